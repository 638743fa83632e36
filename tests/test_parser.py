"""The language: every form the grammar accepts, the IR it builds, printing it back, and
syntax errors that point at the line and column. No tensors, no device."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from statements import CASES

from insum import InsumError, InsumSyntaxError, parse
from insum.ir import Access, Index, Literal, Statement, Term, Var

# ---------------------------------------------------------------- IR builders


def ix(*parts) -> Index:
    """An index from atoms, `(coef, atom)` pairs and ints; a str is a variable."""

    def atom(a):
        return Var(a) if isinstance(a, str) else a

    return Index.of(*(p if isinstance(p, int) else (p[0], atom(p[1])) if isinstance(p, tuple) else atom(p) for p in parts))


def acc(name: str, *indices) -> Access:
    """An access; each index is an Index, or a str naming a variable, or an int."""
    return Access(name, tuple(i if isinstance(i, Index) else ix(i) for i in indices))


# ---------------------------------------------------------------- accepted forms

SPMM = Statement(
    acc("C", ix(acc("AM", "p")), "n"),
    "+=",
    (acc("AV", "p", "q"), acc("B", ix(acc("AK", "p", "q")), "n")),
)

FORMS = [
    # (id, text, expected IR)
    ("group_coo", "C[AM[p],n] += AV[p,q] * B[AK[p,q],n]", SPMM),
    ("spaces_everywhere", "  C [ AM [ p ] , n ]  +=  AV [ p , q ] * B [ AK [ p , q ] , n ]  ", SPMM),
    ("newlines_tabs", "C[AM[p],\n n]\t+=\n\tAV[p, q]\n * B[AK[p, q], n]\n", SPMM),
    ("overwrite", "O[p] = X[AM[p], k] * Y[AK[p], k]",
     Statement(acc("O", "p"), "=", (acc("X", ix(acc("AM", "p")), "k"), acc("Y", ix(acc("AK", "p")), "k")))),
    ("scalar_output_bare", "S = X[i] * Y[i]", Statement(acc("S"), "=", (acc("X", "i"), acc("Y", "i")))),
    ("scalar_output_brackets", "S[] += X[i]", Statement(acc("S"), "+=", (acc("X", "i"),))),
    ("scalar_factor_bare", "C[i] += s * X[i]", Statement(acc("C", "i"), "+=", (acc("s"), acc("X", "i")))),
    ("scalar_factor_brackets", "C[i] += s[] * X[i]", Statement(acc("C", "i"), "+=", (acc("s"), acc("X", "i")))),
    ("int_literal_index", "O[n] += X[1, n] * Y[0, n]",
     Statement(acc("O", "n"), "+=", (acc("X", ix(1), "n"), acc("Y", ix(0), "n")))),
    ("affine_right_coef", "C[AK[p]*32 + k] += X[p, k]",
     Statement(acc("C", ix((32, acc("AK", "p")), "k")), "+=", (acc("X", "p", "k"),))),
    ("affine_left_coef", "C[32*AK[p] + k] += X[p, k]",
     Statement(acc("C", ix((32, acc("AK", "p")), "k")), "+=", (acc("X", "p", "k"),))),
    ("plus_one", "D[i] += X[i + 1]", Statement(acc("D", "i"), "+=", (acc("X", ix("i", 1)),))),
    ("minus_one", "D[i] += X[i - 1]", Statement(acc("D", "i"), "+=", (acc("X", ix("i", -1)),))),
    ("constant_first", "D[i] += X[1 + i]", Statement(acc("D", "i"), "+=", (acc("X", ix("i", 1)),))),
    ("negative_first_term", "D[i] += X[-i + 3]", Statement(acc("D", "i"), "+=", (acc("X", ix((-1, "i"), 3)),))),
    ("negative_scaled_term", "D[i] += X[3 - 2*i - AK[i]*4]",
     Statement(acc("D", "i"), "+=", (acc("X", ix((-2, "i"), (-4, acc("AK", "i")), 3)),))),
    ("negative_constant_only", "D[i] += X[i, -2]", Statement(acc("D", "i"), "+=", (acc("X", "i", ix(-2)),))),
    ("terms_fold", "D[i] += X[i + i - 2*j + j + 2 - 1]",
     Statement(acc("D", "i"), "+=", (acc("X", ix((2, "i"), (-1, "j"), 1)),))),
    ("terms_cancel", "D[i, j] += X[i - i + j]", Statement(acc("D", "i", "j"), "+=", (acc("X", "j"),))),
    ("nested_indirect", "E[i, d] += W[V[I[i]], d]",
     Statement(acc("E", "i", "d"), "+=", (acc("W", ix(acc("V", ix(acc("I", "i")))), "d"),))),
    ("indirect_scalar_index", "E[d] += W[K[], d]", Statement(acc("E", "d"), "+=", (acc("W", ix(acc("K")), "d"),))),
    ("literal_only", "C[i] = 2", Statement(acc("C", "i"), "=", (Literal(2),))),
    ("underscore_digits_names", "out_1[_i, j2] += X_[_i] * y9[j2]",
     Statement(acc("out_1", "_i", "j2"), "+=", (acc("X_", "_i"), acc("y9", "j2")))),
]


@pytest.mark.parametrize("text, expected", [f[1:] for f in FORMS], ids=[f[0] for f in FORMS])
def test_accepted_forms(text, expected):
    assert parse(text) == expected


@pytest.mark.parametrize(
    "text, value",
    [
        ("2", 2),
        ("-3", -3),
        ("0.5", 0.5),
        ("-0.5", -0.5),
        (".25", 0.25),
        ("2.", 2.0),
        ("1e3", 1000.0),
        ("1E-2", 0.01),
        ("-2.5e+2", -250.0),
        ("- 4", -4),
        ("007", 7),
        ("12345678901234567890123", 12345678901234567890123),
    ],
)
def test_numeric_literal_factors(text, value):
    stmt = parse(f"C[i] += {text} * X[i]")
    (literal, access) = stmt.factors
    assert literal == Literal(value)
    assert type(literal.value) is type(value)
    assert access == acc("X", "i")


def test_several_literals_keep_their_order():
    stmt = parse("C[m, n] += 0.5 * A[m, k] * B[k, n] * -2 * 1.5e-1")
    assert [f.value for f in stmt.factors if isinstance(f, Literal)] == [0.5, -2, 0.15]
    assert [f.name for f in stmt.accesses()] == ["A", "B"]


def test_statement_properties():
    assert SPMM.accumulate and not parse("C[i] = X[i]").accumulate
    assert SPMM.variables() == ("p", "n", "q")  # output first, in order of appearance
    assert [a.name for a in SPMM.accesses()] == ["AV", "B"]
    index = SPMM.output.indices[0]
    assert not index.is_direct and index.variable is None
    assert index.indirect_accesses() == (acc("AM", "p"),)
    assert SPMM.output.indices[1].variable == "n"
    assert ix((2, "i")).variable is None and ix("i", 1).variable is None


def test_added_term_is_kept_apart_from_the_product():
    """`product + D[...]`: the addend is no factor (the product's accesses leave it out), but
    it is read (walk), and it is part of the statement's identity."""
    stmt = parse("C[m, n] = A[m, k] * B[k, n] + D[m]")
    assert stmt.addend == acc("D", "m")
    assert [a.name for a in stmt.accesses()] == ["A", "B"]
    assert [a.name for a, _ in stmt.walk()] == ["C", "A", "B", "D"]
    assert stmt != parse("C[m, n] = A[m, k] * B[k, n]")
    assert hash(stmt) != hash(parse("C[m, n] = A[m, k] * B[k, n] + D[n]"))


def test_non_string_is_a_type_error():
    with pytest.raises(TypeError, match="str"):
        parse(b"C[i] += X[i]")


# ---------------------------------------------------------------- printing back


@pytest.mark.parametrize(
    "text, printed",
    [
        ("C[AM[p],n]+=AV[p,q]*B[AK[p,q],n]", "C[AM[p], n] += AV[p, q] * B[AK[p, q], n]"),
        ("S = X[i]*Y[i]", "S[] = X[i] * Y[i]"),
        ("C[32*AK[p] + k] += X[p,k]", "C[AK[p]*32 + k] += X[p, k]"),
        ("D[i] += X[3 - i]", "D[i] += X[-i + 3]"),
        ("D[i] += X[i - 1] * -2.5e-3", "D[i] += X[i - 1] * -0.0025"),
        ("D[i] += X[-2*i - AK[i] - 1]", "D[i] += X[-i*2 - AK[i] - 1]"),
        ("D[i] += X[i - i]", "D[i] += X[0]"),
        ("C[p,m,n] = AV[p,q,m,k]*B[AK[p,q],k,n]+D[p,m]", "C[p, m, n] = AV[p, q, m, k] * B[AK[p, q], k, n] + D[p, m]"),
        ("C[m,n] += 2*A[m,k]*B[k,n] + S", "C[m, n] += 2 * A[m, k] * B[k, n] + S[]"),
    ],
)
def test_str_prints_the_statement(text, printed):
    assert str(parse(text)) == printed


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_round_trip_curated(case):
    stmt = parse(case.stmt)
    assert parse(str(stmt)) == stmt
    assert str(parse(str(stmt))) == str(stmt)


@pytest.mark.parametrize("form", FORMS, ids=[f[0] for f in FORMS])
def test_round_trip_forms(form):
    stmt = parse(form[1])
    assert parse(str(stmt)) == stmt


# ---------------------------------------------------------------- syntax errors


SYNTAX_ERRORS = [
    # (id, text, line, column, a fragment of the reason)
    ("missing_op", "C[i] X[i]", 1, 6, "unexpected 'X', expected '+=' or '='"),
    ("double_equals", "C[i] == X[i]", 1, 7, "unexpected '='"),
    ("minus_equals", "C[i] -= X[i]", 1, 6, "unexpected '-'"),
    ("times_equals", "C[i] *= X[i]", 1, 6, "unexpected '*'"),
    ("unclosed_bracket", "C[i += X[i]", 1, 6, "unexpected '='"),
    ("empty_rhs", "C[i] +=", 1, 8, "unexpected end of statement"),
    ("trailing_star", "C[i] += X[i]*", 1, 14, "unexpected end of statement"),
    ("bad_character", "C[i] += X[i] @ Y[i]", 1, 14, "unexpected character '@'"),
    ("semicolon", "C[i] += X[i]; D[i] += X[i]", 1, 13, "unexpected character ';'"),
    ("parenthesis", "C[i] += X[(i)]", 1, 11, "unexpected character '('"),
    ("product_of_variables", "C[i*j] += X[i]", 1, 5, "unexpected 'j', expected an integer"),
    ("product_of_integers", "C[i] += X[2*3]", 1, 13, "unexpected '3', expected a name"),
    ("sum_of_products", "C[i] += X[i] * Y[i] + Z[i] * W[i]", 1, 28, "unexpected '*', expected end of statement"),
    ("two_addends", "C[i] += X[i] + Y[i] + Z[i]", 1, 21, "unexpected '+', expected end of statement"),
    ("subtracted_term", "C[i] += X[i, j] - Y[i]", 1, 17, "added with '+'"),
    ("addend_under_scatter", "C[I[p]] += X[p] + Y[p]", 1, 17, "distinct plain variables"),
    ("addend_repeated_output_variable", "C[i, i] = X[i] + Y[i]", 1, 16, "distinct plain variables"),
    ("addend_own_variable", "C[i] = X[i, j] + Y[j]", 1, 16, "uses j, which the output"),
    ("juxtaposed_factors", "C[i] += X[i] Y[i]", 1, 14, "unexpected 'Y'"),
    ("extra_bracket", "C[i] += X[i]]", 1, 13, "unexpected ']'"),
    ("trailing_comma", "C[i,] += X[i]", 1, 5, "unexpected ']'"),
    ("double_minus", "C[i] += X[--i]", 1, 12, "unexpected '-'"),
    ("negated_access", "C[i] += X[i] * -Y[i]", 1, 17, "unexpected 'Y', expected a number"),
    ("float_index", "C[1.5] += X[i]", 1, 4, "unexpected"),
    ("number_as_name", "1[i] += X[i]", 1, 1, "unexpected '1', expected a name"),
    ("missing_lhs", "+= X[i]", 1, 1, "expected a name"),
    ("empty", "", 1, 1, "unexpected end of statement"),
    ("blank", "   ", 1, 4, "unexpected end of statement"),
    ("newline_only", "\n", 2, 1, "unexpected end of statement"),
    ("end_after_newline", "C[i] += \n", 2, 1, "unexpected end of statement"),
    ("multiline_token", "C[i]\n  += X[i] *\n  * Y[i]", 3, 3, "unexpected '*'"),
    ("multiline_character", "C[i] +=\n  X[i] *\n  Y[i] $", 3, 8, "unexpected character '$'"),
    ("multiline_end", "C[i] +=\n  X[i\n", 3, 1, "unexpected end of statement"),
    ("float_overflow", "C[i] += 1e400 * X[i]", 1, 9, "out of range"),
    ("negative_float_overflow", "C[i] +=\n -1e999 * X[i]", 2, 3, "out of range"),
    ("integer_overflow_index", "C[i] += X[9223372036854775808]", 1, 11, "out of range"),
    ("integer_overflow_coef", "C[i] += X[i*99999999999999999999]", 1, 13, "out of range"),
    ("huge_integer", "C[i] += X[" + "1" * 5000 + "]", 1, 11, "out of range"),
    ("huge_literal", "C[i] += " + "7" * 5000 + " * X[i]", 1, 9, "out of range"),
]


@pytest.mark.parametrize(
    "text, line, column, reason", [e[1:] for e in SYNTAX_ERRORS], ids=[e[0] for e in SYNTAX_ERRORS]
)
def test_syntax_error_points_at_the_column(text, line, column, reason):
    with pytest.raises(InsumSyntaxError) as info:
        parse(text)
    err = info.value
    assert (err.line, err.column) == (line, column)
    assert err.text == text and reason in err.reason
    assert isinstance(err, InsumError) and isinstance(err, ValueError)
    head, source, caret = str(err).split("\n")
    assert head == f"{err.reason} at line {line}, column {column}"
    assert source == "  " + text.split("\n")[line - 1]
    assert caret == "  " + " " * (column - 1) + "^"


def test_caret_follows_tabs():
    text = "C[i] +=\tX[\ti\t@]"
    with pytest.raises(InsumSyntaxError) as info:
        parse(text)
    caret = str(info.value).split("\n")[-1]
    assert caret == "  " + "       \t  \t \t^"
    assert len(caret) - 2 == info.value.column


def test_largest_integer_is_accepted():
    assert parse("C[i] += X[9223372036854775807]").factors[0] == acc("X", ix(2**63 - 1))


# ---------------------------------------------------------------- property tests

_NAME = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,3}", fullmatch=True)
_VAR = _NAME.map(Var)
_INT64 = st.integers(-(2**63) + 1, 2**63 - 1)
_COEF = st.one_of(st.integers(-40, 40), st.integers(-(2**61), 2**61))  # 3 merged stay int64


def _accesses(depth: int):
    if depth == 0:
        atoms = _VAR
    else:
        atoms = st.one_of(_VAR, st.deferred(lambda: _accesses(depth - 1)))
    parts = st.lists(st.one_of(atoms, st.tuples(_COEF, atoms)), max_size=3)
    index = st.builds(lambda ps, c: Index.of(*ps, c), parts, st.one_of(st.just(0), _INT64))
    return st.builds(Access, _NAME, st.lists(index, max_size=3).map(tuple))


_LITERALS = st.one_of(
    st.integers(-(10**30), 10**30), st.floats(allow_nan=False, allow_infinity=False)
).map(Literal)
_STATEMENTS = st.builds(
    Statement,
    _accesses(2),
    st.sampled_from(["+=", "="]),
    st.lists(st.one_of(_accesses(2), _LITERALS), min_size=1, max_size=4).map(tuple),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_STATEMENTS)
def test_round_trip_random_ir(stmt):
    """Any normalised IR prints to text that parses back to it."""
    assert parse(str(stmt)) == stmt


@st.composite
def _with_addend(draw) -> Statement:
    """A statement with an added term: an output of distinct plain variables, and a term
    whose indices (affine, or gathers) use only those variables."""
    names = draw(st.lists(st.from_regex(r"[a-z][a-z0-9]{0,2}", fullmatch=True), min_size=0, max_size=3, unique=True))
    variables = [Var(n) for n in names]
    output = Access(draw(_NAME), tuple(Index.of(v) for v in variables))
    if variables:
        atom = st.sampled_from(variables)
        atom = st.one_of(atom, st.builds(lambda v: Access("G", (Index.of(v),)), atom))  # a gather
        parts = st.lists(st.one_of(atom, st.tuples(_COEF, atom)), max_size=3)
        index = st.builds(lambda ps, c: Index.of(*ps, c), parts, st.one_of(st.just(0), _INT64))
    else:
        index = _INT64.map(lambda c: Index.of(c))
    addend = Access(draw(_NAME), tuple(draw(st.lists(index, max_size=3))))
    factors = tuple(draw(st.lists(st.one_of(_accesses(1), _LITERALS), min_size=1, max_size=3)))
    return Statement(output, draw(st.sampled_from(["+=", "="])), factors, addend)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_with_addend())
def test_round_trip_random_ir_with_an_added_term(stmt):
    """A statement with an added term prints to text that parses back to it."""
    assert parse(str(stmt)) == stmt


_GAP = st.sampled_from(["", " ", "  ", "\n", "\t", " \n "])


def _spell(data, stmt: Statement) -> str:
    """Print `stmt` with random whitespace and equivalent spellings of each construct."""
    tokens: list[str] = []

    def access(a: Access, scalar_bare_ok: bool):
        tokens.append(a.name)
        if a.indices or not scalar_bare_ok or data.draw(st.booleans()):
            tokens.append("[")
            for k, index in enumerate(a.indices):
                if k:
                    tokens.append(",")
                affine(index)
            tokens.append("]")

    def affine(index: Index):
        const_first = index.const != 0 and data.draw(st.booleans())
        first = True
        if const_first or not index.terms:
            tokens.extend(["-", str(-index.const)] if index.const < 0 else [str(index.const)])
            first = False
        for term in index.terms:
            sign, magnitude = ("-" if term.coef < 0 else "+"), abs(term.coef)
            if not first or sign == "-":
                tokens.append(sign)
            first = False
            style = data.draw(st.sampled_from(["left", "right"] + (["bare"] if magnitude == 1 else [])))
            if style == "left":
                tokens.extend([str(magnitude), "*"])
            atom = term.atom
            access(atom, False) if isinstance(atom, Access) else tokens.append(atom.name)
            if style == "right":
                tokens.extend(["*", str(magnitude)])
        if index.terms and index.const and not const_first:
            tokens.extend(["-" if index.const < 0 else "+", str(abs(index.const))])

    access(stmt.output, True)
    tokens.append(stmt.op)
    for k, factor in enumerate(stmt.factors):
        if k:
            tokens.append("*")
        if isinstance(factor, Literal):
            tokens.append(repr(factor.value))
        else:
            access(factor, True)
    return "".join(t + data.draw(_GAP) for t in tokens)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_STATEMENTS, st.data())
def test_random_spellings_parse_to_the_same_ir(stmt, data):
    """`32*x` / `x*32` / `x`, `S` / `S[]`, constants first or last, any whitespace."""
    text = _spell(data, stmt)
    assert parse(text) == stmt, text


_GRAMMAR_CHARS = st.sampled_from(list("CABpqn_9[],+=-*.0123eE \n\t()@;"))


@settings(max_examples=1000, deadline=None)
@given(st.one_of(st.text(_GRAMMAR_CHARS, max_size=40), st.text(max_size=40)))
def test_random_text_raises_only_syntax_errors(text):
    try:
        stmt = parse(text)
    except InsumSyntaxError as err:
        assert err.line >= 1 and err.column >= 1
        assert str(err).endswith("^")
    else:
        assert isinstance(stmt, Statement)
        assert parse(str(stmt)) == stmt


def test_term_prints_magnitude_only():
    # The sign of a term is printed by its Index, so Term alone prints |coef|.
    assert str(Term(-3, Var("i"))) == "i*3" and str(Term(1, Var("i"))) == "i"
