//! What a learning switch of the rig (a Linux bridge) learns, as it learns
//! it: `bridge monitor fdb` in the bridge's namespace, each event kept with
//! when the test read it. A MAC that moves to another port is an event
//! naming the new port, so "when did the switch start sending this MAC to
//! the new host" is read from the switch itself, not from either end.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::rig::process::run_args;

/// A MAC no host uses, for the start-up handshake.
const PROBE_MAC: &str = "02:00:5e:10:fd:b0";

type Events = Arc<Mutex<Vec<(Instant, String)>>>;

pub struct FdbWatch {
    child: Child,
    events: Events,
    reader: Option<JoinHandle<()>>,
}

impl FdbWatch {
    /// Starts watching the forwarding database of the bridges in namespace
    /// `ns`, and returns once the watch is shown to run: a static entry
    /// for a made-up MAC is added on `port` (a port of a bridge there),
    /// seen, and deleted again.
    pub fn start(ns: &str, port: &str) -> Result<FdbWatch> {
        let mut child = Command::new("ip")
            .args(["netns", "exec", ns, "bridge", "monitor", "fdb"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("bridge monitor fdb (iproute2)")?;
        let out = child.stdout.take().context("the monitor's output")?;
        let events: Events = Arc::default();
        let sink = events.clone();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                sink.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push((Instant::now(), line));
            }
        });
        let watch = FdbWatch {
            child,
            events,
            reader: Some(reader),
        };
        let fdb = |verb: &str| {
            run_args(
                "ip",
                [
                    "netns", "exec", ns, "bridge", "fdb", verb, PROBE_MAC, "dev", port, "master",
                    "static",
                ],
            )
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut seen = false;
        while !seen && Instant::now() < deadline {
            let _ = fdb("replace");
            seen = crate::lb::wait_for(Duration::from_millis(500), || {
                watch
                    .events()
                    .iter()
                    .any(|(_, l)| l.contains(PROBE_MAC))
                    .then_some(())
            })
            .is_some();
        }
        let _ = fdb("del");
        if !seen {
            bail!("bridge monitor fdb in {ns} showed no event within 10 s");
        }
        Ok(watch)
    }

    /// Every event so far, with when it was read.
    pub fn events(&self) -> Vec<(Instant, String)> {
        self.events
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// When the switch first learned `mac` (`aa:bb:…`, lowercase) on
    /// `port` at or after `after`.
    pub fn learned(&self, mac: &str, port: &str, after: Instant) -> Option<Instant> {
        let on = format!("{mac} dev {port} ");
        self.events()
            .into_iter()
            .find(|(t, l)| *t >= after && !l.starts_with("Deleted") && l.contains(&on))
            .map(|(t, _)| t)
    }

    /// The ports of bridge `master` on which `mac` was learned at or after
    /// `after`, each with when, in order: where the switch sent that MAC's
    /// traffic from then on.
    pub fn moves(&self, mac: &str, master: &str, after: Instant) -> Vec<(Instant, String)> {
        let master = format!(" master {master} ");
        self.events()
            .into_iter()
            .filter(|(t, l)| {
                *t >= after
                    && !l.starts_with("Deleted")
                    && l.starts_with(mac)
                    && format!("{l} ").contains(&master)
            })
            .filter_map(|(t, l)| {
                let port = l.split_whitespace().skip_while(|w| *w != "dev").nth(1)?;
                Some((t, port.to_string()))
            })
            .collect()
    }
}

impl Drop for FdbWatch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}
