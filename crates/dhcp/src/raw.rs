//! The packet socket's few syscalls that more than one module needs:
//! the link-layer address of a frame, sending one frame on an interface
//! and receiving one with its sender's address. [`super::io`] (the
//! leases' sockets) and [`super::presence`] (the presence frames and the
//! LAN watch) build on them.

use std::io;
use std::mem::{size_of, zeroed};
use std::os::fd::{AsRawFd, OwnedFd};

pub(crate) const ETH_P_IP: u16 = 0x0800;
pub(crate) const ETH_P_ARP: u16 = 0x0806;
pub(crate) const BROADCAST_MAC: [u8; 6] = [0xff; 6];

pub(crate) fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

pub(crate) fn ll_addr(ifindex: u32, protocol: u16, mac: [u8; 6]) -> libc::sockaddr_ll {
    // SAFETY: sockaddr_ll is plain old data; all-zero is a valid value.
    let mut sa: libc::sockaddr_ll = unsafe { zeroed() };
    sa.sll_family = libc::AF_PACKET as u16;
    sa.sll_protocol = protocol.to_be();
    sa.sll_ifindex = ifindex as i32;
    sa.sll_halen = 6;
    sa.sll_addr[..6].copy_from_slice(&mac);
    sa
}

pub(crate) fn send_to(
    fd: &OwnedFd,
    ifindex: u32,
    protocol: u16,
    mac: [u8; 6],
    data: &[u8],
) -> io::Result<()> {
    let sa = ll_addr(ifindex, protocol, mac);
    // SAFETY: sendto from a live buffer with its length and a valid
    // sockaddr_ll.
    let n = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            data.as_ptr() as *const libc::c_void,
            data.len(),
            0,
            &sa as *const _ as *const libc::sockaddr,
            size_of::<libc::sockaddr_ll>() as u32,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n as usize != data.len() {
        return Err(io::Error::other(format!(
            "short send: {n} of {} bytes",
            data.len()
        )));
    }
    Ok(())
}

/// One received datagram: length, sender link address, packet type, and
/// whether the checksum may be verified.
pub(crate) struct Datagram {
    pub(crate) len: usize,
    pub(crate) src_mac: [u8; 6],
    pub(crate) pkttype: u8,
    pub(crate) csum_ready: bool,
}

pub(crate) fn recv_datagram(fd: &OwnedFd, buf: &mut [u8]) -> io::Result<Datagram> {
    // SAFETY: recvmsg into live buffers whose sizes are passed along; the
    // control messages are read only within msg_controllen.
    unsafe {
        let mut sa: libc::sockaddr_ll = zeroed();
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr() as *mut libc::c_void,
            iov_len: buf.len(),
        };
        let mut cbuf = [0u64; 16];
        let mut msg: libc::msghdr = zeroed();
        msg.msg_name = &mut sa as *mut _ as *mut libc::c_void;
        msg.msg_namelen = size_of::<libc::sockaddr_ll>() as u32;
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = size_of::<[u64; 16]>();
        let n = libc::recvmsg(fd.as_raw_fd(), &mut msg, libc::MSG_TRUNC);
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut csum_ready = true;
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_PACKET && (*c).cmsg_type == libc::PACKET_AUXDATA {
                let aux =
                    std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const libc::tpacket_auxdata);
                if aux.tp_status & libc::TP_STATUS_CSUMNOTREADY != 0 {
                    csum_ready = false;
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
        let mut src_mac = [0u8; 6];
        src_mac.copy_from_slice(&sa.sll_addr[..6]);
        Ok(Datagram {
            len: n as usize,
            src_mac,
            pkttype: sa.sll_pkttype,
            csum_ready,
        })
    }
}
