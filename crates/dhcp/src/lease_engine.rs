//! What a LoadBalancer layer needs from the DHCP engine, as a trait: the
//! real [`Engine`](super::engine::Engine) implements it, and
//! `fake::FakeEngine` (unit tests, feature `fake`) records every call
//! and injects failures, so the LB reconcile is tested without root.
//!
//! Generic use (`E: LeaseEngine`), not `dyn`: the methods return
//! `impl Future + Send`, so a reconcile can spawn them.

use std::collections::BTreeSet;
use std::future::Future;
use std::net::Ipv4Addr;

use tokio::sync::watch;

use super::driver::LeaseStatus;
use super::io::ProbeConfig;
use super::link::LinkError;
use super::machine::StopMode;
use super::machine::Timing;
use super::packet::Identity;
use super::store::StoreError;

/// One LB address to hold.
#[derive(Debug, Clone)]
pub struct LeaseConfig {
    /// The macvlan's name (`hlb-<8 hex>`), also the lease file's name.
    pub interface: String,
    /// The uplink the macvlan sits on.
    pub parent: String,
    pub identity: Identity,
    /// Asked for in INIT-REBOOT when there is no lease file (kube-vip's
    /// `requestedIP`, see `Machine::requesting`).
    pub requested_ip: Option<Ipv4Addr>,
    pub timing: Timing,
    pub probe: ProbeConfig,
    /// When the caller's takeover guard began asking the LAN whether
    /// another host answers for the address (`None`: no guard ran). A first
    /// binding later than `GUARD_FRESH` after
    /// it (or after the start, without one) asks again before the address
    /// goes on the link.
    pub guarded_at: Option<tokio::time::Instant>,
    /// An address on the parent's LAN that answers ARP (its default
    /// gateway): a late first binding's re-check that hears nobody counts
    /// only when this answers, so a node that cannot hear its LAN (a port
    /// gone silent) does not take its silence for a free address.
    pub witness: Option<Ipv4Addr>,
    /// Whether the lease sends presence frames while it holds its address
    /// (`Driver::presence`).
    pub presence: Presence,
}

/// Whether a lease sends presence frames, and how often.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Presence {
    #[default]
    Off,
    Every(std::time::Duration),
    /// Every this long where the parent is a hypervisor's NIC that cannot
    /// have its guest announce a live migration
    /// (`silent_after_migration`),
    /// never elsewhere.
    WhereTheNicIsSilent(std::time::Duration),
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("lease {0} is already starting or running")]
    Exists(String),
    #[error("no lease {0}")]
    Unknown(String),
    #[error("macvlan not ready for {name}: {source}")]
    Link { name: String, source: LinkError },
    /// The takeover guard heard nobody, not even the witness: its silence
    /// says nothing about the address.
    #[error(
        "nothing answers on {name}'s LAN, not even {witness}: whether another host holds the address cannot be told from here"
    )]
    Deaf { name: String, witness: Ipv4Addr },
    #[error("packet socket on {name}: {source}")]
    Socket {
        name: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("lease {0}: the engine's runtime shut down before the operation finished")]
    Aborted(String),
}

/// What [`LeaseEngine::sweep`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Links deleted.
    pub removed: Vec<String>,
    /// Links that could not be listed or deleted, with the reason.
    pub problems: Vec<String>,
}

/// Leases held by this node, one per LoadBalancer address, by macvlan name
/// ([`LeaseConfig::interface`]).
pub trait LeaseEngine: Send + Sync + 'static {
    /// Makes the macvlan (or reuses a macvlan of that name on
    /// `cfg.parent` with `cfg.identity.mac`) and starts acquiring; the
    /// receiver follows the lease's status until it is stopped.
    /// [`EngineError::Exists`] while the name is started or running; a
    /// start while a stop of the name is under way waits for the stop. On
    /// failure nothing the start made is left (a reused link stays).
    fn start(
        &self,
        cfg: LeaseConfig,
    ) -> impl Future<Output = Result<watch::Receiver<LeaseStatus>, EngineError>> + Send;

    /// Stops a lease and deletes its macvlan: `Release` when the address is
    /// no longer wanted anywhere (DHCPRELEASE, lease file deleted),
    /// `Handover` when another node takes it (nothing sent, file kept).
    /// [`EngineError::Unknown`] when no such lease runs.
    fn stop(
        &self,
        name: &str,
        mode: StopMode,
    ) -> impl Future<Output = Result<(), EngineError>> + Send;

    /// Gratuitous ARP for a bound lease now (takeover); nothing when the
    /// lease holds no address yet.
    fn announce(&self, name: &str) -> impl Future<Output = Result<(), EngineError>> + Send;

    /// The takeover guard: whether anybody on `parent`'s LAN answers ARP
    /// for `addr`, asked from `parent`'s own MAC (every holder of one
    /// Service shares the lease's MAC, so a probe from that MAC could not
    /// see another holder's answer), with `probe`'s timing. Makes no link.
    /// With a `witness` (an address on that LAN that answers ARP, its
    /// gateway), silence counts only when the witness answers; otherwise
    /// [`EngineError::Deaf`].
    fn answered(
        &self,
        parent: &str,
        addr: Ipv4Addr,
        witness: Option<Ipv4Addr>,
        probe: ProbeConfig,
    ) -> impl Future<Output = Result<bool, EngineError>> + Send;

    /// Whether `witness` (an address on `parent`'s LAN that answers ARP,
    /// its gateway) answers an ordinary ARP request sent from `parent`
    /// with its own MAC and address, with `probe`'s timing: whether this
    /// node's LAN port is heard at all. Makes no link.
    fn hears(
        &self,
        parent: &str,
        witness: Ipv4Addr,
        probe: ProbeConfig,
    ) -> impl Future<Output = Result<bool, EngineError>> + Send;

    /// Every running lease's current status.
    fn snapshot(&self) -> Vec<LeaseStatus>;

    /// Start-up clean-up: deletes every macvlan named `prefix...` that is
    /// not in `keep` and not held by a running lease, without DHCPRELEASE
    /// (lease files stay). Call it before starting the leases in `keep`,
    /// which then adopt their links.
    fn sweep(
        &self,
        prefix: &str,
        keep: &BTreeSet<String>,
    ) -> impl Future<Output = SweepReport> + Send;

    /// Ends every lease for a restart: addresses, links and lease files
    /// stay, each address's lifetime set to `keep_for`; nothing is sent.
    /// The next run's [`start`](LeaseEngine::start) adopts them.
    fn detach_all(
        &self,
        keep_for: std::time::Duration,
    ) -> impl Future<Output = Vec<EngineError>> + Send;
}
