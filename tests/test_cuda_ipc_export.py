"""The client's CUDA IPC export (priod.client.cuda_ipc) against the fake CUDA (`priod.testing.FakeCuda`), so it runs without a GPU:
a caching allocator's piece of a segment is named by the segment's handle and its offset,
cuMemCreate memory (PyTorch's expandable segments) by a POSIX fd of its allocation, a shareable
stream-ordered pool's memory by the pool's POSIX fd and the allocation's export data, and memory
none can share is refused with the allocator setting to change. Also the daemon's side of
cuMemCreate and pool memory (priod.daemon.engines.cuda.memory): import, map, access, the counted pool
imports, and the undo on each error."""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

import priod.client.cuda_ipc as cuda_ipc
from priod.client.cuda_ipc import POOL_HINT, VMM_HINT, _unshareable, export_device_buffer
from priod.daemon.engines.cuda import memory
from priod.errors import CudaError, EngineError, InvalidRequest
from priod.testing import DriverStatus, FakeCuda, FakeHandle, RuntimeStatus

POINTER_ATTRIBUTES = SimpleNamespace(
    CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL="ordinal",
    CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE="ipc",
    CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE="pool",
)
"""The driver's CUpointer_attribute, as far as cuda_ipc asks, named by what each answers."""


@pytest.mark.parametrize(
    ("capable", "pool", "hint"),
    [(True, None, None), (False, 0xABC, POOL_HINT), (False, 0, VMM_HINT), (False, None, VMM_HINT)],
    ids=["cudaMalloc", "cudaMallocAsync-pool", "cuMemCreate", "cuMemCreate-no-pool-attribute"],
)
def test_unshareable_memory_names_the_setting_to_change(capable: bool, pool: int | None, hint: str | None) -> None:
    """Memory CUDA IPC cannot share is told apart before the handle call: pools point at
    PyTorch's allocator backend, cuMemCreate memory at expandable_segments:False."""
    with FakeCuda() as cuda:
        drv = cuda.driver

        def attribute(attr: str, pointer: int) -> tuple[Any, ...]:
            """cuPointerGetAttribute as a driver answers for one kind of memory (no pool: not a pool allocation)."""
            if attr == "ipc":
                return drv.ok(capable)
            return (DriverStatus.CUDA_ERROR_INVALID_VALUE, None) if pool is None else drv.ok(pool)

        drv.set(CUpointer_attribute=POINTER_ATTRIBUTES)
        drv.script(cuPointerGetAttribute=attribute)
        assert _unshareable(drv, 0x1000) == hint
    assert (
        "expandable_segments:False" in VMM_HINT
        and "backend:cudaMallocAsync" in POOL_HINT
        and "Region.torch()" in VMM_HINT
    )


class _Segment:
    """A caching allocator's segment as the fake CUDA (`cuda`, a `FakeCuda`) shows it: ``base``
    .. ``base + size``, IPC-capable or not, and a handle call that may fail; `_vmm` makes it
    cuMemCreate pages, `_pool` a stream-ordered pool's allocation."""

    def __init__(self, base: int, size: int, capable: bool, handle_ok: bool = True) -> None:
        self.base, self.size, self.capable, self.handle_ok = base, size, capable, handle_ok
        self.handle_of: int | None = None
        self.pages: dict[tuple[int, int], int] = {}
        """(start, size) -> handle of each cuMemMap-ed page."""
        self.handle_types = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self.range_is_segment = False
        """cuMemGetAddressRange answers the whole segment (all pages) instead of the page."""
        self.retains = self.releases = 0
        self.exported: list[int] = []
        self.fds: list[int] = []
        self.pool = 0
        """The buffer's pool (set up by `_pool`); 0: not pool memory."""
        self.pool_shareable = self.pointer_ok = True
        self.cuda = FakeCuda()
        rt, self.drv = self.cuda.runtime, self.cuda.driver
        rt.script(cudaIpcGetMemHandle=self.cudaIpcGetMemHandle)
        self.drv.set(
            CUpointer_attribute=POINTER_ATTRIBUTES,
            CUmemAllocationHandleType=SimpleNamespace(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR=1),
            CUmemAllocationGranularity_flags=SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_MINIMUM=0),
        )
        self.drv.script(
            cuPointerGetAttribute=self.cuPointerGetAttribute,
            cuMemGetAddressRange=self.cuMemGetAddressRange,
            cuMemRetainAllocationHandle=self.cuMemRetainAllocationHandle,
            cuMemRelease=self.cuMemRelease,
            cuMemGetAllocationPropertiesFromHandle=self.cuMemGetAllocationPropertiesFromHandle,
            cuMemGetAllocationGranularity=self.drv.ok(2 << 20),
            cuMemExportToShareableHandle=self.cuMemExportToShareableHandle,
            cuMemPoolExportToShareableHandle=self.cuMemPoolExportToShareableHandle,
            cuMemPoolExportPointer=self.cuMemPoolExportPointer,
        )

    def cuPointerGetAttribute(self, attr: str, pointer: int) -> tuple[Any, ...]:
        assert self.base <= pointer < self.base + self.size
        return self.drv.ok({"ordinal": 0, "ipc": self.capable, "pool": self.pool}[attr])

    def cuMemGetAddressRange(self, pointer: int) -> tuple[Any, ...]:
        if not self.pages:
            return self.drv.ok(self.base, self.size)
        page = self._page(pointer)
        assert page is not None
        return self.drv.ok(self.base, self.size) if self.range_is_segment else self.drv.ok(*page)

    def cudaIpcGetMemHandle(self, base: int) -> tuple[Any, ...]:
        self.handle_of = base
        return (
            self.cuda.runtime.ok(FakeHandle(b"h" * 64))
            if self.handle_ok
            else (RuntimeStatus.cudaErrorInvalidValue, None)
        )

    # -- cuMemCreate memory (set up by `_vmm`), as expandable segments map it
    def _page(self, address: int) -> tuple[int, int] | None:
        return next((p for p in self.pages if p[0] <= address < p[0] + p[1]), None)

    def cuMemRetainAllocationHandle(self, address: int) -> tuple[Any, ...]:
        page = self._page(address)
        if page is None:
            return (DriverStatus.CUDA_ERROR_INVALID_VALUE, None)
        self.retains += 1
        return self.drv.ok(self.pages[page])

    def cuMemRelease(self, handle: int) -> tuple[Any, ...]:
        self.releases += 1
        return self.drv.ok()

    def cuMemGetAllocationPropertiesFromHandle(self, handle: int) -> tuple[Any, ...]:
        return self.drv.ok(SimpleNamespace(requestedHandleTypes=self.handle_types))

    def cuMemExportToShareableHandle(self, handle: int, kind: int, flags: int) -> tuple[Any, ...]:
        assert kind == 1 and flags == 0
        self.exported.append(handle)
        self.fds.append(os.open(os.devnull, os.O_RDONLY))
        return self.drv.ok(self.fds[-1])

    # -- a stream-ordered pool's allocation (set up by `_pool`): ``base`` .. ``base + size``
    def cuMemPoolExportToShareableHandle(self, pool: int, kind: int, flags: int) -> tuple[Any, ...]:
        assert pool == self.pool and kind == 1 and flags == 0
        if not self.pool_shareable:  # a pool made without handle types: a device's default pool
            return (DriverStatus.CUDA_ERROR_INVALID_VALUE, None)
        self.fds.append(os.open(os.devnull, os.O_RDONLY))
        return self.drv.ok(self.fds[-1])

    def cuMemPoolExportPointer(self, pointer: int) -> tuple[Any, ...]:
        self.exported.append(pointer)
        return self.drv.ok(FakeHandle(b"e" * 64)) if self.pointer_ok else (DriverStatus.CUDA_ERROR_INVALID_VALUE, None)


def _vmm(fake: _Segment, pages: list[int], range_is_segment: bool = False) -> None:
    """Make ``fake``'s segment cuMemCreate memory: pages of these sizes side by side from its
    base, handles 100, 101, ...; cuMemGetAddressRange answers a page (or the segment)."""
    fake.capable, fake.range_is_segment, fake.exported, fake.fds = False, range_is_segment, [], []
    fake.pages, start = {}, fake.base
    for i, size in enumerate(pages):
        fake.pages[(start, size)] = 100 + i
        start += size
    fake.size = start


def _pool(fake: _Segment, size: int = 2 << 20) -> None:
    """Make ``fake``'s segment an allocation of ``size`` bytes from a stream-ordered pool."""
    fake.capable, fake.pool, fake.size, fake.exported, fake.fds = False, 0xABC, size, [], []


class _Cai:
    def __init__(self, pointer: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (pointer, False),
            "strides": None,
            "version": 3,
        }


@pytest.fixture
def fake_cuda() -> Iterator[_Segment]:
    """cuda_ipc's CUDA calls answered by a `_Segment`'s fake CUDA, one GPU visible (set its
    fields in the test)."""
    fake = _Segment(0x7F0000000000, 2 << 20, True)
    with fake.cuda:
        yield fake


def test_a_buffer_inside_a_segment_exports_the_segment_handle_and_its_offset(fake_cuda: _Segment) -> None:
    """A caching allocator's piece of a segment is described by the segment base's handle and
    the piece's offset in it (what the daemon opens once per segment)."""
    buf = export_device_buffer(_Cai(fake_cuda.base + 12288, 4096))
    assert fake_cuda.handle_of == fake_cuda.base
    assert buf[:5] == (b"h" * 64, 12288, 4096, 0, fake_cuda.base + 12288) and buf.kind == "cuda_ipc" and buf.fd == -1


def test_memory_ipc_cannot_share_fails_before_the_handle_call(fake_cuda: _Segment) -> None:
    """Memory the driver calls not IPC-capable is refused with the setting to change, without
    asking for a handle; a handle call that fails anyway names both PyTorch settings."""
    fake_cuda.capable = False  # and not cuMemMap-ed either (no pages): the driver does not say why
    with pytest.raises(
        EngineError,
        match=r"^this buffer's memory cannot be registered with priod: it was mapped with cuMemCreate .*expandable_segments:False",
    ):
        export_device_buffer(_Cai(fake_cuda.base, 4096))
    assert fake_cuda.handle_of is None
    fake_cuda.capable, fake_cuda.handle_ok = True, False
    with pytest.raises(
        EngineError,
        match=r"^this buffer's memory cannot be registered with priod: cudaIpcGetMemHandle refused it .*expandable_segments:False.*backend:native",
    ):
        export_device_buffer(_Cai(fake_cuda.base, 4096))


MiB = 1 << 20


@pytest.mark.parametrize("range_is_segment", [False, True], ids=["range-is-the-page", "range-is-the-segment"])
def test_a_buffer_in_cumemcreate_memory_exports_its_allocation_fd(fake_cuda: _Segment, range_is_segment: bool) -> None:
    """A buffer in an expandable segment's second 20 MiB page is named by that page's POSIX fd,
    its offset in the page and the page's size, whether the driver's address range is the page
    or the whole segment (then the page is found by its handle, 2 MiB at a time); every
    retained handle is released."""
    _vmm(fake_cuda, [20 * MiB, 20 * MiB, 20 * MiB], range_is_segment)
    pointer = fake_cuda.base + 20 * MiB + 3 * MiB
    buf = export_device_buffer(_Cai(pointer, 4 * MiB))
    try:
        assert (buf.kind, buf.handle, buf.offset, buf.nbytes, buf.size, buf.pointer) == (
            "vmm_fd",
            b"",
            3 * MiB,
            4 * MiB,
            20 * MiB,
            pointer,
        )
        assert fake_cuda.exported == [101] and os.fstat(buf.fd)
    finally:
        os.close(buf.fd)
    assert fake_cuda.retains == fake_cuda.releases > 0


def test_cumemcreate_memory_that_cannot_be_exported_is_refused(fake_cuda: _Segment) -> None:
    """A buffer over two pages (two allocations) is refused naming the page sizes; an allocation
    made without a POSIX fd handle type (fabric only) names the setting; no fd is made for
    either and every retained handle is released."""
    _vmm(fake_cuda, [2 * MiB, 2 * MiB])
    with pytest.raises(EngineError, match=r"spans several cuMemCreate allocations .*expandable_segments:False"):
        export_device_buffer(_Cai(fake_cuda.base + MiB, 2 * MiB))
    fake_cuda.handle_types = 8  # CU_MEM_HANDLE_TYPE_FABRIC
    with pytest.raises(EngineError, match=r"without a POSIX file descriptor handle type .*expandable_segments:False"):
        export_device_buffer(_Cai(fake_cuda.base, 4096))
    assert fake_cuda.exported == [] and fake_cuda.retains == fake_cuda.releases > 0


@pytest.mark.parametrize(
    ("kind", "handle", "memory"), [("vmm_fd", b"", "cuMemCreate"), ("pool_fd", b"e" * 64, "stream-ordered pool")]
)
def test_register_request_of_fd_memory_carries_the_fd(
    fake_cuda: _Segment, monkeypatch: pytest.MonkeyPatch, kind: str, handle: bytes, memory: str
) -> None:
    """register_device of cuMemCreate memory: kind vmm_fd, the allocation's size, and its fd to
    send beside the frame; of a pool's memory: kind pool_fd, the allocation's export data as its
    handle and size, and the pool's fd. export_cuda_array (IPC handles only) refuses either and
    closes the fd."""
    from priod.client.base import cuda_register_request

    monkeypatch.setattr(cuda_ipc, "gpu_uuid", lambda device: "GPU-00000000-0000-0000-0000-000000000000")
    if kind == "vmm_fd":
        _vmm(fake_cuda, [2 * MiB])
    else:
        _pool(fake_cuda, 2 * MiB)
    req, fds = cuda_register_request(_Cai(fake_cuda.base + 4096, 8192))
    try:
        assert (req.kind, req.size, req.offset, req.nbytes, req.handle, len(fds)) == (
            kind,
            2 * MiB,
            4096,
            8192,
            handle,
            1,
        )
        req.check()
    finally:
        os.close(fds[0])
    with pytest.raises(
        EngineError,
        match=rf"^this buffer is {memory} memory, which has no CUDA IPC handle: use export_device_buffer \(its kind '{kind}'",
    ):
        cuda_ipc.export_cuda_array(_Cai(fake_cuda.base, 4096))
    with pytest.raises(OSError):
        os.fstat(fake_cuda.fds[-1])  # the fd it was given is closed


def test_a_buffer_in_a_shareable_pool_exports_the_pool_fd_and_its_allocation(fake_cuda: _Segment) -> None:
    """A buffer inside a pool allocation is named by the pool's POSIX fd, the export data of the
    allocation's base (cuMemGetAddressRange's, not the buffer's address) and its offset there."""
    _pool(fake_cuda, 3 * MiB)
    pointer = fake_cuda.base + 12288
    buf = export_device_buffer(_Cai(pointer, 4096))
    try:
        assert (buf.kind, buf.handle, buf.offset, buf.nbytes, buf.size, buf.pointer) == (
            "pool_fd",
            b"e" * 64,
            12288,
            4096,
            3 * MiB,
            pointer,
        )
        assert fake_cuda.exported == [fake_cuda.base] and os.fstat(buf.fd)
    finally:
        os.close(buf.fd)


def test_pool_export_data_travels_as_its_64_bytes() -> None:
    """The export data goes as the 64 bytes of cuda-python's CUmemPoolPtrExportData, read and
    written through its address (its fields differ between releases); no GPU needed."""
    pytest.importorskip("cuda.bindings")
    from priod.common.cuda.driver import handle_to_bytes, pool_export_from_bytes

    data = bytes(range(64))
    assert handle_to_bytes(pool_export_from_bytes(data)) == data
    with pytest.raises(InvalidRequest, match="is 64 bytes, this one is 63"):
        pool_export_from_bytes(data[:63])


def test_pool_memory_that_cannot_be_exported_is_refused(fake_cuda: _Segment) -> None:
    """A pool made without a POSIX fd handle type (a device's default pool, which PyTorch's
    backend:cudaMallocAsync uses) is refused naming how to make one that shares and the other
    ways out; a buffer past its allocation's end, and export data the driver refuses, too; the
    pool's fd is closed on every refusal."""
    _pool(fake_cuda)
    fake_cuda.pool_shareable = False
    with pytest.raises(
        EngineError,
        match=r"^this buffer's memory cannot be registered with priod: cuMemPoolExportToShareableHandle refused its pool \(CUDA_ERROR_INVALID_VALUE\); "
        r"it comes from a stream-ordered pool .*backend:cudaMallocAsync.*cudaMemPoolCreate with handleTypes = cudaMemHandleTypePosixFileDescriptor.*"
        r"backend:native.*alloc_device and view it with Region.torch\(\)$",
    ):
        export_device_buffer(_Cai(fake_cuda.base, 4096))
    assert fake_cuda.fds == [] and fake_cuda.exported == []
    fake_cuda.pool_shareable = True
    with pytest.raises(
        EngineError,
        match=r"runs past the end of its pool allocation .*register the part within each allocation separately",
    ):
        export_device_buffer(_Cai(fake_cuda.base + fake_cuda.size - 4096, 8192))
    fake_cuda.pointer_ok = False
    with pytest.raises(
        EngineError, match=r"cuMemPoolExportPointer refused its allocation .*cudaMemHandleTypePosixFileDescriptor"
    ):
        export_device_buffer(_Cai(fake_cuda.base, 4096))
    assert len(fake_cuda.fds) == 2
    for fd in fake_cuda.fds:
        with pytest.raises(OSError):
            os.fstat(fd)


# -- the daemon's side: priod.daemon.engines.cuda.memory ---------------------------------------------


class _FakeVmmDriver:
    """The driver calls of a cuMemCreate import, logged in order by a short name; ``fail`` names
    one that errs. `attach` makes them the fake CUDA's answers."""

    OK, BAD = DriverStatus.CUDA_SUCCESS, DriverStatus.CUDA_ERROR_INVALID_VALUE

    def __init__(self, fail: str = "", granularity: int = 2 * MiB) -> None:
        self.fail, self.granularity = fail, granularity
        self.calls: list[tuple[Any, ...]] = []
        self.access: list[Any] = []

    def attach(self, cuda: FakeCuda) -> None:
        cuda.driver.set(
            CUmemAllocationHandleType=SimpleNamespace(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR="posix_fd"),
            CUmemAllocationGranularity_flags=SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_MINIMUM="minimum"),
            CUmemLocationType=SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE="device"),
            CUmemAccess_flags=SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE="rw"),
            CUmemAccessDesc=lambda: SimpleNamespace(location=SimpleNamespace(type=None, id=None), flags=None),
        )
        cuda.driver.script(
            cuMemImportFromShareableHandle=lambda fd, kind: self._call("import", fd, kind, value=77),
            cuMemGetAllocationPropertiesFromHandle=lambda handle: self._call("props", handle, value="prop"),
            cuMemGetAllocationGranularity=lambda prop, option: self._call(
                "granularity", prop, option, value=self.granularity
            ),
            cuMemAddressReserve=lambda size, alignment, addr, flags: self._call(
                "reserve", size, alignment, addr, flags, value=0x7000_0000_0000
            ),
            cuMemMap=lambda ptr, size, offset, handle, flags: self._call("map", ptr, size, offset, handle, flags),
            cuMemSetAccess=self.cuMemSetAccess,
            cuMemUnmap=lambda ptr, size: self._call("unmap", ptr, size),
            cuMemAddressFree=lambda ptr, size: self._call("free", ptr, size),
            cuMemRelease=lambda handle: self._call("release", handle),
        )

    def _call(self, name: str, *args: Any, value: Any = None) -> tuple[Any, ...]:
        self.calls.append((name, *args))
        if name == self.fail:
            return (self.BAD,) if value is None else (self.BAD, None)
        return (self.OK,) if value is None else (self.OK, value)

    def cuMemSetAccess(self, ptr: int, size: int, desc: list[Any], count: int) -> tuple[Any, ...]:
        self.access = [(d.location.type, d.location.id, d.flags) for d in desc]
        return self._call("access", ptr, size, count)


@pytest.fixture
def daemon_driver() -> Iterator[Any]:
    """memory.py's driver calls answered through the fake CUDA by a `_FakeVmmDriver` (replace it
    with ``.use(...)``)."""
    cuda = FakeCuda()

    def use(drv: _FakeVmmDriver) -> _FakeVmmDriver:
        drv.attach(cuda)
        holder.drv = drv
        return drv

    holder = SimpleNamespace(use=use)
    use(_FakeVmmDriver())
    with cuda:
        yield holder


BASE = 0x7000_0000_0000


def test_daemon_maps_an_imported_allocation_whole_and_unmaps_it(daemon_driver: Any) -> None:
    """The fd is imported, the whole allocation mapped at a reserved range aligned to its
    granularity, read/write for the region's GPU and its peers; the region starts at its offset. Release
    unmaps, frees the range and releases the handle, in that order. The fd is not closed here."""
    drv = daemon_driver.drv
    used: list[int] = []
    regions = memory.Regions(used.append)
    fd = os.open(os.devnull, os.O_RDONLY)
    try:
        mem = regions.import_device_fd(fd, 20 * MiB, 3 * MiB, 4 * MiB, 1, [0])  # gpu0 reaches gpu1 by a peer lane
        os.fstat(fd)  # still open: the session closes it
    finally:
        os.close(fd)
    assert used == [1] and (mem.pointer, mem.nbytes, mem.device, mem.export) == (BASE + 3 * MiB, 4 * MiB, 1, None)
    assert drv.calls == [
        ("import", fd, "posix_fd"),
        ("props", 77),
        ("granularity", "prop", "minimum"),
        ("reserve", 20 * MiB, 2 * MiB, 0, 0),
        ("map", BASE, 20 * MiB, 0, 77, 0),
        ("access", BASE, 20 * MiB, 2),
    ]
    assert drv.access == [("device", 1, "rw"), ("device", 0, "rw")]
    drv.calls.clear()
    regions.release_device(mem)
    regions.release_device(mem)  # idempotent
    assert drv.calls == [("unmap", BASE, 20 * MiB), ("free", BASE, 20 * MiB), ("release", 77)]
    assert regions.device_mems == {}


@pytest.mark.parametrize(
    ("fail", "granularity", "error", "undo"),
    [
        ("import", 2 * MiB, InvalidRequest, []),
        ("", 3 * MiB, InvalidRequest, [("release", 77)]),
        ("map", 2 * MiB, InvalidRequest, [("free", BASE, 20 * MiB), ("release", 77)]),
        ("access", 2 * MiB, CudaError, [("unmap", BASE, 20 * MiB), ("free", BASE, 20 * MiB), ("release", 77)]),
    ],
    ids=["not-a-cuda-fd", "size-off-granularity", "size-too-large", "access-refused"],
)
def test_daemon_import_errors_undo_what_was_done(
    daemon_driver: Any, fail: str, granularity: int, error: type[Exception], undo: list[tuple[Any, ...]]
) -> None:
    """A fd that does not import, or a size that does not map, is the client's mistake
    (InvalidRequest: bad_request, naming what to send); whatever fails, what was done is undone
    in reverse and nothing is left registered."""
    drv = daemon_driver.use(_FakeVmmDriver(fail, granularity))
    regions = memory.Regions(lambda device: None)
    with pytest.raises(error) as info:
        regions.import_device_fd(5, 20 * MiB, 0, 4096, 0)
    if error is InvalidRequest:
        assert "cuMemExportToShareableHandle" in str(info.value)
    done = [c[0] for c in drv.calls]
    assert drv.calls[len(done) - len(undo) :] == undo if undo else done == ["import"]
    assert regions.device_mems == {}


# -- the daemon's side of pool memory: PoolTable ------------------------------------------


class _FakePoolDriver(_FakeVmmDriver):
    """The driver calls of pool imports, logged: as the driver does, every import of the pool
    gives one handle and counts, each cuMemPoolDestroy uncounts one (below zero is a crash), and
    its two allocations are named by their export data."""

    POOL = 900
    ALLOCATIONS: ClassVar[dict[bytes, tuple[int, int]]] = {
        b"a" * 64: (0x7100_0000_0000, 4 * MiB),
        b"b" * 64: (0x7200_0000_0000, 2 * MiB),
    }

    def __init__(self, fail: str = "") -> None:
        super().__init__(fail)
        self.imports = 0
        """Imports of the pool not destroyed yet."""

    def attach(self, cuda: FakeCuda) -> None:
        super().attach(cuda)
        cuda.driver.script(
            cuMemPoolImportFromShareableHandle=self.cuMemPoolImportFromShareableHandle,
            cuMemPoolSetAccess=self.cuMemPoolSetAccess,
            cuMemPoolImportPointer=self.cuMemPoolImportPointer,
            cuMemGetAddressRange=self.cuMemGetAddressRange,
            cuMemFree=lambda pointer: self._call("free_pointer", pointer),
            cuMemPoolDestroy=self.cuMemPoolDestroy,
        )

    def cuMemPoolImportFromShareableHandle(self, fd: int, kind: str, flags: int) -> tuple[Any, ...]:
        result = self._call("import_pool", fd, kind, flags, value=self.POOL)
        self.imports += result[0] is self.OK
        return result

    def cuMemPoolSetAccess(self, pool: int, desc: list[Any], count: int) -> tuple[Any, ...]:
        self.access = [(d.location.type, d.location.id, d.flags) for d in desc]
        return self._call("pool_access", pool, count)

    def cuMemPoolImportPointer(self, pool: int, export: FakeHandle) -> tuple[Any, ...]:
        data = bytes(export)  # the CUmemPoolPtrExportData that memory.py made of the bytes it got
        if data not in self.ALLOCATIONS:
            self.calls.append(("import_pointer", pool, data))
            return (self.BAD, None)
        return self._call("import_pointer", pool, data, value=self.ALLOCATIONS[data][0])

    def cuMemGetAddressRange(self, pointer: int) -> tuple[Any, ...]:
        self.calls.append(("range", pointer))
        return (self.OK, pointer, next(size for address, size in self.ALLOCATIONS.values() if address == pointer))

    def cuMemPoolDestroy(self, pool: int) -> tuple[Any, ...]:
        self.imports -= 1
        assert self.imports >= 0, (
            "the pool was destroyed more often than imported: the process would crash on its next use"
        )
        return self._call("destroy_pool", pool)


A, B = b"a" * 64, b"b" * 64
ADDRESS_A, ADDRESS_B = _FakePoolDriver.ALLOCATIONS[A][0], _FakePoolDriver.ALLOCATIONS[B][0]


@pytest.fixture
def pool_driver(daemon_driver: Any) -> Any:
    """memory.py's pool calls answered by a `_FakePoolDriver` (replace it with ``.use(...)``)."""
    daemon_driver.use(_FakePoolDriver())
    return daemon_driver


def test_daemon_imports_each_allocation_once_and_each_pool_import_goes_with_its_region(pool_driver: Any) -> None:
    """Three regions from one pool, sent with three fds: each import of the pool gives one
    handle, so access for the peer GPU is set once; the allocation two regions share is
    imported once. Each region's release destroys its import of the pool, the last region of
    an allocation frees it first; in the end every import is destroyed."""
    drv = pool_driver.drv
    used: list[int] = []
    regions = memory.Regions(used.append)
    first = regions.import_device_pool(5, A, 4096, 8192, 1, [0])  # gpu0 reaches gpu1 by a peer lane
    again = regions.import_device_pool(6, A, 0, 4096, 1, [0])
    other = regions.import_device_pool(7, B, 100, 1000, 1, [0])
    assert used == [1, 1, 1] and (first.pointer, again.pointer, other.pointer) == (
        ADDRESS_A + 4096,
        ADDRESS_A,
        ADDRESS_B + 100,
    )
    assert (first.nbytes, first.device, first.export) == (8192, 1, None)
    assert [c[1] for c in drv.calls if c[0] == "import_pool"] == [5, 6, 7]
    assert [c for c in drv.calls if c[0] != "import_pool"] == [
        ("pool_access", 900, 1),
        ("import_pointer", 900, A),
        ("range", ADDRESS_A),
        ("import_pointer", 900, B),
        ("range", ADDRESS_B),
    ]
    assert drv.access == [("device", 0, "rw")] and regions.statistics()["pool_imports"] == 2 and drv.imports == 3
    drv.calls.clear()
    regions.release_device(first)
    assert drv.calls == [("destroy_pool", 900)]  # `again` still uses allocation A
    regions.release_device(other)
    regions.release_device(again)
    regions.release_device(again)  # idempotent
    assert drv.calls == [
        ("destroy_pool", 900),
        ("free_pointer", ADDRESS_B),
        ("destroy_pool", 900),
        ("free_pointer", ADDRESS_A),
        ("destroy_pool", 900),
    ]
    assert regions.device_mems == {} and len(regions.pools) == 0 and drv.imports == 0


@pytest.mark.parametrize(
    ("fail", "export", "offset", "error", "undo"),
    [
        ("import_pool", A, 0, InvalidRequest, []),
        ("", b"c" * 64, 0, InvalidRequest, [("import_pointer", 900, b"c" * 64), ("destroy_pool", 900)]),
        ("", A, 4 * MiB - 4095, InvalidRequest, [("free_pointer", ADDRESS_A), ("destroy_pool", 900)]),
        ("pool_access", A, 0, CudaError, [("pool_access", 900, 1), ("destroy_pool", 900)]),
    ],
    ids=["not-a-pool-fd", "no-such-allocation", "past-the-allocation", "access-refused"],
)
def test_daemon_pool_import_errors_undo_what_was_done(
    pool_driver: Any, fail: str, export: bytes, offset: int, error: type[Exception], undo: list[tuple[Any, ...]]
) -> None:
    """A fd that is no pool's, export data that names no allocation of it, or a region past the
    allocation's end are the client's mistakes (InvalidRequest: bad_request, naming what to
    send); whatever fails, what was imported is let go and nothing is left registered."""
    drv = pool_driver.use(_FakePoolDriver(fail))
    regions = memory.Regions(lambda device: None)
    with pytest.raises(error) as info:
        regions.import_device_pool(5, export, offset, 4096, 0, [1])
    if error is InvalidRequest:
        assert "cuMemPoolExportToShareableHandle" in str(info.value) and "cuMemPoolExportPointer" in str(info.value)
    assert drv.calls[len(drv.calls) - len(undo) :] == undo if undo else [c[0] for c in drv.calls] == ["import_pool"]
    assert regions.device_mems == {} and len(regions.pools) == 0 and drv.imports == 0


def test_a_refused_allocation_leaves_its_pool_to_the_others_and_close_frees_all(pool_driver: Any) -> None:
    """Export data that names nothing gives back only its own import of the pool, not the one
    of the allocation already imported from it; closing the engine's regions frees what is
    still imported and destroys every import left."""
    drv = pool_driver.drv
    regions = memory.Regions(lambda device: None)
    regions.pools.acquire(5, A, 0)  # held without a region: only close lets go of it
    regions.pools.acquire(6, A, 0)
    with pytest.raises(InvalidRequest, match="names no allocation of that pool"):
        regions.import_device_pool(7, b"c" * 64, 0, 4096, 0)
    assert drv.imports == 2 and len(regions.pools) == 1
    drv.calls.clear()
    assert regions.close() == []
    assert drv.calls == [("free_pointer", ADDRESS_A), ("destroy_pool", 900), ("destroy_pool", 900)]
    assert len(regions.pools) == 0 and drv.imports == 0
