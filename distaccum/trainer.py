"""The public ``Trainer``: your model, data and loss in; the trained model, records and ledger out.

The same object runs ``distaccum train``'s workers and a user's own ``torchrun`` script::

    trainer = distaccum.Trainer(
        {"accum": {"micro_batch": 4, "global_batch": 64}, "trainer": {"max_steps": 100},
         "run_dir": "runs/mine"},
        model=make_model, dataset=MyDataset(), collate=my_collate, loss=my_loss_sum)
    summary = trainer.fit()

It joins the process group (or uses the one the script made), resolves the run once
(:mod:`distaccum.resolve`), builds the model identically on every rank, wraps it with the engine,
walks the global-batch order through a DataLoader, runs :func:`distaccum.loop.train` with the
components that own checkpoints, non-finite steps and per-step monitors, writes
``metrics.jsonl``/``summary.json`` and the trained model to ``run_dir/final/``, and leaves the group as
it found it. Every object it builds passes through the testing seam (:mod:`distaccum.testing`) here
and nowhere else.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from distaccum import testing
from distaccum.activation_checkpointing import Checkpointing, parse_checkpointing
from distaccum.components import Components, ModelSpec
from distaccum.config import RunConfig, from_mapping, to_mapping, with_overrides
from distaccum.data.sources import build_source
from distaccum.engines import make_engine
from distaccum.engines.base import Engine, OptimizerFactory
from distaccum.evaluate import EvalResult, evaluate
from distaccum.features import Assembly, FeatureSetup, feature_setups
from distaccum.loop import LoopParts, NonFinitePolicy, TrainState, train
from distaccum.losses import LossFn
from distaccum.optim import build_scheduler
from distaccum.resolve import Prepared, ResolvedRun, prepare, resolve
from distaccum.rundir import CONFIG, write_json
from distaccum.rundir.checkpoint import IDENTITY, Checkpointer, CheckpointWriter
from distaccum.rundir.liveness import Liveness, describe_peers, is_timeout, kill_stopped_peers, short_error
from distaccum.rundir.resume import fresh_start, resume
from distaccum.rundir.weights import save_final
from distaccum.runtime.procgroup import join, shutdown
from distaccum.runtime.stopping import StopFlag, StopRequested
from distaccum.telemetry.ledger import CommLedger
from distaccum.telemetry.sinks import NullSink, Record, Sink, build_sinks
from distaccum.telemetry.summary import summarize
from distaccum.telemetry.timing import StepTimer
from distaccum.tuning.autobatch import AutoChoice, auto_micro_batch, default_budget
from distaccum.window import WindowTotals


@dataclass
class _Run:
    """What :meth:`Trainer.setup` built for one run (private to the Trainer)."""

    assembly: Assembly
    """The resolved run and what its features attached."""
    features: list[FeatureSetup]
    """The features on for this run (they add their fields to the summary)."""
    state: TrainState
    parts: LoopParts
    loss: LossFn
    """The loss the loop calls (the user's, through the testing seam)."""
    checkpointer: Checkpointer
    resumed_at: int
    liveness: Liveness
    placement: dict[str, Any] | None = None
    """HSDP's replicas or outer sync's islands and every rank's node (``summary.json``'s ``placement``)."""
    sink: Sink | None = None
    last_eval: tuple[int, EvalResult] | None = None
    """(optimizer steps done, result) of the latest evaluation."""
    resolved: ResolvedRun = field(init=False)
    prepared: Prepared = field(init=False)

    def __post_init__(self) -> None:
        self.resolved, self.prepared = self.assembly.resolved, self.assembly.prepared


def records_lag(device: torch.device, has_on_step: bool, lag_records: bool | None) -> bool:
    """Whether the loop hands records over a step late (``Trainer(lag_records=...)``; None: on CUDA, unless an
    ``on_step`` would see the model a step further than its record)."""
    return lag_records if lag_records is not None else device.type == "cuda" and not has_on_step


class Trainer:
    """Train the user's model with gradient accumulation on every rank of the process group.

    ``config`` is a :class:`~distaccum.config.RunConfig` or a mapping of its sections (``{"accum":
    {...}, "trainer": {...}, "run_dir": ...}``); its ``model``/``data.dataset``/``loss`` nodes are
    not needed here: the objects are. ``on_step(state, record)`` runs after every optimizer step.
    ``lag_records``: hand each step's record to the sinks and ``on_step`` once the next step is queued, so a GPU
    is never drained to time a step (:class:`~distaccum.loop.StepEnd`; steps that evaluate, checkpoint, stop or
    end a :meth:`train_steps` call are handed over at once). None (the default): on CUDA when there is no
    ``on_step`` (which would then see the model one step further than its record); False: never.
    ``activation_checkpointing`` (``"blocks"`` or module-name patterns) makes those modules recompute
    their activations in backward (:mod:`distaccum.activation_checkpointing`). ``dataset`` may be
    map-style or an ``IterableDataset`` (a stream); ``eval_dataset`` (map-style) is the held-out data for
    ``eval.*`` (default: ``dataset.held_out()`` when the dataset has it).
    """

    def __init__(
        self,
        config: RunConfig | Mapping[str, Any] | None = None,
        *,
        model: ModelSpec,
        dataset: Dataset,
        loss: LossFn,
        collate: Callable[[list[Any]], Any] | None = None,
        optimizer: OptimizerFactory | None = None,
        stop: StopFlag | None = None,
        on_step: Callable[[TrainState, Record], None] | None = None,
        check_components: bool = True,
        names: dict[str, str] | None = None,
        activation_checkpointing: Checkpointing | list[str] = None,
        eval_dataset: Dataset | None = None,
        lag_records: bool | None = None,
    ) -> None:
        self.cfg = config if isinstance(config, RunConfig) else from_mapping(config or {})
        checkpointing = parse_checkpointing(activation_checkpointing, "activation_checkpointing")
        self.components = Components(
            model,
            dataset,
            loss,
            collate,
            optimizer,
            names,
            activation_checkpointing=checkpointing,
            eval_dataset=eval_dataset,
        )
        self.stop = stop
        self.on_step = on_step
        self.lag_records = lag_records
        self.check_components = check_components
        self._created_group = False
        self._run: _Run | None = None
        self.auto_choice: AutoChoice | None = None
        """What ``accum.micro_batch=auto`` chose at :meth:`setup` (None for an explicit micro-batch)."""

    @classmethod
    def of(
        cls, config: RunConfig | Mapping[str, Any] | None, components: Components, **options: Any
    ) -> Trainer:
        """A Trainer of ``components`` (e.g. what :func:`distaccum.preflight.instantiate_components` made of a
        config's ``_target_`` nodes); ``options`` are the constructor's other keyword arguments."""
        c = components
        return cls(
            config,
            model=c.model,
            dataset=c.dataset,
            loss=c.loss,
            collate=c.collate,
            optimizer=c.optimizer,
            names=c.names,
            activation_checkpointing=c.activation_checkpointing,
            eval_dataset=c.eval_dataset,
            **options,
        )

    @property
    def state(self) -> TrainState:
        """The wrapped model, engine, scheduler, data order and records (after :meth:`setup`)."""
        if self._run is None:
            raise RuntimeError("Trainer.setup() has not run yet")
        return self._run.state

    def setup(self) -> TrainState:
        """Join the process group, build and wrap the model, resume from a checkpoint. Idempotent;
        :meth:`fit` calls it. Call it first to inspect or adjust the state before training."""
        if self._run is None:
            joined = join(self.cfg.trainer.device, self.cfg.trainer.collective_timeout_s)
            self._created_group = joined.created or self._created_group
            try:
                self._run = self._setup(
                    joined.device, joined.env.local_world_size, joined.env.restart_count, joined.env.node
                )
            except BaseException:
                self._leave(clean=False)
                raise
        return self._run.state

    def fit(self) -> Record:
        """Train to ``trainer.max_steps`` (or ``trainer.max_samples``), then :meth:`finish`; returns the run
        summary (identical on every rank).

        Raises :class:`~distaccum.runtime.stopping.StopRequested` after checkpointing when a stop was
        requested (SIGTERM/SIGUSR1 through ``stop``), ``ValueError`` for bad components or config.
        """
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
        run, rank = self._run, self._run.resolved.rank
        run.parts.sink = self._sink()
        until = None if steps is None else run.state.source.next_step + steps
        if self.cfg.eval.at_start and run.last_eval is None and run.state.source.next_step == 0:
            self.evaluate()
        try:
            return train(run.state, run.resolved.loop, run.loss, run.parts, until=until)
        except StopRequested:
            run.liveness.write("stopped", step=len(run.state.records))
            raise
        except BaseException as err:
            run.liveness.write("failed", step=len(run.state.records), error=short_error(err))
            peers = describe_peers(run.resolved.run_dir, rank)
            if peers:
                killed = kill_stopped_peers(run.resolved.run_dir, rank, run.liveness.attempt)
                timeout = (
                    f"; a collective waited trainer.collective_timeout_s={self.cfg.trainer.collective_timeout_s:g}"
                    " s and timed out"
                    if is_timeout(err)
                    else ""
                )
                print(
                    f"distaccum: rank {rank} failed ({short_error(err)}{timeout}); the other ranks: "
                    + "; ".join(peers)
                    + (
                        f". Killed stopped rank(s) {killed}: they cannot continue, and the launcher would wait "
                        "for them"
                        if killed
                        else ""
                    ),
                    file=sys.stderr,
                    flush=True,
                )
            raise

    def _after_step(self, state: TrainState, record: Record) -> None:
        assert self._run is not None
        self._run.liveness.beat(int(record["step"]))
        if self.on_step is not None:
            self.on_step(state, record)
        if self.cfg.eval.every and record["step"] % self.cfg.eval.every == 0:
            self.evaluate()

    def _sink(self) -> Sink:
        """The run's sinks (console, metrics.jsonl, wandb on rank 0), opened on first use."""
        assert self._run is not None
        cfg, run = self.cfg, self._run
        if run.sink is None:
            run.sink = build_sinks(
                cfg.log.console,
                cfg.trainer.max_steps,
                run.resolved.run_dir,
                run.resolved.rank,
                wandb_config=to_mapping(cfg) if cfg.log.wandb else None,
                append=bool(run.resumed_at),
                first_step=run.resumed_at + 1,
                wandb_mode=cfg.log.wandb_mode,
                wandb_project=cfg.log.wandb_project,
                show_batch=run.resolved.data.growth is not None,
            )
        return run.sink

    def evaluate(self) -> EvalResult | None:
        """Evaluate on the held-out data now and log ``eval_loss``/``eval_ppl`` (console, metrics.jsonl,
        wandb); None without held-out data. Collective: every rank calls it after the same step."""
        self.setup()
        run = self._run
        assert run is not None
        if run.prepared.eval_set is None:
            return None
        state, resolved = run.state, run.resolved
        with state.outer.global_view() if state.outer is not None else contextlib.nullcontext():
            result = evaluate(
                state.model,
                run.prepared.eval_set,
                run.prepared.collate,
                self.components.loss,
                micro_batch=self.cfg.eval.micro_batch or resolved.split.micro_batch,
                device=resolved.device,
                float_dtype=resolved.loop.float_dtype,
                forward_context=state.engine.forward_context,
            )
        run.last_eval = (len(state.records), result)
        self._sink().log(result.record(len(state.records)))
        return result

    def finish(self) -> Record:
        """Summarize, write the trained model to ``run_dir/final/``, close the sinks, release the
        engine and leave the process group if the Trainer joined it. Collective."""
        assert self._run is not None, "nothing to finish: train first"
        cfg, run = self.cfg, self._run
        state, resolved = run.state, run.resolved
        if (
            run.parts.fingerprint is not None
        ):  # a comparison still pending (training stopped before max_steps)
            run.parts.fingerprint.flush()
        if cfg.eval.at_end and (run.last_eval is None or run.last_eval[0] != len(state.records)):
            self.evaluate()
        summary = summarize(
            resolved.summary_header(run.prepared.names["model"]),
            state.records,
            state.engine,
            resolved.run_dir,
            warmup_steps=cfg.log.warmup_steps,
            lr_scale=cfg.optim.lr_scale(resolved.global_batch),
        )
        if self.auto_choice is not None:
            summary["auto_micro_batch"] = self.auto_choice.as_record()
        if run.placement is not None:
            summary["placement"] = run.placement
        if run.last_eval is not None:
            summary["eval_loss"], summary["eval_ppl"] = run.last_eval[1].loss, run.last_eval[1].ppl
        for feature in run.features:
            feature.summarize(run.assembly, state, summary)
        if cfg.trainer.save_final:  # collective (gathers shards); rank 0 writes
            config = {**to_mapping(cfg), "components": run.prepared.names}
            tokenizer = getattr(self.components.dataset, "tokenizer", None)
            summary["final_model"] = str(save_final(state.engine, resolved.run_dir, config, tokenizer))
        if run.sink is not None:
            run.sink.close(summary)
        if run.checkpointer.last_step != state.source.next_step:  # keep the end of the run next to final/
            run.checkpointer.save(state)
        run.liveness.write("finished", step=len(state.records))
        run.parts.timer.ledger.drain()  # no completion callback left to run on a process group thread
        state.engine.teardown()
        # The engine's wrappers hold the process groups in reference cycles (DDP's reducer, FSDP's mesh): collected
        # now, their groups' threads end while the interpreter is whole; left to interpreter exit, a group's worker
        # thread freeing a tensor there aborted the process ("terminate called without an active exception").
        gc.collect()
        self._leave(clean=True)
        return summary

    def _leave(self, *, clean: bool) -> None:
        if self._created_group:
            self._created_group = False
            shutdown(clean=clean)

    def _setup(self, device: Any, local_world_size: int, attempt: int, node: int | None = None) -> _Run:
        """Compose the run: what every run has, and what each registered feature attaches (:mod:`distaccum.features`)."""
        resolved = self._resolve(device, local_world_size)
        cfg, rank, run_dir = self.cfg, resolved.rank, resolved.run_dir
        prepared = prepare(cfg, resolved, self.components, check_components=self.check_components)
        if rank == 0:
            if not cfg.trainer.resume:
                fresh_start(run_dir)
            write_json(run_dir / CONFIG, {**to_mapping(cfg), "components": prepared.names})
        # From here on random draws (dropout masks) must differ between ranks, or every rank would
        # drop the same units of its different samples.
        torch.manual_seed(cfg.trainer.seed + 1_000_003 * (rank + 1))
        run = Assembly.of(cfg, resolved, prepared, self.components, testing.intercept)
        features = feature_setups(run)
        for feature in features:
            feature.before_engine(run)
        ledger = CommLedger(enabled=cfg.log.ledger)
        engine = testing.intercept("engine", make_engine(run.spec, ledger))
        for feature in features:
            engine = feature.around_engine(run, engine)
        wrapped = engine.wrap(prepared.model, resolved.optimizer(self.components))  # engines own parameters
        for feature in features:
            feature.with_engine(run, engine)
        placement = run.place(engine, rank // local_world_size if node is None else node)
        state = self._state(run, wrapped, engine, ledger)
        done = self._resume(run, state, attempt)
        liveness = Liveness(run_dir, rank, attempt)
        liveness.beat(done)
        checkpointer = self._checkpointer(run, done)
        for feature in features:
            feature.with_state(run, state, done)
        parts = self._parts(run, checkpointer)
        loss = testing.intercept("loss", self.components.loss)
        return _Run(run, features, state, parts, loss, checkpointer, done, liveness, placement)

    def _state(
        self, run: Assembly, wrapped: torch.nn.Module, engine: Engine, ledger: CommLedger
    ) -> TrainState:
        """The learning-rate scheduler (announced once), the data source and its timer, the state the loop mutates."""
        resolved, steps = run.resolved, run.cfg.trainer.max_steps
        scheduler = testing.intercept(
            "scheduler",
            build_scheduler(
                engine.optimizer,
                run.cfg.optim,
                steps,
                global_batch=resolved.global_batch,
                batches=run.batches,
            ),
        )
        run.announce(run.steps_line(float(scheduler.base_lrs[0])))
        source = testing.intercept(
            "source",
            build_source(
                self.components.dataset,
                run.prepared.collate,
                resolved.split,
                resolved.rank,
                steps,
                resolved.data,
                device=resolved.device,
                float_dtype=resolved.loop.float_dtype,
            ),
        )
        run.timer = StepTimer(resolved.device, ledger, run.host_group())
        timed = run.timer.watch(source)  # the timer times what the source serves
        return TrainState(wrapped, engine, scheduler, timed, outer=run.outer)

    def _resume(self, run: Assembly, state: TrainState, attempt: int) -> int:
        """The optimizer steps restored from the latest checkpoint (``trainer.resume``); 0 for a fresh start."""
        if not self.cfg.trainer.resume:
            return 0
        return resume(
            state,
            run.resolved.run_dir,
            run.prepared.identity,
            attempt=attempt,
            schedule_on_resume=self.cfg.trainer.schedule_on_resume,
        )

    @staticmethod
    def _checkpointer(run: Assembly, done: int) -> Checkpointer:
        """When checkpoints are due and where they go; ``done`` steps are already saved."""
        cfg = run.cfg
        checkpointer = Checkpointer(
            run.resolved.run_dir,
            keep=cfg.trainer.keep_checkpoints,
            every=cfg.trainer.checkpoint_every,
            every_s=cfg.trainer.checkpoint_every_s,
            rank=run.rank,
            manifest={IDENTITY: run.prepared.identity, "engine": cfg.engine.name},
            writer=testing.intercept("checkpoint_writer", CheckpointWriter()),
        )
        checkpointer.last_step = done
        return checkpointer

    def _parts(self, run: Assembly, checkpointer: Checkpointer) -> LoopParts:
        """What the loop runs around each step: the run's own parts and what the features attached."""
        device, every = run.device, run.cfg.eval.every
        return LoopParts(
            timer=run.timer,
            sink=NullSink(),  # the real sinks open on the first train_steps
            nonfinite=NonFinitePolicy(
                run.cfg.trainer.max_nonfinite_steps, run.resolved.precision.loss_scaling
            ),
            totals=WindowTotals(device, run.group),
            checkpointer=checkpointer,
            monitors=run.monitors,
            fingerprint=run.fingerprint,
            stop=self.stop,
            on_step=self._after_step,
            lag=records_lag(device, self.on_step is not None, self.lag_records),
            flush_after=(lambda step: step % every == 0) if every else None,
            outer=run.outer,
            retry=run.retry,
        )

    def _resolve(self, device: torch.device, local_world_size: int) -> ResolvedRun:
        """The run resolved on this world; ``accum.micro_batch=auto`` measured once, here, on every rank (the run then
        uses the chosen split)."""
        rank, world = dist.get_rank(), dist.get_world_size()
        nodes = world // local_world_size if world % local_world_size == 0 else 1
        resolved = resolve(self.cfg, world, device, rank=rank, nodes=nodes)
        if resolved.auto:
            budget = self.cfg.accum.budget_bytes() or default_budget(device, local_world_size)
            self.auto_choice = auto_micro_batch(resolved, self.components, budget)
            self.cfg = with_overrides(self.cfg, {"accum.micro_batch": self.auto_choice.micro_batch})
            resolved = resolve(self.cfg, world, device, rank=rank, nodes=nodes)
        return resolved
