"""A fault-injecting TCP proxy, because `tc netem` is not available here.

This machine lets a test create network namespaces but its kernel has no
`sch_netem` ("Specified qdisc kind is unknown"), so delay and loss cannot be
put on a link. Instead every service of the chaos mesh is reached through a
`FaultProxy` (see harness.py): a worker listens on 127.0.0.1:P and advertises
127.0.0.2:P, where its proxy listens, so every byte another service sends it
(router -> decode streams, health and Stats, decode -> prefill Prefill and
KvSource reads, workers -> router and kvtransfer) crosses the proxy.

Faults, each settable while connections are open (`set_faults`, `heal`):
  delay_s    one-way latency added to every chunk, pipelined like a link's
             (chunks keep their order; throughput is not cut);
  loss       probability that a chunk is "lost": it and everything behind it
             waits `loss_stall_s` more, as TCP does while it retransmits;
  reset      probability per chunk that the connection is reset (both sides);
  partition  nothing is forwarded and new connections wait, until healed
             (then the held bytes flow, as after a short partition TCP recovers).
`set_upstream` re-points a proxy (a restarted process behind a stable address).

All proxies share one asyncio loop in a background thread (`ProxyHub`).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Faults:
    delay_s: float = 0.0
    loss: float = 0.0
    loss_stall_s: float = 0.3
    reset: float = 0.0
    partition: bool = False


class FaultProxy:
    """One listening address forwarding to one upstream; owned by a `ProxyHub`."""

    def __init__(self, hub: ProxyHub, name: str, upstream: tuple[str, int], seed: int):
        self.hub = hub
        self.name = name
        self.upstream = upstream
        self.faults = Faults()
        self.rng = random.Random(seed)
        self.port = 0
        self.connections = 0
        self.resets = 0
        # evidence that a fault acted on traffic (tests/chaos asserts each fault was felt)
        self.delayed = 0  # chunks that crossed while a delay or loss fault was on
        self.held = 0  # chunks and new connections a partition held back
        self._server: asyncio.base_events.Server | None = None
        self._healed = asyncio.Event()
        self._healed.set()
        self._writers: set[asyncio.StreamWriter] = set()

    # -- control (any thread) ---------------------------------------------------------
    def set_faults(self, **kw: object) -> None:
        self.hub.run(self._set(replace(self.faults, **kw)))

    def heal(self) -> None:
        self.hub.run(self._set(Faults()))

    def set_upstream(self, host: str, port: int) -> None:
        """Point at a new upstream; open connections to the old one are cut."""
        self.hub.run(self._repoint((host, port)))

    async def _set(self, faults: Faults) -> None:
        self.faults = faults
        if faults.partition:
            self._healed.clear()
        else:
            self._healed.set()

    async def _repoint(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        for w in list(self._writers):
            w.transport.abort()

    # -- serving (the hub's loop) --------------------------------------------------
    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._accept, host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.transport.abort()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        up_writer = None
        try:
            if not self._healed.is_set():
                self.held += 1
            await self._healed.wait()  # a partition holds new connections too
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            self._writers.add(up_writer)
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))
        except (OSError, asyncio.IncompleteReadError):
            pass  # upstream down or reset: the client sees its connection close
        finally:
            for w in (writer, up_writer):
                if w is not None:
                    self._writers.discard(w)
                    w.transport.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copy one direction with the faults, pipelined: a reader stamps chunks with
        their delivery time, a writer delivers them in order at that time."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    return
                while (wait := due - time.monotonic()) > 0:
                    await asyncio.sleep(wait)  # the emulated link's latency
                if not self._healed.is_set():
                    self.held += 1
                await self._healed.wait()
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(deliver())
        last_due = 0.0
        try:
            while data := await reader.read(65536):
                f = self.faults
                if f.reset and self.rng.random() < f.reset:
                    self.resets += 1
                    raise ConnectionResetError("injected reset")
                if f.delay_s or f.loss:
                    self.delayed += 1
                due = time.monotonic() + f.delay_s
                if f.loss and self.rng.random() < f.loss:
                    due += f.loss_stall_s * (0.5 + self.rng.random())
                last_due = max(last_due, due)  # in order, as TCP delivers
                queue.put_nowait((last_due, data))
            queue.put_nowait((last_due, b""))
            await sender
        finally:
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await sender
            writer.transport.abort()


class ProxyHub:
    """Owns the loop thread and every proxy on it."""

    def __init__(self, seed: int = 0):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="chaos-proxies", daemon=True)
        self._thread.start()
        self.proxies: dict[str, FaultProxy] = {}
        self._seed = seed

    def run(self, coro, timeout: float = 10.0):
        fut: Future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout)

    def add(self, name: str, listen: tuple[str, int], upstream: tuple[str, int]) -> FaultProxy:
        proxy = FaultProxy(self, name, upstream, self._seed + len(self.proxies))
        self.run(proxy.start(*listen))
        self.proxies[name] = proxy
        return proxy

    def remove(self, name: str) -> None:
        proxy = self.proxies.pop(name, None)
        if proxy is not None:
            self.run(proxy.close())

    def set_faults(self, **kw: object) -> None:
        for p in self.proxies.values():
            p.set_faults(**kw)

    def heal(self) -> None:
        for p in self.proxies.values():
            p.heal()

    def close(self) -> None:
        for name in list(self.proxies):
            self.remove(name)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
