"""The package's shape (issue 14): one executor below both entry points, no import circle,
one cache policy, statements parsed and bound once per call.

No kernels run here except where marked (the interpreter, small sizes).
"""

from __future__ import annotations

import ast
import doctest
import importlib
import os
from pathlib import Path

import pytest
import torch
from torch.library import opcheck

import insum
from insum import InsumIndexError
from insum.bind import bind
from insum.cache import BoundedCache, memoize
from insum.parser import parse
from insum.reference import run_reference

PACKAGE = Path(insum.__file__).parent
CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
needs_kernels = pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1")
DEVICE = "cuda" if CUDA else "cpu"
SPMM = "C[AM[p], n] += AV[p, q] * B[AK[p, q], n]"


# ------------------------------------------------------------------ import graph


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:`: imports for annotations, never run."""
    skipped = set()
    for node in ast.walk(tree):
        test = getattr(node, "test", None)
        if isinstance(node, ast.If) and (
            (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
        ):
            skipped.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return skipped


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The insum modules a file imports at run time, at module level or inside functions."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    annotation_only = _type_checking_only(tree)
    for node in ast.walk(tree):
        if id(node) in annotation_only:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from . import x` imports the submodule x; `from .m import f` imports m.
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _import_graph() -> dict[str, set[str]]:
    paths = list(PACKAGE.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _imports(p, modules) for p in paths}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_import_graph_has_no_circle():
    """Reading every import (function-level ones too): data flows one way. A submodule's
    parent package is imported by Python itself and not counted; the package's own lazy
    `__getattr__` loads by name, not by an import statement."""
    graph = _import_graph()
    assert "insum.execute" in graph["insum.api"] and "insum.execute" in graph["insum.library"]
    assert "insum.api" not in graph["insum.library"]  # the circle that issue 14 found
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_cycle_finder_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


# ------------------------------------------------------------------ one cache policy


def test_bounded_cache_evicts_the_oldest_entry():
    cache = BoundedCache(limit=3)
    for key in "abcd":
        cache[key] = key.upper()
    assert list(cache) == ["b", "c", "d"]
    cache["b"] = "B2"  # an update admits nothing new
    assert list(cache.items()) == [("b", "B2"), ("c", "C"), ("d", "D")]

    calls = []

    @memoize
    def square(x):
        calls.append(x)
        if x < 0:
            raise ValueError(x)
        return x * x

    assert square(3) == square(3) == 9 and calls == [3]
    for _ in range(2):
        with pytest.raises(ValueError):
            square(-1)
    assert calls == [3, -1, -1]  # failures are not cached


def test_no_cache_outside_the_policy():
    """Every cache is a BoundedCache: no lru_cache of its own size, no ad-hoc limit."""
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        assert "lru_cache" not in text and "_LIMIT = " not in text, path


# ------------------------------------------------------------------ parse and bind once


def _spmm(requires_grad: bool, rows: int):
    """GroupCOO SpMM inputs, the output first (the operators bind it last)."""
    return {
        "C": torch.zeros(rows, 3, dtype=torch.float64),
        "AM": torch.arange(rows),
        "AV": torch.randn(rows, 2, dtype=torch.float64, requires_grad=requires_grad),
        "AK": torch.randint(0, 5, (rows, 2)),
        "B": torch.randn(5, 3, dtype=torch.float64, requires_grad=requires_grad),
    }


@pytest.mark.parametrize("requires_grad", [False, True], ids=["eager", "autograd"])
def test_one_parse_and_one_bind_per_call(monkeypatch, requires_grad):
    """The entry point parses and binds; the operators' own lookups hit the caches."""
    import insum.bind as bind_module
    import insum.parser as parser_module

    parsed, bound = [], []
    real_parse, real_bind = parser_module._PARSER.parse, bind_module._bind
    monkeypatch.setattr(parser_module._PARSER, "parse", lambda text: parsed.append(text) or real_parse(text))
    monkeypatch.setattr(bind_module, "_bind", lambda *a: bound.append(a[0]) or real_bind(*a))
    scale = 1.5 if requires_grad else 2.5
    text = f"{SPMM} * {scale}"  # a statement no other test parses
    tensors = _spmm(requires_grad, rows=7)
    out = insum.insum(text, backend="torch", **tensors)
    assert parsed == [text] and bound == [parse(text)]
    AV, AK, B = (tensors[n].detach() for n in ("AV", "AK", "B"))
    torch.testing.assert_close(out.detach(), scale * (AV[:, :, None] * B[AK]).sum(1))
    if requires_grad:
        out.sum().backward()
        assert tensors["AV"].grad is not None and tensors["B"].grad is not None


# ------------------------------------------------------------------ options reach the operators


@needs_kernels
def test_check_indices_reaches_the_autograd_operator():
    if CUDA:
        pytest.skip("on CUDA a bad index is a device-side assert (benchmarks.study_index_check)")
    B = torch.randn(6, 3, requires_grad=True)
    AK = torch.tensor([0, 6, 2])
    with pytest.raises(InsumIndexError, match="AK holds 6, out of range for B dimension 0"):
        insum.insum("C[p,n] += B[AK[p],n]", B=B, AK=AK, backend="triton", check_indices=True)


@needs_kernels
def test_autotune_reaches_the_autograd_operator_and_its_backward(monkeypatch):
    from insum.runtime import Kernel

    seen = []
    original = Kernel._first_config

    def spy(self, bucket, args, launcher, device, autotune):
        seen.append(autotune)
        return original(self, bucket, args, launcher, device, autotune)

    monkeypatch.setattr(Kernel, "_first_config", spy)
    X = torch.randn(29, 13, device=DEVICE, requires_grad=True)  # sizes no other test uses
    W = torch.randn(13, 3, device=DEVICE, requires_grad=True)
    Y = insum.insum("O[i,n] = X[i,k]*W[k,n]", X=X, W=W, backend="triton", autotune=False)
    Y.sum().backward()
    assert seen and set(seen) == {False}


def test_opcheck_with_every_option():
    tensors = _spmm(False, rows=4)
    C = tensors.pop("C")
    names = list(tensors)
    values = [tensors[n] for n in names]
    opcheck(torch.ops.insum.insum.default, (SPMM, C, names, values, None, None, "torch", "ieee", False, True))
    opcheck(torch.ops.insum.insum_.default, (SPMM, C.clone(), names, values, "torch", "tf32", None, False))


# ------------------------------------------------------------------ hooks for benchmarks


def test_reference_without_bounds_checks_gives_the_same_result():
    tensors = _spmm(False, rows=5)
    bound = bind(parse(SPMM), tensors)
    checked = run_reference(bound, torch.zeros(5, 3, dtype=torch.float64))
    unchecked = run_reference(bound, torch.zeros(5, 3, dtype=torch.float64), check_bounds=False)
    assert torch.equal(checked, unchecked)
    tensors["AK"][0, 0] = 5
    with pytest.raises(InsumIndexError):
        run_reference(bind(parse(SPMM), tensors), torch.zeros(5, 3, dtype=torch.float64))


@needs_kernels
def test_kernel_launcher_relaunches_the_prepared_launch():
    from insum.runtime import kernel_for

    stmt = parse("Y[i] += X[i,k]*0.5")
    X = torch.randn(19, 5, device=DEVICE)
    Y = torch.full((19,), 3.0, device=DEVICE)
    insum.insum(str(stmt), X=X, Y=Y, backend="triton")
    bound = bind(stmt, {"X": X, "Y": Y})
    launch = kernel_for(bound).launcher(bound)
    assert set(launch.config) >= {"num_warps", "num_stages"}
    launch()  # += once more
    torch.testing.assert_close(Y, 3.0 + X.sum(1))
    other = bind(stmt, {"X": torch.randn(3, 5, device=DEVICE), "Y": Y[:3]})
    with pytest.raises(KeyError):
        kernel_for(other).launcher(other)


# ------------------------------------------------------------------ examples in docstrings


@pytest.mark.parametrize("module", ["dtypes", "arith", "ir", "settings", "autograd"])
def test_docstring_examples(module):
    result = doctest.testmod(importlib.import_module(f"insum.{module}"))
    assert result.failed == 0 and result.attempted > 0


# ------------------------------------------------------------------ environment switches


@pytest.mark.parametrize("text, default, expected", [
    (None, True, True), (None, False, False), ("", True, False), ("0", True, False),
    ("1", False, True), ("yes", False, True),
    # found by fuzzing: "false" and "off" read as on (anything but "" and "0" did)
    ("false", True, False), ("OFF", True, False), ("no", True, False), ("On", False, True), ("true", False, True),
])
def test_flags_follow_the_environment_at_each_read(monkeypatch, text, default, expected):
    """settings.flag reads what os.environ holds now (set or deleted through it)."""
    from insum.settings import flag

    monkeypatch.setenv("INSUM_TEST_SWITCH", "1" if not default else "0")
    assert flag("INSUM_TEST_SWITCH", default) is (not default)
    if text is None:
        monkeypatch.delenv("INSUM_TEST_SWITCH")
    else:
        monkeypatch.setenv("INSUM_TEST_SWITCH", text)
    assert flag("INSUM_TEST_SWITCH", default) is expected


def test_a_switch_of_another_spelling_raises(monkeypatch):
    from insum.errors import InsumError
    from insum.settings import flag

    monkeypatch.setenv("INSUM_TEST_SWITCH", "maybe")
    with pytest.raises(InsumError, match="INSUM_TEST_SWITCH='maybe'"):
        flag("INSUM_TEST_SWITCH", True)
