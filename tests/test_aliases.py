"""Aliases: one memory under two regions, and one GPU under three names.

Memory: a client may register one memfd twice, or (sim) the memfd of a device region as a host
region; the two regions are then the same pages, and a copy between them whose source and
destination overlap is refused as it is within one region (a copy engine does not copy
overlapping ranges as memmove does). Ranges that do not overlap copy as between any two regions.

GPUs: a request names a GPU by the daemon's ordinal (an int), by its name as ``priod status``
shows it (``gpu1``), or by its UUID; any other string is refused, listing the three.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import socket
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

import priod
from priod.client.base import alloc_device_request
from priod.daemon.engines.sim import sealed_memfd
from priod.daemon.regions import Holdings, Region, RegionTable
from priod.errors import InvalidRequest
from priod.testing import DaemonProcess, daemon_process
from priod.wire.batch import encode_segments
from priod.wire.messages import AllocDevice, decode_request
from priod.wire.transport import BlockingFramedSocket

MiB = 1 << 20
N = 64 << 10
"""Each region's size in the memory tests."""
U0 = "GPU-0b5e5f4a-1c2d-4e3f-8a9b-0c1d2e3f4a5b"
U1 = "GPU-9f8e7d6c-5b4a-4392-8170-6f5e4d3c2b1a"
FORMS = r"give the daemon's ordinal as an int \(0\), its name as `priod status` shows it \('gpu0'\), or the GPU's UUID"


class Raw:
    """One connection on the wire, for the fds that come back beside replies (a sim device
    region's memfd), which the client library maps and closes."""

    def __init__(self, path: str) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(30)
        sock.connect(path)
        self.fs = BlockingFramedSocket(sock)
        self.next_id = 1
        self.fds: list[int] = []
        """Every fd that came back, closed with the connection."""
        self.fds_back: list[int] = []
        """The fds that came back with the last reply."""
        assert self.request({"op": "hello", "v": 2})["ok"]

    def request(self, msg: dict[str, Any], fds: tuple[int, ...] = ()) -> dict[str, Any]:
        self.next_id += 1
        self.fs.send({"id": self.next_id, **msg}, fds)
        reply, got = self.fs.receive()
        assert reply["id"] == self.next_id, reply
        self.fds += got
        self.fds_back = got
        return reply

    def ok(self, msg: dict[str, Any], fds: tuple[int, ...] = ()) -> dict[str, Any]:
        reply = self.request(msg, fds)
        assert reply["ok"] is True, reply
        return reply

    def error(self, msg: dict[str, Any]) -> tuple[str, str]:
        reply = self.request(msg)
        assert reply["ok"] is False, reply
        return reply["error"]["code"], reply["error"]["message"]

    def close(self) -> None:
        self.fs.close()
        for fd in self.fds:
            os.close(fd)


def mapped(fd: int, nbytes: int) -> npt.NDArray[np.uint8]:
    return np.frombuffer(mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE), dtype=np.uint8)


@pytest.fixture
def aliased(daemon: DaemonProcess) -> Iterator[tuple[Raw, int, int, npt.NDArray[np.uint8]]]:
    """A sim device region, the same memfd registered as a host region, and the bytes of both
    (a pattern, so that any byte out of place shows)."""
    raw = Raw(daemon.socket_path)
    try:
        dev = raw.ok({"op": "alloc_device", "nbytes": N})["region"]
        (memfd,) = raw.fds_back
        host = raw.ok({"op": "register_host", "nbytes": N}, (memfd,))["region"]
        mem = mapped(memfd, N)
        mem[:] = np.arange(N, dtype=np.uint32).astype(np.uint8)
        yield raw, dev, host, mem
    finally:
        raw.close()


def copy(dst: int, src: int, nbytes: int, dst_offset: int, src_offset: int) -> dict[str, Any]:
    return {
        "op": "copy",
        "dst": dst,
        "src": src,
        "nbytes": nbytes,
        "dst_offset": dst_offset,
        "src_offset": src_offset,
        "priority": "bulk",
    }


# -- one memory, two regions ---------------------------------------------------------------


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize(("dst_offset", "src_offset"), [(100, 0), (0, 100), (4096, 4096), (0, 4095)])
def test_an_overlapping_copy_between_two_regions_of_one_memfd_is_refused(
    aliased: tuple[Raw, int, int, npt.NDArray[np.uint8]], direction: str, dst_offset: int, src_offset: int
) -> None:
    """A sim device region and its own memfd registered as a host region: a copy between them
    whose source and destination bytes overlap in the memfd is refused, naming the overlap and
    that the two regions are one memory, and nothing is written. (Before: it ran, chunk by
    chunk forwards, and left neither the source's old bytes nor memmove's result.)"""
    raw, dev, host, mem = aliased
    dst, src = (dev, host) if direction == "h2d" else (host, dev)
    before = mem.copy()
    code, message = raw.error(copy(dst, src, 8192, dst_offset, src_offset))
    assert code == "bad_request"
    assert message == (
        f"source bytes {src_offset}..{src_offset + 8192} of region {src} overlap destination bytes "
        f"{dst_offset}..{dst_offset + 8192} of region {dst} (regions {src} and {dst} are views of the same memory: "
        "one memfd or one device allocation); a copy engine does not copy overlapping ranges as memmove does: "
        "copy through another region, or in pieces that do not overlap"
    )
    assert np.array_equal(mem, before)
    raw.ok({"op": "ping"})


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize(
    ("dst_offset", "src_offset", "nbytes"), [(8192, 0, 8192), (0, 8192, 8192), (N // 2, 0, N // 2)]
)
def test_ranges_that_do_not_overlap_copy_between_two_regions_of_one_memfd(
    aliased: tuple[Raw, int, int, npt.NDArray[np.uint8]], direction: str, dst_offset: int, src_offset: int, nbytes: int
) -> None:
    """Between the same two regions, ranges that do not overlap (adjacent ones too) copy, and the
    bytes land right: the memfd's source bytes at the destination offset, the rest untouched."""
    raw, dev, host, mem = aliased
    dst, src = (dev, host) if direction == "h2d" else (host, dev)
    expected = mem.copy()
    expected[dst_offset : dst_offset + nbytes] = mem[src_offset : src_offset + nbytes]
    assert raw.ok(copy(dst, src, nbytes, dst_offset, src_offset))["nbytes"] == nbytes
    assert np.array_equal(mem, expected)


def test_a_batch_between_two_regions_of_one_memfd_is_checked_as_one_memory(
    aliased: tuple[Raw, int, int, npt.NDArray[np.uint8]],
) -> None:
    """copy_batch between the aliases: a source segment that overlaps a destination segment in
    the memfd is refused (the whole batch, nothing written); segments that do not overlap copy,
    every byte right."""
    raw, dev, host, mem = aliased
    before = mem.copy()
    # Segment 1's source (8192..12288) is segment 0's destination: one memory, so they clash.
    clash = encode_segments([[8192, 0, 4096], [20000, 8192, 4096]])
    code, message = raw.error({"op": "copy_batch", "dst": dev, "src": host, "segments": clash})
    assert code == "bad_request"
    assert message.startswith("source segment 1 overlaps destination segment 0 in the same memory; "), message
    assert np.array_equal(mem, before)
    rows = [[8192, 0, 4096], [32768, 4096, 4096], [50000, 12288, 1000]]
    expected = mem.copy()
    for d, s, n in rows:
        expected[d : d + n] = mem[s : s + n]
    reply = raw.ok({"op": "copy_batch", "dst": host, "src": dev, "segments": encode_segments(rows)})
    assert reply["nbytes"] == 9192 and reply["segments"] == 3
    assert np.array_equal(mem, expected)


def test_one_memfd_registered_twice_is_one_memory_and_never_copied_host_to_host(daemon: DaemonProcess) -> None:
    """`register_host` with the same fd twice gives two regions over the same pages (a write
    through one shows through the other, and either copies to a device region); a copy between
    the two is refused, as between any two host regions, overlapping or not."""
    fd = sealed_memfd("alias", N)
    try:
        with priod.SyncClient(daemon.socket_path, copy_path="daemon") as c:
            a, b = c.register_host(fd, N), c.register_host(fd, N)
            dev = c.alloc_device(N)
            assert a.array is not None and b.array is not None and dev.array is not None
            a.array[:] = np.arange(N, dtype=np.uint32).astype(np.uint8)
            assert np.array_equal(b.array, a.array)
            c.copy(dev, b, priority="bulk")
            assert np.array_equal(dev.array, a.array)
            for dst_offset, src_offset in ((100, 0), (8192, 0)):
                with pytest.raises(InvalidRequest, match=r"^both regions are host memory"):
                    c.copy(a, b, 4096, dst_offset=dst_offset, src_offset=src_offset, priority="bulk")
            with pytest.raises(InvalidRequest, match=r"^both regions are host memory"):
                c.copy_batch(a, b, [[100, 0, 4096]], priority="bulk")
    finally:
        os.close(fd)


def _region(
    rid: int, kind: str, file: tuple[int, int] | None, file_offset: int = 0, device: int | None = None
) -> Region:
    mem: Any = None  # never read by the overlap checks
    return Region(rid, Holdings(0), kind, 1 << 20, mem, device, file=file, file_offset=file_offset)


def test_memory_shift_of_regions_over_one_file_is_the_difference_of_their_offsets() -> None:
    """Two regions over one memfd (st_dev, st_ino) overlap where their bytes in the file do;
    regions over different files, or with none (CUDA device memory), never do."""
    a = _region(1, "host", (5, 77), file_offset=0)
    b = _region(2, "device", (5, 77), file_offset=4096, device=0)
    other = _region(3, "device", (5, 78), device=0)
    cuda = _region(4, "device", None, device=0)
    assert RegionTable.memory_shift(a, b) == 4096 and RegionTable.memory_shift(b, a) == -4096
    assert RegionTable.memory_shift(a, other) is None and RegionTable.memory_shift(a, cuda) is None
    # b's byte 0 is a's byte 4096: a copy a[4096:8192] <- b[0:4096] is within one memory.
    assert RegionTable.overlapping(a, 4096, b, 0, 4096)
    assert RegionTable.overlapping(a, 6000, b, 0, 4096)
    assert not RegionTable.overlapping(a, 0, b, 0, 4096)  # a's 0..4096 against b's 0..4096 (a's 4096..8192)
    assert not RegionTable.overlapping(a, 8192, b, 0, 4096)


# -- one GPU, three names ------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_gpus() -> Iterator[DaemonProcess]:
    env = {"PRIOD_SIM__DEVICES": "2", "PRIOD_SIM__UUIDS": json.dumps([U0, U1]), "PRIOD_LOG__LEVEL": '"warning"'}
    with daemon_process(env) as d:
        yield d
    assert d.proc.returncode == 0, d.log()[-4000:]


def test_alloc_device_takes_the_names_priod_status_shows(two_gpus: DaemonProcess) -> None:
    """Every GPU `priod status` lists is reached by its name there (``gpu1``), by its UUID and by
    its ordinal alike: the region lands on that GPU. (Before: ``device="gpu1"`` was taken for a
    UUID and refused, "not a GPU UUID".)"""
    with priod.SyncClient(two_gpus.socket_path) as c:
        gpus = {f"gpu{g['index']}": g["uuid"] for g in c.status()["gpus"]}  # as `priod status` prints them
        assert gpus == {"gpu0": U0, "gpu1": U1}
        for name, uuid in gpus.items():
            ordinal = int(name.removeprefix("gpu"))
            for device in (name, uuid, ordinal, name.upper()):
                r = c.alloc_device(4096, device=device)
                assert (r.device, r.device_uuid) == (ordinal, uuid), (device, r.device, r.device_uuid)
                c.free(r)


@pytest.mark.parametrize(
    "device",
    ["gpu", "gpu-1", "gpu 1", "cuda:0", "0", "", "GPU-not-a-uuid", "gpu\u0661"],
    ids=ascii,  # not the bare "gpu": conftest skips a test with a keyword "gpu" where no GPU is
)
def test_alloc_device_refuses_other_strings_listing_the_three_forms(two_gpus: DaemonProcess, device: str) -> None:
    """A string that is neither ``gpuN`` nor a UUID is refused by the client library and by the
    daemon (a client speaking the wire itself), each message listing the forms it takes."""
    with pytest.raises(InvalidRequest, match=rf"^device {re.escape(repr(device))} names no GPU; {FORMS}"):
        alloc_device_request(4096, device)
    raw = Raw(two_gpus.socket_path)
    try:
        code, message = raw.error({"op": "alloc_device", "nbytes": 4096, "device": device})
        assert code == "bad_request"
        assert message.startswith(f"device {device!r} names no GPU; ") and "'gpu0'" in message and "GPU-" in message
        raw.ok({"op": "ping"})
    finally:
        raw.close()


@pytest.mark.parametrize("device", [True, 1.5, None, b"gpu0"])
def test_alloc_device_refuses_a_device_of_another_type(device: Any) -> None:
    with pytest.raises(InvalidRequest, match=rf"names no GPU; {FORMS}"):
        alloc_device_request(4096, device)


def test_gpu_names_on_the_wire(two_gpus: DaemonProcess) -> None:
    """The client sends ``gpuN`` as the int N (which every daemon takes); the daemon takes
    ``gpuN`` and a UUID in ``device`` too, and refuses an ordinal it does not serve."""
    assert alloc_device_request(8, "gpu1").encode(1) == {"id": 1, "op": "alloc_device", "nbytes": 8, "device": 1}
    numpy_int: Any = np.int64(1)
    assert alloc_device_request(8, numpy_int).encode(2) == {"id": 2, "op": "alloc_device", "nbytes": 8, "device": 1}
    assert decode_request({"id": 3, "op": "alloc_device", "nbytes": 8, "device": "gpu1"}) == AllocDevice(8, "gpu1")
    assert AllocDevice(8, "gpu1").target() == (1, None)
    assert AllocDevice(8, U1).target() == (0, U1)
    assert AllocDevice(8, "gpu1", device_uuid=U0).target() == (0, U0)  # device_uuid wins, as documented
    raw = Raw(two_gpus.socket_path)
    try:
        for device, ordinal in (("gpu1", 1), (U1, 1), ("gpu0", 0), (U0.lower().removeprefix("gpu-"), 0)):
            r = raw.ok({"op": "alloc_device", "nbytes": 4096, "device": device})
            assert (r["device"], r["device_uuid"]) == (ordinal, [U0, U1][ordinal]), (device, r)
        code, message = raw.error({"op": "alloc_device", "nbytes": 4096, "device": "gpu7"})
        assert code == "bad_request" and message.startswith("device 7 does not exist"), message
    finally:
        raw.close()
