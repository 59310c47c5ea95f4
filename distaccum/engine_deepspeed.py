"""DeepSpeed engine (ZeRO 0-3) behind the one backend protocol.

Scaling, stated once. The loop backpropagates ``S_rk * grad_divisor / N``. DeepSpeed would divide
that again: by ``gradient_accumulation_steps`` in ``backward`` and by the data-parallel world in its
gradient reduction (an average). We switch the first off (``backward(loss, scale_wrt_gas=False)``)
and declare the second (``grad_divisor = world size``), so the step sees exactly
``sum(S_rk) / N`` — the loss is scaled once, by the loop.

Boundary control is DeepSpeed's public ``set_gradient_accumulation_boundary``, always set to the
window's real boundary (the last of its K micro-batches): ZeRO-0/1 reduce only there; ZeRO-2/3
reduce(-scatter) on *every* micro-batch by design (that is how they keep only a gradient
partition), so ``accum.sync=every_micro`` changes nothing for them and is refused for ZeRO-0/1
(declaring an earlier micro-batch a boundary makes ZeRO-1/2 drop accumulated gradients).

Clipping happens inside ``engine.step()`` (``gradient_clipping`` in the generated config), so
``clip_grad_norm`` runs DeepSpeed's step and returns the norm DeepSpeed computed; ``step()`` then
only reports whether it was applied.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ContextManager

import torch
import torch.distributed as dist
from torch import nn

from distaccum.backend import OptimizerFactory, Precision
from distaccum.comm import CommLedger
from distaccum.comm_tap import tap_gradient_reductions
from distaccum.config import RunConfig
from distaccum.deepspeed_config import build


def use_extensions_dir(path: str, rank: int) -> Path:
    """Point torch's JIT extension cache at ``path`` (relative: to the cwd) and say so on rank 0.

    DeepSpeed compiles a C++ op the first time its communication layer starts (on CPU: the
    shared-memory all-reduce, ~40 s with g++ and ninja); torch reads the cache location only from
    the ``TORCH_EXTENSIONS_DIR`` environment variable, so the engine sets it before that happens.
    """
    resolved = Path(path).resolve()
    os.environ["TORCH_EXTENSIONS_DIR"] = str(resolved)
    if rank == 0:
        cached = resolved.is_dir() and any(resolved.iterdir())
        state = ("reusing the ops cached there" if cached
                 else "first use: compiling them there (a minute or more, once)")
        print(f"distaccum: DeepSpeed C++ ops cache (engine.extensions_dir): {resolved} — {state}", flush=True)
    return resolved


class DeepSpeedBackend:
    """``deepspeed.initialize`` with our torch optimizer and a config generated from ours."""

    name = "deepspeed"

    def __init__(self, cfg: RunConfig, device: torch.device, ledger: CommLedger) -> None:
        self.cfg = cfg
        self.device = device
        self.ledger = ledger
        self.precision = Precision.of(cfg.precision)
        self.stage = cfg.engine.zero_stage
        # DeepSpeed averages gradients over the data-parallel world; scale_wrt_gas=False below.
        self.grad_divisor = float(dist.get_world_size())
        if cfg.precision == "fp16" and device.type == "cpu":
            raise ValueError("engine=deepspeed precision=fp16 needs a GPU (DeepSpeed's CPU accelerator "
                             "has no fp16); use bf16 or fp32 on CPU")
        self.accum_steps = cfg.split(dist.get_world_size()).accum_steps
        self._micro = 0  # micro-batches seen: the loop's windows always hold exactly K
        self.engine: Any = None
        self._applied: bool | None = None  # set by the DeepSpeed step run in clip_grad_norm

    def wrap(self, model: nn.Module, make_optimizer: OptimizerFactory) -> nn.Module:
        use_extensions_dir(self.cfg.engine.extensions_dir, dist.get_rank())
        # DeepSpeed picks its accelerator by probing (CUDA if present); ours is trainer.device.
        os.environ["DS_ACCELERATOR"] = "cuda" if self.device.type == "cuda" else "cpu"
        # DeepSpeed 0.19 still calls the deprecated torch names; say it once here, not per rank and op.
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated",
                                category=FutureWarning)
        import deepspeed

        config = build(self.cfg, self.cfg.split(dist.get_world_size()))
        model = model.to(device=self.device, dtype=self.precision.param_dtype)
        optimizer = make_optimizer(list(model.parameters()))
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                               dist_init_required=False)
        # Our LR scheduler wraps this torch optimizer; DeepSpeed's ZeRO/bf16/fp16 wrappers step it
        # (over their fp32 partitions) and read its param_groups' lr, so the schedule applies.
        stepped = engine.optimizer
        if stepped is not optimizer and getattr(stepped, "optimizer", None) is not optimizer:
            raise RuntimeError(f"DeepSpeed steps {type(stepped).__name__}, not the optimizer we passed; "
                               "the learning-rate schedule would not reach it")
        self.engine = engine
        self.optimizer = optimizer
        return engine

    def sync(self, enabled: bool) -> ContextManager[object]:
        self._micro += 1
        boundary = self._micro % self.accum_steps == 0
        if self.cfg.accum.sync == "boundary" and enabled != boundary:
            raise RuntimeError(f"micro-batch {self._micro} of a {self.accum_steps}-step window: the loop says "
                               f"sync={enabled}, DeepSpeed's boundary would be {boundary}")
        self.engine.set_gradient_accumulation_boundary(boundary)
        return contextlib.nullcontext()

    def forward_context(self) -> ContextManager[object]:
        # fp16/bf16 make DeepSpeed hold half-precision weights; autocast casts the float inputs.
        return self.precision.autocast(self.device)

    def backward(self, loss: torch.Tensor) -> None:
        with tap_gradient_reductions(self.ledger):  # ZeRO reduces inside backward (hooks, epilogue)
            self.engine.backward(loss, scale_wrt_gas=False)

    def _plain_grad_norm(self) -> float:
        # ZeRO-0 in fp32 steps the torch optimizer directly and keeps no norm; its gradients are
        # whole and already reduced at the boundary, so their norm is the global one.
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0

    def clip_grad_norm(self, max_norm: float | None) -> float:
        assert (max_norm or 0.0) == self.engine.gradient_clipping(), "clipping comes from the generated config"
        before = self._plain_grad_norm() if self.stage == 0 else None
        self.engine.step()  # DeepSpeed: norm, clip, optimizer step, zero grads
        self._applied = self.engine.was_step_applied()
        norm = self.engine.get_global_grad_norm()
        if norm is None:
            if before is None:
                raise RuntimeError("DeepSpeed reported no gradient norm "
                                   "(zero_optimization.compute_grad_norm off in the user config?)")
            norm = before
        return float(norm)

    def step(self) -> bool:
        if self._applied is None:  # the loop always clips first; stay correct if it did not
            self.clip_grad_norm(self.engine.gradient_clipping() or None)
        applied, self._applied = self._applied, None
        return bool(applied)

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        # engine.module is the plain model: names without DeepSpeed's "module." prefix.
        import deepspeed

        for name, param in self.engine.module.named_parameters():
            # ZeRO-3 holds a 1/W partition; gather one parameter at a time (collective).
            with deepspeed.zero.GatheredParameters([param], enabled=self.stage == 3):
                yield name, param.detach().clone()

    def state_dict(self) -> dict[str, Any]:
        model = {name: t.cpu() for name, t in self.full_parameters()}
        # ZeRO optimizer state is partitioned: gather every rank's part (rank 0 saves them all).
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, self.engine.optimizer.state_dict())
        return {"model": model, "optimizer_parts": parts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import deepspeed
        from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
        from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

        for name, param in self.engine.module.named_parameters():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0, enabled=self.stage == 3):
                param.data.copy_(state["model"][name])
        parts = state["optimizer_parts"]
        optimizer = self.engine.optimizer
        if optimizer is self.optimizer or isinstance(optimizer, FP16_Optimizer | FP16_UnfusedOptimizer):
            optimizer.load_state_dict(parts[dist.get_rank()])  # ZeRO-0: whole state on every rank
        else:  # ZeRO 1-3 and bf16: every rank's part in, its own fp32 partition restored from them
            optimizer.load_state_dict(parts, load_optimizer_states=True, load_from_fp32_weights=True)

    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.destroy()  # removes ZeRO hooks and buffers
        self.engine = None
