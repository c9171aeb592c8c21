//! One node's membership of its LAN, as a state machine with no I/O:
//! packets and timers in, packets to send and timers to set out
//! ([`Out`]), the way the DHCP engine is built. The transport
//! (`membership::transport`) owns the socket and the clock.
//!
//! Two layers:
//!
//! - SWIM (`foca`): every member probes a random other each
//!   [`Settings::probe_period`], asks others to probe it indirectly when it
//!   does not answer, suspects it, and spreads the news by gossip. Its view
//!   of who is alive is reported (`status.lan.alive`); its verdicts move
//!   nothing: each is one member's, reached at a random moment and
//!   repeated by gossip.
//! - Witnesses: each node is watched by the [`WITNESSES`] nodes after it on
//!   a hash ring (`hna_contract::membership`). A witness probes each node it
//!   watches itself, every [`Settings::witness_every`], and reports it
//!   down (in its own status) only once its probes have gone unanswered
//!   for longer than that node's address lifetime (which its answers
//!   carry) plus [`Settings::margin`]: by then the dead node's kernel has
//!   dropped every address it held (the lifetime is confirmed only while
//!   its agent runs), so the node the controller moves its Services to
//!   cannot answer beside it, even though a frozen holder's kernel still
//!   answers ARP with the Service's own MAC, which the takeover guard
//!   cannot tell from the new holder's. The controller moves a node's
//!   Services when two of its witnesses agree, so a node is moved on
//!   independent voices that each tried to reach it, never on one. A node
//!   that stood down ([`Member::set_stood_down`]: it holds nothing and
//!   cannot read its assignments) says so in its answers, and is reported
//!   while it answers.
//!
//! Every packet travels sealed (`membership::wire`); what the gate drops is
//! counted and never reaches SWIM. Packets go only to the peers the
//! controller named: an address learned from gossip is never sent to.
//!
//! [`WITNESSES`]: hna_contract::membership::WITNESSES

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddrV4;
use std::num::{NonZeroU8, NonZeroUsize};
use std::sync::Arc;
use std::time::Duration;

use foca::{Config, Foca, NoCustomBroadcast, Notification, PeriodicParams, Runtime};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;

use super::codec::Codec;
pub(crate) use super::identity::Id;
use super::wire::{self, Dropped, Gate, Key, Stamp};
use hna_contract::membership::witnessed_by;

/// The protocol's timing.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    /// How often each member probes another (SWIM's protocol period).
    pub(crate) probe_period: Duration,
    /// How long a direct probe waits before indirect ones are asked for.
    pub(crate) probe_rtt: Duration,
    /// How long a suspect may refute before SWIM declares it down.
    pub(crate) suspect_to_down: Duration,
    /// How often a witness probes each node it watches.
    pub(crate) witness_every: Duration,
    /// Added to a node's address lifetime before its witness may report
    /// it: scheduling, clock rates and the probe in flight.
    pub(crate) margin: Duration,
    /// This node's own address lifetime (`lb_address_lifetime`), told to
    /// its witnesses in every answer.
    pub(crate) own_lifetime: Duration,
    /// The lifetime assumed of a node that has not said its own yet.
    pub(crate) default_lifetime: Duration,
    /// How often peers SWIM does not count as alive are announced to.
    pub(crate) join_every: Duration,
    /// A peer not heard for this long counts as silent for this node's own
    /// fence ([`Hearing`]): three of its witness probes missed.
    pub(crate) silent_after: Duration,
}

impl Default for Settings {
    /// A dead node is reported by its witnesses 1.25-1.35 s after it died
    /// (its 1 s address lifetime, the margin, and the probe interval): the
    /// controller's move, the new holder's guard and its DHCP round trip
    /// follow within about 0.3 s, under the 2 s the failover is allowed.
    /// Ten probes a second to each of three watched nodes, and their
    /// answers: about 60 small packets a second per node.
    fn default() -> Settings {
        Settings {
            probe_period: Duration::from_millis(300),
            probe_rtt: Duration::from_millis(100),
            suspect_to_down: Duration::from_millis(900),
            witness_every: Duration::from_millis(100),
            margin: WITNESS_MARGIN,
            own_lifetime: Duration::from_secs(1),
            default_lifetime: Duration::from_secs(1),
            join_every: Duration::from_secs(1),
            silent_after: Duration::from_millis(300),
        }
    }
}

/// How much longer than a watched node's address lifetime its probes go
/// unanswered before its witness reports it ([`Settings::margin`]).
pub(crate) const WITNESS_MARGIN: Duration = Duration::from_millis(250);

/// A timer the state machine set; handed back through [`Member::timer`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Timer {
    Swim(foca::Timer<Id>),
    /// The witnesses' next round of probes.
    Witness,
    /// Announce to the peers SWIM does not count as alive.
    Join,
}

/// What the transport is to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Out {
    Send { to: SocketAddrV4, packet: Vec<u8> },
    After { after: Duration, timer: Timer },
}

/// The first byte of a sealed payload.
const KIND_SWIM: u8 = 0;
const KIND_PING: u8 = 1;
/// An answer to a witness's probe: the nonce (4 bytes), the node's address
/// lifetime in ms (4), its flags (1) and the prober's name (1 byte of
/// length, then the name); each absent from older agents (no flags read
/// as none, no name as unchecked): a witness reads what it knows and
/// ignores the rest, so either side may be the older. Only an answer whose
/// nonce is one of the witness's recent probes' counts (issue #49: any
/// authentic packet did, and one captured and replayed to a restarted
/// witness, whose replay record was new, kept a dead node heard).
const KIND_PONG: u8 = 2;

/// How many of its latest probes to a node a witness takes answers to:
/// an answer that comes this many probe rounds late is no answer.
const PROBES_ANSWERABLE: usize = 5;

/// A flag of a probe's answer: this node stood down
/// ([`Member::set_stood_down`]).
const FLAG_STOOD_DOWN: u8 = 0x01;

/// A witness's word to the node it watches, sent after each probe: its
/// run (8 bytes), how many of its accusations of that node the API server
/// acknowledged in that run (4) and its flags (1). Its own kind, so that
/// an older agent, which counts it as a SWIM error and ignores it, still
/// answers the probe beside it.
const KIND_ATTEST: u8 = 3;

/// A flag of a witness's word: the API server's latest word from it
/// lists the node as down.
const FLAG_ACCUSING: u8 = 0x01;

/// A witness sends its word with every this many rounds of probes (300
/// ms), and at once when it changes: often enough that a node back on its
/// LAN hears it within a fraction of a second, and a third of the packets
/// a word with every probe would cost (a VM resumed from a long pause
/// works through what was queued for it before its agent acts).
const WORD_EVERY_ROUNDS: u64 = 3;

/// What the API server acknowledged of this node's accusations
/// ([`Member::set_acknowledged`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Acknowledged {
    /// Per peer: how many acknowledged writes newly listed it as down.
    pub(crate) accusations: BTreeMap<String, u32>,
    /// Listed as down in the last acknowledged write.
    pub(crate) accusing: BTreeSet<String>,
}

impl Acknowledged {
    /// A write listing `down` was acknowledged: each name new in it counts
    /// once more.
    pub(crate) fn record(&mut self, down: &[String]) {
        for n in down {
            if !self.accusing.contains(n) {
                *self.accusations.entry(n.clone()).or_default() += 1;
            }
        }
        self.accusing = down.iter().cloned().collect();
    }
}

/// A witness's word on the node it watches, without its times: what a run
/// keeps for the next (`loadbalancer::kept`) and compares the witness's
/// next word with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct Word {
    /// The witness's run: a new one forgets what the old one wrote.
    pub(crate) run: u64,
    /// Its acknowledged accusations of the node, in that run.
    pub(crate) accusations: u32,
    /// Its last acknowledged write lists the node as down.
    pub(crate) accusing: bool,
}

/// One witness's word on this node, as last heard: what the controller may
/// have read from it (`loadbalancer::lan_word` decides with it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Attestation {
    pub(crate) word: Word,
    /// When the word last changed (first heard, included).
    pub(crate) changed: Instant,
    /// When it was last heard.
    pub(crate) heard: Instant,
}

/// What a witness knows of a node it watches.
#[derive(Debug, Clone, Default)]
struct Watched {
    /// The last authentic packet from it.
    heard: Option<Instant>,
    /// The last probe sent to it.
    probed: Option<Instant>,
    /// The first probe of the unanswered run, if the last one is
    /// unanswered.
    silent_since: Option<Instant>,
    /// Its address lifetime, as its answers say.
    lifetime: Option<Duration>,
    /// Reported down since.
    down_since: Option<Instant>,
    /// Its last answer said it stood down: reported down while it says
    /// so, though it answers.
    stood_down: bool,
    /// The nonces of the latest probes sent to it, newest last.
    nonces: std::collections::VecDeque<u32>,
}

/// What this node hears of its LAN, for its own fence: the mirror of its
/// witnesses' verdict. A node that cannot hear enough of its witnesses to
/// be moved by them (or hears none of its peers) is likely the one cut
/// off, and must let go of its addresses before they report it, unless
/// the API server heard from it since (then the controller decides).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Hearing {
    /// Since when no peer has been heard (none for [`Settings::silent_after`];
    /// `None`: one was, or none ever was).
    pub(crate) none_since: Option<Instant>,
    /// Since when [`Hearing::convicting`] of this node's witnesses have
    /// been silent (each heard before, none for `silent_after`).
    pub(crate) short_since: Option<Instant>,
    /// This node's witnesses that are silent, sorted.
    pub(crate) silent: Vec<String>,
    /// How many witnesses' reports move a node (two, or all it has when
    /// fewer), as the controller counts them.
    pub(crate) convicting: usize,
}

/// Counters, for metrics and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Counters {
    /// SWIM payloads that did not parse or that SWIM refused.
    pub(crate) swim_errors: u64,
    /// Packets SWIM wanted to send to a member the controller did not name.
    pub(crate) not_a_peer: u64,
    /// Witness probes sent.
    pub(crate) witness_probes: u64,
    /// Answers to no recent probe of this witness's (late, replayed, or
    /// meant for another): not taken as a sign of life.
    pub(crate) unmatched_answers: u64,
}

/// One node's membership.
pub(crate) struct Member {
    me: Id,
    settings: Settings,
    foca: Foca<Id, Codec, SmallRng, NoCustomBroadcast>,
    rng: SmallRng,
    gate: Gate,
    seal_with: Key,
    sequence: u64,
    peers: BTreeMap<Arc<str>, SocketAddrV4>,
    watched: BTreeMap<Arc<str>, Watched>,
    /// The last authentic packet from any peer.
    heard_any: Option<Instant>,
    /// The last authentic packet from each peer.
    heard: BTreeMap<Arc<str>, Instant>,
    /// This node's own witnesses (the ring's, among the peers).
    witnesses: Vec<Arc<str>>,
    /// When the peers were last set (silence before it counts from then).
    since: Instant,
    counters: Counters,
    out: Vec<Out>,
    /// This node stood down ([`Member::set_stood_down`]): its answers to
    /// its witnesses say so.
    stood_down: bool,
    /// Its own accusations the API server acknowledged, told to each
    /// accused with every probe.
    acknowledged: Acknowledged,
    /// Its witnesses' word on it.
    attested: BTreeMap<Arc<str>, Attestation>,
    /// Rounds of witness probes so far.
    rounds: u64,
    /// Its word changed since it was last sent.
    word_changed: bool,
}

/// Collects what `foca` asks for during one call.
#[derive(Default)]
struct Collect {
    send: Vec<(Id, Vec<u8>)>,
    after: Vec<(Duration, foca::Timer<Id>)>,
}

impl Runtime<Id> for Collect {
    fn notify(&mut self, _n: Notification<'_, Id>) {}

    fn send_to(&mut self, to: Id, data: &[u8]) {
        self.send.push((to, data.to_vec()));
    }

    fn submit_after(&mut self, event: foca::Timer<Id>, after: Duration) {
        self.after.push((after, event));
    }
}

impl Member {
    /// `keys`: the first seals, all open (a rotation has two). `run`: when
    /// this run of the agent began (Unix ms).
    pub(crate) fn new(
        name: &str,
        addr: SocketAddrV4,
        run: u64,
        keys: Vec<Key>,
        settings: Settings,
        seed: u64,
        now: Instant,
    ) -> Option<Member> {
        let seal_with = keys.first()?.clone();
        let me = Id {
            name: Arc::from(name),
            addr,
            run,
            renewal: 0,
        };
        let config = Config {
            probe_period: settings.probe_period,
            probe_rtt: settings.probe_rtt,
            num_indirect_probes: NonZeroUsize::new(3).expect("nonzero"),
            max_transmissions: NonZeroU8::new(10).expect("nonzero"),
            suspect_to_down_after: settings.suspect_to_down,
            remove_down_after: Some(Duration::from_secs(3600)),
            max_packet_size: NonZeroUsize::new(wire::MAX_PAYLOAD - 1).expect("nonzero"),
            notify_down_members: true,
            periodic_announce: Some(PeriodicParams {
                frequency: Duration::from_secs(30),
                num_members: NonZeroUsize::new(1).expect("nonzero"),
            }),
            periodic_announce_to_down_members: Some(PeriodicParams {
                frequency: Duration::from_secs(10),
                num_members: NonZeroUsize::new(2).expect("nonzero"),
            }),
            periodic_gossip: Some(PeriodicParams {
                frequency: Duration::from_millis(100),
                num_members: NonZeroUsize::new(3).expect("nonzero"),
            }),
        };
        let foca = Foca::new(me.clone(), config, SmallRng::seed_from_u64(seed), Codec);
        let mut m = Member {
            me,
            settings,
            foca,
            rng: SmallRng::seed_from_u64(seed ^ 0x5eed),
            gate: Gate::new(keys, BTreeSet::new()),
            seal_with,
            sequence: 0,
            peers: BTreeMap::new(),
            watched: BTreeMap::new(),
            heard_any: None,
            heard: BTreeMap::new(),
            witnesses: Vec::new(),
            since: now,
            counters: Counters::default(),
            out: Vec::new(),
            stood_down: false,
            acknowledged: Acknowledged::default(),
            attested: BTreeMap::new(),
            rounds: 0,
            word_changed: false,
        };
        m.out.push(Out::After {
            after: Duration::ZERO,
            timer: Timer::Join,
        });
        m.out.push(Out::After {
            after: Duration::ZERO,
            timer: Timer::Witness,
        });
        Some(m)
    }

    /// The peers the controller named (this node excluded): only they are
    /// admitted, sent to and watched.
    pub(crate) fn set_peers(&mut self, peers: &[(String, SocketAddrV4)], now: Instant) {
        let new: BTreeMap<Arc<str>, SocketAddrV4> = peers
            .iter()
            .filter(|(n, _)| **n != *self.me.name)
            .map(|(n, a)| (Arc::from(n.as_str()), *a))
            .collect();
        if new == self.peers {
            return;
        }
        self.peers = new;
        self.since = now;
        self.gate
            .set_members(self.peers.keys().map(|n| n.to_string()).collect());
        let watch: BTreeSet<String> = witnessed_by(self.peers.keys().map(|n| &**n), &self.me.name)
            .into_iter()
            .collect();
        self.watched.retain(|n, _| watch.contains(&**n));
        for n in watch {
            self.watched.entry(Arc::from(n.as_str())).or_default();
        }
        let members = self.peers.keys().map(|n| &**n).chain([&*self.me.name]);
        self.witnesses = hna_contract::membership::witnesses_of(members, &self.me.name)
            .into_iter()
            .map(|n| Arc::from(n.as_str()))
            .collect();
        self.heard.retain(|n, _| self.peers.contains_key(n));
        let witnesses = &self.witnesses;
        self.attested.retain(|n, _| witnesses.contains(n));
        self.join();
    }

    /// A new key set (the first seals).
    pub(crate) fn set_keys(&mut self, keys: Vec<Key>) {
        if let Some(k) = keys.first() {
            self.seal_with = k.clone();
            self.gate.set_keys(keys);
        }
    }

    /// This node holds none of its addresses and cannot read its
    /// assignments (its API path is cut): from its next answer on, its
    /// witnesses report it down while they hear it, so that its Services
    /// move, as they would were it silent. It keeps answering, and keeps
    /// witnessing for others: going silent instead would take a witness
    /// from every node it watches. `false`: it serves again, and its next
    /// answer withdraws the report.
    pub(crate) fn set_stood_down(&mut self, stood_down: bool) {
        self.stood_down = stood_down;
    }

    /// What the API server acknowledged of this node's accusations: from
    /// the next probe on, each accused is told what concerns it.
    pub(crate) fn set_acknowledged(&mut self, acknowledged: Acknowledged) {
        if self.acknowledged != acknowledged {
            self.word_changed = true;
            self.acknowledged = acknowledged;
        }
    }

    /// Its witnesses' words as an earlier run of this agent last heard
    /// them, taken as heard `at` (before this run's lapse began): a
    /// witness's next word that is the same has not changed since.
    pub(crate) fn seed_attestations(&mut self, words: &BTreeMap<String, Word>, at: Instant) {
        for (name, w) in words {
            let Some(name) = self.witnesses.iter().find(|n| ***n == **name).cloned() else {
                continue;
            };
            self.attested.entry(name).or_insert(Attestation {
                word: *w,
                changed: at,
                heard: at,
            });
        }
    }

    /// Its witnesses' word on this node, as last heard from each.
    pub(crate) fn attestations(&self) -> BTreeMap<String, Attestation> {
        self.attested
            .iter()
            .map(|(n, a)| (n.to_string(), *a))
            .collect()
    }

    /// A witness's word on this node ([`KIND_ATTEST`]); from anyone but
    /// its witnesses, or cut short, it is not taken.
    fn attested_by(&mut self, name: &Arc<str>, word: &[u8], now: Instant) -> bool {
        if word.len() < 13 || !self.witnesses.contains(name) {
            return false;
        }
        let word = Word {
            run: u64::from_be_bytes(word[..8].try_into().expect("8 bytes")),
            accusations: u32::from_be_bytes(word[8..12].try_into().expect("4 bytes")),
            accusing: word[12] & FLAG_ACCUSING != 0,
        };
        match self.attested.get_mut(name) {
            Some(a) if a.word == word => a.heard = now,
            _ => {
                self.attested.insert(
                    name.clone(),
                    Attestation {
                        word,
                        changed: now,
                        heard: now,
                    },
                );
            }
        }
        true
    }

    /// An answer from `name` to a probe (`rest`: the answer after its
    /// kind): it counts only when it answers one of this witness's recent
    /// probes of it, and names this witness when it names anyone.
    fn answered(&mut self, name: &Arc<str>, rest: &[u8], now: Instant) {
        let me = self.me.name.clone();
        let Some(w) = self.watched.get_mut(name) else {
            return;
        };
        let Some(nonce) = rest.get(..4) else {
            self.counters.unmatched_answers += 1;
            return;
        };
        let nonce = u32::from_be_bytes(nonce.try_into().expect("4 bytes"));
        let to_me = match rest.get(9).map(|n| usize::from(*n)) {
            Some(n) => rest.get(10..10 + n).is_some_and(|to| to == me.as_bytes()),
            None => true,
        };
        let Some(at) = w.nonces.iter().position(|n| *n == nonce).filter(|_| to_me) else {
            self.counters.unmatched_answers += 1;
            return;
        };
        // Each probe is answered once: an answer to it again is a replay.
        w.nonces.remove(at);
        w.heard = Some(now);
        w.silent_since = None;
        if let Some(ms) = rest.get(4..8) {
            let ms = u32::from_be_bytes([ms[0], ms[1], ms[2], ms[3]]);
            w.lifetime = Some(Duration::from_millis(u64::from(ms)));
        }
        let stood_down = rest.get(8).is_some_and(|f| f & FLAG_STOOD_DOWN != 0);
        if stood_down && !w.stood_down {
            tracing::info!(
                peer = %name,
                "a witnessed peer says it stood down (it holds none of its addresses and cannot read its assignments): reporting it dead on the LAN"
            );
        } else if !stood_down && w.stood_down {
            tracing::info!(peer = %name, "a witnessed peer no longer stands down");
        }
        w.stood_down = stood_down;
        if w.stood_down {
            w.down_since.get_or_insert(now);
        } else {
            w.down_since = None;
        }
    }

    /// A packet arrived.
    pub(crate) fn receive(&mut self, packet: &[u8], now: Instant) {
        let Some((sender, payload)) = self.gate.admit(packet) else {
            return;
        };
        let Some(name) = self.peers.get_key_value(sender).map(|(n, _)| n.clone()) else {
            return;
        };
        self.heard_any = Some(now);
        self.heard.insert(name.clone(), now);
        if let Some((&KIND_PONG, rest)) = payload.split_first() {
            self.answered(&name, rest, now);
        }
        match payload.split_first() {
            Some((&KIND_SWIM, data)) => {
                // Speaking for another member is refused, however sealed.
                use foca::Codec as _;
                match Codec.decode_header(data) {
                    Ok(h) if *h.src.name == *name => {}
                    _ => {
                        self.counters.swim_errors += 1;
                        return;
                    }
                }
                let mut rt = Collect::default();
                if self.foca.handle_data(data, &mut rt).is_err() {
                    self.counters.swim_errors += 1;
                }
                self.run_collected(rt);
            }
            Some((&KIND_PING, nonce)) if nonce.len() == 4 => {
                let mut reply = vec![KIND_PONG];
                reply.extend_from_slice(nonce);
                let ms = u32::try_from(self.settings.own_lifetime.as_millis()).unwrap_or(u32::MAX);
                reply.extend_from_slice(&ms.to_be_bytes());
                reply.push(if self.stood_down { FLAG_STOOD_DOWN } else { 0 });
                reply.push(name.len() as u8);
                reply.extend_from_slice(name.as_bytes());
                self.send_to(&name, &reply);
            }
            Some((&KIND_PONG, _)) => {}
            Some((&KIND_ATTEST, word)) => {
                if !self.attested_by(&name, word, now) {
                    self.counters.swim_errors += 1;
                }
            }
            _ => self.counters.swim_errors += 1,
        }
    }

    /// A timer this machine set fired.
    pub(crate) fn timer(&mut self, t: Timer, now: Instant) {
        match t {
            Timer::Swim(t) => {
                let mut rt = Collect::default();
                if self.foca.handle_timer(t, &mut rt).is_err() {
                    self.counters.swim_errors += 1;
                }
                self.run_collected(rt);
            }
            Timer::Join => {
                self.join();
                self.out.push(Out::After {
                    after: self.settings.join_every,
                    timer: Timer::Join,
                });
            }
            Timer::Witness => {
                self.witness_round(now);
                self.out.push(Out::After {
                    after: self.settings.witness_every,
                    timer: Timer::Witness,
                });
            }
        }
    }

    /// Leaves the cluster (a stop that hands the addresses over): the peers
    /// learn at once instead of after a probe.
    pub(crate) fn leave(&mut self) {
        let mut rt = Collect::default();
        let _ = self.foca.leave_cluster(&mut rt);
        self.run_collected(rt);
    }

    /// What to do, since the last call.
    pub(crate) fn drain(&mut self) -> Vec<Out> {
        std::mem::take(&mut self.out)
    }

    /// The nodes this one watches and found dead (sorted).
    pub(crate) fn down(&self) -> Vec<String> {
        self.watched
            .iter()
            .filter(|(_, w)| w.down_since.is_some())
            .map(|(n, _)| n.to_string())
            .collect()
    }

    /// The nodes this one watches whose probes it hears answered
    /// (sorted): heard, and not reported down since. A probe or two lost
    /// changes nothing (no status write for it).
    pub(crate) fn hears(&self) -> Vec<String> {
        self.watched
            .iter()
            .filter(|(_, w)| w.heard.is_some() && w.down_since.is_none())
            .map(|(n, _)| n.to_string())
            .collect()
    }

    /// What this node hears of its LAN at `now`, for its own fence. A
    /// witness never heard does not count as silent, as a witness never
    /// reports a node it never heard.
    pub(crate) fn hearing(&self, now: Instant) -> Hearing {
        let silent_after = self.settings.silent_after;
        let quiet = |at: Instant| now.saturating_duration_since(at) >= silent_after;
        let none_since = self.heard_any.filter(|at| quiet(*at));
        let mut silent: Vec<(Instant, String)> = self
            .witnesses
            .iter()
            .filter_map(|w| {
                let at = *self.heard.get(w)?;
                quiet(at).then(|| (at, w.to_string()))
            })
            .collect();
        silent.sort();
        let convicting = self.witnesses.len().min(2);
        let short_since =
            (convicting > 0 && silent.len() >= convicting).then(|| silent[convicting - 1].0);
        let mut silent: Vec<String> = silent.into_iter().map(|(_, n)| n).collect();
        silent.sort();
        Hearing {
            none_since,
            short_since,
            silent,
            convicting,
        }
    }

    /// This node's own witnesses (sorted).
    pub(crate) fn witnesses(&self) -> Vec<String> {
        let mut w: Vec<String> = self.witnesses.iter().map(|n| n.to_string()).collect();
        w.sort();
        w
    }

    /// The nodes this one watches.
    #[cfg(test)]
    pub(crate) fn watching(&self) -> Vec<String> {
        self.watched.keys().map(|n| n.to_string()).collect()
    }

    /// The last authentic packet from any peer (`None`: none yet).
    pub(crate) fn heard_any(&self) -> Option<Instant> {
        self.heard_any
    }

    pub(crate) fn has_peers(&self) -> bool {
        !self.peers.is_empty()
    }

    /// The peers SWIM counts as alive.
    pub(crate) fn alive(&self) -> usize {
        self.foca.num_members()
    }

    pub(crate) fn dropped(&self, why: Dropped) -> u64 {
        self.gate.dropped(why)
    }

    pub(crate) fn counters(&self) -> &Counters {
        &self.counters
    }

    fn join(&mut self) {
        let alive: BTreeSet<Arc<str>> = self
            .foca
            .iter_members()
            .map(|m| m.id().name.clone())
            .collect();
        let mut rt = Collect::default();
        let unknown: Vec<(Arc<str>, SocketAddrV4)> = self
            .peers
            .iter()
            .filter(|(n, _)| !alive.contains(*n))
            .map(|(n, a)| (n.clone(), *a))
            .collect();
        // A few at a time: a large LAN is learned through their feeds.
        for (name, addr) in unknown.into_iter().take(4) {
            let dst = Id {
                name,
                addr,
                run: 0,
                renewal: 0,
            };
            let _ = self.foca.announce(dst, &mut rt);
        }
        self.run_collected(rt);
    }

    fn run_collected(&mut self, rt: Collect) {
        for (after, t) in rt.after {
            self.out.push(Out::After {
                after,
                timer: Timer::Swim(t),
            });
        }
        for (to, data) in rt.send {
            let mut payload = Vec::with_capacity(data.len() + 1);
            payload.push(KIND_SWIM);
            payload.extend_from_slice(&data);
            let name = to.name.clone();
            self.send_to(&name, &payload);
        }
    }

    fn send_to(&mut self, name: &Arc<str>, payload: &[u8]) {
        let Some(to) = self.peers.get(name).copied() else {
            self.counters.not_a_peer += 1;
            return;
        };
        self.sequence += 1;
        let stamp = Stamp {
            epoch: self.me.run,
            sequence: self.sequence,
        };
        if let Ok(packet) = wire::seal(&self.seal_with, &self.me.name, stamp, payload) {
            self.out.push(Out::Send { to, packet });
        }
    }

    /// One round of the witness's probes: each watched node that answered
    /// before and whose last probe went unanswered is silent since that
    /// probe; silent for longer than its address lifetime and the margin,
    /// it is reported down (its kernel has dropped its addresses by then).
    /// Then the next probes.
    fn witness_round(&mut self, now: Instant) {
        let names: Vec<Arc<str>> = self.watched.keys().cloned().collect();
        let with_word = self.rounds.is_multiple_of(WORD_EVERY_ROUNDS) || self.word_changed;
        self.rounds += 1;
        self.word_changed = false;
        for name in names {
            let Some(w) = self.watched.get_mut(&name) else {
                continue;
            };
            // A node never heard is never reported: its membership may not
            // run yet (no key, no peers, UDP blocked), and silence from a
            // node that never spoke says nothing of the addresses it holds.
            // Its heartbeat judges it.
            if let (Some(probed), Some(_)) = (w.probed, w.heard) {
                let answered = w.heard.is_some_and(|h| h >= probed);
                if !answered {
                    let since = *w.silent_since.get_or_insert(probed);
                    // A node without a lifetime (`lb_address_lifetime = 0`)
                    // is given the default: its addresses never expire by
                    // themselves, so no wait makes a frozen one safe.
                    let bound = w
                        .lifetime
                        .filter(|l| !l.is_zero())
                        .unwrap_or(self.settings.default_lifetime)
                        + self.settings.margin;
                    if now.saturating_duration_since(since) >= bound && w.down_since.is_none() {
                        w.down_since = Some(now);
                        tracing::info!(
                            peer = %name,
                            silent_for = ?now.saturating_duration_since(since),
                            last_heard = ?w.heard.map(|h| now.saturating_duration_since(h)),
                            bound = ?bound,
                            "a witnessed peer answers no probe: reporting it dead on the LAN"
                        );
                    }
                }
            }
            w.probed = Some(now);
            let nonce = self.rng.next_u32();
            w.nonces.push_back(nonce);
            if w.nonces.len() > PROBES_ANSWERABLE {
                w.nonces.pop_front();
            }
            let mut ping = vec![KIND_PING];
            ping.extend_from_slice(&nonce.to_be_bytes());
            self.counters.witness_probes += 1;
            self.send_to(&name, &ping);
            if !with_word {
                continue;
            }
            let mut word = vec![KIND_ATTEST];
            word.extend_from_slice(&self.me.run.to_be_bytes());
            let accusations = self.acknowledged.accusations.get(&*name).copied();
            word.extend_from_slice(&accusations.unwrap_or(0).to_be_bytes());
            let accusing = self.acknowledged.accusing.contains(&*name);
            word.push(if accusing { FLAG_ACCUSING } else { 0 });
            self.send_to(&name, &word);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;

    use hna_contract::membership::witnesses_of;
    use rand::RngExt;

    fn key() -> Key {
        Key::new(1, &[7; 32]).unwrap()
    }

    enum Event {
        Deliver(usize, Vec<u8>),
        Timer(usize, u64, Timer),
    }

    /// A LAN of members on a virtual clock: packets take 1 ms (or are
    /// lost), timers fire when due.
    struct Lan {
        members: Vec<Member>,
        addrs: Vec<SocketAddrV4>,
        /// Per member: its run (timers of an older run are dropped), and
        /// whether it is cut off (sends and receives nothing).
        runs: Vec<u64>,
        cut: Vec<bool>,
        /// Pairs that cannot reach each other (a split LAN).
        split: Option<Box<dyn Fn(usize, usize) -> bool>>,
        loss: f64,
        rng: SmallRng,
        queue: BinaryHeap<Reverse<(Instant, u64)>>,
        events: BTreeMap<u64, Event>,
        seq: u64,
        now: Instant,
        delivered: BTreeMap<(String, usize), Vec<u8>>,
        /// Every packet delivered, while set (from, to, packet).
        capture: Option<Vec<(usize, usize, Vec<u8>)>>,
    }

    impl Lan {
        fn new(n: usize) -> Lan {
            let now = Instant::now();
            let addrs: Vec<SocketAddrV4> = (0..n)
                .map(|i| SocketAddrV4::new([10, 0, 0, 10 + i as u8].into(), 7947))
                .collect();
            let mut lan = Lan {
                members: Vec::new(),
                addrs,
                runs: vec![1; n],
                cut: vec![false; n],
                split: None,
                loss: 0.0,
                rng: SmallRng::seed_from_u64(42),
                queue: BinaryHeap::new(),
                events: BTreeMap::new(),
                seq: 0,
                now,
                delivered: BTreeMap::new(),
                capture: None,
            };
            for i in 0..n {
                let m = lan.member(i, 1);
                lan.members.push(m);
                lan.flush(i);
            }
            lan
        }

        fn name(i: usize) -> String {
            format!("node-{i}")
        }

        fn peers(&self) -> Vec<(String, SocketAddrV4)> {
            (0..self.addrs.len())
                .map(|i| (Lan::name(i), self.addrs[i]))
                .collect()
        }

        fn member(&self, i: usize, run: u64) -> Member {
            let mut m = Member::new(
                &Lan::name(i),
                self.addrs[i],
                run,
                vec![key()],
                Settings::default(),
                i as u64 * 1000 + run,
                self.now,
            )
            .unwrap();
            m.set_peers(&self.peers(), self.now);
            m
        }

        fn push(&mut self, at: Instant, e: Event) {
            self.seq += 1;
            self.queue.push(Reverse((at, self.seq)));
            self.events.insert(self.seq, e);
        }

        fn flush(&mut self, i: usize) {
            for out in self.members[i].drain() {
                match out {
                    Out::Send { to, packet } => {
                        if self.cut[i] || self.rng.random_bool(self.loss) {
                            continue;
                        }
                        let j = self.addrs.iter().position(|a| *a == to).unwrap();
                        if self.split.as_ref().is_some_and(|apart| apart(i, j)) {
                            continue;
                        }
                        self.push(
                            self.now + Duration::from_millis(1),
                            Event::Deliver(j, packet),
                        );
                    }
                    Out::After { after, timer } => {
                        self.push(self.now + after, Event::Timer(i, self.runs[i], timer))
                    }
                }
            }
        }

        fn run_for(&mut self, d: Duration) {
            let until = self.now + d;
            while let Some(Reverse((at, seq))) = self.queue.peek().copied() {
                if at > until {
                    break;
                }
                self.queue.pop();
                assert!(
                    self.seq < 5_000_000,
                    "runaway: {:?}",
                    self.events.get(&seq).map(|e| match e {
                        Event::Deliver(j, _) => format!("deliver to {j}"),
                        Event::Timer(i, _, t) => format!("timer {i} {t:?}"),
                    })
                );
                self.now = at;
                let Some(event) = self.events.remove(&seq) else {
                    continue;
                };
                match event {
                    Event::Deliver(j, p) => {
                        if !self.cut[j] {
                            if let Ok(o) = wire::open(&[key()], &p) {
                                self.delivered.insert((o.sender.to_string(), j), p.clone());
                                if let Some(c) = self.capture.as_mut() {
                                    let from = self
                                        .members
                                        .iter()
                                        .position(|m| *m.me.name == *o.sender)
                                        .unwrap();
                                    c.push((from, j, p.clone()));
                                }
                            }
                            self.members[j].receive(&p, at);
                            self.flush(j);
                        }
                    }
                    Event::Timer(i, run, t) => {
                        if run == self.runs[i] {
                            self.members[i].timer(t, at);
                            self.flush(i);
                        }
                    }
                }
            }
            self.now = until;
        }

        /// Cuts node `i` off, its packets on the way included.
        fn silence(&mut self, i: usize) {
            self.cut[i] = true;
            let name = Lan::name(i);
            self.events.retain(|_, e| match e {
                Event::Deliver(_, p) => wire::open(&[key()], p).map_or(true, |o| o.sender != name),
                Event::Timer(..) => true,
            });
        }

        /// The last packet from `from` that reached `to`.
        fn sniff(&self, from: usize, to: usize) -> Option<Vec<u8>> {
            self.delivered.get(&(Lan::name(from), to)).cloned()
        }

        /// Who reports node `i` down.
        fn accusers(&self, i: usize) -> BTreeSet<String> {
            let name = Lan::name(i);
            (0..self.members.len())
                .filter(|j| *j != i && !self.cut[*j])
                .filter(|j| self.members[*j].down().contains(&name))
                .map(Lan::name)
                .collect()
        }

        fn witnesses(&self, i: usize) -> BTreeSet<String> {
            let names: Vec<String> = (0..self.members.len()).map(Lan::name).collect();
            witnesses_of(names.iter().map(String::as_str), &Lan::name(i))
                .into_iter()
                .collect()
        }

        /// Steps until `done` holds; how long it took.
        fn until(&mut self, limit: Duration, done: impl Fn(&Lan) -> bool) -> Option<Duration> {
            let start = self.now;
            while self.now - start < limit {
                if done(self) {
                    return Some(self.now - start);
                }
                self.run_for(Duration::from_millis(10));
            }
            None
        }
    }

    #[test]
    fn members_find_each_other_and_nobody_is_reported() {
        let mut lan = Lan::new(6);
        let took = lan.until(Duration::from_secs(5), |l| {
            l.members.iter().all(|m| m.alive() == 5)
        });
        assert!(
            took.is_some(),
            "{:?}",
            lan.members.iter().map(Member::alive).collect::<Vec<_>>()
        );
        lan.run_for(Duration::from_secs(30));
        for i in 0..6 {
            assert!(
                lan.accusers(i).is_empty(),
                "node-{i}: {:?}",
                lan.accusers(i)
            );
            assert_eq!(lan.members[i].watching().len(), 3);
        }
    }

    #[test]
    fn a_dead_node_is_reported_by_its_witnesses_only_once_its_addresses_are_gone() {
        for victim in 0..5 {
            let mut lan = Lan::new(7);
            lan.run_for(Duration::from_secs(5));
            lan.cut[victim] = true;
            let witnesses = lan.witnesses(victim);
            let took = lan
                .until(Duration::from_secs(5), |l| l.accusers(victim) == witnesses)
                .unwrap_or_else(|| {
                    panic!("node-{victim}: {:?} of {witnesses:?}", lan.accusers(victim))
                });
            // Not before its 1 s address lifetime and the margin have
            // surely passed; not much after.
            assert!(
                took >= Duration::from_millis(1250) && took <= Duration::from_millis(1420),
                "node-{victim}: {took:?}"
            );
            // Nobody else is accused, and nobody but the witnesses accuses.
            lan.run_for(Duration::from_secs(5));
            assert_eq!(lan.accusers(victim), witnesses);
            for i in (0..7).filter(|i| *i != victim) {
                assert!(
                    lan.accusers(i).is_empty(),
                    "node-{i}: {:?}",
                    lan.accusers(i)
                );
            }
            // Back (a restarted agent, a new run): the reports end.
            lan.cut[victim] = false;
            lan.runs[victim] = 2;
            lan.members[victim] = lan.member(victim, 2);
            lan.flush(victim);
            let back = lan.until(Duration::from_secs(5), |l| l.accusers(victim).is_empty());
            assert!(back.is_some(), "still accused: {:?}", lan.accusers(victim));
        }
    }

    /// A node that stood down is reported by its witnesses at their next
    /// probe, though they hear it, and nobody else is; it still witnesses
    /// for others (nobody it watches loses a witness) and hears its own
    /// witnesses. Serving again, its next answer withdraws the report.
    #[test]
    fn a_node_that_stood_down_is_reported_while_it_answers() {
        let mut lan = Lan::new(5);
        lan.run_for(Duration::from_secs(5));
        let victim = 2;
        let witnesses = lan.witnesses(victim);
        lan.members[victim].set_stood_down(true);
        let took = lan
            .until(Duration::from_secs(2), |l| l.accusers(victim) == witnesses)
            .unwrap_or_else(|| panic!("{:?} of {witnesses:?}", lan.accusers(victim)));
        assert!(took <= Duration::from_millis(300), "took {took:?}");
        // Held while it says so: answers and gossip alike leave it down.
        lan.run_for(Duration::from_secs(3));
        assert_eq!(lan.accusers(victim), witnesses);
        for i in (0..5).filter(|i| *i != victim) {
            assert!(
                lan.accusers(i).is_empty(),
                "node-{i}: {:?}",
                lan.accusers(i)
            );
            assert!(
                !lan.members[i].hears().contains(&Lan::name(victim)),
                "node-{i} still vouches for it"
            );
        }
        let h = lan.members[victim].hearing(lan.now);
        assert!(h.none_since.is_none() && h.short_since.is_none() && h.silent.is_empty());
        lan.members[victim].set_stood_down(false);
        let back = lan.until(Duration::from_secs(2), |l| l.accusers(victim).is_empty());
        assert!(
            back.is_some_and(|b| b <= Duration::from_millis(300)),
            "still accused after {back:?}: {:?}",
            lan.accusers(victim)
        );
    }

    /// The mirror of the witnesses' verdict: a node cut off hears none of
    /// its peers and too few of its witnesses, and its own fence (the
    /// silence's start plus its 1 s address lifetime) falls before its
    /// witnesses report it; the others notice nothing of the kind.
    #[test]
    fn a_node_cut_off_knows_before_its_witnesses_report_it() {
        let mut lan = Lan::new(5);
        lan.run_for(Duration::from_secs(5));
        let victim = 1;
        let cut_at = lan.now;
        lan.cut[victim] = true;
        let witnesses = lan.witnesses(victim);
        let reported = lan
            .until(Duration::from_secs(5), |l| l.accusers(victim) == witnesses)
            .expect("reported");
        let h = lan.members[victim].hearing(lan.now);
        let none = h.none_since.expect("hears none");
        let short = h.short_since.expect("too few witnesses");
        assert_eq!(h.convicting, 2);
        assert_eq!(h.silent.iter().cloned().collect::<BTreeSet<_>>(), witnesses);
        let lifetime = Settings::default().own_lifetime;
        for since in [none, short] {
            assert!(since <= cut_at, "{since:?} after the cut {cut_at:?}");
            let fence = since + lifetime - cut_at;
            assert!(
                fence + Duration::from_millis(200) <= reported,
                "fenced {fence:?} after the cut, reported {reported:?}"
            );
        }
        for i in (0..5).filter(|i| *i != victim) {
            let h = lan.members[i].hearing(lan.now);
            assert_eq!(h.none_since, None, "node-{i}");
            assert_eq!(h.short_since, None, "node-{i}: {:?}", h.silent);
        }
        // Back: it hears them again.
        lan.cut[victim] = false;
        lan.run_for(Duration::from_millis(500));
        assert_eq!(
            lan.members[victim].hearing(lan.now),
            Hearing {
                convicting: 2,
                ..Hearing::default()
            }
        );
    }

    /// Issue #49: a node hears its witnesses' word on it (what the API
    /// server acknowledged of their accusations of it) with their probes;
    /// a LAN silence whose accusations were never acknowledged leaves that
    /// word as it was before, heard again once the LAN is back; an
    /// acknowledged one changes it; words from a node that is no witness
    /// of it are not taken.
    #[test]
    fn witnesses_tell_the_accused_what_the_api_server_acknowledged() {
        let mut lan = Lan::new(5);
        lan.run_for(Duration::from_secs(3));
        let victim = 1;
        let witnesses = lan.witnesses(victim);
        let words = lan.members[victim].attestations();
        assert_eq!(
            words.keys().cloned().collect::<BTreeSet<_>>(),
            witnesses,
            "heard from its witnesses only"
        );
        assert_eq!(
            lan.members[victim].witnesses(),
            witnesses.iter().cloned().collect::<Vec<_>>()
        );
        assert!(
            words
                .values()
                .all(|a| a.word.accusations == 0 && !a.word.accusing)
        );
        let before = words.clone();

        // Cut off past its witnesses' verdict; they accuse, nothing lands.
        let cut_at = lan.now;
        lan.cut[victim] = true;
        lan.until(Duration::from_secs(5), |l| l.accusers(victim) == witnesses)
            .expect("reported");
        lan.cut[victim] = false;
        lan.run_for(Duration::from_millis(300));
        let after = lan.members[victim].attestations();
        for (w, a) in &after {
            assert_eq!(a.changed, before[w].changed, "{w}: unchanged");
            assert!(a.heard > cut_at, "{w}: heard again");
        }

        // One witness's accusation is acknowledged: its word changes.
        let name = Lan::name(victim);
        let first = lan
            .members
            .iter()
            .position(|m| Some(&m.me.name.to_string()) == witnesses.first())
            .unwrap();
        let mut acknowledged = Acknowledged::default();
        acknowledged.record(std::slice::from_ref(&name));
        lan.members[first].set_acknowledged(acknowledged.clone());
        lan.run_for(Duration::from_millis(300));
        let w = lan.members[victim].attestations()[&Lan::name(first)];
        assert_eq!((w.word.accusations, w.word.accusing), (1, true));
        assert!(w.changed > cut_at);
        acknowledged.record(&[]);
        lan.members[first].set_acknowledged(acknowledged);
        lan.run_for(Duration::from_millis(300));
        let w = lan.members[victim].attestations()[&Lan::name(first)];
        assert_eq!(
            (w.word.accusations, w.word.accusing),
            (1, false),
            "withdrawn, still counted"
        );

        // A peer that is no witness of it cannot speak for one.
        let other = (0..5)
            .find(|i| *i != victim && !witnesses.contains(&Lan::name(*i)))
            .expect("a non-witness on a LAN of 5");
        let mut word = vec![KIND_ATTEST];
        word.extend_from_slice(&7u64.to_be_bytes());
        word.extend_from_slice(&9u32.to_be_bytes());
        word.push(FLAG_ACCUSING);
        let packet = wire::seal(
            &key(),
            &Lan::name(other),
            Stamp {
                epoch: 1,
                sequence: 1 << 40,
            },
            &word,
        )
        .unwrap();
        let errors = lan.members[victim].counters().swim_errors;
        lan.members[victim].receive(&packet, lan.now);
        assert_eq!(lan.members[victim].counters().swim_errors, errors + 1);
        assert!(
            !lan.members[victim]
                .attestations()
                .contains_key(&Lan::name(other))
        );
    }

    /// Issue #49: answers captured on the LAN and replayed to a witness
    /// that restarted (its replay record new, so the gate takes each once)
    /// answer none of its probes: a dead node is not heard by it, and not
    /// vouched for.
    #[test]
    fn replayed_answers_keep_no_dead_node_heard() {
        let mut lan = Lan::new(5);
        lan.run_for(Duration::from_secs(2));
        let victim = 1;
        let witness = (0..5)
            .find(|i| lan.witnesses(victim).contains(&Lan::name(*i)))
            .unwrap();
        lan.capture = Some(Vec::new());
        lan.run_for(Duration::from_secs(2));
        let captured: Vec<Vec<u8>> = lan
            .capture
            .take()
            .unwrap()
            .into_iter()
            .filter(|(from, to, _)| *from == victim && *to == witness)
            .map(|(_, _, p)| p)
            .collect();
        assert!(captured.len() > 20, "{} captured", captured.len());
        // The victim dies; the witness restarts (a new run, a new gate).
        lan.silence(victim);
        lan.runs[witness] = 2;
        lan.members[witness] = lan.member(witness, 2);
        lan.flush(witness);
        let name = Lan::name(victim);
        for p in &captured {
            lan.run_for(Duration::from_millis(50));
            lan.members[witness].receive(p, lan.now);
            lan.flush(witness);
            assert!(
                !lan.members[witness].hears().contains(&name),
                "a replayed answer made the dead node heard"
            );
        }
        assert!(lan.members[witness].counters().unmatched_answers > 0);
    }

    /// Lost packets (one in ten) never keep a live node from hearing two
    /// witnesses for the fence's second.
    #[test]
    fn a_lossy_lan_fences_nobody() {
        let mut lan = Lan::new(6);
        lan.loss = 0.1;
        lan.run_for(Duration::from_secs(5));
        for _ in 0..1200 {
            lan.run_for(Duration::from_millis(100));
            for i in 0..6 {
                let h = lan.members[i].hearing(lan.now);
                let long = |s: Option<Instant>| {
                    s.is_some_and(|s| lan.now - s >= Duration::from_millis(900))
                };
                assert!(
                    !long(h.none_since) && !long(h.short_since),
                    "node-{i} at {:?}: {h:?}",
                    lan.now
                );
            }
        }
    }

    /// A LAN split three to four: the nodes whose witnesses are mostly
    /// across know it; a node of the larger side whose witnesses are on
    /// its side does not.
    #[test]
    fn a_split_shows_in_each_nodes_hearing_of_its_witnesses() {
        let mut lan = Lan::new(7);
        lan.run_for(Duration::from_secs(5));
        let side = |i: usize| i < 3;
        lan.loss = 0.0;
        lan.split = Some(Box::new(move |a, b| side(a) != side(b)));
        lan.run_for(Duration::from_secs(2));
        let names: Vec<String> = (0..7).map(Lan::name).collect();
        for i in 0..7 {
            let across = lan
                .witnesses(i)
                .iter()
                .filter(|w| side(names.iter().position(|n| n == *w).unwrap()) != side(i))
                .count();
            let h = lan.members[i].hearing(lan.now);
            assert_eq!(h.none_since, None, "node-{i}");
            assert_eq!(h.silent.len(), across, "node-{i}: {h:?}");
            assert_eq!(h.short_since.is_some(), across >= 2, "node-{i}: {h:?}");
        }
    }

    #[test]
    fn a_node_with_a_longer_address_lifetime_is_reported_after_it() {
        let mut lan = Lan::new(5);
        let victim = 3;
        let settings = Settings {
            own_lifetime: Duration::from_secs(3),
            ..Settings::default()
        };
        let mut m = Member::new(
            &Lan::name(victim),
            lan.addrs[victim],
            2,
            vec![key()],
            settings,
            99,
            lan.now,
        )
        .unwrap();
        m.set_peers(&lan.peers(), lan.now);
        lan.runs[victim] = 2;
        lan.members[victim] = m;
        lan.flush(victim);
        lan.run_for(Duration::from_secs(5));
        lan.cut[victim] = true;
        let witnesses = lan.witnesses(victim);
        let took = lan
            .until(Duration::from_secs(10), |l| l.accusers(victim) == witnesses)
            .expect("reported");
        assert!(
            took >= Duration::from_millis(3250) && took <= Duration::from_millis(3420),
            "{took:?}"
        );
    }

    #[test]
    fn a_lossy_lan_makes_no_two_witnesses_agree_on_a_live_node() {
        let mut lan = Lan::new(8);
        lan.loss = 0.1;
        lan.run_for(Duration::from_secs(5));
        for _ in 0..1200 {
            lan.run_for(Duration::from_millis(100));
            for i in 0..8 {
                assert!(
                    lan.accusers(i).len() < 2,
                    "node-{i} at {:?}: {:?}",
                    lan.now,
                    lan.accusers(i)
                );
            }
        }
    }

    #[test]
    fn a_node_never_heard_is_never_reported() {
        // Its membership may not run (no key yet, UDP blocked) while its
        // agent holds addresses: silence says nothing then.
        let mut lan = Lan::new(5);
        lan.silence(2);
        lan.run_for(Duration::from_secs(20));
        assert!(lan.accusers(2).is_empty(), "{:?}", lan.accusers(2));
        // Once heard, it is.
        lan.cut[2] = false;
        lan.run_for(Duration::from_secs(3));
        lan.cut[2] = true;
        let witnesses = lan.witnesses(2);
        let took = lan.until(Duration::from_secs(10), |l| l.accusers(2) == witnesses);
        assert!(
            took.is_some_and(|t| t <= Duration::from_millis(1420)),
            "{took:?}"
        );
    }

    #[test]
    fn forged_replayed_and_foreign_packets_are_dropped_and_counted_and_change_nothing() {
        let mut lan = Lan::new(4);
        lan.run_for(Duration::from_secs(3));
        // A real packet from node-1 to node-0, taken off the wire.
        let real = lan
            .until(Duration::from_secs(5), |l| l.sniff(1, 0).is_some())
            .and_then(|_| lan.sniff(1, 0))
            .expect("node-1 talks to node-0");
        let now = lan.now;
        let m0 = &mut lan.members[0];
        m0.receive(&real, now);
        m0.receive(&real, now);
        assert_eq!(m0.dropped(Dropped::Replayed), 2);
        let mut forged = real.clone();
        let last = forged.len() - 1;
        forged[last] ^= 1;
        m0.receive(&forged, now);
        assert_eq!(m0.dropped(Dropped::Unauthenticated), 1);
        m0.receive(b"not ours at all", now);
        assert_eq!(m0.dropped(Dropped::Malformed), 1);
        let stranger = wire::seal(
            &key(),
            "node-9",
            Stamp {
                epoch: 1,
                sequence: 1,
            },
            &[KIND_PING, 0, 0, 0, 1],
        )
        .unwrap();
        m0.receive(&stranger, now);
        assert_eq!(m0.dropped(Dropped::NotAMember), 1);
        let other_key = Key::new(2, &[9; 32]).unwrap();
        let wrong = wire::seal(
            &other_key,
            "node-1",
            Stamp {
                epoch: 9,
                sequence: 1,
            },
            &[KIND_PING, 0, 0, 0, 1],
        )
        .unwrap();
        m0.receive(&wrong, now);
        assert_eq!(m0.dropped(Dropped::UnknownKey), 1);
        // Nobody without the key made anyone look dead.
        lan.run_for(Duration::from_secs(10));
        for i in 0..4 {
            assert!(
                lan.accusers(i).is_empty(),
                "node-{i}: {:?}",
                lan.accusers(i)
            );
        }
    }

    #[test]
    fn a_member_speaking_for_another_is_refused() {
        let mut lan = Lan::new(3);
        lan.run_for(Duration::from_secs(2));
        let now = lan.now;
        let mut m2 = lan.member(2, 5);
        m2.timer(Timer::Join, now);
        let said: Vec<u8> = m2
            .drain()
            .into_iter()
            .find_map(|o| match o {
                Out::Send { packet, .. } => Some(packet),
                _ => None,
            })
            .unwrap();
        let opened = wire::open(&[key()], &said).unwrap();
        // node-1's name on the envelope, node-2's in the SWIM header.
        let resealed = wire::seal(
            &key(),
            "node-1",
            Stamp {
                epoch: 99,
                sequence: 1,
            },
            opened.payload,
        )
        .unwrap();
        let before = lan.members[0].counters().swim_errors;
        lan.members[0].receive(&resealed, now);
        assert_eq!(lan.members[0].counters().swim_errors, before + 1);
    }
}
