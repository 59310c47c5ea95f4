"""Reducing rarely across model islands: LocalSGD and DiLoCo (streaming, token-weighted) around any engine's step.

:mod:`~distaccum.outer.config` (the typed ``outer`` section, a leaf), :mod:`~distaccum.outer.islands` (which ranks
form each island, and its groups), :mod:`~distaccum.outer.sync` (the outer step the loop runs every H steps) and
:mod:`~distaccum.outer.simulate` (the single-process simulator ``distaccum verify`` compares these runs with).
Nothing is imported here: the config module is imported by :mod:`distaccum.config`.
"""
