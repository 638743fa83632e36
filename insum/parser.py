"""parse(text) -> Statement, with syntax errors that point at the column."""

from __future__ import annotations

import functools
from pathlib import Path

import lark

from .errors import InsumSyntaxError
from .ir import Access, Index, Literal, Statement, Var

__all__ = ["parse"]

_GRAMMAR = (Path(__file__).parent / "grammar.lark").read_text()
_PARSER = lark.Lark(_GRAMMAR, start="statement", parser="lalr", maybe_placeholders=True)

# What the parser expected, in words, for the common mistakes.
_EXPECTED_WORDS = {
    "ASSIGN": "'+=' or '='",
    "NAME": "a name",
    "INT": "an integer",
    "NUMBER": "a number",
    "RSQB": "']'",
    "LSQB": "'['",
    "COMMA": "','",
    "STAR": "'*'",
    "SIGN": "'+' or '-'",
    "MINUS": "'-'",
    "$END": "end of statement",
}


class _ToIR(lark.Transformer):
    def statement(self, items):
        output, op, product = items
        return Statement(output, str(op), tuple(product))

    def product(self, factors):
        return factors

    def literal(self, items):
        return Literal(_number(items[0]))

    def negative_literal(self, items):
        return Literal(-_number(items[0]))

    def access(self, items):
        name, indices = items
        return Access(str(name), tuple(indices or ()))

    def scalar_access(self, items):
        return Access(str(items[0]), ())

    def indices(self, items):
        return items

    def index(self, items):
        parts: list = [items[0]]
        for sign, term in zip(items[1::2], items[2::2]):
            parts.append(_negate(term) if str(sign) == "-" else term)
        return Index.of(*parts)

    def negated_term(self, items):
        return _negate(items[0])

    def unit_term(self, items):
        return (1, items[0])

    def scaled_term(self, items):
        return (int(items[1]), items[0])

    def scaled_term_left(self, items):
        return (int(items[0]), items[1])

    def constant_term(self, items):
        return int(items[0])

    def variable(self, items):
        return Var(str(items[0]))

    def indirect(self, items):
        name, indices = items
        return Access(str(name), tuple(indices or ()))


def _negate(part):
    if isinstance(part, int):
        return -part
    coef, atom = part
    return (-coef, atom)


def _number(token) -> int | float:
    text = str(token)
    return float(text) if any(c in text for c in ".eE") else int(text)


@functools.lru_cache(maxsize=1024)
def parse(text: str) -> Statement:
    """Parse one indirect-Einsum statement.

    >>> str(parse("C[AM[p],n] += AV[p,q]*B[AK[p,q],n]"))
    'C[AM[p], n] += AV[p, q] * B[AK[p, q], n]'
    """
    if not isinstance(text, str):
        raise TypeError(f"an insum statement is a str, not {type(text).__name__}")
    try:
        tree = _PARSER.parse(text)
    except lark.exceptions.UnexpectedCharacters as e:
        raise InsumSyntaxError(
            f"unexpected character {text[e.pos_in_stream]!r}", text, e.line, e.column
        ) from None
    except lark.exceptions.UnexpectedToken as e:
        expected = sorted({_EXPECTED_WORDS.get(t, repr(t)) for t in e.expected})
        if e.token.type == "$END":
            line, column = _end_position(text)
            found = "end of statement"
        else:
            line, column, found = e.line, e.column, repr(str(e.token))
        raise InsumSyntaxError(
            f"unexpected {found}, expected {' or '.join(expected)}", text, line, column
        ) from None
    except lark.exceptions.UnexpectedEOF:
        line, column = _end_position(text)
        raise InsumSyntaxError("unexpected end of statement", text, line, column) from None
    return _ToIR().transform(tree)


def _end_position(text: str) -> tuple[int, int]:
    lines = text.splitlines() or [""]
    if text.endswith("\n"):
        return len(lines) + 1, 1
    return len(lines), len(lines[-1]) + 1
