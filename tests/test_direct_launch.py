"""The direct launch of a compiled kernel (`insum.direct`), which skips the JIT's binding.

On the CPU: the argument list the direct path passes equals, element for element, what
Python's own binding of the kernel's signature gives for the same call (so the compiled
launcher gets every parameter, constexprs included, in order), for several generated
kernels; and a mock compiled kernel shows the call's shape, the alignment key, the
fallback on an exception and the switches. On CUDA (`gpu`): real repeated calls go through
the direct path and match a float64 product.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import insum
from insum import direct
from insum.bind import bind
from insum.codegen import configs_for
from insum.direct import LAUNCH_OPTIONS, DirectLaunch
from insum.parser import parse
from insum.runtime import Kernel, _Launcher, kernel_for, spec_for

CUDA = torch.cuda.is_available()
DENSE = "C[m, n] = A[m, k] * B[k, n]"
GROUP = "C[AM[p],n] = AV[p,q]*B[AK[p,q],n]"
BLOCK_ROW = "C[p, m, n] = AV[p, q, m, k] * B[AK[p, q], k, n]"


def _dense(dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    return {"A": torch.randn(64, 32, generator=gen).to(dtype), "B": torch.randn(32, 48, generator=gen).to(dtype),
            "C": torch.zeros(64, 48, dtype=dtype)}


def _group(index_dtype=torch.int64):
    gen = torch.Generator().manual_seed(2)
    AM = torch.sort(torch.randint(0, 9, (11,), generator=gen)).values.to(index_dtype)
    return {"AM": AM, "AK": torch.randint(0, 7, (11, 4), generator=gen).to(index_dtype),
            "AV": torch.randn(11, 4, generator=gen), "B": torch.randn(7, 5, generator=gen), "C": torch.zeros(9, 5)}


def _block_row():
    gen = torch.Generator().manual_seed(3)
    return {"AV": torch.randn(3, 2, 64, 64, generator=gen).half(), "AK": torch.randint(0, 4, (3, 2), generator=gen).int(),
            "B": torch.randn(4, 64, 48, generator=gen).half(), "C": torch.zeros(3, 64, 48).half()}


CASES = {
    "dense": lambda: (DENSE, _dense(), {}),
    "groupcoo segment": lambda: (GROUP, _group(), {"sorted_indices": frozenset({"AM"})}),
    "groupcoo int32 atomic": lambda: (GROUP, _group(torch.int32), {}),
    "dense descriptors, persistent": lambda: (DENSE, _dense(torch.float16), {"descriptors": True}),
    "block row descriptors": lambda: (BLOCK_ROW, _block_row(), {"descriptors": True}),
}


def _prepared(name):
    expr, tensors, options = CASES[name]()
    bound = bind(parse(expr), tensors)
    kernel = Kernel(spec_for(bound, **options))
    launcher = _Launcher(kernel, bound)
    config = configs_for(kernel.plan)[-1]
    launcher.set_config(config)
    return kernel, launcher, launcher.args(bound.tensors, tensors["C"]), config


@pytest.mark.parametrize("name", list(CASES))
def test_direct_arguments_are_the_bound_signature(name):
    kernel, launcher, args, config = _prepared(name)
    if name.startswith(("dense desc", "block row")):
        assert kernel.plan.boxes, "the case should build a descriptor plan"
    if name == "dense descriptors, persistent":
        assert kernel.plan.persistent
    if name == "groupcoo segment":
        assert kernel.plan.output == "segment"
    python_fn = kernel.fn.fn
    params = {k: v for k, v in launcher.config.items() if k not in LAUNCH_OPTIONS}  # GROUP_M fitted to the operands
    expected = list(inspect.signature(python_fn).bind(*args, **params).arguments.values())
    got = list(launcher.direct.parameters(args))
    assert launcher.direct.fits and len(got) == len(expected) == len(inspect.signature(python_fn).parameters)
    for position, (a, b) in enumerate(zip(got, expected)):
        assert a is b or (not isinstance(a, torch.Tensor) and a == b and type(a) is type(b)), position


class _MockKernel:
    """A compiled kernel whose launcher records its calls (or raises)."""

    def __init__(self, fail=False):
        self.calls = []
        self.fail = fail
        self.function = "function-handle"
        self.packed_metadata = "packed"

    def run(self, *call):
        if self.fail:
            raise TypeError("refused")
        self.calls.append(call)


class _MockJIT:
    """`fn[grid](*args, **config)` records the call and returns the compiled kernel (or a
    future of it)."""

    def __init__(self, kernel, future=False):
        self.kernel, self.future, self.calls = kernel, future, []

    def __getitem__(self, grid):
        def launch(*args, **config):
            self.calls.append((grid, args, config))
            if self.future:
                return type("Future", (), {"result": lambda _: self.kernel})()
            return self.kernel

        return launch


class _Driver:
    device = 0

    @classmethod
    def get_current_device(cls):
        return cls.device

    @staticmethod
    def get_current_stream(device):
        return 1000 + device


class _Knobs:
    launch_enter_hook = None
    launch_exit_hook = None


@pytest.fixture
def mock_triton(monkeypatch):
    monkeypatch.setattr(direct, "_triton_runtime", lambda: (_Driver, _Knobs))
    monkeypatch.delenv("INSUM_DIRECT_LAUNCH", raising=False)
    monkeypatch.setattr(_Driver, "device", 0)
    monkeypatch.setattr(_Knobs, "launch_enter_hook", None)


def _direct(name="groupcoo segment"):
    kernel, launcher, args, config = _prepared(name)
    launch = DirectLaunch(kernel.fn.fn, launcher.grid, config, len(args),
                          tuple(p for p, _ in launcher.pointers), allowed=True)
    return launch, args, config


@pytest.mark.parametrize("future", [False, True])
def test_first_call_goes_through_the_jit_then_direct(mock_triton, future):
    launch, args, config = _direct()
    compiled = _MockKernel()
    jit = _MockJIT(compiled, future)
    launch(jit, args)
    assert len(jit.calls) == 1 and jit.calls[0][2] == config and not compiled.calls
    launch(jit, args)
    launch(jit, args)
    assert len(jit.calls) == 1 and len(compiled.calls) == 2
    call = compiled.calls[0]
    g = launch.grid
    assert call[:9] == (g[0], 1, 1, 1000, "function-handle", "packed", None, None, None)
    assert call[9:] == launch.parameters(args)


def test_alignment_and_device_are_the_key(mock_triton):
    launch, args, _ = _direct()
    compiled = _MockKernel()
    jit = _MockJIT(compiled)
    launch(jit, args)
    launch(jit, args)
    shifted = list(args)
    i = next(p for p in launch.pointers if args[p].dtype == torch.float32)
    shifted[i] = torch.cat([torch.zeros(1), args[i].reshape(-1)])[1:].view_as(args[i])  # 4 bytes off
    assert shifted[i].data_ptr() % 16 != 0
    launch(jit, shifted)  # a new alignment: the JIT specialises anew
    assert len(jit.calls) == 2
    launch(jit, shifted)
    _Driver.device = 1
    launch(jit, args)  # another device: the JIT again
    assert len(jit.calls) == 3 and len(compiled.calls) == 2


def test_an_exception_switches_the_direct_path_off_for_good(mock_triton):
    launch, args, _ = _direct()
    compiled = _MockKernel(fail=True)
    jit = _MockJIT(compiled)
    launch(jit, args)
    launch(jit, args)  # the launcher refuses: the JIT launches instead
    assert len(jit.calls) == 2 and not launch.enabled
    compiled.fail = False
    launch(jit, args)
    assert len(jit.calls) == 3 and not compiled.calls  # no retry


def test_switch_and_hook_take_the_jit_path(mock_triton, monkeypatch):
    launch, args, _ = _direct()
    compiled = _MockKernel()
    jit = _MockJIT(compiled)
    launch(jit, args)
    monkeypatch.setenv("INSUM_DIRECT_LAUNCH", "0")
    launch(jit, args)
    monkeypatch.setenv("INSUM_DIRECT_LAUNCH", "1")
    monkeypatch.setattr(_Knobs, "launch_enter_hook", lambda metadata: None)
    launch(jit, args)
    assert len(jit.calls) == 3 and not compiled.calls
    monkeypatch.setattr(_Knobs, "launch_enter_hook", None)
    launch(jit, args)
    assert len(compiled.calls) == 1
    # An exit hook runs after the launch: the JIT path, never a direct launch that an
    # exception from the hook would make the fallback repeat (adding into the output twice).
    monkeypatch.setattr(_Knobs, "launch_exit_hook", lambda metadata: None)
    launch(jit, args)
    assert len(jit.calls) == 4 and len(compiled.calls) == 1
    monkeypatch.setattr(_Knobs, "launch_exit_hook", type("HookChain", (), {"calls": []})())  # empty: direct
    launch(jit, args)
    assert len(compiled.calls) == 2


def test_a_configuration_is_published_after_its_launch(monkeypatch):
    """Another thread (autograd runs backward on its own) that sees a launcher's
    configuration must find its grid and direct launch already there."""
    from insum import runtime

    expr, tensors, options = CASES["dense"]()
    bound = bind(parse(expr), tensors)
    kernel = Kernel(spec_for(bound, **options))
    launcher = _Launcher(kernel, bound)
    seen = []
    monkeypatch.setattr(runtime, "DirectLaunch", lambda *a: seen.append(launcher.config) or DirectLaunch(*a))
    config = configs_for(kernel.plan)[-1]
    launcher.set_config(config)
    assert seen == [None] and launcher.config is config and launcher.direct.grid == launcher.grid


def test_never_direct_in_the_interpreter():
    _, launcher, _, _ = _prepared("dense")
    assert not launcher.direct.enabled


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA: the compiled kernel's own launcher")
@pytest.mark.parametrize("name", ["dense", "groupcoo segment", "groupcoo int32 atomic", "block row descriptors"])
def test_cuda_repeats_go_direct_and_match(name):
    expr, make, options = CASES[name]()
    sorted_indices = options.get("sorted_indices", frozenset())
    for seed in range(3):  # the first call goes through the JIT, the others direct
        tensors = {k: v.cuda() for k, v in make.items()} if seed == 0 else {
            k: (v.cuda() if not v.is_floating_point() else (torch.randn_like(v.float()) * (seed + 1)).to(v.dtype).cuda())
            for k, v in make.items()}
        tensors["C"] = torch.full_like(tensors["C"], float("nan"))
        out = insum.insum(expr, sorted_indices=sorted_indices, **tensors)
        ref = insum.insum(expr, backend="torch", **{k: (v.double() if v.is_floating_point() else v).clone()
                                                     for k, v in tensors.items()} | {"C": torch.zeros_like(tensors["C"], dtype=torch.float64)})
        # tf32 dots (the default precision): the tolerance scales with the inputs' size
        torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2 * max(1.0, ref.abs().max().item()))
    bound = bind(parse(expr), tensors)
    launcher = kernel_for(bound, sorted_indices=sorted_indices).prepared(bound)
    assert launcher.direct.enabled and launcher.direct.compiled, launcher.direct.why_not


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA: the compiled batch kernel")
@pytest.mark.parametrize("partitions", [1, 2])
def test_cuda_cell_buckets_run_as_one_direct_launch(partitions):
    from insum import runtime
    from insum.formats import CELL

    gen = torch.Generator().manual_seed(partitions)
    M, K = 300, 257
    lengths = (K / (torch.arange(M) + 1.0) ** 0.8).long()
    A = torch.zeros(M, K)
    for r, n in enumerate(lengths.tolist()):
        A[r, torch.randperm(K, generator=gen)[:n]] = torch.randn(n, generator=gen)
    fmt = CELL.from_dense(A.cuda(), partitions=partitions)
    assert len(fmt.widths) >= 3
    runtime._BATCHES.clear()  # batches of earlier tests with as many parts never ran here
    for _ in range(3):  # one by one, then one batch launch through the JIT, then direct
        B = torch.randn(K, 64, generator=gen).cuda()
        torch.testing.assert_close((fmt @ B).double(), A.double().cuda() @ B.double(), rtol=2e-2, atol=2e-2)
    batches = [b for b in runtime._BATCHES.values() if len(b.parts) == len(fmt.widths)]
    assert batches
    for b in batches:
        assert b.direct.enabled and b.direct.compiled, b.direct.why_not


@pytest.mark.skipif(CUDA, reason="builds the batch in the interpreter")
def test_batch_direct_arguments_are_the_bound_signature():
    from insum import runtime
    from insum.formats import CELL

    gen = torch.Generator().manual_seed(4)
    A = torch.zeros(23, 17)
    for r in range(23):
        n = (0, 1, 2, 3, 6, 17)[r % 6]
        A[r, torch.randperm(17, generator=gen)[:n]] = torch.randn(n, generator=gen)
    fmt = CELL.from_dense(A)
    B = torch.randn(17, 3, generator=gen)
    fmt.spmm(B, backend="triton")
    fmt.spmm(B, backend="triton")
    (batch,) = [b for b in runtime._BATCHES.values() if len(b.parts) == len(fmt.widths)][-1:]
    calls = [(dict(t, C=torch.zeros(23, 3), B=B)) for _, t in fmt.statements()]
    args = []
    for part, tensors in zip(batch.parts, calls):
        args += part.args(tensors, tensors["C"])
    args += batch.ends
    params = {k: v for k, v in batch.direct.config.items() if k not in LAUNCH_OPTIONS}
    expected = list(inspect.signature(batch.fn.fn).bind(*args, **params).arguments.values())
    assert batch.direct.fits
    got = list(batch.direct.parameters(args))
    assert len(got) == len(expected)
    for position, (a, b) in enumerate(zip(got, expected)):
        assert a is b or (not isinstance(a, torch.Tensor) and a == b), position


def test_alignments_given_by_the_caller_key_the_same_compiled_kernel(mock_triton):
    launch, args, _ = _direct()
    compiled = _MockKernel()
    jit = _MockJIT(compiled)
    launch(jit, args)  # the JIT, keyed by the pointers it reads
    given = []
    launch(jit, args, lambda: given.append(1) or tuple(args[i].data_ptr() & 15 for i in launch.pointers))
    assert len(jit.calls) == 1 and len(compiled.calls) == 1 and given == [1]
    launch(jit, args, lambda: (3,) * len(launch.pointers))  # another alignment: the JIT again
    assert len(jit.calls) == 2


def test_addresses_go_to_the_compiled_launcher_and_tensors_to_the_jit(mock_triton):
    launch, args, _ = _direct()
    compiled = _MockKernel()
    jit = _MockJIT(compiled)
    addresses = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
    made = []

    def arguments():
        made.append(1)
        return args

    launch(jit, arguments, None, lambda: addresses)  # the JIT: the tensors
    assert jit.calls[0][1] == tuple(args) and made == [1]
    launch(jit, arguments, None, lambda: addresses)
    assert compiled.calls[0][9:] == (*addresses, *launch.constexprs)
    assert len(made) == 2  # (the key read the tensors' alignment from the list)
    key = tuple(args[i].data_ptr() & 15 for i in launch.pointers)
    launch(jit, arguments, lambda: key, lambda: addresses)  # keyed by the caller: no list made
    assert len(compiled.calls) == 2 and len(made) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA: the compiled kernels' own launchers")
@pytest.mark.parametrize("name", ["GroupCOO", "ELL", "COO", "CELL"])
def test_cuda_pinned_products_go_direct_and_match(name, monkeypatch):
    """fmt @ B repeated runs pinned (`execute.Pinned`) through the direct launch; a B 4 bytes
    off 16-byte alignment afterwards is still right (by whichever path its alignment takes)."""
    from insum import execute, formats

    gen = torch.Generator().manual_seed(8)
    M, K = 200, 131
    lengths = (K / (torch.arange(M) + 1.0) ** 0.8).long()
    A = torch.zeros(M, K)
    for r, n in enumerate(lengths.tolist()):
        A[r, torch.randperm(K, generator=gen)[:n]] = torch.randn(n, generator=gen)
    fmt = getattr(formats, name).from_dense(A.cuda())
    runs = []
    real = execute.Pinned.run
    monkeypatch.setattr(execute.Pinned, "run", lambda self, varying: runs.append(1) or real(self, varying))
    for i in range(7):
        flat = torch.randn(K * 64 + 1, generator=gen).cuda()
        B = (flat[1:] if i == 6 else flat[:-1]).view(K, 64)
        torch.testing.assert_close((fmt @ B).double(), A.double().cuda() @ B.double(), rtol=2e-2, atol=2e-2)
    assert len(runs) >= 4
    plan = next(iter(fmt.__dict__["_spmm_plans"].values()))
    direct = plan.pinned.launch.launch.direct if name == "CELL" else plan.pinned.launch.launcher.direct
    assert direct.enabled and direct.compiled, "the pinned launch did not go direct"


# ----------------------------------------------------------------- kept tensor maps


def _launcher_36(c_launch, positions, metas):
    """A launcher laid out as Triton 3.6's `CudaLauncher`: its `launch` wraps the C launch
    function and expands each descriptor (at `positions`, after the 13 base arguments) with
    `make_tensordesc_arg` on every call, as 3.6's `wrap_handle_tensordesc` does."""
    from triton.backends.nvidia import driver as nvidia

    tensordesc_indices, tensordesc_meta, launcher = set(positions), list(metas), c_launch

    def inner(*args):
        final = list(args[:13])
        k = 0
        for i, arg in enumerate(args[13:]):
            if i in tensordesc_indices:
                final.extend(nvidia.make_tensordesc_arg(arg, tensordesc_meta[k]))
                k += 1
            else:
                final.append(arg)
        return launcher(*final)

    run = type("CudaLauncher", (), {})()
    run.launch, run.global_scratch_size, run.profile_scratch_size = inner, 0, 0
    run.launch_cooperative_grid, run.launch_pdl = False, False
    return run


@pytest.fixture
def encoder(monkeypatch):
    """Triton 3.6's launcher layout and an encoder that counts its calls (a map is a tuple of
    what it encodes)."""
    from triton.backends.nvidia import driver as nvidia

    encoded = []

    def make_tensordesc_arg(desc, meta):
        encoded.append(desc.base.data_ptr())
        return [("map", desc.base.data_ptr(), tuple(desc.block_shape), meta), *desc.shape, *desc.strides]

    monkeypatch.setattr(nvidia, "_BASE_ARGS_FORMAT", "iiiKKppOOOOOO", raising=False)
    monkeypatch.setattr(nvidia, "make_tensordesc_arg", make_tensordesc_arg)
    return encoded


def _descriptor(tensor, block):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(tensor, list(tensor.shape), list(tensor.stride()), block)


def test_kept_maps_pass_what_the_launcher_would(encoder):
    """The kept-map launch gives the C function the argument list Triton's wrapper would,
    encoding a descriptor only for an address (or box) it has not seen."""
    calls = []
    run = _launcher_36(lambda *a: calls.append(a), positions=[1, 3], metas=["meta-a", "meta-b"])
    maps = direct._TensorMaps.for_launcher(run)
    assert maps is not None
    A, B, B2 = torch.randn(64, 32), torch.randn(32, 16), torch.randn(32, 16)
    base = ((4, 1, 1), 7, "fn", "packed", None, None)

    def both(*parameters):
        run.launch(*base[0], base[1], base[2], False, False, None, None, base[3], None, None, None, *parameters)
        expected = calls.pop()
        maps(*base, parameters)
        assert calls.pop() == expected

    both(11, _descriptor(A, [16, 16]), 5, _descriptor(B, [16, 8]), "constexpr")
    assert len(encoder) == 4  # the wrapper's two, the kept maps' first two
    both(11, _descriptor(A, [16, 16]), 5, _descriptor(B, [16, 8]), "constexpr")
    assert len(encoder) == 6  # the wrapper's only: both maps kept
    both(11, _descriptor(A, [16, 16]), 5, _descriptor(B2, [16, 8]), "constexpr")
    assert encoder[-1] == B2.data_ptr() and len(encoder) == 9  # a new address: encoded
    both(11, _descriptor(A, [32, 16]), 5, _descriptor(B2, [16, 8]), "constexpr")
    assert len(encoder) == 12  # a new box for A: encoded


def test_kept_maps_only_for_the_known_layout(encoder, monkeypatch):
    from triton.backends.nvidia import driver as nvidia

    run = _launcher_36(lambda *a: None, positions=[0], metas=["meta"])
    assert direct._TensorMaps.for_launcher(run) is not None
    run.global_scratch_size = 128  # scratch allocated per launch by the launcher
    assert direct._TensorMaps.for_launcher(run) is None
    assert direct._TensorMaps.for_launcher(_launcher_36(lambda *a: None, positions=[0], metas=[None])) is None
    assert direct._TensorMaps.for_launcher(_launcher_36(lambda *a: None, positions=[], metas=[])) is None
    assert direct._TensorMaps.for_launcher(_MockKernel().run) is None
    monkeypatch.setattr(nvidia, "_BASE_ARGS_FORMAT", "iiiKKppOOOOOOOOO")
    assert direct._TensorMaps.for_launcher(_launcher_36(lambda *a: None, positions=[0], metas=["meta"])) is None


def test_direct_launch_goes_through_kept_maps(mock_triton, encoder, monkeypatch):
    """A compiled kernel whose launcher is laid out as 3.6's launches through its kept maps;
    INSUM_KEEP_TENSOR_MAPS=0 sends it through the launcher (which encodes every time)."""
    launch, args, _ = _direct("block row descriptors")
    position = next(i for i, a in enumerate(args) if type(a).__name__ == "TensorDescriptor")
    calls = []
    compiled = _MockKernel()
    compiled.run = _launcher_36(lambda *a: calls.append(a), positions=[position], metas=["meta"])
    compiled.run.__class__.__call__ = lambda self, *call: compiled.calls.append(call)
    jit = _MockJIT(compiled)
    launch(jit, args)
    launch(jit, args)
    launch(jit, args)
    assert len(calls) == 2 and not compiled.calls and len(encoder) == 1
    assert calls[0][:13] == (*launch.grid3, 1000, "function-handle", False, False, None, None, "packed", None, None,
                             None)
    monkeypatch.setenv("INSUM_KEEP_TENSOR_MAPS", "0")
    launch(jit, args)
    assert len(calls) == 2 and len(compiled.calls) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA: the compiled kernels' own launchers")
def test_cuda_block_ell_through_kept_maps_matches(monkeypatch):
    """Block-ELL products through tensor descriptors, repeated over rotating operands and new
    outputs: right every time; on a launcher laid out as Triton 3.6's, through kept maps."""
    from insum import runtime
    from insum.formats import BlockGroupCOO

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor descriptors need sm_90")
    monkeypatch.delenv("INSUM_KEEP_TENSOR_MAPS", raising=False)
    gen = torch.Generator().manual_seed(12)
    keep = torch.rand(4, 3, generator=gen) < 0.6
    keep[0] = True
    A = (torch.randn(256, 192, generator=gen) * keep.repeat_interleave(64, 0).repeat_interleave(64, 1)).half().cuda()
    fmt = BlockGroupCOO.from_dense(A, block=(64, 64), group_size="row")
    Bs = [torch.randn(192, 80, generator=gen).half().cuda() for _ in range(3)]
    for i in range(9):
        B = Bs[i % 3]
        got = fmt @ B
        torch.testing.assert_close(got.double(), A.double() @ B.double(), rtol=1e-2, atol=1e-2)
    compiled = [entry for k in runtime._KERNELS.values() for launch in k._launchers.values()
                if getattr(launch, "direct", None) is not None for entry in launch.direct.compiled.values()]
    kept = [entry[3] for entry in compiled if entry[3] is not None]
    from triton.backends.nvidia import driver as nvidia

    if getattr(nvidia, "_BASE_ARGS_FORMAT", None) == direct._LAUNCHER_BASE_FORMAT:
        assert any(maps.maps for maps in kept), "the descriptor launch did not keep its maps"
