#!/usr/bin/env bash
# Regenerate priod/common/cuda/express.ptx (committed) from priod/common/cuda/express.cu.
#
# The PTX targets compute_75, the oldest architecture current nvcc accepts, so the driver
# JIT-compiles it for whatever GPU it runs on. The PTX ISA version follows the nvcc used:
# nvcc 13.0 writes PTX 9.0, which needs a driver of the 580 series or newer; with an older
# driver the cuda engine turns its express lane off and says so. Set NVCC to use another
# compiler (an older one widens the range of drivers that load the PTX).
#
# Usage: scripts/build_ptx.sh [--check]   (--check: also compile for sm_90 and print
# register use, which must stay at or under 32 per thread for two 1024-thread blocks per SM)
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-nvcc}
src=priod/common/cuda/express.cu
out=priod/common/cuda/express.ptx
"$NVCC" -ptx -O3 -arch=compute_75 -o "$out.tmp" "$src"
mv "$out.tmp" "$out"
echo "wrote $out ($("$NVCC" --version | tail -1))"
if [[ "${1:-}" == "--check" ]]; then
  tmp=$(mktemp -d)
  "$NVCC" -cubin -O3 -arch=sm_90 -Xptxas -v -o "$tmp/express.cubin" "$src"
  rm -rf "$tmp"
fi
