"""The code generator: schedule a bound statement, emit Triton source, choose tile sizes.

Needs no tensors and no GPU: plans and source depend on the statement, roles and dtypes.
"""

from .batch import Batch, emit_batch
from .emit import KERNEL_NAME, Source, emit
from .schedule import KernelSpec, Plan, schedule
from .tune import configs_for, group_rows, operand_bytes, prune_configs

__all__ = [
    "KernelSpec", "Plan", "Source", "Batch", "schedule", "emit", "emit_batch", "configs_for", "prune_configs", "group_rows", "operand_bytes",
    "KERNEL_NAME",
]
