//! A CSI client over the unix socket, and `volring csi`: call any RPC by
//! hand and print the reply as JSON (what `csc` does for Go drivers).

use std::collections::HashMap;
use std::path::PathBuf;

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

use super::proto::controller_client::ControllerClient;
use super::proto::identity_client::IdentityClient;
use super::proto::node_client::NodeClient;
use super::proto::volume_capability::{access_mode::Mode, AccessMode, AccessType, BlockVolume, MountVolume};
use super::proto::*;

/// Connects to a CSI server listening on the unix socket `path`.
pub(crate) async fn connect(path: PathBuf) -> Result<Channel, tonic::transport::Error> {
    // The URI is required by the API and ignored by the connector.
    Endpoint::from_static("http://csi.invalid")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?)) }
        }))
        .await
}

/// The three clients on one connection.
#[derive(Clone)]
pub struct Clients {
    pub identity: IdentityClient<Channel>,
    pub controller: ControllerClient<Channel>,
    pub node: NodeClient<Channel>,
}

impl Clients {
    pub async fn connect(path: PathBuf) -> Result<Self, tonic::transport::Error> {
        let ch = connect(path).await?;
        Ok(Self { identity: IdentityClient::new(ch.clone()), controller: ControllerClient::new(ch.clone()), node: NodeClient::new(ch) })
    }
}

/// A volume capability: block, or mount with a filesystem and flags.
pub fn capability(block: bool, fs_type: &str, flags: &[String], mode: Mode) -> VolumeCapability {
    let access_type = if block {
        AccessType::Block(BlockVolume {})
    } else {
        AccessType::Mount(MountVolume { fs_type: fs_type.to_string(), mount_flags: flags.to_vec(), volume_mount_group: String::new() })
    };
    VolumeCapability { access_type: Some(access_type), access_mode: Some(AccessMode { mode: mode as i32 }) }
}

/// `512M`, `10G`, `1T` or a number of bytes.
pub(crate) fn parse_size(s: &str) -> Result<i64, String> {
    let s = s.trim();
    let (num, shift) = match s.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => return Err(format!("size {s:?}: unit must be K, M, G or T")),
            };
            (&s[..i], shift)
        }
        _ => (s, 0),
    };
    let n: i64 = num.parse().map_err(|_| format!("size {s:?} is not a number"))?;
    n.checked_mul(1 << shift).filter(|v| *v >= 0).ok_or_else(|| format!("size {s:?} is out of range"))
}

#[derive(clap::Args, Debug, Clone)]
pub struct VolumeArgs {
    /// Block access instead of a mounted filesystem.
    #[arg(long)]
    pub block: bool,
    /// Filesystem for mount access (ext4 or xfs; empty: the volume's).
    #[arg(long, default_value = "")]
    pub fs: String,
    /// A mount flag (repeatable).
    #[arg(long = "mount-flag")]
    pub(crate) mount_flags: Vec<String>,
    /// Access mode: single-node-writer, single-node-reader-only, single-node-multi-writer...
    #[arg(long, default_value = "single-node-writer", value_parser = parse_mode)]
    pub mode: Mode,
}

impl VolumeArgs {
    fn capability(&self) -> VolumeCapability {
        capability(self.block, &self.fs, &self.mount_flags, self.mode)
    }
}

fn parse_mode(s: &str) -> Result<Mode, String> {
    Mode::from_str_name(&s.to_ascii_uppercase().replace('-', "_")).ok_or_else(|| format!("unknown access mode {s:?}"))
}

fn parse_param(s: &str) -> Result<(String, String), String> {
    s.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())).ok_or_else(|| format!("parameter {s:?}: expected key=value"))
}

/// One RPC with its fields.
#[derive(clap::Subcommand, Debug, Clone)]
pub enum Call {
    /// Identity.GetPluginInfo
    PluginInfo,
    /// Identity.GetPluginCapabilities
    PluginCapabilities,
    /// Identity.Probe
    Probe,
    /// Controller.CreateVolume
    Create {
        /// The volume's name (the CO's idempotency key).
        #[arg(long)]
        name: String,
        /// Required size (e.g. 1G).
        #[arg(long, value_parser = parse_size)]
        size: Option<i64>,
        /// Largest acceptable size.
        #[arg(long, value_parser = parse_size)]
        limit: Option<i64>,
        /// A StorageClass parameter, key=value (repeatable).
        #[arg(long = "param", value_parser = parse_param)]
        params: Vec<(String, String)>,
        #[command(flatten)]
        volume: VolumeArgs,
    },
    /// Controller.DeleteVolume
    Delete {
        /// The volume id CreateVolume returned.
        #[arg(long)]
        id: String,
    },
    /// Controller.ControllerExpandVolume
    Expand {
        /// The volume id.
        #[arg(long)]
        id: String,
        /// The new required size (e.g. 2G).
        #[arg(long, value_parser = parse_size)]
        size: i64,
        #[command(flatten)]
        volume: VolumeArgs,
    },
    /// Controller.ValidateVolumeCapabilities
    Validate {
        /// The volume id.
        #[arg(long)]
        id: String,
        #[command(flatten)]
        volume: VolumeArgs,
    },
    /// Controller.ListVolumes
    List {
        /// Most entries in one reply (0: the driver chooses).
        #[arg(long, default_value_t = 0)]
        max: i32,
        /// Where to continue: the next_token of the previous reply.
        #[arg(long, default_value = "")]
        token: String,
    },
    /// Controller.GetCapacity
    Capacity,
    /// Controller.ControllerGetCapabilities
    ControllerCapabilities,
    /// Node.NodeStageVolume
    Stage {
        /// The volume id.
        #[arg(long)]
        id: String,
        /// The staging path, under the kubelet root.
        #[arg(long)]
        staging: String,
        /// A volume context entry, key=value, as CreateVolume returned it
        /// (repeatable; a remote volume's volring.io/nbd-uri and
        /// volring.io/nbd-secret, a shared volume's share, nfsServer, nfsExport).
        #[arg(long = "context", value_parser = parse_param)]
        context: Vec<(String, String)>,
        #[command(flatten)]
        volume: VolumeArgs,
    },
    /// Node.NodeUnstageVolume
    Unstage {
        /// The volume id.
        #[arg(long)]
        id: String,
        /// The staging path it was staged at.
        #[arg(long)]
        staging: String,
    },
    /// Node.NodePublishVolume
    Publish {
        /// The volume id.
        #[arg(long)]
        id: String,
        /// The staging path it was staged at.
        #[arg(long)]
        staging: String,
        /// The target path to publish at, under the kubelet root.
        #[arg(long)]
        target: String,
        /// Publish read-only.
        #[arg(long)]
        readonly: bool,
        #[command(flatten)]
        volume: VolumeArgs,
    },
    /// Node.NodeUnpublishVolume
    Unpublish {
        /// The volume id.
        #[arg(long)]
        id: String,
        /// The target path it was published at.
        #[arg(long)]
        target: String,
    },
    /// Node.NodeGetVolumeStats
    Stats {
        /// The volume id.
        #[arg(long)]
        id: String,
        /// A path the volume is staged or published at.
        #[arg(long)]
        path: String,
    },
    /// Node.NodeExpandVolume
    NodeExpand {
        /// The volume id.
        #[arg(long)]
        id: String,
        /// A path the volume is staged or published at.
        #[arg(long)]
        path: String,
        /// The new required size (e.g. 2G; none: no capacity range is sent).
        #[arg(long, value_parser = parse_size)]
        size: Option<i64>,
    },
    /// Node.NodeGetCapabilities
    NodeCapabilities,
    /// Node.NodeGetInfo
    NodeInfo,
}

/// Makes the call and returns the reply as JSON.
pub async fn call(c: &mut Clients, call: Call) -> Result<serde_json::Value, tonic::Status> {
    fn json<T: serde::Serialize>(r: tonic::Response<T>) -> serde_json::Value {
        serde_json::to_value(r.into_inner()).expect("CSI replies serialise")
    }
    let range = |req: Option<i64>, lim: Option<i64>| {
        (req.is_some() || lim.is_some()).then(|| CapacityRange { required_bytes: req.unwrap_or(0), limit_bytes: lim.unwrap_or(0) })
    };
    Ok(match call {
        Call::PluginInfo => json(c.identity.get_plugin_info(GetPluginInfoRequest {}).await?),
        Call::PluginCapabilities => json(c.identity.get_plugin_capabilities(GetPluginCapabilitiesRequest {}).await?),
        Call::Probe => json(c.identity.probe(ProbeRequest {}).await?),
        Call::Create { name, size, limit, params, volume } => json(
            c.controller
                .create_volume(CreateVolumeRequest {
                    name,
                    capacity_range: range(size, limit),
                    volume_capabilities: vec![volume.capability()],
                    parameters: params.into_iter().collect::<HashMap<_, _>>(),
                    ..Default::default()
                })
                .await?,
        ),
        Call::Delete { id } => json(c.controller.delete_volume(DeleteVolumeRequest { volume_id: id, ..Default::default() }).await?),
        Call::Expand { id, size, volume } => json(
            c.controller
                .controller_expand_volume(ControllerExpandVolumeRequest {
                    volume_id: id,
                    capacity_range: range(Some(size), None),
                    volume_capability: Some(volume.capability()),
                    ..Default::default()
                })
                .await?,
        ),
        Call::Validate { id, volume } => json(
            c.controller
                .validate_volume_capabilities(ValidateVolumeCapabilitiesRequest {
                    volume_id: id,
                    volume_capabilities: vec![volume.capability()],
                    ..Default::default()
                })
                .await?,
        ),
        Call::List { max, token } => json(c.controller.list_volumes(ListVolumesRequest { max_entries: max, starting_token: token }).await?),
        Call::Capacity => json(c.controller.get_capacity(GetCapacityRequest::default()).await?),
        Call::ControllerCapabilities => json(c.controller.controller_get_capabilities(ControllerGetCapabilitiesRequest {}).await?),
        Call::Stage { id, staging, context, volume } => json(
            c.node
                .node_stage_volume(NodeStageVolumeRequest {
                    volume_id: id,
                    staging_target_path: staging,
                    volume_capability: Some(volume.capability()),
                    volume_context: context.into_iter().collect::<HashMap<_, _>>(),
                    ..Default::default()
                })
                .await?,
        ),
        Call::Unstage { id, staging } => {
            json(c.node.node_unstage_volume(NodeUnstageVolumeRequest { volume_id: id, staging_target_path: staging }).await?)
        }
        Call::Publish { id, staging, target, readonly, volume } => json(
            c.node
                .node_publish_volume(NodePublishVolumeRequest {
                    volume_id: id,
                    staging_target_path: staging,
                    target_path: target,
                    volume_capability: Some(volume.capability()),
                    readonly,
                    ..Default::default()
                })
                .await?,
        ),
        Call::Unpublish { id, target } => {
            json(c.node.node_unpublish_volume(NodeUnpublishVolumeRequest { volume_id: id, target_path: target }).await?)
        }
        Call::Stats { id, path } => json(
            c.node
                .node_get_volume_stats(NodeGetVolumeStatsRequest { volume_id: id, volume_path: path, staging_target_path: String::new() })
                .await?,
        ),
        Call::NodeExpand { id, path, size } => json(
            c.node
                .node_expand_volume(NodeExpandVolumeRequest {
                    volume_id: id,
                    volume_path: path,
                    capacity_range: range(size, None),
                    ..Default::default()
                })
                .await?,
        ),
        Call::NodeCapabilities => json(c.node.node_get_capabilities(NodeGetCapabilitiesRequest {}).await?),
        Call::NodeInfo => json(c.node.node_get_info(NodeGetInfoRequest {}).await?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_modes() {
        assert_eq!(parse_size("512M").unwrap(), 512 << 20);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("1g").unwrap(), 1 << 30);
        assert!(parse_size("1X").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("99999999999T").is_err());
        assert_eq!(parse_mode("single-node-reader-only").unwrap(), Mode::SingleNodeReaderOnly);
        assert!(parse_mode("everywhere").is_err());
    }
}
