//! The command line's grammar: every subcommand, flag and environment
//! variable, their help text and their value parsers (clap derive).

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use hna_node::config::{self, FlagValues};

use super::dhcp_commands;

const ABOUT: &str = "Node agent for Kubernetes guest clusters on Harvester.";
const LONG_ABOUT: &str = "\
Node agent for Kubernetes guest clusters on Harvester.

On every guest VM it verifies and loads the macvlan kernel module, holds
DHCP-mode LoadBalancer IPs on macvlan interfaces, reports qemu-guest-agent
health and relays Harvester topology labels to the guest Node.

Configuration comes from /etc/harvester-node-agent/config.toml (optional),
environment variables HNA_* and flags, in increasing precedence. Every key is
listed under `run --help` and in docs/operations.md.

Typical use:
  harvester-node-agent check                 # is this node ready?
  systemctl status harvester-node-agent      # the daemon's one-line health
  harvester-node-agent status                # the daemon's live state";

#[derive(Debug, Parser)]
#[command(name = "harvester-node-agent", version, about = ABOUT, long_about = LONG_ABOUT)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Run the node daemon (what harvester-node-agent.service starts).
    ///
    /// Validates the configuration before touching the host (an invalid
    /// configuration exits 78), creates the state directory, listens on the
    /// control socket, then tells systemd READY=1. Connecting to the guest
    /// cluster is not needed for readiness: credentials are picked up when
    /// they appear. Stops cleanly on SIGTERM or SIGINT.
    Run(RunArgs),
    /// Run the in-cluster controller (placement of LoadBalancer IPs).
    ///
    /// Runs in the guest cluster (a Deployment), with its own settings:
    /// none of the node daemon's apply. Credentials: --kubeconfig, else
    /// $KUBECONFIG, else the Pod's service account.
    ///
    /// It keeps one LoadBalancerNode per Node in --namespace, picks a
    /// holder node for every DHCP-mode LoadBalancer Service (written to that
    /// node's object; the node's agent gets the lease), and once the holder
    /// reports the lease BOUND writes the Service's status, then kube-vip's
    /// annotations (hwaddr, requestedIP, vipHost). Deleting a Service waits
    /// (finalizer) until the holder has sent DHCPRELEASE. Replicas elect a
    /// leader on a Lease; only the leader writes. Every decision and every
    /// refusal is an Event on the Service: `kubectl describe service`.
    Controller(ControllerArgs),
    /// One-shot preflight of this node: configuration, credentials, API
    /// server, state directory, macvlan. Read-only unless --fix. Exit code 0
    /// when no check fails, 1 otherwise.
    Check(CheckArgs),
    /// Ask the running daemon for its live state over its control socket.
    /// Exit code 1 when no daemon answers.
    Status(StatusArgs),
    /// Preflight a VM network for DHCP-mode LoadBalancers: create a
    /// temporary macvlan, get a lease with the agent's DHCP engine, print
    /// server, address, lease time, T1/T2, router and step timings, release
    /// it and remove the macvlan (also on Ctrl-C). Exit code 0 on a lease,
    /// 1 with the reason otherwise.
    DhcpProbe(dhcp_commands::ProbeArgs),
    /// Hold N DHCP leases on macvlans until SIGTERM/SIGINT (for tests,
    /// benchmarks and watching the engine; the daemon does this for
    /// Services).
    #[command(hide = true)]
    DhcpHold(dhcp_commands::HoldArgs),
}

/// Flags for every configuration key; each also reads from its HNA_*
/// environment variable, and both override the configuration file.
#[derive(Debug, Args, Clone, Default)]
pub(crate) struct ConfigArgs {
    /// Configuration file [default: /etc/harvester-node-agent/config.toml, used only if it exists] [env: HNA_CONFIG]
    #[arg(long, value_name = "PATH")]
    pub(crate) config: Option<PathBuf>,
    /// Log filter: error, warn, info, debug, trace, or tracing directives [default: info] [env: HNA_LOG_LEVEL]
    #[arg(long, value_name = "FILTER")]
    pub(crate) log_level: Option<String>,
    /// Where logs go: auto, journald or stderr [default: auto] [env: HNA_LOG_TARGET]
    #[arg(long, value_name = "TARGET")]
    pub(crate) log_target: Option<String>,
    /// Persistent state directory [default: /var/lib/harvester-node-agent] [env: HNA_STATE_DIR]
    #[arg(long, value_name = "DIR")]
    pub(crate) state_dir: Option<String>,
    /// Control socket that `status` talks to [default: /run/harvester-node-agent/agent.sock] [env: HNA_SOCKET]
    #[arg(long, value_name = "PATH")]
    pub(crate) socket: Option<String>,
    /// This node's Node name [default: the hostname] [env: HNA_NODE_NAME]
    #[arg(long, value_name = "NAME")]
    pub(crate) node_name: Option<String>,
    /// Guest-cluster kubeconfig; disables discovery [default: discovered] [env: HNA_KUBECONFIG]
    #[arg(long, value_name = "PATH")]
    pub(crate) kubeconfig: Option<String>,
    /// Colon-separated kubeconfigs tried in order when --kubeconfig is unset [default: RKE2, K3s, kubeadm kubelet kubeconfigs] [env: HNA_KUBECONFIG_SEARCH]
    #[arg(long, value_name = "PATHS")]
    pub(crate) kubeconfig_search: Option<String>,
    /// How often to look for credentials and re-check the API server [default: 10s] [env: HNA_CREDENTIALS_RETRY]
    #[arg(long, value_name = "DURATION")]
    pub(crate) credentials_retry: Option<String>,
    /// How often the daemon re-runs the macvlan preflight; SIGHUP re-runs it at once [default: 5m] [env: HNA_MACVLAN_RECHECK]
    #[arg(long, value_name = "DURATION")]
    pub(crate) macvlan_recheck: Option<String>,
    /// Harvester cloud-provider kubeconfig for the topology relay [default: /etc/kubernetes/cloud-config, then RKE2's cloud-provider-config] [env: HNA_CLOUD_CONFIG]
    #[arg(long, value_name = "PATH")]
    pub(crate) cloud_config: Option<String>,
    /// This VM's VirtualMachineInstance name in Harvester [default: the hostname] [env: HNA_VM_NAME]
    #[arg(long, value_name = "NAME")]
    pub(crate) vm_name: Option<String>,
    /// Comma-separated label keys relayed from Harvester; empty turns the relay off [default: topology.kubernetes.io/region,topology.kubernetes.io/zone] [env: HNA_TOPOLOGY_LABELS]
    #[arg(long, value_name = "KEYS")]
    pub(crate) topology_labels: Option<String>,
    /// Serve Prometheus /metrics and /healthz on ADDR:PORT, e.g. 127.0.0.1:9477 [default: off] [env: HNA_METRICS_LISTEN]
    #[arg(long, value_name = "ADDR:PORT")]
    pub(crate) metrics_listen: Option<String>,
    /// Namespace of this node's LoadBalancerNode object (the controller's) [default: harvester-node-agent] [env: HNA_NAMESPACE]
    #[arg(long, value_name = "NAMESPACE")]
    pub(crate) namespace: Option<String>,
    /// How often the LoadBalancerNode status is rewritten when nothing in it changed (200ms to 10s) [default: 10s] [env: HNA_LB_HEARTBEAT]
    #[arg(long, value_name = "DURATION")]
    pub(crate) lb_heartbeat: Option<String>,
    /// ARP-probe a LoadBalancer address before use (true/false) [default: true] [env: HNA_LB_ARP_PROBE]
    #[arg(long, value_name = "BOOL")]
    pub(crate) lb_arp_probe: Option<String>,
    /// Listen this long for another holder before taking an address over; 0s is off (0s to 5s) [default: 150ms] [env: HNA_LB_TAKEOVER_GUARD]
    #[arg(long, value_name = "DURATION")]
    pub(crate) lb_takeover_guard: Option<String>,
    /// Without a view of the LAN: hand every address over after this long without a status write; 0s is never (10s to 1h) [default: 30s] [env: HNA_LB_FENCE_AFTER]
    #[arg(long, value_name = "DURATION")]
    pub(crate) lb_fence_after: Option<String>,
    /// Lifetime of every LoadBalancer address, confirmed four times per lifetime: a frozen or paused daemon stops answering within it; 0s is off (whole seconds, 1s to 60s) [default: 1s] [env: HNA_LB_ADDRESS_LIFETIME]
    #[arg(long, value_name = "DURATION")]
    pub(crate) lb_address_lifetime: Option<String>,
    /// Leave the addresses on their links this long when stopping for a restart; 0s always hands over (1s to 5m) [default: 15s] [env: HNA_LB_RESTART_GRACE]
    #[arg(long, value_name = "DURATION")]
    pub(crate) lb_restart_grace: Option<String>,
    /// Which stops keep the addresses for --lb-restart-grace: restart (systemd restarts the unit) or always [default: restart] [env: HNA_LB_KEEP_ON_STOP]
    #[arg(long, value_name = "WHEN")]
    pub(crate) lb_keep_on_stop: Option<String>,
    /// The RTC's seconds, which count the time this VM stands paused (live migration, suspend): every held address is announced again after a pause; empty is off [default: /sys/class/rtc/rtc0/since_epoch] [env: HNA_LB_PAUSE_CLOCK]
    #[arg(long, value_name = "PATH")]
    pub(crate) lb_pause_clock: Option<String>,
    /// Presence frames from each held address's MAC, so the LAN's switches follow a live migration: auto (every 500ms where the NIC does not announce a migration itself: e1000-family), off, or a period (100ms to 10s) on every uplink [default: auto] [env: HNA_LB_PRESENCE]
    #[arg(long, value_name = "auto|off|DURATION")]
    pub(crate) lb_presence: Option<String>,
    /// Uplink of the LoadBalancer macvlans when a Service names none [default: the default route's interface] [env: HNA_UPLINK]
    #[arg(long, value_name = "IFACE")]
    pub(crate) uplink: Option<String>,
}

impl ConfigArgs {
    pub(crate) fn flag_values(&self) -> FlagValues {
        let mut values = std::collections::BTreeMap::new();
        let pairs: [(&'static str, &Option<String>); 24] = [
            ("log_level", &self.log_level),
            ("log_target", &self.log_target),
            ("state_dir", &self.state_dir),
            ("socket", &self.socket),
            ("node_name", &self.node_name),
            ("kubeconfig", &self.kubeconfig),
            ("kubeconfig_search", &self.kubeconfig_search),
            ("credentials_retry", &self.credentials_retry),
            ("macvlan_recheck", &self.macvlan_recheck),
            ("cloud_config", &self.cloud_config),
            ("vm_name", &self.vm_name),
            ("topology_labels", &self.topology_labels),
            ("metrics_listen", &self.metrics_listen),
            ("namespace", &self.namespace),
            ("lb_heartbeat", &self.lb_heartbeat),
            ("lb_arp_probe", &self.lb_arp_probe),
            ("lb_takeover_guard", &self.lb_takeover_guard),
            ("lb_fence_after", &self.lb_fence_after),
            ("lb_address_lifetime", &self.lb_address_lifetime),
            ("lb_restart_grace", &self.lb_restart_grace),
            ("lb_keep_on_stop", &self.lb_keep_on_stop),
            ("lb_pause_clock", &self.lb_pause_clock),
            ("lb_presence", &self.lb_presence),
            ("uplink", &self.uplink),
        ];
        for (key, value) in pairs {
            if let Some(v) = value {
                values.insert(key, v.clone());
            }
        }
        FlagValues {
            config: self.config.clone(),
            values,
        }
    }
}

#[derive(Debug, Args)]
pub(crate) struct RunArgs {
    #[command(flatten)]
    pub(crate) config: ConfigArgs,
}

/// The controller's settings: flags, each also read from its environment
/// variable (a Deployment sets either).
#[derive(Debug, Args)]
pub(crate) struct ControllerArgs {
    /// Log filter: error, warn, info, debug, trace, or tracing directives
    #[arg(long, value_name = "FILTER", env = "HNA_LOG_LEVEL", default_value = "info", value_parser = log_level_arg)]
    pub(crate) log_level: String,
    /// Where logs go: auto, journald or stderr
    #[arg(long, value_name = "TARGET", env = "HNA_LOG_TARGET", default_value = "auto", value_parser = log_target_arg)]
    pub(crate) log_target: config::LogTarget,
    /// Kubeconfig of the guest cluster [default: $KUBECONFIG, then the Pod's service account]
    #[arg(long, value_name = "PATH", env = "HNA_KUBECONFIG")]
    pub(crate) kubeconfig: Option<PathBuf>,
    /// How often to look for credentials and re-check the API server (1s to 1h)
    #[arg(long, value_name = "DURATION", env = "HNA_CREDENTIALS_RETRY", default_value = "10s", value_parser = credentials_retry_arg)]
    pub(crate) credentials_retry: Duration,
    /// Namespace of the controller's Lease and of the LoadBalancerNode
    /// objects (one per Node) and their Roles; the node agents' `namespace`
    /// must be the same
    #[arg(long, value_name = "NAMESPACE", env = "HNA_NAMESPACE", default_value = hna_contract::DEFAULT_NAMESPACE)]
    pub(crate) namespace: String,
    /// This replica's name in the leader-election Lease (a Deployment sets
    /// POD_NAME from metadata.name); unset: `<hostname>-<pid>`
    #[arg(long, value_name = "NAME", env = "POD_NAME")]
    pub(crate) identity: Option<String>,
    /// Leader election: how long a Lease not renewed (as seen on this
    /// replica's clock) keeps others from taking over
    #[arg(long, value_name = "DURATION", env = "HNA_LEASE_DURATION", default_value = "3s", value_parser = election_arg)]
    pub(crate) lease_duration: Duration,
    /// Leader election: a leader that could not renew for this long stops
    /// writing at once (below --lease-duration)
    #[arg(long, value_name = "DURATION", env = "HNA_RENEW_DEADLINE", default_value = "2s", value_parser = election_arg)]
    pub(crate) renew_deadline: Duration,
    /// Leader election: how often the Lease is renewed or tried (below
    /// --renew-deadline)
    #[arg(long, value_name = "DURATION", env = "HNA_RETRY_PERIOD", default_value = "500ms", value_parser = election_arg)]
    pub(crate) retry_period: Duration,
    /// A node whose agent's heartbeat has not changed for this long, as
    /// seen on the controller's clock, and that none of its witnesses hears
    /// on the LAN, holds no address; its Services move to other nodes (a
    /// node its witnesses find dead on the LAN moves within about 2s,
    /// whatever its heartbeat). At least twice the agents' heartbeat
    /// period (lb_heartbeat, 10s), above their lb_fence_after (30s)
    #[arg(long, value_name = "DURATION", env = "HNA_NODE_STALE_AFTER", default_value = "40s", value_parser = stale_arg)]
    pub(crate) node_stale_after: Duration,
    /// When no node's heartbeat has changed for this long, the silence is
    /// blamed on the API server or the watch, not the nodes: nobody is
    /// judged stale, and after it every node gets a whole
    /// --node-stale-after again. Above the agents' heartbeat period (10s),
    /// at most --node-stale-after [default: 15s, or half of
    /// --node-stale-after when that is less]
    #[arg(long, value_name = "DURATION", env = "HNA_WATCH_QUIET_AFTER", value_parser = election_arg)]
    pub(crate) watch_quiet_after: Option<Duration>,
    /// A Service whose holder reports its lease FAILED (no macvlan, no
    /// DHCP answer on that uplink) for this long moves to another node,
    /// if one can take it
    #[arg(long, value_name = "DURATION", env = "HNA_SERVICE_FAILED_AFTER", default_value = "30s", value_parser = stale_arg)]
    pub(crate) service_failed_after: Duration,
    /// A Service whose holder reports its lease GUARDED (another host still
    /// answers for the address) for this long moves to another node, if
    /// one can take it. Keep it above the agents' lb_fence_after (30s): a
    /// former holder cut off from the API server and its LAN lets go
    /// within that
    #[arg(long, value_name = "DURATION", env = "HNA_SERVICE_GUARDED_AFTER", default_value = "150s", value_parser = stale_arg)]
    pub(crate) service_guarded_after: Duration,
    /// A node that could not serve a Service (see --service-failed-after)
    /// is not given that Service again for this long, while another node
    /// can take it
    #[arg(long, value_name = "DURATION", env = "HNA_SERVICE_AVOID_FOR", default_value = "10m", value_parser = stale_arg)]
    pub(crate) service_avoid_for: Duration,
    /// Serve Prometheus /metrics and /healthz on ADDR:PORT, e.g. 0.0.0.0:9478 [default: off]
    #[arg(long, value_name = "ADDR:PORT", env = "HNA_METRICS_LISTEN")]
    pub(crate) metrics_listen: Option<std::net::SocketAddr>,
    /// Where externalTrafficPolicy: Local learns which nodes have a ready
    /// endpoint: auto (EndpointSlices of discovery.k8s.io/v1 where the API
    /// serves them, Kubernetes 1.21 and later; else Endpoints), endpoints,
    /// or endpointslices (v1, else v1beta1 on Kubernetes 1.17 to 1.20)
    #[arg(long, value_name = "SOURCE", env = "HNA_ENDPOINT_SOURCE", default_value = "auto", value_parser = hna_controller::endpoints::EndpointSetting::parse)]
    pub(crate) endpoint_source: hna_controller::endpoints::EndpointSetting,
    /// Serve LoadBalancer Services of this spec.loadBalancerClass. Services
    /// of any other class are never touched. Naming a class also stops
    /// serving class-less DHCP Services (the Harvester cloud provider's
    /// `cloudprovider.harvesterhci.io/ipam: dhcp`) unless
    /// --serve-classless is given [default: harvester-node-agent.io/dhcp,
    /// with class-less DHCP Services served]
    #[arg(long, value_name = "CLASS", env = "HNA_LOAD_BALANCER_CLASS", value_parser = class_arg)]
    pub(crate) load_balancer_class: Option<String>,
    /// Whether class-less DHCP Services are served too: true or false
    /// (alone: true) [default: true unless --load-balancer-class is given]
    #[arg(long, value_name = "BOOL", env = "HNA_SERVE_CLASSLESS", num_args = 0..=1, default_missing_value = "true")]
    pub(crate) serve_classless: Option<bool>,
}

impl ControllerArgs {
    /// `--load-balancer-class` and `--serve-classless` as one policy.
    pub(crate) fn classes(&self) -> hna_contract::ClassPolicy {
        let default = hna_contract::ClassPolicy::default();
        hna_contract::ClassPolicy {
            classless: self
                .serve_classless
                .unwrap_or(self.load_balancer_class.is_none()),
            class: self.load_balancer_class.clone().unwrap_or(default.class),
        }
    }
}

// The value parsers are the binary's edge: clap shows their error's text
// beside the flag, so they speak anyhow like the rest of the edge.
fn class_arg(v: &str) -> anyhow::Result<String> {
    hna_contract::k8s_names::validate_label_key(v)
        .map(|()| v.to_string())
        .map_err(|e| {
            anyhow::anyhow!(
                "{e} (spec.loadBalancerClass is a label-style name, e.g. example.com/dhcp)"
            )
        })
}

/// `--watch-quiet-after` unless given: above the agents' default heartbeat
/// period (10s).
pub(super) const DEFAULT_WATCH_QUIET_AFTER: Duration = Duration::from_secs(15);

fn election_arg(v: &str) -> anyhow::Result<Duration> {
    let d = hna_edges::duration::parse_duration(v)?;
    if d < Duration::from_millis(100) || d > Duration::from_secs(3600) {
        anyhow::bail!("`{v}` must be between 100ms and 1h");
    }
    Ok(d)
}

fn stale_arg(v: &str) -> anyhow::Result<Duration> {
    Ok(config::duration_between(v, 1, 3600)?)
}

fn log_level_arg(v: &str) -> anyhow::Result<String> {
    config::validate_log_level(v)?;
    Ok(v.to_string())
}

fn log_target_arg(v: &str) -> anyhow::Result<config::LogTarget> {
    Ok(config::parse_log_target(v)?)
}

fn credentials_retry_arg(v: &str) -> anyhow::Result<Duration> {
    Ok(config::duration_between(v, 1, 3600)?)
}

#[derive(Debug, Clone, Copy, ValueEnum, Default, PartialEq, Eq)]
pub(crate) enum Output {
    /// Aligned text for people.
    #[default]
    Human,
    /// One JSON object for scripts.
    Json,
}

#[derive(Debug, Args)]
pub(crate) struct CheckArgs {
    /// Run only these checks: config, kubeconfig (with api-server),
    /// state-dir, macvlan, qemu-guest-agent, topology, cni (whether the
    /// CNI, its BPF programs or a network manager reach our hlb-* links;
    /// prints RKE2's HelmChartConfig that keeps them off) [default: all]
    #[arg(value_name = "CHECK")]
    pub(crate) names: Vec<String>,
    #[command(flatten)]
    pub(crate) config: ConfigArgs,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Output::Human)]
    pub(crate) output: Output,
    /// How long to wait for the API server when credentials are found (seconds, or with a unit: 500ms, 1m)
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = hna_edges::duration::parse_duration)]
    pub(crate) timeout: Duration,
    /// Do what the daemon does: load macvlan when it is on disk but not
    /// loaded (with the system's modprobe), then prove it with a throwaway
    /// macvlan on the uplink, never set up and deleted at once.
    #[arg(long)]
    pub(crate) fix: bool,
    /// Where the `cni` check looks for CNI configuration files (repeat
    /// for several) [default: /etc/cni/net.d, /var/lib/rancher/k3s/agent/etc/cni/net.d]
    #[arg(long, value_name = "DIR")]
    pub(crate) cni_conf_dir: Vec<PathBuf>,
}

#[derive(Debug, Args)]
pub(crate) struct StatusArgs {
    /// The daemon's configuration file, read as `run` reads it for its `socket` [default: /etc/harvester-node-agent/config.toml, used only if it exists] [env: HNA_CONFIG]
    #[arg(long, value_name = "PATH")]
    pub(crate) config: Option<PathBuf>,
    /// The daemon's control socket [default: `socket` from the configuration, else /run/harvester-node-agent/agent.sock] [env: HNA_SOCKET]
    #[arg(long, value_name = "PATH")]
    pub(crate) socket: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Output::Human)]
    pub(crate) output: Output,
}
