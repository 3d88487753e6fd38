//! Why an agent stops.

use std::path::PathBuf;

use crate::gpu;

/// Why the agent stopped.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The GPUs could not be read.
    #[error(transparent)]
    Gpu(#[from] gpu::GpuError),
    /// The ledger refused to register the node.
    #[error("the ledger refused to register node {node:?} (see `fairledger events --kind node_registered`); check --node and this machine's clock")]
    NotRegistered {
        /// The node's name.
        node: String,
    },
    /// The ledger grants this node's agent nothing (never, or no longer): whatever it wrote
    /// would be refused by the fold.
    #[error("the ledger holds no live grant for node {node:?}'s agent{}: an admin grants one with `fairledger token create --name {node} --role agent`", if *revoked { " (it was revoked)" } else { "" })]
    Ungranted {
        /// The node's name.
        node: String,
        /// Whether its grant was revoked.
        revoked: bool,
    },
    /// The node's name is registered with other GPUs than this machine has.
    #[error("node {node:?} is already registered with {registered_gpus} {registered_model} GPUs, and this machine has {gpus} {model}: pass another --node")]
    RegisteredOtherwise {
        /// The node's name.
        node: String,
        /// GPUs the ledger holds for it.
        registered_gpus: u32,
        /// Their model.
        registered_model: String,
        /// GPUs this machine has.
        gpus: u32,
        /// Their model.
        model: String,
    },
    /// The ledger could not be reached.
    #[error("{0}")]
    Log(String),
    /// `--run-as-submitter` without root.
    #[error("--run-as-submitter needs the agent to run as root (it starts each workload as its submitter's Unix user)")]
    NeedsRoot,
    /// The run directory could not be made.
    #[error("cannot create the run directory {}: {source}; pass another --work-dir", path.display())]
    RunDirectory {
        /// The directory.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The service no longer takes this agent's credentials.
    #[error("the server refused this agent's token ({0}): its runs were stopped; give the agent a new token (`fairledger token create --role agent`)")]
    Refused(String),
}
