"""Size a GPT-style model before booking hardware: 64 H100s and a 256-chip TPU v5e pod.

Command (no arguments: a 1.3B-parameter Transformer, 24 layers of width 2048, context
2048, a global batch of 256 sequences, AdamW, bf16 compute; planned for 8 nodes of 8
H100s and for a v5e-256 pod, each as fake CPU devices, or for the v5e through the TPU
compiler itself when libtpu is installed: ``pip install "meshkit[tpu]"``, and for the
H100s through XLA:GPU when JAX's CUDA plugin is: ``pip install "meshkit[gpu-plan]"``)::

    python -m recipes.plan

Expected result, in about 3 minutes on a 2-core machine (the two targets planned side
by side, a process each): for each target a ranked table of candidate layouts
(``data × fsdp × model`` mesh axes, remat policy) with parameter, optimizer-state,
temporary and total GiB per device, collective traffic, TFLOP and an estimated step
time with its range, then the chosen layout and why, e.g.::

    chosen: data=8,fsdp=8,model=1 remat=nothing_saveable - fits with 46.00 GiB to
    spare, estimated 0.265 s per step (0.198 s to 0.322 s, bound by compute), MFU 28%
    (HFU 35%)

The plans are written to ``<workdir>/plan_<target>.json`` and ``.png``. Other runs::

    python -m recipes.plan --params 8b            # Llama 3 8B (also 1b, 7b: LLaMA shapes)
    python -m recipes.plan --params 8b --param-dtype bf16  # bf16 parameters, f32 AdamW
    python -m recipes.plan --targets h100x64      # one target only

Train with a chosen layout: ``python -m recipes.transformer_lm --layout PLAN.json``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from typing import Any, get_args

from meshkit.models import RematPolicy, llama_architecture
from recipes._args import positive_int, recipe_parser

SIZES: dict[str, dict[str, Any]] = {
    "1.3b": {"num_layers": 24, "embed_dim": 2048, "num_heads": 16, "mlp_dim": 8192,
             "vocab_size": 50304},
    **{size: llama_architecture(size) for size in ("1b", "7b", "8b")},
}  # fmt: skip
"""Models by ``--params``: GPT-3 XL's shape (GPT-2's vocabulary), and LLaMA's published
1B (Llama 3.2), 7B (Llama 2) and 8B (Llama 3): RoPE, RMSNorm, SwiGLU, grouped-query
attention, no biases."""

TARGETS: dict[str, dict[str, Any]] = {
    "h100x64": {"accelerator": "h100", "devices": 64, "slices": 8, "fsdp": (1, 8)},
    "v5e-256": {"accelerator": "v5e", "devices": 256, "slices": 1, "fsdp": (16, 256)},
}
"""Targets by name: 8 nodes of 8 H100s (NVLink within a node, InfiniBand across), and a
single 16×16 v5e slice; the FSDP sizes each tries, beside tensor parallelism over 1 or 8."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    # Each target's own count of fake devices: --cpu-devices would have no effect.
    parser = recipe_parser(__doc__, workdir="workdir/plan", cpu_devices=False)
    parser.add_argument("--params", choices=sorted(SIZES), default="1.3b")
    parser.add_argument(
        "--param-dtype",
        choices=("f32", "bf16"),
        default="f32",
        help="the parameters' dtype (bf16: AdamW's state stays float32)",
    )
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma-separated names")
    parser.add_argument("--length", type=positive_int, default=2048, help="tokens per sequence")
    parser.add_argument(
        "--batch-size", type=positive_int, default=256, help="global batch, sequences"
    )
    parser.add_argument(
        "--remat",
        nargs="+",
        type=remat_names,
        default=[["none", "nothing_saveable"]],
        help="remat policies to try, comma-separated as in python -m meshkit.plan "
        "(spaces work too; default: none,nothing_saveable)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    args.remat = [name for names in args.remat for name in names]
    return args


def remat_names(text: str) -> list[str]:
    """``"none,nothing_saveable"`` -> the names, each a ``RematPolicy``."""
    names = [name for name in text.split(",") if name]
    unknown = [name for name in names if name not in get_args(RematPolicy)]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown remat policies {unknown or [text]}; choose among "
            f"{list(get_args(RematPolicy))}, comma-separated"
        )
    return names


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    targets = [name for name in args.targets.split(",") if name]
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        raise SystemExit(f"--targets names {unknown}; choose among {sorted(TARGETS)}.")
    if len(targets) > 1:
        return plan_side_by_side(targets, sys.argv[1:] if argv is None else argv)
    plan_target(targets[0], args)
    return 0


def plan_side_by_side(targets: list[str], argv: list[str]) -> int:
    """Each target planned by a process of its own, at the same time (XLA compiles a
    program on one core); each table printed as its process ends."""
    print(f"planning {', '.join(targets)} side by side, one process each ...", flush=True)
    children = {
        name: subprocess.Popen(
            [sys.executable, "-m", "recipes.plan", *argv, "--targets", name, "--quiet"],
            stdout=subprocess.PIPE,
            text=True,
        )
        for name in targets
    }
    for name, child in children.items():
        output, _ = child.communicate()
        print(output, end="", flush=True)
        if child.returncode:
            raise SystemExit(f"planning {name} failed (exit {child.returncode}): see above.")
    return 0


def plan_target(name: str, args: argparse.Namespace) -> None:
    """Plans the model for one target: its table, its choice, its JSON and PNG."""
    spec = TARGETS[name]
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", spec["devices"])

    import jax.numpy as jnp

    from meshkit import plan

    compilers = plan.installed_compilers()
    on_tpu = "tpu" in compilers and spec["accelerator"] == "v5e"
    on_gpu = "gpu" in compilers and spec["accelerator"] == "h100"
    workload = plan.transformer_workload(  # the TPU compiler plans the flash kernel
        **SIZES[args.params],
        length=args.length,
        batch_size=args.batch_size,
        attention="pallas" if on_tpu else "auto",
        param_dtype=jnp.bfloat16 if args.param_dtype == "bf16" else jnp.float32,
    )
    target = plan.Target(
        spec["accelerator"],
        spec["devices"],
        spec["slices"],
        compiler="tpu" if on_tpu else "gpu" if on_gpu else "cpu",
        topology="v5e:16x16" if on_tpu else None,
    )
    layouts = plan.candidate_layouts(
        target.devices, tensor=(1, 8), fsdp=spec["fsdp"], remat=args.remat, slices=target.slices
    )
    start = time.perf_counter()
    result = plan.plan(workload, layouts, target, progress=not args.quiet)
    print(f"\n{name}: {len(layouts)} layouts planned in {time.perf_counter() - start:.0f} s")
    print(result.table())
    print(result.describe_choice())
    result.write_json(args.workdir / f"plan_{name}.json")
    result.plot(args.workdir / f"plan_{name}.png")
    print(f"{name}'s plan and its plot: {args.workdir}/plan_{name}.json and .png")


if __name__ == "__main__":
    sys.exit(main())
