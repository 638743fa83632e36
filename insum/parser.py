"""parse(text) -> Statement, with syntax errors that point at the column."""

from __future__ import annotations

import math
from pathlib import Path

import lark

from .cache import memoize
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
    def __init__(self):
        super().__init__()
        self.written: dict[str, lark.Token] = {}  # variable -> its first token in the text

    def statement(self, items):
        output, op, product, sign, addend = items
        if sign is not None:
            _check_addend(output, sign, addend)
        stmt = Statement(output, str(op), tuple(product), addend)
        kept = set(stmt.variables())
        for name, token in self.written.items():
            if name not in kept:
                # `O[0] += A[i - i]`: the terms fold away and nothing gives `i` an extent.
                raise _BadToken(token, f"variable '{name}' cancels out of every index it appears in")
        return stmt

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
        return (_int(items[1]), items[0])

    def scaled_term_left(self, items):
        return (_int(items[0]), items[1])

    def constant_term(self, items):
        return _int(items[0])

    def variable(self, items):
        self.written.setdefault(str(items[0]), items[0])
        return Var(str(items[0]))

    def indirect(self, items):
        name, indices = items
        return Access(str(name), tuple(indices or ()))


def _check_addend(output: Access, sign, addend: Access) -> None:
    """An addend is added once per output element: `+`, an output of distinct plain
    variables (one owner per element), and no variable of its own."""
    if str(sign) != "+":
        raise _BadToken(sign, "the term after the product is added with '+' (write a negative term as its own tensor)")
    variables = [index.variable for index in output.indices]
    if any(v is None for v in variables) or len(set(variables)) != len(variables):
        raise _BadToken(
            sign,
            f"an added term needs an output indexed by distinct plain variables (each element "
            f"written once), not {output}",
        )
    extra = [v for v in addend.variables() if v not in variables]
    if extra:
        raise _BadToken(
            sign, f"the added term {addend} uses {', '.join(extra)}, which the output {output} does not index"
        )


def _negate(part):
    if isinstance(part, int):
        return -part
    coef, atom = part
    return (-coef, atom)


class _BadToken(Exception):
    """A token that lexes but means nothing (raised inside the transformer): a literal out of
    range, a variable that cancels out."""

    def __init__(self, token, reason: str):
        super().__init__(reason)
        self.token, self.reason = token, reason


def _int(token) -> int:
    digits = str(token).lstrip("0") or "0"
    if len(digits) > 19 or int(digits) >= 2**63:
        raise _BadToken(token, f"integer {_short(token)} out of range (at most 2**63 - 1)")
    return int(digits)


def _number(token) -> int | float:
    text = str(token)
    value = float(text)
    if not math.isfinite(value):
        raise _BadToken(token, f"number {_short(token)} out of range for a float")
    return value if any(c in text for c in ".eE") else int(text.lstrip("0") or "0")


def _short(token) -> str:
    text = str(token)
    return text if len(text) <= 24 else text[:20] + "..."


@memoize
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
        # accepts() follows the pending reductions; e.expected is the raw LALR state's
        # set, which after `X[i]` on the right wrongly lists '+=' and misses the end.
        accepted = e.interactive_parser.accepts() if e.interactive_parser else e.expected
        expected = sorted({_EXPECTED_WORDS.get(t, repr(t)) for t in accepted})
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
    try:
        return _ToIR().transform(tree)
    except lark.exceptions.VisitError as e:
        if isinstance(e.orig_exc, _BadToken):
            token = e.orig_exc.token
            raise InsumSyntaxError(e.orig_exc.reason, text, token.line, token.column) from None
        raise


def _end_position(text: str) -> tuple[int, int]:
    lines = text.split("\n")  # as the lexer counts lines
    return len(lines), len(lines[-1]) + 1
