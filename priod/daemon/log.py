"""structlog set-up: JSON lines for journald when not on a terminal, readable lines on one.

Under systemd (stdout is the journal's stream, ``$JOURNAL_STREAM``), each line starts with its
syslog priority, ``<4>{"event": ...}``: journald takes the priority from that prefix
(SyslogLevelPrefix=, on by default) and strips it, so ``journalctl -p warning`` shows warnings
and errors; without it every line would land as info.

Connection context (client pid, uid) is bound with contextvars in each connection's task, so
every line a connection causes carries it (`structlog.contextvars.merge_contextvars` first).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, TextIO

import structlog

__all__ = ["LineBudget", "configure_logging", "error_fields", "get_logger"]

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_SYSLOG = {"debug": 7, "info": 6, "warning": 4, "error": 3, "critical": 2, "exception": 3}
"""structlog level names to syslog priorities (sd-daemon(3))."""


def writes_to_journal(stream: TextIO, environ: dict[str, str] | os._Environ[str] | None = None) -> bool:
    """Whether ``stream`` is the journal's stdout stream: ``$JOURNAL_STREAM`` names its device
    and inode (systemd.exec(5)); a stream redirected elsewhere does not match."""
    env = os.environ if environ is None else environ
    dev_ino = env.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return dev_ino == f"{st.st_dev}:{st.st_ino}"


class _PriorityPrefix:
    """Wraps a renderer: the rendered line gets journald's ``<N>`` priority prefix."""

    def __init__(self, renderer: Any) -> None:
        self._renderer = renderer

    def __call__(self, logger: Any, name: str, event: dict[str, Any]) -> str | bytes:
        prefix = f"<{_SYSLOG.get(event.get('level', name), 6)}>"
        line = self._renderer(logger, name, event)
        return prefix.encode() + line if isinstance(line, bytes) else prefix + line


def configure_logging(level: str = "info", fmt: str = "auto", stream: TextIO | None = None) -> None:
    out = stream or sys.stdout
    json_lines = fmt == "json" or (fmt == "auto" and not out.isatty())
    renderer: Any = structlog.processors.JSONRenderer() if json_lines else structlog.dev.ConsoleRenderer(colors=False)
    factory: Any = structlog.WriteLoggerFactory(file=out)
    binary = getattr(out, "buffer", None)
    if json_lines and binary is not None:
        # One JSON line per copy is on the daemon's hot path: orjson into the binary stream
        # takes ~19 us a line where json + text takes ~31 (structlog's own advice).
        try:
            import orjson
        except ImportError:  # optional: a machine without it gets the stdlib path
            pass
        else:
            renderer = structlog.processors.JSONRenderer(serializer=orjson.dumps)
            factory = structlog.BytesLoggerFactory(file=binary)
    if json_lines and writes_to_journal(out):
        renderer = _PriorityPrefix(renderer)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.dict_tracebacks if json_lines else structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=factory,
        cache_logger_on_first_use=True,  # a filtered-out line then costs ~1 us, not ~6
    )


def get_logger(name: str) -> Any:
    return structlog.get_logger(name)


def _causes(exc: BaseException) -> list[str]:
    """What led to ``exc`` (``raise ... from`` or raised while handling), outermost first, so
    a log line names the root cause (an OSError, a msgpack error) and not only our wrapper."""
    out: list[str] = []
    seen = {id(exc)}
    cur = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    while cur is not None and id(cur) not in seen and len(out) < 8:
        seen.add(id(cur))
        out.append(f"{type(cur).__name__}: {cur}")
        cur = cur.__cause__ or (None if cur.__suppress_context__ else cur.__context__)
    return out


def error_fields(exc: BaseException) -> dict[str, Any]:
    """Log fields for an error: its message, and its causes where it has any."""
    causes = _causes(exc)
    return {"error": str(exc), "causes": causes} if causes else {"error": str(exc)}


class LineBudget:
    """A token bucket of log lines: `take` says whether one more line may be written now.

    For lines a client can cause at will (a refused request: session.py), so that a flood of
    them cannot flood the journal: ``burst`` lines at once, then ``per_s`` a second. Pure logic;
    ``now`` is ``time.monotonic()``.
    """

    __slots__ = ("burst", "per_s", "stamp", "tokens")

    def __init__(self, per_s: float, burst: int, now: float) -> None:
        self.per_s = per_s
        self.burst = burst
        self.tokens = float(burst)
        self.stamp = now

    def take(self, now: float) -> bool:
        """Take one line's token if there is one: True, write the line; False, count it instead."""
        tokens = min(float(self.burst), self.tokens + (now - self.stamp) * self.per_s)
        self.stamp = now
        if tokens >= 1.0:
            self.tokens = tokens - 1.0
            return True
        self.tokens = tokens
        return False
