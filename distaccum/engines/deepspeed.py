"""DeepSpeed engine (ZeRO 0-3) behind the one engine protocol.

Scaling, stated once. The loop backpropagates ``S_rk * c * grad_divisor`` and, at the boundary,
asks for the gradients to be multiplied by ``grad_scale = 1 / (c N)``. DeepSpeed would divide the
loss again by ``gradient_accumulation_steps`` in ``backward`` and average gradients over the
data-parallel world in its reduction. We switch the first off (``backward(loss,
scale_wrt_gas=False)``) and declare the second (``grad_divisor = world size``). ``grad_scale`` is
applied by DeepSpeed itself: ZeRO optimizers divide the reduced gradient partitions (and the norm
they clip with) by their loss scale in ``step()``, so for the boundary step we set that scale to
``1 / grad_scale`` with the public ``override_loss_scale`` and put it back to 1 for the next
window's backward passes. ZeRO-0 in fp32 steps the torch optimizer on whole, already reduced
gradients: there we multiply them ourselves (ZeRO-0 with bf16 is refused, see
:func:`~distaccum.engines.deepspeed_config.check`). The loss is scaled once, by the loop.

Boundary control is DeepSpeed's public ``set_gradient_accumulation_boundary``, always set to the
window's real boundary (the last of its K micro-batches). With ``accum.sync=boundary`` on ZeRO 1/2/3
the window's backwards run inside DeepSpeed's ``coalesce_grad_reduction()``: gradients accumulate
locally and one reduction pass runs when the block closes after the last micro-batch — one round
per optimizer step, for a full gradient's worth of memory during the window (where DeepSpeed's
optimizer wrapper does not support it, e.g. bf16 on ZeRO-1, the engine falls back to DeepSpeed's
own cadence and says so). ``accum.sync=every_micro`` keeps DeepSpeed's per-micro-batch reduction on
ZeRO-2/3 (each micro-batch's gradient is reduced into the rank's partition, bucket by bucket of
``reduce_bucket_size``, and freed; the partition is the window's accumulator from micro-batch 2 on) and is
refused for ZeRO-0/1 (declaring an earlier micro-batch a boundary makes ZeRO-1/2 drop accumulated
gradients). ZeRO-2 ``every_micro`` can save memory over ``boundary`` only for a gradient larger than a bucket
(inferred from DeepSpeed's code).

Clipping happens inside ``engine.step()`` (``gradient_clipping`` in the generated config).
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ContextManager, cast

import torch
import torch.distributed as dist
from torch import nn

from distaccum.config import EngineConfig
from distaccum.engines.base import (
    REDUCE_DTYPES,
    EngineBase,
    EngineSpec,
    OptimizerFactory,
    StepResult,
    grads_of,
)
from distaccum.engines.comm_tap import tap_gradient_reductions
from distaccum.engines.compile import compile_options
from distaccum.engines.deepspeed_config import build, check
from distaccum.guards.checksum import ReductionChecksum, Rounding
from distaccum.telemetry.ledger import CommLedger


def use_extensions_dir(path: str, rank: int) -> Path:
    """Point torch's JIT extension cache at ``path`` (``~`` expanded; relative: to the cwd) and say so on rank 0.

    DeepSpeed compiles a C++ op the first time its communication layer starts (on CPU: the
    shared-memory all-reduce, ~40 s with g++ and ninja); torch reads the cache location only from
    the ``TORCH_EXTENSIONS_DIR`` environment variable, so the engine sets it before that happens.
    """
    resolved = Path(path).expanduser().resolve()
    os.environ["TORCH_EXTENSIONS_DIR"] = str(resolved)
    if rank == 0:
        cached = resolved.is_dir() and any(resolved.iterdir())
        state = (
            "reusing the ops cached there"
            if cached
            else "first use: compiling them there (a minute or more, once)"
        )
        print(f"distaccum: DeepSpeed C++ ops cache (engine.extensions_dir): {resolved} — {state}", flush=True)
    return resolved


@contextlib.contextmanager
def _quiet_deepspeed() -> Iterator[None]:
    """``override_loss_scale`` logs every change at INFO; twice a step would flood the console."""
    logger = logging.getLogger("DeepSpeed")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


DEEPSPEED_TAG = "zero"
"""The tag (sub-directory) of DeepSpeed's checkpoint inside distaccum's checkpoint directory."""


def owned_positions(param: nn.Parameter, stage: int, rank: int) -> tuple[int, int]:
    """The flat positions [lo, hi) of ``param`` whose reduced gradient this rank's ZeRO partition holds.

    ZeRO-0 reduces whole gradients: every rank holds all of them. DeepSpeed 0.19 internals
    (tests/test_reduction_checksum.py fails if they move): ZeRO-3 splits every parameter
    into W pieces of ``ds_tensor.ds_numel`` elements, rank r's the r-th; ZeRO-1/2 split the flat concatenation of a
    parameter group, and ``param._hp_mapping.lp_fragment_address`` (None: no piece here) is where this rank's piece
    of ``param`` starts and how long it is (what DeepSpeed's own ``safe_get_full_grad`` reads)."""
    zero: Any = param  # DeepSpeed's attributes on the parameter
    if stage == 0:
        return 0, param.numel()
    if stage == 3:
        piece, numel = int(zero.ds_tensor.ds_numel), int(zero.ds_numel)
        return min(rank * piece, numel), min((rank + 1) * piece, numel)
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:
        return 0, 0
    address = mapping.lp_fragment_address
    return int(address.start), int(address.start + address.numel)


def reduced_partition(param: nn.Parameter, stage: int) -> torch.Tensor | None:
    """This rank's piece of ``param``'s reduced gradient (the positions :func:`owned_positions` names), flat; None
    when it holds none. ZeRO-3: DeepSpeed's public ``safe_get_local_grad``; ZeRO-1/2: the gradient fragment that
    DeepSpeed's ``get_full_hp_grad`` reads, without its all-reduce; ZeRO-0: the parameter's reduced ``.grad``."""
    if stage == 0:
        return param.grad
    if stage == 3:
        from deepspeed.utils import safe_get_local_grad

        return safe_get_local_grad(param)
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:
        return None
    fragment = mapping.get_lp_grad_fragment(cast(Any, param)._index_in_param_group).reshape(-1)
    address = mapping.lp_fragment_address
    if fragment.numel() == param.numel() != address.numel:  # a whole-parameter buffer (bf16)
        fragment = fragment.narrow(0, address.start, address.numel)
    return fragment


class DeepSpeedEngine(EngineBase):
    """``deepspeed.initialize`` with our torch optimizer and a config generated from ours."""

    name = "deepspeed"
    ft_refusal = (
        "ZeRO partitions the optimizer state inside DeepSpeed's own engine, which torchft can neither sum across "
        "groups nor copy to a healing group; use engine=ddp or engine=fsdp inside each group"
    )
    reshardable_checkpoints = False  # ZeRO partitions optimizer state per rank
    reduce_dtypes = ("fp32", "bf16", "fp16")
    # deepspeed.initialize's ZeRO optimizer check imports deepspeed.runtime.zero.muon, whose module calls torch.compile
    # at import, which loads inductor's compile_fx (about 0.9 s of CPU): once in the worker server, not per worker.
    # deepspeed itself is not preloaded: importing it picks its accelerator (DS_ACCELERATOR) before the launch sets it.
    worker_imports = ("torch._inductor.compile_fx",)

    @classmethod
    def identity(cls, config: EngineConfig) -> dict[str, Any]:
        """The ZeRO stage decides how the checkpoint is partitioned."""
        return {"engine.zero_stage": config.zero_stage}

    @classmethod
    def check(cls, spec: EngineSpec) -> None:
        """Combinations DeepSpeed cannot run, and conflicts with the user's DeepSpeed JSON."""
        super().check(spec)
        check(spec)
        if (
            spec.precision.name == "fp16" and spec.device.type == "cpu"
        ):  # pragma: no cover - check() refuses fp16
            raise ValueError("engine=deepspeed precision=fp16 needs a GPU")

    def __init__(self, spec: EngineSpec, ledger: CommLedger) -> None:
        super().__init__(spec, ledger)
        self.stage = spec.engine.zero_stage
        # DeepSpeed averages gradients over the data-parallel world; scale_wrt_gas=False below.
        self.grad_divisor = float(dist.get_world_size())
        self.accum_steps = spec.split.accum_steps
        self._micro = 0  # micro-batches seen: the loop's windows always hold exactly K
        self.engine: Any = None
        self.coalescing = False
        self.unscaled_wrapper = False
        self._block: Any = None  # the open coalesce_grad_reduction() context of the current window
        self.checksum: ReductionChecksum | None = None
        """The reduction checksum (``EngineSpec.sample_grads``)."""
        """The groups of ranks that each hold the whole reduced gradient between them."""

    def wrap(self, model: nn.Module, make_optimizer: OptimizerFactory) -> nn.Module:
        use_extensions_dir(self.spec.engine.extensions_dir, dist.get_rank())
        # DeepSpeed picks its accelerator by probing (CUDA if present); ours is trainer.device.
        os.environ["DS_ACCELERATOR"] = "cuda" if self.device.type == "cuda" else "cpu"
        # DeepSpeed 0.19 still calls the deprecated torch names; say it once here, not per rank and op.
        warnings.filterwarnings(
            "ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning
        )
        import deepspeed

        model = model.to(device=self.device, dtype=self.precision.param_dtype)
        optimizer = make_optimizer(list(model.parameters()))
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=build(self.spec), dist_init_required=False
        )
        # Our LR scheduler wraps this torch optimizer; DeepSpeed's ZeRO/bf16 wrappers step it
        # (over their fp32 partitions) and read its param_groups' lr, so the schedule applies.
        stepped = engine.optimizer
        if stepped is not optimizer and getattr(stepped, "optimizer", None) is not optimizer:
            raise RuntimeError(
                f"DeepSpeed steps {type(stepped).__name__}, not the optimizer we passed; "
                "the learning-rate schedule would not reach it"
            )
        if self.spec.compile_mode:  # DeepSpeed's own path: it compiles the module it runs
            engine.compile(compile_kwargs=compile_options(self.spec.compile_mode))
        self.engine = engine
        self.optimizer = optimizer
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

        self.unscaled_wrapper = isinstance(engine.optimizer, BF16_Optimizer)
        """DeepSpeed's optimizer wrapper has no loss scale for ``override_loss_scale`` to act through."""
        self.coalescing = self.spec.sync == "boundary" and self.stage >= 1
        if self.coalescing and not hasattr(engine.optimizer, "_coalesce_grad_reduction"):
            self.coalescing = False  # DeepSpeed raises NotImplementedError for this optimizer wrapper
            if dist.get_rank() == 0:
                print(
                    f"distaccum: DeepSpeed cannot coalesce the window's reductions with "
                    f"{type(engine.optimizer).__name__} (ZeRO-{self.stage}, {self.precision.name}); it reduces "
                    "on DeepSpeed's own reduction cadence",
                    flush=True,
                )
        if self.spec.sample_grads:
            self._watch(list(engine.module.parameters()))
        return engine

    def _watch(self, params: list[nn.Parameter]) -> None:
        """Set up the reduction checksum (:mod:`distaccum.guards.checksum`) over ``params``: hooks on the parameters
        (autograd's leaves: every micro-batch's local gradient, before DeepSpeed's own hooks bucket and reduce it)
        and the flat positions of each parameter this rank's partition holds (:func:`owned_positions`)."""
        world = dist.get_world_size()
        dtype = params[0].dtype
        self.checksum = ReductionChecksum(
            [cast(Any, p).ds_numel if self.stage == 3 else p.numel() for p in params],
            [owned_positions(p, self.stage, dist.get_rank()) for p in params],
            self.accum_steps,
            self.device,
            dtype,
            torch.float32 if self.stage == 3 else dtype,  # safe_get_local_grad hands out fp32
        )
        self.checksum.watch(params)
        # ZeRO-0 all-reduces: every rank holds the whole reduced gradient, a replica of its own.
        self.checksum.replicas = [[r] for r in range(world)] if self.stage == 0 else [list(range(world))]
        self.checksum.group = self.spec.group
        # ZeRO-0 and a coalesced window: autograd accumulates the parameters' gradients (``grad +=`` in their dtype)
        # and one reduction runs; every_micro reduces each micro-batch into the partition. DeepSpeed's own cadence
        # and its BF16_Optimizer accumulate where this does not reproduce: their K roundings stay in the bound.
        once = self.stage == 0 or self.coalescing
        self.checksum.rounding = Rounding(
            world=world,
            accum_steps=self.accum_steps,
            reduce=REDUCE_DTYPES[self.spec.reduce_dtype] or dtype,
            held=dtype,
            accumulate=dtype if once or self.spec.sync == "boundary" else None,
            exact=not self.unscaled_wrapper and (once or self.spec.sync != "boundary"),
            divides=True,
        )
        if self.checksum.rounding.announced and dist.get_rank() == 0:
            print(f"distaccum: {self.checksum.rounding.describe()}", flush=True)

    def reduction_rounds(self, accum_steps: int | None = None) -> tuple[int, int] | None:
        # As accum.sync says (measured on gloo: ZeRO-0 and the coalesced ZeRO-1-3 window 1 round, ZeRO-2/3
        # every_micro K), except where the window cannot be coalesced: DeepSpeed's own reduction cadence, no promise.
        fallback = self.spec.sync == "boundary" and self.stage >= 1 and not self.coalescing
        return None if fallback else super().reduction_rounds(accum_steps)

    @contextlib.contextmanager
    def sync(self, enabled: bool) -> Iterator[None]:
        first = self._micro % self.accum_steps == 0
        if self.checksum is not None:
            self.checksum.micro = self._micro % self.accum_steps
        self._micro += 1
        boundary = self._micro % self.accum_steps == 0
        if self.spec.sync == "boundary" and enabled != boundary:
            raise RuntimeError(
                f"micro-batch {self._micro} of a {self.accum_steps}-step window: the loop says "
                f"sync={enabled}, DeepSpeed's boundary would be {boundary}"
            )
        self.engine.set_gradient_accumulation_boundary(boundary)
        if self.coalescing and first:
            self._block = self.engine.coalesce_grad_reduction()
            self._block.__enter__()
        try:
            yield
        finally:
            if self._block is not None and boundary:
                block, self._block = self._block, None
                with tap_gradient_reductions(self.ledger):  # the window's one reduction pass
                    block.__exit__(None, None, None)
                # The block restores the boundary flag of its first micro-batch; step() needs True.
                self.engine.set_gradient_accumulation_boundary(True)

    def forward_context(self) -> ContextManager[object]:
        # bf16 makes DeepSpeed hold half-precision weights; autocast casts the float inputs.
        return self.precision.autocast(self.device)

    def backward(self, loss: torch.Tensor) -> None:
        with tap_gradient_reductions(self.ledger):  # ZeRO reduces inside backward (hooks, epilogue)
            self.engine.backward(loss, scale_wrt_gas=False)

    def step(self, max_norm: float | None, grad_scale: float) -> StepResult:
        if (max_norm or 0.0) != self.engine.gradient_clipping():  # DeepSpeed #8068: its default is 1.0
            raise RuntimeError(
                f"DeepSpeed's gradient_clipping is {self.engine.gradient_clipping()} but optim.clip_norm="
                f"{max_norm}: the config distaccum generates sets gradient_clipping (0.0 without clipping), so "
                "something dropped or replaced it on the way to deepspeed.initialize, and DeepSpeed's default "
                "(1.0 since DeepSpeed #8068) would clip a run that never asked for it"
            )
        sums = None
        if self.checksum is not None:  # the reduced side, before the step divides it (a mean: x W)
            shards = [reduced_partition(p, self.stage) for p in self.engine.module.parameters()]
            sums = self.checksum.take(shards, float(dist.get_world_size()))
        result = self._step(grad_scale)
        return StepResult(result.grad_norm, result.applied, grad_sums=sums)

    def _step(self, grad_scale: float) -> StepResult:
        """Normalize (x ``grad_scale``), clip and step: DeepSpeed's own step, through its loss scale."""
        wrapper = self.engine.optimizer
        if wrapper is self.optimizer:
            # ZeRO-0 fp32: whole gradients on the parameters, reduced at the boundary.
            grads = grads_of(self.engine.module.parameters())
            torch._foreach_mul_(grads, grad_scale)
            norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
            if not (norm == norm and norm != float("inf")):
                self.engine.zero_grad()
                return StepResult(norm, False)
            self.engine.step()  # clips (gradient_clipping) and steps the torch optimizer
            return StepResult(norm, True)
        if self.unscaled_wrapper:
            # BF16_Optimizer (bf16 with fp32 gradient accumulation, from a user config) has no loss scale for
            # the override to act through: its accumulated, reduced fp32 gradients are multiplied before it
            # takes their norm.
            flat = wrapper.fp32_groups_gradients_flat
            torch._foreach_mul_(flat, grad_scale)
            self.engine.step()
        else:
            with _quiet_deepspeed():
                # ZeRO 1-3: DeepSpeed divides gradients and their norm by its loss scale in step().
                wrapper.override_loss_scale(1.0 / grad_scale)
                try:
                    self.engine.step()  # norm, clip, optimizer step (skipped on a non-finite norm), zero grads
                finally:
                    wrapper.override_loss_scale(1.0)  # the next window's backward is not scaled
        norm = self.engine.get_global_grad_norm()
        if norm is None:
            raise RuntimeError(
                "DeepSpeed reported no gradient norm "
                "(zero_optimization.compute_grad_norm off in the user config?)"
            )
        return StepResult(float(norm), bool(self.engine.was_step_applied()))

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        # engine.module is the plain model: names without DeepSpeed's "module." prefix.
        import deepspeed

        for name, param in self.engine.module.named_parameters():
            # ZeRO-3 holds a 1/W partition; gather one parameter at a time (collective).
            with deepspeed.zero.GatheredParameters([param], enabled=self.stage == 3):
                yield name, param.detach().clone()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        # Exactly the plain model's state_dict() keys: persistent buffers only (a non-persistent one, such
        # as a Llama's rotary ``original_inv_freq``, would be an unexpected key for from_pretrained), and a
        # tied parameter under each of its names. ZeRO-3 parameters are gathered (full_parameters);
        # buffers are never partitioned.
        module = self.engine.module
        gathered = {name: t.to("cpu", copy=True) for name, t in self.full_parameters()}
        names = {id(param): name for name, param in module.named_parameters()}
        return {
            key: gathered[names[id(value)]] if id(value) in names else value.detach().to("cpu", copy=True)
            for key, value in module.state_dict(keep_vars=True).items()
        }

    def unwrapped(self) -> nn.Module:
        return self.engine.module

    def save_state(self, directory: Path) -> dict[str, Any]:
        # DeepSpeed's own checkpoint: every rank writes its ZeRO partition (collective).
        self.engine.save_checkpoint(str(directory), tag=DEEPSPEED_TAG, client_state={}, save_latest=False)
        return {"world_size": dist.get_world_size()}

    def load_state(self, directory: Path, extra: dict[str, Any]) -> None:
        if extra.get("world_size") not in (None, dist.get_world_size()):
            raise ValueError(
                f"a DeepSpeed ZeRO checkpoint written by {extra['world_size']} ranks cannot be loaded by "
                f"{dist.get_world_size()}: DeepSpeed partitions optimizer state per rank"
            )
        # DeepSpeed unpickles its own files (its loader): distaccum checked them against the
        # checkpoint's manifest (sizes and sha256) before this point.
        path, _ = self.engine.load_checkpoint(
            str(directory), tag=DEEPSPEED_TAG, load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint under {directory}")

    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.destroy()  # removes ZeRO hooks and buffers
        self.engine = None
