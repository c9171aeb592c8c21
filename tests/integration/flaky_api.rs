//! No cascade (issue #22): the agents and controllers talk to the API
//! server through the rig's fault proxy, which fails a fifth of their
//! requests (500, 503 or 429) and holds another fifth back for up to 2 s,
//! for five minutes. Nothing is wrong with any node, so no Service may move
//! off its node and the controller leader may not change. Who holds an
//! address is read from the guests' kernels ([`AddressWatch`]), the Lease
//! with the test's own client, which does not go through the proxy.
//!
//! A failure prints the seed; `HNA_FAULT_SEED=<seed>` replays its draws.
//! `HNA_FAULT_WINDOW=<seconds>` shortens the window while working on a
//! cause (the default, and what the suite runs, is 300).

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use hna_testkit::addrwatch::AddressWatch;
use hna_testkit::failover::{guest_namespaces, served, timeline};
use hna_testkit::lb::{self, CONTROLLER_LEASE, LbRig, NAMESPACE, wait_for};
use hna_testkit::rig::faultproxy::{FaultConfig, FaultCounts};
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;

use crate::harness::tests;

tests! {
    #[alone]
    a_flaky_api_server_moves_nothing_and_keeps_the_leader: Root, Iproute2, Dnsmasq, ApiServer, Socat;
}

const SERVICES: usize = 6;
const FAULTS: FaultConfig = FaultConfig {
    errors: 0.2,
    delays: 0.2,
    max_delay: Duration::from_secs(2),
};

fn window() -> Result<Duration> {
    match std::env::var("HNA_FAULT_WINDOW") {
        Ok(s) => Ok(Duration::from_secs(
            s.parse().with_context(|| format!("HNA_FAULT_WINDOW={s}"))?,
        )),
        Err(_) => Ok(Duration::from_secs(300)),
    }
}

/// The controller Lease's holder and transition count, as the API server
/// has them (read directly, not through the proxy).
fn lease(lb: &LbRig) -> Result<(Option<String>, i32)> {
    let leases: Api<Lease> = Api::namespaced(lb.admin(), NAMESPACE);
    let l = lb
        .block_on(leases.get(CONTROLLER_LEASE))
        .context("reading the controller Lease")?;
    let spec = l.spec.unwrap_or_default();
    Ok((
        spec.holder_identity.filter(|h| !h.is_empty()),
        spec.lease_transitions.unwrap_or(0),
    ))
}

/// The first address that changed hands or had a gap since the watch
/// started, with its story.
fn moved(watch: &AddressWatch, served_by: &[(Ipv4Addr, usize)], t0: Instant) -> Option<String> {
    served_by.iter().find_map(|(ip, holder)| {
        let holders = watch.holders(*ip);
        (holders.len() != 1 || holders[0].1 != [*holder].into()).then(|| {
            format!(
                "{ip} (held by guest {holder}) changed hands or had a gap:\n{}",
                timeline(watch, *ip, t0)
            )
        })
    })
}

fn a_flaky_api_server_moves_nothing_and_keeps_the_leader() -> Result<()> {
    // The product's default timings: heartbeat 1 s, a node stale after
    // 3 s, the controller's Lease 3 s.
    let lb = LbRig::start(lb::Options {
        fault_proxy: true,
        ..lb::Options::new(
            crate::BIN,
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/kubernetes"),
        )
    })?;
    let proxy = lb.fault_proxy().context("the rig's fault proxy")?;
    let seed = proxy.seed();
    let mut served_by = Vec::new();
    for i in 0..SERVICES {
        served_by.push(served(&lb, &format!("s{i}"))?);
    }
    let spread: std::collections::BTreeSet<usize> = served_by.iter().map(|(_, g)| *g).collect();
    println!(
        "{SERVICES} Services served: {served_by:?} ({} guests hold some)",
        spread.len()
    );
    let leader = wait_for(Duration::from_secs(30), || lease(&lb).ok()?.0);
    let Some(leader) = leader else {
        bail!("no controller leads:\n{}", lb.diagnostics());
    };
    let (_, transitions) = lease(&lb)?;
    let watch = AddressWatch::start(&guest_namespaces(&lb))?;
    let before = proxy.counts();
    let window = window()?;
    println!(
        "faults on for {window:?}: {:.0} % errors, {:.0} % delayed up to {:?}; seed {seed}; leader {leader}, {transitions} transitions",
        FAULTS.errors * 100.0,
        FAULTS.delays * 100.0,
        FAULTS.max_delay
    );
    let t0 = Instant::now();
    proxy.set_faults(Some(FAULTS));
    // Every poll reads the kernel's record and the Lease; the first thing
    // wrong ends the window early.
    let mut lease_errors = 0;
    let mut lease_reads = 0;
    let mut check = || -> Option<String> {
        if let Some(m) = moved(&watch, &served_by, t0) {
            return Some(m);
        }
        lease_reads += 1;
        match lease(&lb) {
            Ok((holder, n)) if holder.as_deref() != Some(&leader) || n != transitions => {
                Some(format!(
                    "the controller Lease changed: holder {holder:?} (was {leader}), {n} transitions (was {transitions})"
                ))
            }
            Ok(_) => None,
            Err(_) => {
                lease_errors += 1;
                None
            }
        }
    };
    let wrong = wait_for(window, &mut check);
    let faulty = Instant::now() - t0;
    proxy.set_faults(None);
    // A node judged stale at the very end moves its Services a moment
    // later: twice the staleness bound without faults, nothing moves.
    let wrong = wrong.or_else(|| wait_for(Duration::from_secs(6), &mut check));
    let counts = delta(proxy.counts(), before);
    println!(
        "faults for {:.0} s (seed {seed}): {counts}; {lease_reads} Lease reads ({lease_errors} failed)",
        faulty.as_secs_f64()
    );
    if let Some(what) = wrong {
        bail!(
            "after {:.1} s of faults (seed {seed}; {counts}): {what}\n{}",
            faulty.as_secs_f64(),
            lb.diagnostics()
        );
    }
    ensure!(
        lease_reads > 0 && lease_errors < lease_reads,
        "the Lease was never read"
    );
    // A test that injected nothing proves nothing.
    for (n, what) in [
        (counts.internal_errors, "500"),
        (counts.unavailable, "503"),
        (counts.too_many_requests, "429"),
        (counts.delayed, "delay"),
    ] {
        ensure!(n > 0, "the proxy injected no {what}: {counts}");
    }
    // The agents' and controllers' watches restart every 25 s: some went
    // through the proxy and streamed.
    ensure!(
        counts.watches > 0,
        "no watch went through the proxy: {counts}"
    );
    ensure!(
        counts.upstream_failures == 0,
        "the proxy failed to forward requests it did not mean to fail: {counts}"
    );
    Ok(())
}

fn delta(now: FaultCounts, before: FaultCounts) -> FaultCounts {
    FaultCounts {
        requests: now.requests - before.requests,
        internal_errors: now.internal_errors - before.internal_errors,
        unavailable: now.unavailable - before.unavailable,
        too_many_requests: now.too_many_requests - before.too_many_requests,
        delayed: now.delayed - before.delayed,
        longest_delay_ms: now.longest_delay_ms,
        watches: now.watches - before.watches,
        upstream_failures: now.upstream_failures - before.upstream_failures,
    }
}
