"""Synthetic clients that put load on a daemon, through the public client API only.

- `bulk_load`: keep ``pipeline`` bulk copies outstanding until told to stop, and record when
  each one landed (the demo, the benchmark and tests measure throughput from that).
- `BulkProcess`: the same bulk client in a process of its own, as a real offloading job would be
  (its copies then compete with the measuring process for the daemon, not for one event loop).
- `urgent_copies` / `urgent_probe`: small copies one at a time, each one's latency measured and
  its bytes checked at the destination.
"""

from __future__ import annotations

import asyncio
import json
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TypedDict, Unpack

import numpy as np

from ..client import Client, Region

__all__ = ["BulkLoad", "BulkProcess", "ProbeOptions", "UrgentProbe", "bulk_load", "urgent_copies", "urgent_probe"]


@dataclass
class BulkLoad:
    """What a `bulk_load` moved."""

    bytes_moved: int = 0
    seconds: float = 0.0
    copies: int = 0
    errors: list[str] = field(default_factory=list)
    """One ``"<ExceptionClass>: <message>"`` per failed copy."""
    done: list[tuple[float, int]] = field(default_factory=list)
    """(``time.monotonic()`` when the reply came, bytes) per completed copy: CLOCK_MONOTONIC,
    so comparable across processes on one host."""

    @property
    def gbps(self) -> float:
        return self.bytes_moved / self.seconds / 1e9 if self.seconds else 0.0


def _ends(host: Region, dev: Region, direction: str) -> tuple[Region, Region]:
    """(dst, src) of a copy between a host and a device region in ``direction`` (h2d or d2h)."""
    return (dev, host) if direction == "h2d" else (host, dev)


async def bulk_load(
    client: Client,
    nbytes: int,
    stop: asyncio.Event,
    *,
    priority: str = "bulk",
    pipeline: int = 2,
    direction: str = "h2d",
    regions: tuple[Region, Region] | None = None,
) -> BulkLoad:
    """Keep ``pipeline`` copies of ``nbytes`` outstanding until ``stop`` is set; count what landed.

    ``regions`` is (host, device); without it both are allocated here (and not freed).
    """
    if regions is None:
        host = await client.alloc_host(nbytes)
        dev = await client.alloc_device(nbytes)
    else:
        host, dev = regions
    dst, src = _ends(host, dev, direction)
    result = BulkLoad()
    started = time.perf_counter()
    inflight = [client.start_copy(dst, src, nbytes, priority=priority) for _ in range(pipeline)]
    while inflight:
        handle = inflight.pop(0)
        try:
            r = await handle
            result.done.append((time.monotonic(), r.nbytes))
            result.bytes_moved += r.nbytes
            result.copies += 1
        except Exception as exc:
            result.errors.append(f"{type(exc).__name__}: {exc}")
        if not stop.is_set():
            inflight.append(client.start_copy(dst, src, nbytes, priority=priority))
    result.seconds = time.perf_counter() - started
    return result


class BulkProcess:
    """`bulk_load` in a child process, started at once; ``wait_ready``, then ``stop`` for the result.

    The child connects (as ``name``), fills its host region, runs one warm-up copy (the first
    touch of fresh memfd pages costs far more than a copy) and says ready before the load starts.
    """

    def __init__(self, socket_path: str, nbytes: int, pipeline: int, direction: str = "h2d", *, priority: str = "bulk", name: str = "bulk") -> None:
        code = "import sys; from priod.testing.load import bulk_process_main; sys.exit(bulk_process_main(sys.argv[1:]))"
        cmd = [sys.executable, "-c", code, socket_path, str(nbytes), str(pipeline), direction, priority, name]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        self.nbytes = nbytes

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Return once the child's warm-up copy is done; RuntimeError (child killed) if it fails."""
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if line.strip() != "ready":
            self.proc.kill()
            raise RuntimeError(f"bulk client did not get ready (exit {self.proc.poll()}, said {line!r})")

    def stop(self, timeout: float = 60.0) -> dict[str, Any]:
        """Stop the load (SIGUSR1), wait for the outstanding copies; ``{"done": [[t, nbytes], ...], "errors": [...]}``."""
        self.proc.send_signal(signal.SIGUSR1)
        out, _ = self.proc.communicate(timeout=timeout)
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if not lines:
            raise RuntimeError(f"bulk client exited {self.proc.returncode} without a result")
        result: dict[str, Any] = json.loads(lines[-1])
        return result

    def kill(self) -> None:
        """Kill the child if it still runs (a cleanup after `stop`, or instead of it)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def bulk_process_main(argv: list[str]) -> int:
    """The child of `BulkProcess`: ``SOCKET NBYTES PIPELINE DIRECTION PRIORITY NAME``."""
    path, nbytes, pipeline, direction, priority, name = argv[0], int(argv[1]), int(argv[2]), argv[3], argv[4], argv[5]

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGUSR1, stop.set)
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        client = await Client.connect(path, name=name)
        host = await client.alloc_host(nbytes)
        dev = await client.alloc_device(nbytes)
        if host.array is not None:
            host.array[:] = 0x5A
        dst, src = _ends(host, dev, direction)
        await client.copy(dst, src, nbytes, priority=priority)
        print("ready", flush=True)
        result = await bulk_load(client, nbytes, stop, priority=priority, pipeline=pipeline, direction=direction, regions=(host, dev))
        await client.close()
        print(json.dumps({"done": result.done, "errors": result.errors}), flush=True)

    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is one of priod's dependencies
        asyncio.run(main())
    else:
        uvloop.run(main())
    return 0


@dataclass
class UrgentProbe:
    """What `urgent_copies` saw, one entry per copy (microseconds)."""

    size: int
    latency_us: list[float] = field(default_factory=list)
    """Client-observed: from sending the request to having the reply."""
    queued_us: list[float] = field(default_factory=list)
    """The daemon's own figures from each reply."""
    transfer_us: list[float] = field(default_factory=list)
    paths: dict[str, int] = field(default_factory=dict)
    """How many copies took each path (dma, express)."""


async def urgent_copies(
    client: Client,
    size: int,
    count: int,
    *,
    interval_s: float = 0.005,
    priority: str = "urgent",
    direction: str = "h2d",
) -> UrgentProbe:
    """Send ``count`` copies of ``size`` one at a time, ``interval_s`` apart, and time each.

    Every copy's bytes are checked at the destination (a new pattern per copy) where both ends
    are mapped; AssertionError if they differ. The regions are freed at the end.
    """
    host = await client.alloc_host(size)
    dev = await client.alloc_device(size)
    dst, src = _ends(host, dev, direction)
    probe = UrgentProbe(size)
    for i in range(count):
        if src.array is not None:
            src.array[:] = (i * 7 + 1) % 251
        t0 = time.perf_counter()
        r = await client.copy(dst, src, size, priority=priority)
        probe.latency_us.append((time.perf_counter() - t0) * 1e6)
        probe.queued_us.append(r.queued_us)
        probe.transfer_us.append(r.transfer_us)
        probe.paths[r.path] = probe.paths.get(r.path, 0) + 1
        if dst.array is not None and src.array is not None and not np.array_equal(dst.array, src.array):
            raise AssertionError(f"urgent copy {i} of {size} bytes: the destination differs from the source")
        await asyncio.sleep(interval_s)
    await client.free(host)
    await client.free(dev)
    return probe


class ProbeOptions(TypedDict, total=False):
    """`urgent_copies`'s keyword arguments."""

    interval_s: float
    priority: str
    direction: str


async def urgent_probe(client: Client, size: int, count: int, **options: Unpack[ProbeOptions]) -> list[float]:
    """`urgent_copies`, returning only the client-side latency of each copy in microseconds."""
    probe = await urgent_copies(client, size, count, **options)
    return probe.latency_us

