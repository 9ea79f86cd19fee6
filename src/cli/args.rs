//! The command line's argument groups (flags shared by several
//! subcommands, each with the configuration it builds); `main.rs` keeps
//! the subcommands and what each one runs.

use volring_devices::{DeviceFilter, ScanConfig};
use volring_mounts::{WatchConfig, WatchMode};
use volring_ring::BackendChoice;

use clap::ValueEnum;
#[derive(clap::Args)]
#[command(next_help_heading = "NBD server")]
pub(crate) struct NbdTuning {
    /// Ring threads (0: one per core, at most 4); each ring holds up to
    /// 32 MiB of buffers of its own, outside --nbd-max-server-bytes.
    #[arg(long, env = "VOLRING_NBD_THREADS", default_value_t = 0)]
    pub(crate) nbd_threads: usize,
    /// Buffered writes of up to 2 MiB on the ring thread when the pool's
    /// file system would hand each one to an io_uring worker (ext4): auto
    /// probes each export, off sends every write through io_uring.
    #[arg(long, env = "VOLRING_NBD_INLINE_WRITES", default_value = "auto")]
    pub(crate) nbd_inline_writes: volring_nbd::InlineWrites,
    /// Page-cache reads in io_uring's worker threads when a ring thread is
    /// starved of CPU (auto), never (off) or always.
    #[arg(long, env = "VOLRING_NBD_OFFLOAD_READS", default_value = "auto")]
    pub(crate) nbd_offload_reads: volring_nbd::OffloadReads,
    /// Microseconds a quiet ring that has just served a stream of small
    /// requests polls for the next one before it sleeps (0: never; at most
    /// 10000). Trades a little CPU for the wake-up of a halted CPU at queue
    /// depth 1. Applies to the node's attach server too.
    #[arg(long, env = "VOLRING_NBD_IDLE_POLL_US", default_value_t = 50)]
    pub(crate) nbd_idle_poll_us: u64,
    /// Keep ring threads at their nice instead of giving each the
    /// scheduler weight of as many threads as it has busy connections
    /// (what a thread-per-connection server gets on a contended CPU; needs
    /// CAP_SYS_NICE, without which rings keep their nice anyway).
    #[arg(long, env = "VOLRING_NBD_NO_RING_WEIGHT")]
    pub(crate) nbd_no_ring_weight: bool,
    /// Seconds a client has to finish the handshake.
    #[arg(long, default_value_t = 10.0)]
    pub(crate) handshake_timeout: f64,
    /// Close connections idle this many seconds (0: never).
    #[arg(long, default_value_t = 0.0)]
    pub(crate) idle_timeout: f64,
    /// Close a connection whose replies make no progress for this many seconds.
    #[arg(long, default_value_t = 60.0)]
    pub(crate) stall_timeout: f64,
    /// Bytes of buffers and queued replies one connection may hold before
    /// the server stops reading its requests.
    #[arg(long, default_value_t = 96 << 20)]
    pub(crate) nbd_max_conn_bytes: usize,
    /// Requests one connection may have in flight before the server stops
    /// reading its requests.
    #[arg(long, default_value_t = 512)]
    pub(crate) nbd_max_conn_requests: u32,
    /// Bytes every connection together may hold; past it the heaviest
    /// connections stop being read first, and a stalled one is dropped.
    #[arg(long, default_value_t = 128 << 20)]
    pub(crate) nbd_max_server_bytes: usize,
}

impl NbdTuning {
    pub(crate) fn config(&self, listen: Vec<volring_nbd::Listen>) -> volring_nbd::ServerConfig {
        volring_nbd::ServerConfig {
            listen,
            threads: self.nbd_threads,
            inline_writes: self.nbd_inline_writes,
            offload_reads: self.nbd_offload_reads,
            idle_poll: std::time::Duration::from_micros(self.nbd_idle_poll_us.min(10_000)),
            ring_weight: !self.nbd_no_ring_weight,
            handshake_timeout: std::time::Duration::from_secs_f64(self.handshake_timeout.max(0.05)),
            idle_timeout: (self.idle_timeout > 0.0).then(|| std::time::Duration::from_secs_f64(self.idle_timeout)),
            stall_timeout: std::time::Duration::from_secs_f64(self.stall_timeout.max(0.05)),
            max_queued_bytes: self.nbd_max_conn_bytes.max(1),
            max_requests: self.nbd_max_conn_requests.max(1),
            max_server_bytes: self.nbd_max_server_bytes.max(1),
            ..Default::default()
        }
    }
}

#[derive(clap::Args)]
#[command(next_help_heading = "NBD exports")]
pub(crate) struct NodeNbdArgs {
    /// Serve NBD here: HOST:PORT or unix:PATH (repeatable; none: no NBD server).
    #[arg(long = "nbd-listen", value_name = "ADDR")]
    pub(crate) nbd_listen: Vec<String>,
    /// An export of the node's NBD server (repeatable; see `nbd serve --export`).
    #[arg(long = "nbd-export", value_name = "SPEC")]
    pub(crate) nbd_export: Vec<String>,
    /// Serve this node's `attach: nbd` CSI volumes to other nodes on this
    /// TCP address (HOST:PORT; port 0 picks one). Only volumes created
    /// here with a secret are served, and only to a client naming it; no
    /// TLS, so bind an address on the storage network. Off by default.
    #[arg(long = "nbd-export-listen", value_name = "HOST:PORT", env = "VOLRING_NBD_EXPORT_LISTEN")]
    pub(crate) nbd_export_listen: Option<std::net::SocketAddr>,
    /// HOST:PORT other nodes reach --nbd-export-listen at, written into
    /// volume contexts (default: the bound address; needed for 0.0.0.0).
    #[arg(long = "nbd-export-advertise", value_name = "HOST:PORT")]
    pub(crate) nbd_export_advertise: Option<String>,
    #[command(flatten)]
    pub(crate) tuning: NbdTuning,
}

impl NodeNbdArgs {
    /// The export listener's settings (the NBD tuning flags apply to it).
    pub(crate) fn export(&self) -> anyhow::Result<Option<volring_csi::nbd_export::ExportConfig>> {
        let Some(listen) = self.nbd_export_listen else {
            anyhow::ensure!(self.nbd_export_advertise.is_none(), "--nbd-export-advertise needs --nbd-export-listen");
            return Ok(None);
        };
        Ok(Some(volring_csi::nbd_export::ExportConfig {
            listen,
            advertise: self.nbd_export_advertise.clone(),
            server: self.tuning.config(Vec::new()),
        }))
    }
}

impl NodeNbdArgs {
    pub(crate) fn config(&self) -> anyhow::Result<Option<crate::agent::NbdConfig>> {
        if self.nbd_listen.is_empty() {
            anyhow::ensure!(self.nbd_export.is_empty(), "--nbd-export needs --nbd-listen");
            return Ok(None);
        }
        let listen = self.nbd_listen.iter().map(|l| l.parse()).collect::<Result<Vec<_>, _>>()?;
        let exports = self.nbd_export.iter().map(|e| e.parse()).collect::<Result<Vec<_>, _>>()?;
        Ok(Some(crate::agent::NbdConfig { server: self.tuning.config(listen), exports }))
    }
}

pub(crate) const DEFAULT_CSI_ENDPOINT: &str = "unix:///var/lib/kubelet/plugins/volring.csi.io/csi.sock";

#[derive(clap::Args)]
#[command(next_help_heading = "CSI driver")]
pub(crate) struct CsiArgs {
    /// Serve the CSI driver on this unix socket ("off" to disable).
    #[arg(long, default_value = DEFAULT_CSI_ENDPOINT)]
    pub(crate) csi_endpoint: String,
    /// Staging and target paths must lie under this directory.
    #[arg(long, default_value = "/var/lib/kubelet")]
    pub(crate) kubelet_root: std::path::PathBuf,
    /// The agent's state: volume images under pool/, staged records under
    /// staged/, and agent.lock (one agent at a time).
    #[arg(long, default_value = "/var/lib/volring")]
    pub(crate) state_dir: std::path::PathBuf,
    /// Where volume images live (default: STATE_DIR/pool).
    #[arg(long)]
    pub(crate) pool_dir: Option<std::path::PathBuf>,
    /// The node id reported to the CO, and the node name the published
    /// objects carry (default: NODE_NAME or the hostname).
    #[arg(long)]
    pub(crate) node_id: Option<String>,
    /// The most volumes the CO may put on this node (0: no limit).
    #[arg(long, default_value_t = 0)]
    pub(crate) max_volumes: i64,
    /// Attach loop devices with buffered I/O even when direct I/O works.
    #[arg(long)]
    pub(crate) no_direct_io: bool,
    /// Look at every staged volume this often (seconds), besides on every
    /// mount and device event.
    #[arg(long, env = "VOLRING_RESYNC_INTERVAL", default_value_t = 60.0)]
    pub(crate) resync_interval: f64,
    /// Only report drift (a vanished staging mount, a detached loop
    /// device); do not repair it.
    #[arg(long, env = "VOLRING_NO_REPAIR")]
    pub(crate) no_repair: bool,
    /// Detach loop devices serving pool images that no staged record
    /// explains (and nothing mounts); without it they are only reported.
    #[arg(long, env = "VOLRING_REMOVE_ORPHANS")]
    pub(crate) remove_orphans: bool,
    /// Seconds the kernel queues I/O of an `attach: nbd` volume while its
    /// connection is dead (NBD_ATTR_DEAD_CONN_TIMEOUT): an agent restart
    /// must fit in it.
    #[arg(long, default_value_t = 120)]
    pub(crate) nbd_dead_conn_timeout: u64,
    /// Seconds before the kernel resends an unanswered request of an
    /// `attach: nbd` volume (NBD_ATTR_TIMEOUT).
    #[arg(long, default_value_t = 5)]
    pub(crate) nbd_request_timeout: u64,
    /// Connections (sockets) per `attach: nbd` device.
    #[arg(long, default_value_t = 1)]
    pub(crate) nbd_attach_connections: usize,
    /// Do not reconnect nbd devices at start or on LINK_DEAD (shows what an
    /// agent restart does to its nbd volumes without the healer).
    #[arg(long, env = "VOLRING_NBD_NO_HEAL")]
    pub(crate) nbd_no_heal: bool,
    /// Which service grows a volume's image: `controller`
    /// (ControllerExpandVolume, then NodeExpandVolume for the filesystem)
    /// or `node` (NodeExpandVolume does all of it on the volume's node;
    /// the controller does not offer expansion; what deploy/ uses).
    #[arg(long, env = "VOLRING_EXPANSION", value_enum, default_value_t = ExpansionArg::Controller)]
    pub(crate) expansion: ExpansionArg,
    /// Serve shared (MULTI_NODE_MULTI_WRITER) volumes staged here over
    /// NFSv4 (nfs-ganesha) on this address:port ("off": not served).
    #[arg(long, env = "VOLRING_NFS_LISTEN", default_value = "off")]
    pub(crate) nfs_listen: String,
    /// The IP:port other nodes mount shared volumes from (default: the
    /// listen address). In a cluster it becomes the EndpointSlice's
    /// address, which may not be loopback, link-local or unspecified: a
    /// node listening on one of those advertises its pod IP (deploy/ sets
    /// it from the downward API's status.podIP).
    #[arg(long, env = "VOLRING_NFS_ADVERTISE")]
    pub(crate) nfs_advertise: Option<String>,
    /// Comma-separated IP addresses or address/prefix networks admitted to
    /// every NFS export, besides the nodes that staged the volume (which
    /// make themselves known in a cluster). Out of a cluster nobody
    /// announces itself: list the clients here. Default: none.
    #[arg(long, env = "VOLRING_NFS_CLIENTS", value_delimiter = ',')]
    pub(crate) nfs_clients: Vec<String>,
    /// In a cluster: this node's IP as other nodes' NFS servers see its
    /// connections (deploy/ sets the pod's IP, the node's under
    /// hostNetwork). Staging a shared volume another node serves announces
    /// it on the volume's PVC, and the owner admits exactly the announced
    /// nodes; unset, nothing is announced and this node mounts only from
    /// owners that list it in --nfs-clients.
    #[arg(long, env = "VOLRING_NFS_CLIENT_ADDRESS")]
    pub(crate) nfs_client_address: Option<std::net::IpAddr>,
    /// The nfs-ganesha daemon to run.
    #[arg(long, env = "VOLRING_NFS_GANESHA", default_value = "ganesha.nfsd")]
    pub(crate) nfs_ganesha: std::path::PathBuf,
    /// NFSv4 grace period (s) after the server starts: clients reclaim
    /// their opens and locks.
    #[arg(long, env = "VOLRING_NFS_GRACE", default_value_t = 20)]
    pub(crate) nfs_grace: u32,
    /// NFSv4 lease (s): a client that does not renew within it loses its
    /// locks.
    #[arg(long, env = "VOLRING_NFS_LEASE", default_value_t = 15)]
    pub(crate) nfs_lease: u32,
    /// In a cluster: seconds between re-reads of a shared volume's Service
    /// or EndpointSlice just created, until it is visible.
    #[arg(long, env = "VOLRING_NFS_SERVICE_POLL", default_value_t = 1.0)]
    pub(crate) nfs_service_poll: f64,
    /// In a cluster: seconds a just-created Service or EndpointSlice may take
    /// to become visible before the reconcile fails (and is retried).
    #[arg(long, env = "VOLRING_NFS_SERVICE_WAIT", default_value_t = 20.0)]
    pub(crate) nfs_service_wait: f64,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub(crate) enum ExpansionArg {
    Controller,
    Node,
}

impl CsiArgs {
    pub(crate) fn share_kube(&self) -> volring_share::kube::ControllerConfig {
        volring_share::kube::ControllerConfig {
            poll: std::time::Duration::from_secs_f64(self.nfs_service_poll.max(0.01)),
            total_wait: std::time::Duration::from_secs_f64(self.nfs_service_wait.max(0.0)),
        }
    }

    pub(crate) fn reconcile(&self) -> volring_volumes::ReconcileConfig {
        volring_volumes::ReconcileConfig {
            resync: std::time::Duration::from_secs_f64(self.resync_interval.max(0.1)),
            repair: !self.no_repair,
            remove_orphans: self.remove_orphans,
        }
    }
}

impl CsiArgs {
    pub(crate) fn config(&self) -> anyhow::Result<Option<volring_csi::CsiConfig>> {
        if self.csi_endpoint == "off" {
            return Ok(None);
        }
        let endpoint = volring_csi::server::parse_endpoint(&self.csi_endpoint).map_err(anyhow::Error::msg)?;
        let node = self.node_id.clone().unwrap_or_else(volring_devices::node_name);
        let mut c = volring_csi::CsiConfig::new(endpoint, node);
        c.kubelet_root = self.kubelet_root.clone();
        c.pool_dir = self.pool_dir.clone().unwrap_or_else(|| self.state_dir.join("pool"));
        c.state_dir = self.state_dir.clone();
        c.max_volumes = self.max_volumes;
        c.direct_io = !self.no_direct_io;
        c.expansion = match self.expansion {
            ExpansionArg::Controller => volring_csi::Expansion::Controller,
            ExpansionArg::Node => volring_csi::Expansion::Node,
        };
        anyhow::ensure!(self.nbd_request_timeout >= 1, "--nbd-request-timeout must be at least 1 s");
        anyhow::ensure!((1..=16).contains(&self.nbd_attach_connections), "--nbd-attach-connections: 1 to 16");
        c.nbd = volring_csi::nbd::NbdAttachConfig {
            dead_conn_timeout: std::time::Duration::from_secs(self.nbd_dead_conn_timeout),
            request_timeout: std::time::Duration::from_secs(self.nbd_request_timeout),
            connections: self.nbd_attach_connections,
            heal: !self.nbd_no_heal,
            client: volring_nbd::remote::valid_client(&c.node_id).then(|| c.node_id.clone()),
            ..Default::default()
        };
        if c.nbd.client.is_none() {
            tracing::warn!(node = %c.node_id, "the node id is not a valid NBD client name ([A-Za-z0-9._-], at most 253): \
                remote nbd volumes are attached without a node name, and their owning nodes cannot tell this node from another");
        }
        c.share.listen = match self.nfs_listen.as_str() {
            "off" => None,
            a => Some(a.parse().map_err(|e| anyhow::anyhow!("--nfs-listen {a:?}: {e} (address:port or off)"))?),
        };
        c.share.advertise = self.nfs_advertise.clone();
        c.share.clients = self.nfs_clients.iter().map(|c| c.trim().to_string()).filter(|c| !c.is_empty()).collect();
        if let Some(bad) = c.share.clients.iter().find(|c| !volring_share::valid_client(c)) {
            anyhow::bail!("--nfs-clients {bad:?}: an IP address or address/prefix network");
        }
        c.share.ganesha = self.nfs_ganesha.clone();
        anyhow::ensure!(
            self.nfs_lease >= 5 && self.nfs_grace >= self.nfs_lease,
            "--nfs-lease at least 5 s, --nfs-grace at least the lease"
        );
        c.share.grace_secs = self.nfs_grace;
        c.share.lease_secs = self.nfs_lease;
        Ok(Some(c))
    }
}

#[derive(clap::Args)]
#[command(next_help_heading = "Kubernetes publisher")]
pub(crate) struct PublishArgs {
    /// Publish to the cluster (default: when a kubeconfig or a pod's
    /// service account is found; otherwise the objects go to the node's
    /// store).
    #[arg(long)]
    pub(crate) kube: bool,
    /// Publish to the node's store even when a cluster is configured.
    #[arg(long = "publish-local-store", conflicts_with = "kube")]
    pub(crate) local_store: bool,
    /// Do not publish BlockDevice and StorageNode objects at all.
    #[arg(long)]
    pub(crate) no_publish: bool,
    /// API requests per second the publisher may make to a cluster. The
    /// node's store (no cluster, or --publish-local-store) is written at
    /// once, without pacing.
    #[arg(long, default_value_t = 20.0)]
    pub(crate) publish_qps: f64,
    /// Requests it may make at once above the rate (a cluster only, as
    /// --publish-qps).
    #[arg(long, default_value_t = 40)]
    pub(crate) publish_burst: u32,
    /// Seconds during which changes to one object become one write.
    #[arg(long, default_value_t = 1.0)]
    pub(crate) publish_window: f64,
    /// Delete the objects of devices that are gone (default: mark them Inactive).
    #[arg(long)]
    pub(crate) delete_gone_devices: bool,
}

impl PublishArgs {
    pub(crate) fn config(&self) -> Option<crate::agent::PublishConfig> {
        (!self.no_publish).then(|| crate::agent::PublishConfig {
            kube: if self.kube {
                Some(true)
            } else if self.local_store {
                Some(false)
            } else {
                None
            },
            qps: self.publish_qps.max(0.01),
            burst: self.publish_burst.max(1),
            window: std::time::Duration::from_secs_f64(self.publish_window.max(0.0)),
            gone: if self.delete_gone_devices { volring_kube::GonePolicy::Delete } else { volring_kube::GonePolicy::MarkInactive },
        })
    }
}

#[derive(clap::Args)]
#[command(next_help_heading = "Block devices")]
pub(crate) struct ScanArgs {
    /// Keep only devices whose /dev path starts with this (repeatable).
    #[arg(long = "include", value_name = "PREFIX")]
    pub(crate) include: Vec<String>,
    /// Leave out devices whose /dev path starts with this (repeatable).
    #[arg(long = "exclude", value_name = "PREFIX")]
    pub(crate) exclude: Vec<String>,
    /// Leave out the disk behind `/`.
    #[arg(long)]
    pub(crate) exclude_os_disk: bool,
    /// Also list empty devices (unattached loop devices).
    #[arg(long)]
    pub(crate) empty: bool,
    /// Do not read devices' first blocks for signatures.
    #[arg(long)]
    pub(crate) no_probe: bool,
}

impl ScanArgs {
    pub(crate) fn config(&self) -> ScanConfig {
        ScanConfig {
            filter: DeviceFilter {
                include_paths: self.include.clone(),
                exclude_paths: self.exclude.clone(),
                exclude_os_disk: self.exclude_os_disk,
                include_empty: self.empty,
                ..DeviceFilter::default()
            },
            probe: !self.no_probe,
            ..ScanConfig::default()
        }
    }
}

#[derive(clap::Args)]
#[command(next_help_heading = "Mount watcher")]
pub(crate) struct WatchArgs {
    /// How to watch mounts: fanotify+statmount, or re-reading mountinfo.
    #[arg(long, value_enum, default_value = "auto")]
    pub(crate) mount_watch: ModeArg,
    /// I/O engine of the ring threads.
    #[arg(long, value_enum, default_value = "auto")]
    pub(crate) io: IoArg,
    /// Watch another mount namespace, e.g. the host's (`/proc/1/ns/mnt`)
    /// from a container with hostPID.
    #[arg(long, value_name = "PATH")]
    pub(crate) mount_namespace: Option<std::path::PathBuf>,
    /// Microseconds the mount watcher gathers events before handling them
    /// (a storm costs one ring turn per window; 0: one per event). Adds up
    /// to about this much latency to a change. The node's reconciler proves
    /// every drift through descriptors before it reports or repairs it, so
    /// a table one window old never decides anything (see docs/state.md, "The reconciler").
    #[arg(long, value_name = "US", env = "VOLRING_MOUNT_BATCH_US", default_value_t = 1000)]
    pub(crate) mount_batch_us: u64,
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum ModeArg {
    Auto,
    Fanotify,
    Reparse,
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum IoArg {
    Auto,
    Uring,
    Epoll,
}

impl WatchArgs {
    pub(crate) fn config(&self) -> WatchConfig {
        WatchConfig {
            mode: match self.mount_watch {
                ModeArg::Auto => WatchMode::Auto,
                ModeArg::Fanotify => WatchMode::Fanotify,
                ModeArg::Reparse => WatchMode::Reparse,
            },
            backend: match self.io {
                IoArg::Auto => BackendChoice::Auto,
                IoArg::Uring => BackendChoice::IoUring,
                IoArg::Epoll => BackendChoice::Epoll,
            },
            namespace: self.mount_namespace.clone(),
            batch_window: std::time::Duration::from_micros(self.mount_batch_us),
            ..WatchConfig::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Args;

    /// The rate limit binds only the cluster's API: its help says the
    /// node's store is written at once.
    #[test]
    fn publish_qps_help_names_the_cluster_only() {
        let cmd = super::PublishArgs::augment_args(clap::Command::new("node"));
        let help = |id: &str| cmd.get_arguments().find(|a| a.get_id() == id).and_then(|a| a.get_help()).map(|h| h.to_string());
        let qps = help("publish_qps").unwrap_or_default();
        assert!(qps.contains("to a cluster") && qps.contains("without pacing"), "{qps}");
        assert!(help("publish_burst").is_some_and(|h| h.contains("a cluster only")));
    }
}
