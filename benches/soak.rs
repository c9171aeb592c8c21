//! The long randomized fault soak (issue #20): seeded, reproducible, an
//! independent checker; see `hna_testkit::soak` for the schedule, the
//! checker and the bound of each fault. Prints its seed first and, as its
//! last line, `soak: seed S, F faults, V violations`; exits non-zero when
//! V > 0 (130 when interrupted: SIGINT or SIGTERM end the faults and tear
//! the rig down first).
//!
//! ```text
//! sudo cargo bench --bench soak -- [--minutes 30] [--seed S] [--services 20]
//! ```

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use hna_testkit::soak::{self, SoakOptions};

const BIN: &str = env!("CARGO_BIN_EXE_harvester-node-agent");

fn main() -> Result<()> {
    let mut minutes = 30f64;
    let mut seed: Option<u64> = None;
    let mut services = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        // cargo bench passes --bench; nothing else is expected.
        match a.as_str() {
            "--minutes" => minutes = args.next().context("--minutes M")?.parse()?,
            "--seed" => seed = Some(args.next().context("--seed S")?.parse()?),
            "--services" => services = Some(args.next().context("--services N")?.parse()?),
            _ => {}
        }
    }
    let seed = seed.unwrap_or_else(|| fastrand::u64(..));
    let mut opts = SoakOptions::new(seed, Duration::from_secs_f64(minutes * 60.0));
    if let Some(n) = services {
        opts.services = n;
    }
    let manifests = Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/kubernetes");
    // Ctrl-C ends the faults and tears the rig down before exiting.
    soak::stop_on_signals()?;
    let report = soak::run(BIN, manifests, &opts)?;
    soak::print(&report);
    if !report.violations.is_empty() {
        std::process::exit(1);
    }
    if report.interrupted {
        std::process::exit(130);
    }
    Ok(())
}
