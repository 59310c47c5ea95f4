"""Print the config reference (markdown) of docs/configuration.md from distaccum/config.py.

Each field's docstring in config.py is the single source: ``python launch/config_reference.py``
prints the tables, ``python launch/update_config_reference.py`` writes them into docs/configuration.md, and
tests/test_readme.py fails when that page no longer contains them.
"""

from __future__ import annotations

import dataclasses
import sys

from distaccum import config
from distaccum.cli.helptext import field_default, field_docs

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
    "ft": config.FtConfig,
}


def _default(f: dataclasses.Field) -> str:
    value = field_default(f)
    return "" if value is None else value if value == "(section)" else f"`{value}`"


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
