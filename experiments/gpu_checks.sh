#!/usr/bin/env bash
# One short pass of the GPU checks, sized for a lent single-GPU machine with no package registry
# (its image has jax, flax, optax, torch, pytest; not grain, ray or tensorboardX, so the training
# loop, the data pipeline and async RL are not run here).
#   1. the numerics tests of the kernels, the model, decode and the sampler on the GPU (the test
#      suite's own tolerances; conftest pins CPU unless JAX_PLATFORMS says otherwise; cpu stays
#      listed for the interpret-mode kernels' host callbacks). Tests that need 8 devices or grain
#      fail here by construction: test_kernel_runs_per_shard_on_a_mesh, test_near_greedy_drafting.
#   2. model_bench: bench.yaml forward + backward in bf16, vs the measured matmul peak
#   3. rl_decode --quick: absorbed vs expanded MLA decode, the engine's rollout tokens/s
# Results land in experiments/results/*_gpu.json and, when $OUT is set, are copied there.
#   bash experiments/gpu_checks.sh
set -u
cd "$(dirname "$0")/.."
# the kernels folder is installed as composer_jax.kernels (pyproject.toml); without pip, link it
[ -e composer_jax/kernels ] || ln -s ../kernels composer_jax/kernels
export PYTHONPATH=$PWD
PY=${PY:-python3}
nvidia-smi -L
$PY -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
T0=$SECONDS
JAX_PLATFORMS=cuda,cpu timeout 300 $PY -m pytest -q -p no:cacheprovider --no-header --tb=short -rf \
  tests/kernels/test_gmm.py tests/kernels/test_quant.py tests/kernels/test_moe_dispatch.py \
  tests/model/test_decode.py tests/model/test_chunked_loss.py tests/model/test_numerics.py \
  tests/model/test_attention.py tests/rl/test_sampler.py tests/rl/test_speculative.py \
  tests/rl/test_losses.py > /tmp/gpu_tests.txt 2>&1
grep -E "^FAILED|passed|failed" /tmp/gpu_tests.txt | tail -20
echo "tests: $((SECONDS - T0)) s"
T0=$SECONDS
timeout 120 $PY -m experiments.model_bench --batch 32 model.compute_dtype=bfloat16 2>&1 | tail -4
echo "model_bench: $((SECONDS - T0)) s"
T0=$SECONDS
timeout 150 $PY -m experiments.rl_decode --quick 2>&1 | tail -6
echo "rl_decode: $((SECONDS - T0)) s"
if [ -n "${OUT:-}" ]; then
  cp /tmp/gpu_tests.txt experiments/results/model_bench_gpu.json experiments/results/rl_decode_gpu.json "$OUT"/ 2>/dev/null
fi
exit 0
