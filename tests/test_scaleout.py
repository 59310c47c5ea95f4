"""The large-world prediction of ``distaccum plan --nodes ...`` (``distaccum/tuning/scaleout.py``): each
mode's collectives, the overlap model against hand-computed steps, and the command line (given compute:
no launch), whose output docs/planning.md shows."""

from __future__ import annotations

import math
import re
import shlex

import pytest

from conftest import REPO
from distaccum.cli.plan import measured_cluster, parse_args, plan_main
from distaccum.split import Split
from distaccum.tuning.collectives import Link, Topology
from distaccum.tuning.planner import SizeCost, SplitPlan
from distaccum.tuning.scaleout import (
    MODES,
    Cluster,
    Workload,
    cluster_accum_steps,
    hidden_behind,
    predict_mode,
    predict_modes,
    render,
    select_modes,
)

pytestmark = pytest.mark.unit


def two_nodes(gpus: int = 1) -> Cluster:
    link = Link(alpha_s=0.0, beta_bytes_per_s=1e9)  # 1 GB/s, no latency: times are bytes / 1e9
    return Cluster(topology=Topology(nodes=2, gpus_per_node=gpus, intra=link, inter=link), replicas=2)


WORK = Workload(
    params=1_000_000, compute_s=0.010, compute_basis="given", accum_steps=4, backward_fraction=0.5, units=4
)


def mode(key: str):
    return select_modes([key])[0]


def test_hidden_behind_compute() -> None:
    assert hidden_behind(0.0, 2.0, 4) == 0.0
    assert hidden_behind(1.0, 2.0, 4) == 0.25  # fits in the compute: only the last unit's 1/4 shows
    assert hidden_behind(3.0, 2.0, 4) == 1.5  # longer than the compute: 3 - 2 + 2/4


def test_ddp_steps_by_hand() -> None:
    # 1M fp32 parameters = 4 MB; a ring all-reduce over 2 ranks sends 2 x 1/2 x 4 MB = 4 ms at 1 GB/s.
    # The backward is half of 10 ms: 5 ms, in 4 units, hides all but max(1 ms, 4 - 5 + 1.25 ms) = 1 ms.
    boundary = predict_mode(mode("ddp.boundary"), WORK, two_nodes())
    assert math.isclose(boundary.comm_s, 4e-3) and math.isclose(boundary.exposed_s, 1e-3)
    assert math.isclose(boundary.step_s, 4 * 0.010 + 1e-3)
    assert math.isclose(boundary.comm_share, 1e-3 / (0.040 + 1e-3))
    every = predict_mode(mode("ddp.every_micro"), WORK, two_nodes())
    assert math.isclose(every.comm_s, 16e-3) and math.isclose(every.exposed_s, 4e-3)
    assert boundary.calls == {"all_reduce@world": 1} and every.calls == {"all_reduce@world": 4}
    bf16 = predict_mode(mode("ddp.boundary.bf16"), WORK, two_nodes())
    assert math.isclose(bf16.priced[0].n_bytes, boundary.priced[0].n_bytes / 2) and math.isclose(
        bf16.comm_s, 2e-3
    )


def test_zero1_all_gather_after_the_step_is_exposed() -> None:
    # reduce-scatter of 4 MB (2 ms, behind the 5 ms backward: 0.5 ms shows), then the all-gather of the
    # updated fp32 shards after the step: 2 ms, all of it exposed; the optimizer steps half the parameters
    work = Workload(**{**WORK.__dict__, "optim_s": 0.004})
    row = predict_mode(mode("zero1.boundary"), work, two_nodes())
    assert math.isclose(row.exposed_s, 0.5e-3 + 2e-3) and math.isclose(row.step_s, 0.040 + 2.5e-3 + 0.002)
    assert math.isclose(predict_mode(mode("ddp.boundary"), work, two_nodes()).step_s, 0.040 + 1e-3 + 0.004)


def test_fsdp_gathers_hide_behind_forward_and_backward() -> None:
    # every micro-batch: all-gather of 4 MB in the forward (2 ms vs a 5 ms window: 0.5 ms shows) and again in
    # the backward; the boundary adds the reduce-scatter (2 + 2 = 4 ms behind 5 ms: 1 ms shows)
    row = predict_mode(mode("fsdp.boundary"), WORK, two_nodes())
    assert math.isclose(row.comm_s, 4 * (2e-3 + 2e-3) + 2e-3)
    assert math.isclose(row.exposed_s, 4 * 0.5e-3 + 3 * 0.5e-3 + 1e-3)
    assert row.calls == {"all_gather@world": 8, "reduce_scatter@world": 1}


def test_hsdp_cross_replica_calls_per_mode() -> None:
    cluster = two_nodes(gpus=2)  # 2 replicas (one per node) of 2 shards each
    calls = {
        key: predict_mode(mode(key), WORK, cluster).calls
        for key in ("hsdp.boundary", "hsdp.replica_boundary", "hsdp.every_micro")
    }
    assert [c["all_reduce@replicate"] for c in calls.values()] == [1, 1, 4]  # issue 22: 1, 1 and K per step
    assert [c["reduce_scatter@shard"] for c in calls.values()] == [1, 4, 4]
    assert all(c["all_gather@shard"] == 8 for c in calls.values())
    row = predict_mode(mode("hsdp.replica_boundary"), WORK, cluster)
    replicate = next(p for p in row.priced if p.comm.group == "replicate")
    assert replicate.group.size == 2 and replicate.n_bytes == 4e6 / 2  # the all-reduce of a 1/2 shard
    bf16 = predict_mode(mode("hsdp.replica_boundary.bf16"), WORK, cluster)
    assert next(p for p in bf16.priced if p.comm.group == "replicate").n_bytes == 1e6  # bf16: half again


def test_every_printed_row_says_it_is_a_prediction() -> None:
    rows = predict_modes(MODES, WORK, two_nodes(gpus=2))
    text = render(rows, WORK, two_nodes(gpus=2), micro_batch=4)
    assert text.startswith("PREDICTION for 2 nodes x 2 GPUs = 4 ranks: not a measurement")
    lines = text.splitlines()
    rows = [
        line
        for i, line in enumerate(lines)  # table rows, not headers (a header precedes its |---|)
        if line.startswith("| ")
        and not line.startswith("|---")
        and not (i + 1 < len(lines) and lines[i + 1].startswith("|---"))
    ]
    assert sum(line.split(" | ")[0][2:] in {m.key for m in MODES} for line in rows) == len(MODES)
    assert len(rows) > len(MODES) and all(line.endswith("| predicted |") for line in rows)  # collectives too
    with pytest.raises(ValueError, match="unknown mode"):
        select_modes(["ddp.sometimes"])


DOC_COMMAND = re.compile(r"```bash\n(distaccum plan --nodes [^\n]*)\n```\n\n```\n(.*?)```", re.S)


def test_the_docs_example_is_what_the_command_prints(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/planning.md's large-world example is the command's real output (the given compute time keeps it
    exact)."""
    found = DOC_COMMAND.search((REPO / "docs" / "planning.md").read_text(encoding="utf-8"))
    assert found, "docs/planning.md shows no `distaccum plan --nodes ...` example followed by its output"
    command, shown = found.group(1), found.group(2)
    assert "--compute-ms" in command  # nothing measured here: the output cannot drift with the machine
    assert plan_main(shlex.split(command)[2:]) == 0
    printed = capsys.readouterr().out
    missing = [line for line in shown.strip().splitlines() if line not in printed.splitlines()]
    assert not missing, f"docs/planning.md lines the command no longer prints: {missing}"
    assert "not measured here" in printed
    assert [line.split(" | ")[0][2:] for line in printed.splitlines() if line.endswith("| predicted |")][
        : len(MODES)
    ] == [m.key for m in MODES]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--nodes", "4", "--intra-node-gbps", "900", "--compute-ms", "10", "--params", "1e6"],
            "needs --inter-node-gbps",
        ),
        (
            [
                "--nodes",
                "4",
                "--gpus-per-node",
                "8",
                "--inter-node-gbps",
                "100",
                "--intra-node-gbps",
                "900",
                "--replicas",
                "3",
                "--compute-ms",
                "10",
                "--params",
                "1e6",
            ],
            "replicas=3 must divide",
        ),
        (
            [
                "--nodes",
                "2",
                "--inter-node-gbps",
                "100",
                "--intra-node-gbps",
                "900",
                "--compute-ms",
                "10",
                "--params",
                "1e6",
                "--modes",
                "ddp.never",
            ],
            "unknown mode",
        ),
        (["--gpus-per-node", "8"], "give --nodes too"),
    ],
)
def test_bad_cluster_flags_are_bad_input(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert plan_main([*flags, "model=mlp"]) == 2
    assert message in capsys.readouterr().err


ISSUE_47_COMMAND = (
    "distaccum plan --nodes 4 --gpus-per-node 8 --compute-ms 120 --params 8e9 accum.global_batch=1024 "
    "accum.micro_batch=4"
)
LINKS = ["--inter-node-gbps", "400", "--intra-node-gbps", "3600"]


def test_the_configured_global_batch_sets_k_on_the_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 47: the prediction said K=4 (accum.steps) and global batch 512; K is 1024 / (4 x 32) = 8."""
    assert plan_main([*shlex.split(ISSUE_47_COMMAND)[2:], *LINKS]) == 0
    out = capsys.readouterr().out
    assert "micro-batch 4 x K=8 x 32 ranks = global batch 1024" in out and "K=4" not in out
    # --accum-steps still sets K, and the line says the configured global batch is not the one predicted
    assert plan_main([*shlex.split(ISSUE_47_COMMAND)[2:], *LINKS, "--accum-steps", "2"]) == 0
    assert (
        "micro-batch 4 x K=2 x 32 ranks = global batch 256 (not the configured accum.global_batch=1024"
        in capsys.readouterr().out
    )


def test_a_global_batch_that_does_not_split_on_the_cluster_is_bad_input(
    capsys: pytest.CaptureFixture[str],
) -> None:
    command = ISSUE_47_COMMAND.replace("global_batch=1024", "global_batch=1000")
    assert plan_main([*shlex.split(command)[2:], *LINKS]) == 2
    err = capsys.readouterr().err
    assert "accum.global_batch=1000 has no split on the cluster's 32 ranks at micro-batch 4" in err
    assert "992 or 1024" in err and "--accum-steps K" in err


def test_cluster_accum_steps() -> None:
    assert cluster_accum_steps(4, 32, global_batch=1024, steps=4) == 8
    assert cluster_accum_steps(4, 32, global_batch=None, steps=4) == 4  # no global batch: per-rank K kept
    assert cluster_accum_steps(4, 32, global_batch=1024, steps=4, given_steps=3) == 3
    assert cluster_accum_steps(None, 32, global_batch=1024, steps=4, given_steps=3) == 3
    with pytest.raises(ValueError, match="micro-batches that split it on 32 ranks: 1, 2, 4, 8, 16, 32"):
        cluster_accum_steps(64, 32, global_batch=1024, steps=4)
    with pytest.raises(ValueError, match="micro_batch=auto"):
        cluster_accum_steps(None, 32, global_batch=1024, steps=4)


def test_the_measured_path_takes_k_from_the_global_batch_too() -> None:
    cost = SizeCost(4, 4, 2, base_s=0.5, micro_s=0.12, compute_s=0.1, boundary_s=0.0, optim_s=0.0)
    plan = SplitPlan(32, 2, 1, "cpu peak rss", [], [cost], Split(4, 4, 2))  # K=4 on the 2 ranks measured here
    args, _ = parse_args(["--nodes", "4", "--gpus-per-node", "8", *LINKS, "--params", "1e6"])
    assert "micro-batch 4 x K=8 x 32 ranks = global batch 1024" in measured_cluster(
        args, plan, "ddp", 10**6, 1024
    )
    assert "micro-batch 4 x K=4 x 32 ranks = global batch 512" in measured_cluster(
        args, plan, "ddp", 10**6, None
    )
    assert measured_cluster(args, plan, "ddp", 10**6, 1000).startswith(
        "no prediction for the cluster: accum.global_batch=1000 has no split"
    )


def test_help_is_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "distaccum.tuning.scaleout" in text and "--island-link-gbps" in text
    assert not re.search(r":(mod|class|func|meth|attr|data):`", text) and "``" not in text


def test_the_cluster_prediction_starts_from_a_micro_batch_that_splits_there_and_ends_in_commands() -> None:
    """Issue 56.5: with 2 local ranks the plan recommended micro-batch 128 (K=1) for a global batch of 256, which does
    not split over a 32-rank cluster: "no prediction for the cluster", exit 0, the outer section dropped, and no
    command. Now the fastest measured micro-batch that splits there is used (the configured one when it was fixed),
    and the prediction ends with the commands that train it there; the train line composes into a valid config."""
    from distaccum.cli.compose import compose_config
    from distaccum.tuning.planner import Prediction

    def cost(m: int, s: float) -> SizeCost:
        return SizeCost(m, 1, 2, base_s=s, micro_s=s, compute_s=s * 0.9, boundary_s=0.0, optim_s=0.0)

    costs = [cost(8, 0.30), cost(16, 0.25), cost(128, 0.20)]
    rows = [
        Prediction(Split(c.micro_batch, 256 // (2 * c.micro_batch), 2), c.base_s, 0.1, 1, True, True)
        for c in costs
    ]
    plan = SplitPlan(256, 2, 1, "cpu peak rss", rows, costs, Split(128, 1, 2))
    args, _ = parse_args(
        ["--nodes", "4", "--gpus-per-node", "8", *LINKS, "--params", "1e6", "--outer-every", "10"]
    )
    text = measured_cluster(args, plan, "ddp", 10**6, 256, overrides=["model=mlp"], run_dir="runs/c")
    assert "micro-batch 8, the fastest here that splits the global batch over the cluster's 32 ranks" in text
    assert "micro-batch 8 x K=1 x 32 ranks = global batch 256" in text and "OUTER SYNC PREDICTION" in text
    fixed = measured_cluster(args, plan, "ddp", 10**6, 256, fixed_micro_batch=16, overrides=["model=mlp"])
    assert "accum.micro_batch=16, as configured" in fixed
    assert (
        "no prediction" in fixed
    )  # 16 x 32 ranks = 512 does not split 256: said, with the splits that would
    train = next(line for line in text.splitlines() if line.strip().startswith("distaccum train"))
    overrides = train.split()[2:]
    assert (
        "outer.every=10" in overrides and "trainer.nnodes=4" in overrides and "trainer.nproc=8" in overrides
    )
    cfg = compose_config([o for o in overrides if not o.startswith("trainer.rdzv_endpoint=")])
    assert cfg.world_size() == 32 and cfg.split().global_batch == 256 and cfg.outer.every == 10
    assert any(line.strip().startswith("distaccum submit --to slurm") for line in text.splitlines())
