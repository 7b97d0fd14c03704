"""`SyncClient`: the client's API, blocking, for code without an event loop.

One request at a time on one socket; ``spin_us`` busy-polls for a reply before sleeping, since
waking a sleeping process costs more than an urgent copy. Copies may also be started and polled
(`start_copy`, `start_copy_batch`: handles with ``poll``, ``wait`` and ``cancel``).

A lost connection is noticed at the next request, which reconnects (``reconnect_s``), registers
the held regions again and then goes on (docs/reliability.md, "What survives a daemon restart").
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import time
import warnings
from collections.abc import Callable, Collection
from types import TracebackType
from typing import Any, Generic, Unpack

from priod.client.base import (
    BatchOptions,
    BatchResult,
    CopyOptions,
    CopyResult,
    R,
    Region,
    RegionsLostWarning,
    Reply,
    alloc_device_request,
    batch_request,
    check_owner,
    check_regions,
    check_server,
    close_fds,
    copy_lost,
    copy_request,
    copy_unsent,
    cuda_register_request,
    hold_page,
    no_daemon,
    no_permission,
    progress,
    raise_if_cancelled,
    reconnect_sleep,
    regions_lost,
    reregister_request,
)
from priod.client.copy_ring import ClientRing
from priod.client.direct import HoldPage
from priod.client.route import DIRECT_CLASS, CopyPath, DirectRoute, check_copy_path
from priod.client.torch_face import block_segments, tensor_copy
from priod.common.socket_path import find_socket
from priod.errors import ConnectionClosed, InvalidRequest, PriodError
from priod.wire.messages import (
    PROTOCOL_VERSION,
    AllocHost,
    Cancel,
    Copy,
    CopyBatch,
    CopyBatchReply,
    CopyReply,
    Free,
    Hello,
    HelloReply,
    Message,
    OpenHoldPage,
    OpenRing,
    Ping,
    RegionReply,
    RegisterHost,
    Request,
    Share,
    StatusReply,
    StatusRequest,
    error_of,
    is_progress,
)
from priod.wire.replies import ErrorReply
from priod.wire.ring import RING_VERSION, ring_supported
from priod.wire.transport import BlockingFramedSocket

__all__ = ["DEFAULT_SPIN_US", "DEFAULT_URGENT_SPIN_US", "SyncBatchHandle", "SyncClient", "SyncCopyHandle"]

DEFAULT_SPIN_US = 200.0
"""How long a `SyncClient` busy-polls for a reply before it sleeps in ``recv``. Measured on the
2-vCPU VM (sim engine, 64-byte copy): a client that sleeps at once waits 136-142 us for a reply
that a spinning one has at 58 us; the difference is waking the sleeping process (a virtual CPU
that halted). A small copy's round trip fits in 200 us; a longer wait costs at most that much
CPU before the client sleeps."""
DEFAULT_URGENT_SPIN_US = 2000.0
"""The busy-poll for the reply of an ``urgent`` copy through the daemon. On the GPU hosts such a
copy takes 125-400 us (docs/benchmarks.md), past `DEFAULT_SPIN_US`, and a client asleep by then
pays a wake-up of 46-154 us on top (bench_gpu.py's ``floor`` row); the GPU benchmarks' figures
are for a client that polls this long. It costs the copy's time on a core (at most this long),
which the poll yields to any other task that wants it (`BlockingFramedSocket.receive_or_wake`)."""


class _SyncHandle(Generic[R]):
    """A copy (or batch) started by `SyncClient.start_copy` / `start_copy_batch`: `poll` it
    without blocking, `wait` for it, or `cancel` it. Other requests may go meanwhile."""

    _decode: Callable[[Message], R]

    def __init__(self, client: SyncClient, req_id: int, signalled: bool = False) -> None:
        self.client, self.id = client, req_id
        self._signalled = signalled
        self._reply: Message | None = None
        self.segments_done: int | None = None
        """After `cancel` of a batch: how many of its segments (the first ones) landed whole."""

    def done(self) -> bool:
        return self.poll_reply(0.0) is not None

    def poll_reply(self, timeout: float) -> Message | None:
        """The copy's reply if it came within ``timeout`` seconds (0: never blocks)."""
        if self._reply is None:
            self._reply = self.client._take(self.id, timeout)
        return self._reply

    def wait_recorded(self, timeout: float | None = None) -> None:
        """Block until the daemon has recorded this copy's ``signal_event`` behind its last
        chunk (the copy may still be in flight); see `priod.client.CopyHandle.recorded`. Raises
        the copy's error if it ended without recording it, TimeoutError after ``timeout`` s."""
        if not self._signalled:
            raise InvalidRequest(
                "this copy was sent without signal_event; pass signal_event= to wait on it from a stream"
            )
        c = self.client
        deadline = time.perf_counter() + timeout_seconds(timeout)
        while self.id not in c._recorded:
            if self.poll_reply(0.0) is not None:
                assert self._reply is not None
                self._result(self._reply)  # the reply came first: it raises why nothing was recorded
                return
            left = deadline - time.perf_counter()
            if left <= 0:
                raise TimeoutError(f"the daemon did not record copy {self.id}'s signal_event within {timeout} s")
            try:
                got = c._sock.receive() if left == math.inf else c._sock.receive_within(left)
            except BaseException as exc:
                if not c._lost_by(exc):
                    raise
                c._recover(exc)  # settles this copy (an error reply, or sent again), as `_take` does
                continue
            if got is not None:
                c._keep(*got)

    def poll(self) -> R | None:
        """The result if the copy has ended, else None; never blocks. Raises the copy's error."""
        msg = self.poll_reply(0.0)
        return None if msg is None else self._result(msg)

    def _result(self, msg: Message) -> R:
        if (exc := error_of(msg)) is not None:
            raise self.client._lost_copies.pop(self.id, exc)
        return self._decode(msg)

    def wait(self, timeout: float | None = None) -> R:
        """Block for the result; with ``timeout`` (seconds), cancel the copy in the daemon once it
        passes and raise `CopyTimeout` with how far it got (unless it finished meanwhile). A
        timeout of 0 or less times out at once; one past `MAX_TIMEOUT_S` (or inf) waits for good;
        NaN cancels the copy and raises `InvalidRequest`, so that no copy runs on unwatched."""
        try:
            seconds = timeout_seconds(timeout)
        except InvalidRequest:
            self._stop()
            raise
        msg = self.poll_reply(seconds)
        if msg is None:
            msg = self._stop()
            raise_if_cancelled(self.id, timeout, msg)
        return self._result(msg)

    def _stop(self) -> Message:
        if self.poll_reply(0.0) is None:
            try:
                self.client._request(Cancel(self.id))
            except PriodError:
                pass  # finished meanwhile: its own reply says how
        msg = self.poll_reply(math.inf)
        assert msg is not None
        return msg

    def cancel(self) -> int:
        """Stop at the next chunk boundary; returns the bytes copied (all of them if it had
        finished). For a batch, `segments_done` then says how many segments landed whole."""
        nbytes, self.segments_done = progress(self._stop(), self._decode)
        return nbytes


MAX_TIMEOUT_S = 1e9
"""Longer timeouts (about 32 years) wait for good: a socket's timeout must fit a C time type."""


def timeout_seconds(timeout: float | None) -> float:
    """A timeout as seconds to wait: None and anything past `MAX_TIMEOUT_S` wait for good, and
    0 or less not at all; NaN is refused, as the number it stands for cannot be known."""
    if timeout is None:
        return math.inf
    if math.isnan(timeout):
        raise InvalidRequest("timeout = nan is not a number of seconds; pass seconds >= 0, or None to wait for good")
    return math.inf if timeout > MAX_TIMEOUT_S else max(0.0, float(timeout))


class SyncCopyHandle(_SyncHandle[CopyReply]):
    """A copy started by `SyncClient.start_copy`."""

    _decode = staticmethod(CopyReply.decode)


class SyncBatchHandle(_SyncHandle[CopyBatchReply]):
    """A batch started by `SyncClient.start_copy_batch`."""

    _decode = staticmethod(CopyBatchReply.decode)


class SyncClient:
    """The same API, blocking, for code without an event loop. One request at a time, except
    copies started with `start_copy` / `start_copy_batch`, which go on while others are made.
    Not thread-safe: its copy ring has one writer; give each thread its own, or a lock around it."""

    def __init__(
        self,
        path: str | None = None,
        *,
        name: str = "",
        timeout: float | None = None,
        spin_us: float = DEFAULT_SPIN_US,
        urgent_spin_us: float = DEFAULT_URGENT_SPIN_US,
        expect_uid: int | None = None,
        copy_path: CopyPath = "auto",
        reconnect_s: float = 30.0,
        retry_copies: bool = False,
        ring: bool = True,
    ) -> None:
        """Connect and handshake. ``spin_us`` > 0 busy-polls that long for each reply before
        sleeping (lower latency, at the cost of a core while waiting); 0 sleeps at once. The
        default, `DEFAULT_SPIN_US`, covers a small copy's round trip. ``urgent_spin_us``: the
        same for an ``urgent`` copy through the daemon (`DEFAULT_URGENT_SPIN_US`), the copy
        whose caller waits on it.
        ``copy_path``: this connection's default for `copy`'s ``path`` (see `Client.copy`).
        ``reconnect_s``, ``retry_copies``: as for `priod.connect`; a lost connection is found
        by the next request, which reconnects, registers the regions again and goes on (a copy
        sent before the loss fails with `ConnectionClosed`, or is sent again with ``retry_copies``).
        ``ring``: plain copies go through the connection's copy ring where the daemon offers one
        (see `Client.connect`); the wait for one spins on its completion, then sleeps."""
        if reconnect_s < 0:
            raise InvalidRequest(f"reconnect_s = {reconnect_s} is invalid; give seconds >= 0 (0: never reconnect)")
        self.copy_path = check_copy_path(copy_path)
        self.path = path or find_socket()
        self.name, self.timeout, self.spin_us, self.expect_uid = name, timeout, spin_us, expect_uid
        self.urgent_spin_us = urgent_spin_us
        self.reconnect_s = reconnect_s
        """See `Client.reconnect_s`."""
        self.retry_copies = retry_copies
        """See `Client.retry_copies`."""
        self.reconnects = 0
        """How many times this client reconnected by itself."""
        self.landed_replies = 0
        """Copies whose reply this client made from their landed word (the GPU's store), not
        from the daemon's completion (`priod.wire.ring`)."""
        self.lost_regions: list[Region] = []
        """Regions the last reconnect could not register again (each one's ``lost`` says why)."""
        self.generation = 0
        self._ids = itertools.count(1)
        self._regions: list[Region] = []
        self._started: dict[int, Message | None] = {}
        """Copies started and not yet collected by their handle: their reply once it came."""
        self._started_copies: dict[int, tuple[Copy | CopyBatch, Region, Region]] = {}
        """What those copies were, to send them again after a reconnect (``retry_copies``)."""
        self._recorded: set[int] = set()
        """Started copies whose signal_event the daemon reported recorded (a progress frame)."""
        self._published: dict[int, tuple[ClientRing, int]] = {}
        """Started copies published on the ring: (ring, sequence number), to tell after a lost
        connection whether the daemon took them (`_recover`)."""
        self._landed: dict[int, tuple[ClientRing, int, Copy | CopyBatch]] = {}
        """Started urgent copies on the ring that asked for their landed word: (ring, sequence
        number, the descriptor's copy), to spin on (`ClientRing.landed`)."""
        self._lost_copies: dict[int, ConnectionClosed] = {}
        """Started copies a lost connection left unanswered: the error their handle raises."""
        self._greeted = False
        self._recovering = False
        self._dead: ConnectionClosed | None = None
        """Why this client is closed for good (closed, or a lost connection it did not recover)."""
        self._route: DirectRoute | None = None
        self.use_ring = ring
        self._ring: ClientRing | None = None
        try:
            self._connect()
        except BaseException:
            if hasattr(self, "_sock"):
                self._sock.close()
            raise

    def _connect(self) -> None:
        """Open the socket and handshake (again, after a lost connection)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.path)  # blocking: waits while the daemon's listen backlog is full
            check_owner(sock, self.path, self.expect_uid)
        except PermissionError as exc:
            sock.close()
            raise no_permission(self.path) from exc
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            raise no_daemon(self.path, exc) from exc
        except BaseException:
            sock.close()
            raise
        sock.settimeout(self.timeout)
        self._sock = BlockingFramedSocket(sock, spin_s=self.spin_us / 1e6, peer=self.path)
        self.generation += 1
        msg, _ = self._request(Hello(PROTOCOL_VERSION, self.name or f"pid{os.getpid()}"))
        self.server = check_server(HelloReply.decode(msg), self.path)
        """The daemon's hello: its version, backend, classes, and who it sees us as (``peer``)."""
        if self._route is not None:
            self._route.close()
        self._route = DirectRoute(self.server.backend, self.hold_page)
        if self._ring is not None:
            self._ring.close()
            self._ring = None
        if self.use_ring and self.server.ring == RING_VERSION and ring_supported():
            try:
                self._ring = ClientRing(self._request(OpenRing())[1])
            except (ValueError, OSError, InvalidRequest):
                pass  # the socket carries every copy
        self._greeted = True

    @property
    def route(self) -> DirectRoute:
        assert self._route is not None
        return self._route

    # -- a lost connection ------------------------------------------------------------------------
    @staticmethod
    def _lost_by(exc: BaseException) -> bool:
        """Whether ``exc`` means the connection is gone (not a timeout, not a request's own error)."""
        if isinstance(exc, PriodError):
            return exc.code in ("closed", "shutting_down")
        return isinstance(exc, OSError) and not isinstance(exc, TimeoutError)

    def _lost_why(self, exc: BaseException) -> str:
        """The message of a lost connection: the transport's own names the path already."""
        if isinstance(exc, ConnectionClosed) and str(exc).startswith(f"connection to priod at {self.path} "):
            return str(exc)
        return f"connection to priod at {self.path} lost: {exc}"

    def _recover(self, exc: BaseException) -> bool:
        """The connection was lost (``exc``): reconnect, register the regions again and settle
        the started copies; True once reconnected, False where this client does not (then the
        started copies have failed and the client is closed, unless within a reconnect)."""
        if self._recovering:
            return False
        orphans = [rid for rid, reply in self._started.items() if reply is None]
        # Descriptors the daemon never took (its head did not pass them) never left, as a frame
        # that failed to send: they go again on the new connection, with or without
        # ``retry_copies``. Read now: reconnecting closes the ring.
        untaken = {rid for rid in orphans if (p := self._published.get(rid)) is not None and not p[0].taken(p[1])}
        if self._dead is not None or self.reconnect_s <= 0 or not self._greeted:
            self._sock.close()
            if self._dead is None:
                self._dead = ConnectionClosed(self._lost_why(exc))
            self._settle(orphans, "The client does not reconnect by itself (reconnect_s = 0, or closed).", untaken)
            return False
        self._recovering = True
        start = time.monotonic()
        deadline = start + self.reconnect_s

        try:
            self._sock.close()
            attempt = 0
            while True:
                attempt += 1
                try:
                    self._connect()
                    self._restore()
                    break
                except (PriodError, OSError) as err:
                    self._sock.close()
                    if not self._lost_by(err) or time.monotonic() >= deadline:
                        self._dead = ConnectionClosed(
                            f"connection to priod at {self.path} lost, and reconnecting failed for "
                            f"{time.monotonic() - start:.1f} s (reconnect_s = {self.reconnect_s}): {err}"
                        )
                        self._settle(orphans, f"The client did not reconnect: {err}.", untaken)
                        return False
                    time.sleep(min(reconnect_sleep(attempt), max(0.0, deadline - time.monotonic())))
        finally:
            self._recovering = False
        self.reconnects += 1
        self._settle(
            orphans,
            f"The client has reconnected (in {time.monotonic() - start:.2f} s) and registered its regions again.",
            untaken,
        )
        if self.lost_regions:
            warnings.warn(regions_lost(self.path, self.lost_regions), RegionsLostWarning, stacklevel=3)
        return True

    def _restore(self) -> None:
        """Register every region held again (same Region objects, new ids), and share again."""
        lost: list[Region] = []
        for region in list(self._regions):
            req = reregister_request(region)
            if isinstance(req, str):
                region.lost = req
            else:
                msg, fds = req
                try:
                    reply, got = self._request(msg, fds)
                    close_fds(got)
                    region.renew(RegionReply.decode(reply), self.generation)
                    for uid in sorted(region.shared_with):
                        self._request(Share(region.id, uid))
                    continue
                except PriodError as exc:
                    if self._lost_by(exc):
                        raise
                    region.lost = f"registering it again failed: {exc}"
                finally:
                    close_fds(list(fds))
            lost.append(region)
        for region in lost:
            self._regions.remove(region)
        self.lost_regions = lost

    def _settle(self, orphans: list[int], outcome: str, untaken: Collection[int]) -> None:
        """The started copies the lost connection left unanswered: sent again once reconnected
        (``retry_copies``), else their reply becomes the `ConnectionClosed` that says what became
        of them. ``untaken``: ring descriptors the daemon never took, which never left: sent
        again once reconnected whatever ``retry_copies`` says, else failed saying that no byte
        of them moved."""
        reconnected = self._dead is None  # set before settling wherever the client gave up
        for rid in orphans:
            self._published.pop(rid, None)
            entry = self._started_copies.get(rid)
            never_left = rid in untaken
            if reconnected and (self.retry_copies or never_left) and entry is not None:
                req, dst, src = entry
                if req.wait_event is None and req.signal_event is None and dst.lost is None and src.lost is None:
                    try:
                        if not self._ring_submit(rid, req, dst, src):  # on the new ring if it has one
                            self._sock.send({**req.encode(rid), "dst": dst.id, "src": src.id})
                        continue
                    except (PriodError, OSError):
                        pass
            exc = self._lost_copies[rid] = (copy_unsent if never_left else copy_lost)(rid, self.path, outcome)
            self._started[rid] = ErrorReply(exc.code, str(exc)).encode(rid)

    def _lost_error(self, exc: BaseException, copy: bool, req_id: int) -> ConnectionClosed:
        """What a request whose connection was lost (``exc``), and not recovered, raises."""
        dead = self._dead or ConnectionClosed(self._lost_why(exc))
        err = copy_lost(req_id, self.path, f"The client did not reconnect: {dead}") if copy else dead
        err.__cause__ = exc
        return err

    def _request(
        self,
        msg: Request | Message,
        fds: tuple[int, ...] = (),
        regions: tuple[Region, Region] | None = None,
    ) -> Reply:
        """Send ``msg`` and wait for its reply. A connection found lost is recovered (`_recover`)
        and the request sent again if it had not gone, or had gone and is not a copy (one of
        ``regions``, whose new ids it then names), or is one and ``retry_copies`` is set."""
        while True:
            if self._dead is not None and not self._recovering:
                raise self._dead
            req_id = next(self._ids)
            if regions is not None:
                check_regions(self.generation, *regions)
                assert not isinstance(msg, dict)
                wire: Message = {**msg.encode(req_id), "dst": regions[0].id, "src": regions[1].id}
            else:
                wire = msg.encode(req_id) if not isinstance(msg, dict) else {**msg, "id": req_id}
            try:
                self._sock.send(wire, fds)
            except BaseException as exc:
                if not self._lost_by(exc):
                    raise
                if not self._recover(exc):
                    raise self._lost_error(exc, False, req_id) from exc
                continue  # it never left: nothing moved; send it on the new connection
            try:
                return self._receive(req_id, self._spin_s(msg))
            except BaseException as exc:
                if not self._lost_by(exc) or (isinstance(exc, PriodError) and getattr(exc, "_reply", False)):
                    raise
                if not self._recover(exc):
                    raise self._lost_error(exc, regions is not None, req_id) from exc
                if regions is not None and not self.retry_copies:
                    err = copy_lost(req_id, self.path, "The client has reconnected and registered its regions again.")
                    raise err from exc

    def _spin_s(self, msg: object) -> float | None:
        """How long to busy-poll for ``msg``'s reply, in seconds: `urgent_spin_us` for an urgent
        copy or batch, else None (the socket's own, `spin_us`)."""
        if isinstance(msg, Copy | CopyBatch) and msg.priority == DIRECT_CLASS:
            return self.urgent_spin_us / 1e6
        return None

    def _receive(self, req_id: int, spin_s: float | None = None) -> Reply:
        while True:
            reply, got = self._sock.receive(spin_s)
            if is_progress(reply) and reply.get("id") == req_id:
                close_fds(got)  # a blocking copy() with signal_event: its reply follows
                continue
            if reply.get("id") == req_id:
                if (exc := error_of(reply)) is not None:
                    close_fds(got)
                    exc._reply = True  # type: ignore[attr-defined]  # the request's own error, not a loss
                    raise exc
                return reply, got
            self._keep(reply, got)

    def _keep(self, reply: Message, fds: list[int]) -> None:
        """A reply that is not the one awaited: a started copy's is kept for its handle."""
        close_fds(fds)
        rid = reply.get("id")
        if is_progress(reply):
            if rid in self._started:
                self._recorded.add(rid)
            return
        if rid in self._started:
            self._started[rid] = reply
        elif not rid and (exc := error_of(reply)) is not None:
            raise exc

    def _start(self, msg: Copy | CopyBatch, dst: Region, src: Region) -> int:
        while True:
            if self._dead is not None:
                raise self._dead
            check_regions(self.generation, dst, src)
            req_id = next(self._ids)
            self._started[req_id] = None
            self._started_copies[req_id] = (msg, dst, src)
            try:
                if not self._ring_submit(req_id, msg, dst, src):
                    self._sock.send({**msg.encode(req_id), "dst": dst.id, "src": src.id})
                return req_id
            except BaseException as exc:
                del self._started[req_id], self._started_copies[req_id]
                if not self._lost_by(exc):
                    raise
                if not self._recover(exc):
                    raise self._lost_error(exc, False, req_id) from exc
                # it never left: send it on the new connection

    def _ring_submit(self, req_id: int, msg: Copy | CopyBatch, dst: Region, src: Region) -> bool:
        """Publish a started copy on the ring (and ring the doorbell); False if it cannot go there."""
        ring = self._ring
        if ring is None or msg.wait_event is not None or msg.signal_event is not None:
            return False
        req: Copy | CopyBatch
        if isinstance(msg, CopyBatch):
            req = CopyBatch(dst.id, src.id, msg.segments, msg.priority, msg.deadline_ms)
        else:
            req = Copy(dst.id, src.id, msg.nbytes, msg.dst_offset, msg.src_offset, msg.priority, msg.deadline_ms)
        if not ring.eligible(req):
            return False
        # An urgent copy is spun for (`urgent_spin_us`): the GPU's store of its landed word
        # ends the spin as soon as its bytes are in, before the daemon has seen it done.
        landed = msg.priority == "urgent" and self.urgent_spin_us > 0
        seq = ring.submit(req_id, req, landed)
        if seq is None:
            return False
        # A descriptor published to a daemon that has died does not fail here, as a frame would:
        # the loss is found while waiting, and a descriptor the daemon never took goes again.
        self._published[req_id] = (ring, seq)
        if landed:
            self._landed[req_id] = (ring, seq, req)
        ring.ring()
        return True

    def _landed_reply(self, req_id: int) -> bool:
        """Take a started copy's reply from its landed word (`ClientRing.landed_reply`) if the
        GPU has stored it; True if it had."""
        entry = self._landed.get(req_id)
        if entry is None:
            return False
        ring, seq, req = entry
        if ring is not self._ring or not ring.landed(seq):
            return False
        reply = ring.landed_reply(seq, req_id, req)
        if reply is None:
            return False
        self._started[req_id] = reply  # its completion, when it comes, finds no one waiting
        self.landed_replies += 1
        return True

    def _collect_ring(self) -> bool:
        """Take the ring's completions into the started copies' replies; True if any came."""
        ring = self._ring
        if ring is None:
            return False
        ring.clear_wake()  # first: a completion published after the read below wakes us again
        came = False
        for rid, reply in ring.completions():
            if rid in self._started:
                self._started[rid] = reply
                came = True
        return came

    def _take(self, req_id: int, timeout: float) -> Message | None:
        """A started copy's reply, read within ``timeout`` seconds, else None."""
        deadline = time.perf_counter() + timeout
        started = self._started_copies.get(req_id)
        spin_s = self._spin_s(started[0]) if started is not None else None
        landed = self._landed.get(req_id)
        while self._started.get(req_id) is None:
            if landed is not None and self._landed_reply(req_id):
                break
            if self._collect_ring():
                continue
            left = deadline - time.perf_counter()
            ring = self._ring
            try:
                if ring is not None:
                    # Spin on the ring's completions and the copy's landed word (no system
                    # call), then sleep on both.
                    woken = (
                        ring.completion_or_landed(landed[1]) if landed and landed[0] is ring else ring.has_completions
                    )
                    got = self._sock.receive_or_wake(max(left, 0.0), ring.wake_fd, woken, spin_s)
                    if got is None:
                        if ring.has_completions() or time.perf_counter() < deadline:
                            continue
                        return None
                else:
                    got = (
                        self._sock.receive(spin_s)
                        if left == math.inf
                        else self._sock.receive_within(max(left, 0.0), spin_s)
                    )
            except BaseException as exc:
                if not self._lost_by(exc):
                    raise
                self._recover(exc)  # settles this copy: an error reply, or sent again
                continue
            if got is None:
                return None
            self._keep(*got)
        self._recorded.discard(req_id)
        self._started_copies.pop(req_id, None)
        self._published.pop(req_id, None)
        self._landed.pop(req_id, None)
        return self._started.pop(req_id)

    def raw_request(self, msg: Message) -> Message:
        """Send ``msg`` as it is (an ``id`` is added) and return the reply's fields (see `Client.raw_request`)."""
        reply, fds = self._request(msg)
        close_fds(fds)
        return reply

    def _region(self, reply: Reply) -> Region:
        msg, fds = reply
        region = Region(RegionReply.decode(msg), fds, self.generation)
        self._regions.append(region)
        return region

    @property
    def regions(self) -> tuple[Region, ...]:
        """The regions this connection made and has not freed."""
        return tuple(self._regions)

    def hold_page(self) -> HoldPage:
        """See `Client.hold_page`."""
        return hold_page(self._request(OpenHoldPage(doorbell=True)))

    def alloc_host(self, nbytes: int) -> Region:
        return self._region(self._request(AllocHost(nbytes)))

    def register_host(self, fd: int, nbytes: int) -> Region:
        dup = os.dup(fd)
        try:
            msg, got = self._request(RegisterHost(nbytes), (dup,))
        finally:
            os.close(dup)
        close_fds(got)
        return self._region((msg, [os.dup(fd)]))

    def alloc_device(self, nbytes: int, device: int | str = 0) -> Region:
        """See `Client.alloc_device`."""
        return self._region(self._request(alloc_device_request(nbytes, device)))

    def register_device(self, obj: Any) -> Region:
        """See `Client.register_device`."""
        req, fds = cuda_register_request(obj)
        try:
            reply = self._request(req, fds)
        finally:
            close_fds(list(fds))  # the daemon got its own copy of the allocation's (the pool's) fd
        return self._region(reply).holding(obj)

    def free(self, region: Region) -> None:
        if region.lost is not None:  # gone with the daemon already: nothing to free there
            region.unmap()
            return
        check_regions(self.generation, region)
        self.route.forget(region)
        self._request(Free(region.id))
        region.unmap()
        if region in self._regions:
            self._regions.remove(region)

    def share(self, region: Region, uid: int) -> None:
        check_regions(self.generation, region)
        self._request(Share(region.id, uid))
        region.shared_with.add(uid)

    def copy(
        self,
        dst: Region,
        src: Region,
        nbytes: int | None = None,
        *,
        timeout: float | None = None,
        path: CopyPath | None = None,
        **options: Unpack[CopyOptions],
    ) -> CopyResult:
        """Copy and wait for it (see `Client.copy`: ``timeout``, and ``path``, the direct path
        or the daemon's)."""
        check_regions(self.generation, dst, src)
        if self.route.takes(dst, src, options, check_copy_path(path or self.copy_path)):
            return self.route.copy(dst, src, nbytes, options.get("dst_offset", 0), options.get("src_offset", 0))
        if timeout is not None:
            timeout_seconds(timeout)  # NaN is refused before anything is sent
            return self.start_copy(dst, src, nbytes, **options).wait(timeout)
        if self._ring is not None:
            return self.start_copy(dst, src, nbytes, **options).wait()  # `_take` waits on the ring too
        msg, _ = self._request(copy_request(dst, src, nbytes, options), regions=(dst, src))
        return CopyReply.decode(msg)

    def start_copy(
        self, dst: Region, src: Region, nbytes: int | None = None, **options: Unpack[CopyOptions]
    ) -> SyncCopyHandle:
        """Send a copy and return at once (see `Client.start_copy`)."""
        req = copy_request(dst, src, nbytes, options)
        return SyncCopyHandle(self, self._start(req, dst, src), req.signal_event is not None)

    def copy_batch(
        self,
        dst: Region,
        src: Region,
        segments: Any,
        *,
        timeout: float | None = None,
        path: CopyPath | None = None,
        **options: Unpack[BatchOptions],
    ) -> BatchResult:
        """Copy every segment and wait for the batch (see `Client.copy_batch`)."""
        check_regions(self.generation, dst, src)
        if self.route.takes(dst, src, options, check_copy_path(path or self.copy_path)):
            return self.route.copy_batch(dst, src, segments)
        timeout_seconds(timeout)  # NaN is refused before anything is sent
        return self.start_copy_batch(dst, src, segments, **options).wait(timeout)

    def start_copy_batch(
        self, dst: Region, src: Region, segments: Any, **options: Unpack[BatchOptions]
    ) -> SyncBatchHandle:
        """Send a batch and return at once (see `Client.start_copy_batch`)."""
        req = batch_request(dst, src, segments, options, self.server.max_frame_bytes)
        return SyncBatchHandle(self, self._start(req, dst, src), req.signal_event is not None)

    def copy_tensor(
        self,
        dst: Any,
        src: Any,
        *,
        timeout: float | None = None,
        path: CopyPath | None = None,
        **options: Unpack[BatchOptions],
    ) -> CopyResult:
        """Copy tensor ``src`` into tensor ``dst`` and wait (see `Client.start_copy_tensor`;
        ``path`` as for `copy`)."""
        d, s = tensor_copy(dst, src, self._regions)
        return self.copy(
            d.region,
            s.region,
            d.nbytes,
            dst_offset=d.offset,
            src_offset=s.offset,
            timeout=timeout,
            path=path,
            **options,
        )

    def start_copy_tensor(self, dst: Any, src: Any, **options: Unpack[BatchOptions]) -> SyncCopyHandle:
        """Send a tensor copy and return at once (see `Client.start_copy_tensor`)."""
        d, s = tensor_copy(dst, src, self._regions)
        return self.start_copy(d.region, s.region, d.nbytes, dst_offset=d.offset, src_offset=s.offset, **options)

    def copy_blocks(
        self,
        dst: Any,
        src: Any,
        dst_ids: Any,
        src_ids: Any,
        *,
        block_dim: int = 0,
        block_bytes: int | None = None,
        timeout: float | None = None,
        path: CopyPath | None = None,
        **options: Unpack[BatchOptions],
    ) -> BatchResult:
        """Copy paged blocks as one batch and wait (see `Client.start_copy_blocks`; ``path`` as
        for `copy`)."""
        d, s, segments = block_segments(
            dst, src, dst_ids, src_ids, self._regions, block_dim=block_dim, block_bytes=block_bytes
        )
        return self.copy_batch(d, s, segments, timeout=timeout, path=path, **options)

    def start_copy_blocks(
        self,
        dst: Any,
        src: Any,
        dst_ids: Any,
        src_ids: Any,
        *,
        block_dim: int = 0,
        block_bytes: int | None = None,
        **options: Unpack[BatchOptions],
    ) -> SyncBatchHandle:
        """Send paged blocks as one batch and return at once (see `Client.start_copy_blocks`)."""
        d, s, segments = block_segments(
            dst, src, dst_ids, src_ids, self._regions, block_dim=block_dim, block_bytes=block_bytes
        )
        return self.start_copy_batch(d, s, segments, **options)

    def status(self) -> dict[str, Any]:
        msg, _ = self._request(StatusRequest())
        return StatusReply.decode(msg).status

    def ping(self) -> None:
        self._request(Ping())

    def close(self) -> None:
        self._dead = ConnectionClosed("this client was closed")
        self.route.close()
        self._sock.close()
        if self._ring is not None:
            self._ring.close()
        for region in self._regions:
            region.unmap()
        self._regions.clear()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
