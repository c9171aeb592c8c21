//! `harvester-node-agent controller`: the in-cluster controller.
//!
//! Today it establishes what every reconciler needs — credentials, a
//! verified connection, systemd readiness and clean shutdown. The
//! load-balancer placement and Service status reconcilers are added by the
//! load-balancer work; until then the controller changes nothing in the
//! cluster.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use tokio::signal::unix::{SignalKind, signal};

use crate::config::Config;
use crate::credentials::{self, Discovery, HostEnv};
use crate::systemd::Notifier;

const API_TIMEOUT: Duration = Duration::from_secs(10);

pub async fn run(cfg: Config, notifier: Arc<dyn Notifier>) -> anyhow::Result<()> {
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        "starting harvester-node-agent controller"
    );
    let mut sigterm = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
    let mut sigint = signal(SignalKind::interrupt()).context("installing SIGINT handler")?;
    notifier.ready();

    let mut retry = tokio::time::interval(cfg.credentials_retry);
    retry.reset();
    let mut last_status = String::new();
    loop {
        let status = match credentials::discover(&cfg, &HostEnv) {
            found @ (Discovery::File { .. } | Discovery::InCluster) => {
                match credentials::connect(&found, API_TIMEOUT).await {
                    Ok(conn) => format!(
                        "controller: connected to {} ({}); no reconcilers enabled yet",
                        conn.server, conn.server_version
                    ),
                    Err(e) => format!("controller: cluster unreachable: {e:#}"),
                }
            }
            Discovery::NotFound { searched, .. } => format!(
                "controller: waiting for credentials (searched {})",
                searched
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        if status != last_status {
            tracing::info!("{status}");
            notifier.status(&status);
            last_status = status;
        }
        tokio::select! {
            _ = retry.tick() => {}
            _ = sigterm.recv() => break,
            _ = sigint.recv() => break,
        }
    }
    notifier.stopping();
    tracing::info!("controller stopped");
    Ok(())
}
