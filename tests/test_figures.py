"""Every published figure comes from a generated section or names a source that exists (README.md, BENCHMARKS.md,
docs/).

A figure is a measured number: one with a unit of time, size, rate or count (``12 ms``, ``4.5 %``, ``104 MiB``,
``1.7×``, ``300 samples/s``, ``18 operators``), a ratio (a decimal with two or more places, with or without its
interval: ``1.004 (0.999-1.013)``), a number in scientific notation (``1.1e-16``) or a signed count (``+6``). Figures
inside backticks are configuration values, version numbers (``torch 2.13``) are not figures, and the allow-list
holds the few bare figures that are not measurements either (defaults, targets and bounds), each with its reason.

The rule, per section (the text under one heading), outside fenced blocks (command output, pasted under the
command that printed it) and outside generated sections (between ``<!-- NAME:begin/start -->`` markers, written by
the command the marker names from stored results):

- BENCHMARKS.md holds no figure outside its generated sections: every one is rendered by ``python -m
  benchmarks.report`` from a stored result in docs/results/ (``tests/test_benchmark_unit.py`` checks the render).
- Elsewhere a figure needs its source named in the same section — a ``python -m`` module, a ``pytest`` or
  ``tests/test_*`` reference, a ``distaccum`` command, ``make bench``, a ``benchmarks/`` or ``examples/`` script, a
  stored result (``docs/results/*.json``), or a pointer to BENCHMARKS.md or a generated section — and every
  source of this repository the section names must exist (a retired tool or a deleted result sources nothing). A
  section that points at BENCHMARKS.md alone quotes it: its figures must be in the page's generated sections.

A section built from a stored result must also hold only that result's numbers: ``tests/test_prose_figures.py``.
"""

from __future__ import annotations

import re

import pytest

from conftest import REPO, prose_lines

pytestmark = pytest.mark.unit

UNITS = r"(?:ms|s|%|MiB|GiB|KiB|MB|GB|×|samples/s|tokens/s|operators|ops)"
FIGURE = re.compile(
    rf"(?<![\w.])\d+(?:\.\d+)?\s?{UNITS}(?!\w)"  # with a unit
    r"|(?<![\w.])\d+\.\d{2,}(?:\s?\(\d+\.\d+\s?[-–]\s?\d+\.\d+\))?(?!\w|\.\d)"  # a ratio, with its interval
    r"|(?<![\w.])\d+(?:\.\d+)?e[-+]?\d+(?!\w|\.\d)"  # scientific notation
    r"|(?<![\w.])[+−]\d+(?:\.\d+)?(?!\w|\.\d)"
)  # a signed count or difference
VERSION = re.compile(
    r"(?:torch|Python|python|CUDA|transformers|deepspeed|accelerate)\s?[≥>=<]*\s?\d+(?:\.\d+)+"
)
SOURCE = re.compile(
    r"python -m |pytest|tests/test_\w+|`distaccum \w+|make bench|BENCHMARKS\.md|bench:|"
    r"benchmarks/\w+\.(?:py|sh)|examples/\w+\.py|docs/results/[\w.-]+\.json|printed|prints"
)
ELSEWHERE = re.compile(SOURCE.pattern.replace(r"BENCHMARKS\.md|bench:|", ""))
"""A source other than a pointer to BENCHMARKS.md: a section that points there alone quotes the page, so its figures
must be on the page, in a generated section (rendered from stored results)."""
LOCAL = re.compile(
    r"python -m (benchmarks\.\w+)|((?:benchmarks|examples)/\w+\.(?:py|sh))|(tests/test_\w+\.py)|"
    r"(docs/results/[\w.-]+\.json)"
)
"""Sources of this repository a section can name: each must exist."""
NOT_MEASURED = {
    "25 MB": "DDP's default bucket cap (a torch default)",
    "128 KiB": "glibc's default mmap threshold, which the benchmark fixes",
    "3 %": "the issue's memory-flatness target, not a result",
    "1.02": "issue 21's target for distaccum against the expert loop, not a result",
    "1.03": "the memory-flatness bound as a ratio, not a result",
    "1.05": "the CPU regression guard's bound, not a result",
    "95 %": "the confidence level of the benchmark's intervals, not a result",
}
STRICT = {"BENCHMARKS.md"}
"""Pages whose every figure must be generated from stored results."""
DOCS = ["README.md", "BENCHMARKS.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]


def sections(text: str) -> list[str]:
    """The prose of each section: fenced blocks and generated sections left out (a section whose marker names a
    generator of this repository that no longer exists is prose: nothing can regenerate it)."""
    out: list[str] = []
    current: list[str] = []

    def opens(line: str) -> bool:
        return bool(re.match(r"<!-- [\w:-]+:(begin|start)", line)) and not missing_sources(line)

    for line in prose_lines(text, opens):
        if line.startswith("#"):
            out.append(" ".join(current))
            current = []
        current.append(line.strip())
    out.append(" ".join(current))
    return out


def figures(section: str) -> list[str]:
    """The measured figures of a section's prose (backticked spans and version numbers left out)."""
    prose = VERSION.sub("", re.sub(r"`[^`]*`", "", section))
    return [f for f in FIGURE.findall(prose) if f.strip() not in NOT_MEASURED]


def missing_sources(section: str) -> list[str]:
    """The sources of this repository a section names that do not exist."""
    named = {next(g for g in m.groups() if g) for m in LOCAL.finditer(section)}
    paths = {n: n.replace(".", "/") + ".py" if n.startswith("benchmarks.") else n for n in named}
    return sorted(n for n, path in paths.items() if not (REPO / path).is_file())


def generated(text: str) -> str:
    """The text of a page's generated sections."""
    return " ".join(re.findall(r"<!-- bench:[\w-]+:begin.*?-->(.*?)<!-- bench:[\w-]+:end", text, re.S))


PAGE = generated((REPO / "BENCHMARKS.md").read_text(encoding="utf-8"))
"""What BENCHMARKS.md renders from its stored results: the figures a pointer to it can source."""


def unsourced(text: str, strict: bool = False, page: str = PAGE) -> list[tuple[list[str], str]]:
    """(figures, section start) of every section with a figure that is not sourced: no source named, a named one
    missing, a figure quoted from BENCHMARKS.md (the only source named) that the page's generated sections do not
    hold (``page``), or (``strict``) any figure outside a generated section."""
    bad = []
    for section in sections(text):
        found = figures(section)
        if found and (strict or not SOURCE.search(section) or missing_sources(section)):
            bad.append((found, section[:120]))
        elif found and not ELSEWHERE.search(section) and [f for f in found if f not in page]:
            bad.append(([f for f in found if f not in page], section[:120]))
    return bad


def test_the_rule_flags_an_unsourced_figure_and_accepts_a_sourced_one() -> None:
    assert unsourced("# A\n\nThe step takes 12.5 ms on two cores.\n")
    assert not unsourced("# A\n\nThe step takes 12.5 ms (`python -m benchmarks.run`).\n")
    assert not unsourced("# A\n\n```\nstep 1 12.5 ms\n```\n")  # pasted output
    assert not unsourced(
        "# A\n\n<!-- bench:x:begin (generated by python -m benchmarks.report) -->\n12 ms\n"
        "<!-- bench:x:end -->\n"
    )
    assert not unsourced("# A\n\nSet `engine.bucket_cap_mb=25` for 25 MB buckets.\n")


def test_the_rule_sees_ratios_intervals_exponents_and_counts() -> None:
    ratio = unsourced("# A\n\ndistaccum / expert reads 1.004 (0.999-1.013) at K = 4.\n")
    assert ratio and ratio[0][0] == ["1.004 (0.999-1.013)"]
    assert unsourced("# A\n\nThe two runs agree to 1.1e-16.\n")[0][0] == ["1.1e-16"]
    assert unsourced("# A\n\ndistaccum issues +6 of its own per step.\n")[0][0] == ["+6"]
    assert unsourced("# A\n\nThe expert loop issues 72 operators per step.\n")[0][0] == ["72 operators"]
    assert not unsourced(
        "# A\n\ndistaccum / expert reads 1.004 (0.999-1.013) (`python -m benchmarks.run`).\n"
    )
    assert not unsourced("# A\n\nOn torch 2.13 and Python ≥ 3.10, at K = 1, 4 and 16, within 1.02.\n")


def test_a_source_that_does_not_exist_sources_nothing() -> None:
    assert unsourced("# A\n\nIt reads 0.968 (`python -m benchmarks.no_such_tool`).\n")
    assert unsourced("# A\n\nIt reads 0.968 (docs/results/no-such-run.json).\n")
    assert not unsourced("# A\n\nIt reads 0.968 (`python -m benchmarks.report`, tests/test_figures.py).\n")


def test_a_figure_quoted_from_benchmarks_md_must_be_on_the_page() -> None:
    page = "| 1.004 (0.999-1.013) | 18 operators |"
    assert not unsourced("# A\n\nIt reads 1.004 (0.999-1.013) ([BENCHMARKS.md](BENCHMARKS.md)).\n", page=page)
    assert unsourced("# A\n\nIt reads 1.017 ([BENCHMARKS.md](BENCHMARKS.md)).\n", page=page)[0][0] == [
        "1.017"
    ]
    assert not unsourced("# A\n\nIt reads 1.017 (BENCHMARKS.md, `python -m benchmarks.run`).\n", page=page)


def test_a_strict_page_takes_figures_only_from_its_generated_sections() -> None:
    page = (
        "# A\n\nMeasured by `make bench`: 1.004.\n\n<!-- bench:x:begin (generated by python -m benchmarks.report) "
        "-->\n1.004 (0.999-1.013), 12 ms, 1.1e-16\n<!-- bench:x:end -->\n"
    )
    assert unsourced(page, strict=True)[0][0] == ["1.004"]
    assert not unsourced(page.replace(": 1.004.", "."), strict=True)


@pytest.mark.parametrize("doc", DOCS)
def test_every_figure_comes_from_a_generated_section_or_a_named_source(doc: str) -> None:
    bad = unsourced((REPO / doc).read_text(encoding="utf-8"), strict=doc in STRICT)
    assert not bad, (
        f"{doc}: figures with no generated section or existing source (name it, or remove them): {bad}"
    )


def test_the_readme_and_docs_are_all_checked() -> None:
    assert len(DOCS) >= 15  # the glob found the docs pages
