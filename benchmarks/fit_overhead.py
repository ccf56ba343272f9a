"""``fit`` against a bare loop, timed from outside the call, each run a fresh process.

    python -m benchmarks fit_overhead            # any backend; on CPU, 1 and 8 fake devices
    python -m benchmarks fit_overhead --rounds 1 --cases mlp-1-2000,cnn-8-300

What a user waits for: a new process builds the model, the state and the data, then
the timer starts; the timer stops when the last step's state is ready. Compiles fall
inside the timed part on both sides. Candidates, each in a process of its own, in
turn (A B C A B C ...):

- bare loop: the jitted train step (``make_train_step``) called once per step over 16
  batches placed on the devices before the timer (on several CPU devices it waits for
  step k-1 after queuing step k, as ``fit`` does there; elsewhere it never waits);
- fit: ``meshkit.train.fit`` with ``InputSettings(resident=True)`` and
  ``Dispatch(steps_per_dispatch='auto')``, logging every 10 steps, one checkpoint at
  the last step, no progress bar: everything a run of ``fit`` does;
- fit at a fixed size: the same with the size ``'auto'`` did not choose (1 step per
  dispatch for the tiny MLP, 8 for the CNN), so each case shows whether the choice paid.

Models: a tiny MLP on the 8x8 digits (batch 64: the bookkeeping dominates) and the
MNIST CNN of the Flax ensembling HOWTO on the digits resized to 28x28 (batch 128).
Reports the median seconds of each candidate and ratios of totals to the bare loop.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks.quoted import markdown_table, versions
from recipes._args import positive_int

CASES: dict[str, tuple[str, str, int, int, str]] = {
    # key: (title, model, devices, steps, the fixed size beside 'auto')
    "mlp-1-20000": ("tiny MLP, 1 device, 20,000 steps", "mlp", 1, 20000, "1"),
    "mlp-1-2000": ("tiny MLP, 1 device, 2,000 steps", "mlp", 1, 2000, "1"),
    "cnn-1-600": ("MNIST CNN, 1 device, 600 steps", "cnn", 1, 600, "8"),
    "mlp-8-6000": ("tiny MLP, 8 devices, 6,000 steps", "mlp", 8, 6000, "1"),
    "cnn-8-300": ("MNIST CNN, 8 devices, 300 steps", "cnn", 8, 300, "8"),
}


def child(model: str, devices: int, steps: int, candidate: str) -> dict[str, Any]:
    """One candidate in this process: the seconds from the first step's call to the last
    step's state, and what ``fit`` chose."""
    import meshkit

    meshkit.distributed.initialize(cpu_devices=devices)
    import collections

    import jax

    from benchmarks._harness import TinyMLP, digits_classifier
    from meshkit import data, train
    from meshkit.models import MnistCNN

    on_cpu = jax.devices()[0].platform == "cpu"
    mesh = meshkit.make_mesh("data=-1", devices=jax.devices()[:devices])
    size, batch, module = (8, 64, TinyMLP()) if model == "mlp" else (28, 128, MnistCNN())
    sharding = meshkit.batch_sharding(mesh)
    source, fresh_state, step = digits_classifier(module, image_size=size, mesh=mesh)
    state = fresh_state()
    if candidate == "bare":
        host = data.TrainPipeline(source, global_batch_size=batch, sharding=sharding, seed=0)
        placed = jax.block_until_ready(
            [jax.device_put(host.local_batch(k), sharding) for k in range(16)]
        )
        wait = on_cpu and mesh.size > 1
        queued: collections.deque[Any] = collections.deque()
        began = time.perf_counter()
        for k in range(steps):
            state, metrics = step(state, placed[k % 16])
            if wait:
                queued.append(metrics)
                if len(queued) > 1:
                    jax.block_until_ready(queued.popleft())
        jax.block_until_ready(state)
        return {"seconds": time.perf_counter() - began}
    resident = data.TrainPipeline(
        source,
        global_batch_size=batch,
        sharding=sharding,
        seed=0,
        input_settings=data.InputSettings(resident=True),
    )
    size_setting: Any = candidate if candidate == "auto" else int(candidate)
    with tempfile.TemporaryDirectory() as workdir:
        began = time.perf_counter()
        result = train.fit(
            state,
            step,
            resident,
            num_steps=steps,
            workdir=workdir,
            checkpoints=train.Checkpoints(every=steps),
            logging=train.Logging(progress=False),
            dispatch=train.Dispatch(steps_per_dispatch=size_setting),
        )
        jax.block_until_ready(result.state)
        seconds = time.perf_counter() - began
    if result.preempted:
        raise SystemExit("benchmark stopped: a run was asked to stop (SIGTERM or Ctrl-C)")
    return {
        "seconds": seconds,
        "dispatch": result.dispatch,
        "steps_per_dispatch": result.steps_per_dispatch,
        "compiles": result.train_step_compiles,
        "own_steps_per_second": result.steps_per_second,
    }


def run_child(model: str, devices: int, steps: int, candidate: str) -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.fit_overhead", "--child"]
    command += [model, str(devices), str(steps), candidate]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        sys.stderr.write(done.stderr[-3000:])
        raise SystemExit(f"{' '.join(command)} failed (exit {done.returncode})")
    return json.loads(lines[-1][len("RESULT ") :])


def measure(key: str, rounds: int) -> dict[str, Any]:
    name, model, devices, steps, fixed = CASES[key]
    candidates = {"bare loop": "bare", "fit, 'auto'": "auto", f"fit, N={fixed}": fixed}
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in candidates}
    labels = list(candidates)
    for round_index in range(rounds):
        shift = round_index % len(labels)  # rotate the order: no candidate always follows another
        for label in labels[shift:] + labels[:shift]:
            runs[label].append(run_child(model, devices, steps, candidates[label]))
    seconds = {label: [r["seconds"] for r in rs] for label, rs in runs.items()}
    bare = sum(seconds["bare loop"])
    row = {
        "case": name,
        "rounds": rounds,
        "median_seconds": {label: sorted(s)[len(s) // 2] for label, s in seconds.items()},
        "over_bare": {label: bare / sum(s) for label, s in seconds.items()},
        "auto_chose": sorted({r["steps_per_dispatch"] for r in runs["fit, 'auto'"]}),
        "auto_dispatch": [r["dispatch"] for r in runs["fit, 'auto'"]],
        "compiles": {label: [r.get("compiles") for r in rs] for label, rs in runs.items()},
    }
    print(
        f"{name}: "
        + ", ".join(
            f"{label} {row['median_seconds'][label]:.2f} s ({row['over_bare'][label]:.2f}x)"
            for label in labels
        )
        + f"; auto chose {row['auto_chose']}",
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        model, devices, steps, candidate = argv[1:5]
        print("RESULT " + json.dumps(child(model, int(devices), int(steps), candidate)))
        return
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=positive_int, default=3, help="processes per candidate")
    parser.add_argument("--cases", default=",".join(CASES), help=f"any of {','.join(CASES)}")
    args = parser.parse_args(argv)
    keys = [key for key in args.cases.split(",") if key]
    unknown = sorted(set(keys) - set(CASES))
    if unknown:
        parser.error(f"--cases: unknown {unknown}; choose from {','.join(CASES)}")
    from benchmarks._harness import save

    save("fit_overhead", {"cases": [measure(key, args.rounds) for key in keys]}, tables)


def tables(run: dict[str, Any]) -> dict[str, str]:
    """``table``: each case's median seconds of the bare loop and of ``fit`` (fresh
    processes, timed from outside, compiles included), ``fit`` / bare as rates from totals,
    what ``'auto'`` chose, and the size it did not choose."""
    rows = []
    for case in run["cases"]:
        median, over = case["median_seconds"], case["over_bare"]
        auto = "fit, 'auto'"
        fixed = next(label for label in median if label.startswith("fit, N="))
        rows.append(
            [
                case["case"],
                f"{median['bare loop']:.2f} s",
                f"{median[auto]:.2f} s",
                f"**{over[auto]:.2f}×**",
                ", ".join(str(n) for n in case["auto_chose"]),
                f"{over[fixed]:.2f}× ({fixed.removeprefix('fit, ')})",
            ]
        )
    header = ["case", "bare loop", "`fit`, `'auto'`", "`fit` / bare", "`'auto'` chose"]
    return {
        "versions": versions(run["environment"], devices=False),  # each case names its own
        "table": markdown_table([*header, "the other size / bare"], rows),
    }


if __name__ == "__main__":
    main()
