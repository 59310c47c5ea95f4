"""Fault-tolerant replica groups with torchft: a lost group costs no sample and no restart (docs/failures.md).

:mod:`~distaccum.ft.config` (the typed ``ft`` section, a leaf), :mod:`~distaccum.ft.session` (this group's torchft
Manager: the quorum of each step, the reduction across groups, the commit), :mod:`~distaccum.ft.parts` (the window
cut for the groups a quorum admits, the totals and gradients summed across them, a failed step computed again),
:mod:`~distaccum.ft.setup` (the feature's set-up) and :mod:`~distaccum.ft.launch` (the Lighthouse and one launcher per
group on this machine, a dead group restarted). Nothing is imported here: the config module is imported by
:mod:`distaccum.config`.
"""
