"""Where a step's time goes, eager against ``torch.compile``: ``python -m benchmarks.compile_profile``.

One process (gloo world of 1, one intra-op thread), the 27.3M-parameter benchmark MLP under DDP
(``gradient_as_bucket_view=True``), micro-batch 4: 3 warm-up steps, then torch.profiler over 5 steps, eager
and then compiled (``torch.compile(ddp, dynamic=True)``, what ``trainer.compile`` does on DDP). It prints
each profile's top operators by self CPU time, so the two can be compared operator by operator: which
GEMMs run, how often, and what compiling adds around them. Counts are exact; times are as noisy as the
machine.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

from benchmarks.cases import FULL_CASES


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29631")
    dist.init_process_group("gloo", rank=0, world_size=1)
    case = FULL_CASES[0]
    ddp = DDP(case.shape.build(), gradient_as_bucket_view=True)
    x, y = torch.randn(case.micro_batch, case.shape.in_dim), torch.randn(case.micro_batch, case.shape.out_dim)

    def step(model: torch.nn.Module) -> None:
        ((model(x) - y) ** 2).sum().backward()

    for name, model in (("eager", ddp), ("compiled", torch.compile(ddp, dynamic=True))):
        for _ in range(3):
            step(model)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                step(model)
        print(f"===== {name}: {case.name}, 5 steps")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=55))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
