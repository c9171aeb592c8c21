//! When a node lets go of every address on its own (self-fencing): a pure
//! decision over what it hears of its LAN and what its status writes
//! achieved.
//!
//! The controller moves a node's Services when its witnesses agree it is
//! dead on the LAN (`controller::lan_verdict`), or, without a word from the
//! LAN, when its status went stale. The fence is the node's side of both,
//! so that it lets go before another node is given its addresses:
//!
//! - With a LAN view (the membership runs and has heard a peer): the node
//!   fences when it hears none of its peers, or too few of its witnesses
//!   to escape their verdict, for its address lifetime (before its
//!   witnesses may report it: lifetime plus a margin, counted from their
//!   first unanswered probe), unless a status write succeeded since that
//!   silence began. A write that lands proves the API server still hears
//!   the node, but not that its clients do: then the node asks its
//!   gateway, with an ordinary ARP request from its uplink
//!   ([`GatewayCheck`]). Unanswered, its LAN port is cut off: it fences
//!   all the same, before its witnesses report it, since the controller's
//!   word that moves its Services would race the new holders (whose
//!   takeover guard cannot hear it through the dead port, and which bound
//!   an address before the old holder had read that it lost it, in the
//!   fault soak). Answered, its peers are gone and not its LAN: the
//!   controller decides (a node whose peers all died keeps serving, and the
//!   side of a split that reaches the API server keeps serving). An API
//!   server outage alone never fences while the LAN is heard.
//! - Without one (membership off, not running, no peers or none heard
//!   yet): the node fences when no status write succeeded for
//!   `lb_fence_after`, below the controller's staleness bound.

use std::time::Duration;

use tokio::time::Instant;

use crate::membership::transport::LanView;

/// What the decision reads.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Inputs<'a> {
    pub(crate) lan: &'a LanView,
    /// When a status write last succeeded (or the writes began).
    pub(crate) last_ok: Instant,
    /// The last status write failed.
    pub(crate) write_failing: bool,
    pub(crate) now: Instant,
    /// How long the LAN's silence is borne: this node's address lifetime.
    pub(crate) lan_wait: Duration,
    /// `lb_fence_after` (zero: never, without a LAN view).
    pub(crate) fence_after: Duration,
    /// The newest ask of the gateway (`None`: none yet, or no gateway).
    pub(crate) gateway: Option<GatewayCheck>,
}

/// One ask whether this node's gateway answers ARP on its uplink.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GatewayCheck {
    pub(crate) started: Instant,
    pub(crate) answered: bool,
}

/// The silences the LAN view shows, oldest first, each with what it says.
fn silences(lan: &LanView) -> [(Option<Instant>, String); 2] {
    let h = &lan.hearing;
    [
        (
            h.none_since,
            "it has heard none of its peers on the LAN".to_string(),
        ),
        (
            h.short_since,
            format!(
                "{} of its witnesses on the LAN ({}) have gone silent, enough for them to have its Services moved,",
                h.silent.len(),
                h.silent.join(", ")
            ),
        ),
    ]
}

/// Whether to ask the gateway now (one ask at a time is the caller's
/// part): the LAN went silent, and no ask was made since, or the last is
/// a lifetime old (the port may have died or come back since).
pub(crate) fn gateway_check_due(i: &Inputs<'_>) -> bool {
    if !lan_view_usable(i.lan) {
        return false;
    }
    let Some(since) = silences(i.lan).into_iter().filter_map(|(s, _)| s).min() else {
        return false;
    };
    i.gateway
        .is_none_or(|c| c.started < since || i.now >= c.started + i.lan_wait)
}

/// The decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Keep serving; decide again at `again` (if the inputs have not
    /// changed before).
    Hold { again: Option<Instant> },
    /// Hand every address over, for this reason.
    Fence(String),
}

/// Whether the membership gives this node a view of its LAN to decide on.
pub(crate) fn lan_view_usable(lan: &LanView) -> bool {
    lan.report.is_some() && lan.has_peers && lan.heard_any.is_some()
}

pub(crate) fn verdict(i: &Inputs<'_>) -> Verdict {
    if lan_view_usable(i.lan) {
        let mut again = None;
        let mut look_again = |at: Instant| again = Some(again.map_or(at, |a: Instant| a.min(at)));
        for (since, what) in silences(i.lan) {
            let Some(since) = since else { continue };
            let due = since + i.lan_wait;
            let written = i.last_ok >= since;
            // The API server heard from this node since: fenced only when
            // its gateway, asked since, does not answer either.
            let cut_off = !written || i.gateway.is_some_and(|c| c.started >= since && !c.answered);
            if let Some(c) = i.gateway.filter(|_| written) {
                look_again(c.started + i.lan_wait);
            }
            if !cut_off {
                if !written {
                    look_again(due);
                }
                continue;
            }
            if i.now >= due {
                let why = if written {
                    "its gateway does not answer ARP on its uplink either (its LAN port is cut off, though its status writes land)"
                } else {
                    "no status write succeeded since"
                };
                return Verdict::Fence(format!(
                    "fenced: {what} for {} or more, and {why}; nothing is held until they are heard or the gateway answers",
                    humantime::format_duration(i.lan_wait)
                ));
            }
            look_again(due);
        }
        return Verdict::Hold { again };
    }
    if !i.write_failing || i.fence_after.is_zero() {
        return Verdict::Hold { again: None };
    }
    let due = i.last_ok + i.fence_after;
    if i.now >= due {
        Verdict::Fence(format!(
            "fenced: no status written for {} (lb_fence_after) and no view of the LAN to vouch for this node; nothing is held until a status write succeeds",
            humantime::format_duration(i.fence_after)
        ))
    } else {
        Verdict::Hold { again: Some(due) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::membership::transport::Hearing;
    use hna_contract::membership::LanReport;

    const WAIT: Duration = Duration::from_secs(1);
    const FENCE_AFTER: Duration = Duration::from_secs(30);

    fn lan(t0: Instant) -> LanView {
        LanView {
            report: Some(LanReport::default()),
            has_peers: true,
            heard_any: Some(t0),
            hearing: Hearing {
                convicting: 2,
                ..Hearing::default()
            },
            ..LanView::default()
        }
    }

    fn at<'a>(lan: &'a LanView, last_ok: Instant, failing: bool, now: Instant) -> Inputs<'a> {
        Inputs {
            lan,
            last_ok,
            write_failing: failing,
            now,
            lan_wait: WAIT,
            fence_after: FENCE_AFTER,
            gateway: None,
        }
    }

    fn fenced(v: &Verdict) -> bool {
        matches!(v, Verdict::Fence(_))
    }

    #[test]
    fn an_api_outage_of_any_length_fences_nobody_who_hears_the_lan() {
        let t0 = Instant::now();
        let lan = lan(t0);
        let hour = t0 + Duration::from_secs(3600);
        assert_eq!(
            verdict(&at(&lan, t0, true, hour)),
            Verdict::Hold { again: None }
        );
    }

    #[test]
    fn a_node_that_hears_none_fences_after_its_lifetime_unless_written_since() {
        let t0 = Instant::now();
        let mut lan = lan(t0);
        let since = t0 + Duration::from_secs(5);
        lan.hearing.none_since = Some(since);
        let before = at(&lan, t0, false, since + Duration::from_millis(900));
        assert_eq!(
            verdict(&before),
            Verdict::Hold {
                again: Some(since + WAIT)
            }
        );
        let v = verdict(&at(&lan, t0, false, since + WAIT));
        assert!(fenced(&v), "{v:?}");
        assert!(format!("{v:?}").contains("heard none"), "{v:?}");
        // Its write landed after the silence began: the API server hears
        // it (its peers may all have died); the controller decides.
        let written = since + Duration::from_millis(300);
        assert_eq!(
            verdict(&at(&lan, written, false, since + Duration::from_secs(60))),
            Verdict::Hold { again: None }
        );
    }

    /// Its LAN port silent, its API path fine (a control plane on a
    /// network of its own): its writes land, but its gateway does not
    /// answer, so it fences at its lifetime all the same, before its
    /// witnesses report it. Found by the fault soak: fenced only on the
    /// controller's word, it still held 19 addresses when its port came
    /// back, beside the new holders.
    #[test]
    fn writes_that_land_do_not_save_a_node_its_gateway_does_not_hear() {
        let t0 = Instant::now();
        let mut lan = lan(t0);
        let since = t0 + Duration::from_secs(5);
        lan.hearing.none_since = Some(since);
        let written = since + Duration::from_millis(300);
        let mut i = at(&lan, written, false, since + Duration::from_millis(350));
        assert!(gateway_check_due(&i));
        let asked = since + Duration::from_millis(350);
        i.gateway = Some(GatewayCheck {
            started: asked,
            answered: false,
        });
        assert!(!gateway_check_due(&i), "one ask per lifetime");
        i.now = since + Duration::from_millis(700);
        assert_eq!(
            verdict(&i),
            Verdict::Hold {
                again: Some(since + WAIT)
            }
        );
        i.now = since + WAIT;
        let v = verdict(&i);
        assert!(fenced(&v), "{v:?}");
        assert!(
            format!("{v:?}").contains("gateway does not answer"),
            "{v:?}"
        );
        // Asked again a lifetime later: it answers, the fence lifts (its
        // peers are gone, not its port).
        i.now = asked + WAIT;
        assert!(gateway_check_due(&i));
        i.gateway = Some(GatewayCheck {
            started: asked + WAIT,
            answered: true,
        });
        assert_eq!(
            verdict(&i),
            Verdict::Hold {
                again: Some(asked + WAIT + WAIT)
            }
        );
    }

    /// Its peers all died, its gateway answers: it serves on, however
    /// long; an ask made before the silence began says nothing of it.
    #[test]
    fn a_node_whose_peers_died_serves_on_while_its_gateway_answers() {
        let t0 = Instant::now();
        let mut lan = lan(t0);
        let since = t0 + Duration::from_secs(5);
        lan.hearing.none_since = Some(since);
        let written = since + Duration::from_millis(300);
        let mut i = at(&lan, written, false, since + Duration::from_secs(60));
        i.gateway = Some(GatewayCheck {
            started: since - Duration::from_millis(1),
            answered: false,
        });
        assert!(!fenced(&verdict(&i)), "an ask from before the silence");
        assert!(gateway_check_due(&i));
        i.gateway = Some(GatewayCheck {
            started: since + Duration::from_secs(59),
            answered: true,
        });
        assert!(!fenced(&verdict(&i)));
        // No write since: the gateway cannot vouch for it (the
        // controller, which it cannot hear, may move its Services).
        let mut unwritten = i;
        unwritten.last_ok = t0;
        assert!(fenced(&verdict(&unwritten)));
        // The LAN heard: nothing to ask.
        let heard = LanView {
            hearing: Hearing {
                convicting: 2,
                ..Hearing::default()
            },
            ..lan.clone()
        };
        assert!(!gateway_check_due(&Inputs { lan: &heard, ..i }));
    }

    #[test]
    fn too_few_witnesses_heard_and_no_write_since_fence() {
        let t0 = Instant::now();
        let mut lan = lan(t0);
        let since = t0 + Duration::from_secs(5);
        lan.hearing.short_since = Some(since);
        lan.hearing.silent = vec!["b".into(), "c".into()];
        let v = verdict(&at(&lan, t0, true, since + Duration::from_millis(1200)));
        assert!(fenced(&v), "{v:?}");
        assert!(format!("{v:?}").contains("(b, c)"), "{v:?}");
        // The side of a split that still reaches the API server serves.
        let written = since + Duration::from_millis(400);
        assert_eq!(
            verdict(&at(&lan, written, false, since + Duration::from_secs(60))),
            Verdict::Hold { again: None }
        );
    }

    #[test]
    fn the_earliest_silence_decides_when_to_look_again() {
        let t0 = Instant::now();
        let mut lan = lan(t0);
        lan.hearing.none_since = Some(t0 + Duration::from_millis(700));
        lan.hearing.short_since = Some(t0 + Duration::from_millis(500));
        assert_eq!(
            verdict(&at(&lan, t0, false, t0 + Duration::from_millis(800))),
            Verdict::Hold {
                again: Some(t0 + Duration::from_millis(1500))
            }
        );
    }

    #[test]
    fn without_a_lan_view_the_api_fence_applies() {
        let t0 = Instant::now();
        for lan in [
            LanView::default(),
            LanView {
                heard_any: None,
                ..lan(t0)
            },
            LanView {
                has_peers: false,
                ..lan(t0)
            },
        ] {
            assert_eq!(
                verdict(&at(&lan, t0, true, t0 + Duration::from_secs(10))),
                Verdict::Hold {
                    again: Some(t0 + FENCE_AFTER)
                }
            );
            let v = verdict(&at(&lan, t0, true, t0 + FENCE_AFTER));
            assert!(fenced(&v), "{v:?}");
            // Writes that succeed, or a fence turned off: never.
            assert_eq!(
                verdict(&at(&lan, t0, false, t0 + Duration::from_secs(3600))),
                Verdict::Hold { again: None }
            );
            let off = Inputs {
                fence_after: Duration::ZERO,
                ..at(&lan, t0, true, t0 + Duration::from_secs(3600))
            };
            assert_eq!(verdict(&off), Verdict::Hold { again: None });
        }
    }
}
