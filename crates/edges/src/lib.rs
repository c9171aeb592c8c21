//! The edges harvester-node-agent's two programs both stand on. The node
//! daemon (`hna-node`) and the controller (`hna-controller`) never import
//! each other; what both need of the world outside the contract lives here:
//!
//! - [`cluster`]: the guest-cluster connection (which credentials, a
//!   connection that follows them, the single-object watch);
//! - [`systemd`]: `Type=notify` messages and the liveness-gated watchdog;
//! - [`metrics`]: the `/metrics` and `/healthz` endpoint, the API-latency
//!   layer and the `process_*` metrics;
//! - [`duration`]: the one duration syntax (bare seconds or units).

pub mod cluster;
pub mod duration;
pub mod metrics;
pub mod systemd;
