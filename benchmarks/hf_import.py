"""Reading a LLaMA checkpoint of the transformers layout into its shardings: memory and time.

    python -m benchmarks hf_import            # or: python -m benchmarks.hf_import

A random Llama-shaped checkpoint of about 1 GB (float32: 16 layers of width 1024, 16
query and 8 key and value heads, 32,000 tokens, untied), written in shards of 200 MB by
``save_hf_params``, is read by ``load_hf_params`` with FSDP over 8 devices (every
weight's model width split 8 ways): in 8 processes of one fake CPU device each, as 8
hosts would read it, and in one process of 8. Each process reports the growth of its
peak resident memory over the read (VmHWM, reset just before; on CPU devices the
placed shards are resident memory too) against its share of the checkpoint plus the
largest tensor, plus 25%, and the read's wall time. Beside them, the time to read the
files once (``cat > /dev/null``, after a first read warmed the page cache, as the
processes' reads find it), and with 8 ``cat`` at once: the width splits the columns of
most weights, so each of 8 hosts reads every byte, and on this machine the 8 share its
cores. ``cat`` fills no memory; a fresh process that reads the files into numpy arrays
(the least an import onto one host's devices does: every byte lands in new memory)
is the third figure.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.quoted import markdown_table

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}
PROCESSES = 8
LAYOUTS = ((PROCESSES, 1), (1, PROCESSES))
"""(processes, devices per process) of the two reads, FSDP over all devices."""
TABLE = {"vocab": None, "mlp": None, "heads": None, "kv_heads": None, "kv": None, "embed": "data"}


def abstract_params(model: Any, mesh: Any) -> Any:
    """The model's parameters as ``jax.ShapeDtypeStruct``s in their FSDP shardings."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    import meshkit

    boxed = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    rules = meshkit.PartitionRules(logical=TABLE)
    shardings = meshkit.infer_shardings(boxed, mesh, rules)["params"]
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        nn.unbox(boxed)["params"],
        shardings,
    )


def read_here(folder: str) -> dict[str, float]:
    """In one of the processes: the read's seconds, and the growth of peak memory over it."""
    import jax

    import meshkit
    from benchmarks._harness import peak_rss_mib, reset_peak_rss
    from meshkit.models import llama_from_hf, load_hf_params

    model = llama_from_hf(folder, max_length=8)
    target = abstract_params(model, meshkit.make_mesh("data=-1"))
    jax.block_until_ready(jax.numpy.zeros(1))  # the backend started before the timer
    reset_peak_rss()
    before = peak_rss_mib()
    began = time.perf_counter()
    params = jax.block_until_ready(load_hf_params(folder, target))
    seconds = time.perf_counter() - began
    share = sum(s.data.nbytes for leaf in jax.tree.leaves(params) for s in leaf.addressable_shards)
    return {"seconds": seconds, "growth_mib": peak_rss_mib() - before, "share_mib": share / 2**20}


def write_checkpoint(folder: Path) -> dict[str, float]:
    """A random checkpoint of ``CONFIG`` in ``folder``: its bytes and largest tensor."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np

    from meshkit.models import llama_from_hf, save_hf_params

    model = llama_from_hf(CONFIG, max_length=8)
    boxed = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda x: rng.standard_normal(x.shape, np.float32) * 0.02, nn.unbox(boxed)["params"]
    )
    save_hf_params(params, model, folder, max_shard_bytes=200 * 2**20)
    sizes = [leaf.nbytes for leaf in jax.tree.leaves(params)]
    return {"checkpoint_mib": sum(sizes) / 2**20, "largest_tensor_mib": max(sizes) / 2**20}


def weight_files(folder: Path) -> list[str]:
    return sorted(str(p) for p in folder.glob("*.safetensors"))


def cat_seconds(folder: Path, readers: int = 1) -> float:
    """Seconds for ``readers`` processes at once to read the weight files, each once
    (after a first read warmed the page cache)."""
    files = weight_files(folder)
    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
    began = time.perf_counter()
    cats = [subprocess.Popen(["cat", *files], stdout=subprocess.DEVNULL) for _ in range(readers)]
    if any(cat.wait() for cat in cats):
        raise RuntimeError("cat failed")
    return time.perf_counter() - began


def into_memory_seconds(folder: Path) -> float:
    """Seconds for a fresh process to read the weight files into its memory (numpy
    arrays), the least an import that places every byte on one host's devices does."""
    files = weight_files(folder)
    code = (
        "import time, numpy as np; t = time.perf_counter(); "
        f"a = [np.fromfile(f, np.uint8) for f in {files!r}]; print(time.perf_counter() - t)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(done.stdout)


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0]).parse_args(argv)
    from benchmarks._harness import save
    from meshkit.testing import run_processes

    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "checkpoint"
        result: dict[str, Any] = write_checkpoint(folder)
        result["files"] = len(weight_files(folder))
        result["cat_seconds"] = cat_seconds(folder)
        result["cats_seconds"] = cat_seconds(folder, PROCESSES)
        result["into_memory_seconds"] = into_memory_seconds(folder)
        from benchmarks.hf_import import read_here as in_each  # by module name, not __main__

        for processes, devices in LAYOUTS:
            result[f"{processes}x{devices}"] = run_processes(
                in_each,
                str(folder),
                num_processes=processes,
                devices_per_process=devices,
                timeout=600,
                log_dir=Path(scratch) / f"logs-{processes}x{devices}",
            )
    print(tables(result)["table"])
    save("hf_import", result, tables)


def tables(run: dict[str, Any]) -> dict[str, str]:
    """``table``: each layout's share of the checkpoint and peak memory growth per
    process against the bound, and the slowest read against reading the files."""
    rows = []
    for processes, devices in LAYOUTS:
        runs = run[f"{processes}x{devices}"]
        share = runs[0]["share_mib"]
        slowest = max(r["seconds"] for r in runs)
        cat = run["cats_seconds"] if processes > 1 else run["cat_seconds"]
        fresh = (
            f"{run['into_memory_seconds']:.2f} s ({slowest / run['into_memory_seconds']:.2f}×)"
            if processes == 1
            else ""
        )
        rows.append(
            [
                f"{processes} × {devices} device{'s' * (devices > 1)}",
                f"{share:,.0f}",
                f"{(share + run['largest_tensor_mib']) * 1.25:,.0f}",
                f"**{max(r['growth_mib'] for r in runs):,.0f}**",
                f"{slowest:.2f} s",
                f"{cat:.2f} s ({processes} at once)" if processes > 1 else f"{cat:.2f} s",
                f"**{slowest / cat:.2f}×**",
                fresh,
            ]
        )
    header = ["processes × devices", "share MiB", "bound: (share + largest) × 1.25"]
    header += ["peak growth MiB (most)", "read (slowest)", "`cat` of the files", "read / `cat`"]
    header += ["files into a fresh process's memory (read / it)"]
    title = (
        f"{run['checkpoint_mib']:,.0f} MiB in {run['files']} files, largest tensor "
        f"{run['largest_tensor_mib']:,.0f} MiB, FSDP over {PROCESSES} devices\n\n"
    )
    return {"table": title + markdown_table(header, rows, "l" + "r" * 7)}


if __name__ == "__main__":
    main()
