"""priod: one daemon per GPU host that owns host/device copies, so urgent ones never wait behind bulk ones."""

from __future__ import annotations

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

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "PriodError",
    "ConfigError",
    "ProtocolError",
    "RequestError",
    "InvalidRequest",
    "NotFound",
    "PermissionDenied",
    "LimitExceeded",
    "Cancelled",
    "EngineError",
    "CudaError",
    "ShuttingDown",
    "ConnectionClosed",
]
