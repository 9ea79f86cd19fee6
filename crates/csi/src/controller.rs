//! Controller service: node-local image volumes in the pool.

use std::collections::{BTreeMap, HashMap};

use super::proto::*;
use super::validate::{self, Access};
use std::sync::Arc;

use super::base::Base;
use super::nbd::NbdSide;
use super::nbd_export::NbdExports;
use super::{Error, Expansion, Result};
use volring_share::ShareSide;
use volring_volumes::filesystem::FsKind;
use volring_volumes::{attach, AccessKind, AttachKind, StagePhase, VolumeMeta};

/// StorageClass parameters volring understands; the external-provisioner's
/// own `csi.storage.k8s.io/` keys are passed through and ignored.
pub(super) const PARAM_FS_TYPE: &str = "fsType";
/// `loop` (the default) or `nbd`: how the node attaches the image.
pub(super) const PARAM_ATTACH: &str = "attach";
const PROVISIONER_PREFIX: &str = "csi.storage.k8s.io/";

/// The controller service: volumes in this node's pool.
pub(crate) struct Controller {
    base: Arc<Base>,
    exports: Arc<NbdExports>,
    side: Arc<ShareSide>,
    nbd: Arc<NbdSide>,
}

impl Controller {
    pub(crate) fn new(base: Arc<Base>, exports: Arc<NbdExports>, side: Arc<ShareSide>, nbd: Arc<NbdSide>) -> Self {
        Self { base, exports, side, nbd }
    }

    pub(crate) fn create_volume(&self, req: CreateVolumeRequest) -> Result<CreateVolumeResponse> {
        validate::volume_name(&req.name)?;
        let caps = validate::capabilities(&req.volume_capabilities)?;
        if req.volume_content_source.is_some() {
            return Err(Error::InvalidArgument("volume_content_source is not supported (no snapshots or clones)".into()));
        }
        let fs_type = parameters(&req.parameters)?;
        if let Some(t) = &req.accessibility_requirements {
            if !t.requisite.is_empty() && !t.requisite.iter().any(|t| self.base.is_here(t)) {
                return Err(Error::ResourceExhausted(format!("volumes can only be created on node {}", self.base.config.node_id)));
            }
        }
        // MULTI_NODE_MULTI_WRITER: the volume is shared over NFS (volring_share).
        let shared = caps.iter().any(Access::shared);
        let min = min_size(fs_type, &caps);
        let size = validate::capacity(req.capacity_range.as_ref(), min, self.base.max_volume_size())?;
        let id = req.name.clone();
        let _guard = self.base.lock(&id)?;
        if let Some(have) = self.base.pool.get(&id) {
            let fits = have.size_bytes >= min_required(req.capacity_range.as_ref())
                && limit(req.capacity_range.as_ref()).is_none_or(|l| have.size_bytes <= l);
            let same_fs = have.fs_type == fs_type.map(|k| k.to_string());
            let kind = |p: &BTreeMap<String, String>| p.get(PARAM_ATTACH).and_then(|v| v.parse::<AttachKind>().ok()).unwrap_or_default();
            let wanted: BTreeMap<String, String> = req.parameters.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
            if kind(&have.parameters) != kind(&wanted) {
                return Err(Error::AlreadyExists(format!(
                    "volume {id} exists with attach {}; the request asks for {}",
                    kind(&have.parameters),
                    kind(&wanted)
                )));
            }
            if volring_share::is_shared(&have.parameters) != shared {
                return Err(Error::AlreadyExists(format!(
                    "volume {id} exists {}shared; the request asks for {}",
                    if shared { "not " } else { "" },
                    if shared { "MULTI_NODE_MULTI_WRITER" } else { "single-node access" }
                )));
            }
            if !fits || !same_fs {
                return Err(Error::AlreadyExists(format!(
                    "volume {id} exists with {} bytes and fsType {:?}; the request does not match",
                    have.size_bytes, have.fs_type
                )));
            }
            self.exports.export_volume(&have)?;
            return Ok(CreateVolumeResponse { volume: Some(self.volume(&have)) });
        }
        let nbd = req.parameters.get(PARAM_ATTACH).and_then(|v| v.parse::<AttachKind>().ok()) == Some(AttachKind::Nbd);
        let nbd_secret = if nbd { self.exports.new_secret()? } else { None };
        let mut parameters = req.parameters.iter().map(|(k, v)| (k.clone(), v.clone())).collect::<BTreeMap<_, _>>();
        if shared {
            volring_share::mark_shared(&mut parameters);
        }
        let meta = self.base.pool.create(VolumeMeta {
            id: id.clone(),
            name: req.name.clone(),
            size_bytes: size,
            fs_type: fs_type.map(|f| f.to_string()),
            parameters,
            created_unix: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
            nbd_secret,
        })?;
        self.exports.export_volume(&meta)?;
        tracing::info!(volume = %id, bytes = size, "created volume");
        Ok(CreateVolumeResponse { volume: Some(self.volume(&meta)) })
    }

    pub(crate) fn delete_volume(&self, req: DeleteVolumeRequest) -> Result<DeleteVolumeResponse> {
        validate::volume_id(&req.volume_id)?;
        let id = &req.volume_id;
        let _guard = self.base.lock(id)?;
        // A stage that failed in its own mkfs keeps only that intent, with no
        // device: nothing of the volume is in use, so it may go (the intent
        // is dropped once no device is found either).
        let abandoned_stage = match self.base.records.get(id) {
            Some(r) if r.phase == StagePhase::Formatting && r.loop_number.is_none() && r.nbd_index.is_none() => true,
            Some(r) => return Err(Error::FailedPrecondition(format!("volume {id} is staged at {}", r.staging_path.display()))),
            None => false,
        };
        // A device whose detach the kernel deferred (another opener) is
        // waited for, bounded; one really in use fails the delete.
        if let Some(a) = attach::still_attached(&self.base.pool.image_path(id)).first() {
            return Err(Error::FailedPrecondition(format!("volume {id} is still attached as {}", a.path().display())));
        }
        if abandoned_stage {
            self.base.records.remove(id)?;
        }
        // Other nodes lose it first (their connections are closed); put
        // back if the delete fails.
        self.exports.withdraw(id)?;
        // Unconditional: the pool also removes what an interrupted delete
        // left, and the image of a volume whose record is quarantined.
        let deleted = self.base.pool.delete(id).inspect_err(|_| {
            if let Some(m) = self.base.pool.get(id) {
                let _ = self.exports.export_volume(&m);
            }
        })?;
        self.exports.forget_holder(id);
        if deleted {
            tracing::info!(volume = %id, "deleted volume");
        }
        Ok(DeleteVolumeResponse {})
    }

    pub(crate) fn controller_expand(&self, req: ControllerExpandVolumeRequest) -> Result<ControllerExpandVolumeResponse> {
        if self.base.config.expansion == Expansion::Node {
            return Err(Error::Unimplemented("ControllerExpandVolume: volumes grow on their node (NodeExpandVolume)"));
        }
        validate::volume_id(&req.volume_id)?;
        let range = req.capacity_range.as_ref().ok_or_else(|| Error::InvalidArgument("capacity_range is required".into()))?;
        validate::capacity_range(range)?;
        let cap = req.volume_capability.as_ref().map(|c| validate::capability(Some(c))).transpose()?;
        let id = &req.volume_id;
        let _guard = self.base.lock(id)?;
        let have = self.base.pool.get(id).ok_or_else(|| Error::NotFound(format!("volume {id} does not exist")))?;
        if limit(Some(range)).is_some_and(|l| l < have.size_bytes) {
            return Err(Error::OutOfRange(format!("volume {id} has {} bytes; volumes do not shrink", have.size_bytes)));
        }
        let staged = self.base.records.get(id);
        let node_expansion_required = match (&cap, &staged) {
            (Some(c), _) => c.is_mount(),
            (None, Some(r)) => matches!(r.access, AccessKind::Mount { .. }),
            // Unknown use: ask for the node step; for a block volume it only
            // refreshes the device size.
            (None, None) => true,
        };
        let size = self.base.grow_image(id, range, have.size_bytes)?;
        // A staged device sees the new size at once, so block volumes need
        // no node step; a filesystem still has to be grown by the node.
        if let Some((rec, a)) = staged.as_ref().and_then(|r| Some((r, attach::of_record(r)?))) {
            self.nbd.refresh_device(rec, &a)?;
            volring_volumes::fault::point("expand:refreshed");
        }
        tracing::info!(volume = %id, bytes = size, "expanded volume");
        Ok(ControllerExpandVolumeResponse { capacity_bytes: size as i64, node_expansion_required })
    }

    pub(crate) fn get_capacity(&self, req: GetCapacityRequest) -> Result<GetCapacityResponse> {
        let usable = req.volume_capabilities.is_empty() || validate::capabilities(&req.volume_capabilities).is_ok();
        let here = req.accessible_topology.as_ref().is_none_or(|t| self.base.is_here(t));
        let fs = parameters(&req.parameters).ok();
        let available = if usable && here && fs.is_some() { self.base.pool.free_bytes()? } else { 0 };
        let min = fs.flatten().map_or(FsKind::Ext4.min_size(), FsKind::min_size);
        Ok(GetCapacityResponse {
            available_capacity: available.min(i64::MAX as u64) as i64,
            maximum_volume_size: Some(self.base.max_volume_size() as i64),
            minimum_volume_size: Some(min as i64),
        })
    }

    pub(crate) fn list_volumes(&self, req: ListVolumesRequest) -> Result<ListVolumesResponse> {
        if req.max_entries < 0 {
            return Err(Error::InvalidArgument("max_entries must not be negative".into()));
        }
        let after = match req.starting_token.as_str() {
            "" => None,
            t => Some(validate::parse_list_token(t)?),
        };
        let max = if req.max_entries == 0 { usize::MAX } else { req.max_entries as usize };
        let mut page = self.base.pool.page(after.as_deref(), max.saturating_add(1));
        let next_token = if page.len() > max {
            page.truncate(max);
            page.last().map(|m| validate::list_token(&m.id)).unwrap_or_default()
        } else {
            String::new()
        };
        let entries = page.iter().map(|m| list_volumes_response::Entry { volume: Some(self.volume(m)), status: None }).collect();
        Ok(ListVolumesResponse { entries, next_token })
    }

    pub(crate) fn validate_capabilities(&self, req: ValidateVolumeCapabilitiesRequest) -> Result<ValidateVolumeCapabilitiesResponse> {
        validate::volume_id(&req.volume_id)?;
        if req.volume_capabilities.is_empty() {
            return Err(Error::InvalidArgument("volume_capabilities is required".into()));
        }
        let have = self.base.pool.get(&req.volume_id).ok_or_else(|| Error::NotFound(format!("volume {} does not exist", req.volume_id)))?;
        let checked = validate::capabilities(&req.volume_capabilities).and_then(|caps| {
            let wrong_fs = caps.iter().find_map(|c| match (&c.access, &have.fs_type) {
                (validate::AccessType::Mount { fs, .. }, Some(want)) if fs.to_string() != *want => Some(want.clone()),
                _ => None,
            });
            if let Some(want) = wrong_fs {
                return Err(Error::InvalidArgument(format!("the volume was created for {want}")));
            }
            if caps.iter().any(Access::shared) && !volring_share::is_shared(&have.parameters) {
                return Err(Error::InvalidArgument(format!(
                    "volume {} was created for single-node access; MULTI_NODE_MULTI_WRITER needs a volume created with it",
                    req.volume_id
                )));
            }
            Ok(())
        });
        Ok(match checked {
            Ok(()) => ValidateVolumeCapabilitiesResponse {
                confirmed: Some(validate_volume_capabilities_response::Confirmed {
                    volume_context: req.volume_context,
                    volume_capabilities: req.volume_capabilities,
                    parameters: req.parameters,
                    mutable_parameters: HashMap::new(),
                }),
                message: String::new(),
            },
            Err(e) => ValidateVolumeCapabilitiesResponse { confirmed: None, message: e.to_string() },
        })
    }

    pub(crate) fn volume(&self, m: &VolumeMeta) -> Volume {
        let mut volume_context = HashMap::new();
        if let Some(fs) = &m.fs_type {
            volume_context.insert(PARAM_FS_TYPE.to_string(), fs.clone());
        }
        if let Some(a) = m.parameters.get(PARAM_ATTACH) {
            volume_context.insert(PARAM_ATTACH.to_string(), a.clone());
        }
        self.exports.context(m, &mut volume_context);
        self.side.context(&m.id, &m.parameters, &mut volume_context);
        // A volume other nodes reach (an nbd export, an NFS share) has no
        // topology: "equally accessible from all nodes"; others only here.
        let reachable =
            volume_context.contains_key(super::nbd_export::CONTEXT_URI) || volume_context.contains_key(volring_share::CTX_SERVER);
        let accessible_topology = if reachable { Vec::new() } else { vec![self.base.topology()] };
        Volume { capacity_bytes: m.size_bytes as i64, volume_id: m.id.clone(), volume_context, content_source: None, accessible_topology }
    }
}

/// Checks StorageClass parameters; returns the requested filesystem.
fn parameters(p: &HashMap<String, String>) -> Result<Option<FsKind>> {
    let mut fs = None;
    for (k, v) in p {
        match k.as_str() {
            PARAM_FS_TYPE => fs = Some(v.parse::<FsKind>().map_err(|()| Error::InvalidArgument(format!("fsType {v:?}: ext4 or xfs")))?),
            PARAM_ATTACH => {
                v.parse::<AttachKind>().map_err(|()| Error::InvalidArgument(format!("attach {v:?}: loop or nbd")))?;
            }
            volring_share::PARAM_SQUASH => {
                v.parse::<volring_share::Squash>().map_err(|e| Error::InvalidArgument(e.to_string()))?;
            }
            k if k.starts_with(PROVISIONER_PREFIX) => {}
            k => {
                return Err(Error::InvalidArgument(format!(
                    "unknown parameter {k:?} (volring knows {PARAM_FS_TYPE}, {PARAM_ATTACH} and {})",
                    volring_share::PARAM_SQUASH
                )))
            }
        }
    }
    Ok(fs)
}

fn min_size(fs: Option<FsKind>, caps: &[Access]) -> u64 {
    let from_caps = caps.iter().filter_map(|c| match &c.access {
        validate::AccessType::Mount { fs, .. } => Some(fs.min_size()),
        validate::AccessType::Block => None,
    });
    from_caps.chain(fs.map(FsKind::min_size)).max().unwrap_or(FsKind::Ext4.min_size())
}

fn min_required(r: Option<&CapacityRange>) -> u64 {
    r.map_or(0, |r| r.required_bytes.max(0) as u64)
}

fn limit(r: Option<&CapacityRange>) -> Option<u64> {
    r.map(|r| r.limit_bytes.max(0) as u64).filter(|&l| l > 0)
}
