"""What is alive between micro-batches: ``python -m benchmarks.memory_census [MODE ...] [--k 8]``.

A diagnostic for memory that grows with the number of micro-batches K. One process (a gloo world of 1),
the MLP of tests/test_memory_flat.py, each MODE of that file (default: all) at K micro-batches: after one
warm-up step, at the start of every micro-batch of the next step (when the loss function is entered),
a census of the tensors Python can see (``gc``; parameters included, views counted once per storage).
It prints the live bytes at each micro-batch and the tensors alive at the last micro-batch that were not
at the second. Tensors held only inside C++ (autograd's saved tensors, a collective's buffers) are not
seen: a flat census with a growing allocator count points there.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from distaccum.cli.compose import compose_config
from distaccum.config import from_mapping, to_mapping, with_overrides
from distaccum.preflight import instantiate_components
from distaccum.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_memory_flat as flat  # noqa: E402  (the modes and model of the test, as the test defines them)


def census() -> dict[int, tuple[tuple[int, ...], str, int]]:
    """storage address -> (shape, dtype, bytes) of every CPU tensor the garbage collector tracks."""
    out = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            try:  # a storage resized to nothing (FSDP2's resharded parameters) has no data pointer
                storage = obj.untyped_storage()
                if storage.nbytes():
                    out[storage.data_ptr()] = (tuple(obj.shape), str(obj.dtype), storage.nbytes())
            except (RuntimeError, NotImplementedError):
                continue
    return out


def run(mode: str, k: int, root: Path) -> None:
    cfg = from_mapping(to_mapping(with_overrides(
        compose_config([*flat.MODEL, *flat.MODES[mode], f"accum.steps={k}", "trainer.nproc=1"]),
        {"run_dir": str(root / f"{mode}-k{k}")})))
    parts = instantiate_components(cfg)
    seen: list[dict[int, Any]] = []
    armed = [False]

    def loss(model: torch.nn.Module, batch: Any) -> Any:
        if armed[0]:
            seen.append(census())
        return parts.loss(model, batch)

    trainer = Trainer(cfg, model=parts.model, dataset=parts.dataset, loss=loss, collate=parts.collate,
                      names=parts.names)
    trainer.setup()
    trainer.train_steps(1)
    armed[0] = True
    trainer.train_steps(1)
    trainer.finish()
    mib = [sum(v[2] for v in s.values()) / 2**20 for s in seen]
    new = [v for ptr, v in seen[-1].items() if ptr not in seen[1]]
    kinds = collections.Counter(f"{dtype}{list(shape)}" for shape, dtype, _ in new)
    print(f"{mode} K={k}: live MiB at each micro-batch: {', '.join(f'{m:.2f}' for m in mib)}; "
          f"alive at micro-batch {k} and not at 2: {sum(v[2] for v in new) / 2**10:.1f} KiB in {len(new)} "
          f"tensors {dict(kinds.most_common(4))}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.memory_census", description=__doc__.split("\n\n")[0])
    p.add_argument("modes", nargs="*", default=list(flat.MODES))
    p.add_argument("--k", type=int, default=8)
    args = p.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29641"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            run(mode, args.k, Path(tmp))


if __name__ == "__main__":
    main()
