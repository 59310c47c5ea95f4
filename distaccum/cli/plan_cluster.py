"""``distaccum plan --nodes N ...``: the prediction for a cluster larger than this machine, and the commands that
train the split it predicts there (the flags, the cluster and outer-sync models they describe, the micro-batch the
prediction starts from)."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from distaccum.tuning.collectives import Link, Topology, gbps
from distaccum.tuning.outer_plan import OUTER_BYTES, OuterLinkPlan, render_outer, smallest_hidden_every
from distaccum.tuning.scaleout import (
    MODE_KEYS,
    Cluster,
    Workload,
    cluster_accum_steps,
    describe_split,
    duration,
    predict_modes,
    render,
    select_modes,
)

if TYPE_CHECKING:
    from distaccum.tuning.planner import SizeCost, SplitPlan

SPLIT_KEYS = ("accum.micro_batch", "accum.steps", "accum.global_batch", "run_dir")
"""Overrides the plan replaces in the commands it writes."""


OUTER_ONLY = ("outer_fragments", "islands", "island_link_latency_ms", "outer_reduce_dtype")
"""Flags that only mean something with ``--island-link-gbps`` or ``--outer-every`` (the outer sync)."""
CLUSTER_ONLY = (
    "gpus_per_node",
    "inter_node_gbps",
    "intra_node_gbps",
    "replicas",
    "compute_ms",
    "optim_ms",
    "params",
    "accum_steps",
    "modes",
    "outer_every",
    "island_link_gbps",
    *OUTER_ONLY,
)
"""Flags that only mean something with ``--nodes``."""
DEFAULT_ISLAND_LATENCY_MS = 10.0
"""α of a stated link between islands: a link between sites (a WAN's one-way latency is 1-50 ms)."""


RENAMED_FLAGS = {
    "--outer-replicas": "--islands",
    "--replica-link-gbps": "--island-link-gbps",
    "--replica-link-latency-ms": "--island-link-latency-ms",
}
"""Old spellings of the outer sync's flags (a replica is HSDP's; an outer sync's group is an island), accepted for
one release."""


class RenamedFlag(argparse.Action):
    """An old flag's spelling: stores the value under the new flag's name and says once what to write instead."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)  # type: ignore[arg-type]

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option: str | None = None,
    ) -> None:
        new = RENAMED_FLAGS[option or self.option_strings[0]]
        print(
            f"distaccum: {option} is now {new}: write {new} {values} (the old spelling is accepted for one release)",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)


Flag = tuple[str, Callable[[str], Any], object, str]
"""A flag of the prediction: its name, type, default (None: not given) and help."""

CLUSTER_FLAGS: tuple[Flag, ...] = (
    ("--nodes", int, None, "nodes of the target cluster: predict every engine and sync mode there"),
    ("--gpus-per-node", int, None, "GPUs (ranks) per node (default 8)"),
    ("--inter-node-gbps", float, None, "network bandwidth of one node, Gbit/s each way (all its NICs)"),
    (
        "--intra-node-gbps",
        float,
        None,
        "one GPU's bandwidth to the others in its node, Gbit/s each way (NVLink 4 on H100: 3600)",
    ),
    ("--inter-node-latency-us", float, 20.0, "α between nodes, µs per message (default 20)"),
    ("--intra-node-latency-us", float, 5.0, "α inside a node, µs per message (default 5)"),
    ("--replicas", int, None, "HSDP replicas (default: one per node, sharding inside the node)"),
    (
        "--compute-ms",
        float,
        None,
        "forward+backward of one micro-batch on the target GPU, ms: given, not measured (default: measure this "
        "machine's)",
    ),
    (
        "--optim-ms",
        float,
        None,
        "optimizer step over all parameters, ms (default: measured, or 0 with --compute-ms)",
    ),
    ("--params", float, None, "parameters of the model (default: count the configured model's)"),
    (
        "--accum-steps",
        int,
        None,
        "K on the cluster (default: accum.global_batch / (micro-batch x the cluster's ranks); without a global "
        "batch, the measured split's K, or accum.steps)",
    ),
    ("--grad-bytes", float, 4.0, "bytes per parameter of a gradient reduction (default 4)"),
    (
        "--param-bytes",
        float,
        4.0,
        "bytes per parameter of a parameter all-gather (default 4; 2 with bf16 mixed precision)",
    ),
    ("--compressed-bytes", float, 2.0, "bytes per parameter of the compressed (bf16) reductions (default 2)"),
    ("--backward-fraction", float, 2 / 3, "share of the compute in the backward (default 2/3)"),
    (
        "--units",
        int,
        32,
        "units (FSDP units, buckets) a window's collectives are cut into; the first gather and the last reduction "
        "stay exposed (default 32)",
    ),
    ("--modes", str, None, "comma-separated engine modes to predict (default all): " + ", ".join(MODE_KEYS)),
)
"""``distaccum plan``'s flags for a cluster larger than this machine, in their ``--help`` order."""

OUTER_FLAGS: tuple[Flag, ...] = (
    (
        "--outer-every",
        int,
        None,
        "H, optimizer steps between two syncs of a fragment (outer.every): its row is marked (default: the rows "
        "of H = 1, 10, 50, 100, 500 and the smallest hidden H)",
    ),
    ("--outer-fragments", int, None, "F, fragments synced at staggered offsets (outer.fragments; default 1)"),
    ("--islands", int, None, "R, islands (outer.islands; default: one per node)"),
    (
        "--island-link-gbps",
        float,
        None,
        "one island's link to the others, Gbit/s each way (default: its share of the nodes' network, "
        "--inter-node-gbps x nodes / R)",
    ),
    (
        "--island-link-latency-ms",
        float,
        None,
        f"α of that link, ms per message (default {DEFAULT_ISLAND_LATENCY_MS:g} with --island-link-gbps, else "
        "--inter-node-latency-us)",
    ),
)
"""``distaccum plan``'s flags for an outer sync, in their ``--help`` order."""


def add_flags(group: argparse._ArgumentGroup, flags: tuple[Flag, ...]) -> None:
    """Add ``flags`` to ``group``."""
    for flag, kind, default, text in flags:
        group.add_argument(flag, type=kind, default=default, help=text)


def add_cluster_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of a prediction for a cluster larger than this machine."""
    group = parser.add_argument_group(
        "a cluster larger than this machine (a prediction from the α–β model of docs/planning.md)"
    )
    add_flags(group, CLUSTER_FLAGS)


def add_outer_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of a prediction for an outer sync (DiLoCo, LocalSGD) across islands joined by a slow link."""
    group = parser.add_argument_group("an outer sync across islands over a slow link (DiLoCo, LocalSGD)")
    add_flags(group, OUTER_FLAGS)
    for old, new in RENAMED_FLAGS.items():  # hidden: the old spellings, for one release
        group.add_argument(
            old, type=float if "link" in new else int, dest=new[2:].replace("-", "_"), action=RenamedFlag
        )
    group.add_argument(
        "--outer-reduce-dtype",
        choices=tuple(OUTER_BYTES),
        help="the dtype the outer sync moves (outer.reduce_dtype; default fp32)",
    )


def outer_wanted(args: argparse.Namespace) -> bool:
    """Whether the outer sync is predicted: ``--island-link-gbps`` or ``--outer-every`` given."""
    return args.island_link_gbps is not None or args.outer_every is not None


def missing_links(args: argparse.Namespace) -> str | None:
    """What the table of engines and sync modes lacks: the missing link flag, or None."""
    gpus = 8 if args.gpus_per_node is None else args.gpus_per_node
    if args.nodes > 1 and args.inter_node_gbps is None:
        return f"--nodes {args.nodes} needs --inter-node-gbps (the network bandwidth of one node)"
    if gpus > 1 and args.intra_node_gbps is None:
        return f"--gpus-per-node {gpus} needs --intra-node-gbps (one GPU's bandwidth inside its node)"
    return None


def cluster_of(args: argparse.Namespace, *, need_links: bool = True) -> Cluster:
    """The target cluster of ``--nodes ...`` (ValueError naming the missing or wrong flag; a missing link
    only with ``need_links``)."""
    missing = missing_links(args)
    if need_links and missing:
        raise ValueError(missing)

    def link(latency_us: float, gbit: float | None) -> Link:  # None: a level the cluster does not have
        return Link(alpha_s=latency_us * 1e-6, beta_bytes_per_s=gbps(gbit if gbit is not None else 1.0))

    topo = Topology(
        nodes=args.nodes,
        gpus_per_node=8 if args.gpus_per_node is None else args.gpus_per_node,
        intra=link(args.intra_node_latency_us, args.intra_node_gbps),
        inter=link(args.inter_node_latency_us, args.inter_node_gbps),
    )
    cluster = Cluster(topology=topo, replicas=args.nodes if args.replicas is None else args.replicas)
    cluster.groups()  # checks the HSDP layout
    return cluster


def outer_of(args: argparse.Namespace, work: Workload) -> tuple[OuterLinkPlan, str]:
    """The outer sync of the ``--outer-*``, ``--islands`` and ``--island-link-*`` flags on the ``--nodes`` cluster, with
    where its link comes from (ValueError naming the wrong or missing flag)."""
    topo = cluster_of(args, need_links=False).topology
    islands = args.nodes if args.islands is None else args.islands
    if islands < 1 or topo.world % islands:
        raise ValueError(
            f"--islands {islands} must divide the world of {topo.nodes} x {topo.gpus_per_node} = "
            f"{topo.world} ranks"
        )
    latency_ms = args.island_link_latency_ms
    if args.island_link_gbps is not None:
        gbit, basis = args.island_link_gbps, "--island-link-gbps"
        latency_ms = DEFAULT_ISLAND_LATENCY_MS if latency_ms is None else latency_ms
    elif args.inter_node_gbps is not None:
        gbit = args.inter_node_gbps * args.nodes / islands
        basis = f"its share of the nodes' network: --inter-node-gbps x {args.nodes} nodes / {islands} islands"
        latency_ms = args.inter_node_latency_us / 1e3 if latency_ms is None else latency_ms
    else:
        raise ValueError(
            "--outer-every needs --island-link-gbps (or --inter-node-gbps): the link between islands"
        )
    if not (gbit > 0 and latency_ms >= 0):
        raise ValueError(
            f"--island-link-gbps must be > 0 and --island-link-latency-ms >= 0, got {gbit:g} and {latency_ms:g}"
        )
    sync = OuterLinkPlan(
        params=work.params,
        islands=islands,
        link=Link(alpha_s=latency_ms / 1e3, beta_bytes_per_s=gbps(gbit)),
        step_s=work.accum_steps * (work.compute_s + work.data_s),
        bytes_per_param=OUTER_BYTES[args.outer_reduce_dtype or "fp32"],
        fragments=1 if args.outer_fragments is None else args.outer_fragments,
        sync_bytes_per_param=work.grad_bytes,
    )
    if args.outer_every is not None:
        sync.check_every(args.outer_every)
    return sync, basis


def cluster_workload(
    args: argparse.Namespace,
    params: int,
    compute_s: float,
    basis: str,
    accum_steps: int,
    data_s: float = 0.0,
    optim_s: float = 0.0,
) -> Workload:
    """What one rank does per step on the cluster (the flags override the measured values)."""
    return Workload(
        params=params,
        compute_s=compute_s,
        compute_basis=basis,
        accum_steps=accum_steps,
        data_s=data_s,
        optim_s=args.optim_ms / 1e3 if args.optim_ms is not None else optim_s,
        grad_bytes=args.grad_bytes,
        param_bytes=args.param_bytes,
        compressed_bytes=args.compressed_bytes,
        backward_fraction=args.backward_fraction,
        units=args.units,
    )


def check_cluster_flags(args: argparse.Namespace) -> None:
    """Every cluster flag, before anything is composed or measured (ValueError: bad input)."""
    cluster_of(args, need_links=not outer_wanted(args))
    select_modes(args.modes.split(",") if args.modes else None)
    work = cluster_workload(args, 1, 0.0, "", 1 if args.accum_steps is None else args.accum_steps)
    if args.compute_ms is not None and args.compute_ms < 0 or args.params is not None and args.params < 1:
        raise ValueError(
            f"--compute-ms must be >= 0 and --params >= 1, got {args.compute_ms} and {args.params}"
        )
    if outer_wanted(args):
        outer_of(args, work)


def predict_cluster(
    args: argparse.Namespace, work: Workload, micro_batch: int | None, global_batch: int | None
) -> str:
    """The cluster prediction as text: the table of every engine and sync mode (when its links are given)
    and the outer sync (when asked for). ``global_batch``: the configured one, named if the split's differs."""
    parts = []
    missing = missing_links(args)
    if missing is None:
        cluster = cluster_of(args)
        modes = select_modes(args.modes.split(",") if args.modes else None)
        parts.append(render(predict_modes(modes, work, cluster), work, cluster, micro_batch, global_batch))
    else:
        parts.append(f"no table of engines and sync modes: {missing}")
    if outer_wanted(args):
        sync, link_basis = outer_of(args, work)
        world = cluster_of(args, need_links=False).topology.world
        step_basis = (
            f"{describe_split(micro_batch, work.accum_steps, world, global_batch)}; K x (compute "
            f"{duration(work.compute_s)} + data {duration(work.data_s)}); its own collectives assumed hidden on "
            "its fast links, the optimizer step not counted: a longer step hides more, so the real smallest H is at "
            "most the one below"
        )
        parts.append(render_outer(sync, args.outer_every, step_basis=step_basis, link_basis=link_basis))
    return "\n\n".join(parts)


def user_overrides(overrides: list[str]) -> list[str]:
    """The user's overrides without the ones the plan sets (the split, the global batch, run_dir)."""
    return [o for o in overrides if o.lstrip("+~").split("=", 1)[0] not in SPLIT_KEYS]


def train_command(
    overrides: list[str], global_batch: int, micro: str, run_dir: str, *, multirun: bool
) -> list[str]:
    """``distaccum train [--multirun] ...`` for the given micro-batch value(s)."""
    return [
        "distaccum",
        "train",
        *(["--multirun"] if multirun else []),
        *user_overrides(overrides),
        f"accum.global_batch={global_batch}",
        f"accum.micro_batch={micro}",
        f"run_dir={run_dir}",
    ]


def cluster_cost(
    plan: SplitPlan, world: int, global_batch: int | None, fixed: int | None
) -> tuple[SizeCost | None, str]:
    """The measured micro-batch the cluster prediction starts from, and why: ``fixed`` (the configured
    accum.micro_batch) when it was measured; else the fastest one here that fits and splits ``global_batch`` over
    the cluster's ``world`` ranks (the recommended split's otherwise). None when no measured one does."""
    costs = {c.micro_batch: c for c in plan.costs}
    if fixed is not None:
        return costs.get(fixed), f"accum.micro_batch={fixed}, as configured"
    ranked = sorted(
        (p for p in plan.predictions if p.fits and p.step_s is not None), key=lambda p: p.step_s or 0.0
    )
    for prediction in ranked:
        m = prediction.split.micro_batch
        if m in costs and (global_batch is None or global_batch % (m * world) == 0):
            which = "the fastest here, splits" if prediction is ranked[0] else "the fastest here that splits"
            return costs[m], f"micro-batch {m}, {which} the global batch over the cluster's {world} ranks"
    return None, ""


def measured_cluster(
    args: argparse.Namespace,
    plan: SplitPlan,
    engine: str,
    params: int,
    global_batch: int | None,
    *,
    fixed_micro_batch: int | None = None,
    overrides: list[str] | None = None,
    run_dir: str = "runs/cluster",
) -> str:
    """The cluster prediction from a measured micro-batch's coefficients (:func:`cluster_cost`): its compute per
    micro-batch, data and optimizer times; K from the configured ``global_batch`` on the cluster's ranks (the
    measured split's K when none is configured) unless ``--accum-steps`` is given; then the commands that train it
    there (:func:`cluster_commands`)."""
    if plan.recommended is None:
        return "no split fits the memory budget: nothing measured to predict the cluster from (give --compute-ms)"
    world = cluster_of(args, need_links=False).topology.world
    cost, why = cluster_cost(plan, world, global_batch, fixed_micro_batch)
    if cost is None:  # nothing measured splits: the recommended size's message names the splits that would
        cost, why = next(c for c in plan.costs if c.micro_batch == plan.recommended.micro_batch), ""
    basis = (
        f"measured here: micro-batch {cost.micro_batch}, median of {cost.steps} step(s) on "
        f"{plan.world_size} {engine} ranks ({plan.memory.split()[0]})" + (f"; {why}" if why else "")
    )
    data_s = max(
        cost.micro_s - cost.compute_s, 0.0
    )  # medians of two quantities: the difference can dip below 0
    try:
        accum_steps = cluster_accum_steps(
            cost.micro_batch,
            world,
            global_batch=global_batch,
            steps=plan.recommended.accum_steps,
            given_steps=args.accum_steps,
        )
    except ValueError as err:
        return f"no prediction for the cluster{f' ({why})' if why else ''}: {err}"
    work = cluster_workload(
        args, params, cost.compute_s, basis, accum_steps, data_s=data_s, optim_s=cost.optim_s
    )
    text = predict_cluster(args, work, cost.micro_batch, global_batch)
    return "\n".join([text, "", *cluster_commands(args, overrides or [], cost.micro_batch, work, run_dir)])


def cluster_commands(
    args: argparse.Namespace, overrides: list[str], micro_batch: int, work: Workload, run_dir: str
) -> list[str]:
    """The lines that train the predicted split on the cluster: ``distaccum train`` on each node (torch elastic's
    rendezvous on the first) or ``distaccum submit --to slurm``, with the outer sync when it was predicted (its H:
    ``--outer-every``, else the smallest hidden one)."""
    topo = cluster_of(args, need_links=False).topology
    split = [
        f"accum.global_batch={micro_batch * work.accum_steps * topo.world}",
        f"accum.micro_batch={micro_batch}",
    ]
    if outer_wanted(args):
        sync, _ = outer_of(args, work)
        every = args.outer_every or smallest_hidden_every(sync)
        if every is not None:
            split += ["outer.method=diloco", f"outer.every={every}", f"outer.islands={sync.islands}"]
            split += [f"outer.fragments={sync.fragments}"] if sync.fragments > 1 else []
    rest = [*user_overrides(overrides), *split]
    on_nodes = [
        "distaccum", "train", *rest, f"trainer.nnodes={topo.nodes}", f"trainer.nproc={topo.gpus_per_node}",
        "trainer.rdzv_endpoint=FIRST_NODE:29500", f"run_dir={run_dir}",
    ]  # fmt: skip
    submit = [
        "distaccum", "submit", "--to", "slurm", *rest, f"slurm.nodes={topo.nodes}",
        f"slurm.gpus_per_node={topo.gpus_per_node}", f"run_dir={run_dir}",
    ]  # fmt: skip
    return [
        f"train it there: on each of the {topo.nodes} node(s), FIRST_NODE being the address of the one that hosts the "
        "rendezvous:",
        "  " + shlex.join(on_nodes),
        "or on Slurm:",
        "  " + shlex.join(submit),
    ]
