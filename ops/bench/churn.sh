#!/usr/bin/env bash
# The churn benchmark of BENCHMARKS.md ("Fair without churn"): the fifteen-team trace without
# estimates and the three-team tree of mixed shapes (mean run 1 h, 82 h of submissions, then
# drain), both under the scheduler's default policy, and the bundled Alibaba trace; for each,
# delivered/owed (overall and the worst team), the preemptions by reason, per workload and
# whom reclaims went to, and what they cost.
#
# Usage: ops/bench/churn.sh WORK_DIR [FAIRLEDGER_BINARY] [--seed N]
# (the binary defaults to target/release/fairledger; build it first with
# `cargo build --release -p fairledger`). Extra `[policy]` lines for every scenario may be given
# in CHURN_POLICY, e.g. CHURN_POLICY='reservations = 1'.
set -euo pipefail
cd "$(dirname "$0")/../.."
work="${1:?usage: churn.sh WORK_DIR [FAIRLEDGER_BINARY] [--seed N]}"
bin="${2:-target/release/fairledger}"
seed=1
if [ "${3:-}" = "--seed" ]; then seed="${4:?--seed takes a number}"; fi
mkdir -p "$work"
python3 ops/bench/fragmentation.py "$work/scenarios" --seed "$seed" --mean-hours 1 \
    --policy-lines default >/dev/null
alibaba="$work/scenarios/alibaba"
mkdir -p "$alibaba"
cp services/sim/scenarios/alibaba-32gpu.toml "$alibaba/scenario.toml"
if [ -n "${CHURN_POLICY:-}" ]; then
    for s in "$work"/scenarios/*/scenario.toml; do
        python3 - "$s" "$CHURN_POLICY" <<'PY'
import sys
path, lines = sys.argv[1], sys.argv[2]
text = open(path).read()
open(path, "w").write(text.replace("[policy]\n", "[policy]\n" + lines + "\n", 1))
PY
    done
fi

# The three teams' last submission, to report the submission period apart from the drain.
last=$(tail -n +2 "$work/scenarios/three-teams/workloads.csv" | cut -d, -f3 | sort -n | tail -1)
run() { # name scenario-dir extra-args...
    local name=$1 dir=$2
    shift 2
    local out="$work/out/$name"
    local t0 t1
    t0=$(date +%s.%N)
    "$bin" sim --scenario "$dir/scenario.toml" "$@" --out "$out" >/dev/null
    t1=$(date +%s.%N)
    python3 - "$name" "$out" "$t0" "$t1" <<'PY'
import json, subprocess, sys
name, out, t0, t1 = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
r = json.load(open(out + "/report.json"))
ratios = {a["path"]: a["delivered_gpu_hours"] / a["owed_gpu_hours"]
          for a in r["allocations"] if a["owed_gpu_hours"] > 0}
worst = min(ratios, key=ratios.get)
c = json.loads(subprocess.run(["python3", "ops/bench/churn.py", out + "/events.jsonl", "--json"],
                              capture_output=True, text=True, check=True).stdout)
teams = " ".join(f"{p} {v:.3f}" for p, v in sorted(ratios.items())) if len(ratios) <= 4 else ""
print(f"{name:22} delivered/owed {r['fairness']['delivered_over_owed']:.4f}, worst {worst} "
      f"{ratios[worst]:.3f}; {c['preemption_requests']} preemption requests {c['by_reason']}; "
      f"per workload max {c['preemptions_per_workload_max']}, p99 {c['preemptions_per_workload_p99']}, "
      f"{c['workloads_preempted_more_than_3']} more than 3 times; reclaims for the lender "
      f"{c['reclaims_for_lender']}, for another {c['reclaims_for_another']}; "
      f"{c['fair_share_reversals_within_a_day']} fair-share reversals within a day; "
      f"room made: started at once {c['room_made_started_at_once']}, later "
      f"{c['room_made_started_later']}, elsewhere before {c['room_made_started_elsewhere_before']}; "
      f"{c['gpu_hours_in_grace']} GPU-h in grace, {c['gpu_hours_redone_if_restarted_from_start']} "
      f"GPU-h redone if restarted from the start; "
      f"{r['workloads']['contract_violations']} contract violations; {t1 - t0:.1f} s. {teams}")
PY
}
s="$work/scenarios"
run fifteen-teams "$s/fifteen-teams" --workloads "$s/fifteen-teams/workloads.csv"
run three-teams-period "$s/three-teams" --workloads "$s/three-teams/workloads.csv" --until "$last"
run three-teams-drain "$s/three-teams" --workloads "$s/three-teams/workloads.csv"
run alibaba "$alibaba" --workloads services/sim/traces/alibaba2023/openb_pod_list_default.csv \
    --format alibaba-openb
