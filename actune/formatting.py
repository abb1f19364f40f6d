"""Sizes and what stayed exact, in words: shared by the library's statistics and the reports."""

from __future__ import annotations

__all__ = ["describe_exact", "human_bytes"]


def human_bytes(n: int | float | None) -> str:
    """``1536`` -> ``1.5 KiB``; None -> ``-``."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover


def describe_exact(kept: dict, top: int = 3) -> str:
    """``{"cross_entropy": 80 MiB, ...}`` -> ``"kept exact: 80.0 MiB (cross_entropy 80.0)"``."""
    parts = sorted(kept.items(), key=lambda kv: -kv[1])
    named = [f"{name} {human_bytes(b)}" for name, b in parts[:top]]
    if len(parts) > top:
        named.append(f"{len(parts) - top} more {human_bytes(sum(b for _, b in parts[top:]))}")
    total = human_bytes(sum(kept.values()))
    return f"kept exact: {total}" + (f" ({', '.join(named)})" if named else "")
