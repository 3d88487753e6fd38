#!/usr/bin/env bash
# Can reads use up nats-server's consumers? Starts nats-server and the release `fairledger serve
# --nats` on loopback, submits 2,000 workloads, then reads with wrk: GET /v1/workloads/{id} (a
# workload's history) and GET /v1/events pages of 100, each for DURATION, and counts the answers
# that were not 200 and the consumers the server holds afterwards.
#   bash ops/bench/reads.sh [path/to/fairledger] [duration]   (needs wrk, curl)
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
bin="${1:-$here/target/release/fairledger}"
duration="${2:-60s}"
nats="$(bash "$here/ops/nats-server.sh")"
work="$(mktemp -d)"
port=$((20000 + RANDOM % 20000)); api=$((port + 1)); mon=$((port + 2))
pids=()
cleanup() { { kill -9 "${pids[@]}"; wait; } 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
"$nats" -js -sd "$work/nats" -a 127.0.0.1 -p "$port" -m "$mon" >"$work/nats.log" 2>&1 &
pids+=($!)
"$bin" serve --nats "nats://127.0.0.1:$port" --data "$work/data" --listen "127.0.0.1:$api" \
    --nats-wait-s 30 >"$work/serve.log" 2>&1 &
pids+=($!)
for _ in $(seq 300); do [ -f "$work/data/admin.token" ] && curl -fs -o /dev/null "http://127.0.0.1:$api/readyz" && break; sleep 0.1; done
export FAIRLEDGER_TOKEN="$(cat "$work/data/admin.token")"
call() { curl -s -H "authorization: Bearer $FAIRLEDGER_TOKEN" -H 'content-type: application/json' "$@"; }
call -X PUT -d '{"weight":1}' "http://127.0.0.1:$api/v1/allocations/team" >/dev/null
call -X POST -d '{"node":"gpu-1","gpus":8,"model":"H100"}' "http://127.0.0.1:$api/v1/nodes" >/dev/null
export FAIRLEDGER_BENCH_ALLOCATION=team
wrk -t1 -c16 -d5s -s "$here/ops/bench/submit.lua" "http://127.0.0.1:$api/v1/workloads" >/dev/null
# A running workload: its history holds a submission and a start.
id="$(call "http://127.0.0.1:$api/v1/events?kind=workload_started&limit=1" | python3 -c 'import json,sys; print(json.load(sys.stdin)["events"][0]["event"]["payload"]["workload"])')"
echo "events in the log: $(call "http://127.0.0.1:$api/v1/events?limit=1" | python3 -c 'import json,sys; print(json.load(sys.stdin)["last_seq"])')"
read_with_wrk() {
    wrk -t2 -c16 -d"$duration" -s "$here/ops/bench/get.lua" "$1" |
        grep -E "requests in|Requests/sec|Non-2xx|Socket errors" | tr -s ' ' | paste -sd' '
}
echo "GET /v1/workloads/{id}: $(read_with_wrk "http://127.0.0.1:$api/v1/workloads/$id")"
echo "GET /v1/events?after=500&limit=100: $(read_with_wrk "http://127.0.0.1:$api/v1/events?after=500&limit=100")"
echo "consumers on the server afterwards: $(curl -s "http://127.0.0.1:$mon/jsz" | python3 -c 'import json,sys; print(json.load(sys.stdin)["consumers"])')"
