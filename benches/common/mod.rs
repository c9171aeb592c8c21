//! Helpers the benchmarks share: children killed on drop, percentiles and
//! `/proc` memory fields. Include with `mod common;`.

// Each bench is its own crate and uses a part of these.
#![allow(dead_code)]

use std::process::Child;
use std::time::Duration;

/// A child process killed (and reaped) when dropped, also on an error path.
pub struct Killed(pub Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The `p` quantile (0.0–1.0, nearest rank) of sorted durations.
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let idx = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[idx]
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The resident memory (VmRSS) of `pid`, in KiB.
pub fn rss_kib(pid: u32) -> anyhow::Result<u64> {
    use anyhow::Context as _;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("process {pid} is gone"))?;
    kib_field(&status, "VmRSS:").context("no VmRSS")
}

/// A `Key:   123 kB` field of `/proc/<pid>/status` or `smaps_rollup`.
pub fn kib_field(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}
