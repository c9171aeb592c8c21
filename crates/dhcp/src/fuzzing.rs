//! The receive path as one function of untrusted bytes, shared by the
//! cargo-fuzz target (`fuzz/`) and a bounded stable-Rust harness that runs
//! with the unit tests (so CI exercises it without nightly).

use std::net::Ipv4Addr;
use std::time::Duration;

use dhcproto::v4::{DhcpOption, MessageType};
use tokio::time::Instant;

use super::frame;
use super::machine::{Event, Lease, Machine, State, Timing};
use super::packet::{self, Identity};

const MAC: [u8; 6] = [0, 0, 0x6c, 0xf0, 0x0f, 0x01];

/// Machines in every state that accepts packets.
fn machines() -> Vec<Machine> {
    let now = Instant::now();
    let timing = Timing {
        arp_probe: false,
        ..Timing::default()
    };
    let mut out = Vec::new();
    let mut selecting = Machine::new(Identity::new(MAC), timing.clone(), 1);
    selecting.handle(now, Event::Start { stored: None });
    out.push(selecting);

    let mut requesting = Machine::new(Identity::new(MAC), timing.clone(), 2);
    requesting.handle(now, Event::Start { stored: None });
    let offer = packet::build_reply(
        MessageType::Offer,
        requesting.xid(),
        MAC,
        Ipv4Addr::new(10, 0, 0, 5),
        &[DhcpOption::ServerIdentifier(Ipv4Addr::new(10, 0, 0, 1))],
    );
    requesting.handle(
        now,
        Event::Received {
            payload: &offer,
            src_mac: [2; 6],
        },
    );
    out.push(requesting);

    let stored = Lease {
        address: Ipv4Addr::new(10, 0, 0, 5),
        prefix_len: 24,
        server_id: Ipv4Addr::new(10, 0, 0, 1),
        server_mac: [2; 6],
        routers: vec![],
        lease_time: Duration::from_secs(100),
        t1: Duration::ZERO,
        t2: Duration::from_secs(90),
        acquired: now,
    };
    let mut reboot = Machine::new(Identity::new(MAC), timing.clone(), 3);
    reboot.handle(
        now,
        Event::Start {
            stored: Some(stored.clone()),
        },
    );
    out.push(reboot);
    out
}

/// Feeds `data` to the frame parser, the DHCP parser and every machine
/// (once as is, once with xid and chaddr patched to fit, so the state
/// logic is reached). Panics only on a bug.
pub fn exercise(data: &[u8]) {
    let _ = frame::parse_udp(data, true);
    let _ = frame::parse_udp(data, false);
    let _ = frame::parse_arp(data);
    let _ = packet::parse_reply(data);
    for mut m in machines() {
        let before = m.counters();
        m.handle(
            Instant::now(),
            Event::Received {
                payload: data,
                src_mac: [2; 6],
            },
        );
        assert_eq!(m.counters().received, before.received + 1);
        let mut fitted = data.to_vec();
        if fitted.len() >= 34 {
            fitted[4..8].copy_from_slice(&m.xid().to_be_bytes());
            fitted[28..34].copy_from_slice(&MAC);
        }
        let actions = m.handle(
            Instant::now(),
            Event::Received {
                payload: &fitted,
                src_mac: [2; 6],
            },
        );
        // Whatever happened, the machine is in a sane state.
        if m.state().holds_address() {
            assert!(m.lease().is_some());
        }
        if m.state() == State::Stopped {
            panic!("a packet stopped the machine: {actions:?}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seeds() -> Vec<Vec<u8>> {
        let opts = [
            DhcpOption::ServerIdentifier(Ipv4Addr::new(10, 0, 0, 1)),
            DhcpOption::AddressLeaseTime(100),
            DhcpOption::Renewal(10),
            DhcpOption::Rebinding(20),
            DhcpOption::SubnetMask(Ipv4Addr::new(255, 255, 255, 0)),
            DhcpOption::Router(vec![Ipv4Addr::new(10, 0, 0, 1)]),
        ];
        let mut v = Vec::new();
        for ty in [MessageType::Offer, MessageType::Ack, MessageType::Nak] {
            let p = packet::build_reply(ty, 1, MAC, Ipv4Addr::new(10, 0, 0, 5), &opts);
            v.push(frame::build_udp(
                Ipv4Addr::new(10, 0, 0, 1),
                Ipv4Addr::BROADCAST,
                &p,
            ));
            v.push(p);
        }
        v
    }

    /// Bounded stand-in for `cargo fuzz` on stable: 30 000 mutated and
    /// random inputs (fixed seed, so failures reproduce).
    #[test]
    fn mutated_and_random_packets_never_panic() {
        let mut rng = fastrand::Rng::with_seed(0x5eed);
        let seeds = seeds();
        for i in 0..30_000 {
            let mut p = seeds[rng.usize(..seeds.len())].clone();
            match i % 6 {
                0 => {
                    for _ in 0..rng.usize(1..8) {
                        let at = rng.usize(..p.len());
                        p[at] ^= 1 << rng.u8(..8);
                    }
                }
                1 => p.truncate(rng.usize(..p.len())),
                2 => {
                    // Random option bytes after the cookie (overload,
                    // lengths, END or not).
                    p.truncate(240.min(p.len()));
                    for _ in 0..rng.usize(0..80) {
                        p.push(
                            *rng.choice(&[0u8, 1, 3, 51, 52, 53, 54, 58, 59, 255, 4, 2, 1])
                                .unwrap(),
                        );
                    }
                }
                3 => p.extend((0..rng.usize(0..1600)).map(|_| rng.u8(..))),
                4 => p = (0..rng.usize(0..600)).map(|_| rng.u8(..)).collect(),
                _ => {
                    let at = rng.usize(..p.len());
                    p[at] = rng.u8(..);
                }
            }
            exercise(&p);
        }
    }
}
