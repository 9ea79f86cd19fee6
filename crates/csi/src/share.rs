//! The CSI hooks of shared (MULTI_NODE_MULTI_WRITER) volumes; the work is
//! in `volring_share`. On the node that holds the volume: export after the
//! stage, unexport before the unstage, re-export at start.

use std::sync::Arc;

use super::base::Base;
use super::validate::Access;
use super::{Error, Result};
use volring_share::ShareSide;

/// Reads the endpoint published on a PVC; runs on the CSI call's blocking thread.
pub(crate) use volring_share::follow::EndpointLookup;

/// The shares this node serves: the hooks around its own stages.
pub(crate) struct Shares {
    base: Arc<Base>,
    side: Arc<ShareSide>,
}

impl Shares {
    pub(crate) fn new(base: Arc<Base>, side: Arc<ShareSide>) -> Self {
        Self { base, side }
    }

    /// After a stage (or finding it already staged): a shared mount volume
    /// is exported when this node serves NFS. `context`: the stage's volume
    /// context, which says the squash of a volume this node has no pool
    /// record of.
    pub(crate) fn export_if_shared(
        &self,
        id: &str,
        access: &Access,
        context: Option<&std::collections::HashMap<String, String>>,
    ) -> Result<()> {
        if !(access.shared() && access.is_mount()) {
            return Ok(());
        }
        if !self.side.enabled() {
            tracing::warn!(
                volume = id,
                "MULTI_NODE_MULTI_WRITER volume staged, but this node serves no NFS (--nfs-listen): only pods here can use it"
            );
            return Ok(());
        }
        let rec = self.base.records.get(id).ok_or_else(|| Error::Internal(format!("volume {id} has no staged record")))?;
        // Root squash as the StorageClass says (a volume moved here from
        // another node's pool has only its context).
        let recorded = self.base.pool.get(id).map(|m| m.parameters);
        let squash = volring_share::squash_of(recorded.as_ref(), context);
        let squash = squash.map_err(|e| Error::InvalidArgument(format!("volume {id}: {e}")))?;
        self.side
            .export_squashed(id, &rec.staged_at(), squash)
            .map_err(|e| Error::Internal(format!("export volume {id} over NFS: {e}")))?;
        Ok(())
    }

    /// Refuses an access mode volume `id` was not created for, as
    /// ValidateVolumeCapabilities does: MULTI_NODE_MULTI_WRITER is the one
    /// mode a volume must be created for, since it is exported over NFS.
    /// What it was created for is read from the pool's record; a volume
    /// another node holds has none here, only `context`, the volume
    /// context CreateVolume returned for it, which marks a shared volume
    /// (`None`: the pool's record only, nothing to judge without one).
    ///
    /// FAILED_PRECONDITION is the spec's code in both the NodeStageVolume
    /// and the NodePublishVolume table for "Exceeds capabilities: the CO
    /// has specified capabilities not supported by the volume". Not
    /// INVALID_ARGUMENT: the capability is well formed and served for a
    /// volume created with it; not ALREADY_EXISTS, which is for a volume
    /// already staged or published at that path with another capability.
    pub(crate) fn created_for(&self, id: &str, access: &Access, context: Option<&std::collections::HashMap<String, String>>) -> Result<()> {
        if !access.shared() {
            return Ok(());
        }
        let shared = match (self.base.pool.get(id), context) {
            (Some(m), _) => volring_share::is_shared(&m.parameters),
            (None, Some(c)) => volring_share::is_shared(&c.iter().map(|(k, v)| (k.clone(), v.clone())).collect()),
            (None, None) => return Ok(()),
        };
        if !shared {
            return Err(Error::FailedPrecondition(format!(
                "volume {id} was created for single-node access; MULTI_NODE_MULTI_WRITER needs a volume created with it"
            )));
        }
        Ok(())
    }

    /// Before an unstage: the volume's export goes first, so its filesystem
    /// is not held by the NFS server.
    pub(crate) fn unexport(&self, id: &str) -> Result<()> {
        self.side.unexport(id).map_err(|e| Error::Internal(format!("remove the NFS export of volume {id}: {e}")))
    }

    /// At start, after the first reconcile pass: re-exports the recorded
    /// shares of volumes still staged intact.
    pub(crate) fn resume(&self) {
        let n = self.side.resume(|id| {
            let r = self.base.records.get(id)?;
            self.base.stage_intact(&r).ok()?.then(|| r.staged_at())
        });
        match n {
            Ok(0) => {}
            Ok(n) => tracing::info!(shares = n, "NFS exports resumed"),
            Err(e) => tracing::error!(error = %e, "cannot resume the NFS exports"),
        }
    }

    /// The volumes this node exports over NFS now, each with the PVC it was
    /// created for (for the cluster's Service loop, `volring_share::follow`).
    pub(crate) fn exported(&self) -> Vec<volring_share::follow::Exported> {
        self.side.exported(|id| self.base.pool.get(id).map(|m| m.parameters))
    }

    /// The node's share side (its server's pid and records).
    pub(crate) fn side(&self) -> &ShareSide {
        &self.side
    }
}
