//! Log output: journald with structured fields when its socket exists,
//! otherwise human-readable lines on stderr.

use std::io::IsTerminal;
use std::path::Path;

use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use hna_node::config::LogTarget;

const JOURNALD_SOCKET: &str = "/run/systemd/journal/socket";

/// Installs the global subscriber. `RUST_LOG`, when set, wins over the
/// configured level so a one-off debug run needs no config change.
/// Returns where logs go, for the start-up line.
pub(crate) fn init(level: &str, target: LogTarget) -> &'static str {
    let filter = std::env::var("RUST_LOG")
        .ok()
        .filter(|v| !v.is_empty())
        .and_then(|v| EnvFilter::builder().parse(v).ok())
        .unwrap_or_else(|| EnvFilter::new(level));
    let use_journald = match target {
        LogTarget::Journald => true,
        LogTarget::Stderr => false,
        LogTarget::Auto => Path::new(JOURNALD_SOCKET).exists(),
    };
    if use_journald {
        match tracing_journald::layer() {
            Ok(layer) => {
                let layer = layer.with_syslog_identifier("harvester-node-agent".into());
                let _ = tracing_subscriber::registry()
                    .with(filter)
                    .with(layer)
                    .try_init();
                return "journald";
            }
            Err(e) => eprintln!("journald not available ({e}); logging to stderr"),
        }
    }
    let _ = tracing_subscriber::registry()
        .with(filter)
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_ansi(std::io::stderr().is_terminal())
                .with_target(false),
        )
        .try_init();
    "stderr"
}
