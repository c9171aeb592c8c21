//! Configuration: one TOML file, every key overridable by environment variable
//! and command-line flag (flag > environment > file > default).
//!
//! Resolution is a pure function over already-read inputs so that every error
//! path is unit-testable and nothing on the host is touched before the whole
//! configuration is known to be valid.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use hna_contract::k8s_names::{DEFAULT_TOPOLOGY_KEYS, is_dns_subdomain, validate_label_key};

/// Where the agent looks for its configuration file when none is given.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/harvester-node-agent/config.toml";
/// Environment variable naming the configuration file.
pub(crate) const CONFIG_ENV: &str = "HNA_CONFIG";

/// The shape a key's value must have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Text,
    Path,
    PathList,
    /// A list of strings (TOML array; comma-separated in environment and flag).
    TextList,
    Duration,
    /// `true` or `false` (also `1`/`0`, `yes`/`no` in environment and flag).
    Bool,
    /// A UDP or TCP port, 0-65535.
    Port,
}

/// One configuration key: its name in the file, its environment variable,
/// its flag and what it means (its default is set in `defaults`). The
/// configuration reference table in docs/operations.md is this list.
#[derive(Debug, Clone, Copy)]
pub struct KeySpec {
    pub name: &'static str,
    pub(crate) env: &'static str,
    pub(crate) flag: &'static str,
    // why: only the unit test that holds docs/operations.md's key table to
    // this one reads the text.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) doc: &'static str,
    kind: Kind,
}

pub const KEYS: &[KeySpec] = &[
    KeySpec {
        name: "log_level",
        env: "HNA_LOG_LEVEL",
        flag: "--log-level",
        doc: "Log filter: a level (error, warn, info, debug, trace) or tracing directives such as `info,kube=warn`. RUST_LOG, when set, wins over it.",
        kind: Kind::Text,
    },
    KeySpec {
        name: "log_target",
        env: "HNA_LOG_TARGET",
        flag: "--log-target",
        doc: "Where logs go: `journald` (structured fields), `stderr`, or `auto` (journald when /run/systemd/journal/socket exists, else stderr).",
        kind: Kind::Text,
    },
    KeySpec {
        name: "state_dir",
        env: "HNA_STATE_DIR",
        flag: "--state-dir",
        doc: "Directory for persistent state: the DHCP leases, and what one run keeps for the next (loadbalancer/: the last LoadBalancerNode spec read, the LAN membership key, the witnesses' word and the membership's run epoch, each mode 0600), so that an agent restarted while the API server cannot be read still holds its addresses. Created with mode 0700 if missing. Absolute path.",
        kind: Kind::Path,
    },
    KeySpec {
        name: "socket",
        env: "HNA_SOCKET",
        flag: "--socket",
        doc: "Unix socket on which the daemon answers `status`. Absolute path, at most 107 bytes.",
        kind: Kind::Path,
    },
    KeySpec {
        name: "node_name",
        env: "HNA_NODE_NAME",
        flag: "--node-name",
        doc: "Name of this node's Node object. Defaults to the hostname, as the Harvester node driver names VMs and kubelets.",
        kind: Kind::Text,
    },
    KeySpec {
        name: "kubeconfig",
        env: "HNA_KUBECONFIG",
        flag: "--kubeconfig",
        doc: "Kubeconfig of the guest cluster. When set, only this file is used (the daemon waits for it to appear). When unset, see `kubeconfig_search`.",
        kind: Kind::Path,
    },
    KeySpec {
        name: "kubeconfig_search",
        env: "HNA_KUBECONFIG_SEARCH",
        flag: "--kubeconfig-search",
        doc: "Kubeconfigs tried in order when `kubeconfig` is unset (environment and flag: colon-separated). Default: /var/lib/rancher/rke2/agent/kubelet.kubeconfig, /var/lib/rancher/k3s/agent/kubelet.kubeconfig, /etc/kubernetes/kubelet.conf.",
        kind: Kind::PathList,
    },
    KeySpec {
        name: "credentials_retry",
        env: "HNA_CREDENTIALS_RETRY",
        flag: "--credentials-retry",
        doc: "How often the daemon looks for credentials before the node has joined, and re-checks the API server after. Between 1s and 1h.",
        kind: Kind::Duration,
    },
    KeySpec {
        name: "macvlan_recheck",
        env: "HNA_MACVLAN_RECHECK",
        flag: "--macvlan-recheck",
        doc: "How often the daemon re-runs the macvlan preflight (detect, load if on disk, probe). `systemctl reload` (SIGHUP) re-runs it at once. Between 10s and 24h.",
        kind: Kind::Duration,
    },
    KeySpec {
        name: "cloud_config",
        env: "HNA_CLOUD_CONFIG",
        flag: "--cloud-config",
        doc: "Harvester cloud-provider kubeconfig (as generate_addon.sh makes it; the VMs' namespace comes from its context), used to read this VM's VirtualMachineInstance for the topology relay. When set, only this file is used. Default: /etc/kubernetes/cloud-config, then /var/lib/rancher/rke2/etc/config-files/cloud-provider-config. Looked at again every `credentials_retry` until it appears or changes.",
        kind: Kind::Path,
    },
    KeySpec {
        name: "vm_name",
        env: "HNA_VM_NAME",
        flag: "--vm-name",
        doc: "Name of this VM's VirtualMachineInstance in Harvester. Defaults to the hostname, as the Harvester node driver names VMs.",
        kind: Kind::Text,
    },
    KeySpec {
        name: "topology_labels",
        env: "HNA_TOPOLOGY_LABELS",
        flag: "--topology-labels",
        doc: "Label keys relayed from Harvester to this node's Node (environment and flag: comma-separated). Default: topology.kubernetes.io/region, topology.kubernetes.io/zone. Empty turns the relay off.",
        kind: Kind::TextList,
    },
    KeySpec {
        name: "metrics_listen",
        env: "HNA_METRICS_LISTEN",
        flag: "--metrics-listen",
        doc: "Address and port of the HTTP endpoint serving Prometheus `/metrics` (DHCP leases, macvlan, qemu-guest-agent, cluster) and `/healthz`, such as `127.0.0.1:9477`. Off when unset or empty. A non-loopback address exposes it to the network: restrict it with a firewall.",
        kind: Kind::Text,
    },
    KeySpec {
        name: "namespace",
        env: "HNA_NAMESPACE",
        flag: "--namespace",
        doc: "Namespace of the controller and of this node's LoadBalancerNode object (the LoadBalancer addresses assigned to this node). Must match the controller's.",
        kind: Kind::Text,
    },
    KeySpec {
        name: "lb_heartbeat",
        env: "HNA_LB_HEARTBEAT",
        flag: "--lb-heartbeat",
        doc: "How often the daemon rewrites the heartbeat in its LoadBalancerNode status when nothing in it changed (a change is written within a second; a DHCP renewal alone is no change). The backstop of liveness, at the kubelet's node-Lease rate: a node's death is found on the LAN by its peers (lb_membership_port) within about 2s; a node no peer vouches for is counted dead by the controller once its heartbeat has not changed for 40s (its --node-stale-after). A node whose period does not fit twice in that bound gets no address (the period is in the status). While this node reports a peer dead on the LAN it beats every 2s instead (at most 5 minutes per report), since the controller counts a report only while its writer's heartbeat is on time. Between 200ms and 10s.",
        kind: Kind::Duration,
    },
    KeySpec {
        name: "lb_arp_probe",
        env: "HNA_LB_ARP_PROBE",
        flag: "--lb-arp-probe",
        doc: "Probe a LoadBalancer address with ARP (RFC 5227) before using it, and decline it when another host answers. Turning it off saves about 300 ms per new lease on networks where the DHCP server is the only authority.",
        kind: Kind::Bool,
    },
    KeySpec {
        name: "lb_takeover_guard",
        env: "HNA_LB_TAKEOVER_GUARD",
        flag: "--lb-takeover-guard",
        doc: "Before this node brings up an address another node held, it asks the LAN for this long (two ARP probes from the uplink's own MAC) whether anybody still answers for it, and waits while somebody does: two nodes never answer for one address. 0s turns the guard off. At most 5s.",
        kind: Kind::Duration,
    },
    KeySpec {
        name: "lb_address_lifetime",
        env: "HNA_LB_ADDRESS_LIFETIME",
        flag: "--lb-address-lifetime",
        doc: "Every LoadBalancer address is configured with this lifetime (the kernel's valid_lft) and the daemon confirms it four times per lifetime: a daemon that stops running (frozen, hung, starved of CPU) stops answering for its addresses within this bound, enforced by the kernel, and after it runs again it brings none back before its takeover guard has checked the LAN. A node's witnesses on the LAN report it dead only after its probes went unanswered for longer than this lifetime (its answers carry it) plus 250ms, so its addresses are gone by then; a node that cannot hear its LAN for this long lets go of them itself (unless the API server still hears it). Keep it plus lb_heartbeat below the controller's --node-stale-after (40s). Keep it above the longest the daemon may go without CPU. Whole seconds; 0s turns it off (addresses stay until removed). Otherwise between 1s and 60s.",
        kind: Kind::Duration,
    },
    KeySpec {
        name: "lb_fence_after",
        env: "HNA_LB_FENCE_AFTER",
        flag: "--lb-fence-after",
        doc: "Self-fencing without a view of the LAN (lb_membership_port = 0, or no peer heard): when the daemon has not been able to write its status for this long, it hands every LoadBalancer address over and holds none until a write succeeds. Keep it below the controller's --node-stale-after (40s), after which the node's Services move. With the LAN membership running, an API-server outage never fences a node that hears its peers; a node fences when it hears none of them, or too few of its witnesses, for lb_address_lifetime and no status write succeeded since. 0s is never. Otherwise between 10s and 1h.",
        kind: Kind::Duration,
    },
    KeySpec {
        name: "lb_membership_port",
        env: "HNA_LB_MEMBERSHIP_PORT",
        flag: "--lb-membership-port",
        doc: "The UDP port on the default uplink's address where the agents of one LAN watch each other (SWIM, packets sealed with the cluster key from the Secret harvester-node-agent-membership): a node whose agent its witnesses cannot reach on the LAN has its Services moved within about 2 s. Allow it between the nodes (not from elsewhere). 0 turns it off: the node is then judged by its status heartbeat only.",
        kind: Kind::Port,
    },
    KeySpec {
        name: "lb_restart_grace",
        env: "HNA_LB_RESTART_GRACE",
        flag: "--lb-restart-grace",
        doc: "When the daemon stops for a restart (see lb_keep_on_stop), it leaves every LoadBalancer address on its link for this long instead of handing it over, and says so in its last status: the controller moves nothing for that long and the next run adopts the links (same lease, nothing sent). A restart that takes longer moves the Services as a dead node's, the kernel dropping the addresses when this runs out. 0s always hands over. Otherwise between 1s and 5m.",
        kind: Kind::Duration,
    },
    KeySpec {
        name: "lb_keep_on_stop",
        env: "HNA_LB_KEEP_ON_STOP",
        flag: "--lb-keep-on-stop",
        doc: "Which stops keep the addresses for lb_restart_grace: restart (only a restart of the unit by systemd: systemctl restart, a package upgrade; systemctl stop, a shutdown and a crash hand every address over at once) or always (every SIGTERM: for a supervisor other than systemd that restarts the daemon).",
        kind: Kind::Text,
    },
    KeySpec {
        name: "lb_pause_clock",
        env: "HNA_LB_PAUSE_CLOCK",
        flag: "--lb-pause-clock",
        doc: "The clock that counts the time this VM stands paused (a live migration's switchover, a suspend), which the VM's own clocks do not: its RTC's seconds, read every 10ms around each change of its second and at least every 50ms in between (about 27 times a second), so a long pause is seen within 50ms of the resume. After a pause of 50ms or more the daemon announces every LoadBalancer address it holds again (gratuitous ARP from the Service's MAC), so that the LAN's switches learn the Service MACs' new port after a live migration also where the NIC does not announce them (e1000-family NICs), and after a pause that may have been as long as lb_address_lifetime and the witnesses' 250ms margin (the watch's bound plus the RTC's second: from lb_address_lifetime - 0.8s on) it sets every LoadBalancer link down at once instead of announcing (the resumed kernel would answer for the addresses beside their new holders), hands the addresses over and takes back through the takeover guard what is still assigned here. Empty turns it off; a file that cannot be read is logged once and the watch stops.",
        kind: Kind::Text,
    },
    KeySpec {
        name: "lb_presence",
        env: "HNA_LB_PRESENCE",
        flag: "--lb-presence",
        doc: "While a LoadBalancer address is held, one frame from its MAC (an ARP announcement unicast to the DHCP server's MAC, which nobody answers) every half second, so that the LAN's switches move the Service's traffic to the VM's new port within a second of a live migration's switchover, whether or not the daemon learns of the migration. auto sends them only on an uplink that is a hypervisor's NIC whose guest is not told of a migration (e1000-family and other emulated NICs; a virtio-net NIC that negotiated guest announce has the kernel announce every address itself, and a veth, bridge, bond or VLAN uplink is taken for no such NIC). A duration between 100ms and 10s sends them that often on every uplink; off never. Costs two 60-byte frames a second per address, to one host.",
        kind: Kind::Text,
    },
    KeySpec {
        name: "uplink",
        env: "HNA_UPLINK",
        flag: "--uplink",
        doc: "Interface the LoadBalancer macvlans sit on when a Service names none (kube-vip.io/serviceInterface). Default: the interface of the IPv4 default route, looked at again on every change.",
        kind: Kind::Text,
    },
];

pub(crate) fn key_spec(name: &str) -> Option<&'static KeySpec> {
    KEYS.iter().find(|k| k.name == name)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogTarget {
    Auto,
    Journald,
    Stderr,
}

/// The validated configuration every subcommand works from.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// The file that was read, if any.
    pub file: Option<PathBuf>,
    pub log_level: String,
    pub log_target: LogTarget,
    pub state_dir: PathBuf,
    pub socket: PathBuf,
    pub node_name: String,
    pub(crate) kubeconfig: Option<PathBuf>,
    pub(crate) kubeconfig_search: Vec<PathBuf>,
    pub credentials_retry: Duration,
    pub(crate) macvlan_recheck: Duration,
    /// Harvester cloud-provider kubeconfig; `None` searches the defaults.
    pub(crate) cloud_config: Option<PathBuf>,
    /// This VM's VirtualMachineInstance name.
    pub(crate) vm_name: String,
    /// Label keys the topology relay manages.
    pub(crate) topology_labels: Vec<String>,
    /// Where `/metrics` and `/healthz` are served; `None` is off.
    pub(crate) metrics_listen: Option<std::net::SocketAddr>,
    /// Namespace of this node's `LoadBalancerNode` object.
    pub(crate) namespace: String,
    /// How often the LoadBalancerNode status heartbeat is rewritten.
    pub(crate) lb_heartbeat: Duration,
    /// The LoadBalancer uplink; `None` follows the default route.
    pub uplink: Option<String>,
    /// The file of the RTC's seconds ([`crate::pause`]); `None` is off.
    pub(crate) lb_pause_clock: Option<std::path::PathBuf>,
    /// Presence frames from each held address's MAC (`lb_presence`).
    pub(crate) lb_presence: hna_dhcp::Presence,
    /// RFC 5227 ARP check of a LoadBalancer address before use.
    pub(crate) lb_arp_probe: bool,
    /// How long to listen for another holder before a takeover; zero: off.
    pub(crate) lb_takeover_guard: Duration,
    /// Self-fencing after this long without a status write; zero: never.
    pub(crate) lb_fence_after: Duration,
    /// The membership's UDP port; zero: off.
    pub(crate) lb_membership_port: u16,
    /// The lifetime LoadBalancer addresses are configured with; zero: none.
    pub(crate) lb_address_lifetime: Duration,
    /// How long addresses stay on their links for a restart; zero: never.
    pub(crate) lb_restart_grace: Duration,
    /// Which stops keep the addresses.
    pub(crate) lb_keep_on_stop: KeepOnStop,
}

/// `lb_keep_on_stop`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeepOnStop {
    /// Only when systemd restarts the unit.
    Restart,
    /// Every stop.
    Always,
}

/// Where a configuration value came from, for error messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    File(PathBuf),
    Env(&'static str),
    Flag(&'static str),
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::File(p) => write!(f, "{}", p.display()),
            Origin::Env(v) => write!(f, "environment variable {v}"),
            Origin::Flag(v) => write!(f, "flag {v}"),
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfigError {
    #[error("{origin}: key `{key}`: {reason}")]
    Key {
        origin: Origin,
        key: String,
        reason: String,
    },
    #[error("{path}: {reason}", path = path.display())]
    File { path: PathBuf, reason: String },
}

impl Config {
    /// Where the cluster connection looks for credentials.
    pub fn credential_settings(&self) -> hna_edges::cluster::credentials::Settings {
        hna_edges::cluster::credentials::Settings {
            kubeconfig: self.kubeconfig.clone(),
            search: self.kubeconfig_search.clone(),
        }
    }
}

impl ConfigError {
    /// The offending key, when the error is about one.
    pub fn key(&self) -> Option<&str> {
        match self {
            ConfigError::Key { key, .. } => Some(key),
            ConfigError::File { .. } => None,
        }
    }
}

/// Values given on the command line; `None` means "not given".
#[derive(Debug, Clone, Default)]
pub struct FlagValues {
    pub config: Option<PathBuf>,
    pub values: BTreeMap<&'static str, String>,
}

/// A raw value before validation, with where it came from.
#[derive(Debug, Clone)]
enum Raw {
    Text(String),
    List(Vec<String>),
}

/// Reads the configuration file chosen by flag, `HNA_CONFIG` or the default
/// path, and resolves it with the environment and flags.
///
/// A missing file is fine only at the default path; a file named explicitly
/// must exist.
pub fn load(flags: &FlagValues) -> Result<Config, ConfigError> {
    let env = |name: &str| std::env::var(name).ok();
    let (path, explicit) = match (&flags.config, env(CONFIG_ENV)) {
        (Some(p), _) => (p.clone(), true),
        (None, Some(p)) if !p.is_empty() => (PathBuf::from(p), true),
        _ => (PathBuf::from(DEFAULT_CONFIG_PATH), false),
    };
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => Some(text),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !explicit => None,
        Err(e) => {
            return Err(ConfigError::File {
                path,
                reason: format!("cannot read the configuration file: {e}"),
            });
        }
    };
    let file = text.as_deref().map(|t| (path.as_path(), t));
    resolve(file, &env, flags, &hostname_or_default)
}

/// This machine's hostname as a Node name (lowercased, as the kubelet
/// registers it), or `localhost`.
pub fn hostname_or_default() -> String {
    node_name_of_hostname(
        nix::unistd::gethostname()
            .ok()
            .and_then(|h| h.into_string().ok()),
    )
}

fn node_name_of_hostname(hostname: Option<String>) -> String {
    hostname
        .filter(|h| !h.is_empty())
        .map(|h| h.to_ascii_lowercase())
        .unwrap_or_else(|| "localhost".to_string())
}

/// Why a value of a key is refused: the reason [`ConfigError::Key`]
/// reports after the origin and the key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidValue(pub String);

impl From<hna_edges::duration::DurationError> for InvalidValue {
    fn from(e: hna_edges::duration::DurationError) -> InvalidValue {
        InvalidValue(e.to_string())
    }
}

impl From<hna_contract::k8s_names::InvalidLabelKey> for InvalidValue {
    fn from(e: hna_contract::k8s_names::InvalidLabelKey) -> InvalidValue {
        InvalidValue(e.to_string())
    }
}

/// The value each key was given and where, the later layers (environment,
/// then flags) over the earlier (the file).
type Layered = BTreeMap<&'static str, (Raw, Origin)>;

/// Pure resolution: file text, an environment lookup and flags in; a valid
/// configuration or the first error (with origin and key) out.
pub fn resolve(
    file: Option<(&Path, &str)>,
    env: &dyn Fn(&str) -> Option<String>,
    flags: &FlagValues,
    hostname: &dyn Fn() -> String,
) -> Result<Config, ConfigError> {
    let mut layered = Layered::new();
    if let Some((path, text)) = file {
        layer_file(&mut layered, path, text)?;
    }
    for spec in KEYS {
        if let Some(v) = env(spec.env) {
            layered.insert(spec.name, (raw_from_text(spec, v), Origin::Env(spec.env)));
        }
    }
    for (name, v) in &flags.values {
        let spec = key_spec(name).expect("flag values use names from KEYS");
        layered.insert(
            spec.name,
            (raw_from_text(spec, v.clone()), Origin::Flag(spec.flag)),
        );
    }

    let mut cfg = defaults(file.map(|(p, _)| p.to_path_buf()));
    for (name, (raw, origin)) in layered {
        set(&mut cfg, name, raw).map_err(|InvalidValue(reason)| ConfigError::Key {
            origin,
            key: name.to_string(),
            reason,
        })?;
    }
    if cfg.node_name.is_empty() {
        cfg.node_name = hostname();
    }
    if cfg.vm_name.is_empty() {
        cfg.vm_name = hostname();
    }
    Ok(cfg)
}

/// The file's keys into `layered`; an unknown key or a value of the wrong
/// TOML type stops resolution.
fn layer_file(layered: &mut Layered, path: &Path, text: &str) -> Result<(), ConfigError> {
    let origin = Origin::File(path.to_path_buf());
    let table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| ConfigError::File {
            path: path.to_path_buf(),
            reason: format!("not valid TOML: {}", e.message()),
        })?;
    for (key, value) in table {
        let Some(spec) = key_spec(&key) else {
            return Err(ConfigError::Key {
                origin,
                reason: unknown_key_reason(&key),
                key,
            });
        };
        let raw = raw_from_toml(spec, value).map_err(|InvalidValue(reason)| ConfigError::Key {
            origin: origin.clone(),
            key: key.clone(),
            reason,
        })?;
        layered.insert(spec.name, (raw, origin.clone()));
    }
    Ok(())
}

/// The configuration when no key is given.
fn defaults(file: Option<PathBuf>) -> Config {
    Config {
        file,
        log_level: "info".into(),
        log_target: LogTarget::Auto,
        state_dir: PathBuf::from("/var/lib/harvester-node-agent"),
        socket: PathBuf::from("/run/harvester-node-agent/agent.sock"),
        node_name: String::new(),
        kubeconfig: None,
        kubeconfig_search: hna_edges::cluster::credentials::DEFAULT_SEARCH
            .iter()
            .map(PathBuf::from)
            .collect(),
        credentials_retry: Duration::from_secs(10),
        macvlan_recheck: Duration::from_secs(300),
        cloud_config: None,
        vm_name: String::new(),
        topology_labels: DEFAULT_TOPOLOGY_KEYS
            .iter()
            .map(|k| k.to_string())
            .collect(),
        metrics_listen: None,
        namespace: hna_contract::DEFAULT_NAMESPACE.to_string(),
        lb_heartbeat: Duration::from_secs(10),
        uplink: None,
        lb_pause_clock: Some(crate::pause::DEFAULT_RTC_SECONDS.into()),
        lb_presence: hna_dhcp::Presence::WhereTheNicIsSilent(hna_dhcp::driver::PRESENCE_EVERY),
        lb_arp_probe: true,
        lb_takeover_guard: Duration::from_millis(150),
        lb_fence_after: Duration::from_secs(30),
        lb_membership_port: hna_contract::membership::DEFAULT_PORT,
        lb_address_lifetime: Duration::from_secs(1),
        lb_restart_grace: Duration::from_secs(15),
        lb_keep_on_stop: KeepOnStop::Restart,
    }
}

/// Sets one key from its value. One arm per key of [`KEYS`]; an arm that
/// is more than a parse calls a helper, so this stays a table to read.
fn set(cfg: &mut Config, name: &str, raw: Raw) -> Result<(), InvalidValue> {
    match name {
        "log_level" => {
            let v = text(raw);
            validate_log_level(&v)?;
            cfg.log_level = v;
        }
        "log_target" => cfg.log_target = parse_log_target(&text(raw))?,
        "state_dir" => cfg.state_dir = absolute_path(text(raw))?,
        "socket" => cfg.socket = socket_path(text(raw))?,
        "node_name" => {
            let v = text(raw);
            validate_node_name(&v)?;
            cfg.node_name = v;
        }
        "kubeconfig" => cfg.kubeconfig = optional_path(text(raw))?,
        "kubeconfig_search" => cfg.kubeconfig_search = path_list(raw)?,
        "credentials_retry" => cfg.credentials_retry = duration_between(&text(raw), 1, 3600)?,
        "macvlan_recheck" => cfg.macvlan_recheck = duration_between(&text(raw), 10, 86400)?,
        "cloud_config" => cfg.cloud_config = optional_path(text(raw))?,
        "vm_name" => {
            let v = text(raw);
            validate_node_name(&v)
                .map_err(|e| InvalidValue(e.0.replace("Node name", "VM name")))?;
            cfg.vm_name = v;
        }
        "topology_labels" => cfg.topology_labels = label_keys(raw)?,
        "metrics_listen" => cfg.metrics_listen = listen_address(&text(raw))?,
        "namespace" => {
            let v = text(raw).trim().to_string();
            validate_namespace(&v)?;
            cfg.namespace = v;
        }
        "lb_arp_probe" => cfg.lb_arp_probe = boolean(&text(raw))?,
        "lb_membership_port" => cfg.lb_membership_port = membership_port(&text(raw))?,
        "lb_fence_after" => cfg.lb_fence_after = fence_after(&text(raw))?,
        "lb_restart_grace" => cfg.lb_restart_grace = restart_grace(&text(raw))?,
        "lb_keep_on_stop" => cfg.lb_keep_on_stop = keep_on_stop(&text(raw))?,
        "lb_address_lifetime" => cfg.lb_address_lifetime = address_lifetime(&text(raw))?,
        "lb_takeover_guard" => {
            cfg.lb_takeover_guard = duration_up_to(&text(raw), Duration::from_secs(5))?
        }
        "lb_heartbeat" => cfg.lb_heartbeat = duration_between_ms(&text(raw), 200, 10_000)?,
        "lb_pause_clock" => cfg.lb_pause_clock = optional_path(text(raw).trim().to_string())?,
        "lb_presence" => cfg.lb_presence = presence(&text(raw))?,
        "uplink" => {
            let v = text(raw).trim().to_string();
            cfg.uplink = if v.is_empty() {
                None
            } else {
                validate_interface_name(&v)?;
                Some(v)
            };
        }
        _ => unreachable!("every key in KEYS is handled"),
    }
    Ok(())
}

/// An absolute path that fits a Unix socket's address.
fn socket_path(v: String) -> Result<PathBuf, InvalidValue> {
    let p = absolute_path(v)?;
    // sun_path holds 108 bytes including the terminating NUL.
    if p.as_os_str().len() > 107 {
        return Err(InvalidValue(format!(
            "socket path is {} bytes long; Unix sockets allow at most 107",
            p.as_os_str().len()
        )));
    }
    Ok(p)
}

/// Empty means none; anything else must be an absolute path.
fn optional_path(v: String) -> Result<Option<PathBuf>, InvalidValue> {
    if v.is_empty() {
        Ok(None)
    } else {
        absolute_path(v).map(Some)
    }
}

/// Absolute paths, from a TOML list or `:`-separated text.
fn path_list(raw: Raw) -> Result<Vec<PathBuf>, InvalidValue> {
    let items = match raw {
        Raw::List(items) => items,
        Raw::Text(t) => t
            .split(':')
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect(),
    };
    items.into_iter().map(absolute_path).collect()
}

/// Label keys, from a TOML list or comma-separated text.
fn label_keys(raw: Raw) -> Result<Vec<String>, InvalidValue> {
    let items = match raw {
        Raw::List(items) => items,
        Raw::Text(t) => split_list(&t),
    };
    for k in &items {
        validate_label_key(k)?;
    }
    Ok(items)
}

fn membership_port(v: &str) -> Result<u16, InvalidValue> {
    v.trim().parse::<u16>().map_err(|_| {
        InvalidValue("is not a port number; use 1-65535, or 0 to turn the membership off".into())
    })
}

/// `lb_fence_after`: 0s (never), or 10s to 1h.
fn fence_after(v: &str) -> Result<Duration, InvalidValue> {
    match duration_up_to(v, Duration::from_secs(3600))? {
        d if d.is_zero() || d >= Duration::from_secs(10) => Ok(d),
        d => Err(InvalidValue(format!(
            "{} is out of range; use 0s (never) or a value between 10s and 1h",
            humantime::format_duration(d)
        ))),
    }
}

/// `lb_restart_grace`: 0s (always hand over), or 1s to 5m.
fn restart_grace(v: &str) -> Result<Duration, InvalidValue> {
    match duration_up_to(v, Duration::from_secs(300))? {
        d if d.is_zero() || d >= Duration::from_secs(1) => Ok(d),
        d => Err(InvalidValue(format!(
            "{} is out of range; use 0s (always hand over) or a value between 1s and 5m",
            humantime::format_duration(d)
        ))),
    }
}

fn keep_on_stop(v: &str) -> Result<KeepOnStop, InvalidValue> {
    match v {
        "restart" => Ok(KeepOnStop::Restart),
        "always" => Ok(KeepOnStop::Always),
        other => Err(InvalidValue(format!(
            "`{other}` is not one of restart, always"
        ))),
    }
}

fn presence(v: &str) -> Result<hna_dhcp::Presence, InvalidValue> {
    use hna_dhcp::Presence;
    match v.trim() {
        "auto" => Ok(Presence::WhereTheNicIsSilent(
            hna_dhcp::driver::PRESENCE_EVERY,
        )),
        "off" => Ok(Presence::Off),
        other if hna_edges::duration::parse_duration(other).is_err() => Err(InvalidValue(format!(
            "`{other}` is not auto, off or a duration (such as 500ms)"
        ))),
        other => duration_between_ms(other, 100, 10_000).map(Presence::Every),
    }
}

fn boolean(v: &str) -> Result<bool, InvalidValue> {
    match v.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" => Ok(true),
        "false" | "0" | "no" => Ok(false),
        other => Err(InvalidValue(format!("`{other}` is not true or false"))),
    }
}

fn text(raw: Raw) -> String {
    match raw {
        Raw::Text(t) => t,
        Raw::List(items) => items.join(":"),
    }
}

fn raw_from_text(spec: &KeySpec, v: String) -> Raw {
    match spec.kind {
        Kind::PathList => Raw::List(
            v.split(':')
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect(),
        ),
        Kind::TextList => Raw::List(split_list(&v)),
        _ => Raw::Text(v),
    }
}

/// Comma-separated items, trimmed, empty ones dropped.
fn split_list(v: &str) -> Vec<String> {
    v.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

fn raw_from_toml(spec: &KeySpec, value: toml::Value) -> Result<Raw, InvalidValue> {
    let found = |v: &toml::Value| format!("found {} `{}`", v.type_str(), v);
    match (spec.kind, value) {
        (Kind::PathList, toml::Value::Array(items)) => items
            .into_iter()
            .map(|item| match item {
                toml::Value::String(s) => Ok(s),
                other => Err(InvalidValue(format!(
                    "expected a list of path strings, but an item is {}",
                    found(&other)
                ))),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Raw::List),
        (Kind::PathList, other) => Err(InvalidValue(format!(
            "expected a list of path strings such as [\"/etc/kubernetes/kubelet.conf\"], {}",
            found(&other)
        ))),
        (Kind::TextList, toml::Value::Array(items)) => items
            .into_iter()
            .map(|item| match item {
                toml::Value::String(s) => Ok(s),
                other => Err(InvalidValue(format!(
                    "expected a list of strings, but an item is {}",
                    found(&other)
                ))),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Raw::List),
        (Kind::TextList, other) => Err(InvalidValue(format!(
            "expected a list of strings such as [\"topology.kubernetes.io/zone\"], {}",
            found(&other)
        ))),
        (_, toml::Value::String(s)) => Ok(Raw::Text(s)),
        // A bare number is seconds, in the file as in flags and environment.
        (Kind::Bool, toml::Value::Boolean(b)) => Ok(Raw::Text(b.to_string())),
        (Kind::Bool, other) => Err(InvalidValue(format!(
            "expected true or false, {}",
            found(&other)
        ))),
        (Kind::Port, toml::Value::Integer(i)) => Ok(Raw::Text(i.to_string())),
        (Kind::Port, other) => Err(InvalidValue(format!(
            "expected a port number, {}",
            found(&other)
        ))),
        (Kind::Duration, toml::Value::Integer(i)) => Ok(Raw::Text(i.to_string())),
        (Kind::Duration, toml::Value::Float(f)) => Ok(Raw::Text(f.to_string())),
        (Kind::Duration, other) => Err(InvalidValue(format!(
            "expected a duration such as 10 (seconds), \"10s\" or \"2m\", {}",
            found(&other)
        ))),
        (Kind::Path, other) => Err(InvalidValue(format!(
            "expected a path string, {}",
            found(&other)
        ))),
        (Kind::Text, other) => Err(InvalidValue(format!(
            "expected a string, {}",
            found(&other)
        ))),
    }
}

fn unknown_key_reason(key: &str) -> String {
    let known: Vec<&str> = KEYS.iter().map(|k| k.name).collect();
    let close = KEYS
        .iter()
        .map(|k| (edit_distance(key, k.name), k.name))
        .filter(|(d, _)| *d <= 3)
        .min();
    match close {
        Some((_, name)) => format!("unknown key; did you mean `{name}`?"),
        None => format!("unknown key; valid keys are {}", known.join(", ")),
    }
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let cost = usize::from(ca != *cb);
            cur.push((prev[j] + cost).min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

/// `ADDR:PORT` (`[v6]:PORT` for IPv6); empty or `off` means off.
fn listen_address(v: &str) -> Result<Option<std::net::SocketAddr>, InvalidValue> {
    let v = v.trim();
    if v.is_empty() || v == "off" {
        return Ok(None);
    }
    let addr: std::net::SocketAddr = v.parse().map_err(|_| {
        InvalidValue(format!(
            "`{v}` is not an address and port such as \"127.0.0.1:9477\" or \"[::1]:9477\" (leave it empty to turn the endpoint off)"
        ))
    })?;
    if addr.port() == 0 {
        return Err(InvalidValue(format!(
            "`{v}` has port 0; name a fixed port so Prometheus can find it"
        )));
    }
    Ok(Some(addr))
}

fn absolute_path(v: String) -> Result<PathBuf, InvalidValue> {
    let p = PathBuf::from(&v);
    if v.is_empty() {
        Err(InvalidValue("must not be empty".into()))
    } else if !p.is_absolute() {
        Err(InvalidValue(format!("`{v}` is not an absolute path")))
    } else {
        Ok(p)
    }
}

/// A duration between `min_ms` and `max_ms` milliseconds.
pub(crate) fn duration_between_ms(
    v: &str,
    min_ms: u64,
    max_ms: u64,
) -> Result<Duration, InvalidValue> {
    let d = hna_edges::duration::parse_duration(v)?;
    let (min, max) = (Duration::from_millis(min_ms), Duration::from_millis(max_ms));
    if d < min || d > max {
        return Err(InvalidValue(format!(
            "{} is out of range; use a value between {} and {}",
            humantime::format_duration(d),
            humantime::format_duration(min),
            humantime::format_duration(max)
        )));
    }
    Ok(d)
}

/// `lb_address_lifetime`: `0s`, or whole seconds from 1 to 60 (the
/// kernel counts address lifetimes in seconds).
pub(crate) fn address_lifetime(v: &str) -> Result<Duration, InvalidValue> {
    let d = duration_up_to(v, Duration::from_secs(60))?;
    if d.subsec_nanos() != 0 {
        return Err(InvalidValue(format!(
            "{} is not a whole number of seconds (the kernel counts address lifetimes in seconds); use for example 2s",
            humantime::format_duration(d)
        )));
    }
    Ok(d)
}

/// A duration from zero up to `max`.
pub(crate) fn duration_up_to(v: &str, max: Duration) -> Result<Duration, InvalidValue> {
    duration_between_ms(v, 0, max.as_millis() as u64)
}

pub fn duration_between(v: &str, min_secs: u64, max_secs: u64) -> Result<Duration, InvalidValue> {
    duration_between_ms(v, min_secs * 1000, max_secs * 1000)
}

/// `auto`, `journald` or `stderr`.
pub fn parse_log_target(v: &str) -> Result<LogTarget, InvalidValue> {
    match v {
        "auto" => Ok(LogTarget::Auto),
        "journald" => Ok(LogTarget::Journald),
        "stderr" => Ok(LogTarget::Stderr),
        other => Err(InvalidValue(format!(
            "`{other}` is not a log target; use one of auto, journald, stderr"
        ))),
    }
}

/// A level or tracing directives, as `EnvFilter` parses them.
pub fn validate_log_level(v: &str) -> Result<(), InvalidValue> {
    tracing_subscriber::EnvFilter::builder()
        .parse(v)
        .map(|_| ())
        .map_err(|e| {
            InvalidValue(format!(
                "`{v}` is not a log filter ({e}); use error, warn, info, debug or trace"
            ))
        })
}

/// Node names are DNS-1123 subdomains.
/// A namespace name is a DNS-1123 label.
fn validate_namespace(v: &str) -> Result<(), InvalidValue> {
    if is_dns_subdomain(v) && v.len() <= 63 && !v.contains('.') {
        Ok(())
    } else {
        Err(InvalidValue(format!(
            "`{v}` is not a namespace name (at most 63 of a-z, 0-9 and '-', starting and ending with a letter or digit)"
        )))
    }
}

/// What the kernel accepts as an interface name (`dev_valid_name`).
fn validate_interface_name(v: &str) -> Result<(), InvalidValue> {
    let ok = v.len() < 16
        && v != "."
        && v != ".."
        && !v
            .bytes()
            .any(|b| b == b'/' || b == b':' || b.is_ascii_whitespace());
    if ok {
        Ok(())
    } else {
        Err(InvalidValue(format!(
            "`{v}` is not an interface name (1 to 15 bytes, no '/', ':' or spaces)"
        )))
    }
}

fn validate_node_name(v: &str) -> Result<(), InvalidValue> {
    if v.is_empty() {
        // Empty means "use the hostname".
        return Ok(());
    }
    if !is_dns_subdomain(v) {
        return Err(InvalidValue(format!(
            "`{v}` is not a valid Node name (lowercase letters, digits, '-' and '.', at most 253 characters)"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_hostname_becomes_a_lowercase_node_name() {
        assert_eq!(
            super::node_name_of_hostname(Some("Guest-One".into())),
            "guest-one"
        );
        assert_eq!(
            super::node_name_of_hostname(Some(String::new())),
            "localhost"
        );
        assert_eq!(super::node_name_of_hostname(None), "localhost");
    }

    use super::*;

    fn resolve_file(text: &str) -> Result<Config, ConfigError> {
        resolve(
            Some((Path::new("/etc/hna.toml"), text)),
            &|_| None,
            &FlagValues::default(),
            &|| "node-a".into(),
        )
    }

    #[test]
    fn defaults_apply_without_any_source() {
        let cfg = resolve(None, &|_| None, &FlagValues::default(), &|| "host-1".into()).unwrap();
        assert_eq!(cfg.node_name, "host-1");
        assert_eq!(
            cfg.state_dir,
            PathBuf::from("/var/lib/harvester-node-agent")
        );
        assert_eq!(
            cfg.socket,
            PathBuf::from("/run/harvester-node-agent/agent.sock")
        );
        assert_eq!(cfg.credentials_retry, Duration::from_secs(10));
        assert_eq!(
            cfg.kubeconfig_search.len(),
            hna_edges::cluster::credentials::DEFAULT_SEARCH.len()
        );
        assert_eq!(cfg.log_target, LogTarget::Auto);
    }

    #[test]
    fn durations_take_bare_seconds_from_file_environment_and_flags() {
        for text in [
            "credentials_retry = 3",
            "credentials_retry = \"3\"",
            "credentials_retry = 3.0",
            "credentials_retry = \"3s\"",
        ] {
            assert_eq!(
                resolve_file(text).unwrap().credentials_retry,
                Duration::from_secs(3),
                "{text}"
            );
        }
        let cfg = resolve_file("macvlan_recheck = 12.5\ncredentials_retry = \"1m30s\"").unwrap();
        assert_eq!(cfg.macvlan_recheck, Duration::from_millis(12_500));
        assert_eq!(cfg.credentials_retry, Duration::from_secs(90));

        let env = |k: &str| (k == "HNA_MACVLAN_RECHECK").then(|| "30".to_string());
        let mut flags = FlagValues::default();
        flags.values.insert("credentials_retry", "2.5".into());
        let cfg = resolve(None, &env, &flags, &|| "node-a".into()).unwrap();
        assert_eq!(cfg.macvlan_recheck, Duration::from_secs(30));
        assert_eq!(cfg.credentials_retry, Duration::from_millis(2500));

        for (text, says) in [
            ("credentials_retry = -3", "negative"),
            ("credentials_retry = nan", "bare number"),
            ("credentials_retry = inf", "bare number"),
            ("credentials_retry = \"\"", "empty"),
            ("credentials_retry = \"3 parsecs\"", "unknown time unit"),
            (
                "credentials_retry = true",
                "expected a duration such as 10 (seconds)",
            ),
            // In range only as seconds: 0.5 is below the 1s minimum.
            ("credentials_retry = 0.5", "out of range"),
        ] {
            let err = resolve_file(text).unwrap_err();
            assert_eq!(err.key(), Some("credentials_retry"), "{text}");
            assert!(err.to_string().contains(says), "{text}: {err}");
        }
    }

    #[test]
    fn unknown_key_is_named_with_a_suggestion() {
        let err = resolve_file("stat_dir = \"/x\"\n").unwrap_err();
        assert_eq!(err.key(), Some("stat_dir"));
        let msg = err.to_string();
        assert!(msg.contains("/etc/hna.toml"), "{msg}");
        assert!(msg.contains("did you mean `state_dir`"), "{msg}");
    }

    #[test]
    fn wrong_type_is_named() {
        let err = resolve_file("state_dir = 5\n").unwrap_err();
        assert_eq!(err.key(), Some("state_dir"));
        assert!(
            err.to_string()
                .contains("expected a path string, found integer")
        );
        let err = resolve_file("kubeconfig_search = \"/a\"\n").unwrap_err();
        assert_eq!(err.key(), Some("kubeconfig_search"));
    }

    #[test]
    fn bad_values_are_refused() {
        for (text, key) in [
            ("state_dir = \"relative/dir\"", "state_dir"),
            ("credentials_retry = \"soon\"", "credentials_retry"),
            ("credentials_retry = \"10ms\"", "credentials_retry"),
            ("log_level = \"loud[\"", "log_level"),
            ("log_target = \"syslog\"", "log_target"),
            ("node_name = \"Bad_Name\"", "node_name"),
        ] {
            let err = resolve_file(text).unwrap_err();
            assert_eq!(err.key(), Some(key), "{text}: {err}");
        }
        let long = format!("socket = \"/{}\"", "s".repeat(120));
        assert_eq!(resolve_file(&long).unwrap_err().key(), Some("socket"));
    }

    #[test]
    fn invalid_toml_names_the_file() {
        let err = resolve_file("state_dir = \n").unwrap_err();
        assert!(matches!(err, ConfigError::File { .. }));
        assert!(err.to_string().starts_with("/etc/hna.toml: not valid TOML"));
    }

    #[test]
    fn flags_beat_environment_beat_file() {
        let env = |k: &str| match k {
            "HNA_STATE_DIR" => Some("/from/env".to_string()),
            "HNA_SOCKET" => Some("/env/agent.sock".to_string()),
            "HNA_KUBECONFIG_SEARCH" => Some("/a/kc:/b/kc".to_string()),
            _ => None,
        };
        let mut flags = FlagValues::default();
        flags.values.insert("socket", "/flag/agent.sock".into());
        let cfg = resolve(
            Some((
                Path::new("/c.toml"),
                "state_dir = \"/from/file\"\nlog_level = \"debug\"\n",
            )),
            &env,
            &flags,
            &|| "n".into(),
        )
        .unwrap();
        assert_eq!(cfg.state_dir, PathBuf::from("/from/env"));
        assert_eq!(cfg.socket, PathBuf::from("/flag/agent.sock"));
        assert_eq!(cfg.log_level, "debug");
        assert_eq!(
            cfg.kubeconfig_search,
            vec![PathBuf::from("/a/kc"), PathBuf::from("/b/kc")]
        );
    }

    #[test]
    fn errors_from_environment_and_flags_say_so() {
        let env = |k: &str| (k == "HNA_CREDENTIALS_RETRY").then(|| "never".to_string());
        let err = resolve(None, &env, &FlagValues::default(), &|| "n".into()).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("environment variable HNA_CREDENTIALS_RETRY")
        );
        let mut flags = FlagValues::default();
        flags.values.insert("state_dir", "rel".into());
        let err = resolve(None, &|_| None, &flags, &|| "n".into()).unwrap_err();
        assert!(err.to_string().starts_with("flag --state-dir"), "{err}");
    }

    #[test]
    fn every_key_has_docs_and_a_distinct_env_and_flag() {
        let mut envs: Vec<_> = KEYS.iter().map(|k| k.env).collect();
        envs.sort();
        envs.dedup();
        assert_eq!(envs.len(), KEYS.len());
        for k in KEYS {
            assert!(k.env.starts_with("HNA_") && k.flag.starts_with("--") && !k.doc.is_empty());
        }
    }

    /// Issue #31: presence frames where the NIC is silent by default; off
    /// or a period on request; anything else refused with what is wanted.
    #[test]
    fn lb_presence_is_auto_by_default_and_validated() {
        use hna_dhcp::Presence;
        let cfg = resolve(None, &|_| None, &FlagValues::default(), &|| "n".into()).unwrap();
        assert_eq!(
            cfg.lb_presence,
            Presence::WhereTheNicIsSilent(Duration::from_millis(500))
        );
        for (value, want) in [
            (
                "auto",
                Presence::WhereTheNicIsSilent(Duration::from_millis(500)),
            ),
            ("off", Presence::Off),
            ("250ms", Presence::Every(Duration::from_millis(250))),
        ] {
            let cfg = resolve_file(&format!("lb_presence = \"{value}\"")).unwrap();
            assert_eq!(cfg.lb_presence, want, "{value}");
        }
        for (value, says) in [
            ("sometimes", "is not auto, off or a duration"),
            ("50ms", "out of range"),
            ("1m", "out of range"),
        ] {
            let err = resolve_file(&format!("lb_presence = \"{value}\"")).unwrap_err();
            assert_eq!(err.key(), Some("lb_presence"));
            assert!(err.to_string().contains(says), "{value}: {err}");
        }
    }

    #[test]
    fn metrics_listen_is_off_by_default_and_validated() {
        let cfg = resolve(None, &|_| None, &FlagValues::default(), &|| "n".into()).unwrap();
        assert_eq!(cfg.metrics_listen, None);
        assert_eq!(
            resolve_file("metrics_listen = \"127.0.0.1:9477\"")
                .unwrap()
                .metrics_listen,
            Some("127.0.0.1:9477".parse().unwrap())
        );
        assert_eq!(
            resolve_file("metrics_listen = \"[::1]:9477\"")
                .unwrap()
                .metrics_listen,
            Some("[::1]:9477".parse().unwrap())
        );
        assert_eq!(
            resolve_file("metrics_listen = \"\"")
                .unwrap()
                .metrics_listen,
            None
        );
        for bad in ["localhost:9477", "127.0.0.1", "127.0.0.1:0", "9477"] {
            let err = resolve_file(&format!("metrics_listen = \"{bad}\"")).unwrap_err();
            assert_eq!(err.key(), Some("metrics_listen"), "{bad}: {err}");
        }
        assert!(resolve_file("metrics_listen = 9477").is_err());
    }

    #[test]
    fn topology_keys_have_defaults_and_are_validated() {
        let cfg = resolve(None, &|_| None, &FlagValues::default(), &|| "vm-1".into()).unwrap();
        assert_eq!(cfg.vm_name, "vm-1");
        assert_eq!(cfg.cloud_config, None);
        assert_eq!(cfg.topology_labels.len(), 2);
        let cfg = resolve_file(
            "cloud_config = \"/etc/cc\"\nvm_name = \"vm-2\"\ntopology_labels = [\"example.com/rack\"]\n",
        )
        .unwrap();
        assert_eq!(cfg.cloud_config, Some(PathBuf::from("/etc/cc")));
        assert_eq!(cfg.vm_name, "vm-2");
        assert_eq!(cfg.topology_labels, vec!["example.com/rack".to_string()]);
        assert!(
            resolve_file("topology_labels = []")
                .unwrap()
                .topology_labels
                .is_empty()
        );
        let env = |k: &str| (k == "HNA_TOPOLOGY_LABELS").then(|| "a/b, c".to_string());
        let cfg = resolve(None, &env, &FlagValues::default(), &|| "n".into()).unwrap();
        assert_eq!(
            cfg.topology_labels,
            vec!["a/b".to_string(), "c".to_string()]
        );
        for (text, key) in [
            ("topology_labels = [\"Bad Key\"]", "topology_labels"),
            ("topology_labels = \"x\"", "topology_labels"),
            ("vm_name = \"Bad_Name\"", "vm_name"),
            ("cloud_config = \"rel\"", "cloud_config"),
        ] {
            assert_eq!(resolve_file(text).unwrap_err().key(), Some(key), "{text}");
        }
    }

    #[test]
    fn load_balancer_keys_have_defaults_and_are_validated() {
        let cfg = resolve(None, &|_| None, &FlagValues::default(), &|| "n".into()).unwrap();
        assert_eq!(cfg.namespace, "harvester-node-agent");
        assert_eq!(cfg.lb_heartbeat, Duration::from_secs(10));
        assert_eq!(
            resolve_file("lb_heartbeat = \"200ms\"\n")
                .unwrap()
                .lb_heartbeat,
            Duration::from_millis(200)
        );
        assert!(resolve_file("lb_heartbeat = \"100ms\"\n").is_err());
        assert!(resolve_file("lb_heartbeat = \"11s\"\n").is_err());
        assert!(cfg.lb_arp_probe);
        assert!(!resolve_file("lb_arp_probe = false\n").unwrap().lb_arp_probe);
        assert!(resolve_file("lb_arp_probe = \"maybe\"\n").is_err());
        assert!(resolve_file("lb_arp_probe = 1\n").is_err());
        assert_eq!(cfg.lb_takeover_guard, Duration::from_millis(150));
        assert_eq!(
            resolve_file("lb_takeover_guard = \"0s\"\n")
                .unwrap()
                .lb_takeover_guard,
            Duration::ZERO
        );
        assert!(resolve_file("lb_takeover_guard = \"6s\"\n").is_err());
        assert_eq!(cfg.lb_fence_after, Duration::from_secs(30));
        assert_eq!(
            resolve_file("lb_fence_after = \"0s\"\n")
                .unwrap()
                .lb_fence_after,
            Duration::ZERO
        );
        assert!(resolve_file("lb_fence_after = \"5s\"\n").is_err());
        assert_eq!(cfg.lb_membership_port, 7947);
        assert_eq!(
            resolve_file("lb_membership_port = 0\n")
                .unwrap()
                .lb_membership_port,
            0
        );
        assert_eq!(
            resolve_file("lb_membership_port = \"9000\"\n")
                .unwrap()
                .lb_membership_port,
            9000
        );
        assert!(resolve_file("lb_membership_port = 70000\n").is_err());
        assert!(resolve_file("lb_membership_port = true\n").is_err());
        assert_eq!(cfg.lb_address_lifetime, Duration::from_secs(1));
        assert_eq!(
            resolve_file("lb_address_lifetime = \"0s\"\n")
                .unwrap()
                .lb_address_lifetime,
            Duration::ZERO
        );
        for bad in ["1500ms", "61s", "-1s"] {
            let e = resolve_file(&format!("lb_address_lifetime = \"{bad}\"\n"))
                .unwrap_err()
                .to_string();
            assert!(e.contains("lb_address_lifetime"), "{bad}: {e}");
        }
        assert!(resolve_file("lb_fence_after = \"2h\"\n").is_err());
        assert_eq!(cfg.uplink, None);
        let cfg =
            resolve_file("namespace = \"lb\"\nlb_heartbeat = 2\nuplink = \"eth1\"\n").unwrap();
        assert_eq!(cfg.namespace, "lb");
        assert_eq!(cfg.lb_heartbeat, Duration::from_secs(2));
        assert_eq!(cfg.uplink.as_deref(), Some("eth1"));
        assert_eq!(resolve_file("uplink = \"\"").unwrap().uplink, None);
        for (text, key) in [
            ("namespace = \"Not_A_Namespace\"", "namespace"),
            ("namespace = \"a.b\"", "namespace"),
            ("lb_heartbeat = \"20s\"", "lb_heartbeat"),
            ("lb_heartbeat = \"150ms\"", "lb_heartbeat"),
            ("uplink = \"a-name-too-long-for-linux\"", "uplink"),
            ("uplink = \"eth0/x\"", "uplink"),
        ] {
            assert_eq!(resolve_file(text).unwrap_err().key(), Some(key), "{text}");
        }
    }

    #[test]
    fn operations_guide_documents_every_key() {
        let guide = include_str!("../../../docs/operations.md");
        for k in KEYS {
            let row = format!("| `{}` | `{}` | `{}` |", k.name, k.env, k.flag);
            assert!(
                guide.contains(&row),
                "docs/operations.md's configuration reference lacks the row for {}",
                k.name
            );
        }
    }
}
