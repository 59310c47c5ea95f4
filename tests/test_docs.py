"""The maps of the code stay true: docs/architecture.md names every module, the README's folder map every
package folder, and every link between README.md and docs/ resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.unit

PACKAGE = REPO / "distaccum"


def modules() -> list[str]:
    return sorted(str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py") if "configs" not in p.parts)


def test_the_architecture_page_names_every_module() -> None:
    text = (REPO / "docs" / "architecture.md").read_text()
    missing = [m for m in modules() if f"`{m}`" not in text]
    assert not missing, f"docs/architecture.md does not name {missing}"
    named = set(re.findall(r"`(distaccum/[\w/]+\.py)`", text))
    gone = sorted(n for n in named if not (REPO / n).is_file())
    assert not gone, f"docs/architecture.md names modules that do not exist: {gone}"


def test_the_readme_folder_map_lists_every_package_folder() -> None:
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Module map"):]
    folders = sorted(p.parent.relative_to(REPO).as_posix() for p in PACKAGE.glob("*/__init__.py"))
    missing = [f for f in folders if f"`{f}/`" not in section]
    assert not missing, f"the README's module map misses {missing}"


def links(path: Path) -> list[tuple[str, str]]:
    """(link text, target) of every relative markdown link in ``path``."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"\[([^\]]+)\]\(([^)\s]+)\)", path.read_text())
            if not m.group(2).startswith(("http://", "https://", "mailto:"))]


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file."""
    out = set()
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


@pytest.mark.parametrize("doc", ["README.md", "BENCHMARKS.md", *sorted(
    str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))])
def test_no_dead_links(doc: str) -> None:
    path = REPO / doc
    for text, target in links(path):
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        assert dest.exists(), f"{doc}: [{text}]({target}) points at a missing file"
        if anchor and dest.suffix == ".md":
            assert anchor in anchors(dest), f"{doc}: [{text}]({target}): no heading #{anchor} in {dest.name}"
