//! The netlink framing's unit tests: round trips of the nbd family's
//! messages, replies the kernel sends, and truncated input.

use super::*;

#[test]
fn config_round_trips_through_the_kernel_view() {
    let c = NbdConfig {
        index: Some(3),
        size_bytes: Some(1 << 30),
        block_size: Some(4096),
        timeout: Some(5),
        server_flags: Some(0x10d),
        client_flags: Some(nbd::CFLAG_DISCONNECT_ON_CLOSE),
        dead_conn_timeout: Some(120),
        backend_id: Some("vol-1".into()),
        sockets: vec![7, 9],
    };
    let msg = nbd_request(0x20, NbdCmd::Connect, &c, 42);
    let m: Vec<_> = messages(&msg).collect::<Result<_, _>>().unwrap();
    assert_eq!(m.len(), 1);
    assert_eq!((m[0].kind, m[0].seq, m[0].flags), (0x20, 42, NLM_F_REQUEST | NLM_F_ACK));
    let (cmd, body) = genl(m[0].payload).unwrap();
    assert_eq!(cmd, NbdCmd::Connect as u8);
    assert_eq!(parse_nbd_config(body).unwrap(), c);
}

#[test]
fn status_and_family_replies_parse() {
    let devs = [DeviceStatus { index: 0, connected: true }, DeviceStatus { index: 5, connected: false }];
    let msg = status_reply(0x21, &devs, 1);
    let m = messages(&msg).next().unwrap().unwrap();
    assert_eq!(parse_status(genl(m.payload).unwrap().1).unwrap(), devs);

    let mut b = Builder::new(GENL_ID_CTRL, 0, 1, 2);
    b.u16(CTRL_ATTR_FAMILY_ID, 0x1c).string(CTRL_ATTR_FAMILY_NAME, "nbd");
    b.begin_nest(CTRL_ATTR_MCAST_GROUPS).begin_nest(1).u32(CTRL_ATTR_MCAST_GRP_ID, 9).string(CTRL_ATTR_MCAST_GRP_NAME, "nbd_mc_group");
    b.end_nest().end_nest();
    let msg = b.finish(3);
    let m = messages(&msg).next().unwrap().unwrap();
    let f = parse_family(genl(m.payload).unwrap().1).unwrap();
    assert_eq!(f, Family { id: 0x1c, name: "nbd".into(), groups: vec![("nbd_mc_group".into(), 9)] });
}

#[test]
fn a_link_dead_notice_names_its_device_and_other_messages_none() {
    let mut b = Builder::new(0x1a, 0, NbdCmd::LinkDead as u8, nbd::VERSION);
    b.u32(nbd::ATTR_INDEX, 4);
    assert_eq!(parse_link_dead(&b.finish(0)), Ok(Some(4)));
    let status = status_reply(0x1a, &[DeviceStatus { index: 4, connected: false }], 1);
    assert_eq!(parse_link_dead(&status), Ok(None));
    let (cmd, c) =
        parse_nbd_request(&nbd_request(0x1a, NbdCmd::Disconnect, &NbdConfig { index: Some(2), ..Default::default() }, 1)).unwrap();
    assert_eq!((cmd, c.index, c.sockets.len()), (NbdCmd::Disconnect as u8, Some(2), 0));
}

/// A CONNECT request carries NBD_CMD_CONNECT, and a LINK_DEAD notice
/// written from the UAPI headers (linux/netlink.h, linux/genetlink.h,
/// linux/nbd-netlink.h), not by the code under test, yields its device:
/// nlmsghdr {len 28, type = the family, flags 0, seq 0, port 0},
/// genlmsghdr {cmd NBD_CMD_LINK_DEAD = 4, version 1}, and one attribute
/// {len 8, NBD_ATTR_INDEX = 1} holding device 4.
#[test]
fn connect_carries_its_uapi_command_and_a_uapi_link_dead_notice_parses() {
    let (cmd, _) = parse_nbd_request(&nbd_request(0x1a, NbdCmd::Connect, &NbdConfig { index: Some(4), ..Default::default() }, 9)).unwrap();
    assert_eq!(cmd, 1, "NBD_CMD_CONNECT (linux/nbd-netlink.h)");
    let notice = {
        let mut m = Vec::new();
        m.extend_from_slice(&28u32.to_ne_bytes());
        m.extend_from_slice(&0x1au16.to_ne_bytes());
        m.extend_from_slice(&0u16.to_ne_bytes());
        m.extend_from_slice(&0u32.to_ne_bytes());
        m.extend_from_slice(&0u32.to_ne_bytes());
        m.extend_from_slice(&[4, 1, 0, 0]);
        m.extend_from_slice(&8u16.to_ne_bytes());
        m.extend_from_slice(&1u16.to_ne_bytes());
        m.extend_from_slice(&4u32.to_ne_bytes());
        m
    };
    assert_eq!(parse_link_dead(&notice), Ok(Some(4)));
}

#[test]
fn truncated_input_is_refused_not_read_past() {
    let msg = nbd_request(0x20, NbdCmd::Connect, &NbdConfig { index: Some(1), sockets: vec![3], ..Default::default() }, 1);
    for cut in 0..msg.len() {
        let _ = messages(&msg[..cut]).collect::<Vec<_>>();
        let _ = parse_nbd_config(&msg[NLMSG_HDRLEN + GENL_HDRLEN..cut.max(NLMSG_HDRLEN + GENL_HDRLEN)]);
    }
    assert!(messages(&msg[..10]).next().unwrap().is_err());
    // An attribute claiming more than there is.
    assert!(attrs(&[0xff, 0x00, 1, 0, 0, 0]).next().unwrap().is_err());
}
