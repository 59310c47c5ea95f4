"""HSDP (engine.replicas), the sync modes' refusals, the ledger split by group, the rank layout launchers show,
and the compressed reduction (accum.reduce_dtype): single-process checks of the pieces.

The 4-process runs that exercise them end to end are in tests/test_hsdp.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from conftest import engine_spec
from distaccum.config import AccumConfig, EngineConfig, RunConfig, from_mapping
from distaccum.engines.base import EngineSpec, Precision
from distaccum.engines.comm_tap import tap_gradient_reductions
from distaccum.engines.ddp import DDPEngine
from distaccum.engines.deepspeed_config import generate
from distaccum.engines.fsdp import mixed_precision
from distaccum.models import MLP
from distaccum.resolve import resolve
from distaccum.runtime.contracts import DistEnv
from distaccum.runtime.topology import (
    describe_placement,
    placement_lines,
    replica_groups,
    resolve_replicas,
    split_replicas,
)
from distaccum.split import Split
from distaccum.telemetry.ledger import CommLedger
from distaccum.verify.candidates import verify_tolerance
from distaccum.verify.compare import DEFAULT_TOLERANCES, reduction_roundings, with_reduction

pytestmark = pytest.mark.unit
CPU = torch.device("cpu")


def run_config(**sections: Any) -> RunConfig:
    return from_mapping({"accum": {"micro_batch": 2, "steps": 2}, **sections})


@pytest.mark.parametrize("replicas", [0, -2, "two", True])
def test_replicas_must_be_a_positive_integer_or_auto(replicas: object) -> None:
    with pytest.raises(ValueError, match="engine.replicas must be a positive integer or 'auto'"):
        EngineConfig(name="fsdp", replicas=replicas)  # type: ignore[arg-type]


def test_reduce_dtype_and_sync_take_only_their_choices() -> None:
    with pytest.raises(ValueError, match="accum.reduce_dtype='fp8'"):
        AccumConfig(reduce_dtype="fp8")
    with pytest.raises(ValueError, match="accum.sync='replicas'"):
        AccumConfig(sync="replicas")
    assert AccumConfig().sync == "auto" and AccumConfig().reduce_dtype == "fp32"


@pytest.mark.parametrize(
    ("engine", "replicas", "world", "nodes", "expected"),
    [
        ("fsdp", "auto", 4, 2, (2, "replica_boundary")),  # several nodes: one replica per node
        ("fsdp", "auto", 4, 1, (1, "boundary")),  # one node: flat FSDP
        ("fsdp", 2, 4, 1, (2, "replica_boundary")),  # explicit, on one node
        ("fsdp", 1, 4, 2, (1, "boundary")),  # explicit flat on two nodes
        ("ddp", "auto", 4, 2, (1, "boundary")),  # engines without hybrid sharding stay flat
    ],
)
def test_auto_replicates_across_nodes_and_sync_auto_follows(
    engine: str, replicas: object, world: int, nodes: int, expected: tuple[int, str]
) -> None:
    cfg = run_config(engine={"name": engine, "replicas": replicas})
    spec = resolve(cfg, world, CPU, nodes=nodes).engine
    assert (spec.replicas, spec.sync) == expected


def test_resolve_replicas_needs_ranks_that_split_evenly_over_the_nodes() -> None:
    assert resolve_replicas("auto", True, 6, 4) == 1  # 6 ranks cannot be 4 equal nodes
    assert resolve_replicas(3, False, 6, 1) == 3  # an explicit value is kept (the engine's check refuses it)


@pytest.mark.parametrize("engine", ["ddp", "accelerate", "deepspeed"])
def test_replica_boundary_is_refused_where_it_has_no_meaning(engine: str) -> None:
    cfg = run_config(
        engine={"name": engine}, accum={"micro_batch": 2, "steps": 2, "sync": "replica_boundary"}
    )
    with pytest.raises(
        ValueError,
        match=f"accum.sync=replica_boundary with engine={engine} has no meaning: this "
        "engine keeps a whole replica on every rank",
    ):
        resolve(cfg, 2, CPU)


def test_replica_boundary_on_flat_fsdp_and_replicas_on_ddp_are_refused() -> None:
    flat = run_config(
        engine={"name": "fsdp", "replicas": 1},
        accum={"micro_batch": 2, "steps": 2, "sync": "replica_boundary"},
    )
    with pytest.raises(ValueError, match="with engine.replicas=1 the mesh is flat"):
        resolve(flat, 4, CPU)
    with pytest.raises(ValueError, match="engine.replicas=2 asks for hybrid sharding.*engine=ddp"):
        resolve(run_config(engine={"name": "ddp", "replicas": 2}), 4, CPU)


def test_replicas_that_do_not_divide_the_world_are_refused_with_the_numbers() -> None:
    cfg = run_config(engine={"name": "fsdp", "replicas": 4})
    with pytest.raises(
        ValueError,
        match=r"engine.replicas=4 does not divide the world of 6 ranks.*"
        r"Replicas that do: \[1, 2, 3, 6\]",
    ):
        resolve(cfg, 6, CPU)


def test_distenv_reads_the_node_the_launcher_assigned() -> None:
    torchrun = DistEnv.from_environ(
        {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}
    )
    assert (torchrun.node, torchrun.nodes) == (1, 2)
    srun = DistEnv.from_environ(
        {
            "SLURM_STEP_ID": "0",
            "SLURM_PROCID": "2",
            "SLURM_NTASKS": "4",
            "SLURM_NTASKS_PER_NODE": "2",
            "SLURM_NODEID": "1",
        }
    )
    assert (srun.node, srun.nodes) == (1, 2)
    assert DistEnv.from_environ({"RANK": "0", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "2"}).nodes == 1


def test_replica_groups_are_mesh_rows_and_the_plan_puts_one_replica_on_each_node() -> None:
    assert replica_groups(8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert replica_groups(4, 4) == [[0], [1], [2], [3]]
    nodes = [0, 0, 1, 1]
    assert split_replicas(replica_groups(4, 2), nodes) == []
    assert split_replicas(replica_groups(4, 1), nodes) == [0]
    assert describe_placement(replica_groups(4, 2), nodes).splitlines() == [
        "  replica 0: ranks 0-1 on node 0",
        "  replica 1: ranks 2-3 on node 1",
    ]
    plan = placement_lines(2, nodes=2, per_node=4)
    assert plan[0].startswith("HSDP: 2 replicas x 4 shards over 2 node(s) of 4 ranks")
    assert plan[1:] == ["  replica 0: ranks 0-3 on node 0", "  replica 1: ranks 4-7 on node 1"]
    assert placement_lines(1, nodes=2, per_node=4) == []
    assert "shard group spans nodes" in placement_lines(2, nodes=4, per_node=2)[-1]


def test_ledger_keeps_cross_replica_collectives_apart() -> None:
    ledger = CommLedger(enabled=False)
    ledger.start_step()
    for micro in range(2):
        ledger.start_micro()
        ledger.launched(torch.zeros(10))  # a reduce-scatter input inside the replica
        if micro == 1:
            ledger.completed(ledger.launched(torch.zeros(5), replicate=True))  # the shard, across replicas
    stats = ledger.end_step()
    assert (stats.comm_calls, stats.comm_bytes, stats.comm_rounds) == (2, 80, 2)
    assert (stats.comm_calls_replicate, stats.comm_bytes_replicate, stats.comm_rounds_replicate) == (1, 20, 1)


def test_tap_reports_a_reduction_on_the_named_group_as_cross_replica(cpu_group: None) -> None:
    across = dist.new_group([0])
    ledger = CommLedger(enabled=False)
    ledger.start_step()
    ledger.start_micro()
    with tap_gradient_reductions(ledger, replicate_group=across.group_name):
        dist.all_reduce(torch.ones(3))  # the default group
        dist.all_reduce(torch.ones(4), group=across)
        dist.all_reduce(torch.ones(2), dist.ReduceOp.SUM, across)  # group passed by position
    stats = ledger.end_step()
    assert (stats.comm_calls, stats.comm_bytes) == (1, 12)
    assert (stats.comm_calls_replicate, stats.comm_bytes_replicate) == (2, 24)


def _ddp_step(reduce_dtype: str) -> tuple[int, list[torch.Tensor], list[torch.Tensor]]:
    """One K=2 window through the DDP engine on one rank: the bytes reduced, the reduced gradients, and the
    gradients a plain backward gives."""
    torch.manual_seed(0)
    spec = engine_spec(EngineConfig(name="ddp"), Split(2, 2, 1), reduce_dtype=reduce_dtype)
    ledger = CommLedger(enabled=False)
    engine = DDPEngine(spec, ledger)
    model = MLP(in_dim=8, width=16, depth=2, out_dim=4)
    plain = MLP(in_dim=8, width=16, depth=2, out_dim=4)
    plain.load_state_dict(model.state_dict())
    module = engine.wrap(model, lambda p: torch.optim.SGD(p, lr=0.1))
    batches = [(torch.randn(2, 8), torch.randn(2, 4)) for _ in range(2)]
    ledger.start_step()
    for k, (x, y) in enumerate(batches):
        ledger.start_micro()
        with engine.sync(k == 1):
            engine.backward(((module(x) - y) ** 2).sum())
        ((plain(x) - y) ** 2).sum().backward()
    stats = ledger.end_step()
    return (
        stats.comm_bytes,
        [p.grad.clone() for p in engine.unwrapped().parameters()],
        [p.grad for p in plain.parameters()],
    )


@pytest.mark.filterwarnings("ignore:`torch.distributed.*is deprecated:FutureWarning")
def test_compressed_hook_halves_the_bytes_and_rounds_the_accumulated_gradient_once(cpu_group: None) -> None:
    for dtype, torch_dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        half, reduced, plain = _ddp_step(dtype)
        assert half == 2 * sum(p.numel() for p in plain)  # 2 bytes per gradient element, not 4
        # The window accumulated in fp32 (no_sync), then the one reduction rounded it to the low dtype once.
        for got, want in zip(reduced, plain, strict=True):
            assert got.dtype == torch.float32
            assert torch.equal(got, want.to(torch_dtype).to(torch.float32))
            assert not torch.equal(got, want)


def test_fsdp_policy_reduces_in_the_compressed_dtype() -> None:
    fp32, bf16 = Precision.of("fp32"), Precision.of("bf16")
    assert mixed_precision(fp32, True, torch.bfloat16).reduce_dtype == torch.bfloat16
    assert mixed_precision(fp32, True, torch.bfloat16).param_dtype is None  # local work stays fp32
    assert mixed_precision(bf16, True, torch.float16).reduce_dtype == torch.float16
    assert mixed_precision(bf16, True).reduce_dtype == torch.float32  # the default: uncompressed
    assert mixed_precision(fp32, True).reduce_dtype is None


def test_deepspeed_gets_its_communication_data_type() -> None:
    spec = engine_spec(EngineConfig(name="deepspeed"), Split(2, 2, 2), reduce_dtype="bf16")
    config, sources = generate(spec)
    assert config["communication_data_type"] == "bf16"
    assert sources["communication_data_type"] == "accum.reduce_dtype=bf16"
    assert (
        "communication_data_type" not in generate(EngineSpec(**{**spec.__dict__, "reduce_dtype": "fp32"}))[0]
    )


def test_reduction_tolerance_is_derived_from_the_roundings() -> None:
    assert reduction_roundings("boundary", 4, 8) == 4
    assert reduction_roundings("every_micro", 4, 8) == reduction_roundings("replica_boundary", 4, 8) == 32
    base = DEFAULT_TOLERANCES["fp32"]
    tol = with_reduction(base, "bf16", roundings=2, lr=1e-3, steps=10, adam_betas=(0.9, 0.95))
    e = 2 * 2.0**-8
    assert tol.steps.rtol == base.steps.rtol + e and tol.steps.atol == base.steps.atol
    # Adam: k = max(1, 0.1 / sqrt(0.05)) = 1; every element moves at most lr per step in either run.
    assert tol.params.rtol == base.params.rtol and tol.params.atol == pytest.approx(
        base.params.atol + 2 * 1e-3 * 10
    )
    adam_fast_v = with_reduction(base, "bf16", roundings=2, lr=1e-3, steps=10, adam_betas=(0.5, 0.99))
    assert adam_fast_v.params.atol == pytest.approx(base.params.atol + 2 * 5.0 * 1e-3 * 10)  # k = 0.5 / 0.1
    sgd = with_reduction(base, "fp16", roundings=4, lr=1e-3, steps=10, adam_betas=None)
    assert sgd.params.rtol == base.params.rtol + 2 * 4 * 2.0**-11 and sgd.params.atol == base.params.atol
    assert with_reduction(base, "fp32", roundings=2, lr=1e-3, steps=10, adam_betas=None) == base


def test_verify_widens_for_the_split_that_rounds_most_and_respects_explicit_tolerances() -> None:
    cfg = run_config(
        engine={"name": "fsdp", "replicas": 2},
        trainer={"nproc": 4},
        accum={"micro_batch": 2, "steps": 2, "reduce_dtype": "bf16"},
    )
    tol, note = verify_tolerance(cfg, [Split(2, 2, 4), Split(2, 4, 2)])
    e = 8 * 2.0**-8  # replica_boundary: K W = 4 x 2 or 2 x 4 roundings
    assert (
        tol.steps.rtol == pytest.approx(DEFAULT_TOLERANCES["fp32"].steps.rtol + e) and "8 roundings" in note
    )
    explicit = run_config(accum={"micro_batch": 2, "steps": 2, "reduce_dtype": "bf16"}, verify={"rtol": 0.1})
    assert verify_tolerance(explicit, [Split(2, 2, 2)])[0].steps.rtol == 0.1
