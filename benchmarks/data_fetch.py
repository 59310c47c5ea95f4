"""What the input pipeline costs per micro-batch on the host: ``python -m benchmarks.data_fetch``.

One process, one thread, no training: the time distaccum takes to hand out a micro-batch of an in-memory
``TensorDataset`` (the global-batch plan's walk): through the DataLoader sample by sample with ``default_collate``
(what any map-style dataset gets), through the DataLoader with :class:`~distaccum.data.pipeline.TensorBatches` (one
``index_select`` per tensor: a plain ``TensorDataset`` with DataLoader workers), and cut in the process by
:class:`~distaccum.data.pipeline.TensorRows` (a plain ``TensorDataset`` without workers, the default), shuffled and
in order; and the time the plan takes to cut
a window out of a large shuffled dataset when it keeps the epoch's order against drawing it anew (what it did
before: twice per optimizer step). Medians over ``--repeats`` passes.

    python -m benchmarks.data_fetch [--samples 8192] [--features 768] [--micro 256] [--plan-samples 1000000]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch.utils.data import TensorDataset

from distaccum.config import Split
from distaccum.data.global_batch import GlobalBatchPlan
from distaccum.data.pipeline import build_loader, micro_batches


class SampleBySample(TensorDataset):
    """A ``TensorDataset`` the pipeline does not recognize as plain: what any map-style dataset gets (the
    DataLoader, one ``__getitem__`` per sample, ``default_collate``)."""


def fetch_ms(dataset: Any, plan: GlobalBatchPlan, split: Split, steps: int, repeats: int, *, loader: bool) -> float:
    """Median milliseconds per micro-batch of one rank over ``steps`` windows: through :func:`build_loader`'s
    DataLoader, or what the Trainer takes (:func:`micro_batches`: :class:`TensorRows` for a plain
    ``TensorDataset``)."""
    times = []
    for _ in range(repeats):
        plan.next_step = 0
        batches = (build_loader(dataset, None, plan, split, 0, steps) if loader
                   else micro_batches(dataset, None, plan, split, 0, steps, device=torch.device("cpu")))
        start = time.perf_counter()
        count = sum(1 for _ in batches)
        times.append((time.perf_counter() - start) / count * 1e3)
    return statistics.median(times)


def window_ms(samples: int, global_batch: int, keep: bool, repeats: int) -> float:
    """Median milliseconds for ``plan.window(step)`` of a shuffled plan: one plan kept across calls (its epoch
    order kept) or a fresh plan per call (the order drawn anew, as every call did before)."""
    kept = GlobalBatchPlan(samples, global_batch, seed=0)
    kept.window(0)
    times = []
    for step in range(1, repeats + 1):
        plan = kept if keep else GlobalBatchPlan(samples, global_batch, seed=0)
        start = time.perf_counter()
        plan.window(step)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--features", type=int, default=768)
    parser.add_argument("--micro", type=int, default=256)
    parser.add_argument("--plan-samples", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(args.samples, args.features, generator=gen),
                            torch.randn(args.samples, 16, generator=gen))
    split = Split(args.micro, 4, 1)
    plan = GlobalBatchPlan(args.samples, split.global_batch, seed=0)
    in_order = GlobalBatchPlan(args.samples, split.global_batch, seed=0, shuffle=False)
    steps = max(1, args.samples // split.global_batch)
    samples = SampleBySample(*dataset.tensors)
    print(f"micro-batch of {args.micro} samples ({args.features} + 16 features), ms per micro-batch:")
    print(f"  DataLoader, sample by sample + default_collate (shuffled)  "
          f"{fetch_ms(samples, plan, split, steps, args.repeats, loader=True):8.3f}")
    print(f"  DataLoader, TensorBatches (shuffled: index_select)         "
          f"{fetch_ms(dataset, plan, split, steps, args.repeats, loader=True):8.3f}")
    print(f"  in the process, TensorRows (shuffled: index_select)        "
          f"{fetch_ms(dataset, plan, split, steps, args.repeats, loader=False):8.3f}")
    print(f"  in the process, TensorRows (in order: views)               "
          f"{fetch_ms(dataset, in_order, split, steps, args.repeats, loader=False):8.3f}")
    print(f"plan.window of a shuffled {args.plan_samples}-sample dataset, ms per call:")
    print(f"  order drawn anew (before)            {window_ms(args.plan_samples, 512, False, args.repeats):8.3f}")
    print(f"  epoch order kept                     {window_ms(args.plan_samples, 512, True, args.repeats):8.3f}")


if __name__ == "__main__":
    main()
