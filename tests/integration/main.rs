//! The integration tests, in one binary: the daemon binary as systemd and an
//! operator see it, and the real parts (network namespaces, dnsmasq,
//! kube-apiserver, a real kernel under qemu) through the test kit
//! (`testkit/`, crate `hna_testkit`).
//!
//! ```text
//! cargo test --test integration                  # all
//! cargo test --test integration dhcp_rig::       # one module
//! cargo test --test integration -- --list        # the test names
//! HNA_TEST_FILTERS="manifests:: failover::" cargo test --test integration   # several
//! ```
//!
//! Each test declares its prerequisites; see [`harness`] for what happens
//! when one is missing (a non-root run skips and says so in a closing
//! `skipped: ...` line; a root run or `CI=true` fails naming the install
//! command).

mod facts;
mod harness;

mod bad_day;
mod cloud_init;
mod cluster;
mod cni;
mod controller;
mod current_api;
mod daemon;
mod dhcp_probe;
mod dhcp_rig;
mod docs;
mod failover;
mod flaky_api;
mod harvester_ccm;
mod helm_chart;
mod hostile_node;
mod kiwi;
mod lan_adversary;
mod loadbalancer;
mod manifests;
mod oci_image;
mod packaging;
mod partitions;
mod peers;
mod rig_selftest;
mod scripts;
mod soak;
mod tenants;
mod topology;
mod unit_file;
mod vm_guest_agent;
mod vm_image;
mod vm_macvlan;
mod vm_migration;
mod vm_pause;
mod vm_selftest;

/// The agent binary under test.
const BIN: &str = env!("CARGO_BIN_EXE_harvester-node-agent");

fn main() -> std::process::ExitCode {
    let tests = [
        daemon::tests(),
        unit_file::tests(),
        docs::tests(),
        scripts::tests(),
        cluster::tests(),
        controller::tests(),
        topology::tests(),
        dhcp_rig::tests(),
        dhcp_probe::tests(),
        manifests::tests(),
        packaging::tests(),
        loadbalancer::tests(),
        current_api::tests(),
        cni::tests(),
        tenants::tests(),
        failover::tests(),
        flaky_api::tests(),
        hostile_node::tests(),
        lan_adversary::tests(),
        partitions::tests(),
        bad_day::tests(),
        rig_selftest::tests(),
        soak::tests(),
        peers::tests(),
        harvester_ccm::tests(),
        helm_chart::tests(),
        vm_selftest::tests(),
        vm_macvlan::tests(),
        vm_pause::tests(),
        vm_migration::tests(),
        vm_guest_agent::tests(),
        kiwi::tests(),
        cloud_init::tests(),
        oci_image::tests(),
        vm_image::tests(),
    ]
    .into_iter()
    .flatten()
    .collect();
    harness::main(tests)
}
