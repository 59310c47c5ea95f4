"""``pip install`` of a wheel built from the repository: the configs ship inside the package, and
``distaccum train`` runs from an unrelated directory.

The fresh venv takes the wheel's dependencies (torch, hydra, ...) from the development venv through a
``.pth`` line instead of installing them again (torch alone is a 700 MB download), so what this
test checks is the wheel itself: its files, its entry point, its packaged configs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("install")
    wheels = root / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(REPO)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = wheels.glob("distaccum-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # Dependencies from the development venv; distaccum itself only from the wheel (the dev venv's
    # editable finder lives in a .pth file there, which a plain path line does not run).
    (Path(site) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # Without PYTHONPATH: a source tree on it (its distaccum.egg-info) would make pip call the wheel installed.
    bare = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    pip = subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "-q", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
        env=bare,
    )
    assert pip.returncode == 0, pip.stderr[-3000:]
    return venv


def test_the_wheel_carries_the_configs(installed: Path) -> None:
    (wheel,) = (installed.parent / "wheels").glob("distaccum-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in (
        "distaccum/configs/config.yaml",
        "distaccum/configs/model/tiny_gpt.yaml",
        "distaccum/configs/data/corpus.yaml",
        "distaccum/configs/loss/token_ce.yaml",
        "distaccum/configs/engine/ddp.yaml",
        "distaccum/corpus.txt",
        "distaccum/cli/__init__.py",
        "distaccum/engines/ddp.py",
    ):
        assert required in names, required
    assert not any(n.startswith(("tests/", "benchmarks/", "examples/")) for n in names)


def test_installed_distaccum_trains_from_an_unrelated_directory(installed: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PYTHONPATH")}
    exe = installed / "bin" / "distaccum"
    where = subprocess.run(
        [str(installed / "bin" / "python"), "-c", "import distaccum; print(distaccum.__file__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert str(installed) in where  # the wheel's copy, not the repository's
    version = subprocess.run([str(exe), "--version"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.startswith("distaccum 0.")
    proc = subprocess.run(
        [str(exe), "train", "trainer.max_steps=3", "log.console=quiet", "run_dir=out"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (tmp_path / "out" / "final" / "model.safetensors").is_file()
    assert len((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()) == 3
