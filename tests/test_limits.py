"""Per-client limits ([limits]): pinned and device bytes, regions, queued requests and queued
bytes. Over a limit a request is refused at once with `priod.LimitExceeded` and a message that
names the setting, and is never queued; so no client can grow the daemon's memory.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Iterator

import psutil
import pytest

import priod
from priod.client.client import CopyHandle
from priod.daemon.engines.sim import sealed_memfd
from priod.testing import DaemonProcess, daemon_process

MiB = 1 << 20
LIMITS = {
    "PRIOD_LIMITS__MAX_PINNED_BYTES": str(8 * MiB),
    "PRIOD_LIMITS__MAX_DEVICE_BYTES": str(8 * MiB),
    "PRIOD_LIMITS__MAX_REGIONS": "6",
    "PRIOD_LIMITS__MAX_QUEUED_REQUESTS": "8",
    "PRIOD_LIMITS__MAX_QUEUED_BYTES": str(10 * MiB),
    # 4 MB/s: a 1 MiB copy takes 260 ms, so a refusal sent with it cannot lose the race to a
    # completion; nobody waits for such copies here (they are cancelled).
    "PRIOD_SIM__H2D_GBPS": "0.004",
    "PRIOD_TUNING__MIN_CHUNK_BYTES": "65536",
    "PRIOD_LOG__LEVEL": '"warning"',
}


@pytest.fixture(scope="module")
def limited() -> Iterator[DaemonProcess]:
    """One daemon with small limits; they are per connection, so each test connects afresh."""
    with daemon_process(LIMITS) as d:
        yield d
    assert d.proc.returncode == 0, d.log()[-4000:]


async def replies_in_order(handles: list[CopyHandle]) -> list[str]:
    """Outcomes in the order the replies arrived: "done" or the error's class name."""
    order: list[str] = []

    async def one(h: CopyHandle) -> None:
        try:
            await h
            order.append("done")
        except priod.PriodError as exc:
            order.append(type(exc).__name__ + ": " + str(exc))

    await asyncio.wait_for(asyncio.gather(*map(one, handles)), 60)
    return order


async def cancel_all(handles: list[CopyHandle]) -> None:
    """Cancel the copies nobody wants to wait for (each still gets its reply)."""
    await asyncio.wait_for(asyncio.gather(*(h.cancel() for h in handles)), 60)


async def test_pinned_bytes_limit(limited: DaemonProcess) -> None:
    """Host regions, allocated or registered, count against max_pinned_bytes per connection;
    freeing gives the room back, and another connection has its own budget."""
    async with priod.connect(limited.socket_path) as c, priod.connect(limited.socket_path) as other:
        big = await c.alloc_host(6 * MiB)
        msg = r"^{} more pinned bytes would exceed \[limits\] max_pinned_bytes = 8388608 \(this connection holds 6291456\); free a host region or ask for less$"
        with pytest.raises(priod.LimitExceeded, match=msg.format(4 * MiB)):
            await c.alloc_host(4 * MiB)
        fd = sealed_memfd("test", 3 * MiB)
        try:
            with pytest.raises(priod.LimitExceeded, match=msg.format(3 * MiB)):
                await c.register_host(fd, 3 * MiB)
            await other.register_host(fd, 3 * MiB)
        finally:
            os.close(fd)
        await other.alloc_host(5 * MiB)
        await c.free(big)
        await c.alloc_host(8 * MiB)
        st = await c.status()
    assert sorted(cl["pinned_bytes"] for cl in st["clients"]) == [8 * MiB, 8 * MiB]


async def test_device_bytes_limit(limited: DaemonProcess) -> None:
    """Device regions count against max_device_bytes, separately from pinned host bytes."""
    async with priod.connect(limited.socket_path) as c:
        await c.alloc_device(8 * MiB)
        await c.alloc_host(8 * MiB)
        with pytest.raises(
            priod.LimitExceeded,
            match=r"^1 more device bytes would exceed \[limits\] max_device_bytes = 8388608 \(this connection holds 8388608\); free a device region or ask for less$",
        ):
            await c.alloc_device(1)


async def test_region_count_limit(limited: DaemonProcess) -> None:
    """At most max_regions regions per connection, host and device together."""
    async with priod.connect(limited.socket_path) as c:
        regions = [await (c.alloc_host if i % 2 else c.alloc_device)(4096) for i in range(6)]
        for alloc in (c.alloc_host, c.alloc_device):
            with pytest.raises(
                priod.LimitExceeded,
                match=r"^this connection holds 6 regions \(\[limits\] max_regions = 6\); free some first$",
            ):
                await alloc(4096)
        await c.free(regions[0])
        await c.alloc_host(4096)


async def test_queued_requests_limit_refuses_at_once(limited: DaemonProcess) -> None:
    """Copies beyond max_queued_requests pending on one connection are refused at once (their
    replies come before any queued copy finishes), and never queued: the daemon holds 8."""
    async with priod.connect(limited.socket_path) as c:
        host, dev = await c.alloc_host(MiB), await c.alloc_device(MiB)
        handles = [c.start_copy(dev, host, priority="bulk") for _ in range(12)]  # 260 ms each
        st = await c.status()
        assert st["clients"][0]["pending"] == 8
        assert (
            await replies_in_order(handles[8:])
            == [
                "LimitExceeded: this connection has 8 copies pending ([limits] max_queued_requests = 8); wait for replies before sending more"
            ]
            * 4
        )
        assert not any(h.done() for h in handles[:8])  # refused while all 8 were still pending
        assert (await c.status())["clients"][0]["pending"] == 8
        await cancel_all(handles[:8])


async def test_queued_bytes_limit_refuses_at_once(limited: DaemonProcess) -> None:
    """Copies whose bytes would take the connection past max_queued_bytes are refused at once,
    while smaller ones that fit are still taken."""
    async with priod.connect(limited.socket_path) as c:
        host, dev = await c.alloc_host(4 * MiB), await c.alloc_device(4 * MiB)
        queued = [c.start_copy(dev, host, priority="bulk") for _ in range(2)]  # 1 s each
        over = c.start_copy(dev, host, priority="bulk")
        fits = c.start_copy(dev, host, 2 * MiB, priority="bulk")
        with pytest.raises(
            priod.LimitExceeded,
            match=r"^4194304 more bytes would exceed \[limits\] max_queued_bytes = 10485760 pending on this connection; wait for replies before sending more$",
        ):
            await over
        assert not any(h.done() for h in (*queued, fits))
        st = await c.status()
        assert (st["clients"][0]["pending"], st["clients"][0]["queued_bytes"]) == (3, 10 * MiB)
        await cancel_all([*queued, fits])


@pytest.mark.asyncio(loop_factories=["asyncio"])  # the daemon is under test, not the client's loop
async def test_pipelining_far_past_the_limit_keeps_daemon_memory_bounded(limited: DaemonProcess) -> None:
    """A client that fires copies by the ten thousand without waiting gets a reply to each,
    almost all of them refusals, and the daemon never holds more than max_queued_requests.

    Its memory is bounded, not merely small: a second burst as large as the first adds nothing
    to the daemon's RSS (under 6 MiB, generous; 0.4 to 1.5 MiB is typical), while queueing them would add about 17 MiB per
    burst (some 870 bytes per queued copy). The first burst may grow it by the per-connection
    buffers ([server] max_output_bytes of replies, a window of requests): under 32 MiB.
    """
    burst = 20_000
    proc = psutil.Process(limited.proc.pid)
    async with priod.connect(limited.socket_path) as c:
        # 256 KiB copies take 65 ms each: in any run of this test only a few dozen complete.
        host, dev = await c.alloc_host(256 * 1024), await c.alloc_device(256 * 1024)
        await c.copy(dev, host, priority="bulk")  # warm the paths once before measuring
        rss = [proc.memory_info().rss]
        got: list[str] = []
        for _ in range(2):
            handles = [c.start_copy(dev, host, priority="bulk") for _ in range(burst)]
            st = await c.status()
            assert st["clients"][0]["pending"] <= 8
            got += await replies_in_order(handles)
            rss.append(proc.memory_info().rss)
    refused = [g for g in got if g != "done"]
    assert len(got) == 2 * burst and len(refused) >= 2 * burst - 1000
    assert all(re.fullmatch(r"LimitExceeded: this connection has 8 copies pending .*", g) for g in refused)
    first, second = (rss[1] - rss[0]) / MiB, (rss[2] - rss[1]) / MiB
    print(
        f"{len(got) - len(refused)} copies done, {len(refused)} refused; daemon RSS {first:+.2f} MiB, then {second:+.2f} MiB"
    )
    assert first < 32 and second < 6, f"daemon RSS grew by {first:.1f} MiB, then by {second:.1f} MiB"


def test_request_rate_grants_the_burst_then_the_rate_and_refunds() -> None:
    """The per-uid request bucket (priod/daemon/rate.py): a full burst at first, then ``rate`` per
    second, never more than the burst; unused grants come back; rate 0 means no cap."""
    from priod.daemon.rate import RequestRate

    r = RequestRate()
    assert r.grant(64, 100.0, 10, now=5.0) == 10  # a new uid: the whole burst, no more
    assert r.grant(64, 100.0, 10, now=5.0) == 0
    assert r.wait_s(100.0) == pytest.approx(0.01)  # one token at 100/s
    assert r.grant(64, 100.0, 10, now=5.055) == 5  # 55 ms at 100/s: 5.5 tokens, 5 whole
    r.refund(3)
    assert r.grant(64, 100.0, 10, now=5.055) == 3
    assert r.grant(64, 100.0, 10, now=100.0) == 10  # a long pause refills to the burst only
    assert r.grant(64, 100.0, 10, now=99.0) == 0  # a clock that steps back grants nothing new
    assert RequestRate().grant(64, 0.0, 10, now=0.0) == 64  # 0: no cap
