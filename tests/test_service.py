"""Running priod as a service: systemd units, the notify protocol, socket activation, stop and
reload semantics, ``priod status`` and the structured log.

Every daemon here runs in its own process (``python -m priod serve``) on the sim engine, as
systemd would run it; the tests talk to it only through its socket, signals and files.
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import priod
from priod.client import Client, SyncClient
from priod.common.gpus import sim_uuid
from priod.daemon import systemd
from priod.testing import DaemonProcess, daemon_process, wait_until

ROOT = Path(__file__).resolve().parent.parent
UNITS = ROOT / "config" / "systemd"
MiB = 1 << 20

# A slow link keeps queued work queued for as long as a test needs it: 64 MB/s moves a 4 MiB
# copy in about 65 ms, so a few dozen queued ones outlast any round trip to the daemon.
SLOW = {"PRIOD_SIM__H2D_GBPS": "0.064", "PRIOD_SIM__D2H_GBPS": "0.064", "PRIOD_TUNING__MIN_CHUNK_BYTES": "65536"}


# -- units ---------------------------------------------------------------------------------


def unit_entries(path: Path) -> list[tuple[str, str, str]]:
    """(section, key, value) for each assignment; systemd allows repeated keys, so no dict."""
    section, out = "", []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.append((section, key.strip(), value.strip()))
    return out


def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    """``systemd-analyze verify`` accepts both units without a single warning.

    verify insists that ExecStart's binary exists, so it checks a copy whose ExecStart points at
    this checkout's ``priod`` entry point instead of /usr/bin/priod; nothing else is changed.
    """
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here (apt install systemd); the units were not verified")
    binary = Path(sys.executable).parent / "priod"
    if not binary.exists():
        pytest.skip(f"no priod entry point at {binary}; run 'pip install -e .' in the venv")
    service = (UNITS / "priod.service").read_text()
    assert service.count("ExecStart=/usr/bin/priod ") == 1
    (tmp_path / "priod.service").write_text(service.replace("ExecStart=/usr/bin/priod ", f"ExecStart={binary} "))
    shutil.copy(UNITS / "priod.socket", tmp_path / "priod.socket")
    r = subprocess.run(
        [analyze, "verify", "--man=no", "priod.socket", "priod.service"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (r.returncode, r.stdout + r.stderr) == (0, "")


def test_unit_settings_for_notify_watchdog_activation_and_gpus() -> None:
    """The unit's settings are there: Type=notify with a watchdog, the hardening set,
    a closed device policy that allows the NVIDIA device groups (test_device_allow_covers_...)
    and no PrivateDevices=; a 0660 socket of group priod."""
    svc = unit_entries(UNITS / "priod.service")
    one = {k: v for s, k, v in svc if s == "Service" and k != "DeviceAllow"}
    assert one["Type"] == "notify"
    assert one["NotifyAccess"] == "main"
    assert one["WatchdogSec"] == "10s"
    assert one["ExecReload"] == "/bin/kill -HUP $MAINPID"
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp"):
        assert one[key] == "yes", key
    assert one["ProtectSystem"] == "strict"
    assert "PrivateDevices" not in one
    assert one["DevicePolicy"] == "closed"
    devices = [v for s, k, v in svc if k == "DeviceAllow"]
    assert devices == [f"char-{g} rw" for g in ("nvidia-frontend", "nvidia", "nvidia-uvm", "nvidia-caps")]
    assert ("Unit", "Requires", "priod.socket") in svc
    sock = {k: v for s, k, v in unit_entries(UNITS / "priod.socket") if s == "Socket"}
    assert sock == {
        "ListenStream": "/run/priod/priod.sock",
        "Accept": "no",
        "SocketUser": "root",
        "SocketGroup": "priod",
        "SocketMode": "0660",
        "DirectoryMode": "0755",
        "RemoveOnStop": "yes",
    }


# /proc/devices as the NVIDIA driver fills it (open-gpu-kernel-modules: nv-frontend.c registers
# major 195 as "nvidia-frontend", uvm "nvidia-uvm", nv-caps.c "nvidia-caps"; the other majors
# are dynamic), and as drivers from before the frontend module named major 195: "nvidia".
PROC_DEVICES = {
    "frontend": """Character devices:
  1 mem
  4 tty
195 nvidia-frontend
234 nvidia-nvswitch
235 nvidia-uvm
236 nvidia-nvlink
237 nvidia-caps
238 nvidia-caps-imex-channels

Block devices:
  8 sd
""",
    "legacy": """Character devices:
  1 mem
195 nvidia
249 nvidia-uvm

Block devices:
  8 sd
""",
}


def proc_devices_groups(text: str) -> dict[str, list[tuple[int, str]]]:
    """{"c": [(major, group), ...], "b": [...]} of a /proc/devices text."""
    out: dict[str, list[tuple[int, str]]] = {"c": [], "b": []}
    kind = ""
    for line in text.splitlines():
        if line.strip() in ("Character devices:", "Block devices:"):
            kind = "c" if line.startswith("Character") else "b"
        elif line.strip() and kind:
            major, name = line.split(None, 1)
            out[kind].append((int(major), name.strip()))
    return out


def device_allowed(entries: list[str], node: str, kind: str, major: int, access: str, proc_devices: str) -> bool:
    """Whether DeviceAllow= entries let a process open ``node`` (type ``kind``, ``major``) for
    ``access``, as systemd's device filter decides (bpf_devices_allow_list_*): a /dev/ path is
    that node, ``char-GLOB`` / ``block-GLOB`` every major whose /proc/devices group name matches
    GLOB (fnmatch, case-sensitive), whatever the minor; nothing else is allowed (closed policy)."""
    groups = proc_devices_groups(proc_devices)
    for entry in entries:
        spec, _, rights = entry.partition(" ")
        if not set(access) <= set(rights):
            continue
        if spec == node:
            return True
        for prefix, k in (("char-", "c"), ("block-", "b")):
            if spec.startswith(prefix) and k == kind:
                pattern = spec[len(prefix) :]
                if any(m == major and fnmatch.fnmatchcase(name, pattern) for m, name in groups[k]):
                    return True
    return False


def test_device_allow_covers_every_gpu_and_the_control_nodes() -> None:
    """The unit's DeviceAllow= lines let the daemon open /dev/nvidia0 to /dev/nvidia15 (not
    only nvidia0: a host with 8 GPUs is served whole), /dev/nvidiactl, /dev/nvidia-modeset,
    /dev/nvidia-uvm, /dev/nvidia-uvm-tools and the MIG capability nodes, with the driver's group
    names of today and of drivers before the frontend module; not other devices, nor the
    NVSwitch fabric nodes the daemon does not use."""
    entries = [v for s, k, v in unit_entries(UNITS / "priod.service") if s == "Service" and k == "DeviceAllow"]
    for variant, text in PROC_DEVICES.items():
        major = {name: m for m, name in proc_devices_groups(text)["c"]}
        gpu = major.get("nvidia-frontend", major.get("nvidia"))
        assert gpu == 195, variant
        used = {f"/dev/nvidia{i}": gpu for i in range(16)}
        used |= {"/dev/nvidiactl": gpu, "/dev/nvidia-modeset": gpu}
        used |= {"/dev/nvidia-uvm": major["nvidia-uvm"], "/dev/nvidia-uvm-tools": major["nvidia-uvm"]}
        if "nvidia-caps" in major:
            used |= {f"/dev/nvidia-caps/nvidia-cap{i}": major["nvidia-caps"] for i in (1, 2)}
        refused = [node for node, m in used.items() if not device_allowed(entries, node, "c", m, "rw", text)]
        assert refused == [], f"{variant}: the unit refuses {refused}"
        assert not device_allowed(entries, "/dev/mem", "c", 1, "r", text)
        assert not device_allowed(entries, "/dev/sda", "b", 8, "r", text)
        if "nvidia-nvswitch" in major:
            assert not device_allowed(entries, "/dev/nvidia-nvswitchctl", "c", major["nvidia-nvswitch"], "rw", text)
    # The emulation is not vacuous: the unit as it was (nvidia0 only) is caught.
    before = [f"/dev/{n} rw" for n in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset", "nvidia0")]
    assert not device_allowed(before, "/dev/nvidia1", "c", 195, "rw", PROC_DEVICES["frontend"])


def test_device_allow_covers_this_hosts_nvidia_nodes() -> None:
    """On a host with an NVIDIA driver: every GPU, control, UVM and MIG capability node that
    exists is allowed by the unit, by this host's own /proc/devices."""
    entries = [v for s, k, v in unit_entries(UNITS / "priod.service") if s == "Service" and k == "DeviceAllow"]
    real = Path("/proc/devices").read_text()
    nodes = [
        p
        for p in (*Path("/dev").glob("nvidia*"), *Path("/dev/nvidia-caps").glob("nvidia-cap*"))
        if re.fullmatch(r"nvidia(\d+|ctl|-modeset|-uvm|-uvm-tools|-cap\d+)", p.name) and p.is_char_device()
    ]
    if "nvidia" not in real or not nodes:
        pytest.skip("no NVIDIA driver on this host (the sample /proc/devices are checked by the test above)")
    refused = [
        str(p) for p in nodes if not device_allowed(entries, str(p), "c", os.major(p.stat().st_rdev), "rw", real)
    ]
    assert refused == [], f"on this host the unit refuses {refused}"


EXPOSURE_MAX = 2.0
"""systemd-analyze's exposure score the shipped unit must stay below (0 safest, 10 worst)."""


def test_unit_exposure_score_stays_low(tmp_path: Path) -> None:
    """``systemd-analyze security --offline=yes`` scores the shipped unit below 2.0 ("OK"), with
    the hardening the unit promises, and without the settings a GPU daemon cannot have:
    PrivateUsers= (the daemon reads clients' real uids with SO_PEERCRED), PrivateDevices= (no
    /dev/nvidia* in it), MemoryDenyWriteExecute= (the driver's PTX JIT)."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here (apt install systemd); the unit was not scored")
    usage = subprocess.run([analyze, "security", "--help"], capture_output=True, text=True, timeout=60).stdout
    if "--offline" not in usage:
        pytest.skip("this systemd-analyze has no 'security --offline' (systemd < 250); the unit was not scored")
    shutil.copy(UNITS / "priod.service", tmp_path / "priod.service")
    r = subprocess.run(
        [analyze, "security", "--offline=yes", "--no-pager", str(tmp_path / "priod.service")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"Overall exposure level for priod\.service: (\d+\.\d+) ", r.stdout)
    assert m is not None, r.stdout[-2000:]
    assert float(m.group(1)) < EXPOSURE_MAX, r.stdout
    svc = {k: v for s, k, v in unit_entries(UNITS / "priod.service") if s == "Service"}
    for key in ("ProtectKernelTunables", "PrivateMounts", "RemoveIPC", "NoNewPrivileges", "ProtectHome"):
        assert svc[key] == "yes", key
    assert svc["ProtectProc"] == "invisible" and svc["SystemCallErrorNumber"] == "EPERM"
    filters = [v for s, k, v in unit_entries(UNITS / "priod.service") if k == "SystemCallFilter"]
    assert filters == ["@system-service", "~@privileged"]
    for absent in ("PrivateUsers", "PrivateDevices", "MemoryDenyWriteExecute", "ProcSubset"):
        assert absent not in svc, absent


def test_sysusers_fragment_creates_user_and_group(tmp_path: Path) -> None:
    """The sysusers.d fragment creates a system user priod with a group priod of the same name."""
    sysusers = shutil.which("systemd-sysusers")
    if sysusers is None:
        pytest.skip("systemd-sysusers is not installed here; the fragment was not checked")
    (tmp_path / "etc").mkdir()
    r = subprocess.run(
        [sysusers, f"--root={tmp_path}", str(UNITS / "priod.sysusers.conf")], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    passwd = (tmp_path / "etc" / "passwd").read_text().split(":")
    group = (tmp_path / "etc" / "group").read_text().split(":")
    assert (passwd[0], passwd[3], passwd[5], passwd[6].strip()) == (
        "priod",
        group[2],
        "/nonexistent",
        "/usr/sbin/nologin",
    )
    assert group[0] == "priod"


# -- sd_notify and socket activation -------------------------------------------------------


def test_notify_sends_datagrams_to_path_and_abstract_sockets(tmp_path: Path) -> None:
    """notify() sends one datagram to $NOTIFY_SOCKET (a path, or '@name' for an abstract
    socket) and reports False when the variable is unset."""
    path = str(tmp_path / "notify")
    abstract = f"priod-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as a, socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as b:
        a.bind(path)
        b.bind("\0" + abstract)
        assert systemd.notify("READY=1\nSTATUS=up", {"NOTIFY_SOCKET": path})
        assert systemd.notify("WATCHDOG=1", {"NOTIFY_SOCKET": "@" + abstract})
        assert a.recv(4096) == b"READY=1\nSTATUS=up"
        assert b.recv(4096) == b"WATCHDOG=1"
    assert not systemd.notify("READY=1", {})


def test_listen_fds_and_watchdog_only_for_this_process() -> None:
    """Activation fds and the watchdog are only taken when LISTEN_PID / WATCHDOG_PID name this
    process (sd_listen_fds(3)); the variables are removed once read."""
    env = {"LISTEN_PID": str(os.getpid() + 1), "LISTEN_FDS": "1"}
    assert systemd.listen_fds(env) == []
    assert env == {"LISTEN_PID": str(os.getpid() + 1), "LISTEN_FDS": "1"}
    env = {"LISTEN_PID": str(os.getpid()), "LISTEN_FDS": "0", "LISTEN_FDNAMES": ""}
    assert systemd.listen_fds(env) == []
    assert env == {}
    assert systemd.watchdog_interval({"WATCHDOG_USEC": "10000000"}) == 5.0
    assert systemd.watchdog_interval({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": str(os.getpid())}) == 5.0
    assert systemd.watchdog_interval({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "1"}) is None
    assert systemd.watchdog_interval({}) is None


# Stands in for systemd between fork and exec: the listening socket moves to fd 3 and
# LISTEN_PID / WATCHDOG_PID name the process that will run priod (exec keeps the pid).
_ACTIVATE = """
import os, sys
fd = int(sys.argv[1])
if fd != 3:
    os.dup2(fd, 3)
    os.close(fd)
pid = str(os.getpid())
os.environ.update(LISTEN_PID=pid, LISTEN_FDS="1", LISTEN_FDNAMES="priod.socket", WATCHDOG_PID=pid)
os.execv(sys.executable, [sys.executable, "-m", "priod", *sys.argv[2:]])
"""


class NotifyListener:
    """The service manager's end of $NOTIFY_SOCKET: collects every datagram the daemon sends."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.05)
        self.messages: list[str] = []

    def drain(self) -> list[str]:
        while True:
            try:
                self.messages.append(self.sock.recv(65536).decode())
            except TimeoutError:
                return self.messages

    def wait_for(self, pattern: str, count: int = 1, start: int = 0, timeout: float = 30.0) -> int:
        """Wait until ``count`` messages after index ``start`` match; returns the index of the last."""
        rx = re.compile(pattern)

        def found() -> int | None:
            hits = [i for i, m in enumerate(self.drain()) if i >= start and rx.search(m)]
            return hits[count - 1] + 1 if len(hits) >= count else None

        return wait_until(found, timeout, f"{count} notify message(s) matching {pattern!r}; got {self.messages}") - 1

    def close(self) -> None:
        self.sock.close()


def test_notify_protocol_under_socket_activation(tmp_path: Path) -> None:
    """Run the way systemd runs it: the daemon takes fd 3 from LISTEN_FDS and serves copies on
    it, sends READY=1 and STATUS=, WATCHDOG=1 at half of WATCHDOG_USEC, RELOADING=1 then READY=1
    on SIGHUP, STOPPING=1 on SIGTERM, exits 0, and leaves the socket file (systemd's) in place."""
    sock_path = str(tmp_path / "priod.sock")
    listener = NotifyListener(str(tmp_path / "notify"))
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(sock_path)
    listening.listen(16)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PRIOD_", "LISTEN_", "WATCHDOG_", "NOTIFY_"))}
    env.update(NOTIFY_SOCKET=listener.sock.getsockname(), WATCHDOG_USEC="200000")
    log_path = tmp_path / "daemon.log"
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _ACTIVATE,
                str(listening.fileno()),
                "serve",
                "--backend",
                "sim",
                "--socket",
                sock_path,
            ],
            pass_fds=(listening.fileno(),),
            env=env,
            stdout=logf,
            stderr=subprocess.STDOUT,
        )
    listening.close()  # the daemon holds the only copy now, as with systemd's Accept=no
    try:
        ready = listener.wait_for(r"^READY=1\nSTATUS=serving on ")
        with SyncClient(sock_path, name="activated", timeout=30, copy_path="daemon") as c:
            host, dev = c.alloc_host(MiB), c.alloc_device(MiB)
            assert host.array is not None and dev.array is not None
            host.array[:] = 7
            assert c.copy(dev, host, priority="urgent").nbytes == MiB
            assert (dev.array == 7).all()
            listener.wait_for(r"^WATCHDOG=1$", count=3, start=ready)
            listener.wait_for(r"^STATUS=serving 1 clients, 1 copies", start=ready)
            proc.send_signal(signal.SIGHUP)
            reloading = listener.wait_for(r"^RELOADING=1\nMONOTONIC_USEC=\d+$", start=ready)
            listener.wait_for(r"^READY=1$", start=reloading)
            assert c.copy(host, dev, priority="bulk").nbytes == MiB  # the connection survived
            proc.send_signal(signal.SIGTERM)
            listener.wait_for(r"^STOPPING=1$", start=reloading)
        assert proc.wait(timeout=30) == 0, log_path.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        messages = listener.drain()
        listener.close()
    assert stat.S_ISSOCK(os.stat(sock_path).st_mode), "with socket activation the socket file is systemd's to remove"
    assert messages[0].startswith("READY=1\n")
    assert messages[-1] == "STOPPING=1"
    assert all(
        re.fullmatch(r"READY=1(\nSTATUS=.*)?|STATUS=.*|WATCHDOG=1|RELOADING=1\nMONOTONIC_USEC=\d+|STOPPING=1", m)
        for m in messages
    ), messages
    started = [json.loads(line) for line in log_path.read_text().splitlines() if '"daemon_started"' in line]
    assert started[0]["socket"] == sock_path


def test_daemon_binding_itself_removes_its_socket_on_stop() -> None:
    """Without socket activation the daemon binds the path itself with [server] socket_mode,
    and removes it again when it stops."""
    with daemon_process({"PRIOD_SERVER__SOCKET_MODE": "0o640"}) as d:
        assert stat.S_IMODE(os.stat(d.socket_path).st_mode) == 0o640
        assert d.stop() == 0
    assert not os.path.exists(d.socket_path)


# -- priod status ----------------------------------------------------------------------------


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRIOD_")}
    return subprocess.run(
        [sys.executable, "-m", "priod", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def test_status_cli_table_and_json(daemon: DaemonProcess) -> None:
    """``priod status`` prints lanes with bandwidths, classes, clients and uptime as a table,
    and the same as JSON with ``--json``; it sees this test's connection and its copies."""
    with SyncClient(daemon.socket_path, name="status-test", timeout=30, copy_path="daemon") as c:
        host, dev = c.alloc_host(MiB), c.alloc_device(MiB)
        c.copy(dev, host, priority="bulk")
        me = c.server.peer
        r = run_cli("status", "--socket", daemon.socket_path)
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert re.fullmatch(
            rf"priod {re.escape(priod.__version__)}  backend=sim  mode=priod  uptime=\d+s  socket={re.escape(daemon.socket_path)}",
            lines[0],
        )
        assert lines[1] == "max_block_us=1000.0  classes: urgent(strict), high(w=8), normal(w=4), bulk(w=1)"
        assert lines[2].split() == ["gpu0", sim_uuid(0)]
        assert lines[4].split() == [
            "lane",
            "GB/s",
            "chunk",
            "bound",
            "in",
            "flight",
            "express",
            "queued",
            "(requests",
            "by",
            "class)",
        ]
        assert [ln.split()[:2] for ln in lines[5:8]] == [
            ["gpu0/d2d", "8.00"],
            ["gpu0/d2h", "2.00"],
            ["gpu0/h2d", "2.00"],
        ]
        assert re.fullmatch(r"clients: 2   copies: \d+   bytes: \d+\.\d{3} GB   deadline misses: \d+", lines[9])
        mine = [ln for ln in lines[10:] if f" pid {me['pid']} " in ln]
        assert len(mine) == 1 and re.search(r"regions 2 +pending 0 +copies 1  status-test$", mine[0]), lines

        r = run_cli("status", "--json", "--socket", daemon.socket_path)
        assert r.returncode == 0, r.stderr
        st = json.loads(r.stdout)
    assert st["version"] == priod.__version__ and st["backend"] == "sim" and st["uptime_s"] > 0
    assert [(c["name"], c["weight"], c["strict"]) for c in st["classes"]] == [
        ("urgent", 1, True),
        ("high", 8, False),
        ("normal", 4, False),
        ("bulk", 1, False),
    ]
    assert {ln["lane"]: ln["bandwidth_gbps"] for ln in st["lanes"]} == {
        "gpu0/d2d": 8.0,
        "gpu0/d2h": 2.0,
        "gpu0/h2d": 2.0,
    }
    client = next(c for c in st["clients"] if c["pid"] == me["pid"])
    assert (client["uid"], client["regions"], client["pinned_bytes"], client["device_bytes"], client["copies"]) == (
        me["uid"],
        2,
        MiB,
        MiB,
        1,
    )
    assert st["totals"]["copies"] >= 1


def test_status_cli_without_daemon_says_what_to_do(tmp_path: Path) -> None:
    """Against a path where no daemon listens, ``priod status`` exits 1 and says how to fix it."""
    path = str(tmp_path / "none.sock")
    r = run_cli("status", "--socket", path)
    assert (r.returncode, r.stdout) == (1, "")
    assert (
        r.stderr
        == f"priod: no priod daemon at {path} (No such file or directory); start one with 'priod serve' or pass its socket path\n"
    )


# -- SIGTERM -------------------------------------------------------------------------------

# The client's event loop does not matter to a daemon in another process: run these once.
ONE_LOOP = pytest.mark.asyncio(loop_factories=["asyncio"])


async def queue_bulk(c: Client, count: int, nbytes: int = 4 * MiB) -> list[Any]:
    """``count`` bulk copies queued behind each other on the (slow) h2d lane."""
    host, dev = await c.alloc_host(nbytes), await c.alloc_device(nbytes)
    handles = [c.start_copy(dev, host, priority="bulk") for _ in range(count)]
    st = await c.status()  # a round trip: every copy above has reached the daemon
    assert sum(cl["pending"] for cl in st["clients"]) == count - st["totals"]["copies"]
    return handles


async def outcomes(handles: list[Any], timeout: float = 60.0) -> list[str]:
    """Wait for every reply (a hang fails the test); "done" or the error's class name."""

    async def one(h: Any) -> str:
        try:
            await h
            return "done"
        except priod.PriodError as exc:
            return type(exc).__name__

    return list(await asyncio.wait_for(asyncio.gather(*map(one, handles)), timeout))


def wait_log_event(d: DaemonProcess, event: str, timeout: float = 30.0) -> dict[str, Any]:
    return wait_until(
        lambda: next((e for e in d.log_records() if e.get("event") == event), None), timeout, f"log event {event!r}"
    )


@ONE_LOOP
async def test_sigterm_finish_completes_queued_work_and_refuses_new() -> None:
    """With [service] shutdown = "finish", SIGTERM lets every queued copy complete and answers
    each one; copies sent after it are refused with ShuttingDown; the daemon exits 0."""
    with daemon_process(SLOW) as d:
        # reconnect_s=0: the connection is to stay closed once the daemon has gone (no new one comes)
        c = await Client.connect(d.socket_path, copy_path="daemon", reconnect_s=0)
        handles = await queue_bulk(c, 8)
        d.proc.send_signal(signal.SIGTERM)
        assert wait_log_event(d, "daemon_stopping")["policy"] == "finish"
        wait_until(lambda: not os.path.exists(d.socket_path), what="the socket file to go")
        with pytest.raises(
            priod.ConnectionClosed,
            match=r"^no priod daemon at .*; start one with 'priod serve' or pass its socket path$",
        ):
            await Client.connect(d.socket_path, copy_path="daemon")  # no new connections
        host, dev = await c.alloc_host(4096), await c.alloc_device(4096)  # other requests still work
        with pytest.raises(
            priod.ShuttingDown, match=r"^the daemon is stopping and takes no new copies; retry once it is back$"
        ):
            await c.copy(dev, host, priority="urgent")
        assert await outcomes(handles) == ["done"] * 8
        assert d.proc.wait(timeout=60) == 0
        with pytest.raises(priod.ConnectionClosed, match=rf"^connection to priod at {re.escape(d.socket_path)} lost: "):
            await c.ping()
        await c.close()
    assert not os.path.exists(d.socket_path)
    stopped = [e for e in d.log_records() if e["event"] == "daemon_stopped"]
    assert stopped and stopped[0]["copies"] == 8


@ONE_LOOP
async def test_sigterm_cancel_answers_queued_work_with_shutting_down() -> None:
    """With [service] shutdown = "cancel", SIGTERM cancels queued copies at the next chunk
    boundary: each gets a reply (done, or ShuttingDown), none hangs, the daemon exits 0."""
    with daemon_process({**SLOW, "PRIOD_SERVICE__SHUTDOWN": '"cancel"', "PRIOD_LOG__LEVEL": '"debug"'}) as d:
        c = await Client.connect(d.socket_path, copy_path="daemon")
        handles = await queue_bulk(c, 32)  # about 2 s of work
        d.proc.send_signal(signal.SIGTERM)
        got = await outcomes(handles)
        assert set(got) <= {"done", "ShuttingDown"} and got[-1] == "ShuttingDown", got
        assert d.proc.wait(timeout=60) == 0
        await c.close()
    copies = [e for e in d.log_records() if e["event"] == "copy"]
    assert len(copies) == 32
    assert {e["outcome"] for e in copies} <= {"done", "shutting_down"}


@ONE_LOOP
async def test_sigterm_finish_is_bounded_by_shutdown_timeout() -> None:
    """ "finish" waits at most [service] shutdown_timeout_s: what is still queued then is
    answered with ShuttingDown, and the daemon exits 0 long before the work would be done."""
    with daemon_process({**SLOW, "PRIOD_SERVICE__SHUTDOWN_TIMEOUT_S": "0.3"}) as d:
        c = await Client.connect(d.socket_path, copy_path="daemon")
        handles = await queue_bulk(c, 200)  # about 13 s of work
        d.proc.send_signal(signal.SIGTERM)
        got = await outcomes(handles)
        assert got[-1] == "ShuttingDown" and set(got) <= {"done", "ShuttingDown"}
        assert d.proc.wait(timeout=60) == 0
        await c.close()
    assert "done" not in got[-100:]  # a bound, not a race: the last 100 need 6 s of link time


# -- SIGHUP --------------------------------------------------------------------------------

CONFIG_BEFORE = """
[classes.urgent]
strict = true
[classes.bulk]
weight = 1
"""

CONFIG_AFTER = """
[classes.urgent]
strict = true
[classes.interactive]
weight = 6
[classes.bulk]
weight = 2
[limits]
max_regions = 2
"""


@ONE_LOOP
async def test_sighup_reloads_classes_weights_and_limits_keeping_connections(tmp_path: Path) -> None:
    """SIGHUP re-reads --config: new classes and weights show in ``status`` and take copies, new
    limits apply, and the same connection, its regions and its queued copies carry on."""
    config = tmp_path / "priod.toml"
    config.write_text(CONFIG_BEFORE)
    with daemon_process(SLOW, config=str(config)) as d:
        c = await Client.connect(d.socket_path, copy_path="daemon")
        host, dev = await c.alloc_host(4096), await c.alloc_device(4096)
        handles = await queue_bulk(c, 8)
        with pytest.raises(priod.InvalidRequest, match=r"^unknown class 'interactive'; the classes are "):
            await c.copy(dev, host, priority="interactive")
        config.write_text(CONFIG_AFTER)
        d.proc.send_signal(signal.SIGHUP)

        async def reloaded() -> dict[str, Any]:
            while True:
                st = await c.status()
                if len(st["classes"]) == 3:
                    return st
                await asyncio.sleep(0.02)

        st = await asyncio.wait_for(reloaded(), 30)
        assert [(k["name"], k["weight"], k["strict"]) for k in st["classes"]] == [
            ("urgent", 1, True),
            ("interactive", 6, False),
            ("bulk", 2, False),
        ]
        assert [cl["regions"] for cl in st["clients"]] == [4]
        assert (await c.copy(dev, host, priority="interactive")).nbytes == 4096
        with pytest.raises(
            priod.LimitExceeded,
            match=r"^this connection holds 4 regions \(\[limits\] max_regions = 2\); free some first$",
        ):
            await c.alloc_host(4096)
        assert await outcomes(handles) == ["done"] * 8
        await c.close()
    events = [e["event"] for e in d.log_records()]
    assert events.count("config_reloaded") == 1
    assert events.count("client_connected") == 2  # the harness's probe, then this test's client


@ONE_LOOP
async def test_sighup_with_a_broken_config_keeps_the_old_one(tmp_path: Path) -> None:
    """A config file that fails validation on SIGHUP is logged and ignored: the daemon keeps
    its configuration and its connections."""
    config = tmp_path / "priod.toml"
    config.write_text(CONFIG_BEFORE)
    with daemon_process(config=str(config)) as d:
        c = await Client.connect(d.socket_path, copy_path="daemon")
        config.write_text("[classes.bulk]\nweight = 0\n")
        d.proc.send_signal(signal.SIGHUP)
        failed = wait_log_event(d, "reload_failed")
        assert failed["error"] == "[classes.bulk] weight = 0 is invalid; set weight >= 1"
        assert failed["hint"] == "the previous configuration stays in force"
        st = await c.status()
        assert [k["name"] for k in st["classes"]] == ["urgent", "bulk"]
        await c.close()


# -- logs ----------------------------------------------------------------------------------


@ONE_LOOP
async def test_log_is_json_lines_with_one_line_per_copy_and_connection_context() -> None:
    """The log (stdout, not a tty) is one JSON object per line. At debug level each finished copy
    has one "copy" line with class, bytes, times and outcome (a failed one is a warning at any
    level); lines caused by a connection carry its conn, client_pid and uid; errors name their
    cause chain."""
    with daemon_process({"PRIOD_SIM__FAULT_ON_NBYTES": "12345", "PRIOD_LOG__LEVEL": '"debug"'}) as d:
        async with priod.connect(d.socket_path, name="log-test", copy_path="daemon") as c:
            host, dev = await c.alloc_host(MiB), await c.alloc_device(MiB)
            await c.copy(dev, host, priority="urgent")
            await c.copy(host, dev, 65536, priority="bulk", deadline_ms=60_000)
            with pytest.raises(priod.EngineError, match=r"^copy failed after 0 of 12345 bytes: injected engine fault"):
                await c.copy(dev, host, 12345)
            with pytest.raises(
                priod.InvalidRequest, match=r"^dst_offset 0 \+ nbytes 2097152 is outside region \d+ of 1048576 bytes"
            ):
                await c.copy(dev, host, 2 * MiB)  # refused before it is a copy: no "copy" line
            conn = (await c.status())["clients"][0]["conn"]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.connect(d.socket_path)
            raw.sendall(b"\x00\x00\x00\x03\x81\x01\x02")  # a msgpack map with an int key
            raw.settimeout(30)
            while raw.recv(4096):  # the daemon answers with an error and closes
                pass
        assert d.stop() == 0
    raw_lines = d.log().splitlines()
    entries = [json.loads(line) for line in raw_lines]  # every line is JSON
    assert all({"event", "level", "timestamp"} <= e.keys() for e in entries)
    me = {"conn": conn, "client_pid": os.getpid(), "uid": os.getuid()}
    ours = [e for e in entries if e.get("conn") == conn]
    assert {e["event"] for e in ours} >= {"client_connected", "host_region_registered", "copy", "client_disconnected"}
    assert all(e["client_pid"] == me["client_pid"] and e["uid"] == me["uid"] for e in ours)
    copies = [e for e in entries if e["event"] == "copy"]
    assert [(e["priority"], e["nbytes"], e["bytes_done"], e["outcome"], e["lane"]) for e in copies] == [
        ("urgent", MiB, MiB, "done", "gpu0/h2d"),
        ("bulk", 65536, 65536, "done", "gpu0/d2h"),
        ("normal", 12345, 0, "failed", "gpu0/h2d"),
    ]
    assert [e["level"] for e in copies] == ["debug", "debug", "warning"]
    for e in copies:
        assert e.items() >= me.items()
        assert 0 <= e["queued_us"] <= e["total_us"]
    assert copies[2]["error"].startswith("injected engine fault on a chunk of 12345 bytes")
    bad = [e for e in entries if e["event"] == "protocol_error"]
    assert len(bad) == 1 and bad[0]["level"] == "warning"
    assert bad[0]["error"] == "frame body is not valid msgpack (ValueError); encode each frame as one msgpack map"
    assert bad[0]["causes"] == ["ValueError: int is not allowed for map key when strict_map_key=True"]
    assert bad[0]["conn"] != conn and bad[0]["uid"] == os.getuid()


def test_under_journald_each_line_carries_its_syslog_priority(tmp_path: Path) -> None:
    """With stdout the journal's stream ($JOURNAL_STREAM = its device:inode), each JSON line
    starts with its syslog priority (<6> info, <4> warning, <3> error), which journald turns
    into the entry's priority; anywhere else the lines stay bare JSON."""
    log_path = tmp_path / "daemon.log"
    sock = str(tmp_path / "s.sock")
    with open(log_path, "wb") as out:
        st = os.fstat(out.fileno())
        env = {k: v for k, v in os.environ.items() if not k.startswith("PRIOD_")}
        env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "priod", "serve", "--socket", sock, "--backend", "sim"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        wait_until(lambda: os.path.exists(sock) or None, what="the daemon's socket")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.connect(sock)
            raw.sendall(b"\x00\x00\x00\x03\x81\x01\x02")  # a map with an int key: a protocol error, logged as a warning
            raw.settimeout(30)
            while raw.recv(4096):
                pass
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    lines = log_path.read_text().splitlines()
    parsed = [
        (int(m.group(1)), json.loads(m.group(2))) for m in (re.match(r"^<(\d)>(\{.*\})$", line) for line in lines) if m
    ]
    assert len(parsed) == len(lines) > 0, lines[:5]
    assert {(prio, e["level"]) for prio, e in parsed} >= {(6, "info"), (4, "warning")}
    assert all({"info": 6, "warning": 4, "error": 3, "debug": 7}[e["level"]] == prio for prio, e in parsed)


@ONE_LOOP
async def test_a_copy_held_for_its_event_across_a_reload_that_removes_its_class_still_lands(tmp_path: Path) -> None:
    """A copy waiting on its wait_event when SIGHUP removes its class moves to the fallback
    class, as queued copies do, and lands once its event completes (it used to fail with
    ``engine: unknown class``)."""
    from priod.wire.ipc_event import SimEvent

    config = tmp_path / "priod.toml"
    config.write_text(CONFIG_AFTER.replace("[limits]\nmax_regions = 2\n", ""))
    with daemon_process(config=str(config)) as d:
        c = await Client.connect(d.socket_path, copy_path="daemon")
        host, dev, evr = await c.alloc_host(65536), await c.alloc_device(65536), await c.alloc_device(4096)
        assert host.array is not None and dev.array is not None
        host.array[:] = 7
        ev = SimEvent(evr, 0)
        ev.record()
        held = c.start_copy(dev, host, wait_event=ev, priority="interactive")
        config.write_text(CONFIG_BEFORE)
        d.proc.send_signal(signal.SIGHUP)
        wait_log_event(d, "config_reloaded")
        ev.complete()
        r = await held.wait(timeout=10)
        assert r.nbytes == 65536 and (dev.array == 7).all()
        await c.close()


@ONE_LOOP
async def test_a_reload_that_raises_the_request_rate_frees_connections_waiting_for_a_token(tmp_path: Path) -> None:
    """A connection out of request tokens waits for the next one to accrue; when SIGHUP raises
    the rate, it asks again under the new rate at once instead of waiting out the old rate's
    timer (10 s here)."""
    config = tmp_path / "priod.toml"
    config.write_text("[limits]\nmax_requests_per_s_per_uid = 0.1\nrequest_burst_per_uid = 4\n")
    with daemon_process(config=str(config)) as d:
        c = await Client.connect(d.socket_path, copy_path="daemon")
        for _ in range(4):  # the burst's last tokens (hello took one)
            try:
                await asyncio.wait_for(c.ping(), 0.5)
            except TimeoutError:
                break
        waiting = asyncio.ensure_future(c.ping())
        await asyncio.sleep(0.3)
        assert not waiting.done(), "the uid should be out of tokens"
        config.write_text("[limits]\nmax_requests_per_s_per_uid = 10000.0\nrequest_burst_per_uid = 2000\n")
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGHUP)
        await asyncio.wait_for(waiting, 5)
        assert time.monotonic() - t0 < 3, "the waiting ping waited out the old rate's timer"
        await c.close()
