//! Runs one [`Machine`] against a [`Transport`], an [`AddressConfig`] and
//! an optional [`Store`]: the only place where its actions meet the world.
//! Generic over the edges so the whole loop is tested with in-memory fakes
//! and paused time.

use std::collections::VecDeque;
use std::net::Ipv4Addr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

use super::io::{HeldAddress, RecvError, Transport};
use super::link::AddressConfig;
use super::machine::{Action, Counters, Event, Lease, Machine, State, StopMode};
use super::store::{LeaseRecord, Store};

/// A state change and when it happened, relative to the lease's start.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Transition {
    pub state: State,
    pub at_ms: f64,
}

/// How a lease came to hold its address, for [`AcquiredHook`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Acquisition {
    /// DISCOVER, OFFER, REQUEST, ACK (and the ARP check).
    Discovered,
    /// INIT-REBOOT: a REQUEST for the address it had (a restart, a
    /// takeover, a requested address).
    Rebooted,
}

impl Acquisition {
    pub fn as_str(self) -> &'static str {
        match self {
            Acquisition::Discovered => "discover",
            Acquisition::Rebooted => "reboot",
        }
    }
}

/// Told each time a lease comes to hold an address, and how long that took:
/// from its start, or from losing the address it had, to BOUND. An adopted
/// lease (already BOUND at start) is not an acquisition.
pub type AcquiredHook = std::sync::Arc<dyn Fn(Acquisition, Duration) + Send + Sync>;

/// What `status`, `/metrics` and `dhcp-probe` show for one lease.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LeaseStatus {
    pub name: String,
    pub mac: String,
    pub state: State,
    pub address: Option<Ipv4Addr>,
    pub server: Option<Ipv4Addr>,
    /// The MAC (lower case) the server's replies for this lease came from:
    /// the DHCP server's, or a relay's. No Service may use it (issue #49).
    #[serde(default)]
    pub server_mac: Option<String>,
    pub(crate) routers: Vec<Ipv4Addr>,
    pub(crate) lease_secs: Option<f64>,
    pub t1_secs: Option<f64>,
    pub t2_secs: Option<f64>,
    /// Wall-clock times (Unix milliseconds) of T1, T2 and expiry.
    pub t1_at_unix_ms: Option<u64>,
    pub t2_at_unix_ms: Option<u64>,
    pub expires_at_unix_ms: Option<u64>,
    pub counters: Counters,
    pub(crate) last_drop: Option<String>,
    /// The last failure of the edge (send, address, lease file).
    pub last_error: Option<String>,
    /// The first 32 state changes.
    pub transitions: Vec<Transition>,
    /// The period of the presence frames (`Driver::presence`); `None`:
    /// none are sent.
    #[serde(default)]
    pub presence_every_ms: Option<u64>,
}

impl LeaseStatus {
    pub fn new(name: &str, mac: [u8; 6]) -> Self {
        LeaseStatus {
            name: name.to_string(),
            mac: crate::mac::format(&mac),
            state: State::Init,
            address: None,
            server: None,
            server_mac: None,
            routers: Vec::new(),
            lease_secs: None,
            t1_secs: None,
            t2_secs: None,
            t1_at_unix_ms: None,
            t2_at_unix_ms: None,
            expires_at_unix_ms: None,
            counters: Counters::default(),
            last_drop: None,
            last_error: None,
            transitions: Vec::new(),
            presence_every_ms: None,
        }
    }
}

/// How a lease begins.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Begin {
    /// No lease to go on: discovery, or INIT-REBOOT for a requested
    /// address (see [`Machine::requesting`]).
    Fresh,
    /// From the lease file, in INIT-REBOOT.
    Reboot(Lease),
    /// The lease file's lease is still valid and its address still on the
    /// interface: resume BOUND, nothing sent.
    Adopt(Lease),
}

impl From<Option<Lease>> for Begin {
    fn from(stored: Option<Lease>) -> Begin {
        stored.map_or(Begin::Fresh, Begin::Reboot)
    }
}

/// Requests to a running lease.
#[derive(Debug)]
pub(crate) enum Command {
    /// Stop; the sender is told when the address is gone (and, for
    /// `Release`, the DHCPRELEASE is sent).
    Stop(StopMode, oneshot::Sender<()>),
    /// Gratuitous ARP now (takeover).
    Announce,
    /// Leave the address where it is for this long more (its lifetime, if
    /// it has one, is set to it), send nothing, keep the lease file, and
    /// end: the daemon restarts and its next run adopts the link.
    Detach(Duration, oneshot::Sender<()>),
}

/// A lifetime in the kernel's whole seconds, at least one.
fn lifetime_secs(lifetime: Duration) -> u32 {
    lifetime
        .as_secs_f64()
        .ceil()
        .clamp(1.0, f64::from(u32::MAX - 1)) as u32
}

/// How often an address's lifetime is confirmed: four times per lifetime,
/// so a process that misses three confirmations in a row still keeps it.
fn confirm_every(lifetime: Duration) -> Duration {
    (lifetime / 4).max(Duration::from_millis(50))
}

fn to_unix_ms(at: Instant) -> u64 {
    let now = Instant::now();
    let wall = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let ms = if at >= now {
        wall + (at - now)
    } else {
        wall.saturating_sub(now - at)
    };
    ms.as_millis() as u64
}

/// Asks the LAN from the lease's uplink (with the uplink's own MAC)
/// whether another host answers for an address: the holder of a Service's
/// address answers with the Service's MAC, which is this lease's own, so a
/// probe from the lease's link cannot tell it apart.
pub(crate) type UplinkProbe = Box<
    dyn Fn(Ipv4Addr) -> std::pin::Pin<Box<dyn Future<Output = std::io::Result<bool>> + Send>>
        + Send
        + Sync,
>;

/// An [`UplinkProbe`] that opens `open()` for each probe (a packet socket
/// only while it is needed: late bindings are rare).
pub(crate) fn probe_through<T: Transport>(
    open: impl Fn() -> std::io::Result<T> + Send + Sync + 'static,
) -> UplinkProbe {
    let open = std::sync::Arc::new(open);
    Box::new(move |addr| {
        let open = open.clone();
        Box::pin(async move { open()?.arp_probe(addr).await })
    })
}

/// After an address is put on the link, it is announced again this often
/// for [`REANNOUNCE_FOR`]: the LAN's switches learn its MAC's port from
/// frames, and another host may still send from that MAC after this one
/// took the address over (a VM resumed from a long pause or a migration,
/// whose kernel answers the ARP requests queued for it and announces what
/// it still held before its agent drops it). The switch then sends the
/// Service's traffic there; each announcement brings it back within this
/// period (issue #31). One frame each: two a second per address taken,
/// for half a minute.
pub(crate) const REANNOUNCE_EVERY: Duration = Duration::from_millis(500);
/// See [`REANNOUNCE_EVERY`].
pub(crate) const REANNOUNCE_FOR: Duration = Duration::from_secs(30);

/// The presence frames' period where a lease asks for them and gives none
/// (`Driver::presence`): with the switch's learning within this of a
/// live migration's switchover, the Service's traffic follows within the
/// issue's 1 s (#31) with room for a late wake-up. Two frames a second
/// per address, each 60 bytes, to one host.
pub const PRESENCE_EVERY: Duration = Duration::from_millis(500);

/// How old the takeover guard's verdict may be when a first binding puts
/// the address on the link: a guard and exchange that took longer (a
/// process frozen during the guard or between its request and the answer,
/// a DHCP server slow or down) asks the LAN again first.
pub(crate) const GUARD_FRESH: Duration = Duration::from_secs(1);

pub(crate) struct Driver<T: Transport, A: AddressConfig> {
    name: String,
    machine: Machine,
    transport: T,
    addrs: A,
    /// Given to [`LeaseFiles`] when the loop starts.
    store: Option<Store>,
    files: Option<LeaseFiles>,
    status: watch::Sender<LeaseStatus>,
    started: Instant,
    deadline: Option<Instant>,
    /// The address configured with a lifetime, and when to confirm it.
    lifetime: Option<(Ipv4Addr, Instant)>,
    /// The address on the link now (put there by this driver).
    configured: Option<Ipv4Addr>,
    /// The address put on the link lately: when to announce it again, and
    /// until when ([`REANNOUNCE_EVERY`]).
    reannounce: Option<(Ipv4Addr, Instant, Instant)>,
    /// How often a frame goes out from the lease's MAC while its address
    /// is on the link ([`Driver::presence`]).
    presence_every: Option<Duration>,
    /// What the transport was last told the lease holds.
    held_told: Option<HeldAddress>,
    /// When the caller's takeover guard began (else the start): what a
    /// first binding's freshness is counted from.
    guarded_at: Option<Instant>,
    uplink: Option<UplinkProbe>,
    last_error: Option<String>,
    transitions: Vec<Transition>,
    on_acquired: Option<AcquiredHook>,
    /// Since when the lease has been without an address (`None` while it
    /// holds one, or was adopted holding one).
    acquiring_since: Option<Instant>,
}

impl<T: Transport, A: AddressConfig> Driver<T, A> {
    pub(crate) fn new(
        name: &str,
        machine: Machine,
        transport: T,
        addrs: A,
        store: Option<Store>,
    ) -> (Self, watch::Receiver<LeaseStatus>) {
        let (tx, rx) = watch::channel(LeaseStatus::new(name, machine.identity().mac));
        let now = Instant::now();
        let acquiring_since = (!machine.state().holds_address()).then_some(now);
        (
            Driver {
                name: name.to_string(),
                machine,
                transport,
                addrs,
                store,
                files: None,
                status: tx,
                started: now,
                deadline: None,
                lifetime: None,
                configured: None,
                reannounce: None,
                presence_every: None,
                held_told: None,
                guarded_at: None,
                uplink: None,
                last_error: None,
                transitions: Vec::new(),
                on_acquired: None,
                acquiring_since,
            },
            rx,
        )
    }

    /// See [`AcquiredHook`].
    pub(crate) fn on_acquired(mut self, hook: Option<AcquiredHook>) -> Self {
        self.on_acquired = hook;
        self
    }

    /// While the address is on the link, one frame from the lease's MAC
    /// every `every`: an ARP announcement unicast to the DHCP server's
    /// MAC (or its relay's), which crosses the LAN's switches and asks
    /// nothing back. It keeps their record of the MAC's port current
    /// whether or not anything tells this host that it moved: a live
    /// migration moves the VM's NIC to another hypervisor's port, QEMU
    /// announces only the NIC's own MAC, and where the NIC cannot have the
    /// guest announce (e1000-family) the switches would otherwise send the
    /// Service's traffic to the old port until the host sends from its MAC
    /// (issue #31). `None`: no presence frames.
    pub(crate) fn presence(mut self, every: Option<Duration>) -> Self {
        self.presence_every = every.filter(|d| !d.is_zero());
        let ms = self.presence_every.map(|d| d.as_millis() as u64);
        self.status.send_modify(|s| s.presence_every_ms = ms);
        self
    }

    /// Lets a first binding that comes later than [`GUARD_FRESH`] after the
    /// start ask the LAN, from the uplink, whether another host answers for
    /// the address before putting it on the link; if one does (or the
    /// uplink cannot be asked), the address is not configured and the
    /// lease ends `EXPIRED`, to be started again through the takeover
    /// guard. Without it every binding is configured at once.
    pub(crate) fn with_uplink_check(mut self, probe: UplinkProbe) -> Self {
        self.uplink = Some(probe);
        self
    }

    /// When the caller's takeover guard began asking (see
    /// [`LeaseConfig::guarded_at`](super::lease_engine::LeaseConfig::guarded_at)).
    pub(crate) fn guarded_at(mut self, at: Option<Instant>) -> Self {
        self.guarded_at = at;
        self
    }

    /// Why `address` must not be put on the link now, if it must not: a
    /// first binding, late, and another host answers for it on the uplink.
    async fn answered_elsewhere(&self, address: Ipv4Addr) -> Option<String> {
        let since = self.guarded_at.unwrap_or(self.started);
        if self.configured == Some(address) || since.elapsed() <= GUARD_FRESH {
            return None;
        }
        let probe = self.uplink.as_ref()?;
        match probe(address).await {
            Ok(false) => None,
            Ok(true) => Some(format!(
                "{address} answers on the LAN from another host; bound {:.1} s after the takeover guard asked (its word is too old): not configured",
                since.elapsed().as_secs_f64()
            )),
            Err(e) => Some(format!(
                "cannot ask the LAN whether {address} answers elsewhere ({e}); bound {:.1} s after the takeover guard asked: not configured",
                since.elapsed().as_secs_f64()
            )),
        }
    }

    /// Runs until stopped. A dropped command channel counts as a handover
    /// stop: without an explicit "no longer wanted", nothing is released.
    pub(crate) async fn run(mut self, begin: Begin, mut cmds: mpsc::Receiver<Command>) {
        self.started = Instant::now();
        self.files = self
            .store
            .take()
            .map(|store| LeaseFiles::start(store, self.name.clone()));
        let first = match begin {
            Begin::Fresh => Event::Start { stored: None },
            Begin::Reboot(l) => Event::Start { stored: Some(l) },
            Begin::Adopt(lease) => Event::Adopt { lease },
        };
        self.step(first).await;
        loop {
            let deadline = self.deadline;
            tokio::select! {
                r = self.transport.recv() => match r {
                    Ok(inb) => {
                        self.step(Event::Received { payload: &inb.payload, src_mac: inb.src_mac }).await;
                    }
                    Err(RecvError::Frame(e)) => {
                        self.machine.count_malformed_frame(format!("malformed frame: {e}"));
                        self.publish();
                    }
                    Err(RecvError::Io(e)) => {
                        self.error(format!("receive: {e}"));
                        // Do not spin on a persistent socket error.
                        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                    }
                },
                _ = sleep_until_opt(deadline) => {
                    self.deadline = None;
                    self.step(Event::Timer).await;
                }
                _ = sleep_until_opt(self.lifetime.map(|(_, at)| at)) => self.confirm_address().await,
                _ = sleep_until_opt(self.reannounce.map(|(_, at, _)| at)) => self.announce_again().await,
                Some(failure) = next_failure(&mut self.files) => self.error(failure),
                c = cmds.recv() => match c {
                    Some(Command::Announce) => self.step(Event::Announce).await,
                    Some(Command::Detach(keep_for, done)) => {
                        self.detach(keep_for).await;
                        self.flush_files().await;
                        let _ = done.send(());
                        return;
                    }
                    Some(Command::Stop(mode, done)) => {
                        self.step(Event::Stop(mode)).await;
                        // Whoever starts this lease again reads its file.
                        self.flush_files().await;
                        let _ = done.send(());
                        return;
                    }
                    None => {
                        self.step(Event::Stop(StopMode::Handover)).await;
                        self.flush_files().await;
                        return;
                    }
                },
            }
        }
    }

    /// One of the announcements after a takeover ([`REANNOUNCE_EVERY`]),
    /// while the address is still on the link.
    async fn announce_again(&mut self) {
        let Some((address, at, until)) = self.reannounce else {
            return;
        };
        let next = at + REANNOUNCE_EVERY;
        self.reannounce = (next <= until).then_some((address, next, until));
        if self.configured != Some(address) {
            self.reannounce = None;
            return;
        }
        if let Err(e) = self.transport.arp_announce_once(address).await {
            self.error(format!("ARP announce of {address}: {e}"));
        }
    }

    /// Tells the transport what the lease holds on the link now (nothing
    /// without an address there), when that changed: its presence frames
    /// and its LAN watch follow ([`Transport::set_held`]). A failure is
    /// logged, not made the lease's error: the lease holds its address
    /// all the same.
    fn update_presence(&mut self) {
        let want = match (self.configured, self.machine.lease()) {
            (Some(address), Some(lease)) => Some(HeldAddress {
                address,
                server_mac: lease.server_mac,
                presence_every: self.presence_every,
            }),
            _ => None,
        };
        if want == self.held_told {
            return;
        }
        match self.transport.set_held(want) {
            Ok(()) => self.held_told = want,
            Err(e) => {
                tracing::warn!(lease = %self.name, error = %e, "presence frames and LAN watch not started: after a live migration or a long pause elsewhere the LAN's switches may send this address's traffic to another host until this one sends from its MAC")
            }
        }
    }

    /// Gives the address its lifetime again, or, when the kernel already
    /// deleted it (this task did not run for the whole lifetime), tells
    /// the machine and puts nothing back.
    async fn confirm_address(&mut self) {
        let Some((address, _)) = self.lifetime else {
            return;
        };
        let Some(lifetime) = self.machine.address_lifetime() else {
            self.lifetime = None;
            return;
        };
        let next = Instant::now() + confirm_every(lifetime);
        match self.addrs.refresh(address, lifetime_secs(lifetime)).await {
            Ok(true) => self.lifetime = Some((address, next)),
            Ok(false) => {
                self.note_expired(address, lifetime_secs(lifetime));
                self.step(Event::AddressExpired).await;
            }
            Err(e) => {
                // Tried again at the next confirmation; the kernel removes
                // the address if none gets through.
                self.lifetime = Some((address, next));
                self.error(format!("confirm the lifetime of {address}: {e}"));
            }
        }
    }

    /// See [`Command::Detach`]: the machine is not told (it would remove
    /// the address); the next run reads the lease file and finds the
    /// address on the link.
    async fn detach(&mut self, keep_for: Duration) {
        let (Some(address), Some(_)) = (self.configured, self.lifetime) else {
            return;
        };
        match self.addrs.refresh(address, lifetime_secs(keep_for)).await {
            Ok(true) => {
                tracing::info!(lease = %self.name, %address, keep_for = ?keep_for, "address left on its link for the next run")
            }
            Ok(false) => {}
            Err(e) => self.error(format!("keep {address} for the next run: {e}")),
        }
    }

    /// The kernel removed `address` when its lifetime (`lifetime_s`) ran
    /// out unconfirmed: forgotten here, and said why; the caller tells the
    /// machine (`AddressExpired`).
    fn note_expired(&mut self, address: Ipv4Addr, lifetime_s: u32) {
        self.lifetime = None;
        self.configured = None;
        self.reannounce = None;
        self.update_presence();
        tracing::warn!(
            lease = %self.name,
            %address,
            lifetime_s,
            "the address ran out of its lifetime (this process did not run for that long: frozen, paused or starved) and the kernel removed it; not put back until the lease starts again"
        );
        self.last_error = Some(format!(
            "{address} expired: not confirmed within its {lifetime_s}s lifetime"
        ));
    }

    fn error(&mut self, e: String) {
        tracing::warn!(lease = %self.name, "{e}");
        self.last_error = Some(e);
        self.publish();
    }

    /// Carries out what the state machine decided for `event`, in order.
    // Long on purpose: one arm per `Action` of the machine, run against the
    // same queue (an address answered elsewhere drops the queued
    // announcements and feeds the machine's answer back in); split, each
    // arm would need the queue and the machine handed around.
    async fn step(&mut self, event: Event<'_>) {
        let actions = self.machine.handle(Instant::now(), event);
        self.note_transitions(&actions);
        let mut queue: VecDeque<Action> = actions.into();
        while let Some(a) = queue.pop_front() {
            match a {
                Action::Send {
                    kind,
                    payload,
                    src,
                    dst,
                } => {
                    tracing::debug!(lease = %self.name, ?kind, ?dst, "send");
                    if let Err(e) = self.transport.send(&payload, src, dst).await {
                        self.error(format!("send {kind:?}: {e}"));
                    }
                }
                Action::SetTimer(at) => self.deadline = Some(at),
                Action::ConfigureAddress { address, .. } => {
                    // A binding whose guard is stale (this task did not
                    // run, or the server was slow) may find the address
                    // already held by the node it was moved to meanwhile.
                    if let Some(why) = self.answered_elsewhere(address).await {
                        tracing::warn!(lease = %self.name, "{why}");
                        self.last_error = Some(why);
                        queue.retain(|a| !matches!(a, Action::ArpAnnounce(_)));
                        let more = self.machine.handle(Instant::now(), Event::AddressExpired);
                        self.note_transitions(&more);
                        queue.extend(more);
                        continue;
                    }
                    let lifetime = self.machine.address_lifetime().map(lifetime_secs);
                    // A renewal of an address with a lifetime: refreshed
                    // only if the kernel still has it. Re-added, one the
                    // kernel let expire (this task frozen past its
                    // lifetime, its node's Services moved meanwhile) came
                    // back beside its new holder for as long as the next
                    // look took (the CI soak: 16 ms, ARP answered twice).
                    if let (Some(l), Some(held)) = (lifetime, self.configured)
                        && held == address
                    {
                        match self.addrs.refresh(address, l).await {
                            Ok(true) => {
                                self.lifetime = self
                                    .machine
                                    .address_lifetime()
                                    .map(|l| (address, Instant::now() + confirm_every(l)));
                                // A rebinding may have reached another server.
                                self.update_presence();
                            }
                            Ok(false) => {
                                self.note_expired(address, l);
                                queue.retain(|a| !matches!(a, Action::ArpAnnounce(_)));
                                let more =
                                    self.machine.handle(Instant::now(), Event::AddressExpired);
                                self.note_transitions(&more);
                                queue.extend(more);
                            }
                            Err(e) => self.error(format!("confirm the lifetime of {address}: {e}")),
                        }
                        continue;
                    }
                    match self.addrs.add(address, lifetime).await {
                        Ok(()) => {
                            if self.configured != Some(address) {
                                let now = Instant::now();
                                self.reannounce =
                                    Some((address, now + REANNOUNCE_EVERY, now + REANNOUNCE_FOR));
                            }
                            self.configured = Some(address);
                            self.update_presence();
                            self.lifetime = self
                                .machine
                                .address_lifetime()
                                .map(|l| (address, Instant::now() + confirm_every(l)));
                        }
                        Err(e) => self.error(e.to_string()),
                    }
                }
                Action::RemoveAddress(address) => {
                    self.lifetime = None;
                    self.configured = None;
                    self.reannounce = None;
                    self.update_presence();
                    if let Err(e) = self.addrs.remove(address).await {
                        self.error(e.to_string());
                    }
                }
                Action::ArpProbe(address) => {
                    let conflict = match self.transport.arp_probe(address).await {
                        Ok(c) => c,
                        Err(e) => {
                            // Cannot probe: proceed as RFC 2131 clients
                            // without RFC 5227 do, but say so.
                            self.error(format!("ARP probe of {address}: {e}"));
                            false
                        }
                    };
                    if conflict {
                        tracing::warn!(lease = %self.name, %address, "address in use by another host: declining");
                    }
                    let more = self
                        .machine
                        .handle(Instant::now(), Event::ProbeResult { address, conflict });
                    self.note_transitions(&more);
                    queue.extend(more);
                }
                Action::ArpAnnounce(address) => {
                    if let Err(e) = self.transport.arp_announce(address).await {
                        self.error(format!("ARP announce of {address}: {e}"));
                    }
                }
                // Not waited for: see `LeaseFiles`.
                Action::Persist(lease) => {
                    if let Some(files) = &self.files {
                        files.send(FileOp::Save(LeaseRecord::from_lease(
                            &self.name,
                            self.machine.identity(),
                            &lease,
                        )));
                    }
                }
                Action::Forget => {
                    if let Some(files) = &self.files {
                        files.send(FileOp::Remove);
                    }
                }
                // Recorded by `note_transitions` before the step's work.
                Action::StateChanged { .. } => {}
            }
        }
        self.publish();
    }

    /// Waits until every lease-file write asked for so far is done, and
    /// notes the failures among them.
    async fn flush_files(&mut self) {
        let Some(files) = &mut self.files else {
            return;
        };
        let (done, flushed) = oneshot::channel();
        files.send(FileOp::Flush(done));
        let _ = flushed.await;
        let mut failures = Vec::new();
        while let Ok(f) = files.failures.try_recv() {
            failures.push(f);
        }
        for f in failures {
            self.error(f);
        }
    }

    /// Logs and records state changes when the machine decides them, not
    /// after the step's I/O (an ARP probe takes a while), so step timings
    /// are right.
    fn note_transitions(&mut self, actions: &[Action]) {
        for a in actions {
            if let Action::StateChanged { from, to } = a {
                tracing::info!(
                    lease = %self.name,
                    from = from.as_str(),
                    to = to.as_str(),
                    address = ?self.machine.lease().map(|l| l.address),
                    "DHCP state"
                );
                if self.transitions.len() < 32 {
                    self.transitions.push(Transition {
                        state: *to,
                        at_ms: (Instant::now() - self.started).as_secs_f64() * 1000.0,
                    });
                }
                self.time_acquisition(*from, *to);
            }
        }
    }

    fn time_acquisition(&mut self, from: State, to: State) {
        if to.holds_address() {
            if let Some(since) = self.acquiring_since.take()
                && let Some(hook) = &self.on_acquired
            {
                let how = if from == State::InitReboot {
                    Acquisition::Rebooted
                } else {
                    Acquisition::Discovered
                };
                hook(how, since.elapsed());
            }
        } else if self.acquiring_since.is_none() && !matches!(to, State::Stopped) {
            self.acquiring_since = Some(Instant::now());
        }
    }

    fn publish(&self) {
        let m = &self.machine;
        let l = m.lease();
        let st = LeaseStatus {
            name: self.name.clone(),
            mac: crate::mac::format(&m.identity().mac),
            state: m.state(),
            address: l.map(|l| l.address),
            server: l.map(|l| l.server_id),
            server_mac: l.map(|l| crate::mac::format(&l.server_mac)),
            routers: l.map(|l| l.routers.clone()).unwrap_or_default(),
            lease_secs: l.map(|l| l.lease_time.as_secs_f64()),
            t1_secs: l.map(|l| l.t1.as_secs_f64()),
            t2_secs: l.map(|l| l.t2.as_secs_f64()),
            t1_at_unix_ms: l.map(|l| to_unix_ms(l.t1_at())),
            t2_at_unix_ms: l.map(|l| to_unix_ms(l.t2_at())),
            expires_at_unix_ms: l.map(|l| to_unix_ms(l.expires_at())),
            counters: m.counters(),
            last_drop: m.last_drop().map(str::to_string),
            last_error: self.last_error.clone(),
            transitions: self.transitions.clone(),
            presence_every_ms: self.presence_every.map(|d| d.as_millis() as u64),
        };
        self.status.send_replace(st);
    }
}

/// The lease file's writes, carried out in order by a task of their own.
/// A renewal's save is two fsyncs, which a slow or stalled disk (a busy
/// host's shared storage, a VM's paused volume) holds for seconds; waited
/// for in the lease's loop, they held up the confirmation of the address's
/// lifetime, and a stall of three quarters of a lifetime dropped a healthy
/// node's address (issue #29). The file only matters at the next start,
/// which a stop waits for ([`Driver::run`] flushes before it returns).
struct LeaseFiles {
    ops: mpsc::UnboundedSender<FileOp>,
    failures: mpsc::UnboundedReceiver<String>,
}

enum FileOp {
    Save(LeaseRecord),
    Remove,
    /// Answered once every operation before it is done.
    Flush(oneshot::Sender<()>),
}

impl LeaseFiles {
    fn start(store: Store, name: String) -> LeaseFiles {
        let (ops, mut rx) = mpsc::unbounded_channel();
        let (failed, failures) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Some(op) = rx.recv().await {
                let store = store.clone();
                let name = name.clone();
                // On the blocking pool: an fsync on a runtime worker would
                // stall every lease sharing it.
                let (what, done) = match op {
                    FileOp::Save(rec) => (
                        "save",
                        tokio::task::spawn_blocking(move || store.save(&rec)).await,
                    ),
                    FileOp::Remove => (
                        "remove",
                        tokio::task::spawn_blocking(move || store.remove(&name)).await,
                    ),
                    FileOp::Flush(done) => {
                        let _ = done.send(());
                        continue;
                    }
                };
                let failure = match done {
                    Ok(Ok(())) => continue,
                    Ok(Err(e)) => e.to_string(),
                    Err(e) => format!("{what} of the lease file: {e}"),
                };
                let _ = failed.send(failure);
            }
        });
        LeaseFiles { ops, failures }
    }

    fn send(&self, op: FileOp) {
        // The task ends only when `ops` is dropped.
        let _ = self.ops.send(op);
    }
}

/// The next failed lease-file write; never, without a store.
async fn next_failure(files: &mut Option<LeaseFiles>) -> Option<String> {
    match files {
        Some(f) => f.failures.recv().await,
        None => std::future::pending().await,
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use dhcproto::v4::{DhcpOption, Message, MessageType};
    use dhcproto::{Decodable, Decoder};

    use super::*;
    use crate::io::Inbound;
    use crate::link::LinkError;
    use crate::machine::{Destination, Timing};
    use crate::packet::{Identity, build_reply};

    const MAC: [u8; 6] = [0, 0, 0x6c, 9, 9, 9];
    const SRV: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 1);
    const SRV_MAC: [u8; 6] = [2, 0, 0, 0, 0, 1];

    /// An in-memory DHCP server: answers DISCOVER/REQUEST for `addr`
    /// unless `down`; NAKs renewals when `nak_renew`.
    #[derive(Default)]
    struct World {
        addr: Option<Ipv4Addr>,
        down: bool,
        nak_renew: bool,
        sent: Vec<(MessageType, Ipv4Addr, Destination)>,
        inbox: VecDeque<Inbound>,
        configured: Vec<Ipv4Addr>,
        /// The lifetime of every add and successful refresh, in order.
        lifetimes: Vec<Option<u32>>,
        announced: usize,
        /// Every address the transport was told is held (`None`:
        /// none), in order.
        held: Vec<Option<HeldAddress>>,
    }

    #[derive(Clone, Default)]
    struct Fake(Arc<Mutex<World>>, Arc<tokio::sync::Notify>);

    impl Transport for Fake {
        async fn send(&self, payload: &[u8], src: Ipv4Addr, dst: Destination) -> io::Result<()> {
            let m = Message::decode(&mut Decoder::new(payload)).unwrap();
            let ty = m.opts().msg_type().unwrap();
            let mut w = self.0.lock().unwrap();
            w.sent.push((ty, src, dst));
            let addr = w.addr.unwrap();
            if w.down {
                return Ok(());
            }
            let opts = [
                DhcpOption::ServerIdentifier(SRV),
                DhcpOption::AddressLeaseTime(120),
                DhcpOption::Renewal(20),
                DhcpOption::Rebinding(35),
            ];
            let reply = match ty {
                MessageType::Discover => {
                    Some(build_reply(MessageType::Offer, m.xid(), MAC, addr, &opts))
                }
                MessageType::Request if w.nak_renew && !m.ciaddr().is_unspecified() => Some(
                    build_reply(MessageType::Nak, m.xid(), MAC, Ipv4Addr::UNSPECIFIED, &[]),
                ),
                MessageType::Request => {
                    Some(build_reply(MessageType::Ack, m.xid(), MAC, addr, &opts))
                }
                _ => None,
            };
            if let Some(payload) = reply {
                w.inbox.push_back(Inbound {
                    payload,
                    src_mac: SRV_MAC,
                });
                self.1.notify_one();
            }
            Ok(())
        }

        async fn recv(&self) -> Result<Inbound, RecvError> {
            loop {
                let notified = self.1.notified();
                if let Some(i) = self.0.lock().unwrap().inbox.pop_front() {
                    return Ok(i);
                }
                notified.await;
            }
        }

        async fn arp_probe(&self, _addr: Ipv4Addr) -> io::Result<bool> {
            tokio::time::sleep(Duration::from_millis(300)).await;
            Ok(false)
        }

        async fn arp_announce(&self, _addr: Ipv4Addr) -> io::Result<()> {
            self.0.lock().unwrap().announced += 1;
            Ok(())
        }

        fn set_held(&self, held: Option<HeldAddress>) -> io::Result<()> {
            self.0.lock().unwrap().held.push(held);
            Ok(())
        }
    }

    /// The uplink as the takeover guard's re-check sees it: whether another
    /// host answers, and every probe made.
    #[derive(Clone, Default)]
    struct Uplink {
        answers: bool,
        probes: Arc<Mutex<Vec<Ipv4Addr>>>,
    }

    impl Transport for Uplink {
        async fn send(&self, _: &[u8], _: Ipv4Addr, _: Destination) -> io::Result<()> {
            Ok(())
        }
        async fn recv(&self) -> Result<Inbound, RecvError> {
            std::future::pending().await
        }
        async fn arp_probe(&self, addr: Ipv4Addr) -> io::Result<bool> {
            tokio::time::sleep(Duration::from_millis(150)).await;
            self.probes.lock().unwrap().push(addr);
            Ok(self.answers)
        }
        async fn arp_announce(&self, _addr: Ipv4Addr) -> io::Result<()> {
            Ok(())
        }
    }

    /// A DHCP server that hands out 10.77.0.150, and an uplink on which
    /// another host answers for it.
    fn held_elsewhere() -> (Fake, Uplink, Ipv4Addr) {
        let fake = Fake::default();
        let addr = Ipv4Addr::new(10, 77, 0, 150);
        fake.0.lock().unwrap().addr = Some(addr);
        let uplink = Uplink {
            answers: true,
            ..Uplink::default()
        };
        (fake, uplink, addr)
    }

    /// A lease asking for `addr` whose late first binding asks `uplink`;
    /// its command channel is dropped with the driver (abort the handle).
    fn start_checked(
        fake: &Fake,
        uplink: &Uplink,
        addr: Ipv4Addr,
        guarded_at: Option<Instant>,
    ) -> (watch::Receiver<LeaseStatus>, tokio::task::JoinHandle<()>) {
        let m = Machine::new(Identity::new(MAC), Timing::default(), 1).requesting(Some(addr));
        let (d, rx) = Driver::new("vip-test", m, fake.clone(), fake.clone(), None);
        let open = uplink.clone();
        let d = d
            .guarded_at(guarded_at)
            .with_uplink_check(probe_through(move || Ok(open.clone())));
        let (tx, crx) = mpsc::channel(4);
        let h = tokio::spawn(async move {
            // Kept until the driver ends: a dropped channel stops it.
            let _tx = tx;
            d.run(Begin::Fresh, crx).await
        });
        (rx, h)
    }

    /// The acquisition hook hears each binding once, with how it began and
    /// how long it took: here an INIT-REBOOT whose first request went
    /// unheard (the server was down for 2 s), so its retransmission bound
    /// it.
    #[tokio::test(start_paused = true)]
    async fn an_acquisition_is_told_once_with_its_duration() {
        let fake = Fake::default();
        let addr = Ipv4Addr::new(10, 77, 0, 150);
        {
            let mut w = fake.0.lock().unwrap();
            w.addr = Some(addr);
            w.down = true;
        }
        let heard: Arc<Mutex<Vec<(Acquisition, Duration)>>> = Arc::default();
        let hook: AcquiredHook = {
            let heard = heard.clone();
            Arc::new(move |how, took| heard.lock().unwrap().push((how, took)))
        };
        let m = Machine::new(Identity::new(MAC), Timing::default(), 1).requesting(Some(addr));
        let (d, mut rx) = Driver::new("vip-test", m, fake.clone(), fake.clone(), None);
        let d = d.on_acquired(Some(hook));
        let (tx, crx) = mpsc::channel(4);
        let h = tokio::spawn(async move {
            let _tx = tx;
            d.run(Begin::Fresh, crx).await
        });
        tokio::time::sleep(Duration::from_secs(2)).await;
        fake.0.lock().unwrap().down = false;
        until(&mut rx, |s| s.state == State::Bound).await;
        tokio::time::sleep(Duration::from_secs(30)).await;
        let heard = heard.lock().unwrap().clone();
        assert_eq!(heard.len(), 1, "{heard:?}");
        assert_eq!(heard[0].0, Acquisition::Rebooted);
        assert!(
            heard[0].1 > Duration::from_secs(2) && heard[0].1 < Duration::from_secs(10),
            "{heard:?}"
        );
        h.abort();
    }

    /// Issue #31: a bound address is announced again every
    /// `REANNOUNCE_EVERY` for `REANNOUNCE_FOR`, then no more: another
    /// host sending from the same MAC meanwhile (a VM resumed from a long
    /// pause) takes the MAC's port at the switch for at most that long.
    #[tokio::test(start_paused = true)]
    async fn a_new_binding_is_announced_again_for_a_while() {
        let fake = Fake::default();
        let addr = Ipv4Addr::new(10, 77, 0, 150);
        fake.0.lock().unwrap().addr = Some(addr);
        let uplink = Uplink::default();
        let (mut rx, h) = start_checked(&fake, &uplink, addr, None);
        until(&mut rx, |s| s.state == State::Bound).await;
        let at_bind = fake.0.lock().unwrap().announced;
        assert!(at_bind >= 1, "announced when bound");
        let announced = || fake.0.lock().unwrap().announced - at_bind;
        tokio::time::sleep(REANNOUNCE_EVERY * 5 + REANNOUNCE_EVERY / 2).await;
        assert_eq!(announced(), 5);
        tokio::time::sleep(REANNOUNCE_FOR).await;
        let all = announced();
        assert_eq!(
            all as u128,
            REANNOUNCE_FOR.as_millis() / REANNOUNCE_EVERY.as_millis(),
            "then no more"
        );
        // Renewals (T1 at 20 s) put the same address back: no new round.
        tokio::time::sleep(REANNOUNCE_FOR).await;
        assert_eq!(announced(), all);
        h.abort();
    }

    /// Issue #31: the transport is told the address the lease holds from
    /// its binding, with the MAC its server answered from and the
    /// presence frames' period when the lease was asked for them, until
    /// the address leaves the link (its presence frames and LAN watch
    /// follow); nothing before the binding.
    #[tokio::test(start_paused = true)]
    async fn the_transport_is_told_the_held_address_while_it_is_on_the_link() {
        for every in [Some(PRESENCE_EVERY), None] {
            let fake = Fake::default();
            let addr = Ipv4Addr::new(10, 77, 0, 150);
            {
                let mut w = fake.0.lock().unwrap();
                w.addr = Some(addr);
                w.down = true;
            }
            let m = Machine::new(Identity::new(MAC), Timing::default(), 1).requesting(Some(addr));
            let (d, mut rx) = Driver::new("vip-test", m, fake.clone(), fake.clone(), None);
            let d = d.presence(every);
            let (tx, crx) = mpsc::channel(4);
            let h = tokio::spawn(d.run(Begin::Fresh, crx));
            tokio::time::sleep(Duration::from_secs(3)).await;
            assert!(
                fake.0.lock().unwrap().held.is_empty(),
                "told of an address before the binding"
            );
            fake.0.lock().unwrap().down = false;
            let st = until(&mut rx, |s| s.state == State::Bound).await;
            assert_eq!(st.presence_every_ms, every.map(|d| d.as_millis() as u64));
            // Renewals (T1 at 20 s) keep it as it is.
            tokio::time::sleep(Duration::from_secs(50)).await;
            let held = HeldAddress {
                address: addr,
                server_mac: SRV_MAC,
                presence_every: every,
            };
            assert_eq!(fake.0.lock().unwrap().held, [Some(held)]);
            // The server goes away: the lease (120 s) runs out, the
            // address leaves the link, and the transport is told.
            fake.0.lock().unwrap().down = true;
            until(&mut rx, |s| !s.state.holds_address()).await;
            assert_eq!(fake.0.lock().unwrap().held, [Some(held), None]);
            drop(tx);
            h.abort();
        }
    }

    /// Issue #20 (found by the soak): an agent frozen between its
    /// INIT-REBOOT request and the server's answer was moved away from
    /// meanwhile; when it ran again it put the address up beside the new
    /// holder on the strength of a takeover guard ten seconds old. A first
    /// binding later than `GUARD_FRESH` asks the LAN again from the uplink.
    #[tokio::test(start_paused = true)]
    async fn a_late_first_binding_asks_the_lan_again_and_keeps_off_a_held_address() {
        for answers in [true, false] {
            let fake = Fake::default();
            let addr = Ipv4Addr::new(10, 77, 0, 150);
            {
                let mut w = fake.0.lock().unwrap();
                w.addr = Some(addr);
                w.down = true;
            }
            let uplink = Uplink {
                answers,
                ..Uplink::default()
            };
            let (mut rx, h) = start_checked(&fake, &uplink, addr, None);
            // The server answers only after the first request went unheard.
            tokio::time::sleep(Duration::from_secs(2)).await;
            assert!(!fake.0.lock().unwrap().sent.is_empty());
            fake.0.lock().unwrap().down = false;
            let st = until(&mut rx, |s| {
                matches!(s.state, State::Bound | State::Expired)
            })
            .await;
            let w = fake.0.lock().unwrap();
            assert_eq!(
                *uplink.probes.lock().unwrap(),
                vec![addr],
                "answers {answers}"
            );
            if answers {
                assert_eq!(st.state, State::Expired);
                assert!(w.configured.is_empty(), "configured {:?}", w.configured);
                assert_eq!(w.announced, 0, "announced an address held elsewhere");
                assert!(st.last_error.unwrap().contains("another host"));
            } else {
                assert_eq!(st.state, State::Bound);
                assert_eq!(w.configured, vec![addr]);
            }
            drop(w);
            h.abort();
        }
    }

    /// Found by the 30-minute soak: an agent frozen for 9 s in the middle
    /// of its takeover guard (the probe asked before the addresses moved
    /// elsewhere, its verdict read after) started at once when it ran
    /// again and bound promptly. The guard's age counts from when it began
    /// asking, not from the lease's start.
    #[tokio::test(start_paused = true)]
    async fn a_prompt_binding_behind_a_stale_guard_asks_the_lan_again() {
        let (fake, uplink, addr) = held_elsewhere();
        let guard_began = Instant::now();
        tokio::time::sleep(Duration::from_secs(9)).await;
        let (mut rx, h) = start_checked(&fake, &uplink, addr, Some(guard_began));
        let st = until(&mut rx, |s| {
            matches!(s.state, State::Bound | State::Expired)
        })
        .await;
        assert_eq!(st.state, State::Expired);
        assert_eq!(*uplink.probes.lock().unwrap(), vec![addr]);
        assert!(fake.0.lock().unwrap().configured.is_empty());
        h.abort();
    }

    /// A binding within `GUARD_FRESH` of the start (the usual case: the
    /// server answers in milliseconds) asks nothing more.
    #[tokio::test(start_paused = true)]
    async fn a_prompt_first_binding_does_not_ask_again() {
        let (fake, uplink, addr) = held_elsewhere();
        let (mut rx, h) = start_checked(&fake, &uplink, addr, None);
        wait_for(&mut rx, State::Bound).await;
        assert!(uplink.probes.lock().unwrap().is_empty());
        assert_eq!(fake.0.lock().unwrap().configured, vec![addr]);
        h.abort();
    }

    impl AddressConfig for Fake {
        async fn add(&self, addr: Ipv4Addr, lifetime: Option<u32>) -> Result<(), LinkError> {
            let mut w = self.0.lock().unwrap();
            w.configured.retain(|a| *a != addr);
            w.configured.push(addr);
            w.lifetimes.push(lifetime);
            Ok(())
        }
        async fn refresh(&self, addr: Ipv4Addr, lifetime: u32) -> Result<bool, LinkError> {
            let mut w = self.0.lock().unwrap();
            let there = w.configured.contains(&addr);
            if there {
                w.lifetimes.push(Some(lifetime));
            }
            Ok(there)
        }
        async fn remove(&self, addr: Ipv4Addr) -> Result<(), LinkError> {
            self.0.lock().unwrap().configured.retain(|a| *a != addr);
            Ok(())
        }
    }

    fn start(
        fake: &Fake,
        store: Option<Store>,
        stored: Option<Lease>,
    ) -> (
        watch::Receiver<LeaseStatus>,
        mpsc::Sender<Command>,
        tokio::task::JoinHandle<()>,
    ) {
        let timing = Timing {
            renew_floor: Duration::from_secs(1),
            ..Timing::default()
        };
        start_with(fake, store, stored, timing)
    }

    fn start_with(
        fake: &Fake,
        store: Option<Store>,
        stored: Option<Lease>,
        timing: Timing,
    ) -> (
        watch::Receiver<LeaseStatus>,
        mpsc::Sender<Command>,
        tokio::task::JoinHandle<()>,
    ) {
        let m = Machine::new(Identity::new(MAC), timing, 1);
        let (d, rx) = Driver::new("vip-test", m, fake.clone(), fake.clone(), store);
        let (tx, crx) = mpsc::channel(4);
        let h = tokio::spawn(d.run(stored.into(), crx));
        (rx, tx, h)
    }

    /// Waits (at most 10 virtual minutes, so a wrong expectation fails
    /// instead of spinning the paused clock) for a status matching `f`.
    async fn until(
        rx: &mut watch::Receiver<LeaseStatus>,
        f: impl FnMut(&LeaseStatus) -> bool,
    ) -> LeaseStatus {
        tokio::time::timeout(Duration::from_secs(600), rx.wait_for(f))
            .await
            .expect("status not reached within 10 minutes")
            .unwrap()
            .clone()
    }

    async fn wait_for(rx: &mut watch::Receiver<LeaseStatus>, state: State) -> LeaseStatus {
        until(rx, |s| s.state == state).await
    }

    /// Issue #20: the address is configured with its lifetime and confirmed
    /// four times per lifetime; once the kernel has deleted it (the process
    /// did not run for that long), it is not put back: the lease is
    /// EXPIRED, nothing more is sent, and a release still frees it at the
    /// server.
    /// The CI soak: a renewal's ACK, handled when the task runs again
    /// after its address's lifetime ran out (the kernel removed it), must
    /// not put the address back: the lease ends EXPIRED, as when the
    /// lifetime's confirmation finds it gone.
    #[tokio::test(start_paused = true)]
    async fn a_renewal_does_not_put_back_an_address_the_kernel_let_expire() {
        let fake = Fake::default();
        let addr = Ipv4Addr::new(10, 77, 0, 152);
        fake.0.lock().unwrap().addr = Some(addr);
        // Confirmed every 15 s; T1 comes 20 s after the binding, before
        // the second confirmation.
        let timing = Timing {
            renew_floor: Duration::from_secs(1),
            address_lifetime: Some(Duration::from_secs(60)),
            ..Timing::default()
        };
        let (mut rx, _tx, _h) = start_with(&fake, None, None, timing);
        wait_for(&mut rx, State::Bound).await;
        tokio::time::sleep(Duration::from_secs(16)).await;
        // The kernel removed it meanwhile.
        fake.0.lock().unwrap().configured.clear();
        let st = wait_for(&mut rx, State::Expired).await;
        assert!(
            st.transitions.iter().any(|t| t.state == State::Renewing),
            "expired by the renewal, not by a confirmation: {:?}",
            st.transitions
        );
        let w = fake.0.lock().unwrap();
        assert!(w.configured.is_empty(), "put back: {:?}", w.configured);
    }

    #[tokio::test(start_paused = true)]
    async fn an_address_the_kernel_let_expire_is_not_put_back() {
        let fake = Fake::default();
        let addr = Ipv4Addr::new(10, 77, 0, 150);
        fake.0.lock().unwrap().addr = Some(addr);
        let timing = Timing {
            renew_floor: Duration::from_secs(1),
            address_lifetime: Some(Duration::from_millis(1500)),
            ..Timing::default()
        };
        let (mut rx, tx, h) = start_with(&fake, None, None, timing);
        wait_for(&mut rx, State::Bound).await;
        assert_eq!(
            fake.0.lock().unwrap().lifetimes,
            vec![Some(2)],
            "rounded up to whole seconds"
        );
        // A lifetime later, it has been confirmed at least three times.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let confirmed = fake.0.lock().unwrap().lifetimes.len() - 1;
        assert!(
            confirmed >= 3,
            "confirmed {confirmed} times in one lifetime"
        );
        assert_eq!(rx.borrow().state, State::Bound);

        // The kernel deleted it.
        let sent_before = {
            let mut w = fake.0.lock().unwrap();
            w.configured.clear();
            w.sent.len()
        };
        let st = wait_for(&mut rx, State::Expired).await;
        assert!(st.last_error.unwrap().contains("expired"));
        tokio::time::sleep(Duration::from_secs(3600)).await;
        {
            let w = fake.0.lock().unwrap();
            assert!(w.configured.is_empty(), "put back: {:?}", w.configured);
            assert_eq!(
                w.sent.len(),
                sent_before,
                "sent after expiry: {:?}",
                &w.sent[sent_before..]
            );
        }
        assert_eq!(rx.borrow().state, State::Expired);

        let (done_tx, done_rx) = oneshot::channel();
        tx.send(Command::Stop(StopMode::Release, done_tx))
            .await
            .unwrap();
        done_rx.await.unwrap();
        h.await.unwrap();
        let w = fake.0.lock().unwrap();
        assert_eq!(w.sent.last().map(|s| s.0), Some(MessageType::Release));
        assert!(w.configured.is_empty());
    }

    /// Opens a FIFO's reading end without waiting when dropped, so a
    /// writer blocked on it goes on even when the test fails first.
    struct Unblock(std::path::PathBuf);

    impl Drop for Unblock {
        fn drop(&mut self) {
            use std::os::unix::fs::OpenOptionsExt as _;
            let _ = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NONBLOCK)
                .open(&self.0);
        }
    }

    /// Issue #29: the lease file's save (two fsyncs) is held up by the
    /// disk, and the address's lifetime is confirmed on time all the
    /// while; the save's failure, once the disk answers, is reported.
    /// Real time: a write blocked in a thread stops the paused clock.
    #[tokio::test]
    async fn a_stalled_lease_file_write_does_not_hold_up_the_address() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        // The save opens its temporary file first: a FIFO there blocks
        // that open until somebody reads, as a stalled disk would.
        let fifo = store.dir().join(".vip-test.json.tmp");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let unblock = Unblock(fifo.clone());
        let fake = Fake::default();
        fake.0.lock().unwrap().addr = Some(Ipv4Addr::new(10, 77, 0, 150));
        let timing = Timing {
            renew_floor: Duration::from_secs(1),
            address_lifetime: Some(Duration::from_secs(1)),
            ..Timing::default()
        };
        let (mut rx, tx, h) = start_with(&fake, Some(store.clone()), None, timing);
        let deadline = Duration::from_secs(10);
        tokio::time::timeout(deadline, rx.wait_for(|s| s.state == State::Bound))
            .await
            .expect("BOUND while the lease file's save is stalled")
            .unwrap();
        let at_bound = fake.0.lock().unwrap().lifetimes.len();
        // Two lifetimes' worth of confirmations (every 250 ms).
        tokio::time::timeout(deadline, async {
            while fake.0.lock().unwrap().lifetimes.len() < at_bound + 8 {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await
        .expect("the lifetime is confirmed while the save is stalled");
        assert!(
            !store.path("vip-test").exists(),
            "the save went through: the stall did not hold"
        );
        assert_eq!(rx.borrow().state, State::Bound);

        // The disk answers: the save fails (a FIFO has no fsync), and says so.
        let reader = tokio::task::spawn_blocking(move || std::fs::read(&fifo));
        tokio::time::timeout(
            deadline,
            rx.wait_for(|s| s.last_error.as_deref().is_some_and(|e| e.contains("fsync"))),
        )
        .await
        .expect("the failed save is reported")
        .unwrap();
        reader.await.unwrap().unwrap();
        drop(unblock);
        let (done_tx, done_rx) = oneshot::channel();
        tx.send(Command::Stop(StopMode::Handover, done_tx))
            .await
            .unwrap();
        done_rx.await.unwrap();
        h.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn acquires_renews_and_persists() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let fake = Fake::default();
        fake.0.lock().unwrap().addr = Some(Ipv4Addr::new(10, 77, 0, 150));
        let (mut rx, tx, h) = start(&fake, Some(store.clone()), None);
        let st = wait_for(&mut rx, State::Bound).await;
        assert_eq!(st.address, Some(Ipv4Addr::new(10, 77, 0, 150)));
        assert_eq!(st.server, Some(SRV));
        assert_eq!(
            st.server_mac.as_deref(),
            Some(crate::mac::format(&SRV_MAC).as_str()),
            "the server's replies came from its MAC"
        );
        assert_eq!(st.t1_secs, Some(20.0));
        let states: Vec<_> = st.transitions.iter().map(|t| t.state).collect();
        assert_eq!(
            states,
            vec![
                State::Selecting,
                State::Requesting,
                State::Checking,
                State::Bound
            ]
        );
        assert_eq!(
            fake.0.lock().unwrap().configured,
            vec![Ipv4Addr::new(10, 77, 0, 150)]
        );
        // Saved by a task of its own, soon after.
        tokio::time::timeout(Duration::from_secs(10), async {
            while store.load("vip-test").unwrap().is_none() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the lease file is saved");

        // T1: unicast renewal to the server's MAC, from the lease address.
        // RENEWING lasts no time against this server: look at the history.
        let t0 = Instant::now();
        until(&mut rx, |s| {
            s.state == State::Bound && s.transitions.iter().any(|t| t.state == State::Renewing)
        })
        .await;
        let waited = Instant::now() - t0;
        assert!(waited >= Duration::from_millis(19_000), "{waited:?}");
        let sent = fake.0.lock().unwrap().sent.clone();
        assert_eq!(
            sent.last().unwrap(),
            &(
                MessageType::Request,
                Ipv4Addr::new(10, 77, 0, 150),
                Destination::Unicast {
                    ip: SRV,
                    mac: SRV_MAC
                }
            )
        );

        let (done_tx, done_rx) = oneshot::channel();
        tx.send(Command::Stop(StopMode::Release, done_tx))
            .await
            .unwrap();
        done_rx.await.unwrap();
        h.await.unwrap();
        assert!(fake.0.lock().unwrap().configured.is_empty());
        assert_eq!(
            fake.0.lock().unwrap().sent.last().unwrap().0,
            MessageType::Release
        );
        assert!(store.load("vip-test").unwrap().is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn server_down_rebinds_then_keeps_the_address_when_back() {
        let fake = Fake::default();
        fake.0.lock().unwrap().addr = Some(Ipv4Addr::new(10, 77, 0, 151));
        let (mut rx, tx, h) = start(&fake, None, None);
        wait_for(&mut rx, State::Bound).await;
        fake.0.lock().unwrap().down = true;
        wait_for(&mut rx, State::Rebinding).await;
        fake.0.lock().unwrap().down = false;
        let st = wait_for(&mut rx, State::Bound).await;
        assert_eq!(st.address, Some(Ipv4Addr::new(10, 77, 0, 151)));
        // The rebinding ACK came from a broadcast REQUEST.
        let sent = fake.0.lock().unwrap().sent.clone();
        assert_eq!(sent.last().unwrap().2, Destination::Broadcast);
        drop(tx);
        h.await.unwrap();
        // A dropped handle is a handover: address removed, no RELEASE.
        assert!(fake.0.lock().unwrap().configured.is_empty());
        assert_ne!(
            fake.0.lock().unwrap().sent.last().unwrap().0,
            MessageType::Release
        );
    }

    #[tokio::test(start_paused = true)]
    async fn server_gone_past_expiry_removes_the_address() {
        let fake = Fake::default();
        fake.0.lock().unwrap().addr = Some(Ipv4Addr::new(10, 77, 0, 152));
        let (mut rx, _tx, _h) = start(&fake, None, None);
        let bound = wait_for(&mut rx, State::Bound).await;
        fake.0.lock().unwrap().down = true;
        let t0 = Instant::now();
        wait_for(&mut rx, State::Selecting).await;
        let waited = Instant::now() - t0;
        assert!(
            waited >= Duration::from_secs(119) && waited <= Duration::from_secs(121),
            "{waited:?} {bound:?}"
        );
        assert!(fake.0.lock().unwrap().configured.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn nak_on_renew_reacquires() {
        let fake = Fake::default();
        fake.0.lock().unwrap().addr = Some(Ipv4Addr::new(10, 77, 0, 153));
        let (mut rx, _tx, _h) = start(&fake, None, None);
        wait_for(&mut rx, State::Bound).await;
        {
            let mut w = fake.0.lock().unwrap();
            w.nak_renew = true;
            w.addr = Some(Ipv4Addr::new(10, 77, 0, 160));
        }
        until(&mut rx, |s| s.counters.naks == 1).await;
        fake.0.lock().unwrap().nak_renew = false;
        let st = until(&mut rx, |s| {
            s.state == State::Bound && s.address == Some(Ipv4Addr::new(10, 77, 0, 160))
        })
        .await;
        assert_eq!(st.counters.naks, 1);
        assert_eq!(
            fake.0.lock().unwrap().configured,
            vec![Ipv4Addr::new(10, 77, 0, 160)]
        );
    }
}
