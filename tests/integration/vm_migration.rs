//! Issue #31: a holder that the hypervisor live-migrates, on real VMs.
//!
//! The LoadBalancer rig with one namespace guest and one VM node (Debian's
//! kernel under QEMU, the agent inside, the agent's credentials reaching
//! the API server through its NIC). The LAN is modelled as the field has
//! it: two hypervisor hosts, each with its own bridge, joined to the LAN's
//! learning switch (300 s ageing); the LAN client and the observer sit
//! behind the switch. The test is the hypervisor: it starts a second QEMU
//! with `-incoming` on the other host and migrates the VM into it through
//! QMP (`migrate`), as KubeVirt does between two virt-launchers.
//!
//! The Service is held by the VM (its only endpoint is there, traffic
//! policy `Local`). Two migrations, there and back, as a host upgrade and
//! its return:
//! 1. with a connection open from the LAN client, idle across the
//!    switchover, that sends its next byte as soon as the target runs:
//!    its echo shows when the switch sends the Service's MAC to the new
//!    host. Idle, because a server with data in flight retransmits it from
//!    the Service's MAC and so teaches the switch by itself; and no ARP
//!    prober runs meanwhile, since its broadcasts would make the new host
//!    answer from the Service's MAC too. Only the guest itself is left to
//!    do it: its kernel's announcement with virtio-net; with e1000e, the
//!    agent's presence frames (and its announcement once it sees the
//!    pause).
//! 2. with the observer asking ARP every 10 ms and a client opening a new
//!    connection every 100 ms: one MAC answers, new ARP is answered within
//!    1 s of the switchover, ARP never goes unanswered for 1 s, a new
//!    connection is served (within [`NEW_CONNECTION_BOUND`] under TCG),
//!    and no request is answered twice but those
//!    the target's tap queued before the switchover (the kernel holds
//!    what reaches a tap nobody reads yet, and the migrated guest answers
//!    it at its resume, with the same MAC).
//!
//! Throughout, nothing moves: no namespace guest's kernel ever holds the
//! address and the Service's status keeps it.
//!
//! And the migrations that do not complete: one cancelled and one whose
//! target dies leave the source serving as before, and a holder paused
//! for good (a stalled switchover that never resumes) is failed over like
//! any dead node.

use std::net::Ipv4Addr;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use hna_testkit::addrwatch::AddressWatch;
use hna_testkit::arpprobe::ArpProber;
use hna_testkit::failover::{self, guest_namespaces};
use hna_testkit::fdbwatch::FdbWatch;
use hna_testkit::lb::{self, LbRig, wait_for};
use hna_testkit::rig::{self, apiserver::ApiServer, apiserver::Binaries};
use hna_testkit::tcpprobe::{EchoProber, TcpProber};
use hna_testkit::vm;
use hna_testkit::vm::node::{ECHO_PORT, HELLO_PORT, Host, NicModel, VmNode, node_image};

use crate::harness::tests;
use crate::topology;

tests! {
    a_live_migrated_virtio_holder_keeps_serving_and_nothing_moves:
        Root, Iproute2, Dnsmasq, ApiServer, Socat, Qemu, VmKernel;
    a_live_migrated_e1000e_holder_keeps_serving_and_nothing_moves:
        Root, Iproute2, Dnsmasq, ApiServer, Socat, Qemu, VmKernel;
    a_long_paused_holder_leaves_the_mac_to_its_successor_within_a_second:
        Root, Iproute2, Dnsmasq, ApiServer, Socat, Qemu, VmKernel;
    a_failed_migration_leaves_the_source_serving_and_one_that_never_resumes_fails_over:
        Root, Iproute2, Dnsmasq, ApiServer, Socat, Qemu, VmKernel;
}

const VM_NODE: &str = "vm-1";
const VM_ADDR: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 90);
const VM_MAC: &str = "52:54:00:4d:00:5a";
/// Boot, agent start, membership and first DHCP lease of a debug agent
/// under TCG on a loaded 2-core machine.
const SERVED_WITHIN: Duration = Duration::from_secs(240);
/// The bound for the address to answer again after a switchover:
/// the switch sends the Service's MAC to the new host within it. With
/// virtio-net the guest's kernel announces at once.
const SWITCHOVER_BOUND: Duration = Duration::from_secs(1);
/// The open connection's next byte is retransmitted by the client's TCP
/// about 0.2, 0.6, 1.4 and 3.0 s after it was first sent (RTO 200 ms at
/// least, doubling): the first retransmission after the switch learned
/// is answered, at most this long after it.
const ECHO_AFTER_LEARNING: Duration = Duration::from_secs(2);

/// The nodes' `lb_address_lifetime` in the live migrations (the shipped
/// default is 1 s). QEMU's translation cache does not migrate: under TCG
/// the target translates every guest instruction anew as it first runs
/// it, and the debug agent's userland (tokio, the kube client, serde; no
/// inlining) is most of that. Measured here, 2026-11-28, with a probe in
/// the lease driver: after the switchover the agent's own cgroup used 85
/// to 100% of the vCPU for 1 to 4 s, its lifetime confirmations (due every
/// quarter lifetime) came up to 4.7 s late and one netlink round trip took
/// up to 3.5 s, so the address went unconfirmed for up to about 5.5 s. At
/// 1 s the kernel dropped the address in 10 of 14 runs (3 s: 1 of 2), the
/// agent took it back through INIT-REBOOT and the LAN lost it for up to
/// 3.3 s. That is the fence doing its job for a process that did not run,
/// as `vm_pause::` proves; KVM, the field's accelerator, runs guest code
/// natively and has no such warm-up. So the lifetime here is set past the
/// warm-up, and these tests measure the migration, not TCG.
const TCG_LIFETIME: Duration = Duration::from_secs(10);

/// A new connection is served by the tenant's listener, a busybox `nc`
/// that forks a shell per connection: under TCG the target retranslates
/// that too, beside the agent (above). Measured 0.24 to 1.44 s after the
/// switchover in 10 runs here (2026-11-28), while ARP was answered within
/// 0.21 s and never went silent for more than 42 ms: the 1 s is
/// met by the address (asserted on ARP, [`SWITCHOVER_BOUND`]), not by this
/// listener under TCG; the bound is what it holds.
const NEW_CONNECTION_BOUND: Duration = Duration::from_secs(3);

fn a_live_migrated_virtio_holder_keeps_serving_and_nothing_moves() -> Result<()> {
    migrate_a_holder(NicModel::VirtioNet)
}

/// The same with an e1000e: no announcement from the guest's kernel, only
/// QEMU's RARP for the NIC's own MAC; the agent's presence frames from the
/// Service's MAC teach the switch within the same second (and it
/// announces the address again when it sees the pause on the RTC).
fn a_live_migrated_e1000e_holder_keeps_serving_and_nothing_moves() -> Result<()> {
    migrate_a_holder(NicModel::E1000e)
}

/// The rig of these tests with its VM node booted on host A, holding
/// Service `web` (traffic policy `Local`, its one endpoint on the VM) and
/// serving it to the LAN client. Dropped VM first.
struct VmHolder {
    vm: VmNode,
    /// Harvester's side, for the topology relay, when asked for.
    harvester: Option<Harvester>,
    lb: LbRig,
    ip: Ipv4Addr,
    lan: String,
    kernel: vm::Kernel,
    image: vm::node::NodeImage,
    spec: vm::node::NodeSpec,
    dir: std::path::PathBuf,
}

/// Harvester's side of the topology relay (issue #31 item 5), as the
/// topology tests build it (`crate::topology`): a second API server with
/// the VirtualMachineInstance CRD, host Nodes hv-1 (us-east-1 /
/// us-east-1a) and hv-2 (us-east-1 / us-east-1b), the VM node's
/// VirtualMachineInstance on hv-1, and the cloud-provider kubeconfig made
/// as `generate_addon.sh` makes it, naming the server at a path on the LAN
/// (the VM reaches it through its NIC, as a guest reaches Harvester's VIP).
struct Harvester {
    admin: kube::Client,
    /// The guest cluster's admin, to read the VM node's labels.
    guest_admin: kube::Client,
    rt: tokio::runtime::Runtime,
    _server: ApiServer,
}

/// How soon the guest Node's labels must follow a migration that
/// completed (the VirtualMachineInstance's new host and zone). The issue
/// asks 1 s; measured 328-672 ms in 17 runs here, so the bound leaves room
/// for a loaded CI machine running other rig tests beside this VM under
/// TCG. (Runs that waited 10 s and more were the rig's host bridge
/// answering the VM's ARP for the LAN's addresses: see
/// `Rig::add_host_bridge`.)
const TOPOLOGY_BOUND: Duration = Duration::from_secs(3);

impl Harvester {
    /// Starts it for `lb`'s VM node and puts the cloud-provider kubeconfig
    /// into `spec`.
    fn start(lb: &mut LbRig, spec: &mut vm::node::NodeSpec) -> Result<Harvester> {
        let dir = lb.rig.dir().join("harvester");
        std::fs::create_dir_all(&dir)?;
        let bins = Binaries::find().map_err(anyhow::Error::msg)?;
        let server = ApiServer::start(&dir, &format!("{}-hv", lb.rig.id()), &bins, &[])
            .context("starting the Harvester API server")?;
        let listen = lb.lan_path_to(server.port())?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let cloud_config = dir.join("cloud-config");
        let guest_kubeconfig = lb
            .rig
            .apiserver()
            .context("API server")?
            .admin_kubeconfig()
            .to_path_buf();
        let (admin, guest_admin) = rt.block_on(async {
            let admin = rig::kube_client(server.admin_kubeconfig()).await?;
            topology::setup_harvester(&admin).await?;
            topology::service_account_via(
                &admin,
                &server,
                &format!("https://{listen}"),
                "vm-1-cloud-provider",
                true,
                true,
                &cloud_config,
            )
            .await?;
            topology::create_vmi(&admin, VM_NODE, "hv-1", "us-east-1", "us-east-1a").await?;
            let guest_admin = rig::kube_client(&guest_kubeconfig).await?;
            anyhow::Ok((admin, guest_admin))
        })?;
        spec.files.push((
            "/etc/kubernetes/cloud-config".into(),
            std::fs::read(&cloud_config)?,
        ));
        Ok(Harvester {
            admin,
            guest_admin,
            rt,
            _server: server,
        })
    }

    /// How long after `from` the VM node's zone label became `zone` (the
    /// labels read every 20 ms), within `within`.
    fn zone_within(&self, zone: &str, from: Instant, within: Duration) -> Result<Duration> {
        self.rt.block_on(async {
            loop {
                let labels = topology::guest_labels(&self.guest_admin, VM_NODE).await;
                if labels.get(topology::ZONE).map(String::as_str) == Some(zone) {
                    return Ok(from.elapsed());
                }
                ensure!(
                    from.elapsed() < within,
                    "{VM_NODE}'s zone is not {zone} within {within:?}: labels {labels:?}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    }

    /// KubeVirt's and Harvester's part as a migration completes: the VMI's
    /// new host, and that host's region and zone copied onto it.
    fn migrated_to(&self, host: &str, region: &str, zone: &str) -> Result<()> {
        self.rt.block_on(topology::patch_vmi(
            &self.admin,
            VM_NODE,
            serde_json::json!({
                "metadata": {"annotations": {topology::REGION: region, topology::ZONE: zone}},
                "status": {"nodeName": host, "migrationState": {"completed": true}},
            }),
        ))
    }
}

impl VmHolder {
    /// At the shipped address lifetime.
    fn start(nic: NicModel) -> Result<VmHolder> {
        Self::start_with(nic, false, None)
    }

    /// With `topology`, Harvester's side of the topology relay too
    /// ([`Harvester`]), and the VM node's labels from it before the
    /// Service is made; with `lifetime`, every node's
    /// `lb_address_lifetime` set to it.
    fn start_with(nic: NicModel, topology: bool, lifetime: Option<Duration>) -> Result<VmHolder> {
        let mut lb = LbRig::start(lb::Options {
            guests: 1,
            controllers: 1,
            vm_nodes: vec![VM_NODE.to_string()],
            agent_config: lifetime
                .map(|l| format!("lb_address_lifetime = \"{}s\"\n", l.as_secs()))
                .unwrap_or_default(),
            ..lb::Options::new(
                crate::BIN,
                Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/kubernetes"),
            )
        })?;
        lb.rig.add_host_bridge("hostA")?;
        lb.rig.add_host_bridge("hostB")?;
        let lan = lb.rig.lan_ns().to_string();
        let mut spec = lb.vm_node_spec(VM_NODE, VM_ADDR, VM_MAC, nic)?;
        let harvester = if topology {
            Some(Harvester::start(&mut lb, &mut spec)?)
        } else {
            None
        };
        let kernel = vm::kernel()?;
        let image = node_image(&kernel, &spec)?;
        let dir = lb.rig.dir().join("vm-1");
        let mut vm = VmNode::start(
            &kernel,
            &image,
            &spec,
            &host(&lan, "hostA", "tapA"),
            &dir.join("a"),
            None,
        )?;
        vm.wait_console(
            vm::node::AGENT_STARTED,
            Instant::now() + Duration::from_secs(120),
        )?;
        if let Some(hv) = &harvester {
            let took = hv.zone_within("us-east-1a", vm.started, SERVED_WITHIN);
            ensure!(took.is_ok(), "{took:?}; console:\n{}", vm.console_tail(60));
        }
        let ip = served_by_the_vm(&lb, "web", &vm)?;
        Ok(VmHolder {
            vm,
            harvester,
            lb,
            ip,
            lan,
            kernel,
            image,
            spec,
            dir,
        })
    }
}

/// DHCP Service `name` (traffic policy `Local`, its one endpoint on the
/// VM node) made and served by the VM to the LAN client: its address.
fn served_by_the_vm(lb: &LbRig, name: &str, vm: &VmNode) -> Result<Ipv4Addr> {
    lb.set_endpoints(name, &[VM_NODE.to_string()])?;
    lb.create_service_with(
        name,
        &[(failover::IPAM, "dhcp")],
        &[HELLO_PORT],
        serde_json::json!({"externalTrafficPolicy": "Local"}),
    )?;
    let ip = lb.wait_ingress(name, SERVED_WITHIN);
    let served = wait_for(SERVED_WITHIN, || {
        (lb.tcp_from_client(ip, HELLO_PORT).ok()? == VM_NODE).then_some(())
    });
    ensure!(
        served.is_some(),
        "{name} ({ip}) is not served by {VM_NODE} from the LAN; console:\n{}",
        vm.console_tail(60)
    );
    Ok(ip)
}

/// Host `bridge` of the LAN namespace `lan`, the VM's NIC on its `tap`.
fn host(lan: &str, bridge: &str, tap: &str) -> Host {
    Host {
        netns: lan.to_string(),
        bridge: bridge.to_string(),
        tap: tap.to_string(),
    }
}

fn migrate_a_holder(nic: NicModel) -> Result<()> {
    let _turn = vm::turn();
    // The topology relay follows the first migration (virtio only: the
    // relay does not depend on the NIC).
    let VmHolder {
        mut vm,
        harvester,
        lb,
        ip,
        lan,
        kernel,
        image,
        spec,
        dir,
    } = VmHolder::start_with(nic, nic == NicModel::VirtioNet, Some(TCG_LIFETIME))?;
    let host = |bridge: &str, tap: &str| host(&lan, bridge, tap);
    let watch = AddressWatch::start(&guest_namespaces(&lb))?;
    let t0 = Instant::now();
    let service_mac = neighbour_mac(&lb.client_ns, ip)?;
    let fdb = FdbWatch::start(&lan, "hostA-sw")?;

    // 1. There, with a connection open and idle across the switchover (its
    //    last echoes acknowledged: nothing in flight either way, so nothing
    //    the server sends on its own can teach the switch), its next byte
    //    sent as soon as the target runs.
    let echo = EchoProber::start(&lb.client_ns, ip, ECHO_PORT, Duration::from_millis(10))?;
    echo.set_sending(false);
    std::thread::sleep(Duration::from_millis(500));
    let (vm_b, there) = migrate(
        &mut vm,
        &kernel,
        &image,
        &spec,
        &host("hostB", "tapB"),
        &dir.join("b"),
    )?;
    echo.set_sending(true);
    vm.kill();
    drop(vm);
    let mut vm = vm_b;
    std::thread::sleep(Duration::from_secs(5));
    let echoes = echo.finish()?;
    let after_switchover = echoes
        .echoed
        .iter()
        .find(|t| **t >= there.resumed)
        .map(|t| *t - there.resumed);
    // From when the migration began: the source never sends from the new
    // host's port, and the target may run (and announce) a poll of its
    // monitor before `resumed` says so; learned before it counts as 0.
    let switch_learned = fdb
        .learned(&service_mac, "hostB-sw", there.began)
        .map(|t| t.saturating_duration_since(there.resumed));
    eprintln!(
        "vm_migration ({nic:?}): there: qemu downtime {:?}, total {:?}; the switch sent {service_mac} to the new host {switch_learned:?} after the switchover; the idle connection's next byte echoed {after_switchover:?} after it",
        there.downtime, there.total,
    );
    // With virtio-net the guest's kernel announces; with an e1000e nothing
    // in the guest is told of the migration, and the agent's presence
    // frames (`lb_presence = "auto"`), sent every half second from a
    // thread of their own, teach the switch whether or not the agent saw
    // the pause on the RTC, whose seconds change up to a second after the
    // resume (0.13 to 2.05 s measured here before they were sent).
    let bound = SWITCHOVER_BOUND;
    ensure!(
        switch_learned.is_some_and(|d| d <= bound),
        "the switch learned the Service's MAC {service_mac} on the new host's port {switch_learned:?} after the switchover (bound {bound:?}); console:\n{}",
        vm.console_tail(40)
    );
    ensure!(
        after_switchover.is_some_and(|d| d <= bound + ECHO_AFTER_LEARNING),
        "the open connection's first echo after the switchover came {after_switchover:?} after it (bound {:?})",
        bound + ECHO_AFTER_LEARNING
    );
    let (gap, _) = echoes.longest_gap();
    ensure!(
        echoes.ended.is_some_and(|e| echoes
            .echoed
            .last()
            .is_some_and(|l| e - *l < SWITCHOVER_BOUND)),
        "the open connection stopped echoing after the migration (longest gap {gap:?})"
    );
    if let Some(hv) = &harvester {
        // Now running on host B: KubeVirt and Harvester say so.
        let patched = Instant::now();
        hv.migrated_to("hv-2", "us-east-1", "us-east-1b")?;
        let took = hv
            .zone_within("us-east-1b", patched, Duration::from_secs(10))
            .with_context(|| {
                let sh = |args: &[&str]| {
                    std::process::Command::new("ip")
                        .args(["-n", &lan])
                        .args(args)
                        .output()
                        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                        .unwrap_or_default()
                };
                format!(
                    "the switch's record of the VM's NIC {VM_MAC} (times from the switchover): {:?}; LAN neighbours:\n{}\nconsole:\n{}",
                    fdb.events()
                        .into_iter()
                        .filter(|(_, l)| l.starts_with(VM_MAC))
                        .map(|(t, l)| format!(
                            "{:+.3}s {l}",
                            t.saturating_duration_since(there.resumed).as_secs_f64()
                                - there.resumed.saturating_duration_since(t).as_secs_f64()
                        ))
                        .collect::<Vec<_>>(),
                    sh(&["neigh", "show"]),
                    vm.console_tail(60)
                )
            })?;
        eprintln!(
            "vm_migration ({nic:?}): the VM node's zone label followed its VirtualMachineInstance to hv-2 {took:?} after the change"
        );
        ensure!(
            took <= TOPOLOGY_BOUND,
            "the zone label followed the migration {took:?} after the VMI changed (bound {TOPOLOGY_BOUND:?})"
        );
    }

    // 2. Back, with ARP asked every 10 ms and new connections.
    let arp = ArpProber::start(
        &lb.observer.ns,
        "eth0",
        lb.observer.addr,
        ip,
        Duration::from_millis(10),
    )?;
    let tcp = TcpProber::start(&lb.client_ns, ip, HELLO_PORT, Duration::from_millis(100))?;
    let (vm_a, back) = migrate(
        &mut vm,
        &kernel,
        &image,
        &spec,
        &host("hostA", "tapA2"),
        &dir.join("a2"),
    )?;
    vm.kill();
    drop(vm);
    let vm = vm_a;
    std::thread::sleep(Duration::from_secs(5));
    let arp = arp.finish()?;
    let tcp = tcp.finish()?;
    let switch_learned_back = fdb
        .learned(&service_mac, "hostA-sw", back.began)
        .map(|t| t.saturating_duration_since(back.resumed));
    let first_arp = arp
        .probes
        .iter()
        .filter(|p| p.sent >= back.resumed && !p.replies.is_empty())
        .map(|p| p.replies[0].0 - back.resumed)
        .next();
    let first_tcp = tcp
        .tries
        .iter()
        .find(|t| t.sent >= back.resumed && t.answer.as_deref() == Some(VM_NODE))
        .map(|t| t.sent - back.resumed);
    eprintln!(
        "vm_migration ({nic:?}): back: qemu downtime {:?}, total {:?}; the switch sent the MAC to the new host {switch_learned_back:?}, first ARP answer {first_arp:?} and first new connection {first_tcp:?} after the switchover; longest ARP silence {:?}",
        back.downtime,
        back.total,
        arp.longest_silence()
    );
    // The target's tap is on its host's bridge from the moment the target
    // QEMU starts (as a target virt-launcher's is), and the kernel queues
    // what reaches it (the LAN's broadcasts: these ARP requests) until the
    // migrated guest runs and reads it: at its resume the guest answers
    // every request of the migration's last stretch a second time, with
    // the same MAC. Those are the only second answers allowed: to a
    // request sent before the switchover, within the drain of that queue,
    // naming the MAC of the first answer. The second answer may come a
    // poll of the target's monitor before `resumed` says it runs (CI saw
    // 0.8 ms): counted from the start of QEMU's downtime, when the source
    // stopped (neither guest runs during it, so nothing in it or after it
    // is the source's).
    let drain = Duration::from_secs(2);
    let source_stopped = back
        .resumed
        .checked_sub(back.downtime.unwrap_or_default())
        .unwrap_or(back.resumed);
    let rel = |t: Instant| {
        if t >= back.resumed {
            format!("+{:?}", t - back.resumed)
        } else {
            format!("-{:?}", back.resumed - t)
        }
    };
    let mut queued = 0;
    let mut wrong = Vec::new();
    for p in arp.probes.iter().filter(|p| p.replies.len() > 1) {
        let first_mac = p.replies[0].1;
        let replayed = p.sent < back.resumed
            && p.replies.len() == 2
            && p.replies[1].1 == first_mac
            && p.replies[1].0 >= source_stopped
            && p.replies[1].0.saturating_duration_since(back.resumed) <= drain;
        if replayed {
            queued += 1;
        } else if wrong.len() < 6 {
            let replies: Vec<String> = p
                .replies
                .iter()
                .map(|(t, mac)| format!("{} {}", rel(*t), mac_text(mac)))
                .collect();
            wrong.push(format!("sent {}: {}", rel(p.sent), replies.join(", ")));
        }
    }
    let macs = answering_macs(&arp);
    eprintln!(
        "vm_migration ({nic:?}): back: {queued} ARP requests queued on the target's tap answered again at its resume; MACs that answered: {macs:?}"
    );
    ensure!(
        wrong.is_empty(),
        "ARP requests answered twice other than those queued for the target (times from the switchover): {wrong:#?}"
    );
    ensure!(
        macs.len() == 1,
        "more than one MAC answered for {ip}: {macs:?}"
    );
    ensure!(
        first_arp.is_some_and(|d| d <= SWITCHOVER_BOUND),
        "new ARP first answered {first_arp:?} after the switchover (bound {SWITCHOVER_BOUND:?})"
    );
    // The address answered throughout: a lifetime that ran out (or a
    // release, a handover) shows here as a silence, also after the first
    // answers came.
    ensure!(
        arp.longest_silence() <= SWITCHOVER_BOUND,
        "the address went unanswered for {:?} (bound {SWITCHOVER_BOUND:?}); console:\n{}",
        arp.longest_silence(),
        vm.console_tail(60)
    );
    ensure!(
        first_tcp.is_some_and(|d| d <= NEW_CONNECTION_BOUND),
        "a new connection was first served {first_tcp:?} after the switchover; console:\n{}",
        vm.console_tail(60)
    );
    ensure!(
        tcp.tries
            .iter()
            .all(|t| t.answer.as_deref() != Some(&lb.node_name(0))),
        "the namespace guest served {ip} during the migrations"
    );

    // Nothing moved.
    let others = watch.held_by_in(ip, t0, Instant::now());
    ensure!(
        others.is_empty(),
        "{ip} was held by namespace guest(s) {others:?} during the migrations"
    );
    ensure!(
        lb.wait_ingress("web", Duration::from_secs(5)) == ip,
        "the Service's address changed"
    );
    ensure!(
        lb.assigned_to(VM_NODE, "default/web"),
        "web is no longer assigned to {VM_NODE}: {:?}",
        lb.node_object(VM_NODE)
    );
    drop(vm);
    Ok(())
}

/// How long the holder is paused: far past its witnesses' verdict (1.25 s),
/// as a stalled switchover, `virtctl pause` or a storage error leave it.
const LONG_PAUSE: Duration = Duration::from_secs(8);
/// What the resumed kernel may still answer on its own, before its agent
/// silences the address: requests sent up to this long after the resume
/// (those queued while it was paused are answered too), the 100
/// ms. The agent's pause watch reads the RTC every 50 ms on a thread of
/// its own and sets every LoadBalancer link down in the wake-up that sees
/// the pause. Measured here (2026-11-29, TCG, debug agent): no request
/// sent after the resume was answered twice in 3 runs, and the switch
/// was back on the new holder for good 79 to 107 ms after it (before, with
/// the watch a runtime task and the links going only with the handover:
/// requests sent up to 0.65 s after the resume were).
const RESUME_GRACE: Duration = Duration::from_millis(100);

/// The VM holding the Service is paused (`stop`) for 8 s; the namespace
/// guest, its witness and the Service's other endpoint, takes the Service
/// over meanwhile with the same MAC. At `cont` the resumed kernel still has
/// the address (its clocks did not count the pause) and answers the ARP
/// requests queued for it, from the Service's MAC, so the switch sends
/// that MAC to the VM's host again. The agent sees the pause on the RTC
/// and drops every address without announcing it; the new holder
/// announces the address again twice a second for a while after its
/// takeover. Twice:
/// 1. with the observer asking ARP every 10 ms throughout (the new holder
///    answers each from the Service's MAC too): no request is answered
///    twice but those sent before the resume (plus [`RESUME_GRACE`]);
/// 2. with ARP asked only during the pause (a client that then keeps its
///    cached entry and sends no broadcast): only the new holder's
///    announcements can bring the switch back.
///
/// Held each time: the switch sends the MAC back to the new holder within
/// 1 s of each move to the VM's host after the resume, and ends there; the
/// new holder serves; the resumed agent said why it let go.
fn a_long_paused_holder_leaves_the_mac_to_its_successor_within_a_second() -> Result<()> {
    let _turn = vm::turn();
    let VmHolder {
        mut vm,
        lb,
        ip,
        lan,
        ..
    } = VmHolder::start(NicModel::VirtioNet)?;
    let successor = lb.node_name(0);
    let watch = AddressWatch::start(&guest_namespaces(&lb))?;
    let fdb = FdbWatch::start(&lan, "hostA-sw")?;
    // A Service of its own for each round: the first's former holder is
    // avoided for it a while after it could not serve it.
    for (asked_throughout, name) in [(true, "web"), (false, "web2")] {
        let ip = if name == "web" {
            ip
        } else {
            served_by_the_vm(&lb, name, &vm)?
        };
        let service_mac = neighbour_mac(&lb.client_ns, ip)?;
        // The namespace guest may hold it too from now on.
        lb.set_endpoints(name, &[VM_NODE.to_string(), successor.clone()])?;
        std::thread::sleep(Duration::from_secs(1));
        let arp = ArpProber::start(
            &lb.observer.ns,
            "eth0",
            lb.observer.addr,
            ip,
            Duration::from_millis(10),
        )?;
        let stopped = Instant::now();
        vm.qmp().execute("stop", serde_json::json!({}))?;
        let taken = wait_for(LONG_PAUSE, || watch.taken_by_other(ip, usize::MAX, stopped));
        let arp = if asked_throughout {
            Some(arp)
        } else {
            std::thread::sleep(Duration::from_secs(1));
            arp.finish()?;
            None
        };
        std::thread::sleep(LONG_PAUSE.saturating_sub(stopped.elapsed()));
        let resumed = Instant::now();
        vm.qmp().execute("cont", serde_json::json!({}))?;
        std::thread::sleep(Duration::from_secs(5));
        let arp = arp.map(|a| a.finish()).transpose()?;
        let Some((taken_at, _)) = taken else {
            anyhow::bail!(
                "{ip} not taken over by {successor} during the {LONG_PAUSE:?} pause of {VM_NODE}\n{}",
                lb.diagnostics()
            );
        };
        let phase = if asked_throughout {
            "ARP asked throughout"
        } else {
            "ARP asked during the pause only"
        };
        let rel = |t: Instant| failover::offset_ms(t, resumed);
        let moves = fdb.moves(&service_mac, "br0", taken_at);
        let story: Vec<String> = moves
            .iter()
            .map(|(t, port)| format!("{} {port}", rel(*t)))
            .collect();
        eprintln!(
            "vm_migration (long pause, {phase}): taken over {:.0} ms after the stop; the switch's port for {service_mac} from then on (times from the resume): {story:?}",
            (taken_at - stopped).as_secs_f64() * 1e3
        );
        let successor_port = "vg1";
        ensure!(
            moves.last().is_some_and(|(_, p)| p == successor_port),
            "{phase}: the switch does not send {service_mac} to the new holder's port {successor_port} at the end: {story:?}"
        );
        for (k, (t, port)) in moves.iter().enumerate() {
            if *t < resumed || port == successor_port {
                continue;
            }
            let back = moves[k + 1..]
                .iter()
                .find(|(_, p)| p == successor_port)
                .map(|(b, _)| *b - *t);
            ensure!(
                back.is_some_and(|d| d <= SWITCHOVER_BOUND),
                "{phase}: the switch sent {service_mac} to {port} at {} and back to the new holder {back:?} later (bound {SWITCHOVER_BOUND:?}): {story:?}",
                rel(*t)
            );
        }
        if let Some(arp) = arp {
            let doubly = arp.doubly_answered();
            let late: Vec<String> = doubly
                .iter()
                .filter(|sent| **sent >= resumed + RESUME_GRACE)
                .take(6)
                .map(|sent| rel(*sent))
                .collect();
            let last_after_resume = doubly
                .iter()
                .filter(|sent| **sent >= resumed)
                .max()
                .map(|sent| rel(*sent));
            eprintln!(
                "vm_migration (long pause, {phase}): {} ARP requests answered twice, {} of them sent after the resume's {RESUME_GRACE:?}; the last sent {last_after_resume:?} (from the resume)",
                doubly.len(),
                late.len()
            );
            ensure!(
                late.is_empty(),
                "ARP requests sent after the resume's grace answered twice (sent at, from the resume): {late:?}"
            );
        }
        let answer = lb.tcp_from_client(ip, HELLO_PORT)?;
        ensure!(
            answer == successor,
            "{phase}: {ip} answered by `{answer}` after the resume, not by the new holder {successor}"
        );
    }
    ensure!(
        vm.console_text()
            .matches("every address handed over at once")
            .count()
            == 2,
        "the resumed agent did not hand its addresses over for each pause; console:\n{}",
        vm.console_tail(40)
    );
    Ok(())
}

/// How fast the migrations that must not complete copy the VM's memory
/// (QEMU's `max-bandwidth`, bytes a second): slow enough that they are
/// still copying when the test cancels them or kills their target.
const SLOW_MIGRATION: u64 = 1 << 20;

/// How soon a holder paused for good is failed over, as a dead node is:
/// once its address lifetime ([`TCG_LIFETIME`] in that test) has fenced
/// it, and its witnesses' verdict and the controller's move (1.52 to 1.61
/// s in all at the shipped 1 s, measured by the long-pause test).
const NEVER_RESUMES_MOVED_WITHIN: Duration = Duration::from_secs(TCG_LIFETIME.as_secs() + 5);

/// A migration of the holder that is cancelled (QMP `migrate_cancel`) and
/// one whose target QEMU dies while it copies (as a target virt-launcher
/// that crashes or is evicted): each time the source keeps running and
/// serving as before, at [`TCG_LIFETIME`] as the live migrations (under
/// TCG the copy's dirty-page tracking slows the guest: at the shipped 1 s
/// a CI-like run beside other tests starved the agent past its lifetime,
/// the address went for 1.3 s and the lease back to INIT). Read from the
/// LAN, throughout both: ARP (every 10 ms) never goes unanswered for
/// [`SWITCHOVER_BOUND`], one MAC answers, no request is answered twice,
/// every new connection (every 100 ms) is served by the VM, the switch
/// never sends the Service's MAC to the target's host, and nothing moves.
/// Then the VM is paused for good (`stop`, never `cont`: a switchover that
/// never resumes): the namespace guest takes the Service over within
/// [`NEVER_RESUMES_MOVED_WITHIN`] and serves it, as for a dead node.
fn a_failed_migration_leaves_the_source_serving_and_one_that_never_resumes_fails_over() -> Result<()>
{
    let _turn = vm::turn();
    let VmHolder {
        mut vm,
        lb,
        ip,
        lan,
        kernel,
        image,
        spec,
        dir,
        ..
    } = VmHolder::start_with(NicModel::VirtioNet, false, Some(TCG_LIFETIME))?;
    let watch = AddressWatch::start(&guest_namespaces(&lb))?;
    let service_mac = neighbour_mac(&lb.client_ns, ip)?;
    let fdb = FdbWatch::start(&lan, "hostA-sw")?;
    let arp = ArpProber::start(
        &lb.observer.ns,
        "eth0",
        lb.observer.addr,
        ip,
        Duration::from_millis(10),
    )?;
    let tcp = TcpProber::start(&lb.client_ns, ip, HELLO_PORT, Duration::from_millis(100))?;
    let t0 = Instant::now();
    vm.qmp().execute(
        "migrate-set-parameters",
        serde_json::json!({"max-bandwidth": SLOW_MIGRATION}),
    )?;
    for (round, ending) in ["cancelled", "target killed"].into_iter().enumerate() {
        let (mut target, socket) = start_target(
            &kernel,
            &image,
            &spec,
            &host(&lan, "hostB", &format!("tapB{round}")),
            &dir.join(format!("target-{round}")),
        )?;
        vm.qmp().execute(
            "migrate",
            serde_json::json!({"uri": format!("unix:{}", socket.display())}),
        )?;
        let copying = wait_for(Duration::from_secs(30), || {
            let info = vm
                .qmp()
                .execute("query-migrate", serde_json::json!({}))
                .ok()?;
            (info["status"].as_str() == Some("active")).then_some(info)
        })
        .context("the migration never began copying")?;
        // A second of copying, far from done at this pace.
        std::thread::sleep(Duration::from_secs(1));
        if round == 0 {
            vm.qmp().execute("migrate_cancel", serde_json::json!({}))?;
        } else {
            target.kill();
        }
        let want = if round == 0 { "cancelled" } else { "failed" };
        let ended = wait_for(Duration::from_secs(30), || {
            let info = vm
                .qmp()
                .execute("query-migrate", serde_json::json!({}))
                .ok()?;
            (info["status"].as_str() == Some(want)).then_some(())
        });
        ensure!(
            ended.is_some(),
            "{ending}: the migration did not end `{want}` (it began as {copying})"
        );
        let status = vm.qmp().execute("query-status", serde_json::json!({}))?;
        ensure!(
            status["status"].as_str() == Some("running"),
            "{ending}: the source is {status}, not running"
        );
        drop(target);
        // Served as before for a while after.
        std::thread::sleep(Duration::from_secs(3));
    }
    let arp = arp.finish()?;
    let tcp = tcp.finish()?;
    let macs = answering_macs(&arp);
    // Each try has 300 ms to connect and read; the VM's listener forks a
    // shell per connection under TCG, which misses that now and then, so
    // what is held is that the VM kept serving, not every try.
    let by_others: Vec<&str> = tcp
        .tries
        .iter()
        .filter_map(|t| t.answer.as_deref())
        .filter(|a| *a != VM_NODE)
        .collect();
    let served = tcp.answered();
    let longest_unserved = served
        .windows(2)
        .map(|w| w[1] - w[0])
        .max()
        .unwrap_or_default();
    eprintln!(
        "vm_migration (failed migrations): longest ARP silence {:?}; {} of {} new connections served by {VM_NODE}, the longest stretch without one {longest_unserved:?}",
        arp.longest_silence(),
        served.len(),
        tcp.tries.len()
    );
    ensure!(
        arp.longest_silence() <= SWITCHOVER_BOUND,
        "the address went unanswered for {:?} during the failed migrations; console:\n{}",
        arp.longest_silence(),
        vm.console_tail(60)
    );
    ensure!(
        macs.len() == 1,
        "more than one MAC answered for {ip}: {macs:?}"
    );
    ensure!(
        arp.most_answers() <= 1,
        "ARP requests answered twice during the failed migrations: {:?}",
        arp.doubly_answered()
    );
    ensure!(
        by_others.is_empty(),
        "new connections served by {by_others:?} during the failed migrations"
    );
    ensure!(
        longest_unserved <= NEW_CONNECTION_BOUND,
        "no new connection served for {longest_unserved:?} during the failed migrations (bound {NEW_CONNECTION_BOUND:?})"
    );
    let to_b = fdb.learned(&service_mac, "hostB-sw", t0);
    ensure!(
        to_b.is_none(),
        "the switch sent the Service's MAC to the target's host during a migration that did not complete"
    );
    ensure!(
        watch.held_by_in(ip, t0, Instant::now()).is_empty()
            && lb.assigned_to(VM_NODE, "default/web"),
        "{ip} moved during the failed migrations: {:?}",
        lb.node_object(VM_NODE)
    );

    // Paused for good.
    let successor = lb.node_name(0);
    lb.set_endpoints("web", &[VM_NODE.to_string(), successor.clone()])?;
    std::thread::sleep(Duration::from_secs(1));
    let stopped = Instant::now();
    vm.qmp().execute("stop", serde_json::json!({}))?;
    let taken = wait_for(NEVER_RESUMES_MOVED_WITHIN, || {
        watch.taken_by_other(ip, usize::MAX, stopped)
    });
    let Some((taken_at, _)) = taken else {
        anyhow::bail!(
            "{ip} not taken over within {NEVER_RESUMES_MOVED_WITHIN:?} of {VM_NODE} pausing for good\n{}",
            lb.diagnostics()
        );
    };
    let served = wait_for(Duration::from_secs(10), || {
        (lb.tcp_from_client(ip, HELLO_PORT).ok()? == successor).then_some(())
    });
    eprintln!(
        "vm_migration (never resumes): taken over {:.0} ms after the stop",
        (taken_at - stopped).as_secs_f64() * 1e3
    );
    ensure!(
        served.is_some(),
        "{ip} not served by {successor} after {VM_NODE} paused for good"
    );
    ensure!(
        lb.assigned_to(&successor, "default/web"),
        "web not assigned to {successor}: {:?}",
        lb.node_object(&successor)
    );
    vm.kill();
    Ok(())
}

/// Starts the target on `to` and migrates `source` into it; returns the
/// target (running) and the migration. The source is left paused, as QEMU
/// leaves it; the caller kills it.
fn migrate(
    source: &mut VmNode,
    kernel: &vm::Kernel,
    image: &vm::node::NodeImage,
    spec: &vm::node::NodeSpec,
    to: &Host,
    dir: &Path,
) -> Result<(VmNode, vm::node::Migration)> {
    let (mut target, socket) = start_target(kernel, image, spec, to, dir)?;
    let migration = source.migrate_to(
        &mut target,
        &socket,
        Instant::now() + Duration::from_secs(180),
    )?;
    Ok((target, migration))
}

/// A migration's target on `to`, paused and waiting on its incoming
/// socket (returned), as a target virt-launcher is before the copy.
fn start_target(
    kernel: &vm::Kernel,
    image: &vm::node::NodeImage,
    spec: &vm::node::NodeSpec,
    to: &Host,
    dir: &Path,
) -> Result<(VmNode, std::path::PathBuf)> {
    let socket = dir.join("incoming.sock");
    std::fs::create_dir_all(dir)?;
    let target = VmNode::start(kernel, image, spec, to, dir, Some(&socket))?;
    wait_for(Duration::from_secs(30), || socket.exists().then_some(()))
        .context("the target's incoming socket")?;
    Ok((target, socket))
}

/// Every MAC that answered ARP in `arp`.
fn answering_macs(arp: &hna_testkit::arpprobe::ArpRecord) -> std::collections::BTreeSet<String> {
    arp.probes
        .iter()
        .flat_map(|p| p.replies.iter().map(|(_, m)| mac_text(m)))
        .collect()
}

fn mac_text(mac: &[u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// The MAC namespace `ns` holds for `ip` in its neighbour table (the
/// Service's MAC, after a connection to it).
fn neighbour_mac(ns: &str, ip: Ipv4Addr) -> Result<String> {
    let out = std::process::Command::new("ip")
        .args(["-n", ns, "neigh", "show", &ip.to_string()])
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .skip_while(|w| *w != "lladdr")
        .nth(1)
        .map(str::to_lowercase)
        .with_context(|| format!("no neighbour entry for {ip} in {ns}: {text:?}"))
}
