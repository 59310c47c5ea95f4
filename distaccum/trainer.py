"""The public ``Trainer``: your model, data and loss in; the trained model, records and ledger out.

The same object runs ``distaccum train``'s workers and a user's own ``torchrun`` script::

    trainer = distaccum.Trainer(
        {"accum": {"micro_batch": 4, "global_batch": 64}, "trainer": {"max_steps": 100},
         "run_dir": "runs/mine"},
        model=make_model, dataset=MyDataset(), collate=my_collate, loss=my_loss_sum)
    summary = trainer.fit()

It joins the process group (or uses the one the script made), seeds and builds the model
identically on every rank, wraps it with the engine, walks the global-batch plan through a
DataLoader, runs :func:`distaccum.loop.train`, writes ``metrics.jsonl``/``summary.json`` and the
trained model to ``run_dir/final/``, and leaves the group as it found it.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, default_collate

from distaccum.activation_checkpointing import (
    Checkpointing,
    apply_activation_checkpointing,
    check_engine_compatible,
    parse_checkpointing,
)
from distaccum.cluster.liveness import Liveness, describe_peers, is_timeout, kill_stopped_peers, short_error
from distaccum.cluster.procgroup import ensure_process_group, pick_device, shutdown
from distaccum.cluster.stopping import StopFlag, StopRequested
from distaccum.cluster.topology import DistEnv
from distaccum.components import Components, ModelSpec, build_model
from distaccum.config import RunConfig, from_mapping, to_mapping, with_overrides
from distaccum.data.global_batch import GlobalBatchPlan
from distaccum.data.pipeline import PlanSource
from distaccum.data.stream import StreamSource, is_stream
from distaccum.engines import check_engine, make_engine
from distaccum.engines.base import EngineSpec, OptimizerFactory, Precision
from distaccum.evaluate import EvalResult, eval_dataset, evaluate
from distaccum.loop import LoopSettings, TrainState, train
from distaccum.losses import LossFn
from distaccum.models import batch_stat_layers
from distaccum.optim import build_optimizer, build_scheduler, describe_lr
from distaccum.probe import probe
from distaccum.rundir import CONFIG, write_json
from distaccum.rundir.checkpoint import fingerprint
from distaccum.rundir.checkpoint import save as save_checkpoint
from distaccum.rundir.resume import fresh_start, resume
from distaccum.rundir.weights import save_final
from distaccum.telemetry.ledger import CommLedger
from distaccum.telemetry.sinks import Record, Sink, build_sinks
from distaccum.telemetry.summary import summarize
from distaccum.telemetry.timing import StepTimer
from distaccum.tuning.autobatch import AutoChoice, auto_micro_batch
from distaccum.verify.reference import run_reference

VERIFY_ENV = "DISTACCUM_VERIFY"
"""Set by ``distaccum verify --script``: JSON telling a script's Trainer to run as the reference or
as a candidate split (see :func:`verify_overrides`). Nothing else sets or reads it."""

def verify_overrides(cfg: RunConfig, environ: Mapping[str, str]) -> tuple[RunConfig, dict[str, Any] | None]:
    """Apply ``distaccum verify --script``'s request from ``environ``; returns the config and the
    request (None for a normal run; its ``mode`` is 'reference' or 'candidate')."""
    raw = environ.get(VERIFY_ENV)
    if not raw:
        return cfg, None
    request = json.loads(raw)
    overrides = {"run_dir": request["run_dir"], "verify.record": True, "trainer.check_every": 1,
                 "log.console": "quiet", "log.wandb": False, "trainer.resume": False}
    if request.get("init_from"):
        overrides["trainer.init_from"] = request["init_from"]
    if request["mode"] == "candidate" and request.get("micro_batch"):
        overrides.update({"accum.micro_batch": request["micro_batch"], "accum.steps": request["accum_steps"],
                          "accum.global_batch": None})
    return with_overrides(cfg, overrides), request


@dataclass
class _Run:
    """What :meth:`Trainer.setup` built for one run (private to the Trainer)."""

    state: TrainState
    settings: LoopSettings
    timer: StepTimer
    names: dict[str, str]
    resumed_at: int
    liveness: Liveness
    fingerprint: dict[str, Any]
    last_checkpoint_step: int
    collate: Callable[[list[Any]], Any]
    eval_set: Dataset | None
    sink: Sink | None = None
    last_eval: tuple[int, EvalResult] | None = None
    """(optimizer steps done, result) of the latest evaluation."""


class Trainer:
    """Train the user's model with gradient accumulation on every rank of the process group.

    ``config`` is a :class:`~distaccum.config.RunConfig` or a mapping of its sections (``{"accum":
    {...}, "trainer": {...}, "run_dir": ...}``); its ``model``/``data.dataset``/``loss`` nodes are
    not needed here: the objects are. ``on_step(state, record)`` runs after every optimizer step.
    ``activation_checkpointing`` (``"blocks"`` or module-name patterns) makes those modules recompute
    their activations in backward (:mod:`distaccum.activation_checkpointing`). ``dataset`` may be
    map-style or an ``IterableDataset`` (a stream); ``eval_dataset`` (map-style) is the held-out data for
    ``eval.*`` (default: ``dataset.held_out()`` when the dataset has it).
    """

    def __init__(self, config: RunConfig | Mapping[str, Any] | None = None, *, model: ModelSpec,
                 dataset: Dataset, loss: LossFn, collate: Callable[[list[Any]], Any] | None = None,
                 optimizer: OptimizerFactory | None = None, stop: StopFlag | None = None,
                 on_step: Callable[[TrainState, Record], None] | None = None,
                 check_components: bool = True, names: dict[str, str] | None = None,
                 activation_checkpointing: Checkpointing | list[str] = None,
                 eval_dataset: Dataset | None = None) -> None:
        cfg = config if isinstance(config, RunConfig) else from_mapping(config or {})
        self.cfg, self.verify_request = verify_overrides(cfg, os.environ)
        checkpointing = parse_checkpointing(activation_checkpointing, "activation_checkpointing")
        self.components = Components(model, dataset, loss, collate, optimizer, names,
                                     activation_checkpointing=checkpointing, eval_dataset=eval_dataset)
        self.stop = stop
        self.on_step = on_step
        self.check_components = check_components
        self._created_group = False
        self._run: _Run | None = None
        self.auto_choice: AutoChoice | None = None
        """What ``accum.micro_batch=auto`` chose at :meth:`setup` (None for an explicit micro-batch)."""

    @property
    def state(self) -> TrainState:
        """The wrapped model, engine, scheduler, plan and records (after :meth:`setup`)."""
        if self._run is None:
            raise RuntimeError("Trainer.setup() has not run yet")
        return self._run.state

    def setup(self) -> TrainState:
        """Join the process group, build and wrap the model, resume from a checkpoint. Idempotent;
        :meth:`fit` calls it. Call it first to inspect or adjust the state before training."""
        if self._run is None:
            env = DistEnv.from_environ(os.environ)
            device = pick_device(self.cfg.trainer.device, env)
            timeout = timedelta(seconds=self.cfg.trainer.collective_timeout_s)
            self._created_group = ensure_process_group(env, device, timeout) or self._created_group
            try:
                self._run = self._setup(device, env.restart_count)
            except BaseException:
                self._leave(clean=False)
                raise
        return self._run.state

    def fit(self) -> Record:
        """Train to ``trainer.max_steps``, then :meth:`finish`; returns the run summary (identical on
        every rank).

        Raises :class:`~distaccum.rundir.checkpoint.StopRequested` after checkpointing when a stop was
        requested (SIGTERM/SIGUSR1 through ``stop``), ``ValueError`` for bad components or config.
        """
        request = self.verify_request
        if request is not None and request["mode"] == "reference":  # one process: no group, no engine
            cfg = self.cfg
            return run_reference(cfg, self.components, Path(cfg.run_dir),
                                 global_batch=cfg.global_batch(int(request["world_size"])),
                                 seed_out=Path(request["seed_out"]) if request.get("seed_out") else None)
        clean = False
        try:
            self.train_steps()
            summary = self.finish()
            clean = True
            return summary
        except StopRequested:
            clean = True  # every rank agreed to stop after the same window
            raise
        finally:
            self._leave(clean=clean)

    def train_steps(self, steps: int | None = None) -> list[Record]:
        """Run ``steps`` more optimizer steps (default: up to ``trainer.max_steps``) and return their
        records; :meth:`setup` runs first if needed. Call it repeatedly to interleave your own work
        (an evaluation, a benchmark's other variants) between chunks of training."""
        self.setup()
        assert self._run is not None
        cfg, run = self.cfg, self._run
        state, settings = run.state, run.settings
        sink = self._sink()
        until = None if steps is None else state.source.next_step + steps
        if cfg.eval.at_start and run.last_eval is None and state.source.next_step == 0:
            self.evaluate()

        def after_step(st: TrainState, record: Record) -> None:
            run.liveness.beat(int(record["step"]))
            if self.on_step is not None:
                self.on_step(st, record)
            if cfg.eval.every and record["step"] % cfg.eval.every == 0:
                self.evaluate()

        try:
            return train(state, settings, self.components.loss, run.timer, sink, until=until, stop=self.stop,
                         checkpoint=self._checkpoint, on_step=after_step)
        except StopRequested:
            run.liveness.write("stopped", step=len(state.records))
            raise
        except BaseException as err:
            run.liveness.write("failed", step=len(state.records), error=short_error(err))
            peers = describe_peers(settings.run_dir, settings.rank)
            if peers:
                killed = kill_stopped_peers(settings.run_dir, settings.rank, run.liveness.attempt)
                timeout = (f"; a collective waited trainer.collective_timeout_s={cfg.trainer.collective_timeout_s:g} s "
                           "and timed out" if is_timeout(err) else "")
                print(f"distaccum: rank {settings.rank} failed ({short_error(err)}{timeout}); the other ranks: "
                      + "; ".join(peers)
                      + (f". Killed stopped rank(s) {killed}: they cannot continue, and the launcher would wait "
                         "for them" if killed else ""), file=sys.stderr, flush=True)
            raise

    def _sink(self) -> Sink:
        """The run's sinks (console, metrics.jsonl, wandb on rank 0), opened on first use."""
        assert self._run is not None
        cfg, run = self.cfg, self._run
        if run.sink is None:
            run.sink = build_sinks(cfg.log.console, cfg.trainer.max_steps, run.settings.run_dir, run.settings.rank,
                                   wandb_config=to_mapping(cfg) if cfg.log.wandb else None,
                                   append=bool(run.resumed_at), first_step=run.resumed_at + 1,
                                   wandb_mode=cfg.log.wandb_mode, wandb_project=cfg.log.wandb_project)
        return run.sink

    def evaluate(self) -> EvalResult | None:
        """Evaluate on the held-out data now and log ``eval_loss``/``eval_ppl`` (console, metrics.jsonl,
        wandb); None without held-out data. Collective: every rank calls it after the same step."""
        self.setup()
        run = self._run
        assert run is not None
        if run.eval_set is None:
            return None
        state, settings = run.state, run.settings
        result = evaluate(state.model, run.eval_set, run.collate, self.components.loss,
                          micro_batch=self.cfg.eval.micro_batch or settings.split.micro_batch, device=settings.device,
                          float_dtype=settings.float_dtype, forward_context=state.engine.forward_context)
        run.last_eval = (len(state.records), result)
        self._sink().log(result.record(len(state.records)))
        return result

    def _checkpoint(self, state: TrainState) -> Path:
        """Write a checkpoint after the last finished step (collective)."""
        assert self._run is not None
        run, cfg = self._run, self.cfg
        fault = cfg.debug.checkpoint_fault_at_step == state.source.next_step
        path = save_checkpoint(state, run.settings.run_dir, keep=cfg.trainer.keep_checkpoints,
                               manifest={"fingerprint": run.fingerprint, "engine": cfg.engine.name}, fault=fault)
        run.last_checkpoint_step = state.source.next_step
        return path

    def finish(self) -> Record:
        """Summarize, write the trained model to ``run_dir/final/``, close the sinks, release the
        engine and leave the process group if the Trainer joined it. Collective."""
        assert self._run is not None, "nothing to finish: train first"
        cfg, run = self.cfg, self._run
        state, settings = run.state, run.settings
        if cfg.eval.at_end and (run.last_eval is None or run.last_eval[0] != len(state.records)):
            self.evaluate()
        summary = summarize(cfg, run.names, settings.split, state.records, state.engine, settings.run_dir)
        if self.auto_choice is not None:
            summary["auto_micro_batch"] = self.auto_choice.as_record()
        if run.last_eval is not None:
            summary["eval_loss"], summary["eval_ppl"] = run.last_eval[1].loss, run.last_eval[1].ppl
        if cfg.trainer.save_final:  # collective (gathers shards); rank 0 writes
            config = {**to_mapping(cfg), "components": run.names}
            tokenizer = getattr(self.components.dataset, "tokenizer", None)
            summary["final_model"] = str(save_final(state.engine, settings.run_dir, config, tokenizer))
        if run.sink is not None:
            run.sink.close(summary)
        if run.last_checkpoint_step != state.source.next_step:  # keep the end of the run next to final/
            self._checkpoint(state)
        run.liveness.write("finished", step=len(state.records))
        state.engine.teardown()
        self._leave(clean=True)
        return summary

    def _leave(self, *, clean: bool) -> None:
        if self._created_group:
            self._created_group = False
            shutdown(clean=clean)

    def _setup(self, device: torch.device, attempt: int) -> _Run:
        cfg, parts = self.cfg, self.components
        names = parts.describe()
        rank, world = dist.get_rank(), dist.get_world_size()
        if cfg.accum.auto:  # measured once, here, on every rank; the run then uses the chosen split
            self.auto_choice = auto_micro_batch(cfg, parts, device, DistEnv.from_environ(os.environ).local_world_size)
            self.cfg = cfg = with_overrides(cfg, {"accum.micro_batch": self.auto_choice.micro_batch})
        split = cfg.split(world)
        precision = Precision.of(cfg.precision)
        spec = EngineSpec(engine=cfg.engine, precision=precision, split=split, sync=cfg.accum.sync,
                          clip_norm=cfg.optim.clip_norm, device=device, fault_rank=cfg.debug.skip_reduction_rank,
                          gns=cfg.log.gns)
        check_engine(spec)
        if cfg.log.gns and world < 2:
            raise ValueError("log.gns=true compares each rank's gradient with the reduced one: it needs at least "
                             "2 ranks")
        run_dir = Path(cfg.run_dir)
        if rank == 0:
            if not cfg.trainer.resume:
                fresh_start(run_dir)
            write_json(run_dir / CONFIG, {**to_mapping(cfg), "components": names})

        model = build_model(parts.model, cfg.trainer.seed, precision, cfg.trainer.init_from, names["model"])
        checkpointed = apply_activation_checkpointing(model, parts.activation_checkpointing)
        check_engine_compatible(model, cfg.engine.name)
        if checkpointed and rank == 0:
            shown = ", ".join(checkpointed[:3]) + (", ..." if len(checkpointed) > 3 else "")
            print(f"distaccum: activation checkpointing (non-reentrant) on {len(checkpointed)} modules: {shown}",
                  flush=True)
        collate = parts.collate or default_collate
        if self.check_components:
            probe(model, parts.dataset, collate, parts.loss, names=names)
        layers = batch_stat_layers(model)
        if layers and split.accum_steps > 1:
            warnings.warn(
                f"accumulating {split.accum_steps} micro-batches with batch-statistics layers "
                f"({', '.join(layers)}): their statistics are computed per micro-batch of {split.micro_batch}, "
                "not over the effective batch, so results depend on the split", stacklevel=3)
        fp = fingerprint(cfg, world, names, parts.dataset, model)
        # From here on random draws (dropout masks) must differ between ranks, or every rank would
        # drop the same units of its different samples.
        torch.manual_seed(cfg.trainer.seed + 1_000_003 * (rank + 1))

        ledger = CommLedger(enabled=cfg.log.ledger)
        engine = make_engine(spec, ledger)
        make_optimizer = parts.optimizer or (lambda params: build_optimizer(params, cfg.optim))
        wrapped = engine.wrap(model, make_optimizer)  # the optimizer after wrapping: engines own parameters
        scheduler = build_scheduler(engine.optimizer, cfg.optim, cfg.trainer.max_steps,
                                    global_batch=split.global_batch)
        if cfg.optim.lr_scaling != "none" and rank == 0:
            print(f"distaccum: {describe_lr(cfg.optim, split.global_batch, scheduler.base_lrs[0])}", flush=True)
        source: PlanSource | StreamSource
        if is_stream(parts.dataset):  # no length: windows are cut from the stream in order
            source = StreamSource(parts.dataset, collate, split, rank, drop_last=cfg.data.drop_last,  # type: ignore[arg-type]
                                  num_workers=cfg.data.num_workers, prefetch_factor=cfg.data.prefetch_factor)
        else:
            plan = GlobalBatchPlan(len(parts.dataset), split.global_batch, seed=cfg.trainer.seed,  # type: ignore[arg-type]
                                   shuffle=cfg.data.shuffle, drop_last=cfg.data.drop_last)
            source = PlanSource(parts.dataset, collate, plan, split, rank, cfg.trainer.max_steps,
                                num_workers=cfg.data.num_workers, prefetch_factor=cfg.data.prefetch_factor,
                                pin_memory=device.type == "cuda")
        eval_set = eval_dataset(cfg.eval, parts.dataset, parts.eval_dataset)
        state = TrainState(wrapped, engine, scheduler, source)
        done = resume(state, run_dir, fp, attempt=attempt) if cfg.trainer.resume else 0
        liveness = Liveness(run_dir, rank, attempt)
        liveness.beat(done)
        settings = LoopSettings(
            split=split, max_steps=cfg.trainer.max_steps, clip_norm=cfg.optim.clip_norm,
            every_micro=cfg.accum.sync == "every_micro", loss_norm=cfg.accum.loss_norm,
            float_dtype=torch.float64 if precision.param_dtype == torch.float64 else None,
            check_every=cfg.trainer.check_every, record_checksums=cfg.verify.record,
            rank_stats_every=cfg.log.rank_stats_every, run_dir=run_dir,
            device=device, rank=rank, checkpoint_every=cfg.trainer.checkpoint_every,
            checkpoint_every_s=cfg.trainer.checkpoint_every_s, max_nonfinite_steps=cfg.trainer.max_nonfinite_steps,
            loss_scaling=precision.loss_scaling, grad_scale_fault=cfg.debug.grad_scale_fault,
            nominal_partial_count=cfg.debug.nominal_partial_count,
            nan_steps=tuple(range(cfg.debug.nan_at_step, cfg.debug.nan_at_step + cfg.debug.nan_steps))
            if cfg.debug.nan_at_step else (), nan_rank=cfg.debug.nan_rank,
            gns_decay=cfg.log.gns_ema if cfg.log.gns else None)
        return _Run(state, settings, StepTimer(device, ledger), names, done, liveness, fp, done, collate, eval_set)


