"""Percentiles and latency summaries, for tests, the demo and the benchmark scripts.

One implementation of the figures every report prints: ``summarize(values, keys)`` picks the
keys a report wants (``n``, ``mean``, ``min``, ``max``, ``p50``, ``p99.9``...) in the order it
wants them, so a JSON report keeps its layout. Percentiles are numpy's (linear interpolation).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, overload

import numpy as np
import numpy.typing as npt

__all__ = ["SUMMARY_KEYS", "describe", "percentile", "summarize"]

Values = Sequence[float] | npt.NDArray[Any]
"""A list of figures, or a numpy array of them."""

SUMMARY_KEYS = ("n", "p50", "p99", "mean", "min", "max")
"""What `summarize` reports unless told otherwise."""


def percentile(values: Values, q: float) -> float:
    """The ``q``-th percentile of ``values`` (0 <= q <= 100); NaN when there are none."""
    if len(values) == 0:
        return float("nan")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


@overload
def summarize(
    values: Values, keys: Sequence[str] = SUMMARY_KEYS, *, ndigits: int | None = None, empty: float = math.nan
) -> dict[str, float]: ...


@overload
def summarize(
    values: Values, keys: Sequence[str] = SUMMARY_KEYS, *, ndigits: int | None = None, empty: None
) -> dict[str, float | None]: ...


def summarize(
    values: Values, keys: Sequence[str] = SUMMARY_KEYS, *, ndigits: int | None = None, empty: float | None = math.nan
) -> dict[str, float] | dict[str, float | None]:
    """The figures named by ``keys``, in that order.

    A key is ``n`` (how many values, an int), ``mean``, ``min``, ``max``, or ``p<q>`` for the
    q-th percentile (``p50``, ``p99.9``). ``ndigits`` rounds every figure but ``n``; with no
    values every figure but ``n`` is ``empty`` (NaN unless told, None for JSON reports).
    """
    arr = np.asarray(values, dtype=np.float64)
    out: dict[str, float | None] = {}
    for key in keys:
        if key == "n":
            out[key] = int(arr.size)
            continue
        if arr.size == 0:
            out[key] = empty
            continue
        if key == "mean":
            v = float(arr.mean())
        elif key == "min":
            v = float(arr.min())
        elif key == "max":
            v = float(arr.max())
        elif key.startswith("p"):
            v = float(np.percentile(arr, float(key[1:])))
        else:
            raise ValueError(f"unknown summary key {key!r}; use n, mean, min, max or p<percentile> such as p99.9")
        out[key] = round(v, ndigits) if ndigits is not None else v
    return out


def describe(values: Values) -> dict[str, float]:
    """``n``, ``p50``, ``p99`` and ``max`` of ``values`` (NaN where there are none)."""
    return summarize(values, ("n", "p50", "p99", "max"))
