"""A connection's region requests: alloc_*, register_*, free and share, and the reply that names
a region.

They are apart from the session (session.py) because they share nothing with its read loop but
the holdings they act on: each is a call into the region table (regions.py) for this client's
uid. Set-up (alloc_* and register_*) is a coroutine, since pinning takes milliseconds per GiB
on a worker thread; the session runs it as a task and holds the requests behind it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, Protocol

from priod.daemon.engines.base import Engine
from priod.daemon.regions import Holdings, Region, RegionTable
from priod.wire.messages import AllocDevice, AllocHost, Free, RegisterDevice, RegisterHost, Share
from priod.wire.replies import Empty, RegionReply

__all__ = ["RegionRequests"]


class RegionParts(Protocol):
    """What these requests use of the daemon's shared parts: a `session.Shared`, named by this
    protocol because session.py imports this module."""

    @property
    def regions(self) -> RegionTable: ...
    @property
    def engine(self) -> Engine: ...


class RegionRequests:
    """The region handlers of one connection, each ``(request, fds) -> reply`` as the session's
    dispatch table takes them (a set-up handler returns ``(reply, fds to send)``)."""

    __slots__ = ("holdings", "own_copies", "shared")

    def __init__(self, shared: RegionParts, holdings: Holdings, own_copies: Callable[[], Collection[int]]) -> None:
        self.shared = shared
        self.holdings = holdings
        self.own_copies = own_copies
        """The scheduler ids of this connection's copies pending now (`free` tells them apart)."""

    async def alloc_host(self, req: AllocHost, fds: list[int]) -> tuple[RegionReply, list[int]]:
        region, fd = await self.shared.regions.alloc_host(self.holdings, req.nbytes)
        return self._region_reply(region), [fd]

    async def register_host(self, req: RegisterHost, fds: list[int]) -> tuple[RegionReply, list[int]]:
        region = await self.shared.regions.register_host(self.holdings, req.nbytes, fds[0])
        return self._region_reply(region), []

    async def alloc_device(self, req: AllocDevice, fds: list[int]) -> tuple[RegionReply, list[int]]:
        device = self._device(*req.target())
        region, export, out_fds = await self.shared.regions.alloc_device(self.holdings, req.nbytes, device)
        return self._region_reply(region, export), out_fds

    async def register_device(self, req: RegisterDevice, fds: list[int]) -> tuple[RegionReply, list[int]]:
        device = self._device(req.device, req.device_uuid)
        # An fd is the session's: it closes it (close_received) once this returns, the import
        # keeping the allocation (the pool) alive without it.
        if req.kind == "vmm_fd":
            assert req.size is not None  # RegisterDevice.check
            region = await self.shared.regions.register_device_fd(
                self.holdings, fds[0], req.size, req.offset, req.nbytes, device
            )
        elif req.kind == "memfd":
            region = await self.shared.regions.register_device_memfd(
                self.holdings, fds[0], req.offset, req.nbytes, device
            )
        elif req.kind == "pool_fd":
            region = await self.shared.regions.register_device_pool(
                self.holdings, fds[0], req.handle, req.offset, req.nbytes, device
            )
        else:
            region = await self.shared.regions.register_device(
                self.holdings, req.handle, req.offset, req.nbytes, device
            )
        return self._region_reply(region), []

    def _device(self, ordinal: int, device_uuid: str | None) -> int:
        """The daemon's ordinal of the GPU a request names: by UUID when it gives one, since the
        client's own ordinal of that GPU may differ (CUDA_VISIBLE_DEVICES renumbers per process)."""
        return ordinal if device_uuid is None else self.shared.engine.device_ordinal(device_uuid)

    def _region_reply(self, region: Region, export: dict[str, Any] | None = None) -> RegionReply:
        gpu = None if region.device is None else self.shared.engine.device_uuids().get(region.device)
        return RegionReply(region.id, region.nbytes, region.kind, region.device, export, gpu)

    def free(self, req: Free, fds: list[int]) -> Empty:
        self.shared.regions.free(self.holdings, req.region, self.own_copies())
        return Empty()

    def share(self, req: Share, fds: list[int]) -> Empty:
        self.shared.regions.share(self.holdings, req.region, req.uid)
        return Empty()
