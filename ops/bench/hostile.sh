#!/usr/bin/env bash
# What careless and hostile clients cost the writers: submissions measured with wrk against the
# release `fairledger serve` (embedded log, ops/cluster.toml, no agents) on a log of ~100,000
# events, alone, then beside 200 event streams replaying that log from its start, then beside
# 1,000 connections that say nothing.
#
# Usage: ops/bench/hostile.sh [WORK_DIR]   (needs wrk, curl, python3; builds the release binary)
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=${1:-$(mktemp -d)}
PORT=${FAIRLEDGER_BENCH_PORT:-18090}
URL="http://127.0.0.1:$PORT"
BIN=target/release/fairledger
cargo build --release -p fairledger >/dev/null
rm -rf "$WORK/data"
mkdir -p "$WORK"
export FAIRLEDGER_BENCH_ALLOCATION=ai2/tulu
$BIN serve --data "$WORK/data" --config ops/cluster.toml --no-agents \
  --heartbeat-timeout-s 86400 --listen "127.0.0.1:$PORT" 2>"$WORK/serve.log" &
SERVER=$!
STREAMS=()
cleanup() {
  for p in "${STREAMS[@]}"; do kill "$p" 2>/dev/null || true; done
  kill "$SERVER" 2>/dev/null || true
  wait 2>/dev/null || true
}
trap cleanup EXIT
for _ in $(seq 100); do curl -sf "$URL/readyz" >/dev/null && break; sleep 0.2; done
export FAIRLEDGER_TOKEN=$(cat "$WORK/data/admin.token")
submit() { wrk -t1 -c64 -d"$1" --latency -s ops/bench/submit.lua "$URL/v1/workloads" | grep -E "50%|99%|Requests/sec|Non-2xx" | tr -s ' ' | paste -sd' '; }
echo "fill: $(submit 8s)"
echo "events in the log: $(curl -s "$URL/metrics" | grep '^fairledger_projection_last_seq' | cut -d' ' -f2)"
echo "alone: $(submit 10s)"
for _ in $(seq 200); do
  curl -sN -H "authorization: Bearer $FAIRLEDGER_TOKEN" -H "Last-Event-ID: 0" "$URL/v1/events/stream" >/dev/null &
  STREAMS+=($!)
done
sleep 1
echo "beside 200 replays: $(submit 10s)"
for p in "${STREAMS[@]}"; do kill "$p" 2>/dev/null || true; done
STREAMS=()
python3 - "$PORT" <<'PY' &
import socket, sys, time
held = [socket.create_connection(("127.0.0.1", int(sys.argv[1]))) for _ in range(1000)]
time.sleep(12)
PY
STREAMS+=($!)
sleep 1
echo "beside 1,000 silent connections: $(submit 10s)"
