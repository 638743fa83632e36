"""SparseLinear keeps its format object across forwards (outside torch.compile), so that a
repeated forward runs its product pinned (`insum.execute.Pinned`); values updated in place
are read by the next call, and a replaced tensor, `load_state_dict` or `.double()` drops
what is kept. Each test compares with a float64 dense product; the kernels run in the
interpreter at small sizes."""

from __future__ import annotations

import copy

import pytest
import torch
from kernel_env import CUDA  # before insum: the interpreter on CPU-only machines
from torch import nn

from insum.formats import repeat
from insum.nn import SparseLinear
from insum.nn.sparse_autograd import format_meta, rebuild_format

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(CUDA, reason="CPU tensors in the interpreter"),
]


def _layer(seed: int = 0, fmt: str = "GroupCOO") -> SparseLinear:
    torch.manual_seed(seed)
    return SparseLinear(13, 7, format=fmt, sparsity=0.5, backend="triton", precision="ieee")


def _reference(layer: SparseLinear, x: torch.Tensor) -> torch.Tensor:
    W = layer.weight.to_dense().double()
    return x.double() @ W.t() + layer.bias.double()


def _pinned(layer: SparseLinear) -> bool:
    plans = layer.weight.__dict__.get("_spmm_plans")
    return plans is not None and any(plan.pinned is not None for plan in plans.values())


def _x(seed: int, rows: int = 5) -> torch.Tensor:
    return torch.randn(rows, 13, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fmt", ["GroupCOO", "ELL"])
def test_repeated_forward_is_pinned_and_reads_in_place_updates(fmt):
    layer = _layer(fmt=fmt)
    weight = layer.weight
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    for step in range(4):
        x = _x(step)
        y = layer(x)
        torch.testing.assert_close(y.double(), _reference(layer, x), rtol=1e-5, atol=1e-5)
        optimizer.zero_grad()
        y.square().sum().backward()
        optimizer.step()  # values changed in place: read by the next forward
    assert layer.weight is weight and _pinned(layer)
    with torch.no_grad():
        x = _x(9)
        torch.testing.assert_close(layer(x).double(), _reference(layer, x), rtol=1e-5, atol=1e-5)


def test_repeated_backward_matches_the_dense_gradients():
    layer = _layer(1)
    for seed in range(3):
        x = _x(seed).requires_grad_(True)
        layer.zero_grad()
        layer(x).square().sum().backward()
        W = layer.weight.to_dense().detach().double().requires_grad_(True)
        xd = x.detach().double().requires_grad_(True)
        (xd @ W.t() + layer.bias.double()).square().sum().backward()
        torch.testing.assert_close(x.grad.double(), xd.grad, rtol=1e-5, atol=1e-5)
        # Every trained slot's gradient is dW at its position; padding is frozen (zero).
        torch.testing.assert_close(layer.AV.grad.double().reshape(-1), _at_slots(layer, W.grad), rtol=1e-5, atol=1e-5)


def _at_slots(layer: SparseLinear, dW: torch.Tensor) -> torch.Tensor:
    """A scalar-slot layer's expected value gradient: dW at each slot's position, 0 at its
    frozen slots (padding: `frozen_slots`)."""
    fmt = layer.weight
    rows = fmt._slot_rows()[0].expand_as(fmt.AK).reshape(-1).long()
    expected = dW[rows, fmt.AK.reshape(-1).long()]
    if "AV" in layer._frozen_names:
        expected = expected.masked_fill(layer.frozen_AV.reshape(-1), 0)
    return expected


def test_replaced_parameter_drops_the_kept_format():
    layer = _layer()
    for _ in range(3):
        layer(_x(0))
    weight = layer.weight
    layer.AV = nn.Parameter(torch.randn(layer.AV.shape))
    assert layer.weight is not weight and layer.weight.AV is layer.AV
    x = _x(1)
    torch.testing.assert_close(layer(x).double(), _reference(layer, x), rtol=1e-5, atol=1e-5)


def test_load_state_dict_with_assign_drops_the_kept_format():
    layer, twin = _layer(), _layer()  # same seed: same pattern
    with torch.no_grad():
        twin.AV.mul_(-3)
    for _ in range(3):
        layer(_x(0))
    weight = layer.weight
    layer.load_state_dict(twin.state_dict(), assign=True)
    assert layer.weight is not weight and layer.weight.AV is layer.AV
    x = _x(2)
    torch.testing.assert_close(layer(x), twin(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer(x).double(), _reference(layer, x), rtol=1e-5, atol=1e-5)


def test_module_conversion_drops_the_kept_format():
    layer = _layer()
    for _ in range(3):
        layer(_x(0))
    AV = layer.AV
    layer.double()  # the same Parameter object, its data swapped
    assert layer.AV is AV and layer.weight.dtype == torch.float64 and layer.weight.AV.dtype == torch.float64
    x = _x(3).double()
    y = layer(x)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, _reference(layer, x), rtol=1e-9, atol=1e-9)
    layer.to("cpu")
    torch.testing.assert_close(layer(x), _reference(layer, x), rtol=1e-9, atol=1e-9)


def test_a_deep_copy_keeps_its_own_format():
    layer = _layer()
    for _ in range(3):
        layer(_x(0))
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        layer.AV.mul_(2)
    assert twin.weight.AV is twin.AV
    x = _x(4)
    torch.testing.assert_close(twin(x).double(), _reference(twin, x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer(x).double(), _reference(layer, x), rtol=1e-5, atol=1e-5)


def test_functional_call_runs_on_the_tensors_it_swaps_in():
    layer = _layer()
    x = _x(5)
    for _ in range(3):
        before = layer(x)
    doubled = {name: p * 2 if name == "AV" else p for name, p in layer.named_parameters()}
    y = torch.func.functional_call(layer, doubled, (x,))  # swaps the module's dicts' entries
    W = layer.weight.to_dense().detach().double()
    torch.testing.assert_close(y.double(), x.double() @ (2 * W).t() + layer.bias.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer(x), before)  # the layer's own tensors again
    assert layer.weight.AV is layer.AV


def test_block_ell_layer_skips_its_padding_forward_and_backward():
    """A Block-ELL layer (declared padding) on the triton backend: padding poisoned with NaN
    is skipped by the forward (declared lengths) and by x's gradient (the transposed pattern
    leaves it out); the padding's own gradient is zero. Checked against float64."""
    torch.manual_seed(4)
    layer = SparseLinear(24, 32, format="BlockGroupCOO", sparsity=0.6, block=(8, 8), group_size="row",
                         backend="triton", precision="ieee")
    counts = layer.weight.declared_lengths()["q[p]"]
    padding = torch.arange(layer.AK.shape[1]) >= counts[:, None]
    assert bool(padding.any())
    W = layer.weight.to_dense().detach().double()
    with torch.no_grad():
        layer.AV[padding] = float("nan")
    for seed in range(2):  # the first call, then the kept format's repeat
        x = _x(seed, rows=6).repeat(1, 2)[:, :24].clone().requires_grad_(True)
        y = layer(x)
        xd = x.detach().double().requires_grad_(True)
        yd = xd @ W.t() + layer.bias.double()
        torch.testing.assert_close(y.double(), yd, rtol=1e-5, atol=1e-5)
        layer.zero_grad()
        y.square().sum().backward()
        yd.square().sum().backward()
        torch.testing.assert_close(x.grad.double(), xd.grad, rtol=1e-5, atol=1e-5)
        assert bool((layer.AV.grad[padding] == 0).all())


def test_transposed_pattern_keeps_its_column_lengths():
    """The input gradient's declared column lengths (TL) are a buffer of the layer's pattern,
    read as they are on every backward; a pattern without them (a layer saved before they
    were kept) has them counted once per pattern tensor and again after an in-place change.
    The gradient is right either way."""
    from insum.formats import transposed

    torch.manual_seed(3)
    layer = SparseLinear(40, 24, format="BlockGroupCOO", block=(8, 8), group_size="row", sparsity=0.6,
                         backend="triton", precision="ieee")
    x = torch.randn(5, 40, requires_grad=True)
    layer(x).sum().backward()
    buffers = dict(layer.named_buffers())
    TS, TL = buffers["grad_TS"], buffers["grad_TL"]
    G, g = layer.weight.AV.shape[:2]
    zero_slot = G * g  # with_zero_slot appends it after every stored slot
    torch.testing.assert_close(TL, (TS != zero_slot).sum(1).to(TL.dtype))
    assert transposed._column_lengths({"TS": TS, "TL": TL}, zero_slot)["lengths"]["q[c]"] is TL
    expected = layer.to_dense().double().sum(0).expand(5, 40)
    x.grad = None
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad.double(), expected, rtol=1e-6, atol=1e-6)

    first = transposed._column_lengths({"TS": TS}, zero_slot)["lengths"]["q[c]"]
    assert transposed._column_lengths({"TS": TS}, zero_slot)["lengths"]["q[c]"] is first
    torch.testing.assert_close(first, TL.to(first.dtype))
    TS.add_(0)  # an in-place change: counted again
    assert transposed._column_lengths({"TS": TS}, zero_slot)["lengths"]["q[c]"] is not first
    del layer._buffers["grad_TL"]  # the pattern as an older layer kept it
    layer._pattern_names = ("TS", "TR")
    x.grad = None
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad.double(), expected, rtol=1e-6, atol=1e-6)


def test_block_ell_layer_runs_in_inference_mode():
    """A Block-ELL layer built and run under torch.inference_mode: its block counts are
    inference tensors (no version counter), so their program order is sorted per call."""
    from insum.execute import longest_first

    with torch.inference_mode():
        torch.manual_seed(4)
        layer = SparseLinear(40, 24, format="BlockGroupCOO", block=(8, 8), group_size="row", sparsity=0.6,
                             backend="triton", precision="ieee")
        x = torch.randn(5, 40)
        y = layer(x)
        counts = torch.tensor([1, 3, 2], dtype=torch.int32)
        assert longest_first(counts).tolist() == [1, 2, 0]
    expected = x.double() @ layer.to_dense().double().t() + layer.bias.double()
    torch.testing.assert_close(y.double(), expected, rtol=1e-6, atol=1e-6)


def _value_gradient_dense(layer: SparseLinear) -> torch.Tensor:
    """The layer's values' gradient placed on its pattern, as a dense float64 matrix."""
    fmt = layer.weight
    tensors = {**fmt.tensors, "AV": layer.AV.grad}
    return rebuild_format(type(fmt), fmt.shape, format_meta(fmt), tensors).to_dense().double()


def _gradient_sites(layer: SparseLinear) -> list:
    """The kept format's gradient call sites (`insum.formats.repeat`)."""
    return list((layer.weight.__dict__.get("_repeated") or {}).values())


@pytest.mark.parametrize("fmt", ["ELL", "Block-ELL", "NM"])
def test_repeated_backward_runs_its_gradients_pinned_and_reads_in_place_updates(fmt):
    """A layer's backward calls its gradient statements pinned to the packed tensors from
    its second step on (x's gradient on the transposed pattern; Block-ELL's values' gradient
    on the stored blocks), and its forward adds the bias in the product's epilogue. Values
    updated in place between steps, dy of another layout, and a pattern changed in place (a
    recount of its lengths) all give the float64 output and gradients."""
    torch.manual_seed(5)
    kwargs = {
        "ELL": dict(format="ELL", sparsity=0.6),
        "Block-ELL": dict(format="BlockGroupCOO", block=(8, 8), group_size="row", sparsity=0.6),
        "NM": dict(format="NM", n=2, m=4, vector_len=8),
    }[fmt]
    layer = SparseLinear(24, 16, backend="triton", precision="ieee", **kwargs)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.05)

    def check(seed: int, transposed_dy: bool = False) -> None:
        x = _x(seed, rows=6).repeat(1, 2)[:, :24].clone().requires_grad_(True)
        dy = torch.randn(6, 16, generator=torch.Generator().manual_seed(seed + 100))
        if transposed_dy:
            dy = dy.t().contiguous().t()
        W = layer.weight.to_dense().detach().double().requires_grad_(True)
        xd = x.detach().double().requires_grad_(True)
        bd = layer.bias.detach().double().requires_grad_(True)
        yd = xd @ W.t() + bd
        yd.backward(dy.double())
        optimizer.zero_grad()
        y = layer(x)
        torch.testing.assert_close(y.double(), yd, rtol=1e-5, atol=1e-5)
        y.backward(dy)
        torch.testing.assert_close(x.grad.double(), xd.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer.bias.grad.double(), bd.grad, rtol=1e-5, atol=1e-5)
        fmt_now = layer.weight
        if fmt == "ELL":  # every trained slot's gradient is dW at its position, the padding's zero
            assert layer._frozen_names == ("AV",)
            torch.testing.assert_close(layer.AV.grad.double().reshape(-1), _at_slots(layer, W.grad), rtol=1e-5,
                                       atol=1e-5)
        else:  # the stored blocks' gradients in place (the padding's zero), against dW on the pattern
            stored = fmt_now.to_dense() != 0
            torch.testing.assert_close(_value_gradient_dense(layer), W.grad * stored, rtol=1e-5, atol=1e-5)
        optimizer.step()  # values change in place: the next backward reads them

    for seed in range(3):
        check(seed)
    sites = _gradient_sites(layer)
    assert sites and all(site.pinned is not None for site in sites)
    plans = list(layer.weight.__dict__["_spmm_plans"].values())
    assert all(plan.fused and plan.pinned is not None for plan in plans)  # the bias in the epilogue
    full_path = []  # calls that went through insum() instead of the pinned launch
    original = repeat.insum
    repeat.insum = lambda *args, **kwargs: full_path.append(args[0]) or original(*args, **kwargs)
    try:
        check(3)
    finally:
        repeat.insum = original
    assert full_path == []
    check(7, transposed_dy=True)  # another dy layout: its own call site
    pattern = next(t for name, t in layer.named_buffers() if name.startswith("grad_"))
    pattern.add_(0)  # the pattern changed in place (ELL, Block-ELL: its lengths counted anew, a new tensor)
    for seed in (8, 9):
        check(seed)


@pytest.mark.parametrize("block", [(32, 32), (16, 64)])
def test_block_ell_value_gradient_in_groups_of_one_block_row(block):
    """Block-ELL's values' gradient runs J stored blocks of one block row per program
    (`GROUPED_GRADIENT`, J * bk = 128): rows whose count is no multiple of J, and an empty
    row, give the float64 gradient on every stored block and zero on the padding."""
    torch.manual_seed(6)
    bm, bk = block
    keep = torch.rand(5, 6) < 0.6
    keep[2] = False  # an empty block row
    keep[0] = True  # a full one: 6 blocks, J = 128 // bk groups of them
    W = torch.randn(5 * bm, 6 * bk) * keep.repeat_interleave(bm, 0).repeat_interleave(bk, 1)
    layer = SparseLinear.from_dense(W, None, "BlockGroupCOO", block=block, group_size="row", backend="triton",
                                    precision="ieee")
    groups = layer.weight._stored_groups()
    J = 128 // bk
    assert groups is not None and groups["GF"].shape[1] == J
    assert groups["GF"].unique().numel() == groups["GF"].numel()  # padding writes its own scratch slots
    x = _x(1, rows=3).repeat(1, 40)[:, : 6 * bk].clone()
    dy = torch.randn(3, 5 * bm, generator=torch.Generator().manual_seed(2))
    layer(x).backward(dy)
    dense_grad = dy.double().t() @ x.double()  # dW for y = x W^T
    fmt = layer.weight
    grads = _value_gradient_dense(layer)
    stored = keep.repeat_interleave(bm, 0).repeat_interleave(bk, 1)
    torch.testing.assert_close(grads, dense_grad * stored, rtol=1e-5, atol=1e-5)
    padding = torch.arange(fmt.AK.shape[1]) >= fmt.declared_lengths()["q[p]"][:, None]
    assert bool((layer.AV.grad[padding] == 0).all())


def test_forward_without_gradients_runs_the_product_directly(monkeypatch):
    """Under no_grad (and inference_mode) the layer's forward calls its kept format's product
    with the bias, not the autograd Function; with gradients it goes through the Function.
    Both give the float64 output."""
    from insum.nn import sparse_autograd

    layer = _layer(7, fmt="ELL")
    applied = []
    real = sparse_autograd._KeptLinearFunction.apply
    monkeypatch.setattr(sparse_autograd._KeptLinearFunction, "apply",
                        lambda *args: applied.append(1) or real(*args))
    x = _x(3)
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            for _ in range(3):  # the first call, then the pinned repeat
                torch.testing.assert_close(layer(x).double(), _reference(layer, x), rtol=1e-5, atol=1e-5)
    assert applied == []
    y = layer(x)
    assert applied == [1] and y.requires_grad
    torch.testing.assert_close(y.double(), _reference(layer, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt_name, params", [
    ("NM", {"n": 2, "m": 4, "vector_len": 4}),
    ("BlockGroupCOO", {"block": (4, 4), "group_size": "row", "sparsity": 0.5}),
    ("GroupCOO", {"sparsity": 0.5}),
], ids=["NM", "BlockELL", "GroupCOO"])
def test_frozen_weights_give_x_its_gradient_without_the_operand(monkeypatch, fmt_name, params):
    """With the values frozen, the backward runs x's gradient on the transposed pattern only:
    it never builds x's operand view (a transposing copy for formats that gather its rows)."""
    torch.manual_seed(2)
    layer = SparseLinear(12, 8, format=fmt_name, backend="triton", precision="ieee", **params)
    for p in layer.parameters():
        p.requires_grad_(False)
    x = torch.randn(5, 12, requires_grad=True)
    y = layer(x)
    fmt_cls = type(layer.weight)
    made = []
    real = fmt_cls.operand
    monkeypatch.setattr(fmt_cls, "operand", lambda self, B: made.append(B.shape) or real(self, B))
    dy = torch.randn_like(y)
    y.backward(dy)
    assert made == []
    torch.testing.assert_close(x.grad.double(), dy.double() @ layer.to_dense().double(), rtol=1e-5, atol=1e-5)
    assert all(p.grad is None for p in layer.parameters())


def _float64_gradients(layer: SparseLinear, x: torch.Tensor, gy: torch.Tensor):
    """x's, each value tensor's and the bias's gradients of (x W^T + b) · gy in float64,
    W the layer's format rebuilt around float64 copies of its values (`to_dense` is
    differentiable: each slot's gradient is the dense gradient where it points)."""
    fmt = layer.weight
    values = {n: t.detach().double().requires_grad_() for n, t in fmt._tensors.items() if t.is_floating_point()}
    W = rebuild_format(type(fmt), fmt.shape, format_meta(fmt), {**fmt._tensors, **values}).to_dense()
    xd = x.detach().double().requires_grad_()
    b = None if layer.bias is None else layer.bias.detach().double().requires_grad_()
    y = xd @ W.t()
    ((y if b is None else y + b) * gy.double()).sum().backward()
    return xd.grad, {n: v.grad for n, v in values.items()}, None if b is None else b.grad


@pytest.mark.parametrize("fmt_name, params", [
    ("GroupCOO", {"sparsity": 0.5}),
    ("BlockGroupCOO", {"block": (4, 4), "group_size": "row", "sparsity": 0.5}),
    ("CELL", {"sparsity": 0.5}),
], ids=["GroupCOO", "BlockELL", "CELL"])
@pytest.mark.parametrize("lead, bias", [((), True), ((2,), True), ((), False)], ids=["2d", "3d", "2d-no-bias"])
def test_kept_function_gradients_match_float64(fmt_name, params, lead, bias):
    """Outside torch.compile the layer's autograd Function takes x, the bias and the value
    tensors only (`_KeptLinearFunction`): x's, the values' and the bias's gradients match
    float64 autograd over repeated steps (the pinned repeats), for 2-D x (no reshape node
    between x and the Function) and 3-D x (Block-ELL: its stored blocks; its padding stays
    zero), with a bias and without. Index tensors get no gradient."""
    torch.manual_seed(4)
    layer = SparseLinear(12, 8, bias=bias, format=fmt_name, backend="triton", precision="ieee", **params)
    for step in range(3):
        x = torch.randn(*lead, 5, 12, generator=torch.Generator().manual_seed(step)).requires_grad_()
        gy = torch.randn(*lead, 5, 8, generator=torch.Generator().manual_seed(10 + step))
        for p in layer.parameters():
            p.grad = None
        y = layer(x)
        if not lead:
            assert type(y.grad_fn).__name__ == "_KeptLinearFunctionBackward"
            assert y.grad_fn.next_functions[0][0].variable is x  # straight to x's accumulation
        y.backward(gy)
        dx, dvalues, db = _float64_gradients(layer, x.reshape(-1, 12), gy.reshape(-1, 8))
        torch.testing.assert_close(x.grad.double().reshape(-1, 12), dx, rtol=1e-5, atol=1e-5)
        if bias:
            torch.testing.assert_close(layer.bias.grad.double(), db, rtol=1e-5, atol=1e-5)
        else:
            assert layer.bias is None and db is None
        lengths = layer.weight.declared_lengths()
        for name, expected in dvalues.items():
            got = getattr(layer, name).grad.double()
            if lengths is not None:  # Block-ELL: the stored blocks; padding left zero
                stored = torch.arange(got.shape[1]) < next(iter(lengths.values()))[:, None]
                assert bool((got[~stored] == 0).all())
                got, expected = got[stored], expected[stored]
            elif name in layer._frozen_names:  # padding slots: frozen, zero
                frozen = getattr(layer, "frozen_" + name)
                assert bool((got[frozen] == 0).all())
                got, expected = got[~frozen], expected[~frozen]
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for name, t in layer.weight._tensors.items():
        if not t.is_floating_point():
            assert getattr(layer, name).grad is None


def test_functional_sparse_linear_differentiates_computed_values():
    """`sparse_linear` on a format whose values are computed from a parameter (not a leaf)
    passes their gradient on through the kept Function."""
    from insum import nn as inn
    from insum.formats import GroupCOO

    torch.manual_seed(6)
    A = torch.randn(8, 12) * (torch.rand(8, 12) < 0.5)
    fmt = GroupCOO.from_dense(A)
    scale = torch.tensor(1.5, requires_grad=True)
    tensors = dict(fmt._tensors)
    tensors["AV"] = tensors["AV"] * scale
    scaled = rebuild_format(type(fmt), fmt.shape, format_meta(fmt), tensors)
    x = torch.randn(5, 12)
    y = inn.sparse_linear(x, scaled, None, backend="triton", precision="ieee")
    y.sum().backward()
    expected = (x.double() @ A.double().t()).sum()  # d/dscale of sum(x (scale A)^T)
    torch.testing.assert_close(scale.grad.double(), expected, rtol=1e-5, atol=1e-5)


def test_zero_slot_is_made_once_and_stays_zero():
    """`with_zero_slot` appends one zero slot, the same zero tensor for every call of a
    slot shape, dtype and device (a fill less per backward), another for another kind."""
    from insum.formats import transposed

    values = torch.randn(6, 2, 3)
    first = transposed.with_zero_slot(values)
    second = transposed.with_zero_slot(values * 2)
    assert first.shape == (7, 2, 3) and bool((first[-1] == 0).all()) and bool((second[-1] == 0).all())
    torch.testing.assert_close(first[:-1], values)
    key = (values.shape[1:], values.dtype, values.device)
    assert key in transposed._ZERO_SLOTS
    half = transposed.with_zero_slot(values.half())
    assert half.dtype == torch.float16 and transposed._ZERO_SLOTS[key].dtype == torch.float32
    assert transposed.with_zero_slot(torch.randn(0, 2, 3)).shape == (1, 2, 3)
