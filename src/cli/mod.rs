//! Command line: subcommands, flags and exit codes. The only place that turns
//! errors into process exit codes.
//!
//! - `args`: the grammar (clap);
//! - this module: dispatch, the runtime and logging of the long-lived
//!   commands, the exit codes;
//! - `check_command`, `status_view`, `dhcp_commands`: the one-shot commands.

use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;

use hna_edges::systemd::{Notifier, SdNotifier};
use hna_node::config::{self, ConfigError};

mod args;
mod check_command;
mod dhcp_commands;
mod status_view;

pub(crate) use args::*;
use check_command::check;
use status_view::status;

/// sysexits.h EX_CONFIG: systemd's `RestartPreventExitStatus=78` keeps the
/// unit from restarting into the same configuration error.
pub(crate) const EXIT_CONFIG: u8 = 78;

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Run(args) => {
            // Configuration first: nothing on the host changes before it
            // is valid.
            let cfg = match config::load(&args.config.flag_values()) {
                Ok(cfg) => cfg,
                Err(e) => return config_failure(&e),
            };
            serve(&cfg.log_level.clone(), cfg.log_target, |n| {
                Box::pin(async move { Ok(hna_node::agent::run(cfg, n).await?) })
            })
        }
        Command::Controller(args) => {
            let timing = hna_controller::election::Timing {
                lease_duration: args.lease_duration,
                renew_deadline: args.renew_deadline,
                retry_period: args.retry_period,
            };
            let watch_quiet_after = args
                .watch_quiet_after
                .unwrap_or_else(|| DEFAULT_WATCH_QUIET_AFTER.min(args.node_stale_after / 2));
            if watch_quiet_after > args.node_stale_after {
                eprintln!(
                    "harvester-node-agent: --watch-quiet-after ({}) must not be above --node-stale-after ({})",
                    humantime::format_duration(watch_quiet_after),
                    humantime::format_duration(args.node_stale_after)
                );
                return ExitCode::from(EXIT_CONFIG);
            }
            if let Err(e) = timing.validate() {
                eprintln!("harvester-node-agent: invalid leader election flags: {e}");
                return ExitCode::from(EXIT_CONFIG);
            }
            let classes = args.classes();
            let opts = hna_controller::Options {
                kubeconfig: args.kubeconfig,
                credentials_retry: args.credentials_retry,
                namespace: args.namespace,
                identity: args
                    .identity
                    .filter(|i| !i.trim().is_empty())
                    .unwrap_or_else(hna_controller::default_identity),
                timing,
                node_stale_after: args.node_stale_after,
                watch_quiet_after,
                service_failed_after: args.service_failed_after,
                service_guarded_after: args.service_guarded_after,
                service_avoid_for: args.service_avoid_for,
                metrics_listen: args.metrics_listen,
                endpoint_source: args.endpoint_source,
                classes,
            };
            serve(&args.log_level, args.log_target, |n| {
                Box::pin(async move { Ok(hna_controller::run(opts, n).await?) })
            })
        }
        Command::Check(args) => check(args),
        Command::Status(args) => status(args),
        Command::DhcpProbe(args) => dhcp_commands::probe_main(args),
        Command::DhcpHold(args) => dhcp_commands::hold_main(args),
    }
}

type DaemonFuture = std::pin::Pin<Box<dyn std::future::Future<Output = anyhow::Result<()>>>>;

/// How many worker threads a command's runtime gets.
enum Threads {
    /// One-shot commands.
    Current,
    /// Long-lived ones: two workers keep a slow handler from stalling the
    /// watchdog's loops on a 2-core VM.
    Two,
}

/// The async runtime of a command, or the exit code after saying why not.
fn runtime(threads: Threads) -> Result<tokio::runtime::Runtime, ExitCode> {
    let mut builder = match threads {
        Threads::Current => tokio::runtime::Builder::new_current_thread(),
        Threads::Two => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(2);
            b
        }
    };
    builder.enable_all().build().map_err(|e| {
        eprintln!("harvester-node-agent: cannot start the async runtime: {e}");
        ExitCode::FAILURE
    })
}

/// Runs a long-lived command (`run`, `controller`) on a runtime, with
/// logging set up and its failure told to systemd.
fn serve(
    log_level: &str,
    log_target: config::LogTarget,
    body: impl FnOnce(Arc<dyn Notifier>) -> DaemonFuture,
) -> ExitCode {
    crate::logging::init(log_level, log_target);
    let notifier: Arc<dyn Notifier> = Arc::new(SdNotifier);
    let runtime = match runtime(Threads::Two) {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    match runtime.block_on(body(notifier.clone())) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            notifier.status(&format!("failed: {e:#}"));
            eprintln!("harvester-node-agent: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn config_failure(e: &ConfigError) -> ExitCode {
    eprintln!("harvester-node-agent: invalid configuration: {e}");
    eprintln!(
        "harvester-node-agent: nothing was changed on this host; fix the configuration and start again (see `harvester-node-agent run --help`)"
    );
    // Tell systemd why, so `systemctl status` shows it.
    SdNotifier.status(&format!("invalid configuration: {e}"));
    ExitCode::from(EXIT_CONFIG)
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::status_view::*;
    use super::*;

    fn status_args(line: &[&str]) -> StatusArgs {
        match Cli::try_parse_from(line).expect("parses").command {
            Command::Status(a) => a,
            other => panic!("{other:?}"),
        }
    }

    /// `status` finds the daemon where `run` put it: the configuration
    /// file's `socket`, unless a flag overrides it.
    #[test]
    fn status_reads_the_socket_from_the_configuration() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config.toml");
        std::fs::write(&file, "socket = \"/run/hna-test/other.sock\"\n").unwrap();
        let file = file.to_str().unwrap();
        let args = status_args(&["hna", "status", "--config", file]);
        assert_eq!(
            status_socket(&args, config::load).unwrap(),
            PathBuf::from("/run/hna-test/other.sock")
        );
        let args = status_args(&["hna", "status", "--config", file, "--socket", "/tmp/s.sock"]);
        assert_eq!(
            status_socket(&args, config::load).unwrap(),
            PathBuf::from("/tmp/s.sock")
        );
        std::fs::write(dir.path().join("bad.toml"), "socket = \"relative\"\n").unwrap();
        let bad = dir.path().join("bad.toml");
        let args = status_args(&["hna", "status", "--config", bad.to_str().unwrap()]);
        let err = status_socket(&args, config::load).unwrap_err();
        assert_eq!(err.key(), Some("socket"));
    }

    #[test]
    fn controller_settings_are_not_the_daemons() {
        use clap::CommandFactory;
        let mut cli = Cli::command();
        let run_help = cli
            .find_subcommand_mut("run")
            .unwrap()
            .render_long_help()
            .to_string();
        let controller_help = cli
            .find_subcommand_mut("controller")
            .unwrap()
            .render_long_help()
            .to_string();
        for daemon_only in [
            "--state-dir",
            "--macvlan-recheck",
            "--socket",
            "--node-name",
        ] {
            assert!(run_help.contains(daemon_only), "{daemon_only}");
            assert!(!controller_help.contains(daemon_only), "{daemon_only}");
        }
        assert!(controller_help.contains("--kubeconfig"));
        assert!(Cli::try_parse_from(["hna", "controller", "--state-dir", "/x"]).is_err());
    }
    use hna_dhcp::State;
    use hna_dhcp::driver::LeaseStatus;
    use hna_node::agent::daemon_state::DhcpStatus;

    #[test]
    fn lb_lines_name_each_service_and_its_lease() {
        use hna_contract::node_object::{LeaseReport, Status};
        let lb = hna_node::agent::daemon_state::LbStatus {
            object: "harvester-node-agent/n1".into(),
            read: "watching".into(),
            wanted: 2,
            status: Status {
                held: 1,
                ready: true,
                leases: vec![
                    LeaseReport {
                        service: "default/web".into(),
                        interface: "hlb-3f2a9c1e".into(),
                        state: "BOUND".into(),
                        address: Some("10.77.0.150".into()),
                        expires: Some("2026-11-22T18:00:00Z".into()),
                        ..LeaseReport::default()
                    },
                    LeaseReport {
                        service: "default/db".into(),
                        interface: "hlb-0000abcd".into(),
                        state: "FAILED".into(),
                        message: Some("no uplink".into()),
                        ..LeaseReport::default()
                    },
                ],
                ..Status::default()
            },
            ..Default::default()
        };
        let text = human_lb(&lb);
        assert!(
            text.starts_with("  lb:        lb 1/2 held (harvester-node-agent/n1: watching)\n"),
            "{text}"
        );
        assert!(
            text.contains(
                "default/web hlb-3f2a9c1e BOUND      10.77.0.150     expires 2026-11-22T18:00:00Z\n"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "default/db hlb-0000abcd FAILED     -               expires -; no uplink\n"
            ),
            "{text}"
        );
    }

    #[test]
    fn lease_table_has_a_line_per_lease_and_the_sweep() {
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        let mut bound = LeaseStatus::new("vip-0000abcd", [0, 0, 0x6c, 0, 0xab, 0xcd]);
        bound.state = State::Bound;
        bound.address = Some("10.77.0.150".parse().unwrap());
        bound.server = Some("10.77.0.1".parse().unwrap());
        bound.t1_at_unix_ms = Some(now_ms + 90_500);
        bound.expires_at_unix_ms = Some(now_ms + 3_600_500);
        bound.counters.sent = 2;
        bound.counters.received = 2;
        bound.presence_every_ms = Some(500);
        let mut waiting = LeaseStatus::new("vip-0000abce", [0, 0, 0x6c, 0, 0xab, 0xce]);
        waiting.last_error = Some("send: network is down".into());
        let text = human_dhcp(&DhcpStatus {
            metrics_url: Some("http://127.0.0.1:9477/metrics".into()),
            removed_at_start: vec!["vip-0000dead".into()],
            sweep_problems: vec![],
            leases: vec![bound, waiting],
        });
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "  dhcp:      2 lease(s), metrics at http://127.0.0.1:9477/metrics"
        );
        assert!(lines[1].ends_with("earlier run): vip-0000dead"), "{text}");
        assert!(
            lines[2].starts_with("    vip-0000abcd 00:00:6c:00:ab:cd BOUND      10.77.0.150     server 10.77.0.1       renew in 1m 30s, expires in 1h; sent 2 received 2"),
            "{text}"
        );
        assert!(
            lines[2].ends_with("; presence frames every 500ms"),
            "{text}"
        );
        assert!(!lines[3].contains("presence"), "{text}");
        assert!(
            lines[3].contains("INIT") && lines[3].ends_with("; last error: send: network is down"),
            "{text}"
        );
        assert_eq!(lines.len(), 4, "{text}");
    }

    #[test]
    fn duration_flags_take_bare_seconds_and_units() {
        use std::time::Duration;
        let parse = |args: &[&str]| {
            Cli::try_parse_from([&["harvester-node-agent"], args].concat())
                .map(|c| c.command)
                .map_err(|e| e.to_string())
        };
        let check_timeout = |args: &[&str]| match parse(args) {
            Ok(Command::Check(a)) => Ok(a.timeout),
            Ok(other) => panic!("{other:?}"),
            Err(e) => Err(e),
        };
        let probe_timeout = |args: &[&str]| match parse(args) {
            Ok(Command::DhcpProbe(a)) => Ok(a.timeout),
            Ok(other) => panic!("{other:?}"),
            Err(e) => Err(e),
        };
        assert_eq!(
            check_timeout(&["check", "--timeout", "3"]),
            Ok(Duration::from_secs(3))
        );
        assert_eq!(
            check_timeout(&["check", "--timeout", "1m30s"]),
            Ok(Duration::from_secs(90))
        );
        assert_eq!(check_timeout(&["check"]), Ok(Duration::from_secs(5)));
        assert_eq!(
            probe_timeout(&["dhcp-probe", "--timeout", "3"]),
            Ok(Duration::from_secs(3))
        );
        assert_eq!(
            probe_timeout(&["dhcp-probe", "--timeout", "2.5"]),
            Ok(Duration::from_millis(2500))
        );
        assert_eq!(
            probe_timeout(&["dhcp-probe", "--timeout", "500ms"]),
            Ok(Duration::from_millis(500))
        );
        assert_eq!(probe_timeout(&["dhcp-probe"]), Ok(Duration::from_secs(10)));
        for bad in ["--timeout=-3", "--timeout=soon", "--timeout="] {
            let err = probe_timeout(&["dhcp-probe", bad]).unwrap_err();
            assert!(err.contains("bare number"), "{bad}: {err}");
        }

        // Configuration flags are resolved by config::resolve.
        let Ok(Command::Run(run)) = parse(&["run", "--credentials-retry", "3"]) else {
            panic!("run does not parse");
        };
        let cfg = hna_node::config::resolve(None, &|_| None, &run.config.flag_values(), &|| {
            "node-a".into()
        })
        .unwrap();
        assert_eq!(cfg.credentials_retry, Duration::from_secs(3));
    }
}
