//! The CSI hooks of shared (MULTI_NODE_MULTI_WRITER) volumes; the work is
//! in `crate::share`. On the node that holds the volume: export after the
//! stage, unexport before the unstage, re-export at start.

use super::validate::Access;
use super::{Driver, Error, Result};

impl Driver {
    /// After a stage (or finding it already staged): a shared mount volume
    /// is exported when this node serves NFS.
    pub(super) fn export_if_shared(&self, id: &str, access: &Access) -> Result<()> {
        if !(access.shared() && access.is_mount()) {
            return Ok(());
        }
        if !self.share.enabled() {
            tracing::warn!(
                volume = id,
                "MULTI_NODE_MULTI_WRITER volume staged, but this node serves no NFS (--nfs-listen): only pods here can use it"
            );
            return Ok(());
        }
        let rec = self.records.get(id).ok_or_else(|| Error::Internal(format!("volume {id} has no staged record")))?;
        self.share.export(id, &rec.staged_at()).map_err(|e| Error::Internal(format!("export volume {id} over NFS: {e}")))?;
        Ok(())
    }

    /// Before an unstage: the volume's export goes first, so its filesystem
    /// is not held by the NFS server.
    pub(super) fn unexport(&self, id: &str) -> Result<()> {
        self.share.unexport(id).map_err(|e| Error::Internal(format!("remove the NFS export of volume {id}: {e}")))
    }

    /// At start, after the first reconcile pass: re-exports the recorded
    /// shares of volumes still staged intact.
    pub(super) fn resume_shares(&self) {
        let n = self.share.resume(|id| {
            let r = self.records.get(id)?;
            self.stage_intact(&r).ok()?.then(|| r.staged_at())
        });
        match n {
            Ok(0) => {}
            Ok(n) => tracing::info!(shares = n, "NFS exports resumed"),
            Err(e) => tracing::error!(error = %e, "cannot resume the NFS exports"),
        }
    }

    /// The node's share side (its server's pid and records).
    pub fn shares(&self) -> &crate::share::ShareSide {
        &self.share
    }
}
