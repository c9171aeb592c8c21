//! UDP datagrams seen on one interface, as a host on the LAN that can
//! listen on a switch port (a mirrored port, a compromised neighbour)
//! captures them: to replay them later, byte for byte.

use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};

use crate::rig::forward::in_netns;

const ETH_P_IP: u16 = 0x0800;
/// Every protocol: a bridge port's frames reach only `ETH_P_ALL` taps (the
/// bridge takes them before the per-protocol ones).
const ETH_P_ALL: u16 = 0x0003;

/// One captured datagram.
#[derive(Debug, Clone)]
pub struct Datagram {
    pub from: Ipv4Addr,
    pub to: Ipv4Addr,
    pub to_port: u16,
    pub payload: Vec<u8>,
}

/// Captures for `for_` the UDP datagrams to port `port` that pass
/// interface `ifname` of namespace `ns` (either way).
pub fn capture(ns: &str, ifname: &str, port: u16, for_: Duration) -> Result<Vec<Datagram>> {
    let fd = in_netns(ns, || open(ifname))??;
    let mut out = Vec::new();
    let mut buf = vec![0u8; 65536];
    let until = Instant::now() + for_;
    while Instant::now() < until {
        // SAFETY: recvfrom into a live buffer and address of the lengths
        // given.
        let mut sa: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        let mut sa_len = std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
        let n = unsafe {
            libc::recvfrom(
                fd.as_raw_fd(),
                buf.as_mut_ptr() as *mut libc::c_void,
                buf.len(),
                0,
                &mut sa as *mut _ as *mut libc::sockaddr,
                &mut sa_len,
            )
        };
        if n <= 0 || sa.sll_protocol != ETH_P_IP.to_be() {
            continue;
        }
        if let Some(d) = parse(&buf[..n as usize]).filter(|d| d.to_port == port) {
            out.push(d);
        }
    }
    Ok(out)
}

/// An IPv4 packet (no link header: the socket is `SOCK_DGRAM`) carrying
/// UDP, unfragmented.
fn parse(p: &[u8]) -> Option<Datagram> {
    if p.len() < 20 || p[0] >> 4 != 4 || p[9] != 17 {
        return None;
    }
    let ihl = usize::from(p[0] & 0x0f) * 4;
    let total = usize::from(u16::from_be_bytes([p[2], p[3]])).min(p.len());
    let udp = p.get(ihl..total)?;
    if udp.len() < 8 {
        return None;
    }
    let len = usize::from(u16::from_be_bytes([udp[4], udp[5]]));
    Some(Datagram {
        from: Ipv4Addr::new(p[12], p[13], p[14], p[15]),
        to: Ipv4Addr::new(p[16], p[17], p[18], p[19]),
        to_port: u16::from_be_bytes([udp[2], udp[3]]),
        payload: udp.get(8..len.min(udp.len()))?.to_vec(),
    })
}

/// A cooked packet socket on `ifname` for every protocol, with a 10 ms
/// receive timeout.
fn open(ifname: &str) -> Result<OwnedFd> {
    let name = std::ffi::CString::new(ifname)?;
    // SAFETY: plain syscalls on a descriptor owned here; every pointer is
    // to a live, correctly sized local.
    unsafe {
        let ifindex = libc::if_nametoindex(name.as_ptr()) as i32;
        if ifindex == 0 {
            bail!("no interface {ifname}");
        }
        let fd = libc::socket(
            libc::AF_PACKET,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            i32::from(ETH_P_ALL.to_be()),
        );
        if fd < 0 {
            bail!("socket(AF_PACKET): {}", std::io::Error::last_os_error());
        }
        let fd = OwnedFd::from_raw_fd(fd);
        let mut sa: libc::sockaddr_ll = std::mem::zeroed();
        sa.sll_family = libc::AF_PACKET as u16;
        sa.sll_protocol = ETH_P_ALL.to_be();
        sa.sll_ifindex = ifindex;
        if libc::bind(
            fd.as_raw_fd(),
            &sa as *const _ as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_ll>() as u32,
        ) < 0
        {
            bail!("bind: {}", std::io::Error::last_os_error());
        }
        let tv = libc::timeval {
            tv_sec: 0,
            tv_usec: 10_000,
        };
        if libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            &tv as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::timeval>() as u32,
        ) < 0
        {
            bail!("SO_RCVTIMEO: {}", std::io::Error::last_os_error());
        }
        Ok(fd)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_udp_datagram_parses_and_anything_else_does_not() {
        let mut p = vec![0x45, 0, 0, 0, 0, 0, 0, 0, 64, 17, 0, 0];
        p.extend_from_slice(&[10, 77, 0, 11, 10, 77, 0, 12]);
        p.extend_from_slice(&[0x1f, 0x0b, 0x1f, 0x0b, 0, 11, 0, 0]);
        p.extend_from_slice(b"abc");
        let total = p.len() as u16;
        p[2..4].copy_from_slice(&total.to_be_bytes());
        let d = parse(&p).unwrap();
        assert_eq!(d.from, Ipv4Addr::new(10, 77, 0, 11));
        assert_eq!(d.to, Ipv4Addr::new(10, 77, 0, 12));
        assert_eq!(d.to_port, 7947);
        assert_eq!(d.payload, b"abc");
        let mut tcp = p.clone();
        tcp[9] = 6;
        assert!(parse(&tcp).is_none());
        assert!(parse(&p[..15]).is_none());
    }
}
