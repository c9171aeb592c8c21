//! The macvlan probe's decisions, as plain functions over links read off
//! the host: which interface carries the test link, what the link is
//! called, which leftovers to remove, and what a failure means.
//! [`super::host`] does the netlink.
//!
//! The test link is a macvlan on the node's own uplink, created DOWN in the
//! host namespace and deleted at once. A macvlan needs an Ethernet parent
//! in the namespace it is created from (the loopback is refused with
//! EINVAL), and the uplink is the one such interface every node has with
//! its driver already loaded: no veth or dummy module is needed, and no
//! private network namespace, so the agent needs no CAP_SYS_ADMIN. It is
//! also where the DHCP-mode macvlans (`vip-*`) go, so the probe proves what
//! they need. Never set up, the link carries no traffic, has no address and
//! registers no MAC on the uplink; it is visible to `ip monitor` for the
//! two netlink round trips it lives.

/// Name prefix of the probe link; the process id follows (`hnaprobe1234`,
/// at most 15 characters with Linux's largest pid), so the daemon and a
/// `check` never collide and a leftover names the process that left it.
pub(crate) const LINK_PREFIX: &str = "hnaprobe";

/// At most this many interfaces are tried as parent.
pub(crate) const MAX_PARENTS: usize = 3;

/// A link as the probe sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LinkFacts {
    pub(crate) index: u32,
    pub(crate) name: String,
    /// Ethernet framing (ARPHRD_ETHER) and not a loopback: what a macvlan
    /// parent must be.
    pub(crate) ethernet: bool,
    /// The bridge, bond or team the link is a port of; such a port already
    /// has a receive handler and cannot also carry macvlans.
    pub(crate) controller: Option<u32>,
    /// `IFLA_INFO_KIND` (`veth`, `bridge`, `macvlan`, ...); `None` for a
    /// hardware NIC.
    pub(crate) kind: Option<String>,
}

/// Why the probe failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProbeError {
    /// The kernel refused the macvlan link type itself (EOPNOTSUPP): it
    /// has no macvlan.
    #[error("the kernel has no macvlan link type: {0}")]
    Unsupported(String),
    /// No interface can be a macvlan parent.
    #[error("no interface to create the test macvlan on: {0}")]
    NoParent(String),
    /// Anything else (netlink, permissions, every parent refused).
    #[error("{0}")]
    Failed(String),
}

/// `hnaprobe<pid>`.
pub(crate) fn link_name(pid: u32) -> String {
    format!("{LINK_PREFIX}{pid}")
}

/// The pid in a probe link's name, `None` for any other name.
pub(crate) fn link_owner(name: &str) -> Option<u32> {
    let digits = name.strip_prefix(LINK_PREFIX)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

fn can_be_parent(link: &LinkFacts) -> bool {
    link.ethernet && link.controller.is_none() && link_owner(&link.name).is_none()
}

/// The interfaces to try as parent, best first: the interface of the
/// default route (the uplink, whatever its kind: bridge, bond, VLAN or a
/// NIC), then hardware Ethernet NICs, then, on a node with neither, other
/// Ethernet links (veths, bridges), each group in index order.
pub(crate) fn parents(links: &[LinkFacts], default_route: Option<u32>) -> Vec<&LinkFacts> {
    let mut candidates: Vec<&LinkFacts> = links.iter().filter(|l| can_be_parent(l)).collect();
    candidates.sort_by_key(|l| (Some(l.index) != default_route, l.kind.is_some(), l.index));
    candidates.truncate(MAX_PARENTS);
    candidates
}

/// Why no interface qualifies, for [`ProbeError::NoParent`].
pub(crate) fn no_parent_detail(links: &[LinkFacts]) -> String {
    let seen: Vec<String> = links
        .iter()
        .map(|l| {
            let why = if !l.ethernet {
                "not Ethernet"
            } else if l.controller.is_some() {
                "port of a bridge or bond"
            } else {
                "a probe link"
            };
            format!("{} ({why})", l.name)
        })
        .collect();
    format!(
        "a macvlan needs an Ethernet interface as parent (the uplink); found {}",
        if seen.is_empty() {
            "no interfaces".to_string()
        } else {
            seen.join(", ")
        }
    )
}

/// Probe links to delete before probing: this process's own name (left by
/// an earlier process with the same pid) and those of processes that are
/// gone (`alive` says whether a pid runs). A probe is deleted within
/// milliseconds, so these are leftovers of a process killed mid-probe.
pub(crate) fn leftovers(
    links: &[LinkFacts],
    own_pid: u32,
    alive: impl Fn(u32) -> bool,
) -> Vec<&LinkFacts> {
    links
        .iter()
        .filter(|l| l.kind.as_deref() == Some("macvlan"))
        .filter(|l| link_owner(&l.name).is_some_and(|pid| pid == own_pid || !alive(pid)))
        .collect()
}

/// A locally administered unicast MAC for the probe link. Given
/// explicitly, so udev's `MACAddressPolicy=persistent` leaves the
/// short-lived link alone instead of racing its deletion.
pub(crate) fn link_mac(random: [u8; 5]) -> [u8; 6] {
    [0x02, random[0], random[1], random[2], random[3], random[4]]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(index: u32, name: &str, ethernet: bool, kind: Option<&str>) -> LinkFacts {
        LinkFacts {
            index,
            name: name.into(),
            ethernet,
            controller: None,
            kind: kind.map(str::to_string),
        }
    }

    fn names(ls: Vec<&LinkFacts>) -> Vec<&str> {
        ls.into_iter().map(|l| l.name.as_str()).collect()
    }

    #[test]
    fn the_default_route_interface_comes_first_then_hardware_nics() {
        let links = [
            link(1, "lo", false, None),
            link(2, "eth0", true, None),
            link(3, "br0", true, Some("bridge")),
            link(4, "cali1234", true, Some("veth")),
            link(5, "vip-0a1b2c3d", true, Some("macvlan")),
            link(6, "ens5", true, None),
            link(7, "wg0", false, Some("wireguard")),
        ];
        assert_eq!(names(parents(&links, Some(3))), ["br0", "eth0", "ens5"]);
        assert_eq!(names(parents(&links, Some(6))), ["ens5", "eth0", "br0"]);
        // No default route (or through a tunnel): hardware NICs first.
        assert_eq!(names(parents(&links, None)), ["eth0", "ens5", "br0"]);
        assert_eq!(names(parents(&links, Some(7))), ["eth0", "ens5", "br0"]);
        // No hardware NIC: virtual Ethernet links will do.
        assert_eq!(
            names(parents(&links[2..5], None)),
            ["br0", "cali1234", "vip-0a1b2c3d"]
        );
    }

    #[test]
    fn ports_loopback_and_probe_links_are_never_parents() {
        let mut port = link(2, "eth0", true, None);
        port.controller = Some(3);
        let links = [
            link(1, "lo", false, None),
            port,
            link(3, "br0", true, Some("bridge")),
            link(4, "hnaprobe77", true, Some("macvlan")),
        ];
        // The bridge, never its port, the loopback or a probe link.
        for route in [None, Some(1), Some(2), Some(3), Some(4)] {
            assert_eq!(names(parents(&links, route)), ["br0"], "{route:?}");
        }
        assert_eq!(names(parents(&links[..2], Some(2))), Vec::<&str>::new());
        assert!(no_parent_detail(&links[3..]).contains("hnaprobe77 (a probe link)"));
        let detail = no_parent_detail(&links[..2]);
        assert!(
            detail.contains("lo (not Ethernet)")
                && detail.contains("eth0 (port of a bridge or bond)"),
            "{detail}"
        );
        assert!(no_parent_detail(&[]).contains("no interfaces"));
    }

    #[test]
    fn at_most_max_parents_are_tried() {
        let links: Vec<LinkFacts> = (1..=10)
            .map(|i| link(i, &format!("eth{i}"), true, None))
            .collect();
        assert_eq!(parents(&links, None).len(), MAX_PARENTS);
    }

    #[test]
    fn probe_link_names_carry_the_pid_and_fit_ifnamsiz() {
        // Linux's pid_max is at most 2^22.
        let longest = link_name(4_194_304);
        assert_eq!(longest, "hnaprobe4194304");
        assert!(longest.len() <= 15);
        assert_eq!(link_owner(&longest), Some(4_194_304));
        for other in [
            "hnaprobe",
            "hnaprobe12a",
            "vip-1234",
            "hnaprobe-1",
            "xhnaprobe1",
        ] {
            assert_eq!(link_owner(other), None, "{other}");
        }
    }

    #[test]
    fn leftovers_are_own_and_dead_owners_macvlans_only() {
        let links = [
            link(2, "eth0", true, None),
            link(8, "hnaprobe100", true, Some("macvlan")),
            link(9, "hnaprobe200", true, Some("macvlan")),
            link(10, "hnaprobe300", true, Some("macvlan")),
            link(11, "hnaprobe400", true, Some("dummy")),
        ];
        let alive = |pid| pid == 200 || pid == 100;
        assert_eq!(
            names(leftovers(&links, 100, alive)),
            ["hnaprobe100", "hnaprobe300"]
        );
    }

    #[test]
    fn the_probe_mac_is_locally_administered_unicast() {
        let mac = link_mac([0xff, 1, 2, 3, 4]);
        assert_eq!(mac[0] & 0x02, 0x02);
        assert_eq!(mac[0] & 0x01, 0);
        assert_eq!(&mac[1..], &[0xff, 1, 2, 3, 4]);
    }
}
