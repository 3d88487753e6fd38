//! `scenario.toml`: the cluster, the allocation tree, the policy and optional faults of a run.
//!
//! ```toml
//! [policy]
//! name = "fairshare"        # fairshare | fairtree | fifo | priority
//! window_s = 604800         # usage lookback
//! min_runtime_s = 7200      # scheduling contract default
//! max_min_runtime_s = 28800 # cap on what a workload may ask for
//! grace_s = 300             # time to checkpoint after a preemption request
//! margin = 0.05             # hysteresis on the ranking key
//! reversal_window_s = 86400 # taking back from who took from you needs twice the margin
//! reservations = 4          # most reservations per pass (1 to 64; the default)
//! defragment = true         # assemble whole nodes for under-served multi-GPU work
//! heartbeat_timeout_s = 30  # a node silent this long has its GPUs marked unhealthy
//! topology_label = "rack"   # nodes with equal values of this label are close for gangs
//! preemptors_per_pass = 16  # blocked workloads a pass lets look for victims
//! lookahead = 128           # pending workloads a pass considers, in policy order (0: all)
//! max_preemptions = 3       # preempted this often, left alone a usage window (0: no limit)
//!
//! [[nodes]]                 # a group of identical nodes; repeat for more groups
//! count = 16
//! gpus = 8
//! model = "H100"
//! labels = { rack = "r1" }  # optional topology
//!
//! [[allocations]]           # the allocation tree; parents are implied by the paths
//! path = "ai2/olmo"
//! weight = 3
//!
//! [[faults]]                # optional: a GPU reports ECC errors from a time, until repaired
//! at_s = 3600
//! node = "H100-0-3"
//! gpu = 2
//! repair_s = 7200
//!
//! [[faults]]                # a node's agent falls silent: no heartbeats, no reports
//! kind = "silent"
//! at_s = 7200
//! node = "H100-0-5"
//! repair_s = 600
//!
//! [failures]                # optional: random GPU (ECC) failures, seeded by --seed
//! per_gpu_day = 0.001
//! repair_s = 14400
//! ```
//!
//! Nodes are named `<model>-<group>-<index>`, with any character a node name may not hold made
//! `-`. `nodes_file` may name an Alibaba 2023 `openb_node_list` CSV instead of (or besides)
//! `[[nodes]]`, relative to the scenario file. The set-up is folded by the ledger's own rules
//! before anything runs: a model or label it would refuse fails the scenario, naming the node.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ledger::event::{AllocationSet, Envelope, Event, NodeRegistered};
use ledger::policy::{self, PolicyConfig};
use ledger::settings::Settings;
use ledger::sim::{Fault, FaultKind};
use ledger::{Outcome, State, StateConfig};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Deserialize;

use crate::SimError;

/// The file as written.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// The ledger's settings (`name` or `policy` names the policy), the first event of the
    /// ledger a run writes.
    #[serde(default)]
    pub policy: Settings,
    /// Node groups.
    #[serde(default)]
    pub nodes: Vec<NodeGroup>,
    /// An Alibaba 2023 node list to add as nodes, relative to the scenario file.
    #[serde(default)]
    pub nodes_file: Option<PathBuf>,
    /// The allocation tree.
    #[serde(default)]
    pub allocations: Vec<AllocationEntry>,
    /// Scheduled GPU faults.
    #[serde(default)]
    pub faults: Vec<FaultEntry>,
    /// Random GPU failures.
    #[serde(default)]
    pub failures: Option<Failures>,
}

/// `[[nodes]]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeGroup {
    /// Identical nodes in the group.
    pub count: u32,
    /// GPUs per node.
    pub gpus: u32,
    /// GPU model.
    pub model: String,
    /// Topology labels.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

/// `[[allocations]]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AllocationEntry {
    /// Path.
    pub path: String,
    /// Weight.
    pub weight: u32,
    /// Optional GPU cap.
    #[serde(default)]
    pub max_gpus: Option<u32>,
}

/// `[[faults]]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultEntry {
    /// What goes wrong.
    #[serde(default)]
    pub kind: FaultEntryKind,
    /// When.
    pub at_s: u64,
    /// Node name.
    pub node: String,
    /// GPU index (an `ecc` fault's).
    #[serde(default)]
    pub gpu: Option<u32>,
    /// Seconds until repair; never if absent.
    #[serde(default)]
    pub repair_s: Option<u64>,
}

/// `[[faults]]`' `kind`.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum FaultEntryKind {
    /// The GPU reports uncorrected ECC errors.
    #[default]
    Ecc,
    /// The node's agent falls silent.
    Silent,
}

/// `[failures]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Failures {
    /// Expected failures per GPU per day.
    pub per_gpu_day: f64,
    /// Seconds until a failed GPU is repaired.
    pub repair_s: u64,
}

/// A scenario made ready to run.
#[derive(Clone, Debug)]
pub struct Prepared {
    /// The fold's settings.
    pub state_config: StateConfig,
    /// The scheduler's settings.
    pub policy: PolicyConfig,
    /// Node registrations and allocations, written at time 0.
    pub setup: Vec<Event>,
    /// `(name, gpus)` of every node.
    pub nodes: Vec<(String, u32)>,
    /// Weight of every allocation path given.
    pub weights: BTreeMap<String, u32>,
    /// Scheduled faults.
    pub faults: Vec<Fault>,
    /// Silence after which a node's GPUs go unhealthy.
    pub heartbeat_timeout_ms: u64,
    /// Random failures to draw once the horizon is known.
    pub failures: Option<Failures>,
}

impl Prepared {
    /// The ledger's settings this scenario amounts to (the first event of its ledger). A
    /// simulation's events are exact, but a ledger goes on live: the live clock skew tolerance.
    pub fn settings(&self) -> ledger::settings::Settings {
        let state = StateConfig {
            clock_skew_tolerance_ms: StateConfig::default().clock_skew_tolerance_ms,
            ..self.state_config
        };
        ledger::settings::Settings::from_configs(&state, &self.policy, self.heartbeat_timeout_ms)
    }
}

impl Scenario {
    /// Reads and checks a scenario file.
    pub fn load(path: &Path) -> Result<Scenario, SimError> {
        let text =
            std::fs::read_to_string(path).map_err(|e| SimError::Io(path.to_path_buf(), e))?;
        let mut s: Scenario = toml::from_str(&text).map_err(|e| SimError::Scenario {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        if let Some(f) = &s.nodes_file {
            if f.is_relative() {
                s.nodes_file = Some(path.parent().unwrap_or(Path::new(".")).join(f));
            }
        }
        Ok(s)
    }

    /// Checks the scenario and builds the setup events. `policy` overrides `[policy].name`.
    pub fn prepare(&self, policy_override: Option<&str>) -> Result<Prepared, SimError> {
        self.prepare_cluster(policy_override, true)
    }

    /// As [`Scenario::prepare`]; with `nodes_required` false a scenario may list no nodes (a
    /// live cluster whose node agents register them).
    pub fn prepare_cluster(
        &self,
        policy_override: Option<&str>,
        nodes_required: bool,
    ) -> Result<Prepared, SimError> {
        let bad = |message: String| SimError::Invalid(message);
        let name = policy_override.unwrap_or(&self.policy.policy);
        let policy_name = policy::POLICY_NAMES
            .iter()
            .find(|p| **p == name)
            .ok_or_else(|| {
                bad(format!(
                    "[policy] name {name:?} is unknown; use one of {}",
                    policy::POLICY_NAMES.join(", ")
                ))
            })?;
        let p = &self.policy;
        let mut setup = Vec::new();
        let mut nodes = Vec::new();
        for (g, group) in self.nodes.iter().enumerate() {
            if group.count == 0 || group.gpus == 0 || group.gpus > 64 {
                return Err(bad(format!(
                    "[[nodes]] group {}: count must be at least 1 and gpus 1 to 64",
                    g + 1
                )));
            }
            let stem = node_stem(&group.model);
            for i in 0..group.count {
                let node = format!("{stem}-{g}-{i}");
                nodes.push((node.clone(), group.gpus));
                setup.push(Event::NodeRegistered(NodeRegistered {
                    node,
                    gpus: group.gpus,
                    model: group.model.clone(),
                    labels: group.labels.clone(),
                }));
            }
        }
        if let Some(file) = &self.nodes_file {
            for (node, gpus, model) in crate::trace::alibaba::read_nodes(file)? {
                nodes.push((node.clone(), gpus));
                setup.push(Event::NodeRegistered(NodeRegistered {
                    node,
                    gpus,
                    model,
                    labels: BTreeMap::new(),
                }));
            }
        }
        if nodes.is_empty() && nodes_required {
            return Err(bad(
                "the scenario has no nodes; add a [[nodes]] group or nodes_file".into(),
            ));
        }
        let mut weights = BTreeMap::new();
        for a in &self.allocations {
            ledger::names::path(&a.path).map_err(|e| bad(format!("[[allocations]] {e}")))?;
            if a.weight == 0 {
                return Err(bad(format!(
                    "[[allocations]] {:?}: weight must be at least 1",
                    a.path
                )));
            }
            if weights.insert(a.path.clone(), a.weight).is_some() {
                return Err(bad(format!("[[allocations]] {:?} is listed twice", a.path)));
            }
            setup.push(Event::AllocationSet(AllocationSet {
                path: a.path.clone(),
                weight: a.weight,
                max_gpus: a.max_gpus,
                max_pending_workloads: None,
                max_pending_gpus: None,
            }));
        }
        let mut faults = Vec::new();
        for f in &self.faults {
            let Some(&(_, gpus)) = nodes.iter().find(|n| n.0 == f.node) else {
                return Err(bad(format!(
                    "[[faults]] node {:?} does not exist; nodes are named <model>-<group>-<index>",
                    f.node
                )));
            };
            let kind = match (f.kind, f.gpu) {
                (FaultEntryKind::Ecc, Some(gpu)) if gpu < gpus => FaultKind::Ecc { gpu },
                (FaultEntryKind::Ecc, Some(gpu)) => {
                    return Err(bad(format!(
                        "[[faults]] node {:?} has no GPU {gpu}; it has {gpus}",
                        f.node
                    )))
                }
                (FaultEntryKind::Ecc, None) => {
                    return Err(bad(format!(
                        "[[faults]] at node {:?}: an ecc fault names its gpu",
                        f.node
                    )))
                }
                (FaultEntryKind::Silent, None) => FaultKind::Silent,
                (FaultEntryKind::Silent, Some(_)) => {
                    return Err(bad(format!(
                        "[[faults]] at node {:?}: a silent fault is the whole node's; drop gpu",
                        f.node
                    )))
                }
            };
            faults.push(Fault {
                at_ms: f.at_s * 1000,
                node: f.node.clone(),
                kind,
                repaired_at_ms: f.repair_s.map(|r| (f.at_s + r) * 1000),
            });
        }
        if !(1..=86_400).contains(&p.heartbeat_timeout_s) {
            return Err(bad(
                "[policy] heartbeat_timeout_s must be 1 to 86400 seconds".into(),
            ));
        }
        if let Some(f) = &self.failures {
            if !(f.per_gpu_day >= 0.0 && f.per_gpu_day.is_finite()) {
                return Err(bad(
                    "[failures] per_gpu_day must be a non-negative number".into()
                ));
            }
        }
        // A simulation's events are exact: no skew to tolerate.
        let state_config = StateConfig {
            clock_skew_tolerance_ms: 0,
            ..p.state_config()
        };
        // The set-up goes through the fold's own rules: a scenario the ledger would refuse in
        // part (a model or label it does not take, a node listed twice) is refused whole.
        let mut dry = State::new(state_config);
        for (seq, event) in (1..).zip(&setup) {
            let env = Envelope::new(uuid::Uuid::nil(), 0, "sim", event.clone());
            if let Outcome::Rejected(r) = dry.apply(seq, &env) {
                let what = match event {
                    Event::NodeRegistered(e) => format!("[[nodes]] node {:?}", e.node),
                    Event::AllocationSet(e) => format!("[[allocations]] {:?}", e.path),
                    other => other.kind().to_string(),
                };
                return Err(bad(format!("{what}: {r}")));
            }
        }
        let prepared = Prepared {
            state_config,
            policy: PolicyConfig {
                policy: policy_name,
                ..p.policy_config(&PolicyConfig {
                    // Reports need decisions, not the reasons of every waiting workload.
                    explain: false,
                    ..PolicyConfig::default()
                })
            },
            setup,
            nodes,
            weights,
            faults,
            heartbeat_timeout_ms: p.heartbeat_timeout_ms(),
            failures: self.failures.clone(),
        };
        // The bounds are the ledger's, which folds these settings as its first event.
        prepared
            .settings()
            .check()
            .map_err(|r| bad(format!("[policy] {r}")))?;
        Ok(prepared)
    }
}

/// The stem of the node names of a `[[nodes]]` group: its model with every character a node name
/// may not hold made `-` (`A100 80GB` gives `A100-80GB-<group>-<index>`).
fn node_stem(model: &str) -> String {
    let stem: String = model
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '-'
            }
        })
        .collect();
    if stem.starts_with(|c: char| c.is_ascii_alphanumeric()) {
        stem
    } else {
        format!("gpu{stem}")
    }
}

impl Prepared {
    /// Draws random failures over `[0, horizon_ms)` from `seed`, on top of the scheduled ones.
    pub fn draw_failures(&self, seed: u64, horizon_ms: u64) -> Vec<Fault> {
        let mut faults = self.faults.clone();
        let Some(f) = &self.failures else {
            return faults;
        };
        if f.per_gpu_day <= 0.0 {
            return faults;
        }
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let day_ms = 86_400_000.0;
        for (node, gpus) in &self.nodes {
            for gpu in 0..*gpus {
                // Exponential gaps between failures of one GPU.
                let mut t = 0.0;
                loop {
                    let u: f64 = rng.random_range(f64::MIN_POSITIVE..1.0);
                    t += -u.ln() / f.per_gpu_day * day_ms;
                    if t >= horizon_ms as f64 {
                        break;
                    }
                    let at_ms = t as u64;
                    faults.push(Fault {
                        at_ms,
                        node: node.clone(),
                        kind: FaultKind::Ecc { gpu },
                        repaired_at_ms: Some(at_ms + f.repair_s * 1000),
                    });
                    t += (f.repair_s * 1000) as f64;
                }
            }
        }
        faults
    }
}
