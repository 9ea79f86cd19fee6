//! `volring nbd holders`: who holds each volume this node exports (itself,
//! or another node through the export; `csi::fence`), and the operator's
//! release of a remote holder known dead.
//!
//! Why offline (the agent stopped): the store has one writer, and a
//! release must not race a client the running agent is admitting. An
//! agent restart is invisible to the volumes (the healer), so stopping it
//! for this is cheap. The agent's state-directory lock is taken first: a
//! running agent makes this fail, never wait.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use volring_csi::fence::{Fence, Holder};
use volring_volumes::store::{Store, FILE};

/// Lists the holders, or releases `release`'s remote holder.
pub(crate) fn holders(state_dir: &Path, release: Option<&str>, json: bool) -> anyhow::Result<()> {
    crate::agent::lock_state_dir(state_dir)?;
    let store = Store::open(&state_dir.join(FILE)).with_context(|| format!("open {}", state_dir.join(FILE).display()))?;
    let fence = Fence::open(Arc::new(store)).map_err(|e| anyhow::anyhow!("{e}"))?;
    let all = fence.all();
    if let Some(id) = release {
        match all.get(id) {
            Some(Holder::Remote { .. }) => {
                fence.release_remote(id).map_err(|e| anyhow::anyhow!("{e}"))?;
                println!("released: {id} (the node that held it must not write it again: its device was torn down, or the node is gone)");
                return Ok(());
            }
            Some(Holder::Local) => anyhow::bail!("{id} is staged on this node: NodeUnstage lets it go"),
            None => anyhow::bail!("nothing holds {id}"),
        }
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&all)?);
        return Ok(());
    }
    println!("{:<40} HOLDER", "VOLUME");
    for (id, h) in all {
        let who = match &h {
            Holder::Local => h.who(),
            Holder::Remote { since, .. } => format!("{}, through the export (since unix time {since})", h.who()),
        };
        println!("{id:<40} {who}");
    }
    Ok(())
}
