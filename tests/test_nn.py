"""insum.nn: SparseLinear in every format (forward, gradcheck, state_dict round-trip,
torch.compile of a small model), the functional form and magnitude pruning."""

from __future__ import annotations

import io
import os

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import insum.nn as inn
import insum.nn.sparse_autograd as sparse_autograd
from insum import InsumError, InsumShapeError
from insum.nn import SparseLinear, magnitude_prune

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

FORMATS = [
    ("GroupCOO", {"group_size": 2}),
    ("COO", {}),
    ("ELL", {}),
    ("BlockGroupCOO", {"block": (4, 4)}),
    ("NM", {"n": 2, "m": 4, "vector_len": 4}),
    ("CELL", {"max_width": 2}),
    ("BlockGroupCOO", {"block": (4, 4), "group_size": "row"}),  # Block-ELL: no AM
]
IDS = [name for name, _ in FORMATS[:-1]] + ["BlockELL"]


def layer_for(fmt: str, params: dict, *, in_features: int = 12, out_features: int = 10, seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    sparsity = 0.0 if fmt == "NM" else 0.6
    kwargs.setdefault("backend", "torch")
    kwargs.setdefault("dtype", torch.float64)
    return SparseLinear(in_features, out_features, format=fmt, sparsity=sparsity, **kwargs, **params)


@pytest.mark.parametrize("fmt, params", FORMATS, ids=IDS)
def test_forward_matches_dense(fmt, params):
    layer = layer_for(fmt, params)
    W = layer.to_dense()
    assert W.shape == (10, 12)
    assert (W == 0).sum() >= 50  # pruned (NM 2:4 keeps half; BlockGroupCOO whole 4x4 blocks)
    x = torch.randn(2, 3, 12, dtype=torch.float64)
    torch.testing.assert_close(layer(x), x @ W.T + layer.bias)
    torch.testing.assert_close(inn.functional.sparse_linear(x, layer.weight, layer.bias, backend="torch"), layer(x))
    no_bias = SparseLinear.from_dense(W, None, fmt, backend="torch", **params)
    torch.testing.assert_close(no_bias(x), x @ W.T)


@pytest.mark.parametrize("in_features", [8, 5])
@pytest.mark.parametrize("transposed", [True, False], ids=["transposed", "derived"])
@pytest.mark.parametrize("fmt, params", FORMATS, ids=IDS)
def test_gradcheck_layer(fmt, params, transposed, in_features):
    layer = layer_for(fmt, params, in_features=in_features, out_features=6, transposed_backward=transposed)
    # CELL has no transposed plan, nor N:M where a window holds fewer than n columns
    # (5 = 4 + 1: padded columns repeat column 4)
    planned = fmt != "CELL" and not (fmt == "NM" and in_features % 4)
    assert bool(layer._pattern_names) == planned
    values = [n for n, _ in layer.named_parameters()]
    # Padding (declared, as Block-ELL's, or frozen by the layer) is no weight: its gradient is
    # zero and it stays zero, so the function checked holds it at zero.
    kept = {n: _stored_slots(layer, n) for n in values}

    def f(x, *vals):
        vals = [v if kept[n] is None else v * kept[n] for n, v in zip(values, vals)]
        return torch.func.functional_call(layer, dict(zip(values, vals)), (x,))

    x = torch.randn(3, in_features, dtype=torch.float64, requires_grad=True)
    inputs = (x, *(p.detach().clone().requires_grad_(True) for _, p in layer.named_parameters()))
    assert torch.autograd.gradcheck(f, inputs, fast_mode=True)
    # after training steps the trained slots hold other values: the gradients stay exact
    with torch.no_grad():
        for n, p in layer.named_parameters():
            p.add_(torch.randn_like(p) * (1 if kept[n] is None else kept[n]))
    inputs = (x, *(p.detach().clone().requires_grad_(True) for _, p in layer.named_parameters()))
    assert torch.autograd.gradcheck(f, inputs, fast_mode=True)


def _stored_slots(layer: SparseLinear, name: str) -> torch.Tensor | None:
    """1 at a value tensor's trained slots, 0 at its declared padding and at its frozen slots
    (`frozen_slots`: padding, repeated positions); None where every slot is trained."""
    stored = torch.ones(getattr(layer, name).shape, dtype=torch.bool)
    lengths = layer.weight.declared_lengths()
    if lengths is not None and name == "AV":
        (counts,) = lengths.values()
        rows = torch.arange(layer.AV.shape[1]) < counts[:, None]
        stored &= rows[:, :, None, None].expand_as(layer.AV)
    if name in layer._frozen_names:
        stored &= ~getattr(layer, "frozen_" + name)
    return None if bool(stored.all()) else stored.to(getattr(layer, name).dtype)


def _with_empty_rows(seed: int = 0) -> torch.Tensor:
    """A 6 x 8 weight of scattered nonzeros with two empty rows (an empty row's padding
    points at column 0, which its row does not hold)."""
    W = torch.randn(6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    W[W.abs() < 0.8] = 0
    W[2] = W[4] = 0
    return W


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("fmt, params", FORMATS + [("GroupCOO", {"group_size": 3})], ids=IDS + ["GroupCOO-g3"])
def test_training_step_matches_the_dense_masked_step(fmt, params, compiled):
    """Found by fuzzing: padding slots were trained. An empty row's padding (column 0) grew
    the pattern, and a group's padding (a repeat of a stored position) stepped that entry
    twice. A step now moves exactly the weight's nonzeros, as a dense layer's masked step."""
    W, b = _with_empty_rows(), torch.randn(6, dtype=torch.float64)
    layer = SparseLinear.from_dense(W, b, fmt, backend="torch", **params)
    if fmt == "NM":  # NM prunes: its pattern is what it kept
        W = layer.to_dense().detach()
    if compiled:
        torch._dynamo.reset()  # (one compilation per format: not counted against the next tests')
    run = torch.compile(layer, backend="aot_eager", fullgraph=True) if compiled else layer
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    dense = W.clone()
    for step in range(2):
        x = torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        run(x).square().sum().backward()
        optimizer.step()
        Wd = dense.clone().requires_grad_(True)
        (x @ Wd.t() + b).square().sum().backward()
        dense -= 0.1 * Wd.grad * (W != 0)
        b = b - 0.1 * 2 * (x @ Wd.detach().t() + b).sum(0)
        torch.testing.assert_close(layer.to_dense().detach(), dense)
        assert bool((layer.to_dense()[W == 0] == 0).all())


@pytest.mark.parametrize("transposed", [True, False], ids=["transposed", "derived"])
@pytest.mark.parametrize("fmt, params", FORMATS + [("GroupCOO", {"group_size": 3})], ids=IDS + ["GroupCOO-g3"])
def test_gradient_penalty_step_matches_the_dense_masked_step(fmt, params, transposed):
    """Found by fuzzing: a second-order gradient (a penalty on x's gradient, create_graph)
    reached the values through x's gradient statement, where the frozen slots were not held:
    one step grew the pattern. They read as constants there now, with x's gradient on the
    transposed pattern or derived (transposed_backward=False)."""
    W, b = _with_empty_rows(), torch.randn(6, dtype=torch.float64)
    layer = SparseLinear.from_dense(W, b, fmt, backend="torch", transposed_backward=transposed, **params)
    if fmt == "NM":
        W = layer.to_dense().detach()
    x = torch.randn(5, 8, dtype=torch.float64)
    Wd = W.clone().requires_grad_(True)
    for forward in (layer, lambda v: v @ Wd.t() + b):
        xx = x.clone().requires_grad_(True)
        (gx,) = torch.autograd.grad(torch.tanh(forward(xx)).sum(), xx, create_graph=True)
        gx.square().sum().backward()
    with torch.no_grad():
        for p in layer.parameters():
            p -= 0.1 * p.grad
    torch.testing.assert_close(layer.to_dense().detach(), W - 0.1 * Wd.grad * (W != 0))


@pytest.mark.parametrize("transposed", [True, False], ids=["transposed", "derived"])
def test_gradient_penalty_leaves_block_ell_padding_past_its_lengths(transposed):
    """Found by fuzzing: with x's derived gradient (transposed_backward=False), which reads
    every slot, a penalty on x's gradient trained the two padding blocks past block row 0's
    length (AL = [1, 3]): AV.grad [432, 216, 216] for [432, 0, 0], and a step grew the pattern."""
    W = torch.tensor([[1.0, 0.0, 0.0], [2.0, 3.0, 4.0]], dtype=torch.float64)
    layer = SparseLinear.from_dense(W, None, "BlockGroupCOO", block=1, group_size="row", backend="torch",
                                    transposed_backward=transposed)
    assert layer.AL.tolist() == [1, 3]
    Wd = W.clone().requires_grad_(True)
    x = torch.tensor([[1.0, 2.0, 3.0], [-1.0, 0.5, 2.0]], dtype=torch.float64)
    for forward in (layer, lambda v: v @ Wd.t()):
        xx = x.clone().requires_grad_(True)
        (gx,) = torch.autograd.grad(forward(xx).square().sum(), xx, create_graph=True)
        gx.square().sum().backward()
    want = torch.zeros(3, dtype=torch.float64)
    want[0] = Wd.grad[0, 0]
    torch.testing.assert_close(layer.AV.grad.reshape(2, 3)[0], want)


def test_repeated_position_is_trained_once():
    """Two slots at one position (a format packed with repeats) add up in the product; only
    the first is trained, so a step moves that weight entry once."""
    layer = SparseLinear.from_dense(_with_empty_rows(1), None, "COO", backend="torch")
    fmt = layer.weight
    AM, AK, AV = fmt.AM.clone(), fmt.AK.clone(), fmt.AV.detach().clone()
    first, second = (AV != 0).nonzero().flatten()[:2].tolist()  # two stored slots of one row
    assert AM[first] == AM[second] and AK[first] != AK[second]
    AK[second] = AK[first]
    repeated = type(fmt)(fmt.shape, {"AM": AM, "AK": AK, "AV": AV}, nnz=fmt.nnz, dtype=fmt.dtype,
                         index_dtype=fmt.index_dtype, device=fmt.device, params=fmt.params)
    twice = SparseLinear.from_format(repeated, None, backend="torch")
    assert int(twice.frozen_AV.sum()) == int(layer.frozen_AV.sum()) + 1  # (COO pads its empty rows)
    assert bool(twice.frozen_AV[second]) and not bool(twice.frozen_AV[first])
    x = torch.randn(4, 8, dtype=torch.float64)
    W = twice.to_dense().detach().requires_grad_(True)
    (x @ W.t()).square().sum().backward()
    twice(x).square().sum().backward()
    assert twice.AV.grad[second] == 0
    torch.testing.assert_close(twice.AV.grad[first], W.grad[AM[first].long(), AK[first].long()])


def test_frozen_slots_follow_a_loaded_pattern():
    """The frozen slots are the loaded weight's: a state_dict of another pattern brings its own."""
    layer = SparseLinear.from_dense(_with_empty_rows(2), None, "ELL", backend="torch")
    dense = torch.randn(6, 8, dtype=torch.float64)
    other = SparseLinear.from_dense(dense, None, "ELL", backend="torch")  # no padding at all
    assert layer._frozen_names == ("AV",) and other._frozen_names == ()
    other.load_state_dict(layer.state_dict())
    assert other._frozen_names == ("AV",)
    torch.testing.assert_close(other.frozen_AV, layer.frozen_AV)


def _two_patterns(fmt: str, params: dict):
    """Two layers of one format and tensor shapes but other patterns (ELL rows of 2, 1, 2 and 1, 2, 2)."""
    A = torch.tensor([[1.0, 2, 0, 0], [0, 3, 0, 0], [4, 0, 5, 0]], dtype=torch.float64)
    B = torch.tensor([[0.0, 0, 7, 0], [0, 8, 0, 9], [0, 1, 0, 2]], dtype=torch.float64)
    first, second = (SparseLinear.from_dense(W, None, fmt, backend="torch", **params) for W in (A, B))
    shapes = [{k: v.shape for k, v in layer.state_dict().items() if torch.is_tensor(v)} for layer in (first, second)]
    if shapes[0] != shapes[1]:
        pytest.skip("the two patterns pack to other shapes in this format")
    return first, second


@pytest.mark.parametrize("transposed", [True, False], ids=["transposed", "derived"])
@pytest.mark.parametrize("fmt, params", [("ELL", {}), ("GroupCOO", {"group_size": 2}), ("COO", {})],
                         ids=["ELL", "GroupCOO", "COO"])
def test_functional_call_with_another_pattern_gets_its_gradients(fmt, params, transposed):
    """Found by fuzzing: `torch.func.functional_call` with another layer's tensors (another
    pattern, the same shapes) ran the backward on the layer's own transposed pattern and frozen
    slots: x's and the values' gradients were wrong. The swapped index tensors get a plan of
    their own."""
    first, second = _two_patterns(fmt, params)
    first.transposed_backward = second.transposed_backward = transposed
    state = {k: (v.detach().clone().requires_grad_() if v.is_floating_point() else v)
             for k, v in second.state_dict().items() if torch.is_tensor(v)}
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, 3, dtype=torch.float64)
    for _ in range(2):  # (and the layer's own call in between)
        x.grad = None
        (torch.func.functional_call(first, state, (x,)) * dy).sum().backward()
        xs = x.detach().clone().requires_grad_()
        second.zero_grad()
        (second(xs) * dy).sum().backward()
        torch.testing.assert_close(x.grad, xs.grad)
        torch.testing.assert_close(state["AV"].grad, second.AV.grad)
        state["AV"].grad = None
        first(x)


@pytest.mark.parametrize("fmt, params", [("ELL", {}), ("BlockGroupCOO", {"block": (2, 2), "group_size": "row"})],
                         ids=["ELL", "BlockELL"])
def test_compiled_functional_call_with_another_pattern_gets_its_gradients(fmt, params):
    """Found by fuzzing: traced, `torch.func.functional_call` with another layer's tensors ran
    the backward on the layer's own plan (transposed pattern, tables, frozen slots): x's
    gradient was off by 50 and the values' by 260, silently. A swap is seen when tracing too;
    the swapped tensors' plan breaks the graph (host syncs) and the gradients are right."""
    first, second = _two_patterns(fmt, params)
    state = {k: v.detach().clone() for k, v in second.state_dict().items() if torch.is_tensor(v)}
    x = torch.randn(2, 4, dtype=torch.float64)
    dy = torch.randn(2, 3, dtype=torch.float64)

    def gradients(fn):
        xs = x.clone().requires_grad_()
        swapped = {k: (v.clone().requires_grad_() if v.is_floating_point() else v) for k, v in state.items()}
        (fn(xs, swapped) * dy).sum().backward()
        return xs.grad, swapped["AV"].grad

    want = gradients(lambda xs, st: torch.func.functional_call(second, st, (xs,)))
    compiled = torch.compile(lambda xs, st: torch.func.functional_call(first, st, (xs,)), backend="aot_eager")
    for got, expected in zip(gradients(compiled), want):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("how", ["functional_call", "compiled functional_call", "assigned", "edited in place"])
def test_another_block_count_recounts_the_stored_blocks(how):
    """Found by fuzzing: a Block-ELL layer given another pattern of the same tensor shapes
    but another stored block count kept its packing's count (`params["blocks"]`), which lists
    the stored blocks for the values' gradient (128-column blocks, one block a group): the
    fourth block's gradient was dropped (off by 9.7). The count now follows the tensors."""
    gen = torch.Generator().manual_seed(4)
    A = torch.randn(256, 256, dtype=torch.float64, generator=gen)
    A[128:, :128] = 0  # three stored blocks (rows of 2 and 1), the other matrix four
    B = torch.randn(256, 256, dtype=torch.float64, generator=gen)
    first, second = (SparseLinear.from_dense(W, None, "BlockGroupCOO", backend="torch", block=(128, 128),
                                             group_size="row") for W in (A, B))
    assert first.AK.shape == second.AK.shape and first.AV.shape == second.AV.shape
    x = torch.randn(2, 256, dtype=torch.float64, generator=gen)
    dy = torch.randn(2, 256, dtype=torch.float64, generator=gen)

    def gradients(layer, state=None, run=None):
        xs = x.clone().requires_grad_()
        if state is None:
            layer.zero_grad()
            (layer(xs) * dy).sum().backward()
            return xs.grad, layer.AV.grad
        state = {k: (v.clone().requires_grad_() if v.is_floating_point() else v) for k, v in state.items()}
        (run(xs, state) * dy).sum().backward()
        return xs.grad, state["AV"].grad

    want = gradients(second)
    state = {k: v.detach().clone() for k, v in second.state_dict().items() if torch.is_tensor(v)}
    if how == "functional_call":
        got = gradients(first, state, lambda xs, st: torch.func.functional_call(first, st, (xs,)))
    elif how == "compiled functional_call":
        run = torch.compile(lambda xs, st: torch.func.functional_call(first, st, (xs,)), backend="aot_eager")
        got = gradients(first, state, run)
    elif how == "assigned":
        first.AK, first.AL = state["AK"], state["AL"]
        first.AV = torch.nn.Parameter(state["AV"])
        got = gradients(first)
    else:
        first(x)  # (a kept call, then the edit)
        with torch.no_grad():
            for name in ("AK", "AL", "AV"):
                getattr(first, name).copy_(state[name])
        got = gradients(first)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_compiled_layer_takes_a_pattern_edited_in_place_after_refresh_plan():
    """Found by fuzzing: a compiled layer whose index tensors were edited in place kept the
    old pattern's plan in its backward (x's gradient off by 1-5, silently): a traced graph
    cannot see the version counters that an eager call reads. `refresh_plan()` rebuilds it."""
    first, second = _two_patterns("ELL", {})
    run = torch.compile(first, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 4, dtype=torch.float64)
    run(x.clone().requires_grad_()).sum().backward()
    assert not first.refresh_plan()  # (nothing edited)
    with torch.no_grad():
        for name in ("AK", "AV"):
            getattr(first, name).copy_(getattr(second, name))
    assert first.refresh_plan()
    xx, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    run(xx).sum().backward()
    second(xs).sum().backward()
    torch.testing.assert_close(xx.grad, xs.grad)


def test_assigned_index_tensors_rebuild_the_plan():
    """Assigning another pattern's tensors (a buffer and a parameter replaced) rebuilds the
    layer's transposed pattern and frozen slots (they had stayed the old pattern's)."""
    first, second = _two_patterns("ELL", {})
    first.AK = second.AK.clone()
    first.AV = torch.nn.Parameter(second.AV.detach().clone())
    x = torch.randn(2, 4, dtype=torch.float64)
    dy = torch.randn(2, 3, dtype=torch.float64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    (first(xa) * dy).sum().backward()
    (second(xb) * dy).sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad)
    torch.testing.assert_close(first.AV.grad, second.AV.grad)
    torch.testing.assert_close(first.frozen_AV, second.frozen_AV)


def test_zero_slot_before_a_stored_one_does_not_freeze_it():
    """Found by fuzzing: a zero slot at a position that a later slot stores took the position,
    and the stored weight was frozen."""
    from insum.formats import COO

    AM, AK = torch.tensor([0, 0, 1]), torch.tensor([2, 2, 0])
    AV = torch.tensor([0.0, 3.0, 2.0], dtype=torch.float64)
    fmt = COO((2, 3), {"AM": AM.int(), "AK": AK.int(), "AV": AV}, nnz=2, dtype=torch.float64,
              index_dtype=torch.int32, device=torch.device("cpu"), params={})
    layer = SparseLinear.from_format(fmt, None, backend="torch")
    assert layer.frozen_AV.tolist() == [True, False, False]
    x = torch.ones(1, 3, dtype=torch.float64)
    layer(x).sum().backward()
    assert layer.AV.grad.tolist() == [0.0, 1.0, 1.0]


def test_block_ell_padding_gets_no_gradient_and_stays_zero():
    layer = layer_for("BlockGroupCOO", {"block": (4, 4), "group_size": "row"}, out_features=16, seed=3)
    counts = layer.weight.declared_lengths()["q[p]"]
    padding = torch.arange(layer.AK.shape[1]) >= counts[:, None]
    assert bool(padding.any()) and not bool(padding.all())
    assert bool((layer.AV[padding] == 0).all())
    optimizer = torch.optim.Adam(layer.parameters(), lr=0.1)
    for seed in range(3):
        x = torch.randn(5, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        optimizer.zero_grad()
        layer(x).square().sum().backward()
        assert bool((layer.AV.grad[padding] == 0).all())
        # The stored blocks' gradients are the dense weight's gradient at their positions.
        W = layer.weight.to_dense().detach().requires_grad_(True)
        (x @ W.t() + layer.bias.detach()).square().sum().backward()
        rows = torch.arange(layer.AK.shape[0])[:, None].expand_as(layer.AK)[~padding]
        blocks = W.grad.view(W.shape[0] // 4, 4, 3, 4).permute(0, 2, 1, 3)[rows, layer.AK[~padding].long()]
        torch.testing.assert_close(layer.AV.grad[~padding], blocks)
        optimizer.step()
    assert bool((layer.AV[padding] == 0).all())


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_block_ell_empty_block_row_stays_empty(backend):
    """An empty block row's all-padding group is no weight: count 0 (not 1, which reading the
    counts off AK gives, since its padding repeats a column as any row's padding does), no
    gradient, nothing added by an optimizer, and its output rows are the bias alone."""
    on_gpu = backend == "triton" and not INTERPRET
    if on_gpu and not torch.cuda.is_available():
        pytest.skip("the triton backend needs CUDA or TRITON_INTERPRET=1")
    device, dtype = ("cuda", torch.float32) if on_gpu else ("cpu", torch.float64)
    tol = {"rtol": 1e-5, "atol": 1e-5} if on_gpu else {}
    gen = torch.Generator().manual_seed(0)
    keep = torch.rand(5, 6, generator=gen) < 0.4
    keep[2] = False  # an empty block row
    keep[3, :] = torch.tensor([True, False, True, True, False, True])  # the widest: 4 blocks
    W = torch.randn(20, 24, generator=gen, dtype=dtype) * keep.repeat_interleave(4, 0).repeat_interleave(4, 1)
    bias = torch.randn(20, generator=gen, dtype=dtype)
    layer = SparseLinear.from_dense(W.to(device), bias.to(device), "BlockGroupCOO", block=(4, 4), group_size="row",
                                    backend=backend, precision="ieee")
    counts = layer.weight.declared_lengths()["q[p]"]
    assert counts.tolist() == keep.sum(1).tolist() and counts[2] == 0
    padding = torch.arange(layer.AK.shape[1], device=device) >= counts[:, None]
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.5)
    for seed in range(2):
        x = torch.randn(3, 24, dtype=dtype, generator=torch.Generator().manual_seed(seed)).to(device)
        optimizer.zero_grad()
        y = layer(x)
        torch.testing.assert_close(y, x @ layer.to_dense().detach().T + layer.bias.detach(), **tol)
        torch.testing.assert_close(y[:, 8:12], layer.bias.detach()[8:12].expand(3, -1), **tol)
        y.square().sum().backward()
        assert bool((layer.AV.grad[padding] == 0).all())
        optimizer.step()
    assert bool((layer.to_dense()[8:12] == 0).all())
    assert bool((layer.AV[padding] == 0).all())


@pytest.mark.parametrize("fmt, params", FORMATS, ids=IDS)
def test_gradcheck_functional(fmt, params):
    layer = layer_for(fmt, params, in_features=7, out_features=6)
    template = layer.weight
    values = [n for n in layer._tensor_names if isinstance(getattr(layer, n), torch.nn.Parameter)]
    kept = {n: _stored_slots(layer, n) for n in values}  # declared padding held at zero

    def f(x, bias, *vals):
        vals = [v if kept[n] is None else v * kept[n] for n, v in zip(values, vals)]
        tensors = {**template.packed_tensors, **dict(zip(values, vals))}
        fmt_obj = sparse_autograd.rebuild_format(type(template), template.shape, layer._format_meta, tensors)
        return inn.sparse_linear(x, fmt_obj, bias, backend="torch")

    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    inputs = (x, layer.bias.detach().clone().requires_grad_(True))
    inputs += tuple(getattr(layer, n).detach().clone().requires_grad_(True) for n in values)
    assert torch.autograd.gradcheck(f, inputs, fast_mode=True)


def test_parameters_and_buffers():
    layer = layer_for("BlockGroupCOO", {"block": (4, 4)})
    assert {n for n, _ in layer.named_parameters()} == {"AV", "bias"}
    # frozen_AV: its padding blocks (`frozen_slots`)
    assert {n for n, _ in layer.named_buffers()} == {"AM", "AK", "grad_TM", "grad_TS", "grad_TR", "frozen_AV"}
    assert set(layer.state_dict()) == {"AV", "AM", "AK", "bias", "_extra_state"}  # no grad_*, frozen_*
    x = torch.randn(5, 12, dtype=torch.float64)
    layer(x).sum().backward()
    assert layer.AV.grad is not None and layer.AV.grad.shape == layer.AV.shape
    half = layer.float()
    assert half.AV.dtype == torch.float32 and half.AK.dtype == layer.weight.index_dtype
    assert half(x.float()).dtype == torch.float32


@pytest.mark.parametrize("fmt, params", FORMATS, ids=IDS)
def test_state_dict_round_trip_into_a_fresh_layer(fmt, params):
    layer = layer_for(fmt, params, seed=1)
    buffer = io.BytesIO()
    torch.save(layer.state_dict(), buffer)
    buffer.seek(0)
    fresh = SparseLinear(12, 10, format="COO", sparsity=0.2, backend="torch", dtype=torch.float64)
    fresh.load_state_dict(torch.load(buffer))  # another format and pattern: tensors resized
    assert fresh.format == layer.format
    x = torch.randn(4, 12, dtype=torch.float64)
    torch.testing.assert_close(fresh(x), layer(x))
    torch.testing.assert_close(fresh.to_dense(), layer.to_dense())
    assert set(fresh.state_dict()) == set(layer.state_dict())


def test_state_dict_same_pattern_keeps_parameter_objects():
    layer = layer_for("GroupCOO", {"group_size": 2})
    twin = layer_for("GroupCOO", {"group_size": 2})  # same seed: same pattern
    with torch.no_grad():
        layer.AV.mul_(2)
    AV = twin.AV
    twin.load_state_dict(layer.state_dict())
    assert twin.AV is AV and torch.equal(twin.AV, layer.AV)


def test_state_dict_of_another_size_is_refused():
    layer = layer_for("GroupCOO", {})
    other = SparseLinear(12, 11, format="GroupCOO", backend="torch", dtype=torch.float64)
    with pytest.raises(RuntimeError, match="size mismatch"):
        other.load_state_dict(layer.state_dict())


@pytest.mark.parametrize("fmt, params", FORMATS, ids=IDS)
def test_state_dict_of_another_pattern_loads_with_assign(fmt, params):
    """Found by fuzzing: with assign=True the loader sets the tensors one by one, and each
    rebuilt the plan from a mixture of the new tensors and empty ones (a bincount of garbage
    raised). The plan is now made once, after the last tensor."""
    layer, other = layer_for(fmt, params, seed=1), layer_for(fmt, params, seed=7)
    other.load_state_dict(layer.state_dict(), assign=True)
    x = torch.randn(3, 12, dtype=torch.float64)
    torch.testing.assert_close(other(x), layer(x))
    other(x).sum().backward()
    layer(x).sum().backward()
    for (name, got), (_, want) in zip(other.named_parameters(), layer.named_parameters()):
        torch.testing.assert_close(got.grad, want.grad, msg=name)


def test_state_dict_missing_a_format_tensor_is_refused_whole():
    """Found by fuzzing: a saved weight without one of its index tensors raised a bare
    AttributeError and left the layer without that tensor. It is refused, the layer intact."""
    layer, other = layer_for("COO", {}, seed=1), layer_for("COO", {}, seed=7)
    before = other.to_dense().detach().clone()
    saved = layer.state_dict()
    del saved["AK"]
    for strict in (True, False):
        with pytest.raises(RuntimeError, match="missing tensors AK .* cannot be loaded in part"):
            other.load_state_dict(saved, strict=strict)
        torch.testing.assert_close(other.to_dense().detach(), before)
        other(torch.randn(2, 12, dtype=torch.float64))


def test_loaded_layer_keeps_its_parameter_order_for_the_optimizer_state():
    """Found by fuzzing: loading re-registered the values after the bias, so an optimizer
    state saved with the layer was applied to the wrong parameters on resume."""
    def steps(layer, optimizer, seed):
        for x in torch.randn(3, 4, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)):
            optimizer.zero_grad()
            layer(x).tanh().square().sum().backward()
            optimizer.step()

    layer = layer_for("COO", {}, seed=1)
    optimizer = torch.optim.Adam(layer.parameters(), lr=0.05)
    steps(layer, optimizer, 0)
    buffer = io.BytesIO()
    torch.save({"model": layer.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    resumed = layer_for("COO", {}, seed=7)
    resumed.load_state_dict(saved["model"])
    assert [n for n, _ in resumed.named_parameters()] == [n for n, _ in layer.named_parameters()]
    resumed_optimizer = torch.optim.Adam(resumed.parameters(), lr=0.05)
    resumed_optimizer.load_state_dict(saved["optimizer"])
    steps(layer, optimizer, 1)
    steps(resumed, resumed_optimizer, 1)
    torch.testing.assert_close(resumed.to_dense(), layer.to_dense())
    torch.testing.assert_close(resumed.bias, layer.bias)


@pytest.mark.parametrize("fmt, params", FORMATS, ids=IDS)
def test_compiled_functional_layer_without_gradients(fmt, params):
    """Found by fuzzing: compiling `sparse_linear` on an ELL or N:M weight (two tensors) with
    no tensor requiring grad failed in dynamo (an autograd Function given exactly five such
    arguments had them shifted by one). Without gradients the product runs alone."""
    from insum.nn.functional import sparse_linear

    layer = layer_for(fmt, params)
    x = torch.randn(3, 12, dtype=torch.float64)
    torch._dynamo.reset()
    run = torch.compile(sparse_linear, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        want = x @ layer.to_dense().t()
        for bias in (None, layer.bias):
            got = run(x, layer.weight, bias)
            torch.testing.assert_close(got, want if bias is None else want + bias)


@pytest.mark.parametrize("group_size", [None, "row"], ids=["groups", "BlockELL"])
def test_compiled_training_step_matches_eager(group_size):
    def model(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(
            SparseLinear(16, 12, format="BlockGroupCOO", block=(4, 4), sparsity=0.5, group_size=group_size,
                         backend="torch"),
            torch.nn.ReLU(),
            SparseLinear(12, 6, format="NM", n=2, m=4, vector_len=2, backend="torch"),
        )

    eager, compiled = model(0), model(0)
    counter = CompileCounterWithBackend("inductor")
    run = torch.compile(compiled, backend=counter, fullgraph=True)
    optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled)]
    for step in range(2):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        losses = []
        for net, opt in zip((eager, run), optims):
            opt.zero_grad()
            loss = net(x).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1])
    for a, b in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(a, b)
    assert counter.frame_count == 1


@pytest.mark.parametrize("known_count", [True, False], ids=["stored_blocks", "slots_masked"])
def test_compiled_block_ell_value_gradient(known_count):
    """Traced, AV's gradient lists the stored blocks at the packed count (params["blocks"],
    a static size); a Block-ELL object without it masks the padding of every slot's gradient."""
    layer = layer_for("BlockGroupCOO", {"block": (4, 4), "group_size": "row"}, out_features=16, seed=3)
    meta = dict(layer._format_meta, params={k: v for k, v in layer._format_meta["params"].items()
                                            if known_count or k != "blocks"})
    template = layer.weight
    x = torch.randn(5, 12, dtype=torch.float64)

    def loss(AV):
        fmt = sparse_autograd.rebuild_format(type(template), template.shape, meta, {**template.packed_tensors, "AV": AV})
        return inn.sparse_linear(x, fmt, None, backend="torch").square().sum()

    grads = []
    for run in (loss, torch.compile(loss, backend="aot_eager", fullgraph=True)):
        AV = layer.AV.detach().clone().requires_grad_(True)
        run(AV).backward()
        grads.append(AV.grad)
    torch.testing.assert_close(grads[1], grads[0])
    padding = torch.arange(layer.AK.shape[1]) >= layer.AL[:, None]
    assert bool(padding.any()) and bool((grads[1][padding] == 0).all())


def test_compiled_block_ell_layer_runs_the_grouped_value_gradient():
    """A SparseLinear keeps Block-ELL's group tables as buffers (built outside tracing, not
    saved), so that its compiled backward runs the same grouped values' gradient as the
    eager one (`GROUPED_GRADIENT`, not the per-block form), with the same result; and the
    transposed pattern's column lengths, so that it counts none per step."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    from insum.formats import BlockGroupCOO

    layer = layer_for("BlockGroupCOO", {"block": (4, 4), "group_size": "row"}, out_features=16, seed=3)
    assert {"wgrad_GF", "wgrad_GP", "wgrad_GK"} <= {name for name, _ in layer.named_buffers()}
    assert not any(name.startswith("wgrad_") for name in layer.state_dict())
    x = torch.randn(5, 12, dtype=torch.float64, requires_grad=True)
    backend = AotEagerAndRecordGraphs()
    grads = []
    for run in (layer, torch.compile(layer, backend=backend, fullgraph=True)):
        layer.zero_grad()
        run(x).square().sum().backward()
        grads.append(layer.AV.grad.clone())
    torch.testing.assert_close(grads[1], grads[0])
    backward = "\n".join(graph.code for graph in backend.bw_graphs)
    assert BlockGroupCOO.GROUPED_GRADIENT in backward and BlockGroupCOO.STORED_GRADIENT not in backward
    # x's gradient reads the pattern's kept column lengths (grad_TL): no count in the graph
    assert "DX[c, k, n] = WT[TS[c, q], m, k]" in backward and "aten.ne." not in backward
    padding = torch.arange(layer.AK.shape[1]) >= layer.AL[:, None]
    assert bool(padding.any()) and bool((grads[1][padding] == 0).all())


def test_from_linear_and_magnitude_prune():
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 8)
    W = linear.weight.detach()
    pruned = magnitude_prune(W, 0.75)
    assert int((pruned != 0).sum()) == 32
    assert pruned.abs().min() == 0 and pruned.abs().max() == W.abs().max()
    blocks = magnitude_prune(W, 0.5, block=(4, 4))
    per_block = (blocks.view(2, 4, 4, 4) != 0).any(3).any(1).sum()
    assert int(per_block) == 4
    layer = SparseLinear.from_linear(linear, "BlockGroupCOO", sparsity=0.5, block=(4, 4), backend="torch")
    torch.testing.assert_close(layer.to_dense(), blocks)
    x = torch.randn(3, 16)
    torch.testing.assert_close(layer(x), x @ blocks.T + linear.bias)
    nm = SparseLinear(16, 8, format="NM", n=2, m=4, vector_len=1, backend="torch")
    assert ((nm.to_dense().view(8, 4, 4) != 0).sum(-1) <= 2).all()


def test_errors():
    layer = layer_for("GroupCOO", {})
    with pytest.raises(InsumShapeError, match="12"):
        layer(torch.randn(3, 5, dtype=torch.float64))
    with pytest.raises(InsumError, match="n:m"):
        SparseLinear(8, 8, format="NM", sparsity=0.5)
    with pytest.raises(InsumError, match="sparsity"):
        magnitude_prune(torch.randn(3, 3), 1.5)
    with pytest.raises(InsumError, match="unknown format"):
        SparseLinear(8, 8, format="CSR")
    # Found by fuzzing: a bad block raised ZeroDivisionError or a bare RuntimeError, and
    # coarsen="tune" built a layer or refused it by the clock (after packing and timing).
    for block in (0, (0, 2), (2, -1), (2,)):
        with pytest.raises(InsumError, match="block"):
            magnitude_prune(torch.randn(4, 4), 0.5, block)
    for coarsen in (2, "tune"):
        with pytest.raises(InsumError, match="cannot be coarsened"):
            SparseLinear(20, 12, format="BlockGroupCOO", sparsity=0.5, block=(2, 4), coarsen=coarsen)
        with pytest.raises(InsumError, match="cannot be coarsened"):
            SparseLinear.from_dense(torch.randn(20, 12), None, "BlockGroupCOO", block=(2, 4), coarsen=coarsen)


@pytest.mark.skipif(not INTERPRET, reason="the generated kernels need TRITON_INTERPRET=1 on the CPU")
@pytest.mark.parametrize(
    "fmt, params", [FORMATS[i] for i in (0, 2, 3, 4, 6)], ids=[IDS[i] for i in (0, 2, 3, 4, 6)]
)
def test_triton_forward_and_backward_match_the_lowering(fmt, params):
    results = []
    for backend in ("torch", "triton"):
        layer = layer_for(fmt, params, backend=backend, dtype=torch.float32, precision="ieee")
        x = torch.randn(5, 12, generator=torch.Generator().manual_seed(3), requires_grad=True)
        y = layer(x)
        y.square().sum().backward()
        results.append((y, x.grad, layer.bias.grad, *[p.grad for n, p in layer.named_parameters() if n != "bias"]))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_block_ell_training_step_captured_in_a_cuda_graph():
    """A Block-ELL layer's forward and backward captured in a CUDA graph (the input
    gradient's zero slot made during the capture, not taken from the shared cache, nor left
    in it) replay to the eager gradients; an eager step after the capture is unchanged."""
    from insum.formats import transposed

    torch.manual_seed(3)
    layer = SparseLinear(64, 48, format="BlockGroupCOO", block=(16, 16), group_size="row", sparsity=0.5,
                         precision="ieee").cuda()
    x = torch.randn(32, 64, device="cuda", requires_grad=True)
    gy = torch.randn(32, 48, device="cuda")

    def step():
        for t in (x, *layer.parameters()):
            t.grad = None
        layer(x).backward(gy)
        return x.grad.clone(), layer.AV.grad.clone(), layer.bias.grad.clone()

    eager = step()
    transposed._ZERO_SLOTS.clear()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm on a side stream, as capture asks
    torch.cuda.current_stream().wait_stream(side)
    transposed._ZERO_SLOTS.clear()
    graph = torch.cuda.CUDAGraph()
    for t in (x, *layer.parameters()):
        t.grad = None
    with torch.cuda.graph(graph):
        layer(x).backward(gy)
    assert not transposed._ZERO_SLOTS  # (made in the graph's pool: not kept)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip((x.grad, layer.AV.grad, layer.bias.grad), eager):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for got, want in zip(step(), eager):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt, params", FORMATS, ids=IDS)
def test_forward_mode_tangent_of_x_values_and_bias(fmt, params):
    """Forward-mode AD through a layer (its autograd Functions had no jvp: torch raised, and
    under no_grad the pinned product dropped x's tangent): tx W^T + x tW^T + tb."""
    import torch.autograd.forward_ad as fwAD

    layer = layer_for(fmt, params, bias=True)
    gen = torch.Generator().manual_seed(4)
    x, vx = (torch.randn(3, 12, dtype=torch.float64, generator=gen) for _ in range(2))
    values = {n: p for n, p in layer.named_parameters() if n != "bias"}
    tvalues = {n: torch.randn(p.shape, dtype=p.dtype, generator=gen) * (p != 0) for n, p in values.items()}
    tbias = torch.randn(layer.bias.shape, dtype=torch.float64, generator=gen)
    W = layer.to_dense().detach()
    tW = layer.weight._over(tvalues).to_dense()
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            layer(x), layer(x)  # (the pinned repeat)
            with fwAD.dual_level():
                y = layer(fwAD.make_dual(x, vx))
                torch.testing.assert_close(fwAD.unpack_dual(y).tangent, vx @ W.t())
                duals = {n: fwAD.make_dual(p.detach(), tvalues[n]) for n, p in values.items()}
                duals["bias"] = fwAD.make_dual(layer.bias.detach(), tbias)
                y = torch.func.functional_call(layer, duals, (fwAD.make_dual(x, vx),))
                torch.testing.assert_close(fwAD.unpack_dual(y).tangent, vx @ W.t() + x @ tW.t() + tbias)


@pytest.mark.parametrize("fmt, params", FORMATS, ids=IDS)
def test_pattern_edited_in_place_is_followed_or_refused(fmt, params):
    """Found by fuzzing: an index buffer edited in place (`layer.AK.copy_(...)`, no
    assignment) left the layer's transposed pattern, gradient tables and frozen slots as they
    were: x's gradient and a step followed the old pattern. The plan follows the buffers'
    versions now, and an edit between forward and backward raises as torch's ops do."""
    layer = layer_for(fmt, params)
    name = "AK" if "AK" in layer._tensor_names else next(n for n in layer._tensor_names if n != "AV")
    index = getattr(layer, name)
    x = torch.randn(4, 12, dtype=torch.float64)
    layer(x).sum().backward()
    with torch.no_grad():  # another pattern of the same shape (still in range)
        index.copy_(torch.flip(index, dims=(0,)) if index.dim() else index)
    for p in layer.parameters():
        p.grad = None
    xx = x.clone().requires_grad_(True)
    y = layer(xx)
    y.square().sum().backward()
    W = layer.to_dense().detach().clone().requires_grad_(True)
    xr = x.clone().requires_grad_(True)
    (xr @ W.t() + layer.bias.detach()).square().sum().backward()
    torch.testing.assert_close(y, xr.detach() @ W.detach().t() + layer.bias.detach())
    torch.testing.assert_close(xx.grad, xr.grad)
    y = layer(x.clone().requires_grad_(True))
    with torch.no_grad():
        index.copy_(torch.flip(index, dims=(0,)) if index.dim() else index)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_hessian_vector_product_with_create_graph_keeps_frozen_slots_tangent():
    """Found by fuzzing: in a double backward the frozen slots read as constants through
    `detach`, which dropped a forward-mode tangent placed on them (a Hessian-vector product
    off by 0.8); the constant keeps its tangent now."""
    import torch.autograd.forward_ad as fwAD

    torch.manual_seed(0)
    layer = SparseLinear(4, 4, format="ELL", sparsity=0.5, backend="torch", dtype=torch.float64, bias=False)
    assert layer._frozen_names
    AV = layer.AV.detach().clone()
    tAV = torch.randn_like(AV)  # padding slots included
    x = torch.randn(2, 4, dtype=torch.float64)

    def gx(values):
        xl = x.clone().requires_grad_(True)
        y = torch.func.functional_call(layer, {"AV": values}, (xl,))
        return torch.autograd.grad(torch.sin(y).sum(), xl, create_graph=True)[0]

    want = (gx(AV + 1e-5 * tAV) - gx(AV - 1e-5 * tAV)) / 2e-5
    with fwAD.dual_level():
        got = fwAD.unpack_dual(gx(fwAD.make_dual(AV.clone().requires_grad_(True), tAV))).tangent
    torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-6)
