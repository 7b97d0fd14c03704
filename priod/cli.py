"""``priod serve | status | demo`` (also ``python -m priod``)."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import signal
import sys
from typing import Any

from priod._version import __version__
from priod.common.socket_path import find_socket
from priod.daemon.config import Config, load_config
from priod.errors import ConfigError, PriodError

__all__ = ["main"]


def _load(args: argparse.Namespace) -> Config:
    cfg = load_config(args.config)
    server: dict[str, Any] = {}
    if getattr(args, "socket", None):
        server["socket"] = args.socket
    if getattr(args, "backend", None):
        server["backend"] = args.backend
    return cfg.replace(server=server) if server else cfg


DAEMON_MODULES = ("uvloop", "structlog", "prometheus_client")
"""What the daemon imports beyond the client's dependencies: the ``daemon`` extra."""


def missing_daemon_modules() -> list[str]:
    """The daemon's dependencies that are not installed (a client-only install has none)."""
    return [name for name in DAEMON_MODULES if importlib.util.find_spec(name) is None]


def _need_daemon(command: str) -> int:
    """0 if the daemon's dependencies are installed; else say which extra to install, and 1."""
    missing = missing_daemon_modules()
    if not missing:
        return 0
    print(
        f"priod: 'priod {command}' runs the daemon, whose dependencies are not installed (missing: {', '.join(missing)}). "
        "This is a client-only install; install the daemon with: pip install 'priod[daemon]' "
        "(on a GPU host 'priod[daemon,cuda13]' for driver >= 580, or 'priod[daemon,cuda12]' for driver >= 525)",
        file=sys.stderr,
    )
    return 1


def cmd_serve(args: argparse.Namespace) -> int:
    if rc := _need_daemon("serve"):
        return rc
    import uvloop

    from priod.daemon.log import configure_logging

    cfg = _load(args)
    configure_logging(cfg.log.level, cfg.log.format)
    return uvloop.run(_serve(cfg, args))


async def _serve(cfg: Config, args: argparse.Namespace) -> int:
    from priod.daemon import systemd
    from priod.daemon.log import get_logger
    from priod.daemon.server import Daemon, make_engine

    log = get_logger("priod")
    for moved in cfg.moved:
        log.warning(
            "config_setting_moved",
            setting=moved,
            source=cfg.source,
            hint="rename it in the config file; the old name is read for now",
        )
    loop = asyncio.get_running_loop()
    daemon: Daemon | None = None
    reload_pending = False

    def reload() -> None:
        nonlocal reload_pending
        if daemon is None:
            reload_pending = True  # during start: applied once the daemon serves
            return
        try:
            new = _load(args)
        except ConfigError as exc:
            log.error("reload_failed", error=str(exc), hint="the previous configuration stays in force")
            return
        daemon.reload(new)

    # Before the socket exists: whoever sees it may signal at once (`systemctl reload` right
    # after start), and a SIGHUP meeting its default action would end the daemon.
    stop_requested = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop_requested.set)
    loop.add_signal_handler(signal.SIGINT, stop_requested.set)
    loop.add_signal_handler(signal.SIGHUP, reload)
    try:
        engine = make_engine(cfg, log)
        activated = systemd.listen_fds()
        starting = Daemon(cfg, engine, listen_sock=activated[0] if activated else None, notify=systemd.notify)
        await starting.start()
    except PriodError as exc:
        log.error("start_failed", error=str(exc))
        print(f"priod: {exc}", file=sys.stderr)
        return 1
    daemon = starting
    if reload_pending:
        reload()
    tasks: set[asyncio.Task[Any]] = set()

    def spawn(coro: Any) -> None:
        t = asyncio.ensure_future(coro)
        tasks.add(t)
        t.add_done_callback(tasks.discard)

    async def keepalive() -> None:
        interval = systemd.watchdog_interval()
        while True:
            if interval:
                systemd.notify("WATCHDOG=1")
            st = daemon.totals
            systemd.notify(
                f"STATUS=serving {len(daemon.sessions)} clients, {st['copies']} copies, {st['bytes'] / 1e9:.1f} GB moved ({engine.name} engine)"
            )
            await asyncio.sleep(min(interval or 5.0, 5.0))

    systemd.notify(f"READY=1\nSTATUS=serving on {cfg.socket_path} ({engine.name} engine)")
    spawn(keepalive())
    # Stop from here, not from a task of the signal handler's: an exception in stop must end
    # the process with a non-zero status, not die unseen in a task while the daemon hangs on.
    stopped = asyncio.ensure_future(daemon.wait_stopped())
    requested = asyncio.ensure_future(stop_requested.wait())
    await asyncio.wait({stopped, requested}, return_when=asyncio.FIRST_COMPLETED)
    rc = 0
    if not stopped.done():
        try:
            await daemon.stop()
        except Exception as exc:
            log.exception("stop_failed", error=f"{type(exc).__name__}: {exc}")
            print(f"priod: stopping failed ({type(exc).__name__}: {exc}); exiting anyway", file=sys.stderr)
            rc = 1
    for t in (stopped, requested, *tasks):
        t.cancel()
    return rc


def cmd_status(args: argparse.Namespace) -> int:
    from priod.client import SyncClient

    try:
        # --socket, then [server] socket of --config, then the first socket that exists
        # (find_socket: $PRIOD_SOCKET, $XDG_RUNTIME_DIR/priod.sock, /run/priod/priod.sock).
        path = args.socket or _load(args).server.socket or find_socket()
        with SyncClient(path, name="priod-status", timeout=10) as c:
            st = c.status()
    except PriodError as exc:
        print(f"priod: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(st, indent=2, sort_keys=True))
    else:
        print(format_status(st))
    return 0


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def format_status(st: dict[str, Any]) -> str:
    lines = [
        f"priod {st['version']}  backend={st['backend']}  mode={st['mode']}  uptime={st['uptime_s']:.0f}s  socket={st['socket']}",
        f"max_block_us={st['max_block_us']}  classes: "
        + ", ".join(f"{c['name']}({'strict' if c['strict'] else 'w=' + str(c['weight'])})" for c in st["classes"]),
        *(f"{'gpu' + str(g['index']):<10} {g['uuid']}" for g in st.get("gpus", [])),
        "",
        f"{'lane':<16} {'GB/s':>7} {'chunk':>11} {'bound':>11} {'in flight':>11} {'express':>11}  queued (requests by class)",
    ]
    for ln in st["lanes"]:
        queued = " ".join(f"{k}={v}" for k, v in ln["queued_requests"].items() if v) or "-"
        if ln.get("urgent_beat_us"):  # beat_block_us: the beat this lane runs long chunks between
            queued += f"  (urgent beat {ln['urgent_beat_us'] / 1e3:.1f} ms)"
        lines.append(
            f"{ln['lane']:<16} {ln['bandwidth_gbps']:>7.2f} {_mib(ln['chunk_bytes']):>11} {_mib(ln['inflight_bound']):>11} "
            f"{_mib(ln['inflight_bytes'] + ln['strict_inflight_bytes']):>11} {_mib(ln['express_inflight_bytes']):>11}  {queued}"
        )
    direct = st.get("direct")
    if direct and (direct["pages"] or direct["copies"]):
        copies = " ".join(f"{lane}={n}" for lane, n in direct["copies"].items()) or "-"
        cut = " ".join(f"{lane}={n}" for lane, n in direct["cut"].items()) or "-"
        lines += [
            "",
            f"direct copies: hold pages {direct['pages']}  held now {', '.join(direct['held']) or '-'}  copies {copies}  holds cut {cut}",
        ]
        back = direct.get("stepped_back")
        if back:  # a client's page writer tears its counters (protocol.md, hold_page)
            lines.append(
                "  counters read stepping back (no copy counted): "
                + " ".join(f"{lane}={n}" for lane, n in back.items())
            )
        timed = direct.get("timed")
        if timed:  # direct copies the daemon's scans timed (an upper bound each; protocol.md, hold_page)
            lines.append(
                "  timed, p50 / p99 us: "
                + " ".join(f"{lane}={t['copies']} ({t['p50_us']:.0f} / {t['p99_us']:.0f})" for lane, t in timed.items())
            )
        refused = direct.get("refused")
        if refused:  # uids told on their pages that their hold budget is spent
            lines.append("  hold budgets spent now (uids): " + " ".join(f"{lane}={n}" for lane, n in refused.items()))
        spent = direct.get("refused_lanes")
        if spent:  # lanes where all uids together spent direct_hold_total_share: every page told
            lines.append("  lane hold totals spent now: " + " ".join(spent))
    clients = st.get("clients_total", len(st["clients"]))  # a non-root viewer sees only its own lines
    lines += [
        "",
        f"clients: {clients}   copies: {st['totals']['copies']}   bytes: {st['totals']['bytes'] / 1e9:.3f} GB   deadline misses: {st['deadline_misses']}",
    ]
    for c in st["clients"]:
        refused = f"   refused {c['refused']}" if c.get("refused") else ""
        lines.append(
            f"  conn {c['conn']:<4} pid {c['pid']:<8} uid {c['uid']:<6} regions {c['regions']:<4} pending {c['pending']:<5} "
            f"copies {c['copies']}{refused}  {c.get('name', '')}".rstrip()
        )
    ref = st.get("refusals")
    if ref and ref.get("total"):
        codes = " ".join(f"{code}={n}" for code, n in ref.get("by_code", {}).items())
        limits = " ".join(f"{name}={n}" for name, n in ref.get("by_limit", {}).items())
        log = ref.get("log", {})
        lines.append(
            f"refused: {ref['total']}  {codes}"
            + (f"  limits: {limits}" if limits else "")
            + f"  (log: {log.get('lines', 0)} lines, {log.get('suppressed', 0)} suppressed)"
        )
    return "\n".join(lines)


def cmd_demo(args: argparse.Namespace) -> int:
    if rc := _need_daemon("demo"):
        return rc
    from priod.demo import run_demo

    return run_demo(seconds=args.seconds, urgent_bytes=args.urgent_kib * 1024, bulk_bytes=args.bulk_mib << 20)


def cmd_install_units(args: argparse.Namespace) -> int:
    from priod.daemon.units import install_units

    try:
        written = install_units(args.dest, args.prefix, force=args.force, allow_hidden=args.allow_hidden_prefix)
    except FileNotFoundError as exc:  # a shipped file is missing: the installation, not the destination
        print(f"priod: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(
            f"priod: cannot write the units under {args.dest}: {exc}; run as root, or pass --dest DIR", file=sys.stderr
        )
        return 1
    for w in written:
        print(f"{w.action:<9} {w.path}" + ("  (exists; --force replaces it)" if w.action == "kept" else ""))
    if os.path.abspath(args.dest) == "/":
        print(
            "next: systemd-sysusers && systemctl daemon-reload && systemctl enable --now priod.socket  (docs/operations.md)"
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="priod", description="Transfer scheduler daemon for GPU hosts.")
    p.add_argument("--version", action="version", version=f"priod {__version__}")
    sub = p.add_subparsers(dest="command", metavar="{serve,status,install-units,demo}")
    serve = sub.add_parser("serve", help="run the daemon")
    serve.add_argument("--config", help="TOML config file (see config/priod.toml)")
    serve.add_argument(
        "--socket",
        help="socket path (default: $PRIOD_SOCKET if set, else $XDG_RUNTIME_DIR/priod.sock if set, else /run/priod/priod.sock)",
    )
    serve.add_argument("--backend", choices=["auto", "sim", "cuda"], help="copy engine (default: auto)")
    serve.set_defaults(func=cmd_serve)
    status = sub.add_parser("status", help="show a running daemon's lanes, queues and clients")
    status.add_argument("--config")
    status.add_argument(
        "--socket",
        help="default: [server] socket of --config, else the first that exists of $PRIOD_SOCKET, $XDG_RUNTIME_DIR/priod.sock, /run/priod/priod.sock",
    )
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(func=cmd_status)
    units = sub.add_parser(
        "install-units",
        help="write the systemd units, sysusers.d fragment and example config that ship with priod",
        description="Writes <dest>/etc/systemd/system/priod.{service,socket}, <dest>/usr/lib/sysusers.d/priod.conf and "
        "<dest>/etc/priod/priod.toml (an existing config is kept). Units are replaced: put local changes in drop-ins.",
    )
    units.add_argument("--dest", default="/", help="root to write under (default /; a staging directory for packages)")
    units.add_argument(
        "--prefix",
        help=f"priod's installation prefix: ExecStart= runs <prefix>/bin/priod (default: this installation's, {sys.prefix})",
    )
    units.add_argument("--force", action="store_true", help="replace an existing etc/priod/priod.toml too")
    units.add_argument(
        "--allow-hidden-prefix",
        action="store_true",
        help="write the unit even though its ExecStart lies under a path the unit hides (/home, /root, /tmp)",
    )
    units.set_defaults(func=cmd_install_units, prefix=None)
    demo = sub.add_parser("demo", help="urgent latency and bulk throughput, fifo vs priod, on the sim engine")
    demo.add_argument("--seconds", type=float, default=3.0, help="length of each run")
    demo.add_argument("--urgent-kib", type=int, default=1024)
    demo.add_argument("--bulk-mib", type=int, default=256)
    demo.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        # No command is a usage error, as argparse treats a missing argument: the help (not
        # only the usage line) on stderr, and exit status 2. `priod --help` exits 0.
        parser.print_help(sys.stderr)
        return 2
    if getattr(args, "config", None) is None:
        args.config = os.environ.get("PRIOD_CONFIG")
    try:
        rc: int = args.func(args)
    except ConfigError as exc:
        print(f"priod: configuration error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`priod status | head`): as other command-line tools, stop
        # quietly; stdout goes to /dev/null so that the interpreter's final flush cannot fail too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141 - 128  # SIGPIPE's number, as a shell reports a command it ended
    return rc
