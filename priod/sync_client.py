"""Deprecated: moved to `priod.client.sync_client`; this path works until the next release."""

from __future__ import annotations

import warnings

from priod.client.sync_client import *  # noqa: F403

warnings.warn(
    "priod.sync_client is deprecated: import priod.client.sync_client instead", DeprecationWarning, stacklevel=2
)
