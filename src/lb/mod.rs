//! The node's LoadBalancer data plane: the addresses the controller
//! assigned to this node, held through the DHCP engine
//! ([`crate::dhcp::LeaseEngine`]).
//!
//! Built so far: [`plan`], the pure decision over assignments and running
//! leases, and [`apply`], which carries it out on the engine (unit-tested
//! on the recording fake). The watch of this node's `LoadBalancerNode`
//! object, the status report and the per-interface IPv4 settings come with
//! the LoadBalancer work (see `docs/loadbalancer-design.md`).

pub mod apply;
pub mod plan;
