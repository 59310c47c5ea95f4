"""Ray Train: the same :class:`~distaccum.trainer.Trainer` in the workers of Ray's ``TorchTrainer``.

:func:`train_on_ray` pre-flights the config here, joins Ray (``ray.address``, else RAY_ADDRESS, else a local Ray
started for the run) and runs ``trainer.nproc x trainer.nnodes`` workers. Each one (:func:`ray_worker`) trains in
the process group Ray made (distaccum uses it and leaves it to Ray: the ``initialized_group`` contract of
:mod:`distaccum.runtime.contracts`), writes ``run_dir`` as every launch does, and hands every
``ray.report_every``-th step record to ``ray.train.report`` (:class:`RayReporter`). When a worker dies, Ray restarts
the whole group up to ``trainer.max_restarts`` times, and the Trainer resumes from ``run_dir``'s newest checkpoint,
as after a torch elastic restart. :func:`ray_recipe` is the pure part (what would run, shown by ``distaccum submit --to ray
--dry-run``, :func:`ray_dry_run`); :func:`launch_on_ray` is a launcher for ``distaccum verify``'s candidates.

``ray`` is an optional dependency (``pip install "distaccum[ray]"``), imported only inside functions.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from distaccum.cluster.base import Launcher, LaunchError, Submitted, World
from distaccum.cluster.config import RayConfig
from distaccum.cluster.slurm import split_line
from distaccum.config import ConfigError, RunConfig, from_mapping, to_mapping
from distaccum.preflight import instantiate_components, preflight
from distaccum.rundir import Record
from distaccum.rundir.liveness import short_error
from distaccum.runtime.procgroup import planned_device
from distaccum.runtime.stopping import StopFlag
from distaccum.trainer import Trainer

INSTALL_HINT = 'pip install "distaccum[ray]"'
STORAGE_DIR = "ray"
"""Ray Train's own run state goes to ``run_dir/ray`` unless ``ray.storage_path`` says otherwise."""


class RayError(LaunchError):
    """Ray Train is not installed, or the run on Ray failed; the message says what happened and what to do."""


def _ray() -> ModuleType:
    """``ray`` with Ray Train v2 (the optional ``ray`` extra)."""
    try:
        import ray
        import ray.train.torch  # noqa: F401 - TorchTrainer needs the train extra, not only ray core
    except ImportError as err:
        raise RayError(f"Ray Train is not installed ({err}): {INSTALL_HINT}") from err
    if not hasattr(ray.train, "UserCallback"):  # exported by Ray Train v2 only
        raise RayError(
            "distaccum runs on Ray Train v2 (collective reports, rank 0's return value), and RAY_TRAIN_V2_ENABLED=0 "
            "selects v1: unset it"
        )
    return ray


# --- what would run (pure) ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RayRecipe:
    """What :func:`train_on_ray` asks Ray for."""

    workers: int
    """Ray Train workers: trainer.nproc x trainer.nnodes (one rank each)."""
    resources: dict[str, float]
    """Ray resources reserved for each worker."""
    backend: str
    """The process group Ray makes: nccl for GPU workers, gloo otherwise."""
    address: str | None
    """The Ray cluster joined; None: a local Ray started for the run."""
    address_from: str
    """Where the address came from: 'ray.address', 'RAY_ADDRESS' or 'local'."""
    storage_path: str
    """Ray Train's own run state (absolute, or a URI)."""
    name: str
    """Ray Train's run name (run_dir's last component)."""
    max_failures: int
    """Worker group restarts (trainer.max_restarts)."""
    timeout_s: int
    """Every collective's timeout (trainer.collective_timeout_s)."""
    run_dir: str

    @property
    def local_resources(self) -> dict[str, int]:
        """What a local Ray started for the run needs: every worker's share, rounded up (controller actors take none)."""
        return {k: max(1, math.ceil(v * self.workers)) for k, v in self.resources.items() if v > 0}

    def describe(self) -> list[str]:
        """The recipe as the lines ``distaccum submit --to ray --dry-run`` prints."""
        shown = ", ".join(f"{k} {v:g}" for k, v in self.resources.items())
        where = (
            f"the Ray cluster at {self.address} ({self.address_from})"
            if self.address
            else "a local Ray started for the run ("
            + ", ".join(f"{v} {k}{'s' if v > 1 else ''}" for k, v in self.local_resources.items())
            + ")"
        )
        return [
            f"Ray Train: {self.workers} worker(s) of {shown} each, process group {self.backend}, on {where}",
            f"restarts: up to {self.max_failures} (trainer.max_restarts); a restarted group resumes from run_dir's "
            "newest checkpoint",
            f"run_dir {self.run_dir}; Ray Train's own state in {self.storage_path}/{self.name}",
        ]


def ray_world_size(cfg: RunConfig) -> int:
    """Ranks of the Ray Train run (for the pre-flight): trainer.nproc x trainer.nnodes, one worker each. Raises
    ConfigError for an elastic trainer.nnodes=MIN:MAX (Ray Train starts a fixed number of workers)."""
    if not isinstance(cfg.trainer.nnodes, int):
        raise ConfigError(
            f"trainer.nnodes={cfg.trainer.nnodes} is an elastic range (torch elastic's); Ray Train starts a fixed "
            "number of workers, trainer.nproc x trainer.nnodes: give trainer.nnodes as a number"
        )
    return cfg.trainer.nproc * cfg.trainer.nnodes


def ray_recipe(cfg: RunConfig, environ: Mapping[str, str]) -> RayRecipe:
    """The Ray Train run of ``cfg`` (``environ``: this process's environment, for RAY_ADDRESS).

    Raises ValueError (ConfigError) for an elastic trainer.nnodes and for ``trainer.device=cuda`` without
    ``ray.gpus_per_worker``.
    """
    gpus = cfg.ray.gpus_per_worker
    workers = ray_world_size(cfg)
    if cfg.trainer.device == "cuda" and gpus <= 0:
        raise ValueError(
            "trainer.device=cuda on Ray needs GPU workers: set ray.gpus_per_worker (e.g. 1), or trainer.device=cpu"
        )
    resources = {"CPU": float(cfg.ray.cpus_per_worker)}
    if gpus > 0:
        resources["GPU"] = float(gpus)
    if cfg.ray.address:
        address, source = cfg.ray.address, "ray.address"
    elif environ.get("RAY_ADDRESS"):
        address, source = environ["RAY_ADDRESS"], "RAY_ADDRESS"
    else:
        address, source = None, "local"
    storage = cfg.ray.storage_path or str(Path(cfg.run_dir) / STORAGE_DIR)
    if "://" not in storage:
        storage = os.path.abspath(storage)
    return RayRecipe(
        workers=workers,
        resources=resources,
        backend="nccl" if gpus > 0 and cfg.trainer.device != "cpu" else "gloo",
        address=address,
        address_from=source,
        storage_path=storage,
        name=Path(os.path.abspath(cfg.run_dir)).name or "distaccum",
        max_failures=cfg.trainer.max_restarts,
        timeout_s=max(1, math.ceil(cfg.trainer.collective_timeout_s)),
        run_dir=cfg.run_dir,
    )


# --- in each worker -------------------------------------------------------------------------------------


def scalars(record: Record) -> Record:
    """A record's scalar fields (numbers, strings, flags, nulls): what a report carries of it."""
    return {k: v for k, v in record.items() if v is None or isinstance(v, (bool, int, float, str))}


@dataclass
class RayReporter:
    """The Trainer's ``on_step``: hands every ``every``-th optimizer step's record (and the last step's) to Ray.

    ``ray.train.report`` is collective in Ray Train v2: every worker must make the same calls (each passes a barrier
    of all workers), and a report waits until Ray's controller took the previous one from the worker (it polls every
    RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, 2 s by default); Ray also logs each report's metrics. So the workers report
    at the same step numbers, not every step, and only rank 0's reports carry the record's scalar fields: Ray keeps
    rank 0's metrics as the run's (records are identical on every rank but the timings). Every step's record stays
    in ``run_dir/metrics.jsonl``.
    """

    rank: int
    every: int
    last_step: int
    """trainer.max_steps: its record is always reported."""
    report: Callable[[dict[str, Any]], None]
    """``ray.train.report`` (a list's ``append`` in a unit test)."""

    def __call__(self, state: Any, record: Record) -> None:
        step = int(record["step"])
        if step % self.every == 0 or step >= self.last_step:
            self.report(scalars(record) if self.rank == 0 else {"step": step})


def _stop_flag() -> StopFlag | None:
    """SIGTERM/SIGUSR1 ask for a checkpoint and a stop, where this thread can receive them: signal handlers belong to
    the main thread, and Ray Train runs the train function in a thread of its own (then no flag: Ray ends its
    workers itself, and a restarted group resumes from the last periodic checkpoint)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    flag = StopFlag()
    flag.install()
    return flag


def _enter(cwd: str, run_dir: str) -> None:
    """Work in the driver's directory, as a local launch's workers do: Ray Train starts its workers in a directory of
    its own, where a relative run_dir, data path or ``mytask.py`` would not be found."""
    if Path(cwd).is_dir():
        os.chdir(cwd)
    elif not Path(run_dir).is_absolute():
        raise ConfigError(
            f"run_dir={run_dir!r} is relative, and the directory it is relative to ({cwd}, where the run was "
            "started) does not exist on this Ray node: give an absolute run_dir on storage every node shares"
        )


def ray_worker(payload: Mapping[str, Any]) -> Record:
    """One Ray Train worker (``train_loop_per_worker``): train ``payload["config"]`` (a config mapping) with the
    public Trainer in the process group Ray made; returns the run summary (Ray hands rank 0's to the driver)."""
    import ray.train

    cfg = from_mapping(payload["config"])
    _enter(str(payload["cwd"]), cfg.run_dir)
    reporter = RayReporter(
        ray.train.get_context().get_world_rank(),
        cfg.ray.report_every,
        cfg.trainer.max_steps,
        ray.train.report,
    )
    trainer = Trainer.of(
        cfg,
        instantiate_components(cfg),
        stop=_stop_flag(),
        on_step=reporter,
        check_components=False,  # the driver's pre-flight checked them
        # the reporter reads records only, never the model: records may come a step late (on CUDA), as without it
        lag_records=planned_device(cfg.trainer.device).type == "cuda",
    )
    return trainer.fit()


# --- the driver -----------------------------------------------------------------------------------------


@contextmanager
def ray_session(recipe: RayRecipe) -> Iterator[None]:
    """Ray for the run: the one this process joined already (left as it is), else the recipe's address, else a local
    Ray with the resources the workers need; left (or stopped) at the end."""
    ray = _ray()
    if ray.is_initialized():
        yield
        return
    if recipe.address:
        ray.init(address=recipe.address)
    else:
        local = recipe.local_resources
        ray.init(num_cpus=local.get("CPU", 1), num_gpus=local.get("GPU", 0), include_dashboard=False)
    try:
        yield
    finally:
        ray.shutdown()


def describe_failure(err: BaseException) -> str:
    """A failed Ray Train run's error in one line per failing rank (``WorkerGroupError``) or the controller's."""
    failures: Mapping[int, BaseException] | None = getattr(err, "worker_failures", None)
    if failures:
        return "; ".join(
            f"rank {rank}: {short_error(getattr(e, 'cause', None) or e)}"
            for rank, e in sorted(failures.items())
        )
    cause = getattr(err, "controller_failure", None) or err
    return short_error(cause)


def train_on_ray(cfg: RunConfig, *, callbacks: Sequence[Any] = (), check: bool = True) -> Record:
    """Train ``cfg`` on Ray Train's TorchTrainer and return rank 0's run summary (what ``Trainer.fit`` returns).

    ``check``: pre-flight the config here first (:func:`~distaccum.preflight.preflight`; ConfigError before any
    worker starts). ``callbacks``: ``ray.train.UserCallback`` objects, run in Ray's controller, which get every
    report (:class:`RayReporter`). Raises :class:`RayError` when Ray Train is missing or the run failed after its
    restarts, naming each failing rank's error.
    """
    _ray()
    # Ray Train v2's classes (what ray.train and ray.train.torch export under v2), named where they are defined
    from ray.train.torch import TorchConfig
    from ray.train.v2.api.config import FailureConfig, ScalingConfig
    from ray.train.v2.api.config import RunConfig as RayRunConfig
    from ray.train.v2.api.exceptions import TrainingFailedError
    from ray.train.v2.torch.torch_trainer import TorchTrainer

    try:
        recipe = ray_recipe(cfg, os.environ)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    if check:
        preflight(cfg, recipe.workers, nodes=int(cfg.trainer.nnodes))
    with ray_session(recipe):
        trainer = TorchTrainer(
            ray_worker,
            train_loop_config={"config": to_mapping(cfg), "cwd": os.getcwd()},
            scaling_config=ScalingConfig(
                num_workers=recipe.workers,
                use_gpu="GPU" in recipe.resources,
                resources_per_worker=recipe.resources,
            ),
            torch_config=TorchConfig(backend=recipe.backend, timeout_s=recipe.timeout_s),
            run_config=RayRunConfig(
                name=recipe.name,
                storage_path=recipe.storage_path,
                failure_config=FailureConfig(max_failures=recipe.max_failures),
                callbacks=list(callbacks) or None,
            ),
        )
        try:
            result = trainer.fit()
        except TrainingFailedError as err:
            raise RayError(
                f"the Ray Train run failed (after up to {recipe.max_failures} restart(s), trainer.max_restarts): "
                f"{describe_failure(err)}; its checkpoints are in {cfg.run_dir}: run it again to resume"
            ) from err
    summary = getattr(result, "return_value", None)  # v2 Result: rank 0's return value (typed as v1's Result)
    if not isinstance(summary, dict):
        raise RayError(f"Ray Train returned no summary from rank 0 (got {summary!r})")
    return summary


def launch_on_ray(cfg: RunConfig, config_file: Path) -> int:
    """A launcher for ``distaccum verify``'s candidates (the signature of
    :func:`~distaccum.cluster.local.launch_local`; the config travels to the workers as a mapping, ``config_file``
    only records it): 0 when the run finished, 1 (the error printed) when it failed."""
    try:
        train_on_ray(cfg, check=False)  # verify pre-flighted the configuration it derives the candidates from
    except (RayError, ConfigError) as err:
        print(f"distaccum: {err}", file=sys.stderr, flush=True)
        return 1
    return 0


def ray_dry_run(cfg: RunConfig, overrides: Sequence[str]) -> str:
    """What ``distaccum submit --to ray --dry-run`` prints: the command, the split and the recipe (starts nothing).
    Raises ConfigError (exit 2) for a configuration Ray cannot run."""
    lines = [f"submit --to ray {' '.join(overrides)}".rstrip(), *_recipe_lines(cfg)]
    if cfg.ft.enabled:
        lines += ft_lines(cfg)
    if importlib.util.find_spec("ray") is None:
        lines.append(f"note: Ray is not installed here: {INSTALL_HINT}")
    return "".join(f"distaccum: {line}\n" for line in lines)


def ft_lines(cfg: RunConfig) -> list[str]:
    """An ``ft.groups`` run on Ray, as its dry run says it (``distaccum submit --to ray`` does not start it)."""
    ft = cfg.ft
    return [
        f"ft: the torchft Lighthouse in one Ray actor (torchft.coordination.LighthouseServer, min_replicas="
        f"{ft.min_groups}, heartbeat_timeout_ms={ft.heartbeat_timeout_ms}), its address handed to every group",
        f"ft: one TorchTrainer per replica group ({ft.groups}), each of trainer.nproc={cfg.trainer.nproc} worker(s) "
        "with REPLICA_GROUP_ID=<i> and TORCHFT_LIGHTHOUSE, run_dir/groups/g<i>",
        f"ft: a dead group restarted by its own FailureConfig(max_failures=ft.restarts={ft.restarts}): it resumes "
        "its checkpoints and heals from a live group; the others train on",
        "note: distaccum submit --to ray does not start replica groups yet (this dry run says how they would run); "
        "use `distaccum train` on one machine, or Slurm / Kubernetes from their dry runs",
    ]


def _recipe_lines(cfg: RunConfig) -> list[str]:
    try:
        recipe = ray_recipe(cfg, os.environ)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    return [split_line(cfg, int(cfg.trainer.nnodes), cfg.trainer.nproc), *recipe.describe()]


class RayLauncher(Launcher):
    """``distaccum submit --to ray`` (run on Ray Train and wait) and ``distaccum verify --to ray``."""

    name = "ray"
    summary = "Ray: Ray Train's TorchTrainer, run until it ends"
    section = ("ray", RayConfig)
    submits = True
    verifies = True
    launch = staticmethod(launch_on_ray)
    render = staticmethod(ray_dry_run)

    @staticmethod
    def world(cfg: RunConfig) -> World:
        return World(ray_world_size(cfg), int(cfg.trainer.nnodes))  # ray_world_size refuses MIN:MAX

    @staticmethod
    def submit(cfg: RunConfig, overrides: Sequence[str]) -> Submitted:
        """Run ``cfg`` on Ray and wait (the recipe printed first); raises :class:`RayError` when Ray Train is missing
        or the run failed (or ``ft.groups``, which it does not start)."""
        if cfg.ft.enabled:
            raise RayError(ft_lines(cfg)[-1].removeprefix("note: "))
        for line in _recipe_lines(cfg):
            print(f"distaccum: {line}", flush=True)
        summary = train_on_ray(cfg, check=False)
        return Submitted(
            f"distaccum: Ray Train run finished: {summary.get('steps')} optimizer steps, final loss "
            f"{summary.get('final_loss')}; run_dir {cfg.run_dir}"
        )
