"""Every client may be buggy or hostile: what one uid can make the daemon hold is bounded, and
no client can lock the others out, make the daemon fault, or see other users' clients.

- admission: a hello timeout, an idle timeout, a per-uid connection cap, and a reserve of
  connections beyond [server] max_clients for root and the daemon's own uid;
- limits per uid over all its connections (regions, pinned and device bytes, queued copies) and
  for the whole daemon (pinned bytes below RAM, device bytes, regions below the open-file limit),
  shares per region; every refusal is ``limit`` and names its setting;
- register_host maps only plain memfds (not hugetlb ones, whose hole punch would SIGBUS the
  daemon; not write-sealed or read-only ones), and a hole punched in a plain memfd reads zeros;
- a copy whose source and destination overlap is refused;
- `status` shows other users' clients only to root and the daemon's own uid;
- a client that never reads costs the daemon about [server] max_output_bytes, not more.

Connections "as another uid" are made by a forked child that drops to that uid, connects and
hands the connected sockets back over SCM_RIGHTS: the kernel recorded the child's credentials
at connect(), so the daemon sees that uid (SO_PEERCRED) exactly as it would in production.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import itertools
import mmap
import os
import re
import resource
import select
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import priod
from priod.client.direct import HoldPage
from priod.testing import DaemonProcess, daemon_process, wait_until
from priod.testing.procfs import memory_and_fds, open_fds
from priod.wire.frames import encode
from priod.wire.transport import BlockingFramedSocket

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root to run clients as other uids (setuid); CI runs the suite as root"
)

NOBODY, OTHER, STRANGER = 65534, 65533, 65532
MiB = 1 << 20
QUIET = {"PRIOD_LOG__LEVEL": '"warning"'}
OPEN = {**QUIET, "PRIOD_SERVER__SOCKET_MODE": "0o666"}


def socket_path() -> str:
    d = tempfile.mkdtemp(prefix="priod-hostile-")
    os.chmod(d, 0o755)  # other users must reach the socket inside
    return os.path.join(d, "priod.sock")


def connect_as(uid: int, path: str, n: int = 1) -> list[socket.socket]:
    """``n`` connections to ``path`` opened by a child running as ``uid`` (gid ``uid``)."""
    mine, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the child: only system calls, then _exit
        code = 1
        try:
            mine.close()
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            socks = []
            for _ in range(n):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(path)
                socks.append(s)
            socket.send_fds(theirs, [b"x"], [s.fileno() for s in socks])
            code = 0
        finally:
            os._exit(code)
    theirs.close()
    try:
        mine.settimeout(30)
        _, fds, _, _ = socket.recv_fds(mine, 1, n)
    finally:
        os.waitpid(pid, 0)
        mine.close()
    assert len(fds) == n, f"the child running as uid {uid} could not connect to {path}"
    return [socket.socket(fileno=fd) for fd in fds]


class Raw:
    """A client speaking the wire protocol by hand over a connection it was given."""

    def __init__(self, sock: socket.socket) -> None:
        sock.settimeout(30)
        self.sock = sock
        self.framed = BlockingFramedSocket(sock)
        self._ids = itertools.count(1)

    def request(self, op: str, fds: tuple[int, ...] = (), **fields: Any) -> dict[str, Any]:
        """Send one request and return its reply (fds that come back are closed)."""
        req_id = next(self._ids)
        self.framed.send({"id": req_id, "op": op, **fields}, fds)
        while True:
            msg, got = self.framed.receive()
            for fd in got:
                os.close(fd)
            if msg.get("id") in (req_id, 0):
                return msg

    def ok(self, op: str, **fields: Any) -> dict[str, Any]:
        reply = self.request(op, **fields)
        assert reply["ok"], reply
        return reply

    def hello(self) -> dict[str, Any]:
        return self.ok("hello", v=2)

    def error(self, op: str, **fields: Any) -> tuple[str, str]:
        reply = self.request(op, **fields)
        assert not reply["ok"], reply
        return reply["error"]["code"], reply["error"]["message"]

    def pending(self, timeout: float) -> bool:
        """Whether anything (a frame, or the end) arrives within ``timeout`` seconds."""
        return bool(select.select([self.sock], [], [], timeout)[0])

    def frame(self) -> dict[str, Any]:
        """The next frame the daemon sends unasked (id 0: a refusal or an expiry)."""
        msg, got = self.framed.receive()
        for fd in got:
            os.close(fd)
        return msg

    def at_eof(self, timeout: float) -> bool:
        self.sock.settimeout(timeout)
        try:
            return self.sock.recv(1) == b""
        finally:
            self.sock.settimeout(30)

    def close(self) -> None:
        self.framed.close()


def refusal(msg: dict[str, Any]) -> tuple[str, str]:
    assert msg["id"] == 0 and not msg["ok"], msg
    return msg["error"]["code"], msg["error"]["message"]


@contextlib.contextmanager
def raw_as(uid: int, path: str, n: int = 1, hello: bool = True) -> Iterator[list[Raw]]:
    conns = [Raw(s) for s in connect_as(uid, path, n)]
    try:
        if hello:
            for c in conns:
                c.hello()
        yield conns
    finally:
        for c in conns:
            c.close()


def root_status(path: str) -> dict[str, Any]:
    with priod.SyncClient(path, timeout=30, copy_path="daemon") as c:
        return c.status()


def serving(d: DaemonProcess, clients: int) -> bool:
    """The daemon serves exactly ``clients`` connections besides the one asking."""
    return bool(root_status(d.socket_path)["clients_total"] == clients + 1)


# -- admission ---------------------------------------------------------------------------------


def test_idle_connections_of_one_uid_cannot_lock_others_out() -> None:
    """One uid opening connections and never saying hello used to hold every slot of
    max_clients, root's included, for ever. Now a uid gets at most max_connections_per_uid
    connections, root gets in past max_clients (its reserve), and a connection without a hello
    is closed after hello_timeout_s with a `limit` error saying so, which frees its slot."""
    env = {
        **OPEN,
        "PRIOD_SERVER__MAX_CLIENTS": "4",
        "PRIOD_LIMITS__MAX_CONNECTIONS_PER_UID": "2",
        "PRIOD_SERVER__HELLO_TIMEOUT_S": "4.0",
        "PRIOD_SERVER__IDLE_TIMEOUT_S": "0",
    }
    with daemon_process(env, socket_path=socket_path()) as d:
        path = d.socket_path
        t0 = time.monotonic()
        silent = [Raw(s) for s in connect_as(NOBODY, path, 3)]  # no hello, ever
        try:
            assert refusal(silent[2].frame()) == (
                "limit",
                f"uid {NOBODY} already has 2 connections ([limits] max_connections_per_uid = 2); close one, or share one connection between threads",
            )
            assert not silent[0].pending(0.2) and not silent[1].pending(0)  # admitted, waiting for a hello
            with raw_as(OTHER, path, 2) as others:  # another uid still gets in: 4 of 4 slots taken
                with raw_as(STRANGER, path, hello=False) as (stranger,):
                    assert refusal(stranger.frame()) == (
                        "limit",
                        "the daemon already serves 4 clients ([server] max_clients); retry later",
                    )
                # root gets in beyond max_clients, and sees who holds the slots
                with priod.SyncClient(path, timeout=30, copy_path="daemon") as root, priod.SyncClient(path, timeout=30):
                    st = root.status()
                    assert st["clients_total"] == 6
                    assert sorted(c["uid"] for c in st["clients"]) == [0, 0, OTHER, OTHER, NOBODY, NOBODY]
                assert time.monotonic() - t0 < 3.5, "too slow to see the silent connections before their hello timeout"
                # the silent connections are told why and closed once hello_timeout_s has passed
                for c in silent[:2]:
                    assert refusal(c.frame()) == (
                        "limit",
                        "no hello within 4 s of connecting ([server] hello_timeout_s); send hello as the first request",
                    )
                    assert c.at_eof(5)
                assert 4.0 <= time.monotonic() - t0 < 9.0
                others[0].ok("ping")  # the connections that said hello are untouched
                wait_until(lambda: serving(d, 2), timeout=10.0, what="the expired connections leaving")
                with raw_as(STRANGER, path) as (late,):  # their slots are free again
                    late.ok("ping")
        finally:
            for c in silent:
                c.close()
    assert d.proc.returncode == 0, d.log()[-4000:]


async def test_idle_timeout_closes_connections_that_hold_nothing() -> None:
    """A connection that holds no region and has no copy pending is closed after
    idle_timeout_s without a request (with a `limit` error saying so); one that holds a region,
    or keeps sending requests, stays."""
    env = {**QUIET, "PRIOD_SERVER__IDLE_TIMEOUT_S": "1.0"}
    with daemon_process(env) as d:
        async with (
            priod.connect(d.socket_path, copy_path="daemon") as idle,
            priod.connect(d.socket_path, copy_path="daemon") as holder,
            priod.connect(d.socket_path, copy_path="daemon") as busy,
        ):
            await holder.alloc_host(4096)
            for _ in range(10):
                await busy.ping()
                await asyncio.sleep(0.25)
            with pytest.raises(
                priod.LimitExceeded,
                match=r"^connection idle for 1 s with no regions and no copies \(\[server\] idle_timeout_s\); connect again when needed$",
            ):
                await idle.ping()
            await holder.ping()
            await busy.ping()
    assert d.proc.returncode == 0, d.log()[-4000:]


# -- limits per uid and for the whole daemon ---------------------------------------------------


async def test_limits_per_uid_hold_over_all_its_connections() -> None:
    """Regions, pinned and device bytes and pending copies are counted per uid over all its
    connections (root's included), each uid with its own budget; a connection that leaves
    gives its share back; a region is shared with at most max_shares_per_region uids."""
    env = {
        **OPEN,
        "PRIOD_LIMITS__MAX_REGIONS_PER_UID": "3",
        "PRIOD_LIMITS__MAX_PINNED_BYTES_PER_UID": str(4 * MiB),
        "PRIOD_LIMITS__MAX_DEVICE_BYTES_PER_UID": str(4 * MiB),
        "PRIOD_LIMITS__MAX_QUEUED_REQUESTS_PER_UID": "4",
        "PRIOD_LIMITS__MAX_QUEUED_BYTES_PER_UID": str(3 * MiB),
        "PRIOD_LIMITS__MAX_SHARES_PER_REGION": "2",
        "PRIOD_SIM__H2D_GBPS": "0.004",  # 1 MiB copies take 260 ms: they stay pending
        "PRIOD_TUNING__MIN_CHUNK_BYTES": "65536",
    }
    with daemon_process(env, socket_path=socket_path()) as d:
        path = d.socket_path
        with raw_as(NOBODY, path, 2) as (a1, a2), raw_as(OTHER, path) as (b,):
            a1.ok("alloc_host", nbytes=3 * MiB)
            assert a2.error("alloc_host", nbytes=2 * MiB) == (
                "limit",
                f"2097152 more pinned bytes would exceed [limits] max_pinned_bytes_per_uid = 4194304 (uid {NOBODY} holds 3145728 "
                "over its connections); free a host region or ask for less",
            )
            b.ok("alloc_host", nbytes=4 * MiB)  # another uid: its own budget
            a2.ok("alloc_device", nbytes=3 * MiB)
            assert a1.error("alloc_device", nbytes=2 * MiB) == (
                "limit",
                f"2097152 more device bytes would exceed [limits] max_device_bytes_per_uid = 4194304 (uid {NOBODY} holds 3145728 "
                "over its connections); free a device region or ask for less",
            )
            shared = a2.ok("alloc_host", nbytes=4096)["region"]
            assert a1.error("alloc_device", nbytes=4096) == (
                "limit",
                f"uid {NOBODY} holds 3 regions over its connections ([limits] max_regions_per_uid = 3); free some first",
            )
            a2.ok("share", region=shared, uid=1000)
            a2.ok("share", region=shared, uid=1001)
            a2.ok("share", region=shared, uid=1000)  # already shared with it: no new share
            assert a2.error("share", region=shared, uid=1002) == (
                "limit",
                f"region {shared} is shared with 2 uids already ([limits] max_shares_per_region = 2)",
            )
            a1.close()  # its 3 MiB host region goes back to the uid's budget
            wait_until(
                lambda: a2.request("alloc_host", nbytes=3 * MiB)["ok"],
                timeout=10.0,
                what=f"uid {NOBODY}'s budget coming back",
            )
            st = root_status(path)
            mine = {u["uid"]: u for u in st["uids"]}
            assert (mine[NOBODY]["regions"], mine[NOBODY]["pinned_bytes"], mine[NOBODY]["device_bytes"]) == (
                3,
                3 * MiB + 4096,
                3 * MiB,
            )
            assert (mine[OTHER]["regions"], mine[OTHER]["pinned_bytes"]) == (1, 4 * MiB)

        # copies pending, per uid (root's connections here: per-uid limits bind uid 0 too)
        async with priod.connect(path, copy_path="daemon") as c1, priod.connect(path) as c2:
            dev, host = await c1.alloc_device(MiB), await c1.alloc_host(MiB)
            await c1.share(dev, 0)
            await c1.share(host, 0)  # c2 may name them: same uid
            pending = [c1.start_copy(dev, host, priority="bulk") for _ in range(2)]
            await c1.ping()  # queued before anything of c2's (requests of one connection are handled in order)
            pending.append(c2.start_copy(dev, host, MiB // 2, priority="bulk"))
            with pytest.raises(
                priod.LimitExceeded,
                match=r"^1048576 more bytes would exceed \[limits\] max_queued_bytes_per_uid = 3145728 pending over uid 0's connections; wait for replies before sending more$",
            ):
                await c2.copy(dev, host, priority="bulk")
            pending.append(c2.start_copy(dev, host, 4096, priority="bulk"))
            await c2.ping()
            with pytest.raises(
                priod.LimitExceeded,
                match=r"^uid 0 has 4 copies pending over its connections \(\[limits\] max_queued_requests_per_uid = 4\); wait for replies before sending more$",
            ):
                await c1.copy(dev, host, 4096, priority="bulk")
            assert not any(h.done() for h in pending)
            await asyncio.gather(*(h.cancel() for h in pending))
            await c1.copy(dev, host, 4096, priority="urgent")  # room again
    assert d.proc.returncode == 0, d.log()[-4000:]


def test_daemon_wide_caps_bind_every_uid() -> None:
    """Pinned bytes, device bytes and regions are capped for the whole daemon too, whoever asks
    (root included); the refusal names the setting, and status shows the totals and caps."""
    env = {
        **OPEN,
        "PRIOD_LIMITS__MAX_PINNED_TOTAL_BYTES": str(6 * MiB),
        "PRIOD_LIMITS__MAX_DEVICE_TOTAL_BYTES": str(6 * MiB),
        "PRIOD_LIMITS__MAX_REGIONS_TOTAL": "4",
    }
    with daemon_process(env, socket_path=socket_path()) as d:
        path = d.socket_path
        with (
            raw_as(NOBODY, path) as (a,),
            raw_as(OTHER, path) as (b,),
            priod.SyncClient(path, timeout=30, copy_path="daemon") as root,
        ):
            a.ok("alloc_host", nbytes=4 * MiB)
            pinned = (
                "limit",
                "4194304 more pinned bytes would exceed the daemon's cap of 6291456 ([limits] max_pinned_total_bytes = 6291456; "
                "0 means half the host's memory); all clients hold 4194304: ask for less or retry later",
            )
            assert b.error("alloc_host", nbytes=4 * MiB) == pinned
            with pytest.raises(priod.LimitExceeded, match=re.escape(pinned[1])):
                root.alloc_host(4 * MiB)
            a.ok("alloc_device", nbytes=4 * MiB)
            assert b.error("alloc_device", nbytes=4 * MiB) == (
                "limit",
                "4194304 more device bytes would exceed the daemon's cap of 6291456 ([limits] max_device_total_bytes = 6291456; "
                "0 means none on a GPU, half the host's memory on sim); all clients hold 4194304: ask for less or retry later",
            )
            b.ok("alloc_host", nbytes=MiB)
            b.ok("alloc_device", nbytes=MiB)
            with pytest.raises(
                priod.LimitExceeded,
                match=r"^the daemon holds 4 regions, its cap \(\[limits\] max_regions_total = 4; 0 means what its open-file limit allows: \d+ now\); ",
            ):
                root.alloc_device(4096)
            assert root.status()["holdings"] == {
                "regions": 4,
                "regions_cap": 4,
                "pinned_bytes": 5 * MiB,
                "pinned_cap": 6 * MiB,
                "device_bytes": 5 * MiB,
                "device_cap": 6 * MiB,
            }
            a.close()
            wait_until(
                lambda: root.status()["holdings"]["regions"] == 2,
                timeout=10.0,
                what="the leaver's regions being released",
            )
            root.alloc_host(4 * MiB)
    assert d.proc.returncode == 0, d.log()[-4000:]


@pytest.fixture
def few_fds_daemon() -> Iterator[DaemonProcess]:
    """A daemon whose RLIMIT_NOFILE is lowered to 1024, soft and hard, once it runs."""
    with daemon_process({**QUIET, "PRIOD_SERVER__MAX_CLIENTS": "8"}) as d:
        resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE, (1024, 1024))
        yield d
    assert d.proc.returncode == 0, d.log()[-4000:]


async def test_regions_cannot_use_up_the_daemons_fds(few_fds_daemon: DaemonProcess) -> None:
    """Regions keep fds open (a sim device region two). With the default max_regions_total = 0
    the daemon caps regions at what RLIMIT_NOFILE leaves after its connections, so a client
    allocating region after region gets `limit` (it used to get `internal` errors once the
    daemon's fds ran out, and the daemon could no longer accept anyone); others still connect.
    The pinned cap defaults to half the host's memory."""
    d = few_fds_daemon
    with open(f"/proc/{d.proc.pid}/limits") as fp:
        (soft,) = [int(line.split()[3]) for line in fp if line.startswith("Max open files")]
    assert soft == 1024
    # Kept back per connection (max_clients 8, 16 reserved): its socket, an fd it passes, a hold
    # page (2) and a copy ring (3); then the refusals under way (32) and the daemon's own (64).
    cap = (1024 - (7 * (8 + 16) + 32 + 64)) // 2
    made = 0
    async with priod.connect(d.socket_path, copy_path="daemon") as hog:
        with pytest.raises(
            priod.LimitExceeded,
            match=rf"^the daemon holds {cap} regions, its cap \(\[limits\] max_regions_total = 0; 0 means what its open-file limit allows: {cap} now\); ",
        ):
            for _ in range(2000):
                await hog.alloc_device(4096)
                made += 1
        assert made == cap
        assert open_fds(d.proc.pid) < 1024 - 64
        with priod.SyncClient(d.socket_path, timeout=30, copy_path="daemon") as other:
            st = other.status()
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            assert st["holdings"] == {
                "regions": cap,
                "regions_cap": cap,
                "pinned_bytes": 0,
                "pinned_cap": memory // 2,
                "device_bytes": cap * 4096,
                "device_cap": memory // 2,
            }
            fd = os.memfd_create("t", os.MFD_ALLOW_SEALING)
            try:
                os.ftruncate(fd, 4096)
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
                with pytest.raises(priod.LimitExceeded, match=r"max_regions_total"):
                    other.register_host(fd, 4096)
            finally:
                os.close(fd)
    with priod.SyncClient(d.socket_path, timeout=30, copy_path="daemon") as later:
        wait_until(
            lambda: later.status()["holdings"]["regions"] == 0, timeout=10.0, what="the hog's regions being released"
        )
        later.alloc_device(4096)


# -- memory the daemon maps --------------------------------------------------------------------

FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
F_SEAL_FUTURE_WRITE = 0x10


def memfd(nbytes: int = MiB, *, flags: int = os.MFD_ALLOW_SEALING, seals: int = fcntl.F_SEAL_SHRINK) -> int:
    fd = os.memfd_create("hostile", flags)
    os.ftruncate(fd, nbytes)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def punch_hole(fd: int, offset: int, length: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if (
        libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, ctypes.c_int64(offset), ctypes.c_int64(length))
        != 0
    ):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


async def test_register_host_takes_only_memory_the_daemon_can_trust(daemon: DaemonProcess) -> None:
    """A hugetlb memfd (a hole punch gives its huge page back and the daemon's next copy there
    would SIGBUS; without a huge page pool it used to fail with `internal`), a memfd sealed
    against writing, one opened read-only (both `internal` before) and fds that cannot be
    sealed are refused with `bad_request` and the fix. A hole punched in a plain memfd after
    registration is harmless: the daemon reads zeros there, and its writes land in fresh pages
    the client sees (the mapping is shared)."""
    async with priod.connect(daemon.socket_path, copy_path="daemon") as c:
        cases: list[tuple[str, int, str]] = []
        try:
            cases.append(
                (
                    "hugetlb",
                    memfd(2 * MiB, flags=os.MFD_ALLOW_SEALING | os.MFD_HUGETLB),
                    r"^the passed memfd is backed by huge pages \(MFD_HUGETLB\)",
                )
            )
        except OSError:
            pass  # a kernel without hugetlbfs: nothing to refuse
        cases += [
            (
                "write-sealed",
                memfd(seals=fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE),
                r"^the passed memfd is sealed against writing \(F_SEAL_WRITE or F_SEAL_FUTURE_WRITE\)",
            ),
            (
                "future-write-sealed",
                memfd(seals=fcntl.F_SEAL_SHRINK | F_SEAL_FUTURE_WRITE),
                r"^the passed memfd is sealed against writing",
            ),
            (
                "unsealable",
                memfd(flags=0, seals=0),
                r"^the passed fd cannot be sealed \(a memfd made without MFD_ALLOW_SEALING, or a tmpfs file\)",
            ),
            ("unsealed", memfd(seals=0), r"^seal the memfd against shrinking first"),
        ]
        writable = memfd()
        cases.append(
            ("read-only", os.open(f"/proc/self/fd/{writable}", os.O_RDONLY), r"^the passed fd is open read-only")
        )
        with tempfile.TemporaryFile(dir="/dev/shm") as shm:
            shm.truncate(MiB)
            cases.append(("tmpfs file", os.dup(shm.fileno()), r"^the passed fd cannot be sealed"))
        r, w = os.pipe()
        os.close(w)
        cases.append(("pipe", r, r"^the passed fd is not a memfd"))
        try:
            for name, fd, message in cases:
                with pytest.raises(priod.InvalidRequest, match=message):
                    await c.register_host(fd, MiB)
                    pytest.fail(f"{name}: registered")
        finally:
            for _, fd, _ in cases:
                os.close(fd)
            os.close(writable)
        assert (await c.status())["holdings"]["pinned_bytes"] == 0

        # a hole punched after registration (F_SEAL_SHRINK does not stop it)
        size, hole = 2 * MiB, slice(512 * 1024, 1536 * 1024)
        fd = memfd(size)
        view = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            mine = np.frombuffer(view, dtype=np.uint8)
            pattern = np.random.default_rng(7).integers(1, 256, size, dtype=np.uint8)
            mine[:] = pattern
            host, dev = await c.register_host(fd, size), await c.alloc_device(size)
            punch_hole(fd, hole.start, hole.stop - hole.start)
            assert not mine[hole].any()
            await c.copy(dev, host, priority="bulk")
            expected = pattern.copy()
            expected[hole] = 0
            assert dev.array is not None and np.array_equal(dev.array, expected)
            dev.array[:] = 7
            await c.copy(host, dev, priority="urgent")
            assert (mine == 7).all()
            del mine
        finally:
            view.close()
            os.close(fd)
        await c.ping()
    assert daemon.proc.poll() is None


# -- copies ------------------------------------------------------------------------------------


async def test_copy_within_one_region_may_not_overlap(daemon: DaemonProcess) -> None:
    """A copy whose source and destination ranges overlap in one region is refused with
    `bad_request` (it used to report ok and leave bytes unlike memmove's); ranges that only
    touch are copied."""
    async with priod.connect(daemon.socket_path, copy_path="daemon") as c:
        dev = await c.alloc_device(MiB)
        assert dev.array is not None
        pattern = np.random.default_rng(3).integers(0, 256, MiB, dtype=np.uint8)
        dev.array[:] = pattern
        n = 64 * 1024
        for dst_offset, src_offset in ((4096, 0), (0, 4096), (8192, 8192), (n - 1, 0)):
            with pytest.raises(
                priod.InvalidRequest,
                match=rf"^source bytes {src_offset}\.\.{src_offset + n} of region {dev.id} overlap destination bytes {dst_offset}\.\.{dst_offset + n} of region {dev.id}; ",
            ):
                await c.copy(dev, dev, n, dst_offset=dst_offset, src_offset=src_offset)
        assert np.array_equal(dev.array, pattern)  # nothing was copied
        await c.copy(dev, dev, n, dst_offset=n, src_offset=0)
        assert np.array_equal(dev.array[n : 2 * n], pattern[:n]) and np.array_equal(dev.array[:n], pattern[:n])


# -- status ------------------------------------------------------------------------------------


def test_status_shows_other_users_clients_only_to_root() -> None:
    """Any client may ask for status; it used to list every client's pid, uid and regions.
    Now a uid sees only its own connections (and the totals); root sees everyone."""
    with daemon_process(OPEN, socket_path=socket_path()) as d:
        path = d.socket_path
        with (
            priod.SyncClient(path, timeout=30, copy_path="daemon") as root,
            raw_as(NOBODY, path, 2) as (a, a2),
            raw_as(OTHER, path) as (b,),
        ):
            root.alloc_host(4096)
            a.ok("alloc_host", nbytes=8192)
            b.ok("alloc_device", nbytes=4096)
            for conn, uid, count in ((a, NOBODY, 2), (b, OTHER, 1)):
                st = conn.ok("status")["status"]
                assert {c["uid"] for c in st["clients"]} == {uid} and len(st["clients"]) == count, st["clients"]
                assert [u["uid"] for u in st["uids"]] == [uid]
                assert st["clients_total"] == 4
                assert st["holdings"]["regions"] == 3  # totals stay visible
            st = a2.ok("status")["status"]
            assert sorted(c["regions"] for c in st["clients"]) == [0, 1]
            st = root.status()
            assert sorted(c["uid"] for c in st["clients"]) == [0, OTHER, NOBODY, NOBODY]
            assert {u["uid"]: u["regions"] for u in st["uids"]} == {0: 1, NOBODY: 1, OTHER: 1}
    assert d.proc.returncode == 0, d.log()[-4000:]


# -- a client that never reads -----------------------------------------------------------------


def test_clients_that_never_read_cost_about_max_output_bytes_each() -> None:
    """Clients that flood requests and never read a reply: each costs the daemon about
    [server] max_output_bytes of memory (its buffered replies), not many times that (decoded
    requests waiting, and some 350 bytes of objects per queued 17-byte reply)."""
    clients, max_output = 10, MiB
    env = {**QUIET, "PRIOD_SERVER__MAX_OUTPUT_BYTES": str(max_output)}
    kinds = ({"op": "ping"}, {"op": "ping"}, {"op": "status"})
    flood = b"".join(encode({"id": i, **kinds[i % 3]}) for i in range(2, 120_002))
    with daemon_process(env) as d:
        time.sleep(0.5)
        before = memory_and_fds(d.proc.pid)["RssAnon"]
        socks = []
        try:
            for _ in range(clients):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(d.socket_path)
                s.sendall(encode({"id": 1, "op": "hello", "v": 2}))
                s.setblocking(False)
                sent, last = 0, time.monotonic()
                while sent < len(flood) and time.monotonic() - last < 0.3:  # until the daemon stops reading
                    try:
                        sent += s.send(flood[sent : sent + 65536])
                        last = time.monotonic()
                    except BlockingIOError:
                        time.sleep(0.005)
                socks.append(s)
            time.sleep(1.0)
            per_client = (memory_and_fds(d.proc.pid)["RssAnon"] - before) / clients
        finally:
            for s in socks:
                s.close()
    print(
        f"daemon anonymous RSS per non-reading client: {per_client:.2f} MiB (max_output_bytes {max_output / MiB:.0f} MiB)"
    )
    assert per_client <= max_output / MiB + 1.0


def test_a_uids_request_rate_is_capped_over_its_connections_and_others_are_not() -> None:
    """A uid that floods pings over two connections is read at [limits]
    max_requests_per_s_per_uid (plus its burst) together; every request is still answered (the
    cap slows, it never refuses); another uid's pings meanwhile are answered at once."""
    rate, burst, per_conn = 400, 40, 200
    env = {
        **OPEN,
        "PRIOD_LIMITS__MAX_REQUESTS_PER_S_PER_UID": str(rate),
        "PRIOD_LIMITS__REQUEST_BURST_PER_UID": str(burst),
    }
    with daemon_process(env, socket_path=socket_path()) as d, raw_as(NOBODY, d.socket_path, n=2) as flood:
        time.sleep(0.2)  # the bucket refills after the hellos
        t0 = time.monotonic()
        for c in flood:
            c.sock.sendall(b"".join(encode({"id": 1000 + i, "op": "ping"}) for i in range(per_conn)))
        with priod.SyncClient(d.socket_path, timeout=30, copy_path="daemon") as other:
            waits = []
            for _ in range(20):
                t = time.monotonic()
                other.ping()
                waits.append(time.monotonic() - t)
        replies = [c.frame() for c in flood for _ in range(per_conn)]
        elapsed = time.monotonic() - t0
    assert all(r["ok"] for r in replies), [r for r in replies if not r["ok"]][:3]
    assert sorted(r["id"] for r in replies) == sorted([1000 + i for i in range(per_conn)] * 2)
    floor = (2 * per_conn - burst) / rate  # 0.9 s at the cap
    assert elapsed >= 0.8 * floor, (
        f"{2 * per_conn} pings of one uid answered in {elapsed:.2f} s: faster than the cap allows ({floor:.2f} s)"
    )
    assert max(waits) < 0.25, f"another uid's pings waited up to {max(waits) * 1e3:.0f} ms behind the capped flood"


def test_another_uids_batches_cannot_touch_or_slow_an_honest_client() -> None:
    """copy_batch from a hostile uid: naming another uid's regions is refused; malformed,
    out-of-bounds, overflowing, overlapping and over-cap segment tables are refused with
    ``bad_request`` and the connection goes on; a pipelined flood of large valid batches on its
    own regions, never read, leaves root's batch and urgent copy correct and prompt."""
    from priod.wire.batch import MAX_SEGMENTS

    rng = np.random.default_rng(11)
    with (
        daemon_process(OPEN, socket_path=socket_path()) as d,
        priod.SyncClient(d.socket_path, timeout=30, copy_path="daemon") as honest,
    ):
        h, dv = honest.alloc_host(MiB), honest.alloc_device(MiB)
        assert h.array is not None and dv.array is not None
        with raw_as(NOBODY, d.socket_path) as (bad,):
            hid, did = (
                bad.ok("alloc_host", nbytes=64 * 1024)["region"],
                bad.ok("alloc_device", nbytes=64 * 1024)["region"],
            )

            def table(rows: list[tuple[int, int, int]]) -> bytes:
                return np.asarray(rows, dtype="<u8").tobytes()

            code, _ = bad.error("copy_batch", dst=dv.id, src=h.id, segments=table([(0, 0, 4096)]))
            assert code in ("not_found", "permission"), code
            for segments in (
                b"\x01" * 7,  # not whole triples
                table([(64 * 1024, 0, 1)]),  # past the region's end
                table([(2**63, 0, 16)]),  # offsets that overflow
                table([(0, 0, 0)]),  # an empty segment
                table([(0, 0, 4096), (1024, 8192, 4096)]),  # a destination byte written twice
                table([(16 * i % 65536, 0, 1) for i in range(MAX_SEGMENTS + 1)]),  # past the cap
            ):
                assert bad.error("copy_batch", dst=did, src=hid, segments=segments)[0] == "bad_request"
            bad.ok("ping")
            # A flood of valid batches at the segment cap on its own regions, sent and never read.
            flood = table([(16 * i, 16 * i, 16) for i in range(4096)])
            bad.sock.sendall(
                b"".join(
                    encode({"id": 5000 + i, "op": "copy_batch", "dst": did, "src": hid, "segments": flood})
                    for i in range(64)
                )
            )
            waits = []
            for _ in range(5):
                h.array[:] = rng.integers(0, 256, MiB, dtype=np.uint8)
                blocks = rng.choice(MiB // 4096, 64, replace=False) * 4096
                t = time.monotonic()
                honest.copy_batch(dv, h, [(int(b), int(b), 4096) for b in blocks], priority="urgent")
                honest.copy(dv, h, 65536, priority="urgent")
                waits.append(time.monotonic() - t)
                idx = np.concatenate([np.arange(b, b + 4096) for b in blocks] + [np.arange(65536)])
                assert np.array_equal(dv.array[idx], h.array[idx])
            assert max(waits) < 2.0, (
                f"root's urgent batch and copy took up to {max(waits):.2f} s beside another uid's batch flood"
            )
            replies = [bad.frame() for _ in range(64)]
            assert sorted(r["id"] for r in replies) == list(range(5000, 5064)) and all(r["ok"] for r in replies)


def test_copies_held_on_another_uids_events_hold_nothing_of_anyone_else() -> None:
    """wait_event from a hostile uid: an event naming another uid's region is refused; copies
    held on its own events that never complete (a pipeline of them) delay no one else's copy,
    and they go away with the connection."""
    from priod.wire.ipc_event import sim_handle

    with (
        daemon_process(OPEN, socket_path=socket_path()) as d,
        priod.SyncClient(d.socket_path, timeout=30, copy_path="daemon") as honest,
    ):
        h, dv = honest.alloc_host(MiB), honest.alloc_device(MiB)
        assert h.array is not None and dv.array is not None
        with raw_as(NOBODY, d.socket_path) as (bad,):
            hid, did = (
                bad.ok("alloc_host", nbytes=64 * 1024)["region"],
                bad.ok("alloc_device", nbytes=64 * 1024)["region"],
            )
            code, _ = bad.error("copy", dst=did, src=hid, nbytes=4096, wait_event=sim_handle(dv.id, 0))
            assert code in ("not_found", "permission"), code
            bad.sock.sendall(
                b"".join(
                    encode(
                        {
                            "id": 7000 + i,
                            "op": "copy",
                            "dst": did,
                            "src": hid,
                            "nbytes": 4096,
                            "priority": "urgent",
                            "wait_event": sim_handle(did, 60_000 + i),
                        }
                    )
                    for i in range(32)
                )
            )
            wait_until(
                lambda: root_status(d.socket_path)["held_copies"] == 32,
                timeout=10.0,
                what="32 copies held on events that never complete",
            )
            for _ in range(5):
                h.array[:] = np.random.default_rng().integers(0, 256, MiB, dtype=np.uint8)
                t = time.monotonic()
                honest.copy(dv, h, MiB, priority="urgent")
                assert time.monotonic() - t < 2.0
                assert np.array_equal(dv.array, h.array)
            assert not bad.pending(0.2), "a copy held on an event that never completed was answered"
        wait_until(
            lambda: root_status(d.socket_path)["held_copies"] == 0,
            timeout=10.0,
            what="the held copies dropped with their connection",
        )


def test_another_uids_hold_page_is_held_to_its_own_budget() -> None:
    """A hold page (direct urgent copies) of another uid whose copies never end, a new one
    announced every millisecond: root's bulk still moves (the other uid holds the lane for its
    hold budget and no more; without the budget, with aging off, root's copies would never
    start), the holds past it are cut, and root's own page still holds at once, since budgets
    are per uid. A hold_page request with an fd beside it is refused, the fd closed."""
    env = {**OPEN, "PRIOD_SCHEDULER__AGING_MS": "60000", "PRIOD_TUNING__DIRECT_HOLD_BURST_MS": "20"}
    path = socket_path()
    with daemon_process(env, socket_path=path) as d:
        raw = Raw(connect_as(NOBODY, path)[0])
        raw.hello()
        r, w = os.pipe()
        try:
            reply = raw.request("hold_page", fds=(r,))
        finally:
            os.close(r)
            os.close(w)
        assert not reply["ok"] and reply["error"]["code"] == "bad_request", reply
        raw.framed.send({"id": 99, "op": "hold_page"})
        msg, fds = raw.framed.receive()
        assert msg["ok"] and len(fds) == 1, msg
        theirs = HoldPage(fds[0], msg["lanes"])
        slots = [theirs.slot(ln["device_uuid"], ln["direction"], ln["device"]) for ln in theirs.lanes]
        stop = threading.Event()

        def renew() -> None:
            while not stop.is_set():
                for s in slots:
                    theirs.begin(s)
                time.sleep(0.001)

        attacker = threading.Thread(target=renew)
        attacker.start()
        try:
            with priod.SyncClient(path, copy_path="daemon") as root:
                host, dev = root.alloc_host(8 * MiB), root.alloc_device(8 * MiB)
                t0 = time.perf_counter()
                for _ in range(4):  # 32 MiB: 16 ms at the sim's 2 GB/s when nothing holds it
                    root.copy(dev, host, priority="bulk", timeout=10)
                assert time.perf_counter() - t0 < 5.0
                assert sum(root.status()["direct"]["cut"].values()) > 0  # the budget cut their holds
                stop.set()
                attacker.join()
                # Their last copies, never ended, may still hold a lane for direct_hold_max_ms
                # (5) where their budget has refilled a little since, and the lane's total for
                # all uids together (direct_hold_total_share) may be spent: wait those out.
                deadline = time.monotonic() + 5.0
                while time.monotonic() < deadline:
                    direct = root.status()["direct"]
                    if not direct["held"] and not direct["refused_lanes"]:
                        break
                    time.sleep(0.01)
                assert root.status()["direct"]["held"] == []
                mine = root.hold_page()
                slot = mine.slot(mine.lanes[0]["device_uuid"], mine.lanes[0]["direction"], mine.lanes[0]["device"])
                mine.begin(slot)
                assert root.status()["direct"]["held"] == [f"gpu0/{mine.lanes[0]['direction']}"]
                mine.end(slot)
                mine.close()
        finally:
            stop.set()
            attacker.join()
            theirs.close()
            raw.sock.close()
        assert d.proc.poll() is None


@contextlib.contextmanager
def open_ring(raw: Raw) -> Iterator[tuple[memoryview, int]]:
    """Ask for ``raw``'s copy ring by hand: a view of its mapping and its doorbell (its wake-up
    eventfd is not watched); on the way out all are let go and ``raw``'s connection closed."""
    raw.framed.send({"id": 90, "op": "ring"})
    msg, fds = raw.framed.receive()
    assert msg["ok"] and len(fds) == 3, msg
    memfd, doorbell, wake = fds
    ring = mmap.mmap(memfd, os.fstat(memfd).st_size)
    os.close(memfd)
    buf = memoryview(ring)
    try:
        yield buf, doorbell
    finally:
        buf.release()
        ring.close()
        os.close(doorbell)
        os.close(wake)
        raw.framed.close()


def test_another_uids_hostile_copy_ring_harms_no_copy_of_root() -> None:
    """A connection of another uid opens a copy ring and turns on it: its doorbell rung without
    pause, a thousand descriptors naming a region that is not its own (each refused by id on its
    socket, which it never reads), then a tail far ahead. Meanwhile root's copies on its own
    ring land byte-exact and stay quick; the other uid's connection alone is closed, saying why."""
    from priod.wire.ring import DESCRIPTOR, HEADER_BYTES, RING_ENTRIES, SQ_TAIL, check_header, ring_supported

    if not ring_supported():
        pytest.skip("the copy ring is x86-64 only")
    path = socket_path()
    with daemon_process(OPEN, socket_path=path) as d:
        raw = Raw(connect_as(NOBODY, path)[0])
        raw.hello()
        with open_ring(raw) as (buf, doorbell):
            assert check_header(buf) == RING_ENTRIES
            stop = threading.Event()

            def flood() -> None:
                while not stop.is_set():
                    os.eventfd_write(doorbell, 1)

            flooder = threading.Thread(target=flood)
            try:
                with priod.SyncClient(path, copy_path="daemon") as root:
                    host, dev = root.alloc_host(MiB), root.alloc_device(MiB)
                    assert host.array is not None and dev.array is not None
                    host.array[:] = np.random.default_rng(3).integers(0, 256, MiB, dtype=np.uint8)
                    t0 = time.perf_counter()
                    for _ in range(20):
                        root.copy(dev, host, 64 << 10)
                    alone = time.perf_counter() - t0
                    flooder.start()
                    for i in range(1000):  # root's regions by id, from another uid: refused, never queued
                        DESCRIPTOR.pack_into(
                            buf, HEADER_BYTES + i * DESCRIPTOR.size, i, 100 + i, dev.id, host.id, 0, 0, 64, 0.0, 0, 0
                        )
                    buf.cast("Q")[SQ_TAIL // 8] = 1000
                    t0 = time.perf_counter()
                    for _ in range(20):
                        root.copy(dev, host, 64 << 10)
                    beside = time.perf_counter() - t0
                    buf.cast("Q")[SQ_TAIL // 8] = 10 * RING_ENTRIES  # then a tail far ahead: closed
                    root.copy(dev, host)
                    assert np.array_equal(dev.array, host.array)
                    assert root.status()["clients_total"] >= 1
                stop.set()
                flooder.join()
                replies = []
                while True:  # its refusals, then the error that closed it
                    try:
                        replies.append(raw.framed.receive()[0])
                    except priod.ConnectionClosed:
                        break
                assert all(r["ok"] is False for r in replies) and replies, replies[:3]
                assert {r["error"]["code"] for r in replies[:-1]} <= {"not_found", "permission"}, replies[:3]
                assert replies[-1]["id"] == 0 and "copy ring" in replies[-1]["error"]["message"], replies[-1]
            finally:
                stop.set()
                if flooder.is_alive():
                    flooder.join()
        assert d.proc.poll() is None
    assert beside < 10 * alone + 0.5, (alone, beside)


def test_another_uids_landed_words_reach_its_own_ring_only() -> None:
    """Another uid's ring asks for landed words with junk flag bits beside the flag, on a refused
    descriptor too, then closes with its copies in flight. Its valid copies' words reach its own
    ring and the refused one's never does; root's urgent copies, meanwhile, land byte-exact and are
    answered from words in root's ring, which holds no one else's; the daemon lets the closed
    ring go once its copies end and serves on."""
    from priod.wire.ring import (
        DESCRIPTOR,
        HAS_DEADLINE,
        HEADER_BYTES,
        RING_ENTRIES,
        SQ_TAIL,
        WANT_LANDED,
        LandedReader,
        check_header,
        ring_supported,
    )

    if not ring_supported():
        pytest.skip("the copy ring is x86-64 only")
    path = socket_path()
    slow = {**OPEN, "PRIOD_SIM__H2D_GBPS": "0.2"}  # 1 MiB: about 5 ms
    with daemon_process(slow, socket_path=path) as d:
        raw = Raw(connect_as(NOBODY, path)[0])
        raw.hello()
        dev_id = raw.ok("alloc_device", nbytes=MiB)["region"]
        src_id = raw.ok("alloc_host", nbytes=MiB)["region"]
        with open_ring(raw) as (buf, doorbell):
            theirs = LandedReader(buf, check_header(buf))
            words = buf.cast("Q")

            def publish(first: int, n: int) -> None:
                for i in range(first, first + n):
                    # Descriptor 0 names a negative deadline: refused by id, so no word is stored.
                    flags = WANT_LANDED | 0xF0 | (HAS_DEADLINE if i == 0 else 0)
                    DESCRIPTOR.pack_into(
                        buf, HEADER_BYTES + i * DESCRIPTOR.size, i, 100 + i, dev_id, src_id, 0, 0, MiB, -1.0, 0, flags
                    )
                words[SQ_TAIL // 8] = first + n
                os.eventfd_write(doorbell, 1)

            try:
                publish(0, 16)
                wait_until(
                    lambda: all(theirs.landed(i) for i in range(1, 16)) or None, 10, "the other uid's landed words"
                )
                assert not theirs.landed(0)
                with priod.SyncClient(path, copy_path="daemon") as root:
                    host, dev = root.alloc_host(64 << 10), root.alloc_device(64 << 10)
                    assert host.array is not None and dev.array is not None
                    publish(16, 16)
                    raw.framed.close()  # gone, its copies in flight with their stores queued
                    for i in range(20):
                        host.array[:] = i
                        root.copy(dev, host, priority="urgent")
                        assert (dev.array == i).all()
                    assert root.landed_replies == 20
                    mine = root._ring
                    assert mine is not None
                    root_words = LandedReader(mine._buf, RING_ENTRIES)
                    try:
                        assert all(root_words.landed(i) for i in range(20))
                    finally:
                        root_words.release()
                    wait_until(
                        lambda: root.status()["clients_total"] == 1 or None, 10, "the other uid's connection gone"
                    )
            finally:
                theirs.release()
                words.release()
        assert d.proc.poll() is None
