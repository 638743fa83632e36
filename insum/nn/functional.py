"""Functional forms of the insum.nn layers."""

from .linear import sparse_linear

__all__ = ["sparse_linear"]
