"""The compile figures a run records: recompiles told apart from first compiles, compile time per step, and
the warning a recompile after warm-up gets (with a hint when a shape is what changed). torch.compile with
the ``eager`` backend: the real dynamo, no code generation (fast)."""

from __future__ import annotations

import pytest
import torch

from distaccum.engines.compile import compile_options
from distaccum.telemetry.compilation import CompileWatch, is_recompile

pytestmark = pytest.mark.unit


def test_dynamo_compile_ids_name_recompiles() -> None:
    assert not is_recompile("0/0") and is_recompile("0/1") and is_recompile("3/12")
    assert not is_recompile("0/0_1")  # a restarted analysis of a first compile
    assert is_recompile("2/1_1")


def test_compile_options_make_shapes_dynamic_from_the_start() -> None:
    assert compile_options("default") == {"mode": None, "dynamic": True}
    assert compile_options("max-autotune")["mode"] == "max-autotune"


def test_the_watch_counts_recompiles_and_reports_them_after_warm_up(
    capsys: pytest.CaptureFixture[str],
) -> None:
    torch._dynamo.reset()
    watch = CompileWatch(rank=0, warmup_steps=1)
    fn = torch.compile(
        lambda x: (x * 2).sum(), backend="eager", dynamic=False
    )  # static: every shape recompiles
    fn(torch.ones(3))
    first = watch.fields({"step": 1}, None, [])
    assert first["compile_s"] > 0 and first["recompiles"] == 0  # a first compile, during warm-up
    fn(torch.ones(3))
    assert watch.fields({"step": 2}, None, []) == {"compile_s": 0.0, "recompiles": 0, "graph_breaks": 0}
    fn(torch.ones(5))  # a new shape after warm-up
    third = watch.fields({"step": 3}, None, [])
    assert third["recompiles"] == 1 and third["compile_s"] > 0
    err = capsys.readouterr().err
    assert "torch.compile recompiled 1 graph(s) at step 3, after warm-up" in err
    assert "size mismatch" in err and "pad_to" in err  # the reason, and what to do about it


def test_a_one_sample_micro_batch_recompile_names_its_cause(capsys: pytest.CaptureFixture[str]) -> None:
    torch._dynamo.reset()
    watch = CompileWatch(rank=0, warmup_steps=1)
    fn = torch.compile(
        lambda x: (x * 2).sum(), backend="eager", dynamic=True
    )  # dynamic, but size 1 is special
    fn(torch.ones(4, 3))
    watch.fields({"step": 1}, None, [])
    fn(torch.ones(1, 3))  # a partial window's one-sample micro-batch
    assert watch.fields({"step": 2}, None, [])["recompiles"] == 1
    err = capsys.readouterr().err
    assert "0/1 specialization" in err and "data.drop_last=true" in err


def test_graph_breaks_are_counted_from_the_watch_s_start() -> None:
    torch._dynamo.reset()
    watch = CompileWatch(rank=1)

    def broken(x: torch.Tensor) -> torch.Tensor:
        y = x + 1
        print("", end="")  # a graph break
        return y * 2

    torch.compile(broken, backend="eager")(torch.ones(2))
    assert watch.fields({"step": 1}, None, [])["graph_breaks"] >= 1


def test_a_lagged_record_counts_what_its_own_step_compiled(capsys: pytest.CaptureFixture[str]) -> None:
    """Under the loop's lagged records (CUDA) step n's fields are asked for after step n+1 ran: each step's
    compiles are those before its own ``after_step``, so a recompile in step 2 is step 2's, reported after
    warm-up, not folded into step 1 (warm-up) and missed."""
    torch._dynamo.reset()
    watch = CompileWatch(rank=0, warmup_steps=1)
    fn = torch.compile(lambda x: (x * 2).sum(), backend="eager", dynamic=False)
    fn(torch.ones(3))
    watch.after_step(1, None, 1.0, 1.0)
    fn(torch.ones(5))  # step 2 recompiles
    watch.after_step(2, None, 1.0, 1.0)
    first = watch.fields({"step": 1}, None, [])  # handed over after step 2 ran
    assert first["compile_s"] > 0 and first["recompiles"] == 0
    second = watch.fields({"step": 2}, None, [])
    assert second["recompiles"] == 1
    assert "recompiled 1 graph(s) at step 2, after warm-up" in capsys.readouterr().err
