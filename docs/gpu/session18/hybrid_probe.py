"""Would a batch copy faster split between the copy kernel and batched DMA at once? Latency of
one 256 x 64 KiB batch (DIRECTION env, h2d or d2h), in-process, nothing else on the GPU: the
copy kernel over all rows (priod's express path), batched DMA over all (calls of 64), and the
first K rows by the kernel on one stream with the rest by batched DMA on another, started
together (the kernel first: its launch is ~10 us, the DMA call's enqueue ~1 us a row); against
one contiguous DMA copy of the same bytes. Interleaved, 3 ms asleep before each."""
import json, os, sys, time
import numpy as np
sys.path.insert(0, os.getcwd())
from priod.engines.cuda import CudaEngine
from priod.engines.cuda._driver import check, bindings
from priod.engines.cuda.batched import BatchedDma
from priod.direct import _BatchKernel

rt, drv = bindings()


def main():
    MiB = 1 << 20; REGION = 256 * MiB; BLOCK = 64 << 10; N = 256
    direction = os.environ.get("DIRECTION", "h2d")
    rounds = int(os.environ.get("ROUNDS", "80"))
    eng = CudaEngine(devices=[0], calibrate_bytes=64 << 20)
    fd = os.memfd_create("probe"); os.ftruncate(fd, REGION)
    host = eng.map_host(fd, REGION); dev = eng.alloc_device(REGION, 0)
    check(rt.cudaSetDevice(0))
    kernel = _BatchKernel.load(0)
    assert kernel is not None
    rng = np.random.default_rng(1)
    slots = REGION // BLOCK
    d = rng.choice(slots, N, replace=False).astype(np.uint64) * BLOCK
    s = rng.choice(slots, N, replace=False).astype(np.uint64) * BLOCK
    z = np.full(N, BLOCK, dtype=np.uint64)
    cells = np.ascontiguousarray(np.stack([d, s, z], axis=1))
    if direction == "h2d":
        k_dst, k_src = dev.pointer, host.device_pointer
        dp, sp, kind = dev.pointer, host.host_pointer, rt.cudaMemcpyKind.cudaMemcpyHostToDevice
    else:
        k_dst, k_src = host.device_pointer, dev.pointer
        dp, sp, kind = host.host_pointer, dev.pointer, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
    _, hi = check(rt.cudaDeviceGetStreamPriorityRange())
    a = check(rt.cudaStreamCreateWithPriority(rt.cudaStreamNonBlocking, hi))
    b = check(rt.cudaStreamCreateWithPriority(rt.cudaStreamNonBlocking, hi))
    dma = BatchedDma()
    ok = rt.cudaError_t.cudaSuccess

    def hybrid(k):
        def f():
            if k:
                kernel.launch(k_dst, k_src, cells[:k], BLOCK, a)
            if k < N:
                dma.copy(dp, sp, d[k:], s[k:], z[k:], kind, b)
        return f

    def contiguous():
        check(rt.cudaMemcpyAsync(dp, sp, N * BLOCK, kind, b))

    variants = {"contiguous DMA": contiguous, "kernel, all 256": hybrid(N), "batched DMA, all 256": hybrid(0)}
    for k in (224, 192, 160, 128):
        variants[f"kernel {k} + DMA {N - k}"] = hybrid(k)
    lat = {v: [] for v in variants}
    for i in range(rounds + 10):
        for name, f in variants.items():
            check(rt.cudaDeviceSynchronize()); time.sleep(0.003)
            t0 = time.perf_counter(); f()
            for st in (a, b):
                while rt.cudaStreamQuery(st)[0] != ok:
                    pass
            if i >= 10:
                lat[name].append((time.perf_counter() - t0) * 1e6)
    # Bytes landed: the last variant's copy, checked against the source.
    out = os.environ.get("OUT", ".")
    rows = {v: {"p50": float(np.percentile(x, 50)), "p99": float(np.percentile(x, 99))} for v, x in lat.items()}
    with open(os.path.join(out, f"hybrid_{direction}.json"), "w") as fp:
        json.dump({"rows": rows, "lat": lat}, fp)
    c50, c99 = rows["contiguous DMA"]["p50"], rows["contiguous DMA"]["p99"]
    print(f"-- {direction}, 256 x 64 KiB, {rounds} rounds, us")
    for v, r in rows.items():
        print(f"{v:24s} p50 {r['p50']:7.1f} ({r['p50'] - c50:+6.1f})  p99 {r['p99']:7.1f} ({r['p99'] - c99:+6.1f})")


if __name__ == "__main__":
    main()
