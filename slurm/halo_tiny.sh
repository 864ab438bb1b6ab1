#!/bin/bash
# The HALO chain at the tiny CPU sizes: every step of slurm/halo_{2b,5b,8b}.sh as the same chained jobs,
# on configs/tiny/slurm (tens of steps at 64-256 tokens), 200 offline Wikipedia extracts and CPU flags
# for the evaluation steps, one rank per job. It checks a cluster's Slurm set-up (partitions, accounts,
# GPU requests, dependencies, requeue, the venv inside the jobs) in minutes, before a real size.
#
#   export HALO_DATA=/scratch/$USER/data/tiny-wiki HALO_RUNS=/scratch/$USER/runs/halo-tiny HALO_TEACHER=/path/to/small/teacher
#   HALO_WAIT=1 bash slurm/halo_tiny.sh -p gpu -A myproj     # submit, wait, report the first failing step
#
# HALO_TEACHER: a small Qwen3/Llama folder or hub id with a tokenizer (data prep uses it), e.g. the bundled
# SmolLM2: python -c 'from halo_dist.teacher import smollm2_teacher_dir; print(smollm2_teacher_dir())'
# Every default below is a HALO_* variable of the README section "Slurm" and can be overridden.
#SBATCH --job-name=halo-tiny
#SBATCH --output=halo-tiny-%j.log
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@300
#SBATCH --requeue

# shellcheck disable=SC2034  # read by lib.sh
HALO_SIZE=tiny
HALO_STUDENT=tiny
HALO_CONFIG_DIR=configs/tiny/slurm
HALO_TEACHER_HINT=HuggingFaceTB/SmolLM2-135M
: "${HALO_GPUS_PER_NODE:=1}"       # one rank per node: torchrun --nproc_per_node 1
: "${HALO_CPUS_PER_NODE:=1}"
: "${HALO_PREP_CPUS:=1}"
: "${HALO_EXCLUSIVE:=0}"           # tiny jobs share a node
: "${HALO_PREP_SOURCE:=--wiki-offline}"
: "${HALO_DATA_TOKENS:=0}"         # every token of the documents read
: "${HALO_HELDOUT_FRACTION:=0.05}"
: "${HALO_PREP_ARGS:=--max-docs 200 --shard-tokens 50000 --no-progress}"
: "${HALO_SELECT_ARGS:=--evaluator proxy --device cpu --dtype fp32 --recall-items 2 --recall-length 96 --kl-rows 1 --kl-seq-len 64}"
: "${HALO_CALIBRATE_ARGS:=--seq-len 128 --rows 2 --batch-size 2 --grid none,500 --device cpu --dtype fp32}"
: "${HALO_NIAH_LENGTHS:=160}"
: "${HALO_NIAH_ARGS:=--depths 2 --samples 1 --batch-size 4 --device cpu --dtype fp32}"
: "${HALO_CSR_TASKS:=arc_easy}"
: "${HALO_CSR_ARGS:=--limit 4 --batch-size 8 --device cpu --dtype fp32}"

# The step jobs run a spool copy of this file: find lib.sh next to it, else through HALO_REPO / the submit dir.
_here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
for _lib in "$_here/lib.sh" "${HALO_REPO:-/nonexistent}/slurm/lib.sh" "${SLURM_SUBMIT_DIR:-/nonexistent}/slurm/lib.sh"; do
    [[ -f $_lib ]] && break
done
[[ -f $_lib ]] || { echo "error: slurm/lib.sh not found: set HALO_REPO=/path/to/halo_dist" >&2; exit 2; }
# shellcheck source=slurm/lib.sh
source "$_lib"
halo_pipeline_main "$(dirname "$_lib")" "$@"
