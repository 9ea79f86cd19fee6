//! NodeStage volume context → the NFS export a shared volume is mounted
//! from (`volring_share::client::remote`). Whatever the CO sends, the
//! parser answers without panicking, and what it accepts is safe to hand
//! the kernel: an address with a port, an absolute export path of plain
//! characters with no `..`, and a mount source/options string with no
//! separator an attacker could use to add options. The PVC the context
//! names (`volring_share::pvc_in_context`, which goes into API paths) is
//! either refused or plain Kubernetes names.
#![no_main]

use std::collections::HashMap;

use libfuzzer_sys::fuzz_target;
use volring_share::client;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let mut fields = text.splitn(5, '\n');
    let (server, export) = (fields.next().unwrap_or(""), fields.next().unwrap_or(""));
    let (ns, pvc) = (fields.next().unwrap_or(""), fields.next().unwrap_or(""));
    let ctx: HashMap<String, String> =
        [("share", "nfs"), ("nfsServer", server), ("nfsExport", export), ("nfsPvcNamespace", ns), ("nfsPvcName", pvc)]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
    if let Some((ns, name)) = volring_share::pvc_in_context(&ctx) {
        let plain = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.');
        assert!(plain(&ns) && !ns.contains('.') && plain(&name) && !name.contains(".."), "{ns:?} {name:?}");
    }
    if let Ok(Some(r)) = client::remote(&ctx) {
        assert!(r.server.port() != 0);
        assert!(r.export.starts_with('/') && !r.export.split('/').any(|c| c == ".."));
        let src = r.to_string();
        assert!(!src.contains(','), "{src:?}");
        let opts = r.options(false);
        assert_eq!(opts.data.split(',').count(), 9, "{:?}", opts.data);
    }
});
