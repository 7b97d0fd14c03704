"""examples/kv_offload.py runs to its end on the sim engine (skipped without torch): paged KV
blocks offloaded as one batch and reloaded urgently, the attention output bitwise the same."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from priod.testing import DaemonProcess

pytest.importorskip("torch")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "kv_offload.py"


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_example_offloads_and_reloads_on_sim(daemon: DaemonProcess, dtype: str) -> None:
    """The example against a sim daemon: it exits 0 and reports each step, ending in ``ok``."""
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--socket", daemon.socket_path, "--dtype", dtype, "--blocks", "16"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"sim engine, {dtype}: KV cache (2, 128, 16, 8, 64) on cpu")
    assert "offload A: 16 blocks as one copy_batch (32 segments" in lines[1]
    assert lines[2].startswith("reload A: 32 segments urgent")
    assert lines[-1] == "attention output after offload and reload equals the output before: ok"


@pytest.mark.parametrize("flag", ["--register", "--direct"])
def test_example_refuses_cuda_only_flags_on_sim(daemon: DaemonProcess, flag: str) -> None:
    """--register (PyTorch's own CUDA tensor) and --direct (this process's own CUDA copy) need
    the cuda engine, and say so."""
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--socket", daemon.socket_path, flag],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1
    assert out.stderr.strip().endswith(
        f"{flag} needs the cuda engine (this daemon runs sim): its device memory is a GPU's"
    )
