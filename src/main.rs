//! The `volring` command: the top of the workspace (docs/architecture.md).
//!
//! The binary is the agent that starts and stops every component
//! (`agent`), the metrics it serves (`metrics`) and the command line
//! (`cli`). It has no library: nothing else links these modules, so none
//! of their items is public. The engines live in the crates below it,
//! lowest first: `volring-sys`, `volring-ring`, `volring-mounts`,
//! `volring-devices`, `volring-nbd`, `volring-volumes`, `volring-share`,
//! `volring-csi`, `volring-kube`.

// A `pub` item here is reachable by nothing: an error under `-D warnings`
// (tests/surface.rs counts `pub` lines under src/ too).
#![warn(unreachable_pub)]

use std::io::Write;

mod agent;
mod cli;
mod metrics;

use cli::args::{CsiArgs, ModeArg, NbdTuning, NodeNbdArgs, PublishArgs, ScanArgs, WatchArgs, DEFAULT_CSI_ENDPOINT};
use cli::devices::{print_devices, watch_stats};
use cli::mounts::{print_table, stream};
use cli::serve::nbd_serve;
use cli::status::print_status;
use cli::{denied, runtime, stdout_error, NothingFound, StdoutClosed};

use anyhow::Context;
use clap::{CommandFactory, Parser, Subcommand};

use cli::devices_report as report;
use volring_devices::{CollectorConfig, ScanConfig, StatMethod};

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
/// git checkout), put together by build.rs: a `match` on `option_env!` with
/// `env!` in one arm did not compile outside a checkout.
const VERSION: &str = env!("VOLRING_VERSION");

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum StatsBy {
    Device,
    Volume,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Run the node agent (foreground; stops on SIGINT/SIGTERM; SIGHUP is
    /// ignored). One agent per state directory.
    Node(Box<NodeArgs>),
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
        call: volring_csi::client::Call,
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
        /// Only these filesystem types, comma-separated (like findmnt -t);
        /// `no` before the list leaves them out instead (`noproc,sysfs`).
        #[arg(short = 't', long = "types", value_name = "LIST")]
        types: Option<String>,
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
    /// only; works with or without a running agent. When the store cannot
    /// be read it says so and shows the staged volumes the kernel shows.
    Status {
        #[command(flatten)]
        dirs: cli::status::NodeDirs,
        /// One JSON document instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// Rebuild the staged volumes' records from the kernel after the store
    /// (state.redb) was lost or damaged: loop devices backed by pool images
    /// (by inode), nbd devices by backend id, their mounts under the
    /// kubelet root. What cannot be proven is reported, never guessed.
    /// Dry run unless --apply (which needs the agent stopped; a starting
    /// agent does the same by itself).
    Recover {
        #[command(flatten)]
        dirs: cli::status::NodeDirs,
        /// Write the rebuilt records (a damaged store is set aside first).
        #[arg(long)]
        apply: bool,
        /// One JSON document instead of text.
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
        /// Only these devices and their partitions (`loop1`, `/dev/loop1`,
        /// `/dev/disk/by-id/...`), as lsblk takes them.
        #[arg(value_name = "DEVICE")]
        devices: Vec<String>,
        /// One JSON document (`{"blockdevices": [...]}`).
        #[arg(long)]
        json: bool,
        /// No header line (lsblk -n).
        #[arg(short = 'n', long)]
        noheadings: bool,
        /// SIZE in bytes (lsblk -b).
        #[arg(short = 'b', long)]
        bytes: bool,
        /// Columns to print, lsblk names (`NAME,SIZE,UUID`); `+COL,...` adds to the default.
        #[arg(short = 'o', long = "output", value_name = "COLS")]
        columns: Option<report::Columns>,
        #[command(flatten)]
        scan: ScanArgs,
    },
    /// The node's volumes (or devices) sorted by the busiest, refreshed
    /// each interval, like iotop: IOPS, throughput, await, util, PVC and
    /// pod. Reads the running agent's /metrics, or with no agent the
    /// kernel (the store's staged volumes and their devices' counters).
    /// Keys: q quit, v/d/Tab volumes/devices, s sort, r reverse, / filter.
    Top(cli::top::TopArgs),
    /// Each staged volume's filesystem size, used, available and use%, like
    /// `df -h`, with its PVC and namespace when the agent knows them.
    Df(cli::df::DfArgs),
    /// A live `iostat -x -t` view, refreshed each interval: every device
    /// with I/O, or the devices named; `--by volume`: every staged volume.
    Stats {
        /// `device` (iostat's rows) or `volume` (a row per staged volume).
        #[arg(long, value_enum, default_value = "device")]
        by: StatsBy,
        #[command(flatten)]
        volume_source: cli::volumes::SourceArgs,
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

// The `node` command's flags (its help text is the variant's).
#[derive(clap::Args)]
struct NodeArgs {
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
    /// Who holds each volume this node exports: this node (staged here) or
    /// another node (through the nbd export). With --release, lets go of a
    /// remote holder known dead (its node gone, its device torn down); run
    /// with the agent stopped.
    Holders {
        /// The agent's state directory.
        #[arg(long, default_value = "/var/lib/volring")]
        state_dir: std::path::PathBuf,
        /// Release this volume's remote holder.
        #[arg(long, value_name = "VOLUME")]
        release: Option<String>,
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

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        // A closed stderr drops (and counts) log lines; it never stops the agent.
        .with_writer(metrics::logs::Stderr)
        .log_internal_errors(false);
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
        // findmnt's "nothing matched": status 1, nothing said.
        Err(e) if e.downcast_ref::<NothingFound>().is_some() => std::process::ExitCode::FAILURE,
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

/// `volring node`: the agent, configured from its flags, until a signal.
fn node(args: NodeArgs) -> anyhow::Result<()> {
    let NodeArgs { watch, log_events, metrics_addr, stats_interval, stats_method, scan, csi, nbd, publish } = args;
    let metrics = match metrics_addr.as_str() {
        "off" => None,
        a => Some(a.parse().with_context(|| format!("--metrics-addr {a:?}"))?),
    };
    let config = agent::AgentConfig {
        mounts: watch.config(),
        // One name for this node everywhere: the CSI node id it
        // reports is the name its BlockDevices and StorageNode carry.
        devices: ScanConfig {
            io: watch.config().backend,
            node_name: csi.node_id.clone().unwrap_or_else(volring_devices::node_name),
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
                    c.nbd.server = nbd.tuning.config(Vec::new());
                    c
                })
            })
            .transpose()?,
        nbd: nbd.config()?,
        reconcile: csi.reconcile(),
        share_kube: csi.share_kube(),
        nfs_client_address: csi.nfs_client_address,
        publish: publish.config(),
    };
    runtime()?.block_on(agent::run(config))
}

/// `volring get`: the node's objects from the cluster when one is
/// configured (or `--kube`), else from the node's own store.
fn get(resource: &str, output: Option<&str>, kube: bool, local_store: bool, state_dir: &std::path::Path) -> anyhow::Result<()> {
    let query = volring_kube::show::Query { resource, output, kube, local_store, state_dir };
    let text = runtime()?.block_on(volring_kube::show::get(query, |note| eprintln!("{note}")))?;
    std::io::stdout().write_all(text.as_bytes()).map_err(|_| StdoutClosed)?;
    Ok(())
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Node(args) => node(*args),
        Command::Nbd { command: NbdCommand::Serve { exports, exports_file, unix, tcp, tuning, stats_interval } } => {
            let listen = unix.into_iter().map(volring_nbd::Listen::Unix).chain(tcp.into_iter().map(volring_nbd::Listen::Tcp)).collect();
            let specs = exports.iter().map(|e| e.parse()).collect::<Result<Vec<volring_nbd::ExportSpec>, _>>()?;
            runtime()?.block_on(nbd_serve(tuning.config(listen), specs, exports_file, stats_interval))
        }
        Command::Nbd { command: NbdCommand::Attach { args, tuning } } => cli::nbd::attach(args, tuning.config(Vec::new()), runtime()?),
        Command::Nbd { command: NbdCommand::Detach { index, backend_id } } => cli::nbd::detach(index, backend_id.as_deref()),
        Command::Nbd { command: NbdCommand::Status { index, json } } => cli::nbd::status(index, json),
        Command::Nbd { command: NbdCommand::Watch { count, seconds } } => cli::nbd::watch(count, seconds),
        Command::Nbd { command: NbdCommand::Holders { state_dir, release, json } } => {
            cli::holders::holders(&state_dir, release.as_deref(), json)
        }
        Command::Csi { endpoint, call } => runtime()?.block_on(csi_call(&endpoint, call)),
        Command::Mounts { json, watch: false, watch_args, output, target, source, types, raw, list, tree } => {
            use std::io::IsTerminal;
            let columns = cli::mounts_report::Column::parse_list(output.as_deref()).map_err(anyhow::Error::msg)?;
            let layout = match (raw, list, tree) {
                (true, _, _) => cli::mounts_report::Layout::Raw,
                (_, true, _) => cli::mounts_report::Layout::List,
                (_, _, true) => cli::mounts_report::Layout::Tree,
                _ if std::io::stdout().is_terminal() => cli::mounts_report::Layout::Tree,
                _ => cli::mounts_report::Layout::Raw,
            };
            let filter = cli::mounts_report::Filter {
                target: target.map(|t| t.into_os_string().into_encoded_bytes()),
                source: source.map(String::into_bytes),
            };
            print_table(json, !matches!(watch_args.mount_watch, ModeArg::Reparse), &columns, layout, &filter, types.as_deref())
        }
        Command::Mounts { watch: true, watch_args, json, .. } => {
            use std::io::IsTerminal;
            runtime()?.block_on(stream(watch_args.config(), json || !std::io::stdout().is_terminal()))
        }
        Command::Status { dirs, json } => {
            // A mistyped --state-dir is not an empty node.
            anyhow::ensure!(dirs.state_dir.is_dir(), "state directory {} does not exist", dirs.state_dir.display());
            print_status(&dirs, json)
        }
        Command::Recover { dirs, apply, json } => cli::status::recover(&dirs, apply, json),
        Command::Crds => {
            print!("{}", volring_kube::crds_yaml());
            Ok(())
        }
        Command::Get { resource, output, kube, local_store, state_dir } => get(&resource, output.as_deref(), kube, local_store, &state_dir),
        Command::Devices { devices, json, noheadings, bytes, columns, scan } => print_devices(
            json,
            &columns.unwrap_or_default().0,
            &scan.config(),
            &devices,
            report::TableStyle { headings: !noheadings, bytes },
        ),
        Command::Top(args) => cli::top::top(&args),
        Command::Df(args) => cli::df::df(&args),
        Command::Stats { by: StatsBy::Volume, volume_source, interval, count, all, json, .. } => {
            cli::top::stats_by_volume(&volume_source, interval, count, all, json)
        }
        Command::Stats { devices, interval, count, method, all, json, scan, .. } => {
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
async fn csi_call(endpoint: &str, call: volring_csi::client::Call) -> anyhow::Result<()> {
    let path = volring_csi::server::parse_endpoint(endpoint).map_err(anyhow::Error::msg)?;
    let mut clients =
        volring_csi::client::Clients::connect(path.clone()).await.with_context(|| format!("connect to {}", path.display()))?;
    match volring_csi::client::call(&mut clients, call).await {
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
