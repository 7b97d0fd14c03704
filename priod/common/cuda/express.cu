// The express lane's copy kernel: SM-driven loads and stores that do not queue behind the copy
// engine (on an H200, 64 KiB took 27 us under a 2 GiB copy that held the DMA path for 36.5 ms;
// see priod/common/cuda/express.py). Shipped as PTX text (express.ptx, made by
// scripts/build_ptx.sh) and loaded with cuModuleLoadData, so no NVRTC is needed at run time.
//
// Two entry points: priod_copy(src, dst, n), one range, and priod_copy_table(table), up to 256
// ranges of a batch in one launch (see below). Each range is copied correctly for any size and
// any pair of addresses:
//   - the widest word w in {16, 8, 4, 2, 1} bytes for which src and dst share alignment is used;
//   - a head of < w bytes brings dst (and therefore src) to that alignment, a tail of < w bytes
//     follows the body; both are copied byte by byte by the first threads of the grid;
//   - the body is a grid-stride loop with UNROLL loads in flight per thread before the stores,
//     which is what hides the PCIe round trip when one side is mapped host memory.
// __launch_bounds__(1024, 2) keeps registers at 32 so two 1024-thread blocks fit on one SM.
// Loads and stores use the streaming cache hints (.cs): every byte is touched once, and the
// copy should not evict the L2 working set of whatever else runs on the GPU.
// A misaligned pair (src and dst differ mod 16) falls back to a narrower word; pairs that
// differ mod 2 copy byte by byte, correct but slower (the DMA path has no such penalty).

#define UNROLL 4

typedef unsigned long long u64;

template <typename T>
__device__ __forceinline__ T load_cs(const T* p) { return __ldcs(p); }
template <typename T>
__device__ __forceinline__ void store_cs(T* p, T v) { __stcs(p, v); }

// __ldcs/__stcs have no 8- or 16-bit overloads for every CUDA version: plain accesses there.
template <>
__device__ __forceinline__ unsigned char load_cs(const unsigned char* p) { return *p; }
template <>
__device__ __forceinline__ void store_cs(unsigned char* p, unsigned char v) { *p = v; }
template <>
__device__ __forceinline__ unsigned short load_cs(const unsigned short* p) { return *p; }
template <>
__device__ __forceinline__ void store_cs(unsigned short* p, unsigned short v) { *p = v; }

template <typename T>
__device__ __forceinline__ void copy_words(const T* __restrict__ s, T* __restrict__ d, u64 n, u64 i, u64 stride) {
  for (; i + (UNROLL - 1) * stride < n; i += UNROLL * stride) {
    T r[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; u++) r[u] = load_cs(s + i + u * stride);
#pragma unroll
    for (int u = 0; u < UNROLL; u++) store_cs(d + i + u * stride, r[u]);
  }
  for (; i < n; i += stride) store_cs(d + i, load_cs(s + i));
}

// One range, as grid-stride thread ``tid`` of ``stride``: the body of both kernels below.
__device__ __forceinline__ void copy_range(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst, u64 n, u64 tid, u64 stride) {
  const u64 mis = (u64)src ^ (u64)dst;
  const u64 w = (mis & 15) == 0 ? 16 : (mis & 7) == 0 ? 8 : (mis & 3) == 0 ? 4 : (mis & 1) == 0 ? 2 : 1;
  u64 head = (w - ((u64)dst & (w - 1))) & (w - 1);
  if (head > n) head = n;
  const u64 words = (n - head) / w;
  const u64 tail_at = head + words * w;
  if (tid < head) dst[tid] = src[tid];
  if (tid < n - tail_at) dst[tail_at + tid] = src[tail_at + tid];
  const unsigned char* s = src + head;
  unsigned char* d = dst + head;
  switch (w) {
    case 16: copy_words((const int4*)s, (int4*)d, words, tid, stride); break;
    case 8: copy_words((const int2*)s, (int2*)d, words, tid, stride); break;
    case 4: copy_words((const unsigned int*)s, (unsigned int*)d, words, tid, stride); break;
    case 2: copy_words((const unsigned short*)s, (unsigned short*)d, words, tid, stride); break;
    default: copy_words(s, d, words, tid, stride); break;
  }
}

extern "C" __global__ void __launch_bounds__(1024, 2)
priod_copy(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst, u64 n) {
  copy_range(src, dst, n, (u64)blockIdx.x * blockDim.x + threadIdx.x, (u64)gridDim.x * blockDim.x);
}

// A batch's chunk in one launch: the segment table travels in the kernel's parameters (the
// driver copies them at launch, so no buffer has to outlive the call), TABLE_MAX segments at
// most: 6,160 bytes, past the 4 KiB of old drivers, within the 32 KiB of CUDA 12.1 and later
// (every driver that loads this PTX). 256 rows is a KV-cache step's batch in one launch; two
// launches of 128 cost the host a launch and a join more, ~40 us when it has just woken
// (H200 probe). Segment i is copied by the blocks of row
// blockIdx.y == i, grid-stride over blockIdx.x, each with the widest word its own addresses
// allow. Offsets are relative to the two bases.
#define TABLE_MAX 256

struct SegmentTable {
  u64 src;
  u64 dst;
  u64 seg[3 * TABLE_MAX];  // (dst_offset, src_offset, nbytes) per segment
};

extern "C" __global__ void __launch_bounds__(1024, 2)
priod_copy_table(const __grid_constant__ SegmentTable t) {
  const u64* e = t.seg + 3 * blockIdx.y;
  copy_range((const unsigned char*)(t.src + e[1]), (unsigned char*)(t.dst + e[0]), e[2], (u64)blockIdx.x * blockDim.x + threadIdx.x,
             (u64)gridDim.x * blockDim.x);
}

// A direct batch's table (priod/client/direct.py), checked here instead of on the host: the host's
// checks are several numpy calls, each tens of microseconds on a thread that has just woken
// (H200: a direct batch of 256 blocks reads 130-150 us over a contiguous copy of its bytes with
// them, ~40 without; docs/benchmarks.md). Every block checks every row against the
// two buffers' sizes before it copies, so all blocks reach one verdict with no grid-wide
// barrier: every row is copied or none is. A bad row (nbytes 0, or a range past either buffer;
// compared without sums, so no figure can wrap) makes block (0, 0) write 1 + the first bad
// row's index to ``fault``, a word of mapped host memory the host reads once the stream is done.
// The daemon's tables are checked before any engine sees them and use priod_copy_table.
struct CheckedTable {
  u64 src;
  u64 dst;
  u64 src_bytes;
  u64 dst_bytes;
  u64 fault;  // the device address of the word a bad table is reported in
  u64 seg[3 * TABLE_MAX];
};

extern "C" __global__ void __launch_bounds__(1024, 2)
priod_copy_table_checked(const __grid_constant__ CheckedTable t) {
  __shared__ unsigned int first_bad;
  if (threadIdx.x == 0) first_bad = 0xffffffffu;
  __syncthreads();
  int bad = 0;
  for (unsigned int r = threadIdx.x; r < gridDim.y; r += blockDim.x) {
    const u64 d = t.seg[3 * r], s = t.seg[3 * r + 1], n = t.seg[3 * r + 2];
    if (n == 0 || n > t.dst_bytes || d > t.dst_bytes - n || n > t.src_bytes || s > t.src_bytes - n) {
      bad = 1;
      atomicMin(&first_bad, r);
    }
  }
  if (__syncthreads_or(bad)) {
    if (threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0) {
      *(volatile u64*)t.fault = (u64)first_bad + 1;
      __threadfence_system();
    }
    return;
  }
  const u64* e = t.seg + 3 * blockIdx.y;
  copy_range((const unsigned char*)(t.src + e[1]), (unsigned char*)(t.dst + e[0]), e[2], (u64)blockIdx.x * blockDim.x + threadIdx.x,
             (u64)gridDim.x * blockDim.x);
}
