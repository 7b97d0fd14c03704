"""The CUDA copy engine: `CudaEngine`, on NVIDIA GPUs through cuda-python.

The package, by module:

- `device`: a GPU's context, properties and per-lane streams;
- `memory`: pinned host regions, allocated or imported device regions, the daemon's IPC table;
- `events`: the event pool and the completion the daemon polls;
- `calibrate`: each lane's bandwidth, timed at start;
- `engine`: `CudaEngine`, which wires them into the `priod.daemon.engines.base.Engine` interface.

Shared with the client, in `priod.common.cuda`: `driver` (the only module of priod that imports
``cuda.bindings``, lazily: ``check`` for every CUDA call, the GPU probe, device scopes and IPC
handles), `express` (the express copy kernel, ``express.cu`` shipped as ``express.ptx``, loaded
and launched) and `batched` (batched DMA). The client-side helpers (`export_cuda_array`,
`open_device_export`, `CudaBuffer`) are in `priod.client.cuda_ipc`, which imports
`priod.common.cuda.driver` only. This ``__init__`` imports nothing itself:
the names below load their module on first access (module ``__getattr__``), so importing
``priod.common.cuda.driver`` never imports the engine, and neither needs a GPU nor
cuda-bindings.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from priod.common.cuda.driver import check, gpu_available
    from priod.common.cuda.express import EXPRESS_MAX, EXPRESS_MIN_H2D
    from priod.daemon.engines.cuda.engine import CudaEngine

__all__ = [
    "EXPRESS_MAX",
    "EXPRESS_MIN_H2D",
    "CudaEngine",
    "check",
    "gpu_available",
]

_WHERE = {
    "CudaEngine": "priod.daemon.engines.cuda.engine",
    "check": "priod.common.cuda.driver",
    "gpu_available": "priod.common.cuda.driver",
    "EXPRESS_MAX": "priod.common.cuda.express",
    "EXPRESS_MIN_H2D": "priod.common.cuda.express",
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
