"""The per-step guards the training loop runs: checks that every rank reduced and decided the same, each step.

:mod:`~distaccum.guards.agreement` (one small row per rank, gathered once and compared: who disagrees),
:mod:`~distaccum.guards.fingerprint` (the reduced gradient's sample, or the sharded checksum's verdict, compared a
step later), :mod:`~distaccum.guards.checksum` (the sharded engines' reduction checksum and its rounding bound),
:mod:`~distaccum.guards.tripwire` (the periodic cross-rank parameter check) and
:mod:`~distaccum.guards.reduction_count` (the micro-batches that reduced against what ``accum.sync`` promises).
The guards sit below the Trainer and beside the engines: they import neither the Trainer nor the ``verify``
command, which reads what they write (``divergence.json``, ``warnings.jsonl``, ``param_digests.jsonl``).
Nothing is imported here.
"""
