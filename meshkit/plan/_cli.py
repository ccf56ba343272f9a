"""``python -m meshkit.plan``: plan a GPT-style model (or your own workload) for a target."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast, get_args

from meshkit._help import HelpWithDefaults
from meshkit.models._remat import RematPolicy
from meshkit.models._transformer import llama_architecture

GPT_VOCAB = 50304
"""GPT-2's 50,257 tokens rounded up to a multiple of 128, as GPT models are trained."""

MODELS: dict[str, dict[str, Any]] = {
    "gpt-125m": {"num_layers": 12, "embed_dim": 768, "num_heads": 12, "mlp_dim": 3072},
    "gpt-760m": {"num_layers": 24, "embed_dim": 1536, "num_heads": 12, "mlp_dim": 6144},
    "gpt-1.3b": {"num_layers": 24, "embed_dim": 2048, "num_heads": 16, "mlp_dim": 8192},
    "gpt-7b": {"num_layers": 32, "embed_dim": 4096, "num_heads": 32, "mlp_dim": 16384},
    **{f"llama-{size}": llama_architecture(size) for size in ("1b", "7b", "8b")},
}
"""Models by name: GPT-style sizes (vocabulary from --vocab), and the LLaMA models of
``meshkit.models.llama`` at their published shapes and vocabularies (context from
--length for all)."""


def _positive(text: str) -> int:
    """An argparse type: a whole number of at least 1 (``--devices``, ``--batch-size``)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def remat_policies(text: str) -> list[RematPolicy]:
    """``"none,nothing_saveable"`` -> the policy names, each checked."""
    names = [part for part in text.split(",") if part]
    unknown = [name for name in names if name not in get_args(RematPolicy)]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown remat policies {unknown}; choose among {list(get_args(RematPolicy))}"
        )
    return cast(list[RematPolicy], names)


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m meshkit.plan``."""
    p = argparse.ArgumentParser(
        prog="python -m meshkit.plan",
        description="Compile candidate layouts for a target you do not have and rank them: "
        "memory per device, collectives, estimated step time. A Ctrl-C ranks the layouts "
        "planned so far (and writes --json and --png).",
        formatter_class=HelpWithDefaults,
    )
    p.add_argument("--model", default="gpt-1.3b", choices=sorted(MODELS), help="the model")
    p.add_argument(
        "--hf-config",
        type=Path,
        help="a Llama-family config.json in the transformers layout (or its folder) to plan "
        "instead of --model: size a checkpoint before downloading its weights",
    )
    p.add_argument(
        "--workload",
        help="module:function returning a meshkit.plan.Workload (instead of --model)",
    )
    p.add_argument(
        "--vocab", type=_positive, help=f"vocabulary (default: the model's; {GPT_VOCAB} for GPTs)"
    )
    p.add_argument(
        "--param-dtype",
        choices=("f32", "bf16"),
        default="f32",
        help="the parameters' dtype (bf16: AdamW's state stays float32)",
    )
    p.add_argument("--length", type=_positive, default=2048, help="tokens per sequence")
    p.add_argument("--batch-size", type=_positive, default=256, help="global batch, sequences")
    p.add_argument("--accelerator", default="h100", help="a name in meshkit.plan.ACCELERATORS")
    p.add_argument("--devices", type=_positive, default=64, help="accelerators in all")
    p.add_argument("--slices", type=_positive, default=1, help="nodes (GPU) or slices (TPU)")
    p.add_argument(
        "--compiler",
        default="cpu",
        choices=("cpu", "tpu", "gpu"),
        help='gpu: XLA:GPU for compile-only GPUs (pip install "meshkit[gpu-plan]")',
    )
    p.add_argument("--topology", help="TPU topology, e.g. v5e:16x16 (with --compiler tpu)")
    p.add_argument("--tensor", type=_ints, default=[1, 8], help="model-axis sizes to try")
    p.add_argument("--fsdp", type=_ints, help="fsdp-axis sizes to try (default: all)")
    p.add_argument(
        "--remat",
        type=remat_policies,
        default=["none", "nothing_saveable"],
        help="remat policies to try, comma-separated",
    )
    p.add_argument("--microbatches", type=_ints, default=[1], help="counts to try")
    p.add_argument(
        "--precision", default="bf16", choices=("f32", "bf16", "f16"), help="compute precision"
    )
    p.add_argument(
        "--attention",
        choices=("auto", "xla", "cudnn", "pallas"),
        help="the model's attention (default: pallas with --compiler tpu, else auto)",
    )
    p.add_argument(
        "--efficiency",
        help="fractions of peak a step reaches, e.g. compute=0.45,links=0.8,overlap=1 "
        "(default: calibrated on published runs, docs/planning.md)",
    )
    p.add_argument("--json", type=Path, help="write the plan as JSON here")
    p.add_argument("--png", type=Path, help="write bytes per device per layout as a PNG here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--keep-idle",
        action="store_true",
        help="keep the layouts whose model axis shards no parameter (marked; left out by default)",
    )
    return p


def _workload(args: argparse.Namespace) -> Any:
    if args.workload:
        return _user_workload(args.workload, args.remat)
    import jax.numpy as jnp

    from meshkit.plan._workloads import transformer_workload

    attention = args.attention or ("pallas" if args.compiler == "tpu" else "auto")
    shape = {"vocab_size": GPT_VOCAB, **(_hf_shape(args.hf_config) or MODELS[args.model])}
    if args.vocab is not None:
        shape["vocab_size"] = args.vocab
    return transformer_workload(
        **shape,
        length=args.length,
        batch_size=args.batch_size,
        attention=attention,
        param_dtype=jnp.bfloat16 if args.param_dtype == "bf16" else jnp.float32,
    )


def _hf_shape(config: Path | None) -> dict[str, Any] | None:
    """The ``Transformer`` fields of ``--hf-config`` but its length and dtype (those
    come from ``--length`` and ``--param-dtype``); ``None`` without one."""
    if config is None:
        return None
    from meshkit.models._hf_llama import read_config, transformer_fields

    fields = transformer_fields(read_config(config))
    return {k: v for k, v in fields.items() if k not in ("max_length", "param_dtype")}


def _check_hf_config(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """A ``--hf-config`` meshkit cannot read ends in one line naming the flag."""
    if args.hf_config is None:
        return
    try:
        _hf_shape(args.hf_config)
    except (OSError, ValueError, KeyError) as error:
        what = f"no field {error}" if isinstance(error, KeyError) else error
        p.error(f"--hf-config {args.hf_config}: {what}")


def _user_workload(spec: str, remat: Sequence[str]) -> Any:
    """``--workload module:function``'s ``Workload``; a mistake ends in one line."""
    from meshkit.plan._measure import Workload
    from meshkit.train._state import Model

    module, _, function = spec.partition(":")
    if not function:
        raise SystemExit(f"--workload wants module:function, got {spec!r}.")
    try:
        workload = getattr(importlib.import_module(module), function)()
    except (ImportError, AttributeError) as error:
        raise SystemExit(f"--workload {spec}: {type(error).__name__}: {error}") from None
    if not isinstance(workload, Workload):
        raise SystemExit(
            f"--workload {spec} returned a {type(workload).__name__}; expected a "
            "meshkit.plan.Workload(model=..., tx=..., loss_fn=..., batch=...)."
        )
    fixed = isinstance(workload.model, Model)
    asked = sorted(set(remat) - {"none"})
    if fixed and asked:
        raise SystemExit(
            f"--workload {spec} returns a fixed model, which cannot take the remat policies "
            f"{asked} that --remat asks for: pass --remat none, or return "
            "model=lambda remat: linen_model(MyModule(remat=remat), x) to let layouts choose."
        )
    return workload


def _no_layouts(args: argparse.Namespace) -> str:
    """Why ``candidate_layouts`` found none: the sizes that do not divide the devices."""
    per_slice = args.devices // args.slices
    bad = [f"--tensor {t}" for t in args.tensor if per_slice % t]
    bad += [f"--fsdp {f}" for f in args.fsdp or () if per_slice % f]
    return (
        f"No layout of {args.devices} devices ({per_slice} per slice) from "
        f"{', '.join(bad) or 'these sizes'}: every --tensor and --fsdp size must divide "
        f"{per_slice} and their product too (e.g. --tensor 1,2 --fsdp 1,{per_slice // 2 or 1})."
    )


def _check_batch(batch_size: int, layouts: Sequence[Any]) -> None:
    """Ends in one line when ``--batch-size`` splits over no layout's data shards (every
    layout would fail to compile, each for the same reason)."""
    shards = sorted(
        {math.prod(layout.axis_sizes[a] for a in layout.data_axes) for layout in layouts}
    )
    if any(batch_size % n == 0 for n in shards):
        return
    fewest = shards[0]
    nearest = max(fewest, round(batch_size / fewest) * fewest)
    raise SystemExit(
        f"python -m meshkit.plan: --batch-size {batch_size} does not split over the data "
        f"shards (data x fsdp) of any candidate layout ({', '.join(map(str, shards))}); "
        f"pass a multiple of {fewest}, e.g. --batch-size {nearest}"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Plans as ``args`` say, prints the table and the choice; returns the JSON plan."""
    from meshkit.plan._layout import Target, target_devices
    from meshkit.plan._planner import candidate_layouts, plan

    target = Target(
        args.accelerator,
        args.devices,
        args.slices,
        args.compiler,
        args.topology,
        efficiency=args.efficiency,
    )
    layouts = candidate_layouts(
        args.devices,
        tensor=args.tensor,
        fsdp=args.fsdp,
        remat=args.remat,
        microbatches=args.microbatches,
        precision=args.precision,
        slices=args.slices,
        logical=args.workload is None,
    )
    workload = _workload(args)
    if not layouts:
        raise SystemExit(_no_layouts(args))
    if args.workload is None:
        _check_batch(args.batch_size, layouts)
    try:  # the stand-in devices: a TPU topology needs libtpu and the right chip count
        target_devices(target)
    except (ImportError, RuntimeError, ValueError) as error:
        raise SystemExit(f"python -m meshkit.plan: {error}") from None
    try:
        result = plan(workload, layouts, target, progress=not args.quiet, keep_idle=args.keep_idle)
    except ValueError as error:  # a workload whose step cannot be traced: the cause, one line
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise SystemExit(f"{args.workload or args.hf_config or args.model}: {first}") from None
    print(result.table())
    if result.not_planned:
        skipped = result.not_planned
        names = ", ".join(skipped[:4]) + (" ..." if len(skipped) > 4 else "")
        print(
            f"Stopped by Ctrl-C: {len(skipped)} candidate layouts not planned ({names}); "
            "the table ranks the others."
        )
    print(result.describe_choice())
    if args.json:
        print(f"plan written to {result.write_json(args.json)}")
    if args.png:
        print(f"plot written to {result.plot(args.png)}")
    return result.to_json()


def _check_target(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """A target the command line cannot mean ends in one line naming the flag."""
    from meshkit.plan._accelerators import ACCELERATORS

    if args.accelerator not in ACCELERATORS:
        p.error(
            f"argument --accelerator: unknown chip {args.accelerator!r}; pass one of "
            f"{', '.join(sorted(ACCELERATORS))}"
        )
    if args.devices % args.slices:
        p.error(
            f"--devices {args.devices} does not split into --slices {args.slices} of equal "
            "size; pass a slice count that divides the devices"
        )
    if args.efficiency is not None:
        from meshkit.plan._efficiency import parse_efficiency

        try:
            args.efficiency = parse_efficiency(
                args.efficiency, ACCELERATORS[args.accelerator].family
            )
        except ValueError as error:
            p.error(str(error))
    if args.compiler == "tpu" and not args.topology:
        p.error(
            "--compiler tpu needs --topology, the TPU slice to compile for, e.g. "
            "--topology v5e:16x16 (256 chips) or v5e:8x8 (64)"
        )
    if args.topology and args.compiler != "tpu":
        p.error(f"--topology {args.topology} is for the TPU compiler: add --compiler tpu")
    chip = (args.topology or "").partition(":")[0]
    if args.topology and chip != args.accelerator:
        p.error(
            f"--topology {args.topology} is a slice of {chip or 'no named'} chips but "
            f"--accelerator is {args.accelerator}: pass --accelerator {chip} or a "
            f"--topology of {args.accelerator} chips (e.g. {args.accelerator}:8x8)"
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: starts JAX with as many fake CPU devices as the target has."""
    p = parser()
    args = p.parse_args(argv)
    _check_target(args, p)
    _check_hf_config(args, p)
    import jax

    if args.compiler == "cpu":
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.devices)
    run(args)
    return 0


def plan_in_subprocess(argv: Sequence[str], *, timeout: float | None = None) -> dict[str, Any]:
    """Runs ``python -m meshkit.plan argv`` in a fresh process; returns its JSON plan.

    For a session whose JAX has already started with fewer devices than the target:
    the child starts with as many fake CPU devices as the plan needs.

    Examples:
        >>> plan = plan_in_subprocess(["--model", "gpt-125m", "--devices", "4",
        ...     "--tensor", "1", "--fsdp", "4", "--remat", "none", "--length", "64",
        ...     "--batch-size", "8", "--vocab", "256", "--quiet"])  # doctest: +SKIP
        >>> plan["layouts"][0]["layout"]  # doctest: +SKIP
        'data=1,fsdp=4,model=1'
    """
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "plan.json"
        command = [sys.executable, "-m", "meshkit.plan", *argv, "--json", str(path)]
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        done = subprocess.run(
            command, check=False, capture_output=True, text=True, timeout=timeout, env=env
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"python -m meshkit.plan {' '.join(argv)} failed with exit code "
                f"{done.returncode}:\n{done.stderr[-4000:]}"
            )
        return json.loads(path.read_text())
