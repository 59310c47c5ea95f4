"""No run reaches DeepSpeed without distaccum's own ``gradient_clipping``: DeepSpeed's default became 1.0 (DeepSpeed
#8068), so a config that lacks the key silently clips a run whose ``optim.clip_norm`` is null.

The real ``deepspeed.initialize`` is wrapped (it still runs) and every config it receives is inspected, for a run
without clipping and one with. The bug zoo's fault that drops the key (``DeepSpeedDefaultClipping``) shows the
inspection fails when the key is missing, and that the engine's step refuses such a run at once."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from conftest import engine_spec, one_rank_group, requires
from distaccum.config import EngineConfig
from distaccum.engines.deepspeed import DeepSpeedEngine
from distaccum.split import Split
from distaccum.telemetry.ledger import CommLedger
from distaccum.testing.zoo import DeepSpeedDefaultClipping

deepspeed = requires("deepspeed")

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


ENVIRON = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR")
"""What DeepSpeed reads (a launcher's variables) and the engine sets: put back after the module."""


def test_a_second_world_in_the_same_process_runs_deepspeed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed keeps a clone of the world group; leaving a world through torch alone left it behind, and the next
    world's first DeepSpeed engine in this process failed ("Group ... is not registered": the Python API run twice,
    or in-process tests one after another). distaccum's teardown goes through deepspeed.comm once it ran.
    Defined before the module's group fixture is first used: it makes its own worlds."""
    for key in ENVIRON:  # put back after the test, whatever the engine sets
        monkeypatch.delenv(key, raising=False)
    for key, value in (("LOCAL_RANK", "0"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(key, value)
    for _ in range(2):
        with one_rank_group("cpu"):
            wrapped(None).teardown()


@pytest.fixture(scope="module")
def group() -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in ENVIRON}
    os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")  # what a launcher gives the one rank
    try:
        with one_rank_group("cpu"):
            yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every config the real ``deepspeed.initialize`` is called with (it still runs)."""
    configs: list[dict[str, Any]] = []
    real = deepspeed.initialize

    def initialize(*args: Any, **kwargs: Any) -> Any:
        configs.append(dict(kwargs["config"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(deepspeed, "initialize", initialize)
    return configs


def wrapped(clip_norm: float | None, fault: Any = None) -> DeepSpeedEngine:
    spec = engine_spec(EngineConfig(name="deepspeed", zero_stage=1), Split(2, 1, 1), clip_norm=clip_norm)
    engine = DeepSpeedEngine(spec, CommLedger(enabled=False))
    outer = fault.wrap("engine", engine) if fault is not None else engine
    torch.manual_seed(0)
    outer.wrap(torch.nn.Linear(4, 2), lambda params: torch.optim.SGD(params, lr=0.1))
    return engine


def reached_deepspeed_with_our_clipping(configs: list[dict[str, Any]], clip_norm: float | None) -> None:
    assert configs, "deepspeed.initialize was never called"
    for config in configs:
        assert "gradient_clipping" in config, (
            f"a run reached DeepSpeed without gradient_clipping: {sorted(config)}"
        )
        assert config["gradient_clipping"] == (clip_norm or 0.0)


@pytest.mark.parametrize("clip_norm", [None, 0.5])
def test_every_run_reaches_deepspeed_with_its_own_clipping(
    group: None, seen: list[dict[str, Any]], clip_norm: float | None
) -> None:
    engine = wrapped(clip_norm)
    try:
        reached_deepspeed_with_our_clipping(seen, clip_norm)
        assert engine.engine.gradient_clipping() == (clip_norm or 0.0)  # what DeepSpeed clips with
    finally:
        engine.teardown()


def test_a_config_without_it_fails_the_inspection_and_the_step(
    group: None, seen: list[dict[str, Any]]
) -> None:
    engine = wrapped(None, DeepSpeedDefaultClipping())
    try:
        with pytest.raises(AssertionError, match="without gradient_clipping"):
            reached_deepspeed_with_our_clipping(seen, None)
        assert engine.engine.gradient_clipping() == 1.0  # DeepSpeed's default since #8068
        x = torch.randn(2, 4)
        engine.backward(engine.engine(x).square().sum())
        with pytest.raises(
            RuntimeError, match="DeepSpeed's gradient_clipping is 1.0 but optim.clip_norm=None"
        ):
            engine.step(None, 1.0)
    finally:
        engine.teardown()
