//! `report.html` and `compare.html`: self-contained pages (inline SVG, no network) a manager can
//! read. Charts are drawn with plotters; the page around them is plain HTML.
//!
//! The pictures are gathered by a [`Timeline`] from the ledger's events as the run folds them, so
//! they show what the ledger says (rejected events draw nothing) and memory stays bounded by the
//! picture, not by the trace:
//! - every GPU over time, coloured by the allocation holding it (Ai2's picture), downsampled to at
//!   most 120 rows of GPUs and 480 time bins, each cell showing its dominant holder;
//! - owed versus delivered GPU-hours per allocation;
//! - queue-wait CDFs per allocation;
//! - occupancy over time.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Once;

use ledger::event::Event;
use ledger::{Envelope, Outcome, State, WorkloadId};
use plotters::coord::ranged1d::{Ranged, ValueFormatter};
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use crate::report::Report;
use crate::scenario::Prepared;
use crate::SimError;

const ROWS_MAX: usize = 120;
const BINS: usize = 480;
const PALETTE: [(u8, u8, u8); 12] = [
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (188, 189, 34),
    (23, 190, 207),
    (174, 199, 232),
    (255, 187, 120),
    (152, 223, 138),
];
/// Colours of the policies in `compare.html`: dark and muted, unlike the allocations' palette,
/// so a policy is never read as an allocation.
const POLICY_PALETTE: [(u8, u8, u8); 6] = [
    (20, 20, 20),
    (0, 90, 110),
    (130, 40, 90),
    (110, 90, 0),
    (60, 60, 160),
    (0, 110, 50),
];
const OTHER: RGBColor = RGBColor(110, 110, 110);
const UNALLOCATED: RGBColor = RGBColor(60, 60, 60);
const IDLE: RGBColor = RGBColor(236, 236, 236);

/// A named, coloured line or set of dots.
type Series = (String, RGBColor, Vec<(f64, f64)>);

static FONT: Once = Once::new();

fn register_font() {
    FONT.call_once(|| {
        // Text is laid out with these metrics; the browser draws it with its own sans-serif.
        plotters::style::register_font(
            "sans-serif",
            FontStyle::Normal,
            include_bytes!("../assets/DejaVuSans.ttf"),
        )
        .unwrap_or_else(|_| panic!("the bundled font is valid"));
    });
}

fn svg_err(e: impl std::fmt::Display) -> SimError {
    SimError::Invalid(format!("drawing a chart failed: {e}"))
}

/// Colours of the allocations in the report's order; past the palette they share one.
fn colours(report: &Report) -> Vec<(String, RGBColor)> {
    let mut v: Vec<(String, RGBColor)> = report
        .allocations
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let c = PALETTE.get(i).map_or(OTHER, |&(r, g, b)| RGBColor(r, g, b));
            (a.path.clone(), c)
        })
        .collect();
    v.push(("(unallocated)".into(), UNALLOCATED));
    v
}

/// A duration of `seconds` as Slurm prints it: `HH:MM:SS`, with `D-` in front from a day on.
pub fn clock(seconds: u64) -> String {
    let (d, h, m, s) = (
        seconds / 86_400,
        seconds / 3_600 % 24,
        seconds / 60 % 60,
        seconds % 60,
    );
    if d > 0 {
        format!("{d}-{h:02}:{m:02}:{s:02}")
    } else {
        format!("{h:02}:{m:02}:{s:02}")
    }
}

fn hex(c: &RGBColor) -> String {
    format!("#{:02x}{:02x}{:02x}", c.0, c.1, c.2)
}

/// What the pictures need, gathered from the ledger's events as they are folded
/// ([`Timeline::observe`]). Time is cut into at most 480 bins: of `until / 480` when the run's
/// end is known, otherwise of a width that doubles (merging neighbours) whenever the run outgrows
/// them, so the picture covers the run in 240 to 480 bins.
pub struct Timeline {
    rows: usize,
    gpus_per_row: usize,
    bin_ms: f64,
    /// Bins drawn, once the run is over.
    bins: usize,
    /// `cells[(row * BINS + bin) * k + colour]`: GPU-milliseconds.
    cells: Vec<f32>,
    k: usize,
    busy: Vec<f64>,
    total_gpus: usize,
    /// Waits in hours by allocation, and by GPUs asked.
    waits_h: BTreeMap<String, BTreeMap<u64, Vec<f64>>>,
    until_ms: Option<f64>,
    first_gpu: BTreeMap<String, usize>,
    /// Colour of each leaf allocation, in the report's order (by path), read from the ledger
    /// at the first start.
    colour_of: Option<BTreeMap<String, usize>>,
    running: BTreeMap<WorkloadId, (usize, Vec<usize>, u64)>,
    submitted: BTreeMap<WorkloadId, (u64, Option<String>, u64)>,
}

impl Timeline {
    /// An empty picture of the scenario's cluster; `until_ms` is the end of the run, if known.
    pub fn new(scenario: &Prepared, until_ms: Option<u64>) -> Self {
        let k = PALETTE.len() + 2;
        let total_gpus: usize = scenario.nodes.iter().map(|n| n.1 as usize).sum();
        let mut first_gpu: BTreeMap<String, usize> = BTreeMap::new();
        let mut next = 0;
        for (name, gpus) in &scenario.nodes {
            first_gpu.insert(name.clone(), next);
            next += *gpus as usize;
        }
        let rows = total_gpus.clamp(1, ROWS_MAX);
        let gpus_per_row = total_gpus.div_ceil(rows).max(1);
        let rows = total_gpus.div_ceil(gpus_per_row).max(1);
        let until_ms = until_ms.map(|u| (u as f64).max(1.0));
        Timeline {
            rows,
            gpus_per_row,
            // Without a known end, start at one second a bin and double as needed.
            bin_ms: until_ms.map_or(1000.0, |u| u / BINS as f64),
            bins: BINS,
            cells: vec![0.0; rows * BINS * k],
            k,
            busy: vec![0.0; BINS],
            total_gpus,
            waits_h: BTreeMap::new(),
            until_ms,
            first_gpu,
            colour_of: None,
            running: BTreeMap::new(),
            submitted: BTreeMap::new(),
        }
    }

    /// Takes in one event and its outcome, after the fold.
    pub fn observe(&mut self, state: &State, env: &Envelope, outcome: &Outcome) {
        if *outcome != Outcome::Applied {
            return;
        }
        let at = env.occurred_at_ms;
        match &env.event {
            Event::WorkloadSubmitted(s) => {
                let gpus = u64::from(s.gpus_per_node) * u64::from(s.nodes);
                self.submitted
                    .insert(s.workload, (at, s.allocation.clone(), gpus));
            }
            Event::WorkloadStarted(s) => {
                let colour_of = self.colour_of.get_or_insert_with(|| {
                    let mut leaves: Vec<&str> = state
                        .allocations()
                        .nodes
                        .iter()
                        .filter(|a| !a.removed && a.is_leaf())
                        .map(|a| a.path.as_str())
                        .collect();
                    leaves.sort_unstable();
                    leaves
                        .into_iter()
                        .enumerate()
                        .map(|(i, p)| (p.to_string(), i.min(PALETTE.len())))
                        .collect()
                });
                let colour = state
                    .workloads()
                    .get(&s.workload)
                    .and_then(|w| w.allocation)
                    .map_or(PALETTE.len() + 1, |a| {
                        let path = &state.allocations().node(a).path;
                        colour_of.get(path).copied().unwrap_or(PALETTE.len())
                    });
                let gpus = s
                    .placement
                    .iter()
                    .flat_map(|p| {
                        let first = self.first_gpu.get(&p.node).copied().unwrap_or(0);
                        p.gpus.iter().map(move |&g| first + g as usize)
                    })
                    .collect();
                self.running.insert(s.workload, (colour, gpus, at));
                if let Some((submit, Some(path), gpus)) = self.submitted.remove(&s.workload) {
                    self.waits_h
                        .entry(path)
                        .or_default()
                        .entry(gpus)
                        .or_default()
                        .push((at - submit) as f64 / 3_600_000.0);
                }
            }
            Event::WorkloadStopped(ledger::event::WorkloadStopped { workload, .. })
            | Event::WorkloadFinished(ledger::event::WorkloadFinished { workload, .. }) => {
                if let Some((c, gpus, from)) = self.running.remove(workload) {
                    self.add(c, &gpus, from, at as f64);
                }
            }
            Event::WorkloadCancelled(e) => {
                self.submitted.remove(&e.workload);
            }
            _ => {}
        }
    }

    /// Doubles the width of the bins, merging neighbours.
    fn coarsen(&mut self) {
        let k = self.k;
        for row in 0..self.rows {
            let cells = &mut self.cells[row * BINS * k..(row + 1) * BINS * k];
            for bin in 0..BINS / 2 {
                for c in 0..k {
                    cells[bin * k + c] = cells[2 * bin * k + c] + cells[(2 * bin + 1) * k + c];
                }
            }
            cells[BINS / 2 * k..].iter_mut().for_each(|v| *v = 0.0);
        }
        for bin in 0..BINS / 2 {
            self.busy[bin] = self.busy[2 * bin] + self.busy[2 * bin + 1];
        }
        self.busy[BINS / 2..].iter_mut().for_each(|v| *v = 0.0);
        self.bin_ms *= 2.0;
    }

    /// Adds a run of `colour` on `gpus` over `[from, to)`.
    fn add(&mut self, colour: usize, gpus: &[usize], from: u64, to: f64) {
        let to = self.until_ms.map_or(to, |u| to.min(u));
        while self.until_ms.is_none() && to > BINS as f64 * self.bin_ms {
            self.coarsen();
        }
        for &g in gpus {
            let row = g / self.gpus_per_row;
            let mut s = from as f64;
            while s < to {
                let bin = ((s / self.bin_ms) as usize).min(BINS - 1);
                let e = ((bin + 1) as f64 * self.bin_ms).min(to);
                let dt = (e - s).max(0.0);
                self.cells[(row * BINS + bin) * self.k + colour] += dt as f32;
                self.busy[bin] += dt;
                if e <= s {
                    break;
                }
                s = e;
            }
        }
    }

    /// Ends the picture at `horizon_ms`: work still running is drawn up to it.
    fn finish(&mut self, horizon_ms: f64) {
        let running = std::mem::take(&mut self.running);
        for (c, gpus, from) in running.into_values() {
            self.add(c, &gpus, from, horizon_ms);
        }
        let horizon_ms = horizon_ms.max(1.0);
        while self.until_ms.is_none() && horizon_ms > BINS as f64 * self.bin_ms {
            self.coarsen();
        }
        self.bins = ((horizon_ms / self.bin_ms).ceil() as usize).clamp(1, BINS);
    }

    /// Width of bin `bin`, the last one cut at `horizon_ms`.
    /// Whether unallocated work held any GPU.
    fn unallocated_ran(&self) -> bool {
        let k = self.k;
        self.cells.chunks(k).any(|cell| cell[k - 1] > 0.0)
    }

    fn width_ms(&self, bin: usize, horizon_ms: f64) -> f64 {
        let start = bin as f64 * self.bin_ms;
        ((start + self.bin_ms).min(horizon_ms.max(start + 1.0)) - start).max(1.0)
    }
}

fn timeline_svg(
    t: &Timeline,
    colours: &[(String, RGBColor)],
    horizon_h: f64,
) -> Result<String, SimError> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (960, 420)).into_drawing_area();
        root.fill(&WHITE).map_err(svg_err)?;
        let mut chart = ChartBuilder::on(&root)
            .margin(10)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(
                0.0..horizon_h.max(1e-9),
                0..(t.rows * t.gpus_per_row) as i32,
            )
            .map_err(svg_err)?;
        // Whole GPUs on the axis: a row is a whole number of them.
        chart
            .configure_mesh()
            .disable_mesh()
            .x_desc("hours")
            .y_desc("GPU")
            .y_labels(t.rows.clamp(2, 12))
            .draw()
            .map_err(svg_err)?;
        let horizon_ms = horizon_h * 3_600_000.0;
        let bin_h = t.bin_ms / 3_600_000.0;
        let mut rects = Vec::new();
        for row in 0..t.rows {
            // Run-length merge of equal dominant colours along the row.
            let mut run: Option<(usize, usize)> = None; // (colour or k for idle, first bin)
            for bin in 0..=t.bins {
                let here = (bin < t.bins).then(|| {
                    let cell = &t.cells[(row * BINS + bin) * t.k..(row * BINS + bin + 1) * t.k];
                    let (best, v) = cell.iter().enumerate().fold((t.k, 0.0f32), |acc, (i, &v)| {
                        if v > acc.1 {
                            (i, v)
                        } else {
                            acc
                        }
                    });
                    if (v as f64) < 0.5 * t.width_ms(bin, horizon_ms) {
                        t.k
                    } else {
                        best
                    }
                });
                match (run, here) {
                    (Some((c, _)), Some(h)) if c == h => {}
                    _ => {
                        if let Some((c, start)) = run {
                            let colour = if c == t.k {
                                IDLE
                            } else if c == t.k - 1 {
                                UNALLOCATED
                            } else {
                                colours.get(c).map_or(OTHER, |x| x.1)
                            };
                            let y0 = (row * t.gpus_per_row) as i32;
                            rects.push(Rectangle::new(
                                [
                                    (start as f64 * bin_h, y0),
                                    (
                                        (bin as f64 * bin_h).min(horizon_h),
                                        y0 + t.gpus_per_row as i32,
                                    ),
                                ],
                                colour.filled(),
                            ));
                        }
                        run = here.map(|h| (h, bin));
                    }
                }
            }
        }
        chart.draw_series(rects).map_err(svg_err)?;
        root.present().map_err(svg_err)?;
    }
    Ok(svg)
}

fn bars_svg(report: &Report, colours: &[(String, RGBColor)]) -> Result<String, SimError> {
    let mut svg = String::new();
    {
        let n = report.allocations.len().max(1) as i32;
        let top = report
            .allocations
            .iter()
            .map(|a| a.owed_gpu_hours.max(a.delivered_gpu_hours))
            .fold(1.0, f64::max)
            * 1.1;
        let root = SVGBackend::with_string(&mut svg, (960, 320)).into_drawing_area();
        root.fill(&WHITE).map_err(svg_err)?;
        let mut chart = ChartBuilder::on(&root)
            .margin(10)
            .x_label_area_size(36)
            .y_label_area_size(64)
            .build_cartesian_2d((0..n - 1).into_segmented(), 0.0..top)
            .map_err(svg_err)?;
        let labels: Vec<String> = report.allocations.iter().map(|a| a.path.clone()).collect();
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(n as usize)
            .x_label_formatter(&|v| match v {
                SegmentValue::CenterOf(i) => labels.get(*i as usize).cloned().unwrap_or_default(),
                _ => String::new(),
            })
            .y_desc("GPU-hours")
            .draw()
            .map_err(svg_err)?;
        let mut rects = Vec::new();
        for (i, a) in report.allocations.iter().enumerate() {
            let c = colours.get(i).map_or(OTHER, |x| x.1);
            let i = i as i32;
            // Owed on the left half of the allocation's slot, delivered on the right.
            rects.push(Rectangle::new(
                [
                    (SegmentValue::Exact(i), 0.0),
                    (SegmentValue::CenterOf(i), a.owed_gpu_hours),
                ],
                c.mix(0.35).filled(),
            ));
            rects.push(Rectangle::new(
                [
                    (SegmentValue::CenterOf(i), 0.0),
                    (SegmentValue::Exact(i + 1), a.delivered_gpu_hours),
                ],
                c.filled(),
            ));
        }
        chart.draw_series(rects).map_err(svg_err)?;
        root.present().map_err(svg_err)?;
    }
    Ok(svg)
}

/// Where a wait CDF's log axis starts: a minute.
const WAIT_FLOOR_H: f64 = 1.0 / 60.0;

/// The x axis of a line chart.
#[derive(Clone, Copy)]
enum Axis {
    /// Simulated hours, linear.
    Hours,
    /// Waits in hours on a log scale, from [`WAIT_FLOOR_H`].
    LogHours,
}

fn lines_svg(series: &[Series], x: Axis, y_desc: &str, y_max: f64) -> Result<String, SimError> {
    let mut svg = String::new();
    {
        let x_max = series
            .iter()
            .flat_map(|s| s.2.iter().map(|p| p.0))
            .fold(1e-9, f64::max);
        let root = SVGBackend::with_string(&mut svg, (960, 300)).into_drawing_area();
        root.fill(&WHITE).map_err(svg_err)?;
        let mut builder = ChartBuilder::on(&root);
        builder
            .margin(10)
            .x_label_area_size(36)
            .y_label_area_size(56);
        match x {
            Axis::Hours => {
                let chart = builder
                    .build_cartesian_2d(0.0..x_max, 0.0..y_max)
                    .map_err(svg_err)?;
                draw_lines(chart, series, "hours", y_desc)?;
            }
            Axis::LogHours => {
                let chart = builder
                    .build_cartesian_2d(
                        (WAIT_FLOOR_H..x_max.max(WAIT_FLOOR_H * 10.0)).log_scale(),
                        0.0..y_max,
                    )
                    .map_err(svg_err)?;
                draw_lines(chart, series, "wait (hours, log scale)", y_desc)?;
            }
        }
        root.present().map_err(svg_err)?;
    }
    Ok(svg)
}

fn draw_lines<X>(
    mut chart: ChartContext<'_, SVGBackend<'_>, Cartesian2d<X, RangedCoordf64>>,
    series: &[Series],
    x_desc: &str,
    y_desc: &str,
) -> Result<(), SimError>
where
    X: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .draw()
        .map_err(svg_err)?;
    for (_, c, points) in series {
        chart
            .draw_series(LineSeries::new(points.iter().copied(), c.stroke_width(2)))
            .map_err(svg_err)?;
    }
    Ok(())
}

/// The timeline's legend: the allocations, `(unallocated)` only where unallocated work ran,
/// and idle.
fn legend(colours: &[(String, RGBColor)], unallocated_ran: bool) -> String {
    let mut s = String::from("<p class=legend>");
    for (name, c) in colours {
        if *c == UNALLOCATED && !unallocated_ran {
            continue;
        }
        s += &format!(
            "<span><i style=\"background:{}\"></i>{}</span>",
            hex(c),
            escape(name)
        );
    }
    s += &format!(
        "<span><i style=\"background:{}\"></i>idle</span></p>",
        hex(&IDLE)
    );
    s
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

const STYLE: &str = "body{font-family:sans-serif;max-width:1000px;margin:2em auto;color:#222}\
table{border-collapse:collapse}td,th{padding:3px 10px;border-bottom:1px solid #ddd;text-align:right}\
td:first-child,th:first-child{text-align:left}.legend span{margin-right:1em;white-space:nowrap}\
.legend i{display:inline-block;width:.9em;height:.9em;margin-right:.3em;vertical-align:middle}\
.note{color:#666;font-size:90%}";

/// Writes `report.html` for one run from its report and the timeline gathered from its ledger.
pub fn write_report(out_dir: &Path, mut t: Timeline, report: &Report) -> Result<(), SimError> {
    register_font();
    let colours = colours(report);
    let horizon_ms = (report.sim.horizon_s * 1000.0).max(1.0);
    t.finish(horizon_ms);
    let horizon_h = report.sim.horizon_s / 3600.0;
    let timeline = timeline_svg(&t, &colours, horizon_h)?;
    let bars = bars_svg(report, &colours)?;
    // Waits on a log axis: from a minute (shorter waits are drawn there) to the longest.
    let cdf = |mut w: Vec<f64>| -> Vec<(f64, f64)> {
        w.sort_by(f64::total_cmp);
        let n = w.len() as f64;
        w.iter()
            .enumerate()
            .map(|(j, &x)| (x.max(WAIT_FLOOR_H), (j + 1) as f64 / n))
            .collect()
    };
    let mut cdfs = Vec::new();
    let mut by_size = String::new();
    for (i, a) in report.allocations.iter().enumerate() {
        let Some(sizes) = t.waits_h.get(&a.path) else {
            continue;
        };
        cdfs.push((
            a.path.clone(),
            colours.get(i).map_or(OTHER, |c| c.1),
            cdf(sizes.values().flatten().copied().collect()),
        ));
        let series: Vec<Series> = sizes
            .iter()
            .enumerate()
            .map(|(k, (gpus, w))| {
                let c = PALETTE[k % PALETTE.len()];
                (
                    format!("{gpus} GPU(s)"),
                    RGBColor(c.0, c.1, c.2),
                    cdf(w.clone()),
                )
            })
            .collect();
        by_size += &format!(
            "<h3>{}</h3>{}{}",
            escape(&a.path),
            legend_of(&series),
            lines_svg(&series, Axis::LogHours, "fraction started", 1.0)?
        );
    }
    let waits = lines_svg(&cdfs, Axis::LogHours, "fraction started", 1.0)?;
    let occupancy: Vec<(f64, f64)> = t.busy[..t.bins]
        .iter()
        .enumerate()
        .map(|(b, busy)| {
            let width = t.width_ms(b, horizon_ms);
            (
                (b as f64 * t.bin_ms + width / 2.0) / 3_600_000.0,
                busy / (t.total_gpus.max(1) as f64 * width),
            )
        })
        .collect();
    let occ = lines_svg(
        &[(
            "occupancy".into(),
            RGBColor(PALETTE[0].0, PALETTE[0].1, PALETTE[0].2),
            occupancy,
        )],
        Axis::Hours,
        "GPUs busy (fraction)",
        1.05,
    )?;

    let mut rows = String::new();
    for a in &report.allocations {
        let ratio = if a.owed_gpu_hours > 0.0 {
            format!("{:.3}", a.delivered_gpu_hours / a.owed_gpu_hours)
        } else {
            "-".into()
        };
        let w = |v: Option<f64>| v.map_or("-".into(), |v| format!("{:.1}", v / 3600.0));
        rows += &format!(
            "<tr><td>{}</td><td>{}</td><td>{:.1}</td><td>{:.1}</td><td>{ratio}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            escape(&a.path), a.weight, a.owed_gpu_hours, a.delivered_gpu_hours, w(a.wait_p50_s), w(a.wait_p90_s), w(a.wait_p99_s), a.preemptions
        );
    }
    let r = report;
    let html = format!(
        "<!doctype html><html><head><meta charset=utf-8><title>fairledger sim: {policy}</title><style>{STYLE}</style></head><body>\
<h1>Simulation: policy {policy}</h1>\
<p>{h:.1} simulated hours; {sub} workloads submitted, {st} started, {fin} finished; {pre} preemptions, {cv} contract violations.</p>\
<p><b>Delivered within owed / owed: {fair:.3}</b> &middot; availability {av:.3} &middot; occupancy {oc:.3} &middot; impact {im:.3} &middot; stranded {str:.1} GPU-h &middot; largest startable gang (median) {gang} GPUs</p>\
<h2>What preemptions cost</h2><table><tr><th>reason</th><th>requests</th><th>runs stopped</th><th>GPU-h in grace</th><th>GPU-h redone</th><th>GPU-h if restarted from the start</th></tr>{churn}</table>\
<p class=note>Work model <b>{model}</b>: {model_says}</p>\
<p class=note>{preempted} workloads preempted; at most {most} times each (p99 {p99}); {over3} more than 3 times. Reclaims for the lender: {lender}, for another workload: {another}.</p>\
<h2>Every GPU over time, by allocation</h2>{legend}{timeline}\
<p class=note>{gpr} GPU(s) per row, {bin:.2} h per column; each cell shows the allocation that held most of it, idle when under half used.</p>\
<h2>Owed versus delivered</h2><p class=note>Pale: owed; solid: delivered.</p>{bars}\
<table><tr><th>allocation</th><th>weight</th><th>owed GPU-h</th><th>delivered GPU-h</th><th>delivered/owed</th><th>wait p50 h</th><th>p90 h</th><th>p99 h</th><th>preemptions</th></tr>{rows}</table>\
<h2>Queue waits</h2>{waits_legend}{waits}<h2>Queue waits by GPUs asked</h2><p class=note>Per allocation; waits under a minute are drawn at a minute.</p>{by_size}<h2>Occupancy</h2>{occ}</body></html>\n",
        policy = escape(&r.policy),
        h = horizon_h,
        sub = r.workloads.submitted,
        st = r.workloads.started,
        fin = r.workloads.finished,
        pre = r.workloads.preemptions,
        cv = r.workloads.contract_violations,
        fair = r.fairness.delivered_over_owed,
        av = r.metrics.availability,
        oc = r.metrics.occupancy,
        im = r.metrics.impact,
        str = r.fragmentation.stranded_gpu_hours,
        gang = r.fragmentation.largest_startable_gang_p50,
        churn = r
            .churn
            .by_reason
            .iter()
            .map(|(reason, c)| (reason.as_str(), c))
            .chain(std::iter::once(("all", &r.churn.all)))
            .map(|(reason, c)| format!(
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{:.1}</td><td>{:.1}</td><td>{:.1}</td></tr>",
                escape(reason), c.requests, c.stopped, c.grace_gpu_hours, c.redone_gpu_hours, c.run_gpu_hours
            ))
            .collect::<String>(),
        model = r.sim.work_model.name(),
        model_says = match r.sim.work_model {
            ledger::sim::WorkModel::Checkpoint => "a stopped run redoes its work since its last checkpoint; one that declares no checkpoint interval resumes where it stopped (run with --work-model restart to have those restart from their start).",
            ledger::sim::WorkModel::Restart => "a stopped run redoes its work since its last checkpoint; one that declares no checkpoint interval restarts from its start (--work-model checkpoint has those resume where they stopped).",
        },
        preempted = r.churn.workloads_preempted,
        most = r.churn.per_workload_max,
        p99 = r.churn.per_workload_p99,
        over3 = r.churn.workloads_more_than_3,
        lender = r.churn.reclaims_for_lender,
        another = r.churn.reclaims_for_another,
        legend = legend(&colours, t.unallocated_ran()),
        waits_legend = legend_of(&cdfs),
        gpr = t.gpus_per_row,
        bin = t.bin_ms / 3_600_000.0,
    );
    let path = out_dir.join("report.html");
    std::fs::write(&path, html).map_err(|e| SimError::Io(path, e))
}

/// Writes `compare.html`: the policies side by side.
pub fn write_compare(out_dir: &Path, reports: &[Report]) -> Result<(), SimError> {
    register_font();
    let mut rows = String::new();
    for r in reports {
        rows += &format!(
            "<tr><td><a href=\"{p}/report.html\">{p}</a></td><td>{:.3}</td><td>{:.3}</td><td>{:.3}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.1}</td><td>{:.1}</td><td>{}</td><td>{:.1}</td></tr>",
            r.fairness.delivered_over_owed,
            r.metrics.occupancy,
            r.metrics.impact,
            r.workloads.preemptions,
            r.churn.per_workload_max,
            r.churn.workloads_more_than_3,
            r.churn.all.grace_gpu_hours,
            r.churn.all.run_gpu_hours,
            r.workloads.contract_violations,
            r.fragmentation.stranded_gpu_hours,
            p = escape(&r.policy)
        );
    }
    // Delivered/owed per allocation, one dot per policy.
    let series: Vec<Series> = reports
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let (cr, cg, cb) = POLICY_PALETTE[i % POLICY_PALETTE.len()];
            let points = r
                .allocations
                .iter()
                .enumerate()
                .map(|(j, a)| {
                    (
                        j as f64,
                        if a.owed_gpu_hours > 0.0 {
                            a.delivered_gpu_hours / a.owed_gpu_hours
                        } else {
                            1.0
                        },
                    )
                })
                .collect();
            (r.policy.clone(), RGBColor(cr, cg, cb), points)
        })
        .collect();
    let names: Vec<String> = reports
        .first()
        .map(|r| r.allocations.iter().map(|a| a.path.clone()).collect())
        .unwrap_or_default();
    let chart = dots_svg(&series, &names, "delivered / owed", Some(1.0))?;
    let legend = legend_of(&series);
    // Waits per allocation, one dot per policy, in the policies' colours; and the figures.
    let waits: Vec<Series> = reports
        .iter()
        .zip(&series)
        .map(|(r, (name, c, _))| {
            let points = r
                .allocations
                .iter()
                .enumerate()
                .filter_map(|(j, a)| Some((j as f64, a.wait_p90_s? / 3600.0)))
                .collect();
            (name.clone(), *c, points)
        })
        .collect();
    let waits_chart = dots_svg(&waits, &names, "wait p90 (hours)", None)?;
    let clock = |s: Option<f64>| s.map_or("-".into(), |s| clock(s.round() as u64));
    let mut wait_rows = String::new();
    for (j, path) in names.iter().enumerate() {
        wait_rows += &format!("<tr><td>{}</td>", escape(path));
        for r in reports {
            let a = r.allocations.get(j);
            wait_rows += &format!(
                "<td>{}</td><td>{}</td><td>{}</td>",
                clock(a.and_then(|a| a.wait_p50_s)),
                clock(a.and_then(|a| a.wait_p90_s)),
                clock(a.and_then(|a| a.wait_p99_s)),
            );
        }
        wait_rows += "</tr>";
    }
    let wait_head: String = reports
        .iter()
        .map(|r| format!("<th colspan=3>{}</th>", escape(&r.policy)))
        .collect();
    let wait_sub = "<th>p50</th><th>p90</th><th>p99</th>".repeat(reports.len());
    let html = format!(
        "<!doctype html><html><head><meta charset=utf-8><title>fairledger sim: compare</title><style>{STYLE}</style></head><body>\
<h1>Policies compared on the same input</h1>\
<table><tr><th>policy</th><th>delivered within owed / owed</th><th>occupancy</th><th>impact</th><th>preemptions</th><th>most per workload</th><th>workloads preempted more than 3 times</th><th>GPU-h in grace</th><th>GPU-h redone if restarted from the start</th><th>contract violations</th><th>stranded GPU-h</th></tr>{rows}</table>\
<h2>Delivered / owed per allocation</h2>{legend}{chart}<p class=note>1.0 means the allocation got exactly what it was owed over the period.</p>\
<h2>Queue waits per allocation</h2>{legend}{waits_chart}<p class=note>The 90th percentile of waits from submission to first start, per policy.</p>\
<table><tr><th rowspan=2>allocation</th>{wait_head}</tr><tr>{wait_sub}</tr>{wait_rows}</table><p class=note>Waits as [D-]HH:MM:SS.</p></body></html>\n"
    );
    let path = out_dir.join("compare.html");
    std::fs::write(&path, html).map_err(|e| SimError::Io(path, e))
}

/// One dot per (allocation, policy), allocations along x; `reference` draws a level line.
fn dots_svg(
    series: &[Series],
    names: &[String],
    y_desc: &str,
    reference: Option<f64>,
) -> Result<String, SimError> {
    let mut svg = String::new();
    {
        let n = names.len().max(1) as i32;
        let y_max = series
            .iter()
            .flat_map(|s| s.2.iter().map(|p| p.1))
            .fold(reference.unwrap_or(1e-9), f64::max)
            * 1.1;
        let root = SVGBackend::with_string(&mut svg, (960, 320)).into_drawing_area();
        root.fill(&WHITE).map_err(svg_err)?;
        let mut chart = ChartBuilder::on(&root)
            .margin(10)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d((0..n - 1).into_segmented(), 0.0..y_max)
            .map_err(svg_err)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(n as usize)
            .x_label_formatter(&|v| match v {
                SegmentValue::CenterOf(i) => names.get(*i as usize).cloned().unwrap_or_default(),
                _ => String::new(),
            })
            .y_desc(y_desc)
            .draw()
            .map_err(svg_err)?;
        if let Some(level) = reference {
            chart
                .draw_series(std::iter::once(PathElement::new(
                    vec![
                        (SegmentValue::Exact(0), level),
                        (SegmentValue::Exact(n), level),
                    ],
                    BLACK.mix(0.4).stroke_width(1),
                )))
                .map_err(svg_err)?;
        }
        for (_, c, points) in series {
            chart
                .draw_series(points.iter().map(|&(x, y)| {
                    Circle::new((SegmentValue::CenterOf(x as i32), y), 6, c.filled())
                }))
                .map_err(svg_err)?;
        }
        root.present().map_err(svg_err)?;
    }
    Ok(svg)
}

fn legend_of(series: &[Series]) -> String {
    let mut s = String::from("<p class=legend>");
    for (name, c, _) in series {
        s += &format!(
            "<span><i style=\"background:{}\"></i>{}</span>",
            hex(c),
            escape(name)
        );
    }
    s + "</p>"
}

/// A what-if's answer as a self-contained page: each allocation's delivered over owed,
/// delivered GPU-hours and 90th-percentile wait, without and with the changes (in the policies'
/// colours of `compare.html`), and the figures side by side. `changes` describes what was
/// tried, for the title.
pub fn what_if(answer: &ledger::whatif::Answer, changes: &str) -> Result<String, SimError> {
    register_font();
    let sides = [
        ("baseline", &answer.baseline),
        ("with the changes", &answer.changed),
    ];
    let mut names: Vec<String> = Vec::new();
    for (_, side) in &sides {
        for a in &side.allocations {
            if !names.contains(&a.path) {
                names.push(a.path.clone());
            }
        }
    }
    let series =
        |value: &dyn Fn(&ledger::whatif::AllocationOutcome) -> Option<f64>| -> Vec<Series> {
            sides
                .iter()
                .enumerate()
                .map(|(i, (label, side))| {
                    let (r, g, b) = POLICY_PALETTE[i % POLICY_PALETTE.len()];
                    let points = names
                        .iter()
                        .enumerate()
                        .filter_map(|(j, path)| {
                            let a = side.allocations.iter().find(|a| &a.path == path)?;
                            Some((j as f64, value(a)?))
                        })
                        .collect();
                    (label.to_string(), RGBColor(r, g, b), points)
                })
                .collect()
        };
    let ratio = series(&|a| a.delivered_over_owed);
    let delivered = series(&|a| Some(a.delivered_gpu_hours));
    let waits = series(&|a| a.wait_p90_s.map(|s| s / 3600.0));
    let legend = legend_of(&ratio);
    let charts = format!(
        "<h2>Delivered / owed per allocation</h2>{legend}{}\
<h2>Delivered GPU-hours per allocation</h2>{legend}{}\
<h2>Queue waits per allocation</h2>{legend}{}<p class=note>The 90th percentile of waits from submission to first start.</p>",
        dots_svg(&ratio, &names, "delivered / owed", Some(1.0))?,
        dots_svg(&delivered, &names, "GPU-hours", None)?,
        dots_svg(&waits, &names, "wait p90 (hours)", None)?,
    );
    let clock = |s: Option<f64>| s.map_or("-".into(), |s| clock(s.round() as u64));
    let mut rows = String::new();
    for path in &names {
        let find = |side: &ledger::whatif::Side| {
            side.allocations.iter().find(|a| &a.path == path).cloned()
        };
        let (b, c) = (find(&answer.baseline), find(&answer.changed));
        let both = |f: &dyn Fn(&ledger::whatif::AllocationOutcome) -> String| {
            format!(
                "<td>{}</td><td>{}</td>",
                b.as_ref().map_or("-".into(), f),
                c.as_ref().map_or("-".into(), f)
            )
        };
        rows += &format!(
            "<tr><td>{}</td>{}{}{}{}{}{}{}</tr>",
            escape(path),
            both(&|a| a.weight.to_string()),
            both(&|a| format!("{:.1}", a.owed_gpu_hours)),
            both(&|a| format!("{:.1}", a.delivered_gpu_hours)),
            both(&|a| a
                .delivered_over_owed
                .map_or("-".into(), |r| format!("{r:.3}"))),
            both(&|a| clock(a.wait_p50_s)),
            both(&|a| clock(a.wait_p90_s)),
            both(&|a| a.preemptions.to_string()),
        );
    }
    let head = [
        "weight",
        "owed GPU-h",
        "delivered GPU-h",
        "delivered/owed",
        "wait p50",
        "wait p90",
        "preemptions",
    ]
    .iter()
    .map(|h| format!("<th colspan=2>{h}</th>"))
    .collect::<String>();
    let sub = "<th>before</th><th>after</th>".repeat(7);
    let (b, c) = (&answer.baseline.cluster, &answer.changed.cluster);
    let started = |side: &ledger::whatif::Side| {
        side.pending
            .iter()
            .filter(|p| p.start_at_ms.is_some())
            .count()
    };
    let horizon = clock(Some(answer.horizon_s));
    Ok(format!(
        "<!doctype html><html><head><meta charset=utf-8><title>fairledger what-if</title><style>{STYLE}</style></head><body>\
<h1>What if: {changes}</h1>\
<p>From the ledger at event {seq}, {horizon} ahead ([D-]HH:MM:SS). Nothing was written.</p>\
<p>Occupancy {bo:.3} &rarr; <b>{co:.3}</b> &middot; healthy GPUs {bh} &rarr; {ch} &middot; preemptions {bp} &rarr; {cp} &middot; contract violations {bv} &rarr; {cv} &middot; of {n} workloads waiting now, {bs} &rarr; <b>{cs}</b> start within the horizon</p>\
<table><tr><th rowspan=2>allocation</th>{head}</tr><tr>{sub}</tr>{rows}</table>{charts}</body></html>\n",
        changes = escape(changes),
        seq = answer.forked_at_seq,
        bo = b.occupancy,
        co = c.occupancy,
        bh = b.healthy_gpus,
        ch = c.healthy_gpus,
        bp = b.preemptions,
        cp = c.preemptions,
        bv = b.contract_violations,
        cv = c.contract_violations,
        n = answer.baseline.pending.len(),
        bs = started(&answer.baseline),
        cs = started(&answer.changed),
    ))
}
