"""Activation checkpointing and lr scaling in real runs (gloo, world 2, K=4, partial windows).

- Every engine (DDP, FSDP2, Accelerate, DeepSpeed ZeRO-3) trains tiny_gpt, and FSDP2 a Hugging
  Face Llama, with and without ``model.activation_checkpointing``: the per-step losses and
  grad norms and the final parameters are the same (fp64: <= 1e-12 relative; they are in fact equal),
  and checkpointing really happened: every layer inside a checkpointed module ran its forward twice
  per training micro-batch (once more to recompute in backward), every other layer once.
- ``distaccum verify`` passes with checkpointing on, on DDP and FSDP (fp64, its 1e-9 tolerance).
- ``optim.lr_scaling=linear``: doubling the global batch doubles every step's lr; the summary and
  ``distaccum report`` show the effective lr.
- Bad values exit 2 before any worker starts; a model that already checkpoints with the reentrant
  variant is refused on DDP, and a negative control shows why (DDP fails on it).

The runs share one launch (this file doubles as the worker script), as in test_engines.py. The
Hugging Face checks in this process are single-process but import transformers (seconds), hence
this tier.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.nn.parallel import DistributedDataParallel as DDP

from conftest import EXTENSIONS, PlanRuns, distaccum_cli, forked_torchrun, plan_worker
from distaccum.activation_checkpointing import (
    apply_activation_checkpointing,
    is_checkpointed,
    reentrant_modules,
    saved_activation_bytes,
)
from distaccum.cli.compose import compose_config
from distaccum.cli.report import report_main
from distaccum.config import from_mapping, to_mapping
from distaccum.losses import token_cross_entropy
from distaccum.preflight import instantiate_components

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
TINY = ["model=tiny_gpt", "model.width=32", "data.dataset.seq_max=24", "data.dataset.num_samples=36"]
LLAMA = [
    "--config-dir",
    str(FIXTURES / "conf"),
    "model=llama",
    "data.dataset.seq_max=24",
    "data.dataset.num_samples=36",
]
SPLIT = [
    "accum.micro_batch=2",
    "accum.steps=4",
    "trainer.nproc=2",
    "trainer.max_steps=3",
    "log.console=quiet",
]
BLOCKS = "model.activation_checkpointing=blocks"
ENGINE = {
    "ddp": ["engine=ddp"],
    "fsdp": ["engine=fsdp"],
    "accelerate": ["engine=accelerate"],
    "zero3": ["engine=deepspeed", "engine.zero_stage=3", f"engine.extensions_dir={EXTENSIONS}"],
}
# name -> overrides; every "X-ckpt" run is compared with its "X-none" twin.
RUNS: dict[str, list[str]] = {}
for _engine in ("ddp", "fsdp", "accelerate", "zero3"):
    _precision = (
        "precision=fp32" if _engine == "zero3" else "precision=fp64"
    )  # ZeRO-0 refuses fp64, 1-3 round it
    RUNS[f"tiny-{_engine}-none"] = [*TINY, *ENGINE[_engine], _precision]
    RUNS[f"tiny-{_engine}-ckpt"] = [*TINY, *ENGINE[_engine], _precision, BLOCKS]
RUNS["tiny-ddp-patterns"] = [*TINY, "precision=fp64", "model.activation_checkpointing=[blocks.1.mlp,head]"]
# FSDP2's hooks around the Hugging Face layers' own checkpointed forward (DDP: the refusal test below).
RUNS["llama-fsdp-none"] = [*LLAMA, *ENGINE["fsdp"], "precision=fp64"]
RUNS["llama-fsdp-ckpt"] = [*LLAMA, *ENGINE["fsdp"], "precision=fp64", BLOCKS]
LR = ["data.dataset.num_samples=96", "precision=fp32", "optim.lr_scaling=linear", "optim.base_batch=16"]
RUNS["lr-g16"] = [*TINY, *LR, "accum.steps=4"]  # 2 x 4 x 2 = 16 samples per step
RUNS["lr-g32"] = [*TINY, *LR, "accum.steps=8"]  # 32
TWINS = [name.removesuffix("-none") for name in RUNS if name.endswith("-none")]


def hf_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    path = os.pathsep.join(p for p in (str(FIXTURES), env.get("PYTHONPATH", "")) if p)
    env.update(
        PYTHONPATH=path,
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    return env


class SharedBlock(torch.nn.Module):
    """One block applied twice (weights shared across depth): its parameters take part in two
    checkpointed regions per forward, the case reentrant checkpointing cannot run under DDP."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(16, 8)
        block: torch.nn.Module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
        if reentrant:
            block = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.REENTRANT)
        self.blocks = torch.nn.ModuleList([block, block])
        self.head = torch.nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def reentrant_demo(out: Path) -> None:
    """DDP with ``no_sync`` over 3 micro-batches of SharedBlock: plain, distaccum's non-reentrant
    checkpointing, and torch's reentrant one. Rank 0 writes what each did and the gradients."""
    results: dict[str, Any] = {}
    for variant in ("plain", "non_reentrant", "reentrant"):
        model = SharedBlock(reentrant=variant == "reentrant")
        if variant == "non_reentrant":
            apply_activation_checkpointing(model, "blocks")
        ddp = DDP(model)
        gen = torch.Generator().manual_seed(dist.get_rank())
        try:
            for k in range(3):
                with ddp.no_sync() if k < 2 else contextlib.nullcontext():
                    ddp(torch.randint(0, 16, (4, 5), generator=gen)).square().sum().backward()
            results[variant] = {"ok": True, "grad_sum": sum(float(p.grad.sum()) for p in model.parameters())}
        except RuntimeError as err:
            results[variant] = {"ok": False, "error": str(err)[:300]}
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results))


def count_training_forwards(model: torch.nn.Module) -> dict[str, Any]:
    """Forward hooks on every leaf module counting the calls made with gradients on (training forwards and
    the recomputation in backward; evaluation runs without), and the modules that checkpoint."""
    counts: dict[str, list[int]] = {}
    for name, module in model.named_modules():
        if name and not list(module.children()):
            counts[name] = [0]
            module.register_forward_hook(
                lambda _m, _i, _o, c=counts[name]: c.__setitem__(0, c[0] + int(torch.is_grad_enabled()))
            )
    flagged = [n for n, m in model.named_modules() if is_checkpointed(m)]
    # Hugging Face flags a model's layer stack as well as its layers: the layers are what recompute.
    return {
        "counts": counts,
        "checkpointed": [n for n in flagged if not any(o.startswith(n + ".") for o in flagged)],
    }


def _worker_main(plan_file: str) -> None:
    """Worker entry (under torch.distributed.run): train each config through the public Trainer, as
    the CLI's workers do (components instantiated from the config, checkpointing included), then
    run :func:`reentrant_demo`."""
    from distaccum.trainer import Trainer

    sys.path.insert(0, str(FIXTURES))

    def train(values: dict[str, Any]) -> None:
        cfg = from_mapping(values)
        parts = instantiate_components(cfg)
        trainer = Trainer.of(cfg, parts)
        forwards = count_training_forwards(trainer.setup().engine.unwrapped())
        trainer.fit()
        if dist.get_rank() == 0:
            forwards["counts"] = {k: v[0] for k, v in forwards["counts"].items()}
            (Path(cfg.run_dir) / "forwards.json").write_text(json.dumps(forwards))

    plan_worker(
        plan_file, train, after=lambda: reentrant_demo(Path(plan_file).parent / "reentrant_demo.json")
    )


class Runs(PlanRuns):
    def forwards(self, name: str) -> dict[str, Any]:
        return json.loads((self.root / name / "forwards.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    root = tmp_path_factory.mktemp("ckpt")
    sys.path.insert(0, str(FIXTURES))  # hf_llama, for composing the llama configs
    try:
        plan = [
            to_mapping(compose_config([*SPLIT, *overrides, f"run_dir={root / name}"]))
            for name, overrides in RUNS.items()
        ]
    finally:
        sys.path.remove(str(FIXTURES))
    plan_file = root / "plan.json"
    plan_file.write_text(json.dumps(plan))
    proc = forked_torchrun(str(Path(__file__)), str(plan_file), cwd=root, env=hf_env(), timeout=900)
    if proc.returncode:
        pytest.fail(f"runs failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return Runs(root, proc.stdout)


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("twin", TWINS)
def test_checkpointing_changes_no_loss_on_any_engine(runs: Runs, twin: str) -> None:
    plain, ckpt = runs.records(f"{twin}-none"), runs.records(f"{twin}-ckpt")
    assert [r["partial_window"] for r in ckpt] == [False, False, True]  # with empty micro-batches
    assert len(plain) == len(ckpt) == 3
    for a, b in zip(plain, ckpt, strict=True):
        assert rel(b["loss"], a["loss"]) <= 1e-12, (twin, a["step"], a["loss"], b["loss"])
        assert rel(b["grad_norm"], a["grad_norm"]) <= 1e-12, (twin, a["step"])
        assert b["comm_rounds"] == a["comm_rounds"]  # still one reduction per step where there was one
    for key in ("param_sum", "param_l2"):
        assert rel(runs.summary(f"{twin}-ckpt")[key], runs.summary(f"{twin}-none")[key]) <= 1e-12


@pytest.mark.parametrize("twin", TWINS)
def test_checkpointed_layers_really_recompute_in_backward(runs: Runs, twin: str) -> None:
    """Equal losses cannot show that checkpointing happened; the recomputation can: with it, layers inside
    each checkpointed module run their forward once more per training micro-batch, in backward (all of them
    up to the last one whose output backward needs: torch stops recomputing early), and no other layer does."""
    plain, ckpt = runs.forwards(f"{twin}-none"), runs.forwards(f"{twin}-ckpt")
    assert plain["checkpointed"] == [] and ckpt["checkpointed"], (twin, ckpt["checkpointed"])
    micro_batches = 3 * 4  # steps x K on each rank
    assert {calls % micro_batches for calls in plain["counts"].values()} == {0}, plain["counts"]
    for module in ckpt["checkpointed"]:
        inside = [n for n in ckpt["counts"] if n.startswith(module + ".") and plain["counts"][n]]
        assert inside, (twin, module)
        for name in inside:  # a layer called twice per forward (a shared dropout) may be recomputed once
            assert plain["counts"][name] <= ckpt["counts"][name] <= 2 * plain["counts"][name], (twin, name)
        assert ckpt["counts"][inside[0]] == 2 * plain["counts"][inside[0]], (
            twin,
            module,
            inside[0],
        )  # from its start
    outside = [n for n in plain["counts"] if not any(n.startswith(c + ".") for c in ckpt["checkpointed"])]
    for name in outside:
        assert ckpt["counts"][name] == plain["counts"][name], (twin, name)


def test_the_runs_said_what_they_checkpoint(runs: Runs) -> None:
    assert "activation checkpointing (non-reentrant) on 2 modules: blocks.0, blocks.1" in runs.output
    assert "on 2 modules: blocks.1.mlp, head" in runs.output
    assert "on 2 modules: model.layers.0, model.layers.1" in runs.output  # the Hugging Face decoder layers


def test_linear_lr_scaling_doubles_every_step_lr_with_the_global_batch(runs: Runs) -> None:
    small, large = runs.records("lr-g16"), runs.records("lr-g32")
    assert [r["samples"] for r in small] == [16] * 3 and [r["samples"] for r in large] == [32] * 3
    assert [b["lr"] / a["lr"] for a, b in zip(small, large, strict=True)] == pytest.approx(
        [2.0] * 3, rel=1e-12
    )
    assert runs.summary("lr-g16")["effective_lr"] == pytest.approx(3e-3)  # the configured lr at base_batch
    assert runs.summary("lr-g32")["effective_lr"] == pytest.approx(6e-3)
    assert runs.summary("lr-g32")["lr_scaling"] == "linear" and runs.summary("lr-g32")["base_batch"] == 16
    assert "effective lr 0.006 = 0.003 x 32/16 (optim.lr_scaling=linear" in runs.output


def test_the_report_shows_the_effective_lr_per_run(runs: Runs, tmp_path: Path) -> None:
    code = report_main(
        [
            str(runs.root / "lr-g16"),
            str(runs.root / "lr-g32"),
            str(runs.root / "tiny-ddp-none"),
            str(runs.root / "tiny-ddp-ckpt"),
            "--out",
            str(tmp_path),
        ]
    )
    markdown = (tmp_path / "report.md").read_text()
    assert code == 0, markdown  # tiny-ddp-ckpt agrees with tiny-ddp-none: checkpointing is comparable
    header = [c.strip() for c in markdown.splitlines()[4].strip("|").split("|")]
    rows = {
        line.split("|")[1].strip(" `"): [c.strip() for c in line.strip("|").split("|")]
        for line in markdown.splitlines()
        if line.startswith("| `")
    }
    col = header.index("effective lr")
    assert (rows["lr-g16"][col], rows["lr-g32"][col]) == ("0.003", "0.006")
    assert rows["tiny-ddp-ckpt"][header.index("loss curve")].startswith(("ok", "reference"))


def test_reentrant_checkpointing_breaks_ddp_and_ours_does_not(runs: Runs) -> None:
    """Why the reentrant variant is refused: the negative control fails under DDP + no_sync, the
    non-reentrant one trains and gives the plain model's gradients."""
    demo = json.loads((runs.root / "reentrant_demo.json").read_text())
    assert (
        not demo["reentrant"]["ok"]
        and "Expected to mark a variable ready only once" in demo["reentrant"]["error"]
    )
    assert demo["plain"]["ok"] and demo["non_reentrant"]["ok"]
    assert demo["non_reentrant"]["grad_sum"] == demo["plain"]["grad_sum"]


def test_hugging_face_blocks_use_its_own_non_reentrant_checkpointing() -> None:
    sys.path.insert(0, str(FIXTURES))
    try:
        from hf_llama import make_llama
    finally:
        sys.path.remove(str(FIXTURES))

    def build(**kwargs: Any) -> torch.nn.Module:
        torch.manual_seed(0)
        return make_llama(**kwargs).double()

    ids = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    plain, ckpt = build(), build()
    assert apply_activation_checkpointing(ckpt, "blocks") == ["model.layers.0", "model.layers.1"]
    assert ckpt.is_activation_checkpointing and reentrant_modules(ckpt) == []
    assert all(
        layer._gradient_checkpointing_func.keywords == {"use_reentrant": False} for layer in ckpt.model.layers
    )
    kept = [saved_activation_bytes(m, token_cross_entropy, batch) for m in (plain, ckpt)]
    assert kept[1] < kept[0] / 2, kept
    for model in (plain, ckpt):
        model.zero_grad()
        token_cross_entropy(model, batch)[0].backward()
    assert all(
        torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), ckpt.parameters(), strict=True)
    )
    # A factory that enabled the reentrant variant: "blocks" switches it to the non-reentrant one.
    factory_made = build(reentrant_checkpointing=True)
    assert reentrant_modules(factory_made) == ["model.layers.0", "model.layers.1"]
    apply_activation_checkpointing(factory_made, "blocks")
    assert reentrant_modules(factory_made) == []


def cli(command: str, run_dir: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return distaccum_cli(
        [command, *args, f"run_dir={run_dir}"], cwd=run_dir.parent, env=hf_env(), timeout=timeout
    )


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_verify_passes_with_checkpointing(tmp_path: Path, engine: str) -> None:
    """The reference never checkpoints: a pass says checkpointing changed nothing verify can see."""
    proc = cli("verify", tmp_path / "v", *TINY, *SPLIT, f"engine={engine}", "precision=fp64", BLOCKS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "v" / "verify.json").read_text())
    cand = result["candidates"][0]
    assert result["passed"] and cand["max_rel_diff"] <= 1e-9, result
    assert cand["max_loss_diff"] <= 1e-9 * max(1.0, abs(result.get("final_loss", 1.0))), result


BAD = {
    "unknown pattern": (
        [*TINY, "model.activation_checkpointing=[blocks.0,layers.*]"],
        "pattern 'layers.*' matches no module of TinyGPT",
    ),
    "base_batch 0": ([*TINY, "optim.base_batch=0"], "optim.base_batch must be > 0, got 0"),
    "unknown rule": (
        [*TINY, "optim.lr_scaling=cubic", "optim.base_batch=64"],
        "optim.lr_scaling='cubic' is not one of none, linear, sqrt",
    ),
    "reentrant on ddp": (
        [*LLAMA, "model.reentrant_checkpointing=true", "engine=ddp"],
        "checkpoint activations with the reentrant variant (model.layers.0, model.layers.1); "
        "with engine=ddp DDP fails with 'Expected to mark a variable ready only once'",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_values_exit_2_before_workers_start(tmp_path: Path, case: str) -> None:
    overrides, fragment = BAD[case]
    proc = cli("train", tmp_path / "bad", *overrides, *SPLIT)
    assert proc.returncode == 2, (case, proc.stdout[-1000:], proc.stderr[-3000:])
    assert fragment in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "equivalent to `" not in proc.stdout  # no worker was started
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()


def test_the_trade_off_benchmark_runs(tmp_path: Path) -> None:
    """``python -m benchmarks.checkpointing --smoke``: the table in docs/companions.md, CI-sized."""
    smoke = [sys.executable, "-m", "benchmarks.checkpointing", "--smoke", "--rounds", "1"]
    proc = subprocess.run(
        [*smoke, "--out", str(tmp_path)],
        cwd=REPO,
        env=hf_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (result,) = json.loads((tmp_path / "results.json").read_text())
    assert result["saved_bytes"]["blocks"] < result["saved_bytes"]["none"]
    assert all(
        result["peak"][v]["peak_rss"] > 0 and len(result["step_s"][v]) == 1 for v in ("none", "blocks")
    )
    assert "| tiny_gpt w32 (2 blocks) |" in (tmp_path / "results.md").read_text()


if __name__ == "__main__":
    _worker_main(sys.argv[1])
