"""Sinks: console progress line and quiet mode, JSONL + summary files, rank-0-only fan-out."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from distaccum.telemetry.sinks import (
    ConsoleSink,
    JsonlSink,
    MultiSink,
    NullSink,
    WholeLines,
    build_sinks,
    clock,
)
from distaccum.units import human_bytes

pytestmark = pytest.mark.unit


def record(step: int, **extra: object) -> dict:
    base = {
        "step": step,
        "loss": 2.0 / step,
        "lr": 1e-3,
        "samples_per_s": 123.4,
        "comm_bytes": 3 * 2**20,
        "comm_calls": 2,
        "compute_s": 0.3,
        "comm_exposed_s": 0.1,
        "skipped": False,
    }
    return {**base, **extra}


SUMMARY = {
    "steps": 2,
    "final_loss": 1.0,
    "samples_per_s": 100.0,
    "engine": "ddp",
    "world_size": 2,
    "micro_batch": 4,
    "accum_steps": 2,
    "global_batch": 16,
    "run_dir": "runs/x",
}


def test_console_prints_one_progress_line_per_step() -> None:
    out = io.StringIO()
    sink = ConsoleSink(total_steps=2, stream=out)
    sink.log(record(1))
    sink.log(record(2, skipped=True))
    sink.close(SUMMARY)
    lines = out.getvalue().splitlines()
    assert len(lines) == 4  # not a tty: every step on its own line, then the summary
    assert lines[0].startswith("step 1/2 loss 2.0000")
    assert "123.4 samples/s" in lines[0] and "reduced 3.0MiB in 2 calls" in lines[0]
    assert "comm 25%" in lines[0]  # 0.1 exposed of 0.4 busy
    assert "elapsed 0:00 eta 0:00" in lines[0]  # elapsed time and ETA, for logs
    assert lines[1].startswith("step 2/2") and "SKIPPED" in lines[1]
    assert lines[2].startswith("done: 2 optimizer steps in 0:00, final loss 1.0000")
    assert "split 4x2x2=16" in lines[2]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_console_draws_a_progress_bar_on_a_terminal() -> None:
    out = Terminal()
    sink = ConsoleSink(total_steps=4, stream=out, first_step=3)  # a resumed run starts at step 3
    sink.log(record(3))
    sink.log(record(4))
    sink.close({**SUMMARY, "final_model": "runs/x/final"})
    text = out.getvalue()
    assert "4/4" in text and "loss 0.5000" in text and "samples/s" in text  # tqdm with our fields
    assert "trained model: runs/x/final/ (model.safetensors)" in text


def test_clock_formats_durations() -> None:
    assert (clock(5), clock(65), clock(3725)) == ("0:05", "1:05", "1:02:05")


def test_console_quiet_prints_only_the_summary() -> None:
    out = io.StringIO()
    sink = ConsoleSink(total_steps=2, quiet=True, stream=out)
    sink.log(record(1))
    sink.close(SUMMARY)
    assert not out.getvalue().startswith("step")
    assert out.getvalue().count("\n") == 2


def test_jsonl_writes_each_step_as_it_comes_and_summary_at_close(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path)
    sink.log(record(1))
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["step"] == 1  # flushed already
    sink.log(record(2))
    sink.close(SUMMARY)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]
    assert json.loads((tmp_path / "summary.json").read_text()) == SUMMARY
    assert not (tmp_path / "summary.json.tmp").exists()


def test_jsonl_append_keeps_earlier_steps(tmp_path: Path) -> None:
    first = JsonlSink(tmp_path)
    first.log(record(1))
    first.close(SUMMARY)
    again = JsonlSink(tmp_path, append=True)
    again.log(record(2))
    again.close(SUMMARY)
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_only_rank_zero_writes(tmp_path: Path) -> None:
    other = build_sinks("bar", 3, tmp_path / "r1", rank=1, wandb_config={"x": 1})
    assert isinstance(other, NullSink)
    other.log(record(1))
    other.close(SUMMARY)
    assert not (tmp_path / "r1").exists()


def test_rank_zero_fans_out_to_jsonl_and_console(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sink = build_sinks("bar", 1, tmp_path, rank=0, wandb_config={"x": 1}, wandb_mode="disabled")
    assert isinstance(sink, MultiSink)
    assert [type(s).__name__ for s in sink.sinks] == ["JsonlSink", "ConsoleSink"]  # disabled: no wandb
    sink.log(record(1))
    sink.close(SUMMARY)
    assert "step 1/1" in capsys.readouterr().out
    assert (tmp_path / "metrics.jsonl").is_file() and (tmp_path / "summary.json").is_file()


@pytest.mark.parametrize("n, text", [(0, "0B"), (1023, "1023B"), (1536, "1.5KiB"), (5 * 2**30, "5.0GiB")])
def test_human_bytes(n: int, text: str) -> None:
    assert human_bytes(n) == text


def test_wandb_online_needs_a_key(tmp_path: Path) -> None:
    from distaccum.telemetry.wandb_sink import api_key_available, resolve_mode

    no_netrc = {"NETRC": str(tmp_path / "missing")}
    assert resolve_mode("offline", no_netrc) == "offline"
    with pytest.warns(UserWarning, match="no WANDB_API_KEY") as caught:
        assert resolve_mode("online", no_netrc) == "offline"
    assert resolve_mode("online", {**no_netrc, "WANDB_API_KEY": "k" * 40}) == "online"
    assert "k" * 40 not in str(caught[0].message)
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai login user password " + "p" * 40 + "\n")
    netrc.chmod(0o600)
    assert api_key_available({"NETRC": str(netrc)})
    assert not api_key_available({"NETRC": str(netrc), "WANDB_BASE_URL": "https://wandb.example.org"})


def test_console_prints_eval_lines_apart_from_steps() -> None:
    out = io.StringIO()
    sink = ConsoleSink(total_steps=2, stream=out)
    sink.log(record(1))
    sink.log(
        {"step": 1, "eval_loss": 2.5, "eval_ppl": 12.18, "eval_items": 300, "eval_samples": 8, "eval_s": 0.2}
    )
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("step 1/2 ") and lines[1] == (
        "eval after step 1: loss 2.5000 ppl 12.18 on 300 items of 8 samples (0.2 s)"
    )
    quiet = io.StringIO()
    ConsoleSink(total_steps=2, stream=quiet, quiet=True).log({"step": 1, "eval_loss": 2.5})
    assert quiet.getvalue() == ""


def test_console_shows_compile_time_and_recompiles() -> None:
    out = io.StringIO()
    sink = ConsoleSink(total_steps=3, stream=out)
    sink.log(record(1, compile_s=19.8, recompiles=0))
    sink.log(record(2, compile_s=0.0, recompiles=0))
    sink.log(record(3, compile_s=1.25, recompiles=2))
    sink.close({**SUMMARY, "compile_s": 21.05, "recompiles": 2, "graph_breaks": 3, "median_time_s": 0.0405})
    lines = out.getvalue().splitlines()
    assert "comm 25% compiled 19.8s elapsed" in lines[0]
    assert "compiled" not in lines[1] and "recompiled" not in lines[1]
    assert " compiled 1.2s recompiled 2 " in lines[2]
    assert (
        "torch.compile: 21.1 s compiling (inside the steps' times), 2 recompiles after warm-up, 3 graph breaks; "
        "median step 40.5 ms after warm-up"
    ) in lines


def test_the_adaptive_decision_follows_the_step_it_read_and_says_when_it_keeps_the_batch() -> None:
    """Issue 56.10: "adaptive batch after step 4" printed before the step 4 line, and "-> next global batch 4" when the
    batch already was 4."""
    out = io.StringIO()
    sink = ConsoleSink(total_steps=8, stream=out, show_batch=True)
    batch = {"global_batch": 4, "micro_steps": 1, "comm_bytes_per_sample": 8.0}
    decision = {"adaptive_noise_scale": 3.2, "adaptive_target": 3.2}
    sink.log(record(4, **batch, **decision, adaptive_next_batch=4))
    sink.log(record(8, **batch, **decision, adaptive_next_batch=8))
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("step 4/8") and lines[2].startswith("step 8/8")
    assert lines[1] == (
        "adaptive batch after step 4: noise scale 3.2 loss items, target 3.2 samples keeps global batch 4"
    )
    assert lines[3].endswith("target 3.2 samples -> next global batch 8")


def test_the_console_hands_its_stream_whole_lines() -> None:
    """Replica groups share one console: each line (and its newline) must reach it in one write, or two groups'
    lines cut into each other (``print`` writes the text and the newline apart)."""

    class Writes(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[str] = []

        def write(self, text: str) -> int:
            self.calls.append(text)
            return super().write(text)

    out = Writes()
    stream = WholeLines(out)
    print("done: 5 optimizer steps", file=stream, flush=True)
    print("a", "b", file=stream)
    stream.write("no newline yet")
    assert out.calls == ["done: 5 optimizer steps\n", "a b\n"]
    stream.flush()
    assert out.calls[-1] == "no newline yet" and out.getvalue().endswith("a b\nno newline yet")
    assert not stream.isatty()  # the stream's own attributes
