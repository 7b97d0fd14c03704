"""The client process's side of priod: `Client` (asyncio), `SyncClient`, direct copies, the
PyTorch face and the CUDA IPC helpers. Nothing here imports the daemon."""

from __future__ import annotations

from priod.client.base import Region
from priod.client.client import BatchHandle, BatchResult, Client, CopyHandle, CopyResult, connect
from priod.client.sync_client import SyncBatchHandle, SyncClient, SyncCopyHandle

__all__ = [
    "BatchHandle",
    "BatchResult",
    "Client",
    "CopyHandle",
    "CopyResult",
    "Region",
    "SyncBatchHandle",
    "SyncClient",
    "SyncCopyHandle",
    "connect",
]
