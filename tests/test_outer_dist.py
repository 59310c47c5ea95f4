"""Outer-synced runs (issue 47) on real process groups: the identities that pin the outer step's math, ``distaccum
verify`` on DDP and FSDP2 inside the islands, the ledger of the cross-island collectives, and the islands'
agreement check stopping a run whose islands merged different numbers.

Identities (fp64, no clipping, so only rounding separates the two sides):

- DiLoCo with H=1, a plain-SGD inner step and an outer SGD of lr 1 without momentum IS synchronous SGD over all
  ranks: the token-weighted mean of the islands' pseudo-gradients lr_t g_i is lr_t times the global mean gradient;
- DiLoCo with outer lr 1 and no momentum IS LocalSGD: theta_g - sum_i w_i (theta_g - theta_i) = sum_i w_i theta_i;
- one island is plain training: the merge of one island is its own parameters.

The 2-rank runs share ONE launch: this file doubles as the worker script, training its cells one after another in
one process group (launch cost dominates on 2 cores; tests/test_config_matrix.py does the same). The divergence
cell runs last: its fault stays installed in the worker process.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import cli_server
import pytest
import torch
from safetensors.torch import load_file

from conftest import cli_env, distaccum_cli, forked_torchrun
from distaccum.cluster.forked import leave
from distaccum.config import from_mapping
from distaccum.outer.sync import split_fragments
from distaccum.rundir import read_metrics
from distaccum.telemetry.summary import run_samples
from distaccum.verify.bugzoo import GPT

pytestmark = [
    pytest.mark.dist,
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:`torch.distributed.*is deprecated:FutureWarning"),
]

IN, WIDTH, OUT = 32, 16, 8
BASE: dict[str, Any] = {
    "model": {"_target_": "distaccum.models.MLP", "in_dim": IN, "width": WIDTH, "depth": 2, "out_dim": OUT},
    "data": {"dataset": {"_target_": "distaccum.datasets.SyntheticRegression", "num_samples": 128}},
    "loss": {"_target_": "distaccum.losses.mse", "_partial_": True},
    "accum": {"micro_batch": 2, "steps": 2},
    "precision": "fp64",
    "optim": {"clip_norm": None},
    "trainer": {"nproc": 2, "max_steps": 4, "device": "cpu"},
    "log": {"console": "quiet"},
}
NUMELS = [IN * WIDTH, WIDTH, WIDTH * WIDTH, WIDTH, WIDTH * OUT, OUT]
"""The MLP's parameter sizes, in order (what the fragments are cut from)."""
SGD = {"name": "sgd", "momentum": 0.0, "lr": 0.05, "clip_norm": None}
PLAIN_OUTER = {"lr": 1.0, "momentum": 0.0, "nesterov": False}
"""The outer SGD that only applies the averaged pseudo-gradient."""
FP64_ROUNDING = 1e-12
"""Relative: what separates two fp64 computations of the same math in another order (measured: below 1e-15)."""


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = (
            merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


def cell(name: str, root: Path, **sections: Any) -> dict[str, Any]:
    """BASE with ``sections`` merged in, writing to ``root/name``."""
    return {**merged(BASE, sections), "run_dir": str(root / name)}


CELLS: dict[str, dict[str, Any]] = {
    # (a) and (c)'s reference: one synchronous step over both ranks per optimizer step
    "sync": {"optim": SGD},
    # (a) DiLoCo H=1 over 2 islands of 1, plain SGD inside, plain outer SGD
    "diloco-h1": {
        "optim": SGD,
        "outer": {"method": "diloco", "every": 1, "islands": 2, **PLAIN_OUTER},
    },
    # (c) LocalSGD over one island of both ranks
    "one-island": {"optim": SGD, "outer": {"method": "local_sgd", "every": 2, "islands": 1}},
    # (b) DiLoCo with the plain outer SGD against LocalSGD: AdamW inside (its state kept per island), 2 fragments at
    # staggered offsets (fragment 0 after steps 1, 3; fragment 1 after 2, 4; both after 5)
    "diloco-plain": {
        "trainer": {"max_steps": 5},
        "outer": {"method": "diloco", "every": 2, "fragments": 2, "islands": 2, **PLAIN_OUTER},
    },
    "local-sgd": {
        "trainer": {"max_steps": 5},
        "outer": {"method": "local_sgd", "every": 2, "fragments": 2, "islands": 2},
    },
    # (e) bf16 across the islands: 2 bytes per element (fp32 parameters)
    "bf16-wire": {
        "precision": "fp32",
        "trainer": {"max_steps": 2},
        "outer": {"method": "local_sgd", "every": 2, "islands": 2, "reduce_dtype": "bf16"},
    },
    # (f) island 1's merge is off by 1e-3 (IslandOffset, installed for this cell only): stopped at the first sync
    "diverged": {"outer": {"method": "diloco", "every": 2, "islands": 2}},
}
FAULTY = "diverged"


class IslandOffset:
    """A fault for the ``outer`` point of the testing seam: island ``island``'s cross-island sum comes back off by
    ``delta``, so its merged parameters differ from every other island's.

    The seam hands over the real :class:`~distaccum.outer.sync.OuterSync`, whose :meth:`merge_if_due` calls
    ``self.reduce``: a proxy object around it would never see that call. So the fault wraps the real bound method
    on that one instance (an instance attribute shadows the class's method) and returns the instance itself."""

    def __init__(self, island: int = 1, delta: float = 1e-3) -> None:
        self.island, self.delta = island, delta

    def wrap(self, point: str, obj: Any) -> Any:
        if point != "outer" or obj.layout.index != self.island:
            return obj
        reduce = obj.reduce

        def off(flat: torch.Tensor) -> torch.Tensor:
            return reduce(flat) + self.delta

        obj.reduce = off
        return obj


# --- the 2-rank launch ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("outer")


@pytest.fixture(scope="module")
def launched(root: Path) -> dict[str, Any]:
    """Every cell trained one after another in one 2-rank process group; per rank, each cell's outcome."""
    plan = root / "plan.json"
    plan.write_text(json.dumps({name: cell(name, root, **sections) for name, sections in CELLS.items()}))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    proc = forked_torchrun(str(Path(__file__)), str(plan), nproc=2, cwd=root, env=env, timeout=240)
    if proc.returncode:
        pytest.fail(
            f"the outer cells crashed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    outcomes = [json.loads((root / f"outcomes-{rank}.json").read_text()) for rank in range(2)]
    return {"outcomes": outcomes, "stderr": proc.stderr}


def params(root: Path, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(root / name / "final" / "model.safetensors"))


def records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max |a - b| / max |b| over every tensor (the verify criterion's relative part)."""
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in a)


def trained(launched: dict[str, Any], name: str) -> None:
    for rank, outcome in enumerate(launched["outcomes"]):
        assert outcome[name] == "ok", f"rank {rank}: {outcome[name]}"


def test_diloco_with_h1_and_a_plain_outer_sgd_is_synchronous_sgd(
    root: Path, launched: dict[str, Any]
) -> None:
    trained(launched, "sync")
    trained(launched, "diloco-h1")
    diff = max_rel_diff(params(root, "diloco-h1"), params(root, "sync"))
    print(f"DiLoCo H=1 vs synchronous: final parameters max rel diff {diff:.3g}")
    assert diff <= FP64_ROUNDING
    # 2 islands of 1: every step syncs, its whole model in one all-reduce of fp64 elements
    for record in records(root / "diloco-h1"):
        assert (record["outer_synced"], record["comm_calls_outer"]) == (1, 1), record
        assert record["comm_bytes_outer"] == sum(NUMELS) * 8, record


def test_diloco_with_a_plain_outer_sgd_is_local_sgd(root: Path, launched: dict[str, Any]) -> None:
    trained(launched, "diloco-plain")
    trained(launched, "local-sgd")
    diff = max_rel_diff(params(root, "diloco-plain"), params(root, "local-sgd"))
    diloco, local = records(root / "diloco-plain"), records(root / "local-sgd")
    assert [r["step"] for r in diloco] == [r["step"] for r in local] == [1, 2, 3, 4, 5]
    losses = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(diloco, local, strict=True))
    print(
        f"DiLoCo (lr 1, no momentum) vs LocalSGD: final parameters {diff:.3g}, losses {losses:.3g} (max rel)"
    )
    assert diff <= FP64_ROUNDING and losses <= FP64_ROUNDING
    # both at the same staggered syncs, one all-reduce of the fragment (2 islands of 1 rank: no slices)
    fragments = split_fragments(NUMELS, 2)
    size = [sum(NUMELS[i] for i in f) for f in fragments]
    expected = {1: [0], 2: [1], 3: [0], 4: [1], 5: [0, 1]}
    for run in (diloco, local):
        for record in run:
            due = expected[record["step"]]
            assert record["outer_synced"] == record["comm_calls_outer"] == len(due), record
            assert record["comm_bytes_outer"] == sum(size[p] for p in due) * 8, record


def test_one_island_is_plain_training(root: Path, launched: dict[str, Any]) -> None:
    trained(launched, "sync")
    trained(launched, "one-island")
    island, sync = params(root, "one-island"), params(root, "sync")
    diff = max_rel_diff(island, sync)
    print(f"one island (LocalSGD) vs plain: final parameters max rel diff {diff:.3g}")
    assert all(torch.equal(island[k], sync[k]) for k in sync), (
        diff
    )  # bitwise: merging one island is the identity
    run = records(root / "one-island")
    assert [r["loss"] for r in run] == [r["loss"] for r in records(root / "sync")]
    assert [r["outer_synced"] for r in run] == [0, 1, 0, 1]  # the outer step ran (H=2), merging one island


def test_bf16_across_the_islands_sends_two_bytes_per_element(root: Path, launched: dict[str, Any]) -> None:
    trained(launched, "bf16-wire")
    first, second = records(root / "bf16-wire")
    assert (first["comm_calls_outer"], first["comm_bytes_outer"]) == (0, 0)
    # half of the 4 bytes an fp32 element takes without outer.reduce_dtype=bf16
    assert (second["comm_calls_outer"], second["comm_bytes_outer"]) == (1, sum(NUMELS) * 2)


def test_an_island_that_merged_other_numbers_stops_the_run_naming_it(
    root: Path, launched: dict[str, Any]
) -> None:
    for rank, outcome in enumerate(launched["outcomes"]):  # every rank stops at the same check
        message = outcome[FAULTY]
        assert message.startswith("OuterDivergenceError: after the outer sync of step 2"), (rank, message)
        assert "island(s) 1 disagree with island 0" in message, (rank, message)
    assert "island(s) 1 disagree with island 0" in launched["stderr"]
    run_dir = root / FAULTY
    assert [r["step"] for r in records(run_dir)] == [1]  # stopped before step 2's record, nothing trained on
    assert not (run_dir / "final").exists()
    for rank in range(2):  # what the rank files say about the failure
        info = json.loads((run_dir / "ranks" / f"rank-{rank:05d}.json").read_text())
        assert info["state"] == "failed" and "island(s) 1" in info["error"], info


# --- distaccum verify with 2 islands of 2 ranks ---------------------------------------------------------


def verified(root: Path, **sections: Any) -> list[dict[str, Any]]:
    """``distaccum verify`` (the Python API, in a command forked from the tests' server: tests/fixtures/api_verify.py)
    of BASE with ``sections`` on 4 ranks; the candidate's records."""
    config = merged(merged(BASE, {"trainer": {"nproc": 4}}), {**sections, "run_dir": str(root)})
    config_file, out = root.parent / "verify-config.json", root.parent / "verify-result.json"
    config_file.write_text(json.dumps(config))
    script = Path(__file__).parent / "fixtures" / "api_verify.py"
    proc = cli_server.run(
        [str(script), str(config_file), str(out)], cwd=root.parent, env=cli_env(), timeout=600, kind="script"
    )
    assert proc.returncode == 0 and out.is_file(), proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(out.read_text())
    text = result["text"]
    assert result["passed"], text
    [row] = result["rows"]
    assert row["world_size"] == 4, text
    print(text)
    return records(root / row["label"])


def test_verify_passes_ddp_inside_two_islands_and_the_ledger_counts_each_fragment_once(
    tmp_path: Path,
) -> None:
    """DiLoCo (outer Nesterov by default), H=4 in 2 fragments, 2 islands of 2 DDP ranks, fp64."""
    outer = {"method": "diloco", "every": 4, "fragments": 2, "islands": 2}
    run = verified(tmp_path, trainer={"max_steps": 6}, outer=outer)
    # Fragment 0 syncs after step 2, fragment 1 after 4, both after the last (6). Each syncing fragment is
    # ONE all-reduce across the islands, of this rank's 1/2 slice of it (rounded up), in fp64; nothing else
    # crosses between islands, and there is no HSDP replicate reduction.
    slices = [math.ceil(sum(NUMELS[i] for i in frag) / 2) * 8 for frag in split_fragments(NUMELS, 2)]
    expected = {2: [0], 4: [1], 6: [0, 1]}
    assert [r["step"] for r in run] == list(range(1, 7))
    for record in run:
        due = expected.get(record["step"], [])
        assert record["outer_synced"] == record["comm_calls_outer"] == len(due), record
        assert record["comm_bytes_outer"] == sum(slices[p] for p in due), record
        assert record["comm_calls_replicate"] == 0, record
        # inside the island: the gradient's all-reduce, the whole model once per step, sync or not
        assert record["comm_bytes"] == sum(NUMELS) * 8, record


def test_verify_passes_fsdp2_inside_two_islands(tmp_path: Path) -> None:
    """DiLoCo with the default outer SGD (lr 0.7, Nesterov momentum 0.9), H=3, 2 islands of 2 FSDP2 ranks, fp32."""
    outer = {"method": "diloco", "every": 3, "islands": 2}
    run = verified(tmp_path, engine={"name": "fsdp"}, precision="fp32", trainer={"max_steps": 7}, outer=outer)
    # Syncs after steps 3, 6 and the last (7): each rank all-reduces its own shards (rank 0: the first half of
    # each parameter's rows), 4 bytes per element.
    shapes = [(WIDTH, IN), (WIDTH,), (WIDTH, WIDTH), (WIDTH,), (OUT, WIDTH), (OUT,)]
    shard = sum(math.ceil(s[0] / 2) * math.prod(s[1:]) for s in shapes) * 4
    for record in run:
        syncs = record["step"] in (3, 6, 7)
        assert record["outer_synced"] == record["comm_calls_outer"] == int(syncs), record
        assert record["comm_bytes_outer"] == (shard if syncs else 0), record
        assert record["comm_calls_replicate"] == 0, record


# --- the token-weighted merge on variable-length text (issue 58) ----------------------------------------------

TEXT = merged(
    GPT,  # the bug zoo's tiny_gpt on padded variable-length text, with lengths of its own
    {
        "data": {"dataset": {"num_samples": 32, "seq_min": 2, "seq_max": 30}},
        "accum": {"micro_batch": 2, "steps": 2},
        "precision": "fp64",
        "trainer": {"nproc": 2, "max_steps": 4, "device": "cpu"},
        "log": {"console": "quiet"},
    },
)
"""Variable-length byte sequences (2-30 tokens, every one a loss item) on 2 islands of 1 rank, 4 samples each a
step, merged after steps 2 and 4: the islands' token counts differ (121 and 159 before the first merge), so their
weights n_i / sum_j n_j are not 1/2."""


def island_tokens(cfg: Any, split: Any, steps: range) -> list[int]:
    """Each island's loss items over ``steps`` (0-based), from the data order: the sequences' lengths."""
    from distaccum.data.global_batch import GlobalBatchOrder
    from distaccum.datasets import CorpusSequences
    from distaccum.outer.islands import IslandLayout
    from distaccum.outer.simulate import island_indices

    kwargs = {k: v for k, v in TEXT["data"]["dataset"].items() if k != "_target_"}
    lengths = CorpusSequences(**kwargs).lengths
    plan = GlobalBatchOrder(
        len(lengths),
        split.global_batch,
        seed=cfg.trainer.seed,
        shuffle=cfg.data.shuffle,
        drop_last=cfg.data.drop_last,
    )
    layout = IslandLayout.of(split.world_size, 0, 2)
    return [
        sum(int(lengths[j]) for step in steps for j in island_indices(plan, step, split, layout, i))
        for i in range(2)
    ]


@pytest.mark.parametrize("method", ["diloco", "local_sgd"])
def test_verify_holds_the_merge_to_the_islands_token_counts_on_variable_length_text(
    tmp_path: Path, method: str
) -> None:
    """Issue 58: ``distaccum verify`` of an outer-synced run whose islands trained on different numbers of tokens.
    The merge must weigh island i by n_i / sum_j n_j; the simulator does, so a run that weighed the islands equally
    (the loop handing the outer step 1.0 instead of the step's item count) fails here at the first sync. The same
    launch shows the data make the test able to fail: the counts differ, and the simulator itself with
    outer.weighting=equal (in this process, no launch) is over verify's tolerance at the first sync."""
    from distaccum.config import from_mapping
    from distaccum.outer.simulate import run_outer_reference
    from distaccum.preflight import instantiate_components
    from distaccum.rundir import SEED
    from distaccum.verify import verify
    from distaccum.verify.compare import RunData, compare, tolerance_for

    config = merged(TEXT, {"outer": {"method": method, "every": 2, "islands": 2}, "run_dir": str(tmp_path)})
    lines: list[str] = []
    result = verify(config, echo=lines.append)
    text = "\n".join(lines)
    print(text)
    [row] = result.rows
    cfg, split = from_mapping(config), row.run.split
    tokens = island_tokens(cfg, split, range(2))
    print(
        f"islands' tokens before the first sync: {tokens} (token weights {[n / sum(tokens) for n in tokens]})"
    )
    assert result.passed, text
    assert split.world_size == 2 and [r["outer_synced"] for r in records(row.run.data.run_dir)] == [
        0,
        1,
        0,
        1,
    ]
    assert abs(tokens[0] - tokens[1]) >= 0.1 * sum(tokens), tokens  # weights at least 0.55 / 0.45 apart
    # The power of this test: the same run merged with equal weights differs from it past verify's tolerance.
    equal = from_mapping(
        merged(
            config,
            {
                "outer": {"weighting": "equal"},
                "trainer": {"init_from": str(tmp_path / SEED)},
                "run_dir": str(tmp_path / "equal"),
            },
        )
    )
    run_outer_reference(equal, instantiate_components(equal), tmp_path / "equal", split=split)
    tol = tolerance_for(cfg.precision, cfg.verify)
    report = compare(RunData.load(tmp_path / "reference"), RunData.load(tmp_path / "equal"), tol)
    d = report.first_divergence
    print(f"equal weights against the token-weighted simulator: first divergence {d}")
    assert not report.passed and d is not None and (d.step, d.quantity) == (2, "parameter"), report


# --- the worker -------------------------------------------------------------------------------------------


def _worker_main(plan_file: str) -> None:
    """Worker entry (under torch.distributed.run): train each cell, FAULTY last with :class:`IslandOffset`
    installed; write this rank's outcomes (``ok`` or the error's first line); then leave like the CLI's workers."""
    import torch.distributed as dist

    from distaccum import testing
    from distaccum.preflight import instantiate_components
    from distaccum.rundir.liveness import short_error
    from distaccum.runtime.contracts import DistEnv
    from distaccum.runtime.procgroup import ensure_process_group, shutdown
    from distaccum.trainer import Trainer

    code, outcomes, name = 0, {}, "?"
    plan = json.loads(Path(plan_file).read_text())
    try:
        ensure_process_group(DistEnv.from_environ(os.environ), torch.device("cpu"))
        for name, values in plan.items():
            cfg = from_mapping(values)
            parts = instantiate_components(cfg)
            if name == FAULTY:
                testing.install(IslandOffset(island=1))
            try:
                Trainer(
                    cfg, model=parts.model, dataset=parts.dataset, loss=parts.loss, names=parts.names
                ).fit()
                outcomes[name] = "ok"
            except Exception as err:
                if name != FAULTY:
                    raise
                traceback.print_exc()  # what a CLI worker prints
                outcomes[name] = short_error(err)
        Path(plan_file).with_name(f"outcomes-{dist.get_rank()}.json").write_text(json.dumps(outcomes))
    except BaseException:  # noqa: BLE001 - report, then exit non-zero so the test shows it
        print(f"outer cell {name} crashed:", file=sys.stderr)
        traceback.print_exc()
        code = 1
    shutdown(clean=code == 0)
    sys.stdout.flush()
    sys.stderr.flush()
    leave(code)  # os._exit, except a forked rank that succeeded returns to torch's launcher


if __name__ == "__main__":
    _worker_main(sys.argv[1])


@pytest.mark.dist
def test_the_console_shows_what_the_outer_sync_sends_and_saves(tmp_path: Path) -> None:
    """Issue 56.4: a DiLoCo run's console read `reduced 26.5KiB in 1 call` on every step, sync steps included, had no
    outer figure in its done line, showed island 0's loss unlabelled, and listed the islands three times in two
    vocabularies (island, replica)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    argv = [
        "model=mlp",
        "outer.method=diloco",
        "outer.every=2",
        "trainer.max_steps=4",
        f"run_dir={tmp_path / 'dl'}",
    ]
    run = distaccum_cli(["train", *argv], cwd=tmp_path, env=env, timeout=180)  # the console as a user sees it
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    steps = [line for line in run.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 4 and all("loss (island 0)" in line and "in the island" in line for line in steps)
    assert ["outer sync of 1 fragment" in line for line in steps] == [False, True, False, True]
    summary = json.loads((tmp_path / "dl" / "summary.json").read_text())["outer"]
    assert f"{summary['syncs']} fragment syncs sent" in run.stdout
    assert f"{summary['reduction_factor']:.1f}x less than a synchronous run's" in run.stdout
    assert (
        "replica 0: ranks" not in run.stdout and run.stdout.count("island 0: ranks 0") == 2
    )  # plan, placement
    # Issue 58.4: rank 0's record counted the step's samples over both islands but island 0's items. Now both are
    # island 0's (mse: one loss item per sample), and `run_samples` counts both islands' (32 = 2 islands x 16).
    records = read_metrics(tmp_path / "dl")
    assert [(r["samples"], r["items"], r["run_samples"], r["global_batch"]) for r in records] == [
        (16, 16, 32, 32)
    ] * 4
    assert all(r["run_samples_per_s"] == pytest.approx(2 * r["samples_per_s"]) for r in records)
    done = json.loads((tmp_path / "dl" / "summary.json").read_text())
    assert done["samples_per_s"] == pytest.approx(
        sum(map(run_samples, records)) / sum(r["time_s"] for r in records)
    )
