"""insum.nn.conv: sparse 3-D convolution on voxel coordinates, one insum statement per pass.

    >>> import torch
    >>> from insum.nn import SparseConv3d
    >>> conv = SparseConv3d(4, 8, kernel_size=3)
    >>> coords = torch.tensor([[0, 0, 0], [0, 0, 1], [5, 5, 5]])
    >>> feats, out_coords = conv(torch.randn(3, 4), coords)
    >>> feats.shape, out_coords is coords
    (torch.Size([3, 8]), True)

`weight[dx + r, dy + r, dz + r]` ([k, k, k, in, out], r = (k - 1) // 2) multiplies the
input at (x + dx, y + dy, z + dz) for the output at (x, y, z): cross-correlation, as
`torch.nn.functional.conv3d` with padding dilation * r. The passes, over a `KernelMap`
(`insum.nn.kernel_map`) with one zero row appended to the gathered tensor for absent
neighbours:

- forward, output-stationary (`form="tiles"`, no atomics): output rows sorted by their
  neighbour mask, in tiles that read only the offsets they need:
  `O[t, m, co] = X[NB[t, m, j], ci] * W[TW[t, j], ci, co]`; on the generated kernel one
  launch in which tile t stops after its TL[t] active offsets (`lengths={"j[t]": TL}`)
  and stores each tile row straight to its output row (`TILED_ROWS`, `O[TR[t, m], co]`
  with TR declared unique: plain stores, no gather back), elsewhere (torch backend,
  torch.compile, `TILES_IN_ONE_LAUNCH = False`) one launch per bucket of tiles of similar
  width and one gather back to map order
- forward, grouped pairs (`form="pairs"`, scattered with fp32 atomics):
  `O[PO[p, q], co] += X[PI[p, q], ci] * W[PW[p], ci, co]`
- input gradient: the same tiled statement on the transposed map, with X the output
  gradient and W each offset's transposed (co, ci) block
- weight gradient: per-group partial products summed per offset:
  `dWp[p, ci, co] = X[PI[p, q], ci] * dO[PO[p, q], co]`, `dW[PW[p]] += dWp[p]`

`form="auto"` (the default) picks by the map's real pairs: the grouped pairs below
`PAIRS_BELOW` (one launch; the tiled form's per-bucket launches leave the GPU waiting on
the host there), the tiles above (no atomics). Measured on an H200 (study_conv, fp16,
32-128 channels): pairs fastest at 1.4M pairs (145k voxels), tiles at 11M (1.2M voxels);
the threshold between them is not measured. Statement choice is data: both forms are
plain insum statements and follow the code generator's improvements.

The backward is written out rather than derived: the derived weight gradient of the tiled
statement would add one (ci, co) block atomically per (tile, offset).

`absent="mask"` (opt-in, not yet measured on a GPU) drops the zero row and its copy of the
features (one in the forward, one of the output gradient in the backward): absent
neighbours read row 0 and are multiplied by a 0/1 factor, e.g.
`O[t, m, co] = X[NB[t, m, j], ci] * V[t, m, j] * W[TW[t, j], ci, co]`. The factor costs one
multiply per gathered element inside the kernel. Caveat: a non-finite value in row 0 of
the features (or of the output gradient) then reaches outputs that do not read it (0 * inf).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.autograd import forward_ad

from ..api import insum
from ..bind import forward_mode_on, tangents_alone
from ..dtypes import as_dtype, compute_dtype
from ..errors import InsumError, InsumShapeError
from ..formats.coords import check_positive_int
from .kernel_map import KernelMap, KernelMapCache, default_cache

__all__ = [
    "SparseConv3d",
    "sparse_conv3d",
    "choose_form",
    "FORMS",
    "ABSENT",
    "TILED",
    "TILED_ROWS",
    "PAIRS",
    "WEIGHT_GRAD",
    "MASKED",
    "PAIRS_BELOW",
    "TILES_IN_ONE_LAUNCH",
]

TILED = "O[t, m, co] = X[NB[t, m, j], ci] * W[TW[t, j], ci, co]"
# The tiles' rows stored straight to their rows of the output: TR[t, m] is the output row of
# tile t's row m (padding rows get the rows past the real ones), declared unique, so the
# stores are plain and, TR holding one value per output row, no zero fill comes first.
TILED_ROWS = "O[TR[t, m], co] = X[NB[t, m, j], ci] * W[TW[t, j], ci, co]"
PAIRS = "O[PO[p, q], co] += X[PI[p, q], ci] * W[PW[p], ci, co]"
WEIGHT_GRAD = "dWp[p, ci, co] = X[PI[p, q], ci] * dO[PO[p, q], co]"
# absent="mask": the same statements with a 0/1 factor V in place of the zero row
MASKED = {
    TILED: "O[t, m, co] = X[NB[t, m, j], ci] * V[t, m, j] * W[TW[t, j], ci, co]",
    TILED_ROWS: "O[TR[t, m], co] = X[NB[t, m, j], ci] * V[t, m, j] * W[TW[t, j], ci, co]",
    PAIRS: "O[PO[p, q], co] += X[PI[p, q], ci] * V[p, q] * W[PW[p], ci, co]",
    WEIGHT_GRAD: "dWp[p, ci, co] = X[PI[p, q], ci] * V[p, q] * dO[PO[p, q], co]",
}
FORMS = ("auto", "tiles", "pairs")
ABSENT = ("zero_row", "mask")
# The tiled statement as one launch whose tiles each stop at their active offsets (declared
# lengths), rather than one launch per bucket of tiles padded to the bucket's widest tile.
TILES_IN_ONE_LAUNCH = True
PAIRS_BELOW = 4_000_000  # real pairs; see the module docstring


def choose_form(kernel_map: KernelMap, form: str = "auto") -> str:
    """The forward statement for a map: `form` itself unless it is "auto"."""
    if form not in FORMS:
        raise InsumError(f"unknown convolution form {form!r}; choose one of {', '.join(FORMS)}")
    if form != "auto":
        return form
    return "pairs" if kernel_map.pairs < PAIRS_BELOW else "tiles"


def _with_zero_row(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(1, x.shape[1])])


def _gathered(x: torch.Tensor, absent: str) -> torch.Tensor:
    """The tensor the statements gather from: x with a zero row, or x itself (mask)."""
    return _with_zero_row(x) if absent == "zero_row" else x


def _tile_buckets(km: KernelMap, tile: int, absent: str, dtype: torch.dtype) -> list[tuple[int, int, dict]]:
    """(first tile, last tile + 1, index and mask tensors) per bucket of the tiled statement."""
    if absent == "zero_row":
        return [(start, end, {"NB": nb, "TW": tw}) for start, end, nb, tw in km.tiles(tile).buckets]
    return [(start, end, {"NB": nb, "V": v, "TW": tw}) for start, end, nb, v, tw in km.masked_tiles(tile, dtype)]


def _pair_tensors(km: KernelMap, group: int | None, absent: str, dtype: torch.dtype) -> dict:
    """PI, PO, PW (and V for the mask) of the grouped pairs."""
    groups = km.pair_groups(group)
    if absent == "zero_row":
        return {"PI": groups.PI, "PO": groups.PO, "PW": groups.PW}
    PI, V = km.masked_pairs(group, dtype)
    return {"PI": PI, "V": V, "PO": groups.PO, "PW": groups.PW}


def _statement(stmt: str, absent: str) -> str:
    return stmt if absent == "zero_row" else MASKED[stmt]


def _one_launch(x: torch.Tensor, opts: dict) -> bool:
    """Whether the tiles run as one launch with declared lengths: only where the generated
    kernel honours them (a triton launch), and outside torch.compile (not measured under it,
    where the one launch's output would view a buffer the op mutates); elsewhere the lengths
    would be ignored and every tile would do the widest tile's work, so the buckets run."""
    if not TILES_IN_ONE_LAUNCH or torch.compiler.is_compiling():
        return False
    return opts["backend"] == "triton" or (opts["backend"] == "auto" and x.is_cuda)


def _run_tiled(km: KernelMap, x: torch.Tensor, w: torch.Tensor, tile: int, opts: dict, absent: str):
    """Run the tiled statement over `km`'s tiles (x: `_gathered` features), rows in map order.

    As one launch (`_one_launch`), each tile stopping at its declared length, the tiles'
    rows go straight to their output rows (`TILED_ROWS`: no tile-ordered buffer, no gather
    back). Otherwise one launch per bucket into a tile-ordered buffer, then one gather back
    (`index_select`: less host time than advanced indexing)."""
    tiled = km.tiles(tile)
    width = w.shape[2]
    if km.n_in == 0:  # no input: nothing to gather (the mask has no row 0 to read)
        return x.new_zeros(km.n_out, width)
    if _one_launch(x, opts):
        if absent == "zero_row":
            NB, TW, TL = km.tiles_whole(tile)
            tensors = {"NB": NB, "TW": TW}
        else:
            NB, V, TW, TL = km.masked_tiles_whole(tile, x.dtype)
            tensors = {"NB": NB, "V": V, "TW": TW}
        out = x.new_empty(tiled.n_tiles * tiled.tile, width)
        insum(_statement(TILED_ROWS, absent), O=out, X=x, W=w, TR=tiled.output_rows(), lengths={"j[t]": TL},
              unique_indices={"TR"}, **tensors, **opts)
        return out[: km.n_out]
    y = x.new_empty(tiled.n_tiles, tiled.tile, width)
    stmt = _statement(TILED, absent)
    for start, end, tensors in _tile_buckets(km, tile, absent, x.dtype):
        insum(stmt, O=y[start:end], X=x, W=w, **tensors, **opts)
    return torch.index_select(y.view(-1, width), 0, tiled.inverse)


class _SparseConv(torch.autograd.Function):
    """The convolution with its bias: the bias is added where the output is written (the
    grouped pairs accumulate onto it, the tiled rows get it in place after their gather),
    never as a separate `out + bias` tensor."""

    @staticmethod
    def forward(ctx, feats, weight, bias, km, form, tile, backend, precision, absent):
        volume, cin, cout = weight.shape
        # The packers guarantee every index is in range: no index check.
        opts = {"backend": backend, "precision": precision, "check_indices": False}
        x = _gathered(feats, absent)
        if form == "tiles":
            out = _run_tiled(km, x, weight, tile, opts, absent)
            if bias is not None:
                # In place where it runs eagerly; a new tensor while torch.compile traces:
                # under torch 2.11 a Function output mutated in place in forward got zero
                # gradients for every input (2.13 is fine).
                out = out + bias if torch.compiler.is_compiling() else out.add_(bias)
        else:
            shape, acc_dtype = (max(km.n_out, 1), cout), compute_dtype(feats.dtype)
            if bias is None:
                acc = torch.zeros(shape, dtype=acc_dtype, device=feats.device)
            else:
                # a copy always: with one output site the expanded bias is contiguous already,
                # and the pairs' `+=` would add into the parameter itself
                acc = bias.to(acc_dtype).expand(shape).clone(memory_format=torch.contiguous_format)
            if km.n_in:
                pairs = _pair_tensors(km, tile, absent, feats.dtype)
                insum(_statement(PAIRS, absent), O=acc, X=x, W=weight, **pairs, **opts)
            # Return the buffer itself, not a view of it: under torch 2.11's torch.compile a
            # Function output that views a buffer mutated by the insum op got no gradient.
            whole = (acc.shape[0], acc.dtype) == (km.n_out, feats.dtype)
            out = acc if whole else acc[: km.n_out].to(feats.dtype)
        ctx.save_for_backward(x, weight)
        ctx.km, ctx.tile, ctx.opts, ctx.absent = km, tile, opts, absent
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        km, opts, absent = ctx.km, ctx.opts, ctx.absent
        volume, cin, cout = weight.shape
        grad = grad.contiguous()
        grad_feats = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = _gathered(grad, absent)
            grad_feats = _run_tiled(km.transpose(), grad_x, weight.transpose(1, 2).contiguous(), ctx.tile, opts, absent)
        if ctx.needs_input_grad[1]:
            acc_dtype = compute_dtype(weight.dtype)
            total = torch.zeros(volume, cin, cout, dtype=acc_dtype, device=grad.device)
            if km.n_in and km.n_out:  # (no output: the padded pairs would read row 0 of an empty grad)
                pairs = _pair_tensors(km, None, absent, x.dtype)
                partial = torch.empty(pairs["PI"].shape[0], cin, cout, dtype=acc_dtype, device=grad.device)
                insum(_statement(WEIGHT_GRAD, absent), dWp=partial, X=x, dO=grad,
                      **{k: v for k, v in pairs.items() if k != "PW"}, **opts)
                total.index_add_(0, pairs["PW"], partial)
            grad_weight = as_dtype(total, weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = as_dtype(grad.sum(0, dtype=compute_dtype(grad.dtype)), grad.dtype)
        return grad_feats, grad_weight, grad_bias, None, None, None, None, None, None


def sparse_conv3d(
    feats: torch.Tensor,
    weight: torch.Tensor,
    kernel_map: KernelMap,
    bias: torch.Tensor | None = None,
    *,
    form: str = "auto",
    tile: int = 128,
    backend: str = "auto",
    precision: str = "tf32",
    absent: str = "zero_row",
) -> torch.Tensor:
    """The convolution of `feats` [n_in, in] by `weight` [k, k, k, in, out] over a kernel
    map: [n_out, out] at `kernel_map.out_coords`. Differentiable in feats, weight, bias.

    form: "tiles" (output-stationary), "pairs" (grouped pairs, atomics) or "auto"
    (`choose_form`); tile: rows per tile for "tiles", pairs per group for "pairs";
    absent: "zero_row" or "mask", how absent neighbours read zero (module docstring).
    Under forward-mode AD the tangent is that of a bilinear map: the convolution of the
    feature tangent by the weight, of the features by the weight's tangent, and the bias's."""
    options = dict(form=form, tile=tile, backend=backend, precision=precision, absent=absent)
    if forward_mode_on() and tangents_alone((feats, weight, bias)):
        (feats, t_feats), (weight, t_weight) = forward_ad.unpack_dual(feats), forward_ad.unpack_dual(weight)
        bias, t_bias = forward_ad.unpack_dual(bias) if bias is not None else (None, None)
        out = sparse_conv3d(feats, weight, kernel_map, bias, **options)
        tangent = torch.zeros_like(out)
        if t_feats is not None:
            tangent = tangent + sparse_conv3d(t_feats, weight, kernel_map, **options)
        if t_weight is not None:
            tangent = tangent + sparse_conv3d(feats, t_weight, kernel_map, **options)
        if t_bias is not None:
            tangent = tangent + t_bias.to(out.dtype)
        return forward_ad.make_dual(out, tangent)
    check_positive_int("sparse_conv3d: tile", tile)
    form = choose_form(kernel_map, form)
    if absent not in ABSENT:
        raise InsumError(f"unknown absent-neighbour handling {absent!r}; choose one of {', '.join(ABSENT)}")
    k = kernel_map.kernel_size
    if weight.dim() != 5 or tuple(weight.shape[:3]) != (k, k, k):
        raise InsumShapeError(f"weight must have shape [{k}, {k}, {k}, in, out], got {tuple(weight.shape)}")
    if feats.dim() != 2 or feats.shape[0] != kernel_map.n_in or feats.shape[1] != weight.shape[3]:
        raise InsumShapeError(
            f"feats must have shape [{kernel_map.n_in}, {weight.shape[3]}] (input sites, in channels), "
            f"got {tuple(feats.shape)}"
        )
    w = as_dtype(weight, feats.dtype).reshape(k**3, weight.shape[3], weight.shape[4])
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != w.shape[2]):
        raise InsumShapeError(f"bias must have shape [{w.shape[2]}] (out channels), got {tuple(bias.shape)}")
    b = None if bias is None else as_dtype(bias, feats.dtype)
    return _SparseConv.apply(feats, w, b, kernel_map, form, tile, backend, precision, absent)


def _sites(km: KernelMap, coords: torch.Tensor) -> tuple[torch.Tensor, int | None]:
    """The map's output sites as the caller's coordinates lay them out (batch column or not,
    their dtype), in a tensor of their own, and its version (None: an inference tensor)."""
    columns = coords.shape[1]
    sites = torch.empty((km.n_out, columns), dtype=coords.dtype, device=coords.device)
    sites.copy_(km.out_coords[:, 4 - columns :])
    return sites, None if sites.is_inference() else sites._version


class SparseConv3d(nn.Module):
    """A sparse 3-D convolution over voxel coordinates ([N, 3], or [N, 4] batch first).

    subm=True (submanifold): outputs at the input sites. subm=False: a strided convolution
    whose outputs are every site that reads some input (`output_coords`). transposed=True:
    the adjoint of the strided one, upsampling onto `out_coords` (e.g. the finer sites the
    matching strided layer started from). `forward` returns (feats, coords) and reuses one
    kernel map per coordinate tensor through `cache` (default: a module-wide cache)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int = 3,
        stride: int = 1,
        dilation: int = 1,
        bias: bool = False,
        subm: bool = True,
        transposed: bool = False,
        *,
        form: str = "auto",
        tile: int = 128,
        backend: str = "auto",
        precision: str = "tf32",
        absent: str = "zero_row",
        cache: KernelMapCache | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("in_channels", in_channels), ("out_channels", out_channels), ("kernel_size", kernel_size),
                            ("stride", stride), ("dilation", dilation), ("tile", tile)):
            check_positive_int(f"SparseConv3d: {name}", value)
        if subm and transposed:
            raise InsumError("SparseConv3d: a transposed convolution cannot be submanifold; pass subm=False")
        if subm and stride != 1:
            raise InsumError(f"SparseConv3d: a submanifold convolution has stride 1, got {stride}")
        if form not in FORMS:
            raise InsumError(f"unknown convolution form {form!r}; choose one of {', '.join(FORMS)}")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride, self.dilation = kernel_size, stride, dilation
        self.subm, self.transposed = subm, transposed
        if absent not in ABSENT:
            raise InsumError(f"unknown absent-neighbour handling {absent!r}; choose one of {', '.join(ABSENT)}")
        self.form, self.tile, self.backend, self.precision, self.absent = form, tile, backend, precision, absent
        self.cache = default_cache if cache is None else cache
        self.weight = nn.Parameter(torch.empty(kernel_size, kernel_size, kernel_size, in_channels, out_channels))
        self.bias = nn.Parameter(torch.empty(out_channels)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.in_channels * self.kernel_size**3)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    @property
    def mode(self) -> str:
        return "transposed" if self.transposed else "subm" if self.subm else "strided"

    def kernel_map(self, coords: torch.Tensor, out_coords: torch.Tensor | None = None) -> KernelMap:
        return self.cache.get(coords, self.kernel_size, self.stride, self.dilation, self.mode, out_coords)

    def forward(
        self, feats: torch.Tensor, coords: torch.Tensor, out_coords: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mode == "subm" and out_coords is not None:
            raise InsumError("SparseConv3d: a submanifold convolution's outputs are its input sites; drop out_coords")
        km = self.kernel_map(coords, out_coords)
        out = sparse_conv3d(
            feats, self.weight, km, self.bias,
            form=self.form, tile=self.tile, backend=self.backend, precision=self.precision, absent=self.absent,
        )
        if self.mode == "subm":
            return out, coords
        if out_coords is not None:
            return out, out_coords
        # One tensor per map, so the next layer's cache lookup hits: a copy of the map's own
        # sites (an edit of it must not reach the map), made again if the caller changed it in
        # place (its version moved), which would otherwise come back changed.
        key = ("sites", coords.shape[1], coords.dtype)
        sites, version = km.cached(key, lambda: _sites(km, coords))
        if version is not None and sites._version != version:
            sites, version = km._packed[key] = _sites(km, coords)
        return out, sites

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"dilation={self.dilation}, mode={self.mode}, bias={self.bias is not None}, form={self.form!r}"
        )
