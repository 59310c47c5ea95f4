"""What a lost replica costs: torchft's replica groups (``ft.groups``) against the elastic restart, on one run (issue 60).

``python -m benchmarks.ft_cost [--out DIR] [--publish | --render]`` trains the same run twice on this machine
(``model=mlp``, fp32, global batch 24 of micro-batches of 2 over 3 ranks, K = 4, 40 steps; every loss call slowed by
``SLOW_S`` so that a step takes about 0.1 s, as a real step's compute would, instead of a few milliseconds) and
SIGKILLs one worker (from outside) once step ``KILL_AT`` is recorded:

- **ft**: three replica groups of one rank (``ft.groups=3``), torchft's Lighthouse at its default heartbeat timeout
  (5,000 ms); the killed group is restarted by ``distaccum train`` and heals from a live one;
- **elastic**: one DDP group of three ranks, ``trainer.max_restarts=1`` and a checkpoint every ``CHECKPOINT_EVERY``
  steps: torch elastic restarts every rank and they resume from the last checkpoint.

For each it records the wall time from the kill until the run's step ``KILL_AT`` + 2 is recorded, less two steps at
the run's median step time (``extra_s``: what the failure cost the run), the steps computed again, and for ft the
survivors' stall at the failed step (its ``time_s`` less the median), the work thrown away (``ft_lost_s``: the
failed attempt) and the healing group's quorum (``ft_quorum_s`` of its first step: its state fetched from a live
group). ``--publish`` keeps the result as :data:`STORE` and renders docs/failures.md's ``bench:ft_cost`` section;
``--render`` re-renders it from :data:`STORE`. On a 2-core shared machine the figures are for orientation only.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.launch import ROOT, provenance
from benchmarks.report import replace_section

STORE = ROOT / "docs" / "results" / "ft-cost.json"
"""The stored result docs/failures.md's ``bench:ft_cost`` section is rendered from."""
DOC = ROOT / "docs" / "failures.md"
DOCS_COMMAND = "python -m benchmarks.ft_cost --publish"
STEPS, KILL_AT, CHECKPOINT_EVERY, SLOW_S = 40, 12, 5, 0.02
BASE = [
    "model=mlp",
    "accum.global_batch=24",
    "accum.micro_batch=2",
    f"trainer.max_steps={STEPS}",
    f"trainer.checkpoint_every={CHECKPOINT_EVERY}",
    "trainer.save_final=false",
    "log.console=quiet",
    "--config-dir",
    str(ROOT / "tests" / "fixtures" / "faults"),
    "loss=injected",
    "loss.component={_target_:distaccum.losses.mse,_partial_:true}",
    f"loss.faults=[{{_target_:distaccum.testing.faults.SlowLoss,seconds:{SLOW_S}}}]",
]
VARIANTS = {
    "ft": ["trainer.nproc=1", "ft.groups=3", "ft.min_groups=1"],
    "ft_1s": ["trainer.nproc=1", "ft.groups=3", "ft.min_groups=1", "ft.heartbeat_timeout_ms=1000"],
    "elastic": ["trainer.nproc=3", "trainer.max_restarts=1"],
}


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _pid(ranks: Path, deadline: float) -> int:
    while time.monotonic() < deadline:
        files = sorted(ranks.glob("rank-*.json"))
        if files:
            return int(json.loads(files[0].read_text())["pid"])
        time.sleep(0.05)
    raise RuntimeError(f"{ranks} never appeared")


def _wait_step(metrics: Path, step: int, proc: subprocess.Popen, deadline: float) -> float:
    while time.monotonic() < deadline:
        if len(_records(metrics)) >= step:
            return time.monotonic()
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended (exit {proc.returncode}) before step {step}")
        time.sleep(0.02)
    raise RuntimeError(f"step {step} was never recorded")


def run_variant(name: str, out: Path) -> dict[str, Any]:
    """One run of ``name``, its worker killed after step :data:`KILL_AT`; what the failure cost."""
    run_dir = out / name
    args = [sys.executable, "-m", "distaccum", "train", *BASE, *VARIANTS[name], f"run_dir={run_dir}"]
    env = {"PYTHONPATH": str(ROOT), "RUST_LOG": "warn", "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 600
    # ft: group 0's records are the run's (it is never killed); group 1 is killed. elastic: rank 1 of the one group.
    ft = name.startswith("ft")
    metrics = run_dir / ("groups/g0-a0/metrics.jsonl" if ft else "metrics.jsonl")
    ranks = run_dir / ("groups/g1-a0/ranks" if ft else "ranks")
    _wait_step(metrics, KILL_AT, proc, deadline)
    victim = _pid(ranks, deadline) if ft else int(json.loads((ranks / "rank-00001.json").read_text())["pid"])
    killed = time.monotonic()
    subprocess.run(["kill", "-KILL", str(victim)], check=False)
    after = _wait_step(metrics, KILL_AT + 2, proc, deadline)
    stdout, stderr = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: distaccum train exited {proc.returncode}:\n{stderr[-3000:]}")
    records = _records(metrics)
    step_s = statistics.median(float(r["time_s"]) for r in records[2:])
    result: dict[str, Any] = {
        "median_step_s": step_s,
        "extra_s": after - killed - 2 * step_s,
        "steps_recomputed": 0,
    }
    if ft:
        failed = max(records, key=lambda r: float(r["time_s"]))
        healed = [
            r
            for g in sorted((run_dir / "groups").glob("g1-a*"))
            for r in _records(g / "metrics.jsonl")
            if r.get("ft_healed")
        ]
        result.update(
            {
                "stall_s": float(failed["time_s"]) - step_s,
                "lost_s": float(failed["ft_lost_s"]),
                "heal_quorum_s": float(healed[0]["ft_quorum_s"]) if healed else None,
                "healed_at_step": int(healed[0]["step"]) if healed else None,
                "steps_recomputed": 0,
                "groups_at_failed_step": failed["ft_groups"],
            }
        )
    else:
        resumed = re.search(r"resumed from \S+step-0*(\d+)", stdout + stderr)
        last = int(resumed.group(1)) if resumed else 0
        result.update({"resumed_from_step": last, "steps_recomputed": KILL_AT + 1 - last})
    return result


def settings() -> dict[str, Any]:
    """The run's settings and the defaults docs/failures.md names beside the figures."""
    from distaccum.ft.config import FtConfig

    defaults = FtConfig()
    return {
        "ranks": 3,
        "accum_steps": 4,
        "steps": STEPS,
        "kill_after_step": KILL_AT,
        "checkpoint_every": CHECKPOINT_EVERY,
        "ft_heartbeat_timeout_ms_default": defaults.heartbeat_timeout_ms,
        "ft_timeout_s_default": defaults.timeout_s,
        "torchft_timeout_s_default": 60,
    }


def render(results: dict[str, Any]) -> str:
    ft, el = results["ft"], results["elastic"]
    rows = [
        "| path | the failure's extra wall time | steps computed again | survivors' stall at the failed step | "
        "work thrown away | healing group's quorum |",
        "|---|---|---|---|---|---|",
    ]
    for name, heartbeat in (("ft", "5,000"), ("ft_1s", "1,000")):
        f = results[name]
        rows.append(
            f"| ft (3 groups of 1 rank, `ft.heartbeat_timeout_ms={heartbeat.replace(',', '')}`) | {f['extra_s']:.2f} s | "
            f"{f['steps_recomputed']} (the failed step's window recomputed by the groups left) | {f['stall_s']:.2f} s | "
            f"{f['lost_s']:.2f} s | {f['heal_quorum_s']:.2f} s (at step {f['healed_at_step']}) |"
        )
    rows += [
        f"| elastic restart (1 group of 3 ranks, checkpoint every {CHECKPOINT_EVERY} steps) | {el['extra_s']:.2f} s | "
        f"{el['steps_recomputed']} (resumed from step {el['resumed_from_step']}) | every rank restarts | "
        f"{el['steps_recomputed']} step(s) | n/a |",
    ]
    return (
        "\n".join(rows)
        + f"\n\nMedian step: {ft['median_step_s']:.2f} s (ft), {el['median_step_s']:.2f} s (elastic)."
    )


def publish(results: dict[str, Any]) -> None:
    STORE.parent.mkdir(parents=True, exist_ok=True)
    STORE.write_text(json.dumps(results, indent=2) + "\n")
    DOC.write_text(replace_section(DOC.read_text(), "ft_cost", render(results), by=DOCS_COMMAND))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.ft_cost", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--publish", action="store_true")
    parser.add_argument("--render", action="store_true")
    args = parser.parse_args(argv)
    if args.render:
        results = json.loads(STORE.read_text())
    else:
        out = args.out or Path(tempfile.mkdtemp(prefix="ft-cost-"))
        results = {name: run_variant(name, out) for name in VARIANTS}
        results["provenance"] = provenance(DOCS_COMMAND, device="cpu", world_size=3)
        results["settings"] = settings()
    print(render(results))
    if args.publish or args.render:
        publish(results)


if __name__ == "__main__":
    main(sys.argv[1:])
