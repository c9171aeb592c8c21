//! Command line: subcommands, flags and exit codes. The only place that turns
//! errors into process exit codes.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

mod dhcp_commands;

use crate::check::{self, Report};
use hna_edges::cluster::credentials::HostEnv;
use hna_edges::systemd::{Notifier, SdNotifier};
use hna_node::config::{self, Config, ConfigError, FlagValues};
use hna_node::control;

/// sysexits.h EX_CONFIG: systemd's `RestartPreventExitStatus=78` keeps the
/// unit from restarting into the same configuration error.
pub const EXIT_CONFIG: u8 = 78;

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
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
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
pub struct ConfigArgs {
    /// Configuration file [default: /etc/harvester-node-agent/config.toml, used only if it exists] [env: HNA_CONFIG]
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// Log filter: error, warn, info, debug, trace, or tracing directives [default: info] [env: HNA_LOG_LEVEL]
    #[arg(long, value_name = "FILTER")]
    pub log_level: Option<String>,
    /// Where logs go: auto, journald or stderr [default: auto] [env: HNA_LOG_TARGET]
    #[arg(long, value_name = "TARGET")]
    pub log_target: Option<String>,
    /// Persistent state directory [default: /var/lib/harvester-node-agent] [env: HNA_STATE_DIR]
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<String>,
    /// Control socket that `status` talks to [default: /run/harvester-node-agent/agent.sock] [env: HNA_SOCKET]
    #[arg(long, value_name = "PATH")]
    pub socket: Option<String>,
    /// This node's Node name [default: the hostname] [env: HNA_NODE_NAME]
    #[arg(long, value_name = "NAME")]
    pub node_name: Option<String>,
    /// Guest-cluster kubeconfig; disables discovery [default: discovered] [env: HNA_KUBECONFIG]
    #[arg(long, value_name = "PATH")]
    pub kubeconfig: Option<String>,
    /// Colon-separated kubeconfigs tried in order when --kubeconfig is unset [default: RKE2, K3s, kubeadm kubelet kubeconfigs] [env: HNA_KUBECONFIG_SEARCH]
    #[arg(long, value_name = "PATHS")]
    pub kubeconfig_search: Option<String>,
    /// How often to look for credentials and re-check the API server [default: 10s] [env: HNA_CREDENTIALS_RETRY]
    #[arg(long, value_name = "DURATION")]
    pub credentials_retry: Option<String>,
    /// How often the daemon re-runs the macvlan preflight; SIGHUP re-runs it at once [default: 5m] [env: HNA_MACVLAN_RECHECK]
    #[arg(long, value_name = "DURATION")]
    pub macvlan_recheck: Option<String>,
    /// Harvester cloud-provider kubeconfig for the topology relay [default: /etc/kubernetes/cloud-config, then RKE2's cloud-provider-config] [env: HNA_CLOUD_CONFIG]
    #[arg(long, value_name = "PATH")]
    pub cloud_config: Option<String>,
    /// This VM's VirtualMachineInstance name in Harvester [default: the hostname] [env: HNA_VM_NAME]
    #[arg(long, value_name = "NAME")]
    pub vm_name: Option<String>,
    /// Comma-separated label keys relayed from Harvester; empty turns the relay off [default: topology.kubernetes.io/region,topology.kubernetes.io/zone] [env: HNA_TOPOLOGY_LABELS]
    #[arg(long, value_name = "KEYS")]
    pub topology_labels: Option<String>,
    /// Serve Prometheus /metrics and /healthz on ADDR:PORT, e.g. 127.0.0.1:9477 [default: off] [env: HNA_METRICS_LISTEN]
    #[arg(long, value_name = "ADDR:PORT")]
    pub metrics_listen: Option<String>,
    /// Namespace of this node's LoadBalancerNode object (the controller's) [default: harvester-node-agent] [env: HNA_NAMESPACE]
    #[arg(long, value_name = "NAMESPACE")]
    pub namespace: Option<String>,
    /// How often the LoadBalancerNode status is rewritten when nothing in it changed (200ms to 10s) [default: 10s] [env: HNA_LB_HEARTBEAT]
    #[arg(long, value_name = "DURATION")]
    pub lb_heartbeat: Option<String>,
    /// ARP-probe a LoadBalancer address before use (true/false) [default: true] [env: HNA_LB_ARP_PROBE]
    #[arg(long, value_name = "BOOL")]
    pub lb_arp_probe: Option<String>,
    /// Listen this long for another holder before taking an address over; 0s is off (0s to 5s) [default: 150ms] [env: HNA_LB_TAKEOVER_GUARD]
    #[arg(long, value_name = "DURATION")]
    pub lb_takeover_guard: Option<String>,
    /// Without a view of the LAN: hand every address over after this long without a status write; 0s is never (10s to 1h) [default: 30s] [env: HNA_LB_FENCE_AFTER]
    #[arg(long, value_name = "DURATION")]
    pub lb_fence_after: Option<String>,
    /// Lifetime of every LoadBalancer address, confirmed four times per lifetime: a frozen or paused daemon stops answering within it; 0s is off (whole seconds, 1s to 60s) [default: 1s] [env: HNA_LB_ADDRESS_LIFETIME]
    #[arg(long, value_name = "DURATION")]
    pub lb_address_lifetime: Option<String>,
    /// Leave the addresses on their links this long when stopping for a restart; 0s always hands over (1s to 5m) [default: 15s] [env: HNA_LB_RESTART_GRACE]
    #[arg(long, value_name = "DURATION")]
    pub lb_restart_grace: Option<String>,
    /// Which stops keep the addresses for --lb-restart-grace: restart (systemd restarts the unit) or always [default: restart] [env: HNA_LB_KEEP_ON_STOP]
    #[arg(long, value_name = "WHEN")]
    pub lb_keep_on_stop: Option<String>,
    /// The RTC's seconds, which count the time this VM stands paused (live migration, suspend): every held address is announced again after a pause; empty is off [default: /sys/class/rtc/rtc0/since_epoch] [env: HNA_LB_PAUSE_CLOCK]
    #[arg(long, value_name = "PATH")]
    pub lb_pause_clock: Option<String>,
    /// Presence frames from each held address's MAC, so the LAN's switches follow a live migration: auto (every 500ms where the NIC does not announce a migration itself: e1000-family), off, or a period (100ms to 10s) on every uplink [default: auto] [env: HNA_LB_PRESENCE]
    #[arg(long, value_name = "auto|off|DURATION")]
    pub lb_presence: Option<String>,
    /// Uplink of the LoadBalancer macvlans when a Service names none [default: the default route's interface] [env: HNA_UPLINK]
    #[arg(long, value_name = "IFACE")]
    pub uplink: Option<String>,
}

impl ConfigArgs {
    pub fn flag_values(&self) -> FlagValues {
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
pub struct RunArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
}

/// The controller's settings: flags, each also read from its environment
/// variable (a Deployment sets either).
#[derive(Debug, Args)]
pub struct ControllerArgs {
    /// Log filter: error, warn, info, debug, trace, or tracing directives
    #[arg(long, value_name = "FILTER", env = "HNA_LOG_LEVEL", default_value = "info", value_parser = log_level_arg)]
    pub log_level: String,
    /// Where logs go: auto, journald or stderr
    #[arg(long, value_name = "TARGET", env = "HNA_LOG_TARGET", default_value = "auto", value_parser = log_target_arg)]
    pub log_target: config::LogTarget,
    /// Kubeconfig of the guest cluster [default: $KUBECONFIG, then the Pod's service account]
    #[arg(long, value_name = "PATH", env = "HNA_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// How often to look for credentials and re-check the API server (1s to 1h)
    #[arg(long, value_name = "DURATION", env = "HNA_CREDENTIALS_RETRY", default_value = "10s", value_parser = credentials_retry_arg)]
    pub credentials_retry: Duration,
    /// Namespace of the controller's Lease and of the LoadBalancerNode
    /// objects (one per Node) and their Roles; the node agents' `namespace`
    /// must be the same
    #[arg(long, value_name = "NAMESPACE", env = "HNA_NAMESPACE", default_value = hna_contract::DEFAULT_NAMESPACE)]
    pub namespace: String,
    /// This replica's name in the leader-election Lease (a Deployment sets
    /// POD_NAME from metadata.name); unset: `<hostname>-<pid>`
    #[arg(long, value_name = "NAME", env = "POD_NAME")]
    pub identity: Option<String>,
    /// Leader election: how long a Lease not renewed (as seen on this
    /// replica's clock) keeps others from taking over
    #[arg(long, value_name = "DURATION", env = "HNA_LEASE_DURATION", default_value = "3s", value_parser = election_arg)]
    pub lease_duration: Duration,
    /// Leader election: a leader that could not renew for this long stops
    /// writing at once (below --lease-duration)
    #[arg(long, value_name = "DURATION", env = "HNA_RENEW_DEADLINE", default_value = "2s", value_parser = election_arg)]
    pub renew_deadline: Duration,
    /// Leader election: how often the Lease is renewed or tried (below
    /// --renew-deadline)
    #[arg(long, value_name = "DURATION", env = "HNA_RETRY_PERIOD", default_value = "500ms", value_parser = election_arg)]
    pub retry_period: Duration,
    /// A node whose agent's heartbeat has not changed for this long, as
    /// seen on the controller's clock, and that none of its witnesses hears
    /// on the LAN, holds no address; its Services move to other nodes (a
    /// node its witnesses find dead on the LAN moves within about 2s,
    /// whatever its heartbeat). At least twice the agents' heartbeat
    /// period (lb_heartbeat, 10s), above their lb_fence_after (30s)
    #[arg(long, value_name = "DURATION", env = "HNA_NODE_STALE_AFTER", default_value = "40s", value_parser = stale_arg)]
    pub node_stale_after: Duration,
    /// When no node's heartbeat has changed for this long, the silence is
    /// blamed on the API server or the watch, not the nodes: nobody is
    /// judged stale, and after it every node gets a whole
    /// --node-stale-after again. Above the agents' heartbeat period (10s),
    /// at most --node-stale-after [default: 15s, or half of
    /// --node-stale-after when that is less]
    #[arg(long, value_name = "DURATION", env = "HNA_WATCH_QUIET_AFTER", value_parser = election_arg)]
    pub watch_quiet_after: Option<Duration>,
    /// A Service whose holder reports its lease FAILED (no macvlan, no
    /// DHCP answer on that uplink) for this long moves to another node,
    /// if one can take it
    #[arg(long, value_name = "DURATION", env = "HNA_SERVICE_FAILED_AFTER", default_value = "30s", value_parser = stale_arg)]
    pub service_failed_after: Duration,
    /// A Service whose holder reports its lease GUARDED (another host still
    /// answers for the address) for this long moves to another node, if
    /// one can take it. Keep it above the agents' lb_fence_after (30s): a
    /// former holder cut off from the API server and its LAN lets go
    /// within that
    #[arg(long, value_name = "DURATION", env = "HNA_SERVICE_GUARDED_AFTER", default_value = "150s", value_parser = stale_arg)]
    pub service_guarded_after: Duration,
    /// A node that could not serve a Service (see --service-failed-after)
    /// is not given that Service again for this long, while another node
    /// can take it
    #[arg(long, value_name = "DURATION", env = "HNA_SERVICE_AVOID_FOR", default_value = "10m", value_parser = stale_arg)]
    pub service_avoid_for: Duration,
    /// Serve Prometheus /metrics and /healthz on ADDR:PORT, e.g. 0.0.0.0:9478 [default: off]
    #[arg(long, value_name = "ADDR:PORT", env = "HNA_METRICS_LISTEN")]
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Where externalTrafficPolicy: Local learns which nodes have a ready
    /// endpoint: auto (EndpointSlices of discovery.k8s.io/v1 where the API
    /// serves them, Kubernetes 1.21 and later; else Endpoints), endpoints,
    /// or endpointslices (v1, else v1beta1 on Kubernetes 1.17 to 1.20)
    #[arg(long, value_name = "SOURCE", env = "HNA_ENDPOINT_SOURCE", default_value = "auto", value_parser = hna_controller::endpoints::EndpointSetting::parse)]
    pub endpoint_source: hna_controller::endpoints::EndpointSetting,
    /// Serve LoadBalancer Services of this spec.loadBalancerClass. Services
    /// of any other class are never touched. Naming a class also stops
    /// serving class-less DHCP Services (the Harvester cloud provider's
    /// `cloudprovider.harvesterhci.io/ipam: dhcp`) unless
    /// --serve-classless is given [default: harvester-node-agent.io/dhcp,
    /// with class-less DHCP Services served]
    #[arg(long, value_name = "CLASS", env = "HNA_LOAD_BALANCER_CLASS", value_parser = class_arg)]
    pub load_balancer_class: Option<String>,
    /// Whether class-less DHCP Services are served too: true or false
    /// (alone: true) [default: true unless --load-balancer-class is given]
    #[arg(long, value_name = "BOOL", env = "HNA_SERVE_CLASSLESS", num_args = 0..=1, default_missing_value = "true")]
    pub serve_classless: Option<bool>,
}

impl ControllerArgs {
    /// `--load-balancer-class` and `--serve-classless` as one policy.
    pub fn classes(&self) -> hna_contract::ClassPolicy {
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
const DEFAULT_WATCH_QUIET_AFTER: Duration = Duration::from_secs(15);

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
pub enum Output {
    /// Aligned text for people.
    #[default]
    Human,
    /// One JSON object for scripts.
    Json,
}

#[derive(Debug, Args)]
pub struct CheckArgs {
    /// Run only these checks: config, kubeconfig (with api-server),
    /// state-dir, macvlan, qemu-guest-agent, topology, cni (whether the
    /// CNI, its BPF programs or a network manager reach our hlb-* links;
    /// prints RKE2's HelmChartConfig that keeps them off) [default: all]
    #[arg(value_name = "CHECK")]
    pub names: Vec<String>,
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Output::Human)]
    pub output: Output,
    /// How long to wait for the API server when credentials are found (seconds, or with a unit: 500ms, 1m)
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = hna_edges::duration::parse_duration)]
    pub timeout: Duration,
    /// Do what the daemon does: load macvlan when it is on disk but not
    /// loaded (with the system's modprobe), then prove it with a throwaway
    /// macvlan on the uplink, never set up and deleted at once.
    #[arg(long)]
    pub fix: bool,
    /// Where the `cni` check looks for CNI configuration files (repeat
    /// for several) [default: /etc/cni/net.d, /var/lib/rancher/k3s/agent/etc/cni/net.d]
    #[arg(long, value_name = "DIR")]
    pub cni_conf_dir: Vec<PathBuf>,
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    /// The daemon's configuration file, read as `run` reads it for its `socket` [default: /etc/harvester-node-agent/config.toml, used only if it exists] [env: HNA_CONFIG]
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// The daemon's control socket [default: `socket` from the configuration, else /run/harvester-node-agent/agent.sock] [env: HNA_SOCKET]
    #[arg(long, value_name = "PATH")]
    pub socket: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Output::Human)]
    pub output: Output,
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Run(args) => {
            // Configuration first: nothing on the host changes before it
            // is valid.
            let cfg = match config::load(&args.config.flag_values()) {
                Ok(cfg) => cfg,
                Err(e) => return config_failure(&e),
            };
            serve(&cfg.log_level.clone(), cfg.log_target, |n| {
                Box::pin(async move { Ok(hna_node::agent::run(cfg, n).await?) })
            })
        }
        Command::Controller(args) => {
            let timing = hna_controller::election::Timing {
                lease_duration: args.lease_duration,
                renew_deadline: args.renew_deadline,
                retry_period: args.retry_period,
            };
            let watch_quiet_after = args
                .watch_quiet_after
                .unwrap_or_else(|| DEFAULT_WATCH_QUIET_AFTER.min(args.node_stale_after / 2));
            if watch_quiet_after > args.node_stale_after {
                eprintln!(
                    "harvester-node-agent: --watch-quiet-after ({}) must not be above --node-stale-after ({})",
                    humantime::format_duration(watch_quiet_after),
                    humantime::format_duration(args.node_stale_after)
                );
                return ExitCode::from(EXIT_CONFIG);
            }
            if let Err(e) = timing.validate() {
                eprintln!("harvester-node-agent: invalid leader election flags: {e}");
                return ExitCode::from(EXIT_CONFIG);
            }
            let classes = args.classes();
            let opts = hna_controller::Options {
                kubeconfig: args.kubeconfig,
                credentials_retry: args.credentials_retry,
                namespace: args.namespace,
                identity: args
                    .identity
                    .filter(|i| !i.trim().is_empty())
                    .unwrap_or_else(hna_controller::default_identity),
                timing,
                node_stale_after: args.node_stale_after,
                watch_quiet_after,
                service_failed_after: args.service_failed_after,
                service_guarded_after: args.service_guarded_after,
                service_avoid_for: args.service_avoid_for,
                metrics_listen: args.metrics_listen,
                endpoint_source: args.endpoint_source,
                classes,
            };
            serve(&args.log_level, args.log_target, |n| {
                Box::pin(async move { Ok(hna_controller::run(opts, n).await?) })
            })
        }
        Command::Check(args) => check(args),
        Command::Status(args) => status(args),
        Command::DhcpProbe(args) => dhcp_commands::probe_main(args),
        Command::DhcpHold(args) => dhcp_commands::hold_main(args),
    }
}

type DaemonFuture = std::pin::Pin<Box<dyn std::future::Future<Output = anyhow::Result<()>>>>;

/// How many worker threads a command's runtime gets.
enum Threads {
    /// One-shot commands.
    Current,
    /// Long-lived ones: two workers keep a slow handler from stalling the
    /// watchdog's loops on a 2-core VM.
    Two,
}

/// The async runtime of a command, or the exit code after saying why not.
fn runtime(threads: Threads) -> Result<tokio::runtime::Runtime, ExitCode> {
    let mut builder = match threads {
        Threads::Current => tokio::runtime::Builder::new_current_thread(),
        Threads::Two => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(2);
            b
        }
    };
    builder.enable_all().build().map_err(|e| {
        eprintln!("harvester-node-agent: cannot start the async runtime: {e}");
        ExitCode::FAILURE
    })
}

/// Runs a long-lived command (`run`, `controller`) on a runtime, with
/// logging set up and its failure told to systemd.
fn serve(
    log_level: &str,
    log_target: config::LogTarget,
    body: impl FnOnce(Arc<dyn Notifier>) -> DaemonFuture,
) -> ExitCode {
    crate::logging::init(log_level, log_target);
    let notifier: Arc<dyn Notifier> = Arc::new(SdNotifier);
    let runtime = match runtime(Threads::Two) {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    match runtime.block_on(body(notifier.clone())) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            notifier.status(&format!("failed: {e:#}"));
            eprintln!("harvester-node-agent: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn config_failure(e: &ConfigError) -> ExitCode {
    eprintln!("harvester-node-agent: invalid configuration: {e}");
    eprintln!(
        "harvester-node-agent: nothing was changed on this host; fix the configuration and start again (see `harvester-node-agent run --help`)"
    );
    // Tell systemd why, so `systemctl status` shows it.
    SdNotifier.status(&format!("invalid configuration: {e}"));
    ExitCode::from(EXIT_CONFIG)
}

/// Checks `check` can be limited to. `kubeconfig` includes `api-server`,
/// and `api-server` needs `kubeconfig` (no server without credentials), so
/// naming either runs both.
pub const CHECK_NAMES: &[&str] = &[
    "config",
    "kubeconfig",
    "api-server",
    "state-dir",
    "macvlan",
    "qemu-guest-agent",
    "topology",
    "cni",
];

fn check(args: CheckArgs) -> ExitCode {
    if let Some(bad) = args
        .names
        .iter()
        .find(|n| !CHECK_NAMES.contains(&n.as_str()))
    {
        eprintln!(
            "harvester-node-agent: no check named `{bad}`; choose from {}",
            CHECK_NAMES.join(", ")
        );
        return ExitCode::from(2);
    }
    let wanted = |name: &str| args.names.is_empty() || args.names.iter().any(|n| n == name);
    let runtime = match runtime(Threads::Current) {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    let flags = args.config.flag_values();
    let loaded = config::load(&flags);
    let mut checks = Vec::new();
    let mut helm_chart_configs = Vec::new();
    if wanted("config") {
        checks.push(check::config_check(&loaded));
    }
    // With a broken file, still check what the flags and defaults describe.
    let effective = loaded.or_else(|_| {
        config::resolve(
            None,
            &|k| std::env::var(k).ok(),
            &flags,
            &config::hostname_or_default,
        )
    });
    if let Ok(cfg) = &effective {
        if wanted("kubeconfig") || wanted("api-server") {
            let mut found = runtime.block_on(check::kubeconfig_checks(cfg, &HostEnv, args.timeout));
            if args.names.iter().any(|n| n == "api-server") {
                check::name_api_server(&mut found);
            }
            checks.extend(found);
        }
        if wanted("state-dir") {
            checks.push(check::state_dir_check(cfg));
        }
        if wanted("topology") {
            let found =
                hna_edges::cluster::credentials::discover(&cfg.credential_settings(), &HostEnv);
            let guest = runtime
                .block_on(hna_edges::cluster::credentials::connect(
                    &found,
                    args.timeout,
                ))
                .ok()
                .map(|c| c.client);
            let tcfg = hna_node::topology::TopologyConfig::from_config(cfg);
            let state = runtime.block_on(hna_node::topology::probe(
                &tcfg,
                guest,
                &cfg.node_name,
                args.timeout,
            ));
            checks.push(state.check());
        }
        if wanted("cni") {
            let (found, advice) = runtime.block_on(cni_checks(cfg, &args));
            checks.extend(found);
            helm_chart_configs = advice;
        }
    }
    if wanted("macvlan") {
        let macvlan = hna_node::kmod::preflight(&hna_node::kmod::host::Host::default(), args.fix);
        checks.push(check::macvlan_check(&macvlan));
    }
    if wanted("qemu-guest-agent") {
        let guest = runtime.block_on(hna_node::guest::watch::assess_now(std::path::Path::new(
            "/",
        )));
        checks.push(check::guest_agent_check(&guest));
    }
    let report = Report {
        checks,
        helm_chart_configs,
    };
    match args.output {
        Output::Json => println!("{}", report.to_json()),
        Output::Human => print!("{}", report.to_human()),
    }
    if report.failed() {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// The `cni` checks, and the HelmChartConfigs that keep RKE2's CNIs off
/// our links.
async fn cni_checks(cfg: &Config, args: &CheckArgs) -> (Vec<check::Check>, Vec<check::Advice>) {
    let dirs: Vec<PathBuf> = if args.cni_conf_dir.is_empty() {
        crate::cni::DEFAULT_CONF_DIRS
            .iter()
            .map(PathBuf::from)
            .collect()
    } else {
        args.cni_conf_dir.clone()
    };
    let found = hna_edges::cluster::credentials::discover(&cfg.credential_settings(), &HostEnv);
    let node = match hna_edges::cluster::credentials::connect(&found, args.timeout).await {
        Ok(conn) => crate::cni::host::node_facts(conn.client, &cfg.node_name, args.timeout).await,
        Err(e) => crate::cni::NodeFacts::NotRead(format!("{e:#}")),
    };
    let route = std::fs::read_to_string(hna_dhcp::link::ROUTE_TABLE)
        .ok()
        .and_then(|r| hna_dhcp::link::default_route_interface(&r));
    let uplink = hna_dhcp::link::current_uplink(cfg.uplink.as_deref(), route, None, |_| false);
    let facts = crate::cni::host::gather(&dirs, Path::new("/run"), uplink, node).await;
    let advice = crate::cni::helm_chart_configs(&facts)
        .into_iter()
        .map(|(cni, yaml)| check::Advice {
            title: format!(
                "RKE2 with {}: keep it off hlb-* links (kubectl apply -f, or a file in /var/lib/rancher/rke2/server/manifests/)",
                cni.as_str()
            ),
            text: yaml,
        })
        .collect();
    (crate::cni::assess(&facts), advice)
}

/// The socket `status` asks: resolved exactly as `run` resolves its own
/// (flag, `HNA_SOCKET`, the configuration file's `socket`, the default).
pub fn status_socket(
    args: &StatusArgs,
    load: impl FnOnce(&FlagValues) -> Result<Config, ConfigError>,
) -> Result<PathBuf, ConfigError> {
    let mut values = std::collections::BTreeMap::new();
    if let Some(socket) = &args.socket {
        values.insert("socket", socket.clone());
    }
    let flags = FlagValues {
        config: args.config.clone(),
        values,
    };
    load(&flags).map(|cfg| cfg.socket)
}

fn status(args: StatusArgs) -> ExitCode {
    let socket = match status_socket(&args, config::load) {
        Ok(socket) => socket,
        Err(e) => {
            eprintln!(
                "harvester-node-agent: invalid configuration: {e}; `status` reads it to find the daemon's socket (or pass --socket)"
            );
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let runtime = match runtime(Threads::Current) {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    match runtime.block_on(control::request_status::<
        hna_node::agent::daemon_state::AgentStatus,
    >(&socket))
    {
        Ok(st) => {
            match args.output {
                Output::Json => println!(
                    "{}",
                    serde_json::to_string_pretty(&st).expect("status serializes")
                ),
                Output::Human => print!("{}", human_status(&st)),
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("harvester-node-agent: {e}");
            ExitCode::FAILURE
        }
    }
}

fn human_status(st: &hna_node::agent::daemon_state::AgentStatus) -> String {
    use hna_node::agent::daemon_state::ClusterState;
    let cluster = match &st.cluster {
        ClusterState::WaitingForCredentials { searched, .. } => format!(
            "waiting for credentials (searched {})",
            searched
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
        ClusterState::Connected {
            kubeconfig,
            server,
            server_version,
        } => format!(
            "connected to {server} ({server_version}){}",
            kubeconfig
                .as_ref()
                .map(|p| format!(" using {}", p.display()))
                .unwrap_or_default()
        ),
        ClusterState::Connecting { kubeconfig } => format!(
            "connecting{}",
            kubeconfig
                .as_ref()
                .map(|p| format!(" using {}", p.display()))
                .unwrap_or_default()
        ),
        ClusterState::Unreachable { kubeconfig, error } => format!(
            "unreachable{}: {error}",
            kubeconfig
                .as_ref()
                .map(|p| format!(" ({})", p.display()))
                .unwrap_or_default()
        ),
    };
    format!(
        "harvester-node-agent {} on node {} (pid {}, up {})\n  summary:   {}\n  state dir: {} ({})\n  cluster:   {}\n  macvlan:   {}: {}{}\n  qemu-ga:   {}: {}\n  topology:  {}\n  node conditions: {}\n",
        st.version,
        st.node_name,
        st.pid,
        humantime::format_duration(Duration::from_secs(st.uptime_seconds)),
        st.summary,
        st.state_dir.path.display(),
        st.state_dir.message,
        cluster,
        st.macvlan.reason.as_str(),
        st.macvlan.message,
        if st.macvlan.remediation.is_empty() {
            String::new()
        } else {
            format!("\n             fix: {}", st.macvlan.remediation)
        },
        st.guest_agent.reason.as_str(),
        st.guest_agent.message,
        st.topology.short(),
        match &st.node_conditions {
            hna_node::node_conditions::Reported::NotConnected =>
                "not connected to the cluster".to_string(),
            hna_node::node_conditions::Reported::NodeNotRegistered =>
                format!("Node {} is not registered yet", st.node_name),
            hna_node::node_conditions::Reported::Reported { at } =>
                format!("MacvlanReady, GuestAgentReady reported at {at}"),
            hna_node::node_conditions::Reported::Failed { error } => format!("failed: {error}"),
        }
    ) + &human_lb(&st.lb)
        + &human_dhcp(&st.dhcp)
}

/// The lease table: one line per lease, then the endpoint.
/// The LoadBalancer addresses assigned to this node, one line each.
fn human_lb(lb: &hna_node::agent::daemon_state::LbStatus) -> String {
    use std::fmt::Write;
    let mut out = format!(
        "  lb:        {} ({}: {}){}\n",
        lb.short(),
        lb.object,
        lb.read,
        lb.write_error
            .as_ref()
            .map(|e| format!("; cannot write status: {e}"))
            .unwrap_or_default()
    );
    if !lb.removed_at_start.is_empty() {
        let _ = writeln!(
            out,
            "             removed at start (left by an earlier run, not assigned): {}",
            lb.removed_at_start.join(", ")
        );
    }
    for l in &lb.status.leases {
        let _ = writeln!(
            out,
            "    {} {} {:<10} {:<15} expires {}{}",
            l.service,
            l.interface,
            l.state,
            l.address.as_deref().unwrap_or("-"),
            l.expires.as_deref().unwrap_or("-"),
            l.message
                .as_ref()
                .map(|m| format!("; {m}"))
                .unwrap_or_default()
        );
    }
    out
}

fn human_dhcp(d: &hna_node::agent::daemon_state::DhcpStatus) -> String {
    use std::fmt::Write;
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|t| t.as_millis() as u64)
        .unwrap_or(0);
    let until = |at: Option<u64>| match at {
        Some(ms) if ms > now_ms => {
            humantime::format_duration(Duration::from_secs((ms - now_ms) / 1000)).to_string()
        }
        Some(_) => "now".to_string(),
        None => "-".to_string(),
    };
    let mut out = format!("  dhcp:      {} lease(s)", d.leases.len());
    if let Some(url) = &d.metrics_url {
        let _ = write!(out, ", metrics at {url}");
    }
    out.push('\n');
    if !d.removed_at_start.is_empty() {
        let _ = writeln!(
            out,
            "             removed at start (left by an earlier run): {}",
            d.removed_at_start.join(", ")
        );
    }
    for p in &d.sweep_problems {
        let _ = writeln!(out, "             could not check: {p}");
    }
    for l in &d.leases {
        let _ = writeln!(
            out,
            "    {} {} {:<10} {:<15} server {:<15} renew in {}, expires in {}; sent {} received {} dropped {} NAKs {}{}{}",
            l.name,
            l.mac,
            l.state.as_str(),
            l.address
                .map(|a| a.to_string())
                .unwrap_or_else(|| "-".into()),
            l.server
                .map(|a| a.to_string())
                .unwrap_or_else(|| "-".into()),
            until(l.t1_at_unix_ms),
            until(l.expires_at_unix_ms),
            l.counters.sent,
            l.counters.received,
            l.counters.dropped,
            l.counters.naks,
            l.presence_every_ms
                .map(|ms| format!("; presence frames every {ms}ms"))
                .unwrap_or_default(),
            l.last_error
                .as_ref()
                .map(|e| format!("; last error: {e}"))
                .unwrap_or_default()
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status_args(line: &[&str]) -> StatusArgs {
        match Cli::try_parse_from(line).expect("parses").command {
            Command::Status(a) => a,
            other => panic!("{other:?}"),
        }
    }

    /// `status` finds the daemon where `run` put it: the configuration
    /// file's `socket`, unless a flag overrides it.
    #[test]
    fn status_reads_the_socket_from_the_configuration() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config.toml");
        std::fs::write(&file, "socket = \"/run/hna-test/other.sock\"\n").unwrap();
        let file = file.to_str().unwrap();
        let args = status_args(&["hna", "status", "--config", file]);
        assert_eq!(
            status_socket(&args, config::load).unwrap(),
            PathBuf::from("/run/hna-test/other.sock")
        );
        let args = status_args(&["hna", "status", "--config", file, "--socket", "/tmp/s.sock"]);
        assert_eq!(
            status_socket(&args, config::load).unwrap(),
            PathBuf::from("/tmp/s.sock")
        );
        std::fs::write(dir.path().join("bad.toml"), "socket = \"relative\"\n").unwrap();
        let bad = dir.path().join("bad.toml");
        let args = status_args(&["hna", "status", "--config", bad.to_str().unwrap()]);
        let err = status_socket(&args, config::load).unwrap_err();
        assert_eq!(err.key(), Some("socket"));
    }

    #[test]
    fn controller_settings_are_not_the_daemons() {
        use clap::CommandFactory;
        let mut cli = Cli::command();
        let run_help = cli
            .find_subcommand_mut("run")
            .unwrap()
            .render_long_help()
            .to_string();
        let controller_help = cli
            .find_subcommand_mut("controller")
            .unwrap()
            .render_long_help()
            .to_string();
        for daemon_only in [
            "--state-dir",
            "--macvlan-recheck",
            "--socket",
            "--node-name",
        ] {
            assert!(run_help.contains(daemon_only), "{daemon_only}");
            assert!(!controller_help.contains(daemon_only), "{daemon_only}");
        }
        assert!(controller_help.contains("--kubeconfig"));
        assert!(Cli::try_parse_from(["hna", "controller", "--state-dir", "/x"]).is_err());
    }
    use hna_dhcp::State;
    use hna_dhcp::driver::LeaseStatus;
    use hna_node::agent::daemon_state::DhcpStatus;

    #[test]
    fn lb_lines_name_each_service_and_its_lease() {
        use hna_contract::node_object::{LeaseReport, Status};
        let lb = hna_node::agent::daemon_state::LbStatus {
            object: "harvester-node-agent/n1".into(),
            read: "watching".into(),
            wanted: 2,
            status: Status {
                held: 1,
                ready: true,
                leases: vec![
                    LeaseReport {
                        service: "default/web".into(),
                        interface: "hlb-3f2a9c1e".into(),
                        state: "BOUND".into(),
                        address: Some("10.77.0.150".into()),
                        expires: Some("2026-11-22T18:00:00Z".into()),
                        ..LeaseReport::default()
                    },
                    LeaseReport {
                        service: "default/db".into(),
                        interface: "hlb-0000abcd".into(),
                        state: "FAILED".into(),
                        message: Some("no uplink".into()),
                        ..LeaseReport::default()
                    },
                ],
                ..Status::default()
            },
            ..Default::default()
        };
        let text = human_lb(&lb);
        assert!(
            text.starts_with("  lb:        lb 1/2 held (harvester-node-agent/n1: watching)\n"),
            "{text}"
        );
        assert!(
            text.contains(
                "default/web hlb-3f2a9c1e BOUND      10.77.0.150     expires 2026-11-22T18:00:00Z\n"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "default/db hlb-0000abcd FAILED     -               expires -; no uplink\n"
            ),
            "{text}"
        );
    }

    #[test]
    fn lease_table_has_a_line_per_lease_and_the_sweep() {
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        let mut bound = LeaseStatus::new("vip-0000abcd", [0, 0, 0x6c, 0, 0xab, 0xcd]);
        bound.state = State::Bound;
        bound.address = Some("10.77.0.150".parse().unwrap());
        bound.server = Some("10.77.0.1".parse().unwrap());
        bound.t1_at_unix_ms = Some(now_ms + 90_500);
        bound.expires_at_unix_ms = Some(now_ms + 3_600_500);
        bound.counters.sent = 2;
        bound.counters.received = 2;
        bound.presence_every_ms = Some(500);
        let mut waiting = LeaseStatus::new("vip-0000abce", [0, 0, 0x6c, 0, 0xab, 0xce]);
        waiting.last_error = Some("send: network is down".into());
        let text = human_dhcp(&DhcpStatus {
            metrics_url: Some("http://127.0.0.1:9477/metrics".into()),
            removed_at_start: vec!["vip-0000dead".into()],
            sweep_problems: vec![],
            leases: vec![bound, waiting],
        });
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "  dhcp:      2 lease(s), metrics at http://127.0.0.1:9477/metrics"
        );
        assert!(lines[1].ends_with("earlier run): vip-0000dead"), "{text}");
        assert!(
            lines[2].starts_with("    vip-0000abcd 00:00:6c:00:ab:cd BOUND      10.77.0.150     server 10.77.0.1       renew in 1m 30s, expires in 1h; sent 2 received 2"),
            "{text}"
        );
        assert!(
            lines[2].ends_with("; presence frames every 500ms"),
            "{text}"
        );
        assert!(!lines[3].contains("presence"), "{text}");
        assert!(
            lines[3].contains("INIT") && lines[3].ends_with("; last error: send: network is down"),
            "{text}"
        );
        assert_eq!(lines.len(), 4, "{text}");
    }

    #[test]
    fn duration_flags_take_bare_seconds_and_units() {
        use std::time::Duration;
        let parse = |args: &[&str]| {
            Cli::try_parse_from([&["harvester-node-agent"], args].concat())
                .map(|c| c.command)
                .map_err(|e| e.to_string())
        };
        let check_timeout = |args: &[&str]| match parse(args) {
            Ok(Command::Check(a)) => Ok(a.timeout),
            Ok(other) => panic!("{other:?}"),
            Err(e) => Err(e),
        };
        let probe_timeout = |args: &[&str]| match parse(args) {
            Ok(Command::DhcpProbe(a)) => Ok(a.timeout),
            Ok(other) => panic!("{other:?}"),
            Err(e) => Err(e),
        };
        assert_eq!(
            check_timeout(&["check", "--timeout", "3"]),
            Ok(Duration::from_secs(3))
        );
        assert_eq!(
            check_timeout(&["check", "--timeout", "1m30s"]),
            Ok(Duration::from_secs(90))
        );
        assert_eq!(check_timeout(&["check"]), Ok(Duration::from_secs(5)));
        assert_eq!(
            probe_timeout(&["dhcp-probe", "--timeout", "3"]),
            Ok(Duration::from_secs(3))
        );
        assert_eq!(
            probe_timeout(&["dhcp-probe", "--timeout", "2.5"]),
            Ok(Duration::from_millis(2500))
        );
        assert_eq!(
            probe_timeout(&["dhcp-probe", "--timeout", "500ms"]),
            Ok(Duration::from_millis(500))
        );
        assert_eq!(probe_timeout(&["dhcp-probe"]), Ok(Duration::from_secs(10)));
        for bad in ["--timeout=-3", "--timeout=soon", "--timeout="] {
            let err = probe_timeout(&["dhcp-probe", bad]).unwrap_err();
            assert!(err.contains("bare number"), "{bad}: {err}");
        }

        // Configuration flags are resolved by config::resolve.
        let Ok(Command::Run(run)) = parse(&["run", "--credentials-retry", "3"]) else {
            panic!("run does not parse");
        };
        let cfg = hna_node::config::resolve(None, &|_| None, &run.config.flag_values(), &|| {
            "node-a".into()
        })
        .unwrap();
        assert_eq!(cfg.credentials_retry, Duration::from_secs(3));
    }
}
