"""Model weights on disk: safetensors under the plain model's state-dict names.

Initial weights (``trainer.init_from``) may be a ``.safetensors`` file, a run's ``final/`` directory, or a
PyTorch state dict saved with ``torch.save`` (``.pt``, ``.pth``, ``.bin``; read with ``weights_only=True``,
so no code in the file runs), flat or under a ``"state_dict"`` / ``"model"`` key.

Every finished run keeps ``run_dir/final/``: ``model.safetensors`` (gathered from FSDP/ZeRO
shards, no ``module.`` prefixes), ``run_config.json``, and for a Hugging Face ``PreTrainedModel`` its
``save_pretrained`` layout (``config.json``, generation config) around the same weights file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from distaccum.engines.base import Engine
from distaccum.rundir import FINAL_CONFIG, FINAL_DIR, FINAL_WEIGHTS, resolve_weights, write_json


def is_hf_pretrained(module: nn.Module) -> bool:
    """A Hugging Face ``PreTrainedModel`` (duck-typed: transformers is optional)."""
    return callable(getattr(module, "save_pretrained", None)) and hasattr(module, "config")


def save_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    """Write ``state`` as safetensors (contiguous CPU copies; tied tensors become separate entries)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, value in state.items():
        tensor = value.detach().to("cpu").contiguous()
        storage = tensor.untyped_storage().data_ptr()
        if storage in storages:  # a tied weight (GPT-2's lm_head is its embedding): safetensors wants a copy
            tensor = tensor.clone()
        storages.add(storage)
        tensors[name] = tensor
    save_file(tensors, str(path), metadata={"format": "pt"})


TORCH_SUFFIXES = (".pt", ".pth", ".bin")
"""``torch.save`` state dicts that :func:`load_weights` reads (with ``weights_only=True``)."""
ACCEPTED = (
    "a .safetensors file, a run's final/ directory (model.safetensors), or a PyTorch state dict "
    "saved with torch.save (.pt, .pth, .bin; flat, or under a 'state_dict' or 'model' key)"
)


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """A state dict from ``path`` (see the module docstring for the formats). ValueError naming the file and
    the accepted formats when it is missing or not one of them."""
    file = resolve_weights(path)
    if not file.is_file():
        raise ValueError(f"no weights at {path}: expected {ACCEPTED}")
    if file.suffix in TORCH_SUFFIXES:
        try:
            loaded = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as err:  # a pickle with code in it, a truncated file, not a torch file at all
            raise ValueError(
                f"weights file {file} is not a PyTorch state dict torch.load can read with "
                f"weights_only=True ({type(err).__name__}: {str(err).splitlines()[0]}); "
                f"expected {ACCEPTED}"
            ) from err
        for key in ("state_dict", "model"):
            if isinstance(loaded, dict) and isinstance(loaded.get(key), dict):
                loaded = loaded[key]
        if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
            raise ValueError(
                f"weights file {file} holds a {type(loaded).__name__}, not a state dict of tensors; "
                f"expected {ACCEPTED}"
            )
        return dict(loaded)
    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as err:
        raise ValueError(
            f"weights file {file} is not a safetensors file ({err}); expected {ACCEPTED}"
        ) from err


def load_into(model: nn.Module, path: str | Path) -> None:
    """Load weights into ``model`` (strict: every name and shape must match), casting to its dtypes."""
    state = load_weights(path)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ValueError(f"weights in {path} do not fit the model: {err}") from err


def save_final(engine: Engine, run_dir: Path, run_config: dict[str, Any], tokenizer: Any = None) -> Path:
    """Write the trained model to ``run_dir/final/`` (and ``tokenizer`` when it has ``save_pretrained``,
    so the directory loads with ``AutoTokenizer`` too). Collective (gathers shards); rank 0 writes."""
    state = engine.full_state_dict()
    final = Path(run_dir) / FINAL_DIR
    if dist.get_rank() == 0:
        final.mkdir(parents=True, exist_ok=True)
        module = engine.unwrapped()
        if is_hf_pretrained(module):
            cast(Any, module).save_pretrained(
                str(final), state_dict=dict(state)
            )  # it removes tied names in place
            if (final / FINAL_WEIGHTS).is_file():
                # save_pretrained drops tied duplicates (GPT-2's lm_head.weight); rewrite the file with
                # every state-dict name so it loads strictly into the plain model (init_from, verify).
                # from_pretrained reads it all the same.
                save_weights(state, final / FINAL_WEIGHTS)
        else:
            save_weights(state, final / FINAL_WEIGHTS)
        if callable(getattr(tokenizer, "save_pretrained", None)):
            tokenizer.save_pretrained(str(final))
        write_json(final / FINAL_CONFIG, run_config)
    dist.barrier()  # nobody reports the path before the files are there
    return final
