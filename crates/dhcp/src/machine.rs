//! The RFC 2131 client state machine, as plain data: `Machine::handle`
//! takes an [`Event`] and the current time and returns [`Action`]s. It never
//! sleeps, reads a clock or touches a socket, so every path (retransmission
//! timing, NAKs, expiry, declines) is tested with paused tokio time and
//! hand-made packets.
//!
//! One machine holds one lease. The driver (`dhcp::driver`) feeds it and
//! carries out its actions; there is exactly one timer per machine, and
//! every `SetTimer` replaces the previous one.

use std::net::Ipv4Addr;
use std::time::Duration;

use dhcproto::v4::MessageType;
use serde::Serialize;
use tokio::time::Instant;

use super::packet::{self, Identity, Reply, RequestFields};

/// RFC 2131 state names, plus `Checking` (the RFC 5227 probe between the
/// ACK and first use, RFC 2131 §4.4.1 "the client SHOULD perform a check")
/// and `Stopped`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "SCREAMING-KEBAB-CASE")]
pub enum State {
    /// Waiting before (re)starting discovery: after a NAK or a DECLINE.
    Init,
    Selecting,
    Requesting,
    Checking,
    Bound,
    Renewing,
    Rebinding,
    InitReboot,
    /// The kernel deleted the address when its lifetime ran out
    /// ([`Timing::address_lifetime`]): its client did not confirm it in
    /// time (frozen, paused, starved of CPU). Nothing is sent and nothing
    /// is put back: whoever runs the lease starts it again through its
    /// takeover guard, since another node may hold the address by now. The
    /// lease and its file are kept.
    Expired,
    Stopped,
}

impl State {
    /// Every state, in the order a lease meets them.
    pub const ALL: [State; 10] = [
        State::Init,
        State::Selecting,
        State::Requesting,
        State::Checking,
        State::Bound,
        State::Renewing,
        State::Rebinding,
        State::InitReboot,
        State::Expired,
        State::Stopped,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            State::Init => "INIT",
            State::Selecting => "SELECTING",
            State::Requesting => "REQUESTING",
            State::Checking => "CHECKING",
            State::Bound => "BOUND",
            State::Renewing => "RENEWING",
            State::Rebinding => "REBINDING",
            State::InitReboot => "INIT-REBOOT",
            State::Expired => "EXPIRED",
            State::Stopped => "STOPPED",
        }
    }

    /// Whether the address is configured on the interface in this state.
    pub fn holds_address(self) -> bool {
        matches!(self, State::Bound | State::Renewing | State::Rebinding)
    }
}

/// The longest a lease waits to rediscover after a first DHCPNAK. Random,
/// so leases NAKed together do not rediscover in the same instant.
pub const NAK_RESTART_SPREAD: Duration = Duration::from_millis(200);

/// Timing knobs. Defaults are RFC 2131's; tests and short-lease setups
/// lower `renew_floor`.
#[derive(Debug, Clone)]
pub struct Timing {
    /// First retransmission interval (RFC 2131 §4.1: 4 s).
    pub backoff_initial: Duration,
    /// Cap of the doubling (64 s).
    pub backoff_max: Duration,
    /// Uniform jitter added to each interval (±1 s).
    pub jitter: Duration,
    /// Smallest interval between retransmissions in RENEWING/REBINDING
    /// (RFC 2131 §4.4.5: 60 s). Lower it only for leases of a few minutes.
    pub renew_floor: Duration,
    /// Wait after a DECLINE before discovering again (RFC 2131 §3.1: 10 s).
    pub decline_wait: Duration,
    /// INIT-REBOOT transmissions before falling back (to the stored lease
    /// while it is valid, else to discovery asking for the same address).
    pub init_reboot_tries: u32,
    /// Probe the offered address with ARP (RFC 5227) before using it.
    pub arp_probe: bool,
    /// The lifetime the address is configured with, confirmed by the
    /// driver every quarter of it: a client that stops running (frozen,
    /// its VM paused) stops answering for the address within this bound,
    /// enforced by the kernel alone. `None`: the address stays until
    /// removed.
    pub address_lifetime: Option<Duration>,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            backoff_initial: Duration::from_secs(4),
            backoff_max: Duration::from_secs(64),
            jitter: Duration::from_secs(1),
            renew_floor: Duration::from_secs(60),
            decline_wait: Duration::from_secs(10),
            init_reboot_tries: 3,
            arp_probe: true,
            address_lifetime: None,
        }
    }
}

/// A lease as the machine keeps it. Times are monotonic; the store converts
/// them to wall-clock time for the lease file.
#[derive(Debug, Clone, PartialEq)]
pub struct Lease {
    pub(crate) address: Ipv4Addr,
    pub(crate) prefix_len: u8,
    pub(crate) server_id: Ipv4Addr,
    /// Source MAC of the frame that carried the ACK: the server, or the
    /// relay/router toward it. Unicast renew and release go there.
    pub(crate) server_mac: [u8; 6],
    pub(crate) routers: Vec<Ipv4Addr>,
    pub(crate) lease_time: Duration,
    pub(crate) t1: Duration,
    pub(crate) t2: Duration,
    /// When the REQUEST that this ACK answered was sent; the lease runs
    /// from then (RFC 2131 §4.4.1).
    pub(crate) acquired: Instant,
}

impl Lease {
    pub(crate) fn t1_at(&self) -> Instant {
        self.acquired + self.t1
    }
    pub(crate) fn t2_at(&self) -> Instant {
        self.acquired + self.t2
    }
    pub(crate) fn expires_at(&self) -> Instant {
        self.acquired + self.lease_time
    }
}

/// Where a message goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Destination {
    /// 255.255.255.255, ff:ff:ff:ff:ff:ff.
    Broadcast,
    /// The server, at the MAC the ACK came from.
    Unicast { ip: Ipv4Addr, mac: [u8; 6] },
}

/// What the driver must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    Send {
        kind: MessageType,
        payload: Vec<u8>,
        src: Ipv4Addr,
        dst: Destination,
    },
    /// Fire `Event::Timer` at this instant (replaces any earlier timer).
    SetTimer(Instant),
    ConfigureAddress {
        address: Ipv4Addr,
        prefix_len: u8,
    },
    RemoveAddress(Ipv4Addr),
    /// Run an RFC 5227 probe and answer with `Event::ProbeResult`.
    ArpProbe(Ipv4Addr),
    /// Gratuitous ARP announcing that this interface holds the address.
    ArpAnnounce(Ipv4Addr),
    /// Write the lease file.
    Persist(Lease),
    /// Delete the lease file.
    Forget,
    StateChanged {
        from: State,
        to: State,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopMode {
    /// The address is no longer wanted anywhere: DHCPRELEASE, remove the
    /// address, delete the lease file.
    Release,
    /// Another holder takes over: remove the address, keep the lease file,
    /// send nothing (a RELEASE would free the address the new holder uses).
    Handover,
}

#[derive(Debug, Clone)]
pub enum Event<'a> {
    /// Begin; with the persisted lease, in INIT-REBOOT. Without one, in
    /// INIT-REBOOT for the address of `Machine::requesting` when set,
    /// else in SELECTING.
    Start {
        stored: Option<Lease>,
    },
    /// Resume a lease that an earlier run of this client left configured
    /// on the interface (a restart, `kill -9`): BOUND at once, with the
    /// renewal timers of the stored times, and no message sent. A lease
    /// already expired starts over as [`Event::Start`] with it.
    Adopt {
        lease: Lease,
    },
    /// A UDP payload to port 68 on this interface, and the frame's source
    /// MAC.
    Received {
        payload: &'a [u8],
        src_mac: [u8; 6],
    },
    Timer,
    ProbeResult {
        address: Ipv4Addr,
        conflict: bool,
    },
    Stop(StopMode),
    /// Re-announce the address (takeover on demand).
    Announce,
    /// The address is no longer on the interface although the lease holds
    /// it: its lifetime ran out ([`State::Expired`]).
    AddressExpired,
}

/// Per-lease counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Counters {
    pub sent: u64,
    pub received: u64,
    /// Received but not acted on: malformed, or not fitting the state
    /// (xid, chaddr, message type).
    pub dropped: u64,
    /// The malformed part of `dropped`.
    pub malformed: u64,
    pub naks: u64,
    pub declines: u64,
}

#[derive(Debug, Clone, Copy)]
struct Offer {
    address: Ipv4Addr,
    server_id: Ipv4Addr,
}

/// One lease's state machine.
#[derive(Debug)]
pub struct Machine {
    id: Identity,
    timing: Timing,
    rng: fastrand::Rng,
    state: State,
    xid: u32,
    attempt: u32,
    exchange_started: Instant,
    last_request: Instant,
    deadline: Option<Instant>,
    offer: Option<Offer>,
    /// Candidate lease during CHECKING.
    candidate: Option<Lease>,
    lease: Option<Lease>,
    /// The persisted lease INIT-REBOOT started from.
    stored: Option<Lease>,
    /// The address asked for in INIT-REBOOT (the stored lease's, or the
    /// requested one).
    rebooting: Option<Ipv4Addr>,
    /// Asked for in INIT-REBOOT when there is no stored lease.
    requested: Option<Ipv4Addr>,
    /// Address to ask for (option 50) in the next DISCOVER.
    hint: Option<Ipv4Addr>,
    consecutive_naks: u32,
    counters: Counters,
    last_drop: Option<String>,
}

impl Machine {
    /// `seed` drives xids and jitter (fixed in tests, random in the driver).
    pub(crate) fn new(id: Identity, timing: Timing, seed: u64) -> Self {
        let now = Instant::now();
        Machine {
            id,
            timing,
            rng: fastrand::Rng::with_seed(seed),
            state: State::Init,
            xid: 0,
            attempt: 0,
            exchange_started: now,
            last_request: now,
            deadline: None,
            offer: None,
            candidate: None,
            lease: None,
            stored: None,
            rebooting: None,
            requested: None,
            hint: None,
            consecutive_naks: 0,
            counters: Counters::default(),
            last_drop: None,
        }
    }

    /// An address this client held before without a lease file to show
    /// for it (kube-vip's `requestedIP` on a migrated Service): the start
    /// asks for it in INIT-REBOOT. RFC 2131 §3.2 is for a client that
    /// "remembers and wishes to reuse a previously allocated network
    /// address", which this is, under the same MAC and client identifier;
    /// a server that knows the binding ACKs it, one that does not stays
    /// silent (then discovery asks for it with option 50) or NAKs (then
    /// discovery asks for nothing in particular).
    pub(crate) fn requesting(mut self, address: Option<Ipv4Addr>) -> Self {
        self.requested = address;
        self
    }

    pub(crate) fn state(&self) -> State {
        self.state
    }
    pub(crate) fn lease(&self) -> Option<&Lease> {
        self.lease.as_ref()
    }
    pub(crate) fn counters(&self) -> Counters {
        self.counters
    }
    pub(crate) fn identity(&self) -> &Identity {
        &self.id
    }
    pub(crate) fn xid(&self) -> u32 {
        self.xid
    }
    /// See [`Timing::address_lifetime`].
    pub(crate) fn address_lifetime(&self) -> Option<Duration> {
        self.timing.address_lifetime
    }
    /// The current timer, if any.
    #[cfg(test)]
    pub(crate) fn deadline(&self) -> Option<Instant> {
        self.deadline
    }
    /// Why the last packet was dropped.
    pub(crate) fn last_drop(&self) -> Option<&str> {
        self.last_drop.as_deref()
    }
    /// Counts a frame that never reached the DHCP layer (bad IP/UDP).
    pub(crate) fn count_malformed_frame(&mut self, reason: String) {
        self.counters.received += 1;
        self.counters.dropped += 1;
        self.counters.malformed += 1;
        self.last_drop = Some(reason);
    }

    pub(crate) fn handle(&mut self, now: Instant, event: Event<'_>) -> Vec<Action> {
        let mut out = Vec::new();
        let before = self.state;
        match event {
            Event::Start { stored } => self.start(now, stored, &mut out),
            Event::Adopt { lease } => self.adopt(now, lease, &mut out),
            Event::Received { payload, src_mac } => self.received(now, payload, src_mac, &mut out),
            Event::Timer => self.timer(now, &mut out),
            Event::ProbeResult { address, conflict } => {
                self.probe_result(now, address, conflict, &mut out)
            }
            Event::Stop(mode) => self.stop(now, mode, &mut out),
            Event::Announce => {
                if let (true, Some(l)) = (self.state.holds_address(), &self.lease) {
                    out.push(Action::ArpAnnounce(l.address));
                }
            }
            Event::AddressExpired => {
                if self.state.holds_address() {
                    self.state = State::Expired;
                    self.deadline = None;
                    self.candidate = None;
                }
            }
        }
        if self.state != before {
            out.push(Action::StateChanged {
                from: before,
                to: self.state,
            });
        }
        out
    }

    // ----- helpers -------------------------------------------------------

    fn fresh_xid(&mut self) {
        self.xid = self.rng.u32(..);
    }

    /// Doubling base interval for retransmission number `attempt`, capped.
    fn base_interval(&self, attempt: u32) -> Duration {
        let factor = 1u32.checked_shl(attempt.min(20)).unwrap_or(u32::MAX);
        self.timing
            .backoff_initial
            .saturating_mul(factor)
            .min(self.timing.backoff_max)
    }

    fn at_cap(&self, attempt: u32) -> bool {
        self.base_interval(attempt) >= self.timing.backoff_max
    }

    /// Base interval ± jitter (uniform, millisecond resolution), at least
    /// 1 ms.
    fn backoff(&mut self, attempt: u32) -> Duration {
        let base = self.base_interval(attempt).as_millis() as i64;
        let j = self.timing.jitter.as_millis() as i64;
        let delta = if j > 0 { self.rng.i64(-j..=j) } else { 0 };
        Duration::from_millis((base + delta).max(1) as u64)
    }

    fn set_timer(&mut self, at: Instant, out: &mut Vec<Action>) {
        self.deadline = Some(at);
        out.push(Action::SetTimer(at));
    }

    fn secs(&self, now: Instant) -> u16 {
        now.saturating_duration_since(self.exchange_started)
            .as_secs()
            .min(u64::from(u16::MAX)) as u16
    }

    fn send(
        &mut self,
        kind: MessageType,
        fields: RequestFields,
        src: Ipv4Addr,
        dst: Destination,
        out: &mut Vec<Action>,
    ) {
        let payload = packet::build(kind, &self.id, &fields);
        self.counters.sent += 1;
        out.push(Action::Send {
            kind,
            payload,
            src,
            dst,
        });
    }

    fn drop_packet(&mut self, reason: String) {
        self.counters.dropped += 1;
        self.last_drop = Some(reason);
    }

    /// Next retransmission in RENEWING/REBINDING: half the remaining time
    /// to `limit`, at least `renew_floor`, never past `limit`.
    fn renew_deadline(&self, now: Instant, limit: Instant) -> Instant {
        let remaining = limit.saturating_duration_since(now);
        let wait = (remaining / 2).max(self.timing.renew_floor);
        (now + wait).min(limit)
    }

    // ----- transitions ---------------------------------------------------

    fn start(&mut self, now: Instant, stored: Option<Lease>, out: &mut Vec<Action>) {
        let reboot = stored.as_ref().map(|l| l.address).or(self.requested);
        self.stored = stored;
        match reboot {
            Some(address) => {
                self.hint = Some(address);
                self.rebooting = Some(address);
                self.state = State::InitReboot;
                self.fresh_xid();
                self.attempt = 0;
                self.exchange_started = now;
                self.send_init_reboot(now, out);
            }
            None => self.discover(now, 0, out),
        }
    }

    fn adopt(&mut self, now: Instant, lease: Lease, out: &mut Vec<Action>) {
        if lease.expires_at() <= now {
            return self.start(now, Some(lease), out);
        }
        // Already on the interface; adding it again is a no-op there and
        // repairs a link that lost it meanwhile.
        out.push(Action::ConfigureAddress {
            address: lease.address,
            prefix_len: lease.prefix_len,
        });
        out.push(Action::ArpAnnounce(lease.address));
        self.state = State::Bound;
        self.attempt = 0;
        self.hint = Some(lease.address);
        // T1 past already: the timer fires at once and renews (unicast),
        // and past T2 the renewal turns into rebinding, as after a
        // BOUND that slept through its timers.
        let t1 = lease.t1_at();
        self.lease = Some(lease);
        self.set_timer(t1.max(now), out);
    }

    fn send_init_reboot(&mut self, now: Instant, out: &mut Vec<Action>) {
        let requested = self.rebooting;
        self.last_request = now;
        let f = RequestFields {
            xid: self.xid,
            secs: self.secs(now),
            ciaddr: None,
            requested,
            server_id: None,
        };
        self.send(
            MessageType::Request,
            f,
            Ipv4Addr::UNSPECIFIED,
            Destination::Broadcast,
            out,
        );
        let at = now + self.backoff(self.attempt);
        self.set_timer(at, out);
    }

    /// Enters SELECTING with a fresh xid and sends DISCOVER; `attempt` is
    /// where the backoff continues (0 for a fresh start, the cap after a
    /// fallback).
    fn discover(&mut self, now: Instant, attempt: u32, out: &mut Vec<Action>) {
        self.state = State::Selecting;
        self.fresh_xid();
        self.attempt = attempt;
        self.exchange_started = now;
        self.offer = None;
        self.send_discover(now, out);
    }

    fn send_discover(&mut self, now: Instant, out: &mut Vec<Action>) {
        let f = RequestFields {
            xid: self.xid,
            secs: self.secs(now),
            ciaddr: None,
            requested: self.hint,
            server_id: None,
        };
        self.send(
            MessageType::Discover,
            f,
            Ipv4Addr::UNSPECIFIED,
            Destination::Broadcast,
            out,
        );
        let at = now + self.backoff(self.attempt);
        self.set_timer(at, out);
    }

    fn send_selecting_request(&mut self, now: Instant, out: &mut Vec<Action>) {
        let offer = self.offer.expect("REQUESTING has an offer");
        self.last_request = now;
        let f = RequestFields {
            xid: self.xid,
            secs: self.secs(now),
            ciaddr: None,
            requested: Some(offer.address),
            server_id: Some(offer.server_id),
        };
        self.send(
            MessageType::Request,
            f,
            Ipv4Addr::UNSPECIFIED,
            Destination::Broadcast,
            out,
        );
        let at = now + self.backoff(self.attempt);
        self.set_timer(at, out);
    }

    /// REQUEST in RENEWING (unicast) or REBINDING (broadcast): ciaddr set,
    /// no options 50/54 (RFC 2131 table 5).
    fn send_extend(&mut self, now: Instant, out: &mut Vec<Action>) {
        let lease = self.lease.clone().expect("renewing/rebinding has a lease");
        self.last_request = now;
        let f = RequestFields {
            xid: self.xid,
            secs: self.secs(now),
            ciaddr: Some(lease.address),
            requested: None,
            server_id: None,
        };
        let (dst, limit) = if self.state == State::Renewing {
            (
                Destination::Unicast {
                    ip: lease.server_id,
                    mac: lease.server_mac,
                },
                lease.t2_at(),
            )
        } else {
            (Destination::Broadcast, lease.expires_at())
        };
        self.send(MessageType::Request, f, lease.address, dst, out);
        let at = self.renew_deadline(now, limit);
        self.set_timer(at, out);
    }

    fn timer(&mut self, now: Instant, out: &mut Vec<Action>) {
        let Some(deadline) = self.deadline else {
            return;
        };
        if now < deadline {
            // Early or stale wake-up: keep the real deadline.
            out.push(Action::SetTimer(deadline));
            return;
        }
        self.deadline = None;
        match self.state {
            State::Init => self.discover(now, 0, out),
            State::Selecting | State::Requesting => {
                let capped = self.at_cap(self.attempt);
                self.attempt = self.attempt.saturating_add(1);
                if capped {
                    // Past the cap: a fresh exchange, still at the cap.
                    let attempt = self.attempt;
                    self.discover(now, attempt, out);
                } else if self.state == State::Selecting {
                    self.send_discover(now, out);
                } else {
                    self.send_selecting_request(now, out);
                }
            }
            State::InitReboot => {
                self.attempt = self.attempt.saturating_add(1);
                if self.attempt < self.timing.init_reboot_tries {
                    self.send_init_reboot(now, out);
                    return;
                }
                self.rebooting = None;
                let stored = self.stored.take();
                match stored {
                    // No answer: RFC 2131 §3.2 lets the client keep using
                    // an unexpired lease; a VIP that stays up is better
                    // than one that vanishes because the server is down.
                    Some(l) if l.expires_at() > now => {
                        out.push(Action::ConfigureAddress {
                            address: l.address,
                            prefix_len: l.prefix_len,
                        });
                        out.push(Action::ArpAnnounce(l.address));
                        self.state = State::Bound;
                        let t1 = l.t1_at();
                        self.lease = Some(l);
                        self.set_timer(t1.max(now), out);
                    }
                    _ => self.discover(now, 0, out),
                }
            }
            State::Checking => {}
            State::Bound => {
                // Past T2 already (a lease adopted or resumed late): RFC
                // 2131 §4.4.5 has the client rebinding from T2 on.
                let t2 = self.lease.as_ref().map(Lease::t2_at);
                self.state = if t2.is_some_and(|t2| now >= t2) {
                    State::Rebinding
                } else {
                    State::Renewing
                };
                self.fresh_xid();
                self.exchange_started = now;
                self.send_extend_or_expire(now, out);
            }
            State::Renewing => {
                let t2 = self.lease.as_ref().map(Lease::t2_at);
                if t2.is_some_and(|t2| now >= t2) {
                    self.state = State::Rebinding;
                }
                self.send_extend_or_expire(now, out);
            }
            State::Rebinding => self.send_extend_or_expire(now, out),
            State::Expired | State::Stopped => {}
        }
    }

    fn send_extend_or_expire(&mut self, now: Instant, out: &mut Vec<Action>) {
        let Some(lease) = self.lease.clone() else {
            return self.discover(now, 0, out);
        };
        if now >= lease.expires_at() {
            out.push(Action::RemoveAddress(lease.address));
            self.lease = None;
            self.hint = Some(lease.address);
            return self.discover(now, 0, out);
        }
        self.send_extend(now, out);
    }

    fn received(&mut self, now: Instant, payload: &[u8], src_mac: [u8; 6], out: &mut Vec<Action>) {
        self.counters.received += 1;
        let reply = match packet::parse_reply(payload) {
            Ok(r) => r,
            Err(e) => {
                self.counters.malformed += 1;
                return self.drop_packet(format!("malformed: {e}"));
            }
        };
        if reply.chaddr != self.id.mac {
            return self.drop_packet("chaddr is not ours".into());
        }
        if reply.xid != self.xid {
            return self.drop_packet(format!(
                "xid {:#010x} does not match {:#010x}",
                reply.xid, self.xid
            ));
        }
        match (self.state, reply.msg_type) {
            (State::Selecting, MessageType::Offer) => self.offer(now, &reply, out),
            (State::Requesting, MessageType::Ack) => {
                let offer = self.offer.expect("REQUESTING has an offer");
                if reply.server_id.is_some_and(|s| s != offer.server_id) {
                    return self.drop_packet("ACK from another server".into());
                }
                if reply.yiaddr != offer.address {
                    return self.drop_packet("ACK for another address".into());
                }
                let Some(lease) = self.lease_from(&reply, Some(offer.server_id), src_mac) else {
                    return;
                };
                if self.timing.arp_probe {
                    self.state = State::Checking;
                    self.deadline = None;
                    out.push(Action::ArpProbe(lease.address));
                    self.candidate = Some(lease);
                } else {
                    self.bind(now, lease, out);
                }
            }
            (State::InitReboot, MessageType::Ack) => {
                let want = self.rebooting;
                if Some(reply.yiaddr) != want {
                    return self.drop_packet("INIT-REBOOT ACK for another address".into());
                }
                let Some(lease) = self.lease_from(&reply, None, src_mac) else {
                    return;
                };
                self.stored = None;
                self.rebooting = None;
                self.bind(now, lease, out);
            }
            (State::Renewing | State::Rebinding, MessageType::Ack) => {
                let current = self.lease.clone().expect("renewing has a lease");
                let Some(lease) = self.lease_from(&reply, Some(current.server_id), src_mac) else {
                    return;
                };
                if lease.address != current.address {
                    // The server moved us: drop the old address first.
                    out.push(Action::RemoveAddress(current.address));
                    self.lease = None;
                }
                self.bind(now, lease, out);
            }
            (State::Requesting, MessageType::Nak) => {
                let offer = self.offer.expect("REQUESTING has an offer");
                if reply.server_id.is_some_and(|s| s != offer.server_id) {
                    return self.drop_packet("NAK from another server".into());
                }
                self.nak(now, out);
            }
            (State::InitReboot | State::Renewing | State::Rebinding, MessageType::Nak) => {
                self.nak(now, out)
            }
            (state, ty) => self.drop_packet(format!("{ty:?} in {}", state.as_str())),
        }
    }

    fn offer(&mut self, now: Instant, reply: &Reply, out: &mut Vec<Action>) {
        let usable = !reply.yiaddr.is_unspecified()
            && !reply.yiaddr.is_broadcast()
            && !reply.yiaddr.is_multicast()
            && !reply.yiaddr.is_loopback();
        let Some(server_id) = reply.server_id.filter(|_| usable) else {
            return self.drop_packet("OFFER without a usable address or server id".into());
        };
        self.offer = Some(Offer {
            address: reply.yiaddr,
            server_id,
        });
        self.state = State::Requesting;
        self.attempt = 0;
        self.send_selecting_request(now, out);
    }

    /// Builds the lease from an ACK; `None` (dropped) without a lease time.
    fn lease_from(
        &mut self,
        reply: &Reply,
        server: Option<Ipv4Addr>,
        src_mac: [u8; 6],
    ) -> Option<Lease> {
        let Some(secs) = reply.lease_secs else {
            self.drop_packet("ACK without a lease time (option 51)".into());
            return None;
        };
        let Some(server_id) = reply.server_id.or(server) else {
            self.drop_packet("ACK without a server identifier (option 54)".into());
            return None;
        };
        let lease_time = Duration::from_secs(u64::from(secs.max(MIN_LEASE_SECS)));
        let (t1, t2) = timers(lease_time, reply.t1_secs, reply.t2_secs);
        let prefix_len = reply
            .subnet_mask
            .map(u32::from)
            .filter(|m| m.leading_ones() + m.trailing_zeros() == 32)
            .map_or(32, |m| m.leading_ones() as u8);
        Some(Lease {
            address: reply.yiaddr,
            prefix_len,
            server_id,
            server_mac: src_mac,
            routers: reply.routers.clone(),
            lease_time,
            t1,
            t2,
            acquired: self.last_request,
        })
    }

    fn bind(&mut self, now: Instant, lease: Lease, out: &mut Vec<Action>) {
        let already = self
            .lease
            .as_ref()
            .is_some_and(|l| l.address == lease.address);
        if !already {
            out.push(Action::ConfigureAddress {
                address: lease.address,
                prefix_len: lease.prefix_len,
            });
            out.push(Action::ArpAnnounce(lease.address));
        }
        out.push(Action::Persist(lease.clone()));
        self.state = State::Bound;
        self.attempt = 0;
        self.consecutive_naks = 0;
        self.hint = Some(lease.address);
        let t1 = lease.t1_at();
        self.lease = Some(lease);
        self.set_timer(t1.max(now), out);
    }

    fn nak(&mut self, now: Instant, out: &mut Vec<Action>) {
        self.counters.naks += 1;
        if let Some(l) = self.lease.take() {
            out.push(Action::RemoveAddress(l.address));
        }
        if let Some(l) = self.stored.take() {
            // Left on the interface by an earlier run, perhaps.
            out.push(Action::RemoveAddress(l.address));
        }
        out.push(Action::Forget);
        // The server refused this address: do not ask for it again.
        self.hint = None;
        self.rebooting = None;
        self.offer = None;
        // RFC 2131: restart. When many leases start together (a failover)
        // a server that offers one free address to several of them NAKs all
        // but one, and losers that rediscover in the same instant meet again
        // every round (seen with dnsmasq: a hundred leases, some NAKed seven
        // times over a minute). So the restart waits a random moment, up to
        // NAK_RESTART_SPREAD after the first NAK; repeated NAKs double that
        // (random in the upper half: 0.2–0.4 s, 0.4–0.8 s, … up to
        // `backoff_max`) so a confused server cannot drive a tight loop.
        let n = self.consecutive_naks;
        self.consecutive_naks = n.saturating_add(1);
        let cap = NAK_RESTART_SPREAD
            .saturating_mul(1 << n.min(16))
            .min(self.timing.backoff_max)
            .as_millis() as u64;
        let wait_ms = if n == 0 {
            self.rng.u64(0..=cap)
        } else {
            cap / 2 + self.rng.u64(0..=cap / 2)
        };
        self.state = State::Init;
        self.set_timer(now + Duration::from_millis(wait_ms), out);
    }

    fn probe_result(
        &mut self,
        now: Instant,
        address: Ipv4Addr,
        conflict: bool,
        out: &mut Vec<Action>,
    ) {
        if self.state != State::Checking {
            return;
        }
        let Some(lease) = self.candidate.take_if(|l| l.address == address) else {
            return;
        };
        if !conflict {
            return self.bind(now, lease, out);
        }
        // RFC 2131 §4.4.1: DECLINE, then restart after at least 10 s.
        self.counters.declines += 1;
        let f = RequestFields {
            xid: self.xid,
            secs: 0,
            ciaddr: None,
            requested: Some(lease.address),
            server_id: Some(lease.server_id),
        };
        self.send(
            MessageType::Decline,
            f,
            Ipv4Addr::UNSPECIFIED,
            Destination::Broadcast,
            out,
        );
        self.hint = None;
        self.offer = None;
        self.state = State::Init;
        self.set_timer(now + self.timing.decline_wait, out);
    }

    fn stop(&mut self, now: Instant, mode: StopMode, out: &mut Vec<Action>) {
        // An expired address is still this client's lease at the server:
        // a release frees it there too.
        let held = self
            .lease
            .take()
            .filter(|_| self.state.holds_address() || self.state == State::Expired);
        if let (StopMode::Release, Some(l)) = (mode, &held) {
            self.fresh_xid();
            self.exchange_started = now;
            let f = RequestFields {
                xid: self.xid,
                secs: 0,
                ciaddr: Some(l.address),
                requested: None,
                server_id: Some(l.server_id),
            };
            self.send(
                MessageType::Release,
                f,
                l.address,
                Destination::Unicast {
                    ip: l.server_id,
                    mac: l.server_mac,
                },
                out,
            );
        }
        if let Some(l) = &held {
            out.push(Action::RemoveAddress(l.address));
        }
        if matches!(mode, StopMode::Release) {
            out.push(Action::Forget);
        }
        self.state = State::Stopped;
        self.deadline = None;
        self.candidate = None;
    }
}

/// T1/T2 from options 58/59 when they are consistent (T1 ≤ T2 ≤ lease),
/// else RFC 2131's 0.5 and 0.875 of the lease.
/// The shortest lease taken: a server's 0 or 1 s (a misconfiguration, or
/// a hostile server) would otherwise have every lease renewed in a tight
/// loop and the address expire between two packets. dhcpcd floors it at 20 s
/// too; a server that means a shorter lease NAKs the next renewal.
pub(crate) const MIN_LEASE_SECS: u32 = 20;

pub(crate) fn timers(lease: Duration, t1: Option<u32>, t2: Option<u32>) -> (Duration, Duration) {
    let secs = |s: u32| Duration::from_secs(u64::from(s));
    let t2 = t2
        .map(secs)
        .filter(|t2| *t2 <= lease)
        .unwrap_or(lease.mul_f64(0.875));
    let t1 = t1
        .map(secs)
        .filter(|t1| *t1 <= t2)
        .unwrap_or_else(|| lease.mul_f64(0.5).min(t2));
    (t1, t2)
}
