"""A daemon restart on a real GPU (marker ``gpu``): the KV data of every kind of device region
comes through it bitwise, and the same `Region` objects go on working.

The cuda engine allocates with ``cuMemCreate`` and hands the client the allocation's POSIX fd;
the client keeps it and registers it with the next daemon. A region opened in the client
(`Region.cuda`, the client's own mapping) and one never opened here (only the fd holds it)
both keep their bytes through a SIGKILL and a SIGTERM of the daemon. A PyTorch tensor
registered with `register_device`, from the caching allocator and from expandable segments
(``cuMemCreate`` pages, passed by fd), is registered again from the tensor the region holds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest

import priod
from priod.testing import daemon_process

pytestmark = pytest.mark.gpu

MiB = 1 << 20
ENV = {"PRIOD_LOG__LEVEL": '"warning"'}


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_daemon_allocated_device_regions_outlive_the_daemon(how: str) -> None:
    import cupy as cp

    n = 8 * MiB + 4097  # not a multiple of the allocation granularity
    path = os.path.join(tempfile.mkdtemp(prefix="priod-gpu-restart-"), "priod.sock")
    rng = np.random.default_rng(5)
    first_bytes, second_bytes = rng.integers(0, 256, n, dtype=np.uint8), rng.integers(0, 256, n, dtype=np.uint8)
    with ExitStack() as stack:
        first = stack.enter_context(daemon_process(ENV, backend="cuda", socket_path=path, start_timeout=120))
        with priod.SyncClient(path, copy_path="daemon", reconnect_s=60.0) as c:
            host, back = c.alloc_host(n), c.alloc_host(n)
            opened, unopened = c.alloc_device(n), c.alloc_device(n)
            assert host.array is not None and back.array is not None
            assert opened.export["kind"] == "vmm_fd" and opened.export["size"] >= n
            view = opened.cuda()
            host.array[:] = first_bytes
            c.copy(opened, host)
            host.array[:] = second_bytes
            c.copy(unopened, host)
            assert np.array_equal(cp.asnumpy(cp.asarray(view)), first_bytes)

            first.stop(signal.SIGKILL if how == "SIGKILL" else signal.SIGTERM)
            stack.enter_context(daemon_process(ENV, backend="cuda", socket_path=path, start_timeout=120))

            # The first request reconnects and registers every region again from its fd.
            c.copy(back, unopened)
            assert np.array_equal(back.array, second_bytes), "a never-opened daemon allocation lost its bytes"
            assert not c.lost_regions
            c.copy(back, opened)
            assert np.array_equal(back.array, first_bytes), "an opened daemon allocation lost its bytes"
            # Both still take copies, and the client's own mapping sees the new daemon's writes.
            c.copy(opened, unopened)
            cp.cuda.runtime.deviceSynchronize()
            assert np.array_equal(cp.asnumpy(cp.asarray(view)), second_bytes)
            view.close()
            c.free(opened)
            c.free(unopened)


ROOT = Path(__file__).resolve().parent.parent
_TENSOR_CLIENT = """
import sys
import numpy as np
import torch
import priod

n = 1 << 20  # within one 2 MiB page of expandable segments
t = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
want = t.cpu().numpy()
with priod.SyncClient(sys.argv[1], copy_path="daemon", reconnect_s=60.0) as c:
    region, back = c.register_device(t), c.alloc_host(n)
    c.copy(back, region)
    assert np.array_equal(back.array, want), "before the restart"
    print("ready", flush=True)
    sys.stdin.readline()  # the daemon is restarted meanwhile
    back.array[:] = 0
    c.copy(back, region)  # reconnects and registers the tensor again
    same = np.array_equal(back.array, want)
    back.array[:] = 7
    c.copy(region, back)
    torch.cuda.synchronize()
    written = bool((t == 7).all())
    print("ok" if same and written and not c.lost_regions else f"bad: same {same} written {written} lost {c.lost_regions}")
"""


@pytest.mark.parametrize("allocator", ["native", "expandable_segments"])
def test_registered_torch_tensor_comes_back_after_a_restart(allocator: str) -> None:
    """A tensor registered from another process keeps its bytes through a SIGKILL of the daemon
    (the memory is the client's), and the same Region takes copies both ways from the new one."""
    pytest.importorskip("torch")
    path = os.path.join(tempfile.mkdtemp(prefix="priod-gpu-restart-"), "priod.sock")
    conf = "expandable_segments:True" if allocator == "expandable_segments" else "backend:native"
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf, "PYTHONPATH": str(ROOT)}
    with ExitStack() as stack:
        first = stack.enter_context(daemon_process(ENV, backend="cuda", socket_path=path, start_timeout=120))
        child = subprocess.Popen(
            [sys.executable, "-c", _TENSOR_CLIENT, path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            assert child.stdout is not None and child.stdin is not None
            line = child.stdout.readline()
            assert line.strip() == "ready", line + child.communicate(timeout=60)[1]
            first.stop(signal.SIGKILL)
            stack.enter_context(daemon_process(ENV, backend="cuda", socket_path=path, start_timeout=120))
            out, err = child.communicate("go\n", timeout=120)
        finally:
            if child.poll() is None:
                child.kill()
        assert child.returncode == 0 and out.splitlines()[-1:] == ["ok"], out + err
