"""``priod install-units``: write the systemd units and the example config that ship in the wheel.

The files live once in the repository, under ``config/``; the package reaches them as
``priod/shipped`` (a link to ``config/`` in a checkout, the files themselves in a wheel), so a
``pip install`` has everything `docs/operations.md` installs, without a checkout.
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

__all__ = ["SHIPPED", "Written", "install_units", "shipped"]

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


def shipped(name: str) -> Traversable:
    """A file shipped in the package, like ``systemd/priod.service`` or ``priod.toml``."""
    return resources.files("priod").joinpath("shipped", *name.split("/"))


def install_units(
    dest: str | os.PathLike[str] = "/", prefix: str | None = None, *, force: bool = False
) -> list[Written]:
    """Write the units, the sysusers.d fragment and the example config under ``dest``.

    Args:
        dest: The root to write under (``/``, or a staging directory when building a package).
        prefix: The installation prefix of priod: ``ExecStart=`` runs ``<prefix>/bin/priod``.
            None: this installation's (``sys.prefix``, a venv's root), so the unit runs the
            priod that wrote it.
        force: Replace an existing ``etc/priod/priod.toml`` too.

    Returns:
        What was done to each file, in order.

    Raises:
        FileNotFoundError: The package has no shipped files (a broken install); the message
            says to reinstall.
        OSError: A file could not be written (permissions: run as root for ``/``).
    """
    executable = f"{(prefix or sys.prefix).rstrip('/')}/bin/priod"
    root = Path(dest)
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
