#!/usr/bin/env bash
# The project's one GPU check: FlashInfer against the torch reference (and CUDA-graph steps against
# eager ones), and the benchmark of FlashInfer eager against FlashInfer with CUDA graphs.
#
# For a machine with one CUDA GPU, Python 3.12 with PyTorch preinstalled, and no network. The
# wheels specroll needs beyond that travel next to the checkout, in .whl/ (or $SPECROLL_WHEELS);
# download them on any machine with pip (any OS), from the repository root:
#
#   mkdir -p .whl && for w in flashinfer-python==0.7.0 apache-tvm-ffi==0.1.15.post2 nvidia-ml-py \
#       pyzmq msgspec gguf; do python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl "$w"; done
#
# (about 38 MB; flashinfer-python 0.7.0 is the newest whose wheel fits a 60 MB budget, and its
# kernels are JIT-compiled here with the machine's nvcc, so no prebuilt kernel package is needed.)
# The wheels go in with --no-deps: the machine's image must already hold what they and specroll
# need beyond them — numpy, tokenizers, safetensors, jinja2, tqdm, anyio, pytest, and for
# FlashInfer's JIT nvcc (CUDA 12.9 or 13), ninja, einops, packaging, requests, click, tabulate
# (the workplace's CUDA image has all of these).
#
# Usage: scripts/gpu_check.sh [OUT_DIR]    (default $OUT, else ./gpu_check)
# Writes OUT_DIR/gpu.txt (machine), jit.log, gpu_tests.log + gpu_tests.xml, gpu_bench.log,
# gpu_bench.json (the figures) and gpu_profile.txt (where a batch-1 speculative step's time goes).
# Exits non-zero when a test or the benchmark failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu_check}}"
mkdir -p "$out" && out="$(cd "$out" && pwd)"
wheels="${SPECROLL_WHEELS:-.whl}"
began=$(date +%s)
stamp() { echo "[gpu_check +$(( $(date +%s) - began ))s] $*"; }

python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "gpu_check: torch sees no CUDA GPU here; this script is for a CUDA machine"; exit 1; }
ls "$wheels"/*.whl >/dev/null 2>&1 \
    || { echo "gpu_check: no wheels in $wheels; download them as this script's header says"; exit 1; }
scratch="$(mktemp -d /tmp/specroll-gpu-check.XXXXXX)"
trap 'rm -rf "$scratch"' EXIT
site="$scratch/site"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "$wheels"/*.whl || { echo "gpu_check: could not install the wheels in $wheels"; exit 1; }
# specroll from the checkout, without building it: the package is src/specroll.
export PYTHONPATH="$PWD/src:$site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 MAX_JOBS="${MAX_JOBS:-$(nproc)}" FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer-cache
if [ -z "${CUDA_HOME:-}" ] && ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
    export CUDA_HOME=/usr/local/cuda PATH="/usr/local/cuda/bin:$PATH"
fi

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nvcc --version | tail -1
  python3 -c "import sys, torch, flashinfer; print(sys.version.split()[0], torch.__version__, 'flashinfer', flashinfer.__version__)"
} 2>&1 | tee "$out/gpu.txt"

stamp "JIT: compiling FlashInfer's kernels for bf16, head_dim 64"
timeout 240 python3 - <<'PY' 2>&1 | tee "$out/jit.log"
import time, torch
from specroll.engine.batch import build_metadata
from specroll.engine.flashinfer_attention import FlashInferAttention
from specroll.engine.flashinfer_sampling import FlashInferSampler
from specroll.protocol.sampling import SamplingParams
cuda = torch.device("cuda")
backend = FlashInferAttention(9, 3, 64, cuda, torch.bfloat16)
cache = torch.zeros(8, 2, 16, 3, 64, device=cuda, dtype=torch.bfloat16)
for q_lens in ([20], [1]):  # prefill wrapper, then decode wrapper
    t0 = time.perf_counter()
    meta = build_metadata(q_lens, [20], [[0, 1]], 16)
    backend.plan(meta)
    n = sum(q_lens)
    backend.forward(*(torch.randn(n, h, 64, device=cuda, dtype=torch.bfloat16) for h in (9, 3, 3)), cache)
    torch.cuda.synchronize()
    print(f"{'prefill' if q_lens[0] > 1 else 'decode'} kernels ready in {time.perf_counter() - t0:.1f} s", flush=True)
t0 = time.perf_counter()  # the prefill wrapper with a custom mask (draft trees): another kernel variant
tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool, device="cpu")
backend.plan(build_metadata([3], [20], [[0, 1]], 16, {0: tree}))
backend.forward(*(torch.randn(3, h, 64, device=cuda, dtype=torch.bfloat16) for h in (9, 3, 3)), cache)
torch.cuda.synchronize()
print(f"tree (custom mask) kernels ready in {time.perf_counter() - t0:.1f} s", flush=True)
t0 = time.perf_counter()
FlashInferSampler(cuda, 0).sample(torch.randn(4, 100, device=cuda), [SamplingParams()] * 4)
import flashinfer.sampling
flashinfer.sampling.chain_speculative_sampling(torch.full((1, 2, 100), 0.01, device=cuda),
    torch.zeros(1, 2, dtype=torch.int32, device=cuda), torch.full((1, 3, 100), 0.01, device=cuda))
torch.cuda.synchronize()
print(f"sampling kernels ready in {time.perf_counter() - t0:.1f} s")
PY
jit_rc=${PIPESTATUS[0]}

stamp "tests (pytest -m gpu)"
timeout 360 python3 -m pytest -q -m gpu tests/engine/test_flashinfer_gpu.py -p no:cacheprovider \
    --junitxml "$out/gpu_tests.xml" 2>&1 | tee "$out/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
if grep -q "skipped" "$out/gpu_tests.log"; then  # a skipped GPU test here means the check did not check
    echo "gpu_check: some GPU tests were skipped" | tee -a "$out/gpu_tests.log"; tests_rc=1
fi

stamp "benchmark: FlashInfer eager vs CUDA graphs vs compiled + graphs (decode B = 1/16/64, speculative B = 1)"
(cd benchmarks && timeout 300 python3 bench_backends.py --backends flashinfer,flashinfer-graphs,flashinfer-compiled-graphs --repeats 2 \
    --json "$out/gpu_bench.json" --profile "$out/gpu_profile.txt") 2>&1 | tee "$out/gpu_bench.log"
bench_rc=${PIPESTATUS[0]}

stamp "done: jit rc=$jit_rc, tests rc=$tests_rc, benchmark rc=$bench_rc" | tee -a "$out/gpu.txt"
[ "$jit_rc" = 0 ] && [ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
