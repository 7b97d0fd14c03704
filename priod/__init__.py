"""priod: one daemon per GPU host that owns host/device copies, so urgent ones never wait behind bulk ones."""

from __future__ import annotations

__version__ = "0.1.0"  # before the imports: modules below read it

from .client import Client, CopyHandle, CopyResult, Region, SyncClient, connect
from .errors import (
    Cancelled,
    ConfigError,
    ConnectionClosed,
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
    "Cancelled",
    "Client",
    "ConfigError",
    "ConnectionClosed",
    "CopyHandle",
    "CopyResult",
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
    "__version__",
    "connect",
]
