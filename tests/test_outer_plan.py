"""The outer-sync prediction of ``distaccum plan --island-link-gbps B`` (``distaccum/tuning/outer_plan.py``): the
formulas against hand-computed syncs, the smallest hidden H against a brute-force search, and the command line
(given compute: no launch)."""

from __future__ import annotations

import math
import shlex

import pytest

from distaccum.cli.plan import plan_main
from distaccum.tuning.collectives import Link
from distaccum.tuning.outer_plan import (
    OuterLinkPlan,
    outer_row,
    render_outer,
    shown_every,
    smallest_hidden_every,
)

pytestmark = pytest.mark.unit

GB_PER_S = Link(alpha_s=0.0, beta_bytes_per_s=1e9)  # 1 GB/s, no latency: times are bytes / 1e9


def sync(**kw: object) -> OuterLinkPlan:
    """1M fp32 parameters across 2 islands at 1 GB/s, 1 ms steps, unless ``kw`` says otherwise."""
    base: dict[str, object] = {"params": 1_000_000, "islands": 2, "link": GB_PER_S, "step_s": 1e-3}
    return OuterLinkPlan(**{**base, **kw})  # type: ignore[arg-type]


def test_one_sync_is_a_ring_all_reduce_of_one_fragment() -> None:
    # 4 MB over 2 islands: each sends 2 x 1/2 x 4 MB = 4 MB, 4 ms at 1 GB/s
    assert math.isclose(sync().sync_s(), 4e-3)
    # 4 islands: 2 x 3/4 x 4 MB = 6 MB; bf16 halves it, 2 fragments halve it again
    assert math.isclose(sync(islands=4).sync_s(), 6e-3)
    assert math.isclose(sync(islands=4, bytes_per_param=2.0, fragments=2).sync_s(), 1.5e-3)
    # latency: 2 messages per all-reduce, whatever the fragment size
    slow = Link(alpha_s=0.01, beta_bytes_per_s=1e9)
    assert math.isclose(sync(islands=4, link=slow, fragments=2).sync_s(), 6 * 0.01 + 3e-3)
    assert sync(islands=1).sync_s() == 0.0


def test_rows_by_hand() -> None:
    s = sync()  # a 4 ms sync behind 1 ms steps
    row = outer_row(s, 1)  # hides 1 ms of 4: 3 ms exposed every step
    assert math.isclose(row.exposed_per_step_s, 3e-3) and math.isclose(row.window_s, 1e-3)
    assert math.isclose(row.bytes_per_step, 4e6) and math.isclose(row.reduction or 0, 1.0)  # as HSDP: 4 MB
    row = outer_row(s, 2)  # hides 2 ms of 4: 2 ms every 2 steps
    assert math.isclose(row.exposed_per_step_s, 1e-3) and math.isclose(row.bytes_per_step, 2e6)
    assert outer_row(s, 4).hidden and not outer_row(s, 3).hidden
    assert math.isclose(outer_row(s, 100).reduction or 0, 100.0)
    # 2 fragments at H=4: a 2 ms fragment sync every 2 steps, behind 2 ms: hidden, 1 MB per step
    row = outer_row(sync(fragments=2), 4)
    assert row.hidden and math.isclose(row.sync_s, 2e-3) and math.isclose(row.bytes_per_step, 1e6)
    # bf16 sends half of fp32's bytes: twice the reduction against the fp32 gradient all-reduce
    assert math.isclose(outer_row(sync(bytes_per_param=2.0), 10).reduction or 0, 20.0)
    assert outer_row(sync(islands=1), 1).reduction is None


def brute_force(s: OuterLinkPlan) -> int:
    return next(h for h in range(s.fragments, 10**6, s.fragments) if outer_row(s, h).hidden)


@pytest.mark.parametrize("islands", [2, 3, 8])
@pytest.mark.parametrize("fragments", [1, 2, 5])
@pytest.mark.parametrize("step_s", [1e-4, 7e-4, 1e-3, 3.3e-3])
@pytest.mark.parametrize("alpha_s", [0.0, 1e-3])
def test_smallest_hidden_every_is_the_first_multiple_of_f_with_nothing_exposed(
    islands: int, fragments: int, step_s: float, alpha_s: float
) -> None:
    s = sync(
        islands=islands,
        fragments=fragments,
        step_s=step_s,
        link=Link(alpha_s=alpha_s, beta_bytes_per_s=1e9),
    )
    h = smallest_hidden_every(s)
    assert h == brute_force(s) and h is not None and h % fragments == 0
    assert outer_row(s, h).exposed_per_step_s == 0
    assert h == fragments or outer_row(s, h - fragments).exposed_per_step_s > 0


def test_smallest_hidden_every_at_the_edges() -> None:
    assert smallest_hidden_every(sync()) == 4  # 4 ms behind 4 x 1 ms exactly: hidden
    assert smallest_hidden_every(sync(fragments=3)) == 6  # a 4/3 ms fragment sync needs 2 steps
    assert smallest_hidden_every(sync(islands=1, fragments=3)) == 3  # nothing crosses: any multiple of F
    assert smallest_hidden_every(sync(step_s=0.0)) is None  # nothing to hide behind


def test_fragments_that_do_not_divide_h_are_planned_as_training_runs_them() -> None:
    """Issue 56.5: the planner refused H=10 with 4 fragments, which training runs (fragment p after floor((p+1)H/F)
    steps: gaps of 2 or 3 steps). Bytes follow the F syncs per H steps; the exposure, the shortest gap."""
    from distaccum.outer.config import OuterConfig

    offsets = OuterConfig(method="diloco", every=10, fragments=4).offsets()
    assert (
        offsets == [2, 5, 7, 10]
        and min(b - a for a, b in zip([0, *offsets], offsets, strict=False)) == 10 // 4
    )
    s = sync(fragments=4, step_s=0.0005)
    row = outer_row(s, 10)
    assert row.window_s == pytest.approx(2 * 0.0005)  # the shortest gap, floor(10 / 4) steps
    per_sync = row.bytes_per_step * 10 / 4
    assert outer_row(s, 8).bytes_per_step == pytest.approx(per_sync * 4 / 8)  # the same fragment, more often
    assert row.exposed_per_step_s == pytest.approx(max(0.0, row.sync_s - row.window_s) * 4 / 10)


def test_bad_input_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="must be at least the 4 fragment"):  # training refuses it too
        outer_row(sync(fragments=4), 3)
    with pytest.raises(ValueError, match="fragments must be >= 1"):
        sync(fragments=0)
    with pytest.raises(ValueError, match="step_s must be >= 0"):
        sync(step_s=-1.0)


def test_shown_every_rounds_up_to_multiples_of_f() -> None:
    assert shown_every(sync()) == [1, 10, 50, 100, 500]
    assert shown_every(sync(fragments=4), (8, None, 12)) == [4, 8, 12, 52, 100, 500]


def test_render_marks_the_smallest_and_the_given_h_and_says_prediction() -> None:
    text = render_outer(sync(), 20, step_basis="given", link_basis="stated")
    assert text.startswith("OUTER SYNC PREDICTION") and "smallest H with the sync hidden: H = 4" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| H |")]
    assert len(rows) == 7 and all(line.endswith("| predicted |") for line in rows)
    assert "| 4 (smallest hidden) |" in text and "| 20 (--outer-every) |" in text
    assert "one island: nothing crosses" in render_outer(sync(islands=1), None, step_basis="", link_basis="")


COMMAND = (
    "distaccum plan --nodes 4 --gpus-per-node 8 --compute-ms 120 --params 8e9 accum.global_batch=1024 "
    "accum.micro_batch=4 --island-link-gbps 1"
)


def test_cli_predicts_the_smallest_h_for_an_8b_model_over_1_gbit(capsys: pytest.CaptureFixture[str]) -> None:
    # K = 1024 / (4 x 32) = 8: an 8 x 120 ms = 960 ms step. One sync: 2 x 3/4 x 32 GB at 0.125 GB/s = 384 s
    # plus 6 x 10 ms: 384.06 s, hidden behind ceil(384.06 / 0.96) = 401 steps.
    assert plan_main(shlex.split(COMMAND)[2:]) == 0
    out = capsys.readouterr().out
    assert "no table of engines and sync modes: --nodes 4 needs --inter-node-gbps" in out
    assert "micro-batch 4 x K=8 x 32 ranks = global batch 1024" in out
    assert "smallest H with the sync hidden: H = 401 " in out and "| 401 (smallest hidden) |" in out
    # issue 56.5: it ends in the commands that train it there, with the smallest hidden H
    assert (
        "  distaccum train accum.global_batch=1024 accum.micro_batch=4 outer.method=diloco outer.every=401 "
        in out
    )
    assert "trainer.nnodes=4 trainer.nproc=8 trainer.rdzv_endpoint=FIRST_NODE:29500" in out
    assert "  distaccum submit --to slurm accum.global_batch=1024" in out and "slurm.gpus_per_node=8" in out
    assert (
        "384.06 s per sync" in out
        and "| 100 | 457.8MiB | 384.06 s | 96.00 s | 2.88 s | 3.84 s | 100x fewer |" in out
    )
    # bf16 in 4 fragments: 8 GB fragments of 48.06 s, 51 steps each: H = 204
    assert (
        plan_main([*shlex.split(COMMAND)[2:], "--outer-reduce-dtype", "bf16", "--outer-fragments", "4"]) == 0
    )
    assert "H = 204 " in capsys.readouterr().out


def test_cli_outer_link_defaults_to_the_nodes_network(capsys: pytest.CaptureFixture[str]) -> None:
    flags = "--nodes 2 --gpus-per-node 1 --inter-node-gbps 8 --compute-ms 10 --params 1e6 --outer-every 10"
    assert plan_main([*shlex.split(flags), "accum.micro_batch=2", "accum.steps=3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "PREDICTION for 2 nodes x 1 GPUs"
    )  # the table is printed as before, then the outer sync
    # 1 GB/s, α 20 µs: 2 x 1/2 x 4 MB + 2 x 20 µs = 4.04 ms behind 3 x 10 ms steps: H = 1
    assert "1 GB/s) per island, α 0.02 ms (its share of the nodes' network" in out
    assert "H = 1 " in out and "| 10 (--outer-every) |" in out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--outer-fragments", "2"], "give --island-link-gbps or --outer-every too"),
        (["--outer-every", "10"], "--outer-every needs --island-link-gbps"),
        (
            ["--island-link-gbps", "1", "--outer-every", "3", "--outer-fragments", "4"],
            "must be at least the 4 fragment",
        ),
        (["--island-link-gbps", "1", "--islands", "3"], "--islands 3 must divide"),
        (["--island-link-gbps", "0"], "--island-link-gbps must be > 0"),
    ],
)
def test_bad_outer_flags_are_bad_input(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = ["--nodes", "4", "--compute-ms", "10", "--params", "1e6", "model=mlp"]
    assert plan_main([*cluster, *flags]) == 2
    assert message in capsys.readouterr().err
