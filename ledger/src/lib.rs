//! The pure core of fairledger.
//!
//! fairledger is an event-sourced scheduling ledger for shared GPU clusters. This crate is its
//! heart, and it does no IO: no sockets, no disk, no clock, no unseeded randomness. The services
//! feed it events and ask it for decisions; the simulator does the same with a virtual clock.
//!
//! - [`event`]: the facts ([`Envelope`], [`Event`]), serde JSON with a schema version.
//! - [`State::apply`]: the fold. Total and deterministic: an event is applied whole or rejected
//!   whole with a [`Rejection`] naming the rule it broke.
//! - [`alloc`]: the allocation tree and the hierarchical max-min split that defines *owed*.
//! - [`window`]: windowed usage in time buckets.
//! - [`book`]: the audit's figures per allocation and per hour, day, week and month, kept as
//!   the events fold.
//! - [`metrics`]: availability, occupancy, impact, utilization and fragmentation for any period.
//! - [`identity`]: principals, roles and the rules of who may do what; [`reports`]: what a
//!   node's agent may report.
//! - [`names`]: the one check of every name and string that comes from outside (the API also
//!   bounds an `Idempotency-Key` header before it scopes it to its caller).
//! - [`policy::decide`]: the scheduler as a pure function of the state and the time, returning
//!   starts, preemptions, the reservation and why each pending workload waits.
//! - [`health`]: GPU health from heartbeats and their silence, with the clock passed in.
//! - [`schedule::pass`]: one scheduling step (health first, then decisions, in batches), the
//!   same for the live scheduler and the simulator ([`sim`]).
//!
//! ```
//! use ledger::{event::*, policy::{decide, PolicyConfig}, State, StateConfig, Outcome};
//! use uuid::Uuid;
//!
//! let mut state = State::new(StateConfig::default());
//! let mut seq = 0;
//! let mut fold = |state: &mut State, t_ms, event| {
//!     seq += 1;
//!     state.apply(seq, &Envelope::new(Uuid::from_u128(seq as u128), t_ms, "doc", event))
//! };
//! fold(&mut state, 0, Event::NodeRegistered(NodeRegistered {
//!     node: "n1".into(), gpus: 8, model: "H100".into(), labels: Default::default(),
//! }));
//! fold(&mut state, 0, Event::AllocationSet(AllocationSet {
//!     path: "ai2/olmo".into(), weight: 1, max_gpus: None,
//!     max_pending_workloads: None, max_pending_gpus: None,
//! }));
//! let job = Uuid::from_u128(42);
//! let outcome = fold(&mut state, 1_000, Event::WorkloadSubmitted(WorkloadSubmitted {
//!     workload: job, allocation: Some("ai2/olmo".into()), gpus_per_node: 4, nodes: 1,
//!     model: None, priority: 0, min_runtime_s: None, duration_estimate_s: None,
//!     checkpoint_s: None, name: None, command: vec![], env: Default::default(),
//!     idempotency_key: None, notify: None,
//! }));
//! assert_eq!(outcome, Outcome::Applied);
//!
//! // The scheduler is a pure function: it proposes, the caller writes the events.
//! let plan = decide(&state, 1_000, &PolicyConfig::default());
//! assert_eq!(plan.starts().count(), 1);
//! ```
#![deny(missing_docs)]

pub mod alloc;
pub mod authority;
pub mod book;
pub mod chain;
pub mod cluster;
pub mod dryrun;
pub mod event;
pub mod health;
pub mod identity;
mod indexes;
pub mod metrics;
pub mod names;
pub mod notify;
pub mod policy;
pub mod rejection;
pub mod reports;
pub mod schedule;
pub mod settings;
pub mod sim;
pub mod state;
pub mod whatif;
pub mod window;

pub use event::{Envelope, Event, WorkloadId};
pub use rejection::Rejection;
pub use state::{Archive, Outcome, Phase, State, StateConfig, SteppedMap, Workload};
