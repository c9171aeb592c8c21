//! `check`: which checks run, on what runtime, and the exit code of their
//! report.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::check::{self, Report};
use hna_edges::cluster::credentials::HostEnv;
use hna_node::config::{self, Config};

use super::args::{CheckArgs, Output};
use super::{Threads, runtime};

/// Checks `check` can be limited to. `kubeconfig` includes `api-server`,
/// and `api-server` needs `kubeconfig` (no server without credentials), so
/// naming either runs both.
pub(crate) const CHECK_NAMES: &[&str] = &[
    "config",
    "kubeconfig",
    "api-server",
    "state-dir",
    "macvlan",
    "qemu-guest-agent",
    "topology",
    "cni",
];

pub(super) fn check(args: CheckArgs) -> ExitCode {
    if let Some(bad) = args
        .names
        .iter()
        .find(|n| !CHECK_NAMES.contains(&n.as_str()))
    {
        eprintln!(
            "harvester-node-agent: no check named `{bad}`; choose from {}",
            CHECK_NAMES.join(", ")
        );
        return ExitCode::from(2);
    }
    let wanted = |name: &str| args.names.is_empty() || args.names.iter().any(|n| n == name);
    let runtime = match runtime(Threads::Current) {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    let flags = args.config.flag_values();
    let loaded = config::load(&flags);
    let mut checks = Vec::new();
    let mut helm_chart_configs = Vec::new();
    if wanted("config") {
        checks.push(check::config_check(&loaded));
    }
    // With a broken file, still check what the flags and defaults describe.
    let effective = loaded.or_else(|_| {
        config::resolve(
            None,
            &|k| std::env::var(k).ok(),
            &flags,
            &config::hostname_or_default,
        )
    });
    if let Ok(cfg) = &effective {
        if wanted("kubeconfig") || wanted("api-server") {
            let mut found = runtime.block_on(check::kubeconfig_checks(cfg, &HostEnv, args.timeout));
            if args.names.iter().any(|n| n == "api-server") {
                check::name_api_server(&mut found);
            }
            checks.extend(found);
        }
        if wanted("state-dir") {
            checks.push(check::state_dir_check(cfg));
        }
        if wanted("topology") {
            let found =
                hna_edges::cluster::credentials::discover(&cfg.credential_settings(), &HostEnv);
            let guest = runtime
                .block_on(hna_edges::cluster::credentials::connect(
                    &found,
                    args.timeout,
                ))
                .ok()
                .map(|c| c.client);
            let tcfg = hna_node::topology::TopologyConfig::from_config(cfg);
            let state = runtime.block_on(hna_node::topology::probe(
                &tcfg,
                guest,
                &cfg.node_name,
                args.timeout,
            ));
            checks.push(state.check());
        }
        if wanted("cni") {
            let (found, advice) = runtime.block_on(cni_checks(cfg, &args));
            checks.extend(found);
            helm_chart_configs = advice;
        }
    }
    if wanted("macvlan") {
        let macvlan = hna_node::kmod::preflight(&hna_node::kmod::host::Host::default(), args.fix);
        checks.push(check::macvlan_check(&macvlan));
    }
    if wanted("qemu-guest-agent") {
        let guest = runtime.block_on(hna_node::guest::watch::assess_now(std::path::Path::new(
            "/",
        )));
        checks.push(check::guest_agent_check(&guest));
    }
    let report = Report {
        checks,
        helm_chart_configs,
    };
    match args.output {
        Output::Json => println!("{}", report.to_json()),
        Output::Human => print!("{}", report.to_human()),
    }
    if report.failed() {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// The `cni` checks, and the HelmChartConfigs that keep RKE2's CNIs off
/// our links.
async fn cni_checks(cfg: &Config, args: &CheckArgs) -> (Vec<check::Check>, Vec<check::Advice>) {
    let dirs: Vec<PathBuf> = if args.cni_conf_dir.is_empty() {
        crate::cni::DEFAULT_CONF_DIRS
            .iter()
            .map(PathBuf::from)
            .collect()
    } else {
        args.cni_conf_dir.clone()
    };
    let found = hna_edges::cluster::credentials::discover(&cfg.credential_settings(), &HostEnv);
    let node = match hna_edges::cluster::credentials::connect(&found, args.timeout).await {
        Ok(conn) => crate::cni::host::node_facts(conn.client, &cfg.node_name, args.timeout).await,
        Err(e) => crate::cni::NodeFacts::NotRead(format!("{e:#}")),
    };
    let route = std::fs::read_to_string(hna_dhcp::link::ROUTE_TABLE)
        .ok()
        .and_then(|r| hna_dhcp::link::default_route_interface(&r));
    let uplink = hna_dhcp::link::current_uplink(cfg.uplink.as_deref(), route, None, |_| false);
    let facts = crate::cni::host::gather(&dirs, Path::new("/run"), uplink, node).await;
    let advice = crate::cni::helm_chart_configs(&facts)
        .into_iter()
        .map(|(cni, yaml)| check::Advice {
            title: format!(
                "RKE2 with {}: keep it off hlb-* links (kubectl apply -f, or a file in /var/lib/rancher/rke2/server/manifests/)",
                cni.as_str()
            ),
            text: yaml,
        })
        .collect();
    (crate::cni::assess(&facts), advice)
}
