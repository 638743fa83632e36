"""Every format class by name: filled as the format modules are imported."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import InsumError

if TYPE_CHECKING:
    from .base import SparseFormat

__all__ = ["FORMATS", "format_class"]

#: Every format class by its lower-case name; filled as the format modules are imported.
FORMATS: dict[str, type[SparseFormat]] = {}


def format_class(name: str) -> type[SparseFormat]:
    """Look a format up by name, case-insensitively, listing the valid names when unknown.

    >>> import insum.formats
    >>> format_class("GroupCOO").__name__
    'GroupCOO'
    """
    try:
        return FORMATS[name.lower()]
    except KeyError:
        raise InsumError(f"unknown format {name!r}; choose one of {', '.join(FORMATS)}") from None
