"""Reading a daemon's Prometheus endpoint as tests and scripts do: a free port to serve it on,
one scrape as ``{(name, labels): value}``, and the two lookups PromQL would make of it."""

from __future__ import annotations

import socket
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Samples", "Scraper", "free_port", "get", "total"]

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
"""One scrape: every sample's value by its full name (``_bucket``, ``_total``... included) and labels."""


def free_port() -> int:
    """A loopback TCP port nothing listens on now (for ``PRIOD_METRICS__PORT``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Scraper:
    """Scrapes ``http://127.0.0.1:<port>/metrics``; remembers each family's type as last seen."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.families: dict[str, str] = {}

    def text(self) -> str:
        with urllib.request.urlopen(self.url, timeout=30) as r:
            assert r.status == 200
            return str(r.read().decode())

    def __call__(self) -> Samples:
        """Every sample of one scrape, keyed by (name, labels)."""
        out: Samples = {}
        for fam in text_string_to_metric_families(self.text()):
            self.families[fam.name] = fam.type
            for s in fam.samples:
                out[(s.name, frozenset(s.labels.items()))] = s.value
        return out


def get(samples: Samples, name: str, **labels: str) -> float:
    """The one series of ``name`` with exactly these labels (0 where it does not exist)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum over every series of ``name`` that has these labels (and any others), as
    PromQL's ``sum(name{labels})``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)
