"""Kernels and backends as registered plug-ins, chosen by one rule and logged.

Every place in the workspace that picks an implementation at run time (attention backends,
sparse-attention kernels, fusion backends) follows the same rule, so a user can predict and
force the choice:

1. A plug-in declares what it accepts (``constraints.rejection(call)`` says why not, or None)
   and whether it is installed at all (``installed()``, probed once per process and only for a
   call its constraints accept: an optional package that does not import, a kernel that does
   not build, a device that is absent).
2. A call goes to the first plug-in in priority order (lowest ``priority`` first, then
   registration order) that is installed and accepts it.
3. A forced choice (an argument or an environment variable the caller reads) that is unknown,
   not installed, or does not accept the call raises :class:`PluginError` naming what it
   accepts, instead of silently falling back.
4. Each distinct choice is logged once per registry, with the reasons the preferred plug-ins
   were skipped.

The *call* is whatever small, hashable description of one invocation the caller defines (device,
dtype, shapes): constraints look at facts, never at tensors.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import torch

logger = logging.getLogger(__name__)

T = TypeVar("T")
C = TypeVar("C", bound=Hashable)


class PluginError(ValueError):
    """No plug-in can take a call, or a forced one cannot; the message names what each accepts."""


class Constraint(Protocol):
    """What a plug-in accepts: anything with this one method."""

    def rejection(self, call: Any) -> str | None:
        """Why the plug-in cannot take ``call`` (e.g. ``"dtype float32 (allowed: bfloat16)"``)."""
        ...


@dataclass(frozen=True)
class DeviceDtype:
    """The constraints most kernels share: device types, dtypes, and autograd support.

    Reads ``call.device`` (a device type string), ``call.dtype`` and, when the call has it,
    ``call.requires_grad``. Packages extend it (head dims, CUDA capability) by subclassing
    and calling ``super().rejection(call)`` first.

    Attributes:
        devices: device types it runs on; None for any.
        dtypes: dtypes it takes; None for any.
        differentiable: whether it has a backward; a call that needs gradients skips it if not.
    """

    devices: tuple[str, ...] | None = None
    dtypes: tuple[torch.dtype, ...] | None = None
    differentiable: bool = True

    def rejection(self, call: Any) -> str | None:
        if self.devices is not None and call.device not in self.devices:
            return f"device {call.device!r} (allowed: {', '.join(self.devices)})"
        if self.dtypes is not None and call.dtype not in self.dtypes:
            allowed = ", ".join(_dtype_name(d) for d in self.dtypes)
            return f"dtype {_dtype_name(call.dtype)} (allowed: {allowed})"
        if not self.differentiable and getattr(call, "requires_grad", False):
            return "inputs require grad (allowed: inference only, no backward)"
        return None


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "mixed" if dtype is None else str(dtype).removeprefix("torch.")


def always_installed() -> str | None:
    """``installed`` probe of a plug-in with nothing optional to import."""
    return None


@dataclass(frozen=True)
class Plugin(Generic[T, C]):
    """One implementation and what it accepts.

    Attributes:
        name: what users force it by (an argument value, an environment variable value).
        impl: the implementation itself (a kernel function, a backend object).
        constraints: ``rejection(call)`` for one call.
        installed: returns why it is unusable in this process (package missing, no device), or
            None; called once per process.
        priority: lower is preferred.
    """

    name: str
    impl: T
    constraints: Constraint
    installed: Callable[[], str | None] = always_installed
    priority: int = 100


@dataclass
class Registry(Generic[T, C]):
    """Plug-ins of one kind, chosen by :meth:`select`.

    Attributes:
        kind: what the plug-ins are, for messages and logs (``"attention backend"``).
    """

    kind: str
    _plugins: dict[str, Plugin[T, C]] = field(default_factory=dict)
    _installed: dict[str, str | None] = field(default_factory=dict)
    _logged: set[tuple[str, Hashable]] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def register(self, plugin: Plugin[T, C], *, replace: bool = False) -> Plugin[T, C]:
        """Add ``plugin``; a second plug-in of the same name is refused unless ``replace``."""
        if plugin.name in self._plugins and not replace:
            raise ValueError(f"{self.kind} {plugin.name!r} is already registered")
        with self._lock:
            self._plugins[plugin.name] = plugin
            self._installed.pop(plugin.name, None)
            self._logged.clear()
        return plugin

    def unregister(self, name: str) -> None:
        with self._lock:
            self._plugins.pop(name, None)
            self._installed.pop(name, None)
            self._logged.clear()

    @contextlib.contextmanager
    def registered(self, plugin: Plugin[T, C]) -> Iterator[Plugin[T, C]]:
        """Register ``plugin`` for the duration of a block (tests, experiments)."""
        self.register(plugin)
        try:
            yield plugin
        finally:
            self.unregister(plugin.name)

    def names(self) -> list[str]:
        """Every registered name, in the order :meth:`select` tries them."""
        return [p.name for p in self._ordered()]

    def get(self, name: str) -> Plugin[T, C]:
        try:
            return self._plugins[name]
        except KeyError:
            raise PluginError(
                f"unknown {self.kind} {name!r}; choose one of {', '.join(self.names())}"
            ) from None

    def installed(self) -> list[str]:
        """Names usable in this process, in preference order."""
        return [p.name for p in self._ordered() if self.why_not_installed(p.name) is None]

    def why_not_installed(self, name: str) -> str | None:
        """Why ``name`` is unusable in this process (probed once), or None."""
        if name not in self._installed:
            self._installed[name] = self.get(name).installed()
        return self._installed[name]

    def rejections(self, call: C) -> dict[str, str | None]:
        """For every plug-in in preference order, why it cannot take ``call`` (None: it can)."""
        return {p.name: self._rejection(p, call) for p in self._ordered()}

    def select(self, call: C, forced: str | None = None) -> Plugin[T, C]:
        """The plug-in for ``call``: ``forced`` if given (or an error), else the first that fits.

        Raises:
            PluginError: nothing fits, or ``forced`` is unknown, not installed or refuses.
        """
        if forced is not None:
            plugin = self.get(forced)
            reason = self._rejection(plugin, call)
            if reason is not None:
                raise PluginError(f"{self.kind} {forced!r} cannot run this call: {reason}")
            self._log_once(plugin, call, "forced")
            return plugin
        skipped: list[str] = []
        for plugin in self._ordered():
            reason = self._rejection(plugin, call)
            if reason is None:
                self._log_once(plugin, call, "; ".join(skipped) or "first choice")
                return plugin
            skipped.append(f"{plugin.name}: {reason}")
        raise PluginError(f"no {self.kind} can run this call: {'; '.join(skipped) or 'none'}")

    def _ordered(self) -> list[Plugin[T, C]]:
        order = {name: i for i, name in enumerate(self._plugins)}
        return sorted(self._plugins.values(), key=lambda p: (p.priority, order[p.name]))

    def _rejection(self, plugin: Plugin[T, C], call: C) -> str | None:
        # Constraints first: they are cheap facts, while an install probe may import a package
        # or build a kernel, which a call the plug-in could never take should not pay for.
        reason = plugin.constraints.rejection(call)
        if reason is not None:
            return reason
        missing = self.why_not_installed(plugin.name)
        return None if missing is None else f"not installed ({missing})"

    def _log_once(self, plugin: Plugin[T, C], call: C, why: str) -> None:
        key = (plugin.name, call)
        if key in self._logged:
            return
        with self._lock:
            self._logged.add(key)
        logger.info("%s %s for %s (%s)", self.kind, plugin.name, call, why)
