"""The command line without a command, and how clients find the socket (issue 13, item 5).

A client looks in order at ``$PRIOD_SOCKET``, ``$XDG_RUNTIME_DIR/priod.sock`` and
``/run/priod/priod.sock`` and takes the first that exists: any login sets ``XDG_RUNTIME_DIR``,
and looking only there missed the system daemon.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import priod
import priod.common.socket_path
from priod.common.socket_path import SYSTEM_SOCKET, default_socket_path, find_socket, socket_candidates
from priod.testing import daemon_process


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("PRIOD_") and k != "XDG_RUNTIME_DIR"}
    return subprocess.run(
        [sys.executable, "-m", "priod", *args], capture_output=True, text=True, env={**base, **(env or {})}, timeout=60
    )


def test_priod_alone_prints_the_help_and_exits_2() -> None:
    """No command is a usage error, as argparse has it: the full help (every command) on stderr,
    exit status 2, nothing on stdout. ``--help`` prints the same on stdout and exits 0."""
    bare = run_cli()
    assert (bare.returncode, bare.stdout) == (2, "")
    assert bare.stderr.startswith("usage: priod [-h] [--version] {serve,status,install-units,demo} ...")
    for command in ("serve", "status", "install-units", "demo"):
        assert f"\n    {command} " in bare.stderr, command
    helped = run_cli("--help")
    assert (helped.returncode, helped.stdout, helped.stderr) == (0, bare.stderr, "")


def test_candidates_in_order_skipping_unset_variables(tmp_path: Path) -> None:
    """$PRIOD_SOCKET, $XDG_RUNTIME_DIR/priod.sock, the system socket; the daemon binds the first."""
    env = {"PRIOD_SOCKET": "/x/s", "XDG_RUNTIME_DIR": "/r"}
    assert [p for _, p in socket_candidates(env)] == ["/x/s", "/r/priod.sock", SYSTEM_SOCKET]
    assert [p for _, p in socket_candidates({"XDG_RUNTIME_DIR": "/r", "PRIOD_SOCKET": ""})] == [
        "/r/priod.sock",
        SYSTEM_SOCKET,
    ]
    assert default_socket_path(env) == "/x/s" and default_socket_path({}) == SYSTEM_SOCKET


def test_find_socket_takes_the_first_that_exists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A set variable whose path does not exist is passed over for the next candidate, down to
    the system socket; with none there, the error lists every path tried and what to do."""
    system = tmp_path / "run" / "priod.sock"
    monkeypatch.setattr(priod.common.socket_path, "SYSTEM_SOCKET", str(system))
    xdg = tmp_path / "xdg"
    xdg.mkdir()
    env = {"PRIOD_SOCKET": str(tmp_path / "gone.sock"), "XDG_RUNTIME_DIR": str(xdg)}
    tried = f"{tmp_path}/gone.sock ($PRIOD_SOCKET), {xdg}/priod.sock ($XDG_RUNTIME_DIR/priod.sock), {system} (the system socket)"
    fix = (
        "Start the daemon (systemctl start priod.socket, or priod serve), or give its path (--socket, or PRIOD_SOCKET)"
    )
    with pytest.raises(
        priod.ConnectionClosed,
        match=rf"^no priod daemon socket found; tried {re.escape(tried)} and none exists\. {re.escape(fix)}$",
    ):
        find_socket(env)
    system.parent.mkdir()
    system.touch()
    assert find_socket(env) == str(system)
    (xdg / "priod.sock").touch()
    assert find_socket(env) == str(xdg / "priod.sock")
    (tmp_path / "gone.sock").touch()
    assert find_socket(env) == str(tmp_path / "gone.sock")


@pytest.mark.skipif(
    os.path.exists(SYSTEM_SOCKET), reason=f"a daemon listens at {SYSTEM_SOCKET} here; the test needs it absent"
)
def test_status_and_connect_fall_through_to_a_daemon_under_xdg_runtime_dir(tmp_path: Path) -> None:
    """With $PRIOD_SOCKET naming nothing, ``priod status`` reaches the daemon at
    $XDG_RUNTIME_DIR/priod.sock; with nothing anywhere it exits 1 listing all three paths."""
    xdg = tmp_path / "xdg"
    xdg.mkdir()
    env = {"PRIOD_SOCKET": str(tmp_path / "gone.sock"), "XDG_RUNTIME_DIR": str(xdg)}
    missing = run_cli("status", env=env)
    assert missing.returncode == 1
    assert missing.stderr == (
        f"priod: no priod daemon socket found; tried {tmp_path}/gone.sock ($PRIOD_SOCKET), {xdg}/priod.sock ($XDG_RUNTIME_DIR/priod.sock), "
        f"{SYSTEM_SOCKET} (the system socket) and none exists. Start the daemon (systemctl start priod.socket, or priod serve), "
        "or give its path (--socket, or PRIOD_SOCKET)\n"
    )
    with daemon_process({"PRIOD_LOG__LEVEL": '"warning"'}, socket_path=str(xdg / "priod.sock")) as d:
        found = run_cli("status", "--json", env=env)
        assert found.returncode == 0, found.stderr
        assert f'"socket": "{d.socket_path}"' in found.stdout


async def test_connect_without_a_path_waits_for_the_socket_to_appear(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``priod.connect()`` with ``wait_s`` keeps looking while no socket exists yet (a daemon
    starting), then connects to the one that appears."""
    xdg = tmp_path / "xdg"
    xdg.mkdir()
    monkeypatch.setattr(priod.common.socket_path, "SYSTEM_SOCKET", str(tmp_path / "no-system.sock"))
    monkeypatch.delenv("PRIOD_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    with pytest.raises(priod.ConnectionClosed, match=r"^no priod daemon socket found; tried "):
        await priod.connect(wait_s=0.1)
    waiting = asyncio.ensure_future(priod.connect(name="early", wait_s=30))
    await asyncio.sleep(0.2)
    assert not waiting.done()
    with daemon_process({"PRIOD_LOG__LEVEL": '"warning"'}, socket_path=str(xdg / "priod.sock")) as d:
        client = await waiting
        try:
            assert client.path == d.socket_path
            await client.ping()
        finally:
            await client.close()
