"""Issue 57: "replica" names HSDP's replica only, "island" an outer sync's group. The old spellings of the outer
sync's config key (``outer.replicas``) and plan flags (``--outer-replicas``, ``--replica-link-*``) are read for one
release, each saying what to write instead; a checkpoint's record with the old key compares under the new one.
(The end-to-end resume of a checkpoint with ``replica-N`` folders: tests/test_faults.py.)"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from distaccum.cli import compose
from distaccum.cli.plan import plan_main
from distaccum.config import from_mapping
from distaccum.engines.base import EngineSpec
from distaccum.outer.config import renamed_keys
from distaccum.rundir.changes import REFUSED, classify

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _fresh_notes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compose, "_SAID", set())  # each test sees its own once-per-process lines


def test_old_outer_replicas_override_is_read_as_outer_islands_and_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cfg = compose.compose_config(["outer.method=local_sgd", "outer.replicas=2", "trainer.device=cpu"])
    assert cfg.outer.islands == 2
    err = capsys.readouterr().err
    said = "distaccum: outer.replicas is now outer.islands: write outer.islands=2 (the old key is accepted for one"
    assert err.count(said) == 1, err
    compose.compose_config(
        ["outer.method=local_sgd", "outer.replicas=2"]
    )  # the pre-check, then the app: one line
    assert said not in capsys.readouterr().err


def test_without_the_old_key_nothing_is_said(capsys: pytest.CaptureFixture[str]) -> None:
    assert compose.compose_config(["outer.method=local_sgd", "outer.islands=2"]).outer.islands == 2
    assert "outer.replicas" not in capsys.readouterr().err


def test_an_old_config_mapping_reads_outer_replicas_as_islands() -> None:
    """A run's config.json (or a plan's payload) written with the old key."""
    assert from_mapping({"outer": {"method": "diloco", "replicas": 4}}).outer.islands == 4
    values, notes = renamed_keys(
        {"outer": {"replicas": None, "every": 3}}
    )  # the composed defaults' empty slot
    assert values == {"outer": {"every": 3}} and notes == []


def test_a_checkpoint_record_with_outer_replicas_compares_as_outer_islands() -> None:
    saved = {"outer.replicas": 2, "outer.method": "diloco"}
    assert classify(saved, {"outer.islands": 2, "outer.method": "diloco"}) == []
    [change] = classify(saved, {"outer.islands": 4, "outer.method": "diloco"})
    assert (change.key, change.saved, change.now, change.kind) == ("outer.islands", 2, 4, REFUSED)


CLUSTER = ["--nodes", "4", "--gpus-per-node", "8", "--compute-ms", "120", "--params", "8e9"]
SPLIT = ["accum.global_batch=1024", "accum.micro_batch=4"]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (["--outer-replicas", "2"], ["--islands", "2"]),
        (["--replica-link-latency-ms", "5"], ["--island-link-latency-ms", "5"]),
    ],
)
def test_old_plan_flags_work_and_say_the_new_spelling(
    old: list[str], new: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert plan_main([*CLUSTER, "--island-link-gbps", "1", *new, *SPLIT]) == 0
    expected = capsys.readouterr().out
    assert plan_main([*CLUSTER, "--island-link-gbps", "1", *old, *SPLIT]) == 0
    captured = capsys.readouterr()
    assert captured.out == expected
    assert f"distaccum: {old[0]} is now {new[0]}: write {new[0]} " in captured.err


def test_old_link_flag_works(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_main([*CLUSTER, "--replica-link-gbps", "1", *SPLIT]) == 0
    captured = capsys.readouterr()
    assert "islands" in captured.out and "--replica-link-gbps is now --island-link-gbps" in captured.err


def test_an_islands_state_is_read_from_its_old_folder_when_only_that_exists(tmp_path: Path) -> None:
    spec = SimpleNamespace(islands=SimpleNamespace(layout=SimpleNamespace(index=1)))
    state_dir = EngineSpec.state_dir
    assert state_dir(spec, tmp_path) == tmp_path / "island-1"  # type: ignore[arg-type]  # a new checkpoint
    (tmp_path / "replica-1").mkdir()
    assert state_dir(spec, tmp_path) == tmp_path / "replica-1"  # type: ignore[arg-type]  # written before the rename
    (tmp_path / "island-1").mkdir()
    assert state_dir(spec, tmp_path) == tmp_path / "island-1"  # type: ignore[arg-type]
