"""The ``ft`` config section: replica groups kept training through a failure by torchft (a leaf module).

Kept apart from :mod:`distaccum.config` (which imports it); like :mod:`distaccum.split` it imports nothing of distaccum.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class FtConfig:
    """Fault-tolerant replica groups (docs/failures.md): the run's ranks form ``groups`` groups of
    ``trainer.nproc`` ranks (DDP or FSDP2 inside a group), coordinated by torchft's Manager and a Lighthouse. Each
    step's window of ``accum.global_batch`` samples is cut for the groups the step's quorum admits (K grows when a
    group is missing, the micro-batch stays), a step whose reduction across groups failed is computed again under
    the next quorum, and a restarted group heals from a live one and takes no pieces of the step in which it heals."""

    groups: int = 0
    """Replica groups (0: off). ``accum.global_batch`` must split into micro-batches over every count of groups from
    ``min_groups`` to ``groups``."""
    min_groups: int = 1
    """The fewest groups a step is committed with (the Lighthouse forms no smaller quorum). Every group must be
    present at step 1: none trains alone and overwrites the others' start."""
    lighthouse: str = ""
    """The Lighthouse's address (``http://host:port``); empty: ``distaccum train`` starts one on this machine (or
    ``TORCHFT_LIGHTHOUSE`` from the environment, under torchrun/srun)."""
    hostname: str = ""
    """The name this host advertises to the other groups (empty: ``socket.gethostname()``, which must resolve)."""
    heartbeat_timeout_ms: int = 5000
    """How long the Lighthouse waits for a silent group's heartbeat before it forms a quorum without it: the
    survivors' stall after a group dies (torchft's default)."""
    join_timeout_ms: int = 60000
    """How long the Lighthouse waits for groups that have not asked for the next quorum (torchft's default)."""
    quorum_tick_ms: int = 100
    """How often the Lighthouse checks for a quorum (torchft's default)."""
    timeout_s: float = 30.0
    """The reduction across groups and the commit vote wait this long (a hung group leaves the run after it);
    torchft's default is 60 s."""
    quorum_timeout_s: float = 300.0
    """How long a group waits for a quorum of at least ``min_groups`` (the first waits for all ``groups``)."""
    max_retries: int = 10
    """Steps computed again in a row before the run fails (a reduction that keeps failing)."""
    restarts: int = 3
    """``distaccum train``: times a dead group's launcher is restarted (it then heals from a live group)."""
    sample_ids: bool = False
    """Record the sample ids each group trained at each step (``ft_sample_ids``: the proof that none is lost or
    repeated; a step's record then grows with the global batch)."""

    def __post_init__(self) -> None:
        if self.groups < 0 or self.groups == 1:
            raise ValueError(f"ft.groups={self.groups}: 0 (off) or at least 2 replica groups")
        if self.groups and not 1 <= self.min_groups <= self.groups:
            raise ValueError(f"ft.min_groups={self.min_groups} must be between 1 and ft.groups={self.groups}")
        for name in (
            "heartbeat_timeout_ms",
            "join_timeout_ms",
            "quorum_tick_ms",
            "timeout_s",
            "quorum_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"ft.{name}={getattr(self, name)} must be positive")
        if self.max_retries < 0 or self.restarts < 0:
            raise ValueError(
                f"ft.max_retries={self.max_retries} and ft.restarts={self.restarts} must be >= 0"
            )

    @property
    def enabled(self) -> bool:
        """Whether the run's ranks form fault-tolerant replica groups."""
        return self.groups > 0

    def check_split(self, global_batch: int, micro_batch: int, group_world: int) -> None:
        """ValueError unless the global batch cuts into whole micro-batches for every count of groups a quorum may
        admit (K = G / (micro x ranks per group x groups present))."""
        for n in range(self.min_groups, self.groups + 1):
            if global_batch % (micro_batch * group_world * n):
                raise ValueError(
                    f"accum.global_batch={global_batch} does not split into micro-batches of {micro_batch} over "
                    f"{n} group(s) of {group_world} rank(s) (ft.min_groups={self.min_groups} to ft.groups="
                    f"{self.groups}): make it a multiple of {micro_batch * group_world} x each group count"
                )
