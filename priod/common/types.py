"""Lanes and paths: the names both the client and the daemon use for where and how a copy runs."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = ["LOCAL_DIRECTIONS", "Direction", "LaneInfo", "LaneKey", "Path"]


class Direction(str, enum.Enum):
    """Which way a copy goes; each direction is its own copy engine, hence its own lane."""

    H2D = "h2d"
    D2H = "d2h"
    D2D = "d2d"
    PEER = "peer"
    """Device to device across two GPUs (NVLink or PCIe peer-to-peer): a lane per ordered pair
    of GPUs, keyed by the source GPU and `LaneKey.peer`, the destination."""


LOCAL_DIRECTIONS = (Direction.H2D, Direction.D2H, Direction.D2D)
"""The directions every served GPU has a lane for; peer lanes exist per pair of GPUs."""


class Path(str, enum.Enum):
    """How a chunk travels: through the copy engine's FIFO, or the express lane beside it."""

    DMA = "dma"
    EXPRESS = "express"


@dataclass(frozen=True, order=True)
class LaneKey:
    """One lane: a device and a direction, and for `Direction.PEER` the destination GPU.
    Lanes never wait on each other.

    A peer lane belongs to its source GPU (``device``): its bytes leave through that GPU's
    links, and its status and metrics carry that GPU's label. Each ordered pair has its own
    lane because each direction of a GPU pair is its own hardware path (NVLink is full duplex;
    the copy is driven from the source GPU's stream), so gpu0 -> gpu1 bulk never queues an
    urgent gpu1 -> gpu0 copy.
    """

    device: int
    direction: Direction
    peer: int | None = None
    """The destination GPU of a `Direction.PEER` lane; None for every other direction."""
    _hash: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        if (self.direction is Direction.PEER) != (self.peer is not None) or self.peer == self.device:
            raise ValueError(
                f"LaneKey({self.device}, {self.direction.value}, peer={self.peer}): a peer lane, and only a peer lane, names another GPU as its peer"
            )
        # Lanes key dicts on the per-chunk path (about 8 lookups per copy): the hash is worked
        # out once, since an enum's value is a Python-level property that is slow to read.
        object.__setattr__(self, "_hash", hash((self.device, self.direction.value, self.peer)))

    def __hash__(self) -> int:
        return self._hash

    def __str__(self) -> str:
        if self.peer is not None:
            return f"gpu{self.device}/peer/gpu{self.peer}"
        return f"gpu{self.device}/{self.direction.value}"


@dataclass(frozen=True)
class LaneInfo:
    """What an engine knows about a lane after calibration."""

    key: LaneKey
    bandwidth: float
    """Bytes per second of the DMA path, measured (cuda) or configured (sim)."""
    express_min: int
    """Smallest copy the express lane takes; smaller copies are faster by DMA."""
    express_max: int
    """Largest copy the express lane takes; 0 means the lane has no express path."""
    gate: bool = False
    """The engine can hold this lane's gated chunks that have not begun at a gate (`Engine.set_gates`)."""
