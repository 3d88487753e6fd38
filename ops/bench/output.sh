#!/usr/bin/env bash
# How soon does a line a job writes reach `fairledger logs -f` on a laptop, and how fast is a
# chatty job's output shipped? Starts the demo (`fairledger serve`, embedded log, its own agents)
# on loopback, then:
#  1. a job that prints its clock every 0.2 s for 10 s, followed by `fairledger logs -f`: each
#     line's delay from its writing to its reading (p50, max);
#  2. a job that writes MB megabytes as fast as it can: the time from its end until all of it
#     (or, past the service's bound, its newest 16 MiB) reads back, and how much reads back.
#   bash ops/bench/output.sh [path/to/fairledger] [MB]
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
bin="${1:-$here/target/release/fairledger}"
mb="${2:-64}"
work="$(mktemp -d)"
api=$((20000 + RANDOM % 20000))
serve_pid=""
cleanup() { kill $serve_pid 2>/dev/null || true; sleep 1; kill -9 $serve_pid 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
"$bin" serve --data "$work/data" --listen "127.0.0.1:$api" >"$work/serve.log" 2>&1 &
serve_pid=$!
for _ in $(seq 300); do [ -f "$work/data/admin.token" ] && curl -fs -o /dev/null "http://127.0.0.1:$api/readyz" && break; sleep 0.1; done
export FAIRLEDGER_API="http://127.0.0.1:$api" FAIRLEDGER_TOKEN="$(cat "$work/data/admin.token")"
submit() { "$bin" submit --json -a ai2/tulu -g 1 -- "$@" | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])'; }

id=$(submit sh -c 'for i in $(seq 50); do date +%s.%N; sleep 0.2; done')
"$bin" logs -f "$id" | while read -r t; do echo "$t $(date +%s.%N)"; done >"$work/lines"
python3 - "$work/lines" <<'PY'
import sys, statistics
d = [ (float(b) - float(a)) * 1000 for a, b in (l.split() for l in open(sys.argv[1])) ]
print(f"1. {len(d)} lines followed: delay from written to read p50 {statistics.median(d):.0f} ms, max {max(d):.0f} ms")
PY

id=$(submit sh -c "head -c $((mb * 1048576)) /dev/zero | tr '\\0' 'x' | fold -w 99")
for _ in $(seq 600); do
    [ "$("$bin" status --json "$id" | python3 -c 'import json,sys; print(json.load(sys.stdin)["phase"])')" = finished ] && break
    sleep 0.1
done
t0=$(date +%s.%N)
for _ in $(seq 600); do
    ended=$(curl -s -o /dev/null -D - -H "authorization: Bearer $FAIRLEDGER_TOKEN" "$FAIRLEDGER_API/v1/workloads/$id/logs?tail=0" | tr -d '\r' | awk -F': ' '/^fairledger-ended/ {print $2}')
    [ "$ended" = true ] && break
    sleep 0.2
done
t1=$(date +%s.%N)
bytes=$("$bin" logs "$id" 2>/dev/null | wc -c)
printf '2. %d MB written: all shipped %.1f s after the job ended; %d bytes read back (the newest; the first %s bytes not kept)\n' \
    "$mb" "$(echo "$t1 - $t0" | bc)" "$bytes" \
    "$(curl -s -o /dev/null -D - -H "authorization: Bearer $FAIRLEDGER_TOKEN" "$FAIRLEDGER_API/v1/workloads/$id/logs" | tr -d '\r' | awk -F': ' '/^fairledger-dropped/ {print $2}')"
