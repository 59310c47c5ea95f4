"""Byte sizes: parse ``512MiB`` / ``6GB`` from configs and print ``1.5GiB`` in reports (a leaf module)."""

from __future__ import annotations

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
