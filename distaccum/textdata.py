"""Text files as training data (``data=text_files``): loaded with Hugging Face ``datasets``, tokenized
once and cached, packed into fixed-length blocks or kept as variable-length samples.

- :class:`TextFiles` is a map-style dataset: ``datasets.load_dataset("text" | "json", data_files=...)``
  from local files, tokenized with ``Dataset.map`` under a cache key of the files (path, size,
  mtime), the tokenizer and the options, so the arrow cache under ``cache_dir`` is reused by every
  later run and every rank instead of tokenizing again.
- :class:`TextStream` is the same samples, in the same order, as a ``torch.utils.data.IterableDataset``
  over ``datasets`` streaming: nothing is cached or counted ahead (``distaccum.data.stream`` serves it).
- ``packing=true``: documents joined by the tokenizer's end-of-text token (a blank line for the
  byte-level tokenizer) and cut into blocks of ``block_size`` tokens (the remainder is dropped);
  ``packing=false``: one sample per document (a paragraph, line or JSONL record), truncated to
  ``block_size`` tokens with a warning, padded per micro-batch by :func:`distaccum.datasets.pad_collate`.
- Held-out data: ``eval_files``, or ``eval_fraction`` f: every round(1/f)-th sample (after packing)
  is held out of training and served by :meth:`TextFiles.held_out` (works for streams too, which
  cannot count ahead).

Without ``files`` the demo text is used: CPython's own documentation topics (``pydoc_data.topics``,
~465K characters of English, shipped with every CPython under the PSF license), written once to
``cache_dir/demo/``. Samples are ``{"input_ids": ids, "labels": ids}`` (the loss shifts).
"""

from __future__ import annotations

import copy
import hashlib
import json
import warnings
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from distaccum.hf import load_tokenizer, max_positions, separator_ids, tokenizer_cache_key, vocab_rows
from distaccum.rundir import write_text_atomic

FORMAT_VERSION = 1
"""Part of every cache key: bump it when tokenization or packing changes."""
SAMPLE_BY = ("paragraph", "line", "document")
JSON_SUFFIXES = (".json", ".jsonl")
DEMO_FILE = "python-docs-topics.txt"


def demo_text_file(cache_dir: Path) -> Path:
    """The demo text (CPython's ``pydoc_data.topics``) as a file under ``cache_dir/demo`` (written once)."""
    try:
        from pydoc_data.topics import topics
    except ImportError as err:
        raise ValueError(
            "the demo text (CPython's pydoc_data.topics) is not installed with this Python: give "
            "your own text or JSONL files with data.dataset.files=[...]"
        ) from err
    text = "\n\n".join(str(topics[name]).strip() for name in topics) + "\n"
    path = cache_dir / "demo" / DEMO_FILE
    if not path.is_file() or path.stat().st_size != len(text.encode("utf-8")):
        write_text_atomic(path, text)  # ranks may race here: each writes the same text, atomically
    return path


def check_files(files: Sequence[str | Path] | str | None, cache_dir: Path, what: str = "files") -> list[Path]:
    """Resolved paths of ``files`` (the demo text when None); ValueError for a missing or empty file."""
    if files is None:
        return [demo_text_file(cache_dir)]
    if isinstance(files, str | Path):
        files = [files]
    paths = [Path(f).expanduser().resolve() for f in files]
    if not paths:
        raise ValueError(
            f"data.dataset.{what}=[] names no file: give text (.txt) or JSONL (.jsonl) files, "
            "or leave it null for the demo text"
        )
    for path in paths:
        if not path.is_file():
            raise ValueError(
                f"data.dataset.{what}: {path} does not exist (relative paths are read from "
                f"{Path.cwd()}): give existing text or JSONL files"
            )
        if path.stat().st_size == 0:
            raise ValueError(f"data.dataset.{what}: {path} is empty: give files that hold text")
    kinds = {p.suffix.lower() in JSON_SUFFIXES for p in paths}
    if len(kinds) > 1:
        raise ValueError(
            f"data.dataset.{what} mixes JSONL and plain text files ({', '.join(map(str, paths))}): "
            "use one kind per dataset"
        )
    return paths


def pack_blocks(
    docs: Iterable[Sequence[int]], block_size: int, separator: Sequence[int]
) -> Iterator[list[int]]:
    """Concatenate documents (each followed by ``separator``) and cut blocks of ``block_size`` tokens;
    the last incomplete block is dropped. The same function packs the cached and the streamed data."""
    buffer: list[int] = []
    for doc in docs:
        buffer.extend(doc)
        buffer.extend(separator)
        while len(buffer) >= block_size:
            yield buffer[:block_size]
            del buffer[:block_size]


def tokenize_texts(
    texts: Sequence[Any], tokenizer: Any, text_field: str, limit: int | None
) -> dict[str, list]:
    """Token ids of non-empty ``texts``; with ``limit`` (variable-length samples) only documents with at
    least 2 tokens (one loss item after the shift), truncated to ``limit``, and which were truncated."""
    for text in texts:
        if not isinstance(text, str):
            raise ValueError(
                f"data.dataset.text_field={text_field!r} holds a {type(text).__name__}, not text: "
                "name the field of each record that holds the text"
            )
    ids = tokenizer(list(texts), verbose=False)["input_ids"] if texts else []
    if limit is None:
        return {"input_ids": [x for x in ids if len(x)]}
    kept = [x for x in ids if len(x) >= 2]
    return {"input_ids": [x[:limit] for x in kept], "truncated": [len(x) > limit for x in kept]}


class _TextOptions:
    """What decides the samples: shared by the map-style and the streaming dataset."""

    def __init__(
        self,
        files: Sequence[str] | str | None = None,
        *,
        text_field: str = "text",
        sample_by: str = "paragraph",
        tokenizer: str | None = None,
        packing: bool = True,
        block_size: int = 64,
        eval_fraction: float = 0.0,
        eval_files: Sequence[str] | str | None = None,
        cache_dir: str = ".cache/distaccum",
    ) -> None:
        if sample_by not in SAMPLE_BY:
            raise ValueError(f"data.dataset.sample_by={sample_by!r} is not one of {', '.join(SAMPLE_BY)}")
        if block_size < 2:
            raise ValueError(f"data.dataset.block_size must be >= 2 tokens, got {block_size}")
        if not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"data.dataset.eval_fraction must be in [0, 1), got {eval_fraction}")
        if eval_fraction and eval_files:
            raise ValueError(
                "data.dataset.eval_fraction and data.dataset.eval_files are both set: hold out a "
                "fraction of the training files or give separate eval files, not both"
            )
        self.cache_dir = Path(cache_dir).expanduser().resolve()
        self.files = check_files(files, self.cache_dir)
        self.eval_files = (
            None if eval_files is None else check_files(eval_files, self.cache_dir, "eval_files")
        )
        self.text_field, self.sample_by, self.tokenizer_path = text_field, sample_by, tokenizer
        self.packing, self.block_size, self.eval_fraction = packing, block_size, eval_fraction
        self.tokenizer = load_tokenizer(tokenizer)
        self.period = round(1.0 / eval_fraction) if eval_fraction else 0
        """Sample i is held out when ``i % period == period - 1`` (0: nothing held out)."""

    def load_args(self, files: list[Path]) -> tuple[str, dict[str, Any]]:
        """``datasets.load_dataset``'s builder and keyword arguments for ``files`` (all of one kind)."""
        if files[0].suffix.lower() in JSON_SUFFIXES:
            return "json", {"data_files": [str(f) for f in files]}
        return "text", {"data_files": [str(f) for f in files], "sample_by": self.sample_by}

    def cache_key(self, files: list[Path]) -> str:
        """Identity of the tokenized samples: files (path, size, mtime), tokenizer, options."""
        stamp = {
            "v": FORMAT_VERSION,
            "files": [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files],
            "tokenizer": tokenizer_cache_key(self.tokenizer, self.tokenizer_path),
            "field": self.text_field,
            "by": self.sample_by,
            "packing": self.packing,
            "block": self.block_size,
        }
        return hashlib.sha256(json.dumps(stamp, sort_keys=True).encode()).hexdigest()[:16]

    def held_out(self, index: int) -> bool:
        """Whether sample ``index`` (in file order, after packing) belongs to the eval split."""
        return bool(self.period) and index % self.period == self.period - 1

    def check_model(self, model: nn.Module) -> None:
        """ValueError when ``model`` cannot take these samples: a vocabulary smaller than the tokenizer's
        ids, or fewer positions than ``block_size`` (refused rather than truncated: the fix is a setting)."""
        rows, ids = vocab_rows(model), len(self.tokenizer)
        if rows is not None and rows < ids:
            raise ValueError(
                f"the model's vocabulary has {rows} entries but the tokenizer produces ids up to "
                f"{ids - 1}: set model.vocab_size={ids} (or larger), or use a matching tokenizer"
            )
        positions = max_positions(model)
        if positions is not None and self.block_size > positions:
            raise ValueError(
                f"data.dataset.block_size={self.block_size} is longer than the model's {positions} "
                f"positions: lower data.dataset.block_size to <= {positions} or raise "
                "model.positions"
            )


def _sample(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"input_ids": ids, "labels": ids}


def check_shifting_loss(loss: Any) -> None:
    """ValueError when ``loss`` is distaccum's token cross-entropy without ``shift``: these samples' labels equal
    their inputs (the loss must shift them), so an unshifted loss trains the model to copy its input -- the loss
    falls fast and means nothing. Other losses are the user's to know."""
    from distaccum.losses import token_cross_entropy

    if getattr(loss, "func", None) is token_cross_entropy and not getattr(loss, "keywords", {}).get("shift"):
        raise ValueError(
            "data=text_files samples carry labels equal to their inputs (the Hugging Face convention: the loss "
            "shifts them), but the loss is distaccum.losses.token_cross_entropy without shift: the model would "
            "learn to copy its input. Use loss=causal_ce (shift: true), e.g. `model=tiny_gpt data=text_files "
            "loss=causal_ce`"
        )


class TextFiles(Dataset):
    """Local text/JSONL files as a map-style dataset of token samples (see the module docstring);
    ``options`` are :class:`_TextOptions`'s (text_field, tokenizer, packing, block_size, ...)."""

    def __init__(self, files: Sequence[str] | str | None = None, **options: Any) -> None:
        self.options = _TextOptions(files, **options)
        self.tokenizer = self.options.tokenizer
        self.rows = self._tokenized(self.options.files)
        every = torch.arange(len(self.rows))
        held = (every % self.options.period == self.options.period - 1) if self.options.period else every < 0
        self.index, self._held = every[~held], every[held]
        if not len(self.index):
            raise ValueError(self._empty_message())
        if not self.options.packing:
            truncated = int(sum(self.rows["truncated"]))
            if truncated:
                warnings.warn(
                    f"{truncated} of {len(self.rows)} samples were longer than "
                    f"block_size={self.options.block_size} "
                    "tokens and were truncated to it: raise data.dataset.block_size (up to the model's "
                    "positions) or set data.dataset.packing=true to train on every token",
                    stacklevel=2,
                )

    def _empty_message(self) -> str:
        unit = (
            f"one block of block_size={self.options.block_size} tokens"
            if self.options.packing
            else "one document of at least 2 tokens"
        )
        return (
            f"data.dataset: {', '.join(map(str, self.options.files))} hold(s) less than {unit} for training: "
            "give more text, a smaller block_size, or (JSONL) the right text_field"
        )

    def _tokenized(self, files: list[Path]) -> Any:
        import datasets

        opts = self.options
        datasets.disable_progress_bars()
        builder, kwargs = opts.load_args(files)
        raw = datasets.load_dataset(
            builder, split="train", cache_dir=str(opts.cache_dir / "datasets"), **kwargs
        )
        if opts.text_field not in raw.column_names:
            raise ValueError(
                f"data.dataset.text_field={opts.text_field!r} is not a field of "
                f"{', '.join(map(str, files))}; its records have {', '.join(raw.column_names)}: set "
                "data.dataset.text_field to the one that holds the text"
            )
        cache_key = opts.cache_key(files)
        limit = None if opts.packing else opts.block_size
        rows = raw.map(
            lambda b: tokenize_texts(b[opts.text_field], opts.tokenizer, opts.text_field, limit),
            batched=True,
            remove_columns=raw.column_names,
            new_fingerprint=cache_key,  # datasets' own name for a cache key
        )
        if opts.packing:
            separator = separator_ids(opts.tokenizer)
            # The whole dataset in one batch: packing carries across documents exactly as the stream does.
            rows = rows.map(
                lambda b: {"input_ids": list(pack_blocks(b["input_ids"], opts.block_size, separator))},
                batched=True,
                batch_size=None,
                remove_columns=rows.column_names,
                new_fingerprint=f"{cache_key}-packed",
            )
        return rows.with_format("torch", columns=["input_ids"], output_all_columns=True)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return _sample(self.rows[int(self.index[i])]["input_ids"])

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        """A micro-batch's samples in one arrow read (the DataLoader's fetcher calls this when present)."""
        ids = self.rows[self.index[indices].tolist()]["input_ids"]  # a 2-D tensor when packed, else a list
        return [_sample(row) for row in ids]

    def held_out(self) -> TextFiles | None:
        """The held-out samples (``eval_files`` or every round(1/eval_fraction)-th sample), or None."""
        if self.options.eval_files is not None:
            other = copy.copy(self)
            other.rows = self._tokenized(self.options.eval_files)
            other.index = torch.arange(len(other.rows))
        elif self.options.period:
            other = copy.copy(self)
            other.index = self._held
        else:
            return None
        if not len(other.index):
            raise ValueError(
                "the eval split holds no samples: "
                + (
                    f"{', '.join(map(str, self.options.eval_files or []))} yield none; give eval files "
                    "with more text"
                    if self.options.eval_files is not None
                    else f"data.dataset.eval_fraction={self.options.eval_fraction} of {len(self.rows)} "
                    "samples is less than one; raise it or give data.dataset.eval_files"
                )
            )
        return other

    def check_model(self, model: nn.Module) -> None:
        """See :meth:`_TextOptions.check_model` (called by the normalization probe)."""
        self.options.check_model(model)

    def check_loss(self, loss: Any) -> None:
        """See :func:`check_shifting_loss` (called by the normalization probe)."""
        check_shifting_loss(loss)


class TextStream(IterableDataset):
    """The samples of :class:`TextFiles`, in the same order, streamed from the files (``datasets``
    streaming): no cache, no length. Every iteration starts from the first file. ``options`` are
    :class:`_TextOptions`'s; ``chunk``: records tokenized per batch."""

    def __init__(self, files: Sequence[str] | str | None = None, *, chunk: int = 256, **options: Any) -> None:
        self.kwargs: dict[str, Any] = options
        self.files_arg = files
        self.options = _TextOptions(files, **options)
        self.tokenizer = self.options.tokenizer
        self.chunk = chunk
        first = next(self._records(), None)  # fail here, not in a worker, on a wrong text_field
        text_field = self.options.text_field
        if first is not None and text_field not in first:
            raise ValueError(
                f"data.dataset.text_field={text_field!r} is not a field of the first record of "
                f"{self.options.files[0]}; it has {', '.join(first)}: set data.dataset.text_field "
                "to the one that holds the text"
            )

    def _records(self) -> Iterator[dict[str, Any]]:
        import datasets

        builder, kwargs = self.options.load_args(self.options.files)
        datasets.disable_progress_bars()
        yield from datasets.load_dataset(builder, split="train", streaming=True, **kwargs)

    def _token_lists(self) -> Iterator[list[int]]:
        opts = self.options
        limit = None if opts.packing else opts.block_size
        records = self._records()
        warned = False
        while chunk := list(islice(records, self.chunk)):
            texts = [r.get(opts.text_field) for r in chunk]
            if any(t is None for t in texts):
                raise ValueError(
                    f"data.dataset.text_field={opts.text_field!r} is missing from a record of "
                    f"{', '.join(map(str, opts.files))}"
                )
            out = tokenize_texts(texts, opts.tokenizer, opts.text_field, limit)
            if not warned and any(out.get("truncated", ())):
                warned = True
                warnings.warn(
                    f"samples longer than block_size={opts.block_size} tokens are truncated to it",
                    stacklevel=2,
                )
            yield from out["input_ids"]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        opts = self.options
        samples = self._token_lists()
        if opts.packing:
            samples = pack_blocks(samples, opts.block_size, separator_ids(opts.tokenizer))
        for i, ids in enumerate(samples):
            if not opts.held_out(i):
                yield _sample(torch.tensor(ids, dtype=torch.long))

    def held_out(self) -> TextFiles | None:
        """The held-out samples as a map-style :class:`TextFiles` split (read and cached once)."""
        return TextFiles(self.files_arg, **self.kwargs).held_out()

    def check_model(self, model: nn.Module) -> None:
        """See :meth:`_TextOptions.check_model`."""
        self.options.check_model(model)

    def check_loss(self, loss: Any) -> None:
        """See :func:`check_shifting_loss`."""
        check_shifting_loss(loss)


def text_files(
    files: Sequence[str] | str | None = None, *, streaming: bool = False, **options: Any
) -> Dataset:
    """The ``data.dataset`` factory of ``data=text_files``: :class:`TextStream` with ``streaming=true``,
    else :class:`TextFiles`. ``options`` are theirs (text_field, tokenizer, packing, block_size, ...)."""
    return TextStream(files, **options) if streaming else TextFiles(files, **options)
