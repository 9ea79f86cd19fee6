//! The Kubernetes publisher: what the node knows, as custom resources.
//!
//! - `objects`: the CRDs (BlockDevice, StorageNode) and the pure builders
//!   that turn devices and volumes into objects.
//! - `updater`: the batched, coalescing updater; `pace` is its token
//!   bucket, its in-flight limit (AIMD on 429 and 503) and backoff.
//! - `sink`: what the updater writes through, and how writes fail.
//! - [`kube_sink`]: the API server as a sink (server-side apply, status
//!   subresource, paginated LIST).
//! - [`embedded_sink`]: with no cluster, the node's own store as the sink.
//! - [`feed`]: the agent's side: inventory and volumes to objects.
//! - [`node_feed`]: the StorageNode, rebuilt when the agent's queues say
//!   something changed (never on a timer).
//! - [`names`]: the cluster's names (PVC, pods) for this node's volumes,
//!   looked up by [`names::follow`].
//! - [`attachments`]: the healer hook's VolumeAttachment listing.
//! - [`show`]: `volring get` ([`show::get`]).

// Everything is crate-private unless another crate uses it: a `pub`
// item no other crate can reach is an error (`-D warnings`).
#![warn(unreachable_pub)]

pub mod attachments;
pub mod embedded_sink;
pub mod feed;
mod fuzz;
pub mod kube_sink;
pub mod names;
pub mod node_feed;
mod objects;
mod pace;
pub mod queued;
pub mod show;
mod sink;
mod stats;
mod updater;

pub use fuzz::fuzz_api_object;
pub use objects::{crds_yaml, Key, Kind, Object};
pub use sink::{Part, Seen, Sink, SinkError, Watched};
pub use stats::{Stats, StatsSnapshot};
pub use updater::{GonePolicy, Updater, UpdaterConfig};
