"""Hugging Face causal language models and tokenizers as distaccum components (``pip install distaccum[hf]``).

- :func:`causal_lm` is the ``model`` factory of ``model=hf_causal_lm``: ``AutoModelForCausalLM.from_config``
  on a small config given in YAML (``model_type`` llama or gpt2, width, layers, heads, vocabulary,
  positions; random init under distaccum's seed), or ``from_pretrained`` on a local directory.
  Nothing is downloaded: only local files are read.
- :func:`load_tokenizer` gives ``AutoTokenizer.from_pretrained(<local dir>)`` or, without a directory,
  the :class:`ByteTokenizer` (UTF-8 bytes are the ids: no files at all).
- :func:`model_loss` is the model's own loss (the ``labels=`` path). distaccum's default for these
  models is :func:`distaccum.losses.token_cross_entropy` with ``shift=True``: the summed shifted
  cross-entropy computed outside the model, which works for every model. ``model_loss`` exists to
  show what the model's mean does under accumulation (``loss=hf_model``, see docs/huggingface.md).

``transformers`` is imported inside the functions that need it: it is an optional dependency.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from distaccum.losses import IGNORE_INDEX

CONFIG_NAMES: dict[str, dict[str, str]] = {
    "llama": {
        "width": "hidden_size",
        "layers": "num_hidden_layers",
        "heads": "num_attention_heads",
        "positions": "max_position_embeddings",
        "intermediate": "intermediate_size",
    },
    "gpt2": {
        "width": "n_embd",
        "layers": "n_layer",
        "heads": "n_head",
        "positions": "n_positions",
        "intermediate": "n_inner",
    },
}
"""distaccum's size names -> each supported ``model_type``'s config attributes."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "vocab.txt")
"""Any one of these makes a directory a tokenizer directory."""


def _quiet() -> None:
    # distaccum's console owns the output: no transformers progress bars ("Writing model shards").
    from transformers.utils import logging

    logging.disable_progress_bar()


def _dropout_fields(model_type: str, dropout: float) -> dict[str, float]:
    if model_type == "gpt2":
        return {"resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout}
    return {"attention_dropout": dropout}


def causal_lm(
    *,
    model_type: str = "llama",
    pretrained: str | None = None,
    vocab_size: int = 256,
    width: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int | None = None,
    positions: int = 128,
    intermediate: int | None = None,
    dropout: float = 0.0,
    tie_embeddings: bool | None = None,
    attn_implementation: str = "sdpa",
    config: dict[str, Any] | None = None,
) -> nn.Module:
    """A ``transformers`` causal LM: random init from the sizes given, or ``pretrained`` (a local
    ``save_pretrained`` directory, e.g. a finished run's ``final/``; the sizes are then ignored).

    ``intermediate`` defaults to 4 x width; ``config`` sets any other field of the model's config
    (``{rope_theta: 10000.0}``). Dropout defaults to 0: random layers make runs differ by split.
    """
    _quiet()
    from transformers import AutoConfig, AutoModelForCausalLM

    if pretrained is not None:
        path = Path(pretrained)
        if not (path / "config.json").is_file():
            raise ValueError(
                f"model.pretrained={pretrained!r} is not a save_pretrained directory (no config.json "
                "there): give a local directory written by save_pretrained, such as a finished run's "
                "final/; nothing is downloaded"
            )
        return AutoModelForCausalLM.from_pretrained(
            str(path), local_files_only=True, dtype=torch.float32, attn_implementation=attn_implementation
        )
    names = CONFIG_NAMES.get(model_type)
    if names is None:
        raise ValueError(
            f"model.model_type={model_type!r} is not supported for a random-init model; use one of "
            f"{', '.join(CONFIG_NAMES)}, or model.pretrained=<local directory> for any other model"
        )
    for name, value in (
        ("vocab_size", vocab_size),
        ("width", width),
        ("layers", layers),
        ("heads", heads),
        ("positions", positions),
    ):
        if value <= 0:
            raise ValueError(f"model.{name} must be > 0, got {value}")
    if width % heads:
        raise ValueError(f"model.width={width} is not divisible by model.heads={heads}")
    fields: dict[str, Any] = {
        names["width"]: width,
        names["layers"]: layers,
        names["heads"]: heads,
        names["positions"]: positions,
        names["intermediate"]: intermediate or 4 * width,
        "vocab_size": vocab_size,
        "use_cache": False,
        **_dropout_fields(model_type, dropout),
    }
    if kv_heads is not None:
        if model_type != "llama" or heads % kv_heads:
            raise ValueError(
                f"model.kv_heads={kv_heads} needs model_type=llama and heads ({heads}) divisible by it"
            )
        fields["num_key_value_heads"] = kv_heads
    if tie_embeddings is not None:
        fields["tie_word_embeddings"] = tie_embeddings
    defaults = AutoConfig.for_model(model_type)
    for special in ("bos_token_id", "eos_token_id", "pad_token_id"):
        token = getattr(defaults, special, None)
        if isinstance(token, int) and token >= vocab_size:  # gpt2's 50256 in a byte-level vocabulary
            fields[special] = None
    cfg = AutoConfig.for_model(model_type, **fields, **(config or {}))
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation)


def max_positions(model: nn.Module) -> int | None:
    """The longest sequence ``model`` takes (its config's position count), or None when it has none."""
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def vocab_rows(model: nn.Module) -> int | None:
    """Rows of the model's input embedding (the largest token id it takes + 1), or None if unknown."""
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    return int(embedding.num_embeddings) if isinstance(embedding, nn.Embedding) else None


class ByteTokenizer:
    """UTF-8 bytes as token ids (vocabulary 256): no files, no download, any text.

    Called like a Hugging Face tokenizer (``tok(texts)["input_ids"]``). It has no special tokens:
    packed documents are joined by a blank line instead of an end-of-text token.
    """

    vocab_size = 256
    eos_token_id: int | None = None
    pad_token_id = 0
    name = "bytes"

    def __len__(self) -> int:
        return self.vocab_size

    def __call__(self, texts: list[str], **_: Any) -> dict[str, list[list[int]]]:
        return {"input_ids": [list(text.encode("utf-8")) for text in texts]}

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` (invalid UTF-8 sequences are replaced)."""
        return bytes(ids).decode("utf-8", errors="replace")

    def cache_key(self) -> str:
        """Identity for caches: what decides the ids."""
        return "bytes-utf8-v1"


def load_tokenizer(path: str | None) -> Any:
    """``AutoTokenizer.from_pretrained(path)`` from local files only, or a :class:`ByteTokenizer`."""
    if path is None:
        return ByteTokenizer()
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(
            f"tokenizer={path!r} is not a directory: give a local tokenizer directory (written by "
            "save_pretrained) or tokenizer=null for the byte-level tokenizer"
        )
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"tokenizer={path!r} holds no tokenizer files (none of {', '.join(TOKENIZER_FILES)}): "
            "point it at a directory written by tokenizer.save_pretrained(), or use "
            "tokenizer=null for the byte-level tokenizer"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as err:  # transformers raises OSError, ValueError, KeyError... for broken directories
        raise ValueError(
            f"tokenizer={path!r}: AutoTokenizer cannot load it: {type(err).__name__}: {err}"
        ) from err


def tokenizer_cache_key(tokenizer: Any, path: str | None) -> str:
    """A stable identity of ``tokenizer`` for the token cache: its files' contents, or the byte scheme."""
    own = getattr(tokenizer, "cache_key", None)
    if callable(own):
        return str(own())
    digest = hashlib.sha256()
    for file in sorted(Path(str(path)).iterdir()):
        if file.is_file():
            digest.update(file.name.encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()[:16]


def separator_ids(tokenizer: Any) -> list[int]:
    """What joins two documents when they are packed: the end-of-text token, or a blank line."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        return [eos]
    return list(tokenizer(["\n\n"], add_special_tokens=False)["input_ids"][0])


def model_loss(
    model: nn.Module, batch: dict[str, torch.Tensor], *, as_sum: bool = True, ignore_index: int = IGNORE_INDEX
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own causal-LM loss: ``model(**inputs, labels=labels).loss``, a MEAN over the batch's
    shifted non-ignored labels.

    distaccum's contract wants a sum, so by default the mean is multiplied back by the item count
    (``as_sum=True``; equal to distaccum's own summed loss up to rounding). ``as_sum=False`` returns
    the mean itself: the normalization probe rejects it (exit 2). With ``accum.loss_norm=mean_per_micro``
    the loop divides each micro-batch by its own count and by K x world: the Transformers Trainer's
    gradient-accumulation bug of 2024, which ``distaccum verify`` reports as ``loss_normalization``.
    """
    labels = batch["labels"]
    out = model(**{k: v for k, v in batch.items() if k != "labels"}, labels=labels)
    items = (labels[..., 1:] != ignore_index).sum()
    return (out.loss * items if as_sum else out.loss), items
