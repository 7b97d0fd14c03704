"""Deprecated: moved to `priod.client.cuda_ipc`; this path works until the next release."""

from __future__ import annotations

import warnings

from priod.client.cuda_ipc import *  # noqa: F403

warnings.warn("priod.cuda_ipc is deprecated: import priod.client.cuda_ipc instead", DeprecationWarning, stacklevel=2)
