"""Checkpoints at window boundaries: written atomically, verified before use, resumable on any world size.

Layout (``run_dir/checkpoints/``)::

    step-00000040/
      model/               the engine's state: torch.distributed.checkpoint (DCP) shards written by
                           every rank (DDP, FSDP2, Accelerate), or DeepSpeed's own ZeRO checkpoint
      trainer_state.json   steps done, scheduler, data position, loss scaler, skip streak
      rng/rank-00000.pt    each rank's RNG state (restored only on the same world size)
      manifest.json        written last: step, run identity, size + sha256 of every file

A checkpoint is written into ``step-….tmp/`` and renamed into place only after every rank's files
are on disk (fsync) and the manifest is written: a preempted or failed write never leaves a
half-written checkpoint where a resume would look, and never touches the previous one. A
checkpoint counts only if its manifest exists and every file matches it; a corrupt latest
checkpoint is skipped (with a warning) for the previous valid one.

"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from distaccum.rundir import CHECKPOINTS, read_json, write_json
from distaccum.runtime.procgroup import collective_device

if TYPE_CHECKING:
    from distaccum.loop import TrainState

MANIFEST = "manifest.json"
IDENTITY = "identity"
"""The manifest's run identity (:func:`distaccum.resolve.run_identity`): what a resume is compared with."""
OLD_IDENTITY = "fingerprint"
"""Its name before issue 57 (read for one release: a checkpoint written then still resumes)."""
TRAINER_STATE = "trainer_state.json"
MODEL_DIR = "model"
RNG_DIR = "rng"
OUTER_DIR = "outer"
"""An outer-synced run's outer state (:class:`~distaccum.outer.sync.OuterSync`), one file per rank."""
FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (the previous one is intact) or none valid could be read."""


def step_dir(root: Path, step: int) -> Path:
    """The directory of the checkpoint taken after optimizer step ``step``."""
    return root / f"step-{step:08d}"


def fsync_tree(path: Path) -> None:
    """Flush every file under ``path`` and the directories themselves to disk."""
    for dirpath, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def file_digests(path: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file under ``path`` (relative names), the manifest excluded."""
    out: dict[str, dict[str, Any]] = {}
    for file in sorted(p for p in path.rglob("*") if p.is_file() and p.name != MANIFEST):
        digest = hashlib.sha256()
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        out[str(file.relative_to(path))] = {"size": file.stat().st_size, "sha256": digest.hexdigest()}
    return out


def commit(tmp: Path, final: Path, manifest: dict[str, Any]) -> None:
    """Seal a fully written checkpoint: digests into the manifest, fsync, atomic rename (rank 0 only)."""
    fsync_tree(tmp)
    write_json(tmp / MANIFEST, {**manifest, "format": FORMAT, "files": file_digests(tmp)})
    fsync_tree(tmp)
    if final.exists():  # a checkpoint of the same step from an earlier attempt: replace it whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_tree(final.parent)


def problems(path: Path) -> list[str]:
    """Why ``path`` is not a usable checkpoint (empty list: it is)."""
    manifest = read_json(path / MANIFEST)
    if not manifest:
        return [f"{path}: no readable {MANIFEST} (an unfinished or truncated write)"]
    if manifest.get("format") != FORMAT:
        return [f"{path}: checkpoint format {manifest.get('format')!r}, this distaccum reads {FORMAT}"]
    found = []
    for name, want in manifest.get("files", {}).items():
        file = path / name
        if not file.is_file():
            found.append(f"{path}: {name} is missing")
        elif file.stat().st_size != want["size"]:
            found.append(f"{path}: {name} has {file.stat().st_size} bytes, the manifest says {want['size']}")
    if found:
        return found
    digests = file_digests(path)
    return [
        f"{path}: {name} does not match its sha256 in the manifest"
        for name, want in manifest["files"].items()
        if digests.get(name, {}).get("sha256") != want["sha256"]
    ]


def candidates(root: Path) -> list[Path]:
    """Checkpoint directories under ``root``, newest step first (unfinished ``.tmp`` ones excluded)."""
    if not root.is_dir():
        return []
    found = [
        p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and not p.name.endswith(".tmp")
    ]
    return sorted(found, key=lambda p: p.name, reverse=True)


@dataclass(frozen=True)
class Found:
    """The checkpoint a resume will use, and the newer ones it had to skip."""

    path: Path | None
    skipped: list[str]
    """One line per unusable newer checkpoint (why)."""


def latest_valid(root: Path) -> Found:
    """The newest checkpoint whose files all match its manifest."""
    skipped: list[str] = []
    for path in candidates(root):
        issues = problems(path)
        if not issues:
            return Found(path, skipped)
        skipped.append("; ".join(issues))
    return Found(None, skipped)


def prune(root: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints, and stale ``.tmp`` directories (rank 0 only)."""
    for stale in root.glob("step-*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    for old in candidates(root)[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of a checkpoint directory."""
    return read_json(path / MANIFEST)


def saved_identity(manifest: dict[str, Any]) -> dict[str, Any]:
    """The run identity a checkpoint's manifest recorded (under its old name too: ``fingerprint``)."""
    return dict(manifest.get(IDENTITY, manifest.get(OLD_IDENTITY, {})))


def read_trainer_state(path: Path) -> dict[str, Any]:
    """The loop-level state of a checkpoint (JSON: no unpickling)."""
    return json.loads((path / TRAINER_STATE).read_text(encoding="utf-8"))


def checkpoint_root(run_dir: Path) -> Path:
    """Where a run keeps its checkpoints."""
    return Path(run_dir) / CHECKPOINTS


def describe_skipped(skipped: Iterable[str]) -> str:
    """A warning for checkpoints a resume could not use."""
    lines = list(skipped)
    return "skipped unusable checkpoint(s): " + " | ".join(lines) if lines else ""


def warn_skipped(found: Found) -> None:
    """Warn (once, by the caller's rank 0) about newer checkpoints that were unusable."""
    if found.skipped:
        warnings.warn(describe_skipped(found.skipped) + f"; resuming from {found.path}", stacklevel=2)


# --- what a resume must not silently change --------------------------------------------------------


def _digest(value: Any, h: Any) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"tensor{tuple(t.shape)}{t.dtype}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, Mapping):
        for key in sorted(value, key=str):
            h.update(str(key).encode())
            _digest(value[key], h)
    elif isinstance(value, list | tuple):
        for item in value:
            _digest(item, h)
    else:
        h.update(repr(value).encode())


def data_signature(dataset: Any) -> str:
    """A hash of the samples at the start, middle and end of a map-style dataset: a resume notices
    a data file that changed under an unchanged configuration."""
    h = hashlib.sha256()
    try:
        size = len(dataset)
    except TypeError:
        return "iterable"
    h.update(str(size).encode())
    for i in sorted({0, size // 2, size - 1}):
        _digest(dataset[i], h)
    return h.hexdigest()[:16]


def model_signature(model: nn.Module) -> str:
    """The model's architecture: its state-dict names, shapes and dtypes (not its values)."""
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
    count = sum(p.numel() for p in model.parameters())
    return f"{count} parameters, {h.hexdigest()[:16]}"


# --- writing and reading (collective) -------------------------------------------------------------


class CheckpointWriter:
    """Writes the files of a checkpoint that distaccum itself writes (the engines write their own state).

    One object, so a test can wrap it to fail a write midway, as a full disk would, and check that the
    previous checkpoint survives (``distaccum.testing``)."""

    def write_text(self, path: Path, text: str) -> None:
        """Write ``text`` to ``path`` (UTF-8)."""
        path.write_text(text, encoding="utf-8")

    def save_tensors(self, value: Any, path: Path) -> None:
        """``torch.save`` ``value`` (tensors only: read back with ``weights_only=True``)."""
        torch.save(value, path)


def save(
    state: TrainState,
    run_dir: Path,
    *,
    keep: int,
    manifest: dict[str, Any],
    writer: CheckpointWriter | None = None,
) -> Path:
    """Write a checkpoint of ``state`` after its last step; every rank calls it. Raises
    :class:`CheckpointError` (on every rank) when any rank failed to write: the previous checkpoint
    is untouched and the partial one removed."""
    writer = writer or CheckpointWriter()
    rank = dist.get_rank()
    step = state.source.next_step
    root = checkpoint_root(run_dir)
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    error = ""
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        extra = state.engine.save_state(tmp / MODEL_DIR)
        if (
            state.outer is not None
        ):  # theta_g, the outer optimizer, the island's item counts: every rank's own
            state.outer.save(tmp / OUTER_DIR, rank)
        (tmp / RNG_DIR).mkdir(exist_ok=True)
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state()
        writer.save_tensors(rng, tmp / RNG_DIR / f"rank-{rank:05d}.pt")
        if rank == 0:
            trainer_state = {
                "steps_done": len(state.records),
                "next_step": step,
                "scheduler": state.scheduler.state_dict(),
                "source": state.source.state_dict(),
                "engine": extra,
                "nonfinite_streak": state.nonfinite_streak,
                "n_prev": state.n_prev,  # the next step's c (accum.exact quantizes on its scale)
                "world_size": dist.get_world_size(),
            }
            writer.write_text(tmp / TRAINER_STATE, json.dumps(trainer_state, indent=2) + "\n")
    except Exception as err:  # noqa: BLE001 - every rank must learn that one rank failed
        error = f"{type(err).__name__}: {err}"
    device = collective_device()
    failed = torch.tensor([1.0 if error else 0.0], device=device)
    dist.all_reduce(failed)
    if failed.item() == 0 and rank == 0:
        try:
            commit(tmp, final, {**manifest, "step": step, "world_size": dist.get_world_size()})
            prune(root, keep)
        except Exception as err:  # noqa: BLE001
            error = f"{type(err).__name__}: {err}"
    verdict = torch.tensor([1.0 if error else 0.0], device=device)
    dist.all_reduce(verdict)
    if verdict.item() > 0:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = candidates(root)
        raise CheckpointError(
            f"writing the checkpoint after step {step} failed"
            + (f" on this rank ({error})" if error else " on another rank")
            + f"; the previous checkpoint is intact ({previous[0] if previous else 'none'})"
        )
    return final


def restore(state: TrainState, path: Path) -> dict[str, Any]:
    """Load checkpoint ``path`` into ``state`` on every rank; returns its trainer state. RNG states
    come back only on the world size that wrote them."""
    trainer_state = read_trainer_state(path)
    state.engine.load_state(path / MODEL_DIR, trainer_state.get("engine", {}))
    if state.outer is not None:
        state.outer.load(path / OUTER_DIR, dist.get_rank())
    state.scheduler.load_state_dict(trainer_state["scheduler"])
    state.source.load_state_dict(trainer_state["source"])
    state.nonfinite_streak = int(trainer_state.get("nonfinite_streak", 0))
    state.n_prev = float(trainer_state.get("n_prev", 0.0))
    rng_file = path / RNG_DIR / f"rank-{dist.get_rank():05d}.pt"
    if trainer_state.get("world_size") == dist.get_world_size() and rng_file.is_file():
        rng = torch.load(rng_file, map_location="cpu", weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return trainer_state


@dataclass
class Checkpointer:
    """Decides when the run checkpoints, and writes it: every ``every`` optimizer steps, when ``every_s``
    seconds passed by rank 0's clock (the loop makes every rank agree through the window's all-reduce),
    and always when the run stops on request. Keeps the newest ``keep``."""

    run_dir: Path
    _: KW_ONLY
    keep: int
    """Checkpoints kept, the newest."""
    every: int
    """Optimizer steps between two periodic checkpoints (0: none)."""
    every_s: float
    """Seconds between two time-based checkpoints by rank 0's clock (0: none)."""
    manifest: dict[str, Any]
    """What every checkpoint's manifest records besides its files (the run identity, the engine)."""
    rank: int
    writer: CheckpointWriter = field(default_factory=CheckpointWriter)
    last_time: float = field(default_factory=time.monotonic, init=False)
    last_step: int | None = field(default=None, init=False)
    """Optimizer steps done when the latest checkpoint was written (None: none yet by this run)."""

    def due_by_time(self) -> bool:
        """Rank 0's vote for a time-based checkpoint (the other ranks vote no)."""
        return self.rank == 0 and 0 < self.every_s <= time.monotonic() - self.last_time

    def saves_after(self, step: int, *, due: bool, stopping: bool) -> bool:
        """Whether to checkpoint after optimizer step ``step``: periodic, ``due`` (agreed by time) or the run is
        ``stopping`` (the loop then calls :meth:`save`). A skipped step leaves the parameters as the last finite
        update made them, so a checkpoint written after one never holds a non-finite value."""
        return stopping or due or bool(self.every and step % self.every == 0)

    def save(self, state: TrainState) -> Path:
        """Write a checkpoint after the last finished step now (collective)."""
        path = save(state, self.run_dir, keep=self.keep, manifest=self.manifest, writer=self.writer)
        self.last_time = time.monotonic()
        self.last_step = state.source.next_step
        return path
