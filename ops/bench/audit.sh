#!/usr/bin/env bash
# Auditors at scale. Builds a ledger from a simulated year (FAIRLEDGER_BENCH_WORKLOADS workloads,
# default 1,000,000: about 3 million events; offered load FAIRLEDGER_BENCH_LOAD, default 0.97, so
# the queue stays short), moved in time to end an hour ago, imports it into an embedded log and
# measures, with wrk against the release `fairledger serve`:
#   - the projection rebuild (`project --once`), start-up to /readyz, and resident memory, at
#     start and with 50,000 more submissions waiting;
#   - an audit of every allocation over the last 30 days by day, and the cluster metrics of
#     the same period;
#   - submissions alone, then submissions while 8 connections query the audit;
#   - `audit verify` of the whole log, offline.
# Usage: ops/bench/audit.sh [WORK_DIR]   (needs wrk, python3; keeps WORK_DIR for reruns)
#   BIN=path/to/fairledger measures that build instead of building this checkout's;
#   SERVE_LOG=debug also lists the folds that held the projection (and every waiting
#   acknowledgement) over 40 ms, in ms.
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=${1:-$(mktemp -d)}
PORT=${PORT:-18080}
URL=http://127.0.0.1:$PORT
if [ -z "${BIN:-}" ]; then
  cargo build --release -p fairledger
  BIN=target/release/fairledger
fi
if [ ! -f "$WORK/events.jsonl" ]; then
  FAIRLEDGER_BENCH_LOAD=${FAIRLEDGER_BENCH_LOAD:-0.97} FAIRLEDGER_BENCH_KEEP="$WORK/year" \
    cargo bench -p sim --bench year
  python3 ops/bench/shift.py "$WORK/year/events.jsonl" "$WORK/events.jsonl"
fi
# A fresh log each run: the submissions of an earlier run would otherwise wait in its queue.
rm -rf "$WORK/data"
/usr/bin/time -f "import: %e s, %M KB max resident" $BIN log import --data "$WORK/data" "$WORK/events.jsonl"
echo "== projection rebuild"
/usr/bin/time -f "%e s, %M KB max resident" $BIN project --once --data "$WORK/data"

start=$(date +%s.%N)
FAIRLEDGER_LOG=${SERVE_LOG:-info} $BIN serve --data "$WORK/data" --config "$WORK/year/year.toml" --no-agents \
  --heartbeat-timeout-s 86400 --change-settings --listen "127.0.0.1:$PORT" 2>"$WORK/serve.log" &
SERVE=$!
trap 'kill $SERVE 2>/dev/null || true' EXIT
until curl -sf "$URL/readyz" >/dev/null; do sleep 0.05; done
echo "== start-up to /readyz: $(echo "$(date +%s.%N) - $start" | bc) s"
echo "== resident: $(ps -o rss= -p $SERVE) KB"
export FAIRLEDGER_TOKEN=$(cat "$WORK/data/admin.token")
live() {
  curl -sf -H "Authorization: Bearer $FAIRLEDGER_TOKEN" "$URL/metrics" |
    awk '/^fairledger_workloads\{phase="live"\}/ {print $2}'
}
echo "== live workloads at start: $(live)"
FAIRLEDGER_BENCH_COUNT=50000 wrk -t1 -c64 -d60s -s ops/bench/submit.lua "$URL/v1/workloads" >/dev/null
sleep 2
echo "== after 50,000 submissions: $(live) live, resident $(ps -o rss= -p $SERVE) KB"
FROM=$(date -u -d '30 days ago' +%Y-%m-%d)
AUDIT="$URL/v1/audit/ledger?from=$FROM&granularity=day"
METRICS="$URL/v1/metrics/cluster?from=$FROM"
curl -sf -H "Authorization: Bearer $FAIRLEDGER_TOKEN" "$AUDIT" | python3 -c 'import json,sys; d=json.load(sys.stdin); print("audit rows:", len(d["rows"]))'
echo "== audit, 30 days by day, 8 connections"
wrk -t1 -c8 -d10s --timeout 10s --latency -s ops/bench/get.lua "$AUDIT" | grep -E "Latency|50%|90%|99%|99.9%|Requests/sec|Non-2xx"
echo "== cluster metrics, 30 days, 8 connections"
wrk -t1 -c8 -d10s --timeout 10s --latency -s ops/bench/get.lua "$METRICS" | grep -E "Latency|50%|90%|99%|99.9%|Requests/sec|Non-2xx"
echo "== submissions, 64 connections"
wrk -t1 -c64 -d10s --timeout 10s --latency -s ops/bench/submit.lua "$URL/v1/workloads" | grep -E "Latency|50%|90%|99%|99.9%|Requests/sec|Non-2xx"
echo "== submissions, 64 connections, while 8 connections query the audit"
wrk -t1 -c8 -d12s --timeout 10s --latency -s ops/bench/get.lua "$AUDIT" >"$WORK/auditors.txt" &
AUDITORS=$!
wrk -t1 -c64 -d10s --timeout 10s --latency -s ops/bench/submit.lua "$URL/v1/workloads" | grep -E "Latency|50%|90%|99%|99.9%|Requests/sec|Non-2xx"
wait $AUDITORS
echo "   (the auditors meanwhile:)"; grep -E "99%|Requests/sec" "$WORK/auditors.txt"
echo "== resident after: $(ps -o rss= -p $SERVE) KB"
if [ "${SERVE_LOG:-}" = debug ]; then
  echo "== folds that held the projection over 40 ms: $( (grep "held the projection long" "$WORK/serve.log" || true) |
    grep -o "held_ms=[0-9]*" | cut -d= -f2 | sort -n | tr '\n' ' ')"
fi
kill $SERVE; wait $SERVE || true
echo "== audit verify of the whole log"
/usr/bin/time -f "%e s, %M KB max resident" $BIN audit verify --data "$WORK/data"
