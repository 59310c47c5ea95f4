"""The process group: pick the device, join (or reuse) the group, leave it cleanly.

A run started by distaccum's launcher, by ``torchrun`` or by ``srun`` joins from the environment
(:class:`~distaccum.runtime.topology.DistEnv`); a user script may have created the group already, in which
case distaccum uses it and leaves it alone; a plain ``python script.py`` gets a one-rank group.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distaccum.runtime.contracts import DistEnv, recognize


def pick_device(device: str, env: DistEnv) -> torch.device:
    """cuda:<local_rank> when CUDA is asked for (or ``auto`` and present), else cpu."""
    want_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if want_cuda:
        if not torch.cuda.is_available():
            raise ValueError("trainer.device=cuda but CUDA is not available")
        return torch.device("cuda", env.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def planned_device(device: str) -> torch.device:
    """The device type the workers will pick for ``trainer.device`` (checked before any worker starts)."""
    return torch.device(
        "cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu"
    )


def init_process_group(env: DistEnv, device: torch.device, timeout: timedelta | None = None) -> None:
    """NCCL on GPUs, gloo on CPU. torchrun provides env://; srun tasks rendezvous over tcp://; a
    single process gets a one-rank group on an in-memory store. ``timeout`` bounds every collective
    (``trainer.collective_timeout_s``): a rank that stops responding fails the run instead of hanging it."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if env.source == "torchrun":
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    elif env.source == "slurm":
        dist.init_process_group(
            backend,
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
        )
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def collective_device() -> torch.device:
    """Where the default group's collectives take their tensors: the current GPU on NCCL (which moves
    device tensors only), the CPU otherwise (gloo). Host-side flags and counts go through here."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


all_gather_into = (
    getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
)  # the name before torch 2.13
"""``all_gather_into(out, local, *, group=None, async_op=False)``: every rank's ``local`` into ``out`` (group size x
``local.numel()``, in rank order), one all-gather. The one spelling of the flat all-gather: the window's totals
(:mod:`distaccum.window`, asynchronous), the outer sync's slices (:mod:`distaccum.outer.sync`) and every small row of
host numbers (:func:`gather_rows`) go through it."""


def gather_rows(
    local: torch.Tensor | Sequence[float], *, group: Any = None, device: torch.device | None = None
) -> torch.Tensor:
    """Every rank's ``local`` (a few numbers) as a (ranks, n) float64 tensor on the host, rank r's in row r. One
    all-gather (:data:`all_gather_into`) over ``group`` (None: the world; an outer-synced run's island or its outer
    group), collective: every rank of the group calls it with as many numbers. ``device``: where the collective takes
    its tensors (None: the default group's, :func:`collective_device`). The ranks' agreement rows
    (:mod:`distaccum.guards.agreement`), the tripwire's parameter digests and the timer's per-rank times use it."""
    device = device if device is not None else collective_device()
    row = torch.as_tensor(local, dtype=torch.float64).to(device).reshape(-1).contiguous()
    ranks = dist.get_world_size(group)
    out = torch.empty(ranks * row.numel(), dtype=torch.float64, device=device)
    all_gather_into(out, row, group=group)
    return out.view(ranks, row.numel()).cpu()


def ensure_process_group(env: DistEnv, device: torch.device, timeout: timedelta | None = None) -> bool:
    """Join the process group unless one exists; returns True when this call created it."""
    if dist.is_initialized():
        return False
    init_process_group(env, device, timeout)
    return True


def shutdown(*, clean: bool = True) -> None:
    """Leave the process group. ``clean``: barrier first, so no rank tears gloo down while a peer
    still sends (FSDP runs aborted at exit now and then without it); after a failure on some rank
    the barrier could wait forever, so a failing rank destroys the group without one."""
    if not dist.is_initialized():
        return
    if clean:
        dist.barrier()
    destroy_world()


def destroy_world() -> None:
    """Destroy the default group and every group made from it. Once a DeepSpeed engine ran in this process, through
    ``deepspeed.comm``, whose teardown also drops the groups DeepSpeed keeps (its clone of the world): destroyed
    behind its back they outlive the group, and the next world's first DeepSpeed engine in this process fails
    ("Group ... is not registered")."""
    deepspeed_comm = sys.modules.get("deepspeed.comm")
    if deepspeed_comm is not None and deepspeed_comm.is_initialized():
        deepspeed_comm.destroy_process_group()
    else:
        dist.destroy_process_group()


@dataclass(frozen=True)
class Joined:
    """This process's place in the job after :func:`join`."""

    env: DistEnv
    device: torch.device
    created: bool
    """True when :func:`join` created the process group (so its caller leaves it)."""


def join(device: str, timeout_s: float) -> Joined:
    """Pick this rank's device from ``trainer.device`` and the launch environment (torchrun, srun or a
    plain process: this process's ``os.environ``) and join the process group unless one exists."""
    env = recognize(os.environ, group_initialized=dist.is_initialized()).env  # a half-set contract fails here
    picked = pick_device(device, env)
    created = ensure_process_group(env, picked, timedelta(seconds=timeout_s))
    return Joined(env, picked, created)


def gather_placement(groups: list[list[int]], node: int) -> dict[str, list]:
    """Every rank's node (``node`` here, all-gathered once: collective) beside the engine's replica groups
    (:meth:`~distaccum.engines.base.EngineBase.layout`): what ``summary.json``'s ``placement`` records."""
    nodes = [int(row[0]) for row in gather_rows([node]).tolist()]
    return {"groups": groups, "nodes": nodes}
