"""What a process costs, read from Linux's ``/proc``: CPU time, memory, open fds.

The load test and the benchmark watch the daemon from outside with these. Nothing here needs
psutil: the CPU figures are the ones psutil reports (``utime + stime`` of ``/proc/<pid>/stat``
in clock ticks, per process and per thread), read the same way, and ``schedstat`` adds the
same figures in nanoseconds where the kernel exposes it (what "no CPU measurable when idle"
needs: a clock tick is 10 ms).
"""

from __future__ import annotations

import os
import time
from typing import Final

__all__ = [
    "CpuMeter",
    "cpu_model",
    "cpu_seconds",
    "memory_and_fds",
    "open_fds",
    "schedstat_seconds",
    "thread_cpu_seconds",
]

CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK")
STATUS_MIB_KEYS: Final = ("VmRSS", "RssAnon", "RssShmem")
"""``/proc/<pid>/status`` lines in kB, reported in MiB by `memory_and_fds`."""


def _stat_times(path: str) -> float:
    """utime + stime, in seconds, of one ``stat`` file (a process's or a thread's)."""
    with open(path, "rb") as fp:
        raw = fp.read()
    # The command name (2nd field) may hold spaces and parentheses: split after its last ')'.
    fields = raw[raw.rfind(b")") + 2 :].split()
    return float(fields[11]) / CLOCK_TICKS + float(fields[12]) / CLOCK_TICKS


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds ``pid`` has used, all threads together (clock-tick resolution)."""
    return _stat_times(f"/proc/{pid}/stat")


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """User plus system CPU seconds of each thread of ``pid``, by thread id.

    Raises OSError where the threads' files cannot be read (some sandboxes hide them); a thread
    that ends while this runs is left out.
    """
    out: dict[int, float] = {}
    base = f"/proc/{pid}/task"
    for tid in sorted(os.listdir(base)):
        try:
            out[int(tid)] = _stat_times(f"{base}/{tid}/stat")
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def schedstat_seconds(pid: int) -> tuple[float, float] | None:
    """CPU seconds of ``pid`` in nanosecond resolution: (all threads, the main thread).

    From ``/proc/<pid>/task/*/schedstat``; None where the kernel does not expose it.
    """
    base = f"/proc/{pid}/task"
    try:
        total, main = 0, 0
        for tid in os.listdir(base):
            with open(f"{base}/{tid}/schedstat") as fp:
                ns = int(fp.read().split()[0])
            total += ns
            if int(tid) == pid:
                main = ns
        return total / 1e9, main / 1e9
    except (OSError, ValueError):
        return None


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds ``pid`` has used, all threads: nanosecond resolution where the kernel has
    schedstat (`schedstat_seconds`), else clock ticks (`cpu_seconds`)."""
    precise = schedstat_seconds(pid)
    return precise[0] if precise is not None else cpu_seconds(pid)


def open_fds(pid: int) -> int:
    """How many file descriptors ``pid`` holds open."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def memory_and_fds(pid: int) -> dict[str, float]:
    """RSS (``VmRSS``, ``RssAnon``, ``RssShmem``) in MiB, ``Threads`` and open ``fds`` of ``pid``.

    Empty if the process is gone (or not ours to read); a key the kernel does not report is left out.
    """
    out: dict[str, float] = {}
    try:
        with open(f"/proc/{pid}/status") as fp:
            for line in fp:
                key, _, value = line.partition(":")
                if key in STATUS_MIB_KEYS:
                    out[key] = int(value.split()[0]) / 1024
                elif key == "Threads":
                    out[key] = int(value.split()[0])
        out["fds"] = open_fds(pid)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return out


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` ("" where it says none)."""
    try:
        with open("/proc/cpuinfo") as fp:
            for line in fp:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def machine(**extra: object) -> dict[str, object]:
    """What a benchmark ran on, for its JSON report: cores, CPU, Python, platform, priod and
    numpy versions, and whatever the caller adds."""
    import platform

    import numpy as np

    from priod._version import __version__

    return {
        "nproc": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "cpu_model": cpu_model(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "priod": __version__,
        "numpy": np.__version__,
        **extra,
    }


class CpuMeter:
    """CPU seconds of a process and of its main thread (which runs the daemon's event loop).

    `sample` gives ``wall`` (monotonic seconds), ``cpu`` and ``loop`` (clock ticks, as psutil
    reports them; ``loop`` is NaN where per-thread times are hidden) and, where schedstat is
    readable, ``cpu_ns`` and ``loop_ns`` (the same in nanosecond resolution, still in seconds).
    `delta` turns two samples into what was used between them.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def sample(self) -> dict[str, float]:
        cpu = cpu_seconds(self.pid)
        try:
            threads = thread_cpu_seconds(self.pid)
        except OSError:
            threads = {}
        s: dict[str, float] = {"wall": time.monotonic(), "cpu": cpu, "loop": threads.get(self.pid, float("nan"))}
        precise = schedstat_seconds(self.pid)
        if precise is not None:
            s["cpu_ns"], s["loop_ns"] = precise
        return s

    @staticmethod
    def delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
        """``b - a`` for every figure in both; ``wall`` becomes ``seconds``."""
        out = {k: b[k] - a[k] for k in a if k in b}
        out["seconds"] = out.pop("wall")
        return out
