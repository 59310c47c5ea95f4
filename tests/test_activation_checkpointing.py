"""Activation checkpointing on the plain model (single process): what it selects, that it changes no
value (fp64, bit for bit, dropout included), that it keeps fewer bytes for backward, and the reentrant
variant refused where DDP runs. Engines, the CLI and Hugging Face models: test_activation_checkpointing_dist.py."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

from distaccum.activation_checkpointing import (
    apply_activation_checkpointing,
    check_engine_compatible,
    is_checkpointed,
    parse_checkpointing,
    reentrant_modules,
    saved_activation_bytes,
    select_modules,
)
from distaccum.losses import token_cross_entropy
from distaccum.models import MLP, TinyGPT, block_units

pytestmark = pytest.mark.unit


def gpt(width: int = 32, depth: int = 2, dropout: float = 0.0) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(width=width, depth=depth, heads=4, max_len=64, dropout=dropout).double()


def batch(size: int = 4, length: int = 16, seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (size, length + 1), generator=gen)
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


@pytest.mark.parametrize(
    "value, parsed",
    [
        (None, None),
        ("none", None),
        ("blocks", "blocks"),
        (["blocks.*"], ("blocks.*",)),
        (("a", "b.c"), ("a", "b.c")),
    ],
)
def test_settings_parse(value: object, parsed: object) -> None:
    assert parse_checkpointing(value) == parsed


@pytest.mark.parametrize(
    "value, fragment",
    [("block", "write [block]"), ([], "non-empty list"), ([""], "non-empty list"), (True, "True"), (3, "3")],
)
def test_bad_settings_name_the_value(value: object, fragment: str) -> None:
    with pytest.raises(ValueError, match="model.activation_checkpointing") as err:
        parse_checkpointing(value)
    assert fragment in str(err.value)


def test_blocks_are_the_units_fsdp_shards() -> None:
    model = gpt(depth=3)
    assert [name for name, _ in select_modules(model, "blocks")] == ["blocks.0", "blocks.1", "blocks.2"]
    assert block_units(model) == list(model.blocks)


def test_patterns_select_the_outermost_matches_in_model_order() -> None:
    model = gpt(depth=3)
    assert [n for n, _ in select_modules(model, ("blocks.*",))] == ["blocks.0", "blocks.1", "blocks.2"]
    assert [n for n, _ in select_modules(model, ("head", "blocks.1.mlp", "blocks.1"))] == ["blocks.1", "head"]
    assert [n for n, _ in select_modules(model, ("blocks.?.mlp",))] == [
        "blocks.0.mlp",
        "blocks.1.mlp",
        "blocks.2.mlp",
    ]


def test_a_pattern_matching_nothing_is_an_error_with_examples() -> None:
    with pytest.raises(
        ValueError,
        match=r"pattern 'layers\.\*' matches no module of TinyGPT; module names look "
        r"like tok, pos, drop, blocks, ln_f, head",
    ):
        select_modules(gpt(), ("blocks.0", "layers.*"))


def test_blocks_on_a_model_without_blocks_is_an_error() -> None:
    with pytest.raises(
        ValueError, match=r"MLP has no blocks .* e\.g\. model\.activation_checkpointing=\[net\]"
    ):
        apply_activation_checkpointing(MLP(), "blocks")


def test_names_state_dict_and_tree_are_unchanged() -> None:
    plain, ckpt = gpt(), gpt()
    assert apply_activation_checkpointing(ckpt, "blocks") == ["blocks.0", "blocks.1"]
    assert [n for n, _ in ckpt.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert list(ckpt.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in ckpt.named_modules()] == [n for n, _ in plain.named_modules()]
    assert [is_checkpointed(m) for m in (ckpt.blocks[0], ckpt.blocks[1], ckpt.head)] == [True, True, False]
    assert (
        apply_activation_checkpointing(ckpt, "none") == []
        and apply_activation_checkpointing(ckpt, None) == []
    )


def loss_and_grads(model: nn.Module, seed: int = 7) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the dropout masks
    loss_sum, _ = token_cross_entropy(model, batch())
    loss_sum.backward()
    return loss_sum.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("spec", ["blocks", ("blocks.1.mlp", "head")])
def test_loss_and_gradients_are_bit_identical_with_dropout(spec: object) -> None:
    plain, ckpt = gpt(dropout=0.2), gpt(dropout=0.2)
    apply_activation_checkpointing(ckpt, spec)  # type: ignore[arg-type]
    loss_a, grads_a = loss_and_grads(plain)
    loss_b, grads_b = loss_and_grads(ckpt)
    assert torch.equal(loss_a, loss_b)  # the recompute draws the same dropout masks
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))
    loss_c, _ = loss_and_grads(ckpt, seed=8)
    assert not torch.equal(loss_a, loss_c)  # dropout is active: equality above is not vacuous


def test_checkpointing_keeps_far_fewer_bytes_for_backward() -> None:
    """The memory acceptance test, on a deterministic measure: a model whose activations dominate
    (4 blocks of width 64 on 8 x 64 tokens) keeps under a third of the bytes, and the saving grows
    with depth while the checkpointed model's bytes grow only by one block input per block."""
    data = batch(size=8, length=64)

    def saved(depth: int, spec: object) -> int:
        model = gpt(width=64, depth=depth)
        apply_activation_checkpointing(model, spec)  # type: ignore[arg-type]
        return saved_activation_bytes(model, token_cross_entropy, data)

    plain4, ckpt4, plain2, ckpt2 = saved(4, None), saved(4, "blocks"), saved(2, None), saved(2, "blocks")
    assert ckpt4 < plain4 / 3, (ckpt4, plain4)
    block_input = 8 * 64 * 64 * 8  # (batch, tokens, width) in fp64
    assert ckpt4 - ckpt2 == 2 * block_input  # per extra block: its input, nothing else
    assert plain4 - plain2 > 10 * (ckpt4 - ckpt2)


def test_the_measure_counts_what_a_checkpoint_keeps() -> None:
    """The checkpoint saves its inputs through the outer hooks: the measure sees them (no undercount)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64)))
    apply_activation_checkpointing(model, ["1"])
    x = torch.randn(32, 16)
    kept = saved_activation_bytes(model, lambda m, b: (m(b).sum(), 1), x)
    assert kept >= 32 * 64 * 4  # the checkpointed block's input: Linear(16, 64)'s output in fp32


def test_eval_and_no_grad_run_the_plain_forward() -> None:
    model = gpt()
    apply_activation_checkpointing(model, "blocks")
    model.eval()
    with torch.no_grad():
        out = model(batch()["input_ids"])
    assert out.grad_fn is None and saved_activation_bytes(model, token_cross_entropy, batch()) > 0
    assert not model.training  # the measure restores the mode it found


def test_a_deep_copy_recomputes_its_own_weights() -> None:
    model = gpt()
    apply_activation_checkpointing(model, "blocks")
    twin = copy.deepcopy(model)
    assert twin.blocks[0].forward.__self__ is twin.blocks[0]
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    loss_a, grads_a = loss_and_grads(twin)
    fresh = gpt()
    with torch.no_grad():
        for p in fresh.parameters():
            p.mul_(0.5)
    loss_b, grads_b = loss_and_grads(fresh)
    assert torch.equal(loss_a, loss_b) and all(
        torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True)
    )


def test_reentrant_checkpointing_is_refused_where_ddp_runs() -> None:
    model = gpt()
    model.blocks[1] = checkpoint_wrapper(model.blocks[1], checkpoint_impl=CheckpointImpl.REENTRANT)
    assert reentrant_modules(model) == ["blocks.1"]
    for engine in ("ddp", "accelerate"):
        with pytest.raises(
            ValueError,
            match=rf"reentrant variant \(blocks\.1\); with engine={engine} DDP fails with "
            "'Expected to mark a variable ready only once'",
        ):
            check_engine_compatible(model, engine)
    check_engine_compatible(model, "fsdp")  # not refused where it is not known to break
    plain = gpt()
    plain.blocks[1] = checkpoint_wrapper(plain.blocks[1], checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    apply_activation_checkpointing(plain, "blocks")
    assert reentrant_modules(plain) == []
    check_engine_compatible(plain, "ddp")
