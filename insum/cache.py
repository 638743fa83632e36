"""The one in-memory cache policy.

Every cache in insum is a `BoundedCache`: at most `LIMIT` entries, and a new key beyond
that evicts the oldest one (insertion order), so a workload whose shapes keep changing
costs recompilation, never unbounded memory. Lookups are plain dict lookups (the launch
path reads several caches per call). No cache holds a tensor: keys and values are
statements, signatures (dtypes, shapes, strides, devices), plans, kernels and ints
(except a format's own plans, which hold that format's tensors and live on it).

What is cached, and where:
  parser.parse                text -> Statement
  bind._analyse               Statement -> its tensor uses and roles
  bind.bind                   (Statement, signature) -> the checked binding, without tensors
  bounds.check_indices        (Statement, signature) -> the device checks left to do
  autograd.derive             Statement -> its gradient statements
  runtime.kernel_for          KernelSpec -> Kernel; (Statement, signature, precision) -> Kernel
  runtime.Kernel              per kernel: launches per signature, tile configs per extents
                              bucket (also on disk), sibling kernels per re-planned spec
  execute.run                 statements that already warned about the fallback
  execute.prepared            (text, options, call signature) -> a prepared call (no tensors)
  execute.prepared_batch      (texts, options, tensor structure, signatures) -> a batch launch
  runtime.batch_launch        the prepared launches of a batch -> its loaded batch kernel
  formats.SparseFormat.spmm   per format object: B signature -> its SpMM plan, with the calls
                              pinned to views of the format's own tensors (no other tensor)
  execute.longest_first       per declared-lengths tensor (weakly held, with its version):
                              the programs' order, a small int32 tensor that dies with it
  formats.transposed          per transposed-pattern tensor TS (weakly held, with its
                              version): its column lengths

Values computed once per process or per device (the triton import mode, the range-check
kernel, a GPU's compute capability, the kernel map's few-element constant tensors per device
and kernel geometry: key layout, offset taps, bit weights) use `functools.cache`: they are
constants, not caches that grow (a build would otherwise upload them, a host sync, each time).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from typing import TypeVar

__all__ = ["BoundedCache", "memoize", "LIMIT"]

LIMIT = 4096

_K = TypeVar("_K", bound=Hashable)
_V = TypeVar("_V")
_R = TypeVar("_R")


class BoundedCache(dict[_K, _V]):
    """A dict of at most `limit` entries that evicts its oldest entry to admit a new one."""

    def __init__(self, limit: int = LIMIT):
        super().__init__()
        self.limit = limit

    def __setitem__(self, key: _K, value: _V) -> None:
        if key not in self and len(self) >= self.limit:
            # pop, not del: autograd runs backward calls on other threads, and two threads
            # evicting at once may pick the same oldest key.
            self.pop(next(iter(self), None), None)
        super().__setitem__(key, value)

    def __reduce__(self):
        # (pickle's dict protocol would set items before `limit` exists)
        return type(self), (self.limit,), None, None, iter(self.items())


def memoize(fn: Callable[[_K], _R]) -> Callable[[_K], _R]:
    """Cache a one-argument pure function in a `BoundedCache` (exceptions are not cached)."""
    cache: BoundedCache = BoundedCache()
    missing = object()

    @functools.wraps(fn)
    def cached(arg):
        value = cache.get(arg, missing)
        if value is missing:
            value = cache[arg] = fn(arg)
        return value

    cached.cache = cache  # type: ignore[attr-defined]
    return cached
