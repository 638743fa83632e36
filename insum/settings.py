"""insum's switches in the environment, read on every call and cheaply.

A user may change `TRITON_INTERPRET`, `INSUM_AUTOTUNE`, `INSUM_CHECK_INDICES`, `INSUM_TMA`,
`INSUM_DIRECT_LAUNCH`, `INSUM_STAGE` or `INSUM_WIDEN` between calls, so the launch path reads them each time (a repeated
call compares one `snapshot()` of them all with the one it was prepared under); `os.environ.get` costs about 1 µs a
read (key encoding through the Mapping interface), several times per cached call. On POSIX,
`os.environ` keeps its encoded items in a plain dict that every assignment through it
updates, so a switch is one dict lookup there.

    >>> import os
    >>> os.environ["INSUM_EXAMPLE_SWITCH"] = "0"; flag("INSUM_EXAMPLE_SWITCH", default=True)
    False
"""

from __future__ import annotations

import os

__all__ = ["flag", "snapshot", "SWITCHES"]

# CPython's encoded mapping behind os.environ (bytes keys and values on POSIX).
_ENCODED = getattr(os.environ, "_data", None) if os.name == "posix" else None
_OFF = (b"", b"0")


#: Every switch a call reads: a call prepared under one setting of them repeats only under it.
SWITCHES = (
    "TRITON_INTERPRET", "INSUM_AUTOTUNE", "INSUM_CHECK_INDICES", "INSUM_TMA", "INSUM_DIRECT_LAUNCH", "INSUM_STAGE",
    "INSUM_WIDEN",
)
_ENCODED_SWITCHES = tuple(name.encode() for name in SWITCHES)


def snapshot() -> tuple:
    """The raw values of every switch in `SWITCHES` (None where unset), compared, not parsed:
    a prepared call checks with one tuple comparison that none has changed."""
    if _ENCODED is not None:
        return tuple(map(_ENCODED.get, _ENCODED_SWITCHES))
    return tuple(os.environ.get(name) for name in SWITCHES)


def flag(name: str, default: bool) -> bool:
    """Whether the environment switches `name` on: unset gives `default`, "" and "0" are off."""
    if _ENCODED is not None:
        raw = _ENCODED.get(name.encode())
        return default if raw is None else raw not in _OFF
    text = os.environ.get(name)
    return default if text is None else text not in ("", "0")

