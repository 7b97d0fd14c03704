"""CPU probe (session 14, no GPU): what moving a batch's bytes costs this machine, with no daemon.

The sim engine moves a batch's bytes for real, as slice assignments between two memfd mappings
(`priod/engines/sim_model.py`, `Worker._move`). Here the same loop moves 512 scattered 16 KiB
blocks, 30 times each way, back to back ("warm"), after 20 ms asleep, after 20 ms spinning on
the CPU with no memory traffic, after 1 ms asleep, and in two threads at once, ctypes.memmove
each (which lets go of the GIL), after 20 ms asleep. p50 ms.

    .venv/bin/python docs/gpu/session14/cpu_cold_copy_probe.py
"""

import ctypes
import mmap
import os
import threading
import time

import numpy as np

N, BLOCK, SLOTS = 512, 16 << 10, 1024
SIZE = SLOTS * BLOCK


def region() -> np.ndarray:
    fd = os.memfd_create("probe")
    os.ftruncate(fd, SIZE)
    return np.frombuffer(mmap.mmap(fd, SIZE), dtype=np.uint8)


def main() -> None:
    rng = np.random.default_rng(1)
    src, dst = region(), region()
    src[:] = 1
    dst[:] = 2
    src_at, dst_at = src.ctypes.data, dst.ctypes.data

    def move(segs: list[list[int]]) -> None:
        for d, s, n in segs:
            dst[d : d + n] = src[s : s + n]

    def memmove(segs: list[list[int]]) -> None:
        for d, s, n in segs:
            ctypes.memmove(dst_at + d, src_at + s, n)

    def two_threads(segs: list[list[int]]) -> None:
        other = threading.Thread(target=memmove, args=(segs[N // 2 :],))
        other.start()
        memmove(segs[: N // 2])
        other.join()

    def spin(seconds: float) -> None:
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            pass

    cases = {
        "warm": (move, lambda: None),
        "after 20 ms asleep": (move, lambda: time.sleep(0.02)),
        "after 20 ms spinning": (move, lambda: spin(0.02)),
        "after 1 ms asleep": (move, lambda: time.sleep(0.001)),
        "two threads, memmove, after 20 ms asleep": (two_threads, lambda: time.sleep(0.02)),
    }
    for name, (fn, before) in cases.items():
        took = []
        for _ in range(30):
            segs = np.stack([rng.choice(SLOTS, N, replace=False) * BLOCK, rng.choice(SLOTS, N, replace=False) * BLOCK, np.full(N, BLOCK)], axis=1).tolist()
            before()
            t0 = time.perf_counter()
            fn(segs)
            took.append(time.perf_counter() - t0)
        print(f"{name:<42} {np.median(took) * 1e3:6.2f} ms")
    t0 = time.perf_counter()
    dst[: SIZE // 2] = src[SIZE // 2 :]
    print(f"{'one contiguous 8 MiB, warm':<42} {(time.perf_counter() - t0) * 1e3:6.2f} ms")


if __name__ == "__main__":
    main()
