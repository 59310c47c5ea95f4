"""The launcher registry (distaccum.cluster.LAUNCHERS): every entry renders its dry run without a cluster, and
`distaccum submit --to` / `distaccum verify --to` offer what the registry's classes say they can do, so a new
launcher is one module and one registry line."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from conftest import requires
from distaccum.cluster import LAUNCHERS, launcher_class, launchers, train_launcher
from distaccum.cluster.base import Launcher, Submitted, World
from distaccum.config import RunConfig, from_mapping

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name", list(LAUNCHERS))
def test_every_launcher_renders_its_dry_run_without_a_cluster(name: str, tmp_path: Path) -> None:
    if name == "kubeflow":
        requires("kubeflow_trainer_api.models")
    launcher = launcher_class(name)
    assert (
        launcher.name == name
        and launcher.summary
        and (launcher.submits or launcher.verifies or launcher.trains)
    ), name
    cfg = from_mapping({"run_dir": str(tmp_path / "run"), "kubeflow": {"mount_path": str(tmp_path)}})
    world = launcher.world(cfg)
    assert world.ranks >= world.nodes >= 1
    text = launcher.render(cfg, ["model=mlp"])
    assert text.endswith("\n") and len(text.splitlines()) >= 1, name
    assert not (tmp_path / "run").exists(), f"{name}'s dry run wrote {tmp_path / 'run'}"
    if launcher.section is not None:
        key, cls = launcher.section
        assert isinstance(getattr(cfg, key), cls), name


def test_submit_and_verify_offer_the_launchers_that_can() -> None:
    assert [c.name for c in launchers(submits=True)] == ["slurm", "kubeflow", "ray"]
    assert [c.name for c in launchers(verifies=True)] == ["local", "ray"]
    with pytest.raises(ValueError, match="not one of local, slurm, kubeflow, ray, ft"):
        launcher_class("pbs")


def test_train_starts_a_feature_launch_through_the_registry(tmp_path: Path) -> None:
    """`distaccum train` asks TRAINS' launchers first: ft.groups gets the Lighthouse and the groups, the rest torch
    elastic; the entry layer names neither."""
    requires("torchft")
    base = {
        "run_dir": str(tmp_path / "run"),
        "trainer": {"nproc": 1},
        "accum": {"global_batch": 24, "micro_batch": 2},
    }
    assert train_launcher(from_mapping(base)).name == "local"
    cfg = from_mapping({**base, "ft": {"groups": 3, "min_groups": 2, "heartbeat_timeout_ms": 700}})
    launcher = train_launcher(cfg)
    assert launcher.name == "ft" and launcher.world(cfg) == World(3, 1)
    assert launcher.train_lines(cfg, tmp_path / "c.json") == [
        "ft: 24 samples per step in micro-batches of 2 over 3 groups of 1 rank(s): K=4 with 3, K=6 with 2 group(s) "
        "present"
    ]
    text = launcher.render(cfg, [])
    assert (
        "torchft_lighthouse '--bind=[::]:0' --min_replicas=2" in text and "--heartbeat_timeout_ms=700" in text
    )
    assert [line.split()[0] for line in text.splitlines()[2:]] == [f"REPLICA_GROUP_ID={i}" for i in range(3)]


class EchoLauncher(Launcher):
    """A launcher a test registers: its dry run names the config's world."""

    name = "echo"
    summary = "a test's own target"
    submits = True

    @staticmethod
    def world(cfg: RunConfig) -> World:
        return World(2, 1)

    @staticmethod
    def render(cfg: RunConfig, overrides: Sequence[str]) -> str:
        return f"echo: world 2, {' '.join(overrides)}\n"

    @staticmethod
    def submit(cfg: RunConfig, overrides: Sequence[str]) -> Submitted:
        return Submitted("job-1", "submitted to echo")


def test_a_registered_launcher_is_a_target_of_submit_with_no_other_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from distaccum.cli.submit import submit_main

    monkeypatch.setitem(LAUNCHERS, "echo", f"{__name__}:EchoLauncher")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        submit_main(["--help"])
    assert "  echo      a test's own target" in capsys.readouterr().out
    assert submit_main(["--to", "echo", "--dry-run", "model=mlp", "run_dir=exp"]) == 0
    assert capsys.readouterr().out == "echo: world 2, model=mlp run_dir=exp\n"
    assert submit_main(["--to", "echo", "model=mlp", "run_dir=exp"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "job-1\n" and "distaccum: submitted to echo" in captured.err
