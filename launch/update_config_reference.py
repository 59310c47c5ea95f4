"""Rewrite the config reference between docs/configuration.md's markers (``python launch/update_config_reference.py``)."""

from __future__ import annotations

from pathlib import Path

from config_reference import render

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
START, END = "<!-- config-reference:start -->\n", "<!-- config-reference:end -->"

if __name__ == "__main__":
    text = DOC.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(head + START + render() + "\n" + END + tail)
    print(f"updated {DOC}")
