"""What the daemon reports about itself: `priod status` and the Prometheus gauges.

Counters move where things happen (metrics.py, per copy); the gauges here are snapshots, taken
once a second and on a reload, of the scheduler's queues and bytes in flight, the engine's busy
time, the urgent paths' latencies and the clients. Refusals are counted where they are answered
(session.py) and shown under ``refusals``: by code, by limit, by uid and by connection. Direct copies (clients' own, announced on
their hold pages) are counted and timed by the hold scans (holds.py) and moved into their
counters and their ``path="direct"`` latency histogram at the same refresh.

The daemon (server.py) imports this module: what it reads of it is named here (`Reported`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any, Protocol

from priod._version import __version__
from priod.daemon.admission import Admission
from priod.daemon.config import Config
from priod.daemon.engines.base import Engine
from priod.daemon.metrics import Metrics
from priod.daemon.pump import Pump
from priod.daemon.rate import LoopShare
from priod.daemon.regions import RegionTable
from priod.daemon.sched.scheduler import Scheduler
from priod.daemon.session import Session
from priod.wire.transport import Peer

__all__ = ["refresh_metrics", "status"]


class Reported(Protocol):
    """What this module reads of the daemon (a `server.Daemon`)."""

    @property
    def cfg(self) -> Config: ...
    @property
    def engine(self) -> Engine: ...
    @property
    def scheduler(self) -> Scheduler: ...
    @property
    def pump(self) -> Pump: ...
    @property
    def regions(self) -> RegionTable: ...
    @property
    def metrics(self) -> Metrics: ...
    @property
    def admission(self) -> Admission: ...
    @property
    def sessions(self) -> Mapping[int, Session]: ...
    @property
    def loop_share(self) -> LoopShare: ...
    @property
    def totals(self) -> Mapping[str, int]: ...
    @property
    def stopping(self) -> bool: ...
    @property
    def started_at(self) -> float: ...


def status(d: Reported, viewer: Peer | None = None) -> dict[str, Any]:
    """The daemon's state for `priod status`. ``viewer``: who asks; root, the daemon's own
    uid and the daemon itself (None) see every client, anyone else only its own uid's
    connections and holdings beside the totals."""
    mine = None if viewer is None or d.admission.privileged(viewer.uid) else viewer.uid
    if d.pump.holds.pages:
        d.pump.scan_holds()  # direct copies since the last submission are counted too
    st = d.scheduler.statistics()
    inflight: dict[str, int] = {}
    for ls in st.lanes:
        for path, n in (("dma", ls.inflight_bytes + ls.strict_inflight_bytes), ("express", ls.express_inflight_bytes)):
            if n:
                inflight[f"{ls.lane}/{path}"] = n
    return {
        "version": __version__,
        "backend": d.engine.name,
        "socket": d.cfg.socket_path,
        "uptime_s": round(time.time() - d.started_at, 3),
        "mode": st.mode,
        "stopping": d.stopping,
        "max_block_us": d.cfg.scheduler.max_block_us,
        "classes": [{"name": c.name, "weight": c.weight, "strict": c.strict} for c in st.classes],
        "gpus": [{"index": i, "uuid": u} for i, u in sorted(d.engine.device_uuids().items())],
        "host_bandwidth_gbps": round(d.engine.host_bandwidth() / 1e9, 3),
        "lanes": [
            {
                "lane": ls.lane,
                "gpu": d.engine.device_uuid(ls.device),
                **({"peer_gpu": d.engine.device_uuid(ls.peer)} if ls.peer is not None else {}),
                "bandwidth_gbps": round(ls.bandwidth / 1e9, 3),
                "chunk_bytes": ls.chunk_bytes,
                "inflight_bound": ls.inflight_bound,
                "express_range": [ls.express_min, ls.express_max],
                "queued_requests": ls.queued_requests,
                "queued_bytes": ls.queued_bytes,
                "inflight_bytes": ls.inflight_bytes,
                "strict_inflight_bytes": ls.strict_inflight_bytes,
                "express_inflight_bytes": ls.express_inflight_bytes,
                "urgent_chunk_bytes": ls.urgent_chunk_bytes,
                "urgent_inflight_bound": ls.urgent_inflight_bound,
                "batch_chunk_bytes": ls.batch_chunk_bytes,
                "batch_inflight_bound": ls.batch_inflight_bound,
                "beat_chunk_bytes": ls.beat_chunk_bytes,
                "beat_inflight_bound": ls.beat_inflight_bound,
                "urgent_beat_us": None if ls.beat_us is None else round(ls.beat_us, 1),
                "host_scale": round(ls.host_scale, 4),
            }
            for ls in st.lanes
        ],
        "urgent_paths": [dataclasses.asdict(e) for e in d.scheduler.path_estimates()],
        "inflight_chunks": d.pump.inflight_chunks,
        "polls": d.pump.polls,
        "beat_turns": d.pump.beat_turns,
        "held_copies": len(d.pump.gates),
        "direct": d.pump.holds.figures(),
        "event_polls": d.pump.gates.polls,
        "lane_bytes": {str(lane): n for lane, n in sorted(d.pump.lane_bytes.items())},
        "inflight_bytes": inflight,
        "deadline_misses": st.deadline_misses,
        "finished": st.finished,
        "totals": dict(d.totals),
        "refusals": d.admission.refusals.figures(d.sessions.values(), mine),
        "clients": [s.figures() for s in d.sessions.values() if mine is None or s.peer.uid == mine],
        "clients_total": len(d.sessions),
        "uids": [t.figures() for t in d.regions.all_uid_holdings() if mine is None or t.uid == mine],
        "loop_share": loop_share_figures(d.loop_share.figures(), mine),
        "holdings": d.regions.figures(),
        "engine": d.engine.statistics(),
    }


def loop_share_figures(figures: dict[str, Any], mine: int | None) -> dict[str, Any]:
    """``[limits] request_loop_share``'s books (uids sending now; per uid the loop seconds charged,
    its credit, its connections waiting): a viewer who is not privileged sees its own uid's only."""
    if mine is None:
        return figures
    return {**figures, "uids": {u: f for u, f in figures["uids"].items() if u == str(mine)}}


def refresh_metrics(d: Reported) -> None:
    m = d.metrics
    m.set_engine(d.engine.name)
    # Scheduler and path figures name lanes by their text; the labels come from the key.
    keys = {str(info.key): info.key for info in d.engine.lanes()}
    st = d.scheduler.statistics()
    for ls in st.lanes:
        labels = m.lane_labels(keys[ls.lane])
        for cls, n in ls.queued_requests.items():
            m.queued_requests.labels(*labels, cls).set(n)
        for cls, n in ls.queued_bytes.items():
            m.queued_bytes.labels(*labels, cls).set(n)
        m.inflight.labels(*labels, "dma").set(ls.inflight_bytes + ls.strict_inflight_bytes)
        m.inflight.labels(*labels, "express").set(ls.express_inflight_bytes)
        m.urgent_beat.labels(*labels).set(0.0 if ls.beat_us is None else ls.beat_us / 1e6)
    for lane, seconds in d.engine.busy_seconds().items():
        m.add_busy(lane, seconds)
    for e in d.scheduler.path_estimates():
        labels = m.lane_labels(keys[e.lane])
        for path, us in (("express", e.express_us), ("dma", e.dma_us)):
            if us is not None:
                m.urgent_path_latency.labels(*labels, path, str(e.size_bytes), e.form).set(us / 1e6)
    holds = d.pump.holds
    for key in holds.copies.keys() | holds.cut.keys() | holds.stepped_back.keys():
        m.add_direct(key, holds.copies.get(key, 0), holds.cut.get(key, 0), holds.stepped_back.get(key, 0))
    for key, times in holds.timed.items():
        m.set_direct_times(key, times.buckets, times.total_s)
    m.clients.set(len(d.sessions))
    m.pinned.set(sum(s.holdings.pinned_bytes for s in d.sessions.values()))
