"""compile, tune, cache and launch generated kernels.

The kernel cache is keyed by the KernelSpec (canonical statement, roles, dtypes, addressing
width, precision). Each kernel's source is written to a content-hashed file that Triton
reads back. Tile sizes are tuned with `triton.autotune` once per bucket of extents (each
tiled extent rounded up to a power of two) and device, and remembered in memory and in a
JSON file beside the source, so another process does not tune again.

Tensor descriptors (TMA) are offered to the schedule for input tensors whose layout fits
one (`box_layout`) on a GPU that has them (compute capability 9.0 and up, compiled code,
INSUM_TMA not "0"); the start address's alignment is then part of the kernel's cache key.
The launch makes them on the host (`_Descriptor`) and passes them as arguments, which the
kernel loads through without making its own.

Over 400 lines, as one module: a `Kernel` owns its loaded source, its prepared launches and
its tuning (in memory and on disk), and each reads the others' state.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import inspect
import json
import math
import os
import sys
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .arith import cdiv, next_power_of_2
from .bind import Bound, bind, has_tangent, mark_written
from .bounds import check_indices
from .cache import BoundedCache
from .codegen import (
    KERNEL_NAME,
    KernelSpec,
    Plan,
    configs_for,
    emit,
    emit_batch,
    group_rows,
    operand_bytes,
    prune_configs,
    schedule,
)
from .codegen.schedule import NARROW, SIZE_CAP, box_layout, permuted_output, segment_index
from .direct import LAUNCH_OPTIONS, DirectLaunch
from .dtypes import DTYPE_NAMES, HALF_DTYPES, INT32_MAX
from .errors import InsumError, InsumTypeError, UnsupportedStatement
from .settings import flag

__all__ = [
    "Kernel", "BareLaunch", "BatchLaunch", "UnsupportedStatement", "kernel_for", "cached_kernel", "spec_for", "cache_dir",
    "batch_launch", "PinnedArguments", "PinnedCall",
]

_KERNELS: BoundedCache[KernelSpec, Kernel] = BoundedCache()
# The spec follows from the tensor signature (dtypes, shapes, strides), so repeated calls skip it.
_BY_SIGNATURE: BoundedCache[tuple, Kernel] = BoundedCache()


def cache_dir() -> Path:
    """Where kernel sources and tuning results live: $INSUM_CACHE_DIR or ~/.cache/insum."""
    root = os.environ.get("INSUM_CACHE_DIR") or Path.home() / ".cache" / "insum"
    return Path(root).expanduser()


@functools.cache
def _private_cache() -> Path:
    """Where this process writes what the cache folder does not take (read-only, a file, no
    space): a temporary folder of its own, named in a warning once."""
    path = Path(tempfile.mkdtemp(prefix="insum-"))
    warnings.warn(
        f"insum: the cache folder {cache_dir()} cannot be written; this process keeps its kernels in {path} "
        "(set INSUM_CACHE_DIR to a writable folder)",
        stacklevel=3,
    )
    return path


def _replace(path: Path, text: str) -> None:
    """Write `text` to `path` atomically: another process may write or read the same file."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write(path: Path, text: str) -> Path:
    """Write `text` to `path` (`_replace`); where the folder cannot be written, into
    `_private_cache()` instead. Returns where it lies."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _replace(path, text)
        return path
    except OSError:
        fallback = _private_cache() / path.parent.name / path.name
        fallback.parent.mkdir(parents=True, exist_ok=True)
        fallback.write_text(text)
        return fallback


def _interpreting() -> bool:
    """TRITON_INTERPRET, read at call time."""
    return flag("TRITON_INTERPRET", default=False)


def _tuning_enabled(autotune: bool | None = None) -> bool:
    """autotune=False (or INSUM_AUTOTUNE=0 when it is None) takes the first candidate
    configuration instead of measuring."""
    if autotune is not None:
        return bool(autotune)
    return flag("INSUM_AUTOTUNE", default=True)


def _max_offset(shape, strides) -> int:
    return sum((s - 1) * abs(st) for s, st in zip(shape, strides) if s > 0)


def descriptors_supported(device: torch.device) -> bool:
    """Whether kernels on `device` may load through tensor descriptors (TMA): Hopper or later,
    compiled (the interpreter has no TMA), and not switched off with INSUM_TMA=0."""
    if device.type != "cuda" or _interpreting() or not flag("INSUM_TMA", default=True):
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device())[0] >= 9


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def box_tensors(bound: Bound, descriptors: bool) -> frozenset[str]:
    """Input value tensors whose layout fits a tensor descriptor (none unless `descriptors`,
    none for fake tensors seen while tracing, which have no address, and no empty tensor,
    whose address the driver need not take for a descriptor's)."""
    if not descriptors or bound.signature is None:
        return frozenset()
    return frozenset(
        name
        for name in bound.value_names
        if bound.tensors[name].numel() and box_layout(tuple(bound.tensors[name].shape), bound.tensors[name].stride(),
                                                      bound.tensors[name].element_size(), bound.tensors[name].data_ptr())
    )


def spec_for(
    bound: Bound,
    precision: str = "tf32",
    descriptors: bool | None = None,
    sorted_indices: frozenset[str] = frozenset(),
    unique_indices: frozenset[str] = frozenset(),
    lengths: tuple = (),
) -> KernelSpec:
    """The parts of a bound statement that a kernel depends on (and the caller's facts).

    descriptors: allow tensor-descriptor loads (default: `descriptors_supported` on the
    tensors' device). sorted_indices / unique_indices: index tensors the caller guarantees
    sorted / free of duplicate values. lengths: declared lengths (`insum.execute.length_facts`),
    their tensors in `bound`."""
    dtypes = {name: DTYPE_NAMES[t.dtype] for name, t in bound.tensors.items()}
    dtypes[bound.output_name] = DTYPE_NAMES[bound.out_dtype]
    wide = {
        name
        for name, t in bound.tensors.items()
        if t.untyped_storage().nbytes() > INT32_MAX and _max_offset(t.shape, t.stride()) > INT32_MAX
    }
    if bound.output_name not in bound.tensors and math.prod(bound.out_shape) > INT32_MAX:
        wide.add(bound.output_name)
    narrow = {v for v, role in bound.roles.items() if role != "reduced" and bound.extents[v] < NARROW}
    return KernelSpec(
        stmt=bound.stmt,
        roles=tuple(bound.roles.items()),
        dtypes=tuple(sorted(dtypes.items())),
        wide=frozenset(wide),
        precision=precision,
        narrow=frozenset(narrow),
        boxes=box_tensors(bound, descriptors_supported(bound.device) if descriptors is None else descriptors),
        sorted_indices=frozenset(sorted_indices),
        unique_indices=frozenset(unique_indices),
        sizes=tuple((v, min(next_power_of_2(int(e)), SIZE_CAP)) for v, e in bound.extents.items()),
        lengths=tuple(lengths),
        stride_multiples=stride_multiples(bound),
        extent_multiples=extent_multiples(bound),
    )


#: The narrowest vector worth stating (bytes): the smallest asynchronous copy (cp.async)
#: moves 4, so a gathered load of 2-byte elements leaves the software pipeline below it.
VECTOR_BYTES = 4


def _vector_multiple(value: int, element_size: int) -> int:
    """The power of two (8, 4 or 2) that `value` is a multiple of where Triton cannot see it
    (not a multiple of 16) and that many elements of `element_size` bytes make at least a
    VECTOR_BYTES vector; 1 otherwise (no hint: one kernel serves every such value)."""
    if value % 16 == 0:
        return 1
    m = 8 if value % 8 == 0 else 4 if value % 4 == 0 else 2 if value % 2 == 0 else 1
    return m if m * element_size >= VECTOR_BYTES else 1


def _element_sizes(bound: Bound) -> dict[str, int]:
    sizes = {name: t.element_size() for name, t in bound.tensors.items()}
    sizes.setdefault(bound.output_name, bound.out_dtype.itemsize)
    return sizes


def _strides(bound: Bound) -> dict[str, tuple[int, ...]]:
    """Every tensor's strides, the output's as it will be written (`Bound.output_strides`)."""
    strides = {name: t.stride() for name, t in bound.tensors.items()}
    strides[bound.output_name] = bound.output_strides()
    return strides


def stride_multiples(bound: Bound) -> tuple[tuple[str, int, int], ...]:
    """(tensor, dim, m) for each stride of the statement's tensors (the output as given, or
    contiguous as allocated) that is a multiple of m elements, a vector of at least
    VECTOR_BYTES, but not of 16 elements. Triton marks multiples of 16 only, so rows 8 fp16
    elements apart load (and add atomically) one element at a time unless the kernel states
    the multiple (`KernelSpec.stride_multiples`). H200, fp16 (session 17): a submanifold
    SparseConv3d at 120 channels ran 1.20 ms against 0.73 ms at 128 (0.72 ms stated); a
    grouped BlockGroupCOO product into 1000 columns 150 µs against 52 µs into 1008 (38 µs
    stated)."""
    element = _element_sizes(bound)
    found = [(name, dim, _vector_multiple(stride, element[name])) for name, dims in _strides(bound).items()
             for dim, stride in enumerate(dims)]
    return tuple(sorted(hint for hint in found if hint[2] > 1))


def extent_multiples(bound: Bound) -> tuple[tuple[str, int], ...]:
    """(variable, m) for each variable that indexes the contiguous last dimension of a value
    tensor or the output (two or more dimensions) and whose extent is a multiple of m
    elements, a vector of at least VECTOR_BYTES, but not of 16: a mask over it keeps m lanes
    constant. Not the extents of rows or of index tensors (voxels, groups), which would split
    kernels by the data's sizes for no vector."""
    strides, element = _strides(bound), _element_sizes(bound)
    found: dict[str, int] = {}
    for access, as_index in bound.stmt.walk():
        var = access.indices[-1].variable if len(access.indices) >= 2 and not as_index else None
        if var is not None and strides[access.name][-1] == 1:
            m = _vector_multiple(bound.extents[var], element[access.name])
            if m > 1:
                found[var] = min(m, found.get(var, m))
    return tuple(sorted(found.items()))


def _check_out_strides(out: torch.Tensor, multiples: tuple[tuple[int, int], ...]) -> None:
    """Refuse an output whose strides break the multiples its kernel states: the kernel
    rounds each stated stride down to its multiple, so another stride would address wrong
    elements (`KernelSpec.stride_multiples`)."""
    for dim, m in multiples:
        if out.stride(dim) % m:
            raise InsumError(
                f"the output's stride {out.stride(dim)} along dimension {dim} is not a multiple of {m}, "
                "as the prepared kernel was compiled for: pass an output of the statement's own layout"
            )


def _plan_here(spec: KernelSpec) -> Plan:
    """The schedule, with bf16 dots in float32 under the interpreter.

    The interpreter stores bf16 as raw 16-bit integers and its `tl.dot` multiplies those
    (garbage results): there the operands are upcast, multiplied in float32 ("ieee") and the
    result rounded once at the store, as a GPU's bf16 tensor cores accumulate in float32.
    """
    plan = schedule(spec)
    if plan.dot_dtype == "bf16" and _interpreting():
        plan = dataclasses.replace(plan, dot_dtype="fp32", spec=dataclasses.replace(spec, precision="ieee"))
    return plan


class Kernel:
    """A generated kernel: `.source`, `.plan`, and a launcher that tunes on first use.

    Callable on any tensors of the compiled dtypes and ranks: extents that change the plan
    (the narrow-tile orientation, 64-bit addressing) run the sibling kernel for them.
    """

    def __init__(self, spec: KernelSpec, plan: Plan | None = None, autotune: bool | None = None):
        self.spec = spec
        self.plan = plan if plan is not None else _plan_here(spec)
        self.autotune = autotune  # None: INSUM_AUTOTUNE decides
        generated = self.emitted = emit(self.plan)
        self.source: str = generated.text
        self.args = generated.args
        self.digest = generated.digest
        self.path = cache_dir() / "kernels" / f"insum_{self.digest}.py"
        self.fn = _load(self.path, self.source, self.digest)
        self.param_names = tuple(inspect.signature(_python_fn(self.fn)).parameters)
        self.tuned: BoundedCache[tuple, dict] = BoundedCache()  # extents bucket -> configuration
        self._launchers: BoundedCache[tuple, _Launcher] = BoundedCache()  # tensor signature -> prepared launch
        self._siblings: BoundedCache[KernelSpec, Kernel] = BoundedCache()  # re-planned for other extents

    def __repr__(self) -> str:
        return f"insum.Kernel('{self.spec.stmt}', plan={self.plan.kind}, digest={self.digest})"

    def __call__(self, **tensors: torch.Tensor) -> torch.Tensor:
        """Run the kernel's statement on new tensors of the same dtypes and ranks, any extents.
        The launch is not recorded by autograd: `insum()` is the differentiable call."""
        _refuse_differentiation(tensors)
        bound = bind(self.spec.stmt, tensors)
        if bound.device.type == "meta":  # (explain() reads shapes alone from meta tensors; a call runs)
            raise InsumTypeError("the tensors are on the meta device and hold no values: a kernel needs real tensors")
        _check_device(bound)
        spec = spec_for(
            bound, self.spec.precision, sorted_indices=self.spec.sorted_indices, unique_indices=self.spec.unique_indices
        )
        if spec.dtypes != self.spec.dtypes:
            compiled, given = dict(self.spec.dtypes), dict(spec.dtypes)
            wrong = [f"{n} is {given[n]}, compiled for {compiled[n]}" for n in compiled if given[n] != compiled[n]]
            raise InsumTypeError(f"tensor dtypes differ from this kernel's ({'; '.join(wrong)}): {self!r}")
        kernel = self
        if spec != self.spec:
            kernel = self._siblings.get(spec)
            if kernel is None:
                kernel = self._siblings[spec] = cached_kernel(spec, self.autotune)
        out = bound.output()
        # As `insum()` does: what the extents decide always, index values under INSUM_CHECK_INDICES.
        check_indices(bound, out, device_check=flag("INSUM_CHECK_INDICES", default=False))
        result = kernel.launch(bound, out)
        mark_written(out)
        return result

    # -- launching ----------------------------------------------------------------------
    def launch(self, bound: Bound, out: torch.Tensor, *, autotune: bool | None = None) -> torch.Tensor:
        """Run on a bound statement, writing into `out`; returns `out`.

        autotune: measure the candidate tiles on a signature's first call (None: the kernel's
        own setting, then INSUM_AUTOTUNE)."""
        return self.prepared(bound).run(bound.tensors, out, autotune)

    def prepared(self, bound: Bound) -> _Launcher:
        """The launch prepared for bound's signature (made on first use; kept per signature
        unless the binding has none, as fake tensors while tracing)."""
        launcher = self._launchers.get(bound.signature) if bound.signature is not None else None
        if launcher is None:
            launcher = _Launcher(self, bound)
            if bound.signature is not None:
                self._launchers[bound.signature] = launcher
        return launcher

    def launcher(self, bound: Bound, out: torch.Tensor | None = None) -> BareLaunch:
        """The bare launch an earlier call prepared for `bound`'s signature, on bound's tensors
        and `out` (default: the bound output): the kernel with the grid and tile configuration
        chosen then, and nothing around it (no zero fill, no float32 scratch buffer).
        Benchmarks time it beside `insum()` to measure the host overhead.

        Raises KeyError when no call has prepared this signature yet."""
        prepared = self._launchers[bound.signature]
        if prepared.config is None:
            raise KeyError(f"no launch of {self!r} has run for this signature yet")
        args = prepared.args(bound.tensors, bound.output() if out is None else out)
        return BareLaunch(self.fn, prepared.grid, prepared.config, tuple(args))

    def bucket(self, launcher: _Launcher) -> tuple:
        """The launches that share a tuned configuration: each tile axis's extent rounded up to
        a power of two, and the integer arguments Triton compiles specially (`specialisation`).
        Calls of one extent bucket whose strides differ in it run different code: on the
        H200 a GroupCOO product tuned into 1001 columns (element-wise fp16 atomics) kept a
        tile that ran 1.35 ms into 1008 (8-wide atomics), where the tuner's own choice there
        ran 0.22 ms (`explore/scatter_configs`, session 17)."""
        sizes = (next_power_of_2(math.prod(launcher.extents[v] for v in self.plan.axis_vars(a))) for a, _ in self.plan.tiles)
        return (*sizes, launcher.specialisation)

    def _first_run(self, launcher: _Launcher, args: list, device: torch.device, autotune: bool | None) -> None:
        """Find the configuration for a new signature (tuning if needed) and run once."""
        bucket = self.bucket(launcher)
        config = self.tuned.get(bucket)
        if config is None:
            config = self._first_config(bucket, args, launcher, device, autotune)
        launcher.set_config(config)
        launcher.direct(self.fn, launcher.with_blocks(args))

    def _first_config(self, bucket, args, launcher: _Launcher, device, autotune) -> dict:
        """Configuration for a new bucket: interpreter, untuned, disk cache, or autotune."""
        candidates = [launcher.fitted(c) for c in prune_configs(self.plan, configs_for(self.plan), launcher.extents)]
        grid = launcher.grid_fn
        if _interpreting():
            # The interpreter runs programs one at a time: the largest tile is the fastest.
            config = max(candidates, key=lambda c: math.prod(v for k, v in c.items() if k.startswith("BLOCK")))
        elif not _tuning_enabled(autotune):
            return candidates[0]  # not kept for the bucket: its other sizes still measure
        else:
            config = self._disk_config(bucket, device)
        if config is None:
            config = self.tuned[bucket] = self._autotune(launcher.tuning_args(args), grid, candidates,
                                                         launcher.blocks_hook(self.param_names))
            self._save_disk_config(bucket, device, config)
            return config
        self.tuned[bucket] = config
        return config

    def _autotune(self, args, grid, candidates, pre_hook=None) -> dict:
        """The fastest of `candidates` (triton.autotune), each timed as CUDA-graph replays of its
        launch (`graphed_bench`); `args` write a scratch output (`_Launcher.tuning_args`), so no
        candidate's timing includes saving and restoring the caller's. pre_hook sizes each
        candidate's descriptor arguments (`_Launcher.blocks_hook`)."""
        import triton

        configs = [
            triton.Config(
                {k: v for k, v in c.items() if k not in ("num_warps", "num_stages")},
                num_warps=c["num_warps"],
                num_stages=c["num_stages"],
                pre_hook=pre_hook,
            )
            for c in candidates
        ]
        if len(configs) == 1:
            return candidates[0]
        tuner = triton.autotune(configs=configs, key=[], do_bench=graphed_bench)(self.fn)
        tuner[grid](*args)
        best = tuner.best_config
        return {**best.kwargs, "num_warps": best.num_warps, "num_stages": best.num_stages}

    def _disk_path(self) -> Path:
        return self.path.with_suffix(".tune.json")

    def _device_key(self, bucket, device) -> str:
        """The disk table's key for a bucket: the device, Triton's version, the tensors' dtypes
        (kernels of other dtypes can share one source, and so one table: an fp16 ELL product
        read the float32 one's tile and ran 6x slower, `session17/call9`) and the bucket."""
        import triton

        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        dtypes = ",".join(f"{tensor}:{dtype}" for tensor, dtype in self.spec.dtypes)
        return f"{name}|triton {triton.__version__}|{dtypes}|{','.join(map(str, bucket))}"

    def _disk_table(self) -> dict:
        """The tuning table on disk: {} where it is missing, unreadable or not a table."""
        try:
            table = json.loads(self._disk_path().read_text())
        except (OSError, ValueError):
            return {}
        return table if isinstance(table, dict) else {}

    def _disk_config(self, bucket, device) -> dict | None:
        config = self._disk_table().get(self._device_key(bucket, device))
        return config if isinstance(config, dict) else None

    def _save_disk_config(self, bucket, device, config) -> None:
        """Add a tuned configuration to the table on disk (where the cache folder takes no
        file, the tuning is kept in memory only)."""
        table = self._disk_table()
        table[self._device_key(bucket, device)] = config
        path = self._disk_path()
        try:
            _replace(path, json.dumps(table, indent=1, sort_keys=True))
        except OSError:
            pass


#: Launches a tuning candidate's graph holds at most (its replays then time them together).
GRAPHED_LAUNCHES = 200
GRAPH_REPLAYS = 10


def graphed_bench(kernel_call, quantiles: Sequence[float], rep_ms: float = 20.0) -> list[float]:
    """A tuning candidate's device time per launch (ms, at `quantiles` of `GRAPH_REPLAYS`
    replays, about `rep_ms` of device time in all): its launches captured as one CUDA graph,
    replayed back to back.

    Triton's `do_bench` times each launch between events with the host in the loop: where a
    product takes a few tens of µs and the host needs about as long to launch it (Triton's
    binding, the descriptors' encoding), the host's time decides, and the tuner can pick by
    noise (seen once: a Block-ELL 64x64 product at 4096^3, s = 0.9, tuned 12% slower than its
    best candidate, benchmarks/results/h200/session14/call6). Falls back to `do_bench` where a
    capture fails. Each graph replays one input set, so the L2 is warm (do_bench flushes it)."""
    import triton.testing

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            kernel_call()  # compiled and warm outside the capture
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(3):
                kernel_call()
            end.record()
            end.synchronize()
            per_launch = max(start.elapsed_time(end) / 3, 1e-3)
            launches = max(1, min(GRAPHED_LAUNCHES, int(rep_ms / GRAPH_REPLAYS / per_launch)))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                for _ in range(launches):
                    kernel_call()
            times = []
            for _ in range(GRAPH_REPLAYS):
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / launches)
    except RuntimeError:
        times = None
    finally:
        torch.cuda.current_stream().wait_stream(stream)
    if times is None:
        return triton.testing.do_bench(kernel_call, quantiles=list(quantiles))
    ordered = torch.tensor(times, dtype=torch.float64)
    return [float(torch.quantile(ordered, q)) for q in quantiles]


@dataclasses.dataclass(frozen=True)
class BareLaunch:
    """One prepared kernel launch (see `Kernel.launcher`); calling it runs the kernel."""

    fn: Any
    grid: tuple[int, ...]
    config: dict
    args: tuple

    def __call__(self) -> None:
        self.fn[self.grid](*self.args, **self.config)


class _Descriptor:
    """How a launch makes one of its kernel's tensor-descriptor arguments (`emit.Source.args`):
    the tensor's box layout, fixed by the launch's signature, and the tile sizes its box takes.

    A tiled dimension is bounded by its variable's extent (what the box zero-fills past is the
    tile's mask); a scalar-indexed one by the tensor's own size, one element wide. A call
    copies the descriptor made for the same boxes and puts its tensor in (Triton's
    constructor checks the layout, which the signature and the kernel's alignment key fix).
    """

    __slots__ = ("name", "shape", "strides", "blocks", "made")

    def __init__(self, name: str, dims: tuple, tensor: torch.Tensor, extents: Mapping[str, int]):
        self.name = name
        # (An extent of 0, a loop that never runs, still needs a positive dimension.)
        self.shape = [max(int(extents[var]) if var else tensor.shape[d], 1) for d, (var, _) in enumerate(dims)]
        self.strides = [*tensor.stride()[:-1], 1]
        self.blocks = [f"BLOCK_{axis}" if axis else None for _, axis in dims]
        self.made: tuple | None = None  # (block shape, the descriptor class, the fields of one made for it)

    def block_shape(self, config: Mapping[str, Any] | None) -> list[int]:
        """The box for `config`'s tiles (ones before a configuration is chosen)."""
        return [config[b] if b and config is not None else 1 for b in self.blocks]

    def __call__(self, tensor: torch.Tensor, config: Mapping[str, Any] | None):
        block = self.block_shape(config)
        made = self.made
        if made is None or made[0] != block:
            from triton.tools.tensor_descriptor import TensorDescriptor

            prototype = TensorDescriptor(tensor, list(self.shape), list(self.strides), block)
            prototype.base = None  # (kept past the call: it must not keep the tensor alive)
            made = self.made = (block, TensorDescriptor, vars(prototype))
        _, cls, fields = made
        desc = object.__new__(cls)  # (a copy without the constructor's checks: a quarter of its host time)
        desc.__dict__.update(fields)
        desc.base = tensor
        return desc


class _Launcher:
    """A launch prepared for one tensor signature: constant arguments, grid and config.

    Sizes and strides are fixed by the signature, so a repeated call only fills in the
    pointers.
    """

    def __init__(self, kernel: Kernel, bound: Bound):
        plan = kernel.plan
        self.extents = dict(bound.extents)
        self.template: list = []
        self.pointers: list[tuple[int, str]] = []  # (position, tensor name)
        self.out_strides: list[tuple[int, int]] = []  # (position, output dimension)
        out_name = bound.output_name
        spec = kernel.spec
        if (spec.stride_multiples, spec.extent_multiples) != (stride_multiples(bound), extent_multiples(bound)):
            # (the kernel rounds its stated strides and extents down to their multiples)
            raise InsumError(f"{kernel!r} states stride and extent multiples that these tensors lack")
        # The output's stated multiples: its strides come with each call (`args`, `PinnedCall`).
        self.out_multiples = tuple((dim, m) for name, dim, m in spec.stride_multiples if name == out_name)
        self.descriptors: list[tuple[int, _Descriptor]] = []  # (position, how to make it)
        for position, arg in enumerate(kernel.args):
            if arg[0] == "ptr":
                self.template.append(None)
                self.pointers.append((position, arg[1]))
            elif arg[0] == "desc":
                self.template.append(None)
                self.descriptors.append((position, _Descriptor(arg[1], arg[2], bound.tensors[arg[1]], self.extents)))
            elif arg[0] == "size":
                self.template.append(self.extents[arg[1]])
            elif arg[1] == out_name:  # the output may be a float32 scratch buffer: per call
                self.template.append(None)
                self.out_strides.append((position, arg[2]))
            else:
                self.template.append(bound.tensors[arg[1]].stride(arg[2]))
        self.out_name = out_name
        out_strides = bound.output_strides()
        integers = [v for v in self.template if type(v) is int] + [out_strides[dim] for _, dim in self.out_strides]
        # Triton compiles an integer argument specially where it is 1 or a multiple of 16.
        self.specialisation = "".join("1" if v == 1 else "g" if v % 16 == 0 else "." for v in integers)
        launched_vars = [v for a, _ in plan.tiles if a != "K" for v in plan.axis_vars(a)] + list(plan.grid)
        self.launched = all(self.extents[v] > 0 for v in launched_vars)
        tiles = [(math.prod(self.extents[v] for v in plan.axis_vars(a)), f"BLOCK_{a}") for a, _ in plan.tiles if a != "K"]
        fixed = math.prod(self.extents[v] for v in plan.grid)

        slots = _program_slots(bound.device) if plan.persistent else None

        def grid_fn(meta):
            programs = fixed * math.prod(cdiv(extent, meta[b]) for extent, b in tiles)
            return (min(programs, slots) if slots else programs,)

        self.grid_fn = grid_fn
        self.config: dict | None = None
        self.grid: tuple[int, ...] | None = None
        self.kernel = kernel
        self.device = bound.device
        # What a call does around the launch, fixed by the signature: a scatter into an fp16/
        # bf16 output without native atomics goes through a float32 buffer; an overwriting
        # scatter starts from zeros.
        scatters = plan.output in ("atomic", "segment")
        self.half_scratch = scatters and bound.out_dtype in HALF_DTYPES and not _half_atomics(bound.out_dtype, bound.device)
        # An owned scatter (a plain store through an indirect index) writes only the elements
        # it reaches: overwriting, it starts from zeros too, unless its declared-unique index
        # holds as many values as the dimension it indexes (a permutation of it).
        permuted = permuted_output(plan)
        covered = plan.covers_output or (
            permuted is not None and bound.tensors[permuted[0]].numel() == bound.out_shape[permuted[1]]
        )
        self.zero_fill = not plan.stmt.accumulate and ((scatters and not self.half_scratch) or (not scatters and not covered))
        self.accumulate = plan.stmt.accumulate
        # (read by `fitted` only: plans whose grid joins the grouped order)
        self.operand_bytes = operand_bytes(
            plan, {name: t.numel() * t.element_size() for name, t in bound.tensors.items()}
        ) if plan.grid_joins else (0, 0)

    def fitted(self, config: dict) -> dict:
        """The configuration with GROUP_M sized for this launch's operands, where the plan's
        grid joins the grouped order (`tune.group_rows`); a tuned configuration is shared by
        every launch of its extents bucket, the group is not."""
        if not self.kernel.plan.grid_joins:
            return config
        share = _l2_share(self.device)
        return {**config, "GROUP_M": group_rows(self.kernel.plan, config, self.extents, *self.operand_bytes, share)}

    def set_config(self, config: dict) -> None:
        config = self.fitted(config)
        grid = self.grid_fn(config)
        allowed = self.device.type == "cuda" and not _interpreting()
        self.direct = DirectLaunch(_python_fn(self.kernel.fn), grid, config, len(self.template),
                                   tuple(position for position, _ in self.pointers), allowed)
        self.grid = grid
        # Last: another thread (autograd's backward) that sees a configuration finds its launch.
        self.config = config

    def with_blocks(self, args: list) -> list:
        """`args` (made before this launch had a configuration) with its descriptors' boxes
        sized for the configuration."""
        if self.descriptors:
            args = list(args)
            for position, made in self.descriptors:
                args[position] = made(args[position].base, self.config)
        return args

    def run(self, tensors, out: torch.Tensor, autotune: bool | None = None) -> torch.Tensor:
        """Launch on `tensors` (of this launch's signature; or a `PinnedCall` of this launch,
        `pin`) into `out`; returns `out`.

        The first call finds the configuration (autotune: as for `Kernel.launch`)."""
        target = out
        if self.half_scratch:
            # (in out's strides: those the kernel was compiled for)
            target = torch.empty_strided(out.shape, out.stride(), dtype=torch.float32, device=out.device).zero_()
        elif self.zero_fill:
            out.zero_()
        if self.launched:
            pinned = type(tensors) is PinnedCall  # (pinned only where no float32 buffer stands in for out)
            kernel = self.kernel
            if self.config is None:
                args = tensors.arguments() if pinned else self.args(tensors, target)
                kernel._first_run(self, args, self.device, kernel.autotune if autotune is None else autotune)
            elif pinned:
                self.direct(kernel.fn, tensors.arguments, tensors.alignments, tensors.addresses)
            else:
                self.direct(kernel.fn, self.args(tensors, target))
        if target is not out:
            if self.accumulate:
                out.add_(target)
            else:
                out.copy_(target)
        return out

    def pin(self, fixed: Mapping[str, torch.Tensor]) -> PinnedArguments | None:
        """The argument list with the tensors in `fixed` in place, the others (and the output)
        coming with each call; None where a float32 buffer stands in for the output, or before
        a first call chose the configuration (which sizes the descriptors)."""
        return None if self.half_scratch or self.config is None else _pin_arguments([self], [fixed], [])

    def args(self, tensors, target: torch.Tensor, config: dict | None = None) -> list:
        """The argument list for `tensors` into `target`; its descriptors' boxes sized for
        `config` (default: this launch's; before it has one, the tuner sizes them per
        candidate, `blocks_hook`)."""
        args = list(self.template)
        for position, name in self.pointers:
            args[position] = target if name == self.out_name else tensors[name]
        if self.out_multiples:
            _check_out_strides(target, self.out_multiples)
        for position, dim in self.out_strides:
            args[position] = target.stride(dim)
        config = config if config is not None else self.config
        for position, made in self.descriptors:
            args[position] = made(tensors[made.name], config)
        return args

    def tuning_args(self, args: list) -> list:
        """`args` with a scratch tensor of the output's layout for the output: the tuner runs
        every candidate many times, and a `+=` statement would add into the caller's output
        each time (Triton's `restore_value` saves and restores it around every timed launch,
        two copies of the output that the timing then includes)."""
        tuned = list(args)
        scratch = None
        for position, name in self.pointers:
            if name == self.out_name:
                out = args[position]
                if scratch is None:
                    # (zeros: what the candidates add into stays finite)
                    scratch = torch.empty_strided(out.size(), out.stride(), dtype=out.dtype, device=out.device).zero_()
                tuned[position] = scratch
        return tuned

    def blocks_hook(self, names: Sequence[str]):
        """A tuner's pre-hook that sizes the descriptors among a candidate's arguments (by
        parameter name, `names` in signature order) for that candidate's tiles."""
        if not self.descriptors:
            return None
        given = [(names[position], made) for position, made in self.descriptors]

        def hook(nargs: dict) -> None:
            for name, made in given:
                nargs[name].block_shape = made.block_shape(nargs)

        return hook


class BatchLaunch:
    """Several prepared launches (each part's signature and tile configuration decided by its
    own first call) as one launch of a batch kernel (`codegen.emit_batch`).

    Only for parts that add into their outputs atomically without a float32 buffer (no zero
    fill, no copy back): run concurrently, they sum as the separate launches would. With
    `disjoint` also overwriting (`=`) parts that store every element of their own outputs
    once (no zero fill): layout copies, one run of blocks each.

    covering: the caller's claim that the parts' scattered indices write every element of
    their output, each row from one part and, within it, from one aligned block of that many
    entries of its sorted index. Where every part then has one writer per row (plain stores,
    or segment tiles that are multiples of the block or span the whole index), the batch runs
    the parts' `=` kernels, which store each row's sum without reading the output: `covers`
    is then True, and the output may come uninitialised (`torch.empty`), needing no zero fill.
    """

    def __init__(self, parts: list[_Launcher], disjoint: bool = False, covering: int | None = None):
        for part in parts:
            if part.config is None or part.half_scratch or part.zero_fill or not (part.accumulate or disjoint):
                raise UnsupportedStatement("a batch takes prepared `+=` statements, or disjoint ones that store each element once")
            if part.kernel.plan.output not in ("atomic", "segment") and not disjoint:
                raise UnsupportedStatement("a batch takes statements whose outputs add atomically, or write disjoint elements")
        sources = _covering_sources(parts, covering) if covering and disjoint else None
        self.covers = sources is not None
        batch = emit_batch(sources or [part.kernel.emitted for part in parts])
        self.source = batch.text
        self.path = cache_dir() / "kernels" / f"insum_batch_{batch.digest}.py"
        self.fn = _load(self.path, batch.text, batch.digest)
        self.parts = parts
        self.launched = [part for part in parts if part.launched]
        ends, total = [], 0
        for part in parts:
            total += part.grid[0] if part.launched else 0
            ends.append(total)
        # The launch's warps and stages: those of the part with the most programs (the parts'
        # tile sizes are their own).
        largest = max(parts, key=lambda part: part.grid[0] if part.launched else 0)
        config = {f"{b}_{i}": part.config[b] for i, part in enumerate(parts) for b in batch.blocks[i]}
        config.update({k: v for k, v in largest.config.items() if k in LAUNCH_OPTIONS})
        self.ends = ends
        self.total = total
        width = sum(len(part.template) for part in parts)
        pointers, offset = [], 0
        for part in parts:
            pointers += [offset + position for position, _ in part.pointers]
            offset += len(part.template)
        allowed = parts[0].device.type == "cuda" and not _interpreting()
        self.direct = DirectLaunch(_python_fn(self.fn), (max(total, 1),), config, width + len(parts), tuple(pointers), allowed)

    def run(self, calls) -> None:
        """Launch on `calls`: per part, (tensors, out) of its signature; or a `PinnedCall` of
        this batch (`pin`), its arguments made but for the varying tensors."""
        if self.total == 0:
            return
        if type(calls) is PinnedCall:
            self.direct(self.fn, calls.arguments, calls.alignments, calls.addresses)
            return
        args = []
        for part, (tensors, out) in zip(self.parts, calls):
            args += part.args(tensors, out)
        args += self.ends
        self.direct(self.fn, args)

    def pin(self, fixed: Sequence[Mapping[str, torch.Tensor]]) -> PinnedArguments:
        """The batch's argument list with the tensors in `fixed` (per part, by name) filled
        in; the others (and the outputs, and their strides) come with each call."""
        return _pin_arguments(self.parts, fixed, self.ends)


def _pin_arguments(parts: Sequence[_Launcher], fixed: Sequence[Mapping[str, torch.Tensor]], tail: list) -> PinnedArguments:
    """The parts' argument lists one after the other, then `tail`, with the tensors in `fixed`
    (per part, by name) in place."""
    template, slots, strides, aligned, free, addresses, descriptors = [], [], [], [], [], [], []
    multiples: dict[str, tuple] = {}
    for part, tensors in zip(parts, fixed):
        offset = len(template)
        template += part.template
        for position, made in part.descriptors:
            tensor = tensors.get(made.name)
            if tensor is None:
                descriptors.append((offset + position, made, part.config))
            else:
                template[offset + position] = made(tensor, part.config)
        for position, name in part.pointers:
            tensor = tensors.get(name) if name != part.out_name else None
            if tensor is None:
                slots.append((offset + position, name))
                free.append((len(aligned), name))
                aligned.append(0)
            else:
                address = tensor.data_ptr()
                template[offset + position] = tensor
                aligned.append(address & 15)
                addresses.append((offset + position, address))
        strides += [(offset + position, part.out_name, dim) for position, dim in part.out_strides]
        if part.out_multiples:
            multiples[part.out_name] = part.out_multiples
    template += tail
    by_address = list(template)
    for position, address in addresses:
        by_address[position] = address
    return PinnedArguments(template, tuple(slots), tuple(strides), tuple(aligned), tuple(free), by_address,
                           tuple(descriptors), tuple(multiples.items()))


class PinnedArguments:
    """A launch's argument list with its pinned tensors in place (`BatchLaunch.pin`): a call
    fills in the varying tensors by name, the outputs' strides, and their pointers' alignment."""

    __slots__ = ("template", "by_address", "slots", "strides", "outputs", "aligned", "free", "names", "keys",
                 "descriptors", "multiples")

    def __init__(
        self, template: list, slots: tuple, strides: tuple, aligned: tuple, free: tuple, by_address: list,
        descriptors: tuple = (), multiples: tuple = (),
    ):
        self.template = template
        # The same list with the pinned tensors' device addresses in their place: what the
        # compiled launcher takes without asking the driver about each pointer (`Pinned.ready`
        # checks before every call that the memory under them has not moved).
        self.by_address = by_address
        self.slots = slots  # (position, name) of each varying tensor's pointer
        self.strides = strides  # (position, output name, dimension) of each output stride
        self.outputs = tuple({name: None for _, name, _ in strides})
        self.aligned = aligned  # every pointer's alignment (mod 16), the varying ones' 0
        self.free = free  # (index in `aligned`, name) of the varying pointers
        self.names = tuple({name: None for _, name in free})  # the varying tensors' names
        # The varying tensors' alignments -> every pointer's (at most 16 per varying tensor).
        self.keys: BoundedCache[tuple, tuple] = BoundedCache(256)
        # (position, _Descriptor, configuration) of each varying tensor's descriptor: made per call.
        self.descriptors = descriptors
        # (output name, its stated stride multiples): checked per call (`_check_out_strides`).
        self.multiples = multiples

    def __call__(self, varying: Mapping[str, torch.Tensor]) -> PinnedCall:
        return PinnedCall(self, varying)

    def key(self, alignments: tuple) -> tuple:
        """Every pointer's alignment, given the varying tensors' (in `names` order)."""
        aligned = list(self.aligned)
        of = dict(zip(self.names, alignments))
        for i, name in self.free:
            aligned[i] = of[name]
        key = self.keys[alignments] = tuple(aligned)
        return key


class PinnedCall:
    """One call of pinned arguments: what `BatchLaunch.run` and `_Launcher.run` take instead
    of the tensors by name."""

    __slots__ = ("pinned", "varying", "pointers")

    def __init__(self, pinned: PinnedArguments, varying: Mapping[str, torch.Tensor]):
        self.pinned = pinned
        self.varying = varying
        self.pointers: tuple | None = None  # the varying tensors' addresses, once read

    def arguments(self) -> list:
        """The argument list, with tensors (for the JIT)."""
        return self._fill(self.pinned.template, self.varying)

    def addresses(self) -> list:
        """The argument list with every pointer as a device address (for the compiled launcher,
        on a device the call's tensors were checked to be on)."""
        return self._fill(self.pinned.by_address, dict(zip(self.pinned.names, self._pointers())))

    def _pointers(self) -> tuple:
        """The varying tensors' addresses (in `names` order), read once per call."""
        if self.pointers is None:
            self.pointers = tuple([self.varying[name].data_ptr() for name in self.pinned.names])
        return self.pointers

    def _fill(self, template: list, pointers: Mapping[str, object]) -> list:
        pinned, varying = self.pinned, self.varying
        args = template.copy()
        for position, name in pinned.slots:
            args[position] = pointers[name]
        if pinned.strides:
            for name, multiples in pinned.multiples:
                _check_out_strides(varying[name], multiples)
            strides = {name: varying[name].stride() for name in pinned.outputs}
            for position, name, dim in pinned.strides:
                args[position] = strides[name][dim]
        for position, made, config in pinned.descriptors:
            args[position] = made(varying[made.name], config)
        return args

    def alignments(self) -> tuple:
        """The pointers' alignments (mod 16), as `DirectLaunch` keys them."""
        pinned = self.pinned
        alignments = tuple([pointer & 15 for pointer in self._pointers()])
        key = pinned.keys.get(alignments)
        return key if key is not None else pinned.key(alignments)


def _covering_sources(parts: Sequence[_Launcher], block: int) -> list | None:
    """The parts' kernels with `=` for `+=` (same arguments, same tiles), where each part
    owns its output rows under the caller's covering claim (`BatchLaunch`); else None."""
    sources = []
    for part in parts:
        plan = part.kernel.plan
        if plan.output == "segment":
            var = segment_index(plan).indices[0].variable
            tile = part.config[f"BLOCK_{plan.var_axis(var)}"]
            if tile % block and tile < part.extents[var]:
                return None  # a row's block may straddle two programs
        elif plan.output != "store":
            return None
        stmt = dataclasses.replace(plan.stmt, op="=")
        source = emit(dataclasses.replace(plan, spec=dataclasses.replace(plan.spec, stmt=stmt)))
        if source.args != part.kernel.args or source.blocks != part.kernel.emitted.blocks:
            return None
        sources.append(source)
    return sources


_BATCHES: BoundedCache[tuple, BatchLaunch] = BoundedCache()  # (id of each part's launch, ...) -> batch


def batch_launch(parts: list[_Launcher], disjoint: bool = False, covering: int | None = None) -> BatchLaunch:
    """The batch launch of prepared parts (made once per tuple of parts). disjoint: the
    caller guarantees that no two parts write one output element (then parts may store
    without atomics); covering: see `BatchLaunch`."""
    key = (disjoint, covering, *(id(part) for part in parts))
    batch = _BATCHES.get(key)
    if batch is None or batch.parts != parts:
        batch = _BATCHES[key] = BatchLaunch(parts, disjoint, covering)
    return batch


def _python_fn(fn):
    """The Python function behind a JIT (or interpreted) kernel: its signature orders the
    compiled kernel's parameters."""
    return getattr(fn, "fn", fn)


def _half_atomics(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether fp16/bf16 scatters add in the output's dtype with native atomics.

    They do wherever the GPU has them (sm_70 for fp16, sm_90 for bf16), like torch's
    `index_put_(accumulate=True)`: each contribution is rounded to the output's precision.
    For float32 accumulation pass a float32 output (the formats do when many contributions
    meet in one row). Elsewhere (the interpreter has none) a float32 buffer is scattered
    into and added to the output once.
    """
    if device.type != "cuda" or _interpreting():
        return False
    major, _ = _capability(device.index if device.index is not None else torch.cuda.current_device())
    return major >= (9 if dtype == torch.bfloat16 else 7)


def _program_slots(device: torch.device) -> int:
    """Programs a persistent kernel launches: one per SM (per CPU core in the interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return os.cpu_count() or 1


def _l2_share(device: torch.device) -> int | None:
    """Half the device's L2 cache in bytes (`tune.group_rows`), None where it is not known
    (the interpreter, or a torch that does not report it): tune.L2_SHARE, an H100's half."""
    if device.type != "cuda" or _interpreting():
        return None
    return (getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) // 2) or None


def _load(path: Path, source: str, digest: str):
    """Import the kernel from its content-hashed file (Triton reads source via inspect)."""
    module_name = f"insum_generated_{digest}"
    if not path.is_file() or path.read_text() != source:
        path = _write(path, source)
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # never leave a half-loaded module for the next call to find
            del sys.modules[module_name]
            raise UnsupportedStatement(f"the generated kernel {path} does not load: {e!r}") from e
    return getattr(module, KERNEL_NAME)


def _refuse_differentiation(tensors: Mapping[str, torch.Tensor]) -> None:
    """A compiled kernel's call records no gradient and carries no tangent: refused where one
    is asked for rather than dropped."""
    tensors = [t for t in tensors.values() if isinstance(t, torch.Tensor)]
    if (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)) or has_tangent(tensors):
        raise InsumError(
            "a compiled kernel's call is not differentiable and a tensor requires grad (or carries a "
            "forward-mode tangent); use insum() for gradients, or call it under torch.no_grad() "
            "with plain tensors"
        )


def _check_device(bound: Bound) -> None:
    """The generated kernel runs on CUDA, or on the CPU under the interpreter; and triton
    must have been imported in the mode TRITON_INTERPRET asks for now."""
    interpreting = _interpreting()
    if not interpreting and bound.device.type != "cuda":
        raise UnsupportedStatement(
            f"the triton backend needs a CUDA device or TRITON_INTERPRET=1 set before importing "
            f"insum (tensors are on {bound.device})"
        )
    imported = _triton_imported_interpreting()
    if interpreting != imported:
        raise UnsupportedStatement(
            f"TRITON_INTERPRET is {os.environ.get('TRITON_INTERPRET', 'unset')!r} now, but triton "
            f"was imported {'with' if imported else 'without'} it; set TRITON_INTERPRET before "
            "importing insum (or triton)"
        )


@functools.cache
def _triton_imported_interpreting() -> bool:
    """The mode triton.language's own @jit helpers (tl.cdiv, tl.sum, ...) were built in when
    triton was imported; a kernel of the other mode cannot call them."""
    import triton.language as tl

    return type(tl.cdiv).__name__ == "InterpretedFunction"


def kernel_for(
    bound: Bound,
    precision: str = "tf32",
    sorted_indices: frozenset[str] = frozenset(),
    unique_indices: frozenset[str] = frozenset(),
    lengths: tuple = (),
) -> Kernel:
    """The cached kernel for a bound statement, compiled on first use.

    sorted_indices / unique_indices: index tensors the caller guarantees sorted / free of
    duplicate values (see `insum()`); lengths: see `insum.execute.length_facts`.
    """
    _check_device(bound)
    facts = {"sorted_indices": sorted_indices, "unique_indices": unique_indices, "lengths": lengths}
    if bound.signature is None:
        return cached_kernel(spec_for(bound, precision, **facts))
    key = (bound.stmt, bound.signature, precision, sorted_indices, unique_indices, lengths)
    if descriptors_supported(bound.device):  # descriptors need 16-byte aligned starts
        key += tuple(bound.tensors[n].data_ptr() % 16 == 0 for n in bound.value_names)
    kernel = _BY_SIGNATURE.get(key)
    if kernel is None:
        kernel = _BY_SIGNATURE[key] = cached_kernel(spec_for(bound, precision, **facts))
    return kernel


def cached_kernel(spec: KernelSpec, autotune: bool | None = None) -> Kernel:
    """The shared kernel for `spec`, or (with an autotune setting) a kernel of its own."""
    if autotune is not None:
        return Kernel(spec, autotune=autotune)
    kernel = _KERNELS.get(spec)
    if kernel is None:
        kernel = _KERNELS[spec] = Kernel(spec)
    return kernel

