"""Short human forms of the planner's quantities: seconds and bytes (device-id ranges: ``flowrl.placement.device_ranges``).

Memory messages compare what a node needs with what a device has; ``format_gib_pair`` and
``format_excess`` print them so that rounding never hides the difference (no "72.0 GiB ... has
72.0 GiB, 0.0 GiB over").
"""

from __future__ import annotations

__all__ = ["format_seconds", "format_bytes", "format_gib_pair", "format_excess"]


def format_seconds(t: float) -> str:
    """``0.0123`` -> ``"12.3 ms"``; three significant digits, unit chosen to fit."""
    if t == 0:
        return "0 s"
    if t < 1e-3:
        return f"{t * 1e6:.3g} us"
    if t < 1:
        return f"{t * 1e3:.3g} ms"
    return f"{t:.3g} s"


def format_bytes(nbytes: float) -> str:
    """Bytes in GiB (from 1 GiB up) or MiB."""
    if nbytes >= 1024**3:
        return f"{nbytes / 1024**3:.1f} GiB"
    return f"{nbytes / 1024**2:.1f} MiB"


def format_gib_pair(a: float, b: float) -> tuple[str, str]:
    """Two byte counts in GiB with the fewest decimals (1 to 4) that tell them apart.

    Example:
        >>> format_gib_pair(72.01 * 1024**3, 72.0 * 1024**3)
        ('72.01 GiB', '72.00 GiB')
        >>> format_gib_pair(80 * 1024**3, 72 * 1024**3)
        ('80.0 GiB', '72.0 GiB')
    """
    for decimals in range(1, 5):
        left, right = f"{a / 1024**3:.{decimals}f}", f"{b / 1024**3:.{decimals}f}"
        if left != right or a == b:
            break
    return f"{left} GiB", f"{right} GiB"


def format_excess(nbytes: float) -> str:
    """How far over a budget, three significant digits in a unit that never shows it as zero.

    Example:
        >>> format_excess(0.004 * 1024**3), format_excess(1.234 * 1024**3), format_excess(300)
        ('4.1 MiB', '1.23 GiB', '300 bytes')
    """
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2)):
        if nbytes >= 0.1 * size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{max(0, round(nbytes)):,} bytes"
