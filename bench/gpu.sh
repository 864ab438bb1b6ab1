#!/usr/bin/env bash
# The GPU benchmarks whose figures BENCHMARKS.md reports, one suite per call (a lent GPU call may run 10 minutes):
#
#   bash bench/gpu.sh SUITE          on a GPU machine, from the repository root
#   bash bench/gpu.sh --list         the suites and what each writes
#   CPU_SMOKE=1 bash bench/gpu.sh SUITE   the same benchmarks at their tiny CPU shapes (a rehearsal)
#
# Suites (results under bench/results/, one file per figure, overwritten by each run; git keeps the history):
#   train     stage 2 of HypeNet-2B (Qwen3-1.7B shape, compiled layers and loss) with the same process's naive
#             baseline and a profile of steps 6-7, then stage 3 at 16K          -> stages_train.json, stages_train_s3.json
#   decode    the 512K decode step of HypeNet-2B and of the teacher shape in one process, alternating rounds
#             (two 512K caches: ~75 GB, an H200)                                -> decode_ratio_512k.json
#   opd       the whole OPD step at horizon 2048 (256 rollouts), then the rollouts alone at the shipped settings
#             (768 rows on an H200, 384 on an H100)                             -> opd_step.json, opd_rollouts.json
#   opd-512   the whole OPD step at horizon 2048 with 512 rollouts (an H200)    -> opd_step_512.json
#   opd-8k    OPD at horizon 8K, 64 rollouts                                    -> opd_h8k.json
#   opd-32k   OPD at horizon 32K, 16 rollouts, activation checkpointing         -> opd_h32k.json
#   pretrain  the 500M from-scratch models, compiled vs shipped loss, micro 8   -> pretrain.json
#   cuda      the tests marked cuda (Triton kernels, CUDA graphs; they skip on CPU); no result file
#   multigpu  stage-2 data-parallel scaling over the GPUs present               -> multigpu_dp.json
#   real      the real SmolLM2-135M conversion; several calls: PHASE=R0|R1|R2|R3 (bench/device_real.sh says what
#             each carries and does)                                             -> real_conversion*.json
#
# Carry: .whl (the wheels the GPU image lacks, see bench/xfer_real.sh) for every suite; .bench_data (made by
# `python bench/make_long_docs.py`) for train and multigpu. Packages, bytecode and Triton's cache live in /tmp/halo,
# which outlives the calls of one warm machine; the committed fla autotune results seed the cache.
set -uo pipefail
cd "$(dirname "$0")/.."
suite=${1:?"usage: bash bench/gpu.sh SUITE (--list: the suites)"}
if [ "$suite" = --list ] || [ "$suite" = --help ] || [ "$suite" = -h ]; then
  sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0
fi
case $suite in train|decode|opd|opd-512|opd-8k|opd-32k|pretrain|cuda|multigpu|real) ;; *)
  echo "error: unknown suite '$suite': train, decode, opd, opd-512, opd-8k, opd-32k, pretrain, cuda,"
  echo "multigpu or real (--list)"
  exit 2 ;;
esac
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SMOKE=${CPU_SMOKE:+--cpu-smoke}
R=bench/results
[ -z "$SMOKE" ] || { R=/tmp/gpu_sh_smoke; mkdir -p $R; }  # a rehearsal never overwrites a measured figure

setup() {  # packages, bytecode and the Triton cache, once per warm machine
  local H=/tmp/halo; mkdir -p $H
  unset PYTHONDONTWRITEBYTECODE  # the image sets it: every process would compile torch's bytecode again
  export PYTHONPYCACHEPREFIX=$H/pycache PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TRITON_CACHE_DIR=$H/triton
  export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HALO_CACHE=$PWD/.cache/halo_dist
  if [ -z "$SMOKE" ] && [ -d .whl ] && [ ! -f $H/site/.installed ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $H/site .whl/*.whl \
      && DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade \
        --target $H/site .whl/deepspeed-*.tar.gz \
      && touch $H/site/.installed
  fi
  export PYTHONPATH=$H/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
  [ -d $H/triton ] || tar -xzf bench/cache/triton_autotune_sm90.tgz -C $H 2>/dev/null || true
  command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
}

gpu_memory_mib() { nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1; }
gpu_count() { nvidia-smi -L 2>/dev/null | wc -l; }

step() {  # NAME LIMIT_S COMMAND...: one benchmark, its log in $OUT, its exit status and last lines printed
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: rc=$? ($((SECONDS)) s into the suite)"; tail -4 "$OUT/$name.log"
}

need_bench_data() {  # the stage benchmarks read real shards, in a rehearsal too
  [ -d .bench_data/long ] \
    || { echo "error: .bench_data/long is missing: run python bench/make_long_docs.py and carry .bench_data"; exit 2; }
}

setup
case $suite in
train)
  need_bench_data
  step stage2 330 python3 bench/bench_stages.py $SMOKE --data .bench_data/long --stages 2 --steps 1 7 1 \
    --naive-steps 6 --tag train --timeout 220 --extra logging.profile_at_step=6 logging.profile_steps=2
  step stage3 $((585 - SECONDS)) python3 bench/bench_stages.py $SMOKE --data .bench_data/long --no-naive \
    --stages 3 --steps 1 1 3 --tag train_s3 --timeout $((570 - SECONDS))
  ;;
decode)
  mem=$(gpu_memory_mib)
  [ -n "$SMOKE" ] || [ "${mem:-0}" -gt 100000 ] \
    || { echo "error: the 512K decode ratio holds two 512K caches (~75 GB) beside both models: it needs an H200"; exit 2; }
  step decode_ratio 560 python3 bench/decode_ratio.py $SMOKE --context 524288 --rounds 12 --steps 24 \
    --out $R/decode_ratio_512k.json
  ;;
opd)
  rows=$([ "$(gpu_memory_mib)" -gt 100000 ] 2>/dev/null && echo 768 || echo 384)
  step opd_step 300 python3 bench/bench_opd.py $SMOKE --horizons 2048 --rollouts 256 --continuous \
    --compile-rollouts --compile-layers --micro 8 --timed-steps 1 --out $R/opd_step.json
  step opd_rollouts $((585 - SECONDS)) python3 bench/bench_opd.py $SMOKE --horizons 2048 --rollouts "$rows" \
    --continuous --compile-rollouts --compile-layers --skip-train --timed-steps 1 --state-dtype float32 \
    --state-write-every 4 --out $R/opd_rollouts.json
  ;;
opd-512)
  step opd_step_512 580 python3 bench/bench_opd.py $SMOKE --horizons 2048 --rollouts 512 --continuous \
    --compile-rollouts --compile-layers --micro 8 --timed-steps 1 --out $R/opd_step_512.json
  ;;
opd-8k)
  step opd_h8k 580 python3 bench/bench_opd.py $SMOKE --horizons 8192 --rollouts 64 --continuous \
    --compile-rollouts --compile-layers --out $R/opd_h8k.json
  ;;
opd-32k)  # eager-step rollouts: a compiled warm-up at the timed horizon would double the rollout time
  step opd_h32k 580 python3 bench/bench_opd.py $SMOKE --horizons 32768 --rollouts 16 --continuous \
    --checkpointing --out $R/opd_h32k.json
  ;;
pretrain)
  [ -z "$SMOKE" ] || { echo "pretrain: bench/bench_pretrain.py --smoke is its CPU shape"; SMOKE=--smoke; }
  step pretrain 560 python3 bench/bench_pretrain.py $SMOKE --steps 30 --no-checkpointing \
    --runs compiled:8 shipped:8 --out $R/pretrain.json
  ;;
cuda)
  # only the files that hold cuda tests: the GPU image lacks some CPU-test dependencies (peft, lm-eval, ...)
  step cuda_tests 560 python3 -m pytest -q -p no:cacheprovider -m cuda $(grep -l "pytest.mark.cuda" tests/test_*.py)
  ;;
multigpu)
  need_bench_data
  n=$([ -n "$SMOKE" ] && echo 2 || gpu_count)
  [ "$n" -ge 2 ] || { echo "error: multigpu needs 2+ GPUs (found $n)"; exit 2; }
  step multigpu_dp 570 python3 bench/multigpu.py scaling $SMOKE --gpus 1 "$n" --steps 8 --timeout 260 \
    --data .bench_data/long
  ;;
real)
  exec bash bench/device_real.sh "${PHASE:?real: set PHASE=R0, R1, R2 or R3 (bench/device_real.sh)}"
  ;;
esac
