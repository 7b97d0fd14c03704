"""Which threads of a process feeding one DMA lane take CPU: 27 MiB chunks, two on the stream,
the next one issued after a short sleep and a query (as the daemon's poller does), in-process
with the daemon's own engine (its context flags, its event pool). Is the busy thread beside the
daemon's loop (0.1-0.18 CPU s/s with bulk alone, not a Python thread) the driver's?"""
import os, sys, time
sys.path.insert(0, os.getcwd())
from priod.engines.cuda import CudaEngine
from priod.engines.cuda._driver import check, bindings
rt, drv = bindings()
MiB = 1 << 20
eng = CudaEngine(devices=[0], calibrate_bytes=64 << 20)
REGION = 1024 * MiB
fd = os.memfd_create("probe"); os.ftruncate(fd, REGION)
host = eng.map_host(fd, REGION); dev = eng.alloc_device(REGION, 0)
lane = eng._devices[0].h2d
stream, kind = lane.dma, lane.kind
hp, dp = host.host_pointer, dev.pointer
ok = rt.cudaError_t.cudaSuccess
pid = os.getpid()

def threads():
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        f = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        out[int(tid)] = ((int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK"), open(f"/proc/{pid}/task/{tid}/comm").read().strip())
    return out

def feed(seconds, with_events):
    size = 27 * MiB; n = REGION // size
    events = [check(rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming)) for _ in range(4)]
    t0 = time.perf_counter(); i = 0; polls = 0
    while time.perf_counter() - t0 < seconds:
        if i >= 2:
            while True:
                time.sleep(0.0003); polls += 1
                done = rt.cudaEventQuery(events[(i - 2) % 4])[0] == ok if with_events else rt.cudaStreamQuery(stream)[0] == ok
                if done or not with_events:
                    break
        off = (i % n) * size
        check(rt.cudaMemcpyAsync(dp + off, hp + off, size, kind, stream))
        if with_events:
            check(rt.cudaEventRecord(events[i % 4], stream))
        i += 1
    check(rt.cudaStreamSynchronize(stream))
    return i / (time.perf_counter() - t0), polls / (time.perf_counter() - t0)

for with_events in (True, False, True):
    a = threads(); t = time.perf_counter()
    chunks, polls = feed(3.0, with_events)
    b = threads(); el = time.perf_counter() - t
    busy = sorted((((b[k][0] - a.get(k, (0, ""))[0]) / el), b[k][1] + ("/main" if k == pid else f"/{k}")) for k in b)[::-1][:4]
    print(f"events {with_events}: {chunks:.0f} chunks/s, {polls:.0f} polls/s; CPU s/s by thread: " + ", ".join(f"{n} {c:.3f}" for c, n in busy), flush=True)
