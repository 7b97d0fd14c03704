"""The copy ring: a shared-memory submission and completion queue per connection.

A plain copy or batch (no events, one of the `RING_CLASSES`) costs the daemon's loop less as a
fixed 64-byte descriptor in shared memory than as a msgpack frame on the socket: no frame to
decode, no reply to encode, and a doorbell or two for every copy a loop turn brings. The socket stays for
everything else (the handshake, fds, other requests, errors with text) and as the fallback when
a ring is full.

One memfd per connection, made by the daemon (``ring`` request) and sealed against resizing, so
a client can neither shrink it under the daemon (a mapping past the end would fault) nor grow
it; both map it read-write. Beside it come two eventfds: the client's doorbell (written after
descriptors are published) and the daemon's (written after completions are). All integers are
little-endian; each index is one aligned 8-byte store by its one writer:

- ``[0, 64)``: header, written once by the daemon: magic, `RING_VERSION`, entries, sizes.
- ``SQ_TAIL`` (client), ``SQ_HEAD`` (daemon), ``CQ_TAIL`` (daemon), ``CQ_HEAD`` (client): free
  running uint64 counters, each on its own cache line.
- ``[HEADER_BYTES, ...)``: ``entries`` submission slots of `DESCRIPTOR`, then ``entries``
  completion slots of `COMPLETION`. Slot ``i % entries`` holds entry ``i``, and its first word
  is ``i`` itself: a slot that does not carry the sequence number expected is torn or forged.
- then `TABLE_BYTES` of batches' segment tables, written by the client, each in one piece; the
  daemon copies a table out as it takes its descriptor, and checks it as a frame's.
- then, from the next page, ``entries`` landed slots of `LANDED_BYTES`, slot ``i % entries`` for
  descriptor ``i``: how a copy the client waits for tells it that it landed without the daemon
  (below).

Landed words: a descriptor flagged `WANT_LANDED` asks the daemon to have the GPU itself (on the
sim, the copy engine's thread) store ``i + 1`` into its slot's first word right behind the
copy's last chunk, on the same stream, before the chunk's own completion event: the client
spinning on that word sees its bytes landed a microsecond after they have, not after the
daemon's poll finds the chunk done and its loop writes a completion. Before it asks for that
store the daemon writes the slot's other three words, the figures of the reply the client then
makes for itself: ``i + 1`` as a tag, then when the copy's first chunk went to the GPU
(CLOCK_MONOTONIC ns), then the ns it waited before that times two, plus one for the express
path; the tag is zeroed first and written last, so a reader that finds it unchanged around its
read has read one copy's figures. The completion still follows on the completion queue, as for
any copy, and the client drops it. The daemon only writes this area and never reads it.

Ordering: a writer fills a slot, then stores the counter; a reader loads the counter, then the
slot. On x86-64 (total store order) separate stores and loads keep that order, so no fence is
needed; `ring_supported` is False elsewhere, and clients there use the socket.

Waking: after publishing, the client writes its doorbell; the daemon reads the doorbell (which
resets it) before it looks at the queue, so a descriptor published after that look rings again.
The same holds for completions the other way. The doorbells are system calls; one per loop turn
on each side, however many copies the turn carries.

Trust: the daemon keeps its own copy of every counter it owns and checks those the client owns:
a tail that runs backwards or more than ``entries`` ahead, or a slot with the wrong sequence
number, is `RingCorrupt` (the daemon closes that connection, as for a bad frame); a descriptor
with bad fields is refused like the same copy sent as a frame, by its request id, on the socket.
A completion queue the client does not read fills up: the daemon then answers on the socket.
"""

from __future__ import annotations

import collections
import math
import platform
import struct
from typing import Final

from priod.errors import InvalidRequest
from priod.wire.batch import SEGMENT_BYTES
from priod.wire.messages import MAX_ID, Copy, CopyBatch

__all__ = [
    "COMPLETION",
    "CQ_HEAD",
    "CQ_TAIL",
    "DESCRIPTOR",
    "HEADER_BYTES",
    "RING_CLASSES",
    "RING_ENTRIES",
    "RING_VERSION",
    "SQ_HEAD",
    "SQ_TAIL",
    "WANT_LANDED",
    "CompletionReader",
    "CompletionWriter",
    "LandedReader",
    "LandedStamps",
    "RingCorrupt",
    "SubmissionReader",
    "SubmissionWriter",
    "check_header",
    "ring_bytes",
    "ring_eligible",
    "ring_supported",
    "write_header",
]

RING_VERSION: Final = 2
"""The layout's version: a client maps only a ring whose header carries the version it knows."""
MAGIC: Final = 0x474E4952  # b"RING"
RING_ENTRIES: Final = 1024
"""Slots in each queue: more copies than a connection may have pending by default
(``[limits] max_queued_requests``), so a ring is full only for a client past its limits."""
HEADER: Final = struct.Struct("<IIIIII")
"""magic, version, entries, descriptor bytes, completion bytes, table bytes."""
SQ_TAIL: Final = 64
SQ_HEAD: Final = 128
CQ_TAIL: Final = 192
CQ_HEAD: Final = 256
HEADER_BYTES: Final = 4096
U64: Final = struct.Struct("<Q")
"""For tests and tools; the ring's own counters go through `_words`, never `U64`."""

DESCRIPTOR: Final = struct.Struct("<QQIIQQQdBB6x")
"""seq, request id, dst region, src region, dst offset, src offset, nbytes, deadline_ms, class
(index into `RING_CLASSES`), flags (`HAS_DEADLINE`, `IS_BATCH`). A batch's descriptor gives its
segment table's offset in the table area and its length in bytes in place of the two offsets,
and its segment count as ``nbytes``."""
COMPLETION: Final = struct.Struct("<QQQdddBBxxI")
"""seq, request id, nbytes, queued_us, transfer_us, total_us, path (index into `PATHS`),
missed_deadline (0 or 1), segments (a batch's; 0 for a copy)."""
HAS_DEADLINE: Final = 1
IS_BATCH: Final = 2
WANT_LANDED: Final = 4
"""Have the GPU store the copy's landed word behind its last chunk (`LandedStamps`)."""
LANDED_BYTES: Final = 32
"""A landed slot: the word the GPU stores, the figures' tag, first submission ns, queued ns."""
PAGE: Final = 4096
TABLE_BYTES: Final = 256 << 10
"""The table area, after the completions: batches' segment tables, written by the client in
turn; the daemon copies a table out when it takes its descriptor, so the space is the client's
again once the submission head has passed it. 10,922 segments at once; a larger table goes on
the socket."""
RING_CLASSES: Final = ("urgent", "high", "normal", "bulk")
"""The classes a descriptor can name (the shipped ones); a copy of any other goes by the socket."""
CLASS_INDEX: Final = {name: i for i, name in enumerate(RING_CLASSES)}
PATHS: Final = ("dma", "express")
PATH_INDEX: Final = {name: i for i, name in enumerate(PATHS)}
MAX_REGION_ID: Final = 0xFFFFFFFF
MAX_U64: Final = (1 << 64) - 1


class RingCorrupt(Exception):
    """The client broke the ring's rules (a counter out of range, a torn or forged slot)."""


def ring_supported() -> bool:
    """Whether this machine's memory order lets the ring go without fences (x86-64)."""
    return platform.machine() in ("x86_64", "AMD64")


def _words(buf: memoryview) -> memoryview:
    """The ring as uint64 words: ``words[SQ_TAIL // 8] = n`` is one aligned 8-byte store (and
    a read one 8-byte load), where `struct.pack_into` writes byte by byte and a reader on the
    other side could catch a counter half-written."""
    return buf.cast("Q")


def table_base(entries: int) -> int:
    return HEADER_BYTES + entries * (DESCRIPTOR.size + COMPLETION.size)


def landed_base(entries: int) -> int:
    """Where the landed slots start: on a page of their own, after the table area."""
    return -(-(table_base(entries) + TABLE_BYTES) // PAGE) * PAGE


def ring_bytes(entries: int = RING_ENTRIES) -> int:
    return landed_base(entries) + entries * LANDED_BYTES


def write_header(buf: memoryview, entries: int = RING_ENTRIES) -> None:
    HEADER.pack_into(buf, 0, MAGIC, RING_VERSION, entries, DESCRIPTOR.size, COMPLETION.size, TABLE_BYTES)


def check_header(buf: memoryview) -> int:
    """The ring's entries, once its header says it is a ring of this layout and size."""
    if len(buf) < HEADER_BYTES:
        raise InvalidRequest(
            f"the daemon's ring is {len(buf)} bytes, too small for a header; is it a priod of this version?"
        )
    magic, version, entries, dsize, csize, tsize = HEADER.unpack_from(buf, 0)
    if (
        magic != MAGIC
        or version != RING_VERSION
        or dsize != DESCRIPTOR.size
        or csize != COMPLETION.size
        or tsize != TABLE_BYTES
    ):
        raise InvalidRequest(
            f"the daemon's ring has layout version {version} (magic {magic:#x}); this client knows version "
            f"{RING_VERSION}: it uses the socket instead"
        )
    if entries < 1 or len(buf) < ring_bytes(entries):
        raise InvalidRequest(f"the daemon's ring claims {entries} entries in {len(buf)} bytes")
    return int(entries)


def ring_eligible(req: Copy | CopyBatch) -> bool:
    """Whether a copy or batch can be a descriptor: no events, a class the ring names, ids and
    sizes that fit (a batch's table within the table area)."""
    if not (
        req.wait_event is None
        and req.signal_event is None
        and req.priority in CLASS_INDEX
        and 0 <= req.dst <= MAX_REGION_ID
        and 0 <= req.src <= MAX_REGION_ID
    ):
        return False
    if type(req) is CopyBatch:
        return 0 < len(req.segments) <= TABLE_BYTES
    assert type(req) is Copy
    return 0 <= req.nbytes <= MAX_U64 and 0 <= req.dst_offset <= MAX_U64 and 0 <= req.src_offset <= MAX_U64


class _Side:
    _words: memoryview

    def release(self) -> None:
        """Let go of the ring's memory (before it is unmapped)."""
        self._words.release()


class SubmissionWriter(_Side):
    """The client's side of the submission queue."""

    def __init__(self, buf: memoryview, entries: int) -> None:
        self._buf, self._entries, self._words = buf, entries, _words(buf)
        self._tail = self._words[SQ_TAIL // 8]
        self._table = table_base(entries)
        self._table_tail = 0
        """Where the next table goes, counted up without wrapping (mod `TABLE_BYTES`)."""
        self._tables: collections.deque[tuple[int, int]] = collections.deque()
        """(descriptor seq, table start) of the tables the daemon may not have copied out yet."""

    def _place_table(self, nbytes: int) -> int | None:
        """Where in the table area a table of ``nbytes`` goes now (a counter, not yet mod the
        area), or None if the space the daemon has not read yet leaves no room."""
        head = self._words[SQ_HEAD // 8]
        while self._tables and self._tables[0][0] < head:
            self._tables.popleft()
        start = self._table_tail
        if start % TABLE_BYTES + nbytes > TABLE_BYTES:
            start += TABLE_BYTES - start % TABLE_BYTES  # tables do not wrap: the next lap
        oldest = self._tables[0][1] if self._tables else start
        return start if start + nbytes - oldest <= TABLE_BYTES else None

    def taken(self, seq: int) -> bool:
        """Whether the daemon's head has passed descriptor ``seq``: it read the descriptor."""
        return bool(self._words[SQ_HEAD // 8] > seq)

    def try_submit(self, req_id: int, req: Copy | CopyBatch, landed: bool = False) -> int | None:
        """Publish one descriptor (and a batch's table); its sequence number, or None if the
        queue or the table area is full (send it on the socket). ``landed``: ask for its landed
        word (`WANT_LANDED`), which `LandedReader` reads by that number."""
        buf, tail = self._buf, self._tail
        if tail - self._words[SQ_HEAD // 8] >= self._entries:
            return None
        deadline = req.deadline_ms
        flags = (0 if deadline is None else HAS_DEADLINE) | (WANT_LANDED if landed else 0)
        if type(req) is CopyBatch:
            table = req.segments
            start = self._place_table(len(table))
            if start is None:
                return None
            at = start % TABLE_BYTES
            buf[self._table + at : self._table + at + len(table)] = table
            self._tables.append((tail, start))
            self._table_tail = start + len(table)
            dst_offset, src_offset, nbytes, flags = at, len(table), len(table) // SEGMENT_BYTES, flags | IS_BATCH
        else:
            assert type(req) is Copy
            dst_offset, src_offset, nbytes = req.dst_offset, req.src_offset, req.nbytes
        DESCRIPTOR.pack_into(
            buf,
            HEADER_BYTES + (tail % self._entries) * DESCRIPTOR.size,
            tail,
            req_id,
            req.dst,
            req.src,
            dst_offset,
            src_offset,
            nbytes,
            math.nan if deadline is None else deadline,
            CLASS_INDEX[req.priority],
            flags,
        )
        self._tail = tail + 1
        self._words[SQ_TAIL // 8] = tail + 1  # after the slot: the daemon reads it once it sees this
        return tail


class SubmissionReader(_Side):
    """The daemon's side of the submission queue: what it reads from the client is checked."""

    def __init__(self, buf: memoryview, entries: int) -> None:
        self._buf, self._entries, self._words = buf, entries, _words(buf)
        self._head = 0
        self._table = table_base(entries)

    def pending(self) -> bool:
        return bool(self._words[SQ_TAIL // 8] != self._head)

    def take(self) -> tuple[int, Copy | CopyBatch | InvalidRequest, int | None] | None:
        """The next descriptor as (request id, copy, its sequence number if it asked for its
        landed word, else None), or None if there is none; a descriptor that names no class of
        the ring's comes as (request id, the refusal to answer it with, None). The copy's own
        fields are the caller's to check (`Copy.check`), as for a frame's.

        Raises:
            RingCorrupt: the client's tail or slot breaks the ring's rules.
        """
        buf, head = self._buf, self._head
        tail = self._words[SQ_TAIL // 8]
        if tail == head:
            return None
        if not 0 < tail - head <= self._entries:
            raise RingCorrupt(f"submission tail {tail} is not within {self._entries} ahead of head {head}")
        seq, req_id, dst, src, dst_off, src_off, nbytes, deadline, cls, flags = DESCRIPTOR.unpack_from(
            buf, HEADER_BYTES + (head % self._entries) * DESCRIPTOR.size
        )
        if seq != head:
            raise RingCorrupt(f"submission slot {head % self._entries} holds entry {seq}, not {head}: torn or forged")
        table = None
        if flags & IS_BATCH and 0 < src_off <= TABLE_BYTES and dst_off <= TABLE_BYTES - src_off:
            # dst_off, src_off: the table's place and length. Copied out before the head moves:
            # once it passes this descriptor, the client may write this part of the area again.
            base = self._table + dst_off
            table = bytes(self._buf[base : base + src_off])
        self._head = head + 1
        self._words[SQ_HEAD // 8] = head + 1  # the slot (and its table) is free for the client again
        if not 0 < req_id <= MAX_ID:
            raise RingCorrupt(f"a descriptor with request id {req_id} (ids are 1 .. 2**63-1)")
        if cls >= len(RING_CLASSES):
            return req_id, _refused(f"class index {cls} is not one of the ring's {len(RING_CLASSES)} classes"), None
        deadline_ms = deadline if flags & HAS_DEADLINE else None
        landed = seq if flags & WANT_LANDED else None
        if flags & IS_BATCH:
            if table is None:
                return (
                    req_id,
                    _refused(f"a segment table of {src_off} bytes at {dst_off} is outside the table area"),
                    None,
                )
            return req_id, CopyBatch(dst, src, table, RING_CLASSES[cls], deadline_ms), landed
        return req_id, Copy(dst, src, nbytes, dst_off, src_off, RING_CLASSES[cls], deadline_ms), landed


def _refused(why: str) -> InvalidRequest:
    return InvalidRequest(f"ring descriptor: {why}; the client library wrote it wrong: upgrade or report it")


class CompletionWriter(_Side):
    """The daemon's side of the completion queue."""

    def __init__(self, buf: memoryview, entries: int) -> None:
        self._buf, self._entries, self._words = buf, entries, _words(buf)
        self._tail = 0

    def try_complete(
        self,
        req_id: int,
        nbytes: int,
        queued_us: float,
        transfer_us: float,
        total_us: float,
        path: str,
        missed_deadline: bool,
        segments: int = 0,
    ) -> bool:
        """Publish one completion (``segments``: a batch's); False if the client has not made
        room (answer on the socket).
        The client's head is read, not trusted: one out of range counts as no room."""
        buf, tail = self._buf, self._tail
        if not 0 <= tail - self._words[CQ_HEAD // 8] < self._entries:
            return False
        COMPLETION.pack_into(
            buf,
            HEADER_BYTES + self._entries * DESCRIPTOR.size + (tail % self._entries) * COMPLETION.size,
            tail,
            req_id,
            nbytes,
            queued_us,
            transfer_us,
            total_us,
            PATH_INDEX[path],
            missed_deadline,
            segments,
        )
        self._tail = tail + 1
        self._words[CQ_TAIL // 8] = tail + 1
        return True


class CompletionReader(_Side):
    """The client's side of the completion queue: each completion as the reply the socket
    would have brought (`priod.wire.replies.CopyReply`'s fields)."""

    def __init__(self, buf: memoryview, entries: int) -> None:
        self._buf, self._entries, self._words = buf, entries, _words(buf)
        self._head = self._words[CQ_HEAD // 8]
        self._base = HEADER_BYTES + entries * DESCRIPTOR.size

    def pending(self) -> bool:
        return bool(self._words[CQ_TAIL // 8] != self._head)

    def drain(self) -> list[tuple[int, dict[str, object]]]:
        buf, head, entries = self._buf, self._head, self._entries
        tail = self._words[CQ_TAIL // 8]
        out: list[tuple[int, dict[str, object]]] = []
        while head != tail:
            seq, req_id, nbytes, queued_us, transfer_us, total_us, path, missed, segments = COMPLETION.unpack_from(
                buf, self._base + (head % entries) * COMPLETION.size
            )
            head += 1
            if seq != head - 1:
                continue  # the daemon writes the slot before the tail: never seen; skip rather than guess
            reply: dict[str, object] = {
                "id": req_id,
                "ok": True,
                "nbytes": nbytes,
                "queued_us": queued_us,
                "transfer_us": transfer_us,
                "total_us": total_us,
                "path": PATHS[path] if path < len(PATHS) else "dma",
                "missed_deadline": bool(missed),
            }
            if segments:
                reply["segments"] = segments
            out.append((req_id, reply))
        if head != self._head:
            self._head = head
            self._words[CQ_HEAD // 8] = head
        return out


class LandedStamps(_Side):
    """The daemon's side of the landed slots: the figures it writes before it asks the engine
    to store a copy's landed word (`landed_word`, the store's place and value)."""

    def __init__(self, buf: memoryview, entries: int) -> None:
        self._entries, self._words = entries, _words(buf)
        self._base = landed_base(entries)

    def landed_word(self, seq: int) -> tuple[int, int]:
        """The byte offset in the ring of descriptor ``seq``'s landed word, and the value the
        engine stores there once the copy has landed."""
        return self._base + (seq % self._entries) * LANDED_BYTES, seq + 1

    def stamp(self, seq: int, first_submit_ns: int, queued_ns: int, express: bool) -> None:
        """Write descriptor ``seq``'s figures: the tag last, so a reader never takes two
        copies' figures for one."""
        words, at = self._words, (self._base + (seq % self._entries) * LANDED_BYTES) // 8
        words[at + 1] = 0
        words[at + 2] = max(first_submit_ns, 0)
        words[at + 3] = max(queued_ns, 0) * 2 + express
        words[at + 1] = seq + 1


class LandedReader(_Side):
    """The client's side of the landed slots (`WANT_LANDED`)."""

    def __init__(self, buf: memoryview, entries: int) -> None:
        self._entries, self._words = entries, _words(buf)
        self._base = landed_base(entries) // 8

    def landed(self, seq: int) -> bool:
        """Whether descriptor ``seq``'s bytes have landed (its word holds ``seq + 1``). False
        also where a later descriptor's copy took the slot over: its completion says."""
        return bool(self._words[self._base + (seq % self._entries) * (LANDED_BYTES // 8)] == seq + 1)

    def figures(self, seq: int) -> tuple[int, int, bool] | None:
        """Descriptor ``seq``'s figures, once `landed`: (first chunk submitted, CLOCK_MONOTONIC
        ns; ns queued before that; the express path), or None if the slot holds another's."""
        words, at = self._words, self._base + (seq % self._entries) * (LANDED_BYTES // 8)
        tag = words[at + 1]
        first, queued = words[at + 2], words[at + 3]
        if tag != seq + 1 or words[at + 1] != tag:
            return None
        return int(first), int(queued) >> 1, bool(queued & 1)
