//! CSI request bytes → decoded message → validation. Whatever a CO (or an
//! attacker on the socket) sends, validation returns a typed answer without
//! panicking, and what it accepts keeps its promises: paths stay inside the
//! kubelet root with no `..`, sizes respect the range and the limits. The
//! checks live beside the validators (`volring_csi::validate::fuzz_request`),
//! which stay private to the crate.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| volring_csi::validate::fuzz_request(data));
