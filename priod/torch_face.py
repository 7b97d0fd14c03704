"""Deprecated: moved to `priod.client.torch_face`; this path works until the next release."""

from __future__ import annotations

import warnings

from priod.client.torch_face import *  # noqa: F403

warnings.warn(
    "priod.torch_face is deprecated: import priod.client.torch_face instead", DeprecationWarning, stacklevel=2
)
