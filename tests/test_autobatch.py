"""micro_batch=auto in one process: the config it needs, the search over micro-batch sizes, and a
real trial window's peak memory."""

from __future__ import annotations

import pytest
import torch

from distaccum.components import Components
from distaccum.config import (
    AccumConfig,
    check_split,
    from_mapping,
    nearest_valid_global_batches,
    resolve_split,
)
from distaccum.datasets import SyntheticRegression
from distaccum.engines.base import Precision
from distaccum.losses import mse
from distaccum.models import MLP
from distaccum.resolve import resolve
from distaccum.tuning.autobatch import (
    LocalSteps,
    Measurement,
    budget_too_small,
    micro_batch_sizes,
    search,
    trial_window,
)
from distaccum.units import parse_bytes

pytestmark = pytest.mark.unit
MiB = 2**20


@pytest.mark.parametrize(
    "text, size",
    [
        ("512MiB", 512 * MiB),
        ("6GB", 6 * 10**9),
        ("1.5 GiB", 3 * 2**29),
        (4096, 4096),
        ("100", 100),
        ("2kib", 2048),
    ],
)
def test_sizes_parse(text: str | int, size: int) -> None:
    assert parse_bytes("accum.memory_budget", text) == size


@pytest.mark.parametrize(
    "mapping, fragment",
    [
        ({"accum": {"micro_batch": "auto"}}, "accum.micro_batch=auto needs accum.global_batch"),
        ({"accum": {"micro_batch": "big", "global_batch": 8}}, "a positive integer or 'auto', got 'big'"),
        (
            {"accum": {"micro_batch": "auto", "global_batch": 8, "memory_budget": "12 parsecs"}},
            "is not a size",
        ),
        ({"accum": {"memory_budget": "-3GB"}}, "accum.memory_budget must be > 0"),
        ({"log": {"gns": True}, "accum": {"sync": "every_micro"}}, "accum.sync=every_micro"),
        ({"log": {"gns_ema": 1.0}}, "log.gns_ema must be in [0, 1)"),
    ],
)
def test_bad_auto_budget_and_gns_config(mapping: dict, fragment: str) -> None:
    with pytest.raises(ValueError) as err:
        from_mapping(mapping)
    assert fragment in str(err.value)


def test_gns_needs_an_engine_whose_comm_hook_measures_it() -> None:
    """Checked when the run is resolved (the engine class says whether it supports it), before any worker."""
    cfg = from_mapping({"log": {"gns": True}, "engine": {"name": "fsdp"}})
    with pytest.raises(ValueError, match="engine=fsdp has no such hook .engines that do: ddp"):
        resolve(cfg, 2, torch.device("cpu"))
    resolve(from_mapping({"log": {"gns": True}}), 2, torch.device("cpu"))  # ddp: fine


def test_no_split_names_the_nearest_valid_global_batches() -> None:
    auto = AccumConfig(micro_batch="auto", global_batch=30)
    with pytest.raises(ValueError, match="nearest valid global batches are 28 or 32"):
        check_split(auto, 4)
    with pytest.raises(ValueError, match="nearest valid global batches are 28 or 32"):
        resolve_split(AccumConfig(micro_batch=2, global_batch=30), 4)
    assert nearest_valid_global_batches(3, 4) == [4]
    check_split(AccumConfig(micro_batch="auto", global_batch=32), 4)  # valid: no error


def test_auto_cannot_be_resolved_without_measuring() -> None:
    cfg = from_mapping({"accum": {"micro_batch": "auto", "global_batch": 64}})
    with pytest.raises(ValueError, match="chosen when training starts"):
        cfg.split(2)
    assert cfg.global_batch(2) == 64 and micro_batch_sizes(64, 2) == [1, 2, 4, 8, 16, 32]


def linear(base: int, per_sample: int, oom_from: int | None = None, log: list[int] | None = None):  # noqa: ANN201
    """A measurement whose peak grows linearly (and runs out of memory from ``oom_from`` on)."""

    def measure(m: int) -> Measurement:
        if log is not None:
            log.append(m)
        if oom_from is not None and m >= oom_from:
            return Measurement(m, 0, False, oom=True)
        peak = base + per_sample * m
        return Measurement(m, peak, peak <= BUDGET)

    return measure


BUDGET = 1000


def test_search_finds_the_largest_fitting_size_without_trying_hopeless_ones() -> None:
    tried: list[int] = []
    best, probes = search(micro_batch_sizes(256, 2), linear(300, 10, log=tried), BUDGET)
    assert best == 64  # 300 + 10 * 64 = 940 <= 1000 < 300 + 10 * 128
    assert tried == [1, 2, 64]  # extrapolated from 1 and 2: 128 would need 1580, never run
    assert [p.micro_batch for p in probes] == [1, 2, 64]


def test_search_retries_smaller_after_out_of_memory() -> None:
    tried: list[int] = []
    best, _ = search(micro_batch_sizes(256, 2), linear(300, 1, oom_from=32, log=tried), BUDGET)
    assert best == 16 and tried[:3] == [1, 2, 128] and 16 in tried and 32 in tried  # bisects down


def test_search_gives_none_when_one_sample_does_not_fit() -> None:
    best, probes = search([1, 2, 4], linear(2000, 1), BUDGET)
    assert best is None and [p.micro_batch for p in probes] == [1]
    message = str(budget_too_small(probes[0].peak_bytes, BUDGET, torch.device("cpu")))
    assert (
        "one sample needs" in message
        and "peaks at 2.0KiB" in message
        and "Raise accum.memory_budget" in message
    )


def parts() -> Components:
    return Components(
        model=lambda: MLP(in_dim=8, width=32, out_dim=2), dataset=SyntheticRegression(64, 8, 2), loss=mse
    )


def test_trial_window_measures_a_real_step() -> None:
    model = MLP(in_dim=8, width=32, out_dim=2)
    before = [p.detach().clone() for p in model.parameters()]
    steps = LocalSteps(torch.optim.SGD(model.parameters(), lr=0.1), Precision.of("fp32"), torch.device("cpu"))
    data = SyntheticRegression(16, 8, 2)
    batches = [(data.x[:4], data.y[:4]), (data.x[4:8], data.y[4:8])]
    peak, oom = trial_window(steps, model, mse, batches, torch.device("cpu"))
    assert not oom and peak > 10 * MiB  # the process's peak RSS (the interpreter and torch included)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # it stepped
