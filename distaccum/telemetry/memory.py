"""Peak memory per optimizer step: CUDA allocator peak on GPU, peak process RSS on CPU."""

from __future__ import annotations

import resource

import torch


def _read_status(key: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window (called at the start of each optimizer step)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # Linux: writing 5 to clear_refs resets VmHWM (peak RSS) of this process
        with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
            refs.write("5")
    except OSError:
        pass  # elsewhere the peak is the lifetime peak; still monotone and comparable


def peak_memory_bytes(device: torch.device) -> int:
    """Peak bytes since the last reset: allocated CUDA memory, or process RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = _read_status("VmHWM:")
    if peak is not None:
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
