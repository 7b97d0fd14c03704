"""Synthetic clients that put load on a daemon, through the public client API only.

- `bulk_load`: keep ``pipeline`` bulk copies outstanding until told to stop, and record when
  each one landed (the demo, the benchmark and tests measure throughput from that, with
  `throughput_between`); with ``verify`` every copy's bytes are checked (`bulk_pairs`).
- `BulkProcess`: the same bulk client in a process of its own, as a real offloading job would be
  (its copies then compete with the measuring process for the daemon, not for one event loop);
  `LoadProcess` is its plumbing (a child that says ready, then runs until told to stop), for
  other synthetic clients in processes of their own.
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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict, Unpack

import numpy as np
import numpy.typing as npt

from priod.client.client import Client, CopyHandle, Region

__all__ = [
    "BulkLoad",
    "BulkProcess",
    "LoadProcess",
    "ProbeOptions",
    "UrgentProbe",
    "bulk_load",
    "bulk_pairs",
    "throughput_between",
    "urgent_copies",
    "urgent_probe",
]

STAMP_EVERY = 4096
"""A verified bulk copy's number is stamped into its source once per this many bytes."""


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
    verified_bytes: int = 0
    """With ``verify``: bytes of completed copies found equal to their source at the destination."""
    corrupted_bytes: int = 0
    """With ``verify``: bytes that differed from their source after their copy reported done."""
    corrupted_copies: int = 0
    """With ``verify``: copies reported done with any byte differing at the destination."""
    unverified_bytes: int = 0
    """With ``verify``: bytes of completed copies whose ends are not both mapped here (cuda device memory)."""

    @property
    def gbps(self) -> float:
        return self.bytes_moved / self.seconds / 1e9 if self.seconds else 0.0


def _ends(host: Region, dev: Region, direction: str) -> tuple[Region, Region]:
    """(dst, src) of a copy between a host and a device region in ``direction`` (h2d or d2h)."""
    return (dev, host) if direction == "h2d" else (host, dev)


def throughput_between(done: Sequence[Sequence[float]], t0: float, t1: float) -> dict[str, float]:
    """Bytes per second between the first and last completion inside [t0, t1] (`BulkLoad.done`).

    With the pipeline kept full, the bytes of every completion after the first one are exactly
    what moved between those two instants.
    """
    inside = [(t, n) for t, n in done if t0 <= t <= t1]
    if len(inside) < 2:
        return {"gbps": float("nan"), "copies": len(inside), "seconds": 0.0}
    seconds = inside[-1][0] - inside[0][0]
    moved = sum(n for _, n in inside[1:])
    return {"gbps": moved / seconds / 1e9, "copies": len(inside), "seconds": seconds}


async def bulk_pairs(
    client: Client, nbytes: int, count: int, *, direction: str = "h2d", priority: str = "bulk", seed: int = 0
) -> list[tuple[Region, Region]]:
    """``count`` (host, device) pairs of ``nbytes`` for a verified `bulk_load`: each source
    (where it is mapped here) filled with random bytes, each pair warmed by one copy (the first
    touch of fresh memfd pages costs far more than a copy)."""
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(count):
        host = await client.alloc_host(nbytes)
        dev = await client.alloc_device(nbytes)
        dst, src = _ends(host, dev, direction)
        if src.array is not None:
            src.array[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)
        await client.copy(dst, src, nbytes, priority=priority)
        pairs.append((host, dev))
    return pairs


def _stamp(arr: npt.NDArray[np.uint8], seq: int) -> None:
    """Write ``seq`` into the first 8 bytes of every `STAMP_EVERY` of ``arr`` (its first byte if shorter)."""
    words = arr[: len(arr) // 8 * 8].view(np.uint64)
    if len(words):
        words[:: STAMP_EVERY // 8] = seq
    else:
        arr[0] = seq & 0xFF


def _differing_bytes(a: npt.NDArray[np.uint8], b: npt.NDArray[np.uint8]) -> int:
    """How many bytes of ``a`` and ``b`` (same length) differ; compared 8 bytes at a time first."""
    cut = len(a) // 8 * 8
    if np.array_equal(a[:cut].view(np.uint64), b[:cut].view(np.uint64)) and np.array_equal(a[cut:], b[cut:]):
        return 0
    return int(np.count_nonzero(a != b))


async def bulk_load(
    client: Client,
    nbytes: int,
    stop: asyncio.Event,
    *,
    priority: str = "bulk",
    pipeline: int = 2,
    direction: str = "h2d",
    regions: tuple[Region, Region] | list[tuple[Region, Region]] | None = None,
    verify: bool = False,
    deadline_ms: float | None = None,
) -> BulkLoad:
    """Keep ``pipeline`` copies of ``nbytes`` outstanding until ``stop`` is set; count what landed.

    ``regions`` is (host, device), or a list of such pairs, one per outstanding copy; without
    it one pair is allocated here (``pipeline`` pairs from `bulk_pairs` with ``verify``), and
    not freed. ``deadline_ms`` goes with every copy.

    ``verify``: every copy's bytes are checked where both ends are mapped here. Each
    outstanding copy then has a pair of its own (a list of ``pipeline`` pairs whose sources
    hold random bytes: `bulk_pairs`); before each copy its number is stamped into its source
    every 4 KiB (`STAMP_EVERY`), and after the reply its destination is compared with its
    source, so a copy that never happened, landed shifted or in part, or carried wrong bytes
    is counted in `BulkLoad.corrupted_bytes`.
    """
    if regions is None and verify:
        pairs = await bulk_pairs(client, nbytes, pipeline, direction=direction, priority=priority)
    elif regions is None:
        pairs = [(await client.alloc_host(nbytes), await client.alloc_device(nbytes))]
    else:
        pairs = regions if isinstance(regions, list) else [regions]
    if verify and len(pairs) != pipeline:
        raise ValueError(
            f"a verified bulk load needs one (host, device) pair per outstanding copy: {pipeline}, not {len(pairs)}"
        )
    ends = [_ends(host, dev, direction) for host, dev in pairs]
    result = BulkLoad()
    seq = 0

    def start(slot: int) -> CopyHandle:
        nonlocal seq
        dst, src = ends[slot % len(ends)]
        if verify and src.array is not None:
            seq += 1
            _stamp(src.array[:nbytes], seq)
        return client.start_copy(dst, src, nbytes, priority=priority, deadline_ms=deadline_ms)

    started = time.perf_counter()
    inflight = [(start(slot), slot) for slot in range(pipeline)]
    while inflight:
        handle, slot = inflight.pop(0)
        try:
            r = await handle
            result.done.append((time.monotonic(), r.nbytes))
            result.bytes_moved += r.nbytes
            result.copies += 1
            if verify:
                dst, src = ends[slot]
                if dst.array is None or src.array is None:
                    result.unverified_bytes += nbytes
                else:
                    bad = _differing_bytes(dst.array[:nbytes], src.array[:nbytes])
                    result.corrupted_bytes += bad
                    result.corrupted_copies += int(bad > 0)
                    result.verified_bytes += nbytes - bad
        except Exception as exc:
            result.errors.append(f"{type(exc).__name__}: {exc}")
        if not stop.is_set():
            inflight.append((start(slot), slot))
    result.seconds = time.perf_counter() - started
    return result


class LoadProcess:
    """A synthetic client in a child process (``cmd``), started at once: it prints ``ready`` once
    set up, runs until SIGUSR1, then prints its result as one JSON line and exits.
    ``wait_ready``, then ``stop`` for the result; ``kill`` to clean up."""

    what = "load client"

    def __init__(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Return once the child says ready; RuntimeError (child killed) if it does not in time."""
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if line.strip() != "ready":
            self.proc.kill()
            raise RuntimeError(f"{self.what} did not get ready (exit {self.proc.poll()}, said {line!r})")

    def stop(self, timeout: float = 60.0) -> dict[str, Any]:
        """Stop the child (SIGUSR1), wait for it, return its JSON result."""
        self.proc.send_signal(signal.SIGUSR1)
        out, _ = self.proc.communicate(timeout=timeout)
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if not lines:
            raise RuntimeError(f"{self.what} exited {self.proc.returncode} without a result")
        result: dict[str, Any] = json.loads(lines[-1])
        return result

    def kill(self) -> None:
        """Kill the child if it still runs (a cleanup after `stop`, or instead of it)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class BulkProcess(LoadProcess):
    """`bulk_load` in a child process, started at once; ``wait_ready``, then ``stop`` for the result.

    The child connects (as ``name``), fills its host region, runs one warm-up copy (the first
    touch of fresh memfd pages costs far more than a copy) and says ready before the load starts.
    With ``verify`` it checks every copy's bytes (`bulk_load`'s ``verify``, one region pair per
    outstanding copy, each warmed before ready).

    `stop` returns ``{"done": [[t, nbytes], ...], "errors": [...]}``, and with ``verify``
    ``verified_bytes``, ``corrupted_bytes``, ``corrupted_copies`` and ``unverified_bytes`` too.
    """

    what = "bulk client"

    def __init__(
        self,
        socket_path: str,
        nbytes: int,
        pipeline: int,
        direction: str = "h2d",
        *,
        priority: str = "bulk",
        name: str = "bulk",
        verify: bool = False,
    ) -> None:
        code = "import sys; from priod.testing.load import bulk_process_main; sys.exit(bulk_process_main(sys.argv[1:]))"
        super().__init__(
            [
                sys.executable,
                "-c",
                code,
                socket_path,
                str(nbytes),
                str(pipeline),
                direction,
                priority,
                name,
                "verify" if verify else "-",
            ]
        )
        self.nbytes = nbytes


def bulk_process_main(argv: list[str]) -> int:
    """The child of `BulkProcess`: ``SOCKET NBYTES PIPELINE DIRECTION PRIORITY NAME [verify]``."""
    path, nbytes, pipeline, direction, priority, name = argv[0], int(argv[1]), int(argv[2]), argv[3], argv[4], argv[5]
    verify = argv[6:7] == ["verify"]

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGUSR1, stop.set)
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        client = await Client.connect(path, name=name, copy_path="daemon")
        regions: tuple[Region, Region] | list[tuple[Region, Region]]
        if verify:
            regions = await bulk_pairs(client, nbytes, pipeline, direction=direction, priority=priority)
        else:
            host = await client.alloc_host(nbytes)
            dev = await client.alloc_device(nbytes)
            if host.array is not None:
                host.array[:] = 0x5A
            dst, src = _ends(host, dev, direction)
            await client.copy(dst, src, nbytes, priority=priority)
            regions = (host, dev)
        print("ready", flush=True)
        result = await bulk_load(
            client,
            nbytes,
            stop,
            priority=priority,
            pipeline=pipeline,
            direction=direction,
            regions=regions,
            verify=verify,
        )
        await client.close()
        out: dict[str, Any] = {"done": result.done, "errors": result.errors}
        if verify:
            out.update(
                verified_bytes=result.verified_bytes,
                corrupted_bytes=result.corrupted_bytes,
                corrupted_copies=result.corrupted_copies,
                unverified_bytes=result.unverified_bytes,
            )
        print(json.dumps(out), flush=True)

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
