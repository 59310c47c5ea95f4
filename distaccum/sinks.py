"""Where per-step records go: one two-method interface, a null object, and rank-0-only sinks.

The same record dict feeds the console, ``metrics.jsonl``, wandb and ``distaccum verify``.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import IO, Any, Protocol

Record = dict[str, Any]


class Sink(Protocol):
    """Receives one record per optimizer step and the run summary at the end."""

    def log(self, record: Record) -> None: ...

    def close(self, summary: Record) -> None: ...


class NullSink:
    """Used on ranks other than 0: every method does nothing."""

    def log(self, record: Record) -> None:
        pass

    def close(self, summary: Record) -> None:
        pass


class JsonlSink:
    """``metrics.jsonl`` (one JSON object per step, flushed as written) and ``summary.json``."""

    def __init__(self, run_dir: Path, *, append: bool = False) -> None:
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = open(run_dir / "metrics.jsonl", "a" if append else "w", encoding="utf-8")

    def log(self, record: Record) -> None:
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()  # a killed job keeps every finished step

    def close(self, summary: Record) -> None:
        self._file.close()
        tmp = self.run_dir / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, self.run_dir / "summary.json")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}GiB"  # pragma: no cover


class ConsoleSink:
    """A progress line per optimizer step (loss, samples/s, bytes reduced, comm share); quiet mode
    prints only the summary."""

    def __init__(self, total_steps: int, *, quiet: bool = False, stream: IO[str] | None = None) -> None:
        self.total = total_steps
        self.quiet = quiet
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()

    def log(self, record: Record) -> None:
        if self.quiet:
            return
        step = record["step"]
        width = 20
        done = int(width * step / max(self.total, 1))
        bar = "#" * done + "." * (width - done)
        busy = record.get("compute_s", 0.0) + record.get("comm_exposed_s", 0.0)
        share = record.get("comm_exposed_s", 0.0) / busy if busy > 0 else 0.0
        line = (f"step {step:>4}/{self.total} [{bar}] loss {record['loss']:.4f} "
                f"lr {record['lr']:.2e} {record.get('samples_per_s', 0):8.1f} samples/s "
                f"reduced {human_bytes(record['comm_bytes'])} in {record['comm_calls']} "
                f"call{'' if record['comm_calls'] == 1 else 's'} "
                f"comm {share:4.0%}" + (" SKIPPED(overflow)" if record.get("skipped") else ""))
        end = "\r" if self.tty and step < self.total else "\n"
        print(line, end=end, file=self.stream, flush=True)

    def close(self, summary: Record) -> None:
        loss = summary.get("final_loss", math.nan)
        print(f"done: {summary['steps']} optimizer steps, final loss {loss:.4f}, "
              f"{summary['samples_per_s']:.1f} samples/s, {summary['engine']} world {summary['world_size']} "
              f"split {summary['micro_batch']}x{summary['accum_steps']}x{summary['world_size']}"
              f"={summary['global_batch']}", file=self.stream)
        print(f"outputs: {summary['run_dir']}/metrics.jsonl, summary.json", file=self.stream, flush=True)


class MultiSink:
    """Fans one record out to several sinks."""

    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks

    def log(self, record: Record) -> None:
        for sink in self.sinks:
            sink.log(record)

    def close(self, summary: Record) -> None:
        for sink in self.sinks:
            sink.close(summary)


def build_sinks(console: str, total_steps: int, run_dir: Path, rank: int, *,
                wandb_config: dict[str, Any] | None = None, wandb_mode: str = "offline",
                wandb_project: str = "distaccum", append: bool = False) -> Sink:
    """Rank 0 gets console + JSONL (+ wandb when ``wandb_config`` is given and ``wandb_mode`` is not
    ``disabled``); other ranks a NullSink."""
    if rank != 0:
        return NullSink()
    quiet = console == "quiet"
    sinks: list[Sink] = [JsonlSink(run_dir, append=append), ConsoleSink(total_steps, quiet=quiet)]
    if wandb_config is not None and wandb_mode != "disabled":
        from distaccum.wandb_sink import WandbSink  # imported lazily: wandb is optional

        sinks.append(WandbSink(run_dir, wandb_config, mode=wandb_mode, project=wandb_project,
                               quiet=quiet, resume=append))
    return MultiSink(sinks)
