//! `fairledger nats-auth`: the NATS users of a deployment, one per role, as a `users.conf` for
//! nats-server (public nkeys and permissions; `ops/nats/secure.conf` includes it) and a seed file
//! per user, readable by its owner only. Seeds already there are kept, so adding a node does not
//! change the others' keys.

use std::path::{Path, PathBuf};

use eventlog::access::{self, NatsRole, NatsUser};

/// Settings of `nats-auth`.
#[derive(clap::Args, Debug)]
pub struct NatsAuthArgs {
    /// Where to write users.conf and the seed files (NAME.nk).
    #[arg(long)]
    pub out: PathBuf,
    /// A user for fairledger's own processes (serve, project, log): may do everything.
    #[arg(long, default_value = "fairledger")]
    pub service: Vec<String>,
    /// A node whose agent gets a user of its own (repeat for more).
    #[arg(long = "agent", value_name = "NODE")]
    pub agents: Vec<String>,
    /// A downstream consumer that may only read the ledger (repeat for more).
    #[arg(long = "reader", value_name = "NAME")]
    pub readers: Vec<String>,
}

pub fn nats_auth(args: NatsAuthArgs) -> Result<(), String> {
    let mut wanted: Vec<(String, NatsRole)> = Vec::new();
    for name in &args.service {
        ledger::names::principal(name).map_err(|r| format!("--service {name:?}: {r}"))?;
        wanted.push((name.clone(), NatsRole::Service));
    }
    for node in &args.agents {
        ledger::names::node(node).map_err(|r| format!("--agent {node:?}: {r}"))?;
        wanted.push((node.clone(), NatsRole::Agent { node: node.clone() }));
    }
    for name in &args.readers {
        ledger::names::principal(name).map_err(|r| format!("--reader {name:?}: {r}"))?;
        wanted.push((name.clone(), NatsRole::Reader));
    }
    let mut names: Vec<&str> = wanted.iter().map(|(n, _)| n.as_str()).collect();
    names.sort_unstable();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        return Err(format!(
            "{:?} is named twice: every user needs a name of its own (it names its seed file)",
            w[0]
        ));
    }
    std::fs::create_dir_all(&args.out)
        .map_err(|e| format!("cannot create {}: {e}", args.out.display()))?;
    let mut users = Vec::new();
    for (name, role) in wanted {
        let path = args.out.join(format!("{name}.nk"));
        let nkey = seed_of(&path)?;
        users.push(NatsUser { name, role, nkey });
    }
    let conf = args.out.join("users.conf");
    std::fs::write(&conf, access::users_conf(&users))
        .map_err(|e| format!("cannot write {}: {e}", conf.display()))?;
    eprintln!(
        "wrote {} ({} users) and their seeds in {}; include it in nats-server's configuration (ops/nats/secure.conf does)",
        conf.display(),
        users.len(),
        args.out.display()
    );
    Ok(())
}

/// The public key of the seed in `path`, made and written (0600) if there is none.
fn seed_of(path: &Path) -> Result<String, String> {
    if let Ok(seed) = std::fs::read_to_string(path) {
        return access::public_key(&seed).map_err(|e| format!("{}: {e}", path.display()));
    }
    let (seed, public) = access::new_user_nkey()?;
    api::application::write_secret(path, &seed)?;
    Ok(public)
}
