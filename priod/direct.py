"""Deprecated: moved to `priod.client.direct`; this path works until the next release."""

from __future__ import annotations

import warnings

from priod.client.direct import *  # noqa: F403

warnings.warn("priod.direct is deprecated: import priod.client.direct instead", DeprecationWarning, stacklevel=2)
