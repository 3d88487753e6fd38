#!/usr/bin/env bash
# How soon after a restarted nats-server is reachable again is the first submission acknowledged?
# Starts nats-server and `fairledger serve --nats` on loopback, then ROUNDS times: SIGKILLs
# nats-server, waits 2 s, starts it again on the same store, and times (a) until its port takes
# connections and (b) from then until a POST /v1/workloads answers 202.
#   bash ops/bench/recovery.sh [path/to/fairledger] [rounds]
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
bin="${1:-$here/target/release/fairledger}"
rounds="${2:-5}"
nats="$(bash "$here/ops/nats-server.sh")"
work="$(mktemp -d)"
port=$((20000 + RANDOM % 20000)); api=$((port + 1))
nats_pid=""; serve_pid=""
cleanup() { kill -9 $nats_pid $serve_pid 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
start_nats() { "$nats" -js -sd "$work/nats" -a 127.0.0.1 -p "$port" >"$work/nats.log" 2>&1 & nats_pid=$!; }
reachable() { (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; }
start_nats
for _ in $(seq 500); do reachable && break; sleep 0.01; done
"$bin" serve --nats "nats://127.0.0.1:$port" --data "$work/data" --listen "127.0.0.1:$api" >"$work/serve.log" 2>&1 &
serve_pid=$!
for _ in $(seq 300); do [ -f "$work/data/admin.token" ] && curl -fs -o /dev/null "http://127.0.0.1:$api/readyz" && break; sleep 0.1; done
token="$(cat "$work/data/admin.token")"
call() { curl -s -m 5 -o /dev/null -w '%{http_code}' -H "authorization: Bearer $token" -H 'content-type: application/json' "$@"; }
call -X PUT -d '{"weight":1}' "http://127.0.0.1:$api/v1/allocations/team" >/dev/null
call -X POST -d '{"node":"gpu-1","gpus":8,"model":"H100"}' "http://127.0.0.1:$api/v1/nodes" >/dev/null
submit() { call -X POST -d '{"allocation":"team","gpus_per_node":1}' "http://127.0.0.1:$api/v1/workloads"; }
[ "$(submit)" = 202 ] || { echo "the first submission failed; see $work/serve.log" >&2; exit 1; }
for round in $(seq "$rounds"); do
    kill -9 "$nats_pid"; wait "$nats_pid" 2>/dev/null || true
    sleep 2
    start_nats
    t0=$(date +%s.%N)
    for _ in $(seq 3000); do reachable && break; sleep 0.01; done
    t1=$(date +%s.%N)
    for _ in $(seq 1200); do [ "$(submit)" = 202 ] && break; sleep 0.05; done
    t2=$(date +%s.%N)
    printf 'round %d: port open %.2f s after start; first acknowledged submission %.2f s after that\n' \
        "$round" "$(echo "$t1 - $t0" | bc)" "$(echo "$t2 - $t1" | bc)"
done
