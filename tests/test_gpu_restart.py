"""A daemon restart on a real GPU (marker ``gpu``): device regions the daemon allocated outlive it.

The cuda engine allocates with ``cuMemCreate`` and hands the client the allocation's POSIX fd;
the client keeps it and registers it with the next daemon. A region opened in the client
(`Region.cuda`, the client's own mapping) and one never opened here (only the fd holds it)
both keep their bytes through a SIGKILL of the daemon.
"""

from __future__ import annotations

import os
import signal
import tempfile
from contextlib import ExitStack

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
