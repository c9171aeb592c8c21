//! The node's LoadBalancer data plane: the addresses the controller
//! assigned to this node, held through the DHCP engine
//! ([`hna_dhcp::LeaseEngine`]).
//!
//! Built so far: [`plan`], the pure decision over assignments and running
//! leases, and [`apply`], which carries it out on the engine (unit-tested
//! on the recording fake). The watch of this node's `LoadBalancerNode`
//! object, the status report and the per-interface IPv4 settings come with
//! the LoadBalancer work (see `docs/loadbalancer-design.md`).

pub mod apply;
pub mod delivery;
mod fence;
pub mod lease_metrics;
pub mod lease_plan;
pub mod spawn;
pub mod status_writes;
pub mod task;

#[cfg(test)]
mod tests {
    /// The DHCP engine's lease records (read by `status` and the status
    /// reports) and the contract's annotations write a MAC the same way.
    #[test]
    fn lease_records_and_the_contract_write_a_mac_alike() {
        for mac in [
            [0x00, 0x00, 0x6c, 0xab, 0xcd, 0xef],
            [0x02, 0xff, 0, 1, 0x10, 0xa0],
        ] {
            let record = hna_dhcp::driver::LeaseStatus::new("hlb-x", mac);
            assert_eq!(record.mac, hna_contract::mac::format(&mac));
            assert_eq!(hna_contract::mac::parse(&record.mac), Some(mac));
        }
    }
}
