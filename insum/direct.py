"""Launch a compiled kernel directly, without the JIT's per-call binding.

`fn[grid](*args, **config)` goes through Triton's `JITFunction.run`, which binds the
arguments, specialises every one of them, hashes the result and looks the compiled kernel
up again on every call (about 15 µs of host time). A prepared insum launch already knows
all of that: the sizes and strides are fixed by the tensor signature, the constexprs by the
tile configuration. So after the JIT has run once for a (device, pointer alignments) key,
`DirectLaunch` keeps the `CompiledKernel` it returned and calls its launcher itself:

    kernel.run(grid0, grid1, grid2, stream, kernel.function, kernel.packed_metadata,
               launch_metadata, launch_enter_hook, launch_exit_hook, *every_parameter)

where every_parameter is the kernel's Python signature in order, constexprs included
(Triton 3.6 to 3.9 launch so). Its pointers may be given as device addresses (integers): a
pinned call does so, which spares the launcher a `data_ptr()` call and a driver query
(`cuPointerGetAttribute`) per tensor, the largest part of a many-tensor launch. What the JIT would specialise on beyond the signature is
each pointer's 16-byte alignment, so that is the key, with the current device; the stream
is read the way the JIT reads it. A launch hook (a profiler) takes the JIT path, as do the
interpreter and INSUM_DIRECT_LAUNCH=0. Any exception on the direct path switches it
off for good for that launch and falls back to the JIT.

Tensor descriptors: Triton 3.6's launcher encodes every descriptor argument on every launch
(`make_tensordesc_arg`: a `cuTensorMapEncodeTiled` per descriptor, inside a Python loop over
all the arguments). The 128-byte map it makes is a function of the tensor's address, shape,
strides and box only, and in one prepared launch all but the address are fixed; so
`_TensorMaps` keeps each map it encoded by (argument, address) and hands the launcher's C
function the expanded arguments itself (`INSUM_KEEP_TENSOR_MAPS=0`: encode on every launch,
through Triton). Where the launcher is not laid out as 3.6's, descriptors go through it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from .settings import flag

__all__ = ["DirectLaunch", "LAUNCH_OPTIONS"]

#: Configuration keys that are launch options of the JIT, not parameters of the kernel.
LAUNCH_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg"})


_TRITON: list = []  # [triton.runtime.driver, triton.knobs.runtime], imported on first use


def _triton_runtime():
    """(driver.active, knobs.runtime): what the JIT reads the device, stream and hooks from
    (the active driver read on every call, as the JIT reads it)."""
    if not _TRITON:
        import triton

        _TRITON.extend((triton.runtime.driver, triton.knobs.runtime))
    driver, knobs = _TRITON
    return driver.active, knobs


#: The base arguments Triton 3.6's C launcher takes before the kernel's parameters.
_LAUNCHER_BASE_FORMAT = "iiiKKppOOOOOO"
_TENSOR_MAPS_KEPT = 256  # maps one launch keeps (addresses of rotating inputs, outputs)


class _TensorMaps:
    """A compiled kernel's launch with its tensor descriptors encoded once per address.

    Made from Triton 3.6's `CudaLauncher` (`for_launcher`): the C launch function behind its
    descriptor wrapper, each descriptor parameter's position and metadata (swizzle, element
    type, box), and Triton's own `make_tensordesc_arg` to encode with. A parameter's map is
    keyed by its position and the descriptor's address, shape, strides and box, so a map is
    reused only where it would encode the same bytes."""

    __slots__ = ("launch", "descriptors", "encode", "base", "maps")

    def __init__(self, launch: Callable, descriptors: tuple, encode: Callable, cooperative: bool, pdl: bool):
        self.launch = launch
        self.descriptors = descriptors  # ((position, metadata), ...) in order
        self.encode = encode
        self.base = (cooperative, pdl, None, None)  # launch flags; no global or profile scratch
        self.maps: dict[tuple, list] = {}

    @classmethod
    def for_launcher(cls, run) -> _TensorMaps | None:
        """The kept-map launch of `run` (a compiled kernel's launcher), None where it has no
        descriptor parameters or is not laid out as Triton 3.6's."""
        inner = getattr(run, "launch", None)
        code, cells = getattr(inner, "__code__", None), getattr(inner, "__closure__", None)
        if code is None or not cells:
            return None
        captured = dict(zip(code.co_freevars, (cell.cell_contents for cell in cells)))
        metas, positions = captured.get("tensordesc_meta"), captured.get("tensordesc_indices")
        if "launcher" not in captured or not metas or positions is None or any(m is None for m in metas):
            return None
        if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
            return None  # the launcher would allocate scratch per launch
        try:
            from triton.backends.nvidia import driver as nvidia
        except ImportError:
            return None
        if getattr(nvidia, "_BASE_ARGS_FORMAT", None) != _LAUNCHER_BASE_FORMAT or len(metas) != len(positions):
            return None
        return cls(captured["launcher"], tuple(zip(sorted(positions), metas)), nvidia.make_tensordesc_arg,
                   run.launch_cooperative_grid, run.launch_pdl)

    def __call__(self, grid3: tuple, stream: int, function, metadata, enter, leave, parameters: tuple) -> None:
        arguments = [*grid3, stream, function, *self.base, metadata, None, enter, leave]
        maps, start = self.maps, 0
        for position, meta in self.descriptors:
            arguments += parameters[start:position]
            desc = parameters[position]
            key = (position, desc.base.data_ptr(), *desc.shape, *desc.strides, *desc.block_shape)
            expanded = maps.get(key)
            if expanded is None:
                if len(maps) >= _TENSOR_MAPS_KEPT:
                    maps.clear()
                expanded = maps[key] = self.encode(desc, meta)
            arguments += expanded
            start = position + 1
        arguments += parameters[start:]
        self.launch(*arguments)


def _has_calls(hook) -> bool:
    """Whether a launch hook would run anything (Triton 3.6 to 3.9 keep an empty HookChain
    when none is set; a plain callable always runs)."""
    return hook is not None and bool(getattr(hook, "calls", True))


class DirectLaunch:
    """The launch of one prepared kernel call (grid and configuration fixed), direct after
    the JIT's first launch for each (device, alignment) key.

    python_fn: the kernel's Python function (its signature orders the parameters);
    nargs: how many leading parameters `args` give; the rest come from `config`.
    pointers: the positions in `args` of the tensors (the JIT specialises on their alignment).
    allowed: False where a direct launch never applies (the interpreter, no CUDA).
    """

    def __init__(
        self, python_fn: Callable, grid: tuple[int, ...], config: dict, nargs: int, pointers: tuple[int, ...], allowed: bool
    ):
        names = list(inspect.signature(python_fn).parameters)
        rest = names[nargs:]
        self.config = config
        self.grid = grid
        self.grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        # Every parameter after the arguments must come from the configuration, and every
        # configuration key must be a parameter or a launch option: else take the JIT path.
        self.fits = all(n in config for n in rest) and all(k in LAUNCH_OPTIONS or k in rest for k in config)
        self.enabled = allowed and self.fits
        #: Why the launch goes through the JIT (None while direct launches apply).
        self.why_not: str | None = None if self.enabled else (
            "not on a CUDA device outside the interpreter" if not allowed else
            f"parameters {[n for n in rest if n not in config]} and configuration keys "
            f"{[k for k in config if k not in LAUNCH_OPTIONS and k not in rest]} do not match")
        self.constexprs = tuple(config[n] for n in rest) if self.fits else ()
        self.pointers = pointers
        self.compiled: dict[tuple, tuple] = {}  # (device, alignments) -> (run, function, metadata)

    def parameters(self, args: list) -> tuple:
        """Every parameter of the kernel in signature order, as the compiled launcher takes them."""
        return (*args, *self.constexprs)

    def __call__(
        self,
        jit_fn,
        args: list | Callable[[], list],
        alignments: Callable[[], tuple] | None = None,
        addresses: Callable[[], list] | None = None,
    ) -> None:
        """Launch on `args` (the argument list, or what makes it: a pinned call makes it only
        for the JIT). alignments: what `args`' pointers give modulo 16, in order, from a caller
        that knows most of them already (a pinned launch); read from `args` if None.
        addresses: the argument list with every pointer as its device address, from a caller
        that checked the tensors' device (a pinned launch): the compiled launcher then takes
        each as it is, where a tensor costs it a `data_ptr()` call and a driver query."""
        listed = args if isinstance(args, list) else None

        def argument_list() -> list:
            return listed if listed is not None else args()

        if not self.enabled or not flag("INSUM_DIRECT_LAUNCH", default=True):
            jit_fn[self.grid](*argument_list(), **self.config)
            return
        driver, knobs = _triton_runtime()
        device = driver.get_current_device()
        if alignments is None:
            listed = argument_list()
            key = (device, *[listed[i].data_ptr() & 15 for i in self.pointers])  # (finer than aligned or not)
        else:
            key = (device, *alignments())
        compiled = self.compiled.get(key)
        enter, leave = knobs.launch_enter_hook, knobs.launch_exit_hook
        # A hook takes the JIT path: an enter hook wants the launch metadata the JIT builds,
        # and an exit hook runs after the launch, where an exception must not make the
        # fallback below launch (and add into the output) a second time.
        hooked = _has_calls(enter) or _has_calls(leave)
        if compiled is None or hooked:
            kernel = jit_fn[self.grid](*argument_list(), **self.config)
            if compiled is None and kernel is not None:
                try:
                    if hasattr(kernel, "result"):  # a future while compiling asynchronously
                        kernel = kernel.result()
                    run = kernel.run  # (initialises the handles first)
                    self.compiled[key] = (run, kernel.function, kernel.packed_metadata, _TensorMaps.for_launcher(run))
                except Exception as error:  # not a compiled kernel this module knows: the JIT path
                    self.enabled, self.why_not = False, f"the JIT returned {type(kernel).__name__}: {error!r}"
            return
        run, function, metadata, maps = compiled
        try:
            if maps is not None and flag("INSUM_KEEP_TENSOR_MAPS", default=True):
                maps(self.grid3, driver.get_current_stream(device), function, metadata, enter, leave,
                     (*(addresses() if addresses is not None else argument_list()), *self.constexprs))
                return
            run(*self.grid3, driver.get_current_stream(device), function, metadata, None, enter, leave,
                *(addresses() if addresses is not None else argument_list()), *self.constexprs)
        except Exception as error:
            self.enabled = False  # for good: no retry cost on later calls
            self.why_not = f"the compiled launcher raised {error!r}"
            jit_fn[self.grid](*argument_list(), **self.config)
