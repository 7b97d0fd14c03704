"""The daemon: accepts connections, owns regions, feeds the scheduler, polls the engine.

One asyncio loop (uvloop in production) runs everything but the engine's own work. Requests are
handled in arrival order per connection, without awaiting, except region set-up (pinning takes
milliseconds per GiB, so it runs in a worker thread). Copies flow:

    copy frame -> checks (regions, bounds, limits) -> scheduler.enqueue -> _pump: next_chunks ->
    engine.submit -> _poll: Completion.done() -> scheduler.chunk_done -> reply frame

Nothing a client sends can stop the daemon or touch another client's memory: every request is
checked against the regions its own connection may use, every failure is answered with an
error reply, and a connection that breaks the protocol is closed alone.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import itertools
import os
import socket
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from . import __version__
from .config import Config
from .engines.base import Completion, DeviceMemory, Direction, Engine, HostMemory, LaneKey, Memory, Path
from .engines.sim import sealed_memfd
from .errors import (
    ConnectionClosed,
    InvalidRequest,
    LimitExceeded,
    NotFound,
    PermissionDenied,
    PriodError,
    ProtocolError,
    RequestError,
    ShuttingDown,
)
from .metrics import Metrics
from .protocol import OPS, PROTOCOL_VERSION, Message, error_reply, require
from .scheduler import Chunk, Finished, Request, Scheduler
from .transport import FramedSocket, Peer, peer_credentials

__all__ = ["Daemon", "bind_unix_socket"]

log = structlog.get_logger("priod.server")

_US = 1e6
TIMER_MIN_S = 100e-6
"""Shortest timer sleep: an overdue chunk is not re-polled more often than this."""
PUMP_ROUNDS = 16
"""Submit-and-collect rounds in one `_pump`; the poll loop carries on with any that remain."""


def _causes(exc: BaseException) -> list[str]:
    """What led to ``exc`` (``raise ... from`` or raised while handling), outermost first, so
    a log line names the root cause (an OSError, a msgpack error) and not only our wrapper."""
    out: list[str] = []
    seen = {id(exc)}
    cur = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    while cur is not None and id(cur) not in seen and len(out) < 8:
        seen.add(id(cur))
        out.append(f"{type(cur).__name__}: {cur}")
        cur = cur.__cause__ or (None if cur.__suppress_context__ else cur.__context__)
    return out


def _error_fields(exc: BaseException) -> dict[str, Any]:
    causes = _causes(exc)
    return {"error": str(exc), "causes": causes} if causes else {"error": str(exc)}


_CANCEL_WHY = {
    "cancelled": "copy cancelled",
    "shutting_down": "the daemon is stopping and cancelled this copy; retry once it is back",
    "not_found": "a region this copy names was freed by its owner",
}


def _outcome_reply(f: Finished, client_id: int, cancel_code: str, queued_s: float, transfer_s: float, total_s: float) -> Message:
    """The reply that ends a copy: its timings when done, else why not and how far it got."""
    req = f.request
    if f.outcome == "done":
        return {
            "id": client_id,
            "ok": True,
            "nbytes": req.nbytes,
            "queued_us": round(queued_s * _US, 3),
            "transfer_us": round(transfer_s * _US, 3),
            "total_us": round(total_s * _US, 3),
            "path": req.path.value if req.path else "dma",
            "missed_deadline": f.missed_deadline,
        }
    progress = f"after {f.bytes_done} of {req.nbytes} bytes"
    if f.outcome == "failed":
        return error_reply(client_id, "engine", f"copy failed {progress}: {f.error}", bytes_done=f.bytes_done)
    return error_reply(client_id, cancel_code, f"{_CANCEL_WHY[cancel_code]} {progress}", bytes_done=f.bytes_done)


@dataclass(eq=False)
class Region:
    """Memory registered once and named by copies. Belongs to the connection that made it."""

    id: int
    owner: Connection
    kind: str  # "host" | "device"
    nbytes: int
    mem: Memory
    device: int | None
    shared_uids: set[int] = field(default_factory=set)
    users: set[int] = field(default_factory=set)
    """Scheduler ids of copies naming this region; it is released only once none is left."""
    released: bool = False
    freeing: bool = False


@dataclass(eq=False)
class PendingCopy:
    """The scheduler request's payload: where the bytes go, and who to answer."""

    conn: Connection
    client_id: int
    dst: Region
    dst_offset: int
    src: Region
    src_offset: int
    cancel_code: str = "cancelled"


@dataclass(eq=False, slots=True)
class InFlight:
    """A chunk handed to the engine, and when it should be done: a hint for the poller's sleep."""

    chunk: Chunk
    completion: Completion
    submitted: float
    due: float


def reanchor_dues(waiting: list[InFlight], since: float, bandwidth: float) -> None:
    """Bring forward the due times of one lane's DMA chunks still in flight (in submission
    order) once one of them has been seen complete.

    That chunk was still running at the previous poll (``since``), and a lane's DMA chunks run
    one after another, so the next one started no earlier than ``since`` (or its own
    submission) and each later one as its predecessor ended. Estimating from the previous poll
    rather than from when the completion was noticed keeps each notice's lateness out of the
    next estimate: chained, those delays grow until the lane runs dry between chunks (on the
    H200 that cost 4-5% of bulk bandwidth). Due times only move earlier; the estimate made at
    submission, with every byte ahead counted whole, is the upper bound.
    """
    start = since
    for entry in waiting:
        start = max(start, entry.submitted) + entry.chunk.nbytes / bandwidth
        entry.due = min(entry.due, start)


@dataclass(eq=False)
class Connection:
    id: int
    sock: FramedSocket
    peer: Peer
    regions: dict[int, Region] = field(default_factory=dict)
    pending: dict[int, Request] = field(default_factory=dict)
    queued_bytes: int = 0
    pinned_bytes: int = 0
    device_bytes: int = 0
    greeted: bool = False
    closed: bool = False
    copies: int = 0


class _Timer(threading.Thread):
    """Calls ``wake`` (thread-safe) at a requested time, to within the kernel's timer slack
    (tens of microseconds), where the event loop's own timers are 1 ms coarse."""

    def __init__(self, wake: Callable[[], None]) -> None:
        super().__init__(name="priod-poll-timer", daemon=True)
        self._wake = wake
        self._cv = threading.Condition()
        self._at: float | None = None
        self._stopped = False

    def wake_at(self, at: float) -> None:
        with self._cv:
            if self._at is None or at < self._at:
                self._at = at
                self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()

    def run(self) -> None:
        with self._cv:
            while not self._stopped:
                if self._at is None:
                    self._cv.wait()
                    continue
                delay = self._at - time.perf_counter()
                if delay > 0:
                    self._cv.wait(delay)
                    continue
                self._at = None
                self._wake()


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
        self.cfg = cfg
        self.engine = engine
        self.scheduler = Scheduler(cfg.policy(), engine.lanes())
        self.metrics = Metrics()
        self._listen_sock = listen_sock
        self._owns_socket_path = listen_sock is None
        self._notify = notify or (lambda _msg: None)
        self._conn_ids = itertools.count(1)
        self._region_ids = itertools.count(1)
        self._request_ids = itertools.count(1)
        self.connections: dict[int, Connection] = {}
        self.regions: dict[int, Region] = {}
        self._inflight: list[InFlight] = []
        self._last_poll = 0.0
        self._paced_by_polls = not engine.wakes_on_completion
        """Due times pace the poller only on an engine that is polled (cuda); sim wakes us."""
        self.polls = 0
        """Engine polls so far: what polling costs, shown in status (spin vs timer)."""
        self._bandwidth = {info.key: info.bandwidth for info in engine.lanes()}
        # The per-copy log line runs thousands of times a second: resolve the logger once
        # (not through structlog's lazy proxy on every call) and name lanes once.
        self._copy_log = structlog.get_logger("priod.server").bind()
        self._lane_names = {info.key: str(info.key) for info in engine.lanes()}
        self._lane_keys: dict[tuple[int | None, Direction], LaneKey] = {(info.key.device, info.key.direction): info.key for info in engine.lanes()}
        self.lane_bytes = {info.key: 0 for info in engine.lanes()}
        """Bytes landed per lane, counted per chunk (throughput without per-copy granularity)."""
        self._inflight_bytes: dict[tuple[LaneKey, Path], int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._releases: set[asyncio.Future[None]] = set()
        """Memory being given back on executor threads; stop() waits for it before closing the engine."""
        self._timer: _Timer | None = None
        self._wake: asyncio.Future[None] | None = None
        self._stopped: asyncio.Event | None = None
        self.stopping = False
        self.started_at = time.time()
        self.metrics_port: int | None = None
        self.totals = {"copies": 0, "bytes": 0, "refused": 0, "protocol_errors": 0}

    # -- life cycle ------------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._stopped = asyncio.Event()
        if self._listen_sock is None:
            self._listen_sock = bind_unix_socket(self.cfg.socket_path, self.cfg.server.socket_mode)
        self._listen_sock.setblocking(False)
        pending = threading.Event()

        def wake_from_thread() -> None:
            # Runs on the loop: clear first, then poll, so no completion is missed.
            pending.clear()
            self._wakeup()

        def wake_from_engine_thread() -> None:
            # One wake-up in flight is enough: a burst of completions costs one self-pipe write.
            if not pending.is_set():
                pending.set()
                loop.call_soon_threadsafe(wake_from_thread)

        self.engine.set_wakeup(wake_from_engine_thread)
        if self.cfg.server.bulk_poll == "timer" and self._paced_by_polls:
            self._timer = _Timer(wake_from_engine_thread)
            self._timer.start()
        if self.cfg.metrics.port:
            self.metrics_port = self.metrics.serve(self.cfg.metrics.address, self.cfg.metrics.port)
        self._spawn(self._accept_loop())
        self._spawn(self._poll_loop())
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

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
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
        self.stopping = True
        self._notify("STOPPING=1")
        log.info("daemon_stopping", policy=self.cfg.service.shutdown, pending=sum(len(c.pending) for c in self.connections.values()))
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
        for conn in list(self.connections.values()):
            for req in list(conn.pending.values()):
                self._cancel_request(req, "shutting_down")
        while self._inflight and time.monotonic() < deadline + 30:
            await asyncio.sleep(0.001)
        for conn in list(self.connections.values()):
            await self._flush_and_close(conn, timeout=1.0)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._timer is not None:
            self._timer.stop()
        await asyncio.gather(*list(self._releases), return_exceptions=True)
        self.engine.close()
        log.info("daemon_stopped", copies=self.totals["copies"], bytes=self.totals["bytes"])
        assert self._stopped is not None
        self._stopped.set()

    def reload(self, cfg: Config) -> None:
        """Apply new classes, weights, chunking and limits; connections and requests stay."""
        self._notify("RELOADING=1\nMONOTONIC_USEC=%d" % (time.monotonic_ns() // 1000))
        self.scheduler.set_policy(cfg.policy())
        self.cfg = cfg
        # Series of classes that are gone would otherwise keep their last value forever.
        self.metrics.queue_depth.clear()
        self.refresh_metrics()
        log.info("config_reloaded", source=cfg.source, classes=[c.name for c in cfg.classes], mode=cfg.scheduler.mode)
        self._pump()
        self._notify("READY=1")

    # -- connections -----------------------------------------------------------------------
    async def _accept_loop(self) -> None:
        assert self._listen_sock is not None
        while not self.stopping:
            try:
                sock, _ = await self._loop.sock_accept(self._listen_sock)
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
        cid = next(self._conn_ids)
        structlog.contextvars.bind_contextvars(conn=cid, client_pid=peer.pid, uid=peer.uid)
        fs = FramedSocket(sock, max_frame=self.cfg.server.max_frame_bytes, max_output=self.cfg.server.max_output_bytes)
        conn = Connection(cid, fs, peer)
        refusal = None
        if not self._allowed(peer):
            refusal = error_reply(0, PermissionDenied.code, f"uid {peer.uid} (gid {peer.gid}) may not use this daemon; an administrator can add it to [server] allow_uids or allow_gids")
        elif len(self.connections) >= self.cfg.server.max_clients:
            refusal = error_reply(0, LimitExceeded.code, f"the daemon already serves {len(self.connections)} clients ([server] max_clients); retry later")
        elif self.stopping:
            refusal = error_reply(0, ShuttingDown.code, "the daemon is stopping; retry once it is back")
        if refusal is not None:
            log.warning("connection_refused", reason=refusal["error"]["message"])
            fs.send(refusal)
            await self._close_refused(conn)
            return
        self.connections[cid] = conn
        log.info("client_connected")
        try:
            while True:
                msg, fds = await fs.receive()
                await self._dispatch(conn, msg, fds)
        except ConnectionClosed:
            pass
        except ProtocolError as exc:
            self.totals["protocol_errors"] += 1
            log.warning("protocol_error", **_error_fields(exc))
            if not fs.closed:
                fs.send(error_reply(0, exc.code, f"{exc}; the connection is closed"))
        finally:
            self._drop_connection(conn)
            await self._flush_and_close(conn, timeout=1.0)
            log.info("client_disconnected", copies=conn.copies)

    async def _close_refused(self, conn: Connection) -> None:
        """Close after the client's first frame (its hello) or a short wait: a client whose
        hello is still on its way when we close gets EPIPE on sending it and loses our reason."""
        try:
            await asyncio.wait_for(conn.sock.drain(), 1.0)
            _msg, fds = await asyncio.wait_for(conn.sock.receive(), 2.0)
            for fd in fds:
                os.close(fd)
        except (asyncio.TimeoutError, PriodError):
            pass
        conn.sock.close()

    async def _flush_and_close(self, conn: Connection, timeout: float) -> None:
        try:
            await asyncio.wait_for(conn.sock.drain(), timeout)
        except (asyncio.TimeoutError, PriodError):
            pass
        conn.sock.close()

    def _drop_connection(self, conn: Connection) -> None:
        """Release what the connection held; in-flight chunks finish, nothing else is touched."""
        if conn.closed:
            return
        conn.closed = True
        self.connections.pop(conn.id, None)
        for f in self.scheduler.drop_owner(conn.id, time.perf_counter()):
            self._on_finished(f)
        for region in list(conn.regions.values()):
            self._release_region(region)

    # -- requests --------------------------------------------------------------------------
    async def _dispatch(self, conn: Connection, msg: Message, fds: list[int]) -> None:
        raw_id = msg.get("id")
        req_id = raw_id if type(raw_id) is int and 0 < raw_id < 1 << 63 else 0
        valid_id = req_id != 0
        try:
            if not valid_id:
                raise InvalidRequest("every request needs an integer 'id' between 1 and 2**63-1; see docs/protocol.md")
            op = msg.get("op")
            if not isinstance(op, str) or op not in OPS:
                raise InvalidRequest(f"unknown op {op!r}; known ops: {', '.join(sorted(OPS))}", )
            if op != "hello" and not conn.greeted:
                raise InvalidRequest("send 'hello' with your protocol version before any other request")
            expects_fds = op == "register_host"
            if fds and not expects_fds:
                raise InvalidRequest(f"'{op}' takes no file descriptors, but {len(fds)} came with it; they were closed")
            if op == "copy":
                if self.stopping:
                    raise ShuttingDown("the daemon is stopping and takes no new copies; retry once it is back")
                self._op_copy(conn, req_id, msg)
                return
            handler = getattr(self, f"_op_{op}")
            if expects_fds:
                owned, fds = fds, []  # the handler closes them, whatever happens
                reply = await handler(conn, msg, owned)
            else:
                reply = handler(conn, msg)
                if asyncio.iscoroutine(reply):
                    reply = await reply
            out_fds = reply.pop("_fds", [])
            reply["id"] = req_id
            reply["ok"] = True
            if not conn.closed:
                conn.sock.send(reply, out_fds)
            else:
                for fd in out_fds:
                    os.close(fd)
        except RequestError as exc:
            self._refuse(conn, req_id, exc)
        except ConnectionClosed:
            raise
        except Exception as exc:  # a bug of ours: answer, log, keep serving everyone else
            log.exception("request_failed", op=msg.get("op"))
            self._refuse(conn, req_id, PriodError(f"internal error ({type(exc).__name__}: {exc}); the daemon logged it"))
        finally:
            for fd in fds:
                os.close(fd)

    def _refuse(self, conn: Connection, req_id: int, exc: PriodError) -> None:
        self.totals["refused"] += 1
        self.metrics.refused.labels(exc.code).inc()
        if not conn.closed:
            conn.sock.send(error_reply(req_id, exc.code, str(exc)))

    def _op_hello(self, conn: Connection, msg: Message) -> Message:
        version = require(msg, "v", int)
        if version != PROTOCOL_VERSION:
            raise InvalidRequest(f"protocol version {version} is not supported; this daemon speaks version {PROTOCOL_VERSION}: upgrade the client library")
        conn.greeted = True
        name = require(msg, "client", str, default="")
        if name:
            structlog.contextvars.bind_contextvars(client=name[:64])
        return {
            "v": PROTOCOL_VERSION,
            "server": "priod",
            "version": __version__,
            "backend": self.engine.name,
            "max_frame_bytes": self.cfg.server.max_frame_bytes,
            "classes": [c.name for c in self.cfg.classes],
            "peer": {"pid": conn.peer.pid, "uid": conn.peer.uid, "gid": conn.peer.gid},
        }

    def _op_ping(self, conn: Connection, msg: Message) -> Message:
        return {}

    def _op_status(self, conn: Connection, msg: Message) -> Message:
        return {"status": self.status()}

    # -- regions ---------------------------------------------------------------------------
    def _check_size(self, msg: Message, conn: Connection, kind: str) -> int:
        nbytes: int = require(msg, "nbytes", int)
        lim = self.cfg.limits
        if nbytes < 1:
            raise InvalidRequest(f"nbytes = {nbytes} is invalid; a region holds at least 1 byte")
        if len(conn.regions) >= lim.max_regions:
            raise LimitExceeded(f"this connection holds {len(conn.regions)} regions ([limits] max_regions = {lim.max_regions}); free some first")
        if kind == "host" and conn.pinned_bytes + nbytes > lim.max_pinned_bytes:
            raise LimitExceeded(
                f"{nbytes} more pinned bytes would exceed [limits] max_pinned_bytes = {lim.max_pinned_bytes} "
                f"(this connection holds {conn.pinned_bytes}); free a host region or ask for less"
            )
        if kind == "device" and conn.device_bytes + nbytes > lim.max_device_bytes:
            raise LimitExceeded(
                f"{nbytes} more device bytes would exceed [limits] max_device_bytes = {lim.max_device_bytes} "
                f"(this connection holds {conn.device_bytes}); free a device region or ask for less"
            )
        return nbytes

    def _add_region(self, conn: Connection, kind: str, nbytes: int, mem: Memory, device: int | None) -> Region:
        region = Region(next(self._region_ids), conn, kind, nbytes, mem, device)
        if conn.closed:  # the client left while we were mapping: undo at once
            region.freeing = True
            self._finish_release(region)
            raise ConnectionClosed("client left during region set-up")
        self.regions[region.id] = region
        conn.regions[region.id] = region
        if kind == "host":
            conn.pinned_bytes += nbytes
        else:
            conn.device_bytes += nbytes
        log.debug("region_added", region=region.id, kind=kind, nbytes=nbytes)
        return region

    @staticmethod
    def _region_reply(region: Region) -> Message:
        return {"region": region.id, "nbytes": region.nbytes, "kind": region.kind, "device": region.device}

    async def _op_alloc_host(self, conn: Connection, msg: Message) -> Message:
        nbytes = self._check_size(msg, conn, "host")
        fd = sealed_memfd("priod-host", nbytes)
        try:
            mem = await self._map_host(fd, nbytes)
            region = self._add_region(conn, "host", nbytes, mem, None)
        except BaseException:
            os.close(fd)
            raise
        return {**self._region_reply(region), "_fds": [fd]}

    async def _op_register_host(self, conn: Connection, msg: Message, fds: list[int]) -> Message:
        try:
            if len(fds) != 1:
                raise InvalidRequest(f"'register_host' takes exactly one memfd with the frame, got {len(fds)}")
            nbytes = self._check_size(msg, conn, "host")
            fd = fds[0]
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                raise InvalidRequest("the passed fd is not a memfd; create it with os.memfd_create(name, os.MFD_ALLOW_SEALING)") from None
            if not seals & fcntl.F_SEAL_SHRINK:
                raise InvalidRequest("seal the memfd against shrinking first: fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK); a shrunk region would fault the daemon")
            try:
                mem = await self._map_host(fd, nbytes)
            except ValueError as exc:
                raise InvalidRequest(str(exc)) from exc
            region = self._add_region(conn, "host", nbytes, mem, None)
            return self._region_reply(region)
        finally:
            for fd in fds:
                os.close(fd)

    async def _map_host(self, fd: int, nbytes: int) -> HostMemory:
        started = time.perf_counter()
        # Pinning takes about 0.1 ms per MiB (findings.md section 6): off the loop.
        mem = await self._loop.run_in_executor(None, self.engine.map_host, fd, nbytes)
        log.info("host_region_registered", nbytes=nbytes, register_ms=round((time.perf_counter() - started) * 1e3, 3))
        return mem

    async def _op_alloc_device(self, conn: Connection, msg: Message) -> Message:
        nbytes = self._check_size(msg, conn, "device")
        device = require(msg, "device", int, default=0)
        mem = await self._loop.run_in_executor(None, self.engine.alloc_device, nbytes, device)
        region = self._add_region(conn, "device", nbytes, mem, device)
        reply = self._region_reply(region)
        export = mem.export
        assert export is not None
        if export.fd is not None:
            reply["export"] = {"kind": "memfd", "offset": export.offset}
            reply["_fds"] = [os.dup(export.fd)]
        else:
            reply["export"] = {"kind": "cuda_ipc", "handle": export.ipc_handle, "offset": export.offset}
        return reply

    async def _op_register_device(self, conn: Connection, msg: Message) -> Message:
        nbytes = self._check_size(msg, conn, "device")
        handle = require(msg, "handle", bytes)
        offset = require(msg, "offset", int, default=0)
        device = require(msg, "device", int, default=0)
        if offset < 0:
            raise InvalidRequest(f"offset = {offset} is invalid; it must be >= 0")
        mem = await self._loop.run_in_executor(None, self.engine.import_device, handle, offset, nbytes, device)
        region = self._add_region(conn, "device", nbytes, mem, device)
        return self._region_reply(region)

    def _op_free(self, conn: Connection, msg: Message) -> Message:
        region = self._owned_region(conn, require(msg, "region", int))
        if region.users:
            raise InvalidRequest(f"region {region.id} has {len(region.users)} copies queued or in flight; wait for them or cancel them, then free it")
        self._release_region(region)
        return {}

    def _op_share(self, conn: Connection, msg: Message) -> Message:
        region = self._owned_region(conn, require(msg, "region", int))
        uid = require(msg, "uid", int)
        region.shared_uids.add(uid)
        log.info("region_shared", region=region.id, with_uid=uid)
        return {}

    def _owned_region(self, conn: Connection, region_id: int) -> Region:
        region = self.regions.get(region_id)
        if region is None:
            raise NotFound(f"no region {region_id}; use an id returned by alloc_host, alloc_device or register_*")
        if region.owner is not conn:
            raise PermissionDenied(f"region {region_id} belongs to another connection; only its owner may free or share it")
        return region

    def _usable_region(self, conn: Connection, region_id: int) -> Region:
        region = self.regions.get(region_id)
        if region is None:
            raise NotFound(f"no region {region_id}; use an id returned by alloc_host, alloc_device or register_*")
        if region.owner is not conn and conn.peer.uid not in region.shared_uids:
            raise PermissionDenied(f"region {region_id} belongs to another client and is not shared with uid {conn.peer.uid}")
        return region

    def _release_region(self, region: Region) -> None:
        """Forget the region now; give its memory back once no copy in flight names it."""
        if region.freeing:
            return
        region.freeing = True
        self.regions.pop(region.id, None)
        owner = region.owner
        owner.regions.pop(region.id, None)
        if region.kind == "host":
            owner.pinned_bytes -= region.nbytes
        else:
            owner.device_bytes -= region.nbytes
        for sched_id in list(region.users):
            req = self.scheduler.get(sched_id)
            if req is not None:
                self._cancel_request(req, "not_found")
        if not region.users:
            self._finish_release(region)

    def _finish_release(self, region: Region) -> None:
        """Give the region's memory back, off the event loop: cudaFree and cudaHostUnregister
        wait for work in flight on the device, and the loop must go on serving urgent copies."""
        if region.released:
            return
        region.released = True
        mem = region.mem
        if isinstance(mem, HostMemory):
            fut = self._loop.run_in_executor(None, self.engine.release_host, mem)
        else:
            assert isinstance(mem, DeviceMemory)
            fut = self._loop.run_in_executor(None, self.engine.release_device, mem)
        self._releases.add(fut)
        fut.add_done_callback(functools.partial(self._released, region.id))

    def _released(self, region_id: int, fut: asyncio.Future[None]) -> None:
        self._releases.discard(fut)
        if fut.cancelled():
            return
        if (exc := fut.exception()) is not None:
            log.error("region_release_failed", region=region_id, **_error_fields(exc))
        else:
            log.debug("region_released", region=region_id)

    # -- copies ----------------------------------------------------------------------------
    def _op_copy(self, conn: Connection, req_id: int, msg: Message) -> None:
        now = time.perf_counter()
        if req_id in conn.pending:
            raise InvalidRequest(f"request id {req_id} is already pending on this connection; use a new id per request")
        dst = self._usable_region(conn, require(msg, "dst", int))
        src = self._usable_region(conn, require(msg, "src", int))
        nbytes = require(msg, "nbytes", int)
        dst_offset = require(msg, "dst_offset", int, default=0)
        src_offset = require(msg, "src_offset", int, default=0)
        priority = require(msg, "priority", str, default="normal")
        deadline_ms = require(msg, "deadline_ms", (int, float), default=None) if msg.get("deadline_ms") is not None else None
        if nbytes < 1:
            raise InvalidRequest(f"nbytes = {nbytes} is invalid; copy at least 1 byte")
        for name, region, offset in (("dst", dst, dst_offset), ("src", src, src_offset)):
            if offset < 0 or offset + nbytes > region.nbytes:
                raise InvalidRequest(
                    f"{name}_offset {offset} + nbytes {nbytes} is outside region {region.id} of {region.nbytes} bytes; "
                    "copy within the region's size"
                )
        lane = self._lane_for(dst, src)
        lim = self.cfg.limits
        if len(conn.pending) >= lim.max_queued_requests:
            raise LimitExceeded(f"this connection has {len(conn.pending)} copies pending ([limits] max_queued_requests = {lim.max_queued_requests}); wait for replies before sending more")
        if conn.queued_bytes + nbytes > lim.max_queued_bytes:
            raise LimitExceeded(f"{nbytes} more bytes would exceed [limits] max_queued_bytes = {lim.max_queued_bytes} pending on this connection; wait for replies before sending more")
        payload = PendingCopy(conn, req_id, dst, dst_offset, src, src_offset)
        deadline = now + deadline_ms / 1e3 if deadline_ms is not None else None
        req = Request(next(self._request_ids), conn.id, lane, priority, nbytes, now, deadline, payload)
        self.scheduler.enqueue(req, now)  # raises InvalidRequest for an unknown class
        conn.pending[req_id] = req
        conn.queued_bytes += nbytes
        dst.users.add(req.id)
        src.users.add(req.id)
        self._pump()

    def _lane_for(self, dst: Region, src: Region) -> LaneKey:
        if src.kind == "host" and dst.kind == "device":
            device, direction = dst.device, Direction.H2D
        elif src.kind == "device" and dst.kind == "host":
            device, direction = src.device, Direction.D2H
        elif src.kind == "device" and dst.kind == "device":
            if src.device != dst.device:
                raise InvalidRequest(f"device-to-device copies must stay on one GPU (src on {src.device}, dst on {dst.device}); copy through a host region")
            device, direction = src.device, Direction.D2D
        else:
            raise InvalidRequest("both regions are host memory; copy between them with memcpy in your own process")
        # The engine's own key objects: every dict lookup on the per-chunk path then matches
        # by identity instead of comparing dataclasses field by field.
        lane = self._lane_keys.get((device, direction))
        if lane is None:
            raise InvalidRequest(f"no lane {direction.value} on device {device}; this daemon serves {sorted(map(str, self._lane_keys.values()))}")
        return lane

    def _op_cancel(self, conn: Connection, msg: Message) -> Message:
        target = require(msg, "target", int)
        req = conn.pending.get(target)
        if req is None:
            raise NotFound(f"no copy with id {target} is pending on this connection; it may have finished already")
        finished = self._cancel_request(req, "cancelled")
        return {"target": target, "state": "cancelled" if finished else "stopping"}

    def _cancel_request(self, req: Request, code: str) -> bool:
        """Cancel at the next chunk boundary; True if it ended at once (nothing in flight)."""
        payload = req.payload
        assert isinstance(payload, PendingCopy)
        payload.cancel_code = code
        try:
            f = self.scheduler.cancel(req.id, time.perf_counter())
        except NotFound:
            return False  # already cancelled, its last chunk is still in flight
        if f is not None:
            self._on_finished(f)
            return True
        return False

    # -- the engine side -------------------------------------------------------------------
    def _pump(self) -> None:
        """Hand every chunk the scheduler releases to the engine.

        Chunks an engine finished at once (a tiny copy on an idle sim lane) are collected here
        and their room refilled, rather than a loop turn later: that turn is most of a small
        copy's round trip.
        """
        for _ in range(PUMP_ROUNDS):
            if not (self._submit(self.scheduler.next_chunks(time.perf_counter())) and self._poll()):
                break
        else:
            # Bounded, so other connections get the loop between rounds; carry on next turn.
            self._loop.call_soon(self._pump)
        self._wakeup()

    def _submit(self, chunks: list[Chunk]) -> bool:
        """Submit ``chunks`` to the engine; True if any was submitted."""
        for chunk in chunks:
            p = chunk.request.payload
            assert isinstance(p, PendingCopy)
            try:
                completion = self.engine.submit(
                    chunk.request.lane,
                    chunk.path,
                    p.dst.mem,
                    p.dst_offset + chunk.offset,
                    p.src.mem,
                    p.src_offset + chunk.offset,
                    chunk.nbytes,
                    strict=chunk.strict,
                )
            except PriodError as exc:
                log.error("submit_failed", **_error_fields(exc))
                for f in self.scheduler.chunk_done(chunk, time.perf_counter(), exc):
                    self._on_finished(f)
                continue
            key = (chunk.request.lane, chunk.path)
            self._inflight_bytes[key] = self._inflight_bytes.get(key, 0) + chunk.nbytes
            now = time.perf_counter()
            self._inflight.append(InFlight(chunk, completion, now, now + self._time_to_done(chunk)))
        return bool(chunks)

    def _time_to_done(self, chunk: Chunk) -> float:
        """At most how long the chunk just submitted should take at the calibrated bandwidth.

        DMA chunks of a lane run one after another, so it is done once every DMA byte in flight
        on its lane (its own included) has moved; `reanchor_dues` refines this as the chunks
        ahead complete. The poller sleeps until the earliest due time (a hint, not a promise).
        """
        lane = chunk.request.lane
        nbytes = chunk.nbytes if chunk.path is Path.EXPRESS else self._inflight_bytes.get((lane, Path.DMA), 0)
        return nbytes / self._bandwidth.get(lane, 1e9)

    def _wakeup(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def _poll(self) -> bool:
        """Query every chunk in flight once; True if any completed."""
        since, self._last_poll = self._last_poll, time.perf_counter()
        self.polls += 1
        still: list[InFlight] = []
        reanchor: set[LaneKey] = set()
        completed = False
        for entry in self._inflight:
            chunk, completion = entry.chunk, entry.completion
            error: Exception | None = None
            try:
                if not completion.done():
                    still.append(entry)
                    continue
            except PriodError as exc:
                error = exc
            completion.release()
            completed = True
            key = (chunk.request.lane, chunk.path)
            self._inflight_bytes[key] -= chunk.nbytes
            if self._paced_by_polls and chunk.path is Path.DMA:
                reanchor.add(chunk.request.lane)
            if error is None:
                self.lane_bytes[chunk.request.lane] += chunk.nbytes
            for f in self.scheduler.chunk_done(chunk, time.perf_counter(), error):
                self._on_finished(f)
        self._inflight = still
        for lane in reanchor:
            waiting = [e for e in still if e.chunk.path is Path.DMA and e.chunk.request.lane == lane]
            reanchor_dues(waiting, since, self._bandwidth.get(lane, 1e9))
        return completed

    async def _poll_loop(self) -> None:
        """Find completions by polling; never block the loop, and sleep when polling is useless.

        - Nothing in flight: sleep until a submission wakes us (no CPU when idle).
        - The engine wakes us on completions (sim): sleep until then, polling as a safety net.
        - A strict-class chunk in flight: poll every loop turn (an urgent copy is waiting).
        - Otherwise, with the earliest chunk due in 2 ms or more: sleep until 1 ms before it
          (uvloop's timers are about 1 ms coarse). Due sooner: ``[server] bulk_poll`` decides:
          "timer" sleeps on a timer thread until the chunk is due (sub-millisecond; on the H200
          0.2 CPU s/s while bulk moves), "spin" polls every loop turn (about one core).
        """
        loop = asyncio.get_running_loop()
        engine_wakes = not self._paced_by_polls
        while True:
            if self._inflight and self._poll():
                self._pump()
                continue
            timeout: float | None = None  # None: no CPU at all until something wakes us
            if self._inflight and engine_wakes:
                timeout = 0.05  # the wakeup is a hint; polling stays the source of truth
            elif self._inflight:
                wait = min(e.due for e in self._inflight) - time.perf_counter()
                if self.scheduler.strict_in_flight or (wait < 0.002 and self._timer is None):
                    await asyncio.sleep(0)  # one loop turn: other connections are served between polls
                    continue
                if wait >= 0.002:
                    timeout = wait - 0.001
                else:
                    assert self._timer is not None
                    self._timer.wake_at(time.perf_counter() + max(wait, TIMER_MIN_S))
            self._wake = loop.create_future()
            handle = loop.call_later(timeout, self._wakeup) if timeout is not None else None
            try:
                await self._wake
            finally:
                self._wake = None
                if handle is not None:
                    handle.cancel()

    def _on_finished(self, f: Finished) -> None:
        req = f.request
        p = req.payload
        assert isinstance(p, PendingCopy)
        conn = p.conn
        if conn.pending.get(p.client_id) is req:
            del conn.pending[p.client_id]
            conn.queued_bytes -= req.nbytes
        for region in (p.dst, p.src):
            region.users.discard(req.id)
            if region.freeing and not region.users:
                self._finish_release(region)
        end = req.last_done if req.last_done is not None else time.perf_counter()
        first = req.first_submit if req.first_submit is not None else end
        queued_s, total_s = first - req.arrival, end - req.arrival
        outcome = f.outcome if f.outcome != "cancelled" else p.cancel_code
        direction = req.lane.direction.value
        if f.outcome == "done":
            conn.copies += 1
            self.totals["copies"] += 1
            self.totals["bytes"] += req.nbytes
        # The reply goes first: the client waits for it, while the metrics and the log line
        # below wait for no one (they cost tens of microseconds, most of a small copy's time).
        if not conn.closed:
            conn.sock.send(_outcome_reply(f, p.client_id, p.cancel_code, queued_s, end - first, total_s))
        self.metrics.copy_finished(
            req.cls, outcome, direction, f.bytes_done, queued_s, total_s, req.path is Path.EXPRESS, f.missed_deadline
        )
        self._copy_log.info(
            "copy",
            id=p.client_id,
            conn=conn.id,
            client_pid=conn.peer.pid,
            uid=conn.peer.uid,
            priority=req.cls,
            lane=self._lane_names[req.lane],
            path=req.path.value if req.path else None,
            nbytes=req.nbytes,
            bytes_done=f.bytes_done,
            outcome=outcome,
            queued_us=round(queued_s * _US, 1),
            total_us=round(total_s * _US, 1),
            **(_error_fields(f.error) if f.error else {}),
        )

    # -- status and metrics ----------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        st = self.scheduler.statistics()
        inflight = {f"{lane}/{path.value}": n for (lane, path), n in sorted(self._inflight_bytes.items()) if n}
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
                }
                for ls in st.lanes
            ],
            "inflight_chunks": len(self._inflight),
            "polls": self.polls,
            "lane_bytes": {str(lane): n for lane, n in sorted(self.lane_bytes.items())},
            "inflight_bytes": inflight,
            "deadline_misses": st.deadline_misses,
            "finished": st.finished,
            "totals": dict(self.totals),
            "clients": [
                {
                    "conn": c.id,
                    "pid": c.peer.pid,
                    "uid": c.peer.uid,
                    "regions": len(c.regions),
                    "pinned_bytes": c.pinned_bytes,
                    "device_bytes": c.device_bytes,
                    "pending": len(c.pending),
                    "queued_bytes": c.queued_bytes,
                    "copies": c.copies,
                    "output_buffered": c.sock.output_buffered,
                }
                for c in self.connections.values()
            ],
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
        m.clients.set(len(self.connections))
        m.pinned.set(sum(c.pinned_bytes for c in self.connections.values()))
