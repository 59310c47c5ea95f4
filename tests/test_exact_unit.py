"""The fixed-point accumulator on one rank (gloo): the same bits whatever the pieces' order, closer to the exact sum
than fp32, a redo instead of an overflow, a skip for a non-finite gradient; the headroom's arithmetic; the refusals;
the per-piece seed."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from distaccum.config import from_mapping
from distaccum.exact.checks import check_exact_model
from distaccum.exact.engine import piece_seed
from distaccum.exact.fixed_point import (
    LIMIT_BITS,
    MAX_PIECES,
    TARGET_BITS,
    FixedPoint,
    Outcome,
    exponent_for,
    fits,
)
from distaccum.resolve import resolve

pytestmark = pytest.mark.unit


def pieces(seed: int = 0, count: int = 8) -> list[list[torch.Tensor]]:
    """``count`` pieces' gradients of two tensors, over six orders of magnitude."""
    g = torch.Generator().manual_seed(seed)
    return [
        [
            torch.randn(5, 3, generator=g) * 10.0 ** torch.randint(-3, 3, (5, 3), generator=g),
            torch.randn(7, generator=g),
        ]
        for _ in range(count)
    ]


def summed(
    params: list[nn.Parameter], grads: list[list[torch.Tensor]], fixed: FixedPoint
) -> list[torch.Tensor]:
    """Run one step's passes over ``grads`` (again after a redo) and return the converted sum."""
    while True:
        fixed.attach()
        for piece in grads:
            for p, g in zip(params, piece, strict=True):
                p.grad.add_(g)  # what a backward does: add into the existing gradient
            fixed.add_piece()
        outcome = fixed.reduce()
        if outcome is not Outcome.REDO:
            assert outcome is Outcome.SUMMED
            return [p.grad.clone() for p in params]


def test_the_sum_has_the_same_bits_in_any_order_and_beats_fp32(cpu_group: None) -> None:
    params = [nn.Parameter(torch.zeros(5, 3)), nn.Parameter(torch.zeros(7))]
    grads = pieces()
    forward = summed(params, grads, FixedPoint(params, torch.device("cpu")))
    backward = summed(params, grads[::-1], FixedPoint(params, torch.device("cpu")))
    shuffled = summed(
        params, [grads[i] for i in (3, 1, 7, 0, 5, 2, 6, 4)], FixedPoint(params, torch.device("cpu"))
    )
    for a, b, c in zip(forward, backward, shuffled, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    fp32 = [sum(piece[t] for piece in grads) for t in range(2)]
    fp32_rev = [sum(piece[t] for piece in grads[::-1]) for t in range(2)]
    assert any(
        not torch.equal(a, b) for a, b in zip(fp32, fp32_rev, strict=True)
    )  # the float sum does depend on the order
    for t, total in enumerate(forward):
        exact = sum(piece[t].double() for piece in grads)
        assert (
            total.double() - exact
        ).abs().max() <= exact.abs().max() * 2.0**-23  # one fp32 rounding at most


def test_a_piece_beyond_the_headroom_makes_a_redo_with_a_wider_scale(cpu_group: None) -> None:
    params = [nn.Parameter(torch.zeros(5, 3)), nn.Parameter(torch.zeros(7))]
    fixed = FixedPoint(params, torch.device("cpu"))
    small = pieces(1)
    summed(params, small, fixed)  # the first step: a measuring pass, then the sum
    assert fixed.redos == 1
    before = list(fixed.exponents or [])
    grown = [[g * 2.0**HEADROOM for g in piece] for piece in small]  # 2^10 x the last maximum: beyond 2^6
    result = summed(params, grown, fixed)
    assert fixed.redos == 2 and all(e < b for e, b in zip(fixed.exponents or [], before, strict=True))
    expected = summed(params, grown, FixedPoint(params, torch.device("cpu")))
    for a, b in zip(result, expected, strict=True):
        assert torch.equal(a, b)  # the redone sum is the sum any fresh accumulator finds


HEADROOM = 10


def test_a_nonfinite_gradient_skips_the_step(cpu_group: None) -> None:
    params = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2))]
    fixed = FixedPoint(params, torch.device("cpu"))
    fixed.attach()
    params[1].grad.add_(torch.tensor([1.0, math.inf]))
    fixed.add_piece()
    assert fixed.reduce() is Outcome.NONFINITE
    assert params[1].grad.isnan().all() and (params[0].grad == 0).all()


def test_the_headroom_arithmetic() -> None:
    # The previous maximum lands in [2^39, 2^40); growth up to 64x still fits below 2^46; 2^16 such pieces < 2^63.
    for maximum in (1e-20, 3e-5, 0.5, 1.0, 7.0, 1e20):
        e = exponent_for(maximum, None)
        assert 2.0 ** (TARGET_BITS - 1) <= math.ldexp(maximum, e) < 2.0**TARGET_BITS
        assert fits(maximum * 64, e) and not fits(maximum * 128 * 2, e)
    assert MAX_PIECES * 2.0**LIMIT_BITS < 2.0**63
    assert exponent_for(0.0, 17) == 17 and exponent_for(0.0, None) == TARGET_BITS
    assert exponent_for(1e-38, None) == 120  # clamped: 2^e stays a normal fp32 number


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ({"engine": {"name": "accelerate"}}, "engine=accelerate is not supported"),
        ({"engine": {"name": "fsdp", "replicas": 2}}, "engine.replicas=2"),
        ({"engine": {"name": "fsdp"}}, "optim.clip_norm=1.0 with engine=fsdp"),
        ({"accum": {"sync": "every_micro"}}, "accum.sync=every_micro"),
        ({"accum": {"reduce_dtype": "bf16"}}, "accum.reduce_dtype=bf16"),
        ({"precision": "fp16"}, "precision=fp16"),
        ({"trainer": {"compile": True}}, "trainer.compile=true"),
    ],
)
def test_what_exact_mode_refuses(override: dict, words: str) -> None:
    values: dict = {"accum": {"exact": True, "micro_batch": 2, "global_batch": 8}}
    for key, value in override.items():
        values[key] = {**values.get(key, {}), **value} if isinstance(value, dict) else value
    with pytest.raises(ValueError, match=r"accum\.exact=true: " + words.replace(".", r"\.")):
        resolve(from_mapping(values), 2, torch.device("cpu"))


def test_batch_normalization_is_refused() -> None:
    with pytest.raises(ValueError, match="batch normalization"):
        check_exact_model(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
    check_exact_model(nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2)))


def test_a_pieces_dropout_mask_depends_on_the_piece_only() -> None:
    def mask(step: int, piece: int) -> torch.Tensor:
        torch.manual_seed(piece_seed(0, step, piece))
        return nn.functional.dropout(torch.ones(64), 0.5)

    assert torch.equal(mask(3, 5), mask(3, 5))
    assert not torch.equal(mask(3, 5), mask(3, 6)) and not torch.equal(mask(3, 5), mask(4, 5))
