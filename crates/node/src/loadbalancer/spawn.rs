//! Starting the node's LoadBalancer work: the watch of this node's
//! `LoadBalancerNode`, the LoadBalancer task ([`super::task::run_loop`]),
//! the LAN membership it consults and the pause watch. The daemon
//! (`agent`) only calls [`spawn`].

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::metrics::histogram::Histogram;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;

use super::LbStatus;
use super::kept::Kept;
use super::task::{self, LanLink, LbSettings, NodeView};
use crate::config::Config;
use crate::kmod::MacvlanState;
use crate::membership::transport::{self, KeyBytes, LanView, Want};
use hna_edges::systemd::Liveness;

/// What the daemon lends the LoadBalancer work.
pub(crate) struct Daemon<'a> {
    pub(crate) liveness: &'a Liveness,
    pub(crate) beat_every: Duration,
    /// Changes once, when the daemon stops.
    pub(crate) shutdown: watch::Receiver<bool>,
    pub(crate) takeover_guard_wait: Histogram,
}

/// How often the default uplink's address is looked at for the membership.
const UPLINK_ADDRESS_POLL: Duration = Duration::from_secs(1);

const SYS_CLASS_NET: &str = "/sys/class/net";

/// The LoadBalancer task and the watch of this node's object it reads.
pub(crate) fn spawn(
    tasks: &mut JoinSet<()>,
    daemon: Daemon<'_>,
    cfg: &Config,
    engine: Arc<hna_dhcp::engine::Engine>,
    client: watch::Receiver<Option<kube::Client>>,
    macvlan: watch::Receiver<MacvlanState>,
    out: watch::Sender<LbStatus>,
) {
    let (tx, rx) = mpsc::channel(16);
    let (relist, relist_asked) = watch::channel(0);
    tasks.spawn(task::follow(
        client.clone(),
        cfg.namespace.clone(),
        cfg.node_name.clone(),
        tx,
        relist_asked,
    ));
    let view = HostView::new(cfg.uplink.clone(), macvlan);
    let node = move || view.read();
    let kept = Kept::in_state_dir(&cfg.state_dir);
    let settings = LbSettings {
        kept: Some(kept.clone()),
        ..settings(cfg, daemon.takeover_guard_wait.clone())
    };
    let lan = spawn_membership(tasks, cfg, client.clone(), daemon.shutdown.clone(), kept);
    let pauses = watch_pauses(cfg);
    let writer = task::KubeStatus {
        client,
        namespace: cfg.namespace.clone(),
        node: cfg.node_name.clone(),
    };
    tasks.spawn(task::run_loop(
        engine,
        writer,
        settings,
        node,
        rx,
        out,
        daemon.liveness.register("loadbalancer"),
        daemon.beat_every,
        lan,
        pauses,
        relist,
        daemon.shutdown,
    ));
}

/// The LoadBalancer task's settings from the daemon's configuration.
fn settings(cfg: &Config, takeover_guard_wait: Histogram) -> LbSettings {
    LbSettings {
        object: format!("{}/{}", cfg.namespace, cfg.node_name),
        heartbeat: cfg.lb_heartbeat,
        fence_after: cfg.lb_fence_after,
        restart_grace: cfg.lb_restart_grace,
        keep_on_stop: cfg.lb_keep_on_stop,
        adoption_wait: task::ADOPTION_WAIT,
        settle: task::SETTLE,
        leases: super::apply::Settings {
            timing: hna_dhcp::Timing {
                arp_probe: cfg.lb_arp_probe,
                address_lifetime: (!cfg.lb_address_lifetime.is_zero())
                    .then_some(cfg.lb_address_lifetime),
                ..hna_dhcp::Timing::default()
            },
            takeover_guard: cfg.lb_takeover_guard,
            presence: cfg.lb_presence,
            ..super::apply::Settings::default()
        },
        takeover_guard_wait,
        kept: None,
    }
}

/// The pauses of this VM the LoadBalancer task hears of; with a pause
/// clock configured, a long pause also sets every link down at once.
fn watch_pauses(cfg: &Config) -> watch::Receiver<Option<crate::pause::Pause>> {
    let (pause_tx, pauses) = watch::channel(None);
    if let Some(clock) = cfg.lb_pause_clock.clone() {
        // A pause that may have been as long as the witnesses' verdict on
        // this node: every Service address of this node goes silent at
        // once, before the LoadBalancer task hands them over
        // (`task::Lb::after_pause`), which deletes the links.
        let on_long = crate::pause::OnLongPause {
            from: task::may_have_been_judged_from(cfg.lb_address_lifetime),
            act: Box::new(|at_least| {
                let (down, failed) = hna_dhcp::link::set_down_now(hna_contract::INTERFACE_PREFIX);
                tracing::warn!(at_least = ?at_least, links = ?down, "this VM was paused for long enough that its witnesses may have reported it: every LoadBalancer link set down at once");
                for (link, e) in failed {
                    tracing::warn!(%link, error = %e, "could not set the link down after the pause");
                }
            }),
        };
        if let Err(e) = crate::pause::spawn(clock, pause_tx, Some(on_long)) {
            tracing::warn!(error = %e, "cannot start the pause watch: pauses of this VM (live migration, suspend) go unseen");
        }
    }
    pauses
}

/// The host as the LoadBalancer task sees it, read afresh each time, with
/// what must stay steady across reads (the uplink, the gateway's MAC).
struct HostView {
    uplink: Option<String>,
    macvlan: watch::Receiver<MacvlanState>,
    last_uplink: Mutex<Option<String>>,
    last_gateway: Mutex<Option<((String, Ipv4Addr), String)>>,
}

impl HostView {
    fn new(uplink: Option<String>, macvlan: watch::Receiver<MacvlanState>) -> HostView {
        HostView {
            uplink,
            macvlan,
            last_uplink: Mutex::new(None),
            last_gateway: Mutex::new(None),
        }
    }

    fn read(&self) -> NodeView {
        let sys_class_net = Path::new(SYS_CLASS_NET);
        // Read once: the uplink and the gateway come from the same table.
        let routes = std::fs::read_to_string(hna_dhcp::link::ROUTE_TABLE).ok();
        let default_uplink = self.default_uplink(routes.as_deref());
        let neighbours = std::fs::read_to_string(hna_dhcp::link::ARP_TABLE)
            .map(|t| hna_dhcp::link::arp_neighbours(&t))
            .unwrap_or_default();
        let gateway = routes.as_deref().and_then(hna_dhcp::link::default_gateway);
        let gateway_address = gateway.as_ref().map(|(_, gw)| *gw);
        let gateway_mac = self.gateway_mac(gateway, &neighbours);
        let mut no_carrier =
            hna_dhcp::link::without_carrier(sys_class_net, hna_contract::INTERFACE_PREFIX);
        // A configured uplink that does not exist (deleted, not yet made
        // again by the network service) carries nothing either: its leases
        // are handed over at once, not retried on it.
        if let Some(u) = &default_uplink
            && !sys_class_net.join(u).exists()
        {
            no_carrier.insert(u.clone());
        }
        let m = self.macvlan.borrow();
        NodeView {
            macvlan_ready: m.ready,
            macvlan_reason: m.short(),
            default_uplink,
            no_carrier,
            nics: hna_dhcp::link::network_cards(sys_class_net, hna_contract::INTERFACE_PREFIX),
            own_macs: hna_dhcp::link::interface_macs(sys_class_net, hna_contract::INTERFACE_PREFIX),
            neighbours,
            gateway_mac,
            gateway_address,
        }
    }

    fn default_uplink(&self, routes: Option<&str>) -> Option<String> {
        let mut last = self.last_uplink.lock().unwrap_or_else(|p| p.into_inner());
        let now = hna_dhcp::link::current_uplink(
            self.uplink.as_deref(),
            routes.and_then(hna_dhcp::link::default_route_interface),
            last.as_deref(),
            |name| Path::new(SYS_CLASS_NET).join(name).exists(),
        );
        last.clone_from(&now);
        now
    }

    /// Kept while the gateway stays the same: its ARP entry comes and goes
    /// with traffic, and `status.gatewayMac` should not.
    fn gateway_mac(
        &self,
        gateway: Option<(String, Ipv4Addr)>,
        neighbours: &BTreeMap<String, BTreeSet<(Ipv4Addr, String)>>,
    ) -> Option<String> {
        let mut last = self.last_gateway.lock().unwrap_or_else(|p| p.into_inner());
        let seen = gateway.as_ref().and_then(|(dev, gw)| {
            neighbours
                .iter()
                .find(|(_, at)| at.contains(&(*gw, dev.clone())))
                .map(|(mac, _)| mac.clone())
        });
        *last = match (gateway, seen, last.take()) {
            (Some(gw), Some(mac), _) => Some((gw, mac)),
            (Some(gw), None, Some((was, mac))) if was == gw => Some((gw, mac)),
            _ => None,
        };
        last.as_ref().map(|(_, mac)| mac.clone())
    }
}

/// The LAN membership (`crate::membership`), the watch of its key (the
/// Secret, which this node's Role may read) and the poll of the address it
/// listens on; returns the LoadBalancer task's side of it.
fn spawn_membership(
    tasks: &mut JoinSet<()>,
    cfg: &Config,
    client: watch::Receiver<Option<kube::Client>>,
    shutdown: watch::Receiver<bool>,
    kept: Kept,
) -> LanLink {
    // What the last run kept: its peers, its key and its witnesses' words,
    // so that a run started while the API server cannot be read still
    // takes part in its LAN (`super::kept`).
    let kept_peers = kept.spec().map(|s| s.peers).unwrap_or_default();
    let kept_key = kept.key().map(|secret| vec![KeyBytes { id: 1, secret }]);
    let want = Arc::new(
        watch::channel(Want {
            node: cfg.node_name.clone(),
            port: cfg.lb_membership_port,
            lifetime: cfg.lb_address_lifetime,
            peers: kept_peers,
            keys: kept_key.unwrap_or_default(),
            seed: Some((tokio::time::Instant::now(), kept.words())),
            ..Want::default()
        })
        .0,
    );
    let (view_tx, view) = watch::channel(LanView::default());
    let (stop, stop_rx) = watch::channel(None);
    if cfg.lb_membership_port == 0 {
        view_tx.send_replace(LanView {
            why_not: Some("off (lb_membership_port = 0)".into()),
            ..LanView::default()
        });
        return LanLink { want, view, stop };
    }
    let epochs = kept.clone();
    tasks.spawn(transport::run(
        want.subscribe(),
        view_tx,
        stop_rx,
        Arc::new(move |now_ms| epochs.next_epoch(now_ms)),
    ));
    let mut stopping = shutdown.clone();
    let key = follow_membership_key(client, cfg.namespace.clone(), want.clone(), kept);
    tasks.spawn(async move {
        tokio::select! {
            _ = key => {}
            _ = stopping.changed() => {}
        }
    });
    tasks.spawn(poll_uplink_address(
        cfg.uplink.clone(),
        want.clone(),
        shutdown,
    ));
    LanLink { want, view, stop }
}

/// Keeps the membership's listen address at the default uplink's.
async fn poll_uplink_address(
    uplink: Option<String>,
    poll: Arc<watch::Sender<Want>>,
    mut stopping: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(UPLINK_ADDRESS_POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The uplink as the LoadBalancer task picks it (`current_uplink`:
    // kept through a moment without a default route).
    let mut last: Option<String> = None;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stopping.changed() => return,
        }
        let interface = hna_dhcp::link::current_uplink(
            uplink.as_deref(),
            std::fs::read_to_string(hna_dhcp::link::ROUTE_TABLE)
                .ok()
                .as_deref()
                .and_then(hna_dhcp::link::default_route_interface),
            last.as_deref(),
            |name| Path::new(SYS_CLASS_NET).join(name).exists(),
        );
        last.clone_from(&interface);
        let listen = interface
            .as_deref()
            .and_then(hna_dhcp::link::interface_ipv4);
        poll.send_if_modified(|w| {
            let changed = w.listen != listen;
            w.listen = listen;
            changed
        });
    }
}

/// Keeps the membership's keys at what the Secret holds, with whichever
/// client the daemon has.
async fn follow_membership_key(
    mut client: watch::Receiver<Option<kube::Client>>,
    namespace: String,
    want: Arc<watch::Sender<Want>>,
    kept: Kept,
) {
    loop {
        let current = client.borrow_and_update().clone();
        let Some(c) = current else {
            if client.changed().await.is_err() {
                return;
            }
            continue;
        };
        if let KeyWatch::DaemonStops =
            follow_key_with(c, &mut client, &namespace, &want, &kept).await
        {
            return;
        }
    }
}

/// How one client's watch of the Secret ended.
enum KeyWatch {
    /// Start again: with the new client, or after the watch gave up.
    Again,
    DaemonStops,
}

/// Follows the Secret with one client until that client changes or the
/// watch ends.
async fn follow_key_with(
    c: kube::Client,
    client: &mut watch::Receiver<Option<kube::Client>>,
    namespace: &str,
    want: &watch::Sender<Want>,
    kept: &Kept,
) -> KeyWatch {
    use hna_contract::membership::SECRET_NAME;
    use hna_edges::cluster::watch_one::watch_one;
    use k8s_openapi::api::core::v1::Secret;
    let (tx, mut rx) = mpsc::channel(4);
    let api: kube::Api<Secret> = kube::Api::namespaced(c, namespace);
    let task = tokio::spawn(watch_one(
        api,
        SECRET_NAME.to_string(),
        hna_edges::cluster::credentials::WATCH_TIMEOUT_SECS,
        tx,
        |u| u,
    ));
    let mut logged = None::<String>;
    loop {
        tokio::select! {
            changed = client.changed() => {
                task.abort();
                if changed.is_err() {
                    return KeyWatch::DaemonStops;
                }
                return KeyWatch::Again;
            }
            u = rx.recv() => {
                let Some(u) = u else {
                    task.abort();
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    return KeyWatch::Again;
                };
                let Some(keys) = keys_in(u, namespace, &mut logged) else {
                    continue;
                };
                logged = None;
                let changed = want.send_if_modified(|w| {
                    let changed = w.keys != keys;
                    w.keys.clone_from(&keys);
                    changed
                });
                if changed && let Some(k) = keys.first() {
                    kept.keep_key(&k.secret);
                }
            }
        }
    }
}

/// The membership keys one update of the Secret gives; `None` keeps the
/// keys known (and says why once, not at every update).
fn keys_in(
    u: hna_edges::cluster::watch_one::Update<k8s_openapi::api::core::v1::Secret>,
    namespace: &str,
    logged: &mut Option<String>,
) -> Option<Vec<KeyBytes>> {
    use hna_contract::membership::{SECRET_KEY, SECRET_NAME};
    use hna_edges::cluster::watch_one::Update;
    match u {
        Update::Present(secret) => {
            let bytes = secret
                .data
                .as_ref()
                .and_then(|d| d.get(SECRET_KEY))
                .map(|b| b.0.clone())
                .unwrap_or_default();
            if bytes.len() < 32 {
                let why = format!(
                    "the Secret {namespace}/{SECRET_NAME} has no `{SECRET_KEY}` of at least 32 bytes; the controller makes it"
                );
                if logged.as_deref() != Some(&why) {
                    tracing::warn!("{why}");
                    *logged = Some(why);
                }
                return None;
            }
            Some(vec![KeyBytes {
                id: 1,
                secret: bytes,
            }])
        }
        Update::Absent => {
            let why = format!(
                "the Secret {namespace}/{SECRET_NAME} does not exist yet (the controller makes it); the LAN membership waits for it"
            );
            if logged.as_deref() != Some(&why) {
                tracing::info!("{why}");
                *logged = Some(why);
            }
            None
        }
        // Unreadable: the key known stays.
        Update::Failed(_) => None,
    }
}
