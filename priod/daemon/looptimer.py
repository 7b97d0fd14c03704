"""A sub-millisecond wake-up on the event loop itself: a Linux timerfd that the loop watches.

The poller must look at a lane's bulk chunks about every 500 us, and the loop's own timers are
about 1 ms coarse (uvloop counts in milliseconds). priod first slept a thread on a condition
variable until the time asked, which then woke the loop through its self-pipe: every poll cost
two thread wake-ups and two GIL hand-overs, and that thread alone took 0.11-0.15 CPU s/s of the
daemon's ~0.4 with bulk alone on the H200 (docs/benchmarks.md). A timerfd makes the loop's own
epoll return at the time asked, to within the kernel's timer slack, with no other thread.

Python 3.13 has ``os.timerfd_create``; the two libc calls are reached through ctypes here so
that 3.11 and 3.12 have them too.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import time
from collections.abc import Callable

__all__ = ["LoopTimer"]

_CLOCK_MONOTONIC = time.CLOCK_MONOTONIC
_TFD_TIMER_ABSTIME = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class LoopTimer:
    """Calls ``wake`` on ``loop`` once the earliest time asked of `wake_at` has come.

    One shot: after it fires, the next `wake_at` arms it again. A later time than the one
    armed is ignored (the caller re-plans when it is woken). Loop thread only.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, wake: Callable[[], None]) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        create, self._settime = libc.timerfd_create, libc.timerfd_settime
        create.argtypes, create.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        self._settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        self._settime.restype = ctypes.c_int
        fd = create(_CLOCK_MONOTONIC, os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"timerfd_create: {os.strerror(errno)}")
        self._fd = fd
        self._loop = loop
        self._wake = wake
        self._at: float | None = None
        """The time armed (perf_counter seconds), None while disarmed."""
        self._spec = _Itimerspec()
        loop.add_reader(fd, self._fired)

    def wake_at(self, at: float) -> None:
        """Wake the loop at ``at`` (``time.perf_counter`` seconds), or at once if it has passed."""
        if self._at is not None and at >= self._at:
            return
        self._at = at
        # The timer counts on CLOCK_MONOTONIC; perf_counter's clock need not be that one.
        mono = max(at - time.perf_counter() + time.clock_gettime(_CLOCK_MONOTONIC), 1e-9)
        value = self._spec.it_value
        value.tv_sec = int(mono)
        value.tv_nsec = max(int((mono - value.tv_sec) * 1e9), 1)  # all zero would disarm it
        if self._settime(self._fd, _TFD_TIMER_ABSTIME, ctypes.byref(self._spec), None) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"timerfd_settime: {os.strerror(errno)}")

    def _fired(self) -> None:
        try:
            os.read(self._fd, 8)  # the expiry count; reading it clears the fd
        except BlockingIOError:
            return  # re-armed between its expiry and this callback: it fires again
        self._at = None
        self._wake()

    def close(self) -> None:
        """Stop watching the timer and close it. Idempotent."""
        if self._fd >= 0:
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1
