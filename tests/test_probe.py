"""The loss contract, the ready-made losses, the normalization probe, and instantiating components."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import default_collate

from distaccum import losses
from distaccum.config import ConfigError, from_mapping
from distaccum.datasets import CorpusSequences, SyntheticImages, SyntheticRegression, pad_collate
from distaccum.models import MLP, ConvNetBN, TinyGPT
from distaccum.preflight import instantiate_components
from distaccum.probe import probe

pytestmark = pytest.mark.unit


def test_token_cross_entropy_sums_over_real_tokens_and_counts_them() -> None:
    torch.manual_seed(0)
    model = TinyGPT(width=16, depth=1, heads=2)
    batch = pad_collate([CorpusSequences(8, seq_min=3, seq_max=9)[i] for i in range(4)])
    loss_sum, items = losses.token_cross_entropy(model, batch)
    real = batch["labels"] != losses.IGNORE_INDEX
    logits = model(batch["input_ids"])
    per_token = torch.nn.functional.cross_entropy(logits[real], batch["labels"][real], reduction="none")
    assert int(items) == int(real.sum()) and torch.allclose(loss_sum, per_token.sum())


def test_token_cross_entropy_shifts_like_hugging_face() -> None:
    class Echo(nn.Module):  # logits favour the current token: only the shift makes the label right
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(10.0))

        def forward(
            self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
        ) -> torch.Tensor:
            return self.scale * nn.functional.one_hot(input_ids, 8).float()

    ids = torch.tensor([[1, 1, 1, 0]])
    labels = torch.tensor([[1, 1, 1, -100]])
    _, items = losses.token_cross_entropy(Echo(), {"input_ids": ids, "labels": labels}, shift=True)
    assert int(items) == 2  # position t predicts label t+1: three real labels give two predictions


def test_sample_losses_count_one_item_per_sample() -> None:
    x, y = torch.randn(5, 32), torch.randn(5, 8)
    model = MLP()
    loss_sum, items = losses.mse(model, (x, y))
    assert items == 5 and torch.allclose(loss_sum, ((model(x) - y) ** 2).sum())
    images = default_collate([SyntheticImages(5)[i] for i in range(5)])
    _, items = losses.sample_cross_entropy(ConvNetBN(width=4, depth=1), images)
    assert items == 5


def mean_mse(model: nn.Module, batch: tuple) -> tuple[torch.Tensor, int]:
    inputs, targets = batch
    return nn.functional.mse_loss(model(inputs), targets), len(targets)


def test_probe_accepts_summed_losses() -> None:
    report = probe(MLP(), SyntheticRegression(8), default_collate, losses.mse)
    assert report.checked_sum and report.loss_two == pytest.approx(2 * report.loss_one, rel=1e-5)
    report = probe(
        TinyGPT(width=16, depth=1, heads=2), CorpusSequences(8), pad_collate, losses.token_cross_entropy
    )
    assert report.items_two == 2 * report.items_one


def test_probe_refuses_a_mean_and_says_so() -> None:
    with pytest.raises(ValueError) as err:
        probe(MLP(), SyntheticRegression(8), default_collate, mean_mse, names={"loss": "mytask.loss_mean"})
    message = str(err.value)
    assert "loss mytask.loss_mean does not return a sum" in message and "That is a mean" in message
    assert "reduction='sum'" in message


@pytest.mark.parametrize(
    "bad_loss, fragment",
    [
        (lambda model, batch: losses.mse(model, batch)[0], "must return (loss_sum, n_items)"),
        (lambda model, batch: (1.0, 4), "loss_sum of type float"),
        (lambda model, batch: (model(batch[0]).sum(dim=1), len(batch[0])), "loss_sum of shape"),
        (lambda model, batch: (losses.mse(model, batch)[0], "4"), "n_items of type str"),
        (lambda model, batch: (losses.mse(model, batch)[0], 3), "n_items must add up"),
        (lambda model, batch: (losses.mse(model, batch)[0], 0), "n_items=0"),
        (lambda model, batch: 1 / 0, "failed on sample 0: ZeroDivisionError"),
    ],
)
def test_probe_names_every_broken_contract(bad_loss, fragment: str) -> None:
    with pytest.raises(ValueError) as err:
        probe(MLP(), SyntheticRegression(8), default_collate, bad_loss)
    assert fragment in str(err.value)


def test_probe_checks_the_dataset_and_collate() -> None:
    with pytest.raises(ValueError, match="dataset .* is empty"):
        probe(MLP(), SyntheticRegression(0), default_collate, losses.mse)

    def broken(samples: list) -> None:
        raise KeyError("input_ids")

    with pytest.raises(ValueError, match=r"collate mytask.collate failed on sample 0 .*KeyError"):
        probe(MLP(), SyntheticRegression(8), broken, losses.mse, names={"collate": "mytask.collate"})


def test_probe_only_counts_items_for_batch_statistics_models() -> None:
    with pytest.warns(UserWarning, match="loss-sum check is skipped"):
        report = probe(
            ConvNetBN(width=4, depth=1), SyntheticImages(8), default_collate, losses.sample_cross_entropy
        )
    assert not report.checked_sum


def test_probe_leaves_the_model_and_the_rng_as_they_were() -> None:
    model = MLP(dropout=0.5)
    before = torch.random.get_rng_state()
    probe(model, SyntheticRegression(8), default_collate, losses.mse)
    assert model.training and torch.equal(before, torch.random.get_rng_state())


def node_cfg(**nodes: dict) -> object:
    base = {
        "model": {"_target_": "distaccum.models.MLP", "width": 8},
        "loss": {"_target_": "distaccum.losses.mse", "_partial_": True},
        "data": {"dataset": {"_target_": "distaccum.datasets.SyntheticRegression", "num_samples": 8}},
    }
    base.update(nodes)
    return from_mapping(base)


def test_components_are_instantiated_with_the_model_built_later() -> None:
    parts = instantiate_components(node_cfg(loss={"_target_": "distaccum.losses.mse"}))  # _partial_ implied
    assert isinstance(parts.model, functools.partial) and isinstance(parts.model(), MLP)
    assert len(parts.dataset) == 8 and parts.loss.func is losses.mse
    assert parts.describe()["model"] == "distaccum.models.MLP"


@pytest.mark.parametrize(
    "nodes, fragment",
    [
        ({"model": {"_target_": "nosuchpkg.make"}}, "model: cannot import _target_ 'nosuchpkg.make'"),
        ({"model": {"_target_": "distaccum.models.Nope"}}, "cannot import _target_ 'distaccum.models.Nope'"),
        (
            {"data": {"dataset": {"_target_": "distaccum.datasets.SyntheticRegression", "bogus": 1}}},
            "data.dataset: building distaccum.datasets.SyntheticRegression(bogus=1) failed: TypeError",
        ),
        ({"model": None}, "no model configured"),
    ],
)
def test_component_errors_name_the_target(nodes: dict, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        instantiate_components(node_cfg(**nodes))
    assert fragment in str(err.value)


def test_modules_in_the_current_directory_are_importable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "cwdtask.py").write_text(
        "from distaccum.models import MLP\n\ndef make(width):\n    return MLP(width=width)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", str(tmp_path))])
    parts = instantiate_components(node_cfg(model={"_target_": "cwdtask.make", "width": 4}))
    assert parts.model().net[0].out_features == 4
