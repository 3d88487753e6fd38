#!/usr/bin/env python3
"""Moves a ledger (JSON lines, one envelope a line) in time so that its last event happened
an hour before now: a simulated ledger (which starts at the epoch) then reads as recent history.
Usage: shift.py IN OUT"""
import json
import sys
import time

src, dst = sys.argv[1], sys.argv[2]
last = 0
with open(src) as f:
    for line in f:
        if line.strip():
            last = max(last, json.loads(line)["occurred_at_ms"])
offset = int(time.time() * 1000) - 3_600_000 - last
offset -= offset % 3_600_000  # keep the events' positions within their hours
with open(src) as f, open(dst, "w") as out:
    for line in f:
        if not line.strip():
            continue
        env = json.loads(line)
        env["occurred_at_ms"] += offset
        payload = env.get("payload") or {}
        if "protected_until_ms" in payload:
            payload["protected_until_ms"] += offset
        out.write(json.dumps(env, separators=(",", ":")) + "\n")
print(f"shifted by {offset} ms", file=sys.stderr)
