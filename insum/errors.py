"""The error hierarchy. Every error is an `InsumError`, itself a `ValueError`."""

from __future__ import annotations

__all__ = [
    "InsumError",
    "InsumSyntaxError",
    "InsumShapeError",
    "InsumTypeError",
    "InsumIndexError",
    "UnsupportedStatement",
]


class InsumError(ValueError):
    """Any problem with an insum statement or the tensors bound to it."""


class InsumSyntaxError(InsumError):
    """The statement does not parse; points at the offending column with a caret."""

    def __init__(self, reason: str, text: str, line: int, column: int):
        self.reason = reason
        self.text = text
        self.line = line
        self.column = column
        lines = text.split("\n")  # lines as the lexer counts them: only "\n" ends one
        source_line = lines[line - 1] if 0 < line <= len(lines) else ""
        caret = "".join(c if c == "\t" else " " for c in source_line[: column - 1]) + "^"
        super().__init__(f"{reason} at line {line}, column {column}\n  {source_line}\n  {caret}")


class InsumShapeError(InsumError):
    """Ranks, extents or output shapes disagree; names the tensor, dimension and sizes."""


class InsumTypeError(InsumError):
    """A tensor has the wrong dtype or device for its role (e.g. a float index)."""


class InsumIndexError(InsumError):
    """An index value is out of range for the dimension it addresses."""


class UnsupportedStatement(InsumError):
    """The generated-kernel backend cannot run this statement here (`backend="auto"` falls
    back to the torch lowering with one warning; `backend="triton"` raises it)."""
