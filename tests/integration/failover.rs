//! Failover without split brain (issue #11) on the LoadBalancer rig. Who
//! holds an address is read from the kernel of every guest, continuously
//! (`ip monitor address`, [`AddressWatch`]), not from any agent's report.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use hna_testkit::addrwatch::AddressWatch;
use hna_testkit::failover::{
    self, Fault, fail_over, guest_namespaces, served, set_cable, timeline,
};
use hna_testkit::lb::{self, LISTEN_PORT, LbRig, wait_for};
use nix::sys::signal::Signal;

use crate::harness::tests;

tests! {
    the_test_kit_asks_for_dhcp_as_the_contract_does;
    a_stopped_holder_hands_its_address_over_within_a_second: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    a_frozen_holder_stops_answering_by_itself_and_not_again_when_it_resumes: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    a_paused_guest_does_not_answer_beside_the_new_holder_when_it_resumes: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    a_holder_that_loses_carrier_hands_over_and_does_not_take_it_back: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    a_holder_whose_uplink_is_set_down_hands_over_and_comes_back_without_the_address: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    a_holder_whose_uplink_is_deleted_hands_over_at_once_and_comes_back_without_the_address: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    a_dead_holders_address_moves_within_five_seconds: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    a_webhook_refusing_service_writes_does_not_delay_a_failover: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    a_webhook_refusing_service_writes_does_not_delay_a_failover_judged_by_heartbeats: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    a_webhook_refusing_one_new_service_does_not_hold_back_a_failover_to_its_node: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    a_credential_rotation_that_does_not_connect_yet_moves_nothing: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    an_api_server_outage_drops_and_moves_nothing: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    a_restarted_agent_keeps_its_addresses_and_nothing_moves: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    a_guard_that_cannot_hear_its_lan_takes_nothing_over: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    a_moment_without_a_default_route_drops_and_moves_nothing: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    a_node_whose_heartbeat_is_too_slow_gets_no_address: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    the_leader_dying_with_the_holder_still_moves_it_within_five_seconds: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    a_local_service_is_held_where_its_endpoint_is_and_follows_it: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    a_local_service_follows_its_endpoint_slices_where_the_api_has_them: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    two_hundred_services_moving_onto_one_node_leave_its_heartbeat_beating: Root, Iproute2, Dnsmasq, ApiServer, Socat;
}

const WITHIN: Duration = Duration::from_secs(30);

/// The rig with the product's default timings (the LAN membership on, a
/// heartbeat every 10 s, a node no witness hears stale after 40 s, the
/// controller's Lease 3 s).
fn options() -> lb::Options {
    lb::Options::new(
        crate::BIN,
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/kubernetes"),
    )
}

fn the_test_kit_asks_for_dhcp_as_the_contract_does() {
    assert_eq!(failover::IPAM, hna_contract::harvester::IPAM);
}

/// The new holder answers a client's TCP connection.
fn reachable(lb: &LbRig, f: &failover::Failover) -> Result<()> {
    let answer = lb.tcp_from_client(f.ip, LISTEN_PORT)?;
    ensure!(
        answer == lb.node_name(f.to),
        "{} answered `{answer}`, expected {}",
        f.ip,
        lb.node_name(f.to)
    );
    Ok(())
}

/// Within `limit`, and never two holders.
fn clean(f: &failover::Failover, limit: Duration) -> Result<()> {
    println!(
        "guest {} -> guest {}: {} after the fault\n{}",
        f.from,
        f.to,
        humantime_ms(f.took),
        f.story()
    );
    ensure!(
        f.took < limit,
        "took {:?}, limit {limit:?}:\n{}",
        f.took,
        f.story()
    );
    ensure!(
        f.overlaps() == 0,
        "two guests held {}:\n{}",
        f.ip,
        f.story()
    );
    Ok(())
}

fn humantime_ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1e3)
}

fn a_stopped_holder_hands_its_address_over_within_a_second() -> Result<()> {
    let mut lb = LbRig::start(options())?;
    let f = fail_over(&mut lb, "web", Fault::Graceful, Duration::from_secs(10))?;
    clean(&f, Duration::from_secs(1))?;
    reachable(&lb, &f)
}

/// Issue #20: the holder's agent frozen (SIGSTOP, as a paused VM's or a
/// hung process's) for longer than the failover: its kernel stops
/// answering for the address by itself once the address's lifetime
/// (`lb_address_lifetime`, 1 s) runs out unconfirmed, another node takes it
/// over, and when the frozen agent runs again it does not bring the
/// address back: no ARP request is ever answered twice.
fn a_frozen_holder_stops_answering_by_itself_and_not_again_when_it_resumes() -> Result<()> {
    let mut lb = LbRig::start(options())?;
    let (ip, holder) = served(&lb, "web")?;
    // Its witnesses must have heard it: a node never heard is judged by its
    // heartbeat alone (40 s).
    lb.wait_for_membership(WITHIN)?;
    let watch = AddressWatch::start(&guest_namespaces(&lb))?;
    let prober = failover::arp_prober(&lb, ip)?;
    let t0 = Instant::now();
    lb.signal_agent(holder, Signal::SIGSTOP);
    // Nothing of the agent runs now: only its kernel can drop the address.
    let dropped = wait_for(Duration::from_secs(10), || {
        watch
            .holders(ip)
            .into_iter()
            .find(|(at, h)| *at >= t0 && !h.contains(&holder))
            .map(|(at, _)| at)
    });
    let Some(dropped) = dropped else {
        anyhow::bail!(
            "the frozen holder's kernel still held {ip} 10 s later:\n{}",
            timeline(&watch, ip, t0)
        );
    };
    let taken = wait_for(WITHIN, || watch.taken_by_other(ip, holder, t0));
    let Some((at, by)) = taken else {
        anyhow::bail!(
            "{ip} never moved off the frozen holder:\n{}\n{}",
            timeline(&watch, ip, t0),
            lb.diagnostics()
        );
    };
    // Frozen past the failover, as a VM paused for 8 s: then it runs again.
    std::thread::sleep((t0 + Duration::from_secs(8)).saturating_duration_since(Instant::now()));
    let resumed = Instant::now();
    lb.signal_agent(holder, Signal::SIGCONT);
    // Its next status (read from the API, not from the agent) shows it
    // running again; then a whole staleness period more.
    let beat = lb
        .node_object(&lb.node_name(holder))
        .map(|o| o["status"]["heartbeat"].clone());
    let beating = wait_for(WITHIN, || {
        lb.node_object(&lb.node_name(holder))
            .map(|o| o["status"]["heartbeat"].clone())
            .filter(|b| Some(b) != beat.as_ref())
    });
    ensure!(
        beating.is_some(),
        "the resumed agent never wrote its status"
    );
    std::thread::sleep(Duration::from_secs(3));
    let arp = prober.finish()?;
    let silence = arp.longest_silence();
    let story = format!(
        "{}\nARP every 10 ms: {} requests, at most {} answers to one, longest without an answer {:.0} ms",
        timeline(&watch, ip, t0),
        arp.probes.len(),
        arp.most_answers(),
        silence.as_secs_f64() * 1e3
    );
    println!(
        "frozen guest {holder} at +0; its kernel dropped {ip} at +{:.2}s; guest {by} held it at +{:.2}s; resumed at +{:.1}s\n{story}",
        (dropped - t0).as_secs_f64(),
        (at - t0).as_secs_f64(),
        (resumed - t0).as_secs_f64()
    );
    ensure!(
        dropped - t0 <= Duration::from_secs(3),
        "the 1 s lifetime ran out {:?} after the freeze:\n{story}",
        dropped - t0
    );
    ensure!(
        arp.doubly_answered().is_empty(),
        "two hosts answered ARP for {ip} at once:\n{story}"
    );
    ensure!(
        watch.overlaps(ip).is_empty(),
        "two guests held {ip}:\n{story}"
    );
    ensure!(
        watch.taken_by_other(ip, by, at).is_none(),
        "{ip} left guest {by} after the resume:\n{story}"
    );
    let answer = lb.tcp_from_client(ip, LISTEN_PORT)?;
    ensure!(answer == lb.node_name(by), "{ip} answered `{answer}`");
    Ok(())
}

/// Issue #20: the holder's whole guest paused for 8 s, as a paused VM
/// looks from inside and from the LAN (every process of its namespace
/// frozen, its LAN port silent, no carrier change; `PausedGuest`), then
/// resumed, processes and port at the same moment. The LAN hears nobody, so
/// another node takes the address over after the staleness bound; the
/// paused guest's kernel has let the address expire by then, so after the
/// resume no ARP request is answered twice and the address stays put.
fn a_paused_guest_does_not_answer_beside_the_new_holder_when_it_resumes() -> Result<()> {
    let lb = LbRig::start(options())?;
    let (ip, holder) = served(&lb, "web")?;
    // Its witnesses must have heard it: a node never heard is judged by its
    // heartbeat alone (40 s).
    lb.wait_for_membership(WITHIN)?;
    let watch = AddressWatch::start(&guest_namespaces(&lb))?;
    let prober = failover::arp_prober(&lb, ip)?;
    let t0 = Instant::now();
    let mut paused = failover::PausedGuest::pause(&lb, holder)?;
    let taken = wait_for(WITHIN, || watch.taken_by_other(ip, holder, t0));
    let Some((at, by)) = taken else {
        anyhow::bail!(
            "{ip} never moved off the paused guest:\n{}\n{}",
            timeline(&watch, ip, t0),
            lb.diagnostics()
        );
    };
    std::thread::sleep((t0 + Duration::from_secs(8)).saturating_duration_since(Instant::now()));
    let resumed = Instant::now();
    paused.resume()?;
    drop(paused);
    // A whole staleness period and more after the resume.
    std::thread::sleep(Duration::from_secs(4));
    let arp = prober.finish()?;
    let after = arp.probes.iter().filter(|p| p.sent >= resumed).count();
    let story = format!(
        "{}\nARP every 10 ms: {} requests ({after} after the resume), at most {} answers to one, longest without an answer {:.0} ms",
        timeline(&watch, ip, t0),
        arp.probes.len(),
        arp.most_answers(),
        arp.longest_silence().as_secs_f64() * 1e3
    );
    println!(
        "paused guest {holder} at +0; guest {by} held {ip} at +{:.2}s; resumed at +{:.1}s\n{story}",
        (at - t0).as_secs_f64(),
        (resumed - t0).as_secs_f64()
    );
    ensure!(
        arp.doubly_answered().is_empty(),
        "{} ARP requests for {ip} answered twice:\n{story}",
        arp.doubly_answered().len()
    );
    ensure!(
        watch.overlaps(ip).is_empty(),
        "two guests held {ip}:\n{story}"
    );
    ensure!(
        watch.taken_by_other(ip, by, at).is_none(),
        "{ip} left guest {by} after the resume:\n{story}"
    );
    let answer = lb.tcp_from_client(ip, LISTEN_PORT)?;
    ensure!(answer == lb.node_name(by), "{ip} answered `{answer}`");
    Ok(())
}

fn a_holder_that_loses_carrier_hands_over_and_does_not_take_it_back() -> Result<()> {
    let mut lb = LbRig::start(options())?;
    let f = fail_over(&mut lb, "web", Fault::CablePulled, Duration::from_secs(10))?;
    clean(&f, Duration::from_secs(3))?;
    reachable(&lb, &f)?;

    // The cable is back: the node says it is ready again, and it does not
    // take the address back.
    let back = Instant::now();
    set_cable(&lb, f.from, true)?;
    let ready = wait_for(WITHIN, || {
        lb.node_object(&lb.node_name(f.from))
            .is_some_and(|o| o["status"]["ready"] == true)
            .then_some(())
    });
    ensure!(ready.is_some(), "guest {} never ready again", f.from);
    let retaken = wait_for(Duration::from_secs(5), || {
        f.watch.taken_by_other(f.ip, f.to, back)
    });
    ensure!(
        retaken.is_none(),
        "taken back after the cable returned:\n{}",
        f.story()
    );
    clean(&f, Duration::MAX)
}

/// Issue #20: the holder's owner sets its uplink down (a network service
/// restart), which is not a carrier loss: the default route goes too. The
/// holder hands over at once; when the uplink comes back up, its old link
/// holds no address, so no ARP request is answered twice and the address
/// stays with the new holder.
fn a_holder_whose_uplink_is_set_down_hands_over_and_comes_back_without_the_address() -> Result<()> {
    let mut lb = LbRig::start(options())?;
    let f = fail_over(
        &mut lb,
        "web",
        Fault::UplinkSetDown,
        Duration::from_secs(10),
    )?;
    clean(&f, Duration::from_secs(3))?;
    reachable(&lb, &f)?;
    comes_back_without_the_address(&lb, &f, || failover::set_uplink(&lb, f.from, true))
}

/// After `restore` gives the old holder its uplink back: it gets ready
/// again and, for a whole staleness period and more, neither takes the
/// address back nor answers for it beside the new holder.
fn comes_back_without_the_address(
    lb: &LbRig,
    f: &failover::Failover,
    restore: impl FnOnce() -> Result<()>,
) -> Result<()> {
    let prober = failover::arp_prober(lb, f.ip)?;
    let back = Instant::now();
    restore()?;
    let ready = wait_for(WITHIN, || {
        lb.node_object(&lb.node_name(f.from))
            .is_some_and(|o| o["status"]["ready"] == true)
            .then_some(())
    });
    ensure!(ready.is_some(), "guest {} never ready again", f.from);
    // A whole staleness period and more after it is ready again.
    std::thread::sleep(Duration::from_secs(4).saturating_sub(back.elapsed()));
    let arp = prober.finish()?;
    let twice = arp.doubly_answered();
    ensure!(
        twice.is_empty(),
        "{} ARP requests answered twice after the uplink came back (first at +{:?}):\n{}",
        twice.len(),
        twice[0] - back,
        f.story()
    );
    ensure!(
        f.watch.taken_by_other(f.ip, f.to, back).is_none() && f.watch.overlaps(f.ip).is_empty(),
        "the old holder took the address back:\n{}",
        timeline(&f.watch, f.ip, f.t0)
    );
    ensure!(
        lb.carriers(f.ip).len() == 1,
        "{} on {:?}",
        f.ip,
        lb.carriers(f.ip)
    );
    reachable(lb, f)
}

/// Issue #20 (found by the soak): the holder's uplink deleted and made
/// again, as a network service that recreates its interfaces does. The
/// deletion takes the macvlan with it; the node must say at once that its
/// uplink carries nothing (it did not: a missing interface has no carrier
/// file to read as "down", so it stayed ready and its Service unserved, its
/// start retried on a missing parent, until the uplink was back), and the
/// new uplink must not bring the address back beside the new holder.
fn a_holder_whose_uplink_is_deleted_hands_over_at_once_and_comes_back_without_the_address()
-> Result<()> {
    let mut lb = LbRig::start(options())?;
    let f = fail_over(
        &mut lb,
        "web",
        Fault::UplinkDeleted,
        Duration::from_secs(10),
    )?;
    clean(&f, Duration::from_secs(2))?;
    reachable(&lb, &f)?;
    comes_back_without_the_address(&lb, &f, || failover::recreate_uplink(&lb, f.from))
}

/// The holder's VM is switched off (its namespace deleted with everything
/// in it): nobody hands anything over, the controller sees the heartbeat
/// stop and moves the Service; a client connecting all along gets through
/// again.
fn a_dead_holders_address_moves_within_five_seconds() -> Result<()> {
    const METRICS: &str = "127.0.0.1:9478";
    let mut opts = options();
    opts.agent_config
        .push_str(&format!("metrics_listen = \"{METRICS}\"\n"));
    let mut lb = LbRig::start(opts)?;
    let f = fail_over(&mut lb, "web", Fault::GuestDeleted, Duration::from_secs(15))?;
    clean(&f, Duration::from_secs(5))?;
    // A client that keeps trying gets through to the new holder.
    let reconnected = wait_for(Duration::from_secs(10), || reachable(&lb, &f).ok());
    println!("a client got through {:?} after the fault", f.t0.elapsed());
    ensure!(reconnected.is_some(), "no client got through to {}", f.ip);
    // The new holder's histograms hold the takeover: one wait behind the
    // guard and one acquisition of the address it asked for (INIT-REBOOT),
    // each no longer than the failover; its API requests are timed.
    let m = lb.agent_http(f.to, METRICS, "/metrics")?;
    let sample = |prefix: &str| -> Option<f64> {
        m.lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
    };
    let took = f.took.as_secs_f64();
    for family in [
        "hna_lb_takeover_guard_wait_seconds",
        "hna_dhcp_acquisition_duration_seconds{begin=\"reboot\"}",
    ] {
        let (name, labels) = family.split_once('{').map_or((family, ""), |(n, l)| (n, l));
        let labels = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{labels}")
        };
        let count = sample(&format!("{name}_count{labels} "));
        let sum = sample(&format!("{name}_sum{labels} "));
        ensure!(count == Some(1.0), "{family}: count {count:?} in\n{m}");
        ensure!(
            sum.is_some_and(|s| s > 0.0 && s <= took),
            "{family}: sum {sum:?} beyond the failover's {took} s"
        );
    }
    ensure!(
        m.lines().any(|l| l
            .starts_with("hna_api_request_duration_seconds_count{verb=\"PATCH\",code=\"2xx\"}")),
        "no PATCH timed in\n{m}"
    );
    Ok(())
}

/// Waits until a controller's log says the webhook refused a write.
fn refused_by_webhook(lb: &LbRig, within: Duration) -> Result<()> {
    let refused = wait_for(within, || {
        (0..2)
            .map(|c| lb.controller_log(c))
            .any(|log| log.contains("failed calling webhook"))
            .then_some(())
    });
    ensure!(
        refused.is_some(),
        "no controller wrote through the webhook and was refused:\n{}",
        lb.diagnostics()
    );
    Ok(())
}

/// Issue #29: a validating webhook on Services and `services/status` with
/// `failurePolicy: Fail` is down (a policy engine's Pod gone), so every
/// PATCH of a Service is refused. A Service created meanwhile keeps
/// failing its first write long enough for any backoff to reach its
/// longest (35 s); then the holder of a served Service dies (agent killed
/// and uplink down, as a VM switched off). Another node answers within the
/// same bound as without the webhook, and once the webhook is gone both
/// Services' status and annotations catch up.
fn a_webhook_refusing_service_writes_does_not_delay_a_failover() -> Result<()> {
    webhook_refusing_service_writes(options(), Duration::from_secs(5))
}

/// The same with liveness judged from the heartbeats alone (the LAN
/// membership off, a heartbeat every second, stale after 3 s): a heartbeat
/// is timed when the watch delivers it, not when a pass that the writes'
/// backoff delays reads it, so the dead holder is still found stale 3 s
/// after its last beat.
fn a_webhook_refusing_service_writes_does_not_delay_a_failover_judged_by_heartbeats() -> Result<()>
{
    webhook_refusing_service_writes(options().api_liveness(), Duration::from_secs(6))
}

fn webhook_refusing_service_writes(opts: lb::Options, bound: Duration) -> Result<()> {
    const WEBHOOK: &str = "policy-engine-down";
    let mut lb = LbRig::start(opts)?;
    let f = failover::fail_over_prepared(
        &mut lb,
        "web",
        Fault::GuestDeleted,
        Duration::from_secs(60),
        |lb| {
            lb.install_failing_webhook(WEBHOOK, "")?;
            lb.create_service("late", &[(failover::IPAM, "dhcp")], &[LISTEN_PORT])?;
            // Its finalizer (the controller's first write) is refused again
            // and again meanwhile.
            std::thread::sleep(Duration::from_secs(35));
            refused_by_webhook(lb, Duration::from_secs(5))?;
            ensure!(
                lb.ingress_ip("late").is_none(),
                "`late` was served through the webhook"
            );
            Ok(())
        },
    )?;
    clean(&f, bound)?;
    let reconnected = wait_for(Duration::from_secs(10), || reachable(&lb, &f).ok());
    ensure!(reconnected.is_some(), "no client got through to {}", f.ip);
    lb.remove_webhook(WEBHOOK, "")?;
    // The longest backoff is 30 s (+25 % jitter): both catch up within it.
    let late = wait_for(Duration::from_secs(60), || lb.ingress_ip("late"));
    ensure!(
        late.is_some(),
        "`late` got no address after the webhook went:\n{}",
        lb.diagnostics()
    );
    let new_holder = lb.node_name(f.to);
    let caught_up = wait_for(Duration::from_secs(60), || {
        let svc = lb.service("web")?;
        let host = svc
            .metadata
            .annotations?
            .get("kube-vip.io/vipHost")?
            .clone();
        (host == new_holder && lb.ingress_ip("web") == Some(f.ip)).then_some(())
    });
    ensure!(
        caught_up.is_some(),
        "web's vipHost never named its new holder {new_holder} after the webhook went:\n{}",
        lb.diagnostics()
    );
    Ok(())
}

/// Issue #29: a webhook with `failurePolicy: Fail` that is down refuses
/// every write of one new Service, `late`, and nothing else (a policy
/// scoped to some workloads). With two guests, `late` is placed on the
/// guest that does not hold `web`; then `web`'s holder dies and `web` must
/// move to that same guest. One write carries that guest's assignments:
/// `late`'s refused finalizer must not hold `web` back. `web` moves within
/// the usual bound, `late` is served once the webhook goes.
fn a_webhook_refusing_one_new_service_does_not_hold_back_a_failover_to_its_node() -> Result<()> {
    const WEBHOOK: &str = "policy-for-late";
    const REFUSED: &str = "late";
    let mut opts = options();
    opts.guests = 2;
    let mut lb = LbRig::start(opts)?;
    let f = failover::fail_over_prepared(
        &mut lb,
        "web",
        Fault::GuestDeleted,
        Duration::from_secs(30),
        |lb| {
            lb.install_failing_webhook(WEBHOOK, REFUSED)?;
            lb.create_service(REFUSED, &[(failover::IPAM, "dhcp")], &[LISTEN_PORT])?;
            refused_by_webhook(lb, Duration::from_secs(15))?;
            Ok(())
        },
    )?;
    clean(&f, Duration::from_secs(5))?;
    ensure!(
        lb.ingress_ip(REFUSED).is_none(),
        "`{REFUSED}` was served through the webhook"
    );
    let reconnected = wait_for(Duration::from_secs(10), || reachable(&lb, &f).ok());
    ensure!(reconnected.is_some(), "no client got through to {}", f.ip);
    lb.remove_webhook(WEBHOOK, REFUSED)?;
    // The longest backoff is 30 s (+25 % jitter).
    let late = wait_for(Duration::from_secs(60), || lb.ingress_ip(REFUSED));
    ensure!(
        late.is_some(),
        "`{REFUSED}` got no address after the webhook went:\n{}",
        lb.diagnostics()
    );
    Ok(())
}

/// Issue #29: the holder's kubeconfig is rewritten (a credential rotation)
/// to something that does not connect yet (here a server port nothing
/// listens on). The agent keeps its working session and retries the new
/// credentials every round: its heartbeat goes on, nothing moves, no
/// address is dropped. Once the file works again it connects with it.
fn a_credential_rotation_that_does_not_connect_yet_moves_nothing() -> Result<()> {
    // Liveness through the API (a 3 s staleness bound): a node whose
    // writes stopped would be moved within the test, so keeping the
    // working client is what keeps it.
    let lb = LbRig::start(options().api_liveness())?;
    let (ip, holder) = served(&lb, "web")?;
    let watch = AddressWatch::start(&guest_namespaces(&lb))?;
    let path = lb.agent_kubeconfig(holder)?;
    let working = std::fs::read_to_string(&path)?;
    // A server nothing listens at, inside the guest.
    let broken: String = working
        .lines()
        .map(|l| {
            if l.trim_start().starts_with("server: ") {
                "    server: https://127.0.0.1:1".to_string()
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    ensure!(
        broken != working,
        "the kubeconfig names no server:\n{working}"
    );
    let t0 = Instant::now();
    // Written whole (a rename), as a rotation does.
    let tmp = path.with_extension("rotating");
    std::fs::write(&tmp, &broken)?;
    std::fs::rename(&tmp, &path)?;
    let tried = wait_for(Duration::from_secs(10), || {
        lb.agent_log(holder)
            .contains("the changed credentials do not connect")
            .then_some(())
    });
    ensure!(
        tried.is_some(),
        "the agent never tried the new credentials:\n{}",
        lb.agent_log(holder)
    );
    // Longer than the controller's 3 s staleness bound, twice over.
    std::thread::sleep(Duration::from_secs(7));
    let held: Vec<_> = watch
        .holders(ip)
        .into_iter()
        .filter(|(at, _)| *at >= t0)
        .collect();
    ensure!(
        held.is_empty()
            && lb.carriers(ip).len() == 1
            && lb.guest_of(&lb.carriers(ip)[0].0) == holder,
        "the address moved or dropped while the rotation did not connect: {held:?}\n{}",
        lb.diagnostics()
    );
    ensure!(
        !lb.our_events("web")
            .iter()
            .any(|(_, reason, _)| reason == "HolderMoved"),
        "the Service moved: {:?}",
        lb.our_events("web")
    );
    std::fs::write(&tmp, &working)?;
    std::fs::rename(&tmp, &path)?;
    Ok(())
}

/// kube-apiserver and etcd stopped for 10 s, then for 30 s, nothing else
/// wrong: every address stays where it is, with no gap, and clients keep
/// connecting throughout; after each restart, a whole staleness period and
/// more passes without a move.
/// Issue #22: every node's default route gone for a while, as when the
/// node's network service restarts, with the uplink taken from the route
/// (the default). The uplink is still there with carrier: nothing is
/// dropped, nothing moves, every node stays ready.
fn a_moment_without_a_default_route_drops_and_moves_nothing() -> Result<()> {
    let mut opts = options();
    opts.uplink_from_route = true;
    let lb = LbRig::start(opts)?;
    let mut served_by = Vec::new();
    for n in ["a", "b", "c"] {
        served_by.push(served(&lb, n)?);
    }
    let watch = AddressWatch::start(&guest_namespaces(&lb))?;
    let t0 = Instant::now();
    let route = |verb: &str| -> Result<()> {
        for ns in guest_namespaces(&lb) {
            hna_testkit::rig::process::run_args(
                "ip",
                [
                    "-n",
                    &ns,
                    "route",
                    verb,
                    "default",
                    "via",
                    hna_testkit::rig::LAN_ADDR,
                ],
            )?;
        }
        Ok(())
    };
    route("del")?;
    // Twice the staleness bound, with no default route anywhere.
    let dropped = wait_for(Duration::from_secs(6), || {
        served_by.iter().find_map(|(ip, holder)| {
            let holders = watch.holders(*ip);
            (holders.len() != 1 || holders[0].1 != [*holder].into()).then_some(*ip)
        })
    });
    let not_ready: Vec<String> = (0..3)
        .map(|i| lb.node_name(i))
        .filter(|n| {
            lb.node_object(n)
                .is_none_or(|o| o["status"]["ready"] != true)
        })
        .collect();
    route("add")?;
    if let Some(ip) = dropped {
        anyhow::bail!(
            "{ip} was dropped or moved without a default route:\n{}",
            timeline(&watch, ip, t0)
        );
    }
    ensure!(
        not_ready.is_empty(),
        "not ready without a default route: {not_ready:?}\n{}",
        lb.diagnostics()
    );
    Ok(())
}

/// Issue #22: `lb_heartbeat` 2 s against a `--node-stale-after` of 3 s
/// (the defaults, 10 s and 40 s, fit; the setting is an operator's):
/// less than two heartbeats fit, so the node would look dead between two
/// writes. It gets no address, and the controller says why; the other
/// node takes them all.
fn a_node_whose_heartbeat_is_too_slow_gets_no_address() -> Result<()> {
    let mut opts = options().api_liveness();
    opts.guests = 2;
    let mut lb = LbRig::start(opts)?;
    lb.stop_agent(1);
    lb.set_agent_config("lb_membership_port = 0\nlb_heartbeat = \"2s\"");
    lb.start_agent(1)?;
    let slow = lb.node_name(1);
    let said = wait_for(WITHIN, || {
        lb.node_object(&slow)
            .and_then(|o| o["status"]["heartbeatPeriodMs"].as_u64())
    });
    ensure!(
        said == Some(2000),
        "the slow node's status does not carry its period: {:?}",
        lb.node_object(&slow)
    );
    for n in ["a", "b", "c", "d"] {
        let (ip, holder) = served(&lb, n)?;
        ensure!(
            holder == 0,
            "{n} ({ip}) went to the node with the slow heartbeat"
        );
    }
    let told = wait_for(WITHIN, || {
        (0..2)
            .map(|i| lb.controller_log(i))
            .find(|log| log.contains("writes its heartbeat too seldom") && log.contains(&slow))
    });
    ensure!(
        told.is_some(),
        "no controller said why {slow} gets no address"
    );
    Ok(())
}

/// Issue #30: API server and etcd down for 10 s, then for 50 s (past the
/// agents' `lb_fence_after` and the controller's staleness bound): every
/// holder answers throughout and nothing moves afterwards, since every node
/// hears its LAN.
fn an_api_server_outage_drops_and_moves_nothing() -> Result<()> {
    let mut lb = LbRig::start(options())?;
    let names = ["a", "b", "c"];
    let mut served_by = Vec::new();
    for n in names {
        served_by.push(served(&lb, n)?);
    }
    let watch = AddressWatch::start(&guest_namespaces(&lb))?;
    let t0 = Instant::now();
    // The second outage outlasts the agents' lb_fence_after (30 s) and the
    // controller's --node-stale-after (40 s): with the LAN heard, neither
    // applies.
    for outage in [Duration::from_secs(10), Duration::from_secs(50)] {
        let down = Instant::now();
        lb.rig.apiserver_mut().expect("API server").stop();
        let mut connects = 0;
        while down.elapsed() < outage {
            for (ip, holder) in &served_by {
                let answer = lb.tcp_from_client(*ip, LISTEN_PORT)?;
                ensure!(
                    answer == lb.node_name(*holder),
                    "{ip} answered `{answer}` during the outage, not {}",
                    lb.node_name(*holder)
                );
                connects += 1;
            }
        }
        lb.rig.apiserver_mut().expect("API server").restart()?;
        let up = Instant::now();
        println!(
            "API server and etcd stopped for {outage:?}, ready again {:?} after the stop; {connects} client connections got through meanwhile",
            up - down
        );
        // Every agent reports again (a fresh write on the new server)...
        for i in 0..3 {
            let back = wait_for(WITHIN, || {
                lb.node_object(&lb.node_name(i))
                    .is_some_and(|o| o["status"]["ready"] == true)
                    .then_some(())
            });
            ensure!(back.is_some(), "guest {i} never reported again");
        }
        // ...and for longer than the staleness bound nothing moves.
        let moved = wait_for(Duration::from_secs(45), || {
            served_by
                .iter()
                .find_map(|(ip, holder)| watch.taken_by_other(*ip, *holder, t0).map(|m| (*ip, m)))
        });
        ensure!(
            moved.is_none(),
            "moved after a {outage:?} outage: {moved:?}"
        );
        for (ip, holder) in &served_by {
            let holders = watch.holders(*ip);
            ensure!(
                holders.len() == 1 && holders[0].1 == [*holder].into(),
                "{ip} changed hands or had a gap:\n{}",
                timeline(&watch, *ip, t0)
            );
        }
    }
    Ok(())
}

/// Issue #29: a restart of a healthy holder's agent (SIGTERM, then a new
/// process with the same state directory, as `systemctl restart` and a
/// package upgrade do) that keeps the agent down for 6 s, three times as
/// long as its witnesses on the LAN take to find a dead node, moves nothing
/// and drops no address: the stopping agent leaves its addresses on their
/// links for `lb_restart_grace` and says so, the controller waits that
/// long, and the new process adopts the links. `lb_keep_on_stop =
/// "always"` stands in for systemd's restart job, which the agent asks
/// systemd about under systemd (the VM image test). Read from the guests'
/// kernels and a client's TCP connections, not from any report.
fn a_restarted_agent_keeps_its_addresses_and_nothing_moves() -> Result<()> {
    let mut opts = options();
    opts.agent_config = "lb_keep_on_stop = \"always\"\n".into();
    let mut lb = LbRig::start(opts)?;
    let (ip, holder) = served(&lb, "web")?;
    let watch = AddressWatch::start(&guest_namespaces(&lb))?;
    let t0 = Instant::now();
    let stopped = lb.stop_agent(holder);
    ensure!(stopped.success(), "the agent's stop: {stopped:?}");
    let down = Instant::now();
    let mut connects = 0;
    while down.elapsed() < Duration::from_secs(6) {
        let answer = lb
            .tcp_from_client(ip, LISTEN_PORT)
            .unwrap_or_else(|e| e.to_string());
        ensure!(
            answer == lb.node_name(holder),
            "{ip} answered `{answer}` {:?} after its holder's agent was stopped, not {}:\n{}\nthe agent's log:\n{}",
            down.elapsed(),
            lb.node_name(holder),
            timeline(&watch, ip, t0),
            lb::tail(&lb.agent_log(holder), 30)
        );
        connects += 1;
    }
    lb.start_agent(holder)?;
    let node = lb.node_name(holder);
    let adopted = wait_for(WITHIN, || {
        lb.node_object(&node)
            .is_some_and(|o| o["status"]["held"] == 1 && o["status"]["restartGraceMs"].is_null())
            .then_some(())
    });
    ensure!(
        adopted.is_some(),
        "the new run never reported the address held: {:?}",
        lb.node_object(&node)
    );
    // For twice the staleness bound after the new run, nothing moves.
    let moved = wait_for(Duration::from_secs(6), || {
        watch.taken_by_other(ip, holder, t0)
    });
    ensure!(moved.is_none(), "moved by a restart: {moved:?}");
    let holders = watch.holders(ip);
    ensure!(
        holders.len() == 1 && holders[0].1 == [holder].into(),
        "{ip} changed hands or had a gap:\n{}",
        timeline(&watch, ip, t0)
    );
    let log = lb.agent_log(holder);
    ensure!(
        log.contains("every address stays on its link"),
        "the stopping agent did not leave its addresses:\n{}",
        lb::tail(&log, 40)
    );
    println!("{connects} client connections reached {ip} on its holder while its agent was down");
    Ok(())
}

/// Issue #29, found by the soak: the holder is cut off from the API server
/// only (its LAN fine), so the controller gives its Service to another
/// node, whose takeover guard hears the holder and waits. While that
/// node's own LAN port is silent (a switch filtering it; its link and its
/// API path up), its guard hears nobody, not even the gateway, and that
/// silence is not taken for a free address. Never two holders, read from
/// the kernels; once the holder hears the API again and lets go, the new
/// node takes the address.
fn a_guard_that_cannot_hear_its_lan_takes_nothing_over() -> Result<()> {
    // Moved off a holder cut off from the API server only: liveness through
    // the API (with the LAN membership on, its witnesses vouch for it and
    // nothing moves: `partitions::`). The next node's port goes silent with
    // its API path up: a side channel to the API server (a management
    // network), so that its guard, not its API path, is what is tried.
    let mut opts = options().api_liveness();
    opts.api_on_lan = false;
    let mut lb = LbRig::start(opts)?;
    let (ip, holder) = served(&lb, "web")?;
    let watch = AddressWatch::start(&guest_namespaces(&lb))?;
    let t0 = Instant::now();
    lb.cut_api(holder);
    let assigned_to = |lb: &LbRig| {
        (0..3).filter(|g| *g != holder).find(|g| {
            lb.node_object(&lb.node_name(*g)).is_some_and(|o| {
                o["spec"]["assignments"]
                    .as_array()
                    .is_some_and(|a| a.iter().any(|a| a["service"] == "default/web"))
            })
        })
    };
    let Some(next) = wait_for(WITHIN, || assigned_to(&lb)) else {
        anyhow::bail!("the Service never moved off the node cut off from the API");
    };
    let lease_message = |lb: &LbRig| -> String {
        lb.node_object(&lb.node_name(next))
            .and_then(|o| {
                o["status"]["leases"].as_array()?.iter().find_map(|l| {
                    (l["service"] == "default/web")
                        .then(|| format!("{} {}", l["state"], l["message"]))
                })
            })
            .unwrap_or_default()
    };
    let guarded = wait_for(WITHIN, || {
        let m = lease_message(&lb);
        m.contains("GUARDED").then_some(m)
    });
    ensure!(
        guarded.is_some(),
        "the next node never waited for the holder: {}",
        lease_message(&lb)
    );
    failover::set_port(&lb, next, false)?;
    let deaf = wait_for(WITHIN, || {
        let m = lease_message(&lb);
        m.contains("nothing answers").then_some(m)
    });
    failover::set_port(&lb, next, true)?;
    ensure!(
        deaf.is_some(),
        "the guard never said it could not hear its LAN: {}",
        lease_message(&lb)
    );
    // The port is back: for a few guard rounds more, still the holder alone.
    let taken = wait_for(Duration::from_secs(3), || {
        watch.taken_by_other(ip, holder, t0)
    });
    ensure!(
        taken.is_none(),
        "{ip} taken while its holder still answered:\n{}",
        timeline(&watch, ip, t0)
    );
    lb.restore_api(holder)?;
    let moved = wait_for(WITHIN, || {
        let c = lb.carriers(ip);
        (c.len() == 1 && lb.guest_of(&c[0].0) == next).then_some(())
    });
    ensure!(
        moved.is_some(),
        "{ip} never moved to guest {next} once the holder let go:\n{}",
        timeline(&watch, ip, t0)
    );
    ensure!(
        watch.overlaps(ip).is_empty(),
        "two guests held {ip}:\n{}",
        timeline(&watch, ip, t0)
    );
    println!("guest {next}'s guard said: {}", deaf.unwrap_or_default());
    Ok(())
}

/// The controller leader's node dies together with the holder: the other
/// replica takes the Lease once it expires and, having judged the nodes
/// all along, moves the Service at once.
fn the_leader_dying_with_the_holder_still_moves_it_within_five_seconds() -> Result<()> {
    let mut lb = LbRig::start(options())?;
    let f = fail_over(
        &mut lb,
        "web",
        Fault::LeaderAndHolder,
        Duration::from_secs(15),
    )?;
    clean(&f, Duration::from_secs(5))?;
    reachable(&lb, &f)
}

/// `externalTrafficPolicy: Local`: the holder is the node with the ready
/// endpoint, and when the endpoint moves the address follows it, never on
/// two nodes at once (the new holder waits, guarded, until the old one has
/// let go).
fn a_local_service_is_held_where_its_endpoint_is_and_follows_it() -> Result<()> {
    local_service_follows_its_endpoint(options())
}

/// The same with EndpointSlices alone, as a current cluster publishes
/// them: the controller's default (`--endpoint-source auto`) reads
/// `discovery.k8s.io/v1` on the real server (there are no Endpoints for it
/// to fall back on), and a not-ready endpoint does not count.
fn a_local_service_follows_its_endpoint_slices_where_the_api_has_them() -> Result<()> {
    local_service_follows_its_endpoint(lb::Options {
        endpoint_slices: true,
        ..options()
    })
}

fn local_service_follows_its_endpoint(options: lb::Options) -> Result<()> {
    let lb = LbRig::start(options)?;
    let guests = guest_namespaces(&lb).len();
    let first = guests - 1;
    lb.set_endpoints("web", &[lb.node_name(first)])?;
    lb.create_service_with(
        "web",
        &[(failover::IPAM, "dhcp")],
        &[LISTEN_PORT],
        serde_json::json!({"externalTrafficPolicy": "Local"}),
    )?;
    let ip = lb.wait_ingress("web", Duration::from_secs(60));
    let on_first = wait_for(WITHIN, || {
        let c = lb.carriers(ip);
        (c.len() == 1 && c[0].0 == lb.node_name(first)).then_some(())
    });
    ensure!(
        on_first.is_some(),
        "{ip} not on {} (the endpoint's node): {:?}",
        lb.node_name(first),
        lb.carriers(ip)
    );
    let watch = AddressWatch::start(&guest_namespaces(&lb))?;
    let t0 = Instant::now();
    lb.set_endpoints("web", &[lb.node_name(0)])?;
    let moved = wait_for(Duration::from_secs(15), || {
        watch.taken_by_other(ip, first, t0)
    });
    let story = timeline(&watch, ip, t0);
    let Some((at, to)) = moved else {
        anyhow::bail!(
            "{ip} did not follow the endpoint:\n{story}\n{}",
            lb.diagnostics()
        );
    };
    println!(
        "endpoint moved to guest 0: {ip} followed in {:?}\n{story}",
        at - t0
    );
    ensure!(
        to == 0,
        "{ip} went to guest {to}, not guest 0 (the endpoint's node)"
    );
    ensure!(
        watch.overlaps(ip).is_empty(),
        "two guests held {ip}:\n{story}"
    );
    let answer = lb.tcp_from_client(ip, LISTEN_PORT)?;
    ensure!(answer == lb.node_name(0), "{ip} answered `{answer}`");
    Ok(())
}

/// Issue #29: 200 Services held by one node move at once onto the other
/// when their holder's VM is gone. The receiver starts 200 leases (each
/// behind the takeover guard) and must go on writing its heartbeat all
/// the while, or it looks dead in turn and everything moves a second time.
/// Read from the API (the receiver's heartbeat as written) and from the
/// kernels (who holds each address), not from the product's own report.
fn two_hundred_services_moving_onto_one_node_leave_its_heartbeat_beating() -> Result<()> {
    const SERVICES: usize = 200;
    let mut opts = options();
    opts.guests = 2;
    opts.wide_lan = true;
    // The period the gap is compared with; the point is the writer's
    // independence from the loop's rounds, whatever the period.
    opts.agent_config = "lb_heartbeat = \"1s\"\n".into();
    let mut lb = LbRig::start(opts)?;
    let (receiver, giver) = (0, 1);
    // All on the giver: the receiver's agent is down while they are placed.
    let ips = failover::all_on_one(&mut lb, giver, "mass", SERVICES)?;
    let node = lb.node_name(receiver);
    let watch = AddressWatch::start(&guest_namespaces(&lb))?;
    // The heartbeat as the API server has it, read every 50 ms on a thread
    // of its own (the guest's deletion blocks this one for seconds): a
    // changed value is a write that landed.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let recorder = {
        let kubeconfig = lb
            .admin_kubeconfig()
            .ok_or_else(|| anyhow::anyhow!("the rig has no API server"))?;
        let stop = stop.clone();
        let node = node.clone();
        std::thread::spawn(move || -> Result<Vec<Instant>> {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let api = lb::node_objects_with(rt.block_on(lb::client_from(&kubeconfig))?);
            let mut beats = Vec::new();
            let mut last: Option<String> = None;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                if let Ok(o) = rt.block_on(api.get(&node)) {
                    let now = o.data["status"]["heartbeat"].as_str().map(str::to_string);
                    if now.is_some() && now != last {
                        beats.push(Instant::now());
                        last = now;
                    }
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            Ok(beats)
        })
    };
    std::thread::sleep(Duration::from_secs(3));
    let t0 = Instant::now();
    lb.delete_guest(giver)?;
    // Its LAN port goes first, its monitor with its namespace (seconds
    // later): its addresses went at the start.
    watch.gone(giver, t0);
    let mut all_moved: Option<Duration> = None;
    while t0.elapsed() < Duration::from_secs(90) {
        if all_moved.is_none()
            && ips.iter().all(|ip| {
                watch
                    .holders(*ip)
                    .last()
                    .is_some_and(|(_, h)| h.contains(&receiver))
            })
        {
            // From the kernel's record, not from when this loop saw it
            // (the deletion itself takes seconds).
            all_moved = ips
                .iter()
                .filter_map(|ip| watch.taken_by_other(*ip, giver, t0).map(|(at, _)| at - t0))
                .max();
        }
        // Past the takeover by twice the staleness bound: a second move
        // would have come by then.
        if all_moved.is_some_and(|d| t0.elapsed() > d + Duration::from_secs(6)) {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // Read from the receiver's kernel only: the deleted guest's monitor
    // dies with its namespace, seconds after its port (and so its
    // addresses) left the LAN.
    let on_receiver = |ip: &Ipv4Addr| {
        watch
            .holders(*ip)
            .last()
            .is_some_and(|(_, h)| h.contains(&receiver))
    };
    let Some(all_moved) = all_moved else {
        let left: Vec<&Ipv4Addr> = ips.iter().filter(|ip| !on_receiver(ip)).collect();
        let log = lb.agent_log(receiver);
        let about: Vec<String> = left
            .iter()
            .take(3)
            .map(|ip| {
                let lines: Vec<&str> = log
                    .lines()
                    .filter(|l| l.contains(&ip.to_string()))
                    .collect();
                format!(
                    "{ip}:\n{}\nthe receiver's log about it:\n{}",
                    timeline(&watch, **ip, t0),
                    lines[lines.len().saturating_sub(12)..].join("\n")
                )
            })
            .collect();
        anyhow::bail!(
            "{} of {SERVICES} addresses not on guest {receiver} 90 s after guest {giver} was deleted:\n{}",
            left.len(),
            about.join("\n")
        );
    };
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let beats = recorder
        .join()
        .map_err(|_| anyhow::anyhow!("the heartbeat recorder panicked"))??;
    let gap = beats
        .windows(2)
        .map(|w| w[1] - w[0])
        .max()
        .unwrap_or_default();
    let log = lb.agent_log(receiver);
    let expired = log.matches("ran out of its lifetime").count();
    println!(
        "{SERVICES} Services moved onto {node} in {:.2} s; its heartbeat's longest gap as the API server had it: {:.2} s ({} writes: {}); {expired} of its addresses ran out of their lifetime",
        all_moved.as_secs_f64(),
        gap.as_secs_f64(),
        beats.len(),
        beats
            .iter()
            .map(|b| failover::offset_ms(*b, t0))
            .collect::<Vec<_>>()
            .join(" ")
    );
    // Each address taken once, and kept.
    for ip in &ips {
        // Whether the receiver held it, change by change since the fault:
        // taken once and kept is one change, to held.
        let mut after: Vec<bool> = watch
            .holders(*ip)
            .into_iter()
            .filter(|(at, _)| *at >= t0)
            .map(|(_, h)| h.contains(&receiver))
            .collect();
        after.dedup();
        ensure!(
            after == [false, true] || after == [true],
            "{ip} moved more than once:\n{}\n({expired} addresses ran out of their lifetime on {node}; its log:\n{})",
            timeline(&watch, *ip, t0),
            lb::tail(&log, 40)
        );
    }
    // The heartbeat is 1 s here (`lb_heartbeat`), due a period after the
    // last write began, so the gap seen through the API is the period plus
    // how much longer one write took than the one before it, plus the read's
    // latency and the 50 ms between reads: 1.05-1.17 s on a quiet 2-core
    // machine, 1.45 and 1.54 s in whole CI-like runs (2026-11-28/29), where
    // a write of 200 addresses' status took up to half a second. What is
    // held is the writer's independence from the loop's rounds: a writer
    // that waited for the takeover round would show its 3.6-4.1 s, so the
    // bound is two periods.
    ensure!(
        gap <= Duration::from_secs(2),
        "{node}'s heartbeat stopped for {gap:?} while it took {SERVICES} Services over"
    );
    Ok(())
}
