"""FSDP2 engine: ``fully_shard`` per block over a flat mesh, or hybrid sharding (HSDP) over a 2-D one.

Flat (``engine.replicas=1``): every rank holds 1/W of each unit.

- ``accum.sync=boundary``: ``set_requires_gradient_sync(False)`` on micro-batches 1..K-1, so each
  unit keeps its *unsharded* gradient until the last micro-batch reduce-scatters it once — one
  reduce-scatter round per optimizer step, but a full gradient's worth of memory per rank.
- ``accum.sync=every_micro``: every micro-batch reduce-scatters and frees the unsharded gradient,
  accumulating into the 1/W sharded one — K rounds (K x the bytes), the memory-saving mode.
- ``engine.fsdp_unsharded_window=true``: parameters stay unsharded from the window's first forward
  to its last backward (``reshard_after_forward=False`` and ``set_reshard_after_backward(False)``
  until the boundary): one parameter all-gather per unit per step instead of two per micro-batch,
  for a full copy of the parameters in memory during the window.

HSDP (``engine.replicas=R``, R > 1): a ``(R, W/R)`` mesh named ``("replicate", "shard")``. Mesh rank
``r`` sits at replica ``r // (W/R)``, shard ``r % (W/R)``: launchers number the ranks of a node
consecutively, so with R = nodes each replica is one node (shard within a node, replicate across
nodes). A unit's gradient is reduce-scattered inside the replica (shard group, the fast link), then its
1/(W/R) shard is all-reduced across replicas (the slow link). The modes:

- ``boundary``: nothing on micro-batches 1..K-1 (unsharded gradients kept, as above); the last one
  reduce-scatters and all-reduces once.
- ``replica_boundary`` (the default on HSDP): ``set_requires_gradient_sync(True)`` with
  ``set_requires_all_reduce(last micro-batch)``: a reduce-scatter inside the replica every
  micro-batch (memory stays at the 1/(W/R) shard: FSDP2 keeps the partial sum of the scattered shards),
  one all-reduce across replicas per optimizer step.
- ``every_micro``: reduce-scatter and all-reduce after every micro-batch.

``accum.reduce_dtype=bf16|fp16`` is ``MixedPrecisionPolicy.reduce_dtype``: FSDP2 casts the unit's
gradient into the reduce dtype *before* the reduce-scatter, so both collectives (reduce-scatter and,
under HSDP, the all-reduce) run in it, and under ``replica_boundary`` the partial sum it keeps across
micro-batches is in that dtype too (read off ``foreach_reduce`` in torch 2.13); the result is cast
back to the parameters' dtype when it becomes the sharded gradient. With ``boundary`` the K
micro-batches accumulate in the reduce dtype (FSDP2 casts the first and adds the others to it) and the
compressed reduction runs once per step.

Reduction is a plain SUM (``grad_divisor = 1``): the loop's division by the global item count
stays the only normalization. FSDP2's default is a mean over ranks; keeping it and declaring
``grad_divisor = world`` would work too, but a custom divide factor runs as
``ReduceOp.PREMUL_SUM``, which gloo rejects, so we set factor 1 *and* force plain SUM comms. (DDP
must average instead: its every_micro buckets hold already-reduced gradients; FSDP2's reduce-scatter
always takes fresh unsharded gradients, so a sum is exact.)
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from distaccum.engines.base import (
    EngineBase,
    EngineSpec,
    GradNorms,
    OptimizerFactory,
    Precision,
    StepResult,
    dcp_load,
    dcp_save,
    step_plain,
)
from distaccum.engines.comm_tap import tap_gradient_reductions, tap_parameter_gathers
from distaccum.engines.compile import compile_in_place
from distaccum.guards.checksum import ReductionChecksum, Rounding
from distaccum.models import block_units
from distaccum.telemetry.ledger import CommLedger


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules sharded on their own (each is all-gathered/reduce-scattered as one unit).

    The model's blocks (:func:`distaccum.models.block_units`: a Hugging Face model's
    ``_no_split_modules`` layers, else the children of the largest ``nn.ModuleList``); without
    blocks, every Linear/Conv layer, so at most one layer is unsharded at a time. The root module
    takes whatever is left (embeddings, final norm, head).
    """
    units = block_units(model)
    if units:
        return units
    return [m for m in model.modules() if isinstance(m, nn.Linear | nn.Conv1d | nn.Conv2d | nn.Conv3d)]


def mixed_precision(
    precision: Precision, reduce_fp32: bool, compressed: torch.dtype | None = None
) -> MixedPrecisionPolicy:
    """bf16: parameters all-gathered in bf16; gradients reduced in fp32 unless ``reduce_fp32`` is off.
    ``compressed`` (``accum.reduce_dtype``), when set, is the dtype every gradient reduction runs in."""
    low = precision.autocast_dtype
    if compressed is not None:
        return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=compressed)
    if low is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if reduce_fp32 else low)


def hsdp_mesh(device_type: str, world: int, replicas: int) -> DeviceMesh:
    """The flat ``(world,)`` mesh, or for ``replicas`` > 1 the ``(replicas, world / replicas)`` mesh named
    ``("replicate", "shard")``: row i (replica i) holds ranks ``i*S .. i*S+S-1``."""
    if replicas == 1:
        return init_device_mesh(device_type, (world,))
    return init_device_mesh(device_type, (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))


def unsharded_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The unsharded ``nn.Parameter`` of every sharded parameter of ``model``, in ``named_parameters`` order: what
    autograd accumulates a micro-batch's local gradient into (collective: each unit is unsharded once).

    FSDP2 internals relied on (see :meth:`FSDPEngine._watch`): each FSDP parameter's unsharded parameter is made at
    its first all-gather and kept for the module's life; the public ``unshard()`` registers it on the module."""
    named = list(model.named_parameters())
    found: dict[str, nn.Parameter] = {}
    for module in model.modules():  # one unit unsharded at a time: never the whole model in memory
        if isinstance(module, FSDPModule):
            module.unshard()  # registers this unit's unsharded parameters (a collective, once)
            found.update((n, p) for n, p in model.named_parameters() if not isinstance(p, DTensor))
            module.reshard()
    leaves = [found.get(name) for name, _ in named]
    if any(p is None or p.shape != q.shape for p, (_, q) in zip(leaves, named, strict=True)):
        raise RuntimeError("FSDP2's unshard() did not register whole unsharded parameters on the modules")
    return cast(list[nn.Parameter], leaves)


class FSDPEngine(EngineBase):
    """torch FSDP2 (``fully_shard``) with SUM reduce-scatters reported to the ledger by a tap."""

    name = "fsdp"
    exact_accumulation = True
    grad_divisor = 1.0  # SUM reduction (see the module docstring): nothing divides after the loop
    hybrid_sharding = True
    reduce_dtypes = ("fp32", "bf16", "fp16")

    @classmethod
    def check(cls, spec: EngineSpec) -> None:
        """fp16 needs a sharded GradScaler, which distaccum does not drive; replicas must divide the world."""
        super().check(spec)
        if spec.precision.loss_scaling:
            raise ValueError(
                "precision=fp16 with engine=fsdp is unsupported (GradScaler needs the sharded "
                "scaler); use bf16 or fp32"
            )
        world = spec.split.world_size
        if world % spec.replicas:
            divisors = [r for r in range(1, world + 1) if world % r == 0]
            raise ValueError(
                f"engine.replicas={spec.replicas} does not divide the world of {world} ranks: HSDP "
                f"needs {world} = replicas x shards. Replicas that do: {divisors}"
            )

    def __init__(self, spec: EngineSpec, ledger: CommLedger) -> None:
        super().__init__(spec, ledger)
        self.module: nn.Module | None = None
        self._micro = 0
        self.mesh: DeviceMesh | None = None
        self._replicate_group: str | None = None
        """Name of the cross-replica process group (HSDP), for the ledger's tap."""
        self._norms = GradNorms()
        self.checksum: ReductionChecksum | None = None
        """The reduction checksum (``EngineSpec.sample_grads``: the reduction fingerprint with more than one rank)."""
        """The groups of ranks that each hold the whole reduced gradient between them (HSDP: the replicas)."""

    def wrap(self, model: nn.Module, make_optimizer: OptimizerFactory) -> nn.Module:
        model = model.to(device=self.device, dtype=self.precision.param_dtype)
        mesh = self.mesh = (
            self.spec.islands.inner_mesh  # an outer-synced run: sharded over its island only
            if self.spec.islands is not None
            else hsdp_mesh(self.device.type, dist.get_world_size(), self.spec.replicas)
        )
        if self.spec.replicas > 1:
            self._replicate_group = mesh.get_group("replicate").group_name
        policy = mixed_precision(
            self.precision, self.spec.engine.fsdp_reduce_fp32, self.spec.compressed_dtype
        )
        keep = self.spec.engine.fsdp_unsharded_window
        for unit in shard_units(model):
            if self.spec.compile_mode:  # per block, before sharding: FSDP's hooks run between compiled blocks
                compile_in_place(unit, self.spec.compile_mode)
            fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=not keep)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        for module in model.modules():  # both setters act on one FSDP unit, not recursively
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        self.module = model
        self.optimizer = make_optimizer(list(model.parameters()))  # over the sharded DTensors
        if self.spec.sample_grads:
            self._watch(model, mesh, policy)
        return model

    def _watch(self, model: nn.Module, mesh: DeviceMesh, policy: MixedPrecisionPolicy) -> None:
        """Set up the reduction checksum (:mod:`distaccum.guards.checksum`): the positions each rank's shards hold,
        and hooks on the unsharded parameters autograd accumulates the window's local gradients into.

        FSDP2 internals relied on (tests/test_reduction_checksum.py fails if torch moves them): a parameter is
        sharded on dim 0 in ``torch.chunk`` pieces over the shard mesh dimension (checked here against the local
        shard's size), and each FSDP parameter's unsharded ``nn.Parameter`` is made at its first all-gather and
        kept for the module's life (its storage freed and refilled in place), so hooks registered once see every
        micro-batch. The public ``unshard()`` registers those parameters on the modules, where they are read."""
        named = list(model.named_parameters())
        shard_rank, shards = (
            (mesh.get_local_rank(), mesh.size())
            if mesh.ndim == 1
            else (mesh.get_local_rank("shard"), mesh.size(1))
        )
        owned = []
        for name, param in named:
            assert isinstance(param, DTensor), f"{name}: fully_shard left a plain tensor"
            rows = param.shape[0] if param.dim() else 1
            per_row = param.numel() // max(rows, 1)
            chunk = -(-rows // shards)
            lo, hi = min(shard_rank * chunk, rows) * per_row, min((shard_rank + 1) * chunk, rows) * per_row
            if param.to_local().numel() != hi - lo:
                raise RuntimeError(
                    f"FSDP2 no longer shards {name} on dim 0 in torch.chunk pieces ({param.to_local().numel()} local "
                    f"elements, {hi - lo} expected): the reduction checksum cannot place its shards"
                )
            owned.append((lo, hi))
        leaves = unsharded_parameters(model)
        unsharded = policy.param_dtype or self.precision.param_dtype
        self.checksum = ReductionChecksum(
            [p.numel() for _, p in named],
            owned,
            self.spec.split.accum_steps,
            self.device,
            unsharded,
            named[0][1].dtype,  # the sharded gradients keep the parameters' own dtype
        )
        self.checksum.watch(cast(list[nn.Parameter], leaves))
        self.checksum.replicas = self.layout() or [list(range(self.spec.world_size))]
        self.checksum.group = self.spec.group
        reduce = policy.reduce_dtype or unsharded
        # boundary: FSDP2 accumulates the window's unsharded gradients in the reduce dtype (autograd's ``grad +=``
        # when it is the parameters' dtype, else its own ``acc += grad`` after a first cast) and reduces once; the
        # other modes reduce every micro-batch and accumulate the reduced pieces.
        self.checksum.rounding = Rounding(
            world=mesh.size(),
            accum_steps=self.spec.split.accum_steps,
            reduce=reduce,
            held=named[0][1].dtype,
            accumulate=reduce if self.spec.sync == "boundary" else None,
        )
        if self.checksum.rounding.announced and dist.get_rank() == 0:
            print(f"distaccum: {self.checksum.rounding.describe()}", flush=True)

    def local_gradients(self) -> list[nn.Parameter]:
        """``accum.exact``: the parameters whose ``.grad`` holds this rank's local, unsharded gradient after a
        backward without sync (the unsharded parameters; collective), in ``named_parameters`` order."""
        assert self.module is not None
        return unsharded_parameters(self.module)

    def gradient_shards(self) -> list[torch.Tensor]:
        """``accum.exact``: each parameter's local shard of its (sharded) gradient, made zero where there is none,
        in ``named_parameters`` order: where the int64 reduce-scatter writes."""
        assert self.module is not None
        shards = []
        for _, param in self.module.named_parameters():
            sharded = cast(DTensor, param)
            if param.grad is None:
                local = torch.zeros_like(sharded.to_local())
                param.grad = DTensor.from_local(
                    local,
                    sharded.device_mesh,
                    sharded.placements,
                    shape=sharded.shape,
                    stride=sharded.stride(),
                )
            shards.append(cast(DTensor, param.grad).to_local())
        return shards

    def _fsdp(self) -> FSDPModule:
        assert isinstance(self.module, FSDPModule)
        return self.module

    def layout(self) -> list[list[int]] | None:
        """HSDP: the mesh's ranks, one row per replica (each row is a shard group); None when flat."""
        assert self.mesh is not None, "wrap() first"
        return self.mesh.mesh.reshape(self.spec.replicas, -1).tolist() if self.spec.replicas > 1 else None

    @contextlib.contextmanager
    def sync(self, enabled: bool) -> Iterator[None]:
        # The loop's windows always hold exactly K micro-batches: k is this one's place in its window.
        k = self._micro % self.spec.split.accum_steps
        self._micro += 1
        if self.checksum is not None:
            self.checksum.micro = k
        # The setters recurse into every unit; the collectives run in the post-backward hooks.
        if self.spec.sync == "replica_boundary":
            # Reduce-scatter inside the replica on every micro-batch, all-reduce across replicas only
            # on the window's last (the loop enables sync exactly there).
            self._fsdp().set_requires_gradient_sync(True)
            self._fsdp().set_requires_all_reduce(enabled)
        else:
            self._fsdp().set_requires_gradient_sync(enabled)
        if self.spec.engine.fsdp_unsharded_window:
            # Reshard only after the window's last backward (the boundary); every_micro reduces on
            # every micro-batch but can still keep the parameters gathered in between.
            self._fsdp().set_reshard_after_backward(k == self.spec.split.accum_steps - 1)
        yield

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        # The tap counts the parameter all-gathers the forward issues (and nothing else there).
        with self.precision.autocast(self.device), tap_parameter_gathers(self.ledger):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        # Reduce-scatters run inside backward (post-backward hooks, waited for by the root's final
        # callback), so the tap sees exactly the gradient collectives of this micro-batch.
        with tap_gradient_reductions(
            self.ledger,
            gathers=True,  # + re-gathers for the backward
            replicate_group=self._replicate_group,
        ):
            loss.backward()

    def step(self, max_norm: float | None, grad_scale: float) -> StepResult:
        assert self.module is not None
        # Sharded DTensor gradients: per-shard norms and one all-reduce for the total (not a gradient
        # reduction, and outside the tap); the multiply acts on the local shards. The norm decides the skip.
        named = list(self.module.named_parameters())
        sums = None
        if self.checksum is not None:  # the reduced side, before the multiply (a SUM: divisor 1)
            sums = self.checksum.take(
                [cast(DTensor, p.grad).to_local() if p.grad is not None else None for _, p in named]
            )
        result = step_plain(self.optimizer, named, max_norm, grad_scale, None, norms=self._norms)
        return dataclasses.replace(result, grad_sums=sums)

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        assert self.module is not None
        # fully_shard swaps parameters in place: names and order are the plain model's.
        for name, param in self.module.named_parameters():
            if isinstance(param, DTensor):
                yield name, param.full_tensor().detach()  # an all-gather: every rank iterates
            else:
                yield name, param.detach()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        assert self.module is not None
        # Gathered shard by shard onto rank 0's CPU (the other ranks get an empty dict).
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return cast(dict[str, torch.Tensor], dict(get_model_state_dict(self.module, options=options)))

    def unwrapped(self) -> nn.Module:
        assert self.module is not None
        return self.module

    def save_state(self, directory: Path) -> dict[str, Any]:
        assert self.module is not None
        # each rank writes its own shards: no gather
        dcp_save(self.spec.state_dir(directory), self.module, self.optimizer, self.spec.group)
        return {}

    def load_state(self, directory: Path, extra: dict[str, Any]) -> None:
        assert self.module is not None
        # reshards onto this world size
        dcp_load(self.spec.state_dir(directory), self.module, self.optimizer, self.spec.group)

    def teardown(self) -> None:
        # Drop the sharded module and optimizer before the barrier and destroy_process_group; the
        # CLI worker then leaves with os._exit (see cli.worker).
        self.module = None
        self.mesh = None
        self.optimizer = None  # type: ignore[assignment]
