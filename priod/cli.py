"""``priod serve | status | demo`` (also ``python -m priod``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from typing import Any

from . import __version__
from .config import Config, load_config
from .errors import ConfigError, PriodError

__all__ = ["main"]


def _load(args: argparse.Namespace) -> Config:
    cfg = load_config(args.config)
    server: dict[str, Any] = {}
    if getattr(args, "socket", None):
        server["socket"] = args.socket
    if getattr(args, "backend", None):
        server["backend"] = args.backend
    return cfg.replace(server=server) if server else cfg


def cmd_serve(args: argparse.Namespace) -> int:
    import uvloop

    from .log import configure_logging

    cfg = _load(args)
    configure_logging(cfg.log.level, cfg.log.format)
    return uvloop.run(_serve(cfg, args))


async def _serve(cfg: Config, args: argparse.Namespace) -> int:
    from . import systemd
    from .engines import make_engine
    from .log import get_logger
    from .server import Daemon

    log = get_logger("priod")
    try:
        engine = make_engine(cfg, log)
        activated = systemd.listen_fds()
        daemon = Daemon(cfg, engine, listen_sock=activated[0] if activated else None, notify=systemd.notify)
        await daemon.start()
    except PriodError as exc:
        log.error("start_failed", error=str(exc))
        print(f"priod: {exc}", file=sys.stderr)
        return 1
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[Any]] = set()

    def spawn(coro: Any) -> None:
        t = asyncio.ensure_future(coro)
        tasks.add(t)
        t.add_done_callback(tasks.discard)

    def reload() -> None:
        try:
            new = _load(args)
        except ConfigError as exc:
            log.error("reload_failed", error=str(exc), hint="the previous configuration stays in force")
            return
        daemon.reload(new)

    stop_requested = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop_requested.set)
    loop.add_signal_handler(signal.SIGINT, stop_requested.set)
    loop.add_signal_handler(signal.SIGHUP, reload)

    async def keepalive() -> None:
        interval = systemd.watchdog_interval()
        while True:
            if interval:
                systemd.notify("WATCHDOG=1")
            st = daemon.totals
            systemd.notify(f"STATUS=serving {len(daemon.sessions)} clients, {st['copies']} copies, {st['bytes'] / 1e9:.1f} GB moved ({engine.name} engine)")
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
    from .client import SyncClient

    path = args.socket or _load(args).socket_path
    try:
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
        f"max_block_us={st['max_block_us']}  classes: " + ", ".join(f"{c['name']}({'strict' if c['strict'] else 'w=' + str(c['weight'])})" for c in st["classes"]),
        *(f"{'gpu' + str(g['index']):<10} {g['uuid']}" for g in st.get("gpus", [])),
        "",
        f"{'lane':<10} {'GB/s':>7} {'chunk':>11} {'bound':>11} {'in flight':>11} {'express':>11}  queued (requests by class)",
    ]
    for ln in st["lanes"]:
        queued = " ".join(f"{k}={v}" for k, v in ln["queued_requests"].items() if v) or "-"
        lines.append(
            f"{ln['lane']:<10} {ln['bandwidth_gbps']:>7.2f} {_mib(ln['chunk_bytes']):>11} {_mib(ln['inflight_bound']):>11} "
            f"{_mib(ln['inflight_bytes'] + ln['strict_inflight_bytes']):>11} {_mib(ln['express_inflight_bytes']):>11}  {queued}"
        )
    clients = st.get("clients_total", len(st["clients"]))  # a non-root viewer sees only its own lines
    lines += ["", f"clients: {clients}   copies: {st['totals']['copies']}   bytes: {st['totals']['bytes'] / 1e9:.3f} GB   deadline misses: {st['deadline_misses']}"]
    for c in st["clients"]:
        lines.append(f"  conn {c['conn']:<4} pid {c['pid']:<8} uid {c['uid']:<6} regions {c['regions']:<4} pending {c['pending']:<5} copies {c['copies']}")
    return "\n".join(lines)


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(seconds=args.seconds, urgent_bytes=args.urgent_kib * 1024, bulk_bytes=args.bulk_mib << 20)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="priod", description="Transfer scheduler daemon for GPU hosts.")
    p.add_argument("--version", action="version", version=f"priod {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the daemon")
    serve.add_argument("--config", help="TOML config file (see config/priod.toml)")
    serve.add_argument("--socket", help="socket path (default $PRIOD_SOCKET, $XDG_RUNTIME_DIR/priod.sock, /run/priod/priod.sock)")
    serve.add_argument("--backend", choices=["auto", "sim", "cuda"], help="copy engine (default: auto)")
    serve.set_defaults(func=cmd_serve)
    status = sub.add_parser("status", help="show a running daemon's lanes, queues and clients")
    status.add_argument("--config")
    status.add_argument("--socket")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(func=cmd_status)
    demo = sub.add_parser("demo", help="urgent latency and bulk throughput, fifo vs priod, on the sim engine")
    demo.add_argument("--seconds", type=float, default=3.0, help="length of each run")
    demo.add_argument("--urgent-kib", type=int, default=1024)
    demo.add_argument("--bulk-mib", type=int, default=256)
    demo.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "config", None) is None:
        args.config = os.environ.get("PRIOD_CONFIG")
    try:
        rc: int = args.func(args)
    except ConfigError as exc:
        print(f"priod: configuration error: {exc}", file=sys.stderr)
        return 2
    return rc
