"""The simulated engine: real bytes, real FIFO copy engines, modelled bandwidth. Not a mock.

Each lane (device x direction) has a copy-engine thread that takes chunks in submission order
and moves each one whole before the next (non-preemptive, like the hardware), paced to the
configured bandwidth; and an express thread beside it that does not wait for that queue but
shares the link: while both run, the express copy gets ``express_share`` of the bandwidth and
the copy engine the rest (measured on the H200: a copy kernel got about a third of the link).
A co-tenant (another process computing on the GPU) is modelled too: the express path is a
kernel on the SMs, so with ``cotenant_stall_us`` set each express chunk first waits for the
co-tenant's compute time slice, without holding the link; the copy engines do not wait.
"Device memory" is a sealed memfd the client can map too, so tests read what landed.

A multi-GPU host is modelled too (``devices`` > 1): each GPU has its own h2d, d2h and d2d
lanes with their own links (PCIe links are per GPU), and each ordered pair of GPUs a peer lane
(`Direction.PEER`) with a copy engine and link of its own at ``peer_gbps`` (NVLink: each
direction of a pair is its own path), DMA only. With ``host_gbps`` set, every link that touches
host memory (h2d and d2h of all GPUs) also draws on one host-memory bandwidth: while the links
busy at once ask for more than it, each gets its rate scaled by ``host_gbps / demand``
(proportional sharing, as a memory controller under load does roughly), so the sum is the cap.

This module is the engine: its settings, its memory (sealed memfds that both sides map) and
`SimEngine`, which builds the lanes and hands them chunks. What the lanes run (links, the host
bus, the copy-engine threads that pace the bytes, completions and events) is in sim_model.py.
"""

from __future__ import annotations

import fcntl
import math
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from priod.common.gpus import sim_uuid
from priod.common.types import Direction, LaneInfo, LaneKey, Path
from priod.daemon.engines.base import (
    ChunkJob,
    Completion,
    DeviceExport,
    DeviceMemory,
    Engine,
    HostMemory,
    IpcEvent,
    Memory,
    map_fd,
    release_mapping,
)
from priod.daemon.engines.sim_model import HostBus, Job, Link, SimCompletion, SimIpcEvent, Worker
from priod.errors import InvalidRequest
from priod.wire.ipc_event import parse_sim_handle

__all__ = ["SimEngine", "SimSettings", "sealed_memfd"]


@dataclass(frozen=True)
class SimSettings:
    """The simulated engine's figures; config's ``[sim]`` section is one of these."""

    devices: int = 1
    h2d_gbps: float = 2.0
    d2h_gbps: float = 2.0
    d2d_gbps: float = 8.0
    peer_gbps: float = 16.0
    """Each ordered GPU pair's peer link (NVLink-like: faster than a GPU's host link), used
    only with ``devices`` > 1."""
    host_gbps: float = 0.0
    """Host-memory bandwidth shared by every h2d and d2h link of every GPU (0: no shared cap;
    each link then runs at its own rate)."""
    express_share: float = 0.33
    """Share of the link an express copy gets while DMA runs beside it (about a third, measured on the H200)."""
    express_max_bytes: int = 64 << 20
    express_min_bytes: int = 4096
    fault_on_nbytes: int = 0
    """Fault injection for tests: a chunk of exactly this many bytes fails. 0: never."""
    cotenant_stall_us: float = 0.0
    """A co-tenant process computes on the GPU: each express chunk first waits for its compute
    time slice, a delay drawn uniformly from [0.5, 1.0] x this many microseconds (H200 with
    8192^3 bf16 GEMMs in another process: 1,500-2,200 us; 0: the SMs are idle). The wait holds
    no bandwidth and delays neither the DMA path nor other lanes. Changed at run time with
    `SimEngine.set_cotenant_stall`."""
    context_slice_us: float = 1000.0
    """Copy engines time-slice between CUDA contexts: another context's copy (`foreign_copy`)
    waits at most this long for the daemon's context to run out of queued chunks (H200: ~1 ms)."""
    context_switch_us: float = 80.0
    """What switching the engine to another context costs (H200: ~80 us)."""
    polled: bool = False
    """Tell the daemon of no completion: it finds each by polling, as it must on a GPU (what
    ``[server] bulk_poll`` and ``urgent_poll`` cost, measured without one)."""
    uuids: tuple[str, ...] = ()
    """Each device's UUID, as nvidia-smi would print it (``GPU-xxxxxxxx-...``), one per device.
    Empty: made-up ones that are the same every run (`priod.common.gpus.sim_uuid`). Tests set them to
    play GPUs that clients name by UUID."""


def sealed_memfd(name: str, nbytes: int) -> int:
    """A memfd of ``nbytes`` that nobody can shrink (a shrunk mapping would SIGBUS the daemon)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


class SimDeviceMemory(DeviceMemory):
    def __init__(self, fd: int, nbytes: int, device: int) -> None:
        self.nbytes = nbytes
        self.device = device
        self.fd = fd
        self.mapping, self.array = map_fd(fd, nbytes)
        self.export = DeviceExport(fd=fd)


def _landed_word(landed: tuple[HostMemory, int, int]) -> tuple[npt.NDArray[np.uint64], int]:
    """A ring's landed word as the uint64 the engine's thread stores into, and its value."""
    mem, offset, value = landed
    return mem.array[offset : offset + 8].view(np.uint64), value


class SimEngine(Engine):
    """Copy engines simulated with threads; see the module docstring."""

    name = "sim"
    stores_landed = True
    wakes_on_completion = True

    def __init__(self, cfg: SimSettings | None = None, *, seed: int | None = None) -> None:
        """``seed`` seeds this engine's own random draws (the co-tenant waits), for tests that
        want the same waits every run; None: seeded from the OS."""
        self.cfg = cfg or SimSettings()
        self.wakes_on_completion = not self.cfg.polled
        if self.cfg.uuids and len(self.cfg.uuids) != self.cfg.devices:
            raise ValueError(
                f"[sim] uuids lists {len(self.cfg.uuids)} UUIDs for {self.cfg.devices} devices; give one per device, or none"
            )
        self._uuids = {i: (self.cfg.uuids[i] if self.cfg.uuids else sim_uuid(i)) for i in range(self.cfg.devices)}
        self._wake: Callable[[], None] = lambda: None
        self._cotenant_lock = threading.Lock()
        self._cotenant_rng = random.Random(seed)
        self._cotenant_stall_s = 0.0
        self.set_cotenant_stall(self.cfg.cotenant_stall_us)
        rates = {Direction.H2D: self.cfg.h2d_gbps, Direction.D2H: self.cfg.d2h_gbps, Direction.D2D: self.cfg.d2d_gbps}
        self._bus = HostBus(self.cfg.host_gbps * 1e9) if self.cfg.host_gbps > 0 else None
        self._links: dict[LaneKey, Link] = {}
        self._workers: dict[tuple[LaneKey, Path], Worker] = {}
        for device in range(self.cfg.devices):
            for direction, gbps in rates.items():
                bus = self._bus if direction is not Direction.D2D else None
                self._add_lane(LaneKey(device, direction), Link(gbps * 1e9, self.cfg.express_share, bus), tuple(Path))
            for peer in range(self.cfg.devices):
                if peer != device:
                    # DMA only: no express kernel over peer memory is modelled (nor built on cuda).
                    self._add_lane(
                        LaneKey(device, Direction.PEER, peer),
                        Link(self.cfg.peer_gbps * 1e9, self.cfg.express_share),
                        (Path.DMA,),
                    )
        self._started = time.perf_counter()
        self._closed = False

    def _add_lane(self, key: LaneKey, link: Link, paths: tuple[Path, ...]) -> None:
        self._links[key] = link
        for path in paths:
            w = Worker(f"priod-sim-{key}-{path.value}", link, path, lambda: self._wake)
            w.start()
            self._workers[(key, path)] = w

    def lanes(self) -> list[LaneInfo]:
        return [
            LaneInfo(
                key,
                link.bandwidth,
                self.cfg.express_min_bytes,
                self.cfg.express_max_bytes if key.peer is None else 0,
                gate=key.peer is None,  # as on CUDA, where a peer lane has no gate word
            )
            for key, link in sorted(self._links.items())
        ]

    def map_host(self, fd: int, nbytes: int) -> HostMemory:
        return HostMemory(fd, nbytes)

    def release_host(self, mem: HostMemory) -> None:
        mem.unmap()

    def alloc_device(self, nbytes: int, device: int) -> DeviceMemory:
        if not 0 <= device < self.cfg.devices:
            raise InvalidRequest(
                f"device {device} does not exist; the sim engine has devices 0..{self.cfg.devices - 1} ([sim] devices)"
            )
        fd = sealed_memfd(f"priod-sim-gpu{device}", nbytes)
        return SimDeviceMemory(fd, nbytes, device)

    def import_device(self, ipc_handle: bytes, offset: int, nbytes: int, device: int) -> DeviceMemory:
        raise InvalidRequest(
            "register_device needs the cuda engine; under sim, use alloc_device (its memory is a memfd you can map)"
        )

    def import_device_memfd(self, fd: int, offset: int, nbytes: int, device: int) -> DeviceMemory:
        """A sim device region's memfd, registered again by its client (after a daemon restart):
        checked as a host memfd is (`check_host_fd`: a plain memfd, sealed against shrinking,
        read-write) and for its size; kept by a dup of its own."""
        from priod.daemon.hostfd import check_host_fd

        if not 0 <= device < self.cfg.devices:
            raise InvalidRequest(
                f"device {device} does not exist; the sim engine has devices 0..{self.cfg.devices - 1} ([sim] devices)"
            )
        if offset != 0:
            raise InvalidRequest(f"offset = {offset} is invalid; a sim device memfd is registered from its byte 0")
        check_host_fd(fd)
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise InvalidRequest(f"the passed memfd holds {size} bytes but the region asks for {nbytes}")
        own = os.dup(fd)
        try:
            return SimDeviceMemory(own, nbytes, device)
        except BaseException:
            os.close(own)
            raise

    def release_device(self, mem: DeviceMemory) -> None:
        assert isinstance(mem, SimDeviceMemory)
        release_mapping(mem)
        os.close(mem.fd)

    def submit_range(self, job: ChunkJob) -> Completion:
        lane, path, dst, src, nbytes = job.lane, job.path, job.dst, job.src, job.nbytes
        dst_offset, src_offset, strict, gated = job.dst_offset, job.src_offset, job.strict, job.gated
        # One copy engine per lane: strict DMA chunks queue with the rest (the scheduler
        # already put them first), as they would on a single hardware queue; only a gated chunk
        # waiting at a closed gate lets them pass (`Worker._take_turn`).
        completion = SimCompletion()
        work = Job(
            _view(dst),
            _view(src),
            nbytes,
            completion,
            nbytes == self.cfg.fault_on_nbytes,
            self._draw_stall() if self._cotenant_stall_s > 0 and path is Path.EXPRESS else 0.0,
            gated,
            dst_offset,
            src_offset,
            strict,
        )
        if job.landed is not None:
            work.landed = _landed_word(job.landed)
        worker = self._workers[(lane, path)]
        if not worker.run_inline(work):
            worker.put(work)
        return completion

    def submit_table(self, job: ChunkJob) -> Completion:
        """One sim job for the whole chunk: its segments move one after another on the lane's
        thread, paced by their bytes together, as one entry of the lane's FIFO."""
        lane, path, dst, src, strict, gated = job.lane, job.path, job.dst, job.src, job.strict, job.gated
        cells = job.cells
        assert cells is not None
        nbytes = int(
            np.add.reduce(cells[:, 2])
        )  # the ufunc itself: ndarray.sum() runs Python code of numpy's first (batch.LARGEST)
        completion = SimCompletion()
        work = Job(
            _view(dst),
            _view(src),
            nbytes,
            completion,
            fail=nbytes == self.cfg.fault_on_nbytes,
            stall_s=self._draw_stall() if self._cotenant_stall_s > 0 and path is Path.EXPRESS else 0.0,
            gated=gated,
            strict=strict,
        )
        work.segments = cells  # the rows as the table has them: cut into views on the engine's thread
        if job.landed is not None:
            work.landed = _landed_word(job.landed)
        worker = self._workers[(lane, path)]
        if not worker.run_inline(work):
            worker.put(work)
        return completion

    def set_wakeup(self, wakeup: Callable[[], None]) -> None:
        self._wake = wakeup

    def set_gates(self, closed: frozenset[LaneKey]) -> None:
        """A lane's DMA engine holds its gated jobs that have not begun while its gate is closed."""
        for (lane, path), worker in self._workers.items():
            if path is Path.DMA:
                worker.set_gate(lane in closed)

    def set_gate(self, lane: LaneKey, closed: frozenset[LaneKey]) -> None:
        worker = self._workers.get((lane, Path.DMA))
        if worker is not None:
            worker.set_gate(lane in closed)

    def open_event(self, handle: bytes, device: int, region: Callable[[int], Memory]) -> IpcEvent:
        """A byte of a device region of the client's on GPU ``device`` (priod.wire.ipc_event.SimEvent);
        ``region`` checks that the client may name it."""
        region_id, offset = parse_sim_handle(handle)
        mem = region(region_id)
        if not isinstance(mem, SimDeviceMemory) or mem.device != device:
            where = "host memory" if mem.device is None else f"gpu{mem.device}"
            raise InvalidRequest(
                f"sim event region {region_id} is {where}, but the copy runs on gpu{device}: an IPC event belongs to "
                "one GPU; put the event in a device region of the copy's GPU"
            )
        if offset >= mem.nbytes:
            raise InvalidRequest(f"sim event offset {offset} is outside region {region_id} of {mem.nbytes} bytes")
        return SimIpcEvent(mem.array[offset : offset + 1], device)

    def record_event(self, event: IpcEvent, after: list[Completion]) -> None:
        assert isinstance(event, SimIpcEvent)
        event.record([c for c in after if isinstance(c, SimCompletion)])

    def device_uuids(self) -> dict[int, str]:
        return dict(self._uuids)

    def foreign_copy(self, lane: LaneKey, nbytes: int) -> float:
        """Another CUDA context's copy of ``nbytes`` on ``lane``'s copy engine (a client's own
        DMA, as a direct urgent copy is), on the caller's thread; returns the seconds it took
        from arrival to end. The engine time-slices between contexts (`Worker.foreign_copy`):
        the copy waits for the daemon's chunks queued there, or for ``[sim] context_slice_us``
        if the daemon keeps the engine fed, which is what holding bulk back avoids."""
        return self._workers[(lane, Path.DMA)].foreign_copy(
            nbytes, self.cfg.context_slice_us / 1e6, self.cfg.context_switch_us / 1e6
        )

    def set_cotenant_stall(self, us: float) -> None:
        """Switch the co-tenant compute model: express chunks submitted from now on each wait
        uniform [0.5, 1.0] x ``us`` microseconds for a time slice before copying (0: off).

        Thread-safe (a test may call it from any thread while copies run); chunks already
        submitted keep the wait they drew. Raises ValueError unless ``us`` is finite and >= 0.
        """
        if not (math.isfinite(us) and us >= 0):
            raise ValueError(f"cotenant stall = {us} us is invalid; pass a finite number >= 0 (0: the SMs are idle)")
        with self._cotenant_lock:
            self._cotenant_stall_s = float(us) * 1e-6

    def _draw_stall(self) -> float:
        with self._cotenant_lock:
            return self._cotenant_rng.uniform(0.5, 1.0) * self._cotenant_stall_s

    def statistics(self) -> dict[str, object]:
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        return {
            "engine": "sim",
            "devices": [{"index": i, "uuid": u} for i, u in self._uuids.items()],
            "busy_fraction": {str(k): round(link.busy_seconds / elapsed, 4) for k, link in sorted(self._links.items())},
            "host_gbps": self.cfg.host_gbps,
            "cotenant_stall_us": round(self._cotenant_stall_s * 1e6, 3),
            "cotenant_stalled_chunks": sum(w.stalled for w in self._workers.values()),
            "cotenant_stalled_seconds": round(sum(w.stalled_seconds for w in self._workers.values()), 6),
        }

    def host_bandwidth(self) -> float:
        return self.cfg.host_gbps * 1e9

    def busy_seconds(self) -> dict[LaneKey, float]:
        return {k: link.busy_seconds for k, link in self._links.items()}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for w in self._workers.values():
            w.set_gate(False)  # what is queued drains
            w.jobs.put(None)
        for w in self._workers.values():
            w.join(timeout=30)


def _view(mem: Memory) -> npt.NDArray[np.uint8]:
    # numpy (unlike memoryview) lets go of the GIL while it copies, so the event loop runs on.
    if isinstance(mem, (HostMemory, SimDeviceMemory)):
        return mem.array
    raise TypeError(f"the sim engine cannot copy {type(mem).__name__}")  # pragma: no cover - a bug
