"""What one Transformer layer keeps for its backward pass, per compiler, against a count.

    python -m benchmarks activations      # or: nox -s bench

One GPT layer (s = 2048, h = 1024, a = 8 heads, one sequence per chip, bf16 compute, no
remat, no dropout) measured two ways on each compiler installed (XLA:CPU always;
XLA:TPU for a v5e:2x2 slice with ``pip install "meshkit[tpu]"``, XLA:GPU for H100s
with ``pip install "meshkit[gpu-plan]"``):

- **bare layer**: the temporaries of the gradient of a stack of layers (the blocks
  alone: no embedding, loss or optimizer), 4 layers less 2, halved;
- **train step**: the planner's own measurement of the whole train step of the GPT,
  4 layers less 2, halved; what 2 layers' step holds beyond twice that is the step's
  other temporaries (logits, loss, the optimizer's update), shown apart.

The count is Korthikanti et al.'s without dropout, with the softmax in the dtype the
attention keeps it in (``korthikanti_activation_bytes``): XLA's attention keeps a
float32 softmax (``32·s·b·h + 4·a·s²·b`` bytes), the Pallas flash kernel none
(``32·s·b·h``). Depths of 2 and 4 rather than 1 and 3: a one-layer program is small
enough that the TPU compiler keeps part of it in on-chip memory.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from benchmarks._harness import save
from benchmarks.quoted import markdown_table

LENGTH, WIDTH, HEADS = 2048, 1024, 8
DEPTHS = (2, 4)
MiB = 2**20


def targets() -> list[tuple[Any, str]]:
    """``(Target, attention)`` for every compiler installed here and the attention
    implementations it runs."""
    from meshkit import plan

    compilers = plan.installed_compilers()
    found = [(plan.Target("h100", 4), "xla")]
    if "tpu" in compilers:
        tpu = plan.Target("v5e", 4, compiler="tpu", topology="v5e:2x2")
        found += [(tpu, "xla"), (tpu, "pallas")]
    if "gpu" in compilers:
        found.append((plan.Target("h100", 4, compiler="gpu"), "xla"))
    return found


Shape = dict[str, int]
"""``length``, ``width`` and ``heads`` of a GPT layer."""

SHAPE: Shape = {"length": LENGTH, "width": WIDTH, "heads": HEADS}


def bare_layers_temp_bytes(target: Any, layers: int, attention: str, shape: Shape) -> int:
    """Temporaries per chip of the gradient (parameters and input) of ``layers`` GPT
    blocks in bf16, one sequence per chip."""
    from meshkit.models._transformer import Block
    from meshkit.plan._layout import target_devices

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            for i in range(layers):
                block = Block(heads, 4 * width, attention=attention, name=f"block{i}")  # type: ignore[arg-type]
                x = block(x)
            return x

    length, width, heads = shape["length"], shape["width"], shape["heads"]
    devices = target_devices(target)
    mesh = Mesh(np.asarray(devices), ("data",))
    one = jax.ShapeDtypeStruct((1, length, width), jnp.bfloat16)
    params = jax.eval_shape(Stack().init, jax.random.key(0), one)
    params = jax.tree.map(
        lambda p: jax.ShapeDtypeStruct(
            p.shape, jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec())
        ),
        params,
    )
    x = jax.ShapeDtypeStruct(
        (len(devices), length, width),
        jnp.bfloat16,
        sharding=NamedSharding(mesh, PartitionSpec("data")),
    )

    def loss(p: Any, x: jax.Array) -> jax.Array:
        out: jax.Array = Stack().apply(p, x)  # pyright: ignore[reportAssignmentType]
        return jnp.sum(out.astype(jnp.float32))

    # The mesh and the batch's logical axis in force, as in a train step: the flash
    # kernel then runs per device under shard_map.
    with jax.set_mesh(mesh), nn.logical_axis_rules((("batch", "data"),)):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x)
    compiled = lowered.compile()
    analysis = compiled.memory_analysis()
    assert analysis is not None
    return int(analysis.temp_size_in_bytes)


def step_temp_bytes(target: Any, layers: int, attention: str, shape: Shape) -> int:
    """Temporaries per chip of the planner's train step of a ``layers``-layer GPT."""
    from meshkit import plan
    from meshkit.plan._layout import target_devices
    from meshkit.plan._measure import measure
    from meshkit.plan._planner import layout_rules

    workload = plan.transformer_workload(
        num_layers=layers, embed_dim=shape["width"], num_heads=shape["heads"],
        mlp_dim=4 * shape["width"], vocab_size=256, length=shape["length"],
        batch_size=target.devices, scan_layers=False,
        attention=attention,  # pyright: ignore[reportArgumentType]
    )  # fmt: skip
    rules = layout_rules(fsdp=False, tensor=False, logical=True)
    layout = plan.Layout({"data": target.devices}, rules=rules, precision="bf16")
    return measure(workload, layout, target, target_devices(target)).temp_bytes


def per_layer(
    target: Any, attention: str, shape: Shape = SHAPE, *, bare: bool = True
) -> dict[str, Any]:
    """One more layer's temporaries in the train step and (``bare``) in the blocks
    alone, ``DEPTHS`` apart, and the step's other temporaries."""
    step = [step_temp_bytes(target, n, attention, shape) for n in DEPTHS]
    span = DEPTHS[1] - DEPTHS[0]
    row: dict[str, Any] = {
        "attention": attention,
        "shape": shape,
        "step_temp_bytes": step,
        "step_per_layer_bytes": (step[1] - step[0]) / span,
    }
    if bare:
        blocks = [bare_layers_temp_bytes(target, n, attention, shape) for n in DEPTHS]
        row["bare_temp_bytes"] = blocks
        row["bare_per_layer_bytes"] = (blocks[1] - blocks[0]) / span
    row["step_other_bytes"] = step[0] - DEPTHS[0] * row["step_per_layer_bytes"]
    return row


def measure_all() -> list[dict[str, Any]]:
    from meshkit.plan._measure import _compiler_name

    rows = []
    for target, attention in targets():
        rows.append({"compiler": _compiler_name(target), **per_layer(target, attention)})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    jax.config.update("jax_platforms", "cpu")  # the stand-in devices of XLA:CPU's target
    jax.config.update("jax_num_cpu_devices", 4)
    save("activations", {"rows": measure_all()}, tables)


def tables(run: dict[str, Any]) -> dict[str, str]:
    """``table``: per-layer bytes, bare and in the step, against the count."""
    from meshkit.plan._workloads import korthikanti_activation_bytes

    rows = []
    for row in run["rows"]:
        fused = row["attention"] == "pallas"
        count = korthikanti_activation_bytes(
            length=LENGTH, batch=1, width=WIDTH, heads=HEADS, softmax_bytes=4,
            fused_attention=fused,
        )  # fmt: skip
        bare, step = row["bare_per_layer_bytes"], row["step_per_layer_bytes"]
        rows.append(
            [
                row["compiler"],
                "Pallas flash" if fused else "XLA (float32 softmax)",
                f"{count / MiB:.1f}",
                f"{bare / MiB:.1f} ({bare / count:.2f})",
                f"{step / MiB:.1f} ({step / count:.2f})",
                f"{row['step_other_bytes'] / MiB:.1f}",
            ]
        )
    header = ["compiler", "attention", "count MiB", "bare layer MiB (/ count)"]
    header += ["in the train step MiB (/ count)", "the step's other temporaries MiB"]
    return {"table": markdown_table(header, rows, "ll" + "r" * 4)}


if __name__ == "__main__":
    main()
