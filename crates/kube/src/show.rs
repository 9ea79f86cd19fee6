//! `volring get`: published objects printed the way kubectl prints them,
//! read from the cluster or, with no cluster, from the node's store. One
//! entry point, [`get`]; the rendering is pure, the reading is the two
//! functions at the end.

use std::path::{Path, PathBuf};

use super::objects::{Kind, GROUP, VERSION};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    Table,
    Wide,
    Json,
    Yaml,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("unknown resource {0:?} (blockdevices, bd, storagenodes, sn, volumes)")]
    Resource(String),
    #[error("unknown output format {0:?} (json, yaml, wide)")]
    Format(String),
    /// A mistyped `--state-dir` is not an empty node.
    #[error("state directory {} does not exist", .0.display())]
    NoStateDir(PathBuf),
    /// The node's store could not be read.
    #[error("the node's store: {0}")]
    Store(#[from] volring_volumes::store::Error),
    /// No usable cluster configuration (kubeconfig or service account).
    #[error("the cluster's configuration: {0}")]
    Config(#[from] kube::config::InferConfigError),
    /// The API server refused the LIST or did not answer.
    #[error("the cluster: {0}")]
    Cluster(#[from] kube::Error),
}

/// What `volring get` was asked.
#[derive(Debug, Clone, Copy)]
pub struct Query<'a> {
    /// The resource as kubectl names it (`blockdevices`, `bd`, `sn`, ...).
    pub resource: &'a str,
    /// `-o`: `json`, `yaml` or `wide`; none prints the table.
    pub output: Option<&'a str>,
    /// `--kube`: read the cluster even when none is detected.
    pub kube: bool,
    /// `--local-store`: read the node's store even when a cluster is detected.
    pub local_store: bool,
    /// The agent's state directory (its store, and its record of what it
    /// still holds).
    pub state_dir: &'a Path,
}

/// `volring get`: the objects from the cluster when one is configured (or
/// `q.kube`), else from the node's own store, as the text for stdout. The
/// lines for stderr (where the objects come from, and what the agent
/// still holds back) go to `note` as soon as they are known, so the first
/// is seen before a slow cluster answers.
pub async fn get(q: Query<'_>, mut note: impl FnMut(&str)) -> Result<String, Error> {
    let (kind, fmt) = (resource(q.resource)?, format(q.output)?);
    let source = if q.local_store { None } else { super::kube_sink::KubeSink::detect() };
    let items = if q.kube || source.is_some() {
        let from = source.map_or_else(|| "--kube".to_string(), |s| s.to_string());
        note(&format!("# {} from the cluster ({from})", kind.plural()));
        read_cluster(kind).await?
    } else {
        if !q.state_dir.is_dir() {
            return Err(Error::NoStateDir(q.state_dir.to_path_buf()));
        }
        let store = q.state_dir.join(volring_volumes::store::FILE);
        note(&format!("# {} from the node's store {} (no cluster configured)", kind.plural(), store.display()));
        read_store(q.state_dir, kind)?
    };
    if let Some(held) = super::queued::note(q.state_dir) {
        note(&held);
    }
    Ok(render(kind, &items, fmt))
}

/// kubectl's names for the resources, and `volumes` (the node objects
/// carry them).
pub(crate) fn resource(s: &str) -> Result<Kind, Error> {
    match s {
        "blockdevices" | "blockdevice" | "bd" => Ok(Kind::BlockDevice),
        "storagenodes" | "storagenode" | "sn" | "volumes" => Ok(Kind::StorageNode),
        _ => Err(Error::Resource(s.to_string())),
    }
}

pub(crate) fn format(s: Option<&str>) -> Result<Format, Error> {
    match s {
        None => Ok(Format::Table),
        Some("wide") => Ok(Format::Wide),
        Some("json") => Ok(Format::Json),
        Some("yaml") => Ok(Format::Yaml),
        Some(o) => Err(Error::Format(o.to_string())),
    }
}

fn text(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::Null => "<none>".into(),
        serde_json::Value::String(s) => s.clone(),
        v => v.to_string(),
    }
}

fn columns(kind: Kind, wide: bool) -> Vec<(&'static str, &'static str)> {
    let mut c = match kind {
        Kind::BlockDevice => vec![
            ("NAME", "/metadata/name"),
            ("NODE", "/spec/nodeName"),
            ("PATH", "/spec/path"),
            ("SIZE", "/spec/capacity/storage"),
            ("CLAIMSTATE", "/status/claimState"),
            ("STATE", "/status/state"),
        ],
        Kind::StorageNode => vec![
            ("NAME", "/metadata/name"),
            ("VOLUMES", "/status/volumesTotal"),
            ("DRIFTING", "/status/volumesDrifting"),
            ("POOLFREE", "/status/pool/availableBytes"),
            ("READY", "/status/conditions/0/status"),
        ],
    };
    if wide {
        c.extend(match kind {
            Kind::BlockDevice => {
                vec![("FSTYPE", "/status/filesystem/fsType"), ("VOLUME", "/status/volume"), ("STABLEID", "/spec/stableId")]
            }
            Kind::StorageNode => vec![("POOL", "/status/pool/path"), ("OMITTED", "/status/volumesOmitted")],
        });
    }
    c
}

/// The objects (as the API returns them), in `format`.
pub(crate) fn render(kind: Kind, items: &[serde_json::Value], format: Format) -> String {
    match format {
        Format::Json | Format::Yaml => {
            let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": items});
            if format == Format::Json {
                serde_json::to_string_pretty(&list).expect("JSON serialises") + "\n"
            } else {
                serde_saphyr::to_string(&list).expect("YAML serialises")
            }
        }
        Format::Table | Format::Wide => {
            if items.is_empty() {
                return format!("No {} found.\n", kind.plural());
            }
            let cols = columns(kind, format == Format::Wide);
            let rows: Vec<Vec<String>> = std::iter::once(cols.iter().map(|(h, _)| h.to_string()).collect())
                .chain(items.iter().map(|i| cols.iter().map(|(_, p)| text(i.pointer(p).unwrap_or(&serde_json::Value::Null))).collect()))
                .collect();
            let widths: Vec<usize> = (0..cols.len()).map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0)).collect();
            let mut out = String::new();
            for r in rows {
                let line: Vec<String> = r.iter().zip(&widths).map(|(cell, w)| format!("{cell:<w$}")).collect();
                out.push_str(line.join("   ").trim_end());
                out.push('\n');
            }
            out
        }
    }
}

/// Every object of `kind` in the node's store (read beside a running agent).
pub(crate) fn read_store(state_dir: &Path, kind: Kind) -> Result<Vec<serde_json::Value>, Error> {
    let contents = volring_volumes::store::Store::read_only(&state_dir.join(volring_volumes::store::FILE), false)?;
    let prefix = format!("{}/", kind.as_str());
    Ok(contents.published.iter().filter(|(k, _)| k.starts_with(&prefix)).filter_map(|(_, b)| serde_json::from_slice(b).ok()).collect())
}

/// Every object of `kind` in the cluster (all nodes), page by page.
pub(crate) async fn read_cluster(kind: Kind) -> Result<Vec<serde_json::Value>, Error> {
    let mut config = kube::Config::infer().await?;
    volring_share::kube::identify(&mut config, &volring_devices::node_name());
    let client = kube::Client::try_from(config)?;
    let api: kube::Api<kube::core::DynamicObject> =
        kube::Api::all_with(client, &kube::core::ApiResource::from_gvk(&kube::core::GroupVersionKind::gvk(GROUP, VERSION, kind.as_str())));
    let mut out = Vec::new();
    let mut lp = kube::api::ListParams::default().limit(super::kube_sink::PAGE as u32);
    loop {
        let page = api.list(&lp).await?;
        out.extend(page.items.iter().filter_map(|o| serde_json::to_value(o).ok()));
        match page.metadata.continue_ {
            Some(c) if !c.is_empty() => lp = lp.continue_token(&c),
            _ => return Ok(out),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_line_up_and_missing_fields_say_none() {
        let items = vec![
            serde_json::json!({"metadata": {"name": "bd-1"}, "spec": {"nodeName": "n1", "path": "/dev/sdb", "capacity": {"storage": 1024}},
                "status": {"claimState": "Unclaimed", "state": "Active"}}),
            serde_json::json!({"metadata": {"name": "bd-22"}, "spec": {"nodeName": "n1", "path": "/dev/sdc"}}),
        ];
        let t = render(Kind::BlockDevice, &items, Format::Table);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[0], "NAME    NODE   PATH       SIZE     CLAIMSTATE   STATE");
        assert_eq!(lines[2], "bd-22   n1     /dev/sdc   <none>   <none>       <none>");
        assert!(render(Kind::BlockDevice, &items, Format::Wide).lines().next().unwrap().ends_with("STABLEID"));
        let j: serde_json::Value = serde_json::from_str(&render(Kind::BlockDevice, &items, Format::Json)).unwrap();
        assert_eq!(j["items"][1]["metadata"]["name"], "bd-22");
        assert!(render(Kind::BlockDevice, &items, Format::Yaml).contains("name: bd-22"));
        assert_eq!(render(Kind::StorageNode, &[], Format::Table), "No storagenodes found.\n");
        assert!(resource("pods").is_err() && format(Some("xml")).is_err());
    }
}
