//! The contract between the node daemon and the controller, and with the
//! Harvester cloud provider and kube-vip: annotation keys, which Services
//! are ours, and the identity (link name, MAC, client identifier) under
//! which any node asks for a Service's lease. A crate of its own: about
//! LoadBalancers the daemon and the controller share this and nothing else
//! (besides the common edges, `hna-edges`), and never import each other.
//! Besides the Kubernetes types it needs nothing.
//!
//! - the crate root: annotation keys, [`select`] (which Services are ours),
//!   [`AddressIdentity::of`], [`fnv1a`];
//! - [`node_object`]: the `LoadBalancerNode` resource and its spec and
//!   status types;
//! - [`harvester`], [`kube_vip`]: the keys the cloud provider and kube-vip
//!   write;
//! - [`membership`]: what the LAN membership's agents and the controller
//!   agree on;
//! - [`k8s_names`]: Kubernetes name and label-key rules, the default
//!   topology keys;
//! - [`mac`]: MAC addresses as text, in kube-vip's format.
//!
//! What kube-vip and the cloud provider do with these keys is written up in
//! `docs/kube-vip-contract.md`.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

pub mod k8s_names;
pub mod mac;

/// `spec.loadBalancerClass` that selects this agent on clusters without the
/// Harvester cloud provider (Kubernetes 1.24+; the field is immutable).
pub(crate) const LOAD_BALANCER_CLASS: &str = "harvester-node-agent.io/dhcp";
/// On a primary: the other namespaces whose Services may share its address
/// (`cloudprovider.harvesterhci.io/primary-service` naming it), comma- or
/// space-separated, or `*` for every namespace. Services of the primary's
/// own namespace need no consent.
pub const SHARE_WITH: &str = "harvester-node-agent.io/share-with";
/// Our opt-out: `"true"` leaves the Service alone.
pub const IGNORE: &str = "harvester-node-agent.io/ignore";
/// Prefix of the macvlans that hold LoadBalancer addresses: `hlb-` and the
/// first 8 hex digits of the Service UID. Not kube-vip's `vip-`, so that
/// neither agent's clean-up takes the other's links during a migration.
pub const INTERFACE_PREFIX: &str = "hlb-";

/// The namespace of the controller, its Lease and the per-node objects,
/// unless configured otherwise (agent `namespace`, controller `--namespace`).
pub const DEFAULT_NAMESPACE: &str = "harvester-node-agent";
/// The finalizer the controller puts on every Service it gives an address:
/// deleting the Service waits until the holder has sent DHCPRELEASE.
pub const FINALIZER: &str = "harvester-node-agent.io/dhcp-release";

/// The condition the controller keeps in the `status.conditions` of each
/// Service it publishes an address for (as Cilium keeps
/// `cilium.io/IPAMRequestSatisfied`): `True`, reason `AddressAssigned`,
/// with the Service's `observedGeneration`; removed when it lets the
/// Service go.
pub const SERVICE_CONDITION: &str = "harvester-node-agent.io/AddressAssigned";
/// The `coordination.k8s.io` Lease the controller replicas elect a leader on.
pub const CONTROLLER_LEASE: &str = "harvester-node-agent-controller";

/// Written by the Harvester cloud provider; never by us.
pub mod harvester {
    pub const IPAM: &str = "cloudprovider.harvesterhci.io/ipam";
    pub const PRIMARY_SERVICE: &str = "cloudprovider.harvesterhci.io/primary-service";
    pub const NETWORK: &str = "cloudprovider.harvesterhci.io/network";
}

/// kube-vip's keys. `LOADBALANCER_IPS` and `SERVICE_INTERFACE` come from the
/// cloud provider (never written by us); `HWADDR`, `REQUESTED_IP` and
/// `VIP_HOST` are written back in kube-vip's format so that going back to
/// kube-vip keeps the address.
pub mod kube_vip {
    pub const LOADBALANCER_IPS: &str = "kube-vip.io/loadbalancerIPs";
    pub const SERVICE_INTERFACE: &str = "kube-vip.io/serviceInterface";
    pub const HWADDR: &str = "kube-vip.io/hwaddr";
    pub const REQUESTED_IP: &str = "kube-vip.io/requestedIP";
    pub const VIP_HOST: &str = "kube-vip.io/vipHost";
    pub const LOADBALANCER_HOSTNAME: &str = "kube-vip.io/loadbalancerHostname";
    /// The address the cloud provider writes for "ask DHCP".
    pub const ASK_DHCP: &str = "0.0.0.0";
}

pub type Annotations = BTreeMap<String, String>;

/// The per-node object (`LoadBalancerNode`, one per Node, named after it,
/// in the controller's namespace): the controller writes `spec`, the node's
/// agent writes `status` (see `docs/loadbalancer-design.md`).
pub mod node_object {
    use serde::{Deserialize, Serialize};

    pub const GROUP: &str = "lb.harvester-node-agent.io";
    pub const VERSION: &str = "v1alpha1";
    pub const KIND: &str = "LoadBalancerNode";
    pub const PLURAL: &str = "loadbalancernodes";

    /// The object: `spec` from the controller, `status` from the node's
    /// agent. Used through [`api_resource`] (no generated types).
    pub type LoadBalancerNode = kube::core::Object<Spec, Status>;

    pub fn api_resource() -> kube::core::ApiResource {
        kube::core::ApiResource::from_gvk_with_plural(
            &kube::core::GroupVersionKind::gvk(GROUP, VERSION, KIND),
            PLURAL,
        )
    }

    /// The name of the Role (and RoleBinding) that lets `system:node:<node>`
    /// read its own object and write its status, and nothing else.
    /// Kubernetes names may be 253 characters; a long node name is cut and
    /// made unique again with a hash.
    pub fn role_name(node: &str) -> String {
        let full = format!("harvester-node-agent-node-{node}");
        if full.len() <= 253 {
            return full;
        }
        let hash = crate::fnv1a(&[node.as_bytes()]);
        format!("{}-{hash:016x}", &full[..253 - 17])
    }

    /// The Kubernetes user a node's kubelet credentials authenticate as.
    pub fn node_user(node: &str) -> String {
        format!("system:node:{node}")
    }

    /// Written by the controller only.
    #[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
    #[serde(rename_all = "camelCase")]
    pub struct Spec {
        #[serde(default)]
        pub assignments: Vec<Assignment>,
        /// The other members of this node's LAN (the agents whose default
        /// uplink is on the same subnet), whom its agent watches and is
        /// watched by (`crate::membership`). Written when nodes come, go
        /// or move, never periodically.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub peers: Vec<crate::membership::Peer>,
    }

    /// One address this node is to hold (or release). Everything the node
    /// needs is here: agents never read Services.
    #[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
    #[serde(rename_all = "camelCase")]
    pub struct Assignment {
        /// `namespace/name`.
        pub service: String,
        pub uid: String,
        /// The macvlan's name (`hlb-<8 hex>`).
        pub interface: String,
        /// kube-vip's format, `02:..`.
        pub mac: String,
        /// Option 61 as hex bytes; empty: send none.
        pub client_id: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub hostname: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub requested_ip: Option<String>,
        /// The uplink (`kube-vip.io/serviceInterface`); the node's own
        /// default otherwise.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub uplink: Option<String>,
        /// The Service is gone: send DHCPRELEASE, then drop the link.
        #[serde(default)]
        pub release: bool,
    }

    /// The longest restart grace the controller grants (5 minutes).
    pub const MAX_RESTART_GRACE_MS: u64 = 300_000;

    /// Written by the node's agent only (the `status` subresource).
    #[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
    #[serde(rename_all = "camelCase")]
    pub struct Status {
        /// RFC 3339 on the agent's clock. The controller judges only whether
        /// it changed, on its own clock, never its value.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub heartbeat: Option<String>,
        /// How often the agent rewrites `heartbeat` (its `lb_heartbeat`, or
        /// 2 s while `lan.down` lists a peer), in milliseconds. The
        /// controller gives no address to a node whose period does not fit
        /// twice in its `--node-stale-after`: such a node would look dead
        /// between two heartbeats and its addresses would move back and
        /// forth. It counts the node's `lan.down` only while its heartbeat
        /// changed within two periods and a second.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub heartbeat_period_ms: Option<u64>,
        /// The agent is restarting (a package upgrade, `systemctl restart`)
        /// and left its addresses on their links for this many milliseconds:
        /// the controller judges the node dead only once this much has
        /// passed without a new heartbeat (at most [`MAX_RESTART_GRACE_MS`]),
        /// and its next run adopts the links.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub restart_grace_ms: Option<u64>,
        /// The `metadata.generation` of this object whose spec the agent
        /// had read when it wrote this status. The controller counts an
        /// assignment as read only from a status whose
        /// `observedGeneration` is at least the generation that first
        /// carried it: a node cut off from the API server keeps the status
        /// it last wrote, leases and all, and one that held a Service
        /// before still lists it there. An older agent writes none; the
        /// controller then counts any listing.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub observed_generation: Option<i64>,
        /// The agent can hold addresses: macvlan usable and, if set, the
        /// default uplink present.
        #[serde(default)]
        pub ready: bool,
        /// Why not ready (or `Ready`), in the agent's words.
        #[serde(default)]
        pub reason: String,
        #[serde(default)]
        pub macvlan_ready: bool,
        /// The uplink used when an assignment names none.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub default_uplink: Option<String>,
        /// The MACs (lower case) of the node's own network cards and
        /// uplink: no Service may use one (the LAN's switches would send
        /// the node's traffic to the Service's holder).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub nic_macs: Vec<String>,
        /// The MAC (lower case) of the default gateway, as the node's ARP
        /// table has it: no Service may use it either.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub gateway_mac: Option<String>,
        /// The MACs (lower case) the DHCP server's replies to this node's
        /// leases came from (the server's, or a relay's): no Service may
        /// use one either, since a DISCOVER from it would move that host's
        /// port at the switches and be offered that host's lease (issue
        /// #49). Sorted.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub dhcp_server_macs: Vec<String>,
        /// The default gateway's address: never published as a Service's
        /// address, whatever a node reports BOUND.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub gateway_address: Option<String>,
        /// Number of leases BOUND (printer column).
        #[serde(default)]
        pub held: u32,
        /// `10.77.0.150 (default/web), ...` for `kubectl get` (printer column).
        #[serde(default)]
        pub addresses: String,
        #[serde(default)]
        pub leases: Vec<LeaseReport>,
        #[serde(default)]
        pub agent_version: String,
        /// What the node's agent hears on its LAN (`crate::membership`):
        /// its own membership address, and the peers it witnesses and
        /// found dead. `None`: membership is not running.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub lan: Option<crate::membership::LanReport>,
        /// Kubernetes conditions, for `kubectl wait` and the tools that read
        /// conditions: [`READY`] says what `ready` and `reason` say, with
        /// the `observedGeneration` of the spec it was judged with.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub conditions: Vec<Condition>,
    }

    /// The condition type that mirrors `ready`.
    pub const READY: &str = "Ready";

    /// The [`READY`] condition's reason of a node that fenced itself (it
    /// hears too few of its peers and its gateway, or cannot write): the
    /// controller does not count its accusations, since the fenced side of
    /// a split LAN accuses the healthy side.
    pub const FENCED: &str = "Fenced";

    /// A Kubernetes condition (`metav1.Condition`'s fields).
    #[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
    #[serde(rename_all = "camelCase")]
    pub struct Condition {
        #[serde(rename = "type")]
        pub type_: String,
        /// `True`, `False` or `Unknown`.
        pub status: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub observed_generation: Option<i64>,
        /// RFC 3339: when `status` last changed.
        pub last_transition_time: String,
        /// CamelCase, for machines.
        pub reason: String,
        /// For people.
        #[serde(default)]
        pub message: String,
    }

    /// One lease as its holder sees it.
    #[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
    #[serde(rename_all = "camelCase")]
    pub struct LeaseReport {
        /// `namespace/name` from the assignment.
        pub service: String,
        pub interface: String,
        /// The DHCP state: `BOUND`, `SELECTING`, `INIT-REBOOT`, ... or
        /// `FAILED` when the lease could not be started (see `message`).
        pub state: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub address: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub server: Option<String>,
        /// RFC 3339.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub expires: Option<String>,
        /// The MAC the lease runs under (kube-vip's format).
        #[serde(default)]
        pub mac: String,
        /// Why the lease is not as assigned; a refused MAC begins with
        /// [`MAC_REFUSED_BY_HOLDER`].
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub message: Option<String>,
    }

    /// How a holder's [`LeaseReport::message`] begins when it refuses the
    /// assignment's MAC (another host on its LAN uses it, or the node
    /// itself): the controller tells the Service's owner with a Warning
    /// Event naming the annotation. What the holder still runs under
    /// another MAC it keeps.
    pub const MAC_REFUSED_BY_HOLDER: &str = "MAC refused: ";
}

/// The parts of a Service that decide whether it is ours.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServiceView {
    /// `spec.type`.
    pub type_: String,
    /// `spec.loadBalancerClass`.
    pub load_balancer_class: Option<String>,
    pub annotations: Annotations,
}

/// `namespace/name`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServiceKey {
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for ServiceKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// What a Service is to this agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    /// Its address comes from DHCP and a node of ours holds it.
    Primary,
    /// Shares its primary's address (Harvester's share-IP). Whether the
    /// primary is ours, and not itself a secondary, the controller decides
    /// with the whole set in view.
    Secondary { primary: ServiceKey },
    /// Not ours; the reason, for logs and Events.
    NotOurs(&'static str),
    /// A class-less LoadBalancer in pool mode: Harvester's pool allocates
    /// its address. Not ours either, but a Service of ours that turns into
    /// one changed its IPAM mode, which is refused.
    PoolMode,
    /// `harvester-node-agent.io/ignore: "true"`.
    OptedOut,
    /// Ours by its annotations, but one is malformed: an Event says which,
    /// and nothing that runs changes.
    Invalid(String),
}

/// Which `spec.loadBalancerClass` values are served (the controller's
/// `--load-balancer-class` and `--serve-classless`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassPolicy {
    /// Services of this class are ours whatever their annotations.
    pub class: String,
    /// Whether class-less Services in DHCP mode (what the Harvester cloud
    /// provider serves: `ipam: dhcp`, `loadbalancerIPs: 0.0.0.0`) are
    /// ours too.
    pub classless: bool,
}

impl Default for ClassPolicy {
    /// `LOAD_BALANCER_CLASS` and class-less DHCP Services: what a
    /// Harvester guest cluster wants.
    fn default() -> ClassPolicy {
        ClassPolicy {
            class: LOAD_BALANCER_CLASS.to_string(),
            classless: true,
        }
    }
}

/// Decides from one Service alone. Pool-mode Services are never ours: the
/// Harvester side allocates them. A Service of another class is not ours
/// before anything else is read of it: its implementation owns it whole.
pub fn select(svc: &ServiceView, classes: &ClassPolicy) -> Selection {
    if svc.type_ != "LoadBalancer" {
        return Selection::NotOurs("not type LoadBalancer");
    }
    let ours_by_class = match svc.load_balancer_class.as_deref() {
        Some(class) if class == classes.class => true,
        // The cloud-provider framework skips classed Services, and so do we.
        Some(_) => return Selection::NotOurs("another loadBalancerClass"),
        None if !classes.classless => {
            return Selection::NotOurs(
                "no loadBalancerClass, and this controller serves only its --load-balancer-class",
            );
        }
        None => false,
    };
    let a = &svc.annotations;
    if a.get(IGNORE).map(String::as_str) == Some("true") {
        return Selection::OptedOut;
    }
    if ours_by_class {
        return Selection::Primary;
    }
    if let Some(primary) = a.get(harvester::PRIMARY_SERVICE) {
        return match parse_service_key(primary) {
            Some(primary) => Selection::Secondary { primary },
            None => Selection::Invalid(format!(
                "{} must be `namespace/name`, not `{primary}`",
                harvester::PRIMARY_SERVICE
            )),
        };
    }
    let dhcp_ipam = a.get(harvester::IPAM).map(String::as_str) == Some("dhcp");
    let ask_dhcp = a.get(kube_vip::LOADBALANCER_IPS).map(|v| v.trim()) == Some(kube_vip::ASK_DHCP);
    if dhcp_ipam || ask_dhcp {
        Selection::Primary
    } else {
        Selection::PoolMode
    }
}

/// Whether a primary with these annotations lets Services of `namespace`
/// share its address: always within its own namespace (`primary_namespace`),
/// else only when [`SHARE_WITH`] names `namespace` or `*`.
pub fn shares_with(primary_namespace: &str, annotations: &Annotations, namespace: &str) -> bool {
    namespace == primary_namespace
        || annotations.get(SHARE_WITH).is_some_and(|list| {
            list.split([',', ' '])
                .map(str::trim)
                .any(|n| n == namespace || n == "*")
        })
}

pub fn parse_service_key(v: &str) -> Option<ServiceKey> {
    let (namespace, name) = v.trim().split_once('/')?;
    let ok = |s: &str| !s.is_empty() && !s.contains('/');
    (ok(namespace) && ok(name)).then(|| ServiceKey {
        namespace: namespace.to_string(),
        name: name.to_string(),
    })
}

/// Under which identity any node asks for a Service's lease: the same on
/// every node, so a failover keeps the address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddressIdentity {
    /// The macvlan's name.
    pub interface: String,
    pub mac: [u8; 6],
    /// Option 61; empty: none is sent (a Service kube-vip served without a
    /// hostname, which the server knows by its MAC).
    pub client_id: Vec<u8>,
    /// Option 12.
    pub hostname: Option<String>,
    /// The address to ask for first (INIT-REBOOT), from kube-vip's record.
    pub requested_ip: Option<Ipv4Addr>,
}

/// Why a Service has no usable identity: its UID, or one of kube-vip's
/// annotations on it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidIdentity {
    #[error("Service UID `{0}` has fewer than 8 hex digits")]
    ShortUid(String),
    #[error("{key}: `{value}` is not a unicast MAC like 00:00:6c:12:34:56", key = kube_vip::HWADDR, value = .0)]
    Mac(String),
    #[error("{key}: `{value}` is not an IPv4 address", key = kube_vip::REQUESTED_IP, value = .0)]
    RequestedIp(String),
    #[error("{key}: `{value}` is not a valid hostname", key = kube_vip::LOADBALANCER_HOSTNAME, value = .0)]
    Hostname(String),
}

impl AddressIdentity {
    /// The identity of the Service with `uid`: kube-vip's `hwaddr`,
    /// `requestedIP` and `loadbalancerHostname` when present (a Service
    /// that kube-vip served keeps its address and its client), otherwise a
    /// locally administered unicast MAC and a client identifier derived
    /// from the UID.
    pub fn of(uid: &str, annotations: &Annotations) -> Result<AddressIdentity, InvalidIdentity> {
        identity(uid, annotations)
    }
}

fn identity(uid: &str, annotations: &Annotations) -> Result<AddressIdentity, InvalidIdentity> {
    let hex: String = uid
        .chars()
        .filter(char::is_ascii_hexdigit)
        .take(8)
        .collect::<String>()
        .to_ascii_lowercase();
    if hex.len() < 8 {
        return Err(InvalidIdentity::ShortUid(uid.to_string()));
    }
    let mac = match annotations.get(kube_vip::HWADDR) {
        Some(v) => {
            crate::mac::parse_unicast(v).ok_or_else(|| InvalidIdentity::Mac(v.to_string()))?
        }
        None => derived_mac(uid),
    };
    let requested_ip = match annotations.get(kube_vip::REQUESTED_IP) {
        Some(v) if !v.trim().is_empty() => Some(
            v.trim()
                .parse::<Ipv4Addr>()
                .map_err(|_| InvalidIdentity::RequestedIp(v.to_string()))?,
        ),
        _ => None,
    };
    let hostname = match annotations.get(kube_vip::LOADBALANCER_HOSTNAME) {
        Some(h) if crate::k8s_names::is_dns_subdomain(h.trim()) => Some(h.trim().to_string()),
        Some(h) => {
            return Err(InvalidIdentity::Hostname(h.to_string()));
        }
        None => None,
    };
    // The server must see the client kube-vip was: kube-vip sends the
    // hostname itself as option 61 (no type byte), and without a hostname
    // no option 61 at all, so the server knows the lease by its MAC. A
    // `hwaddr` that is not our own derived MAC is kube-vip's (we write back
    // the derived one), and a client identifier of ours would make the
    // server treat the Service as a new client with a new address.
    let kube_vips_mac = annotations.contains_key(kube_vip::HWADDR) && mac != derived_mac(uid);
    let client_id = match &hostname {
        Some(h) => h.as_bytes().to_vec(),
        None if kube_vips_mac => Vec::new(),
        // RFC 2132 type 0: an identifier that is not a hardware address.
        None => [&[0u8][..], b"hna/", uid.as_bytes()].concat(),
    };
    Ok(AddressIdentity {
        interface: format!("{INTERFACE_PREFIX}{hex}"),
        mac,
        client_id,
        hostname,
        requested_ip,
    })
}

/// A locally administered unicast MAC from the UID (FNV-1a, 64 bits): the
/// same on every node, unlikely to meet another Service's (46 free bits).
pub(crate) fn derived_mac(uid: &str) -> [u8; 6] {
    let b = fnv1a(&[uid.as_bytes()]).to_be_bytes();
    [(b[0] & 0xfc) | 0x02, b[1], b[2], b[3], b[4], b[5]]
}

/// Liveness on the LAN: the agents of one LAN watch each other there (SWIM,
/// with each node's death confirmed by its witnesses). What the controller
/// and the agents must agree on: where the key is, who a node's peers and
/// witnesses are, and what a node reports.
pub mod membership {
    use serde::{Deserialize, Serialize};

    /// The Secret (in the controller's namespace) holding the cluster key
    /// that seals every membership packet; the controller creates it, each
    /// node's Role may read it (and nothing else of the namespace's).
    pub const SECRET_NAME: &str = "harvester-node-agent-membership";
    /// Its data key: at least 32 random bytes.
    pub const SECRET_KEY: &str = "key";
    /// The UDP port the agents' membership listens on (`lb_membership_port`).
    pub const DEFAULT_PORT: u16 = 7947;
    /// How many witnesses each node has: the nodes after it on the ring.
    pub(crate) const WITNESSES: usize = 3;

    /// Another member of a node's LAN.
    #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
    #[serde(rename_all = "camelCase")]
    pub struct Peer {
        pub name: String,
        /// `ip:port` its membership listens on.
        pub address: String,
    }

    /// A node's membership, in its status.
    #[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
    #[serde(rename_all = "camelCase")]
    pub struct LanReport {
        /// `ip:port` the membership listens on (the default uplink's
        /// address).
        pub address: String,
        /// The uplink's subnet (`10.77.0.0/24`): nodes on the same one are
        /// peers.
        pub network: String,
        /// The peers this node witnesses that it found dead on the LAN (its
        /// own probes went unanswered), sorted. Counted only while the
        /// node's heartbeat is on time by its stated period: a node cut off
        /// from the API server cannot take an accusation back.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub down: Vec<String>,
        /// The peers this node witnesses whose probes it hears answered,
        /// sorted: the controller does not move a node whose status went
        /// stale (cut off from the API server) while a witness still hears
        /// it on the LAN.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub hears: Vec<String>,
        /// How many of its peers the membership counts alive (changes when
        /// one joins, leaves or dies, not otherwise).
        #[serde(default)]
        pub alive: u32,
        /// This node hears none of its peers, or too few of its witnesses
        /// to escape their verdict (the silences its fence counts), as of
        /// its last write. Set within a fraction of its address lifetime,
        /// before its witnesses may report it: a node its witnesses then
        /// find dead on the LAN that wrote this was still in touch with
        /// the API server after its LAN went quiet, so it still reads its
        /// assignments and lets go of what moves (the controller waits for
        /// that before it gives the addresses to another node).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        pub unheard: bool,
    }

    /// The position of `name` on the ring: a hash, so that neighbours on
    /// the ring are not neighbours by name (racks, naming schemes).
    fn ring_key(name: &str) -> (u64, &str) {
        (crate::fnv1a(&[b"hna-ring", name.as_bytes()]), name)
    }

    /// `members` in ring order, each once.
    fn sorted_ring<'a>(members: impl IntoIterator<Item = &'a str>) -> Vec<(u64, &'a str)> {
        let mut ring: Vec<(u64, &str)> = members.into_iter().map(ring_key).collect();
        ring.sort_unstable();
        ring.dedup();
        ring
    }

    /// The witnesses of `node` among `members` (which may or may not
    /// include it): the `WITNESSES` members after it on the ring, fewer
    /// when the LAN has fewer other members.
    pub fn witnesses_of<'a>(members: impl IntoIterator<Item = &'a str>, node: &str) -> Vec<String> {
        let ring = sorted_ring(members.into_iter().filter(|m| *m != node));
        let at = ring.partition_point(|k| *k < ring_key(node));
        (0..ring.len().min(WITNESSES))
            .map(|i| ring[(at + i) % ring.len()].1.to_string())
            .collect()
    }

    /// [`witnesses_of`] for every member at once, from one sort of the
    /// ring (the controller judges every node of a LAN on every wake-up:
    /// one sort per node cost it a quadratic pass at 500 nodes).
    pub fn witnesses_all<'a>(
        members: impl IntoIterator<Item = &'a str>,
    ) -> std::collections::BTreeMap<&'a str, Vec<String>> {
        let ring = sorted_ring(members);
        let n = ring.len();
        let each = WITNESSES.min(n.saturating_sub(1));
        ring.iter()
            .enumerate()
            .map(|(i, (_, name))| {
                let w = (1..=each).map(|d| ring[(i + d) % n].1.to_string());
                (*name, w.collect())
            })
            .collect()
    }

    /// How many members on each side of a node on the ring are its peers
    /// (its `spec.peers`, the only members its membership talks to). Its
    /// witnesses and those it witnesses (`WITNESSES` each way) come out
    /// the same among its peers as on the whole ring, with room for SWIM's
    /// indirect probes; a node's spec stays small and a join rewrites
    /// `2 × PEERS_EACH_SIDE` specs, not every one (with every member a
    /// peer, a node's spec named 499 others at 500 nodes: 22 KB written
    /// again with each status heartbeat, issue #30).
    pub const PEERS_EACH_SIDE: usize = 8;

    /// Every member's peers ([`PEERS_EACH_SIDE`] each way on the ring;
    /// every other member on a LAN of `2 × PEERS_EACH_SIDE + 1` or fewer),
    /// each list sorted by name. The relation is symmetric: a node's peers
    /// have it as a peer.
    pub fn ring_peers<'a>(
        members: impl IntoIterator<Item = &'a str>,
    ) -> std::collections::BTreeMap<&'a str, Vec<&'a str>> {
        let ring = sorted_ring(members);
        let n = ring.len();
        ring.iter()
            .enumerate()
            .map(|(i, (_, name))| {
                let mut peers: Vec<&str> = if n <= 2 * PEERS_EACH_SIDE + 1 {
                    ring.iter().map(|(_, m)| *m).filter(|m| m != name).collect()
                } else {
                    (1..=PEERS_EACH_SIDE)
                        .flat_map(|d| [ring[(i + d) % n].1, ring[(i + n - d) % n].1])
                        .collect()
                };
                peers.sort_unstable();
                (*name, peers)
            })
            .collect()
    }

    /// The members `node` is a witness of: those whose witnesses include
    /// it.
    pub fn witnessed_by<'a>(
        members: impl IntoIterator<Item = &'a str> + Clone,
        node: &'a str,
    ) -> Vec<String> {
        let all: Vec<&str> = members.clone().into_iter().chain([node]).collect();
        members
            .into_iter()
            .filter(|m| {
                *m != node
                    && witnesses_of(all.iter().copied(), m)
                        .iter()
                        .any(|w| w == node)
            })
            .map(str::to_string)
            .collect()
    }
}

/// FNV-1a (64 bits) over `parts`, each followed by a zero byte: stable
/// across processes and versions (unlike `std`'s seeded hasher), so every
/// node and every controller replica derives the same value.
pub fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in part.iter().chain([0u8].iter()) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "3f2a9c1e-77b0-4d2e-9a51-0c8d2b6e4f11";

    fn svc(type_: &str, class: Option<&str>, annotations: &[(&str, &str)]) -> ServiceView {
        ServiceView {
            type_: type_.into(),
            load_balancer_class: class.map(str::to_string),
            annotations: annotations
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }

    #[test]
    fn which_services_are_ours() {
        let lb = "LoadBalancer";
        let table: &[(ServiceView, Selection)] = &[
            (
                svc(lb, None, &[(harvester::IPAM, "dhcp")]),
                Selection::Primary,
            ),
            (
                svc(lb, None, &[(kube_vip::LOADBALANCER_IPS, "0.0.0.0")]),
                Selection::Primary,
            ),
            (svc(lb, Some(LOAD_BALANCER_CLASS), &[]), Selection::Primary),
            (
                svc(lb, Some("other.io/lb"), &[(harvester::IPAM, "dhcp")]),
                Selection::NotOurs("another loadBalancerClass"),
            ),
            (
                svc(lb, None, &[(harvester::IPAM, "pool")]),
                Selection::PoolMode,
            ),
            (
                svc(lb, None, &[(kube_vip::LOADBALANCER_IPS, "10.0.0.5")]),
                Selection::PoolMode,
            ),
            (
                svc("ClusterIP", None, &[(harvester::IPAM, "dhcp")]),
                Selection::NotOurs("not type LoadBalancer"),
            ),
            (
                svc(lb, None, &[(harvester::IPAM, "dhcp"), (IGNORE, "true")]),
                Selection::OptedOut,
            ),
            (
                // A secondary loses its ipam annotation and gets its
                // primary's address from the cloud provider.
                svc(
                    lb,
                    None,
                    &[
                        (harvester::PRIMARY_SERVICE, "default/web"),
                        (kube_vip::LOADBALANCER_IPS, "10.77.0.150"),
                    ],
                ),
                Selection::Secondary {
                    primary: ServiceKey {
                        namespace: "default".into(),
                        name: "web".into(),
                    },
                },
            ),
        ];
        let default = ClassPolicy::default();
        for (view, want) in table {
            assert_eq!(&select(view, &default), want, "{view:?}");
        }
        assert!(matches!(
            select(
                &svc(lb, None, &[(harvester::PRIMARY_SERVICE, "web")]),
                &default
            ),
            Selection::Invalid(_)
        ));
        // kube-vip's own opt-out is not ours: it is how a Service moves
        // from kube-vip to this agent.
        assert_eq!(
            select(
                &svc(
                    lb,
                    None,
                    &[(harvester::IPAM, "dhcp"), ("kube-vip.io/ignore", "true")]
                ),
                &default
            ),
            Selection::Primary
        );
    }

    #[test]
    fn sharing_across_namespaces_needs_the_primarys_consent() {
        let none = Annotations::new();
        let some: Annotations = [(SHARE_WITH.to_string(), "team-a, team-c".to_string())].into();
        let all: Annotations = [(SHARE_WITH.to_string(), "*".to_string())].into();
        assert!(shares_with("team-b", &none, "team-b"), "own namespace");
        assert!(!shares_with("team-b", &none, "team-a"));
        assert!(shares_with("team-b", &some, "team-a"));
        assert!(shares_with("team-b", &some, "team-c"));
        assert!(!shares_with("team-b", &some, "team"), "whole names only");
        assert!(shares_with("team-b", &all, "anyone"));
    }

    #[test]
    fn a_configured_class_is_served_and_classless_services_only_when_asked() {
        let lb = "LoadBalancer";
        let dhcp = [(harvester::IPAM, "dhcp")];
        let only = ClassPolicy {
            class: "example.com/dhcp".into(),
            classless: false,
        };
        let also = ClassPolicy {
            classless: true,
            ..only.clone()
        };
        for classes in [&only, &also] {
            assert_eq!(
                select(&svc(lb, Some("example.com/dhcp"), &[]), classes),
                Selection::Primary
            );
            // The default class is just another class once one is named.
            assert_eq!(
                select(&svc(lb, Some(LOAD_BALANCER_CLASS), &dhcp), classes),
                Selection::NotOurs("another loadBalancerClass")
            );
            // Another class is never read further: not even its opt-out.
            assert_eq!(
                select(&svc(lb, Some("other.io/lb"), &[(IGNORE, "true")]), classes),
                Selection::NotOurs("another loadBalancerClass")
            );
        }
        assert!(matches!(
            select(&svc(lb, None, &dhcp), &only),
            Selection::NotOurs(_)
        ));
        assert_eq!(select(&svc(lb, None, &dhcp), &also), Selection::Primary);
    }

    #[test]
    fn every_node_derives_the_same_identity() {
        let id = AddressIdentity::of(UID, &Annotations::new()).unwrap();
        assert_eq!(id, AddressIdentity::of(UID, &Annotations::new()).unwrap());
        assert_eq!(id.interface, "hlb-3f2a9c1e");
        assert!(id.interface.len() <= 15, "IFNAMSIZ");
        assert_eq!(id.mac[0] & 0x03, 0x02, "locally administered unicast");
        assert_eq!(id.client_id[0], 0, "RFC 2132 type 0");
        assert!(id.client_id.ends_with(UID.as_bytes()));
        assert_eq!((id.hostname, id.requested_ip), (None, None));
        let other =
            AddressIdentity::of("9f2a9c1e-0000-4000-8000-000000000000", &Annotations::new())
                .unwrap();
        assert_ne!(other.mac, id.mac);
    }

    #[test]
    fn kube_vips_record_is_honoured() {
        let a: Annotations = [
            (kube_vip::HWADDR, "00:00:6C:AB:CD:EF"),
            (kube_vip::REQUESTED_IP, "10.77.0.150"),
            (kube_vip::LOADBALANCER_HOSTNAME, "web-lb"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let id = AddressIdentity::of(UID, &a).unwrap();
        assert_eq!(id.mac, [0x00, 0x00, 0x6c, 0xab, 0xcd, 0xef]);
        assert_eq!(
            crate::mac::format(&id.mac),
            "00:00:6c:ab:cd:ef",
            "kube-vip's format"
        );
        assert_eq!(id.requested_ip, Some(Ipv4Addr::new(10, 77, 0, 150)));
        assert_eq!(id.hostname.as_deref(), Some("web-lb"));
        assert_eq!(id.client_id, b"web-lb", "as kube-vip sends it");
    }

    /// kube-vip without a hostname sends no client identifier; the server
    /// knows its lease by the MAC, so we must not send one either. Our own
    /// written-back MAC keeps our identifier.
    #[test]
    fn kube_vips_mac_without_a_hostname_means_no_client_identifier() {
        let with = |mac: String| -> Annotations { [(kube_vip::HWADDR.to_string(), mac)].into() };
        let theirs = AddressIdentity::of(UID, &with("00:00:6c:ab:cd:ef".into())).unwrap();
        assert!(theirs.client_id.is_empty());
        let ours = AddressIdentity::of(UID, &with(crate::mac::format(&derived_mac(UID)))).unwrap();
        assert_eq!(ours, AddressIdentity::of(UID, &Annotations::new()).unwrap());
    }

    #[test]
    fn malformed_records_are_errors_not_guesses() {
        for (k, v) in [
            (kube_vip::HWADDR, "01:00:5e:00:00:01"),
            (kube_vip::HWADDR, "00:00:00:00:00:00"),
            (kube_vip::HWADDR, "zz:00:6c:ab:cd:ef"),
            (kube_vip::REQUESTED_IP, "10.77.0"),
            (kube_vip::LOADBALANCER_HOSTNAME, "Not A Host"),
        ] {
            let a: Annotations = [(k.to_string(), v.to_string())].into();
            let e = AddressIdentity::of(UID, &a).unwrap_err().to_string();
            assert!(e.starts_with(k), "{e}");
        }
        assert!(AddressIdentity::of("short", &Annotations::new()).is_err());
    }

    #[test]
    fn service_keys() {
        assert_eq!(
            parse_service_key(" kube-system/traefik ")
                .unwrap()
                .to_string(),
            "kube-system/traefik"
        );
        for bad in ["", "a", "/b", "a/", "a/b/c"] {
            assert_eq!(parse_service_key(bad), None, "{bad}");
        }
    }

    #[test]
    fn every_member_has_three_witnesses_and_witnesses_know_whom_they_watch() {
        let names: Vec<String> = (0..20).map(|i| format!("node-{i}")).collect();
        let members: Vec<&str> = names.iter().map(String::as_str).collect();
        let mut watched_count = std::collections::BTreeMap::new();
        for n in &members {
            let w = membership::witnesses_of(members.iter().copied(), n);
            assert_eq!(w.len(), 3, "{n}: {w:?}");
            assert!(!w.iter().any(|x| x == n));
            let unique: std::collections::BTreeSet<_> = w.iter().collect();
            assert_eq!(unique.len(), 3);
            for x in &w {
                *watched_count.entry(x.clone()).or_insert(0) += 1;
                let others: Vec<&str> = members.iter().copied().filter(|m| m != x).collect();
                assert!(
                    membership::witnessed_by(others.iter().copied(), x)
                        .iter()
                        .any(|m| m == n),
                    "{x} witnesses {n} but does not know it"
                );
            }
        }
        // A ring: every member witnesses exactly three others.
        assert!(watched_count.values().all(|c| *c == 3), "{watched_count:?}");
        // The same answer whether the node itself is in the list or not.
        let others: Vec<&str> = members[1..].to_vec();
        assert_eq!(
            membership::witnesses_of(others.iter().copied(), members[0]),
            membership::witnesses_of(members.iter().copied(), members[0])
        );
        // Small LANs: everyone else.
        assert_eq!(
            membership::witnesses_of(["a", "b"], "a"),
            vec!["b".to_string()]
        );
        assert!(membership::witnesses_of(["a"], "a").is_empty());
    }

    #[test]
    fn every_members_witnesses_at_once_are_each_members_own() {
        for n in 0..=100 {
            let names: Vec<String> = (0..n).map(|i| format!("node-{i}")).collect();
            let members: Vec<&str> = names.iter().map(String::as_str).collect();
            let all = membership::witnesses_all(members.iter().copied());
            assert_eq!(all.len(), n);
            for m in &members {
                assert_eq!(
                    all[m],
                    membership::witnesses_of(members.iter().copied(), m),
                    "{m} of {n}"
                );
            }
        }
    }

    /// A node computes its witnesses, and whom it witnesses, from its
    /// peers only: the answers must be the whole ring's.
    #[test]
    fn among_its_ring_peers_a_node_finds_the_whole_rings_witnesses() {
        for size in [1, 2, 3, 5, 16, 17, 18, 40, 100] {
            let names: Vec<String> = (0..size).map(|i| format!("sim-{i:04}")).collect();
            let all: Vec<&str> = names.iter().map(String::as_str).collect();
            let peers = membership::ring_peers(all.iter().copied());
            assert_eq!(peers.len(), size);
            for n in &all {
                let mine = &peers[n];
                assert!(mine.len() <= 2 * membership::PEERS_EACH_SIDE, "{n}");
                assert_eq!(mine.len(), (size - 1).min(2 * membership::PEERS_EACH_SIDE));
                assert!(!mine.contains(n));
                for p in mine {
                    assert!(peers[p].contains(n), "{p} is {n}'s peer, not the other way");
                }
                let with_me = mine.iter().copied().chain([*n]);
                assert_eq!(
                    membership::witnesses_of(with_me, n),
                    membership::witnesses_of(all.iter().copied(), n),
                    "{n}'s witnesses, {size} members"
                );
                let others: Vec<&str> = all.iter().copied().filter(|m| m != n).collect();
                assert_eq!(
                    membership::witnessed_by(mine.iter().copied(), n),
                    membership::witnessed_by(others.iter().copied(), n),
                    "whom {n} witnesses, {size} members"
                );
            }
        }
    }
}
