"""Label checks shared by every source: integer class indices in ``[0, num_classes)``.

A label of -1 indexes the last logit and one of ``num_classes`` or more gives NaN
losses: neither fails where it happens. Sources check the field named ``"label"`` when
they are built (in-memory arrays) or as they decode it (files read record by record),
and raise naming the source, the value, its index and the fix.
"""

from __future__ import annotations

import numpy as np

from meshkit._checks import check_int

LABEL_FIELD = "label"
"""The field every source checks, and meshkit's losses read."""


def check_label_options(
    num_classes: object, ignore_label: object, *, where: str
) -> tuple[int | None, int | None]:
    """Validates ``num_classes`` and ``ignore_label`` and returns them as ints (or ``None``).

    Args:
      num_classes: the number of classes, or ``None`` when the source does not know it.
      ignore_label: a label value admitted besides the classes, or ``None``; it must
        not be a class itself (a negative value, or one at least ``num_classes``).
      where: the source, for the message.

    Raises:
      TypeError: either is not an int (or ``None``).
      ValueError: ``num_classes < 1``, or ``ignore_label`` could be a class.

    Examples:
        >>> check_label_options(10, -1, where="ArraySource")
        (10, -1)
        >>> try:
        ...     check_label_options(10, 3, where="ArraySource")
        ... except ValueError as error:
        ...     print(error)
        ArraySource: ignore_label=3 is one of the classes [0, 10); pass a value outside them.
    """
    if num_classes is not None:
        num_classes = check_int(num_classes, name="num_classes", minimum=1)
    if ignore_label is not None:
        ignore_label = check_int(ignore_label, name="ignore_label")
        if ignore_label >= 0 and num_classes is None:
            raise ValueError(
                f"{where}: ignore_label={ignore_label} cannot be told apart from a class "
                "without num_classes; pass num_classes too, or a negative ignore_label."
            )
        if num_classes is not None and 0 <= ignore_label < num_classes:
            raise ValueError(
                f"{where}: ignore_label={ignore_label} is one of the classes "
                f"[0, {num_classes}); pass a value outside them."
            )
    return num_classes, ignore_label


def check_label_dtype(dtype: np.dtype, *, where: str) -> None:
    """Raises unless ``dtype`` is an integer dtype (``bool`` is not one).

    Examples:
        >>> try:
        ...     check_label_dtype(np.dtype(np.float32), where="ArraySource 'arrays'")
        ... except ValueError as error:
        ...     print(str(error).split(";")[0])
        ArraySource 'arrays': field 'label' has dtype float32
    """
    if not np.issubdtype(dtype, np.integer):
        raise ValueError(
            f"{where}: field {LABEL_FIELD!r} has dtype {dtype}; expected integer class "
            "indices. Convert them with labels.astype(np.int32), or name the field "
            "differently if it does not hold class labels (e.g. 'target')."
        )


def check_labels(
    labels_N: np.ndarray,
    *,
    where: str,
    num_classes: int | None,
    ignore_label: int | None = None,
    indices: np.ndarray | None = None,
    item: str = "index",
) -> None:
    """Raises on the first label outside ``[0, num_classes)`` that is not ``ignore_label``.

    Without ``num_classes`` only negative labels are refused. When every label is a
    class the check is one min and one max; the offending row is searched for only on
    failure.

    Args:
      labels_N: integer labels, one row (of any trailing shape) per example.
      where: the source, for the message (a file path or ``"ArraySource 'name'"``).
      num_classes: the number of classes, or ``None`` if the source does not know it.
      ignore_label: a value admitted besides the classes, or ``None``.
      indices: the source index of each row (default: ``0, 1, ...``).
      item: what an index counts, for the message (``"index"``, ``"record"``).

    Raises:
      ValueError: the dtype is not an integer one, or a label is out of range; the
        message names ``where``, the value, its index and the fix.

    Examples:
        >>> check_labels(np.array([0, 9, 3]), where="ArraySource", num_classes=10)
        >>> check_labels(np.array([0, -1]), where="x.npz", num_classes=10, ignore_label=-1)
        >>> try:
        ...     check_labels(np.array([4, 10, 3]), where="x.npz", num_classes=10)
        ... except ValueError as error:
        ...     print(str(error).split(". ")[0])
        x.npz: label 10 at index 1 is outside the classes [0, 10) (num_classes=10)
    """
    labels_N = np.atleast_1d(np.asarray(labels_N))
    check_label_dtype(labels_N.dtype, where=where)
    if labels_N.size == 0:
        return
    if labels_N.min() >= 0 and (num_classes is None or labels_N.max() < num_classes):
        return
    bad = labels_N < 0
    if num_classes is not None:
        bad |= labels_N >= num_classes
    if ignore_label is not None:
        bad &= labels_N != ignore_label
    rows = np.flatnonzero(bad.reshape(len(labels_N), -1).any(axis=1))
    if not rows.size:
        return
    row = int(rows[0])
    value = int(np.asarray(labels_N[row])[np.asarray(bad[row])].flat[0])
    index = row if indices is None else int(indices[row])
    raise ValueError(_message(where, value, f"{item} {index}", len(rows), num_classes))


def _message(where: str, value: int, at: str, rows: int, num_classes: int | None) -> str:
    """What is wrong with ``value`` and the ways to fix it."""
    others = f"; {rows - 1} more example(s) here are out of range too" if rows > 1 else ""
    if num_classes is None:
        problem = f"label {value} at {at} is negative{others}"
        fixes = "remap them (np.unique(labels, return_inverse=True)[1]), drop those examples"
        bound = "non-negative class indices"
    else:
        problem = (
            f"label {value} at {at} is outside the classes [0, {num_classes}) "
            f"(num_classes={num_classes}){others}"
        )
        fixes = (
            "remap them (np.unique(labels, return_inverse=True)[1]), drop those examples, "
            "pass the right num_classes"
        )
        bound = f"class indices 0..{num_classes - 1}"
    skip = (
        f"or, if {value} marks examples to skip, pass ignore_label={value} and mask them in "
        "your loss (meshkit's built-in losses skip no label)"
    )
    return f"{where}: {problem}. Labels must be {bound}: {fixes}, {skip}."
