"""Client library: `Client` (asyncio) and `SyncClient` (blocking), speaking docs/protocol.md.

    c = await priod.connect(socket_path)        # or: async with priod.connect(path) as c:
    h = await c.alloc_host(nbytes)              # h.array: numpy view of the shared memory
    d = await c.alloc_device(nbytes)            # under sim, d.array too
    r = await c.copy(d, h, nbytes, priority="urgent")
    b = await c.copy_batch(d, h, [(0, 0, 4096), (65536, 8192, 4096)])  # many blocks, one request
    await c.close()

Copies never carry data: they name regions both sides can reach. Replies may come back out of
order (urgent copies overtake bulk ones); each request waits on its own future. If the
connection breaks, the client reconnects by itself (``reconnect_s``, default 30 s; 0: never)
and registers its regions again, so the same `Region` objects go on working after a daemon
restart (docs/reliability.md, "What survives a daemon restart"). A copy whose reply had not
come fails with `ConnectionClosed` saying so (or is sent again with ``retry_copies``); no copy
is ever reported done that the daemon did not report done.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import socket
import time
import warnings
from collections.abc import Callable, Generator
from types import TracebackType
from typing import Any, Generic, Unpack

from priod.client.base import (
    BUSY_WAIT_S,
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
    discover,
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
from priod.client.route import CopyPath, DirectRoute, check_copy_path
from priod.client.torch_face import block_segments, tensor_copy
from priod.errors import ConnectionClosed, InvalidRequest, PermissionDenied, PriodError, ProtocolError
from priod.wire.frames import REPLY_LIMITS
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
from priod.wire.ring import RING_VERSION, ring_supported
from priod.wire.transport import FramedSocket

__all__ = [
    "BatchHandle",
    "BatchOptions",
    "BatchResult",
    "Client",
    "CopyHandle",
    "CopyOptions",
    "CopyResult",
    "Region",
    "connect",
]


class _Handle(Generic[R]):
    """A copy (or batch) in progress: await it (or `wait`) for its result, or `cancel()` it."""

    _decode: Callable[[Message], R]

    def __init__(
        self, client: Client, req_id: int, future: asyncio.Future[Reply], recorded: asyncio.Future[None] | None = None
    ) -> None:
        self.client, self.id, self._future = client, req_id, future
        self._recorded = recorded
        self.segments_done: int | None = None
        """After `cancel` of a batch: how many of its segments (the first ones) landed whole."""

    async def recorded(self) -> None:
        """Return once the daemon has recorded this copy's ``signal_event`` behind its last
        chunk (the copy itself may still be in flight): from then on
        ``stream.wait_event(event)`` makes ``stream``'s later work wait for the copy's bytes,
        with no host synchronisation. Raises the copy's error if it ended without recording
        it (cancelled before its last chunk, failed, or the record failed)."""
        if self._recorded is None:
            raise InvalidRequest(
                "this copy was sent without signal_event; pass signal_event= to wait on it from a stream"
            )
        if not self._recorded.done():
            either: list[asyncio.Future[Any]] = [self._recorded, self._future]
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if not self._recorded.done():
            await self  # the reply came first: it raises why nothing was recorded

    def __await__(self) -> Generator[Any, None, R]:
        msg, _fds = yield from self._future.__await__()
        if (exc := error_of(msg)) is not None:
            raise exc
        return self._decode(msg)

    def done(self) -> bool:
        return self._future.done()

    async def wait(self, timeout: float | None = None) -> R:
        """The result; with ``timeout`` (seconds), cancel the copy in the daemon once it passes
        and raise `CopyTimeout` with how far it got (unless it finished meanwhile)."""
        if timeout is not None and not self._future.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._future), timeout)
            except TimeoutError:
                await self._stop()
                raise_if_cancelled(self.id, timeout, self._future.result()[0])
        return await self

    async def _stop(self) -> None:
        """Ask the daemon to cancel, then wait for the copy's own last reply."""
        if not self._future.done():
            try:
                await self.client._request(Cancel(self.id))
            except PriodError:
                pass  # finished meanwhile: its own reply says how
        await asyncio.wait([self._future])

    async def cancel(self) -> int:
        """Stop at the next chunk boundary; returns the bytes copied (all of them if it had
        finished). For a batch, `segments_done` then says how many segments landed whole."""
        await self._stop()
        nbytes, self.segments_done = progress(self._future.result()[0], self._decode)
        return nbytes


class CopyHandle(_Handle[CopyReply]):
    """A copy in progress: await it (or `wait`) for its `CopyResult`, or `cancel()` it."""

    _decode = staticmethod(CopyReply.decode)


class BatchHandle(_Handle[CopyBatchReply]):
    """A batch in progress: await it (or `wait`) for its `BatchResult`, or `cancel()` it."""

    _decode = staticmethod(CopyBatchReply.decode)


RING_RUNG = 1
"""This loop turn's first copy on the ring rang the doorbell, and no other copy followed it."""
RING_DUE = 2
"""More copies followed this turn's first: the doorbell rings again when the turn ends."""
INLINE_DIRECT_BYTES = 4 << 20
"""A direct copy (or batch) of up to this many bytes runs on the event loop itself; a larger one
on a worker thread, so that the loop goes on serving meanwhile. The hand-over to a thread and
back costs a copy ~170 us at p50 on a 2-core machine (asyncio.to_thread, a 1 MiB memcpy), more
than 4 MiB takes on an H200's link (~80 us idle); past that, holding the loop for the whole copy
would cost other tasks more than the hop costs this one (docs/design.md, Defaults)."""


class Client:
    """An asyncio connection to the daemon. Many requests may be in flight at once."""

    def __init__(
        self,
        path: str,
        name: str = "",
        expect_uid: int | None = None,
        copy_path: CopyPath = "auto",
        reconnect_s: float = 30.0,
        retry_copies: bool = False,
        ring: bool = True,
        spin_us: float = 0.0,
    ) -> None:
        self.path = path
        self.spin_us = spin_us
        """How long `copy` and `copy_batch` poll the copy ring for their completion, after
        sending, before they await it (0: they await at once). Polling saves this process a
        wake-up (a 64-byte copy's round trip 143-148 -> 43-45 us p50, 2-vCPU VM, sim) but holds
        the event loop meanwhile: for a process whose loop has little else to do."""
        self.use_ring = ring
        """Send plain copies through a shared-memory copy ring when the daemon offers one
        (`priod.wire.ring`); False: every request goes on the socket."""
        self._ring: ClientRing | None = None
        self.landed_replies = 0
        """See `SyncClient.landed_replies`."""
        self._published: dict[int, int] = {}
        """Copies published on the ring and not yet answered: their sequence numbers, to tell
        after a lost connection whether the daemon took them (`_lost`)."""
        self._untaken: set[int] = set()
        """Of the copies a lost connection left unanswered, those the daemon never took: they
        never left, and go again once reconnected (`_settle_orphans`)."""
        self._landed: dict[int, tuple[ClientRing, int, Copy | CopyBatch]] = {}
        """Urgent ring copies that asked for their landed word and are not yet spun for:
        (ring, sequence number, the descriptor's copy) (`_spin_for`)."""
        self._ring_due = 0
        """0, `RING_RUNG` or `RING_DUE`: this loop turn's doorbell (`_send_copy`)."""
        self.reconnect_s = reconnect_s
        """On a lost connection, reconnect (and register the regions again) for up to this
        many seconds; 0: never (the connection stays closed, as `reconnect` leaves it to you)."""
        self.retry_copies = retry_copies
        """Send again, after a reconnect, the copies whose reply the lost connection never
        brought (those without events); False: they fail with `ConnectionClosed`."""
        self.reconnects = 0
        """How many times this client reconnected by itself."""
        self.lost_regions: list[Region] = []
        """Regions the last reconnect could not register again (each one's ``lost`` says why)."""
        self._closing = False
        self._reconnecting: asyncio.Task[None] | None = None
        self._copies: dict[int, tuple[Copy | CopyBatch, Region, Region]] = {}
        """Copies sent and not answered yet, to say (or retry) what became of them on a lost connection."""
        self._orphans: dict[int, asyncio.Future[Reply]] = {}
        """Copies the lost connection left unanswered, while the client reconnects."""
        self.name = name
        self.copy_path = check_copy_path(copy_path)
        """The default of `copy`'s ``path`` for this connection."""
        self._route: DirectRoute | None = None
        self.expect_uid = expect_uid
        """Connect only to a daemon whose process runs as this uid (checked on every connect)."""
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Reply]] = {}
        self._recorded: dict[int, asyncio.Future[None]] = {}
        """Copies sent with a signal_event whose record the daemon has not reported yet."""
        self._sock: FramedSocket | None = None
        self._closed_exc: PriodError | None = None
        self.generation = 0
        self._server: HelloReply | None = None
        self._regions: list[Region] = []

    @property
    def regions(self) -> tuple[Region, ...]:
        """The regions this connection made and has not freed."""
        return tuple(self._regions)

    @property
    def server(self) -> HelloReply:
        """The daemon's hello: its version, backend, classes, and who it sees us as (``peer``)."""
        if self._server is None:
            raise ConnectionClosed("not connected; use priod.connect()")
        return self._server

    @classmethod
    async def connect(
        cls,
        path: str | None = None,
        *,
        name: str = "",
        wait_s: float = 0.0,
        expect_uid: int | None = None,
        copy_path: CopyPath = "auto",
        reconnect_s: float = 30.0,
        retry_copies: bool = False,
        ring: bool = True,
        spin_us: float = 0.0,
    ) -> Client:
        """Connect and handshake; retry for up to ``wait_s`` seconds while the daemon is not up.

        ``path``: None looks for the socket (`priod.daemon.config.find_socket`), for ``wait_s`` too.

        ``expect_uid``: refuse (`PermissionDenied`) a daemon whose process does not run as this
        uid, so a socket path that another user took over never gets this client's requests.

        ``copy_path``: this connection's default for `copy`'s ``path``.

        ``reconnect_s``: on a lost connection (a daemon restart), reconnect with jittered
        exponential backoff for up to this many seconds and register every held region again
        (0: never). ``retry_copies``: send again the copies the lost connection left unanswered.

        ``ring``: send plain copies (no events, a shipped class) through the connection's
        shared-memory copy ring, where the daemon offers one (docs/design.md: it costs the loop
        less than a frame); False keeps every request on the socket. ``spin_us``: see `spin_us`.
        """
        if not spin_us >= 0:
            raise InvalidRequest(f"spin_us = {spin_us} is invalid; give microseconds >= 0 (0: no polling)")
        deadline = time.monotonic() + wait_s
        client = cls(
            path or await discover(deadline), name, expect_uid, copy_path, reconnect_s, retry_copies, ring, spin_us
        )
        try:
            await client._open(max(0.0, deadline - time.monotonic()))
        except BaseException:
            await client.close()
            raise
        return client

    async def _open(self, wait_s: float) -> None:
        start = time.monotonic()
        deadline = start + wait_s
        busy_deadline = start + max(wait_s, BUSY_WAIT_S)
        busy_sleep = 0.002
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                # A Unix stream connect completes at once or fails; it is never "in progress".
                # With the daemon's listen backlog full it fails with EAGAIN, which asyncio's
                # sock_connect takes for EINPROGRESS and then reports as connected.
                sock.connect(self.path)
                check_owner(sock, self.path, self.expect_uid)
                break
            except PermissionError as exc:
                sock.close()
                raise no_permission(self.path) from exc
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                sock.close()
                if time.monotonic() >= deadline:
                    raise no_daemon(self.path, exc) from exc
                await asyncio.sleep(0.05)
            except BlockingIOError as exc:
                sock.close()
                if time.monotonic() >= busy_deadline:
                    raise ConnectionClosed(
                        f"priod at {self.path} accepted no connection for {time.monotonic() - start:.2f} s: its listen backlog "
                        "is full (EAGAIN), so it is overloaded or stuck; retry later, or pass a longer wait_s"
                    ) from exc
                await asyncio.sleep(busy_sleep)
                busy_sleep = min(busy_sleep * 2, 0.05)
            except PermissionDenied:
                sock.close()
                raise
            except OSError as exc:
                sock.close()
                raise ConnectionClosed(f"cannot connect to priod at {self.path}: {exc}") from exc
        self.generation += 1
        self._closed_exc = None
        self._sock = FramedSocket(sock, max_output=1 << 30, limits=REPLY_LIMITS)
        self._sock.set_listener(functools.partial(self._on_replies, self._sock))
        msg, _ = await self._request(Hello(PROTOCOL_VERSION, self.name or f"pid{os.getpid()}"))
        self._server = check_server(HelloReply.decode(msg), self.path)
        if self._route is not None:
            self._route.close()
        self._route = DirectRoute(self._server.backend)
        self._drop_ring()
        if self.use_ring and self._server.ring == RING_VERSION and ring_supported():
            await self._attach_ring()

    async def _attach_ring(self) -> None:
        """Map the connection's copy ring; on any refusal the socket carries every copy."""
        try:
            _, fds = await self._request(OpenRing())
            ring = ClientRing(fds)
        except (ValueError, OSError, InvalidRequest):
            return
        self._ring = ring
        asyncio.get_running_loop().add_reader(ring.wake_fd, self._on_ring_wake, ring)

    def _on_ring_wake(self, ring: ClientRing) -> None:
        ring.clear_wake()  # first: a completion published after the drain wakes us again
        self._take_completions(ring)

    def _take_completions(self, ring: ClientRing) -> None:
        for req_id, msg in ring.completions():
            self._copies.pop(req_id, None)
            self._published.pop(req_id, None)
            self._landed.pop(req_id, None)
            fut = self._pending.pop(req_id, None)
            if fut is not None and not fut.done():
                fut.set_result((msg, []))

    def _drop_ring(self) -> set[int]:
        """Stop using the ring (the connection is gone): completions already there count first.
        Returns the copies published on it that the daemon never read (its head, which only it
        moves, did not pass them): they never left."""
        ring, self._ring = self._ring, None
        self._landed.clear()
        untaken: set[int] = set()
        if ring is not None:
            self._take_completions(ring)
            untaken = {rid for rid, seq in self._published.items() if not ring.taken(seq)}
            if not ring.closed:
                asyncio.get_running_loop().remove_reader(ring.wake_fd)
            ring.close()
        self._published.clear()
        return untaken

    def _ring_doorbell(self) -> None:
        if self._ring_due == RING_DUE and self._ring is not None:
            self._ring.ring()
        self._ring_due = 0

    def _spin_for(self, req_id: int, fut: asyncio.Future[Reply]) -> None:
        """Ring the doorbell now and poll the ring for ``fut``'s completion for `spin_us` (an
        error's reply comes on the socket, read once the caller awaits), and an urgent copy's
        landed word (`ClientRing.landed_reply`): the GPU stores it as the bytes land."""
        ring = self._ring
        landed = self._landed.pop(req_id, None)
        if ring is None or fut.done():
            return
        seq = landed[1] if landed is not None and landed[0] is ring else None
        self._ring_doorbell()
        deadline = time.perf_counter() + self.spin_us / 1e6
        while not fut.done() and time.perf_counter() < deadline:
            if seq is not None and ring.landed(seq):
                reply = ring.landed_reply(seq, req_id, landed[2])  # type: ignore[index]
                if reply is not None:
                    # Answered: the completion that follows finds no one waiting.
                    self._copies.pop(req_id, None)
                    self._published.pop(req_id, None)
                    self._pending.pop(req_id, None)
                    fut.set_result((reply, []))
                    self.landed_replies += 1
                    return
                seq = None  # the slot holds another copy's figures: wait for the completion
            if ring.has_completions():
                self._take_completions(ring)
            else:
                os.sched_yield()  # the daemon may be queued on this CPU: `BlockingFramedSocket.receive_or_wake`

    def _send_copy(self, req: Copy | CopyBatch) -> tuple[int, asyncio.Future[Reply]]:
        """Send a copy or batch: a descriptor on the ring when it can go there, a frame otherwise."""
        ring = self._ring
        if ring is not None and self._closed_exc is None and ring.eligible(req):
            req_id = next(self._ids)
            # An urgent copy that `copy` will spin for (`spin_us`) asks for its landed word.
            landed = self.spin_us > 0 and req.priority == "urgent"
            seq = ring.submit(req_id, req, landed)
            if seq is not None:
                self._published[req_id] = seq
                if landed:
                    self._landed[req_id] = (ring, seq, req)
                loop = asyncio.get_running_loop()
                fut: asyncio.Future[Reply] = loop.create_future()
                self._pending[req_id] = fut
                if not self._ring_due:
                    # The loop turn's first copy rings at once, so that the daemon takes it
                    # while the rest of the turn's copies are written; those ring once more,
                    # together, when the turn ends.
                    self._ring_due = RING_RUNG
                    ring.ring()
                    loop.call_soon(self._ring_doorbell)
                else:
                    self._ring_due = RING_DUE
                return req_id, fut
        return self._send(req)

    async def reconnect(self, wait_s: float = 10.0) -> None:
        """Open a fresh connection by hand (the client does it by itself unless ``reconnect_s``
        is 0). Regions of the old one are gone: allocate them again. Pending requests of the
        old connection have already failed."""
        await self.close()
        self._closing = False
        await self._open(wait_s)

    async def wait_connected(self) -> None:
        """Return once a reconnect under way (if any) has ended; raises if it gave up."""
        task = self._reconnecting
        if task is not None and task is not asyncio.current_task():
            if not task.done():
                await asyncio.shield(task)
            if self._closed_exc is not None:
                raise self._closed_exc

    def _will_reconnect(self, cause: PriodError) -> bool:
        return (
            self.reconnect_s > 0
            and not self._closing
            and self._server is not None
            and cause.code in ("closed", "shutting_down")
        )

    async def _reconnect(self) -> None:
        """Reconnect after a lost connection, register the regions again, then settle the
        copies the lost connection left unanswered. Runs as a task; requests wait for it."""
        start = time.monotonic()
        deadline = start + self.reconnect_s
        attempt = 0
        why: BaseException | None = None
        while not self._closing:
            attempt += 1
            try:
                await self._open(0.0)
                await self._restore()
                break
            except (ConnectionClosed, OSError) as exc:
                why = exc
                if self._sock is not None and self._closed_exc is None:
                    self._lost(ConnectionClosed(f"reconnect attempt failed: {exc}"))
                if time.monotonic() >= deadline:
                    break
                await asyncio.sleep(min(reconnect_sleep(attempt), max(0.0, deadline - time.monotonic())))
            except PriodError as exc:  # refused (permission, version): trying again will not help
                why = exc
                break
        if self._closed_exc is None and not self._closing:
            self.reconnects += 1
            self._settle_orphans(
                f"The client has reconnected (in {time.monotonic() - start:.2f} s) and registered its regions again.",
                retry=self.retry_copies,
            )
            if self.lost_regions:
                warnings.warn(regions_lost(self.path, self.lost_regions), RegionsLostWarning, stacklevel=1)
            return
        gave_up = ConnectionClosed(
            f"connection to priod at {self.path} lost, and reconnecting failed for {time.monotonic() - start:.1f} s "
            f"(reconnect_s = {self.reconnect_s}): {why}"
        )
        gave_up.__cause__ = why
        if self._sock is not None and self._closed_exc is None:
            self._sock.set_listener(None)
            self._sock.close()
        self._closed_exc = gave_up
        self._settle_orphans(f"The client did not reconnect: {why}.", retry=False)

    async def _restore(self) -> None:
        """Register every region held again (same Region objects, new ids), and share again."""
        lost: list[Region] = []
        for region in list(self._regions):
            req = reregister_request(region)
            if isinstance(req, str):
                region.lost = req
            else:
                try:
                    msg, fds = await self._request(*req)
                    close_fds(fds)
                    region.renew(RegionReply.decode(msg), self.generation)
                    for uid in sorted(region.shared_with):
                        await self._request(Share(region.id, uid))
                    continue
                except ConnectionClosed:
                    raise
                except PriodError as exc:
                    region.lost = f"registering it again failed: {exc}"
            lost.append(region)
        for region in lost:
            self._regions.remove(region)
        self.lost_regions = lost

    def _settle_orphans(self, outcome: str, retry: bool) -> None:
        """Fail (or, with ``retry``, send again) the copies the lost connection left unanswered.
        Those the daemon never took never left: sent again once reconnected (``retry`` or not),
        else failed saying that no byte of them moved (`copy_unsent`)."""
        orphans, self._orphans = self._orphans, {}
        untaken, self._untaken = self._untaken, set()
        for req_id, fut in orphans.items():
            entry = self._copies.pop(req_id, None)
            if fut.done():
                continue
            # Not reconnected (`_closed_exc` set): nothing goes again; the error says what became of it.
            if (retry or req_id in untaken) and self._closed_exc is None and entry is not None:
                req, dst, src = entry
                if req.wait_event is None and req.signal_event is None and dst.lost is None and src.lost is None:
                    try:
                        assert self._sock is not None
                        self._sock.send({**req.encode(req_id), "dst": dst.id, "src": src.id})
                        self._pending[req_id] = fut
                        self._copies[req_id] = entry
                        continue
                    except PriodError:
                        pass
            exc = (copy_unsent if req_id in untaken else copy_lost)(req_id, self.path, outcome)
            exc.__cause__ = self._closed_exc
            fut.set_exception(exc)

    def _on_replies(self, sock: FramedSocket) -> None:
        """The transport's listener: replies resolve their requests in the read callback itself
        (a reader task would cost every reply one more turn of the loop)."""
        if sock is not self._sock or self._closed_exc is not None:
            return
        try:
            while (item := sock.take()) is not None:
                msg, fds = item
                if is_progress(msg):  # not the reply: a copy's signal_event was recorded
                    close_fds(fds)
                    rec = self._recorded.pop(msg.get("id", 0), None)
                    if rec is not None and not rec.done():
                        rec.set_result(None)
                    continue
                if self._recorded:
                    self._recorded.pop(msg.get("id", 0), None)
                if self._copies:
                    self._copies.pop(msg.get("id", 0), None)
                    self._published.pop(msg.get("id", 0), None)
                fut = self._pending.pop(msg.get("id", 0), None) if msg.get("id") else None
                if fut is None or fut.done():
                    close_fds(fds)
                    if fut is None and (exc := error_of(msg)) is not None:
                        # id 0: the daemon refused the connection or closed it for a protocol error
                        raise exc
                    continue
                fut.set_result((msg, fds))
        except PriodError as exc:
            self._lost(exc)
        except Exception as exc:
            self._lost(ProtocolError(f"unexpected error reading replies: {exc!r}"))

    def _lost(self, cause: PriodError) -> None:
        """The connection ended (``cause``): close it and fail every request still waiting."""
        closed = ConnectionClosed(f"connection to priod at {self.path} lost: {cause}")
        closed.__cause__ = cause
        if cause.code != "closed":
            self._closed_exc = cause  # a refusal (permission, limit...) is more useful than "closed"
        else:
            self._closed_exc = closed
        if self._sock is not None:
            self._sock.set_listener(None)
            self._sock.close()
        self._untaken |= self._drop_ring()
        again = self._will_reconnect(cause)
        if again:
            # Copies wait for the reconnect's outcome, which their error then states.
            for req_id in list(self._copies):
                fut = self._pending.pop(req_id, None)
                if fut is not None:
                    self._orphans[req_id] = fut
            self._closed_exc = ConnectionClosed(
                f"connection to priod at {self.path} lost ({cause}); the client is reconnecting "
                f"(for up to reconnect_s = {self.reconnect_s} s): retry the request"
            )
            self._closed_exc.__cause__ = cause
        for req_id, fut in self._pending.items():
            if not fut.done():
                if req_id in self._copies:
                    why = "The client does not reconnect by itself (reconnect_s = 0, or closed)."
                    lost = copy_unsent if req_id in self._untaken else copy_lost
                    exc = lost(req_id, self.path, why)
                    exc.__cause__ = cause
                    fut.set_exception(exc)
                else:
                    fut.set_exception(self._closed_exc)
        self._pending.clear()
        if not again:
            self._copies.clear()
            self._untaken.clear()
        self._recorded.clear()  # their handles see the copy's future fail
        if again and (self._reconnecting is None or self._reconnecting.done()):
            self._reconnecting = asyncio.get_running_loop().create_task(self._reconnect())

    def _send(self, msg: Request | Message, fds: tuple[int, ...] = ()) -> tuple[int, asyncio.Future[Reply]]:
        if self._closed_exc is not None or self._sock is None or self._sock.closed:
            close_fds(list(fds))  # they are ours to close from here on, sent or not
            if self._closed_exc is not None:
                raise self._closed_exc
            raise ConnectionClosed("not connected; use priod.connect() or reconnect()")
        req_id = next(self._ids)
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._pending[req_id] = fut
        self._sock.send(msg.encode(req_id) if not isinstance(msg, dict) else {**msg, "id": req_id}, fds)
        return req_id, fut

    async def _request(self, msg: Request | Message, fds: tuple[int, ...] = ()) -> Reply:
        if self._reconnecting is not None:
            try:
                await self.wait_connected()
            except BaseException:
                close_fds(list(fds))
                raise
        _, fut = self._send(msg, fds)
        reply, got = await fut
        if (exc := error_of(reply)) is not None:
            close_fds(got)
            raise exc
        return reply, got

    async def raw_request(self, msg: Message) -> Message:
        """Send ``msg`` as it is (an ``id`` is added) and return the reply's fields; raises the
        error an error reply stands for. For tools and protocol tests; fds that come back are closed."""
        reply, fds = await self._request(msg)
        close_fds(fds)
        return reply

    def _region(self, reply: Reply) -> Region:
        msg, fds = reply
        region = Region(RegionReply.decode(msg), fds, self.generation)
        self._regions.append(region)
        return region

    def _check_region(self, *regions: Region) -> None:
        task = self._reconnecting
        if task is not None and not task.done() and task is not asyncio.current_task():
            raise ConnectionClosed(
                f"the client is reconnecting to priod at {self.path} after a lost connection; await wait_connected() "
                "(or any awaited request, which waits by itself) and retry"
            )
        check_regions(self.generation, *regions)

    # -- regions -----------------------------------------------------------------------------
    async def hold_page(self) -> HoldPage:
        """This connection's hold page, for direct urgent copies (`priod.client.direct.DirectCopies`):
        your own DMA, with the daemon holding bulk back on the lane while each is under way."""
        return hold_page(await self._request(OpenHoldPage(doorbell=True)))

    async def alloc_host(self, nbytes: int) -> Region:
        """A host region: a memfd the daemon maps and pins once; ``.array`` is your view of it."""
        return self._region(await self._request(AllocHost(nbytes)))

    async def register_host(self, fd: int, nbytes: int) -> Region:
        """Share your own memfd (sealed with F_SEAL_SHRINK) as a host region. ``fd`` stays yours."""
        msg, got = await self._request(RegisterHost(nbytes), (os.dup(fd),))
        close_fds(got)
        return self._region((msg, [os.dup(fd)]))  # map our own copy, so .array works as for alloc_host

    async def alloc_device(self, nbytes: int, device: int | str = 0) -> Region:
        """Device memory the daemon allocates; sim: ``.array`` maps it; cuda: ``.cuda()`` opens it.

        ``device``: the GPU's UUID (``GPU-...``; `priod.client.cuda_ipc.gpu_uuid` gives it for one of
        your ordinals), or the daemon's ordinal of it. Name it by UUID wherever your
        CUDA_VISIBLE_DEVICES may differ from the daemon's (containers): your ordinal 0 may be
        the daemon's gpu3.
        """
        return self._region(await self._request(alloc_device_request(nbytes, device)))

    async def register_device(self, obj: Any) -> Region:
        """Share your own GPU buffer: a CUDA tensor of any dtype (PyTorch's caching allocator in
        its default mode, or with expandable segments: then the buffer must lie within one of
        its pages), or anything with ``__cuda_array_interface__``, also memory of a
        stream-ordered pool created with POSIX fd handles (``cudaMallocAsync`` from a
        shareable pool; a device's default pool is not). The region holds a reference to it
        until `free`; tensors viewing it then name it in `copy_tensor`."""
        req, fds = cuda_register_request(obj)  # the fd of cuMemCreate or pool memory: closed once sent
        return self._region(await self._request(req, fds)).holding(obj)

    async def free(self, region: Region) -> None:
        if region.lost is not None:  # gone with the daemon already: nothing to free there
            region.unmap()
            return
        await self.wait_connected()
        self._check_region(region)
        if self._route is not None:
            self._route.forget(region)
        await self._request(Free(region.id))
        region.unmap()
        if region in self._regions:
            self._regions.remove(region)

    async def share(self, region: Region, uid: int) -> None:
        """Let connections of ``uid`` name this region in their copies (not free or share it)."""
        await self.wait_connected()
        self._check_region(region)
        await self._request(Share(region.id, uid))
        region.shared_with.add(uid)

    # -- copies ------------------------------------------------------------------------------
    def start_copy(
        self, dst: Region, src: Region, nbytes: int | None = None, **options: Unpack[CopyOptions]
    ) -> CopyHandle:
        """Send a copy and return at once; await the handle for its result.

        ``nbytes`` defaults to as much as both regions hold past their offsets; the direction
        comes from the regions' kinds.
        """
        self._check_region(dst, src)
        req = copy_request(dst, src, nbytes, options)
        req_id, fut = self._send_copy(req)
        self._copies[req_id] = (req, dst, src)
        return CopyHandle(self, req_id, fut, self._expect_record(req_id, req.signal_event))

    def start_copy_batch(self, dst: Region, src: Region, segments: Any, **options: Unpack[BatchOptions]) -> BatchHandle:
        """Send many copies between ``src`` and ``dst`` as one request and return at once.

        ``segments``: an (N, 3) integer array or a sequence of ``(dst_offset, src_offset,
        nbytes)`` triples, at most ``priod.wire.batch.MAX_SEGMENTS`` of them; every segment must fit
        its region, and no two destination segments (nor, in one memory, a destination and a
        source segment) may overlap. The daemon checks all of them before queuing any, and
        schedules the batch as one copy of its class. One reply: total bytes, segment count,
        timings. Cancelled or failed, the error's ``segments_done`` says how many of the first
        segments landed whole.
        """
        self._check_region(dst, src)
        req = batch_request(dst, src, segments, options, self.server.max_frame_bytes)
        req_id, fut = self._send_copy(req)
        self._copies[req_id] = (req, dst, src)
        return BatchHandle(self, req_id, fut, self._expect_record(req_id, req.signal_event))

    def _expect_record(self, req_id: int, signal_event: bytes | None) -> asyncio.Future[None] | None:
        if signal_event is None:
            return None
        fut = self._recorded[req_id] = asyncio.get_running_loop().create_future()
        return fut

    async def copy(
        self,
        dst: Region,
        src: Region,
        nbytes: int | None = None,
        *,
        timeout: float | None = None,
        path: CopyPath | None = None,
        **options: Unpack[CopyOptions],
    ) -> CopyResult:
        """Copy ``nbytes`` from ``src`` to ``dst`` and wait for it.

        ``path``: an urgent copy that this process can make itself takes the direct path by
        default ("auto"; `priod.client.route` says when it can): its own copy, while the daemon
        holds bulk back; the result's ``path`` is then "direct", and the copy cannot be
        cancelled once begun. Every other copy goes through the daemon (``path`` "dma" or
        "express"), as `start_copy`. "direct" or "daemon" forces one; a forced direct copy that
        this process cannot make raises `InvalidRequest` saying why. Default: ``copy_path`` of
        `connect`.

        After a lost connection it waits for the client's reconnect first (``reconnect_s``).
        Through the daemon, with ``timeout`` (seconds), a copy still unfinished then is
        cancelled there and `CopyTimeout` raised, carrying ``bytes_done``. If the awaiting task
        is cancelled, the copy is cancelled in the daemon too.
        """
        if self._reconnecting is not None:
            await self.wait_connected()
        route = await self._direct_route(dst, src, options, path)
        if route is not None:
            dst_offset, src_offset = options.get("dst_offset", 0), options.get("src_offset", 0)
            size = min(dst.nbytes - dst_offset, src.nbytes - src_offset) if nbytes is None else nbytes
            if size <= INLINE_DIRECT_BYTES:
                return route.copy(dst, src, nbytes, dst_offset, src_offset)
            return await asyncio.to_thread(route.copy, dst, src, nbytes, dst_offset, src_offset)
        handle = self.start_copy(dst, src, nbytes, **options)
        if self.spin_us > 0:
            self._spin_for(handle.id, handle._future)
        return await self._wait(handle, timeout)

    async def copy_batch(
        self,
        dst: Region,
        src: Region,
        segments: Any,
        *,
        timeout: float | None = None,
        path: CopyPath | None = None,
        **options: Unpack[BatchOptions],
    ) -> BatchResult:
        """Copy every segment and wait for the batch (see `start_copy_batch`; ``timeout`` as
        for `copy`, the `CopyTimeout` carrying ``segments_done`` too; ``path`` as for `copy`)."""
        if self._reconnecting is not None:
            await self.wait_connected()
        route = await self._direct_route(dst, src, options, path)
        if route is not None:
            table = route.check_batch(dst, src, segments)
            if table.total <= INLINE_DIRECT_BYTES:
                return route.copy_batch(dst, src, table)
            return await asyncio.to_thread(route.copy_batch, dst, src, table)
        handle = self.start_copy_batch(dst, src, segments, **options)
        if self.spin_us > 0:
            self._spin_for(handle.id, handle._future)
        return await self._wait(handle, timeout)

    async def _direct_route(self, dst: Region, src: Region, options: Any, path: CopyPath | None) -> DirectRoute | None:
        """The direct route where this copy takes it, else None (see `copy`)."""
        choice = check_copy_path(path or self.copy_path)
        route = self._route
        if choice == "daemon" or route is None:
            return None
        self._check_region(dst, src)
        if not route.has_page:
            why = route.eligible(dst, src, options)
            if why is not None:
                if choice == "direct":
                    raise InvalidRequest(f"this copy cannot take the direct path: {why}")
                return None
            route.set_page(await self.hold_page())
        return route if route.takes(dst, src, options, choice) else None

    # -- tensors (priod.client.torch_face) ----------------------------------------------------------
    def start_copy_tensor(self, dst: Any, src: Any, **options: Unpack[BatchOptions]) -> CopyHandle:
        """Copy tensor ``src`` into tensor ``dst`` (any dtypes, the same number of bytes; each a
        contiguous view of a region of this connection: `Region.torch`, or a tensor given to
        `register_device`) and return at once. The copy moves bytes: make sure the kernels that
        wrote ``src`` have finished (``torch.cuda.current_stream().synchronize()``)."""
        d, s = tensor_copy(dst, src, self._regions)
        return self.start_copy(d.region, s.region, d.nbytes, dst_offset=d.offset, src_offset=s.offset, **options)

    async def copy_tensor(
        self,
        dst: Any,
        src: Any,
        *,
        timeout: float | None = None,
        path: CopyPath | None = None,
        **options: Unpack[BatchOptions],
    ) -> CopyResult:
        """`start_copy_tensor` and wait for it (``timeout`` and ``path`` as for `copy`)."""
        d, s = tensor_copy(dst, src, self._regions)
        return await self.copy(
            d.region,
            s.region,
            d.nbytes,
            dst_offset=d.offset,
            src_offset=s.offset,
            timeout=timeout,
            path=path,
            **options,
        )

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
    ) -> BatchHandle:
        """Copy block ``src_ids[i]`` of ``src`` to block ``dst_ids[i]`` of ``dst`` as one
        `start_copy_batch`. ``dst``, ``src``: paged caches as tensors viewing regions (blocks
        along ``block_dim``; K/V or layer dimensions before it) or regions holding blocks of
        ``block_bytes`` end to end (`priod.client.torch_face.block_segments`)."""
        d, s, segments = block_segments(
            dst, src, dst_ids, src_ids, self._regions, block_dim=block_dim, block_bytes=block_bytes
        )
        return self.start_copy_batch(d, s, segments, **options)

    async def copy_blocks(
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
        """`start_copy_blocks` and wait for it (``timeout`` and ``path`` as for `copy_batch`)."""
        d, s, segments = block_segments(
            dst, src, dst_ids, src_ids, self._regions, block_dim=block_dim, block_bytes=block_bytes
        )
        return await self.copy_batch(d, s, segments, timeout=timeout, path=path, **options)

    async def _wait(self, handle: _Handle[R], timeout: float | None) -> R:
        try:
            return await handle.wait(timeout)
        except asyncio.CancelledError:
            if self._sock is not None and not self._sock.closed and self._closed_exc is None:
                try:
                    self._send(Cancel(handle.id))
                except PriodError:
                    pass
            raise

    async def status(self) -> dict[str, Any]:
        msg, _ = await self._request(StatusRequest())
        return StatusReply.decode(msg).status

    async def ping(self) -> None:
        await self._request(Ping())

    async def close(self) -> None:
        """Close the connection; the daemon releases this connection's regions."""
        self._closing = True
        task, self._reconnecting = self._reconnecting, None
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()
            await asyncio.wait([task])
        if self._orphans:
            self._settle_orphans("The client was closed while reconnecting.", retry=False)
        if self._route is not None:
            self._route.close()
            self._route = None
        if self._sock is not None and self._closed_exc is None:
            self._lost(ConnectionClosed("connection closed by this client"))
        if self._sock is not None:
            self._sock.close()
        for region in self._regions:
            region.unmap()
        self._regions.clear()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


class _Connecting:
    """What `connect` returns: await it for a `Client`, or use it with ``async with``."""

    def __init__(
        self,
        path: str | None,
        name: str,
        wait_s: float,
        expect_uid: int | None,
        copy_path: CopyPath,
        reconnect_s: float = 30.0,
        retry_copies: bool = False,
        ring: bool = True,
        spin_us: float = 0.0,
    ) -> None:
        self._args = (path, name, wait_s, expect_uid, copy_path, reconnect_s, retry_copies, ring, spin_us)
        self._client: Client | None = None

    def __await__(self) -> Generator[Any, None, Client]:
        path, name, wait_s, expect_uid, copy_path, reconnect_s, retry_copies, ring, spin_us = self._args
        return Client.connect(
            path,
            name=name,
            wait_s=wait_s,
            expect_uid=expect_uid,
            copy_path=copy_path,
            reconnect_s=reconnect_s,
            retry_copies=retry_copies,
            ring=ring,
            spin_us=spin_us,
        ).__await__()

    async def __aenter__(self) -> Client:
        self._client = await self
        return self._client

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._client is not None:
            await self._client.close()


def connect(
    path: str | None = None,
    *,
    name: str = "",
    wait_s: float = 0.0,
    expect_uid: int | None = None,
    copy_path: CopyPath = "auto",
    reconnect_s: float = 30.0,
    retry_copies: bool = False,
    ring: bool = True,
    spin_us: float = 0.0,
) -> _Connecting:
    """Connect to the daemon at ``path`` (default: the first that exists of $PRIOD_SOCKET,
    $XDG_RUNTIME_DIR/priod.sock, /run/priod/priod.sock; `priod.common.socket_path.find_socket`);
    with ``expect_uid``, only to a daemon whose process runs as that uid (see `Client.connect`);
    ``copy_path``: the connection's default for `Client.copy`'s ``path``; ``reconnect_s`` and
    ``retry_copies``: what the client does when the connection is lost, ``ring``: whether plain
    copies go through the shared-memory copy ring, ``spin_us``: how long `Client.copy` polls the
    ring before it awaits (see `Client.connect`)."""
    if reconnect_s < 0:
        raise InvalidRequest(f"reconnect_s = {reconnect_s} is invalid; give seconds >= 0 (0: never reconnect)")
    return _Connecting(
        path, name, wait_s, expect_uid, check_copy_path(copy_path), reconnect_s, retry_copies, ring, spin_us
    )


# The blocking client lives in sync_client.py; both are importable from here, as from `priod`.
