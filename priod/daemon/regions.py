"""Regions: memory registered once and named by copies, who owns them and who may use them.

A region belongs to the connection that made it (its `Holdings`); its owner may share it with
other uids, whose connections may then name it in copies but not free or share it. Limits are
checked here before anything is mapped: per connection (`Holdings`), per uid over all its
connections (`UidHoldings`), and for the whole daemon (`Caps`: pinned host memory below physical
RAM, regions below the fds the process may open). Setting a region up (pinning, allocating, opening an
IPC handle) takes milliseconds per GiB, and giving it back waits for the device, so both run on
executor threads: the event loop goes on serving urgent copies meanwhile.

A region is forgotten at once when it is freed or its owner leaves, but its memory is given back
only once no copy in flight names it (`users`): the copies still queued are cancelled with
``not_found``, and those in flight finish first.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import resource
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import structlog

from priod.common.types import Direction, LaneKey
from priod.daemon.config import LimitsConfig
from priod.daemon.engines.base import DeviceMemory, Engine, HostMemory, Memory
from priod.daemon.engines.sim import sealed_memfd
from priod.daemon.hostfd import check_host_fd
from priod.daemon.log import error_fields
from priod.daemon.rate import RequestRate
from priod.errors import ConnectionClosed, InvalidRequest, LimitExceeded, NotFound, PermissionDenied

__all__ = ["Caps", "Holdings", "Region", "RegionTable", "UidHoldings", "check_host_fd"]

_H2D, _D2H = Direction.H2D, Direction.D2H
"""Module globals: ``Direction.H2D`` costs ~55 ns more on Python 3.11 (EnumType's __getattr__),
and `RegionTable.lane_between` reads one per copy."""

log = structlog.get_logger("priod.daemon.regions")

FDS_PER_REGION = 2
"""Open fds a region may keep: its mapping's (Python's mmap keeps a dup of the fd) and, for a
sim device region, the memfd itself."""


@dataclass(eq=False)
class UidHoldings:
    """What all connections of one uid hold together, counted against its per-uid limits.

    Regions and bytes are counted from the moment their set-up is accepted (other connections'
    set-ups run meanwhile), until they are released.
    """

    uid: int
    regions: int = 0
    pinned_bytes: int = 0
    device_bytes: int = 0
    queued_requests: int = 0
    queued_bytes: int = 0
    queued_segments: int = 0
    """Segments of pending batches (copy_batch), for [limits] max_queued_segments_per_uid."""
    holders: int = 0
    """Connections of this uid now open (their `Holdings`)."""
    requests: RequestRate = field(default_factory=RequestRate)
    """Its request rate (``[limits] max_requests_per_s_per_uid``), shared by its connections."""

    @property
    def unused(self) -> bool:
        return not (
            self.holders
            or self.regions
            or self.pinned_bytes
            or self.device_bytes
            or self.queued_requests
            or self.queued_bytes
            or self.queued_segments
        )

    def figures(self) -> dict[str, int]:
        return {
            "uid": self.uid,
            "connections": self.holders,
            "regions": self.regions,
            "pinned_bytes": self.pinned_bytes,
            "device_bytes": self.device_bytes,
            "queued_requests": self.queued_requests,
            "queued_bytes": self.queued_bytes,
        }


@dataclass(eq=False)
class Holdings:
    """What one connection holds: its regions and the bytes they count against its limits."""

    uid: int
    regions: dict[int, Region] = field(default_factory=dict)
    pinned_bytes: int = 0
    device_bytes: int = 0
    closed: bool = False
    tally: UidHoldings = field(init=False, repr=False)
    """Its uid's holdings over all connections: one per uid when made by `RegionTable.holdings`."""

    def __post_init__(self) -> None:
        self.tally = UidHoldings(self.uid)


@dataclass(frozen=True)
class Caps:
    """The daemon-wide limits in force: ``[limits] *_total`` settings, or what 0 derives."""

    pinned_bytes: int
    device_bytes: int
    """0: no cap of the daemon's own (a GPU refuses what does not fit)."""
    regions: int


def physical_memory() -> int:
    """Bytes of RAM (0 where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def open_files_limit() -> int:
    """RLIMIT_NOFILE's soft limit (what this process may open), or a large figure if unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


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
    file: tuple[int, int] | None = None
    """The memfd under its memory, as (st_dev, st_ino) when it was registered: host regions and
    sim device regions; None for CUDA device memory. Two live regions with one file are the
    same pages (a client may register one memfd twice, or a sim device region's memfd as a
    host region), so a copy between them can overlap (`RegionTable.memory_shift`). The
    region's mapping keeps the file open, so its inode is not reused while the region lives."""
    file_offset: int = 0
    """Where the region begins in that file (its byte 0 is the file's byte ``file_offset``)."""


def memfd_identity(fd: int) -> tuple[int, int]:
    """The file behind ``fd`` as (st_dev, st_ino): one memfd whichever fd names it."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


class RegionTable:
    """Every live region, by id; the one place regions are made, checked and given back.

    ``cancel_user`` cancels a queued copy (by scheduler id) that names a region being freed;
    the copy's own reply says ``not_found``. ``fd_reserve`` says how many fds the rest of the
    daemon may need (connections and their passing fds, logs, the engine): regions get the
    rest of RLIMIT_NOFILE, unless ``[limits] max_regions_total`` sets fewer.
    """

    def __init__(
        self,
        engine: Engine,
        limits: LimitsConfig,
        cancel_user: Callable[[int], None],
        fd_reserve: Callable[[], int] = lambda: 512,
    ) -> None:
        self.engine = engine
        self.limits = limits
        """Replaced on reload; checked at each request."""
        self._cancel_user = cancel_user
        self._fd_reserve = fd_reserve
        self._ids = itertools.count(1)
        self._regions: dict[int, Region] = {}
        self._releases: set[asyncio.Future[None]] = set()
        self._uids: dict[int, UidHoldings] = {}
        self._memory = physical_memory()
        self.total_regions = 0
        """Regions held or being set up, all clients together (as are the two below)."""
        self.total_pinned_bytes = 0
        self.total_device_bytes = 0
        # The engine's own key objects: every dict lookup on the per-chunk path then matches
        # by identity instead of comparing dataclasses field by field.
        self._lanes: dict[tuple[int, Direction, int | None], LaneKey] = {
            (i.key.device, i.key.direction, i.key.peer): i.key for i in engine.lanes()
        }

    def __len__(self) -> int:
        return len(self._regions)

    # -- holders ---------------------------------------------------------------------------
    def holdings(self, uid: int) -> Holdings:
        """A new connection's `Holdings`, counted in its uid's tally with the uid's other connections."""
        holder = Holdings(uid)
        holder.tally = self._uids.setdefault(uid, holder.tally)
        holder.tally.holders += 1
        return holder

    def uid_holdings(self, uid: int) -> UidHoldings | None:
        return self._uids.get(uid)

    def all_uid_holdings(self) -> list[UidHoldings]:
        return [self._uids[uid] for uid in sorted(self._uids)]

    def forget_if_unused(self, tally: UidHoldings) -> None:
        """Drop a uid's tally once it has no connection and holds nothing."""
        if tally.unused and self._uids.get(tally.uid) is tally:
            del self._uids[tally.uid]

    def caps(self) -> Caps:
        """The daemon-wide limits now (RLIMIT_NOFILE and the settings may change at run time)."""
        lim = self.limits
        pinned = lim.max_pinned_total_bytes or self._memory // 2 or 1 << 62
        device = lim.max_device_total_bytes
        if not device and self.engine.name == "sim":
            device = self._memory // 2 or 1 << 62  # the sim's device memory is host memory (memfds)
        by_fds = max(0, (open_files_limit() - self._fd_reserve()) // FDS_PER_REGION)
        regions = min(lim.max_regions_total, by_fds) if lim.max_regions_total else by_fds
        return Caps(pinned, device, regions)

    def figures(self) -> dict[str, int]:
        """What all clients hold together, and the daemon-wide caps (for `priod status`)."""
        caps = self.caps()
        return {
            "regions": self.total_regions,
            "regions_cap": caps.regions,
            "pinned_bytes": self.total_pinned_bytes,
            "pinned_cap": caps.pinned_bytes,
            "device_bytes": self.total_device_bytes,
            "device_cap": caps.device_bytes,
        }

    # -- lookups ---------------------------------------------------------------------------
    def owned(self, holder: Holdings, region_id: int) -> Region:
        """A region ``holder`` owns (to free or share it)."""
        region = self._get(region_id)
        if region.owner is not holder:
            raise PermissionDenied(
                f"region {region_id} belongs to another connection; only its owner may free or share it"
            )
        return region

    def usable(self, holder: Holdings, region_id: int) -> Region:
        """A region ``holder`` may name in a copy: its own, or one shared with its uid."""
        region = self._regions.get(region_id)  # `_get`, written out: twice per copy
        if region is None:
            region = self._get(region_id)  # raises NotFound
        if region.owner is not holder and holder.uid not in region.shared_uids:
            raise PermissionDenied(
                f"region {region_id} belongs to another client and is not shared with uid {holder.uid}"
            )
        return region

    def _get(self, region_id: int) -> Region:
        region = self._regions.get(region_id)
        if region is None:
            raise NotFound(f"no region {region_id}; use an id returned by alloc_host, alloc_device or register_*")
        return region

    def lane_between(self, dst: Region, src: Region) -> LaneKey:
        """The lane a copy from ``src`` to ``dst`` runs on; its direction follows from their kinds."""
        if src.kind == "host" and dst.kind == "device":
            device, direction = dst.device, _H2D
        elif src.kind == "device" and dst.kind == "host":
            device, direction = src.device, _D2H
        elif src.kind == "device" and dst.kind == "device":
            if src.device != dst.device:
                # Across GPUs: the peer lane of the pair, driven from the source GPU.
                lane = self._lanes.get((src.device, Direction.PEER, dst.device))  # type: ignore[arg-type]
                if lane is None:
                    raise InvalidRequest(
                        f"no peer lane gpu{src.device} -> gpu{dst.device}: this daemon has no peer path between those GPUs "
                        "(one GPU, or the engine found no peer access between them); copy through a host region"
                    )
                return lane
            device, direction = src.device, Direction.D2D
        else:
            raise InvalidRequest("both regions are host memory; copy between them with memcpy in your own process")
        lane = self._lanes.get((device, direction, None))  # type: ignore[arg-type]
        if lane is None:
            raise InvalidRequest(
                f"no lane {direction.value} on device {device}; this daemon serves {sorted(map(str, self._lanes.values()))}"
            )
        return lane

    @staticmethod
    def memory_shift(dst: Region, src: Region) -> int | None:
        """Where ``src``'s offsets lie in ``dst``'s offsets' terms when the two may be one memory:
        one region (0), regions over one memfd (the same file: a memfd registered twice, or a
        sim device region's memfd registered as a host region; the difference of their offsets
        in it), or device regions over one allocation (cuda imports of the same IPC handle
        share it: the pointers' difference); None when they cannot overlap."""
        if dst is src:
            return 0
        if dst.file is not None and dst.file == src.file:
            return src.file_offset - dst.file_offset
        if dst.kind == "device" and src.kind == "device" and dst.device == src.device:
            a, b = getattr(dst.mem, "pointer", None), getattr(src.mem, "pointer", None)  # cuda's device address
            if isinstance(a, int) and isinstance(b, int):
                return b - a
        return None

    @staticmethod
    def overlapping(dst: Region, dst_offset: int, src: Region, src_offset: int, nbytes: int) -> bool:
        """Whether a copy's source and destination bytes overlap (see `memory_shift`). Copy
        engines do not copy overlapping ranges as memmove does."""
        shift = RegionTable.memory_shift(dst, src)
        return shift is not None and abs(dst_offset - (src_offset + shift)) < nbytes

    # -- making regions --------------------------------------------------------------------
    def _claim(self, holder: Holdings, kind: str, nbytes: int) -> None:
        """Check every limit for one more region of ``nbytes`` and count it at once in the uid's
        and the daemon's totals (set-up takes milliseconds, and other connections' set-ups run
        meanwhile); `_unclaim` takes it back if the set-up fails. A connection sets up one
        region at a time, so its own counts wait for `_add`."""
        lim, tally = self.limits, holder.tally
        if len(holder.regions) >= lim.max_regions:
            raise LimitExceeded(
                f"this connection holds {len(holder.regions)} regions ([limits] max_regions = {lim.max_regions}); free some first"
            )
        if tally.regions >= lim.max_regions_per_uid:
            raise LimitExceeded(
                f"uid {holder.uid} holds {tally.regions} regions over its connections ([limits] max_regions_per_uid = {lim.max_regions_per_uid}); free some first"
            )
        caps = self.caps()
        if self.total_regions >= caps.regions:
            raise LimitExceeded(
                f"the daemon holds {self.total_regions} regions, its cap ([limits] max_regions_total = {lim.max_regions_total}; "
                f"0 means what its open-file limit allows: {caps.regions} now); free some or retry later"
            )
        if kind == "host":
            if holder.pinned_bytes + nbytes > lim.max_pinned_bytes:
                raise LimitExceeded(
                    f"{nbytes} more pinned bytes would exceed [limits] max_pinned_bytes = {lim.max_pinned_bytes} "
                    f"(this connection holds {holder.pinned_bytes}); free a host region or ask for less"
                )
            if tally.pinned_bytes + nbytes > lim.max_pinned_bytes_per_uid:
                raise LimitExceeded(
                    f"{nbytes} more pinned bytes would exceed [limits] max_pinned_bytes_per_uid = {lim.max_pinned_bytes_per_uid} "
                    f"(uid {holder.uid} holds {tally.pinned_bytes} over its connections); free a host region or ask for less"
                )
            if self.total_pinned_bytes + nbytes > caps.pinned_bytes:
                raise LimitExceeded(
                    f"{nbytes} more pinned bytes would exceed the daemon's cap of {caps.pinned_bytes} ([limits] max_pinned_total_bytes = "
                    f"{lim.max_pinned_total_bytes}; 0 means half the host's memory); all clients hold {self.total_pinned_bytes}: ask for less or retry later"
                )
            tally.pinned_bytes += nbytes
            self.total_pinned_bytes += nbytes
        else:
            if holder.device_bytes + nbytes > lim.max_device_bytes:
                raise LimitExceeded(
                    f"{nbytes} more device bytes would exceed [limits] max_device_bytes = {lim.max_device_bytes} "
                    f"(this connection holds {holder.device_bytes}); free a device region or ask for less"
                )
            if tally.device_bytes + nbytes > lim.max_device_bytes_per_uid:
                raise LimitExceeded(
                    f"{nbytes} more device bytes would exceed [limits] max_device_bytes_per_uid = {lim.max_device_bytes_per_uid} "
                    f"(uid {holder.uid} holds {tally.device_bytes} over its connections); free a device region or ask for less"
                )
            if caps.device_bytes and self.total_device_bytes + nbytes > caps.device_bytes:
                raise LimitExceeded(
                    f"{nbytes} more device bytes would exceed the daemon's cap of {caps.device_bytes} ([limits] max_device_total_bytes = "
                    f"{lim.max_device_total_bytes}; 0 means none on a GPU, half the host's memory on sim); all clients hold {self.total_device_bytes}: "
                    "ask for less or retry later"
                )
            tally.device_bytes += nbytes
            self.total_device_bytes += nbytes
        tally.regions += 1
        self.total_regions += 1

    def _unclaim(self, tally: UidHoldings, kind: str, nbytes: int) -> None:
        tally.regions -= 1
        self.total_regions -= 1
        if kind == "host":
            tally.pinned_bytes -= nbytes
            self.total_pinned_bytes -= nbytes
        else:
            tally.device_bytes -= nbytes
            self.total_device_bytes -= nbytes
        self.forget_if_unused(tally)

    async def alloc_host(self, holder: Holdings, nbytes: int) -> tuple[Region, int]:
        """A host region on a memfd of the daemon's; returns it and the fd for the client."""
        self._claim(holder, "host", nbytes)
        try:
            fd = sealed_memfd("priod-host", nbytes)
            try:
                mem = await self._map_host(fd, nbytes)
                return self._add(holder, "host", nbytes, mem, None, memfd_identity(fd)), fd
            except BaseException:
                os.close(fd)
                raise
        except BaseException:
            self._unclaim(holder.tally, "host", nbytes)
            raise

    async def register_host(self, holder: Holdings, nbytes: int, fd: int) -> Region:
        """A host region on the client's memfd (the caller keeps and closes ``fd``)."""
        check_host_fd(fd)
        self._claim(holder, "host", nbytes)
        try:
            try:
                mem = await self._map_host(fd, nbytes)
            except ValueError as exc:
                raise InvalidRequest(str(exc)) from exc
            return self._add(holder, "host", nbytes, mem, None, memfd_identity(fd))
        except BaseException:
            self._unclaim(holder.tally, "host", nbytes)
            raise

    async def _map_host(self, fd: int, nbytes: int) -> HostMemory:
        started = time.perf_counter()
        # Pinning takes about 0.1 ms per MiB: off the loop.
        mem = await asyncio.get_running_loop().run_in_executor(None, self.engine.map_host, fd, nbytes)
        log.info("host_region_registered", nbytes=nbytes, register_ms=round((time.perf_counter() - started) * 1e3, 3))
        return mem

    async def alloc_device(
        self, holder: Holdings, nbytes: int, device: int
    ) -> tuple[Region, dict[str, Any], list[int]]:
        """Device memory of the daemon's; returns it, how the client reaches it, and the fds for that."""
        self._claim(holder, "device", nbytes)
        try:
            mem = await asyncio.get_running_loop().run_in_executor(None, self.engine.alloc_device, nbytes, device)
            export = mem.export
            assert export is not None
            # The sim engine's device memory is a memfd the client gets: it may register it
            # as a host region too, and copies between the two are then within one memory.
            file = memfd_identity(export.fd) if export.kind == "memfd" else None
            region = self._add(holder, "device", nbytes, mem, device, file, export.offset)
        except BaseException:
            self._unclaim(holder.tally, "device", nbytes)
            raise
        # The client keeps a dup of the fd: the memory lives as long as it does, daemon or not.
        reply: dict[str, Any] = {"kind": export.kind, "offset": export.offset}
        if export.kind == "vmm_fd":
            reply["size"] = export.size
        return region, reply, [os.dup(export.fd)]

    async def register_device(self, holder: Holdings, handle: bytes, offset: int, nbytes: int, device: int) -> Region:
        """The client's own device memory, opened from its IPC handle."""
        return await self._import_device(
            holder, nbytes, device, self.engine.import_device, handle, offset, nbytes, device
        )

    async def register_device_fd(
        self, holder: Holdings, fd: int, size: int, offset: int, nbytes: int, device: int
    ) -> Region:
        """The client's own ``cuMemCreate`` memory, imported from its POSIX fd and mapped whole
        (``size`` bytes), the region being ``nbytes`` at ``offset``. The caller keeps and
        closes ``fd``."""
        return await self._import_device(
            holder, nbytes, device, self.engine.import_device_fd, fd, size, offset, nbytes, device
        )

    async def register_device_pool(
        self, holder: Holdings, fd: int, export: bytes, offset: int, nbytes: int, device: int
    ) -> Region:
        """The client's own memory of a stream-ordered pool: the pool imported from its POSIX
        fd, the allocation from its export data, the region being ``nbytes`` at ``offset`` in
        it. The caller keeps and closes ``fd``."""
        return await self._import_device(
            holder, nbytes, device, self.engine.import_device_pool, fd, export, offset, nbytes, device
        )

    async def register_device_memfd(self, holder: Holdings, fd: int, offset: int, nbytes: int, device: int) -> Region:
        """A sim device region's memfd, registered again by its client after a daemon restart
        (sim only; the engine refuses it elsewhere). The caller keeps and closes ``fd``."""
        return await self._import_device(
            holder, nbytes, device, self.engine.import_device_memfd, fd, offset, nbytes, device, file=memfd_identity(fd)
        )

    async def _import_device(
        self,
        holder: Holdings,
        nbytes: int,
        device: int,
        open_it: Callable[..., Memory],
        *args: object,
        file: tuple[int, int] | None = None,
    ) -> Region:
        """Count ``nbytes`` more of ``holder``'s device memory and open the client's memory
        with ``open_it(*args)`` on an executor thread (imports take milliseconds)."""
        self._claim(holder, "device", nbytes)
        try:
            mem = await asyncio.get_running_loop().run_in_executor(None, open_it, *args)
            return self._add(holder, "device", nbytes, mem, device, file)
        except BaseException:
            self._unclaim(holder.tally, "device", nbytes)
            raise

    def _add(
        self,
        holder: Holdings,
        kind: str,
        nbytes: int,
        mem: Memory,
        device: int | None,
        file: tuple[int, int] | None = None,
        file_offset: int = 0,
    ) -> Region:
        region = Region(next(self._ids), holder, kind, nbytes, mem, device, file=file, file_offset=file_offset)
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
        if device is None:
            log.debug("region_added", region=region.id, kind=kind, nbytes=nbytes)
        else:
            log.debug(
                "region_added",
                region=region.id,
                kind=kind,
                nbytes=nbytes,
                device=device,
                gpu=self.engine.device_uuid(device),
            )
        return region

    # -- sharing and freeing ---------------------------------------------------------------
    def share(self, holder: Holdings, region_id: int, uid: int) -> None:
        region = self.owned(holder, region_id)
        cap = self.limits.max_shares_per_region
        if uid not in region.shared_uids and len(region.shared_uids) >= cap:
            raise LimitExceeded(
                f"region {region.id} is shared with {len(region.shared_uids)} uids already ([limits] max_shares_per_region = {cap})"
            )
        region.shared_uids.add(uid)
        log.info("region_shared", region=region.id, with_uid=uid)

    def free(self, holder: Holdings, region_id: int, own: Collection[int] = ()) -> None:
        """The owner frees a region. Its own copies naming it (``own``: their scheduler ids)
        must end first; other connections' copies (a uid it was shared with) are cancelled with
        ``not_found`` if queued or held, and finish if in flight: no one else can keep the
        owner's memory pinned by queuing a copy that never runs."""
        region = self.owned(holder, region_id)
        mine = len(region.users.intersection(own))
        if mine:
            raise InvalidRequest(
                f"region {region.id} has {mine} of this connection's copies queued or in flight; wait for them or "
                "cancel them, then free it"
            )
        self.release(region)

    def release_all(self, holder: Holdings) -> None:
        """The owner left: forget its regions (their copies in flight finish first)."""
        for region in list(holder.regions.values()):
            self.release(region)
        holder.tally.holders -= 1
        self.forget_if_unused(holder.tally)

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
        self._unclaim(owner.tally, region.kind, region.nbytes)
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

    def release_host_later(self, mem: HostMemory) -> None:
        """Release host memory that is no region's (a copy ring's) as a region's is: on an
        executor thread, counted among the releases `wait_released` waits for."""
        fut = asyncio.get_running_loop().run_in_executor(None, self.engine.release_host, mem)
        self._releases.add(fut)
        fut.add_done_callback(functools.partial(self._released, None))

    def _released(self, region_id: int | None, fut: asyncio.Future[None]) -> None:
        self._releases.discard(fut)
        if fut.cancelled():
            return
        if (exc := fut.exception()) is not None:
            if region_id is None:
                log.error("ring_release_failed", **error_fields(exc))
            else:
                log.error("region_release_failed", region=region_id, **error_fields(exc))
        elif region_id is not None:
            log.debug("region_released", region=region_id)

    async def wait_released(self) -> None:
        """Wait for every release under way (before the engine is closed)."""
        await asyncio.gather(*list(self._releases), return_exceptions=True)
