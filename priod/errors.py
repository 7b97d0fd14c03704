"""One shallow hierarchy of errors, shared by the daemon and the client library.

Every error that crosses the socket has a wire ``code``; the client turns an error reply back
into the class registered for that code, so ``except priod.LimitExceeded`` works on both sides.
Messages say what to do next, not only what went wrong.
"""

from __future__ import annotations

__all__ = [
    "Cancelled",
    "ConfigError",
    "ConnectionClosed",
    "CopyTimeout",
    "CudaError",
    "EngineError",
    "InvalidRequest",
    "LimitExceeded",
    "NotFound",
    "PermissionDenied",
    "PriodError",
    "ProtocolError",
    "RequestError",
    "ShuttingDown",
    "error_for_code",
]


class PriodError(Exception):
    """Base of every error priod raises on purpose."""

    code = "internal"


class ConfigError(PriodError):
    """A setting is missing or invalid; the message names the setting and the fix."""

    code = "config"


class ProtocolError(PriodError):
    """A frame could not be decoded, or broke the protocol (docs/protocol.md)."""

    code = "bad_frame"


class RequestError(PriodError):
    """The daemon refused or failed one request; the connection stays usable."""

    code = "bad_request"
    bytes_done: int = 0
    """For a copy that ended early (cancelled, failed, timed out): the bytes that landed."""
    segments_done: int | None = None
    """For a batch that ended early: how many of its segments, the first ones, landed whole
    (None for a single copy)."""


class InvalidRequest(RequestError):
    """A request's fields are missing, of the wrong type, or out of range."""

    code = "bad_request"


class NotFound(RequestError):
    """A request named a region or request id that does not exist (or is not yours)."""

    code = "not_found"


class PermissionDenied(RequestError):
    """The peer may not connect, or may not touch that region."""

    code = "permission"


class LimitExceeded(RequestError):
    """A per-client limit (pinned bytes, queued requests, queued bytes) would be exceeded."""

    code = "limit"


class Cancelled(RequestError):
    """The copy was cancelled before it finished; ``bytes_done`` says how far it got."""

    code = "cancelled"

    def __init__(self, message: str, bytes_done: int = 0, segments_done: int | None = None) -> None:
        super().__init__(message)
        self.bytes_done = bytes_done
        self.segments_done = segments_done


class CopyTimeout(Cancelled, TimeoutError):
    """A copy given a ``timeout`` did not finish in time: the client cancelled it in the daemon,
    and ``bytes_done`` (``segments_done`` for a batch) says how far it got. Never sent on the
    wire; ``except priod.Cancelled`` and ``except TimeoutError`` both catch it."""

    code = "timeout"


class EngineError(RequestError):
    """The copy engine failed this request (a CUDA error, or an injected fault in ``sim``)."""

    code = "engine"


class CudaError(EngineError):
    """A CUDA call failed; ``name`` is the CUDA error's name (for example cudaErrorInvalidValue)."""

    code = "engine"

    def __init__(self, name: str, explanation: str = "") -> None:
        super().__init__(f"{name}: {explanation}" if explanation else name)
        self.name = name


class ShuttingDown(RequestError):
    """The daemon is stopping and did not run this request; retry against the restarted daemon."""

    code = "shutting_down"


class ConnectionClosed(PriodError):
    """The connection to the daemon is closed (by us, or because the daemon went away)."""

    code = "closed"


_BY_CODE: dict[str, type[PriodError]] = {
    cls.code: cls
    for cls in (
        ProtocolError,
        InvalidRequest,
        NotFound,
        PermissionDenied,
        LimitExceeded,
        Cancelled,
        EngineError,
        ShuttingDown,
        ConfigError,
    )
}


def error_for_code(code: str, message: str, bytes_done: int = 0, segments_done: int | None = None) -> PriodError:
    """Build the exception that an error reply with ``code`` stands for; a copy's progress
    (``bytes_done``, ``segments_done``) is kept on it whatever the code."""
    if code == Cancelled.code:
        return Cancelled(message, bytes_done, segments_done)
    exc = _BY_CODE.get(code, PriodError)(message)
    if isinstance(exc, RequestError) and (bytes_done or segments_done is not None):
        exc.bytes_done = bytes_done
        exc.segments_done = segments_done
    return exc
