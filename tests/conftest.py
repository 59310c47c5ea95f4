"""Shared test helpers: run the real CLI in a subprocess and read what it wrote."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cli_server
import pytest

from distaccum.cluster.forked import leave
from distaccum.config import DEFAULT_EXTENSIONS_DIR

if TYPE_CHECKING:
    from distaccum.config import EngineConfig
    from distaccum.engines.base import EngineSpec
    from distaccum.split import Split

pytest_plugins = [
    "slurm_fixtures",  # the `slurm_cluster` fixture (real local Slurm)
    "serial_lock",  # `serial` tests run alone under pytest-xdist
    "tiers",  # each test's tier in runs/junit.xml (tests/tiers.py reports the time by tier)
]

# Nothing in the suite may download (no network here, nor in CI): Hugging Face offline for every test and every
# process it starts, set before anything imports huggingface_hub (which reads these once, when imported) and before
# the command server (tests/cli_server.py) preloads transformers and datasets for the commands it forks.
for _offline in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ[_offline] = "1"

REPO = Path(__file__).resolve().parents[1]
EXTENSIONS = Path(DEFAULT_EXTENSIONS_DIR).expanduser()
"""DeepSpeed's JIT-compiled ops, built once per machine (``make test`` builds them first): the runs' default."""
ENGINES: dict[str, dict[str, Any]] = {
    "ddp": {"name": "ddp"},
    "fsdp": {"name": "fsdp"},
    "zero0": {"name": "deepspeed", "zero_stage": 0},
    "zero1": {"name": "deepspeed", "zero_stage": 1},
    "zero2": {"name": "deepspeed", "zero_stage": 2},
    "zero3": {"name": "deepspeed", "zero_stage": 3},
    "accelerate": {"name": "accelerate"},
}
"""Every engine cell the engine-matrix tests run: name -> its ``engine`` config section."""
FAULTS = REPO / "tests" / "fixtures" / "faults"
"""A config directory with ``loss=injected``: the run's loss wrapped by the testing seam."""


def requires(module: str) -> Any:
    """Import an optional dependency a test file needs: without it the file is skipped, except under
    ``CI=true``, where a missing optional dependency (an extra that failed to install) fails the run
    instead of passing with the tests silently skipped. Call at module level."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:
        why = f"{module} is not importable ({err}); install distaccum's extras (make install)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but {why}", pytrace=False)
        pytest.skip(why, allow_module_level=True)


def fault(name: str, **kwargs: Any) -> str:
    """A fault of :mod:`distaccum.testing.faults` as a Hydra dict (for :func:`inject`)."""
    fields = "".join(f",{key}:{value}" for key, value in kwargs.items())
    return f"{{_target_:distaccum.testing.faults.{name}{fields}}}"


def inject(loss: str, *faults: str) -> list[str]:
    """CLI overrides that wrap the run's loss (the ``_target_`` of a summed loss) in
    :class:`distaccum.testing.Inject` with ``faults`` (see :func:`fault`): every worker the launcher starts
    installs them when it builds its components; the product itself has no fault switch."""
    return [
        "--config-dir",
        str(FAULTS),
        "loss=injected",
        f"loss.component={{_target_:{loss},_partial_:true}}",
        f"loss.faults=[{','.join(faults)}]",
    ]


@dataclass
class Run:
    """A finished ``distaccum`` invocation."""

    returncode: int
    stdout: str
    stderr: str
    run_dir: Path

    @property
    def records(self) -> list[dict[str, Any]]:
        lines = (self.run_dir / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]

    @property
    def summary(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "summary.json").read_text())


def cli_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """A command's environment: this one, unbuffered output, ``env`` on top, and no worker variables (a test never
    inherits a worker environment)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_STEP_ID", "SLURM_PROCID"):
        full_env.pop(var, None)
    return full_env


def distaccum_cli(
    argv: Sequence[str], *, cwd: Path, env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """``python -m distaccum ARGV`` in ``cwd``, its output captured (``subprocess.run``'s result and timeout), forked
    from this pytest process's command server (tests/cli_server.py) rather than a new interpreter."""
    return cli_server.run(argv, cwd=cwd, env=cli_env(env), timeout=timeout)


def final_hash(run_dir: Path) -> str:
    """The SHA-256 of the trained parameters as ``run_dir/final/`` holds them (any run, exact or not)."""
    from safetensors.torch import load_file

    from distaccum.exact.fixed_point import params_sha256

    return params_sha256(load_file(str(run_dir / "final" / "model.safetensors")).items())


def run_cli(
    command: str, run_dir: Path, *overrides: str, timeout: float = 180, env: dict[str, str] | None = None
) -> Run:
    """``python -m distaccum COMMAND overrides... run_dir=RUN_DIR log.console=quiet``."""
    proc = distaccum_cli(
        [command, *overrides, "log.console=quiet", f"run_dir={run_dir}"],
        cwd=run_dir.parent,
        env=env,
        timeout=timeout,
    )
    return Run(proc.returncode, proc.stdout, proc.stderr, run_dir)


def torchrun(
    *args: str,
    nproc: int = 2,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 180,
) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run --standalone --nproc_per_node=NPROC ARGS...``, its output captured."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *args,
    ]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def forked_torchrun(
    *args: str,
    nproc: int = 2,
    cwd: Path,
    env: dict[str, str] | None = None,
    timeout: float = 180,
) -> subprocess.CompletedProcess[str]:
    """:func:`torchrun` of a test's own worker script (a plan of runs, a matrix), torch's launcher and the ranks forked
    from this pytest process's command server (tests/cli_server.py) instead of a new interpreter each. The script
    ends each rank with :func:`distaccum.cluster.forked.leave`. Tests of torchrun itself (a user's script under it,
    ``-m distaccum``, a process's exit) use :func:`torchrun`."""
    return cli_server.run(
        ["--standalone", f"--nproc_per_node={nproc}", *args],
        cwd=cwd,
        env=cli_env(env),
        timeout=timeout,
        kind="torchrun",
    )


def train(run_dir: Path, *overrides: str, timeout: float = 180, check: bool = True) -> Run:
    """Run ``distaccum train``; with ``check`` a failure shows the workers' output."""
    run = run_cli("train", run_dir, *overrides, timeout=timeout)
    if check and run.returncode != 0:
        pytest.fail(
            f"distaccum train {' '.join(overrides)} exited {run.returncode}\n"
            f"stdout:\n{run.stdout[-3000:]}\nstderr:\n{run.stderr[-5000:]}"
        )
    return run


def check_golden(path: Path, text: str) -> None:
    """``text`` equals the golden file ``path`` as it was before the test ran. With DISTACCUM_UPDATE_GOLDEN=1 a
    difference rewrites the file and still fails (review the diff, then rerun), so a test can never pass by
    comparing a rendering with itself."""
    golden = path.read_text() if path.exists() else None
    if os.environ.get("DISTACCUM_UPDATE_GOLDEN") == "1" and text != golden:
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        pytest.fail(f"{path} rewritten: review `git diff {path}`, then rerun without DISTACCUM_UPDATE_GOLDEN")
    assert golden is not None, f"{path} missing; run with DISTACCUM_UPDATE_GOLDEN=1 to create it"
    assert text == golden, f"{path} differs; if intended, regenerate with DISTACCUM_UPDATE_GOLDEN=1"


def prose_lines(text: str, opens: Callable[[str], bool]) -> Iterator[str]:
    """A markdown page's lines outside fenced blocks and generated sections: a generated section runs from a line
    for which ``opens`` is true to the next ``<!-- NAME:end`` marker (both markers left out too)."""
    fence = generated = False
    for line in text.splitlines():
        if opens(line):
            generated = True
            continue
        if re.match(r"<!-- [\w:-]+:end", line):
            generated = False
            continue
        if line.startswith("```"):
            fence = not fence
            continue
        if not (fence or generated):
            yield line


def line_count(path: Path) -> int:
    """Lines of ``path`` (0 while it does not exist): records a run has written to ``metrics.jsonl``."""
    return len(path.read_text().splitlines()) if path.is_file() else 0


def sigterm_at_step(
    cmd: list[str], run_dir: Path, step: int, env: dict[str, str], timeout: float
) -> tuple[int, str]:
    """Start ``cmd`` (a ``distaccum train`` of ``run_dir``) in ``run_dir``'s parent, send it SIGTERM (what
    srun and torchrun deliver on preemption) once ``step`` records are written (or ``timeout`` s passed, or
    it ended), wait up to ``timeout`` s for it to end; its exit code and stderr."""
    assert cmd[1:3] == ["-m", "distaccum"], cmd
    proc = cli_server.popen(
        cmd[3:], cwd=run_dir.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + timeout
    while (
        line_count(run_dir / "metrics.jsonl") < step and time.monotonic() < deadline and proc.poll() is None
    ):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


@contextmanager
def one_rank_group(device: str) -> Iterator[None]:
    """A one-rank process group in this process for in-process ``Trainer`` tests: gloo on CPU, NCCL on
    CUDA (what a launched rank uses). Reuses a group that already exists."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=f"file://{Path(tmp) / 'store'}",
            rank=0,
            world_size=1,
            device_id=torch.device("cuda", 0) if cuda else None,
        )
        try:
            yield
        finally:
            from distaccum.runtime.procgroup import destroy_world

            destroy_world()  # DeepSpeed's cached groups too (see there)


def pytest_configure(config: pytest.Config) -> None:
    """No cyclic collection while the test modules import torch and the rest (resumed by pytest_collection_finish),
    as the product's own processes start (distaccum.cli.startup)."""
    from distaccum.cli.startup import pause

    pause()


def pytest_collection_finish(session: pytest.Session) -> None:
    """The libraries are loaded: freeze them out of every later collection and collect again."""
    from distaccum.cli.startup import resume

    resume()


@pytest.fixture(autouse=True)
def no_faults_left_behind() -> Iterator[None]:
    """Faults a test installed in this process (``distaccum.testing``) end with the test."""
    from distaccum import testing

    before = testing.installed()
    yield
    testing.uninstall()
    testing.install(*before)


@pytest.fixture(scope="module")
def cpu_group() -> Iterator[None]:
    """:func:`one_rank_group` on gloo for a whole test module (reusing a group that already exists)."""
    with one_rank_group("cpu"):
        yield


def engine_spec(
    engine: EngineConfig,
    split: Split,
    *,
    precision: str = "fp32",
    sync: str = "boundary",
    clip_norm: float | None = None,
    **extra: Any,
) -> EngineSpec:
    """The :class:`~distaccum.engines.base.EngineSpec` of ``engine`` (an ``EngineConfig``) at ``split`` on the
    CPU, for single-process engine tests; ``extra``: its optional fields (``reduce_dtype``, ...)."""
    import torch

    from distaccum.engines.base import EngineSpec, Precision

    return EngineSpec(
        engine=engine,
        precision=Precision.of(precision),
        split=split,
        sync=sync,
        clip_norm=clip_norm,
        device=torch.device("cpu"),
        **extra,
    )


def fresh_accelerate_state() -> None:
    """Forget Accelerate's process-wide state before an in-process run that stands for its own process.

    Accelerate fixes mixed precision and the device once per process (a second ``Accelerator`` with
    another one raises), so in-process tests that use it with different settings reset it first, as
    Accelerate's own test scripts do (``AcceleratorState._reset_state``)."""
    if "accelerate" in sys.modules:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)


def plan_worker(plan_file: str, train_each: Any, after: Any = None) -> None:
    """Entry of a test file that doubles as its worker script (under torch.distributed.run): join the gloo
    group, call ``train_each(values)`` for every config mapping of the plan, then ``after()``; print the
    traceback and exit non-zero on any failure, so the launching test shows it."""
    import traceback

    import torch

    from distaccum.runtime.contracts import DistEnv
    from distaccum.runtime.procgroup import ensure_process_group, shutdown

    code = 0
    try:
        ensure_process_group(DistEnv.from_environ(os.environ), torch.device("cpu"))
        for values in json.loads(Path(plan_file).read_text()):
            train_each(values)
        if after is not None:
            after()
        shutdown()
    except BaseException:  # noqa: BLE001 - report, then exit non-zero so the test shows it
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    leave(code)  # os._exit, except a forked rank that succeeded returns to torch's launcher


class PlanRuns:
    """The run directories of one plan launch: ``root/NAME`` per run, and the launch's output."""

    def __init__(self, root: Path, output: str) -> None:
        self.root, self.output = root, output

    def records(self, name: str) -> list[dict[str, Any]]:
        return [json.loads(line) for line in (self.root / name / "metrics.jsonl").read_text().splitlines()]

    def summary(self, name: str) -> dict[str, Any]:
        return json.loads((self.root / name / "summary.json").read_text())


def plan_env() -> dict[str, str]:
    """The environment of a plan's 2-rank launch: this one without a parent launch's rank variables, the
    checkout on the path, one intra-op thread, DeepSpeed on CPU with its op from the checkout's cache."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        OMP_NUM_THREADS="1",
        DS_ACCELERATOR="cpu",
        TORCH_EXTENSIONS_DIR=str(EXTENSIONS),
    )
    return env


def launch_recipe(
    script: Path, plan: list[dict[str, Any]], root: Path, timeout: float = 560, *, nproc: int = 2
) -> Any:
    """Write ``plan`` (config mappings) to ``root/plan.json`` and run ``script`` on it as the worker of an
    ``nproc``-rank torch.distributed.run launch (one intra-op thread each, DeepSpeed's op from the checkout's
    cache); fail the test with the output when the launch fails. Returns the completed process."""
    (root / "plan.json").write_text(json.dumps(plan))
    proc = forked_torchrun(
        str(script), str(root / "plan.json"), nproc=nproc, cwd=root, env=plan_env(), timeout=timeout
    )
    if proc.returncode:
        pytest.fail(f"runs failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def train_plan(root: Path, runs: dict[str, Sequence[str]], *, timeout: float = 560) -> dict[str, Run]:
    """Train each of ``runs`` (name -> ``distaccum train`` overrides) into ``root/NAME`` as ``distaccum train`` would,
    with one launch per world size (``trainer.nproc``, 2 by default) instead of one per run: the configs are
    composed here, and every rank trains them one after the other through the public Trainer, as the CLI's workers
    do (``tests/plan_train.py``). What the launcher itself prints or writes (status.json) is not there: tests of
    the launcher run ``distaccum train``."""
    from distaccum.cli.compose import compose_config
    from distaccum.config import to_mapping, with_overrides

    by_world: dict[int, list[dict[str, Any]]] = {}
    for name, overrides in runs.items():
        cfg = compose_config([*overrides, "log.console=quiet"])
        by_world.setdefault(cfg.trainer.nproc, []).append(
            to_mapping(with_overrides(cfg, {"run_dir": str(root / name)}))
        )
    out: dict[str, Run] = {}
    for world, plan in sorted(by_world.items()):
        folder = root / f"plan-world{world}"
        folder.mkdir(parents=True, exist_ok=True)
        proc = launch_recipe(REPO / "tests" / "plan_train.py", plan, folder, timeout, nproc=world)
        for values in plan:
            out[Path(values["run_dir"]).name] = Run(0, proc.stdout, proc.stderr, Path(values["run_dir"]))
    return out
