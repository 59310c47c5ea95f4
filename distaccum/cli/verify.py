"""``distaccum verify``: a config (Hydra overrides) or a user's own Trainer script (``--script``), run by
the library (:func:`distaccum.verify.runner.verify`, :mod:`distaccum.verify.script`); this module only
reads argv and turns the result into an exit code: 0 all candidates match, 1 a mismatch or a failed run,
2 bad input."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distaccum.cli.compose import to_run_config
from distaccum.cli.exitcodes import EXIT_CONFIG, EXIT_OK
from distaccum.cli.startup import resume as resume_collection


def verify_task(dcfg: Any, *, to: str = "local") -> int:
    """The Hydra task behind ``distaccum verify``; exits 2 on bad input, 1 on a mismatch. ``to``: the launcher the
    candidates run on (``--to``; Ray Train's workers for ``ray``)."""
    from distaccum.cluster import launcher_class
    from distaccum.verify.runner import verify

    launcher = launcher_class(to)
    try:
        cfg = to_run_config(dcfg)
        launcher.prepare(
            cfg
        )  # the local launcher's workers load their libraries while the reference runs here
        result = verify(cfg, echo=lambda line: print(line, flush=True), launcher=launcher.launch)
    except ValueError as err:
        print(f"distaccum: invalid configuration: {err}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None
    if result.exit_code:
        raise SystemExit(result.exit_code)
    return EXIT_OK


def script_main(argv: list[str]) -> int:
    """``distaccum verify --script FILE [--nproc N] [--auto] [--run-dir DIR] [-- ARGS]``."""
    from distaccum.verify.runner import run_verify
    from distaccum.verify.script import script_job

    parser = argparse.ArgumentParser(
        prog="distaccum verify --script",
        description="Verify a script that trains with distaccum.Trainer: run it as a single-process reference "
        "and as candidate splits under the launcher, and compare them step by step.",
    )
    parser.add_argument(
        "--script", type=Path, required=True, help="the Python script (its Trainer is verified)"
    )
    parser.add_argument("--nproc", type=int, default=2, help="ranks of the candidate run (default 2)")
    parser.add_argument("--auto", action="store_true", help="also try other splits of the same global batch")
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="where the runs and verify.json go (default runs/verify-<script>-<time>)",
    )
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script (after --)")
    try:
        opts = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0) and EXIT_CONFIG
    if not opts.script.is_file():
        print(f"distaccum: --script {opts.script}: no such file", file=sys.stderr)
        return EXIT_CONFIG
    if opts.nproc < 1:
        print(f"distaccum: --nproc must be >= 1, got {opts.nproc}", file=sys.stderr)
        return EXIT_CONFIG
    args = opts.args[1:] if opts.args[:1] == ["--"] else opts.args
    root = opts.run_dir or Path("runs") / f"verify-{opts.script.stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        job = script_job(opts.script.resolve(), args, opts.nproc, root, opts.auto)
    except ValueError as err:
        print(f"distaccum: {err}", file=sys.stderr)
        return EXIT_CONFIG
    return run_verify(job, root, echo=lambda line: print(line, flush=True)).exit_code


VERIFY_USAGE = """\
usage: distaccum verify [overrides] [--config-dir DIR] [--to {targets}]
       distaccum verify --script FILE [--nproc N] [--auto] [--run-dir DIR] [-- ARGS]

Trains the configured run as one or more candidates (the configured split; with verify.splits=auto every valid
split of the same global batch, up to verify.max_candidates) on local workers (--to ray: on Ray Train's workers),
and compares each, step by step, with one process taking every step's whole global batch in one forward/backward
(the reference, from the same seed weights): loss, gradient norm, per-step parameter digests, then the final
weights. Prints a table, writes run_dir/verify.json, and names the first diverging step and parameter with a
diagnosis. --script verifies your own torchrun script's Trainer the same way (`distaccum verify --script FILE
--help`).

keys (override as for `distaccum train`, e.g. verify.splits=auto):
{keys}

exit codes: 0 every candidate agrees within the tolerance; 1 a candidate disagrees or failed; 2 bad input,
reported before any run starts.
docs: docs/verification.md; every key: docs/configuration.md"""


def verify_help() -> str:
    """``distaccum verify --help``."""
    from distaccum.cli.helptext import config_keys
    from distaccum.cluster import launchers
    from distaccum.config import VerifyConfig

    targets = "|".join(launcher.name for launcher in launchers(verifies=True))
    return VERIFY_USAGE.format(keys="\n".join(config_keys("verify", VerifyConfig)), targets=targets)


def verify_main(argv: list[str], run_hydra: Callable[[Callable[[Any], int], list[str]], None]) -> int:
    """``distaccum verify``: a script (``--script``) or a config (Hydra overrides; ``--to NAME`` runs the candidates
    with a launcher that verifies (:data:`distaccum.cluster.LAUNCHERS`): ``ray`` on Ray Train, ``local``, the
    default, on local workers)."""
    script = any(a == "--script" or a.startswith("--script=") for a in argv)
    if not script and any(a in ("-h", "--help") for a in argv):  # verify's own, not Hydra's help of train
        print(verify_help())
        return EXIT_OK
    if script:
        resume_collection()
        return script_main(argv)
    from distaccum.cluster import launchers

    to = argparse.ArgumentParser(add_help=False)
    to.add_argument("--to", choices=[launcher.name for launcher in launchers(verifies=True)], default="local")
    opts, rest = to.parse_known_args(argv)
    run_hydra(lambda dcfg: verify_task(dcfg, to=opts.to), rest)
    return EXIT_OK


def verify_script_entry(argv: list[str]) -> None:
    """``distaccum _verify_script REQUEST SCRIPT [ARGS]``: one role of a ``verify --script`` run."""
    from distaccum.verify.script import run_script

    run_script(Path(argv[0]), Path(argv[1]), argv[2:])
