"""The CUDA copy engine: `CudaEngine`, on NVIDIA GPUs through cuda-python.

The package, by module:

- `_driver`: the only module of priod that imports ``cuda.bindings`` (lazily), ``check`` for
  every CUDA call, the GPU probe, device scopes and IPC handles;
- `device`: a GPU's context, properties and per-lane streams;
- `memory`: pinned host regions, allocated or imported device regions, the daemon's IPC table;
- `events`: the event pool and the completion the daemon polls;
- `express`: the express copy kernel (``express.cu``, shipped as ``express.ptx``), loaded and
  launched;
- `calibrate`: each lane's bandwidth, timed at start;
- `engine`: `CudaEngine`, which wires them into the `priod.engines.base.Engine` interface.

The client-side helpers (`export_cuda_array`, `open_device_export`, `CudaBuffer`) are not here
but in `priod.cuda_ipc`, which imports `_driver` only. This ``__init__`` imports nothing itself:
the names below load their module on first access (module ``__getattr__``), so importing
``priod.engines.cuda._driver`` never imports the engine, and neither needs a GPU nor
cuda-bindings.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._driver import check, gpu_available
    from .engine import CudaEngine
    from .express import EXPRESS_MAX, EXPRESS_MIN_H2D

__all__ = [
    "EXPRESS_MAX",
    "EXPRESS_MIN_H2D",
    "CudaEngine",
    "check",
    "gpu_available",
]

_WHERE = {
    "CudaEngine": "priod.engines.cuda.engine",
    "check": "priod.engines.cuda._driver",
    "gpu_available": "priod.engines.cuda._driver",
    "EXPRESS_MAX": "priod.engines.cuda.express",
    "EXPRESS_MIN_H2D": "priod.engines.cuda.express",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
