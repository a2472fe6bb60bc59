#!/usr/bin/env bash
# A throw-away single-node SLURM cluster on this machine (CI and tests/sweeper/test_sweeper_slurm.py):
#   bash scripts/slurm_local.sh install          # apt-get install slurm-wlm munge [+ slurmdbd mariadb-server]
#   bash scripts/slurm_local.sh start [--no-accounting]   # munged, [mariadb + slurmdbd], slurmctld, slurmd
#   bash scripts/slurm_local.sh stop | status | ctld-stop | ctld-start
# As root, no systemd, no cgroup plugins. Idempotent: `start` on a running cluster only checks it (a
# different accounting mode restarts the controller). Writes /etc/slurm/slurm.conf (only when absent or
# written by this script) and its state/logs under $SLURM_LOCAL_DIR (default /tmp/vramsweep-slurm).
# Exit codes: 0 ok, 3 not installed / not root (callers skip), 1 failed to start (callers fail, with the log).
set -uo pipefail
DIR=${SLURM_LOCAL_DIR:-/tmp/vramsweep-slurm}
CONF=/etc/slurm/slurm.conf
MARK="# written by vramsweep scripts/slurm_local.sh"
NODE=localhost
CLUSTER=vramsweep
PARTITION=debug
log() { echo "slurm_local: $*" >&2; }

need() {
  [ "$(id -u)" = 0 ] || { log "needs root"; exit 3; }
  for b in munged slurmctld slurmd sbatch squeue sinfo; do
    command -v "$b" >/dev/null || { log "$b not installed (bash scripts/slurm_local.sh install)"; exit 3; }
  done
}

alive() { [ -f "$DIR/$1.pid" ] && kill -0 "$(cat "$DIR/$1.pid")" 2>/dev/null; }

wait_for() {  # wait_for <seconds> <what> <command...>
  local n=$(($1 * 5)) what=$2; shift 2
  for _ in $(seq "$n"); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
  log "$what did not come up in $((n / 5)) s"; return 1
}

install() {
  [ "$(id -u)" = 0 ] || { log "needs root"; exit 3; }
  local pkgs="slurm-wlm munge"
  [ "${1:-}" = "--no-accounting" ] || pkgs="$pkgs slurmdbd mariadb-server"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $pkgs >/dev/null) \
    || { log "apt-get install $pkgs failed"; exit 3; }
}

start_munge() {
  if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge && chown munge:munge /etc/munge
    runuser -u munge -- mungekey --create >/dev/null 2>&1 || mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
  fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge && chown munge:munge /run/munge /var/log/munge /var/lib/munge
  if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    runuser -u munge -- munged --force --pid-file=/run/munge/munged.pid
    wait_for 10 munged sh -c 'munge -n | unmunge' || exit 1
  fi
}

start_db() {  # MariaDB (its own datadir under $DIR, socket in $DIR) + slurmdbd
  local db="$DIR/db"  # owned by the mysql user: datadir, socket, pid file, log
  if ! alive db/mariadb; then
    mkdir -p "$db" && chown mysql:mysql "$db"
    if [ ! -d "$db/data/mysql" ]; then
      mariadb-install-db --user=mysql --datadir="$db/data" --auth-root-authentication-method=socket \
        >"$DIR/mariadb-install.log" 2>&1 || { log "mariadb-install-db failed: $(tail -3 "$DIR/mariadb-install.log")"; exit 1; }
    fi
    mariadbd --user=mysql --datadir="$db/data" --socket="$db/mysql.sock" --pid-file="$db/mariadb.pid" \
      --bind-address=127.0.0.1 --port=3307 --log-error="$db/mariadb.log" >/dev/null 2>&1 &
    wait_for 30 mariadb mariadb --socket="$db/mysql.sock" -e 'select 1' || { tail -5 "$db/mariadb.log" >&2; exit 1; }
    mariadb --socket="$db/mysql.sock" -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
      CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
      CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
      GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
      FLUSH PRIVILEGES;" || exit 1
  fi
  if ! alive slurmdbd; then
    cat >/etc/slurm/slurmdbd.conf <<EOF
$MARK
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=3307
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
LogFile=$DIR/slurmdbd.log
PidFile=$DIR/slurmdbd.pid
EOF
    chmod 600 /etc/slurm/slurmdbd.conf
    slurmdbd || { tail -5 "$DIR/slurmdbd.log" >&2; exit 1; }
    wait_for 30 slurmdbd sacctmgr -n list cluster || { tail -5 "$DIR/slurmdbd.log" >&2; exit 1; }
    sacctmgr -i add cluster "$CLUSTER" >/dev/null 2>&1 || true
  fi
}

write_conf() {  # write_conf <accounting: yes|no>
  if [ -f "$CONF" ] && ! grep -q "^$MARK" "$CONF"; then
    log "$CONF exists and was not written by this script: not touching it"; exit 1
  fi
  local cpus mem acct
  cpus=$(nproc)
  mem=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
  if [ "$1" = yes ]; then
    acct="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost"
  else
    acct="AccountingStorageType=accounting_storage/none"
  fi
  mkdir -p "$DIR/ctld" "$DIR/slurmd" /etc/slurm
  cat >"$CONF" <<EOF
$MARK (accounting=$1)
ClusterName=$CLUSTER
SlurmctldHost=$NODE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/slurmd
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SchedulerType=sched/backfill
MinJobAge=300
KillWait=5
$acct
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
}

node_idle() { sinfo -h -n "$NODE" -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)'; }

start() {
  need
  local accounting=yes
  [ "${1:-}" = "--no-accounting" ] && accounting=no
  if [ "$accounting" = yes ] && ! command -v slurmdbd >/dev/null || [ "$accounting" = yes ] && ! command -v mariadbd >/dev/null; then
    log "slurmdbd/mariadb-server not installed: starting without accounting"; accounting=no
  fi
  mkdir -p "$DIR"
  start_munge
  if alive slurmctld && ! grep -q "^$MARK (accounting=$accounting)" "$CONF" 2>/dev/null; then
    stop_ctld  # other accounting mode: restart the controller with the new config
  fi
  write_conf "$accounting"  # before slurmdbd: sacctmgr reads it
  if [ "$accounting" = yes ]; then start_db; fi
  if ! alive slurmctld; then
    slurmctld || { tail -5 "$DIR/slurmctld.log" >&2; exit 1; }
  fi
  wait_for 30 slurmctld scontrol ping || { tail -5 "$DIR/slurmctld.log" >&2; exit 1; }
  if ! alive slurmd; then
    slurmd -N "$NODE" || { tail -5 "$DIR/slurmd.log" >&2; exit 1; }
  fi
  scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true
  wait_for 30 "node $NODE idle" node_idle || { sinfo >&2; tail -5 "$DIR/slurmd.log" >&2; exit 1; }
  log "up: partition $PARTITION, node $NODE ($(nproc) CPUs), accounting=$accounting, logs in $DIR"
}

stop_ctld() {
  alive slurmctld && kill "$(cat "$DIR/slurmctld.pid")"
  for _ in $(seq 50); do alive slurmctld || return 0; sleep 0.2; done
  kill -9 "$(cat "$DIR/slurmctld.pid")" 2>/dev/null || true
}

stop() {
  scancel --user="$(id -un)" >/dev/null 2>&1 || true
  stop_ctld
  for d in slurmd slurmdbd db/mariadb; do
    alive "$d" && kill "$(cat "$DIR/$d.pid")"
  done
  for d in slurmd slurmdbd db/mariadb; do
    for _ in $(seq 50); do alive "$d" || break; sleep 0.2; done
  done
  return 0
}

case "${1:-}" in
  install) shift; install "$@" ;;
  start) shift; start "$@" ;;
  stop) stop ;;
  ctld-stop) stop_ctld ;;
  ctld-start) need; slurmctld && wait_for 30 slurmctld scontrol ping && wait_for 30 "node $NODE idle" node_idle ;;
  status) sinfo; squeue ;;
  *) echo "usage: $0 install|start [--no-accounting]|stop|status|ctld-stop|ctld-start" >&2; exit 2 ;;
esac
