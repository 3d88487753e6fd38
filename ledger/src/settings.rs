//! The ledger's settings: everything the fold and the scheduling step read, as an event of the
//! log (`settings_set`), so that every folder — the server, its agents, a replay, an audit, a
//! subscriber — folds by the same rules, and a change takes effect at its position in the log.
//!
//! A log without the event folds by the defaults of its schema version: [`Settings::default`]
//! for every version so far. The usage window's shape may change only while no allocation
//! exists: every allocation's history is kept in buckets of that shape.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::policy::{PolicyConfig, POLICY_NAMES};
use crate::rejection::Rejection;
use crate::state::StateConfig;

/// The settings of a ledger; every field has its default, so a `settings_set` names only what
/// it changes from the defaults (not from the settings before it).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Settings {
    /// The policy that orders the queue: fairshare, fairtree, fifo or priority (`name` in a
    /// scenario file's `[policy]`).
    #[serde(alias = "name")]
    pub policy: String,
    /// Usage lookback of the fair-share ranking, in seconds.
    pub window_s: u64,
    /// Buckets the lookback is kept in.
    pub window_buckets: u32,
    /// The scheduling contract: protection of a started workload that asks for none, seconds.
    pub min_runtime_s: u64,
    /// The most protection a workload may ask for, seconds.
    pub max_min_runtime_s: u64,
    /// Time a preempted workload gets to checkpoint, seconds.
    pub grace_s: u64,
    /// Hysteresis on the ranking key: a victim's allocation must rank above the beneficiary's
    /// by more than this.
    pub margin: f64,
    /// Hysteresis in time, seconds: taking work back from whoever took from you within it needs
    /// twice the margin.
    pub reversal_window_s: u64,
    /// The most reservations a scheduling pass holds.
    pub reservations: u32,
    /// The most blocked workloads a pass lets look for victims.
    pub preemptors_per_pass: u32,
    /// The most pending workloads a pass considers, in the policy's order; 0: every one.
    pub lookahead: u32,
    /// The most times the policy preempts one workload; then it is left alone for the usage
    /// window past its contract. 0: no limit.
    pub max_preemptions: u32,
    /// Assemble whole nodes for the multi-GPU work of under-served allocations.
    pub defragment: bool,
    /// The node label whose equal values mean "close" for gang placement.
    pub topology_label: String,
    /// A node silent this long has its GPUs marked unhealthy, seconds.
    pub heartbeat_timeout_s: u64,
    /// How far behind the ledger's clock an event may be and still be folded, milliseconds.
    pub clock_skew_tolerance_ms: u64,
    /// The URL prefixes workloads' notifications may be posted to (see [`crate::notify`]);
    /// none by default.
    pub notify_urls: Vec<String>,
}

impl Default for Settings {
    fn default() -> Self {
        Settings::from_configs(
            &StateConfig::default(),
            &PolicyConfig::default(),
            crate::health::DEFAULT_TIMEOUT_MS,
        )
    }
}

/// The bounds every setting is checked against, in one place.
const WINDOW_BUCKETS_MAX: u32 = 10_000;
const DAY_S: u64 = 86_400;

impl Settings {
    /// The settings the fold and the scheduler's configurations amount to.
    pub fn from_configs(state: &StateConfig, policy: &PolicyConfig, heartbeat_ms: u64) -> Self {
        Settings {
            policy: policy.policy.to_owned(),
            window_s: state.window_ms / 1000,
            window_buckets: state.window_buckets,
            min_runtime_s: policy.min_runtime_ms / 1000,
            max_min_runtime_s: state.min_runtime_cap_ms / 1000,
            grace_s: policy.grace_ms / 1000,
            margin: policy.margin,
            reversal_window_s: policy.reversal_window_ms / 1000,
            reservations: policy.reservations_max,
            preemptors_per_pass: policy.preemptors_per_pass_max,
            lookahead: policy.lookahead,
            max_preemptions: policy.max_preemptions,
            defragment: policy.defragment,
            topology_label: policy.topology_label.clone(),
            heartbeat_timeout_s: heartbeat_ms.div_ceil(1000),
            clock_skew_tolerance_ms: state.clock_skew_tolerance_ms,
            notify_urls: Vec::new(),
        }
    }

    /// Checks every setting; the error names the first that is out of bounds and what to do.
    pub fn check(&self) -> Result<(), Rejection> {
        let bad =
            |field: &'static str, reason: String| Err(Rejection::InvalidField { field, reason });
        crate::notify::check_prefixes(&self.notify_urls)?;
        if !POLICY_NAMES.contains(&self.policy.as_str()) {
            return bad(
                "policy",
                format!(
                    "{:?} is unknown; use one of {}",
                    self.policy,
                    POLICY_NAMES.join(", ")
                ),
            );
        }
        // Whole numbers within bounds, in the order they are checked; a bound's gloss follows it.
        let bounded: [(&'static str, u64, u64, u64, &str); 11] = [
            (
                "window_s",
                self.window_s,
                3600,
                366 * DAY_S,
                " (an hour to a year)",
            ),
            (
                "window_buckets",
                self.window_buckets.into(),
                1,
                WINDOW_BUCKETS_MAX.into(),
                "",
            ),
            (
                "max_min_runtime_s",
                self.max_min_runtime_s,
                0,
                30 * DAY_S,
                " (30 days)",
            ),
            ("grace_s", self.grace_s, 0, DAY_S, " (a day)"),
            (
                "reversal_window_s",
                self.reversal_window_s,
                0,
                30 * DAY_S,
                " (30 days)",
            ),
            ("reservations", self.reservations.into(), 1, 64, ""),
            (
                "preemptors_per_pass",
                self.preemptors_per_pass.into(),
                1,
                1024,
                "",
            ),
            (
                "lookahead",
                self.lookahead.into(),
                0,
                1_000_000,
                " (0 considers every pending workload)",
            ),
            (
                "max_preemptions",
                self.max_preemptions.into(),
                0,
                1_000,
                " (0 for no limit)",
            ),
            (
                "heartbeat_timeout_s",
                self.heartbeat_timeout_s,
                1,
                DAY_S,
                " (a day)",
            ),
            (
                "clock_skew_tolerance_ms",
                self.clock_skew_tolerance_ms,
                0,
                3_600_000,
                " (an hour)",
            ),
        ];
        for (field, value, low, high, gloss) in bounded {
            if !(low..=high).contains(&value) {
                return bad(
                    field,
                    if low == 0 {
                        format!("{value} must be at most {high}{gloss}")
                    } else {
                        format!("{value} must lie in {low} to {high}{gloss}")
                    },
                );
            }
        }
        if self.min_runtime_s > self.max_min_runtime_s {
            return bad(
                "min_runtime_s",
                format!(
                    "{} exceeds max_min_runtime_s {}; raise the cap or lower the default",
                    self.min_runtime_s, self.max_min_runtime_s
                ),
            );
        }
        if !(self.margin.is_finite() && (0.0..10.0).contains(&self.margin)) {
            return bad("margin", format!("{} must lie in [0, 10)", self.margin));
        }
        let label =
            std::collections::BTreeMap::from([(self.topology_label.clone(), String::new())]);
        if crate::names::labels(&label).is_err() {
            return bad(
                "topology_label",
                format!(
                    "{:?}: a label key has 1 to 128 letters, digits, '-', '_', '.' or '/', the first a letter or digit",
                    self.topology_label
                ),
            );
        }
        Ok(())
    }

    /// The fold's configuration.
    pub fn state_config(&self) -> StateConfig {
        StateConfig {
            window_ms: self.window_s * 1000,
            window_buckets: self.window_buckets,
            min_runtime_cap_ms: self.max_min_runtime_s * 1000,
            clock_skew_tolerance_ms: self.clock_skew_tolerance_ms,
        }
    }

    /// The scheduler's configuration: these settings over `local`'s, which keeps only what
    /// changes no decision (whether every waiting workload is explained).
    pub fn policy_config(&self, local: &PolicyConfig) -> PolicyConfig {
        PolicyConfig {
            policy: POLICY_NAMES
                .iter()
                .find(|p| **p == self.policy)
                .copied()
                .unwrap_or(local.policy),
            min_runtime_ms: self.min_runtime_s * 1000,
            grace_ms: self.grace_s * 1000,
            margin: self.margin,
            preemptors_per_pass_max: self.preemptors_per_pass,
            reservations_max: self.reservations,
            defragment: self.defragment,
            topology_label: self.topology_label.clone(),
            explain: local.explain,
            reversal_window_ms: self.reversal_window_s * 1000,
            lookahead: self.lookahead,
            max_preemptions: self.max_preemptions,
        }
    }

    /// The silence after which a node's GPUs go unhealthy.
    pub fn heartbeat_timeout_ms(&self) -> u64 {
        self.heartbeat_timeout_s * 1000
    }

    /// The settings that differ between `self` and `other`, as `name: ours → theirs`.
    pub fn differences(&self, other: &Settings) -> Vec<String> {
        let a = serde_json::to_value(self).expect("settings serialize");
        let b = serde_json::to_value(other).expect("settings serialize");
        let (Some(a), Some(b)) = (a.as_object(), b.as_object()) else {
            return Vec::new();
        };
        a.iter()
            .filter(|(k, v)| b.get(*k) != Some(v))
            .map(|(k, v)| {
                format!(
                    "{k}: {v} → {}",
                    b.get(k).unwrap_or(&serde_json::Value::Null)
                )
            })
            .collect()
    }
}
