"""The daemon: wires the pipeline together, starts it, stops it, reloads it, reports on it.

    socket -> Session (session.py) -> messages -> Scheduler (scheduler.py) -> Pump (pump.py)
        -> Engine (engines/) -> Pump -> Session -> reply

One asyncio loop (uvloop in production) runs everything but the engine's own work. This class
accepts connections (checking who may connect), holds the parts every session shares, and
answers `status()`; the work of a request happens in the session, the region table and the pump.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import resource
import socket
import stat
import time
from collections.abc import Callable, Coroutine
from typing import Any

import structlog

from priod._version import __version__
from priod.daemon.admission import PRIVILEGED_RESERVE, Admission
from priod.daemon.config import Config
from priod.daemon.copies import cancel_copy, copy_finished, signal_recorded
from priod.daemon.engines.base import Engine
from priod.daemon.metrics import Metrics
from priod.daemon.pump import Pump
from priod.daemon.rate import LoopShare
from priod.daemon.regions import RegionTable
from priod.daemon.report import refresh_metrics, status
from priod.daemon.rings import RING_FDS
from priod.daemon.sched.scheduler import Scheduler
from priod.daemon.session import Session, Shared
from priod.errors import PriodError
from priod.wire.replies import ErrorReply
from priod.wire.transport import FramedSocket, Peer, close_received, peer_credentials

__all__ = ["Daemon", "bind_unix_socket", "make_engine"]

log = structlog.get_logger("priod.daemon.server")

REFUSING_MAX = 32
"""Refused connections kept open at once to tell their client why (up to 3 s each); past this a
refusal is written and the connection closed at once, so a connect flood cannot use up fds."""
FD_SPARE = 64
"""Open files the daemon needs besides connections and regions (listening socket, epoll, logs,
engine, metrics)."""


LISTEN_BACKLOG = 1024
"""Connections the kernel holds for accept() (capped by socket.SOMAXCONN and net.core.somaxconn).
While it is full a client's connect fails with EAGAIN; 128 was filled by a burst of 300 short
connections."""


def make_engine(cfg: Config, log: Any = None) -> Engine:
    """The engine ``[server] backend`` asks for; ``auto`` takes cuda where a GPU is found."""
    from priod.daemon.engines.sim import SimEngine

    backend = cfg.server.backend
    reason = f"[server] backend = {backend!r}"
    if backend == "auto":
        try:
            from priod.common.cuda.driver import gpu_available
        except ImportError as exc:  # pragma: no cover - the module guards its own imports
            available, reason = False, f"auto: cuda engine unavailable ({exc})"
        else:
            available = gpu_available()
            reason = (
                "auto: a GPU was found"
                if available
                else "auto: no usable GPU (or cuda-bindings missing), using the simulated engine"
            )
        backend = "cuda" if available else "sim"
    if log is not None:
        log.info("engine_selected", backend=backend, reason=reason)
    if backend == "sim":
        return SimEngine(cfg.sim)
    from priod.daemon.engines.cuda.engine import CudaEngine

    return CudaEngine(
        devices=list(cfg.cuda.devices) or None,
        express=cfg.scheduler.express,
        calibrate_bytes=cfg.cuda.calibrate_bytes,
        log=log,
    )


def bind_unix_socket(path: str, mode: int) -> socket.socket:
    """Bind and listen on ``path``, replacing a stale socket file but never a live daemon's.

    Nothing at ``path`` is followed: a symbolic link there (dangling or not) is refused, as is
    anything but a socket; a socket is replaced only if nobody listens on it. Every refusal is
    a `PriodError` that says what to do.
    """
    directory = os.path.dirname(path) or "."
    try:
        os.makedirs(directory, exist_ok=True)
        st: os.stat_result | None = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise PriodError(
            f"cannot use the socket path {path}: {exc.strerror}; choose another path with --socket"
        ) from exc
    if st is not None:
        if stat.S_ISLNK(st.st_mode):
            raise PriodError(
                f"{path} is a symbolic link; priod does not follow links at its socket path (it would bind or remove "
                "whatever the link names): remove the link or choose another path with --socket"
            )
        if not stat.S_ISSOCK(st.st_mode):
            raise PriodError(f"{path} exists and is not a socket; remove it or choose another path with --socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.setblocking(False)  # a live daemon with a full backlog answers EAGAIN instead of blocking us
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            try:
                os.unlink(path)  # nobody listens: a leftover from a daemon that died
            except FileNotFoundError:
                pass
        except BlockingIOError:
            raise PriodError(
                f"another daemon is already listening on {path} (its backlog is full); stop it or choose another path with --socket"
            ) from None
        except OSError as exc:
            raise PriodError(
                f"cannot tell whether a daemon listens on {path} ({exc.strerror}); remove the file or choose another path with --socket"
            ) from exc
        else:
            raise PriodError(
                f"another daemon is already listening on {path}; stop it or choose another path with --socket"
            )
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        _chmod_no_follow(path, mode)
        sock.listen(min(LISTEN_BACKLOG, socket.SOMAXCONN))
    except OSError as exc:
        sock.close()
        raise PriodError(f"cannot listen on {path}: {exc.strerror or exc}; choose another path with --socket") from exc
    except BaseException:
        sock.close()
        raise
    return sock


def _chmod_no_follow(path: str, mode: int) -> None:
    try:
        os.chmod(path, mode, follow_symlinks=False)
    except NotImplementedError:  # no fchmodat(AT_SYMLINK_NOFOLLOW) here (or ``path`` became a link)
        if stat.S_ISLNK(os.lstat(path).st_mode):
            raise PriodError(
                f"{path} was replaced by a symbolic link while priod bound it; remove the link and start again"
            ) from None
        os.chmod(path, mode)


def _unlink_socket(path: str) -> None:
    """Remove the socket file at ``path`` if it still is one (never a link or a file put there since)."""
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass


STOP_FLUSH_S = 2.0
"""At stop, how long the last replies may take to reach all clients together (at most
``[service] shutdown_timeout_s``); a client that does not read loses its replies after that."""


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
        self.scheduler = Scheduler(cfg.policy(), engine.lanes(), host_bandwidth=engine.host_bandwidth())
        self.metrics = Metrics(engine.device_uuids())
        self.pump = Pump(
            self.scheduler,
            engine,
            copy_finished,
            bulk_poll=cfg.server.bulk_poll,
            urgent_poll=cfg.server.urgent_poll,
            on_signalled=signal_recorded,
        )
        self.pump.gates.configure(cfg.limits.max_event_wait_s)
        self.own_uid = os.geteuid()
        """With uid 0, the uid that sees every client in `status` and may use PRIVILEGED_RESERVE."""
        _raise_open_files_limit()
        self.regions = RegionTable(engine, cfg.limits, self._cancel_for_freed_region, self._fd_reserve)
        self.shared = Shared(cfg, engine, self.scheduler, self.pump, self.regions, self.metrics, self.status)
        self.admission = Admission(self.shared, self.own_uid)
        self._refusing = 0
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
    def loop_share(self) -> LoopShare:
        return self.shared.loop

    @property
    def totals(self) -> dict[str, int]:
        return self.shared.totals

    def status(self, viewer: Peer | None = None) -> dict[str, Any]:
        """The daemon's state for `priod status` (report.py); ``viewer``: who asks."""
        return status(self, viewer)

    def refresh_metrics(self) -> None:
        refresh_metrics(self)

    def _fd_reserve(self) -> int:
        """Open files kept back from regions: each connection's socket, an fd it passes, its hold
        page (its memfd and the mapping's) and its copy ring, the refusals under way, and the
        daemon's own."""
        per_connection = 4 + RING_FDS
        return per_connection * (self.cfg.server.max_clients + PRIVILEGED_RESERVE) + REFUSING_MAX + FD_SPARE

    def _cancel_for_freed_region(self, request_id: int) -> None:
        req = self.scheduler.get(request_id) or self.pump.gates.get(request_id)  # queued, or held for its event
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
            self.metrics_port = self.metrics.serve(
                self.cfg.metrics.address, self.cfg.metrics.port, asyncio.get_running_loop(), self.refresh_metrics
            )
        self._spawn(self._accept_loop())
        self._spawn(self.admission.expire_loop())
        self._spawn(self.pump.run())
        lanes = self.scheduler.statistics().lanes
        log.info(
            "daemon_started",
            version=__version__,
            socket=self.cfg.socket_path,
            backend=self.engine.name,
            mode=self.cfg.scheduler.mode,
            lanes={
                ls.lane: {
                    "gbps": round(ls.bandwidth / 1e9, 2),
                    "chunk_bytes": ls.chunk_bytes,
                    "inflight_bytes": ls.inflight_bound,
                }
                for ls in lanes
            },
            gpus={f"gpu{i}": u for i, u in sorted(self.engine.device_uuids().items())},
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
        ``shutdown_timeout_s`` plus the in-flight chunks' own time, plus at most
        ``STOP_FLUSH_S`` for the last replies of all clients together (flushed at once, so
        clients that do not read cost that once, not once each).
        """
        if self.stopping:
            await self.wait_stopped()
            return
        self.shared.stopping = True
        self._notify("STOPPING=1")
        log.info(
            "daemon_stopping",
            policy=self.cfg.service.shutdown,
            pending=sum(len(s.pending) for s in self.sessions.values()),
        )
        if self._listen_sock is not None:
            # The path this daemon bound and serves, whatever a reload asked for since.
            bound = self._listen_sock.getsockname() if self._owns_socket_path else None
            self._listen_sock.close()
            if self._owns_socket_path:
                _unlink_socket(bound if isinstance(bound, str) and bound else self.cfg.socket_path)
        deadline = time.monotonic() + self.cfg.service.shutdown_timeout_s
        if self.cfg.service.shutdown == "finish":
            while not self.scheduler.idle and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        for session in list(self.sessions.values()):
            session.cancel_all("shutting_down")
        await self.pump.settle(deadline + 30)
        flush_s = min(STOP_FLUSH_S, self.cfg.service.shutdown_timeout_s)
        flushed = await asyncio.gather(
            *(s.flush_and_close(timeout=flush_s) for s in list(self.sessions.values())), return_exceptions=True
        )
        for exc in flushed:
            if isinstance(exc, BaseException):
                log.error("flush_failed", exc_info=exc)
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
        """Apply new classes, weights, chunking and limits; connections and requests stay.

        The socket path is not reloaded: the daemon keeps serving (and at stop removes) the one
        it bound; a new ``[server] socket`` takes a restart.
        """
        self._notify(f"RELOADING=1\nMONOTONIC_USEC={time.monotonic_ns() // 1000}")
        if cfg.socket_path != self.cfg.socket_path:
            log.warning(
                "socket_path_change_needs_restart",
                serving=self.cfg.socket_path,
                configured=cfg.socket_path,
                hint="the daemon keeps serving its socket; restart it to move to the new path",
            )
            cfg = cfg.replace(server={"socket": self.cfg.socket_path})
        self.scheduler.set_policy(cfg.policy())
        for req in self.pump.gates.requests():  # held for an event: their class moves as queued ones' do
            req.cls = self.scheduler.class_after_reload(req.cls)
        self.pump.configure_holds()
        self.shared.cfg = cfg
        self.regions.limits = cfg.limits
        self.pump.gates.configure(cfg.limits.max_event_wait_s)
        for session in list(self.shared.sessions.values()):
            session.limits_changed()
        # Series of classes that are gone would otherwise keep their last value forever.
        self.metrics.forget_classes()
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

    async def _serve_connection(self, sock: socket.socket) -> None:
        structlog.contextvars.clear_contextvars()
        peer = peer_credentials(sock)
        sid = next(self._session_ids)
        structlog.contextvars.bind_contextvars(conn=sid, client_pid=peer.pid, uid=peer.uid)
        fs = FramedSocket(sock, max_frame=self.cfg.server.max_frame_bytes, max_output=self.cfg.server.max_output_bytes)
        refusal = self.admission.refusal(peer)
        if refusal is not None:
            log.warning("connection_refused", reason=str(refusal))
            fs.send(ErrorReply.of(refusal).encode(0))
            if self._refusing >= REFUSING_MAX:
                fs.close()  # a flood of refused connects: no time to wait for each one's hello
                return
            self._refusing += 1
            try:
                await _close_refused(fs)
            finally:
                self._refusing -= 1
            return
        session = Session(sid, fs, peer, self.shared)
        self.sessions[sid] = session
        log.info("client_connected")
        await session.serve()


def _raise_open_files_limit() -> None:
    """Raise RLIMIT_NOFILE's soft limit to the hard one, as systemd advises for services that
    need many fds (and do not use select()): every region keeps an fd or two open, and the
    daemon-wide region cap is what the limit leaves after connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 1 << 20 if hard == resource.RLIM_INFINITY else min(hard, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("open_files_limit_not_raised", soft=soft, hard=hard, error=str(exc))


async def _close_refused(sock: FramedSocket) -> None:
    """Close after the client's first frame (its hello) or a short wait: a client whose
    hello is still on its way when we close gets EPIPE on sending it and loses our reason."""
    try:
        await asyncio.wait_for(sock.drain(), 1.0)
        _msg, fds = await asyncio.wait_for(sock.receive(), 2.0)
        close_received(fds)
    except (TimeoutError, PriodError):
        pass
    sock.close()
