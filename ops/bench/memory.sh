#!/usr/bin/env bash
# The server's memory with a long history and a queue. Serves a fresh copy of an imported and
# rebuilt ledger (WORK_DIR/data.clean, made from WORK_DIR/events.jsonl the first time; build
# that file as ops/bench/audit.sh does) and measures, with wrk, resident memory at start, with
# 50,000 submissions more waiting, and after 10 s more of 64 writers (with their rate), and how
# much the log's and the projection's files grew.
# Usage: ops/bench/memory.sh WORK_DIR [serve flags...]   (needs wrk; BIN=path/to/fairledger
#   measures that build instead of building this checkout's)
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=$1
shift
PORT=${PORT:-18080}
URL=http://127.0.0.1:$PORT
if [ -z "${BIN:-}" ]; then
  cargo build --release -p fairledger
  BIN=target/release/fairledger
fi
if [ ! -d "$WORK/data.clean" ]; then
  $BIN log import --data "$WORK/data.clean.tmp" "$WORK/events.jsonl"
  $BIN project --once --data "$WORK/data.clean.tmp"
  mv "$WORK/data.clean.tmp" "$WORK/data.clean"
fi
rm -rf "$WORK/data"
cp -r "$WORK/data.clean" "$WORK/data"
size() { du -sm "$WORK/data/$1" | cut -f1; }
log0=$(size log) projection0=$(size projection)
$BIN serve --data "$WORK/data" --config "$WORK/year/year.toml" --no-agents \
  --heartbeat-timeout-s 86400 --change-settings --listen "127.0.0.1:$PORT" "$@" 2>"$WORK/serve.log" &
SERVE=$!
trap 'kill $SERVE 2>/dev/null || true' EXIT
until curl -sf "$URL/readyz" >/dev/null; do sleep 0.05; done
export FAIRLEDGER_TOKEN=$(cat "$WORK/data/admin.token")
live() {
  curl -sf -H "Authorization: Bearer $FAIRLEDGER_TOKEN" "$URL/metrics" |
    awk '/^fairledger_workloads\{phase="live"\}/ {print $2}'
}
echo "== serve $*"
echo "resident at start: $(ps -o rss= -p $SERVE) KB, $(live) live"
FAIRLEDGER_BENCH_COUNT=50000 wrk -t1 -c64 -d60s -s ops/bench/submit.lua "$URL/v1/workloads" >/dev/null
sleep 2
echo "after 50,000 submissions: $(ps -o rss= -p $SERVE) KB, $(live) live"
wrk -t1 -c64 -d10s --latency -s ops/bench/submit.lua "$URL/v1/workloads" |
  grep -E "Requests/sec| 99%" | tr -s ' ' | tr '\n' ' '
echo
echo "after 10 s more: $(ps -o rss= -p $SERVE) KB, $(live) live"
kill $SERVE
wait $SERVE || true
echo "files grew: log $(($(size log) - log0)) MB, projection $(($(size projection) - projection0)) MB"
