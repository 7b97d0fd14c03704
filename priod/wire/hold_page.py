"""The hold page's layout, shared by a client's direct copies and the daemon's holds.

One 8 KiB memfd per connection, made by the daemon and sealed against resizing; both map it
read-write, and each writes only its own half:

- bytes ``[0, 4096)``, the client's: slot ``i`` (lane ``i`` of the ``hold_page`` reply's list)
  is two little-endian uint64 at ``SLOT_BYTES * i``, ``begun`` and ``ended``, written only by
  the client, each counting up by one per copy with one aligned 8-byte store. A lane is held
  while ``begun != ended``.
- bytes ``[4096, 8192)``, the daemon's: slot ``i``'s word is one little-endian uint64 at
  ``DAEMON_OFFSET + 8 * i``, written only by the daemon with one aligned 8-byte store:
  `GRANTED` (0), holds are granted; `REFUSED` (1), this uid's hold budget on this lane is spent,
  so an announced copy would run un-held: send urgent copies through the daemon until it reads
  0 again. The daemon never reads this half back: what a client writes there changes nothing
  but its own reading of it.

A daemon before this layout made a 4096-byte page (the client's half alone): a client that finds
one reads every slot as granted.
"""

from __future__ import annotations

__all__ = [
    "CLIENT_BYTES",
    "DAEMON_OFFSET",
    "DAEMON_WORD",
    "GRANTED",
    "MAX_SLOTS",
    "PAGE_BYTES",
    "REFUSED",
    "SLOT_BYTES",
    "WORDS_PER_SLOT",
]

PAGE_BYTES = 8192
CLIENT_BYTES = 4096
"""The client's half, first: the slots' counters. A page of this size alone has no daemon half."""
SLOT_BYTES = 16
"""Two uint64 per lane: begun, ended."""
WORDS_PER_SLOT = SLOT_BYTES // 8
MAX_SLOTS = CLIENT_BYTES // SLOT_BYTES
"""Lanes one page can serve (256)."""
DAEMON_OFFSET = CLIENT_BYTES
"""Where the daemon's half starts: one uint64 per slot, slot ``i``'s at ``DAEMON_OFFSET + 8 * i``."""
DAEMON_WORD = DAEMON_OFFSET // 8
"""Index of slot 0's daemon word in the page read as uint64 words."""
GRANTED = 0
"""The daemon's word: this uid's copies on the lane hold bulk back (within the per-copy limit)."""
REFUSED = 1
"""The daemon's word: this uid's hold budget on the lane is spent; a copy announced now is not held."""
