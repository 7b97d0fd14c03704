"""The mailbox: copies through shared memory instead of the socket (priod/mailbox.py)."""

from __future__ import annotations

import asyncio
import os
import struct
import tempfile
import time
from collections.abc import AsyncIterator, Iterator

import numpy as np
import pytest

import priod
from priod.client import SyncClient
from priod.config import load_config
from priod.engines.sim import SimEngine
from priod.mailbox import MAILBOX_BYTES, SUBMITTED, ClientMailbox
from priod.messages import Copy, CopyReply, ErrorReply
from priod.server import Daemon
from priod.testing import DaemonProcess, daemon_process

KiB = 1024


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with daemon_process({"PRIOD_LOG__LEVEL": '"warning"'}) as d:
        yield d


def test_mailbox_copies_land_and_report_like_socket_copies(daemon: DaemonProcess) -> None:
    with SyncClient(daemon.socket_path, mailbox=True, spin_us=500, timeout=30) as c:
        h, d = c.alloc_host(64 * KiB), c.alloc_device(64 * KiB)
        assert h.array is not None and d.array is not None
        for i, prio in enumerate(["urgent", "bulk", "normal", "urgent"]):
            h.array[:] = np.arange(64 * KiB, dtype=np.uint32).astype(np.uint8) + i
            r = c.copy(d, h, 60 * KiB, dst_offset=4 * KiB, priority=prio)
            assert isinstance(r, CopyReply) and r.nbytes == 60 * KiB and r.path in ("dma", "express")
            assert np.array_equal(d.array[4 * KiB :], h.array[: 60 * KiB])
        r = c.copy(h, d, 4 * KiB, deadline_ms=0.001)
        assert r.missed_deadline and np.array_equal(h.array[: 4 * KiB], d.array[: 4 * KiB])
        assert c.status()["totals"]["copies"] >= 5


def test_mailbox_refusals_raise_what_the_socket_would(daemon: DaemonProcess) -> None:
    with SyncClient(daemon.socket_path, mailbox=True, timeout=30) as c:
        h, d = c.alloc_host(4 * KiB), c.alloc_device(4 * KiB)
        with pytest.raises(priod.InvalidRequest, match=r"^dst_offset 1 \+ nbytes 4096 is outside region \d+ of 4096 bytes"):
            c.copy(d, h, 4 * KiB, dst_offset=1)
        with pytest.raises(priod.InvalidRequest, match=r"'vip'"):
            c.copy(d, h, priority="vip")
        c.free(h)
        with pytest.raises(priod.NotFound, match=r"^no region \d+"):
            c.copy(d, h, 16)
        h2 = c.alloc_host(4 * KiB)
        assert c.copy(d, h2).nbytes == 4 * KiB  # the mailbox goes on after refusals


def test_garbage_in_the_mailbox_harms_only_its_writer(daemon: DaemonProcess) -> None:
    """A client scribbling on its page: invalid fields are refused in the page; flipping the
    state back and forth makes no duplicate copy land elsewhere; the daemon serves on."""
    with SyncClient(daemon.socket_path, timeout=30) as evil, SyncClient(daemon.socket_path, timeout=30) as honest:
        mailbox = evil.open_mailbox()
        raw = mailbox._map  # written by hand, as a hostile client would
        # An invalid UTF-8 priority and a zero-byte copy, written by hand.
        struct.pack_into("<QQQQQd32s", raw, 16, 1, 2, 0, 0, 0, float("nan"), b"\xff\xfe")
        struct.pack_into("<II", raw, 0, SUBMITTED, 77)
        evil.kick()
        deadline = time.monotonic() + 10
        while struct.unpack_from("<I", raw, 0)[0] == SUBMITTED and time.monotonic() < deadline:
            time.sleep(0.001)
        state, seq = struct.unpack_from("<II", raw, 0)
        assert seq == 77 and state not in (SUBMITTED,)
        h, d = honest.alloc_host(4 * KiB), honest.alloc_device(4 * KiB)
        assert h.array is not None and d.array is not None
        h.array[:] = 5
        assert honest.copy(d, h).nbytes == 4 * KiB and int(d.array.min()) == 5
        honest.ping()


def test_the_daemon_gone_is_noticed_by_a_waiting_client() -> None:
    with daemon_process({"PRIOD_LOG__LEVEL": '"warning"', "PRIOD_SIM__H2D_GBPS": "0.01"}) as d, SyncClient(d.socket_path, mailbox=True, timeout=30) as c:
        h, dv = c.alloc_host(8 << 20), c.alloc_device(8 << 20)
        d.proc.kill()  # the copy below (0.8 s at 10 MB/s) never gets an answer
        t0 = time.monotonic()
        with pytest.raises(priod.ConnectionClosed):
            c.copy(dv, h)
        assert time.monotonic() - t0 < 5


@pytest.fixture
async def polled_daemon() -> AsyncIterator[Daemon]:
    """An in-process daemon on a sim engine that must be polled, as the cuda engine is."""
    path = os.path.join(tempfile.mkdtemp(prefix="priod-"), "s.sock")
    cfg = load_config(None, environ={}).replace(server={"socket": path}, log={"level": "warning"})
    engine = SimEngine(cfg.sim)
    engine.wakes_on_completion = False
    daemon = Daemon(cfg, engine)
    await daemon.start()
    try:
        yield daemon
    finally:
        await daemon.stop()


async def test_while_urgent_copies_are_about_the_daemon_reads_the_mailbox_unprompted(polled_daemon: Daemon) -> None:
    """After an urgent copy the loop stays awake (urgent_window_ms) and says so in the page;
    a copy put in the mailbox then completes with no kick frame at all."""
    async with priod.connect(polled_daemon.cfg.socket_path) as c:
        h, d = await c.alloc_host(4 * KiB), await c.alloc_device(4 * KiB)
        assert h.array is not None and d.array is not None
        mailbox = await c.open_mailbox()
        assert len(mailbox._map) == MAILBOX_BYTES
        assert not mailbox.daemon_awake()
        await c.copy(d, h, priority="urgent")
        h.array[:] = 9
        mailbox.submit(Copy(d.id, h.id, 4 * KiB, priority="urgent"))  # no kick
        deadline = time.monotonic() + 5
        while (result := mailbox.result()) is None and time.monotonic() < deadline:
            await asyncio.sleep(0.0005)
        assert isinstance(result, CopyReply) and result.nbytes == 4 * KiB, result
        assert int(d.array.min()) == 9
        assert mailbox.daemon_awake(margin_s=0.0)
        mailbox.close()


def test_an_error_reply_round_trips_through_the_page() -> None:
    from priod.mailbox import DaemonMailbox

    daemon_side = DaemonMailbox()
    client_side = ClientMailbox(daemon_side.fd)
    seq = client_side.submit(Copy(1, 2, 3))
    taken = daemon_side.take()
    assert taken is not None and taken[0] == seq and taken[1] == Copy(1, 2, 3)
    assert daemon_side.take() is None  # taken once
    daemon_side.finish(seq, ErrorReply("limit", "too much", 7))
    assert client_side.result() == ErrorReply("limit", "too much", 7)
    client_side.close()
    daemon_side.close()
