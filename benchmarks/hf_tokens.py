"""Tokens/s of ``hf_causal_lm`` under distaccum vs a hand-written Hugging Face + DDP ``no_sync`` loop.

``python -m benchmarks.hf_tokens [--smoke] [--rounds N] [--steps S] [--out DIR]`` starts two ranks
(gloo, one thread each) that hold BOTH variants — same random-init model (same seed), same packed
text blocks in the same order, same AdamW, clipping at 1.0, constant learning rate — and alternate
them round by round (the order flips every round), so drift of the machine falls on both alike:

- ``distaccum``: the public :class:`distaccum.Trainer` (``engine=ddp``, ``train_steps(S)`` per round),
  with distaccum's own summed loss and global-count normalization (ledger on, tripwire off).
- ``hf_ddp``: the Transformers Trainer's recipe written by hand: the window's K micro-batches are
  fetched first, ``num_items_in_batch`` = their shifted non-ignored labels, summed over ranks with an
  all-reduce; each micro-batch runs ``model(**batch, labels=..., num_items_in_batch=N)`` (the
  model's own loss, sum / N) times the world size (DDP averages), under ``no_sync`` except the last.

Each round times S optimizer steps per variant between barriers (rank 0's wall clock); tokens/s =
S x global batch x block size / seconds. The tables give the median over rounds with the min and
max. Both variants train the same trajectory: their per-step losses are recorded and compared
(``max_loss_rel_diff``), which shows the two measure the same work. The smoke size only checks
that everything runs (CI); the figures come from a full run on a quiet machine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.launch import ROOT, launch

VARIANTS = ("distaccum", "hf_ddp")
WORLD = 2


@dataclass(frozen=True, kw_only=True)
class TokenSpec:
    """The model, data and loop every variant runs."""

    model_type: str = "llama"
    width: int = 64
    layers: int = 2
    heads: int = 4
    block_size: int = 64
    """Tokens per packed sample."""
    micro_batch: int = 4
    accum_steps: int = 4
    steps: int = 6
    """Optimizer steps timed per variant per round."""
    rounds: int = 6
    warmup: int = 2
    """Untimed steps per variant before the first round."""
    lr: float = 1e-3
    seed: int = 0
    files: tuple[str, ...] | None = None
    """Text files (None: the demo text)."""
    cache_dir: str = ".cache/distaccum"

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accum_steps * WORLD

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.block_size

    def model_kwargs(self) -> dict[str, Any]:
        return {"model_type": self.model_type, "width": self.width, "layers": self.layers, "heads": self.heads,
                "positions": max(self.block_size, 128), "vocab_size": 256}

    def dataset(self) -> Any:
        from distaccum.textdata import TextFiles

        return TextFiles(list(self.files) if self.files else None, block_size=self.block_size, packing=True,
                         cache_dir=self.cache_dir)


SMOKE = TokenSpec(width=32, layers=1, heads=2, block_size=32, micro_batch=2, accum_steps=2, steps=2, rounds=2,
                  warmup=1)


class DistaccumVariant:
    """distaccum's Trainer, driven ``steps`` optimizer steps at a time."""

    def __init__(self, spec: TokenSpec, dataset: Any, run_dir: Path) -> None:
        from distaccum import Trainer
        from distaccum.datasets import pad_collate
        from distaccum.hf import causal_lm
        from distaccum.losses import token_cross_entropy

        total = spec.warmup + spec.rounds * spec.steps
        config = {"engine": {"name": "ddp"}, "precision": "fp32", "run_dir": str(run_dir),
                  "accum": {"micro_batch": spec.micro_batch, "steps": spec.accum_steps},
                  "optim": {"name": "adamw", "lr": spec.lr, "schedule": "constant", "warmup_steps": 0,
                            "weight_decay": 0.0, "clip_norm": 1.0},
                  "data": {"shuffle": False}, "eval": {"at_end": False},
                  "trainer": {"max_steps": total, "seed": spec.seed, "device": "cpu", "check_every": 0,
                              "save_final": False, "resume": False},
                  "log": {"console": "quiet"}}
        self.trainer = Trainer(config, model=partial(causal_lm, **spec.model_kwargs()), dataset=dataset,
                               collate=pad_collate, loss=partial(token_cross_entropy, shift=True))
        self.trainer.setup()

    def run(self, steps: int) -> list[Any]:
        return [r["loss"] for r in self.trainer.train_steps(steps)]

    def losses(self, values: list[Any]) -> list[float]:
        return [float(v) for v in values]  # the loop's own records: already global

    def close(self) -> None:
        self.trainer.finish()


class HandWrittenVariant:
    """The Transformers recipe with DDP ``no_sync``, written by hand (what a user writes without distaccum)."""

    def __init__(self, spec: TokenSpec, dataset: Any) -> None:
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        from torch.utils.data import DataLoader

        from distaccum.config import Split
        from distaccum.data.global_batch import GlobalBatchPlan
        from distaccum.datasets import pad_collate
        from distaccum.hf import causal_lm

        self.torch, self.dist = torch, dist
        torch.manual_seed(spec.seed)  # the same initial weights as distaccum's build_model
        self.raw = causal_lm(**spec.model_kwargs())
        self.model = DDP(self.raw, gradient_as_bucket_view=True)  # an expert's setting (and distaccum's)
        self.optimizer = torch.optim.AdamW(self.raw.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.0,
                                           foreach=False)
        # The same samples as distaccum's run, step by step, through a plain DataLoader (what a user writes).
        plan = GlobalBatchPlan(len(dataset), spec.global_batch, seed=spec.seed, shuffle=False)
        split, steps = Split(spec.micro_batch, spec.accum_steps, WORLD), spec.warmup + spec.rounds * spec.steps
        if steps > plan.windows_per_epoch:
            raise ValueError(f"{steps} steps need more than one epoch of {plan.windows_per_epoch} windows: more text")
        order = [piece.tolist() for step in range(steps)
                 for piece in plan.window(step).rank_micro_batches(split, dist.get_rank())]
        self.batches = iter(DataLoader(dataset, batch_sampler=order, collate_fn=pad_collate))
        self.accum_steps, self.step = spec.accum_steps, 0

    def one_step(self) -> Any:
        torch, dist = self.torch, self.dist
        # The recipe fetches the whole window first: it needs the item count before any forward.
        batches = [next(self.batches) for _ in range(self.accum_steps)]
        items = sum((b["labels"][..., 1:] != -100).sum() for b in batches).to(torch.float32)
        dist.all_reduce(items)  # num_items_in_batch gathered across ranks
        loss_total = torch.zeros(())
        for k, batch in enumerate(batches):
            last = k == len(batches) - 1
            with contextlib.nullcontext() if last else self.model.no_sync():
                out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                 labels=batch["labels"], num_items_in_batch=items)
                (out.loss * dist.get_world_size()).backward()  # DDP averages over ranks
            loss_total += out.loss.detach()
        torch.nn.utils.clip_grad_norm_(self.raw.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)  # in place: the gradients stay DDP's bucket views
        self.step += 1
        return loss_total  # this rank's share; summed over ranks after the timed round

    def run(self, steps: int) -> list[Any]:
        return [self.one_step() for _ in range(steps)]

    def losses(self, values: list[Any]) -> list[float]:
        totals = self.torch.stack(values)
        self.dist.all_reduce(totals)  # only to compare the trajectories: outside the timed region
        return totals.tolist()

    def close(self) -> None:
        pass


def run_rank(spec: TokenSpec, scratch: Path) -> dict[str, Any]:
    """One rank: build both variants, warm up, then alternate timed rounds. Returns rank 0's record."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        dataset = spec.dataset()
        variants = {"distaccum": DistaccumVariant(spec, dataset, scratch / "distaccum-run"),
                    "hf_ddp": HandWrittenVariant(spec, dataset)}
        losses = {name: v.losses(v.run(spec.warmup)) for name, v in variants.items()}
        seconds: dict[str, list[float]] = {name: [] for name in variants}
        for r in range(spec.rounds):
            for name in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
                dist.barrier()
                started = time.perf_counter()
                values = variants[name].run(spec.steps)
                dist.barrier()
                seconds[name].append(time.perf_counter() - started)
                losses[name] += variants[name].losses(values)
        for v in variants.values():
            v.close()
        return {"seconds": seconds, "losses": losses}
    finally:
        dist.barrier()
        dist.destroy_process_group()


def summarize(spec: TokenSpec, measured: dict[str, Any]) -> dict[str, Any]:
    """Tokens/s per round, median / min / max per variant, and the ratio of the medians."""
    tokens = spec.steps * spec.tokens_per_step
    rows: dict[str, Any] = {}
    for name in VARIANTS:
        rates = [tokens / s for s in measured["seconds"][name]]
        rows[name] = {"tokens_per_s_rounds": rates, "tokens_per_s_median": statistics.median(rates),
                      "tokens_per_s_min": min(rates), "tokens_per_s_max": max(rates)}
    a, b = measured["losses"]["distaccum"], measured["losses"]["hf_ddp"]
    return {"spec": dataclasses.asdict(spec), "tokens_per_step": spec.tokens_per_step, "variants": rows,
            "ratio_distaccum_over_hf_ddp": rows["distaccum"]["tokens_per_s_median"] / rows["hf_ddp"]["tokens_per_s_median"],
            "losses": measured["losses"],
            "max_loss_rel_diff": max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))}


def render_markdown(result: dict[str, Any]) -> str:
    """The BENCHMARKS.md row (and its header)."""
    s = result["spec"]
    model = f"{s['model_type']} {s['layers']}x{s['width']}, block {s['block_size']}"
    split = f"{s['micro_batch']} x K={s['accum_steps']} x {WORLD}"
    cells = []
    for name in VARIANTS:
        v = result["variants"][name]
        cells.append(f"{v['tokens_per_s_median']:.0f} ({v['tokens_per_s_min']:.0f}-{v['tokens_per_s_max']:.0f})")
    return ("| model | split | distaccum tokens/s | HF + DDP no_sync tokens/s | ratio | rounds |\n"
            "|---|---|---:|---:|---:|---:|\n"
            f"| {model} | {split} | {cells[0]} | {cells[1]} | {result['ratio_distaccum_over_hf_ddp']:.3f} | "
            f"{s['rounds']} x {s['steps']} steps |\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hf_tokens", description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model, 2 rounds of 2 steps (CI: it runs)")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="timed optimizer steps per variant per round")
    p.add_argument("--files", nargs="*", default=None, help="text files (default: the demo text)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-hf")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--worker", nargs=2, metavar=("SPEC_JSON", "OUT_JSON"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Launch the two ranks, then write results.json / results.md and print the row."""
    args = parse_args(argv)
    if args.worker:
        spec_json, out = args.worker
        values = json.loads(spec_json)
        spec = TokenSpec(**{**values, "files": tuple(values["files"]) if values["files"] else None})
        record = run_rank(spec, Path(out).parent)
        if int(os.environ["RANK"]) == 0:
            Path(out).write_text(json.dumps(record))
        return 0
    spec = SMOKE if args.smoke else TokenSpec()
    spec = dataclasses.replace(spec, rounds=args.rounds or spec.rounds, steps=args.steps or spec.steps,
                               files=tuple(args.files) if args.files else None,
                               cache_dir=str(Path(spec.cache_dir).resolve()))
    spec.dataset()  # tokenize and cache once, before two ranks would race to
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="distaccum-hf-bench-") as scratch:
        out = Path(scratch) / "rank0.json"
        log = args.out / "output.log"
        done = launch("benchmarks.hf_tokens", ["--worker", json.dumps(dataclasses.asdict(spec)), str(out)],
                      WORLD, log, timeout_s=args.timeout)
        if not done.ok or not out.is_file():
            print(f"benchmark ranks failed; see {log}:\n{done.tail}", file=sys.stderr)
            return 1
        result = summarize(spec, json.loads(out.read_text()))
    result["smoke"] = args.smoke
    markdown = render_markdown(result)
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "results.md").write_text(markdown)
    print(markdown)
    print(f"trajectories agree: max relative per-step loss difference {result['max_loss_rel_diff']:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
