"""Where the kernel tests run: on the GPU when there is one, else in the Triton interpreter.

Kernel test modules import this before insum: TRITON_INTERPRET must be set before triton is
imported. One tile configuration per kernel (INSUM_AUTOTUNE=0) is enough for correctness;
a test that tunes sets the variable itself.
"""

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("INSUM_AUTOTUNE", "0")

DEVICE = "cuda" if CUDA else "cpu"
#: Compiled kernels on the GPU, the interpreter elsewhere.
KERNEL_MARK = pytest.mark.gpu if CUDA else pytest.mark.interpreter
