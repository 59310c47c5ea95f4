"""Stored results and the tables made from them: ``docs/results/*.json`` -> BENCHMARKS.md's generated sections.

    python -m benchmarks.report --store runs/bench/results.json   # keep a run's parts, then render BENCHMARKS.md
    python -m benchmarks.report                                   # render BENCHMARKS.md from the stored results
    python -m benchmarks.report --check                           # 1 when BENCHMARKS.md differs from that render
    python -m benchmarks.report --hsdp runs/hsdp/results.json     # docs/multinode.md's HSDP table

This module owns the results format. A run's ``results.json`` (:mod:`benchmarks.run`, :mod:`benchmarks.host_ops`)
holds ``meta`` (:func:`benchmarks.launch.provenance`: the commit, the sources' digest and the environment),
``settings`` and up to three parts: ``timing``, ``memory`` and ``host_ops``. ``--store`` keeps each part it has as
one file, ``docs/results/{cpu,gpu}-timing.json``, ``{cpu,gpu}-memory.json`` or ``host-ops.json``, each with the run's
``meta``, after refusing what must not become a figure (a smoke run, a failed or stopped launch, fewer than
:data:`MIN_ROUNDS` rounds, a part that misses a split, a machine shared with other work). Every table is rendered from
these files alone, with the code and environment it describes; a part never stored renders as "not measured".
Everything but :func:`main` is a pure function of dictionaries.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.cases import FULL_CASES
from benchmarks.host_ops import table as ops_markdown
from benchmarks.launch import ROOT
from benchmarks.stats import COMPILED, DISTACCUM_VS_EXPERT, GUARD, TARGET, guard
from benchmarks.variants import DISTACCUM, EXPERT, sync_of

STORE = ROOT / "docs" / "results"
"""Where the page's figures live: one file per part and device."""
DOC = ROOT / "BENCHMARKS.md"
BY = "python -m benchmarks.report"
MIN_ROUNDS = 6
MEMORY_LIMIT = 1.03
"""Peak memory at the largest K over the smallest: the issue's "flat in K" bound."""
PARTS = {"timing": "timing", "memory": "memory", "host_ops": "ops"}
"""A results file's part -> the name its stored file and its sections carry."""
TIMING_COLUMNS = (
    DISTACCUM_VS_EXPERT,
    "distaccum / floor",
    "expert / floor",
    COMPILED,
    "A/A: expert twin / expert",
    "A/A compiled: twin / compiled expert",
)
"""The timing table's ratios, in its column order."""
STEP_COLUMNS = (
    "distaccum",
    EXPERT,
    "compute_floor",
    "distaccum_compiled",
    "ddp_no_sync_compiled",
    "ddp_no_sync_compiled_static",
)
"""The step-time table's variants."""


# -- storing -----------------------------------------------------------------------------------------------------


def stored_name(part: str, device: str) -> str:
    """The file a part is stored in: ``host-ops.json`` (the CPU's count), else ``{device}-{part}.json``."""
    return (
        "host-ops.json"
        if part == "host_ops"
        else f"{'gpu' if device == 'cuda' else 'cpu'}-{PARTS[part]}.json"
    )


def parts_of(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The stored files a run gives: file name -> ``{"meta", "settings", "cases", part: ...}`` for every part it
    measured (the ``orders`` of each timing launch left out: ``runs/`` keeps them)."""
    out = {}
    for part in PARTS:
        data = results.get(part)
        if not data:
            continue
        if part == "timing":
            data = [{k: v for k, v in row.items() if k != "orders"} for row in data]
        out[stored_name(part, results["meta"]["device"])] = {
            "meta": results["meta"],
            "settings": results.get("settings", {}),
            "cases": results.get("cases", {}),
            "finished": results.get("finished", True),
            part: data,
        }
    return out


def problems(stored: dict[str, Any], allow_loaded: bool = False, allow_partial: bool = False) -> list[str]:
    """Why one part must not become the page's figures (empty: it may)."""
    found = []
    settings, device = stored["settings"], stored["meta"]["device"]
    if settings.get("smoke"):
        found.append("a smoke run (tiny model): structure only, not figures")
    if stored.get("finished") is False and not allow_partial:
        found.append("a run stopped part-way: finish it, or pass --allow-partial")
    timing, memory, ops = stored.get("timing", []), stored.get("memory", []), stored.get("host_ops", {})
    failed = [f"timing {r['case']} K={r['k']}" for r in timing if r["status"] != "ok"]
    failed += [f"memory {r['case']} K={r['k']} {r['variant']}" for r in memory if r["status"] != "ok"]
    if failed and not allow_partial:
        found.append(
            f"failed launches: {', '.join(failed)} (--allow-partial stores the others, shown as failed)"
        )
    if timing and min(r["rounds"] for r in timing) < MIN_ROUNDS:
        found.append(
            f"{min(r['rounds'] for r in timing)} rounds in a launch; figures need at least {MIN_ROUNDS}"
        )
    if device == "cpu" and not settings.get("smoke") and not allow_partial:
        missing = [
            f"{c.name} K={k}"
            for c in FULL_CASES
            for k in c.ks
            if timing and (c.name, k) not in {(r["case"], r["k"]) for r in timing}
        ]
        missing += [
            f"{c.name} K={k}"
            for c in FULL_CASES
            for k in c.sweep_ks
            if memory and (c.name, k) not in {(r["case"], r["k"]) for r in memory}
        ]
        missing += [f"host ops K={k}" for k in (1, 16) if ops and str(k) not in {str(key) for key in ops}]
        if missing:
            found.append(f"a partial run (no {', '.join(missing)}): run it all, or pass --allow-partial")
    loads = [r["launch"]["load_1m"][1] for r in timing]
    limit = stored["meta"]["world_size"] + 1.0
    if loads and statistics.median(loads) > limit and not allow_loaded:
        found.append(
            f"the 1-minute load average after the timing launches had median {statistics.median(loads):.2f} "
            f"> {limit:.1f} (the benchmark alone: about {stored['meta']['world_size']}): the machine was "
            "shared; rerun it alone, or pass --allow-loaded and say so beside the table"
        )
    return found


# -- tables ------------------------------------------------------------------------------------------------------


def _table(header: list[str], rows: list[list[str]], left: int = 1) -> list[str]:
    """A markdown table, its first ``left`` columns left-aligned, the rest right."""
    marks = ["---" if i < left else "---:" for i in range(len(header))]
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(marks) + "|",
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def _cell(ratio: dict[str, Any] | None) -> str:
    """``median (95 % interval)`` of a per-round ratio."""
    if not ratio:
        return "n/a"
    return f"{ratio['median']:.3f} ({ratio['ci_low']:.3f}-{ratio['ci_high']:.3f})"


def _bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _case(stored: dict[str, Any], case: str) -> str:
    about = stored.get("cases", {}).get(case)
    if not about:
        return case
    params = f"{about['params'] / 1e6:.1f}M" if about["params"] >= 10**5 else f"{about['params']:,}"
    return f"{case} ({params} params, micro-batch {about['micro_batch']})"


def provenance_lines(stored: dict[str, Any], source: str) -> list[str]:
    """What the figures below describe: the code (commit, uncommitted changes, the sources' digest), the
    environment and the command, and the stored file they are rendered from."""
    m = stored["meta"]
    changes = {True: " with uncommitted changes to distaccum/ or benchmarks/", False: "", None: ""}[
        m.get("uncommitted_changes")
    ]
    return [
        f"Code: commit `{m['commit']}`{changes} (sources sha256 `{m['source_sha256']}`). Environment: torch "
        f"{m['torch']}, Python {m['python']}; {m['cpu']}, {m['logical_cpus']} logical CPUs; {m['device_name']} "
        f"({m['backend']}), world {m['world_size']}, {m['threads']}, {m['precision']}. Date {m['date']}. "
        f"Command: `{m['command']}`. Stored: `{source}`."
    ]


def timing_lines(stored: dict[str, Any]) -> list[str]:
    """The timing table (ratios with their 95 % intervals), the step times, the same-work check and the guard."""
    timing = stored["timing"]
    rows, times, last = [], [], None
    for row in timing:
        label = _case(stored, row["case"]) if row["case"] != last else ""
        last = row["case"]
        compiled = row["ratios"].get(COMPILED)
        vs = (
            ""
            if not compiled
            else {"ddp_no_sync_compiled": " vs dynamic", "ddp_no_sync_compiled_static": " vs static"}.get(
                compiled["denominator"], ""
            )
        )
        cells = [
            _cell(row["ratios"].get(c)) + (vs if c == COMPILED and compiled else "") for c in TIMING_COLUMNS
        ]
        rows.append([label, str(row["k"]), str(row["rounds"]), *cells])
        steps = [row["variants"].get(v, {}).get("step_s") for v in STEP_COLUMNS]
        times.append([label, str(row["k"]), *("n/a" if not s else f"{s['median'] * 1e3:.1f}" for s in steps)])
    settings = stored["settings"]
    blocks = (
        f"blocks of {settings['block_steps']} optimizer step(s) per variant, "
        if settings.get("block_steps")
        else ""
    )
    budget = (
        f"whole cycles of rounds for {settings['budget_s']:g} s per launch"
        if settings.get("budget_s")
        else f"{settings.get('rounds')} rounds per launch"
    )
    lines = [
        f"Per case and K, one launch: {blocks}{budget}. Median of the per-round ratios of step times, its 95 % "
        "confidence interval in brackets (two order statistics of the rounds: docs/benchmarks.md). The compiled "
        "column divides by the faster compiled expert loop of the launch (`dynamic=True` or static shapes). "
        "The A/A columns are the controls: 1 by construction, their interval is the harness's resolution.",
        "",
        *_table(["case", "K", "rounds", *TIMING_COLUMNS], rows, 1),
        "",
        "Time per optimizer step, ms (median over rounds, slowest rank):",
        "",
        *_table(["case", "K", *STEP_COLUMNS], times, 1),
    ]
    lines += ["", *agreement_lines(timing)]
    verdicts = [
        r["ratios"][label]["verdict"]
        for r in timing
        for label in (DISTACCUM_VS_EXPERT, COMPILED)
        if label in r["ratios"]
    ]
    if verdicts:
        lines += [
            "",
            f"Target: distaccum / expert and compiled distaccum / compiled expert <= {TARGET}, met when the "
            f"whole interval is within it: {_tally(verdicts)}.",
        ]
    g = guard(timing) if stored["meta"]["device"] == "cpu" else None  # the guard is the CPU's
    if g:
        state = "met" if g["met"] else "**missed**"
        lines += [
            "",
            f"Regression guard (median of distaccum / expert <= {GUARD} at every split, this run as "
            f"measured): {state}; the largest median is {g['worst']:.3f} ({g['case']} K={g['k']}), "
            f"over {g['splits']} splits.",
        ]
    return lines


def agreement_lines(timing: list[dict[str, Any]]) -> list[str]:
    """Same work: the largest parameter difference of each variant from the reference loop after its launch."""
    worst: dict[str, float] = {}
    for row in timing:
        for name, diff in row.get("param_rel_diff", {}).items():
            worst[name] = max(worst.get(name, 0.0), diff)
    references = sorted({row["param_reference"] for row in timing if row.get("param_reference")})
    if not worst or not references:
        return []
    parts = ", ".join(f"{n} {d:.1e}" for n, d in worst.items() if n not in (*references, "compute_floor"))
    floor = worst.get("compute_floor")
    control = (
        ""
        if floor is None
        else f" The compute floor, which averages nothing over ranks, differs by "
        f"{floor:.1e} (the negative control: the check can fail)."
    )
    return [
        f"Same work: after each launch every variant's parameters are compared with {' / '.join(references)}'s "
        f"(largest |difference| / largest |parameter|, worst launch): {parts}.{control}"
    ]


def memory_growth(memory: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per case and variant: the peaks at the smallest and the largest K of the sweep, and their growth."""
    rows = []
    for case in dict.fromkeys(r["case"] for r in memory):
        for variant in dict.fromkeys(r["variant"] for r in memory):
            runs = sorted(
                (r for r in memory if r["case"] == case and r["variant"] == variant and r["status"] == "ok"),
                key=lambda r: r["k"],
            )
            if len(runs) < 2:
                continue
            low, high = runs[0], runs[-1]
            step, proc = (
                high["step_peak_mb"] / low["step_peak_mb"],
                high["process_peak_mb"] / low["process_peak_mb"],
            )
            rows.append(
                {
                    "case": case,
                    "variant": variant,
                    "k_low": low["k"],
                    "k_high": high["k"],
                    "step_low": low["step_peak_mb"],
                    "step_high": high["step_peak_mb"],
                    "step_growth": step,
                    "process_low": low["process_peak_mb"],
                    "process_high": high["process_peak_mb"],
                    "process_growth": proc,
                    "reduced": high.get("records", {}).get("comm_bytes"),
                    "flat": step <= MEMORY_LIMIT and proc <= MEMORY_LIMIT,
                }
            )
    return rows


def _engine(variant: str) -> str:
    return DISTACCUM[variant].engine if variant in DISTACCUM else "hand-written DDP"


def memory_lines(stored: dict[str, Any]) -> list[str]:
    """Peak memory per engine at the smallest and the largest K, and whether it stays flat."""
    growth = memory_growth(stored["memory"])
    peak = "peak CUDA memory allocated" if stored["meta"]["device"] == "cuda" else "peak RSS"
    env = " ".join(f"{k}={v}" for k, v in stored["settings"].get("sweep_env", {}).items())
    rows = [
        [
            _case(stored, g["case"]),
            g["variant"],
            _engine(g["variant"]),
            sync_of(g["variant"]),
            f"{g['step_low']:.0f} -> {g['step_high']:.0f}",
            f"{g['step_growth']:.3f}",
            f"{g['process_low']:.0f} -> {g['process_high']:.0f}",
            f"{g['process_growth']:.3f}",
            _bytes(g["reduced"]),
            "yes" if g["flat"] else "**no**",
        ]
        for g in growth
    ]
    ks = sorted({r["k"] for r in stored["memory"]})
    return [
        f"Each (variant, K) in fresh processes; {peak} per rank, MiB, the largest rank, of a step (the largest "
        f"over the timed steps) and of the process (set-up and warm-up too), at K = {ks[0]} -> {ks[-1]}; the "
        "gradient bytes distaccum's ledger reduced per step at the largest K; flat when both growths are "
        f"<= {MEMORY_LIMIT}." + (f" Workers' environment: `{env}` (docs/benchmarks.md)." if env else ""),
        "",
        *_table(
            [
                "case",
                "variant",
                "engine",
                "sync",
                "step peak",
                "growth",
                "process peak",
                "growth",
                "reduced / step",
                "flat",
            ],
            rows,
            4,
        ),
    ]


def ops_lines(stored: dict[str, Any]) -> list[str]:
    """The operators per step of distaccum and of the expert loop (:func:`benchmarks.host_ops.table`)."""
    counts = {int(k): v for k, v in stored["host_ops"].items()}
    return [
        "Top-level operators one steady-state optimizer step issues on the host outside the model's forward and "
        "backward, the loss and the optimizer (counted by torch.profiler on rank 0 of 2 gloo ranks, not timed: "
        "exact, the same on every run; `benchmarks/host_ops.py`):",
        "",
        ops_markdown(counts),
    ]


HSDP_MODES = {
    "distaccum_fsdp": "flat FSDP2, boundary",
    "distaccum_hsdp_boundary": "HSDP, boundary",
    "distaccum_hsdp_replica_boundary": "HSDP, replica_boundary (default)",
    "distaccum_hsdp_every_micro": "HSDP, every_micro",
}
"""The rows of docs/multinode.md's trade-off table: variant -> mode."""


def hsdp_lines(results: dict[str, Any]) -> list[str]:
    """docs/multinode.md's trade-off table: per FSDP2 mode, one step's communication at the largest K (inside a
    replica and across replicas, from distaccum's ledger) and the step's peak memory at the smallest and the
    largest K (``python -m benchmarks.run --no-timing --sweep hsdp --world 4``)."""
    rows = []
    memory = results["memory"]
    for case in dict.fromkeys(r["case"] for r in memory):
        for variant, mode in HSDP_MODES.items():
            runs = sorted(
                (r for r in memory if r["case"] == case and r["variant"] == variant and r["status"] == "ok"),
                key=lambda r: r["k"],
            )
            if not runs:
                continue
            low, high = runs[0], runs[-1]
            rec = high["records"]
            inner = f"{rec['comm_rounds']:.0f} / {rec['comm_calls']:.0f} / {_bytes(rec['comm_bytes'])}"
            across = (
                f"{rec['comm_rounds_replicate']:.0f} / {rec['comm_calls_replicate']:.0f} / "
                f"{_bytes(rec['comm_bytes_replicate'])}"
                if rec.get("comm_calls_replicate")
                else "-"
            )
            rows.append(
                [
                    _case(results, case),
                    mode,
                    str(high["k"]),
                    inner,
                    across,
                    f"{low['step_peak_mb']:.0f}",
                    f"{high['step_peak_mb']:.0f}",
                    f"{high['step_peak_mb'] / low['step_peak_mb']:.3f}",
                ]
            )
    ks = sorted({r["k"] for r in memory})
    return [
        *provenance_lines(results, "the run's results.json"),
        "",
        "HSDP with 2 replicas; per optimizer step at the largest K: rounds / calls / bytes of the gradient "
        "reductions inside a replica (reduce-scatters) and across replicas (all-reduces), from distaccum's "
        f"ledger; peak memory of a step per rank (MiB, largest rank) at K = {ks[0]} and K = {ks[-1]}.",
        "",
        *_table(
            [
                "case",
                "mode",
                "K",
                "in replica",
                "across replicas",
                f"peak K={ks[0]}",
                f"peak K={ks[-1]}",
                "growth",
            ],
            rows,
            3,
        ),
    ]


# -- the page ----------------------------------------------------------------------------------------------------


def not_measured(section: str) -> list[str]:
    """A section's text when its part was never stored."""
    if section.startswith("gpu"):
        return [
            "No GPU was lent for this release: not measured. On a CUDA machine `benchmarks/gpu_check.sh OUT` "
            "runs the GPU tests and this benchmark; `python -m benchmarks.report --store OUT/bench/results.json "
            "--store OUT/memory/results.json` stores its results and renders this table."
        ]
    return ["Not measured for this release yet: run `make bench`, then `make bench-docs`."]


def _tally(verdicts: list[str]) -> str:
    """``met 4, not resolved 2 of 6``."""
    counts = [f"{sum(v == kind for v in verdicts)} {kind}" for kind in ("met", "not resolved", "missed")]
    return ", ".join(c for c in counts if not c.startswith("0 ")) + f" of {len(verdicts)}"


def targets_lines(store: dict[str, dict[str, Any]]) -> list[str]:
    """Where the targets stand, from the stored timing and memory of each device."""
    rows = []
    for device in ("cpu", "gpu"):
        timing = [r for r in store.get(f"{device}-timing.json", {}).get("timing", []) if r["status"] == "ok"]
        for label in (DISTACCUM_VS_EXPERT, COMPILED):
            measured = [r for r in timing if label in r["ratios"]]
            reading = "; ".join(f"{r['case']} K={r['k']} {_cell(r['ratios'][label])}" for r in measured)
            rows.append(
                [
                    f"{label} <= {TARGET}",
                    device.upper(),
                    reading or "not measured",
                    _tally([r["ratios"][label]["verdict"] for r in measured]) if measured else "",
                ]
            )
        g = guard(timing)
        if device == "cpu":
            rows.append(
                [
                    f"guard: distaccum / expert median <= {GUARD} at every split",
                    "CPU",
                    "not measured" if not g else f"largest {g['worst']:.3f} ({g['case']} K={g['k']})",
                    "" if not g else "met" if g["met"] else "**missed**",
                ]
            )
        growth = memory_growth(store.get(f"{device}-memory.json", {}).get("memory", []))
        grows = [
            f"{g['case']} {g['variant']} {max(g['step_growth'], g['process_growth']):.3f}"
            for g in growth
            if not g["flat"]
        ]
        rows.append(
            [
                f"memory flat in K (growth <= {MEMORY_LIMIT})",
                device.upper(),
                "not measured"
                if not growth
                else "grows: " + "; ".join(grows)
                if grows
                else "every engine flat",
                f"{sum(g['flat'] for g in growth)} flat of {len(growth)}" if growth else "",
            ]
        )
    return [
        "Read from the stored results in the sections below (each names its code and environment):",
        "",
        *_table(["target", "device", "reading: median (95 % interval)", "verdict"], rows, 4),
    ]


SECTIONS = {
    "targets": None,
    "cpu-timing": ("cpu-timing.json", timing_lines),
    "cpu-memory": ("cpu-memory.json", memory_lines),
    "host-ops": ("host-ops.json", ops_lines),
    "gpu-timing": ("gpu-timing.json", timing_lines),
    "gpu-memory": ("gpu-memory.json", memory_lines),
}
"""BENCHMARKS.md's generated sections: name -> (the stored file, its renderer); ``targets`` reads them all."""


def markers(section: str) -> tuple[str, str]:
    """The begin and end markers of a generated section."""
    return (
        f"<!-- bench:{section}:begin (generated by {BY}; edits here are lost) -->",
        f"<!-- bench:{section}:end -->",
    )


def section_body(section: str, store: dict[str, dict[str, Any]], store_name: str = "docs/results") -> str:
    """The text between a section's markers, from the stored results (``store``: file name -> content)."""
    if section == "targets":
        return "\n".join(targets_lines(store))
    file, render = SECTIONS[section]
    stored = store.get(file)
    if stored is None:
        return "\n".join(not_measured(section))
    return "\n".join([*provenance_lines(stored, f"{store_name}/{file}"), "", *render(stored)])


def replace_section(text: str, section: str, body: str, by: str = BY) -> str:
    """``text`` with the content between ``section``'s markers replaced by ``body`` (``by``: the command the
    markers name)."""
    begin = f"<!-- bench:{section}:begin (generated by {by}"
    end = f"<!-- bench:{section}:end -->"
    start = text.find(begin)
    start = text.find("-->", start) + 3 if start >= 0 else -1
    stop = text.find(end, max(start, 0))
    if start < 3 or stop < 0:
        raise ValueError(f"the document has no '{begin} ...' ... '{end}' section")
    return text[:start] + "\n\n" + body.strip() + "\n\n" + text[stop:]


def render_doc(text: str, store: dict[str, dict[str, Any]], store_name: str = "docs/results") -> str:
    """``text`` (BENCHMARKS.md) with every generated section rendered from ``store``."""
    for section in SECTIONS:
        text = replace_section(text, section, section_body(section, store, store_name))
    return text


def render_results(results: dict[str, Any], source: str = "results.json") -> str:
    """A run's own ``results.md``: its parts through the page's renderers, then where it ran."""
    store = parts_of(results)
    sections = [
        ["**Smoke run: the structure of the benchmark, not figures (tiny model, few rounds).**"]
        if results.get("settings", {}).get("smoke")
        else [],
        provenance_lines(results, source),
    ]
    for stored in store.values():
        part = next(p for p in PARTS if p in stored)
        sections.append({"timing": timing_lines, "memory": memory_lines, "host_ops": ops_lines}[part](stored))
    return "\n\n".join("\n".join(lines) for lines in sections if lines) + "\n"


def load_store(folder: Path) -> dict[str, dict[str, Any]]:
    """Every stored result in ``folder``: file name -> content."""
    return {
        name: json.loads((folder / name).read_text())
        for name, _ in (s for s in SECTIONS.values() if s)
        if (folder / name).is_file()
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Store results and render the page; 0 on success, 1 when results are refused or the page is stale (--check),
    2 for missing files."""
    p = argparse.ArgumentParser(prog=BY, description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--store", type=Path, action="append", default=[], help="a run's results.json to keep (repeat)"
    )
    p.add_argument("--results-dir", type=Path, default=STORE, help="where stored results live (docs/results)")
    p.add_argument("--doc", type=Path, default=DOC)
    p.add_argument(
        "--check", action="store_true", help="only compare the page with the render of the stored results"
    )
    p.add_argument(
        "--allow-loaded", action="store_true", help="store a run whose load average says it was shared"
    )
    p.add_argument(
        "--allow-partial", action="store_true", help="store a run that misses splits or stopped part-way"
    )
    p.add_argument(
        "--hsdp", type=Path, help="a `--sweep hsdp` run's results.json: docs/multinode.md's HSDP table"
    )
    args = p.parse_args(argv)
    if args.hsdp:
        doc = args.doc if args.doc != DOC else ROOT / "docs" / "multinode.md"
        results = json.loads(args.hsdp.read_text())
        if not any(r["variant"] in HSDP_MODES and r["status"] == "ok" for r in results.get("memory", [])):
            print(
                f"report: {args.hsdp} holds no HSDP memory launch (run it with --sweep hsdp --world 4)",
                file=sys.stderr,
            )
            return 1
        doc.write_text(replace_section(doc.read_text(), "hsdp", "\n".join(hsdp_lines(results))))
        print(f"report: wrote the hsdp section of {doc}")
        return 0
    for path in [*args.store, args.doc]:
        if not path.is_file():
            print(f"report: no {path} (make bench writes runs/bench/results.json)", file=sys.stderr)
            return 2
    strict = args.results_dir.resolve() == STORE.resolve()  # the page's own store takes figures only
    parts = [
        (path, name, stored)
        for path in args.store
        for name, stored in parts_of(json.loads(path.read_text())).items()
    ]
    refusals = {
        (path, name): problems(stored, args.allow_loaded, args.allow_partial) for path, name, stored in parts
    }
    if strict and any(refusals.values()):  # nothing is stored unless every part may be
        for (path, name), refused in refusals.items():
            if refused:
                print(f"report: not storing {name} from {path}: " + "; ".join(refused), file=sys.stderr)
        return 1
    for path, name, stored in parts:
        args.results_dir.mkdir(parents=True, exist_ok=True)
        (args.results_dir / name).write_text(json.dumps(stored, indent=1) + "\n")
        refused = refusals[(path, name)]
        print(f"report: stored {args.results_dir / name}" + (f" ({'; '.join(refused)})" if refused else ""))
    store_name = "docs/results" if strict else str(args.results_dir)
    text = args.doc.read_text()
    rendered = render_doc(text, load_store(args.results_dir), store_name)
    if args.check:
        if rendered != text:
            print(
                f"report: {args.doc} differs from what {BY} renders from {store_name}: run it",
                file=sys.stderr,
            )
            return 1
        return 0
    args.doc.write_text(rendered)
    print(f"report: rendered {args.doc} from {store_name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def study_markdown(lines: list[str], about: str, meta: dict[str, Any], figure: str | None, alt: str) -> str:
    """A study's ``results.md``: its table ``lines``, the paragraph ``about`` its settings closed by the code and the
    date it ran with, and the figure (``alt`` its text) when there is one."""
    dirty = " with uncommitted changes" if meta["uncommitted_changes"] else ""
    lines = [*lines, "", f"{about} torch {meta['torch']}, commit {meta['commit']}{dirty}, {meta['date']}."]
    if figure:
        lines += ["", f"![{alt}]({figure})"]
    return "\n".join(lines) + "\n"


def write_study(
    results: dict[str, Any],
    out: Path,
    figure: str,
    render: Callable[[dict[str, Any], str], str],
    plot: Callable[[dict[str, Any], Path], None],
) -> str:
    """A study's own output in ``out`` (``results.json``, ``results.md`` from ``render``, the figure ``figure``
    from ``plot``): what ``outer_curves`` and ``batch_growth`` write on every run; returns the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    markdown = render(results, figure)
    (out / "results.md").write_text(markdown)
    plot(results, out / figure)
    return markdown
