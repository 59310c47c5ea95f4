"""The global batch that grows during a run (its batch growth): a ramp by accumulation, and an adaptive batch
that follows the noise scale.

:mod:`~distaccum.batching.config` (the typed ``accum.ramp`` and ``accum.adaptive`` sections, a leaf),
:mod:`~distaccum.batching.growth` (the global batch and split of every step; the data order and the learning rate
follow it) and :mod:`~distaccum.batching.adaptive` (the rule that changes it from the measured noise scale, checked
across ranks).
"""
