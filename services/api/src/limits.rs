//! Per-principal rates: a token bucket for each principal and each kind of costly request
//! (submissions, what-ifs, history replays), so that no principal below an admin can take the
//! service's time from the others. The rates are the grant's ([`Principal::rate`]); the buckets
//! live in each API process.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use ledger::identity::{Principal, RateKind};

use crate::Problem;

/// The buckets of every principal that has used one, and the scarce turns each holds.
#[derive(Default)]
pub(crate) struct Limiter {
    buckets: Mutex<HashMap<(String, RateKind), Bucket>>,
    held: std::sync::Arc<Mutex<HashMap<(String, RateKind), usize>>>,
}

/// One of the few turns at costly work (a what-if, a replay of history) that a principal
/// holds; given back when dropped.
pub(crate) struct Held {
    held: std::sync::Arc<Mutex<HashMap<(String, RateKind), usize>>>,
    key: (String, RateKind),
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut held = self.held.lock().expect("never poisoned");
        if let Some(n) = held.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.key);
            }
        }
    }
}

/// Turns of one kind a principal with a rate of that kind may hold at once: the few slots are
/// shared, so one principal's requests cannot take them all while another's wait.
pub(crate) const HELD_AT_ONCE: usize = 1;

struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Limiter {
    /// Holds one more turn of `kind` for `principal`: a 429 while it already holds
    /// [`HELD_AT_ONCE`] (its earlier request must end first).
    pub(crate) fn hold(&self, principal: &Principal, kind: RateKind) -> Result<Held, Problem> {
        let key = (principal.name.clone(), kind);
        // Those without a rate of this kind (admins, agents) hold as many as they ask for.
        let bound = if principal.rate(kind).is_some() {
            HELD_AT_ONCE
        } else {
            usize::MAX
        };
        let mut held = self.held.lock().expect("never poisoned");
        let n = held.entry(key.clone()).or_insert(0);
        if *n >= bound {
            return Err(Problem::rate_limited(
                format!(
                    "{} already has {} of its {} under way, which is all one principal may have at once while others share the slots; wait for it to end (or close it)",
                    principal.actor(),
                    n,
                    kind.name()
                ),
                2,
            ));
        }
        *n += 1;
        Ok(Held {
            held: self.held.clone(),
            key,
        })
    }

    /// Takes one turn of `kind` for `principal`: a 429 with `Retry-After` when its rate has none
    /// left. A bucket holds ten seconds' worth (at least one), refilled at the rate.
    pub(crate) fn take(&self, principal: &Principal, kind: RateKind) -> Result<(), Problem> {
        let Some(per_minute) = principal.rate(kind) else {
            return Ok(());
        };
        let per_s = f64::from(per_minute) / 60.0;
        let capacity = (per_s * 10.0).max(1.0);
        let now = Instant::now();
        let mut buckets = self.buckets.lock().expect("never poisoned");
        let bucket = buckets
            .entry((principal.name.clone(), kind))
            .or_insert(Bucket {
                tokens: capacity,
                at: now,
            });
        bucket.tokens =
            (bucket.tokens + now.duration_since(bucket.at).as_secs_f64() * per_s).min(capacity);
        bucket.at = now;
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            return Ok(());
        }
        let wait_s = if per_s > 0.0 {
            ((1.0 - bucket.tokens) / per_s).ceil().max(1.0) as u64
        } else {
            3_600
        };
        Err(Problem::rate_limited(
            format!(
                "{} may make {per_minute} {} a minute and has made them; try again in {wait_s} s, or ask an admin to raise its rate",
                principal.actor(),
                kind.name()
            ),
            wait_s,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ledger::identity::Role;

    fn principal(name: &str, role: Role) -> Principal {
        Principal {
            name: name.into(),
            role,
            allocations: Vec::new(),
            node: None,
            token_sha256: String::new(),
            expires_at_ms: None,
            max_pending: None,
            rates: None,
            notify: None,
            unix_user: None,
            granted_by: "user:admin".into(),
            granted_at_ms: 0,
            granted_seq: 0,
        }
    }

    #[test]
    fn a_principal_holds_one_what_if_at_a_time_and_admins_are_not_held() {
        let limiter = Limiter::default();
        let (viewer, other) = (
            principal("viewer", Role::Viewer),
            principal("other", Role::Viewer),
        );
        let first = limiter.hold(&viewer, RateKind::WhatIf).unwrap();
        let refused = limiter.hold(&viewer, RateKind::WhatIf).err().unwrap();
        assert_eq!(refused.status, 429);
        assert!(
            refused.detail.contains("user:viewer already has 1"),
            "{}",
            refused.detail
        );
        // Another principal's turn, and the same principal's turn of another kind, are its own.
        let _theirs = limiter.hold(&other, RateKind::WhatIf).unwrap();
        let _replay = limiter.hold(&viewer, RateKind::Replay).unwrap();
        // Given back when the what-if ends.
        drop(first);
        let _again = limiter.hold(&viewer, RateKind::WhatIf).unwrap();
        // An admin has no rate: as many as it asks for.
        let admin = principal("admin", Role::Admin);
        let held: Vec<Held> = (0..3)
            .map(|_| limiter.hold(&admin, RateKind::WhatIf).unwrap())
            .collect();
        assert_eq!(held.len(), 3);
    }
}
