"""Text for a terminal: the subcommands' ``--help`` is their module docstring, written in reStructuredText
for the API docs; :func:`plain_text` drops the markup a terminal would print literally, :func:`config_keys` lists a
config section's keys with their defaults and the docstrings under them (the source of docs/configuration.md too)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap

ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`~?([^`]+)`")
"""A reStructuredText role (``:mod:`a.b```, ``:func:`~a.b```); group 1 is its target."""


def plain_text(doc: str) -> str:
    """``doc`` for a terminal: reStructuredText roles (:mod:`a.b`) and inline literals (``x``) as plain text."""
    return ROLE.sub(r"\1", doc).replace("``", "")


def _plain(value: object) -> bool:
    return value is None or isinstance(value, bool)


def config_keys(section: str, cls: type) -> list[str]:
    """One line per field of the config dataclass ``cls`` under ``section``: ``section.key (default): doc``, the
    doc being the first sentence of the docstring written under the field in its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    lines = []
    for field in dataclasses.fields(cls):
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            default = "required"
        default = (
            {None: "null", True: "true", False: "false"}.get(default, default) if _plain(default) else default
        )
        doc = plain_text(docs.get(field.name, ""))
        first = doc.split(". ")[0].rstrip(".")
        lines.append(f"  {section}.{field.name} ({default}): {first}")
    return lines
