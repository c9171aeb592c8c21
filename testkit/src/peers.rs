//! The peers this project is measured beside, run in the rig as plain
//! processes (issue #19): kube-vip in DHCP mode, one `kube-vip manager` per
//! guest namespace, against the same LAN, DHCP server and API server as our
//! agents.
//!
//! They are built from the Go module proxy by `tests/rig/peers.sh` and
//! cached by version outside the checkout ([`PEERS_DIR`]); nothing of
//! their code is in this repository.

use std::fs;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::lb::LbRig;

pub use crate::locate::peers::{INSTALL, KUBE_VIP_VERSION, METALLB_VERSION, PEERS_DIR};

/// kube-vip's leader-election timings (seconds): per Service, the holder
/// renews a Lease; another instance takes over when it expires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseTimings {
    pub duration: u32,
    pub renew_deadline: u32,
    pub retry_period: u32,
}

impl LeaseTimings {
    /// kube-vip's defaults (`vip_leaseduration` 15, `vip_renewdeadline`
    /// 10, `vip_retryperiod` 2).
    pub const DEFAULT: LeaseTimings = LeaseTimings {
        duration: 15,
        renew_deadline: 10,
        retry_period: 2,
    };
    /// What kube-vip's own manifests and end-to-end tests run with (5, 3,
    /// 1), the tuning its users are pointed at.
    pub const TUNED: LeaseTimings = LeaseTimings {
        duration: 5,
        renew_deadline: 3,
        retry_period: 1,
    };
}

/// One `kube-vip manager` per guest, in DHCP mode (a Service asking for
/// `0.0.0.0`), ARP, with per-Service leader election, as the Harvester
/// cloud provider's chart runs it. Killed when dropped.
pub struct KubeVip {
    bin: PathBuf,
    timings: LeaseTimings,
    procs: Vec<Option<Child>>,
    logs: PathBuf,
}

impl KubeVip {
    pub fn new(lb: &LbRig, timings: LeaseTimings) -> Result<KubeVip> {
        let bin = crate::locate::peers::kube_vip()
            .map_err(|what| anyhow::anyhow!("{what}: build and cache it with `{INSTALL}`"))?;
        let logs = lb.rig.dir().join("kube-vip");
        fs::create_dir_all(&logs)?;
        Ok(KubeVip {
            bin,
            timings,
            procs: (0..lb.rig.guest_namespaces().len()).map(|_| None).collect(),
            logs,
        })
    }

    fn log_path(&self, i: usize) -> PathBuf {
        self.logs.join(format!("guest-{i}.log"))
    }

    /// The tail of guest `i`'s kube-vip log.
    pub fn log_tail(&self, i: usize, lines: usize) -> String {
        let text = fs::read_to_string(self.log_path(i)).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Starts kube-vip in guest `i`, as node `lb.node_name(i)`, with the
    /// admin kubeconfig (the chart's ClusterRole is wider than any test
    /// needs), on `eth0`, metrics off.
    pub fn start(&mut self, lb: &LbRig, i: usize) -> Result<()> {
        if self.procs[i].is_some() {
            bail!("kube-vip already runs in guest {i}");
        }
        let api = lb.rig.apiserver().context("API server")?;
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path(i))?;
        let t = self.timings;
        let child = lb
            .rig
            .netns_cmd(lb.rig.guest_ns(i), &self.bin)
            .args(["manager", "--prometheusHTTPServer="])
            .env("vip_arp", "true")
            .env("vip_interface", "eth0")
            .env("svc_enable", "true")
            .env("svc_election", "true")
            .env("vip_nodename", lb.node_name(i))
            .env("k8s_config_file", api.admin_kubeconfig())
            .env("vip_leaseduration", t.duration.to_string())
            .env("vip_renewdeadline", t.renew_deadline.to_string())
            .env("vip_retryperiod", t.retry_period.to_string())
            .env("vip_loglevel", "0")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", self.bin.display()))?;
        self.procs[i] = Some(child);
        Ok(())
    }

    /// An error with its log's tail for every instance that exited on its
    /// own (kube-vip exits on a bad setting or a lost API): what a test
    /// that timed out waiting on kube-vip says first.
    pub fn check_running(&mut self) -> Result<()> {
        let mut dead = Vec::new();
        for i in 0..self.procs.len() {
            if let Some(st) = self.procs[i]
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                self.procs[i] = None;
                dead.push(format!(
                    "kube-vip in guest {i} exited ({st}):\n{}",
                    self.log_tail(i, 30)
                ));
            }
        }
        if dead.is_empty() {
            Ok(())
        } else {
            bail!("{}", dead.join("\n"))
        }
    }

    /// Starts kube-vip in every guest.
    pub fn start_all(&mut self, lb: &LbRig) -> Result<()> {
        for i in 0..self.procs.len() {
            self.start(lb, i)?;
        }
        Ok(())
    }

    /// Guest `i`'s kube-vip's pid, while it runs (`ip netns exec` execs it).
    pub fn pid(&self, i: usize) -> Option<u32> {
        self.procs.get(i)?.as_ref().map(|c| c.id())
    }

    /// Sends `signal` and waits (up to 20 s) for it to exit; SIGKILL after
    /// that.
    pub fn stop(&mut self, i: usize, signal: Signal) {
        let Some(mut child) = self.procs[i].take() else {
            return;
        };
        let _ = kill(Pid::from_raw(child.id() as i32), signal);
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!("kube-vip in guest {i} ignored {signal} for 20 s: SIGKILL");
        let _ = child.kill();
        let _ = child.wait();
    }

    /// Stops every instance at once with SIGTERM, as a DaemonSet's pods are
    /// stopped when it is deleted, and waits (up to 20 s, then SIGKILL) for
    /// all of them. One at a time, the ones still running would take over
    /// the stopped ones' Services, each with its own MAC and lease.
    pub fn stop_all(&mut self) {
        for c in self.procs.iter().flatten() {
            let _ = kill(Pid::from_raw(c.id() as i32), Signal::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        for i in 0..self.procs.len() {
            let Some(mut child) = self.procs[i].take() else {
                continue;
            };
            loop {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                if Instant::now() > deadline {
                    eprintln!("kube-vip in guest {i} ignored SIGTERM for 20 s: SIGKILL");
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

impl Drop for KubeVip {
    fn drop(&mut self) {
        for c in self.procs.iter_mut().flatten() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
