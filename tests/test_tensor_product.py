"""insum.nn tensor products against e3nn's own modules (weights copied), on the CPU.

The torch backend runs the layer's statement through the reference lowering; one tiny case
runs the generated kernel in the Triton interpreter. e3nn is built in float64 (its CG
constants follow the default dtype at construction) so that float64 results agree to 1e-12.
"""

from __future__ import annotations

import os

import pytest
import torch

from insum import InsumError, insum
from insum.nn import FullyConnectedTensorProduct, Irreps, TensorProduct, wigner_3j
from insum.nn.irreps import Irrep
from insum.nn.tensor_product import mace_instructions

o3 = pytest.importorskip("e3nn.o3")


@pytest.fixture(autouse=True)
def _float64_default():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-10) -> None:
    assert actual.shape == expected.shape
    assert torch.isfinite(actual).all()
    scale = expected.abs().max().clamp_min(1.0)
    assert (actual - expected).abs().max() <= tol * scale, (actual - expected).abs().max()


def _close_gradients(layer, ref, x1, x2, w) -> None:
    """The layer's float32 gradients of all three inputs against the float64 reference's."""
    inputs = [t.float().requires_grad_() for t in (x1, x2, w)]
    grads = torch.autograd.grad(layer(*inputs).sum(), inputs)
    leaves = [t.clone().requires_grad_() for t in (x1, x2, w)]
    for got, want in zip(grads, torch.autograd.grad(ref(*leaves).sum(), leaves)):
        _close(got.double(), want, 1e-5)


def _mace(irreps1, irreps2, lmax):
    """insum's MACE paths with e3nn's irreps (the layers under test take either)."""
    irreps_out, ins = mace_instructions(irreps1, irreps2, lmax)
    return o3.Irreps(str(irreps_out)), ins


@pytest.mark.parametrize("irreps1,irreps2,target", [
    ("3x0e+2x1o+2e", "0e+1o+2e+3o", 3),
    ("4x0o+4x1e+2x0e", "1o+0e", 2),
    ("2x0e+2x1o", "0e+1o", "0e+1o+1e"),
])
def test_mace_instructions_follow_e3nn_sort(irreps1, irreps2, target):
    """MACE's construction, written with e3nn's Irreps.sort as the reference."""
    irreps1, irreps2 = o3.Irreps(irreps1), o3.Irreps(irreps2)
    allowed = [o3.Irrep(l, (-1) ** l) for l in range(target + 1)] if isinstance(target, int) else [ir for _, ir in o3.Irreps(target)]  # noqa: E741
    outs, ins = [], []
    for i, (mul, ir1) in enumerate(irreps1):
        for j, (_, ir2) in enumerate(irreps2):
            for ir in ir1 * ir2:
                if ir in allowed:
                    ins.append((i, j, len(outs), "uvu", True))
                    outs.append((mul, ir))
    expected, perm, _ = o3.Irreps(outs).sort()
    irreps_out, got = mace_instructions(irreps1, irreps2, target)
    assert str(irreps_out) == str(expected)
    assert got == [(a, b, perm[c], m, w) for a, b, c, m, w in ins]


def test_wigner_3j_equals_e3nn():
    for l1 in range(4):
        for l2 in range(4):
            for l3 in range(abs(l1 - l2), min(l1 + l2, 4) + 1):
                _close(wigner_3j(l1, l2, l3), o3.wigner_3j(l1, l2, l3, dtype=torch.float64), 1e-13)
    assert wigner_3j(0, 1, 3).abs().max() == 0  # outside the triangle


def test_irreps_parse_and_print():
    irreps = Irreps("16x0e + 8x1o+2e+1y")
    assert str(irreps) == "16x0e+8x1o+1x2e+1x1o"
    assert irreps.dim == 16 + 24 + 5 + 3
    assert Irreps(o3.Irreps("3x1o+2x2e")).entries == ((3, Irrep(1, -1)), (2, Irrep(2, 1)))
    assert Irreps([(2, (1, -1))]).dim == 6


@pytest.mark.parametrize(
    "irreps1, irreps2, irreps_out",
    [
        ("5x0e+3x1o", "0e+1o", "4x0e+2x1o"),  # multiplicities differ between all three
        ("3x0e+2x1o+1x2e+2x1e", "2x0e+1o+2e", "2x0o+3x1o+2e+1x3o"),  # parities, mul2 > 1, unreachable 0o
        ("3x0e+3x1o+3x2e+3x3o", "0e+1o+2e+3o", "3x0e+3x1o+3x2e+3x3o"),  # the paper's grid, L = 3
    ],
)
def test_fully_connected_equals_e3nn(irreps1, irreps2, irreps_out):
    torch.manual_seed(0)
    ref = o3.FullyConnectedTensorProduct(irreps1, irreps2, irreps_out)
    layer = FullyConnectedTensorProduct.from_e3nn(ref, backend="torch")
    assert layer.weight_numel == ref.weight_numel
    x1, x2 = torch.randn(7, ref.irreps_in1.dim), torch.randn(7, ref.irreps_in2.dim)
    _close(layer(x1, x2), ref(x1, x2))
    # Built from the irreps alone, with the weights copied: the same product.
    fresh = FullyConnectedTensorProduct(irreps1, irreps2, irreps_out, backend="torch")
    with torch.no_grad():
        fresh.weight.copy_(ref.weight)
    _close(fresh(x1, x2), ref(x1, x2))
    # Leading dimensions broadcast as in e3nn.
    _close(layer(x1.view(7, 1, -1), x2[:3]), ref(x1.view(7, 1, -1), x2[:3]))


@pytest.mark.parametrize("irrep_normalization, path_normalization", [("norm", "path"), ("none", "none")])
def test_normalisations_equal_e3nn(irrep_normalization, path_normalization):
    torch.manual_seed(1)
    args = ("2x0e+2x1o", "0e+1o", "3x0e+1x1o")
    options = dict(irrep_normalization=irrep_normalization, path_normalization=path_normalization)
    ref = o3.FullyConnectedTensorProduct(*args, **options)
    layer = FullyConnectedTensorProduct(*args, backend="torch", **options)
    with torch.no_grad():
        layer.weight.copy_(ref.weight)
    x1, x2 = torch.randn(4, 8), torch.randn(4, 4)
    _close(layer(x1, x2), ref(x1, x2))


@pytest.mark.parametrize("shared", [True, False])
def test_channel_wise_equals_e3nn(shared):
    torch.manual_seed(2)
    irreps1, irreps2 = o3.Irreps("4x0e+4x1o+4x2e"), o3.Irreps("0e+1o+2e+3o")
    irreps_out, ins = _mace(irreps1, irreps2, 3)
    ref = o3.TensorProduct(irreps1, irreps2, irreps_out, ins, shared_weights=shared, internal_weights=shared)
    layer = TensorProduct.from_e3nn(ref, backend="torch")
    x1, x2 = torch.randn(6, irreps1.dim), torch.randn(6, irreps2.dim)
    if shared:
        _close(layer(x1, x2), ref(x1, x2))
    else:
        w = torch.randn(6, ref.weight_numel)
        _close(layer(x1, x2, w), ref(x1, x2, w))


def test_channel_wise_with_second_multiplicity():
    torch.manual_seed(3)
    irreps1, irreps2, irreps_out = o3.Irreps("3x0e+2x1o"), o3.Irreps("2x0e+2x1o"), o3.Irreps("3x1o+2x0e+2x1o")
    ins = [(0, 1, 0, "uvu", True), (1, 1, 1, "uvu", True), (1, 0, 2, "uvu", True)]
    ref = o3.TensorProduct(irreps1, irreps2, irreps_out, ins)
    layer = TensorProduct.from_e3nn(ref, backend="torch")
    x1, x2 = torch.randn(5, irreps1.dim), torch.randn(5, irreps2.dim)
    _close(layer(x1, x2), ref(x1, x2))


def test_gradients_equal_e3nn_and_gradcheck():
    torch.manual_seed(4)
    args = ("2x0e+1x1o", "0e+1o", "1x0e+2x1o")
    ref = o3.FullyConnectedTensorProduct(*args)
    layer = FullyConnectedTensorProduct.from_e3nn(ref, backend="torch")
    x1 = torch.randn(3, 5, requires_grad=True)
    x2 = torch.randn(3, 4, requires_grad=True)
    g = torch.randn(3, ref.irreps_out.dim)
    mine = torch.autograd.grad(layer(x1, x2), [x1, x2, layer.weight], g)
    theirs = torch.autograd.grad(ref(x1, x2), [x1, x2, ref.weight], g)
    for a, b in zip(mine, theirs):
        _close(a, b)
    # Shared weights passed in (internal_weights=False): gradcheck through all three.
    external = FullyConnectedTensorProduct(*args, internal_weights=False, backend="torch")
    weight = torch.randn(external.weight_numel, requires_grad=True)
    assert torch.autograd.gradcheck(external, (x1, x2, weight))


@pytest.mark.parametrize("case", ["uvw uniform", "uvw padded", "uvu per-edge", "uvu second multiplicity", "uvw broadcast",
                                  "uvu buckets", "uvw buckets"])
def test_all_gradients_equal_e3nn(case):
    """Every input's gradient against e3nn's, over the layouts the layer treats apart: a
    weight already in slab order (a view) or gathered, padded channels and outputs, per-edge
    weights, broadcast leading dimensions."""
    torch.manual_seed(7)
    if case.startswith("uvw"):
        args = ("3x0e+3x1o", "0e+1o", "3x0e+3x1o") if case != "uvw padded" else ("2x0e+1x1o", "0e+1o", "1x0e+2x1o")
        ref = o3.FullyConnectedTensorProduct(*args)
    elif case in ("uvu per-edge", "uvu buckets"):
        irreps_out, ins = _mace(o3.Irreps("4x0e+4x1o"), o3.Irreps("0e+1o+2e"), 2)
        ref = o3.TensorProduct("4x0e+4x1o", "0e+1o+2e", irreps_out, ins, shared_weights=False, internal_weights=False)
    else:
        ins = [(0, 1, 0, "uvu", True), (1, 1, 1, "uvu", True), (1, 0, 2, "uvu", True)]
        ref = o3.TensorProduct("3x0e+2x1o", "2x0e+2x1o", "3x1o+2x0e+2x1o", ins)
    if case == "uvw buckets":
        ref = o3.FullyConnectedTensorProduct("2x0e+2x1o+1x2e", "0e+1o+2e", "2x0e+3x1o+1x2e")
    layer = TensorProduct.from_e3nn(ref, backend="torch", output="gather", row_buckets=3 if case.endswith("buckets") else 1)
    assert bool(layer._buckets) == case.endswith("buckets")  # rows of unequal entry counts: several launches
    assert layer._identity_w == (case in ("uvw uniform", "uvw broadcast", "uvu per-edge", "uvu buckets"))
    assert layer._pad_x == layer._pad_dz == (case in ("uvw padded", "uvu second multiplicity", "uvw buckets"))
    assert ("PR[p]" in layer.statement) == (case in ("uvu per-edge", "uvu buckets"))  # one weight slab per output component
    lead1, lead2 = ((2, 1), (1, 3)) if case == "uvw broadcast" else ((4,), (4,))
    x1 = torch.randn(*lead1, ref.irreps_in1.dim, requires_grad=True)
    x2 = torch.randn(*lead2, ref.irreps_in2.dim, requires_grad=True)
    if ref.internal_weights:
        inputs, mine_w, theirs_w = (x1, x2), layer.weight, ref.weight
    else:
        w = torch.randn(4, ref.weight_numel, requires_grad=True)
        inputs, mine_w, theirs_w = (x1, x2, w), w, w
    g = torch.randn(*torch.broadcast_shapes(lead1, lead2), ref.irreps_out.dim)
    mine = torch.autograd.grad(layer(*inputs), [x1, x2, mine_w], g)
    theirs = torch.autograd.grad(ref(*inputs), [x1, x2, theirs_w], g)
    for a, b in zip(mine, theirs):
        _close(a, b)


def test_channel_wise_gradcheck_per_edge_weights():
    torch.manual_seed(5)
    irreps1, irreps2 = o3.Irreps("2x0e+2x1o"), o3.Irreps("0e+1o")
    irreps_out, ins = _mace(irreps1, irreps2, 1)
    layer = TensorProduct(irreps1, irreps2, irreps_out, ins, shared_weights=False, backend="torch")
    x1 = torch.randn(3, irreps1.dim, requires_grad=True)
    x2 = torch.randn(3, irreps2.dim, requires_grad=True)
    w = torch.randn(3, layer.weight_numel, requires_grad=True)
    assert torch.autograd.gradcheck(layer, (x1, x2, w))


@pytest.mark.interpreter
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter is chosen before triton is imported")
def test_generated_kernel_in_the_interpreter():
    """The layer's statement through the generated kernel (CPU: the Triton interpreter)."""
    torch.manual_seed(6)
    ref = o3.FullyConnectedTensorProduct("2x0e+2x1o", "0e+1o", "2x0e+3x1o")
    layer = FullyConnectedTensorProduct.from_e3nn(ref, backend="triton", precision="ieee").float()
    x1 = torch.randn(5, 8, dtype=torch.float32, requires_grad=True)
    x2 = torch.randn(5, 4, dtype=torch.float32, requires_grad=True)
    out = layer(x1, x2)
    _close(out.double(), ref(x1.double(), x2.double()), 1e-5)
    # Every gradient statement (with its declared lengths) through the generated kernels.
    grads = torch.autograd.grad(out, [x1, x2, layer.weight], torch.ones_like(out))
    expected = torch.autograd.grad(ref(x1.double(), x2.double()).sum(), [x1, x2, ref.weight])
    for got, want in zip(grads, expected):
        _close(got.double(), want.double(), 1e-5)


@pytest.mark.interpreter
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter is chosen before triton is imported")
def test_channel_wise_generated_kernel_in_the_interpreter():
    """The MACE-like product (one weight slab per output component) through the generated kernel."""
    torch.manual_seed(8)
    irreps_out, ins = _mace(o3.Irreps("3x0e+3x1o"), o3.Irreps("0e+1o"), 1)
    ref = o3.TensorProduct("3x0e+3x1o", "0e+1o", irreps_out, ins, shared_weights=False, internal_weights=False)
    x1, x2, w = torch.randn(5, 12), torch.randn(5, 4), torch.randn(5, ref.weight_numel)
    for row_buckets in (1, 2):  # one launch; two, each writing its rows of Z through a strided view
        layer = TensorProduct.from_e3nn(ref, backend="triton", precision="ieee", output="gather", row_buckets=row_buckets).float()
        assert "PR[p]" in layer.statement and len(layer._buckets) == (0 if row_buckets == 1 else 2)
        _close(layer(x1.float(), x2.float(), w.float()).double(), ref(x1, x2, w), 1e-5)
    # output="indexed": the output stored in e3nn's layout through ZO (plain stores, no fill)
    indexed = TensorProduct.from_e3nn(ref, backend="triton", precision="ieee", output="indexed").float()
    _close(indexed(x1.float(), x2.float(), w.float()).double(), ref(x1, x2, w), 1e-5)
    tensors = indexed.statement_tensors(x1.float(), x2.float(), w.float())
    tensors["Z"].fill_(float("nan"))  # every output element is stored (ZO: a permutation, no zero fill)
    out = insum(indexed.statement, backend="triton", precision="ieee", **indexed.statement_facts(), **tensors)
    _close(out.double(), ref(x1, x2, w), 1e-5)
    from insum.bind import bind
    from insum.execute import length_facts
    from insum.parser import parse
    from insum.runtime import kernel_for

    facts = indexed.statement_facts()
    bound, declared = length_facts(bind(parse(indexed.statement), tensors), facts["lengths"])
    launcher = kernel_for(bound, "ieee", unique_indices=facts["unique_indices"], lengths=declared).prepared(bound)
    assert not launcher.zero_fill  # ZO covers the output: plain stores only
    # The channel-wise gradient statements (declared lengths) through the generated kernels.
    _close_gradients(layer, ref, x1, x2, w)


@pytest.mark.parametrize("shared", [True, False])
def test_indexed_output_equals_e3nn_to_second_derivatives(shared):
    """output="indexed" (x1 gathered, the output stored in e3nn's layout through ZO): the
    output, every input's gradient and their second-order gradients against e3nn's."""
    torch.manual_seed(12)
    irreps_out, ins = _mace(o3.Irreps("2x0e+2x1o"), o3.Irreps("0e+1o+2e"), 2)
    ref = o3.TensorProduct("2x0e+2x1o", "0e+1o+2e", irreps_out, ins, shared_weights=shared, internal_weights=shared).double()
    layer = TensorProduct.from_e3nn(ref, backend="torch", output="indexed").double()
    assert layer.statement.startswith("Z[b,ZO[p,u]] =") and layer.statement_facts()["unique_indices"] == {"ZO"}
    x1 = torch.randn(3, ref.irreps_in1.dim, requires_grad=True)
    x2 = torch.randn(3, ref.irreps_in2.dim, requires_grad=True)
    w = None if shared else torch.randn(3, ref.weight_numel, requires_grad=True)
    probe = torch.randn(3, ref.irreps_in1.dim)

    def run(module):
        weight = module.weight if shared else w
        out = module(x1, x2) if shared else module(x1, x2, w)
        first = torch.autograd.grad((out * out).sum(), [x1, x2, weight], create_graph=True)
        return [out, *first, *torch.autograd.grad((first[0] * probe).sum(), [x1, x2, weight])]

    for got, want in zip(run(layer), run(ref)):
        _close(got, want, 1e-9)


def test_empty_batch_and_no_internal_weights():
    layer = FullyConnectedTensorProduct("2x0e", "0e", "1x0e", backend="torch")
    assert layer(torch.randn(0, 2), torch.randn(0, 1)).shape == (0, 1)
    external = FullyConnectedTensorProduct("2x0e", "0e", "1x0e", shared_weights=False, backend="torch")
    with pytest.raises(InsumError, match="no internal weights"):
        external(torch.randn(3, 2), torch.randn(3, 1))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Irreps("16x0q"), "cannot read the term"),
        (lambda: Irreps("3x"), "cannot read the term"),
        (lambda: FullyConnectedTensorProduct("2x0e", "1o", "2x1e"), None),  # no path: allowed, zeros
        (lambda: TensorProduct("2x0e", "0e", "3x0e", [(0, 0, 0, "uvu")]), "'uvu' needs"),
        (lambda: TensorProduct("2x0e", "0e", "2x1o", [(0, 0, 0, "uvw")]), "is not in"),
        (lambda: TensorProduct("2x0e", "0e", "2x0e", [(0, 0, 1, "uvw")]), "no entry 1"),
        (lambda: TensorProduct("2x0e", "0e", "2x0e", [(0, 0, 0, "uuu")]), "connection mode"),
        (lambda: TensorProduct("2x0e", "0e", "2x0e", [(0, 0, 0, "uvw", False)]), "without weights"),
        (lambda: FullyConnectedTensorProduct("2x0e", "0e", "2x0e", path_normalization="x"), "path_normalization"),
        (lambda: FullyConnectedTensorProduct("2x0e", "0e", "2x0e", output="views", row_buckets=2), "row_buckets"),
        (lambda: FullyConnectedTensorProduct("2x0e+1x1o", "0e", "2x0e+1x1o", output="direct"), "one multiplicity"),
        (lambda: FullyConnectedTensorProduct("2x0e", "0e", "2x0e", output="flat"), "'uvu'"),
        (lambda: FullyConnectedTensorProduct("2x0e+1x1o", "0e", "2x0e+1x1o", output="indexed"), "one multiplicity"),
        # Found by fuzzing: a negative multiplicity failed inside numpy, an index of 0.5 read as 0.
        (lambda: Irreps([(-1, (0, 1))]), "multiplicities must be integers >= 0"),
        (lambda: TensorProduct("2x0e", "0e", "2x0e", [(0.5, 0, 0, "uvw")]), "must be an integer index"),
        (lambda: wigner_3j(1.0, 1, 1), "integer degrees"),
    ],
)
def test_bad_irreps_raise(make, match):
    if match is None:
        layer = make()
        layer.backend = "torch"
        assert layer(torch.randn(2, 2), torch.randn(2, 3)).abs().max() == 0
        return
    with pytest.raises(InsumError, match=match):
        make()


@pytest.mark.parametrize("output", ["gather", "views", "flat"])
@pytest.mark.parametrize("irreps_out, i_out", [("3x0e+2x0e", 1), ("2x0e+3x0e", 0)])
def test_uvu_output_entry_no_path_feeds_wider_than_the_inputs(output, irreps_out, i_out):
    """Found by fuzzing: "uvu" tables were as wide as irreps_in1's largest multiplicity, so an
    output entry that no path feeds, wider than every input entry, took another row's
    position (a copied value, silently) or raised an IndexError building the tables."""
    ins = [(0, 0, i_out, "uvu", True)]
    ref = o3.TensorProduct("2x0e", "0e", irreps_out, ins)
    layer = TensorProduct.from_e3nn(ref, backend="torch", output=output)
    x1, x2 = torch.randn(4, 2), torch.randn(4, 1)
    _close(layer(x1, x2), ref(x1, x2))


@pytest.mark.parametrize("output", ["gather", "views"])
def test_a_zero_path_weight_keeps_the_other_paths(output):
    """Found by fuzzing: output="views" trimmed each row to its nonzero CG values, and a path of
    path_weight 0 lists its (zero) entries first, so the real entries after them were cut off:
    zeros instead of e3nn's output."""
    ins = [(0, 0, 0, "uvw", True, 0.0), (0, 0, 0, "uvw", True, 1.0)]
    ref = o3.TensorProduct("1x1o", "1x1o", "1x0e", ins)
    layer = TensorProduct.from_e3nn(ref, backend="torch", output=output)
    x1, x2 = torch.randn(3, 3), torch.randn(3, 3)
    _close(layer(x1, x2), ref(x1, x2))


def test_shared_weights_refuse_a_weight_per_sample():
    """Found by fuzzing: a shared-weight layer given weight[batch, numel] used its first row for
    every sample (e3nn refuses the shape)."""
    layer = FullyConnectedTensorProduct("2x0e+1x1o", "0e+1o", "2x0e+3x1o", internal_weights=False, backend="torch")
    with pytest.raises(InsumError, match="shares one weight"):
        layer(torch.randn(3, 5), torch.randn(3, 4), torch.randn(3, layer.weight_numel))
    layer(torch.randn(3, 5), torch.randn(3, 4), torch.randn(1, layer.weight_numel))  # (one row is one weight)


def test_empty_batches_and_empty_irreps_give_zeros_with_gradients():
    """Found by fuzzing: an empty batch returned zeros cut off from autograd (backward raised),
    and irreps of dimension 0 raised index errors naming internal tensors; e3nn gives zeros and
    zero gradients."""
    layer = FullyConnectedTensorProduct("2x0e+1x1o", "0e+1o", "2x0e", backend="torch")
    x1 = torch.randn(0, 5, requires_grad=True)
    layer(x1, torch.randn(0, 4)).sum().backward()
    assert x1.grad.shape == (0, 5) and layer.weight.grad.abs().max() == 0
    for irreps1, irreps2, irreps_out in (("5x0e", "0x0e", "3x0e"), ("0x0e", "1o", "2x1o")):
        layer = FullyConnectedTensorProduct(irreps1, irreps2, irreps_out, backend="torch")
        ref = o3.FullyConnectedTensorProduct(irreps1, irreps2, irreps_out)
        x1 = torch.randn(2, Irreps(irreps1).dim, requires_grad=True)
        x2 = torch.randn(2, Irreps(irreps2).dim)
        out = layer(x1, x2)
        _close(out, ref(x1, x2))
        out.sum().backward()
        assert x1.grad is not None and not x1.grad.any()


def test_operands_that_are_not_float_tensors_raise():
    layer = FullyConnectedTensorProduct("2x0e", "0e", "1x0e", backend="torch")
    with pytest.raises(InsumError, match="0-d tensor"):
        layer(torch.tensor(1.0), torch.randn(1))
    with pytest.raises(InsumError, match="floating-point"):
        layer(torch.ones(2, 2, dtype=torch.int32), torch.randn(2, 1))


def test_wrong_feature_count_names_the_input():
    layer = FullyConnectedTensorProduct("2x0e+1o", "0e", "1x0e", backend="torch")
    with pytest.raises(InsumError, match="x1 has 4 features"):
        layer(torch.randn(3, 4), torch.randn(3, 1))
    with pytest.raises(InsumError, match="x2 has 2 features"):
        layer(torch.randn(3, 5), torch.randn(3, 2))


@pytest.mark.parametrize("mode", ["uvw", "uvu"])
def test_views_output_equals_gather_output(mode):
    """output="views" (a launch per run of equal output entries into e3nn's layout) and
    the default gather agree, forward and backward, with multiplicities that differ."""
    torch.manual_seed(7)
    if mode == "uvw":
        ref = o3.FullyConnectedTensorProduct("3x0e+2x1o", "0e+1o", "2x0e+3x1o+1x1o+2x2e")
        args = ()
    else:
        irreps1, irreps2 = o3.Irreps("3x0e+3x1o+3x2e"), o3.Irreps("0e+1o+2e")
        irreps_out, ins = _mace(irreps1, irreps2, 2)
        ref = o3.TensorProduct(irreps1, irreps2, irreps_out, ins, shared_weights=False, internal_weights=False)
        args = (torch.randn(4, ref.weight_numel, requires_grad=True),)
    x1 = torch.randn(4, ref.irreps_in1.dim, requires_grad=True)
    x2 = torch.randn(4, ref.irreps_in2.dim, requires_grad=True)
    expected = ref(x1, x2, *args)
    g = torch.randn_like(expected)
    want = torch.autograd.grad(expected, [x1, x2, *args], g)
    for output in ("gather", "views"):
        layer = TensorProduct.from_e3nn(ref, backend="torch", output=output)
        out = layer(x1, x2, *args)
        _close(out, expected)
        for a, b in zip(torch.autograd.grad(out, [x1, x2, *args], g), want):
            _close(a, b)


@pytest.mark.parametrize("case", ["per-edge", "shared", "second multiplicity"])
def test_flat_output_equals_e3nn_forward_and_backward(case):
    """output="flat" (one statement reading x1 and the weight and writing the output in
    e3nn's layouts) against e3nn: the output and every gradient, on 5 edges and on one."""
    torch.manual_seed(11)
    if case == "second multiplicity":  # entries of several multiplicities, a weight position per CG entry
        ins = [(0, 1, 0, "uvu", True), (1, 1, 1, "uvu", True), (1, 0, 2, "uvu", True)]
        ref = o3.TensorProduct("3x0e+2x1o", "2x0e+2x1o", "3x1o+2x0e+2x1o", ins)
    else:
        irreps_out, ins = _mace(o3.Irreps("3x0e+3x1o+3x2e"), o3.Irreps("0e+1o+2e+3o"), 3)
        shared = case == "shared"
        ref = o3.TensorProduct("3x0e+3x1o+3x2e", "0e+1o+2e+3o", irreps_out, ins, shared_weights=shared, internal_weights=shared)
    layer = TensorProduct.from_e3nn(ref, backend="torch", output="flat")
    assert ("FR[t]" in layer.statement) == (case != "second multiplicity")  # one weight position per output
    for edges in (5, 1):
        x1 = torch.randn(edges, ref.irreps_in1.dim, requires_grad=True)
        x2 = torch.randn(edges, ref.irreps_in2.dim, requires_grad=True)
        w = layer.weight if ref.internal_weights else torch.randn(edges, ref.weight_numel, requires_grad=True)
        extra = () if ref.internal_weights else (w,)
        expected = ref(x1, x2, *extra)
        out = layer(x1, x2, *extra)
        _close(out, expected)
        g = torch.randn_like(expected)
        mine = torch.autograd.grad(out, [x1, x2, w], g)
        theirs = torch.autograd.grad(expected, [x1, x2, ref.weight if ref.internal_weights else w], g)
        for a, b in zip(mine, theirs):
            _close(a, b)
    if ref.internal_weights:  # leading dimensions broadcast as in e3nn (expanded, non-contiguous inputs)
        x1, x2 = torch.randn(5, 1, ref.irreps_in1.dim), torch.randn(3, ref.irreps_in2.dim)
        _close(layer(x1, x2), ref(x1, x2))
    # the statement as documented: insum(layer.statement, **facts, **tensors), lengths over t
    x1, x2 = torch.randn(4, ref.irreps_in1.dim), torch.randn(4, ref.irreps_in2.dim)
    w = None if ref.internal_weights else torch.randn(4, ref.weight_numel)
    facts = layer.statement_facts()
    assert set(facts["lengths"]) == {"q[t]"}
    out = insum(layer.statement, backend="torch", **facts, **layer.statement_tensors(x1, x2, w))
    _close(out.reshape(4, -1), ref(x1, x2, *(() if w is None else (w,))))


def test_flat_statements_plan_edges_by_contiguous_outputs_at_mace_scale():
    """The plans the flat layer's cost argument rests on, at MACE's size (10,000 edges of
    128x0e+128x1o+128x2e x sh(3); shapes only): edges on M, the e3nn output (or gradient)
    positions on N, the CG entries on K up to each tile's declared length, every output
    element stored once by its owner (no atomics, no zero fill)."""
    import re

    from insum.bind import bind
    from insum.codegen import schedule
    from insum.execute import length_facts
    from insum.parser import parse
    from insum.runtime import spec_for

    irreps_out, ins = mace_instructions("128x0e+128x1o+128x2e", "0e+1o+2e+3o", 3)
    layer = TensorProduct("128x0e+128x1o+128x2e", "0e+1o+2e+3o", irreps_out, ins, shared_weights=False, output="flat")
    E = 10_000
    flat = {"Y": (E, 16), "X": (E, 1152), "W": (E, layer.weight_numel), "DZ": (E, irreps_out.dim)}
    cases = [(layer.statement, "q[t]", "FL", "t")] + [
        (stmt, f"q[{column}]", f"G{key}L", column) for (key, stmt), column in zip(layer.gradient_statements.items(), "srj")]
    for stmt, key, length, column in cases:
        names = re.findall(r"([A-Z][A-Z0-9]*)\[", stmt.split("=", 1)[1])  # the output is allocated
        tensors = {n: torch.empty(flat[n], device="meta") if n in flat else layer._buffers[n].to("meta") for n in names}
        bound, declared = length_facts(bind(parse(stmt), tensors), {key: layer._buffers[length].to("meta")})
        plan = schedule(spec_for(bound, lengths=declared))
        assert dict(plan.tiles) == {"M": "b", "K": "q", "N": column} and plan.grid == () and plan.loops == (), stmt
        assert plan.output == "store" and plan.covers_output and plan.lengths, stmt


def test_flat_output_shared_weight_gradient_over_batch_groups():
    """768 edges: the shared weight's flat gradient statement runs on 3 batch groups, summed."""
    torch.manual_seed(14)
    irreps_out, ins = _mace(o3.Irreps("2x0e+2x1o"), o3.Irreps("0e+1o"), 1)
    ref = o3.TensorProduct("2x0e+2x1o", "0e+1o", irreps_out, ins)
    layer = TensorProduct.from_e3nn(ref, backend="torch", output="flat")
    x1, x2 = torch.randn(768, 8), torch.randn(768, 4)
    g = torch.randn(768, ref.irreps_out.dim)
    (mine,) = torch.autograd.grad(layer(x1, x2), [layer.weight], g)
    (theirs,) = torch.autograd.grad(ref(x1, x2), [ref.weight], g)
    _close(mine, theirs)


def test_flat_output_gradcheck_and_compile():
    torch.manual_seed(12)
    irreps1, irreps2 = o3.Irreps("2x0e+2x1o"), o3.Irreps("0e+1o")
    irreps_out, ins = _mace(irreps1, irreps2, 1)
    layer = TensorProduct(irreps1, irreps2, irreps_out, ins, shared_weights=False, backend="torch", output="flat")
    x1 = torch.randn(3, irreps1.dim, requires_grad=True)
    x2 = torch.randn(3, irreps2.dim, requires_grad=True)
    w = torch.randn(3, layer.weight_numel, requires_grad=True)
    assert torch.autograd.gradcheck(layer, (x1, x2, w))
    compiled = torch.compile(layer, fullgraph=True)
    out = compiled(x1, x2, w)
    _close(out, layer(x1, x2, w))
    for a, b in zip(torch.autograd.grad(out.sum(), [x1, x2, w]), torch.autograd.grad(layer(x1, x2, w).sum(), [x1, x2, w])):
        _close(a, b)


@pytest.mark.interpreter
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter is chosen before triton is imported")
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_flat_output_generated_kernel_in_the_interpreter(index_dtype):
    """output="flat" through the generated kernel, int32 and int64 tables, 1 and 7 edges,
    into e3nn's layout directly (the output is allocated by insum: no zero fill, no gather)."""
    torch.manual_seed(13)
    irreps_out, ins = _mace(o3.Irreps("3x0e+3x1o"), o3.Irreps("0e+1o"), 1)
    ref = o3.TensorProduct("3x0e+3x1o", "0e+1o", irreps_out, ins, shared_weights=False, internal_weights=False)
    layer = TensorProduct.from_e3nn(ref, backend="triton", precision="ieee", output="flat").float()
    for name in ("FJ", "FX", "FR", "FL"):
        setattr(layer, name, getattr(layer, name).to(index_dtype))
    for edges in (1, 7):
        x1, x2, w = torch.randn(edges, 12), torch.randn(edges, 4), torch.randn(edges, ref.weight_numel)
        _close(layer(x1.float(), x2.float(), w.float()).double(), ref(x1, x2, w), 1e-5)
    _close_gradients(layer, ref, x1, x2, w)


def test_shared_weight_gradient_split_over_batch_groups():
    """A batch of 768 splits the shared weight's gradient into 3 groups (summed after)."""
    from insum.nn.tensor_product import _batch_groups

    assert _batch_groups(768) == 3 and _batch_groups(10_000) == 25 and _batch_groups(9973) == 1
    torch.manual_seed(8)
    ref = o3.FullyConnectedTensorProduct("2x0e+1x1o", "0e+1o", "1x0e+2x1o")
    layer = FullyConnectedTensorProduct.from_e3nn(ref, backend="torch")
    x1, x2 = torch.randn(768, 5), torch.randn(768, 4)
    g = torch.randn(768, ref.irreps_out.dim)
    (mine,) = torch.autograd.grad(layer(x1, x2), [layer.weight], g)
    (theirs,) = torch.autograd.grad(ref(x1, x2), [ref.weight], g)
    _close(mine, theirs)


@pytest.mark.parametrize("row_buckets", [1, 2])
def test_torch_compile_fullgraph_forward_and_backward(row_buckets):
    torch.manual_seed(9)
    ref = o3.FullyConnectedTensorProduct("2x0e+2x1o", "0e+1o", "2x0e+2x1o")
    layer = FullyConnectedTensorProduct.from_e3nn(ref, backend="torch", row_buckets=row_buckets)
    assert len(layer._buckets) == (0 if row_buckets == 1 else 2)
    compiled = torch.compile(layer, fullgraph=True)
    x1 = torch.randn(5, 8, requires_grad=True)
    x2 = torch.randn(5, 4, requires_grad=True)
    out = compiled(x1, x2)
    _close(out, ref(x1, x2))
    mine = torch.autograd.grad(out.sum(), [x1, x2, layer.weight])
    theirs = torch.autograd.grad(ref(x1, x2).sum(), [x1, x2, ref.weight])
    for a, b in zip(mine, theirs):
        _close(a, b)


def test_converted_tables_follow_the_module_dtype():
    """The per-dtype copies of the CG values are dropped by .to()/.float()/.double()."""
    torch.manual_seed(10)
    ref = o3.FullyConnectedTensorProduct("2x0e+1x1o", "0e+1o", "1x0e+1x1o")
    layer = FullyConnectedTensorProduct.from_e3nn(ref, backend="torch").float()
    x1, x2 = torch.randn(3, 5), torch.randn(3, 4)
    _close(layer(x1.float(), x2.float()).double(), ref(x1, x2), 1e-5)
    layer.double()
    with torch.no_grad():
        layer.weight.copy_(ref.weight)  # .float() rounded the weights; the CG values must not be
    _close(layer(x1, x2), ref(x1, x2))


# --- output="direct": x1 read and the output written in e3nn's layout by the statements ---

_DIRECT_CASES = {
    "paper grid": ("3x0e+3x1o", "0e+1o", "3x0e+3x1o"),
    "in1 and out multiplicities differ": ("2x0e+2x1o+2x2e", "0e+1o+2e", "3x0e+3x1o+3x2e"),
    "mul2 > 1 (weight gathered), output 1o first": ("2x0e+2x1o", "2x0e+1x1o", "3x1o+3x0e"),
}


@pytest.mark.parametrize("case", list(_DIRECT_CASES))
def test_direct_layout_equals_e3nn(case):
    """output="auto" takes "direct" where every multiplicity of input 1 is one and so is the
    output's: forward and every gradient against e3nn (float64, torch lowering)."""
    torch.manual_seed(11)
    ref = o3.FullyConnectedTensorProduct(*_DIRECT_CASES[case])
    layer = FullyConnectedTensorProduct.from_e3nn(ref, backend="torch")
    assert layer.output == "direct" and "ZO[p,w]" in layer.statement
    assert layer._identity_w == (case != "mul2 > 1 (weight gathered), output 1o first")
    x1 = torch.randn(5, ref.irreps_in1.dim, requires_grad=True)
    x2 = torch.randn(5, ref.irreps_in2.dim, requires_grad=True)
    out = layer(x1, x2)
    _close(out, ref(x1, x2))
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, [x1, x2, layer.weight], g),
                    torch.autograd.grad(ref(x1, x2), [x1, x2, ref.weight], g)):
        _close(a, b)
    with torch.no_grad():  # again: the pinned repeat
        _close(layer(x1, x2), ref(x1, x2))
        _close(layer(x1, x2), ref(x1, x2))
    assert (layer._fast is not None) == layer._identity_w  # a gathered weight takes the full path


def test_direct_layout_per_edge_weights_and_gradcheck():
    """"uvw" with one weight vector per batch element, and gradcheck of the direct path."""
    torch.manual_seed(12)
    irreps = ("2x0e+2x1o", "0e+1o", "2x0e+2x1o")
    ins = [(i, j, k, "uvw", True) for i, j, k in ((0, 0, 0), (1, 1, 0), (0, 1, 1), (1, 0, 1))]
    ref = o3.TensorProduct(*irreps, ins, shared_weights=False, internal_weights=False)
    layer = TensorProduct.from_e3nn(ref, backend="torch")
    assert layer.output == "direct"
    x1, x2 = torch.randn(3, 8, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    w = torch.randn(3, ref.weight_numel, requires_grad=True)
    _close(layer(x1, x2, w), ref(x1, x2, w))
    assert torch.autograd.gradcheck(layer, (x1, x2, w))
    shared = FullyConnectedTensorProduct(*irreps, internal_weights=False, backend="torch")
    assert shared.output == "direct"
    assert torch.autograd.gradcheck(shared, (x1, x2, torch.randn(shared.weight_numel, requires_grad=True)))


def test_direct_layout_repeat_follows_the_weight_and_the_inputs():
    """The repeated no-grad forward (pinned) sees in-place weight updates, a replaced weight
    (.data or a new Parameter), another batch, non-contiguous inputs and gradients."""
    torch.manual_seed(13)
    ref = o3.FullyConnectedTensorProduct("2x0e+2x1o", "0e+1o", "2x0e+2x1o")
    layer = FullyConnectedTensorProduct.from_e3nn(ref, backend="torch")
    x1, x2 = torch.randn(4, 8), torch.randn(4, 4)
    with torch.no_grad():
        for _ in range(3):
            _close(layer(x1, x2), ref(x1, x2))
        fast = layer._fast
        assert fast is not None
        layer.weight.mul_(2)
        ref.weight.mul_(2)
        _close(layer(x1, x2), ref(x1, x2))
        layer.weight.data = torch.randn(layer.weight_numel)
        ref.weight.copy_(layer.weight)
        _close(layer(x1, x2), ref(x1, x2))
        swapped = torch.randn(layer.weight_numel)  # a weight swapped in for one call
        ref.weight.copy_(swapped)
        _close(torch.func.functional_call(layer, {"weight": swapped}, (x1, x2)), ref(x1, x2))
        layer.weight = torch.nn.Parameter(torch.randn(layer.weight_numel))
        assert layer._fast is None  # assigning an attribute drops what was kept
        ref.weight.copy_(layer.weight)
        _close(layer(x1, x2), ref(x1, x2))
        for a, b in ((x1[:1], x2[:1]), (torch.randn(8, 7)[:, :4].t(), torch.randn(7, 4)[::2, :][:4]),
                     (torch.randn(4, 16)[:, ::2], x2)):
            _close(layer(a, b), ref(a, b))  # one row; transposed and strided inputs
            _close(layer(a, b), ref(a, b))
        external = FullyConnectedTensorProduct("2x0e+2x1o", "0e+1o", "2x0e+2x1o", internal_weights=False, backend="torch")
        for _ in range(3):  # a new weight per call, of one signature: the repeat reads each
            w = torch.randn(external.weight_numel)
            ref.weight.copy_(w)
            _close(external(x1, x2, w), ref(x1, x2))
        assert external._fast is not None and external._fast.weight is None  # the caller's weight is not kept
        ref.weight.copy_(layer.weight)
    x1.requires_grad_()
    out = layer(x1, x2)
    assert out.grad_fn is not None  # gradients: the autograd function, not the no-grad launch
    _close(torch.autograd.grad(out.sum(), [x1])[0], torch.autograd.grad(ref(x1, x2).sum(), [x1])[0])


def _work(ops) -> int:
    """The ops counted by `count_ops` that move data (not the allocations, which launch nothing)."""
    return sum(n for name, n in ops.names.items() if name not in ("new_empty", "empty_like"))


class _Launches:
    """Every cached generated kernel's launch replaced by a record of it (the interpreter's
    JIT path): what a layer call launches, and, with `count_ops`, what else it runs."""

    def __init__(self):
        from insum import runtime

        self.runtime, self.count, self.saved = runtime, 0, []

    def __getitem__(self, grid):
        def launch(*args, **config):
            self.count += 1

        return launch

    def __enter__(self):
        stack = list(self.runtime._KERNELS.values()) + list(self.runtime._BY_SIGNATURE.values())
        while stack:
            kernel = stack.pop()
            if all(kernel is not k for k, _ in self.saved):
                self.saved.append((kernel, kernel.fn))
                stack.extend(kernel._siblings.values())
                kernel.fn = self
        return self

    def __exit__(self, *exc):
        for kernel, fn in self.saved:
            kernel.fn = fn


@pytest.mark.interpreter
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter is chosen before triton is imported")
def test_direct_layout_generated_kernel_in_the_interpreter():
    """The direct statements through the generated kernels: batch 1 and 5, int32 and int64
    tables, non-contiguous inputs, forward and every gradient against e3nn; a repeated
    forward is one launch and no other op (no gather, no zero fill), its backward four."""
    from insum.formats.opcount import count_ops

    torch.manual_seed(14)
    ref = o3.FullyConnectedTensorProduct("2x0e+2x1o", "0e+1o", "3x0e+3x1o")
    layer = FullyConnectedTensorProduct.from_e3nn(ref, backend="triton", precision="ieee").float()
    gather = FullyConnectedTensorProduct.from_e3nn(ref, backend="triton", precision="ieee", output="gather").float()
    assert layer.output == "direct"
    for index_dtype, batch in ((torch.int32, 5), (torch.int64, 1)):
        for name in ("XI", "ZO", "CGJ", "CGI", "PW", "CGL"):
            setattr(layer, name, getattr(layer, name).to(index_dtype))
        x1 = torch.randn(batch, 16)[:, ::2].float()  # non-contiguous
        x2 = torch.randn(4, batch).t().float()
        x1g, x2g = x1.clone().requires_grad_(), x2.clone().requires_grad_()
        out = layer(x1g, x2g)
        _close(out.double(), ref(x1.double(), x2.double()), 1e-5)
        g = torch.randn_like(out)
        leaves = [x1.double().requires_grad_(), x2.double().requires_grad_()]
        want = torch.autograd.grad(ref(*leaves), leaves + [ref.weight], g.double())
        for got, expected in zip(torch.autograd.grad(out, [x1g, x2g, layer.weight], g), want):
            _close(got.double(), expected, 1e-5)
        with torch.no_grad():
            _close(layer(x1, x2).double(), ref(x1.double(), x2.double()), 1e-5)
    x1, x2, g = torch.randn(3, 8).float(), torch.randn(3, 4).float(), torch.randn(3, 12).float()
    x1g, x2g = x1.clone().requires_grad_(), x2.clone().requires_grad_()
    for module in (layer, gather):  # each kernel run once (and tuned) before the launches are replaced
        with torch.no_grad():
            module(x1, x2), module(x1, x2)
        torch.autograd.grad(module(x1g, x2g), [x1g, x2g, module.weight], g)
    counts = {}
    for name, module in (("direct", layer), ("gather", gather)):
        with _Launches() as launches, count_ops() as ops, torch.no_grad():
            module(x1, x2)
        counts[name] = (launches.count, _work(ops))
        with _Launches() as launches, count_ops() as ops:
            torch.autograd.grad(module(x1g, x2g), [x1g, x2g, module.weight], g)
        counts[name + " fb"] = (launches.count, _work(ops))
    assert counts["direct"] == (1, 0)
    assert counts["gather"][0] == 1 and counts["gather"][1] >= 2  # x1 and Z gathered
    assert counts["direct fb"] == (5, 0), counts  # forward; dX, T, dY, dW (one batch group: no sum)
    assert counts["gather fb"][1] >= 2, counts  # d_out gathered, dX gathered back


def test_direct_layout_layer_copies_and_pickles_after_repeats():
    """A layer whose statements are pinned copies (`copy.deepcopy`) and pickles (`torch.save`)
    without them; the copy computes with its own weight."""
    import copy
    import io

    torch.manual_seed(15)
    layer = FullyConnectedTensorProduct("2x0e+2x1o", "0e+1o", "2x0e+2x1o", backend="torch")
    x1, x2 = torch.randn(3, 8), torch.randn(3, 4)
    with torch.no_grad():
        expected = layer(x1, x2)
        layer(x1, x2)
    assert layer._fast is not None
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    for clone in (copy.deepcopy(layer), torch.load(buffer, weights_only=False)):
        assert clone._fast is None
        with torch.no_grad():
            _close(clone(x1, x2), expected)
            clone.weight.mul_(2)
            _close(clone(x1, x2), 2 * expected)  # linear in the weight
            _close(clone(x1, x2), 2 * expected)
            _close(layer(x1, x2), expected)


def test_direct_layout_double_backward_equals_e3nn():
    """Second derivatives (a force-field model's gradient of forces) through output="direct":
    the backward's statements read the saved inputs themselves, so the graph reaches them."""
    torch.manual_seed(16)
    ref = o3.FullyConnectedTensorProduct("2x0e+2x1o", "0e+1o", "2x0e+2x1o")
    layer = FullyConnectedTensorProduct.from_e3nn(ref, backend="torch")
    assert layer.output == "direct"
    x1, x2 = torch.randn(3, 8, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    results = []
    for module in (layer, ref):
        (dx2,) = torch.autograd.grad(module(x1, x2).pow(2).sum(), [x2], create_graph=True)
        results.append((dx2, *torch.autograd.grad(dx2.pow(2).sum(), [x1, x2])))
    for a, b in zip(*results):
        _close(a, b)


@pytest.mark.parametrize("case", ["uvw padded", "uvu per-edge", "uvu second multiplicity", "uvu buckets"])
def test_second_derivatives_of_the_gather_path_equal_e3nn(case):
    """Double backward (a gradient taken with create_graph, then differentiated again, as a
    force-field loss on forces does) through output="gather": every input's second-order
    gradient against e3nn's, in float64 on the torch lowering."""
    torch.manual_seed(11)
    if case == "uvw padded":
        ref = o3.FullyConnectedTensorProduct("2x0e+1x1o", "0e+1o", "1x0e+2x1o")
        w = None
    elif case == "uvu second multiplicity":
        ins = [(0, 1, 0, "uvu", True), (1, 1, 1, "uvu", True), (1, 0, 2, "uvu", True)]
        ref = o3.TensorProduct("3x0e+2x1o", "2x0e+2x1o", "3x1o+2x0e+2x1o", ins)
        w = None
    else:
        irreps_out, ins = _mace(o3.Irreps("2x0e+2x1o"), o3.Irreps("0e+1o+2e"), 2)
        ref = o3.TensorProduct("2x0e+2x1o", "0e+1o+2e", irreps_out, ins, shared_weights=False, internal_weights=False)
        w = torch.randn(3, ref.weight_numel, dtype=torch.float64, requires_grad=True)
    ref = ref.double()
    layer = TensorProduct.from_e3nn(ref, backend="torch", output="gather",
                                    row_buckets=3 if case.endswith("buckets") else 1).double()
    x1 = torch.randn(3, ref.irreps_in1.dim, dtype=torch.float64, requires_grad=True)
    x2 = torch.randn(3, ref.irreps_in2.dim, dtype=torch.float64, requires_grad=True)
    probe = torch.randn(3, ref.irreps_in1.dim, dtype=torch.float64)

    def second(module, weight):
        leaves = [x1, x2] + ([weight] if weight is not None else [module.weight])
        out = module(x1, x2, weight) if weight is not None else module(x1, x2)
        (g1,) = torch.autograd.grad((out * out).sum(), [x1], create_graph=True)
        return torch.autograd.grad((g1 * probe).sum(), leaves)

    for got, want in zip(second(layer, w), second(ref, w)):
        _close(got, want, 1e-9)


def test_from_e3nn_keeps_a_float64_modules_weights():
    """A float64 e3nn module's weights were copied into a float32 weight (rounded: 5e-8
    relative off e3nn where float64 gives 1e-16)."""
    torch.manual_seed(4)
    ref = o3.FullyConnectedTensorProduct("2x0e+1x1o", "1x0e+1x1o", "2x0e+1x1o").double()
    with torch.no_grad():
        ref.weight.copy_(torch.randn_like(ref.weight))
    layer = TensorProduct.from_e3nn(ref, backend="torch")
    assert layer.weight.dtype == torch.float64
    x1, x2 = torch.randn(5, 5, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    torch.testing.assert_close(layer(x1, x2), ref(x1, x2), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("output", ["gather", "indexed", "views"])
def test_forward_mode_tangents_of_all_three_inputs(output):
    """Found by fuzzing: the layer's layout copies and pinned launches dropped x1's tangent
    (silently partial with x2 dual too). The product is linear in x1, x2 and the weights:
    its tangent is three products of primals, checked against finite differences."""
    import torch.autograd.forward_ad as fwAD

    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    backend = "triton" if (interpreting or torch.cuda.is_available()) else "torch"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    tp = FullyConnectedTensorProduct("2x0e+2x1o", "0e+1o", "2x0e+2x1o", backend=backend, output=output).double()
    tp = tp.to(device)
    a, b = (torch.randn(5, n, dtype=torch.float64, generator=gen).to(device) for n in (8, 4))
    va, vb, vw = torch.randn_like(a), torch.randn_like(b), torch.randn_like(tp.weight)
    w = tp.weight.detach().clone()
    with torch.no_grad():
        tp(a, b)
        tp(a, b)  # (the pinned repeat)
        h = 1e-6
        want = (tp(a + h * va, b + h * vb, w + h * vw) - tp(a - h * va, b - h * vb, w - h * vw)) / (2 * h)
        with fwAD.dual_level():
            y = tp(fwAD.make_dual(a, va), fwAD.make_dual(b, vb), fwAD.make_dual(w, vw))
            primal, tangent = fwAD.unpack_dual(y)
    torch.testing.assert_close(primal, tp(a, b, w))
    torch.testing.assert_close(tangent, want, rtol=1e-6, atol=1e-6)
