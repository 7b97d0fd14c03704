"""Packaging (issue 13, item 5): the wheel built from a clean checkout carries the units and the
example config, its extras split the client from the daemon and CUDA 12 from 13, and a client
installed without the daemon's dependencies works and never imports them."""

from __future__ import annotations

import email.parser
import importlib.metadata
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from priod.testing import DaemonProcess

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = {
    "priod/shipped/priod.toml": "config/priod.toml",
    "priod/shipped/systemd/priod.service": "config/systemd/priod.service",
    "priod/shipped/systemd/priod.socket": "config/systemd/priod.socket",
    "priod/shipped/systemd/priod.sysusers.conf": "config/systemd/priod.sysusers.conf",
}
DAEMON_ONLY = ("uvloop", "structlog", "prometheus_client", "orjson")


def _setuptools_builds_wheels() -> bool:
    """Whether this environment's setuptools meets pyproject's build requirement (77, which
    has bdist_wheel built in), so the wheel builds offline; otherwise pip's isolated build
    fetches one (the test extra installs it)."""
    try:
        return int(importlib.metadata.version("setuptools").split(".")[0]) >= 77
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built by pip from a copy of the files git tracks (what a clean clone has)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: 'a clean checkout' is the files git tracks")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    src = tmp_path_factory.mktemp("checkout")
    out = tmp_path_factory.mktemp("dist")
    for name in filter(None, tracked):
        path = Path(os.fsdecode(name))
        if not (ROOT / path).exists() and not (ROOT / path).is_symlink():
            continue  # deleted in the working tree, not yet committed
        (src / path).parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / path).is_symlink():
            os.symlink(os.readlink(ROOT / path), src / path)  # priod/shipped -> ../config, as git checks it out
        else:
            shutil.copy2(ROOT / path, src / path)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(src)]
    if _setuptools_builds_wheels():
        cmd.insert(4, "--no-build-isolation")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    (built,) = out.glob("priod-*.whl")
    return built


def test_wheel_ships_units_config_and_every_module(wheel: Path) -> None:
    """The wheel holds the systemd units, the sysusers.d fragment and the example config, byte
    for byte as in config/, and every module git tracks under priod/ (the PTX too)."""
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for inside, original in SHIPPED.items():
            assert z.read(inside) == (ROOT / original).read_bytes(), inside
    modules = subprocess.run(
        ["git", "ls-files", "priod/*.py", "priod/**/*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert len(modules) > 30 and set(modules) <= names
    assert "priod/common/cuda/express.ptx" in names and "priod/py.typed" in names


def test_wheel_metadata_splits_client_daemon_and_cuda_majors(wheel: Path) -> None:
    """Core requirements are the client's alone; the daemon's are the ``daemon`` extra; CUDA 12
    and 13 are separate extras bounded to their major (13 needs driver >= 580), ``cuda`` = 13."""
    with zipfile.ZipFile(wheel) as z:
        meta = email.parser.Parser().parsestr(
            z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        )
    requires = meta.get_all("Requires-Dist") or []
    by_extra: dict[str, set[str]] = {}
    for req in requires:
        spec, _, marker = req.partition(";")
        extra = marker.split("extra ==")[1].strip().strip("\"'") if "extra ==" in marker else ""
        by_extra.setdefault(extra, set()).add(spec.strip().replace(" ", ""))
    assert by_extra[""] == {"msgpack>=1.0", "numpy>=1.26"}
    assert by_extra["daemon"] == {"uvloop>=0.19", "structlog>=24.1", "orjson>=3.9", "prometheus-client>=0.20"}
    assert by_extra["cuda13"] == by_extra["cuda"] == {"cuda-bindings<14,>=13"}
    assert by_extra["cuda12"] == {"cuda-bindings<13,>=12.6"}
    assert by_extra["daemon"] <= by_extra["test"]  # the tests run daemons
    assert {"client", "daemon", "cuda12", "cuda13", "cuda", "test"} <= set(meta.get_all("Provides-Extra") or [])


@pytest.fixture(scope="module")
def client_only(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """sys.path of a client-only install: the wheel unpacked, beside numpy and msgpack only.
    Python then runs with ``-I -S`` (no site-packages, no PYTHONPATH), so the daemon's
    dependencies cannot be imported even by accident."""
    import msgpack
    import numpy

    site = tmp_path_factory.mktemp("client-site")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    deps = tmp_path_factory.mktemp("client-deps")
    for module in (numpy, msgpack):
        pkg = Path(module.__file__ or "").parent
        for sibling in pkg.parent.glob(f"{pkg.name}*"):
            if sibling.is_dir() and not sibling.name.endswith(".dist-info"):
                os.symlink(sibling, deps / sibling.name)  # numpy and numpy.libs (its bundled BLAS)
    return [str(site), str(deps)]


def _run_client(path: list[str], code: str) -> subprocess.CompletedProcess[str]:
    prelude = f"import sys; sys.path[:0] = {path!r}\n"
    return subprocess.run(
        [sys.executable, "-I", "-S", "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )


def test_client_only_install_works_without_the_daemon_dependencies(
    client_only: list[str], daemon: DaemonProcess, tmp_path: Path
) -> None:
    """With only numpy and msgpack beside it, the installed wheel's client copies through a
    daemon, ``priod status`` works, and none of uvloop, structlog, prometheus_client or orjson
    is imported (nor importable: the check is not vacuous). ``priod serve`` says which extra
    to install; ``priod install-units`` writes the files from inside the wheel."""
    r = _run_client(
        client_only,
        f"""
        import importlib.util, json
        import priod, priod.client.cuda_ipc
        from priod.cli import main
        assert priod.__file__.startswith({client_only[0]!r}), priod.__file__
        with priod.SyncClient({daemon.socket_path!r}, name="client-only", copy_path="daemon") as c:
            h, d = c.alloc_host(4096), c.alloc_device(4096)
            h.array[:] = 7
            c.copy(d, h, priority="urgent")
            assert int(d.array.min()) == int(d.array.max()) == 7
        rc_status = main(["status", "--socket", {daemon.socket_path!r}])
        rc_serve = main(["serve", "--socket", {str(tmp_path / "never.sock")!r}])
        rc_units = main(["install-units", "--dest", {str(tmp_path / "root")!r}, "--prefix", "/opt/priod"])
        daemon_only = {DAEMON_ONLY!r}
        print(json.dumps({{
            "rc": [rc_status, rc_serve, rc_units],
            "imported": sorted(m for m in sys.modules if m.split(".")[0] in daemon_only),
            "importable": [m for m in daemon_only if importlib.util.find_spec(m) is not None],
        }}))
        """,
    )
    assert r.returncode == 0, r.stderr
    result = r.stdout.strip().splitlines()[-1]
    assert result == '{"rc": [0, 1, 0], "imported": [], "importable": []}', r.stdout
    assert "backend=sim" in r.stdout
    assert r.stderr.strip() == (
        "priod: 'priod serve' runs the daemon, whose dependencies are not installed (missing: uvloop, structlog, prometheus_client). "
        "This is a client-only install; install the daemon with: pip install 'priod[daemon]' "
        "(on a GPU host 'priod[daemon,cuda13]' for driver >= 580, or 'priod[daemon,cuda12]' for driver >= 525)"
    )
    service = (tmp_path / "root/etc/systemd/system/priod.service").read_text()
    assert service == (ROOT / "config/systemd/priod.service").read_text().replace(
        "ExecStart=/usr/bin/priod ", "ExecStart=/opt/priod/bin/priod "
    )


def test_install_units_writes_units_keeps_config_and_points_at_this_install(tmp_path: Path) -> None:
    """Units and the sysusers.d fragment go where docs/operations.md puts them; ExecStart= runs
    this installation's priod by default; an existing config is kept unless --force."""
    from priod.cli import main

    fake_root = tmp_path / "root"
    assert main(["install-units", "--dest", str(fake_root)]) == 0
    expect = {
        "etc/systemd/system/priod.service": "config/systemd/priod.service",
        "etc/systemd/system/priod.socket": "config/systemd/priod.socket",
        "usr/lib/sysusers.d/priod.conf": "config/systemd/priod.sysusers.conf",
        "etc/priod/priod.toml": "config/priod.toml",
    }
    for target, original in expect.items():
        text = (fake_root / target).read_text()
        want = (ROOT / original).read_text()
        if target.endswith("priod.service"):
            want = want.replace("ExecStart=/usr/bin/priod ", f"ExecStart={sys.prefix}/bin/priod ")
        assert text == want, target
        assert (fake_root / target).stat().st_mode & 0o777 == 0o644
    (fake_root / "etc/priod/priod.toml").write_text("# mine\n")
    assert main(["install-units", "--dest", str(fake_root), "--prefix", "/usr"]) == 0
    assert (fake_root / "etc/priod/priod.toml").read_text() == "# mine\n"
    assert (fake_root / "etc/systemd/system/priod.service").read_text() == (
        ROOT / "config/systemd/priod.service"
    ).read_text()
    assert main(["install-units", "--dest", str(fake_root), "--force"]) == 0
    assert (fake_root / "etc/priod/priod.toml").read_text() == (ROOT / "config/priod.toml").read_text()


def test_install_units_into_an_unwritable_root_says_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A destination that cannot be written fails with exit 1 and the fix, not a traceback."""
    from priod.cli import main

    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["install-units", "--dest", str(blocker)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"priod: cannot write the units under {blocker}: ") and err.endswith(
        "; run as root, or pass --dest DIR\n"
    )


def test_install_units_from_a_broken_install_says_to_reinstall(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A shipped file missing from the installation is reported as such (not as a permission
    problem with the destination), and nothing is written."""
    import priod.daemon.units
    from priod.cli import main

    monkeypatch.setattr(priod.daemon.units, "shipped", lambda name: tmp_path / "gone" / name)
    assert main(["install-units", "--dest", str(tmp_path / "root")]) == 1
    assert capsys.readouterr().err == (
        f"priod: systemd/priod.service is missing from this priod installation ({tmp_path}/gone/systemd/priod.service); reinstall priod from its wheel\n"
    )
    assert not (tmp_path / "root").exists()
