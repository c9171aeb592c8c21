//! The packet socket's few syscalls that more than one module needs:
//! the link-layer address of a frame and sending one frame on an
//! interface. [`super::io`] (the leases' sockets) and [`super::presence`]
//! (the presence frames' thread) build on them.

use std::io;
use std::mem::{size_of, zeroed};
use std::os::fd::{AsRawFd, OwnedFd};

pub(crate) const ETH_P_IP: u16 = 0x0800;
pub(crate) const ETH_P_ARP: u16 = 0x0806;

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
