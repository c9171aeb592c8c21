//! Pauses of this VM that its own clocks do not count.
//!
//! A hypervisor stops a VM's vCPUs for the switchover of a live migration
//! (a few hundred milliseconds), for `virsh suspend` / `virtctl pause`, or
//! when its storage fails. The guest's monotonic clock (kvmclock, TSC) and
//! its wall clock stand still meanwhile, so nothing the daemon times sees
//! the pause; but the emulated RTC follows the host's clock and does count
//! it. After a migration the LAN's switches still send a Service MAC to the
//! old host until a frame from that MAC comes from the new one: the guest
//! kernel announces its addresses only where the NIC negotiated
//! `VIRTIO_NET_F_GUEST_ANNOUNCE` (not with e1000-family NICs), so the
//! daemon announces every address it holds again when it sees a pause.
//!
//! The RTC tells only whole seconds (`/sys/class/rtc/rtc0/since_epoch`,
//! readable by anyone, no exclusive open as `/dev/rtc0` has). [`PauseWatch`]
//! finds the instant its second changes, to within a few milliseconds, by
//! reading it around that instant, and from then on expects the next
//! change one monotonic second later: a change seen earlier is a pause at
//! least that much earlier. Every figure it reports is a lower bound that
//! scheduling delays cannot inflate (each reading carries the monotonic
//! time before and after it), so a loaded guest gets no false pause; a
//! stepped RTC (`hwclock --systohc`) can cause one, which costs one round
//! of announcements.
//!
//! Pure: readings in, pauses and the time of the next reading out; the
//! thread that reads the file is started by [`spawn`].

use std::path::PathBuf;
use std::time::Duration;

/// One reading of the RTC's whole seconds, with the monotonic clock read
/// just before and just after it (since any fixed origin).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reading {
    pub(crate) before: Duration,
    pub(crate) after: Duration,
    pub(crate) rtc_seconds: u64,
}

/// What a reading showed, and when to read next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Step {
    /// The VM was paused for at least this long since the last known
    /// change of the RTC's second (`None`: nothing the bound can show).
    pub(crate) paused: Option<Duration>,
    /// Read again at this monotonic time.
    pub(crate) next_at: Duration,
}

/// The last change of the RTC's second: it happened after `earliest` and
/// by `latest` (monotonic), from `rtc_seconds - 1` to `rtc_seconds`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Edge {
    earliest: Duration,
    latest: Duration,
    rtc_seconds: u64,
}

/// Finds pauses from readings of the RTC. See the module's documentation.
#[derive(Debug, Clone)]
pub(crate) struct PauseWatch {
    /// Pauses shorter than this are not reported.
    report_from: Duration,
    /// How often to read while waiting for the second to change.
    poll: Duration,
    /// How long before the expected change to start polling.
    lead: Duration,
    /// The longest time between two readings, also far from a change: a
    /// pause as long as the address lifetime is seen this soon after the
    /// resume, before the resumed kernel has answered for the address
    /// beside its new holder for long (issue #31 asks 100 ms).
    at_least_every: Duration,
    edge: Option<Edge>,
    last: Option<Reading>,
}

/// One second.
const SECOND: Duration = Duration::from_secs(1);

impl PauseWatch {
    /// Reports pauses of at least `report_from`, polling every `poll` from
    /// `report_from + poll` before each expected change (so a pause of
    /// about `report_from + poll` is seen at the first reading after it),
    /// and at least every `at_least_every` in between (a pause of a second
    /// or more is seen at the first reading after it).
    pub(crate) fn new(
        report_from: Duration,
        poll: Duration,
        at_least_every: Duration,
    ) -> PauseWatch {
        PauseWatch {
            report_from,
            poll,
            lead: report_from + poll * 2,
            at_least_every,
            edge: None,
            last: None,
        }
    }

    /// The defaults: pauses of 50 ms or more, polled every 10 ms around
    /// each change of second, and read at least every 50 ms (about 27
    /// reads a second: a sysfs read of the emulated RTC each, a few
    /// microseconds under KVM).
    pub(crate) fn with_defaults() -> PauseWatch {
        PauseWatch::new(
            Duration::from_millis(50),
            Duration::from_millis(10),
            Duration::from_millis(50),
        )
    }

    /// Takes one reading.
    pub(crate) fn observe(&mut self, r: Reading) -> Step {
        let previous = self.last.replace(r);
        let mut paused = None;
        if let Some(edge) = self.edge {
            if r.rtc_seconds < edge.rtc_seconds {
                // Set back: nothing to compare with any more.
                self.edge = None;
            } else {
                // The RTC shows `rtc_seconds` at some moment within the
                // reading, so at least this many seconds passed on it
                // since the edge; on the monotonic clock at most this.
                let rtc_elapsed = SECOND * (r.rtc_seconds - edge.rtc_seconds) as u32;
                let mono_elapsed = r.after.saturating_sub(edge.earliest);
                let lower_bound = rtc_elapsed.saturating_sub(mono_elapsed);
                if lower_bound >= self.report_from {
                    paused = Some(lower_bound);
                    // The edge is in the past of a pause: find a new one.
                    self.edge = None;
                }
            }
        }
        // A change seen between two readings close together is a new edge,
        // unless a pause was seen: the change may have come in the pause,
        // and the next one would then look early.
        if let Some(p) = previous
            && paused.is_none()
            && r.rtc_seconds == p.rtc_seconds + 1
            && r.after.saturating_sub(p.before) <= self.poll * 4
        {
            self.edge = Some(Edge {
                earliest: p.before,
                latest: r.after,
                rtc_seconds: r.rtc_seconds,
            });
        }
        let next_at = match self.edge {
            Some(edge) => {
                // The next change is due one second after the edge.
                let due = edge.earliest + SECOND * (r.rtc_seconds - edge.rtc_seconds + 1) as u32;
                let start_polling = due.saturating_sub(self.lead);
                if r.after < start_polling {
                    start_polling
                } else {
                    r.after + self.poll
                }
            }
            None => r.after + self.poll,
        };
        let next_at = next_at.min(r.after + self.at_least_every);
        Step { paused, next_at }
    }
}

/// Where the RTC's seconds are read unless configured otherwise.
pub(crate) const DEFAULT_RTC_SECONDS: &str = "/sys/class/rtc/rtc0/since_epoch";

/// A pause the watch saw: at least `at_least` long, seen `seen` (tokio's
/// clock).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pause {
    pub(crate) at_least: Duration,
    pub(crate) seen: tokio::time::Instant,
}

/// What the watch's own thread does at once when it sees a pause of at
/// least `from`, before it tells anyone: after a pause as long as the
/// address lifetime the node's Services may be held elsewhere by now,
/// while this VM's kernel, whose clocks did not count the pause, still
/// answers for their addresses beside the new holders, until something
/// removes them. The rest of the daemon gets to that only after the
/// runtime's tasks have run (under TCG, with the resumed kernel first
/// draining what was queued for it, 0.2 to 0.66 s after the resume here,
/// issue #31); this thread reads the RTC every 50 ms and acts in the same
/// wake-up.
pub(crate) struct OnLongPause {
    pub(crate) from: Duration,
    pub(crate) act: Box<dyn Fn(Duration) + Send>,
}

/// Starts the watch on a thread of its own: reads `path` as
/// [`PauseWatch`] asks, runs `on_long` for a long pause, and sends every
/// pause it sees to `tx` (the newest only: a consumer that announces after
/// a pause needs no history). A thread, not a task: the first reading
/// after a resume must not wait for the runtime (nor a blocking-pool hop
/// per read). Ends when every receiver is gone; a file that cannot be read
/// (no RTC, as in some containers) is said once and the watch stops.
pub(crate) fn spawn(
    path: PathBuf,
    tx: tokio::sync::watch::Sender<Option<Pause>>,
    on_long: Option<OnLongPause>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("hna-pause".into())
        .spawn(move || {
            run(
                &path,
                || std::fs::read_to_string(&path),
                &tx,
                on_long.as_ref(),
            )
        })
}

/// The watch's loop over `read` (the RTC file's text, `path` in messages).
fn run(
    path: &std::path::Path,
    mut read: impl FnMut() -> std::io::Result<String>,
    tx: &tokio::sync::watch::Sender<Option<Pause>>,
    on_long: Option<&OnLongPause>,
) {
    let mut watch = PauseWatch::with_defaults();
    let origin = std::time::Instant::now();
    loop {
        let before = origin.elapsed();
        let text = match read() {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot read the RTC: pauses of this VM (live migration, suspend) go unseen, and addresses are not announced again after them");
                return;
            }
        };
        let after = origin.elapsed();
        let Ok(rtc_seconds) = text.trim().parse::<u64>() else {
            tracing::warn!(path = %path.display(), content = %text.trim(), "the RTC's seconds are not a number: pauses of this VM go unseen");
            return;
        };
        let step = watch.observe(Reading {
            before,
            after,
            rtc_seconds,
        });
        if let Some(at_least) = step.paused {
            if let Some(hook) = on_long.filter(|h| at_least >= h.from) {
                (hook.act)(at_least);
            }
            tracing::info!(at_least = ?at_least, "this VM was paused (its RTC ran on while its clocks stood still): a live migration or a suspend");
            if tx
                .send(Some(Pause {
                    at_least,
                    seen: tokio::time::Instant::now(),
                }))
                .is_err()
            {
                return;
            }
        }
        if tx.is_closed() {
            return;
        }
        std::thread::sleep(step.next_at.saturating_sub(origin.elapsed()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// A VM whose RTC's second changes at monotonic `phase` + k s, read
    /// as the watch asks (each read taking `cost`), with `pauses` (at
    /// monotonic time, length) hidden from the monotonic clock. Returns
    /// the pauses reported, with the monotonic time of the reading.
    fn simulate(
        phase: Duration,
        cost: Duration,
        pauses: &[(Duration, Duration)],
        until: Duration,
    ) -> (Vec<(Duration, Duration)>, usize) {
        let mut w = PauseWatch::with_defaults();
        let mut mono = ms(3);
        let mut reads = 0;
        let mut seen = Vec::new();
        // Real time = mono + the pauses before it.
        let real = |m: Duration| {
            m + pauses
                .iter()
                .filter(|(at, _)| *at <= m)
                .map(|(_, len)| *len)
                .sum::<Duration>()
        };
        while mono < until {
            let at = real(mono + cost / 2);
            let rtc = 1_000 + (at.saturating_sub(phase)).as_secs();
            let step = w.observe(Reading {
                before: mono,
                after: mono + cost,
                rtc_seconds: rtc,
            });
            reads += 1;
            if let Some(p) = step.paused {
                seen.push((mono, p));
            }
            mono = step.next_at.max(mono + cost);
        }
        (seen, reads)
    }

    #[test]
    fn no_pause_no_report_and_few_reads() {
        for phase in [ms(0), ms(137), ms(999)] {
            let (seen, reads) = simulate(phase, ms(1), &[], Duration::from_secs(60));
            assert!(seen.is_empty(), "{phase:?}: {seen:?}");
            assert!(reads < 60 * 30, "{reads} reads in a minute");
        }
    }

    #[test]
    fn a_switchover_pause_is_seen_within_a_second_and_not_overstated() {
        for (phase, at, len) in [
            (ms(0), ms(10_300), ms(300)),
            (ms(400), ms(20_950), ms(120)),
            (ms(777), ms(5_001), ms(80)),
        ] {
            let (seen, _) = simulate(phase, ms(1), &[(at, len)], Duration::from_secs(40));
            assert_eq!(seen.len(), 1, "{phase:?} {at:?} {len:?}: {seen:?}");
            let (when, bound) = seen[0];
            assert!(when >= at && when - at <= SECOND, "seen at {when:?}");
            assert!(
                bound <= len && bound >= ms(50),
                "bound {bound:?} for {len:?}"
            );
        }
    }

    #[test]
    fn a_long_pause_is_seen_at_the_first_reading_after_it() {
        let (seen, _) = simulate(
            ms(250),
            ms(1),
            &[(ms(7_500), ms(8_000))],
            Duration::from_secs(30),
        );
        assert_eq!(seen.len(), 1, "{seen:?}");
        let (when, bound) = seen[0];
        assert!(when - ms(7_500) <= ms(51), "seen at {when:?}");
        assert!(bound >= ms(7_000) && bound <= ms(8_000), "{bound:?}");
    }

    #[test]
    fn slow_readings_are_not_a_pause() {
        // Each reading takes 40 ms (a loaded guest): the bounds widen, no
        // report.
        let (seen, _) = simulate(ms(500), ms(40), &[], Duration::from_secs(60));
        assert!(seen.is_empty(), "{seen:?}");
    }

    /// A watch that saw the RTC change from 7 to 8 between 1.000 and
    /// 1.002 s.
    fn with_an_edge() -> PauseWatch {
        let mut w = PauseWatch::with_defaults();
        for (before, after, rtc_seconds) in [(990, 991, 7), (1_000, 1_002, 8)] {
            w.observe(Reading {
                before: ms(before),
                after: ms(after),
                rtc_seconds,
            });
        }
        w
    }

    #[test]
    fn a_late_wake_up_is_not_a_pause() {
        let mut w = with_an_edge();
        // The next reading comes 3 s late (the thread starved): the RTC
        // moved as much as the monotonic clock.
        let step = w.observe(Reading {
            before: ms(4_900),
            after: ms(4_901),
            rtc_seconds: 11,
        });
        assert_eq!(step.paused, None);
    }

    /// Issue #31: the watch's thread runs the long-pause hook itself, in
    /// the wake-up that sees the pause, before it tells the receiver; a
    /// pause shorter than the hook's `from` is only told.
    #[test]
    fn the_long_pause_hook_runs_on_the_watch_thread_before_the_news() {
        for (jump, hooked) in [(9, true), (2, false)] {
            let (tx, rx) = tokio::sync::watch::channel(None);
            let (hook_tx, hook_rx) = std::sync::mpsc::channel();
            let told_before_hook = rx.clone();
            let on_long = OnLongPause {
                from: Duration::from_secs(3),
                act: Box::new(move |at_least| {
                    let told = told_before_hook.borrow().is_some();
                    let _ = hook_tx.send((at_least, told));
                }),
            };
            // The RTC as read: 1000 three times, its change to 1001 (the
            // edge), then a jump of `jump` seconds (the resume), then the
            // file gone (the watch ends).
            let mut script = vec!["1000", "1000", "1000", "1001"];
            let resumed = (1001 + jump).to_string();
            let mut reads = 0;
            let thread = std::thread::spawn(move || {
                run(
                    std::path::Path::new("rtc"),
                    || {
                        reads += 1;
                        match reads {
                            1..=4 => Ok(script.remove(0).to_string()),
                            5 => Ok(resumed.clone()),
                            _ => Err(std::io::Error::other("gone")),
                        }
                    },
                    &tx,
                    Some(&on_long),
                )
            });
            thread.join().unwrap();
            let told = rx.borrow().expect("the pause is told");
            assert!(told.at_least >= Duration::from_secs(jump - 1), "{told:?}");
            match hook_rx.try_recv() {
                Ok((at_least, told_first)) => {
                    assert!(hooked, "hooked for a {jump} s pause");
                    assert_eq!(at_least, told.at_least);
                    assert!(!told_first, "the receiver heard before the hook ran");
                }
                Err(_) => assert!(!hooked, "no hook for a {jump} s pause"),
            }
        }
    }

    #[test]
    fn an_rtc_set_back_forgets_the_edge() {
        let mut w = with_an_edge();
        let step = w.observe(Reading {
            before: ms(1_500),
            after: ms(1_501),
            rtc_seconds: 3,
        });
        assert_eq!(step.paused, None);
        assert_eq!(step.next_at, ms(1_511));
    }
}
