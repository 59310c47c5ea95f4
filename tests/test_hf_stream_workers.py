"""A stream read through DataLoader workers (``data.num_workers``): ``datasets`` gives each worker its
own files, so the order depends on the worker count, but it is the same on every read (every rank,
the reference, a resumed run) and holds every sample once."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

from conftest import requires

requires("datasets")

from distaccum.data.stream import StreamWindows  # noqa: E402
from distaccum.textdata import TextStream  # noqa: E402
from hf_corpus import OFFLINE, write_text_files  # noqa: E402

pytestmark = pytest.mark.dist  # DataLoader worker processes

for _key, _value in OFFLINE.items():
    os.environ.setdefault(_key, _value)


def test_workers_change_the_order_never_the_samples_and_reads_repeat(tmp_path: Path) -> None:
    files = [str(f) for f in write_text_files(tmp_path / "text", count=60)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stream = TextStream(files, cache_dir=str(tmp_path / "c"), packing=False, block_size=40)

        def read(workers: int, index: int = 0) -> list[bytes]:
            windows = StreamWindows(stream, 8, num_workers=workers, index=index)
            out = []
            for _, window in zip(range(8 - index), windows, strict=False):  # epoch 0: 7 full, 1 partial
                out += [bytes(s["input_ids"].tolist()) for s in window.samples]
            return out

        plain, two, again, resumed = read(0), read(2), read(2), read(2, index=3)
    assert len(plain) == 60 and sorted(plain) == sorted(two)  # 60 paragraphs, every one once
    assert two == again and two[3 * 8 :] == resumed  # deterministic, and a resume skips exactly
    assert plain != two  # file 1's paragraphs interleave with file 0's
