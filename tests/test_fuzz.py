"""Bad input, fuzzed: hypothesis drives the frame decoder and a live daemon with random
and mutated frames. The daemon must answer every bad request with a well-formed error (never an
``internal`` one), close only the offending connection on a broken stream, leak no fd that came
with a frame where none belonged, and keep serving a well-behaved client correct copies after
every case.

Example counts are modest so the file runs in a few seconds; ``PRIOD_FUZZ_SCALE=40`` multiplies
them all by 40 for a longer campaign.
"""

from __future__ import annotations

import collections
import fcntl
import itertools
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import priod
import priod.wire.transport
from priod.errors import ProtocolError
from priod.testing import DaemonProcess, daemon_process
from priod.wire.frames import HEADER, OPS, FrameDecoder, encode
from priod.wire.transport import MAX_FDS_PER_FRAME

SCALE = max(1, int(os.environ.get("PRIOD_FUZZ_SCALE", "1")))
FAST = settings(
    max_examples=150 * SCALE, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
LIVE = settings(
    max_examples=120 * SCALE,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

ERROR_CODES = {"bad_frame", "bad_request", "not_found", "permission", "limit", "cancelled", "engine", "shutting_down"}
"""Every code a bad request may get. ``internal`` (an unexpected exception in the daemon) is a bug."""

# -- values ----------------------------------------------------------------------------------

EDGE_INTS = [0, -1, 1, 4095, 4096, 65535, 65536, 2**31, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)]
INTS = st.one_of(st.integers(-(2**63), 2**64 - 1), st.sampled_from(EDGE_INTS), st.integers(-8, 70_000))
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    INTS,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.binary(max_size=12),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
REGION_REFS = st.sampled_from(["$own_host", "$own_dev", "$victim_host", "$victim_dev", "$victim_canary"])
"""Placeholders, replaced at send time by the ids the daemon gave (the attacker's own, or another client's)."""
SIZES = st.one_of(st.integers(-8, 70_000), st.sampled_from(EDGE_INTS))
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "dst": st.one_of(REGION_REFS, INTS, VALUES),
    "src": st.one_of(REGION_REFS, INTS, VALUES),
    "region": st.one_of(REGION_REFS, INTS, VALUES),
    "nbytes": st.one_of(SIZES, VALUES),
    "dst_offset": st.one_of(SIZES, VALUES),
    "src_offset": st.one_of(SIZES, VALUES),
    "offset": st.one_of(SIZES, VALUES),
    "priority": st.one_of(st.sampled_from(["urgent", "high", "normal", "bulk", "", "URGENT", "vip"]), VALUES),
    "deadline_ms": st.one_of(st.floats(allow_nan=True, allow_infinity=True), INTS, VALUES),
    "target": st.one_of(st.integers(0, 50), INTS, VALUES),
    "uid": st.one_of(INTS, VALUES),
    "device": st.one_of(st.integers(-2, 3), INTS, VALUES),
    "v": st.one_of(st.just(1), INTS, VALUES),
    "client": st.one_of(st.text(max_size=80), VALUES),
    "handle": st.one_of(st.binary(max_size=80), VALUES),
}
OP_VALUES = st.one_of(st.sampled_from(sorted(OPS)), st.text(max_size=10), VALUES)
IDS = st.one_of(st.integers(1, 60), st.sampled_from([0, -1, 2**63 - 1, 2**63, 2**64 - 1]), VALUES)


@st.composite
def requests(draw: st.DrawFn) -> dict[str, Any]:
    """A request map: usually a real op with some of its fields, each of a random type or value."""
    msg: dict[str, Any] = {}
    if draw(st.integers(0, 9)):
        msg["id"] = draw(IDS)
    if draw(st.integers(0, 9)):
        msg["op"] = draw(OP_VALUES)
    for key in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=6, unique=True)):
        msg[key] = draw(FIELDS[key])
    if draw(st.integers(0, 5)) == 0:
        msg[draw(st.text(max_size=8))] = draw(VALUES)
    return msg


@st.composite
def near_valid(draw: st.DrawFn) -> dict[str, Any]:
    """A request that mostly passes the checks, so the deeper paths run: copies between real
    regions (one's own or another client's) with odd sizes, offsets and deadlines, cancels,
    frees while copies are queued, shares, allocations."""
    op = draw(
        st.sampled_from(["copy"] * 5 + ["cancel", "free", "share", "status", "ping", "alloc_host", "alloc_device"])
    )
    msg: dict[str, Any] = {"id": draw(st.integers(4, 40)), "op": op}
    refs = st.sampled_from(["$own_host", "$own_dev"] * 4 + ["$victim_host", "$victim_dev", "$victim_canary"])
    small = st.one_of(st.integers(1, 4096), st.integers(0, 9000), SIZES)
    if op == "copy":
        msg.update(dst=draw(refs), src=draw(refs), nbytes=draw(small), dst_offset=draw(small), src_offset=draw(small))
        msg["priority"] = draw(st.sampled_from(["urgent", "high", "normal", "bulk"]))
        if draw(st.booleans()):
            msg["deadline_ms"] = draw(
                st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10, 10**6), st.none())
            )
    elif op == "cancel":
        msg["target"] = draw(st.integers(1, 40))
    elif op in ("free", "share"):
        msg["region"] = draw(refs)
        if op == "share":
            msg["uid"] = draw(st.one_of(st.just(os.getuid()), INTS))
    elif op.startswith("alloc"):
        msg["nbytes"] = draw(st.one_of(st.integers(1, 1 << 20), SIZES))
        if op == "alloc_device":
            msg["device"] = draw(st.integers(-1, 2))
    return msg


def _pack(value: Any) -> bytes:
    body: bytes = msgpack.packb(value, use_bin_type=True)
    return body


@st.composite
def actions(draw: st.DrawFn) -> tuple[str, Any]:
    """One thing the attacker sends; see `send_action`."""
    kind = draw(
        st.sampled_from(
            ["valid", "valid", "valid", "frame", "frame", "mutated", "raw", "truncated", "oversize", "non_map", "fds"]
        )
    )
    if kind == "valid":
        return "frame", draw(near_valid())
    if kind == "frame":
        return kind, draw(requests())
    if kind == "mutated":
        frame = encode(draw(requests()))
        flips = draw(st.lists(st.tuples(st.integers(0, len(frame) - 1), st.integers(0, 255)), min_size=1, max_size=4))
        cut = draw(st.one_of(st.none(), st.integers(0, len(frame))))
        return kind, (frame, flips, cut)
    if kind == "raw":
        return kind, draw(st.binary(min_size=1, max_size=64))
    if kind == "truncated":
        frame = encode(draw(requests()))
        return kind, frame[: draw(st.integers(1, len(frame) - 1))]
    if kind == "oversize":
        return kind, HEADER.pack(draw(st.integers((1 << 20) + 1, 2**32 - 1))) + draw(st.binary(max_size=16))
    if kind == "non_map":
        return kind, draw(st.one_of(SCALARS, st.lists(VALUES, max_size=3)))
    fd_kind = draw(st.sampled_from(["memfd", "sealed_memfd", "pipe", "devnull"]))
    count = draw(st.integers(1, MAX_FDS_PER_FRAME + 2))
    return kind, (draw(requests()), fd_kind, count)


# -- the decoder -----------------------------------------------------------------------------


def _feed_all(decoder: FrameDecoder, chunks: list[bytes]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for chunk in chunks:
        out += decoder.feed(chunk)
    return out


@FAST
@given(st.lists(st.binary(max_size=300), max_size=8))
def test_decoder_takes_any_bytes(chunks: list[bytes]) -> None:
    """Any byte stream, fed in any pieces, yields maps or raises ProtocolError; nothing else, and
    the decoder never holds more than one frame's worth of bytes."""
    decoder = FrameDecoder(max_frame=4096)
    try:
        msgs = _feed_all(decoder, chunks)
    except ProtocolError:
        return
    assert all(isinstance(m, dict) for m in msgs)
    assert decoder.buffered <= 4096 + HEADER.size


@settings(FAST, max_examples=60 * SCALE)
@given(st.lists(requests(), min_size=1, max_size=3), st.lists(st.integers(0, 2000), max_size=6))
def test_decoder_round_trips_any_split(msgs: list[dict[str, Any]], cuts: list[int]) -> None:
    """Valid frames split at arbitrary points decode to the same messages, in order, once each
    (compared re-encoded, so a NaN equals itself)."""
    stream = b"".join(encode(m) for m in msgs)
    points = sorted({min(c, len(stream)) for c in cuts} | {0, len(stream)})
    chunks = [stream[a:b] for a, b in itertools.pairwise(points)]
    got = _feed_all(FrameDecoder(max_frame=1 << 20), chunks)
    assert [encode(m) for m in got] == [encode(m) for m in msgs]


@FAST
@given(
    requests(),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=6),
    st.integers(1, 64),
)
def test_decoder_mutated_frames(msg: dict[str, Any], flips: list[tuple[int, int]], step: int) -> None:
    """A valid frame with bytes overwritten, fed a few bytes at a time: maps or ProtocolError only."""
    frame = bytearray(encode(msg))
    for pos, value in flips:
        frame[pos % len(frame)] = value
    decoder = FrameDecoder(max_frame=1 << 16)
    try:
        msgs = _feed_all(decoder, [bytes(frame[i : i + step]) for i in range(0, len(frame), step)])
    except ProtocolError:
        return
    assert all(isinstance(m, dict) for m in msgs)


@FAST
@given(st.integers(4097, 2**32 - 1), st.binary(max_size=64))
def test_decoder_refuses_oversize_from_the_header(length: int, tail: bytes) -> None:
    """A header announcing more than max_frame bytes is refused before any of the body is kept."""
    decoder = FrameDecoder(max_frame=4096)
    with pytest.raises(
        ProtocolError,
        match=rf"^frame of {length} bytes exceeds max_frame_bytes=4096; requests name memory regions and never carry data, so keep frames small$",
    ):
        decoder.feed(HEADER.pack(length) + tail)


# -- the live daemon -------------------------------------------------------------------------

LIVE_ENV = {
    "PRIOD_LOG__LEVEL": '"error"',
    # Small limits keep whatever a fuzzed request asks for cheap; the checks are the same.
    "PRIOD_LIMITS__MAX_PINNED_BYTES": str(64 << 20),
    "PRIOD_LIMITS__MAX_DEVICE_BYTES": str(64 << 20),
    "PRIOD_LIMITS__MAX_REGIONS": "8",
}


@pytest.fixture(scope="module")
def target() -> Iterator[DaemonProcess]:
    """The daemon under attack, in its own process."""
    with daemon_process(LIVE_ENV) as d:
        yield d
    assert d.proc.returncode == 0, d.log()[-4000:]


class WellBehaved:
    """A SyncClient with regions another client will try to name, and a canary nobody may touch."""

    def __init__(self, path: str) -> None:
        self.c = priod.SyncClient(path, name="well-behaved", timeout=30, copy_path="daemon")
        self.host = self.c.alloc_host(65536)
        self.dev = self.c.alloc_device(65536)
        self.canary = self.c.alloc_device(4096)
        assert self.canary.array is not None
        self.canary.array[:] = np.arange(4096, dtype=np.uint16).astype(np.uint8)
        self.canary_bytes = self.canary.array.copy()
        self.n = 0

    def ids(self) -> dict[str, int]:
        return {"$victim_host": self.host.id, "$victim_dev": self.dev.id, "$victim_canary": self.canary.id}

    def check(self) -> None:
        """One correct copy, checked byte for byte, and the canary untouched."""
        assert self.host.array is not None and self.dev.array is not None and self.canary.array is not None
        self.n += 1
        data = np.random.default_rng(self.n).integers(0, 256, 65536, dtype=np.uint8)
        self.host.array[:] = data
        r = self.c.copy(self.dev, self.host, priority=["urgent", "bulk"][self.n % 2])
        assert r.nbytes == 65536 and np.array_equal(self.dev.array, data)
        assert np.array_equal(self.canary.array, self.canary_bytes), (
            "another client's requests changed this client's region"
        )

    def close(self) -> None:
        self.c.close()


def _make_fds(kind: str, count: int) -> list[int]:
    fds: list[int] = []
    for _ in range(count):
        if kind == "pipe":
            r, w = os.pipe()
            os.close(w)
            fds.append(r)
        elif kind == "devnull":
            fds.append(os.open(os.devnull, os.O_RDONLY))
        else:
            fd = os.memfd_create("fuzz", os.MFD_ALLOW_SEALING)
            os.ftruncate(fd, 4096)
            if kind == "sealed_memfd":
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
            fds.append(fd)
    return fds


def _resolve(value: Any, ids: dict[str, int]) -> Any:
    if isinstance(value, str) and value in ids:
        return ids[value]
    return value


def send_action(sock: socket.socket, action: tuple[str, Any], ids: dict[str, int]) -> None:
    kind, arg = action
    if kind == "frame":
        sock.sendall(encode({k: _resolve(v, ids) for k, v in arg.items()}))
    elif kind == "mutated":
        frame, flips, cut = arg
        data = bytearray(frame)
        for pos, value in flips:
            data[pos] = value
        sock.sendall(bytes(data[:cut] if cut is not None else data))
    elif kind in ("raw", "truncated", "oversize"):
        sock.sendall(arg)
    elif kind == "non_map":
        body = _pack(arg)
        sock.sendall(HEADER.pack(len(body)) + body)
    else:
        msg, fd_kind, count = arg
        frame = encode({k: _resolve(v, ids) for k, v in msg.items()})
        fds = _make_fds(fd_kind, count)
        try:
            sent = socket.send_fds(sock, [frame], fds)
            if sent < len(frame):
                sock.sendall(frame[sent:])
        finally:
            for fd in fds:
                os.close(fd)


def check_reply(msg: Any) -> None:
    """Every reply is a map with an id and ok; every error a known code and a message."""
    assert isinstance(msg, dict), msg
    assert type(msg.get("id")) is int and 0 <= msg["id"] < 2**63, msg
    assert isinstance(msg.get("ok"), bool), msg
    if not msg["ok"]:
        err = msg.get("error")
        assert isinstance(err, dict) and err.get("code") in ERROR_CODES, msg
        assert isinstance(err.get("message"), str) and err["message"], msg


def attack(
    path: str, greet: bool, setup: bool, acts: list[tuple[str, Any]], victim: dict[str, int], linger: bool = False
) -> list[dict[str, Any]]:
    """One attacker connection: maybe hello and own regions, then ``acts``; then end our side of
    the stream and read every reply until the daemon closes (a hang fails the test).

    With ``linger`` (and a stream still in step) it first waits for the reply to a last ping and
    a little more, so copies it started complete and are answered instead of being dropped."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(20)
    sock.connect(path)
    ids = dict(victim)
    decoder = FrameDecoder(max_frame=64 << 20)
    decoded: collections.deque[dict[str, Any]] = collections.deque()
    replies: list[dict[str, Any]] = []
    fds_back: list[int] = []

    def read_one() -> dict[str, Any]:
        while not decoded:
            data, anc, _, _ = sock.recvmsg(1 << 16, socket.CMSG_SPACE(16 * 4))
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds_back.extend(np.frombuffer(payload[: len(payload) - len(payload) % 4], dtype=np.int32).tolist())
            if not data:
                raise ConnectionError("closed")
            decoded.extend(decoder.feed(data))
        return decoded.popleft()

    try:
        if greet:
            sock.sendall(encode({"id": 1, "op": "hello", "v": 2}))
            assert read_one()["ok"]
            if setup:
                sock.sendall(encode({"id": 2, "op": "alloc_host", "nbytes": 8192}))
                r = read_one()
                sock.sendall(encode({"id": 3, "op": "alloc_device", "nbytes": 8192}))
                r2 = read_one()
                assert r["ok"] and r2["ok"], (r, r2)
                ids.update({"$own_host": r["region"], "$own_dev": r2["region"]})
        ids.setdefault("$own_host", 10**9)
        ids.setdefault("$own_dev", 10**9 + 1)
        broken = False
        for act in acts:
            try:
                send_action(sock, act, ids)
            except (BrokenPipeError, ConnectionResetError):
                broken = True
                break  # the daemon closed us for a broken stream: expected, it answered why
        if linger and not broken and all(kind in ("frame", "fds") for kind, _ in acts):
            sentinel = 1 << 40
            try:
                sock.sendall(encode({"id": sentinel, "op": "ping"}))
                while (r := read_one())["id"] != sentinel:
                    replies.append(r)
                replies.append(r)
                time.sleep(0.005)
            except (ConnectionError, ConnectionResetError, BrokenPipeError):
                pass  # closed for a protocol error (too many fds): its reply says so
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        while True:
            try:
                replies.append(read_one())
            except (ConnectionError, ConnectionResetError):
                break
    finally:
        for fd in fds_back:
            os.close(fd)
        sock.close()
    return replies


def daemon_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def wait_fds(pid: int, expected: int, timeout: float = 20.0) -> int:
    """Poll until the daemon holds no more than ``expected`` fds (connections close
    asynchronously; a baseline taken while an earlier connection's socket was still closing is
    one high, so fewer is no leak)."""
    deadline = time.monotonic() + timeout
    n = daemon_fds(pid)
    while n > expected and time.monotonic() < deadline:
        time.sleep(0.02)
        n = daemon_fds(pid)
    return n


def settled_fds(c: priod.SyncClient, pid: int, timeout: float = 20.0) -> int:
    """The daemon's fd count once ``c`` is its only client (the harness's readiness probe and
    earlier tests' connections close asynchronously)."""
    deadline = time.monotonic() + timeout
    while len(c.status()["clients"]) != 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    return daemon_fds(pid)


def test_live_daemon_survives_fuzzed_frames(target: DaemonProcess) -> None:
    """Random and mutated frames from raw connections: truncated, oversize lengths, garbage,
    non-maps, wrong types, unknown ops, huge or negative ids, offsets and sizes, other clients'
    regions, fds with frames that take none (memfds with 'copy', too many fds for one frame).
    Each reply is well-formed with a known error code; after each case a well-behaved client
    copies correctly and its regions are untouched; at the end the daemon holds no more fds
    than before."""
    good = WellBehaved(target.socket_path)
    pid = target.proc.pid
    base_fds = settled_fds(good.c, pid)
    tried = {"cases": 0, "actions": 0, "replies": 0, "errors": 0, "copies_done": 0}
    try:
        mostly = st.integers(0, 3).map(bool)

        @LIVE
        @given(mostly, mostly, st.lists(actions(), min_size=1, max_size=6), st.booleans())
        def case(greet: bool, setup: bool, acts: list[tuple[str, Any]], linger: bool) -> None:
            replies = attack(target.socket_path, greet, setup, acts, good.ids(), linger)
            for r in replies:
                check_reply(r)
            tried["cases"] += 1
            tried["actions"] += len(acts)
            tried["replies"] += len(replies)
            tried["errors"] += sum(1 for r in replies if not r["ok"])
            tried["copies_done"] += sum(1 for r in replies if r["ok"] and "nbytes" in r and "total_us" in r)
            assert target.proc.poll() is None, "the daemon died:\n" + target.log()[-4000:]
            good.check()

        case()
        assert wait_fds(pid, base_fds) <= base_fds
        st_ = good.c.status()
        assert [cl["regions"] for cl in st_["clients"]] == [3], "an attacker's regions outlived its connection"
    finally:
        good.close()
    print(f"fuzz: {tried}")


def test_live_daemon_survives_fuzzed_requests(target: DaemonProcess) -> None:
    """Well-framed requests that mostly pass the checks: copies between the attacker's regions
    and another client's with odd sizes, offsets and deadlines (NaN, infinite, negative),
    cancels, frees while copies are queued, shares, allocations at the limits. Every reply is
    well-formed, no error is 'internal', copies complete or are refused, and the well-behaved
    client's copies and canary stay correct after each case."""
    good = WellBehaved(target.socket_path)
    pid = target.proc.pid
    base_fds = settled_fds(good.c, pid)
    tried = {"cases": 0, "requests": 0, "ok": 0, "copies_done": 0}
    try:

        @LIVE
        @given(st.lists(near_valid(), min_size=1, max_size=8), st.booleans())
        def case(reqs: list[dict[str, Any]], linger: bool) -> None:
            replies = attack(target.socket_path, True, True, [("frame", r) for r in reqs], good.ids(), linger)
            for r in replies:
                check_reply(r)
            tried["cases"] += 1
            tried["requests"] += len(reqs)
            tried["ok"] += sum(1 for r in replies if r["ok"])
            tried["copies_done"] += sum(1 for r in replies if r["ok"] and "total_us" in r)
            assert target.proc.poll() is None, "the daemon died:\n" + target.log()[-4000:]
            good.check()

        case()
        assert wait_fds(pid, base_fds) <= base_fds
    finally:
        good.close()
    assert tried["copies_done"] > 0, tried
    print(f"fuzz: {tried}")


@settings(max_examples=40 * SCALE, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    op=st.sampled_from(sorted(OPS - {"register_host"})),
    count=st.integers(1, MAX_FDS_PER_FRAME),
    fd_kind=st.sampled_from(["memfd", "sealed_memfd", "pipe"]),
)
def test_fds_where_none_belong_are_refused_and_closed(target: DaemonProcess, op: str, count: int, fd_kind: str) -> None:
    """A memfd (or a pipe) sent with any frame but register_host is refused with a message saying
    it was closed, the connection goes on, and the daemon does not keep the fd."""
    pid = target.proc.pid
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(20)
    sock.connect(target.socket_path)
    try:
        framed = priod.wire.transport.BlockingFramedSocket(sock)
        framed.send({"id": 1, "op": "hello", "v": 2})
        assert framed.receive()[0]["ok"]
        # The baseline once this is the only connection (the last example's may still be closing).
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            framed.send({"id": 99, "op": "status"})
            if len(framed.receive()[0]["status"]["clients"]) == 1:
                break
            time.sleep(0.01)
        before = daemon_fds(pid)
        fds = _make_fds(fd_kind, count)
        try:
            framed.send({"id": 2, "op": op, "dst": 1, "src": 2, "nbytes": 4096}, fds)
        finally:
            for fd in fds:
                os.close(fd)
        reply, got = framed.receive()
        assert got == []
        assert reply == {
            "id": 2,
            "ok": False,
            "error": {
                "code": "bad_request",
                "message": f"'{op}' takes no file descriptors, but {count} came with it; they were closed",
            },
        }
        framed.send({"id": 3, "op": "ping"})
        assert framed.receive()[0] == {"id": 3, "ok": True}
        assert wait_fds(pid, before) <= before
    finally:
        sock.close()
