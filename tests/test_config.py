"""Config validation: bad input is a ValueError naming the values, before anything runs."""

from __future__ import annotations

import pytest

from distaccum.config import (
    AccumConfig,
    RunConfig,
    Split,
    from_mapping,
    resolve_split,
    to_mapping,
    valid_splits,
    with_overrides,
)

pytestmark = pytest.mark.unit


def test_defaults_build_and_round_trip() -> None:
    cfg = RunConfig()
    assert from_mapping(to_mapping(cfg)) == cfg


def test_global_batch_derives_steps() -> None:
    split = resolve_split(AccumConfig(micro_batch=4, global_batch=64), world_size=2)
    assert split == Split(4, 8, 2) and split.global_batch == 64


def test_indivisible_global_batch_names_values_and_suggests_splits() -> None:
    with pytest.raises(ValueError) as err:
        resolve_split(AccumConfig(micro_batch=3, global_batch=16), world_size=2)
    msg = str(err.value)
    assert "global_batch=16" in msg and "micro_batch=3" in msg and "world_size=2" in msg
    assert "micro_batch=1 (steps=8)" in msg and "micro_batch=8 (steps=1)" in msg


def test_global_batch_not_a_multiple_of_world() -> None:
    with pytest.raises(ValueError, match="multiple of world_size=4"):
        resolve_split(AccumConfig(micro_batch=1, global_batch=6), world_size=4)


def test_valid_splits_enumerates_divisors() -> None:
    assert [(s.micro_batch, s.accum_steps) for s in valid_splits(16, 2)] == [(1, 8), (2, 4), (4, 2), (8, 1)]


@pytest.mark.parametrize(
    "mapping, fragment",
    [
        ({"accum": {"micro_batch": 0}}, "accum.micro_batch must be > 0, got 0"),
        ({"accum": {"steps": -2}}, "accum.steps must be > 0, got -2"),
        ({"engine": {"name": "horovod"}}, "engine.name='horovod'"),
        ({"model": {"name": "resnet"}}, "model needs a _target_"),
        ({"model": "distaccum.models.MLP"}, "model must be a mapping with a _target_"),
        ({"data": {"dataset": {"_target_": "nodots"}}}, "data.dataset needs a _target_"),
        ({"data": {"num_workers": -1}}, "data.num_workers must be >= 0, got -1"),
        ({"precision": "fp8"}, "precision='fp8'"),
        ({"accum": {"sync": "sometimes"}}, "accum.sync='sometimes'"),
        ({"accum": {"micro_btach": 4}}, "unknown config key(s) accum.micro_btach"),
        ({"engine": {"name": "deepspeed", "zero_stage": 5}}, "zero_stage must be 0, 1, 2 or 3"),
    ],
)
def test_invalid_values_raise_value_error(mapping: dict, fragment: str) -> None:
    with pytest.raises(ValueError) as err:
        from_mapping(mapping)
    assert fragment in str(err.value)


def test_component_nodes_round_trip() -> None:
    values = {
        "model": {"_target_": "distaccum.models.MLP", "width": 8},
        "loss": {"_target_": "distaccum.losses.mse", "_partial_": True},
        "data": {"dataset": {"_target_": "distaccum.datasets.SyntheticRegression", "num_samples": 8}},
    }
    cfg = from_mapping(values)
    assert (
        cfg.model == values["model"] and cfg.describe("dataset") == "distaccum.datasets.SyntheticRegression"
    )
    assert from_mapping(to_mapping(cfg)) == cfg


def test_with_overrides_applies_dotted_keys_and_validates() -> None:
    cfg = with_overrides(RunConfig(), {"accum.micro_batch": 2, "run_dir": "x"})
    assert cfg.accum.micro_batch == 2 and cfg.run_dir == "x"
    with pytest.raises(ValueError, match="unknown config key 'accum.micro_btach'"):
        with_overrides(RunConfig(), {"accum.micro_btach": 2})
    with pytest.raises(ValueError, match="accum.micro_batch must be > 0"):
        with_overrides(RunConfig(), {"accum.micro_batch": 0})


def test_split_label() -> None:
    assert Split(4, 2, 3).label() == "w3-m4-k2"
