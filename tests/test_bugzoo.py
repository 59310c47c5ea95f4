"""`distaccum bugzoo` end to end: every bug of the zoo (issue 23's accumulation bugs, the ones peers shipped in
2025–26 (issue 46), the skipped reductions of the sharded engines and the outer-sync bugs) injected into real
2-rank runs (one shared launch), each verified against the plain reference or the outer simulator; what caught it,
and whether its diagnosis is right; and the controls.

One CLI invocation (the fixture) feeds every test. The thresholds are what the zoo does today, so that a bug it
stops catching fails here (every bug of BUGS in the table, every one caught, all but one diagnosed as its cause:
ZeRO-3's per-micro-batch transform is caught by the reduction checksum but not diagnosed as a transform); the table
in the README must be the one this run prints (it has no timings: the same code gives the same table), so a change
in what the zoo finds shows up as a README diff.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from conftest import REPO, distaccum_cli
from distaccum.verify.bugzoo import BUGS, CONFIGS, Row, render

pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]

ISSUE_BUGS = (
    "loss/K with variable-length items",
    "the mean-per-micro-batch normalisation",
    "no_sync on the wrong micro-batch",
    "a rank that skips the reduction",
    "static_graph=True with no_sync",
    "loss scaled twice (DeepSpeed)",
    "partial window scaled by K",
    "scheduler stepped per micro-batch",
    "clipping per micro-batch",
    "GradScaler updated per micro-batch",
    "gradients not zeroed between windows",
    "gradients wiped mid-window",
    "BatchNorm statistics per micro-batch",
    "dropout RNG shared across ranks",
    "every rank reading the same samples",
)
"""The bugs issue 23 lists, in its words."""

PEER_BUGS = {
    "no_sync_backward_only": "no_sync around the backward only",
    "fsdp2_no_sync_noop": "a no_sync helper that does nothing under FSDP2",
    "nested_ddp": "nested DDP wrappers",
    "sync_first_micro": "sync on the first micro-batch, not the last",
    "zero3_transform_per_micro": "an optimizer transform per micro-batch (ZeRO-3)",
    "deepspeed_default_clipping": "DeepSpeed's gradient_clipping default (1.0)",
}
"""The bugs peers shipped in 2025–26 that issue 46 lists (LoongForge #163, cosmos-framework #161, torchrec #4121,
FunASR #3472, DeepSpeed #8443 and #8068): name -> title."""


@pytest.fixture(scope="module")
def zoo() -> Iterator[tuple[subprocess.CompletedProcess, list[dict[str, Any]]]]:
    """The README's exact command, ``distaccum bugzoo``, from the repository root (DeepSpeed's compiled op is cached
    in .cache/torch_extensions there): its default run_dir is relative, ``runs/bugzoo-<time>`` (issue 56: a relative
    run_dir once made every row fail)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    before = set((REPO / "runs").glob("bugzoo-*"))
    run = distaccum_cli(["bugzoo"], cwd=REPO, env=env, timeout=380)
    made = sorted(set((REPO / "runs").glob("bugzoo-*")) - before)
    try:
        assert len(made) == 1 and (made[0] / "bugzoo.json").is_file(), run.stdout[-3000:] + run.stderr[-3000:]
        assert f"-> runs/{made[0].name}" in run.stdout  # the relative run_dir it was given
        yield run, json.loads((made[0] / "bugzoo.json").read_text())
    finally:
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)


Zoo = tuple[subprocess.CompletedProcess, list[dict[str, Any]]]


def test_every_bug_the_issue_lists_is_in_the_table_and_enough_are_caught(zoo: Zoo) -> None:
    run, rows = zoo
    bugs = [r for r in rows if not r["control"]]
    titles = [r["title"] for r in bugs]
    assert titles[: len(ISSUE_BUGS)] == list(ISSUE_BUGS) and set(PEER_BUGS.values()) <= set(titles)
    assert titles == [b.title for b in BUGS if not b.control]
    for r in rows:
        assert {"bug", "caught", "caught_by", "step", "diagnosis", "diagnosis_correct"} <= set(r)
        assert isinstance(r["caught"], bool) and isinstance(r["diagnosis_correct"], bool)
        assert r["caught"] == bool(r["runtime"] or not r["verify"]["passed"])
    caught, right = sum(r["caught"] for r in bugs), sum(r["diagnosis_correct"] for r in bugs)
    assert caught == len(bugs) and right >= len(bugs) - 1, (caught, right, len(bugs))
    assert f"{caught}/{len(bugs)} bugs caught, {right}/{len(bugs)} diagnosed as their cause" in run.stdout
    assert run.returncode == (0 if caught == len(bugs) else 1), run.stderr[-3000:]


def test_the_2025_26_bugs_are_caught_at_their_first_bad_step_and_diagnosed(zoo: Zoo) -> None:
    rows = {r["bug"]: r for r in zoo[1]}
    zero3 = rows["zero3_transform_per_micro"]
    checksum = [r for r in zero3["runtime"] if r["check"] == "fingerprint"]
    for name in PEER_BUGS:
        row = rows[name]
        assert row["caught"] and row["step"] == 1, row
        assert row["diagnosis_correct"] or (row is zero3 and checksum), row
    # Extra reductions: the reduction count warns at step 1 (4 reducing micro-batches where boundary promises 1).
    for name in ("no_sync_backward_only", "fsdp2_no_sync_noop", "nested_ddp"):
        [count] = [r for r in rows[name]["runtime"] if r["check"] == "warning:reduction_count"]
        assert count["step"] == 1 and "4 of the window's micro-batches reduced gradients" in count["message"]
    # FSDP2 sums fresh reduce-scatters: the sum is right to rounding, but it rounds like K reductions, which the
    # reduction checksum (held to one reduction's rounding) stops at step 1; the count names the cause
    [stop] = [r for r in rows["fsdp2_no_sync_noop"]["runtime"] if r["check"] == "fingerprint"]
    assert stop["step"] == 1 and "is 1 x what the ranks' local gradients add up to" in stop["message"]
    assert rows["fsdp2_no_sync_noop"]["diagnosis"] == "reduction_count"
    # DDP sums in its hook: an extra all-reduce corrupts the gradient as well
    assert (
        rows["no_sync_backward_only"]["verify"]["quantity"]
        == rows["nested_ddp"]["verify"]["quantity"]
        == "grad_norm"
    )
    [first] = rows["sync_first_micro"]["runtime"]
    assert (first["check"], first["step"]) == ("fingerprint", 1)
    [failed] = rows["deepspeed_default_clipping"]["runtime"]
    assert failed["check"] == "run_failed" and "gradient_clipping is 1.0" in failed["message"]
    if (
        checksum
    ):  # ZeRO-3's reduction checksum: the reduced partitions are not what the local gradients add up to
        assert checksum[0]["step"] == 1 and "reduction checksum" in checksum[0]["message"]
    else:  # the run completes: verify's replay names the clip after every micro-batch's reduction
        assert zero3["verify"]["quantity"] == "grad_norm" and zero3["diagnosis"] == "clipping"


OUTER_BUGS = {
    "outer_sign_flipped": "DiLoCo pseudo-gradient with the wrong sign",
    "outer_sum_as_mean": "the islands' SUM used as their mean (DiLoCo)",
}
"""The outer-sync bugs peers shipped (torchft #233 / torchtitan #1507, torchft #286): name -> title."""


def test_the_outer_sync_bugs_are_caught_by_verify_at_the_first_outer_step_and_diagnosed(zoo: Zoo) -> None:
    rows = {r["bug"]: r for r in zoo[1]}
    first_sync = CONFIGS["gpt_diloco"]["outer"]["every"]  # H: one fragment, so its first sync is after step H
    for name, title in OUTER_BUGS.items():
        row = rows[name]
        assert row["title"] == title and row["caught"] and row["step"] == first_sync, row
        # every island is wrong alike: no runtime check can tell, the simulator can
        assert not row["runtime"] and row["caught_by"] == [f"verify: step {first_sync} parameter"], row
        assert row["diagnosis"] == name and row["diagnosis_correct"], row
    assert "-1 times as far" in rows["outer_sign_flipped"]["diagnosis_message"]
    assert "2 times as far" in rows["outer_sum_as_mean"]["diagnosis_message"]


def test_the_controls_stay_clean(zoo: Zoo) -> None:
    controls = {r["bug"]: r for r in zoo[1] if r["control"]}
    assert set(controls) == {"control", "control_outer", "control_dropout"}
    for name in ("control", "control_outer"):  # the plain reference; the outer simulator (issue 58)
        assert controls[name]["verify"]["passed"] and not controls[name]["caught"], controls[name]
        assert controls[name]["diagnosis"] is None and controls[name]["diagnosis_correct"], controls[name]
    assert not any(c["runtime"] for c in controls.values())
    # verify alone fails any dropout run (the split changes the masks): only the seed check tells
    # a shared seed from independent ones
    assert controls["control_dropout"]["diagnosis"] == "randomness"


def test_a_broken_reduction_is_stopped_by_the_fingerprint_at_step_1(zoo: Zoo) -> None:
    rows = {r["bug"]: r for r in zoo[1]}
    for name in ("skipped_reduction", "no_sync_wrong_micro"):
        [first] = rows[name]["runtime"]
        assert (first["check"], first["step"]) == ("fingerprint", 1), rows[name]
        assert rows[name]["verify"]["quantity"] == "ranks" and rows[name]["diagnosis"] == "rank_divergence"
    for name, check in (("same_samples", "warning:same_samples"), ("dropout_rng_shared", "warning:same_rng")):
        assert [r["check"] for r in rows[name]["runtime"]] == [check] and rows[name]["step"] == 1


def test_the_readme_shows_this_table(zoo: Zoo) -> None:
    readme = (REPO / "README.md").read_text()
    block = re.search(r"<!-- bugzoo:begin.*?-->\n(.*?)<!-- bugzoo:end -->", readme, re.S)
    assert block, "README.md has no bugzoo section"
    rows = [Row(**r) for r in zoo[1]]
    assert render(rows) in block.group(1)
    assert "distaccum bugzoo" in block.group(1)
    assert len(rows) == len(BUGS)
