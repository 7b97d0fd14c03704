"""The torch face on a real GPU (marker ``gpu``; skipped without a GPU or torch): tensors of
PyTorch's caching allocator registered at their offset inside a segment, bf16 and fp8 through
byte views, torch views of daemon allocations, the error for memory CUDA IPC cannot share
(expandable segments, cudaMallocAsync pools), and examples/kv_offload.py on the cuda engine."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import priod
from priod.testing import DaemonProcess, daemon_process

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def torch() -> Any:
    return pytest.importorskip("torch")


@pytest.fixture(scope="module")
def gpu_daemon() -> Iterator[DaemonProcess]:
    """A daemon on the cuda engine."""
    with daemon_process({"PRIOD_LOG__LEVEL": '"warning"'}, backend="cuda", start_timeout=120) as d:
        yield d


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "uint8"])
def test_caching_allocator_tensor_inside_a_segment(gpu_daemon: DaemonProcess, torch: Any, dtype: str) -> None:
    """A tensor PyTorch's caching allocator carved out of a segment after another one registers by
    the segment's handle and its offset; copies land at exactly its bytes (the neighbours in the
    segment keep theirs), bf16 and fp8 included, also into a slice named by copy_tensor."""
    from priod.cuda_ipc import export_device_buffer

    dt = getattr(torch, dtype)
    # both under 1 MiB: PyTorch's small pool puts them in one 2 MiB cudaMalloc segment, t after pad
    pad = torch.full((4096,), 7, dtype=torch.uint8, device="cuda")
    t = torch.zeros(256 << 10, dtype=torch.uint8, device="cuda").view(dt)
    after = torch.full((4096,), 9, dtype=torch.uint8, device="cuda")
    buf = export_device_buffer(t)
    assert buf.offset > 0, "the tensor is at its segment's base: this test would not check the offset"
    assert buf.pointer == t.data_ptr() and buf.nbytes == 256 << 10
    rng = np.random.default_rng(5)
    with priod.SyncClient(gpu_daemon.socket_path) as c:
        region = c.register_device(t)
        assert region.nbytes == 256 << 10
        host = c.alloc_host(region.nbytes)
        assert host.array is not None
        for priority in ("bulk", "urgent"):
            host.array[:] = rng.integers(0, 256, host.nbytes, dtype=np.uint8)
            torch.cuda.synchronize()
            c.copy(region, host, priority=priority)
            assert np.array_equal(t.view(torch.uint8).cpu().numpy(), host.array), priority
        assert bool((pad == 7).all()) and bool((after == 9).all())
        # a slice of the registered tensor, named by copy_tensor: only its bytes change
        t.view(torch.uint8).zero_()
        torch.cuda.synchronize()
        hv = host.torch(dt)
        n = t.numel()
        c.copy_tensor(t[n // 4 : n // 2], hv[: n // 4], priority="urgent")
        got = t.view(torch.uint8).cpu().numpy()
        q = t.element_size() * (n // 4)
        assert np.array_equal(got[q : 2 * q], host.array[:q])
        assert not got[:q].any() and not got[2 * q :].any()
        c.free(region)


def test_registered_tensor_is_held_until_free(gpu_daemon: DaemonProcess, torch: Any) -> None:
    """The region keeps the tensor: dropping the caller's name does not let the caching
    allocator hand its memory to the next tensor while the daemon may still write it."""
    with priod.SyncClient(gpu_daemon.socket_path) as c:
        t = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
        pointer = t.data_ptr()
        region = c.register_device(t)
        del t
        nxt = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
        assert nxt.data_ptr() != pointer
        c.free(region)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_device_region_views_and_tensor_copies(gpu_daemon: DaemonProcess, torch: Any, dtype: str) -> None:
    """Region.torch() of a daemon allocation is a CUDA tensor on its memory (DLPack gives the same
    memory); copy_tensor moves rows host -> device and device -> host, bytes checked."""
    dt = getattr(torch, dtype)
    with priod.SyncClient(gpu_daemon.socket_path) as c:
        d, h = c.alloc_device(1 << 20), c.alloc_host(1 << 20)
        assert h.array is not None
        dv, hv = d.torch(dt, (64, -1)), h.torch(dt, (64, -1))
        assert dv.is_cuda and dv.dtype == dt
        assert torch.from_dlpack(d).data_ptr() == dv.data_ptr()
        h.array[:] = np.random.default_rng(6).integers(0, 256, h.nbytes, dtype=np.uint8)
        c.copy_tensor(dv[5:9], hv[1:5], priority="urgent")
        assert np.array_equal(dv[5:9].view(torch.uint8).cpu().numpy().reshape(-1), hv[1:5].view(torch.uint8).numpy().reshape(-1))
        dv[20].view(torch.uint8).fill_(0xA5)
        torch.cuda.synchronize()
        c.copy_tensor(hv[0], dv[20], priority="bulk")
        assert bool((hv[0].view(torch.uint8) == 0xA5).all()) and not bool((hv[1].view(torch.uint8) == 0xA5).all())
        c.free(d)


_REGISTER_UNDER = """
import sys, torch, priod
with priod.SyncClient(sys.argv[1]) as c:
    t = torch.empty(1 << 20, dtype=torch.float32, device="cuda")
    try:
        c.register_device(t)
    except priod.EngineError as exc:
        print(exc)
        sys.exit(0)
print("registered")
sys.exit(3)
"""


@pytest.mark.parametrize(
    ("conf", "hint"),
    [("expandable_segments:True", "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False"), ("backend:cudaMallocAsync", "PYTORCH_CUDA_ALLOC_CONF=backend:native")],
    ids=["expandable_segments", "cudaMallocAsync"],
)
def test_unshareable_allocator_memory_names_the_setting(gpu_daemon: DaemonProcess, torch: Any, conf: str, hint: str) -> None:
    """With PyTorch's allocator set to memory CUDA IPC cannot share, register_device fails
    before any request, with an error that names the setting to change and the alternative."""
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", _REGISTER_UNDER, gpu_daemon.socket_path], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    message = out.stdout.strip()
    assert message.startswith("this buffer's memory cannot be registered with priod: "), message
    assert hint in message and "alloc_device and view it with Region.torch()" in message, message


@pytest.mark.parametrize("register", [False, True], ids=["alloc_device", "register_device"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_kv_offload_example_on_cuda(gpu_daemon: DaemonProcess, torch: Any, dtype: str, register: bool) -> None:
    """examples/kv_offload.py on the cuda engine: the cache a daemon allocation viewed by
    Region.torch(), or PyTorch's own tensor registered; output bitwise the same after reload."""
    cmd = [sys.executable, str(ROOT / "examples" / "kv_offload.py"), "--socket", gpu_daemon.socket_path, "--dtype", dtype]
    out = subprocess.run([*cmd, *(["--register"] if register else [])], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines()[0].startswith(f"cuda engine, {dtype}: KV cache (2, 128, 16, 8, 64) on cuda:0"), out.stdout
    assert out.stdout.splitlines()[-1] == "attention output after offload and reload equals the output before: ok"
