"""A cheap lower bound of the host memory a run needs, checked before any rank starts.

Every rank builds the whole model in its parameter dtype on the host before FSDP shards it (so
that all ranks start from the same weights), and the ranks of one machine do so at the same
time. A model that cannot fit that many times in the machine's memory fails minutes later in
every rank with an allocator error or the kernel's OOM killer; the product of a few settings
says so at once. Only this bound is checked: activations, gradients and optimizer state come on
top, so a run that passes can still run out of memory, and then its rank's failure names the
cause.
"""

from __future__ import annotations

import os

from hyperparallel.train.config import PARAMETER_DTYPES


def physical_memory_bytes() -> int | None:
    """The machine's physical memory, or None where the OS does not say (non-POSIX)."""
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    return pages * page_size if pages > 0 and page_size > 0 else None


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:,.1f} GiB"


def check_host_memory(
    parameters: int,
    ranks: int,
    model: str,
    available: int | None = None,
    *,
    dtype: str = "fp32",
) -> None:
    """Refuse a model whose copies, one per rank of this machine, exceed its memory.

    Args:
        parameters: the model's parameter count.
        ranks: ranks that build it on this machine at the same time.
        model: how the message names the model and its size settings.
        available: bytes of memory (default: :func:`physical_memory_bytes`).
        dtype: the parameters' dtype setting (``fp32`` or ``bf16``).

    Raises:
        ValueError: naming the model, the estimate and the memory.
    """
    available = physical_memory_bytes() if available is None else available
    need = parameters * PARAMETER_DTYPES[dtype].itemsize * ranks
    if available is None or need <= available:
        return
    copies = f"{ranks} ranks each build it whole" if ranks > 1 else "the rank builds it whole"
    raise ValueError(
        f"{model} has {parameters:,} parameters; {copies} in {dtype} at start-up, at least "
        f"{_gib(need)}, above this machine's {_gib(available)} of memory; choose a smaller "
        "model or fewer ranks per machine"
    )
