"""Errors raised by mccl; each names what went wrong and where to look."""

from __future__ import annotations


class MCCLError(RuntimeError):
    """Base class of mccl's own errors."""


class InitTimeoutError(MCCLError, TimeoutError):
    """Initialisation did not finish within ``init_timeout``.

    Attributes:
        missing_ranks: ranks that never registered at the rendezvous store (read from the store;
            empty when every rank arrived and process-group construction itself stalled).
        address: ``host:port`` (or URL) of the rendezvous store.
        timeout: the limit that passed, in seconds.
    """

    def __init__(
        self, message: str, *, missing_ranks: list[int], address: str, timeout: float
    ) -> None:
        super().__init__(message)
        self.missing_ranks = missing_ranks
        self.address = address
        self.timeout = timeout

    def __reduce__(self) -> tuple[object, tuple[str, list[int], str, float]]:
        # Keep the attributes when a launcher ships the error between processes.
        return (
            _rebuild_timeout,
            (str(self), self.missing_ranks, self.address, self.timeout),
        )


def _rebuild_timeout(
    message: str, missing: list[int], address: str, timeout: float
) -> InitTimeoutError:
    return InitTimeoutError(message, missing_ranks=missing, address=address, timeout=timeout)
