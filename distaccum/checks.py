"""Cross-rank consistency tripwire: after a boundary step every rank must hold the same parameters.

A misplaced ``no_sync`` (or a rank that skipped the reduction) leaves ranks training different
models while losses still look plausible. Each rank computes a fp64 (sum, sum of squares) per
parameter — 2 numbers per tensor — and one all-gather compares them with rank 0's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distaccum.backend import Backend


class RankDivergenceError(RuntimeError):
    """Ranks hold different parameters after an optimizer step."""


def parameter_checksums(backend: Backend) -> tuple[list[str], torch.Tensor]:
    """Names and a [P, 2] fp64 tensor of (sum, sum of squares) per full parameter."""
    names, rows = [], []
    for name, tensor in backend.full_parameters():
        t = tensor.detach().to(torch.float64)
        names.append(name)
        rows.append(torch.stack([t.sum(), (t * t).sum()]).cpu())
    return names, torch.stack(rows)


def check_consistency(backend: Backend, step: int) -> None:
    """Raise :class:`RankDivergenceError` naming the step and parameter if ranks disagree."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    names, local = parameter_checksums(backend)
    if dist.get_backend() == "nccl":  # NCCL only moves device tensors
        local = local.to(torch.device("cuda", torch.cuda.current_device()))
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    reference = gathered[0]
    for rank, other in enumerate(gathered[1:], start=1):
        # Reduced gradients are bitwise identical on every rank, so parameters must be too.
        bad = (other != reference).any(dim=1).nonzero().flatten()
        if len(bad):
            i = int(bad[0])
            raise RankDivergenceError(
                f"ranks diverged after optimizer step {step}: parameter {names[i]!r} has checksum "
                f"{other[i].tolist()} on rank {rank} but {reference[i].tolist()} on rank 0 "
                f"({len(bad)} of {len(names)} parameters differ). Gradients were not reduced "
                "identically on every rank (misplaced no_sync, a skipped reduction, or rank-dependent code)."
            )
