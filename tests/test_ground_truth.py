"""Ground truth: SGD steps through each engine equal minus the plain autograd gradient.

Nothing here compares a run with another run of the same loop. The expected result is computed in
this file from the seed weights alone: one forward/backward of ``sum(loss over the window) /
items`` on the plain model; with SGD (lr 1, no momentum, no weight decay, no clipping, constant
schedule, no warmup) a step must leave exactly ``weights - grad``.

- unit tier: each engine trains one step through the public :class:`distaccum.Trainer` on a
  one-rank gloo group in this process, 8 micro-batches of 4, on a full window (32 of 32 samples)
  and a partial one (20 of 32), in fp64: parameters to 1e-12, the recorded loss and grad_norm to
  1e-12 relative. DeepSpeed refuses fp64 (its ZeRO optimizers keep fp32 master weights), so its
  ZeRO 0-3 are held to the same ground truth in fp32, to fp32 rounding.
- unit tier, the optimizer acting: every engine (DDP, FSDP2, ZeRO 0-3, Accelerate) x optimizer (SGD;
  SGD with momentum and weight decay; AdamW with weight decay) x precision (fp64 where the engine takes
  it, fp32, bf16 autocast) trains 3 steps (two full windows, then a partial one) from known weights; the
  weights must be what the plain PyTorch optimizer makes of plain autograd gradients of each whole
  window (:data:`OPT_TOLERANCE`), and every step's loss and gradient norm the plain ones.
- dist tier: ``distaccum train`` on 2 ranks (micro-batch 4 x 4 steps), two SGD steps — a full
  window, then a partial one (20 of 32) — in fp64; what one rank cannot show (a world size applied
  twice, a reduction averaged instead of summed) shows here.

The fault switches prove the check can fail: a gradient off by one part in a million, or a partial
window divided by the nominal batch, is far outside the bound.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.data import Dataset, default_collate

from conftest import ENGINES, EXTENSIONS, fresh_accelerate_state, train
from distaccum import losses
from distaccum.cli.compose import compose_config
from distaccum.datasets import CorpusSequences, SyntheticRegression, pad_collate
from distaccum.models import MLP, TinyGPT
from distaccum.preflight import instantiate_components
from distaccum.testing import injected
from distaccum.testing.faults import GradScale, NominalPartialCount
from distaccum.trainer import Trainer

pytestmark = pytest.mark.filterwarnings("ignore:`torch.distributed.*is deprecated:FutureWarning")

SGD = {
    "name": "sgd",
    "lr": 1.0,
    "momentum": 0.0,
    "weight_decay": 0.0,
    "schedule": "constant",
    "warmup_steps": 0,
    "clip_norm": None,
}
MICRO, K = 4, 8  # unit tier: global batch 32 on one rank
WINDOWS = {"full": 32, "partial": 20}  # samples in the dataset = in the first (only) window
FP64_ATOL = 1e-12
FP32_RTOL = 1e-5
"""DeepSpeed in fp32: max |param - expected| relative to the largest update element (measured 8e-7 at worst)."""


@dataclass(frozen=True)
class Model:
    """A model factory with the dataset, loss and collate it trains on."""

    make: Callable[[], nn.Module]
    dataset: Callable[[int], Dataset]
    loss: losses.LossFn
    collate: Callable[[list[Any]], Any] | None = None


MODELS = {
    "mlp": Model(lambda: MLP(32, 16, 2, 8), lambda n: SyntheticRegression(n), losses.mse),
    # Variable-length sequences: micro-batches hold different numbers of loss items.
    "tiny_gpt": Model(
        lambda: TinyGPT(width=32, depth=2, heads=4),
        lambda n: CorpusSequences(n, seq_max=24),
        losses.token_cross_entropy,
        pad_collate,
    ),
}


@pytest.fixture(autouse=True)
def environ_restored() -> Any:
    """Accelerate on CPU writes RANK, WORLD_SIZE, MASTER_PORT... into os.environ (and resizes torch's
    thread pool unless OMP_NUM_THREADS is set): keep them from leaking into later tests."""
    saved = dict(os.environ)
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    yield
    os.environ.clear()
    os.environ.update(saved)


def cast(batch: Any, dtype: torch.dtype) -> Any:
    """Floating tensors of a (nested) batch in ``dtype``; integer tensors as they are."""
    if isinstance(batch, torch.Tensor):
        return batch.to(dtype) if batch.is_floating_point() else batch
    if isinstance(batch, dict):
        return {k: cast(v, dtype) for k, v in batch.items()}
    return type(batch)(cast(v, dtype) for v in batch)


@dataclass
class Plain:
    """The ground truth of one step: loss, gradient norm, and the weights before and after ``w - grad``."""

    loss: float
    grad_norm: float
    before: dict[str, torch.Tensor]
    after: dict[str, torch.Tensor]

    def error(self, params: dict[str, torch.Tensor]) -> float:
        """Largest |candidate - expected| over every element of every parameter."""
        assert params.keys() == self.after.keys()
        return max(float((params[k].double() - self.after[k].double()).abs().max()) for k in params)

    def largest_update(self) -> float:
        return max(float((self.after[k] - self.before[k]).abs().max()) for k in self.after)


def plain_step(
    make: Callable[[], nn.Module],
    samples: list[Any],
    collate: Callable[[list[Any]], Any],
    loss: losses.LossFn,
    weights: dict[str, torch.Tensor],
    dtype: torch.dtype,
) -> Plain:
    """One forward/backward of the whole window on the plain model, and ``w - grad``; nothing else."""
    net = make().to(dtype)
    net.load_state_dict(weights)
    loss_sum, items = loss(net, cast(collate(samples), dtype))
    (loss_sum / items).backward()
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in net.parameters()]))
    after = {name: (p - p.grad).detach() for name, p in net.named_parameters()}
    return Plain(float(loss_sum.detach()) / float(items), float(norm), dict(weights), after)


def seed_weights(make: Callable[[], nn.Module], path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Fresh weights (a seed unrelated to the run's) in a safetensors file the run starts from."""
    torch.manual_seed(7)
    state = {k: v.to(dtype).contiguous() for k, v in make().state_dict().items()}
    save_file(state, str(path))
    return state


# --- unit tier: every engine, one rank, in this process ----------------------------------------------


def engine_precision(engine: str) -> str:
    return "fp32" if ENGINES[engine]["name"] == "deepspeed" else "fp64"


def one_step(
    tmp_path: Path,
    model: Model,
    engine: str,
    samples: int,
    seed_file: Path,
    precision: str,
    *faults: Any,
    split: tuple[int, int] = (MICRO, K),
    **options: Any,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """One optimizer step through ``engine`` (with ``faults`` injected, ``options`` added to its config section) at
    ``split`` (micro-batch, K): the step's record and the parameters after it."""
    fresh_accelerate_state()
    cfg = {
        "precision": precision,
        "run_dir": str(tmp_path / "run"),
        "engine": {**ENGINES[engine], "extensions_dir": str(EXTENSIONS), **options},
        "accum": {"micro_batch": split[0], "steps": split[1]},
        "optim": SGD,
        "data": {"shuffle": False},
        "trainer": {
            "nproc": 1,
            "max_steps": 1,
            "check_every": 0,
            "save_final": False,
            "device": "cpu",
            "init_from": str(seed_file),
        },
        "log": {"console": "quiet"},
    }
    trainer = Trainer(
        cfg, model=model.make, dataset=model.dataset(samples), loss=model.loss, collate=model.collate
    )
    with injected(*faults):
        (record,) = trainer.train_steps()
    params = {name: t.detach().to("cpu", copy=True) for name, t in trainer.state.engine.full_parameters()}
    trainer.finish()  # releases the engine; the group stays (the Trainer did not create it)
    return record, params


def unit_case(tmp_path: Path, model_name: str, window: str, dtype: torch.dtype) -> tuple[Model, int, Plain]:
    model, samples = MODELS[model_name], WINDOWS[window]
    seed = seed_weights(model.make, tmp_path / "seed.safetensors", dtype)
    data = model.dataset(samples)
    plain = plain_step(
        model.make,
        [data[i] for i in range(samples)],
        model.collate or default_collate,
        model.loss,
        seed,
        dtype,
    )
    return model, samples, plain


@pytest.mark.unit
@pytest.mark.parametrize("window", list(WINDOWS))
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("engine", list(ENGINES))
def test_one_sgd_step_is_minus_the_plain_gradient(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    cpu_group: None,
    engine: str,
    model_name: str,
    window: str,
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")  # DeepSpeed asserts that a launcher set it
    precision = engine_precision(engine)
    dtype = torch.float64 if precision == "fp64" else torch.float32
    model, samples, plain = unit_case(tmp_path, model_name, window, dtype)
    record, params = one_step(tmp_path, model, engine, samples, tmp_path / "seed.safetensors", precision)

    assert record["partial_window"] == (window == "partial") and record["samples"] == samples
    error, update = plain.error(params), plain.largest_update()
    print(
        f"ground truth {engine} {model_name} {window} {precision}: max|param - (seed - grad)| {error:.2e} "
        f"(largest update {update:.2e}); loss rel {abs(record['loss'] / plain.loss - 1):.1e}, "
        f"grad_norm rel {abs(record['grad_norm'] / plain.grad_norm - 1):.1e}"
    )
    if precision == "fp64":
        assert error <= FP64_ATOL, (engine, error)
        assert record["loss"] == pytest.approx(plain.loss, rel=1e-12, abs=0)
        assert record["grad_norm"] == pytest.approx(plain.grad_norm, rel=1e-12, abs=0)
    else:
        assert error <= FP32_RTOL * update, (engine, error, update)
        assert record["loss"] == pytest.approx(plain.loss, rel=1e-6, abs=0)
        assert record["grad_norm"] == pytest.approx(plain.grad_norm, rel=1e-5, abs=0)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("window", "fault"), [("full", lambda: GradScale(1.0 + 1e-6)), ("partial", NominalPartialCount)]
)
def test_the_ground_truth_sees_split_independent_faults(
    tmp_path: Path, cpu_group: None, window: str, fault: Any
) -> None:
    """The check can fail: a gradient off by one part in a million, or a partial window normalized by
    the nominal batch, breaks the 1e-12 bound (by at least 100x)."""
    model, samples, plain = unit_case(tmp_path, "mlp", window, torch.float64)
    record, params = one_step(tmp_path, model, "ddp", samples, tmp_path / "seed.safetensors", "fp64", fault())
    assert plain.error(params) > 100 * FP64_ATOL, plain.error(params)
    assert record["grad_norm"] != pytest.approx(plain.grad_norm, rel=1e-9, abs=0)


@pytest.mark.unit
@pytest.mark.parametrize("engine", ["ddp", "accelerate"])
def test_a_window_of_one_micro_batch_is_the_plain_gradient_and_its_faults_show(
    tmp_path: Path, cpu_group: None, engine: str
) -> None:
    """K = 1, a window of one micro-batch through the same normalization as any other (the reduced sum times
    1/(c N) in the step): one SGD step is minus the plain gradient to fp64 rounding, and a gradient off by one part
    in a million (the fault wraps the normalization the step applies) breaks the bound."""
    model, samples, plain = unit_case(tmp_path, "tiny_gpt", "full", torch.float64)
    seed = tmp_path / "seed.safetensors"
    record, params = one_step(tmp_path, model, engine, samples, seed, "fp64", split=(samples, 1))
    assert plain.error(params) <= FP64_ATOL, plain.error(params)
    assert record["grad_norm"] == pytest.approx(plain.grad_norm, rel=1e-12, abs=0)
    record, params = one_step(
        tmp_path / "faulty", model, engine, samples, seed, "fp64", GradScale(1.0 + 1e-6), split=(samples, 1)
    )
    assert plain.error(params) > 100 * FP64_ATOL, plain.error(params)
    assert record["grad_norm"] != pytest.approx(plain.grad_norm, rel=1e-9, abs=0)


# --- unit tier: the optimizer acting, every engine x optimizer x precision ---------------------------

OPTIMIZERS: dict[str, dict[str, Any]] = {
    "sgd": {"name": "sgd", "lr": 0.5, "momentum": 0.0, "weight_decay": 0.0},
    "sgd_momentum_wd": {"name": "sgd", "lr": 0.5, "momentum": 0.9, "weight_decay": 0.01},
    "adamw": {"name": "adamw", "lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.1},
}
"""Learning rates large enough that three updates stand well above bf16's rounding of the weights."""
OPT_STEPS, OPT_SAMPLES = 3, 80  # windows of 32: two full ones, then the partial rest of 16
PRECISIONS = ("fp64", "fp32", "bf16")
OPT_TOLERANCE = {"fp64": 1e-12, "fp32": 1e-5, "bf16": 1e-2, "bf16-deepspeed": 1e-1}
"""Bound on ||(w - w0) - (w_plain - w0)|| / ||w_plain - w0||, over every parameter, after the 3 steps.
fp64: rounding only (measured <= 4e-16). fp32: the accumulation order of 8 micro-batches against one
whole-window pass, carried through the optimizer (measured <= 1.8e-7). bf16 (autocast over fp32 weights
and gradients: DDP, FSDP2, Accelerate): every micro-batch's weight gradient is rounded to bf16's 8-bit
mantissa (2^-8 = 3.9e-3 relative) where the plain pass rounds the window's once (measured <= 3.4e-3).
DeepSpeed bf16 holds the weights and their ``.grad`` in bf16, so autograd also adds the 8 micro-batch
gradients up in bf16 (DeepSpeed itself warns that bf16 accumulation is not safe numerically); its fp32
master weights are compared, measured <= 6e-2 for SGD, 2.4e-2 with momentum, 1.3e-2 for AdamW. ZeRO-0
with bf16, which this test found off by 20-29 % (an unnormalized step, and weights moved by a step on
zero gradients at creation), is refused up front. A lost micro-batch or a gradient 1.5x too large is far
outside every bound."""


def opt_cells() -> list[tuple[str, str, str]]:
    """Every (engine, optimizer, precision) an engine accepts: DeepSpeed refuses fp64 (fp32 master weights),
    and ZeRO-0 refuses bf16 (this test found DeepSpeed's FP16_UnfusedOptimizer stepping once on zero
    gradients at creation: weight decay and AdamW's step count moved before training)."""

    def refused(engine: str, precision: str) -> bool:
        deepspeed = ENGINES[engine]["name"] == "deepspeed"
        return deepspeed and (
            precision == "fp64" or (precision == "bf16" and ENGINES[engine]["zero_stage"] == 0)
        )

    return [(e, o, p) for e in ENGINES for o in OPTIMIZERS for p in PRECISIONS if not refused(e, p)]


def plain_optimizer(name: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The plain PyTorch optimizer with the cell's settings (built here, not by distaccum)."""
    o = OPTIMIZERS[name]
    if o["name"] == "sgd":
        return torch.optim.SGD(params, lr=o["lr"], momentum=o["momentum"], weight_decay=o["weight_decay"])
    return torch.optim.AdamW(params, lr=o["lr"], betas=tuple(o["betas"]), weight_decay=o["weight_decay"])


def plain_training(
    weights: dict[str, torch.Tensor], optimizer: str, precision: str
) -> tuple[list[tuple[float, float]], dict[str, torch.Tensor]]:
    """OPT_STEPS plain steps: the whole window in one autograd pass (bf16: under autocast), the plain
    optimizer; (loss, grad_norm) per step and the final weights."""
    model = MODELS["mlp"]
    dtype = torch.float64 if precision == "fp64" else torch.float32
    net = model.make().to(dtype)
    net.load_state_dict({k: v.to(dtype) for k, v in weights.items()})
    opt = plain_optimizer(optimizer, list(net.parameters()))
    data = model.dataset(OPT_SAMPLES)
    records = []
    for step in range(OPT_STEPS):
        batch = cast(
            default_collate([data[i] for i in range(32 * step, min(32 * (step + 1), OPT_SAMPLES))]), dtype
        )
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss_sum, items = model.loss(net, batch)
        (loss_sum / items).backward()
        norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(p.grad) for p in net.parameters()])
        )
        records.append((float(loss_sum.detach()) / float(items), float(norm)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return records, {k: v.detach().clone() for k, v in net.named_parameters()}


def engine_training(
    tmp_path: Path, engine: str, optimizer: str, precision: str, seed_file: Path, **engine_options: Any
) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
    """The same OPT_STEPS through ``engine`` (micro-batch 4 x 8 on one rank): the records and final weights."""
    fresh_accelerate_state()
    model = MODELS["mlp"]
    cfg = {
        "precision": precision,
        "run_dir": str(tmp_path / "run"),
        "engine": {**ENGINES[engine], "extensions_dir": str(EXTENSIONS), **engine_options},
        "accum": {"micro_batch": MICRO, "steps": K},
        "optim": {**OPTIMIZERS[optimizer], "schedule": "constant", "warmup_steps": 0, "clip_norm": None},
        "data": {"shuffle": False},
        "trainer": {
            "nproc": 1,
            "max_steps": OPT_STEPS,
            "check_every": 0,
            "save_final": False,
            "device": "cpu",
            "init_from": str(seed_file),
            "resume": False,
        },
        "log": {"console": "quiet"},
    }
    trainer = Trainer(cfg, model=model.make, dataset=model.dataset(OPT_SAMPLES), loss=model.loss)
    records = trainer.train_steps()
    params = {name: t.detach().to("cpu", copy=True) for name, t in trainer.state.engine.full_parameters()}
    if precision == "bf16" and ENGINES[engine]["name"] == "deepspeed":
        # DeepSpeed holds bf16 weights and steps fp32 master copies: the optimizer's result is the master.
        from deepspeed.utils import safe_get_full_fp32_param

        params = {
            name: safe_get_full_fp32_param(p).detach().to("cpu", copy=True)
            for name, p in trainer.state.engine.unwrapped().named_parameters()
        }
    trainer.finish()
    return records, params


def update_error(
    seed: dict[str, torch.Tensor], cand: dict[str, torch.Tensor], plain: dict[str, torch.Tensor]
) -> float:
    """||(cand - seed) - (plain - seed)|| / ||plain - seed|| over every parameter."""
    assert cand.keys() == plain.keys()
    diff = torch.cat([(cand[k].double() - plain[k].double()).flatten() for k in plain])
    update = torch.cat([(plain[k].double() - seed[k].double()).flatten() for k in plain])
    return float(diff.norm() / update.norm())


@pytest.mark.unit
@pytest.mark.parametrize(("engine", "optimizer", "precision"), opt_cells())
def test_three_optimizer_steps_equal_a_plain_optimizer_on_plain_gradients(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    cpu_group: None,
    engine: str,
    optimizer: str,
    precision: str,
) -> None:
    """After 3 steps (the last a partial window) through the engine, the weights are what the plain PyTorch
    optimizer makes of plain autograd gradients of each whole window; the recorded losses and gradient
    norms are the plain ones at every step."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    seed = seed_weights(
        MODELS["mlp"].make,
        tmp_path / "seed.safetensors",
        torch.float64 if precision == "fp64" else torch.float32,
    )
    plain_records, plain = plain_training(seed, optimizer, precision)
    records, params = engine_training(tmp_path, engine, optimizer, precision, tmp_path / "seed.safetensors")
    error = update_error(seed, params, plain)
    print(f"optimizer ground truth {engine} {optimizer} {precision}: update error {error:.2e}")
    assert [r["samples"] for r in records] == [32, 32, 16] and not any(r["skipped"] for r in records)
    bound = OPT_TOLERANCE[
        "bf16-deepspeed" if precision == "bf16" and ENGINES[engine]["name"] == "deepspeed" else precision
    ]
    assert error <= bound, (engine, optimizer, precision, error)
    rel = {"fp64": 1e-12, "fp32": 1e-5, "bf16": 2e-2}[precision]
    for record, (loss, norm) in zip(records, plain_records, strict=True):
        assert record["loss"] == pytest.approx(loss, rel=rel, abs=0), record["step"]
        assert record["grad_norm"] == pytest.approx(norm, rel=rel, abs=0), record["step"]


@pytest.mark.unit
def test_zero1_bf16_with_fp32_gradient_accumulation_is_normalized_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpu_group: None
) -> None:
    """A user JSON asking DeepSpeed for fp32 gradient accumulation makes ZeRO-1 bf16 run its BF16_Optimizer,
    which has no loss scale: distaccum scales its fp32 gradients itself (the partial step 3 shows it)."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    user = tmp_path / "ds.json"
    user.write_text('{"data_types": {"grad_accum_dtype": "fp32"}}')
    seed = seed_weights(MODELS["mlp"].make, tmp_path / "seed.safetensors", torch.float32)
    plain_records, plain = plain_training(seed, "sgd", "bf16")
    records, params = engine_training(
        tmp_path, "zero1", "sgd", "bf16", tmp_path / "seed.safetensors", deepspeed_config=str(user)
    )
    assert update_error(seed, params, plain) <= OPT_TOLERANCE["bf16-deepspeed"]
    for record, (_, norm) in zip(records, plain_records, strict=True):
        assert record["grad_norm"] == pytest.approx(norm, rel=2e-2, abs=0), record["step"]


@pytest.mark.unit
def test_the_optimizer_ground_truth_sees_a_lost_micro_batch_and_a_scaled_gradient(
    tmp_path: Path, cpu_group: None
) -> None:
    """The update bound can fail: on DDP, AdamW with the accumulated gradient wiped before the last
    micro-batch of every window, or SGD with momentum on a gradient 1.5x too large, lands far outside even
    DeepSpeed bf16's bound."""
    from distaccum.testing.zoo import GradientsWipedMidWindow

    seed = seed_weights(MODELS["mlp"].make, tmp_path / "seed.safetensors", torch.float64)
    for optimizer, fault in (
        ("adamw", GradientsWipedMidWindow(before=K)),
        ("sgd_momentum_wd", GradScale(1.5)),
    ):
        _, plain = plain_training(seed, optimizer, "fp64")
        with injected(fault):
            _, params = engine_training(tmp_path, "ddp", optimizer, "fp64", tmp_path / "seed.safetensors")
        assert update_error(seed, params, plain) > 2 * OPT_TOLERANCE["bf16-deepspeed"], optimizer


# --- dist tier: the real CLI on two ranks ---------------------------------------------------------

CLI_MODELS = {
    "mlp": ["model=mlp"],
    "tiny_gpt": ["model=tiny_gpt", "model.width=32", "data.dataset.seq_max=24"],
}
CLI_CASES = [("ddp", "mlp"), ("ddp", "tiny_gpt"), ("fsdp", "tiny_gpt"), ("accelerate", "mlp")]


@pytest.mark.dist
@pytest.mark.parametrize(("engine", "model_name"), CLI_CASES)
def test_two_ranks_two_sgd_steps_follow_the_plain_gradient(
    tmp_path: Path, engine: str, model_name: str
) -> None:
    """World 2, micro-batch 4 x 4 steps: step 1 a full window (32 samples), step 2 the partial rest
    (20), each equal to a plain step from the plain weights before it."""
    overrides = [
        *CLI_MODELS[model_name],
        "data.dataset.num_samples=52",
        "data.shuffle=false",
        "precision=fp64",
        *(f"optim.{k}={'null' if v is None else v}" for k, v in SGD.items()),
        "accum.micro_batch=4",
        "accum.steps=4",
        "trainer.nproc=2",
        "trainer.max_steps=2",
        f"engine={engine}",
    ]
    parts = instantiate_components(compose_config(overrides))
    seed = seed_weights(parts.model, tmp_path / "seed.safetensors", torch.float64)
    run = train(tmp_path / "run", *overrides, f"trainer.init_from={tmp_path / 'seed.safetensors'}")

    collate = parts.collate or default_collate
    weights, plains = seed, []
    for window in (range(0, 32), range(32, 52)):
        plains.append(
            plain_step(
                parts.model, [parts.dataset[i] for i in window], collate, parts.loss, weights, torch.float64
            )
        )
        weights = plains[-1].after
    assert [(r["samples"], r["partial_window"]) for r in run.records] == [(32, False), (20, True)]
    for record, plain in zip(run.records, plains, strict=True):
        assert record["loss"] == pytest.approx(plain.loss, rel=1e-12, abs=0)
        assert record["grad_norm"] == pytest.approx(plain.grad_norm, rel=1e-12, abs=0)
    final = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
    error = plains[-1].error({k: v for k, v in final.items() if k in weights})
    print(f"ground truth {engine} {model_name} world 2: max|param - plain| after 2 steps {error:.2e}")
    assert error <= FP64_ATOL, error
