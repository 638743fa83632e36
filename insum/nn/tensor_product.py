"""insum.nn.tensor_product: e3nn-compatible equivariant tensor products as one insum statement.

    >>> import torch
    >>> from insum.nn import FullyConnectedTensorProduct
    >>> tp = FullyConnectedTensorProduct("4x0e+4x1o", "0e+1o", "4x0e+4x1o")
    >>> tp(torch.randn(10, 16), torch.randn(10, 4)).shape
    torch.Size([10, 16])

A tensor product of irreps sums, over its paths (l1 ⊗ l2 → l3), the Clebsch–Gordan table
contracted with the two inputs and a weight. Grouping the table's nonzero entries by the
output component they feed (padded to the longest group, Q) turns the whole layer into
one indirect Einsum; for the fully connected ("uvw") product

    Z[b,p,w] = CGV[p,q] * Y[b,CGJ[p,q]] * X[b,CGI[p,q],u] * W[PW[p,q],u,w]

where p is an output component (irrep entry, m), q its q-th CG entry, CGV the entry times
the path's normalisation, CGJ the flat position in input 2 (multiplicity v folded in),
CGI the component of input 1, and PW the weight slab of the entry's (path, v). The code
generator runs it as a `tl.dot` over the channels u (M = batch, N = output channels) with
the CG entries as the loop: no dense CG tensor, no zero entries. The channel-wise ("uvu")
product of MACE-style models keeps the channel: `Z[b,p,u] = ... X[b,CGI[p,q],u] * W[PW[p,q],u]`
(or `W[b,PW[p,q],u]` with one weight vector per edge), a broadcast-multiply-and-sum; when each
output component reads one weight slab (MACE: one path per output entry), `W[b,PR[p],u]`.

Layouts and normalisation are e3nn's (`irrep_normalization="component"`,
`path_normalization="element"` by default), and so is the flat weight vector (paths in
instruction order, each `[mul1, mul2, mul_out]` or `[mul1, mul2]`), so `from_e3nn(tp)`
copies an e3nn module's weights. Where every input-1 entry has one multiplicity and so
does every output entry ("uvw", `output="direct"`, the default there), the statement reads x1
and writes the output in e3nn's layout itself through two index tables:

    Z[b,ZO[p,w]] = CGV[p,q] * Y[b,CGJ[p,q]] * X[b,XI[CGI[p,q],u]] * W[PW[p,q],u,w]

(XI[c,u]: x1's flat position of component c, channel u; ZO[p,w]: the output's, declared
unique, a permutation of the output's columns: plain stores, no zero fill), one launch, and
so do its gradient statements (`LAYOUT_STATEMENTS`). Otherwise input 1 is permuted into
component-major `[batch, component, channel]` and Z back into e3nn's `[mul, 2l+1]` blocks
(two layout changes, inside the autograd function: its backward returns each input's
gradient by one inverse change; on the generated kernels each is one launch of block
transposes, `insum.nn.layout`, else a gather through the flat table); channel-wise ("uvu") layers read and write e3nn's layouts through
`FLAT_STATEMENTS` with `output="flat"` (opt-in: on the H200 its one launch took 3.1x the
three of "gather" at 10k MACE edges, 2.227 against 0.717 ms), and `output="indexed"` (opt-in)
stores Z in e3nn's layout through ZO[p, u] in the gather layer's launch. Gradients are regrouped statements
(`GRADIENT_STATEMENTS`); the layer runs under `torch.compile`. Outside it, for
`output="direct"`, each statement is pinned to its tables after its
first run (`insum.execute.Pinned`), and a repeated forward on inputs of one signature goes
straight to the pinned launch (`_FastForward`).
"""

from __future__ import annotations

import math
import numbers
import weakref
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.autograd import forward_ad

from ..api import insum
from ..bind import PLAIN_TENSORS, forward_mode_on, tangents_alone
from ..dtypes import as_dtype
from ..errors import InsumShapeError, InsumTypeError
from ..execute import PIN_TRIES, Pinned, pin
from .cg_tables import (
    FLAT_GRADIENT_STATEMENTS,
    FLAT_STATEMENTS,
    GRADIENT_STATEMENTS,
    IRREP_NORMALIZATIONS,
    LAYOUT_STATEMENTS,
    PATH_NORMALIZATIONS,
    ROW_SLAB_STATEMENTS,
    RUN_STATEMENTS,
    STATEMENTS,
    Instruction,
    check_instruction,
    flat_gradient_tables,
    flat_tables,
    normalised_instructions,
    tensor_product_tables,
)
from .irreps import Irrep, Irreps, IrrepsError
from .kernel_map import bucket_bounds
from .layout import BlockLayout

__all__ = [
    "TensorProduct",
    "FullyConnectedTensorProduct",
    "Instruction",
    "STATEMENTS",
    "tensor_product_tables",
    "mace_instructions",
]

_OUTPUTS = ("direct", "flat", "gather", "indexed", "views")


def _check_operands(**tensors: torch.Tensor | None) -> None:
    """Each given operand a floating-point tensor of at least one dimension (its features)."""
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise InsumTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() == 0:
            raise InsumShapeError(f"{name} is a 0-d tensor; the tensor product takes [..., features]")
        if not t.is_floating_point():
            raise InsumTypeError(f"{name} has dtype {t.dtype}; the tensor product takes floating-point tensors")


class TensorProduct(nn.Module):
    """An e3nn-compatible tensor product with "uvw" or "uvu" paths, run as one insum statement.

    instructions: `(i_in1, i_in2, i_out, mode)` or `(..., mode, has_weight)` or
    `(..., has_weight, path_weight)` tuples as e3nn takes them; every path is weighted, and
    all share one mode ("uvw": fully connected channels, "uvu": channel-wise).
    shared_weights: one weight vector for the batch (a parameter when internal_weights),
    else `forward(x1, x2, weight)` takes `weight[..., weight_numel]`, one per batch element.
    backend, precision: passed to `insum` ("tf32" or "ieee" float32 `tl.dot`).
    output: "direct" (one launch that reads x1 and writes the output in e3nn's layout
    through index tables, `LAYOUT_STATEMENTS`: no gather, no zero fill; its backward too;
    "uvw" paths whose input-1 entries share one multiplicity, and so do the output's),
    "gather" (one launch into component-major Z, then one gather into e3nn's
    layout), "indexed" (as "gather", but the launch writes the output in e3nn's layout
    itself through ZO[p, u], each output element stored once: no output gather; the
    stores along the channels are strided by each irrep's dimension; opt-in, unmeasured;
    output entries of one multiplicity, row_buckets=1), "views" (one launch per run of equal output entries, each writing its
    strided view of the e3nn-layout output: no gather pass, more launches) or, for "uvu"
    paths, "flat": one launch of FLAT_STATEMENTS, one table column per e3nn output position,
    reading x1 and the weight and writing the output in e3nn's layouts, and a backward of
    FLAT_GRADIENT_STATEMENTS (no layout gathers: on MACE's 128x0e+128x1o+128x2e edges the
    forward moves 49.7 instead of 131.6 KB per edge in one launch instead of three, over
    33.5k instead of 72.7k padded multiply slots; yet 3.1x slower than "gather" on the
    H200: its plan puts 256 edges by 16 positions per program, one entry per step).
    None (default): "direct" for "uvw" paths where it applies (without row_buckets), else
    "gather".
    row_buckets: with "gather", the output components sorted by their number of CG entries
    and run in up to this many launches, each with its own entry count Q (less padded work
    where counts differ, as in MACE's channel-wise product: 568 -> 239 entry slots per edge
    with 4 buckets; one launch more per bucket). Default 1: one launch (not yet measured).
    """

    def __init__(
        self,
        irreps_in1: Any,
        irreps_in2: Any,
        irreps_out: Any,
        instructions: list[tuple],
        *,
        irrep_normalization: str = "component",
        path_normalization: str = "element",
        shared_weights: bool = True,
        internal_weights: bool | None = None,
        backend: str = "auto",
        precision: str = "tf32",
        output: str | None = None,
        row_buckets: int = 1,
    ) -> None:
        super().__init__()
        if irrep_normalization not in IRREP_NORMALIZATIONS:
            raise IrrepsError(f"irrep_normalization {irrep_normalization!r}: choose one of {', '.join(IRREP_NORMALIZATIONS)}")
        if path_normalization not in PATH_NORMALIZATIONS:
            raise IrrepsError(f"path_normalization {path_normalization!r}: choose one of {', '.join(PATH_NORMALIZATIONS)}")
        self.irreps_in1, self.irreps_in2, self.irreps_out = Irreps(irreps_in1), Irreps(irreps_in2), Irreps(irreps_out)
        paths = []
        for raw in instructions:
            if len(raw) < 4:
                raise IrrepsError(f"instruction {raw!r}: expected (i_in1, i_in2, i_out, mode[, has_weight[, path_weight]])")
            i1, i2, io, mode = raw[:4]
            if len(raw) > 4 and not raw[4]:
                raise IrrepsError(f"instruction {raw!r}: paths without weights are not supported")
            for name, irreps, i in (("irreps_in1", self.irreps_in1, i1), ("irreps_in2", self.irreps_in2, i2), ("irreps_out", self.irreps_out, io)):
                if isinstance(i, (bool, str)) or not isinstance(i, numbers.Real) or int(i) != i:
                    raise IrrepsError(f"instruction {raw!r}: the {name} entry must be an integer index, got {i!r}")
                if not 0 <= int(i) < len(irreps):
                    raise IrrepsError(f"instruction {raw!r}: {name} has {len(irreps)} entries, no entry {i}")
            paths.append((int(i1), int(i2), int(io), str(mode), float(raw[5]) if len(raw) > 5 else 1.0))
        self.instructions = normalised_instructions(
            self.irreps_in1, self.irreps_in2, self.irreps_out, paths, irrep_normalization, path_normalization
        )
        self._setup(shared_weights, internal_weights, backend, precision, output, row_buckets)

    def _setup(self, shared_weights: bool, internal_weights: bool | None, backend: str, precision: str,
               output: str | None = None, row_buckets: int = 1) -> None:
        if output is not None and output not in _OUTPUTS:
            raise IrrepsError(f"output {output!r}: choose one of {', '.join(_OUTPUTS)}")
        self._cast: dict = {}
        self._calls: dict = {}  # dtype -> the e3nn-layout statements (output="direct"), pinned as they repeat
        self._fast: _FastForward | None = None  # the last no-grad forward, repeated (output="direct")
        for ins in self.instructions:
            check_instruction(self.irreps_in1, self.irreps_in2, self.irreps_out, ins)
        modes = {ins.mode for ins in self.instructions}
        if len(modes) > 1:
            raise IrrepsError(f"all paths must share one connection mode, got {sorted(modes)}")
        self.mode = modes.pop() if modes else "uvw"
        automatic = output is None  # "uvw": "direct" where the layouts allow it (below)
        if output is None:
            output = "gather"
        if row_buckets < 1 or (row_buckets > 1 and output != "gather"):
            raise IrrepsError(f"row_buckets={row_buckets}: needs a positive count, and output='gather' above 1")
        self.output = output
        self.shared_weights = shared_weights
        self.internal_weights = shared_weights if internal_weights is None else internal_weights
        if self.internal_weights and not shared_weights:
            raise IrrepsError("internal_weights=True needs shared_weights=True")
        self.backend, self.precision = backend, precision
        tables = tensor_product_tables(self.irreps_in1, self.irreps_in2, self.irreps_out, self.instructions,
                                       sort_rows=row_buckets > 1)
        self.weight_numel = int(tables.pop("weight_numel"))
        # Whether a padded (channel, weight or output) position reads the zero appended to
        # x1 / weight / the output gradient, and whether a layout gather is the identity (then
        # it is a view: the uniform multiplicities of the paper's grid and of MACE's weights).
        self._pad_x = bool((tables["X_INDEX"] == self.irreps_in1.dim).any())
        self._pad_w = bool((tables["W_INDEX"] == self.weight_numel).any())
        self._pad_dz = bool((tables["OUT_INVERSE"] == self.irreps_out.dim).any())
        self._identity_w = _is_identity(tables["W_INDEX"], self.weight_numel)
        self._identity_out = _is_identity(tables["OUT_INDEX"], tables["OUT_INVERSE"].size)
        direct = self.mode == "uvw" and row_buckets == 1 and not self._pad_x and not self._pad_dz
        if output == "direct" and not direct:
            raise IrrepsError("output='direct' needs 'uvw' paths, row_buckets=1, one multiplicity across irreps_in1 "
                              f"({self.irreps_in1}) and one across irreps_out ({self.irreps_out})")
        if automatic and direct:
            self.output = output = "direct"
        if output == "indexed" and (row_buckets != 1 or self._pad_dz):
            raise IrrepsError(f"output='indexed' needs row_buckets=1 and one multiplicity across irreps_out ({self.irreps_out})")
        if output in ("direct", "indexed"):
            # the output's flat position of (component p, channel): a permutation of its
            # columns (no padding); for "direct" also x1's of (component, channel)
            tables["ZO"] = tables["OUT_INVERSE"].reshape(tables["CGV"].shape[0], -1)
        if output == "direct":
            tables["XI"] = tables["X_INDEX"]
        # The inverse layout gathers of the backward: the gradients of x1 and of the flat
        # weight, read from the component-major / slab-major gradients (no zero-fill, no scatter).
        tables["X_INVERSE"] = _inverse(tables["X_INDEX"], self.irreps_in1.dim)
        tables["W_INVERSE"] = _inverse(tables["W_INDEX"], self.weight_numel)
        # The same layout changes as block transposes (`insum.nn.layout`; runs None where
        # the tables are not [U, D] blocks, as with row_buckets: the gathers run instead).
        self._x_layout = BlockLayout(tables["X_INDEX"], self.irreps_in1.dim)
        self._out_layout = BlockLayout(tables["OUT_INVERSE"].reshape(tables["CGV"].shape[0], -1), self.irreps_out.dim)
        # float64, cast per call: the CG values must stay exact for a float64 product
        self._value_tables = {name: table for name, table in tables.items() if table.dtype == np.float64}
        for name, table in tables.items():
            if table.dtype == np.float64:
                self.register_buffer(name, torch.from_numpy(table), persistent=False)
            else:
                gathers = ("X_INDEX", "W_INDEX", "OUT_INDEX", "OUT_INVERSE", "X_INVERSE", "W_INVERSE")  # torch indexing: int64
                self.register_buffer(name, torch.from_numpy(table).to(torch.int64 if name in gathers else torch.int32), persistent=False)
        self.statement = STATEMENTS[(self.mode, shared_weights)]
        row_slab = _row_slab(tables["CGV"], tables["PW"])
        if row_slab is not None and (self.mode, shared_weights) in ROW_SLAB_STATEMENTS and output != "views":
            self.statement = ROW_SLAB_STATEMENTS[(self.mode, shared_weights)]
            self.register_buffer("PR", torch.from_numpy(row_slab).to(torch.int32), persistent=False)
        self.gradient_statements = GRADIENT_STATEMENTS[(self.mode, shared_weights)]
        if output == "indexed":
            self.statement = _indexed(self.statement)
        if output == "direct":
            self.statement = LAYOUT_STATEMENTS[shared_weights]["Z"]
            self.gradient_statements = {k: v for k, v in LAYOUT_STATEMENTS[shared_weights].items() if k != "Z"}
        self.run_statement = RUN_STATEMENTS[(self.mode, shared_weights)]
        self._runs = self._output_runs() if output == "views" else []
        if output == "flat":
            self._setup_flat(tables, row_buckets)
        counts = tables["CGL"].tolist()
        ends = bucket_bounds(counts, row_buckets) if row_buckets > 1 else []
        # (first row, last row + 1, entries) per launch; empty: one launch over all rows
        self._buckets = [(start, end, max(1, counts[end - 1])) for start, end in zip([0] + ends, ends)] if len(ends) > 1 else []
        # No CG entry at all (zero multiplicities everywhere, or irreps of dimension 0): the
        # output is zeros, as e3nn's, without a product over empty operands.
        self._no_entries = sum(counts) == 0
        if self.internal_weights:
            self.weight = nn.Parameter(torch.randn(self.weight_numel))
        else:
            self.register_parameter("weight", None)

    def _setup_flat(self, tables: dict, row_buckets: int) -> None:
        """The tables of FLAT_STATEMENTS (`flat_tables`) and the statement that reads them."""
        if self.mode != "uvu" or row_buckets != 1:
            raise IrrepsError("output='flat' is for channel-wise ('uvu') paths, with row_buckets=1")
        flat = flat_tables(tables, self.irreps_out.dim)
        grads = flat_gradient_tables(flat, self.irreps_in1.dim, self.irreps_in2.dim, self.weight_numel)
        if flat["FR"] is None:
            del flat["FR"]
        else:
            del flat["FW"]
        for name, table in (flat | grads).items():
            if table.dtype == np.float64:
                self._value_tables[name] = table
                self.register_buffer(name, torch.from_numpy(table), persistent=False)
            else:
                self.register_buffer(name, torch.from_numpy(table).to(torch.int32), persistent=False)
        self.statement = FLAT_STATEMENTS[(self.shared_weights, "FR" in flat)]
        self.gradient_statements = FLAT_GRADIENT_STATEMENTS[self.shared_weights]

    @classmethod
    def from_e3nn(cls, tp: Any, **options: Any) -> TensorProduct:
        """The same product as an `e3nn.o3.TensorProduct` (or FullyConnectedTensorProduct),
        its path coefficients and (internal) weights copied."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.irreps_in1, layer.irreps_in2, layer.irreps_out = Irreps(tp.irreps_in1), Irreps(tp.irreps_in2), Irreps(tp.irreps_out)
        layer.instructions = []
        for ins in tp.instructions:
            if not ins.has_weight:
                raise IrrepsError(f"from_e3nn: path {ins} has no weight; paths without weights are not supported")
            layer.instructions.append(Instruction(ins.i_in1, ins.i_in2, ins.i_out, ins.connection_mode, float(ins.path_weight)))
        layer._setup(tp.shared_weights, tp.internal_weights, options.get("backend", "auto"),
                     options.get("precision", "tf32"), options.get("output"), options.get("row_buckets", 1))
        dtype = next((t.dtype for t in tp.parameters() if t.is_floating_point()), None)
        if dtype is not None:
            layer = layer.to(dtype)  # (a float64 module's weights, not rounded through float32)
        if layer.internal_weights:
            with torch.no_grad():
                layer.weight.copy_(tp.weight.detach().reshape(-1))
        device = next((t.device for t in (*tp.parameters(), *tp.buffers())), None)
        return layer.to(device) if device is not None else layer

    def _forward_mode(self, x1: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """The product on inputs that carry forward-mode tangents: it is linear in each of x1, x2
        and the weights, so its tangent is the sum of three products of primals, each with one
        input's tangent in its place (the layout copies and pinned launches never see one)."""
        w = weight if weight is not None else self._parameters.get("weight")
        (p1, t1), (p2, t2) = forward_ad.unpack_dual(x1), forward_ad.unpack_dual(x2)
        pw, tw = forward_ad.unpack_dual(w) if w is not None else (None, None)
        out = self(p1, p2, pw)
        tangent = torch.zeros_like(out)
        for a, b, c in ((t1, p2, pw), (p1, t2, pw), (p1, p2, tw)):
            if a is not None and b is not None and c is not None:
                tangent = tangent + self(a, b, c)
        return forward_ad.make_dual(out, tangent)

    def extra_repr(self) -> str:
        return (f"{self.irreps_in1} x {self.irreps_in2} -> {self.irreps_out}, {len(self.instructions)} paths "
                f"({self.mode}), weight_numel={self.weight_numel}")

    def forward(self, x1: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """x1[..., irreps_in1.dim], x2[..., irreps_in2.dim] -> [..., irreps_out.dim] (leading dims broadcast)."""
        if forward_mode_on() and tangents_alone((x1, x2, weight if weight is not None else self._parameters.get("weight"))):
            return self._forward_mode(x1, x2, weight)
        if not torch.compiler.is_compiling() and self._fast is not None:
            # a repeat of the last forward: its checks, then one pinned launch
            out = self._fast(x1, x2, weight, self._parameters.get("weight"))
            if out is not None:
                return out
        internal = weight is None
        _check_operands(x1=x1, x2=x2, weight=weight)
        if x1.shape[-1] != self.irreps_in1.dim:
            raise InsumShapeError(f"x1 has {x1.shape[-1]} features (shape {tuple(x1.shape)}), irreps_in1 {self.irreps_in1} has {self.irreps_in1.dim}")
        if x2.shape[-1] != self.irreps_in2.dim:
            raise InsumShapeError(f"x2 has {x2.shape[-1]} features (shape {tuple(x2.shape)}), irreps_in2 {self.irreps_in2} has {self.irreps_in2.dim}")
        if weight is None:
            if self.weight is None:
                raise InsumShapeError("this tensor product has no internal weights: pass weight[..., weight_numel]")
            weight = self.weight
        if weight.shape[-1] != self.weight_numel:
            raise InsumShapeError(f"weight has {weight.shape[-1]} entries (shape {tuple(weight.shape)}), the paths need {self.weight_numel}")
        if self.shared_weights and math.prod(weight.shape[:-1]) != 1:
            raise InsumShapeError(
                f"weight has shape {tuple(weight.shape)}: this layer shares one weight[{self.weight_numel}] over the "
                "batch (shared_weights=True); build it with shared_weights=False for a weight per sample"
            )
        lead = self._lead(x1, x2, weight)
        if math.prod(lead) == 0 or not self.instructions or self._no_entries:
            out = x1.new_zeros(*lead, self.irreps_out.dim, dtype=_promoted(x1, x2, weight))
            given = [t for t in (x1, x2, weight) if t.requires_grad]
            if torch.is_grad_enabled() and given:  # (zero gradients, as e3nn's: a sum over no element)
                out = out + sum(t.reshape(-1)[:0].sum() for t in given).to(out.dtype)
            return out
        given = (x1, x2, weight)
        x1, x2, weight = self._flat_inputs(x1, x2, weight, lead)
        direct = self.output == "direct"
        if torch.is_grad_enabled() and (x1.requires_grad or x2.requires_grad or weight.requires_grad):
            out = (_LayoutFunction if direct else _ProductFunction).apply(self, x1, x2, weight)
        elif direct:
            out = self._direct(x1, x2, weight)
        else:
            out = self._product(*self._operands(x1, x2, weight))  # no autograd node: less host time per call
        if direct and not torch.compiler.is_compiling() and given[0] is x1 and given[1] is x2 and given[2] is weight:
            self._fast = _FastForward.of(self, x1, x2, weight, internal, out)
        return out if len(lead) == 1 else out.reshape(*lead, self.irreps_out.dim)

    def _lead(self, x1: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor) -> tuple[int, ...]:
        """The broadcast leading shape (torch.broadcast_shapes only when the shapes differ)."""
        shapes = [x1.shape[:-1], x2.shape[:-1]] + ([] if self.shared_weights else [weight.shape[:-1]])
        if all(shape == shapes[0] for shape in shapes):
            return tuple(shapes[0])
        return tuple(torch.broadcast_shapes(*shapes))

    def _table(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """A value table (kept in float64) in the product's dtype, converted once per dtype."""
        if torch.compiler.is_compiling():
            return self._buffers[name].to(dtype)  # a traced graph converts once anyway; no cache mutation in it
        cached = self._cast.get((name, dtype))  # emptied by _apply (a move to another device)
        if cached is None:
            cached = self._cast[(name, dtype)] = self._buffers[name].to(dtype)
        return cached

    def _apply(self, fn, *args, **kwargs):
        """.to(), .cuda(), .float(), ...: the value tables stay float64 (exact CG values for a
        float64 product after a float32 one) on the new device; the per-dtype copies go."""
        module = super()._apply(fn, *args, **kwargs)
        self._cast, self._calls, self._fast = {}, {}, None
        for name, table in self._value_tables.items():
            buffer = self._buffers[name]
            if buffer.dtype != torch.float64:
                self._buffers[name] = torch.from_numpy(table).to(buffer.device)
        return module

    def _product(self, Y: torch.Tensor, X: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        """The e3nn-layout output [batch, irreps_out.dim] of the forward statement(s)."""
        if self.output == "views":
            return self._forward_views(Y, X, W)
        if self.output == "flat":
            return self._run(self.statement, **self._flat_tensors(Y, X, W))
        tables = self._buffers
        if self.output == "indexed":
            out = Y.new_empty(Y.shape[0], self.irreps_out.dim)
            return self._run(self.statement, Z=out, Y=Y, X=X, W=W, CGV=self._table("CGV", Y.dtype), CGJ=tables["CGJ"],
                             CGI=tables["CGI"], ZO=tables["ZO"], lengths={"q[p]": tables["CGL"]},
                             unique_indices=frozenset({"ZO"}), **self._weight_tables())
        if self._buckets:
            Z = self._forward_buckets(Y, X, W)
        else:
            Z = self._run(self.statement, Y=Y, X=X, W=W, CGV=self._table("CGV", Y.dtype), CGJ=tables["CGJ"],
                          CGI=tables["CGI"], lengths={"q[p]": tables["CGL"]}, **self._weight_tables())
        if self._identity_out:
            return Z.reshape(Z.shape[0], -1)
        if self._copies(self._out_layout, Z):
            return self._out_layout.to_flat(Z)
        return Z.reshape(Z.shape[0], -1).index_select(1, tables["OUT_INDEX"])

    def _copies(self, layout: BlockLayout, t: torch.Tensor) -> bool:
        """Whether a layout change of `t` runs as `layout`'s block transposes (generated
        kernels, eager, no gradient through them) rather than as a gather through its table
        (torch indexing: the torch backend, torch.compile, a graph for second derivatives)."""
        if layout.runs is None or torch.compiler.is_compiling() or (torch.is_grad_enabled() and t.requires_grad):
            return False
        return self.backend == "triton" or (self.backend == "auto" and t.is_cuda)

    def __setattr__(self, name: str, value: Any) -> None:
        """Assigning an attribute (backend, precision, a parameter or table replaced; not
        .train()/.eval()) drops the statements kept for output="direct" and the repeated
        forward (made anew on the next call)."""
        super().__setattr__(name, value)
        if not name.startswith("_") and name != "training" and self.__dict__.get("_calls") is not None:
            self._calls, self._fast = {}, None

    def __getstate__(self) -> dict[str, Any]:
        """A copy or pickle (`torch.save(layer)`, `copy.deepcopy`) starts without the kept
        statements and repeated forward (pinned launches; the copy makes its own)."""
        state = super().__getstate__()
        state["_calls"], state["_fast"] = {}, None
        return state

    def _slabs(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight as slabs [(batch,) S, U, Wd]: a view when its layout already is."""
        if self._identity_w:
            return weight.view(*weight.shape[:-1], *self._buffers["W_INDEX"].shape)
        return _gather(weight, self._buffers["W_INDEX"], self._pad_w)

    def _direct(self, x1: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """output="direct": [batch, irreps_out.dim] by one launch that reads x1 and writes the
        output in e3nn's layout (`LAYOUT_STATEMENTS`); flat inputs of one dtype."""
        out = x1.new_empty(x1.shape[0], self.irreps_out.dim)
        self._layout_statements(x1.dtype)["Z"](Z=out, X=x1, Y=x2, W=self._slabs(weight))
        return out

    def _direct_backward(self, x1: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, d_out: torch.Tensor,
                         needs: tuple[bool, bool, bool]) -> tuple:
        """The gradients of x1, x2 and the flat weight for output="direct": the regrouped
        statements read x1 and d_out and write x1's gradient in e3nn's layout (one launch
        each; the shared weight's adds one sum over batch groups, input 2's one for T)."""
        statements = self._layout_statements(d_out.dtype)
        batch = x1.shape[0]
        W = self._slabs(weight)
        dx1 = dx2 = dweight = None
        if needs[0]:
            dx1 = x1.new_empty(batch, self.irreps_in1.dim)
            statements["X"](DX=dx1, Y=x2, DZ=d_out, W=W)
        if needs[1]:
            T = x1.new_empty(batch, self.RC.shape[0], W.shape[-1])
            statements["T"](T=T, X=x1, W=W)
            dx2 = x1.new_empty(batch, self.irreps_in2.dim)
            statements["Y"](DY=dx2, T=T, DZ=d_out)
        if needs[2]:
            if self.shared_weights:
                groups = _batch_groups(batch)
                DW = x1.new_empty(groups, *W.shape)
                statements["W"](DW=DW, Y=_grouped(x2, groups), X=_grouped(x1, groups), DZ=_grouped(d_out, groups))
                DW = _summed(DW).reshape(-1)
            else:
                DW = x1.new_empty(W.shape)
                statements["W"](DW=DW, Y=x2, X=x1, DZ=d_out)
                DW = DW.reshape(batch, -1)
            dweight = DW if self._identity_w else DW.index_select(DW.dim() - 1, self.W_INVERSE)
        return dx1, dx2, dweight

    def _layout_statements(self, dtype: torch.dtype) -> dict[str, _Statement]:
        """output="direct": the forward ("Z") and gradient statements with their tables, per
        dtype (kept, and pinned as they repeat, outside torch.compile)."""
        statements = None if torch.compiler.is_compiling() else self._calls.get(dtype)
        if statements is not None:
            return statements
        b, options = self._buffers, {"backend": self.backend, "precision": self.precision}
        texts = LAYOUT_STATEMENTS[self.shared_weights]
        layout = {"XI": b["XI"], "ZO": b["ZO"]}
        statements = {
            "Z": _Statement(texts["Z"], {"CGV": self._table("CGV", dtype), "CGJ": b["CGJ"], "CGI": b["CGI"], "PW": b["PW"],
                                         **layout}, {"q[p]": b["CGL"]}, {"ZO"}, options),
            "X": _Statement(texts["X"], {"XV": self._table("XV", dtype), "XJ": b["XJ"], "XP": b["XP"], "XS": b["XS"],
                                         **layout}, {"q[c]": b["XL"]}, {"XI"}, options),
            "W": _Statement(texts["W"], {"WV": self._table("WV", dtype), "WJ": b["WJ"], "WC": b["WC"], "WP": b["WP"],
                                         **layout}, {"q[s]": b["WL"]}, (), options),
            "T": _Statement(texts["T"], {"XI": b["XI"], "RC": b["RC"], "RS": b["RS"]}, None, (), options),
            "Y": _Statement(texts["Y"], {"YV": self._table("YV", dtype), "YR": b["YR"], "YP": b["YP"], "ZO": b["ZO"]},
                            {"q[j]": b["YL"]}, (), options),
        }
        if not torch.compiler.is_compiling():
            self._calls[dtype] = statements
        return statements

    def _forward_buckets(self, Y: torch.Tensor, X: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        """Component-major Z [batch, P, channels], one launch per bucket of rows, each reading
        its rows' tables trimmed to the bucket's entry count."""
        channels = X.shape[2] if self.mode == "uvu" else W.shape[-1]
        Z = Y.new_empty(Y.shape[0], self._buffers["CGV"].shape[0], channels)
        for (start, end, _), bucket in zip(self._buckets, self._bucket_tables(Y.dtype)):
            tables = {name: t for name, t in bucket.items() if name != "CGL"}  # the cached dict stays whole
            self._run(self.statement, Z=Z[:, start:end], Y=Y, X=X, W=W, lengths={"q[p]": bucket["CGL"]}, **tables)
        return Z

    def _bucket_tables(self, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
        """Per bucket, the statement's tables sliced to its rows and entries (kept per dtype)."""
        key = ("buckets", dtype)
        if not torch.compiler.is_compiling() and key in self._cast:
            return self._cast[key]
        full = {"CGV": self._table("CGV", dtype), "CGJ": self._buffers["CGJ"], "CGI": self._buffers["CGI"],
                **self._weight_tables()}
        full["CGL"] = self._buffers["CGL"]
        buckets = [{name: t[start:end] if t.dim() == 1 else t[start:end, :q] for name, t in full.items()}
                   for start, end, q in self._buckets]
        if not torch.compiler.is_compiling():
            self._cast[key] = buckets
        return buckets

    def _flat_tensors(self, Y: torch.Tensor, X: torch.Tensor, W: torch.Tensor) -> dict[str, torch.Tensor]:
        """The inputs of the flat statement: x2 as Y, the flat x1 as X, the flat weight as W."""
        tables = self._buffers
        weight = {"FR": tables["FR"]} if "FR" in tables else {"FW": tables["FW"]}
        return {"Y": Y, "X": X, "W": W, "FV": self._table("FV", Y.dtype), "FJ": tables["FJ"], "FX": tables["FX"],
                "lengths": {"q[t]": tables["FL"]}, **weight}

    def _output_runs(self) -> list[tuple[int, int, int, int, int, int]]:
        """(first component row, entries, mul, dim, output offset, Q) per run of consecutive
        output entries with one multiplicity and dimension; Q trims the run's padding."""
        runs: list[list[int]] = []
        row, offset = 0, 0
        counts = self.CGL.tolist()  # (entries, a zero path weight's included: rows list them first)
        for mul, ir in self.irreps_out:
            if runs and runs[-1][2:4] == [mul, ir.dim]:
                runs[-1][1] += 1
            else:
                runs.append([row, 1, mul, ir.dim, offset, 0])
            row += ir.dim
            offset += mul * ir.dim
        for run in runs:
            first, n, _, dim = run[:4]
            run[5] = max([1] + counts[first : first + n * dim])
        return [tuple(r) for r in runs]

    def _forward_views(self, Y: torch.Tensor, X: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        """The e3nn-layout output written run by run through strided views (no gather)."""
        batch = Y.shape[0]
        out = Y.new_empty(batch, self.irreps_out.dim)
        cgv = self._table("CGV", Y.dtype)
        for first, n, mul, dim, offset, Q in self._runs:
            rows = slice(first, first + n * dim)
            view = out[:, offset : offset + n * mul * dim].view(batch, n, mul, dim).transpose(2, 3)
            # The run's output channels: w (the weight's last axis) for uvw, u for uvu.
            channels = X if self.mode == "uvw" else X[:, :, :mul]
            weights = W[..., :mul]
            self._run(self.run_statement, Z=view, Y=Y, X=channels, W=weights,
                      CGV=cgv[rows, :Q].view(n, dim, Q), CGJ=self.CGJ[rows, :Q].view(n, dim, Q),
                      CGI=self.CGI[rows, :Q].view(n, dim, Q), PW=self.PW[rows, :Q].view(n, dim, Q))
        return out

    def _run(self, statement: str, lengths: dict | None = None, unique_indices: frozenset[str] = frozenset(),
             **tensors: torch.Tensor) -> torch.Tensor:
        """insum with the layer's options. lengths: each row's CG entry count, declared so
        that the generated kernel skips the padding entries (also under torch.compile; a hint
        the torch backend ignores: the padding is zero-valued either way); unique_indices: the
        output index of output="indexed"."""
        return insum(statement, backend=self.backend, precision=self.precision, lengths=lengths,
                     unique_indices=unique_indices, **tensors)

    def _flat_inputs(self, x1: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, lead: tuple[int, ...]):
        """x1 [batch, dim1], x2 [batch, dim2] and the weight (flat, or [batch, numel]) in the
        product's dtype: views when the shapes and dtypes already agree."""
        batch = math.prod(lead)
        dtype = _promoted(x1, x2, weight)
        if x1.shape[:-1] != lead:
            x1 = x1.expand(*lead, x1.shape[-1])
        if x2.shape[:-1] != lead:
            x2 = x2.expand(*lead, x2.shape[-1])
        if len(lead) != 1:
            x1, x2 = x1.reshape(batch, -1), x2.reshape(batch, -1)
        if self.shared_weights:
            weight = weight if weight.dim() == 1 else weight.reshape(-1)
        else:
            weight = weight if weight.shape[:-1] == lead else weight.expand(*lead, self.weight_numel)
            weight = weight if len(lead) == 1 else weight.reshape(batch, -1)
        # (a .to() that changes nothing still costs a dispatch per call)
        return tuple(as_dtype(t, dtype) for t in (x1, x2, weight))

    def _operands(self, x1: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor):
        """The statement's (Y, X, W) from flat inputs: input 1 gathered component-major, the
        weight as slabs (a view when its layout already is); all three as given for
        output="flat", whose statement reads e3nn's layouts."""
        if self.output == "flat":
            return x2, x1, weight
        if self._copies(self._x_layout, x1):
            return x2, self._x_layout.to_components(x1), self._slabs(weight)
        return x2, _gather(x1, self._buffers["X_INDEX"], self._pad_x), self._slabs(weight)

    def statement_tensors(
        self, x1: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor | None = None, lead: tuple[int, ...] | None = None
    ) -> dict[str, torch.Tensor]:
        """The tensors of `self.statement` for these inputs: X gathered component-major, the
        weight slabs W, input 2 as Y, and the CG tables (Z, the output, is left to insum); for
        output="direct", x1 itself as X, the layout tables and a new output Z (`statement_facts`)."""
        weight = self.weight if weight is None else weight
        lead = self._lead(x1, x2, weight) if lead is None else lead
        flat = self._flat_inputs(x1, x2, weight, lead)
        if self.output == "direct":
            x1, x2, weight = flat
            Z = x1.new_empty(x1.shape[0], self.irreps_out.dim)
            return {"Z": Z, "Y": x2, "X": x1, "W": self._slabs(weight), **self._layout_statements(x1.dtype)["Z"].constants}
        Y, X, W = self._operands(*flat)
        if self.output == "flat":
            tensors = self._flat_tensors(Y, X, W)
            del tensors["lengths"]
            return tensors
        indexed = {"Z": Y.new_empty(Y.shape[0], self.irreps_out.dim), "ZO": self.ZO} if self.output == "indexed" else {}
        return {"CGV": self._table("CGV", Y.dtype), "Y": Y, "X": X, "W": W, "CGJ": self.CGJ, "CGI": self.CGI,
                **self._weight_tables(), **indexed}

    def statement_facts(self) -> dict[str, Any]:
        """What `insum()` is told besides the tensors when it runs `self.statement` (each
        row's entry count; the output's index declared unique for output="direct"):
        `insum(layer.statement, **layer.statement_facts(), **layer.statement_tensors(x1, x2))`."""
        if self.output == "flat":  # one row per output component: its entry count
            return {"lengths": {"q[t]": self._buffers["FL"]}}
        facts: dict[str, Any] = {"lengths": {"q[p]": self.CGL}}
        if self.output == "indexed":
            facts["unique_indices"] = frozenset({"ZO"})
        if self.output == "direct":
            facts["unique_indices"] = frozenset({"ZO"})
        return facts

    def _weight_tables(self) -> dict[str, torch.Tensor]:
        """The weight's index table of `self.statement`: PW [P, Q] per CG entry, or PR [P]
        per output component (ROW_SLAB_STATEMENTS)."""
        tables = self._buffers
        return {"PR": tables["PR"]} if "PR" in tables else {"PW": tables["PW"]}


class _ProductFunction(torch.autograd.Function):
    """The layer from flat inputs (x1, x2, weight) to e3nn's output layout, the layout changes
    included, so that its backward returns the inputs' gradients with one inverse change each
    (no zero-filled gradient and scatter per gather). The backward runs the regrouped
    statements of GRADIENT_STATEMENTS (each gradient element owned by one row: no atomics)
    instead of insum's derived ones, which scatter every CG entry into dX and dW."""

    @staticmethod
    def forward(ctx, layer: TensorProduct, x1: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        Y, X, W = layer._operands(x1, x2, weight)
        ctx.layer = layer
        # The inputs, not their gathered copies: the backward gathers them again, so that a
        # double backward (create_graph) differentiates through the gathers back to x1 and
        # the weight (saved copies would be constants to it: wrong second derivatives).
        ctx.save_for_backward(x1, x2, weight)
        return layer._product(Y, X, W)

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):
        layer: TensorProduct = ctx.layer
        Y, X, W = layer._operands(*ctx.saved_tensors)
        if layer.output == "flat":
            return (None, *_flat_backward(layer, ctx.needs_input_grad[1:4], Y, X, W, d_out.contiguous()))
        batch = d_out.shape[0]
        # The output gradient, component-major like Z (padded channels read a zero).
        P, channels = layer.CGV.shape[0], (X.shape[2] if layer.mode == "uvu" else W.shape[-1])
        if layer._identity_out:
            DZ = d_out.contiguous().view(batch, P, channels)
        elif layer._copies(layer._out_layout, d_out):
            DZ = layer._out_layout.to_components(d_out)
        else:
            DZ = _gather(d_out, layer.OUT_INVERSE, layer._pad_dz).view(batch, P, channels)
        dtype, stmts = DZ.dtype, layer.gradient_statements
        need_x1, need_x2, need_w = ctx.needs_input_grad[1:4]
        dx1 = dx2 = dweight = None
        if need_x1:
            DX = layer._run(stmts["X"], XV=layer._table("XV", dtype), Y=Y, DZ=DZ, W=W, XJ=layer.XJ, XP=layer.XP, XS=layer.XS,
                            lengths={"q[c]": layer.XL})
            if layer._copies(layer._x_layout, DX):
                dx1 = layer._x_layout.to_flat(DX)
            else:
                dx1 = DX.reshape(batch, -1).index_select(1, layer.X_INVERSE)
        if need_w:
            tables = {"WV": layer._table("WV", dtype), "WJ": layer.WJ, "WC": layer.WC, "WP": layer.WP}
            if layer.shared_weights:
                groups = _batch_groups(batch)
                DW = layer._run(stmts["W"], Y=_grouped(Y, groups), X=_grouped(X, groups), DZ=_grouped(DZ, groups),
                                lengths={"q[s]": layer.WL}, **tables)
                DW = _summed(DW)
                DW = DW.reshape(-1)
            else:
                DW = layer._run(stmts["W"], Y=Y, X=X, DZ=DZ, lengths={"q[s]": layer.WL}, **tables).reshape(batch, -1)
            dweight = DW if layer._identity_w else DW.index_select(DW.dim() - 1, layer.W_INVERSE)
        if need_x2 and layer.mode == "uvu":
            dx2 = layer._run(stmts["Y"], YV=layer._table("YV", dtype), X=X, W=W, DZ=DZ, YC=layer.YC, YS=layer.YS, YP=layer.YP,
                             lengths={"q[j]": layer.YL})
        elif need_x2:
            T = layer._run(stmts["T"], X=X, W=W, RC=layer.RC, RS=layer.RS)
            dx2 = layer._run(stmts["Y"], YV=layer._table("YV", dtype), T=T, DZ=DZ, YR=layer.YR, YP=layer.YP,
                             lengths={"q[j]": layer.YL})
        return None, dx1, dx2, dweight


def _flat_backward(layer: TensorProduct, needs: tuple[bool, ...], Y: torch.Tensor, X: torch.Tensor, W: torch.Tensor,
                   DZ: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """(dx1, dx2, dweight) of output="flat": FLAT_GRADIENT_STATEMENTS on e3nn's layouts, one
    launch per gradient (a shared weight's summed over batch groups), no gathers."""
    stmts, tables = layer.gradient_statements, layer._buffers
    dtype = DZ.dtype

    def run(key: str, letters: str, **tensors: torch.Tensor) -> torch.Tensor:
        name = "G" + key
        given = {name + f: tables[name + f] for f in letters} | {name + "V": layer._table(name + "V", dtype)}
        row = {"X": "s", "W": "r", "Y": "j"}[key]  # the gradient's column variable
        return layer._run(stmts[key], lengths={f"q[{row}]": tables[name + "L"]}, **given, **tensors)

    dx1 = run("X", "JWT", Y=Y, W=W, DZ=DZ) if needs[0] else None
    dx2 = run("Y", "XWT", X=X, W=W, DZ=DZ) if needs[1] else None
    dweight = None
    if needs[2] and layer.shared_weights:
        groups = _batch_groups(Y.shape[0])
        dweight = _summed(run("W", "JXT", Y=_grouped(Y, groups), X=_grouped(X, groups), DZ=_grouped(DZ, groups)))
    elif needs[2]:
        dweight = run("W", "JXT", Y=Y, X=X, DZ=DZ)
    return dx1, dx2, dweight


class _LayoutFunction(torch.autograd.Function):
    """output="direct": the layer from flat inputs (x1, x2, weight) by one launch, and its
    backward by the regrouped statements of `LAYOUT_STATEMENTS`, which read x1 and the output
    gradient and write x1's gradient in e3nn's layout (no gathers, no atomics)."""

    @staticmethod
    def forward(ctx, layer: TensorProduct, x1: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.layer = layer
        ctx.save_for_backward(x1, x2, weight)
        return layer._direct(x1, x2, weight)

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):
        x1, x2, weight = ctx.saved_tensors
        return (None, *ctx.layer._direct_backward(x1, x2, weight, d_out, ctx.needs_input_grad[1:4]))


_PINS_PER_STATEMENT = 8  # signatures of the varying tensors pinned per statement


def _signature(tensors: dict[str, torch.Tensor]) -> tuple | None:
    """What a pinned launch depends on, per tensor; None for anything but plain tensors
    (subclasses, fake tensors: insum's full path handles them)."""
    if any(type(t) not in PLAIN_TENSORS for t in tensors.values()):
        return None
    return tuple([(t.dtype, t.shape, t.stride(), t.device) for t in tensors.values()])


class _Statement:
    """One statement of a layer with its constant tensors (tables; declared lengths and
    unique indices), run through `insum()` and, from its first run on a signature of the
    varying tensors (those given per call, the output among them), pinned to the constants
    (`insum.execute.Pinned`: they are checked once, and a call fills in the varying
    tensors' addresses for one direct launch)."""

    __slots__ = ("text", "constants", "lengths", "facts", "options", "pins")

    def __init__(self, text: str, constants: dict[str, torch.Tensor], lengths: dict[str, torch.Tensor] | None,
                 unique: Any, options: dict[str, str]) -> None:
        self.text = text
        self.constants = constants
        self.lengths = lengths
        self.facts = {"unique_indices": frozenset(unique)} if unique else {}
        self.options = options
        self.pins: dict[tuple, Pinned | int] = {}  # signature -> its pinned launch, or the tries so far

    def __call__(self, **varying: torch.Tensor) -> None:
        """Run the statement into the output among `varying` (allocated by the caller)."""
        key = None if torch.compiler.is_compiling() else _signature(varying)
        if key is None:
            self._run(varying)
            return
        pinned = self.pins.get(key)
        if type(pinned) is Pinned:
            if pinned.ready(*varying.values()) and pinned.run(varying):
                return
            if pinned.moved():  # memory moved under a constant: pinned anew
                self.pins.pop(key, None)  # (pop: a backward on another thread may do the same)
        self._run(varying)
        tries = self.pins.get(key, 0)
        if type(tries) is int and tries < PIN_TRIES and (key in self.pins or len(self.pins) < _PINS_PER_STATEMENT):
            facts = {**self.facts, "lengths": self.lengths} if self.lengths else self.facts
            found = pin([(self.text, {**self.constants, **varying}, facts)], varying=frozenset(varying), **self.options)
            self.pins[key] = tries + 1 if found is None else found

    def _run(self, varying: dict[str, torch.Tensor]) -> None:
        insum(self.text, lengths=self.lengths, **self.facts, **self.options, **self.constants, **varying)

    def pinned(self, varying: dict[str, torch.Tensor]) -> Pinned | None:
        """The pinned launch for tensors of this signature, if any."""
        key = _signature(varying)
        found = None if key is None else self.pins.get(key)
        return found if type(found) is Pinned else None


class _FastForward:
    """The layer's last forward with output="direct" on inputs taken as given (flat, one
    dtype, a weight already in slab order), kept to repeat it: per call the inputs'
    signature and the weight's memory, then, without gradients, the pinned launch's own
    checks (`Pinned.ready`), the output's allocation and one launch; with them, the autograd
    function on the inputs as they are. None where any differs (the full path runs)."""

    __slots__ = ("layer", "key", "internal", "weight", "address", "slabs", "slab_shape", "weight_key", "pinned",
                 "shape", "dtype", "device")

    @classmethod
    def of(cls, layer: TensorProduct, x1: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, internal: bool,
           out: torch.Tensor) -> _FastForward | None:
        if not layer._identity_w:
            return None
        slabs = layer._slabs(weight)
        pinned = layer._layout_statements(x1.dtype)["Z"].pinned({"Z": out, "X": x1, "Y": x2, "W": slabs})
        if pinned is None:
            return None
        fast = cls()
        fast.layer = weakref.ref(layer)  # (the layer holds this record)
        fast.key = (type(x1), x1.dtype, x1.shape, x1.stride(), x1.device, type(x2), x2.dtype, x2.shape, x2.stride(), x2.device)
        # The layer's own weight is kept (its memory checked per call); a weight passed in is
        # not (no cache holds the caller's tensors): only its signature.
        fast.internal, fast.address = internal, weight.data_ptr()
        fast.weight, fast.slabs = (weight, slabs.detach()) if internal else (None, None)
        fast.weight_key = (type(weight), weight.dtype, weight.shape, weight.stride(), weight.device)
        fast.slab_shape = slabs.shape
        fast.pinned = pinned
        fast.shape, fast.dtype, fast.device = tuple(out.shape), out.dtype, out.device  # (ints: a torch.Size parses slower)
        return fast

    def __call__(self, x1: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor | None,
                 own: torch.Tensor | None) -> torch.Tensor | None:
        """own: the layer's weight now (a parameter swapped in its dict, as by
        torch.func.functional_call, is another object)."""
        if self.internal:
            if weight is not None or own is not self.weight:
                return None
            weight, slabs = self.weight, self.slabs
            if weight.data_ptr() != self.address:  # .data replaced
                return None
        else:
            if weight is None or (type(weight), weight.dtype, weight.shape, weight.stride(), weight.device) != self.weight_key:
                return None
            slabs = weight.view(self.slab_shape)
        if (type(x1), x1.dtype, x1.shape, x1.stride(), x1.device,
                type(x2), x2.dtype, x2.shape, x2.stride(), x2.device) != self.key:
            return None
        if torch.is_grad_enabled() and (x1.requires_grad or x2.requires_grad or weight.requires_grad):
            return _LayoutFunction.apply(self.layer(), x1, x2, weight)  # the inputs as the full path would pass them
        pinned = self.pinned
        if not pinned.ready(x1, x2, weight):
            return None
        out = torch.empty(*self.shape, dtype=self.dtype, device=self.device)
        return out if pinned.run({"Z": out, "X": x1, "Y": x2, "W": slabs}) else None


def _batch_groups(batch: int, most: int = 64, least_rows: int = 256) -> int:
    """How many groups the batch splits into for a shared weight's gradient: the largest
    divisor of the batch up to `most` that leaves each group `least_rows` rows (else 1)."""
    for groups in range(min(most, batch // least_rows), 1, -1):
        if batch % groups == 0:
            return groups
    return 1


def _grouped(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The batch (first) dimension split into `groups` equal groups: [groups, batch/groups, ...]."""
    return t.reshape(groups, t.shape[0] // groups, *t.shape[1:])


def _summed(per_group: torch.Tensor) -> torch.Tensor:
    """A shared weight's gradient from its per-group partial gradients (no sum for one group)."""
    return per_group[0] if per_group.shape[0] == 1 else per_group.sum(0)


def _promoted(x1: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The product's dtype (promote_types only when the three differ)."""
    if x1.dtype == x2.dtype == weight.dtype:
        return x1.dtype
    return torch.promote_types(torch.promote_types(x1.dtype, x2.dtype), weight.dtype)


def _indexed(statement: str) -> str:
    """The statement with its component-major output `Z[b,p,c]` written through the output
    index instead, `Z[b,ZO[p,c]]` (output="indexed").

    >>> _indexed("Z[b,p,u] = CGV[p,q] * X[b,CGI[p,q],u]")
    'Z[b,ZO[p,u]] = CGV[p,q] * X[b,CGI[p,q],u]'
    """
    lhs, rhs = statement.split(" = ", 1)
    channel = lhs.removeprefix("Z[b,p,").removesuffix("]")
    return f"Z[b,ZO[p,{channel}]] = {rhs}"


def _row_slab(cgv, pw):
    """PR[p], the one weight slab every CG entry of output component p reads, or None when
    some component reads two (rows without entries read slab 0)."""
    real = cgv != 0
    first = np.where(real.any(1), pw[np.arange(len(pw)), real.argmax(1)], 0)
    if (real & (pw != first[:, None])).any():
        return None
    return first.astype(np.int64)


def _is_identity(index, size: int) -> bool:
    """Whether a layout table reads positions 0..size-1 in order (no padding): a view."""
    return index.size == size and bool((index.reshape(-1) == np.arange(size)).all())


def _inverse(index, size: int):
    """inverse[index[k]] = k over the real (unpadded) positions of a layout table: the table
    that gathers a gradient back into the flat layout (each flat position is read once)."""
    flat = index.reshape(-1)
    real = flat < size
    inverse = np.zeros(size, dtype=np.int64)
    inverse[flat[real]] = np.nonzero(real)[0]
    return inverse


def _gather(t: torch.Tensor, index: torch.Tensor, padded: bool) -> torch.Tensor:
    """t[..., index] along the last dimension; when padded, index t.shape[-1] reads a zero.
    (index_select on the flat index: far less host time per call than advanced indexing.)"""
    if padded:
        t = nn.functional.pad(t, (0, 1))
    return t.index_select(t.dim() - 1, index.reshape(-1)).view(*t.shape[:-1], *index.shape)


class FullyConnectedTensorProduct(TensorProduct):
    """e3nn's FullyConnectedTensorProduct: every (in1, in2) -> out path allowed by O(3), "uvw".

        >>> import torch
        >>> tp = FullyConnectedTensorProduct("2x0e+2x1o", "1x0e+1x1o", "3x1o")
        >>> tp.weight_numel, tp(torch.randn(5, 8), torch.randn(5, 4)).shape
        (12, torch.Size([5, 9]))
    """

    def __init__(self, irreps_in1: Any, irreps_in2: Any, irreps_out: Any, **options: Any) -> None:
        irreps1, irreps2, irreps_out_ = Irreps(irreps_in1), Irreps(irreps_in2), Irreps(irreps_out)
        paths = [
            (i1, i2, io, "uvw")
            for i1, (_, ir1) in enumerate(irreps1)
            for i2, (_, ir2) in enumerate(irreps2)
            for io, (_, ir_out) in enumerate(irreps_out_)
            if ir_out in ir1 * ir2
        ]
        super().__init__(irreps1, irreps2, irreps_out_, paths, **options)


def mace_instructions(irreps_in1: Any, irreps_in2: Any, target: Any) -> tuple[Irreps, list[tuple]]:
    """The channel-wise ("uvu") paths of a MACE interaction block and their output irreps:
    every (in1, in2) pair feeds each irrep of `target` that its product contains, one output
    entry per path (input 1's multiplicity), outputs sorted by irrep as MACE's
    `tp_out_irreps_with_instructions` (and e3nn's `Irreps.sort`) order them.

    target: irreps (the allowed output irreps) or an int lmax (0e+1o+2e+... up to lmax).

        >>> irreps_out, ins = mace_instructions("4x0e+4x1o", "0e+1o", 1)
        >>> str(irreps_out), ins[:2]
        ('4x0e+4x0e+4x1o+4x1o', [(0, 0, 0, 'uvu', True), (0, 1, 2, 'uvu', True)])
    """
    irreps1, irreps2 = Irreps(irreps_in1), Irreps(irreps_in2)
    if isinstance(target, int):
        allowed = {Irrep(l, (-1) ** l) for l in range(target + 1)}  # noqa: E741
    else:
        allowed = {ir for _, ir in Irreps(target)}
    outs: list[tuple[int, Irrep]] = []
    paths = []
    for i, (mul, ir1) in enumerate(irreps1):
        for j, (_, ir2) in enumerate(irreps2):
            for ir in ir1 * ir2:
                if ir in allowed:
                    paths.append((i, j, len(outs)))
                    outs.append((mul, ir))
    order = sorted(range(len(outs)), key=lambda k: (outs[k][1], k, outs[k][0]))  # e3nn's Irreps.sort
    position = {k: n for n, k in enumerate(order)}
    irreps_out = Irreps([(outs[k][0], (outs[k][1].l, outs[k][1].p)) for k in order])
    return irreps_out, [(i, j, position[k], "uvu", True) for i, j, k in paths]
