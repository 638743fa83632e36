"""Functional forms of the insum.nn layers."""

from .conv import sparse_conv3d
from .linear import sparse_linear

__all__ = ["sparse_linear", "sparse_conv3d"]
