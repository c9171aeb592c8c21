//! Data-plane edge: the lease's macvlan and its address, over rtnetlink,
//! behind [`AddressConfig`] (what the driver does) and [`Links`] (what the
//! engine does) so both can be tested without root.

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr};

use futures::TryStreamExt;
use rtnetlink::packet_route::address::{AddressAttribute, AddressFlags, CacheInfo};
use rtnetlink::packet_route::link::{
    AfSpecInet, AfSpecUnspec, InetDevConf, InfoKind, LinkAttribute, LinkInfo as NlLinkInfo,
    LinkMessage, MacVlanMode,
};
use rtnetlink::{Handle, LinkMacVlan, LinkUnspec};

use super::io::{AfPacket, ProbeConfig, Transport};

/// Prefix length the LB address is configured with. A /32 adds no subnet
/// route through the `vip-*` interface, so node traffic to the subnet keeps
/// using the node's own uplink, and CNIs that pick "the interface with a
/// route to X" (Calico's VTEP, harvester #10784) are not misled.
pub(crate) const VIP_PREFIX_LEN: u8 = 32;

/// Per-interface IPv4 settings (`net.ipv4.conf.<if>.*`), set over
/// rtnetlink (`RTM_SETLINK`, `IFLA_AF_SPEC`/`AF_INET`/`IFLA_INET_CONF`)
/// rather than `/proc/sys`, which the unit keeps read-only
/// (`ProtectKernelTunables`). `None` leaves a setting as it is; a value of
/// 0 cannot be set this way (the crate's request form skips zeros), and
/// none of ours is 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Ipv4Conf {
    pub(crate) rp_filter: Option<u32>,
    pub(crate) arp_ignore: Option<u32>,
    pub(crate) arp_announce: Option<u32>,
}

impl Ipv4Conf {
    /// The uplink a LoadBalancer macvlan sits on: answer ARP only for
    /// addresses configured on the interface the request came in on
    /// (`arp_ignore=1`), so the uplink does not answer for a VIP with its
    /// own MAC (Linux is a weak host and otherwise would), and use the
    /// outgoing interface's own address as the ARP source
    /// (`arp_announce=2`), never a VIP.
    pub(crate) const UPLINK: Ipv4Conf = Ipv4Conf {
        rp_filter: None,
        arp_ignore: Some(1),
        arp_announce: Some(2),
    };

    /// A LoadBalancer macvlan: the same ARP rules from its side (it hears
    /// the uplink's broadcast ARP and must not answer for the node's own
    /// address with the VIP's MAC), and loose reverse-path filtering
    /// (`rp_filter=2`): the VIP is a /32 without a route, so the route back
    /// to any client leaves through the uplink, and strict filtering
    /// (`rp_filter=1`, the default of many distributions) would drop every
    /// packet that arrives for the VIP on the macvlan.
    pub(crate) const VIP_LINK: Ipv4Conf = Ipv4Conf {
        rp_filter: Some(2),
        arp_ignore: Some(1),
        arp_announce: Some(2),
    };

    fn request(self) -> InetDevConf {
        let mut c = InetDevConf::default();
        let v = |x: Option<u32>| x.map_or(0, |x| x as i32);
        c.rp_filter = v(self.rp_filter);
        c.arp_ignore = v(self.arp_ignore);
        c.arp_announce = v(self.arp_announce);
        c
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("netlink socket: {0}")]
    Connect(std::io::Error),
    #[error("interface {0} not found")]
    NotFound(String),
    #[error("{what} {name}: {reason}")]
    Netlink {
        what: &'static str,
        name: String,
        reason: String,
    },
}

/// Turns a netlink error into the errno text (`Operation not supported`
/// is what a missing macvlan module looks like).
fn reason(e: &rtnetlink::Error) -> String {
    match e {
        rtnetlink::Error::NetlinkError(m) if m.raw_code() != 0 => {
            std::io::Error::from_raw_os_error(-m.raw_code()).to_string()
        }
        other => other.to_string(),
    }
}

fn errno(e: &rtnetlink::Error) -> i32 {
    match e {
        rtnetlink::Error::NetlinkError(m) => -m.raw_code(),
        _ => 0,
    }
}

/// What the driver does to the interface.
pub trait AddressConfig: Send + Sync + 'static {
    /// Configures `addr`; with `lifetime` (whole seconds, at least 1) the
    /// kernel deletes it by itself once that long has passed without a
    /// [`refresh`](AddressConfig::refresh). An address already there is
    /// given the new lifetime.
    fn add(
        &self,
        addr: Ipv4Addr,
        lifetime: Option<u32>,
    ) -> impl Future<Output = Result<(), LinkError>> + Send;
    /// Gives `addr` `lifetime` seconds again if it is still configured and
    /// has not run out: `Ok(false)` when the kernel already deleted it (or
    /// someone else did), which is never undone here.
    fn refresh(
        &self,
        addr: Ipv4Addr,
        lifetime: u32,
    ) -> impl Future<Output = Result<bool, LinkError>> + Send;
    fn remove(&self, addr: Ipv4Addr) -> impl Future<Output = Result<(), LinkError>> + Send;
}

/// What the engine does to the kernel for a lease: the macvlan, the packet
/// socket on it and its address configuration. A trait (the way youki hides
/// syscalls) so the lease table's logic, its races and its clean-up, is
/// tested without root; [`Netlink`] is the real one.
pub trait Links: Clone + Send + Sync + 'static {
    type Transport: Transport;
    type Addrs: AddressConfig;

    /// Link `name`, or `None` when there is none.
    fn link(&self, name: &str) -> impl Future<Output = Result<Option<LinkInfo>, LinkError>> + Send;
    /// Every link in the namespace.
    fn links(&self) -> impl Future<Output = Result<Vec<LinkInfo>, LinkError>> + Send;
    /// See `Netlink::ensure_macvlan`.
    fn ensure_macvlan(
        &self,
        name: &str,
        parent: &str,
        mac: [u8; 6],
        conf: Option<Ipv4Conf>,
    ) -> impl Future<Output = Result<Ensured, LinkError>> + Send;
    /// Deletes link `name`; a missing link is not an error.
    fn delete(&self, name: &str) -> impl Future<Output = Result<(), LinkError>> + Send;
    /// The IPv4 addresses on interface `index`.
    fn addresses(
        &self,
        index: u32,
    ) -> impl Future<Output = Result<Vec<Ipv4Addr>, LinkError>> + Send;
    /// See `Netlink::set_ipv4_conf`.
    fn set_ipv4_conf(
        &self,
        name: &str,
        conf: Ipv4Conf,
    ) -> impl Future<Output = Result<(), LinkError>> + Send;
    /// The lease's packet sockets on interface `index`, whose lower device
    /// is `uplink` (`None`: the uplink's own, or unknown).
    fn open(
        &self,
        index: u32,
        uplink: Option<u32>,
        mac: [u8; 6],
        probe: ProbeConfig,
    ) -> std::io::Result<Self::Transport>;
    /// The lease's address configuration on interface `name`/`index`.
    fn addrs(&self, name: &str, index: u32) -> Self::Addrs;
    /// See `silent_after_migration`; fakes have no such NIC.
    fn silent_after_migration(&self, parent: &str) -> bool {
        let _ = parent;
        false
    }
}

/// How `Netlink::ensure_macvlan` came by the link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ensured {
    /// Made by this call (possibly replacing a link that did not fit):
    /// whoever asked must delete it if it then cannot use it.
    Created { index: u32 },
    /// A fitting link was already there and is used as it is: not this
    /// call's to delete.
    Reused { index: u32 },
}

impl Ensured {
    pub(crate) fn index(self) -> u32 {
        match self {
            Ensured::Created { index } | Ensured::Reused { index } => index,
        }
    }

    pub(crate) fn created(self) -> bool {
        matches!(self, Ensured::Created { .. })
    }
}

/// An rtnetlink connection (its task runs on the current runtime). The
/// task ending (a socket error, a panic) would fail every later call while
/// the daemon looks alive; the next call reconnects instead.
///
/// Reads run one at a time: the kernel runs one dump per netlink socket and
/// answers a second one begun meanwhile with EBUSY (every lease confirms its
/// address's lifetime on this one connection: without this, confirmations
/// failed under load and addresses expired under live agents; the soak found
/// it).
#[derive(Clone)]
pub struct Netlink {
    conn: std::sync::Arc<std::sync::Mutex<Connection>>,
    reads: std::sync::Arc<tokio::sync::Mutex<()>>,
}

struct Connection {
    handle: Handle,
    task: tokio::task::JoinHandle<()>,
}

impl Connection {
    fn open() -> Result<Connection, LinkError> {
        // Strict checking: the kernel then filters an address dump by the
        // interface the request names, instead of sending every address in
        // the namespace for this side to filter. Each lease confirms its
        // address's lifetime four times a second, reading the address
        // before and after: with 200 addresses on a node, unfiltered dumps
        // made that quadratic (every read returned all 200), and a
        // debug-build agent on two cores fell behind until addresses ran
        // out of their lifetime (issue #29's 200-takeover rig test).
        let (conn, handle, _) =
            rtnetlink::new_connection_with_strict_check().map_err(LinkError::Connect)?;
        Ok(Connection {
            handle,
            task: tokio::spawn(conn),
        })
    }
}

/// A link as seen over netlink.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkInfo {
    pub name: String,
    pub index: u32,
    pub(crate) mac: Option<[u8; 6]>,
    /// The lower device's index (a macvlan's parent).
    pub(crate) parent: Option<u32>,
    pub(crate) macvlan: bool,
}

impl LinkInfo {
    fn from_message(msg: &LinkMessage) -> LinkInfo {
        let mut info = LinkInfo {
            name: String::new(),
            index: msg.header.index,
            mac: None,
            parent: None,
            macvlan: false,
        };
        for a in &msg.attributes {
            match a {
                LinkAttribute::IfName(n) => info.name = n.clone(),
                LinkAttribute::Address(m) if m.len() == 6 => {
                    info.mac = m.as_slice().try_into().ok()
                }
                LinkAttribute::Link(parent) => info.parent = Some(*parent),
                LinkAttribute::LinkInfo(infos) => {
                    info.macvlan = infos
                        .iter()
                        .any(|i| matches!(i, NlLinkInfo::Kind(InfoKind::MacVlan)));
                }
                _ => {}
            }
        }
        info
    }
}

impl Netlink {
    pub fn connect() -> Result<Netlink, LinkError> {
        Ok(Netlink {
            conn: std::sync::Arc::new(std::sync::Mutex::new(Connection::open()?)),
            reads: std::sync::Arc::default(),
        })
    }

    /// The live connection's handle, reconnecting first if its task ended.
    fn handle(&self) -> Result<Handle, LinkError> {
        let mut conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        if conn.task.is_finished() {
            tracing::error!("the netlink connection's task ended; reconnecting");
            *conn = Connection::open()?;
        }
        Ok(conn.handle.clone())
    }

    #[cfg(test)]
    fn end_connection_task(&self) {
        self.conn.lock().unwrap().task.abort();
    }

    pub(crate) async fn link(&self, name: &str) -> Result<Option<LinkInfo>, LinkError> {
        let _one = self.reads.lock().await;
        let mut s = self
            .handle()?
            .link()
            .get()
            .match_name(name.to_string())
            .execute();
        match s.try_next().await {
            Ok(Some(msg)) => Ok(Some(LinkInfo::from_message(&msg))),
            Ok(None) => Ok(None),
            Err(e) if errno(&e) == libc::ENODEV => Ok(None),
            Err(e) => Err(LinkError::Netlink {
                what: "look up",
                name: name.into(),
                reason: reason(&e),
            }),
        }
    }

    /// Every link in the namespace.
    pub async fn links(&self) -> Result<Vec<LinkInfo>, LinkError> {
        let _one = self.reads.lock().await;
        let msgs: Vec<LinkMessage> = self
            .handle()?
            .link()
            .get()
            .execute()
            .try_collect()
            .await
            .map_err(|e| LinkError::Netlink {
                what: "list",
                name: "links".into(),
                reason: reason(&e),
            })?;
        Ok(msgs.iter().map(LinkInfo::from_message).collect())
    }

    /// Makes macvlan `name` (bridge mode) on `parent` with `mac`, applies
    /// `conf` to it and only then sets it up: a link that is up answers ARP,
    /// and with the kernel's defaults (`arp_ignore=0`) it would answer for
    /// every address of the node, the other LoadBalancer addresses
    /// included, with its own MAC, beside their holders.
    ///
    /// Reuse: a link of that name that is a macvlan on `parent` with `mac`
    /// is kept as it is (`conf` applied again, set up) and reported
    /// [`Ensured::Reused`]: a restarted agent adopting its own link keeps
    /// serving the address while it re-acquires, and a caller that pre-made
    /// the link keeps it. Any other link of that name (another MAC, another
    /// parent, another kind) is deleted and replaced, which is
    /// [`Ensured::Created`].
    pub(crate) async fn ensure_macvlan(
        &self,
        name: &str,
        parent: &str,
        mac: [u8; 6],
        conf: Option<Ipv4Conf>,
    ) -> Result<Ensured, LinkError> {
        let parent_info = self
            .link(parent)
            .await?
            .ok_or_else(|| LinkError::NotFound(parent.into()))?;
        if let Some(existing) = self.link(name).await? {
            if existing.macvlan
                && existing.mac == Some(mac)
                && existing.parent == Some(parent_info.index)
            {
                if let Some(conf) = conf {
                    self.set_ipv4_conf(name, conf).await?;
                }
                self.set_up(name, existing.index).await?;
                return Ok(Ensured::Reused {
                    index: existing.index,
                });
            }
            self.delete(name).await?;
        }
        self.handle()?
            .link()
            .add(
                LinkMacVlan::new(name, parent_info.index, MacVlanMode::Bridge)
                    .address(mac.to_vec())
                    .build(),
            )
            .execute()
            .await
            .map_err(|e| LinkError::Netlink {
                what: "create macvlan",
                name: name.into(),
                reason: reason(&e),
            })?;
        let made = async {
            let info = self
                .link(name)
                .await?
                .ok_or_else(|| LinkError::NotFound(name.into()))?;
            if let Some(conf) = conf {
                self.set_ipv4_conf(name, conf).await?;
            }
            self.set_up(name, info.index).await?;
            Ok(Ensured::Created { index: info.index })
        };
        match made.await {
            Ok(e) => Ok(e),
            // Made but not usable: do not leave it behind.
            Err(e) => {
                let _ = self.delete(name).await;
                Err(e)
            }
        }
    }

    async fn set_up(&self, name: &str, index: u32) -> Result<(), LinkError> {
        self.handle()?
            .link()
            .set(LinkUnspec::new_with_index(index).up().build())
            .execute()
            .await
            .map_err(|e| LinkError::Netlink {
                what: "set up",
                name: name.into(),
                reason: reason(&e),
            })
    }

    /// Applies `conf` to interface `name` (`RTM_SETLINK` with
    /// `IFLA_AF_SPEC`); the kernel validates every value.
    pub(crate) async fn set_ipv4_conf(&self, name: &str, conf: Ipv4Conf) -> Result<(), LinkError> {
        let info = self
            .link(name)
            .await?
            .ok_or_else(|| LinkError::NotFound(name.into()))?;
        let mut msg = LinkUnspec::new_with_index(info.index).build();
        msg.attributes
            .push(LinkAttribute::AfSpecUnspec(vec![AfSpecUnspec::Inet(vec![
                AfSpecInet::DevConfRequest(conf.request()),
            ])]));
        self.handle()?
            .link()
            .set(msg)
            .execute()
            .await
            .map_err(|e| LinkError::Netlink {
                what: "set IPv4 settings of",
                name: name.into(),
                reason: reason(&e),
            })
    }

    /// Deletes link `name`; a missing link is not an error.
    pub(crate) async fn delete(&self, name: &str) -> Result<(), LinkError> {
        let Some(info) = self.link(name).await? else {
            return Ok(());
        };
        match self.handle()?.link().del(info.index).execute().await {
            Ok(()) => Ok(()),
            Err(e) if errno(&e) == libc::ENODEV => Ok(()),
            Err(e) => Err(LinkError::Netlink {
                what: "delete",
                name: name.into(),
                reason: reason(&e),
            }),
        }
    }

    /// A dump of the IPv4 addresses of interface `index`: filtered by the
    /// kernel (the connection checks strictly), and again here, in case a
    /// kernel without strict checking sends more.
    fn address_dump(&self, index: u32) -> Result<rtnetlink::AddressGetRequest, LinkError> {
        let mut request = self.handle()?.address().get().set_link_index_filter(index);
        let header = &mut request.message_mut().header;
        header.family = rtnetlink::packet_route::AddressFamily::Inet;
        header.index = index;
        Ok(request)
    }

    /// The addresses configured on interface `index`.
    pub async fn addresses(&self, index: u32) -> Result<Vec<Ipv4Addr>, LinkError> {
        let _one = self.reads.lock().await;
        let msgs: Vec<_> = self
            .address_dump(index)?
            .execute()
            .try_collect()
            .await
            .map_err(|e| LinkError::Netlink {
                what: "list addresses of",
                name: format!("ifindex {index}"),
                reason: reason(&e),
            })?;
        Ok(msgs
            .iter()
            .flat_map(|m| m.attributes.iter())
            .filter_map(|a| match a {
                AddressAttribute::Address(IpAddr::V4(v4)) => Some(*v4),
                _ => None,
            })
            .collect())
    }

    /// Binds this connection to one interface for [`AddressConfig`].
    pub(crate) fn on(&self, name: &str, index: u32) -> IfAddrs {
        IfAddrs {
            nl: self.clone(),
            name: name.to_string(),
            index,
        }
    }
}

impl Links for Netlink {
    type Transport = AfPacket;
    type Addrs = IfAddrs;

    fn silent_after_migration(&self, parent: &str) -> bool {
        silent_after_migration(std::path::Path::new("/sys/class/net"), parent)
    }

    fn link(&self, name: &str) -> impl Future<Output = Result<Option<LinkInfo>, LinkError>> + Send {
        Netlink::link(self, name)
    }

    fn links(&self) -> impl Future<Output = Result<Vec<LinkInfo>, LinkError>> + Send {
        Netlink::links(self)
    }

    fn ensure_macvlan(
        &self,
        name: &str,
        parent: &str,
        mac: [u8; 6],
        conf: Option<Ipv4Conf>,
    ) -> impl Future<Output = Result<Ensured, LinkError>> + Send {
        Netlink::ensure_macvlan(self, name, parent, mac, conf)
    }

    fn delete(&self, name: &str) -> impl Future<Output = Result<(), LinkError>> + Send {
        Netlink::delete(self, name)
    }

    fn addresses(
        &self,
        index: u32,
    ) -> impl Future<Output = Result<Vec<Ipv4Addr>, LinkError>> + Send {
        Netlink::addresses(self, index)
    }

    fn set_ipv4_conf(
        &self,
        name: &str,
        conf: Ipv4Conf,
    ) -> impl Future<Output = Result<(), LinkError>> + Send {
        Netlink::set_ipv4_conf(self, name, conf)
    }

    fn open(
        &self,
        index: u32,
        uplink: Option<u32>,
        mac: [u8; 6],
        probe: ProbeConfig,
    ) -> std::io::Result<AfPacket> {
        AfPacket::open(index, uplink, mac, probe)
    }

    fn addrs(&self, name: &str, index: u32) -> IfAddrs {
        self.on(name, index)
    }
}

/// When the kernel created an address entry (`IFA_CACHEINFO`'s `cstamp`,
/// hundredths of a second since boot): a new entry has a new one.
fn created_at(msg: &rtnetlink::packet_route::address::AddressMessage) -> Option<u32> {
    msg.attributes.iter().find_map(|a| match a {
        AddressAttribute::CacheInfo(c) => Some(c.cstamp),
        _ => None,
    })
}

/// [`AddressConfig`] for one interface.
#[derive(Clone)]
pub struct IfAddrs {
    nl: Netlink,
    name: String,
    index: u32,
}

/// How old the look at an address may be when its lifetime is renewed
/// ([`IfAddrs::refresh_pausing`]): older, it is looked at again first.
const LOOK_FRESH: std::time::Duration = std::time::Duration::from_millis(50);

impl IfAddrs {
    /// [`AddressConfig::refresh`], with `pause` between the (first) look and the
    /// write (the test's stand-in for this process frozen there).
    ///
    /// RTM_NEWADDR creates an IPv4 address that is not there whatever its
    /// flags (devinet never required NLM_F_CREATE), so the refresh looks
    /// first: an address the kernel deleted stays deleted, and one whose
    /// lifetime has run out but whose deletion the kernel's timer has not
    /// yet carried out (milliseconds) counts as deleted too. The look and
    /// the write are two requests: a process frozen between them (a
    /// SIGSTOP, a stall) while the lifetime ran out would put back, without
    /// the takeover guard, an address the kernel had withdrawn (issue
    /// #29). So a look older than 50 ms (`LOOK_FRESH`) when the write is due is
    /// made again, and the entry's creation stamp is read before and after:
    /// a different one means the write created the address anew (a process
    /// frozen in the microseconds between the last look and the write),
    /// and it is removed at once and reported as gone.
    pub(crate) async fn refresh_pausing(
        &self,
        addr: Ipv4Addr,
        lifetime: u32,
        pause: std::time::Duration,
    ) -> Result<bool, LinkError> {
        let mut looks = 0;
        let created = loop {
            let entries = self.entries(addr).await?;
            let looked = std::time::Instant::now();
            let Some(live) = entries.iter().find(|m| valid_left(m) != Some(0)) else {
                return Ok(false);
            };
            let created = created_at(live);
            looks += 1;
            if looks == 1 && !pause.is_zero() {
                tokio::time::sleep(pause).await;
            }
            // Frozen or stalled since the look (the soak caught a guest
            // paused there, its address expired meanwhile and re-created by
            // the write for the 51 ms until the look after it): look again
            // rather than write on an old look. The write goes a few
            // microseconds after a fresh look; the look after it stays for
            // what still slips through.
            if looked.elapsed() <= LOOK_FRESH || looks >= 3 {
                break created;
            }
        };
        self.add(addr, Some(lifetime)).await?;
        if let Some(created) = created {
            let after = self.entries(addr).await?;
            if !after.iter().any(|m| created_at(m) == Some(created)) {
                self.remove(addr).await?;
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// The kernel's entries for `addr` on this interface.
    async fn entries(
        &self,
        addr: Ipv4Addr,
    ) -> Result<Vec<rtnetlink::packet_route::address::AddressMessage>, LinkError> {
        let _one = self.nl.reads.lock().await;
        self.nl
            .address_dump(self.index)?
            .set_address_filter(IpAddr::V4(addr))
            .execute()
            .try_collect()
            .await
            .map_err(|e| LinkError::Netlink {
                what: "list addresses of",
                name: self.name.clone(),
                reason: format!("{addr}: {}", reason(&e)),
            })
    }
}

/// The valid lifetime left, in seconds, of an address entry (`u32::MAX`:
/// forever; `None`: the kernel did not say).
fn valid_left(msg: &rtnetlink::packet_route::address::AddressMessage) -> Option<u32> {
    msg.attributes.iter().find_map(|a| match a {
        AddressAttribute::CacheInfo(c) => Some(c.ifa_valid),
        _ => None,
    })
}

impl AddressConfig for IfAddrs {
    async fn add(&self, addr: Ipv4Addr, lifetime: Option<u32>) -> Result<(), LinkError> {
        let mut req = self
            .nl
            .handle()?
            .address()
            .add(self.index, IpAddr::V4(addr), VIP_PREFIX_LEN)
            // An entry already there (an adopted link) takes the new
            // lifetime instead of failing with EEXIST.
            .replace();
        // A /32 makes no prefix route anyway; the flag says so to every
        // reader of the address (and keeps it so should the length change).
        req.message_mut()
            .attributes
            .push(AddressAttribute::Flags(AddressFlags::Noprefixroute));
        if let Some(secs) = lifetime {
            let mut c = CacheInfo::default();
            c.ifa_valid = secs.max(1);
            c.ifa_preferred = secs.max(1);
            req.message_mut()
                .attributes
                .push(AddressAttribute::CacheInfo(c));
        }
        match req.execute().await {
            Ok(()) => Ok(()),
            Err(e) => Err(LinkError::Netlink {
                what: "add address to",
                name: self.name.clone(),
                reason: format!("{addr}: {}", reason(&e)),
            }),
        }
    }

    async fn refresh(&self, addr: Ipv4Addr, lifetime: u32) -> Result<bool, LinkError> {
        self.refresh_pausing(addr, lifetime, std::time::Duration::ZERO)
            .await
    }

    async fn remove(&self, addr: Ipv4Addr) -> Result<(), LinkError> {
        let msgs = self.entries(addr).await.unwrap_or_default();
        for m in msgs {
            match self.nl.handle()?.address().del(m).execute().await {
                Ok(()) => {}
                Err(e) if matches!(errno(&e), libc::EADDRNOTAVAIL | libc::ENODEV) => {}
                Err(e) => {
                    return Err(LinkError::Netlink {
                        what: "remove address from",
                        name: self.name.clone(),
                        reason: format!("{addr}: {}", reason(&e)),
                    });
                }
            }
        }
        Ok(())
    }
}

/// The names of the interfaces under `sys_class_net` but those starting
/// with `skip_prefix`; none when it cannot be read.
fn interfaces(sys_class_net: &std::path::Path, skip_prefix: &str) -> impl Iterator<Item = String> {
    std::fs::read_dir(sys_class_net)
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(move |n| !n.starts_with(skip_prefix))
}

/// The interfaces under `sys_class_net` (`/sys/class/net`, this network
/// namespace's when sysfs was mounted in it) whose `carrier` is not 1: no
/// carrier, or set down (the file then cannot be read). Names starting
/// with `skip_prefix` (our own macvlans) are left out: only uplinks matter.
pub fn without_carrier(
    sys_class_net: &std::path::Path,
    skip_prefix: &str,
) -> std::collections::BTreeSet<String> {
    interfaces(sys_class_net, skip_prefix)
        .filter(|n| {
            std::fs::read_to_string(sys_class_net.join(n).join("carrier"))
                .map(|c| c.trim() != "1")
                .unwrap_or(true)
        })
        .collect()
}

/// The network cards under `sys_class_net`: interfaces backed by a device
/// (`device`), not enslaved to a bridge or bond (`master`) and not bridges
/// themselves; names starting with `skip_prefix` are left out. Bridges,
/// veths, tunnels and our own macvlans have no `device`.
pub fn network_cards(
    sys_class_net: &std::path::Path,
    skip_prefix: &str,
) -> std::collections::BTreeSet<String> {
    interfaces(sys_class_net, skip_prefix)
        .filter(|n| {
            let d = sys_class_net.join(n);
            d.join("device").exists() && !d.join("master").exists() && !d.join("bridge").exists()
        })
        .collect()
}

/// Sets every link of the calling thread's network namespace named
/// `prefix...` down at once, with two ioctls each and no runtime: for a
/// thread that must silence the node's addresses before anything else
/// runs (a VM resumed from a long pause: the daemon's pause watch). A link
/// that is down answers no ARP and sends nothing; its lease is then
/// stopped as usual, which deletes it. Returns the links set down, and
/// each failure.
pub fn set_down_now(prefix: &str) -> (Vec<String>, Vec<(String, std::io::Error)>) {
    let names: Vec<String> = match nix::net::if_::if_nameindex() {
        Ok(all) => all
            .iter()
            .filter_map(|i| i.name().to_str().ok().map(str::to_string))
            .filter(|n| n.starts_with(prefix))
            .collect(),
        Err(e) => return (Vec::new(), vec![(format!("{prefix}*"), e.into())]),
    };
    let (mut down, mut failed) = (Vec::new(), Vec::new());
    for name in names {
        match set_down(&name) {
            Ok(()) => down.push(name),
            Err(e) => failed.push((name, e)),
        }
    }
    (down, failed)
}

fn set_down(name: &str) -> std::io::Result<()> {
    use crate::raw::cvt;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    if name.len() >= libc::IFNAMSIZ {
        return Err(std::io::Error::other("interface name too long"));
    }
    // SAFETY: plain syscalls on a descriptor owned here; `req` is a live,
    // zero-initialised ifreq whose name is NUL-terminated (checked above).
    unsafe {
        let fd = OwnedFd::from_raw_fd(cvt(libc::socket(
            libc::AF_INET,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            0,
        ))?);
        let mut req: libc::ifreq = std::mem::zeroed();
        for (dst, src) in req.ifr_name.iter_mut().zip(name.bytes()) {
            *dst = src as libc::c_char;
        }
        cvt(libc::ioctl(fd.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req))?;
        req.ifr_ifru.ifru_flags &= !(libc::IFF_UP as libc::c_short);
        cvt(libc::ioctl(fd.as_raw_fd(), libc::SIOCSIFFLAGS, &req))?;
    }
    Ok(())
}

/// `VIRTIO_NET_F_GUEST_ANNOUNCE`: the host may ask the guest to announce
/// itself after a live migration (virtio 1.x, 5.1.3).
const VIRTIO_NET_F_GUEST_ANNOUNCE: usize = 21;

/// Whether `parent` (under `sys_class_net`) is a hypervisor's NIC that
/// cannot have its guest announce a live migration: a device (PCI, virtio)
/// other than a virtio-net that negotiated `VIRTIO_NET_F_GUEST_ANNOUNCE`,
/// which the virtio device's `features` file shows as a `1` at index 21
/// (one character per feature bit). Such a guest's kernel announces
/// every address of every macvlan on the NIC after a migration; with an
/// e1000-family NIC nothing does but QEMU's RARP for the NIC's own MAC.
/// A link without a device (veth, bridge, bond, VLAN) is not such a NIC.
pub(crate) fn silent_after_migration(sys_class_net: &std::path::Path, parent: &str) -> bool {
    let device = sys_class_net.join(parent).join("device");
    if !device.exists() {
        return false;
    }
    match std::fs::read_to_string(device.join("features")) {
        Ok(bits) => bits.as_bytes().get(VIRTIO_NET_F_GUEST_ANNOUNCE) != Some(&b'1'),
        Err(_) => true,
    }
}

/// The MAC addresses (lower case) of the interfaces under `sys_class_net`,
/// each with its interface's name; names starting with `skip_prefix` left
/// out.
pub fn interface_macs(
    sys_class_net: &std::path::Path,
    skip_prefix: &str,
) -> std::collections::BTreeMap<String, String> {
    interfaces(sys_class_net, skip_prefix)
        .filter_map(|n| {
            let mac = std::fs::read_to_string(sys_class_net.join(&n).join("address")).ok()?;
            let mac = mac.trim().to_ascii_lowercase();
            (!mac.is_empty() && mac != "00:00:00:00:00:00").then_some((mac, n))
        })
        .collect()
}

/// The address (and its prefix length) of `interface` that the node is
/// known by on its LAN: the first IPv4 address with a subnet's prefix. A
/// /32 (kube-vip and the like put Service addresses on the uplink so) is
/// taken only when there is nothing else.
pub fn interface_ipv4(interface: &str) -> Option<(Ipv4Addr, u8)> {
    let mut host_only = None;
    for a in nix::ifaddrs::getifaddrs().ok()? {
        if a.interface_name != interface {
            continue;
        }
        let (Some(addr), Some(mask)) = (a.address, a.netmask) else {
            continue;
        };
        let (Some(ip), Some(mask)) = (addr.as_sockaddr_in(), mask.as_sockaddr_in()) else {
            continue;
        };
        let prefix = mask.ip().to_bits().count_ones() as u8;
        if prefix < 32 {
            return Some((ip.ip(), prefix));
        }
        host_only.get_or_insert((ip.ip(), prefix));
    }
    host_only
}

/// The default uplink now: the configured one, else the default route's
/// interface, else the one the route last named while that interface still
/// exists. A default route is briefly gone whenever the node's own network
/// service renews or restarts; believing that moment would drop every
/// address the node holds. An uplink that loses carrier or disappears is
/// noticed through the carrier and the interface, not the route.
pub fn current_uplink(
    configured: Option<&str>,
    route: Option<String>,
    last: Option<&str>,
    exists: impl Fn(&str) -> bool,
) -> Option<String> {
    if let Some(c) = configured {
        return Some(c.to_string());
    }
    route.or_else(|| last.filter(|l| exists(l)).map(str::to_string))
}

/// The IPv4 routing table as text. Through `self`: the daemon's unit sets
/// `ProcSubset=pid`, which hides the top-level `/proc/net` link.
pub const ROUTE_TABLE: &str = "/proc/self/net/route";
/// The kernel's ARP table of this process's network namespace.
pub const ARP_TABLE: &str = "/proc/self/net/arp";

/// The IPv4 default routes that are up in `/proc/net/route` text:
/// (metric, interface, gateway; 0.0.0.0 for a route without one).
fn default_routes(proc_net_route: &str) -> impl Iterator<Item = (u32, String, Ipv4Addr)> + '_ {
    proc_net_route.lines().skip(1).filter_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        // Iface Destination Gateway Flags RefCnt Use Metric Mask ...
        if f.len() < 8 || f[1] != "00000000" || f[7] != "00000000" {
            return None;
        }
        let flags = u32::from_str_radix(f[3], 16).ok()?;
        let metric: u32 = f[6].parse().ok()?;
        // The kernel prints the gateway in host (little-endian) order.
        let gateway = Ipv4Addr::from(u32::from_str_radix(f[2], 16).ok()?.swap_bytes());
        // RTF_UP
        (flags & 1 == 1).then(|| (metric, f[0].to_string(), gateway))
    })
}

/// The interface of the IPv4 default route, from `/proc/net/route` text
/// (the lowest metric wins).
pub fn default_route_interface(proc_net_route: &str) -> Option<String> {
    default_routes(proc_net_route)
        .min()
        .map(|(_, iface, _)| iface)
}

/// The IPv4 default route's interface and gateway, from `/proc/net/route`
/// text (the lowest metric wins; a route without a gateway has none).
pub fn default_gateway(proc_net_route: &str) -> Option<(String, Ipv4Addr)> {
    default_routes(proc_net_route)
        .min()
        .filter(|(_, _, gw)| !gw.is_unspecified())
        .map(|(_, iface, gw)| (iface, gw))
}

/// The complete entries of the kernel's ARP table (`/proc/net/arp` text):
/// per neighbour MAC (lower case), the addresses it answers for and on
/// which interfaces. Incomplete and all-zero entries are left out.
pub fn arp_neighbours(
    proc_net_arp: &str,
) -> std::collections::BTreeMap<String, std::collections::BTreeSet<(Ipv4Addr, String)>> {
    let mut out: std::collections::BTreeMap<
        String,
        std::collections::BTreeSet<(Ipv4Addr, String)>,
    > = Default::default();
    for l in proc_net_arp.lines().skip(1) {
        // IP address  HW type  Flags  HW address  Mask  Device
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.len() < 6 {
            continue;
        }
        let (Ok(ip), Ok(flags)) = (
            f[0].parse::<Ipv4Addr>(),
            u32::from_str_radix(f[2].trim_start_matches("0x"), 16),
        ) else {
            continue;
        };
        let mac = f[3].to_ascii_lowercase();
        // ATF_COM: resolved.
        if flags & 0x2 == 0 || crate::mac::parse(&mac).is_none_or(|m| m == [0; 6]) {
            continue;
        }
        out.entry(mac).or_default().insert((ip, f[5].to_string()));
    }
    out
}

/// `vip-<first 8 hex digits of key>`: the kube-vip naming the field knows
/// (key is the Service UID). Non-hex characters are skipped.
#[cfg(test)]
pub(crate) fn vip_name(key: &str) -> String {
    let hex: String = key
        .chars()
        .filter(|c| c.is_ascii_hexdigit())
        .take(8)
        .collect::<String>()
        .to_ascii_lowercase();
    format!("vip-{hex}")
}

/// A random `00:00:6C:xx:xx:xx` MAC (the prefix the field uses for LB
/// macvlans; universally administered, so DHCP servers that refuse
/// locally administered MACs still answer).
pub(crate) fn random_vip_mac() -> [u8; 6] {
    [
        0x00,
        0x00,
        0x6c,
        fastrand::u8(..),
        fastrand::u8(..),
        fastrand::u8(..),
    ]
}

#[cfg(test)]
mod netlink_tests {
    use super::Netlink;

    /// Listing links needs no privilege, so this runs anywhere.
    #[tokio::test]
    async fn a_dead_connection_task_is_replaced_on_the_next_call() {
        let nl = Netlink::connect().unwrap();
        assert!(nl.links().await.unwrap().iter().any(|l| l.name == "lo"));
        nl.end_connection_task();
        tokio::task::yield_now().await;
        let links = nl.links().await.expect("a call after the task ended");
        assert!(links.iter().any(|l| l.name == "lo"));
    }
}

#[cfg(test)]
mod uplink_tests {
    use super::current_uplink;

    #[test]
    fn a_moment_without_a_default_route_keeps_the_uplink() {
        let exists = |n: &str| n == "eth0";
        assert_eq!(
            current_uplink(None, Some("eth0".into()), None, exists).as_deref(),
            Some("eth0")
        );
        // The route is gone for a moment: the interface is still there.
        assert_eq!(
            current_uplink(None, None, Some("eth0"), exists).as_deref(),
            Some("eth0")
        );
        // The interface itself is gone: so is the uplink.
        assert_eq!(current_uplink(None, None, Some("eth1"), exists), None);
        // Never had a route: none.
        assert_eq!(current_uplink(None, None, None, exists), None);
        // The route moved: the new one.
        assert_eq!(
            current_uplink(None, Some("eth1".into()), Some("eth0"), exists).as_deref(),
            Some("eth1")
        );
        // Configured wins over all.
        assert_eq!(
            current_uplink(Some("bond0"), Some("eth0".into()), None, exists).as_deref(),
            Some("bond0")
        );
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn network_cards_are_devices_neither_enslaved_nor_bridges() {
        let dir = tempfile::tempdir().unwrap();
        let link = |name: &str, files: &[&str]| {
            let d = dir.path().join(name);
            std::fs::create_dir_all(&d).unwrap();
            for f in files {
                std::fs::create_dir_all(d.join(f)).unwrap();
            }
        };
        link("enp1s0", &["device"]);
        link("enp2s0", &["device"]);
        link("enp3s0", &["device", "master"]); // a bond's or bridge's port
        link("cni0", &["bridge"]);
        link("veth1234", &[]);
        link("flannel.1", &[]);
        link("hlb-3f2a9c1e", &["device"]);
        for (name, mac) in [
            ("enp1s0", "52:54:00:AA:BB:01\n"),
            ("hlb-3f2a9c1e", "02:00:00:00:00:01\n"),
        ] {
            std::fs::write(dir.path().join(name).join("address"), mac).unwrap();
        }
        assert_eq!(
            super::interface_macs(dir.path(), "hlb-")
                .into_iter()
                .collect::<Vec<_>>(),
            [("52:54:00:aa:bb:01".to_string(), "enp1s0".to_string())]
        );
        let cards = super::network_cards(dir.path(), "hlb-");
        assert_eq!(cards.into_iter().collect::<Vec<_>>(), ["enp1s0", "enp2s0"]);
    }

    /// Issue #31: the NICs whose guest is not told of a live migration.
    #[test]
    fn silent_after_migration_is_a_device_without_virtio_guest_announce() {
        let dir = tempfile::tempdir().unwrap();
        let virtio = |announce: bool| {
            // The kernel's `features`: one character per feature bit, 64.
            let mut bits = vec![b'0'; 64];
            for b in [0, 5, 16, 17, 32] {
                bits[b] = b'1';
            }
            bits[21] = if announce { b'1' } else { b'0' };
            let mut text = String::from_utf8(bits).unwrap();
            text.push('\n');
            text
        };
        let link = |name: &str, device: bool, features: Option<String>| {
            let d = dir.path().join(name);
            std::fs::create_dir_all(&d).unwrap();
            if device {
                std::fs::create_dir_all(d.join("device")).unwrap();
            }
            if let Some(f) = features {
                std::fs::write(d.join("device").join("features"), f).unwrap();
            }
        };
        link("virtio-announcing", true, Some(virtio(true)));
        link("virtio-plain", true, Some(virtio(false)));
        link("e1000e", true, None);
        link("veth0", false, None);
        let silent = |n: &str| super::silent_after_migration(dir.path(), n);
        assert!(!silent("virtio-announcing"));
        assert!(silent("virtio-plain"));
        assert!(silent("e1000e"));
        assert!(!silent("veth0"));
        assert!(!silent("missing"));
    }

    #[test]
    fn without_carrier_reads_sysfs_and_skips_our_links() {
        let dir = tempfile::tempdir().unwrap();
        let link = |name: &str, carrier: Option<&str>| {
            let d = dir.path().join(name);
            std::fs::create_dir(&d).unwrap();
            if let Some(c) = carrier {
                std::fs::write(d.join("carrier"), c).unwrap();
            }
        };
        link("lo", Some("1\n"));
        link("eth0", Some("1\n"));
        link("eth1", Some("0\n"));
        link("eth2", None); // set down: carrier cannot be read
        link("hlb-0a1b2c3d", Some("0\n"));
        assert_eq!(
            without_carrier(dir.path(), "hlb-"),
            ["eth1", "eth2"].map(String::from).into()
        );
        assert!(without_carrier(&dir.path().join("missing"), "hlb-").is_empty());
    }

    use super::*;

    #[test]
    fn default_route_picks_lowest_metric_up_route() {
        let t = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n\
eth1\t00000000\t0100A8C0\t0003\t0\t0\t200\t00000000\t0\t0\t0\n\
eth0\t00000000\t01004D0A\t0003\t0\t0\t100\t00000000\t0\t0\t0\n\
eth0\t00004D0A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n";
        assert_eq!(default_route_interface(t).as_deref(), Some("eth0"));
        assert_eq!(default_route_interface("Iface\n"), None);
    }

    #[test]
    fn the_default_gateway_and_the_arp_table() {
        let route = "Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\tMTU\tWindow\tIRTT\n\
eth1\t00000000\t0100A8C0\t0003\t0\t0\t200\t00000000\t0\t0\t0\n\
eth0\t00000000\t01004D0A\t0003\t0\t0\t100\t00000000\t0\t0\t0\n\
eth0\t00004D0A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n";
        assert_eq!(
            default_gateway(route),
            Some(("eth0".to_string(), Ipv4Addr::new(10, 77, 0, 1)))
        );
        // A default route on a link, without a gateway.
        let onlink = "Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\n\
eth0\t00000000\t00000000\t0001\t0\t0\t0\t00000000\n";
        assert_eq!(default_gateway(onlink), None);
        let arp = "IP address       HW type     Flags       HW address            Mask     Device\n\
10.77.0.1        0x1         0x2         0A:11:22:33:44:55     *        eth0\n\
10.77.0.12       0x1         0x2         02:00:00:00:00:0c     *        eth0\n\
10.77.0.150      0x1         0x2         02:00:00:00:00:0c     *        eth0\n\
10.77.0.99       0x1         0x0         00:00:00:00:00:00     *        eth0\n\
garbage\n";
        let n = arp_neighbours(arp);
        assert_eq!(n.len(), 2, "{n:?}");
        assert_eq!(
            n["0a:11:22:33:44:55"],
            [(Ipv4Addr::new(10, 77, 0, 1), "eth0".to_string())].into()
        );
        assert_eq!(n["02:00:00:00:00:0c"].len(), 2);
    }

    #[test]
    fn names_and_macs() {
        assert_eq!(vip_name("0a1b2c3d-4e5f-6789"), "vip-0a1b2c3d");
        assert_eq!(vip_name("AB-cd-ef-01-23"), "vip-abcdef01");
        let m = random_vip_mac();
        assert_eq!(&m[..3], &[0, 0, 0x6c]);
        assert_eq!(crate::mac::parse(&crate::mac::format(&m)), Some(m));
    }
}
