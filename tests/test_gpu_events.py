"""GPU-side ordering on a real GPU (marker ``gpu``; skipped where there is none).

A slow torch kernel in this process produces a copy's source and records an interprocess event;
the daemon, told to wait for it, copies the kernel's output and not the stale bytes before it.
A copy with a ``signal_event``: once the daemon reports it recorded (the copy may still be in
flight), a kernel on this process's stream that waits on the event reads the copied bytes, with
no host synchronisation in between; in uint8, bf16 and fp8 tensors. Handles that are not events
are refused, and an event its client destroys early breaks nothing but that client's copy.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import priod
from priod.testing import DaemonProcess, daemon_process

pytestmark = pytest.mark.gpu

MiB = 1 << 20
SLEEP_CYCLES = 200_000_000
"""``torch.cuda._sleep``: about 0.1 s of a spinning kernel at H200 clocks, far longer than the copy."""


def _torch() -> Any:
    """torch, untyped here (its stubs vary by release; ``torch.cuda._sleep`` has none)."""
    import torch

    return torch


def _event(kind: str) -> Any:
    torch = _torch()

    if kind == "torch":
        return torch.cuda.Event(interprocess=True)  # blocking=False, enable_timing=False: what IPC needs
    from priod.client.cuda_ipc import ipc_event

    return ipc_event(torch.cuda.current_device())


def _record(ev: Any) -> None:
    torch = _torch()

    if hasattr(ev, "ipc_handle"):
        ev.record()
    else:
        ev.record(torch.cuda.current_stream())


@pytest.mark.parametrize("kind", ["torch", "priod"])
@pytest.mark.parametrize("form", ["copy", "batch"])
def test_wait_event_copies_the_kernels_output_not_stale_bytes(gpu_daemon: DaemonProcess, kind: str, form: str) -> None:
    """A 64 MiB tensor is written by a kernel queued behind ~0.1 s of spinning; the event is
    recorded behind it and the copy (device -> host) sent at once: the host gets the kernel's
    bytes (not the zeros before it), and the daemon reports having waited for the kernel."""
    torch = _torch()

    n = 64 * MiB
    with priod.SyncClient(gpu_daemon.socket_path, copy_path="daemon") as c:
        buf = torch.zeros(n, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        src = c.register_device(buf)
        host = c.alloc_host(n)
        assert host.array is not None
        host.array[:] = 1
        ev = _event(kind)
        pattern = torch.arange(n, device="cuda", dtype=torch.int64).remainder_(251).to(torch.uint8) + 3
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        buf.copy_(pattern)  # the producer: runs only after the sleep
        _record(ev)
        r: priod.CopyResult | priod.BatchResult
        if form == "copy":
            r = c.copy(host, src, wait_event=ev, priority="urgent", timeout=30)
        else:
            half = n // 2
            r = c.copy_batch(
                host, src, [(0, 0, half), (half, half, half)], wait_event=ev, priority="urgent", timeout=30
            )
        want = pattern.cpu().numpy()
        assert np.array_equal(host.array, want), "the copy read the source before the producing kernel finished"
        assert r.event_wait_us is not None and r.event_wait_us > 10_000, r  # it did wait for the sleep
        torch.cuda.synchronize()
        c.free(src)


@pytest.fixture(scope="module")
def deep_daemon() -> Iterator[DaemonProcess]:
    """A cuda daemon with 40 ms of bulk in flight per lane (max_block_us), not 1 ms: a copy's
    signal_event is recorded behind its last chunk, when at most that much of the copy is left,
    so the client has that long to queue its kernel while the copy is still in flight. With 1
    ms a slow loop turn on a busy host lets the copy land first, and the test cannot tell
    whether the ordering held (it says so rather than pass)."""
    env = {"PRIOD_LOG__LEVEL": '"warning"', "PRIOD_SCHEDULER__MAX_BLOCK_US": "40000"}
    with daemon_process(env, backend="cuda", start_timeout=120) as d:
        yield d


@pytest.mark.parametrize("dtype", ["uint8", "bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("kind", ["torch", "priod"])
def test_signal_event_orders_a_kernel_after_the_copy_without_host_sync(
    deep_daemon: DaemonProcess, kind: str, dtype: str
) -> None:
    """A 256 MiB bulk copy host -> a registered tensor, with a signal_event: as soon as the
    daemon reports the event recorded, this process's stream waits on it and a kernel copies the
    tensor out (no host synchronisation between); that kernel read every copied byte. The report
    came while the copy was still in flight, so a missing wait would have read stale bytes."""
    torch = _torch()

    n = 256 * MiB
    rng = np.random.default_rng(11)
    with priod.SyncClient(deep_daemon.socket_path, copy_path="daemon") as c:
        raw = torch.zeros(n, dtype=torch.uint8, device="cuda")
        t = raw.view(getattr(torch, dtype))  # the tensor the reader kernel works on
        torch.cuda.synchronize()
        dst = c.register_device(raw)
        host = c.alloc_host(n)
        assert host.array is not None
        host.array[:] = rng.integers(0, 256, n, dtype=np.uint8)
        ev = _event(kind)
        h = c.start_copy(dst, host, signal_event=ev, priority="bulk")
        h.wait_recorded(timeout=30)
        stream = torch.cuda.current_stream()
        if hasattr(ev, "ipc_handle"):
            stream.wait_event(ev)
        else:
            ev.wait(stream)
        out = t.clone()  # the reader kernel, queued behind the wait
        in_flight = not h.done()
        h.wait(timeout=60)
        torch.cuda.synchronize()
        assert np.array_equal(out.view(torch.uint8).cpu().numpy(), host.array), (
            "the kernel read bytes the copy had not written yet"
        )
        assert in_flight, "the record was reported only once the copy had landed: this run did not test the ordering"
        c.free(dst)


def test_handles_that_are_not_events_are_refused(gpu_daemon: DaemonProcess) -> None:
    """64 random bytes, a memory handle and an all-zero handle are refused with bad_request;
    the connection and the daemon go on."""
    torch = _torch()

    with priod.SyncClient(gpu_daemon.socket_path, copy_path="daemon") as c:
        h, d = c.alloc_host(MiB), c.alloc_device(MiB)
        buf = torch.zeros(MiB, dtype=torch.uint8, device="cuda")
        from priod.client.cuda_ipc import export_cuda_array

        mem_handle = export_cuda_array(buf)[0]
        for handle in (np.random.default_rng(5).integers(0, 256, 64, dtype=np.uint8).tobytes(), mem_handle, bytes(64)):
            with pytest.raises(priod.InvalidRequest, match=r"^wait_event: the event handle does not open on gpu\d+"):
                c.copy(d, h, 4096, wait_event=handle)
        c.ping()
        assert c.copy(d, h, 4096).nbytes == 4096


def test_an_event_destroyed_early_breaks_only_its_own_copy(gpu_daemon: DaemonProcess) -> None:
    """The client records an event behind a slow kernel, sends a copy waiting on it and
    destroys the event at once: the copy lands, fails with an engine error or times out (and is
    cancelled), all within seconds; another client's copies are untouched meanwhile, and the
    daemon serves on. Prints which outcome, for docs/protocol.md."""
    torch = _torch()

    with (
        priod.SyncClient(gpu_daemon.socket_path, copy_path="daemon") as c,
        priod.SyncClient(gpu_daemon.socket_path) as other,
    ):
        h, d = c.alloc_host(MiB), c.alloc_device(MiB)
        oh, od = other.alloc_host(MiB), other.alloc_device(MiB)
        from priod.client.cuda_ipc import ipc_event

        ev = ipc_event(torch.cuda.current_device())
        torch.cuda._sleep(SLEEP_CYCLES)
        ev.record(torch.cuda.current_stream())
        handle = c.start_copy(d, h, wait_event=ev, priority="urgent")
        ev.close()
        start = time.perf_counter()
        for _ in range(20):
            assert other.copy(od, oh, priority="urgent", timeout=5).nbytes == MiB
        try:
            r = handle.wait(timeout=10)
            outcome = f"landed after waiting {r.event_wait_us} us"
        except (priod.EngineError, priod.CopyTimeout) as exc:  # its own copy only: either is contained
            outcome = f"{type(exc).__name__}: {exc}"
        print(
            f"event destroyed by its client while a copy waited on it: {outcome} ({time.perf_counter() - start:.3f} s)"
        )
        torch.cuda.synchronize()
        c.ping()
