#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for tests: no systemd, no cgroups, no munge.
#
#   launch/slurm_local.sh start  STATE_DIR [--accounting]
#   launch/slurm_local.sh status STATE_DIR
#   launch/slurm_local.sh stop   STATE_DIR
#
# Everything (slurm.conf, state, spool, logs, pid files, the MariaDB data dir) lives under
# STATE_DIR. After `start`, use the cluster with:  source STATE_DIR/env.sh   (sets SLURM_CONF).
# --accounting adds MariaDB + slurmdbd so `sacct` works (submitit reads job states from it).
#
# Ports (change them to run several clusters side by side):
#   SLURM_LOCAL_CTLD_PORT (6817)  SLURM_LOCAL_SLURMD_PORT (6818)
#   SLURM_LOCAL_DBD_PORT  (6819)  SLURM_LOCAL_DB_PORT     (3307)
#
# Installs nothing (see launch/install_slurm.sh). Needs root: slurmd runs jobs as their owner.
# Daemons are stopped by the PIDs in their pid files, never by name, so other clusters and
# other users' processes on the machine are left alone.
set -euo pipefail

usage() {
    echo "usage: $0 start|status|stop STATE_DIR [--accounting]" >&2
    exit 2
}

[[ $# -ge 2 ]] || usage
action=$1
state=$(mkdir -p "$2" && cd "$2" && pwd)
accounting=0
if [[ "${3:-}" == "--accounting" ]]; then
    accounting=1
elif [[ $# -gt 2 ]]; then
    usage
fi

ctld_port=${SLURM_LOCAL_CTLD_PORT:-6817}
slurmd_port=${SLURM_LOCAL_SLURMD_PORT:-6818}
dbd_port=${SLURM_LOCAL_DBD_PORT:-6819}
db_port=${SLURM_LOCAL_DB_PORT:-3307}
startup_timeout=${SLURM_LOCAL_TIMEOUT:-60}

export SLURM_CONF=$state/slurm.conf
node=$(hostname -s)

log() { echo "slurm_local: $*" >&2; }

# PID from a pid file, only when that process is still alive.
live_pid() {
    local file=$1 pid
    [[ -s $file ]] || return 1
    pid=$(<"$file")
    [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

# SIGTERM every daemon named by NAME=PIDFILE, then wait for all of them together; SIGKILL what
# is still alive after 10 s.
stop_pid_files() {
    local pair name file pid
    local -A pids=()
    for pair in "$@"; do
        name=${pair%%=*} file=${pair#*=}
        if pid=$(live_pid "$file"); then
            kill -TERM "$pid" 2>/dev/null || true
            pids[$name]=$pid
        fi
        rm -f "$file"
    done
    for _ in $(seq 100); do
        for name in "${!pids[@]}"; do
            if ! kill -0 "${pids[$name]}" 2>/dev/null; then
                log "stopped $name (pid ${pids[$name]})"
                unset "pids[$name]"
            fi
        done
        ((${#pids[@]} == 0)) && return 0
        sleep 0.1
    done
    for name in "${!pids[@]}"; do
        log "$name (pid ${pids[$name]}) ignored SIGTERM for 10 s; sending SIGKILL"
        kill -KILL "${pids[$name]}" 2>/dev/null || true
    done
}

# Wait until a command succeeds, or fail with the tail of the daemon's log: at the timeout, or
# as soon as the daemon behind PIDFILE has exited (after a 3 s grace for it to write the file).
wait_for() {
    local what=$1 pidfile=$2 logfile=$3
    shift 3
    local t0=$SECONDS why=""
    until "$@" >/dev/null 2>&1; do
        if ((SECONDS - t0 >= startup_timeout)); then
            why="not ready after ${startup_timeout}s"
        elif ((SECONDS - t0 >= 3)) && ! live_pid "$pidfile" >/dev/null; then
            why="exited"
        fi
        if [[ -n $why ]]; then
            log "$what $why; last lines of $logfile:"
            tail -n 20 "$logfile" >&2 || true
            return 1
        fi
        sleep 0.2
    done
}

write_slurm_conf() {
    local cpus mem_mb
    cpus=$(nproc --all)  # GNU nproc alone honours OMP_NUM_THREADS: a 1-CPU node would pend every 2-CPU job
    # Leave 10% of the memory out: slurmd drains the node when RealMemory exceeds what it finds.
    mem_mb=$(awk '/^MemTotal:/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)
    mkdir -p "$state"/{ctld,spool,log,run}
    cat >"$SLURM_CONF" <<EOF
# Written by launch/slurm_local.sh; restart both daemons after editing.
ClusterName=distaccum
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MailProg=/bin/true
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/spool
SlurmctldPidFile=$state/run/slurmctld.pid
SlurmdPidFile=$state/run/slurmd.pid
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdLogFile=$state/log/slurmd.log
# Short timers: tests want quick turnaround, not production robustness.
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=300
EOF
    if ((accounting)); then
        cat >>"$SLURM_CONF" <<EOF
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$dbd_port
JobCompType=jobcomp/none
EOF
    else
        echo "AccountingStorageType=accounting_storage/none" >>"$SLURM_CONF"
    fi
    cat >>"$SLURM_CONF" <<EOF
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
    printf 'export SLURM_CONF=%q\n' "$SLURM_CONF" >"$state/env.sh"
}

# MariaDB on 127.0.0.1:$db_port with its data under the state dir, then slurmdbd in front of it.
start_accounting() {
    local db=$state/mysql sock=$state/run/mysqld.sock
    if [[ ! -d $db/mysql ]]; then
        mariadb-install-db --no-defaults --user=root --datadir="$db" --skip-test-db \
            --auth-root-authentication-method=socket >"$state/log/mariadb-install.log" 2>&1
    fi
    if ! live_pid "$state/run/mariadb.pid" >/dev/null; then
        mariadbd --no-defaults --user=root --datadir="$db" --socket="$sock" \
            --bind-address=127.0.0.1 --port="$db_port" --pid-file="$state/run/mariadb.pid" \
            --log-error="$state/log/mariadb.log" --skip-name-resolve \
            --innodb-buffer-pool-size=128M --innodb-log-file-size=8M \
            --innodb-lock-wait-timeout=900 >/dev/null 2>&1 &
        wait_for mariadb "$state/run/mariadb.pid" "$state/log/mariadb.log" mariadb --no-defaults --socket="$sock" -e "SELECT 1"
    fi
    mariadb --no-defaults --socket="$sock" <<'EOF'
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
EOF
    # slurmdbd reads slurmdbd.conf from the directory of $SLURM_CONF; it must be private.
    install -m 600 /dev/null "$state/slurmdbd.conf"
    cat >"$state/slurmdbd.conf" <<EOF
AuthType=auth/none
DbdHost=$node
DbdAddr=127.0.0.1
DbdPort=$dbd_port
SlurmUser=root
PidFile=$state/run/slurmdbd.pid
LogFile=$state/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$db_port
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
    if ! live_pid "$state/run/slurmdbd.pid" >/dev/null; then
        slurmdbd
        wait_for slurmdbd "$state/run/slurmdbd.pid" "$state/log/slurmdbd.log" sacctmgr -n list cluster
    fi
    # No `sacctmgr add cluster`: slurmctld registers its cluster with slurmdbd on start.
}

start() {
    if live_pid "$state/run/slurmctld.pid" >/dev/null; then
        log "already running in $state"
        status
        return 0
    fi
    local t0=$SECONDS
    write_slurm_conf
    ((accounting)) && start_accounting
    slurmctld -f "$SLURM_CONF"
    wait_for slurmctld "$state/run/slurmctld.pid" "$state/log/slurmctld.log" scontrol ping
    slurmd -f "$SLURM_CONF"
    wait_for "node $node idle" "$state/run/slurmd.pid" "$state/log/slurmd.log" node_idle
    log "cluster up in $((SECONDS - t0)) s (node $node, $(nproc --all) CPUs); source $state/env.sh"
}

node_idle() {
    [[ $(sinfo -h -o %T 2>/dev/null) == idle ]]
}

stop() {
    # Cancel this cluster's jobs first so no slurmstepd outlives its slurmd.
    if live_pid "$state/run/slurmctld.pid" >/dev/null; then
        local jobs
        jobs=$(squeue -h -o %i 2>/dev/null || true)
        if [[ -n $jobs ]]; then
            # shellcheck disable=SC2086  # one job id per word
            scancel $jobs 2>/dev/null || true
            for _ in $(seq 50); do
                [[ -z $(squeue -h -o %i 2>/dev/null || true) ]] && break
                sleep 0.2
            done
        fi
    fi
    stop_pid_files slurmd="$state/run/slurmd.pid" slurmctld="$state/run/slurmctld.pid"
    # slurmctld is down: nothing else reports to slurmdbd, which can go with its database.
    stop_pid_files slurmdbd="$state/run/slurmdbd.pid" mariadb="$state/run/mariadb.pid"
}

status() {
    local name pid rc=0
    for name in slurmctld slurmd slurmdbd mariadb; do
        if pid=$(live_pid "$state/run/$name.pid"); then
            echo "$name running (pid $pid)"
        elif [[ $name == slurmctld || $name == slurmd ]]; then
            echo "$name not running"
            rc=1
        fi
    done
    if ((rc == 0)); then
        echo "node $node: $(sinfo -h -o %T 2>/dev/null || echo unreachable)"
    fi
    return $rc
}

case $action in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) usage ;;
esac
