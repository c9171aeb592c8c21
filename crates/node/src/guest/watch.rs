//! Follows the guest agent's health: device hot-plug through inotify on
//! `/dev` and `/dev/virtio-ports`, unit changes through systemd's D-Bus
//! signals, and a short poll for what neither can signal (debugfs flags,
//! a process started by hand).

use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
use tokio::io::unix::AsyncFd;
use tokio::sync::watch;

use super::units::{ServiceManager, Systemd};
use super::{GuestAgentState, UNITS, assess, facts};
use hna_edges::systemd::Heartbeat;

/// Debugfs flags and processes cannot signal changes; look this often.
pub(crate) const POLL: Duration = Duration::from_secs(5);

/// One assessment of the node, connecting to systemd first (for `check`).
pub async fn assess_now(root: &Path) -> GuestAgentState {
    assess_with(root, connect_systemd().await.as_ref()).await
}

/// One assessment with an existing systemd connection (or none).
pub(crate) async fn assess_with(root: &Path, systemd: Option<&Systemd>) -> GuestAgentState {
    assess(&facts::gather(root, systemd).await)
}

/// The system bus connection, or `None` (logged) when there is no systemd.
pub(crate) async fn connect_systemd() -> Option<Systemd> {
    match Systemd::connect().await {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::info!(error = %e, "no systemd on D-Bus; judging qemu-ga by its process");
            None
        }
    }
}

struct RawInotify(Inotify);
impl AsRawFd for RawInotify {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

fn watch_dirs(inotify: &Inotify, root: &Path) {
    for dir in facts::watched_dirs(root) {
        // /dev/virtio-ports appears only with the first port: a missing
        // directory is watched through /dev until then.
        let _ = inotify.add_watch(
            &dir,
            AddWatchFlags::IN_CREATE | AddWatchFlags::IN_DELETE | AddWatchFlags::IN_MOVED_TO,
        );
    }
}

pub(crate) async fn run(
    root: PathBuf,
    systemd: Option<Systemd>,
    out: watch::Sender<GuestAgentState>,
    hb: Heartbeat,
    beat_every: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)
        .ok()
        // SAFETY: the descriptor belongs to the Inotify moved into the
        // AsyncFd, which keeps it open and unchanged for its whole life.
        .and_then(|i| {
            unsafe { AsyncFd::register_with_interest(RawInotify(i), tokio::io::Interest::READABLE) }
                .ok()
        });
    if let Some(i) = &inotify {
        watch_dirs(&i.get_ref().0, &root);
    }
    let mut beat = tokio::time::interval(beat_every);
    loop {
        let next = assess(&facts::gather(&root, systemd.as_ref()).await);
        out.send_if_modified(|cur| {
            if *cur == next {
                return false;
            }
            if next.ready {
                tracing::info!(reason = next.reason.as_str(), "qemu-guest-agent: {}", next.message);
            } else {
                tracing::warn!(reason = next.reason.as_str(), remediation = %next.remediation, "qemu-guest-agent: {}", next.message);
            }
            *cur = next;
            true
        });
        let poll = tokio::time::sleep(POLL);
        tokio::pin!(poll);
        loop {
            tokio::select! {
                _ = &mut poll => break,
                ready = async {
                    match &inotify {
                        Some(i) => i.readable().await.ok(),
                        None => std::future::pending().await,
                    }
                } => {
                    if let (Some(mut guard), Some(i)) = (ready, &inotify) {
                        let _ = i.get_ref().0.read_events();
                        guard.clear_ready();
                        watch_dirs(&i.get_ref().0, &root);
                    }
                    // Let udev finish the link before looking.
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    break;
                }
                _ = async {
                    match &systemd {
                        Some(s) => s.changed(UNITS).await,
                        None => std::future::pending().await,
                    }
                } => break,
                _ = beat.tick() => hb.beat(),
                _ = shutdown.changed() => return,
            }
        }
    }
}
