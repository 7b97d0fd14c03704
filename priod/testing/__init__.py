"""Helpers shipped for tests, the demo and the benchmark scripts. They use only public APIs.

- `priod.testing.daemon`: a daemon in its own process (`daemon_process`), waiting for a socket,
  the pid behind a socket.
- `priod.testing.load`: synthetic clients: a bulk load (in this process or its own, its bytes
  checked or not), urgent probes, the plumbing of a client in a process of its own.
- `priod.testing.stats`: percentiles and latency summaries.
- `priod.testing.scrape`: a daemon's /metrics as tests read it (`Scraper`, `get`, `total`).
- `priod.testing.scripts`: a checkout's ``scripts/*.py`` imported as modules (`import_script`).
- `priod.testing.procfs`: a process's CPU time, memory and open fds, read from ``/proc``.
- `priod.testing.fakes`: `ManualEngine` (an engine whose copies finish on command) and
  `framed_pair` (connected framed sockets), for tests of the daemon's parts.
- `priod.testing.cuda`: `FakeCuda`, scripted stand-ins for cuda.bindings' runtime and driver,
  put in place through `priod.common.cuda.driver.use_bindings`, for CUDA code without a GPU.

Every public name is importable from ``priod.testing`` itself.
"""

from __future__ import annotations

from priod.testing.cuda import DriverStatus, FakeApi, FakeCall, FakeCuda, FakeHandle, MemcpyKind, RuntimeStatus
from priod.testing.daemon import DaemonProcess, daemon_pid, daemon_process, settings_env, wait_for_socket, wait_until
from priod.testing.fakes import (
    ManualChunk,
    ManualDeviceMemory,
    ManualEngine,
    blocking_framed_pair,
    framed_pair,
    memfd,
)
from priod.testing.load import (
    BulkLoad,
    BulkProcess,
    LoadProcess,
    UrgentProbe,
    bulk_load,
    bulk_pairs,
    throughput_between,
    urgent_copies,
    urgent_probe,
)
from priod.testing.procfs import (
    CpuMeter,
    cpu_model,
    cpu_seconds,
    machine,
    memory_and_fds,
    open_fds,
    process_cpu_seconds,
    schedstat_seconds,
    thread_cpu_seconds,
)
from priod.testing.stats import describe, percentile, summarize

__all__ = [
    "BulkLoad",
    "BulkProcess",
    "CpuMeter",
    "DaemonProcess",
    "DriverStatus",
    "FakeApi",
    "FakeCall",
    "FakeCuda",
    "FakeHandle",
    "LoadProcess",
    "ManualChunk",
    "ManualDeviceMemory",
    "ManualEngine",
    "MemcpyKind",
    "RuntimeStatus",
    "UrgentProbe",
    "blocking_framed_pair",
    "bulk_load",
    "bulk_pairs",
    "cpu_model",
    "cpu_seconds",
    "daemon_pid",
    "daemon_process",
    "describe",
    "framed_pair",
    "machine",
    "memfd",
    "memory_and_fds",
    "open_fds",
    "percentile",
    "process_cpu_seconds",
    "schedstat_seconds",
    "settings_env",
    "summarize",
    "thread_cpu_seconds",
    "throughput_between",
    "urgent_copies",
    "urgent_probe",
    "wait_for_socket",
    "wait_until",
]
