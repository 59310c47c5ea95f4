"""Verify a user's own ``Trainer`` script (``distaccum verify --script FILE [--nproc N] [-- ARGS]``).

The script runs as itself — once as the single-process reference, once per candidate split under the
launcher — through a separate entry, ``distaccum _verify_script REQUEST SCRIPT [ARGS]``, which runs the
file (``runpy``) with ``distaccum.Trainer`` replaced, in that process only, by a subclass that knows its
role from the request file: the reference trains plain PyTorch on the script's components
(:mod:`distaccum.verify.reference`), a candidate trains its split from the seed checkpoint with every
step recorded. The Trainer itself never changes role behind a script's back.
"""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

from distaccum import trainer as trainer_module
from distaccum.cluster.local import LaunchRecipe, launch
from distaccum.config import ConfigError, from_mapping, with_overrides
from distaccum.rundir import CONFIG, CONSOLE_LOG, SEED, read_json
from distaccum.split import Split
from distaccum.telemetry.sinks import Record
from distaccum.verify.candidates import candidate_splits
from distaccum.verify.console import log_tail, timed_run
from distaccum.verify.diagnosis import RunFacts
from distaccum.verify.reference import run_reference
from distaccum.verify.runner import VerifyJob

REQUEST = "verify_request.json"
"""The role file a run directory of ``verify --script`` gets."""


def role_overrides(request: dict[str, Any]) -> dict[str, Any]:
    """What a role changes in the script's configuration."""
    overrides: dict[str, Any] = {
        "run_dir": request["run_dir"],
        "verify.record": True,
        "trainer.check_every": 1,
        "log.console": "quiet",
        "log.wandb": False,
        "trainer.resume": False,
    }
    if request.get("init_from"):
        overrides["trainer.init_from"] = request["init_from"]
    if request["mode"] == "candidate":
        overrides.update(
            {
                "accum.micro_batch": request["micro_batch"],
                "accum.steps": request["accum_steps"],
                # the same split, stated as its global batch: a ramp (accum.ramp) ends there
                "accum.global_batch": request["micro_batch"]
                * request["accum_steps"]
                * int(request["world_size"]),
            }
        )
    return overrides


def verifying_trainer(request: dict[str, Any]) -> type[trainer_module.Trainer]:
    """A :class:`~distaccum.trainer.Trainer` subclass playing the role ``request`` names."""

    class VerifyingTrainer(trainer_module.Trainer):
        """The script's Trainer as verify's reference or candidate."""

        def __init__(self, config: Any = None, **kwargs: Any) -> None:
            super().__init__(config, **kwargs)
            self.cfg = with_overrides(self.cfg, role_overrides(request))

        def fit(self) -> Record:
            if request["mode"] != "reference":
                return super().fit()
            cfg = self.cfg  # one process: no group, no engine
            return run_reference(
                cfg,
                self.components,
                Path(cfg.run_dir),
                global_batch=cfg.global_batch(int(request["world_size"])),
                seed_out=Path(request["seed_out"]) if request.get("seed_out") else None,
            )

    return VerifyingTrainer


def run_script(request_file: Path, script: Path, args: list[str]) -> None:
    """Run ``script`` with ``args`` in this process, its ``distaccum.Trainer`` playing the requested role."""
    request = json.loads(Path(request_file).read_text())
    trainer_module.Trainer = verifying_trainer(request)  # type: ignore[misc]  # this process only
    sys.argv = [str(script), *args]
    runpy.run_path(str(script), run_name="__main__")


def _request(run_dir: Path, **fields: Any) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / REQUEST
    path.write_text(json.dumps({"run_dir": str(run_dir), **fields}, indent=2) + "\n")
    return path


def script_job(script: Path, args: list[str], nproc: int, root: Path, auto: bool) -> VerifyJob:
    """The verification of a script that trains with ``distaccum.Trainer``.

    The reference run goes first (one process): its Trainer writes the resolved config, from which
    the candidate splits follow (the script's own split on ``nproc`` ranks, plus others with ``auto``).
    """
    seed = root / SEED

    def entry(request: Path) -> list[str]:
        return ["-m", "distaccum", "_verify_script", str(request), str(script), *args]

    def reference(run_dir: Path) -> int:
        request = _request(run_dir, mode="reference", seed_out=str(seed), world_size=nproc)
        return subprocess.run([sys.executable, *entry(request)], check=False).returncode

    def candidate(split: Split, run_dir: Path) -> int:
        request = _request(
            run_dir,
            mode="candidate",
            init_from=str(seed),
            micro_batch=split.micro_batch,
            accum_steps=split.accum_steps,
            world_size=split.world_size,
        )
        recipe = LaunchRecipe(1, split.world_size, "127.0.0.1:0", "distaccum-verify", 0, str(run_dir))
        return launch(recipe, entry(request))

    ref_dir = root / "reference"
    code, seconds = timed_run(lambda: reference(ref_dir), ref_dir / CONSOLE_LOG)
    resolved = read_json(ref_dir / CONFIG)
    if code or not resolved:
        raise ConfigError(
            f"the script {script} failed as the verify reference (exit {code}); last lines of "
            f"{ref_dir}/{CONSOLE_LOG}:\n{log_tail(ref_dir)}"
        )
    resolved.pop("components", None)
    cfg = with_overrides(
        from_mapping(resolved),
        {
            "trainer.nproc": nproc,
            "trainer.nnodes": 1,
            "verify.splits": "auto" if auto else "config",
            "run_dir": str(root),
        },
    )
    summary = read_json(ref_dir / "summary.json")
    facts = RunFacts(
        tuple(summary.get("batch_stat_layers", ())),
        tuple(summary.get("random_layers", ())),
        cfg.accum.loss_norm,
    )
    return VerifyJob(
        cfg,
        candidate_splits(cfg),
        reference,
        candidate,
        lambda: facts,
        str(summary.get("model", script)),
        reference_ran=(code, seconds),
    )
