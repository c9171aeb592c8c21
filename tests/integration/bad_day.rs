//! A bad day (issue #49): compound faults, as an operator's incident brings
//! them, on the LoadBalancer rig with the shipped manifests and the
//! product's default timings, the guests reaching the API server through
//! their uplink (the field's topology). Who answers for an address is read
//! from a LAN client's ARP requests, each from a MAC of its own
//! ([`failover::arp_prober`]), and from every guest's kernel
//! ([`AddressWatch`]), never from an agent's report.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use hna_testkit::addrwatch::AddressWatch;
use hna_testkit::arpprobe::ArpRecord;
use hna_testkit::failover::{
    self, PausedGuest, guest_namespaces, offset_ms, served, set_cable, set_port, timeline,
};
use hna_testkit::lb::{self, LbRig, wait_for};
use nix::sys::signal::Signal;

use crate::harness::tests;

tests! {
    lan_blips_in_a_hung_api_server_leave_every_address_answered_by_one_node: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    a_holder_cut_off_from_the_api_server_alone_never_goes_dark_nor_answers_twice: Root, Iproute2, Dnsmasq, ApiServer, Socat;
}

fn options() -> lb::Options {
    lb::Options::new(
        crate::BIN,
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/kubernetes"),
    )
}

/// What the issue asks: every address answered by exactly one node with
/// its Service's MAC within this long of the LAN being whole again.
const ANSWERED_WITHIN: Duration = Duration::from_secs(2);
/// How long after that each address is watched staying so.
const STAYS_FOR: Duration = Duration::from_secs(8);

/// The DHCP server's lease time in this test, and in seconds.
const LEASE_TIME: &str = "2m";
const LEASE_SECS: u64 = 120;

fn unix_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// One address of the test: its Service, its holder and its Service's MAC.
struct Served {
    ip: Ipv4Addr,
    holder: usize,
    mac: String,
}

/// A window in which every address must be answered by its holder alone.
struct Whole {
    label: String,
    from: Instant,
    to: Instant,
}

/// One fault of the bad day, and how long it lasts.
#[derive(Debug, Clone, Copy)]
enum Fault {
    /// Every guest's bridge port silenced at once (a switch reboot).
    LanBlip(Duration),
    /// The busiest holder's agent frozen (SIGSTOP, then SIGCONT).
    AgentFrozen(Duration),
    /// The busiest holder's agent killed (SIGKILL), started again 1 s later
    /// with the same state directory.
    AgentKilled,
    /// The busiest holder's uplink without carrier.
    CarrierLost(Duration),
    /// The busiest holder paused as a paused VM looks (its processes
    /// frozen, its LAN port silent).
    GuestPaused(Duration),
}

impl Fault {
    /// Carries the fault out on `lb`, `busiest` being the guest the
    /// one-guest faults hit; returns when it ended (the LAN whole again,
    /// the agent running again).
    fn play(self, lb: &mut LbRig, busiest: usize) -> Result<Instant> {
        // Each sleep below is the fault's length, not a wait for an outcome.
        match self {
            Fault::LanBlip(d) => {
                for i in 0..lb.guests() {
                    set_port(lb, i, false)?;
                }
                std::thread::sleep(d);
                for i in 0..lb.guests() {
                    set_port(lb, i, true)?;
                }
            }
            Fault::AgentFrozen(d) => {
                lb.signal_agent(busiest, Signal::SIGSTOP);
                std::thread::sleep(d);
                lb.signal_agent(busiest, Signal::SIGCONT);
            }
            Fault::AgentKilled => {
                lb.signal_agent(busiest, Signal::SIGKILL);
                std::thread::sleep(Duration::from_secs(1));
                lb.start_agent(busiest)?;
            }
            Fault::CarrierLost(d) => {
                set_cable(lb, busiest, false)?;
                std::thread::sleep(d);
                set_cable(lb, busiest, true)?;
            }
            Fault::GuestPaused(d) => {
                let mut paused = PausedGuest::pause(lb, busiest)?;
                std::thread::sleep(d);
                paused.resume()?;
            }
        }
        Ok(Instant::now())
    }
}

/// The operator's bad day from the issue: the API server hangs (SIGSTOP:
/// connections stay open, nothing answers), and 15 s later the whole LAN
/// blips (every guest's bridge port silenced at once, as a switch reboot
/// does) for 1 s, 1.5 s and 5 s in turn; then, on the guest that holds the
/// most addresses, its agent frozen for 2 s, its agent killed and started
/// again, its uplink's carrier lost for 2 s, and the guest paused for 2 s
/// and for 10 s; the API server hung throughout. Before issue #49 every
/// such lapse ended in "nothing taken over until the assignments are read
/// again": the whole cluster dark after the first blip, until the API
/// server came back. Now each node takes its addresses back on its
/// witnesses' word (none of their accusations reached the API server).
/// Asserted: within 2 s of each fault's end, and for 8 s after, every ARP
/// request for each address is answered exactly once, with its Service's
/// MAC, and only its holder's kernel carries it; no request is ever
/// answered twice; every lease (two minutes, T1 at one) is renewed
/// through the outage, as the DHCP server's lease file shows; and once the
/// API server wakes (the accusations sent into it may land then), nothing
/// moves and no address has two holders.
fn lan_blips_in_a_hung_api_server_leave_every_address_answered_by_one_node() -> Result<()> {
    // Two-minute leases (T1 at one minute): the outage outlasts T1, so each
    // lease must be renewed through it.
    let mut lb = LbRig::start(lb::Options {
        lease_time: Some(LEASE_TIME.into()),
        ..options()
    })?;
    let Watched {
        addresses,
        busiest,
        watch,
        probers,
    } = watched_services(&lb, "bad-day")?;
    let t0 = Instant::now();
    let hung = lb.rig.apiserver().context("API server")?.hang()?;
    let hung_at = unix_secs();
    std::thread::sleep(Duration::from_secs(15)); // the outage before the blip, as the issue tells it
    let mut windows = Vec::new();
    let mut ended = Vec::new();
    for fault in [
        Fault::LanBlip(Duration::from_secs(1)),
        Fault::LanBlip(Duration::from_millis(1500)),
        Fault::LanBlip(Duration::from_secs(5)),
        Fault::AgentFrozen(Duration::from_secs(2)),
        Fault::AgentKilled,
        Fault::CarrierLost(Duration::from_secs(2)),
        Fault::GuestPaused(Duration::from_secs(2)),
        Fault::GuestPaused(Duration::from_secs(10)),
    ] {
        let began = Instant::now();
        let whole = fault.play(&mut lb, busiest)?;
        ended.push((fault, began, whole));
        // Back within the bound, from every kernel: each address on its
        // holder alone.
        let back = wait_for(ANSWERED_WITHIN, || {
            addresses
                .iter()
                .all(|a| {
                    let c = lb.carriers(a.ip);
                    c.len() == 1 && lb.guest_of(&c[0].0) == a.holder
                })
                .then_some(())
        });
        ensure!(
            back.is_some(),
            "{fault:?} in a hung API server (guest {busiest}): not every address held by its holder alone within {ANSWERED_WITHIN:?} of its end:\n{}\n{}",
            addresses
                .iter()
                .map(|a| format!(
                    "{} (guest {}):\n{}",
                    a.ip,
                    a.holder,
                    timeline(&watch, a.ip, t0)
                ))
                .collect::<Vec<_>>()
                .join("\n"),
            lb.diagnostics()
        );
        windows.push(watch_window(format!("after {fault:?}"), whole));
    }
    // Renewed through the outage, as the DHCP server saw it: each lease's
    // expiry is more than a lease time past the outage's start plus T1,
    // which only a renewal after T1 (or a new lease) gives.
    let served = lb.rig.dnsmasq_leases()?;
    for a in &addresses {
        let expiry: u64 = served
            .lines()
            .find(|l| l.split_whitespace().nth(2) == Some(&a.ip.to_string()))
            .and_then(|l| l.split_whitespace().next()?.parse().ok())
            .with_context(|| format!("{} not in the DHCP server's leases:\n{served}", a.ip))?;
        ensure!(
            expiry >= hung_at + LEASE_SECS + LEASE_SECS / 2,
            "{}: the DHCP server's lease ends at {expiry}, not renewed after T1 of the outage that began at {hung_at}:\n{served}",
            a.ip
        );
    }
    // The API server wakes: what was sent into it lands now.
    drop(hung);
    let woke = Instant::now();
    for i in 0..lb.guests() {
        let node = lb.node_name(i);
        let again = wait_for(Duration::from_secs(30), || {
            lb.node_object(&node)
                .is_some_and(|o| o["status"]["ready"] == true)
                .then_some(())
        });
        ensure!(again.is_some(), "{node} never reported ready again");
    }
    std::thread::sleep(Duration::from_secs(10)); // an observation window
    windows.push(Whole {
        label: "after the API server woke".into(),
        from: woke,
        to: Instant::now(),
    });
    let records = probers
        .into_iter()
        .map(|p| p.finish())
        .collect::<Result<Vec<ArpRecord>>>()?;

    for (a, record) in addresses.iter().zip(&records) {
        let story = || timeline(&watch, a.ip, t0);
        ensure!(
            watch.overlaps(a.ip).is_empty(),
            "{} held by two guests at once:\n{}",
            a.ip,
            story()
        );
        let twice = record.doubly_answered();
        ensure!(
            twice.is_empty(),
            "{}: {} ARP requests answered twice, the first at {}:\n{}",
            a.ip,
            twice.len(),
            offset_ms(twice[0], t0),
            story()
        );
        for w in &windows {
            let held = watch.held_by_in(a.ip, w.from, w.to);
            ensure!(
                held == [a.holder].into(),
                "{} {}: held by guests {held:?}, not guest {} alone:\n{}",
                a.ip,
                w.label,
                a.holder,
                story()
            );
            answered_once_by_its_mac(a, record, w, t0, story)?;
        }
    }
    println!(
        "the API server hung for {:.0} s; guest {busiest} held {} of the {} addresses",
        (woke - t0).as_secs_f64(),
        addresses.iter().filter(|a| a.holder == busiest).count(),
        addresses.len()
    );
    for (fault, began, whole) in &ended {
        let hit: Vec<&ArpRecord> = addresses
            .iter()
            .zip(&records)
            .filter(|(a, _)| matches!(fault, Fault::LanBlip(_)) || a.holder == busiest)
            .map(|(_, r)| r)
            .collect();
        // From the fault's end to the first request answered after it, per
        // address it could darken.
        let again: Vec<String> = hit
            .iter()
            .map(|r| {
                r.probes
                    .iter()
                    .find(|p| p.sent >= *whole && !p.replies.is_empty())
                    .map_or("never".into(), |p| {
                        format!("{:.0}", (p.sent - *whole).as_secs_f64() * 1e3)
                    })
            })
            .collect();
        println!(
            "{fault:?} (lasted {:.1} s): answered again {} ms after its end",
            (*whole - *began).as_secs_f64(),
            again.join(" / ")
        );
    }
    Ok(())
}

/// Issue #49, "the same for one node cut off from the API server alone":
/// the guest holding the most addresses loses its API path (its LAN
/// untouched, the API server fine for the others), then its agent is
/// frozen for 1 s and the guest paused for 1 s (each past its 1 s address
/// lifetime, short of its witnesses' 1.25 s verdict: the kernel drops the
/// addresses, nobody accuses it), then its agent is frozen for 2 s (its
/// witnesses accuse it and the controller, which hears them, moves its
/// Services). Asserted from the LAN and every kernel: within 2 s of each
/// fault's end every address is held by exactly one guest and answered
/// once with its Service's MAC, and stays so; never two holders at once.
/// Before, the short lapses left its addresses dark until it stood down
/// (2 s) and its Services moved; now it takes them back on its witnesses'
/// word, and after the long one, whose accusations landed, it does not.
fn a_holder_cut_off_from_the_api_server_alone_never_goes_dark_nor_answers_twice() -> Result<()> {
    let mut lb = LbRig::start(options())?;
    let Watched {
        addresses,
        busiest,
        watch,
        probers,
    } = watched_services(&lb, "cut-off")?;
    let t0 = Instant::now();
    lb.cut_api(busiest);
    // Past the 2 s after which a node whose writes fail takes nothing over.
    std::thread::sleep(Duration::from_secs(5));
    let mut windows = Vec::new();
    for fault in [
        Fault::AgentFrozen(Duration::from_secs(1)),
        Fault::GuestPaused(Duration::from_secs(1)),
        Fault::AgentFrozen(Duration::from_secs(2)),
    ] {
        let whole = fault.play(&mut lb, busiest)?;
        let back = wait_for(ANSWERED_WITHIN, || {
            addresses
                .iter()
                .all(|a| lb.carriers(a.ip).len() == 1)
                .then_some(())
        });
        ensure!(
            back.is_some(),
            "{fault:?} on guest {busiest}, cut off from the API server alone: not every address held by one guest within {ANSWERED_WITHIN:?} of its end:\n{}\n{}",
            addresses
                .iter()
                .map(|a| format!("{}:\n{}", a.ip, timeline(&watch, a.ip, t0)))
                .collect::<Vec<_>>()
                .join("\n"),
            lb.agent_log(busiest)
        );
        windows.push(watch_window(format!("after {fault:?}"), whole));
    }
    let records = probers
        .into_iter()
        .map(|p| p.finish())
        .collect::<Result<Vec<ArpRecord>>>()?;
    let mut moved = 0;
    for (a, record) in addresses.iter().zip(&records) {
        let story = || timeline(&watch, a.ip, t0);
        ensure!(
            watch.overlaps(a.ip).is_empty(),
            "{} held by two guests at once:\n{}",
            a.ip,
            story()
        );
        ensure!(
            record.doubly_answered().is_empty(),
            "{}: ARP requests answered twice:\n{}",
            a.ip,
            story()
        );
        for w in &windows {
            answered_once_by_its_mac(a, record, w, t0, story)?;
        }
        let now = lb.carriers(a.ip);
        if now.len() == 1 && lb.guest_of(&now[0].0) != a.holder {
            moved += 1;
        }
    }
    let on_word = lb
        .agent_log(busiest)
        .matches("holding its assignments again on its witnesses' word")
        .count();
    ensure!(
        on_word >= 2,
        "guest {busiest} held again on its witnesses' word {on_word} times, not after each short lapse:\n{}",
        lb.agent_log(busiest)
    );
    println!(
        "guest {busiest}, cut off from the API server alone: held its addresses again on its witnesses' word {on_word} times; {moved} of its addresses moved after the 2 s freeze; none dark past 2 s, none answered twice"
    );
    Ok(())
}

/// Waits out the window from [`ANSWERED_WITHIN`] after `whole` (a
/// fault's end) to [`STAYS_FOR`] later, which the records are read for
/// afterwards.
fn watch_window(label: String, whole: Instant) -> Whole {
    std::thread::sleep(
        (whole + ANSWERED_WITHIN + STAYS_FOR).saturating_duration_since(Instant::now()),
    );
    Whole {
        label,
        from: whole + ANSWERED_WITHIN,
        to: Instant::now(),
    }
}

/// The test's Services, each held by one guest, watched from the LAN and
/// from every guest's kernel, the membership settled.
struct Watched {
    addresses: Vec<Served>,
    /// The guest that holds the most of them.
    busiest: usize,
    watch: AddressWatch,
    probers: Vec<hna_testkit::arpprobe::ArpProber>,
}

fn watched_services(lb: &LbRig, prefix: &str) -> Result<Watched> {
    let mut addresses = Vec::new();
    for i in 0..6 {
        let (ip, holder) = served(lb, &format!("{prefix}-{i}"))?;
        let carriers = lb.carriers(ip);
        ensure!(carriers.len() == 1, "{ip}: {carriers:?}");
        addresses.push(Served {
            ip,
            holder,
            mac: carriers[0].1.mac.to_lowercase(),
        });
    }
    let busiest = (0..lb.guests())
        .max_by_key(|g| addresses.iter().filter(|a| a.holder == *g).count())
        .expect("guests");
    lb.wait_for_membership(Duration::from_secs(30))?;
    let watch = AddressWatch::start(&guest_namespaces(lb))?;
    let probers = addresses
        .iter()
        .map(|a| failover::arp_prober(lb, a.ip))
        .collect::<Result<Vec<_>>>()?;
    Ok(Watched {
        addresses,
        busiest,
        watch,
        probers,
    })
}

/// Every request for `a` sent in window `w` (and answered before its end)
/// was answered exactly once, with the Service's MAC.
fn answered_once_by_its_mac(
    a: &Served,
    record: &ArpRecord,
    w: &Whole,
    t0: Instant,
    story: impl Fn() -> String,
) -> Result<()> {
    let asked: Vec<_> = record
        .probes
        .iter()
        .filter(|p| p.sent >= w.from && p.sent + record.every * 5 <= w.to)
        .collect();
    ensure!(!asked.is_empty(), "{}: no ARP request {}", a.ip, w.label);
    for p in asked {
        let macs: Vec<String> = p.replies.iter().map(|(_, m)| mac_text(m)).collect();
        ensure!(
            macs == [a.mac.clone()],
            "{} {}: the request at {} was answered by {macs:?}, not once by the Service's MAC {}:\n{}",
            a.ip,
            w.label,
            offset_ms(p.sent, t0),
            a.mac,
            story()
        );
    }
    Ok(())
}

fn mac_text(m: &[u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}
