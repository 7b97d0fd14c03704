"""The front door's choice of path: an urgent copy this process can make itself takes the direct
path (its own copy, announced on the connection's hold page so that the daemon holds bulk back
on the lane meanwhile); every other copy goes through the daemon.

Why: through the daemon an urgent copy pays a round trip between two Python processes (about
150-250 us on the H200's host) on top of the copy, while the direct path costs the copy and two
words written to shared memory (docs/benchmarks.md). The daemon still arbitrates: it holds bulk
back for a direct copy only within the uid's hold budget, and says on the page when that budget
is spent, and then the copy goes through the daemon instead of running un-held.

What "this process can make the copy itself" means, per engine:
- ``sim``: both regions are mapped here (host regions and the sim's device regions are shared
  memfds); the client moves the bytes between the two mappings itself.
- ``cuda``: the device region is open in this process (registered from this process's memory,
  or a daemon allocation opened with `Region.device_view` or `Region.torch`, which means a CUDA
  context is already there: priod never makes one for this path), and the host region is pinned
  here. Pinning takes about 0.1 ms a MiB, so it never happens inside a copy: the first urgent
  copy that finds a host region unpinned starts pinning it on a thread and goes through the
  daemon; later copies take the direct path once it is pinned. `forget` unpins it when freed.

Only copies of the ``urgent`` class take it, and only without ``wait_event`` or
``signal_event`` (the daemon orders those on the GPU). A direct copy has landed when the call
returns, and cannot be cancelled once it has begun.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from priod.client.base import Region
from priod.errors import InvalidRequest
from priod.wire.batch import Segments, encode_segments
from priod.wire.replies import CopyBatchReply, CopyReply

if TYPE_CHECKING:
    from priod.client.direct import DirectCopies, DirectPair, HoldPage, PinnedHost

__all__ = ["DIRECT_CLASS", "DIRECT_PATH", "CopyPath", "DirectRoute", "check_copy_path"]

CopyPath = Literal["auto", "direct", "daemon"]
"""``auto``: direct where this process can make the copy, else the daemon; or force one."""
DIRECT_CLASS = "urgent"
"""The class whose copies may take the direct path: the strict class of the shipped config."""
DIRECT_PATH = "direct"
"""A result's ``path`` for a copy this process made itself."""
_PATHS = ("auto", "direct", "daemon")


def check_copy_path(path: str) -> CopyPath:
    if path not in _PATHS:
        raise InvalidRequest(f"path = {path!r} is not one of {', '.join(repr(p) for p in _PATHS)}")
    return path  # type: ignore[return-value]  # checked just above


class DirectRoute:
    """One connection's direct path: which copies can take it, and making them. Thread-safe."""

    def __init__(self, backend: str, open_page: Callable[[], HoldPage] | None = None) -> None:
        """``open_page``: a call that opens the connection's hold page (a request to the
        daemon), made on the first direct copy; None where the caller opens it (`set_page`)."""
        self.backend = backend
        self._open_page = open_page
        self._page: HoldPage | None = None
        self._copies: DirectCopies | None = None
        self._pairs: dict[tuple[int, int], DirectPair] = {}
        self._ready: dict[tuple[int, int], int] = {}
        """(dst, src) region ids that passed `why_not` -> their hold page slot: what holds for
        the pair until a region is freed (`forget`). An urgent copy on the front door then pays
        a dict lookup and the page's word instead of a dozen calls, which cost tens of
        microseconds on a host whose CPU has just woken."""
        self._pins: dict[int, PinnedHost | None] = {}
        """Host regions pinned here by id; None while a thread pins one."""
        self._lock = threading.Lock()

    # -- which path ---------------------------------------------------------------------------
    def takes(self, dst: Region, src: Region, options: Any, path: CopyPath) -> bool:
        """Whether this copy takes the direct path (`why_not` says why not); ``path="direct"``
        that cannot raises `InvalidRequest` saying why."""
        if path == "daemon":
            return False
        slot = self._ready.get((dst.id, src.id))
        page = self._page
        if (
            slot is not None
            and page is not None
            and options.get("priority") == DIRECT_CLASS
            and options.get("wait_event") is None
            and options.get("signal_event") is None
            and not page.refused(slot)
        ):
            return True
        why = self.why_not(dst, src, options)
        if why is not None and path == "direct":
            raise InvalidRequest(f"this copy cannot take the direct path: {why}")
        if why is None:
            # A region freed meanwhile by another thread may leave its entry behind: its copies
            # then fail as a freed region's do (`copy`: not mapped in this process any more).
            slot = _slot(self.page(), dst, src)
            with self._lock:  # `forget` walks the dict under it
                self._ready[(dst.id, src.id)] = slot
        return why is None

    def why_not(self, dst: Region, src: Region, options: Any) -> str | None:
        """None where this process can make the copy itself, else why it cannot."""
        return self.eligible(dst, src, options) or self.refused(dst, src)

    def eligible(self, dst: Region, src: Region, options: Any) -> str | None:
        """`why_not`, short of the hold page's word (which needs the page open)."""
        priority = options.get("priority")
        if priority != DIRECT_CLASS:
            return f"only {DIRECT_CLASS} copies take the direct path, not {priority or 'normal'} ones"
        if options.get("wait_event") is not None or options.get("signal_event") is not None:
            return "a copy with wait_event or signal_event goes through the daemon, which orders it on the GPU"
        if {dst.kind, src.kind} != {"host", "device"}:
            return "a direct copy goes between a host region and a device region"
        host, device = (src, dst) if dst.kind == "device" else (dst, src)
        if host.array is None or (self.backend == "sim" and device.array is None):
            return "a region is not mapped in this process any more (freed, or its connection closed)"
        if self.backend == "sim":
            return None
        if self.backend != "cuda":
            return f"the daemon's {self.backend!r} engine has no direct path"
        if device.address(on_gpu=True) is None:
            return (
                "the device region is not open in this process: register it from this process (register_device), "
                "or open it once with Region.device_view() or Region.torch()"
            )
        if not self._pinned(host, device):
            return "the host region is being pinned in this process; urgent copies take the direct path once it is"
        return None

    def refused(self, dst: Region, src: Region) -> str | None:
        """Why not, from the hold page: the daemon's word that this uid's hold budget on the
        lane is spent (a copy made then would run un-held)."""
        page = self.page()
        if page.refused(_slot(page, dst, src)):
            return "this uid's hold budget on the lane is spent for now; the copy goes through the daemon"
        return None

    @property
    def has_page(self) -> bool:
        return self._page is not None

    def set_page(self, page: HoldPage) -> None:
        """The hold page, opened by the caller (the asyncio client awaits it)."""
        with self._lock:
            if self._page is None:
                self._page = page
                return
        page.close()

    def page(self) -> HoldPage:
        """The connection's hold page, opened on first need."""
        page = self._page
        if page is None:
            if self._open_page is None:
                raise InvalidRequest("the hold page is not open; open it with hold_page() first")
            with self._lock:
                if self._page is None:
                    self._page = self._open_page()
                page = self._page
        assert page is not None
        return page

    def _pinned(self, host: Region, device: Region) -> bool:
        """Whether ``host`` is pinned here; if not, and no thread is pinning it, start one."""
        with self._lock:
            if host.id in self._pins:
                return self._pins[host.id] is not None
            self._pins[host.id] = None
        threading.Thread(target=self._pin, args=(host, device), name="priod-pin", daemon=True).start()
        return False

    def _pin(self, host: Region, device: Region) -> None:
        from priod.client.cuda_ipc import local_ordinal
        from priod.client.direct import pin_host
        from priod.common.cuda.driver import DeviceScope

        try:
            # In the context of the device region's GPU, which this process has (the region is
            # open here): pinning on a thread's default device could make another context.
            ordinal = local_ordinal(device.device_uuid) if device.device_uuid else device.device or 0
            with DeviceScope(ordinal):
                pin = pin_host(host)
        except Exception:
            return  # stays None: this region's copies keep to the daemon path
        with self._lock:
            if host.id in self._pins:
                self._pins[host.id] = pin
                return
        pin.close()  # freed while it was being pinned

    def forget(self, region: Region) -> None:
        """``region`` is being freed: unpin it here, drop what was resolved for it."""
        with self._lock:
            pin = self._pins.pop(region.id, None)
            for key in [k for k in self._pairs if region.id in k]:
                del self._pairs[key]
            for key in [k for k in self._ready if region.id in k]:
                del self._ready[key]
        if pin is not None:
            pin.close()

    # -- making copies ------------------------------------------------------------------------
    def copy(self, dst: Region, src: Region, nbytes: int | None, dst_offset: int, src_offset: int) -> CopyReply:
        """Copy ``nbytes`` (default: as much as both regions hold past their offsets) and
        return once they have landed. Checked as the daemon checks a copy, with its messages."""
        if nbytes is None:
            nbytes = min(dst.nbytes - dst_offset, src.nbytes - src_offset)
        _check_bounds(dst, dst_offset, src, src_offset, nbytes)
        t0 = time.perf_counter()
        if self.backend == "sim":
            self._sim(dst, src, lambda: _move(dst, dst_offset, src, src_offset, nbytes))
        else:
            self._pair(dst, src).copy(nbytes, dst_offset=dst_offset, src_offset=src_offset)
        us = (time.perf_counter() - t0) * 1e6
        return CopyReply(nbytes, 0.0, us, us, DIRECT_PATH)

    @staticmethod
    def check_batch(dst: Region, src: Region, segments: Any) -> Segments:
        """The batch's table, checked as the daemon checks one (`Segments`), with its messages."""
        table = Segments.decode(encode_segments(segments))
        table.check_regions(dst.nbytes, src.nbytes, None, dst.id, src.id)
        return table

    def copy_batch(self, dst: Region, src: Region, segments: Any) -> CopyBatchReply:
        """Copy every segment and return once all have landed. ``segments`` as for
        ``copy_batch``, or a table `check_batch` returned.

        The hold begins before the table is checked: the daemon closes the lane's gate and the
        bulk chunk running drains while this thread checks the table (tens of microseconds on a
        thread that has just woken), as `DirectPair.copy_batch` does. A table that fails its
        checks moves no byte and ends the hold at once."""
        page = self.page()
        slot = self._slot_of(page, dst, src)
        t0 = time.perf_counter()
        page.begin(slot)
        try:
            table = segments if isinstance(segments, Segments) else self.check_batch(dst, src, segments)
            if self.backend == "sim":
                for d, s, n in table.cells.tolist():
                    _move(dst, d, src, s, n)
            else:
                self._pair(dst, src).copy_batch(table.cells)
        finally:
            page.end(slot)
        us = (time.perf_counter() - t0) * 1e6
        return CopyBatchReply(table.total, len(table), 0.0, us, us, DIRECT_PATH)

    def _sim(self, dst: Region, src: Region, move: Callable[[], None]) -> None:
        """The sim's direct copy: the bytes moved here, between the two mappings, inside a hold."""
        page = self.page()
        slot = self._slot_of(page, dst, src)
        page.begin(slot)
        try:
            move()
        finally:
            page.end(slot)

    def _slot_of(self, page: HoldPage, dst: Region, src: Region) -> int:
        """The pair's slot on ``page``: remembered where `takes` passed it, else looked up."""
        slot = self._ready.get((dst.id, src.id))
        return _slot(page, dst, src) if slot is None else slot

    def _pair(self, dst: Region, src: Region) -> DirectPair:
        """The CUDA pair of the two regions' memory in this process, resolved once."""
        pair = self._pairs.get((dst.id, src.id))
        if pair is None:
            from priod.client.direct import DirectCopies

            with self._lock:
                if self._copies is None:
                    self._copies = DirectCopies(self.page())
                copies = self._copies
            ends = []
            for region in (dst, src):
                address = region.address(on_gpu=region.kind == "device")
                if address is None:
                    raise InvalidRequest(f"{region!r} is not mapped in this process any more")
                ends.append((address, region.nbytes))
            pair = copies.pair(ends[0], ends[1])
            with self._lock:  # `forget` walks the dict under it
                self._pairs[(dst.id, src.id)] = pair
        return pair

    def close(self) -> None:
        with self._lock:
            pins = [p for p in self._pins.values() if p is not None]
            self._pins.clear()
            self._pairs.clear()
            self._ready.clear()
            copies, self._copies = self._copies, None
            page, self._page = self._page, None
        if copies is not None:
            copies.close()
        for pin in pins:
            pin.close()
        if page is not None:
            page.close()


def _slot(page: HoldPage, dst: Region, src: Region) -> int:
    device = dst if dst.kind == "device" else src
    return page.slot(device.device_uuid, "h2d" if device is dst else "d2h", device.device or 0)


def _check_bounds(dst: Region, dst_offset: int, src: Region, src_offset: int, nbytes: int) -> None:
    """The daemon's checks of a single copy (messages.py's and copies.py's), with their words."""
    if nbytes <= 0:
        raise InvalidRequest(f"nbytes = {nbytes} is invalid; a copy moves at least 1 byte")
    for name, region, offset in (("dst", dst, dst_offset), ("src", src, src_offset)):
        if offset < 0:
            raise InvalidRequest(f"{name}_offset = {offset} is invalid; offsets are >= 0")
        if offset + nbytes > region.nbytes:
            raise InvalidRequest(
                f"{name}_offset {offset} + nbytes {nbytes} is outside region {region.id} of {region.nbytes} bytes; "
                "copy within the region's size"
            )


def _move(dst: Region, dst_offset: int, src: Region, src_offset: int, nbytes: int) -> None:
    d, s = dst.array, src.array
    if d is None or s is None:
        raise InvalidRequest("a region is not mapped in this process any more (freed, or its connection closed)")
    np.copyto(d[dst_offset : dst_offset + nbytes], s[src_offset : src_offset + nbytes])
