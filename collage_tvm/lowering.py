"""The lowering interface: how a chosen subgraph becomes something runnable on a backend.

A backend's lowering (docs/DESIGN.md, "Backends") is one small class, declared here the way TVM's
dlight declares a ``ScheduleRule``: subclass :class:`Lowering`, implement :meth:`version`
and :meth:`lower`, and override :meth:`available` and :meth:`probe` where the defaults do
not fit. The registry checks a lowering when it first resolves it; an object that does not
subclass :class:`Lowering` is accepted when it has callable ``available``, ``version`` and
``lower`` (duck typing), anything else is a ``TypeError`` naming the backend.

A foundation module: it imports only the standard library and tvm.
"""
from __future__ import annotations

import abc
from typing import Callable

from tvm import relax

#: The methods every lowering has (``probe`` is optional: the measurer's default applies).
REQUIRED_METHODS = ("available", "version", "lower")


class Lowering(abc.ABC):
    """Turns one candidate subgraph (a standalone Relax function) into a callable.

    The measurement worker pickles the lowering spec of a backend (an instance, a class, or
    a ``"module:Class"`` string) and re-creates it in a child process: keep instances
    picklable (plain attributes; open libraries lazily).
    """

    #: The backend's name, used in messages.
    name: str = ""
    #: Its builds take seconds and leave a cache on disk that a later build of the same
    #: subgraph in another process reuses (``torch.compile``'s): the measurer's build
    #: processes then build and run its candidates once before they are timed, so that the
    #: measuring process's own build finds them compiled (``Measurer.prebuild``).
    build_cache: bool = False

    def available(self) -> tuple[bool, str]:
        """``(True, "")`` when the library can run here, else ``(False, reason)``.

        Must not raise: a missing library is a reason, not an error.
        """
        return True, ""

    @abc.abstractmethod
    def version(self) -> str:
        """The library's version: part of every cost-database key of this backend."""

    @abc.abstractmethod
    def lower(self, func: relax.Function) -> Callable:
        """``fn(*tvm_tensors) -> tvm tensor | tuple of tvm tensors`` computing ``func``.

        Raise ``NotImplementedError`` (with a reason) for a subgraph the library cannot run.
        """

    def probe(self) -> relax.Function | None:
        """The smallest kernel the backend runs, timed for its call overhead (the DP's
        epsilon). ``None`` (the default): the measurer's 1-element ``add``."""
        return None


def missing_methods(lowering) -> list[str]:
    """The interface methods ``lowering`` (an instance or a class) lacks, sorted; ``[]`` when
    it implements the interface."""
    if isinstance(lowering, type) and issubclass(lowering, Lowering):
        return sorted(getattr(lowering, "__abstractmethods__", ()))
    return [m for m in REQUIRED_METHODS if not callable(getattr(lowering, m, None))]
