//! The short soak CI runs (issue #20): the randomized fault schedule of
//! `hna_testkit::soak` with a fixed seed for 3 minutes, failing on any
//! violation the independent checker finds. `HNA_SOAK_SEED` replays
//! another seed; `sudo cargo bench --bench soak` runs the long one.

use std::time::Duration;

use anyhow::{Result, ensure};
use hna_testkit::soak::{self, SoakOptions};

use crate::harness::tests;

tests! {
    #[alone]
    a_short_seeded_soak_finds_no_violation: Root, Iproute2, Dnsmasq, ApiServer, Socat, Ebtables;
}

/// The seed CI runs (any other: `HNA_SOAK_SEED`).
const SEED: u64 = 20_261_125;

fn a_short_seeded_soak_finds_no_violation() -> Result<()> {
    let seed = match std::env::var("HNA_SOAK_SEED") {
        Ok(s) => s.parse()?,
        Err(_) => SEED,
    };
    let opts = SoakOptions::new(seed, Duration::from_secs(180));
    let manifests = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/kubernetes");
    let report = soak::run(crate::BIN, manifests, &opts)?;
    soak::print(&report);
    // The violations ride in the failure itself: CI shows a failing
    // test's message, not its whole output.
    let listed: Vec<String> = report
        .violations
        .iter()
        .take(20)
        .map(|v| format!("- {}", v.what))
        .collect();
    ensure!(
        report.violations.is_empty(),
        "{}; the first {}:\n{}",
        report.summary(),
        listed.len(),
        listed.join("\n")
    );
    Ok(())
}
