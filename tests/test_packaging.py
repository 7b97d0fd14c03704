"""Packaging: the wheel built from a clean checkout carries the units and the
example config, its extras split the client from the daemon and CUDA 12 from 13, and a client
installed without the daemon's dependencies works and never imports them.

Operability issue, items 2-4: the wheel and the sdist carry the LICENSE (Apache-2.0, the standard
text); the sdist is the whole project (tests with their data, scripts, deploy, config, examples,
docs, the changelog), its own tests pass when run from it, and a wheel built from it ships what
the checkout's does; the metadata names the project's URLs and classifiers."""

from __future__ import annotations

import email.message
import email.parser
import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import tomllib
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
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the files git tracks: what a clean clone has."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: 'a clean checkout' is the files git tracks")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    src = tmp_path_factory.mktemp("checkout")
    for name in filter(None, tracked):
        path = Path(os.fsdecode(name))
        if not (ROOT / path).exists() and not (ROOT / path).is_symlink():
            continue  # deleted in the working tree, not yet committed
        (src / path).parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / path).is_symlink():
            os.symlink(os.readlink(ROOT / path), src / path)  # priod/shipped -> ../config, as git checks it out
        else:
            shutil.copy2(ROOT / path, src / path)
    return src


def _fresh_copy(src: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of ``src`` to build in: builds write into their tree (build/, *.egg-info), and
    the tree the next build or a test reads must not have them."""
    dest = tmp_path_factory.mktemp("build-tree") / "src"
    shutil.copytree(src, dest, symlinks=True)
    return dest


def _build_wheel(src: Path, out: Path) -> Path:
    """The wheel pip builds from the source tree ``src``."""
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(src)]
    if _setuptools_builds_wheels():
        cmd.insert(4, "--no-build-isolation")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    (built,) = out.glob("priod-*.whl")
    return built


@pytest.fixture(scope="module")
def wheel(checkout: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built by pip from a copy of the files git tracks (what a clean clone has)."""
    return _build_wheel(_fresh_copy(checkout, tmp_path_factory), tmp_path_factory.mktemp("dist"))


@pytest.fixture(scope="module")
def sdist(checkout: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist, built from the same copy by the build backend's own hook (what ``python -m
    build --sdist --no-isolation`` calls), offline."""
    if not _setuptools_builds_wheels():
        pytest.skip("setuptools >= 77 (pyproject's build requirement, in the test extra) is not installed here")
    out = tmp_path_factory.mktemp("sdist")
    code = "import sys, setuptools.build_meta as b; print(b.build_sdist(sys.argv[1]))"
    src = _fresh_copy(checkout, tmp_path_factory)
    r = subprocess.run([sys.executable, "-c", code, str(out)], cwd=src, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    (built,) = out.glob("priod-*.tar.gz")
    return built


@pytest.fixture(scope="module")
def sdist_tree(sdist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist unpacked: its one top directory."""
    out = tmp_path_factory.mktemp("sdist-tree")
    with tarfile.open(sdist) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(out, filter="data")
        else:  # Python 3.11 before 3.11.4
            tar.extractall(out)
    (top,) = out.iterdir()
    return top


@pytest.fixture(scope="module")
def sdist_wheel(sdist_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel pip builds from the unpacked sdist (what ``pip install priod-*.tar.gz`` does)."""
    return _build_wheel(_fresh_copy(sdist_tree, tmp_path_factory), tmp_path_factory.mktemp("dist-from-sdist"))


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as z:
        return email.parser.Parser().parsestr(
            z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        )


def _assert_ships_units_config_and_every_module(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for inside, original in SHIPPED.items():
            assert z.read(inside) == (ROOT / original).read_bytes(), inside
    modules = subprocess.run(
        ["git", "ls-files", "priod/*.py", "priod/**/*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert len(modules) > 30 and set(modules) <= names
    assert "priod/common/cuda/express.ptx" in names and "priod/py.typed" in names
    assert not any(n.endswith(".cu") for n in names), "the kernel's source is the sdist's, not the wheel's"


def test_wheel_ships_units_config_and_every_module(wheel: Path) -> None:
    """The wheel holds the systemd units, the sysusers.d fragment and the example config, byte
    for byte as in config/, and every module git tracks under priod/ (the PTX too)."""
    _assert_ships_units_config_and_every_module(wheel)


def test_wheel_built_from_the_sdist_ships_the_same(sdist_wheel: Path, wheel: Path) -> None:
    """In the sdist, priod/shipped is a directory of the files themselves (no link to ../config),
    so the wheel pip builds from it ships the units and config as the checkout's does, and
    nothing less or more than that wheel."""
    _assert_ships_units_config_and_every_module(sdist_wheel)
    with zipfile.ZipFile(sdist_wheel) as a, zipfile.ZipFile(wheel) as b:
        assert set(a.namelist()) == set(b.namelist())


def test_wheel_metadata_splits_client_daemon_and_cuda_majors(wheel: Path) -> None:
    """Core requirements are the client's alone; the daemon's are the ``daemon`` extra; CUDA 12
    and 13 are separate extras bounded to their major (13 needs driver >= 580), ``cuda`` = 13."""
    meta = _metadata(wheel)
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


# The standard Apache-2.0 text (https://www.apache.org/licenses/LICENSE-2.0.txt) with its appendix's
# "Copyright [yyyy] [name of copyright owner]" as written there.
APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"
COPYRIGHT = re.compile(r"^   Copyright (\d{4}(?:-\d{4})?) the priod authors$", re.M)


def test_license_is_the_apache_2_text_and_both_artefacts_carry_it(wheel: Path, sdist: Path) -> None:
    """LICENSE is the whole Apache License 2.0, its copyright line naming the priod authors, as
    pyproject's ``license`` says; the wheel has it in its dist-info (METADATA naming it and the
    SPDX expression), the sdist at its top."""
    text = (ROOT / "LICENSE").read_text()
    assert len(COPYRIGHT.findall(text)) == 1, "one 'Copyright YYYY the priod authors' line"
    standard = COPYRIGHT.sub("   Copyright [yyyy] [name of copyright owner]", text)
    assert hashlib.sha256(standard.encode()).hexdigest() == APACHE_2_SHA256, "not the standard Apache-2.0 text"
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"] == "Apache-2.0"

    with zipfile.ZipFile(wheel) as z:
        licenses = [n for n in z.namelist() if re.fullmatch(r"priod-[^/]+\.dist-info/licenses/LICENSE", n)]
        assert len(licenses) == 1, z.namelist()
        assert z.read(licenses[0]).decode() == text
    meta = _metadata(wheel)
    assert meta["License-Expression"] == "Apache-2.0" and meta.get_all("License-File") == ["LICENSE"]
    with tarfile.open(sdist) as tar:
        member = tar.extractfile(f"{sdist.name.removesuffix('.tar.gz')}/LICENSE")
        assert member is not None and member.read().decode() == text


REPO_ONLY = (".ci/", ".github/", ".gitignore", ".gitattributes")
"""What a clone has and the sdist need not: CI's own files and git's."""


def test_sdist_holds_the_whole_project(checkout: Path, sdist_tree: Path) -> None:
    """The sdist has every file git tracks (less CI's and git's own), byte for byte: the tests
    with conftest.py and tests/data, scripts/, deploy/, config/, examples/, docs/, CHANGELOG.md
    and LICENSE; priod/shipped holds the files its link points at; nothing else but what the
    build adds (PKG-INFO, setup.cfg, priod.egg-info/), no caches."""
    tracked = {p.relative_to(checkout).as_posix() for p in checkout.rglob("*") if p.is_file() or p.is_symlink()}
    expect = {n for n in tracked if not n.startswith(REPO_ONLY)} - {"priod/shipped"} | set(SHIPPED)
    got = {p.relative_to(sdist_tree).as_posix() for p in sdist_tree.rglob("*") if not p.is_dir()}
    built = {n for n in got if n in ("PKG-INFO", "setup.cfg") or n.startswith("priod.egg-info/")}
    assert expect - got == set(), "missing from the sdist"
    assert got - built - expect == set(), "in the sdist but not tracked"
    for name in expect:
        original = ROOT / SHIPPED.get(name, name)
        assert (sdist_tree / name).read_bytes() == original.read_bytes(), name
    for required in ("tests/conftest.py", "tests/data", "scripts/", "deploy/Containerfile", "config/priod.toml",
                     "examples/", "docs/", "CHANGELOG.md", "LICENSE"):  # fmt: skip
        assert any(n.startswith(required) for n in got), required


def test_sdist_runs_its_own_tests(sdist_tree: Path) -> None:
    """A quick subset of the sdist's tests passes when run from the unpacked sdist with priod
    imported from there (config/, priod/, tests/conftest.py, tests/data and scripts/ used)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PRIOD_", "PYTHON"))}
    env["PYTHONPATH"] = str(sdist_tree)
    probe = subprocess.run(
        [sys.executable, "-c", "import priod; print(priod.__file__)"],
        cwd=sdist_tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.stdout.strip() == str(sdist_tree / "priod" / "__init__.py"), probe.stdout + probe.stderr
    subset = ["tests/test_config.py", "tests/test_layout.py", "tests/test_bench_gpu_accounting.py"]
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *subset],
        cwd=sdist_tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    summary = r.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"\d+ passed in [\d.]+s", summary) and int(summary.split()[0]) >= 20, summary


REPOSITORY = "https://github.com/priod/priod"


def test_metadata_names_urls_classifiers_and_license(wheel: Path, sdist_tree: Path) -> None:
    """The wheel's METADATA (and the sdist's PKG-INFO) link the project's home, documentation,
    changelog and issues in one repository, at paths the checkout has; classify it (beta,
    Linux, NVIDIA CUDA, typed, Python 3.11 and 3.12, each allowed by Requires-Python); and give
    the license as the SPDX expression. No ``License ::`` classifier: PEP 639 replaced it with
    License-Expression, and setuptools refuses both together."""
    for meta in (_metadata(wheel), email.parser.Parser().parsestr((sdist_tree / "PKG-INFO").read_text())):
        urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL") or [])
        assert urls == {
            "Homepage": REPOSITORY,
            "Documentation": f"{REPOSITORY}/tree/main/docs",
            "Changelog": f"{REPOSITORY}/blob/main/CHANGELOG.md",
            "Issues": f"{REPOSITORY}/issues",
        }
        assert (ROOT / "docs").is_dir() and (ROOT / "CHANGELOG.md").is_file()
        classifiers = set(meta.get_all("Classifier") or [])
        assert {
            "Development Status :: 4 - Beta",
            "Environment :: GPU :: NVIDIA CUDA",
            "Operating System :: POSIX :: Linux",
            "Programming Language :: Python :: 3.11",
            "Programming Language :: Python :: 3.12",
            "Typing :: Typed",
        } <= classifiers, classifiers
        assert any(c.startswith("Topic :: ") for c in classifiers), classifiers
        assert not any(c.startswith("License :: ") for c in classifiers)
        assert meta["License-Expression"] == "Apache-2.0"
        floor = re.fullmatch(r">=3\.(\d+)", meta["Requires-Python"])
        assert floor, meta["Requires-Python"]
        minors = [int(m) for c in classifiers if (m := c.removeprefix("Programming Language :: Python :: 3.")) != c]
        assert minors and min(minors) == int(floor[1]), (minors, meta["Requires-Python"])


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
    # this installation may live under /home or /tmp (a CI checkout): that check has tests of its own
    assert main(["install-units", "--dest", str(fake_root), "--allow-hidden-prefix"]) == 0
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
    assert main(["install-units", "--dest", str(fake_root), "--force", "--allow-hidden-prefix"]) == 0
    assert (fake_root / "etc/priod/priod.toml").read_text() == (ROOT / "config/priod.toml").read_text()


def test_install_units_into_an_unwritable_root_says_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A destination that cannot be written fails with exit 1 and the fix, not a traceback."""
    from priod.cli import main

    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["install-units", "--dest", str(blocker), "--prefix", "/usr"]) == 1
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
