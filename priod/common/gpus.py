"""GPU identity: UUIDs as nvidia-smi prints them, the one name of a GPU that every process shares.

An ordinal is only meaningful inside one process: ``CUDA_VISIBLE_DEVICES`` (set by a container
runtime or the Kubernetes device plugin) renumbers the GPUs a process sees from 0. A client in a
pod that sees one GPU calls it 0 while the daemon, which sees all of them, may call it 3. The
UUID does not change between processes, so requests name the GPU by UUID and the daemon maps it
to its own ordinal (`priod.daemon.engines.base.Engine.device_ordinal`).

This module imports nothing of priod's but the errors, so the client library, the wire messages
and the engines all share one format and one parser.
"""

from __future__ import annotations

import re
import uuid

from priod.errors import InvalidRequest

__all__ = ["format_uuid", "sim_uuid", "uuid_key"]

_UUID_TEXT = re.compile(
    r"^(?:GPU-|MIG-)?([0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12})$"
)
_SIM_NAMESPACE = uuid.UUID("6d1c2f4e-0b8a-4c55-9a49-2f0f5e1d7a11")
"""Fixed, so that a sim GPU's UUID is the same in every run and on every host."""


def format_uuid(raw: bytes) -> str:
    """The 16 bytes of a ``CUuuid`` as nvidia-smi prints them: ``GPU-xxxxxxxx-xxxx-...``."""
    if len(raw) != 16:
        raise ValueError(f"a GPU UUID is 16 bytes, got {len(raw)}")
    return f"GPU-{uuid.UUID(bytes=bytes(raw))}"


def uuid_key(text: str) -> str:
    """The part of a GPU UUID that identifies it: lower-case ``xxxxxxxx-xxxx-...``.

    Takes what nvidia-smi prints (``GPU-...``, or ``MIG-...`` for a MIG instance), in any case,
    with or without the prefix: CUDA reports a MIG instance's UUID with the same 16 bytes.

    Raises:
        InvalidRequest: ``text`` is not a GPU UUID; the message shows the expected form.
    """
    m = _UUID_TEXT.match(text.strip())
    if m is None:
        raise InvalidRequest(
            f"device_uuid {text[:80]!r} is not a GPU UUID; give it as nvidia-smi -L prints it, like GPU-5f3c0e1a-9b7d-4e2f-8a61-0c4d2b9e7f13"
        )
    return m.group(1).lower()


def sim_uuid(index: int) -> str:
    """The sim engine's default UUID of its device ``index``: made up, but the same every run."""
    return format_uuid(uuid.uuid5(_SIM_NAMESPACE, f"priod-sim-gpu{index}").bytes)
