"""One test body, every client: a blocking facade over the real TrioClient and AsyncioClient.

`TrioFacade` runs `open_client` inside `trio.run` on a background thread and
calls into it with `trio.from_thread` (`AsyncioFacade`: `open_asyncio_client`
in `asyncio.run`, with `run_coroutine_threadsafe`): a method that returns an awaitable
(an operation, `await c.segment(n)`) is awaited there, a pending request
comes back as a `FacadePending` whose `result()` awaits it there, and pools
and slots are wrapped the same way. So a test written against the blocking
API drives the trio client's own code paths, with no test-only logic in it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import math
import threading
from typing import Any

import trio

import transfer
from transfer.client import Slot, SlotPool
from transfer._pending import AwaitablePending


async def _await(x: Any) -> Any:
    return await x


class _Bridge:
    """Calls into one trio thread."""

    def __init__(self, token: trio.lowlevel.TrioToken) -> None:
        self.token = token

    def run_sync(self, fn: Any) -> Any:
        return trio.from_thread.run_sync(fn, trio_token=self.token)

    def run(self, afn: Any, *args: Any) -> Any:
        return trio.from_thread.run(afn, *args, trio_token=self.token)

    async def settle(self, p: AwaitablePending, timeout: float | None) -> None:
        """Await p, up to timeout, without raising its error."""
        with trio.move_on_after(math.inf if timeout is None else timeout):
            await _settle(p)

    def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run fn in the loop's thread; await what it returns if it is awaitable; wrap the result."""
        (out,) = self.run_sync(lambda: (fn(*args, **kwargs),))  # boxed: may be a coroutine
        if inspect.isawaitable(out) and not isinstance(out, AwaitablePending):
            out = self.run(_await, out)
        return self.wrap(out)

    def wrap(self, x: Any) -> Any:
        if isinstance(x, AwaitablePending):
            return FacadePending(self, x)
        if isinstance(x, (SlotPool, Slot)) or hasattr(x, "__exit__"):  # pools, slots, batch()
            return Facade(self, x)
        return x


class Facade:
    """Proxy: callables run in the trio thread (see _Bridge.call); attributes pass through."""

    def __init__(self, bridge: _Bridge, obj: Any) -> None:
        object.__setattr__(self, "_bridge", bridge)
        object.__setattr__(self, "_obj", obj)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._obj, name)
        if not callable(attr):
            return self._bridge.wrap(attr)
        return lambda *a, **kw: self._bridge.call(attr, *a, **kw)

    def __enter__(self) -> Any:
        enter = getattr(self._obj, "__aenter__", None) or self._obj.__enter__
        self._bridge.call(enter)
        return self

    def __exit__(self, *exc: Any) -> None:
        leave = getattr(self._obj, "__aexit__", None) or self._obj.__exit__
        self._bridge.call(leave, *exc)

    def __repr__(self) -> str:
        return f"<Facade {self._obj!r}>"


class _AsyncioBridge(_Bridge):
    """Calls into one asyncio loop's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def run_sync(self, fn: Any) -> Any:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def call() -> None:
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - raised in the test thread
                fut.set_exception(exc)

        self.loop.call_soon_threadsafe(call)
        return fut.result()

    def run(self, afn: Any, *args: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(afn(*args), self.loop).result()

    async def settle(self, p: AwaitablePending, timeout: float | None) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await _settle(p)


class FacadePending:
    """An awaitable pending seen from the test thread: `result(timeout)` awaits it in the loop's thread."""

    def __init__(self, bridge: _Bridge, p: AwaitablePending) -> None:
        self._bridge = bridge
        self._p = p
        self.id = p.id

    def done(self) -> bool:
        return self._p.done()

    def exception(self, timeout: float | None = None) -> Any:
        async def get() -> Any:
            await self._bridge.settle(self._p, timeout)
            if not self._p.done():
                raise transfer.RequestTimeout(f"no reply within {timeout}s")
            return self._p.exception()

        return self._bridge.run(get)

    def result(self, timeout: float | None = None) -> Any:
        err = self.exception(timeout)
        if err is not None:
            raise err
        return self._p._value


async def _settle(p: AwaitablePending) -> None:
    """Await p without raising its error (exception() reads it after)."""
    try:
        await p
    except transfer.TransferError:
        pass


class TrioFacade(Facade):
    """A TrioClient in a trio loop on its own thread, driven through the blocking API."""

    def __init__(self, endpoint: str, **kwargs: Any) -> None:
        ready = threading.Event()
        box: dict[str, Any] = {}

        async def main() -> None:
            try:
                async with transfer.open_client(endpoint, **kwargs) as c:
                    box["client"], box["token"], box["stop"] = c, trio.lowlevel.current_trio_token(), trio.Event()
                    ready.set()
                    await box["stop"].wait()
            except BaseException as exc:  # noqa: BLE001 - handed to the test thread
                box["error"] = exc
            finally:
                ready.set()

        thread = threading.Thread(target=trio.run, args=(main,), name="trio-facade", daemon=True)
        thread.start()
        ready.wait()
        if "error" in box:
            thread.join()
            raise box["error"]
        super().__init__(_Bridge(box["token"]), box["client"])
        object.__setattr__(self, "_box", box)
        object.__setattr__(self, "_thread", thread)

    def close(self) -> None:
        """Leave open_client (it closes the session) and end the loop."""
        if not self._thread.is_alive():
            return
        trio.from_thread.run_sync(self._box["stop"].set, trio_token=self._bridge.token)
        self._thread.join(30)
        if "error" in self._box:
            raise self._box["error"]

    def __enter__(self) -> "TrioFacade":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncioFacade(Facade):
    """An AsyncioClient in an asyncio loop on its own thread, driven through the blocking API."""

    def __init__(self, endpoint: str, **kwargs: Any) -> None:
        ready = threading.Event()
        box: dict[str, Any] = {}

        async def main() -> None:
            try:
                async with transfer.open_asyncio_client(endpoint, **kwargs) as c:
                    box["client"], box["loop"], box["stop"] = c, asyncio.get_running_loop(), asyncio.Event()
                    ready.set()
                    await box["stop"].wait()
            except BaseException as exc:  # noqa: BLE001 - handed to the test thread
                box["error"] = exc
            finally:
                ready.set()

        thread = threading.Thread(target=asyncio.run, args=(main(),), name="asyncio-facade", daemon=True)
        thread.start()
        ready.wait()
        if "error" in box:
            thread.join()
            raise box["error"]
        super().__init__(_AsyncioBridge(box["loop"]), box["client"])
        object.__setattr__(self, "_box", box)
        object.__setattr__(self, "_thread", thread)

    def close(self) -> None:
        """Leave open_asyncio_client (it closes the session) and end the loop."""
        if not self._thread.is_alive():
            return
        self._box["loop"].call_soon_threadsafe(self._box["stop"].set)
        self._thread.join(30)
        if "error" in self._box:
            raise self._box["error"]

    def __enter__(self) -> "AsyncioFacade":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def connect(kind: str, endpoint: str, **kwargs: Any) -> Any:
    """A blocking client (`sync`), or the trio (`trio`) or asyncio (`asyncio`) client behind a facade."""
    if kind == "sync":
        return transfer.connect(endpoint, **kwargs)
    return TrioFacade(endpoint, **kwargs) if kind == "trio" else AsyncioFacade(endpoint, **kwargs)
