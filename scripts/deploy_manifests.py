#!/usr/bin/env python3
"""Render the Helm chart (deploy/helm/priod) and write the plain manifests (deploy/kubernetes/).

The plain manifests are the chart rendered with ``plain: true`` (no Helm bookkeeping labels,
the namespace included), so the two can never drift: tests/test_deploy.py renders the chart
again and fails if deploy/kubernetes/ differs. After changing the chart, run

    python scripts/deploy_manifests.py

Rendering uses the ``helm`` binary where one is on PATH (``helm template``), else the
helm-python-sdk package (Helm's own Go template engine, bundled in its wheel; a test
dependency), so that CI renders the chart without downloading a helm release.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "priod"
PLAIN = ROOT / "deploy" / "kubernetes"
PLAIN_NAMESPACE = "priod"
MONITORING_KINDS = frozenset({"ServiceMonitor", "PrometheusRule"})
"""Kinds that need the Prometheus Operator's CRDs: written to their own file, so that a cluster
without them can apply the rest."""


class NoRenderer(RuntimeError):
    """Neither a helm binary nor helm-python-sdk is available."""


def renderer() -> str:
    """``"helm"`` or ``"helm-python-sdk"``: what `render` will use. Raises NoRenderer."""
    if shutil.which("helm"):
        return "helm"
    try:
        import helm_python  # noqa: F401
    except ImportError as exc:
        raise NoRenderer(
            f"no helm binary on PATH and helm-python-sdk is not installed ({exc}); pip install -e '.[test]' installs it"
        ) from exc
    return "helm-python-sdk"


def render(
    values: dict[str, Any] | None = None, release: str = "priod", namespace: str = "priod"
) -> list[dict[str, Any]]:
    """The chart's objects for these values, parsed, in template order (empty documents dropped)."""
    values = values or {}
    if renderer() == "helm":
        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as fp:
            yaml.safe_dump(values, fp)
            fp.flush()
            out = subprocess.run(
                ["helm", "template", release, str(CHART), "--namespace", namespace, "--values", fp.name],
                check=True,
                capture_output=True,
                text=True,
                env={**os.environ, "HELM_CACHE_HOME": tempfile.gettempdir()},
            ).stdout
        texts = [out]
    else:
        import helm_python

        with helm_python.Chart.load(str(CHART)) as chart:
            rendered = chart.render(values, name=release, namespace=namespace)
        # The SDK returns one text per template file; NOTES.txt is not a manifest.
        texts = [text for name, text in rendered.items() if name.endswith((".yaml", ".yml"))]
    docs = [doc for text in texts for doc in yaml.safe_load_all(text) if doc]
    # One order whichever renderer ran (helm sorts by kind, the SDK returns files), so the plain
    # manifests come out the same: what kubectl apply needs first comes first.
    return sorted(
        docs,
        key=lambda d: (
            KIND_ORDER.index(d["kind"]) if d["kind"] in KIND_ORDER else len(KIND_ORDER),
            d["kind"],
            d["metadata"]["name"],
        ),
    )


KIND_ORDER = ["Namespace", "PriorityClass", "ConfigMap", "Service", "DaemonSet", "ServiceMonitor", "PrometheusRule"]


def lint() -> list[str]:
    """Helm's lint findings of warning level or worse (empty when clean)."""
    if renderer() == "helm":
        r = subprocess.run(["helm", "lint", "--strict", str(CHART)], capture_output=True, text=True)
        return [] if r.returncode == 0 else [r.stdout + r.stderr]
    import helm_python

    result = helm_python.lint(str(CHART))
    # Severity 1 is INFO ("icon is recommended"); 2 and up are warnings and errors.
    return [f"{m['path']}: {m['error']}" for m in result["messages"] if m["severity"] >= 2] + [
        str(e) for e in result["errors"]
    ]


def plain_documents() -> dict[str, list[dict[str, Any]]]:
    """The plain manifests, by file name."""
    docs = render({"plain": True}, release="priod", namespace=PLAIN_NAMESPACE)
    files: dict[str, list[dict[str, Any]]] = {"priod.yaml": [], "monitoring.yaml": []}
    for doc in docs:
        monitoring = doc["kind"] in MONITORING_KINDS or doc["metadata"]["name"].endswith("-dashboard")
        files["monitoring.yaml" if monitoring else "priod.yaml"].append(doc)
    return files


HEADER = """\
# Generated from deploy/helm/priod by scripts/deploy_manifests.py (helm values: plain: true).
# Do not edit: change the chart and run the script again; tests/test_deploy.py checks they match.
"""


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the config file, the dashboard) as literal blocks, readable in a diff."""


def _str(dumper: yaml.SafeDumper, s: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)


_Dumper.add_representer(str, _str)


def plain_texts() -> dict[str, str]:
    """The plain manifests' file contents, by file name."""
    return {
        name: HEADER + "".join("---\n" + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=1000) for doc in docs)
        for name, docs in plain_documents().items()
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--check", action="store_true", help="only say whether deploy/kubernetes/ is up to date (exit 1 if not)"
    )
    args = p.parse_args()
    stale = []
    for name, text in plain_texts().items():
        path = PLAIN / name
        if not path.exists() or path.read_text() != text:
            stale.append(name)
            if not args.check:
                path.write_text(text)
    verb = "out of date" if args.check else "written"
    print(f"{verb}: {', '.join(stale)}" if stale else "deploy/kubernetes/ is up to date", file=sys.stderr)
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
