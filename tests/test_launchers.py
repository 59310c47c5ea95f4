"""The launcher registry (distaccum.cluster.LAUNCHERS): every entry renders its dry run without a cluster, and
`distaccum submit --to` / `distaccum verify --to` offer what the registry's classes say they can do, so a new
launcher is one module and one registry line."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from conftest import requires
from distaccum.cluster import LAUNCHERS, launcher_class, launchers
from distaccum.cluster.base import Launcher, Submitted, World
from distaccum.config import RunConfig, from_mapping

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name", list(LAUNCHERS))
def test_every_launcher_renders_its_dry_run_without_a_cluster(name: str, tmp_path: Path) -> None:
    if name == "kubeflow":
        requires("kubeflow_trainer_api.models")
    launcher = launcher_class(name)
    assert launcher.name == name and launcher.summary and (launcher.submits or launcher.verifies), name
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
    with pytest.raises(ValueError, match="not one of local, slurm, kubeflow, ray"):
        launcher_class("pbs")


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
