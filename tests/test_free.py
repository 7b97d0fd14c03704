"""Freeing a region: the owner's own copies must end first, but no other connection can keep the
owner's memory by queuing a copy into it that never runs (a uid it was shared with, holding a
copy on an event that never fires)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

import priod
from priod.testing import DaemonProcess, daemon_process
from priod.wire.ipc_event import SimEvent


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with daemon_process({"PRIOD_LOG__LEVEL": '"warning"'}) as d:
        yield d


async def test_a_copy_of_another_connection_held_forever_does_not_keep_the_owner_from_freeing(
    daemon: DaemonProcess,
) -> None:
    async with (
        priod.connect(daemon.socket_path, copy_path="daemon") as owner,
        priod.connect(daemon.socket_path, copy_path="daemon") as other,
    ):
        region = await owner.alloc_device(1 << 20)
        await owner.share(region, owner.server.peer["uid"])  # the other connection's uid (the same here)
        src, evr = await other.alloc_host(1 << 20), await other.alloc_device(4096)
        never = SimEvent(evr, 0)
        never.record()  # recorded, never completed: the copy waits for good
        held = other.start_copy(region, src, wait_event=never)
        await asyncio.sleep(0.1)
        assert not held.done()
        await owner.free(region)  # refused before: "has 1 copies queued or in flight"
        with pytest.raises(priod.NotFound):
            await held.wait(timeout=10)


async def test_the_owners_own_pending_copy_still_has_to_end_first(daemon: DaemonProcess) -> None:
    async with priod.connect(daemon.socket_path, copy_path="daemon") as c:
        region, src, evr = await c.alloc_device(1 << 20), await c.alloc_host(1 << 20), await c.alloc_device(4096)
        ev = SimEvent(evr, 0)
        ev.record()
        held = c.start_copy(region, src, wait_event=ev)
        with pytest.raises(priod.InvalidRequest, match=r"has 1 of this connection's copies queued or in flight"):
            await c.free(region)
        ev.complete()
        await held.wait(timeout=10)
        await c.free(region)
