"""Which host memory fds a client may register: only memory the daemon can map and keep using safely.

A client picks the file behind an fd, and the daemon maps it and copies into it for as long as
the region lives: a file that can shrink, or give its pages back (hugetlb), would fault the
daemon (SIGBUS) on a later copy, and asking a filesystem the client controls (FUSE) could block
the loop. So only plain memfds, sealed against shrinking, are taken (`check_host_fd`).
"""

from __future__ import annotations

import ctypes
import fcntl
import os

from priod.errors import InvalidRequest

__all__ = ["check_host_fd"]

TMPFS_MAGIC = 0x01021994
"""``f_type`` of shmem (tmpfs) files, which plain memfds are."""
HUGETLBFS_MAGIC = 0x958458F6
F_SEAL_FUTURE_WRITE = 0x0010  # Linux 5.1; not in Python 3.11's fcntl

_libc: ctypes.CDLL | None = None


def _fs_magic(fd: int) -> int:
    """``f_type`` of the filesystem ``fd`` lives on (fstatfs(2); os.fstatvfs does not report it)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(256)  # struct statfs: 120 bytes on 64-bit Linux, f_type first
    if _libc.fstatfs(fd, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def check_host_fd(fd: int) -> None:
    """Refuse (InvalidRequest, naming the fix) any fd but memory the daemon can map and keep
    using safely: a plain memfd (shmem), open read-write, sealed against shrinking and not
    against writing.

    A hole punched in a plain memfd (fallocate PUNCH_HOLE, which F_SEAL_SHRINK does not stop)
    reads back as zeros afterwards, in the client's mapping and the daemon's alike; in a hugetlb
    memfd it gives the huge page back and the daemon's next copy there would fault (SIGBUS), so
    hugetlb memfds are refused.
    """
    try:
        # F_GET_SEALS first: it fails at once for anything but shmem and hugetlbfs files, before
        # fstatfs could ask a filesystem a client controls (FUSE) and block the loop.
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        magic = _fs_magic(fd)
    except OSError:
        raise InvalidRequest(
            "the passed fd is not a memfd; create it with os.memfd_create(name, os.MFD_ALLOW_SEALING)"
        ) from None
    if magic == HUGETLBFS_MAGIC:
        raise InvalidRequest(
            "the passed memfd is backed by huge pages (MFD_HUGETLB), which its owner can give back under the daemon (a hole punch) "
            "and make it fault; create it with os.memfd_create(name, os.MFD_ALLOW_SEALING) without MFD_HUGETLB"
        )
    if magic != TMPFS_MAGIC:
        raise InvalidRequest(
            f"the passed fd is not a memfd (its filesystem is 0x{magic:x}); create it with os.memfd_create(name, os.MFD_ALLOW_SEALING)"
        )
    if not seals & fcntl.F_SEAL_SHRINK:
        if seals & fcntl.F_SEAL_SEAL:
            raise InvalidRequest(
                "the passed fd cannot be sealed (a memfd made without MFD_ALLOW_SEALING, or a tmpfs file); "
                "create it with os.memfd_create(name, os.MFD_ALLOW_SEALING) and seal it with fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK)"
            )
        raise InvalidRequest(
            "seal the memfd against shrinking first: fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK); a shrunk region would fault the daemon"
        )
    if seals & (fcntl.F_SEAL_WRITE | F_SEAL_FUTURE_WRITE):
        raise InvalidRequest(
            "the passed memfd is sealed against writing (F_SEAL_WRITE or F_SEAL_FUTURE_WRITE), and copies into a host region write to it; "
            "register a memfd without write seals (F_SEAL_SHRINK is the one needed)"
        )
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
        raise InvalidRequest(
            "the passed fd is open read-only, and copies into a host region write to it; pass the memfd itself (open for reading and writing)"
        )
