//! The node's LoadBalancer task: holds the addresses this node's
//! `LoadBalancerNode` object assigns, through the DHCP engine, and reports
//! what it holds in that object's status.
//!
//! - Input: the object, watched by name (list/watch with a `metadata.name`
//!   field selector, all the node's Role allows), as [`Update`]s of its
//!   spec. An unreadable object (cluster unreachable, forbidden) changes
//!   nothing: every running lease stays.
//! - Each round: the assignments are checked (`crate::loadbalancer::lease_plan::want`); an
//!   invalid one is reported and its interface left exactly as it is; the
//!   rest is planned against the running leases (`crate::loadbalancer::lease_plan::plan`) and
//!   carried out (`crate::loadbalancer::apply::apply`). A failed action makes another
//!   round after a backoff (1 s doubling to 30 s), not at once.
//! - Start-up adoption: links an earlier run left (`hlb-*`) are kept until
//!   the assignments are first read, then [`LeaseEngine::sweep`] removes the
//!   ones no assignment wants (no RELEASE, lease files kept) and the wanted
//!   ones are started, which adopts them (same link, same lease, no DHCP
//!   exchange while the lease is valid). The wait is bounded
//!   (`ADOPTION_WAIT`): after it, the assignments are still unknown and
//!   the left links go (handover, never released).
//! - Output: the status subresource, merge-patched at every heartbeat
//!   period (`lb_heartbeat`, a backstop) and, within `SETTLE`, after every
//!   change of what is reported (a release shows as the lease leaving `leases`), by
//!   a task of its own (`status_writes`) so that no round, however
//!   long, holds up a heartbeat.
//!
//! The loop is generic over the engine ([`LeaseEngine`]) and the status
//! writer ([`StatusWriter`]) so it is tested with the fake engine and paused
//! time; `run_loop` wires it to the API server.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use kube::Api;
use kube::api::{Patch, PatchParams};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::loadbalancer::apply::{self, Settings};
use crate::loadbalancer::lease_plan::{self, Action, Running};
use crate::membership::transport::{LanView, Want};
use hna_contract::INTERFACE_PREFIX;
use hna_contract::node_object::{
    self, Assignment, Condition, LeaseReport, LoadBalancerNode, Spec, Status,
};
use hna_dhcp::LeaseEngine;
use hna_dhcp::driver::LeaseStatus;
use hna_edges::cluster::watch_one::{Update, watch_one};
use hna_edges::systemd::{self, Heartbeat};

use super::LbStatus;
use crate::loadbalancer::status_writes::StatusWrites;

/// How long start-up keeps left links for the first read of the
/// assignments. Past it, the controller has moved the addresses of a node
/// that was down this long (its witnesses report it within about 2 s; a
/// node none of them hears is stale after 40 s), and the addresses on the
/// left links have expired (only a running lease confirms their
/// lifetime): the links only wait to be adopted.
pub(crate) const ADOPTION_WAIT: Duration = Duration::from_secs(30);
/// How soon a change of what is reported reaches the status.
pub(crate) const SETTLE: Duration = Duration::from_secs(1);
/// How often the leases are looked at while one is on its way to an
/// address (the engine's snapshot is an in-memory copy).
pub(crate) const FAST_SETTLE: Duration = Duration::from_millis(10);
/// How often the uplinks' carrier is looked at (a read of sysfs each).
pub(crate) const CARRIER_POLL: Duration = Duration::from_millis(100);
/// How soon a start held back by the takeover guard is tried again: soon
/// at first, since a healthy holder that was told to let go does so within
/// tens of milliseconds (an `externalTrafficPolicy: Local` move, a
/// hand-back), doubling to at most [`GUARD_RETRY_MAX`] while the other
/// holder stays (a frozen agent), so the LAN is not flooded with probes.
const GUARD_RETRY_MIN: Duration = Duration::from_millis(100);
const GUARD_RETRY_MAX: Duration = Duration::from_secs(1);
/// Retry backoff after a failed action.
const RETRY_MIN: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(30);
/// `state` of a lease the takeover guard holds back: another host still
/// answers for its address.
pub(crate) const GUARDED: &str = "GUARDED";
/// The last status, when stopping: short, so a stop is not held up by an
/// unreachable API server (`TimeoutStopSec`).
const STOPPING_WRITE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long after its last status written, with the last write failed, a
/// node takes no address over: what it reads as its assignments may have
/// moved since.
const OUT_OF_TOUCH_AFTER: Duration = Duration::from_secs(2);
pub(crate) use super::holder::{STAND_DOWN_AFTER, lan_wait, may_have_been_judged_from};

/// `status.reason` of a stopping agent.
pub(crate) const STOPPING: &str =
    "stopping: the agent is shutting down and has handed its addresses over";

pub(crate) use crate::loadbalancer::status_writes::StatusWriter;

/// What the task needs to know about the node each round.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct NodeView {
    pub(crate) macvlan_ready: bool,
    /// Why macvlan is not ready.
    pub(crate) macvlan_reason: String,
    /// `uplink` from the configuration, else the default route's interface.
    pub(crate) default_uplink: Option<String>,
    /// The interfaces without carrier now (a cable pulled, the peer gone,
    /// set down). Leases on them are handed over and not held until the
    /// carrier is back: their node cannot answer for them, another can.
    pub(crate) no_carrier: BTreeSet<String>,
    /// The node's own network cards (`link::network_cards`): with
    /// `default_uplink`, the only parents a macvlan is made on, whatever an
    /// assignment names.
    pub(crate) nics: BTreeSet<String>,
    /// The MACs (lower case) of the node's own interfaces, with their
    /// names: never a Service's.
    pub(crate) own_macs: BTreeMap<String, String>,
    /// The kernel's ARP table: per neighbour MAC (lower case), the
    /// addresses it answers for and where. A Service's MAC that another
    /// host on the LAN uses for another address is never brought up.
    pub(crate) neighbours: BTreeMap<String, BTreeSet<(std::net::Ipv4Addr, String)>>,
    /// The default gateway's MAC (lower case), when the ARP table has it.
    pub(crate) gateway_mac: Option<String>,
    /// The default route's gateway.
    pub(crate) gateway_address: Option<std::net::Ipv4Addr>,
}

impl NodeView {
    /// The MACs of the node's own network cards and default uplink, for
    /// `status.nicMacs`.
    pub(crate) fn nic_macs(&self) -> Vec<String> {
        self.own_macs
            .iter()
            .filter(|(_, name)| {
                self.nics.contains(*name) || self.default_uplink.as_ref() == Some(*name)
            })
            .map(|(mac, _)| mac.clone())
            .collect()
    }

    /// Why `mac` must not be put on a link for a Service holding
    /// `address`: another LAN host answers with it for another address
    /// (the gateway, another node, any neighbour in the ARP table).
    pub(crate) fn mac_taken_on_lan(
        &self,
        mac: &str,
        address: Option<std::net::Ipv4Addr>,
    ) -> Option<String> {
        let others: Vec<String> = self
            .neighbours
            .get(mac)?
            .iter()
            .filter(|(ip, _)| Some(*ip) != address)
            .map(|(ip, dev)| format!("{ip} on {dev}"))
            .collect();
        if others.is_empty() {
            return None;
        }
        let who = if self.gateway_mac.as_deref() == Some(mac) {
            "the default gateway's"
        } else {
            "another host's on the LAN"
        };
        Some(format!(
            "MAC {mac} is {who} (this node's ARP table: {}): a Service's link with it would take that host's traffic from the switches; no macvlan is made with it",
            others.join(", ")
        ))
    }
}

/// The LoadBalancer task's side of the LAN membership
/// (`crate::membership::transport`): it hands on the peers its spec names,
/// reports what the membership hears, and tells it how the agent stops.
pub(crate) struct LanLink {
    pub(crate) want: Arc<watch::Sender<Want>>,
    pub(crate) view: watch::Receiver<LanView>,
    /// `Some(true)`: leave the cluster (the addresses are handed over);
    /// `Some(false)`: just stop (a restart keeps them).
    pub(crate) stop: watch::Sender<Option<bool>>,
}

impl LanLink {
    /// A link to no membership (tests; `lb_membership_port = 0`).
    #[cfg(test)]
    pub(crate) fn detached() -> LanLink {
        let (view_tx, view) = watch::channel(LanView::default());
        // The view never changes: its sender may go.
        drop(view_tx);
        LanLink {
            want: Arc::new(watch::channel(Want::default()).0),
            view,
            stop: watch::channel(None).0,
        }
    }
}

/// The task's settings.
#[derive(Debug, Clone)]
pub(crate) struct LbSettings {
    /// `namespace/node`, for logs and `status`.
    pub(crate) object: String,
    pub(crate) heartbeat: Duration,
    /// No status written for this long: every lease is handed over until
    /// one is written again (self-fencing); zero: never.
    pub(crate) fence_after: Duration,
    pub(crate) adoption_wait: Duration,
    pub(crate) settle: Duration,
    /// How long a restart leaves the addresses on their links; zero: every
    /// stop hands them over.
    pub(crate) restart_grace: Duration,
    /// Which stops keep them.
    pub(crate) keep_on_stop: crate::config::KeepOnStop,
    /// What every lease shares; `default_uplink` is filled in each round.
    pub(crate) leases: Settings,
    /// What this run keeps for the next, and reads from the last
    /// (`super::kept`); `None`: nothing is kept (tests).
    pub(crate) kept: Option<super::kept::Kept>,
    /// Where the takeover guard's waits are observed (`/metrics`).
    pub(crate) takeover_guard_wait: prometheus_client::metrics::histogram::Histogram,
}

/// The loop's state between events.
struct Lb<E: LeaseEngine> {
    engine: Arc<E>,
    writes: StatusWrites,
    settings: LbSettings,
    node: Box<dyn Fn() -> NodeView + Send>,
    out: watch::Sender<LbStatus>,
    /// `None` until the object was first read.
    assignments: Option<Vec<Assignment>>,
    read: String,
    /// `Some` once the start-up sweep ran: what it removed.
    swept: Option<Vec<String>>,
    /// The last round's failed actions, by interface.
    failures: BTreeMap<String, String>,
    /// The last round's starts held back by the takeover guard, by
    /// interface.
    guarded: BTreeMap<String, String>,
    /// Per start held back by the takeover guard: when it first was.
    guarded_since: BTreeMap<String, Instant>,
    /// Invalid assignments already logged (their message).
    logged_invalid: BTreeSet<lease_plan::InvalidAssignment>,
    retry_at: Option<Instant>,
    backoff: Duration,
    /// Until the next round with a guarded start.
    guard_backoff: Duration,
    /// The agent is stopping: reported as not ready.
    stopping: bool,
    /// The interfaces without carrier at the last look.
    no_carrier: BTreeSet<String>,
    /// The default uplink at the last round: a new one moves the leases
    /// that follow it.
    uplink: Option<String>,
    /// Self-fenced, and why (`loadbalancer::fence`): nothing is held until the
    /// reason is gone.
    fence: Option<String>,
    /// The `Ready` condition last drafted (its transition time is kept).
    ready_condition: Option<Condition>,
    /// When the fence is to be decided again, the inputs unchanged.
    fence_again: Option<Instant>,
    /// The start of the last LAN silence a status write was asked for, to
    /// show that the API server still hears this node.
    touched: Option<Instant>,
    /// The last status write failed and none succeeded for
    /// [`OUT_OF_TOUCH_AFTER`]: what this node reads as its assignments may
    /// be out of date.
    out_of_touch: bool,
    /// The watch of this node's object failed and has not read it since:
    /// the assignments known are as they were before.
    spec_stale: bool,
    /// The `metadata.generation` of this node's object as last read
    /// (`status.observedGeneration`).
    read_generation: Option<i64>,
    /// Whether the last status write's failure was logged.
    write_error_logged: bool,
    /// How each lease this loop started was started (parent, identity), so
    /// a change of either restarts it.
    started: BTreeMap<String, lease_plan::StartedAs>,
    lan: LanLink,
    /// The newest ask whether the gateway hears this node (`loadbalancer::fence`).
    gateway: Option<super::fence::GatewayCheck>,
    /// An ask is on its way; its answer comes on `gateway_answers`.
    gateway_asking: bool,
    gateway_answers: mpsc::Sender<super::fence::GatewayCheck>,
    /// When this loop was last seen running, on both clocks
    /// ([`did_not_run_for`]).
    ran: (Instant, SystemTime),
    /// Longer than this between two looks, and this node was not running.
    awake_within: Duration,
    /// Asks the watch of this node's object to read it again ([`follow`]).
    relist: watch::Sender<u64>,
    /// Since when this node has held none of the addresses its assignments
    /// want while it could not read them again.
    unserved_since: Option<Instant>,
    /// When to decide again whether it stands down.
    stand_down_at: Option<Instant>,
    /// Since when this node may have been judged from (fenced, paused,
    /// stalled, its uplink without carrier) and has not read its
    /// assignments since (`super::lan_word`).
    lapsed_since: Option<Instant>,
    /// Its witnesses vouch that its assignments cannot have moved since the
    /// lapse: they are held again before they can be read (who vouched).
    lan_word: Option<Vec<String>>,
    /// When the default uplink was first seen without carrier, while it
    /// has none.
    uplink_lost_at: Option<Instant>,
    /// The spec and the witnesses' words as last kept for the next run
    /// (`super::kept`), so each is written when it changes only.
    kept_spec: Option<Spec>,
    kept_words: BTreeMap<String, crate::membership::transport::Word>,
    /// The assignments are the last run's, kept in the state directory,
    /// and the object has not been read yet.
    kept_unread: bool,
    /// The start-up sweep kept what the last run's assignments wanted: it
    /// runs again once the object is read, so that a link the last run
    /// left for an assignment that has moved since goes (the fault soak
    /// found such links left for good).
    swept_on_kept: bool,
}

/// Runs the loop on `updates` until `shutdown` changes.
// Long on purpose: one `select!` over every event the task hears, each arm
// a call or two into `Lb`; split, the arms would lose their shared timers.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run_loop<E: LeaseEngine, W: StatusWriter>(
    engine: Arc<E>,
    writer: W,
    settings: LbSettings,
    node: impl Fn() -> NodeView + Send + 'static,
    mut updates: mpsc::Receiver<SpecRead>,
    out: watch::Sender<LbStatus>,
    hb: Heartbeat,
    beat_every: Duration,
    lan: LanLink,
    mut pauses: watch::Receiver<Option<crate::pause::Pause>>,
    relist: watch::Sender<u64>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut lan_changes = lan.view.clone();
    let mut lan_open = true;
    let adoption_deadline = Instant::now() + settings.adoption_wait;
    let mut next_settle = Instant::now() + settings.settle;
    let mut beat = tokio::time::interval(beat_every);
    let writes = StatusWrites::start(writer, settings.heartbeat);
    let mut written = writes.watch();
    let (gateway_answers, mut gateway_answered) = mpsc::channel(1);
    let mut lb = Lb::new(
        engine,
        writes,
        settings,
        Box::new(node),
        out,
        lan,
        gateway_answers,
        relist,
    );
    lb.awake_within = beat_every + lb.lan_wait();
    lb.take_up_what_was_kept();
    let mut carrier = tokio::time::interval(CARRIER_POLL);
    carrier.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut updates_open = true;
    let mut pauses_open = true;
    loop {
        tokio::select! {
            u = updates.recv(), if updates_open => match u {
                Some(u) => {
                    if lb.observe(u) {
                        systemd::beating(&hb, beat_every, lb.reconcile()).await;
                    }
                    lb.report();
                    next_settle = Instant::now() + lb.settle_period();
                }
                None => {
                    // Only a stopping daemon drops the sender; otherwise the
                    // loop would go on blind to new assignments. No more
                    // beats: the watchdog restarts the daemon.
                    tracing::error!("the assignments' feed ended; this loop no longer counts as alive");
                    updates_open = false;
                }
            },
            _ = tokio::time::sleep_until(adoption_deadline), if lb.swept.is_none() => {
                tracing::warn!(
                    object = %lb.settings.object,
                    wait = ?lb.settings.adoption_wait,
                    "the assignments could not be read in time: removing the links an earlier run left (not released; lease files kept)"
                );
                systemd::beating(&hb, beat_every, lb.sweep()).await;
                lb.report();
            }
            _ = hna_edges::duration::sleep_until(lb.retry_at) => {
                lb.retry_at = None;
                systemd::beating(&hb, beat_every, lb.reconcile()).await;
                lb.report();
                next_settle = Instant::now() + lb.settle_period();
            }
            _ = written.changed() => lb.after_write().await,
            changed = pauses.changed(), if pauses_open => match changed {
                Ok(()) => {
                    let pause = *pauses.borrow_and_update();
                    if let Some(pause) = pause {
                        lb.after_pause(pause.at_least).await;
                        lb.report();
                    }
                }
                Err(_) => pauses_open = false,
            },
            changed = lan_changes.changed(), if lan_open => match changed {
                Ok(()) => {
                    lb.judge_fence().await;
                    lb.judge_lan_word();
                    lb.keep_words();
                    lb.report();
                }
                Err(_) => lan_open = false,
            },
            Some(check) = gateway_answered.recv() => {
                lb.gateway_answered(check);
                lb.judge_fence().await;
                lb.report();
            }
            _ = hna_edges::duration::sleep_until(lb.fence_again) => {
                lb.fence_again = None;
                lb.judge_fence().await;
                lb.report();
            }
            _ = hna_edges::duration::sleep_until(lb.stand_down_at) => {
                lb.stand_down_at = None;
                lb.report();
            }
            _ = tokio::time::sleep_until(next_settle) => {
                // A lease whose address the kernel let expire (this
                // process did not run for its lifetime) starts again,
                // through the takeover guard.
                if lb.engine.snapshot().iter().any(|l| l.state == hna_dhcp::State::Expired) {
                    systemd::beating(&hb, beat_every, lb.reconcile()).await;
                }
                lb.report();
                next_settle = Instant::now() + lb.settle_period();
            }
            _ = carrier.tick() => {
                if lb.links_changed() {
                    systemd::beating(&hb, beat_every, lb.reconcile()).await;
                    lb.report();
                    next_settle = Instant::now() + lb.settle_period();
                }
            }
            _ = beat.tick(), if updates_open => {
                hb.beat();
                lb.note_running();
            }
            _ = shutdown.changed() => {
                lb.stop().await;
                return;
            }
        }
    }
}

impl<E: LeaseEngine> Lb<E> {
    /// A loop that has read nothing yet.
    #[allow(clippy::too_many_arguments)]
    fn new(
        engine: Arc<E>,
        writes: StatusWrites,
        settings: LbSettings,
        node: Box<dyn Fn() -> NodeView + Send>,
        out: watch::Sender<LbStatus>,
        lan: LanLink,
        gateway_answers: mpsc::Sender<super::fence::GatewayCheck>,
        relist: watch::Sender<u64>,
    ) -> Lb<E> {
        Lb {
            engine,
            writes,
            settings,
            node,
            out,
            assignments: None,
            read: "waiting for the cluster connection".into(),
            swept: None,
            failures: BTreeMap::new(),
            guarded: BTreeMap::new(),
            guarded_since: BTreeMap::new(),
            logged_invalid: BTreeSet::new(),
            retry_at: None,
            backoff: RETRY_MIN,
            guard_backoff: GUARD_RETRY_MIN,
            stopping: false,
            no_carrier: BTreeSet::new(),
            uplink: None,
            fence: None,
            ready_condition: None,
            fence_again: None,
            touched: None,
            out_of_touch: false,
            spec_stale: false,
            read_generation: None,
            write_error_logged: false,
            started: BTreeMap::new(),
            lan,
            gateway: None,
            gateway_asking: false,
            gateway_answers,
            ran: (Instant::now(), SystemTime::now()),
            awake_within: Duration::ZERO,
            relist,
            unserved_since: None,
            stand_down_at: None,
            lapsed_since: None,
            lan_word: None,
            uplink_lost_at: None,
            kept_spec: None,
            kept_words: BTreeMap::new(),
            kept_unread: false,
            swept_on_kept: false,
        }
    }

    /// Takes in the gateway's answer to ARP. Asked every lifetime while the
    /// LAN is silent: told when the answer changes, not each time.
    fn gateway_answered(&mut self, check: super::fence::GatewayCheck) {
        self.gateway_asking = false;
        match (self.gateway.map(|g| g.answered), check.answered) {
            (Some(false), true) => {
                tracing::info!("the default gateway answers ARP on the uplink again")
            }
            (Some(true) | None, false) => {
                tracing::warn!("the default gateway does not answer ARP on the uplink")
            }
            _ => {}
        }
        self.gateway = Some(check);
    }

    /// Whether the carrier or the default uplink changed since the last
    /// round (which recorded them); an uplink that carries again first
    /// asks for the assignments to be read again.
    fn links_changed(&mut self) -> bool {
        let node = (self.node)();
        if node.no_carrier == self.no_carrier && node.default_uplink == self.uplink {
            return false;
        }
        let was_down = self
            .uplink
            .as_ref()
            .is_none_or(|u| self.no_carrier.contains(u));
        let is_up = node
            .default_uplink
            .as_ref()
            .is_some_and(|u| !node.no_carrier.contains(u));
        if is_up {
            let lost_at = self.uplink_lost_at.take();
            if self.assignments.is_some() && was_down {
                self.lapse(lost_at.unwrap_or_else(Instant::now));
                self.read_again("its uplink carries again");
            }
        } else {
            self.uplink_lost_at.get_or_insert_with(Instant::now);
        }
        true
    }

    /// The daemon stops: the addresses stay for a restart if configured
    /// so, else they are handed over.
    async fn stop(&mut self) {
        let keep = !self.settings.restart_grace.is_zero()
            && match self.settings.keep_on_stop {
                crate::config::KeepOnStop::Always => true,
                crate::config::KeepOnStop::Restart => systemd::restart_pending().await,
            };
        if keep {
            self.leave_for_restart().await;
        } else {
            self.hand_over_all().await;
        }
    }

    /// How soon to look at the leases again: at once (every
    /// [`FAST_SETTLE`]) while one is on its way to an address, so the
    /// controller hears of a new lease within milliseconds; else every
    /// `settle`.
    fn settle_period(&self) -> Duration {
        let moving = self
            .engine
            .snapshot()
            .iter()
            .any(|l| !l.state.holds_address());
        if moving {
            FAST_SETTLE.min(self.settings.settle)
        } else {
            self.settings.settle
        }
    }

    /// Takes in an observation; `true` when the assignments changed (or
    /// were read for the first time, or read again as asked).
    fn observe(&mut self, read: SpecRead) -> bool {
        // A read from a watch begun before the last ask to read again
        // (queued, or a connection that stalled and caught up) is news,
        // but not the fresh read that lets this node take over again.
        let current = read.listed >= *self.relist.borrow();
        // As read, not the highest seen: reads come in order (a relist
        // waits for the old watch to end), and a deleted and recreated
        // object starts again at 1.
        match &read.update {
            Update::Present(_) => self.read_generation = read.generation,
            Update::Absent => self.read_generation = None,
            Update::Failed(_) => {}
        }
        let next = match read.update {
            Update::Present(spec) => {
                self.read = "watching".into();
                self.keep_spec(Some(&spec));
                self.lan.want.send_if_modified(|w| {
                    let changed = w.peers != spec.peers;
                    if changed {
                        w.peers.clone_from(&spec.peers);
                    }
                    changed
                });
                spec.assignments
            }
            Update::Absent => {
                self.keep_spec(None);
                self.read = format!(
                    "{} does not exist (the controller makes it)",
                    self.settings.object
                );
                Vec::new()
            }
            Update::Failed(f) => {
                // Nothing known changes: every running lease stays, but
                // none is taken over from what may be an old view.
                self.read = format!("cannot read {}: {}", self.settings.object, f.message);
                let was = self.spec_stale;
                self.spec_stale = true;
                return !was;
            }
        };
        let changed = self.assignments.as_ref() != Some(&next);
        tracing::debug!(
            object = %self.settings.object,
            assignments = next.len(),
            changed,
            current,
            stale = self.spec_stale,
            "assignments read"
        );
        self.assignments = Some(next);
        let read_again = current && std::mem::replace(&mut self.spec_stale, false);
        if current {
            // Swept on the last run's assignments (`swept_on_kept`): the
            // next round sweeps again, on what is read.
            self.kept_unread = false;
        }
        if current && (self.lapsed_since.is_some() || self.lan_word.is_some()) {
            self.lapsed_since = None;
            if self.lan_word.take().is_some() {
                tracing::info!(object = %self.settings.object, "assignments read again: no longer holding on its witnesses' word");
            }
        }
        changed || read_again || self.swept.is_none() || self.swept_on_kept
    }

    /// The assignments this node read may have moved while it could not
    /// hear of it: it reads its object again, with a new list, and takes
    /// nothing over until it has (what it holds stays). After a pause, a
    /// lost uplink (its API path may ride on it: the watch stalls without
    /// an error and catches up later) and a lifted fence; the fault soak
    /// saw each of them take an address over from an assignment that had
    /// moved away meanwhile, beside a holder that could not answer yet.
    fn read_again(&mut self, why: &str) {
        tracing::info!(object = %self.settings.object, "{why}: reading its assignments again before taking anything over");
        self.ask_read_again(why);
    }

    /// [`Lb::read_again`], for a caller that has said why already.
    fn ask_read_again(&mut self, why: &str) {
        self.spec_stale = true;
        self.read = format!("reading {} again: {why}", self.settings.object);
        self.relist.send_modify(|n| *n += 1);
    }

    /// The interfaces the assignments want held (valid, not released).
    fn wanted_interfaces(&self) -> BTreeSet<String> {
        self.assignments
            .iter()
            .flatten()
            .filter_map(|a| lease_plan::want(a).ok())
            .filter(|w| !w.release)
            .map(|w| w.interface)
            .collect()
    }

    /// The start-up sweep: left links no assignment wants go.
    async fn sweep(&mut self) {
        let keep = self.wanted_interfaces();
        let report = self.engine.sweep(INTERFACE_PREFIX, &keep).await;
        if !report.removed.is_empty() {
            tracing::warn!(links = ?report.removed, "removed LoadBalancer macvlans an earlier run left that no assignment wants (not released; lease files kept)");
        }
        for p in &report.problems {
            tracing::warn!(problem = %p, "start-up sweep of LoadBalancer macvlans");
        }
        if !keep.is_empty() {
            tracing::info!(links = ?keep, "adopting the assigned LoadBalancer addresses");
        }
        self.swept_on_kept = self.kept_unread;
        let mut removed = self.swept.take().unwrap_or_default();
        removed.extend(report.removed);
        self.swept = Some(removed);
    }

    /// One round: plan over the assignments and the running leases, act,
    /// note what failed and when to try again.
    async fn reconcile(&mut self) {
        self.note_running();
        self.reconcile_round().await;
        self.note_running();
    }

    /// The hypervisor paused this VM (seen on its RTC: `crate::pause`),
    /// as at a live migration's switchover: the LAN's switches send this
    /// node's Service MACs to the port they last came from, the old host's,
    /// until a frame from each comes from here, and a guest whose NIC
    /// cannot announce itself (e1000-family) sends none. So every held
    /// address is announced again from its MAC.
    ///
    /// Not after a pause that may have been as long as its witnesses'
    /// verdict ([`may_have_been_judged_from`]: a stalled switchover,
    /// `virtctl pause`, a storage error): its Services may be held
    /// elsewhere now, with the same MACs. An announcement would then take
    /// the MAC's port at the switch from the new holder, and black-hole its
    /// traffic once this node lets go (issue #31). So every address goes at
    /// once (handover: no RELEASE), and what is still this node's is taken
    /// back through the takeover guard, on its witnesses' word
    /// (`super::lan_word`: none of their accusations landed) or once the
    /// assignments are read again.
    async fn after_pause(&mut self, at_least: Duration) {
        let paused_for =
            humantime::format_duration(Duration::from_millis(at_least.as_millis() as u64));
        if super::holder::after_pause(at_least, self.address_lifetime())
            == super::holder::AfterPause::HandOver
        {
            self.lapse(self.ran.0);
            hand_over_every_lease(&*self.engine).await;
            tracing::warn!(
                at_least = ?at_least,
                "this VM was paused for long enough that its witnesses may have reported it: every address handed over at once (its Services may be held elsewhere by now), taken back through the takeover guard if still assigned here"
            );
            self.ask_read_again(&format!("paused for at least {paused_for}"));
            self.retry_at = Some(Instant::now());
            return;
        }
        let leases = self.engine.snapshot();
        let mut announced = 0;
        for l in leases.iter().filter(|l| l.address.is_some()) {
            match self.engine.announce(&l.name).await {
                Ok(()) => announced += 1,
                Err(e) => {
                    tracing::debug!(lease = %l.name, error = %e, "no announcement after the pause")
                }
            }
        }
        tracing::info!(
            at_least = ?at_least,
            announced,
            "this VM was paused (live migration or suspend): announced every held address again"
        );
    }

    /// A pause longer than the address lifetime (a paused VM, a frozen
    /// cgroup, SIGSTOP) let the kernel drop the addresses, and the
    /// assignments may have moved meanwhile while the watch, paused too,
    /// has not said so yet: the fault soak saw a resumed node take a
    /// deleted Service's address back for a second from what it had read
    /// before. So the object is read again, and nothing is taken over
    /// until it is (what is still held stays).
    fn note_running(&mut self) {
        let now = (Instant::now(), SystemTime::now());
        let gap = did_not_run_for(self.ran, now);
        let last_seen = self.ran.0;
        self.ran = now;
        if gap > self.awake_within {
            self.lapse(last_seen);
            tracing::warn!(
                gap = ?gap,
                object = %self.settings.object,
                "this node did not run (paused, frozen or stalled) for longer than its address lifetime: reading its assignments again before taking anything over"
            );
            self.ask_read_again(&format!(
                "did not run for {}",
                humantime::format_duration(Duration::from_millis(gap.as_millis() as u64))
            ));
        }
    }

    /// One round: sort the assignments into what to hold and what not,
    /// plan over them and the running leases, act, and note when to try
    /// again.
    async fn reconcile_round(&mut self) {
        let Some(assignments) = self.assignments.clone() else {
            return;
        };
        if self.swept.is_none() || (self.swept_on_kept && !self.kept_unread) {
            self.sweep().await;
        }
        let node = (self.node)();
        self.no_carrier = node.no_carrier.clone();
        self.uplink = node.default_uplink.clone();
        // One look at the leases serves the whole round.
        let leases = self.engine.snapshot();
        if leases.iter().any(|l| l.state == hna_dhcp::State::Expired) {
            self.after_expiry();
        }
        let sorted = self.sort_assignments(&assignments, &node, &leases);
        let mut failures = BTreeMap::new();
        let actions = self.actions(&sorted, &node, &leases, &mut failures);
        let settings = Settings {
            default_uplink: node.default_uplink.clone(),
            witness: node.gateway_address,
            ..self.settings.leases.clone()
        };
        let guarded = self.apply(actions, &settings, &mut failures).await;
        for i in self.guarded.keys().filter(|i| !guarded.contains_key(*i)) {
            tracing::info!(interface = %i, "the address no longer answers elsewhere");
        }
        self.guarded = guarded;
        // A start no longer wanted, or failed otherwise, waits no more.
        let guarded = &self.guarded;
        self.guarded_since.retain(|i, _| guarded.contains_key(i));
        self.failures = failures;
        self.schedule_retry(sorted.cut_off);
    }

    /// Which assignments this round may act on, and why the others wait.
    fn sort_assignments(
        &mut self,
        assignments: &[Assignment],
        node: &NodeView,
        leases: &[LeaseStatus],
    ) -> Sorted {
        let mut sorted = Sorted::default();
        let out_of_touch = self.out_of_touch_reason();
        let server_macs = dhcp_server_macs(leases);
        let holding: BTreeSet<&str> = leases
            .iter()
            .filter(|l| l.state.holds_address())
            .map(|l| l.name.as_str())
            .collect();
        for a in assignments {
            let mut w = match lease_plan::want(a) {
                Ok(w) => w,
                Err(e) => {
                    if self.logged_invalid.insert(e.clone()) {
                        tracing::warn!(error = %e, "invalid assignment: left as it is");
                    }
                    sorted.untouched.insert(a.interface.clone());
                    continue;
                }
            };
            if w.uplink.is_none() {
                w.uplink = self.parent_for(&w, node);
            }
            let mac = hna_contract::mac::format(&w.mac);
            if let Some(why) = self.fence.as_ref().filter(|_| !w.release) {
                sorted.cut_off.insert(w.interface.clone(), why.clone());
            } else if let Some(why) = out_of_touch
                .as_ref()
                .filter(|_| !w.release && !holding.contains(w.interface.as_str()))
            {
                // Out of touch, this node cannot know that an assignment is
                // still its own: it keeps serving the addresses it holds,
                // and takes none over (see `out_of_touch_reason`).
                sorted.cut_off.insert(w.interface.clone(), why.clone());
            } else if let Some(why) = mac_refusal(&w, &mac, node, &server_macs) {
                refuse_mac(
                    &mut sorted.cut_off,
                    &mut sorted.untouched,
                    leases,
                    &w.interface,
                    &mac,
                    why,
                );
            } else if let Some(why) = parent_refusal(&w, node) {
                sorted.cut_off.insert(w.interface.clone(), why);
            } else {
                sorted.wants.push(w);
            }
        }
        sorted
    }

    /// The parent of an assignment that names none. Resolved here, so a
    /// moved default uplink shows in the plan as a changed parent (`apply`
    /// resolves the same). A running lease stays on the card it was
    /// started on while that card is there with carrier: which of two DHCP
    /// NICs' default routes wins (a metric change, a renewal re-adding a
    /// route) must not move a Service to another network and another
    /// address (issue #29).
    fn parent_for(&self, w: &lease_plan::Want, node: &NodeView) -> Option<String> {
        let kept = self
            .started
            .get(&w.interface)
            .and_then(|s| s.parent.clone())
            .filter(|p| node.nics.contains(p) && !node.no_carrier.contains(p));
        kept.or_else(|| node.default_uplink.clone())
    }

    /// The plan over the wanted and the running leases, less what this
    /// round leaves alone; a start that cannot work yet (no macvlan) is a
    /// failure instead.
    fn actions(
        &self,
        sorted: &Sorted,
        node: &NodeView,
        leases: &[LeaseStatus],
        failures: &mut BTreeMap<String, String>,
    ) -> Vec<Action> {
        let running: Vec<Running> = leases
            .iter()
            .cloned()
            .filter_map(|l| {
                Some(Running {
                    mac: hna_contract::mac::parse(&l.mac)?,
                    started_as: self.started.get(&l.name).cloned(),
                    expired: l.state == hna_dhcp::State::Expired,
                    interface: l.name,
                })
            })
            .collect();
        lease_plan::plan(&sorted.wants, &running)
            .into_iter()
            .filter(|a| !sorted.untouched.contains(action_interface(a)))
            .filter(|a| match a {
                Action::Start(w) if !node.macvlan_ready => {
                    failures.insert(
                        w.interface.clone(),
                        format!("macvlan not ready: {}", node.macvlan_reason),
                    );
                    false
                }
                _ => true,
            })
            .collect()
    }

    /// Carries the actions out and records each outcome; returns the starts
    /// the takeover guard held back (the address answers elsewhere).
    async fn apply(
        &mut self,
        actions: Vec<Action>,
        settings: &Settings,
        failures: &mut BTreeMap<String, String>,
    ) -> BTreeMap<String, String> {
        let mut guarded = BTreeMap::new();
        let round_began = Instant::now();
        for (action, o) in actions
            .iter()
            .zip(apply::apply(&*self.engine, actions.clone(), settings).await)
        {
            let a = describe(action);
            match o.result {
                Ok(()) => {
                    if o.passed_guard {
                        let since = self.guarded_since.remove(&o.interface);
                        self.settings
                            .takeover_guard_wait
                            .observe((Instant::now() - since.unwrap_or(round_began)).as_secs_f64());
                    }
                    match action {
                        Action::Start(w) => {
                            self.started.insert(w.interface.clone(), w.started_as());
                        }
                        Action::Stop { interface, .. } => {
                            self.started.remove(interface);
                        }
                    }
                    tracing::info!(interface = %o.interface, "{a}")
                }
                Err(e) if o.guarded => {
                    self.guarded_since
                        .entry(o.interface.clone())
                        .or_insert(round_began);
                    if !self.guarded.contains_key(&o.interface) {
                        tracing::warn!(interface = %o.interface, "{e}");
                    }
                    guarded.insert(o.interface, e.to_string());
                }
                Err(e) => {
                    tracing::warn!(interface = %o.interface, error = %e, "could not {a}; trying again");
                    failures.insert(o.interface, e.to_string());
                }
            }
        }
        guarded
    }

    /// When the next round comes: failures back off, guarded starts look
    /// again soon; what was held back waits for what it waits on.
    fn schedule_retry(&mut self, cut_off: BTreeMap<String, String>) {
        // Not failures to retry: the carrier's return starts a round.
        let retry_for_failures = !self.failures.is_empty();
        if !cut_off.is_empty() {
            tracing::debug!(object = %self.settings.object, held_back = ?cut_off, "assignments not taken over this round");
        }
        self.failures.extend(cut_off);
        let failed_retry = retry_for_failures.then(|| Instant::now() + self.backoff);
        self.backoff = if retry_for_failures {
            (self.backoff * 2).min(RETRY_MAX)
        } else {
            RETRY_MIN
        };
        // A guarded start is no failure: the other holder goes when its
        // agent (or systemd's watchdog) acts, so look again soon, whatever
        // else is backing off.
        let guard_retry = (!self.guarded.is_empty()).then(|| Instant::now() + self.guard_backoff);
        self.guard_backoff = if self.guarded.is_empty() {
            GUARD_RETRY_MIN
        } else {
            (self.guard_backoff * 2).min(GUARD_RETRY_MAX)
        };
        self.retry_at = match (failed_retry, guard_retry) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }

    /// The agent is stopping: every address goes at once (handover: no
    /// RELEASE, lease files kept, so the next holder asks for the same
    /// address), then one last status says so, `ready: false` with no lease
    /// held, so the controller moves the Services now instead of after the
    /// heartbeat goes stale. Links first: the next holder's takeover guard
    /// waits while this node still answers for an address.
    async fn hand_over_all(&mut self) {
        self.lan.stop.send_replace(Some(true));
        hand_over_every_lease(&*self.engine).await;
        self.stopping = true;
        let status = self.report();
        if !self.writes.write_now(status, STOPPING_WRITE_TIMEOUT).await {
            tracing::warn!(object = %self.settings.object, "the last status (stopping) was not written within {STOPPING_WRITE_TIMEOUT:?}; the controller moves the addresses once the heartbeat is stale");
        }
    }

    /// The agent is restarting: every address stays on its link for
    /// `restart_grace` (lifetimes set to it, nothing sent, lease files
    /// kept), then one last status says so, with everything still held,
    /// so the controller moves nothing for that long. In that order: the
    /// controller's wait, counted from when it reads the status, ends after
    /// the kernel has dropped any address the next run did not adopt.
    async fn leave_for_restart(&mut self) {
        let grace = self.settings.restart_grace;
        let mut status = self.report();
        for e in self.engine.detach_all(grace).await {
            tracing::warn!(error = %e, "could not leave a lease for the next run");
        }
        status.restart_grace_ms = u64::try_from(grace.as_millis()).ok();
        status.reason = format!(
            "restarting: addresses left on their links for {}",
            humantime::format_duration(grace)
        );
        tracing::info!(object = %self.settings.object, grace = ?grace, "restarting: every address stays on its link for the next run to adopt");
        if !self.writes.write_now(status, STOPPING_WRITE_TIMEOUT).await {
            tracing::warn!(object = %self.settings.object, "the last status (restarting) was not written within {STOPPING_WRITE_TIMEOUT:?}: the controller may move the addresses once the heartbeat is stale (the takeover guard waits for these to go)");
        }
        // Only now: stopped first, its witnesses could report it (their
        // probes unanswered for its lifetime and a margin) before the
        // controller has read the grace, and its Services would move from
        // a node that keeps answering for them (issue #49's review).
        self.lan.stop.send_replace(Some(false));
    }

    /// Why this node takes nothing over now, if it does not. Cut off from
    /// the API server, it cannot know that an assignment is still its own
    /// (the controller moves its Services once its heartbeat is stale); a
    /// takeover guard alone does not protect a stale assignment: a holder
    /// whose LAN port is silent for a moment looks gone, and both answered
    /// once it was back (the fault soak, issue #29). Written again, a node
    /// still acts on what it read before the cut until its watch reads the
    /// object again: the soak saw one take an address from its old
    /// assignments 0.8 s before the new ones came.
    fn out_of_touch_reason(&self) -> Option<String> {
        if self.lan_word.is_some() {
            None
        } else if self.out_of_touch {
            Some(self.out_of_touch_message())
        } else if self.spec_stale {
            Some("out of touch: this node's assignments could not be read since the watch failed (they may have moved); the addresses held are kept, none is taken over until they are read again".into())
        } else {
            None
        }
    }

    fn out_of_touch_message(&self) -> String {
        format!(
            "out of touch: no status written for {} or more, so this assignment may have moved; the addresses held are kept, none is taken over until a status write succeeds",
            humantime::format_duration(OUT_OF_TOUCH_AFTER)
        )
    }

    /// Whether this node stands down on the LAN: it holds none of the
    /// addresses its assignments want, and cannot read them again (its
    /// API path is cut), for [`STAND_DOWN_AFTER`]. Its witnesses then
    /// report it down while they hear it, and its Services move.
    ///
    /// Found by the fault soak: a node that fenced itself during an API
    /// server outage (too few witnesses heard, no status written) heard its
    /// peers again, and lifted the fence, while its own API path was cut.
    /// It held nothing until it could read its assignments (they may have
    /// moved meanwhile); its witnesses heard it, so the controller kept its
    /// Services on it, believing a node cut off from the API server serves
    /// on: 49 s without an answer, until its API path came back. Its
    /// witnesses are the only ones that can tell the controller, and the
    /// only thing they can tell is that it stood down: it still answers
    /// their probes (going silent would take a witness from every node it
    /// watches), with a flag.
    ///
    /// A node that holds anything keeps serving when cut off, as before.
    fn judge_stand_down(&mut self, leases: &[LeaseStatus]) {
        let unserved = super::holder::unserved(
            self.spec_stale,
            self.lan_word.is_some(),
            self.stopping,
            !self.wanted_interfaces().is_empty(),
            leases.iter().any(|l| l.state.holds_address()),
        );
        let decided = super::holder::stand_down(unserved, self.unserved_since, Instant::now());
        self.unserved_since = decided.unserved_since;
        self.stand_down_at = decided.again_at;
        let stand_down = decided.stood_down;
        let object = &self.settings.object;
        self.lan.want.send_if_modified(|w| {
            if w.stood_down == stand_down {
                return false;
            }
            if stand_down {
                tracing::warn!(object = %object, for_at_least = ?STAND_DOWN_AFTER, "standing down on the LAN: this node holds none of its addresses and cannot read its assignments; its witnesses report it so that its Services move");
            } else {
                tracing::info!(object = %object, "no longer standing down on the LAN");
            }
            w.stood_down = stand_down;
            true
        });
    }

    /// `lb_address_lifetime` (zero: none).
    fn address_lifetime(&self) -> Duration {
        self.settings
            .leases
            .timing
            .address_lifetime
            .unwrap_or_default()
    }

    /// The address lifetime: how long the LAN's silence is borne.
    fn lan_wait(&self) -> Duration {
        lan_wait(self.address_lifetime())
    }

    /// Decides the fence ([`super::fence`]): hands every lease over when
    /// it falls, holds what is assigned again (through the takeover guard)
    /// when it lifts, and asks for a status write when the LAN went quiet
    /// and nothing was written since, so that a node the API server still
    /// hears shows it in time.
    async fn judge_fence(&mut self) {
        let written = self.writes.written();
        let lan = self.lan.view.borrow().clone();
        let inputs = super::fence::Inputs {
            lan: &lan,
            last_ok: written.last_ok,
            write_failing: written.error.is_some(),
            now: Instant::now(),
            lan_wait: self.lan_wait(),
            fence_after: self.settings.fence_after,
            gateway: self.gateway,
        };
        if !self.gateway_asking && super::fence::gateway_check_due(&inputs) {
            self.ask_gateway();
        }
        let verdict = super::fence::verdict(&inputs);
        match verdict {
            super::fence::Verdict::Hold { again } => {
                self.fence_again = again;
                if let Some(why) = self.fence.take() {
                    tracing::warn!(object = %self.settings.object, was = %why, "no longer fenced: reading its assignments again, then holding what is assigned (through the takeover guard)");
                    self.ask_read_again("no longer fenced");
                    self.retry_at = Some(Instant::now());
                }
                let silences = [lan.hearing.none_since, lan.hearing.short_since];
                if let Some(since) = silences.into_iter().flatten().max()
                    && written.last_ok < since
                    && self.touched != Some(since)
                {
                    self.touched = Some(since);
                    self.writes.touch();
                }
            }
            super::fence::Verdict::Fence(why) => {
                self.fence_again = None;
                if self.fence.is_none() {
                    if let Some(e) = &written.error {
                        tracing::warn!(object = %self.settings.object, error = %e, "cannot write the LoadBalancerNode status");
                    }
                    tracing::warn!(object = %self.settings.object, "{why}: handing every address over");
                    let silences = [lan.hearing.none_since, lan.hearing.short_since];
                    let since = silences.into_iter().flatten().min();
                    self.lapse(since.unwrap_or(inputs.now));
                    hand_over_every_lease(&*self.engine).await;
                }
                self.fence = Some(why);
            }
        }
    }

    /// Asks, in a task of its own, whether the default gateway answers ARP
    /// on the default uplink; the answer comes back to the loop. Without
    /// either (no default route), nothing is asked.
    fn ask_gateway(&mut self) {
        let node = (self.node)();
        let (Some(uplink), Some(gateway)) = (node.default_uplink, node.gateway_address) else {
            return;
        };
        self.gateway_asking = true;
        let engine = self.engine.clone();
        let answers = self.gateway_answers.clone();
        let probe = self.settings.leases.probe;
        tokio::spawn(async move {
            let started = Instant::now();
            let answered = match engine.hears(&uplink, gateway, probe).await {
                Ok(answered) => answered,
                Err(e) => {
                    tracing::warn!(%uplink, %gateway, error = %e, "cannot ask the gateway whether it hears this node: counted as not heard");
                    false
                }
            };
            tracing::debug!(%uplink, %gateway, answered, "asked the gateway");
            let _ = answers
                .send(super::fence::GatewayCheck { started, answered })
                .await;
        });
    }

    /// A status write succeeded or failed: out of touch after failures
    /// for [`OUT_OF_TOUCH_AFTER`] (no takeover), and the fence decided
    /// again.
    async fn after_write(&mut self) {
        let written = self.writes.written();
        self.lan.want.send_if_modified(|w| {
            let changed = w.acknowledged != written.acknowledged;
            if changed {
                w.acknowledged.clone_from(&written.acknowledged);
            }
            changed
        });
        let out_of_touch =
            written.error.is_some() && written.last_ok.elapsed() >= OUT_OF_TOUCH_AFTER;
        if out_of_touch != self.out_of_touch {
            self.out_of_touch = out_of_touch;
            if out_of_touch {
                tracing::warn!(object = %self.settings.object, "{}", self.out_of_touch_message());
            } else {
                tracing::info!(object = %self.settings.object, "status written again: taking over what is assigned again (through the takeover guard)");
            }
            self.retry_at = Some(Instant::now());
        }
        self.judge_fence().await;
        self.judge_lan_word();
        self.report();
    }

    /// The last run's spec (`super::kept`), when it kept one: its
    /// assignments are this run's until the object is read, not to be
    /// taken over but on the witnesses' word ([`Lb::judge_lan_word`]),
    /// counted from now: the words the last run heard are this run's
    /// baseline (`swim::Member::seed_attestations`, seeded before now).
    fn take_up_what_was_kept(&mut self) {
        let Some(spec) = self.settings.kept.as_ref().and_then(|k| k.spec()) else {
            return;
        };
        tracing::info!(
            object = %self.settings.object,
            assignments = spec.assignments.len(),
            "the last run's assignments (kept in the state directory) stand until the object is read; held again before that only on the witnesses' word"
        );
        self.assignments = Some(spec.assignments.clone());
        self.kept_spec = Some(spec);
        self.kept_unread = true;
        // The uplink as it is now: its first look is no carrier's return
        // (which would ask for a read again), it is where this run began.
        let node = (self.node)();
        self.no_carrier = node.no_carrier;
        self.uplink = node.default_uplink;
        self.spec_stale = true;
        self.read = format!(
            "the last run's assignments, until {} is read",
            self.settings.object
        );
        self.lapse(Instant::now());
    }

    /// Keeps the spec read (`None`: the object is gone) for the next run.
    fn keep_spec(&mut self, spec: Option<&Spec>) {
        let Some(kept) = &self.settings.kept else {
            return;
        };
        if self.kept_spec.as_ref() == spec {
            return;
        }
        let (kept, to_keep, ticket) = (kept.clone(), spec.cloned(), kept.ticket());
        tokio::task::spawn_blocking(move || kept.keep_spec_in_order(ticket, to_keep.as_ref()));
        self.kept_spec = spec.cloned();
    }

    /// Keeps the witnesses' words on this node for the next run, when one
    /// changed.
    fn keep_words(&mut self) {
        let Some(kept) = &self.settings.kept else {
            return;
        };
        let words: BTreeMap<String, crate::membership::transport::Word> = self
            .lan
            .view
            .borrow()
            .attestations
            .iter()
            .map(|(n, a)| (n.clone(), a.word))
            .collect();
        if words != self.kept_words && !words.is_empty() {
            // Off the runtime's threads: an fsync on a loaded VM's disk
            // must not hold up the loop (a resumed VM lets go of its
            // addresses from it).
            let (kept, to_keep, ticket) = (kept.clone(), words.clone(), kept.ticket());
            tokio::task::spawn_blocking(move || kept.keep_words_in_order(ticket, &to_keep));
            self.kept_words = words;
        }
    }

    /// A held address expired in the kernel: this node did not confirm it
    /// for its lifetime (stalled, frozen), so it may have been judged from
    /// since then. Out of touch with the API server, that is a lapse like
    /// any other (`super::lan_word`): before, the address stayed dark
    /// until the node stood down and its Services moved, its witnesses not
    /// having accused it (issue #49).
    fn after_expiry(&mut self) {
        if self.out_of_touch || self.spec_stale {
            let since = Instant::now()
                .checked_sub(self.lan_wait())
                .unwrap_or_else(Instant::now);
            self.lapse(since);
            self.judge_lan_word();
        }
    }

    /// This node may have been judged from since `since` (see
    /// [`super::lan_word`]): what it read before is no longer its own on
    /// its witnesses' word, until they vouch again or it reads.
    fn lapse(&mut self, since: Instant) {
        self.lapsed_since = Some(self.lapsed_since.map_or(since, |l| l.min(since)));
        self.lan_word = None;
    }

    /// While a lapse keeps it from taking anything over, asks its
    /// witnesses' word ([`super::lan_word`]): when they vouch that its
    /// assignments cannot have moved, it holds them again (through the
    /// takeover guard) without waiting for the API server.
    fn judge_lan_word(&mut self) {
        let Some(lapsed_since) = self.lapsed_since else {
            return;
        };
        if self.lan_word.is_some() || self.fence.is_some() || self.assignments.is_none() {
            return;
        }
        if !self.spec_stale && !self.out_of_touch {
            return;
        }
        let written = self.writes.written();
        let lan = self.lan.view.borrow().clone();
        let word = super::lan_word::judge(&super::lan_word::Inputs {
            lapsed_since,
            last_write_ok: written.last_ok,
            witnesses: &lan.witnesses,
            attestations: &lan.attestations,
        });
        match word {
            super::lan_word::Word::Holds { by } => {
                tracing::warn!(
                    object = %self.settings.object,
                    vouched_by = ?by,
                    lapsed_for = ?lapsed_since.elapsed(),
                    "holding its assignments again on its witnesses' word: none of their accusations of it reached the API server since the lapse, so they cannot have moved (its assignments are read again when the API server answers)"
                );
                self.read = format!(
                    "holding its last assignments on its witnesses' word ({}); reading {} again",
                    by.join(", "),
                    self.settings.object
                );
                self.lan_word = Some(by);
                self.retry_at = Some(Instant::now());
            }
            super::lan_word::Word::Unsure(why) => {
                tracing::debug!(object = %self.settings.object, %why, "not holding on its witnesses' word");
            }
        }
    }

    /// Publishes the state, and drafts the status (written when what it
    /// reports changed, and at every heartbeat); returns that status.
    fn report(&mut self) -> Status {
        let leases = self.engine.snapshot();
        self.judge_stand_down(&leases);
        let node = (self.node)();
        let mut status = report(
            self.assignments.as_deref().unwrap_or_default(),
            &self.failures,
            &self.guarded,
            &leases,
            &node,
            self.swept.is_some(),
        );
        if self.stopping {
            status.ready = false;
            status.reason = STOPPING.to_string();
        } else if let Some(why) = &self.fence {
            status.ready = false;
            status.reason = why.clone();
        }
        status.heartbeat_period_ms = u64::try_from(self.settings.heartbeat.as_millis()).ok();
        status.observed_generation = self.read_generation;
        let machine_reason = match (status.ready, self.stopping, &self.fence) {
            (true, ..) => "Ready",
            (false, true, _) => "Stopping",
            (false, false, Some(_)) => node_object::FENCED,
            (false, false, None) => "NotReady",
        };
        let ready = ready_condition(
            self.ready_condition.as_ref(),
            status.ready,
            machine_reason,
            &status.reason,
            self.read_generation,
            std::time::SystemTime::now(),
        );
        self.ready_condition = Some(ready.clone());
        status.conditions = vec![ready];
        status.lan = self.lan.view.borrow().report.clone();
        self.writes.draft(status.clone());
        let write_error = self.writes.written().error;
        if write_error.is_some() != self.write_error_logged {
            match &write_error {
                Some(e) => {
                    tracing::warn!(object = %self.settings.object, error = %e, "cannot write the LoadBalancerNode status; leases are kept")
                }
                None => {
                    tracing::info!(object = %self.settings.object, "LoadBalancerNode status written again")
                }
            }
            self.write_error_logged = write_error.is_some();
        }
        let wanted = self
            .assignments
            .iter()
            .flatten()
            .filter(|a| !a.release)
            .count() as u32;
        let (membership_not_running, membership_dropped) = {
            let v = self.lan.view.borrow();
            (
                v.why_not.clone(),
                v.dropped.iter().map(|(k, n)| (k.to_string(), *n)).collect(),
            )
        };
        self.out.send_replace(LbStatus {
            object: self.settings.object.clone(),
            read: self.read.clone(),
            adopted: self.swept.is_some(),
            removed_at_start: self.swept.clone().unwrap_or_default(),
            wanted,
            write_error,
            status: status.clone(),
            membership_not_running,
            membership_dropped,
        });
        status
    }
}

/// Every running lease handed over at once (no RELEASE; the links go).
async fn hand_over_every_lease<E: LeaseEngine>(engine: &E) {
    let names: Vec<String> = engine.snapshot().into_iter().map(|l| l.name).collect();
    let stops = names
        .iter()
        .map(|n| engine.stop(n, hna_dhcp::StopMode::Handover));
    for (name, result) in names.iter().zip(futures::future::join_all(stops).await) {
        match result {
            Ok(()) | Err(hna_dhcp::EngineError::Unknown(_)) => {}
            Err(e) => {
                tracing::warn!(interface = %name, error = %e, "could not hand the lease over cleanly")
            }
        }
    }
}

/// One round's assignments, sorted.
#[derive(Default)]
struct Sorted {
    /// To hold.
    wants: Vec<lease_plan::Want>,
    /// Left as they are, running or not.
    untouched: BTreeSet<String>,
    /// Not taken over this round, and why.
    cut_off: BTreeMap<String, String>,
}

/// Why this node makes no link with the assignment's MAC, if it does not.
/// The controller refuses the MACs the nodes report; the node checks
/// again, as root, against what its LAN shows it now. A Service's MAC on a
/// link of this node would steal the node's own traffic, and another
/// host's that host's.
fn mac_refusal(
    w: &lease_plan::Want,
    mac: &str,
    node: &NodeView,
    server_macs: &BTreeSet<String>,
) -> Option<String> {
    if w.release {
        return None;
    }
    node.own_macs
        .get(mac)
        .map(|own| format!(
            "MAC {mac} is already this node's interface {own}'s (kube-vip's vip-* link left behind, or the node's own): no macvlan is made with it"
        ))
        .or_else(|| server_macs.contains(mac).then(|| format!(
            "MAC {mac} is the DHCP server's (its replies to this node's leases come from it): a DISCOVER from it would move that host's port at the switches and be offered that host's lease; no macvlan is made with it"
        )))
        .or_else(|| node.mac_taken_on_lan(mac, w.requested_ip))
}

/// The MACs the DHCP server's replies to these leases came from (lower
/// case).
fn dhcp_server_macs(leases: &[LeaseStatus]) -> BTreeSet<String> {
    leases.iter().filter_map(|l| l.server_mac.clone()).collect()
}

/// Why the assignment's parent will not carry it, if it will not. The
/// controller allows only uplinks; the node checks again, as root, against
/// its own cards.
fn parent_refusal(w: &lease_plan::Want, node: &NodeView) -> Option<String> {
    let p = w.uplink.as_ref()?;
    if w.release {
        None
    } else if Some(p) != node.default_uplink.as_ref() && !node.nics.contains(p) {
        Some(format!(
            "{p} is neither this node's uplink nor a network card of its own (a bridge, a veth, a tunnel or an enslaved port): no macvlan is made on it"
        ))
    } else if node.no_carrier.contains(p) {
        Some(format!(
            "uplink {p} carries nothing (no carrier, set down or deleted): handed over, not held until it is back"
        ))
    } else {
        None
    }
}

fn action_interface(a: &Action) -> &str {
    match a {
        Action::Start(w) => &w.interface,
        Action::Stop { interface, .. } => interface,
    }
}

fn describe(a: &Action) -> String {
    match a {
        Action::Start(w) => format!("start the lease of {}", w.service),
        Action::Stop {
            mode: hna_dhcp::StopMode::Release,
            ..
        } => "release the lease (DHCPRELEASE)".into(),
        Action::Stop { .. } => "hand the lease over (no RELEASE)".into(),
    }
}

/// A Service's MAC this node refuses (another host's, or its own): no
/// link is made with it. A lease of that Service still running with
/// another MAC, holding its address, stays as it is: a refused change
/// leaves what is served (issue #29, "bad input"); the report says why.
fn refuse_mac(
    cut_off: &mut BTreeMap<String, String>,
    untouched: &mut BTreeSet<String>,
    leases: &[LeaseStatus],
    interface: &str,
    refused: &str,
    why: String,
) {
    let serving_another = leases.iter().any(|l| {
        l.name == interface && l.state.holds_address() && !l.mac.eq_ignore_ascii_case(refused)
    });
    let refused = node_object::MAC_REFUSED_BY_HOLDER;
    if serving_another {
        untouched.insert(interface.to_string());
        cut_off.insert(
            interface.to_string(),
            format!("{refused}{why}; the address stays on the MAC it has"),
        );
    } else {
        cut_off.insert(interface.to_string(), format!("{refused}{why}"));
    }
}

fn rfc3339_ms(unix_ms: u64) -> String {
    let t = SystemTime::UNIX_EPOCH + Duration::from_millis(unix_ms);
    humantime::format_rfc3339_seconds(t).to_string()
}

/// How long between two looks at both clocks: the larger of the two
/// spans, since a paused VM's monotonic clock may stand still (some
/// hypervisors hide the pause from it) while its wall clock is set right
/// on resume (KubeVirt does so through the guest agent). A wall clock
/// stepped back counts for nothing; one stepped forward only costs a read
/// of the node's object.
pub(crate) fn did_not_run_for(
    before: (Instant, SystemTime),
    now: (Instant, SystemTime),
) -> Duration {
    let monotonic = now.0.saturating_duration_since(before.0);
    let wall = now.1.duration_since(before.1).unwrap_or_default();
    monotonic.max(wall)
}

/// The status to report (without its heartbeat), as a pure function of
/// the assignments, the last round's failures, the engine's leases and the
/// node. A released assignment is reported only while its lease still
/// runs: its absence is how the controller learns the release happened.
pub(crate) fn report(
    assignments: &[Assignment],
    failures: &BTreeMap<String, String>,
    guarded: &BTreeMap<String, String>,
    leases: &[LeaseStatus],
    node: &NodeView,
    adopted: bool,
) -> Status {
    let mut reports = Vec::new();
    for a in assignments {
        let running = leases.iter().find(|l| l.name == a.interface);
        let problem = lease_plan::want(a)
            .err()
            .map(|e| e.to_string())
            .or_else(|| failures.get(&a.interface).cloned());
        let report = match running {
            Some(l) => LeaseReport {
                service: a.service.clone(),
                interface: a.interface.clone(),
                state: l.state.as_str().to_string(),
                address: l.address.map(|x| x.to_string()),
                server: l.server.map(|x| x.to_string()),
                expires: l.expires_at_unix_ms.map(rfc3339_ms),
                mac: l.mac.clone(),
                message: problem.or_else(|| l.last_error.clone()),
            },
            None if a.release => continue,
            None if guarded.contains_key(&a.interface) && problem.is_none() => LeaseReport {
                service: a.service.clone(),
                interface: a.interface.clone(),
                state: GUARDED.to_string(),
                address: None,
                server: None,
                expires: None,
                mac: a.mac.clone(),
                message: guarded.get(&a.interface).cloned(),
            },
            None => LeaseReport {
                service: a.service.clone(),
                interface: a.interface.clone(),
                state: if problem.is_some() {
                    "FAILED"
                } else {
                    "PENDING"
                }
                .to_string(),
                address: None,
                server: None,
                expires: None,
                mac: a.mac.clone(),
                message: problem.or_else(|| {
                    (!adopted).then(|| {
                        "waiting for the start-up adoption of the links an earlier run left"
                            .to_string()
                    })
                }),
            },
        };
        reports.push(report);
    }
    let held: Vec<&LeaseReport> = reports
        .iter()
        .filter(|r| {
            leases
                .iter()
                .any(|l| l.name == r.interface && l.state.holds_address())
        })
        .collect();
    let addresses = held
        .iter()
        .filter_map(|r| Some(format!("{} ({})", r.address.as_ref()?, r.service)))
        .collect::<Vec<_>>()
        .join(", ");
    let (ready, reason) = match (&node.default_uplink, node.macvlan_ready) {
        (_, false) => (false, format!("macvlan not ready: {}", node.macvlan_reason)),
        (None, true) => (
            false,
            "no default uplink: no IPv4 default route and no `uplink` configured".to_string(),
        ),
        (Some(u), true) if node.no_carrier.contains(u) => (
            false,
            format!("uplink {u} carries nothing (no carrier, set down or deleted)"),
        ),
        (Some(_), true) => (true, "Ready".to_string()),
    };
    Status {
        heartbeat: None,
        heartbeat_period_ms: None,
        restart_grace_ms: None,
        observed_generation: None,
        ready,
        reason,
        macvlan_ready: node.macvlan_ready,
        default_uplink: node.default_uplink.clone(),
        nic_macs: node.nic_macs(),
        gateway_mac: node.gateway_mac.clone(),
        dhcp_server_macs: dhcp_server_macs(leases).into_iter().collect(),
        gateway_address: node.gateway_address.map(|a| a.to_string()),
        held: held.len() as u32,
        addresses,
        leases: reports,
        agent_version: env!("CARGO_PKG_VERSION").to_string(),
        lan: None,
        conditions: Vec::new(),
    }
}

/// The `Ready` condition for a status saying `ready` (`machine_reason`
/// and `reason`, the status's own words, as its message), judged with the
/// spec of `generation`: the transition time of `previous` is kept while
/// its status stays, so a heartbeat changes nothing in it.
pub(crate) fn ready_condition(
    previous: Option<&Condition>,
    ready: bool,
    machine_reason: &str,
    reason: &str,
    generation: Option<i64>,
    now: std::time::SystemTime,
) -> Condition {
    let status = if ready { "True" } else { "False" };
    Condition {
        type_: hna_contract::node_object::READY.to_string(),
        status: status.to_string(),
        observed_generation: generation,
        last_transition_time: previous
            .filter(|p| p.status == status)
            .map(|p| p.last_transition_time.clone())
            .unwrap_or_else(|| humantime::format_rfc3339_seconds(now).to_string()),
        reason: machine_reason.to_string(),
        message: if ready {
            String::new()
        } else {
            reason.to_string()
        },
    }
}

/// The status as a merge patch body that says every field, absent ones
/// included: a merge patch keeps what it does not mention, and the
/// contract's types leave empty fields out. Left out, a cleared field kept
/// its old value at the API server: a restart's grace outlived it, and a
/// witness's last accusation (`lan.down` back to empty) and its
/// `lan.unheard` stayed there after it heard its peers again, so a node
/// that came back stayed dead on its LAN for as long as that witness beat
/// on time (the VM pause test: for good; the fault soak: 85 s).
pub(crate) fn merge_patch_body(status: &Status) -> Result<serde_json::Value, serde_json::Error> {
    use serde_json::{Value, json};
    let mut body = serde_json::to_value(status)?;
    for key in [
        "defaultUplink",
        "restartGraceMs",
        "gatewayMac",
        "gatewayAddress",
        "heartbeatPeriodMs",
        "lan",
    ] {
        if body.get(key).is_none() {
            body[key] = Value::Null;
        }
    }
    if body.get("nicMacs").is_none() {
        body["nicMacs"] = json!([]);
    }
    if let Some(lan) = body.get_mut("lan").and_then(Value::as_object_mut) {
        for (key, empty) in [
            ("down", json!([])),
            ("hears", json!([])),
            ("unheard", json!(false)),
        ] {
            lan.entry(key).or_insert(empty);
        }
    }
    Ok(body)
}

/// Writes the status subresource with a merge patch, through whichever
/// client the daemon has now.
pub struct KubeStatus {
    pub client: watch::Receiver<Option<kube::Client>>,
    pub namespace: String,
    pub node: String,
}

impl StatusWriter for KubeStatus {
    async fn write(&self, status: &Status) -> Result<(), super::delivery::Failed> {
        let client = self
            .client
            .borrow()
            .clone()
            .ok_or_else(|| super::delivery::Failed::from("not connected to the cluster"))?;
        let api: Api<LoadBalancerNode> =
            Api::namespaced_with(client, &self.namespace, &node_object::api_resource());
        let body = merge_patch_body(status).map_err(|e| e.to_string())?;
        let patch = serde_json::json!({ "status": body });
        api.patch_status(&self.node, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map(|_| ())
            .map_err(|e| failed(&e))
    }
}

/// A failed write as [`super::delivery`] needs it: its message, and a
/// 429's `Retry-After` (`details.retryAfterSeconds` of its `Status`).
fn failed(e: &kube::Error) -> super::delivery::Failed {
    super::delivery::Failed {
        retry_after: match e {
            kube::Error::Api(s) if s.code == 429 => s
                .details
                .as_ref()
                .map(|d| d.retry_after_seconds)
                .filter(|s| *s > 0)
                .map(|s| Duration::from_secs(u64::from(s))),
            _ => None,
        },
        message: hna_edges::cluster::watch_one::Failure::from_kube(e).message,
        answered: matches!(e, kube::Error::Api(_)),
    }
}

/// A read of this node's assignments, and which ask to read again the
/// watch it came from answers (the `relist` count when it began).
#[derive(Debug)]
pub struct SpecRead {
    pub(crate) listed: u64,
    /// The object's `metadata.generation` (its spec's version), echoed in
    /// `status.observedGeneration`.
    pub generation: Option<i64>,
    pub update: Update<Spec>,
}

impl From<Update<Spec>> for SpecRead {
    /// From the first watch, before any ask.
    fn from(update: Update<Spec>) -> SpecRead {
        SpecRead {
            listed: 0,
            generation: None,
            update,
        }
    }
}

/// Watches this node's object with whichever client the daemon has,
/// starting over (with a list) when the client changes or the loop asks
/// through `relist`; the spec goes to `tx`.
pub async fn follow(
    mut client: watch::Receiver<Option<kube::Client>>,
    namespace: String,
    node: String,
    tx: mpsc::Sender<SpecRead>,
    mut relist: watch::Receiver<u64>,
) {
    loop {
        // Every start lists the object: an ask made before it is answered.
        let listed = *relist.borrow_and_update();
        let current = client.borrow_and_update().clone();
        let task = current.map(|c| {
            let api: Api<LoadBalancerNode> =
                Api::namespaced_with(c, &namespace, &node_object::api_resource());
            tokio::spawn(watch_one(
                api,
                node.clone(),
                hna_edges::cluster::credentials::WATCH_TIMEOUT_SECS,
                tx.clone(),
                move |u| SpecRead {
                    listed,
                    generation: match &u {
                        Update::Present(o) => o.metadata.generation,
                        _ => None,
                    },
                    update: match u {
                        Update::Present(o) => Update::Present(o.spec),
                        Update::Absent => Update::Absent,
                        Update::Failed(f) => Update::Failed(f),
                    },
                },
            ))
        });
        let Some(mut task) = task else {
            if client.changed().await.is_err() {
                return;
            }
            continue;
        };
        tokio::select! {
            changed = client.changed() => {
                task.abort();
                if changed.is_err() {
                    return;
                }
            }
            // The loop was paused: a watch that ran on may not have told
            // everything yet; a new one lists the object first.
            asked = relist.changed() => {
                task.abort();
                // Gone before the new watch begins: nothing of it comes
                // after the new one's reads.
                let _ = (&mut task).await;
                if asked.is_err() {
                    return;
                }
            }
            // The watch never ends by itself; a panic would otherwise leave
            // the loop on its last assignments while the heartbeat goes on.
            ended = &mut task => {
                tracing::error!(outcome = ?ended.map(|_| "returned"), "the watch of this node's object ended; starting it again");
                if tx.is_closed() {
                    return;
                }
                tokio::time::sleep(FOLLOW_RESTART).await;
            }
        }
    }
}

/// Between a watch of the node's object that ended and its restart.
const FOLLOW_RESTART: Duration = Duration::from_secs(1);

#[cfg(test)]
#[path = "task_tests.rs"]
mod tests;

#[cfg(test)]
mod failed_tests {
    use super::*;

    #[test]
    fn a_429_carries_its_retry_after() {
        let status: kube::core::Status = serde_json::from_value(serde_json::json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "too many requests", "reason": "TooManyRequests", "code": 429,
            "details": {"retryAfterSeconds": 1},
        }))
        .unwrap();
        let f = failed(&kube::Error::Api(status.boxed()));
        assert_eq!(f.retry_after, Some(Duration::from_secs(1)));
    }
}
