"""A process of the console script starts with the cyclic garbage collector paused while it loads its libraries.

Importing torch (and its compiler stack, which DDP's constructor and torch's optimizers import), Hydra and the
components' modules creates hundreds of thousands of objects that live as long as the process; meanwhile the collector
scans them over and over. A one-step ``distaccum train model=mlp`` on two CPU ranks took 6.6-6.8 s of user CPU and
4.9-5.1 s of wall with it, 5.0 s and 4.3-4.4 s with the pause (three runs each, 2-core machine). :func:`pause` runs
at entry; :func:`resume` once the libraries are loaded (a worker: before it builds the components and the Trainer; a
launcher or verify: when its task starts, the config composed): everything tracked then moves to the permanent
generation (``gc.freeze``), so later collections, in the training loop too, never scan it again, and collection
resumes before anything the run builds, so nothing it leaves behind (the auto micro-batch's probe models) outlives
it. Only the few thousand unreachable cycles the imports leave (8,754 objects after ``import torch,
torch._dynamo``) are frozen with the rest rather than found by a full collection (0.17 s).
"""

from __future__ import annotations

import gc


def pause() -> None:
    """Stop cyclic collection until :func:`resume` (at process entry, before the heavy imports)."""
    gc.disable()


def resume() -> None:
    """Freeze what is alive into the permanent generation and collect again from here on. Idempotent."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()
