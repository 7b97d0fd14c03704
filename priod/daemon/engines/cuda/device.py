"""One GPU as the CUDA engine sets it up: its context, properties and three lanes of streams.

Each (device, direction) lane has three streams, because of how the hardware behaves (measured
on an H200):

- Host-to-device and device-to-host copies run FIFO on one copy engine per direction, whatever
  the stream's priority. So a lane has one low-priority DMA stream for bulk chunks, which the
  scheduler keeps short, and one high-priority DMA stream for strict chunks: priority does
  nothing for copies, but a second stream lets small host-to-device copies (up to 24 KiB here)
  pass a running bulk copy, which they cannot do behind it on the same stream.
- The express copy kernel (`express`) runs on a third stream of the highest priority: priority
  does matter for the kernel's blocks.

`open_device` makes the primary context with ``cudaDeviceScheduleSpin | cudaDeviceMapHost``
(mapped host memory is what the express kernel reads and writes), loads the kernel through the
engine's hook, and creates the streams; `Device.close` undoes it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from priod.common.cuda.driver import bindings, check, error, gpu_uuid, status_codes
from priod.common.types import Direction, LaneKey
from priod.daemon.engines.cuda.events import Busy, EventPool
from priod.errors import CudaError

__all__ = ["HOST_ENDS", "Device", "Lane", "open_device"]

Attempt = Callable[[tuple[Any, ...]], None]
"""Checks a CUDA result and keeps its error for later (used on the way out, in close)."""

HOST_ENDS = {
    Direction.H2D: (True, False),
    Direction.D2H: (False, True),
    Direction.D2D: (False, False),
    Direction.PEER: (False, False),
}
"""Per direction: whether the source, and whether the destination, is host memory."""

_KIND_NAMES = {
    Direction.H2D: "cudaMemcpyHostToDevice",
    Direction.D2H: "cudaMemcpyDeviceToHost",
    Direction.D2D: "cudaMemcpyDeviceToDevice",
    Direction.PEER: "cudaMemcpyDefault",  # unused (peer chunks name both GPUs); UVA would tell them apart
}
_kinds: dict[Direction, Any] = {}


def _kind(direction: Direction) -> Any:
    """The ``cudaMemcpyKind`` of ``direction``."""
    kind = _kinds.get(direction)
    if kind is None:
        rt, _ = bindings()
        kind = _kinds[direction] = getattr(rt.cudaMemcpyKind, _KIND_NAMES[direction])
    return kind


@dataclass
class Lane:
    """The streams of one (device, direction) lane, and what calibration found."""

    key: LaneKey
    dma: Any = None
    """Lowest priority: bulk (non-strict) DMA chunks, FIFO."""
    strict: Any = None
    """Highest priority: strict DMA chunks. A second stream matters for small host-to-device
    copies, which ride the command stream and pass a bulk copy on *another* stream only."""
    express: Any = None
    """Highest priority: the copy kernel."""
    express_cu: Any = None
    """The same stream as a driver-API ``CUstream``, for ``cuLaunchKernel``."""
    kind: Any = None
    """The cudaMemcpyKind of this direction."""
    host_src: bool = False
    host_dst: bool = False
    dma_bandwidth: float = 0.0
    express_bandwidth: float = 0.0
    express_min: int = 0
    express_max: int = 0
    busy: Busy = field(default_factory=Busy)
    """Time with a chunk of this lane outstanding (the metrics' busy counter)."""
    peer_access: bool = False
    """A peer lane only: direct peer access is enabled (NVLink or PCIe P2P); without it
    ``cudaMemcpyPeerAsync`` stages through host memory, slower and on the host's bandwidth."""
    dma_cu: Any = None
    """The DMA stream as a driver-API ``CUstream``, for ``cuStreamWaitValue32``."""
    strict_cu: Any = None
    """The strict DMA stream as a driver-API ``CUstream``, for ``cuStreamWriteValue64``."""
    gate: Any = None
    """The device address of this lane's gate word (`Gates`); None: no gate (peer lanes, or
    stream memory operations refused)."""

    @property
    def streams(self) -> tuple[Any, Any, Any]:
        """The DMA, strict and express streams (None where not created)."""
        return self.dma, self.strict, self.express


GATE_LANES = 3
"""A word for each local lane (h2d, d2h, d2d), in `Device.local_lanes` order."""


class Gates:
    """A page of mapped pinned host memory with a 32-bit word per local lane. A gated bulk
    chunk is preceded on its lane's DMA stream by ``cuStreamWaitValue32(word == 0)``: while the
    daemon writes 1 there, a chunk queued but not begun waits on the GPU, and it goes the moment
    the word is 0 again, with no call on the host. Measured on the H200 (two contexts of one
    process): a stream waiting so leaves the copy engine to the other
    context at once, and the wait costs the link ~1.5 us a chunk."""

    def __init__(self) -> None:
        rt, drv = bindings()
        self.host = check(rt.cudaHostAlloc(4096, rt.cudaHostAllocPortable | rt.cudaHostAllocMapped))
        self.words = (ctypes.c_uint32 * GATE_LANES).from_address(int(self.host))
        self.open_all()
        base = int(check(rt.cudaHostGetDevicePointer(self.host, 0)))
        self.addresses = [drv.CUdeviceptr(base + 4 * i) for i in range(GATE_LANES)]

    def set(self, index: int, closed: bool) -> None:
        self.words[index] = 1 if closed else 0

    def open_all(self) -> None:
        for i in range(GATE_LANES):
            self.words[i] = 0


class Device:
    """One GPU the engine serves: its properties, event pool, copy kernel and lanes.

    The lanes are attributes named after their direction (``h2d``, ``d2h``, ``d2d``), which
    `CudaEngine.submit` reads by identity test on the direction rather than by hashing an Enum;
    peer lanes (this GPU to another, `peer.open_peer_lanes`) are in ``peers`` by destination.
    `lanes` lists them all.
    """

    def __init__(self, index: int) -> None:
        self.index = index
        self.name = ""
        self.uuid = ""
        """``GPU-xxxxxxxx-...`` as nvidia-smi prints it: what clients name this GPU by."""
        self.pci_bus_id = ""
        self.sm_count = 0
        self.events = EventPool(index)
        self.module: Any = None
        """The loaded copy kernel's module (None: no express lane on this device)."""
        self.function: Any = None
        self.table_function: Any = None
        """``priod_copy_table``, a batch's chunk in one launch (None: launch per segment)."""
        self.kernel_registers = 0
        self.h2d, self.d2h, self.d2d = (
            self._new_lane(LaneKey(index, d)) for d in (Direction.H2D, Direction.D2H, Direction.D2D)
        )
        self.peers: dict[int, Lane] = {}
        """Peer lanes from this GPU, by destination ordinal (empty on a one-GPU engine)."""
        self.gates: Gates | None = None
        """The local lanes' gate words (None: gates off, see `CudaEngine.statistics`)."""

    def _new_lane(self, key: LaneKey) -> Lane:
        host_src, host_dst = HOST_ENDS[key.direction]
        return Lane(key, kind=_kind(key.direction), host_src=host_src, host_dst=host_dst)

    def add_peer(self, peer: int) -> Lane:
        """A peer lane to GPU ``peer`` (no streams yet)."""
        lane = self.peers[peer] = self._new_lane(LaneKey(self.index, Direction.PEER, peer))
        return lane

    @property
    def local_lanes(self) -> tuple[Lane, Lane, Lane]:
        """The lanes within this GPU, in `Direction` order."""
        return self.h2d, self.d2h, self.d2d

    @property
    def lanes(self) -> tuple[Lane, ...]:
        """Every lane: the local ones, then the peer lanes by destination."""
        return (*self.local_lanes, *(self.peers[p] for p in sorted(self.peers)))

    def synchronize(self, attempt: Attempt) -> None:
        """Wait for every stream of the device's lanes."""
        rt, _ = bindings()
        attempt(rt.cudaSetDevice(self.index))
        for lane in self.lanes:
            for stream in lane.streams:
                if stream is not None:
                    attempt(rt.cudaStreamSynchronize(stream))

    def close(self, attempt: Attempt) -> None:
        """Destroy the events and streams and unload the kernel (nothing may be in flight)."""
        rt, drv = bindings()
        attempt(rt.cudaSetDevice(self.index))
        self.events.close(attempt)
        for lane in self.lanes:
            for stream in lane.streams:
                if stream is not None:
                    attempt(rt.cudaStreamDestroy(stream))
            lane.dma = lane.strict = lane.express = lane.express_cu = lane.dma_cu = lane.strict_cu = lane.gate = None
        if self.gates is not None:
            attempt(rt.cudaFreeHost(self.gates.host))
            self.gates = None
        if self.module is not None:
            attempt(drv.cuModuleUnload(self.module))
            self.module = self.function = None


def open_device(
    index: int,
    devices: dict[int, Device],
    use: Callable[[int], None],
    load_kernel: Callable[[Device], None],
) -> Device:
    """Set up gpu ``index`` and add it to ``devices`` before creating anything on it, so that
    closing ``devices`` frees what was made even if a later step fails.

    ``use`` makes a device current; ``load_kernel`` loads the express kernel (or not) once the
    context exists, before the streams are created.
    """
    rt, drv = bindings()
    ok, _ = status_codes()
    use(index)
    err = rt.cudaSetDeviceFlags(rt.cudaDeviceScheduleSpin | rt.cudaDeviceMapHost)[0]
    # Spin: the engine never blocks on the GPU in normal work (it polls events), so the flag
    # only shapes calibration and close, where spinning gives the cleanest timings.
    if err is not ok and err is not rt.cudaError_t.cudaErrorSetOnActiveProcess:
        raise error(err)
    check(rt.cudaFree(0))  # create the primary context now, with those flags
    props = check(rt.cudaGetDeviceProperties(index))
    dev = Device(index)
    dev.name = bytes(props.name).split(b"\0", 1)[0].decode(errors="replace")
    dev.uuid = gpu_uuid(index)
    dev.sm_count = int(check(rt.cudaDeviceGetAttribute(rt.cudaDeviceAttr.cudaDevAttrMultiProcessorCount, index)))
    try:
        dev.pci_bus_id = bytes(check(rt.cudaDeviceGetPCIBusId(32, index))).split(b"\0", 1)[0].decode()
    except CudaError:
        dev.pci_bus_id = ""
    least, greatest = (int(v) for v in check(rt.cudaDeviceGetStreamPriorityRange()))
    devices[index] = dev
    load_kernel(dev)
    for lane in dev.local_lanes:
        lane.dma = check(rt.cudaStreamCreateWithPriority(rt.cudaStreamNonBlocking, least))
        lane.strict = check(rt.cudaStreamCreateWithPriority(rt.cudaStreamNonBlocking, greatest))
        lane.express = check(rt.cudaStreamCreateWithPriority(rt.cudaStreamNonBlocking, greatest))
        lane.express_cu = drv.CUstream(int(lane.express))
        lane.dma_cu = drv.CUstream(int(lane.dma))
        lane.strict_cu = drv.CUstream(int(lane.strict))
    return dev


def open_gates(dev: Device) -> str | None:
    """Give ``dev``'s local lanes their gates; None, or why they have none (gated chunks then
    run as any other). Tried once on each DMA stream with the gate open, so a driver that
    refuses stream memory operations is found here, not on the first gated chunk."""
    _, drv = bindings()
    try:
        gates = Gates()
    except CudaError as exc:
        return f"no mapped pinned page for the gates ({exc})"
    dev.gates = gates
    eq = drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ
    for i, lane in enumerate(dev.local_lanes):
        try:
            check(drv.cuStreamWaitValue32(lane.dma_cu, gates.addresses[i], 0, eq))
        except CudaError as exc:
            return f"cuStreamWaitValue32 refused ({exc}): bulk chunks are not gated"
    for i, lane in enumerate(dev.local_lanes):
        lane.gate = gates.addresses[i]
    return None
