"""One rank of a run: process group, model, engine, loop, summary. Called by the entry layer."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from distaccum.backend import make_backend
from distaccum.checkpoint import CHECKPOINT_NAME, StopFlag
from distaccum.comm import CommLedger
from distaccum.config import RunConfig, to_mapping
from distaccum.data import build_dataset
from distaccum.models import build_model
from distaccum.sinks import Record, build_sinks
from distaccum.topology import DistEnv
from distaccum.train import resume, setup, summarize, train
from distaccum.verify import FINAL_PARAMS_FILE, save_final_params


def pick_device(cfg: RunConfig, env: DistEnv) -> torch.device:
    """cuda:<local_rank> when CUDA is asked for (or auto and present), else cpu."""
    want_cuda = cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and torch.cuda.is_available())
    if want_cuda:
        if not torch.cuda.is_available():
            raise ValueError("trainer.device=cuda but CUDA is not available")
        return torch.device("cuda", env.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_process_group(env: DistEnv, device: torch.device) -> None:
    """NCCL on GPUs, gloo on CPU. torchrun provides env://; srun tasks rendezvous over tcp://."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if env.source == "torchrun":
        dist.init_process_group(backend, init_method="env://")
    else:
        dist.init_process_group(backend, init_method=f"tcp://{env.master_addr}:{env.master_port}",
                                rank=env.rank, world_size=env.world_size)


def shutdown() -> None:
    """Barrier, then destroy the process group: no rank tears gloo down while a peer still sends."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _previous_records(run_dir: Path, done: int) -> list[Record]:
    """The records of the steps a checkpoint already holds (later lines, if any, are dropped)."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines()[:done] if path.is_file() else []
    if dist.get_rank() == 0 and path.is_file():
        path.write_text("".join(line + "\n" for line in lines))
    dist.barrier()
    return [json.loads(line) for line in lines]


def run_worker(cfg: RunConfig, env: DistEnv, stop: StopFlag | None = None) -> Record:
    """Train one rank of ``cfg`` to the end; returns the summary (identical on every rank)."""
    device = pick_device(cfg, env)
    if not dist.is_initialized():
        init_process_group(env, device)
    split = cfg.split(dist.get_world_size())
    run_dir = Path(cfg.run_dir)
    rank = dist.get_rank()
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(to_mapping(cfg), indent=2) + "\n")

    torch.manual_seed(cfg.trainer.seed)  # identical initial weights on every rank and every split
    dataset = build_dataset(cfg.model, cfg.data)
    model, loss_fn = build_model(cfg.model, cfg.data)
    if cfg.precision == "fp64":
        model = model.double()
    if cfg.trainer.init_from:
        model.load_state_dict(torch.load(cfg.trainer.init_from, map_location="cpu", weights_only=True))
    # From here on random draws (dropout masks) must differ between ranks, or every rank would
    # drop the same units of its different samples.
    torch.manual_seed(cfg.trainer.seed + 1_000_003 * (rank + 1))

    ledger = CommLedger(enabled=cfg.log.ledger)
    backend = make_backend(cfg, device, ledger)
    state = setup(cfg, model, backend, split, dataset)
    done = resume(cfg, state) if cfg.trainer.resume else 0
    if done:
        state.records = _previous_records(run_dir, done)
        if rank == 0:
            print(f"distaccum: resumed from {run_dir / 'checkpoint.pt'} after optimizer step {done}",
                  flush=True)
    wandb_config = to_mapping(cfg) if cfg.log.wandb else None
    sink = build_sinks(cfg.log.console, cfg.trainer.max_steps, run_dir, rank, wandb_config=wandb_config,
                       append=bool(done),
                       wandb_mode=cfg.log.wandb_mode, wandb_project=cfg.log.wandb_project)
    records = train(cfg, state, split, dataset, loss_fn, ledger, sink, device, rank, stop=stop)
    summary = summarize(cfg, split, records, backend, run_dir)
    if cfg.verify.record:  # collective (full_parameters); rank 0 writes final_params.pt
        save_final_params(backend, run_dir / FINAL_PARAMS_FILE, rank)
    sink.close(summary)
    if rank == 0:  # finished: a later run in this run_dir starts afresh instead of resuming
        (run_dir / CHECKPOINT_NAME).unlink(missing_ok=True)
    backend.teardown()
    return summary
