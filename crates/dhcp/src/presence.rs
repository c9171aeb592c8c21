//! The presence frames of every lease of the process, sent by one thread
//! of their own.
//!
//! Why a thread and not each lease's task: the frames matter most right
//! after a live migration's switchover, which is when the process is
//! slowest. Under QEMU's TCG the target translates every instruction
//! anew as it first runs it, and the async runtime's paths (the lease
//! driver, netlink, the API client) kept the agent busy for one to four
//! seconds after the switchover, its timers seconds late (issue #31). This
//! thread's loop is a handful of instructions and a `sendto` per frame:
//! it is runnable within milliseconds of its deadline, whatever the rest
//! of the process is doing, and one wake-up sends every lease's frame that
//! is due, where a task per lease would wake a hundred times.
//!
//! A lease registers its frame while its address is on the link and drops
//! the [`Registration`] when it is not; the thread starts with the first
//! registration and runs for the life of the process.

use std::collections::BTreeMap;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use crate::raw::{ETH_P_ARP, cvt, send_to};

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

#[derive(Default)]
struct Table {
    entries: BTreeMap<u64, Entry>,
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
}

struct Sender {
    table: Mutex<Table>,
    changed: Condvar,
    ids: AtomicU64,
}

impl Sender {
    fn table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A lease's entry with the sender: removed when dropped.
#[derive(Debug)]
pub struct Registration {
    id: u64,
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Ok(sender) = sender() {
            sender.table().entries.remove(&self.id);
        }
    }
}

/// The process's sender, started on first use; an error when its socket
/// cannot be opened (no `CAP_NET_RAW`), said again to every caller.
fn sender() -> Result<&'static Arc<Sender>, &'static str> {
    static SENDER: OnceLock<Result<Arc<Sender>, String>> = OnceLock::new();
    SENDER
        .get_or_init(|| {
            let socket =
                open_socket().map_err(|e| format!("presence frames: packet socket: {e}"))?;
            let sender = Arc::new(Sender {
                table: Mutex::new(Table::default()),
                changed: Condvar::new(),
                ids: AtomicU64::new(1),
            });
            let theirs = sender.clone();
            std::thread::Builder::new()
                .name("hna-presence".into())
                .spawn(move || {
                    run(&theirs, |e| {
                        send_to(&socket, e.ifindex, ETH_P_ARP, e.to, &e.arp)
                    })
                })
                .map_err(|e| format!("presence frames: thread: {e}"))?;
            Ok(sender)
        })
        .as_ref()
        .map_err(String::as_str)
}

/// A blocking `SOCK_DGRAM` packet socket that receives nothing (protocol
/// 0); each frame names its interface.
fn open_socket() -> io::Result<OwnedFd> {
    // SAFETY: a plain syscall; the descriptor is owned from here on.
    unsafe {
        let fd = cvt(libc::socket(
            libc::AF_PACKET,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            0,
        ))?;
        Ok(OwnedFd::from_raw_fd(fd))
    }
}

/// Sends `arp` on `ifindex` to `to` every `every`, the first a period from
/// now, until the registration is dropped.
pub fn register(
    ifindex: u32,
    to: [u8; 6],
    arp: Vec<u8>,
    every: Duration,
) -> io::Result<Registration> {
    let sender = sender().map_err(io::Error::other)?;
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

/// The thread's loop: sends what is due, sleeps until the next is due or
/// the table changes. A frame that cannot be sent (its link just deleted)
/// is skipped: the lease removes its entry as it goes.
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

    /// The loop sends each entry every period and nothing once it is gone.
    #[test]
    fn the_loop_sends_every_period_until_the_entry_goes() {
        let sender = Arc::new(Sender {
            table: Mutex::new(Table::default()),
            changed: Condvar::new(),
            ids: AtomicU64::new(1),
        });
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
