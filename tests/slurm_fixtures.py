"""The session-scoped ``slurm_cluster`` fixture: a real one-node Slurm with accounting.

Load it from ``tests/conftest.py`` with ``pytest_plugins = ["slurm_fixtures"]``. The cluster is
started once per session by ``launch/slurm_local.sh`` in a temporary directory, on free ports
(so parallel sessions on one machine do not collide), and stopped by PID at the end.
Accounting (MariaDB + slurmdbd) is on: submitit reads job states from ``sacct`` and, without it,
waits forever for a job that died before writing its result.

Outside CI the fixture skips when not root or when the Slurm/MariaDB binaries are missing
(install them with ``launch/install_slurm.sh --with-accounting``); with ``CI=true`` it fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from distaccum.cluster.local import free_ports

REPO = Path(__file__).resolve().parent.parent
SLURM_LOCAL = REPO / "launch" / "slurm_local.sh"
BINARIES = (
    "slurmctld",
    "slurmd",
    "slurmdbd",
    "sbatch",
    "srun",
    "squeue",
    "sacct",
    "sacctmgr",
    "scontrol",
    "mariadbd",
    "mariadb-install-db",
)
START_TIMEOUT_S = 120


@dataclass(frozen=True)
class SlurmCluster:
    """A running local cluster: pass ``env`` to every subprocess that talks to it."""

    state_dir: Path
    """Holds slurm.conf, logs (``log/``), pid files (``run/``) and daemon state."""
    env: dict[str, str]
    """``os.environ`` plus ``SLURM_CONF`` pointing at this cluster."""

    def run(self, *argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run a command against this cluster and capture its text output."""
        return subprocess.run(
            list(argv), env=self.env, capture_output=True, text=True, check=check, timeout=timeout
        )

    def logs(self) -> str:
        """The tail of every daemon log, for assertion messages."""
        parts = []
        for log in sorted((self.state_dir / "log").glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-15:]
            parts.append(f"--- {log.name}\n" + "\n".join(tail))
        return "\n".join(parts)


def _unavailable() -> str | None:
    """Why no cluster can be started here, or None."""
    if os.geteuid() != 0:
        return "the local Slurm cluster needs root (slurmd runs jobs as their owner)"
    missing = [name for name in BINARIES if shutil.which(name) is None]
    if missing:
        return (
            f"Slurm/MariaDB binaries missing ({', '.join(missing)}); "
            "install them with launch/install_slurm.sh --with-accounting"
        )
    return None


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """Start a local Slurm cluster with accounting for the session; stop it afterwards."""
    problem = _unavailable()
    if problem:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but {problem}", pytrace=False)
        pytest.skip(problem)
    state = tmp_path_factory.mktemp("slurm")
    ctld, slurmd, dbd, db = free_ports(4)
    env = {
        **os.environ,
        "SLURM_CONF": str(state / "slurm.conf"),
        "SLURM_LOCAL_CTLD_PORT": str(ctld),
        "SLURM_LOCAL_SLURMD_PORT": str(slurmd),
        "SLURM_LOCAL_DBD_PORT": str(dbd),
        "SLURM_LOCAL_DB_PORT": str(db),
    }
    cluster = SlurmCluster(state_dir=state, env=env)
    try:
        start = subprocess.run(
            [str(SLURM_LOCAL), "start", str(state), "--accounting"],
            env=env,
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT_S,
        )
        if start.returncode != 0:
            pytest.fail(
                f"launch/slurm_local.sh start failed:\n{start.stderr}\n{cluster.logs()}", pytrace=False
            )
        yield cluster
    finally:
        subprocess.run([str(SLURM_LOCAL), "stop", str(state)], env=env, capture_output=True, timeout=120)
        # pytest keeps the last 3 temp dirs: keep the logs, drop the ~90 MB MariaDB data dir.
        shutil.rmtree(state / "mysql", ignore_errors=True)
