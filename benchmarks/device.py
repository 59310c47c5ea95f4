"""CPU (gloo) or GPU (NCCL) measurement: the clock, the process group, MFU and NCCL bus bandwidth.

On CPU every op runs on the host, so ``perf_counter`` around a step is the step. On CUDA kernels run
asynchronously: a host clock would time their queueing, so steps are timed with CUDA events on the
current stream and read after one ``torch.cuda.synchronize`` at the end of each block (outside the
timed steps). GPU mode is only entered when CUDA is present; nothing here touches CUDA otherwise.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

PEAK_TFLOPS: dict[tuple[str, str], float] = {
    # (device name fragment, precision) -> dense peak TFLOP/s per GPU, from the vendors' data sheets.
    # fp32 means plain FP32 (torch's default float32 matmul precision "highest": no TF32).
    ("H200", "fp32"): 67.0,
    ("H200", "bf16"): 989.0,
    ("H100 SXM", "fp32"): 67.0,
    ("H100 SXM", "bf16"): 989.0,
    ("H100 80GB HBM3", "fp32"): 67.0,  # the SXM part reports itself this way
    ("H100 80GB HBM3", "bf16"): 989.0,
    ("H100 PCIe", "fp32"): 51.0,
    ("H100 PCIe", "bf16"): 756.0,
    ("A100", "fp32"): 19.5,
    ("A100", "bf16"): 312.0,
}
"""Peak throughput used for MFU. A device not listed gets no MFU (``--peak-tflops`` sets one)."""


class Clock(Protocol):
    """Stamps around steps; ``seconds`` of consecutive stamps is only valid after ``sync``."""

    def stamp(self) -> Any: ...

    def sync(self) -> None: ...

    def seconds(self, start: Any, end: Any) -> float: ...


class HostClock:
    """The process's wall clock (CPU: the work happens on the host)."""

    def stamp(self) -> float:
        return time.perf_counter()

    def sync(self) -> None:
        pass

    def seconds(self, start: float, end: float) -> float:
        return end - start


class CudaClock:
    """CUDA events on the current stream, resolved after one synchronize per block."""

    def stamp(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def sync(self) -> None:
        torch.cuda.synchronize()

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1000.0


def step_seconds(clock: Clock, stamps: list[Any]) -> list[float]:
    """Durations between consecutive stamps (call after ``clock.sync()``)."""
    return [clock.seconds(a, b) for a, b in zip(stamps[:-1], stamps[1:], strict=True)]


def cuda_present() -> bool:
    """Whether GPU mode can run here."""
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def join(device_kind: str) -> tuple[torch.device, Clock]:
    """Join the process group of this worker (torchrun-style environment) and pick its device:
    ``cuda:LOCAL_RANK`` on NCCL, or the CPU on gloo with one intra-op thread (torchrun's default
    for several ranks per node, and what the hand-written loops would get)."""
    if device_kind == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device, CudaClock()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    return torch.device("cpu"), HostClock()


def peak_tflops(precision: str, override: float | None = None) -> tuple[float | None, str]:
    """Peak TFLOP/s of this GPU for ``precision`` and where the number comes from."""
    if override:
        return override, "--peak-tflops"
    if not cuda_present():
        return None, "no GPU"
    name = torch.cuda.get_device_name()
    for (fragment, prec), value in PEAK_TFLOPS.items():
        if fragment in name and prec == precision:
            return value, f"data sheet, {fragment} {prec} dense"
    return None, f"{name} is not in benchmarks.device.PEAK_TFLOPS; pass --peak-tflops"


def model_flops_per_step(num_params: int, samples_per_rank: int) -> float:
    """Training FLOPs of one rank's optimizer step for an MLP: 2 per parameter and sample forward,
    4 backward (weight and input gradients); biases and activations are negligible."""
    return 6.0 * num_params * samples_per_rank


def mfu(num_params: int, samples_per_rank: int, step_s: float, peak: float | None) -> float | None:
    """Model FLOPs utilization of one GPU: achieved FLOP/s over the peak (None without a peak)."""
    if not peak or step_s <= 0:
        return None
    return model_flops_per_step(num_params, samples_per_rank) / step_s / (peak * 1e12)


def bus_bandwidth(numel: int, device: torch.device, clock: Clock, iters: int = 20) -> dict[str, Any]:
    """NCCL-tests' all-reduce bus bandwidth for a float32 tensor of ``numel`` (the gradients):
    algbw = bytes / time, busbw = algbw * 2 (W - 1) / W. Collective; needs W > 1."""
    world = dist.get_world_size()
    if world < 2:
        return {"status": "not measured", "why": "one GPU: an all-reduce over one rank moves no data"}
    tensor = torch.ones(numel, dtype=torch.float32, device=device)
    for _ in range(3):
        dist.all_reduce(tensor)
    clock.sync()
    start = clock.stamp()
    for _ in range(iters):
        dist.all_reduce(tensor)
    end = clock.stamp()
    clock.sync()
    seconds = clock.seconds(start, end) / iters
    algbw = tensor.numel() * tensor.element_size() / seconds
    return {"status": "ok", "bytes": tensor.numel() * tensor.element_size(), "time_s": seconds,
            "algbw_gbps": algbw / 1e9, "busbw_gbps": algbw * 2 * (world - 1) / world / 1e9}


def worker_main(module: str, measure: Callable[[Any, Path], dict[str, Any]], spec_from_json: Callable[[str], Any],
                argv: list[str] | None = None) -> None:
    """A benchmark worker's entry: ``SPEC_JSON OUT_JSON WORKDIR``; rank 0 writes ``measure``'s record."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3:
        raise SystemExit(f"usage: python -m {module} SPEC_JSON OUT_JSON WORKDIR")
    record = measure(spec_from_json(args[0]), Path(args[2]))
    if dist.get_rank() == 0:
        Path(args[1]).write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo threads occasionally abort interpreter teardown; the record is on disk
