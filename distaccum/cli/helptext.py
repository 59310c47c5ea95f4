"""Text for a terminal: the subcommands' ``--help`` is their module docstring, written in reStructuredText
for the API docs; :func:`plain_text` drops the markup a terminal would print literally, :func:`config_keys` lists a
config section's keys with their defaults and the docstrings under them (the source of docs/configuration.md too)."""

from __future__ import annotations

import ast
import dataclasses
import re
import sys
from pathlib import Path
from typing import Any

ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`~?([^`]+)`")
"""A reStructuredText role (``:mod:`a.b```, ``:func:`~a.b```); group 1 is its target."""


def plain_text(doc: str) -> str:
    """``doc`` for a terminal: reStructuredText roles (:mod:`a.b`) and inline literals (``x``) as plain text."""
    return ROLE.sub(r"\1", doc).replace("``", "")


def field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under each field of dataclass ``cls`` in its module's source, whitespace folded: the one
    source of the config reference (docs/configuration.md) and of the commands' ``--help`` key lists."""
    tree = ast.parse(Path(str(sys.modules[cls.__module__].__file__)).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    docs: dict[str, str] = {}
    for stmt, nxt in zip(node.body, node.body[1:], strict=False):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
        ):
            docs[stmt.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def field_default(f: dataclasses.Field[Any]) -> str | None:
    """A config field's default as YAML writes it (``null``, ``true``, ``[a, b]``), ``(section)`` for a nested
    section, None when the field has none."""
    if f.default is not dataclasses.MISSING:
        value: Any = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return None
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        value = list(value)
    if dataclasses.is_dataclass(value):
        return "(section)"
    return str(value)


def config_keys(section: str, cls: type) -> list[str]:
    """One line per field of the config dataclass ``cls`` under ``section``: ``section.key (default): doc``, the
    doc being the first sentence of the docstring written under the field in its source."""
    docs = field_docs(cls)
    lines = []
    for f in dataclasses.fields(cls):
        first = plain_text(docs.get(f.name, "")).split(". ")[0].rstrip(".")
        lines.append(f"  {section}.{f.name} ({field_default(f) or 'required'}): {first}")
    return lines
