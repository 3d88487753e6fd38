#!/usr/bin/env python3
"""Reads a simulated (or live) ledger's events.jsonl and prints what its preemptions cost, in the
terms of BENCHMARKS.md's "Fair without churn": preemption requests by reason, the preemptions
per workload (max, p99, how many workloads more than 3 times), reclaims that went to the
reservation that lent the GPUs against those that went to anyone else, fair-share preemptions
that reverse one between the same two allocations within a day, one-GPU jobs preempted for
one-GPU jobs, the GPU-hours a preempted run would redo if it restarted from its start (no
checkpoint) against what the ledger's requeues say was lost, and what became of the room made:
for every beneficiary whose victims have all left, whether it started at that instant, later,
or had started elsewhere before they left (the preemption bought it nothing).

Usage: churn.py EVENTS_JSONL [--json]
"""
import json
import sys
from collections import Counter, defaultdict

DAY_MS = 86_400_000


def main():
    args = sys.argv[1:]
    if not args or args[0].startswith("-"):
        sys.exit(__doc__)
    alloc, gpus = {}, {}
    run = {}  # workload -> (start ms, borrowed reserved_for or None)
    pending = set()
    preempting = {}  # workload -> (requested ms, reason)
    by_reason = Counter()
    per_workload = Counter()
    reclaim_lender = reclaim_other = reclaim_other_lender_waiting = 0
    last_pair = {}  # (beneficiary alloc, victim alloc) -> ms of the last fair-share preemption
    reversals = 0
    one_for_one = 0
    redone_restart_ms = 0
    lost_reported_ms = 0
    grace_ms = 0
    # What became of the room made, per beneficiary and round of victims.
    leaving_for = defaultdict(set)  # beneficiary -> victims still leaving
    asked_for = {}  # victim -> beneficiary
    round_at = {}  # beneficiary -> when its current round was asked
    last_start = {}  # workload -> its last start
    room_made_at = {}  # beneficiary -> when its last victim left
    room = Counter()
    with open(args[0]) as f:
        for line in f:
            e = json.loads(line)
            t, kind, p = e["occurred_at_ms"], e["type"], e.get("payload") or {}
            if kind == "workload_submitted":
                w = p["workload"]
                alloc[w] = p.get("allocation")
                gpus[w] = p["gpus_per_node"] * p.get("nodes", 1)
                pending.add(w)
            elif kind == "workload_started":
                w = p["workload"]
                b = p.get("borrowed")
                run[w] = (t, b["reserved_for"] if b else None)
                pending.discard(w)
                last_start[w] = t
                if w in room_made_at:
                    room["started_at_once" if t == room_made_at.pop(w) else "started_later"] += 1
            elif kind == "preemption_requested":
                reason = p["reason"]
                if reason == "user_cancelled":
                    continue
                w, ben = p["workload"], p.get("beneficiary")
                if ben is not None:
                    if not leaving_for[ben]:
                        round_at[ben] = t
                    leaving_for[ben].add(w)
                    asked_for[w] = ben
                by_reason[reason] += 1
                per_workload[w] += 1
                preempting[w] = (t, reason)
                if reason == "reclaimed":
                    lender = run.get(w, (0, None))[1]
                    if lender is not None and lender == ben:
                        reclaim_lender += 1
                    else:
                        reclaim_other += 1
                        if lender in pending:
                            reclaim_other_lender_waiting += 1
                if reason == "fair_share" and ben in alloc:
                    pair = (alloc[ben], alloc.get(w))
                    back = last_pair.get((pair[1], pair[0]))
                    if back is not None and t - back <= DAY_MS:
                        reversals += 1
                    last_pair[pair] = t
                if ben in gpus and gpus.get(w) == 1 and gpus[ben] == 1:
                    one_for_one += 1
            elif kind == "workload_stopped":
                w = p["workload"]
                ben = asked_for.pop(w, None)
                if ben is not None:
                    leaving_for[ben].discard(w)
                    if not leaving_for[ben]:
                        if last_start.get(ben, -1) >= round_at[ben]:
                            room["started_elsewhere_before"] += 1
                        else:
                            room_made_at[ben] = t
                if w in preempting and w in run:
                    asked, _ = preempting.pop(w)
                    grace_ms += (t - asked) * gpus.get(w, 0)
                    redone_restart_ms += (t - run[w][0]) * gpus.get(w, 0)
                run.pop(w, None)
            elif kind == "workload_requeued":
                w = p["workload"]
                lost_reported_ms += p.get("work_lost_s", 0) * 1000 * gpus.get(w, 0)
                pending.add(w)
            elif kind in ("workload_finished", "workload_cancelled"):
                run.pop(p["workload"], None)
                pending.discard(p["workload"])
    counts = sorted(per_workload.values())
    preempted = len(counts)
    p99 = 0
    if counts:
        # Over every workload submitted, preempted or not.
        every = [0] * (len(alloc) - preempted) + counts
        p99 = every[min(len(every) - 1, int(0.99 * len(every)))]
    out = {
        "preemption_requests": sum(by_reason.values()),
        "by_reason": dict(sorted(by_reason.items())),
        "workloads_preempted": preempted,
        "preemptions_per_workload_max": counts[-1] if counts else 0,
        "preemptions_per_workload_p99": p99,
        "workloads_preempted_more_than_3": sum(1 for c in counts if c > 3),
        "reclaims_for_lender": reclaim_lender,
        "reclaims_for_another": reclaim_other,
        "reclaims_for_another_while_lender_waited": reclaim_other_lender_waiting,
        "fair_share_reversals_within_a_day": reversals,
        "one_gpu_for_one_gpu": one_for_one,
        "gpu_hours_in_grace": round(grace_ms / 3.6e6, 1),
        "gpu_hours_redone_if_restarted_from_start": round(redone_restart_ms / 3.6e6, 1),
        "gpu_hours_lost_as_reported": round(lost_reported_ms / 3.6e6, 1),
        "room_made_started_at_once": room["started_at_once"],
        "room_made_started_later": room["started_later"],
        "room_made_started_elsewhere_before": room["started_elsewhere_before"],
    }
    if "--json" in args:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:45} {v}")


if __name__ == "__main__":
    main()
