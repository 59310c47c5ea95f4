"""Print the config reference (markdown) of docs/configuration.md from distaccum/config.py.

Each field's docstring in config.py is the single source: ``python launch/config_reference.py``
prints the tables, ``python launch/update_config_reference.py`` writes them into docs/configuration.md, and
tests/test_readme.py fails when that page no longer contains them.
"""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

from distaccum import config

SECTIONS = {
    "": config.RunConfig,
    "data": config.DataConfig,
    "eval": config.EvalConfig,
    "engine": config.EngineConfig,
    "accum": config.AccumConfig,
    "accum.ramp": config.RampConfig,
    "accum.adaptive": config.AdaptiveConfig,
    "optim": config.OptimConfig,
    "trainer": config.TrainerConfig,
    "log": config.LogConfig,
    "verify": config.VerifyConfig,
    "slurm": config.SlurmConfig,
    "kubeflow": config.KubeflowConfig,
    "ray": config.RayConfig,
    "outer": config.OuterConfig,
}


def field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under each field of dataclass ``cls`` in its module (config.py, or a leaf it imports)."""
    tree = ast.parse(Path(str(sys.modules[cls.__module__].__file__)).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    docs: dict[str, str] = {}
    body = node.body
    for stmt, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
        ):
            docs[stmt.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return ""
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, tuple):
        value = list(value)
    if dataclasses.is_dataclass(value):
        return "(section)"
    return f"`{value}`"


def render() -> str:
    """Markdown tables, one per config section."""
    out = []
    for section, cls in SECTIONS.items():
        docs = field_docs(cls)
        rows = [f for f in dataclasses.fields(cls) if f.name in docs]
        if not rows:
            continue
        out.append(f"**`{section or 'top level'}`** — {(cls.__doc__ or '').strip().splitlines()[0]}\n")
        out.append("| key | default | meaning |\n|---|---|---|")
        for f in rows:
            key = f"{section}.{f.name}" if section else f.name
            out.append(f"| `{key}` | {_default(f)} | {docs[f.name].replace('|', '/')} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(render())
