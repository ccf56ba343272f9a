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
import os
from collections.abc import Sequence
from typing import Any, Literal

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


EOS_TOKENS = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>")
"""End-of-sequence tokens of the Llama 3, Llama 2 / Mistral, GPT-2 and Gemma vocabularies."""


def token_windows(
    texts: Sequence[str],
    tokenizer: str | os.PathLike[str] | Any,
    length: int,
    *,
    eos_id: int | None = None,
    name: str = "tokens",
) -> ArraySource:
    """Texts tokenized and packed into windows of ``length + 1`` token ids:
    ``{"tokens": int32[length + 1]}``, as ``text_windows`` cuts bytes.

    Each text is a document: they are tokenized in a Grain map (on threads) with
    ``tokenizer`` (a ``tokenizer.json`` of the tokenizers package, or a loaded
    ``tokenizers.Tokenizer``), without the tokenizer's own start tokens, and joined into
    one stream with ``eos_id`` after each. Window ``i`` starts at token ``i * length``, so
    every token after the first is a target exactly once; a window may hold the end of
    one document and the start of the next, the end-of-sequence id between them, and
    positions run on across it (attention is not cut at document ends, as in GPT-style
    packing). The tokens after the last whole window are left out. The windows are an
    ``ArraySource``: a pipeline over them is exact and resumable like any other.

    Args:
        texts: the documents.
        tokenizer: a ``tokenizer.json`` path or a ``tokenizers.Tokenizer``.
        length: the context length a model sees.
        eos_id: the id after each document; by default the tokenizer's own
            end-of-sequence token (one of ``EOS_TOKENS``).
        name: names the data in the source's fingerprint and ``repr``.

    Raises:
        ValueError: no end-of-sequence id known, or fewer tokens than one window.

    Examples:
        >>> from tokenizers import Tokenizer, models, pre_tokenizers
        >>> tokenizer = Tokenizer(models.WordLevel({"a": 0, "b": 1, "</s>": 2}, unk_token="a"))
        >>> tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        >>> source = token_windows(["a b", "b b a"], tokenizer, 3)  # 0 1 2 | 1 1 0 2
        >>> len(source), source[0]["tokens"].tolist(), source[1]["tokens"].tolist()
        (2, [0, 1, 2, 1], [1, 1, 0, 2])
    """
    import grain
    from tokenizers import Tokenizer

    check_int(length, name="length", minimum=1)
    if not isinstance(tokenizer, Tokenizer):
        tokenizer = Tokenizer.from_file(os.fspath(tokenizer))
    if eos_id is None:
        found = [tokenizer.token_to_id(token) for token in EOS_TOKENS]
        eos_id = next((i for i in found if i is not None), None)
        if eos_id is None:
            raise ValueError(
                f"The tokenizer has none of the end-of-sequence tokens {list(EOS_TOKENS)}: "
                "pass eos_id=, the id to put after each document."
            )

    def encode(text: str) -> np.ndarray:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        return np.asarray([*ids, eos_id], np.int32)

    documents = grain.MapDataset.source(list(texts)).map(encode)
    options = grain.ReadOptions(num_threads=min(16, os.cpu_count() or 1), prefetch_buffer_size=64)
    stream_N = np.concatenate([np.zeros(0, np.int32), *documents.to_iter_dataset(options)])
    count = (len(stream_N) - 1) // length
    if count < 1:
        raise ValueError(
            f"token_windows got {len(stream_N)} tokens, fewer than one window of length + 1 "
            f"= {length + 1}. Pass more text or a smaller length."
        )
    starts_W = np.arange(count) * length
    tokens_WxL = stream_N[starts_W[:, None] + np.arange(length + 1)]
    return ArraySource({TOKENS_FIELD: tokens_WxL}, name=name)
