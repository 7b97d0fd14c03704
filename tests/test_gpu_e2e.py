"""Through the daemon on a real GPU (marker ``gpu``; skipped where there is none).

Every direction, DMA and express paths, odd sizes and offsets, bytes checked; two client
processes sharing one daemon, one of them copying into its own CuPy buffer.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import priod
from priod.testing import DaemonProcess, daemon_process

pytestmark = pytest.mark.gpu

SIZES = [1, 4097, 64 << 10, (1 << 20) + 7, 3 << 20]
OFFSETS = [(0, 0), (19, 35), (5, 2)]


@pytest.mark.parametrize("priority", ["normal", "urgent"])
def test_every_direction_bytes_checked(gpu_daemon: DaemonProcess, priority: str) -> None:
    """h2d, d2d, d2h at odd sizes and offsets, by DMA (normal) and express (urgent); bytes match."""
    import cupy as cp

    rng = np.random.default_rng(7)
    n_region = 4 << 20
    with priod.SyncClient(gpu_daemon.socket_path, copy_path="daemon") as c:
        src, back = c.alloc_host(n_region), c.alloc_host(n_region)
        d1, d2 = c.alloc_device(n_region), c.alloc_device(n_region)
        assert src.array is not None and back.array is not None
        view1, view2 = d1.cuda(), d2.cuda()
        try:
            paths = set()
            for n in SIZES:
                for so, do in OFFSETS:
                    src.array[so : so + n] = rng.integers(0, 256, n, dtype=np.uint8)
                    r1 = c.copy(d1, src, n, dst_offset=do, src_offset=so, priority=priority)
                    got = cp.asnumpy(cp.asarray(view1)[do : do + n])
                    assert np.array_equal(got, src.array[so : so + n]), f"h2d {n} @ {so}->{do}"
                    r2 = c.copy(d2, d1, n, dst_offset=so, src_offset=do, priority=priority)
                    r3 = c.copy(back, d2, n, dst_offset=do, src_offset=so, priority=priority)
                    assert np.array_equal(back.array[do : do + n], src.array[so : so + n]), (
                        f"round trip {n} @ {so}->{do}"
                    )
                    paths |= {r1.path, r2.path, r3.path}
            assert paths == ({"dma"} if priority == "normal" else {"dma", "express"})
            # An urgent copy's reply comes from the landed word the GPU stores behind its bytes
            # (the bytes were checked above right after each reply); a normal one's from the
            # daemon's completion.
            if priority == "urgent":
                assert c.landed_replies > 0
            else:
                assert c.landed_replies == 0
            cp.cuda.runtime.deviceSynchronize()
        finally:
            view1.close()
            view2.close()


def _cupy_client(path: str, q: mp.Queue[str]) -> None:
    """A second process: registers its own CuPy buffer and copies into it."""
    import cupy as cp

    try:
        with priod.SyncClient(path, name="cupy-client", copy_path="daemon") as c:
            buf = cp.zeros(5 << 20, dtype=cp.uint8)[1000:]  # an offset into a pool allocation
            region = c.register_device(buf)
            host = c.alloc_host(region.nbytes)
            assert host.array is not None
            host.array[:] = np.arange(region.nbytes, dtype=np.uint64).astype(np.uint8)
            for priority in ("bulk", "urgent"):
                c.copy(region, host, priority=priority)
                cp.cuda.runtime.deviceSynchronize()
                if not np.array_equal(cp.asnumpy(buf), host.array):
                    q.put(f"mismatch after {priority} copy into a registered CuPy buffer")
                    return
                buf[:] = 0
            c.free(region)
        q.put("ok")
    except Exception as exc:
        q.put(f"{type(exc).__name__}: {exc}")


def test_two_processes_one_with_its_own_cupy_buffer(gpu_daemon: DaemonProcess) -> None:
    """While this process copies through the daemon, another registers a CuPy array and copies into it."""
    ctx = mp.get_context("spawn")
    q: mp.Queue[str] = ctx.Queue()
    child = ctx.Process(target=_cupy_client, args=(gpu_daemon.socket_path, q))
    child.start()
    with priod.SyncClient(gpu_daemon.socket_path, copy_path="daemon") as c:
        h, d, back = c.alloc_host(8 << 20), c.alloc_device(8 << 20), c.alloc_host(8 << 20)
        assert h.array is not None and back.array is not None
        for i in range(10):
            h.array[:] = i
            c.copy(d, h, priority="bulk")
            c.copy(back, d, priority="normal")
            assert int(back.array.min()) == int(back.array.max()) == i
    assert q.get(timeout=120) == "ok"
    child.join(timeout=60)
    assert child.exitcode == 0


def _bulk_round_trips(path: str, n: int, rounds: int, errors: list[str]) -> None:
    """Bulk copies host -> device -> host of ``n`` bytes, ``rounds`` times, checking each."""
    try:
        with priod.SyncClient(path, name="bulk", copy_path="daemon") as c:
            src, back, d = c.alloc_host(n), c.alloc_host(n), c.alloc_device(n)
            assert src.array is not None and back.array is not None
            for i in range(rounds):
                src.array[:] = np.arange(n, dtype=np.uint32).astype(np.uint8) + i
                c.copy(d, src, priority="bulk")
                c.copy(back, d, priority="bulk")
                if not np.array_equal(back.array, src.array):
                    errors.append(f"bulk round trip {i} differs")
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}")


@pytest.mark.parametrize("bulk_poll", ["spin", "timer"])
def test_bulk_and_urgent_together_in_each_poll_mode(bulk_poll: str) -> None:
    """256 MiB bulk round trips in one thread, urgent copies (both paths) in another: every byte
    lands, in both ``[server] bulk_poll`` modes (timer sleeps between bulk chunks; spin polls)."""
    import threading

    env = {"PRIOD_LOG__LEVEL": '"warning"', "PRIOD_SERVER__BULK_POLL": f'"{bulk_poll}"'}
    errors: list[str] = []
    with (
        daemon_process(env, backend="cuda", start_timeout=120) as dmn,
        priod.SyncClient(dmn.socket_path, name="urgent", copy_path="daemon") as c,
    ):
        n = 16 << 20
        usrc, uback, ud = c.alloc_host(n), c.alloc_host(n), c.alloc_device(n)
        assert usrc.array is not None and uback.array is not None
        bulk = threading.Thread(target=_bulk_round_trips, args=(dmn.socket_path, 256 << 20, 4, errors))
        bulk.start()
        paths, rounds = set(), 0
        while bulk.is_alive() or rounds == 0:
            for size in (64 << 10, 1 << 20, n):
                usrc.array[:size] = (rounds + size) % 251
                r1 = c.copy(ud, usrc, size, priority="urgent")
                r2 = c.copy(uback, ud, size, priority="urgent")
                assert np.array_equal(uback.array[:size], usrc.array[:size]), f"urgent {size} round {rounds}"
                paths |= {r1.path, r2.path}
            rounds += 1
        bulk.join()
        assert errors == []
        assert "express" in paths and rounds > 1


def _pod_client(path: str, expect_uuid: str, q: mp.Queue[str]) -> None:
    """A process that sees one GPU only, by ``CUDA_VISIBLE_DEVICES=<its UUID>`` as a pod does:
    whatever the daemon calls it, this process calls it 0. It names the GPU by UUID both ways
    (its own CuPy buffer, a daemon allocation) and opens the daemon's region on its own ordinal."""
    import cupy as cp

    from priod.client.cuda_ipc import gpu_uuid

    try:
        mine = gpu_uuid(0)
        if mine != expect_uuid:
            q.put(f"this process's gpu 0 is {mine}, not {expect_uuid}: CUDA_VISIBLE_DEVICES did not apply")
            return
        n = 3 << 20
        with priod.SyncClient(path, name="pod", copy_path="daemon") as c:
            buf = cp.zeros(n, dtype=cp.uint8)
            own = c.register_device(buf)
            theirs = c.alloc_device(n, device=mine)
            host = c.alloc_host(n)
            assert host.array is not None
            host.array[:] = np.arange(n, dtype=np.uint32).astype(np.uint8)
            c.copy(own, host, priority="bulk")
            c.copy(theirs, host, priority="urgent")
            cp.cuda.runtime.deviceSynchronize()
            view = theirs.cuda()  # opened on this process's ordinal of the UUID, not the daemon's
            try:
                same = np.array_equal(cp.asnumpy(buf), host.array) and np.array_equal(
                    cp.asnumpy(cp.asarray(view)), host.array
                )
            finally:
                view.close()
            q.put(
                json.dumps(
                    {"same": same, "own": [own.device, own.device_uuid], "theirs": [theirs.device, theirs.device_uuid]}
                )
            )
    except Exception as exc:
        q.put(f"{type(exc).__name__}: {exc}")


def test_a_pod_with_one_visible_gpu_names_it_by_uuid(
    gpu_daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon's last GPU, seen by a client process as its only one (CUDA_VISIBLE_DEVICES=UUID):
    its buffer and a daemon allocation it names by UUID both land on that GPU (the daemon's
    ordinal comes back), and the bytes are right. The UUIDs match what nvidia-smi prints."""
    with priod.SyncClient(gpu_daemon.socket_path, copy_path="daemon") as c:
        gpus = c.status()["gpus"]
    assert gpus and all(g["uuid"].startswith("GPU-") for g in gpus)
    if shutil.which("nvidia-smi"):
        listed = subprocess.run(
            ["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], capture_output=True, text=True, timeout=60
        ).stdout.split()
        assert {g["uuid"] for g in gpus} <= set(listed)
    target = gpus[-1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", target["uuid"])  # the spawned child's environment only
    ctx = mp.get_context("spawn")
    q: mp.Queue[str] = ctx.Queue()
    child = ctx.Process(target=_pod_client, args=(gpu_daemon.socket_path, target["uuid"], q))
    child.start()
    got = q.get(timeout=120)
    child.join(timeout=60)
    assert child.exitcode == 0
    assert got.startswith("{"), got
    assert json.loads(got) == {
        "same": True,
        "own": [target["index"], target["uuid"]],
        "theirs": [target["index"], target["uuid"]],
    }, got


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([str(Path(__file__)), "-q"]))
