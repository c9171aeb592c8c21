//! No cascade (issue #22): the agents and controllers talk to the API
//! server through the rig's fault proxy, which fails a fifth of their
//! requests (500, 503 or 429) and holds another fifth back for up to 2 s,
//! for five minutes. Nothing is wrong with any node, so no Service may move
//! off its node and the controller leader may not change. Who holds an
//! address is read from the guests' kernels ([`AddressWatch`]), the Lease
//! with the test's own client, which does not go through the proxy.
//!
//! The second test (issue #29) puts the API server in brownouts instead:
//! every request 1-3 s slow for 5-20 s at a time and a fifth shed with 429
//! and `Retry-After`; still nothing moves. The proxy counts status writes
//! that come sooner than a 429 asked (per client's credentials); the test
//! prints that count.
//!
//! A failure prints the seed; `HNA_FAULT_SEED=<seed>` replays its draws.
//! `HNA_FAULT_WINDOW=<seconds>` shortens the window while working on a
//! cause (the defaults, and what the suite runs, are 300 and 120).

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use hna_testkit::addrwatch::AddressWatch;
use hna_testkit::failover::{guest_namespaces, served, timeline};
use hna_testkit::lb::{self, CONTROLLER_LEASE, LbRig, NAMESPACE, wait_for};
use hna_testkit::rig::faultproxy::{Brownout, FaultConfig, FaultCounts};
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;

use crate::harness::tests;

tests! {
    #[alone]
    a_flaky_api_server_moves_nothing_and_keeps_the_leader: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    #[alone]
    a_brownout_moves_nothing_and_the_agents_wait_as_asked: Root, Iproute2, Dnsmasq, ApiServer, Socat;
}

const SERVICES: usize = 6;
const FAULTS: FaultConfig = FaultConfig {
    errors: 0.2,
    delays: 0.2,
    max_delay: Duration::from_secs(2),
    brownout: None,
};

/// Issue #29: brownouts instead, every request 1-3 s slow for 5-20 s and a
/// fifth of them shed with 429 and `Retry-After: 1`, 10-30 s apart.
const BROWNOUTS: FaultConfig = FaultConfig {
    errors: 0.0,
    delays: 0.0,
    max_delay: Duration::ZERO,
    brownout: Some(Brownout::SEVERE),
};

fn window(default: Duration) -> Result<Duration> {
    match std::env::var("HNA_FAULT_WINDOW") {
        Ok(s) => Ok(Duration::from_secs(
            s.parse().with_context(|| format!("HNA_FAULT_WINDOW={s}"))?,
        )),
        Err(_) => Ok(default),
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
    let counts = no_cascade(FAULTS, window(Duration::from_secs(300))?, true)?;
    // A test that injected nothing proves nothing.
    for (n, what) in [
        (counts.internal_errors, "500"),
        (counts.unavailable, "503"),
        (counts.too_many_requests, "429"),
        (counts.delayed, "delay"),
    ] {
        ensure!(n > 0, "the proxy injected no {what}: {counts}");
    }
    Ok(())
}

/// Issue #29: an API server in brownouts (every request slow for seconds,
/// a share shed with 429 and `Retry-After`), not faults drawn per request,
/// which hedging beats. Nothing may move off a healthy node. The controller
/// Lease may change hands: requests slower than its renewal deadline are
/// what a leader steps down for, as client-go's does.
fn a_brownout_moves_nothing_and_the_agents_wait_as_asked() -> Result<()> {
    let counts = no_cascade(BROWNOUTS, window(Duration::from_secs(120))?, false)?;
    ensure!(
        counts.brownouts >= 2 && counts.too_many_requests > 0 && counts.delayed > 0,
        "the proxy made fewer than two brownouts: {counts}"
    );
    // kube's own retry layer is off (`cluster::credentials::client_config`):
    // every 429 reaches the writer, which holds back as asked.
    ensure!(
        counts.early_retries == 0,
        "{} status writes came sooner than a 429's Retry-After: {counts}",
        counts.early_retries
    );
    Ok(())
}

/// The LB rig behind the fault proxy, `faults` on for `window`: no Service
/// may move off its node (and, with `keep_leader`, the controller leader
/// may not change). Returns what the proxy did meanwhile.
fn no_cascade(faults: FaultConfig, window: Duration, keep_leader: bool) -> Result<FaultCounts> {
    // The product's default timings: the LAN membership on, a heartbeat
    // every 10 s, a node no witness hears stale after 40 s, the
    // controller's Lease 3 s.
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
    println!(
        "faults on for {window:?}: {faults:?}; seed {seed}; leader {leader}, {transitions} transitions"
    );
    let t0 = Instant::now();
    proxy.set_faults(Some(faults));
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
            Ok((holder, n))
                if keep_leader && (holder.as_deref() != Some(&leader) || n != transitions) =>
            {
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
    if !keep_leader {
        println!("the controller Lease after the faults: {:?}", lease(&lb)?);
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
    Ok(counts)
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
        brownouts: now.brownouts - before.brownouts,
        early_retries: now.early_retries - before.early_retries,
    }
}
