"""The planner against independent counts: shard bytes of placed arrays, hand-counted
collectives, an unrolled program's FLOPs, and training with the layout it chooses."""

from __future__ import annotations

import dataclasses
import functools
import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import meshkit
from meshkit import plan as planning
from meshkit.models import RematPolicy
from meshkit.plan import _hlo
from meshkit.plan._efficiency import PUBLISHED_RUNS, PublishedRun, calibrated
from meshkit.testing import run_processes
from meshkit.train import classification_loss, create_train_state, linen_model

pytestmark = pytest.mark.devices(8)

TARGET = planning.Target("h100", 8)


def _mlp_workload(batch_size: int = 4096) -> planning.Workload:
    import flax.linen as nn

    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
            x = nn.relu(nn.Dense(512)(x))
            x = nn.relu(nn.Dense(512)(x))
            return nn.Dense(10)(x)

    return planning.Workload(
        model=linen_model(Mlp(), jnp.zeros((1, 256))),
        tx=optax.adam(1e-3),
        loss_fn=classification_loss,
        batch={
            "image": jax.ShapeDtypeStruct((batch_size, 256), jnp.float32),
            "label": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
        },
    )


@functools.cache
def _mlp_plan() -> planning.Plan:
    fsdp = meshkit.PartitionRules.fsdp("data", min_size=1024)
    layouts = [
        planning.Layout({"data": 8}, None, precision="f32", name="replicated"),
        planning.Layout({"data": 8}, fsdp, precision="f32", name="fsdp"),
    ]
    return planning.plan(_mlp_workload(), layouts, TARGET, progress=False)


def _report(name: str) -> planning.LayoutReport:
    return next(r for r in _mlp_plan().reports if r.layout.name == name)


def _payload(report: planning.LayoutReport, kind: str) -> int:
    return sum(c.payload_bytes * c.count for c in report.measurement.collectives if c.kind == kind)


def _placed_bytes(tree: object) -> int:
    """The most bytes any device holds of placed arrays: summed from their shards."""
    per_device: dict[object, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values())


@pytest.mark.parametrize("name", ["replicated", "fsdp"])
def test_state_bytes_per_device_equal_the_shards_of_a_placed_state(name: str) -> None:
    report = _report(name)
    workload = _mlp_workload()
    model = workload.model_for("none")
    state = create_train_state(
        model, workload.tx, meshkit.make_mesh("data=8"), rules=report.layout.rules
    )
    assert report.measurement.params_bytes == _placed_bytes(state.params)
    assert report.measurement.optimizer_bytes == _placed_bytes(state.opt_state)
    assert report.measurement.num_params == sum(x.size for x in jax.tree.leaves(state.params))


def test_data_parallel_collectives_are_one_all_reduce_of_the_gradients() -> None:
    report = _report("replicated")
    gradient_bytes = report.measurement.num_params * 4
    assert _payload(report, "all-gather") == 0
    # the gradients, plus a few scalars (loss and metrics)
    assert gradient_bytes <= _payload(report, "all-reduce") <= gradient_bytes * 1.05
    ring = 2 * gradient_bytes * 7 / 8
    assert report.collective_bytes() == pytest.approx(ring, rel=0.05)


def test_fsdp_gathers_and_scatters_the_parameters() -> None:
    report = _report("fsdp")
    params = jax.eval_shape(_mlp_workload().model_for("none").init, jax.random.key(0))["params"]
    # the leaves FSDP shards (the biases are under its min_size)
    sharded = sum(x.size * 4 for x in jax.tree.leaves(params) if x.size >= 1024)
    assert _payload(report, "all-gather") == pytest.approx(sharded, rel=0.05)
    assert _payload(report, "reduce-scatter") == pytest.approx(sharded, rel=0.05)


def test_replica_group_formats() -> None:
    def groups(attributes: str) -> list[list[int]]:
        line = f"  %x = f32[8]{{0}} all-reduce(%y), {attributes}, to_apply=%add"
        (instruction,) = _hlo._instructions([line])
        return _hlo._groups(instruction, 8)

    assert groups("replica_groups={{0,1},{2,3},{4,5},{6,7}}")[1] == [2, 3]
    assert groups("replica_groups=[2,4]<=[8]") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups("replica_groups=[4,2]<=[2,4]T(1,0)") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    mesh_form = "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}"
    assert groups(mesh_form) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups("replica_groups={}") == [list(range(8))]
    # XLA:GPU names the device at each mesh position (an iota, transposed): here the
    # 'axis_0' groups are the same device blocks as the explicit form's {0,1},{2,3}...
    gpu_form = "replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_0'}"
    assert groups(gpu_form) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_an_asynchronous_reduce_scatter_counts_what_it_reduces_once() -> None:
    line = (
        "  %rs = ((bf16[2048,64]{1,0}), (bf16[256,64]{1,0})) reduce-scatter-start(%g), "
        "replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add"
    )
    (instruction,) = _hlo._instructions([line])
    # the whole array it reduces: not its operands and outputs together, times the group
    assert _hlo._payload(instruction, "reduce-scatter", 8) == 2048 * 64 * 2


def _lm_workload(*, scan_layers: bool) -> planning.Workload:
    """The small language model of ``_lm_module``, batch 16, as a workload."""
    return planning.transformer_workload(
        num_layers=2,
        embed_dim=64,
        num_heads=4,
        mlp_dim=256,
        vocab_size=256,
        length=32,
        batch_size=16,
        scan_layers=scan_layers,
    )


def test_a_scanned_program_counts_every_trip_of_its_loop() -> None:
    layout = planning.Layout({"data": 8}, precision="f32")
    flops = {
        scan: planning.plan(_lm_workload(scan_layers=scan), [layout], TARGET, progress=False)
        .reports[0]
        .measurement.flops
        for scan in (False, True)
    }
    assert flops[True] == pytest.approx(flops[False], rel=0.03)


def test_collectives_across_slices_are_only_those_of_the_axis_that_spans_them() -> None:
    workload = _lm_workload(scan_layers=True)
    target = planning.Target("h100", 8, slices=2)
    layout = planning.candidate_layouts(8, tensor=(2,), fsdp=(1,), slices=2)[0]
    report = planning.plan(workload, [layout], target, progress=False).reports[0]
    across = [c for c in report.measurement.collectives if c.across_slices]
    assert across and report.collective_bytes(across_slices=True) > 0
    # tensor parallelism (model=2) stays within a slice: groups of 2 never cross
    assert all(c.group_size != 2 for c in across)
    assert report.terms["dcn"] > 0


def test_a_llama_in_bf16_plans_with_exact_parameter_and_float32_optimizer_bytes() -> None:
    from meshkit.models import llama_architecture

    shape = {**llama_architecture("1b"), "num_layers": 2, "embed_dim": 128, "num_heads": 8,
             "num_kv_heads": 2, "mlp_dim": 256, "vocab_size": 512}  # fmt: skip
    workload = planning.transformer_workload(
        **shape, length=32, batch_size=16, param_dtype=jnp.bfloat16
    )
    from meshkit.plan._planner import layout_rules

    rules = layout_rules(fsdp=True, tensor=True, logical=True)
    layout = planning.Layout({"data": 2, "fsdp": 2, "model": 2}, rules=rules, precision="bf16")
    m = planning.plan(workload, [layout], TARGET, progress=False).reports[0].measurement
    width, kv, mlp, vocab = 128, 2 * 16, 256, 512  # kv: 2 key/value heads of width 16
    per_layer = 2 * width * width + 2 * width * kv + 3 * width * mlp + 2 * width
    count = vocab * width + 2 * per_layer + width  # tied embeddings, no biases
    assert m.num_params == count
    # every weight is split over fsdp x model (4 devices) but the norm scales, which are
    # split over fsdp only (embed); bf16 parameters, two float32 AdamW moments each
    norms = (2 * 2 + 1) * width
    assert m.params_bytes == 2 * ((count - norms) // 4 + norms // 2)
    assert m.optimizer_bytes - 2 * 4 * ((count - norms) // 4 + norms // 2) < 64  # + counts
    assert not m.error and not m.idle_axes


def layer_activation_bytes(
    target: planning.Target, *, attention: str, length: int, width: int, heads: int
) -> float:
    """Temporaries per device of one more layer of a GPT's train step (unscanned, no
    remat, bf16 compute, one sequence per device): (4 layers - 2 layers) / 2."""
    from benchmarks.activations import per_layer

    shape = {"length": length, "width": width, "heads": heads}
    return per_layer(target, attention, shape, bare=False)["step_per_layer_bytes"]


@pytest.mark.once
def test_xla_cpu_keeps_at_least_the_activations_korthikanti_counts_per_layer() -> None:
    from meshkit.plan._workloads import korthikanti_activation_bytes

    shape: dict[str, int] = {"length": 512, "width": 256, "heads": 4}
    measured = layer_activation_bytes(planning.Target("h100", 1), attention="xla", **shape)
    counted = korthikanti_activation_bytes(batch=1, length=512, width=256, heads=4, softmax_bytes=4)
    # an upper bound on CPU: its fusions keep more buffers (2.7x at s=2048, h=1024)
    assert counted <= measured <= 4 * counted, (measured / 2**20, counted / 2**20)


@functools.cache
def _lm_plan() -> planning.Plan:
    """Four tensor-parallel layouts of the small language model on 8 devices."""
    workload = _lm_workload(scan_layers=True)
    layouts = planning.candidate_layouts(8, tensor=(2, 4), fsdp=(1, 2), precision="f32")
    return planning.plan(workload, layouts, TARGET, progress=False)


def test_plan_ranks_fitting_layouts_and_writes_json_and_png(tmp_path) -> None:  # type: ignore[no-untyped-def]
    result = _lm_plan()
    assert len(result.reports) == 4 and all(r.fits for r in result.reports)
    times = [r.estimated_step_seconds for r in result.reports]
    assert times == sorted(times) and result.best is result.reports[0]
    records = json.loads(result.write_json(tmp_path / "plan.json").read_text())
    keys = {"layout", "fits", "params_bytes_per_device", "optimizer_bytes_per_device",
            "temp_bytes_per_device", "total_bytes_per_device", "collective_bytes_per_device",
            "flops_per_device", "estimated_step_seconds", "num_params"}  # fmt: skip
    assert all(keys <= set(record) for record in records["layouts"])
    chosen = planning.load_layout(tmp_path / "plan.json")
    assert chosen.name == result.best.layout.name
    assert chosen.axis_sizes == result.best.layout.axis_sizes
    assert chosen.rules is not None and chosen.rules.logical == result.best.layout.rules.logical  # type: ignore[union-attr]
    import matplotlib

    before = matplotlib.get_backend()
    matplotlib.use("svg")  # the caller's backend (a notebook's, say) is left as it is
    try:
        assert result.plot(tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG"
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(before)
    assert result.best.layout.name in result.table()
    assert result.describe_choice().startswith(f"chosen: {result.best.layout.name}")
    # a small model's figures in units that show them (they printed as 0.00 GiB, 0.000 s)
    header = result.table().splitlines()[2]
    assert "param MiB" in header and ("step µs" in header or "step ms" in header), header
    assert " 0.00 " not in result.table().splitlines()[4]


def test_mfu_counts_the_models_flops_and_hfu_what_the_program_runs() -> None:
    workload = planning.transformer_workload(  # long enough that attention is 23% of it
        num_layers=2, embed_dim=128, num_heads=4, mlp_dim=512, vocab_size=256, length=256,
        batch_size=8,
    )  # fmt: skip
    layouts = [
        planning.Layout({"data": 8}, None, precision="f32", remat=remat, name=remat)
        for remat in ("none", "nothing_saveable")
    ]
    plain, recomputing = sorted(
        planning.plan(workload, layouts, TARGET, progress=False).reports,
        key=lambda r: r.layout.remat != "none",
    )
    # Without remat the program runs the model's FLOPs (6 per parameter and token, and
    # attention's 12 * layers * positions * width) and little else; a count that missed
    # the backward pass or attention, or counted the embedding lookup, would be far off.
    model_flops = workload.model_flops
    assert model_flops is not None
    assert plain.measurement.flops * 8 == pytest.approx(model_flops, rel=0.05)
    for report in (plain, recomputing):
        peak = report.estimated_step_seconds * TARGET.chip.peak_flops * 8
        assert report.estimated_mfu == pytest.approx(model_flops / peak)
        assert report.estimated_hfu == pytest.approx(report.measurement.flops * 8 / peak)
    assert recomputing.estimated_hfu > 1.15 * recomputing.estimated_mfu  # the forward again
    assert " MFU   HFU  bound by" in planning.Plan(TARGET, (plain,)).table()


@pytest.mark.once
@pytest.mark.parametrize("run", PUBLISHED_RUNS, ids=lambda run: run.name)
def test_the_calibration_predicts_each_published_run_within_a_quarter(run: PublishedRun) -> None:
    # These runs are bound by compute, so the planned step is the run's hardware FLOPs at
    # the family's efficiency and the measured one the same FLOPs at the run's own: their
    # ratio is the two efficiencies'. A run unlike the others (an outlier source, a remat
    # factor left out) would fall outside.
    family = calibrated(run.family)
    planned_over_measured = run.compute_efficiency / family.compute
    assert 0.8 <= planned_over_measured <= 1.25
    low, high = family.compute_range
    assert low <= run.compute_efficiency <= high


@pytest.mark.once
def test_the_docs_table_of_published_runs_is_the_calibration() -> None:
    from pathlib import Path

    page = (Path(__file__).parent.parent / "docs" / "planning.md").read_text()
    for run in PUBLISHED_RUNS:
        ratio = run.compute_efficiency / calibrated(run.family).compute
        row = next(line for line in page.splitlines() if line.startswith(f"| {run.name} |"))
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[2] == f"{run.mfu:.2%}" and cells[4] == f"{run.compute_efficiency:.1%}"
        assert cells[5] == f"{ratio:.2f}", (run.name, cells)


def test_collectives_hide_their_overlapped_share_behind_compute() -> None:
    from meshkit.plan._planner import estimate

    m = _report("fsdp").measurement
    by_hand = planning.Efficiency(compute=0.5, links=0.8, overlap=0.0)
    serial = estimate(m, dataclasses.replace(TARGET, efficiency=by_hand), m.flops * 8)
    compute = m.flops / TARGET.chip.peak_flops / 0.5
    ici = m.traffic_bytes(across_slices=False) / (TARGET.chip.ici_bytes_per_second * 0.8)
    assert serial.terms["compute"] == pytest.approx(compute)
    assert serial.terms["ici"] == pytest.approx(ici) and serial.terms["dcn"] == 0
    busy = max(compute, serial.terms["memory"])
    assert serial.estimated_step_seconds == pytest.approx(busy + ici)
    hidden = dataclasses.replace(by_hand, overlap=1.0)
    full = estimate(m, dataclasses.replace(TARGET, efficiency=hidden), m.flops * 8)
    assert full.estimated_step_seconds == pytest.approx(max(busy, ici))
    # Set by hand, compute is one figure: the range spans the overlap alone.
    assert serial.step_seconds_range == pytest.approx((max(busy, ici), busy + ici))
    default = _report("fsdp")  # the default: the published runs' median and spread
    low, high = default.step_seconds_range
    assert low < default.estimated_step_seconds < high
    assert TARGET.step_efficiency() == calibrated("gpu")


@pytest.mark.once
def test_a_chip_holds_what_a_program_gets_there(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    h100, v5e = planning.Target("h100", 8), planning.Target("v5e", 8)
    assert h100.usable_bytes() == (60 * 10**9, "75% of the HBM, JAX's default preallocation")
    assert v5e.usable_bytes()[0] == 15.75 * 2**30  # what XLA:TPU compiles a v5e program for
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".9")
    assert h100.usable_bytes() == (72 * 10**9, "90% of the HBM, XLA_PYTHON_CLIENT_MEM_FRACTION")
    asked = planning.Target("h100", 8, memory_fraction=0.5)
    assert asked.usable_bytes() == (40 * 10**9, "50% of the HBM, as asked")


def test_fsdp_gathers_a_tied_embedding_once_a_step() -> None:
    def gathered(vocab: int) -> float:
        workload = planning.transformer_workload(  # logits far larger than the table
            num_layers=1, embed_dim=64, num_heads=4, mlp_dim=256, vocab_size=vocab,
            length=256, batch_size=64,
        )  # fmt: skip
        layouts = planning.candidate_layouts(8, tensor=(1,), fsdp=(8,), remat=("none",))
        report = planning.plan(workload, layouts, TARGET, progress=False).reports[0]
        return report.to_json()["collective_payload_bytes_by_kind"]["all-gather"]

    # 512 more rows of 64 float32: gathered once for the lookup and the logits together
    # (each gathering its own copy moved them twice)
    assert gathered(1024) - gathered(512) == 512 * 64 * 4


def test_nothing_fits_names_the_closest_and_its_overshoot() -> None:
    from meshkit.plan._planner import estimate

    target = planning.Target("h100", 8, memory_fraction=1e-6)
    reports = [estimate(r.measurement, target, 1.0) for r in _lm_plan().reports]
    closest = min(reports, key=lambda r: r.measurement.total_bytes)
    result = planning.Plan(target, tuple(sorted(reports, key=lambda r: r.measurement.total_bytes)))
    assert not any(r.fits for r in reports)
    with pytest.raises(
        planning.NoLayoutFitsError, match=rf"closest, '{closest.layout.name}'.*GiB over"
    ):
        _ = result.best
    assert "What would make it fit" in result.describe_choice()


def test_bad_input_gets_clear_errors() -> None:
    with pytest.raises(ValueError, match=r"h100.*v5e"):
        planning.Target("h900", 8)
    with pytest.raises(ValueError, match="multiply to 4"):
        planning.plan(_lm_workload(scan_layers=True), [planning.Layout({"data": 4})], TARGET)
    bad = planning.Workload(
        model=_lm_workload(scan_layers=True).model,
        tx=optax.sgd(0.1),
        loss_fn=classification_loss,  # wants "image" and "label"
        batch={"tokens": np.zeros((8, 33), np.int32)},
    )
    with pytest.raises(ValueError, match=r"could not be traced with the batch.*tokens"):
        planning.plan(bad, [planning.Layout({"data": 8})], TARGET, progress=False)


LLAMA_3_8B_CONFIG = {  # the published config.json of Llama 3 8B, as transformers writes it
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
    "torch_dtype": "bfloat16",
}


@pytest.mark.once
def test_a_transformers_config_plans_the_model_it_describes(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from meshkit.models import llama_from_hf
    from meshkit.plan import _cli

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_8B_CONFIG))
    shape = _cli._hf_shape(tmp_path)
    assert shape is not None
    assert {k: shape[k] for k in _cli.MODELS["llama-8b"]} == _cli.MODELS["llama-8b"]
    model = llama_from_hf(tmp_path, max_length=8)
    abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    assert sum(x.size for x in jax.tree.leaves(abstract)) == 8_030_261_248
    (tmp_path / "bias.json").write_text(json.dumps({**LLAMA_3_8B_CONFIG, "mlp_bias": True}))
    with pytest.raises(SystemExit):
        _cli.main(["--hf-config", str(tmp_path / "bias.json")])
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == (
        f"python -m meshkit.plan: error: --hf-config {tmp_path / 'bias.json'}: config.json: "
        "mlp_bias=True is not supported: meshkit's LLaMA has no biases and attends to every "
        "earlier position."
    )


@pytest.mark.once
def test_planning_a_7b_model_allocates_none_of_its_weights(tmp_path) -> None:  # type: ignore[no-untyped-def]
    argv = ["--model", "gpt-7b", "--devices", "8", "--tensor", "8", "--fsdp", "1", "--remat",
            "nothing_saveable", "--length", "128", "--batch-size", "8", "--vocab", "32000",
            "--quiet", "--json", str(tmp_path / "plan.json")]  # fmt: skip
    code = (
        "import resource, sys; from meshkit.plan._cli import main; main(sys.argv[1:]); "
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, check=True
    )
    peak_bytes = int(done.stdout.split()[-1]) * 1024
    record = json.loads((tmp_path / "plan.json").read_text())["layouts"][0]
    weights = record["num_params"] * 4
    assert record["num_params"] > 6e9 and weights > 24 * 2**30
    assert peak_bytes < 3 * 2**30  # the float32 weights alone would be 25 GiB


def _lm_module(remat: RematPolicy = "none") -> Any:
    from meshkit.models import Transformer

    return Transformer(
        vocab_size=256, num_layers=2, num_heads=4, embed_dim=64, mlp_dim=256, max_length=32,
        remat=remat, scan_layers=True,
    )  # fmt: skip


def _chosen_layout() -> dict[str, Any]:
    """The plan's choice for the small language model on 8 devices, as JSON."""
    return _lm_plan().best.layout.to_json()


def train_with_layout(layout_json: dict[str, Any] | None, steps: int = 3) -> list[float]:
    """Losses of the small language model trained ``steps`` steps with a layout.

    ``None``: the default layout, pure data parallelism over every device.
    """
    from meshkit import data, train
    from meshkit.plan._workloads import next_token_loss

    layout = planning.Layout.from_json(layout_json) if layout_json else None
    mesh = layout.make_mesh() if layout else meshkit.make_mesh("data=-1")
    sharding = meshkit.batch_sharding(mesh, layout.data_axes if layout else "data")
    module = _lm_module(layout.remat if layout else "none")
    model = linen_model(module, jnp.zeros((1, 32), jnp.int32))
    state = create_train_state(
        model, optax.adamw(3e-3), mesh, rules=layout.rules if layout else None
    )
    step = train.make_train_step(
        next_token_loss,
        train.state_shardings_of(state),
        sharding,
        microbatches=layout.microbatches if layout else 1,
    )
    source = data.reference_text("train", length=32)
    pipeline = data.TrainPipeline(source, global_batch_size=16, sharding=sharding, seed=0)
    losses = []
    with data.GlobalBatchIterator(pipeline) as batches:
        for _ in range(steps):
            state, metrics = step(state, next(batches))
            losses.append(float(metrics["loss"]))
    return losses


def test_the_chosen_layout_trains_like_the_default_one() -> None:
    chosen = _chosen_layout()
    assert chosen["axes"]["model"] > 1  # tensor parallel: a layout unlike the default
    reference = train_with_layout(None)
    assert reference[-1] < reference[0]
    np.testing.assert_allclose(train_with_layout(chosen), reference, rtol=1e-5)


def plan_and_train() -> tuple[str, list[float]]:
    """Plans the small language model on every device of the run, trains with the choice."""
    chosen = _chosen_layout()
    return chosen["name"], train_with_layout(chosen)


@pytest.mark.multiprocess
def test_every_process_plans_the_same_layout_and_trains_like_one() -> None:
    reference = train_with_layout(None)
    results = run_processes(plan_and_train, timeout=300)
    assert len({name for name, _ in results}) == 1  # every process chose alike
    for _, losses in results:
        np.testing.assert_allclose(losses, reference, rtol=1e-5)


@pytest.mark.once  # the recipe starts its own 64 fake devices
def test_the_recipe_prints_a_ranked_plan_and_writes_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    argv = ["--targets", "h100x64", "--remat", "nothing_saveable", "--length", "128",
            "--batch-size", "64", "--workdir", str(tmp_path)]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "recipes.plan", *argv], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "chosen: data=" in done.stdout
    layouts = json.loads((tmp_path / "plan_h100x64.json").read_text())["layouts"]
    assert len(layouts) == 3 and layouts[0]["num_params"] > 1.3e9
    assert (tmp_path / "plan_h100x64.png").read_bytes()[:4] == b"\x89PNG"


def test_a_loop_without_a_trip_count_annotation_is_counted_by_its_condition() -> None:
    """The TPU compiler writes no ``known_trip_count``: the condition's bound counts."""
    import re

    def body(h, w):
        return jnp.tanh(h @ w), None

    def f(ws, x):
        return jax.lax.scan(body, x, ws)[0].sum()

    ws, x = jnp.zeros((12, 64, 64)), jnp.zeros((32, 64))
    text = jax.jit(jax.grad(f)).lower(ws, x).compile().as_text() or ""
    assert '"known_trip_count"' in text  # XLA:CPU annotates its loops
    bare = re.sub(r'"known_trip_count":\{"n":"\d+"\},?', "", text)
    annotated, unannotated = (_hlo.program_counts(t, [0]) for t in (text, bare))
    assert unannotated.dot_flops == annotated.dot_flops > 10 * annotated.dot_flops_once


_Q = "bf16[2,12,1024,64]"  # [batch, heads, length, head_dim], as the kernels take them
_KERNEL = 'custom-call(%q, %q, %q), custom_call_target="tpu_custom_call"'
FLASH_PROGRAM = f"""\
%body (p: (s32[], {_Q})) -> (s32[], {_Q}) {{
  %p = (s32[], {_Q}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %q = {_Q}{{3,2,1,0}} get-tuple-element(%p), index=1
  %flash_attention.1 = ({_Q}, f32[2,12,1024,128]) {_KERNEL}
  %flash_mha_bwd_dkv_block_q_major_128.1 = ({_Q}, {_Q}) {_KERNEL}
  %flash_mha_bwd_dq_block_q_major_128.1 = {_Q} {_KERNEL}
  %some_other_kernel.1 = {_Q} {_KERNEL}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], {_Q}) tuple(%next, %q)
}}

%condition (p.1: (s32[], {_Q})) -> pred[] {{
  %p.1 = (s32[], {_Q}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %layers = s32[] constant(12)
  ROOT %below = pred[] compare(%i.1, %layers), direction=LT
}}

ENTRY %main (x: (s32[], {_Q})) -> (s32[], {_Q}) {{
  %x = (s32[], {_Q}) parameter(0)
  ROOT %while.1 = (s32[], {_Q}) while(%x), condition=%condition, body=%body
}}
"""


def test_flash_attention_kernels_count_as_xlas_attention_every_layer() -> None:
    """XLA's cost analysis leaves the Pallas kernels' custom calls out; the planner counts
    each as the products XLA's attention runs (q k^T and p v forward, four backward),
    in a loop as often as its condition's bound says (the TPU compiler's form)."""
    counts = _hlo.program_counts(FLASH_PROGRAM, [0])
    product = 2 * (2 * 12 * 1024 * 64) * 1024  # one [1024, 64] x [64, 1024] per head
    assert counts.kernel_flops == 12 * (2 + 2 + 2) * product  # not the unknown kernel
    assert counts.dot_flops == counts.dot_flops_once == 0


def _failing_compiles(
    monkeypatch: pytest.MonkeyPatch, error_at: Callable[[int], BaseException | None]
) -> list[int]:
    """Patches XLA's compile: its n-th call (from 1) raises ``error_at(n)`` where that
    gives an exception, else compiles. Returns the list of calls, one entry each."""
    compile_once = jax.stages.Lowered.compile
    calls: list[int] = []

    def compile_or_fail(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        error = error_at(len(calls))
        if error is not None:
            raise error
        return compile_once(self, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", compile_or_fail)
    return calls


@pytest.mark.parametrize(
    ("message", "note"),
    [
        (
            "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
            "temporaries (18.82G) exceeds available HBM (15.75G).",
            "refused it for memory: HLO temporaries need 18.82 GiB, 15.75 GiB available",
        ),
        ("INTERNAL: a failure of the compiler", "could not compile it: RuntimeError: INTERNAL"),
    ],
)
def test_a_layout_the_compiler_refuses_is_a_row_and_the_others_are_planned(
    monkeypatch, tmp_path, message: str, note: str
) -> None:  # type: ignore[no-untyped-def]
    _failing_compiles(monkeypatch, lambda n: RuntimeError(message) if n == 1 else None)
    fsdp = meshkit.PartitionRules.fsdp("data", min_size=1024)
    layouts = [
        planning.Layout({"data": 8}, None, precision="f32", name="refused"),
        planning.Layout({"data": 8}, fsdp, precision="f32", name="fsdp"),
    ]
    result = planning.plan(_mlp_workload(), layouts, TARGET, progress=False)
    assert [r.layout.name for r in result.reports] == ["fsdp", "refused"]
    assert result.best.layout.name == "fsdp"
    refused = result.reports[1]
    assert not refused.fits and note in refused.measurement.error
    assert refused.measurement.params_bytes == _report("replicated").measurement.params_bytes
    if "memory" in note:
        assert refused.measurement.temp_bytes == int(18.82 * 2**30)
    table = result.table().splitlines()
    # a note under the table, not numbered like a row; its overshoot said once, by the
    # closest-layout message where nothing fits
    assert table[-1].startswith("  ^ row 2, refused: XLA:CPU") and note in table[-1]
    assert "over" not in table[-1]
    assert " -  not compiled" in table[-2]
    record = json.loads(result.write_json(tmp_path / "plan.json").read_text())["layouts"][1]
    assert record["fits"] is False and record["flops_per_device"] is None
    assert note in record["error"] and record["estimated_step_seconds"] is None


def test_a_ctrl_c_ranks_the_layouts_planned_so_far(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    calls = _failing_compiles(monkeypatch, lambda n: KeyboardInterrupt() if n > 1 else None)
    fsdp = meshkit.PartitionRules.fsdp("data", min_size=1024)
    layouts = [
        planning.Layout({"data": 8}, None, precision="f32", name="replicated"),
        planning.Layout({"data": 8}, fsdp, precision="f32", name="fsdp"),
        planning.Layout({"data": 8}, fsdp, precision="bf16", name="fsdp bf16"),
    ]
    result = planning.plan(_mlp_workload(), layouts, TARGET, progress=False)
    assert [r.layout.name for r in result.reports] == ["replicated"]
    assert result.not_planned == ("fsdp", "fsdp bf16") and result.best.layout.name == "replicated"
    record = json.loads(result.write_json(tmp_path / "plan.json").read_text())
    assert record["not_planned"] == ["fsdp", "fsdp bf16"]
    calls.clear()
    calls.append(1)  # the first compile stops: nothing to rank, the Ctrl-C goes on
    with pytest.raises(KeyboardInterrupt):
        planning.plan(_mlp_workload(), layouts, TARGET, progress=False)


@pytest.mark.once(8)
@pytest.mark.parametrize(
    ("name", "conv"),
    [
        ("same 3x3", {"window_strides": (1, 1), "padding": "SAME"}),
        ("strided valid 5x5", {"window_strides": (2, 2), "padding": "VALID"}),
        ("atrous", {"window_strides": (1, 1), "padding": "SAME", "rhs_dilation": (2, 2)}),
        (
            "transposed",
            {"window_strides": (1, 1), "padding": ((2, 2), (2, 2)), "lhs_dilation": (2, 2)},
        ),
    ],
)
def test_convolution_flops_count_only_taps_on_real_inputs(name: str, conv: dict) -> None:
    """Against XLA:CPU's own count for a program of one convolution (no loop)."""
    size = 5 if "5x5" in name else 3
    x = jnp.zeros((2, 9, 11, 3))
    w = jnp.zeros((size, size, 3, 4))

    def f(x, w):
        return jax.lax.conv_general_dilated(
            x, w, dimension_numbers=("NHWC", "HWIO", "NHWC"), **conv
        )

    compiled = jax.jit(f).lower(x, w).compile()
    counted = _hlo.program_counts(compiled.as_text() or "", [0]).dot_flops
    assert counted == pytest.approx((compiled.cost_analysis() or {})["flops"], rel=0.02), name


@pytest.mark.once(8)
def test_a_plan_for_other_devices_says_which_axes_to_change_or_scales(capsys) -> None:  # type: ignore[no-untyped-def]
    import argparse

    from recipes.transformer_lm import on_these_devices

    layout = planning.Layout("data=64,fsdp=1,model=1", data_axes=("data", "fsdp"))
    args = argparse.Namespace(layout="plan_h100x64.json", scale_to_devices=False)
    with pytest.raises(SystemExit, match=r"spans 64 devices, this run has 8: add "
                       r"--scale-to-devices to train it as data=8,fsdp=1,model=1"):  # fmt: skip
        on_these_devices(layout, 8, args)
    args.scale_to_devices = True
    assert on_these_devices(layout, 8, args).axis_sizes == {"data": 8, "fsdp": 1, "model": 1}
    assert "scaled to 8 devices: data=8,fsdp=1,model=1" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="its model axes do not divide them"):
        on_these_devices(planning.Layout("data=2,model=16"), 8, args)
    fsdp = planning.Layout("data=2,fsdp=16,model=2", data_axes=("data", "fsdp"))
    assert fsdp.scaled_to(8) is not None and fsdp.scaled_to(8).axis_sizes == {  # type: ignore[union-attr]
        "data": 1,
        "fsdp": 4,
        "model": 2,
    }


WORKLOADS = """
import jax, jax.numpy as jnp, optax
import flax.linen as nn
from meshkit import plan
from meshkit.train import classification_loss, linen_model

class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        return nn.Dense(10)(x)

def fixed():
    return plan.Workload(
        model=linen_model(Mlp(), jnp.zeros((1, 16))), tx=optax.sgd(0.1),
        loss_fn=classification_loss,
        batch={"image": jax.ShapeDtypeStruct((64, 16), jnp.float32),
               "label": jax.ShapeDtypeStruct((64,), jnp.int32)},
    )

def untraceable():
    workload = fixed()
    return plan.Workload(model=workload.model, tx=workload.tx, loss_fn=workload.loss_fn,
                         batch={"tokens": jax.ShapeDtypeStruct((64, 9), jnp.int32)})

def number():
    return 3
"""


@pytest.mark.once(8)
@pytest.mark.parametrize(
    ("function", "extra", "message"),
    [
        ("fixed", [], "returns a fixed model, which cannot take the remat policies "
         "['nothing_saveable'] that --remat asks for: pass --remat none"),
        ("number", [], "returned a int; expected a meshkit.plan.Workload(model=..."),
        ("untraceable", ["--remat", "none"], "could not be traced with the batch"),
        ("missing", [], "AttributeError"),
    ],
)  # fmt: skip
def test_a_workload_mistake_on_the_command_line_ends_in_one_line(
    tmp_path, monkeypatch, function: str, extra: list[str], message: str
) -> None:  # type: ignore[no-untyped-def]
    from meshkit.plan import _cli

    (tmp_path / "my_workloads.py").write_text(WORKLOADS)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = _cli.parser().parse_args(
        ["--workload", f"my_workloads:{function}", "--devices", "8", "--tensor", "1",
         "--fsdp", "1", "--quiet", *extra]
    )  # fmt: skip
    with pytest.raises(SystemExit) as stop:
        _cli.run(args)
    text = str(stop.value.code)
    assert message in text and "\n" not in text, text


@pytest.mark.once(8)
def test_sizes_that_give_no_layout_and_a_batch_one_layout_cannot_split_are_explained() -> None:
    from meshkit.plan import _cli

    args = _cli.parser().parse_args(["--devices", "8", "--tensor", "3", "--quiet"])
    with pytest.raises(SystemExit, match=r"from --tensor 3: every --tensor and --fsdp size must"):
        _cli.run(args)
    layouts = [
        planning.Layout({"data": 8}, precision="f32"),
        planning.Layout({"data": 1, "model": 8}, precision="f32"),
    ]
    result = planning.plan(_mlp_workload(batch_size=7), layouts, TARGET, progress=False)
    assert result.best.layout.name == "data=1,model=8"
    refused = result.reports[1]
    assert not refused.fits and refused.measurement.error == (
        "the global batch (image: 7 rows, label: 7 rows) does not split over its 8 data "
        "shards (data); use a batch that is a multiple of 8"
    )


@pytest.mark.once
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--devices", "0"], "argument --devices: expected a whole number of at least 1, got '0'"),
        (["--batch-size", "-8"], "argument --batch-size: expected a whole number of at least 1"),
        (["--devices", "8", "--slices", "3"], "--devices 8 does not split into --slices 3"),
        (
            ["--accelerator", "h900"],
            "argument --accelerator: unknown chip 'h900'; pass one of a100",
        ),
        (["--compiler", "tpu"], "--compiler tpu needs --topology, the TPU slice to compile for"),
        (["--efficiency", "compute=2"], "--efficiency compute=2: a fraction, above 0 and at"),
        (["--efficiency", "speed=1"], "--efficiency 'speed=1': expected name=fraction pairs"),
        (
            ["--topology", "v5e:2x4"],
            "--topology v5e:2x4 is for the TPU compiler: add --compiler tpu",
        ),
        (
            ["--accelerator", "v5e", "--compiler", "tpu", "--topology", "v4:2x2x2"],
            "--topology v4:2x2x2 is a slice of v4 chips but --accelerator is v5e: pass "
            "--accelerator v4 or a --topology of v5e chips (e.g. v5e:8x8)",
        ),
    ],
)
def test_a_target_the_command_line_cannot_mean_ends_in_one_line_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from meshkit.plan import _cli

    with pytest.raises(SystemExit) as stop:  # before JAX starts or a layout is traced
        _cli.main([*argv, "--quiet"])
    assert stop.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("python -m meshkit.plan: error: ") and message in last, last


@pytest.mark.once
def test_a_batch_no_layout_can_split_ends_in_one_line_naming_a_batch_that_splits() -> None:
    from meshkit.plan import _cli

    args = _cli.parser().parse_args(
        ["--devices", "8", "--batch-size", "12", "--tensor", "1", "--quiet"]
    )
    with pytest.raises(SystemExit) as stop:
        _cli.run(args)
    text = str(stop.value.code)
    assert text == (
        "python -m meshkit.plan: --batch-size 12 does not split over the data shards "
        "(data x fsdp) of any candidate layout (8); pass a multiple of 8, e.g. "
        "--batch-size 16"
    ), text
    layouts = [planning.Layout({"data": 8}, precision="f32")]
    result = planning.plan(_mlp_workload(batch_size=7), layouts, TARGET, progress=False)
    assert result.describe_choice() == (
        f"No candidate layout could be compiled for 8 x {TARGET.accelerator}; the first, "
        "'data=8': the global batch (image: 7 rows, label: 7 rows) does not split over its "
        "8 data shards (data); use a batch that is a multiple of 8."
    )


@pytest.mark.once
def test_more_devices_than_xla_cpu_compiles_for_ends_in_one_line_naming_the_way_out() -> None:
    from meshkit.plan import _cli

    args = _cli.parser().parse_args(["--devices", "4096", "--batch-size", "4096", "--quiet"])
    with pytest.raises(SystemExit) as stop:  # before a device is counted or a layout traced
        _cli.run(args)
    text = str(stop.value.code)
    assert "XLA:CPU compiles for at most 2048 devices" in text and "\n" not in text, text
    assert "--compiler tpu" in text and "Layout.scaled_to" in text


@pytest.mark.once
def test_an_idle_axis_of_a_model_with_logical_names_is_blamed_on_divisibility() -> None:
    from types import SimpleNamespace

    from meshkit.plan._planner import layout_rules
    from meshkit.plan._report import _idle

    rules = layout_rules(fsdp=True, tensor=False, logical=True)
    layout = planning.Layout({"data": 2, "fsdp": 512, "model": 1}, rules=rules)
    text = _idle(SimpleNamespace(layout=layout, idle_axes=("fsdp",)))
    assert "no dimension named embed divides evenly by its size" in text, text
    plain = planning.Layout({"data": 2, "fsdp": 512}, rules=layout_rules(
        fsdp=True, tensor=False, logical=False))  # fmt: skip
    assert "carry no logical axis names" in _idle(
        SimpleNamespace(layout=plain, idle_axes=("fsdp",))
    )


@pytest.mark.once(8)
def test_a_model_axis_that_shards_nothing_is_marked_and_ranked_after(tmp_path) -> None:  # type: ignore[no-untyped-def]
    layouts = [
        planning.Layout({"data": 1, "model": 8}, precision="f32"),  # no logical names: idle
        planning.Layout({"data": 8}, precision="f32"),
    ]
    result = planning.plan(_mlp_workload(), layouts, TARGET, progress=False, keep_idle=True)
    idle, used = (next(r for r in result.reports if r.layout is layout) for layout in layouts)
    assert idle.measurement.idle_axes == ("model",) and used.measurement.idle_axes == ()
    assert idle.measurement.params_bytes == used.measurement.params_bytes  # nothing sharded
    assert result.best is used and result.reports[-1] is idle
    assert "model=8 shards no parameter, so its devices repeat the same work" in result.table()
    record = json.loads(result.write_json(tmp_path / "plan.json").read_text())["layouts"][-1]
    assert record["idle_axes"] == ["model"]
    # by default the search leaves such a layout out, and says so
    default = planning.plan(_mlp_workload(), layouts, TARGET, progress=False)
    assert [r.layout.name for r in default.reports] == ["data=8"]
    assert default.dropped == ("data=1,model=8",)
    assert "left out: data=1,model=8: a model axis that shards no parameter" in default.table()


@pytest.mark.once(8)
def test_xla_warnings_and_alarms_are_counted_and_other_log_lines_pass_through(capfd) -> None:  # type: ignore[no-untyped-def]
    import os

    from meshkit.plan._measure import XlaLog, _xla_log

    log = XlaLog()
    with _xla_log(log):
        os.write(2, b"W1127 spmd_partitioner.cc:656] [SPMD] Involuntary full rematerialization.\n")
        os.write(2, b"E1127 something else the compiler said\n")
        os.write(
            2,
            b"E1130 00:41:07.1 slow_operation_alarm.cc:73] Constant folding an instruction "
            b"is taking > 1s:\n\n  %reduce.1 = f32[2048]{0} reduce(...)\n\nThis isn't "
            b"necessarily a bug; constant-folding is inherently a trade-off.\n",
        )
        os.write(2, b"W1130 and after the alarm, the compiler again\n")
    assert (log.reshards, log.alarms) == (1, 1)
    err = capfd.readouterr().err
    assert "something else the compiler said" in err and "Involuntary" not in err
    assert "and after the alarm, the compiler again" in err
    assert "reduce" not in err and "trade-off" not in err and "Constant folding" not in err


@pytest.mark.once
@pytest.mark.parametrize(
    ("warned", "names"),
    [(4, "a, b, c, d"), (5, "a, b, c and 2 more"), (1, "a")],
)
def test_the_plan_says_which_layouts_xla_resharded_or_alarmed_in_a_line_each(
    warned, names, caplog
) -> None:  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    from meshkit.plan._planner import _say_xla_log

    plans = [
        SimpleNamespace(resharding_warnings=2, compile_alarms=1, layout=SimpleNamespace(name=name))
        for name in "abcde"[:warned]
    ] + [
        SimpleNamespace(
            resharding_warnings=0, compile_alarms=0, layout=SimpleNamespace(name="quiet")
        )
    ]
    with caplog.at_level("WARNING", logger="meshkit"):
        _say_xla_log(plans)  # pyright: ignore[reportArgumentType]
    alarms, reshards = caplog.messages
    assert f'({2 * warned} "Involuntary full rematerialization" warnings)' in reshards
    assert f"in {warned} layout(s): {names}. Their memory" in reshards
    assert f"XLA said {warned} time(s) that compiling took long" in alarms
    assert f"in {warned} layout(s): {names}. It concerns the compile time only" in alarms
