//! Keeps `STATUS=` and the log in step with the daemon's state.

use std::sync::Arc;

use tokio::sync::watch;

use super::status::{AgentStatus, ClusterState};
use crate::guest::GuestAgentState;
use crate::kmod::MacvlanState;
use crate::systemd::Notifier;
use crate::topology::TopologyState;

/// What the publisher listens to: any change re-renders the summary.
pub struct Sources {
    pub cluster: watch::Receiver<ClusterState>,
    pub macvlan: watch::Receiver<MacvlanState>,
    pub guest: watch::Receiver<GuestAgentState>,
    pub topology: watch::Receiver<TopologyState>,
}

pub async fn status_line(
    notifier: Arc<dyn Notifier>,
    mut sources: Sources,
    snapshot: impl Fn() -> AgentStatus,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut last = String::new();
    loop {
        let summary = snapshot().summary;
        if summary != last {
            notifier.status(&summary);
            match &*sources.cluster.borrow() {
                ClusterState::Unreachable { error, .. } => tracing::warn!(%error, "{summary}"),
                _ => tracing::info!("{summary}"),
            }
            last = summary;
        }
        tokio::select! {
            changed = sources.cluster.changed() => if changed.is_err() { return },
            changed = sources.macvlan.changed() => if changed.is_err() { return },
            changed = sources.guest.changed() => if changed.is_err() { return },
            changed = sources.topology.changed() => if changed.is_err() { return },
            _ = shutdown.changed() => return,
        }
    }
}
