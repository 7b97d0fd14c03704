"""A daemon under test in its own process: start ``priod serve`` on a private socket, wait until
it listens, stop it; and find the pid of a daemon that is already running."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from priod.wire.transport import peer_credentials

__all__ = ["DaemonProcess", "daemon_pid", "daemon_process", "settings_env", "wait_for_socket", "wait_until"]


T = TypeVar("T")


def wait_until(check: Callable[[], T | None], timeout: float = 30.0, what: str = "condition") -> T:
    """Poll ``check`` until it returns something truthy, and return that; AssertionError naming
    ``what`` after ``timeout`` seconds. Tests wait with this, never with fixed sleeps."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def wait_for_socket(path: str, timeout: float, proc: subprocess.Popen[Any] | None = None) -> None:
    """Return once something accepts connections on ``path``.

    Raises RuntimeError if ``proc`` (the process meant to listen) exits first, TimeoutError
    after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the daemon exited with {proc.returncode} before listening on {path}")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            return
        except OSError:
            time.sleep(0.02)
        finally:
            s.close()
    raise TimeoutError(f"no daemon listening on {path} after {timeout} s")


def daemon_pid(path: str) -> int:
    """The pid of the process listening on ``path``, from the kernel's record of the peer (SO_PEERCRED)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return peer_credentials(s).pid
    finally:
        s.close()


def settings_env(items: list[str]) -> dict[str, str]:
    """``SECTION__KEY=VALUE`` items (a script's ``--set``) as the daemon's ``PRIOD_*`` environment.

    Raises:
        ValueError: an item not of that form; the message shows one that is.
    """
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or "__" not in key:
            raise ValueError(f"--set {item!r}: write SECTION__KEY=VALUE, e.g. scheduler__max_block_us=500")
        env[f"PRIOD_{key.upper()}"] = value
    return env


@dataclass
class DaemonProcess:
    """``priod serve`` running in a child process on a private socket."""

    proc: subprocess.Popen[bytes]
    socket_path: str
    log_path: str
    final_log: str | None = None
    """The whole log, kept here once `daemon_process` has removed the file (a clean stop)."""

    def log(self) -> str:
        """Everything the daemon wrote to stdout and stderr so far."""
        if self.final_log is not None:
            return self.final_log
        with open(self.log_path, encoding="utf-8", errors="replace") as fp:
            return fp.read()

    def log_records(self) -> list[dict[str, Any]]:
        """The daemon's JSON log lines (it logs JSON when stdout is not a terminal), parsed; a
        line it is still writing is left for the next call."""
        text = self.log()
        if self.final_log is None:
            text = text[: text.rfind("\n") + 1]
        return [json.loads(line) for line in text.splitlines() if line.startswith("{")]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send ``sig`` (SIGKILL after ``timeout`` s) and return the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@contextmanager
def daemon_process(
    env: Mapping[str, str] | None = None,
    *,
    backend: str = "sim",
    config: str | None = None,
    args: tuple[str, ...] = (),
    socket_path: str | None = None,
    start_timeout: float = 60.0,
) -> Iterator[DaemonProcess]:
    """Start a daemon, wait until it listens, stop it (SIGTERM) on exit. Its private directory
    (the socket, ``daemon.log``) is removed if it stopped cleanly (`DaemonProcess.log` still
    answers), kept if not.

    ``env`` adds settings as ``PRIOD_<SECTION>__<KEY>`` variables; ``PRIOD_*`` variables of this
    process are not passed on.
    """
    tmp = tempfile.mkdtemp(prefix="priod-")
    path = socket_path or os.path.join(tmp, "priod.sock")
    log_path = os.path.join(tmp, "daemon.log")
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PRIOD_")}
    full_env.update(env or {})
    cmd = [sys.executable, "-m", "priod", "serve", "--socket", path, "--backend", backend, *args]
    if config:
        cmd += ["--config", config]
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=full_env)
    d = DaemonProcess(proc, path, log_path)
    try:
        wait_for_socket(path, start_timeout, proc)
        yield d
    finally:
        # The private directory (socket, log) goes with a daemon that stopped cleanly; one that
        # did not keeps its log there for whoever looks into it. Left behind every time, they
        # piled up by the ten thousand in /tmp of a machine that ran the suite all day.
        if d.stop() == 0:
            d.final_log = d.log()  # tests read it after the block
            shutil.rmtree(tmp, ignore_errors=True)
