//! Kernel bytes → the netlink parsers (datagram split, genl header,
//! attributes, nested attributes, the controller's family reply, STATUS
//! replies, LINK_DEAD notices, and the nbd config decoder). Whatever the
//! bytes, they answer or refuse, never panic or read out of bounds; and a
//! config that decodes re-encodes to one that decodes the same.
#![no_main]

use libfuzzer_sys::fuzz_target;
use volring_nbd::attach::link_dead_index;
use volring_sys::nlmsg::{self, nbd};

fuzz_target!(|data: &[u8]| {
    let _ = link_dead_index(data);
    for m in nlmsg::messages(data).take(64) {
        let Ok(m) = m else { break };
        assert!(m.payload.len() <= data.len());
        let _ = nlmsg::error_code(m.payload);
        let Ok((_, attrs)) = nlmsg::genl(m.payload) else { continue };
        let _ = nlmsg::parse_family(attrs);
        let _ = nlmsg::parse_status(attrs);
        let _ = nlmsg::parse_index(attrs);
        for a in nlmsg::attrs(attrs).take(256) {
            let Ok(a) = a else { break };
            let _ = (a.u8(), a.u16(), a.u32(), a.u64(), a.str());
            for n in a.nested().take(256) {
                if n.is_err() {
                    break;
                }
            }
        }
        if let Ok(c) = nlmsg::parse_nbd_config(attrs) {
            // Strings cut at a NUL or of invalid UTF-8 do not round-trip by
            // design; the rest must.
            if c.backend_id.as_deref().is_none_or(|s| !s.contains('\0')) && c.sockets.len() < 1000 {
                let again = nlmsg::nbd_config_request(1, nbd::CMD_CONNECT, &c, 1);
                let m2 = nlmsg::messages(&again).next().expect("one message").expect("well formed");
                let (_, attrs2) = nlmsg::genl(m2.payload).expect("genl");
                assert_eq!(nlmsg::parse_nbd_config(attrs2).expect("re-decodes"), c);
            }
        }
    }
});
