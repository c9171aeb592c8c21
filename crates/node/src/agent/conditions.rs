//! The daemon's Node-conditions task: `MacvlanReady` and `GuestAgentReady`
//! on its own Node, on every change, and looked at again every
//! [`node_conditions::RECHECK`] (written then only if the Node shows something
//! else).

use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::Context;
use crate::guest::GuestAgentState;
use crate::kmod::MacvlanState;
use crate::node_conditions::{self, Condition, Reported};

fn condition(
    type_: &str,
    ready: bool,
    reason: &str,
    message: &str,
    remediation: &str,
) -> Condition {
    Condition {
        type_: type_.into(),
        ready,
        reason: reason.into(),
        message: if remediation.is_empty() {
            message.to_string()
        } else {
            format!("{message} Fix: {remediation}")
        },
    }
}

/// The conditions the agent owns, from the states they report.
pub(crate) fn wanted(macvlan: &MacvlanState, guest: &GuestAgentState) -> Vec<Condition> {
    vec![
        condition(
            "MacvlanReady",
            macvlan.ready,
            macvlan.reason.as_str(),
            &macvlan.message,
            &macvlan.remediation,
        ),
        condition(
            "GuestAgentReady",
            guest.ready,
            guest.reason.as_str(),
            &guest.message,
            &guest.remediation,
        ),
    ]
}

/// What was last written, and when.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Sent {
    pub(crate) conditions: Vec<Condition>,
    pub(crate) at: Instant,
}

/// Whether the Node is to be looked at again (and written if it shows
/// something else): never looked at yet, something changed, or
/// [`node_conditions::RECHECK`] has passed.
pub(crate) fn look_due(last: Option<&Sent>, wanted: &[Condition], now: Instant) -> bool {
    match last {
        Some(s) => s.conditions != wanted || now.duration_since(s.at) >= node_conditions::RECHECK,
        None => true,
    }
}

/// After a reconcile: what is remembered as sent and how long to wait.
pub(crate) fn after(
    result: &Reported,
    last: Option<Sent>,
    wanted: Vec<Condition>,
    due: bool,
    now: Instant,
    retry: Duration,
) -> (Option<Sent>, Duration) {
    match result {
        Reported::Reported { .. } if due => (
            Some(Sent {
                conditions: wanted,
                at: now,
            }),
            node_conditions::RECHECK,
        ),
        Reported::Reported { .. } => (last, node_conditions::RECHECK),
        Reported::NotConnected => (None, node_conditions::RECHECK),
        Reported::NodeNotRegistered | Reported::Failed { .. } => (last, retry),
    }
}

pub(crate) async fn report(
    ctx: Context,
    retry: Duration,
    mut client: watch::Receiver<Option<kube::Client>>,
    mut macvlan: watch::Receiver<MacvlanState>,
    mut guest: watch::Receiver<GuestAgentState>,
    out: watch::Sender<Reported>,
) {
    let mut shutdown = ctx.shutdown.clone();
    let mut last: Option<Sent> = None;
    loop {
        let current_client = client.borrow().clone();
        let wanted = wanted(&macvlan.borrow(), &guest.borrow());
        let now = Instant::now();
        let due = look_due(last.as_ref(), &wanted, now);
        let result = match current_client {
            None => Reported::NotConnected,
            // Written only when the Node shows something else.
            Some(c) => node_conditions::reconcile(&c, &ctx.node, &wanted, false).await,
        };
        if let Reported::Failed { error } = &result {
            tracing::warn!(%error, "could not report Node conditions");
        }
        let (next_last, wait) = after(&result, last.take(), wanted, due, now, retry);
        last = next_last;
        out.send_if_modified(|cur| {
            let changed = std::mem::discriminant(cur) != std::mem::discriminant(&result);
            *cur = result;
            changed
        });
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            r = client.changed() => if r.is_err() { return },
            r = macvlan.changed() => if r.is_err() { return },
            r = guest.changed() => if r.is_err() { return },
            _ = shutdown.changed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(reason: &str) -> Vec<Condition> {
        vec![condition("MacvlanReady", true, reason, "m", "")]
    }

    #[test]
    fn due_on_first_change_and_recheck_only() {
        let t0 = Instant::now();
        assert!(look_due(None, &c("BuiltIn"), t0));
        let sent = Sent {
            conditions: c("BuiltIn"),
            at: t0,
        };
        assert!(!look_due(
            Some(&sent),
            &c("BuiltIn"),
            t0 + Duration::from_secs(299)
        ));
        assert!(look_due(
            Some(&sent),
            &c("BuiltIn"),
            t0 + node_conditions::RECHECK
        ));
        assert!(look_due(
            Some(&sent),
            &c("Loaded"),
            t0 + Duration::from_secs(1)
        ));
    }

    #[test]
    fn a_failed_write_is_retried_soon_and_not_remembered() {
        let t0 = Instant::now();
        let retry = Duration::from_secs(10);
        let failed = Reported::Failed {
            error: "403".into(),
        };
        assert_eq!(
            after(&failed, None, c("BuiltIn"), true, t0, retry),
            (None, retry)
        );
        let reported = Reported::Reported { at: "now".into() };
        let (last, wait) = after(&reported, None, c("BuiltIn"), true, t0, retry);
        assert_eq!(wait, node_conditions::RECHECK);
        assert_eq!(last.unwrap().conditions, c("BuiltIn"));
        // Disconnected: forget what was sent, so reconnecting writes at once.
        let sent = Some(Sent {
            conditions: c("BuiltIn"),
            at: t0,
        });
        assert_eq!(
            after(
                &Reported::NotConnected,
                sent,
                c("BuiltIn"),
                false,
                t0,
                retry
            )
            .0,
            None
        );
    }

    #[test]
    fn fixes_are_part_of_the_message() {
        let w = wanted(
            &MacvlanState {
                remediation: "zypper in kernel-default".into(),
                message: "macvlan is missing.".into(),
                ..MacvlanState::checking(String::new())
            },
            &GuestAgentState::checking("looking".into()),
        );
        assert_eq!(
            w[0].message,
            "macvlan is missing. Fix: zypper in kernel-default"
        );
        assert_eq!(w[1].type_, "GuestAgentReady");
        assert!(!w[1].ready);
    }
}
