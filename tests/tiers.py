"""Test tiers and what they cost.

As a pytest plugin (``pytest_plugins`` in conftest.py) it writes each test's tier into runs/junit.xml as the
property ``tier``: the first of :data:`ORDER` among the test's markers (``unmarked`` when none). As a script it
reads that file and prints the time by tier against the budgets of ``[tool.distaccum.test-tiers]`` in
pyproject.toml, then the slowest tests: ``make test`` and ``make check`` end with it.

    python tests/tiers.py runs/junit.xml [--slowest 15] [--store]   (--store: tests/durations.json from this run)
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

import pytest
import tomllib

ORDER = ("gpu", "slurm", "faults", "stress", "timing", "serial", "dist", "unit")
"""A test's tier: the first of these it is marked with (a ``dist`` test that is also ``faults`` is ``faults``)."""
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def tier_of(markers: set[str]) -> str:
    """The tier of a test with these marker names."""
    return next((name for name in ORDER if name in markers), "unmarked")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.user_properties.append(("tier", tier_of({mark.name for mark in item.iter_markers()})))


def budgets(pyproject: Path = PYPROJECT) -> dict[str, float]:
    """Seconds of test time each tier may take (summed over its tests, as runs/junit.xml counts them)."""
    with pyproject.open("rb") as handle:
        table = tomllib.load(handle).get("tool", {}).get("distaccum", {}).get("test-tiers", {})
    return {name: float(seconds) for name, seconds in table.items()}


def read(junit: Path) -> list[tuple[float, str, str]]:
    """(seconds, tier, test id) of every test case in ``junit``."""
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        test = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        rows.append((float(case.get("time") or 0.0), props.get("tier") or "unmarked", test))
    return rows


def report(rows: list[tuple[float, str, str]], limits: dict[str, float], slowest: int = 15) -> list[str]:
    """The lines ``make test`` prints: time by tier (with its budget), then the ``slowest`` tests."""
    time: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for seconds, tier, _ in rows:
        time[tier] += seconds
        count[tier] += 1
    lines = ["test time by tier (sum over tests; budgets: pyproject.toml [tool.distaccum.test-tiers]):"]
    for tier in [*ORDER, "unmarked"]:
        if tier not in count:
            continue
        limit = limits.get(tier)
        verdict = (
            "" if limit is None else f" / {limit:6.0f} s budget" + (" OVER" if time[tier] > limit else "")
        )
        lines.append(f"  {tier:9s} {count[tier]:5d} tests {time[tier]:7.1f} s{verdict}")
    lines.append(f"  {'all':9s} {len(rows):5d} tests {sum(time.values()):7.1f} s")
    lines.append(f"the {min(slowest, len(rows))} slowest tests:")
    lines += [f"  {s:6.1f} s  {tier:7s} {test}" for s, tier, test in sorted(rows, reverse=True)[:slowest]]
    return lines


DURATIONS = Path(__file__).resolve().parent / "durations.json"
"""Seconds each test file took in a whole run of the suite (``python tests/tiers.py runs/junit.xml --store``):
the order in which the two xdist workers take the files (tests/serial_lock.py)."""


def file_durations(rows: list[tuple[float, str, str]]) -> dict[str, float]:
    """Seconds per test file (``tests/test_x.py``), summed over its tests."""
    out: dict[str, float] = defaultdict(float)
    for seconds, _, test in rows:
        out[test.split("::")[0]] += seconds
    return {name: round(seconds, 1) for name, seconds in sorted(out.items())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("junit", type=Path)
    parser.add_argument("--slowest", type=int, default=15)
    parser.add_argument("--store", action="store_true", help=f"write each file's time to {DURATIONS.name}")
    args = parser.parse_args(argv)
    if not args.junit.is_file():
        print(f"tiers: {args.junit} not found (no test ran)", file=sys.stderr)
        return 0
    rows = read(args.junit)
    print("\n".join(report(rows, budgets(), args.slowest)))
    if args.store:
        DURATIONS.write_text(json.dumps(file_durations(rows), indent=1) + "\n")
        print(f"tiers: {DURATIONS} written")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
