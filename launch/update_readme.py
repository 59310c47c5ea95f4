"""Rewrite the config reference between the README's markers (``python launch/update_readme.py``)."""

from __future__ import annotations

from pathlib import Path

from config_reference import render

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- config-reference:start -->\n", "<!-- config-reference:end -->"

if __name__ == "__main__":
    text = README.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    README.write_text(head + START + render() + "\n" + END + tail)
    print(f"updated {README}")
