"""Project tasks: ``nox -s tests lint typecheck docs bench``; ``nox -s slurm`` alone."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["tests", "lint", "typecheck", "docs"]
nox.options.reuse_existing_virtualenvs = True

PYTHON = "3.11"

# Installed packages arrive with their bytecode compiled (uv leaves it out by default), and
# the tests' own processes may write theirs: where PYTHONDONTWRITEBYTECODE is set, every
# Python process the suite starts (recipes, docs blocks, the processes of a multi-process
# test, hundreds in all) would otherwise compile jax, flax and optax from source again,
# about a second each.
os.environ.setdefault("UV_COMPILE_BYTECODE", "1")


# pytest-xdist workers for the single-process passes: one per core, at most 4. Each
# worker is a JAX process with its own fake devices; a test file stays on one worker, so
# the compiled functions its tests share are compiled once.
WORKERS = str(min(os.cpu_count() or 1, 4))


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The tests at 1 and at 8 fake CPU devices (docstring examples at 8), then the
    multi-process tests and those that start a recipe of their own, then the SLURM
    tests (see ``slurm``)."""
    session.install("-e", ".[test]")
    _install_transformers(session)
    args = ["--durations=15", *session.posargs]  # the slowest tests, to keep CI fast
    parallel = ["-n", WORKERS, "--dist", "loadfile"]
    single = "not multiprocess and not slurm and not tpu and not gpu_plan"
    env = _test_env(session)
    session.run(
        "pytest",
        "tests",
        "-m",
        single,
        *parallel,
        *args,
        env={"MESHKIT_TEST_DEVICES": "1", **env},
    )
    session.run("pytest", "-m", single, *parallel, *args, env={"MESHKIT_TEST_DEVICES": "8", **env})
    # Each starts JAX processes of its own, which use about 1.4 of 2 cores: two tests at a
    # time, but those that check their processes' timing (signals, heartbeats, stalls,
    # timed dispatches: marked ``exclusive``) one at a time, on the cores they were
    # written for.
    multiprocess = "multiprocess and not tpu"
    session.run(
        "pytest", "tests", "-m", f"{multiprocess} and not exclusive", *parallel, *args, env=env
    )
    session.run("pytest", "tests", "-m", f"{multiprocess} and exclusive", *args, env=env)
    _slurm_tests(session, args, env=env)


def _install_transformers(session: nox.Session) -> None:
    """torch's CPU build and transformers: the reference the LLaMA checkpoint tests
    compare with (tests/test_hf_llama.py). The CPU wheel comes from the machine's pip
    find-links folders (``PIP_FIND_LINKS``) where one lies there, else from PyTorch's CPU
    index; a plain ``torch`` from PyPI would be a CUDA build of several GB."""
    tag = f"cp{PYTHON.replace('.', '')}"
    folders = os.environ.get("PIP_FIND_LINKS", "").split()
    wheels = sorted(w for f in folders for w in Path(f).glob(f"torch-*+cpu-{tag}-*.whl"))
    if wheels:
        session.install(str(wheels[-1]))
    else:
        session.install("torch", "--index-url", "https://download.pytorch.org/whl/cpu")
    session.install("transformers>=4.45")


def _test_env(session: nox.Session) -> dict[str, str]:
    """The tests' environment: bytecode written (see ``UV_COMPILE_BYTECODE`` above) and
    JAX's persistent compilation cache for this run of the suite, empty at its start.

    Many tests and the processes they start compile the same programs (a recipe's
    train step, a docs page's model): compiled once, the others load them. Every
    program is still compiled at least once per run, and ``meshkit.count_compiles``
    counts a load from this cache as a compilation, so the "compiles once" checks keep
    their meaning.
    """
    directory = Path(session.create_tmp()) / "jax-compilation-cache"
    shutil.rmtree(directory, ignore_errors=True)
    return {
        "PYTHONDONTWRITEBYTECODE": "",
        "JAX_COMPILATION_CACHE_DIR": str(directory),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.1",
    }


def _slurm_tests(session: nox.Session, args: list[str], env: dict[str, str] | None = None) -> None:
    session.run("pytest", "tests/test_slurm.py", "-m", "slurm", "-rs", *args, env=env or {})


@nox.session(python=PYTHON)
def slurm(session: nox.Session) -> None:
    """The docs' SLURM scripts, preemption, requeue and failures on a one-node SLURM
    cluster the tests start (as root, installing slurm-wlm and munge with apt-get when
    missing; they skip, saying why, where they cannot). ``nox -s tests`` runs them last."""
    session.install("-e", ".[test]")
    _slurm_tests(session, ["--durations=10", *session.posargs])


@nox.session(python=PYTHON)
def hf(session: nox.Session) -> None:
    """The LLaMA checkpoint tests against transformers itself (installs torch's CPU build
    and transformers, see ``_install_transformers``): logits, greedy tokens, exports
    transformers loads, every layout and two processes. ``nox -s tests`` runs them too."""
    session.install("-e", ".[test]")
    _install_transformers(session)
    session.run("pytest", "tests/test_hf_llama.py", "-rs", "--durations=10", *session.posargs)


@nox.session(python=PYTHON)
def plan_tpu(session: nox.Session) -> None:
    """The planner through the TPU compiler (installs ``meshkit[tpu]``, libtpu, about
    a 100 MB download): the 1.3B model on a v5e-256 with its refused layouts as rows,
    two planners at once, and libtpu quiet on a machine without TPUs. Several minutes;
    not part of ``tests``, whose machines have no libtpu."""
    session.install("-e", ".[test,tpu]")
    session.run("pytest", "tests", "-m", "tpu", "-rs", "--durations=10", *session.posargs)


@nox.session(python=PYTHON)
def plan_gpu(session: nox.Session) -> None:
    """The planner through XLA:GPU for compile-only H100s (installs ``meshkit[gpu-plan]``:
    JAX's CUDA plugin, about 180 MB, no CUDA libraries and no GPU needed). Not part of
    ``tests``."""
    session.install("-e", ".[test,gpu-plan]")
    session.run("pytest", "tests", "-m", "gpu_plan", "-rs", *session.posargs)


@nox.session(python=PYTHON)
def layouts(session: nox.Session) -> None:
    """Every recipe for a few steps as 1 process x 8 devices and as 2 x 4: same results."""
    session.install("-e", ".[test]")
    session.run("python", "tests/layout_equivalence.py", *session.posargs)


@nox.session(python=False)
def first_hour(session: nox.Session) -> None:
    """A fresh clone and venv: the README's commands and every recipe, timed and checked."""
    session.run("python3", "tests/first_hour.py", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff format --check and ruff check."""
    session.install("ruff>=0.6")
    session.run("ruff", "format", "--check", ".")
    session.run("ruff", "check", ".")


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """pyright over the package, recipes, benchmarks and tests."""
    session.install("-e", ".[test]", "pyright>=1.1.380", "nox")
    session.run("pyright")


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Builds the docs site with mkdocs --strict."""
    session.install("-e", ".[docs,recipes]")
    session.run("mkdocs", "build", "--strict", "--site-dir", "site")


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Runs every benchmark in benchmarks/ (A B A B comparisons; prints tables, writes JSON)."""
    session.install("-e", ".[test]")
    session.run("python", "-m", "benchmarks", *session.posargs)
