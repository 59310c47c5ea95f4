"""A process that ran ``distaccum.Trainer`` in-process and destroyed its own process group exits 0, every time.

Issue 55 saw such a two-rank process abort at interpreter exit once in about ten runs ("terminate called without
an active exception", SIGABRT: a job Slurm or Kubernetes then marks failed). The product now waits for the
completion callbacks it chains on the process group's work (the ledger's :meth:`drain`) and collects the engine's
reference cycles, which hold the groups, before leaving the group (``Trainer.finish``), so that no group thread
calls into Python once the interpreter finalizes. The ``stress`` test repeats the exit ``DISTACCUM_EXIT_RUNS``
times (100 by default: ``make stress``); the suite runs it a few times per engine on every ``make test``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import REPO, plan_env, torchrun

SCRIPT = REPO / "tests" / "fixtures" / "exit_cleanly.py"


def _exit_codes(root: Path, engine: str, runs: int) -> list[tuple[int, str]]:
    """(exit code, the output's tail when it failed) of ``runs`` launches of the script."""
    out = []
    for n in range(runs):
        proc = torchrun(
            str(SCRIPT), str(root / f"{engine}-{n}"), engine, cwd=root, env=plan_env(), timeout=120
        )
        out.append((proc.returncode, "" if proc.returncode == 0 else (proc.stdout + proc.stderr)[-3000:]))
    return out


@pytest.mark.dist
@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_a_trainer_process_that_destroyed_its_group_exits_0(tmp_path: Path, engine: str) -> None:
    codes = _exit_codes(tmp_path, engine, 2)
    assert [code for code, _ in codes] == [0, 0], "\n".join(tail for _, tail in codes)


@pytest.mark.stress
def test_a_hundred_trainer_processes_exit_0(tmp_path: Path) -> None:
    runs = int(os.environ.get("DISTACCUM_EXIT_RUNS", "100"))
    codes = _exit_codes(tmp_path, "fsdp", runs // 2) + _exit_codes(tmp_path, "ddp", runs - runs // 2)
    failed = [tail for code, tail in codes if code != 0]
    print(f"{len(codes) - len(failed)} of {len(codes)} exited 0")
    assert not failed, f"{len(failed)} of {len(codes)} exits failed; the first:\n{failed[0]}"
