//! Who answers ARP for an address, asked every few milliseconds from a host
//! on the LAN, as a client would before it sends anything.
//!
//! Every request carries its own sender MAC (a locally administered MAC
//! whose last two bytes are the request's number), so each reply, which
//! Linux sends to the requester's MAC, names the request it answers: two
//! replies to one request are two hosts answering at once, however late
//! they arrive. The socket is in promiscuous mode to see replies to the
//! MACs that are not the interface's own.

use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};

use crate::rig::forward::in_netns;

const ETH_P_ARP: u16 = 0x0806;
/// Requests are `02:68:6e:61:HI:LO` (`hna`, then the number).
const PREFIX: [u8; 4] = [0x02, 0x68, 0x6e, 0x61];

/// One request and the replies to it.
#[derive(Debug, Clone)]
pub struct Probe {
    pub sent: Instant,
    /// When each reply came and the MAC it names for the address.
    pub replies: Vec<(Instant, [u8; 6])>,
}

pub struct ArpProber {
    every: Duration,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<Vec<Probe>>>>,
}

/// What the prober saw.
#[derive(Debug, Clone)]
pub struct ArpRecord {
    pub every: Duration,
    pub probes: Vec<Probe>,
}

impl ArpRecord {
    /// The most replies any one request got (2 or more: two answered).
    pub fn most_answers(&self) -> usize {
        self.probes
            .iter()
            .map(|p| p.replies.len())
            .max()
            .unwrap_or(0)
    }

    /// Requests with two or more replies, by when they were sent.
    pub fn doubly_answered(&self) -> Vec<Instant> {
        self.probes
            .iter()
            .filter(|p| p.replies.len() > 1)
            .map(|p| p.sent)
            .collect()
    }

    /// The longest time without an answered request, from the last one
    /// answered before it to the first one answered after it (nothing
    /// answered at all: the whole record).
    pub fn longest_silence(&self) -> Duration {
        let answered: Vec<Instant> = self
            .probes
            .iter()
            .filter(|p| !p.replies.is_empty())
            .map(|p| p.sent)
            .collect();
        match (self.probes.first(), self.probes.last()) {
            (Some(first), Some(last)) if answered.is_empty() => last.sent - first.sent,
            _ => answered
                .windows(2)
                .map(|w| w[1] - w[0])
                .max()
                .unwrap_or_default(),
        }
    }
}

impl ArpProber {
    /// Starts asking who has `target` every `every`, from interface `ifname`
    /// (with address `source`) in namespace `ns`, and returns once the
    /// first answer came (an error after 5 s without one: the record must
    /// begin with the address answered).
    pub fn start(
        ns: &str,
        ifname: &str,
        source: Ipv4Addr,
        target: Ipv4Addr,
        every: Duration,
    ) -> Result<ArpProber> {
        let (fd, ifindex) = in_netns(ns, || open(ifname))??;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let (answered_tx, answered) = std::sync::mpsc::channel();
        let thread =
            std::thread::spawn(move || run(fd, ifindex, source, target, every, &flag, answered_tx));
        if answered.recv_timeout(Duration::from_secs(5)).is_err() {
            stop.store(true, Ordering::SeqCst);
            let _ = thread.join();
            bail!("nobody answered ARP for {target} within 5 s");
        }
        Ok(ArpProber {
            every,
            stop,
            thread: Some(thread),
        })
    }

    /// Stops and returns what was seen.
    pub fn finish(mut self) -> Result<ArpRecord> {
        self.stop.store(true, Ordering::SeqCst);
        let probes = self
            .thread
            .take()
            .expect("running")
            .join()
            .map_err(|_| anyhow::anyhow!("the ARP prober panicked"))??;
        Ok(ArpRecord {
            every: self.every,
            probes,
        })
    }
}

impl Drop for ArpProber {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Sends one broadcast ARP announcement of `addr` (sender and target) from
/// interface `ifname` in namespace `ns`, with `mac` as the frame's source
/// and the ARP sender: what a VM resumed from a long pause sends for an
/// address (and MAC) it still held, from its own port of the LAN.
pub fn announce_as(ns: &str, ifname: &str, mac: [u8; 6], addr: Ipv4Addr) -> Result<()> {
    let (fd, ifindex) = in_netns(ns, || open(ifname))??;
    send(&fd, ifindex, &arp_request(mac, addr, addr))
}

/// Sends a whole Ethernet `frame` (broadcast) on `ifindex`.
fn send(fd: &OwnedFd, ifindex: i32, frame: &[u8]) -> Result<()> {
    let mut sa = link_addr(ifindex);
    sa.sll_halen = 6;
    sa.sll_addr[..6].copy_from_slice(&[0xff; 6]);
    // SAFETY: sendto on our socket with a live buffer and address.
    let r = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            frame.as_ptr() as *const libc::c_void,
            frame.len(),
            0,
            &sa as *const _ as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_ll>() as u32,
        )
    };
    cvt(r as i32, "sendto").map(|_| ())
}

fn cvt(r: libc::c_int, what: &str) -> Result<libc::c_int> {
    if r < 0 {
        bail!("{what}: {}", std::io::Error::last_os_error());
    }
    Ok(r)
}

/// A raw ARP packet socket on `ifname`, promiscuous, with a receive
/// timeout of 1 ms (the send loop's tick).
fn open(ifname: &str) -> Result<(OwnedFd, i32)> {
    let name = std::ffi::CString::new(ifname)?;
    // SAFETY: plain syscalls on a descriptor owned here; every pointer is
    // to a live, correctly sized local.
    unsafe {
        let ifindex = libc::if_nametoindex(name.as_ptr()) as i32;
        if ifindex == 0 {
            bail!("no interface {ifname}");
        }
        let fd = cvt(
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                (ETH_P_ARP.to_be()) as i32,
            ),
            "socket(AF_PACKET)",
        )?;
        let fd = OwnedFd::from_raw_fd(fd);
        let sa = link_addr(ifindex);
        cvt(
            libc::bind(
                fd.as_raw_fd(),
                &sa as *const _ as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            ),
            "bind",
        )?;
        let mut mr: libc::packet_mreq = std::mem::zeroed();
        mr.mr_ifindex = ifindex;
        mr.mr_type = libc::PACKET_MR_PROMISC as u16;
        set_option(
            &fd,
            libc::SOL_PACKET,
            libc::PACKET_ADD_MEMBERSHIP,
            &mr,
            "PACKET_ADD_MEMBERSHIP",
        )?;
        let tv = libc::timeval {
            tv_sec: 0,
            tv_usec: 1000,
        };
        set_option(&fd, libc::SOL_SOCKET, libc::SO_RCVTIMEO, &tv, "SO_RCVTIMEO")?;
        Ok((fd, ifindex))
    }
}

/// The link-layer address of `ifindex` for ARP (no hardware address).
fn link_addr(ifindex: i32) -> libc::sockaddr_ll {
    // SAFETY: sockaddr_ll is plain data; all-zero is a valid value.
    let mut sa: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sa.sll_family = libc::AF_PACKET as u16;
    sa.sll_protocol = ETH_P_ARP.to_be();
    sa.sll_ifindex = ifindex;
    sa
}

/// `setsockopt` with a plain-data `value`.
fn set_option<T>(fd: &OwnedFd, level: i32, name: i32, value: &T, what: &str) -> Result<()> {
    // SAFETY: `value` is a live `T` and the length passed is its size.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            value as *const T as *const libc::c_void,
            std::mem::size_of::<T>() as u32,
        )
    };
    cvt(r, what).map(|_| ())
}

fn request(seq: u16, source: Ipv4Addr, target: Ipv4Addr) -> Vec<u8> {
    arp_request(mac_of(seq), source, target)
}

/// A broadcast ARP request from `mac` (the frame's source and the ARP
/// sender) with `source` as the sender's address, for `target`.
fn arp_request(mac: [u8; 6], source: Ipv4Addr, target: Ipv4Addr) -> Vec<u8> {
    let mut f = Vec::with_capacity(42);
    f.extend_from_slice(&[0xff; 6]);
    f.extend_from_slice(&mac);
    f.extend_from_slice(&ETH_P_ARP.to_be_bytes());
    f.extend_from_slice(&[0, 1, 8, 0, 6, 4, 0, 1]);
    f.extend_from_slice(&mac);
    f.extend_from_slice(&source.octets());
    f.extend_from_slice(&[0; 6]);
    f.extend_from_slice(&target.octets());
    f
}

fn mac_of(seq: u16) -> [u8; 6] {
    let [hi, lo] = seq.to_be_bytes();
    [PREFIX[0], PREFIX[1], PREFIX[2], PREFIX[3], hi, lo]
}

/// A reply for `target` to one of our requests: its number and the MAC it
/// gives for the address.
fn reply(frame: &[u8], target: Ipv4Addr) -> Option<(u16, [u8; 6])> {
    if frame.len() < 42 || frame[12..14] != ETH_P_ARP.to_be_bytes() {
        return None;
    }
    let arp = &frame[14..];
    if arp[..8] != [0, 1, 8, 0, 6, 4, 0, 2] || arp[14..18] != target.octets() {
        return None;
    }
    let to = &arp[18..24];
    if to[..4] != PREFIX {
        return None;
    }
    let seq = u16::from_be_bytes([to[4], to[5]]);
    Some((seq, arp[8..14].try_into().ok()?))
}

fn run(
    fd: OwnedFd,
    ifindex: i32,
    source: Ipv4Addr,
    target: Ipv4Addr,
    every: Duration,
    stop: &AtomicBool,
    first_answer: std::sync::mpsc::Sender<()>,
) -> Result<Vec<Probe>> {
    let mut first_answer = Some(first_answer);
    let mut probes: Vec<Probe> = Vec::new();
    let mut next = Instant::now();
    let mut buf = [0u8; 256];
    while !stop.load(Ordering::SeqCst) {
        if Instant::now() >= next {
            let seq = probes.len() as u16;
            let frame = request(seq, source, target);
            send(&fd, ifindex, &frame)?;
            probes.push(Probe {
                sent: Instant::now(),
                replies: Vec::new(),
            });
            next += every;
        }
        // SAFETY: recv into a live buffer of the given size.
        let n = unsafe {
            libc::recv(
                fd.as_raw_fd(),
                buf.as_mut_ptr() as *mut libc::c_void,
                buf.len(),
                0,
            )
        };
        if n <= 0 {
            continue; // the 1 ms timeout, or EINTR
        }
        let at = Instant::now();
        if let Some((seq, mac)) = reply(&buf[..n as usize], target) {
            // The number wraps after 65536 requests (11 minutes at 10 ms):
            // the newest request with that number.
            if let Some(last) = probes.len().checked_sub(1) {
                let back = (last as u16).wrapping_sub(seq) as usize;
                if back <= last {
                    probes[last - back].replies.push((at, mac));
                    if let Some(tx) = first_answer.take() {
                        let _ = tx.send(());
                    }
                }
            }
        }
    }
    Ok(probes)
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 150);

    #[test]
    fn a_reply_names_its_request() {
        let req = request(0x0102, Ipv4Addr::new(10, 77, 0, 200), T);
        // The reply a host sends: swap, op 2, its MAC as sender.
        let holder = [0x02, 0x11, 0x22, 0x33, 0x44, 0x55];
        let mut rep = Vec::new();
        rep.extend_from_slice(&req[6..12]);
        rep.extend_from_slice(&holder);
        rep.extend_from_slice(&ETH_P_ARP.to_be_bytes());
        rep.extend_from_slice(&[0, 1, 8, 0, 6, 4, 0, 2]);
        rep.extend_from_slice(&holder);
        rep.extend_from_slice(&T.octets());
        rep.extend_from_slice(&req[22..28]);
        rep.extend_from_slice(&[10, 77, 0, 200]);
        assert_eq!(reply(&rep, T), Some((0x0102, holder)));
        assert_eq!(reply(&rep, Ipv4Addr::new(10, 77, 0, 151)), None);
        assert_eq!(reply(&req, T), None, "a request is no reply");
    }
}
