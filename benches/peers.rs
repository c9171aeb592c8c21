//! Ours beside the peers (issue #19), in one run on one rig: the same
//! DHCP Services and the same faults, each on a fresh rig, for our agents
//! and controller, for kube-vip with its default lease timings, for
//! kube-vip with the tuned ones its users are pointed at, for kube-vip
//! with Services that have no endpoints but its
//! `allow-reconcile-without-endpoints` annotation, and for MetalLB in
//! layer-2 mode (from a static pool: it has no DHCP). Both are built from
//! the Go module proxy by `tests/rig/peers.sh`. Ours with
//! `lb_arp_probe = false` (neither peer probes a new address before using
//! it) and kube-vip without a ready endpoint are measured in the first row
//! only: what sets them apart acts before any fault.
//!
//! Rows: Service created → address in its status, and → the first TCP
//! answer from a LAN client; for each fault done to the holder, the time
//! until another guest's kernel holds the Service's address, the LAN
//! client's longest stretch without an ARP answer, the time until a TCP
//! client (a connection every 100 ms) is answered by another node at the
//! original address, whether the address changed, and ARP requests that
//! two answered or moments two kernels held it. min/median/max over N runs.
//!
//! Then, per system on a fresh rig with a wide LAN (kube-vip takes a DHCP
//! lease on every node for every Service: 303 for 100 Services on 3
//! nodes), the steady state with `--steady N` Services (100): the API
//! server's writes per second over `--window S` (60), and the VmRSS of
//! each node's process and of the central ones.
//!
//! ```text
//! sudo cargo bench --bench peers [-- --runs 10] [--only LABEL-PREFIX] [--systems LIST] [--steady 100] [--window 60]
//! ```
//!
//! `LIST` is some of `ours,ours-no-arp-probe,kube-vip,kube-vip-tuned,kube-vip-no-endpoints,metallb`
//! (all by default).

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use hna_testkit::peers::{HolderFault, LeaseTimings, System, SystemRig, fail_over};

const BIN: &str = env!("CARGO_BIN_EXE_harvester-node-agent");
const NAMES: &str =
    "ours, ours-no-arp-probe, kube-vip, kube-vip-tuned, kube-vip-no-endpoints, metallb";

fn main() -> Result<()> {
    let mut runs = 10usize;
    let mut only: Option<String> = None;
    let mut steady = 100usize;
    let mut window = Duration::from_secs(60);
    let mut systems = vec![
        System::Ours,
        System::OursWithoutArpProbe,
        System::KubeVip(LeaseTimings::DEFAULT),
        System::KubeVip(LeaseTimings::TUNED),
        System::KubeVipWithoutEndpoints,
        System::MetalLb,
    ];
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--runs" => runs = args.next().context("--runs N")?.parse()?,
            "--only" => only = Some(args.next().context("--only LABEL-PREFIX")?),
            "--steady" => steady = args.next().context("--steady N")?.parse()?,
            "--window" => {
                window = Duration::from_secs(args.next().context("--window SECONDS")?.parse()?)
            }
            "--systems" => {
                let list = args.next().with_context(|| format!("--systems {NAMES}"))?;
                systems = list
                    .split(',')
                    .map(|s| match s {
                        "ours" => Ok(System::Ours),
                        "ours-no-arp-probe" => Ok(System::OursWithoutArpProbe),
                        "kube-vip" => Ok(System::KubeVip(LeaseTimings::DEFAULT)),
                        "kube-vip-tuned" => Ok(System::KubeVip(LeaseTimings::TUNED)),
                        "kube-vip-no-endpoints" => Ok(System::KubeVipWithoutEndpoints),
                        "metallb" => Ok(System::MetalLb),
                        other => anyhow::bail!("--systems: unknown system {other:?} ({NAMES})"),
                    })
                    .collect::<Result<_>>()?;
            }
            _ => {}
        }
    }
    ensure!(
        runs >= 1 || steady >= 1,
        "nothing to measure: --runs 0 and --steady 0"
    );
    let manifests = Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/kubernetes");
    // kube-vip's slowest move in the rig took 21 s (its default 15 s
    // Lease, after a SIGTERM it ignored for 20 s); where it never moves
    // (uplink faults) waiting longer only costs time.
    let within = Duration::from_secs(30);
    let mut table: Vec<(String, String, Stats)> = Vec::new();
    let faults: Vec<HolderFault> = HolderFault::ALL
        .into_iter()
        .filter(|f| only.as_deref().is_none_or(|p| f.label().starts_with(p)))
        .collect();
    for (row, fault) in faults.iter().copied().enumerate().filter(|_| runs > 0) {
        for system in &systems {
            if system.first_row_only() && row > 0 {
                continue;
            }
            let mut st = Stats::default();
            for run in 0..runs {
                let mut sr = SystemRig::start(*system, BIN, manifests.clone())
                    .with_context(|| format!("{}: starting the rig", system.label()))?;
                let (served, f) = fail_over(&mut sr, &format!("peer-{run}"), fault, within)
                    .with_context(|| format!("{}: {} run {run}", system.label(), fault.label()))?;
                eprintln!(
                    "{} | {} | run {run}: status {:.0} ms, TCP {:.0} ms, moved {:?}, ARP silence {:.0} ms, TCP back {:?}, address {} -> {:?}, two answerers {}",
                    system.label(),
                    fault.label(),
                    ms(served.to_status),
                    ms(served.to_tcp),
                    f.took.map(ms),
                    ms(f.arp_silence),
                    f.tcp_back.map(ms),
                    served.ip,
                    f.ip_after,
                    f.two_answerers
                );
                st.to_status.push(served.to_status);
                st.to_tcp.push(served.to_tcp);
                st.took.push(f.took);
                st.silence.push(f.arp_silence);
                st.tcp_back.push(f.tcp_back);
                st.changed += usize::from(f.ip_after != Some(served.ip));
                st.two += f.two_answerers;
            }
            table.push((fault.label().to_string(), system.label(), st));
        }
    }
    if runs > 0 {
        print_failovers(&table, runs, within);
    }
    if steady > 0 {
        let mut rows = Vec::new();
        for system in systems.iter().filter(|s| !s.first_row_only()) {
            let mut sr = SystemRig::start_wide(*system, BIN, manifests.clone())
                .with_context(|| format!("{}: starting the rig", system.label()))?;
            let st = sr
                .steady(steady, window)
                .with_context(|| format!("{}: {steady} Services at rest", system.label()))?;
            eprintln!("{}: {st:?}", system.label());
            rows.push((system.label(), st));
        }
        println!(
            "\nat rest with {steady} Services (and the warm-up one), over {window:?}: API writes per second (all writers, the API server's own included), VmRSS in MiB"
        );
        println!(
            "{:<44} {:>14} {:>26} {:>26}",
            "system", "API writes/s", "per node", "central"
        );
        for (system, st) in &rows {
            println!(
                "{system:<44} {:>14.1} {:>26} {:>26}",
                st.writes_per_s,
                mib(&st.node_rss_kib),
                mib(&st.central_rss_kib)
            );
        }
    }
    Ok(())
}

/// The failover table: one line per fault and system.
fn print_failovers(table: &[(String, String, Stats)], runs: usize, within: Duration) {
    println!(
        "\nours beside the peers: milliseconds, min / median / max of {runs} runs; \"-\" = not within {within:?}"
    );
    println!(
        "{:<34} {:<44} {:>20} {:>20} {:>20} {:>20} {:>20} {:>8} {:>5}",
        "fault",
        "system",
        "Service -> status",
        "Service -> TCP",
        "fault -> held again",
        "ARP silence",
        "fault -> TCP back",
        "changed",
        "2 ans"
    );
    for (fault, system, st) in table {
        println!(
            "{fault:<34} {system:<44} {:>20} {:>20} {:>20} {:>20} {:>20} {:>8} {:>5}",
            spread(st.to_status.iter().map(|d| Some(*d))),
            spread(st.to_tcp.iter().map(|d| Some(*d))),
            spread(st.took.iter().copied()),
            spread(st.silence.iter().map(|d| Some(*d))),
            spread(st.tcp_back.iter().copied()),
            format!("{}/{}", st.changed, st.took.len()),
            st.two
        );
    }
}

/// KiB figures as `a / b / c` MiB, `-` for none.
fn mib(kib: &[u64]) -> String {
    if kib.is_empty() {
        return "-".into();
    }
    kib.iter()
        .map(|k| format!("{:.1}", *k as f64 / 1024.0))
        .collect::<Vec<_>>()
        .join(" / ")
}

#[derive(Default)]
struct Stats {
    to_status: Vec<Duration>,
    to_tcp: Vec<Duration>,
    took: Vec<Option<Duration>>,
    silence: Vec<Duration>,
    tcp_back: Vec<Option<Duration>>,
    changed: usize,
    two: usize,
}

/// `min / median / max` in milliseconds; a run that never got there counts
/// as longer than any other (`-`).
fn spread(values: impl Iterator<Item = Option<Duration>>) -> String {
    let mut v: Vec<Option<Duration>> = values.collect();
    v.sort_by_key(|d| d.unwrap_or(Duration::MAX));
    let show = |d: &Option<Duration>| d.map(|d| format!("{:.0}", ms(d))).unwrap_or("-".into());
    match v.len() {
        0 => "-".into(),
        n => format!(
            "{} / {} / {}",
            show(&v[0]),
            show(&v[n / 2]),
            show(&v[n - 1])
        ),
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
