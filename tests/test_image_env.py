"""The container image's environment serves (operability issue, item 1).

deploy/Containerfile is read, not copied: its build stage's COPY lines fill a ``/src`` from the
checkout (through .dockerignore, as a build context would), its RUN lines (all but apt-get's)
build ``/opt/priod`` with its own pip line and ARG defaults, and its final stage's COPY and ENV
lines set up the config it runs with. Every absolute path of the file is taken under a temporary
root, and the image's ENTRYPOINT and CMD then serve there (on the sim engine: no GPU here):
the environment's own SyncClient copies through it and ``priod status`` reports it. pip reaches
PyPI for the requirements as the image build does (``--no-cache-dir`` is left off so that a
machine that just installed them reuses the downloads), and this interpreter stands in for the
base's ``python3``. Where docker or podman can build the
image itself (a daemon, and a registry to pull the base from), the image is built and serves
too; elsewhere that test is skipped, saying which was missing.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
import tomllib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from priod.testing import wait_for_socket

ROOT = Path(__file__).resolve().parent.parent
CONTAINERFILE = ROOT / "deploy" / "Containerfile"


# -- reading the Containerfile ------------------------------------------------------------------


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(m[1].upper(), m[2].strip()) for m in re.finditer(r"^\s*([A-Za-z]+)\s+(.*)$", joined, re.M)]


@dataclass
class Containerfile:
    args: dict[str, str]
    """ARG defaults, global and of every stage (an ARG without a default is left out)."""
    stages: list[list[tuple[str, str]]]
    """Each stage's instructions after its FROM; stages[0] is the build stage."""

    @classmethod
    def read(cls, path: Path = CONTAINERFILE) -> Containerfile:
        args: dict[str, str] = {}
        stages: list[list[tuple[str, str]]] = []
        for ins, arg in instructions(path.read_text()):
            if ins == "ARG" and "=" in arg:
                name, _, value = arg.partition("=")
                args[name] = "".join(shlex.split(value))
            if ins == "FROM":
                stages.append([])
            elif stages:
                stages[-1].append((ins, arg))
        return cls(args, stages)

    @property
    def base(self) -> str:
        return self.args["BASE"]


def cuda_major_of_base(base: str) -> int:
    found = re.fullmatch(r"nvidia/cuda:(\d+)\.\d+\.\d+-runtime-ubuntu24\.04", base)
    assert found, f"BASE={base}: expected an nvidia/cuda:X.Y.Z-runtime-ubuntu24.04 tag"
    return int(found[1])


def cuda_majors_of_extra(extra: str) -> set[int]:
    """The cuda-bindings majors pyproject's ``extra`` allows (it must bound the major both ways)."""
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (req,) = [r for r in optional[extra] if r.replace("_", "-").startswith("cuda-bindings")]
    low = re.search(r">=\s*(\d+)", req)
    high = re.search(r"<\s*(\d+)(?:\.0)*(?=\s*(?:,|;|$))", req)
    assert low and high, f"{extra}: {req} does not bound cuda-bindings' major both ways"
    return set(range(int(low[1]), int(high[1])))


def test_base_image_and_default_cuda_extra_agree() -> None:
    """The base image's CUDA major is the one the default CUDA extra's cuda-bindings is built
    for: a CUDA 12.8 base (which the container toolkit starts on driver >= 570) with
    cuda-bindings 13 (driver >= 580) starts on R570 hosts where the daemon's engine then cannot.
    The header says how to build for older drivers."""
    cf = Containerfile.read()
    extra = cf.args["CUDA_EXTRA"]
    assert cuda_majors_of_extra(extra) == {cuda_major_of_base(cf.base)}, (cf.base, extra)
    assert cf.args.get("CUDA_BINDINGS", "") == ""  # nothing resolved beside the extra by default
    header = CONTAINERFILE.read_text().split("\nARG ", 1)[0]
    assert "--build-arg CUDA_EXTRA=cuda12" in header and "--build-arg BASE=nvidia/cuda:12." in header, (
        "the header says how to build for drivers older than 580"
    )


# -- the build context --------------------------------------------------------------------------


def _glob_rx(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def dockerignored(rel: str, ignore: Path = ROOT / ".dockerignore") -> bool:
    """Whether the build context leaves ``rel`` out: Docker's rules, the last pattern that
    matches the path or one of its parents deciding, ``!`` putting it back."""
    if not ignore.exists():
        return False
    excluded = False
    parts = rel.split("/")
    for line in ignore.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        rx = _glob_rx(line.lstrip("!").strip().strip("/"))
        if any(rx.fullmatch("/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            excluded = not negate
    return excluded


def under(root: Path, path: str) -> Path:
    """An absolute path of the image, under ``root``."""
    assert path.startswith("/"), path
    return root / path.lstrip("/")


def reroot(text: str, root: Path) -> str:
    """Every absolute path in a shell command or ENV value moved under ``root``."""
    return re.sub(r"(?<![^\s\"'=:])/(?=[A-Za-z_])", f"{root}/", text)


def copy_from_context(arg: str, root: Path) -> None:
    """COPY <src>... <dest> from the checkout as a build context: sources the context lacks
    (.dockerignore) fail the build; a directory's contents are copied, links kept as links."""
    *sources, dest = shlex.split(arg)
    assert sources and not any(s.startswith("--") for s in sources), arg
    for src in sources:
        found = ROOT / src
        assert (found.exists() or found.is_symlink()) and not dockerignored(src), (
            f"COPY {src}: not in the build context (missing, or left out by .dockerignore)"
        )
        target = under(root, dest)
        if found.is_dir() and not found.is_symlink():
            for path in sorted(found.rglob("*")):
                rel = path.relative_to(ROOT).as_posix()
                if dockerignored(rel) or (path.is_dir() and not path.is_symlink()):
                    continue
                out = target / path.relative_to(found)
                out.parent.mkdir(parents=True, exist_ok=True)
                if path.is_symlink():
                    os.symlink(os.readlink(path), out)
                else:
                    shutil.copy2(path, out)
        else:
            out = target / found.name if dest.endswith("/") or len(sources) > 1 else target
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(found, out)


# -- the environment ----------------------------------------------------------------------------


@dataclass
class ImageEnv:
    root: Path
    venv: Path
    env: dict[str, str]
    """The final stage's ENV, rerooted, over this process's environment (less PRIOD_*)."""
    command: list[str]
    """ENTRYPOINT + CMD, rerooted."""
    compiled: bool
    """Built with the Containerfile's ``COMPILE`` default, 1: this machine has the C compiler and
    Python headers that the build stage's apt-get line installs in the image."""

    def python(self, code: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.venv / "bin" / "python"), "-I", "-c", textwrap.dedent(code)],
            capture_output=True,
            text=True,
            timeout=120,
            env=self.env,
            cwd=self.root,
        )


def can_compile() -> bool:
    """A C compiler and this interpreter's headers: what mypyc needs (the build stage's apt-get
    line gives the image gcc and python3-dev)."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc) is not None and (Path(sysconfig.get_paths()["include"]) / "Python.h").exists()


@pytest.fixture(scope="module")
def image_env() -> Iterator[ImageEnv]:
    """The image's /opt/priod built as the Containerfile builds it, under a temporary root
    (short: the socket's path must fit a sockaddr_un)."""
    cf = Containerfile.read()
    assert len(cf.stages) == 2, "a build stage and the final stage"
    root = Path(tempfile.mkdtemp(prefix="priod-image-"))
    try:
        build, final = cf.stages
        base_env = {k: v for k, v in os.environ.items() if not k.startswith(("PRIOD_", "PYTHON", "VIRTUAL_ENV"))}
        base_env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
        ran = []
        args = dict(cf.args)
        compiled = args.get("COMPILE") == "1" and can_compile()
        if not compiled:
            args["COMPILE"] = "0"  # the apt-get line is not run here (test_image_daemon_is_compiled skips)
        for ins, arg in build:
            if ins == "COPY":
                copy_from_context(arg, root)
            elif ins == "RUN" and not arg.startswith("apt-get"):  # the base's system packages
                cmd = reroot(arg, root).replace("--no-cache-dir ", "")
                cmd = re.sub(r"(^|&&\s*)python3 ", rf"\g<1>{shlex.quote(sys.executable)} ", cmd)
                env = base_env | args
                r = subprocess.run(["/bin/sh", "-c", cmd], capture_output=True, text=True, timeout=240, env=env)
                assert r.returncode == 0, f"RUN {arg}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
                ran.append(arg)
        assert any("pip install" in a for a in ran), "the build stage has no pip line"
        env = dict(base_env)
        for ins, arg in final:
            if ins == "COPY" and not arg.startswith("--from="):
                copy_from_context(arg, root)
            elif ins == "COPY":
                *_, src, dest = shlex.split(arg)
                assert src == dest, f"{arg}: the venv is not relocatable; copied to where it was built"
            elif ins == "ENV":
                for item in shlex.split(arg):
                    key, _, value = item.partition("=")
                    env[key] = os.path.expandvars(reroot(value, root)) if key == "PATH" else reroot(value, root)
        last = dict(final)
        command = json.loads(last["ENTRYPOINT"]) + [reroot(a, root) for a in json.loads(last["CMD"])]
        venv = under(root, "/opt/priod")
        assert (venv / "bin" / "python").exists(), "the pip line's venv is /opt/priod (the final stage copies it)"
        yield ImageEnv(root, venv, env, command, compiled)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
def test_image_daemon_is_compiled(image_env: ImageEnv) -> None:
    """The image's daemon runs its per-copy modules as the mypyc build made them (setup.py's
    COMPILED), not as .py files, and the build tools stayed in the build stage."""
    if not image_env.compiled:
        pytest.skip("no C compiler or Python headers here (the image's build stage installs them with apt-get)")
    r = image_env.python(
        """
        import importlib.util, json
        import priod.daemon.pump, priod.daemon.session, priod.wire.ring
        mods = (priod.daemon.pump, priod.daemon.session, priod.wire.ring)
        print(json.dumps({"files": [m.__file__ for m in mods], "mypy": importlib.util.find_spec("mypy") is not None}))
        """
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert all(f.endswith(".so") for f in got["files"]), got["files"]
    assert not got["mypy"], "mypy is a build tool: it stays in /opt/build"


@pytest.mark.slow
def test_image_environment_serves_and_ships_what_it_should(image_env: ImageEnv) -> None:
    """In the environment the Containerfile builds: priod is the one installed from /src (not
    this checkout), with the daemon's modules, the cuda-bindings major the base's CUDA is for,
    the LICENSE, the README as its description and the shipped units; the image's command
    (plus ``--backend sim``) serves on its socket, with the config the image puts in
    PRIOD_CONFIG; the environment's SyncClient copies through it and ``priod status`` reports
    it; SIGTERM stops it cleanly."""
    e = image_env
    assert shutil.which(e.command[0], path=e.env["PATH"]) == str(e.venv / "bin" / "priod")
    r = e.python(
        """
        import importlib.metadata as m, importlib.util, json, priod
        from priod.cli import DAEMON_MODULES
        files = {str(f): f for f in m.files("priod") or []}
        lic = [n for n in files if n.endswith("licenses/LICENSE")]
        print(json.dumps({
            "file": priod.__file__,
            "version": m.version("priod"),
            "cuda_bindings": m.version("cuda-bindings"),
            "missing": [n for n in DAEMON_MODULES if importlib.util.find_spec(n) is None],
            "license": files[lic[0]].read_text() if lic else None,
            "readme": m.metadata("priod").get_payload(),
        }))
        """
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["file"].startswith(str(e.venv)), got["file"]
    assert got["version"] == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert got["missing"] == []
    assert int(got["cuda_bindings"].split(".")[0]) == cuda_major_of_base(Containerfile.read().base), got
    assert got["license"] == (ROOT / "LICENSE").read_text(), "the installed priod carries the LICENSE"
    assert got["readme"].strip() == (ROOT / "README.md").read_text().strip(), "its description is the README"

    units = e.root / "units"
    r = subprocess.run(
        [str(e.venv / "bin" / "priod"), "install-units", "--dest", str(units), "--prefix", "/opt/priod"],
        capture_output=True,
        text=True,
        timeout=60,
        env=e.env,
    )
    assert r.returncode == 0, r.stdout + r.stderr  # the shipped files are in the installed wheel
    assert (units / "etc/priod/priod.toml").read_bytes() == (ROOT / "config/priod.toml").read_bytes()

    config = e.env.get("PRIOD_CONFIG")
    assert config and Path(config).read_bytes() == (ROOT / "config/priod.toml").read_bytes(), config
    sock = e.command[e.command.index("--socket") + 1]
    Path(sock).parent.mkdir(parents=True, exist_ok=True)
    log_path = e.root / "daemon.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*e.command, "--backend", "sim"], stdout=log, stderr=subprocess.STDOUT, env=e.env)
    try:
        try:
            wait_for_socket(sock, 60, proc)
        except (RuntimeError, TimeoutError) as exc:
            raise AssertionError(f"{exc}\n{log_path.read_text()[-4000:]}") from None
        r = e.python(
            f"""
            import priod
            with priod.SyncClient({sock!r}, name="image-env", copy_path="daemon") as c:
                c.ping()
                assert c.status()["backend"] == "sim"
                h, d = c.alloc_host(4096), c.alloc_device(4096)
                h.array[:] = 5
                c.copy(d, h, priority="urgent")
                assert int(d.array.min()) == int(d.array.max()) == 5
            print("copied")
            """
        )
        assert r.returncode == 0 and r.stdout.strip() == "copied", r.stdout + r.stderr
        r = subprocess.run(["priod", "status", "--socket", sock], capture_output=True, text=True, timeout=60, env=e.env)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "backend=sim" in r.stdout and f"socket={sock}" in r.stdout, r.stdout
    finally:
        rc: int | str = "killed: no exit 30 s after SIGTERM"
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert rc == 0, f"{rc}\n{log_path.read_text()[-4000:]}"


# -- the image itself, where it can be built ----------------------------------------------------


def _container_tool() -> tuple[str | None, str]:
    """(docker or podman, "") where one answers and can reach the registry for the base
    image; else (None, why not)."""
    why = "neither docker nor podman is installed"
    for name in ("docker", "podman"):
        tool = shutil.which(name)
        if tool is None:
            continue
        try:
            r = subprocess.run([tool, "info"], capture_output=True, text=True, timeout=30)
        except subprocess.TimeoutExpired:
            why = f"{name} info timed out"
            continue
        if r.returncode != 0:
            why = f"{name} cannot reach its daemon: {(r.stderr or r.stdout).strip()[-300:]}"
            continue
        base = Containerfile.read().base
        try:
            r = subprocess.run([tool, "pull", "-q", base], capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            why = f"{name} pull {base} timed out"
            continue
        if r.returncode != 0:
            why = f"{name} cannot pull {base} (no registry reachable?): {(r.stderr or r.stdout).strip()[-300:]}"
            continue
        return tool, ""
    return None, why


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_image_builds_and_serves(tmp_path: Path) -> None:
    """Where a container engine can build it: the image builds from the checkout, its command
    (with ``--backend sim``) serves, and ``priod status`` inside it reports the daemon."""
    tool, why = _container_tool()
    if tool is None:
        pytest.skip(f"the image itself is not built here: {why}; its environment is checked above")
    tag = f"localhost/priod-test:{uuid.uuid4().hex[:12]}"
    r = subprocess.run(
        [tool, "build", "-f", str(CONTAINERFILE), "-t", tag, str(ROOT)], capture_output=True, text=True, timeout=1200
    )
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-6000:]
    name = f"priod-test-{uuid.uuid4().hex[:12]}"
    try:
        r = subprocess.run(
            [tool, "run", "-d", "--name", name, "--tmpfs", "/run/priod:mode=1777", tag,
             "serve", "--socket", "/run/priod/priod.sock", "--backend", "sim"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert r.returncode == 0, r.stdout + r.stderr
        status = ""
        for _ in range(120):
            s = subprocess.run(
                [tool, "exec", name, "priod", "status", "--socket", "/run/priod/priod.sock"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            if s.returncode == 0:
                status = s.stdout
                break
            time.sleep(0.5)
        logs = subprocess.run([tool, "logs", name], capture_output=True, text=True, timeout=60)
        assert "backend=sim" in status, logs.stdout[-4000:] + logs.stderr[-4000:]
        stop = subprocess.run([tool, "stop", "-t", "30", name], capture_output=True, text=True, timeout=90)
        assert stop.returncode == 0, stop.stderr
        code = subprocess.run(
            [tool, "inspect", "-f", "{{.State.ExitCode}}", name], capture_output=True, text=True, timeout=60
        )
        assert code.stdout.strip() == "0", logs.stdout[-4000:] + logs.stderr[-4000:]
    finally:
        subprocess.run([tool, "rm", "-f", name], capture_output=True, timeout=120)
        subprocess.run([tool, "rmi", "-f", tag], capture_output=True, timeout=120)
