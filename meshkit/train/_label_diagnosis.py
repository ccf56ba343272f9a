"""Why a step's loss was not finite, when the reason is a label or a token id: found after the fact.

meshkit's losses give a NaN for a label that is no class, so a bad label costs the
step nothing to detect: ``fit`` stops on the non-finite loss. Sources check their
labels as they read them when they know the class count, but a source that does not
(no ``num_classes``), or a transform that maps labels out of range after the check,
lets such a label through. When ``fit`` stops, it reads that step's batch again (the
pipeline is deterministic) and looks for labels outside the model's classes, so the
error can name the label, its row and the example it came from. Token ids outside a
language model's vocabulary (``meshkit.models.Transformer`` gives NaN for them under
``jax.jit``, where it cannot raise) are found the same way, with their position.
Nothing of this runs while training goes well.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import numpy as np

from meshkit.data._labels import LABEL_FIELD

IMAGE_FIELD = "image"


TOKENS_FIELD = "tokens"


def labels_outside_classes(state: Any, pipeline: Any, data_step: int) -> str | None:
    """A sentence naming the first label of ``data_step``'s batch (this process's rows)
    that is no class of the model, or the first token id outside its vocabulary; ``None``
    when there is none (or the batch has neither field, or the check cannot tell)."""
    with contextlib.suppress(Exception):  # a diagnosis must never hide the real error
        batch = pipeline.local_batch(data_step)  # read (and transformed) once, for both
        if not isinstance(batch, dict):
            return None
        return _labels(state, pipeline, data_step, batch) or _tokens(
            state, pipeline, data_step, batch
        )
    return None


def _integer_field(batch: dict[str, Any], field: str, ndim: int) -> np.ndarray | None:
    """``batch[field]`` when it is a non-empty integer array of ``ndim`` dimensions."""
    if field not in batch:
        return None
    values = np.asarray(batch[field])
    integer = np.issubdtype(values.dtype, np.integer)
    return values if values.ndim == ndim and integer and values.size else None


def _tokens(state: Any, pipeline: Any, data_step: int, batch: dict[str, Any]) -> str | None:
    tokens = _integer_field(batch, TOKENS_FIELD, ndim=2)
    if tokens is None:
        return None
    vocabulary = _model_width(state, jax.ShapeDtypeStruct((1, 1), tokens.dtype), rank=3)
    bad = tokens < 0
    if vocabulary is not None:
        bad |= tokens >= vocabulary
    if not bad.any():
        return None
    row, position = (int(i) for i in np.argwhere(bad)[0])
    within, index = _where(pipeline, data_step, row)
    expected = f"[0, {vocabulary}), the model's vocabulary" if vocabulary else "[0, vocabulary)"
    return (
        f"The batch of that step holds token ids outside {expected}: {int(bad.sum())} of "
        f"this process's {tokens.size} ids. The first is id {int(tokens[row, position])} at "
        f"position {position} of row {within} of the global batch, source index {index} of "
        f"{type(pipeline.source).__name__}. Check the tokenizer (or the transform that makes "
        "the ids), or build the model with a vocabulary that covers every id."
    )


def _where(pipeline: Any, data_step: int, row: int) -> tuple[int, int]:
    """Row ``row`` of this process's part of ``data_step``'s batch: its row in the global
    batch and its source index."""
    shard = pipeline.shard
    _, global_position, index = pipeline._locate(data_step * shard.size + row)  # pyright: ignore[reportPrivateUsage]
    return global_position % pipeline.global_batch_size, index


def _labels(state: Any, pipeline: Any, data_step: int, batch: dict[str, Any]) -> str | None:
    labels = _integer_field(batch, LABEL_FIELD, ndim=1)
    if labels is None:
        return None
    classes = _model_classes(state, batch.get(IMAGE_FIELD))
    bad = labels < 0
    if classes is not None:
        bad |= labels >= classes
    ignore = getattr(pipeline.source, "ignore_label", None)
    if ignore is not None:
        bad &= labels != ignore
    if not bad.any():
        return None
    row = int(np.argmax(bad))
    within, index = _where(pipeline, data_step, row)
    locate = getattr(pipeline.source, "locate", None)
    stored = f": {locate(index)}" if callable(locate) else ""
    expected = f"[0, {classes}), the model's classes" if classes is not None else "[0, classes)"
    return (
        f"The batch of that step holds labels outside {expected}: {int(bad.sum())} of "
        f"this process's {labels.size} rows. The first is label {int(labels[row])} at row "
        f"{within} of the global batch, source index {index} of "
        f"{type(pipeline.source).__name__}{stored}. Fix that label (or the transform that "
        "makes it), or give the source num_classes= so labels are checked as they are read."
    )


def _model_classes(state: Any, images: Any) -> int | None:
    """The width of the model's output on one example: its class count."""
    if images is None:
        return None
    one = jax.ShapeDtypeStruct((1, *np.shape(images)[1:]), np.asarray(images).dtype)
    return _model_width(state, one, rank=2)


def _model_width(state: Any, one: jax.ShapeDtypeStruct, *, rank: int) -> int | None:
    """The last dimension of the model's output on ``one`` when the output has ``rank``
    dimensions (classes, or a language model's vocabulary); abstract: no compile, no
    device work."""
    if not hasattr(state, "apply_fn"):
        return None
    from meshkit.train._step import apply_model

    logits, _ = jax.eval_shape(apply_model, state, one)
    dims = list(getattr(logits, "shape", ()))
    return int(dims[-1]) if len(dims) == rank else None
