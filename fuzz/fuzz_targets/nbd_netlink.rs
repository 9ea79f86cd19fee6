//! Kernel bytes → the netlink parsers (datagram split, genl header,
//! attributes, nested attributes, the controller's family reply, STATUS
//! replies, LINK_DEAD notices, and the nbd config decoder). Whatever the
//! bytes, they answer or refuse, never panic or read out of bounds; and a
//! config that decodes re-encodes to one that decodes the same.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    volring_sys::fuzz_nbd_netlink(data);
});
