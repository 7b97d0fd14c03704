"""The command line without a command, and how clients find the socket.

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
from priod.daemon.units import HiddenExecutable, exec_chain, hidden_dirs, hidden_problem, install_units, shipped
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


# -- priod install-units: an ExecStart the unit itself hides ----------------------------------

SHIPPED_HIDDEN = {
    "/home": "ProtectHome=yes",
    "/root": "ProtectHome=yes",
    "/run/user": "ProtectHome=yes",
    "/tmp": "PrivateTmp=yes",
    "/var/tmp": "PrivateTmp=yes",
}


def test_hidden_dirs_are_read_from_the_unit() -> None:
    """What the check refuses follows the shipped unit's own settings: ProtectHome=yes hides
    /home, /root and /run/user, PrivateTmp=yes /tmp and /var/tmp; ProtectHome=read-only hides
    nothing an executable needs, InaccessiblePaths= adds its paths (an empty one resets them)."""
    assert hidden_dirs(shipped("systemd/priod.service").read_text()) == SHIPPED_HIDDEN
    assert hidden_dirs("[Service]\nProtectHome=read-only\nPrivateTmp=no\n") == {}
    assert hidden_dirs("[Service]\nProtectHome=tmpfs\n")["/root"] == "ProtectHome=tmpfs"
    assert hidden_dirs("[Unit]\nProtectHome=yes\n[Service]\nInaccessiblePaths=-/srv/a /srv/b/\n") == {
        "/srv/a": "InaccessiblePaths=/srv/a",
        "/srv/b": "InaccessiblePaths=/srv/b/",
    }
    assert hidden_dirs("[Service]\nInaccessiblePaths=/srv/a\nInaccessiblePaths=\n") == {}


@pytest.mark.parametrize(
    ("prefix", "directory"),
    [
        ("/home/alice/venv", "/home"),
        ("/root/.venv", "/root"),
        ("/run/user/1000/priod", "/run/user"),
        ("/tmp/priod", "/tmp"),
        ("/var/tmp/priod/", "/var/tmp"),
    ],
)
def test_install_units_refuses_a_prefix_the_unit_hides(
    prefix: str, directory: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A prefix under /home, /root, /run/user, /tmp or /var/tmp is refused with exit status 1,
    naming the path, the setting that hides it, the 203/EXEC it would cause and the fix; nothing
    is written. (The unit runs under ProtectHome=yes and PrivateTmp=yes, so systemd would not
    find the executable.)"""
    from priod.cli import main

    root = tmp_path / "root"
    assert main(["install-units", "--dest", str(root), "--prefix", prefix]) == 1
    executable = prefix.rstrip("/") + "/bin/priod"
    assert capsys.readouterr().err == (
        f"priod: the unit could not start priod: ExecStart={executable} is under {directory}; {directory} is hidden "
        f"from the daemon by the unit's {SHIPPED_HIDDEN[directory]}, so the start fails with status 203/EXEC. "
        "Fix: install priod under /usr/local or /opt, or in a venv there (python3 -m venv /opt/priod && "
        "/opt/priod/bin/pip install ...), and run that installation's priod install-units (or pass its prefix "
        "with --prefix); or write the unit anyway with --allow-hidden-prefix\n"
    )
    assert not root.exists()


@pytest.mark.parametrize("prefix", ["/opt/priod", "/usr/local", "/usr", "/homework/priod", "/tmpfs/priod", "/"])
def test_install_units_takes_a_prefix_the_unit_can_run(
    prefix: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Prefixes outside the hidden directories pass, also ones whose name only begins like one
    (/homework is not under /home)."""
    from priod.cli import main

    root = tmp_path / "root"
    assert main(["install-units", "--dest", str(root), "--prefix", prefix]) == 0
    assert capsys.readouterr().err == ""
    executable = prefix.rstrip("/") + "/bin/priod"
    assert f"\nExecStart={executable} serve " in (root / "etc/systemd/system/priod.service").read_text()


def test_install_units_allow_hidden_prefix_writes_it_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--allow-hidden-prefix writes the unit anyway (someone who relaxes ProtectHome= in a drop-in), and still
    says on stderr why it will not start as shipped. Through the API the warning goes to
    ``warn``, and ``allow_hidden=False`` refuses even with ``force`` (which then only means
    replacing the config)."""
    from priod.cli import main

    root = tmp_path / "root"
    assert main(["install-units", "--dest", str(root), "--prefix", "/home/alice/venv", "--allow-hidden-prefix"]) == 0
    out = capsys.readouterr()
    assert out.err.startswith(
        "priod: warning: the unit could not start priod: ExecStart=/home/alice/venv/bin/priod is under /home; "
    )
    assert (
        out.err.endswith("; written anyway (--allow-hidden-prefix)\n")
        and "Fix: install priod under /usr/local or /opt" in out.err
    )
    assert "\nExecStart=/home/alice/venv/bin/priod serve " in (root / "etc/systemd/system/priod.service").read_text()

    told: list[str] = []
    install_units(root, "/tmp/p", force=True, warn=told.append)
    assert len(told) == 1 and told[0].startswith("warning: the unit could not start priod: ExecStart=/tmp/p/bin/priod")
    with pytest.raises(HiddenExecutable, match=r"ExecStart=/tmp/p/bin/priod is under /tmp; /tmp is hidden"):
        install_units(root, "/tmp/p", force=True, allow_hidden=False)
    assert install_units(root, "/root/p", allow_hidden=True, warn=told.append)[0].action == "replaced"


def _fake_venv(tmp_path: Path, launcher: bool = False) -> tuple[Path, Path]:
    """A venv-like prefix whose bin/priod runs bin/python, a symbolic link to a base Python
    elsewhere (as venv, pyenv and uv make them); returns (prefix, the base interpreter)."""
    base = tmp_path / "base" / "bin" / "python3.11"
    base.parent.mkdir(parents=True)
    base.write_text("")
    prefix = tmp_path / "opt" / "priod"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "bin" / "python").symlink_to(base)
    script = prefix / "bin" / "priod"
    if launcher:  # pip's form for an interpreter path too long for #!
        script.write_text(f"#!/bin/sh\n'''exec' \"{prefix}/bin/python\" \"$0\" \"$@\"\n' '''\nimport sys\n")
    else:
        script.write_text(f"#!{prefix}/bin/python\nimport sys\n")
    return prefix, base


@pytest.mark.parametrize("launcher", [False, True])
def test_an_interpreter_the_unit_hides_is_found_too(tmp_path: Path, launcher: bool) -> None:
    """Installing onto this machine, the check follows the executable to its #! interpreter
    (also pip's /bin/sh launcher) and that to the Python it links to: a venv under /opt whose
    python leads into /root/.pyenv fails the same way. Under a staging root only the path is
    checked (the links there are the build machine's)."""
    prefix, base = _fake_venv(tmp_path, launcher)
    executable = f"{prefix}/bin/priod"
    assert exec_chain(executable) == [
        (executable, "ExecStart"),
        (f"{prefix}/bin/python", f"{executable} runs the interpreter"),
        (str(base), f"{executable} runs the interpreter {prefix}/bin/python, a symbolic link to"),
    ]
    unit = f"[Service]\nProtectHome=yes\nInaccessiblePaths=-{tmp_path}/base\n"
    assert hidden_problem(executable, unit, resolve=True) == (
        f"the unit could not start priod: {executable} runs the interpreter {prefix}/bin/python, a symbolic link to "
        f"{base}; {tmp_path}/base is hidden from the daemon by the unit's InaccessiblePaths={tmp_path}/base, so the "
        "start fails with status 203/EXEC. Fix: install priod under /usr/local or /opt from a Python that is itself "
        f"outside /home, /root, /run/user, {tmp_path}/base (for example /usr/bin/python3 -m venv /opt/priod)"
    )
    assert hidden_problem(executable, unit, resolve=False) is None
    assert hidden_problem(executable, "[Service]\nProtectHome=yes\n", resolve=True) is None
    assert exec_chain(str(tmp_path / "nowhere" / "priod")) == [(str(tmp_path / "nowhere" / "priod"), "ExecStart")]


def test_install_units_onto_this_machine_checks_this_installations_python(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`priod install-units` as root onto / checks the priod that runs it, down to the Python
    its venv links to: it refuses exactly when one of those lies in a directory the unit hides
    (a venv made from a pyenv or uv Python under /root, say). Written under a staging root
    here, with the check made as for /."""
    import priod.daemon.units

    monkeypatch.setattr(priod.daemon.units, "_installs_here", lambda root: True)
    hidden = hidden_dirs(shipped("systemd/priod.service").read_text())
    steps = [p for p, _ in exec_chain(f"{sys.prefix}/bin/priod")]
    blocked = any(p == d or p.startswith(d + "/") for p in steps for d in hidden)
    if blocked:
        with pytest.raises(HiddenExecutable, match=r"^the unit could not start priod: "):
            install_units(tmp_path / "root")
        assert not (tmp_path / "root").exists()
    else:
        assert [w.action for w in install_units(tmp_path / "root")] == ["wrote"] * 4


def test_status_into_a_closed_pipe_stops_quietly() -> None:
    """`priod status | head -1`: the reader goes away and priod stops without a traceback, with
    the status a shell gives a command that SIGPIPE ended (13 here, 141 in a shell)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRIOD_")}
    with daemon_process({"PRIOD_LOG__LEVEL": '"warning"'}) as d:
        proc = subprocess.Popen(
            [sys.executable, "-m", "priod", "status", "--socket", d.socket_path],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()  # the reader is gone before priod writes a byte
        err = proc.stderr.read().decode()
        rc = proc.wait(timeout=60)
        proc.stderr.close()
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert rc == 13, (rc, err)
