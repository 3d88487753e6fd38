//! Simulator throughput: the bundled real trace, and a generated year on 10,000 GPUs.
//!
//! `cargo bench -p sim --bench year` runs both and prints simulated seconds per wall second,
//! events per second and a fingerprint of the ledger each run wrote.
//! `FAIRLEDGER_BENCH_WORKLOADS=N` sets the generated trace's size (default 1,000,000 over a
//! simulated year; fewer workloads keep the same load by shortening the year).
//! `FAIRLEDGER_BENCH_LOAD=X` scales run times so the offered load is X of the cluster (by
//! default about 1.13: the queue grows all year; below 1 it stays short).
//! `FAIRLEDGER_BENCH_KEEP=DIR` keeps the generated year's scenario, trace and `events.jsonl` in
//! DIR (the ledger the audit benchmark imports, see BENCHMARKS.md).

use std::io::Write;

// The allocator the `fairledger` binary runs (and so simulates) with.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
use std::path::Path;
use std::time::Instant;

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use sim::scenario::Scenario;
use sim::trace::{Format, TraceOptions};

fn run(
    name: &str,
    scenario: &Path,
    workloads: &Path,
    format: Format,
    until_s: Option<u64>,
    keep: Option<&Path>,
) {
    let out = tempfile::tempdir().unwrap();
    let out = keep.map_or_else(|| out.path().to_path_buf(), Path::to_path_buf);
    let spec = sim::RunSpec {
        scenario: Scenario::load(scenario).unwrap().prepare(None).unwrap(),
        workloads: workloads.to_path_buf(),
        trace: TraceOptions {
            format,
            skip_bad_rows: false,
            allocation_column: None,
        },
        seed: 1,
        work_model: sim::WorkModel::default(),
        until_s,
        out: out.clone(),
    };
    let t = Instant::now();
    let r = sim::run(&spec, |_| {}).unwrap().report;
    let wall = t.elapsed().as_secs_f64();
    // Two builds that print the same fingerprint made the same decisions: how a change meant
    // only to be faster is checked to change nothing else.
    let fingerprint = {
        use std::hash::Hasher;
        let bytes = std::fs::read(out.join("events.jsonl")).unwrap();
        let mut h = std::collections::hash_map::DefaultHasher::new();
        h.write(&bytes);
        format!("{:016x} ({} bytes)", h.finish(), bytes.len())
    };
    println!(
        "{name}: {} workloads, {} events, {:.0} simulated s in {wall:.2} s wall ({:.2} s simulating, the rest drawing the report): {:.0} simulated s per wall s, {:.0} events/s; delivered/owed {:.3}, {} preemptions; events.jsonl fingerprint {fingerprint}",
        r.workloads.submitted,
        r.sim.events,
        r.sim.horizon_s,
        r.sim.wall_s,
        r.sim.horizon_s / wall,
        r.sim.events as f64 / wall,
        r.fairness.delivered_over_owed,
        r.workloads.preemptions
    );
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    run(
        "alibaba 2023 trace on 32 GPUs",
        &root.join("scenarios/alibaba-32gpu.toml"),
        &root.join("traces/alibaba2023/openb_pod_list_default.csv"),
        Format::AlibabaOpenb,
        None,
        None,
    );

    // A year of 1M workloads on 1,250 x 8 = 10,000 GPUs, 30 leaf allocations, offered load about
    // 113% of the cluster: 1 to 8 GPUs and some 2- and 4-node gangs, log-uniform run times from
    // 13 minutes to 2.6 days.
    let n: u64 = std::env::var("FAIRLEDGER_BENCH_WORKLOADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1_000_000);
    let year_s = 365 * 86_400 * n / 1_000_000;
    let keep = std::env::var_os("FAIRLEDGER_BENCH_KEEP").map(std::path::PathBuf::from);
    let temp = tempfile::tempdir().unwrap();
    let dir = keep.clone().unwrap_or_else(|| temp.path().to_path_buf());
    std::fs::create_dir_all(&dir).unwrap();
    let scenario = dir.join("year.toml");
    let mut toml = String::from(
        "[policy]\nname = \"fairshare\"\n\n[[nodes]]\ncount = 1250\ngpus = 8\nmodel = \"H100\"\n",
    );
    let mut leaves = Vec::new();
    for o in 0..3 {
        for t in 0..10 {
            leaves.push(format!("org{o}/team{t}"));
            toml += &format!(
                "\n[[allocations]]\npath = \"org{o}/team{t}\"\nweight = {}\n",
                1 + (t % 3)
            );
        }
    }
    std::fs::write(&scenario, toml).unwrap();
    let trace = dir.join("year.csv");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&trace).unwrap());
    writeln!(f, "id,allocation,submit_s,duration_s,gpus,nodes").unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(42);
    let mut times: Vec<u64> = (0..n).map(|_| rng.random_range(0..year_s)).collect();
    times.sort_unstable();
    let mut rows = Vec::with_capacity(times.len());
    let mut gpu_s = 0.0;
    for t in times {
        let (gpus, nodes) = [
            (1, 1),
            (1, 1),
            (2, 1),
            (4, 1),
            (8, 1),
            (8, 1),
            (8, 2),
            (8, 4),
        ][rng.random_range(0..8)];
        let duration =
            1.3 * (600.0f64.ln() + rng.random_range(0.0..1.0) * (172_800.0f64 / 600.0).ln()).exp();
        gpu_s += duration * f64::from(gpus * nodes);
        rows.push((t, duration, gpus, nodes, rng.random_range(0..leaves.len())));
    }
    // Run times as drawn offer about 1.13 of the cluster; FAIRLEDGER_BENCH_LOAD scales them to
    // offer what it says instead.
    let offered = gpu_s / (10_000.0 * year_s as f64);
    let scale = std::env::var("FAIRLEDGER_BENCH_LOAD")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .map_or(1.0, |load| load / offered);
    for (i, (t, duration, gpus, nodes, leaf)) in rows.into_iter().enumerate() {
        let duration = duration * scale;
        writeln!(f, "w{i},{},{t},{duration:.0},{gpus},{nodes}", leaves[leaf]).unwrap();
    }
    f.flush().unwrap();
    drop(f);
    println!(
        "generated: {n} workloads over {year_s} s, offered load {:.2} of 10,000 GPUs",
        offered * scale
    );
    run(
        "generated year on 10,000 GPUs",
        &scenario,
        &trace,
        Format::Native,
        Some(year_s),
        keep.as_deref(),
    );
}
