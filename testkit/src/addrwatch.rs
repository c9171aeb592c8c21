//! Who holds an address, over time: `ip -o monitor address` in every guest
//! namespace, each event stamped on arrival with one monotonic clock. The
//! kernel reports every IPv4 address added or removed (a deleted link's
//! addresses too), so this is a continuous record, not a sampling: a
//! moment when two guests held the address cannot fall between samples.
//!
//! [`AddressWatch::start`] returns once every monitor is shown to be
//! listening, then reads the guests' current state, so no change is lost
//! between the two.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::net::Ipv4Addr;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// One address event in guest `guest`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddrEvent {
    pub at: Instant,
    pub guest: usize,
    pub added: bool,
    pub addr: Ipv4Addr,
}

pub struct AddressWatch {
    children: Vec<Child>,
    events: Arc<Mutex<Vec<AddrEvent>>>,
    /// Per guest, which of its monitors counts: [`AddressWatch::gone`]
    /// moves it on, so what a deleted guest's monitor still reads (its
    /// agent refreshing address lifetimes in a namespace whose LAN port is
    /// already gone) counts for nothing.
    generations: Generations,
    /// The guests holding each address when the watch started.
    initial: Vec<(usize, Ipv4Addr)>,
    started: Instant,
}

/// `ip -o monitor address` lines: `5: hlb-0a1b inet 10.77.0.150/32 scope
/// global hlb-0a1b ...`, or `Deleted 5: ...` for a removal.
fn parse(line: &str) -> Option<(bool, Ipv4Addr)> {
    let added = !line.trim_start().starts_with("Deleted");
    let mut words = line.split_whitespace();
    words.find(|w| *w == "inet")?;
    let cidr = words.next()?;
    let addr = cidr.split('/').next()?.parse().ok()?;
    Some((added, addr))
}

/// The IPv4 addresses in namespace `ns` now.
fn addresses(ns: &str) -> Result<Vec<Ipv4Addr>> {
    let out = Command::new("ip")
        .args(["-n", ns, "-o", "-4", "addr", "show"])
        .output()
        .context("ip addr show")?;
    if !out.status.success() {
        bail!(
            "ip -n {ns} addr show: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(parse)
        .map(|(_, a)| a)
        .collect())
}

type Generations = Arc<Mutex<std::collections::BTreeMap<usize, u64>>>;

/// `ip -o monitor address` in `ns`, its events recorded as guest `guest`'s
/// while the guest's generation is the one it started in.
fn monitor(
    ns: &str,
    guest: usize,
    events: &Arc<Mutex<Vec<AddrEvent>>>,
    generations: &Generations,
) -> Result<Child> {
    let generation = *generations.lock().unwrap().entry(guest).or_default();
    let generations = generations.clone();
    let mut child = Command::new("ip")
        .args(["-n", ns, "-o", "monitor", "address"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("ip -n {ns} monitor address"))?;
    let out = child.stdout.take().expect("piped");
    let events = events.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            let at = Instant::now();
            if generations.lock().unwrap().get(&guest) != Some(&generation) {
                continue;
            }
            if let Some((added, addr)) = parse(&line) {
                events.lock().unwrap().push(AddrEvent {
                    at,
                    guest,
                    added,
                    addr,
                });
            }
        }
    });
    Ok(child)
}

/// Returns once `ns`'s monitor is shown to be listening. `ip monitor`
/// prints nothing once it has subscribed, so: add a marker address to the
/// guest's loopback until its monitor reports it (an add before the
/// subscription goes unseen: remove it and add it again); from then on it
/// sees everything.
fn handshake(ns: &str, guest: usize, events: &Arc<Mutex<Vec<AddrEvent>>>) -> Result<()> {
    let marker = Ipv4Addr::new(127, 77, 77, 77);
    let ip = |verb: &str| {
        Command::new("ip")
            .args(["-n", ns, "addr", verb, &format!("{marker}/32"), "dev", "lo"])
            .status()
    };
    let handshake_start = Instant::now();
    let seen = || {
        events.lock().unwrap().iter().any(|e: &AddrEvent| {
            e.guest == guest && e.addr == marker && e.added && e.at >= handshake_start
        })
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    'handshake: loop {
        ip("add").context("ip addr add (the monitor handshake)")?;
        let attempt = Instant::now() + Duration::from_millis(200);
        while Instant::now() < attempt {
            if seen() {
                break 'handshake;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        ip("del").context("ip addr del (the monitor handshake)")?;
        if Instant::now() > deadline {
            bail!("ip monitor in {ns} reported nothing within 10 s");
        }
    }
    ip("del").context("ip addr del (the monitor handshake)")?;
    Ok(())
}

impl AddressWatch {
    /// Watches the guest namespaces `guests` (index = guest number).
    pub fn start(guests: &[String]) -> Result<AddressWatch> {
        let events = Arc::new(Mutex::new(Vec::new()));
        let generations = Generations::default();
        let mut children = Vec::new();
        for (guest, ns) in guests.iter().enumerate() {
            children.push(monitor(ns, guest, &events, &generations)?);
        }
        for (guest, ns) in guests.iter().enumerate() {
            handshake(ns, guest, &events)?;
        }
        let started = Instant::now();
        let mut initial = Vec::new();
        for (guest, ns) in guests.iter().enumerate() {
            for a in addresses(ns)? {
                initial.push((guest, a));
            }
        }
        Ok(AddressWatch {
            children,
            events,
            generations,
            initial,
            started,
        })
    }

    /// Guest `guest` is back in namespace `ns` (a new guest in the place of
    /// one that is [`gone`](Self::gone)): watched again from now on, with
    /// what it holds already counted as added now.
    pub fn rewatch(&mut self, guest: usize, ns: &str) -> Result<()> {
        self.children
            .push(monitor(ns, guest, &self.events, &self.generations)?);
        handshake(ns, guest, &self.events)?;
        let at = Instant::now();
        let held = addresses(ns)?;
        let mut events = self.events.lock().unwrap();
        for addr in held {
            events.push(AddrEvent {
                at,
                guest,
                added: true,
                addr,
            });
        }
        Ok(())
    }

    /// Guest `guest` is gone (its namespace deleted, so its monitor too):
    /// from `at` on it holds nothing.
    pub fn gone(&self, guest: usize, at: Instant) {
        *self.generations.lock().unwrap().entry(guest).or_default() += 1;
        let mut events = self.events.lock().unwrap();
        // What its monitor read after `at`, before the line above.
        events.retain(|e| !(e.guest == guest && e.at >= at));
        let held: BTreeSet<Ipv4Addr> = self
            .initial
            .iter()
            .filter(|(g, _)| *g == guest)
            .map(|(_, a)| *a)
            .chain(events.iter().filter(|e| e.guest == guest).map(|e| e.addr))
            .collect();
        for addr in held {
            events.push(AddrEvent {
                at,
                guest,
                added: false,
                addr,
            });
        }
    }

    /// Who held `addr` from the start on: each change as (when, holders
    /// after it), the first entry being the state at the start.
    pub fn holders(&self, addr: Ipv4Addr) -> Vec<(Instant, BTreeSet<usize>)> {
        let mut now: BTreeSet<usize> = self
            .initial
            .iter()
            .filter(|(_, a)| *a == addr)
            .map(|(g, _)| *g)
            .collect();
        let mut out = vec![(self.started, now.clone())];
        let mut events = self.events.lock().unwrap().clone();
        events.sort_by_key(|e| e.at);
        for e in events
            .iter()
            .filter(|e| e.addr == addr && e.at >= self.started)
        {
            let changed = if e.added {
                now.insert(e.guest)
            } else {
                now.remove(&e.guest)
            };
            if changed {
                out.push((e.at, now.clone()));
            }
        }
        out
    }

    /// Every guest that held `addr` at some moment of `[from, to]`.
    pub fn held_by_in(&self, addr: Ipv4Addr, from: Instant, to: Instant) -> BTreeSet<usize> {
        let changes = self.holders(addr);
        let mut out = BTreeSet::new();
        for (k, (at, h)) in changes.iter().enumerate() {
            let until = changes.get(k + 1).map(|(next, _)| *next);
            // This state lasted [at, until): does it meet [from, to]?
            if *at <= to && until.is_none_or(|u| u > from) {
                out.extend(h.iter().copied());
            }
        }
        out
    }

    /// The first moment after `after` when `addr` was held by a guest
    /// other than `not`.
    pub fn taken_by_other(
        &self,
        addr: Ipv4Addr,
        not: usize,
        after: Instant,
    ) -> Option<(Instant, usize)> {
        self.holders(addr)
            .into_iter()
            .filter(|(at, _)| *at >= after)
            .find_map(|(at, h)| h.iter().find(|g| **g != not).map(|g| (at, *g)))
    }

    /// Every moment two or more guests held `addr`.
    pub fn overlaps(&self, addr: Ipv4Addr) -> Vec<(Instant, BTreeSet<usize>)> {
        self.holders(addr)
            .into_iter()
            .filter(|(_, h)| h.len() > 1)
            .collect()
    }
}

impl Drop for AddressWatch {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn monitor_lines_parse() {
        assert_eq!(
            parse(
                "7: hlb-0a1b2c3d    inet 10.77.0.150/32 scope global hlb-0a1b2c3d\\       valid_lft forever preferred_lft forever"
            ),
            Some((true, Ipv4Addr::new(10, 77, 0, 150)))
        );
        assert_eq!(
            parse("Deleted 7: hlb-0a1b2c3d    inet 10.77.0.150/32 scope global hlb-0a1b2c3d"),
            Some((false, Ipv4Addr::new(10, 77, 0, 150)))
        );
        assert_eq!(
            parse("7: hlb-0a1b2c3d    inet6 fe80::1/64 scope link"),
            None
        );
        assert_eq!(parse("garbage"), None);
    }

    #[test]
    fn held_by_in_names_every_holder_that_meets_the_window() {
        let a = Ipv4Addr::new(10, 77, 0, 150);
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let event = |ms, guest, added| AddrEvent {
            at: at(ms),
            guest,
            added,
            addr: a,
        };
        // Guest 0 from the start to 1 s, guest 1 from 3 s to 4 s, guest 2
        // from 6 s on.
        let w = AddressWatch {
            children: Vec::new(),
            generations: Generations::default(),
            events: Arc::new(Mutex::new(vec![
                event(1_000, 0, false),
                event(3_000, 1, true),
                event(4_000, 1, false),
                event(6_000, 2, true),
            ])),
            initial: vec![(0, a)],
            started: t0,
        };
        let set = |g: &[usize]| g.iter().copied().collect::<BTreeSet<usize>>();
        assert_eq!(w.held_by_in(a, at(0), at(500)), set(&[0]));
        assert_eq!(w.held_by_in(a, at(1_500), at(2_500)), set(&[]));
        assert_eq!(w.held_by_in(a, at(500), at(3_500)), set(&[0, 1]));
        assert_eq!(w.held_by_in(a, at(4_500), at(9_000)), set(&[2]));
        assert_eq!(w.held_by_in(a, at(0), at(9_000)), set(&[0, 1, 2]));
        assert_eq!(
            w.held_by_in(Ipv4Addr::new(10, 77, 0, 151), at(0), at(9_000)),
            set(&[])
        );
    }
}
