#!/usr/bin/env bash
# How long do submissions go unacknowledged when the LEDGER stream's leader dies?
# Starts a 3-node JetStream cluster and `fairledger serve --replicas 3` on loopback, with CLIENTS
# shells submitting 1-GPU workloads in a loop (each retrying its Idempotency-Key until answered
# 202), then ROUNDS times: finds the stream's leader (monitoring /jsz), SIGKILLs it, waits until
# ACKS more submissions are acknowledged, starts the node again and lets it catch up. Prints per
# round the longest time without an acknowledgement after the kill, then p50/p90/max.
#   bash ops/bench/failover.sh [path/to/fairledger] [rounds] [clients]
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
bin="${1:-$here/target/release/fairledger}"
rounds="${2:-20}"
clients="${3:-4}"
nats="$(bash "$here/ops/nats-server.sh")"
work="$(mktemp -d)"
base=$((20000 + RANDOM % 20000))
pids=(); nats_pids=(0 0 0); serve_pid=""
cleanup() {
    { kill -9 "${pids[@]}" "${nats_pids[@]}" $serve_pid; wait; } 2>/dev/null || true
    [ -n "${KEEP:-}" ] && echo "kept $work" >&2 || rm -rf "$work"
}
trap cleanup EXIT
client_port() { echo $((base + $1)); }
route_port() { echo $((base + 10 + $1)); }
mon_port() { echo $((base + 20 + $1)); }
routes="$(for i in 0 1 2; do printf '"nats://127.0.0.1:%s", ' "$(route_port $i)"; done)"
routes="${routes%, }"
for i in 0 1 2; do
    mkdir -p "$work/n$i"
    cat >"$work/n$i.conf" <<EOF
server_name: "n$((i + 1))"
listen: "127.0.0.1:$(client_port $i)"
http: "127.0.0.1:$(mon_port $i)"
jetstream { store_dir: "$work/n$i" }
cluster { name: "bench", listen: "127.0.0.1:$(route_port $i)", routes: [ $routes ] }
EOF
done
start_node() { "$nats" -c "$work/n$1.conf" >>"$work/n$1.log" 2>&1 & nats_pids[$1]=$!; }
for i in 0 1 2; do start_node $i; done
url="$(for i in 0 1 2; do printf 'nats://127.0.0.1:%s,' "$(client_port $i)"; done)"
api=$((base + 30))
"$bin" serve --nats "${url%,}" --replicas 3 --data "$work/data" --listen "127.0.0.1:$api" \
    --nats-wait-s 60 >"$work/serve.log" 2>&1 &
serve_pid=$!
for _ in $(seq 600); do [ -f "$work/data/admin.token" ] && curl -fs -o /dev/null "http://127.0.0.1:$api/readyz" && break; sleep 0.1; done
[ -f "$work/data/admin.token" ] || { echo "serve did not start:" >&2; cat "$work/serve.log" "$work/n0.log" >&2; exit 1; }
token="$(cat "$work/data/admin.token")"
call() { curl -s -m 10 -o /dev/null -w '%{http_code}' -H "authorization: Bearer $token" -H 'content-type: application/json' "$@"; }
call -X PUT -d '{"weight":1}' "http://127.0.0.1:$api/v1/allocations/team" >/dev/null
call -X POST -d '{"node":"gpu-1","gpus":8,"model":"H100"}' "http://127.0.0.1:$api/v1/nodes" >/dev/null
for c in $(seq "$clients"); do
    (
        n=0
        while :; do
            n=$((n + 1))
            until [[ "$(call -X POST -H "idempotency-key: c$c-$n" -d '{"allocation":"team","gpus_per_node":1}' "http://127.0.0.1:$api/v1/workloads")" == 20[02] ]]; do
                sleep 0.05
            done
            date +%s.%N >>"$work/acks.$c"
        done
    ) &
    pids+=($!)
done
acks() { cat "$work"/acks.* 2>/dev/null | wc -l; }
leader() {
    for i in 0 1 2; do
        curl -fs -m 2 "http://127.0.0.1:$(mon_port $i)/jsz?accounts=true&streams=true" 2>/dev/null |
            python3 -c 'import json,sys
d=json.load(sys.stdin)
for a in d.get("account_details",[]):
    for s in a.get("stream_detail",[]):
        if s["name"]=="LEDGER" and s.get("cluster",{}).get("leader"): print(s["cluster"]["leader"]); sys.exit()' && return
    done
}
sleep 3
gaps=()
for round in $(seq "$rounds"); do
    name="$(leader)"
    [ -n "$name" ] || { echo "no leader of LEDGER found; see $work" >&2; sleep 30; exit 1; }
    i=$((${name#n} - 1))
    before=$(acks)
    t0=$(date +%s.%N)
    kill -9 "${nats_pids[$i]}"; wait "${nats_pids[$i]}" 2>/dev/null || true
    for _ in $(seq 1200); do [ $(($(acks) - before)) -ge 200 ] && break; sleep 0.05; done
    # The outage clients saw (the longest time without an acknowledgement since the kill), when
    # a surviving node first logged the new leader, and the first acknowledgement after that.
    read -r gap elected after < <(python3 - "$t0" "$work" <<'PY'
import datetime, glob, re, sys
t0, work = float(sys.argv[1]), sys.argv[2]
acks = sorted(float(t) for f in glob.glob(work + "/acks.*") for t in open(f).read().split())
last, gap = t0, 0.0
for t in (t for t in acks if t > t0):
    gap, last = max(gap, t - last), t
elected = []
for f in glob.glob(work + "/n*.log"):
    for line in open(f, errors="replace"):
        if "new stream leader" in line and "LEDGER" in line:
            m = re.search(r"(\d{4}/\d\d/\d\d \d\d:\d\d:\d\d\.\d+)", line)
            at = datetime.datetime.strptime(m.group(1), "%Y/%m/%d %H:%M:%S.%f")
            at = at.replace(tzinfo=datetime.timezone.utc).timestamp()
            if at > t0:
                elected.append(at)
e = min(elected) if elected else float("nan")
first = min((t for t in acks if t > e), default=float("nan"))
print(f"{gap:.2f} {e - t0:.2f} {first - e:.2f}")
PY
)
    gaps+=("$gap")
    printf 'round %d: killed %s; new leader logged %s s later, first acknowledgement %s s after that; no acknowledgement for %s s\n' \
        "$round" "$name" "$elected" "$after" "$gap"
    start_node "$i"
    sleep 5
done
printf '%s\n' "${gaps[@]}" | sort -n | awk '{ v[NR] = $1 } END {
    printf "%d kills: p50 %.2f s, p90 %.2f s, max %.2f s\n", NR, v[int((NR + 1) / 2)], v[int(NR * 0.9 + 0.5)], v[NR] }'
