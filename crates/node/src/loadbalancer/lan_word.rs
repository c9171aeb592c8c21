//! Whether a node that lapsed while it could not read the API server may
//! hold its last assignments again on its witnesses' word (issue #49).
//!
//! A lapse is any moment the node's addresses may have been judged from:
//! a fence after a LAN silence, a pause or stall longer than its address
//! lifetime, an uplink that lost its carrier. Before, every lapse ended in
//! "nothing is taken over until the assignments are read again", and in
//! an API outage that read never came: a LAN blip of 1.5 s darkened every
//! address of the cluster for as long as the outage lasted.
//!
//! The controller moves a node's Services on the LAN's verdict only when
//! enough of its witnesses' accusations reached the API server (two, or
//! all when it has fewer; `controller::lan_verdict`). Each witness tells
//! the node it watches, with every probe, how many of its accusations of
//! it the API server acknowledged in its run, and whether its latest
//! acknowledged word still accuses it (`membership::swim::Attestation`).
//! So a node knows, on its LAN alone, that its assignments cannot have
//! moved on that verdict since its lapse began: too few of its witnesses'
//! words changed since, or were not heard after it.
//!
//! What this does not cover, and why it is safe: the controller also moves
//! a node's Services when the node itself wrote that it is not ready (the
//! rule below leaves the word alone once any of its own writes landed
//! since the lapse: then its API path works and the read decides), when a
//! Service is deleted or changed (nobody can while the API server is
//! down; a node cut off alone keeps serving a deleted Service's address
//! until it reads again, and no other node is given it meanwhile, since
//! its lease is still held), and on accusations written into a hung API
//! server that land when it wakes (counted by nobody: the new holder's
//! takeover guard hears this node answer and waits until it reads its
//! assignments and lets go).

use std::collections::BTreeMap;

use tokio::time::Instant;

use crate::membership::transport::Attestation;

/// What the decision reads.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Inputs<'a> {
    /// When the lapse began: the earliest moment this node may have been
    /// judged from.
    pub(crate) lapsed_since: Instant,
    /// When one of its own status writes last succeeded.
    pub(crate) last_write_ok: Instant,
    /// Its witnesses (sorted).
    pub(crate) witnesses: &'a [String],
    /// Their word on it, as last heard from each.
    pub(crate) attestations: &'a BTreeMap<String, Attestation>,
}

/// The decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Word {
    /// Its assignments cannot have moved on its witnesses' verdict: it
    /// holds them again. `by`: the witnesses whose word says so.
    Holds { by: Vec<String> },
    /// It waits for the API server; why.
    Unsure(String),
}

/// How many witnesses' reports move a node: two, or all it has when fewer
/// (as the controller counts them).
fn convicting(witnesses: usize) -> usize {
    witnesses.min(2)
}

/// Decides on the witnesses' word: it holds again when fewer of its
/// witnesses than convict it may have had an accusation acknowledged since
/// the lapse began. A witness vouches when its word was heard after the
/// lapse began, has not changed since before it, and does not accuse.
pub(crate) fn judge(i: &Inputs<'_>) -> Word {
    if i.last_write_ok > i.lapsed_since {
        return Word::Unsure(
            "a status write landed since the lapse: the controller decides, and its assignments are read from the API server".into(),
        );
    }
    if i.witnesses.is_empty() {
        return Word::Unsure("it has no witnesses on its LAN to vouch for it".into());
    }
    let mut by = Vec::new();
    let mut doubtful = Vec::new();
    for w in i.witnesses {
        match i.attestations.get(w) {
            Some(a) if a.word.accusing => doubtful.push(format!("{w} (accuses it)")),
            Some(a) if a.changed >= i.lapsed_since => {
                doubtful.push(format!("{w} (its word changed since)"))
            }
            Some(a) if a.heard > i.lapsed_since => by.push(w.clone()),
            Some(_) => doubtful.push(format!("{w} (not heard since)")),
            None => doubtful.push(format!("{w} (never heard)")),
        }
    }
    let needed = convicting(i.witnesses.len());
    if doubtful.len() < needed {
        Word::Holds { by }
    } else {
        Word::Unsure(format!(
            "{} of its {} witnesses may have had an accusation of it acknowledged since the lapse ({}); {needed} move it",
            doubtful.len(),
            i.witnesses.len(),
            doubtful.join(", ")
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    struct Case {
        name: &'static str,
        witnesses: &'static [&'static str],
        /// (witness, changed, heard, accusing), in seconds after t0; the
        /// lapse is at 10 s.
        words: &'static [(&'static str, u64, u64, bool)],
        write_ok_at: u64,
        holds: bool,
    }

    const CASES: &[Case] = &[
        Case {
            name: "API hung, a LAN blip: both witnesses unchanged and heard after",
            witnesses: &["a", "b"],
            words: &[("a", 1, 12, false), ("b", 2, 12, false)],
            write_ok_at: 5,
            holds: true,
        },
        Case {
            name: "both accusations acknowledged (the API server heard them)",
            witnesses: &["a", "b"],
            words: &[("a", 11, 12, true), ("b", 11, 12, true)],
            write_ok_at: 5,
            holds: false,
        },
        Case {
            name: "acknowledged and withdrawn: the controller may have acted between",
            witnesses: &["a", "b"],
            words: &[("a", 11, 12, false), ("b", 11, 12, false)],
            write_ok_at: 5,
            holds: false,
        },
        Case {
            name: "one of two acknowledged: two convict, so nothing moved",
            witnesses: &["a", "b"],
            words: &[("a", 11, 12, false), ("b", 2, 12, false)],
            write_ok_at: 5,
            holds: true,
        },
        Case {
            name: "one of three acknowledged, one not heard since: two doubtful",
            witnesses: &["a", "b", "c"],
            words: &[
                ("a", 11, 12, false),
                ("b", 2, 9, false),
                ("c", 2, 12, false),
            ],
            write_ok_at: 5,
            holds: false,
        },
        Case {
            name: "one of three silent (dead), two vouch",
            witnesses: &["a", "b", "c"],
            words: &[("b", 2, 12, false), ("c", 2, 12, false)],
            write_ok_at: 5,
            holds: true,
        },
        Case {
            name: "a lone witness (a 2-node LAN) that vouches",
            witnesses: &["a"],
            words: &[("a", 2, 12, false)],
            write_ok_at: 5,
            holds: true,
        },
        Case {
            name: "a lone witness whose word changed (a new run)",
            witnesses: &["a"],
            words: &[("a", 11, 12, false)],
            write_ok_at: 5,
            holds: false,
        },
        Case {
            name: "a standing acknowledged accusation from before the lapse",
            witnesses: &["a", "b"],
            words: &[("a", 2, 12, true), ("b", 2, 12, true)],
            write_ok_at: 5,
            holds: false,
        },
        Case {
            name: "its own write landed since: the API server decides",
            witnesses: &["a", "b"],
            words: &[("a", 1, 12, false), ("b", 2, 12, false)],
            write_ok_at: 11,
            holds: false,
        },
        Case {
            name: "no witnesses at all",
            witnesses: &[],
            words: &[],
            write_ok_at: 5,
            holds: false,
        },
        Case {
            name: "witnesses first heard after the lapse (this node just started)",
            witnesses: &["a", "b"],
            words: &[("a", 11, 12, false), ("b", 11, 12, false)],
            write_ok_at: 5,
            holds: false,
        },
    ];

    #[test]
    fn each_case() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        for c in CASES {
            let witnesses: Vec<String> = c.witnesses.iter().map(|s| s.to_string()).collect();
            let attestations = c
                .words
                .iter()
                .map(|(w, changed, heard, accusing)| {
                    (
                        w.to_string(),
                        Attestation {
                            word: crate::membership::transport::Word {
                                run: 1,
                                accusations: 0,
                                accusing: *accusing,
                            },
                            changed: at(*changed),
                            heard: at(*heard),
                        },
                    )
                })
                .collect();
            let word = judge(&Inputs {
                lapsed_since: at(10),
                last_write_ok: at(c.write_ok_at),
                witnesses: &witnesses,
                attestations: &attestations,
            });
            assert_eq!(
                matches!(word, Word::Holds { .. }),
                c.holds,
                "{}: {word:?}",
                c.name
            );
        }
    }
}
