//! `dhcp-probe` and `dhcp-hold` command lines.
//!
//! `dhcp-hold` holds N leases in one process until SIGTERM/SIGINT (then
//! hands them over, or releases them with `--release-on-exit`) or SIGKILL
//! (then leaves macvlans and lease files behind, exactly like a crashed
//! daemon). It exists for the integration tests and benchmarks ("kill -9
//! and restart keeps the address", "200 leases in one process") and for
//! operators who want to watch the engine against their network.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;

use super::Output;
use hna_dhcp::driver::LeaseStatus;
use hna_dhcp::engine::{Engine, LeaseConfig};
use hna_dhcp::io::ProbeConfig;
use hna_dhcp::link::default_route_interface;
use hna_dhcp::machine::{StopMode, Timing};
use hna_dhcp::packet::Identity;
use hna_dhcp::probe::{self, ProbeOptions};
use hna_dhcp::store::Store;

// The value parsers are the binary's edge (clap shows the text): anyhow.
fn parse_mac_arg(s: &str) -> anyhow::Result<[u8; 6]> {
    hna_contract::mac::parse(s)
        .ok_or_else(|| anyhow::anyhow!("`{s}` is not a MAC address like 00:00:6c:12:34:56"))
}

/// Option 61 as given on the command line. A newtype, because clap reads
/// a field of type `Option<Vec<u8>>` as a list of bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ClientIdArg(pub Vec<u8>);

fn parse_client_id_arg(s: &str) -> anyhow::Result<ClientIdArg> {
    parse_client_id(s).map(ClientIdArg)
}

/// `01:02:0a` (hex bytes), plain text, or `none` (no option 61: empty).
fn parse_client_id(s: &str) -> anyhow::Result<Vec<u8>> {
    if s == "none" {
        return Ok(Vec::new());
    }
    let hex: Option<Vec<u8>> = s
        .split(':')
        .map(|p| {
            (p.len() == 2)
                .then(|| u8::from_str_radix(p, 16).ok())
                .flatten()
        })
        .collect();
    match hex {
        Some(bytes) if s.contains(':') => Ok(bytes),
        _ if s.is_empty() => anyhow::bail!("client id must not be empty"),
        _ => Ok(s.as_bytes().to_vec()),
    }
}

#[derive(Debug, Args)]
pub(crate) struct ProbeArgs {
    /// Uplink to put the temporary macvlan on [default: the interface of the default route]
    #[arg(long, value_name = "IFACE")]
    pub(crate) parent: Option<String>,
    /// MAC of the temporary macvlan [default: random 00:00:6c:xx:xx:xx]
    #[arg(long, value_name = "MAC", value_parser = parse_mac_arg)]
    pub(crate) mac: Option<[u8; 6]>,
    /// Client identifier (option 61): hex bytes `01:00:00:6c:..`, text, or `none` to send no option 61 (as kube-vip without a hostname) [default: 01 + MAC]
    #[arg(long, value_name = "ID", value_parser = parse_client_id_arg)]
    pub(crate) client_id: Option<ClientIdArg>,
    /// Hostname to send (option 12)
    #[arg(long)]
    pub(crate) hostname: Option<String>,
    /// Ask for this address first (INIT-REBOOT, then option 50 in DISCOVER), as an agent or kube-vip does with `kube-vip.io/requestedIP`
    #[arg(long, value_name = "IPV4")]
    pub(crate) requested_ip: Option<std::net::Ipv4Addr>,
    /// Release the lease at the end (`--release=false` keeps it on the server)
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub(crate) release: bool,
    /// How long to wait for a lease (seconds, or with a unit: 500ms, 1m)
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = hna_edges::duration::parse_duration)]
    pub(crate) timeout: Duration,
    /// Skip the ARP probe (RFC 5227) of the offered address
    #[arg(long)]
    pub(crate) no_arp_probe: bool,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Output::Human)]
    pub(crate) output: Output,
}

pub(crate) fn probe_main(args: ProbeArgs) -> ExitCode {
    let rt = match super::runtime(super::Threads::Current) {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    let report = rt.block_on(probe::run(ProbeOptions {
        parent: args.parent,
        mac: args.mac,
        client_id: args.client_id.map(|c| c.0),
        hostname: args.hostname,
        requested_ip: args.requested_ip,
        release: args.release,
        timeout: args.timeout,
        arp_probe: !args.no_arp_probe,
    }));
    match args.output {
        Output::Json => println!(
            "{}",
            serde_json::to_string_pretty(&report).expect("report serializes")
        ),
        Output::Human => print!("{}", report.to_human()),
    }
    if report.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

#[derive(Debug, Args)]
pub(crate) struct HoldArgs {
    /// Uplink for the macvlans [default: the interface of the default route]
    #[arg(long, value_name = "IFACE")]
    pub(crate) parent: Option<String>,
    /// Number of leases
    #[arg(long, default_value_t = 1)]
    pub(crate) count: u32,
    /// Distinguishes sets of leases: lease i is `vip-<set><i as 6 hex>` with
    /// MAC 00:00:6c:<set>:<i>
    #[arg(long, default_value_t = 1)]
    pub(crate) set: u8,
    /// State directory (lease files go to <DIR>/leases)
    #[arg(long, value_name = "DIR")]
    pub(crate) state_dir: PathBuf,
    /// Smallest retransmission interval while renewing/rebinding (RFC: 60s; seconds, or with a unit)
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = hna_edges::duration::parse_duration)]
    pub(crate) renew_floor: Duration,
    /// Skip the ARP probe (RFC 5227) of offered addresses
    #[arg(long)]
    pub(crate) no_arp_probe: bool,
    /// Write the lease table (JSON) here, atomically, every 100 ms
    #[arg(long, value_name = "PATH")]
    pub(crate) status_file: Option<PathBuf>,
    /// On SIGTERM/SIGINT send DHCPRELEASE (default: hand over, keeping the
    /// leases on the server and the lease files on disk)
    #[arg(long)]
    pub(crate) release_on_exit: bool,
    /// Serve /metrics and /healthz here
    #[arg(long, value_name = "ADDR:PORT")]
    pub(crate) metrics_listen: Option<SocketAddr>,
}

fn write_status(path: &PathBuf, leases: &[LeaseStatus]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(&serde_json::to_vec(leases).expect("status serializes"))?;
    drop(f);
    std::fs::rename(&tmp, path)
}

pub(crate) fn hold_main(args: HoldArgs) -> ExitCode {
    let rt = match super::runtime(super::Threads::Two) {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    match rt.block_on(hold(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("harvester-node-agent: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn hold(args: HoldArgs) -> anyhow::Result<()> {
    use anyhow::Context;
    let parent = match args.parent.clone() {
        Some(p) => p,
        None => std::fs::read_to_string(hna_dhcp::link::ROUTE_TABLE)
            .ok()
            .and_then(|t| default_route_interface(&t))
            .context("no default route to find the uplink; name it with --parent")?,
    };
    let store = Store::open(&args.state_dir)?;
    let acquisitions = hna_node::loadbalancer::lease_metrics::acquisition_durations();
    let engine = Arc::new(Engine::new(Some(store))?.on_acquired(
        hna_node::loadbalancer::lease_metrics::observe_acquisitions(acquisitions.clone()),
    ));
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    for i in 0..args.count {
        let mac = [0, 0, 0x6c, args.set, (i >> 8) as u8, i as u8];
        let cfg = LeaseConfig {
            interface: format!("vip-{:02x}{:06x}", args.set, i),
            parent: parent.clone(),
            identity: Identity::new(mac),
            requested_ip: None,
            timing: Timing {
                renew_floor: args.renew_floor,
                arp_probe: !args.no_arp_probe,
                ..Timing::default()
            },
            probe: ProbeConfig::default(),
            guarded_at: None,
            witness: None,
            presence: hna_dhcp::Presence::Off,
        };
        engine.start(cfg).await?;
    }
    eprintln!("dhcp-hold: {} leases started on {parent}", args.count);
    if let Some(addr) = args.metrics_listen {
        let l = hna_edges::metrics::bind(addr)
            .await
            .with_context(|| format!("listen on {addr}"))?;
        let e = engine.clone();
        let registry = hna_node::loadbalancer::lease_metrics::registry(
            Arc::new(move || e.snapshot()),
            acquisitions,
        );
        tokio::spawn(hna_edges::metrics::serve(
            l,
            hna_edges::metrics::Pages {
                metrics: Arc::new(move || hna_edges::metrics::exposition::encode(&registry)),
                health: Arc::new(|| Ok(())),
                live: Arc::new(|| Ok(())),
            },
        ));
    }
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tokio::select! {
            _ = tick.tick() => {
                if let Some(p) = &args.status_file {
                    write_status(p, &engine.snapshot())
                        .with_context(|| format!("write {}", p.display()))?;
                }
            }
            _ = tokio::signal::ctrl_c() => break,
            _ = sigterm.recv() => break,
        }
    }
    let mode = if args.release_on_exit {
        StopMode::Release
    } else {
        StopMode::Handover
    };
    let errors = engine.stop_all(mode).await;
    if let Some(p) = &args.status_file {
        let _ = write_status(p, &engine.snapshot());
    }
    if let Some(e) = errors.into_iter().next() {
        return Err(e.into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_id_hex_or_text() {
        assert_eq!(
            parse_client_id("01:00:00:6c:aa:bb").unwrap(),
            vec![1, 0, 0, 0x6c, 0xaa, 0xbb]
        );
        assert_eq!(parse_client_id("lb-web").unwrap(), b"lb-web".to_vec());
        assert!(parse_client_id("").is_err());
        assert!(
            parse_client_id("none").unwrap().is_empty(),
            "none: no option 61"
        );
    }

    #[test]
    fn probe_flags_parse() {
        use clap::Parser;
        let cli = crate::cli::Cli::try_parse_from([
            "harvester-node-agent",
            "dhcp-probe",
            "--client-id",
            "none",
            "--requested-ip",
            "10.77.0.150",
        ])
        .unwrap();
        let text = format!("{cli:?}");
        assert!(text.contains("ClientIdArg([])"), "{text}");
        assert!(text.contains("10.77.0.150"), "{text}");
        assert!(parse_mac_arg("00:00:6c:01:02").is_err());
    }
}
