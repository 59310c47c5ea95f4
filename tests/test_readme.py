"""The README's config reference is generated from config.py's field docstrings: keep it current."""

from __future__ import annotations

import importlib.util

import pytest

from conftest import REPO

pytestmark = pytest.mark.unit


def test_config_reference_is_current() -> None:
    spec = importlib.util.spec_from_file_location("config_reference", REPO / "launch" / "config_reference.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    readme = (REPO / "README.md").read_text()
    start, end = "<!-- config-reference:start -->\n", "<!-- config-reference:end -->"
    current = readme[readme.index(start) + len(start):readme.index(end)]
    assert current.strip() == module.render().strip(), (
        "README config reference is stale: regenerate it with `python launch/config_reference.py`")


def test_readme_has_the_two_commands() -> None:
    readme = (REPO / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
