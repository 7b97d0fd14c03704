"""Copy engine backends behind one interface (`base.Engine`): `sim` everywhere, `cuda` on a GPU."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config import Config
    from .base import Engine

__all__ = ["make_engine"]


def make_engine(cfg: Config, log: Any = None) -> Engine:
    """The engine ``[server] backend`` asks for; ``auto`` takes cuda where a GPU is found."""
    from .sim import SimEngine

    backend = cfg.server.backend
    reason = f"[server] backend = {backend!r}"
    if backend == "auto":
        try:
            from .cuda._driver import gpu_available
        except ImportError as exc:  # pragma: no cover - the module guards its own imports
            available, reason = False, f"auto: cuda engine unavailable ({exc})"
        else:
            available = gpu_available()
            reason = "auto: a GPU was found" if available else "auto: no usable GPU (or cuda-bindings missing), using the simulated engine"
        backend = "cuda" if available else "sim"
    if log is not None:
        log.info("engine_selected", backend=backend, reason=reason)
    if backend == "sim":
        return SimEngine(cfg.sim)
    from .cuda.engine import CudaEngine

    return CudaEngine(devices=list(cfg.cuda.devices) or None, express=cfg.scheduler.express, calibrate_bytes=cfg.cuda.calibrate_bytes, log=log)
