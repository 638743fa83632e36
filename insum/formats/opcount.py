"""Count the torch ops and host synchronisations a piece of code issues (packing's budget).

On a GPU, packing time is dominated by two things a CPU run can still count: kernel
launches (one per non-view aten op, a few microseconds each) and host syncs (any op whose
result size or value the host must read waits for the whole queue). `count_ops` records
both with a `TorchDispatchMode`, treating every tensor as if it lived on a GPU, so that
tests and benchmarks can bound them on any machine.

    >>> import torch
    >>> with count_ops() as c:
    ...     x = torch.arange(5)
    ...     n = int(x.sum())
    >>> c.ops, c.syncs
    (2, 1)
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCount", "count_ops"]

# Ops whose output size (or value) the host must read before it can go on.
_DATA_DEPENDENT = {
    "_local_scalar_dense",
    "nonzero",
    "unique_dim",
    "unique_consecutive",
    "unique_dim_consecutive",
    "_unique",
    "_unique2",
    "masked_select",
    "bincount",  # reads the maximum to size its output
    "histc",
    "equal",
    "_coalesce",
    "lift_fresh",  # torch.tensor(data): an upload that waits on the stream
}
# Ops that move no data and launch nothing.
_FREE = {"scalar_tensor", "empty", "empty_strided"}


def _has_bool(indices) -> bool:
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()
    )


def _is_sync(func, args, kwargs) -> bool:
    name = func._schema.name.split("::")[-1]
    if name in _DATA_DEPENDENT:
        return True
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        return _has_bool(args[1] if len(args) > 1 else kwargs.get("indices"))
    if name == "repeat_interleave":
        size = kwargs.get("output_size", args[-1] if len(args) > 1 else None)
        return not isinstance(size, int)
    if name in ("_to_copy", "copy_"):
        source = args[1] if name == "copy_" else args[0]
        target = args[0].device if name == "copy_" else kwargs.get("device") or source.device
        return torch.device(target) != source.device
    return False


class OpCount(TorchDispatchMode):
    """ops: non-view aten ops (launches); syncs: host synchronisations; names: per op."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.syncs = 0
        self.names: Counter[str] = Counter()
        self.sync_names: Counter[str] = Counter()
        self._tolist = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        view = bool(schema.returns) and schema.returns[0].alias_info is not None
        name = func.overloadpacket.__name__
        if _is_sync(func, args, kwargs):
            self.syncs += 1
            self.sync_names[name] += 1
        elif not (view and not schema.is_mutable) and name not in _FREE:
            self.ops += 1
            self.names[name] += 1
        return func(*args, **kwargs)

    def __enter__(self):
        # tolist() reads a tensor without dispatching on the CPU: count it as one sync.
        original = torch.Tensor.tolist
        counter = self

        def tolist(tensor):
            counter.syncs += 1
            counter.sync_names["tolist"] += 1
            with torch.utils._python_dispatch._disable_current_modes():
                return original(tensor)

        self._tolist = original
        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __repr__(self) -> str:
        return f"OpCount(ops={self.ops}, syncs={self.syncs}, sync_names={dict(self.sync_names)})"


def count_ops() -> OpCount:
    """A context manager counting ops and syncs of the code it wraps (see the module doc)."""
    return OpCount()
