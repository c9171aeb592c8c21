//! Failover distributions (issue #11) on the rig with the product's default
//! timings: for each fault done to a Service's holder, the time until
//! another guest holds the address, as the guests' kernels report it
//! (`ip monitor address`), over N runs (default 10), each on a fresh rig,
//! the fault spread over a second (the witnesses' probes come every
//! 100 ms, the status's changes within a second);
//! beside it, the longest time a client on the LAN asking who has the
//! address every 10 ms got no answer. Also counts the moments two guests
//! held the address or answered one request (must be 0).
//!
//! Last, the row issue #30 names: one guest of three holding 200 Services,
//! its VM deleted; the time until every one of the 200 addresses is held
//! by another guest (`--mass N` Services, `--mass-runs R`, default 3 runs;
//! `--mass 0` leaves it out).
//!
//! ```text
//! sudo cargo bench --bench failover [-- --runs 10] [--only LABEL-PREFIX] [--mass 200 --mass-runs 3]
//! ```

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use hna_testkit::addrwatch::AddressWatch;
use hna_testkit::failover::{
    Fault, all_on_one, delete_until_all_moved, fail_over_after, guest_namespaces, timeline,
};
use hna_testkit::lb::{self, LbRig};

const BIN: &str = env!("CARGO_BIN_EXE_harvester-node-agent");

fn main() -> Result<()> {
    let mut runs = 10usize;
    let mut only: Option<String> = None;
    let (mut mass, mut mass_runs) = (200usize, 3usize);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        // cargo bench passes --bench; nothing else is expected.
        match a.as_str() {
            "--runs" => runs = args.next().context("--runs N")?.parse()?,
            "--only" => only = Some(args.next().context("--only LABEL-PREFIX")?),
            "--mass" => mass = args.next().context("--mass N")?.parse()?,
            "--mass-runs" => mass_runs = args.next().context("--mass-runs R")?.parse()?,
            _ => {}
        }
    }
    ensure!(runs >= 1, "--runs must be at least 1");
    let manifests = Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/kubernetes");
    let mut rows = Vec::new();
    for fault in Fault::ALL
        .into_iter()
        .filter(|f| only.as_deref().is_none_or(|p| f.label().starts_with(p)))
    {
        let mut took = Vec::new();
        let mut silence = Vec::new();
        let mut overlaps = 0;
        for run in 0..runs {
            let mut lb = LbRig::start(lb::Options::new(BIN, &manifests))?;
            // Spread over a second: run k of n faults k/n of the way through
            // it from wherever the phase starts.
            let delay = Duration::from_millis((1000 * run / runs) as u64);
            let f = fail_over_after(
                &mut lb,
                &format!("bench-{run}"),
                fault,
                Duration::from_secs(20),
                delay,
            )
            .with_context(|| format!("{} run {run}", fault.label()))?;
            eprintln!("{}: run {run}: {:.0} ms", fault.label(), ms(f.took));
            overlaps += f.overlaps();
            took.push(f.took);
            silence.push(f.arp.longest_silence());
        }
        took.sort();
        silence.sort();
        rows.push((fault.label(), took, silence, overlaps));
    }
    println!("\nfailover, fault → another guest holds the address; milliseconds, {runs} runs each");
    println!(
        "{:<36} {:>8} {:>8} {:>8}   {:>22} {:>10}",
        "", "min", "median", "max", "ARP silence min/med/max", "2 holders"
    );
    for (label, took, silence, overlaps) in rows {
        let mid = took.len() / 2;
        println!(
            "{label:<36} {:>8.0} {:>8.0} {:>8.0}   {:>6.0} {:>7.0} {:>7.0} {overlaps:>10}",
            ms(took[0]),
            ms(took[mid]),
            ms(took[took.len() - 1]),
            ms(silence[0]),
            ms(silence[mid]),
            ms(silence[silence.len() - 1]),
        );
    }
    if mass > 0 && mass_runs > 0 {
        let mut took = Vec::new();
        let mut overlaps = 0;
        for run in 0..mass_runs {
            let mut lb = LbRig::start(lb::Options {
                wide_lan: true,
                ..lb::Options::new(BIN, &manifests)
            })?;
            let holder = 2;
            let ips = all_on_one(&mut lb, holder, &format!("mass{run}"), mass)?;
            let watch = AddressWatch::start(&guest_namespaces(&lb))?;
            std::thread::sleep(Duration::from_secs(1));
            let t0 = std::time::Instant::now();
            let t = delete_until_all_moved(&mut lb, holder, &ips, &watch, Duration::from_secs(60))?;
            // Long enough for a second move to show.
            std::thread::sleep(Duration::from_secs(3));
            let doubled: Vec<&std::net::Ipv4Addr> = ips
                .iter()
                .filter(|ip| !watch.overlaps(**ip).is_empty())
                .collect();
            for ip in doubled.iter().take(3) {
                eprintln!("{ip} held twice:\n{}", timeline(&watch, **ip, t0));
            }
            overlaps += ips
                .iter()
                .map(|ip| watch.overlaps(*ip).len())
                .sum::<usize>();
            eprintln!(
                "{mass} Services, holder's VM deleted: run {run}: {:.0} ms",
                ms(t)
            );
            took.push(t);
        }
        took.sort();
        println!(
            "\n{mass} Services on one holder of 3, its VM deleted → all {mass} held by another guest; milliseconds, {mass_runs} runs"
        );
        println!(
            "{:<36} {:>8.0} {:>8.0} {:>8.0}   {:>22} {overlaps:>10}",
            format!("{mass} Services, VM deleted"),
            ms(took[0]),
            ms(took[took.len() / 2]),
            ms(took[took.len() - 1]),
            "-"
        );
    }
    Ok(())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
