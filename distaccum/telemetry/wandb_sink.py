"""Weights & Biases sink (rank 0 only, imported lazily by ``sinks.build_sinks``).

Offline by default: the run is written under ``<run_dir>/wandb/`` and needs no account or network
(``wandb sync <run_dir>/wandb/offline-run-*`` uploads it later). Online only when asked for
(``log.wandb_mode=online``) *and* an API key is available (``WANDB_API_KEY`` or a netrc entry);
otherwise it warns and stays offline rather than prompting for a login inside a worker. The key is
only ever read by wandb itself: this module checks that one exists and never prints or logs it.
"""

from __future__ import annotations

import netrc
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, cast
from urllib.parse import urlparse

from distaccum.rundir import Record

WANDB_ENV_DIRS = {
    "WANDB_DIR": ".",
    "WANDB_CACHE_DIR": "wandb/.cache",
    "WANDB_CONFIG_DIR": "wandb/.config",
    "WANDB_DATA_DIR": "wandb/.data",
    "WANDB_ARTIFACT_DIR": "wandb/.artifacts",
}
"""Every directory wandb writes to, relative to ``run_dir``: nothing lands in $HOME."""

RUN_ID_FILE = "wandb/run_id"
"""The wandb run id, kept so that a resumed run (``append``) continues the same wandb run."""


def api_key_available(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether wandb could authenticate without prompting: ``WANDB_API_KEY`` or a netrc entry."""
    if environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        return netrc.netrc(environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def resolve_mode(
    asked: str, environ: Mapping[str, str] = os.environ
) -> Literal["online", "offline", "disabled"]:
    """The mode to run wandb in: ``online`` needs a key, otherwise offline (with a warning)."""
    if asked == "online" and not api_key_available(environ):
        warnings.warn(
            "log.wandb_mode=online but no WANDB_API_KEY (or netrc entry) is set: "
            "logging offline instead; upload later with `wandb sync`",
            stacklevel=2,
        )
        return "offline"
    return cast(Literal["online", "offline", "disabled"], asked)  # LogConfig validated the choice


class WandbSink:
    """One wandb run per training run: ``wandb.log(record, step=step)`` per optimizer step, the run
    summary into ``run.summary``, ``finish()`` at close."""

    def __init__(
        self,
        run_dir: Path,
        config: dict[str, Any],
        *,
        mode: str = "offline",
        project: str = "distaccum",
        quiet: bool = False,
        resume: bool = False,
    ) -> None:
        run_dir = Path(run_dir).resolve()
        # wandb reads its directories from the environment only; this is rank 0's worker process,
        # so nothing else sees the change.
        for var, rel in WANDB_ENV_DIRS.items():
            path = run_dir / rel
            path.mkdir(parents=True, exist_ok=True)
            os.environ[var] = str(path)
        import wandb  # lazily: wandb is an optional dependency

        mode = resolve_mode(mode)
        id_file = run_dir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else None
        offline = mode != "online"
        settings = wandb.Settings(
            silent=quiet,
            console="off",  # our console sink owns stdout; wandb would otherwise wrap it
            x_disable_stats=offline,  # no system-metrics sampler (nor its cloud metadata probes) offline
            x_disable_machine_info=offline,
        )
        self.run = wandb.init(
            project=project,
            dir=str(run_dir),
            mode=mode,
            id=run_id,
            resume="allow" if resume else None,
            name=run_dir.name,
            config=config,
            settings=settings,
        )
        id_file.write_text(self.run.id + "\n")

    def log(self, record: Record) -> None:
        self.run.log(record, step=int(record["step"]))

    def close(self, summary: Record) -> None:
        self.run.summary.update(summary)
        self.run.finish()
