"""LLaMA-family checkpoints in the layout of Hugging Face transformers, in and out.

A checkpoint folder of that layout holds ``config.json`` and the weights in
``model.safetensors``, or in shards ``model-0000X-of-0000N.safetensors`` named by
``model.safetensors.index.json``. Reading places every tensor straight into the
sharding of the parameter it becomes: each process reads only the slices its own
devices hold (``_safetensors``), so no process ever holds the whole model.
Writing gathers one tensor at a time and writes the shards from process 0.

A parameter of meshkit's ``Transformer`` is its tensor in the checkpoint, reshaped
and transposed (``_Layout``): ``q_proj.weight`` ``[heads * kv, embed]`` is
``query/kernel`` ``[embed, heads, kv]``, a linear layer's ``[out, in]`` weight is a
``[in, out]`` kernel, norms and the embedding are as they are. Both sides rotate the
two halves of each head's width (transformers' ``rotate_half``), so the weights need
no permutation.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from meshkit.models._safetensors import SafetensorsFile, Tensor, spans
from meshkit.models._transformer import RopeScaling, Transformer

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How a checkpoint tensor becomes a parameter: its dimensions split into the
    parameter's (``groups``: the parameter's dimensions, in the tensor's order, that
    each tensor dimension holds, outer first), then put in the parameter's order
    (``order``: the split dimension each parameter dimension is)."""

    groups: tuple[tuple[int, ...], ...]
    order: tuple[int, ...]


_SAME_1 = _Layout(((0,),), (0,))
_SAME_2 = _Layout(((0,), (1,)), (0, 1))
_DENSE = _Layout(((0,), (1,)), (1, 0))  # [out, in] -> [in, out]
_HEADS_OUT = _Layout(((0, 1), (2,)), (2, 0, 1))  # [heads * kv, embed] -> [embed, heads, kv]
_HEADS_IN = _Layout(((0,), (1, 2)), (1, 2, 0))  # [embed, heads * kv] -> [heads, kv, embed]

_BLOCK = {
    ("attention", "query", "kernel"): ("self_attn.q_proj.weight", _HEADS_OUT),
    ("attention", "key", "kernel"): ("self_attn.k_proj.weight", _HEADS_OUT),
    ("attention", "value", "kernel"): ("self_attn.v_proj.weight", _HEADS_OUT),
    ("attention", "out", "kernel"): ("self_attn.o_proj.weight", _HEADS_IN),
    ("mlp", "gate", "kernel"): ("mlp.gate_proj.weight", _DENSE),
    ("mlp", "up", "kernel"): ("mlp.up_proj.weight", _DENSE),
    ("mlp", "down", "kernel"): ("mlp.down_proj.weight", _DENSE),
    ("attention_norm", "scale"): ("input_layernorm.weight", _SAME_1),
    ("mlp_norm", "scale"): ("post_attention_layernorm.weight", _SAME_1),
}
_TOP = {
    ("embed", "embedding"): ("model.embed_tokens.weight", _SAME_2),
    ("final_norm", "scale"): ("model.norm.weight", _SAME_1),
    ("head", "kernel"): ("lm_head.weight", _DENSE),
}
_IGNORED = ("rotary_emb.inv_freq",)  # a buffer some older checkpoints carry


def read_config(path: str | Path) -> dict[str, Any]:
    """``config.json`` of a checkpoint folder (or the file itself)."""
    path = Path(path)
    file = path / CONFIG if path.is_dir() else path
    if not file.exists():
        raise FileNotFoundError(
            f"{file} not found: a checkpoint in the transformers layout has a config.json "
            "beside its model.safetensors (pass the folder that holds both)."
        )
    return json.loads(file.read_text())


def llama_from_hf(config: str | Path | Mapping[str, Any], **overrides: Any) -> Transformer:
    """The ``Transformer`` of a Llama-family checkpoint in the transformers layout.

    ``config`` is the checkpoint folder, its ``config.json``, or that file's contents.
    Llama 2, Llama 3 and 3.1 (RoPE scaling of type ``"llama3"``), 3.2 (tied
    embeddings), grouped key and value heads, and Mistral-style configurations without
    a sliding window are read; anything else (another architecture, biases, another
    activation or rope type, a sliding window, a head width other than ``hidden_size
    / num_attention_heads``) is refused naming the field. The parameters' dtype is the
    checkpoint's; ``overrides`` replace any field (``param_dtype=jnp.float32`` to read
    a bfloat16 checkpoint in float32, ``max_length``, ``remat``, ``scan_layers``...).

    Examples:
        >>> model = llama_from_hf({"architectures": ["LlamaForCausalLM"],
        ...     "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        ...     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        ...     "max_position_embeddings": 32, "rms_norm_eps": 1e-6, "rope_theta": 1e4})
        >>> model.num_kv_heads, model.norm_epsilon, model.tie_embeddings
        (2, 1e-06, False)
    """
    if not isinstance(config, Mapping):
        config = read_config(config)
    return Transformer(**{**transformer_fields(config), **overrides})


def transformer_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``Transformer`` fields of a transformers ``config.json`` (see ``llama_from_hf``)."""
    architectures = config.get("architectures") or [f"{config.get('model_type')!s} model"]
    if not set(architectures) <= set(ARCHITECTURES):
        raise ValueError(
            f"config.json: architectures {architectures} is not a Llama-family causal "
            f"language model; meshkit reads {', '.join(ARCHITECTURES)}."
        )
    refused = {
        "attention_bias": config.get("attention_bias", False),
        "mlp_bias": config.get("mlp_bias", False),
        "sliding_window": config.get("sliding_window"),
    }
    for name, value in refused.items():
        if value:
            raise ValueError(
                f"config.json: {name}={value!r} is not supported: meshkit's LLaMA has no "
                "biases and attends to every earlier position."
            )
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(
            f"config.json: hidden_act={config['hidden_act']!r} is not supported: the "
            "LLaMA MLP is SwiGLU (hidden_act 'silu')."
        )
    width, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim")
    if head_dim is not None and (not isinstance(head_dim, int) or head_dim < 1):
        raise ValueError(f"config.json: head_dim={head_dim!r} is not a positive integer.")
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    if dtype not in DTYPES:
        raise ValueError(f"config.json: dtype {dtype!r} is not one of {sorted(DTYPES)}.")
    base, scaling = _rope(config)
    return {
        "vocab_size": config["vocab_size"],
        "num_layers": config["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": config.get("num_key_value_heads", heads),
        "embed_dim": width,
        "mlp_dim": config["intermediate_size"],
        "max_length": config.get("max_position_embeddings", 4096),
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "positions": "rope",
        "norm": "rms",
        "mlp": "swiglu",
        "use_bias": False,
        "rope_base": base,
        "rope_scaling": scaling,
        "norm_epsilon": float(config.get("rms_norm_eps", 1e-6)),
        "param_dtype": DTYPES[dtype],
        # heads narrower or wider than the model (Mistral NeMo); None where they split it
        "head_dim": head_dim if head_dim is not None and head_dim * heads != width else None,
    }


def _rope(config: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """The rotary base and scaling of a config: ``rope_parameters`` (transformers 5),
    or ``rope_theta`` and ``rope_scaling`` (earlier releases)."""
    field = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    parameters = config.get(field) or {}
    base = float(parameters.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind == "default":
        return base, None
    if kind != "llama3":
        raise ValueError(
            f"config.json: {field} of type {kind!r} is not supported; meshkit reads the "
            "'default' and 'llama3' rope types."
        )
    return base, RopeScaling(
        factor=float(parameters["factor"]),
        low_freq_factor=float(parameters["low_freq_factor"]),
        high_freq_factor=float(parameters["high_freq_factor"]),
        original_max_length=int(parameters["original_max_position_embeddings"]),
    )


def _tensor_names(params: Mapping[str, Any]) -> Iterator[tuple[tuple[Any, ...], str, _Layout]]:
    """Each parameter's path in ``params``, and its tensor name and layout in the
    checkpoint (``{layer}`` standing for the layer of a scanned model's first axis)."""
    for top, (name, layout) in _TOP.items():
        if top[0] in params:
            yield top, name, layout
    if "layers" in params:
        for inner, (name, layout) in _BLOCK.items():
            yield ("layers", *inner), f"model.layers.{{layer}}.{name}", layout
    for key in params:
        if key.startswith("block_"):
            layer = int(key.removeprefix("block_"))
            for inner, (name, layout) in _BLOCK.items():
                yield (key, *inner), f"model.layers.{layer}.{name}", layout


def _get(tree: Mapping[str, Any], path: tuple[Any, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


class _Checkpoint:
    """The safetensors files of a checkpoint folder, opened as needed, by tensor name."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._handles: dict[str, SafetensorsFile] = {}
        if (folder / INDEX).exists():
            self.files = dict(json.loads((folder / INDEX).read_text())["weight_map"])
        elif (folder / SINGLE).exists():
            self.files = dict.fromkeys(self._opened(SINGLE).tensors, SINGLE)
        else:
            raise FileNotFoundError(
                f"{folder} holds neither {SINGLE} nor {INDEX}: not a checkpoint in the "
                "transformers layout (safetensors weights)."
            )

    def tensor(self, name: str) -> Tensor:
        return self._opened(self.files[name]).tensors[name]

    def read(self, name: str, region: tuple[slice, ...]) -> np.ndarray:
        return self._opened(self.files[name]).read(name, region)

    def _opened(self, file: str) -> SafetensorsFile:
        if file not in self._handles:
            self._handles[file] = SafetensorsFile(self.folder / file)
        return self._handles[file]

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()


def _split_shape(shape: tuple[int, ...], layout: _Layout) -> tuple[int, ...]:
    """The tensor's dimensions split into the parameter's, in the tensor's order."""
    split = [0] * len(layout.order)
    for position, dimension in enumerate(layout.order):
        split[dimension] = shape[position]
    return tuple(split)


def _tensor_shape(shape: tuple[int, ...], layout: _Layout) -> tuple[int, ...]:
    split = _split_shape(shape, layout)
    return tuple(math.prod(split[d] for d in group) for group in layout.groups)


def _read_region(
    checkpoint: _Checkpoint,
    name: str,
    layout: _Layout,
    shape: tuple[int, ...],
    index: tuple[slice, ...],
) -> np.ndarray:
    """The part ``index`` of a parameter of ``shape``, read from tensor ``name``: whole
    inner dimensions of a merged tensor dimension, then cut."""
    split = _split_shape(shape, layout)
    wanted = [slice(None)] * len(split)
    for position, dimension in enumerate(layout.order):
        wanted[dimension] = index[position]
    bounds = spans(tuple(wanted), split)
    region, cut = [], []
    for group in layout.groups:
        outer, inner = group[0], group[1:]
        size = math.prod(split[d] for d in inner)
        start, stop = bounds[outer]
        region.append(slice(start * size, stop * size))
        cut.append(slice(None))
        cut += [slice(*bounds[d]) for d in inner]
    block = checkpoint.read(name, tuple(region))
    block = block.reshape(
        [bounds[d][1] - bounds[d][0] if d == g[0] else split[d] for g in layout.groups for d in g]
    )
    return np.transpose(block[tuple(cut)], layout.order)


def load_hf_params(path: str | Path, params: Any, *, cast: bool = False) -> Any:
    """The parameters of a Llama-family checkpoint (transformers layout), placed like
    ``params``.

    ``params`` is the parameter tree of a ``Transformer`` made by ``llama_from_hf`` (or
    one of the same shapes), as arrays or as ``jax.ShapeDtypeStruct`` with shardings:
    typically ``state.params`` of ``train.create_train_state``, under any layout. Each
    parameter is built with ``jax.make_array_from_callback`` in its sharding, each
    process reading once the part of each tensor that holds its own devices' slices
    (its share, where they are adjacent), with positioned reads in bounded blocks:
    besides what the devices hold, host memory holds that part of one parameter at a
    time. A tensor whose dtype differs from its parameter's is an
    error unless ``cast`` asks to convert it (a float32 model from a bfloat16
    checkpoint: ``llama_from_hf(folder, param_dtype=jnp.float32)``). A tensor the model
    needs and the checkpoint lacks, a shape that differs, or a tensor the model has no
    place for is an error naming it.

    Examples:
        >>> import jax, jax.numpy as jnp, flax.linen as nn, tempfile
        >>> model = llama_from_hf({"architectures": ["LlamaForCausalLM"],
        ...     "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
        ...     "num_attention_heads": 2, "vocab_size": 32})
        >>> params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))["params"]
        >>> folder = tempfile.mkdtemp()
        >>> written = save_hf_params(params, model, folder)
        >>> again = load_hf_params(folder, params)
        >>> bool(jnp.array_equal(again["block_0"]["mlp"]["up"]["kernel"],
        ...                      params["block_0"]["mlp"]["up"]["kernel"]))
        True
    """
    folder = Path(path)
    checkpoint = _Checkpoint(folder)
    try:
        loaded: dict[str, Any] = {}
        used = set()
        for key, name, layout in _tensor_names(params):
            target = _get(params, key)
            loaded_leaf = _load_leaf(
                checkpoint, name, layout, target, scanned=key[0] == "layers", cast=cast
            )
            used |= {name.format(layer=layer) for layer in range(_layers(target, key))}
            _set(loaded, key, loaded_leaf)
        unused = sorted(n for n in checkpoint.files if n not in used and not n.endswith(_IGNORED))
        tied_head = "lm_head.weight" in unused and "head" not in params
        if tied_head:  # a tied model's file may carry the embedding twice
            unused.remove("lm_head.weight")
        if unused:
            raise ValueError(
                f"{folder}: the checkpoint holds tensors the model has no place for: "
                f"{unused[:5]}{' ...' if len(unused) > 5 else ''}; is its config.json the "
                "one these weights were saved with?"
            )
        return loaded
    finally:
        checkpoint.close()


def _layers(target: Any, key: tuple[Any, ...]) -> int:
    return target.shape[0] if key[0] == "layers" else 1


def _load_leaf(
    checkpoint: _Checkpoint, name: str, layout: _Layout, target: Any, *, scanned: bool, cast: bool
) -> jax.Array:
    """One parameter, built in ``target``'s sharding from its tensor (one per layer when
    ``scanned``: the parameter's first axis)."""
    shape = tuple(target.shape[1:] if scanned else target.shape)
    expected = _tensor_shape(shape, layout)
    layers = target.shape[0] if scanned else 1
    for layer in range(layers):
        tensor = name.format(layer=layer)
        if tensor not in checkpoint.files:
            raise ValueError(
                f"{checkpoint.folder}: the checkpoint has no tensor {tensor!r}, which the "
                "model needs; is its config.json the one these weights were saved with?"
            )
        found = checkpoint.tensor(tensor)
        if found.shape != expected:
            raise ValueError(
                f"{checkpoint.folder}: tensor {tensor!r} has shape {found.shape}, "
                f"but the model's parameter needs {expected}; is its config.json the one "
                "these weights were saved with?"
            )
        if found.dtype != target.dtype and not cast:
            raise ValueError(
                f"{checkpoint.folder / checkpoint.files[tensor]}: tensor {tensor!r} is "
                f"{found.dtype}, the model's parameter {np.dtype(target.dtype)}; pass "
                "cast=True to convert it, or build the model in the checkpoint's dtype "
                "(llama_from_hf's default)."
            )
    # This process's devices' slices lie in one box (most often its share), read once
    # when the first device asks for it: each byte read once however many devices hold it.
    held = target.sharding.addressable_devices_indices_map(target.shape).values()
    held_spans = np.asarray([spans(index, target.shape) for index in held])
    low, high = held_spans[:, :, 0].min(axis=0), held_spans[:, :, 1].max(axis=0)
    box: list[np.ndarray] = []

    def region(index: Any) -> np.ndarray:
        if not box:
            whole = tuple(slice(int(a), int(b)) for a, b in zip(low, high, strict=True))
            if scanned:
                value = np.stack(
                    [
                        _read_region(checkpoint, name.format(layer=k), layout, shape, whole[1:])
                        for k in range(*whole[0].indices(layers))
                    ]
                )
            else:
                value = _read_region(checkpoint, name, layout, shape, whole)
            box.append(value.astype(np.dtype(target.dtype), copy=False))
        bounds = spans(index, target.shape)
        return box[0][tuple(slice(a - o, b - o) for (a, b), o in zip(bounds, low, strict=True))]

    return jax.make_array_from_callback(tuple(target.shape), target.sharding, region)


def _hf_config(model: Transformer, dtype: Any) -> dict[str, Any]:
    """The transformers ``config.json`` of ``model`` (a ``LlamaForCausalLM``)."""
    if (model.positions, model.norm, model.mlp, model.use_bias) != ("rope", "rms", "swiglu", False):
        raise ValueError(
            "save_hf_params writes the LLaMA architecture: a Transformer with "
            "positions='rope', norm='rms', mlp='swiglu' and use_bias=False (as "
            "llama(...) and llama_from_hf(...) build); this one has positions="
            f"{model.positions!r}, norm={model.norm!r}, mlp={model.mlp!r}, "
            f"use_bias={model.use_bias}."
        )
    name = {np.dtype(v): k for k, v in DTYPES.items()}[np.dtype(dtype)]
    rope: dict[str, Any] = {"rope_theta": model.rope_base, "rope_type": "default"}
    if model.rope_scaling is not None:
        scaling = model.rope_scaling
        rope.update(
            rope_type="llama3",
            factor=scaling.factor,
            low_freq_factor=scaling.low_freq_factor,
            high_freq_factor=scaling.high_freq_factor,
            original_max_position_embeddings=scaling.original_max_length,
        )
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": model.vocab_size,
        "hidden_size": model.embed_dim,
        "intermediate_size": model.mlp_dim,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.num_kv_heads or model.num_heads,
        "head_dim": model.head_width,
        "max_position_embeddings": model.max_length,
        "rms_norm_eps": 1e-5 if model.norm_epsilon is None else model.norm_epsilon,
        "rope_theta": model.rope_base,
        "rope_parameters": rope,
        "tie_word_embeddings": model.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "dtype": name,
    }


def save_hf_params(
    params: Any,
    model: Transformer,
    path: str | Path,
    *,
    max_shard_bytes: int = 5 * 2**30,
    dtype: Any = None,
) -> list[Path]:
    """Writes ``params`` of the LLaMA ``model`` as a transformers checkpoint folder.

    ``config.json``, and the weights in ``model.safetensors``, or, past
    ``max_shard_bytes``, in shards ``model-0000X-of-0000N.safetensors`` with their
    ``model.safetensors.index.json``; ``transformers.AutoModelForCausalLM
    .from_pretrained(path)`` reads it. ``dtype`` casts the weights (default: the
    parameters'). Each tensor is gathered on its own; process 0 writes, holding at
    most one shard's tensors. Every process must call it (the gathers are
    collectives). Returns the files written (on process 0; an empty list elsewhere).
    """
    from safetensors.numpy import save_file

    folder = Path(path)
    names = list(_tensor_names(params))
    first = _get(params, names[0][0])
    dtype = np.dtype(dtype if dtype is not None else first.dtype)
    tensors: list[tuple[str, tuple[Any, ...], int | None, _Layout, int]] = []
    for key, name, layout in names:
        leaf = _get(params, key)
        scanned = key[0] == "layers"
        shape = tuple(leaf.shape[1:] if scanned else leaf.shape)
        size = math.prod(shape) * dtype.itemsize
        for layer in range(leaf.shape[0] if scanned else 1):
            tensors.append(
                (name.format(layer=layer), key, layer if scanned else None, layout, size)
            )
    shards: list[list[int]] = [[]]
    used = 0
    for position, (*_, size) in enumerate(tensors):
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(position)
        used += size
    files = (
        [SINGLE]
        if len(shards) == 1
        else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    )
    writer = jax.process_index() == 0
    if writer:
        folder.mkdir(parents=True, exist_ok=True)
        config = _hf_config(model, dtype)
        (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    written = [folder / CONFIG] if writer else []
    weight_map: dict[str, str] = {}
    for file, members in zip(files, shards, strict=True):
        arrays = {}
        for position in members:
            name, key, layer, layout, _ = tensors[position]
            leaf = _get(params, key)
            value = _host(leaf if layer is None else leaf[layer])
            split = value.transpose(np.argsort(layout.order))
            arrays[name] = np.ascontiguousarray(
                split.reshape(_tensor_shape(value.shape, layout)).astype(dtype)
            )
            weight_map[name] = file
        if writer:
            save_file(arrays, str(folder / file), metadata={"format": "pt"})
            written.append(folder / file)
    if writer and len(files) > 1:
        total = sum(size for *_, size in tensors)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        written.append(folder / INDEX)
    return written


def _host(value: Any) -> np.ndarray:
    """``value`` whole on this host: gathered from every process where it is spread."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(value, tiled=True))
    return np.asarray(value)
