"""results.json -> the markdown tables (results.md, and the generated part of BENCHMARKS.md).

Pure functions of the results dictionary: no measurement, no I/O.
"""

from __future__ import annotations

import math
from typing import Any

from benchmarks.stats import ISSUE_RATIOS, RATIOS, REFERENCE, across_launches, spread, verdict
from benchmarks.variants import ENGINE_VARIANTS, LETTERS

MEMORY_LIMIT = 1.03
"""Peak memory at the largest K over the smallest: the issue's "flat in K" bound."""


def _num(value: Any, digits: int = 3, scale: float = 1.0) -> str:
    return "n/a" if value is None else f"{value * scale:.{digits}f}"


def _cell(ratio: dict[str, Any] | None) -> str:
    """``median (q1-q3)`` of a per-round ratio."""
    if not ratio:
        return "n/a"
    return f"{ratio['median']:.3f} ({ratio['q1']:.3f}-{ratio['q3']:.3f})"


def _k(row: dict[str, Any]) -> str:
    """A timing row's K, with its launch number in a run that repeats launches (``--repeat``)."""
    return f"{row['k']} #{row['repeat'] + 1}" if row.get("repeats", 1) > 1 else str(row["k"])


def _bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _table(header: list[str], rows: list[list[str]], align: str = "") -> list[str]:
    """A markdown table; ``align`` gives 'l' (left) or 'r' per leading column, the rest right."""
    marks = [("---" if i < len(align) and align[i] == "l" else "---:") for i in range(len(header))]
    return ["| " + " | ".join(header) + " |", "|" + "|".join(marks) + "|",
            *("| " + " | ".join(row) + " |" for row in rows)]


def _case_label(results: dict[str, Any], case: str) -> str:
    about = results.get("cases", {}).get(case, {})
    if not about:
        return case
    params = f"{about['params'] / 1e6:.1f}M" if about["params"] >= 10**5 else f"{about['params']:,}"
    return f"{case} ({params} params, micro {about['micro_batch']})"


def header(results: dict[str, Any]) -> list[str]:
    """Where and how the figures were taken."""
    m, s = results["machine"], results["settings"]
    loads = [x for row in results["timing"] for x in row["launch"]["load_1m"]]
    load = f"median {sorted(loads)[len(loads) // 2]:.2f}, max {max(loads):.2f}" if loads else "n/a"
    return [
        f"Machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, {m['memory_gib']} GiB, {m['platform']}; "
        f"Python {m['python']}, torch {m['torch']}, accelerate {m['accelerate']}, deepspeed {m['deepspeed']}. "
        f"{s['backend']}, world {s['world_size']}, {s['threads']}, {s.get('precision', 'fp32')} compute. "
        f"Date {results['date']}.",
        "",
        (f"Command: `{s['command']}` ({_rounds(results)}"
         + (f", {s['repeats']} launches per case and K" if s.get("repeats", 1) > 1 else "")
         + f", whole run {results['wall_s']:.0f} s). "
         f"1-minute load average around the timing launches: {load} (the benchmark alone: about "
         f"{s['world_size']}; more means other work shared the machine and the figures are noise)."
         if results["timing"] else
         f"Command: `{s['command']}` (the engine sweep alone, whole run {results['wall_s']:.0f} s; memory and "
         "counts, not timing: the machine's load does not change them)."),
        *(["", "**Smoke run: the structure of the benchmark, not figures (tiny model, few rounds).**"]
          if s["smoke"] else []),
    ]


def _rounds(results: dict[str, Any]) -> str:
    """How many rounds each launch ran: fixed, or as many whole cycles as the time budget held."""
    s, counts = results["settings"], [row["rounds"] for row in results["timing"]]
    if not s.get("budget_s") or not counts:
        return f"{s['rounds']} rounds per launch"
    blocks = f"{s['block_steps']}-step blocks, " if s.get("block_steps") else ""
    return (f"{blocks}whole cycles of rounds for {s['budget_s']:g} s per launch: "
            f"{min(counts)}-{max(counts)} rounds")


def issue_table(results: dict[str, Any]) -> list[str]:
    """The issue's table: per case and K, the median of the per-round ratios and their IQR."""
    rows = []
    last = None
    for row in results["timing"]:
        label = _case_label(results, row["case"]) if row["case"] != last else ""
        last = row["case"]
        rows.append([label, _k(row), *(_cell(row["ratios"].get(r)) for r in ISSUE_RATIOS)])
    return [
        "Median of the per-round ratios of step times (interquartile range over rounds in brackets):",
        "",
        *_table(["case", "K", *ISSUE_RATIOS], rows, "l"),
    ]


def spread_table(results: dict[str, Any]) -> list[str]:
    """Every ratio with min-max over rounds, its target and whether it is met."""
    rows = []
    for row in results["timing"]:
        for label, ratio in row["ratios"].items():
            goal = f"<= {ratio['target']:.2f}" if ratio["target"] else ""
            s = spread(ratio["per_round"])  # the interval and verdict from the rounds: also for a run before them
            rows.append([row["case"], _k(row), label, f"{s.median:.3f}", f"{s.ci_low:.3f}-{s.ci_high:.3f}",
                         f"{s.q1:.3f}-{s.q3:.3f}", f"{s.min:.3f}-{s.max:.3f}", str(s.rounds), goal,
                         verdict(s, ratio["target"])])
    return [
        "Every ratio: median of the per-round ratios, the median's 95 % confidence interval (distribution-free: two "
        "order statistics of the rounds; min-max up to 8 rounds), interquartile range and min-max; a target is met "
        "when the interval lies within it, missed when it lies beyond it, otherwise not resolved (within the "
        "spread: more rounds narrow the interval, not the IQR).",
        "",
        *_table(["case", "K", "ratio", "median", "95 % CI", "IQR", "min-max", "rounds", "target", "verdict"], rows,
                "lrlrrrrrll"),
    ]


def launches_table(results: dict[str, Any]) -> list[str]:
    """A run that repeats launches (``--repeat``): every ratio's median per launch, and the verdict from them."""
    rows = [[r["case"], str(r["k"]), r["ratio"], f"{r['median']:.3f}", f"{r['min']:.3f}-{r['max']:.3f}",
             " ".join(f"{m:.3f}" for m in r["launch_medians"]), f"<= {r['target']:.2f}" if r["target"] else "",
             r["verdict"], f"{r['pooled']['median']:.3f} ({r['pooled']['ci_low']:.3f}-{r['pooled']['ci_high']:.3f}, "
             f"{r['pooled']['rounds']} rounds)", _launch_effect(r)] for r in across_launches(results["timing"])]
    if not rows:
        return []
    return [
        "Across launches: each launch's median ratio is one value (a launch's processes keep their CPU placement, "
        "memory layout and allocator state for all its rounds, which can move a ratio from one launch to the next); "
        "the median of the launches' medians, their min-max (the median's interval: confidence 1 - 2 / 2^launches, "
        "97 % for 6), and the verdict from it: met when every launch is within the target, missed when every "
        "launch is beyond it. For information: every launch's rounds pooled as one sample, their "
        "median and its 95 % interval (narrower, and right only if the launches share no effect of their own), and "
        "whether they do: the spread (sd) of the launches' mean log ratios against the spread their rounds' noise "
        "alone would give them (near 1: no effect of the launch's own; `benchmarks.stats.launch_effect`).",
        "",
        *_table(["case", "K", "ratio", "median of launches", "min-max", "launches", "target", "verdict",
                 "rounds pooled: median (95 % interval)", "launch sd / rounds' sd"], rows, "lrl"),
    ]


def _launch_effect(row: dict[str, Any]) -> str:
    """``launch sd / expected sd`` of an across-launch row (:func:`benchmarks.stats.launch_effect`)."""
    launch, expected = row["launch_sd"], row["expected_sd"]
    if not (math.isfinite(launch) and math.isfinite(expected)) or expected == 0:
        return "n/a"
    return f"{launch:.3f} / {expected:.3f} = {launch / expected:.2f}"


def time_table(results: dict[str, Any]) -> list[str]:
    """Step time per variant: median over rounds of the block medians, with min-max."""
    names = list(dict.fromkeys(v for row in results["timing"] for v in row["variants"]))
    rows = []
    for row in results["timing"]:
        cells = []
        for name in names:
            s = row["variants"].get(name, {}).get("step_s")
            cells.append("n/a" if not s else f"{s['median'] * 1e3:.1f} ({s['min'] * 1e3:.1f}-{s['max'] * 1e3:.1f})")
        rows.append([row["case"], _k(row), str(row["steps_per_block"]), *cells])
    heads = [f"{LETTERS.get(n, '')} {n}".strip() for n in names]
    return ["Time per optimizer step, ms: median over rounds (min-max), slower rank:", "",
            *_table(["case", "K", "steps/block", *heads], rows, "l")]


def ledger_table(results: dict[str, Any]) -> list[str]:
    """Where distaccum's step goes, from its own per-step records (medians of the timed steps)."""
    rows = []
    for row in results["timing"]:
        led = row["distaccum_ledger"].get("distaccum")
        if led:
            rows.append([row["case"], _k(row), *(_num(led.get(k), 1, 1e3) for k in
                         ("time_s", "data_s", "compute_s", "comm_s", "comm_exposed_s", "optim_s")),
                         f"{led.get('comm_rounds', 0):.0f} / {led.get('comm_calls', 0):.0f}"])
    if not rows:
        return []
    return ["distaccum's own ledger in the same runs, ms (medians; rank 0; `comm_s` overlaps `compute_s`):", "",
            *_table(["case", "K", "time", "data", "compute", "comm", "comm exposed", "optim", "rounds / calls"],
                    rows, "l")]


def agreement_lines(results: dict[str, Any]) -> list[str]:
    """Same work: the largest parameter difference from the reference loop (ddp_no_sync where it ran) after the
    launch."""
    worst: dict[str, float] = {}
    for row in results["timing"]:
        for name, diff in row["param_rel_diff"].items():
            worst[name] = max(worst.get(name, 0.0), diff)
    if not worst:
        return []
    references = {row.get("param_reference", REFERENCE) for row in results["timing"] if row["param_rel_diff"]}
    reference = " / ".join(sorted(references))
    parts = ", ".join(f"{n} {d:.1e}" for n, d in worst.items() if n not in (*references, "compute_floor"))
    floor = worst.get("compute_floor")
    if floor is None:
        control = ""
    elif results["settings"]["world_size"] == 1:
        control = (f" The compute floor differs by {floor:.1e}: at world 1 there is nothing to average over ranks, "
                   "so it does the same arithmetic and is no negative control here.")
    else:
        control = f" The compute floor, which averages nothing over ranks, differs by {floor:.1e} (a negative control)."
    return [f"Same work: after each launch every variant's parameters are compared with {reference}'s "
            f"(largest |difference| / largest |parameter|, worst launch): {parts}.{control}"]


def comm_table(results: dict[str, Any]) -> list[str]:
    """Per engine variant and K: reductions, gathers, step time, peak memory (fresh processes)."""
    rows = []
    for r in results["sweep"]:
        rec = r.get("records", {})
        if r["status"] != "ok":
            rows.append([r["case"], str(r["k"]), r["variant"], r["status"], *[""] * 8])
            continue
        engine = ENGINE_VARIANTS.get(r["variant"], ("ddp",))[0]
        gathers = {"fsdp": f"{rec.get('gather_calls', 0):.0f} ({_bytes(rec.get('gather_bytes'))})",
                   "deepspeed": "not counted"}.get(engine, "none (replicated)")
        across = (f"{rec['comm_rounds_replicate']:.0f} / {rec['comm_calls_replicate']:.0f} / "
                  f"{_bytes(rec['comm_bytes_replicate'])}" if rec.get("comm_calls_replicate") else "-")
        rows.append([r["case"], str(r["k"]), r["variant"], r["sync"],
                     _num(rec.get("comm_rounds"), 0), _num(rec.get("comm_calls"), 0),
                     _bytes(rec.get("comm_bytes")), across, gathers if rec else "n/a (no ledger)",
                     f"{r['step_s']['median'] * 1e3:.1f}", f"{r['step_peak_mb']:.0f}", f"{r['process_peak_mb']:.0f}"])
    env = " ".join(f"{k}={v}" for k, v in results["settings"].get("sweep_env", {}).items())
    env_note = f" (workers' environment: {env}; see docs/benchmarks.md)" if env else ""
    return ["Engines, each (variant, K) in fresh processes: per optimizer step, medians over the timed "
            "steps of distaccum's records (gradient-reduction rounds, calls, bytes reduced; for HSDP those "
            "inside a replica, and the all-reduces across replicas as rounds / calls / bytes; FSDP2 parameter "
            f"all-gathers), step time (separate launches: read only large differences), {_peak_name(results)} of "
            f"the step and of the process through training, MiB{env_note}:", "",
            *_table(["case", "K", "variant", "sync", "rounds", "calls", "reduced", "across replicas",
                     "all-gathers", "step ms", "step peak", "process peak"], rows, "lrll")]


HSDP_MODES = {"distaccum_fsdp": "flat FSDP2, boundary", "distaccum_hsdp_boundary": "HSDP, boundary",
              "distaccum_hsdp_replica_boundary": "HSDP, replica_boundary (default)",
              "distaccum_hsdp_every_micro": "HSDP, every_micro"}
"""The rows of docs/multinode.md's trade-off table: sweep variant -> mode."""


def hsdp_table(results: dict[str, Any]) -> list[str]:
    """docs/multinode.md's trade-off table: per FSDP2 mode, the communication of one step at the largest K (inside a
    replica and across replicas, from distaccum's ledger) and the step's peak memory at the smallest and the
    largest K (``python -m benchmarks.run --no-timing --sweep hsdp --world 4``)."""
    rows = []
    for case in dict.fromkeys(r["case"] for r in results["sweep"]):
        for variant, mode in HSDP_MODES.items():
            runs = sorted((r for r in results["sweep"] if r["case"] == case and r["variant"] == variant
                           and r["status"] == "ok"), key=lambda r: r["k"])
            if not runs:
                continue
            low, high = runs[0], runs[-1]
            rec = high["records"]
            inner = f"{rec['comm_rounds']:.0f} / {rec['comm_calls']:.0f} / {_bytes(rec['comm_bytes'])}"
            across = (f"{rec['comm_rounds_replicate']:.0f} / {rec['comm_calls_replicate']:.0f} / "
                      f"{_bytes(rec['comm_bytes_replicate'])}" if rec.get("comm_calls_replicate") else "-")
            rows.append([_case_label(results, case), mode, str(high["k"]), inner, across,
                         f"{low['step_peak_mb']:.0f}", f"{high['step_peak_mb']:.0f}",
                         f"{high['step_peak_mb'] / low['step_peak_mb']:.3f}"])
    ks = sorted({r["k"] for r in results["sweep"]})
    s = results["settings"]
    return [f"World {s['world_size']} ({s['backend']}, {results['machine']['cpu']}), HSDP with 2 replicas; per "
            "optimizer step at the largest K: rounds / calls / bytes of the gradient reductions inside a replica "
            "(reduce-scatters) and across replicas (all-reduces), from distaccum's ledger; peak RSS of a step per "
            f"rank (MiB, largest rank) at K = {ks[0]} and K = {ks[-1]}. Command: `{s['command']}`.", "",
            *_table(["case", "mode", "K", "in replica", "across replicas", f"peak K={ks[0]}", f"peak K={ks[-1]}",
                     "growth"], rows, "lll")]


def _peak_name(results: dict[str, Any]) -> str:
    """What the sweep's peaks measure: the CUDA caching allocator's peak on a GPU, the resident set on the CPU."""
    return "peak CUDA memory allocated" if results["settings"].get("device") == "cuda" else "peak RSS"


def memory_table(results: dict[str, Any]) -> list[str]:
    """Peak memory at the largest K over the smallest, per engine variant."""
    rows = [[m["case"], m["variant"], f"{m['k_low']} -> {m['k_high']}",
             f"{m['step_peak_low_mb']:.0f} -> {m['step_peak_high_mb']:.0f}", f"{m['step_growth']:.3f}",
             f"{m['process_peak_low_mb']:.0f} -> {m['process_peak_high_mb']:.0f}", f"{m['process_growth']:.3f}",
             "yes" if m["flat"] else "**no**"] for m in results["memory"]]
    return [f"Memory flat in K: {_peak_name(results)} per rank (MiB, largest rank) at the smallest and largest K; "
            f"flat means both growths <= {MEMORY_LIMIT:.2f}:", "",
            *_table(["case", "variant", "K", "step peak", "growth", "process peak", "growth", "flat"], rows,
                    "llrrrrrl")]


def gpu_lines(results: dict[str, Any]) -> list[str]:
    """MFU and NCCL bus bandwidth, or why they were not measured."""
    gpu = results.get("gpu")
    if not gpu:
        return ["GPU: not measured (no CUDA device in this run)."]
    lines = [f"GPU: {gpu['device']}, world {gpu['world_size']}, {gpu['precision']} compute, peak "
             f"{_num(gpu['peak_tflops'], 0)} TFLOP/s ({gpu['peak_source']}); MFU = 6 x parameters x samples per "
             "rank and step / step time / peak.", ""]
    rows = []
    for r in gpu["mfu"]:
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.3g} %"
        rows.append([r["case"], str(r["k"]), r["variant"], f"{r['step_ms']:.2f}", mfu])
    if rows:  # an engine sweep alone (--no-timing) times nothing to compute MFU from
        lines += [*_table(["case", "K", "variant", "step ms", "MFU"], rows, "lll"), ""]
    busbw = (f"- NCCL all-reduce, {b['case']}: " + (
        f"{b['bytes'] / 2**20:.0f} MiB in {b['time_s'] * 1e3:.2f} ms, algbw {b['algbw_gbps']:.1f} GB/s, "
        f"busbw {b['busbw_gbps']:.1f} GB/s" if b["status"] == "ok" else f"not measured ({b['why']})")
        for b in gpu["busbw"])
    return lines + list(dict.fromkeys(busbw))  # one line per case when every K reads alike


def render(results: dict[str, Any], *, across_only: bool = False) -> str:
    """results.md: every table, in reading order. ``across_only``: of the timing, only what is taken across
    launches and the parameter check (a ``--repeat`` run's section of BENCHMARKS.md; each launch's tables stay in
    results.md)."""
    sections = [header(results)]
    if results["timing"] and across_only:
        sections += [launches_table(results), agreement_lines(results)]
    elif results["timing"]:  # an engine sweep alone (--no-timing) has no timing tables to show
        sections += [launches_table(results), issue_table(results), spread_table(results), time_table(results),
                     ledger_table(results), agreement_lines(results)]
    if results["sweep"]:
        sections += [comm_table(results), memory_table(results)]
    sections.append(gpu_lines(results))
    if results["timing"]:
        labels = ", ".join(f"{label} = {num} / {den}" for label, num, den in RATIOS)
        sections.append([f"Ratios: {labels}."])
    return "\n\n".join("\n".join(lines) for lines in sections if lines) + "\n"
