"""Access control with real users: who may connect (socket mode, [server] allow_uids /
allow_gids checked with SO_PEERCRED), and whose regions and copies a connection may touch.

Each "user" is a forked child of this (root) test process that drops to its own uid and gid
before it connects, so the daemon sees a different peer uid exactly as it would in production.
The children are forked rather than exec'd because the interpreter may live where an
unprivileged user cannot read it (pyenv under /root); everything they need is imported here
first.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import multiprocessing.connection
import os
import stat
import tempfile
import traceback
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import priod
from priod.client.client import Client, CopyHandle, Region
from priod.testing import DaemonProcess, daemon_process
from priod.wire.messages import RegionReply

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root to run clients as other uids (setuid); CI runs the suite as root"
)

NOBODY = 65534  # allowed by [server] allow_uids
OTHER = 65533  # allowed by [server] allow_gids (its gid)
STRANGER = 65532  # neither: refused at connect
MiB = 1 << 20


def _user_main(conn: multiprocessing.connection.Connection, uid: int, gid: int) -> None:
    """The child: become ``uid``/``gid``, then run requests from the test until told to stop."""
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    asyncio.run(_serve_commands(conn))


async def _serve_commands(conn: multiprocessing.connection.Connection) -> None:
    loop = asyncio.get_running_loop()
    client: Client | None = None
    regions: dict[int, Region] = {}
    handles: dict[int, CopyHandle] = {}

    def region(rid: int, kind: str = "host", nbytes: int = MiB) -> Region:
        # A region id of someone else's is only a number: forge the handle a hostile client would.
        assert client is not None
        return regions.get(rid) or Region(RegionReply(rid, nbytes, kind), [], client.generation)

    async def receive() -> tuple[str, tuple[Any, ...]]:
        # Wait on the pipe with the loop itself: no worker thread, nothing imported lazily
        # (this process may no longer be able to read the interpreter's files).
        ready: asyncio.Future[None] = loop.create_future()

        def on_readable() -> None:
            if not ready.done():
                ready.set_result(None)

        loop.add_reader(conn.fileno(), on_readable)
        try:
            await ready
        finally:
            loop.remove_reader(conn.fileno())
        op, args = conn.recv()
        return op, args

    while True:
        op, args = await receive()
        try:
            value: Any = None
            if op == "connect":
                client = await Client.connect(args[0], name=f"uid{os.getuid()}")
                value = client.server.peer
            elif op == "exit":
                if client is not None:
                    await client.close()
                conn.send(("ok", None))
                return
            else:
                assert client is not None
                if op in ("alloc_host", "alloc_device"):
                    r = await getattr(client, op)(args[0])
                    regions[r.id] = r
                    value = r.id
                elif op == "fill":
                    arr = regions[args[0]].array
                    assert arr is not None
                    arr[:] = args[1]
                    value = None
                elif op == "values":
                    arr = regions[args[0]].array
                    assert arr is not None
                    value = sorted(int(v) for v in np.unique(arr))
                elif op == "copy":
                    dst, src, nbytes = args
                    value = (await client.copy(region(dst[0], dst[1]), region(src[0], src[1]), nbytes)).nbytes
                elif op == "start_copy":
                    dst, src, nbytes = args
                    h = client.start_copy(region(dst[0], dst[1]), region(src[0], src[1]), nbytes, priority="bulk")
                    handles[h.id] = h
                    value = h.id
                elif op == "wait":
                    value = (await handles.pop(args[0])).nbytes
                elif op == "cancel_id":
                    # CopyHandle.cancel() only names this connection's copies; send the raw op.
                    value = (await client.raw_request({"op": "cancel", "target": args[0]}))["state"]
                elif op == "free":
                    await client.free(region(args[0]))
                elif op == "share":
                    await client.share(region(args[0]), args[1])
                else:
                    raise AssertionError(f"unknown op {op}")
            conn.send(("ok", value))
        except priod.PriodError as exc:
            conn.send(("err", type(exc).__name__, str(exc)))
        except OSError as exc:
            conn.send(("oserror", exc.errno, exc.strerror))
        except Exception as exc:
            conn.send(("bug", type(exc).__name__, traceback.format_exc()))


class User:
    """A client running as another uid, driven one request at a time from the test."""

    def __init__(self, uid: int, gid: int | None = None) -> None:
        self.uid = uid
        ctx = multiprocessing.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_user_main, args=(child, uid, uid if gid is None else gid), daemon=True)
        self.proc.start()
        child.close()

    def __call__(self, op: str, *args: Any) -> Any:
        """Run ``op``; returns its value or raises the priod error the client raised."""
        self.conn.send((op, args))
        if not self.conn.poll(60):
            raise AssertionError(f"uid {self.uid}: no answer to {op}{args} within 60 s")
        kind, *rest = self.conn.recv()
        if kind == "ok":
            return rest[0]
        if kind == "err":
            raise getattr(priod, rest[0])(rest[1])
        if kind == "oserror":
            raise OSError(*rest)
        raise AssertionError(f"uid {self.uid}: {op}{args} failed: {rest[1]}")

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self("exit")
            except (AssertionError, OSError, EOFError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        self.conn.close()


@pytest.fixture
def users() -> Iterator[dict[int, User]]:
    """Started on demand: ``users[uid]`` (gid = uid); all stopped after the test."""
    started: dict[int, User] = {}

    class Users(dict[int, User]):
        def __missing__(self, uid: int) -> User:
            started[uid] = self[uid] = User(uid)
            return started[uid]

    yield Users()
    for u in started.values():
        u.close()


def shared_socket_dir() -> str:
    d = tempfile.mkdtemp(prefix="priod-access-")
    os.chmod(d, 0o755)  # other users must reach the socket inside
    return d


@pytest.fixture(scope="module")
def open_daemon() -> Iterator[DaemonProcess]:
    """A daemon whose socket anyone may open (0666); who gets in is up to the allow-lists.
    A slow h2d link keeps bulk copies pending long enough to be named by others."""
    env = {
        "PRIOD_SERVER__SOCKET_MODE": "0o666",
        "PRIOD_SERVER__ALLOW_UIDS": f"[{NOBODY}]",
        "PRIOD_SERVER__ALLOW_GIDS": f"[{OTHER}]",
        "PRIOD_SIM__H2D_GBPS": "0.064",
        "PRIOD_TUNING__MIN_CHUNK_BYTES": "65536",
    }
    with daemon_process(env, socket_path=os.path.join(shared_socket_dir(), "priod.sock")) as d:
        yield d
    assert d.proc.returncode == 0, d.log()[-4000:]


def test_allow_lists_admit_by_uid_or_gid_and_refuse_others(open_daemon: DaemonProcess, users: dict[int, User]) -> None:
    """SO_PEERCRED decides: a uid in allow_uids and a gid in allow_gids get in, uid 0 always
    does, and any other uid is refused at connect with PermissionDenied saying what to change."""
    assert stat.S_IMODE(os.stat(open_daemon.socket_path).st_mode) == 0o666
    assert users[NOBODY]("connect", open_daemon.socket_path) == {
        "pid": users[NOBODY].proc.pid,
        "uid": NOBODY,
        "gid": NOBODY,
    }
    assert users[OTHER]("connect", open_daemon.socket_path)["uid"] == OTHER
    with pytest.raises(
        priod.PermissionDenied,
        match=rf"^uid {STRANGER} \(gid {STRANGER}\) may not use this daemon; an administrator can add it to \[server\] allow_uids or allow_gids$",
    ):
        users[STRANGER]("connect", open_daemon.socket_path)
    with priod.SyncClient(open_daemon.socket_path, timeout=30) as root:
        assert root.server.peer["uid"] == 0
    refused = [r for r in open_daemon.log_records() if r.get("event") == "connection_refused"]
    assert len(refused) == 1 and refused[0]["uid"] == STRANGER


def test_regions_and_copies_are_private_to_their_connection(open_daemon: DaemonProcess, users: dict[int, User]) -> None:
    """Another user cannot read, write, free or share a region it was not given, nor cancel
    someone else's copy; neither can a second connection of the same uid."""
    a, b = users[NOBODY], users[OTHER]
    a("connect", open_daemon.socket_path)
    b("connect", open_daemon.socket_path)
    ah, ad = a("alloc_host", MiB), a("alloc_device", MiB)
    bh, bd = b("alloc_host", MiB), b("alloc_device", MiB)
    a("fill", ah, 42)
    pending = [a("start_copy", (ad, "device"), (ah, "host"), MiB) for _ in range(4)]  # ~16 ms each
    not_shared = rf"^region {{}} belongs to another client and is not shared with uid {OTHER}$"
    with pytest.raises(priod.PermissionDenied, match=not_shared.format(ah)):
        b("copy", (bd, "device"), (ah, "host"), MiB)  # read A's memory
    with pytest.raises(priod.PermissionDenied, match=not_shared.format(ad)):
        b("copy", (ad, "device"), (bh, "host"), MiB)  # write A's memory
    not_owner = r"^region {} belongs to another connection; only its owner may free or share it$"
    with pytest.raises(priod.PermissionDenied, match=not_owner.format(ah)):
        b("free", ah)
    with pytest.raises(priod.PermissionDenied, match=not_owner.format(ad)):
        b("share", ad, OTHER)
    for target in pending:
        with pytest.raises(
            priod.NotFound,
            match=rf"^no copy with id {target} is pending on this connection; it may have finished already$",
        ):
            b("cancel_id", target)
    with pytest.raises(
        priod.NotFound, match=r"^no region 999999; use an id returned by alloc_host, alloc_device or register_\*$"
    ):
        b("copy", (999999, "device"), (bh, "host"), MiB)
    assert [a("wait", h) for h in pending] == [MiB] * 4  # none was cancelled
    assert b("values", bd) == [0]  # nothing of A's reached B

    a2 = User(NOBODY)  # the same uid on another connection is another owner
    try:
        a2("connect", open_daemon.socket_path)
        with pytest.raises(
            priod.PermissionDenied,
            match=rf"^region {ad} belongs to another client and is not shared with uid {NOBODY}$",
        ):
            a2("copy", (ad, "device"), (ah, "host"), MiB)
        with pytest.raises(priod.PermissionDenied, match=not_owner.format(ah)):
            a2("free", ah)
    finally:
        a2.close()
    a("free", ah)  # the owner still can


def test_share_lets_a_uid_copy_to_and_from_but_not_free_or_share(
    open_daemon: DaemonProcess, users: dict[int, User]
) -> None:
    """After share(region, uid) connections of that uid may name the region in copies both
    ways, but still not free or re-share it; when the owner leaves, their queued copies that
    name it end with NotFound and their connection carries on."""
    a, b = users[NOBODY], users[OTHER]
    a("connect", open_daemon.socket_path)
    b("connect", open_daemon.socket_path)
    ah, ad = a("alloc_host", MiB), a("alloc_device", MiB)
    bh, bd = b("alloc_host", MiB), b("alloc_device", MiB)
    a("share", ah, OTHER)
    a("share", ad, OTHER)
    a("fill", ah, 42)
    b("fill", bh, 7)
    assert b("copy", (bd, "device"), (ah, "host"), MiB) == MiB  # read from A's host region
    assert b("values", bd) == [42]
    assert b("copy", (ad, "device"), (bh, "host"), MiB) == MiB  # write into A's device region
    assert a("values", ah) == [42]
    assert a("copy", (ah, "host"), (ad, "device"), MiB) == MiB
    assert a("values", ah) == [7]
    owner_only = r"^region {} belongs to another connection; only its owner may free or share it$"
    with pytest.raises(priod.PermissionDenied, match=owner_only.format(ah)):
        b("free", ah)
    with pytest.raises(priod.PermissionDenied, match=owner_only.format(ad)):
        b("share", ad, STRANGER)
    with priod.SyncClient(open_daemon.socket_path, timeout=30) as root:  # shared with OTHER only
        forged = Region(RegionReply(ah, MiB, "host"), [], 1)
        with pytest.raises(
            priod.PermissionDenied, match=rf"^region {ah} belongs to another client and is not shared with uid 0$"
        ):
            root.copy(forged, forged, MiB)

    queued = [b("start_copy", (ad, "device"), (bh, "host"), MiB) for _ in range(8)]  # ~0.5 s
    a("exit")  # the owner leaves: its regions go, copies naming them stop
    got = []
    for h in queued:
        try:
            got.append(b("wait", h))
        except priod.NotFound as exc:
            assert str(exc).startswith("a region this copy names was freed by its owner after ")
            got.append("NotFound")
    assert got[-1] == "NotFound" and set(got) <= {MiB, "NotFound"}
    assert b("copy", (bd, "device"), (bh, "host"), MiB) == MiB


def test_default_socket_mode_keeps_other_users_out(users: dict[int, User]) -> None:
    """When priod binds the socket itself it applies [server] socket_mode, 0660 by default: a
    user outside the socket's group cannot even connect."""
    with daemon_process(socket_path=os.path.join(shared_socket_dir(), "priod.sock")) as d:
        st = os.stat(d.socket_path)
        assert stat.S_IMODE(st.st_mode) == 0o660 and (st.st_uid, st.st_gid) == (0, 0)
        with pytest.raises(
            priod.PermissionDenied,
            match=r"^cannot connect to .*: permission denied by the socket's mode; ask an administrator",
        ):
            users[NOBODY]("connect", d.socket_path)
