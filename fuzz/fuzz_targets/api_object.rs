//! Bytes from the API server (or the node's store) → `Object::from_api`,
//! the publisher's reading of a LIST item or GET reply, the Retry-After
//! header and a VolumeAttachment LIST page. Whatever comes, nothing
//! panics, and what is read keeps its promises; the checks live beside the
//! readers (`volring_kube::fuzz_api_object`), which stay private.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| volring_kube::fuzz_api_object(data));
