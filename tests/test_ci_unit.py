"""CI cannot pass by skipping: a missing optional dependency fails the run under ``CI=true``."""

from __future__ import annotations

import pytest

from conftest import REPO, requires

pytestmark = pytest.mark.unit


def test_a_missing_optional_dependency_fails_under_ci_and_skips_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true but no_such_module_xyz is not importable"):
        requires("no_such_module_xyz")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="no_such_module_xyz is not importable"):
        requires("no_such_module_xyz")
    assert requires("json").dumps({}) == "{}"


def test_no_test_file_skips_an_optional_dependency_silently() -> None:
    """``pytest.importorskip`` would skip under CI too; test files use ``conftest.requires``."""
    offenders = [
        p.name
        for p in (REPO / "tests").glob("*.py")
        if "importorskip(" in p.read_text() and p.name != "test_ci_unit.py"
    ]
    assert not offenders, offenders
