//! DHCP messages: strict parsing of server replies and building of client
//! requests, with `dhcproto` as the codec.
//!
//! `dhcproto` decodes leniently (it stops at the first bad option, does not
//! check the magic cookie, and reads fixed-size options without checking
//! their length byte). A client that acts on what it reads must not guess, so
//! `parse_reply` first walks the option TLVs itself (lengths, `END`, option
//! overload into `file`/`sname` per RFC 2131 §4.1, RFC 3396 concatenation of
//! repeated options), checks the lengths of every option the client uses,
//! and only then lets `dhcproto` decode the header and each option. Anything
//! that does not fit is a `ParseError`: the caller drops and counts it.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use dhcproto::v4::{
    DhcpOption, DhcpOptions, Flags, HType, Message, MessageType, Opcode, OptionCode, UnknownOption,
};
use dhcproto::{Decodable, Decoder, Encodable, Encoder};

/// Fixed BOOTP header before the magic cookie (RFC 2131 figure 1).
pub(crate) const HEADER_LEN: usize = 236;
/// Header plus the magic cookie: the shortest possible DHCP message.
pub(crate) const MIN_LEN: usize = HEADER_LEN + 4;
/// The largest reply accepted: an Ethernet MTU of 1500 less the IPv4 and UDP
/// headers. The client advertises this as option 57, so a compliant server
/// never sends more.
pub(crate) const MAX_LEN: usize = 1472;
/// RFC 2131's magic cookie.
pub(crate) const MAGIC: [u8; 4] = [99, 130, 83, 99];
const SNAME: std::ops::Range<usize> = 44..108;
const FILE: std::ops::Range<usize> = 108..236;

/// Why a received packet was dropped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ParseError {
    #[error("{0} bytes is shorter than the {MIN_LEN}-byte DHCP minimum")]
    Truncated(usize),
    #[error("{0} bytes is longer than the {MAX_LEN}-byte maximum")]
    Oversized(usize),
    #[error("bad magic cookie {0:02x?}")]
    BadMagic([u8; 4]),
    #[error("op {0} is not BOOTREPLY")]
    NotReply(u8),
    #[error("hardware type {htype} / length {hlen} is not Ethernet")]
    NotEthernet { htype: u8, hlen: u8 },
    #[error("option {code} in {area}: length runs past the end")]
    OptionOverrun { code: u8, area: &'static str },
    #[error("options in {0} have no END option")]
    NoEnd(&'static str),
    #[error("option overload value {0} is not 1, 2 or 3")]
    BadOverload(u8),
    #[error("option {code} has length {len}, expected {expected}")]
    OptionLength {
        code: u8,
        len: usize,
        expected: &'static str,
    },
    #[error("no message type (option 53)")]
    NoMessageType,
    #[error("message type {0} is not a server reply")]
    NotServerMessage(u8),
    #[error("option {code} does not decode: {reason}")]
    OptionDecode { code: u8, reason: String },
    #[error("header does not decode: {0}")]
    Header(String),
}

/// A server reply that passed every structural check. The fields the client
/// acts on are pulled out; everything else stays in `options`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Reply {
    pub(crate) xid: u32,
    pub(crate) chaddr: [u8; 6],
    pub(crate) msg_type: MessageType,
    pub(crate) yiaddr: Ipv4Addr,
    pub(crate) siaddr: Ipv4Addr,
    pub(crate) server_id: Option<Ipv4Addr>,
    pub(crate) lease_secs: Option<u32>,
    pub(crate) t1_secs: Option<u32>,
    pub(crate) t2_secs: Option<u32>,
    pub(crate) subnet_mask: Option<Ipv4Addr>,
    pub(crate) routers: Vec<Ipv4Addr>,
    /// Every option, as `dhcproto` decoded it (after overload/concatenation).
    pub(crate) options: DhcpOptions,
}

/// Walks one option area. Returns `(code, data)` pairs in order; stops at
/// `END`. `need_end`: the main options area must be terminated by `END`;
/// the overloaded `file`/`sname` fields may also simply be full.
fn walk_area<'a>(
    area: &'a [u8],
    name: &'static str,
    need_end: bool,
    out: &mut Vec<(u8, &'a [u8])>,
) -> Result<(), ParseError> {
    let mut i = 0;
    while i < area.len() {
        match area[i] {
            0 => i += 1,
            255 => return Ok(()),
            code => {
                let Some(&len) = area.get(i + 1) else {
                    return Err(ParseError::OptionOverrun { code, area: name });
                };
                let start = i + 2;
                let end = start + usize::from(len);
                if end > area.len() {
                    return Err(ParseError::OptionOverrun { code, area: name });
                }
                out.push((code, &area[start..end]));
                i = end;
            }
        }
    }
    if need_end {
        Err(ParseError::NoEnd(name))
    } else {
        Ok(())
    }
}

/// Checks the length of an option the client acts on. `Ok(true)`: the
/// client reads this option and its length fits; `Ok(false)`: the client
/// does not read it (any length will do).
fn check_len(code: u8, len: usize) -> Result<bool, ParseError> {
    let (ok, expected) = match code {
        1 | 50 | 54 => (len == 4, "4"),
        51 | 58 | 59 => (len == 4, "4"),
        53 | 52 => (len == 1, "1"),
        3 | 6 => (
            len >= 4 && len.is_multiple_of(4),
            "a positive multiple of 4",
        ),
        _ => return Ok(false),
    };
    if ok {
        Ok(true)
    } else {
        Err(ParseError::OptionLength {
            code,
            len,
            expected,
        })
    }
}

/// Parses a DHCP message received from a server, strictly.
pub(crate) fn parse_reply(buf: &[u8]) -> Result<Reply, ParseError> {
    if buf.len() < MIN_LEN {
        return Err(ParseError::Truncated(buf.len()));
    }
    if buf.len() > MAX_LEN {
        return Err(ParseError::Oversized(buf.len()));
    }
    let magic: [u8; 4] = buf[HEADER_LEN..MIN_LEN].try_into().expect("4 bytes");
    if magic != MAGIC {
        return Err(ParseError::BadMagic(magic));
    }
    if buf[0] != 2 {
        return Err(ParseError::NotReply(buf[0]));
    }
    if buf[1] != 1 || buf[2] != 6 {
        return Err(ParseError::NotEthernet {
            htype: buf[1],
            hlen: buf[2],
        });
    }

    let mut tlvs = Vec::new();
    walk_area(&buf[MIN_LEN..], "options", true, &mut tlvs)?;
    let overload = tlvs.iter().find(|(c, _)| *c == 52).map(|(_, d)| d);
    if let Some(d) = overload {
        check_len(52, d.len())?;
        match d[0] {
            // RFC 2131 §4.1: `file` first, then `sname`.
            1 => walk_area(&buf[FILE], "file", false, &mut tlvs)?,
            2 => walk_area(&buf[SNAME], "sname", false, &mut tlvs)?,
            3 => {
                walk_area(&buf[FILE], "file", false, &mut tlvs)?;
                walk_area(&buf[SNAME], "sname", false, &mut tlvs)?;
            }
            v => return Err(ParseError::BadOverload(v)),
        }
    }
    // RFC 3396: an option that appears more than once is one option whose
    // data is the concatenation, in order.
    let mut merged: BTreeMap<u8, Vec<u8>> = BTreeMap::new();
    for (code, data) in tlvs {
        merged.entry(code).or_default().extend_from_slice(data);
    }

    let mut options = DhcpOptions::new();
    for (code, data) in &merged {
        let read_by_client = check_len(*code, data.len())?;
        if data.len() > 255 {
            // Only long options the client never reads can get here (the
            // ones it reads are length-checked above); a single TLV cannot
            // carry them, so they are not represented.
            continue;
        }
        // Only the options this client reads, length-checked above, go
        // through dhcproto's typed decoders: some of the others assert on
        // their length (81, 94, 152-155) or subtract from it (151), which
        // a hostile server could turn into a panic or a dropped reply
        // (found by the fuzz target). The rest are kept as raw bytes.
        let opt = if read_by_client {
            let mut tlv = Vec::with_capacity(data.len() + 2);
            tlv.push(*code);
            tlv.push(data.len() as u8);
            tlv.extend_from_slice(data);
            DhcpOption::decode(&mut Decoder::new(&tlv)).map_err(|e| ParseError::OptionDecode {
                code: *code,
                reason: e.to_string(),
            })?
        } else {
            DhcpOption::Unknown(UnknownOption::new((*code).into(), data.clone()))
        };
        options.insert(opt);
    }

    // The header through dhcproto; its own option parsing result is
    // discarded in favour of the checked set above.
    let header = Message::decode(&mut Decoder::new(&buf[..MIN_LEN]))
        .map_err(|e| ParseError::Header(e.to_string()))?;

    let msg_type = match merged.get(&53) {
        None => return Err(ParseError::NoMessageType),
        Some(d) => match MessageType::from(d[0]) {
            t @ (MessageType::Offer | MessageType::Ack | MessageType::Nak) => t,
            _ => return Err(ParseError::NotServerMessage(d[0])),
        },
    };
    let ip = |code: u8| {
        merged
            .get(&code)
            .map(|d| Ipv4Addr::new(d[0], d[1], d[2], d[3]))
    };
    let secs = |code: u8| {
        merged
            .get(&code)
            .map(|d| u32::from_be_bytes([d[0], d[1], d[2], d[3]]))
    };
    let routers = merged
        .get(&3)
        .map(|d| {
            d.chunks(4)
                .map(|c| Ipv4Addr::new(c[0], c[1], c[2], c[3]))
                .collect()
        })
        .unwrap_or_default();
    let mut chaddr = [0u8; 6];
    chaddr.copy_from_slice(&header.chaddr()[..6]);
    Ok(Reply {
        xid: header.xid(),
        chaddr,
        msg_type,
        yiaddr: header.yiaddr(),
        siaddr: header.siaddr(),
        server_id: ip(54),
        lease_secs: secs(51),
        t1_secs: secs(58),
        t2_secs: secs(59),
        subnet_mask: ip(1),
        routers,
        options,
    })
}

/// Who the client is on the wire. Chosen by the caller (the LB layer
/// derives them per Service, so they survive restarts and failovers).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Identity {
    pub mac: [u8; 6],
    /// Option 61. `None` means RFC 2132's default: hardware type 1 + MAC.
    /// Empty means no option 61 at all, as kube-vip sends without a
    /// hostname: the server then knows the client by its MAC alone.
    pub client_id: Option<Vec<u8>>,
    /// Option 12.
    pub hostname: Option<String>,
}

impl Identity {
    pub fn new(mac: [u8; 6]) -> Self {
        Identity {
            mac,
            client_id: None,
            hostname: None,
        }
    }

    /// The client identifier actually sent, if any.
    pub fn client_id_bytes(&self) -> Option<Vec<u8>> {
        match &self.client_id {
            Some(id) if id.is_empty() => None,
            Some(id) => Some(id.clone()),
            None => {
                let mut id = vec![1];
                id.extend_from_slice(&self.mac);
                Some(id)
            }
        }
    }
}

/// What a request carries besides the identity.
#[derive(Debug, Clone, Default)]
pub(crate) struct RequestFields {
    pub(crate) xid: u32,
    pub(crate) secs: u16,
    pub(crate) ciaddr: Option<Ipv4Addr>,
    pub(crate) requested: Option<Ipv4Addr>,
    pub(crate) server_id: Option<Ipv4Addr>,
}

/// Builds a client message (DISCOVER, REQUEST, DECLINE, RELEASE) ready for
/// the UDP payload. Padded to the 300-byte BOOTP minimum that some relays
/// and servers still insist on.
pub(crate) fn build(ty: MessageType, id: &Identity, f: &RequestFields) -> Vec<u8> {
    let mut msg = Message::default();
    msg.set_opcode(Opcode::BootRequest)
        .set_htype(HType::Eth)
        .set_xid(f.xid)
        .set_secs(f.secs)
        .set_flags(Flags::default())
        .set_chaddr(&id.mac);
    msg.clear_addrs();
    if let Some(ci) = f.ciaddr {
        msg.set_ciaddr(ci);
    }
    let opts = msg.opts_mut();
    opts.insert(DhcpOption::MessageType(ty));
    if let Some(client_id) = id.client_id_bytes() {
        opts.insert(DhcpOption::ClientIdentifier(client_id));
    }
    if let Some(r) = f.requested {
        opts.insert(DhcpOption::RequestedIpAddress(r));
    }
    if let Some(s) = f.server_id {
        opts.insert(DhcpOption::ServerIdentifier(s));
    }
    if matches!(ty, MessageType::Discover | MessageType::Request) {
        opts.insert(DhcpOption::MaxMessageSize(MAX_LEN as u16));
        opts.insert(DhcpOption::ParameterRequestList(vec![
            OptionCode::SubnetMask,
            OptionCode::Router,
            OptionCode::AddressLeaseTime,
            OptionCode::ServerIdentifier,
            OptionCode::Renewal,
            OptionCode::Rebinding,
        ]));
        if let Some(h) = &id.hostname {
            opts.insert(DhcpOption::Hostname(h.clone()));
        }
    }
    let mut buf = Vec::with_capacity(320);
    msg.encode(&mut Encoder::new(&mut buf))
        .expect("encoding into a Vec cannot fail");
    if buf.len() < 300 {
        buf.resize(300, 0);
    }
    buf
}

/// Builds a server reply; used by tests and the fuzz harness to produce
/// well-formed input to mutate.
pub(crate) fn build_reply(
    ty: MessageType,
    xid: u32,
    chaddr: [u8; 6],
    yiaddr: Ipv4Addr,
    extra: &[DhcpOption],
) -> Vec<u8> {
    let mut msg = Message::default();
    msg.set_opcode(Opcode::BootReply)
        .set_htype(HType::Eth)
        .set_xid(xid)
        .set_chaddr(&chaddr);
    msg.clear_addrs();
    msg.set_yiaddr(yiaddr);
    msg.opts_mut().insert(DhcpOption::MessageType(ty));
    for o in extra {
        msg.opts_mut().insert(o.clone());
    }
    let mut buf = Vec::new();
    msg.encode(&mut Encoder::new(&mut buf))
        .expect("encoding into a Vec cannot fail");
    buf
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAC: [u8; 6] = [0, 0, 0x6c, 1, 2, 3];
    const SRV: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 1);

    fn ack() -> Vec<u8> {
        build_reply(
            MessageType::Ack,
            42,
            MAC,
            Ipv4Addr::new(10, 77, 0, 150),
            &[
                DhcpOption::ServerIdentifier(SRV),
                DhcpOption::AddressLeaseTime(120),
                DhcpOption::Renewal(20),
                DhcpOption::Rebinding(35),
                DhcpOption::SubnetMask(Ipv4Addr::new(255, 255, 255, 0)),
                DhcpOption::Router(vec![SRV]),
            ],
        )
    }

    #[test]
    fn well_formed_ack_parses() {
        let r = parse_reply(&ack()).unwrap();
        assert_eq!(r.xid, 42);
        assert_eq!(r.chaddr, MAC);
        assert_eq!(r.msg_type, MessageType::Ack);
        assert_eq!(r.yiaddr, Ipv4Addr::new(10, 77, 0, 150));
        assert_eq!(r.server_id, Some(SRV));
        assert_eq!(
            (r.lease_secs, r.t1_secs, r.t2_secs),
            (Some(120), Some(20), Some(35))
        );
        assert_eq!(r.routers, vec![SRV]);
    }

    #[test]
    fn every_truncation_is_rejected_without_panic() {
        let full = ack();
        for n in 0..full.len() {
            assert!(
                parse_reply(&full[..n]).is_err(),
                "prefix of {n} bytes parsed"
            );
        }
    }

    #[test]
    fn oversized_and_bad_magic_are_rejected() {
        let mut big = ack();
        big.resize(MAX_LEN + 1, 0);
        assert_eq!(parse_reply(&big), Err(ParseError::Oversized(MAX_LEN + 1)));
        // Padding up to the maximum is fine.
        let mut padded = ack();
        padded.resize(MAX_LEN, 0);
        assert!(parse_reply(&padded).is_ok());
        let mut bad = ack();
        bad[HEADER_LEN] = 0;
        assert!(matches!(parse_reply(&bad), Err(ParseError::BadMagic(_))));
    }

    #[test]
    fn requests_and_non_ethernet_are_rejected() {
        let mut m = ack();
        m[0] = 1;
        assert_eq!(parse_reply(&m), Err(ParseError::NotReply(1)));
        let mut m = ack();
        m[2] = 16;
        assert!(matches!(
            parse_reply(&m),
            Err(ParseError::NotEthernet { .. })
        ));
    }

    /// Header (no options) plus the given option bytes.
    fn with_options(opts: &[u8]) -> Vec<u8> {
        let mut m = ack();
        m.truncate(MIN_LEN);
        m.extend_from_slice(opts);
        m
    }

    #[test]
    fn option_lengths_are_checked() {
        // Option 51 with 2 bytes: dhcproto alone would read 4 and misalign.
        let m = with_options(&[53, 1, 5, 51, 2, 0, 120, 255]);
        assert!(matches!(
            parse_reply(&m),
            Err(ParseError::OptionLength { code: 51, .. })
        ));
        let m = with_options(&[53, 1, 5, 3, 5, 1, 2, 3, 4, 5, 255]);
        assert!(matches!(
            parse_reply(&m),
            Err(ParseError::OptionLength { code: 3, .. })
        ));
        // Length byte running past the end.
        let m = with_options(&[53, 1, 5, 12, 40, b'a']);
        assert!(matches!(
            parse_reply(&m),
            Err(ParseError::OptionOverrun { code: 12, .. })
        ));
        // No END.
        let m = with_options(&[53, 1, 5]);
        assert_eq!(parse_reply(&m), Err(ParseError::NoEnd("options")));
        // No message type; a client message type.
        let m = with_options(&[54, 4, 10, 77, 0, 1, 255]);
        assert_eq!(parse_reply(&m), Err(ParseError::NoMessageType));
        let m = with_options(&[53, 1, 1, 255]);
        assert_eq!(parse_reply(&m), Err(ParseError::NotServerMessage(1)));
        let m = with_options(&[53, 1, 77, 255]);
        assert_eq!(parse_reply(&m), Err(ParseError::NotServerMessage(77)));
    }

    #[test]
    fn overloaded_file_and_sname_are_read() {
        let mut m = with_options(&[53, 1, 5, 52, 1, 3, 255]);
        // file: server id and lease time; sname: T1, then END.
        let file = [54, 4, 10, 77, 0, 1, 51, 4, 0, 0, 0, 120, 255];
        m[FILE.start..FILE.start + file.len()].copy_from_slice(&file);
        let sname = [58, 4, 0, 0, 0, 20, 255];
        m[SNAME.start..SNAME.start + sname.len()].copy_from_slice(&sname);
        let r = parse_reply(&m).unwrap();
        assert_eq!(r.server_id, Some(SRV));
        assert_eq!(r.lease_secs, Some(120));
        assert_eq!(r.t1_secs, Some(20));

        // An overrun inside an overloaded field is malformed.
        let mut m = with_options(&[53, 1, 5, 52, 1, 2, 255]);
        m[SNAME.end - 2] = 12;
        m[SNAME.end - 1] = 10;
        assert!(matches!(
            parse_reply(&m),
            Err(ParseError::OptionOverrun { area: "sname", .. })
        ));
        let m = with_options(&[53, 1, 5, 52, 1, 9, 255]);
        assert_eq!(parse_reply(&m), Err(ParseError::BadOverload(9)));
    }

    #[test]
    fn odd_lengths_of_options_the_client_never_reads_are_kept_raw() {
        // Found by the fuzz target: dhcproto's typed decoders assert on the
        // length of these (debug builds panic) or subtract from it. None of
        // them may cost a reply, let alone panic.
        for code in [80u8, 81, 94, 151, 152, 153, 154, 155] {
            for len in [0u8, 1, 2, 5] {
                let mut opts = vec![53, 1, 5, 54, 4, 10, 77, 0, 1, code, len];
                opts.extend(std::iter::repeat_n(7, len as usize));
                opts.push(255);
                let r = parse_reply(&with_options(&opts))
                    .unwrap_or_else(|e| panic!("option {code} length {len}: {e}"));
                assert_eq!(r.server_id, Some(SRV));
                assert!(
                    r.options.get(OptionCode::from(code)).is_some(),
                    "option {code} not kept"
                );
            }
        }
    }

    #[test]
    fn split_options_are_concatenated() {
        // RFC 3396: two option-3 instances form one router list.
        let m = with_options(&[53, 1, 5, 3, 4, 10, 77, 0, 1, 3, 4, 10, 77, 0, 2, 255]);
        let r = parse_reply(&m).unwrap();
        assert_eq!(
            r.routers,
            vec![Ipv4Addr::new(10, 77, 0, 1), Ipv4Addr::new(10, 77, 0, 2)]
        );
        // ... and a split 4-byte option whose halves add up is fine, while
        // two full lease times (8 bytes) are not.
        let m = with_options(&[53, 1, 5, 51, 2, 0, 0, 51, 2, 0, 120, 255]);
        assert_eq!(parse_reply(&m).unwrap().lease_secs, Some(120));
        let m = with_options(&[53, 1, 5, 51, 4, 0, 0, 0, 1, 51, 4, 0, 0, 0, 2, 255]);
        assert!(parse_reply(&m).is_err());
    }

    #[test]
    fn built_requests_round_trip_through_dhcproto() {
        let mut id = Identity::new(MAC);
        id.hostname = Some("lb-1".into());
        let f = RequestFields {
            xid: 7,
            secs: 3,
            ciaddr: None,
            requested: Some(Ipv4Addr::new(10, 77, 0, 150)),
            server_id: Some(SRV),
        };
        let buf = build(MessageType::Request, &id, &f);
        assert!(buf.len() >= 300);
        let m = Message::decode(&mut Decoder::new(&buf)).unwrap();
        assert_eq!(m.opcode(), Opcode::BootRequest);
        assert_eq!(m.xid(), 7);
        assert_eq!(m.chaddr(), &MAC);
        assert_eq!(m.opts().msg_type(), Some(MessageType::Request));
        assert_eq!(
            m.opts().get(OptionCode::ClientIdentifier),
            Some(&DhcpOption::ClientIdentifier(vec![1, 0, 0, 0x6c, 1, 2, 3]))
        );
        assert_eq!(
            m.opts().get(OptionCode::Hostname),
            Some(&DhcpOption::Hostname("lb-1".into()))
        );
        assert_eq!(
            m.opts().get(OptionCode::RequestedIpAddress),
            Some(&DhcpOption::RequestedIpAddress(Ipv4Addr::new(
                10, 77, 0, 150
            )))
        );
        let bare = Identity {
            client_id: Some(Vec::new()),
            ..id.clone()
        };
        let m =
            Message::decode(&mut Decoder::new(&build(MessageType::Request, &bare, &f))).unwrap();
        assert!(
            m.opts().get(OptionCode::ClientIdentifier).is_none(),
            "empty: no option 61, as kube-vip without a hostname"
        );
        // A RELEASE carries no parameter request list.
        let rel = build(MessageType::Release, &id, &f);
        let m = Message::decode(&mut Decoder::new(&rel)).unwrap();
        assert!(m.opts().get(OptionCode::ParameterRequestList).is_none());
    }
}
