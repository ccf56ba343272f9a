"""Byte-level text data that needs no download: the Python reference's topic texts.

Every CPython install ships ``pydoc_data/topics.py``, the text ``help("assert")``,
``help("with")`` and the other keyword and topic pages print: about 465,000
characters of English prose on the Python language, extracted from its reference
manual, with code examples between the paragraphs. It is the only sizeable body of
natural-language text that every Python has, so a language model can train on it
offline, on any machine. Its exact content differs a little between Python versions
(3.11.7: 466,273 bytes), so losses do too, at the second decimal.
"""

from __future__ import annotations

import functools
from typing import Literal

import numpy as np

from meshkit._checks import check_int
from meshkit.data._source import ArraySource

TOKENS_FIELD = "tokens"
"""The field of a text window: ``int32[length + 1]`` byte values (inputs and next bytes)."""


@functools.cache
def reference_text_bytes() -> bytes:
    """The Python reference's topic texts, in topic-name order, as UTF-8 bytes.

    The topics are joined by a blank line. In Python 3.11.7 the text is ASCII apart from
    575 characters (curly quotes, dashes, ellipses) that take 1,722 bytes: 466,273 bytes
    for 465,126 characters, so bits per byte and bits per character differ by 0.25%.

    Examples:
        >>> reference_text_bytes()[:22]
        b'The "assert" statement'
    """
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics)).encode("utf-8")


def text_windows(data: bytes, length: int, *, name: str = "text") -> ArraySource:
    """Non-overlapping windows of ``length + 1`` bytes: ``{"tokens": int32[length + 1]}``.

    Window ``i`` starts at byte ``i * length``: a model reads ``tokens[:-1]`` and
    predicts ``tokens[1:]``, so every byte after the first is a target exactly once.
    The bytes after the last whole window are left out (fewer than ``length``).

    Args:
        data: the text, as bytes (encode a ``str`` with ``.encode("utf-8")``).
        length: the context length a model sees.
        name: names the data in the source's fingerprint and ``repr``.

    Raises:
        ValueError: ``length`` is not a positive integer, or ``data`` is shorter
            than one window.

    Examples:
        >>> source = text_windows(b"abcdefg", 3)
        >>> len(source), source[1]["tokens"].tolist()
        (2, [100, 101, 102, 103])
    """
    check_int(length, name="length", minimum=1)
    count = (len(data) - 1) // length
    if count < 1:
        raise ValueError(
            f"text_windows got {len(data)} bytes, fewer than one window of length + 1 = "
            f"{length + 1}. Pass more text or a smaller length."
        )
    bytes_N = np.frombuffer(data, np.uint8)
    starts_W = np.arange(count) * length
    tokens_WxL = bytes_N[starts_W[:, None] + np.arange(length + 1)].astype(np.int32)
    return ArraySource({TOKENS_FIELD: tokens_WxL}, name=name)


def reference_text(
    split: Literal["train", "test"], *, length: int = 128, held_out: float = 0.1
) -> ArraySource:
    """Byte windows of the Python reference's topic texts (``reference_text_bytes``).

    The last ``held_out`` of the bytes are the ``"test"`` split, the rest ``"train"``;
    each part is cut into windows on its own (``text_windows``), so no test byte is
    ever a training input or target. Token values are bytes, so a model needs a
    vocabulary of 256.

    Args:
        split: ``"train"`` or ``"test"``.
        length: the context length (each window holds ``length + 1`` bytes).
        held_out: the fraction of the text kept for ``"test"``, in (0, 1).

    Raises:
        ValueError: an argument is outside the values above.

    Examples:
        >>> train, test = reference_text("train"), reference_text("test")
        >>> train[0]["tokens"].shape, len(train) > 8 * len(test) > 0
        ((129,), True)
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test'; got {split!r}.")
    if not 0 < held_out < 1:
        raise ValueError(f"held_out must be a fraction in (0, 1), e.g. 0.1; got {held_out!r}.")
    data = reference_text_bytes()
    cut = len(data) - int(len(data) * held_out)
    part = data[:cut] if split == "train" else data[cut:]
    return text_windows(part, length, name=f"python_reference_{split}_{length}")


def decode_bytes(tokens: np.ndarray) -> str:
    """Byte tokens back to text; bytes that are not valid UTF-8 become U+FFFD.

    Examples:
        >>> decode_bytes(np.array([104, 105]))
        'hi'
    """
    return np.asarray(tokens, np.uint8).tobytes().decode("utf-8", errors="replace")
