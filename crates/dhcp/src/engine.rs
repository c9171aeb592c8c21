//! Many leases in one process: each on its own macvlan with its own MAC,
//! client identifier and packet socket, driven by its own task.
//!
//! The lease table holds a name from the moment a start or stop of it
//! begins until that operation has finished, so two operations on one name
//! never interleave: a second start while the first is under way gets
//! [`EngineError::Exists`], a start while a stop is under way waits for the
//! stop (which deletes the link) and then makes its own. Starts and stops
//! run in their own tasks: a caller that stops waiting (a timeout, a
//! dropped reconcile) cannot leave a half-made lease or a held name behind.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

use std::net::Ipv4Addr;

use super::driver::{AcquiredHook, Begin, Command, Driver, LeaseStatus, probe_through};
use super::io::{ProbeConfig, Transport};
// The trait and the types of its surface live with the trait; the engine
// implements it (no import back from there).
pub use super::lease_engine::{EngineError, LeaseConfig, Presence};
use super::lease_engine::{LeaseEngine, SweepReport};
use super::link::{Ensured, Ipv4Conf, LinkError, LinkInfo, Links, Netlink};
use super::machine::{Machine, StopMode};
use super::store::{Store, StoreError, validate_name};

struct Running {
    cmds: mpsc::Sender<Command>,
    status: watch::Receiver<LeaseStatus>,
    task: JoinHandle<()>,
}

impl Running {
    /// Stops the driver: it removes the address and, for `Release`, sends
    /// DHCPRELEASE and deletes the lease file.
    async fn shut_down(self, mode: StopMode) {
        let (done_tx, done_rx) = oneshot::channel();
        if self.cmds.send(Command::Stop(mode, done_tx)).await.is_ok() {
            let _ = done_rx.await;
        }
        let _ = self.task.await;
    }
}

enum Slot {
    /// A start is under way.
    Starting(Settled),
    Running(Running),
    /// A stop, or a clean-up of a left-behind link, is under way.
    Stopping(Settled),
}

/// Resolves once the operation holding a slot has finished: its sender
/// lives in that operation's [`Claim`] and is dropped with it.
#[derive(Clone)]
struct Settled(watch::Receiver<()>);

impl Settled {
    async fn wait(mut self) {
        // Err means the sender is gone: the operation has finished.
        while self.0.changed().await.is_ok() {}
    }
}

type Table = Arc<Mutex<BTreeMap<String, Slot>>>;

fn lock(table: &Table) -> MutexGuard<'_, BTreeMap<String, Slot>> {
    // The table is consistent after every statement that holds the lock,
    // so a panic elsewhere cannot have left it half-changed.
    table.lock().unwrap_or_else(PoisonError::into_inner)
}

/// An operation's hold on a name. Dropped, it puts the lease it was
/// given with [`Claim::commit`] into the table, or else frees the name;
/// either way, then it wakes whoever waits for the name.
struct Claim {
    table: Table,
    name: String,
    then: Option<Running>,
    _settled: watch::Sender<()>,
}

impl Claim {
    /// Puts `slot` for `name` into `map`, the table behind `table` that the
    /// caller has locked: checking and taking a name happen under one lock.
    fn take(
        table: &Table,
        map: &mut BTreeMap<String, Slot>,
        name: &str,
        slot: fn(Settled) -> Slot,
    ) -> Claim {
        let (tx, rx) = watch::channel(());
        map.insert(name.to_string(), slot(Settled(rx)));
        Claim {
            table: table.clone(),
            name: name.to_string(),
            then: None,
            _settled: tx,
        }
    }

    fn commit(mut self, running: Running) {
        self.then = Some(running);
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        let mut table = lock(&self.table);
        match self.then.take() {
            Some(running) => table.insert(self.name.clone(), Slot::Running(running)),
            None => table.remove(&self.name),
        };
    }
}

/// The lease table. `L` is the kernel edge: [`Netlink`] in the daemon, a
/// fake in unit tests.
pub struct Engine<L: Links = Netlink> {
    links: L,
    store: Option<Store>,
    table: Table,
    /// `Some` when the engine sets the IPv4 settings of its links and
    /// their uplinks ([`Engine::tuning_ipv4`]): the uplinks already logged.
    tuned: Option<Tuned>,
    on_acquired: Option<AcquiredHook>,
}

/// The uplinks whose IPv4 settings were changed (logged once each).
type Tuned = Arc<Mutex<BTreeSet<String>>>;

impl Engine<Netlink> {
    /// `store`: where lease files live; `None` for throwaway leases
    /// (`dhcp-probe`). Must be called inside a tokio runtime.
    pub fn new(store: Option<Store>) -> Result<Engine, EngineError> {
        let nl = Netlink::connect().map_err(|source| EngineError::Link {
            name: "netlink".into(),
            source,
        })?;
        Ok(Engine::with_links(nl, store))
    }

    pub(crate) fn netlink(&self) -> &Netlink {
        &self.links
    }
}

impl<L: Links> Engine<L> {
    pub(crate) fn with_links(links: L, store: Option<Store>) -> Engine<L> {
        Engine {
            links,
            store,
            table: Arc::new(Mutex::new(BTreeMap::new())),
            tuned: None,
            on_acquired: None,
        }
    }

    /// Every lease started from now on tells `hook` of its acquisitions.
    pub fn on_acquired(mut self, hook: AcquiredHook) -> Self {
        self.on_acquired = Some(hook);
        self
    }

    /// Every start also applies `Ipv4Conf::VIP_LINK` to the lease's
    /// macvlan and `Ipv4Conf::UPLINK` to its uplink (only to those: no
    /// other interface is touched). The daemon's engine does; `dhcp-probe`,
    /// a throwaway lease, leaves the node's settings alone.
    pub fn tuning_ipv4(mut self) -> Self {
        self.tuned = Some(Arc::default());
        self
    }

    /// Makes (or reuses, see `Netlink::ensure_macvlan`) the macvlan,
    /// opens its packet socket and starts the lease: adopted (BOUND, no
    /// message sent) when a lease file for the same MAC holds a lease that
    /// is still valid and the reused link still carries its address (a
    /// restart or `kill -9` of the daemon); in INIT-REBOOT when such a file
    /// exists otherwise, or for `requested_ip` without one. `Exists` while another start of
    /// the name is under way or its lease runs; waits for a stop of it
    /// under way. When the start fails after making the link, the link is
    /// deleted again; a reused link is left as it was.
    pub async fn start(
        &self,
        cfg: LeaseConfig,
    ) -> Result<watch::Receiver<LeaseStatus>, EngineError> {
        let name = cfg.interface.clone();
        validate_name(&name)?;
        // The name is taken before the first await: no second start can
        // pass this point for it until this one has finished.
        let claim = loop {
            let stopping = {
                let mut table = lock(&self.table);
                match table.get(&name) {
                    None => break Claim::take(&self.table, &mut table, &name, Slot::Starting),
                    Some(Slot::Stopping(s)) => s.clone(),
                    Some(Slot::Starting(_) | Slot::Running(_)) => {
                        return Err(EngineError::Exists(name));
                    }
                }
            };
            stopping.wait().await;
        };
        let work = bring_up(
            self.links.clone(),
            self.store.clone(),
            self.tuned.clone(),
            self.on_acquired.clone(),
            cfg,
            claim,
        );
        let started = finish(&name, tokio::spawn(work)).await?;
        self.prune_lease_files().await;
        started
    }

    /// Removes lease files that handovers left and whose lease ran out
    /// ([`Store::prune_expired`]); the running and starting ones are kept.
    async fn prune_lease_files(&self) {
        let Some(store) = self.store.clone() else {
            return;
        };
        let in_use: std::collections::BTreeSet<String> =
            lock(&self.table).keys().cloned().collect();
        let pruned = tokio::task::spawn_blocking(move || {
            store.prune_expired(&in_use, std::time::SystemTime::now())
        })
        .await;
        match pruned {
            Ok(Ok(names)) if !names.is_empty() => {
                tracing::info!(leases = ?names, "removed lease files whose lease ran out after a handover");
            }
            Ok(Ok(_)) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "pruning lease files"),
            Err(e) => tracing::warn!(error = %e, "pruning lease files"),
        }
    }

    /// Stops a lease and deletes its macvlan. `Release` sends DHCPRELEASE
    /// and deletes the lease file; `Handover` does neither. Waits for a
    /// start of the name under way and then stops what it started.
    pub async fn stop(&self, name: &str, mode: StopMode) -> Result<(), EngineError> {
        let (running, claim) = loop {
            let busy = {
                let mut table = lock(&self.table);
                if let Some(Slot::Starting(s) | Slot::Stopping(s)) = table.get(name) {
                    s.clone()
                } else {
                    match table.remove(name) {
                        Some(Slot::Running(running)) => {
                            let claim = Claim::take(&self.table, &mut table, name, Slot::Stopping);
                            break (running, claim);
                        }
                        _ => return Err(EngineError::Unknown(name.into())),
                    }
                }
            };
            busy.wait().await;
        };
        let links = self.links.clone();
        let work = async move {
            running.shut_down(mode).await;
            let deleted = links.delete(&claim.name).await;
            // The name is free only once the link is gone.
            drop(claim);
            deleted
        };
        let stopped = finish(name, tokio::spawn(work))
            .await?
            .map_err(|source| EngineError::Link {
                name: name.into(),
                source,
            });
        self.prune_lease_files().await;
        stopped
    }

    /// Ends every lease without touching the LAN: each address stays on
    /// its link for `keep_for` more (its lifetime set to that, when it has
    /// one), nothing is sent, lease files are kept, the links stay. For a
    /// daemon that restarts: its next run adopts them. Starts under way
    /// are waited for.
    pub(crate) async fn detach_all(&self, keep_for: Duration) -> Vec<EngineError> {
        let names: Vec<String> = lock(&self.table).keys().cloned().collect();
        let mut errors = Vec::new();
        for name in names {
            let running = loop {
                let busy = {
                    let mut table = lock(&self.table);
                    match table.get(&name) {
                        Some(Slot::Starting(s) | Slot::Stopping(s)) => s.clone(),
                        Some(Slot::Running(_)) => match table.remove(&name) {
                            Some(Slot::Running(r)) => break Some(r),
                            _ => unreachable!("looked at under the same lock"),
                        },
                        None => break None,
                    }
                };
                busy.wait().await;
            };
            let Some(running) = running else { continue };
            let (done_tx, done_rx) = oneshot::channel();
            if running
                .cmds
                .send(Command::Detach(keep_for, done_tx))
                .await
                .is_err()
                || done_rx.await.is_err()
            {
                errors.push(EngineError::Unknown(name.clone()));
            }
            let _ = running.task.await;
        }
        errors
    }

    /// Stops every lease, all at once: a daemon stopping (or handing over)
    /// a hundred addresses should not take a hundred link deletions in a
    /// row. Starts under way are waited for and stopped too.
    pub async fn stop_all(&self, mode: StopMode) -> Vec<EngineError> {
        let names: Vec<String> = lock(&self.table).keys().cloned().collect();
        futures::future::join_all(names.iter().map(|n| self.stop(n, mode)))
            .await
            .into_iter()
            .filter_map(Result::err)
            // Gone meanwhile (a start that failed, a stop by someone else).
            .filter(|e| !matches!(e, EngineError::Unknown(_)))
            .collect()
    }

    /// See [`LeaseEngine::answered`]: an RFC 5227 probe on the uplink
    /// itself. Any ARP naming `addr` as its sender from another MAC (a
    /// reply, an announcement) or another host's probe for it counts.
    pub(crate) async fn answered(
        &self,
        parent: &str,
        addr: Ipv4Addr,
        witness: Option<Ipv4Addr>,
        probe: ProbeConfig,
    ) -> Result<bool, EngineError> {
        let uplink = self.uplink(parent).await?;
        let transport = uplink.open(probe)?;
        let Some(witness) = witness else {
            return transport.arp_probe(addr).await.map_err(|e| uplink.error(e));
        };
        let asker = uplink.open(probe)?;
        let (answered, heard) = futures::join!(
            transport.arp_probe(addr),
            asker.arp_ask(witness, uplink.sender)
        );
        match (
            answered.map_err(|e| uplink.error(e))?,
            heard.map_err(|e| uplink.error(e))?,
        ) {
            (true, _) => Ok(true),
            (false, true) => Ok(false),
            (false, false) => Err(EngineError::Deaf {
                name: parent.to_string(),
                witness,
            }),
        }
    }

    /// See [`LeaseEngine::hears`].
    pub(crate) async fn hears(
        &self,
        parent: &str,
        witness: Ipv4Addr,
        probe: ProbeConfig,
    ) -> Result<bool, EngineError> {
        let uplink = self.uplink(parent).await?;
        uplink
            .open(probe)?
            .arp_ask(witness, uplink.sender)
            .await
            .map_err(|e| uplink.error(e))
    }

    /// `parent`'s index, MAC and first address, to ask its LAN from.
    async fn uplink<'a>(&'a self, parent: &'a str) -> Result<Uplink<'a, L>, EngineError> {
        let link_err = |source| EngineError::Link {
            name: parent.to_string(),
            source,
        };
        let link = self
            .links
            .link(parent)
            .await
            .map_err(link_err)?
            .ok_or_else(|| link_err(LinkError::NotFound(parent.to_string())))?;
        let mac = link.mac.ok_or_else(|| EngineError::Socket {
            name: parent.to_string(),
            source: std::io::Error::other(format!("{parent} has no MAC address")),
        })?;
        let sender = self
            .links
            .addresses(link.index)
            .await
            .ok()
            .and_then(|a| a.into_iter().next())
            .unwrap_or(Ipv4Addr::UNSPECIFIED);
        Ok(Uplink {
            links: &self.links,
            name: parent,
            index: link.index,
            mac,
            sender,
        })
    }

    /// Gratuitous ARP for a lease now (takeover).
    pub(crate) async fn announce(&self, name: &str) -> Result<(), EngineError> {
        let tx = match lock(&self.table).get(name) {
            Some(Slot::Running(r)) => r.cmds.clone(),
            _ => return Err(EngineError::Unknown(name.into())),
        };
        let _ = tx.send(Command::Announce).await;
        Ok(())
    }

    /// Takes `name` for a clean-up when nothing else holds it; a start of
    /// it meanwhile waits as for a stop.
    fn claim_if_free(&self, name: &str) -> Option<Claim> {
        let mut table = lock(&self.table);
        if table.contains_key(name) {
            return None;
        }
        Some(Claim::take(&self.table, &mut table, name, Slot::Stopping))
    }

    /// Deletes every macvlan named `prefix...` that is not in `keep` and
    /// not held by a lease of this engine, without DHCPRELEASE (lease files
    /// stay). Links of other kinds are never touched, whatever their name.
    pub(crate) async fn sweep(&self, prefix: &str, keep: &BTreeSet<String>) -> SweepReport {
        let mut report = SweepReport::default();
        let links = match self.links.links().await {
            Ok(l) => l,
            Err(e) => {
                report.problems.push(e.to_string());
                return report;
            }
        };
        for link in links {
            if !link.macvlan || !link.name.starts_with(prefix) || keep.contains(&link.name) {
                continue;
            }
            let Some(_claim) = self.claim_if_free(&link.name) else {
                continue;
            };
            match self.links.delete(&link.name).await {
                Ok(()) => report.removed.push(link.name),
                Err(e) => report.problems.push(format!("{}: {e}", link.name)),
            }
        }
        report
    }

    /// Every running lease's current status, by name.
    pub fn snapshot(&self) -> Vec<LeaseStatus> {
        lock(&self.table)
            .values()
            .filter_map(|slot| match slot {
                Slot::Running(r) => Some(r.status.borrow().clone()),
                _ => None,
            })
            .collect()
    }
}

/// Waits for an operation's task; a panic in it is a bug and goes on to
/// the caller.
async fn finish<T>(name: &str, task: JoinHandle<T>) -> Result<T, EngineError> {
    match task.await {
        Ok(t) => Ok(t),
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => Err(EngineError::Aborted(name.into())),
    }
}

/// The body of [`Engine::start`], with the name already claimed.
async fn bring_up<L: Links>(
    links: L,
    store: Option<Store>,
    tuned: Option<Tuned>,
    on_acquired: Option<AcquiredHook>,
    cfg: LeaseConfig,
    claim: Claim,
) -> Result<watch::Receiver<LeaseStatus>, EngineError> {
    let name = cfg.interface.clone();
    // Read before the kernel is touched: an unreadable lease file fails
    // the start with nothing to undo.
    let stored = match &store {
        Some(s) => stored_lease(s, &name, cfg.identity.mac)?,
        None => None,
    };
    // The uplink first and the macvlan before it goes up: a link that is
    // up with the kernel's default ARP settings answers for every address
    // of the node, other Services' included, beside their holders.
    if let Some(tuned) = &tuned {
        tune_uplink(&links, tuned, &cfg.parent).await;
    }
    let link = links
        .ensure_macvlan(
            &name,
            &cfg.parent,
            cfg.identity.mac,
            tuned.is_some().then_some(Ipv4Conf::VIP_LINK),
        )
        .await
        .map_err(|source| EngineError::Link {
            name: name.clone(),
            source,
        })?;
    let begin = match stored {
        Some(lease) if adoptable(&links, link, &lease).await => Begin::Adopt(lease),
        other => Begin::from(other),
    };
    // The uplink as it is now: the lease's LAN watch listens there, and a
    // late first binding asks the LAN from it (below).
    let uplink_now = links.link(&cfg.parent).await;
    let uplink_index = match &uplink_now {
        Ok(Some(info)) => Some(info.index),
        _ => None,
    };
    let transport = match links.open(link.index(), uplink_index, cfg.identity.mac, cfg.probe) {
        Ok(t) => t,
        Err(source) => {
            undo(&links, &name, link).await;
            return Err(EngineError::Socket { name, source });
        }
    };
    let machine =
        Machine::new(cfg.identity, cfg.timing, fastrand::u64(..)).requesting(cfg.requested_ip);
    let addrs = links.addrs(&name, link.index());
    let (driver, status) = Driver::new(&name, machine, transport, addrs, store);
    let presence = presence_every(&links, cfg.presence, &cfg.parent);
    if let Some(every) = presence {
        tracing::debug!(lease = %name, parent = %cfg.parent, every = ?every, "presence frames on");
    }
    let driver = driver
        .guarded_at(cfg.guarded_at)
        .on_acquired(on_acquired)
        .presence(presence);
    // The uplink as it is now: a late first binding asks the LAN from it
    // (`GUARD_FRESH`); an uplink replaced meanwhile cannot be asked, and
    // then nothing is configured.
    let driver = driver.with_uplink_check(uplink_check(&links, uplink_now, cfg.probe, cfg.witness));
    let (tx, rx) = mpsc::channel(4);
    let task = tokio::spawn(driver.run(begin, rx));
    claim.commit(Running {
        cmds: tx,
        status: status.clone(),
        task,
    });
    Ok(status)
}

/// The lease stored for `name` under `mac`, if any; a file that cannot be
/// read (half-written by a crash or edited by hand) is set aside, since
/// failing every start would block the Service forever: it starts afresh.
fn stored_lease(
    s: &Store,
    name: &str,
    mac: [u8; 6],
) -> Result<Option<super::machine::Lease>, EngineError> {
    match s.load(name) {
        Ok(r) => Ok(r.filter(|r| r.identity.mac == mac).map(|r| r.to_lease())),
        Err(StoreError::Corrupt { path, source }) => {
            let aside = s.set_aside(name)?;
            tracing::warn!(lease = %name, file = %path.display(), error = %source, kept = %aside.display(), "the lease file cannot be read; set aside, the lease starts afresh");
            Ok(None)
        }
        Err(e) => Err(e.into()),
    }
}

/// How often the lease sends presence frames, if at all.
fn presence_every<L: Links>(links: &L, presence: Presence, parent: &str) -> Option<Duration> {
    match presence {
        Presence::Off => None,
        Presence::Every(every) => Some(every),
        Presence::WhereTheNicIsSilent(every) => {
            links.silent_after_migration(parent).then_some(every)
        }
    }
}

/// How a late first binding asks the LAN, from the uplink as it is now
/// (`GUARD_FRESH`): through a witness when there is one, so a deaf node
/// is told from a free address; an uplink replaced meanwhile cannot be
/// asked, and then nothing is configured.
// Nested deep only by its shape: a boxed closure returning a boxed future.
fn uplink_check<L: Links>(
    links: &L,
    uplink_now: Result<Option<LinkInfo>, LinkError>,
    probe: ProbeConfig,
    witness: Option<Ipv4Addr>,
) -> super::driver::UplinkProbe {
    match uplink_now {
        Ok(Some(LinkInfo {
            index,
            mac: Some(mac),
            ..
        })) => {
            let links = links.clone();
            match witness {
                None => probe_through(move || links.open(index, None, mac, probe)),
                Some(witness) => Box::new(move |addr| {
                    let links = links.clone();
                    Box::pin(async move {
                        let transport = links.open(index, None, mac, probe)?;
                        if transport.arp_probe(addr).await? {
                            return Ok(true);
                        }
                        let sender = links
                            .addresses(index)
                            .await
                            .ok()
                            .and_then(|a| a.into_iter().next())
                            .unwrap_or(Ipv4Addr::UNSPECIFIED);
                        if links
                            .open(index, None, mac, probe)?
                            .arp_ask(witness, sender)
                            .await?
                        {
                            Ok(false)
                        } else {
                            Err(std::io::Error::other(format!(
                                "nothing answers on the uplink's LAN, not even {witness}"
                            )))
                        }
                    })
                }),
            }
        }
        _ => Box::new(|_| {
            Box::pin(async {
                Err(std::io::Error::other(
                    "the uplink was not found at the start",
                ))
            })
        }),
    }
}

/// A stored lease can be resumed without a DHCP exchange when the link was
/// there before this start (a restart left it), the lease has not expired
/// and the address is still on the link: nothing on the wire changed.
async fn adoptable<L: Links>(links: &L, link: Ensured, lease: &super::machine::Lease) -> bool {
    if link.created() || lease.expires_at() <= tokio::time::Instant::now() {
        return false;
    }
    match links.addresses(link.index()).await {
        Ok(addrs) => addrs.contains(&lease.address),
        Err(e) => {
            tracing::warn!(error = %e, "cannot list the addresses of a reused macvlan; starting in INIT-REBOOT");
            false
        }
    }
}

/// Applies the uplink's IPv4 settings ([`Ipv4Conf::UPLINK`]). A failure is
/// logged and the start goes on: the address still works, with the caveat
/// the settings exist for. The macvlan's own are applied by
/// [`Links::ensure_macvlan`] before it goes up, and a failure there fails
/// the start.
async fn tune_uplink<L: Links>(links: &L, tuned: &Tuned, parent: &str) {
    match links.set_ipv4_conf(parent, Ipv4Conf::UPLINK).await {
        Ok(()) => {
            if lock_tuned(tuned).insert(parent.to_string()) {
                tracing::info!(
                    uplink = %parent,
                    "set arp_ignore=1 and arp_announce=2 on the uplink, so that it does not answer ARP for LoadBalancer addresses with its own MAC"
                );
            }
        }
        Err(e) => {
            tracing::warn!(uplink = %parent, error = %e, "could not set arp_ignore=1, arp_announce=2 on the uplink: it may answer ARP for LoadBalancer addresses with its own MAC")
        }
    }
}

fn lock_tuned(t: &Tuned) -> MutexGuard<'_, BTreeSet<String>> {
    t.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Deletes a link this start made; a reused one stays.
async fn undo<L: Links>(links: &L, name: &str, link: Ensured) {
    if !link.created() {
        return;
    }
    if let Err(e) = links.delete(name).await {
        tracing::warn!(lease = %name, "could not delete the macvlan of a failed start: {e}");
    }
}

/// An uplink to ask the LAN from ([`Engine::answered`], [`Engine::hears`]).
struct Uplink<'a, L: Links> {
    links: &'a L,
    name: &'a str,
    index: u32,
    mac: [u8; 6],
    /// Its own address (unspecified when it has none).
    sender: Ipv4Addr,
}

impl<L: Links> Uplink<'_, L> {
    fn open(&self, probe: ProbeConfig) -> Result<L::Transport, EngineError> {
        self.links
            .open(self.index, None, self.mac, probe)
            .map_err(|e| self.error(e))
    }

    fn error(&self, source: std::io::Error) -> EngineError {
        EngineError::Socket {
            name: self.name.to_string(),
            source,
        }
    }
}

impl<L: Links> LeaseEngine for Engine<L> {
    async fn start(&self, cfg: LeaseConfig) -> Result<watch::Receiver<LeaseStatus>, EngineError> {
        Engine::start(self, cfg).await
    }

    async fn stop(&self, name: &str, mode: StopMode) -> Result<(), EngineError> {
        Engine::stop(self, name, mode).await
    }

    async fn announce(&self, name: &str) -> Result<(), EngineError> {
        Engine::announce(self, name).await
    }

    async fn answered(
        &self,
        parent: &str,
        addr: Ipv4Addr,
        witness: Option<Ipv4Addr>,
        probe: ProbeConfig,
    ) -> Result<bool, EngineError> {
        Engine::answered(self, parent, addr, witness, probe).await
    }

    async fn hears(
        &self,
        parent: &str,
        witness: Ipv4Addr,
        probe: ProbeConfig,
    ) -> Result<bool, EngineError> {
        Engine::hears(self, parent, witness, probe).await
    }

    fn snapshot(&self) -> Vec<LeaseStatus> {
        Engine::snapshot(self)
    }

    async fn sweep(&self, prefix: &str, keep: &BTreeSet<String>) -> SweepReport {
        Engine::sweep(self, prefix, keep).await
    }

    async fn detach_all(&self, keep_for: Duration) -> Vec<EngineError> {
        Engine::detach_all(self, keep_for).await
    }
}
