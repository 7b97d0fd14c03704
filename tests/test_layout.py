"""The package's layout is part of its contract: a client process's ``import priod`` loads no
daemon code, the client and the daemon never import each other, nothing imports in a circle,
and the public paths that moved still work for one release, with a warning naming the new one."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "priod"


def test_import_priod_in_a_client_loads_no_daemon_module() -> None:
    """A fresh interpreter that imports priod (and its client API) has no daemon, scheduler,
    simulator or engine module loaded, and no CUDA bindings."""
    code = (
        "import sys, priod, priod.client\n"
        "c = priod.connect; s = priod.SyncClient\n"
        "print('\\n'.join(sorted(m for m in sys.modules if m.startswith(('priod', 'cuda', 'uvloop', 'structlog', 'prometheus_client')))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()
    assert "priod.client.client" in out and "priod.wire.transport" in out, out  # the probe sees what it should
    loaded_daemon = [
        m
        for m in out
        if m.startswith("priod.daemon") or m.startswith(("cuda", "uvloop", "structlog", "prometheus_client"))
    ]
    assert loaded_daemon == [], loaded_daemon


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Every priod module and the priod modules it imports anywhere in its text (type-only and
    function-level imports included): `from pkg import name` counts as pkg.name where that is a
    module."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and node.module
                and node.module.split(".")[0] == "priod"
            ):
                for alias in node.names:
                    child = f"{node.module}.{alias.name}"
                    found.add(child if child in modules else node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.split(".")[0] == "priod")
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


DEPRECATED = {"priod.direct", "priod.cuda_ipc", "priod.torch_face", "priod.sync_client", "priod.config"}


def test_client_and_daemon_never_import_each_other_and_the_shared_layers_import_neither() -> None:
    graph = _imports()
    wrong = []
    for module, targets in graph.items():
        if module in DEPRECATED:
            continue
        for target in targets:
            if module.startswith("priod.client") and target.startswith("priod.daemon"):
                wrong.append((module, target))
            if module.startswith("priod.daemon") and target.startswith("priod.client"):
                wrong.append((module, target))
            if module.startswith(("priod.wire", "priod.common")) and target.startswith(
                ("priod.client", "priod.daemon", "priod.testing")
            ):
                wrong.append((module, target))
            if module.startswith("priod.common") and target.startswith("priod.wire"):
                wrong.append((module, target))  # common is the bottom layer
            if (
                module.startswith("priod.daemon.sched")
                and target.startswith("priod.daemon")
                and not target.startswith("priod.daemon.sched")
            ):
                wrong.append((module, target))  # the scheduler is pure: no engine, no I/O
    assert wrong == [], wrong


def test_no_module_imports_in_a_circle() -> None:
    graph = _imports()
    cycles = []
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert cycles == [], cycles


@pytest.mark.parametrize(
    ("old", "new", "name"),
    [
        ("priod.direct", "priod.client.direct", "DirectCopies"),
        ("priod.cuda_ipc", "priod.client.cuda_ipc", "gpu_uuid"),
        ("priod.torch_face", "priod.client.torch_face", "where"),
        ("priod.sync_client", "priod.client.sync_client", "SyncClient"),
        ("priod.config", "priod.daemon.config", "load_config"),
    ],
)
def test_moved_public_paths_still_work_and_name_the_new_one(old: str, new: str, name: str) -> None:
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert any(new in m for m in messages), messages
    assert getattr(module, name) is getattr(importlib.import_module(new), name)
