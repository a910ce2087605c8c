#!/usr/bin/env bash
# anyccl links beside candle: `cargo check` of bench/candle-fixture, a crate that depends on
# candle-core 0.11 with `cuda` (cudarc's dynamic linking, CUDA version from nvcc) and on
# anyccl with `nccl`. candle's CUDA kernels need nvcc and the CUDA headers: both come from
# PyPI (nvidia-cuda-nvcc, -nvvm, -runtime, -crt, -cccl 13.0) into a virtual environment. No
# GPU is needed. CI runs it (.ci/run); candle's kernels take most of its ~17 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-/tmp/anyccl-nvcc}
if [ ! -x "$VENV/bin/pip" ]; then
  python3 -m venv "$VENV"
fi
# One toolkit release throughout: a newer nvvm writes PTX that 13.0's ptxas refuses.
"$VENV/bin/pip" install -q nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-runtime==13.0.96 \
  nvidia-cuda-crt==13.0.88 "nvidia-cuda-cccl<13.1"
CUDA=$("$VENV/bin/python" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')
export PATH="$CUDA/bin:$PATH" CUDA_ROOT="$CUDA" CUDA_PATH="$CUDA" CUDA_HOME="$CUDA"
# No GPU here to ask: compile the kernels for the H200s (sm_90).
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
nvcc --version | tail -1
start=$(date +%s)
cargo check --manifest-path bench/candle-fixture/Cargo.toml --target-dir "${TARGET_DIR:-target/candle-fixture}"
echo "candle fixture: cargo check passed in $(( $(date +%s) - start )) s"
