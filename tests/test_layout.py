"""insum.nn.layout: e3nn's irreps layout <-> component-major by block transposes.

Each case builds a layer's layout tables (input 1's and the output's), copies random data
both ways through the generated copy kernels (the Triton interpreter) and compares with
the gather through the same table (torch indexing, the layer's other path), exactly.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from insum.direct import DirectLaunch
from insum.nn import TensorProduct
from insum.nn.layout import BlockLayout, Run
from insum.nn.tensor_product import mace_instructions
from insum.runtime import BatchLaunch

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the interpreter is chosen before triton is imported")


def _layer(case: str, **options) -> TensorProduct:
    if case.startswith("mace"):  # one multiplicity: 0e, 1o, 2e (, 3o) runs of the output
        irreps1, irreps2, lmax = ("2x0e+2x1o", "0e+1o+2e", 2) if case == "mace small" else ("3x0e+3x1o+3x2e", "0e+1o+2e+3o", 3)
        irreps_out, ins = mace_instructions(irreps1, irreps2, lmax)
        return TensorProduct(irreps1, irreps2, irreps_out, ins, shared_weights=False, internal_weights=False, **options)
    # multiplicities 3, 2 and 1 in input 1 (padded channels in X) and in the output (in DZ)
    ins = [(0, 1, 0, "uvu", True), (1, 1, 1, "uvu", True), (1, 0, 2, "uvu", True), (2, 0, 3, "uvu", True)]
    return TensorProduct("3x0e+2x1o+1x2e", "2x0e+2x1o", "3x1o+2x0e+2x1o+1x2e", ins, **options)


def _flat_of(comp: torch.Tensor, inverse: np.ndarray) -> torch.Tensor:
    """The e3nn layout of a component-major tensor: a gather through the inverse table."""
    return comp.reshape(comp.shape[0], -1).index_select(1, torch.from_numpy(inverse))


def _comp_of(flat: torch.Tensor, index: np.ndarray) -> torch.Tensor:
    """The component-major tensor of an e3nn-layout one (a padded channel reads zero)."""
    padded = torch.cat([flat, flat.new_zeros(flat.shape[0], 1)], 1)
    return padded.index_select(1, torch.from_numpy(index.reshape(-1))).view(flat.shape[0], *index.shape)


def _tables(layer: TensorProduct) -> list[tuple[np.ndarray, int]]:
    P = layer.CGV.shape[0]
    return [(layer.X_INDEX.numpy(), layer.irreps_in1.dim), (layer.OUT_INVERSE.numpy().reshape(P, -1), layer.irreps_out.dim)]


def test_runs_read_the_blocks_of_a_layout_table():
    """Runs of equal [U, D] blocks, consecutive in both layouts; None for a table that is not
    made of blocks (a channel past a padded one, a position twice)."""
    layer = _layer("mace", backend="torch")
    x, out = (BlockLayout(index, dim) for index, dim in _tables(layer))
    assert x.runs == (Run(0, 0, 1, 3, 1), Run(3, 1, 1, 3, 3), Run(12, 4, 1, 3, 5))
    assert [(r.n, r.D) for r in out.runs] == [(3, 1), (5, 3), (5, 5), (4, 7)] and not out.padded
    uneven = BlockLayout(*_tables(_layer("uneven", backend="torch"))[0])
    assert uneven.padded and [(r.U, r.D) for r in uneven.runs] == [(3, 1), (2, 3), (1, 1)]
    table = np.array([[0, 2], [1, 3]])  # [U=2, D=1] blocks would need f = 0, 1 in row 0
    assert BlockLayout(table, 4).runs == (Run(0, 0, 1, 2, 2),)  # one 2x(D=2) block
    assert BlockLayout(np.array([[0, 4], [1, 3]]), 4).runs is None
    assert BlockLayout(np.array([[0, 1], [0, 1]]), 2).runs is None
    assert BlockLayout(np.array([[2, 0], [1, 3]]), 4).runs is None


@pytest.mark.interpreter
@interpreted
@pytest.mark.parametrize("case", ["mace", "uneven"])
@pytest.mark.parametrize("dtype,batch", [(torch.float32, 5), (torch.float64, 1), (torch.float16, 3)])
def test_block_transposes_equal_the_gathers(case, dtype, batch, monkeypatch):
    """Both directions, for input 1's and the output's tables, on non-contiguous inputs,
    twice (the second call: all runs in one launch), exactly equal to the gathers."""
    launches = []
    real = DirectLaunch.__call__
    monkeypatch.setattr(DirectLaunch, "__call__", lambda self, *a, **k: launches.append(1) or real(self, *a, **k))
    layer = _layer(case, backend="torch")
    for index, dim in _tables(layer):
        layout = BlockLayout(index, dim)
        rows, channels = index.shape
        for repeat in range(2):
            comp = torch.randn(batch, rows, 2 * channels).to(dtype)[:, :, ::2]  # strided channels
            flat = torch.randn(batch, dim + 3).to(dtype)[:, 3:]
            inverse = np.zeros(dim, dtype=np.int64)
            real_pos = index.reshape(-1) < dim
            inverse[index.reshape(-1)[real_pos]] = np.nonzero(real_pos)[0]
            launches.clear()
            got_flat = layout.to_flat(comp)
            got_comp = layout.to_components(flat)
            assert torch.equal(got_flat, _flat_of(comp.contiguous(), inverse))
            assert torch.equal(got_comp, _comp_of(flat, index))
            if repeat:  # one launch per direction once every run has its tiles
                assert len(launches) == 2 and all(type(p.batch) is BatchLaunch or len(layout.runs) == 1
                                                 for p in layout._prepared.values())


def test_empty_batch_and_a_copy_of_the_layout():
    import copy
    import pickle

    layout = BlockLayout(*_tables(_layer("mace", backend="torch"))[1])
    assert layout.to_flat(torch.randn(0, layout.rows, layout.channels)).shape == (0, layout.flat_dim)
    assert layout.to_components(torch.randn(0, layout.flat_dim)).shape == (0, layout.rows, layout.channels)
    layout._prepared[("key",)] = object()  # launches are not copied
    for other in (copy.deepcopy(layout), pickle.loads(pickle.dumps(layout))):
        assert other.runs == layout.runs and len(other._prepared) == 0


@pytest.mark.interpreter
@interpreted
@pytest.mark.parametrize("case", ["mace small", "uneven"])
def test_gather_layer_runs_its_layout_changes_as_block_transposes(case, monkeypatch):
    """The gather layer on the generated kernels: output, every gradient and (through the
    gathers, which a second derivative needs) second derivatives equal the torch backend's,
    and no layout change (x1, the output, their gradients) runs as index_select in the
    forward or the first backward (a weight with padded slabs still gathers)."""
    torch.manual_seed(3)
    ref = _layer(case, backend="torch").double()
    layer = _layer(case, backend="triton", precision="ieee").double()
    if layer.internal_weights:
        layer.weight.data.copy_(ref.weight.data)
    x1 = torch.randn(4, ref.irreps_in1.dim, dtype=torch.float64, requires_grad=True)
    x2 = torch.randn(4, ref.irreps_in2.dim, dtype=torch.float64, requires_grad=True)
    w = None if ref.internal_weights else torch.randn(4, ref.weight_numel, dtype=torch.float64, requires_grad=True)

    def run(module, create_graph=False):
        weight = module.weight if w is None else w
        out = module(x1, x2) if w is None else module(x1, x2, w)
        grads = torch.autograd.grad((out * out).sum(), [x1, x2, weight], create_graph=create_graph)
        return out, grads

    selects = []
    real = torch.Tensor.index_select
    monkeypatch.setattr(torch.Tensor, "index_select", lambda self, *a: selects.append(a[1].data_ptr()) or real(self, *a))
    got, got_grads = run(layer)
    layouts = {getattr(layer, name).data_ptr() for name in ("X_INDEX", "X_INVERSE", "OUT_INDEX", "OUT_INVERSE")}
    assert not layouts & set(selects)
    monkeypatch.setattr(torch.Tensor, "index_select", real)
    want, want_grads = run(ref)
    for a, b in zip((got, *got_grads), (want, *want_grads)):
        assert torch.allclose(a, b, atol=1e-10, rtol=1e-10)
    probe = torch.randn_like(x1)
    second = [torch.autograd.grad((run(m, True)[1][0] * probe).sum(), [x1, x2]) for m in (layer, ref)]
    for a, b in zip(*second):
        assert torch.allclose(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.interpreter
@interpreted
def test_insum_many_runs_disjoint_overwriting_copies_as_one_launch(monkeypatch):
    """`=` statements that store each element of disjoint outputs once batch into one launch
    (the second call), and overwrite what the outputs held."""
    from insum import insum_many

    launches = []
    real = DirectLaunch.__call__
    monkeypatch.setattr(DirectLaunch, "__call__", lambda self, *a, **k: launches.append(1) or real(self, *a, **k))
    Z = torch.randn(5, 3, 7)
    out = torch.full((5, 7, 3), float("nan"))
    calls = [("O[b,u,m] = Z[b,m,u]", {"O": out[:, :4], "Z": Z[:, :, :4]}),
             ("O[b,u,m] = Z[b,m,u]", {"O": out[:, 4:], "Z": Z[:, :, 4:]})]
    for _ in range(2):
        out.fill_(float("nan"))
        launches.clear()
        insum_many(calls, backend="triton", disjoint=True)
        assert torch.equal(out, Z.transpose(1, 2))
    assert len(launches) == 1
