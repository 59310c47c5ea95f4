"""Where per-step records go: one two-method interface, a null object, and rank-0-only sinks.

The same record dict feeds the console, ``metrics.jsonl``, wandb and ``distaccum verify``. Evaluation
lines (``eval_loss``, ``eval_ppl``: :mod:`distaccum.evaluate`) go through the same sinks.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import IO, Any, Protocol

from distaccum.rundir import METRICS, SUMMARY, Record, write_json
from distaccum.units import human_bytes


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
        # Kept open and flushed after every line: a killed or stopped job keeps every finished step (the
        # operating system holds the bytes), without an open/close per step (~0.2 ms each here, a
        # percent of a small model's step).
        self._file: IO[str] | None = open(run_dir / METRICS, "a" if append else "w", encoding="utf-8")

    def log(self, record: Record) -> None:
        if self._file is None:  # logged after close (an evaluation at the very end): append once
            with open(self.run_dir / METRICS, "a", encoding="utf-8") as f:
                f.write(json.dumps(record, sort_keys=True) + "\n")
            return
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def close(self, summary: Record) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        write_json(self.run_dir / SUMMARY, summary)


def clock(seconds: float) -> str:
    """``1:02:03`` / ``2:03`` for a duration in seconds."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class WholeLines:
    """A text stream that hands the stream below it whole lines, one write each: processes that share a console
    (fault-tolerant replica groups, each group's rank 0 reporting) then never cut into each other's lines, even
    unbuffered (``print`` writes a line and its newline apart)."""

    def __init__(self, inner: IO[str]) -> None:
        self.inner, self._pending = inner, ""

    def write(self, text: str) -> int:
        self._pending += text
        if "\n" in self._pending:
            lines, _, self._pending = self._pending.rpartition("\n")
            self.inner.write(lines + "\n")
        return len(text)

    def flush(self) -> None:
        if self._pending:
            self.inner.write(self._pending)
            self._pending = ""
        self.inner.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...: the stream's
        return getattr(self.inner, name)


class ConsoleSink:
    """Progress per optimizer step: a tqdm bar on a terminal, one plain line per step otherwise (log
    files, CI), each with loss, lr, samples/s, bytes reduced, comm share, elapsed time and ETA.
    Quiet mode prints only the summary."""

    def __init__(
        self,
        total_steps: int,
        *,
        quiet: bool = False,
        stream: IO[str] | None = None,
        first_step: int = 1,
        show_batch: bool = False,
    ) -> None:
        self.total = total_steps
        self.show_batch = show_batch
        """A growing batch's run: each line shows the global batch, K and the bytes reduced per sample, and a
        change of the global batch gets a line of its own."""
        self._batch: tuple[int, int] | None = None
        self.quiet = quiet
        self.stream: Any = WholeLines(stream or sys.stdout)
        self.first_step = first_step
        self.started = time.monotonic()
        self.bar: Any = None
        if not quiet and self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(
                total=total_steps,
                initial=first_step - 1,
                file=self.stream,
                unit="step",
                dynamic_ncols=True,
                leave=True,
            )

    def _fields(self, record: Record) -> str:
        busy = record.get("compute_s", 0.0) + record.get("comm_exposed_s", 0.0)
        share = record.get("comm_exposed_s", 0.0) / busy if busy > 0 else 0.0
        calls, across = record.get("comm_calls", 0), record.get("comm_calls_replicate", 0)
        replicas = (
            f" + {human_bytes(record.get('comm_bytes_replicate', 0))} across replicas in {across}"
            if across
            else ""
        )
        batch = (
            f"batch {record['global_batch']} K={record['micro_steps']} "
            f"{human_bytes(record.get('comm_bytes_per_sample', 0))}/sample "
            if self.show_batch and "global_batch" in record
            else ""
        )
        where, loss = "", "loss"
        if (
            "outer_synced" in record
        ):  # an outer-synced run: the step reduces inside the island; a sync crosses
            where, loss = " in the island", "loss (island 0)"
            synced = int(record["outer_synced"])
            if synced:
                replicas += (
                    f" + outer sync of {synced} fragment{'' if synced == 1 else 's'}: "
                    f"{human_bytes(record.get('comm_bytes_outer', 0))} across islands"
                )
        return (
            f"{loss} {record['loss']:.4f} lr {record['lr']:.2e} {batch}{record.get('run_samples_per_s', record.get('samples_per_s', 0)):.1f} samples/s "
            f"reduced {human_bytes(record.get('comm_bytes', 0))} in {calls} call{'' if calls == 1 else 's'}{where}"
            f"{replicas} comm {share:.0%}" + _compiled(record) + (" SKIPPED" if record.get("skipped") else "")
        )

    def log(self, record: Record) -> None:
        if self.quiet:
            return
        if "eval_loss" in record:  # an evaluation line (distaccum.evaluate), not a step
            line = (
                f"eval after step {record['step']}: loss {record['eval_loss']:.4f} ppl {record['eval_ppl']:.2f} "
                f"on {record['eval_items']} items of {record['eval_samples']} samples ({record['eval_s']:.1f} s)"
            )
            if self.bar is not None:
                self.bar.write(line, file=self.stream)
            else:
                print(line, file=self.stream, flush=True)
            return
        step = int(record["step"])
        self._say_batch(record)
        if self.bar is not None:
            self.bar.set_postfix_str(self._fields(record), refresh=False)
            self.bar.update(step - self.bar.n)
            self._say_decision(record)
            return
        elapsed = time.monotonic() - self.started
        done = step - self.first_step + 1
        eta = elapsed / done * (self.total - step) if done > 0 else 0.0
        print(
            f"step {step:>{len(str(self.total))}}/{self.total} {self._fields(record)} "
            f"elapsed {clock(elapsed)} eta {clock(eta)}",
            file=self.stream,
            flush=True,
        )
        self._say_decision(record)

    def _say_batch(self, record: Record) -> None:
        """A line when the global batch changes (a ramp's phase, the adaptive rule's decision), before the step's."""
        if not self.show_batch or "global_batch" not in record:
            return
        step, lines = int(record["step"]), []
        now = (int(record["global_batch"]), int(record["micro_steps"]))
        if self._batch is not None and now != self._batch:
            lines.append(
                f"global batch {self._batch[0]} -> {now[0]} from step {step} (K {self._batch[1]} -> {now[1]}, "
                f"micro-batch and ranks unchanged; lr {record['lr']:.3e})"
            )
        self._batch = now
        self._write(lines)

    def _say_decision(self, record: Record) -> None:
        """The adaptive rule's reading and choice after the step it read (printed after that step's line)."""
        if not self.show_batch or "adaptive_next_batch" not in record:
            return
        target, chosen = record["adaptive_target"], int(record["adaptive_next_batch"])
        choice = (
            f"keeps global batch {chosen}"
            if chosen == int(record["global_batch"])
            else f"-> next global batch {chosen}"
        )
        self._write(
            [
                f"adaptive batch after step {record['step']}: noise scale {record['adaptive_noise_scale']:.4g} "
                "loss items, target "
                + (
                    f"{target:.1f} samples"
                    if math.isfinite(target)
                    else "none (the estimate is negative or undefined)"
                )
                + f" {choice}"
            ]
        )

    def _write(self, lines: list[str]) -> None:
        for line in lines:
            if self.bar is not None:
                self.bar.write(line, file=self.stream)
            else:
                print(line, file=self.stream, flush=True)

    def close(self, summary: Record) -> None:
        if self.bar is not None:
            self.bar.close()
        loss = summary.get("final_loss", math.nan)
        print(
            f"done: {summary['steps']} optimizer steps in {clock(time.monotonic() - self.started)}, final loss "
            f"{loss:.4f}, {summary['samples_per_s']:.1f} samples/s, {summary['engine']} world {summary['world_size']} "
            f"split {summary['micro_batch']}x{summary['accum_steps']}x{summary['world_size']}"
            f"={summary['global_batch']}{describe_phases(summary.get('batch_phases', []))}",
            file=self.stream,
        )
        ft = summary.get("ft")
        if ft:  # the split above is the group's alone: K followed the groups present
            healed = ", ".join(map(str, ft["healed_at"])) or "none"
            print(
                f"ft: replica group {ft['group']} of {ft['groups']}; K per step followed the groups present "
                f"(micro_steps, ft_groups in the records); {ft['steps_recomputed']} attempt(s) computed again "
                f"({ft['lost_s']:.2f} s); {human_bytes(ft['bytes_across'])} sent across groups; healed at step(s): "
                f"{healed}",
                file=self.stream,
            )
        outer = summary.get("outer")
        if outer:  # what the outer sync saved: the point of running it
            factor = outer["reduction_factor"]
            print(
                f"outer sync ({outer['method']}, every {outer['every']} steps, {outer['fragments']} fragment(s), "
                f"{outer['islands']} islands): {outer['syncs']} fragment syncs sent "
                f"{human_bytes(outer['bytes_across_per_island'])} across the islands per island, "
                + (f"{factor:.1f}x less than" if math.isfinite(factor) else "nothing, against")
                + f" a synchronous run's {human_bytes(outer['synchronous_bytes_per_island'])}",
                file=self.stream,
            )
        if "compile_s" in summary:
            print(
                f"torch.compile: {summary['compile_s']:.1f} s compiling (inside the steps' times), "
                f"{summary['recompiles']} recompiles after warm-up, {summary['graph_breaks']} graph breaks; "
                f"median step {summary['median_time_s'] * 1e3:.1f} ms after warm-up",
                file=self.stream,
            )
        print(f"records: {summary['run_dir']}/metrics.jsonl, summary.json", file=self.stream)
        if summary.get("final_model"):
            print(f"trained model: {summary['final_model']}/ (model.safetensors)", file=self.stream)
        self.stream.flush()


def describe_phases(phases: list[list[int]]) -> str:
    """`` (global batch 8 -> 16 -> 24)`` for a run whose global batch changed (summary's ``batch_phases``)."""
    batches = [int(batch) for _, batch in phases]
    return f" (global batch {' -> '.join(map(str, batches))})" if len(batches) > 1 else ""


def _compiled(record: Record) -> str:
    """`` compiled 19.8s`` on a step that compiled (``trainer.compile``), `` recompiled 2`` on one that recompiled."""
    out = f" compiled {record['compile_s']:.1f}s" if record.get("compile_s") else ""
    return out + (f" recompiled {record['recompiles']}" if record.get("recompiles") else "")


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


def build_sinks(
    console: str,
    total_steps: int,
    run_dir: Path,
    rank: int,
    *,
    wandb_config: dict[str, Any] | None = None,
    wandb_mode: str = "offline",
    wandb_project: str = "distaccum",
    append: bool = False,
    first_step: int = 1,
    show_batch: bool = False,
) -> Sink:
    """Rank 0 gets console + JSONL (+ wandb when ``wandb_config`` is given and ``wandb_mode`` is not
    ``disabled``); other ranks a NullSink."""
    if rank != 0:
        return NullSink()
    quiet = console == "quiet"
    sinks: list[Sink] = [
        JsonlSink(run_dir, append=append),
        ConsoleSink(total_steps, quiet=quiet, first_step=first_step, show_batch=show_batch),
    ]
    if wandb_config is not None and wandb_mode != "disabled":
        from distaccum.telemetry.wandb_sink import WandbSink  # imported lazily: wandb is optional

        sinks.append(
            WandbSink(
                run_dir, wandb_config, mode=wandb_mode, project=wandb_project, quiet=quiet, resume=append
            )
        )
    return MultiSink(sinks)
