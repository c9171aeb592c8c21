//! One controller pass, without the API server (issue #30: "a pass is
//! O(S log S) or better"): the pure decision `hna_controller::reconcile` over a
//! simulated cluster (`hna_controller::reconcile::sim`) of S DHCP Services on
//! S / 20 nodes, every Service served. Measures a pass at rest (nothing to
//! write) and the pass that moves the Services of one node that died, for
//! growing S; a quadratic pass takes four times as long at twice the
//! Services, an O(S log S) one a little over twice.
//!
//! ```text
//! cargo bench --bench reconcile [-- --services 1000,2000,5000,10000 --runs 5]
//! ```

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use hna_controller::reconcile::sim::{Sim, dhcp};

fn main() -> Result<()> {
    let mut sizes = vec![1_000usize, 2_000, 5_000, 10_000];
    let mut runs = 5usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--services" => {
                sizes = args
                    .next()
                    .context("--services N[,N...]")?
                    .split(',')
                    .map(|n| n.trim().parse())
                    .collect::<Result<_, _>>()?;
            }
            "--runs" => runs = args.next().context("--runs N")?.parse()?,
            // cargo bench passes --bench; nothing else is expected.
            _ => {}
        }
    }
    ensure!(runs >= 1, "--runs must be at least 1");
    println!(
        "{:>8} {:>6} {:>14} {:>14} {:>14} {:>10}",
        "Services", "nodes", "pass at rest", "per Service", "failover pass", "moved"
    );
    let mut previous: Option<(usize, Duration)> = None;
    for &services in &sizes {
        let nodes = (services / 20).max(3);
        let names: Vec<String> = (0..nodes).map(|i| format!("node-{i:03}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let mut sim = Sim::new(&refs);
        for i in 0..services {
            sim.services.push(dhcp(&format!("svc-{i:05}"), &[80]));
        }
        sim.settle();
        let served = sim
            .services
            .iter()
            .filter(|s| !s.ingress.is_empty())
            .count();
        ensure!(served == services, "{served} of {services} served");
        let at_rest = median(runs, || {
            let t = Instant::now();
            let plan = std::hint::black_box(sim.plan());
            (t.elapsed(), plan.writes.len())
        })?;
        ensure!(at_rest.1 == 0, "{} writes at rest", at_rest.1);
        // One node dies: its Services move (the Sim's agents stop
        // reporting for it).
        let mut failed = sim.clone();
        failed.up.remove(&names[0]);
        failed.agents();
        let failover = median(runs, || {
            let t = Instant::now();
            let plan = std::hint::black_box(failed.plan());
            let moved = plan
                .events
                .iter()
                .filter(|e| e.reason == "HolderMoved")
                .count();
            (t.elapsed(), moved)
        })?;
        println!(
            "{services:>8} {nodes:>6} {:>11.2} ms {:>11.2} µs {:>11.2} ms {:>10}",
            ms(at_rest.0),
            at_rest.0.as_secs_f64() * 1e6 / services as f64,
            ms(failover.0),
            failover.1
        );
        if let Some((s0, d0)) = previous {
            let growth = at_rest.0.as_secs_f64() / d0.as_secs_f64();
            let ratio = services as f64 / s0 as f64;
            println!(
                "{:>8} x{ratio:.1} Services: the pass at rest took x{growth:.2} (linear x{ratio:.1}, quadratic x{:.1})",
                "",
                ratio * ratio
            );
        }
        previous = Some((services, at_rest.0));
    }
    Ok(())
}

/// The median time of `runs` runs, with the last run's count.
fn median(runs: usize, mut f: impl FnMut() -> (Duration, usize)) -> Result<(Duration, usize)> {
    let mut times = Vec::with_capacity(runs);
    let mut count = 0;
    for _ in 0..runs {
        let (t, n) = f();
        times.push(t);
        count = n;
    }
    times.sort();
    Ok((times[times.len() / 2], count))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
