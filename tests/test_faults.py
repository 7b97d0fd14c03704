"""Faults the daemon survives: a client killed mid-transfer, a client that never reads
its replies, an engine error on one chunk, the daemon itself restarted under load, overload.

The daemon always runs in its own process. Every copy that reports success has its bytes checked
at the destination. Nothing here asserts a wall-clock time: waits poll a condition with a
generous deadline, and comparisons are orderings or bounds with wide margins.
"""

from __future__ import annotations

import asyncio
import bisect
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import priod
from priod.client.client import Client, CopyHandle, Region
from priod.testing import DaemonProcess, daemon_process
from priod.wire.frames import encode
from priod.wire.transport import BlockingFramedSocket

MiB = 1 << 20
FAULT_NBYTES = 12345
"""[sim] fault_on_nbytes: no chunk of an ordinary copy has this size (chunks are 4 KiB multiples)."""
MAX_OUTPUT = 64 * 1024
FAULTY = {
    "PRIOD_LOG__LEVEL": '"warning"',
    "PRIOD_SIM__FAULT_ON_NBYTES": str(FAULT_NBYTES),
    "PRIOD_SERVER__MAX_FRAME_BYTES": "4096",
    "PRIOD_SERVER__MAX_OUTPUT_BYTES": str(MAX_OUTPUT),
}


@pytest.fixture(scope="module")
def faulty() -> Iterator[DaemonProcess]:
    """A sim daemon with an engine fault on chunks of FAULT_NBYTES and a 64 KiB output buffer per client."""
    with daemon_process(FAULTY) as d:
        yield d
    assert d.proc.returncode == 0, d.log()[-4000:]


# -- helpers ---------------------------------------------------------------------------------


def pattern(seed: int, n: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """Bytes unique to one copy: a stale or shifted destination never matches."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def daemon_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def daemon_memfd_maps(pid: int) -> int:
    """Mappings of memfds (host and sim device regions) in the daemon's address space."""
    with open(f"/proc/{pid}/maps") as fp:
        return sum(1 for line in fp if "/memfd:" in line)


async def steady_counts(pid: int) -> tuple[int, int] | None:
    """The daemon's fds and memfd mappings, where they read the same 100 ms apart; else None."""
    first = (daemon_fds(pid), daemon_memfd_maps(pid))
    await asyncio.sleep(0.1)
    return first if (daemon_fds(pid), daemon_memfd_maps(pid)) == first else None


async def until(check: Callable[[], Awaitable[Any]], what: str, timeout: float = 30.0) -> Any:
    """Poll ``check`` until it returns something truthy; the deadline only catches a hang."""
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout} s")
        await asyncio.sleep(0.02)


@dataclass
class Load:
    """What a verifying load client saw."""

    done: int = 0
    bytes: int = 0
    errors: list[BaseException] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    daemon_queued_us: list[float] = field(default_factory=list)


async def verified_copies(
    c: Client,
    dst: Region,
    src: Region,
    sizes: list[int],
    stop: asyncio.Event,
    *,
    priority: str,
    seed: int,
    stop_on: tuple[type[BaseException], ...] = (priod.ConnectionClosed,),
    out: Load | None = None,
) -> Load:
    """Copy ``src`` -> ``dst`` one copy at a time until ``stop``; each success is checked byte for byte.

    Sizes cycle through ``sizes``; the pattern is written where the client can reach it (a mapped
    region) and read back at the destination. Errors in ``stop_on`` end the loop; others are kept.
    ``out`` (if given) is filled as the copies go, so a test can watch progress.
    """
    assert src.array is not None and dst.array is not None
    out = out if out is not None else Load()
    i = 0
    while not stop.is_set():
        n = sizes[i % len(sizes)]
        data = pattern(seed * 100_003 + i, n)
        src.array[:n] = data
        t0 = time.perf_counter()
        try:
            r = await c.copy(dst, src, n, priority=priority)
        except priod.PriodError as exc:
            out.errors.append(exc)
            if isinstance(exc, stop_on):
                break
            continue
        finally:
            i += 1
        out.latencies.append(time.perf_counter() - t0)
        out.daemon_queued_us.append(r.queued_us)
        assert r.nbytes == n
        assert np.array_equal(dst.array[:n], data), (
            f"copy {i} of {n} bytes reported success but its destination differs"
        )
        out.done += 1
        out.bytes += n
    return out


VICTIM = r"""
import asyncio, sys
import priod

async def main(path: str) -> None:
    c = await priod.connect(path, name="victim", copy_path="daemon")
    n = 64 << 20
    h, d = await c.alloc_host(n), await c.alloc_device(n)
    h2, d2 = await c.alloc_host(n), await c.alloc_device(n)
    for _ in range(8):
        c.start_copy(d, h, n, priority="bulk")
        c.start_copy(h2, d2, n, priority="bulk")
    await c.ping()
    print("ready", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(sys.argv[1]))
"""


# -- a client killed mid-transfer ------------------------------------------------------------


@pytest.mark.asyncio(loop_factories=["asyncio"])  # the daemon is under test, not the client's loop
async def test_sigkill_client_mid_transfer_releases_everything(faulty: DaemonProcess) -> None:
    """A client process killed with SIGKILL while 1 GiB of its copies is queued and in flight:
    its regions and queued copies are released, its chunks in flight drain, another client's
    copies (bulk and urgent, both directions) keep completing and verify, and the daemon's open
    fds, memfd mappings and pinned and device bytes return to where they were."""
    pid = faulty.proc.pid
    async with priod.connect(faulty.socket_path, name="watcher", copy_path="daemon") as watcher:

        async def alone() -> dict[str, Any] | None:
            st = await watcher.status()  # earlier connections (other tests, the harness's probe) close asynchronously
            return st if len(st["clients"]) == 1 else None

        base = await until(alone, "the watcher is the daemon's only client")
        # A connection that has left the client list may still hold its socket for a loop turn
        # or two (a loaded machine stretches that): the base is taken once the counts are steady.
        base_fds, base_maps = await until(lambda: steady_counts(pid), "the daemon's fds and mappings steady")
        assert all(cl["pinned_bytes"] == 0 and cl["device_bytes"] == 0 for cl in base["clients"])

        other = await priod.connect(faulty.socket_path, name="other", copy_path="daemon")
        bulk_h, bulk_d = await other.alloc_host(8 * MiB), await other.alloc_device(8 * MiB)
        urg_h, urg_d = await other.alloc_host(MiB), await other.alloc_device(MiB)
        stop = asyncio.Event()
        bulk, urgent = Load(), Load()
        loads = [
            asyncio.ensure_future(
                verified_copies(other, bulk_d, bulk_h, [8 * MiB, 3 * MiB + 5], stop, priority="bulk", seed=1, out=bulk)
            ),
            asyncio.ensure_future(
                verified_copies(other, urg_h, urg_d, [MiB, 65536, 4099], stop, priority="urgent", seed=2, out=urgent)
            ),
        ]

        victim = subprocess.Popen([sys.executable, "-c", VICTIM, faulty.socket_path], stdout=subprocess.PIPE, text=True)
        try:
            assert victim.stdout is not None
            assert victim.stdout.readline().strip() == "ready"

            async def victim_busy() -> bool:
                st = await watcher.status()
                mine = [cl for cl in st["clients"] if cl["pid"] == victim.pid]
                return bool(mine) and mine[0]["pending"] > 0 and mine[0]["regions"] == 4 and st["inflight_chunks"] > 0

            await until(victim_busy, "victim's copies queued and in flight")
            victim.send_signal(signal.SIGKILL)
            victim.wait(30)
        finally:
            if victim.poll() is None:
                victim.kill()
                victim.wait()
            assert victim.stdout is not None
            victim.stdout.close()

        async def victim_gone() -> bool:
            return all(cl["pid"] != victim.pid for cl in (await watcher.status())["clients"])

        await until(victim_gone, "victim's connection dropped")
        at_drop = (bulk.done, urgent.done)

        async def other_went_on() -> bool:
            return bulk.done > at_drop[0] + 1 and urgent.done > at_drop[1] + 1

        await until(other_went_on, "the other client's copies go on after the victim is dropped")
        stop.set()
        await asyncio.wait_for(asyncio.gather(*loads), 60)
        assert bulk.errors == [] and urgent.errors == []
        await other.close()

        async def back_to_base() -> dict[str, Any] | None:
            st = await watcher.status()
            idle = st["inflight_chunks"] == 0 and all(not any(ln["queued_requests"].values()) for ln in st["lanes"])
            if (
                idle
                and len(st["clients"]) == len(base["clients"])
                and daemon_fds(pid) == base_fds
                and daemon_memfd_maps(pid) == base_maps
            ):
                return st
            return None

        st = await until(back_to_base, f"daemon back to {base_fds} fds and {base_maps} memfd mappings")
        assert [(cl["pinned_bytes"], cl["device_bytes"], cl["regions"], cl["pending"]) for cl in st["clients"]] == [
            (0, 0, 0, 0)
        ] * len(base["clients"])
        assert st["inflight_bytes"] == {}


# -- a client that never reads ---------------------------------------------------------------


class Flooder:
    """A raw-socket client that sends requests as fast as the kernel takes them and reads nothing."""

    def __init__(self, path: str) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        self.framed = BlockingFramedSocket(sock)
        self.sock = sock
        self.sent = 0
        self.frames: list[int] = []  # end offset of each frame in the stream
        self.stalled = threading.Event()
        self._thread: threading.Thread | None = None

    def request(self, msg: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        self.framed.send(msg)
        return self.framed.receive()

    def flood(self, frames: list[bytes]) -> None:
        """Send ``frames`` from a thread until the kernel stops taking bytes for 0.5 s."""
        ends = list(np.cumsum([len(f) for f in frames]))
        self.frames = [int(e) for e in ends]
        blob = b"".join(frames)

        def run() -> None:
            self.sock.setblocking(False)
            idle_since = time.monotonic()
            while self.sent < len(blob):
                try:
                    self.sent += self.sock.send(blob[self.sent : self.sent + 65536])
                    idle_since = time.monotonic()
                except BlockingIOError:
                    if time.monotonic() - idle_since > 0.5:
                        break
                    time.sleep(0.005)
            self.stalled.set()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def complete_frames(self) -> int:
        return bisect.bisect_right(self.frames, self.sent)

    def drain(self, expect: int, timeout: float = 30.0) -> dict[int, dict[str, Any]]:
        """Read replies until ``expect`` have come; returns them by id."""
        self.sock.setblocking(True)
        self.sock.settimeout(timeout)
        got: dict[int, dict[str, Any]] = {}
        while len(got) < expect:
            msg, fds = self.framed.receive()
            for fd in fds:
                os.close(fd)
            assert msg["id"] not in got, f"two replies for request {msg['id']}"
            got[msg["id"]] = msg
        return got

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join(5)
        self.framed.close()


@pytest.mark.asyncio(loop_factories=["asyncio"])  # the daemon is under test, not the client's loop
async def test_client_that_never_reads_is_bounded_and_others_keep_their_promise(faulty: DaemonProcess) -> None:
    """A client sends requests (ping, status, bad ops) as fast as it can and never reads a reply.
    The daemon's buffered output for it stays within [server] max_output_bytes plus one frame,
    and it stops reading that client's requests (nothing more is answered while it does not
    read). Meanwhile an urgent client under a bulk load stays as fast as it was without the
    flood (generous bound), every copy verifies, and once the flooder reads, each of its
    complete requests has exactly one reply."""
    attacker_pinned = 3 * MiB + 4096  # tells its entry in status() apart
    async with (
        priod.connect(faulty.socket_path, name="bulk", copy_path="daemon") as bulk_c,
        priod.connect(faulty.socket_path, name="urgent", copy_path="daemon") as urg_c,
    ):
        bh, bd = await bulk_c.alloc_host(16 * MiB), await bulk_c.alloc_device(16 * MiB)
        uh, ud = await urg_c.alloc_host(MiB), await urg_c.alloc_device(MiB)
        stop_bulk = asyncio.Event()
        bulk = asyncio.ensure_future(verified_copies(bulk_c, bd, bh, [16 * MiB], stop_bulk, priority="bulk", seed=3))

        async def urgent_phase(seed: int) -> Load:
            stop = asyncio.Event()
            task = asyncio.ensure_future(verified_copies(urg_c, ud, uh, [MiB], stop, priority="urgent", seed=seed))
            await asyncio.sleep(1.0)
            stop.set()
            return await task

        before = await urgent_phase(4)

        fl = Flooder(faulty.socket_path)
        try:
            assert fl.request({"id": 1, "op": "hello", "v": 2})[0]["ok"]
            reply, fds = fl.request({"id": 2, "op": "alloc_host", "nbytes": attacker_pinned})
            for fd in fds:
                os.close(fd)
            assert reply["ok"]
            kinds = ({"op": "ping"}, {"op": "status"}, {"op": "no_such_op"})
            frames = [encode({"id": i, **kinds[i % 3]}) for i in range(3, 200_003)]
            fl.flood(frames)
            await asyncio.get_running_loop().run_in_executor(None, fl.stalled.wait, 60)

            async def attacker() -> dict[str, Any]:
                st = await urg_c.status()
                (me,) = [cl for cl in st["clients"] if cl["pinned_bytes"] == attacker_pinned]
                return {**me, "refused": st["totals"]["refused"]}

            during = asyncio.ensure_future(urgent_phase(5))
            samples = []
            for _ in range(5):
                samples.append(await attacker())
                await asyncio.sleep(0.2)
            flooded = await during
            status_frame = len(encode({"id": 1 << 40, "ok": True, "status": await urg_c.status()}))
            for s in samples:
                assert 0 < s["output_buffered"] <= MAX_OUTPUT + status_frame + 256, s
            # Stopped reading: nothing more of the flooder's requests is answered or refused.
            assert (
                samples[-1]["refused"] == samples[1]["refused"]
                and samples[-1]["output_buffered"] == samples[1]["output_buffered"]
            )
            assert fl.complete_frames() < len(frames), "the kernel and the daemon took the whole flood: make it larger"

            replies = await asyncio.get_running_loop().run_in_executor(None, fl.drain, fl.complete_frames())
            assert sorted(replies) == list(range(3, 3 + fl.complete_frames()))
            for rid, msg in replies.items():
                assert msg["ok"] == (rid % 3 != 2), msg
        finally:
            fl.close()
        stop_bulk.set()
        bulk_load = await bulk
    assert before.errors == [] and flooded.errors == [] and bulk_load.errors == []
    assert bulk_load.done > 0
    p50_before, p50_during = float(np.median(before.latencies)), float(np.median(flooded.latencies))
    assert p50_during <= 3 * p50_before + 0.005, (
        f"urgent p50 {p50_before * 1e3:.2f} ms before the flood, {p50_during * 1e3:.2f} ms during it"
    )


# -- an engine error on one chunk ------------------------------------------------------------


@pytest.mark.asyncio(loop_factories=["asyncio"])  # the daemon is under test, not the client's loop
async def test_engine_error_fails_only_that_request(faulty: DaemonProcess) -> None:
    """A chunk of exactly [sim] fault_on_nbytes fails in the engine: its copy fails with
    EngineError and a message saying how far it got (on the express path, on the DMA path,
    and as the last chunk of a multi-chunk copy); every other copy sent at the same time, in
    every direction and class, completes and verifies."""
    async with priod.connect(faulty.socket_path, name="faults", copy_path="daemon") as c:
        st = await c.status()
        # The urgent copies sent first put the lane on its short bound: bulk is cut into its chunks.
        chunk = next(ln["urgent_chunk_bytes"] for ln in st["lanes"] if ln["lane"] == "gpu0/h2d")
        n = 8 * MiB
        h, d, d2 = await c.alloc_host(n), await c.alloc_device(n), await c.alloc_device(n)
        assert h.array is not None and d.array is not None and d2.array is not None
        rng = np.random.default_rng(7)
        jobs: list[tuple[str, Region, Region, int, int, str]] = []  # (what, dst, src, nbytes, offset, priority)
        faults = [
            ("fault-express", d, h, FAULT_NBYTES, 0, "urgent"),
            ("fault-dma", h, d, FAULT_NBYTES, 0, "bulk"),
            ("fault-last-chunk", d, h, chunk + FAULT_NBYTES, 0, "bulk"),
        ]
        # Good copies in the other parts of the regions, so no two copies touch the same bytes.
        base = 2 * MiB
        for i in range(24):
            size = int(rng.integers(1, 96 * 1024))
            if size == FAULT_NBYTES:
                size += 1
            dst, src = [(d, h), (h, d), (d2, d)][i % 3]
            jobs.append(
                (f"good-{i}", dst, src, size, base + i * 256 * 1024, ["urgent", "high", "normal", "bulk"][i % 4])
            )
        h.array[:] = pattern(8, n)
        d.array[base:] = pattern(9, n - base)
        expected = {}
        for name, _, src, k, off, _ in jobs:
            assert src.array is not None
            expected[name] = src.array[off : off + k].copy()
        handles: dict[str, CopyHandle] = {}
        for name, dst, src, k, off, prio in faults + jobs:
            handles[name] = c.start_copy(dst, src, k, dst_offset=off, src_offset=off, priority=prio)
        outcomes = await asyncio.wait_for(asyncio.gather(*handles.values(), return_exceptions=True), 60)
        by_name = dict(zip(handles, outcomes, strict=False))
        for name in ("fault-express", "fault-dma"):
            exc = by_name[name]
            assert isinstance(exc, priod.EngineError), (name, exc)
            with pytest.raises(
                priod.EngineError,
                match=rf"^copy failed after 0 of {FAULT_NBYTES} bytes: injected engine fault on a chunk of {FAULT_NBYTES} bytes "
                r"\(\[sim\] fault_on_nbytes\); the copy did not complete$",
            ):
                raise exc
        with pytest.raises(
            priod.EngineError,
            match=rf"^copy failed after {chunk} of {chunk + FAULT_NBYTES} bytes: injected engine fault on a chunk of {FAULT_NBYTES} bytes",
        ):
            raise by_name["fault-last-chunk"]  # type: ignore[misc]
        for name, dst, _src, k, off, _ in jobs:
            r = by_name[name]
            assert isinstance(r, priod.CopyResult), (name, r)
            assert dst.array is not None and np.array_equal(dst.array[off : off + k], expected[name]), name
        # The connection and the lanes are fine afterwards.
        h.array[:4096] = 42
        await c.copy(d, h, 4096, priority="urgent")
        assert int(d.array[:4096].min()) == 42


# -- the daemon restarted under load ---------------------------------------------------------


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
async def test_daemon_restart_under_load_fails_clearly_and_reconnects(how: str) -> None:
    """The daemon dies (SIGKILL) or stops (SIGTERM, [service] shutdown = "cancel") while three
    clients copy: pending copies fail with ConnectionClosed or ShuttingDown, never with a false
    success (every success verified byte for byte); a client that waits in connect(wait_s=) gets
    in once a new daemon listens on the same path; reconnect() gives each old client a working
    connection, and its old regions are refused with a message saying to allocate them again."""
    tmp = tempfile.mkdtemp(prefix="priod-restart-")
    path = os.path.join(tmp, "priod.sock")
    env = {"PRIOD_LOG__LEVEL": '"warning"', "PRIOD_SERVICE__SHUTDOWN": '"cancel"'}
    with ExitStack() as stack:
        first = stack.enter_context(daemon_process(env, socket_path=path))
        # reconnect_s=0: this test is of handling it by hand (tests/test_reconnect.py: by itself)
        clients = [await priod.connect(path, name=f"load{i}", copy_path="daemon", reconnect_s=0) for i in range(3)]
        try:
            regions = []
            for c in clients:
                regions.append((await c.alloc_host(4 * MiB), await c.alloc_device(4 * MiB)))
            stop = asyncio.Event()
            loads = [Load() for _ in clients]
            plans = [
                (0, "h2d", [4 * MiB, MiB + 3], "bulk"),
                (1, "d2h", [2 * MiB, 4097], "normal"),
                (2, "h2d", [256 * 1024, 65536], "urgent"),
            ]
            tasks = []
            for i, direction, sizes, prio in plans:
                h, d = regions[i]
                dst, src = (d, h) if direction == "h2d" else (h, d)
                tasks.append(
                    asyncio.ensure_future(
                        verified_copies(clients[i], dst, src, sizes, stop, priority=prio, seed=10 + i, out=loads[i])
                    )
                )

            async def all_copying() -> bool:
                return all(ld.done >= 2 for ld in loads)

            await until(all_copying, "every client copying")
            sig = signal.SIGKILL if how == "SIGKILL" else signal.SIGTERM
            await asyncio.get_running_loop().run_in_executor(None, first.stop, sig)
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
            for ld in loads:
                assert ld.done > 0
                assert ld.errors, "the loop ends only on an error"
                assert isinstance(ld.errors[-1], priod.ConnectionClosed), ld.errors
                assert all(isinstance(e, (priod.ConnectionClosed, priod.ShuttingDown)) for e in ld.errors), ld.errors
            with pytest.raises(priod.ConnectionClosed, match=rf"^connection to priod at {re.escape(path)} lost: "):
                await clients[0].ping()

            waiting = asyncio.ensure_future(Client.connect(path, name="patient", wait_s=30, copy_path="daemon"))
            await asyncio.sleep(0.3)
            assert not waiting.done(), "connect(wait_s=) returned while no daemon listened"
            stack.enter_context(daemon_process(env, socket_path=path))
            patient = await asyncio.wait_for(waiting, 60)
            await patient.ping()
            await patient.close()

            for i, c in enumerate(clients):
                await c.reconnect(wait_s=30)
                old_h, old_d = regions[i]
                with pytest.raises(
                    priod.InvalidRequest,
                    match=r"^<priod.Region \d+ device 4194304 bytes> belongs to an earlier connection; allocate it again after reconnect\(\)$",
                ):
                    await c.copy(old_d, old_h)
                h, d = await c.alloc_host(MiB), await c.alloc_device(MiB)
                assert h.array is not None and d.array is not None
                data = pattern(99 + i, MiB)
                h.array[:] = data
                r = await c.copy(d, h, priority="urgent")
                assert r.nbytes == MiB and np.array_equal(d.array, data)
        finally:
            for c in clients:
                await c.close()


# -- overload --------------------------------------------------------------------------------

OVERLOAD = {
    "PRIOD_LOG__LEVEL": '"warning"',
    "PRIOD_SERVER__MAX_CLIENTS": "4",
    "PRIOD_LIMITS__MAX_QUEUED_REQUESTS": "8",
    "PRIOD_LIMITS__MAX_REGIONS": "4",
}


@pytest.mark.asyncio(loop_factories=["asyncio"])  # the daemon is under test, not the client's loop
async def test_overload_is_refused_at_once_never_hangs() -> None:
    """Three client processes' worth of flooding at once: connections past [server] max_clients
    and copies past [limits] max_queued_requests are refused with LimitExceeded while the
    accepted copies are still running (refusals do not wait for the queue), every request gets
    exactly one reply, and afterwards a freed connection slot admits a well-behaved client whose
    copies verify."""
    with daemon_process(OVERLOAD) as d:
        good = await priod.connect(d.socket_path, name="good", copy_path="daemon")
        flooders = [await priod.connect(d.socket_path, name=f"flood{i}", copy_path="daemon") for i in range(3)]
        try:
            with pytest.raises(
                priod.LimitExceeded,
                match=r"^the daemon already serves 4 clients \(\[server\] max_clients\); retry later$",
            ):
                await asyncio.wait_for(Client.connect(d.socket_path, name="one-too-many", copy_path="daemon"), 30)

            async def flood(c: Client) -> list[tuple[str, float]]:
                h, dv = await c.alloc_host(4 * MiB), await c.alloc_device(4 * MiB)
                with pytest.raises(
                    priod.LimitExceeded,
                    match=r"^this connection holds 4 regions \(\[limits\] max_regions = 4\); free some first$",
                ):
                    for _ in range(3):
                        await c.alloc_host(4096)
                handles = [c.start_copy(dv, h, priority="bulk") for _ in range(50)]
                order: list[tuple[str, float]] = []

                async def one(hd: CopyHandle) -> None:
                    try:
                        await hd
                        order.append(("done", time.perf_counter()))
                    except priod.LimitExceeded as exc:
                        assert str(exc).startswith(
                            "this connection has 8 copies pending ([limits] max_queued_requests = 8)"
                        ), exc
                        order.append(("refused", time.perf_counter()))

                await asyncio.wait_for(asyncio.gather(*map(one, handles)), 60)
                return order

            orders = await asyncio.gather(*map(flood, flooders))
            for order in orders:
                kinds = [k for k, _ in order]
                # 8 are taken at once (max_queued_requests); the rest are refused, unless one of
                # the 8 finished before the daemon read the client's last requests (its 50 frames
                # may come in several reads on a loaded machine): then its slot takes another.
                done = kinds.count("done")
                assert 8 <= done <= 12 and kinds.count("refused") == 50 - done, kinds
                # Every refusal came back before the last accepted copy finished.
                last_done = max(i for i, k in enumerate(kinds) if k == "done")
                assert max(i for i, k in enumerate(kinds) if k == "refused") < last_done
            st = await good.status()
            assert st["totals"]["refused"] >= 3 * 38
        finally:
            for c in flooders:
                await c.close()

        async def admitted() -> Client | None:
            try:
                return await Client.connect(d.socket_path, name="next", copy_path="daemon")
            except priod.LimitExceeded:
                return None

        nxt = await until(admitted, "a connection slot freed by the flooders")
        for c in (good, nxt):
            h, dv = await c.alloc_host(MiB), await c.alloc_device(MiB)
            assert h.array is not None and dv.array is not None
            h.array[:] = pattern(5, MiB)
            await c.copy(dv, h, priority="urgent")
            assert np.array_equal(dv.array, h.array)
            await c.close()
    assert d.proc.returncode == 0, d.log()[-4000:]


async def test_a_reply_that_sets_off_the_next_copy_does_not_reenter_the_pump() -> None:
    """A flood of 1-byte urgent copies, 256 outstanding: each reply lets that client's next
    request be handled, which queues a copy while the pump is still walking its chunks in
    flight. That nested pass once completed chunks twice: copies failed as `internal`, the poll
    loop died, and a copy could be reported done before its last chunk had landed. Every copy
    here must succeed, the other client's bytes must be exact, and the daemon must log no
    failure."""
    with daemon_process({"PRIOD_LOG__LEVEL": '"warning"'}) as d:
        async with priod.connect(d.socket_path, copy_path="daemon") as flood, priod.connect(d.socket_path) as honest:
            fh, fd = await flood.alloc_host(4096), await flood.alloc_device(4096)
            hh, hd = await honest.alloc_host(MiB), await honest.alloc_device(MiB)
            assert hh.array is not None and hd.array is not None
            stop = False
            done = 0

            async def flooding() -> None:
                nonlocal done
                window = [flood.start_copy(fd, fh, 1, priority="urgent") for _ in range(256)]
                while window:
                    await window.pop(0)
                    done += 1
                    if not stop:
                        window.append(flood.start_copy(fd, fh, 1, priority="urgent"))

            task = asyncio.ensure_future(flooding())
            for i in range(20):
                hh.array[:] = np.uint8(i + 1)
                r = await asyncio.wait_for(honest.copy(hd, hh, priority="urgent"), 30)
                assert r.nbytes == MiB and int(hd.array.min()) == int(hd.array.max()) == i + 1

            # The flood goes on past its first window (replies setting off copies) however fast
            # the honest client's copies were.
            async def flood_past_its_window() -> bool:
                return done > 512

            await until(flood_past_its_window, "the flood past its first window", timeout=60)
            stop = True
            await asyncio.wait_for(task, 60)
            assert done > 512
        assert d.stop() == 0
        log = d.log()
    assert "task_failed" not in log and "request_failed" not in log and "not in flight" not in log, log[-3000:]
