//! The membership envelope: who sent a packet, in which of its runs and in
//! what order, sealed with a cluster key (HMAC-SHA-256), so that nobody
//! without the key can make a node look alive or dead, and nobody can make
//! an old packet count again.
//!
//! Layout (all integers big-endian):
//!
//! | bytes | field |
//! | --- | --- |
//! | 4 | magic `HNAM` |
//! | 1 | version (1) |
//! | 1 | key id (the key it is sealed with; two may be valid during a rotation) |
//! | 1 | sender name length n (1-253) |
//! | n | sender: the node's name |
//! | 8 | epoch: when the sender's run began (Unix ms) |
//! | 8 | sequence within the run |
//! | 2 | payload length m |
//! | m | payload (the SWIM message) |
//! | 32 | HMAC-SHA-256 of everything before it |
//!
//! A restarted agent begins a new epoch, so its sequence may start at 0
//! again without its packets looking replayed; packets of an older epoch
//! than the newest seen from that sender are dropped, and so are, within
//! an epoch, a sequence already seen or more than `WINDOW` behind the
//! newest.

use std::collections::{BTreeMap, BTreeSet};

use ring::hmac;

const MAGIC: &[u8; 4] = b"HNAM";
pub(crate) const VERSION: u8 = 1;
const TAG_LEN: usize = 32;
const HEADER_FIXED: usize = 4 + 1 + 1 + 1;
/// The largest payload: a UDP datagram that fits an Ethernet frame with
/// room for the envelope.
pub(crate) const MAX_PAYLOAD: usize = 1200;
/// How far behind the newest sequence of a run a packet may arrive (UDP
/// reorders) and still count once.
pub(crate) const WINDOW: u64 = 64;

/// A cluster key and its id.
#[derive(Clone)]
pub struct Key {
    pub(crate) id: u8,
    key: hmac::Key,
}

impl Key {
    /// `secret` as the controller's Secret holds it (at least 32 bytes).
    pub fn new(id: u8, secret: &[u8]) -> Result<Key, WireError> {
        if secret.len() < 32 {
            return Err(WireError::ShortKey(secret.len()));
        }
        Ok(Key {
            id,
            key: hmac::Key::new(hmac::HMAC_SHA256, secret),
        })
    }
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Key({}, <secret>)", self.id)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("a membership key must be at least 32 bytes, this one has {0}")]
    ShortKey(usize),
    #[error("a sender name is 1-253 bytes, this one has {0}")]
    SenderName(usize),
    #[error("a payload is at most {MAX_PAYLOAD} bytes, this one has {0}")]
    PayloadTooLong(usize),
}

/// Where a packet came from, as sealed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Stamp {
    pub epoch: u64,
    pub sequence: u64,
}

/// Seals `payload` from `sender` with `key`.
pub fn seal(key: &Key, sender: &str, stamp: Stamp, payload: &[u8]) -> Result<Vec<u8>, WireError> {
    if sender.is_empty() || sender.len() > 253 {
        return Err(WireError::SenderName(sender.len()));
    }
    if payload.len() > MAX_PAYLOAD {
        return Err(WireError::PayloadTooLong(payload.len()));
    }
    let mut out = Vec::with_capacity(HEADER_FIXED + sender.len() + 18 + payload.len() + TAG_LEN);
    out.extend_from_slice(MAGIC);
    out.push(VERSION);
    out.push(key.id);
    out.push(sender.len() as u8);
    out.extend_from_slice(sender.as_bytes());
    out.extend_from_slice(&stamp.epoch.to_be_bytes());
    out.extend_from_slice(&stamp.sequence.to_be_bytes());
    out.extend_from_slice(&(payload.len() as u16).to_be_bytes());
    out.extend_from_slice(payload);
    let tag = hmac::sign(&key.key, &out);
    out.extend_from_slice(tag.as_ref());
    Ok(out)
}

/// Why a packet was dropped: each is counted, none reaches the protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Dropped {
    /// Not an envelope of ours: too short, another magic or version,
    /// lengths that do not add up.
    Malformed,
    /// Sealed with a key id this node does not have.
    UnknownKey,
    /// The tag does not match: not sealed with the key it names.
    Unauthenticated,
    /// Seen already, or from an older run of its sender.
    Replayed,
    /// Authentic, but its sender is no member of this network.
    NotAMember,
    /// Stamped with a run epoch far ahead of this node's wall clock
    /// ([`FUTURE_EPOCH_TOLERANCE`]): taken, it would make every later
    /// genuine packet of its sender count as replayed, until that epoch.
    FutureEpoch,
}

/// How far ahead of this node's wall clock a sender's run epoch (its
/// start, in Unix milliseconds, or one past its last run's) may be: clocks
/// a few minutes apart, and a run that began after its clock was stepped
/// back, pass; a forged far-future epoch does not.
pub(crate) const FUTURE_EPOCH_TOLERANCE: std::time::Duration = std::time::Duration::from_secs(600);

impl Dropped {
    pub(crate) const ALL: [Dropped; 6] = [
        Dropped::Malformed,
        Dropped::UnknownKey,
        Dropped::Unauthenticated,
        Dropped::Replayed,
        Dropped::NotAMember,
        Dropped::FutureEpoch,
    ];

    pub(crate) fn label(self) -> &'static str {
        match self {
            Dropped::Malformed => "malformed",
            Dropped::UnknownKey => "unknown_key",
            Dropped::Unauthenticated => "unauthenticated",
            Dropped::Replayed => "replayed",
            Dropped::NotAMember => "not_a_member",
            Dropped::FutureEpoch => "future_epoch",
        }
    }
}

/// An authentic packet, before the replay check.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Opened<'a> {
    pub(crate) sender: &'a str,
    pub(crate) stamp: Stamp,
    pub(crate) payload: &'a [u8],
}

/// Checks the form and the tag of `packet` against `keys`.
pub(crate) fn open<'a>(keys: &[Key], packet: &'a [u8]) -> Result<Opened<'a>, Dropped> {
    let take = |at: usize, n: usize| packet.get(at..at + n).ok_or(Dropped::Malformed);
    if take(0, 4)? != MAGIC || take(4, 1)?[0] != VERSION {
        return Err(Dropped::Malformed);
    }
    let key_id = take(5, 1)?[0];
    let sender_len = usize::from(take(6, 1)?[0]);
    if sender_len == 0 {
        return Err(Dropped::Malformed);
    }
    let sender =
        std::str::from_utf8(take(HEADER_FIXED, sender_len)?).map_err(|_| Dropped::Malformed)?;
    let at = HEADER_FIXED + sender_len;
    let u64_at = |at: usize| -> Result<u64, Dropped> {
        Ok(u64::from_be_bytes(
            take(at, 8)?.try_into().map_err(|_| Dropped::Malformed)?,
        ))
    };
    let stamp = Stamp {
        epoch: u64_at(at)?,
        sequence: u64_at(at + 8)?,
    };
    let len_bytes = take(at + 16, 2)?;
    let payload_len = usize::from(u16::from_be_bytes([len_bytes[0], len_bytes[1]]));
    let payload_at = at + 18;
    let payload = take(payload_at, payload_len)?;
    let signed_len = payload_at + payload_len;
    if packet.len() != signed_len + TAG_LEN {
        return Err(Dropped::Malformed);
    }
    let key = keys
        .iter()
        .find(|k| k.id == key_id)
        .ok_or(Dropped::UnknownKey)?;
    hmac::verify(&key.key, &packet[..signed_len], &packet[signed_len..])
        .map_err(|_| Dropped::Unauthenticated)?;
    Ok(Opened {
        sender,
        stamp,
        payload,
    })
}

/// The newest run of one sender and which of its recent sequences were
/// seen.
#[derive(Debug, Clone, Default)]
struct Seen {
    epoch: u64,
    newest: u64,
    /// Bit i: `newest - i` was seen.
    recent: u64,
}

impl Seen {
    /// Whether `stamp` is new; if so, it is noted.
    fn admit(&mut self, stamp: Stamp) -> bool {
        if stamp.epoch < self.epoch {
            return false;
        }
        if stamp.epoch > self.epoch {
            *self = Seen {
                epoch: stamp.epoch,
                newest: stamp.sequence,
                recent: 1,
            };
            return true;
        }
        if stamp.sequence > self.newest {
            let shift = stamp.sequence - self.newest;
            self.recent = if shift >= WINDOW {
                0
            } else {
                self.recent << shift
            };
            self.recent |= 1;
            self.newest = stamp.sequence;
            return true;
        }
        let behind = self.newest - stamp.sequence;
        if behind >= WINDOW || self.recent & (1 << behind) != 0 {
            return false;
        }
        self.recent |= 1 << behind;
        true
    }
}

/// What a node lets through to its membership protocol: authentic packets
/// from members, each once.
#[derive(Debug)]
pub(crate) struct Gate {
    keys: Vec<Key>,
    members: BTreeSet<String>,
    seen: BTreeMap<String, Seen>,
    dropped: BTreeMap<Dropped, u64>,
}

impl Gate {
    pub(crate) fn new(keys: Vec<Key>, members: BTreeSet<String>) -> Gate {
        Gate {
            keys,
            members,
            seen: BTreeMap::new(),
            dropped: BTreeMap::new(),
        }
    }

    /// The members changed (a node joined or left the network): a sender
    /// that is gone is forgotten, so that its name can start afresh.
    pub(crate) fn set_members(&mut self, members: BTreeSet<String>) {
        self.seen.retain(|n, _| members.contains(n));
        self.members = members;
    }

    /// A new key set (a rotation: the new key, and the old one until every
    /// node has the new).
    pub(crate) fn set_keys(&mut self, keys: Vec<Key>) {
        self.keys = keys;
    }

    /// The sender and payload of `packet`, or `None` (counted).
    pub(crate) fn admit<'a>(&mut self, packet: &'a [u8]) -> Option<(&'a str, &'a [u8])> {
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        self.admit_at(packet, now_ms)
    }

    /// [`Gate::admit`] with this node's wall clock at `now_ms`.
    pub(crate) fn admit_at<'a>(
        &mut self,
        packet: &'a [u8],
        now_ms: u64,
    ) -> Option<(&'a str, &'a [u8])> {
        let verdict = open(&self.keys, packet).and_then(|o| {
            if !self.members.contains(o.sender) {
                return Err(Dropped::NotAMember);
            }
            let tolerance = FUTURE_EPOCH_TOLERANCE.as_millis() as u64;
            if o.stamp.epoch > now_ms.saturating_add(tolerance) {
                return Err(Dropped::FutureEpoch);
            }
            if !self
                .seen
                .entry(o.sender.to_string())
                .or_default()
                .admit(o.stamp)
            {
                return Err(Dropped::Replayed);
            }
            Ok((o.sender, o.payload))
        });
        match verdict {
            Ok(v) => Some(v),
            Err(why) => {
                *self.dropped.entry(why).or_default() += 1;
                None
            }
        }
    }

    /// Packets dropped so far, by reason.
    pub(crate) fn dropped(&self, why: Dropped) -> u64 {
        self.dropped.get(&why).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(id: u8, fill: u8) -> Key {
        Key::new(id, &[fill; 32]).unwrap()
    }

    fn gate() -> Gate {
        Gate::new(
            vec![key(1, 7)],
            ["node-a".to_string(), "node-b".to_string()].into(),
        )
    }

    fn stamp(epoch: u64, sequence: u64) -> Stamp {
        Stamp { epoch, sequence }
    }

    #[test]
    fn a_sealed_packet_opens_once_with_its_sender_and_payload() {
        let mut g = gate();
        let p = seal(&key(1, 7), "node-a", stamp(1, 0), b"ping").unwrap();
        assert_eq!(g.admit(&p), Some(("node-a", &b"ping"[..])));
        assert_eq!(g.admit(&p), None, "the same packet again");
        assert_eq!(g.dropped(Dropped::Replayed), 1);
    }

    #[test]
    fn a_wrong_key_an_unknown_key_and_a_flipped_bit_are_dropped_and_counted() {
        let mut g = gate();
        let wrong = seal(&key(1, 8), "node-a", stamp(1, 0), b"ping").unwrap();
        assert_eq!(g.admit(&wrong), None);
        assert_eq!(g.dropped(Dropped::Unauthenticated), 1);
        let unknown = seal(&key(2, 7), "node-a", stamp(1, 0), b"ping").unwrap();
        assert_eq!(g.admit(&unknown), None);
        assert_eq!(g.dropped(Dropped::UnknownKey), 1);
        let good = seal(&key(1, 7), "node-a", stamp(1, 0), b"ping").unwrap();
        for i in 7..good.len() {
            let mut bad = good.clone();
            bad[i] ^= 0x01;
            assert_eq!(g.admit(&bad), None, "bit flipped in byte {i}");
        }
        // Neither counted the genuine packet as seen.
        assert_eq!(g.admit(&good), Some(("node-a", &b"ping"[..])));
    }

    #[test]
    fn an_authentic_packet_from_a_node_that_is_no_member_is_dropped() {
        let mut g = gate();
        let p = seal(&key(1, 7), "node-z", stamp(1, 0), b"ping").unwrap();
        assert_eq!(g.admit(&p), None);
        assert_eq!(g.dropped(Dropped::NotAMember), 1);
        g.set_members(["node-z".to_string()].into());
        assert!(g.admit(&p).is_some(), "a member now");
    }

    #[test]
    fn malformed_input_of_every_length_is_dropped_never_a_panic() {
        let mut g = gate();
        let good = seal(&key(1, 7), "node-a", stamp(1, 0), b"ping").unwrap();
        for n in 0..good.len() {
            assert_eq!(g.admit(&good[..n]), None, "truncated to {n}");
        }
        let mut longer = good.clone();
        longer.push(0);
        assert_eq!(g.admit(&longer), None);
        // Lengths that lie, and garbage.
        let mut lying = good.clone();
        lying[6] = 200;
        assert_eq!(g.admit(&lying), None);
        let mut rng = fastrand::Rng::with_seed(29);
        for _ in 0..10_000 {
            let n = rng.usize(0..200);
            let junk: Vec<u8> = (0..n).map(|_| rng.u8(..)).collect();
            assert_eq!(g.admit(&junk), None);
        }
        assert_eq!(
            g.dropped(Dropped::Malformed) + g.dropped(Dropped::Unauthenticated),
            good.len() as u64 + 2 + 10_000
        );
    }

    #[test]
    fn reordered_packets_count_once_and_an_older_run_not_at_all() {
        let mut g = gate();
        let k = key(1, 7);
        let send = |g: &mut Gate, e, s| {
            g.admit(&seal(&k, "node-b", stamp(e, s), b"x").unwrap())
                .is_some()
        };
        assert!(send(&mut g, 100, 10));
        assert!(send(&mut g, 100, 8), "late, within the window");
        assert!(!send(&mut g, 100, 8), "again");
        assert!(send(&mut g, 100, 9));
        assert!(send(&mut g, 100, 10 + WINDOW));
        assert!(!send(&mut g, 100, 10), "now too far behind");
        // The sender restarted: a new run, its sequence from 0.
        assert!(send(&mut g, 200, 0));
        assert!(!send(&mut g, 100, 10 + WINDOW + 1), "the old run is over");
        // Each sender has its own record.
        assert!(
            g.admit(&seal(&k, "node-a", stamp(100, 10), b"x").unwrap())
                .is_some()
        );
    }

    /// Issue #49: a packet stamped far ahead of this node's clock is
    /// dropped and counted, and does not silence its sender's genuine
    /// packets; one a few minutes ahead (clocks apart, a run after a clock
    /// step back) passes.
    #[test]
    fn a_far_future_epoch_is_refused_and_silences_nobody() {
        let mut g = gate();
        let k = key(1, 7);
        let now_ms = 1_800_000_000_000;
        let forged = seal(&k, "node-b", stamp(u64::MAX / 2, 0), b"x").unwrap();
        assert!(g.admit_at(&forged, now_ms).is_none());
        assert_eq!(g.dropped(Dropped::FutureEpoch), 1);
        let genuine = seal(&k, "node-b", stamp(now_ms - 5_000, 1), b"x").unwrap();
        assert!(g.admit_at(&genuine, now_ms).is_some(), "still heard");
        let ahead = seal(&k, "node-b", stamp(now_ms + 120_000, 0), b"x").unwrap();
        assert!(g.admit_at(&ahead, now_ms).is_some(), "two minutes ahead");
        let past = now_ms + FUTURE_EPOCH_TOLERANCE.as_millis() as u64 + 1;
        let too_far = seal(&k, "node-b", stamp(past, 0), b"x").unwrap();
        assert!(g.admit_at(&too_far, now_ms).is_none());
        assert_eq!(g.dropped(Dropped::FutureEpoch), 2);
    }

    #[test]
    fn keys_rotate_without_a_gap() {
        let mut g = gate();
        g.set_keys(vec![key(2, 9), key(1, 7)]);
        assert!(
            g.admit(&seal(&key(1, 7), "node-a", stamp(1, 0), b"old").unwrap())
                .is_some()
        );
        assert!(
            g.admit(&seal(&key(2, 9), "node-a", stamp(1, 1), b"new").unwrap())
                .is_some()
        );
        g.set_keys(vec![key(2, 9)]);
        assert!(
            g.admit(&seal(&key(1, 7), "node-a", stamp(1, 2), b"old").unwrap())
                .is_none()
        );
    }

    #[test]
    fn what_cannot_be_sealed_is_refused() {
        assert_eq!(Key::new(1, &[0; 16]).unwrap_err(), WireError::ShortKey(16));
        let k = key(1, 7);
        assert_eq!(
            seal(&k, "", stamp(1, 0), b"").unwrap_err(),
            WireError::SenderName(0)
        );
        assert_eq!(
            seal(&k, "n", stamp(1, 0), &[0; MAX_PAYLOAD + 1]).unwrap_err(),
            WireError::PayloadTooLong(MAX_PAYLOAD + 1)
        );
    }
}
