"""The hold page's layout, shared by a client's direct copies and the daemon's holds.

One 4 KiB memfd per connection, made by the daemon and sealed against resizing. Slot ``i``
(lane ``i`` of the ``hold_page`` reply's list) is two little-endian uint64 at ``SLOT_BYTES * i``:
``begun`` and ``ended``, written only by the client, each counting up by one per copy with one
aligned 8-byte store. A lane is held while ``begun != ended``.
"""

from __future__ import annotations

__all__ = ["PAGE_BYTES", "SLOT_BYTES", "WORDS_PER_SLOT"]

PAGE_BYTES = 4096
SLOT_BYTES = 16
"""Two uint64 per lane: begun, ended."""
WORDS_PER_SLOT = SLOT_BYTES // 8
