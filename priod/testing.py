"""Helpers shipped for tests, the demo and the benchmarks: a daemon in its own process, and
synthetic bulk and urgent clients. They use only the public client API."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .client import Client, Region

__all__ = ["DaemonProcess", "daemon_process", "BulkLoad", "bulk_load", "urgent_probe", "percentile", "wait_for_socket"]


def wait_for_socket(path: str, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the daemon exited with {proc.returncode} before listening on {path}")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            return
        except OSError:
            time.sleep(0.02)
        finally:
            s.close()
    raise TimeoutError(f"no daemon listening on {path} after {timeout} s")


@dataclass
class DaemonProcess:
    """``priod serve`` running in a child process on a private socket."""

    proc: subprocess.Popen[bytes]
    socket_path: str
    log_path: str

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as fp:
            return fp.read()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@contextmanager
def daemon_process(
    env: Mapping[str, str] | None = None,
    *,
    backend: str = "sim",
    config: str | None = None,
    args: tuple[str, ...] = (),
    socket_path: str | None = None,
    start_timeout: float = 60.0,
) -> Iterator[DaemonProcess]:
    """Start a daemon, wait until it listens, stop it (SIGTERM) on exit.

    ``env`` adds settings as ``PRIOD_<SECTION>__<KEY>`` variables.
    """
    tmp = tempfile.mkdtemp(prefix="priod-")
    path = socket_path or os.path.join(tmp, "priod.sock")
    log_path = os.path.join(tmp, "daemon.log")
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PRIOD_")}
    full_env.update(env or {})
    cmd = [sys.executable, "-m", "priod", "serve", "--socket", path, "--backend", backend, *args]
    if config:
        cmd += ["--config", config]
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=full_env)
    d = DaemonProcess(proc, path, log_path)
    try:
        wait_for_socket(path, start_timeout, proc)
        yield d
    finally:
        d.stop()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return float(np.percentile(np.asarray(values), q))


@dataclass
class BulkLoad:
    bytes_moved: int = 0
    seconds: float = 0.0
    copies: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def gbps(self) -> float:
        return self.bytes_moved / self.seconds / 1e9 if self.seconds else 0.0


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
    """Keep ``pipeline`` copies of ``nbytes`` outstanding until ``stop`` is set; count what landed."""
    if regions is None:
        host = await client.alloc_host(nbytes)
        dev = await client.alloc_device(nbytes)
    else:
        host, dev = regions
    dst, src = (dev, host) if direction == "h2d" else (host, dev)
    result = BulkLoad()
    started = time.perf_counter()
    inflight = [client.start_copy(dst, src, nbytes, priority=priority) for _ in range(pipeline)]
    while inflight:
        handle = inflight.pop(0)
        try:
            r = await handle
            result.bytes_moved += r.nbytes
            result.copies += 1
        except Exception as exc:  # noqa: BLE001 - the load test counts errors by kind
            result.errors.append(type(exc).__name__)
        if not stop.is_set():
            inflight.append(client.start_copy(dst, src, nbytes, priority=priority))
    result.seconds = time.perf_counter() - started
    return result


async def urgent_probe(
    client: Client,
    size: int,
    count: int,
    *,
    interval_s: float = 0.005,
    priority: str = "urgent",
    direction: str = "h2d",
) -> list[float]:
    """Send ``count`` copies of ``size`` one at a time; client-side latency of each in microseconds.

    Every copy's bytes are checked at the destination (a new pattern per copy).
    """
    host = await client.alloc_host(size)
    dev = await client.alloc_device(size)
    dst, src = (dev, host) if direction == "h2d" else (host, dev)
    latencies: list[float] = []
    for i in range(count):
        if src.array is not None:
            src.array[:] = (i * 7 + 1) % 251
        t0 = time.perf_counter()
        await client.copy(dst, src, size, priority=priority)
        latencies.append((time.perf_counter() - t0) * 1e6)
        if dst.array is not None and src.array is not None and not np.array_equal(dst.array, src.array):
            raise AssertionError(f"urgent copy {i} of {size} bytes: destination differs from source")
        await asyncio.sleep(interval_s)
    await client.free(host)
    await client.free(dev)
    return latencies


def describe(values: list[float]) -> dict[str, Any]:
    return {"n": len(values), "p50": percentile(values, 50), "p99": percentile(values, 99), "max": max(values) if values else float("nan")}
