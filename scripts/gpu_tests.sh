#!/usr/bin/env bash
# Runs the CUDA tests and the CUDA benchmark on the GPU machine from binaries built elsewhere:
#   cargo build --release && cargo test --no-run      (here)
#   scripts/stage_gpu_binaries.sh                     (here: stripped copies into .out/bin)
#   scripts/gpu_tests.sh [tests|bench|startup|long|calibration|sweep|capture|matrix|positions|nano|engine-ci|devicemap|profile|all]       (there, with .out/pack and .cache carried;
#                                                     nano: the nano-vllm-fork wheel in .whl/ too)
#   scripts/gpu_tests.sh [tp|placed|multi]            (two or more GPUs: tensor-parallel capture, the reference across GPUs)
set -euo pipefail
stage=${1:-all}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
# The binaries travel compressed (scripts/stage_gpu_binaries.sh packs them).
[ -x .out/bin/kvdiff ] || tar xJf .out/pack/bin.tar.xz -C .out
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export KVDIFF_ROOT=$root KVDIFF_BIN=$root/.out/bin/kvdiff KVDIFF_REQUIRE_CUDA=1
export KVDIFF_CACHE_DIR=/tmp/kvdiff-cache
out=${OUT:-/tmp}
export KVDIFF_CONFORMANCE_OUT=$out
# NVLink multicast stays off in every multi-GPU program (NCCL, PyTorch, NVSHMEM).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
# The default model on GPU 0 alone, placed over GPUs 0 and 1, and placed over them with the
# home GPU's tap budget at 1 MiB (GPU 1 then lends the reference's taps their memory; on one GPU
# that budget splits them into layer groups): the JSON reports must be byte for byte alike.
placed_tests() {
  local run d budget name
  for run in 0: 0,1: 0:1 0,1:1; do
    d=${run%%:*} budget=${run#*:} name=placed-${run//[:,]/-}
    KVDIFF_CUDA_TAP_BUDGET=$budget .out/bin/kvdiff -v compare --backend cuda --devices $d \
      --json /tmp/$name.json fixtures/prompts/no-system.json > /tmp/$name.out 2> /tmp/$name.err || true
    echo "$name: $(grep -cE "EQUIVALENT|DIVERGED" /tmp/$name.out || true) verdicts"
    grep -E "placed|another GPU|layer groups|^error:|fix:" /tmp/$name.err | head -3 || true
  done
  if cmp /tmp/placed-0-.json /tmp/placed-0-1-.json; then
    echo "default model: one GPU and --devices 0,1 reports alike"
  else
    echo "FAILED: one GPU and --devices 0,1 report differently"
  fi
  # At 1 MiB on one GPU the taps are split into layer groups; with GPU 1 lending, they are not.
  if grep -q "layer groups" /tmp/placed-0-1.err && grep -q "another GPU's memory" /tmp/placed-0-1-1.err &&
    ! grep -q "layer groups" /tmp/placed-0-1-1.err &&
    cmp /tmp/placed-0-.json /tmp/placed-0-1-1.json; then
    echo "default model: taps kept in GPU 1's memory, one pass, reports alike"
  else
    echo "FAILED: taps lent by GPU 1"
  fi
}
if [ "$stage" = all ] || [ "$stage" = tests ]; then
  .out/bin/cuda-tests cuda:: --test-threads 1 --nocapture 2>&1 | tee "$out/cuda-tests.log" |
    grep --line-buffered -E "^(test |SKIPPED|CPU vs CUDA|  [a-z_]+ +[0-9]|thread|seed|test result)"
  # The kernels again with prefill attention on the CUDA cores (what GPUs before sm_80 run).
  KVDIFF_CUDA_MMA=0 .out/bin/cuda-tests --test-threads 1 cuda::kernels_match 2>&1 |
    tee "$out/cuda-tests-no-mma.log" | grep --line-buffered -E "^(test |test result)"
fi
if [ "$stage" = all ] || [ "$stage" = bench ]; then
  scripts/bench_cuda.sh .out/bin/kvdiff 2>&1 | tee "$out/bench.log" | grep --line-buffered -vE "^(Writing|Loading)"
fi
if [ "$stage" = all ] || [ "$stage" = startup ]; then
  scripts/bench_startup.sh .out/bin/kvdiff 2>&1 | tee "$out/startup.log"
fi
if [ "$stage" = all ] || [ "$stage" = long ]; then
  scripts/bench_long.sh .out/bin/kvdiff 2>&1 | tee "$out/long.log"
fi
if [ "$stage" = all ] || [ "$stage" = calibration ]; then
  scripts/bench_calibration.sh .out/bin/kvdiff 2>&1 | tee "$out/calibration.log"
fi
if [ "$stage" = all ] || [ "$stage" = sweep ]; then
  scripts/bench_sweep.sh .out/bin/kvdiff 2>&1 | tee "$out/sweep.log"
fi
if [ "$stage" = all ] || [ "$stage" = profile ]; then
  scripts/profile_kernels.sh .out/bin/kvdiff 2>&1 | tee "$out/profile.log"
fi
if [ "$stage" = all ] || [ "$stage" = capture ]; then
  # HF transformers and a nano-vllm layout captured by the kvdiff_capture package, then kvdiff diff.
  python3 scripts/capture_hf_test.py .out/bin/kvdiff "$out" 2>&1 | tee "$out/capture.log" | grep -vE "^\(|Writing|Loading"
  for m in fixtures/default-model fixtures/random-model; do
    python3 scripts/capture_nano_test.py .out/bin/kvdiff "$m"
  done
fi
if [ "$stage" = all ] || [ "$stage" = matrix ]; then
  # HF generate() as people configure it: caches, attention, padding, chunked prefill, compile;
  # every clean run EQUIVALENT, every planted fault named (docs/engine-debugging.md#measured).
  python3 scripts/capture_hf_matrix.py .out/bin/kvdiff "$out" 2>&1 | tee "$out/matrix.log" | tail -n 120
fi
if [ "$stage" = all ] || [ "$stage" = positions ]; then
  # Clean HF dumps far out in the positions (a Qwen3, and a Llama with Llama 3's RoPE scaling),
  # where an f32 angle's rounding is many units of the engine's precision: each must be
  # EQUIVALENT with replay on, on either backend.
  # The last, `model.to(bfloat16)` after building in f32, rounds RoPE's inv_freq to bf16: it
  # must be DIVERGED at L0.q_rope.
  for spec in float32:4096 float32:8000 float16:8000 bfloat16:8000 float32:8000:llama3 \
    bfloat16:8000:llama3 bfloat16:4096:cast; do
    IFS=: read -r dt n how <<< "$spec"
    d=/tmp/kvdiff-far/$dt-$n${how:+-$how}
    rm -rf "$d" && mkdir -p "$d"
    python3 scripts/replay_long_prompt.py fixtures/default-model "$d/model" "$d/dump" "$n" "$dt" $how 2>/dev/null | tail -1
    for b in cpu cuda; do
      rc=0
      .out/bin/kvdiff diff --backend "$b" --model "$d/model" --json "$d/$b.json" "$d/dump" > "$d/$b.txt" 2>&1 || rc=$?
      echo "positions: HF $dt${how:+ ($how)}, $n tokens, --backend $b: $(grep -m1 -oE 'EQUIVALENT|DIVERGED' "$d/$b.txt" || echo none) (exit $rc)"
      [ "$rc" = 0 ] || grep -E "first divergence|systematic|replay:|error|^  L[0-9]" "$d/$b.txt" | head -6 || true
    done
  done 2>&1 | tee "$out/positions.log"
fi
if [ "$stage" = all ] || [ "$stage" = engine-ci ]; then
  # The pytest plugin on torch engines (docs/engine-ci.md): the kvdiff wheel built here
  # (maturin build --release, into .whl/) installed as a user installs it, pytest and hypothesis
  # from wheels carried in .whl/py, nano-vllm from its wheel.
  # Installed beside the image's torch (a --target folder: that python3 is itself a venv).
  rm -rf /tmp/kvdiff-site
  python3 -m pip install -q --no-index --no-deps --target /tmp/kvdiff-site .whl/kvdiff-*.whl .whl/py/*.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/nano-site .whl/nano_vllm_fork-*.whl
  (cd tests/python/gpu && KVDIFF_GPU_ENGINES=1 KVDIFF_REQUIRE_NANO=1 PATH=/tmp/kvdiff-site/bin:$PATH \
    PYTHONPATH=/tmp/kvdiff-site:/tmp/nano-site:${PYTHONPATH:-} \
    python3 -m pytest -q -p no:cacheprovider -rA -s . 2>&1 | tee "$out/engine-ci.log" | tail -n 60)
fi
if [ "$stage" = all ] || [ "$stage" = nano ]; then
  # A real nano-vllm release (its wheel carried in .whl/: pip download --no-deps nano-vllm-fork),
  # flash-attn replaced by the torch stand-in in scripts/nano_vllm/.
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/nano-site .whl/nano_vllm_fork-*.whl
  PYTHONPATH=/tmp/nano-site:${PYTHONPATH:-} python3 scripts/nano_vllm_suite.py .out/bin/kvdiff /tmp/nano-suite 2>&1 |
    tee "$out/nano.log" | grep -vE "^(\[debug\]|Generating)"
fi
if [ "$stage" = all ] || [ "$stage" = devicemap ]; then
  # HF transformers spread over every GPU and the CPU (device_map="auto") as the reference dump.
  python3 scripts/capture_device_map_test.py .out/bin/kvdiff 2>&1 | tee "$out/devicemap.log" | grep -vE "^(Writing|Loading)"
fi
if [ "$stage" = tp ]; then
  # Tensor-parallel engines captured whole: a real nano-vllm at tensor_parallel_size=2 (its
  # worker hooked through the engine's own call channel), torchrun ranks each opening the
  # capture; then the default model compared on GPU 0 alone and placed over GPUs 0 and 1: the
  # JSON reports must be byte for byte alike.
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/nano-site .whl/nano_vllm_fork-*.whl
  PYTHONPATH=/tmp/nano-site:${PYTHONPATH:-} python3 scripts/nano_vllm_tp_suite.py .out/bin/kvdiff /tmp/nano-tp 2>&1 |
    tee "$out/nano-tp.log" | grep -vE "^(\[debug\]|Generating)"
  python3 scripts/capture_torchrun_test.py .out/bin/kvdiff /tmp/torchrun 2>&1 | tee "$out/torchrun.log" | tail -n 8
  placed_tests
fi
if [ "$stage" = placed ]; then
  placed_tests
fi
if [ "$stage" = multi ]; then
  scripts/bench_multi_gpu.sh .out/bin/kvdiff 2>&1 | tee "$out/multi.log"
fi
