"""The outer step: every H optimizer steps, merge the islands' work across the slow link, once per fragment.

Each island (:mod:`distaccum.outer.islands`) trains on its own between syncs: its optimizer steps are the usual
accumulation steps over its own ranks, and nothing crosses to another island. Every rank keeps the *global*
parameters theta_g (the last merged state, its own part of them: whole under DDP, its shards under FSDP2). When
fragment p syncs after step t (``OuterConfig.syncing``), island i, having trained on n_i loss items since p's last
sync, contributes

    local_sgd:  x_i = theta_i                      (its parameters)
    diloco:     x_i = theta_g - theta_i            (its pseudo-gradient: how far it moved, sign included)

and every island computes the same weighted mean over the R islands in ONE all-reduce (a sum) of w_i x_i:

    w_i = n_i / sum_j n_j   (outer.weighting=tokens; 1/R with equal, or when no island counted an item)
    xbar = sum_i w_i x_i

then local_sgd sets theta_g = xbar; diloco hands xbar to the outer optimizer as theta_g's gradient (SGD with
Nesterov momentum by default: theta_g -= lr (m + mu m'), a descent step along the averaged pseudo-gradient) and
steps it. Every island then continues from theta_g (its inner optimizer state is kept). The weights are exact:
the n_i travel first, in float64, in a small all-gather that also carries the stop and checkpoint votes (the
only place the islands agree on them: between syncs their window collectives stay inside each island). After
the update a second small all-gather compares theta_g's agreement row across the islands bit for bit
(:mod:`distaccum.guards.agreement`); a mismatch stops the run naming them. Under DDP each of an island's S ranks
all-reduces 1/S of the fragment across the islands and the island all-gathers the pieces, so the slow link carries
the fragment once per island, not S times.

Buffers (BatchNorm statistics) are not merged: each island keeps its own; the trained model carries island 0's.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distaccum.guards import agreement
from distaccum.outer.config import OuterConfig
from distaccum.outer.islands import Islands
from distaccum.runtime.procgroup import all_gather_into

OUTER_DIR = "outer"
"""The checkpoint's sub-directory of the outer state (one file per rank)."""
WIRE_DTYPES = {"fp32": None, "bf16": torch.bfloat16}


class OuterDivergenceError(RuntimeError):
    """After an outer sync the islands' global parameters differ: the merge was not the same everywhere."""


def local_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The parameters this rank holds, as plain tensors: whole (DDP) or its local shards (FSDP2's DTensors)."""
    out = []
    for name, param in module.named_parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        out.append((name, local.detach()))
    return out


def split_fragments(numels: list[int], fragments: int) -> list[list[int]]:
    """Consecutive parameters in ``fragments`` groups of about equal size (by the whole model's element counts, so
    every rank of every island cuts the same way). Every group holds at least one parameter."""
    if fragments > len(numels):
        raise ValueError(
            f"outer.fragments={fragments} is more than the model's {len(numels)} parameters: a fragment is a group "
            "of whole parameters"
        )
    total, groups, start = sum(numels), [], 0
    running = 0
    for p in range(fragments):
        target = total * (p + 1) / fragments
        end = start + 1  # at least one parameter
        running += numels[start]
        while end < len(numels) - (fragments - p - 1) and running + numels[end] / 2 <= target:
            running += numels[end]
            end += 1
        if p == fragments - 1:
            end = len(numels)
        groups.append(list(range(start, end)))
        start = end
    return groups


def agreement_row(tensors: list[torch.Tensor]) -> list[float]:
    """[sum, sum of squares, position-weighted sum] of ``tensors`` in float64: bitwise equal on every island after
    a merge that was the same everywhere."""
    flat = torch.cat([t.reshape(-1) for t in tensors]).to(torch.float64)
    weights = torch.linspace(1.0, 2.0, flat.numel(), dtype=torch.float64, device=flat.device)
    return [float(flat.sum()), float((flat * flat).sum()), float((flat * weights).sum())]


@dataclass
class SyncStats:
    """One step's outer communication (record fields)."""

    fragments: list[int]
    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def record(self) -> dict[str, Any]:
        """The step's ``metrics.jsonl`` fields."""
        return {
            "outer_synced": len(self.fragments),
            "comm_calls_outer": self.calls,
            "comm_bytes_outer": self.bytes,
            "comm_outer_s": self.seconds,
        }


class OuterSync:
    """The outer step of an outer-synced run (module docstring). Built after the engine wrapped the model; the
    loop calls :meth:`merge_if_due` after every optimizer step (collective across the islands at sync steps only)."""

    def __init__(
        self, cfg: OuterConfig, islands: Islands, module: nn.Module, sliced: bool, max_steps: int
    ) -> None:
        self.cfg, self.islands, self.max_steps = cfg, islands, max_steps
        self.layout = islands.layout
        self.sliced = sliced and self.layout.size > 1
        """Each rank holds the whole parameters (DDP): reduce 1/size of each fragment per rank, then all-gather."""
        named = local_tensors(module)
        self.names = [n for n, _ in named]
        self.local = [t for _, t in named]
        whole = [int(p.numel()) for p in module.parameters()]
        self.fragments = split_fragments(whole, cfg.fragments)
        self.global_params = [t.clone() for t in self.local]
        """theta_g: the last merged parameters (this rank's part of them)."""
        self.optimizers: list[torch.optim.Optimizer] = (
            [
                torch.optim.SGD(
                    [self.global_params[i] for i in frag],
                    lr=cfg.lr,
                    momentum=cfg.momentum,
                    nesterov=cfg.nesterov,
                )
                for frag in self.fragments
            ]
            if cfg.method == "diloco"
            else []
        )
        self.model_bytes = sum(int(p.numel()) * p.element_size() for p in module.parameters())
        """The whole model's parameters in bytes (what a synchronous step's gradient all-reduce carries)."""
        self.items = [0.0] * len(self.fragments)
        """This island's loss items since each fragment's last sync (its merge weight)."""
        self.last = SyncStats([])
        self.control_device = (
            torch.device("cpu")
            if not self.local or dist.get_backend(islands.outer_group) == "gloo"
            else self.local[0].device
        )
        """Where the small all-gathers' float64 numbers live: the CPU on gloo, the parameters' device on NCCL."""

    # --- the step -------------------------------------------------------------------------------------------

    def merge_if_due(self, step: int, items: float, stop: bool, checkpoint: bool) -> tuple[bool, bool]:
        """Count the step's items; at a sync step merge the fragments due and return the votes every island agreed
        on (stop, checkpoint). Between syncs: (False, False) and nothing crosses to another island."""
        for p in range(len(self.items)):
            self.items[p] += items
        due = self.cfg.syncing(step, self.max_steps)
        self.last = SyncStats(due)
        if not due:
            return False, False
        started = time.perf_counter()
        rows = self._gather([*(self.items[p] for p in due), float(stop), float(checkpoint)])
        for j, p in enumerate(due):
            self._merge(p, self.weight([row[j] for row in rows]))
            self.items[p] = 0.0
        self._check(step, due)
        self.last.seconds = time.perf_counter() - started
        return any(row[-2] for row in rows), any(row[-1] for row in rows)

    def fields(self) -> dict[str, Any]:
        """The last step's record fields (:class:`SyncStats`)."""
        return self.last.record()

    def weight(self, counts: list[float]) -> float:
        """This island's merge weight from every island's item count (module docstring)."""
        total = math.fsum(counts)
        if self.cfg.weighting == "equal" or total <= 0:
            return 1.0 / len(counts)
        return counts[self.layout.index] / total

    def contribution(self, p: int) -> list[torch.Tensor]:
        """What this island sends for fragment ``p`` (before its weight): parameters or pseudo-gradient."""
        idx = self.fragments[p]
        if self.cfg.method == "local_sgd":
            return [self.local[i] for i in idx]
        return [self.global_params[i] - self.local[i] for i in idx]

    def _merge(self, p: int, weight: float) -> None:
        idx = self.fragments[p]
        with torch.no_grad():
            parts = self.contribution(p)
            flat = torch.cat([t.reshape(-1) for t in parts]) * weight
            merged = self.reduce(flat).to(flat.dtype)
            pieces = merged.split([t.numel() for t in parts])
            if self.cfg.method == "local_sgd":
                for i, piece in zip(idx, pieces, strict=True):
                    self.global_params[i].copy_(piece.view_as(self.global_params[i]))
            else:
                for i, piece in zip(idx, pieces, strict=True):
                    self.global_params[i].grad = piece.view_as(self.global_params[i]).clone()
                self.optimizers[p].step()
                self.optimizers[p].zero_grad(set_to_none=True)
            for i in idx:
                self.local[i].copy_(self.global_params[i])

    def reduce(self, flat: torch.Tensor) -> torch.Tensor:
        """The sum over the islands of ``flat`` (this island's weighted contribution), in ``outer.reduce_dtype`` on
        the wire: one all-reduce across the islands (its 1/S slice per rank under DDP, then an all-gather inside
        the island)."""
        wire = WIRE_DTYPES[self.cfg.reduce_dtype]
        send = flat.to(wire) if wire is not None else flat.clone()
        if not self.sliced:
            self._all_reduce(send)
            return send
        size, rank = self.layout.size, self.layout.inner_rank
        chunk = -(-send.numel() // size)
        padded = torch.zeros(chunk * size, dtype=send.dtype, device=send.device)
        padded[: send.numel()] = send
        mine = padded[rank * chunk : (rank + 1) * chunk].clone()
        self._all_reduce(mine)
        all_gather_into(padded, mine, group=self.islands.inner_group)
        return padded[: send.numel()]

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        """The one cross-island collective of a fragment's sync (counted; none with one island: the sum of one)."""
        if self.layout.islands == 1:
            return
        dist.all_reduce(tensor, group=self.islands.outer_group)
        self.last.calls += 1
        self.last.bytes += tensor.numel() * tensor.element_size()

    def _gather(self, values: list[float]) -> list[list[float]]:
        """Every island's ``values`` (one small all-gather across the islands), island by island."""
        return agreement.gather(values, group=self.islands.outer_group, device=self.control_device).tolist()

    def _check(self, step: int, due: list[int]) -> None:
        """Compare the merged global parameters' agreement rows across the islands, bit for bit; raise naming those that
        differ."""

        def divergence(rows: list[list[float]], bad: list[int]) -> OuterDivergenceError:
            return OuterDivergenceError(
                f"after the outer sync of step {step} (fragments {due}) the global parameters differ between "
                f"islands: island(s) {', '.join(map(str, bad))} disagree with island 0 (agreement rows "
                f"{rows[bad[0]]} vs {rows[0]}, inner rank {self.layout.inner_rank}). The islands did not merge the "
                "same numbers: a rank-dependent outer step, or a corrupted exchange. Stopped before training on."
            )

        mine = [x for p in due for x in agreement_row([self.global_params[i] for i in self.fragments[p]])]
        agreement.require(mine, divergence, group=self.islands.outer_group, device=self.control_device)

    def summary(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """``summary.json``'s ``outer`` section from this rank's records: what crossed between the islands against
        a synchronous run of the same steps (a gradient all-reduce of the whole model across the islands every
        step), per island: every rank of an island sends its slice (DDP) or shard (FSDP2), so the island sends its
        ranks' bytes times their number."""
        island_bytes = sum(int(r.get("comm_bytes_outer", 0)) for r in records) * self.layout.size
        items = sum(float(r.get("items", 0)) for r in records)
        synchronous = len(records) * self.model_bytes
        return {
            "method": self.cfg.method,
            "islands": self.layout.islands,
            "every": self.cfg.every,
            "fragments": self.cfg.fragments,
            "syncs": sum(int(r.get("outer_synced", 0)) for r in records),
            "bytes_across_per_island": island_bytes,
            "bytes_across_per_item": island_bytes / items if items else math.nan,
            "synchronous_bytes_per_island": synchronous,
            "reduction_factor": synchronous / island_bytes if island_bytes else math.inf,
        }

    # --- around the step ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def global_view(self) -> Iterator[None]:
        """The model holds theta_g inside (evaluation), its own parameters again after."""
        with torch.no_grad():
            saved = [t.clone() for t in self.local]
            for local, glob in zip(self.local, self.global_params, strict=True):
                local.copy_(glob)
        try:
            yield
        finally:
            with torch.no_grad():
                for local, kept in zip(self.local, saved, strict=True):
                    local.copy_(kept)

    def state_dict(self) -> dict[str, Any]:
        """theta_g, the outer optimizers' state and this island's item counts (this rank's, for its own file)."""
        return {
            "global": [t.detach().cpu() for t in self.global_params],
            "optimizers": [opt.state_dict() for opt in self.optimizers],
            "items": torch.tensor(self.items, dtype=torch.float64),
            "layout": torch.tensor([self.layout.islands, self.layout.size], dtype=torch.int64),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the same world and islands)."""
        saved = [int(x) for x in state["layout"].tolist()]
        if saved != [self.layout.islands, self.layout.size]:
            raise ValueError(
                f"the checkpoint was written by {saved[0]} islands of {saved[1]} ranks; this run has "
                f"{self.layout.islands} of {self.layout.size}"
            )
        with torch.no_grad():
            for glob, value in zip(self.global_params, state["global"], strict=True):
                glob.copy_(value.to(glob.device))
        for opt, opt_state in zip(self.optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(opt_state)
        self.items = [float(x) for x in state["items"].tolist()]

    def save(self, directory: Path, rank: int) -> None:
        """Write this rank's outer state into ``directory`` (every rank its own file)."""
        directory.mkdir(parents=True, exist_ok=True)
        torch.save(self.state_dict(), directory / f"rank-{rank:05d}.pt")

    def load(self, directory: Path, rank: int) -> None:
        """Read what :meth:`save` wrote for ``rank``."""
        self.load_state_dict(
            torch.load(directory / f"rank-{rank:05d}.pt", map_location="cpu", weights_only=True)
        )
