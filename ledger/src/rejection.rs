//! Rejections: why an event did not change the state.
//!
//! A *rejection* is the fold's answer to an event that is invalid in the current state. It is data,
//! not a panic: the event stays in the log, every replica rejects it the same way, and the state is
//! exactly as before. Checks run in the order the variants are listed: ordering first (sequence,
//! time, schema), then the event's own fields, then its fit with the state.

use crate::event::Event;
use uuid::Uuid;

/// The rule an event broke. Each message says what was wrong and what to do.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Rejection {
    /// Sequences must strictly increase; this one was already applied.
    #[error(
        "sequence {seq} is not after the last applied sequence {last}; it was already applied"
    )]
    SequenceNotIncreasing {
        /// The event's sequence.
        seq: u64,
        /// The last applied sequence.
        last: u64,
    },
    /// The event claims to have happened before the ledger's present by more than the tolerated
    /// clock skew.
    #[error("occurred_at_ms {occurred_at_ms} is before the ledger's time {now_ms} by more than the {tolerance_ms} ms skew tolerated; fix the writer's clock")]
    TimeWentBackwards {
        /// The event's time.
        occurred_at_ms: u64,
        /// The ledger's time.
        now_ms: u64,
        /// The skew tolerated.
        tolerance_ms: u64,
    },
    /// The schema version is not one this build folds (newer), or not the one it takes new
    /// events in (older).
    #[error("schema_version {version} is not taken here (this build writes {supported}); write events with a fairledger of the server's version")]
    UnsupportedSchemaVersion {
        /// The event's version.
        version: u16,
        /// The version this build writes.
        supported: u16,
    },
    /// The event's actor holds no authority for it by the grants folded so far: never
    /// granted, revoked, expired, or out of its role's scope ([`crate::authority`]).
    #[error("{actor} may not write this {kind}: {reason}")]
    Unauthorized {
        /// The envelope's actor.
        actor: String,
        /// The event's kind.
        kind: &'static str,
        /// What it would need.
        reason: String,
    },
    /// A path is not one [`crate::names::path`] accepts.
    #[error("allocation path {path:?} is invalid: {reason}")]
    InvalidAllocationPath {
        /// The path given.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A field of the event is not what [`crate::names`] accepts (a node's name, a command with
    /// a NUL byte, an environment variable named `A=B`).
    #[error("{field} is invalid: {reason}")]
    InvalidField {
        /// The field at fault.
        field: &'static str,
        /// What is wrong and what to do.
        reason: String,
    },
    /// A count that must be at least 1 was 0.
    #[error("{field} must be at least 1")]
    MustBePositive {
        /// The field at fault.
        field: &'static str,
    },
    /// A node with more GPUs than the ledger tracks per node.
    #[error("a node may have at most {max} GPUs, not {gpus}")]
    TooManyGpusOnNode {
        /// GPUs asked for.
        gpus: u32,
        /// The limit.
        max: u32,
    },
    /// The allocation does not exist.
    #[error("allocation {path:?} does not exist; create it with AllocationSet first")]
    UnknownAllocation {
        /// Path given.
        path: String,
    },
    /// Workloads are charged to leaves; this allocation has children.
    #[error("allocation {path:?} has children; charge the workload to one of its leaves")]
    AllocationNotLeaf {
        /// Path given.
        path: String,
    },
    /// An allocation with children cannot be removed.
    #[error("allocation {path:?} has children; remove them first")]
    AllocationHasChildren {
        /// Path given.
        path: String,
    },
    /// An allocation with live workloads cannot be removed or given children.
    #[error(
        "allocation {path:?} has {workloads} live workloads; cancel them or let them finish first"
    )]
    AllocationInUse {
        /// Path of the allocation holding workloads.
        path: String,
        /// Pending, running or stopped workloads charged to it.
        workloads: u32,
    },
    /// The node name is registered with a different shape.
    #[error("node {node:?} is already registered with {gpus} x {model}; pick another name")]
    NodeAlreadyRegistered {
        /// Node name.
        node: String,
        /// Its registered GPU count.
        gpus: u32,
        /// Its registered model.
        model: String,
    },
    /// No such node.
    #[error("node {node:?} is not registered; register it first")]
    UnknownNode {
        /// Node name.
        node: String,
    },
    /// No such GPU on the node.
    #[error("node {node:?} has no GPU {gpu}")]
    UnknownGpu {
        /// Node name.
        node: String,
        /// GPU index.
        gpu: u32,
    },
    /// The workload id or the idempotency key's workload is already in the ledger.
    #[error("workload {workload} already exists; use a new id")]
    DuplicateWorkload {
        /// The id.
        workload: Uuid,
    },
    /// No node of the model exists.
    #[error("no node has GPU model {model:?}; pick a registered model or omit it")]
    UnknownGpuModel {
        /// The model asked for.
        model: String,
    },
    /// More GPUs per node than the largest node has.
    #[error("gpus_per_node {gpus_per_node} exceeds the largest node ({largest} GPUs); split the workload across nodes")]
    GpusPerNodeExceedLargestNode {
        /// Asked for.
        gpus_per_node: u32,
        /// The largest eligible node.
        largest: u32,
    },
    /// The gang needs more nodes than exist.
    #[error("the gang needs {nodes} nodes with {gpus_per_node} GPUs each but the cluster has at most {eligible} such nodes of one model; use fewer nodes")]
    GangLargerThanCluster {
        /// Nodes asked for.
        nodes: u32,
        /// GPUs per node asked for.
        gpus_per_node: u32,
        /// Nodes of one model that could host one member.
        eligible: u32,
    },
    /// min_runtime_s above the cluster's cap.
    #[error("min_runtime_s {min_runtime_s} exceeds the cluster's cap of {cap_s} s; ask for at most the cap")]
    MinRuntimeAboveCap {
        /// Asked for.
        min_runtime_s: u64,
        /// The cap.
        cap_s: u64,
    },
    /// A quota on waiting work is full: the submitter's, or an allocation's (or an ancestor's).
    #[error("{holder} may have at most {limit} {} waiting at once and has {waiting}: wait for some to start or end, or ask an admin to raise its {setting}", counted(*.limit, .what))]
    QuotaExceeded {
        /// Whose quota: `user:alice`, or an allocation's path.
        holder: String,
        /// What it counts: `workloads` or `GPUs`.
        what: &'static str,
        /// The setting that sets it: `max_pending` (a grant's), `max_pending_workloads` or
        /// `max_pending_gpus` (an allocation's).
        setting: &'static str,
        /// The limit.
        limit: u64,
        /// What waits now, with this submission.
        waiting: u64,
    },
    /// No such workload.
    #[error("workload {workload} is unknown")]
    UnknownWorkload {
        /// The id.
        workload: Uuid,
    },
    /// The event needs the workload in another phase (start of a cancelled workload, ...).
    #[error("workload {workload} is {phase}, but this event needs it {expected}")]
    WrongPhase {
        /// The id.
        workload: Uuid,
        /// Its phase now.
        phase: &'static str,
        /// The phase the event needs.
        expected: &'static str,
    },
    /// The placement does not match the workload's shape.
    #[error("placement gives {got}, but the workload needs {nodes} nodes x {gpus_per_node} GPUs on distinct nodes")]
    PlacementShapeMismatch {
        /// Nodes needed.
        nodes: u32,
        /// GPUs per node needed.
        gpus_per_node: u32,
        /// What the placement gave, in words.
        got: String,
    },
    /// The placement uses a node of the wrong model.
    #[error("node {node:?} has {has}, but the workload needs {model}")]
    GpuModelMismatch {
        /// Node.
        node: String,
        /// Its model.
        has: String,
        /// The model needed.
        model: String,
    },
    /// The GPU is held by another workload.
    #[error("GPU {gpu} of node {node:?} is already taken by workload {holder}")]
    GpuTaken {
        /// Node.
        node: String,
        /// GPU index.
        gpu: u32,
        /// The holder.
        holder: Uuid,
    },
    /// The node is drained: it takes no new work.
    #[error("node {node:?} is drained and takes no new work; resume it or place elsewhere")]
    NodeDraining {
        /// Node.
        node: String,
    },
    /// The GPU is unhealthy.
    #[error("GPU {gpu} of node {node:?} is unhealthy")]
    GpuUnhealthy {
        /// Node.
        node: String,
        /// GPU index.
        gpu: u32,
    },
    /// The allocation cap would be exceeded.
    #[error("allocation {path:?} may hold at most {max_gpus} GPUs; {held} are held and {asked} more were asked")]
    AllocationCapExceeded {
        /// The capped allocation.
        path: String,
        /// Its cap.
        max_gpus: u32,
        /// Held now.
        held: u64,
        /// Asked.
        asked: u64,
    },
    /// The scheduling contract protects the workload until `protected_until_ms`.
    #[error("workload {workload} is protected by its contract until {protected_until_ms} ms; only a hardware failure may preempt it before then")]
    ContractProtected {
        /// The workload.
        workload: Uuid,
        /// End of its protection.
        protected_until_ms: u64,
    },
    /// A preemption is already in progress.
    #[error("workload {workload} is already being preempted")]
    AlreadyPreempting {
        /// The workload.
        workload: Uuid,
    },
    /// `protected_until_ms` lies before the start.
    #[error("protected_until_ms {protected_until_ms} is before the start at {started_at_ms}")]
    ProtectedUntilBeforeStart {
        /// Given.
        protected_until_ms: u64,
        /// The start.
        started_at_ms: u64,
    },
    /// A protection longer than the cap allows.
    #[error("protected_until_ms {protected_until_ms} gives more than the {cap_s} s contract cap")]
    ProtectionAboveCap {
        /// Given.
        protected_until_ms: u64,
        /// The cap.
        cap_s: u64,
    },
    /// A grant's field is invalid.
    #[error("the grant's {field} is invalid: {reason}")]
    InvalidGrant {
        /// The field at fault.
        field: &'static str,
        /// What is wrong and what to do.
        reason: String,
    },
    /// A live principal already has the name.
    #[error("a principal named {name:?} exists; revoke it first or pick another name")]
    PrincipalExists {
        /// The name.
        name: String,
    },
    /// No live principal has the name.
    #[error("no live principal is named {name:?}")]
    UnknownPrincipal {
        /// The name.
        name: String,
    },
    /// The usage window's shape changes only while no allocation exists: their histories are
    /// kept in buckets of that shape.
    #[error("the usage window ({window_s} s in {window_buckets} buckets) is fixed once allocations exist; keep it, or start a new ledger")]
    WindowFixed {
        /// The window's length now.
        window_s: u64,
        /// Its buckets now.
        window_buckets: u32,
    },
    /// The last admin cannot be revoked: nobody could grant anything again.
    #[error("{name:?} is the last admin (from schema version 3, admins whose tokens expire do not count); grant another admin without an expiry before revoking it")]
    LastAdmin {
        /// The name.
        name: String,
    },
}

/// `what` (a plural: `workloads`, `GPUs`) as it reads after `n`.
fn counted(n: u64, what: &str) -> &str {
    if n == 1 {
        what.strip_suffix('s').unwrap_or(what)
    } else {
        what
    }
}

impl Rejection {
    /// A stable snake_case name of the rule broken, for metrics and the audit.
    pub fn code(&self) -> &'static str {
        match self {
            Rejection::SequenceNotIncreasing { .. } => "sequence_not_increasing",
            Rejection::TimeWentBackwards { .. } => "time_went_backwards",
            Rejection::UnsupportedSchemaVersion { .. } => "unsupported_schema_version",
            Rejection::Unauthorized { .. } => "unauthorized",
            Rejection::InvalidAllocationPath { .. } => "invalid_allocation_path",
            Rejection::InvalidField { .. } => "invalid_field",
            Rejection::MustBePositive { .. } => "must_be_positive",
            Rejection::TooManyGpusOnNode { .. } => "too_many_gpus_on_node",
            Rejection::UnknownAllocation { .. } => "unknown_allocation",
            Rejection::AllocationNotLeaf { .. } => "allocation_not_leaf",
            Rejection::AllocationHasChildren { .. } => "allocation_has_children",
            Rejection::AllocationInUse { .. } => "allocation_in_use",
            Rejection::NodeAlreadyRegistered { .. } => "node_already_registered",
            Rejection::UnknownNode { .. } => "unknown_node",
            Rejection::UnknownGpu { .. } => "unknown_gpu",
            Rejection::DuplicateWorkload { .. } => "duplicate_workload",
            Rejection::UnknownGpuModel { .. } => "unknown_gpu_model",
            Rejection::GpusPerNodeExceedLargestNode { .. } => "gpus_per_node_exceed_largest_node",
            Rejection::GangLargerThanCluster { .. } => "gang_larger_than_cluster",
            Rejection::MinRuntimeAboveCap { .. } => "min_runtime_above_cap",
            Rejection::QuotaExceeded { .. } => "quota_exceeded",
            Rejection::UnknownWorkload { .. } => "unknown_workload",
            Rejection::WrongPhase { .. } => "wrong_phase",
            Rejection::PlacementShapeMismatch { .. } => "placement_shape_mismatch",
            Rejection::GpuModelMismatch { .. } => "gpu_model_mismatch",
            Rejection::GpuTaken { .. } => "gpu_taken",
            Rejection::NodeDraining { .. } => "node_draining",
            Rejection::GpuUnhealthy { .. } => "gpu_unhealthy",
            Rejection::AllocationCapExceeded { .. } => "allocation_cap_exceeded",
            Rejection::ContractProtected { .. } => "contract_protected",
            Rejection::AlreadyPreempting { .. } => "already_preempting",
            Rejection::ProtectedUntilBeforeStart { .. } => "protected_until_before_start",
            Rejection::ProtectionAboveCap { .. } => "protection_above_cap",
            Rejection::InvalidGrant { .. } => "invalid_grant",
            Rejection::PrincipalExists { .. } => "principal_exists",
            Rejection::UnknownPrincipal { .. } => "unknown_principal",
            Rejection::LastAdmin { .. } => "last_admin",
            Rejection::WindowFixed { .. } => "window_fixed",
        }
    }

    /// The field of `event` at fault when the event itself is invalid whatever the state (a
    /// request that carries it answers 422 naming the field); `None` when the event only does
    /// not fit the state now (409).
    pub fn field_in(&self, event: &Event) -> Option<&'static str> {
        // Where an event names allocations: one path, or a grant's list.
        let allocation_field = match event {
            Event::AllocationSet(_) | Event::AllocationRemoved(_) => "path",
            Event::PrincipalGranted(_) => "allocations",
            _ => "allocation",
        };
        match self {
            Rejection::InvalidAllocationPath { .. } => Some(allocation_field),
            Rejection::InvalidField { field, .. }
            | Rejection::MustBePositive { field }
            | Rejection::InvalidGrant { field, .. } => Some(field),
            Rejection::TooManyGpusOnNode { .. } => Some("gpus"),
            // Removing what is not there, or no longer, is a conflict with the state.
            Rejection::UnknownAllocation { .. } if matches!(event, Event::AllocationRemoved(_)) => {
                None
            }
            Rejection::UnknownAllocation { .. } | Rejection::AllocationNotLeaf { .. } => {
                Some(allocation_field)
            }
            Rejection::UnknownGpuModel { .. } => Some("model"),
            Rejection::GpusPerNodeExceedLargestNode { .. } => Some("gpus_per_node"),
            Rejection::GangLargerThanCluster { .. } => Some("nodes"),
            Rejection::MinRuntimeAboveCap { .. } => Some("min_runtime_s"),
            _ => None,
        }
    }
}
