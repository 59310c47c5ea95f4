"""The variants a launch runs: loops an expert writes by hand, and distaccum's Trainer.

Hand-written (:data:`HAND_WRITTEN`), every one DDP set up as an expert does (gradients as bucket views, zeroed in
place), the loss ``mse_loss(model(x), y) / K``:

- ``ddp_no_sync``: **the expert loop**, the baseline: ``no_sync()`` on micro-batches 1..K-1, one all-reduce per step.
- ``compute_floor``: the same K forward/backward passes and SGD step with no DDP and no communication (it runs on
  every rank, so the ranks compete for the CPU as in the others).
- ``ddp_no_sync_compiled``: the expert loop around ``torch.compile(ddp, dynamic=True)``;
  ``ddp_no_sync_compiled_static``: the same with dynamo's default shapes (``torch.compile(ddp)``: specialised to
  the benchmark's fixed micro-batch). Compiled distaccum is judged against the faster of the two.
- ``ddp_no_sync_twin``, ``ddp_no_sync_compiled_twin``: the A/A controls, the expert loop (eager, compiled) built a
  second time in the same processes: its ratio to the first is 1 by construction, so its spread is the harness's
  own resolution on the machine.
- ``ddp_every_micro`` (all-reduce every micro-batch), ``accelerate`` (Accelerate's ``accumulate()``),
  ``ddp_bf16_hook`` (the expert loop with a bf16-compressing comm hook: the baseline of ``distaccum_bf16_reduce``).

distaccum (:data:`DISTACCUM`): the public :class:`distaccum.Trainer` built from a config, each variant the product
defaults of :func:`distaccum_config` plus dotted config overrides and, for one, a Trainer argument. Nothing here
reaches into the library: variants are configurations.

Every variant exposes ``run(steps) -> stamps`` (steps + 1 clock stamps: before the first step and after each),
``parameters()`` and ``close()``. Construction is collective (DDP broadcasts).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

from benchmarks.cases import Batch, BenchData, Spec, loss_sum, sgd
from distaccum import Trainer
from distaccum.config import DEFAULT_EXTENSIONS_DIR
from distaccum.telemetry.ledger import Clock

EXPERT = "ddp_no_sync"
"""The baseline every ratio is read against, and whose trained parameters the others are compared with."""
EXTENSIONS = str(
    Path(DEFAULT_EXTENSIONS_DIR).expanduser()
)  # DeepSpeed's JIT-compiled op, built once per machine


@dataclass(frozen=True)
class Setup:
    """A distaccum variant: the engine, dotted config overrides, and the Trainer's ``lag_records`` argument."""

    engine: str = "ddp"
    overrides: dict[str, Any] = field(default_factory=dict)
    lag_records: bool | None = None
    """``Trainer(lag_records=...)``; None: the Trainer's default (a step late on CUDA)."""


_DS = {"engine.extensions_dir": EXTENSIONS}
DISTACCUM: dict[str, Setup] = {
    "distaccum": Setup(),
    "distaccum_compiled": Setup(overrides={"trainer.compile": True}),
    # What each per-step switch costs: distaccum with it turned off (or on) against distaccum.
    "distaccum_no_ledger": Setup(overrides={"log.ledger": False}),
    "distaccum_no_fingerprint": Setup(overrides={"trainer.fingerprint": False}),
    # Every per-step check off: the fingerprint, the ledger, the straggler view's gather. What is left is the
    # accumulation itself.
    "distaccum_no_checks": Setup(
        overrides={"trainer.fingerprint": False, "log.ledger": False, "log.rank_stats_every": 0}
    ),
    "distaccum_grad_norm": Setup(overrides={"log.grad_norm": True}),
    "distaccum_bf16_reduce": Setup(overrides={"accum.reduce_dtype": "bf16"}),
    "distaccum_sync_records": Setup(lag_records=False),  # on CUDA: what the lagged records save
    # Exact accumulation (int64 fixed-point sums, issue 59): what it costs the step against the default mode. It turns
    # on torch.use_deterministic_algorithms for its whole process (the other variants' too).
    "distaccum_exact": Setup(overrides={"accum.exact": True}),
    "distaccum_fsdp": Setup("fsdp"),
    "distaccum_fsdp_exact": Setup("fsdp", {"accum.exact": True}),
    "distaccum_fsdp_every_micro": Setup("fsdp", {"accum.sync": "every_micro"}),
    "distaccum_fsdp_unsharded": Setup("fsdp", {"engine.fsdp_unsharded_window": True}),
    "distaccum_fsdp_unchecked": Setup(
        "fsdp", {"trainer.fingerprint": False}
    ),  # prices the reduction checksum
    "distaccum_zero1": Setup("deepspeed", {"engine.zero_stage": 1, **_DS}),
    "distaccum_zero2": Setup("deepspeed", {"engine.zero_stage": 2, **_DS}),
    "distaccum_zero2_every_micro": Setup(
        "deepspeed", {"engine.zero_stage": 2, "accum.sync": "every_micro", **_DS}
    ),
    "distaccum_zero3": Setup("deepspeed", {"engine.zero_stage": 3, **_DS}),
    "distaccum_zero3_unchecked": Setup(
        "deepspeed", {"engine.zero_stage": 3, "trainer.fingerprint": False, **_DS}
    ),
    "distaccum_zero3_every_micro": Setup(
        "deepspeed", {"engine.zero_stage": 3, "accum.sync": "every_micro", **_DS}
    ),
    "distaccum_accelerate": Setup("accelerate"),
    # FSDP2 hybrid sharding, 2 replicas: a world of 4 or more (benchmarks.run --sweep hsdp --world 4).
    "distaccum_hsdp_boundary": Setup("fsdp", {"engine.replicas": 2, "accum.sync": "boundary"}),
    "distaccum_hsdp_replica_boundary": Setup(
        "fsdp", {"engine.replicas": 2, "accum.sync": "replica_boundary"}
    ),
    "distaccum_hsdp_every_micro": Setup("fsdp", {"engine.replicas": 2, "accum.sync": "every_micro"}),
}
"""distaccum variants by name. A new engine option is one more line; an override the config does not know fails
that variant's launch with the config's own message."""


class Variant(Protocol):
    """One way of training, stepped in blocks by a worker."""

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

    def __init__(
        self, name: str, spec: Spec, data: BenchData, rank: int, device: torch.device, clock: Clock
    ) -> None:
        self.name, self.spec, self.device, self.clock = name, spec, device, clock
        self.windows = data.windows(rank)
        self.position = 0
        torch.manual_seed(spec.seed)  # the weights distaccum's Trainer builds from trainer.seed
        self.model: nn.Module = spec.shape.build().to(device)
        self.optimizer = sgd(spec.lr)(list(self.model.parameters()))

    def step(self, batches: list[Batch]) -> None:
        raise NotImplementedError

    def loss(self, module: nn.Module, batch: Batch, accum_steps: int) -> torch.Tensor:
        """``mse_loss(module(x), y) / K`` for one micro-batch, moved to the device just before its forward; under
        bf16 autocast when the spec computes in bf16 (as an expert writes it: autocast around forward and loss,
        backward outside it; autocast runs ``mse_loss`` in fp32)."""
        x, y = (t.to(self.device, non_blocking=True) for t in batch)
        if self.spec.precision != "bf16":
            return F.mse_loss(module(x), y) / accum_steps
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            return F.mse_loss(module(x), y) / accum_steps

    def finish_step(self) -> None:
        """The optimizer step, then the gradients zeroed without freeing them: with bucket views,
        ``set_to_none=True`` would make the next window allocate a fresh set of gradients (page faults on a large
        model) and copy it into the buckets at the boundary."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)

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


class DDPEveryMicro(HandWritten):
    """DDP that all-reduces the gradients of every micro-batch."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        # An expert's DDP: gradients live in the communication buckets (no copy in or out).
        self.ddp = DDP(
            self.model,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            gradient_as_bucket_view=True,
        )

    def step(self, batches: list[Batch]) -> None:
        for batch in batches:
            self.loss(self.ddp, batch, len(batches)).backward()  # DDP all-reduces here
        self.finish_step()


class DDPNoSync(DDPEveryMicro):
    """The expert loop: DDP that skips the all-reduce on micro-batches 1..K-1 with ``no_sync()``."""

    def forward_module(self) -> nn.Module:
        """What the micro-batches run through (the compiled loops: the compiled module)."""
        return self.ddp

    def step(self, batches: list[Batch]) -> None:
        module = self.forward_module()
        for i, batch in enumerate(batches):
            # Gradients accumulate locally; only the last backward all-reduces the sum.
            with contextlib.nullcontext() if i == len(batches) - 1 else self.ddp.no_sync():
                self.loss(module, batch, len(batches)).backward()
        self.finish_step()


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


class DDPBf16Hook(DDPNoSync):
    """The expert loop with its all-reduce compressed to bf16 by a comm hook."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.ddp.register_comm_hook(
            None, bf16_allreduce_hook
        )  # not named bf16_compress_hook: refused off NCCL


class DDPNoSyncCompiled(DDPNoSync):
    """The expert loop with the DDP module compiled: ``torch.compile(ddp, dynamic=True)`` (dynamo's DDP optimizer
    splits the graph at the gradient buckets, so the all-reduces still overlap the backward), as distaccum compiles
    (``trainer.compile=true``) so that variable lengths and partial windows recompile nothing."""

    dynamic: bool | None = True

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.compiled = torch.compile(self.ddp, dynamic=self.dynamic)

    def forward_module(self) -> nn.Module:
        return self.compiled


class DDPNoSyncCompiledStatic(DDPNoSyncCompiled):
    """The compiled expert loop with dynamo's default shapes (``dynamic=None``: specialised until a size changes),
    which the benchmark's fixed micro-batch allows."""

    dynamic = None


class AccelerateLoop(HandWritten):
    """Accelerate's ``accumulate()``, the loop of its gradient-accumulation guide (one Accelerator per process: its
    state is a singleton)."""

    def __init__(self, name: str, spec: Spec, *args: Any) -> None:
        super().__init__(name, spec, *args)
        from accelerate import Accelerator  # optional dependency, only this variant needs it

        self.accelerator = Accelerator(
            cpu=self.device.type == "cpu",
            gradient_accumulation_steps=spec.accum_steps,
            mixed_precision="bf16" if spec.precision == "bf16" else "no",
        )
        self.prepared, self.optimizer = self.accelerator.prepare(self.model, self.optimizer)

    def step(self, batches: list[Batch]) -> None:
        for batch in batches:
            x, y = (t.to(self.device, non_blocking=True) for t in batch)
            with self.accelerator.accumulate(self.prepared):
                self.accelerator.backward(F.mse_loss(self.prepared(x), y))  # divides by K; syncs on the K-th
                self.optimizer.step()  # a no-op until the K-th micro-batch
                self.optimizer.zero_grad()

    def close(self) -> None:
        self.accelerator.free_memory()


class ComputeFloor(HandWritten):
    """The same arithmetic without DDP: no communication at all."""

    def step(self, batches: list[Batch]) -> None:
        for batch in batches:
            self.loss(self.model, batch, len(batches)).backward()
        self.finish_step()


def distaccum_config(spec: Spec, run_dir: Path, setup: Setup | None = None) -> dict[str, Any]:
    """The Trainer's configuration: product defaults, except what makes it train what the hand-written loops
    train and keeps work they do not do out of the timed steps, then ``setup``'s overrides."""
    setup = setup or Setup()
    config: dict[str, Any] = {
        "engine": {"name": setup.engine},
        "accum": {"micro_batch": spec.micro_batch, "steps": spec.accum_steps, "global_batch": None},
        # The loops' plain SGD comes in as the optimizer factory; no schedule and no clipping (default 1.0): the
        # loops do not clip.
        "optim": {"schedule": "constant", "warmup_steps": 0, "clip_norm": None},
        "trainer": {
            "max_steps": spec.total_steps,
            "seed": spec.seed,
            "device": spec.device,
            "check_every": 0,  # the cross-rank tripwire (default every 10): a check the loops lack
            "checkpoint_every": 0,  # default 100: no periodic checkpoint inside the timed steps
            "save_final": False,
        },  # after timing; irrelevant here
        "data": {"shuffle": False},  # the loops' in-order walk: the micro-batches are views of the tensors
        # The ledger and the fingerprint stay on (defaults); the per-step gradient norm, which the loops do not
        # compute and no clipping needs, is off (its cost: distaccum_grad_norm / distaccum).
        "log": {"console": "quiet", "warmup_steps": spec.warmup, "grad_norm": False},
        "precision": spec.precision,  # what the hand-written loops compute in (fp32, or bf16 autocast)
        "run_dir": str(run_dir),
    }
    for dotted, value in setup.overrides.items():
        *parents, leaf = dotted.split(".")
        section = config
        for part in parents:
            section = section.setdefault(part, {})
        section[leaf] = value
    return config


class DistaccumTrainer:
    """distaccum's public Trainer (:data:`DISTACCUM`), stepped with ``train_steps(n)`` in blocks.

    Its data is the benchmark's tensors as a plain ``TensorDataset`` (what a user with tensors in memory passes;
    the Trainer cuts the same views the hand-written loops slice). A step's stamp: on the CPU from ``on_step``
    (after the step's record went to the sinks: all of the step's work); on CUDA from the optimizer's post-step
    hook, as the hand-written loops stamp after their optimizer step, because an ``on_step`` would turn off the
    Trainer's default there, the lagged records: the stamp must not move the work."""

    def __init__(
        self,
        name: str,
        spec: Spec,
        data: BenchData,
        rank: int,
        device: torch.device,
        clock: Clock,
        run_dir: Path,
    ) -> None:
        self.name, self.clock = name, clock
        self._stamps: list[Any] = []
        setup = DISTACCUM[name]
        on_gpu = device.type == "cuda"
        self.trainer = Trainer(
            distaccum_config(spec, run_dir, setup),
            model=spec.shape.build,
            dataset=TensorDataset(data.x, data.y),
            loss=loss_sum,
            optimizer=self._stamped(sgd(spec.lr)) if on_gpu else sgd(spec.lr),
            on_step=None if on_gpu else self._on_step,
            lag_records=setup.lag_records,
        )
        self.trainer.setup()  # joins the group this process already has, builds and wraps the model
        self.records: list[dict[str, Any]] = []

    def _on_step(self, state: Any, record: dict[str, Any]) -> None:
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
            raise RuntimeError(
                f"Trainer.train_steps({steps}) stamped {len(self._stamps) - 1} steps: the benchmark "
                "times a step from one stamp to the next and needs one per step"
            )
        return self._stamps

    def parameters(self) -> Iterator[torch.Tensor]:
        return (tensor for _, tensor in self.trainer.state.engine.full_parameters())

    def close(self) -> None:
        self.trainer.finish()


HAND_WRITTEN: dict[str, type[HandWritten]] = {
    "ddp_no_sync": DDPNoSync,
    "ddp_no_sync_twin": DDPNoSync,
    "compute_floor": ComputeFloor,
    "ddp_no_sync_compiled": DDPNoSyncCompiled,
    "ddp_no_sync_compiled_twin": DDPNoSyncCompiled,
    "ddp_no_sync_compiled_static": DDPNoSyncCompiledStatic,
    "ddp_every_micro": DDPEveryMicro,
    "accelerate": AccelerateLoop,
    "ddp_bf16_hook": DDPBf16Hook,
}
"""Hand-written loops by name (a twin is the same class built a second time)."""
TIMED = (
    "ddp_no_sync",
    "distaccum",
    "compute_floor",
    "ddp_no_sync_twin",
    "distaccum_compiled",
    "ddp_no_sync_compiled",
    "ddp_no_sync_compiled_static",
    "ddp_no_sync_compiled_twin",
)
"""``make bench``'s timing: distaccum, the expert loop, the floor, the compiled pair (both compiled expert loops)
and the two A/A controls."""
SWEPT = (
    "ddp_no_sync",
    "distaccum",
    "distaccum_fsdp",
    "distaccum_zero2",
    "distaccum_zero3",
    "distaccum_accelerate",
)
"""``make bench``'s memory sweep: one variant per engine, and the expert loop as the reference."""


def build_variant(
    name: str, spec: Spec, data: BenchData, rank: int, device: torch.device, clock: Clock, workdir: Path
) -> Variant:
    """Variant ``name`` for this rank (collective: call in the same order on every rank)."""
    if name in HAND_WRITTEN:
        return HAND_WRITTEN[name](name, spec, data, rank, device, clock)
    if name in DISTACCUM:
        return DistaccumTrainer(name, spec, data, rank, device, clock, workdir / name)
    raise ValueError(f"unknown variant {name!r}; choose from {', '.join([*HAND_WRITTEN, *DISTACCUM])}")


def check_variants(names: list[str]) -> None:
    """Refuse unknown names and combinations one process cannot hold (before any launch)."""
    unknown = [n for n in names if n not in HAND_WRITTEN and n not in DISTACCUM]
    if unknown:
        raise ValueError(
            f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join([*HAND_WRITTEN, *DISTACCUM])}"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"a variant is named twice in {', '.join(names)}")
    if "accelerate" in names and "distaccum_accelerate" in names:
        raise ValueError(
            "accelerate and distaccum_accelerate cannot share a process: Accelerate's state is a "
            "singleton; measure them in separate runs"
        )


def sync_of(name: str) -> str:
    """How a variant synchronizes the gradients of a window (the memory table's column)."""
    if name in HAND_WRITTEN:
        return "no_sync (hand-written)" if name != "ddp_every_micro" else "every micro-batch (hand-written)"
    return str(DISTACCUM[name].overrides.get("accum.sync", "auto"))
