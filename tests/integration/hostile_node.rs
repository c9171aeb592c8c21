//! A compromised node or controller credential, used as an attacker would
//! on the rig's real API server with the shipped manifests (issue #22):
//! whatever a controller writes into a node's assignments, the node's
//! agent builds no macvlan on a host interface that is not its uplink or a
//! card of its own; whatever a node reports, the controller publishes no
//! implausible address, and a node that never lets go holds a Service's
//! deletion for a bounded time only.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use hna_contract::{harvester, node_object};
use hna_testkit::lb::{self, LISTEN_PORT, LbRig, NAMESPACE, wait_for};
use hna_testkit::rig;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use serde_json::json;

use crate::harness::tests;
use crate::tenants::{add_cni_bridges, ipv4_conf, macvlans_on};

tests! {
    a_node_makes_no_macvlan_on_a_host_interface_whatever_its_assignment_says: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    a_compromised_node_cannot_publish_an_address_or_hold_a_deletion: Root, Iproute2, Dnsmasq, ApiServer, Socat;
}

const ADDRESS_WITHIN: Duration = Duration::from_secs(60);
const WITHIN: Duration = Duration::from_secs(30);

fn options() -> lb::Options {
    lb::Options::new(
        crate::BIN,
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/kubernetes"),
    )
}

fn assignment(
    service: &str,
    uid: &str,
    interface: &str,
    mac: &str,
    uplink: &str,
) -> serde_json::Value {
    json!({
        "service": service, "uid": uid, "interface": interface, "mac": mac,
        "clientId": "", "uplink": uplink,
    })
}

fn a_node_makes_no_macvlan_on_a_host_interface_whatever_its_assignment_says() -> Result<()> {
    let mut lb = LbRig::start(options())?;
    add_cni_bridges(&lb)?;
    let node = lb.node_name(0);
    // The controller has made node 0's object and its access: the agent
    // writes its status.
    ensure!(
        wait_for(ADDRESS_WITHIN, || lb
            .node_object(&node)
            .filter(|o| o["status"]["ready"] == true))
        .is_some(),
        "node {node} never ready\n{}",
        lb.diagnostics()
    );
    // The controllers are gone; an attacker with a controller credential
    // (or a bug) writes node 0's assignments: one on the CNI bridge, one
    // on the uplink beside it as a control.
    lb.kill_controller(0);
    lb.kill_controller(1);
    let before = ipv4_conf(&lb, 0, "cni0", "arp_ignore");
    let objects = lb.node_objects();
    let spec = json!({"spec": {"assignments": [
        assignment("team-a/bridged", "0b0b0b0b-0000-4000-8000-000000000001", "hlb-0b0b0b0b",
            "00:00:6c:0b:0b:01", "cni0"),
        assignment("team-a/control", "0c0c0c0c-0000-4000-8000-000000000002", "hlb-0c0c0c0c",
            "00:00:6c:0c:0c:02", "eth0"),
    ]}});
    lb.block_on(objects.patch(&node, &PatchParams::default(), &Patch::Merge(&spec)))
        .map_err(|e| anyhow::anyhow!("write node 0's assignments as an attacker would: {e:?}"))?;

    // The control assignment is served: the agent has acted on the spec
    // that named cni0 in the same write.
    let control = wait_for(ADDRESS_WITHIN, || {
        lb.hlb_links(0)
            .into_iter()
            .find(|l| l.name == "hlb-0c0c0c0c" && !l.addrs.is_empty())
    });
    ensure!(
        control.is_some(),
        "the control assignment on eth0 got no address\n{}",
        lb.diagnostics()
    );
    let on_bridge = macvlans_on(&lb, "cni0");
    ensure!(on_bridge.is_empty(), "macvlans on cni0: {on_bridge:?}");
    ensure!(
        lb.hlb_links(0).iter().all(|l| l.name != "hlb-0b0b0b0b"),
        "hlb-0b0b0b0b exists"
    );
    let after = ipv4_conf(&lb, 0, "cni0", "arp_ignore");
    ensure!(
        before == after,
        "cni0's arp_ignore changed: {before} -> {after}"
    );
    Ok(())
}

/// Writes node `node`'s status with its own credentials, as a node whose
/// agent was replaced by an attacker: a fresh heartbeat every 300 ms, and
/// `lease` (BOUND) as the only lease, whatever its assignments say.
struct ForgedAgent {
    stop: Arc<AtomicBool>,
    written: Arc<std::sync::atomic::AtomicU64>,
    lease: Arc<std::sync::Mutex<serde_json::Value>>,
    thread: Option<std::thread::JoinHandle<Result<()>>>,
}

impl ForgedAgent {
    fn start(api: &rig::ApiServer, node: &str, lease: serde_json::Value) -> ForgedAgent {
        let stop = Arc::new(AtomicBool::new(false));
        let written = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let lease = Arc::new(std::sync::Mutex::new(lease));
        let kubeconfig = api.node_kubeconfig(node).to_path_buf();
        let node = node.to_string();
        let (s, l, w) = (stop.clone(), lease.clone(), written.clone());
        let thread = std::thread::spawn(move || -> Result<()> {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(async {
                let client = rig::kube_client(&kubeconfig).await?;
                let objects: Api<DynamicObject> =
                    Api::namespaced_with(client, NAMESPACE, &node_object::api_resource());
                let mut beat = 0u64;
                while !s.load(Ordering::SeqCst) {
                    beat += 1;
                    let lease = l.lock().unwrap().clone();
                    let status = json!({"status": {
                        "heartbeat": format!("2026-01-01T00:{:02}:{:02}.{:03}Z", beat / 600 % 60, beat / 10 % 60, beat % 10 * 100),
                        "heartbeatPeriodMs": 300, "ready": true, "reason": "Ready",
                        "macvlanReady": true, "defaultUplink": "eth0", "held": 1,
                        "leases": [lease],
                    }});
                    objects
                        .patch_status(&node, &PatchParams::default(), &Patch::Merge(&status))
                        .await
                        .with_context(|| format!("{node} writes its own status"))?;
                    w.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
                Ok(())
            })
        });
        ForgedAgent {
            stop,
            written,
            lease,
            thread: Some(thread),
        }
    }

    /// Waits for the first forged status to be written.
    fn wait_written(&self, within: Duration) -> Result<()> {
        ensure!(
            wait_for(within, || (self.written.load(Ordering::SeqCst) > 0)
                .then_some(()))
            .is_some(),
            "no forged status written within {within:?}"
        );
        Ok(())
    }

    fn report(&self, lease: serde_json::Value) {
        *self.lease.lock().unwrap() = lease;
    }

    fn stop(&mut self) -> Result<()> {
        self.stop.store(true, Ordering::SeqCst);
        match self.thread.take() {
            Some(t) => t.join().expect("forger thread"),
            None => Ok(()),
        }
    }
}

impl Drop for ForgedAgent {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

fn a_compromised_node_cannot_publish_an_address_or_hold_a_deletion() -> Result<()> {
    // The attacker replaces the holder's agent with one that only writes
    // the status: with the LAN membership on, the holder's witnesses would
    // (rightly) find it dead and the deletion would not wait for it at
    // all. Off here, so the node stays alive by its heartbeat, which is
    // the attacker's to keep: the bound on how long it holds a deletion is
    // what is tested.
    let mut opts = options();
    opts.agent_config = "lb_membership_port = 0\n".into();
    let mut lb = LbRig::start(opts)?;
    lb.create_namespace("team-a")?;
    lb.create_service("team-a/web", &[(harvester::IPAM, "dhcp")], &[LISTEN_PORT])?;
    let ip = lb.wait_ingress("team-a/web", ADDRESS_WITHIN);
    let carriers = lb.carriers(ip);
    ensure!(carriers.len() == 1, "{ip} on {carriers:?}");
    let (holder_node, link) = carriers[0].clone();
    let holder = lb.guest_of(&holder_node);

    let kubernetes = lb
        .block_on(
            Api::<k8s_openapi::api::core::v1::Service>::namespaced(lb.admin(), "default")
                .get("kubernetes"),
        )?
        .spec
        .and_then(|s| s.cluster_ip)
        .context("the kubernetes Service's cluster IP")?;
    let lease = |address: &str| {
        json!({"service": "team-a/web", "interface": link.name, "state": "BOUND",
            "address": address, "mac": link.mac})
    };
    // The holder's agent is replaced: the node's credential writes what
    // the attacker wants, and once it does, the agent is killed (its link
    // stays) with no gap in the heartbeat that would move the Service.
    let api = lb.rig.apiserver().context("API server")?;
    let mut forged = ForgedAgent::start(api, &holder_node, lease(&kubernetes));
    forged.wait_written(WITHIN)?;
    lb.signal_agent(holder, nix::sys::signal::Signal::SIGKILL);

    let why = lb.wait_warning("team-a/web", "AddressImplausible", WITHIN);
    ensure!(why.contains(&kubernetes), "{why}");
    for _ in 0..20 {
        let now = lb.ingress_ip("team-a/web");
        ensure!(
            now == Some(ip),
            "team-a/web's status changed to {now:?} on a forged report"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // The node claims the real address again and never lets go: the
    // deletion waits for it, but not for ever.
    forged.report(lease(&ip.to_string()));
    lb.delete_service("team-a/web")?;
    let deleted_at = Instant::now();
    let held = wait_for(Duration::from_secs(10), || {
        lb.service("team-a/web")
            .filter(|s| s.metadata.deletion_timestamp.is_some())
            .map(|_| ())
    });
    ensure!(
        held.is_some(),
        "the deletion was never held for the release"
    );
    let gone = wait_for(Duration::from_secs(60), || {
        lb.service("team-a/web").is_none().then_some(())
    });
    let took = deleted_at.elapsed();
    ensure!(
        gone.is_some(),
        "a node that never lets go held the deletion for over 60 s\n{}",
        lb.diagnostics()
    );
    ensure!(
        took >= Duration::from_secs(20),
        "the deletion did not wait for the holder at all ({took:?})"
    );
    // The Event is posted with the pass that lets the Service go, so it
    // may land just after the Service is gone.
    let said = wait_for(Duration::from_secs(10), || {
        lb.events("team-a/web")
            .iter()
            .any(|(_, r, _)| r == "ReleasedWithoutDHCPRelease")
            .then_some(())
    });
    ensure!(
        said.is_some(),
        "no ReleasedWithoutDHCPRelease Event: {:?}",
        lb.events("team-a/web")
    );
    forged.stop()?;
    Ok(())
}
