//! `volring df`: each staged volume's filesystem size, used, available and
//! use%, like `df -h`, named by its CSI volume and, when the running agent
//! knows them, its PVC and namespace.
//!
//! The sizes are statvfs(2) of the volume's staging mount, asked here (the
//! same call df makes, so the figures match df's); the names come from the
//! agent's `/metrics` when it answers, and are left empty when it does not.

use std::io::Write;
use std::path::PathBuf;

use super::devices_report::human_size;

use super::volumes::{self, SourceArgs, SourceChoice};
use super::{stdout_error, NothingFound};

#[derive(Debug, Clone, clap::Args)]
pub(crate) struct DfArgs {
    #[command(flatten)]
    pub(crate) source: SourceArgs,
    /// One JSON document (`{"volumes": [...]}`).
    #[arg(long)]
    pub(crate) json: bool,
    /// Sizes in bytes (default: human-readable, as df -h).
    #[arg(short = 'b', long)]
    pub(crate) bytes: bool,
    /// Only these volumes (CSI volume ids or PVC names).
    #[arg(value_name = "VOLUME")]
    pub(crate) volumes: Vec<String>,
}

/// One row of `volring df`.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct DfRow {
    #[serde(flatten)]
    pub(crate) volume: volumes::Volume,
    /// None for block volumes (no filesystem) and a mount that cannot be
    /// asked.
    pub(crate) size_bytes: Option<u64>,
    pub(crate) used_bytes: Option<u64>,
    pub(crate) available_bytes: Option<u64>,
    /// As df computes it: used / (used + available), rounded up.
    pub(crate) use_pct: Option<u64>,
    pub(crate) inodes: Option<u64>,
    pub(crate) inodes_used: Option<u64>,
    pub(crate) inodes_free: Option<u64>,
}

/// The rows, one per staged volume (sorted by volume id).
pub(crate) fn rows(source: &SourceArgs) -> anyhow::Result<Vec<DfRow>> {
    let mut staged = volumes::staged(&source.state_dir, &source.kubelet_root)?;
    if source.source != SourceChoice::Kernel {
        let scrape = volumes::fetch_metrics(&source.metrics_addr).map(|t| volumes::parse_scrape(&t)).unwrap_or_default();
        anyhow::ensure!(
            source.source != SourceChoice::Agent || scrape.exported,
            "no per-volume series at http://{}/metrics (is the agent running there?)",
            source.metrics_addr
        );
        for v in &mut staged {
            if let Some((known, _)) = scrape.volumes.get(&v.volume) {
                v.persistentvolumeclaim.clone_from(&known.persistentvolumeclaim);
                v.namespace.clone_from(&known.namespace);
                v.pod.clone_from(&known.pod);
            }
        }
    }
    staged.sort_by(|a, b| a.volume.cmp(&b.volume));
    Ok(staged.into_iter().map(measure).collect())
}

fn measure(volume: volumes::Volume) -> DfRow {
    // Only the volume's own filesystem: a staging mount gone would answer
    // for the filesystem below it.
    let fs = volume.mount.as_ref().filter(|m| mounted_from(m, &volume.device)).and_then(|m| rustix::fs::statvfs(m).ok());
    let Some(s) = fs else {
        // A block volume: its device's size, nothing used or free to say.
        let size = std::fs::read_to_string(format!("/sys/block/{}/size", volume.device))
            .ok()
            .and_then(|t| t.trim().parse::<u64>().ok())
            .map(|sectors| sectors * 512)
            .filter(|_| volume.mount.is_none() && !volume.device.is_empty());
        return DfRow {
            volume,
            size_bytes: size,
            used_bytes: None,
            available_bytes: None,
            use_pct: None,
            inodes: None,
            inodes_used: None,
            inodes_free: None,
        };
    };
    let unit = s.f_frsize.max(1);
    let size = s.f_blocks.saturating_mul(unit);
    let used = s.f_blocks.saturating_sub(s.f_bfree).saturating_mul(unit);
    let avail = s.f_bavail.saturating_mul(unit);
    let use_pct = (used + avail > 0).then(|| (used * 100).div_ceil(used + avail));
    DfRow {
        volume,
        size_bytes: Some(size),
        used_bytes: Some(used),
        available_bytes: Some(avail),
        use_pct,
        inodes: Some(s.f_files),
        inodes_used: Some(s.f_files.saturating_sub(s.f_ffree)),
        inodes_free: Some(s.f_ffree),
    }
}

/// Whether `path` is on the block device `device` (kernel name).
fn mounted_from(path: &std::path::Path, device: &str) -> bool {
    let Ok(text) = std::fs::read_to_string(format!("/sys/block/{device}/dev")) else { return false };
    let Some((major, minor)) = text.trim().split_once(':') else { return false };
    let (Ok(major), Ok(minor)) = (major.parse::<u32>(), minor.parse::<u32>()) else { return false };
    rustix::fs::stat(path).is_ok_and(|st| rustix::fs::major(st.st_dev) == major && rustix::fs::minor(st.st_dev) == minor)
}

pub(crate) fn df(args: &DfArgs) -> anyhow::Result<()> {
    let mut rows = rows(&args.source)?;
    if !args.volumes.is_empty() {
        rows.retain(|r| args.volumes.iter().any(|w| *w == r.volume.volume || *w == r.volume.persistentvolumeclaim));
        if rows.is_empty() {
            return Err(NothingFound.into());
        }
    }
    let mut out = std::io::stdout().lock();
    if args.json {
        serde_json::to_writer_pretty(&mut out, &serde_json::json!({ "volumes": rows }))
            .map_err(std::io::Error::from)
            .map_err(stdout_error)?;
        return writeln!(out).map_err(stdout_error);
    }
    let size = |b: Option<u64>| match b {
        Some(b) if args.bytes => b.to_string(),
        Some(b) => human_size(b),
        None => "-".into(),
    };
    let dash = |s: &str| if s.is_empty() { "-".to_string() } else { s.to_string() };
    let width = rows.iter().map(|r| r.volume.volume.len()).max().unwrap_or(0).max(6);
    let pvc_width = rows.iter().map(|r| r.volume.persistentvolumeclaim.len()).max().unwrap_or(0).max(3);
    let ns_width = rows.iter().map(|r| r.volume.namespace.len()).max().unwrap_or(0).max(9);
    let result = (|| -> std::io::Result<()> {
        writeln!(
            out,
            "{:<width$} {:<pvc_width$} {:<ns_width$} {:<8} {:>8} {:>8} {:>8} {:>5} MOUNTED ON",
            "VOLUME", "PVC", "NAMESPACE", "DEVICE", "SIZE", "USED", "AVAIL", "USE%"
        )?;
        for r in &rows {
            let mounted: PathBuf = r.volume.mount.clone().unwrap_or_else(|| PathBuf::from("-"));
            writeln!(
                out,
                "{:<width$} {:<pvc_width$} {:<ns_width$} {:<8} {:>8} {:>8} {:>8} {:>5} {}",
                r.volume.volume,
                dash(&r.volume.persistentvolumeclaim),
                dash(&r.volume.namespace),
                dash(&r.volume.device),
                size(r.size_bytes),
                size(r.used_bytes),
                size(r.available_bytes),
                r.use_pct.map_or("-".into(), |p| format!("{p}%")),
                mounted.display()
            )?;
        }
        Ok(())
    })();
    result.map_err(stdout_error)
}
