//! The CSI hooks of shared (MULTI_NODE_MULTI_WRITER) volumes; the work is
//! in `volring_share`. On the node that holds the volume: export after the
//! stage, unexport before the unstage, re-export at start.

use super::validate::Access;
use super::{Driver, Error, Result};

/// Reads the endpoint published on a PVC; runs on the CSI call's blocking thread.
pub use volring_share::follow::EndpointLookup;

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
    pub(super) fn created_for(&self, id: &str, access: &Access, context: Option<&std::collections::HashMap<String, String>>) -> Result<()> {
        if !access.shared() {
            return Ok(());
        }
        let shared = match (self.pool.get(id), context) {
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

    /// The volumes this node exports over NFS now, each with the PVC it was
    /// created for (for the cluster's Service loop, `volring_share::follow`).
    pub fn exported_shares(&self) -> Vec<volring_share::follow::Exported> {
        let records = match self.share.records() {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(error = %e, "cannot read the share records");
                return Vec::new();
            }
        };
        records
            .into_iter()
            .map(|r| volring_share::follow::Exported {
                pvc: match self.pool.get(&r.volume_id) {
                    Some(m) => volring_share::pvc_of(&m.parameters),
                    // Staged here from another node's export (moved here).
                    None => volring_share::get_pvc(self.records.store(), &r.volume_id),
                },
                volume_id: r.volume_id,
            })
            .collect()
    }

    /// Sets how NodeStage of a shared volume another node holds finds the
    /// endpoint published on its PVC (in a cluster; without one the
    /// context's `nfsServer` is mounted).
    pub fn set_endpoint_lookup(&self, f: EndpointLookup) {
        let _ = self.endpoint_lookup.set(f);
    }

    /// The server a shared volume's NodeStage mounts: the endpoint
    /// published on the PVC the context names, when this node can read
    /// it; else the context's own (`remote`). Published but not yet:
    /// UNAVAILABLE, and kubelet retries.
    pub(super) fn published_remote(
        &self,
        id: &str,
        context: &std::collections::HashMap<String, String>,
        mut remote: volring_share::client::Remote,
    ) -> Result<volring_share::client::Remote> {
        let (Some(lookup), Some((ns, name))) = (self.endpoint_lookup.get(), volring_share::pvc_in_context(context)) else {
            return Ok(remote);
        };
        let endpoint = lookup(&ns, &name)
            .map_err(|e| Error::Unavailable(format!("volume {id}: reading the NFS endpoint of PVC {ns}/{name}: {e}")))?
            .ok_or_else(|| {
                Error::Unavailable(format!("volume {id}: the owning node has not published the NFS endpoint on PVC {ns}/{name} yet"))
            })?;
        remote.server = endpoint.parse().map_err(|_| {
            Error::FailedPrecondition(format!("volume {id}: PVC {ns}/{name} names the NFS endpoint {endpoint:?}, not address:port"))
        })?;
        Ok(remote)
    }

    /// The node's share side (its server's pid and records).
    pub fn shares(&self) -> &volring_share::ShareSide {
        &self.share
    }
}

/// The cluster's shared-volume loop (`volring_share::follow`) reaches the
/// driver through this trait: share sits below csi in the crate graph.
impl volring_share::follow::ShareHost for Driver {
    fn shares(&self) -> &volring_share::ShareSide {
        Driver::shares(self)
    }
    fn exported_shares(&self) -> Vec<volring_share::follow::Exported> {
        Driver::exported_shares(self)
    }
    fn set_endpoint_lookup(&self, f: EndpointLookup) {
        Driver::set_endpoint_lookup(self, f)
    }
}
