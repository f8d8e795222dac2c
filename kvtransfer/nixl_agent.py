"""One NIXL agent and the one thread every call to it runs on.

`NixlAgent` owns the `nixl_agent` object: it creates it, registers the pool
once, prepares the pool's local descriptor list, loads and unloads remote
agents, posts and polls READs, drains notifications and tears everything
down. Every call goes to a dedicated thread (`call`): NIXL agents are not
thread-safe by default, and on CPU the UCX CMA transport copies synchronously
inside `transfer()`, which must not stall the event loop. The transfer policy
(which holder, deadlines, retries, leases) lives in `NixlTransport`.

`call` waits for the thread even when its caller is cancelled, so nobody goes
on (e.g. frees destination blocks) while an agent call is still running.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvtransfer.pool import PoolView

# What a posted READ is after a step: "PROC", "DONE", "ERR", or the NIXL error raised.
XferState = str | BaseException


class NixlAgent:
    def __init__(self, name: str, *, backends: Sequence[str], progress_thread: bool, num_threads: int):
        from nixl_cu12 import _bindings  # ImportError here when NIXL is missing (the factory falls back)

        # The typed errors the bindings raise (nixlBackendError, nixlRemoteDisconnectError, ...).
        self.errors: tuple[type[BaseException], ...] = tuple(
            v for k, v in vars(_bindings).items() if k.startswith("nixl") and k.endswith("Error")
        )
        self.disconnect_error: type[BaseException] = _bindings.nixlRemoteDisconnectError
        self.name = name
        self._backends = list(backends)
        self._progress_thread = progress_thread
        self._num_threads = num_threads
        self._exec = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"nixl-{name}")
        self._agent: Any = None
        self._reg: Any = None
        self._local: Any = None
        self._remotes: dict[str, Any] = {}  # agent name -> prepped dlist of its blocks

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)` on the agent's thread."""
        fut = asyncio.get_running_loop().run_in_executor(self._exec, functools.partial(fn, *args))
        cancelled = False
        while True:
            try:
                result = await asyncio.shield(fut)
                break
            except asyncio.CancelledError:
                if fut.done():
                    raise
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError
        return result

    # -- lifecycle (agent thread) ----------------------------------------------------
    async def start(self, pool: PoolView) -> bytes:
        """Create the agent, register `pool` once, prepare its blocks; returns the metadata."""
        return await self.call(self._start, pool)

    def _start(self, pool: PoolView) -> bytes:
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        cfg = nixl_agent_config(
            enable_prog_thread=self._progress_thread, backends=self._backends, num_threads=self._num_threads
        )
        self._agent = nixl_agent(self.name, cfg)
        self._reg = self._agent.register_memory(pool.pool)
        self._local = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", pool.block_regions(), pool.memory_type)
        return self._agent.get_agent_metadata()

    async def close(self) -> None:
        if self._agent is not None:
            await self.call(self._close)
        self._exec.shutdown(wait=True)

    def _close(self) -> None:
        for name in list(self._remotes):
            self._unload(name)
        with contextlib.suppress(*self.errors):
            self._local.release()
        with contextlib.suppress(*self.errors):
            self._agent.deregister_memory(self._reg)
        self._agent = None

    # -- remote agents (agent thread) ------------------------------------------------
    def load(self, metadata: bytes, regions: list[tuple[int, int, int]], memory_type: str) -> str:
        """Load a remote agent's metadata and prepare its blocks; returns its name.
        (Unload an earlier incarnation under the same name first.)"""
        name = self._agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else name
        try:
            self._remotes[name] = self._agent.prep_xfer_dlist(name, regions, memory_type)
        except BaseException:
            self._unload(name)
            raise
        return name

    def unload(self, name: str) -> None:
        self._unload(name)

    def _unload(self, name: str) -> None:
        dlist = self._remotes.pop(name, None)
        if dlist is not None:
            with contextlib.suppress(*self.errors):  # best effort: the peer may be gone already
                dlist.release()
        with contextlib.suppress(*self.errors):
            self._agent.remove_remote_agent(name)

    # -- READs (agent thread): one hop per step -----------------------------------------
    # A READ that is DONE is released in the same call (returned as None); NIXL
    # errors come back as values so the caller still holds the handle to release.
    def post(self, remote: str, src: list[int], dst: list[int], notif: bytes) -> tuple[Any, XferState]:
        xfer = self._agent.make_prepped_xfer("READ", self._local, dst, self._remotes[remote], src, notif)
        try:
            return self._settle(xfer, self._agent.transfer(xfer))
        except self.errors as e:
            return xfer, e

    def poll(self, xfer: Any) -> tuple[Any, XferState]:
        try:
            return self._settle(xfer, self._agent.check_xfer_state(xfer))
        except self.errors as e:
            return xfer, e

    def _settle(self, xfer: Any, state: str) -> tuple[Any, XferState]:
        if state == "DONE":
            with contextlib.suppress(*self.errors):  # else the caller releases it
                xfer.release()
                return None, state
        return xfer, state

    @staticmethod
    def release(xfer: Any) -> None:
        """Release a READ; NIXL cancels it if still active, or raises if it cannot."""
        xfer.release()

    def notifications(self) -> dict[str, list[bytes]]:
        """New notifications by sender; also progresses the agent's worker."""
        return self._agent.get_new_notifs()
