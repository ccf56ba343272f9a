"""Argument checks shared by every entry point, with errors that say what to pass."""

from __future__ import annotations

import numpy as np


def check_int(
    value: object, *, name: str, minimum: int | None = None, unit: str = "", fix: str = ""
) -> int:
    """Returns ``value`` as an ``int`` after checking that it is one and at least ``minimum``.

    ``bool`` is not accepted although Python counts it as an ``int``; numpy integers are.

    Args:
      value: what the caller passed.
      name: the argument's name, as the caller spells it.
      minimum: the smallest accepted value, if any.
      unit: what ``minimum`` counts (``"step"``), for the message.
      fix: a sentence appended to the message, saying what to pass instead.

    Raises:
      TypeError: ``value`` is not an int.
      ValueError: ``value`` is smaller than ``minimum``.

    Examples:
        >>> check_int(3, name="num_members", minimum=1)
        3
        >>> check_int(True, name="seed")
        Traceback (most recent call last):
        ...
        TypeError: seed must be an int, got True (bool).
    """
    bound = "" if minimum is None else f" >= {minimum}" + (f" {unit}" if unit else "")
    hint = f" {fix}" if fix else ""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(
            f"{name} must be an int{bound}, got {value!r} ({type(value).__name__}).{hint}"
        )
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be an int{bound}, got {value!r}.{hint}")
    return int(value)
