//! `harvester-node-agent controller`: the in-cluster controller that gives
//! DHCP-mode LoadBalancer Services an address through the node agents
//! (issue #9; `docs/loadbalancer-design.md`).
//!
//! Every replica watches and decides; only the leader writes. [`run`] is
//! the loop; the modules, from pure to edge:
//!
//! - [`reconcile`]: the decision: Services, Nodes and node objects in,
//!   ordered writes and Events out;
//! - `placement`: stable, spread, deterministic holders;
//! - `liveness`: node agents' heartbeats judged on our clock;
//! - `lan_verdict`: which nodes are dead on their LAN, by two witnesses;
//! - `eligibility`: which nodes may hold addresses, and how (a node's
//!   heartbeat, its LAN's verdict and its own word, judged together);
//! - `failover_metric`, `service_health`, `deletions`, `networks`: the
//!   failover duration metric, avoiding nodes whose leases fail, releases
//!   that time out, which networks a node is on;
//! - [`election`]: leader election on a `coordination.k8s.io/v1` Lease,
//!   pure; `leadership` runs it (the Lease read and written);
//! - [`writer`]: decisions as PATCHes, leadership checked before each;
//! - [`kube_edge`], `watches`: the API (watch caches, requests, Events);
//! - [`endpoints`]: which nodes have a ready endpoint of a Service;
//! - `stats`: `STATUS=` and metrics; `heap`: freed heap given back to the
//!   kernel after a large pass.

pub(crate) mod deletions;
pub mod election;
pub(crate) mod eligibility;
pub mod endpoints;
pub(crate) mod failover_metric;
mod heap;
pub mod kube_edge;
pub(crate) mod lan_verdict;
pub(crate) mod leadership;
pub(crate) mod liveness;
pub(crate) mod networks;
pub(crate) mod placement;
pub mod reconcile;
pub(crate) mod service_health;
pub(crate) mod stats;
pub(crate) mod watches;
pub mod writer;

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::api::Api;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use hna_edges::cluster::connection::{self, ClusterState, WatchOptions};
use hna_edges::cluster::credentials::{self, HostEnv, Settings};
use hna_edges::systemd::{self, Liveness, Notifier};

use election::Timing;
use stats::Stats;

/// How long one API health request may take.
const API_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the controller reconciles without a change (heartbeat
/// staleness is only seen by looking again).
const TICK: Duration = Duration::from_secs(1);
/// A burst of watch events is decided once, a window after its first:
/// twice as long as the last pass took to decide (the pure part), within
/// these bounds. Short for a small cluster, since the window is paid twice
/// on the way from a new Service to its address (Service to assignment,
/// lease to status); longer for a large one, so a storm of events cannot
/// keep the controller deciding all the time.
const COALESCE_MIN: Duration = Duration::from_millis(5);
const COALESCE_MAX: Duration = Duration::from_millis(200);

fn coalesce_window(last_pass: Duration) -> Duration {
    (last_pass * 2).clamp(COALESCE_MIN, COALESCE_MAX)
}

/// The controller's own settings (its command line is `cli`'s
/// `ControllerArgs`); none of the node daemon's keys apply to it.
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    /// A kubeconfig to use; `None` means `$KUBECONFIG`, then the Pod's
    /// service account.
    pub kubeconfig: Option<PathBuf>,
    /// How often to look for credentials and re-check the API server.
    pub credentials_retry: Duration,
    /// The namespace of the controller Lease and the LoadBalancerNodes.
    pub namespace: String,
    /// This replica's name in the Lease.
    pub identity: String,
    pub timing: Timing,
    /// A node whose heartbeat has not changed for this long (on our clock)
    /// holds no address.
    pub node_stale_after: Duration,
    /// No heartbeat change from any node for this long: the watch, not the
    /// nodes, is suspect (`liveness`).
    pub watch_quiet_after: Duration,
    /// A lease reported FAILED, or GUARDED, for this long makes its node
    /// one to avoid for that Service for `service_avoid_for`
    /// (`service_health`).
    pub service_failed_after: Duration,
    pub service_guarded_after: Duration,
    pub service_avoid_for: Duration,
    /// Serve `/metrics` and `/healthz` here.
    pub metrics_listen: Option<SocketAddr>,
    /// Where `externalTrafficPolicy: Local` reads ready endpoints.
    pub endpoint_source: endpoints::EndpointSetting,
    /// Which `spec.loadBalancerClass` values are ours.
    pub classes: hna_contract::ClassPolicy,
}

/// `<hostname>-<pid>`: unique enough among replicas when no Pod name is
/// given.
pub fn default_identity() -> String {
    let host = nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "controller".into());
    format!("{host}-{}", std::process::id())
}

/// Why the controller could not start.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    #[error("invalid election timing: {0}")]
    Timing(election::TimingError),
    #[error("installing {signal} handler")]
    Signal {
        signal: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("listening for metrics on {addr}")]
    Metrics {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// The controller until SIGTERM or SIGINT.
pub async fn run(opts: Options, notifier: Arc<dyn Notifier>) -> Result<(), ControllerError> {
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        identity = %opts.identity,
        namespace = %opts.namespace,
        "starting harvester-node-agent controller"
    );
    opts.timing.validate().map_err(ControllerError::Timing)?;
    let installing = |signal| move |source| ControllerError::Signal { signal, source };
    let mut sigterm = signal(SignalKind::terminate()).map_err(installing("SIGTERM"))?;
    let mut sigint = signal(SignalKind::interrupt()).map_err(installing("SIGINT"))?;
    let watchdog = systemd::watchdog_period();
    let beat_every = systemd::heartbeat_interval(watchdog);
    let settings = Settings {
        kubeconfig: opts.kubeconfig.clone(),
        search: Vec::new(),
    };
    let (cluster_tx, mut cluster_rx) = watch::channel(ClusterState::initial(
        &credentials::discover(&settings, &HostEnv),
    ));
    let (client_tx, mut client_rx) = watch::channel::<Option<kube::Client>>(None);
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let liveness = Liveness::default();
    let stats = Arc::new(Mutex::new(Stats {
        ..Default::default()
    }));
    let failover = stats::failover_histogram();
    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn(connection::watch(
        WatchOptions {
            settings,
            every: opts.credentials_retry,
            api_timeout: API_TIMEOUT,
            beat_every,
        },
        HostEnv,
        cluster_tx,
        client_tx,
        liveness.register("credentials"),
        shutdown_rx.clone(),
    ));
    if let Some(period) = watchdog {
        tasks.spawn(systemd::run_watchdog(
            notifier.clone(),
            liveness.clone(),
            period,
            shutdown_rx.clone(),
        ));
    }
    if let Some(addr) = opts.metrics_listen {
        serve_metrics(addr, &stats, &failover, &liveness, beat_every, &mut tasks).await?;
    }
    notifier.ready();

    let main_beat = liveness.register("main");
    let mut tick = tokio::time::interval(beat_every);
    let mut last_status = String::new();
    let mut session: Option<Session> = None;
    loop {
        tell_status(&stats, &cluster_rx, notifier.as_ref(), &mut last_status);
        tokio::select! {
            changed = cluster_rx.changed() => if changed.is_err() { break },
            changed = client_rx.changed() => {
                if changed.is_err() { break }
                if let Some(old) = session.take() {
                    old.stop().await;
                }
                let client = client_rx.borrow_and_update().clone();
                session = client.map(|c| Session::start(c, &opts, stats.clone(), failover.clone()));
            }
            _ = tick.tick() => main_beat.beat(),
            _ = sigterm.recv() => break,
            _ = sigint.recv() => break,
        }
    }
    notifier.stopping();
    if let Some(s) = session.take() {
        s.stop().await;
    }
    let _ = shutdown_tx.send(true);
    let drain = async { while tasks.join_next().await.is_some() {} };
    let _ = tokio::time::timeout(Duration::from_secs(10), drain).await;
    tracing::info!("controller stopped");
    Ok(())
}

/// `/metrics`, `/healthz` and `/livez` on `addr`, served among `tasks`.
async fn serve_metrics(
    addr: SocketAddr,
    stats: &Arc<Mutex<Stats>>,
    failover: &prometheus_client::metrics::histogram::Histogram,
    liveness: &Liveness,
    beat_every: Duration,
    tasks: &mut tokio::task::JoinSet<()>,
) -> Result<(), ControllerError> {
    let listener = hna_edges::metrics::bind(addr)
        .await
        .map_err(|source| ControllerError::Metrics { addr, source })?;
    let h = stats.clone();
    let registry = stats::registry(stats.clone(), failover.clone());
    let alive = liveness.clone();
    let pages = hna_edges::metrics::Pages {
        metrics: Arc::new(move || hna_edges::metrics::exposition::encode(&registry)),
        health: Arc::new(move || {
            let s = h.lock().expect("stats lock");
            if s.connected {
                Ok(())
            } else {
                Err("not connected to the cluster".into())
            }
        }),
        // Not the connection: a restart does not bring an API server
        // back, and an outage would restart every replica at once.
        live: Arc::new(
            move || match alive.stalled(tokio::time::Instant::now(), beat_every * 5) {
                stalled if stalled.is_empty() => Ok(()),
                stalled => Err(format!("loops stalled: {}", stalled.join(", "))),
            },
        ),
    };
    tasks.spawn(hna_edges::metrics::serve(listener, pages));
    Ok(())
}

/// Logs the status line and tells it to systemd when it changed since
/// `last_status`.
fn tell_status(
    stats: &Mutex<Stats>,
    cluster_rx: &watch::Receiver<ClusterState>,
    notifier: &dyn Notifier,
    last_status: &mut String,
) {
    let status = {
        let mut s = stats.lock().expect("stats lock");
        s.connected = matches!(*cluster_rx.borrow(), ClusterState::Connected { .. });
        if s.connected {
            s.status_line()
        } else {
            summary(&cluster_rx.borrow())
        }
    };
    if status != *last_status {
        tracing::info!("{status}");
        notifier.status(&status);
        *last_status = status;
    }
}

/// Everything that runs on one client: watches, election, reconcile.
struct Session {
    shutdown: watch::Sender<bool>,
    election: tokio::task::JoinHandle<()>,
    tasks: tokio::task::JoinSet<()>,
}

impl Session {
    fn start(
        client: kube::Client,
        opts: &Options,
        stats: Arc<Mutex<Stats>>,
        failover: prometheus_client::metrics::histogram::Histogram,
    ) -> Session {
        let (shutdown, shutdown_rx) = watch::channel(false);
        let leadership = Arc::new(leadership::Leadership::default());
        let election = tokio::spawn(leadership::run(
            Api::namespaced(client.clone(), &opts.namespace),
            hna_contract::CONTROLLER_LEASE.to_string(),
            opts.identity.clone(),
            opts.timing,
            leadership.clone(),
            shutdown_rx.clone(),
        ));
        let mut tasks = tokio::task::JoinSet::new();
        let changed = Arc::new(Notify::new());
        let errors = stats.clone();
        let caches = kube_edge::watch_all(
            &client,
            &opts.namespace,
            opts.endpoint_source,
            liveness::Liveness::new(opts.node_stale_after, opts.watch_quiet_after),
            changed.clone(),
            Arc::new(move |e: String| {
                tracing::warn!("{e}");
                errors.lock().expect("stats lock").watch_errors += 1;
            }),
            &mut tasks,
        );
        tasks.spawn(reconcile_loop(
            kube_edge::KubeApi::new(client, &opts.identity),
            caches,
            changed,
            leadership,
            opts.clone(),
            stats::Reports { stats, failover },
            shutdown_rx,
        ));
        Session {
            shutdown,
            election,
            tasks,
        }
    }

    /// Stops writing at once, releases the Lease if held, stops watching.
    async fn stop(mut self) {
        let _ = self.shutdown.send(true);
        let _ = tokio::time::timeout(Duration::from_secs(6), &mut self.election).await;
        self.tasks.abort_all();
        while self.tasks.join_next().await.is_some() {}
    }
}

async fn reconcile_loop(
    api: kube_edge::KubeApi,
    caches: kube_edge::Caches,
    changed: Arc<Notify>,
    leadership: Arc<leadership::Leadership>,
    opts: Options,
    reports: stats::Reports,
    mut shutdown: watch::Receiver<bool>,
) {
    tokio::select! {
        ready = caches.ready() => if !ready { return },
        _ = shutdown.changed() => return,
    }
    reports.stats.lock().expect("stats lock").synced = true;
    // The floor of supported servers (1.33) knows it; an older or
    // unreadable one gets no ipMode rather than a write every pass.
    let ip_mode = api.knows_ip_mode().await.unwrap_or_else(|| {
        tracing::warn!("GET /version failed: ipMode is not written in this session");
        false
    });
    tracing::info!(ip_mode, "watch caches loaded: reconciling");
    let mut reconciler = Reconciler::new(api, caches, leadership, opts, reports, ip_mode);
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while reconciler
        .wait_for_news(&changed, &mut tick, &mut shutdown)
        .await
    {
        reconciler.pass().await;
    }
}

/// The reconcile loop of one session: what it reads and writes through,
/// and what it keeps from one pass to the next.
struct Reconciler {
    api: kube_edge::KubeApi,
    caches: kube_edge::Caches,
    leadership: Arc<leadership::Leadership>,
    opts: Options,
    stats: Arc<Mutex<Stats>>,
    failover: prometheus_client::metrics::histogram::Histogram,
    ip_mode: bool,
    slow_warned: BTreeSet<String>,
    let_go: lan_verdict::LetGo,
    memory: writer::Memory,
    deletions: deletions::Deletions,
    access_ensured: BTreeSet<String>,
    key_ensured: bool,
    health: service_health::ServiceHealth,
    failovers: failover_metric::FailoverClock,
    /// The leader term the memories above belong to.
    term: u64,
    coalesce: Duration,
    /// The inputs of the last pass, if it left nothing to do.
    settled: Option<Inputs>,
    trimmer: heap::Trimmer,
}

impl Reconciler {
    fn new(
        api: kube_edge::KubeApi,
        caches: kube_edge::Caches,
        leadership: Arc<leadership::Leadership>,
        opts: Options,
        reports: stats::Reports,
        ip_mode: bool,
    ) -> Reconciler {
        let health = service_health::ServiceHealth::new(
            opts.service_failed_after,
            opts.service_guarded_after,
            opts.service_avoid_for,
        );
        Reconciler {
            api,
            caches,
            leadership,
            opts,
            stats: reports.stats,
            failover: reports.failover,
            ip_mode,
            slow_warned: BTreeSet::new(),
            let_go: lan_verdict::LetGo::default(),
            memory: writer::Memory::default(),
            deletions: deletions::Deletions::default(),
            access_ensured: BTreeSet::new(),
            key_ensured: false,
            health,
            failovers: failover_metric::FailoverClock::default(),
            term: 0,
            coalesce: COALESCE_MIN,
            settled: None,
            trimmer: heap::Trimmer::new(Instant::now()),
        }
    }

    /// Waits for something that may move a decision; false at shutdown.
    async fn wait_for_news(
        &self,
        changed: &Notify,
        tick: &mut tokio::time::Interval,
        shutdown: &mut watch::Receiver<bool>,
    ) -> bool {
        // A node turning stale is news without an event: wake for it; and
        // for the first write whose backoff is over. A failing write never
        // delays a pass: it waits out its own backoff
        // (`writer::WriteBackoff`) while the rest is decided and written.
        let stale_at = self
            .caches
            .alive
            .lock()
            .expect("liveness lock")
            .next_deadline(Instant::now());
        let retry_at = self.memory.backoff.next_retry(Instant::now());
        let health_at = self.health.next_deadline();
        // A node dead on its LAN that never reported its addresses gone:
        // they move when its wait ends.
        let let_go_at = self.let_go.next_deadline(Instant::now());
        tokio::select! {
            _ = changed.notified() => tokio::time::sleep(self.coalesce).await,
            _ = tick.tick() => {}
            _ = hna_edges::duration::sleep_until(stale_at) => {}
            _ = hna_edges::duration::sleep_until(retry_at) => {}
            _ = hna_edges::duration::sleep_until(health_at) => {}
            _ = hna_edges::duration::sleep_until(let_go_at) => {}
            _ = shutdown.changed() => return false,
        }
        true
    }

    /// One pass: decide from the caches and, as leader, write the plan.
    async fn pass(&mut self) {
        if self.trimmer.due(Instant::now()) {
            heap::trim();
        }
        let now = Instant::now();
        let (inputs, object_versions) = self.inputs(now);
        // Most wake-ups at scale are heartbeats alone: they move no
        // decision, and a whole pass over every Service for each would
        // keep a core busy. Skipped only after a pass that had nothing to
        // write and nothing failed, so a skipped pass would have been the
        // same again.
        if self.settled.as_ref() == Some(&inputs) {
            let mut s = self.stats.lock().expect("stats lock");
            s.skipped += 1;
            s.holder = self.leadership.holder();
            return;
        }
        let leading = inputs.leading;
        let (plan, services, versions) = self.decide(&inputs, object_versions, now);
        self.report_decision(&plan, leading);
        if leading {
            self.observe_failovers(&inputs.objects, now);
        }
        if !leading {
            // A follower writes nothing: the same inputs give the same
            // summary. (Its plan always has writes, each node's access
            // among them, which only a leader ensures: settled on an
            // empty plan, it ran a whole pass every second, 0.2 s of CPU a
            // second at 10,000 Services.)
            self.settled = Some(inputs);
            return;
        }
        self.forget_past_terms();
        self.ensure_membership_key().await;
        let out = self.write(&plan, &services, &versions).await;
        self.report_outcome(&out);
        let nothing_left = plan.writes.is_empty()
            && out.errors.is_empty()
            && out.conflicts == 0
            && out.deferred == 0
            && !out.stopped;
        self.settled = nothing_left.then_some(inputs);
    }

    /// What this pass decides from, the node objects judged on our clock
    /// at `now`; and each node object's resourceVersion.
    fn inputs(&mut self, now: Instant) -> (Inputs, HashMap<String, String>) {
        let (objects, object_versions) = {
            let mut alive = self.caches.alive.lock().expect("liveness lock");
            eligibility::objects_from(
                &self.caches,
                &mut alive,
                &mut self.slow_warned,
                &mut self.let_go,
                now,
            )
        };
        let avoid = self.health.observe(
            objects.iter().map(|o| service_health::Report {
                node: &o.name,
                spec: &o.spec,
                generation: o.generation,
                status: &o.status,
            }),
            now,
            self.caches.node_objects_generation.current(),
        );
        let leading = self.leadership.leading();
        let inputs = Inputs {
            overdue: self.overdue_deletions(now),
            services: self.caches.services_generation.get(),
            nodes: self.caches.nodes_generation.get(),
            endpoints: self.caches.endpoints.generation(),
            objects,
            avoid,
            networks: self
                .caches
                .networks
                .lock()
                .expect("network map lock")
                .clone(),
            leading,
            term: self.leadership.term(),
        };
        (inputs, object_versions)
    }

    /// How many Services being deleted have waited past the release
    /// timeout.
    fn overdue_deletions(&mut self, now: Instant) -> usize {
        self.caches
            .services
            .state()
            .iter()
            .filter(|s| s.metadata.deletion_timestamp.is_some())
            .filter_map(|s| {
                s.metadata
                    .uid
                    .as_deref()
                    .map(|uid| self.deletions.waited(uid, now))
            })
            .filter(|w| w.as_secs() as i64 >= reconcile::RELEASE_TIMEOUT_SECS)
            .count()
    }

    /// The plan for `inputs`, the Services it was decided from, and the
    /// resourceVersion of every object (for the [`writer::WriteMemo`]).
    fn decide(
        &mut self,
        inputs: &Inputs,
        object_versions: HashMap<String, String>,
        now: Instant,
    ) -> (
        reconcile::Plan,
        Vec<reconcile::ServiceIn>,
        HashMap<String, String>,
    ) {
        let wall = k8s_openapi::jiff::Timestamp::now().as_second();
        let (mut services, nodes, mut versions) = services_from(&self.caches);
        for s in &mut services {
            self.deletions.time(s, now, wall);
        }
        let deleting: BTreeSet<&str> = services
            .iter()
            .filter(|s| s.deleting)
            .map(|s| s.uid.as_str())
            .collect();
        self.deletions.retain(|uid| deleting.contains(uid));
        let node_networks = node_networks(&self.caches);
        versions.extend(object_versions);
        let plan = reconcile::reconcile(reconcile::World {
            services: &services,
            nodes: &nodes,
            node_objects: &inputs.objects,
            access_ensured: &self.access_ensured,
            networks: &inputs.networks,
            classes: &self.opts.classes,
            ip_mode: self.ip_mode,
            node_networks: &node_networks,
            avoid: &inputs.avoid,
            now: wall,
        });
        self.coalesce = coalesce_window(now.elapsed());
        self.trimmer.worked();
        tracing::debug!(
            took = ?now.elapsed(),
            services = services.len(),
            writes = plan.writes.len(),
            "pass decided"
        );
        (plan, services, versions)
    }

    fn report_decision(&self, plan: &reconcile::Plan, leading: bool) {
        let mut s = self.stats.lock().expect("stats lock");
        s.reconciles += 1;
        s.summary = plan.summary.clone();
        s.leader = leading;
        s.holder = self.leadership.holder();
    }

    /// How long the addresses of dead nodes took to be served again. The
    /// leader alone observes it, so that the replicas' histograms add up.
    fn observe_failovers(&mut self, objects: &[reconcile::NodeIn], now: Instant) {
        let alive = self.caches.alive.lock().expect("liveness lock");
        for took in self.failovers.observe(
            &failover_metric::serving(objects),
            |n| alive.last_change(n),
            now,
        ) {
            self.failover.observe(took.as_secs_f64());
        }
    }

    /// A new term: what was sent or told before may have been undone by
    /// another leader since.
    fn forget_past_terms(&mut self) {
        if self.leadership.term() != self.term {
            self.term = self.leadership.term();
            self.memory.clear();
            self.access_ensured.clear();
            self.key_ensured = false;
        }
    }

    /// The LAN membership's key, once per term; a failure is tried again
    /// next pass.
    async fn ensure_membership_key(&mut self) {
        if self.key_ensured {
            return;
        }
        match self.api.ensure_membership_key(&self.opts.namespace).await {
            Ok(made) => {
                self.key_ensured = true;
                if made {
                    tracing::info!(
                        secret = %format!("{}/{}", self.opts.namespace, hna_contract::membership::SECRET_NAME),
                        "made the LAN membership's key"
                    );
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot make the LAN membership's key (Secret {}); the agents' membership waits for it", hna_contract::membership::SECRET_NAME);
                self.stats.lock().expect("stats lock").write_errors += 1;
            }
        }
    }

    /// Carries out `plan`, first forgetting the writes and Events whose
    /// objects changed or are gone.
    async fn write(
        &mut self,
        plan: &reconcile::Plan,
        services: &[reconcile::ServiceIn],
        versions: &HashMap<String, String>,
    ) -> writer::Outcome {
        self.memory.writes.prune(|t| versions.get(t).cloned());
        let uids: HashMap<&hna_contract::ServiceKey, &str> =
            services.iter().map(|s| (&s.key, s.uid.as_str())).collect();
        self.memory
            .events
            .retain(|k, uid| uids.get(k) == Some(&uid));
        let version_of = |t: &str| versions.get(t).cloned();
        let leadership = &self.leadership;
        let out = writer::execute(
            &self.opts.namespace,
            plan,
            &self.api,
            &|| leadership.leading(),
            &mut self.memory,
            &version_of,
        )
        .await;
        self.access_ensured
            .extend(out.access_ensured.iter().cloned());
        out
    }

    fn report_outcome(&self, out: &writer::Outcome) {
        for e in &out.errors {
            tracing::warn!("{e}");
        }
        for (kind, n) in &out.writes {
            tracing::debug!(kind, n, "writes");
        }
        {
            let mut s = self.stats.lock().expect("stats lock");
            for (kind, n) in &out.writes {
                *s.writes.entry(kind).or_default() += n;
            }
            s.write_errors += out.errors.len() as u64;
            if let Some(e) = out.errors.last() {
                s.last_error = Some(e.clone());
            } else if out.writes.values().sum::<u64>() > 0 {
                s.last_error = None;
            }
            s.count_events(&out.published);
        }
        for e in &out.published {
            tracing::info!(service = %e.service, reason = e.reason, "{}", e.message);
        }
        if out.conflicts > 0 {
            tracing::debug!(
                conflicts = out.conflicts,
                "writes refused: their objects changed since this plan; the next plan redoes them"
            );
        }
        let mut s = self.stats.lock().expect("stats lock");
        s.writes_deferred += out.deferred;
        s.objects_backing_off = self.memory.backoff.waiting() as u64;
    }
}

/// What a pass decides from, as far as it can change: the caches'
/// generations (they change with every change of an object), the node
/// objects as the decision reads them (without their heartbeat: liveness
/// has read it), and leadership.
#[derive(Debug, PartialEq)]
struct Inputs {
    /// Deletions that have waited past the release timeout: time alone
    /// changes a decision there.
    overdue: usize,
    services: u64,
    nodes: u64,
    endpoints: u64,
    objects: Vec<reconcile::NodeIn>,
    avoid: service_health::Avoid,
    networks: networks::NetworkMap,
    leading: bool,
    term: u64,
}

/// The Services and Nodes as the decision reads them, and the
/// resourceVersion of every Service (for the [`writer::WriteMemo`]).
fn services_from(
    caches: &kube_edge::Caches,
) -> (
    Vec<reconcile::ServiceIn>,
    Vec<String>,
    HashMap<String, String>,
) {
    let mut versions = HashMap::new();
    let mut services = Vec::new();
    // Built at the first `Local` Service of the pass, if there is one.
    let mut ready_nodes = None;
    for s in caches.services.state() {
        let Some(mut view) = kube_edge::service_in(&s) else {
            continue;
        };
        if let Some(local) = &mut view.local_endpoints {
            let by_service = ready_nodes.get_or_insert_with(|| caches.endpoints.ready_nodes());
            if let Some(nodes) = by_service.get(&view.key) {
                local.clone_from(nodes);
            }
        }
        if let Some(rv) = &s.metadata.resource_version {
            versions.insert(format!("service/{}", view.key), rv.clone());
        }
        services.push(view);
    }
    let nodes: Vec<String> = caches
        .nodes
        .state()
        .iter()
        .filter_map(|n| n.metadata.name.clone())
        .collect();
    (services, nodes, versions)
}

/// The Nodes' own addresses and Pod CIDRs (`reconcile::NodeNetworks`).
fn node_networks(caches: &kube_edge::Caches) -> reconcile::NodeNetworks {
    let mut out = reconcile::NodeNetworks::default();
    for n in caches.nodes.state() {
        let addresses: Vec<&str> = n
            .status
            .iter()
            .flat_map(|s| s.addresses.iter().flatten())
            .map(|a| a.address.as_str())
            .collect();
        let cidrs: Vec<&str> = n
            .spec
            .iter()
            .flat_map(|s| s.pod_cidrs.iter().flatten())
            .map(String::as_str)
            .collect();
        out.add(&addresses, &cidrs);
    }
    out
}

/// The controller's `STATUS=` line before it is connected.
pub(crate) fn summary(cluster: &ClusterState) -> String {
    match cluster {
        ClusterState::Connected {
            server,
            server_version,
            ..
        } => format!("controller: connected to {server} ({server_version})"),
        ClusterState::Connecting { .. } => "controller: connecting to the cluster".into(),
        ClusterState::Unreachable { error, .. } => {
            format!("controller: cluster unreachable: {error}")
        }
        ClusterState::WaitingForCredentials { searched, .. } => format!(
            "controller: waiting for credentials (searched {})",
            searched
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_coalescing_window_follows_the_cost_of_a_pass_within_bounds() {
        assert_eq!(coalesce_window(Duration::ZERO), COALESCE_MIN);
        assert_eq!(
            coalesce_window(Duration::from_millis(30)),
            Duration::from_millis(60)
        );
        assert_eq!(coalesce_window(Duration::from_secs(1)), COALESCE_MAX);
    }
}
