"""``cuMemCreate`` memory shared by POSIX fd: made, imported, mapped and unmapped.

Both sides use it: the daemon allocates device regions this way (`vmm_prop`) and imports a
client's own ``cuMemCreate`` memory; the client maps a daemon allocation from the fd it keeps.
An allocation lives while any handle, mapping or exported fd of it does, in any process, which
is what lets a daemon-allocated region outlive the daemon (docs/reliability.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from priod.common.cuda.driver import bindings, check
from priod.errors import CudaError, InvalidRequest

__all__ = ["VMM_FD_HINT", "VmmMapping", "access_descs", "vmm_import", "vmm_map", "vmm_prop", "vmm_unmap"]


class VmmMapping(NamedTuple):
    """An imported ``cuMemCreate`` allocation mapped here: ``size`` bytes at ``base``."""

    handle: Any
    """The imported ``CUmemGenericAllocationHandle``, released after the unmap."""
    base: int
    size: int


VMM_FD_HINT = (
    "pass the fd that cuMemExportToShareableHandle(handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) gave for the "
    "allocation (priod.client.cuda_ipc.export_device_buffer does), with size the whole allocation's"
)


def vmm_map(drv: Any, handle: Any, size: int, devices: Sequence[int]) -> VmmMapping:
    """Map all ``size`` bytes of the imported ``handle`` at a new address range and give
    ``devices`` read/write access; on any failure undo what was done and release ``handle``."""
    base = 0
    mapped = False
    try:
        prop = check(drv.cuMemGetAllocationPropertiesFromHandle(handle))
        granularity = int(
            check(
                drv.cuMemGetAllocationGranularity(
                    prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
                )
            )
        )
        if granularity <= 0 or size % granularity:
            raise InvalidRequest(
                f"size = {size} is not a multiple of the allocation's granularity ({granularity} bytes): {VMM_FD_HINT}"
            )
        base = int(check(drv.cuMemAddressReserve(size, granularity, 0, 0)))
        try:
            check(drv.cuMemMap(base, size, 0, handle, 0))
        except CudaError as exc:
            # The driver's one complaint about a size larger than the allocation.
            raise InvalidRequest(f"the allocation does not map with size = {size} ({exc}): {VMM_FD_HINT}") from exc
        mapped = True
        descs = access_descs(drv, devices)
        check(drv.cuMemSetAccess(base, size, descs, len(descs)))
    except BaseException:
        # Best effort, in the reverse order; the error that got us here is the one to report.
        if mapped:
            drv.cuMemUnmap(base, size)
        if base:
            drv.cuMemAddressFree(base, size)
        drv.cuMemRelease(handle)
        raise
    return VmmMapping(handle, base, size)


def access_descs(drv: Any, devices: Sequence[int]) -> list[Any]:
    """``CUmemAccessDesc`` read/write for each of ``devices`` (cuMemSetAccess, cuMemPoolSetAccess)."""
    descs = []
    for device in devices:
        access = drv.CUmemAccessDesc()
        access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = device
        access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        descs.append(access)
    return descs


def vmm_unmap(mapping: VmmMapping) -> None:
    """Unmap, free the address range, release the imported handle (each tried, the first error
    raised): the client's allocation is freed once it, too, lets go. Nothing may be in flight
    on it (cuMemUnmap does not wait for the device)."""
    _, drv = bindings()
    results = (
        drv.cuMemUnmap(mapping.base, mapping.size),
        drv.cuMemAddressFree(mapping.base, mapping.size),
        drv.cuMemRelease(mapping.handle),
    )
    for result in results:
        check(result)


def vmm_import(drv: Any, fd: int) -> Any:
    """``cuMemImportFromShareableHandle`` of a POSIX fd; a fd that is not a CUDA allocation's
    export is the client's mistake (InvalidRequest), whatever the driver calls it."""
    kind = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    try:
        return check(drv.cuMemImportFromShareableHandle(fd, kind))
    except CudaError as exc:
        raise InvalidRequest(
            f"the fd passed with register_device (kind 'vmm_fd') does not import as a CUDA allocation ({exc}): {VMM_FD_HINT}"
        ) from exc


def vmm_prop(drv: Any, device: int) -> Any:
    """The ``CUmemAllocationProp`` of device memory on ``device`` exportable as a POSIX fd."""
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    prop.requestedHandleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop
