//! What `GET /metrics` shows, in the OpenMetrics text format: the projection's progress, the
//! cluster's GPUs and workloads, every allocation's share of them now and over the usage window
//! (leaves, labelled by path: a parent is the sum of its leaves), how long scheduling passes
//! take and how long started work waited (from the scheduler in this process), and how long
//! the API took to answer, by route and status.
//!
//! The figures of the state are read when scraped; the durations accumulate in histograms that
//! live as long as the process. The route is open, and shows no names to a caller without a
//! token: the series labelled by allocation need a token whose role may read the cluster (a
//! scraper's `authorization: credentials_file:`).

use std::sync::atomic::AtomicU64;

use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::Response;
use projector::Projector;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

type Labels = Vec<(String, String)>;

/// The histograms kept across scrapes.
#[derive(Clone, Debug)]
pub struct Metrics {
    /// Seconds to answer a request, by method, route (as the router matched it) and status.
    http: Family<Labels, Histogram>,
    /// The scheduler's figures (empty in a process that does not schedule).
    pub(crate) scheduler: scheduler::SchedulerMetrics,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            // 250 µs to about 8 s.
            http: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(2.5e-4, 2.0, 16))
            }),
            scheduler: Default::default(),
        }
    }
}

fn labels<const N: usize>(pairs: [(&str, &str); N]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

impl Metrics {
    /// Every figure, as of the projection `p`, in the OpenMetrics text format.
    /// The series labelled by allocation only `by_allocation`.
    pub(crate) fn render(
        &self,
        p: &Projector,
        refused_decisions: u64,
        by_allocation: bool,
    ) -> String {
        let mut registry = Registry::default();
        let state = p.state();

        let last_seq = Gauge::<i64>::default();
        last_seq.set(p.last_seq() as i64);
        registry.register(
            "fairledger_projection_last_seq",
            "Last ledger sequence folded.",
            last_seq,
        );
        let events = Family::<Labels, Counter>::default();
        let s = p.stats();
        for (outcome, n) in [
            ("applied", s.applied),
            ("rejected", s.rejected),
            ("duplicate", s.duplicates),
            ("malformed", s.malformed),
        ] {
            events
                .get_or_create(&labels([("outcome", outcome)]))
                .inc_by(n);
        }
        registry.register(
            "fairledger_projection_events",
            "Events read by the projector, by outcome.",
            events,
        );

        let c = state.cluster();
        let gpus = Family::<Labels, Gauge>::default();
        for (kind, n) in [
            ("total", c.total_gpus),
            ("healthy", c.healthy_gpus),
            ("allocated", c.allocated_gpus),
        ] {
            gpus.get_or_create(&labels([("state", kind)])).set(n as i64);
        }
        registry.register("fairledger_gpus", "GPUs of the cluster, by state.", gpus);
        let workloads = Family::<Labels, Gauge>::default();
        workloads
            .get_or_create(&labels([("phase", "running")]))
            .set(state.running().len() as i64);
        workloads
            .get_or_create(&labels([("phase", "live")]))
            .set(state.workloads().len() as i64);
        registry.register("fairledger_workloads", "Live workloads.", workloads);
        let preemptions = Family::<Labels, Counter>::default();
        let by_reason = p.book().preemptions();
        for (reason, n) in [
            ("fair_share", by_reason.fair_share),
            ("reclaimed", by_reason.reclaimed),
            ("defragment", by_reason.defragment),
            ("opportunistic", by_reason.opportunistic),
            ("hardware_failure", by_reason.hardware_failure),
        ] {
            preemptions
                .get_or_create(&labels([("reason", reason)]))
                .inc_by(n);
        }
        registry.register(
            "fairledger_preemptions",
            "Preemptions requested since the ledger began, by reason.",
            preemptions,
        );
        // How often the live workloads were preempted: the churn a researcher feels.
        let mut by_count = [0i64; 5];
        for (_, w) in state.workloads().iter() {
            by_count[(w.preemptions as usize).min(4)] += 1;
        }
        let preempted = Family::<Labels, Gauge>::default();
        for (times, n) in ["0", "1", "2", "3", "4+"].iter().zip(by_count) {
            preempted.get_or_create(&labels([("times", times)])).set(n);
        }
        registry.register(
            "fairledger_live_workloads_by_preemptions",
            "Live workloads by how many times they were preempted.",
            preempted,
        );
        let refused = Counter::<u64>::default();
        refused.inc_by(refused_decisions);
        registry.register(
            "fairledger_scheduler_refused_decisions",
            "Decisions left out because the log refuses them, counting every pass.",
            refused,
        );

        if by_allocation {
            allocation_figures(&mut registry, state);
        }
        self.scheduler.register(&mut registry, by_allocation);
        registry.register(
            "fairledger_http_request_duration_seconds",
            "Time to answer an API request, by method, route and status.",
            self.http.clone(),
        );
        let mut out = String::new();
        encode(&mut out, &registry).expect("writing to a string does not fail");
        out
    }
}

/// Every leaf allocation's figures now (a parent's are the sums of its leaves').
fn allocation_figures(registry: &mut Registry, state: &ledger::State) {
    let owed_now = Family::<Labels, Gauge<f64, AtomicU64>>::default();
    let held = Family::<Labels, Gauge>::default();
    let pending = Family::<Labels, Gauge>::default();
    let window_ratio = Family::<Labels, Gauge<f64, AtomicU64>>::default();
    let owed = state.owed_now();
    let (shape, now) = (state.window_shape(), state.now_ms());
    for (id, a) in state.allocations().nodes.iter().enumerate() {
        if a.removed || !a.is_leaf() {
            continue;
        }
        let l = labels([("allocation", a.path.as_str())]);
        owed_now
            .get_or_create(&l)
            .set(owed.get(id).copied().unwrap_or(0.0));
        held.get_or_create(&l).set(a.held_gpus as i64);
        pending
            .get_or_create(&l)
            .set(state.subtree_pending(id as u32).1 as i64);
        let w = a.window.sums(shape, now);
        if w.owed_gpu_ms > 0.0 {
            window_ratio
                .get_or_create(&l)
                .set(w.delivered_gpu_ms / w.owed_gpu_ms);
        }
    }
    registry.register(
        "fairledger_allocation_owed_gpus",
        "GPUs the fair-share split owes each leaf allocation now.",
        owed_now,
    );
    registry.register(
        "fairledger_allocation_held_gpus",
        "GPUs each leaf allocation's running work holds.",
        held,
    );
    registry.register(
        "fairledger_allocation_pending_gpus",
        "GPUs each leaf allocation's waiting work asks for.",
        pending,
    );
    registry.register(
            "fairledger_allocation_window_delivered_over_owed",
            "GPU-hours delivered over GPU-hours owed in the usage window, per leaf allocation that was owed any.",
            window_ratio,
        );
}

/// Times every request, labelled by method, the route the router matched (`unmatched` for none:
/// never the raw path, whose ids would make a series each) and status.
pub(crate) async fn track(
    State(metrics): State<Metrics>,
    request: Request,
    next: Next,
) -> Response {
    let started = std::time::Instant::now();
    let method = request.method().as_str().to_owned();
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", MatchedPath::as_str)
        .to_owned();
    let response = next.run(request).await;
    metrics
        .http
        .get_or_create(&vec![
            ("method".into(), method),
            ("route".into(), route),
            ("status".into(), response.status().as_u16().to_string()),
        ])
        .observe(started.elapsed().as_secs_f64());
    response
}
