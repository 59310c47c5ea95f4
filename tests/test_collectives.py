"""The α–β model of the collectives against values computed by hand, the two-level layouts, and the fit
that calibrates it (``distaccum/tuning/collectives.py``)."""

from __future__ import annotations

import math

import pytest

from distaccum.tuning.collectives import (
    Group,
    Link,
    Sample,
    Topology,
    binomial_all_reduce,
    collective,
    cpu_shared,
    fit_link,
    gbps,
    halving_doubling,
    hsdp_groups,
    predict_ring,
    ring,
    world_group,
)

pytestmark = pytest.mark.unit

LINK = Link(alpha_s=1e-5, beta_bytes_per_s=1e9, gamma_s_per_byte=1e-10)


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15)


def test_ring_formulas_by_hand() -> None:
    # p = 4, n = 1 MB: (p-1)/p n = 750 kB; 750 kB / (1 GB/s) = 0.75 ms; 750 kB x 0.1 ns = 75 us
    assert close(ring("all_reduce", 1e6, 4, LINK), 6 * 1e-5 + 1.5e-3 + 7.5e-5)
    assert close(ring("reduce_scatter", 1e6, 4, LINK), 3 * 1e-5 + 7.5e-4 + 7.5e-5)
    assert close(ring("all_gather", 1e6, 4, LINK), 3 * 1e-5 + 7.5e-4)
    assert ring("all_reduce", 1e6, 1, LINK) == 0.0  # one rank: nothing to send
    # the bandwidth term approaches Patarasuk & Yuan's bound 2n/beta as p grows
    assert close(ring("all_reduce", 1e6, 1000, Link(alpha_s=0, beta_bytes_per_s=1e9)), 2 * 999 / 1000 * 1e-3)
    with pytest.raises(ValueError, match="unknown collective"):
        ring("broadcast", 1.0, 2, LINK)


def test_tree_variants_by_hand() -> None:
    link = Link(alpha_s=1e-5, beta_bytes_per_s=1e9)
    # p = 8: log2 p = 3 messages per phase, the ring's bandwidth term 7/8 n / beta
    assert close(halving_doubling("reduce_scatter", 8e6, 8, link) or 0, 3e-5 + 7e-3)
    assert close(halving_doubling("all_reduce", 8e6, 8, link) or 0, 6e-5 + 14e-3)
    assert halving_doubling("all_gather", 8e6, 6, link) is None  # not a power of two
    # binomial reduce + broadcast: 2 log2 p (alpha + n/beta)
    assert close(binomial_all_reduce(1000, 8, link), 6 * (1e-5 + 1e-6))


def test_two_level_all_reduce_by_hand() -> None:
    # 2 nodes x 2 GPUs, n = 4 MB. Flat ring: 6 steps of 1 MB, each as slow as the network edge:
    # 10 us + 1 MB / 1 GB/s = 1.01 ms -> 6.06 ms. Hierarchical: reduce-scatter in the node
    # (1 us + 2 MB / 10 GB/s = 0.201 ms), all-reduce of 2 MB across the 2 nodes by 2 streams sharing the
    # node's 1 GB/s (2 x 10 us + 2 MB / 0.5 GB/s = 4.02 ms), all-gather in the node (0.201 ms): 4.422 ms.
    topo = Topology(
        nodes=2,
        gpus_per_node=2,
        intra=Link(alpha_s=1e-6, beta_bytes_per_s=1e10),
        inter=Link(alpha_s=1e-5, beta_bytes_per_s=1e9),
    )
    est = collective("all_reduce", 4e6, world_group(topo), topo)
    assert close(est.seconds, 4.422e-3) and est.algorithm.startswith("hierarchical")
    # with 1.5 GB/s inside the node the two in-node phases cost 2 x (1 us + 2 MB / 1.5 GB/s) = 2.669 ms, so
    # hierarchical takes 6.689 ms and the flat ring (its network edge still the slowest) wins with 6.06 ms
    slower = Topology(
        nodes=2, gpus_per_node=2, intra=Link(alpha_s=1e-6, beta_bytes_per_s=1.5e9), inter=topo.inter
    )
    flat = collective("all_reduce", 4e6, world_group(slower), slower)
    assert flat.algorithm == "flat ring" and close(flat.seconds, 6 * (1e-5 + 1e-3))
    # HSDP's cross-node all-reduce of the 1/2 shard (one rank per node, 2 groups sharing each node's link)
    # moves the same bytes through the node's network link as the hierarchical middle phase
    _, replicate = hsdp_groups(topo, 2)
    assert replicate == Group(nodes=2, per_node=1, concurrent=2)
    assert close(collective("all_reduce", 2e6, replicate, topo).seconds, 4.02e-3)
    assert collective("all_reduce", 4e6, Group(nodes=1, per_node=1), topo).seconds == 0.0


def test_hsdp_layouts() -> None:
    topo = Topology(nodes=64, gpus_per_node=8, intra=LINK, inter=LINK)
    assert topo.world == 512
    # one replica per node (the default): shard inside the node, replicate across all 64 nodes
    assert hsdp_groups(topo, 64) == (Group(nodes=1, per_node=8), Group(nodes=64, per_node=1, concurrent=8))
    # 4-GPU shards: two per node; a replicate group has 2 ranks on every node, 4 such groups per node
    assert hsdp_groups(topo, 128) == (
        Group(nodes=1, per_node=4, concurrent=2),
        Group(nodes=64, per_node=2, concurrent=4),
    )
    # 16-GPU shards span 2 nodes; replicate groups take one rank on each of 32 nodes
    assert hsdp_groups(topo, 32) == (Group(nodes=2, per_node=8), Group(nodes=32, per_node=1, concurrent=8))
    with pytest.raises(ValueError, match="must divide"):
        hsdp_groups(topo, 3)
    with pytest.raises(ValueError, match="straddle nodes"):
        hsdp_groups(
            Topology(nodes=3, gpus_per_node=8, intra=LINK, inter=LINK), 2
        )  # shards of 12 on 8-GPU nodes


def test_units_and_validation() -> None:
    assert gbps(100) == 12.5e9
    assert LINK.shared(4).beta_bytes_per_s == 2.5e8 and LINK.shared(4).alpha_s == LINK.alpha_s
    with pytest.raises(ValueError, match="beta_bytes_per_s > 0"):
        Link(alpha_s=0, beta_bytes_per_s=0)
    with pytest.raises(ValueError, match="nodes >= 1"):
        Topology(nodes=0, gpus_per_node=8, intra=LINK, inter=LINK)


def test_cpu_sharing_on_loopback() -> None:
    assert cpu_shared(1.0, 2, 2) == 1.0 and cpu_shared(1.0, 4, 2) == 2.0 and cpu_shared(1.0, 3, 4) == 1.0
    assert predict_ring("all_gather", 1e6, 4, LINK, cores=2) == 2 * ring("all_gather", 1e6, 4, LINK)
    with pytest.raises(ValueError, match="cores"):
        cpu_shared(1.0, 2, 0)


def _samples(link: Link, cores: int, noise: tuple[float, ...] = (1.0,)) -> list[Sample]:
    sizes = (64 * 1024, 1 << 20, 8 << 20)
    return [
        Sample(op, p, n, predict_ring(op, n, p, link, cores) * noise[i % len(noise)])
        for i, (op, p, n) in enumerate(
            (op, p, n) for op in ("reduce_scatter", "all_gather") for p in (2, 4) for n in sizes
        )
    ]


def test_fit_recovers_the_link_it_was_given() -> None:
    truth = Link(alpha_s=2e-4, beta_bytes_per_s=8e8, gamma_s_per_byte=3e-10)
    fitted = fit_link(_samples(truth, cores=2), cores=2)
    assert math.isclose(fitted.alpha_s, truth.alpha_s, rel_tol=1e-9)
    assert math.isclose(fitted.beta_bytes_per_s, truth.beta_bytes_per_s, rel_tol=1e-9)
    assert math.isclose(fitted.gamma_s_per_byte, truth.gamma_s_per_byte, rel_tol=1e-9)
    noisy = fit_link(_samples(truth, cores=2, noise=(1.05, 0.95, 1.02, 0.98)), cores=2)
    assert math.isclose(noisy.beta_bytes_per_s, truth.beta_bytes_per_s, rel_tol=0.1)
    # all-gathers carry no reduction: gamma stays 0 instead of being confused with beta
    gathers = [s for s in _samples(truth, cores=2) if s.op == "all_gather"]
    only = fit_link(gathers, cores=2)
    assert only.gamma_s_per_byte == 0.0 and math.isclose(
        only.beta_bytes_per_s, truth.beta_bytes_per_s, rel_tol=1e-9
    )


def test_fit_clamps_a_negative_latency_and_refuses_flat_times() -> None:
    # times exactly proportional to the bytes, less a constant: the best alpha would be negative
    samples = [Sample("all_gather", 2, n, n / 2 / 1e9 - 1e-6) for n in (1 << 20, 4 << 20, 16 << 20)]
    fitted = fit_link(samples, cores=2)
    assert fitted.alpha_s == 0.0 and math.isclose(fitted.beta_bytes_per_s, 1e9, rel_tol=0.01)
    with pytest.raises(ValueError, match="no positive bandwidth"):
        fit_link(
            [Sample("all_gather", 2, n, 1e-3 * (2 - n / (16 << 20))) for n in (1 << 20, 16 << 20)], cores=2
        )
    with pytest.raises(ValueError, match="needs samples"):
        fit_link([], cores=2)
