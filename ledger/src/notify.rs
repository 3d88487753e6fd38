//! Notifications: the rules for the URLs a workload's events are posted to, and which events.
//!
//! A workload may carry `notify` (a URL), and a principal a default one for its workloads; the
//! service posts the workload's events there. Only URLs under a prefix the ledger's settings
//! allow (`notify_urls`, an admin's) are accepted, so the service is no proxy into the network:
//! a URL matches a prefix when it is the prefix, or goes on after it with `/`, `?`, `#` or (after
//! a host) a port's `:`; a URL naming a user (`user@host`) is refused, as it would hide its host.

use crate::event::Event;
use crate::rejection::Rejection;

/// The longest URL accepted.
pub const URL_MAX: usize = 2048;
/// The most prefixes the settings may allow.
pub const PREFIXES_MAX: usize = 32;

/// The kinds of events posted, in the order a workload meets them.
pub const KINDS: [&str; 6] = [
    "workload_started",
    "preemption_requested",
    "workload_stopped",
    "workload_requeued",
    "workload_finished",
    "workload_cancelled",
];

/// Whether `event` is posted to its workload's URL.
pub fn posted(event: &Event) -> bool {
    KINDS.contains(&event.kind())
}

/// Whether `event` is a workload's last (nothing is posted for it afterwards).
pub fn last(event: &Event) -> bool {
    matches!(
        event,
        Event::WorkloadFinished(_) | Event::WorkloadCancelled(_)
    )
}

/// The scheme and authority of `url` (`https://host:port`), what may be shown of it to anyone:
/// its path and query may hold a secret (many webhooks carry their key there).
pub fn origin(url: &str) -> &str {
    let after = url.find("://").map_or(0, |i| i + 3);
    let end = url[after..]
        .find(['/', '?', '#'])
        .map_or(url.len(), |i| after + i);
    &url[..end]
}

/// Checks the form of `url`: http or https, printable, no user, at most [`URL_MAX`] bytes.
fn well_formed(url: &str) -> Result<(), String> {
    if url.len() > URL_MAX {
        return Err(format!("at most {URL_MAX} bytes"));
    }
    if url.bytes().any(|b| !(0x21..0x7f).contains(&b)) {
        return Err("a URL of printable ASCII without spaces (percent-encode the rest)".into());
    }
    let rest = url
        .strip_prefix("https://")
        .or_else(|| url.strip_prefix("http://"))
        .ok_or("an http:// or https:// URL")?;
    let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    if authority.is_empty() {
        return Err("a URL with a host".into());
    }
    if authority.contains('@') {
        return Err("a URL without a user name (user@host hides the host)".into());
    }
    Ok(())
}

/// Checks the prefixes an admin allows (`notify_urls` of the settings).
pub fn check_prefixes(prefixes: &[String]) -> Result<(), Rejection> {
    let bad = |reason: String| {
        Err(Rejection::InvalidField {
            field: "notify_urls",
            reason,
        })
    };
    if prefixes.len() > PREFIXES_MAX {
        return bad(format!("at most {PREFIXES_MAX} prefixes"));
    }
    for p in prefixes {
        if let Err(reason) = well_formed(p) {
            return bad(format!("{p:?} is not {reason}"));
        }
    }
    Ok(())
}

/// Whether `url` is under `prefix`: the prefix itself, or the prefix followed by a path, a
/// query, a fragment, or (when the prefix ends at its host) a port.
fn under(url: &str, prefix: &str) -> bool {
    let Some(rest) = url.strip_prefix(prefix) else {
        return false;
    };
    if rest.is_empty() || prefix.ends_with('/') {
        return true;
    }
    let at_host = !prefix[prefix.find("://").map_or(0, |i| i + 3)..].contains(['/', '?', '#']);
    match rest.as_bytes()[0] {
        b'/' | b'?' | b'#' => true,
        b':' => at_host,
        _ => false,
    }
}

/// Checks `url` (given as `field`) against the prefixes `allowed`.
pub fn check_url(allowed: &[String], field: &'static str, url: &str) -> Result<(), Rejection> {
    let bad = |reason: String| Err(Rejection::InvalidField { field, reason });
    if let Err(reason) = well_formed(url) {
        return bad(format!("must be {reason}"));
    }
    if allowed.iter().any(|p| under(url, p)) {
        return Ok(());
    }
    if allowed.is_empty() {
        return bad(
            "this ledger posts notifications to no URL; an admin allows prefixes with `fairledger settings set notify_urls=https://hooks.example.org/`".into(),
        );
    }
    bad(format!(
        "{} is not under a prefix this ledger posts to ({}); ask an admin to allow it",
        origin(url),
        allowed.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_is_allowed_under_a_prefix_and_nowhere_else() {
        let allowed = vec![
            "http://127.0.0.1".to_owned(),
            "https://hooks.example.org/team/".to_owned(),
        ];
        let ok = |url: &str| check_url(&allowed, "notify", url).is_ok();
        assert!(ok("http://127.0.0.1:8080/hook"));
        assert!(ok("http://127.0.0.1/hook?x=1"));
        assert!(ok("https://hooks.example.org/team/abc"));
        assert!(!ok("http://127.0.0.1.evil.example/"), "another host");
        assert!(
            !ok("http://127.0.0.1@evil.example/"),
            "a user hides the host"
        );
        assert!(!ok("https://hooks.example.org/teammate/"), "another path");
        assert!(!ok("https://hooks.example.org/other/"));
        assert!(!ok("ftp://127.0.0.1/"));
        assert!(!ok("http://127.0.0.1/a b"));
        assert!(check_url(&[], "notify", "http://127.0.0.1/").is_err());
        assert_eq!(
            origin("https://hooks.example.org/team/secret?k=1"),
            "https://hooks.example.org"
        );
        assert_eq!(origin("http://127.0.0.1:9"), "http://127.0.0.1:9");
        assert!(check_prefixes(&allowed).is_ok());
        assert!(check_prefixes(&["localhost".into()]).is_err());
    }
}
