"""Every `distaccum train|verify|plan|submit` line in README.md and docs/ composes into a valid config.

Documentation rots silently when a key is renamed; this composes each documented command's overrides
with the packaged configs and validates them (no worker starts). Lines that need a user's own config
directory, a script, a sweep or elisions are skipped, and at least 25 must be checked.
"""

from __future__ import annotations

import re
import shlex

import pytest

from conftest import REPO
from distaccum.cli.compose import compose_config
from distaccum.cli.plan import parse_args

pytestmark = pytest.mark.unit

SKIP_WHEN = ("--config-dir", "--multirun", "--script", "...", "[")
DROP = ("--dry-run",)


def documented_commands() -> list[tuple[str, list[str]]]:
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(encoding="utf-8"), re.S):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                match = re.match(r"distaccum (train|verify|plan|submit)\b(.*)", line.split(" #")[0].strip())
                if match:
                    args = [a for a in shlex.split(match.group(2)) if a not in DROP]
                    if "--to" in args:  # submit's / verify's target (slurm, kubeflow, ray, local)
                        at = args.index("--to")
                        args = args[:at] + args[at + 2 :]
                    if match.group(1) == "plan":  # the plan's own flags parse; the rest are overrides
                        args = parse_args(args)[1]
                    if not any(a.startswith(SKIP_WHEN) for a in args):
                        found.append(
                            (f"{path.name}: distaccum {match.group(1)} {match.group(2).strip()}", args)
                        )
    return found


COMMANDS = documented_commands()


def test_enough_documented_commands_are_checked() -> None:
    assert len(COMMANDS) >= 25, [name for name, _ in COMMANDS]


@pytest.mark.parametrize("args", [args for _, args in COMMANDS], ids=[name for name, _ in COMMANDS])
def test_documented_command_composes_and_validates(args: list[str]) -> None:
    compose_config(args)
