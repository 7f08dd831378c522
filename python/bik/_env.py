"""bik's boolean environment variables, read by one parser (issue 50): 1 / 0, true / false,
yes / no, on / off, in any case; unset or empty gives the variable's default; anything else is
an error naming the variable, never a silent guess (``BIK_ENABLE_NATIVE=false`` once kept the C++
kernels on). Imports nothing but the standard library: setup.py loads it by path."""

from __future__ import annotations

import os

__all__ = ["flag"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def flag(name: str, default: bool = False) -> bool:
    """The boolean environment variable ``name`` (``default`` when unset or empty)."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"bik: {name}={raw!r} is not a boolean; use 1/0, true/false, yes/no or "
                     f"on/off (or leave it unset: {'on' if default else 'off'})")
