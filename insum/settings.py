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

from .errors import InsumError

__all__ = ["flag", "snapshot", "SWITCHES"]

# CPython's encoded mapping behind os.environ (bytes keys and values on POSIX).
_ENCODED = getattr(os.environ, "_data", None) if os.name == "posix" else None
#: A switch's spellings, as Triton reads its own (TRITON_INTERPRET among them); others raise.
_ON = frozenset((b"1", b"true", b"yes", b"on", b"y"))
_OFF = frozenset((b"", b"0", b"false", b"no", b"off", b"n"))


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
    """Whether the environment switches `name` on: unset gives `default`; 1, true, yes, on
    (any case) are on, 0, false, no, off and "" off; anything else raises (INSUM_AUTOTUNE=false
    read as on before)."""
    if _ENCODED is not None:
        raw = _ENCODED.get(name.encode())
    else:
        text = os.environ.get(name)
        raw = None if text is None else text.encode()
    if raw is None:
        return default
    if raw in _OFF:  # (the usual spellings first: one set lookup)
        return False
    if raw in _ON:
        return True
    word = raw.strip().lower()
    if word in _OFF or word in _ON:
        return word in _ON
    raise InsumError(
        f"{name}={raw.decode(errors='replace')!r}: a switch is 1, true, yes or on, or 0, false, no, off or empty"
    )

