"""FSDP2, DeepSpeed (ZeRO 0-3) and Accelerate against DDP and the single-process reference, on gloo.

Three models: ``mlp``, ``tiny_gpt`` (variable-length sequences) and a Hugging Face causal LM (a random-init
Llama from transformers, offline), so every engine also trains, verifies and reloads an HF model: its
``final/`` must load with ``from_pretrained`` with no missing or unexpected keys, and every engine's
final weights must hold exactly the plain model's ``state_dict`` keys. Every engine trains the same split (world 2, micro-batch 2 x 4 accumulation steps, 36 samples so
step 3 is a partial window with empty micro-batches) from the same seed checkpoint. Each must give
DDP's per-step loss and grad norm and final parameter checksums within fp32 rounding, pass the
comparison ``distaccum verify`` makes against one process on the whole batch (``verify.compare``,
same tolerance), and reduce gradients as often as its design says.

Launch cost dominates on 2 cores (DeepSpeed alone imports for ~6 s), so the runs share one
launch: this file doubles as a worker script that runs a list of configs one after the other
through the public ``Trainer`` (what the CLI's workers run) in one process group. The reference is
the plain single-process one ``distaccum verify`` uses, run in the test process. The CLI itself is
exercised by the config-conflict test and by real ``distaccum verify`` runs.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils.data import default_collate

from conftest import EXTENSIONS, distaccum_cli, forked_torchrun, plan_worker, run_cli
from distaccum.cli.compose import compose_config
from distaccum.config import from_mapping, to_mapping, with_overrides
from distaccum.preflight import instantiate_components
from distaccum.resolve import resolve
from distaccum.rundir import read_config
from distaccum.rundir.weights import load_weights
from distaccum.verify.candidates import reference_config, write_seed_checkpoint
from distaccum.verify.compare import RunData, compare, tolerance_for
from distaccum.verify.reference import run_reference
from hf_corpus import OFFLINE

pytestmark = pytest.mark.dist


REPO = Path(__file__).resolve().parents[1]
MODELS: dict[str, list[str]] = {
    "mlp": ["model=mlp"],
    "tiny_gpt": ["model=tiny_gpt", "model.width=32", "data.dataset.seq_max=24"],
    # A Hugging Face causal LM (transformers' random-init Llama, built offline) on the same token data.
    "llama": [
        "model=hf_causal_lm",
        "data=corpus",
        "loss=token_ce",
        "model.width=32",
        "model.layers=1",
        "model.heads=2",
        "model.positions=32",
        "data.dataset.seq_max=24",
        "eval.every=0",
    ],
}
ENGINES: dict[str, dict[str, Any]] = {
    "ddp": {"name": "ddp"},
    "zero0": {"name": "deepspeed", "zero_stage": 0},
    "fsdp": {"name": "fsdp"},
    "zero1": {"name": "deepspeed", "zero_stage": 1},
    "zero2": {"name": "deepspeed", "zero_stage": 2},
    "zero3": {"name": "deepspeed", "zero_stage": 3},
    "accelerate": {"name": "accelerate"},
}
K = 4
# Same bound as the DDP split-invariance tests: fp32 rounding of reordered sums over a few AdamW steps.
RTOL = 1e-5


def mapping(model: str, engine: str, run_dir: Path, seed: Path, sync: str = "boundary") -> dict[str, Any]:
    """The config of one engine run (the test's split, seed checkpoint, recording for verify), composed
    from the packaged configs like ``distaccum train`` does."""
    cfg = compose_config(
        [
            *MODELS[model],
            "data.dataset.num_samples=36",
            "accum.micro_batch=2",
            f"accum.steps={K}",
            f"accum.sync={sync}",
            "trainer.nproc=2",
            "trainer.max_steps=4",
            "trainer.check_every=1",
            f"trainer.init_from={seed}",
            "verify.record=true",
            "log.console=quiet",
            f"engine.extensions_dir={EXTENSIONS}",
            f"run_dir={run_dir}",
        ]
    )
    return to_mapping(with_overrides(cfg, {f"engine.{k}": v for k, v in ENGINES[engine].items()}))


def launch_many(plan: list[dict[str, Any]], nproc: int, workdir: Path, timeout: float) -> str:
    """Run every config of ``plan`` in order, in one ``nproc``-rank process group (this file as worker);
    returns the workers' stdout."""
    plan_file = workdir / f"plan-{nproc}.json"
    plan_file.write_text(json.dumps(plan))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **OFFLINE)
    proc = forked_torchrun(
        str(Path(__file__)), str(plan_file), nproc=nproc, cwd=workdir, env=env, timeout=timeout
    )
    if proc.returncode:
        pytest.fail(
            f"engine runs failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc.stdout


def _worker_main(plan_file: str) -> None:
    """Worker entry (under torch.distributed.run): run each config, then leave like the CLI's workers.

    An entry with ``"_stop_after": n`` is stopped (checkpoint, ``StopRequested``) before window n + 1,
    as SIGTERM would stop it, and then run again from its checkpoint.
    """
    from distaccum.runtime.stopping import StopFlag, StopRequested
    from distaccum.trainer import Trainer

    class StopAfter(StopFlag):
        """Reads as requested from the n-th check on: the loop checks once per window, at its end."""

        def __init__(self, windows: int) -> None:
            super().__init__()
            self.left = windows - 1

        @property  # type: ignore[override]
        def requested(self) -> bool:
            self.left -= 1
            return self.left < 0

        @requested.setter
        def requested(self, value: bool) -> None:
            pass

    def trainer(cfg: Any, stop: StopFlag | None = None) -> Trainer:
        parts = instantiate_components(cfg)

        def record_outputs(state: Any, record: dict) -> None:
            # After the last step, the trained (wrapped, maybe sharded) model on a fixed batch:
            # what the saved final weights must reproduce. Collective on sharded engines.
            if record["step"] == cfg.trainer.max_steps:
                state.model.eval()
                with torch.no_grad():
                    out = outputs(state.model, example_batch(parts))
                state.model.train()
                if torch.distributed.get_rank() == 0:
                    save_file({"outputs": out.contiguous()}, str(Path(cfg.run_dir) / "outputs.safetensors"))

        return Trainer.of(cfg, parts, stop=stop, on_step=record_outputs)

    def train(values: dict[str, Any]) -> None:
        stop_after = values.pop("_stop_after", None)
        cfg = from_mapping(values)
        if stop_after is not None:
            try:
                trainer(cfg, StopAfter(stop_after)).fit()
                raise AssertionError(f"{cfg.run_dir}: the run did not stop after {stop_after} windows")
            except StopRequested:
                pass
        trainer(cfg).fit()

    plan_worker(plan_file, train)


def example_batch(parts: Any) -> Any:
    """Four samples of the run's dataset, collated as the run collates them."""
    return (parts.collate or default_collate)([parts.dataset[i] for i in range(4)])


def outputs(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The model's outputs on a batch (token models take the batch's keys, the MLP its inputs; a Hugging Face
    model's output is its logits)."""
    if isinstance(batch, dict):
        out = model(**{k: v for k, v in batch.items() if k != "labels"})
        return getattr(out, "logits", out)
    return model(batch[0])


class Runs:
    """Finished runs by (model, name), plus the world-1 references by model."""

    def __init__(self, root: Path, stdout: str) -> None:
        self.root = root
        self.stdout = stdout

    def dir(self, model: str, name: str) -> Path:
        return self.root / f"{model}-{name}"

    def records(self, model: str, name: str) -> list[dict[str, Any]]:
        lines = (self.dir(model, name) / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]

    def summary(self, model: str, name: str) -> dict[str, Any]:
        return json.loads((self.dir(model, name) / "summary.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    root = tmp_path_factory.mktemp("engines")
    plan = []
    for model in MODELS:
        seed = root / f"{model}-seed.safetensors"
        cfg = from_mapping(mapping(model, "ddp", root / "unused", seed))
        parts = instantiate_components(cfg)
        write_seed_checkpoint(resolve(cfg, 1, torch.device("cpu")).model, parts, seed)
        ref_dir = root / f"{model}-reference"
        run_reference(
            reference_config(cfg, ref_dir, seed), parts, ref_dir, global_batch=cfg.split().global_batch
        )
        for name in ENGINES:
            plan.append(mapping(model, name, root / f"{model}-{name}", seed))
    seed = root / "mlp-seed.safetensors"
    plan.append(mapping("mlp", "fsdp", root / "mlp-fsdp-every_micro", seed, "every_micro"))
    for name in ("zero2", "zero3"):  # DeepSpeed's own per-micro-batch growth (its memory saving)
        plan.append(mapping("mlp", name, root / f"mlp-{name}-every_micro", seed, "every_micro"))
    window = mapping("tiny_gpt", "fsdp", root / "tiny_gpt-fsdp-window", root / "tiny_gpt-seed.safetensors")
    plan.append({**window, "engine": {**window["engine"], "fsdp_unsharded_window": True}})
    for name in RESUMED:  # stopped after 2 windows, checkpointed, resumed in a second run
        plan.append({**mapping("mlp", name, root / f"mlp-{name}-resumed", seed), "_stop_after": 2})
    return Runs(root, launch_many(plan, 2, root, timeout=600))


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("engine", [e for e in ENGINES if e != "ddp"])
def test_engine_matches_ddp_every_step(runs: Runs, model: str, engine: str) -> None:
    ddp, cand = runs.records(model, "ddp"), runs.records(model, engine)
    assert [r["partial_window"] for r in cand] == [False, False, True, False]
    for a, b in zip(ddp, cand, strict=True):
        assert (b["items"], b["samples"], b["lr"]) == (a["items"], a["samples"], a["lr"])
        assert b["loss"] == pytest.approx(a["loss"], rel=RTOL), (engine, a["step"])
        # A loss scaled twice (e.g. DeepSpeed's own 1/K on top of ours) shows as a K-fold norm.
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=RTOL), (engine, a["step"])
    for key in ("param_sum", "param_l2"):
        assert runs.summary(model, engine)[key] == pytest.approx(runs.summary(model, "ddp")[key], rel=RTOL)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("engine", list(ENGINES))
def test_final_weights_reproduce_the_trained_model(runs: Runs, model: str, engine: str) -> None:
    """final/model.safetensors (gathered from shards, plain names) in a fresh model: the run's param_sum
    bit for bit, and the trained model's outputs on a batch."""
    run_dir = runs.dir(model, engine)
    cfg = from_mapping(read_config(run_dir))
    parts = instantiate_components(cfg)
    fresh = parts.model()
    state = load_weights(run_dir / "final")
    assert set(state) == set(fresh.state_dict())  # every name, no "module." or "_fsdp" prefixes
    fresh.load_state_dict(state)
    total = torch.zeros((), dtype=torch.float64)
    for _, p in fresh.named_parameters():
        total += p.detach().double().sum()
    assert float(total) == runs.summary(model, engine)["param_sum"]
    fresh.eval()
    with torch.no_grad():
        ours = outputs(fresh, example_batch(parts))
    trained = load_file(str(run_dir / "outputs.safetensors"))["outputs"]
    assert torch.allclose(ours, trained, rtol=1e-6, atol=1e-7), float((ours - trained).abs().max())


@pytest.mark.parametrize("engine", list(ENGINES))
def test_hf_final_reloads_with_from_pretrained(runs: Runs, engine: str) -> None:
    """A Hugging Face model's final/ is its save_pretrained layout: from_pretrained finds every key it expects
    and nothing else, and the reloaded model gives the trained model's logits."""
    from transformers import AutoModelForCausalLM

    run_dir = runs.dir("llama", engine)
    reloaded, info = AutoModelForCausalLM.from_pretrained(
        str(run_dir / "final"), output_loading_info=True, local_files_only=True
    )
    assert {k: v for k, v in info.items() if v} == {}, info  # missing, unexpected, mismatched keys, errors
    reloaded.eval()
    parts = instantiate_components(from_mapping(read_config(run_dir)))
    with torch.no_grad():
        logits = outputs(reloaded, example_batch(parts))
    trained = load_file(str(run_dir / "outputs.safetensors"))["outputs"]
    assert torch.allclose(logits, trained, rtol=1e-6, atol=1e-6), float((logits - trained).abs().max())


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("engine", list(ENGINES))
def test_engine_passes_verify_comparison(runs: Runs, model: str, engine: str) -> None:
    """What ``distaccum verify`` decides for this run: same criterion, same tolerance."""
    cfg = from_mapping(read_config(runs.dir(model, engine)))
    report = compare(
        RunData.load(runs.dir(model, "reference")),
        RunData.load(runs.dir(model, engine)),
        tolerance_for(cfg.precision, cfg.verify),
    )
    assert report.passed, report.to_dict()
    assert report.steps_compared == 4


def _grad_numel(runs: Runs, model: str) -> int:
    return sum(t.numel() for t in load_weights(runs.root / f"{model}-seed.safetensors").values())


# Gradient reductions per optimizer step, by design (boundary mode, K micro-batches):
# (rounds = micro-batches with a reduction, bytes in units of one fp32 copy of the gradients).
DESIGN = {
    "fsdp": (1, 1),
    "zero0": (1, 1),
    "zero1": (1, 1),
    "zero2": (1, 1),
    "zero3": (1, 1),
    "accelerate": (1, 1),
}


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("engine", list(DESIGN))
def test_reductions_per_step_follow_the_engine_design(runs: Runs, model: str, engine: str) -> None:
    rounds, copies = DESIGN[engine]
    grad_bytes = 4 * _grad_numel(runs, model)
    for r in runs.records(model, engine):
        assert r["comm_rounds"] == rounds, (engine, r["step"])
        # FSDP pads each unit's flat gradient to a multiple of the world size: a few bytes more.
        assert copies * grad_bytes <= r["comm_bytes"] <= copies * grad_bytes * 1.01, (engine, r["step"])


def test_fsdp_units_and_every_micro(runs: Runs) -> None:
    boundary, every = runs.records("mlp", "fsdp"), runs.records("mlp", "fsdp-every_micro")
    units = 3  # mlp depth 2: three Linear layers, each its own FSDP unit (the root holds none)
    for b, e in zip(boundary, every, strict=True):
        assert (b["comm_calls"], b["comm_rounds"]) == (units, 1)  # one reduce-scatter round
        assert (e["comm_calls"], e["comm_rounds"]) == (K * units, K)  # one per micro-batch
        assert e["comm_bytes"] == K * b["comm_bytes"]
        assert e["loss"] == pytest.approx(b["loss"], rel=RTOL)
    assert runs.records("tiny_gpt", "fsdp")[0]["comm_calls"] == 3  # two blocks + the root


@pytest.mark.parametrize("engine", ["zero2", "zero3"])
def test_zero_every_micro_keeps_deepspeeds_per_micro_batch_reduction(runs: Runs, engine: str) -> None:
    boundary, every = runs.records("mlp", engine), runs.records("mlp", f"{engine}-every_micro")
    for b, e in zip(boundary, every, strict=True):
        assert b["comm_rounds"] == 1 and e["comm_rounds"] == K  # coalesced vs DeepSpeed's schedule
        assert e["comm_bytes"] == pytest.approx(K * b["comm_bytes"], rel=0.01)
        assert e["loss"] == pytest.approx(b["loss"], rel=RTOL)
        assert e["grad_norm"] == pytest.approx(b["grad_norm"], rel=RTOL)


def test_fsdp_unsharded_window_gathers_parameters_once_per_step(runs: Runs) -> None:
    default, window = runs.records("tiny_gpt", "fsdp"), runs.records("tiny_gpt", "fsdp-window")
    blocks = 2  # each block is its own unit; the root's parameters stay gathered from forward to backward
    for d, w in zip(default[1:], window[1:], strict=True):
        # Default: every block is gathered for each micro-batch's forward and again for its backward.
        assert d["gather_calls"] == 2 * K * blocks + K, d["gather_calls"]
        assert w["gather_calls"] == blocks + 1  # once per unit per step
        assert w["loss"] == pytest.approx(d["loss"], rel=RTOL) and w["comm_rounds"] == d["comm_rounds"] == 1


RESUMED = ["fsdp", "zero1", "zero3", "accelerate"]


@pytest.mark.parametrize("engine", RESUMED)
def test_checkpoint_resume_is_exact(runs: Runs, engine: str) -> None:
    """state_dict/load_state_dict: sharded parameters and optimizer state come back bit for bit."""
    resumed, straight = runs.records("mlp", f"{engine}-resumed"), runs.records("mlp", engine)
    checkpoint = runs.dir("mlp", f"{engine}-resumed") / "checkpoints" / "step-00000002"
    assert f"resumed from {checkpoint} after optimizer step 2" in runs.stdout
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [(r["loss"], r["grad_norm"]) for r in resumed] == [(r["loss"], r["grad_norm"]) for r in straight]
    for key in ("param_sum", "param_l2"):
        assert runs.summary("mlp", f"{engine}-resumed")[key] == runs.summary("mlp", engine)[key]


def test_conflicting_deepspeed_config_fails_before_training(tmp_path: Path) -> None:
    user = tmp_path / "ds.json"
    user.write_text(
        json.dumps({"gradient_accumulation_steps": 8, "zero_optimization": {"overlap_comm": False}})
    )
    run_dir = tmp_path / "run"
    proc = run_cli(
        "train", run_dir, "engine=deepspeed", f"engine.deepspeed_config={user}", "accum.steps=4", timeout=60
    )
    assert proc.returncode == 2, proc.stderr
    assert "gradient_accumulation_steps=8 in the file, but 4 from accum.steps=4" in proc.stderr
    assert "ranks, micro_batch" not in proc.stdout  # the launch line: no worker was started
    assert not (run_dir / "metrics.jsonl").exists()


# Each engine once through the real command; the full engine x model matrix is compared above.
VERIFY_CLI = [
    ("fsdp", "tiny_gpt"),
    ("zero1", "mlp"),
    ("zero2", "tiny_gpt"),
    ("zero3", "mlp"),
    ("accelerate", "tiny_gpt"),
]


@pytest.mark.parametrize(("engine", "model"), VERIFY_CLI)
def test_distaccum_verify_passes(tmp_path: Path, engine: str, model: str) -> None:
    """The real ``distaccum verify`` command, end to end (reference + one candidate)."""
    overrides = [f"engine.{k}={v}" for k, v in ENGINES[engine].items()]
    proc = distaccum_cli(
        [
            "verify",
            *overrides,
            f"engine.extensions_dir={EXTENSIONS}",
            *MODELS[model],
            "accum.micro_batch=2",
            "accum.steps=4",
            "trainer.max_steps=3",
            f"run_dir={tmp_path / 'v'}",
        ],
        cwd=tmp_path,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "v" / "verify.json").read_text())
    assert summary["passed"] and summary["candidates"][0]["engine"] == ENGINES[engine]["name"]


if __name__ == "__main__":
    _worker_main(sys.argv[1])
