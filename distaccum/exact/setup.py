"""Exact accumulation's set-up: deterministic kernels and what stays outside the guarantee (said once, at start), the
fixed-point engine around the run's engine, the step it seeds pieces by, and the summary's parameter hash."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from distaccum.engines import engine_class
from distaccum.exact.engine import ExactEngine
from distaccum.exact.fixed_point import HEADROOM_BITS, TARGET_BITS, params_sha256
from distaccum.features.base import Assembly, Engine, SetupBase, TrainState

OUTSIDE = (
    "random draws of the dataset or collate (augmentation) are not seeded per piece; the forward and backward "
    "of one piece must be deterministic on this hardware and its kernels"
)
"""What the guarantee does not cover, printed at start."""


class ExactSetup(SetupBase):
    """On with ``accum.exact=true`` (:mod:`distaccum.exact.checks` refused what it cannot run)."""

    name: ClassVar[str] = "exact"

    def __init__(self) -> None:
        self.engine: ExactEngine | None = None

    def enabled(self, run: Assembly) -> bool:
        return run.cfg.accum.exact

    def before_engine(self, run: Assembly) -> None:
        torch.use_deterministic_algorithms(True)  # for the rest of the process
        if not engine_class(run.spec.engine.name).replicated_gradients:
            # The reduction checksum bounds a float reduction's rounding; the int64 sum has none to bound (and the
            # fingerprint still compares the ranks' seeds and data).
            run.spec = dataclasses.replace(run.spec, sample_grads=False)
        split = run.resolved.split
        pieces = split.global_batch // split.micro_batch
        run.announce(
            f"distaccum: accum.exact: gradients summed in int64 fixed point over {pieces} pieces of "
            f"{split.micro_batch} samples per step (scale: the previous step's largest gradient at 2^{TARGET_BITS}, "
            f"{HEADROOM_BITS} bits of headroom), dropout seeded per piece, deterministic algorithms on: the same "
            f"bits for any K x world with accum.micro_batch={split.micro_batch}. Not covered: {OUTSIDE}"
            + (
                f"; on the CPU the intra-op thread count too (here {torch.get_num_threads()}: runs compared must "
                "use the same, e.g. OMP_NUM_THREADS=1)"
                if run.device.type == "cpu"
                else ""
            )
        )

    def around_engine(self, run: Assembly, engine: Engine) -> Engine:
        self.engine = ExactEngine(
            engine,
            world=run.world,
            rank=run.group_rank,
            seed=run.cfg.trainer.seed,
            group=run.group,
            across=run.across,
        )
        return self.engine  # type: ignore[return-value]  # an Engine by its methods

    def with_state(self, run: Assembly, state: TrainState, done: int) -> None:
        """Pieces placed and seeded by the window source: its step, and the split it cut the window for (a
        source cut per quorum, replica groups', says its own: ``place``)."""
        assert self.engine is not None
        source, fixed = state.source, (run.world, run.group_rank)
        self.engine.step_of = lambda: source.next_step
        self.engine.place_of = lambda: getattr(source, "place", fixed)

    def summarize(self, run: Assembly, state: TrainState, summary: dict[str, Any]) -> None:
        assert self.engine is not None and self.engine.fixed is not None
        fixed = self.engine.fixed
        summary["params_sha256"] = params_sha256(state.engine.full_parameters())
        summary["exact"] = {
            "redos": fixed.redos,
            "reduced_bytes_per_step": fixed.bytes_per_step,
            "exponents": {"min": min(fixed.exponents or [0]), "max": max(fixed.exponents or [0])},
        }
