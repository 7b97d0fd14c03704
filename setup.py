"""The build's one option: ``PRIOD_COMPILE=1`` compiles the per-copy path to C with mypyc.

Every module listed in `COMPILED` runs once or more for each copy: the copy ring (both sides),
the daemon's session, checks, scheduler and pump. Compiled, an urgent 64 KiB-1 MiB copy through
an idle daemon read p50 79-130 us against 101-155 on an H100 host (docs/design.md, "The compiled
path"). The source is the same either way, and a build without the variable is pure Python.

mypyc, and the dependencies whose types it reads, must be installed where it is built, and the
build must not be isolated from them (docs/operations.md, "The compiled build")::

    pip install mypy 'setuptools>=77' '.[daemon]'
    PRIOD_COMPILE=1 pip wheel --no-build-isolation --no-deps -w dist .
"""

from __future__ import annotations

import os
from typing import Any

from setuptools import setup

COMPILED = [
    "priod/wire/ring.py",
    "priod/daemon/session.py",
    "priod/daemon/copies.py",
    "priod/daemon/rings.py",
    "priod/daemon/rate.py",
    "priod/daemon/regions.py",
    "priod/daemon/pump.py",
    "priod/daemon/sched/scheduler.py",
    "priod/daemon/sched/dispatch.py",
    "priod/daemon/sched/queues.py",
    "priod/daemon/sched/lanes.py",
    "priod/daemon/sched/budget.py",
    "priod/common/choice.py",
]


def ext_modules() -> list[Any]:
    if os.environ.get("PRIOD_COMPILE", "") != "1":
        return []
    try:
        from mypyc.build import mypycify
    except ImportError as exc:
        raise SystemExit(
            "PRIOD_COMPILE=1 needs mypyc where it builds: pip install mypy 'setuptools>=77' '.[daemon]', "
            "then build with --no-build-isolation (docs/operations.md, The compiled build)"
        ) from exc
    # One shared library for them all, named for the package rather than a hash of the list.
    return list(mypycify(COMPILED, opt_level="3", group_name="priod"))


setup(ext_modules=ext_modules())
