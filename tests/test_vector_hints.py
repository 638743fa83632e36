"""Strides and extents that are multiples of 8 (or 4, 2) elements but not of 16: Triton marks
only multiples of 16, so the kernel states the smaller multiple itself (`stride_multiples`,
`extent_multiples`), and rows 8 fp16 elements apart load and add atomically as 16-byte
vectors (rows 2 apart as 4-byte ones, which the asynchronous copies still take). The stated values are rounded down to their multiples in the kernel, so a launch
whose tensors lack them must be refused, never run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_env import DEVICE  # before insum: the interpreter on CPU-only machines

from insum import insum
from insum.bind import bind
from insum.errors import InsumError
from insum.formats import BlockGroupCOO
from insum.parser import parse
from insum.runtime import extent_multiples, kernel_for, stride_multiples

GATHER = "O[v,co] += X[NB[v,w],ci] * W[w,ci,co]"
TOL = 1e-6 if DEVICE == "cpu" else 2e-3  # (fp32 products run as TF32 on the GPU)


def close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Relative error in the Frobenius norm against a float64 reference, within TOL."""
    return float((actual.double() - expected).norm() / expected.norm()) < TOL
ROOT = Path(__file__).resolve().parents[1]


def gathered(channels: int, dtype=torch.float32, voxels: int = 37, width: int = 5, seed: int = 0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return {
        "X": torch.randn(voxels, channels, generator=gen, device=DEVICE).to(dtype),
        "NB": torch.randint(0, voxels, (voxels, width), generator=gen, device=DEVICE, dtype=torch.int32),
        "W": torch.randn(width, channels, channels, generator=gen, device=DEVICE).to(dtype),
    }


def reference(t: dict) -> torch.Tensor:
    X, NB, W = t["X"].double(), t["NB"].long(), t["W"].double()
    return torch.einsum("vwc,wcd->vd", X[NB], W)


@pytest.mark.parametrize(
    "channels, dtype, expected",
    [(120, torch.float16, 8), (128, torch.float16, None), (100, torch.float16, 4), (98, torch.float16, 2),
     (12, torch.float32, 4), (40, torch.float32, 8), (6, torch.float32, 2), (7, torch.float32, None)],
    ids=["fp16-120", "fp16-128", "fp16-100", "fp16-98", "fp32-12", "fp32-40", "fp32-6", "odd"],
)
def test_multiples_are_those_triton_cannot_see_and_a_vector_can_use(channels, dtype, expected):
    bound = bind(parse(GATHER), gathered(channels, dtype))
    strides = {(name, dim): m for name, dim, m in stride_multiples(bound)}
    extents = dict(extent_multiples(bound))
    assert strides.get(("X", 0)) == expected
    assert strides.get(("O", 0)) == expected  # the output as allocated: contiguous
    assert extents.get("co") == expected and extents.get("ci") == expected
    assert "v" not in extents and "w" not in extents  # rows and index extents: never


@pytest.mark.parametrize("channels", [40, 48, 12])
def test_stated_multiples_multiply_as_the_reference(channels):
    tensors = gathered(channels)
    out = insum(GATHER, **tensors)
    kernel = kernel_for(bind(parse(GATHER), tensors))
    stated = "stride_X_0 = stride_X_0 // 8 * 8" in kernel.source
    assert stated == (channels == 40)
    assert close(out.double(), reference(tensors))


def test_an_output_in_wider_rows_states_its_own_stride():
    tensors = gathered(40)
    buffer = torch.full((37, 56), float("nan"), device=DEVICE)  # rows 56 apart: a multiple of 8
    out = buffer[:, :40].zero_()
    insum(GATHER, O=out, **tensors)
    assert close(out.double(), reference(tensors))
    assert torch.isnan(buffer[:, 40:]).all()  # nothing written past the view


def test_a_prepared_kernel_refuses_an_output_whose_stride_breaks_its_multiple():
    tensors = gathered(40)
    bound = bind(parse(GATHER), tensors)
    kernel = kernel_for(bound)
    kernel.launch(bound, torch.zeros(37, 40, device=DEVICE))
    odd = torch.zeros(37, 41, device=DEVICE)[:, :40]  # rows 41 apart
    with pytest.raises(InsumError, match="not a multiple of 8"):
        kernel.launch(bound, odd)


def test_a_pinned_call_refuses_an_output_whose_stride_breaks_its_multiple():
    tensors = gathered(40)
    bound = bind(parse(GATHER), tensors)
    kernel = kernel_for(bound)
    kernel.launch(bound, torch.zeros(37, 40, device=DEVICE))
    pinned = kernel.prepared(bound).pin(tensors)  # the inputs in place, the output per call
    assert pinned({"O": torch.zeros(37, 40, device=DEVICE)}).arguments()
    with pytest.raises(InsumError, match="not a multiple of 8"):
        pinned({"O": torch.zeros(37, 41, device=DEVICE)[:, :40]}).arguments()


def test_a_kernel_refuses_tensors_that_lack_its_multiples():
    kernel = kernel_for(bind(parse(GATHER), gathered(40)))
    other = bind(parse(GATHER), gathered(48))  # multiples of 16: the kernel's rounding would be wrong
    with pytest.raises(InsumError, match="multiples"):
        kernel.prepared(other)
    # The kernel called as a function picks its sibling for the other tensors.
    tensors = gathered(48)
    assert close(kernel(**tensors).double(), reference(tensors))


@pytest.mark.parametrize("N", [40, 41, 48])
def test_grouped_blocks_scatter_into_rows_of_any_width(N):
    gen = torch.Generator(device=DEVICE).manual_seed(N)
    A = torch.randn(64, 96, generator=gen, device=DEVICE)
    A[torch.rand(4, 6, generator=gen, device=DEVICE).repeat_interleave(16, 0).repeat_interleave(16, 1) < 0.5] = 0
    fmt = BlockGroupCOO.from_dense(A, block=16, group_size=2)
    B = torch.randn(96, N, generator=gen, device=DEVICE)
    assert close((fmt @ B).double(), A.double() @ B.double())


@pytest.mark.skipif(DEVICE != "cpu", reason="the offline compile is for machines without the GPU")
def test_hopper_code_loads_and_adds_vectors_where_rows_are_8_elements_apart():
    """Compiled for sm_90 on this machine (`benchmarks.explore.ptx`): the 120-channel gathered
    GEMM loads X's rows asynchronously in 16-byte vectors and stores 16 bytes at a time as at
    128 channels (at 98 channels 4-byte copies, still asynchronous), and a grouped block
    product adds 8 fp16 at once into rows 1000 apart as into rows 1008 apart."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "benchmarks.explore.ptx"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    facts, case = {}, None
    for line in done.stdout.splitlines():
        if line.startswith("== "):
            case = line[3:].split(":")[0]
            facts[case] = {}
        elif case is not None and line.strip():
            count, opcode = line.split()
            facts[case][opcode] = int(count)
    for n in ("1000", "1008"):
        grouped = facts[f"grouped BlockGroupCOO N={n}"]
        assert grouped.get("red.global.gpu.relaxed.add.noftz.v8.f16"), grouped
        assert not grouped.get("red.global.gpu.relaxed.add.noftz.f16"), grouped
    for c in ("120", "128"):
        conv = facts[f"conv TILED {c} channels"]
        assert conv.get("cp.async.cg.shared.global") and conv.get("st.global.v4.b32"), conv
    for c in ("98", "120", "128"):
        conv = facts[f"conv TILED {c} channels"]
        assert conv.get("cp.async.ca.shared.global"), conv
        assert not any(op.startswith("ld.global.b16") or op.startswith("st.global.b16") for op in conv), conv


def test_tuning_buckets_split_where_triton_compiles_differently():
    """One tuned configuration serves an extent bucket only among calls that Triton compiles
    alike: rows 1008 and 1024 elements apart (multiples of 16) share one, rows 1001 and 1009
    apart another (`Kernel.bucket`)."""
    statement = "C[m,n] += A[m,k] * B[k,n]"

    def bound(n: int):
        return bind(parse(statement), {"A": torch.randn(24, 16, device=DEVICE), "B": torch.randn(16, n, device=DEVICE)})

    kernel = kernel_for(bound(1001))
    assert not kernel.spec.stride_multiples and not kernel.spec.extent_multiples
    b1001, b1009, b1008, b1024 = (kernel.bucket(kernel.prepared(bound(n))) for n in (1001, 1009, 1008, 1024))
    assert b1001 == b1009 and b1008 == b1024 and b1001 != b1008
