//! The owning node's side of remote nbd volumes: a TCP listener that
//! serves this node's `attach: nbd` volumes to other nodes.
//!
//! Who may read or write a volume through it: only a client that names the
//! volume's secret. CreateVolume makes a secret per volume (32 random
//! bytes), keeps it in the volume's pool record and returns it in the
//! volume context beside the export URI; the consuming node's NodeStage
//! presents it. The listener's catalog is guarded (`nbd::Exports::guarded`):
//! it holds only the volumes this agent created with a secret — never a
//! `--nbd-export` of the node's own NBD server, never the socketpair
//! exports of locally staged volumes, which live in another server — lists
//! nothing, compares secrets in constant time, and answers a wrong secret
//! as it answers an unknown export. The secret is never logged (the server
//! logs the export name without it). There is no TLS (the kernel's driver
//! cannot speak it): the secret and the data cross the network in the
//! clear, so the listener belongs on the storage network, not on one a
//! tenant shares.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use super::base::Base;
use super::fence::Fence;
use super::{Error, Result};
use volring_nbd::remote::{ExportUri, Secret};
use volring_nbd::{ExportSpec, Exports, Listen, NbdServer, ServerConfig};
use volring_volumes::VolumeMeta;

/// Volume-context key: where the volume is served (`nbd://HOST:PORT/ID`).
pub(crate) const CONTEXT_URI: &str = "volring.io/nbd-uri";
/// Volume-context key: the volume's secret (64 hex digits).
pub(crate) const CONTEXT_SECRET: &str = "volring.io/nbd-secret";

/// How the node's export listener runs.
#[derive(Debug, Clone)]
pub struct ExportConfig {
    /// TCP address to bind (port 0: any free port).
    pub listen: SocketAddr,
    /// `HOST:PORT` other nodes reach the listener at; `None`: the bound
    /// address (which must then not be a wildcard).
    pub advertise: Option<String>,
    pub server: ServerConfig,
}

/// The running listener.
pub struct ExportListener {
    server: NbdServer,
    /// `host:port` as written into URIs.
    advertise: String,
}

impl ExportListener {
    /// Binds and starts the listener (a failure is fatal for the agent: a
    /// node told to export must not run without it).
    pub fn start(config: ExportConfig) -> std::result::Result<Self, volring_nbd::Error> {
        let mut server_config = config.server.clone();
        server_config.listen = vec![Listen::Tcp(config.listen)];
        let server = NbdServer::start(server_config, Arc::new(Exports::guarded()))?;
        let bound: SocketAddr = server.addresses().first().and_then(|a| a.parse().ok()).unwrap_or(config.listen);
        let advertise = match config.advertise {
            Some(a) => a,
            None if bound.ip().is_unspecified() => {
                return Err(volring_nbd::Error::Listen {
                    addr: bound.to_string(),
                    why: "a wildcard address: say which address other nodes reach with --nbd-export-advertise".into(),
                })
            }
            None => bound.to_string(),
        };
        // The advertised address must make a URI this agent itself accepts.
        format!("nbd://{advertise}/x").parse::<ExportUri>()?;
        tracing::info!(listen = %bound, advertise = %advertise, "serving nbd volumes to other nodes");
        Ok(ExportListener { server, advertise })
    }

    /// Where other nodes connect.
    pub(crate) fn address(&self) -> String {
        self.server.addresses().first().cloned().unwrap_or_default()
    }

    fn uri(&self, id: &str) -> String {
        format!("nbd://{}/{id}", self.advertise)
    }

    /// Serves a volume (once; again after a restart).
    fn serve(&self, meta: &VolumeMeta, image: &std::path::Path, secret: &str) -> Result<()> {
        if self.server.exports().get(&meta.id).is_some() {
            return Ok(());
        }
        let secret = secret.parse::<Secret>().map_err(|e| Error::Internal(format!("volume {}'s recorded secret: {e}", meta.id)))?;
        let spec = ExportSpec {
            name: meta.id.clone(),
            path: image.to_path_buf(),
            read_only: false,
            direct_io: false,
            max_connections: 0,
            description: String::new(),
        };
        self.server.exports().add(&spec, Some(secret)).map_err(|e| Error::Internal(format!("export {}: {e}", meta.id)))?;
        tracing::info!(volume = %meta.id, "exported to other nodes");
        Ok(())
    }

    /// Stops serving a volume: new connections are refused, open ones closed.
    fn withdraw(&self, id: &str) {
        if self.server.remove_export(id).is_ok() {
            tracing::info!(volume = %id, "no longer exported");
        }
    }
}

/// This node's volumes as other nodes reach them: the listener (once the
/// agent starts it) and the fence that keeps a volume to one holder.
pub(crate) struct NbdExports {
    base: Arc<Base>,
    /// Who holds each exported volume: this node or another, never both.
    pub(crate) fence: Arc<Fence>,
    listener: OnceLock<ExportListener>,
}

impl NbdExports {
    pub(crate) fn new(base: Arc<Base>, fence: Arc<Fence>) -> Self {
        Self { base, fence, listener: OnceLock::new() }
    }

    /// Starts serving every exported volume of the pool on `listener` (at
    /// start, before Probe answers ready), and every one created from now on.
    pub(crate) fn serve(&self, listener: ExportListener) -> Result<()> {
        // Fenced from the first export on: nothing is handed out to another
        // node while this node has it staged (`fence`).
        listener
            .server
            .exports()
            .set_admission(self.fence.clone())
            .map_err(|e| Error::Internal(format!("the export listener's fence: {e}")))?;
        for meta in self.base.pool.page(None, usize::MAX) {
            if let Some(secret) = &meta.nbd_secret {
                listener.serve(&meta, &self.base.pool.image_path(&meta.id), secret)?;
            }
        }
        self.listener.set(listener).map_err(|_| Error::Internal("the export listener is already set".into()))
    }

    /// The secret for a new `attach: nbd` volume, when this node exports.
    pub(crate) fn new_secret(&self) -> Result<Option<String>> {
        match self.listener.get() {
            Some(_) => Secret::generate().map(|s| Some(format!("{s:x}"))).map_err(|e| Error::Internal(e.to_string())),
            None => Ok(None),
        }
    }

    /// Serves a just-created (or re-requested) volume that has a secret.
    pub(crate) fn export_volume(&self, meta: &VolumeMeta) -> Result<()> {
        match (self.listener.get(), &meta.nbd_secret) {
            (Some(l), Some(secret)) => l.serve(meta, &self.base.pool.image_path(&meta.id), secret),
            _ => Ok(()),
        }
    }

    /// Before a delete: the volume stops being served (open connections
    /// are closed). A volume another node holds is served again and the
    /// delete refused: it is in use (FAILED_PRECONDITION, the spec's code
    /// for a volume in use).
    pub(crate) fn withdraw(&self, id: &str) -> Result<()> {
        self.fence.settle(id);
        if let Some(l) = self.listener.get() {
            l.withdraw(id);
        }
        if let Some(h @ super::fence::Holder::Remote { since, .. }) = self.fence.holder(id) {
            if let Some(m) = self.base.pool.get(id) {
                self.export_volume(&m)?;
            }
            return Err(Error::FailedPrecondition(format!(
                "volume {id} is attached on {} through this node's nbd export (since unix time {since})",
                h.who()
            )));
        }
        Ok(())
    }

    /// After a delete: whatever held the volume is moot.
    pub(crate) fn forget_holder(&self, id: &str) {
        if let Err(e) = self.fence.forget(id) {
            tracing::error!(volume = id, error = %e, "cannot forget the deleted volume's holder");
        }
    }

    /// The context keys of an exported volume: its URI and secret. A volume
    /// with a secret but no listener now (the agent restarted without one)
    /// gets none: no URI would lead anywhere.
    pub(crate) fn context(&self, meta: &VolumeMeta, context: &mut std::collections::HashMap<String, String>) {
        if let (Some(l), Some(secret)) = (self.listener.get(), &meta.nbd_secret) {
            context.insert(CONTEXT_URI.to_string(), l.uri(&meta.id));
            context.insert(CONTEXT_SECRET.to_string(), secret.clone());
        }
    }

    /// The address the export listener is bound to, if it runs.
    pub(crate) fn address(&self) -> Option<String> {
        self.listener.get().map(ExportListener::address)
    }

    /// The export listener's catalog, once it serves: an export per volume
    /// it hands to other nodes, named by the volume id, and its rings'
    /// counters (what `/metrics` shows of the I/O other nodes do here).
    pub(crate) fn catalog(&self) -> Option<Arc<Exports>> {
        self.listener.get().map(|l| l.server.exports().clone())
    }
}

/// The remote export a stage's volume context names, checked: both keys
/// or neither (a URI without a secret could only be refused).
pub(super) fn remote_from_context(
    id: &str,
    context: &std::collections::HashMap<String, String>,
) -> Result<Option<volring_volumes::RemoteExport>> {
    match (context.get(CONTEXT_URI), context.get(CONTEXT_SECRET)) {
        (None, None) => Ok(None),
        (Some(uri), Some(secret)) => {
            let parsed = uri.parse::<ExportUri>().map_err(|e| Error::InvalidArgument(format!("volume context {CONTEXT_URI}: {e}")))?;
            if parsed.export != id {
                return Err(Error::InvalidArgument(format!("volume context {CONTEXT_URI} names export {:?}, not {id:?}", parsed.export)));
            }
            secret.parse::<Secret>().map_err(|e| Error::InvalidArgument(format!("volume context {CONTEXT_SECRET}: {e}")))?;
            Ok(Some(volring_volumes::RemoteExport { uri: uri.clone(), secret: secret.clone() }))
        }
        _ => Err(Error::InvalidArgument(format!("volume context: {CONTEXT_URI} and {CONTEXT_SECRET} go together"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn context_needs_both_keys_well_formed_and_naming_the_volume() {
        let secret = "ab".repeat(32);
        let ctx = |pairs: &[(&str, &str)]| pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<HashMap<_, _>>();
        assert_eq!(remote_from_context("v", &ctx(&[])).unwrap(), None);
        let ok = remote_from_context("v", &ctx(&[(CONTEXT_URI, "nbd://10.0.0.1:10809/v"), (CONTEXT_SECRET, &secret)])).unwrap().unwrap();
        assert_eq!((ok.uri.as_str(), ok.secret.as_str()), ("nbd://10.0.0.1:10809/v", secret.as_str()));
        for bad in [
            ctx(&[(CONTEXT_URI, "nbd://10.0.0.1/v")]),
            ctx(&[(CONTEXT_SECRET, &secret)]),
            ctx(&[(CONTEXT_URI, "nbd://10.0.0.1/other"), (CONTEXT_SECRET, &secret)]),
            ctx(&[(CONTEXT_URI, "http://10.0.0.1/v"), (CONTEXT_SECRET, &secret)]),
            ctx(&[(CONTEXT_URI, "nbd://10.0.0.1/v"), (CONTEXT_SECRET, "short")]),
        ] {
            let e = remote_from_context("v", &bad).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
            assert!(!e.to_string().contains(&secret), "the secret is not echoed: {e}");
        }
    }
}
