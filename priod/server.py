"""The daemon: wires the pipeline together, starts it, stops it, reloads it, reports on it.

    socket -> Session (session.py) -> messages -> Scheduler (scheduler.py) -> Pump (pump.py)
        -> Engine (engines/) -> Pump -> Session -> reply

One asyncio loop (uvloop in production) runs everything but the engine's own work. This class
accepts connections (checking who may connect), holds the parts every session shares, and
answers `status()`; the work of a request happens in the session, the region table and the pump.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import socket
import stat
import time
from collections.abc import Callable, Coroutine
from typing import Any

import structlog

from . import __version__
from .config import Config
from .engines.base import Engine
from .errors import LimitExceeded, PermissionDenied, PriodError, ShuttingDown
from .messages import ErrorReply
from .metrics import Metrics
from .pump import Pump
from .regions import RegionTable
from .scheduler import Scheduler
from .session import Session, Shared, cancel_copy, copy_finished
from .transport import FramedSocket, Peer, peer_credentials

__all__ = ["Daemon", "bind_unix_socket"]

log = structlog.get_logger("priod.server")


def bind_unix_socket(path: str, mode: int) -> socket.socket:
    """Bind and listen on ``path``, replacing a stale socket file but never a live daemon's."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    if os.path.exists(path):
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise PriodError(f"{path} exists and is not a socket; remove it or choose another path with --socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # nobody listens: a leftover from a daemon that died
        else:
            raise PriodError(f"another daemon is already listening on {path}; stop it or choose another path with --socket")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, mode)
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


class Daemon:
    """The whole daemon, wired from a `Config` and an `Engine`."""

    def __init__(
        self,
        cfg: Config,
        engine: Engine,
        *,
        listen_sock: socket.socket | None = None,
        notify: Callable[[str], object] | None = None,
    ) -> None:
        self.engine = engine
        self.scheduler = Scheduler(cfg.policy(), engine.lanes())
        self.metrics = Metrics()
        self.pump = Pump(self.scheduler, engine, copy_finished, bulk_poll=cfg.server.bulk_poll)
        self.regions = RegionTable(engine, cfg.limits, self._cancel_for_freed_region)
        self.shared = Shared(cfg, engine, self.scheduler, self.pump, self.regions, self.metrics, self.status)
        self._listen_sock = listen_sock
        self._owns_socket_path = listen_sock is None
        self._notify = notify or (lambda _msg: None)
        self._session_ids = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopped: asyncio.Event | None = None
        self.started_at = time.time()
        self.metrics_port: int | None = None

    @property
    def cfg(self) -> Config:
        return self.shared.cfg

    @property
    def stopping(self) -> bool:
        return self.shared.stopping

    @property
    def sessions(self) -> dict[int, Session]:
        return self.shared.sessions

    @property
    def totals(self) -> dict[str, int]:
        return self.shared.totals

    def _cancel_for_freed_region(self, request_id: int) -> None:
        req = self.scheduler.get(request_id)
        if req is not None:
            cancel_copy(self.pump, req, "not_found")

    # -- life cycle ------------------------------------------------------------------------
    async def start(self) -> None:
        self._stopped = asyncio.Event()
        if self._listen_sock is None:
            self._listen_sock = bind_unix_socket(self.cfg.socket_path, self.cfg.server.socket_mode)
        self._listen_sock.setblocking(False)
        self.pump.start()
        if self.cfg.metrics.port:
            self.metrics_port = self.metrics.serve(self.cfg.metrics.address, self.cfg.metrics.port)
        self._spawn(self._accept_loop())
        self._spawn(self.pump.run())
        self._spawn(self._refresh_metrics_loop())
        lanes = self.scheduler.statistics().lanes
        log.info(
            "daemon_started",
            version=__version__,
            socket=self.cfg.socket_path,
            backend=self.engine.name,
            mode=self.cfg.scheduler.mode,
            lanes={ls.lane: {"gbps": round(ls.bandwidth / 1e9, 2), "chunk_bytes": ls.chunk_bytes, "inflight_bytes": ls.inflight_bound} for ls in lanes},
            metrics_port=self.metrics_port,
        )

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(self._on_task_done)

    def _on_task_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("task_failed", exc_info=task.exception())

    async def wait_stopped(self) -> None:
        assert self._stopped is not None
        await self._stopped.wait()

    async def stop(self) -> None:
        """Stop accepting, finish or cancel queued work ([service] shutdown), release everything.

        Every pending request gets a reply; the whole stop takes at most
        ``shutdown_timeout_s`` plus the in-flight chunks' own time.
        """
        if self.stopping:
            await self.wait_stopped()
            return
        self.shared.stopping = True
        self._notify("STOPPING=1")
        log.info("daemon_stopping", policy=self.cfg.service.shutdown, pending=sum(len(s.pending) for s in self.sessions.values()))
        if self._listen_sock is not None:
            self._listen_sock.close()
            if self._owns_socket_path:
                try:
                    os.unlink(self.cfg.socket_path)
                except FileNotFoundError:
                    pass
        deadline = time.monotonic() + self.cfg.service.shutdown_timeout_s
        if self.cfg.service.shutdown == "finish":
            while not self.scheduler.idle and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        for session in list(self.sessions.values()):
            session.cancel_all("shutting_down")
        await self.pump.settle(deadline + 30)
        for session in list(self.sessions.values()):
            await session.flush_and_close(timeout=1.0)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.pump.stop()
        await self.regions.wait_released()
        self.engine.close()
        log.info("daemon_stopped", copies=self.totals["copies"], bytes=self.totals["bytes"])
        assert self._stopped is not None
        self._stopped.set()

    def reload(self, cfg: Config) -> None:
        """Apply new classes, weights, chunking and limits; connections and requests stay."""
        self._notify(f"RELOADING=1\nMONOTONIC_USEC={time.monotonic_ns() // 1000}")
        self.scheduler.set_policy(cfg.policy())
        self.shared.cfg = cfg
        self.regions.limits = cfg.limits
        # Series of classes that are gone would otherwise keep their last value forever.
        self.metrics.queue_depth.clear()
        self.refresh_metrics()
        log.info("config_reloaded", source=cfg.source, classes=[c.name for c in cfg.classes], mode=cfg.scheduler.mode)
        self.pump.kick()
        self._notify("READY=1")

    # -- connections -----------------------------------------------------------------------
    async def _accept_loop(self) -> None:
        assert self._listen_sock is not None
        loop = asyncio.get_running_loop()
        while not self.stopping:
            try:
                sock, _ = await loop.sock_accept(self._listen_sock)
            except OSError as exc:
                if self.stopping:
                    return
                log.warning("accept_failed", error=str(exc))
                await asyncio.sleep(0.05)  # EMFILE and friends: back off instead of spinning
                continue
            self._spawn(self._serve_connection(sock))

    def _allowed(self, peer: Peer) -> bool:
        s = self.cfg.server
        if not s.allow_uids and not s.allow_gids:
            return True  # the socket's mode and group are the only gate
        return peer.uid == 0 or peer.uid in s.allow_uids or peer.gid in s.allow_gids

    async def _serve_connection(self, sock: socket.socket) -> None:
        structlog.contextvars.clear_contextvars()
        peer = peer_credentials(sock)
        sid = next(self._session_ids)
        structlog.contextvars.bind_contextvars(conn=sid, client_pid=peer.pid, uid=peer.uid)
        fs = FramedSocket(sock, max_frame=self.cfg.server.max_frame_bytes, max_output=self.cfg.server.max_output_bytes)
        refusal: PriodError | None = None
        if not self._allowed(peer):
            refusal = PermissionDenied(f"uid {peer.uid} (gid {peer.gid}) may not use this daemon; an administrator can add it to [server] allow_uids or allow_gids")
        elif len(self.sessions) >= self.cfg.server.max_clients:
            refusal = LimitExceeded(f"the daemon already serves {len(self.sessions)} clients ([server] max_clients); retry later")
        elif self.stopping:
            refusal = ShuttingDown("the daemon is stopping; retry once it is back")
        if refusal is not None:
            log.warning("connection_refused", reason=str(refusal))
            fs.send(ErrorReply.of(refusal).encode(0))
            await _close_refused(fs)
            return
        session = Session(sid, fs, peer, self.shared)
        self.sessions[sid] = session
        log.info("client_connected")
        await session.serve()

    # -- status and metrics ----------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        st = self.scheduler.statistics()
        inflight: dict[str, int] = {}
        for ls in st.lanes:
            for path, n in (("dma", ls.inflight_bytes + ls.strict_inflight_bytes), ("express", ls.express_inflight_bytes)):
                if n:
                    inflight[f"{ls.lane}/{path}"] = n
        return {
            "version": __version__,
            "backend": self.engine.name,
            "socket": self.cfg.socket_path,
            "uptime_s": round(time.time() - self.started_at, 3),
            "mode": st.mode,
            "stopping": self.stopping,
            "max_block_us": self.cfg.scheduler.max_block_us,
            "classes": [{"name": c.name, "weight": c.weight, "strict": c.strict} for c in st.classes],
            "lanes": [
                {
                    "lane": ls.lane,
                    "bandwidth_gbps": round(ls.bandwidth / 1e9, 3),
                    "chunk_bytes": ls.chunk_bytes,
                    "inflight_bound": ls.inflight_bound,
                    "express_range": [ls.express_min, ls.express_max],
                    "queued_requests": ls.queued_requests,
                    "queued_bytes": ls.queued_bytes,
                    "inflight_bytes": ls.inflight_bytes,
                    "strict_inflight_bytes": ls.strict_inflight_bytes,
                    "express_inflight_bytes": ls.express_inflight_bytes,
                    "urgent_chunk_bytes": ls.urgent_chunk_bytes,
                    "urgent_inflight_bound": ls.urgent_inflight_bound,
                }
                for ls in st.lanes
            ],
            "urgent_paths": [dataclasses.asdict(e) for e in self.scheduler.path_estimates()],
            "inflight_chunks": self.pump.inflight_chunks,
            "polls": self.pump.polls,
            "lane_bytes": {str(lane): n for lane, n in sorted(self.pump.lane_bytes.items())},
            "inflight_bytes": inflight,
            "deadline_misses": st.deadline_misses,
            "finished": st.finished,
            "totals": dict(self.totals),
            "clients": [s.figures() for s in self.sessions.values()],
            "engine": self.engine.statistics(),
        }

    async def _refresh_metrics_loop(self) -> None:
        while True:
            self.refresh_metrics()
            await asyncio.sleep(1.0)

    def refresh_metrics(self) -> None:
        m = self.metrics
        st = self.scheduler.statistics()
        for ls in st.lanes:
            for cls, n in ls.queued_requests.items():
                m.queue_depth.labels(ls.lane, cls).set(n)
            m.inflight.labels(ls.lane, "dma").set(ls.inflight_bytes + ls.strict_inflight_bytes)
            m.inflight.labels(ls.lane, "express").set(ls.express_inflight_bytes)
        busy = self.engine.statistics().get("busy_fraction")
        if isinstance(busy, dict):
            for lane, frac in busy.items():
                m.busy.labels(lane).set(float(frac))
        for e in self.scheduler.path_estimates():
            for path, us in (("express", e.express_us), ("dma", e.dma_us)):
                if us is not None:
                    m.urgent_path_latency.labels(e.lane, path, str(e.size_bytes)).set(us / 1e6)
        m.clients.set(len(self.sessions))
        m.pinned.set(sum(s.holdings.pinned_bytes for s in self.sessions.values()))


async def _close_refused(sock: FramedSocket) -> None:
    """Close after the client's first frame (its hello) or a short wait: a client whose
    hello is still on its way when we close gets EPIPE on sending it and loses our reason."""
    try:
        await asyncio.wait_for(sock.drain(), 1.0)
        _msg, fds = await asyncio.wait_for(sock.receive(), 2.0)
        for fd in fds:
            os.close(fd)
    except (TimeoutError, PriodError):
        pass
    sock.close()
