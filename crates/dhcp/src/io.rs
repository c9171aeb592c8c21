//! The packet edge: [`Transport`] (what the driver needs) and [`AfPacket`],
//! its implementation over Linux packet sockets on the lease's macvlan.
//!
//! Why packet sockets for everything, including unicast renew and release:
//! binding UDP port 68 collides with the node's own DHCP client (wicked,
//! dhclient, dhcpcd, systemd-networkd), which is what broke renewals for
//! kube-vip. A `SOCK_DGRAM` packet socket bound to one interface with a
//! classic BPF filter (UDP, not a fragment, destination port 68) sees only
//! DHCP traffic of that interface and takes no port from anyone.

use std::future::Future;
use std::io;
use std::mem::size_of;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::time::Instant;

use super::frame::{self, FrameError};
use super::machine::Destination;

use super::raw::{BROADCAST_MAC, ETH_P_ARP, ETH_P_IP, cvt, ll_addr, recv_datagram, send_to};

/// A DHCP payload received on the interface, with the source MAC of its
/// frame (the server or the relay toward it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inbound {
    pub(crate) payload: Vec<u8>,
    pub(crate) src_mac: [u8; 6],
}

#[derive(Debug, thiserror::Error)]
pub enum RecvError {
    /// A frame that is not a well-formed DHCP datagram to us: count it.
    #[error("malformed frame: {0}")]
    Frame(#[from] FrameError),
    #[error("receive failed: {0}")]
    Io(#[from] io::Error),
}

/// RFC 5227 probe timing. RFC 5227's own numbers (3 probes 1–2 s apart,
/// then 2 s) are meant for hosts joining a link; a LoadBalancer address
/// that the DHCP server just handed out only needs to catch a host that
/// squats on it, so the defaults are shorter. Tunable per lease.
#[derive(Debug, Clone, Copy)]
pub struct ProbeConfig {
    pub probes: u32,
    pub interval: Duration,
    /// Listening time after the last probe.
    pub wait: Duration,
    /// Second gratuitous ARP this long after the first (RFC 5227
    /// ANNOUNCE_NUM 2).
    pub announce_interval: Duration,
}

impl Default for ProbeConfig {
    fn default() -> Self {
        ProbeConfig {
            probes: 2,
            interval: Duration::from_millis(100),
            wait: Duration::from_millis(200),
            announce_interval: Duration::from_secs(2),
        }
    }
}

/// What the driver needs from the network. Implemented by [`AfPacket`]
/// and by in-memory fakes in tests.
pub trait Transport: Send + Sync + 'static {
    /// Sends a DHCP payload from UDP port 68 to port 67.
    fn send(
        &self,
        payload: &[u8],
        src: Ipv4Addr,
        dst: Destination,
    ) -> impl Future<Output = io::Result<()>> + Send;
    /// The next DHCP datagram for us. Must be cancel-safe: the driver
    /// selects on it.
    fn recv(&self) -> impl Future<Output = Result<Inbound, RecvError>> + Send;
    /// RFC 5227 probe; `true` when another host uses `addr`.
    fn arp_probe(&self, addr: Ipv4Addr) -> impl Future<Output = io::Result<bool>> + Send;
    /// An ordinary ARP request for `addr` from `sender` (this host's own
    /// address on the link), with the probe's timing: `true` when `addr`
    /// answers. Asks whether the LAN can be heard at all (its gateway),
    /// which some routers do not answer an RFC 5227 probe for.
    fn arp_ask(
        &self,
        addr: Ipv4Addr,
        sender: Ipv4Addr,
    ) -> impl Future<Output = io::Result<bool>> + Send {
        let _ = sender;
        self.arp_probe(addr)
    }
    /// Gratuitous ARP (announcement) for `addr`: one now and, as RFC 5227
    /// has it, one more `announce_interval` later.
    fn arp_announce(&self, addr: Ipv4Addr) -> impl Future<Output = io::Result<()>> + Send;
    /// One gratuitous ARP for `addr`, nothing after it (the repeats after
    /// a takeover, `driver::REANNOUNCE_EVERY`).
    fn arp_announce_once(&self, addr: Ipv4Addr) -> impl Future<Output = io::Result<()>> + Send {
        self.arp_announce(addr)
    }
    /// Tells the transport the address the lease holds on the link now
    /// (`None`: none), and so what keeps the lease's MAC in place on the
    /// LAN meanwhile (`crate::presence`, threads of their own): its
    /// presence frames, when asked for, and the LAN watch, which answers
    /// another port's frames from the lease's MAC. Fakes do neither.
    fn set_held(&self, held: Option<HeldAddress>) -> io::Result<()> {
        let _ = held;
        Ok(())
    }
}

/// The address a lease holds on its link, as [`Transport::set_held`] is
/// told it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeldAddress {
    pub(crate) address: Ipv4Addr,
    /// The MAC its DHCP server (or relay) answered from.
    pub(crate) server_mac: [u8; 6],
    /// How often a presence frame goes from the lease's MAC to
    /// `server_mac`: an ARP announcement of `address`, which crosses the
    /// LAN's switches toward a host beyond them, so that they keep the
    /// MAC's port current, and which nobody answers (`Driver::presence`
    /// says why). `None`: no presence frames.
    pub(crate) presence_every: Option<Duration>,
}

/// Packet sockets on one interface.
pub struct AfPacket {
    ifindex: u32,
    mac: [u8; 6],
    /// The interface's lower device (a macvlan's parent): where the LAN
    /// watch listens. `None`: no LAN watch (the uplink's own sockets).
    uplink: Option<u32>,
    probe: ProbeConfig,
    ip: PacketFd,
    /// This lease's entries with the presence threads while it holds an
    /// address: its presence frames and its LAN watch.
    held: std::sync::Mutex<Vec<crate::presence::Registration>>,
}

/// An AF_PACKET socket registered with the runtime. Closing one makes the
/// kernel wait for an RCU grace period (`packet_release` calls
/// `synchronize_net`): milliseconds during which a runtime thread would
/// stall every other lease, which turned a hundred ARP probes ending
/// together into a second of queueing. The close happens on the blocking
/// pool instead.
struct PacketFd(Option<AsyncFd<OwnedFd>>);

impl std::ops::Deref for PacketFd {
    type Target = AsyncFd<OwnedFd>;
    fn deref(&self) -> &AsyncFd<OwnedFd> {
        self.0.as_ref().expect("open until dropped")
    }
}

impl Drop for PacketFd {
    fn drop(&mut self) {
        if let Some(fd) = self.0.take() {
            let fd = fd.into_inner();
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => {
                    rt.spawn_blocking(move || drop(fd));
                }
                Err(_) => drop(fd),
            }
        }
    }
}

/// A non-blocking `SOCK_DGRAM` packet socket bound to `ifindex` for
/// `protocol`, with `filter` attached before the bind so nothing
/// unfiltered is ever queued.
fn packet_socket(
    ifindex: u32,
    protocol: u16,
    filter: Option<&[libc::sock_filter]>,
) -> io::Result<PacketFd> {
    // SAFETY: plain syscalls on a descriptor this function owns; every
    // pointer passed points to a live, correctly sized local.
    unsafe {
        let fd = cvt(libc::socket(
            libc::AF_PACKET,
            libc::SOCK_DGRAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        ))?;
        let fd = OwnedFd::from_raw_fd(fd);
        if let Some(f) = filter {
            let prog = libc::sock_fprog {
                len: f.len() as u16,
                filter: f.as_ptr() as *mut libc::sock_filter,
            };
            cvt(libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_ATTACH_FILTER,
                &prog as *const _ as *const libc::c_void,
                size_of::<libc::sock_fprog>() as u32,
            ))?;
        }
        let one: libc::c_int = 1;
        cvt(libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_PACKET,
            libc::PACKET_AUXDATA,
            &one as *const _ as *const libc::c_void,
            size_of::<libc::c_int>() as u32,
        ))?;
        let sa = ll_addr(ifindex, protocol, [0; 6]);
        cvt(libc::bind(
            fd.as_raw_fd(),
            &sa as *const _ as *const libc::sockaddr,
            size_of::<libc::sockaddr_ll>() as u32,
        ))?;
        // SAFETY (register): the OwnedFd stays open and unchanged for as
        // long as the AsyncFd owns it.
        AsyncFd::register(fd)
            .map(|fd| PacketFd(Some(fd)))
            .map_err(|e| e.into_parts().1)
    }
}

/// Classic BPF: IPv4 UDP, not a fragment, destination port 68. Offsets are
/// from the IP header (SOCK_DGRAM).
fn dhcp_filter() -> [libc::sock_filter; 9] {
    let s = |code: u32, jt: u8, jf: u8, k: u32| libc::sock_filter {
        code: code as u16,
        jt,
        jf,
        k,
    };
    use libc::{
        BPF_ABS, BPF_B, BPF_H, BPF_IND, BPF_JEQ, BPF_JMP, BPF_JSET, BPF_K, BPF_LD, BPF_LDX,
        BPF_MSH, BPF_RET,
    };
    [
        s(BPF_LD | BPF_B | BPF_ABS, 0, 0, 9),        // protocol
        s(BPF_JMP | BPF_JEQ | BPF_K, 0, 6, 17),      // UDP?
        s(BPF_LD | BPF_H | BPF_ABS, 0, 0, 6),        // flags/fragment
        s(BPF_JMP | BPF_JSET | BPF_K, 4, 0, 0x1fff), // fragment offset
        s(BPF_LDX | BPF_B | BPF_MSH, 0, 0, 0),       // X = IHL*4
        s(BPF_LD | BPF_H | BPF_IND, 0, 0, 2),        // UDP dst port
        s(BPF_JMP | BPF_JEQ | BPF_K, 0, 1, 68),
        s(BPF_RET | BPF_K, 0, 0, 0xffff),
        s(BPF_RET | BPF_K, 0, 0, 0),
    ]
}

/// Classic BPF for ARP (SOCK_DGRAM: offsets from the ARP header): accept
/// when the sender (offset 14) or target (offset 24) protocol address is
/// `addr`, the only frames [`frame::arp_conflicts`] can act on.
fn arp_filter(addr: Ipv4Addr) -> [libc::sock_filter; 6] {
    let s = |code: u32, jt: u8, jf: u8, k: u32| libc::sock_filter {
        code: code as u16,
        jt,
        jf,
        k,
    };
    use libc::{BPF_ABS, BPF_JEQ, BPF_JMP, BPF_K, BPF_LD, BPF_RET, BPF_W};
    let a = u32::from(addr);
    [
        s(BPF_LD | BPF_W | BPF_ABS, 0, 0, 14), // sender protocol address
        s(BPF_JMP | BPF_JEQ | BPF_K, 2, 0, a), // ours? accept
        s(BPF_LD | BPF_W | BPF_ABS, 0, 0, 24), // target protocol address
        s(BPF_JMP | BPF_JEQ | BPF_K, 0, 1, a),
        s(BPF_RET | BPF_K, 0, 0, 0xffff),
        s(BPF_RET | BPF_K, 0, 0, 0),
    ]
}

async fn send_async(
    fd: &AsyncFd<OwnedFd>,
    ifindex: u32,
    protocol: u16,
    mac: [u8; 6],
    data: &[u8],
) -> io::Result<()> {
    loop {
        let mut guard = fd.writable().await?;
        match guard.try_io(|inner| send_to(inner.get_ref(), ifindex, protocol, mac, data)) {
            Ok(r) => return r,
            Err(_would_block) => continue,
        }
    }
}

impl AfPacket {
    /// Opens the DHCP socket on `ifindex` (the lease's macvlan, whose MAC
    /// is `mac`), whose lower device is `uplink` (`None` for a socket on
    /// the uplink itself). Needs CAP_NET_RAW.
    pub(crate) fn open(
        ifindex: u32,
        uplink: Option<u32>,
        mac: [u8; 6],
        probe: ProbeConfig,
    ) -> io::Result<AfPacket> {
        let ip = packet_socket(ifindex, ETH_P_IP, Some(&dhcp_filter()))?;
        Ok(AfPacket {
            ifindex,
            mac,
            uplink,
            probe,
            ip,
            held: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// An ARP socket that sees only frames naming `addr` as sender or
    /// target: with a hundred siblings probing on one parent, an
    /// unfiltered socket per lease would wake for every sibling's ARP.
    fn arp_socket(&self, addr: Ipv4Addr) -> io::Result<PacketFd> {
        packet_socket(self.ifindex, ETH_P_ARP, Some(&arp_filter(addr)))
    }

    /// A socket for sending ARP that receives nothing (protocol 0).
    fn arp_sender(&self) -> io::Result<PacketFd> {
        packet_socket(self.ifindex, 0, None)
    }
}

impl Transport for AfPacket {
    async fn send(&self, payload: &[u8], src: Ipv4Addr, dst: Destination) -> io::Result<()> {
        let (ip, mac) = match dst {
            Destination::Broadcast => (Ipv4Addr::BROADCAST, BROADCAST_MAC),
            Destination::Unicast { ip, mac } => (ip, mac),
        };
        let pkt = frame::build_udp(src, ip, payload);
        send_async(&self.ip, self.ifindex, ETH_P_IP, mac, &pkt).await
    }

    async fn recv(&self) -> Result<Inbound, RecvError> {
        let mut buf = vec![0u8; 9216];
        loop {
            let mut guard = self.ip.readable().await?;
            let d = match guard.try_io(|inner| recv_datagram(inner.get_ref(), &mut buf)) {
                Ok(r) => r?,
                Err(_would_block) => continue,
            };
            if d.pkttype == libc::PACKET_OUTGOING {
                continue; // our own transmission, looped back to packet sockets
            }
            if d.len > buf.len() {
                return Err(FrameError::Truncated(d.len).into());
            }
            match frame::parse_udp(&buf[..d.len], d.csum_ready) {
                Ok(payload) => {
                    return Ok(Inbound {
                        payload: payload.to_vec(),
                        src_mac: d.src_mac,
                    });
                }
                Err(FrameError::NotDhcp) => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }

    async fn arp_probe(&self, addr: Ipv4Addr) -> io::Result<bool> {
        self.arp_ask(addr, Ipv4Addr::UNSPECIFIED).await
    }

    async fn arp_ask(&self, addr: Ipv4Addr, sender: Ipv4Addr) -> io::Result<bool> {
        let sock = self.arp_socket(addr)?;
        let probe = frame::build_arp(self.mac, sender, addr);
        let mut buf = [0u8; 128];
        let mut next_probe = Instant::now();
        let mut sent = 0;
        let mut end = Instant::now() + self.probe.wait;
        loop {
            if sent < self.probe.probes && Instant::now() >= next_probe {
                send_async(&sock, self.ifindex, ETH_P_ARP, BROADCAST_MAC, &probe).await?;
                sent += 1;
                next_probe += self.probe.interval;
                end = if sent == self.probe.probes {
                    Instant::now() + self.probe.wait
                } else {
                    next_probe
                };
            }
            if sent >= self.probe.probes && Instant::now() >= end {
                return Ok(false);
            }
            let wake = if sent < self.probe.probes {
                next_probe
            } else {
                end
            };
            tokio::select! {
                _ = tokio::time::sleep_until(wake) => {}
                r = sock.readable() => {
                    let mut guard = r?;
                    if let Ok(r) = guard.try_io(|inner| recv_datagram(inner.get_ref(), &mut buf)) {
                        let d = r?;
                        if d.pkttype != libc::PACKET_OUTGOING
                            && let Some(arp) = frame::parse_arp(&buf[..d.len.min(buf.len())])
                            && frame::arp_conflicts(&arp, addr, self.mac)
                        {
                            return Ok(true);
                        }
                    }
                }
            }
        }
    }

    async fn arp_announce_once(&self, addr: Ipv4Addr) -> io::Result<()> {
        let sock = self.arp_sender()?;
        let ann = frame::build_arp(self.mac, addr, addr);
        send_async(&sock, self.ifindex, ETH_P_ARP, BROADCAST_MAC, &ann).await
    }

    fn set_held(&self, held: Option<HeldAddress>) -> io::Result<()> {
        let mut registrations = Vec::new();
        if let Some(h) = held {
            let announcement = frame::build_arp(self.mac, h.address, h.address);
            if let Some(every) = h.presence_every {
                registrations.push(crate::presence::register(
                    self.ifindex,
                    h.server_mac,
                    announcement.clone(),
                    every,
                )?);
            }
            if let Some(uplink) = self.uplink {
                registrations.push(crate::presence::watch(
                    uplink,
                    self.mac,
                    self.ifindex,
                    announcement,
                )?);
            }
        }
        // The entries replaced (or ended) are removed as their
        // registrations drop.
        *self
            .held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = registrations;
        Ok(())
    }

    async fn arp_announce(&self, addr: Ipv4Addr) -> io::Result<()> {
        let sock = self.arp_sender()?;
        let ann = frame::build_arp(self.mac, addr, addr);
        send_async(&sock, self.ifindex, ETH_P_ARP, BROADCAST_MAC, &ann).await?;
        let (ifindex, interval) = (self.ifindex, self.probe.announce_interval);
        tokio::spawn(async move {
            tokio::time::sleep(interval).await;
            let _ = send_async(&sock, ifindex, ETH_P_ARP, BROADCAST_MAC, &ann).await;
        });
        Ok(())
    }
}
