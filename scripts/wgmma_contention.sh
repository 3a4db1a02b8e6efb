#!/usr/bin/env bash
# Float math beside wgmma on one SM (scripts/wgmma_contention.cu), on the GPU machine:
#   bash scripts/wgmma_contention.sh     (needs the nvidia-cutlass package for the CuTe headers)
set -euo pipefail
inc=$(python3 -c "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))")
nvcc -O3 -arch=sm_90a -std=c++17 --expt-relaxed-constexpr -I"$inc" -o /tmp/wgmma_contention \
  scripts/wgmma_contention.cu
/tmp/wgmma_contention
