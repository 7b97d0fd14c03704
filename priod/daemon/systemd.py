"""systemd integration written by hand: sd_notify(3) and sd_listen_fds(3), no package needed.

The notify protocol is one datagram per message to ``$NOTIFY_SOCKET`` (an ``@`` prefix means an
abstract socket); it is stable per systemd's portability promise, and small enough to own.
"""

from __future__ import annotations

import os
import socket
from collections.abc import MutableMapping

__all__ = ["SD_LISTEN_FDS_START", "listen_fds", "notify", "watchdog_interval"]

SD_LISTEN_FDS_START = 3


def notify(message: str, environ: MutableMapping[str, str] | None = None) -> bool:
    """Send ``message`` (e.g. ``"READY=1"``) to systemd; False when not run under Type=notify."""
    env = os.environ if environ is None else environ
    address = env.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address[0] == "@":
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.connect(address)
        sock.sendall(message.encode())
    return True


def watchdog_interval(environ: MutableMapping[str, str] | None = None) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings (half of ``WatchdogSec``), or None if not asked for."""
    env = os.environ if environ is None else environ
    usec = env.get("WATCHDOG_USEC")
    pid = env.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 1e6 / 2


def listen_fds(environ: MutableMapping[str, str] | None = None, *, unset: bool = True) -> list[socket.socket]:
    """Sockets passed by socket activation (``LISTEN_FDS``), if they are meant for this process.

    The variables are removed afterwards (so children do not take the fds for theirs).
    """
    env = os.environ if environ is None else environ
    if env.get("LISTEN_PID") != str(os.getpid()):
        return []
    count = int(env.get("LISTEN_FDS", "0"))
    if unset:
        for key in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            env.pop(key, None)
    socks = []
    for fd in range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + count):
        os.set_inheritable(fd, False)
        sock = socket.socket(fileno=fd)
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
            raise OSError(
                f"socket-activated fd {fd} is not a Unix stream socket; set ListenStream= to a path in priod.socket"
            )
        socks.append(sock)
    return socks
