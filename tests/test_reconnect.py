"""A daemon restart under clients that hold regions (sim engine): the clients reconnect by
themselves, register their regions again and carry on with the same `Region` objects; no
region's bytes change; a copy pending at the restart fails saying what may have happened (or
is sent again with ``retry_copies``), never with a false success (docs/reliability.md, "What
survives a daemon restart")."""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np
import pytest

import priod
from priod.client.base import RegionsLostWarning
from priod.testing import DaemonProcess, daemon_process, wait_until
from priod.wire.messages import PROTOCOL_VERSION, RegisterDevice
from priod.wire.transport import BlockingFramedSocket

MiB = 1 << 20
BIG = 48 * MiB
"""The pending copy's size: at [sim] h2d_gbps = 0.25 it takes ~200 ms, so it is under way at the kill."""
ENV = {"PRIOD_LOG__LEVEL": '"warning"', "PRIOD_SIM__H2D_GBPS": "0.25", "PRIOD_SERVICE__SHUTDOWN": '"cancel"'}
LOST_COPY = (
    r"^copy \d+ was sent to priod at .* and the connection was lost before its reply: it may have moved some or all of its "
    r"bytes, or none, and did not report success\. Re-submitting it is safe when its source and destination do not overlap "
    r"\(always so between a host and a device region\)\. "
)
RECONNECTED = LOST_COPY + r"The client has reconnected \(in [\d.]+ s\) and registered its regions again\.$"


def pattern(seed: int, n: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def sealed(nbytes: int) -> int:
    fd = os.memfd_create("test-reconnect", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return fd


@contextmanager
def restartable(env: dict[str, str] | None = None) -> Iterator[tuple[str, ExitStack, DaemonProcess]]:
    """A daemon on a socket path that a second one can take over: (path, stack, first daemon)."""
    path = os.path.join(tempfile.mkdtemp(prefix="priod-reconnect-"), "priod.sock")
    with ExitStack() as stack:
        first = stack.enter_context(daemon_process(env or ENV, socket_path=path))
        yield path, stack, first


async def one_read_one_not(
    c: priod.Client, path: str, first: DaemonProcess
) -> tuple[priod.CopyHandle, priod.CopyHandle, priod.Region, priod.Region]:
    """Start a copy the daemon at ``path`` takes (`BIG`, ~200 ms at the sim's 0.25 GB/s), stop
    the daemon (SIGSTOP: alive, but reading nothing more), publish a 1 MiB copy it never reads,
    and kill it: (the copy it took, the one it never read, that one's destination and source,
    its source filled)."""
    h, d = await c.alloc_host(MiB), await c.alloc_device(MiB)
    big_h, big_d = await c.alloc_host(BIG), await c.alloc_device(BIG)
    assert h.array is not None and d.array is not None
    taken = c.start_copy(big_d, big_h)
    async with priod.connect(path) as other:
        deadline = time.monotonic() + 30
        while not any(x["pending"] for x in (await other.status())["clients"]):
            assert time.monotonic() < deadline, "the big copy was never taken"
            await asyncio.sleep(0.01)
    first.proc.send_signal(signal.SIGSTOP)
    h.array[:] = pattern(42, MiB)
    untaken = c.start_copy(d, h)
    await stop(first, "SIGKILL")
    return taken, untaken, d, h


def snapshot(*regions: priod.Region) -> list[bytes]:
    out = []
    for r in regions:
        assert r.array is not None
        out.append(r.array.tobytes())
    return out


async def stop(d: DaemonProcess, how: str) -> None:
    sig = signal.SIGKILL if how == "SIGKILL" else signal.SIGTERM
    await asyncio.get_running_loop().run_in_executor(None, d.stop, sig)


def check_pending(outcome: BaseException | priod.CopyResult, dst: priod.Region, src: priod.Region) -> None:
    """A copy pending at the restart: failed saying so, or succeeded and its bytes are there."""
    if isinstance(outcome, priod.CopyResult):
        assert dst.array is not None and src.array is not None
        assert np.array_equal(dst.array, src.array), "a copy reported done whose bytes did not land"
    elif isinstance(outcome, priod.ShuttingDown):
        pass  # SIGTERM: the daemon refused it before running it
    else:
        assert isinstance(outcome, priod.ConnectionClosed), repr(outcome)
        with pytest.raises(priod.ConnectionClosed, match=RECONNECTED):
            raise outcome


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
async def test_async_client_carries_on_with_its_regions_after_restart(how: str) -> None:
    with restartable() as (path, stack, first):
        async with priod.connect(path, name="survivor") as c:
            h, d = await c.alloc_host(MiB), await c.alloc_device(MiB)
            fd = sealed(MiB)
            try:
                r = await c.register_host(fd, MiB)
            finally:
                os.close(fd)
            big_h, big_d = await c.alloc_host(BIG), await c.alloc_device(BIG)
            assert h.array is not None and d.array is not None and r.array is not None and big_h.array is not None
            h.array[:] = pattern(1, MiB)
            await c.copy(d, h)
            r.array[:] = pattern(2, MiB)
            big_h.array[:] = pattern(3, BIG)
            await c.share(h, os.getuid() + 1)
            before = snapshot(h, d, r, big_h)
            old_ids = [x.id for x in (h, d, r, big_h, big_d)]

            pending = c.start_copy(big_d, big_h)
            await stop(first, how)
            after_kill = snapshot(big_d)  # the daemon is gone: nothing writes into it any more
            assert snapshot(h, d, r, big_h) == before
            stack.enter_context(daemon_process(ENV, socket_path=path))
            listening = time.monotonic()

            outcome: BaseException | priod.CopyResult
            try:
                outcome = await asyncio.wait_for(pending, 30)
            except priod.PriodError as exc:
                outcome = exc
            check_pending(outcome, big_d, big_h)
            if not isinstance(outcome, priod.CopyResult):
                assert snapshot(big_d) == after_kill, "the restart changed a region's bytes"

            h.array[:] = pattern(4, MiB)
            res = await c.copy(d, h)  # the same Region objects, as they were
            first_copy_s = time.monotonic() - listening
            assert res.nbytes == MiB and np.array_equal(d.array, h.array)
            assert first_copy_s < 5, f"the first copy after the restart took {first_copy_s:.2f} s"
            assert c.reconnects == 1 and c.lost_regions == []
            assert all(x.generation == c.generation for x in (h, d, r, big_h, big_d))
            assert snapshot(r, big_h) == before[2:], "the restart changed a region's bytes"
            assert len(c.regions) == 5 and {x.id for x in c.regions} <= set(range(1, 6)), (old_ids, c.regions)
            assert h.shared_with == {os.getuid() + 1}

            await c.copy(r, d)  # d2h into the registered memfd
            assert np.array_equal(r.array, h.array)
            big_h.array[:MiB] = pattern(5, MiB)
            await c.copy(big_d, big_h, MiB)
            assert big_d.array is not None and np.array_equal(big_d.array[:MiB], big_h.array[:MiB])
            h.array[:] = pattern(6, MiB)
            urgent = await c.copy(d, h, priority="urgent")  # the direct path: the new daemon's hold page
            assert urgent.path == "direct" and np.array_equal(d.array, h.array)
            status = await c.status()
            assert status is not None


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_sync_client_carries_on_with_its_regions_after_restart(how: str) -> None:
    with restartable() as (path, stack, first), priod.SyncClient(path, name="sync-survivor") as c:
        h, d = c.alloc_host(MiB), c.alloc_device(MiB)
        big_h, big_d = c.alloc_host(BIG), c.alloc_device(BIG)
        assert h.array is not None and d.array is not None and big_h.array is not None
        h.array[:] = pattern(11, MiB)
        c.copy(d, h)
        big_h.array[:] = pattern(12, BIG)
        before = snapshot(h, d, big_h)

        pending = c.start_copy(big_d, big_h)
        first.stop(signal.SIGKILL if how == "SIGKILL" else signal.SIGTERM)
        after_kill = snapshot(big_d)
        stack.enter_context(daemon_process(ENV, socket_path=path))
        listening = time.monotonic()

        outcome: BaseException | priod.CopyResult
        try:
            outcome = pending.wait(30)
        except priod.PriodError as exc:
            outcome = exc
        check_pending(outcome, big_d, big_h)
        if not isinstance(outcome, priod.CopyResult):
            assert snapshot(big_d) == after_kill
        assert snapshot(h, d, big_h) == before, "the restart changed a region's bytes"

        h.array[:] = pattern(13, MiB)
        c.copy(d, h)
        first_copy_s = time.monotonic() - listening
        assert np.array_equal(d.array, h.array)
        assert first_copy_s < 5, f"the first copy after the restart took {first_copy_s:.2f} s"
        assert c.reconnects == 1 and c.lost_regions == []
        back = c.alloc_host(MiB)
        c.copy(back, d)
        assert back.array is not None and np.array_equal(back.array, h.array)
        h.array[:] = pattern(14, MiB)
        assert c.copy(d, h, priority="urgent").path == "direct" and np.array_equal(d.array, h.array)


def test_sync_client_finds_the_loss_at_its_next_copy() -> None:
    """Nothing pending at the restart: the next blocking copy reconnects first, then runs."""
    with restartable() as (path, stack, first), priod.SyncClient(path, name="sync-next") as c:
        h, d = c.alloc_host(MiB), c.alloc_device(MiB)
        assert h.array is not None and d.array is not None
        first.stop(signal.SIGKILL)
        stack.enter_context(daemon_process(ENV, socket_path=path))
        h.array[:] = pattern(21, MiB)
        c.copy(d, h)  # sent on the dead connection or not: either way it lands or says why
        assert np.array_equal(d.array, h.array) and c.reconnects == 1


def test_sync_copy_on_the_ring_goes_again_only_if_the_dead_daemon_never_took_it() -> None:
    """A blocking client publishes a copy on its ring without a system call, so a daemon that has
    died does not refuse it as a socket would refuse a frame. After the reconnect, a descriptor
    the dead daemon never read (its head never passed it) goes again by itself, as a frame that
    failed to send does, and lands; one it had read fails as lost (no ``retry_copies``), never
    sent again behind the caller's back."""
    with restartable() as (path, stack, first), priod.SyncClient(path, copy_path="daemon") as c:
        h, d = c.alloc_host(MiB), c.alloc_device(MiB)
        big_h, big_d = c.alloc_host(BIG), c.alloc_device(BIG)
        assert h.array is not None and d.array is not None
        taken = c.start_copy(big_d, big_h)  # ~200 ms at the sim's 0.25 GB/s
        with priod.SyncClient(path) as other:
            wait_until(lambda: any(x["pending"] for x in other.status()["clients"]), what="the big copy taken")
        first.proc.send_signal(signal.SIGSTOP)  # alive, but reads nothing more
        h.array[:] = pattern(41, MiB)
        untaken = c.start_copy(d, h)
        first.stop(signal.SIGKILL)
        stack.enter_context(daemon_process(ENV, socket_path=path))
        result = untaken.wait(30)
        assert result.nbytes == MiB and np.array_equal(d.array, h.array)
        with pytest.raises(priod.ConnectionClosed, match=RECONNECTED):
            taken.wait(30)
        assert c.reconnects == 1


async def test_async_copy_on_the_ring_goes_again_only_if_the_dead_daemon_never_took_it() -> None:
    """The asyncio client as the blocking one above: after the reconnect, a ring descriptor the
    dead daemon never read goes again by itself and lands; one it had read fails as lost."""
    with restartable() as (path, stack, first):
        async with priod.connect(path, copy_path="daemon") as c:
            taken, untaken, d, h = await one_read_one_not(c, path, first)
            stack.enter_context(daemon_process(ENV, socket_path=path))
            result = await asyncio.wait_for(untaken, 30)
            assert d.array is not None and h.array is not None
            assert result.nbytes == MiB and np.array_equal(d.array, h.array)
            with pytest.raises(priod.ConnectionClosed, match=RECONNECTED):
                await asyncio.wait_for(taken, 30)
            assert c.reconnects == 1


async def test_without_a_reconnect_a_copy_the_daemon_never_read_says_no_byte_moved() -> None:
    """``reconnect_s=0``: the ring copy the dead daemon never read fails saying it never reached
    the daemon and moved nothing; the one it had read fails as possibly moved."""
    with restartable() as (path, _, first):
        async with priod.connect(path, copy_path="daemon", reconnect_s=0) as c:
            taken, untaken, _, _ = await one_read_one_not(c, path, first)
            unsent = (
                rf"^connection to priod at {path} lost: copy \d+ never reached the daemon, and no byte of it moved\. "
            )
            with pytest.raises(priod.ConnectionClosed, match=unsent):
                await asyncio.wait_for(untaken, 30)
            with pytest.raises(priod.ConnectionClosed, match=LOST_COPY):
                await asyncio.wait_for(taken, 30)


async def test_retry_copies_sends_the_pending_copy_again() -> None:
    with restartable() as (path, stack, first):
        async with priod.connect(path, name="retrier", retry_copies=True) as c:
            big_h, big_d = await c.alloc_host(BIG), await c.alloc_device(BIG)
            assert big_h.array is not None and big_d.array is not None
            big_h.array[:] = pattern(31, BIG)
            pending = c.start_copy(big_d, big_h)
            await stop(first, "SIGKILL")
            stack.enter_context(daemon_process(ENV, socket_path=path))
            res = await asyncio.wait_for(pending, 30)
            assert res.nbytes == BIG and np.array_equal(big_d.array, big_h.array)


def test_sync_retry_copies_sends_the_pending_copy_again() -> None:
    with restartable() as (path, stack, first), priod.SyncClient(path, retry_copies=True) as c:
        big_h, big_d = c.alloc_host(BIG), c.alloc_device(BIG)
        assert big_h.array is not None and big_d.array is not None
        big_h.array[:] = pattern(32, BIG)
        pending = c.start_copy(big_d, big_h)
        first.stop(signal.SIGKILL)
        stack.enter_context(daemon_process(ENV, socket_path=path))
        assert pending.wait(30).nbytes == BIG and np.array_equal(big_d.array, big_h.array)


async def test_reconnect_off_keeps_the_connection_closed() -> None:
    with restartable() as (path, stack, first):
        async with priod.connect(path, name="by-hand", reconnect_s=0) as c:
            big_h, big_d = await c.alloc_host(BIG), await c.alloc_device(BIG)
            pending = c.start_copy(big_d, big_h)
            await stop(first, "SIGKILL")
            with pytest.raises(
                priod.ConnectionClosed,
                match=LOST_COPY + r"The client does not reconnect by itself \(reconnect_s = 0, or closed\)\.$",
            ):
                await asyncio.wait_for(pending, 30)
            stack.enter_context(daemon_process(ENV, socket_path=path))
            with pytest.raises(priod.ConnectionClosed, match=r"^connection to priod at .* lost: "):
                await c.ping()
            assert c.reconnects == 0


def test_sync_reconnect_off_keeps_the_connection_closed() -> None:
    with restartable() as (path, stack, first), priod.SyncClient(path, reconnect_s=0) as c:
        h, d = c.alloc_host(MiB), c.alloc_device(MiB)
        first.stop(signal.SIGKILL)
        stack.enter_context(daemon_process(ENV, socket_path=path))
        with pytest.raises(priod.ConnectionClosed):
            c.copy(d, h)
        with pytest.raises(priod.ConnectionClosed, match=r"^connection to priod at .* lost: "):
            c.ping()
        assert c.reconnects == 0


@pytest.mark.parametrize("op", ["ping", "copy", "wait_recorded"])
def test_sync_client_without_reconnect_raises_connection_closed_naming_the_socket(op: str) -> None:
    """With reconnect_s=0, a SyncClient whose daemon was SIGKILLed raises `ConnectionClosed`
    naming the socket path (never a bare BrokenPipeError or ConnectionResetError) on its next
    request: a ping, a blocking copy, or waiting for a held copy's signal_event to be recorded
    (blocked in a read when the daemon dies); and keeps raising it."""
    from priod.wire.ipc_event import SimEvent

    with restartable() as (path, _, first), priod.SyncClient(path, reconnect_s=0, copy_path="daemon") as c:
        h, d, evr = c.alloc_host(MiB), c.alloc_device(MiB), c.alloc_device(4096)
        at = rf"^connection to priod at {path} lost: "
        if op == "wait_recorded":
            never = SimEvent(evr, 0)
            never.record()
            held = c.start_copy(d, h, wait_event=never, signal_event=SimEvent(evr, 1))
            threading.Timer(0.2, first.stop, (signal.SIGKILL,)).start()
            with pytest.raises(priod.ConnectionClosed, match=LOST_COPY) as info:
                held.wait_recorded(timeout=10)
            assert path in str(info.value)
        else:
            first.stop(signal.SIGKILL)
            with pytest.raises(priod.ConnectionClosed, match=at) as info:
                c.ping() if op == "ping" else c.copy(d, h)
            assert not isinstance(info.value, OSError)
        with pytest.raises(priod.ConnectionClosed, match=at):
            c.ping()
        assert c.reconnects == 0


def test_blocking_transport_turns_a_dead_peer_into_connection_closed() -> None:
    """`BlockingFramedSocket` raises `ConnectionClosed` naming its peer for a reset, a broken
    pipe and an end of stream alike, with the OS error as the cause."""
    a, b = socket.socketpair()
    framed = BlockingFramedSocket(a, peer="/run/priod/priod.sock")
    try:
        framed.send({"id": 1, "op": "ping"})
        b.close()  # with our frame unread: the read sees a reset
        at = r"^connection to priod at /run/priod/priod\.sock lost: "
        with pytest.raises(priod.ConnectionClosed, match=at + r"\[Errno 104\]") as reset:
            framed.receive()
        assert isinstance(reset.value.__cause__, ConnectionResetError)
        with pytest.raises(priod.ConnectionClosed, match=at + r"\[Errno 32\]") as pipe:
            framed.send({"id": 2, "op": "ping"})
        assert isinstance(pipe.value.__cause__, BrokenPipeError)
        with pytest.raises(priod.ConnectionClosed, match=at + r"the daemon closed the connection$"):
            framed.receive_within(1.0)
    finally:
        framed.close()


async def test_regions_past_the_new_daemons_limits_are_reported() -> None:
    with restartable() as (path, stack, first):
        async with priod.connect(path, name="crowded") as c:
            regions = [await c.alloc_host(MiB), await c.alloc_device(MiB), await c.alloc_host(MiB)]
            await stop(first, "SIGKILL")
            with pytest.warns(
                RegionsLostWarning, match=r"1 region\(s\) could not be registered again: .*max_regions = 2"
            ):
                stack.enter_context(daemon_process({**ENV, "PRIOD_LIMITS__MAX_REGIONS": "2"}, socket_path=path))
                await c.ping()
            h, d, lost = regions
            assert c.lost_regions == [lost] and lost.lost is not None and lost not in c.regions
            with pytest.raises(
                priod.ConnectionClosed, match=r"did not come back after the daemon restarted: .*max_regions"
            ):
                await c.copy(d, lost)
            assert h.array is not None and d.array is not None
            h.array[:] = pattern(41, MiB)
            await c.copy(d, h)
            assert np.array_equal(d.array, h.array)
            await c.free(lost)  # nothing to free in the daemon: only unmapped here


def test_sync_regions_past_the_new_daemons_limits_are_reported() -> None:
    with restartable() as (path, stack, first), priod.SyncClient(path) as c:
        h, d, lost = c.alloc_host(MiB), c.alloc_device(MiB), c.alloc_device(MiB)
        first.stop(signal.SIGKILL)
        stack.enter_context(daemon_process({**ENV, "PRIOD_LIMITS__MAX_REGIONS": "2"}, socket_path=path))
        with pytest.warns(RegionsLostWarning, match=r"max_regions = 2"):
            c.ping()
        assert c.lost_regions == [lost]
        with pytest.raises(priod.ConnectionClosed, match=r"did not come back after the daemon restarted"):
            c.copy(lost, h)
        c.copy(d, h)


def test_sim_device_memfd_registers_like_a_host_memfd(daemon: DaemonProcess) -> None:
    """register_device of kind "memfd" (how a sim device region comes back): checked as host memfds are."""
    with priod.SyncClient(daemon.socket_path) as c:
        fd = os.memfd_create("unsealed", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, MiB)
        try:
            with pytest.raises(priod.InvalidRequest, match=r"^seal the memfd against shrinking first"):
                c._request(RegisterDevice(b"", MiB, kind="memfd", size=MiB), (fd,))
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
            with pytest.raises(priod.InvalidRequest, match=r"past the allocation's size"):
                c._request(RegisterDevice(b"", 2 * MiB, kind="memfd", size=MiB), (fd,))
            reply, _ = c._request(RegisterDevice(b"", MiB, kind="memfd", size=MiB), (fd,))
            assert reply["kind"] == "device"
        finally:
            os.close(fd)


def test_daemon_refuses_another_protocol_version(daemon: DaemonProcess) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(daemon.socket_path)
    conn = BlockingFramedSocket(s)
    try:
        conn.send({"id": 1, "op": "hello", "v": PROTOCOL_VERSION + 1})
        reply, _ = conn.receive()
        with pytest.raises(
            priod.InvalidRequest,
            match=rf"^protocol version {PROTOCOL_VERSION + 1} is not supported; this daemon speaks",
        ):
            raise _error(reply)
    finally:
        conn.close()


def _error(reply: dict[str, Any]) -> BaseException:
    from priod.wire.messages import error_of

    exc = error_of(reply)
    assert exc is not None, reply
    return exc


@contextmanager
def fake_daemon(version: int) -> Iterator[str]:
    """A socket that answers hello as a daemon of protocol ``version`` would."""
    path = os.path.join(tempfile.mkdtemp(prefix="priod-fake-"), "fake.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(4)

    def serve() -> None:
        while True:
            try:
                s, _ = server.accept()
            except OSError:
                return
            conn = BlockingFramedSocket(s)
            try:
                msg, _ = conn.receive()
                conn.send(
                    {
                        "id": msg["id"],
                        "ok": True,
                        "v": version,
                        "server": "priod",
                        "version": "99.0",
                        "backend": "sim",
                        "max_frame_bytes": 1 << 20,
                        "classes": ["urgent", "normal", "bulk"],
                        "peer": {"uid": os.getuid(), "gid": os.getgid(), "pid": os.getpid()},
                    }
                )
            except priod.PriodError:
                pass
            finally:
                conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield path
    finally:
        server.shutdown(socket.SHUT_RDWR)
        server.close()
        t.join(5)


async def test_clients_refuse_a_daemon_of_another_protocol_version() -> None:
    message = rf"^the priod daemon at .* speaks protocol version {PROTOCOL_VERSION + 1}, this client library version {PROTOCOL_VERSION}"
    with fake_daemon(PROTOCOL_VERSION + 1) as path:
        with pytest.raises(priod.ProtocolError, match=message):
            await priod.connect(path)
        with pytest.raises(priod.ProtocolError, match=message):
            priod.SyncClient(path)


@pytest.mark.parametrize("blocking", [True, False], ids=["SyncClient", "Client"])
def test_the_copy_ring_is_opened_again_after_a_restart(blocking: bool) -> None:
    """A reconnected client asks the new daemon for a copy ring as the first did, and its plain
    copies and batches go there again (the new daemon counts them as ring completions)."""

    def ring_completions(st: dict[str, Any]) -> int:
        return sum(x["ring_completions"] or 0 for x in st["clients"])

    with restartable() as (path, stack, first):
        if blocking:
            with priod.SyncClient(path) as c:
                h, d = c.alloc_host(MiB), c.alloc_device(MiB)
                c.copy(d, h)
                assert ring_completions(c.status()) == 1
                first.stop(signal.SIGKILL)
                stack.enter_context(daemon_process(ENV, socket_path=path))
                c.copy(d, h)
                c.copy_batch(d, h, [(0, 0, 4096)])
                assert c.reconnects == 1 and ring_completions(c.status()) == 2
            return

        async def main() -> None:
            async with priod.connect(path) as c:
                h, d = await c.alloc_host(MiB), await c.alloc_device(MiB)
                await c.copy(d, h)
                assert ring_completions(await c.status()) == 1
                await stop(first, "SIGKILL")
                stack.enter_context(daemon_process(ENV, socket_path=path))
                await c.wait_connected()
                await c.copy(d, h)
                await c.copy_batch(d, h, [(0, 0, 4096)])
                assert c.reconnects == 1 and ring_completions(await c.status()) == 2

        asyncio.run(main())
