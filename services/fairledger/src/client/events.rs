//! `fairledger events`, `token` and `whoami`: the ledger's events, principals and the caller.

use std::io::{BufRead, BufReader};

use super::listings::{print_pages, written, Listing};
use super::*;

/// Which events `fairledger events` prints.
#[derive(clap::Args, Clone, Debug)]
pub struct EventsArgs {
    /// Start after this sequence.
    #[arg(long, default_value_t = 0)]
    pub after: u64,
    /// At most this many (without --follow; 0: all, printed page after page).
    #[arg(long, short = 'n', default_value_t = 100)]
    pub limit: usize,
    /// Keep printing new events as they come.
    #[arg(long, short)]
    pub follow: bool,
    /// Only events of this kind, e.g. workload_started.
    #[arg(long, short)]
    pub kind: Option<String>,
    /// Only events of this allocation and below.
    #[arg(long, short)]
    pub allocation: Option<String>,
}

pub fn events(args: &ClientArgs, which: &EventsArgs) -> Result<(), String> {
    let api = Api::new(args)?;
    let mut query = vec![("after", which.after.to_string())];
    if let Some(k) = &which.kind {
        query.push(("kind", k.clone()));
    }
    if let Some(a) = &which.allocation {
        query.push(("allocation", a.clone()));
    }
    let header = ["SEQ", "TIME (UTC)", "TYPE", "ABOUT", "ALLOCATION", "ACTOR"];
    if !which.follow {
        // Page after page (1,000 a page) up to the limit or the end of the log.
        let limit = if which.limit == 0 {
            usize::MAX
        } else {
            which.limit
        };
        let mut listing = Listing::new(args, "events", &header);
        let mut after = which.after;
        while listing.printed() < limit {
            let mut q = query.clone();
            q[0].1 = after.to_string();
            q.push(("limit", (limit - listing.printed()).min(1_000).to_string()));
            let page = api.call("GET", &with_query("/v1/events", &q), None)?;
            let room = limit - listing.printed();
            let printed = listing.page(&page, room, &["next_after", "now_ms"], |e| {
                event_row(&e["seq"], &e["event"], e["subject"].as_str())
            });
            if printed.is_err() {
                return written(printed);
            }
            match page["next_after"].as_u64() {
                Some(next) if next > after && next < page["last_seq"].as_u64().unwrap_or(0) => {
                    after = next
                }
                _ => break,
            }
        }
        return written(listing.finish(None));
    }
    let url = format!("{}{}", api.base, with_query("/v1/events/stream", &query));
    let mut response = api
        .request("GET", &url)
        .call()
        .map_err(|e| unreachable(&api.base, &e))?;
    if response.status().as_u16() >= 400 {
        let text = response.body_mut().read_to_string().unwrap_or_default();
        let value: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        return Err(value["detail"]
            .as_str()
            .unwrap_or("the API refused to stream the events")
            .to_owned());
    }
    let reader = BufReader::new(response.into_body().into_reader());
    let mut id = String::new();
    // The stream carries envelopes without their subjects: a workload's allocation is read once
    // from its row when its event does not name it.
    let mut allocations: std::collections::HashMap<String, Value> = Default::default();
    if !args.json {
        println!("{}", header.join("  "));
    }
    for line in reader.lines() {
        let line = line.map_err(|e| format!("the event stream broke: {e}"))?;
        if let Some(v) = line.strip_prefix("id:") {
            id = v.trim().to_owned();
        } else if let Some(data) = line.strip_prefix("data:") {
            if args.json {
                println!("{}", data.trim());
            } else {
                let mut envelope: Value = serde_json::from_str(data.trim()).unwrap_or(Value::Null);
                let p = &mut envelope["payload"];
                if let (Some(w), true) = (p["workload"].as_str(), p["allocation"].is_null()) {
                    if allocations.len() > 100_000 {
                        allocations.clear();
                    }
                    let a = match allocations.get(w) {
                        Some(a) => a.clone(),
                        None => {
                            let a = api
                                .call("GET", &format!("/v1/workloads/{w}"), None)
                                .map_or(Value::Null, |row| row["allocation"].clone());
                            allocations.insert(w.to_owned(), a.clone());
                            a
                        }
                    };
                    p["allocation"] = a;
                }
                let row = event_row(&Value::from(id.as_str()), &envelope, None);
                println!("{}", ledger::names::terminal_safe(&row.join("  ")));
            }
        }
    }
    Ok(())
}

/// One event as the events table shows it: its sequence, when, its kind, what it is about (a
/// workload, a node, a principal), the allocation (from its subject when known, else its
/// payload) and who acted.
fn event_row(seq: &Value, envelope: &Value, subject: Option<&str>) -> Vec<String> {
    let p = &envelope["payload"];
    let about = ["workload", "node", "name"]
        .iter()
        .find_map(|k| p[*k].as_str())
        .map_or("-".into(), |s| ledger::names::terminal_safe(s).into_owned());
    let from_subject = subject
        .and_then(|s| s.strip_prefix("fairledger.ledger."))
        .and_then(|s| {
            let mut parts = s.splitn(3, '.');
            let entity = parts.next()?;
            parts.next()?;
            let rest = parts.next()?;
            matches!(entity, "workload" | "allocation").then_some(rest)
        })
        .filter(|rest| *rest != eventlog::subject::UNALLOCATED)
        .map(|rest| rest.replace('.', "/"));
    let allocation = from_subject
        .or_else(|| p["allocation"].as_str().map(str::to_owned))
        .or_else(|| p["path"].as_str().map(str::to_owned))
        .map_or("-".into(), |a| {
            ledger::names::terminal_safe(&a).into_owned()
        });
    vec![
        text(seq),
        date_time(&envelope["occurred_at_ms"]),
        text(&envelope["type"]),
        about,
        allocation,
        text(&envelope["actor"]),
    ]
}

/// What `fairledger token create` grants.
#[derive(clap::Args, Debug)]
pub struct TokenCreate {
    /// The principal's name (letters, digits, - and _); it acts as user:NAME (agent:NAME).
    #[arg(long)]
    pub name: String,
    /// admin, operator, submitter, agent, auditor or viewer.
    #[arg(long)]
    pub role: String,
    /// A submitter's allocation subtree (repeat for more; * for all and unallocated work).
    #[arg(long = "allocation", short = 'a')]
    pub allocations: Vec<String>,
    /// An agent's node (default: its name; an agent is named after its node).
    #[arg(long)]
    pub node: Option<String>,
    /// Refuse the token after this long, e.g. 12h, 30d.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub expires: Option<std::time::Duration>,
    /// Most workloads it may have waiting at once (default 10,000; none for an admin).
    #[arg(long)]
    pub max_pending: Option<u32>,
    /// Where the events of its workloads that name no URL of their own are posted (under a
    /// prefix the settings' notify_urls allow).
    #[arg(long)]
    pub notify: Option<String>,
    /// The Unix user its workloads run as on agents started with --run-as-submitter
    /// (default: its name; never root).
    #[arg(long)]
    pub unix_user: Option<String>,
    /// Most submissions (dry runs included) per minute (default 600; none for an admin or
    /// an agent).
    #[arg(long)]
    pub submissions_per_minute: Option<u32>,
    /// Most what-ifs per minute (default 20).
    #[arg(long)]
    pub whatifs_per_minute: Option<u32>,
    /// Most event streams replaying history per minute (default 20).
    #[arg(long)]
    pub replays_per_minute: Option<u32>,
    /// Write the token to this file (readable by you only) instead of printing it.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// With the server stopped, grant it straight into the log (`--data DIR`, or `--nats`
    /// with the service's credentials): how to get an admin back when none can sign in.
    /// The grant is an event like any other, its actor `recovery`.
    #[arg(long)]
    pub offline: bool,
    #[command(flatten)]
    pub log: Box<crate::common::LogArgs>,
}

/// `fairledger token …`.
#[derive(clap::Subcommand, Debug)]
pub enum TokenCommand {
    /// Grant a principal a role and a new token (admin). The token is printed once.
    Create(Box<TokenCreate>),
    /// The principals: name, role, scope, who granted them and when (admin).
    List,
    /// Revoke a principal's token: every API process refuses it once it has folded this (admin).
    Revoke {
        /// The principal's name.
        name: String,
    },
}

pub fn token_command(args: &ClientArgs, command: TokenCommand) -> Result<(), String> {
    if let TokenCommand::Create(create) = &command {
        if create.offline {
            let c = &**create;
            let grant = crate::recover::Grant {
                name: c.name.clone(),
                role: c.role.clone(),
                allocations: c.allocations.clone(),
                node: c.node.clone(),
                expires: c.expires,
                max_pending: c.max_pending,
            };
            if c.notify.is_some() {
                return Err("--notify is given online only (the server signs notifications); create the token offline without it, then grant it again online".into());
            }
            return crate::recover::grant_offline(&c.log, grant, c.out.as_deref(), args.json);
        }
    }
    let api = Api::new(args)?;
    match command {
        TokenCommand::Create(create) => {
            let TokenCreate {
                name,
                role,
                allocations,
                node,
                expires,
                max_pending,
                out,
                notify,
                unix_user,
                submissions_per_minute,
                whatifs_per_minute,
                replays_per_minute,
                ..
            } = *create;
            let rates = (submissions_per_minute.is_some()
                || whatifs_per_minute.is_some()
                || replays_per_minute.is_some())
            .then(|| {
                json!({
                    "submissions_per_minute": submissions_per_minute,
                    "whatifs_per_minute": whatifs_per_minute,
                    "replays_per_minute": replays_per_minute,
                })
            });
            let body = json!({
                "name": name, "role": role, "allocations": allocations, "node": node,
                "expires_in_s": expires.map(|d| d.as_secs().max(1)), "max_pending": max_pending,
                "notify": notify, "rates": rates, "unix_user": unix_user,
            });
            let mut v = api.call("POST", "/v1/tokens", Some(&body))?;
            let token = v["token"].as_str().unwrap_or_default().to_owned();
            if let Some(path) = &out {
                api::application::write_secret(path, &token)?;
                v["token"] = json!(format!("written to {}", path.display()));
            }
            print(args, &v, |v| {
                let scope = match (v["allocations"].as_array(), v["node"].as_str()) {
                    (Some(a), _) if !a.is_empty() => {
                        let a: Vec<String> = a.iter().map(text).collect();
                        format!(" of {}", a.join(", "))
                    }
                    (_, Some(n)) => format!(" of node {n}"),
                    _ => String::new(),
                };
                let expires = match v["expires_at"].as_str() {
                    Some(t) => format!(", expires {t}"),
                    None => String::new(),
                };
                let head = format!(
                    "{} ({}{scope}{expires})",
                    text(&v["actor"]),
                    text(&v["role"])
                );
                if let Some(secret) = v["notify_secret"].as_str() {
                    eprintln!(
                        "its workloads' notifications are signed with the secret {secret} (X-Fairledger-Signature-256: sha256=HMAC-SHA256 of the body); it is shown this once"
                    );
                }
                match &out {
                    Some(path) => format!("token of {head} written to {}\n", path.display()),
                    // The token alone on stdout, so `$(fairledger token create …)` captures it.
                    None => {
                        eprintln!("token of {head}; it is shown this once:");
                        format!("{}\n", text(&v["token"]))
                    }
                }
            });
        }
        TokenCommand::List => {
            let header = ["NAME", "ROLE", "SCOPE", "GRANTED_BY", "GRANTED", "EXPIRES"];
            let mut listing = Listing::new(args, "tokens", &header);
            print_pages(
                &api,
                &mut listing,
                "/v1/tokens",
                &[],
                ("after", "next_after"),
                usize::MAX,
                &["next_after"],
                token_row,
            )?;
            return written(listing.finish(None));
        }
        TokenCommand::Revoke { name } => {
            let v = api.call("DELETE", &format!("/v1/tokens/{name}"), None)?;
            print(args, &v, |v| format!("revoked {}\n", text(&v["name"])));
        }
    }
    Ok(())
}

pub fn whoami(args: &ClientArgs) -> Result<(), String> {
    let v = Api::new(args)?.call("GET", "/v1/whoami", None)?;
    print(args, &v, |v| {
        format!(
            "{} ({}){}\n",
            text(&v["actor"]),
            text(&v["role"]),
            match v["expires_at"].as_str() {
                Some(t) => format!(", token expires {t}"),
                None => String::new(),
            }
        )
    });
    Ok(())
}

/// One principal as `fairledger token list` shows it.
fn token_row(t: &Value) -> Vec<String> {
    let scope = match (t["allocations"].as_array(), t["node"].as_str()) {
        (Some(a), _) if !a.is_empty() => a.iter().map(text).collect::<Vec<_>>().join(","),
        (_, Some(n)) => format!("node {n}"),
        _ => "-".into(),
    };
    let expires = match (t["expired"].as_bool(), t["expires_at"].as_str()) {
        (Some(true), Some(at)) => format!("expired {at}"),
        (_, Some(at)) => at.to_owned(),
        _ => "never".into(),
    };
    vec![
        text(&t["name"]),
        text(&t["role"]),
        scope,
        text(&t["granted_by"]),
        text(&t["granted_at"]),
        expires,
    ]
}

#[cfg(test)]
mod tests {
    use super::{clock, seconds, span};

    #[test]
    fn durations_read_as_seconds_spans_or_slurm_clocks() {
        assert_eq!(seconds("5400"), Ok(5_400));
        assert_eq!(seconds("1h30m"), Ok(5_400));
        assert_eq!(seconds("1h 30m"), Ok(5_400));
        assert_eq!(seconds("01:30:00"), Ok(5_400));
        assert_eq!(seconds("2-01:30:00"), Ok(2 * 86_400 + 5_400));
        assert_eq!(
            seconds("90:00"),
            Err(
                "\"90:00\" is not a duration: give seconds (5400), a span (1h30m) or D-HH:MM:SS"
                    .into()
            )
        );
        assert_eq!(seconds("05:07"), Ok(307));
        for bad in [
            "",
            "an hour",
            "-5",
            "1:2:3",
            "2-05:07",
            "1-24:00:00",
            "00:60:00",
        ] {
            assert!(seconds(bad).is_err(), "{bad:?}");
        }
        // What the tables print reads back.
        assert_eq!(seconds(&clock(200_000_000)), Ok(200_000));
    }

    #[test]
    fn spans_read_in_their_two_largest_units() {
        assert_eq!(span(45), "45s");
        assert_eq!(span(42 * 60 + 59), "42m");
        assert_eq!(span(3 * 3_600 + 5 * 60 + 7), "3h 5m");
        assert_eq!(span(2 * 86_400 + 4 * 3_600 + 59), "2d 4h");
    }
}
