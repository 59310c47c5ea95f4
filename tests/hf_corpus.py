"""Small local text files for the Hugging Face tests: paragraphs of CPython's documentation topics (they
ship with Python), so every test reads real English of varied length without a download."""

from __future__ import annotations

import json
from pathlib import Path
from pydoc_data.topics import topics

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def paragraphs(count: int, start: int = 0) -> list[str]:
    """``count`` non-empty paragraphs of the documentation topics, from paragraph ``start``."""
    found = [p.strip() for name in sorted(topics) for p in topics[name].split("\n\n") if p.strip()]
    return found[start : start + count]


def write_text_files(directory: Path, count: int = 240, files: int = 2) -> list[Path]:
    """``files`` .txt files holding ``count`` paragraphs (blank-line separated) between them."""
    directory.mkdir(parents=True, exist_ok=True)
    texts = paragraphs(count)
    share = len(texts) // files
    paths = []
    for i in range(files):
        path = directory / f"part{i}.txt"
        path.write_text("\n\n".join(texts[i * share : (i + 1) * share]) + "\n", encoding="utf-8")
        paths.append(path)
    return paths


def write_bpe_tokenizer(directory: Path, vocab_size: int = 320) -> Path:
    """A small byte-level BPE tokenizer trained here on the topics (``tokenizers``; no download), saved
    with ``save_pretrained`` so ``AutoTokenizer.from_pretrained(directory)`` loads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<eos>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(paragraphs(300), trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>").save_pretrained(
        str(directory)
    )
    return directory


def write_jsonl(path: Path, count: int = 40, field: str = "content") -> Path:
    """A JSONL file whose records hold the text under ``field``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(paragraphs(count))))
    return path
