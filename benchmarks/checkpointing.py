"""What activation checkpointing costs and saves, per model: memory (deterministic) and step time (CPU).

``python -m benchmarks.checkpointing [--rounds N] [--threads T] [--smoke] [--out DIR]`` measures one
micro-batch's training step (forward, backward, AdamW step) of each model with and without
``activation_checkpointing=blocks``:

- **saved bytes**: what autograd keeps for backward after the forward
  (:func:`distaccum.activation_checkpointing.saved_activation_bytes`; exact, no timing, no allocator).
- **peak RSS**: a fresh process per (model, variant) does one warm-up step, resets the peak
  (``/proc/self/clear_refs``) and reports the peak resident set of the next step (it includes
  torch itself, the weights and the optimizer state, the same in both variants; ``rise`` in the
  JSON, the growth above the resident set before the step, depends on what the allocator kept).
- **step time**: both variants in one process, alternating (order swapped every round), ``--rounds``
  rounds of 3 steps; the median per round, then the median and range over rounds.

Writes ``results.json`` and ``results.md`` into ``--out`` and prints the markdown; ``--docs FILE`` also puts
the table into FILE between its ``bench:checkpointing`` markers (docs/companions.md; not for ``--smoke``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.report import replace_section
from distaccum.activation_checkpointing import apply_activation_checkpointing, saved_activation_bytes
from distaccum.losses import token_cross_entropy
from distaccum.models import TinyGPT
from distaccum.telemetry.memory import peak_memory_bytes, reset_peak_memory

VARIANTS = ("none", "blocks")
DOCS_COMMAND = "python -m benchmarks.checkpointing --rounds 8 --docs docs/companions.md"
"""The command whose output docs/companions.md carries between its ``bench:checkpointing`` markers."""


@dataclass(frozen=True)
class Case:
    """A model and the micro-batch it trains on."""

    name: str
    kind: str
    """tiny_gpt | llama."""
    width: int
    depth: int
    micro_batch: int
    seq: int

    def build(self) -> nn.Module:
        torch.manual_seed(0)
        if self.kind == "tiny_gpt":
            return TinyGPT(width=self.width, depth=self.depth, heads=4, max_len=self.seq)
        from transformers import AutoModelForCausalLM, LlamaConfig  # optional: only this case needs it

        config = LlamaConfig(
            vocab_size=256,
            hidden_size=self.width,
            num_hidden_layers=self.depth,
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=4 * self.width,
            max_position_embeddings=self.seq,
            use_cache=False,
        )
        return AutoModelForCausalLM.from_config(config)

    def batch(self) -> dict[str, torch.Tensor]:
        ids = torch.randint(
            0, 256, (self.micro_batch, self.seq + 1), generator=torch.Generator().manual_seed(0)
        )
        return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


CASES = (
    Case("tiny_gpt w128", "tiny_gpt", 128, 4, 16, 128),
    Case("tiny_gpt w512", "tiny_gpt", 512, 4, 16, 128),
    Case("llama h256", "llama", 256, 4, 16, 128),
)
SMOKE = (Case("tiny_gpt w32", "tiny_gpt", 32, 2, 2, 16),)


def prepare(case: Case, variant: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = case.build()
    apply_activation_checkpointing(model, variant)
    model.train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> None:
    loss_sum, n_items = token_cross_entropy(model, batch)
    (loss_sum / n_items).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _rss() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def peak_child(case: Case, variant: str) -> dict[str, int]:
    """In a fresh process: the peak RSS of one step after a warm-up step, and its rise over the start."""
    model, optimizer = prepare(case, variant)
    batch = case.batch()
    train_step(model, optimizer, batch)  # optimizer state, first-touch allocations
    cpu = torch.device("cpu")
    reset_peak_memory(cpu)
    before = _rss()
    train_step(model, optimizer, batch)
    peak = peak_memory_bytes(cpu)
    return {"peak_rss": peak, "rise": peak - before}


def peak_rss(case: Case, variant: str, threads: int) -> dict[str, int]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.checkpointing",
            "--child",
            case.name,
            variant,
            "--threads",
            str(threads),
            *(["--smoke"] if case in SMOKE else []),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def step_times(case: Case, rounds: int) -> dict[str, list[float]]:
    """Per variant, the median step time of each round (3 steps), variants alternating."""
    built = {v: prepare(case, v) for v in VARIANTS}
    batch = case.batch()
    for model, optimizer in built.values():
        train_step(model, optimizer, batch)  # warm-up
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            model, optimizer = built[variant]
            steps = []
            for _ in range(3):
                start = time.perf_counter()
                train_step(model, optimizer, batch)
                steps.append(time.perf_counter() - start)
            times[variant].append(statistics.median(steps))
    return times


def measure(case: Case, rounds: int, threads: int) -> dict[str, Any]:
    saved = {}
    for variant in VARIANTS:
        model, _ = prepare(case, variant)
        saved[variant] = saved_activation_bytes(model, token_cross_entropy, case.batch())
    params = sum(p.numel() for p in case.build().parameters())
    times = step_times(case, rounds)
    ratios = [c / p for p, c in zip(times["none"], times["blocks"], strict=True)]
    return {
        "case": case.name,
        "params": params,
        "micro_batch": case.micro_batch,
        "seq": case.seq,
        "depth": case.depth,
        "saved_bytes": saved,
        "peak": {v: peak_rss(case, v, threads) for v in VARIANTS},
        "step_s": times,
        "time_ratio_rounds": ratios,
    }


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def _ms(times: list[float]) -> str:
    return f"{1e3 * statistics.median(times):.1f} ({1e3 * min(times):.1f}-{1e3 * max(times):.1f})"


def render(results: list[dict[str, Any]], rounds: int, threads: int) -> str:
    lines = [
        f"| model | params | micro-batch x tokens | saved for backward, MiB (none -> blocks) | peak RSS of a step, "
        f"MiB | step time, ms (median, range over {rounds} rounds) | "
        "time ratio blocks/none |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        saved, peak, times = r["saved_bytes"], r["peak"], r["step_s"]

        ratio = r["time_ratio_rounds"]
        lines.append(
            f"| {r['case']} ({r['depth']} blocks) | {r['params'] / 1e6:.2f} M | {r['micro_batch']} x {r['seq']} | "
            f"{mib(saved['none'])} -> {mib(saved['blocks'])} ({saved['blocks'] / saved['none']:.0%}) | "
            f"{mib(peak['none']['peak_rss'])} -> {mib(peak['blocks']['peak_rss'])} "
            f"({mib(peak['blocks']['peak_rss'] - peak['none']['peak_rss'])}) | "
            f"{_ms(times['none'])} -> {_ms(times['blocks'])} | {statistics.median(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f}) |"
        )
    lines += [
        "",
        f"fp32 on CPU, torch {torch.__version__}, {threads} intra-op thread(s); one step = forward, "
        "backward and an AdamW step of one micro-batch.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.checkpointing", description=__doc__)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--smoke", action="store_true", help="one tiny model (CI)")
    parser.add_argument("--out", type=Path, default=Path("runs/checkpointing"))
    parser.add_argument(
        "--docs",
        type=Path,
        default=None,
        help="also write the table between the bench:checkpointing markers of this file",
    )
    parser.add_argument("--child", nargs=2, metavar=("CASE", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cases = SMOKE if args.smoke else CASES
    if args.child:
        case = next(c for c in cases if c.name == args.child[0])
        print(json.dumps(peak_child(case, args.child[1])))
        return
    results = [measure(case, args.rounds, args.threads) for case in cases]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    markdown = render(results, args.rounds, args.threads)
    (args.out / "results.md").write_text(markdown)
    print(markdown)
    if args.docs is not None:
        if args.smoke:
            raise SystemExit("--docs refuses a --smoke run: its figures are structure only")
        args.docs.write_text(replace_section(args.docs.read_text(), "checkpointing", markdown, DOCS_COMMAND))
        print(f"wrote the table into {args.docs}")


if __name__ == "__main__":
    main(sys.argv[1:])
