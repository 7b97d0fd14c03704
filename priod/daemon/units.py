"""``priod install-units``: write the systemd units and the example config that ship in the wheel.

The files live once in the repository, under ``config/``; the package reaches them as
``priod/shipped`` (a link to ``config/`` in a checkout, the files themselves in a wheel), so a
``pip install`` has everything `docs/operations.md` installs, without a checkout.

The unit it writes runs ``<prefix>/bin/priod`` under ``ProtectHome=yes`` and ``PrivateTmp=yes``,
so a priod installed under /home, /root or /tmp (a venv in a home directory, a pyenv or uv
Python under /root) cannot run there: the start fails with status 203/EXEC. `install_units`
refuses such a prefix (`HiddenExecutable`) unless told to write it anyway.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

__all__ = [
    "SHIPPED",
    "HiddenExecutable",
    "Written",
    "exec_chain",
    "hidden_dirs",
    "hidden_problem",
    "install_units",
    "shipped",
]

SHIPPED_EXEC = "/usr/bin/priod"
"""The daemon's path in the shipped ``ExecStart=``: where a distribution package puts it."""


@dataclass(frozen=True)
class _File:
    source: str
    """Under ``priod/shipped``."""
    target: str
    """Under the destination root."""
    replace: bool
    """Whether an existing file is overwritten: units yes (local changes go in drop-ins, so an
    upgrade brings the new unit), the config no (it is the administrator's)."""


SHIPPED = (
    _File("systemd/priod.service", "etc/systemd/system/priod.service", True),
    _File("systemd/priod.socket", "etc/systemd/system/priod.socket", True),
    _File("systemd/priod.sysusers.conf", "usr/lib/sysusers.d/priod.conf", True),
    _File("priod.toml", "etc/priod/priod.toml", False),
)


@dataclass(frozen=True)
class Written:
    path: Path
    action: str
    """``wrote``, ``replaced`` or ``kept`` (an existing config file)."""


class HiddenExecutable(FileNotFoundError):
    """The unit's ``ExecStart=`` executable, or what running it opens (its symbolic link's
    target, its ``#!`` interpreter), lies in a directory the unit's own sandboxing hides from
    the daemon (``ProtectHome=``, ``PrivateTmp=``): the start would fail with status 203/EXEC.
    A FileNotFoundError because that is what the start would meet (ENOENT); the message names
    the path, the setting that hides it and the fix.
    """


HIDING: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # =yes makes these inaccessible, =tmpfs mounts an empty tmpfs over them; =read-only leaves
    # them readable, so an executable there still runs.
    "ProtectHome": (("yes", "true", "on", "1", "tmpfs"), ("/home", "/root", "/run/user")),
    # The service gets its own, empty /tmp and /var/tmp.
    "PrivateTmp": (("yes", "true", "on", "1"), ("/tmp", "/var/tmp")),
}
"""[Service] settings that hide directories: the values that hide, and the directories."""


def hidden_dirs(unit_text: str) -> dict[str, str]:
    """The directories a unit's [Service] settings hide from its processes, each with the
    setting that hides it (``{"/home": "ProtectHome=yes", ...}``): ProtectHome=, PrivateTmp=
    and InaccessiblePaths= (the last assignment wins; an empty one resets the list)."""
    settings: dict[str, str] = {}
    inaccessible: list[str] = []
    section = ""
    for raw in unit_text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = (part.strip() for part in line.partition("="))
        if section != "Service":
            continue
        if key == "InaccessiblePaths":
            inaccessible = inaccessible + [p.lstrip("-+") for p in value.split()] if value else []
        else:
            settings[key] = value
    out: dict[str, str] = {}
    for key, (values, dirs) in HIDING.items():
        if settings.get(key, "").lower() in values:
            out.update(dict.fromkeys(dirs, f"{key}={settings[key]}"))
    out.update({p.rstrip("/") or "/": f"InaccessiblePaths={p}" for p in inaccessible})
    return out


def _under(path: str, hidden: dict[str, str]) -> tuple[str, str] | None:
    """(directory, setting) of the hidden directory that ``path`` lies in, or None."""
    for directory, setting in hidden.items():
        if path == directory or path.startswith(directory.rstrip("/") + "/"):
            return directory, setting
    return None


_SH_EXEC = re.compile(r"^'''exec' \"?([^\" ]+)\"?", re.M)
"""pip's launcher when the interpreter's path is too long for a ``#!`` line: ``#!/bin/sh``
followed by a line ``'''exec' "/long/path/bin/python" "$0" "$@"``."""


def exec_chain(executable: str) -> list[tuple[str, str]]:
    """What the kernel opens to run ``executable`` on this machine, as (path, what it is): the
    path itself, where its symbolic links lead, the interpreter of its ``#!`` line (a venv's
    ``bin/python``) and where that leads. A path that does not exist here ends the chain."""
    chain = [(executable, "ExecStart")]
    if not os.path.exists(executable):
        return chain
    real = os.path.realpath(executable)
    if real != executable:
        chain.append((real, f"{executable} is a symbolic link to"))
    try:
        with open(real, "rb") as fp:
            head = fp.read(4096).decode("utf-8", "replace")
    except OSError:
        return chain
    first = head.splitlines()[0] if head.startswith("#!") else ""
    words = first[2:].split()
    if not words:
        return chain
    interpreter = words[0]
    launcher = _SH_EXEC.search(head)
    if os.path.basename(interpreter) == "sh" and launcher:
        interpreter = launcher.group(1)
    chain.append((interpreter, f"{executable} runs the interpreter"))
    if os.path.exists(interpreter):
        real_interpreter = os.path.realpath(interpreter)
        if real_interpreter != interpreter:
            chain.append((real_interpreter, f"{executable} runs the interpreter {interpreter}, a symbolic link to"))
    return chain


def hidden_problem(executable: str, unit_text: str, *, resolve: bool) -> str | None:
    """Why a unit with this text could not run ``executable`` (the first hidden step of
    `exec_chain`, or only the path itself unless ``resolve``), with the fix; None if it can."""
    hidden = hidden_dirs(unit_text)
    for path, what in exec_chain(executable) if resolve else [(executable, "ExecStart")]:
        found = _under(path, hidden)
        if found is None:
            continue
        directory, setting = found
        if what == "ExecStart":
            where = f"ExecStart={executable} is under {directory}"
            fix = (
                "install priod under /usr/local or /opt, or in a venv there "
                "(python3 -m venv /opt/priod && /opt/priod/bin/pip install ...), and run that "
                "installation's priod install-units (or pass its prefix with --prefix)"
            )
        else:
            where = f"{what} {path}"
            fix = (
                "install priod under /usr/local or /opt from a Python that is itself outside "
                f"{', '.join(sorted(hidden))} (for example /usr/bin/python3 -m venv /opt/priod)"
            )
        return (
            f"the unit could not start priod: {where}; {directory} is hidden from the daemon by the "
            f"unit's {setting}, so the start fails with status 203/EXEC. Fix: {fix}"
        )
    return None


def shipped(name: str) -> Traversable:
    """A file shipped in the package, like ``systemd/priod.service`` or ``priod.toml``."""
    return resources.files("priod").joinpath("shipped", *name.split("/"))


def install_units(
    dest: str | os.PathLike[str] = "/",
    prefix: str | None = None,
    *,
    force: bool = False,
    allow_hidden: bool | None = None,
    warn: Callable[[str], None] | None = None,
) -> list[Written]:
    """Write the units, the sysusers.d fragment and the example config under ``dest``.

    Args:
        dest: The root to write under (``/``, or a staging directory when building a package).
        prefix: The installation prefix of priod: ``ExecStart=`` runs ``<prefix>/bin/priod``.
            None: this installation's (``sys.prefix``, a venv's root), so the unit runs the
            priod that wrote it.
        force: Replace an existing ``etc/priod/priod.toml`` too.
        allow_hidden: Write the unit even when ``<prefix>/bin/priod`` lies under a directory
            the unit's ProtectHome= or PrivateTmp= hides (/home, /root, /run/user, /tmp,
            /var/tmp), and tell ``warn``. When ``dest`` is this machine's ``/``, where the
            executable's symbolic links and its ``#!`` interpreter lead is checked too (a
            venv's python may lead to /root/.pyenv); under a staging root those are the build
            machine's, so only the path is. None: as ``force`` (the library's default; the
            CLI passes ``--allow-hidden-prefix``).
        warn: Called with the warning when such a unit is written anyway; None prints it to
            stderr.

    Returns:
        What was done to each file, in order.

    Raises:
        HiddenExecutable: The unit could not run its executable and ``allow_hidden`` is false;
            the message names the path, the setting that hides it and the fix. Nothing is
            written.
        FileNotFoundError: The package has no shipped files (a broken install); the message
            says to reinstall.
        OSError: A file could not be written (permissions: run as root for ``/``).
    """
    executable = f"{(prefix or sys.prefix).rstrip('/')}/bin/priod"
    root = Path(dest)
    service = shipped("systemd/priod.service")
    if service.is_file():  # else the loop below reports the broken installation
        problem = hidden_problem(executable, service.read_text(), resolve=_installs_here(root))
        if problem is not None:
            if not (force if allow_hidden is None else allow_hidden):
                raise HiddenExecutable(f"{problem}; or write the unit anyway with --allow-hidden-prefix")
            (warn or _warn_stderr)(f"warning: {problem}; written anyway (--allow-hidden-prefix)")
    out = []
    for f in SHIPPED:
        src = shipped(f.source)
        if not src.is_file():
            raise FileNotFoundError(
                f"{f.source} is missing from this priod installation ({src}); reinstall priod from its wheel"
            )
        text = src.read_text()
        if f.source == "systemd/priod.service" and executable != SHIPPED_EXEC:
            old = f"ExecStart={SHIPPED_EXEC} "
            if text.count(old) != 1:  # pragma: no cover - the shipped unit is tested
                raise ValueError(f"the shipped priod.service has no single '{old}' line to point at {executable}")
            text = text.replace(old, f"ExecStart={executable} ")
        target = root / f.target
        existed = target.exists()
        if existed and not (f.replace or force):
            out.append(Written(target, "kept"))
            continue
        _write(target, text)
        out.append(Written(target, "replaced" if existed else "wrote"))
    return out


def _installs_here(root: Path) -> bool:
    """Whether ``root`` is this machine's ``/``, so that the executable's links and interpreter
    here are the ones the unit will run."""
    return root.resolve() == Path("/")


def _warn_stderr(message: str) -> None:
    print(f"priod: {message}", file=sys.stderr)


def _write(target: Path, text: str) -> None:
    """Write whole or not at all (a unit cut short by a full disk would not load), mode 0644."""
    target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "w") as fp:
            fp.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
