//! The membership's edge: one UDP socket on the default uplink's address,
//! the timers on tokio's clock, and what the rest of the agent reads
//! ([`LanView`]). Everything the protocol decides is in [`super::swim`].

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::time::{Duration, SystemTime};

use tokio::net::UdpSocket;
use tokio::sync::watch;
use tokio::time::Instant;

pub(crate) use super::swim::{Acknowledged, Attestation, Hearing, Word};
use super::swim::{Member, Out, Settings, Timer};
use super::wire::{Dropped, Key};
use hna_contract::membership::{LanReport, Peer};

/// What the agent knows that the membership needs.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Want {
    pub(crate) node: String,
    /// The default uplink's address and prefix length (`None`: it has none).
    pub(crate) listen: Option<(Ipv4Addr, u8)>,
    /// 0: off.
    pub(crate) port: u16,
    /// From this node's spec.
    pub(crate) peers: Vec<Peer>,
    /// From the membership Secret (empty: not read yet).
    pub(crate) keys: Vec<KeyBytes>,
    /// This node's `lb_address_lifetime`, told to its witnesses.
    pub(crate) lifetime: Duration,
    /// It holds none of its addresses and cannot read its assignments: its
    /// witnesses are told, and report it down (`swim::Member::set_stood_down`).
    pub(crate) stood_down: bool,
    /// Its accusations the API server acknowledged: each accused is told
    /// (`swim::Member::set_acknowledged`).
    pub(crate) acknowledged: Acknowledged,
    /// Its witnesses' words as the last run of this agent heard them, and
    /// when they were read back: a new member starts with them
    /// (`swim::Member::seed_attestations`).
    pub(crate) seed: Option<(Instant, BTreeMap<String, Word>)>,
}

/// Gives a new member's run epoch from the wall clock's milliseconds
/// (`loadbalancer::kept`: one that only grows across runs).
pub(crate) type Epochs = std::sync::Arc<dyn Fn(u64) -> u64 + Send + Sync>;

/// A key as the Secret holds it, with its id.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct KeyBytes {
    pub(crate) id: u8,
    pub(crate) secret: Vec<u8>,
}

impl std::fmt::Debug for KeyBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KeyBytes({}, {} bytes)", self.id, self.secret.len())
    }
}

/// What the membership tells the agent.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct LanView {
    /// For `status.lan` (`None`: not running; see `why_not`).
    pub(crate) report: Option<LanReport>,
    /// Why it is not running.
    pub(crate) why_not: Option<String>,
    /// Whether the controller named any peers.
    pub(crate) has_peers: bool,
    /// The last authentic packet from any peer.
    pub(crate) heard_any: Option<Instant>,
    /// What this node hears of its peers and its witnesses, for its own
    /// fence.
    pub(crate) hearing: Hearing,
    /// Packets dropped, by reason.
    pub(crate) dropped: BTreeMap<&'static str, u64>,
    /// This node's witnesses (sorted).
    pub(crate) witnesses: Vec<String>,
    /// Their word on this node: what the API server acknowledged of their
    /// accusations of it.
    pub(crate) attestations: BTreeMap<String, Attestation>,
}

/// The drop reason of packets this node could not send (no room in the
/// socket's buffer, no route): counted beside those it refused.
pub(crate) const UNSENT: &str = "unsent";

/// The drop reason of authentic answers to no recent probe of this
/// witness's (late, replayed, or meant for another node): counted beside
/// the packets the gate refused.
pub(crate) const UNMATCHED: &str = "unmatched_answer";

/// How often the view's `heard_any` is brought up to date (it changes with
/// every packet; readers need it to a fraction of a second only).
const HEARD_GRANULARITY: Duration = Duration::from_millis(250);

/// The membership socket and its member, while running.
struct Running {
    socket: UdpSocket,
    member: Member,
    listen: (Ipv4Addr, u8),
    port: u16,
    timers: BinaryHeap<Reverse<(Instant, u64)>>,
    pending: BTreeMap<u64, Timer>,
    seq: u64,
    send_errors: u64,
}

impl Running {
    async fn start(
        want: &Want,
        listen: (Ipv4Addr, u8),
        epochs: &Epochs,
    ) -> Result<Running, NotRunning> {
        let keys = keys_of(want)?;
        let addr = SocketAddrV4::new(listen.0, want.port);
        let socket = UdpSocket::bind(addr)
            .await
            .map_err(|error| NotRunning::Bind { addr, error })?;
        grow_buffers(&socket);
        let run = epochs(
            SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
        );
        let member = Member::new(
            &want.node,
            addr,
            run,
            keys,
            Settings {
                own_lifetime: want.lifetime,
                ..Settings::default()
            },
            run ^ u64::from(std::process::id()),
            Instant::now(),
        )
        .ok_or(NotRunning::MemberKey)?;
        let mut r = Running {
            socket,
            member,
            listen,
            port: want.port,
            timers: BinaryHeap::new(),
            pending: BTreeMap::new(),
            seq: 0,
            send_errors: 0,
        };
        r.set_peers(want);
        if let Some((at, words)) = &want.seed {
            r.member.seed_attestations(words, *at);
        }
        r.flush().await;
        Ok(r)
    }

    fn set_peers(&mut self, want: &Want) {
        let peers: Vec<(String, SocketAddrV4)> = want
            .peers
            .iter()
            .filter_map(|p| Some((p.name.clone(), p.address.parse().ok()?)))
            .collect();
        self.member.set_peers(&peers, Instant::now());
    }

    async fn flush(&mut self) {
        for out in self.member.drain() {
            match out {
                // Never waits: should the socket's buffer fill up (see
                // `grow_buffers`), a send that waited for room would stall
                // the whole membership (its witness rounds and its answers
                // to every peer). A packet that finds no room is dropped,
                // as UDP may, and counted.
                Out::Send { to, packet } => {
                    if self.socket.try_send_to(&packet, to.into()).is_err() {
                        self.send_errors += 1;
                    }
                }
                Out::After { after, timer } => {
                    self.seq += 1;
                    self.timers
                        .push(Reverse((Instant::now() + after, self.seq)));
                    self.pending.insert(self.seq, timer);
                }
            }
        }
    }

    fn next_timer(&self) -> Option<Instant> {
        self.timers.peek().map(|Reverse((at, _))| *at)
    }

    async fn fire_due(&mut self) {
        let now = Instant::now();
        while let Some(Reverse((at, seq))) = self.timers.peek().copied() {
            if at > now {
                break;
            }
            self.timers.pop();
            if let Some(t) = self.pending.remove(&seq) {
                self.member.timer(t, now);
            }
        }
        self.flush().await;
    }

    fn view(&self) -> LanView {
        let (ip, prefix) = self.listen;
        let network = Ipv4Addr::from(u32::from(ip) & prefix_mask(prefix));
        let hearing = self.member.hearing(Instant::now());
        LanView {
            report: Some(LanReport {
                address: SocketAddrV4::new(ip, self.port).to_string(),
                network: format!("{network}/{prefix}"),
                down: self.member.down(),
                hears: self.member.hears(),
                alive: self.member.alive() as u32,
                unheard: hearing.none_since.is_some() || hearing.short_since.is_some(),
            }),
            why_not: None,
            has_peers: self.member.has_peers(),
            heard_any: self.member.heard_any(),
            hearing,
            dropped: Dropped::ALL
                .iter()
                .map(|d| (d.label(), self.member.dropped(*d)))
                .chain([
                    (UNSENT, self.send_errors),
                    (UNMATCHED, self.member.counters().unmatched_answers),
                ])
                .collect(),
            witnesses: self.member.witnesses(),
            attestations: self.member.attestations(),
        }
    }
}

/// The socket's buffers, each as large as [`BUFFER`], forced past
/// `net.core.rmem_max`/`wmem_max` when the agent may (it runs as root or
/// with `CAP_NET_ADMIN`), else as large as the kernel allows.
///
/// - Receive: a burst of packets (a flood of junk from the LAN included)
///   must not push out the probes' answers, which a witness would take for
///   a silent peer.
/// - Send: packets to a peer whose VM is gone wait in the kernel for an ARP
///   answer that never comes, up to `unres_qlen_bytes` (208 KiB by
///   default), charged to this socket. With the default send buffer (the
///   same 208 KiB) one dead peer filled it: the sends to every live peer
///   then failed, and two witnesses, whose probes no longer went out,
///   reported a live node dead (the fault soak).
fn grow_buffers(socket: &UdpSocket) {
    use std::os::fd::AsRawFd;
    let size: libc::c_int = BUFFER;
    for options in [
        [libc::SO_RCVBUFFORCE, libc::SO_RCVBUF],
        [libc::SO_SNDBUFFORCE, libc::SO_SNDBUF],
    ] {
        for option in options {
            // SAFETY: a valid socket descriptor and a c_int option value of
            // the size given.
            let rc = unsafe {
                libc::setsockopt(
                    socket.as_raw_fd(),
                    libc::SOL_SOCKET,
                    option,
                    (&size as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
            if rc == 0 {
                break;
            }
        }
    }
}

/// 4 MiB each way: some 20,000 packets of junk, several seconds of a large
/// LAN's membership traffic, or the ARP queues of a score of dead peers.
const BUFFER: libc::c_int = 4 << 20;

fn prefix_mask(prefix: u8) -> u32 {
    match prefix {
        0 => 0,
        p => u32::MAX << (32 - u32::from(p.min(32))),
    }
}

/// Why the membership does not run.
#[derive(Debug, thiserror::Error)]
enum NotRunning {
    #[error(
        "no key yet (Secret {} not read)",
        hna_contract::membership::SECRET_NAME
    )]
    NoKey,
    #[error(transparent)]
    Key(#[from] super::wire::WireError),
    /// The member refused the keys.
    #[error("no key")]
    MemberKey,
    #[error("cannot listen on {addr} (udp): {error}")]
    Bind {
        addr: SocketAddrV4,
        #[source]
        error: std::io::Error,
    },
}

fn keys_of(want: &Want) -> Result<Vec<Key>, NotRunning> {
    if want.keys.is_empty() {
        return Err(NotRunning::NoKey);
    }
    want.keys
        .iter()
        .map(|k| Ok(Key::new(k.id, &k.secret)?))
        .collect()
}

/// Whether the view changed enough to tell the readers.
fn worth_telling(old: &LanView, new: &LanView) -> bool {
    let heard_moved = match (old.heard_any, new.heard_any) {
        (Some(a), Some(b)) => b.saturating_duration_since(a) >= HEARD_GRANULARITY,
        (a, b) => a != b,
    };
    // A word heard again unchanged matters only as often as `heard_any`.
    let word_moved = old.attestations.len() != new.attestations.len()
        || old
            .attestations
            .iter()
            .zip(&new.attestations)
            .any(|((n, a), (m, b))| {
                n != m
                    || a.changed != b.changed
                    || b.heard.saturating_duration_since(a.heard) >= HEARD_GRANULARITY
            });
    heard_moved
        || word_moved
        || old.witnesses != new.witnesses
        || old.report != new.report
        || old.why_not != new.why_not
        || old.has_peers != new.has_peers
        || old.hearing != new.hearing
        || old.dropped != new.dropped
}

/// Runs the membership as `want` says, until `stop` is set: `true` leaves
/// the cluster (the addresses are handed over), a dropped sender just ends.
pub(crate) async fn run(
    mut want: watch::Receiver<Want>,
    view: watch::Sender<LanView>,
    mut stop: watch::Receiver<Option<bool>>,
    epochs: Epochs,
) {
    let mut running: Option<Running> = None;
    let mut buf = vec![0u8; 2048];
    let mut logged: Option<String> = None;
    loop {
        let w = want.borrow_and_update().clone();
        let target = w.listen.filter(|_| w.port != 0);
        align(&mut running, &w, target, &view, &mut logged, &epochs).await;
        // Events until the wanted state changes.
        loop {
            let next = running.as_ref().and_then(Running::next_timer);
            tokio::select! {
                changed = want.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    break;
                }
                _ = stop.changed() => {
                    let leave = *stop.borrow();
                    if let (Some(true), Some(r)) = (leave, running.as_mut()) {
                        r.member.leave();
                        r.flush().await;
                    }
                    if leave.is_some() {
                        return;
                    }
                }
                got = recv(running.as_ref(), &mut buf) => {
                    if let (Some((n, from)), Some(r)) = (got, running.as_mut())
                        && matches!(from, SocketAddr::V4(_))
                    {
                        r.member.receive(&buf[..n], Instant::now());
                        r.flush().await;
                    }
                }
                _ = hna_edges::duration::sleep_until(next) => {
                    if let Some(r) = running.as_mut() {
                        r.fire_due().await;
                    }
                }
                // A failed start is tried again now and then (a port in
                // use, a key not read yet).
                _ = tokio::time::sleep(Duration::from_secs(5)), if running.is_none() && target.is_some() => break,
            }
            if let Some(r) = &running {
                publish_view(r, &view);
            }
        }
    }
}

/// Brings the running member in line with what is wanted: (re)started on
/// a new address or port, its keys, peers and standing set; or, when it
/// cannot run, says why.
async fn align(
    running: &mut Option<Running>,
    w: &Want,
    target: Option<(Ipv4Addr, u8)>,
    view: &watch::Sender<LanView>,
    logged: &mut Option<String>,
    epochs: &Epochs,
) {
    let restart = match (&*running, target) {
        (Some(r), Some(l)) => r.listen != l || r.port != w.port,
        (Some(_), None) => true,
        (None, Some(_)) => true,
        (None, None) => false,
    };
    if restart {
        *running = None;
        if let Some(l) = target {
            *running = start_or_say_why(w, l, view, logged, epochs).await;
        }
    }
    match running {
        Some(r) => {
            if let Ok(keys) = keys_of(w) {
                r.member.set_keys(keys);
            }
            r.set_peers(w);
            r.member.set_stood_down(w.stood_down);
            r.member.set_acknowledged(w.acknowledged.clone());
            r.flush().await;
        }
        None if w.port == 0 => {
            view.send_replace(LanView {
                why_not: Some("off (lb_membership_port = 0)".into()),
                ..LanView::default()
            });
        }
        None if target.is_none() => {
            view.send_replace(LanView {
                why_not: Some("the default uplink has no IPv4 address".into()),
                ..LanView::default()
            });
        }
        None => {}
    }
}

/// The member listening on `l`, or `None` with the reason in the view
/// (logged once while it stays the same).
async fn start_or_say_why(
    w: &Want,
    l: (Ipv4Addr, u8),
    view: &watch::Sender<LanView>,
    logged: &mut Option<String>,
    epochs: &Epochs,
) -> Option<Running> {
    match Running::start(w, l, epochs).await {
        Ok(r) => {
            tracing::info!(address = %SocketAddrV4::new(l.0, w.port), peers = w.peers.len(), "LAN membership listening");
            *logged = None;
            Some(r)
        }
        Err(why) => {
            let why = why.to_string();
            if logged.as_deref() != Some(why.as_str()) {
                tracing::warn!("LAN membership not running: {why}");
                *logged = Some(why.clone());
            }
            view.send_replace(LanView {
                why_not: Some(why),
                ..LanView::default()
            });
            None
        }
    }
}

/// Tells the readers the member's view when it moved enough, and warns
/// when the peers found dead change.
fn publish_view(r: &Running, view: &watch::Sender<LanView>) {
    let new = r.view();
    let down = |v: &LanView| {
        v.report
            .as_ref()
            .map(|r| r.down.clone())
            .unwrap_or_default()
    };
    let (was, now) = (down(&view.borrow()), down(&new));
    if was != now {
        tracing::warn!(down = ?now, was = ?was, "witnessed peers found dead on the LAN (their probes unanswered for longer than their address lifetime, or they stood down)");
    }
    view.send_if_modified(|old| {
        let tell = worth_telling(old, &new);
        if tell {
            *old = new;
        }
        tell
    });
}

async fn recv(r: Option<&Running>, buf: &mut [u8]) -> Option<(usize, SocketAddr)> {
    match r {
        Some(r) => r.socket.recv_from(buf).await.ok(),
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_network_is_the_address_under_its_prefix() {
        assert_eq!(prefix_mask(24), 0xffff_ff00);
        assert_eq!(prefix_mask(0), 0);
        assert_eq!(prefix_mask(32), u32::MAX);
    }

    /// Two members on loopback addresses find each other, and one that
    /// stops is reported by the other.
    #[tokio::test]
    async fn two_members_on_loopback_watch_each_other() {
        let key = KeyBytes {
            id: 1,
            secret: vec![3; 32],
        };
        let peers = vec![
            Peer {
                name: "a".into(),
                address: "127.0.0.1:17947".into(),
            },
            Peer {
                name: "b".into(),
                address: "127.0.0.2:17947".into(),
            },
        ];
        let mut tasks = Vec::new();
        let mut views = Vec::new();
        let mut stops = Vec::new();
        for (name, ip) in [("a", [127, 0, 0, 1]), ("b", [127, 0, 0, 2])] {
            let (_want_tx, want_rx) = watch::channel(Want {
                node: name.into(),
                listen: Some((Ipv4Addr::from(ip), 8)),
                port: 17947,
                peers: peers.clone(),
                keys: vec![key.clone()],
                lifetime: Duration::from_secs(1),
                stood_down: false,
                acknowledged: Default::default(),
                seed: None,
            });
            let (view_tx, view_rx) = watch::channel(LanView::default());
            let (stop_tx, stop_rx) = watch::channel(None);
            tasks.push(tokio::spawn(async move {
                let _keep = _want_tx;
                run(want_rx, view_tx, stop_rx, std::sync::Arc::new(|ms| ms)).await
            }));
            views.push(view_rx);
            stops.push(stop_tx);
        }
        // Both hear each other.
        let deadline = Instant::now() + Duration::from_secs(10);
        for v in &mut views {
            while v.borrow().heard_any.is_none() {
                tokio::time::timeout_at(deadline, v.changed())
                    .await
                    .expect("heard within 10 s")
                    .unwrap();
            }
            assert_eq!(v.borrow().report.as_ref().unwrap().network, "127.0.0.0/8");
        }
        // b stops without leaving (a crash): a reports it.
        stops[1].send_replace(Some(false));
        let a = &mut views[0];
        let reported = |v: &LanView| v.report.as_ref().is_some_and(|r| r.down == ["b"]);
        while !reported(&a.borrow()) {
            tokio::time::timeout_at(deadline, a.changed())
                .await
                .expect("b reported down within 10 s")
                .unwrap();
        }
        stops[0].send_replace(Some(false));
        for t in tasks {
            t.await.unwrap();
        }
    }
}
