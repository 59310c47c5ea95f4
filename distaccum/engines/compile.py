"""torch.compile under accumulation, shared by the engines (``trainer.compile=true``).

What each engine compiles (chosen so that sync control stays eager and outside the graphs):

- DDP and Accelerate: the DDP module as a whole (``torch.compile(ddp)``). Dynamo's DDP optimizer splits
  the graph at the gradient buckets, so each bucket's all-reduce still overlaps the backward of the
  layers before it (pytorch #108966); ``no_sync`` is read outside the graph, so toggling it between
  micro-batches recompiles nothing. Compiling the inner module instead would not compile at all:
  dynamo skips frames inside DDP's forward.
- FSDP2: every block, in place (``module.compile()``), before ``fully_shard`` — torchtitan's recipe:
  FSDP's unshard/reshard hooks run between the compiled blocks, and names (checkpoints, the final
  weights) do not change.
- DeepSpeed: its own ``engine.compile()``.

Shapes: DDP, Accelerate and DeepSpeed compile with dynamic shapes from the first compile
(``dynamic=True``): variable sequence lengths and the smaller micro-batches of a partial last window reuse
the first window's graphs (0 recompiles after step 1, tests/test_compile.py). FSDP2's per-block compile
uses dynamo's automatic dynamic shapes instead (``dynamic=None``: a dimension becomes dynamic the first
time it changes), with the blocks' first input dimension (the micro-batch) marked dynamic from the start:
with ``dynamic=True`` the blocks' compiled backward failed on CPU with torch 2.13 as soon as the sequence
length varied (``AssertionError: expected size 4==4, stride 400==512``: the backward assumed the first
shape's strides). The price is one recompile in the first window, when the sequence length first changes;
partial windows recompile nothing. torch specialises a dimension of size 1 on every engine (a
micro-batch of one sample compiles once more). The run reports every recompile after its first step
(:mod:`distaccum.telemetry.compilation`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def compile_options(mode: str, dynamic: bool | None = True) -> dict[str, Any]:
    """``torch.compile`` keyword arguments for ``trainer.compile_mode`` (and dynamic shapes, see above)."""
    return {"mode": None if mode == "default" else mode, "dynamic": dynamic}


def compiled(module: nn.Module, mode: str) -> nn.Module:
    """``torch.compile(module)`` (a new module whose forward is compiled; the original keeps its names)."""
    return torch.compile(module, **compile_options(mode))  # type: ignore[return-value]


def _batch_dim_dynamic(module: nn.Module, args: tuple[Any, ...]) -> None:
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() > 0:
            torch._dynamo.maybe_mark_dynamic(a, 0)


def compile_in_place(module: nn.Module, mode: str) -> None:
    """Compile ``module``'s forward in place (its parameters, names and hooks stay where they are), with
    automatic dynamic shapes and the inputs' first (micro-batch) dimension dynamic from the start (FSDP2's
    blocks: see the module docstring)."""
    module.forward = torch.compile(module.forward, **compile_options(mode, dynamic=None))
    module.register_forward_pre_hook(_batch_dim_dynamic)  # eager, before the compiled forward
