"""Verification: a run compared step by step with plain PyTorch taking the whole batch in one process.

- :mod:`~distaccum.verify.reference`: the plain single-process reference;
- :mod:`~distaccum.verify.compare`: the tiny file format and ``compare(ref, cand) -> Report``;
- :mod:`~distaccum.verify.diagnosis`: why a candidate diverged (one rule per cause);
- :mod:`~distaccum.verify.runner`: :func:`verify`, the Python API (what ``distaccum verify`` runs);
- :mod:`~distaccum.verify.script`: verifying a user's own ``Trainer`` script.

The runtime checks every run carries (the tripwire, the reduction fingerprint) are the per-step guards,
:mod:`distaccum.guards`, which this command reads the reports of. ``from distaccum.verify import verify`` imports
the runner on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "verify": "distaccum.verify.runner",
    "VerifyResult": "distaccum.verify.runner",
    "VerifyRow": "distaccum.verify.runner",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Lazy exports (PEP 562)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'distaccum.verify' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
