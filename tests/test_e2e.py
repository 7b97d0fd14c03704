"""End to end: the daemon in its own process, real sockets, real fd passing, several client processes."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import priod
from priod.testing import DaemonProcess
from priod.wire.frames import encode
from priod.wire.messages import Copy

CLIENT = str(Path(__file__).with_name("clientproc.py"))


def _client(daemon: DaemonProcess, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, CLIENT, daemon.socket_path, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


async def _wait_for(predicate: object, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await predicate():  # type: ignore[operator]
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached in time")


def test_two_client_processes_every_byte_checked(daemon: DaemonProcess) -> None:
    """Two client processes copy random bytes at random sizes and offsets at once; every byte lands."""
    procs = [_client(daemon, "verify", str(seed), "12") for seed in (1, 2)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert json.loads(out.strip().splitlines()[-1])["copies"] == 24


async def test_async_api_round_trip(daemon: DaemonProcess) -> None:
    """The documented async API: alloc, copy both ways with offsets, results carry times."""
    async with priod.connect(daemon.socket_path, copy_path="daemon") as c:
        h = await c.alloc_host(1 << 20)
        d = await c.alloc_device(1 << 20)
        assert h.array is not None and d.array is not None
        h.array[:] = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)[: 1 << 20]
        r = await c.copy(d, h, 4097, dst_offset=3, src_offset=11, priority="urgent")
        assert r.nbytes == 4097 and r.total_us >= r.transfer_us >= 0 and r.queued_us >= 0
        assert np.array_equal(d.array[3:4100], h.array[11:4108])
        back = await c.alloc_host(8192)
        await c.copy(back, d, 4097, src_offset=3)
        assert back.array is not None and np.array_equal(back.array[:4097], h.array[11:4108])


async def test_replies_come_back_out_of_order(daemon: DaemonProcess) -> None:
    """An urgent copy sent after a large bulk copy on the same connection finishes first."""
    async with priod.connect(daemon.socket_path, copy_path="daemon") as c:
        big_h, big_d = await c.alloc_host(64 << 20), await c.alloc_device(64 << 20)
        small_h, small_d = await c.alloc_host(64 << 10), await c.alloc_device(64 << 10)
        bulk = c.start_copy(big_d, big_h, priority="bulk")
        urgent = c.start_copy(small_d, small_h, priority="urgent")
        await urgent
        assert not bulk.done()
        await bulk


async def test_cancel_reports_bytes_done(daemon: DaemonProcess) -> None:
    """Cancel stops a large copy at a chunk boundary and reports how many bytes were copied."""
    async with priod.connect(daemon.socket_path, copy_path="daemon") as c:
        n = 128 << 20
        h, d = await c.alloc_host(n), await c.alloc_device(n)
        handle = c.start_copy(d, h, n, priority="bulk")
        await asyncio.sleep(0.02)
        done = await handle.cancel()
        st = await c.status()
        lane = next(ln for ln in st["lanes"] if ln["lane"].endswith("h2d"))
        # Chunks are long or, while urgent copies are recent on the lane, short.
        chunk = math.gcd(lane["chunk_bytes"], lane["urgent_chunk_bytes"])
        assert 0 <= done < n
        assert done % chunk == 0  # stopped at a chunk boundary
        with pytest.raises(priod.NotFound, match=r"^no copy with id 1 is pending on this connection"):
            await c.raw_request({"op": "cancel", "target": 1})


async def test_errors_are_clear_and_connection_survives(daemon: DaemonProcess) -> None:
    """Bad requests get errors that say what to do; the same connection then copies fine."""
    async with priod.connect(daemon.socket_path, copy_path="daemon") as c:
        h, d = await c.alloc_host(4096), await c.alloc_device(4096)
        with pytest.raises(
            priod.InvalidRequest, match=r"^dst_offset 1 \+ nbytes 4096 is outside region \d+ of 4096 bytes"
        ):
            await c.copy(d, h, 4096, dst_offset=1)
        with pytest.raises(priod.InvalidRequest, match=r"^nbytes = 0 is invalid; copy at least 1 byte$"):
            await c.copy(d, h, 0)
        with pytest.raises(priod.InvalidRequest, match=r"^unknown priority class 'vip'|^unknown class 'vip'|.*'vip'"):
            await c.copy(d, h, 16, priority="vip")
        with pytest.raises(priod.InvalidRequest, match=r"^both regions are host memory; copy between them with memcpy"):
            await c.copy(h, h, 16)
        with pytest.raises(priod.NotFound, match=r"^no region 999999; use an id returned by"):
            await c.raw_request({"op": "free", "region": 999999})
        with pytest.raises(priod.InvalidRequest, match=r"^unknown op 'explode'; known ops: "):
            await c.raw_request({"op": "explode"})
        with pytest.raises(priod.InvalidRequest, match=r"^field 'nbytes' must be int, got str$"):
            await c.raw_request({"op": "copy", "dst": d.id, "src": h.id, "nbytes": "lots"})
        r = await c.copy(d, h, 4096)
        assert r.nbytes == 4096


def test_sync_client_same_api(daemon: DaemonProcess) -> None:
    """SyncClient offers the same calls, blocking."""
    with priod.SyncClient(daemon.socket_path, copy_path="daemon") as c:
        h, d = c.alloc_host(1000), c.alloc_device(1000)
        assert h.array is not None and d.array is not None
        h.array[:] = 7
        assert c.copy(d, h, 1000, priority="high").nbytes == 1000
        assert int(d.array.sum()) == 7000
        c.free(h)
        assert c.status()["backend"] == "sim"


async def test_register_host_memfd(daemon: DaemonProcess) -> None:
    """A client's own sealed memfd becomes a host region; an unsealed one is refused with the fix."""
    import fcntl

    async with priod.connect(daemon.socket_path, copy_path="daemon") as c:
        fd = os.memfd_create("mine", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, 8192)
        with pytest.raises(priod.InvalidRequest, match=r"^seal the memfd against shrinking first"):
            await c.register_host(fd, 8192)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        h = await c.register_host(fd, 8192)
        d = await c.alloc_device(8192)
        assert h.array is not None and d.array is not None
        os.pwrite(fd, b"hello priod", 100)
        await c.copy(d, h, 8192)
        assert bytes(d.array[100:111]) == b"hello priod"
        os.close(fd)


@pytest.mark.parametrize(
    ("kind", "handle", "memory"),
    [("vmm_fd", b"", "cuMemCreate memory"), ("pool_fd", b"e" * 64, "stream-ordered pool memory")],
)
def test_register_device_by_fd_on_sim_is_refused_and_its_fd_closed(
    daemon: DaemonProcess, kind: str, handle: bytes, memory: str
) -> None:
    """cuMemCreate memory by fd (kind vmm_fd) and pool memory by the pool's fd (kind pool_fd)
    need the cuda engine: the sim refuses them with bad_request naming the alternative, and the
    fd that came with the request is closed in the daemon."""
    from priod.wire.messages import RegisterDevice

    name = f"priod-{kind}-test"
    fd = os.memfd_create(name)
    try:
        with priod.SyncClient(daemon.socket_path, copy_path="daemon") as c:
            with pytest.raises(
                priod.InvalidRequest,
                match=rf"^register_device of {memory} \(kind '{kind}'\) needs the cuda engine; .*alloc_device",
            ):
                c._request(RegisterDevice(handle, 4096, 0, kind=kind, size=2 << 20), (fd,))
            c.ping()
    finally:
        os.close(fd)

    def held() -> bool:
        for link in Path(f"/proc/{daemon.proc.pid}/fd").iterdir():
            try:
                if name in os.readlink(link):
                    return True
            except FileNotFoundError:
                pass  # closed meanwhile
        return False

    deadline = time.monotonic() + 10
    while held() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not held(), "the daemon kept the fd that came with a refused register_device"


async def test_dead_client_regions_released(daemon: DaemonProcess) -> None:
    """A client killed mid-transfer: its regions and queued copies go, others are untouched."""
    async with priod.connect(daemon.socket_path, copy_path="daemon") as watcher:
        mine_h, mine_d = await watcher.alloc_host(1 << 20), await watcher.alloc_device(1 << 20)
        before = await watcher.status()
        victim = _client(daemon, "hold", str(64 << 20))
        assert victim.stdout is not None
        assert victim.stdout.readline().strip() == "ready"

        async def victim_listed() -> bool:
            return any(cl["regions"] == 2 and cl["pending"] > 0 for cl in (await watcher.status())["clients"])

        await _wait_for(victim_listed)
        victim.send_signal(signal.SIGKILL)
        victim.communicate()

        async def victim_gone() -> bool:
            st = await watcher.status()
            return len(st["clients"]) == len(before["clients"]) and st["inflight_chunks"] == 0

        await _wait_for(victim_gone)
        assert mine_h.array is not None
        mine_h.array[:] = 3
        await watcher.copy(mine_d, mine_h)
        assert mine_d.array is not None and int(mine_d.array.min()) == 3


async def test_many_tiny_pipelined_copies_all_complete(daemon: DaemonProcess) -> None:
    """Hundreds of tiny copies sent at once (finished at submission on an idle lane) all
    complete with the right bytes, including past the daemon's per-turn pump bound."""
    async with priod.connect(daemon.socket_path, copy_path="daemon") as c:
        h, d = await c.alloc_host(64 * 500), await c.alloc_device(64 * 500)
        assert h.array is not None and d.array is not None
        h.array[:] = np.arange(64 * 500, dtype=np.uint32).astype(np.uint8)
        handles = [c.start_copy(d, h, 64, dst_offset=64 * i, src_offset=64 * i) for i in range(500)]
        results = [await x for x in handles]
        assert all(r.nbytes == 64 for r in results)
        assert np.array_equal(d.array, h.array)


def test_copies_whose_client_hung_up_before_the_reply_harm_no_one(daemon: DaemonProcess) -> None:
    """A client sends copies and closes its socket at once: the daemon reads the frames and the
    end together, runs the copies at the end of that turn (the pump's one kick per turn) and
    finds the connection gone when it answers. That must end only that connection: the daemon
    goes on serving others and stops cleanly (the module's fixture checks its exit status)."""
    for round_ in range(20):
        with priod.SyncClient(
            daemon.socket_path, timeout=10, copy_path="daemon"
        ) as c:  # a daemon stuck fails in seconds
            h, d = c.alloc_host(4096), c.alloc_device(4096)
            sock = c._sock.sock
            frames = b"".join(encode(Copy(d.id, h.id, 64, priority="urgent").encode(100 + i)) for i in range(8))
            sock.sendall(frames)
            sock.shutdown(2)  # frames and the end arrive together
        with priod.SyncClient(daemon.socket_path, timeout=10, copy_path="daemon") as other:
            h2, d2 = other.alloc_host(4096), other.alloc_device(4096)
            assert h2.array is not None
            h2.array[:] = round_
            other.copy(d2, h2, priority="urgent")
            other.ping()
