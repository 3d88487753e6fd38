//! `fairledger token create --offline`: a grant written straight into the log while the server
//! is stopped, for when no admin can sign in any more (every admin token lost, revoked or
//! expired). The log is folded to its end, the grant is checked as the fold would check it, and
//! appended as an ordinary `principal_granted` event whose actor, `recovery`, says how it came:
//! a principal of the role `service` that `serve` grants in the same batch when the log has none
//! (whoever may stop the server and write its log holds the service's authority); the token is
//! shown once, like any other.

use std::path::Path;

use eventlog::{Append, EventLog};
use ledger::event::{Event, PrincipalGranted};
use ledger::identity::Role;
use ledger::Envelope;

use crate::common::LogArgs;

/// The actor of an offline grant.
pub const RECOVERY_ACTOR: &str = "recovery";

/// What an offline grant gives.
pub struct Grant {
    /// The principal's name.
    pub name: String,
    /// Its role, by name.
    pub role: String,
    /// A submitter's allocation subtrees.
    pub allocations: Vec<String>,
    /// An agent's node.
    pub node: Option<String>,
    /// When the token stops being accepted, from now.
    pub expires: Option<std::time::Duration>,
    /// Its cap on waiting workloads.
    pub max_pending: Option<u32>,
}

/// Writes `grant` into the log `log_args` names and prints its token (or writes it to `out`).
pub fn grant_offline(
    log_args: &LogArgs,
    grant: Grant,
    out: Option<&Path>,
    json: bool,
) -> Result<(), String> {
    let role = Role::parse(&grant.role).ok_or_else(|| {
        let roles: Vec<&str> = Role::ALL.iter().map(|r| r.name()).collect();
        format!(
            "--role {:?} is not a role; use one of {}",
            grant.role,
            roles.join(", ")
        )
    })?;
    let now = scheduler::wall_clock_ms();
    let (token, token_sha256) = api::auth::new_token()?;
    let event = Event::PrincipalGranted(PrincipalGranted {
        node: match (role, grant.node) {
            (Role::Agent, None) => Some(grant.name.clone()),
            (_, node) => node,
        },
        name: grant.name.clone(),
        role,
        allocations: grant.allocations,
        token_sha256,
        expires_at_ms: grant
            .expires
            .map(|d| now.saturating_add(d.as_millis() as u64)),
        max_pending: grant.max_pending,
        rates: None,
        notify: None,
        unix_user: None,
    });
    let (state_config, _, _, _) = crate::common::settings(None, None)?;
    let seq = crate::common::runtime()?.block_on(async {
        let log = log_args.open().await.map_err(|e| {
            if e.contains("in use") {
                format!(
                    "{e}: stop `fairledger serve` first (an offline grant needs the log to itself), or grant the token through the running server with `fairledger token create`"
                )
            } else {
                e
            }
        })?;
        let last = log.last_seq().await.map_err(|e| e.to_string())?;
        let scratch = tempfile::tempdir().map_err(|e| e.to_string())?;
        let p = crate::logcmd::folded_to(&log, &scratch.path().join("projection"), state_config, last)
            .await?;
        // The recovery principal, granted by the service (its root first, on a log without
        // one), then the grant; each checked against the ledger as the ones before leave it.
        let mut state = p.state().clone();
        let principals = state.principals();
        let mut events = Vec::new();
        if principals.root().is_none() {
            let serve = api::application::SERVE_ACTOR;
            events.push((serve, api::application::service_grant(serve)?));
        }
        if principals
            .get(RECOVERY_ACTOR)
            .is_none_or(|p| p.role != Role::Service)
        {
            let recovery = api::application::service_grant(RECOVERY_ACTOR)?;
            events.push((api::application::SERVE_ACTOR, recovery));
        }
        events.push((RECOVERY_ACTOR, event));
        let at = now.max(state.now_ms());
        let mut appends = Vec::new();
        for (i, (actor, event)) in events.into_iter().enumerate() {
            let env = Envelope::new(uuid::Uuid::now_v7(), at, actor, event);
            state
                .check(&env)
                .map_err(|r| format!("the ledger refuses this grant: {r}"))?;
            state.apply(last + 1 + i as u64, &env);
            appends.push(Append::event(&env, None, None));
        }
        let acks = log
            .append_batch(appends)
            .await
            .map_err(|e| format!("the grant was not written: {e}"))?;
        Ok::<u64, String>(acks.last().expect("one event at least").seq)
    })?;
    let head = format!(
        "{} ({}), granted offline as event {seq}",
        grant.name,
        role.name()
    );
    match out {
        Some(path) => {
            api::application::write_secret(path, &token)?;
            if json {
                println!(
                    "{}",
                    serde_json::json!({"name": grant.name, "role": role.name(), "seq": seq, "token": format!("written to {}", path.display())})
                );
            } else {
                println!("token of {head} written to {}", path.display());
            }
        }
        None if json => println!(
            "{}",
            serde_json::json!({"name": grant.name, "role": role.name(), "seq": seq, "token": token})
        ),
        None => {
            eprintln!("token of {head}; it is shown this once:");
            println!("{token}");
        }
    }
    Ok(())
}
