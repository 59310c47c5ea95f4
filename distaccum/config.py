"""Typed run configuration: the only place config fields are declared and validated.

Hydra composes YAML from ``configs/`` (shipped inside the package); the entry layer converts it
to a plain mapping and calls :func:`from_mapping`, which builds these dataclasses and validates
them. The user's components (``model``, ``data.dataset``, ``data.collate``, ``loss``) stay
``_target_`` nodes here: the entry layer instantiates them, the library receives objects.
The library resolves it once (:func:`distaccum.resolve.resolve`) into the narrow objects each part
uses; nothing below the Trainer sees a :class:`RunConfig`, Hydra or OmegaConf.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

from distaccum.batching.config import AdaptiveConfig, RampConfig, check_growth
from distaccum.cluster.config import KubeflowConfig, RayConfig, SlurmConfig  # leaf modules, like Split
from distaccum.data.config import DataConfig, EvalConfig
from distaccum.ft.config import FtConfig
from distaccum.outer.config import OuterConfig, renamed_keys
from distaccum.rundir.log_config import LogConfig
from distaccum.runtime.contracts import parse_nnodes
from distaccum.split import (  # noqa: F401
    Split,
    check_split,
    check_worlds,
    nearest_valid_global_batches,
    no_split_message,
    resolve_split,
    valid_splits,
)
from distaccum.units import Node, check_choice, check_node, check_positive, parse_bytes
from distaccum.verify.config import VerifyConfig

ENGINES = ("ddp", "fsdp", "deepspeed", "accelerate")
PRECISIONS = ("fp32", "bf16", "fp16", "fp64")
SYNC_MODES = ("auto", "boundary", "replica_boundary", "every_micro")
REDUCE_DTYPES = ("fp32", "bf16", "fp16")
LOSS_NORMS = ("global_count", "mean_per_micro")
OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("constant", "cosine", "linear")
AUTO = "auto"
"""``accum.micro_batch=auto``: the Trainer picks the largest micro-batch that fits the memory budget."""
LR_SCALINGS = ("none", "linear", "sqrt")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
SCHEDULE_ON_RESUME = ("keep", "stretch")
DEFAULT_EXTENSIONS_DIR = "~/.cache/distaccum/torch_extensions"
"""DeepSpeed's C++ op cache unless ``engine.extensions_dir`` says otherwise."""


class ConfigError(ValueError):
    """An invalid configuration: reported with exit code 2 before (or instead of) training."""


@dataclass(kw_only=True)
class EngineConfig:
    """Which distributed engine wraps the model, and its engine-specific knobs."""

    name: str = "ddp"
    """ddp | fsdp | deepspeed | accelerate."""
    zero_stage: int = 1
    """DeepSpeed ZeRO stage (0-3); ignored by other engines."""
    deepspeed_config: str | None = None
    """Path to a user DeepSpeed JSON merged into the generated one; conflicts are errors."""
    extensions_dir: str = DEFAULT_EXTENSIONS_DIR
    """Where DeepSpeed caches its JIT-compiled C++ ops (TORCH_EXTENSIONS_DIR; ``~`` is the home directory). The default
    is one cache per user and machine, shared by every run directory and checkout: the op compiles once (torch
    rebuilds it when its sources or flags change)."""
    fsdp_reduce_fp32: bool = True
    """FSDP2 mixed precision: reduce gradients in fp32 even when computing in bf16/fp16 (accum.reduce_dtype=bf16
    or fp16, when set, is the reduce dtype instead)."""
    fsdp_unsharded_window: bool = False
    """FSDP2: keep parameters unsharded from a window's first forward to its last backward: one
    parameter all-gather per unit per optimizer step instead of two per micro-batch, for a full
    copy of the parameters in memory during the window."""
    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size in MiB."""
    replicas: int | str = AUTO
    """FSDP2 hybrid sharding (HSDP): R replicas of the model, each sharded over world/R ranks (a 2-D
    replicate x shard mesh; R must divide the world). 1: flat FSDP over the whole world. auto: one
    replica per node when the launch spans several nodes (replicate across nodes, shard within a
    node), else 1. Other engines take only 1 or auto."""

    def __post_init__(self) -> None:
        check_choice("engine", "name", self.name, ENGINES)
        if self.replicas != AUTO and (isinstance(self.replicas, (str, bool)) or self.replicas < 1):
            raise ValueError(f"engine.replicas must be a positive integer or 'auto', got {self.replicas!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"engine.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        check_positive("engine", "bucket_cap_mb", self.bucket_cap_mb)


@dataclass(kw_only=True)
class AccumConfig:
    """Gradient accumulation: how an optimizer step's global batch is split."""

    micro_batch: int | str = 4
    """Samples per micro-batch per rank, or auto: the largest micro-batch whose training step fits
    memory_budget on every rank, measured when training starts (needs global_batch; steps follow)."""
    steps: int = 4
    """Micro-batches accumulated per optimizer step (K). Ignored when global_batch is set."""
    global_batch: int | None = None
    """Samples per optimizer step over all ranks; when set, steps = global_batch / (micro_batch * world)."""
    sync: str = "auto"
    """When gradients are reduced. boundary: once per optimizer step, after the last micro-batch (no
    communication before it); every_micro: after every micro-batch; replica_boundary (HSDP only,
    engine.replicas > 1): reduce-scatter inside each replica after every micro-batch, one all-reduce
    across replicas per optimizer step; auto: replica_boundary on HSDP, boundary otherwise."""
    reduce_dtype: str = "fp32"
    """fp32 | bf16 | fp16: the dtype of the gradient reduction on the wire (for HSDP: both its
    collectives; see docs/multinode.md). fp32: the gradients' own dtype, uncompressed. bf16/fp16 halve
    the bytes reduced while the local accumulation stays in the parameters' precision, so with
    accum.sync=boundary the rounding is paid once per optimizer step."""
    loss_norm: str = "global_count"
    """global_count: divide by the window's loss items over all ranks; mean_per_micro: classic loss/K
    (wrong for variable-length items; kept as a negative control for verify)."""
    memory_budget: int | str | None = None
    """Peak memory per rank a training step may use, for micro_batch=auto and `distaccum plan`: bytes
    or a size (6GiB, 512MB), compared with what peak_mem_bytes records (CUDA: allocated device memory;
    CPU: the process's peak RSS). null: the free device memory on CUDA; on CPU, this process's
    resident memory plus 80% of the available RAM shared by the node's ranks."""
    ramp: RampConfig = field(default_factory=RampConfig)
    """Grow the global batch during training by K (docs/planning.md, batch growth); ends at global_batch."""
    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    """Let the measured gradient noise scale choose the global batch (opt-in; starts at global_batch)."""
    exact: bool = False
    """Accumulate and reduce gradients in int64 fixed point (engine=ddp or fsdp): the same bits for every split of the
    global batch (micro_batch fixed; K and world size free). docs/verification.md, bitwise."""

    def __post_init__(self) -> None:
        check_growth(self.ramp, self.adaptive, self.global_batch)
        if isinstance(self.micro_batch, str):
            if self.micro_batch != AUTO:
                raise ValueError(
                    f"accum.micro_batch must be a positive integer or 'auto', got {self.micro_batch!r}"
                )
            if self.global_batch is None:
                raise ValueError(
                    "accum.micro_batch=auto needs accum.global_batch (the samples per optimizer "
                    "step it keeps fixed while it picks the micro-batch), e.g. accum.global_batch=64"
                )
        else:
            check_positive("accum", "micro_batch", self.micro_batch)
        check_positive("accum", "steps", self.steps)
        if self.memory_budget is not None:
            parse_bytes("accum.memory_budget", self.memory_budget)
        check_positive("accum", "global_batch", self.global_batch, allow_none=True)
        check_choice("accum", "sync", self.sync, SYNC_MODES)
        check_choice("accum", "reduce_dtype", self.reduce_dtype, REDUCE_DTYPES)
        check_choice("accum", "loss_norm", self.loss_norm, LOSS_NORMS)

    @property
    def auto(self) -> bool:
        """micro_batch=auto: the split is chosen when training starts."""
        return self.micro_batch == AUTO

    def budget_bytes(self) -> int | None:
        """``memory_budget`` in bytes (None: the device's default)."""
        return None if self.memory_budget is None else parse_bytes("accum.memory_budget", self.memory_budget)


@dataclass(kw_only=True)
class OptimConfig:
    """Optimizer, learning-rate schedule and clipping (all applied once per optimizer step)."""

    name: str = "adamw"
    """sgd | adamw."""
    lr: float = 3e-3
    """Peak learning rate."""
    momentum: float = 0.9
    """SGD momentum."""
    weight_decay: float = 0.0
    """Decoupled (adamw) or L2 (sgd) weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    schedule: str = "cosine"
    """constant | cosine | linear (decay after warmup to min_lr_ratio * lr at trainer.max_steps)."""
    warmup_steps: int = 2
    """Linear warmup, in optimizer steps."""
    min_lr_ratio: float = 0.1
    """Final lr as a fraction of lr (cosine/linear)."""
    clip_norm: float | None = 1.0
    """Clip the global gradient norm to this value at the boundary; null disables clipping."""
    lr_scaling: str = "none"
    """none | linear | sqrt: train with lr x f(global_batch / base_batch), f(r) = r (the linear scaling
    rule, for SGD) or sqrt(r) (adaptive optimizers), so a sweep over accum.global_batch keeps the
    update size comparable; warmup stays in optimizer steps."""
    base_batch: int | None = None
    """The global batch (samples per optimizer step) that lr is set for; needed by lr_scaling."""

    def __post_init__(self) -> None:
        check_choice("optim", "name", self.name, OPTIMIZERS)
        check_choice("optim", "schedule", self.schedule, SCHEDULES)
        check_choice("optim", "lr_scaling", self.lr_scaling, LR_SCALINGS)
        check_positive("optim", "lr", self.lr)
        check_positive("optim", "clip_norm", self.clip_norm, allow_none=True)
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        self.betas = tuple(self.betas)  # type: ignore[assignment]
        check_positive("optim", "base_batch", self.base_batch, allow_none=True)
        if self.lr_scaling != "none" and self.base_batch is None:
            raise ValueError(
                f"optim.lr_scaling={self.lr_scaling} needs optim.base_batch: the global batch "
                f"optim.lr={self.lr:g} was chosen for (e.g. optim.base_batch=64)"
            )

    def lr_scale(self, global_batch: int) -> float:
        """``f(global_batch / base_batch)``: 1 (``none``), the ratio (``linear``) or its square root (``sqrt``)."""
        if self.lr_scaling == "none" or self.base_batch is None:
            return 1.0
        ratio = global_batch / self.base_batch
        return ratio if self.lr_scaling == "linear" else ratio**0.5


@dataclass(kw_only=True)
class TrainerConfig:
    """Process topology and the length of the run."""

    nproc: int = 2
    """Worker processes per node (torchrun --nproc_per_node)."""
    nnodes: int | str = 1
    """Nodes taking part (> 1 needs rdzv_endpoint): N, or MIN:MAX for an elastic launch (torchrun --nnodes=MIN:MAX)
    that starts once MIN nodes have joined and, when nodes leave (up to max_restarts times) or join, continues from
    its last checkpoint on the new world at the same global batch (needs accum.global_batch; docs/clusters.md)."""
    rdzv_endpoint: str = "127.0.0.1:29500"
    """host:port of the c10d rendezvous (the first node)."""
    rdzv_id: str = "distaccum"
    """Rendezvous id shared by all nodes of one job."""
    max_restarts: int = 0
    """Elastic restarts of the worker group after a failure."""
    rdzv_last_call_s: int = 30
    """Elastic launches: once MIN nodes have joined a rendezvous, the seconds it waits for more (up to MAX) before
    it starts with those it has (torch elastic's last_call_timeout)."""
    max_steps: int = 20
    """Optimizer steps to run (not micro-batches). A decaying schedule's horizon, also when max_samples ends the run
    earlier."""
    max_samples: int | None = None
    """End the run after the optimizer step whose samples bring the run's total to N or past it: the first step s
    with samples(1) + ... + samples(s) >= N, whatever each step's global batch (accum.ramp, accum.adaptive), or at
    max_steps if that comes first. Not with outer.method (its closing sync follows max_steps). null: max_steps
    alone."""
    seed: int = 0
    """Seed for initial weights and data shuffling."""
    device: str = "auto"
    """auto (cuda when present) | cpu | cuda."""
    check_every: int = 10
    """Cross-rank consistency tripwire every N optimizer steps (0 disables). One check costs ~3-6%
    of a step on CPU/gloo (measured, see docs/verification.md), so every 10 steps costs <= 0.6%."""
    fingerprint: bool = True
    """After every boundary reduction compare across ranks a sample of the reduced gradient (ddp, accelerate) or
    check each sampled reduced element against the ranks' local gradients summed exactly (fsdp, HSDP, deepspeed
    ZeRO: distaccum/guards/checksum.py, one all-reduce of the sample a step), each rank's data and random seed,
    compared a step later. A correct reduction is never flagged (a proven bound); a skipped, doubled or halved one
    stops the run at the next step or before a checkpoint (exit 1) when some sampled element does not cancel across
    the ranks: in fp32 always, in bf16/fp16 as docs/verification.md tabulates (a bf16 reduction over 23 or more
    ranks does not check gradients uncorrelated across them, and the run says so at start).
    Identical data or random numbers on every rank are warned about. Off only to save the sample; 1 rank skips it."""
    init_from: str | None = None
    """Initial weights, loaded after the model is built, before wrapping, under the plain model's parameter
    names (e.g. a seed checkpoint): a .safetensors file, a run's final/ directory, or a PyTorch state dict
    saved with torch.save (.pt, .pth, .bin; read with weights_only=True; flat or under 'state_dict'/'model')."""
    resume: bool = True
    """Resume from the newest valid checkpoint in run_dir/checkpoints when there is one; false deletes the
    run directory's checkpoints and starts afresh. Every setting that differs from the checkpoint's record is
    allowed (and listed), must be chosen (trainer.schedule_on_resume) or is refused (exit 2):
    docs/failures.md#resuming."""
    schedule_on_resume: str | None = None
    """A resume that changes trainer.max_steps under a decaying schedule (cosine, linear) moves its horizon and
    is refused unless this says how: keep (the original schedule; past its horizon the lr stays at its final value)
    | stretch (decay from the lr reached at the resumed step to the final value at the new max_steps)."""
    checkpoint_every: int = 100
    """Checkpoint after every N-th optimizer step (0: only when stopped and at the end). A stop
    request (SIGTERM/SIGUSR1) always checkpoints after the window in progress."""
    checkpoint_every_s: float = 0.0
    """Also checkpoint when this many seconds passed since the last checkpoint (0: off)."""
    keep_checkpoints: int = 2
    """Checkpoints kept in run_dir/checkpoints (the newest; older ones are deleted after a new one is
    complete). A finished run keeps its last one next to final/."""
    max_nonfinite_steps: int = 3
    """Stop (exit 1, with a diagnosis) after this many consecutive optimizer steps whose loss or
    gradient was not finite; each such step is skipped on every rank."""
    collective_timeout_s: float = 600.0
    """A collective that waits longer than this fails the run, naming the unresponsive rank where it
    can (a stopped or dead process), instead of hanging forever."""
    shutdown_grace_s: int = 30
    """Local launches: how long the launcher lets workers exit after SIGTERM (a stop request, or
    the rest of the group after one rank failed) before it kills them."""
    save_final: bool = True
    """Write the trained model to run_dir/final/ (model.safetensors, config; save_pretrained for
    Hugging Face models) when the run finishes."""
    compile: bool = False
    """torch.compile the model: DDP and Accelerate compile the wrapped module (graphs split at the gradient
    buckets), FSDP2 each block before sharding, DeepSpeed through its engine.compile(). DDP, Accelerate and
    DeepSpeed compile with dynamic shapes from the start (varying sequence lengths and partial windows do not
    recompile); FSDP2's blocks use automatic dynamic shapes (one recompile in the first window when the sequence
    length first changes).
    Each step records compile_s, recompiles and graph_breaks; a recompile after the first step is reported.
    See docs/compile.md."""
    compile_mode: str = "default"
    """torch.compile mode: default | reduce-overhead | max-autotune | max-autotune-no-cudagraphs."""

    def __post_init__(self) -> None:
        for name in ("nproc", "max_steps"):
            check_positive("trainer", name, getattr(self, name))
        low, high = parse_nnodes(self.nnodes)
        self.nnodes = low if low == high else f"{low}:{high}"
        check_choice("trainer", "device", self.device, ("auto", "cpu", "cuda"))
        check_choice("trainer", "compile_mode", self.compile_mode, COMPILE_MODES)
        if self.schedule_on_resume is not None:
            check_choice("trainer", "schedule_on_resume", self.schedule_on_resume, SCHEDULE_ON_RESUME)
        if self.check_every < 0 or self.max_restarts < 0 or self.checkpoint_every < 0:
            raise ValueError(
                "trainer.check_every, trainer.max_restarts and trainer.checkpoint_every must be >= 0"
            )
        if self.checkpoint_every_s < 0:
            raise ValueError(f"trainer.checkpoint_every_s must be >= 0, got {self.checkpoint_every_s}")
        for name in ("keep_checkpoints", "max_nonfinite_steps", "collective_timeout_s", "shutdown_grace_s"):
            check_positive("trainer", name, getattr(self, name))
        check_positive("trainer", "rdzv_last_call_s", self.rdzv_last_call_s)
        check_positive("trainer", "max_samples", self.max_samples, allow_none=True)

    def node_range(self) -> tuple[int, int]:
        """(MIN, MAX) nodes of the launch: equal for a fixed ``nnodes``, MIN < MAX for an elastic launch."""
        return parse_nnodes(self.nnodes)


@dataclass(kw_only=True)
class RunConfig:
    """Everything one run needs. Built by :func:`from_mapping` (CLI) or directly (Python API)."""

    model: Node | None = None
    """_target_ node of a callable returning the nn.Module to train (built once per rank, after seeding)."""
    loss: Node | None = None
    """_target_ node (``_partial_: true``) of ``(model, batch) -> (loss_sum, n_items)``: the SUM of the
    loss over the batch's n_items loss items (tokens or samples), never a mean."""
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    accum: AccumConfig = field(default_factory=AccumConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    log: LogConfig = field(default_factory=LogConfig)
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    kubeflow: KubeflowConfig = field(default_factory=KubeflowConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    ft: FtConfig = field(default_factory=FtConfig)
    precision: str = "fp32"
    """fp32 | bf16 (autocast) | fp16 (autocast + GradScaler) | fp64."""
    run_dir: str = "runs/default"
    """Directory for every output of the run (metrics.jsonl, summary.json, config, final/)."""

    def __post_init__(self) -> None:
        check_choice("", "precision", self.precision, PRECISIONS)
        self.model = check_node("model", self.model)
        self.loss = check_node("loss", self.loss)
        low, high = self.trainer.node_range()
        if high > 1 and not self.trainer.rdzv_endpoint:
            raise ValueError(f"trainer.nnodes={self.trainer.nnodes} needs trainer.rdzv_endpoint=host:port")
        elastic = f"trainer.nnodes={self.trainer.nnodes} is elastic"
        if low < high and self.accum.global_batch is None:
            raise ValueError(
                f"{elastic} and needs accum.global_batch: a fixed accum.steps={self.accum.steps} would "
                "change the samples per optimizer step with the world size"
            )
        if low < high and self.outer.enabled:  # islands have a fixed size: a lost node changes their count
            raise ValueError(
                f"{elastic}, and outer.method={self.outer.method} cannot follow: a lost node changes "
                "the island count, which a resume refuses; use a fixed trainer.nnodes"
            )
        if (
            self.trainer.max_samples is not None and self.outer.enabled
        ):  # the last merge is placed at max_steps
            raise ValueError(
                f"trainer.max_samples={self.trainer.max_samples} cannot end an outer-synced run "
                f"(outer.method={self.outer.method}): its closing sync merges every island after "
                "trainer.max_steps; set trainer.max_steps instead"
            )
        if low < high:  # the run may continue on any of these worlds: every one must split the global batch
            check_worlds(self.accum, self.world_sizes(), f"trainer.nnodes={self.trainer.nnodes}")
        if self.log.gns and self.accum.sync not in ("boundary", "auto"):
            raise ValueError(
                f"log.gns=true reads the gradients the comm hook reduces once per step: it needs "
                f"accum.sync=boundary, got accum.sync={self.accum.sync}"
            )

    def world_size(self) -> int:
        """World size a local launch of this config produces (an elastic launch: the largest, MAX nodes)."""
        return self.trainer.nproc * self.trainer.node_range()[1]

    def world_sizes(self) -> list[int]:
        """Every world size a local launch may run on: nproc x n for n from MIN to MAX nodes."""
        low, high = self.trainer.node_range()
        return [self.trainer.nproc * n for n in range(low, high + 1)]

    def split(self, world_size: int | None = None) -> Split:
        """The resolved split for ``world_size`` (default: the launch's world size)."""
        return resolve_split(self.accum, world_size or self.world_size())

    def global_batch(self, world_size: int | None = None) -> int:
        """Samples per optimizer step on ``world_size`` ranks (known even with micro_batch=auto)."""
        if self.accum.global_batch is not None:
            return self.accum.global_batch
        return self.split(world_size).global_batch

    def describe(self, node: str) -> str:
        """The ``_target_`` of component ``node`` ('model', 'loss', 'dataset', 'collate', 'eval_dataset'),
        for messages."""
        value = {
            "model": self.model,
            "loss": self.loss,
            "dataset": self.data.dataset,
            "collate": self.data.collate,
            "eval_dataset": self.eval.dataset,
        }[node]
        return str(value["_target_"]) if value else "(none)"


SECTIONS: dict[str, type] = {f.name: f.type for f in dataclasses.fields(RunConfig)}  # type: ignore[misc]


def _build(cls: type, values: Mapping[str, Any], path: str) -> Any:
    """Build dataclass ``cls`` from a mapping, recursing into nested config sections."""
    if not isinstance(values, Mapping):
        raise ValueError(f"{path or 'config'} must be a mapping, got {values!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(
            f"unknown config key(s) {', '.join(f'{path}{k}' for k in unknown)}; "
            f"valid keys under {path or 'the top level'}: {', '.join(sorted(names))}"
        )
    kwargs: dict[str, Any] = {}
    for name, value in values.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint) and isinstance(hint, type):
            kwargs[name] = _build(hint, value, f"{path}{name}.")
        else:
            kwargs[name] = value
    try:
        return cls(**kwargs)
    except TypeError as err:  # wrong value types from YAML end up here
        raise ValueError(f"bad value in {path or 'config'}: {err}") from err


def from_mapping(values: Mapping[str, Any]) -> RunConfig:
    """Build and validate a :class:`RunConfig` from a plain (resolved) mapping; an old key of
    :data:`~distaccum.outer.config.RENAMED_KEYS` is read as its new name."""
    return _build(RunConfig, renamed_keys(values)[0], "")


def to_mapping(cfg: RunConfig) -> dict[str, Any]:
    """The inverse of :func:`from_mapping` (JSON-serializable)."""
    out = dataclasses.asdict(cfg)
    out["optim"]["betas"] = list(cfg.optim.betas)
    return out


def with_overrides(cfg: RunConfig, overrides: Mapping[str, Any]) -> RunConfig:
    """``cfg`` with dotted-key overrides applied (``{"accum.micro_batch": 2, "run_dir": "x"}``), validated."""
    values = to_mapping(cfg)
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        target = values
        for part in parents:
            if not isinstance(target.get(part), dict):
                raise ValueError(f"unknown config key {dotted!r}")
            target = target[part]
        if leaf not in target:
            raise ValueError(f"unknown config key {dotted!r}")
        target[leaf] = value
    return from_mapping(values)
