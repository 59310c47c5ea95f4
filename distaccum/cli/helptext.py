"""Text for a terminal: the subcommands' ``--help`` is their module docstring, written in reStructuredText
for the API docs; :func:`plain_text` drops the markup a terminal would print literally."""

from __future__ import annotations

import re

ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`~?([^`]+)`")
"""A reStructuredText role (``:mod:`a.b```, ``:func:`~a.b```); group 1 is its target."""


def plain_text(doc: str) -> str:
    """``doc`` for a terminal: reStructuredText roles (:mod:`a.b`) and inline literals (``x``) as plain text."""
    return ROLE.sub(r"\1", doc).replace("``", "")
