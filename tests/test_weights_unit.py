"""Initial weights (``trainer.init_from``): safetensors, a run's final/, or a ``torch.save`` state dict
(.pt/.pth/.bin, read with ``weights_only=True``); anything else is one clear error naming the setting,
the file and the accepted formats."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from distaccum.components import build_model
from distaccum.engines.base import Precision
from distaccum.models import MLP
from distaccum.rundir.weights import load_weights, save_weights

pytestmark = pytest.mark.unit


def make() -> torch.nn.Module:
    return MLP(in_dim=4, width=8, out_dim=2)


def built(init_from: Path) -> torch.nn.Module:
    return build_model(make, seed=1, precision=Precision.of("fp32"), init_from=str(init_from), target="MLP")


@pytest.mark.parametrize(("name", "wrap"), [("w.pt", None), ("w.bin", "state_dict"), ("w.pth", "model")])
def test_a_torch_save_state_dict_is_read_like_safetensors(
    tmp_path: Path, name: str, wrap: str | None
) -> None:
    torch.manual_seed(7)
    source = make().state_dict()
    torch.save(source if wrap is None else {wrap: source, "epoch": 3}, tmp_path / name)
    save_weights(source, tmp_path / "w.safetensors")
    from_torch, from_safetensors = built(tmp_path / name), built(tmp_path / "w.safetensors")
    for key, value in source.items():
        assert torch.equal(from_torch.state_dict()[key], value)
        assert torch.equal(from_safetensors.state_dict()[key], value)


class NotWeights:
    """A pickled object: torch.load with weights_only=True refuses to run its class."""


@pytest.mark.parametrize(
    ("name", "content", "fragment"),
    [
        ("code.pt", "pickle", "is not a PyTorch state dict torch.load can read with weights_only=True"),
        ("list.pt", "list", "holds a list, not a state dict of tensors"),
        ("junk.bin", "text", "is not a PyTorch state dict"),
        ("junk.safetensors", "text", "is not a safetensors file"),
        ("missing.pt", None, "no weights at"),
    ],
)
def test_other_files_are_one_clear_error(
    tmp_path: Path, name: str, content: str | None, fragment: str
) -> None:
    path = tmp_path / name
    if content == "pickle":
        torch.save({"w": NotWeights()}, path)
    elif content == "list":
        torch.save([torch.zeros(2)], path)
    elif content == "text":
        path.write_text("not weights at all\n")
    with pytest.raises(ValueError) as err:
        built(path)
    message = str(err.value)
    assert message.startswith(f"trainer.init_from={path}: ") and fragment in message, message
    assert "a .safetensors file, a run's final/ directory" in message and ".pt, .pth, .bin" in message
    assert "\n" not in message  # one paragraph


def test_load_weights_reads_a_runs_final_directory(tmp_path: Path) -> None:
    state = make().state_dict()
    save_weights(state, tmp_path / "final" / "model.safetensors")
    assert set(load_weights(tmp_path / "final")) == set(state)
