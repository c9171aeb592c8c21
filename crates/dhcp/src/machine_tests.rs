//! State machine tests: hand-made server replies, paused tokio time.

use std::net::Ipv4Addr;
use std::time::Duration;

use dhcproto::v4::{DhcpOption, Message, MessageType, OptionCode};
use dhcproto::{Decodable, Decoder};
use tokio::time::{Instant, advance};

use super::machine::*;
use super::packet::{Identity, build_reply};

const MAC: [u8; 6] = [0, 0, 0x6c, 0xaa, 0xbb, 0xcc];
const SRV: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 1);
const SRV_MAC: [u8; 6] = [2, 0, 0, 0, 0, 1];
const ADDR: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 150);

fn machine(timing: Timing) -> Machine {
    Machine::new(Identity::new(MAC), timing, 7)
}

fn no_probe() -> Timing {
    Timing {
        arp_probe: false,
        ..Timing::default()
    }
}

/// The one message sent among `actions`, decoded.
fn sent(actions: &[Action]) -> (Message, Ipv4Addr, Destination) {
    let sends: Vec<_> = actions
        .iter()
        .filter_map(|a| match a {
            Action::Send {
                payload, src, dst, ..
            } => Some((payload, *src, *dst)),
            _ => None,
        })
        .collect();
    assert_eq!(sends.len(), 1, "expected one message in {actions:?}");
    let (p, src, dst) = sends[0];
    (Message::decode(&mut Decoder::new(p)).unwrap(), src, dst)
}

fn no_send(actions: &[Action]) {
    assert!(
        !actions.iter().any(|a| matches!(a, Action::Send { .. })),
        "unexpected send in {actions:?}"
    );
}

fn timer(actions: &[Action]) -> Instant {
    actions
        .iter()
        .rev()
        .find_map(|a| match a {
            Action::SetTimer(t) => Some(*t),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no timer in {actions:?}"))
}

fn opt(m: &Message, code: OptionCode) -> Option<DhcpOption> {
    m.opts().get(code).cloned()
}

fn lease_opts(lease: u32, t1: Option<u32>, t2: Option<u32>) -> Vec<DhcpOption> {
    let mut v = vec![
        DhcpOption::ServerIdentifier(SRV),
        DhcpOption::AddressLeaseTime(lease),
        DhcpOption::SubnetMask(Ipv4Addr::new(255, 255, 255, 0)),
        DhcpOption::Router(vec![SRV]),
    ];
    v.extend(t1.map(DhcpOption::Renewal));
    v.extend(t2.map(DhcpOption::Rebinding));
    v
}

fn reply(m: &Machine, ty: MessageType, extra: &[DhcpOption]) -> Vec<u8> {
    let yi = if ty == MessageType::Nak {
        Ipv4Addr::UNSPECIFIED
    } else {
        ADDR
    };
    build_reply(ty, m.xid(), MAC, yi, extra)
}

fn feed(m: &mut Machine, bytes: &[u8]) -> Vec<Action> {
    m.handle(
        Instant::now(),
        Event::Received {
            payload: bytes,
            src_mac: SRV_MAC,
        },
    )
}

fn fire(m: &mut Machine) -> Vec<Action> {
    m.handle(Instant::now(), Event::Timer)
}

/// After a first NAK: INIT, a timer within the restart spread, then a
/// DISCOVER without the refused address.
async fn restarts_after_nak(m: &mut Machine, after_nak: &[Action]) {
    no_send(after_nak);
    assert_eq!(m.state(), State::Init);
    let wait = timer(after_nak) - Instant::now();
    assert!(wait <= NAK_RESTART_SPREAD, "{wait:?}");
    advance(wait).await;
    let a = fire(m);
    let (d, _, _) = sent(&a);
    assert_eq!(d.opts().msg_type(), Some(MessageType::Discover));
    assert!(opt(&d, OptionCode::RequestedIpAddress).is_none());
    assert_eq!(m.state(), State::Selecting);
}

/// Runs DISCOVER/OFFER/REQUEST/ACK with a 120 s lease, T1 20 s, T2 35 s.
fn bound(timing: Timing) -> Machine {
    let mut m = machine(timing);
    m.handle(Instant::now(), Event::Start { stored: None });
    let offer = reply(&m, MessageType::Offer, &lease_opts(120, Some(20), Some(35)));
    feed(&mut m, &offer);
    let ack = reply(&m, MessageType::Ack, &lease_opts(120, Some(20), Some(35)));
    let a = feed(&mut m, &ack);
    if m.state() == State::Checking {
        m.handle(
            Instant::now(),
            Event::ProbeResult {
                address: ADDR,
                conflict: false,
            },
        );
    } else {
        assert!(a.contains(&Action::ArpAnnounce(ADDR)));
    }
    assert_eq!(m.state(), State::Bound);
    m
}

#[tokio::test(start_paused = true)]
async fn full_exchange_with_probe() {
    let mut m = machine(Timing::default());
    let t0 = Instant::now();
    let a = m.handle(t0, Event::Start { stored: None });
    let (d, src, dst) = sent(&a);
    assert_eq!(d.opts().msg_type(), Some(MessageType::Discover));
    assert_eq!((src, dst), (Ipv4Addr::UNSPECIFIED, Destination::Broadcast));
    assert_eq!(d.chaddr(), &MAC);
    assert!(
        !d.flags().broadcast(),
        "replies must come as unicast frames"
    );
    assert_eq!(
        opt(&d, OptionCode::ClientIdentifier),
        Some(DhcpOption::ClientIdentifier(vec![
            1, 0, 0, 0x6c, 0xaa, 0xbb, 0xcc
        ]))
    );
    let t = timer(&a) - t0;
    assert!(
        t >= Duration::from_secs(3) && t <= Duration::from_secs(5),
        "{t:?}"
    );
    assert_eq!(m.state(), State::Selecting);

    advance(Duration::from_millis(5)).await;
    let offer = reply(&m, MessageType::Offer, &lease_opts(120, Some(20), Some(35)));
    let a = feed(&mut m, &offer);
    let (r, _, dst) = sent(&a);
    assert_eq!(r.opts().msg_type(), Some(MessageType::Request));
    assert_eq!(r.xid(), d.xid());
    assert_eq!(dst, Destination::Broadcast);
    assert_eq!(
        opt(&r, OptionCode::RequestedIpAddress),
        Some(DhcpOption::RequestedIpAddress(ADDR))
    );
    assert_eq!(
        opt(&r, OptionCode::ServerIdentifier),
        Some(DhcpOption::ServerIdentifier(SRV))
    );
    assert_eq!(r.ciaddr(), Ipv4Addr::UNSPECIFIED);
    let requested_at = Instant::now();

    advance(Duration::from_millis(5)).await;
    let ack = reply(&m, MessageType::Ack, &lease_opts(120, Some(20), Some(35)));
    let a = feed(&mut m, &ack);
    assert_eq!(a[0], Action::ArpProbe(ADDR));
    assert_eq!(m.state(), State::Checking);
    no_send(&a);

    advance(Duration::from_millis(200)).await;
    let a = m.handle(
        Instant::now(),
        Event::ProbeResult {
            address: ADDR,
            conflict: false,
        },
    );
    assert!(a.contains(&Action::ConfigureAddress {
        address: ADDR,
        prefix_len: 24
    }));
    assert!(a.contains(&Action::ArpAnnounce(ADDR)));
    assert!(
        a.iter()
            .any(|x| matches!(x, Action::Persist(l) if l.address == ADDR))
    );
    assert!(a.contains(&Action::StateChanged {
        from: State::Checking,
        to: State::Bound
    }));
    // T1 counts from when the REQUEST was sent.
    assert_eq!(timer(&a), requested_at + Duration::from_secs(20));
    let l = m.lease().unwrap();
    assert_eq!((l.server_id, l.server_mac), (SRV, SRV_MAC));
    assert_eq!(l.expires_at(), requested_at + Duration::from_secs(120));
    assert_eq!(m.counters().sent, 2);
    assert_eq!(m.counters().received, 2);
    assert_eq!(m.counters().dropped, 0);
}

#[tokio::test(start_paused = true)]
async fn discover_backoff_doubles_to_the_cap_and_never_gives_up() {
    let mut m = machine(Timing::default());
    let a = m.handle(Instant::now(), Event::Start { stored: None });
    let mut deadline = timer(&a);
    let mut intervals = Vec::new();
    let mut xids = vec![m.xid()];
    for _ in 0..12 {
        let before = Instant::now();
        advance(deadline - before).await;
        let a = fire(&mut m);
        let (d, _, _) = sent(&a);
        assert_eq!(d.opts().msg_type(), Some(MessageType::Discover));
        xids.push(d.xid());
        intervals.push((deadline - before).as_secs_f64());
        deadline = timer(&a);
    }
    let expected = [4.0, 8.0, 16.0, 32.0, 64.0, 64.0, 64.0, 64.0];
    for (got, want) in intervals.iter().zip(expected) {
        assert!((got - want).abs() <= 1.0, "{intervals:?}");
    }
    // Jitter is real: not all intervals are exact.
    assert!(intervals.iter().any(|i| i.fract() != 0.0), "{intervals:?}");
    // Same xid while backing off to the cap, fresh ones after it.
    assert!(xids[..5].iter().all(|x| *x == xids[0]), "{xids:?}");
    assert_ne!(xids[5], xids[4]);
    assert_ne!(xids[6], xids[5]);
    assert_eq!(m.state(), State::Selecting);
}

#[tokio::test(start_paused = true)]
async fn requesting_falls_back_to_discovery_after_the_cap() {
    let mut m = machine(no_probe());
    m.handle(Instant::now(), Event::Start { stored: None });
    let offer = reply(&m, MessageType::Offer, &lease_opts(120, None, None));
    let a = feed(&mut m, &offer);
    let xid = m.xid();
    let mut deadline = timer(&a);
    let mut kinds = Vec::new();
    for _ in 0..5 {
        advance(deadline - Instant::now()).await;
        let a = fire(&mut m);
        let (msg, _, _) = sent(&a);
        kinds.push((msg.opts().msg_type().unwrap(), msg.xid() == xid));
        deadline = timer(&a);
    }
    use MessageType::*;
    assert_eq!(
        kinds,
        vec![
            (Request, true),
            (Request, true),
            (Request, true),
            (Request, true),
            (Discover, false)
        ]
    );
    assert_eq!(m.state(), State::Selecting);
    // 4 + 8 + 16 + 32 + 64 s (± jitter) after the first REQUEST, and the
    // discovery continues at the cap.
    let gap = deadline - Instant::now();
    assert!(gap >= Duration::from_secs(63), "{gap:?}");
}

#[tokio::test(start_paused = true)]
async fn renew_unicast_then_rebind_broadcast_then_expiry() {
    let mut m = bound(Timing {
        renew_floor: Duration::from_secs(1),
        ..no_probe()
    });
    let acquired = m.lease().unwrap().acquired;
    advance(Duration::from_secs(20)).await;
    let a = fire(&mut m);
    assert_eq!(m.state(), State::Renewing);
    let (r, src, dst) = sent(&a);
    assert_eq!(r.opts().msg_type(), Some(MessageType::Request));
    assert_eq!(r.ciaddr(), ADDR);
    assert_eq!(src, ADDR);
    assert_eq!(
        dst,
        Destination::Unicast {
            ip: SRV,
            mac: SRV_MAC
        }
    );
    assert!(opt(&r, OptionCode::RequestedIpAddress).is_none());
    assert!(opt(&r, OptionCode::ServerIdentifier).is_none());
    // Half of the 15 s left to T2.
    assert_eq!(timer(&a), Instant::now() + Duration::from_millis(7500));

    let mut deadline = timer(&a);
    let t2 = acquired + Duration::from_secs(35);
    while deadline < t2 {
        advance(deadline - Instant::now()).await;
        let a = fire(&mut m);
        let (_, _, dst) = sent(&a);
        assert!(matches!(dst, Destination::Unicast { .. }));
        deadline = timer(&a);
    }
    assert_eq!(deadline, t2);
    advance(deadline - Instant::now()).await;
    let a = fire(&mut m);
    assert_eq!(m.state(), State::Rebinding);
    let (r, src, dst) = sent(&a);
    assert_eq!((src, dst), (ADDR, Destination::Broadcast));
    assert_eq!(r.ciaddr(), ADDR);

    let expiry = acquired + Duration::from_secs(120);
    let mut deadline = timer(&a);
    while deadline < expiry {
        advance(deadline - Instant::now()).await;
        let a = fire(&mut m);
        assert!(!a.iter().any(|x| matches!(x, Action::RemoveAddress(_))));
        deadline = timer(&a);
    }
    advance(deadline - Instant::now()).await;
    let a = fire(&mut m);
    assert_eq!(a[0], Action::RemoveAddress(ADDR));
    let (d, _, _) = sent(&a);
    assert_eq!(d.opts().msg_type(), Some(MessageType::Discover));
    // Ask for the old address back.
    assert_eq!(
        opt(&d, OptionCode::RequestedIpAddress),
        Some(DhcpOption::RequestedIpAddress(ADDR))
    );
    assert_eq!(m.state(), State::Selecting);
    assert!(m.lease().is_none());
}

#[tokio::test(start_paused = true)]
async fn renew_floor_is_respected() {
    // Default floor 60 s: with 15 s between T1 and T2 the only renew
    // retransmission is at T2 itself.
    let mut m = bound(no_probe());
    let acquired = m.lease().unwrap().acquired;
    advance(Duration::from_secs(20)).await;
    let a = fire(&mut m);
    assert_eq!(timer(&a), acquired + Duration::from_secs(35));
}

#[tokio::test(start_paused = true)]
async fn ack_while_renewing_extends_without_reconfiguring() {
    let mut m = bound(no_probe());
    advance(Duration::from_secs(20)).await;
    fire(&mut m);
    advance(Duration::from_millis(3)).await;
    let renewed_at = Instant::now();
    let ack = reply(&m, MessageType::Ack, &lease_opts(120, Some(20), Some(35)));
    let a = feed(&mut m, &ack);
    assert_eq!(m.state(), State::Bound);
    assert!(
        !a.iter()
            .any(|x| matches!(x, Action::ConfigureAddress { .. }))
    );
    assert!(a.iter().any(|x| matches!(x, Action::Persist(_))));
    let t1 = timer(&a);
    assert!(
        t1 > renewed_at + Duration::from_secs(19),
        "T1 moved forward"
    );
}

#[tokio::test(start_paused = true)]
async fn nak_while_renewing_removes_the_address_and_rediscovers() {
    let mut m = bound(no_probe());
    advance(Duration::from_secs(20)).await;
    fire(&mut m);
    let nak = reply(&m, MessageType::Nak, &[DhcpOption::ServerIdentifier(SRV)]);
    let a = feed(&mut m, &nak);
    assert_eq!(a[0], Action::RemoveAddress(ADDR));
    assert!(a.contains(&Action::Forget));
    restarts_after_nak(&mut m, &a).await;
    assert_eq!(m.counters().naks, 1);

    // A second NAK in a row (now in REQUESTING) waits longer.
    let offer = reply(&m, MessageType::Offer, &lease_opts(120, None, None));
    feed(&mut m, &offer);
    let nak = reply(&m, MessageType::Nak, &[DhcpOption::ServerIdentifier(SRV)]);
    let a = feed(&mut m, &nak);
    no_send(&a);
    assert_eq!(m.state(), State::Init);
    let wait = timer(&a) - Instant::now();
    assert!(
        (Duration::from_millis(200)..=Duration::from_millis(400)).contains(&wait),
        "{wait:?}"
    );
    advance(wait).await;
    let a = fire(&mut m);
    assert_eq!(sent(&a).0.opts().msg_type(), Some(MessageType::Discover));
}

/// Leases NAKed together (a server offered one address to all of them)
/// must not retry together: the first restart waits a random moment within
/// the spread, later ones a random time in the upper half of a growing
/// backoff.
#[tokio::test(start_paused = true)]
async fn repeated_naks_back_off_with_spread_waits() {
    let mut first_waits = Vec::new();
    let mut second_waits = Vec::new();
    for seed in 0..20u64 {
        let mut m = Machine::new(Identity::new(MAC), no_probe(), seed);
        let mut waits = Vec::new();
        m.handle(Instant::now(), Event::Start { stored: None });
        for _ in 0..4 {
            let offer = reply(&m, MessageType::Offer, &lease_opts(120, None, None));
            feed(&mut m, &offer);
            let nak = reply(&m, MessageType::Nak, &[DhcpOption::ServerIdentifier(SRV)]);
            let a = feed(&mut m, &nak);
            assert_eq!(m.state(), State::Init);
            let wait = timer(&a) - Instant::now();
            waits.push(wait);
            advance(wait).await;
            fire(&mut m);
        }
        // NAK 1 waits up to the spread (200 ms); NAKs 2, 3, 4 within the
        // upper half of 400, 800, 1600 ms.
        assert!(waits[0] <= NAK_RESTART_SPREAD, "seed {seed}: {waits:?}");
        for (w, cap) in waits[1..].iter().zip([400u64, 800, 1600]) {
            let ms = w.as_millis() as u64;
            assert!(ms >= cap / 2 && ms <= cap, "seed {seed}: {waits:?}");
        }
        first_waits.push(waits[0]);
        second_waits.push(waits[1]);
    }
    for waits in [&mut first_waits, &mut second_waits] {
        waits.sort();
        waits.dedup();
        assert!(waits.len() >= 15, "waits do not spread: {waits:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn nak_while_rebinding_is_honoured() {
    let mut m = bound(no_probe());
    advance(Duration::from_secs(20)).await;
    fire(&mut m);
    advance(Duration::from_secs(15)).await;
    fire(&mut m);
    assert_eq!(m.state(), State::Rebinding);
    let nak = reply(&m, MessageType::Nak, &[]);
    let a = feed(&mut m, &nak);
    assert_eq!(a[0], Action::RemoveAddress(ADDR));
    restarts_after_nak(&mut m, &a).await;
}

#[tokio::test(start_paused = true)]
async fn replies_that_do_not_fit_are_dropped_and_counted() {
    let mut m = machine(no_probe());
    m.handle(Instant::now(), Event::Start { stored: None });
    let good = reply(&m, MessageType::Offer, &lease_opts(120, None, None));
    // Wrong xid, wrong chaddr, wrong type for SELECTING, a request.
    let wrong_xid = build_reply(
        MessageType::Offer,
        m.xid() ^ 1,
        MAC,
        ADDR,
        &lease_opts(120, None, None),
    );
    let wrong_mac = build_reply(
        MessageType::Offer,
        m.xid(),
        [0, 0, 0x6c, 0, 0, 1],
        ADDR,
        &lease_opts(120, None, None),
    );
    let ack = reply(&m, MessageType::Ack, &lease_opts(120, None, None));
    let mut request = good.clone();
    request[0] = 1;
    let no_server_id = reply(&m, MessageType::Offer, &[]);
    for bad in [&wrong_xid, &wrong_mac, &ack, &request, &no_server_id] {
        let a = feed(&mut m, bad);
        assert!(a.is_empty(), "{a:?}");
        assert_eq!(m.state(), State::Selecting);
    }
    assert_eq!(m.counters().dropped, 5);
    assert_eq!(m.counters().malformed, 1);
    // Truncated, oversized, garbage.
    for bad in [&good[..100], &[0u8; 2000][..], &[0xffu8; 400][..], &[][..]] {
        assert!(feed(&mut m, bad).is_empty());
    }
    assert_eq!(m.counters().malformed, 5);
    assert_eq!(m.counters().received, 9);
    assert!(m.last_drop().unwrap().starts_with("malformed"));
    // The good one still works after all that.
    feed(&mut m, &good);
    assert_eq!(m.state(), State::Requesting);
    // An OFFER in REQUESTING is ignored.
    assert!(feed(&mut m, &good).is_empty());
    assert_eq!(m.state(), State::Requesting);
}

#[tokio::test(start_paused = true)]
async fn probe_conflict_declines_and_waits() {
    let mut m = machine(Timing::default());
    m.handle(Instant::now(), Event::Start { stored: None });
    let offer = reply(&m, MessageType::Offer, &lease_opts(120, None, None));
    feed(&mut m, &offer);
    let ack = reply(&m, MessageType::Ack, &lease_opts(120, None, None));
    feed(&mut m, &ack);
    // A result for another address is ignored.
    assert!(
        m.handle(
            Instant::now(),
            Event::ProbeResult {
                address: Ipv4Addr::new(10, 77, 0, 9),
                conflict: true
            }
        )
        .is_empty()
    );
    let a = m.handle(
        Instant::now(),
        Event::ProbeResult {
            address: ADDR,
            conflict: true,
        },
    );
    let (d, src, dst) = sent(&a);
    assert_eq!(d.opts().msg_type(), Some(MessageType::Decline));
    assert_eq!((src, dst), (Ipv4Addr::UNSPECIFIED, Destination::Broadcast));
    assert_eq!(
        opt(&d, OptionCode::RequestedIpAddress),
        Some(DhcpOption::RequestedIpAddress(ADDR))
    );
    assert_eq!(
        opt(&d, OptionCode::ServerIdentifier),
        Some(DhcpOption::ServerIdentifier(SRV))
    );
    assert!(
        !a.iter()
            .any(|x| matches!(x, Action::ConfigureAddress { .. }))
    );
    assert_eq!(m.state(), State::Init);
    assert_eq!(timer(&a), Instant::now() + Duration::from_secs(10));
    assert_eq!(m.counters().declines, 1);
    advance(Duration::from_secs(10)).await;
    let a = fire(&mut m);
    let (d, _, _) = sent(&a);
    assert_eq!(d.opts().msg_type(), Some(MessageType::Discover));
    assert!(opt(&d, OptionCode::RequestedIpAddress).is_none());
}

fn stored_lease(expires_in: Duration) -> Lease {
    let lease_time = Duration::from_secs(120);
    Lease {
        address: ADDR,
        prefix_len: 24,
        server_id: SRV,
        server_mac: SRV_MAC,
        routers: vec![],
        lease_time,
        t1: Duration::from_secs(20),
        t2: Duration::from_secs(35),
        acquired: Instant::now() + expires_in - lease_time,
    }
}

#[tokio::test(start_paused = true)]
async fn init_reboot_asks_for_the_stored_address() {
    advance(Duration::from_secs(1000)).await;
    let mut m = machine(Timing::default());
    let a = m.handle(
        Instant::now(),
        Event::Start {
            stored: Some(stored_lease(Duration::from_secs(60))),
        },
    );
    assert_eq!(m.state(), State::InitReboot);
    let (r, src, dst) = sent(&a);
    assert_eq!(r.opts().msg_type(), Some(MessageType::Request));
    assert_eq!((src, dst), (Ipv4Addr::UNSPECIFIED, Destination::Broadcast));
    assert_eq!(r.ciaddr(), Ipv4Addr::UNSPECIFIED);
    assert_eq!(
        opt(&r, OptionCode::RequestedIpAddress),
        Some(DhcpOption::RequestedIpAddress(ADDR))
    );
    assert!(opt(&r, OptionCode::ServerIdentifier).is_none());
    // The ACK binds at once (no probe: the address was ours).
    let ack = reply(&m, MessageType::Ack, &lease_opts(120, Some(20), Some(35)));
    let a = feed(&mut m, &ack);
    assert_eq!(m.state(), State::Bound);
    assert!(a.contains(&Action::ConfigureAddress {
        address: ADDR,
        prefix_len: 24
    }));
}

#[tokio::test(start_paused = true)]
async fn init_reboot_nak_removes_and_rediscovers() {
    advance(Duration::from_secs(1000)).await;
    let mut m = machine(no_probe());
    m.handle(
        Instant::now(),
        Event::Start {
            stored: Some(stored_lease(Duration::from_secs(60))),
        },
    );
    let nak = reply(&m, MessageType::Nak, &[]);
    let a = feed(&mut m, &nak);
    assert_eq!(a[0], Action::RemoveAddress(ADDR));
    assert!(a.contains(&Action::Forget));
    restarts_after_nak(&mut m, &a).await;
}

#[tokio::test(start_paused = true)]
async fn init_reboot_without_answer_keeps_a_valid_lease() {
    advance(Duration::from_secs(1000)).await;
    let mut m = machine(no_probe());
    let a = m.handle(
        Instant::now(),
        Event::Start {
            stored: Some(stored_lease(Duration::from_secs(90))),
        },
    );
    let mut deadline = timer(&a);
    for _ in 0..2 {
        advance(deadline - Instant::now()).await;
        let a = fire(&mut m);
        assert_eq!(m.state(), State::InitReboot);
        deadline = timer(&a);
    }
    advance(deadline - Instant::now()).await;
    let a = fire(&mut m);
    no_send(&a);
    assert_eq!(m.state(), State::Bound);
    assert!(a.contains(&Action::ConfigureAddress {
        address: ADDR,
        prefix_len: 24
    }));
    // T1 and T2 of the stored lease (acquired about 58 s ago, T2 35 s)
    // are past: rebind (broadcast) right away.
    assert_eq!(timer(&a), Instant::now());
    let a = fire(&mut m);
    assert_eq!(m.state(), State::Rebinding);
    assert_eq!(sent(&a).2, Destination::Broadcast);
}

#[tokio::test(start_paused = true)]
async fn init_reboot_without_answer_and_expired_lease_rediscovers_same_address() {
    advance(Duration::from_secs(1000)).await;
    let mut m = machine(no_probe());
    let a = m.handle(
        Instant::now(),
        Event::Start {
            stored: Some(stored_lease(Duration::from_secs(5))),
        },
    );
    let mut deadline = timer(&a);
    let mut last = Vec::new();
    for _ in 0..3 {
        advance(deadline - Instant::now()).await;
        last = fire(&mut m);
        deadline = timer(&last);
    }
    let (d, _, _) = sent(&last);
    assert_eq!(d.opts().msg_type(), Some(MessageType::Discover));
    assert_eq!(
        opt(&d, OptionCode::RequestedIpAddress),
        Some(DhcpOption::RequestedIpAddress(ADDR))
    );
}

#[tokio::test(start_paused = true)]
async fn release_stop_sends_release_and_forgets() {
    let mut m = bound(no_probe());
    let a = m.handle(Instant::now(), Event::Stop(StopMode::Release));
    let (r, src, dst) = sent(&a);
    assert_eq!(r.opts().msg_type(), Some(MessageType::Release));
    assert_eq!(r.ciaddr(), ADDR);
    assert_eq!(src, ADDR);
    assert_eq!(
        dst,
        Destination::Unicast {
            ip: SRV,
            mac: SRV_MAC
        }
    );
    assert_eq!(
        opt(&r, OptionCode::ServerIdentifier),
        Some(DhcpOption::ServerIdentifier(SRV))
    );
    assert!(opt(&r, OptionCode::RequestedIpAddress).is_none());
    assert!(a.contains(&Action::RemoveAddress(ADDR)));
    assert!(a.contains(&Action::Forget));
    assert_eq!(m.state(), State::Stopped);
    // Timers after a stop do nothing.
    assert!(fire(&mut m).is_empty());
}

#[tokio::test(start_paused = true)]
async fn handover_stop_sends_nothing_and_keeps_the_file() {
    let mut m = bound(no_probe());
    let a = m.handle(Instant::now(), Event::Stop(StopMode::Handover));
    no_send(&a);
    assert!(a.contains(&Action::RemoveAddress(ADDR)));
    assert!(!a.contains(&Action::Forget));
    assert_eq!(m.state(), State::Stopped);
}

#[tokio::test(start_paused = true)]
async fn announce_on_demand_only_while_holding() {
    let mut m = machine(no_probe());
    m.handle(Instant::now(), Event::Start { stored: None });
    assert!(m.handle(Instant::now(), Event::Announce).is_empty());
    let mut m = bound(no_probe());
    assert_eq!(
        m.handle(Instant::now(), Event::Announce),
        vec![Action::ArpAnnounce(ADDR)]
    );
}

#[tokio::test(start_paused = true)]
async fn early_timer_keeps_the_deadline() {
    let mut m = bound(no_probe());
    let t1 = m.deadline().unwrap();
    advance(Duration::from_secs(5)).await;
    assert_eq!(fire(&mut m), vec![Action::SetTimer(t1)]);
    assert_eq!(m.state(), State::Bound);
}

#[test]
fn t1_t2_from_options_or_defaults() {
    let l = Duration::from_secs(1000);
    let s = Duration::from_secs;
    assert_eq!(timers(l, Some(100), Some(200)), (s(100), s(200)));
    assert_eq!(timers(l, None, None), (s(500), s(875)));
    // Inconsistent options fall back.
    assert_eq!(timers(l, Some(900), Some(800)), (s(500), s(800)));
    assert_eq!(timers(l, Some(100), Some(5000)), (s(100), s(875)));
    assert_eq!(timers(s(0), None, None), (s(0), s(0)));
}

/// kube-vip's `requestedIP` without a lease file: INIT-REBOOT asks for it
/// (option 50, no server id, no ciaddr), and the server's ACK binds it.
#[tokio::test(start_paused = true)]
async fn a_requested_address_is_asked_for_in_init_reboot() {
    let mut m = machine(no_probe()).requesting(Some(ADDR));
    let a = m.handle(Instant::now(), Event::Start { stored: None });
    assert_eq!(m.state(), State::InitReboot);
    let (r, src, dst) = sent(&a);
    assert_eq!(r.opts().msg_type(), Some(MessageType::Request));
    assert_eq!((src, dst), (Ipv4Addr::UNSPECIFIED, Destination::Broadcast));
    assert_eq!(r.ciaddr(), Ipv4Addr::UNSPECIFIED);
    assert_eq!(
        opt(&r, OptionCode::RequestedIpAddress),
        Some(DhcpOption::RequestedIpAddress(ADDR))
    );
    assert!(opt(&r, OptionCode::ServerIdentifier).is_none());
    let ack = reply(&m, MessageType::Ack, &lease_opts(120, None, None));
    let a = feed(&mut m, &ack);
    assert_eq!(m.state(), State::Bound);
    assert_eq!(m.lease().unwrap().address, ADDR);
    assert!(a.iter().any(|x| matches!(x, Action::Persist(_))));
}

/// A server that does not know the binding stays silent (RFC 2131
/// §4.3.2): after the INIT-REBOOT tries, discovery still asks for the
/// address with option 50, and nothing is configured meanwhile.
#[tokio::test(start_paused = true)]
async fn a_requested_address_without_answer_is_asked_for_in_discovery() {
    let mut m = machine(no_probe()).requesting(Some(ADDR));
    let a = m.handle(Instant::now(), Event::Start { stored: None });
    let mut deadline = timer(&a);
    let mut last = Vec::new();
    for _ in 0..Timing::default().init_reboot_tries {
        advance(deadline - Instant::now()).await;
        last = fire(&mut m);
        assert!(
            !last
                .iter()
                .any(|x| matches!(x, Action::ConfigureAddress { .. })),
            "{last:?}"
        );
        deadline = timer(&last);
    }
    assert_eq!(m.state(), State::Selecting);
    let (d, _, _) = sent(&last);
    assert_eq!(d.opts().msg_type(), Some(MessageType::Discover));
    assert_eq!(
        opt(&d, OptionCode::RequestedIpAddress),
        Some(DhcpOption::RequestedIpAddress(ADDR))
    );
}

/// A NAK for the requested address: discovery asks for nothing in
/// particular, and there is nothing to remove.
#[tokio::test(start_paused = true)]
async fn a_refused_requested_address_is_not_asked_for_again() {
    let mut m = machine(no_probe()).requesting(Some(ADDR));
    m.handle(Instant::now(), Event::Start { stored: None });
    let nak = reply(&m, MessageType::Nak, &[]);
    let a = feed(&mut m, &nak);
    assert!(!a.iter().any(|x| matches!(x, Action::RemoveAddress(_))));
    restarts_after_nak(&mut m, &a).await;
}

/// A lease file takes precedence over the requested address.
#[tokio::test(start_paused = true)]
async fn a_stored_lease_wins_over_the_requested_address() {
    advance(Duration::from_secs(1000)).await;
    let other = Ipv4Addr::new(10, 77, 0, 99);
    let mut m = machine(no_probe()).requesting(Some(other));
    let a = m.handle(
        Instant::now(),
        Event::Start {
            stored: Some(stored_lease(Duration::from_secs(60))),
        },
    );
    let (r, _, _) = sent(&a);
    assert_eq!(
        opt(&r, OptionCode::RequestedIpAddress),
        Some(DhcpOption::RequestedIpAddress(ADDR))
    );
}

/// Adoption after a restart: BOUND at once, no message, renewal at the
/// stored T1 (unicast to the stored server).
#[tokio::test(start_paused = true)]
async fn an_adopted_lease_is_bound_without_a_message_and_renews_at_its_t1() {
    advance(Duration::from_secs(1000)).await;
    // 120 s lease with 110 s left: acquired 10 s ago, T1 in 10 s.
    let lease = stored_lease(Duration::from_secs(110));
    let t1 = lease.t1_at();
    let mut m = machine(no_probe());
    let a = m.handle(Instant::now(), Event::Adopt { lease });
    no_send(&a);
    assert_eq!(m.state(), State::Bound);
    assert_eq!(m.lease().unwrap().address, ADDR);
    assert_eq!(timer(&a), t1);
    assert_eq!(t1 - Instant::now(), Duration::from_secs(10));
    assert!(
        !a.iter()
            .any(|x| matches!(x, Action::Persist(_) | Action::Forget))
    );
    advance(t1 - Instant::now()).await;
    let a = fire(&mut m);
    assert_eq!(m.state(), State::Renewing);
    let (r, src, dst) = sent(&a);
    assert_eq!(r.opts().msg_type(), Some(MessageType::Request));
    assert_eq!(r.ciaddr(), ADDR);
    assert_eq!(src, ADDR);
    assert_eq!(
        dst,
        Destination::Unicast {
            ip: SRV,
            mac: SRV_MAC
        }
    );
}

/// Adopted past T2: the first timer goes straight to rebinding
/// (broadcast), as for a BOUND lease that slept through its timers.
#[tokio::test(start_paused = true)]
async fn an_adopted_lease_past_t2_rebinds() {
    advance(Duration::from_secs(1000)).await;
    // 120 s lease with 50 s left: past T2 (35 s).
    let mut m = machine(no_probe());
    let a = m.handle(
        Instant::now(),
        Event::Adopt {
            lease: stored_lease(Duration::from_secs(50)),
        },
    );
    assert_eq!(timer(&a), Instant::now());
    let a = fire(&mut m);
    let (_, _, dst) = sent(&a);
    assert_eq!(dst, Destination::Broadcast);
    assert_eq!(m.state(), State::Rebinding);
}

/// An expired lease is not adopted: INIT-REBOOT for its address.
#[tokio::test(start_paused = true)]
async fn an_expired_lease_is_not_adopted() {
    advance(Duration::from_secs(1000)).await;
    let mut m = machine(no_probe());
    let mut lease = stored_lease(Duration::ZERO);
    lease.acquired -= Duration::from_secs(1);
    let a = m.handle(Instant::now(), Event::Adopt { lease });
    assert_eq!(m.state(), State::InitReboot);
    let (r, _, _) = sent(&a);
    assert_eq!(r.opts().msg_type(), Some(MessageType::Request));
}

/// Issue #22: a server's lease of 0 or 1 s is not taken as given (every
/// lease would renew in a tight loop); it is floored, T1 and T2 with it.
#[tokio::test(start_paused = true)]
async fn a_lease_of_zero_or_one_second_is_floored() {
    for secs in [0, 1] {
        let mut m = machine(no_probe());
        m.handle(Instant::now(), Event::Start { stored: None });
        let offer = reply(&m, MessageType::Offer, &lease_opts(secs, None, None));
        feed(&mut m, &offer);
        let t0 = Instant::now();
        let ack = reply(&m, MessageType::Ack, &lease_opts(secs, None, None));
        let a = feed(&mut m, &ack);
        assert_eq!(m.state(), State::Bound, "{secs} s");
        let lease = m.lease().expect("bound");
        assert_eq!(
            lease.lease_time,
            Duration::from_secs(u64::from(MIN_LEASE_SECS))
        );
        let renew_at = timer(&a) - t0;
        assert!(
            renew_at >= Duration::from_secs(u64::from(MIN_LEASE_SECS) / 2),
            "{secs} s lease: renewal after {renew_at:?}"
        );
    }
}
