"""Who may connect, and who must go: admission at connect, and the timeouts after.

A connection is a slot of ``[server] max_clients`` and an open file; nobody may hold one for
nothing (no hello, or nothing held and nothing sent) or take them all (a cap per uid). uid 0 and
the daemon's own uid are always let in, with a reserve of slots beyond max_clients, so an
administrator can always look (`priod status`) and stop things.

Each connection turned away is counted by uid, code and limit in the daemon's book of refusals
(`session.Refusals`, ``refusals.connections`` in `priod status`), which `priod status` reads here.
"""

from __future__ import annotations

import asyncio
import time

from priod.daemon.session import Refusals, Shared
from priod.errors import LimitExceeded, PermissionDenied, PriodError, ShuttingDown
from priod.wire.transport import Peer

__all__ = ["PRIVILEGED_RESERVE", "Admission"]

PRIVILEGED_RESERVE = 16
"""Connections beyond max_clients kept for uid 0 and the daemon's uid."""


class Admission:
    """The gate in front of the sessions (``shared.sessions``)."""

    def __init__(self, shared: Shared, own_uid: int) -> None:
        self.shared = shared
        self.own_uid = own_uid

    def privileged(self, uid: int) -> bool:
        """uid 0 and the daemon's own uid: always allowed in, a reserve of connections beyond
        [server] max_clients, no per-uid connection cap, every client shown in `status`."""
        return uid == 0 or uid == self.own_uid

    def allowed(self, peer: Peer) -> bool:
        s = self.shared.cfg.server
        if not s.allow_uids and not s.allow_gids:
            return True  # the socket's mode and group are the only gate
        return self.privileged(peer.uid) or peer.uid in s.allow_uids or peer.gid in s.allow_gids

    @property
    def refusals(self) -> Refusals:
        """The daemon's book of refused requests and connections (for `priod status`)."""
        return self.shared.refusals

    def refusal(self, peer: Peer) -> PriodError | None:
        """Why this peer may not connect now, or None; a refusal is counted (`Refusals`)."""
        why = self._refusal(peer)
        if why is not None:
            self.shared.refusals.connection_refused(peer.uid, why)
        return why

    def _refusal(self, peer: Peer) -> PriodError | None:
        sv, lim = self.shared.cfg.server, self.shared.cfg.limits
        n = len(self.shared.sessions)
        if not self.allowed(peer):
            return PermissionDenied(
                f"uid {peer.uid} (gid {peer.gid}) may not use this daemon; an administrator can add it to [server] allow_uids or allow_gids"
            )
        if self.shared.stopping:
            return ShuttingDown("the daemon is stopping; retry once it is back")
        privileged = self.privileged(peer.uid)
        if n >= sv.max_clients:
            full = LimitExceeded(f"the daemon already serves {n} clients ([server] max_clients); retry later")
            if not privileged or n >= sv.max_clients + PRIVILEGED_RESERVE:
                return full
            if sum(1 for s in self.shared.sessions.values() if self.privileged(s.peer.uid)) >= sv.max_clients:
                return full  # the reserve gets root past other users' connections, not its own
            return None
        if privileged:
            return None
        tally = self.shared.regions.uid_holdings(peer.uid)
        if tally is not None and tally.holders >= lim.max_connections_per_uid:
            return LimitExceeded(
                f"uid {peer.uid} already has {tally.holders} connections ([limits] max_connections_per_uid = {lim.max_connections_per_uid}); "
                "close one, or share one connection between threads"
            )
        return None

    async def expire_loop(self) -> None:
        """Close connections that sent no hello within [server] hello_timeout_s, and those that
        held nothing and sent nothing for idle_timeout_s: a connection is a slot of max_clients
        and an fd, and nobody may keep them for nothing."""
        while True:
            sv = self.shared.cfg.server
            now = time.monotonic()
            for session in list(self.shared.sessions.values()):
                if not session.greeted:
                    if now - session.connected_at >= sv.hello_timeout_s:
                        session.expire(
                            LimitExceeded(
                                f"no hello within {sv.hello_timeout_s:g} s of connecting ([server] hello_timeout_s); send hello as the first request"
                            )
                        )
                elif not session.idle:
                    session.last_active = now
                elif sv.idle_timeout_s and now - session.last_active >= sv.idle_timeout_s:
                    session.expire(
                        LimitExceeded(
                            f"connection idle for {sv.idle_timeout_s:g} s with no regions and no copies ([server] idle_timeout_s); connect again when needed"
                        )
                    )
            await asyncio.sleep(max(0.05, min(1.0, sv.hello_timeout_s / 4, (sv.idle_timeout_s or 4.0) / 4)))
