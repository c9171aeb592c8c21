//! The `process_*` metrics every Prometheus client library exports (CPU
//! time, memory, file descriptors, threads, start time), read from
//! `/proc/self` at each scrape. `prometheus-client` has none; the Go and
//! Python clients' names and meanings are kept, so their dashboards work.

use std::fmt;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::registry::Unit;

use super::exposition::{counter, gauge};

/// Registered once per process (unprefixed: these names are shared).
#[derive(Debug, Default)]
pub(crate) struct ProcessCollector;

/// What `/proc/self/stat` and friends say, in the metrics' units.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct ProcessFacts {
    pub(crate) cpu_seconds: f64,
    pub(crate) resident_bytes: f64,
    pub(crate) virtual_bytes: f64,
    pub(crate) start_time_seconds: f64,
    pub(crate) threads: f64,
    pub(crate) open_fds: f64,
    pub(crate) max_fds: Option<f64>,
}

impl ProcessFacts {
    /// Reads this process's facts; `None` where `/proc` is not mounted.
    pub(crate) fn read() -> Option<ProcessFacts> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        let boot = std::fs::read_to_string("/proc/stat").ok()?;
        // SAFETY: sysconf has no preconditions.
        let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as f64;
        let mut facts = parse_stat(&stat, &boot, ticks, page)?;
        facts.open_fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count()) as f64;
        facts.max_fds = std::fs::read_to_string("/proc/self/limits")
            .ok()
            .and_then(|l| parse_max_fds(&l));
        Some(facts)
    }
}

/// Parses `/proc/self/stat` (fields after the command's closing
/// parenthesis, which may itself hold spaces and parentheses) and the boot
/// time from `/proc/stat`.
pub(crate) fn parse_stat(
    stat: &str,
    proc_stat: &str,
    ticks: f64,
    page: f64,
) -> Option<ProcessFacts> {
    let after = &stat[stat.rfind(')')? + 1..];
    // Field 3 (state) is the first after the command; utime is field 14.
    let fields: Vec<&str> = after.split_whitespace().collect();
    let field = |n: usize| -> Option<f64> { fields.get(n - 3)?.parse().ok() };
    let boot: f64 = proc_stat
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    Some(ProcessFacts {
        cpu_seconds: (field(14)? + field(15)?) / ticks,
        threads: field(20)?,
        start_time_seconds: boot + field(22)? / ticks,
        virtual_bytes: field(23)?,
        resident_bytes: field(24)? * page,
        open_fds: 0.0,
        max_fds: None,
    })
}

/// The soft limit of `Max open files` in `/proc/self/limits`.
pub(crate) fn parse_max_fds(limits: &str) -> Option<f64> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let Some(p) = ProcessFacts::read() else {
            return Ok(());
        };
        counter(
            &mut encoder,
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds.",
            p.cpu_seconds,
        )?;
        gauge(
            &mut encoder,
            "process_resident_memory",
            "Resident memory size in bytes.",
            Some(Unit::Bytes),
            p.resident_bytes,
        )?;
        gauge(
            &mut encoder,
            "process_virtual_memory",
            "Virtual memory size in bytes.",
            Some(Unit::Bytes),
            p.virtual_bytes,
        )?;
        gauge(
            &mut encoder,
            "process_start_time",
            "Start time of the process since the Unix epoch in seconds.",
            Some(Unit::Seconds),
            p.start_time_seconds,
        )?;
        gauge(
            &mut encoder,
            "process_threads",
            "Number of OS threads in the process.",
            None,
            p.threads,
        )?;
        gauge(
            &mut encoder,
            "process_open_fds",
            "Number of open file descriptors.",
            None,
            p.open_fds,
        )?;
        if let Some(max) = p.max_fds {
            gauge(
                &mut encoder,
                "process_max_fds",
                "Maximum number of open file descriptors.",
                None,
                max,
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_with_parentheses_and_spaces_does_not_shift_the_fields() {
        // Fields 3.. as the kernel writes them; utime 250, stime 50,
        // threads 7, starttime 1000 ticks, vsize 4096000, rss 100 pages.
        let stat = "42 (a (b) c) S 1 42 42 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 7 0 1000 4096000 100 18446744073709551615";
        let p = parse_stat(stat, "cpu 1 2 3\nbtime 1700000000\n", 100.0, 4096.0).unwrap();
        assert_eq!(p.cpu_seconds, 3.0);
        assert_eq!(p.threads, 7.0);
        assert_eq!(p.start_time_seconds, 1_700_000_010.0);
        assert_eq!(p.virtual_bytes, 4_096_000.0);
        assert_eq!(p.resident_bytes, 409_600.0);
        assert!(parse_stat("garbage", "btime 1", 100.0, 4096.0).is_none());
    }

    #[test]
    fn the_soft_open_files_limit_is_read() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units\nMax open files            1024                 524288               files\n";
        assert_eq!(parse_max_fds(limits), Some(1024.0));
    }

    /// Against this very process: what the test knows (it has threads,
    /// open descriptors, memory, and started before now).
    #[test]
    fn this_process_is_described() {
        let p = ProcessFacts::read().expect("/proc is mounted");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        assert!(p.threads >= 1.0 && p.open_fds >= 3.0 && p.resident_bytes > 0.0);
        assert!(p.start_time_seconds <= now + 1.0 && p.start_time_seconds > now - 86_400.0 * 365.0);
    }
}
