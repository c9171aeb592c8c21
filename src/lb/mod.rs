//! The node's LoadBalancer data plane: the addresses the controller
//! assigned to this node, held through the DHCP engine
//! ([`crate::dhcp::LeaseEngine`]).
//!
//! Built so far: [`plan`], the pure decision over assignments and running
//! leases. The executor over the engine, the watch of this node's
//! `LoadBalancerNode` object and the status report come with the
//! LoadBalancer work (see `docs/loadbalancer-design.md`).

pub mod plan;
