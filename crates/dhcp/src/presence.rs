//! What keeps a held address's MAC where it is on the LAN, for every lease
//! of the process, on threads of their own: the presence frames, and the
//! LAN watch that answers another port's frames from one of our MACs.
//!
//! **Presence frames.** While a lease asks for them, its MAC sends one
//! frame every period (`Driver::presence` says why and to whom).
//!
//! **The LAN watch.** While a lease holds its address, a frame that
//! arrives on its uplink from the LAN with the lease's MAC as its source
//! was sent by another port: a VM resumed from a long pause, whose kernel
//! still held the address, announcing it after a migration or answering
//! the ARP requests queued for it (issue #31). The LAN's switches now
//! send that MAC's traffic there. The watch answers each such frame at
//! once with a broadcast announcement from the lease's MAC, which takes
//! the MAC back on every switch the other frame crossed: at most
//! [`ANSWER_BURST`] at once, then one every [`ANSWER_EVERY`], so that two
//! hosts that both hold the address (a fault) do not answer each other
//! without end. Our own frames never come back in on the uplink: a
//! socket for one protocol is not shown what the host sends, and a
//! bridge does not send a frame back out of the port it came in on.
//!
//! Why threads and not each lease's task: the frames matter most right
//! after a live migration's switchover, which is when the process is
//! slowest. Under QEMU's TCG the target translates every instruction
//! anew as it first runs it, and the async runtime's paths (the lease
//! driver, netlink, the API client) kept the agent busy for one to four
//! seconds after the switchover, its timers seconds late (issue #31). The
//! threads' loops are a handful of instructions and a syscall per frame:
//! runnable within milliseconds, whatever the rest of the process is
//! doing, and one wake-up serves every lease, where a task per lease
//! would wake a hundred times.
//!
//! A lease registers while its address is on the link and drops the
//! [`Registration`] when it is not. The sending thread starts with the
//! first registration and runs for the life of the process; an uplink's
//! listening thread starts with the first lease watched on it and ends
//! once none is (or the uplink is gone).

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use crate::raw::{BROADCAST_MAC, ETH_P_ARP, cvt, ll_addr, recv_datagram, send_to};

/// How many frames from another port the LAN watch answers at once for
/// one lease ([module docs](self)): a resumed kernel sends a handful of
/// announcements in its first second.
pub(crate) const ANSWER_BURST: u32 = 5;
/// Past [`ANSWER_BURST`], one answer per this long for one lease.
pub(crate) const ANSWER_EVERY: Duration = Duration::from_secs(1);

/// How long a listening thread blocks before it looks whether it still
/// has a lease to watch and an uplink to watch on.
const LISTEN_TIMEOUT: Duration = Duration::from_secs(2);

/// One lease's frame, and when it is due next.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    ifindex: u32,
    to: [u8; 6],
    /// The ARP body (the socket is `SOCK_DGRAM`: the kernel adds the
    /// Ethernet header, from the interface's MAC, which is the lease's).
    arp: Vec<u8>,
    every: Duration,
    due: Instant,
}

/// An uplink: its network namespace (the inode of
/// `/proc/thread-self/ns/net` where it was registered, 0 when unknown)
/// and its index there. The agent has one namespace; the tests run
/// several in one process, where indexes repeat.
type UplinkKey = (u64, u32);

/// One lease watched on its uplink.
#[derive(Debug)]
struct Watched {
    uplink: UplinkKey,
    mac: [u8; 6],
    /// The lease's macvlan, which the answer is sent from.
    ifindex: u32,
    /// The announcement (ARP body) the answer carries.
    arp: Vec<u8>,
    budget: Budget,
}

/// The answers a watched lease may still give: [`ANSWER_BURST`], one more
/// per [`ANSWER_EVERY`] up to that.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Budget {
    left: u32,
    /// When `left` was last counted up (or full).
    since: Instant,
}

impl Budget {
    fn full(now: Instant) -> Budget {
        Budget {
            left: ANSWER_BURST,
            since: now,
        }
    }

    /// Spends one answer at `now` if there is one left.
    fn spend(&mut self, now: Instant) -> bool {
        let periods =
            now.saturating_duration_since(self.since).as_millis() / ANSWER_EVERY.as_millis().max(1);
        let periods = u32::try_from(periods).unwrap_or(u32::MAX);
        if self.left.saturating_add(periods) >= ANSWER_BURST {
            *self = Budget::full(now);
        } else {
            self.left += periods;
            self.since += ANSWER_EVERY * periods;
        }
        if self.left == 0 {
            return false;
        }
        self.left -= 1;
        true
    }
}

#[derive(Default)]
struct Table {
    entries: BTreeMap<u64, Entry>,
    watched: BTreeMap<u64, Watched>,
    /// The uplinks with a listening thread.
    listening: BTreeSet<UplinkKey>,
}

impl Table {
    /// Every entry due at `now`, each moved to its next time (a period
    /// from its last, or from now when the thread woke that late: no
    /// burst to catch up), and how long until the next is due.
    fn take_due(&mut self, now: Instant) -> (Vec<Entry>, Option<Duration>) {
        let mut due = Vec::new();
        for e in self.entries.values_mut() {
            if e.due <= now {
                due.push(e.clone());
                let next = e.due + e.every;
                e.due = if next > now { next } else { now + e.every };
            }
        }
        let wait = self
            .entries
            .values()
            .map(|e| e.due.saturating_duration_since(now))
            .min();
        (due, wait)
    }

    /// The answers to a frame from `src` that arrived on `uplink` from
    /// the LAN: `(macvlan, announcement)` of each lease watched there with
    /// that MAC and an answer left.
    fn answers(&mut self, uplink: UplinkKey, src: [u8; 6], now: Instant) -> Vec<(u32, Vec<u8>)> {
        self.watched
            .values_mut()
            .filter(|w| w.uplink == uplink && w.mac == src)
            .filter_map(|w| w.budget.spend(now).then(|| (w.ifindex, w.arp.clone())))
            .collect()
    }

    fn watches_on(&self, uplink: UplinkKey) -> bool {
        self.watched.values().any(|w| w.uplink == uplink)
    }
}

struct Sender {
    table: Mutex<Table>,
    changed: Condvar,
    ids: AtomicU64,
}

impl Sender {
    fn new() -> Sender {
        Sender {
            table: Mutex::new(Table::default()),
            changed: Condvar::new(),
            ids: AtomicU64::new(1),
        }
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The process's sender.
struct Process {
    sender: Arc<Sender>,
}

/// A lease's entry with the sender (its frame, or its watch): removed
/// when dropped.
#[derive(Debug)]
pub(crate) struct Registration {
    id: u64,
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Ok(process) = process() {
            let mut table = process.sender.table();
            table.entries.remove(&self.id);
            table.watched.remove(&self.id);
        }
    }
}

/// Why this process sends no presence frames.
#[derive(Debug, thiserror::Error)]
enum Unavailable {
    #[error("presence frames: packet socket: {0}")]
    Socket(#[source] io::Error),
    #[error("presence frames: thread: {0}")]
    Thread(#[source] io::Error),
}

/// The process's sender, started on first use; an error when its socket
/// cannot be opened (no `CAP_NET_RAW`), said again to every caller.
fn process() -> Result<&'static Process, &'static Unavailable> {
    static PROCESS: OnceLock<Result<Process, Unavailable>> = OnceLock::new();
    PROCESS
        .get_or_init(|| {
            let socket = open_socket(0).map_err(Unavailable::Socket)?;
            let sender = Arc::new(Sender::new());
            let theirs = sender.clone();
            std::thread::Builder::new()
                .name("hna-presence".into())
                .spawn(move || {
                    run(&theirs, |e| {
                        send_to(&socket, e.ifindex, ETH_P_ARP, e.to, &e.arp)
                    })
                })
                .map_err(Unavailable::Thread)?;
            Ok(Process { sender })
        })
        .as_ref()
}

/// A blocking `SOCK_DGRAM` packet socket for `protocol` (0: receives
/// nothing; each frame sent names its interface).
fn open_socket(protocol: u16) -> io::Result<OwnedFd> {
    // SAFETY: a plain syscall; the descriptor is owned from here on.
    unsafe {
        let fd = cvt(libc::socket(
            libc::AF_PACKET,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            i32::from(protocol.to_be()),
        ))?;
        Ok(OwnedFd::from_raw_fd(fd))
    }
}

/// Sends `arp` on `ifindex` to `to` every `every`, the first a period from
/// now, until the registration is dropped.
pub(crate) fn register(
    ifindex: u32,
    to: [u8; 6],
    arp: Vec<u8>,
    every: Duration,
) -> io::Result<Registration> {
    let process = process().map_err(|e| io::Error::other(e.to_string()))?;
    let sender = &process.sender;
    let id = sender.ids.fetch_add(1, Ordering::Relaxed);
    sender.table().entries.insert(
        id,
        Entry {
            ifindex,
            to,
            arp,
            every,
            due: Instant::now() + every,
        },
    );
    sender.changed.notify_one();
    Ok(Registration { id })
}

/// Watches `uplink` for frames from `mac` sent by another port, and
/// answers each with `arp` broadcast from `ifindex` (the lease's macvlan,
/// whose MAC is `mac`), until the registration is dropped ([module
/// docs](self)).
pub(crate) fn watch(
    uplink: u32,
    mac: [u8; 6],
    ifindex: u32,
    arp: Vec<u8>,
) -> io::Result<Registration> {
    let process = process().map_err(|e| io::Error::other(e.to_string()))?;
    let sender = &process.sender;
    let id = sender.ids.fetch_add(1, Ordering::Relaxed);
    let uplink = (current_netns(), uplink);
    let mut table = sender.table();
    if !table.listening.contains(&uplink) {
        // Bound before the lease counts as watched: no frame goes unseen
        // from here on. The thread, made from this one, is in its
        // namespace, as the socket is.
        let socket = listening_socket(uplink.1)?;
        let theirs = sender.clone();
        std::thread::Builder::new()
            .name(format!("hna-lan-{}", uplink.1))
            .spawn(move || listen(&theirs, uplink, &socket))?;
        table.listening.insert(uplink);
    }
    table.watched.insert(
        id,
        Watched {
            uplink,
            mac,
            ifindex,
            arp,
            budget: Budget::full(Instant::now()),
        },
    );
    Ok(Registration { id })
}

/// A socket that receives the ARP frames arriving on `uplink`, blocking
/// for at most [`LISTEN_TIMEOUT`].
fn listening_socket(uplink: u32) -> io::Result<OwnedFd> {
    let socket = open_socket(ETH_P_ARP)?;
    let timeout = libc::timeval {
        tv_sec: LISTEN_TIMEOUT.as_secs() as libc::time_t,
        tv_usec: 0,
    };
    let sa = ll_addr(uplink, ETH_P_ARP, [0; 6]);
    // SAFETY: plain syscalls on a live descriptor with correctly sized
    // locals.
    unsafe {
        cvt(libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            &timeout as *const _ as *const libc::c_void,
            size_of::<libc::timeval>() as u32,
        ))?;
        cvt(libc::bind(
            socket.as_raw_fd(),
            &sa as *const _ as *const libc::sockaddr,
            size_of::<libc::sockaddr_ll>() as u32,
        ))?;
    }
    Ok(socket)
}

/// The namespace key of [`UplinkKey`] for the calling thread.
fn current_netns() -> u64 {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::metadata("/proc/thread-self/ns/net").map_or(0, |m| m.ino())
}

/// An uplink's listening thread: answers what [`Table::answers`] says,
/// from the listening socket (sent on the lease's macvlan, in the
/// uplink's namespace); ends once no lease is watched on the uplink or
/// the uplink is gone.
fn listen(sender: &Sender, uplink: UplinkKey, socket: &OwnedFd) {
    let mut buf = [0u8; 64];
    loop {
        match recv_datagram(socket, &mut buf) {
            // A socket for one protocol is not shown outgoing frames; a
            // looped-back copy would say so.
            Ok(d) if d.pkttype == libc::PACKET_OUTGOING => {}
            Ok(d) => {
                let answers = sender.table().answers(uplink, d.src_mac, Instant::now());
                for (ifindex, arp) in answers {
                    let sent = send_to(socket, ifindex, ETH_P_ARP, BROADCAST_MAC, &arp);
                    tracing::info!(
                        uplink = uplink.1,
                        ifindex,
                        mac = %crate::mac::format(&d.src_mac),
                        sent = sent.is_ok(),
                        "another port sent from a held address's MAC: announced it again"
                    );
                }
            }
            Err(e) => {
                let timed_out = matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                );
                let mut table = sender.table();
                if !table.watches_on(uplink) || !interface_exists(uplink.1) {
                    table.listening.remove(&uplink);
                    return;
                }
                drop(table);
                // The uplink went down (ENETDOWN, said once): the socket
                // listens again when it comes up.
                if !timed_out {
                    tracing::debug!(uplink = uplink.1, error = %e, "LAN watch: receive");
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }
}

fn interface_exists(ifindex: u32) -> bool {
    let mut name = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: the buffer is IF_NAMESIZE long, as if_indextoname needs.
    !unsafe { libc::if_indextoname(ifindex, name.as_mut_ptr()) }.is_null()
}

/// The sending thread's loop: sends what is due, sleeps until the next is
/// due or the table changes. A frame that cannot be sent (its link just
/// deleted) is skipped: the lease removes its entry as it goes.
fn run(sender: &Sender, mut send: impl FnMut(&Entry) -> io::Result<()>) {
    let mut table = sender.table();
    loop {
        let (due, wait) = table.take_due(Instant::now());
        if !due.is_empty() {
            drop(table);
            for e in &due {
                if let Err(err) = send(e) {
                    tracing::debug!(ifindex = e.ifindex, error = %err, "presence frame not sent");
                }
            }
            table = sender.table();
            continue;
        }
        table = match wait {
            Some(wait) => {
                sender
                    .changed
                    .wait_timeout(table, wait)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0
            }
            None => sender
                .changed
                .wait(table)
                .unwrap_or_else(PoisonError::into_inner),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(ifindex: u32, every_ms: u64, due: Instant) -> Entry {
        Entry {
            ifindex,
            to: [2, 0, 0, 0, 0, 1],
            arp: vec![ifindex as u8],
            every: Duration::from_millis(every_ms),
            due,
        }
    }

    #[test]
    fn due_entries_go_once_and_a_late_wake_up_makes_no_burst() {
        let t0 = Instant::now();
        let mut table = Table::default();
        table.entries.insert(1, entry(1, 500, t0));
        table
            .entries
            .insert(2, entry(2, 500, t0 + Duration::from_millis(200)));
        let (due, wait) = table.take_due(t0);
        assert_eq!(due.iter().map(|e| e.ifindex).collect::<Vec<_>>(), [1]);
        assert_eq!(wait, Some(Duration::from_millis(200)));
        // Woken 3 s late: each due entry goes once, the next a period on.
        let late = t0 + Duration::from_secs(3);
        let (due, wait) = table.take_due(late);
        assert_eq!(due.len(), 2);
        assert_eq!(wait, Some(Duration::from_millis(500)));
        let (due, _) = table.take_due(late + Duration::from_millis(499));
        assert!(due.is_empty());
    }

    /// The LAN watch answers a burst at once, then one per period, and a
    /// quiet spell fills the budget again, but not beyond the burst.
    #[test]
    fn answers_come_in_a_burst_then_one_per_period() {
        let t0 = Instant::now();
        let mut b = Budget::full(t0);
        let spent = (0..10).filter(|_| b.spend(t0)).count();
        assert_eq!(spent, ANSWER_BURST as usize);
        assert!(!b.spend(t0 + ANSWER_EVERY / 2));
        assert!(b.spend(t0 + ANSWER_EVERY));
        assert!(!b.spend(t0 + ANSWER_EVERY + ANSWER_EVERY / 2));
        assert!(b.spend(t0 + ANSWER_EVERY * 2));
        let later = t0 + ANSWER_EVERY * 100;
        let spent = (0..10).filter(|_| b.spend(later)).count();
        assert_eq!(spent, ANSWER_BURST as usize);
    }

    /// Only a frame on the lease's uplink, from the lease's MAC, is
    /// answered, from the lease's macvlan with its announcement; the
    /// same MAC on another uplink (or namespace) is another lease's.
    #[test]
    fn a_frame_is_answered_for_the_leases_with_its_mac_on_its_uplink() {
        let now = Instant::now();
        let mut table = Table::default();
        let watched = |uplink: UplinkKey, mac: [u8; 6], ifindex: u32| Watched {
            uplink,
            mac,
            ifindex,
            arp: vec![ifindex as u8],
            budget: Budget::full(now),
        };
        let (m1, m2) = ([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2]);
        table.watched.insert(1, watched((7, 3), m1, 10));
        table.watched.insert(2, watched((7, 3), m2, 11));
        table.watched.insert(3, watched((8, 3), m1, 12));
        assert_eq!(table.answers((7, 3), m1, now), [(10, vec![10])]);
        assert_eq!(table.answers((8, 3), m1, now), [(12, vec![12])]);
        assert!(table.answers((7, 4), m1, now).is_empty());
        assert!(table.answers((7, 3), [2, 0, 0, 0, 0, 9], now).is_empty());
        assert!(table.watches_on((7, 3)) && !table.watches_on((7, 4)));
    }

    /// The loop sends each entry every period and nothing once it is gone.
    #[test]
    fn the_loop_sends_every_period_until_the_entry_goes() {
        let sender = Arc::new(Sender::new());
        let (tx, rx) = std::sync::mpsc::channel();
        let theirs = sender.clone();
        std::thread::spawn(move || {
            run(&theirs, |e| {
                let _ = tx.send((e.ifindex, Instant::now()));
                Ok(())
            })
        });
        let every = Duration::from_millis(20);
        let start = Instant::now();
        sender
            .table()
            .entries
            .insert(7, entry(7, 20, start + every));
        sender.changed.notify_one();
        let deadline = Duration::from_secs(10);
        let sent: Vec<(u32, Instant)> =
            (0..5).map(|_| rx.recv_timeout(deadline).unwrap()).collect();
        assert!(sent.iter().all(|(i, _)| *i == 7));
        // Never before its time: the k-th is due k+1 periods after the
        // start (a late wake-up keeps the cadence, or moves it later).
        for (k, (_, at)) in sent.iter().enumerate() {
            assert!(*at >= start + every * (k as u32 + 1), "{k}: {sent:?}");
        }
        sender.table().entries.remove(&7);
        // One frame may have been taken before the removal; none after it.
        let after = std::iter::from_fn(|| rx.recv_timeout(every * 5).ok())
            .take(3)
            .count();
        assert!(after <= 1, "{after} frames after the entry went");
    }
}
