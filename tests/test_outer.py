"""The outer sync's pure parts (issue 47), no process group: the ``outer`` section's validation, the fragments'
sync cadence, the islands' layout, the fragment cut, the merge weight, and what ``resolve`` refuses."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from distaccum.config import from_mapping
from distaccum.outer.config import OuterConfig
from distaccum.outer.islands import IslandLayout, resolve_islands
from distaccum.outer.sync import OuterSync, split_fragments
from distaccum.resolve import resolve

pytestmark = pytest.mark.unit


# --- OuterConfig ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"every": 3, "fragments": 4}, "outer.fragments=4 is more than outer.every=3"),
        ({"method": "diloco", "momentum": 0.0}, "outer.nesterov=true needs outer.momentum > 0"),
        ({"method": "easgd"}, "outer.method='easgd' is not one of none, local_sgd, diloco"),
        ({"reduce_dtype": "fp16"}, "outer.reduce_dtype='fp16' is not one of fp32, bf16"),
        ({"weighting": "samples"}, "outer.weighting='samples' is not one of tokens, equal"),
        ({"every": 0}, "outer.every must be a positive integer"),
        ({"fragments": True}, "outer.fragments must be a positive integer"),
        ({"islands": 0}, "outer.islands must be a positive integer or 'auto'"),
        ({"islands": "two"}, "outer.islands must be a positive integer or 'auto'"),
        ({"lr": 0.0}, "outer.lr must be > 0"),
        ({"momentum": 1.0}, "outer.momentum must be in [0, 1)"),
    ],
)
def test_invalid_outer_settings_are_refused_naming_the_key(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as err:
        OuterConfig(**fields)
    assert message in str(err.value)


def test_valid_outer_settings() -> None:
    OuterConfig(method="diloco", momentum=0.0, nesterov=False)  # plain SGD outer step
    OuterConfig(method="local_sgd", every=12, fragments=4, islands=2, reduce_dtype="bf16", weighting="equal")
    assert not OuterConfig().enabled and OuterConfig(method="local_sgd").enabled
    # the section reaches the run config (and its validation runs there too)
    assert from_mapping({"outer": {"method": "diloco", "every": 4}}).outer.every == 4
    with pytest.raises(ValueError, match="more than outer.every"):
        from_mapping({"outer": {"method": "diloco", "every": 5, "fragments": 6}})


def schedule(cfg: OuterConfig, max_steps: int) -> dict[int, list[int]]:
    """Step -> the fragments that sync after it, for every step that syncs any."""
    return {t: due for t in range(1, max_steps + 1) if (due := cfg.syncing(t, max_steps))}


def test_one_fragment_syncs_at_multiples_of_h_and_after_the_last_step() -> None:
    cfg = OuterConfig(method="diloco", every=4)
    assert cfg.offsets() == [4]
    assert schedule(cfg, 12) == {4: [0], 8: [0], 12: [0]}
    assert schedule(cfg, 10) == {4: [0], 8: [0], 10: [0]}  # the closing sync: the trained model is global
    assert schedule(OuterConfig(method="local_sgd", every=1), 3) == {1: [0], 2: [0], 3: [0]}
    assert schedule(cfg, 3) == {3: [0]}  # shorter than H: only the closing sync


def test_fragments_sync_at_staggered_offsets() -> None:
    cfg = OuterConfig(method="diloco", every=10, fragments=2)
    assert cfg.offsets() == [5, 10]
    assert schedule(cfg, 37) == {5: [0], 10: [1], 15: [0], 20: [1], 25: [0], 30: [1], 35: [0], 37: [0, 1]}
    assert schedule(cfg, 30) == {5: [0], 10: [1], 15: [0], 20: [1], 25: [0], 30: [0, 1]}
    four = OuterConfig(method="local_sgd", every=8, fragments=4)
    assert four.offsets() == [2, 4, 6, 8]
    assert schedule(four, 16) == {
        2: [0], 4: [1], 6: [2], 8: [3], 10: [0], 12: [1], 14: [2], 16: [0, 1, 2, 3]
    }  # fmt: skip
    # P not dividing H: offsets floor((p+1) H/P), each fragment still every H steps
    uneven = OuterConfig(method="diloco", every=10, fragments=4)
    assert uneven.offsets() == [2, 5, 7, 10]
    assert schedule(uneven, 20) == {
        2: [0],
        5: [1],
        7: [2],
        10: [3],
        12: [0],
        15: [1],
        17: [2],
        20: [0, 1, 2, 3],
    }
    # P = H: one fragment after every step
    assert schedule(OuterConfig(method="diloco", every=3, fragments=3), 5) == {
        1: [0], 2: [1], 3: [2], 4: [0], 5: [0, 1, 2]
    }  # fmt: skip


def test_describe_names_the_method_and_its_settings() -> None:
    assert (
        OuterConfig(method="diloco").describe().startswith("DiLoCo: outer SGD lr 0.7, momentum 0.9 Nesterov")
    )
    plain = OuterConfig(method="diloco", lr=1.0, momentum=0.0, nesterov=False, fragments=2, every=2)
    assert "momentum" not in plain.describe() and "2 fragments at staggered offsets" in plain.describe()
    assert OuterConfig(method="local_sgd", reduce_dtype="bf16").describe().startswith("LocalSGD")
    assert "bf16 across islands" in OuterConfig(method="local_sgd", reduce_dtype="bf16").describe()


# --- IslandLayout -------------------------------------------------------------------------------------


def test_island_layout_of_consecutive_ranks() -> None:
    layouts = [IslandLayout.of(8, rank, 2) for rank in range(8)]
    assert [(x.index, x.inner_rank) for x in layouts] == [(i // 4, i % 4) for i in range(8)]
    layout = layouts[5]
    assert (layout.islands, layout.size) == (2, 4)
    assert layout.ranks(0) == [0, 1, 2, 3] and layout.ranks(1) == [4, 5, 6, 7]
    assert layout.peers(1) == [1, 5] and layout.peers(3) == [3, 7]
    # every rank is in exactly one island and one peer group
    assert sorted(r for i in range(2) for r in layout.ranks(i)) == list(range(8))
    assert sorted(r for j in range(4) for r in layout.peers(j)) == list(range(8))
    ones = IslandLayout.of(3, 2, 3)  # one island per rank
    assert (ones.size, ones.index, ones.inner_rank, ones.peers(0), ones.ranks(2)) == (1, 2, 0, [0, 1, 2], [2])
    single = IslandLayout.of(4, 3, 1)  # one island: the whole world
    assert (single.index, single.inner_rank, single.ranks(0), single.peers(3)) == (0, 3, [0, 1, 2, 3], [3])


@pytest.mark.parametrize(("world", "islands"), [(4, 3), (6, 4), (2, 0), (3, 5)])
def test_island_layout_refuses_islands_that_do_not_divide_the_world(world: int, islands: int) -> None:
    with pytest.raises(ValueError, match=f"outer.islands={islands} must divide the world of {world} ranks"):
        IslandLayout.of(world, 0, islands)


def test_auto_islands_is_one_island_per_node_else_one_per_rank() -> None:
    assert resolve_islands("auto", 16, 4) == 4  # multi-node: one per node
    assert resolve_islands("auto", 8, 1) == 8  # one node: one per rank
    assert resolve_islands("auto", 1, 1) == 1
    assert resolve_islands(2, 16, 4) == 2  # explicit wins
    assert resolve_islands(3, 3, 1) == 3


# --- fragments ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "numels",
    [
        [2048, 64, 4096, 64, 512, 8],  # model=mlp
        [10] * 7,
        [1, 1, 1, 1000, 1, 1, 1],
        [5, 3, 8, 1, 9, 2, 7, 4, 6, 10, 11, 12],
    ],
)
@pytest.mark.parametrize("fragments", [1, 2, 3, 4])
def test_fragments_are_consecutive_cover_every_parameter_and_are_balanced(
    numels: list[int], fragments: int
) -> None:
    groups = split_fragments(numels, fragments)
    assert len(groups) == fragments and all(groups)  # every fragment holds at least one parameter
    assert [i for g in groups for i in g] == list(range(len(numels)))  # consecutive, in order, all, once
    target = sum(numels) / fragments
    for g in groups:
        # balanced: a greedy cut misses the target by at most the largest parameter it could not split
        assert abs(sum(numels[i] for i in g) - target) <= max(numels), (groups, numels)


def test_fragments_by_hand() -> None:
    assert split_fragments([2048, 64, 4096, 64, 512, 8], 2) == [[0, 1], [2, 3, 4, 5]]  # 2112 | 4680
    assert split_fragments([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert split_fragments([10, 10, 10, 10], 4) == [[0], [1], [2], [3]]
    assert split_fragments([1000, 1, 1], 3) == [[0], [1], [2]]  # at least one parameter each
    assert split_fragments([1, 2, 3], 1) == [[0, 1, 2]]
    assert split_fragments([4, 4, 4, 4, 4, 4], 3) == [[0, 1], [2, 3], [4, 5]]


def test_more_fragments_than_parameters_is_refused() -> None:
    with pytest.raises(ValueError, match=r"outer.fragments=4 is more than the model's 3 parameters"):
        split_fragments([10, 10, 10], 4)


# --- the merge weight ----------------------------------------------------------------------------------


def weight_of(index: int, counts: list[float], weighting: str = "tokens") -> float:
    """:meth:`OuterSync.weight` of island ``index`` (no process group: only the layout and config are read)."""
    sync = SimpleNamespace(
        cfg=OuterConfig(method="diloco", weighting=weighting),
        layout=IslandLayout.of(len(counts), index, len(counts)),
    )
    return OuterSync.weight(sync, counts)  # type: ignore[arg-type]


def test_token_weights_are_each_islands_share_of_the_items() -> None:
    counts = [30.0, 10.0, 60.0]
    weights = [weight_of(i, counts) for i in range(3)]
    assert weights == [0.3, 0.1, 0.6]
    assert math.isclose(math.fsum(weights), 1.0)
    assert [weight_of(i, [16.0, 16.0]) for i in range(2)] == [0.5, 0.5]  # equal counts: the plain mean
    assert weight_of(1, [0.0, 5.0]) == 1.0 and weight_of(0, [0.0, 5.0]) == 0.0  # an island that saw nothing


def test_equal_weights_and_zero_counts_give_the_plain_mean() -> None:
    assert [weight_of(i, [30.0, 10.0, 60.0], "equal") for i in range(3)] == [1 / 3] * 3
    assert [weight_of(i, [0.0, 0.0, 0.0, 0.0]) for i in range(4)] == [0.25] * 4  # nobody counted an item
    assert weight_of(0, [7.0]) == 1.0  # one island: its own parameters, exactly


def test_weighted_pseudo_gradient_mean_by_hand() -> None:
    """What the one all-reduce sums: w_i (theta_g - theta_i); by hand for 2 islands of unequal counts."""
    theta_g = torch.tensor([1.0, 2.0], dtype=torch.float64)
    islands = [torch.tensor([0.0, 2.0], dtype=torch.float64), torch.tensor([1.0, 0.0], dtype=torch.float64)]
    counts = [3.0, 1.0]
    summed = sum(weight_of(i, counts) * (theta_g - islands[i]) for i in range(2))
    assert torch.equal(summed, torch.tensor([0.75, 0.5], dtype=torch.float64))


# --- what resolve refuses -------------------------------------------------------------------------------


def config(**sections: Any) -> Any:
    base: dict[str, Any] = {"outer": {"method": "diloco", "every": 2}, "trainer": {"device": "cpu"}}
    return from_mapping({**base, **sections})


@pytest.mark.parametrize(
    ("sections", "world", "message"),
    [
        ({"engine": {"name": "deepspeed"}}, 2, "engine=deepspeed is not supported inside an island"),
        ({"engine": {"name": "accelerate"}}, 2, "engine=accelerate is not supported inside an island"),
        ({"engine": {"name": "ddp", "replicas": 2}}, 4, "HSDP inside an island is not supported"),
        ({"log": {"gns": True}}, 2, "log.gns=true is not supported with outer.method=diloco"),
        ({"outer": {"method": "local_sgd", "islands": 3}}, 4, "outer.islands=3 must divide the world of 4"),
    ],
)
def test_resolve_refuses_what_an_island_cannot_run(
    sections: dict[str, Any], world: int, message: str
) -> None:
    with pytest.raises(ValueError) as err:
        resolve(config(**sections), world, torch.device("cpu"))
    assert message in str(err.value)


def test_resolve_islands() -> None:
    cpu = torch.device("cpu")
    assert resolve(config(), 4, cpu).outer_islands == 4  # auto on one node: one island per rank
    assert resolve(config(), 4, cpu, nodes=2).outer_islands == 2  # auto on two nodes: one per node
    two = resolve(config(outer={"method": "local_sgd", "islands": 2}), 4, cpu)
    assert two.outer_islands == 2 and two.engine.replicas == 1  # the islands take the replicas' place
    assert resolve(from_mapping({"trainer": {"device": "cpu"}}), 2, cpu).outer_islands == 0  # method=none


def test_verify_refuses_a_compressed_outer_merge_before_running_anything(tmp_path: Any) -> None:
    """No derived rounding bound for a bf16 merge: verify says so and names the uncompressed setting."""
    from distaccum.config import ConfigError
    from distaccum.verify import verify

    config = {"model": {"_target_": "distaccum.models.MLP"}, "run_dir": str(tmp_path)}
    config["outer"] = {"method": "diloco", "every": 2, "reduce_dtype": "bf16"}
    with pytest.raises(ConfigError, match="outer.reduce_dtype=fp32"):
        verify(config)
    assert not any(tmp_path.iterdir())  # nothing ran
