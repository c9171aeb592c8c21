//! IPv4/UDP and ARP framing for packet sockets.
//!
//! The sockets are `SOCK_DGRAM` packet sockets, so the kernel writes and
//! strips the Ethernet header (from the `sockaddr_ll` destination); this
//! module builds and checks the 28 bytes of IPv4 + UDP header around a DHCP
//! payload, and ARP bodies. Written here rather than pulled from a crate
//! because it is two fixed headers and a checksum, and because the receive
//! side must be strict in ways general-purpose parsers are not (fragments,
//! ports, lengths, checksums that the NIC has not filled in yet).

use std::net::Ipv4Addr;

/// IPv4 header without options + UDP header.
#[cfg(test)]
pub(crate) const IP_UDP_LEN: usize = 28;
pub(crate) const CLIENT_PORT: u16 = 68;
pub(crate) const SERVER_PORT: u16 = 67;
/// ARP body for Ethernet/IPv4.
pub(crate) const ARP_LEN: usize = 28;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// Not a DHCP reply to us at all (other protocol or port): ignored, not
    /// counted. The socket filter keeps these out in practice.
    #[error("not a UDP datagram to port 68")]
    NotDhcp,
    #[error("IPv4 packet of {0} bytes is truncated")]
    Truncated(usize),
    #[error("not IPv4 (version {0})")]
    NotIpv4(u8),
    #[error("bad IPv4 header length {0}")]
    BadHeaderLength(usize),
    #[error("IPv4 total length {total} does not fit the {got} bytes received")]
    BadTotalLength { total: usize, got: usize },
    #[error("IPv4 header checksum is wrong")]
    IpChecksum,
    #[error("fragmented IPv4 packet")]
    Fragment,
    #[error("UDP length {0} is wrong")]
    UdpLength(usize),
    #[error("UDP checksum is wrong")]
    UdpChecksum,
    #[error("UDP source port {0} is not 67")]
    SourcePort(u16),
}

/// One's-complement sum over `data`, folded later.
fn sum(data: &[u8], mut acc: u32) -> u32 {
    let mut chunks = data.chunks_exact(2);
    for c in &mut chunks {
        acc += u32::from(u16::from_be_bytes([c[0], c[1]]));
    }
    if let [last] = chunks.remainder() {
        acc += u32::from(*last) << 8;
    }
    acc
}

fn fold(mut acc: u32) -> u16 {
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    !(acc as u16)
}

fn pseudo(src: Ipv4Addr, dst: Ipv4Addr, udp_len: usize) -> u32 {
    let mut acc = sum(&src.octets(), 0);
    acc = sum(&dst.octets(), acc);
    acc + 17 + udp_len as u32
}

/// IPv4 + UDP (68 → 67) around `payload`.
pub(crate) fn build_udp(src: Ipv4Addr, dst: Ipv4Addr, payload: &[u8]) -> Vec<u8> {
    let udp_len = 8 + payload.len();
    let total = 20 + udp_len;
    let mut p = Vec::with_capacity(total);
    p.extend_from_slice(&[0x45, 0x10]); // version/IHL, TOS low delay
    p.extend_from_slice(&(total as u16).to_be_bytes());
    p.extend_from_slice(&[0, 0, 0, 0]); // id, flags/fragment
    p.extend_from_slice(&[64, 17, 0, 0]); // TTL, UDP, checksum
    p.extend_from_slice(&src.octets());
    p.extend_from_slice(&dst.octets());
    let c = fold(sum(&p[..20], 0));
    p[10..12].copy_from_slice(&c.to_be_bytes());
    p.extend_from_slice(&CLIENT_PORT.to_be_bytes());
    p.extend_from_slice(&SERVER_PORT.to_be_bytes());
    p.extend_from_slice(&(udp_len as u16).to_be_bytes());
    p.extend_from_slice(&[0, 0]);
    p.extend_from_slice(payload);
    let mut c = fold(sum(&p[20..], pseudo(src, dst, udp_len)));
    if c == 0 {
        c = 0xffff;
    }
    p[26..28].copy_from_slice(&c.to_be_bytes());
    p
}

/// Checks an IPv4 packet and returns its UDP payload when it is a datagram
/// from port 67 to port 68. `csum_ready`: false when the kernel says the
/// UDP checksum was not computed yet (offload on a local path: veth,
/// macvlan), in which case it cannot be verified.
pub(crate) fn parse_udp(p: &[u8], csum_ready: bool) -> Result<&[u8], FrameError> {
    if p.len() < 20 {
        return Err(FrameError::Truncated(p.len()));
    }
    if p[0] >> 4 != 4 {
        return Err(FrameError::NotIpv4(p[0] >> 4));
    }
    let ihl = usize::from(p[0] & 0xf) * 4;
    if ihl < 20 || ihl > p.len() {
        return Err(FrameError::BadHeaderLength(ihl));
    }
    if p[9] != 17 {
        return Err(FrameError::NotDhcp);
    }
    let total = usize::from(u16::from_be_bytes([p[2], p[3]]));
    if total < ihl + 8 || total > p.len() {
        return Err(FrameError::BadTotalLength {
            total,
            got: p.len(),
        });
    }
    if fold(sum(&p[..ihl], 0)) != 0 {
        return Err(FrameError::IpChecksum);
    }
    if u16::from_be_bytes([p[6], p[7]]) & 0x3fff != 0 {
        return Err(FrameError::Fragment);
    }
    let udp = &p[ihl..total];
    let sport = u16::from_be_bytes([udp[0], udp[1]]);
    let dport = u16::from_be_bytes([udp[2], udp[3]]);
    if dport != CLIENT_PORT {
        return Err(FrameError::NotDhcp);
    }
    if sport != SERVER_PORT {
        return Err(FrameError::SourcePort(sport));
    }
    let udp_len = usize::from(u16::from_be_bytes([udp[4], udp[5]]));
    if udp_len != udp.len() {
        return Err(FrameError::UdpLength(udp_len));
    }
    let csum = u16::from_be_bytes([udp[6], udp[7]]);
    if csum_ready && csum != 0 {
        let src = Ipv4Addr::new(p[12], p[13], p[14], p[15]);
        let dst = Ipv4Addr::new(p[16], p[17], p[18], p[19]);
        if fold(sum(udp, pseudo(src, dst, udp_len))) != 0 {
            return Err(FrameError::UdpChecksum);
        }
    }
    Ok(&udp[8..])
}

/// An ARP request body. Probe (RFC 5227 §2.1.1): `sender_ip` 0.0.0.0.
/// Announcement (§2.3): `sender_ip` = `target_ip` = the address.
pub(crate) fn build_arp(mac: [u8; 6], sender_ip: Ipv4Addr, target_ip: Ipv4Addr) -> Vec<u8> {
    let mut a = Vec::with_capacity(ARP_LEN);
    a.extend_from_slice(&[0, 1, 8, 0, 6, 4, 0, 1]);
    a.extend_from_slice(&mac);
    a.extend_from_slice(&sender_ip.octets());
    a.extend_from_slice(&[0; 6]);
    a.extend_from_slice(&target_ip.octets());
    a
}

/// Parsed Ethernet/IPv4 ARP body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Arp {
    pub(crate) op: u16,
    pub(crate) sender_mac: [u8; 6],
    pub(crate) sender_ip: Ipv4Addr,
    pub(crate) target_ip: Ipv4Addr,
}

pub(crate) fn parse_arp(a: &[u8]) -> Option<Arp> {
    if a.len() < ARP_LEN || a[..6] != [0, 1, 8, 0, 6, 4] {
        return None;
    }
    Some(Arp {
        op: u16::from_be_bytes([a[6], a[7]]),
        sender_mac: a[8..14].try_into().ok()?,
        sender_ip: Ipv4Addr::new(a[14], a[15], a[16], a[17]),
        target_ip: Ipv4Addr::new(a[24], a[25], a[26], a[27]),
    })
}

/// RFC 5227 §2.1.1: a conflict is any ARP from another host that claims
/// `addr` as its sender address, or another host's probe for `addr`.
pub(crate) fn arp_conflicts(arp: &Arp, addr: Ipv4Addr, our_mac: [u8; 6]) -> bool {
    arp.sender_mac != our_mac
        && (arp.sender_ip == addr
            || (arp.op == 1 && arp.sender_ip.is_unspecified() && arp.target_ip == addr))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SRC: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 1);
    const DST: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 150);

    /// A server reply: swap the ports of a built client datagram and fix
    /// the checksums.
    fn reply(payload: &[u8]) -> Vec<u8> {
        let mut p = build_udp(SRC, DST, payload);
        p[20..22].copy_from_slice(&SERVER_PORT.to_be_bytes());
        p[22..24].copy_from_slice(&CLIENT_PORT.to_be_bytes());
        p[26..28].copy_from_slice(&[0, 0]);
        let c = fold(sum(&p[20..], pseudo(SRC, DST, 8 + payload.len())));
        p[26..28].copy_from_slice(&c.to_be_bytes());
        p
    }

    #[test]
    fn built_datagram_has_valid_checksums() {
        let p = build_udp(Ipv4Addr::UNSPECIFIED, Ipv4Addr::BROADCAST, b"hello");
        assert_eq!(p.len(), IP_UDP_LEN + 5);
        assert_eq!(fold(sum(&p[..20], 0)), 0);
        let udp_len = p.len() - 20;
        assert_eq!(
            fold(sum(
                &p[20..],
                pseudo(Ipv4Addr::UNSPECIFIED, Ipv4Addr::BROADCAST, udp_len)
            )),
            0
        );
    }

    #[test]
    fn reply_parses_and_corruption_is_caught() {
        let p = reply(b"dhcp!");
        assert_eq!(parse_udp(&p, true).unwrap(), b"dhcp!");
        // Trailing Ethernet padding beyond the IP total length is fine.
        let mut padded = p.clone();
        padded.extend_from_slice(&[0; 20]);
        assert_eq!(parse_udp(&padded, true).unwrap(), b"dhcp!");

        let mut bad = p.clone();
        bad[30] ^= 1;
        assert_eq!(parse_udp(&bad, true), Err(FrameError::UdpChecksum));
        // ... unless the kernel says the checksum is not there yet.
        assert_eq!(parse_udp(&bad, false).unwrap(), b"dhbp!");
        let mut bad = p.clone();
        bad[8] ^= 1;
        assert_eq!(parse_udp(&bad, true), Err(FrameError::IpChecksum));
        for n in 0..p.len() {
            assert!(parse_udp(&p[..n], true).is_err(), "prefix {n}");
        }
        let mut frag = p.clone();
        frag[6] = 0x20; // more fragments
        let c = fold(sum(
            &{
                let mut h = frag[..20].to_vec();
                h[10] = 0;
                h[11] = 0;
                h
            },
            0,
        ));
        frag[10..12].copy_from_slice(&c.to_be_bytes());
        assert_eq!(parse_udp(&frag, true), Err(FrameError::Fragment));
        // Our own outgoing datagram (68 → 67) is not a reply.
        let own = build_udp(DST, SRC, b"x");
        assert_eq!(parse_udp(&own, true), Err(FrameError::NotDhcp));
    }

    #[test]
    fn arp_probe_announce_and_conflicts() {
        let ours = [0, 0, 0x6c, 1, 2, 3];
        let other = [2, 0, 0, 0, 0, 9];
        let probe = parse_arp(&build_arp(ours, Ipv4Addr::UNSPECIFIED, DST)).unwrap();
        assert_eq!(probe.op, 1);
        assert!(!arp_conflicts(&probe, DST, ours), "our own probe");
        let their_probe = parse_arp(&build_arp(other, Ipv4Addr::UNSPECIFIED, DST)).unwrap();
        assert!(arp_conflicts(&their_probe, DST, ours));
        let their_announce = parse_arp(&build_arp(other, DST, DST)).unwrap();
        assert!(arp_conflicts(&their_announce, DST, ours));
        let unrelated = parse_arp(&build_arp(other, SRC, SRC)).unwrap();
        assert!(!arp_conflicts(&unrelated, DST, ours));
        assert!(parse_arp(&[0; 10]).is_none());
    }
}
