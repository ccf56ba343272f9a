"""Planning time and peak memory: a 1.3B model on 64 devices, a 7B model on 256.

    python -m benchmarks plan        # or: nox -s bench

Each plan runs as ``python -m meshkit.plan`` in a process of its own, so its peak
resident memory (``ru_maxrss``) is its own; the 1.3B-parameter GPT (24 layers, width
2048, context 2048, batch 256) is planned for 8 nodes of 8 H100s with 16 candidate
layouts, the 7B (32 layers, width 4096) for a 256-chip v5e pod with 12. The float32
weights alone would be 5.3 GB and 26 GB: a plan allocates none of them.

Then, side by side (A B A B), one layout of the 1.3B model compiled with its layers
under ``nn.scan`` and unrolled: the scan keeps compile time flat in depth.
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._harness import save
from benchmarks.quoted import markdown_table

PLANS = {
    "gpt-1.3b on 64 x h100 (8 nodes)": [
        "--model", "gpt-1.3b", "--accelerator", "h100", "--devices", "64", "--slices", "8",
        "--tensor", "1,2,4,8", "--remat", "none,nothing_saveable",
    ],
    "gpt-7b on 256 x v5e": [
        "--model", "gpt-7b", "--accelerator", "v5e", "--devices", "256", "--tensor", "1,4,8",
        "--fsdp", "16,64,256", "--remat", "none,nothing_saveable", "--vocab", "32000",
    ],
}  # fmt: skip
"""Each plan's command line for ``python -m meshkit.plan``."""

SCAN_ROUNDS = 2

_CHILD = (
    "import json, resource, sys, time; from meshkit.plan._cli import main; "
    "start = time.perf_counter(); main(sys.argv[1:]); "
    "print(json.dumps({'seconds': time.perf_counter() - start, "
    "'peak_rss_kib': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))"
)


def run_plan(argv: list[str]) -> dict[str, Any]:
    """Plans in a fresh process; its wall time, peak RSS and the plan's layouts."""
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "plan.json"
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, *argv, "--quiet", "--json", str(path)],
            capture_output=True,
            text=True,
            check=True,
        )
        measured = json.loads(done.stdout.strip().splitlines()[-1])
        layouts = json.loads(path.read_text())["layouts"]
    print(done.stdout.split("plan written")[0])
    compile_seconds = [layout["compile_seconds"] for layout in layouts]
    return {
        "candidates": len(layouts),
        "seconds": measured["seconds"],
        "peak_rss_gib": measured["peak_rss_kib"] / 2**20,
        "median_compile_seconds": statistics.median(compile_seconds),
        "num_params": layouts[0]["num_params"],
        "chosen": next((layout["layout"] for layout in layouts if layout["fits"]), None),
    }


def scan_versus_unrolled() -> dict[str, list[float]]:
    """Compile seconds of one 1.3B layout on 64 devices, scanned and unrolled, interleaved."""
    code = (
        "import jax, sys, time; jax.config.update('jax_platforms', 'cpu'); "
        "jax.config.update('jax_num_cpu_devices', 64); from meshkit import plan; "
        "w = plan.transformer_workload(num_layers=24, embed_dim=2048, num_heads=16, "
        "mlp_dim=8192, vocab_size=50304, length=2048, batch_size=256, "
        "scan_layers=sys.argv[1] == 'scan'); "
        "layout = plan.candidate_layouts(64, tensor=(8,), fsdp=(8,))[0]; "
        "r = plan.plan(w, [layout], plan.Target('h100', 64), progress=False).reports[0]; "
        "print(r.measurement.compile_seconds)"
    )
    seconds: dict[str, list[float]] = {"scan": [], "unrolled": []}
    for _ in range(SCAN_ROUNDS):
        for mode, times in seconds.items():
            done = subprocess.run(
                [sys.executable, "-c", code, mode], capture_output=True, text=True, check=True
            )
            times.append(float(done.stdout.strip().splitlines()[-1]))
    return seconds


def main() -> None:
    results: dict[str, Any] = {"plans": {}}
    for name, argv in PLANS.items():
        start = time.perf_counter()
        results["plans"][name] = run_plan(argv)
        print(f"{name}: {time.perf_counter() - start:.0f} s")
    print(f"\n{'plan':<36} {'layouts':>7} {'seconds':>8} {'s/layout':>9} {'peak RSS GiB':>13}")
    for name, row in results["plans"].items():
        print(
            f"{name:<36} {row['candidates']:>7} {row['seconds']:>8.1f} "
            f"{row['median_compile_seconds']:>9.1f} {row['peak_rss_gib']:>13.2f}"
        )
    compile_seconds = scan_versus_unrolled()
    results["compile_seconds_scan_vs_unrolled"] = compile_seconds
    scan, unrolled = (statistics.median(compile_seconds[m]) for m in ("scan", "unrolled"))
    print(f"\n1.3B, one layout: scanned {scan:.1f} s, unrolled {unrolled:.1f} s to compile")
    print(f"peak RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss} KiB")
    save("plan", results, tables)


def tables(run: dict[str, Any]) -> dict[str, str]:
    """``plans``: each plan's layouts, seconds, median compile and peak RSS; ``scan``:
    one layout's compile seconds, scanned against unrolled."""
    rows = [
        [
            name,
            str(row["candidates"]),
            f"{row['seconds']:.0f}",
            f"{row['median_compile_seconds']:.1f}",
            f"{row['peak_rss_gib']:.2f} GiB",
        ]
        for name, row in run["plans"].items()
    ]
    header = ["plan", "layouts", "seconds", "seconds per layout (median compile)", "peak RSS"]
    compile_seconds = run["compile_seconds_scan_vs_unrolled"]
    scan, unrolled = (statistics.median(compile_seconds[m]) for m in ("scan", "unrolled"))
    return {
        "plans": markdown_table(header, rows, "lrrrr"),
        "scan": (
            f"**{scan:.1f} s scanned, {unrolled:.1f} s unrolled** ({unrolled / scan:.1f}x; "
            f"interleaved, {len(compile_seconds['scan'])} rounds, median)"
        ),
    }


if __name__ == "__main__":
    main()
