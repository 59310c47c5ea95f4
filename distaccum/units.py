"""Config values: parse byte sizes (``512MiB`` / ``6GB``) and print them (``1.5GiB``) in reports; the checks every
config section shares (one of a set, positive, a ``_target_`` node). A leaf module: the sections in
:mod:`distaccum.config` and beside their features (``data/config.py``, ``verify/config.py``) import it."""

from __future__ import annotations

from typing import Any, Mapping

Node = dict[str, Any]
"""A Hydra component node: ``{"_target_": "pkg.mod.name", **kwargs}`` (``_partial_: true`` for callables)."""

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(where: str, value: int | float | str) -> int:
    """A size in bytes from an integer or a string such as ``512MiB``, ``6GB``, ``1.5GiB``."""
    if isinstance(value, bool):
        raise ValueError(f"{where} must be a size such as 512MiB or 6GB, got {value!r}")
    if isinstance(value, int | float):
        size = float(value)
    else:
        text = str(value).strip().lower().replace(" ", "")
        number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(number) :] or "b"
        try:
            size = float(number) * _UNITS[unit]
        except (ValueError, KeyError):
            raise ValueError(
                f"{where}={value!r} is not a size: write bytes or a number with a unit "
                "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 512MiB or 6GB"
            ) from None
    if size <= 0:
        raise ValueError(f"{where} must be > 0, got {value!r}")
    return int(size)


def human_bytes(n: float) -> str:
    """``512B``, ``1.5KiB``, ``3.2MiB``, ``1.0GiB`` (binary units, GiB the largest)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}GiB"  # pragma: no cover


def check_choice(section: str, name: str, value: str, allowed: tuple[str, ...]) -> None:
    """Raise ``ValueError`` unless ``section.name`` is one of ``allowed``."""
    if value not in allowed:
        raise ValueError(f"{section}.{name}={value!r} is not one of {', '.join(allowed)}")


def check_positive(section: str, name: str, value: int | float | None, *, allow_none: bool = False) -> None:
    """Raise ``ValueError`` unless ``section.name`` is > 0 (or None, with ``allow_none``)."""
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise ValueError(f"{section}.{name} must be > 0, got {value!r}")


def check_node(where: str, value: Any) -> Node | None:
    """Validate a component node: None, or a mapping with a dotted ``_target_`` string."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(
            f"{where} must be a mapping with a _target_ (e.g. {{_target_: mypkg.make_model}}), got {value!r}"
        )
    target = value.get("_target_")
    if not isinstance(target, str) or "." not in target:
        raise ValueError(
            f"{where} needs a _target_ naming an importable callable such as "
            f"'mypkg.module.name', got _target_={target!r}"
        )
    return dict(value)
