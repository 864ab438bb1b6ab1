# shellcheck shell=bash
# slurm/lib.sh -- functions shared by slurm/halo_{2b,5b,8b}.sh and slurm/sweep_scratch.sh. Sourced, never run.
#
# Two modes of the same script:
#   driver  (HALO_STEP unset): `bash slurm/halo_8b.sh [sbatch flags]` (or `sbatch slurm/halo_8b.sh`)
#           validates the environment and the batch layout, then submits one sbatch job per step,
#           chained with --dependency=afterok:<previous job>. HALO_DRY_RUN=1 prints every command instead.
#   step    (HALO_STEP=<step>, set by the driver through --export): runs inside that job; skips a step
#           whose DONE marker exists; forwards USR1/TERM to the training processes; after a preemption
#           stop it requeues itself (scontrol requeue), and the launchers resume from the latest checkpoint.
#
# Every variable is documented in the README section "Slurm"; `HALO_*` names are the user interface.

set -euo pipefail

# ------------------------------------------------------------------------------------------------
# Flags of the commands the pipeline calls. Kept here, in one place, so a renamed flag is a one-line
# change. Values are split on whitespace (no spaces inside one value).
# ------------------------------------------------------------------------------------------------
: "${HALO_PYTHON:=python}"                  # interpreter with halo_dist installed (the repo's .venv)
: "${HALO_CLI:=halo-dist}"                  # the `halo-dist` console script
: "${HALO_TORCHRUN:=torchrun}"
: "${HALO_HF_DATASET:=HuggingFaceFW/fineweb-edu}"
: "${HALO_HF_CONFIG:=sample-10BT}"
: "${HALO_DATA_TOKENS:=1B}"                 # data prep --max-tokens
: "${HALO_HELDOUT_FRACTION:=0.001}"
: "${HALO_SELECT_ARGS:=--evaluator proxy --device cuda --dtype bf16}"
: "${HALO_CALIBRATE_ARGS:=--seq-len 16384 --rows 8 --device cuda --dtype bf16}"
: "${HALO_NIAH_LENGTHS:=4K,8K,16K,32K,64K,128K,256K}"
: "${HALO_NIAH_ARGS:=--depths 10 --samples 2 --batch-size 1 --device cuda --dtype bf16}"
# eval-lm's offline tasks (halo_dist/eval/olmo_sets.py SETS): the default CSR list, runnable without the hub
HALO_OFFLINE_TASKS=hellaswag,arc_easy,arc_challenge,piqa,winogrande
: "${HALO_CSR_TASKS:=$HALO_OFFLINE_TASKS}"
: "${HALO_CSR_ARGS:=--batch-size 8 --device cuda --dtype bf16}"
HALO_NIAH_OUT_FLAG=--output-dir             # eval-niah writes <dir>/niah.json, niah.md, niah_heatmap.png
HALO_STAGE1_FILE=rnn_layers.safetensors     # what stage 1 writes into <run_dir>/final (select-layers wants the file)
HALO_SCALING_KEY=attn_logits_scale_base     # config.json key that calibrate-scaling writes

# Slurm / launch knobs (see README). Node and GPU counts are checked against every stage's batch layout.
HALO_NODES_SET=${HALO_NODES:+1}             # the user chose HALO_NODES (wins over a driver job's own node count)
: "${HALO_NODES:=1}"
: "${HALO_GPUS_PER_NODE:=8}"
: "${HALO_CPUS_PER_NODE:=32}"               # cpus for the one torchrun task per node (8 ranks + loader workers)
: "${HALO_PREP_CPUS:=32}"                   # data prep --num-proc
: "${HALO_EVAL_GPUS:=1}"                    # select / calibrate / export / eval run one process on one GPU
: "${HALO_EXCLUSIVE:=1}"                    # training stages: --exclusive --mem=0
: "${HALO_SIGNAL_LEAD:=300}"                # --signal=B:USR1@<seconds before the time limit>
: "${HALO_RDZV_PORT:=}"                     # torchrun's rendezvous port; default: one per job (halo_rdzv_port)
: "${HALO_SHUTDOWN_TIMEOUT:=240}"           # torchrun waits this long for workers to checkpoint after a signal
: "${HALO_MAX_REQUEUES:=100}"
: "${HALO_DRY_RUN:=0}"
: "${HALO_WAIT:=0}"                         # 1: the driver stays until the chain ends and reports how it ended
: "${HALO_WAIT_POLL:=30}"                   # seconds between two looks at the chain's jobs

HALO_PREVIEW=0          # 1 while the driver prints, in a dry run, what each step job will run
HALO_JOB_ID=""          # id of the job the last halo_sbatch submitted
HALO_CHILD_PID=""       # the srun / command a step job supervises
HALO_GOT_SIGNAL=""      # the last signal the batch shell received
HALO_EXTRA_SBATCH=()    # sbatch flags passed through from the driver's command line and HALO_SBATCH_ARGS

# ------------------------------------------------------------------------------------------------
# Printing, running, validating
# ------------------------------------------------------------------------------------------------

halo_die() {  # one clear line on stderr, exit 2 (nothing has been submitted when the driver dies)
    printf 'error: %s\n' "$*" >&2
    exit 2
}

halo_log() { printf '# %s\n' "$*"; }

halo_is_dry() { [[ $HALO_DRY_RUN == 1 ]]; }

halo_quote() {  # the arguments as one copy-pasteable shell line (quotes only where needed)
    local out="" a
    for a in "$@"; do
        if [[ -z $a || $a =~ [^A-Za-z0-9_./:=,@%+^-] ]]; then
            a="'${a//\'/\'\\\'\'}'"
        fi
        out+="${out:+ }$a"
    done
    printf '%s' "$out"
}

run_cmd() {  # print a command; run it unless HALO_DRY_RUN=1
    printf '+ %s\n' "$(halo_quote "$@")"
    halo_is_dry && return 0
    "$@"
}

halo_abs() {  # absolute path (the file need not exist); hub ids and empty values pass through
    local p=$1
    [[ -z $p || $p == /* ]] && { printf '%s' "$p"; return; }
    printf '%s/%s' "$PWD" "${p#./}"
}

halo_posint() {  # halo_posint NAME VALUE: a positive integer or a clear error
    [[ $2 =~ ^[1-9][0-9]*$ ]] || halo_die "$1=$2 must be a positive integer"
}

halo_step_var() {  # halo_step_var STEP NAME [DEFAULT]: HALO_<STEP>_<NAME>, else HALO_<NAME>, else DEFAULT
    local specific="HALO_${1^^}_$2" generic="HALO_$2"
    if [[ -n ${!specific:-} ]]; then printf '%s' "${!specific}"
    elif [[ -n ${!generic:-} ]]; then printf '%s' "${!generic}"
    else printf '%s' "${3:-}"; fi
}

halo_locate_repo() {  # HALO_REPO: the checkout holding launchers/ (a Slurm job runs a spool copy of the script)
    local here=$1 cand
    for cand in "${HALO_REPO:-}" "$here/.." "${SLURM_SUBMIT_DIR:-}" "$PWD"; do
        if [[ -n $cand && -f $cand/slurm/lib.sh && -d $cand/launchers ]]; then
            HALO_REPO=$(cd "$cand" && pwd)
            export HALO_REPO
            return 0
        fi
    done
    halo_die "cannot find the halo_dist checkout: run from the repository root or set HALO_REPO=/path/to/halo_dist"
}

halo_setup_env() {  # step jobs: optional site setup, then the repo's venv unless one is active
    if [[ -n ${HALO_ENV_SETUP:-} ]]; then eval "$HALO_ENV_SETUP"; fi
    local venv=${HALO_VENV:-}
    [[ -z $venv && -z ${VIRTUAL_ENV:-} && -f $HALO_REPO/.venv/bin/activate ]] && venv=$HALO_REPO/.venv
    if [[ -n $venv ]]; then
        # shellcheck disable=SC1091
        source "$venv/bin/activate"
    fi
    # torchrun forwards SIGUSR1 (not only TERM/INT/HUP/QUIT) to its workers and gives them time to save.
    export TORCHELASTIC_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1
    export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=$HALO_SHUTDOWN_TIMEOUT
}

# ------------------------------------------------------------------------------------------------
# Driver: command line, environment, layout checks, submission
# ------------------------------------------------------------------------------------------------

halo_parse_args() {  # sbatch-style flags: nodes/GPUs/partition/account/time map to HALO_*; others pass through
    local a v
    while (($#)); do
        a=$1; shift
        case $a in
            -h|--help) halo_usage; exit 0 ;;
            --nodes=*|--partition=*|--account=*|--time=*|--gpus-per-node=*|--qos=*) v=${a#*=}; a=${a%%=*} ;;
            -N|--nodes|-p|--partition|-A|--account|-t|--time|--gpus-per-node|-q|--qos)
                (($#)) || halo_die "$a needs a value"
                v=$1; shift ;;
            -N*|-p*|-A*|-t*|-q*) v=${a:2}; a=${a:0:2} ;;
            *) HALO_EXTRA_SBATCH+=("$a"); continue ;;
        esac
        # shellcheck disable=SC2034  # HALO_TIME is read indirectly (halo_step_var)
        case $a in
            -N|--nodes) HALO_NODES=$v ;;
            -p|--partition) HALO_PARTITION=$v ;;
            -A|--account) HALO_ACCOUNT=$v ;;
            -t|--time) HALO_TIME=$v ;;   # read through halo_step_var
            -q|--qos) HALO_QOS=$v ;;
            --gpus-per-node) HALO_GPUS_PER_NODE=${v##*:} ;;   # "h200:8" -> 8
        esac
    done
    if [[ -n ${HALO_SBATCH_ARGS:-} ]]; then
        local -a extra
        read -r -a extra <<< "$HALO_SBATCH_ARGS"
        HALO_EXTRA_SBATCH+=("${extra[@]}")
    fi
}

halo_inherit_driver_job() {
    # `sbatch slurm/halo_8b.sh`: this driver runs inside a small job. Take its partition/account/node
    # count as defaults for the step jobs, then drop the SLURM_* variables so the step jobs, which
    # inherit this environment, do not mistake them for their own.
    [[ -n ${SLURM_JOB_ID:-} ]] || return 0
    : "${HALO_PARTITION:=${SLURM_JOB_PARTITION:-}}"
    : "${HALO_ACCOUNT:=${SLURM_JOB_ACCOUNT:-}}"
    [[ -n $HALO_NODES_SET ]] || HALO_NODES=${SLURM_JOB_NUM_NODES:-$HALO_NODES}
    local g=${SLURM_GPUS_PER_NODE:-}
    [[ ${g##*:} =~ ^[1-9][0-9]*$ ]] && HALO_GPUS_PER_NODE=${g##*:}
    local v
    for v in $(compgen -v SLURM_); do
        [[ $v == SLURM_CONF ]] || unset "$v"
    done
}

halo_require_env() {  # halo_require_env "VAR:what to set" ...: every missing one reported, then exit 2
    local spec var missing=()
    for spec in "$@"; do
        var=${spec%%:*}
        [[ -n ${!var:-} ]] || missing+=("  $var: ${spec#*:}")
    done
    if ((${#missing[@]})); then
        printf 'error: required environment is not set (nothing was submitted):\n' >&2
        printf '%s\n' "${missing[@]}" >&2
        exit 2
    fi
}

halo_check_slurm_tools() {
    halo_is_dry && return 0
    command -v sbatch >/dev/null || halo_die "sbatch not found: run on a Slurm login node (or HALO_DRY_RUN=1 to print the commands)"
}

halo_check_layouts() {
    # halo_check_layouts "LABEL|WORLD|CONFIG|override ..." ...: run the config dry-run for every stage
    # (in parallel: each is a Python start-up) and stop on the first layout that does not fit.
    if [[ ${HALO_CONFIG_CHECK:-} == none ]]; then
        halo_log "WARNING: HALO_CONFIG_CHECK=none: batch layouts not checked"
        return 0
    fi
    local -a checker
    read -r -a checker <<< "${HALO_CONFIG_CHECK:-$HALO_PYTHON -m halo_dist.config}"
    local tmp spec label world cfg rest i=0 failed=0
    tmp=$(mktemp -d)
    local -a pids=() labels=() worlds=()
    for spec in "$@"; do
        IFS='|' read -r label world cfg rest <<< "$spec"
        local -a ov=()
        [[ -n ${rest:-} ]] && read -r -a ov <<< "$rest"
        ( cd "$HALO_REPO" && "${checker[@]}" --config "$cfg" "${ov[@]}" --world-size "$world" ) \
            >"$tmp/$i.out" 2>&1 &
        pids+=($!); labels+=("$label"); worlds+=("$world")
        i=$((i + 1))
    done
    for i in "${!pids[@]}"; do
        if ! wait "${pids[$i]}"; then
            failed=$((failed + 1))
            ((failed > 3)) && continue   # the same mistake usually breaks every check: show three
            printf 'error: %s does not fit %s GPU rank(s):\n' "${labels[$i]}" "${worlds[$i]}" >&2
            grep -v '^usage:\|^ \{10,\}' "$tmp/$i.out" | sed 's/^/  /' >&2 || true
        fi
    done
    ((failed > 3)) && printf '(%d more checks failed)\n' $((failed - 3)) >&2
    if ((!failed)); then   # say where data.fit_micro_batch changed a stage's micro batch
        for i in "${!labels[@]}"; do
            sed -n 's/^#   data.fit_micro_batch: /'"${labels[$i]}"': /p' "$tmp/$i.out" | while IFS= read -r line; do
                halo_log "$line"
            done
        done
    fi
    rm -rf "$tmp"
    if ((failed)); then
        printf '%s\n' "${HALO_LAYOUT_HINT:-Change the node count or the batch layout.}" "Nothing was submitted." >&2
        exit 2
    fi
    halo_log "batch layouts fit: ${labels[*]}"
}

halo_refuse_duplicates() {  # a second chain writing the same HALO_RUNS would corrupt its checkpoints
    halo_is_dry && return 0
    [[ ${HALO_ALLOW_DUPLICATE:-0} == 1 ]] && return 0
    command -v squeue >/dev/null || return 0
    local line
    line=$(squeue -h --me -o '%i|%j|%k' 2>/dev/null | awk -F'|' -v c="halo:$HALO_RUNS" '$3 == c' | head -n 3 || true)
    [[ -z $line ]] || halo_die "jobs for $HALO_RUNS are already queued or running (${line//$'\n'/; }): wait or scancel them, or set HALO_ALLOW_DUPLICATE=1"
}

halo_resources() {  # halo_resources KIND NODES -> sbatch resource flags in HALO_RES
    local kind=$1 nodes=$2
    HALO_RES=()
    case $kind in
        cpu)
            HALO_RES+=(--nodes=1 --ntasks=1 "--cpus-per-task=$HALO_PREP_CPUS")
            [[ -n ${HALO_CPU_PARTITION:-${HALO_PARTITION:-}} ]] && HALO_RES+=("--partition=${HALO_CPU_PARTITION:-$HALO_PARTITION}")
            ;;
        gpu1)
            HALO_RES+=(--nodes=1 --ntasks=1 "--gpus-per-node=$HALO_EVAL_GPUS" "--cpus-per-task=$HALO_CPUS_PER_NODE")
            [[ -n ${HALO_PARTITION:-} ]] && HALO_RES+=("--partition=$HALO_PARTITION")
            ;;
        dist)
            HALO_RES+=("--nodes=$nodes" --ntasks-per-node=1 "--gpus-per-node=$HALO_GPUS_PER_NODE" "--cpus-per-task=$HALO_CPUS_PER_NODE")
            [[ $HALO_EXCLUSIVE == 1 ]] && HALO_RES+=(--exclusive --mem=0)
            [[ -n ${HALO_PARTITION:-} ]] && HALO_RES+=("--partition=$HALO_PARTITION")
            ;;
    esac
    [[ -n ${HALO_ACCOUNT:-} ]] && HALO_RES+=("--account=$HALO_ACCOUNT")
    [[ -n ${HALO_QOS:-} ]] && HALO_RES+=("--qos=$HALO_QOS")
    return 0
}

halo_sbatch() {
    # halo_sbatch NAME STEP KIND NODES DEPENDENCY LOG SCRIPT [extra sbatch flags...]: submit one job;
    # its id lands in HALO_JOB_ID ("dry-<step>" in a dry run). The job runs SCRIPT with HALO_STEP=STEP.
    local name=$1 step=$2 kind=$3 nodes=$4 dep=$5 log=$6 script=$7
    shift 7
    halo_resources "$kind" "$nodes"
    local time
    time=$(halo_step_var "$step" TIME)
    local -a cmd=(sbatch --parsable "--job-name=$name" "--output=$log" --open-mode=append
        "--chdir=$HALO_REPO" "--export=ALL,HALO_STEP=$step" "--comment=halo:$HALO_RUNS"
        --requeue "--signal=B:USR1@$HALO_SIGNAL_LEAD" "${HALO_RES[@]}")
    [[ -n $time ]] && cmd+=("--time=$time")
    [[ -n $dep ]] && cmd+=("--dependency=$dep" --kill-on-invalid-dep=yes)
    cmd+=("$@" "${HALO_EXTRA_SBATCH[@]}" "$script")
    if halo_is_dry; then
        run_cmd "${cmd[@]}"
        HALO_JOB_ID="dry-$step"
        return 0
    fi
    printf '+ %s\n' "$(halo_quote "${cmd[@]}")"
    local out
    out=$("${cmd[@]}") || halo_die "sbatch failed for step $step (jobs submitted so far stay queued; scancel them or re-run: finished steps are skipped)"
    HALO_JOB_ID=${out%%;*}
    [[ $HALO_JOB_ID =~ ^[0-9]+$ ]] || halo_die "sbatch printed '$out' for step $step, expected a job id"
    halo_log "submitted $step: job $HALO_JOB_ID"
}

halo_job_field() {  # halo_job_field LINE KEY: the value of KEY=... in a `scontrol show job -o` line
    local re="(^| )$2=([^ ]*)"
    [[ $1 =~ $re ]] && printf '%s' "${BASH_REMATCH[2]}"
    return 0
}

halo_wait_chain() {
    # halo_wait_chain STEP:JOB ...: HALO_WAIT=1. Wait until every job of the chain completed and its step
    # is done (exit 0), or name the first step that ended otherwise, with its state, exit code, log and
    # last error lines, and the steps that will not run (exit 1). A requeued job is still waiting.
    halo_posint HALO_WAIT_POLL "$HALO_WAIT_POLL"
    local spec step id line state seen="" now
    halo_log "HALO_WAIT=1: waiting for the chain (a look every ${HALO_WAIT_POLL}s)"
    while :; do
        local bad="" active="" i=0 idx=0
        for spec in "$@"; do
            step=${spec%%:*}; id=${spec#*:}
            line=$(scontrol show job -o "$id" 2>/dev/null | head -n 1) || line=""
            state=$(halo_job_field "$line" JobState)
            case $state in
                COMPLETED)
                    halo_step_is_done "$step" || { bad=$spec; idx=$i; break; } ;;
                "")  # the record is gone (MinJobAge): the step's marker decides
                    halo_step_is_done "$step" || { bad=$spec; idx=$i; break; } ;;
                PENDING|CONFIGURING|RUNNING|COMPLETING|REQUEUED|REQUEUE_HOLD|REQUEUE_FED|RESIZING|SUSPENDED|SIGNALING|STAGE_OUT|POWER_UP_NODE)
                    active="$step (job $id) $state, restart $(halo_job_field "$line" Restarts)"
                    break ;;
                *) bad=$spec; idx=$i; break ;;
            esac
            i=$((i + 1))
        done
        if [[ -n $bad ]]; then
            step=${bad%%:*}; id=${bad#*:}
            local log=$RUNS/logs/$step-$id.log what
            if [[ -z $state ]]; then what="is no longer known to Slurm"
            else what="ended $state (exit code $(halo_job_field "$line" ExitCode), reason $(halo_job_field "$line" Reason))"; fi
            printf 'error: step %s (job %s) %s without finishing: %s missing; log: %s\n' \
                "$step" "$id" "$what" "$(halo_step_done_file "$step")" "$log" >&2
            if [[ -f $log ]]; then grep -a '^error:' "$log" | tail -n 3 | sed 's/^/  | /' >&2 || true; fi
            local -a rest=("${@:idx+2}")
            if ((${#rest[@]})); then
                printf 'not run: %s (their afterok dependency on job %s can no longer be met; Slurm cancels them)\n' \
                    "$(for spec in "${rest[@]}"; do printf '%s ' "${spec%%:*}"; done | sed 's/ $//')" "$id" >&2
            fi
            return 1
        fi
        if [[ -z $active ]]; then
            halo_log "chain finished: every step done (outputs under $RUNS)"
            return 0
        fi
        if [[ $active != "$seen" ]]; then
            now=$(date +%H:%M:%S)
            halo_log "$now $active"
            seen=$active
        fi
        sleep "$HALO_WAIT_POLL"
    done
}

# ------------------------------------------------------------------------------------------------
# Step jobs: launching, signal forwarding, requeue
# ------------------------------------------------------------------------------------------------

halo_head_node() {  # first host of the allocation: the torchrun rendezvous endpoint
    if ((HALO_PREVIEW)); then printf '<head>'; return; fi
    local -a hosts
    mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    ((${#hosts[@]})) || halo_die "scontrol show hostnames '$SLURM_JOB_NODELIST' printed no host"
    printf '%s' "${hosts[0]}"
}

halo_rdzv_port() {
    # HALO_RDZV_PORT, else a port derived from the job id (15000-29999, below Linux's ephemeral range):
    # two jobs sharing a node (array tasks, HALO_EXCLUSIVE=0) must not meet in one rendezvous store
    if [[ -n $HALO_RDZV_PORT ]]; then printf '%s' "$HALO_RDZV_PORT"
    elif [[ ${SLURM_JOB_ID:-} =~ ^[0-9]+$ ]]; then printf '%s' $((15000 + SLURM_JOB_ID % 15000))
    else printf '<15000 + job id %% 15000>'; fi
}

halo_torchrun_cmd() {  # halo_torchrun_cmd SCRIPT ARGS...: srun -> one torchrun per node -> GPUS ranks each
    local nnodes=${SLURM_NNODES:-1} head
    head=$(halo_head_node) || exit 2
    HALO_CMD=(srun "--nodes=$nnodes" "--ntasks=$nnodes" --ntasks-per-node=1 --kill-on-bad-exit=1 --cpu-bind=none)
    [[ -n ${SLURM_CPUS_PER_TASK:-} ]] && HALO_CMD+=("--cpus-per-task=$SLURM_CPUS_PER_TASK")
    HALO_CMD+=("$HALO_TORCHRUN" --nnodes "$nnodes" --nproc_per_node "$HALO_GPUS_PER_NODE"
        --rdzv_backend c10d --rdzv_endpoint "$head:$(halo_rdzv_port)" --rdzv_id "${SLURM_JOB_ID:-0}"
        --max_restarts 0 "$@")
}

halo_one_cmd() {  # halo_one_cmd CMD...: one task on the first node
    HALO_CMD=(srun --nodes=1 --ntasks=1 --kill-on-bad-exit=1)
    [[ -n ${SLURM_CPUS_PER_TASK:-} ]] && HALO_CMD+=("--cpus-per-task=$SLURM_CPUS_PER_TASK")
    HALO_CMD+=("$@")
}

halo_forward() {
    # Trap handler: remember the signal and pass it on to the supervised srun, which forwards it to its
    # tasks (torchrun, which forwards it to the ranks: TORCHELASTIC_SIGNALS_TO_HANDLE includes SIGUSR1).
    # Sent as USR1 whatever arrived: srun answers TERM, HUP and QUIT by sending SIGKILL to its tasks,
    # which would kill the ranks before they save; USR1 and USR2 it forwards unchanged. The trainers
    # treat USR1 and TERM alike (checkpoint at the next step, exit 0). HALO_FORWARD_SIGNAL=same forwards
    # the received signal unchanged, HALO_FORWARD_SIGNAL=<name> sends that one.
    HALO_GOT_SIGNAL=$1
    local sig=${HALO_FORWARD_SIGNAL:-USR1}
    [[ $sig == same ]] && sig=$1
    printf '# received SIG%s: forwarding SIG%s to pid %s\n' "$1" "$sig" "${HALO_CHILD_PID:-none}"
    [[ -n $HALO_CHILD_PID ]] && kill -s "$sig" "$HALO_CHILD_PID" 2>/dev/null
    return 0
}

halo_install_traps() {
    trap 'halo_forward USR1' USR1
    trap 'halo_forward TERM' TERM
}

halo_requeue() {  # requeue this job (same id, same script, same environment) and end this run
    local restarts=${SLURM_RESTART_COUNT:-0}
    if ((restarts >= HALO_MAX_REQUEUES)); then
        halo_die "step $HALO_STEP stopped without finishing after $restarts requeues (HALO_MAX_REQUEUES): giving up"
    fi
    halo_log "step $HALO_STEP is not finished (signal: ${HALO_GOT_SIGNAL:-none}); requeueing job $SLURM_JOB_ID (restart $((restarts + 1)))"
    scontrol requeue "$SLURM_JOB_ID" || halo_log "scontrol requeue failed (Slurm may already requeue a preempted job)"
    exit 0
}

halo_exec() {
    # halo_exec DONE_FILE CMD...: run CMD in the background under the USR1/TERM traps. DONE_FILE
    # ("-": none) is the marker that CMD writes when it finished its work. After CMD ends: finished ->
    # return 0; a signal arrived, or a trainer exited 0 without its marker (it checkpointed and stopped)
    # -> requeue; any other failure -> exit with CMD's status, so afterok dependents never start.
    local done_file=$1
    shift
    if ((HALO_PREVIEW)); then
        printf '    + %s\n' "$(halo_quote "$@")"
        return 0
    fi
    printf '+ %s\n' "$(halo_quote "$@")"
    halo_is_dry && return 0
    [[ -z $HALO_GOT_SIGNAL ]] || halo_requeue   # told to stop before this command started
    "$@" &
    HALO_CHILD_PID=$!
    local rc
    while :; do
        rc=0
        wait "$HALO_CHILD_PID" || rc=$?
        # wait returns >128 when a trapped signal interrupts it; the child may still be running (or a zombie)
        if ((rc > 128)) && kill -0 "$HALO_CHILD_PID" 2>/dev/null; then continue; fi
        break
    done
    HALO_CHILD_PID=""
    if [[ $done_file != - && -e $done_file ]]; then return 0; fi
    if [[ -n $HALO_GOT_SIGNAL ]]; then halo_requeue; fi
    if ((rc == 0)) && [[ $done_file == - ]]; then return 0; fi
    if ((rc == 0)); then halo_requeue; fi
    printf 'error: step %s failed: exit status %s of: %s\n' "$HALO_STEP" "$rc" "$(halo_quote "$@")" >&2
    exit "$rc"
}

halo_mark_done() {  # halo_mark_done DIR: the DONE marker of a non-training step
    ((HALO_PREVIEW)) && return 0
    run_cmd mkdir -p "$1"
    halo_is_dry || printf '{"step": "%s", "job": "%s", "time": "%s"}\n' "$HALO_STEP" "${SLURM_JOB_ID:-}" "$(date -Is)" > "$1/DONE"
}

halo_step_begin() {  # common start of every step job
    halo_setup_env
    halo_install_traps
    halo_log "step $HALO_STEP: job ${SLURM_JOB_ID:-?} (restart ${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NODELIST:-$(hostname)}, $(date -Is)"
}

halo_manifest_complete() {  # halo_manifest_complete DIR: data prep finished there
    [[ -f $1/manifest.json ]] || return 1
    "$HALO_PYTHON" -c 'import json,sys; sys.exit(0 if json.load(open(sys.argv[1])).get("complete") else 1)' "$1/manifest.json" 2>/dev/null
}

halo_prep_cmd() {  # halo_prep_cmd OUT TOKENIZER TOKENS HF_CONFIG: the data prep command (resumes on re-run)
    local procs=${SLURM_CPUS_PER_TASK:-$HALO_PREP_CPUS}
    local -a source=(--hf-dataset "$HALO_HF_DATASET" --hf-config "$4")
    # another corpus: local files (--input 'corpus/*.jsonl.gz', the glob expanded by data prep) or --wiki-offline
    [[ -n ${HALO_PREP_SOURCE:-} ]] && read -r -a source <<< "$HALO_PREP_SOURCE"
    halo_split "${HALO_PREP_ARGS:-}"
    halo_one_cmd "$HALO_PYTHON" -m data_prep.tokenize "${source[@]}" \
        --tokenizer "$2" --out "$1" --max-tokens "$3" --heldout-fraction "$HALO_HELDOUT_FRACTION" --num-proc "$procs" \
        "${HALO_WORDS[@]}"
}

halo_split() {  # halo_split "a b c" -> HALO_WORDS=(a b c)
    HALO_WORDS=()
    [[ -n ${1:-} ]] && read -r -a HALO_WORDS <<< "$1"
    return 0
}

# ------------------------------------------------------------------------------------------------
# The HALO pipeline (slurm/halo_<size>.sh): data prep -> stage 1 -> select -> stage 2 -> stage 3 ->
# calibrate a -> export -> eval (NIAH + CSR)
# ------------------------------------------------------------------------------------------------

HALO_STEPS=(prep stage1 select stage2 stage3 calibrate export eval)

halo_usage() {
    cat <<EOF
usage: [HALO_DRY_RUN=1] bash slurm/halo_${HALO_SIZE:-8b}.sh [sbatch flags: -N/--nodes, -p, -A, -t, --gpus-per-node, --qos, ...]
       (or: sbatch [flags] slurm/halo_${HALO_SIZE:-8b}.sh)
required: HALO_DATA (tokenized data folder), HALO_RUNS (run folder, TensorBoard root), HALO_TEACHER (hub id or folder)
see the README section "Slurm" for every HALO_* variable.
EOF
}

halo_pipeline_paths() {  # derived paths, identical in the driver and in every step job
    RUNS=$HALO_RUNS
    DATA=$HALO_DATA
    DATA_LONG=${HALO_DATA_LONG:-$HALO_DATA}
    MODEL_OUT=$RUNS/export/hypenet-$HALO_STUDENT
    CFG=$HALO_CONFIG_DIR
}

halo_step_kind() {
    case $1 in
        prep) echo cpu ;;
        stage1|stage2|stage3) echo dist ;;
        *) echo gpu1 ;;
    esac
}

halo_step_nodes() {  # nodes of a step's job
    case $1 in
        stage1|stage2|stage3) halo_step_var "$1" NODES "$HALO_NODES" ;;
        *) echo 1 ;;
    esac
}

halo_step_done_file() {  # the marker whose existence means the step finished
    case $1 in
        prep) echo "$DATA/manifest.json" ;;   # plus "complete": true, see halo_step_is_done
        stage1|stage2|stage3) echo "$RUNS/$1/final/DONE" ;;
        *) echo "$RUNS/$1/DONE" ;;
    esac
}

halo_step_is_done() {
    case $1 in
        prep) halo_manifest_complete "$DATA" ;;
        select) [[ -n ${HALO_ATTN_LAYERS:-} || -e $(halo_step_done_file select) ]] ;;
        *) [[ -e $(halo_step_done_file "$1") ]] ;;
    esac
}

halo_attn_layers() {  # stage 2/3: HALO_ATTN_LAYERS, else the selection step's list
    if [[ -n ${HALO_ATTN_LAYERS:-} ]]; then printf '%s' "$HALO_ATTN_LAYERS"; return; fi
    local f=$RUNS/select/selection.json
    if [[ -f $f ]]; then
        "$HALO_PYTHON" -c 'import json,sys; print(",".join(str(int(i)) for i in json.load(open(sys.argv[1]))["attn_layers"]))' "$f" \
            || halo_die "cannot read attn_layers from $f"
        return
    fi
    if ((HALO_PREVIEW)) || halo_is_dry; then printf '<attn_layers of %s>' "$f"; return; fi
    halo_die "$f is missing: the select step has not finished (or set HALO_ATTN_LAYERS=2,3,6,...)"
}

halo_stage_args() {  # halo_stage_args N: the launcher arguments of stage N -> HALO_ARGS
    local n=$1 layers
    HALO_ARGS=(--config "$CFG/stage$n.yaml" "model.teacher=$HALO_TEACHER" "logging.run_dir=$RUNS/stage$n")
    case $n in
        1) HALO_ARGS+=("data.train=$DATA") ;;
        2) layers=$(halo_attn_layers) || exit 2
           HALO_ARGS+=("data.train=$DATA" "model.stage1_weights=$RUNS/stage1/final" "model.attn_layers=$layers") ;;
        3) layers=$(halo_attn_layers) || exit 2
           HALO_ARGS+=("data.train=$DATA_LONG" "model.student_init=$RUNS/stage2/final" "model.attn_layers=$layers") ;;
    esac
    local var="HALO_STAGE${n}_ARGS"
    halo_split "${!var:-}"
    HALO_ARGS+=("${HALO_WORDS[@]}")
}

halo_copy_scaling_cmd() {  # carry calibrate's a from SRC/config.json into DST/config.json (atomic rename)
    HALO_CMD=("$HALO_PYTHON" -c 'import json,os,sys; k,s,d=sys.argv[1:]; c=json.load(open(d+"/config.json")); c[k]=json.load(open(s+"/config.json"))[k]; open(d+"/.config.tmp","w").write(json.dumps(c,indent=2)); os.replace(d+"/.config.tmp",d+"/config.json"); print(k,"=",c[k],"->",d)' \
        "$HALO_SCALING_KEY" "$1" "$2")
}

halo_pipeline_step_body() {  # what the job of step $1 runs (printed instead in a dry-run preview)
    local step=$1
    case $step in
        prep)
            halo_prep_cmd "$DATA" "$HALO_TEACHER" "$HALO_DATA_TOKENS" "$HALO_HF_CONFIG"
            halo_exec - "${HALO_CMD[@]}"
            ((HALO_PREVIEW)) || halo_is_dry || halo_manifest_complete "$DATA" \
                || halo_die "data prep ended but $DATA/manifest.json is not complete"
            ;;
        stage1|stage2|stage3)
            halo_stage_args "${step#stage}"
            halo_torchrun_cmd "launchers/$step.py" "${HALO_ARGS[@]}"
            halo_exec "$RUNS/$step/final/DONE" "${HALO_CMD[@]}"
            ;;
        select)
            halo_split "$HALO_SELECT_ARGS"
            halo_one_cmd "$HALO_CLI" select-layers --teacher "$HALO_TEACHER" \
                --stage1-weights "$RUNS/stage1/final/$HALO_STAGE1_FILE" --heldout "$DATA/manifest.json" \
                --output "$RUNS/select/selection.json" --results-out "$RUNS/select/results.json" --resume "${HALO_WORDS[@]}"
            halo_exec - "${HALO_CMD[@]}"
            halo_mark_done "$RUNS/select"
            ;;
        calibrate)
            halo_split "$HALO_CALIBRATE_ARGS"
            halo_one_cmd "$HALO_CLI" calibrate-scaling --model "$RUNS/stage3/final" --data "$DATA_LONG/manifest.json" \
                --output "$RUNS/calibrate/scaling.json" "${HALO_WORDS[@]}"
            halo_exec - "${HALO_CMD[@]}"
            halo_mark_done "$RUNS/calibrate"
            ;;
        export)
            # --overwrite: a re-run of this step replaces its own earlier export (nothing else)
            halo_one_cmd "$HALO_CLI" export --checkpoint "$RUNS/stage3/checkpoints" --output "$MODEL_OUT" --overwrite
            halo_exec - "${HALO_CMD[@]}"
            halo_copy_scaling_cmd "$RUNS/stage3/final" "$MODEL_OUT"
            halo_exec - "${HALO_CMD[@]}"
            halo_mark_done "$RUNS/export"
            ;;
        eval)
            halo_split "$HALO_NIAH_ARGS"
            halo_one_cmd "$HALO_CLI" eval-niah --model "$MODEL_OUT" --lengths "$HALO_NIAH_LENGTHS" \
                "$HALO_NIAH_OUT_FLAG" "$RUNS/eval/niah" "${HALO_WORDS[@]}"
            if ((HALO_PREVIEW)) || [[ ! -e $RUNS/eval/niah/niah.json ]]; then halo_exec - "${HALO_CMD[@]}"; fi
            halo_split "$HALO_CSR_ARGS"
            halo_one_cmd "$HALO_CLI" eval-lm --model "$MODEL_OUT" --tasks "$HALO_CSR_TASKS" \
                --output "$RUNS/eval/csr.json" "${HALO_WORDS[@]}"
            if ((HALO_PREVIEW)) || [[ ! -e $RUNS/eval/csr.json ]]; then halo_exec - "${HALO_CMD[@]}"; fi
            halo_mark_done "$RUNS/eval"
            ;;
        *) halo_die "unknown step '$step' (steps: ${HALO_STEPS[*]})" ;;
    esac
}

halo_check_teacher_depth() {
    # A teacher of another depth than the configs (e.g. Qwen3-1.7B with halo_5b.sh) fails here, not in the
    # stage-1 job after data prep. Offline: a teacher folder, or a hub id already in the HF cache. Depth
    # only (Qwen3-4B and -8B both have 36 layers). Best effort: no verdict without halo_dist in HALO_PYTHON.
    [[ ${HALO_CONFIG_CHECK:-} == none ]] && return 0
    local problem
    if ! problem=$(cd "$HALO_REPO" && "$HALO_PYTHON" -W ignore -c '
import sys
from halo_dist.config import load_tree
from halo_dist.teacher import teacher_depth_problem
cfg, teacher = sys.argv[1:]
print(teacher_depth_problem(teacher, load_tree(cfg).get("model", {}).get("num_layers")) or "")
' "$HALO_CONFIG_DIR/stage1.yaml" "$HALO_TEACHER" 2>/dev/null); then
        halo_log "WARNING: teacher depth not checked ($HALO_PYTHON cannot import halo_dist)"
        return 0
    fi
    [[ -z $problem ]] || halo_die "$problem"
}

halo_hub_tasks() {  # the HALO_CSR_TASKS outside HALO_OFFLINE_TASKS (comma-separated): they need the hub
    local t tasks hub=()
    IFS=, read -ra tasks <<< "$HALO_CSR_TASKS"
    for t in "${tasks[@]}"; do
        [[ -z $t || ,$HALO_OFFLINE_TASKS, == *",$t,"* ]] || hub+=("$t")
    done
    (IFS=,; echo "${hub[*]}")
}

halo_pipeline_validate() {
    halo_require_env \
        "HALO_DATA:folder of the tokenized training data (data prep writes HALO_DATA/manifest.json), e.g. export HALO_DATA=/scratch/\$USER/data/qwen3-fwe-1b" \
        "HALO_RUNS:run folder for checkpoints, logs and TensorBoard, e.g. export HALO_RUNS=/scratch/\$USER/runs/halo-$HALO_SIZE" \
        "HALO_TEACHER:the teacher, a hub id or a local folder, e.g. export HALO_TEACHER=$HALO_TEACHER_HINT"
    HALO_DATA=$(halo_abs "$HALO_DATA"); HALO_RUNS=$(halo_abs "$HALO_RUNS")
    [[ -n ${HALO_DATA_LONG:-} ]] && HALO_DATA_LONG=$(halo_abs "$HALO_DATA_LONG")
    [[ $HALO_DATA != "$HALO_RUNS" ]] || halo_die "HALO_DATA and HALO_RUNS must be different folders"
    if [[ $HALO_TEACHER == /* || $HALO_TEACHER == .* || $HALO_TEACHER == "~"* || -e $HALO_TEACHER ]]; then
        HALO_TEACHER=$(halo_abs "$HALO_TEACHER")
        [[ -f $HALO_TEACHER/config.json ]] || halo_die "HALO_TEACHER=$HALO_TEACHER is not a model folder (no config.json)"
    elif [[ ! $HALO_TEACHER =~ ^[A-Za-z0-9._-]+/[A-Za-z0-9._-]+$ ]]; then
        halo_die "HALO_TEACHER=$HALO_TEACHER is neither an existing folder nor a hub id like $HALO_TEACHER_HINT"
    fi
    halo_posint HALO_NODES "$HALO_NODES"
    halo_posint HALO_GPUS_PER_NODE "$HALO_GPUS_PER_NODE"
    local n
    for n in 1 2 3; do halo_posint "HALO_STAGE${n}_NODES" "$(halo_step_nodes "stage$n")"; done
    [[ -d $HALO_REPO/$HALO_CONFIG_DIR ]] || halo_die "no stage configs in $HALO_REPO/$HALO_CONFIG_DIR"
    halo_check_teacher_depth
    if [[ ${HALO_SKIP_PREP:-0} == 1 ]] && ! halo_manifest_complete "$HALO_DATA"; then
        halo_die "HALO_SKIP_PREP=1 but $HALO_DATA/manifest.json is missing or not complete: run data prep first"
    fi
    [[ -z ${HALO_ATTN_LAYERS:-} || $HALO_ATTN_LAYERS =~ ^[0-9]+(,[0-9]+)*$ ]] \
        || halo_die "HALO_ATTN_LAYERS=$HALO_ATTN_LAYERS must be comma-separated layer indices, e.g. 2,3,6"
    halo_check_slurm_tools
}

halo_pipeline_driver() {
    halo_inherit_driver_job
    halo_parse_args "$@"
    halo_pipeline_validate
    export HALO_DATA HALO_RUNS HALO_TEACHER HALO_NODES HALO_GPUS_PER_NODE HALO_REPO
    [[ -n ${HALO_DATA_LONG:-} ]] && export HALO_DATA_LONG
    halo_pipeline_paths
    halo_log "HALO $HALO_SIZE: teacher $HALO_TEACHER -> HypeNet-${HALO_STUDENT^^}; data $DATA; runs $RUNS (tensorboard --logdir $RUNS)"
    if [[ -z ${HALO_DATA_LONG:-} ]]; then
        halo_log "stage 3 and calibration (16K context) also read $DATA: set HALO_DATA_LONG to shards of long documents"
    fi
    local hub
    hub=$(halo_hub_tasks)  # said before submission: the eval job comes last, hours later, often without network
    if [[ -n $hub ]]; then
        halo_log "eval: HALO_CSR_TASKS $hub are not saved offline and need the Hugging Face hub" \
            "(network or the HF cache) in the eval job; offline: $HALO_OFFLINE_TASKS"
    fi
    local checks=() n
    for n in 1 2 3; do
        local nodes world
        nodes=$(halo_step_nodes "stage$n"); world=$((nodes * HALO_GPUS_PER_NODE))
        local var="HALO_STAGE${n}_ARGS"
        checks+=("stage$n ($nodes node(s) x $HALO_GPUS_PER_NODE GPUs)|$world|$CFG/stage$n.yaml|model.teacher=$HALO_TEACHER ${!var:-}")
    done
    HALO_LAYOUT_HINT="Change the node count (HALO_NODES, or HALO_STAGE<N>_NODES for one stage), HALO_GPUS_PER_NODE, or that stage's batch layout (e.g. HALO_STAGE2_ARGS='data.micro_batch_size=3')."
    halo_check_layouts "${checks[@]}"
    halo_refuse_duplicates
    run_cmd mkdir -p "$RUNS/logs"

    local script=$HALO_REPO/slurm/halo_$HALO_SIZE.sh dep="" step
    local -a submitted=()
    for step in "${HALO_STEPS[@]}"; do
        if [[ $step == prep && ${HALO_SKIP_PREP:-0} == 1 ]]; then
            halo_log "skip prep: HALO_SKIP_PREP=1"
            continue
        elif [[ $step == select && -n ${HALO_ATTN_LAYERS:-} ]]; then
            halo_log "skip select: HALO_ATTN_LAYERS=$HALO_ATTN_LAYERS"
            continue
        elif halo_step_is_done "$step"; then
            halo_log "skip $step: already done ($(halo_step_done_file "$step"))"
            continue
        fi
        halo_sbatch "halo-$HALO_SIZE-$step" "$step" "$(halo_step_kind "$step")" "$(halo_step_nodes "$step")" \
            "$dep" "$RUNS/logs/$step-%j.log" "$script"
        dep="afterok:$HALO_JOB_ID"
        submitted+=("$step:$HALO_JOB_ID")
        if halo_is_dry; then   # show what the job will run, with this step's node count
            HALO_PREVIEW=1 HALO_STEP=$step SLURM_NNODES=$(halo_step_nodes "$step") SLURM_JOB_ID=$HALO_JOB_ID \
                SLURM_CPUS_PER_TASK="" halo_pipeline_step_body "$step"
        fi
    done
    [[ -n $dep ]] || halo_log "every step is done: nothing to submit (outputs under $RUNS)"
    if halo_is_dry; then
        halo_log "dry run: nothing was submitted"
    elif [[ $HALO_WAIT == 1 && ${#submitted[@]} -gt 0 ]]; then
        halo_wait_chain "${submitted[@]}" || exit 1
    fi
    return 0
}

halo_pipeline_step() {
    halo_pipeline_paths
    halo_step_begin
    if halo_step_is_done "$HALO_STEP"; then
        halo_log "skip $HALO_STEP: already done ($(halo_step_done_file "$HALO_STEP"))"
        exit 0
    fi
    cd "$HALO_REPO"
    halo_pipeline_step_body "$HALO_STEP"
    halo_log "step $HALO_STEP finished $(date -Is)"
}

halo_pipeline_main() {  # entry point of slurm/halo_<size>.sh
    local here=$1
    shift
    halo_locate_repo "$here"
    if [[ -n ${HALO_STEP:-} ]]; then halo_pipeline_step; else halo_pipeline_driver "$@"; fi
}
