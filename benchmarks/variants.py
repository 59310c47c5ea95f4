"""The variants a launch interleaves: hand-written loops a user would write, and distaccum's Trainer.

- (a) ``ddp_every_micro``: DDP, gradients all-reduced after every micro-batch.
- (b) ``ddp_no_sync``: DDP with ``no_sync()`` on micro-batches 1..K-1: one all-reduce per step.
- (c) ``accelerate``: Accelerate's ``accumulate()``, the loop of its gradient-accumulation guide.
- (d) ``distaccum``: :class:`distaccum.Trainer` (``engine=ddp``) through its public API, product
  defaults except the settings in :func:`distaccum_config` (each says why).
- (e) ``compute_floor``: the K forward/backward passes and the step with no DDP and no
  communication; it runs on both ranks so they compete for the CPU as in (a)-(d).
- (g) ``ddp_no_sync_compiled``: (b) with the DDP module compiled (``torch.compile(ddp, dynamic=True)``).
- (f) ``ddp_bf16_hook``: (b) with the gradient all-reduce compressed to bf16 by a comm hook, in an
  expert's settings (``gradient_as_bucket_view=True``, gradients zeroed in place): what
  ``distaccum_bf16_reduce`` (``accum.reduce_dtype=bf16``) is measured against.
- ``ddp_python_hook``: (b) with DDP's default all-reduce written as a Python comm hook: what running the
  reduction through Python costs (distaccum's ledger and normalization live in such a hook).
- ``ddp_no_sync_twin``: (b) built a second time in the same processes, a control: ``ddp_no_sync_twin / ddp_no_sync``
  is 1 by construction, so its spread is the harness's own resolution on the machine (an A/A comparison).
- ``ddp_no_sync_compiled_twin``: (g) built a second time, the same control for the compiled pair
  (``ddp_no_sync_compiled_twin / ddp_no_sync_compiled``); both compiled loops share dynamo's cache of the DDP module's
  code, as ``distaccum_compiled``'s does, so the control includes what sharing it costs.
- ``ddp_no_sync_compiled_static``: (g) compiled with dynamo's default automatic dynamic shapes
  (``torch.compile(ddp)``) instead of ``dynamic=True``: what the shapes the benchmark's fixed micro-batches allow to
  specialise would save the expert loop (a diagnostic of the baseline; distaccum compiles with ``dynamic=True`` so that
  variable sequence lengths and partial windows recompile nothing).
- ``ddp_window_allreduce``: ``ddp_python_hook`` plus a second, small all-reduce per step like distaccum's window
  had (item count, loss sum, votes): what that collective costs (a diagnostic for ``benchmarks.fixed_cost``).
- ``ddp_window_allgather``: the same with an all-gather of each rank's row instead, as distaccum's window on the
  CPU now gathers (:class:`distaccum.window.HostTotals`).
- ``distaccum_sync_records``: ``distaccum`` with each step's record made right after it (``lag_records=False``):
  on CUDA, what the lagged records (the default there) save; on the CPU the same loop.
- ``distaccum_loader``: ``distaccum`` fed as before this release: the samples' indices as the dataset and a collate
  that slices the tensors, through a DataLoader per rank, where ``distaccum`` gets the tensors as a plain
  ``TensorDataset``, which it cuts in the training process (:class:`distaccum.data.pipeline.TensorRows`):
  ``distaccum_loader / distaccum`` is what that saves.
- ``distaccum_copied_rows``: ``distaccum`` whose loss copies its micro-batch before the forward, as
  :class:`~distaccum.data.pipeline.TensorRows` did before this release (a slice's ``clone`` per tensor, where it now
  hands out views guarded by the tensors' version counters): ``distaccum_copied_rows / distaccum`` is what the views
  save.
- ``distaccum_gloo_window``: ``distaccum`` with the CPU window's rows through gloo's all-gather (across hosts, and on
  one host before this release) instead of the run's Unix sockets (:mod:`distaccum.cluster.exchange`):
  ``distaccum_gloo_window / distaccum`` is what the sockets save.
- ``distaccum_host_allreduce``: ``distaccum`` with the CPU's window totals all-reduced (the whole layout) instead of
  all-gathered, as before this release: what the all-gather saves (a diagnostic for ``benchmarks.fixed_cost``).
- ``distaccum_device_totals``: ``distaccum`` with the window's totals kept as one-number tensors on the CPU too
  (:class:`distaccum.window.DeviceTotals`, what an accelerator uses): what the CPU's Python-float totals
  (:class:`~distaccum.window.HostTotals`) save (a diagnostic for ``benchmarks.fixed_cost``).
- ``distaccum_no_ledger``, ``distaccum_no_fingerprint`` (the reduction fingerprint off: its cost is
  ``distaccum / distaccum_no_fingerprint``), ``distaccum_no_checks`` (both off and the straggler view's gather too:
  ``distaccum_no_checks / ddp_no_sync`` is what the accumulation itself costs against the expert loop),
  ``distaccum_fsdp``, ``distaccum_zero2``, ... (:data:`ENGINE_VARIANTS`):
  the Trainer with another engine or setting, for the engine sweep, or interleaved like the others.

Every variant exposes ``run(steps) -> stamps`` (steps + 1 clock stamps: before the first step and
after each), ``parameters()`` and ``close()``. Construction is collective (DDP broadcasts).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, TensorDataset

from benchmarks.cases import Batch, BenchData, Spec, loss_sum, sgd
from benchmarks.device import Clock
from benchmarks.launch import ROOT
from distaccum import Trainer, window
from distaccum.cluster.exchange import GlooExchange
from distaccum.cluster.procgroup import all_gather_flat

LETTERS = {"ddp_every_micro": "a", "ddp_no_sync": "b", "accelerate": "c", "distaccum": "d",
           "compute_floor": "e", "ddp_bf16_hook": "f", "ddp_no_sync_compiled": "g"}
"""Variant -> the letter tables use."""
EXTENSIONS = str(ROOT / ".cache" / "torch_extensions")  # DeepSpeed's JIT-compiled op, built once per checkout
ENGINE_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "distaccum": ("ddp", {}),
    "distaccum_device_totals": ("ddp", {}),  # DistaccumDeviceTotals
    "distaccum_host_allreduce": ("ddp", {}),  # DistaccumHostAllreduce
    "distaccum_sync_records": ("ddp", {}),  # DistaccumSyncRecords
    "distaccum_loader": ("ddp", {}),  # DistaccumLoader
    "distaccum_copied_rows": ("ddp", {}),  # DistaccumCopiedRows
    "distaccum_gloo_window": ("ddp", {}),  # DistaccumGlooWindow
    "distaccum_folded_k1": ("ddp", {}),  # DistaccumFoldedK1
    "distaccum_in_loss": ("ddp", {"engine.normalize_in_loss_mb": 0}),  # K = 1: 1/N in the loss whatever the size
    "distaccum_no_ledger": ("ddp", {"log.ledger": False}),
    "distaccum_no_fingerprint": ("ddp", {"trainer.fingerprint": False}),
    # Every per-step check a switch turns off at once (the fingerprint, the ledger, the straggler view's gather):
    # what the accumulation itself costs (the window's collective, exact normalization, the record and its sinks).
    "distaccum_no_checks": ("ddp", {"trainer.fingerprint": False, "log.ledger": False, "log.rank_stats_every": 0}),
    "distaccum_grad_norm": ("ddp", {"log.grad_norm": True}),
    "distaccum_compiled": ("ddp", {"trainer.compile": True}),
    "distaccum_fsdp": ("fsdp", {}),
    "distaccum_fsdp_every_micro": ("fsdp", {"accum.sync": "every_micro"}),
    "distaccum_fsdp_unsharded": ("fsdp", {"engine.fsdp_unsharded_window": True}),
    "distaccum_zero1": ("deepspeed", {"engine.zero_stage": 1, "engine.extensions_dir": EXTENSIONS}),
    "distaccum_zero2": ("deepspeed", {"engine.zero_stage": 2, "engine.extensions_dir": EXTENSIONS}),
    "distaccum_zero2_every_micro": ("deepspeed", {"engine.zero_stage": 2, "accum.sync": "every_micro",
                                                  "engine.extensions_dir": EXTENSIONS}),
    "distaccum_zero3": ("deepspeed", {"engine.zero_stage": 3, "engine.extensions_dir": EXTENSIONS}),
    "distaccum_zero3_every_micro": ("deepspeed", {"engine.zero_stage": 3, "accum.sync": "every_micro",
                                                  "engine.extensions_dir": EXTENSIONS}),
    "distaccum_accelerate": ("accelerate", {}),
    "distaccum_bf16_reduce": ("ddp", {"accum.reduce_dtype": "bf16"}),
    # FSDP2 hybrid sharding, 2 replicas: run with --world 4 (2 x 2) or more (HSDP_SWEEP in benchmarks.run).
    "distaccum_hsdp_boundary": ("fsdp", {"engine.replicas": 2, "accum.sync": "boundary"}),
    "distaccum_hsdp_replica_boundary": ("fsdp", {"engine.replicas": 2, "accum.sync": "replica_boundary"}),
    "distaccum_hsdp_every_micro": ("fsdp", {"engine.replicas": 2, "accum.sync": "every_micro"}),
}
"""distaccum variants: name -> (engine.name, dotted config overrides). Add an engine option (e.g.
the FSDP2 window without re-gathering) as one more line; an override the config does not know
yet fails that variant's launch with the config's own message."""
DEFAULT_VARIANTS = ("ddp_no_sync", "distaccum", "accelerate", "compute_floor", "ddp_every_micro")
"""What ``benchmarks.run`` interleaves unless told otherwise."""


class Variant(Protocol):
    """One way of training, stepped in blocks by the interleaving worker."""

    name: str

    def run(self, steps: int) -> list[Any]:
        """Run ``steps`` optimizer steps; return steps + 1 clock stamps."""
        ...

    def parameters(self) -> Iterator[torch.Tensor]:
        """The full trained parameters in the plain model's order (collective for sharded engines)."""
        ...

    def close(self) -> None:
        """Release what the variant holds (collective)."""
        ...


class HandWritten:
    """Shared by the hand-written loops: identical model and data; subclasses write ``step``."""

    def __init__(self, name: str, spec: Spec, data: BenchData, rank: int, device: torch.device,
                 clock: Clock) -> None:
        self.name, self.spec, self.device, self.clock = name, spec, device, clock
        self.windows = data.windows(rank)
        self.position = 0
        torch.manual_seed(spec.seed)  # the weights distaccum's Trainer builds from trainer.seed
        self.model: nn.Module = spec.shape.build().to(device)

    def step(self, batches: list[Batch]) -> None:
        raise NotImplementedError

    def batch(self, batch: Batch) -> Batch:
        """This micro-batch on the device (a no-op on CPU), moved just before its forward."""
        x, y = batch
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def loss(self, module: nn.Module, batch: Batch, accum_steps: int) -> torch.Tensor:
        """``mse_loss(module(x), y) / K`` for one micro-batch, the forward under bf16 autocast when the spec
        computes in bf16 (as an expert writes it: autocast around forward and loss, backward outside it;
        autocast runs ``mse_loss`` in fp32)."""
        x, y = self.batch(batch)
        if self.spec.precision != "bf16":  # fp32: nothing around the forward, as a plain loop has it
            return F.mse_loss(module(x), y) / accum_steps
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            return F.mse_loss(module(x), y) / accum_steps

    def run(self, steps: int) -> list[Any]:
        stamps = [self.clock.stamp()]
        for _ in range(steps):
            self.step(self.windows[self.position % len(self.windows)])
            self.position += 1
            stamps.append(self.clock.stamp())
        return stamps

    def parameters(self) -> Iterator[torch.Tensor]:
        return (p.detach() for p in self.model.parameters())

    def close(self) -> None:
        pass


def _ddp(model: nn.Module, device: torch.device) -> DDP:
    """DDP as an expert sets it up: gradients live in the communication buckets (no copy in or out)."""
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)


def zero_in_place(optimizer: torch.optim.Optimizer) -> None:
    """Zero the gradients without freeing them: with bucket views, ``set_to_none=True`` would make the next
    window allocate a fresh set of gradients (page faults on large models: 27.3M params 1.59 vs 1.48 s per
    K=16 step, measured here) and copy it into the buckets at the boundary."""
    optimizer.zero_grad(set_to_none=False)


class DDPEveryMicro(HandWritten):
    """(a) DDP that all-reduces the gradients of every micro-batch."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.ddp = _ddp(self.model, self.device)
        self.optimizer = sgd(self.spec.lr)(list(self.model.parameters()))

    def step(self, batches: list[Batch]) -> None:
        for batch in batches:
            self.loss(self.ddp, batch, len(batches)).backward()  # DDP all-reduces here
        self.optimizer.step()
        zero_in_place(self.optimizer)


class DDPNoSync(DDPEveryMicro):
    """(b) DDP that skips the all-reduce on micro-batches 1..K-1 with ``no_sync()``."""

    def step(self, batches: list[Batch]) -> None:
        for i, batch in enumerate(batches):
            # Gradients accumulate locally; only the last backward all-reduces the sum.
            with contextlib.nullcontext() if i == len(batches) - 1 else self.ddp.no_sync():
                self.loss(self.ddp, batch, len(batches)).backward()
        self.optimizer.step()
        zero_in_place(self.optimizer)


def bf16_allreduce_hook(state, bucket):  # noqa: ANN001, ANN201 - DDP compares real annotations; ours are strings
    """PyTorch's ``bf16_compress_hook`` without its NCCL-only check: cast the bucket to bf16, all-reduce,
    divide by the world size, copy back into the (fp32) bucket."""
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size())
    future = dist.all_reduce(compressed, async_op=True).get_future()

    def decompress(fut):  # noqa: ANN001, ANN202
        buffer.copy_(fut.value()[0])
        return buffer

    return future.then(decompress)


def python_allreduce_hook(state, bucket):  # noqa: ANN001, ANN201 - DDP compares real annotations; ours are strings
    """DDP's default all-reduce (divide by the world size, sum) written as a Python comm hook: the least any
    Python hook does."""
    buffer = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])


def python_allreduce_after_hook(state, bucket):  # noqa: ANN001, ANN201 - DDP compares real annotations
    """:func:`python_allreduce_hook` dividing the bucket when its all-reduce lands (in the future's callback, on
    the process group's thread), where distaccum's hook normalizes, instead of before launching it."""
    world = dist.get_world_size()

    def done(fut):  # noqa: ANN001, ANN202
        return fut.value()[0].div_(world)

    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(done)


def window_allreduce_hook(state, bucket):  # noqa: ANN001, ANN201 - DDP compares real annotations; ours are strings
    """:func:`python_allreduce_hook` that also waits for the step's small all-reduce (``state["work"]``) when the
    bucket lands, as distaccum's hook waits for the window's item count before normalizing."""
    buffer = bucket.buffer().div_(dist.get_world_size())

    def done(fut):  # noqa: ANN001, ANN202
        state["work"].wait()
        return fut.value()[0]

    return dist.all_reduce(buffer, async_op=True).get_future().then(done)


class DDPPythonHook(DDPNoSync):
    """(b) with DDP's all-reduce as a Python comm hook instead of its C++ default: what running the
    reduction through Python costs (a diagnostic: distaccum's ledger and normalization live in such a hook)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.ddp.register_comm_hook(None, python_allreduce_hook)


class DDPPythonHookAfter(DDPNoSync):
    """(b) with :func:`python_allreduce_after_hook`: where the bucket is divided (before its all-reduce on the
    backward's thread, or after it in the callback) priced against ``ddp_python_hook`` (a diagnostic)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.ddp.register_comm_hook(None, python_allreduce_after_hook)


class DDPWindowAllreduce(DDPNoSync):
    """(b) with a Python comm hook and, as distaccum's window has, a second, small all-reduce per step (8 float64
    numbers), launched before the last backward and waited for in the hook before the bucket is returned: what
    that collective costs on its own (a diagnostic for ``benchmarks.fixed_cost``; distaccum's carries the
    window's item count, loss sum, votes and the fingerprint's rows)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.pending: dict[str, Any] = {}
        self.ddp.register_comm_hook(self.pending, window_allreduce_hook)

    def step(self, batches: list[Batch]) -> None:
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1
            with contextlib.nullcontext() if last else self.ddp.no_sync():
                loss = self.loss(self.ddp, batch, len(batches))
                if last:  # the forwards are done: the window's numbers are known before the last backward
                    self.pending["work"] = self.window_collective()
                loss.backward()
        self.optimizer.step()
        zero_in_place(self.optimizer)

    def window_collective(self) -> Any:
        """Launch the step's small collective: an all-reduce of 8 float64 numbers."""
        return dist.all_reduce(torch.zeros(8, dtype=torch.float64, device=self.device), async_op=True)


class DDPWindowAllgather(DDPWindowAllreduce):
    """:class:`DDPWindowAllreduce` with the small collective an all-gather of each rank's row (8 float64 numbers:
    what :class:`distaccum.window.HostTotals` sends on the CPU), waited for in the hook alike."""

    def window_collective(self) -> Any:
        rows = torch.empty(8 * dist.get_world_size(), dtype=torch.float64, device=self.device)
        return all_gather_flat(rows, torch.zeros(8, dtype=torch.float64, device=self.device), async_op=True)


class DDPBf16Hook(HandWritten):
    """(f) (b) with a bf16-compressing comm hook; gradients stay bucket views and are zeroed in place."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.ddp = DDP(self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                       gradient_as_bucket_view=True)
        self.ddp.register_comm_hook(None, bf16_allreduce_hook)  # not named bf16_compress_hook: DDP refuses that name off NCCL
        self.optimizer = sgd(self.spec.lr)(list(self.model.parameters()))

    def step(self, batches: list[Batch]) -> None:
        for i, batch in enumerate(batches):
            with contextlib.nullcontext() if i == len(batches) - 1 else self.ddp.no_sync():
                self.loss(self.ddp, batch, len(batches)).backward()
        self.optimizer.step()
        zero_in_place(self.optimizer)


class DDPNoSyncCompiled(DDPNoSync):
    """(g) (b) with the DDP module compiled as an expert would: ``torch.compile(ddp, dynamic=True)`` (dynamo's
    DDP optimizer splits the graph at the gradient buckets, so the all-reduces still overlap the backward);
    what ``distaccum_compiled`` (``trainer.compile=true``) is measured against."""

    dynamic: bool | None = True

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.eager = self.ddp
        self.compiled = torch.compile(self.ddp, dynamic=self.dynamic)

    def step(self, batches: list[Batch]) -> None:
        for i, batch in enumerate(batches):
            with contextlib.nullcontext() if i == len(batches) - 1 else self.eager.no_sync():
                self.loss(self.compiled, batch, len(batches)).backward()
        self.optimizer.step()
        zero_in_place(self.optimizer)


class DDPNoSyncCompiledStatic(DDPNoSyncCompiled):
    """(g) with dynamo's default shapes (``dynamic=None``: specialised until a size changes): a diagnostic of the
    baseline against ``ddp_no_sync_compiled``."""

    dynamic = None


class AccelerateLoop(HandWritten):
    """(c) Accelerate's ``accumulate()`` (one Accelerator per process: its state is a singleton)."""

    def __init__(self, name: str, spec: Spec, *args: Any) -> None:
        super().__init__(name, spec, *args)
        from accelerate import Accelerator  # optional dependency, only this variant needs it

        self.accelerator = Accelerator(cpu=self.device.type == "cpu", gradient_accumulation_steps=spec.accum_steps,
                                       mixed_precision="bf16" if spec.precision == "bf16" else "no")
        optimizer = sgd(spec.lr)(list(self.model.parameters()))
        self.prepared, self.optimizer = self.accelerator.prepare(self.model, optimizer)

    def step(self, batches: list[Batch]) -> None:
        for batch in batches:
            x, y = self.batch(batch)
            with self.accelerator.accumulate(self.prepared):
                self.accelerator.backward(F.mse_loss(self.prepared(x), y))  # divides by K; syncs on the K-th
                self.optimizer.step()  # a no-op until the K-th micro-batch
                self.optimizer.zero_grad()

    def close(self) -> None:
        self.accelerator.free_memory()


class ComputeFloor(HandWritten):
    """(e) The same arithmetic without DDP: no communication at all."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.optimizer = sgd(self.spec.lr)(list(self.model.parameters()))

    def step(self, batches: list[Batch]) -> None:
        for batch in batches:
            self.loss(self.model, batch, len(batches)).backward()
        self.optimizer.step()
        zero_in_place(self.optimizer)


def distaccum_config(spec: Spec, run_dir: Path, *, engine: str = "ddp",
                     overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Trainer's configuration: product defaults, except what makes it train what the
    hand-written loops train and keeps work they do not do out of the timed steps."""
    config: dict[str, Any] = {
        "engine": {"name": engine},
        "accum": {"micro_batch": spec.micro_batch, "steps": spec.accum_steps, "global_batch": None},
        # The baselines' plain SGD comes in as the optimizer factory; the config adds no schedule
        # and no clipping (default 1.0: the baselines do not clip).
        "optim": {"schedule": "constant", "warmup_steps": 0, "clip_norm": None},
        "trainer": {"max_steps": spec.total_steps, "seed": spec.seed, "device": spec.device,
                    "check_every": 0,  # the cross-rank tripwire (default every 10): a check the baselines lack
                    "checkpoint_every": 0,  # default 100: no periodic checkpoint inside the timed steps
                    "save_final": False},  # after timing; irrelevant here
        "data": {"shuffle": False},  # the baselines' in-order walk; the collate then takes views
        # The ledger stays on (default); the per-step gradient norm, which the baselines do not compute, is off
        # (no clipping needs it: its cost is the distaccum_grad_norm variant's ratio).
        "log": {"console": "quiet", "warmup_steps": spec.warmup, "grad_norm": False},
        "precision": spec.precision,  # what the hand-written loops compute in (fp32, or bf16 autocast)
        "run_dir": str(run_dir),
    }
    for dotted, value in (overrides or {}).items():
        *parents, leaf = dotted.split(".")
        section = config
        for part in parents:
            section = section.setdefault(part, {})
        section[leaf] = value
    return config


class DistaccumTrainer:
    """(d) distaccum's public Trainer, stepped with ``train_steps(n)`` in blocks.

    A step's stamp: on the CPU from ``on_step`` (after the step's record went to the sinks: all of the step's
    work); on CUDA from the optimizer's post-step hook, as the hand-written loops stamp after their optimizer
    step, because an ``on_step`` would turn off the Trainer's default there, the lagged records (a step's record
    is made once the next step is queued, :class:`distaccum.loop.StepEnd`): the stamp must not move the work."""

    LAG_RECORDS: bool | None = None
    """``Trainer(lag_records=...)``: the Trainer's default."""

    @staticmethod
    def loss_fn() -> Any:
        """The loss the Trainer gets, looked up when it is built (the benchmark's :func:`~benchmarks.cases.loss_sum`,
        or what a tool put in its place: ``benchmarks.rss_maps`` reads memory from inside it)."""
        return loss_sum

    @staticmethod
    def inputs(data: BenchData) -> tuple[Dataset, Any]:
        """(dataset, collate) the Trainer gets: the samples as a plain ``TensorDataset``, no collate (what a user
        with tensors in memory passes; the Trainer cuts its micro-batches in the process, the hand-written loops'
        slices of the same tensors)."""
        return TensorDataset(data.x, data.y), None

    def __init__(self, name: str, spec: Spec, data: BenchData, rank: int, device: torch.device, clock: Clock,
                 run_dir: Path) -> None:
        self.name, self.clock = name, clock
        self._stamps: list[Any] = []
        engine, overrides = ENGINE_VARIANTS[name]
        config = distaccum_config(spec, run_dir, engine=engine, overrides=overrides)
        on_gpu = device.type == "cuda"
        dataset, collate = self.inputs(data)
        self.trainer = Trainer(config, model=spec.shape.build, dataset=dataset, collate=collate,
                               loss=self.loss_fn(), optimizer=self._stamped(sgd(spec.lr)) if on_gpu else sgd(spec.lr),
                               on_step=None if on_gpu else self._on_step, lag_records=self.LAG_RECORDS)
        self.trainer.setup()  # joins the group this process already has, builds and wraps the model
        self.records: list[dict[str, Any]] = []

    def _on_step(self, state: Any, record: dict[str, Any]) -> None:
        # Runs after the step's record went to the sinks: the stamp covers all of the step's work.
        self._stamps.append(self.clock.stamp())

    def _stamped(self, factory: Any) -> Any:
        def build(params: Any) -> torch.optim.Optimizer:
            optimizer = factory(params)
            optimizer.register_step_post_hook(lambda *_: self._stamps.append(self.clock.stamp()))
            return optimizer
        return build

    def run(self, steps: int) -> list[Any]:
        self._stamps = [self.clock.stamp()]
        self.records += self.trainer.train_steps(steps)
        if len(self._stamps) != steps + 1:
            raise RuntimeError(f"Trainer.train_steps({steps}) stamped {len(self._stamps) - 1} steps: the benchmark "
                               "times a step from one stamp to the next and needs one per step")
        return self._stamps

    def parameters(self) -> Iterator[torch.Tensor]:
        return (tensor for _, tensor in self.trainer.state.engine.full_parameters())

    def close(self) -> None:
        self.trainer.finish()


class DistaccumTotalsKind(DistaccumTrainer):
    """``distaccum`` whose loop keeps the window's totals as :attr:`KIND` while it runs (the loop asks
    ``WindowTotals.for_device`` once per step, so swapping it for the run's duration changes nothing else)."""

    KIND: type[window.WindowTotals]
    """Built as ``for_device`` builds its kinds: a :class:`~distaccum.window.HostTotals` with the run's transport."""

    def run(self, steps: int) -> list[Any]:
        chosen, kind = window.WindowTotals.for_device, self.KIND

        def build(split: Any, rank: int, device: torch.device, exchange: Any = None) -> window.WindowTotals:
            if issubclass(kind, window.HostTotals):
                return kind(split, rank, device, exchange)
            return kind(split, rank, device)

        window.WindowTotals.for_device = staticmethod(build)  # type: ignore[method-assign, assignment]
        try:
            return super().run(steps)
        finally:
            window.WindowTotals.for_device = chosen  # type: ignore[method-assign]


class DistaccumDeviceTotals(DistaccumTotalsKind):
    """``distaccum`` with the window's totals as device tensors on the CPU too: the difference from ``distaccum``
    prices :class:`~distaccum.window.HostTotals`."""

    KIND = window.DeviceTotals


class HostTotalsAllreduce(window.HostTotals):
    """:class:`~distaccum.window.HostTotals` with the window's collective an all-reduce of the whole layout (each
    rank's values in its slots, zeros in the others), as before this release: the same totals, the other
    collective."""

    @property
    def totals(self) -> torch.Tensor:  # type: ignore[override]
        return self._sent

    def reduce(self, *, stop: bool, checkpoint_due: bool) -> None:
        mine = window.layout([self.own_row(stop=stop, checkpoint_due=checkpoint_due)], self.split.world_size)
        self._sent = torch.tensor(mine, dtype=torch.float64)  # this rank's values, zeros in the others' slots
        self._work = dist.all_reduce(self._sent, async_op=True)

    def _reduced(self) -> list[float]:
        if self._got is None:
            self._work.wait()
            self._got = self._sent.tolist()
        return self._got


class DistaccumHostAllreduce(DistaccumTotalsKind):
    """``distaccum`` whose CPU window totals all-reduce (:class:`HostTotalsAllreduce`): the difference from
    ``distaccum`` prices the all-gather :class:`~distaccum.window.HostTotals` makes instead."""

    KIND = HostTotalsAllreduce


class HostTotalsGloo(window.HostTotals):
    """:class:`~distaccum.window.HostTotals` whose rows always go through gloo's all-gather (what runs across hosts,
    and on one host before this release), not the run's Unix sockets: the same rows, so the same totals."""

    def __init__(self, split: Any, rank: int, device: torch.device, exchange: Any = None) -> None:
        super().__init__(split, rank, device, GlooExchange())  # the run's ``exchange`` set aside


class DistaccumGlooWindow(DistaccumTotalsKind):
    """``distaccum`` whose CPU window's rows go through gloo's all-gather (:class:`HostTotalsGloo`) instead of the
    Unix sockets a run on one host uses (:mod:`distaccum.cluster.exchange`): ``distaccum_gloo_window / distaccum``
    prices gloo's hand-off to its thread and back for the window's collective."""

    KIND = HostTotalsGloo


class DistaccumFoldedK1(DistaccumTrainer):
    """``distaccum`` whose engine does not take a one-micro-batch window's normalization in the loss, while it runs:
    at K = 1 the difference from ``distaccum`` prices :meth:`~distaccum.engines.replicated.ReplicatedEngine.
    normalize_loss` (the reduction folds the normalization in instead, a pass over each bucket as it lands)."""

    def run(self, steps: int) -> list[Any]:
        engine = self.trainer.state.engine
        engine.normalize_loss = lambda scale: None  # on the instance, for this run only
        try:
            return super().run(steps)
        finally:
            del engine.normalize_loss


class DistaccumSyncRecords(DistaccumTrainer):
    """``distaccum`` with each step's record made right after it (``Trainer(lag_records=False)``: the timer
    synchronizes the device once per step): on CUDA, ``distaccum_sync_records / distaccum`` is what the lagged
    records (the default there) save; on the CPU the two are the same loop."""

    LAG_RECORDS = False


class DistaccumLoader(DistaccumTrainer):
    """``distaccum`` fed through a DataLoader as before this release: the dataset of sample indices and the collate
    that slices the tensors (:class:`~benchmarks.cases.SliceCollate`, views of consecutive rows): the difference
    from ``distaccum`` prices :class:`~distaccum.data.pipeline.TensorRows`."""

    @staticmethod
    def inputs(data: BenchData) -> tuple[Dataset, Any]:
        return data.dataset, data.collate


class DistaccumCopiedRows(DistaccumTrainer):
    """``distaccum`` whose loss works on a copy of its micro-batch (a ``clone`` of each tensor's rows, the copy
    :class:`~distaccum.data.pipeline.TensorRows` made of consecutive rows before this release): the difference from
    ``distaccum`` prices the views it hands out now."""

    @staticmethod
    def loss_fn() -> Any:
        return copied_rows_loss


def copied_rows_loss(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, int]:
    """:func:`~benchmarks.cases.loss_sum` of a copy of the micro-batch (:class:`DistaccumCopiedRows`)."""
    x, y = batch
    return loss_sum(model, (x.clone(), y.clone()))


TRAINERS: dict[str, type[DistaccumTrainer]] = {"distaccum_copied_rows": DistaccumCopiedRows,"distaccum_device_totals": DistaccumDeviceTotals,
                                                "distaccum_host_allreduce": DistaccumHostAllreduce,
                                                "distaccum_loader": DistaccumLoader,
                                                "distaccum_gloo_window": DistaccumGlooWindow,
                                                "distaccum_folded_k1": DistaccumFoldedK1,
                                                "distaccum_sync_records": DistaccumSyncRecords}
"""distaccum variants that need more than config overrides (the rest are :class:`DistaccumTrainer`)."""


HAND_WRITTEN = {"ddp_every_micro": DDPEveryMicro, "ddp_no_sync": DDPNoSync, "ddp_no_sync_twin": DDPNoSync,
                "accelerate": AccelerateLoop,
                "compute_floor": ComputeFloor, "ddp_bf16_hook": DDPBf16Hook, "ddp_python_hook": DDPPythonHook,
                "ddp_no_sync_compiled": DDPNoSyncCompiled, "ddp_no_sync_compiled_twin": DDPNoSyncCompiled,
                "ddp_no_sync_compiled_static": DDPNoSyncCompiledStatic,
                "ddp_python_hook_after": DDPPythonHookAfter, "ddp_window_allreduce": DDPWindowAllreduce,
                "ddp_window_allgather": DDPWindowAllgather}


def build_variant(name: str, spec: Spec, data: BenchData, rank: int, device: torch.device, clock: Clock,
                  workdir: Path) -> Variant:
    """Variant ``name`` for this rank (collective: call in the same order on every rank)."""
    if name in HAND_WRITTEN:
        return HAND_WRITTEN[name](name, spec, data, rank, device, clock)
    if name in ENGINE_VARIANTS:
        return TRAINERS.get(name, DistaccumTrainer)(name, spec, data, rank, device, clock, workdir / name)
    raise ValueError(f"unknown variant {name!r}; choose from {', '.join([*HAND_WRITTEN, *ENGINE_VARIANTS])}")


def check_variants(names: list[str]) -> None:
    """Refuse unknown names and combinations one process cannot hold (before any launch)."""
    unknown = [n for n in names if n not in HAND_WRITTEN and n not in ENGINE_VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {', '.join(unknown)}; choose from "
                         f"{', '.join([*HAND_WRITTEN, *ENGINE_VARIANTS])}")
    if len(set(names)) != len(names):
        raise ValueError(f"a variant is named twice in {', '.join(names)}")
    if "accelerate" in names and "distaccum_accelerate" in names:
        raise ValueError("accelerate and distaccum_accelerate cannot share a process: Accelerate's state is a "
                         "singleton; measure them in separate runs")
