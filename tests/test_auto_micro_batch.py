"""``accum.micro_batch=auto`` end to end through ``distaccum train``: the largest micro-batch within the
budget is chosen, recorded and trained exactly like the same split given explicitly; bad input exits
2 before training (a budget below one sample's step: from the workers, which measure it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_cli, train

pytestmark = pytest.mark.dist

# tiny_gpt on fixed-length samples, so every micro-batch of the same size has the same activations
TASK = (
    "data.dataset.seq_min=32",
    "data.dataset.seq_max=32",
    "accum.global_batch=256",
    "trainer.max_steps=3",
    "trainer.check_every=0",
    "trainer.device=cpu",
)


def test_auto_fits_the_budget_and_trains_the_chosen_split_exactly(tmp_path: Path) -> None:
    free = train(tmp_path / "free", *TASK, "accum.micro_batch=auto").summary["auto_micro_batch"]
    assert (
        free["micro_batch"] == 128 and free["accum_steps"] == 1
    )  # the budget (available RAM) holds them all
    small, large = free["probes"][0]["peak_bytes"], free["probes"][-1]["peak_bytes"]
    assert large > small + 20 * 2**20  # 128 samples of activations are measurably more than one
    budget = small + (large - small) // 3
    run = train(tmp_path / "auto", *TASK, "accum.micro_batch=auto", f"accum.memory_budget={budget}")
    auto = run.summary["auto_micro_batch"]
    chosen = auto["micro_batch"]
    assert (
        1 < chosen < 128 and auto["budget_bytes"] == budget and f"micro_batch=auto -> {chosen}" in run.stdout
    )
    fitting = [p["micro_batch"] for p in auto["probes"] if p["fits"]]
    assert max(fitting) == chosen and auto["peak_bytes"] <= budget
    assert all(not p["fits"] for p in auto["probes"] if p["micro_batch"] > chosen)
    assert run.summary["micro_batch"] == chosen and run.summary["accum_steps"] == 256 // (2 * chosen)
    # the trial window predicts what training then records (within 5%)
    assert abs(run.summary["peak_mem_bytes"] - auto["peak_bytes"]) <= 0.05 * auto["peak_bytes"]
    # trials run on a throwaway copy: the run is bit-identical to the explicit split
    explicit = train(tmp_path / "explicit", *TASK, f"accum.micro_batch={chosen}").summary
    assert (
        explicit["param_sum"] == run.summary["param_sum"]
        and explicit["final_loss"] == run.summary["final_loss"]
    )


@pytest.mark.parametrize(
    "overrides, message, launched",
    [
        (
            ("accum.micro_batch=auto", "accum.global_batch=64", "accum.memory_budget=64MiB"),
            "accum.memory_budget=64.0MiB is below what one sample needs: a training step with micro_batch=1 peaks at ",
            True,  # the workers measure one sample's step, where the memory is spent
        ),
        (("accum.micro_batch=auto",), "accum.micro_batch=auto needs accum.global_batch", False),
        (
            ("accum.micro_batch=auto", "accum.global_batch=63"),
            "accum.global_batch=63 has no split on world_size=2 ranks: it must be a multiple of world_size=2; the nearest "
            "valid global batches are 62 or 64",
            False,
        ),
        (
            ("accum.micro_batch=4", "accum.global_batch=63"),
            "the nearest valid global batches are 62 or 64",
            False,
        ),
    ],
)
def test_bad_input_exits_2_before_training(
    tmp_path: Path, overrides: tuple[str, ...], message: str, launched: bool
) -> None:
    run = run_cli("train", tmp_path / "run", "model=mlp", *overrides)
    assert run.returncode == 2, run.stderr
    assert message in run.stderr and "invalid configuration" in run.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert (
        "equivalent to `" in run.stdout
    ) == launched  # refused by the launcher unless the workers measure it
