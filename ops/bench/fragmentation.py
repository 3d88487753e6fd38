#!/usr/bin/env python3
"""Writes the two fragmentation scenarios of BENCHMARKS.md ("Fragmentation") as a scenario.toml
and a native workloads.csv each, seeded, so `fairledger sim` can replay them.

Usage: fragmentation.py OUT_DIR [--seed N] [--mean-hours H] [--policy-lines FILE|default]

- OUT_DIR/three-teams: 128 nodes x 8 GPUs, a/x : a/y : b/z weighted 1:2:1, 33,000 jobs of 1, 1,
  2, 4 or 8 GPUs on one node, about 1.27x offered load, 11,000 jobs per team, exponential run
  times (mean 4 h). Whole-node work of an under-served team behind an over-served sibling's
  small jobs.
- OUT_DIR/fifteen-teams: 24 nodes x 8 GPUs, 15 teams of very unequal size, 13,716 jobs over
  250 days, mostly 1-GPU with a tail of whole-node jobs, arrivals in bursts of 1.3x
  oversubscription and lulls, heavy-tailed run times, no duration estimates.
"""
import math
import os
import random
import sys


# What `[policy]` says beyond its name: the settings of BENCHMARKS.md's fragmentation sections
# unless --policy-lines says otherwise ("default": none, the scheduler's defaults).
POLICY = "margin = 0.05\nreservations = 4\ndefragment = true\n"


def write(out, name, nodes, allocations, rows):
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "scenario.toml"), "w") as f:
        f.write(f'[policy]\nname = "fairshare"\n{POLICY}\n')
        f.write(f'[[nodes]]\ncount = {nodes}\ngpus = 8\nmodel = "H100"\n')
        for path, weight in allocations:
            f.write(f'\n[[allocations]]\npath = "{path}"\nweight = {weight}\n')
    rows.sort(key=lambda r: (r[2], r[0]))
    with open(os.path.join(d, "workloads.csv"), "w") as f:
        f.write("id,allocation,submit_s,duration_s,gpus\n")
        for job_id, alloc, submit, duration, gpus in rows:
            f.write(f"{job_id},{alloc},{submit},{duration},{gpus}\n")
    last = max(r[2] for r in rows)
    offered = sum(r[3] * r[4] for r in rows) / (nodes * 8 * last)
    print(f"{d}: {len(rows)} jobs, last submission at {last} s, offered load {offered:.3f}")


def three_teams(out, rng, mean_hours):
    jobs_per_team, mean_s, load, gpus = 11_000, mean_hours * 3600, 1.27, 128 * 8
    shapes = [1, 1, 2, 4, 8]
    span = 3 * jobs_per_team * (sum(shapes) / len(shapes)) * mean_s / (load * gpus)
    rows = []
    for team in ["a/x", "a/y", "b/z"]:
        for i in range(jobs_per_team):
            submit = int(rng.uniform(0, span))
            duration = max(60, int(rng.expovariate(1 / mean_s)))
            rows.append((f"{team.replace('/', '-')}-{i}", team, submit, duration, rng.choice(shapes)))
    write(out, "three-teams", 128, [("a/x", 1), ("a/y", 2), ("b/z", 1)], rows)


def fifteen_teams(out, rng):
    jobs, days, gpus = 13_716, 250, 24 * 8
    weights = [20, 12, 8, 6, 5, 4, 3, 3, 2, 2, 1, 1, 1, 1, 1]
    teams = [f"t{i:02d}" for i in range(len(weights))]
    # Each team's demand: its weight, give or take half.
    demand = [w * rng.uniform(0.5, 1.5) for w in weights]
    shapes, shape_p = [1, 2, 4, 8], [0.8, 0.08, 0.06, 0.06]
    mean_gpus = sum(s * p for s, p in zip(shapes, shape_p))
    # Lognormal run times, sigma 1.5, with the mean that makes the whole trace offer a load of
    # about 1.0: bursts of 1.3x for a day, lulls of 0.7x for a day.
    sigma = 1.2
    # (1.15: the 14-day cap on a run cuts the tail.)
    mean_s = 1.15 * gpus * days * 86400 / (jobs * mean_gpus)
    mu = math.log(mean_s) - sigma * sigma / 2
    # Arrival times: a day at 1.3x the mean rate, a day at 0.7x, alternately.
    rows, t = [], 0.0
    base = jobs / (days * 86400)
    while len(rows) < jobs:
        rate = base * (1.3 if int(t // 86400) % 2 == 0 else 0.7)
        t += rng.expovariate(rate)
        team = rng.choices(range(len(teams)), weights=demand)[0]
        g = rng.choices(shapes, weights=shape_p)[0]
        duration = max(60, min(14 * 86400, int(rng.lognormvariate(mu, sigma))))
        rows.append((f"{teams[team]}-{len(rows)}", teams[team], int(t), duration, g))
    write(out, "fifteen-teams", 24, list(zip(teams, weights)), rows)


def main():
    global POLICY
    args = sys.argv[1:]
    if not args or args[0].startswith("-"):
        sys.exit("usage: fragmentation.py OUT_DIR [--seed N] [--mean-hours H] [--policy-lines FILE|default]")
    option = lambda name, default: args[args.index(name) + 1] if name in args else default
    seed = int(option("--seed", 1))
    mean_hours = float(option("--mean-hours", 4))
    lines = option("--policy-lines", None)
    if lines == "default":
        POLICY = ""
    elif lines is not None:
        with open(lines) as f:
            POLICY = f.read()
    print(f"seed {seed}, three teams' mean run {mean_hours} h")
    three_teams(args[0], random.Random(seed), mean_hours)
    fifteen_teams(args[0], random.Random(seed))


if __name__ == "__main__":
    main()
