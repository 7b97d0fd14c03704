"""The torch face on a real GPU (marker ``gpu``; skipped without a GPU or torch): tensors of
PyTorch's caching allocator registered at their offset inside a segment, bf16 and fp8 through
byte views, torch views of daemon allocations, expandable segments (cuMemCreate memory, passed by
fd), the error for memory nothing can share (cudaMallocAsync from the device's default pool),
and examples/kv_offload.py on the cuda engine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import priod
from priod.testing import DaemonProcess

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def torch() -> Any:
    return pytest.importorskip("torch")


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "uint8"])
def test_caching_allocator_tensor_inside_a_segment(gpu_daemon: DaemonProcess, torch: Any, dtype: str) -> None:
    """A tensor PyTorch's caching allocator carved out of a segment after another one registers by
    the segment's handle and its offset; copies land at exactly its bytes (the neighbours in the
    segment keep theirs), bf16 and fp8 included, also into a slice named by copy_tensor."""
    from priod.client.cuda_ipc import export_device_buffer

    dt = getattr(torch, dtype)
    # both under 1 MiB: PyTorch's small pool puts them in one 2 MiB cudaMalloc segment, t after pad
    pad = torch.full((4096,), 7, dtype=torch.uint8, device="cuda")
    t = torch.zeros(256 << 10, dtype=torch.uint8, device="cuda").view(dt)
    after = torch.full((4096,), 9, dtype=torch.uint8, device="cuda")
    buf = export_device_buffer(t)
    assert buf.offset > 0, "the tensor is at its segment's base: this test would not check the offset"
    assert buf.pointer == t.data_ptr() and buf.nbytes == 256 << 10
    rng = np.random.default_rng(5)
    with priod.SyncClient(gpu_daemon.socket_path, copy_path="daemon") as c:
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
    with priod.SyncClient(gpu_daemon.socket_path, copy_path="daemon") as c:
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
    with priod.SyncClient(gpu_daemon.socket_path, copy_path="daemon") as c:
        d, h = c.alloc_device(1 << 20), c.alloc_host(1 << 20)
        assert h.array is not None
        dv, hv = d.torch(dt, (64, -1)), h.torch(dt, (64, -1))
        assert dv.is_cuda and dv.dtype == dt
        assert torch.from_dlpack(d).data_ptr() == dv.data_ptr()
        h.array[:] = np.random.default_rng(6).integers(0, 256, h.nbytes, dtype=np.uint8)
        c.copy_tensor(dv[5:9], hv[1:5], priority="urgent")
        assert np.array_equal(
            dv[5:9].view(torch.uint8).cpu().numpy().reshape(-1), hv[1:5].view(torch.uint8).numpy().reshape(-1)
        )
        dv[20].view(torch.uint8).fill_(0xA5)
        torch.cuda.synchronize()
        c.copy_tensor(hv[0], dv[20], priority="bulk")
        assert bool((hv[0].view(torch.uint8) == 0xA5).all()) and not bool((hv[1].view(torch.uint8) == 0xA5).all())
        c.free(d)


_REGISTER_UNDER = """
import sys, torch, priod
with priod.SyncClient(sys.argv[1], copy_path="daemon") as c:
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
    ("conf", "hints"),
    [
        (
            "backend:cudaMallocAsync",
            (
                "cuMemPoolExportToShareableHandle refused its pool",
                "cudaMemPoolCreate with handleTypes = cudaMemHandleTypePosixFileDescriptor",
                "PYTORCH_CUDA_ALLOC_CONF=backend:native",
            ),
        )
    ],
    ids=["cudaMallocAsync"],
)
def test_unshareable_allocator_memory_names_the_setting(
    gpu_daemon: DaemonProcess, torch: Any, conf: str, hints: tuple[str, ...]
) -> None:
    """With PyTorch's allocator set to memory priod cannot share (backend:cudaMallocAsync takes
    it from the device's default pool, which has no POSIX fd handle type to export),
    register_device fails before any request, with an error that names the settings to change
    and the alternative. In a subprocess: the setting must be made before torch starts CUDA."""
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", _REGISTER_UNDER, gpu_daemon.socket_path],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    message = out.stdout.strip()
    assert message.startswith("this buffer's memory cannot be registered with priod: "), message
    assert all(hint in message for hint in hints) and "alloc_device and view it with Region.torch()" in message, message


_EXPANDABLE = """
import os, sys
import numpy as np, torch, priod
from priod.client.cuda_ipc import export_device_buffer

def described(t):
    buf = export_device_buffer(t)
    os.close(buf.fd)
    assert buf.kind == "vmm_fd" and buf.handle == b"" and buf.nbytes == t.numel() * t.element_size(), buf
    return buf

rng = np.random.default_rng(11)
with priod.SyncClient(sys.argv[1], copy_path="daemon") as c:
    # small pool: one expandable segment of 2 MiB pages; t (512 KiB bf16) between two neighbours
    pad = torch.full((4096,), 7, dtype=torch.uint8, device="cuda")
    t = torch.zeros(256 << 10, dtype=torch.bfloat16, device="cuda")
    after = torch.full((4096,), 9, dtype=torch.uint8, device="cuda")
    try:
        buf = described(t)
    except priod.EngineError:
        # Skipped only where PyTorch made its pages with fabric handles only (IMEX systems)
        from cuda.bindings import driver as drv
        err, h = drv.cuMemRetainAllocationHandle(t.data_ptr())
        assert err == drv.CUresult.CUDA_SUCCESS, err
        err, prop = drv.cuMemGetAllocationPropertiesFromHandle(h)
        drv.cuMemRelease(h)
        if err != drv.CUresult.CUDA_SUCCESS or int(prop.requestedHandleTypes) != int(drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC):
            raise
        print("fabric")
        sys.exit(0)
    print(f"small: offset {buf.offset} in an allocation of {buf.size}")
    region = c.register_device(t)
    host = c.alloc_host(region.nbytes)
    assert region.nbytes == 512 << 10 and host.array is not None
    for priority in ("urgent", "bulk"):
        host.array[:] = rng.integers(0, 256, host.nbytes, dtype=np.uint8)
        torch.cuda.synchronize()
        c.copy(region, host, priority=priority)  # into the tensor
        assert np.array_equal(t.view(torch.uint8).cpu().numpy(), host.array), ("in", priority)
        want = rng.integers(0, 256, host.nbytes, dtype=np.uint8)
        t.view(torch.uint8).copy_(torch.from_numpy(want).cuda())
        torch.cuda.synchronize()
        c.copy(host, region, priority=priority)  # out of it
        assert np.array_equal(host.array, want), ("out", priority)
    assert bool((pad == 7).all()) and bool((after == 9).all()), "a neighbour in the page changed"
    c.free(region)
    # large pool: 20 MiB pages; an 8 MiB tensor lies in the first, a 30 MiB one spans two
    mid = torch.zeros(8 << 20, dtype=torch.uint8, device="cuda")
    buf = described(mid)
    print(f"large: offset {buf.offset} in an allocation of {buf.size}")
    region, host = c.register_device(mid), c.alloc_host(8 << 20)
    host.array[:] = rng.integers(0, 256, host.nbytes, dtype=np.uint8)
    c.copy(region, host, priority="bulk")
    assert np.array_equal(mid.cpu().numpy(), host.array), "large page"
    big = torch.zeros(30 << 20, dtype=torch.uint8, device="cuda")
    try:
        c.register_device(big)
    except priod.EngineError as exc:
        assert "spans several cuMemCreate allocations" in str(exc), exc
    else:
        raise AssertionError("a tensor over two pages registered")
print("ok")
"""


def test_expandable_segments_tensor_registers_by_fd(gpu_daemon: DaemonProcess, torch: Any) -> None:
    """Under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (cuMemCreate pages), a bf16 tensor
    registers by its page's POSIX fd at its offset in the page; copies into it and out of it,
    urgent and bulk, move exactly its bytes (checked by torch after a synchronize), its
    neighbours keep theirs; a tensor in a 20 MiB page registers too, one over two pages is
    refused with the reason."""
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", _EXPANDABLE, gpu_daemon.socket_path],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    if out.returncode == 0 and out.stdout.splitlines()[-1:] == ["fabric"]:
        pytest.skip(
            f"PyTorch's expandable segments use fabric handles on this machine, which priod does not take: {out.stdout}"
        )
    assert out.returncode == 0 and out.stdout.splitlines()[-1:] == ["ok"], out.stdout + out.stderr


@pytest.mark.parametrize(
    "flags",
    [[], ["--register"], ["--direct"], ["--register", "--direct"]],
    ids=["alloc_device", "register_device", "direct", "register_direct"],
)
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_kv_offload_example_on_cuda(gpu_daemon: DaemonProcess, torch: Any, dtype: str, flags: list[str]) -> None:
    """examples/kv_offload.py on the cuda engine: the cache a daemon allocation viewed by
    Region.torch(), or PyTorch's own tensor registered; the urgent reload through the daemon,
    or this process's own (--direct, the daemon's host pool pinned here); output bitwise the
    same after reload."""
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "kv_offload.py"),
        "--socket",
        gpu_daemon.socket_path,
        "--dtype",
        dtype,
        *flags,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"cuda engine, {dtype}: KV cache (2, 128, 16, 8, 64) on cuda:0"), out.stdout
    assert lines[2].startswith(
        "reload A: 64 segments urgent, direct," if "--direct" in flags else "reload A: 64 segments urgent in"
    ), out.stdout
    assert lines[-1] == "attention output after offload and reload equals the output before: ok"
