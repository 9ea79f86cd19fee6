//! The `volring` command.

use std::io::Write;

mod cli;

use cli::devices::{print_devices, watch_stats};
use cli::mounts::{print_table, stream};
use cli::serve::nbd_serve;
use cli::status::print_status;
use cli::{denied, runtime, stdout_error, StdoutClosed};

use anyhow::Context;
use clap::{CommandFactory, Parser, Subcommand, ValueEnum};

use volring::devices::{report, CollectorConfig, DeviceFilter, ScanConfig, StatMethod};
use volring::mounts::{self, WatchConfig, WatchMode};
use volring::ring::BackendChoice;

mod cli_docs;

#[derive(Parser)]
#[command(name = "volring", version = VERSION, about = "Node agent for Kubernetes storage nodes")]
struct Cli {
    /// Log lines as text (coloured only on a terminal) or as JSON objects,
    /// one per line, for a log pipeline.
    #[arg(long, global = true, value_enum, env = "VOLRING_LOG_FORMAT", default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

/// The package version and the commit it was built from (when built from a
/// git checkout).
const VERSION: &str = match option_env!("VOLRING_GIT_COMMIT") {
    Some(_) => concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("VOLRING_GIT_COMMIT"), ")"),
    None => env!("CARGO_PKG_VERSION"),
};

#[derive(Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Run the node agent (foreground; stops on SIGINT/SIGTERM; SIGHUP is
    /// ignored). One agent per state directory.
    Node {
        #[command(flatten)]
        watch: WatchArgs,
        /// Log every mount and device event, not only summaries.
        #[arg(long)]
        log_events: bool,
        /// Serve Prometheus metrics at http://ADDR/metrics ("off" to disable).
        #[arg(long, default_value = "127.0.0.1:9477")]
        metrics_addr: String,
        /// Seconds between device stat samples.
        #[arg(long, default_value_t = 1.0)]
        stats_interval: f64,
        /// How device counters are read.
        #[arg(long, value_enum, default_value = "auto")]
        stats_method: StatMethod,
        #[command(flatten)]
        scan: ScanArgs,
        #[command(flatten)]
        csi: Box<CsiArgs>,
        #[command(flatten)]
        nbd: NodeNbdArgs,
        #[command(flatten)]
        publish: PublishArgs,
    },
    /// Serve exports over NBD.
    Nbd {
        #[command(subcommand)]
        command: NbdCommand,
    },
    /// Call one CSI RPC on a running driver and print the reply as JSON.
    Csi {
        /// The driver's socket.
        #[arg(long, default_value = DEFAULT_CSI_ENDPOINT)]
        endpoint: String,
        #[command(subcommand)]
        call: volring::csi::client::Call,
    },
    /// Print the mount table like `findmnt --raw`, or stream changes.
    Mounts {
        /// One JSON document (`{"filesystems": [...]}`), or JSON lines with
        /// --watch (the default for --watch when stdout is not a terminal).
        #[arg(long)]
        json: bool,
        /// Stream change events until Ctrl-C: text lines on a terminal,
        /// JSON lines otherwise.
        #[arg(long)]
        watch: bool,
        /// Columns, by findmnt's names: TARGET,SOURCE,FSTYPE,OPTIONS,
        /// VFS-OPTIONS,FS-OPTIONS,ID,PARENT,MAJ:MIN,FSROOT,PROPAGATION.
        #[arg(short = 'o', long = "output", value_name = "COLUMNS")]
        output: Option<String>,
        /// Only the mount PATH is on (like findmnt --target).
        #[arg(long, value_name = "PATH")]
        target: Option<std::path::PathBuf>,
        /// Only mounts of this source (a device, `tmpfs`, ...).
        #[arg(long, value_name = "SOURCE")]
        source: Option<String>,
        /// One escaped line per mount (the default when stdout is not a
        /// terminal; like findmnt --raw).
        #[arg(long, conflicts_with_all = ["list", "tree"])]
        raw: bool,
        /// Aligned columns without the tree.
        #[arg(long, conflicts_with = "tree")]
        list: bool,
        /// The tree of parents and children (the default on a terminal).
        #[arg(long)]
        tree: bool,
        #[command(flatten)]
        watch_args: WatchArgs,
    },
    /// What this node's state directory holds: volumes, staged volumes with
    /// their phase, device and targets, quarantined records. Reads the files
    /// only; works with or without a running agent.
    Status {
        /// The agent's state directory.
        #[arg(long, default_value = "/var/lib/volring")]
        state_dir: std::path::PathBuf,
        /// The image pool, if not <state-dir>/pool.
        #[arg(long)]
        pool_dir: Option<std::path::PathBuf>,
        /// One JSON document instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// Print the CustomResourceDefinitions volring publishes (YAML).
    Crds,
    /// Print published objects like kubectl: blockdevices (bd) or
    /// storagenodes (sn, volumes). From the cluster when a kubeconfig
    /// ($KUBECONFIG, ~/.kube/config) or a pod's service account is found,
    /// else from the node's store; stderr says which was read.
    Get {
        /// blockdevices (bd), storagenodes (sn) or volumes.
        resource: String,
        /// json, yaml or wide (default: a table).
        #[arg(short = 'o', long = "output")]
        output: Option<String>,
        /// Read the cluster; fail when no client configuration is found.
        #[arg(long)]
        kube: bool,
        /// Read the node's store even when a cluster is configured.
        #[arg(long, conflicts_with = "kube")]
        local_store: bool,
        /// The agent's state directory (its store holds the objects with no cluster).
        #[arg(long, default_value = "/var/lib/volring")]
        state_dir: std::path::PathBuf,
    },
    /// List block devices like `lsblk`: type, filesystem, mounts, ids.
    /// What could not be read (as an ordinary user: the devices' first
    /// blocks) is said after the table, and shown as `?`, never guessed.
    #[command(after_help = report::columns_help())]
    Devices {
        /// One JSON document (`{"blockdevices": [...]}`).
        #[arg(long)]
        json: bool,
        /// Columns to print, lsblk names (`NAME,SIZE,UUID`); `+COL,...` adds to the default.
        #[arg(short = 'o', long = "output", value_name = "COLS")]
        columns: Option<report::Columns>,
        #[command(flatten)]
        scan: ScanArgs,
    },
    /// A live `iostat -x -t` view, refreshed each interval: every device
    /// with I/O, or the devices named.
    Stats {
        /// Devices to show, idle or not (`vda`, `/dev/vda`, `/dev/mapper/NAME`); default: all with I/O.
        #[arg(value_name = "DEVICE")]
        devices: Vec<String>,
        /// Seconds between samples.
        #[arg(long, default_value_t = 1.0)]
        interval: f64,
        /// Stop after this many samples (default: until Ctrl-C).
        #[arg(long)]
        count: Option<u64>,
        /// How counters are read (`auto` times the others and takes the fastest).
        #[arg(long, value_enum, default_value = "auto")]
        method: StatMethod,
        /// Show idle devices too.
        #[arg(long)]
        all: bool,
        /// JSON lines, one snapshot per sample.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        scan: ScanArgs,
    },
    /// Print a shell completion script (bash: `source <(volring completions bash)`).
    Completions {
        /// The shell to complete for.
        shell: clap_complete::Shell,
    },
    /// Print the manual page (roff) to stdout: `volring man | man -l -`.
    Man,
}

#[derive(Subcommand)]
enum NbdCommand {
    /// Serve image files and block devices until SIGINT/SIGTERM; SIGHUP
    /// re-reads --exports-file (adding and removing exports).
    Serve {
        /// NAME=PATH[,ro][,direct][,limit=N][,description=TEXT] (repeatable).
        #[arg(long = "export", value_name = "SPEC")]
        exports: Vec<String>,
        /// A file of export specs, one per line (# comments).
        #[arg(long)]
        exports_file: Option<std::path::PathBuf>,
        /// Listen on this unix socket (repeatable).
        #[arg(long = "unix", value_name = "PATH")]
        unix: Vec<std::path::PathBuf>,
        /// Listen on this TCP address, e.g. 127.0.0.1:10809 (repeatable).
        #[arg(long = "tcp", value_name = "ADDR")]
        tcp: Vec<std::net::SocketAddr>,
        #[command(flatten)]
        tuning: NbdTuning,
        /// Print every export's counters as a JSON line this often (seconds; 0: only at exit).
        #[arg(long, default_value_t = 0.0)]
        stats_interval: f64,
    },
    /// Attach an image to /dev/nbdN through the kernel's netlink interface
    /// and serve it from this process until SIGINT/SIGTERM (the device then
    /// waits for a successor's --reattach).
    Attach {
        #[command(flatten)]
        args: cli::nbd::AttachArgs,
        #[command(flatten)]
        tuning: NbdTuning,
    },
    /// Disconnect /dev/nbdN.
    Detach {
        /// The device to disconnect: /dev/nbdINDEX.
        #[arg(long)]
        index: u32,
        /// Refuse unless the device carries this backend identifier.
        #[arg(long)]
        backend_id: Option<String>,
    },
    /// The kernel's nbd devices: connected, backend, size.
    Status {
        /// Only /dev/nbdINDEX (default: every nbd device).
        #[arg(long)]
        index: Option<u32>,
        /// One JSON document instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Print each LINK_DEAD notice (every connection of a device died) as a JSON line.
    Watch {
        /// Stop after this many notices.
        #[arg(long)]
        count: Option<u64>,
        /// Stop after this many seconds.
        #[arg(long)]
        seconds: Option<f64>,
    },
}

#[derive(clap::Args)]
#[command(next_help_heading = "NBD server")]
struct NbdTuning {
    /// Ring threads (0: one per core, at most 4); each ring holds up to
    /// 32 MiB of buffers of its own, outside --nbd-max-server-bytes.
    #[arg(long, env = "VOLRING_NBD_THREADS", default_value_t = 0)]
    nbd_threads: usize,
    /// Small buffered writes on the ring thread when the pool's file system
    /// would hand each one to an io_uring worker (ext4): auto probes each
    /// export, off sends every write through io_uring.
    #[arg(long, env = "VOLRING_NBD_INLINE_WRITES", default_value = "auto")]
    nbd_inline_writes: volring::nbd::InlineWrites,
    /// Seconds a client has to finish the handshake.
    #[arg(long, default_value_t = 10.0)]
    handshake_timeout: f64,
    /// Close connections idle this many seconds (0: never).
    #[arg(long, default_value_t = 0.0)]
    idle_timeout: f64,
    /// Close a connection whose replies make no progress for this many seconds.
    #[arg(long, default_value_t = 60.0)]
    stall_timeout: f64,
    /// Bytes of buffers and queued replies one connection may hold before
    /// the server stops reading its requests.
    #[arg(long, default_value_t = 96 << 20)]
    nbd_max_conn_bytes: usize,
    /// Requests one connection may have in flight before the server stops
    /// reading its requests.
    #[arg(long, default_value_t = 512)]
    nbd_max_conn_requests: u32,
    /// Bytes every connection together may hold; past it the heaviest
    /// connections stop being read first, and a stalled one is dropped.
    #[arg(long, default_value_t = 128 << 20)]
    nbd_max_server_bytes: usize,
}

impl NbdTuning {
    fn config(&self, listen: Vec<volring::nbd::Listen>) -> volring::nbd::ServerConfig {
        volring::nbd::ServerConfig {
            listen,
            threads: self.nbd_threads,
            inline_writes: self.nbd_inline_writes,
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
struct NodeNbdArgs {
    /// Serve NBD here: HOST:PORT or unix:PATH (repeatable; none: no NBD server).
    #[arg(long = "nbd-listen", value_name = "ADDR")]
    nbd_listen: Vec<String>,
    /// An export of the node's NBD server (repeatable; see `nbd serve --export`).
    #[arg(long = "nbd-export", value_name = "SPEC")]
    nbd_export: Vec<String>,
    /// Serve this node's `attach: nbd` CSI volumes to other nodes on this
    /// TCP address (HOST:PORT; port 0 picks one). Only volumes created
    /// here with a secret are served, and only to a client naming it; no
    /// TLS, so bind an address on the storage network. Off by default.
    #[arg(long = "nbd-export-listen", value_name = "HOST:PORT", env = "VOLRING_NBD_EXPORT_LISTEN")]
    nbd_export_listen: Option<std::net::SocketAddr>,
    /// HOST:PORT other nodes reach --nbd-export-listen at, written into
    /// volume contexts (default: the bound address; needed for 0.0.0.0).
    #[arg(long = "nbd-export-advertise", value_name = "HOST:PORT")]
    nbd_export_advertise: Option<String>,
    #[command(flatten)]
    tuning: NbdTuning,
}

impl NodeNbdArgs {
    /// The export listener's settings (the NBD tuning flags apply to it).
    fn export(&self) -> anyhow::Result<Option<volring::csi::nbd_export::ExportConfig>> {
        let Some(listen) = self.nbd_export_listen else {
            anyhow::ensure!(self.nbd_export_advertise.is_none(), "--nbd-export-advertise needs --nbd-export-listen");
            return Ok(None);
        };
        Ok(Some(volring::csi::nbd_export::ExportConfig {
            listen,
            advertise: self.nbd_export_advertise.clone(),
            server: self.tuning.config(Vec::new()),
        }))
    }
}

impl NodeNbdArgs {
    fn config(&self) -> anyhow::Result<Option<volring::agent::NbdConfig>> {
        if self.nbd_listen.is_empty() {
            anyhow::ensure!(self.nbd_export.is_empty(), "--nbd-export needs --nbd-listen");
            return Ok(None);
        }
        let listen = self.nbd_listen.iter().map(|l| l.parse()).collect::<Result<Vec<_>, _>>()?;
        let exports = self.nbd_export.iter().map(|e| e.parse()).collect::<Result<Vec<_>, _>>()?;
        Ok(Some(volring::agent::NbdConfig { server: self.tuning.config(listen), exports }))
    }
}

const DEFAULT_CSI_ENDPOINT: &str = "unix:///var/lib/kubelet/plugins/volring.csi.io/csi.sock";

#[derive(clap::Args)]
#[command(next_help_heading = "CSI driver")]
struct CsiArgs {
    /// Serve the CSI driver on this unix socket ("off" to disable).
    #[arg(long, default_value = DEFAULT_CSI_ENDPOINT)]
    csi_endpoint: String,
    /// Staging and target paths must lie under this directory.
    #[arg(long, default_value = "/var/lib/kubelet")]
    kubelet_root: std::path::PathBuf,
    /// The agent's state: volume images under pool/, staged records under
    /// staged/, and agent.lock (one agent at a time).
    #[arg(long, default_value = "/var/lib/volring")]
    state_dir: std::path::PathBuf,
    /// Where volume images live (default: STATE_DIR/pool).
    #[arg(long)]
    pool_dir: Option<std::path::PathBuf>,
    /// The node id reported to the CO, and the node name the published
    /// objects carry (default: NODE_NAME or the hostname).
    #[arg(long)]
    node_id: Option<String>,
    /// The most volumes the CO may put on this node (0: no limit).
    #[arg(long, default_value_t = 0)]
    max_volumes: i64,
    /// Attach loop devices with buffered I/O even when direct I/O works.
    #[arg(long)]
    no_direct_io: bool,
    /// Look at every staged volume this often (seconds), besides on every
    /// mount and device event.
    #[arg(long, env = "VOLRING_RESYNC_INTERVAL", default_value_t = 60.0)]
    resync_interval: f64,
    /// Only report drift (a vanished staging mount, a detached loop
    /// device); do not repair it.
    #[arg(long, env = "VOLRING_NO_REPAIR")]
    no_repair: bool,
    /// Detach loop devices serving pool images that no staged record
    /// explains (and nothing mounts); without it they are only reported.
    #[arg(long, env = "VOLRING_REMOVE_ORPHANS")]
    remove_orphans: bool,
    /// Seconds the kernel queues I/O of an `attach: nbd` volume while its
    /// connection is dead (NBD_ATTR_DEAD_CONN_TIMEOUT): an agent restart
    /// must fit in it.
    #[arg(long, default_value_t = 120)]
    nbd_dead_conn_timeout: u64,
    /// Seconds before the kernel resends an unanswered request of an
    /// `attach: nbd` volume (NBD_ATTR_TIMEOUT).
    #[arg(long, default_value_t = 5)]
    nbd_request_timeout: u64,
    /// Connections (sockets) per `attach: nbd` device.
    #[arg(long, default_value_t = 1)]
    nbd_attach_connections: usize,
    /// Do not reconnect nbd devices at start or on LINK_DEAD (shows what an
    /// agent restart does to its nbd volumes without the healer).
    #[arg(long, env = "VOLRING_NBD_NO_HEAL")]
    nbd_no_heal: bool,
    /// Which service grows a volume's image: `controller`
    /// (ControllerExpandVolume, then NodeExpandVolume for the filesystem)
    /// or `node` (NodeExpandVolume does all of it on the volume's node;
    /// the controller does not offer expansion; what deploy/ uses).
    #[arg(long, env = "VOLRING_EXPANSION", value_enum, default_value_t = ExpansionArg::Controller)]
    expansion: ExpansionArg,
    /// Serve shared (MULTI_NODE_MULTI_WRITER) volumes staged here over
    /// NFSv4 (nfs-ganesha) on this address:port ("off": not served).
    #[arg(long, env = "VOLRING_NFS_LISTEN", default_value = "off")]
    nfs_listen: String,
    /// The host:port other nodes mount shared volumes from (default: the
    /// listen address).
    #[arg(long, env = "VOLRING_NFS_ADVERTISE")]
    nfs_advertise: Option<String>,
    /// The nfs-ganesha daemon to run.
    #[arg(long, env = "VOLRING_NFS_GANESHA", default_value = "ganesha.nfsd")]
    nfs_ganesha: std::path::PathBuf,
    /// NFSv4 grace period (s) after the server starts: clients reclaim
    /// their opens and locks.
    #[arg(long, env = "VOLRING_NFS_GRACE", default_value_t = 20)]
    nfs_grace: u32,
    /// NFSv4 lease (s): a client that does not renew within it loses its
    /// locks.
    #[arg(long, env = "VOLRING_NFS_LEASE", default_value_t = 15)]
    nfs_lease: u32,
    /// In a cluster: seconds between re-reads of a shared volume's Service
    /// or Endpoints just created, until it is visible.
    #[arg(long, env = "VOLRING_NFS_SERVICE_POLL", default_value_t = 1.0)]
    nfs_service_poll: f64,
    /// In a cluster: seconds a just-created Service or Endpoints may take
    /// to become visible before the reconcile fails (and is retried).
    #[arg(long, env = "VOLRING_NFS_SERVICE_WAIT", default_value_t = 20.0)]
    nfs_service_wait: f64,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum ExpansionArg {
    Controller,
    Node,
}

impl CsiArgs {
    fn share_kube(&self) -> volring::share::kube::ControllerConfig {
        volring::share::kube::ControllerConfig {
            poll: std::time::Duration::from_secs_f64(self.nfs_service_poll.max(0.01)),
            total_wait: std::time::Duration::from_secs_f64(self.nfs_service_wait.max(0.0)),
        }
    }

    fn reconcile(&self) -> volring::state::reconcile::ReconcileConfig {
        volring::state::reconcile::ReconcileConfig {
            resync: std::time::Duration::from_secs_f64(self.resync_interval.max(0.1)),
            repair: !self.no_repair,
            remove_orphans: self.remove_orphans,
        }
    }
}

impl CsiArgs {
    fn config(&self) -> anyhow::Result<Option<volring::csi::CsiConfig>> {
        if self.csi_endpoint == "off" {
            return Ok(None);
        }
        let endpoint = volring::csi::server::parse_endpoint(&self.csi_endpoint).map_err(anyhow::Error::msg)?;
        let node = self.node_id.clone().unwrap_or_else(volring::devices::node_name);
        let mut c = volring::csi::CsiConfig::new(endpoint, node);
        c.kubelet_root = self.kubelet_root.clone();
        c.pool_dir = self.pool_dir.clone().unwrap_or_else(|| self.state_dir.join("pool"));
        c.state_dir = self.state_dir.clone();
        c.max_volumes = self.max_volumes;
        c.direct_io = !self.no_direct_io;
        c.expansion = match self.expansion {
            ExpansionArg::Controller => volring::csi::Expansion::Controller,
            ExpansionArg::Node => volring::csi::Expansion::Node,
        };
        anyhow::ensure!(self.nbd_request_timeout >= 1, "--nbd-request-timeout must be at least 1 s");
        anyhow::ensure!((1..=16).contains(&self.nbd_attach_connections), "--nbd-attach-connections: 1 to 16");
        c.nbd = volring::csi::nbd::NbdAttachConfig {
            dead_conn_timeout: std::time::Duration::from_secs(self.nbd_dead_conn_timeout),
            request_timeout: std::time::Duration::from_secs(self.nbd_request_timeout),
            connections: self.nbd_attach_connections,
            heal: !self.nbd_no_heal,
        };
        c.share.listen = match self.nfs_listen.as_str() {
            "off" => None,
            a => Some(a.parse().map_err(|e| anyhow::anyhow!("--nfs-listen {a:?}: {e} (address:port or off)"))?),
        };
        c.share.advertise = self.nfs_advertise.clone();
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
struct PublishArgs {
    /// Publish to the cluster (default: when a kubeconfig or a pod's
    /// service account is found; otherwise the objects go to the node's
    /// store).
    #[arg(long)]
    kube: bool,
    /// Publish to the node's store even when a cluster is configured.
    #[arg(long = "publish-local-store", conflicts_with = "kube")]
    local_store: bool,
    /// Do not publish BlockDevice and StorageNode objects at all.
    #[arg(long)]
    no_publish: bool,
    /// API requests per second the publisher may make.
    #[arg(long, default_value_t = 20.0)]
    publish_qps: f64,
    /// Requests it may make at once above the rate.
    #[arg(long, default_value_t = 40)]
    publish_burst: u32,
    /// Seconds during which changes to one object become one write.
    #[arg(long, default_value_t = 1.0)]
    publish_window: f64,
    /// Delete the objects of devices that are gone (default: mark them Inactive).
    #[arg(long)]
    delete_gone_devices: bool,
}

impl PublishArgs {
    fn config(&self) -> Option<volring::agent::PublishConfig> {
        (!self.no_publish).then(|| volring::agent::PublishConfig {
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
            gone: if self.delete_gone_devices {
                volring::publisher::GonePolicy::Delete
            } else {
                volring::publisher::GonePolicy::MarkInactive
            },
        })
    }
}

#[derive(clap::Args)]
#[command(next_help_heading = "Block devices")]
struct ScanArgs {
    /// Keep only devices whose /dev path starts with this (repeatable).
    #[arg(long = "include", value_name = "PREFIX")]
    include: Vec<String>,
    /// Leave out devices whose /dev path starts with this (repeatable).
    #[arg(long = "exclude", value_name = "PREFIX")]
    exclude: Vec<String>,
    /// Leave out the disk behind `/`.
    #[arg(long)]
    exclude_os_disk: bool,
    /// Also list empty devices (unattached loop devices).
    #[arg(long)]
    empty: bool,
    /// Do not read devices' first blocks for signatures.
    #[arg(long)]
    no_probe: bool,
}

impl ScanArgs {
    fn config(&self) -> ScanConfig {
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
struct WatchArgs {
    /// How to watch mounts: fanotify+statmount, or re-reading mountinfo.
    #[arg(long, value_enum, default_value = "auto")]
    mount_watch: ModeArg,
    /// I/O engine of the ring threads.
    #[arg(long, value_enum, default_value = "auto")]
    io: IoArg,
    /// Watch another mount namespace, e.g. the host's (`/proc/1/ns/mnt`)
    /// from a container with hostPID.
    #[arg(long, value_name = "PATH")]
    mount_namespace: Option<std::path::PathBuf>,
    /// Microseconds the mount watcher gathers events before handling them
    /// (a storm costs one ring turn per window; 0: one per event). Adds up
    /// to about this much latency to a change. The node's reconciler proves
    /// every drift through descriptors before it reports or repairs it, so
    /// a table one window old never decides anything (see README).
    #[arg(long, value_name = "US", env = "VOLRING_MOUNT_BATCH_US", default_value_t = 1000)]
    mount_batch_us: u64,
}

#[derive(Clone, Copy, ValueEnum)]
enum ModeArg {
    Auto,
    Fanotify,
    Reparse,
}

#[derive(Clone, Copy, ValueEnum)]
enum IoArg {
    Auto,
    Uring,
    Epoll,
}

impl WatchArgs {
    fn config(&self) -> WatchConfig {
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

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let logs = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match cli.log_format {
        LogFormat::Json => logs.json().with_current_span(false).init(),
        // Colour codes only for a person at a terminal (and not with NO_COLOR).
        LogFormat::Text => {
            use std::io::IsTerminal;
            logs.with_ansi(std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none()).init()
        }
    }
    match run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        // `volring mounts --watch | head -1` is not an error.
        Err(e) if e.downcast_ref::<StdoutClosed>().is_some() => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // One line, the cause chain joined: "cannot bind CSI socket /x: address in use ..."
            let _ = writeln!(std::io::stderr(), "Error: {}", cli::one_line(&e));
            if !rustix::process::geteuid().is_root() && denied(&e) {
                let _ =
                    writeln!(std::io::stderr(), "hint: this needs root (mounts, loop devices, fanotify and block devices are privileged)");
            }
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Node { watch, log_events, metrics_addr, stats_interval, stats_method, scan, csi, nbd, publish } => {
            let metrics = match metrics_addr.as_str() {
                "off" => None,
                a => Some(a.parse().with_context(|| format!("--metrics-addr {a:?}"))?),
            };
            let config = volring::agent::AgentConfig {
                mounts: watch.config(),
                // One name for this node everywhere: the CSI node id it
                // reports is the name its BlockDevices and StorageNode carry.
                devices: ScanConfig {
                    io: watch.config().backend,
                    node_name: csi.node_id.clone().unwrap_or_else(volring::devices::node_name),
                    ..scan.config()
                },
                stats: CollectorConfig {
                    interval: std::time::Duration::from_secs_f64(stats_interval.max(0.01)),
                    method: stats_method,
                    ..CollectorConfig::default()
                },
                metrics,
                log_events,
                state_dir: csi.state_dir.clone(),
                csi: csi
                    .config()?
                    .map(|mut c| {
                        nbd.export().map(|e| {
                            c.nbd_export = e;
                            c
                        })
                    })
                    .transpose()?,
                nbd: nbd.config()?,
                reconcile: csi.reconcile(),
                share_kube: csi.share_kube(),
                publish: publish.config(),
            };
            runtime()?.block_on(volring::agent::run(config))
        }
        Command::Nbd { command: NbdCommand::Serve { exports, exports_file, unix, tcp, tuning, stats_interval } } => {
            let listen = unix.into_iter().map(volring::nbd::Listen::Unix).chain(tcp.into_iter().map(volring::nbd::Listen::Tcp)).collect();
            let specs = exports.iter().map(|e| e.parse()).collect::<Result<Vec<volring::nbd::ExportSpec>, _>>()?;
            runtime()?.block_on(nbd_serve(tuning.config(listen), specs, exports_file, stats_interval))
        }
        Command::Nbd { command: NbdCommand::Attach { args, tuning } } => cli::nbd::attach(args, tuning.config(Vec::new()), runtime()?),
        Command::Nbd { command: NbdCommand::Detach { index, backend_id } } => cli::nbd::detach(index, backend_id.as_deref()),
        Command::Nbd { command: NbdCommand::Status { index, json } } => cli::nbd::status(index, json),
        Command::Nbd { command: NbdCommand::Watch { count, seconds } } => cli::nbd::watch(count, seconds),
        Command::Csi { endpoint, call } => runtime()?.block_on(csi_call(&endpoint, call)),
        Command::Mounts { json, watch: false, watch_args, output, target, source, raw, list, tree } => {
            use std::io::IsTerminal;
            let columns = match output {
                Some(o) => mounts::report::Column::parse_list(&o).map_err(anyhow::Error::msg)?,
                None => mounts::report::DEFAULT_COLUMNS.to_vec(),
            };
            let layout = match (raw, list, tree) {
                (true, _, _) => mounts::report::Layout::Raw,
                (_, true, _) => mounts::report::Layout::List,
                (_, _, true) => mounts::report::Layout::Tree,
                _ if std::io::stdout().is_terminal() => mounts::report::Layout::Tree,
                _ => mounts::report::Layout::Raw,
            };
            let filter = mounts::report::Filter {
                target: target.map(|t| t.into_os_string().into_encoded_bytes()),
                source: source.map(String::into_bytes),
            };
            print_table(json, !matches!(watch_args.mount_watch, ModeArg::Reparse), &columns, layout, &filter)
        }
        Command::Mounts { watch: true, watch_args, json, .. } => {
            use std::io::IsTerminal;
            runtime()?.block_on(stream(watch_args.config(), json || !std::io::stdout().is_terminal()))
        }
        Command::Status { state_dir, pool_dir, json } => {
            print_status(&pool_dir.unwrap_or_else(|| state_dir.join("pool")), &state_dir, json)
        }
        Command::Crds => {
            print!("{}", volring::publisher::objects::crds_yaml());
            Ok(())
        }
        Command::Get { resource, output, kube, local_store, state_dir } => {
            use volring::publisher::{kube_sink::KubeSink, show};
            let (kind, format) = (show::resource(&resource)?, show::format(output.as_deref())?);
            let source = if local_store { None } else { KubeSink::detect() };
            let items = if kube || source.is_some() {
                let from = source.map_or_else(|| "--kube".to_string(), |s| s.to_string());
                eprintln!("# {} from the cluster ({from})", kind.plural());
                runtime()?.block_on(show::read_cluster(kind))?
            } else {
                let store = state_dir.join(volring::state::store::FILE);
                eprintln!("# {} from the node's store {} (no cluster configured)", kind.plural(), store.display());
                show::read_store(&state_dir, kind)?
            };
            std::io::stdout().write_all(show::render(kind, &items, format).as_bytes()).map_err(|_| StdoutClosed)?;
            Ok(())
        }
        Command::Devices { json, columns, scan } => {
            print_devices(json, columns.as_ref().map_or(&report::DEFAULT_COLUMNS[..], |c| &c.0), &scan.config())
        }
        Command::Stats { devices, interval, count, method, all, json, scan } => {
            let cfg =
                CollectorConfig { interval: std::time::Duration::from_secs_f64(interval.max(0.01)), method, ..CollectorConfig::default() };
            runtime()?.block_on(watch_stats(cfg, count, all, json, ScanConfig { probe: false, ..scan.config() }, &devices))
        }
        Command::Completions { shell } => cli_docs::completions(shell, &mut Cli::command()),
        Command::Man => cli_docs::man(Cli::command()),
    }
}

/// Prints the reply as JSON; a gRPC error goes to stderr with its code and
/// the exit status is 1.
async fn csi_call(endpoint: &str, call: volring::csi::client::Call) -> anyhow::Result<()> {
    let path = volring::csi::server::parse_endpoint(endpoint).map_err(anyhow::Error::msg)?;
    let mut clients =
        volring::csi::client::Clients::connect(path.clone()).await.with_context(|| format!("connect to {}", path.display()))?;
    match volring::csi::client::call(&mut clients, call).await {
        Ok(v) => {
            let text = serde_json::to_string_pretty(&v)?;
            let mut out = std::io::stdout().lock();
            writeln!(out, "{text}").and_then(|_| out.flush()).map_err(stdout_error)
        }
        Err(status) => {
            let _ = writeln!(std::io::stderr(), "{:?}: {}", status.code(), status.message());
            std::process::exit(1);
        }
    }
}
