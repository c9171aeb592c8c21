//! systemd service-manager integration: the `Type=notify` protocol
//! (`READY=1`, `STATUS=`, `STOPPING=1`) and a watchdog that pings only while
//! every registered main loop is alive.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

use sd_notify::NotifyState;
use tokio::sync::watch;

/// Messages the daemon sends to the service manager. A trait so that the
/// orchestration logic can be tested without a `NOTIFY_SOCKET`.
pub trait Notifier: Send + Sync + 'static {
    fn ready(&self);
    fn status(&self, line: &str);
    fn watchdog(&self);
    fn stopping(&self);
}

/// Sends to `$NOTIFY_SOCKET`; a no-op when the variable is unset (for example
/// when the daemon runs in a terminal).
#[derive(Debug, Default)]
pub struct SdNotifier;

impl SdNotifier {
    fn send(&self, state: &[NotifyState]) {
        if let Err(e) = sd_notify::notify(state) {
            tracing::debug!(error = %e, "could not notify the service manager");
        }
    }
}

impl Notifier for SdNotifier {
    fn ready(&self) {
        self.send(&[NotifyState::Ready]);
    }
    fn status(&self, line: &str) {
        self.send(&[NotifyState::Status(line)]);
    }
    fn watchdog(&self) {
        self.send(&[NotifyState::Watchdog]);
    }
    fn stopping(&self) {
        self.send(&[NotifyState::Stopping]);
    }
}

/// The watchdog period systemd asked for (`WatchdogSec=` → `WATCHDOG_USEC`),
/// if any and if it is meant for this process.
pub fn watchdog_period() -> Option<Duration> {
    sd_notify::watchdog_enabled().filter(|d| !d.is_zero())
}

/// Registry of the daemon's main loops. Each loop beats regularly; the
/// watchdog pings systemd only while every loop has beaten recently, so a
/// wedged loop gets the service restarted instead of hidden by a timer task.
#[derive(Debug, Default, Clone)]
pub struct Liveness {
    inner: Arc<LivenessInner>,
}

#[derive(Debug)]
struct LivenessInner {
    epoch: Instant,
    loops: Mutex<Vec<(String, Arc<AtomicU64>)>>,
}

impl Default for LivenessInner {
    fn default() -> Self {
        Self {
            epoch: Instant::now(),
            loops: Mutex::new(Vec::new()),
        }
    }
}

/// A loop's handle to report that it is still turning.
#[derive(Debug, Clone)]
pub struct Heartbeat {
    epoch: Instant,
    last_ms: Arc<AtomicU64>,
}

impl Heartbeat {
    pub fn beat(&self) {
        self.beat_at(Instant::now());
    }

    fn beat_at(&self, now: Instant) {
        let ms = now.saturating_duration_since(self.epoch).as_millis() as u64;
        self.last_ms.store(ms, Ordering::Relaxed);
    }
}

impl Liveness {
    /// Registers a loop; it counts as alive from now.
    pub fn register(&self, name: &str) -> Heartbeat {
        let hb = Heartbeat {
            epoch: self.inner.epoch,
            last_ms: Arc::new(AtomicU64::new(0)),
        };
        hb.beat();
        self.inner
            .loops
            .lock()
            .expect("liveness lock")
            .push((name.to_string(), hb.last_ms.clone()));
        hb
    }

    /// Loops that have not beaten within `max_age` of `now`.
    pub fn stalled(&self, now: Instant, max_age: Duration) -> Vec<String> {
        let now_ms = now.saturating_duration_since(self.inner.epoch).as_millis() as u64;
        let max_ms = max_age.as_millis() as u64;
        self.inner
            .loops
            .lock()
            .expect("liveness lock")
            .iter()
            .filter(|(_, last)| now_ms.saturating_sub(last.load(Ordering::Relaxed)) > max_ms)
            .map(|(name, _)| name.clone())
            .collect()
    }
}

/// How often loops should beat for a given watchdog period: often enough that
/// two beats fit in the half period the watchdog checks against.
pub fn heartbeat_interval(watchdog: Option<Duration>) -> Duration {
    match watchdog {
        Some(p) => (p / 4).clamp(Duration::from_millis(10), Duration::from_secs(1)),
        None => Duration::from_secs(1),
    }
}

/// Pings `WATCHDOG=1` every `period / 2` while all loops are alive, until
/// `shutdown` turns true.
pub async fn run_watchdog(
    notifier: Arc<dyn Notifier>,
    liveness: Liveness,
    period: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let half = period / 2;
    let mut tick = tokio::time::interval_at(Instant::now() + half, half);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut withheld = false;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.changed() => {}
        }
        if *shutdown.borrow() {
            return;
        }
        let stalled = liveness.stalled(Instant::now(), half);
        if stalled.is_empty() {
            if withheld {
                tracing::info!("all main loops alive again; resuming watchdog pings");
                withheld = false;
            }
            notifier.watchdog();
        } else if !withheld {
            tracing::error!(loops = ?stalled, "main loops stalled; withholding watchdog pings so systemd restarts the daemon");
            withheld = true;
        }
    }
}

/// The longest any one awaited step of a main loop may take and still count
/// as alive: past every bounded wait there is (the 60 s macvlan preflight is
/// the longest). A netlink or API call that hangs longer stops the beats, so
/// the watchdog restarts the daemon instead of hiding the hang.
pub(crate) const LONGEST_STEP: Duration = Duration::from_secs(90);

/// Drives `fut` to completion while beating, so a loop waiting on bounded
/// I/O still counts as alive; for `LONGEST_STEP` at most.
pub async fn beating<F: std::future::Future>(hb: &Heartbeat, every: Duration, fut: F) -> F::Output {
    beating_for(hb, every, LONGEST_STEP, fut).await
}

async fn beating_for<F: std::future::Future>(
    hb: &Heartbeat,
    every: Duration,
    limit: Duration,
    fut: F,
) -> F::Output {
    tokio::pin!(fut);
    let mut tick = tokio::time::interval(every);
    let give_up = tokio::time::sleep(limit);
    tokio::pin!(give_up);
    loop {
        tokio::select! {
            out = &mut fut => return out,
            _ = tick.tick() => hb.beat(),
            _ = &mut give_up => {
                tracing::error!(limit = %humantime::format_duration(limit), "a step of a main loop has not finished in time; it no longer counts as alive, so the watchdog restarts the daemon");
                return fut.await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_hung_step_stops_beating_after_the_limit() {
        let liveness = Liveness::default();
        let hb = liveness.register("lb");
        let every = Duration::from_secs(1);
        let limit = Duration::from_secs(10);
        let hung = tokio::spawn({
            let hb = hb.clone();
            async move { beating_for(&hb, every, limit, std::future::pending::<()>()).await }
        });
        tokio::time::sleep(Duration::from_secs(9)).await;
        assert!(
            liveness
                .stalled(Instant::now(), Duration::from_secs(2))
                .is_empty()
        );
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(
            liveness.stalled(Instant::now(), Duration::from_secs(2)),
            ["lb"],
            "a step hung past its limit still counts as alive"
        );
        hung.abort();

        // A step that ends in time returns its output.
        assert_eq!(beating_for(&hb, every, limit, async { 7 }).await, 7);
    }

    #[derive(Default)]
    struct Recorder(Mutex<Vec<String>>);
    impl Notifier for Recorder {
        fn ready(&self) {
            self.0.lock().unwrap().push("READY=1".into());
        }
        fn status(&self, line: &str) {
            self.0.lock().unwrap().push(format!("STATUS={line}"));
        }
        fn watchdog(&self) {
            self.0.lock().unwrap().push("WATCHDOG=1".into());
        }
        fn stopping(&self) {
            self.0.lock().unwrap().push("STOPPING=1".into());
        }
    }

    #[test]
    fn a_loop_that_stops_beating_is_reported() {
        let l = Liveness::default();
        let a = l.register("a");
        let _b = l.register("b");
        let t0 = Instant::now();
        a.beat_at(t0 + Duration::from_secs(5));
        let stalled = l.stalled(t0 + Duration::from_secs(6), Duration::from_secs(2));
        assert_eq!(stalled, vec!["b".to_string()]);
        assert!(
            l.stalled(t0 + Duration::from_millis(500), Duration::from_secs(2))
                .is_empty()
        );
    }

    #[test]
    fn heartbeat_fits_twice_in_half_a_period() {
        assert_eq!(
            heartbeat_interval(Some(Duration::from_millis(400))),
            Duration::from_millis(100)
        );
        assert_eq!(
            heartbeat_interval(Some(Duration::from_secs(60))),
            Duration::from_secs(1)
        );
        assert_eq!(heartbeat_interval(None), Duration::from_secs(1));
    }

    #[tokio::test(start_paused = true)]
    async fn watchdog_pings_only_while_loops_beat() {
        let rec = Arc::new(Recorder::default());
        let liveness = Liveness::default();
        let hb = liveness.register("main");
        let (tx, rx) = watch::channel(false);
        let period = Duration::from_secs(2);
        let task = tokio::spawn(run_watchdog(rec.clone(), liveness, period, rx));
        // Beat for 5 s: pings at 0, 1, 2, 3, 4, 5 s.
        for _ in 0..50 {
            hb.beat();
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let pings_while_alive = rec.0.lock().unwrap().len();
        assert!(pings_while_alive >= 4, "{pings_while_alive}");
        // Stop beating: at most one more ping, then none.
        tokio::time::sleep(Duration::from_secs(10)).await;
        let after = rec.0.lock().unwrap().len();
        assert!(
            after <= pings_while_alive + 1,
            "{after} vs {pings_while_alive}"
        );
        tx.send(true).unwrap();
        task.await.unwrap();
    }
}

/// Whether systemd is stopping this unit to start it again (`systemctl
/// restart`, `try-restart`, a package's upgrade script): a job of a
/// restarting type is queued for it. `false` outside systemd, when the
/// unit cannot be named, or when `systemctl` does not answer within
/// three seconds: a stop then hands everything over.
pub async fn restart_pending() -> bool {
    if std::env::var_os("INVOCATION_ID").is_none() {
        return false;
    }
    let Some(unit) = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|c| own_unit(&c))
    else {
        return false;
    };
    let out = tokio::time::timeout(
        Duration::from_secs(3),
        tokio::process::Command::new("systemctl")
            .args(["list-jobs", "--no-legend", "--no-pager", "--full", &unit])
            .kill_on_drop(true)
            .output(),
    )
    .await;
    match out {
        Ok(Ok(o)) if o.status.success() => {
            let restart = restart_job(&String::from_utf8_lossy(&o.stdout), &unit);
            tracing::info!(
                unit,
                restart,
                "asked systemd whether this stop is a restart"
            );
            restart
        }
        other => {
            tracing::warn!(unit, outcome = ?other.map(|r| r.map(|o| o.status)), "cannot ask systemd whether this stop is a restart: handing every address over");
            false
        }
    }
}

/// The `.service` unit this process runs in, from `/proc/self/cgroup`.
fn own_unit(cgroup: &str) -> Option<String> {
    cgroup.lines().find_map(|line| {
        let path = line.splitn(3, ':').nth(2)?;
        path.split('/')
            .rev()
            .find(|p| p.ends_with(".service"))
            .map(str::to_string)
    })
}

/// Whether `systemctl list-jobs` output (`JOB UNIT TYPE STATE` per line)
/// has a restarting job for `unit`.
fn restart_job(list: &str, unit: &str) -> bool {
    list.lines().any(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        f.len() >= 3 && f[1] == unit && f[2].contains("restart")
    })
}

#[cfg(test)]
mod restart_tests {
    use super::*;

    #[test]
    fn the_unit_comes_from_the_cgroup_and_only_a_restart_job_counts() {
        assert_eq!(
            own_unit("0::/system.slice/harvester-node-agent.service\n").as_deref(),
            Some("harvester-node-agent.service")
        );
        assert_eq!(
            own_unit("0::/user.slice/user-0.slice/session-1.scope\n"),
            None
        );
        let unit = "harvester-node-agent.service";
        assert!(restart_job(
            "812 harvester-node-agent.service restart running\n",
            unit
        ));
        assert!(restart_job(
            "812 harvester-node-agent.service try-restart running\n",
            unit
        ));
        assert!(!restart_job(
            "812 harvester-node-agent.service stop running\n",
            unit
        ));
        assert!(!restart_job("9 other.service restart running\n", unit));
        assert!(!restart_job("", unit));
    }
}
