"""Regions: memory registered once and named by copies, who owns them and who may use them.

A region belongs to the connection that made it (its `Holdings`); its owner may share it with
other uids, whose connections may then name it in copies but not free or share it. Limits are
checked here before anything is mapped. Setting a region up (pinning, allocating, opening an
IPC handle) takes milliseconds per GiB, and giving it back waits for the device, so both run on
executor threads: the event loop goes on serving urgent copies meanwhile.

A region is forgotten at once when it is freed or its owner leaves, but its memory is given back
only once no copy in flight names it (`users`): the copies still queued are cancelled with
``not_found``, and those in flight finish first.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from .config import LimitsConfig
from .engines.base import DeviceMemory, Direction, Engine, HostMemory, LaneKey, Memory
from .engines.sim import sealed_memfd
from .log import error_fields
from .errors import ConnectionClosed, InvalidRequest, LimitExceeded, NotFound, PermissionDenied

__all__ = ["Holdings", "Region", "RegionTable"]

log = structlog.get_logger("priod.regions")


@dataclass(eq=False)
class Holdings:
    """What one connection holds: its regions and the bytes they count against its limits."""

    uid: int
    regions: dict[int, Region] = field(default_factory=dict)
    pinned_bytes: int = 0
    device_bytes: int = 0
    closed: bool = False


@dataclass(eq=False)
class Region:
    """Memory registered once and named by copies."""

    id: int
    owner: Holdings
    kind: str  # "host" | "device"
    nbytes: int
    mem: Memory
    device: int | None
    shared_uids: set[int] = field(default_factory=set)
    users: set[int] = field(default_factory=set)
    """Scheduler ids of copies naming this region; its memory goes back only once none is left."""
    released: bool = False
    freeing: bool = False


class RegionTable:
    """Every live region, by id; the one place regions are made, checked and given back.

    ``cancel_user`` cancels a queued copy (by scheduler id) that names a region being freed;
    the copy's own reply says ``not_found``.
    """

    def __init__(self, engine: Engine, limits: LimitsConfig, cancel_user: Callable[[int], None]) -> None:
        self.engine = engine
        self.limits = limits
        """Replaced on reload; checked at each request."""
        self._cancel_user = cancel_user
        self._ids = itertools.count(1)
        self._regions: dict[int, Region] = {}
        self._releases: set[asyncio.Future[None]] = set()
        # The engine's own key objects: every dict lookup on the per-chunk path then matches
        # by identity instead of comparing dataclasses field by field.
        self._lanes: dict[tuple[int, Direction], LaneKey] = {(i.key.device, i.key.direction): i.key for i in engine.lanes()}

    def __len__(self) -> int:
        return len(self._regions)

    # -- lookups ---------------------------------------------------------------------------
    def owned(self, holder: Holdings, region_id: int) -> Region:
        """A region ``holder`` owns (to free or share it)."""
        region = self._get(region_id)
        if region.owner is not holder:
            raise PermissionDenied(f"region {region_id} belongs to another connection; only its owner may free or share it")
        return region

    def usable(self, holder: Holdings, region_id: int) -> Region:
        """A region ``holder`` may name in a copy: its own, or one shared with its uid."""
        region = self._get(region_id)
        if region.owner is not holder and holder.uid not in region.shared_uids:
            raise PermissionDenied(f"region {region_id} belongs to another client and is not shared with uid {holder.uid}")
        return region

    def _get(self, region_id: int) -> Region:
        region = self._regions.get(region_id)
        if region is None:
            raise NotFound(f"no region {region_id}; use an id returned by alloc_host, alloc_device or register_*")
        return region

    def lane_between(self, dst: Region, src: Region) -> LaneKey:
        """The lane a copy from ``src`` to ``dst`` runs on; its direction follows from their kinds."""
        if src.kind == "host" and dst.kind == "device":
            device, direction = dst.device, Direction.H2D
        elif src.kind == "device" and dst.kind == "host":
            device, direction = src.device, Direction.D2H
        elif src.kind == "device" and dst.kind == "device":
            if src.device != dst.device:
                raise InvalidRequest(f"device-to-device copies must stay on one GPU (src on {src.device}, dst on {dst.device}); copy through a host region")
            device, direction = src.device, Direction.D2D
        else:
            raise InvalidRequest("both regions are host memory; copy between them with memcpy in your own process")
        lane = self._lanes.get((device, direction))  # type: ignore[arg-type]
        if lane is None:
            raise InvalidRequest(f"no lane {direction.value} on device {device}; this daemon serves {sorted(map(str, self._lanes.values()))}")
        return lane

    # -- making regions --------------------------------------------------------------------
    def _check_room(self, holder: Holdings, kind: str, nbytes: int) -> None:
        lim = self.limits
        if len(holder.regions) >= lim.max_regions:
            raise LimitExceeded(f"this connection holds {len(holder.regions)} regions ([limits] max_regions = {lim.max_regions}); free some first")
        if kind == "host" and holder.pinned_bytes + nbytes > lim.max_pinned_bytes:
            raise LimitExceeded(
                f"{nbytes} more pinned bytes would exceed [limits] max_pinned_bytes = {lim.max_pinned_bytes} "
                f"(this connection holds {holder.pinned_bytes}); free a host region or ask for less"
            )
        if kind == "device" and holder.device_bytes + nbytes > lim.max_device_bytes:
            raise LimitExceeded(
                f"{nbytes} more device bytes would exceed [limits] max_device_bytes = {lim.max_device_bytes} "
                f"(this connection holds {holder.device_bytes}); free a device region or ask for less"
            )

    async def alloc_host(self, holder: Holdings, nbytes: int) -> tuple[Region, int]:
        """A host region on a memfd of the daemon's; returns it and the fd for the client."""
        self._check_room(holder, "host", nbytes)
        fd = sealed_memfd("priod-host", nbytes)
        try:
            mem = await self._map_host(fd, nbytes)
            return self._add(holder, "host", nbytes, mem, None), fd
        except BaseException:
            os.close(fd)
            raise

    async def register_host(self, holder: Holdings, nbytes: int, fd: int) -> Region:
        """A host region on the client's memfd (the caller keeps and closes ``fd``)."""
        self._check_room(holder, "host", nbytes)
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            raise InvalidRequest("the passed fd is not a memfd; create it with os.memfd_create(name, os.MFD_ALLOW_SEALING)") from None
        if not seals & fcntl.F_SEAL_SHRINK:
            raise InvalidRequest("seal the memfd against shrinking first: fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK); a shrunk region would fault the daemon")
        try:
            mem = await self._map_host(fd, nbytes)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        return self._add(holder, "host", nbytes, mem, None)

    async def _map_host(self, fd: int, nbytes: int) -> HostMemory:
        started = time.perf_counter()
        # Pinning takes about 0.1 ms per MiB: off the loop.
        mem = await asyncio.get_running_loop().run_in_executor(None, self.engine.map_host, fd, nbytes)
        log.info("host_region_registered", nbytes=nbytes, register_ms=round((time.perf_counter() - started) * 1e3, 3))
        return mem

    async def alloc_device(self, holder: Holdings, nbytes: int, device: int) -> tuple[Region, dict[str, Any], list[int]]:
        """Device memory of the daemon's; returns it, how the client reaches it, and the fds for that."""
        self._check_room(holder, "device", nbytes)
        mem = await asyncio.get_running_loop().run_in_executor(None, self.engine.alloc_device, nbytes, device)
        region = self._add(holder, "device", nbytes, mem, device)
        export = mem.export
        assert export is not None
        if export.fd is not None:
            return region, {"kind": "memfd", "offset": export.offset}, [os.dup(export.fd)]
        return region, {"kind": "cuda_ipc", "handle": export.ipc_handle, "offset": export.offset}, []

    async def register_device(self, holder: Holdings, handle: bytes, offset: int, nbytes: int, device: int) -> Region:
        """The client's own device memory, opened from its IPC handle."""
        self._check_room(holder, "device", nbytes)
        mem = await asyncio.get_running_loop().run_in_executor(None, self.engine.import_device, handle, offset, nbytes, device)
        return self._add(holder, "device", nbytes, mem, device)

    def _add(self, holder: Holdings, kind: str, nbytes: int, mem: Memory, device: int | None) -> Region:
        region = Region(next(self._ids), holder, kind, nbytes, mem, device)
        if holder.closed:  # the client left while we were mapping: undo at once
            region.freeing = True
            self._give_back(region)
            raise ConnectionClosed("client left during region set-up")
        self._regions[region.id] = region
        holder.regions[region.id] = region
        if kind == "host":
            holder.pinned_bytes += nbytes
        else:
            holder.device_bytes += nbytes
        log.debug("region_added", region=region.id, kind=kind, nbytes=nbytes)
        return region

    # -- sharing and freeing ---------------------------------------------------------------
    def share(self, holder: Holdings, region_id: int, uid: int) -> None:
        region = self.owned(holder, region_id)
        region.shared_uids.add(uid)
        log.info("region_shared", region=region.id, with_uid=uid)

    def free(self, holder: Holdings, region_id: int) -> None:
        region = self.owned(holder, region_id)
        if region.users:
            raise InvalidRequest(f"region {region.id} has {len(region.users)} copies queued or in flight; wait for them or cancel them, then free it")
        self.release(region)

    def release_all(self, holder: Holdings) -> None:
        """The owner left: forget its regions (their copies in flight finish first)."""
        for region in list(holder.regions.values()):
            self.release(region)

    def release(self, region: Region) -> None:
        """Forget the region now; give its memory back once no copy in flight names it."""
        if region.freeing:
            return
        region.freeing = True
        self._regions.pop(region.id, None)
        owner = region.owner
        owner.regions.pop(region.id, None)
        if region.kind == "host":
            owner.pinned_bytes -= region.nbytes
        else:
            owner.device_bytes -= region.nbytes
        for request_id in list(region.users):
            self._cancel_user(request_id)
        if not region.users:
            self._give_back(region)

    def copy_ended(self, request_id: int, *regions: Region) -> None:
        """A copy naming ``regions`` ended: a region freed meanwhile can now be given back."""
        for region in regions:
            region.users.discard(request_id)
            if region.freeing and not region.users:
                self._give_back(region)

    def _give_back(self, region: Region) -> None:
        """Release the memory on an executor thread: cudaFree and cudaHostUnregister wait for
        work in flight on the device, and the loop must go on serving urgent copies."""
        if region.released:
            return
        region.released = True
        mem = region.mem
        loop = asyncio.get_running_loop()
        if isinstance(mem, HostMemory):
            fut = loop.run_in_executor(None, self.engine.release_host, mem)
        else:
            assert isinstance(mem, DeviceMemory)
            fut = loop.run_in_executor(None, self.engine.release_device, mem)
        self._releases.add(fut)
        fut.add_done_callback(functools.partial(self._released, region.id))

    def _released(self, region_id: int, fut: asyncio.Future[None]) -> None:
        self._releases.discard(fut)
        if fut.cancelled():
            return
        if (exc := fut.exception()) is not None:
            log.error("region_release_failed", region=region_id, **error_fields(exc))
        else:
            log.debug("region_released", region=region_id)

    async def wait_released(self) -> None:
        """Wait for every release under way (before the engine is closed)."""
        await asyncio.gather(*list(self._releases), return_exceptions=True)
