#!/bin/bash
# From-scratch architecture sweep (paper §6.3): every variant of configs/sweeps/grid.yaml trained
# for 40K steps x 128 x 4K tokens by launchers/pretrain.py, as one Slurm job array, then NIAH 4K -> 256K
# for every variant and one comparison table + plot.
#
#   export HALO_DATA=/scratch/$USER/data/fwe-gpt2 HALO_RUNS=/scratch/$USER/runs/sweep
#   HALO_DRY_RUN=1 bash slurm/sweep_scratch.sh                      # print everything, submit nothing
#   HALO_MAX_CONCURRENT=4 bash slurm/sweep_scratch.sh -p gpu -A proj   # the whole grid, 4 tasks at a time
#   HALO_VARIANTS=transformer,hypenet-lightning-hype bash slurm/sweep_scratch.sh
#
# Jobs: [data prep, if HALO_DATA is not complete] -> array task i trains variant i (of the HALO_VARIANTS
# subset, if given; variants already DONE are left out) -> eval job (afterany: the array) -> table + plot
# in $HALO_RUNS/sweep_niah.{md,png}. Each task resumes from its checkpoints and requeues itself after a
# preemption. Variant names: python slurm/sweep_variants.py list. Shared logic: slurm/lib.sh.
#SBATCH --job-name=halo-sweep
#SBATCH --output=halo-sweep-%j.log
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@300
#SBATCH --requeue

_here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
for _lib in "$_here/lib.sh" "${HALO_REPO:-/nonexistent}/slurm/lib.sh" "${SLURM_SUBMIT_DIR:-/nonexistent}/slurm/lib.sh"; do
    [[ -f $_lib ]] && break
done
[[ -f $_lib ]] || { echo "error: slurm/lib.sh not found: set HALO_REPO=/path/to/halo_dist" >&2; exit 2; }
# shellcheck source=slurm/lib.sh
source "$_lib"

: "${HALO_SWEEP_GRID:=configs/sweeps/grid.yaml}"
: "${HALO_PRETRAIN_LAUNCHER:=launchers/pretrain.py}"
: "${HALO_MAX_CONCURRENT:=4}"
: "${HALO_SWEEP_TOKENIZER:=openai-community/gpt2}"   # the paper's GPT-2 tokenizer (vocab padded to 50,304)
: "${HALO_SWEEP_HF_CONFIG:=sample-100BT}"           # sample-10BT holds only ~10B GPT-2 tokens
: "${HALO_SWEEP_DATA_TOKENS:=21B}"                  # 128 x 4096 x 40,000 = 20.97B
: "${HALO_SWEEP_MODEL_DIR:=final}"                  # what pretrain.py writes under <run_dir>: an HF model folder

halo_usage() {
    cat <<'EOF'
usage: [HALO_DRY_RUN=1] [HALO_VARIANTS=a,b] bash slurm/sweep_scratch.sh [sbatch flags: -N, -p, -A, -t, --gpus-per-node, --qos, ...]
required: HALO_DATA (GPT-2-tokenized data folder; prepared first if incomplete), HALO_RUNS (run folder, TensorBoard root)
variants: python slurm/sweep_variants.py list      README section "Slurm" lists every HALO_* variable.
EOF
}

sweep_variants() { "$HALO_PYTHON" "$HALO_REPO/slurm/sweep_variants.py" --grid "$HALO_SWEEP_GRID" "$@"; }

sweep_done_file() { echo "$HALO_RUNS/$1/$HALO_SWEEP_MODEL_DIR/DONE"; }

sweep_task_cmd() {  # sweep_task_cmd NAME BASE "OVERRIDES": the training command of one variant -> HALO_CMD
    local name=$1 base=$2
    local -a overrides=()
    [[ -n $3 ]] && read -r -a overrides <<< "$3"
    halo_split "${HALO_SWEEP_ARGS:-}"
    # the model exports (and checks the shards against) the tokenizer data prep used
    halo_torchrun_cmd "$HALO_PRETRAIN_LAUNCHER" --config "$base" "${overrides[@]}" \
        "pretrain.model.tokenizer=$HALO_SWEEP_TOKENIZER" "data.train=$HALO_DATA" "logging.run_dir=$HALO_RUNS/$name" \
        "${HALO_WORDS[@]}"
}

sweep_eval_body() {  # NIAH for every variant with a trained model, then the comparison table + plot
    local -a names
    IFS=, read -r -a names <<< "$HALO_SWEEP_ALL"
    local name model out
    halo_split "$HALO_NIAH_ARGS"
    for name in "${names[@]}"; do
        model=$HALO_RUNS/$name/$HALO_SWEEP_MODEL_DIR
        out=$HALO_RUNS/$name/niah
        if ((!HALO_PREVIEW)) && [[ ! -e $model/DONE ]]; then
            halo_log "$name: no finished model ($model/DONE missing): left out of the NIAH runs"
            continue
        fi
        if ((!HALO_PREVIEW)) && [[ -e $out/niah.json ]]; then
            halo_log "$name: $out/niah.json exists: skipped"
            continue
        fi
        halo_one_cmd "$HALO_CLI" eval-niah --model "$model" --lengths "$HALO_NIAH_LENGTHS" "$HALO_NIAH_OUT_FLAG" "$out" "${HALO_WORDS[@]}"
        halo_exec - "${HALO_CMD[@]}"
    done
    halo_exec - "$HALO_PYTHON" "$HALO_REPO/slurm/compare_sweep.py" --runs "$HALO_RUNS" --variants "$HALO_SWEEP_ALL" \
        --output "$HALO_RUNS/sweep_niah"
}

sweep_step() {  # inside a job: HALO_STEP = sweep_prep | sweep_task | sweep_eval
    halo_step_begin
    cd "$HALO_REPO" || exit 2
    case $HALO_STEP in
        sweep_prep)
            if halo_manifest_complete "$HALO_DATA"; then halo_log "skip: $HALO_DATA is complete"; exit 0; fi
            halo_prep_cmd "$HALO_DATA" "$HALO_SWEEP_TOKENIZER" "$HALO_SWEEP_DATA_TOKENS" "$HALO_SWEEP_HF_CONFIG"
            halo_exec - "${HALO_CMD[@]}"
            ;;
        sweep_task)
            local -a pending
            IFS=, read -r -a pending <<< "$HALO_SWEEP_PENDING"
            local i=${SLURM_ARRAY_TASK_ID:?sweep_task runs as a job array task (SLURM_ARRAY_TASK_ID unset)}
            ((i < ${#pending[@]})) || halo_die "array task $i has no variant: this array holds ${#pending[@]} (${HALO_SWEEP_PENDING})"
            local name=${pending[$i]}
            halo_log "array task $i -> variant $name"
            if [[ -e $(sweep_done_file "$name") ]]; then halo_log "skip $name: $(sweep_done_file "$name") exists"; exit 0; fi
            local base overrides
            base=$(sweep_variants base) || exit 2
            overrides=$(sweep_variants overrides "$name") || exit 2
            sweep_task_cmd "$name" "$base" "${overrides//$'\n'/ }"
            halo_exec "$(sweep_done_file "$name")" "${HALO_CMD[@]}"
            ;;
        sweep_eval) sweep_eval_body ;;
        *) halo_die "unknown sweep step '$HALO_STEP'" ;;
    esac
    halo_log "step $HALO_STEP finished $(date -Is)"
}

sweep_driver() {
    halo_inherit_driver_job
    halo_parse_args "$@"
    halo_require_env \
        "HALO_DATA:folder of the GPT-2-tokenized FineWeb-edu data (prepared by the first job if incomplete), e.g. export HALO_DATA=/scratch/\$USER/data/fwe-gpt2" \
        "HALO_RUNS:run folder (one sub-folder per variant; TensorBoard root), e.g. export HALO_RUNS=/scratch/\$USER/runs/sweep"
    HALO_DATA=$(halo_abs "$HALO_DATA"); HALO_RUNS=$(halo_abs "$HALO_RUNS")
    [[ $HALO_DATA != "$HALO_RUNS" ]] || halo_die "HALO_DATA and HALO_RUNS must be different folders"
    halo_posint HALO_NODES "$HALO_NODES"
    halo_posint HALO_GPUS_PER_NODE "$HALO_GPUS_PER_NODE"
    halo_posint HALO_MAX_CONCURRENT "$HALO_MAX_CONCURRENT"
    [[ -f $HALO_REPO/$HALO_SWEEP_GRID || -f $HALO_SWEEP_GRID ]] || halo_die "sweep grid $HALO_SWEEP_GRID not found"

    local -a all pending=()
    local out
    out=$(cd "$HALO_REPO" && sweep_variants select "${HALO_VARIANTS:-}" 2>&1) \
        || halo_die "${out#error: } (HALO_VARIANTS=${HALO_VARIANTS:-}); nothing was submitted"
    mapfile -t all <<< "$out"
    HALO_SWEEP_SELECTED=$(IFS=,; echo "${all[*]}")
    local name
    for name in "${all[@]}"; do
        if [[ -e $(sweep_done_file "$name") ]]; then halo_log "skip $name: already trained ($(sweep_done_file "$name"))"
        else pending+=("$name"); fi
    done
    if ! halo_is_dry && ((${#pending[@]})) && [[ ! -f $HALO_REPO/$HALO_PRETRAIN_LAUNCHER && ! -f $HALO_PRETRAIN_LAUNCHER ]]; then
        halo_die "$HALO_PRETRAIN_LAUNCHER not found in $HALO_REPO: the from-scratch launcher is needed to train the sweep"
    fi
    halo_check_slurm_tools

    local world=$((HALO_NODES * HALO_GPUS_PER_NODE)) base line
    base=$(cd "$HALO_REPO" && sweep_variants base) || exit 2
    local -A ovs=()
    out=$(cd "$HALO_REPO" && sweep_variants dump --among "${HALO_SWEEP_SELECTED}") || exit 2
    while IFS=$'\t' read -r name line; do ovs[$name]=$line; done <<< "$out"
    local -a checks=()
    for name in "${pending[@]}"; do
        checks+=("variant $name ($HALO_NODES node(s) x $HALO_GPUS_PER_NODE GPUs)|$world|$base|${ovs[$name]} ${HALO_SWEEP_ARGS:-}")
    done
    # shellcheck disable=SC2034  # read by halo_check_layouts
    HALO_LAYOUT_HINT="Change HALO_NODES / HALO_GPUS_PER_NODE or the batch layout (e.g. HALO_SWEEP_ARGS='data.micro_batch_size=2'). Check one variant by hand: python launchers/pretrain.py --check --world-size N --config <base> <its overrides>."
    if ((${#checks[@]})); then halo_check_layouts "${checks[@]}"; fi
    halo_refuse_duplicates

    HALO_SWEEP_ALL=$(IFS=,; echo "${all[*]}")
    HALO_SWEEP_PENDING=$(IFS=,; echo "${pending[*]}")
    export HALO_DATA HALO_RUNS HALO_NODES HALO_GPUS_PER_NODE HALO_REPO HALO_SWEEP_ALL HALO_SWEEP_PENDING HALO_SWEEP_GRID
    halo_log "sweep: ${#all[@]} variant(s), ${#pending[@]} to train; data $HALO_DATA; runs $HALO_RUNS (tensorboard --logdir $HALO_RUNS)"
    run_cmd mkdir -p "$HALO_RUNS/logs"

    local script=$HALO_REPO/slurm/sweep_scratch.sh dep="" i
    if ((${#pending[@]})); then
        if ! halo_manifest_complete "$HALO_DATA"; then
            halo_sbatch halo-sweep-prep sweep_prep cpu 1 "" "$HALO_RUNS/logs/sweep-prep-%j.log" "$script"
            dep="afterok:$HALO_JOB_ID"
            if halo_is_dry; then
                HALO_PREVIEW=1 HALO_STEP=sweep_prep SLURM_CPUS_PER_TASK="" \
                    halo_prep_cmd "$HALO_DATA" "$HALO_SWEEP_TOKENIZER" "$HALO_SWEEP_DATA_TOKENS" "$HALO_SWEEP_HF_CONFIG"
                HALO_PREVIEW=1 halo_exec - "${HALO_CMD[@]}"
            fi
        else
            halo_log "data: $HALO_DATA is complete"
        fi
        halo_sbatch halo-sweep sweep_task dist "$HALO_NODES" "$dep" "$HALO_RUNS/logs/sweep-%A_%a.log" "$script" \
            "--array=0-$((${#pending[@]} - 1))%$HALO_MAX_CONCURRENT"
        local array_id=$HALO_JOB_ID
        if halo_is_dry; then
            for i in "${!pending[@]}"; do
                printf '  [array task %d] %s\n' "$i" "${pending[$i]}"
                HALO_PREVIEW=1 HALO_STEP=sweep_task SLURM_NNODES=$HALO_NODES SLURM_JOB_ID="${array_id}_$i" \
                    SLURM_CPUS_PER_TASK="" sweep_task_cmd "${pending[$i]}" "$base" "${ovs[${pending[$i]}]}"
                HALO_PREVIEW=1 halo_exec - "${HALO_CMD[@]}"
            done
        fi
        dep="afterany:$array_id"
    fi
    halo_sbatch halo-sweep-eval sweep_eval gpu1 1 "$dep" "$HALO_RUNS/logs/sweep-eval-%j.log" "$script"
    if halo_is_dry; then
        HALO_PREVIEW=1 HALO_STEP=sweep_eval SLURM_CPUS_PER_TASK="" sweep_eval_body
        halo_log "dry run: nothing was submitted"
    fi
    return 0
}

halo_locate_repo "$(dirname "$_lib")"
if [[ -n ${HALO_STEP:-} ]]; then sweep_step; else sweep_driver "$@"; fi
