"""Start one world of worker processes (torchrun's environment contract), wait, clean up; and say what ran where.

Each rank is ``python -m MODULE ARGS...`` with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT and
``OMP_NUM_THREADS=1`` (torchrun's default with several ranks per node), in its own session so a
timeout or a failed rank kills exactly this launch's processes. ``os.wait4`` gives each rank's
peak RSS as the kernel saw it. :func:`provenance` records the code (commit, uncommitted changes, a digest of the
sources) and the environment that define a run, for every stored result.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distaccum.cluster.local import free_ports

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Launch:
    """What one launch did."""

    ok: bool
    codes: list[int]
    wall_s: float
    peak_rss_mb: float
    """Largest ``ru_maxrss`` of the ranks, MiB."""
    load_1m: tuple[float, float]
    """1-minute load average before and after: the launch alone adds about its world size."""
    tail: str
    """The end of the combined output when a rank failed or timed out."""


def rank_env(rank: int, world: int, port: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of one rank (``extra`` last)."""
    env = {k: v for k, v in os.environ.items() if k not in ("DISTACCUM_VERIFY",)}
    env.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
    )
    env.update(extra or {})
    return env


def _wait(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> tuple[list[int], list[float]]:
    """Exit codes and peak RSS (MiB) of ``procs``; when one fails or time runs out the others are
    killed (a lone rank would wait in a collective forever)."""
    deadline = time.monotonic() + timeout_s
    codes: dict[int, int] = {}
    rss: dict[int, float] = {}
    while len(codes) < len(procs):
        for proc in procs:
            if proc.pid in codes:
                continue
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                codes[pid] = proc.returncode = os.waitstatus_to_exitcode(status)
                rss[pid] = usage.ru_maxrss / 1024  # KiB on Linux
        if len(codes) < len(procs) and (any(codes.values()) or time.monotonic() > deadline):
            for proc in procs:
                if proc.pid not in codes:
                    os.killpg(proc.pid, signal.SIGKILL)  # its own session: this launch's processes only
                    _, status, usage = os.wait4(proc.pid, 0)
                    codes[proc.pid] = proc.returncode = os.waitstatus_to_exitcode(status) or -9
                    rss[proc.pid] = usage.ru_maxrss / 1024
        time.sleep(0.05)
    return [codes[p.pid] for p in procs], [rss[p.pid] for p in procs]


def launch(
    module: str, args: list[str], world: int, log: Path, timeout_s: float, env: dict[str, str] | None = None
) -> Launch:
    """Run ``python -m module args`` on ``world`` ranks (``env`` added to theirs); output goes to ``log``."""
    (port,) = free_ports(1)
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as sink:
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for rank in range(world):
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", module, *args],
                        env=rank_env(rank, world, port, env),
                        cwd=ROOT,
                        stdout=sink,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
            codes, rss = _wait(procs, timeout_s)
        except (
            BaseException
        ):  # Ctrl-C, SIGTERM (benchmarks.run turns it into SystemExit): the ranks, in their own
            for proc in procs:  # sessions, would not get the signal and would run on
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            raise
    wall = time.perf_counter() - start
    ok = not any(codes)
    why = f"timed out after {timeout_s:.0f} s; " if wall >= timeout_s else ""
    tail = "" if ok else f"{why}exit codes {codes}:\n" + log.read_text(errors="replace")[-4000:]
    return Launch(ok, codes, wall, max(rss), (load_before, os.getloadavg()[0]), tail)


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def source_digest(folders: tuple[str, ...] = ("distaccum", "benchmarks")) -> str:
    """sha256 (first 12 hex digits) of every Python and shell file under ``folders``, by path and content: names the
    exact code of a run whose commit had uncommitted changes."""
    digest = hashlib.sha256()
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and path.suffix in (".py", ".sh") and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what the platform says."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            return next(
                (line.split(":", 1)[1].strip() for line in info if line.startswith("model name")),
                platform.processor() or "unknown",
            )
    except OSError:
        return platform.processor() or "unknown"


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def provenance(command: str, *, device: str, world_size: int, precision: str = "fp32") -> dict[str, Any]:
    """The code and environment that define a run: commit (and whether distaccum/ or benchmarks/ differed from it),
    the sources' digest, torch and the other packages' versions, the CPU model and count, threads per rank, world
    size, device and backend, the date and the command."""
    import torch

    dirty = _git("status", "--porcelain", "--", "distaccum", "benchmarks")
    return {
        "commit": _git("rev-parse", "--short=12", "HEAD") or "unknown",
        "uncommitted_changes": bool(dirty) if dirty is not None else None,
        "source_sha256": source_digest(),
        "date": datetime.date.today().isoformat(),
        "command": command,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "accelerate": _version("accelerate"),
        "deepspeed": _version("deepspeed"),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "threads": "CUDA" if device == "cuda" else "1 intra-op thread per rank",
        "world_size": world_size,
        "device": device,
        "device_name": torch.cuda.get_device_name(0) if device == "cuda" else "CPU",
        "backend": "nccl" if device == "cuda" else "gloo",
        "precision": precision,
    }


def train_cli(label: str, args: list[str], timeout_s: float = 3600) -> float:
    """Run ``python -m distaccum train ARGS`` from the repository (a study's one training run: ``label`` names it in
    the error); its wall time in seconds. Raises RuntimeError with the end of its stderr when it fails."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "distaccum", "train", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{label}: distaccum train exited {done.returncode}:\n{done.stderr[-4000:]}")
    return time.perf_counter() - start
