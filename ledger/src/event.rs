//! Events: the immutable facts the ledger is folded from.
//!
//! An *event* is something that happened — a past-tense fact such as [`WorkloadStarted`] — wrapped
//! in an [`Envelope`] that says who wrote it and when. Time and ids are supplied by the writer;
//! the ledger never reads a clock or generates an id. The JSON shape of every event is checked in
//! under `schemas/` and is the contract for downstream consumers.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, Visitor};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

pub use crate::identity::{PrincipalGranted, PrincipalRevoked, Role};

/// The schema version this build writes. It reads every version from
/// [`OLDEST_SCHEMA_VERSION`] up: payloads keep their shape across versions (fields are only
/// added), while what they may hold can narrow.
///
/// - 1: the first.
/// - 2: names hold to [`crate::names`] (node names, GPU models, labels, allocation path
///   segments, and what a workload runs). A version-1 event is folded by the rules of its day,
///   so a replay of an old log comes out as it did when it was written.
/// - 3: the last admin is the last whose token does not expire: an admin is not revoked while
///   only admins whose tokens expire would be left (who would all be locked out in time). A
///   version-2 revocation is folded by the rule of its day. The ledger's settings are an event
///   (`settings_set`).
/// - 4: quotas. A submission is refused past its allocation's (or an ancestor's)
///   `max_pending_workloads` or `max_pending_gpus`, or past its submitter's cap on waiting
///   workloads (the grant's `max_pending`, else [`crate::identity::DEFAULT_MAX_PENDING`] for
///   anyone but an admin). Earlier submissions are folded without them.
/// - 5: authority in the fold. The role `service` (the service's own processes, whose actor is
///   the bare name: `serve`, `scheduler`); its first grant, written by its holder for itself,
///   is the log's root, and from it on every event's actor must hold the authority the event
///   needs by the grants folded before it ([`crate::authority`]). A log without a root folds as
///   before.
pub const SCHEMA_VERSION: u16 = 5;

/// The oldest schema version this build folds.
pub const OLDEST_SCHEMA_VERSION: u16 = 1;

/// A workload's id: a UUIDv7 chosen by whoever submitted it.
pub type WorkloadId = Uuid;

/// One event with its metadata; JSON on the wire.
#[derive(Clone, Debug, PartialEq, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Envelope {
    /// Unique id of this event (UUIDv7, supplied by the writer).
    pub id: Uuid,
    /// Version of the payload schema; see [`SCHEMA_VERSION`].
    pub schema_version: u16,
    /// When the fact happened, in milliseconds since the Unix epoch (or since the start of a
    /// simulation), supplied by the writer.
    pub occurred_at_ms: u64,
    /// The event that caused this one, if any (a start is caused by a submission).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub causation_id: Option<Uuid>,
    /// Groups the events of one workflow, for tracing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub correlation_id: Option<Uuid>,
    /// Who caused the event: the authenticated principal (`user:<name>`, `agent:<name>`), or a
    /// role of the service itself (`scheduler`, `serve`); `sim` in simulations.
    pub actor: String,
    /// The fact itself.
    #[serde(flatten)]
    pub event: Event,
}

impl Envelope {
    /// Wraps an event with the current schema version and no causation.
    pub fn new(id: Uuid, occurred_at_ms: u64, actor: impl Into<String>, event: Event) -> Self {
        Envelope {
            id,
            schema_version: SCHEMA_VERSION,
            occurred_at_ms,
            causation_id: None,
            correlation_id: None,
            actor: actor.into(),
            event,
        }
    }
}

/// Every kind of fact, tagged by `type` with its `payload`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type", content = "payload", rename_all = "snake_case")]
pub enum Event {
    /// An allocation was created or its weight or cap changed.
    AllocationSet(AllocationSet),
    /// An allocation was removed.
    AllocationRemoved(AllocationRemoved),
    /// A node joined the cluster.
    NodeRegistered(NodeRegistered),
    /// Readings of a node's GPUs (telemetry).
    GpuHeartbeat(GpuHeartbeat),
    /// A GPU became healthy or unhealthy.
    GpuHealthChanged(GpuHealthChanged),
    /// A node takes no new work; what runs there runs on.
    NodeDrained(NodeDrained),
    /// A drained node takes work again.
    NodeResumed(NodeResumed),
    /// A workload entered the queue.
    WorkloadSubmitted(WorkloadSubmitted),
    /// A workload that was not running was withdrawn.
    WorkloadCancelled(WorkloadCancelled),
    /// A workload was placed on GPUs and started.
    WorkloadStarted(WorkloadStarted),
    /// A running workload was asked to stop within a grace period.
    PreemptionRequested(PreemptionRequested),
    /// A running workload stopped before finishing its work.
    WorkloadStopped(WorkloadStopped),
    /// A running workload ended by itself.
    WorkloadFinished(WorkloadFinished),
    /// A stopped workload went back to the queue with its remaining work.
    WorkloadRequeued(WorkloadRequeued),
    /// A principal was given a role and a token.
    PrincipalGranted(PrincipalGranted),
    /// A principal's token was revoked.
    PrincipalRevoked(PrincipalRevoked),
    /// The ledger's settings, from here on (see [`crate::settings`]).
    SettingsSet(crate::settings::Settings),
}

impl Event {
    /// The snake_case kind, as in the `type` field and the NATS subject.
    pub fn kind(&self) -> &'static str {
        match self {
            Event::AllocationSet(_) => "allocation_set",
            Event::AllocationRemoved(_) => "allocation_removed",
            Event::NodeRegistered(_) => "node_registered",
            Event::GpuHeartbeat(_) => "gpu_heartbeat",
            Event::GpuHealthChanged(_) => "gpu_health_changed",
            Event::NodeDrained(_) => "node_drained",
            Event::NodeResumed(_) => "node_resumed",
            Event::WorkloadSubmitted(_) => "workload_submitted",
            Event::WorkloadCancelled(_) => "workload_cancelled",
            Event::WorkloadStarted(_) => "workload_started",
            Event::PreemptionRequested(_) => "preemption_requested",
            Event::WorkloadStopped(_) => "workload_stopped",
            Event::WorkloadFinished(_) => "workload_finished",
            Event::WorkloadRequeued(_) => "workload_requeued",
            Event::PrincipalGranted(_) => "principal_granted",
            Event::PrincipalRevoked(_) => "principal_revoked",
            Event::SettingsSet(_) => "settings_set",
        }
    }

    /// The workload this event is about, if it is about one.
    pub fn workload(&self) -> Option<WorkloadId> {
        match self {
            Event::WorkloadSubmitted(e) => Some(e.workload),
            Event::WorkloadCancelled(e) => Some(e.workload),
            Event::WorkloadStarted(e) => Some(e.workload),
            Event::PreemptionRequested(e) => Some(e.workload),
            Event::WorkloadStopped(e) => Some(e.workload),
            Event::WorkloadFinished(e) => Some(e.workload),
            Event::WorkloadRequeued(e) => Some(e.workload),
            Event::AllocationSet(_)
            | Event::AllocationRemoved(_)
            | Event::NodeRegistered(_)
            | Event::GpuHeartbeat(_)
            | Event::GpuHealthChanged(_)
            | Event::NodeDrained(_)
            | Event::NodeResumed(_)
            | Event::PrincipalGranted(_)
            | Event::PrincipalRevoked(_)
            | Event::SettingsSet(_) => None,
        }
    }
}

/// The fields of an envelope on the wire.
#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "snake_case")]
enum Field {
    Id,
    SchemaVersion,
    OccurredAtMs,
    CausationId,
    CorrelationId,
    Actor,
    Type,
    Payload,
}

/// Declares [`Kind`], an event's `type` on its own, and how to read the payload of each kind.
macro_rules! kinds {
    ($($variant:ident),* $(,)?) => {
        /// An event's `type`, read before its payload so the payload is read straight into
        /// its own struct.
        #[derive(Clone, Copy, Deserialize)]
        #[serde(rename_all = "snake_case")]
        enum Kind {
            $($variant),*
        }

        /// Never called: it stops the build when an event has no kind here.
        #[allow(dead_code)]
        fn kind_of(event: &Event) -> Kind {
            match event {
                $(Event::$variant(_) => Kind::$variant),*
            }
        }

        impl<'de> DeserializeSeed<'de> for Kind {
            type Value = Event;

            fn deserialize<D: Deserializer<'de>>(self, payload: D) -> Result<Event, D::Error> {
                Ok(match self {
                    $(Kind::$variant => Event::$variant(Deserialize::deserialize(payload)?)),*
                })
            }
        }
    };
}

kinds!(
    AllocationSet,
    AllocationRemoved,
    NodeRegistered,
    GpuHeartbeat,
    GpuHealthChanged,
    NodeDrained,
    NodeResumed,
    WorkloadSubmitted,
    WorkloadCancelled,
    WorkloadStarted,
    PreemptionRequested,
    WorkloadStopped,
    WorkloadFinished,
    WorkloadRequeued,
    PrincipalGranted,
    PrincipalRevoked,
    SettingsSet,
);

/// Reads an envelope as derived code would read it with the event flattened in, without what
/// flattening costs: serde buffers a flattened field's every key and string before it reads
/// them again, which was most of the time a replay spent reading events. Here the payload is
/// read straight into its struct once its `type` is known; a payload that comes before its
/// `type` (any key order is valid JSON) is buffered as a JSON value and read after.
impl<'de> Deserialize<'de> for Envelope {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(EnvelopeVisitor)
    }
}

struct EnvelopeVisitor;

/// An envelope's payload as read: into its struct, or held until its `type` comes. A local of
/// one read, so its size costs nothing; boxing the event would cost an allocation per event.
#[allow(clippy::large_enum_variant)]
enum Payload {
    Read(Event),
    Held(serde_json::Value),
}

/// Takes the value of a field seen for the first time.
fn once<T, E: de::Error>(slot: &mut Option<T>, name: &'static str, value: T) -> Result<(), E> {
    if slot.is_some() {
        return Err(E::duplicate_field(name));
    }
    *slot = Some(value);
    Ok(())
}

impl<'de> Visitor<'de> for EnvelopeVisitor {
    type Value = Envelope;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an event envelope")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Envelope, A::Error> {
        let mut id = None;
        let mut schema_version = None;
        let mut occurred_at_ms = None;
        let mut causation_id = None;
        let mut correlation_id = None;
        let mut actor = None;
        let mut kind: Option<Kind> = None;
        let mut payload = None;
        while let Some(field) = map.next_key::<Field>()? {
            match field {
                Field::Id => once(&mut id, "id", map.next_value()?)?,
                Field::SchemaVersion => {
                    once(&mut schema_version, "schema_version", map.next_value()?)?
                }
                Field::OccurredAtMs => {
                    once(&mut occurred_at_ms, "occurred_at_ms", map.next_value()?)?
                }
                Field::CausationId => once(
                    &mut causation_id,
                    "causation_id",
                    map.next_value::<Option<Uuid>>()?,
                )?,
                Field::CorrelationId => once(
                    &mut correlation_id,
                    "correlation_id",
                    map.next_value::<Option<Uuid>>()?,
                )?,
                Field::Actor => once(&mut actor, "actor", map.next_value::<String>()?)?,
                Field::Type => once(&mut kind, "type", map.next_value()?)?,
                Field::Payload => {
                    let read = match kind {
                        Some(kind) => Payload::Read(map.next_value_seed(kind)?),
                        None => Payload::Held(map.next_value()?),
                    };
                    once(&mut payload, "payload", read)?
                }
            }
        }
        let id = id.ok_or_else(|| de::Error::missing_field("id"))?;
        let schema_version =
            schema_version.ok_or_else(|| de::Error::missing_field("schema_version"))?;
        let occurred_at_ms =
            occurred_at_ms.ok_or_else(|| de::Error::missing_field("occurred_at_ms"))?;
        let actor = actor.ok_or_else(|| de::Error::missing_field("actor"))?;
        let kind = kind.ok_or_else(|| de::Error::missing_field("type"))?;
        let event = match payload.ok_or_else(|| de::Error::missing_field("payload"))? {
            Payload::Read(event) => event,
            Payload::Held(payload) => kind.deserialize(payload).map_err(de::Error::custom)?,
        };
        Ok(Envelope {
            id,
            schema_version,
            occurred_at_ms,
            causation_id: causation_id.flatten(),
            correlation_id: correlation_id.flatten(),
            actor,
            event,
        })
    }
}

/// An allocation (a share of the cluster) was created or changed. Missing parents of the path are
/// created with weight 1.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AllocationSet {
    /// Slash-separated path, e.g. `ai2/olmo/pretrain`.
    pub path: String,
    /// Weight relative to its siblings; at least 1.
    pub weight: u32,
    /// Optional hard cap on the GPUs its subtree may hold at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_gpus: Option<u32>,
    /// Most workloads its subtree may have waiting at once: a submission past it is refused
    /// (schema 4 on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_pending_workloads: Option<u32>,
    /// Most GPUs its subtree's waiting workloads may ask for at once (schema 4 on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_pending_gpus: Option<u64>,
}

/// An allocation was removed; it must have no children and no live workloads.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AllocationRemoved {
    /// Path of the allocation.
    pub path: String,
}

/// A node and its GPUs joined the cluster. Registering the same node again with the same shape is a
/// no-op (an agent restarting).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NodeRegistered {
    /// Unique node name.
    pub node: String,
    /// Number of GPUs, 1 to 64.
    pub gpus: u32,
    /// GPU model, e.g. `H100`.
    pub model: String,
    /// Topology labels such as `rack` or `zone`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

/// A node was drained: no workload is placed on it from now on, and the work running there runs
/// to its end (maintenance, a suspect machine). Its GPUs stay in the cluster's capacity: mark them
/// unhealthy to take them out of the owed split too.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NodeDrained {
    /// Node name.
    pub node: String,
    /// Why, for the audit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// A drained node takes work again.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NodeResumed {
    /// Node name.
    pub node: String,
}

/// One GPU's readings in a heartbeat.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GpuReading {
    /// GPU index on the node.
    pub gpu: u32,
    /// Vendor UUID, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// Compute utilization, 0 to 100.
    pub utilization_pct: u8,
    /// Memory in use.
    #[serde(default)]
    pub memory_used_mib: u64,
    /// Memory installed.
    #[serde(default)]
    pub memory_total_mib: u64,
    /// Temperature.
    #[serde(default)]
    pub temperature_c: u32,
    /// Power draw.
    #[serde(default)]
    pub power_w: u32,
    /// Uncorrected ECC errors since boot.
    #[serde(default)]
    pub ecc_errors_uncorrected: u64,
    /// A fault the GPU itself reports (pending page retirement, a critical XID error), which
    /// makes it unhealthy until a heartbeat without one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fault: Option<String>,
}

/// Periodic readings of a node's GPUs. Lives on the telemetry stream; the fold uses it only for the
/// utilization metric.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GpuHeartbeat {
    /// Node name.
    pub node: String,
    /// One reading per GPU reported.
    pub readings: Vec<GpuReading>,
}

/// A GPU's health changed. Unhealthy GPUs leave the available capacity and are never placed on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GpuHealthChanged {
    /// Node name.
    pub node: String,
    /// GPU index on the node.
    pub gpu: u32,
    /// The new health.
    pub healthy: bool,
    /// Why, for the audit (`heartbeat timeout`, `xid 79`, ...).
    pub reason: String,
}

/// A workload entered the queue.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WorkloadSubmitted {
    /// Its id (UUIDv7, chosen by the submitter).
    pub workload: WorkloadId,
    /// Leaf allocation charged; `None` is unallocated (opportunistic) work.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocation: Option<String>,
    /// GPUs on each node, at least 1.
    pub gpus_per_node: u32,
    /// Nodes in the gang, at least 1; all start together or none do.
    #[serde(default = "one")]
    pub nodes: u32,
    /// Required GPU model, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Order within its allocation; higher first.
    #[serde(default)]
    pub priority: i32,
    /// Requested protection from preemption; defaults to the cluster's and may not exceed the cap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_runtime_s: Option<u64>,
    /// Expected run time, used for backfill and start estimates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_estimate_s: Option<u64>,
    /// How often the workload checkpoints; work since the last one is lost on preemption.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_s: Option<u64>,
    /// Human-readable name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Command line the node agent launches.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub command: Vec<String>,
    /// Environment for the command.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Client key: a second submission with the same key is answered with this workload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    /// Where its events are posted (started, preemption requested, stopped, requeued,
    /// finished, cancelled); under a prefix the settings' `notify_urls` allow. Without it, its
    /// submitter's default, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub notify: Option<String>,
}

fn one() -> u32 {
    1
}

impl WorkloadSubmitted {
    /// A submission of `nodes` x `gpus_per_node` GPUs charged to `allocation`, every optional
    /// field unset; set the others on the value.
    pub fn new(
        workload: WorkloadId,
        allocation: Option<String>,
        gpus_per_node: u32,
        nodes: u32,
    ) -> Self {
        WorkloadSubmitted {
            workload,
            allocation,
            gpus_per_node,
            nodes,
            model: None,
            priority: 0,
            min_runtime_s: None,
            duration_estimate_s: None,
            checkpoint_s: None,
            name: None,
            command: Vec::new(),
            env: BTreeMap::new(),
            idempotency_key: None,
            notify: None,
        }
    }
}

/// A pending or stopped workload was withdrawn. A running one must be preempted first.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WorkloadCancelled {
    /// The workload.
    pub workload: WorkloadId,
    /// Why, for the audit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// The GPUs of one node given to a workload.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PlacedNode {
    /// Node name.
    pub node: String,
    /// GPU indices on that node.
    pub gpus: Vec<u32>,
}

/// A workload was placed and started.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WorkloadStarted {
    /// The workload.
    pub workload: WorkloadId,
    /// One entry per node of the gang.
    pub placement: Vec<PlacedNode>,
    /// Until this instant the workload may be preempted only for hardware failure.
    pub protected_until_ms: u64,
    /// A *borrowed* placement: the GPUs were reserved for a pending workload and are lent until
    /// it can start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub borrowed: Option<Borrowed>,
}

/// GPUs a reservation lends: the borrower accepts a contract with its lender that ends when the
/// reservation is due (a grace period before, so it has left by then), or at once when that is
/// not known. From then on the reservation may take them back ([`PreemptionReason::Reclaimed`]),
/// which is no contract violation; any other preemption still waits for `protected_until_ms`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Borrowed {
    /// The pending workload the GPUs are reserved for.
    pub reserved_for: WorkloadId,
    /// From this instant the reservation may take the GPUs back.
    pub until_ms: u64,
}

/// Why a running workload is asked to stop.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum PreemptionReason {
    /// Work from an allocation ranked sufficiently above needs the GPUs.
    FairShare,
    /// Unallocated (opportunistic) work yields to allocated work.
    Opportunistic,
    /// One of its GPUs failed: the contract's one exception.
    HardwareFailure,
    /// Its owner cancelled it.
    UserCancelled,
    /// It runs on GPUs borrowed from a reservation ([`WorkloadStarted::borrowed`]), whose
    /// workload now needs them, and the borrowing's term is over.
    Reclaimed,
    /// Its node is assembled into a whole one for blocked multi-GPU work of an under-served
    /// allocation ranked below its own, while other nodes have room for it to start again at
    /// once (`defragment` in the policy's configuration). Past its contract only.
    Defragment,
}

/// A running workload was asked to stop within a grace period.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PreemptionRequested {
    /// The victim.
    pub workload: WorkloadId,
    /// Why.
    pub reason: PreemptionReason,
    /// The workload the GPUs are wanted for, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub beneficiary: Option<WorkloadId>,
    /// Time to checkpoint before the GPUs are taken.
    pub grace_s: u64,
}

/// Why a running workload stopped without finishing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// Preempted by the scheduler; it will be requeued.
    Preempted,
    /// Its hardware failed; it will be requeued and this is no contract violation.
    HardwareFailure,
    /// Its owner cancelled it; terminal.
    Cancelled,
    /// The node lost it (agent restart, node gone); it will be requeued.
    Lost,
}

/// A running workload stopped; its GPUs are free.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WorkloadStopped {
    /// The workload.
    pub workload: WorkloadId,
    /// Why.
    pub reason: StopReason,
}

/// A running workload ended by itself; its GPUs are free.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WorkloadFinished {
    /// The workload.
    pub workload: WorkloadId,
    /// Exit code, when it exited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// Signal number, when a signal ended it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    /// Why it failed without running its command (the node could not launch it), when so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A stopped workload went back to the queue, keeping its place in submission order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WorkloadRequeued {
    /// The workload.
    pub workload: WorkloadId,
    /// Run time lost since its last checkpoint, in seconds.
    #[serde(default)]
    pub work_lost_s: u64,
}
