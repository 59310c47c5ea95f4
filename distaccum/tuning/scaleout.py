"""``distaccum plan --nodes N ...``: step time and communication share of every engine and sync mode on
a cluster larger than this machine. A **prediction**, never a measurement: the compute of one
micro-batch (measured here by :mod:`distaccum.tuning.planner`, or given by the user for a GPU this
machine does not have) plus the α–β model of each collective (:mod:`distaccum.tuning.collectives`).

Per optimizer step of K micro-batches, each mode's collectives fall in three places:

    forward     parameter all-gathers (FSDP2, HSDP, ZeRO-3), hidden behind the forward compute
    backward    parameter re-gathers and the gradient reductions, hidden behind the backward compute
    after step  ZeRO-1/2's all-gather of the updated parameter shards: exposed

A stretch of P seconds of compute, cut into L units (FSDP units, buckets), hides collectives of C
seconds except ``max(C/L, C - P + P/L)``: the units pipeline (unit i's collective runs while unit
i+1 computes), the first gather or the last reduction cannot overlap anything, and the link is one
stream (collectives on the intra-node and the inter-node link are summed, not overlapped). Then

    step(mode)  = K (compute + data) + exposed + optimizer step / shard size
    comm share  = exposed / (K compute + exposed)        (as summary.json's comm_share)

Everything not named here is not modelled: kernels slowed by concurrent communication, stragglers,
congestion, NCCL's choice of algorithm and protocol, in-network reduction, the cost of the bf16 casts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from distaccum.split import nearest_valid_global_batches, valid_splits
from distaccum.tuning.collectives import Estimate, Group, Topology, collective, hsdp_groups, world_group
from distaccum.units import human_bytes

PHASES = ("forward", "backward", "after_step")


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What one rank does per optimizer step, independent of the engine."""

    params: int
    """Parameters of the model."""
    compute_s: float
    """Forward and backward of one micro-batch on one GPU, seconds."""
    compute_basis: str
    """Where ``compute_s`` comes from: measured on this machine (and how), or given by the user."""
    accum_steps: int
    """K: micro-batches per optimizer step."""
    data_s: float = 0.0
    """Fetching one micro-batch, seconds (not overlapped)."""
    optim_s: float = 0.0
    """The optimizer step over all parameters; a sharded engine steps 1/shard of them."""
    grad_bytes: float = 4.0
    """Bytes per parameter of a gradient reduction (4: fp32)."""
    param_bytes: float = 4.0
    """Bytes per parameter of a parameter all-gather (2: bf16 mixed precision)."""
    compressed_bytes: float = 2.0
    """Bytes per parameter of a compressed reduction (``accum.reduce_dtype=bf16``)."""
    backward_fraction: float = 2 / 3
    """Share of ``compute_s`` in the backward (2/3: backward costs twice the forward's FLOPs)."""
    units: int = 32
    """Units a step's collectives are cut into (FSDP units, DDP/DeepSpeed buckets)."""

    def __post_init__(self) -> None:
        if self.params < 1 or self.accum_steps < 1 or self.units < 1:
            raise ValueError(
                f"params, accum_steps and units must be >= 1, got params={self.params}, "
                f"accum_steps={self.accum_steps}, units={self.units}"
            )
        if min(self.compute_s, self.data_s, self.optim_s) < 0 or not 0 <= self.backward_fraction <= 1:
            raise ValueError(
                f"times must be >= 0 and backward_fraction in [0, 1], got compute_s={self.compute_s}, "
                f"data_s={self.data_s}, optim_s={self.optim_s}, backward_fraction={self.backward_fraction}"
            )
        if min(self.grad_bytes, self.param_bytes, self.compressed_bytes) <= 0:
            raise ValueError(
                f"bytes per parameter must be > 0, got grad_bytes={self.grad_bytes}, "
                f"param_bytes={self.param_bytes}, compressed_bytes={self.compressed_bytes}"
            )


@dataclass(frozen=True)
class Comm:
    """One collective of a mode."""

    phase: str
    """forward, backward or after_step."""
    every_micro: bool
    """True: on every micro-batch (K per step); False: once per step (the boundary micro-batch)."""
    op: str
    group: str
    """world, shard (inside an HSDP replica) or replicate (across replicas, on the 1/shard of the data)."""
    payload: str
    """grad, param or compressed: which bytes per parameter it moves."""


def _gathers(group: str) -> tuple[Comm, Comm]:
    return (
        Comm("forward", True, "all_gather", group, "param"),
        Comm("backward", True, "all_gather", group, "param"),
    )


@dataclass(frozen=True)
class Mode:
    """An engine with a sync mode, as a list of collectives."""

    key: str
    """``engine.sync[.bf16]``, the name ``--modes`` takes; ``bf16``: the boundary reduction compressed
    (for HSDP the cross-replica all-reduce), ``accum.reduce_dtype=bf16``."""
    comms: tuple[Comm, ...]
    shards: str
    """Whose size divides the optimizer step: none, world or shard."""


AR, RS, AG = "all_reduce", "reduce_scatter", "all_gather"


def _hsdp(rs_every: bool, ar_every: bool, ar_payload: str = "grad") -> tuple[Comm, ...]:
    """HSDP: gathers and a reduce-scatter inside the replica, then an all-reduce across replicas."""
    return (
        *_gathers("shard"),
        Comm("backward", rs_every, RS, "shard", "grad"),
        Comm("backward", ar_every, AR, "replicate", ar_payload),
    )


def _zero(rs_every: bool) -> tuple[Comm, Comm]:
    """ZeRO-1/2: a gradient reduce-scatter, then the all-gather of the updated parameter shards."""
    return Comm("backward", rs_every, RS, "world", "grad"), Comm("after_step", False, AG, "world", "param")


MODES: tuple[Mode, ...] = (
    Mode("ddp.boundary", (Comm("backward", False, AR, "world", "grad"),), "none"),
    Mode("ddp.every_micro", (Comm("backward", True, AR, "world", "grad"),), "none"),
    Mode("ddp.boundary.bf16", (Comm("backward", False, AR, "world", "compressed"),), "none"),
    Mode("fsdp.boundary", (*_gathers("world"), Comm("backward", False, RS, "world", "grad")), "world"),
    Mode("fsdp.every_micro", (*_gathers("world"), Comm("backward", True, RS, "world", "grad")), "world"),
    Mode("hsdp.boundary", _hsdp(False, False), "shard"),
    Mode("hsdp.replica_boundary", _hsdp(True, False), "shard"),
    Mode("hsdp.replica_boundary.bf16", _hsdp(True, False, "compressed"), "shard"),
    Mode("hsdp.every_micro", _hsdp(True, True), "shard"),
    Mode("zero1.boundary", _zero(False), "world"),
    Mode("zero2.boundary", _zero(False), "world"),
    Mode("zero2.every_micro", _zero(True), "world"),
    Mode("zero3.boundary", (*_gathers("world"), Comm("backward", False, RS, "world", "grad")), "world"),
    Mode("zero3.every_micro", (*_gathers("world"), Comm("backward", True, RS, "world", "grad")), "world"),
)
"""DDP (and Accelerate, the same collectives), FSDP2 flat and HSDP, DeepSpeed ZeRO-1/2/3 (``zeroN``), each
with the sync modes distaccum runs; ZeRO-1 reduces once per step whatever the sync mode."""
MODE_KEYS = tuple(m.key for m in MODES)


def select_modes(keys: Sequence[str] | None) -> list[Mode]:
    """The modes named by ``keys`` (all when None), in table order; ValueError naming unknown ones."""
    if not keys:
        return list(MODES)
    unknown = sorted(set(keys) - set(MODE_KEYS))
    if unknown:
        raise ValueError(f"unknown mode(s) {', '.join(unknown)}; known: {', '.join(MODE_KEYS)}")
    return [m for m in MODES if m.key in keys]


def hidden_behind(comm_s: float, compute_s: float, units: int) -> float:
    """Exposed seconds of ``comm_s`` of collectives pipelined with ``compute_s`` of compute in ``units``
    units: ``max(C/L, C - P + P/L)`` (0 without communication)."""
    if comm_s <= 0:
        return 0.0
    return max(comm_s / units, comm_s - compute_s + compute_s / units)


@dataclass(frozen=True)
class Priced:
    """One collective of a mode with its modelled time."""

    comm: Comm
    n_bytes: float
    group: Group
    estimate: Estimate


@dataclass(frozen=True)
class ModePrediction:
    """One row of the large-world table: predicted, never measured."""

    mode: Mode
    calls: dict[str, int]
    """Collectives per step by ``op@group``."""
    comm_s: float
    """All communication of a step."""
    exposed_s: float
    step_s: float
    comm_share: float
    priced: tuple[Priced, ...]

    @property
    def overlapped_s(self) -> float:
        """Communication hidden behind compute."""
        return self.comm_s - self.exposed_s


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """The target: a topology and how HSDP lays out its replicas on it."""

    topology: Topology
    replicas: int
    """HSDP replicas (one per node by default: shard inside a node, replicate across nodes)."""

    def groups(self) -> dict[str, Group]:
        """The process groups the modes use."""
        shard, replicate = hsdp_groups(self.topology, self.replicas)
        return {"world": world_group(self.topology), "shard": shard, "replicate": replicate}


def cluster_accum_steps(
    micro_batch: int | None,
    world: int,
    *,
    global_batch: int | None,
    steps: int,
    given_steps: int | None = None,
) -> int:
    """K predicted on a cluster of ``world`` ranks: ``given_steps`` (``--accum-steps``) when given, else the
    configured ``global_batch`` / (``micro_batch`` x ``world``), else ``steps`` (no global batch configured:
    each rank's micro-batches per step are kept). ValueError when the global batch does not split over the
    cluster's ranks at this micro-batch, or the micro-batch is unknown (``auto``) and K not given."""
    if min(micro_batch or 1, world, steps) < 1 or given_steps is not None and given_steps < 1:
        raise ValueError(
            f"micro_batch, world, steps and --accum-steps must be >= 1, got micro_batch={micro_batch}, "
            f"world={world}, steps={steps}, --accum-steps {given_steps}"
        )
    if given_steps is not None:
        return given_steps
    if micro_batch is None:
        raise ValueError(
            "accum.micro_batch=auto: the cluster prediction needs the micro-batch "
            "(give accum.micro_batch=M, or --accum-steps K)"
        )
    if global_batch is None:
        return steps
    per_step = micro_batch * world
    if global_batch % per_step == 0:
        return global_batch // per_step
    fits = [s.micro_batch for s in valid_splits(global_batch, world)]
    hint = (
        f"micro-batches that split it on {world} ranks: {', '.join(map(str, fits))}"
        if fits
        else f"a multiple of {world} splits on {world} ranks: "
        + " or ".join(map(str, nearest_valid_global_batches(global_batch, world)))
    )
    raise ValueError(
        f"accum.global_batch={global_batch} has no split on the cluster's {world} ranks at micro-batch "
        f"{micro_batch}: {micro_batch} x {world} ranks = {per_step} samples per micro-step, and "
        f"{global_batch} / {per_step} = {global_batch / per_step:g} accumulation steps is not a whole number; "
        f"{hint} (or give --accum-steps K to predict micro-batch {micro_batch} x K x {world} ranks)"
    )


def describe_split(micro_batch: int | None, accum_steps: int, world: int, global_batch: int | None) -> str:
    """``micro-batch 4 x K=8 x 32 ranks = global batch 1024``, naming the configured ``global_batch`` when
    the split's differs (``--accum-steps`` given)."""
    if not micro_batch:
        return f"K={accum_steps}"
    text = (
        f"micro-batch {micro_batch} x K={accum_steps} x {world} ranks = global batch "
        f"{micro_batch * accum_steps * world}"
    )
    if global_batch is not None and global_batch != micro_batch * accum_steps * world:
        text += f" (not the configured accum.global_batch={global_batch}: --accum-steps sets K)"
    return text


def predict_mode(mode: Mode, work: Workload, cluster: Cluster) -> ModePrediction:
    """Step time and communication share of ``mode`` (see the module docstring for the model)."""
    groups = cluster.groups()
    per_param = {"grad": work.grad_bytes, "param": work.param_bytes, "compressed": work.compressed_bytes}
    k = work.accum_steps
    priced = []
    for c in mode.comms:
        n = work.params * per_param[c.payload] / (groups["shard"].size if c.group == "replicate" else 1)
        priced.append(Priced(c, n, groups[c.group], collective(c.op, n, groups[c.group], cluster.topology)))

    def seconds(phase: str, boundary: bool) -> float:
        """Communication of ``phase`` on one micro-batch: an inner one, or the boundary (the last)."""
        return sum(
            p.estimate.seconds for p in priced if p.comm.phase == phase and (p.comm.every_micro or boundary)
        )

    forward_w, backward_w = (
        (1 - work.backward_fraction) * work.compute_s,
        work.backward_fraction * work.compute_s,
    )
    exposed = after = seconds("after_step", True)
    total = after
    for boundary, count in ((False, k - 1), (True, 1)):
        fwd, bwd = seconds("forward", boundary), seconds("backward", boundary)
        total += count * (fwd + bwd)
        exposed += count * (
            hidden_behind(fwd, forward_w, work.units) + hidden_behind(bwd, backward_w, work.units)
        )
    shard = {"none": 1, "world": groups["world"].size, "shard": groups["shard"].size}[mode.shards]
    step = k * (work.compute_s + work.data_s) + exposed + work.optim_s / shard
    busy = k * work.compute_s + exposed
    calls: dict[str, int] = {}
    for p in priced:
        key = f"{p.comm.op}@{p.comm.group}"
        calls[key] = calls.get(key, 0) + (k if p.comm.every_micro else 1)
    return ModePrediction(
        mode, calls, total, exposed, step, exposed / busy if busy > 0 else 0.0, tuple(priced)
    )


def predict_modes(modes: Sequence[Mode], work: Workload, cluster: Cluster) -> list[ModePrediction]:
    """:func:`predict_mode` for each of ``modes``."""
    return [predict_mode(m, work, cluster) for m in modes]


def duration(seconds: float) -> str:
    """``0``, ``850 µs``, ``12.5 ms`` or ``3.84 s``."""
    if seconds == 0:
        return "0"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


OP_SHORT = {"all_reduce": "AR", "reduce_scatter": "RS", "all_gather": "AG"}


def render(
    rows: Sequence[ModePrediction],
    work: Workload,
    cluster: Cluster,
    micro_batch: int | None,
    global_batch: int | None = None,
) -> str:
    """The prediction as text: what it assumes, a row per mode, each collective's modelled time.
    Every row says it is a prediction; ``global_batch`` (the configured one) is named when the split's
    differs."""
    topo = cluster.topology
    groups = cluster.groups()
    sizes = ", ".join(
        f"{name} {g.size} ranks ({g.nodes} node{'s' if g.nodes > 1 else ''} x {g.per_node})"
        for name, g in groups.items()
    )
    batch = describe_split(micro_batch, work.accum_steps, topo.world, global_batch)
    lines = [
        f"PREDICTION for {topo.nodes} nodes x {topo.gpus_per_node} GPUs = {topo.world} ranks: not a measurement. "
        "Every row below is the α–β model of docs/planning.md applied to the compute time stated here.",
        f"links: inside a node {rate(topo.intra.beta_bytes_per_s)} per GPU, α {topo.intra.alpha_s * 1e6:g} µs; "
        f"between nodes {rate(topo.inter.beta_bytes_per_s)} per node (shared by its GPUs), "
        f"α {topo.inter.alpha_s * 1e6:g} µs",
        f"groups: {sizes}; HSDP replicas {cluster.replicas}",
        f"model: {work.params:,} parameters; reductions {work.grad_bytes:g} B/param, gathers {work.param_bytes:g} "
        f"B/param, compressed reductions {work.compressed_bytes:g} B/param",
        f"compute per micro-batch: {duration(work.compute_s)} ({work.compute_basis}); data {duration(work.data_s)}; optimizer step "
        + (f"{duration(work.optim_s)} over all parameters" if work.optim_s else "not included (--optim-ms)")
        + f"; {batch}",
        f"overlap: forward gathers behind {1 - work.backward_fraction:.0%} of the compute, backward collectives "
        f"behind {work.backward_fraction:.0%}, in {work.units} units (the first gather and the last reduction of a "
        "pass stay exposed)",
        "",
        "| mode | collectives per step | comm | overlapped | exposed | step | comm share | |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        calls = ", ".join(
            f"{n} {OP_SHORT[key.split('@')[0]]} {key.split('@')[1]}" for key, n in r.calls.items()
        )
        lines.append(
            f"| {r.mode.key} | {calls} | {duration(r.comm_s)} | {duration(r.overlapped_s)} | "
            f"{duration(r.exposed_s)} | {duration(r.step_s)} | {r.comm_share:.0%} | predicted |"
        )
    lines += [
        "",
        "comm share = exposed / (K x compute + exposed); AR all-reduce, RS reduce-scatter, AG all-gather",
        "",
        "| collective | group | bytes per rank | modelled algorithm | time | |",
        "|---|---|---|---|---|---|",
    ]
    seen = set()
    for r in rows:
        for p in r.priced:
            key = (p.comm.op, p.comm.group, p.n_bytes)
            if key not in seen:
                seen.add(key)
                lines.append(
                    f"| {p.comm.op} | {p.comm.group} ({p.group.size}) | {human_bytes(int(p.n_bytes))} | "
                    f"{p.estimate.algorithm} | {duration(p.estimate.seconds)} | predicted |"
                )
    return "\n".join(lines)


def rate(bytes_per_s: float) -> str:
    """``100 Gbit/s (12.5 GB/s)``."""
    return f"{bytes_per_s * 8 / 1e9:g} Gbit/s ({bytes_per_s / 1e9:g} GB/s)"
