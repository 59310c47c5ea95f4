"""The reduction checksum's margin, simulated: K x W x dtype, a correct reduction's worst element against the bound
(at most 1 by construction) and the smallest fault's (a doubled, halved or skipped reduction: above 1 is caught).

Each of W simulated ranks draws K micro-batch gradients of n elements in the dtype: independent noise, no common
mean (the ranks' gradients do not agree beyond chance, the hardest case for the check), magnitudes spread over
2^-4 .. 2^4. Each rank accumulates them as an engine does (``acc += g`` in the dtype), and the reduction sums the
ranks' accumulated values in the dtype in a random order, rounding every addition. The checksum's own functions
(:func:`~distaccum.guards.checksum.local_parts`, :func:`~distaccum.guards.checksum.verdict`) then judge the
reduced values, as the engines' step does after its all-reduce.

    python -m benchmarks.checksum_margin            # the table pasted in docs/verification.md
    python -m benchmarks.checksum_margin --ops      # the checksum's host operators per micro-batch and per step
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile

import torch
import torch.distributed as dist

from distaccum.guards.checksum import ReductionChecksum, Rounding, local_parts, verdict

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FAULTS = ("double", "halve", "skip")


def simulate(k: int, w: int, dtype: torch.dtype, fault: str | None, seed: int = 0, n: int = 4096) -> float:
    """The worst sampled element's share of its bound (v of :func:`verdict`) for one simulated step."""
    gen = torch.Generator().manual_seed(seed)
    scale = 2.0 ** (torch.rand(n, generator=gen) * 8 - 4)
    rounding = Rounding(world=w, accum_steps=k, reduce=dtype, held=dtype, accumulate=dtype)
    parts = torch.zeros(2, n, dtype=torch.float64)
    local = []
    for _ in range(w):
        rows = (torch.randn(k, n, generator=gen) * scale).to(dtype)
        parts += local_parts(rows, rounding)  # the all-reduce of the sample
        acc = rows[0].clone()
        for row in rows[1:]:
            acc += row  # the engine's accumulation
        local.append(acc)
    order = torch.randperm(w, generator=gen).tolist()
    reduced = local[order[0]].clone()
    for r in order[1:]:
        reduced += local[r]  # the collective's additions, one rounding each
    held = reduced.to(torch.float64)
    if fault == "double":
        held = (reduced * 2).to(torch.float64)
    elif fault == "halve":
        held = (reduced / 2).to(torch.float64)
    elif fault == "skip":  # each element keeps its owner's own piece (owners: element i on rank i mod W)
        held = torch.stack(local).to(torch.float64)[torch.arange(n) % w, torch.arange(n)]
    return float(verdict(parts, held, rounding)[1])


def sweep(
    ks: tuple[int, ...] = (1, 16, 64),
    worlds: tuple[int, ...] = (2, 8, 64),
    dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16"),
    seeds: int = 2,
    n: int = 4096,
) -> list[dict[str, float | int | str]]:
    """One row per (dtype, K, W): the correct run's worst share of the bound and the smallest fault's."""
    rows: list[dict[str, float | int | str]] = []
    for name in dtypes:
        for k in ks:
            for w in worlds:
                correct = max(simulate(k, w, DTYPES[name], None, s, n) for s in range(seeds))
                fault = min(simulate(k, w, DTYPES[name], f, s, n) for f in FAULTS for s in range(seeds))
                coefficient = Rounding(
                    world=w, accum_steps=k, reduce=DTYPES[name], held=DTYPES[name], accumulate=DTYPES[name]
                ).coefficient()
                rows.append(
                    {"dtype": name, "K": k, "W": w, "c": coefficient, "correct": correct, "fault": fault}
                )
    return rows


def table(rows: list[dict[str, float | int | str]]) -> str:
    """Markdown: the bound's coefficient, the correct worst, the smallest fault (both as shares of the bound)."""
    lines = [
        "| dtype | K | W | c (bound / sum \\|x\\|) | correct: worst share | smallest fault: share | caught |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        caught = "yes" if float(r["fault"]) > 1.0 >= float(r["correct"]) else "NO"
        lines.append(
            f"| {r['dtype']} | {r['K']} | {r['W']} | {float(r['c']):.3g} | {float(r['correct']):.3g} | "
            f"{float(r['fault']):.3g} | {caught} |"
        )
    return "\n".join(lines)


def count_ops(k: int = 16, n_params: int = 6) -> tuple[int, int]:
    """(operators per micro-batch, operators per step) the checksum issues on the host: a one-rank gloo group, a
    3-layer-MLP-like list of parameters, the hooks of ``k`` micro-batches and one :meth:`ReductionChecksum.take`,
    counted with ``torch.profiler`` (top-level ``aten::`` operators, the backward's own excluded)."""
    from torch.profiler import profile

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    store = tempfile.NamedTemporaryFile(delete=False)
    dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1)
    try:
        shapes = [(32, 32), (32,)] * (n_params // 2)
        params = [torch.zeros(s, requires_grad=True) for s in shapes]
        check = ReductionChecksum(
            [p.numel() for p in params],
            [(0, p.numel()) for p in params],
            k,
            torch.device("cpu"),
            torch.float32,
        )
        check.rounding = Rounding(
            world=1, accum_steps=k, reduce=torch.float32, held=torch.float32, accumulate=torch.float32
        )
        grads = [torch.ones(s) for s in shapes]

        def counted(fn: object) -> int:
            with profile() as prof:
                fn()  # type: ignore[operator]
            events = [e for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]
            return sum(collections.Counter(e.name for e in events).values())

        def micro() -> None:
            for j, grad in enumerate(grads):
                check._hook(j)(grad)  # what the hooks do as autograd delivers each parameter's gradient

        per_micro = counted(micro)
        per_step = counted(lambda: check.take([p.reshape(-1) for p in grads]))
        return per_micro, per_step
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", action="store_true", help="count the checksum's host operators instead")
    args = parser.parse_args()
    if args.ops:
        micro, step = count_ops()
        print(
            f"reduction checksum: +{micro} host operators per micro-batch (one take per parameter: 6 parameters), "
            f"+{step} per step (K = 16)"
        )
        return
    print(table(sweep()))


if __name__ == "__main__":
    main()
