//! The daemon's macvlan task: the first preflight (bounded by the start-up
//! budget), then re-checks on a slow timer and on `systemctl reload`.

use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use super::Context;
use crate::health::Status;
use crate::kmod::{self, MacvlanState, Reason};
use hna_edges::systemd::beating;

/// The longest one preflight (a module load + probe) may take.
pub(crate) const PREFLIGHT_TIMEOUT: Duration = Duration::from_secs(60);

/// One preflight, loading the module when it is on disk.
pub(crate) async fn run_preflight() -> MacvlanState {
    let work = tokio::task::spawn_blocking(|| kmod::preflight(&kmod::host::Host::default(), true));
    match tokio::time::timeout(PREFLIGHT_TIMEOUT, work).await {
        Ok(Ok(state)) => state,
        Ok(Err(e)) => failed(format!("the preflight task failed: {e}")),
        Err(_) => failed(format!(
            "the preflight did not finish within {}",
            humantime::format_duration(PREFLIGHT_TIMEOUT)
        )),
    }
}

fn failed(message: String) -> MacvlanState {
    MacvlanState {
        status: Status::Fail,
        reason: Reason::ProbeFailed,
        message,
        remediation: "see the daemon's log; `harvester-node-agent check --fix` runs the same steps"
            .into(),
        ready: false,
        kernel: String::new(),
        loaded_at_boot: None,
    }
}

/// The state after a re-check. `LoadedByAgent` stays the reason while the
/// module stays loaded: who loaded it does not change on a later look.
pub(crate) fn merge(was: &MacvlanState, next: MacvlanState) -> MacvlanState {
    if was.reason == Reason::LoadedByAgent && next.reason == Reason::Loaded {
        MacvlanState {
            reason: Reason::LoadedByAgent,
            ..next
        }
    } else {
        next
    }
}

/// Whether a new state is worth a log line (the reason or readiness moved).
pub(crate) fn worth_logging(was: &MacvlanState, next: &MacvlanState) -> bool {
    was.reason != next.reason || was.ready != next.ready
}

pub(crate) fn log(state: &MacvlanState) {
    if state.ready || state.reason == Reason::Checking {
        tracing::info!(reason = state.reason.as_str(), "{}", state.message);
    } else {
        tracing::error!(
            reason = state.reason.as_str(),
            remediation = %state.remediation,
            "macvlan is not usable, DHCP LoadBalancer addresses cannot be held on this node: {}",
            state.message
        );
    }
}

/// Publishes the first preflight when it outlived the start-up budget, then
/// re-runs it every `every` and on each request (SIGHUP), so installing the
/// module and reloading fixes a node without a restart.
pub(crate) async fn recheck(
    ctx: Context,
    every: Duration,
    first: Option<JoinHandle<MacvlanState>>,
    state: watch::Sender<MacvlanState>,
    mut requests: mpsc::Receiver<()>,
) {
    let hb = ctx.liveness.register("macvlan");
    let mut shutdown = ctx.shutdown.clone();
    if let Some(first) = first {
        let next = match beating(&hb, ctx.beat_every, first).await {
            Ok(s) => s,
            Err(e) => failed(format!("the preflight task failed: {e}")),
        };
        publish(&state, next);
    }
    let mut timer = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    let mut beat = tokio::time::interval(ctx.beat_every);
    loop {
        tokio::select! {
            _ = timer.tick() => {}
            Some(()) = requests.recv() => {}
            _ = beat.tick() => { hb.beat(); continue; }
            _ = shutdown.changed() => return,
        }
        let next = beating(&hb, ctx.beat_every, run_preflight()).await;
        publish(&state, next);
    }
}

fn publish(state: &watch::Sender<MacvlanState>, next: MacvlanState) {
    let was = state.borrow().clone();
    let next = merge(&was, next);
    if worth_logging(&was, &next) {
        log(&next);
    }
    state.send_if_modified(|cur| {
        let changed = *cur != next;
        *cur = next;
        changed
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(reason: Reason, ready: bool) -> MacvlanState {
        MacvlanState {
            reason,
            ready,
            ..failed(String::new())
        }
    }

    #[test]
    fn loaded_by_agent_sticks_while_loaded() {
        let was = state(Reason::LoadedByAgent, true);
        assert_eq!(
            merge(&was, state(Reason::Loaded, true)).reason,
            Reason::LoadedByAgent
        );
        assert_eq!(
            merge(&was, state(Reason::ProbeFailed, false)).reason,
            Reason::ProbeFailed
        );
        assert_eq!(
            merge(&state(Reason::Checking, false), state(Reason::Loaded, true)).reason,
            Reason::Loaded
        );
    }

    #[test]
    fn only_a_move_is_logged() {
        let a = state(Reason::Loaded, true);
        assert!(!worth_logging(&a, &state(Reason::Loaded, true)));
        assert!(worth_logging(&a, &state(Reason::ProbeFailed, false)));
        assert!(worth_logging(
            &state(Reason::Checking, false),
            &state(Reason::BuiltIn, true)
        ));
    }
}
