"""Reading a checkpoint written by a pmap-era Flax program into a meshkit train state."""

from __future__ import annotations

import json
import os
import warnings
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from etils import epath
from flax import serialization

from meshkit._host import place_global
from meshkit._paths import as_path, write_text_atomically
from meshkit.train._precision import LossScale
from meshkit.train._state import TrainState

# Flax's DynamicScale fields and the LossScale fields they become.
_DYNAMIC_SCALE = {"scale": "scale", "fin_steps": "good_steps"}


def import_flax_checkpoint(
    path: str | os.PathLike[str],
    state: TrainState,
    *,
    step: int | None = None,
    ignore: Sequence[str] = (),
    digest_file: str | os.PathLike[str] | None = None,
) -> TrainState:
    """``state`` with the values of a checkpoint written by ``flax.training.checkpoints``.

    For programs of the ``pmap`` era, such as Flax's ImageNet and MNIST examples:
    their ``TrainState`` (a ``flax.training.train_state.TrainState``, often with
    ``batch_stats`` and ``dynamic_scale`` fields) was saved with
    ``checkpoints.save_checkpoint``, in Orbax's format or the older msgpack one. Both
    are read, unreplicated (``jax_utils.unreplicate`` before saving, as the examples
    do) or replicated (a leading device axis on every leaf). The checkpoint's
    ``step``, ``params``, ``opt_state``, every collection of ``state`` (``batch_stats``)
    and ``dynamic_scale`` (into ``state.loss_scale``: its ``scale`` and ``fin_steps``)
    replace the state's values, each placed in the sharding of the leaf it replaces;
    the dropout key and everything static stay ``state``'s.

    Build ``state`` with ``create_train_state`` from the same model and optimizer as the
    program that wrote the checkpoint: optimizer states are matched by their structure
    (an optax chain saved as ``{"0": ..., "1": ...}`` or as a tuple), so the optax
    transformation must be the same chain. Continue with
    ``fit(..., num_steps=...)``: it counts on from the imported step.

    A replicated checkpoint's replicas must agree for the step, parameters and
    optimizer state (they did in a ``pmap`` program); batch statistics are averaged
    over the replicas, which is what ``sync_batch_stats`` did before the examples
    evaluated or saved.

    Every process reads the whole checkpoint (as the examples wrote it), so a
    multi-process job calls this on every process with the same path.

    Neither format carries a checksum: a flipped bit in the file imports silently
    different values. ``digest_file`` catches such a change after the first import: the
    first import records a CRC-32 and an Adler-32 of every array the file holds (JSON,
    one entry per content, with the paths it was read from; ``ignore`` changes nothing
    there), and every later import of that path compares against it. An intact copy
    elsewhere is recognised by its content; a copy with other values is warned about.
    (meshkit's own checkpoints carry a digest, so once a run has saved one, resume from
    it rather than importing again.)

    Args:
      path: the directory ``save_checkpoint`` wrote into (the newest
        ``checkpoint_<step>`` in it is read), or one ``checkpoint_<step>`` directory
        or file.
      state: the train state to fill, which fixes structure, shapes and shardings.
      step: read ``checkpoint_<step>`` of the directory instead of the newest.
      ignore: top-level fields or path prefixes (``"epoch"``,
        ``"dynamic_scale"``, ``"params/head"``) of the checkpoint to leave out, and
        of the state to keep as they are.
      digest_file: a JSON file recording what each checkpoint held when first imported
        (written by process 0 then), checked on every later import.

    Raises:
      FileNotFoundError: no checkpoint at ``path``.
      ValueError: paths that do not match, listed (in the checkpoint only, in the
        state only, different shapes), replicas that disagree, or values that differ
        from those ``digest_file`` recorded.

    Examples:
        >>> import tempfile, jax, jax.numpy as jnp, optax, flax.linen as nn, meshkit
        >>> from flax.training import checkpoints, train_state
        >>> from meshkit.train import create_train_state, import_flax_checkpoint, linen_model
        >>> module = nn.Dense(3)
        >>> params = module.init(jax.random.key(7), jnp.ones((1, 2)))["params"]
        >>> old = train_state.TrainState.create(apply_fn=module.apply, params=params,
        ...                                     tx=optax.adam(1e-3))
        >>> workdir = tempfile.mkdtemp()
        >>> _ = checkpoints.save_checkpoint(workdir, old.replace(step=200), step=200)
        >>> state = create_train_state(linen_model(module, jnp.ones((1, 2))),
        ...                            optax.adam(1e-3), meshkit.make_mesh("data=-1"))
        >>> state = import_flax_checkpoint(workdir, state)
        >>> int(state.step), bool((state.params["kernel"] == params["kernel"]).all())
        (200, True)
    """
    # Orbax misreads a relative path (a "pytree structure ... RestoreArgs" error)
    path = str(Path(os.fspath(path)).absolute())
    raw, where = _read(path, step)
    if not isinstance(raw, Mapping):
        raise ValueError(
            f"The checkpoint at {path!r} holds a {type(raw).__name__}, not a train state's "
            "fields (step, params, opt_state, ...)."
        )
    ignored = tuple(prefix.strip("/") for prefix in ignore)
    saved = {
        key: value
        for key, value in _flat(_plain(raw)).items()
        if not _under(key, ignored) and value is not None
    }
    target = _target(state)
    wanted = {key: value for key, value in _flat(target).items() if not _under(key, ignored)}
    replicas = _replicas(saved, wanted)
    _check_match(path, saved, wanted, replicas)
    values = {
        key: _unreplicate(key, np.asarray(saved[key]), replicas, wanted[key]) for key in wanted
    }
    if digest_file is not None:  # all the file holds, whatever this import uses
        every = {key: value for key, value in _flat(_plain(raw)).items() if value is not None}
        _check_digest(digest_file, where, every)
    return _place(_from_target(state, _with_leaves(target, values)), state)


def _host_digest(values: Mapping[str, Any]) -> dict[str, list[int]]:
    """CRC-32 and Adler-32 of each array's bytes, under its path."""
    digest = {}
    for key, value in values.items():
        raw = np.ascontiguousarray(value).tobytes()
        digest[key] = [zlib.crc32(raw), zlib.adler32(raw)]
    return digest


def _check_digest(record: Any, checkpoint: Path, arrays: Mapping[str, Any]) -> None:
    """Checks ``arrays``, everything ``checkpoint`` holds, against ``record``.

    The record holds one entry per content (a CRC-32 and an Adler-32 of each array),
    with the paths it was imported from. A path whose recorded content differs now
    raises; content already recorded under another path (a copy) is fine, and the
    path is added; a checkpoint of the same name and arrays as a recorded one but
    other values, at a new path, is warned about (a damaged copy, or another run's
    checkpoint); anything else is recorded (by process 0).
    """
    digest = _host_digest(arrays)
    here = str(checkpoint.resolve())
    record = as_path(record)
    entries = _read_record(record)
    same = _content_id(digest)
    before = next((e for e in entries.values() if here in e["paths"]), None)
    if before is not None and before["arrays"] != digest:
        differ = sorted(
            k
            for k in before["arrays"].keys() | digest.keys()
            if before["arrays"].get(k) != digest.get(k)
        )
        shown = ", ".join(differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
        raise ValueError(
            f"{checkpoint} no longer holds what its first import read (recorded in {record}): "
            f"{len(differ)} of {len(digest)} arrays differ ({shown}). Its format has no "
            "checksum, so this record is how the change shows: copy the checkpoint again from "
            f"where it was written (a copy anywhere is checked against this record), or "
            f"delete {record} to accept the new values."
        )
    if same not in entries:
        _warn_if_like(entries, checkpoint, digest)
    entry = entries.setdefault(same, {"name": checkpoint.name, "arrays": digest, "paths": []})
    if here in entry["paths"]:
        return
    entry["paths"].append(here)
    if jax.process_index() == 0:
        record.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(record, json.dumps({"checkpoints": entries}, indent=1) + "\n")


def _read_record(record: epath.Path) -> dict[str, dict[str, Any]]:
    """The record's entries by content (an earlier layout, by path, is converted)."""
    if not record.exists():
        return {}
    try:
        held = json.loads(record.read_text())
        if "checkpoints" in held:
            return held["checkpoints"]
        return {  # the earlier layout: {path: {array: [crc, adler]}}
            _content_id(arrays): {"name": Path(path).name, "arrays": arrays, "paths": [path]}
            for path, arrays in held.items()
        }
    except (ValueError, TypeError, AttributeError) as error:
        raise ValueError(
            f"The digest record {record} is damaged ({type(error).__name__}: {error}): "
            "delete it, and the next import records its checkpoint again."
        ) from None


def _content_id(digest: Mapping[str, list[int]]) -> str:
    """One name for a checkpoint's content: a CRC-32 of its arrays' sorted digests."""
    return f"{zlib.crc32(json.dumps(sorted(digest.items())).encode()):08x}"


def _warn_if_like(
    entries: Mapping[str, Mapping[str, Any]], checkpoint: Path, digest: Mapping[str, list[int]]
) -> None:
    for entry in entries.values():
        if entry["name"] == checkpoint.name and entry["arrays"].keys() == digest.keys():
            differ = [k for k in digest if entry["arrays"][k] != digest[k]]
            warnings.warn(
                f"{checkpoint} has the name and arrays of the checkpoint imported from "
                f"{entry['paths'][0]} (recorded in the digest record), but {len(differ)} of "
                f"{len(digest)} arrays hold other values ({', '.join(differ[:3])}): if it is "
                "a copy of that one, the copy is damaged; if it is another run's, ignore this.",
                stacklevel=4,
            )
            return


def _read(path: str, step: int | None) -> tuple[Any, Path]:
    """The checkpoint's tree, arrays as numpy (whatever devices wrote it), and the
    checkpoint read (an Orbax directory or a msgpack file)."""
    from flax.training import checkpoints

    where = Path(path)
    if not _is_checkpoint(where):
        latest = checkpoints.latest_checkpoint(path) if where.is_dir() else None
        chosen = where / f"checkpoint_{step}" if step is not None else latest
        if chosen is None or not Path(chosen).exists():
            found = sorted(p.name for p in where.iterdir())[:10] if where.is_dir() else []
            raise FileNotFoundError(
                f"No flax.training.checkpoints checkpoint at {path!r}"
                + (f" for step={step}" if step is not None else "")
                + f" (it holds {found}). Pass the directory save_checkpoint wrote into, or "
                "one of its checkpoint_<step> entries."
            )
        where = Path(chosen)
    if where.is_file():  # the msgpack format of flax before Orbax
        return _read_msgpack(where, checkpoints), where
    from meshkit.checkpoint._orbax import read_pytree_as_numpy

    return read_pytree_as_numpy(where), where


def _read_msgpack(where: Path, checkpoints: Any) -> Any:
    """A msgpack checkpoint's tree; a file cut short or not msgpack at all is named."""
    size = where.stat().st_size
    try:
        return checkpoints.restore_checkpoint(str(where), target=None)
    except Exception as error:
        cut = "incomplete" in str(error).lower() or size == 0
        what = "is cut short" if cut else "is not a msgpack checkpoint flax can read"
        raise ValueError(
            f"{where} ({size} bytes) {what} ({type(error).__name__}: {error}). Copy it again "
            "from where it was written, or import an earlier checkpoint_<step>."
        ) from None


def _is_checkpoint(path: Path) -> bool:
    """A checkpoint itself (an Orbax directory or a msgpack file), not a directory of them."""
    if path.is_dir():
        return any((path / name).exists() for name in ("_METADATA", "_CHECKPOINT_METADATA"))
    return path.is_file()


def _plain(tree: Any) -> Any:
    """Nested dicts with string keys: tuples and lists become ``{"0": ..., "1": ...}``."""
    if isinstance(tree, Mapping):
        return {str(key): _plain(value) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return {str(i): _plain(value) for i, value in enumerate(tree)}
    return tree


def _flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out |= _flat(value, name + "/")
        else:
            out[name] = value
    return out


def _with_leaves(tree: Mapping[str, Any], values: Mapping[str, Any], prefix: str = "") -> Any:
    """``tree`` (nested dicts) with the leaves named in ``values`` replaced."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out[key] = _with_leaves(value, values, name + "/")
        else:
            out[key] = values.get(name, value)
    return out


def _under(key: str, prefixes: Sequence[str]) -> bool:
    return any(key == prefix or key.startswith(prefix + "/") for prefix in prefixes)


def _target(state: TrainState) -> dict[str, Any]:
    """The state's importable fields, named as the pmap-era ``TrainState`` named them."""
    target: dict[str, Any] = {
        "step": state.step,
        "params": serialization.to_state_dict(state.params),
        "opt_state": serialization.to_state_dict(state.opt_state),
    }
    for name, collection in state.collections.items():
        target[name] = serialization.to_state_dict(collection)
    if state.loss_scale is not None:
        target["dynamic_scale"] = {
            saved: getattr(state.loss_scale, own) for saved, own in _DYNAMIC_SCALE.items()
        }
    return _plain(target)


def _from_target(state: TrainState, filled: Mapping[str, Any]) -> TrainState:
    loss_scale = state.loss_scale
    if loss_scale is not None:
        scale = filled["dynamic_scale"]
        loss_scale = LossScale(
            scale=scale["scale"],
            good_steps=scale["fin_steps"],
            growth_interval=loss_scale.growth_interval,
        )
    return state.replace(
        step=filled["step"],
        params=serialization.from_state_dict(state.params, filled["params"]),
        opt_state=serialization.from_state_dict(state.opt_state, filled["opt_state"]),
        collections={
            name: serialization.from_state_dict(collection, filled[name])
            for name, collection in state.collections.items()
        },
        loss_scale=loss_scale,
    )


def _replicas(saved: Mapping[str, Any], wanted: Mapping[str, Any]) -> int:
    """How many replicas the checkpoint holds (a leading device axis), 0 for none."""
    for key in wanted:  # the step first: its shape is () unreplicated, (devices,) replicated
        if key in saved:
            have, want = np.shape(saved[key]), np.shape(wanted[key])
            return int(have[0]) if len(have) == len(want) + 1 and have[1:] == want else 0
    return 0


def _check_match(
    path: str, saved: Mapping[str, Any], wanted: Mapping[str, Any], replicas: int
) -> None:
    missing = [key for key in wanted if key not in saved]
    extra = [key for key in saved if key not in wanted]
    lead = (replicas,) if replicas else ()
    shapes = [
        f"{key}: checkpoint {tuple(np.shape(saved[key]))}, state "
        f"{lead + tuple(np.shape(wanted[key]))}"
        for key in wanted
        if key in saved and tuple(np.shape(saved[key])) != lead + tuple(np.shape(wanted[key]))
    ]
    if not (missing or extra or shapes):
        return

    def listed(title: str, items: list[str]) -> str:
        shown = "\n    ".join(items[:12])
        more = f"\n    ... and {len(items) - 12} more" if len(items) > 12 else ""
        return f"\n  {title} ({len(items)}):\n    {shown}{more}" if items else ""

    kind = f"replicated over {replicas} devices" if replicas else "unreplicated"
    differing = [line.split(":")[0] for line in shapes] + missing + extra
    advice = []  # only what the differing paths call for
    if any(key.startswith("opt_state") for key in differing):
        advice.append("the optimizer (the same optax chain) of the program that wrote it")
    if any(not key.startswith(("opt_state", "dynamic_scale", "loss_scale")) for key in differing):
        advice.append("its model")
    if any(key.startswith(("dynamic_scale", "loss_scale")) for key in differing):
        advice.append(
            "precision='f16' for a checkpoint with a dynamic_scale (or ignore=['dynamic_scale'])"
        )
    raise ValueError(
        f"The checkpoint at {path!r} ({kind}) does not match the train state:"
        + listed("in the state, not in the checkpoint", missing)
        + listed("in the checkpoint, not in the state", extra)
        + listed("different shapes", shapes)
        + "\nBuild the state with create_train_state from "
        + "; ".join(advice)
        + "; or leave fields out with ignore=[...]."
    )


def _unreplicate(key: str, value: np.ndarray, replicas: int, like: Any) -> np.ndarray:
    dtype = np.dtype(getattr(like, "dtype", value.dtype))
    if not replicas:
        return value.astype(dtype)
    statistics = not key.startswith(("step", "params/", "opt_state/", "dynamic_scale/"))
    if statistics and np.issubdtype(value.dtype, np.floating):
        return value.mean(0).astype(dtype)  # sync_batch_stats
    if not (value == value[:1]).all():
        raise ValueError(
            f"The checkpoint's replicas of {key} differ (it holds {replicas} copies with a "
            "leading device axis, and they should agree). Save the program's state after "
            "jax_utils.unreplicate, or check that it is a replicated pmap state."
        )
    return value[0].astype(dtype)


def _place(imported: TrainState, state: TrainState) -> TrainState:
    def put(value: Any, like: Any) -> Any:
        if value is like:  # not in the checkpoint (the dropout key) or ignored: a copy,
            return place_global(like, like.sharding, copy=True)  # which a step may donate
        return place_global(np.asarray(value), like.sharding)

    return jax.tree.map(put, imported, state)
