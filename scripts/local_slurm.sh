#!/usr/bin/env bash
# A one-node Slurm on this host (Debian's slurmctld + slurmd + munge), for the real-Slurm tests and for
# trying the slurm/ scripts without a cluster. Needs root: it installs packages and runs the daemons.
#
#   bash scripts/local_slurm.sh up       # install if missing, configure, start, wait until the node is idle
#   eval "$(bash scripts/local_slurm.sh env)"   # SLURM_CONF for sbatch/squeue/... in this shell
#   bash scripts/local_slurm.sh status   # sinfo; exit 0 when the node takes jobs
#   bash scripts/local_slurm.sh down     # cancel jobs, stop the daemons it started, delete its state
#
# Everything it writes lives in $HALO_LOCAL_SLURM_DIR (default /tmp/halo-slurm): slurm.conf, gres.conf,
# controller state, slurmd spool, daemon logs, pid files, and jobcomp.log (one line per ended job run:
# there is no accounting database, so sacct has nothing). `up` and `down` may both be repeated.
# The node is `hostname -s` (slurmd insists) with every CPU of this host, in partition `debug`, plus
# HALO_LOCAL_SLURM_GPUS (default 2) `gpu` generic resources whose device files are /dev/null: the
# pipeline's `--gpus-per-node` requests are then scheduled as on a GPU cluster while the work runs on
# CPU. With HALO_LOCAL_SLURM_CPU=idle (the default) slurmd, and so every job, runs in a CPU cgroup of
# the idle class (cpu.idle): jobs get only the CPU time this machine's other work leaves unused, so a
# test suite can run them alongside its other tests (where the kernel has no cpu.idle: nice 10 instead).
# HALO_LOCAL_SLURM_CPU=normal leaves them at normal priority. The scheduler's intervals are short so
# that a chain of small jobs does not wait on it.
set -euo pipefail

DIR=${HALO_LOCAL_SLURM_DIR:-/tmp/halo-slurm}
CONF=$DIR/etc/slurm.conf
GPUS=${HALO_LOCAL_SLURM_GPUS:-2}
MUNGE_SOCKET=/run/munge/munge.socket.2   # munged's and Slurm's default: the client tools need no option
WAIT_S=${HALO_LOCAL_SLURM_WAIT_S:-60}
CPU=${HALO_LOCAL_SLURM_CPU:-idle}
CGROUP_NAME=halo-slurm
[[ $GPUS =~ ^[0-9]+$ ]] || { echo "error: local_slurm: HALO_LOCAL_SLURM_GPUS=$GPUS must be a count (0: no gpu resources)" >&2; exit 2; }
[[ $CPU == idle || $CPU == normal ]] || { echo "error: local_slurm: HALO_LOCAL_SLURM_CPU=$CPU must be idle or normal" >&2; exit 2; }

die() { printf 'error: local_slurm: %s\n' "$*" >&2; exit 2; }
say() { printf '# local_slurm: %s\n' "$*"; }

usage() {
    sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
}

need_root() {
    [[ $(id -u) == 0 ]] || die "'$1' needs root (it installs slurm-wlm and munge with apt-get and runs their daemons); run it as root, or use an existing Slurm through SLURM_CONF"
}

install_if_missing() {
    local missing=() t
    for t in slurmctld slurmd sbatch sinfo munged mungekey; do
        command -v "$t" >/dev/null 2>&1 || PATH=$PATH:/usr/sbin:/sbin command -v "$t" >/dev/null 2>&1 || missing+=("$t")
    done
    ((${#missing[@]})) || return 0
    command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get to install slurm-wlm and munge"
    say "installing slurm-wlm and munge (missing: ${missing[*]})"
    local pkgs=(slurm-wlm munge) log=/tmp/local_slurm-apt.$$.log
    # the lists of a fresh image may be missing or stale: update only when the first attempt fails
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${pkgs[@]}" >"$log" 2>&1; then
        DEBIAN_FRONTEND=noninteractive apt-get update -q >>"$log" 2>&1 || true
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${pkgs[@]}" >>"$log" 2>&1 \
            || { tail -n 20 "$log" >&2; rm -f "$log"; die "apt-get install ${pkgs[*]} failed (output above)"; }
    fi
    rm -f "$log"
}

munge_works() { munge -n -S "$MUNGE_SOCKET" 2>/dev/null | unmunge -S "$MUNGE_SOCKET" >/dev/null 2>&1; }

start_munge() {
    mkdir -p "$DIR/run"
    if munge_works; then
        say "munge is already running"
        return 0
    fi
    local key=/etc/munge/munge.key
    install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
    install -d -o munge -g munge -m 0755 /run/munge
    if [[ ! -s $key ]]; then
        if command -v mungekey >/dev/null; then mungekey --create --keyfile="$key"
        else dd if=/dev/urandom of="$key" bs=1024 count=1 status=none; fi
    fi
    chown munge:munge "$key"
    chmod 0400 "$key"
    runuser -u munge -- munged --socket="$MUNGE_SOCKET" \
        || die "munged did not start (see /var/log/munge/munged.log)"
    local i
    for ((i = 0; i < 50; i++)); do munge_works && break; sleep 0.1; done
    munge_works || die "munged started but munge -n | unmunge fails (see /var/log/munge/munged.log)"
    # only a munged started here is stopped by `down`
    cp /run/munge/munged.pid "$DIR/run/munged.pid" 2>/dev/null || pgrep -u munge -x munged > "$DIR/run/munged.pid"
}

node_line() {  # this host as slurmd sees it, with RealMemory below the actual (slurmd refuses less than configured)
    local line mem
    line=$(slurmd -C | head -n 1)
    [[ $line == NodeName=* ]] || die "slurmd -C printed '$line', expected a NodeName= line"
    mem=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<< "$line")
    [[ -n $mem ]] || die "no RealMemory in '$line'"
    line=${line/RealMemory=$mem/RealMemory=$((mem * 8 / 10))}
    printf '%s NodeAddr=127.0.0.1' "$line"
    ((GPUS > 0)) && printf ' Gres=gpu:%d' "$GPUS"
    printf ' State=UNKNOWN\n'
}

write_conf() {
    local host
    host=$(hostname -s)
    mkdir -p "$DIR/etc" "$DIR/state" "$DIR/spool/slurmd" "$DIR/log" "$DIR/run"
    local prolog=""
    if [[ $CPU == idle ]]; then
        prolog=$(task_prolog)
        if [[ -f $DIR/run/cgroup ]]; then say "jobs get the CPU time other work leaves unused (idle-class cgroup $(cat "$DIR/run/cgroup"))"
        else say "no idle-class CPU cgroup here (cpu.idle): jobs run at nice 10"; fi
    fi
    cat > "$CONF" <<EOF
# Written by scripts/local_slurm.sh: one node, partition debug, no accounting database, no Slurm cgroup plugins.
ClusterName=halo-local
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# a requeued job may start again cred_expire seconds after it stopped (default 120)
AuthInfo=cred_expire=5
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/slurmd
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/jobcomp.log
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
$( ((GPUS > 0)) && echo "GresTypes=gpu" )
# schedule on every event and re-test pending jobs (dependencies) every second
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1,sched_min_interval=0,batch_sched_delay=0
# generous: idle-class tasks (srun, the batch shell) may wait seconds for a CPU while other work runs,
# and a job told to stop (scancel, scontrol requeue) gets KillWait seconds to checkpoint before SIGKILL
MessageTimeout=30
SlurmctldTimeout=60
SlurmdTimeout=60
InactiveLimit=0
KillWait=120
MinJobAge=60
ReturnToService=2
JobRequeue=1
${prolog:+TaskProlog=$prolog}
$(node_line)
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
    if ((GPUS > 0)); then
        # slurmd drops a gpu resource without a device file: /dev/null stands in for each one
        local i
        mkdir -p "$DIR/dev"
        for ((i = 0; i < GPUS; i++)); do ln -sfn /dev/null "$DIR/dev/gpu$i"; done
        echo "NodeName=$host Name=gpu File=$DIR/dev/gpu[0-$((GPUS - 1))]" > "$DIR/etc/gres.conf"
    fi
}

idle_cgroup() {  # an idle-class CPU cgroup (cgroup v1's cpu hierarchy, else v2), its folder in $DIR/run/cgroup
    local dir
    for dir in /sys/fs/cgroup/cpu/$CGROUP_NAME /sys/fs/cgroup/$CGROUP_NAME; do
        [[ -d ${dir%/*} ]] || continue
        mkdir -p "$dir" 2>/dev/null || continue
        if [[ -f $dir/cpu.idle ]] && echo 1 2>/dev/null > "$dir/cpu.idle"; then
            echo "$dir" > "$DIR/run/cgroup"
            return 0
        fi
        rmdir "$dir" 2>/dev/null || true
    done
    return 1
}

task_prolog() {  # slurm.conf's TaskProlog: run in each task (batch script, srun task) before its command
    local script=$DIR/etc/task_prolog.sh
    {
        echo '#!/bin/sh'
        echo '# the task (this script'"'"'s parent) and all it starts: the CPU time other work leaves unused'
        if idle_cgroup; then echo "echo \$PPID > $(cat "$DIR/run/cgroup")/cgroup.procs 2>/dev/null"
        else echo 'renice -n 10 -p $PPID >/dev/null 2>&1'; fi
        echo 'exit 0'
    } > "$script"
    chmod 755 "$script"
    printf '%s' "$script"
}

ctl_up() { scontrol ping 2>/dev/null | grep -q 'is UP'; }

node_state() { sinfo -h -n "$(hostname -s)" -o %T 2>/dev/null | head -n 1; }

node_ready() {  # the node takes jobs: idle, or busy with some
    case $(node_state) in
        idle|mixed|allocated|completing) return 0 ;;
        *) return 1 ;;
    esac
}

pid_alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

show_logs() {
    local f
    for f in "$DIR"/log/slurmctld.log "$DIR"/log/slurmd.log; do
        [[ -f $f ]] && { printf -- '--- %s (last lines)\n' "$f" >&2; tail -n 15 "$f" >&2; }
    done
    return 0
}

cmd_up() {
    need_root up
    export SLURM_CONF=$CONF
    if [[ -f $CONF ]] && ctl_up && node_ready; then
        say "already up (node $(hostname -s) $(node_state)); SLURM_CONF=$CONF"
        return 0
    fi
    [[ -f $CONF ]] && stop_daemons   # a half-started or crashed earlier attempt: start from scratch
    rm -rf "$DIR"
    install_if_missing
    PATH=$PATH:/usr/sbin:/sbin
    start_munge
    write_conf
    slurmctld -c -f "$CONF" || { show_logs; die "slurmctld did not start"; }
    slurmd -f "$CONF" || { show_logs; die "slurmd did not start"; }
    local deadline=$((SECONDS + WAIT_S))
    until ctl_up && node_ready; do
        if ((SECONDS >= deadline)) || [[ $(node_state) == inval* || $(node_state) == drain* ]]; then
            sinfo -N -l >&2 2>&1 || true
            show_logs
            die "the node is not idle after $((SECONDS - deadline + WAIT_S))s (state: $(node_state || true); reason: $(sinfo -h -o %E 2>/dev/null))"
        fi
        sleep 0.5
    done
    say "up: node $(hostname -s) $(node_state), partition debug; export SLURM_CONF=$CONF"
}

wait_gone() {  # wait_gone PIDFILE SECONDS: until the process ended (or it is killed)
    local f=$1 n=$(($2 * 10)) i
    pid_alive "$f" || return 0
    for ((i = 0; i < n; i++)); do pid_alive "$f" || return 0; sleep 0.1; done
    kill -KILL "$(cat "$f")" 2>/dev/null || true
}

stop_daemons() {
    export SLURM_CONF=$CONF
    local f
    if ctl_up; then
        # jobs first: slurmstepd (and what it runs) outlives a stopped slurmd; SIGKILL, as nothing is resumed
        scancel --quiet --state=PENDING,SUSPENDED,REQUEUED 2>/dev/null || true
        scancel --quiet --full --signal=KILL --state=RUNNING 2>/dev/null || true
        local i
        for ((i = 0; i < 300; i++)); do
            [[ -z $(squeue -h -o %i 2>/dev/null) ]] && break
            sleep 0.1
        done
        [[ -z $(squeue -h -o %i 2>/dev/null) ]] || say "jobs still listed after 30 s: $(squeue -h -o '%i %T' | tr '\n' ' ')"
        scontrol shutdown >/dev/null 2>&1 || true
    fi
    for f in "$DIR"/run/slurmd.pid "$DIR"/run/slurmctld.pid; do
        [[ -f $f ]] || continue
        pid_alive "$f" && kill -TERM "$(cat "$f")" 2>/dev/null
        wait_gone "$f" 10
    done
    if [[ -f $DIR/run/munged.pid ]]; then
        kill -TERM "$(cat "$DIR/run/munged.pid")" 2>/dev/null || true
        wait_gone "$DIR/run/munged.pid" 5
    fi
    if [[ -f $DIR/run/cgroup ]]; then
        rmdir "$(cat "$DIR/run/cgroup")" 2>/dev/null || say "$(cat "$DIR/run/cgroup") still holds processes: not removed"
    fi
}

cmd_down() {
    if [[ ! -d $DIR ]]; then
        say "down (nothing in $DIR)"
        return 0
    fi
    need_root down
    PATH=$PATH:/usr/sbin:/sbin
    stop_daemons
    rm -rf "$DIR"
    say "down: daemons stopped, $DIR removed"
}

cmd_status() {
    export SLURM_CONF=$CONF
    [[ -f $CONF ]] || { say "not configured ($CONF missing)"; return 1; }
    sinfo -N -o '%N %P %T %C %G' || return 1
    ctl_up && node_ready
}

case ${1:-} in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    env) printf 'export SLURM_CONF=%q\n' "$CONF" ;;
    -h|--help|help) usage ;;
    *) usage >&2; die "unknown command '${1:-}' (up, down, status, env)" ;;
esac
