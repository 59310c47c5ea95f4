"""The console script's argv handling, without running anything: one command form everywhere
(``run_dir=DIR``) and ``--help`` texts a terminal can print (no reStructuredText markup)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from conftest import REPO
from distaccum.cli import main
from distaccum.cli.bugzoo import parse_args
from distaccum.cli.helptext import plain_text

pytestmark = pytest.mark.unit

MARKUP = re.compile(r":[a-z]+(?::[a-z]+)?:`|``")


def test_plain_text_drops_roles_and_inline_literals() -> None:
    text = plain_text("see :mod:`distaccum.verify.bugzoo`, :func:`~a.b` and ``DIR/bugzoo.json``")
    assert text == "see distaccum.verify.bugzoo, a.b and DIR/bugzoo.json"


def test_bugzoo_takes_run_dir_as_an_override_like_every_command() -> None:
    assert parse_args(["run_dir=/tmp/zoo"]).run_dir == Path("/tmp/zoo")
    assert parse_args(["--run-dir", "/tmp/zoo"]).run_dir == Path("/tmp/zoo")
    assert parse_args(["--run-dir", "/tmp/zoo", "run_dir=/tmp/zoo"]).run_dir == Path("/tmp/zoo")
    opts = parse_args(["--only", "same_samples,clip_per_micro", "run_dir=/tmp/zoo"])
    assert (opts.only, opts.run_dir, opts.list) == ("same_samples,clip_per_micro", Path("/tmp/zoo"), False)
    assert parse_args([]).run_dir is None and parse_args(["--list"]).list


@pytest.mark.parametrize(
    "argv",
    [["accum.micro_batch=4"], ["run_dir="], ["zoo"], ["run_dir=a", "--run-dir", "b"]],
    ids=["other key", "empty", "bare word", "two dirs"],
)
def test_bugzoo_refuses_other_arguments_naming_the_accepted_form(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stop:
        parse_args(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "run_dir=DIR" in err or "two run directories" in err


def test_the_documented_bugzoo_commands_parse() -> None:
    lines = [
        line.split(" #")[0].split()
        for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(encoding="utf-8"), re.S)
        for line in block.splitlines()
        if line.startswith("distaccum bugzoo")
    ]
    assert lines
    for line in lines:
        parse_args(shlex.split(" ".join(line[2:])))


@pytest.mark.parametrize(
    "argv",
    [["plan", "--help"], ["bugzoo", "--help"], ["report", "--help"], ["submit", "--help"]]
    + [["verify", "--script=train.py", "--help"], ["verify", "--help"], ["verify", "model=mlp", "-h"]],
    ids=["plan", "bugzoo", "report", "submit", "verify --script", "verify", "verify with overrides"],
)
def test_help_has_no_restructuredtext_markup(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # `distaccum train --help` is Hydra's, from configs/config.yaml.
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: distaccum"), text[:200]
    assert not MARKUP.search(text), MARKUP.search(text)


def test_verify_and_submit_help_describe_their_own_command(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 56.6: `verify --help` printed train's Hydra help; `submit --help` named neither the cluster keys nor
    docs/clusters.md. Each key is listed with its default, from the config dataclass."""
    for argv in (["verify", "--help"], ["submit", "--help"]):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 0
    verify_text, submit_text = capsys.readouterr().out.split("usage: distaccum submit")
    assert "verify.splits (config): config: only the configured split" in verify_text
    assert "--to local|ray" in verify_text and "exit codes: 0" in verify_text
    assert "docs/verification.md" in verify_text and "Trains the configured model" not in verify_text
    for key in (
        "slurm.nodes (1)",
        "slurm.gpus_per_node (0)",
        "kubeflow.name (distaccum)",
        "ray.address (null)",
    ):
        assert key in submit_text, key
    assert "docs/clusters.md" in submit_text and "exit codes: 0" in submit_text


def test_train_help_points_at_the_config_reference() -> None:
    """Issue 56.6: train's help said the keys are in "the README's config reference"; they are in
    docs/configuration.md."""
    footer = (REPO / "configs" / "config.yaml").read_text()
    assert "documented in docs/configuration.md" in footer and "README's config reference" not in footer


def test_verify_to_ray_is_taken_out_before_hydra_and_picks_rays_launcher(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`distaccum verify --to ray OVERRIDES`: Hydra gets the overrides alone; the task verifies with Ray's launcher
    (the launch itself is tested on a real Ray in tests/test_ray.py)."""
    import distaccum.verify.runner as runner
    from distaccum.cli.verify import verify_main
    from distaccum.cluster.local import launch_local
    from distaccum.cluster.ray_train import launch_on_ray

    launchers: list = []

    class Passed:
        exit_code = 0

    monkeypatch.setattr(runner, "verify", lambda cfg, echo, launcher: launchers.append(launcher) or Passed())
    seen: list[list[str]] = []

    def run_hydra(task, args: list[str]) -> None:
        seen.append(args)
        from omegaconf import OmegaConf

        task(OmegaConf.create({"model": {"_target_": "distaccum.models.MLP"}}))

    assert verify_main(["--to", "ray", "model=mlp", "precision=fp64"], run_hydra) == 0
    assert verify_main(["model=mlp"], run_hydra) == 0
    assert seen == [["model=mlp", "precision=fp64"], ["model=mlp"]]
    assert launchers == [launch_on_ray, launch_local]


def test_a_mistyped_key_is_answered_with_the_key_it_resembles() -> None:
    """Issue 56.10: `accum.micro_bach=4` got Hydra's "use +accum.micro_bach=4" (which adds a key nothing reads)."""
    from distaccum.cli.compose import compose_config
    from distaccum.config import ConfigError

    with pytest.raises(
        ConfigError, match=r"accum.micro_bach is not a key of the config: did you mean accum.micro_batch\?"
    ):
        compose_config(["accum.micro_bach=4"])
    with pytest.raises(
        ConfigError, match="Could not override 'nothing.like.it'"
    ):  # nothing close: Hydra's words
        compose_config(["nothing.like.it=4"])
