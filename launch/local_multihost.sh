#!/usr/bin/env bash
# Run one flatlm command as N processes on this machine, joined like the hosts of a pod:
#
#   launch/local_multihost.sh N VERB [flatlm args...]
#   launch/local_multihost.sh 2 train --config configs/hmm_mlm.py:tiny --workdir /tmp/run2x4
#
# Process i gets JAX_COORDINATOR_ADDRESS=127.0.0.1:<a free port>, JAX_NUM_PROCESSES=N, JAX_PROCESS_ID=i (flatlm joins
# them in `flatlm.run.initialize_distributed`) and, unless JAX_PLATFORMS says otherwise, FLATLM_CPU_DEVICES (default
# 4) simulated CPU devices (XLA_FLAGS), so N x 4 devices train like one process with 4N devices.
# Logs: $FLATLM_LOG_DIR (default: a new temporary folder, printed) holds process_<i>.log; process 0's output is also
# shown here. When a process fails, the others get FLATLM_GRACE seconds (default 30) to stop by themselves (a
# preempted one stops them at the next step), then are killed. Exit status: 0, or the first failure's.
# Environment: PYTHON (default: python), FLATLM_CPU_DEVICES, FLATLM_LOG_DIR, FLATLM_GRACE.
set -uo pipefail

if [[ $# -lt 2 || ! $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 NUM_PROCESSES VERB [flatlm args...]  (e.g. $0 2 train --config configs/hmm_mlm.py:tiny --workdir /tmp/r)" >&2
  exit 2
fi
n=$1
shift
python=${PYTHON:-python}
grace=${FLATLM_GRACE:-30}
logs=${FLATLM_LOG_DIR:-$(mktemp -d -t flatlm-multihost.XXXXXX)}
mkdir -p "$logs"
port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export JAX_COORDINATOR_ADDRESS=127.0.0.1:$port JAX_NUM_PROCESSES=$n
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
if [[ $JAX_PLATFORMS == cpu ]]; then
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=${FLATLM_CPU_DEVICES:-4}"
fi
echo "flatlm: $n processes, coordinator $JAX_COORDINATOR_ADDRESS, logs in $logs" >&2

pids=()
for ((i = 0; i < n; i++)); do
  if ((i == 0)); then
    JAX_PROCESS_ID=$i "$python" -m flatlm.cli "$@" > >(tee "$logs/process_$i.log") 2>&1 &
  else
    JAX_PROCESS_ID=$i "$python" -m flatlm.cli "$@" >"$logs/process_$i.log" 2>&1 &
  fi
  pids+=($!)
done

stop_all() {  # $1: signal; only our own children
  for pid in "${pids[@]}"; do kill "-$1" "$pid" 2>/dev/null; done
}
trap 'stop_all TERM' TERM INT

status=0
remaining=$n
deadline=
while ((remaining > 0)); do
  for idx in "${!pids[@]}"; do
    pid=${pids[$idx]}
    [[ -z $pid ]] && continue
    if ! kill -0 "$pid" 2>/dev/null; then
      wait "$pid"
      rc=$?
      pids[$idx]=
      remaining=$((remaining - 1))
      if ((rc != 0 && status == 0)); then
        status=$rc
        deadline=$((SECONDS + grace))
        echo "flatlm: process $idx exited with $rc (log: $logs/process_$idx.log); stopping the others" >&2
      fi
    fi
  done
  if [[ -n $deadline ]] && ((SECONDS >= deadline && remaining > 0)); then
    stop_all KILL
    deadline=
  fi
  ((remaining > 0)) && sleep 0.2
done
wait  # the tee of process 0
exit $status
