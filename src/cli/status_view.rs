//! `status`: asks the running daemon over its control socket and renders
//! its state for people (or passes its JSON through).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use hna_node::config::{self, Config, ConfigError, FlagValues};
use hna_node::control;

use super::args::{Output, StatusArgs};
use super::{EXIT_CONFIG, Threads, runtime};

/// The socket `status` asks: resolved exactly as `run` resolves its own
/// (flag, `HNA_SOCKET`, the configuration file's `socket`, the default).
pub(crate) fn status_socket(
    args: &StatusArgs,
    load: impl FnOnce(&FlagValues) -> Result<Config, ConfigError>,
) -> Result<PathBuf, ConfigError> {
    let mut values = std::collections::BTreeMap::new();
    if let Some(socket) = &args.socket {
        values.insert("socket", socket.clone());
    }
    let flags = FlagValues {
        config: args.config.clone(),
        values,
    };
    load(&flags).map(|cfg| cfg.socket)
}

pub(super) fn status(args: StatusArgs) -> ExitCode {
    let socket = match status_socket(&args, config::load) {
        Ok(socket) => socket,
        Err(e) => {
            eprintln!(
                "harvester-node-agent: invalid configuration: {e}; `status` reads it to find the daemon's socket (or pass --socket)"
            );
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let runtime = match runtime(Threads::Current) {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    match runtime.block_on(control::request_status::<
        hna_node::agent::daemon_state::AgentStatus,
    >(&socket))
    {
        Ok(st) => {
            match args.output {
                Output::Json => println!(
                    "{}",
                    serde_json::to_string_pretty(&st).expect("status serializes")
                ),
                Output::Human => print!("{}", human_status(&st)),
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("harvester-node-agent: {e}");
            ExitCode::FAILURE
        }
    }
}

pub(super) fn human_status(st: &hna_node::agent::daemon_state::AgentStatus) -> String {
    use hna_node::agent::daemon_state::ClusterState;
    let cluster = match &st.cluster {
        ClusterState::WaitingForCredentials { searched, .. } => format!(
            "waiting for credentials (searched {})",
            searched
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
        ClusterState::Connected {
            kubeconfig,
            server,
            server_version,
        } => format!(
            "connected to {server} ({server_version}){}",
            kubeconfig
                .as_ref()
                .map(|p| format!(" using {}", p.display()))
                .unwrap_or_default()
        ),
        ClusterState::Connecting { kubeconfig } => format!(
            "connecting{}",
            kubeconfig
                .as_ref()
                .map(|p| format!(" using {}", p.display()))
                .unwrap_or_default()
        ),
        ClusterState::Unreachable { kubeconfig, error } => format!(
            "unreachable{}: {error}",
            kubeconfig
                .as_ref()
                .map(|p| format!(" ({})", p.display()))
                .unwrap_or_default()
        ),
    };
    format!(
        "harvester-node-agent {} on node {} (pid {}, up {})\n  summary:   {}\n  state dir: {} ({})\n  cluster:   {}\n  macvlan:   {}: {}{}\n  qemu-ga:   {}: {}\n  topology:  {}\n  node conditions: {}\n",
        st.version,
        st.node_name,
        st.pid,
        humantime::format_duration(Duration::from_secs(st.uptime_seconds)),
        st.summary,
        st.state_dir.path.display(),
        st.state_dir.message,
        cluster,
        st.macvlan.reason.as_str(),
        st.macvlan.message,
        if st.macvlan.remediation.is_empty() {
            String::new()
        } else {
            format!("\n             fix: {}", st.macvlan.remediation)
        },
        st.guest_agent.reason.as_str(),
        st.guest_agent.message,
        st.topology.short(),
        match &st.node_conditions {
            hna_node::node_conditions::Reported::NotConnected =>
                "not connected to the cluster".to_string(),
            hna_node::node_conditions::Reported::NodeNotRegistered =>
                format!("Node {} is not registered yet", st.node_name),
            hna_node::node_conditions::Reported::Reported { at } =>
                format!("MacvlanReady, GuestAgentReady reported at {at}"),
            hna_node::node_conditions::Reported::Failed { error } => format!("failed: {error}"),
        }
    ) + &human_lb(&st.lb)
        + &human_dhcp(&st.dhcp)
}

/// The lease table: one line per lease, then the endpoint.
/// The LoadBalancer addresses assigned to this node, one line each.
pub(super) fn human_lb(lb: &hna_node::agent::daemon_state::LbStatus) -> String {
    use std::fmt::Write;
    let mut out = format!(
        "  lb:        {} ({}: {}){}\n",
        lb.short(),
        lb.object,
        lb.read,
        lb.write_error
            .as_ref()
            .map(|e| format!("; cannot write status: {e}"))
            .unwrap_or_default()
    );
    if !lb.removed_at_start.is_empty() {
        let _ = writeln!(
            out,
            "             removed at start (left by an earlier run, not assigned): {}",
            lb.removed_at_start.join(", ")
        );
    }
    for l in &lb.status.leases {
        let _ = writeln!(
            out,
            "    {} {} {:<10} {:<15} expires {}{}",
            l.service,
            l.interface,
            l.state,
            l.address.as_deref().unwrap_or("-"),
            l.expires.as_deref().unwrap_or("-"),
            l.message
                .as_ref()
                .map(|m| format!("; {m}"))
                .unwrap_or_default()
        );
    }
    out
}

pub(super) fn human_dhcp(d: &hna_node::agent::daemon_state::DhcpStatus) -> String {
    use std::fmt::Write;
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|t| t.as_millis() as u64)
        .unwrap_or(0);
    let until = |at: Option<u64>| match at {
        Some(ms) if ms > now_ms => {
            humantime::format_duration(Duration::from_secs((ms - now_ms) / 1000)).to_string()
        }
        Some(_) => "now".to_string(),
        None => "-".to_string(),
    };
    let mut out = format!("  dhcp:      {} lease(s)", d.leases.len());
    if let Some(url) = &d.metrics_url {
        let _ = write!(out, ", metrics at {url}");
    }
    out.push('\n');
    if !d.removed_at_start.is_empty() {
        let _ = writeln!(
            out,
            "             removed at start (left by an earlier run): {}",
            d.removed_at_start.join(", ")
        );
    }
    for p in &d.sweep_problems {
        let _ = writeln!(out, "             could not check: {p}");
    }
    for l in &d.leases {
        let _ = writeln!(
            out,
            "    {} {} {:<10} {:<15} server {:<15} renew in {}, expires in {}; sent {} received {} dropped {} NAKs {}{}{}",
            l.name,
            l.mac,
            l.state.as_str(),
            l.address
                .map(|a| a.to_string())
                .unwrap_or_else(|| "-".into()),
            l.server
                .map(|a| a.to_string())
                .unwrap_or_else(|| "-".into()),
            until(l.t1_at_unix_ms),
            until(l.expires_at_unix_ms),
            l.counters.sent,
            l.counters.received,
            l.counters.dropped,
            l.counters.naks,
            l.presence_every_ms
                .map(|ms| format!("; presence frames every {ms}ms"))
                .unwrap_or_default(),
            l.last_error
                .as_ref()
                .map(|e| format!("; last error: {e}"))
                .unwrap_or_default()
        );
    }
    out
}
