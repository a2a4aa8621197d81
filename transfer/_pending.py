"""A request in flight: the one object both clients hand back for every request.

A leaf module: the core, the ring link and the pools all finish or wait on
these, and none of them may import another to get it.
"""

from __future__ import annotations

from typing import Any, Callable

from . import errors as E

__all__ = ["Pending", "AwaitablePending"]


class Pending:
    """A request in flight. `result()` waits for it (driving the client's I/O).

    Always true as a bool (no `__len__`, no `__bool__`): `submit(...) or _submit(...)`
    relies on it. The native submit makes one without `__init__` (native/submission.c,
    `template_learn`): every field but `id` and `_waiter` starts as `__init__` leaves it."""

    __slots__ = ("id", "_waiter", "_done", "_value", "_error", "_observed", "_waker", "_deps")

    def __init__(self, rid: int, waiter: Callable[..., Any]) -> None:
        self.id = rid
        self._waiter = waiter
        self._done = False
        self._value: Any = None
        self._error: E.TransferError | None = None
        self._observed = False
        #: Anything with .set() (a trio.Event): woken when the request finishes.
        self._waker: Any = None
        #: Deferred definitions sent for this request: their failure is this request's failure.
        self._deps: list[Pending] | None = None

    def done(self) -> bool:
        return self._done

    def result(self, timeout: float | None = None) -> Any:
        if not self._done:
            self._waiter(self, timeout)
        self._observed = True
        err = self._error if self._deps is None else self._outcome()  # (no call for most requests)
        if err is not None:
            raise err
        return self._value

    def exception(self, timeout: float | None = None) -> E.TransferError | None:
        if not self._done:
            self._waiter(self, timeout)
        self._observed = True
        return self._outcome()

    def _outcome(self) -> E.TransferError | None:
        """This request's error, if any: a deferred definition it depended on failing first
        (e.g. the alloc it touched was refused), then its own."""
        for dep in self._deps or ():
            if dep._error is not None:
                dep._observed = True
                return dep._error
        return self._error

    def _finish(self, value: Any, error: E.TransferError | None) -> None:
        self._done = True
        self._value = value
        self._error = error
        if self._waker is not None:
            self._waker.set()

    def __repr__(self) -> str:
        state = "pending" if not self._done else ("failed" if self._error else "done")
        return f"<{type(self).__name__} #{self.id} {state}>"


class AwaitablePending(Pending):
    """A request in flight in an event-loop client (trio, asyncio): await it for its result.

    `result()` cannot wait there (it would block the loop that must deliver the reply),
    so it only reads a request that is done."""

    __slots__ = ()

    def result(self, timeout: float | None = None) -> Any:
        if not self._done:
            raise RuntimeError("in an async client, await the request instead of calling result()")
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> E.TransferError | None:
        if not self._done:
            raise RuntimeError("in an async client, await the request instead of calling result()")
        return super().exception(timeout)

    async def wait(self) -> Any:
        await self._waiter(self, None)
        return self.result()

    def __await__(self) -> Any:
        return self.wait().__await__()
