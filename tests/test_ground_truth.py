"""Ground truth: SGD steps through each engine equal minus the plain autograd gradient.

Nothing here compares a run with another run of the same loop. The expected result is computed in
this file from the seed weights alone: one forward/backward of ``sum(loss over the window) /
items`` on the plain model; with SGD (lr 1, no momentum, no weight decay, no clipping, constant
schedule, no warmup) a step must leave exactly ``weights - grad``.

- unit tier: each engine trains one step through the public :class:`distaccum.Trainer` on a
  one-rank gloo group in this process, 8 micro-batches of 4, on a full window (32 of 32 samples)
  and a partial one (20 of 32), in fp64: parameters to 1e-12, the recorded loss and grad_norm to
  1e-12 relative. DeepSpeed refuses fp64 (its ZeRO optimizers keep fp32 master weights), so its
  ZeRO 1-3 are held to the same ground truth in fp32, to fp32 rounding.
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

from conftest import fresh_accelerate_state, train
from distaccum import losses
from distaccum.cli.compose import compose_config
from distaccum.datasets import CorpusSequences, SyntheticRegression, pad_collate
from distaccum.models import MLP, TinyGPT
from distaccum.preflight import instantiate_components
from distaccum.testing import injected
from distaccum.testing.faults import GradScale, NominalPartialCount
from distaccum.trainer import Trainer

pytestmark = pytest.mark.filterwarnings("ignore:`torch.distributed.*is deprecated:FutureWarning")

REPO = Path(__file__).resolve().parents[1]
EXTENSIONS = REPO / ".cache" / "torch_extensions"  # DeepSpeed's compiled op (gitignored, built once)
SGD = {"name": "sgd", "lr": 1.0, "momentum": 0.0, "weight_decay": 0.0, "schedule": "constant", "warmup_steps": 0,
       "clip_norm": None}
MICRO, K = 4, 8  # unit tier: global batch 32 on one rank
WINDOWS = {"full": 32, "partial": 20}  # samples in the dataset = in the first (only) window
ENGINES: dict[str, dict[str, Any]] = {
    "ddp": {"name": "ddp"},
    "fsdp": {"name": "fsdp"},
    "zero1": {"name": "deepspeed", "zero_stage": 1},
    "zero2": {"name": "deepspeed", "zero_stage": 2},
    "zero3": {"name": "deepspeed", "zero_stage": 3},
    "accelerate": {"name": "accelerate"},
}
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
    "tiny_gpt": Model(lambda: TinyGPT(width=32, depth=2, heads=4), lambda n: CorpusSequences(n, seq_max=24),
                      losses.token_cross_entropy, pad_collate),
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


def plain_step(make: Callable[[], nn.Module], samples: list[Any], collate: Callable[[list[Any]], Any],
               loss: losses.LossFn, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> Plain:
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


def one_step(tmp_path: Path, model: Model, engine: str, samples: int, seed_file: Path, precision: str,
             *faults: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """One optimizer step through ``engine`` (with ``faults`` injected): the step's record and the parameters
    after it."""
    fresh_accelerate_state()
    cfg = {"precision": precision, "run_dir": str(tmp_path / "run"),
           "engine": {**ENGINES[engine], "extensions_dir": str(EXTENSIONS)},
           "accum": {"micro_batch": MICRO, "steps": K}, "optim": SGD, "data": {"shuffle": False},
           "trainer": {"nproc": 1, "max_steps": 1, "check_every": 0, "save_final": False, "device": "cpu",
                       "init_from": str(seed_file)},
           "log": {"console": "quiet"}}
    trainer = Trainer(cfg, model=model.make, dataset=model.dataset(samples), loss=model.loss,
                      collate=model.collate)
    with injected(*faults):
        (record,) = trainer.train_steps()
    params = {name: t.detach().to("cpu", copy=True) for name, t in trainer.state.engine.full_parameters()}
    trainer.finish()  # releases the engine; the group stays (the Trainer did not create it)
    return record, params


def unit_case(tmp_path: Path, model_name: str, window: str, dtype: torch.dtype) -> tuple[Model, int, Plain]:
    model, samples = MODELS[model_name], WINDOWS[window]
    seed = seed_weights(model.make, tmp_path / "seed.safetensors", dtype)
    data = model.dataset(samples)
    plain = plain_step(model.make, [data[i] for i in range(samples)], model.collate or default_collate, model.loss,
                       seed, dtype)
    return model, samples, plain


@pytest.mark.unit
@pytest.mark.parametrize("window", list(WINDOWS))
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("engine", list(ENGINES))
def test_one_sgd_step_is_minus_the_plain_gradient(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  cpu_group: None, engine: str, model_name: str,
                                                  window: str) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")  # DeepSpeed asserts that a launcher set it
    precision = engine_precision(engine)
    dtype = torch.float64 if precision == "fp64" else torch.float32
    model, samples, plain = unit_case(tmp_path, model_name, window, dtype)
    record, params = one_step(tmp_path, model, engine, samples, tmp_path / "seed.safetensors", precision)

    assert record["partial_window"] == (window == "partial") and record["samples"] == samples
    error, update = plain.error(params), plain.largest_update()
    print(f"ground truth {engine} {model_name} {window} {precision}: max|param - (seed - grad)| {error:.2e} "
          f"(largest update {update:.2e}); loss rel {abs(record['loss'] / plain.loss - 1):.1e}, "
          f"grad_norm rel {abs(record['grad_norm'] / plain.grad_norm - 1):.1e}")
    if precision == "fp64":
        assert error <= FP64_ATOL, (engine, error)
        assert record["loss"] == pytest.approx(plain.loss, rel=1e-12, abs=0)
        assert record["grad_norm"] == pytest.approx(plain.grad_norm, rel=1e-12, abs=0)
    else:
        assert error <= FP32_RTOL * update, (engine, error, update)
        assert record["loss"] == pytest.approx(plain.loss, rel=1e-6, abs=0)
        assert record["grad_norm"] == pytest.approx(plain.grad_norm, rel=1e-5, abs=0)


@pytest.mark.unit
@pytest.mark.parametrize(("window", "fault"), [("full", lambda: GradScale(1.0 + 1e-6)),
                                               ("partial", NominalPartialCount)])
def test_the_ground_truth_sees_split_independent_faults(tmp_path: Path, cpu_group: None, window: str,
                                                        fault: Any) -> None:
    """The check can fail: a gradient off by one part in a million, or a partial window normalized by
    the nominal batch, breaks the 1e-12 bound (by at least 100x)."""
    model, samples, plain = unit_case(tmp_path, "mlp", window, torch.float64)
    record, params = one_step(tmp_path, model, "ddp", samples, tmp_path / "seed.safetensors", "fp64", fault())
    assert plain.error(params) > 100 * FP64_ATOL, plain.error(params)
    assert record["grad_norm"] != pytest.approx(plain.grad_norm, rel=1e-9, abs=0)


# --- dist tier: the real CLI on two ranks ---------------------------------------------------------

CLI_MODELS = {"mlp": ["model=mlp"], "tiny_gpt": ["model=tiny_gpt", "model.width=32", "data.dataset.seq_max=24"]}
CLI_CASES = [("ddp", "mlp"), ("ddp", "tiny_gpt"), ("fsdp", "tiny_gpt"), ("accelerate", "mlp")]


@pytest.mark.dist
@pytest.mark.parametrize(("engine", "model_name"), CLI_CASES)
def test_two_ranks_two_sgd_steps_follow_the_plain_gradient(tmp_path: Path, engine: str, model_name: str) -> None:
    """World 2, micro-batch 4 x 4 steps: step 1 a full window (32 samples), step 2 the partial rest
    (20), each equal to a plain step from the plain weights before it."""
    overrides = [*CLI_MODELS[model_name], "data.dataset.num_samples=52", "data.shuffle=false", "precision=fp64",
                 *(f"optim.{k}={'null' if v is None else v}" for k, v in SGD.items()), "accum.micro_batch=4",
                 "accum.steps=4", "trainer.nproc=2", "trainer.max_steps=2", f"engine={engine}"]
    parts = instantiate_components(compose_config(overrides))
    seed = seed_weights(parts.model, tmp_path / "seed.safetensors", torch.float64)
    run = train(tmp_path / "run", *overrides, f"trainer.init_from={tmp_path / 'seed.safetensors'}")

    collate = parts.collate or default_collate
    weights, plains = seed, []
    for window in (range(0, 32), range(32, 52)):
        plains.append(plain_step(parts.model, [parts.dataset[i] for i in window], collate, parts.loss, weights,
                                 torch.float64))
        weights = plains[-1].after
    assert [(r["samples"], r["partial_window"]) for r in run.records] == [(32, False), (20, True)]
    for record, plain in zip(run.records, plains, strict=True):
        assert record["loss"] == pytest.approx(plain.loss, rel=1e-12, abs=0)
        assert record["grad_norm"] == pytest.approx(plain.grad_norm, rel=1e-12, abs=0)
    final = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
    error = plains[-1].error({k: v for k, v in final.items() if k in weights})
    print(f"ground truth {engine} {model_name} world 2: max|param - plain| after 2 steps {error:.2e}")
    assert error <= FP64_ATOL, error
