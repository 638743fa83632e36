"""Random valid statements against a naive loop oracle (independent of `insum.reference`).

Each statement is drawn from a seeded generator: tensors of rank 0-3, variables shared
between factors, plain, affine (`i + j`, `2*i - 1`), literal and indirect (`I[p]*2 + k`)
indices, nested gathers, literal factors, `+=` and `=`, outputs passed or allocated, int32
and int64 index tensors, non-contiguous value tensors. The oracle loops over every
assignment of the variables in plain Python and numpy. A failing seed prints its statement;
minimised failures live in `tests/statements.py` (and in `test_reliability.py`).

    python -m pytest tests/test_fuzz.py -k "torch and 17"     # one seed
"""

from __future__ import annotations

import itertools
import os
import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from insum import insum

TORCH_SEEDS = range(500)
TRITON_SEEDS = range(100)
VARIABLES = "ijkl"


@dataclass
class Drawn:
    stmt: str
    tensors: dict[str, torch.Tensor]
    needs_out: bool


class _Draw:
    """Build one random statement and tensors that make every index valid."""

    def __init__(self, seed: int, dtype: torch.dtype):
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.dtype = dtype
        self.index_dtype = self.rng.choice([torch.int32, torch.int64])
        count = self.rng.choice([0, 1, 2, 2, 3, 3, 4])
        self.vars = list(VARIABLES[:count])
        self.extent = {v: self.rng.randint(1, 4) for v in self.vars}
        self.tensors: dict[str, torch.Tensor] = {}
        self.direct: set[str] = set()  # variables that index some dimension directly
        self.names = iter(f"{c}{n}" for n in ("", "2", "3") for c in "ABCDEFGH")
        self.index_names = iter(f"I{n}" for n in range(100))

    # -- indices: each returns (text, low, high) of the values it takes ----------------
    def plain(self, used: set[str]):
        free = [v for v in self.vars if v not in used]
        if not free:
            return None
        v = self.rng.choice(free)
        used.add(v)
        self.direct.add(v)
        return v, 0, self.extent[v] - 1

    def affine(self, used: set[str]):
        free = [v for v in self.vars if v not in used]
        if not free:
            return None
        chosen = self.rng.sample(free, min(len(free), self.rng.choice([1, 2])))
        terms, low, high = [], 0, 0
        for v in chosen:
            used.add(v)
            coef = self.rng.choice([1, 1, -1, 2, 3, -2])
            terms.append((coef, v))
            span = coef * (self.extent[v] - 1)
            low, high = low + min(0, span), high + max(0, span)
        const = -low + self.rng.choice([0, 0, 1, 2])
        text = ""
        for coef, v in terms:
            sign = "-" if coef < 0 else "+"
            body = v if abs(coef) == 1 else self.rng.choice([f"{v}*{abs(coef)}", f"{abs(coef)}*{v}"])
            text = (f"-{body}" if sign == "-" else body) if not text else f"{text} {sign} {body}"
        if const:
            text += f" + {const}"
        return text, low + const, high + const

    def literal(self, used: set[str]):
        value = self.rng.randint(0, 2)
        return str(value), value, value

    def indirect(self, used: set[str], depth: int = 0):
        free = [v for v in self.vars if v not in used]
        if not free:
            return None
        own = self.rng.sample(free, min(len(free), self.rng.choice([1, 1, 2])))
        for v in own:
            used.add(v)
            self.direct.add(v)
        name = next(self.index_names)
        size = self.rng.randint(1, 4)  # the values lie in [0, size)
        shape = [self.extent[v] for v in own]
        if depth == 0 and len(own) == 1 and self.rng.random() < 0.15:
            # nested: I_outer[I_inner[v]]
            inner_name = next(self.index_names)
            inner_size = self.rng.randint(1, 3)
            self.tensors[inner_name] = torch.randint(0, inner_size, shape, generator=self.gen).to(self.index_dtype)
            self.tensors[name] = torch.randint(0, size, (inner_size,), generator=self.gen).to(self.index_dtype)
            atom = f"{name}[{inner_name}[{own[0]}]]"
        else:
            self.tensors[name] = torch.randint(0, size, shape, generator=self.gen).to(self.index_dtype)
            atom = f"{name}[{', '.join(own)}]"
        coef = self.rng.choice([1, 1, 1, 2])
        text, low, high = (atom if coef == 1 else f"{atom}*{coef}"), 0, coef * (size - 1)
        extra = [v for v in self.vars if v not in used]
        if extra and self.rng.random() < 0.3:
            v = self.rng.choice(extra)
            used.add(v)
            text, high = f"{text} + {v}", high + self.extent[v] - 1
        return text, low, high

    def index(self, used: set[str], allow_indirect: bool = True):
        kinds = [self.plain] * 4 + [self.affine, self.literal] + ([self.indirect] * 2 if allow_indirect else [])
        for _ in range(6):
            got = self.rng.choice(kinds)(used)
            if got is not None:
                return got
        return self.literal(used)

    def values(self, shape) -> torch.Tensor:
        t = torch.randn(shape, generator=self.gen, dtype=torch.float64).to(self.dtype)
        if t.dim() >= 2 and self.rng.random() < 0.3:
            t = t.transpose(0, -1).contiguous().transpose(0, -1)  # non-contiguous
        return t

    def factor(self, name: str, rank: int):
        used: set[str] = set()
        dims, texts = [], []
        for _ in range(rank):
            text, low, high = self.index(used)
            texts.append(text)
            dims.append(high + 1 + (0 if text in self.vars else self.rng.choice([0, 0, 1])))
            assert low >= 0
        return f"{name}[{', '.join(texts)}]", dims

    def draw(self) -> Drawn:
        factors, shapes = [], {}
        for _ in range(self.rng.choice([1, 1, 2, 2, 3])):
            name = next(self.names)
            text, dims = self.factor(name, self.rng.choice([0, 1, 1, 2, 2, 3]))
            factors.append(text)
            shapes[name] = dims
        # The output: plain variables, or (then it must be passed) affine / indirect ones.
        from_factors = set(self.direct)
        used: set[str] = set()
        out_texts, out_dims, needs_out = [], [], False
        for _ in range(self.rng.choice([0, 1, 1, 2, 2, 3])):
            if self.rng.random() < 0.7:
                got = self.plain(used)
            else:
                got = self.index(used)
                needs_out = True
            if got is None:
                break
            text, low, high = got
            out_texts.append(text)
            out_dims.append(high + 1 + (0 if text in self.vars else self.rng.choice([0, 1])))
        pass_out = needs_out or self.rng.random() < 0.6
        # Every variable needs an extent: one that no passed tensor indexes directly gets a
        # factor of its own.
        known = self.direct if pass_out else from_factors
        for v in self.vars:
            if v not in known:
                name = next(self.names)
                factors.append(f"{name}[{v}]")
                shapes[name] = [self.extent[v]]
        if self.rng.random() < 0.2:
            factors.insert(self.rng.randint(0, len(factors)), self.rng.choice(["0.5", "2", "-1.5"]))
        for name, dims in shapes.items():
            self.tensors[name] = self.values(dims)
        op = self.rng.choice(["+=", "="])
        stmt = f"O[{', '.join(out_texts)}] {op} {' * '.join(factors)}"
        if pass_out:
            self.tensors["O"] = self.values(out_dims)
        return Drawn(stmt, self.tensors, needs_out)


# ---------------------------------------------------------------- the oracle


def _eval_index(text: str, env: dict[str, int], arrays: dict[str, np.ndarray]) -> int:
    """Evaluate an index in Python: names are variables or index arrays (`I0[i, j]`)."""
    namespace = dict(env)
    namespace.update({n: _Indexable(a) for n, a in arrays.items()})
    return int(eval(text, {"__builtins__": {}}, namespace))  # the generator's own text


class _Indexable:
    def __init__(self, array: np.ndarray):
        self.array = array

    def __getitem__(self, key):
        return int(self.array[key])


def oracle(stmt: str, tensors: dict[str, torch.Tensor]) -> np.ndarray:
    """The statement's output by looping over every assignment of its variables."""
    lhs, rhs = (stmt.split("+=") if "+=" in stmt else stmt.split("="))
    accumulate = "+=" in stmt
    arrays = {n: t.double().numpy() if t.is_floating_point() else t.long().numpy() for n, t in tensors.items()}
    variables = sorted({c for c in stmt if c in VARIABLES})
    # Extents: the size of any dimension a variable indexes directly.
    extents = {}
    pending = _accesses(stmt)
    while pending:
        name, indices = pending.pop()
        for d, text in enumerate(indices):
            if text in variables and name in arrays:
                extents[text] = arrays[name].shape[d]
            pending.extend(_accesses(text))
    out_name, out_indices = _accesses(lhs)[0]
    if "O" in arrays:
        out = arrays["O"].copy() if accumulate else np.zeros_like(arrays["O"])
    else:
        out = np.zeros([extents[t] for t in out_indices])
    factors = [f.strip() for f in rhs.split(" * ")]
    for values in itertools.product(*(range(extents[v]) for v in variables)):
        env = dict(zip(variables, values))
        product = 1.0
        for factor in factors:
            if "[" not in factor:
                product *= float(factor)
                continue
            name, indices = _accesses(factor)[0]
            key = tuple(_eval_index(t, env, arrays) for t in indices)
            product *= float(arrays[name][key]) if key else float(arrays[name])
        key = tuple(_eval_index(t, env, arrays) for t in out_indices)
        out[key] += product
    return out


def _accesses(text: str) -> list[tuple[str, list[str]]]:
    """Top-level accesses `name[i, j]` of a product, with their index texts."""
    found, depth, start, name_start = [], 0, None, 0
    for pos, ch in enumerate(text):
        if ch == "[":
            if depth == 0:
                start = pos
                name = text[name_start:pos].strip().split(" ")[-1]
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth == 0:
                found.append((name, _split_indices(text[start + 1 : pos])))
        elif depth == 0 and ch in "*=+ ":
            name_start = pos + 1
    return found


def _split_indices(body: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in body:
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
            continue
        depth += ch == "["
        depth -= ch == "]"
        current += ch
    if current.strip():
        parts.append(current.strip())
    return parts


# ---------------------------------------------------------------- the tests


def _check(seed: int, backend: str, dtype: torch.dtype, tol: float) -> None:
    drawn = _Draw(seed, dtype).draw()
    expected = oracle(drawn.stmt, drawn.tensors)
    given = {n: t.clone() for n, t in drawn.tensors.items()}
    actual = insum(drawn.stmt, backend=backend, **given)
    if "O" in given:
        assert actual is given["O"], drawn.stmt
    np.testing.assert_allclose(
        actual.double().numpy(), expected, rtol=tol, atol=tol, err_msg=f"seed {seed}: {drawn.stmt}"
    )


def test_oracle_is_independent_and_sane():
    # The oracle on a statement worked by hand: O[i] = 2 * A[I0[i] + 1] with A = [10, 20, 30].
    tensors = {"A": torch.tensor([10.0, 20.0, 30.0], dtype=torch.float64), "I0": torch.tensor([1, 0])}
    out = oracle("O[i] = 2 * A[I0[i] + 1]", {**tensors, "O": torch.full((2,), 7.0, dtype=torch.float64)})
    assert out.tolist() == [60.0, 40.0]


def test_draws_are_reproducible():
    a, b = _Draw(123, torch.float64).draw(), _Draw(123, torch.float64).draw()
    assert a.stmt == b.stmt and all(torch.equal(a.tensors[n], b.tensors[n]) for n in a.tensors)


@pytest.mark.parametrize("seed", TORCH_SEEDS)
def test_fuzz_torch(seed):
    _check(seed, "torch", torch.float64, 1e-9)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="CPU tensors: the generated kernel needs TRITON_INTERPRET=1",
)
@pytest.mark.parametrize("seed", TRITON_SEEDS)
def test_fuzz_triton(seed):
    # float64 in the interpreter: exact, so the tolerance stays tight.
    _check(seed, "triton", torch.float64, 1e-9)
