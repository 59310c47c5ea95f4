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
    python -m benchmarks.checksum_margin --ops-publish   # on the host-ops harness, FSDP2 and ZeRO-2: STORE, the docs
    python -m benchmarks.checksum_margin --ops-render    # docs/verification.md's bench:checksum_host_ops from STORE

``--ops-publish`` counts, with :mod:`benchmarks.host_ops` (2 gloo ranks, K = 1 and 16, ``--checksum ENGINE``), the
Trainer's own operators on each sharded engine with ``trainer.fingerprint`` on against off, keeps them as
:data:`STORE` and renders them beside the DDP count stored by ``python -m benchmarks.report`` (docs/results/host-ops.json:
distaccum's own work beyond the expert loop, the replicated engines' fingerprint included).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import host_ops
from benchmarks.launch import ROOT, provenance
from benchmarks.report import replace_section
from distaccum.guards.checksum import ReductionChecksum, Rounding, local_parts, verdict

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FAULTS = ("double", "halve", "skip")
STORE = ROOT / "docs" / "results" / "checksum-ops.json"
"""The checksum's operators on the host-ops harness, per sharded engine (``--ops-publish``)."""
DDP_STORE = ROOT / "docs" / "results" / "host-ops.json"
DOC = ROOT / "docs" / "verification.md"
OPS_COMMAND = "python -m benchmarks.checksum_margin --ops-publish"
OPS_KS = (1, 16)
ENGINES = {"fsdp": "FSDP2", "zero2": "DeepSpeed ZeRO-2"}
""":data:`benchmarks.host_ops.CHECKSUM_ENGINES` entries counted, and their names in the table."""


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


def measure_engines(workdir: Path) -> dict[str, Any]:
    """The host-ops harness's counts, checksum off ("expert") and on ("distaccum"), per engine and K."""
    counts = {name: {str(k): host_ops.measure(k, workdir, checksum=name) for k in OPS_KS} for name in ENGINES}
    return {"provenance": provenance(OPS_COMMAND, device="cpu", world_size=2), "ks": list(OPS_KS), **counts}


def render_ops(stored: dict[str, Any], ddp: dict[str, Any]) -> str:
    """The table: the checksum's own operators per micro-batch and per step on each sharded engine (on against off),
    beside DDP's (distaccum beyond the expert loop)."""
    rows = [
        "| engine | what is counted | operators per micro-batch | per step |",
        "|---|---|---|---|",
    ]
    ddp_micro, ddp_step = host_ops.extra({int(k): v for k, v in ddp["host_ops"].items()})
    rows.append(
        f"| DDP | distaccum beyond the expert `no_sync` loop (the sampled-gradient fingerprint included) | "
        f"{ddp_micro:+.0f} | {ddp_step:+.0f} |"
    )
    for name, title in ENGINES.items():
        micro, step = host_ops.extra({int(k): v for k, v in stored[name].items()})
        rows.append(
            f"| {title} | the same run with `trainer.fingerprint` on against off (the reduction checksum) | "
            f"{micro:+.0f} | {step:+.0f} |"
        )
    return "\n".join(rows) + (
        "\n\nCounted outside the backward, as the harness counts DDP: the hooks' one take per parameter and "
        "micro-batch runs inside autograd's backward (`python -m benchmarks.checksum_margin --ops` counts those); "
        "what grows with K here is the step's accumulation of the K sampled rows."
    )


def publish_ops(stored: dict[str, Any]) -> None:
    STORE.parent.mkdir(parents=True, exist_ok=True)
    STORE.write_text(json.dumps(stored, indent=1) + "\n")
    body = render_ops(stored, json.loads(DDP_STORE.read_text()))
    DOC.write_text(replace_section(DOC.read_text(), "checksum_host_ops", body, by=OPS_COMMAND))
    print(body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", action="store_true", help="count the checksum's host operators instead")
    parser.add_argument(
        "--ops-publish",
        action="store_true",
        help="count it on the host-ops harness (FSDP2, ZeRO-2), store it",
    )
    parser.add_argument("--ops-render", action="store_true", help="render the stored count into the docs")
    args = parser.parse_args()
    if args.ops_publish:
        with tempfile.TemporaryDirectory() as tmp:
            publish_ops(measure_engines(Path(tmp)))
        return
    if args.ops_render:
        publish_ops(json.loads(STORE.read_text()))
        return
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
