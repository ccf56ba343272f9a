"""A one-node SLURM cluster started for the tests, and only for them.

``SlurmCluster.start(root)`` writes a ``slurm.conf`` for this host's cores and memory into
``root``, starts a ``munged`` of its own (its own key and socket, so a MUNGE daemon already
on the machine is never used or stopped), then ``slurmctld`` and ``slurmd`` on free ports,
and waits until the node takes jobs. Commands run against it through ``cluster.env``
(``SLURM_CONF`` points at the written config), so a cluster the machine may already
belong to is never touched. ``stop()`` cancels the jobs it ran and stops its daemons.

It needs root (the daemons run as root here) and the distribution's ``slurm-wlm`` and
``munge`` packages, which it installs with ``apt-get`` when they are missing;
``unavailable()`` says why it cannot start, for a skip.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
PACKAGES = ("slurm-wlm", "munge")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _missing_daemons() -> list[str]:
    return [name for name in DAEMONS if shutil.which(name, path="/usr/sbin:/usr/bin") is None]


def unavailable() -> str | None:
    """Why a test cluster cannot start here (``None`` when it can), installing what is missing."""
    if os.name != "posix" or os.geteuid() != 0:
        return "starting slurmctld, slurmd and munged needs root"
    if not _missing_daemons():
        return None
    if shutil.which("apt-get") is None:
        return f"{', '.join(_missing_daemons())} not installed and no apt-get to install them"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]
    result = subprocess.run(install, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:  # a fresh machine's package lists may be empty or stale
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, check=False)
        result = subprocess.run(install, env=env, capture_output=True, text=True, check=False)
    if _missing_daemons():
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        return f"could not install {' '.join(PACKAGES)}: {' | '.join(tail)}"
    return None


def _memory_mib() -> int:
    with Path("/proc/meminfo").open() as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


@dataclass
class SlurmCluster:
    """A running one-node cluster; ``env`` is the environment to run SLURM commands in."""

    root: Path
    node: str
    cpus: int
    memory_mib: int
    env: dict[str, str]
    daemons: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @classmethod
    def start(cls, root: Path, *, kill_wait: int = 30) -> SlurmCluster:
        """Writes the config under ``root`` and starts the daemons; stops them on failure."""
        root.mkdir(parents=True, exist_ok=True)
        for sub in ("state", "spool", "munge", "log"):
            (root / sub).mkdir(exist_ok=True)
        node = socket.gethostname().split(".")[0]
        cpus = os.cpu_count() or 1
        memory = int(_memory_mib() * 0.9)
        conf = root / "slurm.conf"
        munge_socket = root / "munge" / "munge.socket"
        conf.write_text(
            "\n".join(
                [
                    "ClusterName=meshkit-test",
                    f"SlurmctldHost={node}(127.0.0.1)",
                    f"SlurmctldPort={_free_port()}",
                    f"SlurmdPort={_free_port()}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    f"AuthInfo=socket={munge_socket}",
                    f"StateSaveLocation={root / 'state'}",
                    f"SlurmdSpoolDir={root / 'spool'}",
                    f"SlurmctldPidFile={root / 'slurmctld.pid'}",
                    f"SlurmdPidFile={root / 'slurmd.pid'}",
                    f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
                    "ProctrackType=proctrack/pgid",
                    "TaskPlugin=task/none",
                    "MpiDefault=none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    "SchedulerType=sched/builtin",
                    "AccountingStorageType=accounting_storage/none",
                    "JobCompType=jobcomp/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "ReturnToService=2",
                    f"KillWait={kill_wait}",
                    "InactiveLimit=0",
                    "MinJobAge=3600",
                    f"NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory} "
                    "State=UNKNOWN",
                    "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        (root / "munge").chmod(0o700)
        env = {**os.environ, "SLURM_CONF": str(conf)}
        cluster = cls(root=root, node=node, cpus=cpus, memory_mib=memory, env=env)
        log = root / "log"
        try:
            cluster._spawn(
                [
                    "munged",
                    "--foreground",
                    "--force",
                    f"--socket={munge_socket}",
                    f"--key-file={key}",
                    f"--pid-file={root / 'munge' / 'munged.pid'}",
                    f"--seed-file={root / 'munge' / 'munged.seed'}",
                    f"--log-file={log / 'munged.log'}",
                ]
            )
            cluster._wait_for(munge_socket.exists, "munged to open its socket", 20)
            cluster._spawn(["slurmctld", "-D", "-i", "-f", str(conf)])
            cluster._spawn(["slurmd", "-D", "-f", str(conf), "-N", node])
            cluster._wait_for(cluster._node_idle, f"node {node} to take jobs", 60)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _spawn(self, command: list[str]) -> None:
        name = Path(command[0]).name
        with (self.root / "log" / f"{name}.out").open("ab") as out:
            process = subprocess.Popen(
                command, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.daemons.append(process)

    def _wait_for(self, ready: Callable[[], bool], what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for process in self.daemons:
                if process.poll() is not None:
                    name = Path(str(process.args[0])).name  # pyright: ignore[reportIndexIssue]
                    raise RuntimeError(
                        f"{name} exited with code {process.returncode} while waiting for "
                        f"{what}; logs in {self.root / 'log'}"
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout} s for {what}; logs in {self.root / 'log'}")
            time.sleep(0.2)

    def _node_idle(self) -> bool:
        state = self.run(["sinfo", "-h", "-n", self.node, "-o", "%t"], check=False).stdout
        return state.strip() in ("idle", "mix", "alloc")

    def run(
        self, command: list[str], *, check: bool = True, timeout: float = 60, **kwargs
    ) -> subprocess.CompletedProcess[str]:
        """Runs a SLURM command (``sbatch``, ``squeue``...) against this cluster."""
        return subprocess.run(
            command,
            env=kwargs.pop("env", self.env),
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout,
            **kwargs,
        )

    def stop(self) -> None:
        """Cancels every job, then stops the daemons this cluster started (and only those)."""
        if any(process.poll() is None for process in self.daemons[1:]):
            self.run(["scancel", "--full", "--signal=KILL", "--user=root"], check=False)
            self.run(["scancel", "--user=root"], check=False)
        for process in reversed(self.daemons):
            if process.poll() is None:
                process.terminate()
        for process in reversed(self.daemons):
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.daemons.clear()
