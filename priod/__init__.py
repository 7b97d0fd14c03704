"""priod: one daemon per GPU host that owns host/device copies, so urgent ones never wait behind bulk ones."""

from __future__ import annotations

from priod._version import __version__
from priod.client import (
    BatchHandle,
    BatchResult,
    Client,
    CopyHandle,
    CopyResult,
    Region,
    SyncClient,
    SyncCopyHandle,
    connect,
)
from priod.errors import (
    Cancelled,
    ConfigError,
    ConnectionClosed,
    CopyTimeout,
    CudaError,
    EngineError,
    InvalidRequest,
    LimitExceeded,
    NotFound,
    PermissionDenied,
    PriodError,
    ProtocolError,
    RequestError,
    ShuttingDown,
)

__all__ = [
    "BatchHandle",
    "BatchResult",
    "Cancelled",
    "Client",
    "ConfigError",
    "ConnectionClosed",
    "CopyHandle",
    "CopyResult",
    "CopyTimeout",
    "CudaError",
    "EngineError",
    "InvalidRequest",
    "LimitExceeded",
    "NotFound",
    "PermissionDenied",
    "PriodError",
    "ProtocolError",
    "Region",
    "RequestError",
    "ShuttingDown",
    "SyncClient",
    "SyncCopyHandle",
    "__version__",
    "connect",
]
