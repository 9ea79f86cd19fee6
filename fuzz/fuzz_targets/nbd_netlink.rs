//! Kernel bytes → the netlink parsers (datagram split, genl header,
//! attributes, nested attributes, the controller's family reply, STATUS
//! replies, LINK_DEAD notices, and the nbd config decoder). Whatever the
//! bytes, they answer or refuse, never panic or read out of bounds; and a
//! config that decodes re-encodes to one that decodes the same.
#![no_main]

use libfuzzer_sys::fuzz_target;
use volring_nbd::attach::link_dead_index;
use volring_sys::nlmsg;

fuzz_target!(|data: &[u8]| {
    let _ = link_dead_index(data);
    nlmsg::fuzz_parse(data);
});
