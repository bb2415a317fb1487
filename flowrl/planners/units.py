"""Short human forms of the planner's quantities: seconds, bytes and device-id ranges."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["format_seconds", "format_bytes", "device_ranges"]


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


def device_ranges(ids: Sequence[int]) -> str:
    """``[0, 1, 2, 3, 8, 9, 11]`` -> ``"0-3,8-9,11"`` (ids in the order given).

    Example:
        >>> device_ranges(range(8))
        '0-7'
    """
    if isinstance(ids, range) and ids.step == 1 and len(ids):
        return f"{ids.start}-{ids.stop - 1}" if len(ids) > 1 else f"{ids.start}"
    parts: list[str] = []
    start = prev = None
    for d in ids:
        if start is None:
            start = prev = d
        elif d == prev + 1:  # type: ignore[operator]
            prev = d
        else:
            parts.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = d
    if start is not None:
        parts.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ",".join(parts)
