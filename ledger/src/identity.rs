//! Identity: who may write what, and who wrote it.
//!
//! A *principal* is a person, agent or service the ledger knows by name. It holds one [`Role`],
//! scoped where the role needs it (a submitter to allocation subtrees, an agent to one node), and
//! proves who it is with a bearer token of which the ledger keeps only the SHA-256 digest. Grants
//! and revocations are events ([`PrincipalGranted`], [`PrincipalRevoked`]), so who could do what,
//! and when, is folded, replayed and audited like every other fact, and reaches every replica.
//!
//! The rules of what each role may do live here as pure functions: a service maps a request to an
//! [`Action`] and asks [`Principal::allows`]. The *actor* of every event a principal causes is
//! [`Principal::actor`] (`user:alice`, `agent:gpu-17`), never a name the writer chose.
//!
//! | role | may |
//! | --- | --- |
//! | `admin` | everything: the allocation tree, tokens, any workload, every read |
//! | `operator` | register, drain and resume nodes, cancel any workload, read (events without `command`/`env`) |
//! | `submitter` | submit into, cancel and stop in its allocation subtrees; read (events without `command`/`env`) |
//! | `agent` | its node's registration, heartbeats and the ends of runs placed on it; read the events (it launches their commands) |
//! | `auditor` | every read, the audit and events included |
//! | `viewer` | read (events without `command`/`env`) |
//! | `service` | the service's own processes (`serve`, `scheduler`): everything, placing and preempting work included; granted only by the service |
//!
//! The fold holds every event's actor to these rules ([`crate::authority`]) from the log's
//! *root* on: the first grant of the role `service`, which its holder writes for itself.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::alloc::AllocationTree;
use crate::rejection::Rejection;

/// The scope that lets a submitter charge any allocation, or none (unallocated work).
pub const ANY_ALLOCATION: &str = "*";

/// What a principal is for.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// The allocation tree, tokens, any workload, every read.
    Admin,
    /// Nodes (registration, drain and resume), cancelling any workload, reads, workloads'
    /// output.
    Operator,
    /// Submitting into, cancelling and stopping in its allocation subtrees; reads; its own
    /// workloads' output.
    Submitter,
    /// One node: its registration, heartbeats and the ends of the runs placed on it.
    Agent,
    /// Every read, the audit and the events included.
    Auditor,
    /// Reads, without submissions' `command` and `env`.
    Viewer,
    /// The service's own processes (`serve`, `scheduler`): everything, placing and preempting
    /// work included (schema 5 on). Its actor is its bare name; only the service grants it.
    Service,
}

impl Role {
    /// Every role an admin grants, in the order of the table above ([`Role::Service`] is the
    /// service's own).
    pub const ALL: [Role; 6] = [
        Role::Admin,
        Role::Operator,
        Role::Submitter,
        Role::Agent,
        Role::Auditor,
        Role::Viewer,
    ];

    /// The role's name, as in JSON and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::Operator => "operator",
            Role::Submitter => "submitter",
            Role::Agent => "agent",
            Role::Auditor => "auditor",
            Role::Viewer => "viewer",
            Role::Service => "service",
        }
    }

    /// The role named `name`.
    pub fn parse(name: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.name() == name)
    }

    /// Whether the role may ever take an action of `kind`, whatever its scope.
    pub fn may(self, kind: ActionKind) -> bool {
        use ActionKind::*;
        use Role::*;
        if self == Service {
            return true;
        }
        match kind {
            Schedule => false,
            WhoAmI => true,
            Read => self != Agent,
            ReadEvents => true,
            ReadAudit => matches!(self, Admin | Auditor),
            SetAllocations | SetSettings | ManageTokens => self == Admin,
            Submit => matches!(self, Admin | Submitter),
            Cancel => matches!(self, Admin | Operator | Submitter),
            RegisterNode => matches!(self, Admin | Operator | Agent),
            DrainNode => matches!(self, Admin | Operator),
            ReportForNode => self == Agent,
            WhatIf => matches!(self, Admin | Auditor | Submitter),
            ReadOutput => matches!(self, Admin | Operator | Submitter | Auditor),
        }
    }

    /// Whether events read by this role show submissions' `command`, `env` and `notify` (an
    /// auditor and an admin see everything; an agent asks for the command of a run placed on
    /// its node when it launches it, so it never reads another node's).
    pub fn sees_commands(self) -> bool {
        matches!(self, Role::Admin | Role::Auditor | Role::Service)
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A request, as the rules see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action<'a> {
    /// Ask who one is.
    WhoAmI,
    /// Read the cluster: workloads, the queue, allocations, nodes, cluster metrics.
    Read,
    /// Read the ledger's events.
    ReadEvents,
    /// Read the audit: owed and delivered per period, a workload's every event.
    ReadAudit,
    /// Create, change or remove allocations.
    SetAllocations,
    /// Change the ledger's settings (the policy and its parameters).
    SetSettings,
    /// Create, list or revoke tokens.
    ManageTokens,
    /// Submit a workload charged to `allocation` (`None`: unallocated work).
    Submit {
        /// The leaf charged.
        allocation: Option<&'a str>,
    },
    /// Cancel, or ask to stop, a workload charged to `allocation`.
    Cancel {
        /// The leaf the workload is charged to.
        allocation: Option<&'a str>,
    },
    /// Register `node`.
    RegisterNode {
        /// The node.
        node: &'a str,
    },
    /// Drain or resume a node.
    DrainNode,
    /// Report for `node`: heartbeats, the ends of runs placed on it.
    ReportForNode {
        /// The node.
        node: &'a str,
    },
    /// Try changes in a what-if (nothing is written): `allocation` names the allocation a
    /// change touches, `None` a change to the whole cluster (policy, capacity).
    WhatIf {
        /// The allocation the change touches.
        allocation: Option<&'a str>,
    },
    /// Read what a workload's runs wrote (their output may hold secrets: its submitter's, and
    /// the operators', admins' and auditors').
    ReadOutput {
        /// The actor who submitted the workload.
        submitter: &'a str,
    },
    /// Place, preempt and requeue work: the scheduler's decisions.
    Schedule,
}

/// The kind of an [`Action`], without its scope: what a route needs before its body is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActionKind {
    /// [`Action::WhoAmI`].
    WhoAmI,
    /// [`Action::Read`].
    Read,
    /// [`Action::ReadEvents`].
    ReadEvents,
    /// [`Action::ReadAudit`].
    ReadAudit,
    /// [`Action::SetAllocations`].
    SetAllocations,
    /// [`Action::SetSettings`].
    SetSettings,
    /// [`Action::ManageTokens`].
    ManageTokens,
    /// [`Action::Submit`].
    Submit,
    /// [`Action::Cancel`].
    Cancel,
    /// [`Action::RegisterNode`].
    RegisterNode,
    /// [`Action::DrainNode`].
    DrainNode,
    /// [`Action::ReportForNode`].
    ReportForNode,
    /// [`Action::WhatIf`].
    WhatIf,
    /// [`Action::ReadOutput`].
    ReadOutput,
    /// [`Action::Schedule`].
    Schedule,
}

impl ActionKind {
    /// The roles that may take actions of this kind, for messages.
    pub fn roles(self) -> Vec<Role> {
        Role::ALL.into_iter().filter(|r| r.may(self)).collect()
    }
}

impl Action<'_> {
    /// Its kind.
    pub fn kind(&self) -> ActionKind {
        match self {
            Action::WhoAmI => ActionKind::WhoAmI,
            Action::Read => ActionKind::Read,
            Action::ReadEvents => ActionKind::ReadEvents,
            Action::ReadAudit => ActionKind::ReadAudit,
            Action::SetAllocations => ActionKind::SetAllocations,
            Action::SetSettings => ActionKind::SetSettings,
            Action::ManageTokens => ActionKind::ManageTokens,
            Action::Submit { .. } => ActionKind::Submit,
            Action::Cancel { .. } => ActionKind::Cancel,
            Action::RegisterNode { .. } => ActionKind::RegisterNode,
            Action::DrainNode => ActionKind::DrainNode,
            Action::ReportForNode { .. } => ActionKind::ReportForNode,
            Action::WhatIf { .. } => ActionKind::WhatIf,
            Action::ReadOutput { .. } => ActionKind::ReadOutput,
            Action::Schedule => ActionKind::Schedule,
        }
    }
}

/// Why a principal may not take an action: what it would need.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Denied(pub String);

/// A principal granted and not revoked.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Principal {
    /// Its name, unique among live principals.
    pub name: String,
    /// Its role.
    pub role: Role,
    /// A submitter's allocation subtrees.
    pub allocations: Vec<String>,
    /// An agent's node.
    pub node: Option<String>,
    /// SHA-256 of its token, lower-case hex.
    pub token_sha256: String,
    /// After this instant its token is refused.
    pub expires_at_ms: Option<u64>,
    /// Its cap on waiting workloads, as granted.
    #[serde(default)]
    pub max_pending: Option<u32>,
    /// Its rates, as granted.
    #[serde(default)]
    pub rates: Option<Rates>,
    /// Where its workloads' events go by default.
    #[serde(default)]
    pub notify: Option<String>,
    /// The Unix user its workloads run as where agents run them as their submitters.
    #[serde(default)]
    pub unix_user: Option<String>,
    /// The actor that granted it.
    pub granted_by: String,
    /// When it was granted.
    pub granted_at_ms: u64,
    /// The sequence of the grant.
    pub granted_seq: u64,
}

/// How many workloads a principal other than an admin may have waiting at once when its grant
/// names no cap: enough for any sane use, few enough that one submitter cannot bury the queue.
pub const DEFAULT_MAX_PENDING: u32 = 10_000;

impl Principal {
    /// Its cap on waiting workloads: the grant's, else none for an admin and
    /// [`DEFAULT_MAX_PENDING`] for anyone else.
    pub fn pending_cap(&self) -> Option<u32> {
        match (self.max_pending, self.role) {
            (Some(cap), _) => Some(cap),
            (None, Role::Admin | Role::Service) => None,
            (None, _) => Some(DEFAULT_MAX_PENDING),
        }
    }

    /// How many times a minute it may do `kind`: the grant's rate, else none for an admin or an
    /// agent (the service's own) and [`Rates::DEFAULT`]'s for anyone else.
    pub fn rate(&self, kind: RateKind) -> Option<u32> {
        match (self.rates.and_then(|r| r.of(kind)), self.role) {
            (Some(rate), _) => Some(rate),
            (None, Role::Admin | Role::Agent | Role::Service) => None,
            (None, _) => Rates::DEFAULT.of(kind),
        }
    }
}

/// Whether `path` is `scope` or lies below it.
fn under(path: &str, scope: &str) -> bool {
    path == scope
        || path
            .strip_prefix(scope)
            .is_some_and(|rest| rest.starts_with('/'))
}

impl Principal {
    /// The actor of every event this principal causes: `agent:<name>` for agents, the bare name
    /// for the service's own, else `user:<name>`.
    pub fn actor(&self) -> String {
        actor_of(self.role, &self.name)
    }

    /// Whether its token is refused at `now_ms` because it expired.
    pub fn expired_at(&self, now_ms: u64) -> bool {
        self.expires_at_ms.is_some_and(|t| now_ms >= t)
    }

    /// Whether it may take `action` with the allocation tree as it is: `Err` says what it would
    /// need. Scopes name subtrees; an allocation removed since the grant no longer grants
    /// anything.
    pub fn allows(&self, action: &Action, tree: &AllocationTree) -> Result<(), Denied> {
        self.may(action.kind())?;
        match *action {
            Action::Submit { allocation } | Action::Cancel { allocation }
                if self.role == Role::Submitter =>
            {
                self.covers(allocation, tree)
            }
            // A submitter tries changes to its own allocations only.
            Action::WhatIf { allocation } if self.role == Role::Submitter => match allocation {
                Some(path) => self.covers(Some(path), tree),
                None => Err(Denied(format!(
                    "a change to the whole cluster (policy, capacity) needs the role admin or auditor; {:?} is a submitter, who may try changes to its own allocations",
                    self.name
                ))),
            },
            Action::ReadOutput { submitter } if self.role == Role::Submitter => {
                if submitter == self.actor() {
                    Ok(())
                } else {
                    Err(Denied(format!(
                        "a workload's output is its submitter's ({submitter}) to read, or an operator's, admin's or auditor's; {:?} did not submit it",
                        self.name
                    )))
                }
            }
            Action::RegisterNode { node } | Action::ReportForNode { node }
                if self.role == Role::Agent =>
            {
                match &self.node {
                    Some(own) if own == node => Ok(()),
                    own => Err(Denied(format!(
                        "this needs the agent token of node {node:?}; {:?} is the agent of node {:?}",
                        self.name,
                        own.as_deref().unwrap_or("-")
                    ))),
                }
            }
            _ => Ok(()),
        }
    }

    /// Whether its role may ever take actions of `kind`, whatever the scope: `Err` names the
    /// roles that may.
    pub fn may(&self, kind: ActionKind) -> Result<(), Denied> {
        if self.role.may(kind) {
            return Ok(());
        }
        let roles: Vec<&str> = kind.roles().iter().map(|r| r.name()).collect();
        if roles.is_empty() {
            return Err(Denied(format!(
                "this is the service's own to do (the scheduler's); {:?} is {}",
                self.name, self.role
            )));
        }
        Err(Denied(format!(
            "this needs the role {}; {:?} is {}",
            roles.join(" or "),
            self.name,
            self.role
        )))
    }

    /// Whether a submitter's scopes cover `allocation`.
    fn covers(&self, allocation: Option<&str>, tree: &AllocationTree) -> Result<(), Denied> {
        if self.allocations.iter().any(|s| s == ANY_ALLOCATION) {
            return Ok(());
        }
        let scopes: Vec<String> = self.allocations.iter().map(|s| format!("{s:?}")).collect();
        let scopes = scopes.join(", ");
        let Some(path) = allocation else {
            return Err(Denied(format!(
                "unallocated work needs a submitter scoped to {ANY_ALLOCATION:?}; {:?} is scoped to {scopes}",
                self.name
            )));
        };
        let live = |scope: &str| tree.get(scope).is_some_and(|id| !tree.node(id).removed);
        let mut covering = self.allocations.iter().filter(|s| under(path, s));
        let first = covering.clone().next();
        match (covering.any(|s| live(s)), first) {
            (true, _) => Ok(()),
            (false, Some(scope)) => Err(Denied(format!(
                "the allocation {scope:?} that {:?} is scoped to was removed; ask an admin for a token of a live allocation",
                self.name
            ))),
            (false, None) => Err(Denied(format!(
                "this needs a submitter scoped to {path:?} or above; {:?} is scoped to {scopes}",
                self.name
            ))),
        }
    }
}

/// The actor string of a principal of `role` named `name` (an agent is named after its node, so
/// its actor is `agent:<node>` over HTTP and NATS alike; the service's own processes write as
/// `serve` and `scheduler`, as they always have).
pub fn actor_of(role: Role, name: &str) -> String {
    match role {
        Role::Agent => format!("agent:{name}"),
        Role::Service => name.to_owned(),
        _ => format!("user:{name}"),
    }
}

/// A principal was granted a role and a token (of which only the digest is recorded). Who
/// granted it is the envelope's actor.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PrincipalGranted {
    /// Its name: 1 to 64 letters, digits, `-` or `_`, starting with a letter or digit; unique
    /// among live principals.
    pub name: String,
    /// Its role.
    pub role: Role,
    /// A submitter's allocation subtrees (at least one; `*` for all and unallocated work);
    /// empty for every other role.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allocations: Vec<String>,
    /// An agent's node, which is also its name; absent for every other role.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// SHA-256 of the token, 64 lower-case hex digits. The token itself is never recorded.
    pub token_sha256: String,
    /// After this instant (milliseconds since the epoch) the token is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at_ms: Option<u64>,
    /// Most workloads it may have waiting at once (schema 4 on); without it
    /// [`DEFAULT_MAX_PENDING`], and none for an admin.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_pending: Option<u32>,
    /// How often it may submit, ask what-ifs and replay history; without them
    /// [`Rates::DEFAULT`], and none for an admin or an agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rates: Option<Rates>,
    /// Where the events of its workloads that name no URL of their own are posted; under a
    /// prefix the settings' `notify_urls` allow.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub notify: Option<String>,
    /// The Unix user its workloads run as on agents that run them as their submitters
    /// (`fairledger agent --run-as-submitter`); without it, the user of its name. Never root.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unix_user: Option<String>,
}

/// How often a principal may do what costs the service most, per minute; `None`: the default
/// of its role.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Rates {
    /// Submissions (dry runs included).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub submissions_per_minute: Option<u32>,
    /// What-ifs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub whatifs_per_minute: Option<u32>,
    /// Event streams that replay history (more than a little of it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replays_per_minute: Option<u32>,
}

/// What a rate limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RateKind {
    /// Submissions.
    Submission,
    /// What-ifs.
    WhatIf,
    /// History replays.
    Replay,
}

impl RateKind {
    /// Its name, as problems say it.
    pub fn name(self) -> &'static str {
        match self {
            RateKind::Submission => "submissions",
            RateKind::WhatIf => "what-ifs",
            RateKind::Replay => "history replays",
        }
    }
}

impl Rates {
    /// The rates of a principal whose grant names none (and is neither an admin nor an agent):
    /// ten submissions a second, a what-if or a replay every three seconds, on average.
    pub const DEFAULT: Rates = Rates {
        submissions_per_minute: Some(600),
        whatifs_per_minute: Some(20),
        replays_per_minute: Some(20),
    };

    fn of(&self, kind: RateKind) -> Option<u32> {
        match kind {
            RateKind::Submission => self.submissions_per_minute,
            RateKind::WhatIf => self.whatifs_per_minute,
            RateKind::Replay => self.replays_per_minute,
        }
    }
}

/// A principal's token was revoked: it is refused from the moment this event is folded.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PrincipalRevoked {
    /// The principal's name.
    pub name: String,
    /// Why, for the audit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// The live principals, by name and by token digest, and the digests of revoked tokens.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Principals {
    /// By name, hashed: the fold looks every event's actor up here.
    by_name: rustc_hash::FxHashMap<String, Principal>,
    /// The same names, in order, for listings.
    names: std::collections::BTreeSet<String>,
    by_token: BTreeMap<String, String>,
    /// Digests of revoked tokens, with their principal's name: a revoked token is told apart
    /// from an unknown one, and never granted again.
    revoked: BTreeMap<String, String>,
    /// The log's root of authority: the first principal granted the role `service` (by itself),
    /// from whose grant on the fold holds every event's actor to the rules.
    #[serde(default)]
    root: Option<String>,
    /// The sequence of the root's grant (0 without one).
    #[serde(default)]
    root_seq: u64,
}

impl Principals {
    /// The live principal named `name`.
    pub fn get(&self, name: &str) -> Option<&Principal> {
        self.by_name.get(name)
    }

    /// The live principal whose token has SHA-256 `digest` (lower-case hex).
    pub fn by_token_sha256(&self, digest: &str) -> Option<&Principal> {
        self.by_name.get(self.by_token.get(digest)?)
    }

    /// The name of the principal whose token with SHA-256 `digest` was revoked.
    pub fn revoked_token(&self, digest: &str) -> Option<&str> {
        self.revoked.get(digest).map(String::as_str)
    }

    /// Every live principal, by name.
    pub fn iter(&self) -> impl Iterator<Item = &Principal> {
        self.names.iter().map(|n| &self.by_name[n])
    }

    /// The live principals named after `name`, by name (all of them without one).
    pub fn after<'a>(&'a self, name: Option<&str>) -> impl Iterator<Item = &'a Principal> + 'a {
        use std::ops::Bound;
        let from = match name {
            Some(n) => Bound::Excluded(n.to_owned()),
            None => Bound::Unbounded,
        };
        self.names
            .range((from, Bound::Unbounded))
            .map(|n| &self.by_name[n])
    }

    /// The log's root of authority, once granted: from its grant on, every event's actor must
    /// hold the authority the event needs ([`crate::authority`]).
    pub fn root(&self) -> Option<&str> {
        self.root.as_deref()
    }

    /// The sequence of the root's grant, once granted: where authority starts.
    pub fn root_seq(&self) -> Option<u64> {
        self.root.as_ref().map(|_| self.root_seq)
    }

    /// Whether a principal named `name` was granted and revoked (and not granted again).
    pub fn was_revoked(&self, name: &str) -> bool {
        !self.by_name.contains_key(name) && self.revoked.values().any(|n| n == name)
    }

    /// Whether only the service's own principals are live: no person or agent yet.
    pub fn only_service(&self) -> bool {
        self.by_name.values().all(|p| p.role == Role::Service)
    }

    /// How many are live.
    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    /// Checks a grant against the principals and the tree as they stand.
    pub fn check_grant(
        &self,
        e: &PrincipalGranted,
        tree: &AllocationTree,
    ) -> Result<(), Rejection> {
        let invalid =
            |field: &'static str, reason: String| Err(Rejection::InvalidGrant { field, reason });
        if let Err(reason) = crate::names::principal(&e.name) {
            return invalid("name", reason);
        }
        if self.by_name.contains_key(&e.name) {
            return Err(Rejection::PrincipalExists {
                name: e.name.clone(),
            });
        }
        let hex = e.token_sha256.len() == 64
            && e.token_sha256
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        if !hex {
            return invalid(
                "token_sha256",
                "the SHA-256 of the token, as 64 lower-case hex digits".into(),
            );
        }
        if self.by_token.contains_key(&e.token_sha256) || self.revoked.contains_key(&e.token_sha256)
        {
            return invalid(
                "token_sha256",
                "this token was granted before; make a new one".into(),
            );
        }
        match (e.role, e.allocations.is_empty(), &e.node) {
            (Role::Submitter, true, _) => {
                return invalid(
                    "allocations",
                    format!("a submitter needs at least one allocation subtree ({ANY_ALLOCATION:?} for all)"),
                )
            }
            (Role::Submitter, false, None) => {
                for path in e.allocations.iter().filter(|p| *p != ANY_ALLOCATION) {
                    tree.live(path)?;
                }
            }
            (Role::Agent, true, Some(node)) => {
                if let Err(reason) = crate::names::node(node) {
                    return invalid("node", reason);
                }
                // One actor per node, `agent:<node>`, whether the agent speaks HTTP or NATS.
                if *node != e.name {
                    return invalid(
                        "node",
                        format!("an agent is named after its node: name it {node:?}"),
                    );
                }
            }
            (Role::Agent, _, None) => {
                return invalid("node", "an agent is scoped to one node; name it".into())
            }
            (role, false, _) => {
                return invalid(
                    "allocations",
                    format!("only a submitter is scoped to allocations, not a {role}"),
                )
            }
            (role, true, Some(_)) if role != Role::Agent => {
                return invalid("node", format!("only an agent is scoped to a node, not a {role}"))
            }
            _ => {}
        }
        if let Some(user) = &e.unix_user {
            if let Err(reason) = crate::names::unix_user(user) {
                return invalid("unix_user", reason);
            }
        }
        Ok(())
    }

    /// The live principal that acts as `actor` (`user:alice`, `agent:gpu-1`, `scheduler`).
    pub fn by_actor(&self, actor: &str) -> Option<&Principal> {
        match actor.split_once(':') {
            Some((kind, name)) => self.get(name).filter(|p| match p.role {
                Role::Agent => kind == "agent",
                Role::Service => false,
                _ => kind == "user",
            }),
            None => self.get(actor).filter(|p| p.role == Role::Service),
        }
    }

    /// The Unix user the workloads of `actor` run as where agents run them as their
    /// submitters: its grant's `unix_user`, else its name.
    pub fn unix_user_of<'a>(&'a self, actor: &'a str) -> &'a str {
        self.by_actor(actor)
            .and_then(|p| p.unix_user.as_deref())
            .unwrap_or_else(|| actor.split_once(':').map_or(actor, |(_, n)| n))
    }

    /// Records a checked grant made by `actor` at `now_ms`, sequence `seq`. The first grant of
    /// the role `service` becomes the log's root.
    pub fn grant(&mut self, e: &PrincipalGranted, actor: &str, now_ms: u64, seq: u64) {
        if e.role == Role::Service && self.root.is_none() {
            self.root = Some(e.name.clone());
            self.root_seq = seq;
        }
        self.by_token.insert(e.token_sha256.clone(), e.name.clone());
        self.names.insert(e.name.clone());
        self.by_name.insert(
            e.name.clone(),
            Principal {
                name: e.name.clone(),
                role: e.role,
                allocations: e.allocations.clone(),
                node: e.node.clone(),
                token_sha256: e.token_sha256.clone(),
                expires_at_ms: e.expires_at_ms,
                max_pending: e.max_pending,
                rates: e.rates,
                notify: e.notify.clone(),
                unix_user: e.unix_user.clone(),
                granted_by: actor.to_owned(),
                granted_at_ms: now_ms,
                granted_seq: seq,
            },
        );
    }

    /// Whether [`Principals::revoke`] would revoke `name`: a live principal, and not the last
    /// admin.
    /// From schema version 3, only admins whose tokens do not expire count as the admins left:
    /// revoking the last of them would lock every admin out once the others expire.
    pub fn check_revoke(&self, schema_version: u16, name: &str) -> Result<(), Rejection> {
        let target = self
            .by_name
            .get(name)
            .ok_or_else(|| Rejection::UnknownPrincipal {
                name: name.to_owned(),
            })?;
        if target.role != Role::Admin {
            return Ok(());
        }
        let left = self
            .iter()
            .filter(|p| p.role == Role::Admin && p.name != name)
            .filter(|p| schema_version < 3 || p.expires_at_ms.is_none())
            .count();
        if left == 0 {
            return Err(Rejection::LastAdmin {
                name: name.to_owned(),
            });
        }
        Ok(())
    }

    /// Revokes the live principal `name`; never the last admin (from schema version 3, the last
    /// whose token does not expire), so someone can always grant.
    pub fn revoke(&mut self, schema_version: u16, name: &str) -> Result<(), Rejection> {
        self.check_revoke(schema_version, name)?;
        let p = self.by_name.remove(name).expect("checked above");
        self.names.remove(name);
        self.by_token.remove(&p.token_sha256);
        self.revoked.insert(p.token_sha256, p.name);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_are_subtrees_not_prefixes() {
        assert!(under("ai2/olmo", "ai2"));
        assert!(under("ai2", "ai2"));
        assert!(
            !under("ai22", "ai2"),
            "a sibling sharing a prefix is not below"
        );
        assert!(!under("ai2", "ai2/olmo"));
    }

    #[test]
    fn names_that_could_become_subjects_or_paths_are_refused() {
        for bad in ["", "a.b", "a/b", "-a", "a b", "a*", &"x".repeat(65)] {
            assert!(crate::names::principal(bad).is_err(), "{bad:?}");
        }
        for good in ["alice", "nlp-bot", "gpu_17", "A1"] {
            assert!(crate::names::principal(good).is_ok(), "{good:?}");
        }
        assert!(crate::names::node("gpu.1").is_err());
        assert!(crate::names::node(&"n".repeat(129)).is_err());
    }
}
