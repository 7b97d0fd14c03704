"""Where the daemon's socket is: the one setting a client and the daemon must agree on."""

from __future__ import annotations

import os
from collections.abc import Mapping

from priod.errors import ConnectionClosed

__all__ = ["SYSTEM_SOCKET", "default_socket_path", "find_socket", "socket_candidates"]

SYSTEM_SOCKET = "/run/priod/priod.sock"
"""Where systemd's priod.socket (config/systemd) and the Kubernetes hostPath put the socket."""


def socket_candidates(environ: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """(where it came from, path) of each place a daemon's socket may be, in order:
    ``$PRIOD_SOCKET``, ``$XDG_RUNTIME_DIR/priod.sock``, ``/run/priod/priod.sock``; a variable
    that is unset or empty adds nothing."""
    env = os.environ if environ is None else environ
    out = []
    if env.get("PRIOD_SOCKET"):
        out.append(("$PRIOD_SOCKET", env["PRIOD_SOCKET"]))
    if env.get("XDG_RUNTIME_DIR"):
        out.append(("$XDG_RUNTIME_DIR/priod.sock", os.path.join(env["XDG_RUNTIME_DIR"], "priod.sock")))
    out.append(("the system socket", SYSTEM_SOCKET))
    return out


def default_socket_path(environ: Mapping[str, str] | None = None) -> str:
    """Where a daemon binds when told nothing: the first of `socket_candidates`."""
    return socket_candidates(environ)[0][1]


def find_socket(environ: Mapping[str, str] | None = None) -> str:
    """Where a client connects when told nothing: the first of `socket_candidates` that exists.

    Not simply the first one set: any login sets ``$XDG_RUNTIME_DIR``, and a user's own daemon
    there is rarer than the system's under ``/run/priod``.

    Raises:
        ConnectionClosed: none exists; the message lists every path tried and what to do.
    """
    candidates = socket_candidates(environ)
    for _, path in candidates:
        if os.path.exists(path):
            return path
    tried = ", ".join(f"{path} ({origin})" for origin, path in candidates)
    raise ConnectionClosed(
        f"no priod daemon socket found; tried {tried} and none exists. Start the daemon (systemctl start priod.socket, "
        "or priod serve), or give its path (--socket, or PRIOD_SOCKET)"
    )
