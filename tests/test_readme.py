"""The README a newcomer reads in five minutes, and the config reference generated into docs/configuration.md."""

from __future__ import annotations

import importlib.util
import re

import pytest

from conftest import REPO

pytestmark = pytest.mark.unit

README = REPO / "README.md"


def test_config_reference_is_current() -> None:
    spec = importlib.util.spec_from_file_location("config_reference", REPO / "launch" / "config_reference.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    doc = (REPO / "docs" / "configuration.md").read_text()
    start, end = "<!-- config-reference:start -->\n", "<!-- config-reference:end -->"
    current = doc[doc.index(start) + len(start) : doc.index(end)]
    assert current.strip() == module.render().strip(), (
        "docs/configuration.md's config reference is stale: regenerate it with "
        "`python launch/update_config_reference.py`"
    )


def test_the_reference_names_every_config_field() -> None:
    from dataclasses import fields, is_dataclass

    from distaccum.config import RunConfig

    doc = (REPO / "docs" / "configuration.md").read_text()

    def names(cls: type, prefix: str = "") -> list[str]:
        out = []
        for f in fields(cls):
            kind = f.type if isinstance(f.type, type) else None
            default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
            if is_dataclass(default) and not isinstance(default, type):
                out += names(type(default), f"{prefix}{f.name}.")
            elif kind is None or not is_dataclass(kind):
                out.append(prefix + f.name)
        return out

    missing = [n for n in names(RunConfig) if f"`{n}`" not in doc]
    assert not missing, f"docs/configuration.md does not document {missing}"


def test_readme_is_short_and_has_the_two_commands() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 320, "README.md is for the first five minutes: move details into docs/"
    assert "make demo" in text and "make test" in text


def test_the_readme_routes_each_goal_to_a_docs_page() -> None:
    text = README.read_text()
    table = text[text.index("## Where to read next") :]
    pages = set(re.findall(r"\]\(docs/([\w-]+\.md)\)", table))
    on_disk = {p.name for p in (REPO / "docs").glob("*.md")}
    assert pages == on_disk, f"pages the README's table misses: {sorted(on_disk - pages)}"
