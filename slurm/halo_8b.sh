#!/bin/bash
# HALO pipeline, Qwen3-8B -> HypeNet-9B, on Slurm:
#   data prep -> stage 1 -> layer selection -> stage 2 -> stage 3 -> calibrate a -> export -> NIAH + CSR eval
#
#   export HALO_DATA=/scratch/$USER/data/qwen3-fwe-1b HALO_RUNS=/scratch/$USER/runs/halo-8b HALO_TEACHER=Qwen/Qwen3-8B
#   HALO_DRY_RUN=1 bash slurm/halo_8b.sh         # print every command, submit nothing
#   bash slurm/halo_8b.sh -p gpu -A myproj        # submit the chain (one job per step, afterok)
#   sbatch -p gpu -A myproj slurm/halo_8b.sh     # same, from a short driver job (its -p/-A/-N carry over)
#
# Re-running submits only the steps that are not DONE. Every HALO_* knob: README "Slurm"; logic: slurm/lib.sh.
# The #SBATCH lines below apply to the driver job and to every step job (the driver passes each step's
# nodes, GPUs, partition and time on the sbatch command line).
#SBATCH --job-name=halo-8b
#SBATCH --output=halo-8b-%j.log
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@300
#SBATCH --requeue

# shellcheck disable=SC2034  # read by lib.sh
HALO_SIZE=8b                              # names jobs and this script
HALO_STUDENT=9b                             # configs/stages/9b, export folder hypenet-9b
HALO_CONFIG_DIR=configs/stages/9b
HALO_TEACHER_HINT=Qwen/Qwen3-8B

# The step jobs run a spool copy of this file: find lib.sh next to it, else through HALO_REPO / the submit dir.
_here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
for _lib in "$_here/lib.sh" "${HALO_REPO:-/nonexistent}/slurm/lib.sh" "${SLURM_SUBMIT_DIR:-/nonexistent}/slurm/lib.sh"; do
    [[ -f $_lib ]] && break
done
[[ -f $_lib ]] || { echo "error: slurm/lib.sh not found: set HALO_REPO=/path/to/halo_dist" >&2; exit 2; }
# shellcheck source=slurm/lib.sh
source "$_lib"
halo_pipeline_main "$(dirname "$_lib")" "$@"
