"""Deprecated: moved to `priod.daemon.config` (the socket path: `priod.common.socket_path`); this path works until the next release."""

from __future__ import annotations

import warnings

from priod.common.socket_path import *  # noqa: F403
from priod.daemon.config import *  # noqa: F403

warnings.warn("priod.config is deprecated: import priod.daemon.config instead", DeprecationWarning, stacklevel=2)
