//! The real Harvester cloud provider in the loop (issue #31, item 4): the
//! guest CCM built from the shared peers folder's snapshot, run as Harvester
//! runs it (its `service` controller, its own credentials on both sides),
//! against the rig's API server as the guest cluster and a second API
//! server playing Harvester, with a stand-in for Harvester's load-balancer
//! controller (`hna_testkit::peers::harvester_ccm`). Users write their
//! Services as for Harvester and nothing of ours: the cloud provider writes
//! `kube-vip.io/loadbalancerIPs`, our agents and controller serve, the
//! cloud provider copies the address back to Harvester.

use std::net::Ipv4Addr;
use std::time::Duration;

use anyhow::{Result, ensure};
use hna_contract::{self, harvester, kube_vip};
use hna_testkit::lb::{self, LISTEN_PORT, LbRig, annotation, wait_for};
use hna_testkit::peers::harvester_ccm::{HarvesterSide, POOL};

use crate::harness::tests;

tests! {
    the_harvester_cloud_provider_and_we_serve_dhcp_share_it_and_leave_pool_mode_alone: Root, Iproute2, Dnsmasq, ApiServer, Socat, HarvesterCcm;
    a_snapshot_that_does_not_build_stops_the_prerequisites_with_the_command: KubeVip, MetalLb;
}

const WITHIN: Duration = Duration::from_secs(60);

fn options() -> lb::Options {
    lb::Options::new(
        crate::BIN,
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/kubernetes"),
    )
}

fn status_address(object: &serde_json::Value) -> Option<&str> {
    object["status"]["address"]
        .as_str()
        .filter(|a| !a.is_empty())
}

fn finalizers(lb: &LbRig, name: &str) -> Vec<String> {
    lb.service(name)
        .and_then(|s| s.metadata.finalizers)
        .unwrap_or_default()
}

/// A DHCP Service, a secondary sharing it and a pool-mode Service, each
/// written as a Harvester user writes it; then both DHCP ones deleted.
fn the_harvester_cloud_provider_and_we_serve_dhcp_share_it_and_leave_pool_mode_alone() -> Result<()>
{
    let lb = LbRig::start(options())?;
    let mut hv = HarvesterSide::start(&lb)?;
    let diagnostics = |lb: &LbRig, hv: &HarvesterSide| {
        format!(
            "{}\nHarvester objects: {:#?}\ncloud provider log:\n{}",
            lb.diagnostics(),
            hv.load_balancers(),
            hv.log_tail(30)
        )
    };

    // 1. DHCP: the user writes the IPAM mode only.
    lb.create_service("web", &[(harvester::IPAM, "dhcp")], &[LISTEN_PORT])?;
    let asked = wait_for(WITHIN, || {
        let svc = lb.service("web")?;
        (annotation(&svc, kube_vip::LOADBALANCER_IPS)? == kube_vip::ASK_DHCP).then_some(())
    });
    hv.check_running()?;
    ensure!(
        asked.is_some(),
        "the cloud provider never wrote {}={} on web:\n{}",
        kube_vip::LOADBALANCER_IPS,
        kube_vip::ASK_DHCP,
        diagnostics(&lb, &hv)
    );
    let ip = lb.wait_ingress("web", WITHIN);
    let holder = lb.tcp_from_client(ip, LISTEN_PORT)?;
    let carriers = lb.carriers(ip);
    ensure!(
        carriers.len() == 1 && carriers[0].0 == holder,
        "{ip} answered TCP from {holder}, held by {carriers:?}"
    );
    // Harvester learns the address: the cloud provider copies the status
    // back on the resync our annotations (written after the status) start.
    let learned = wait_for(WITHIN, || {
        let objects = hv.load_balancers_of("default", "web");
        (objects.len() == 1
            && objects[0]["spec"]["ipam"] == "dhcp"
            && status_address(&objects[0]) == Some(ip.to_string().as_str()))
        .then_some(())
    });
    ensure!(
        learned.is_some(),
        "Harvester's object for web never learned {ip}:\n{}",
        diagnostics(&lb, &hv)
    );
    println!("web: {ip}, held by {holder}; Harvester's object says so");

    // 2. Pool mode: Harvester's pool allocates, the cloud provider writes
    // it for kube-vip; none of ours touches it.
    lb.create_service("pooled", &[(harvester::IPAM, "pool")], &[LISTEN_PORT])?;
    let pooled_ip = wait_for(WITHIN, || {
        let svc = lb.service("pooled")?;
        annotation(&svc, kube_vip::LOADBALANCER_IPS)?
            .parse::<Ipv4Addr>()
            .ok()
    });
    ensure!(
        pooled_ip.is_some_and(|a| a >= POOL.0 && a <= POOL.1),
        "the cloud provider never wrote a pool address on `pooled`: {pooled_ip:?}\n{}",
        diagnostics(&lb, &hv)
    );

    // 3. A secondary, as its user writes it: its primary named. The cloud
    // provider writes the primary's address on it (and drops its IPAM
    // annotation); we share the primary's address.
    lb.create_service(
        "web-extra",
        &[
            (harvester::PRIMARY_SERVICE, "default/web"),
            (harvester::IPAM, "dhcp"),
        ],
        &[LISTEN_PORT + 1],
    )?;
    let shared = wait_for(WITHIN, || {
        let svc = lb.service("web-extra")?;
        (annotation(&svc, kube_vip::LOADBALANCER_IPS)? == ip.to_string()
            && lb.ingress_ip("web-extra") == Some(ip))
        .then_some(())
    });
    ensure!(
        shared.is_some(),
        "web-extra does not share {ip}:\n{}",
        diagnostics(&lb, &hv)
    );
    ensure!(
        hv.load_balancers_of("default", "web-extra").is_empty(),
        "a Harvester object for the secondary: {:#?}",
        hv.load_balancers()
    );
    // Decided after `pooled` was written: our controller saw it and left
    // it alone (no finalizer, no status, no link, no Event of ours).
    let pooled_ip = pooled_ip.unwrap_or(Ipv4Addr::UNSPECIFIED);
    ensure!(
        !finalizers(&lb, "pooled").contains(&hna_contract::FINALIZER.to_string()),
        "our finalizer on the pool-mode Service: {:?}",
        finalizers(&lb, "pooled")
    );
    ensure!(
        lb.ingress_ip("pooled").is_none(),
        "the pool-mode Service got a status: {:?}",
        lb.ingress_ip("pooled")
    );
    ensure!(
        lb.carriers(pooled_ip).is_empty(),
        "{pooled_ip} on a guest: {:?}",
        lb.carriers(pooled_ip)
    );
    ensure!(
        lb.our_events("pooled").is_empty(),
        "Events of ours on the pool-mode Service: {:?}",
        lb.our_events("pooled")
    );

    // 4. Deleted, secondary first (the cloud provider keeps a primary's
    // object while secondaries name it): no Harvester object, lease, link
    // or finalizer is left.
    let mac = lb
        .carriers(ip)
        .first()
        .map(|(_, l)| l.mac.clone())
        .unwrap_or_default();
    let mark = lb.dnsmasq_log_len();
    lb.delete_service("web-extra")?;
    let gone = wait_for(WITHIN, || lb.service("web-extra").is_none().then_some(()));
    ensure!(
        gone.is_some(),
        "web-extra still there: {:?}",
        lb.service("web-extra").map(|s| s.metadata.finalizers)
    );
    lb.delete_service("web")?;
    let gone = wait_for(WITHIN, || lb.service("web").is_none().then_some(()));
    ensure!(
        gone.is_some(),
        "web still there, finalizers {:?}:\n{}",
        finalizers(&lb, "web"),
        diagnostics(&lb, &hv)
    );
    let cleaned = wait_for(WITHIN, || {
        hv.load_balancers_of("default", "web")
            .is_empty()
            .then_some(())
    });
    ensure!(
        cleaned.is_some(),
        "Harvester's object for web left behind: {:#?}",
        hv.load_balancers()
    );
    lb.ensure_released("web", ip, &mac, mark)?;
    hv.check_running()?;
    Ok(())
}

/// Issue #31: the cloud provider's snapshot that does not build stops
/// `tests/rig/peers.sh` (and so `tests/rig/prereqs.sh`) naming the build
/// command that failed, and caches nothing. The snapshot is the real one;
/// the build fails because `go build` does (a `go` first on `PATH` that
/// refuses to build and passes every other command to the real one), as
/// a toolchain that cannot build it would. kube-vip and MetalLB come from
/// the real cache, so the script reaches the cloud provider.
fn a_snapshot_that_does_not_build_stops_the_prerequisites_with_the_command() -> Result<()> {
    use anyhow::Context as _;
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let real_go = ["/usr/local/go/bin/go", "/usr/bin/go"]
        .into_iter()
        .map(std::path::PathBuf::from)
        .chain(
            std::env::var_os("PATH")
                .map(|p| {
                    std::env::split_paths(&p)
                        .map(|d| d.join("go"))
                        .collect::<Vec<_>>()
                })
                .unwrap_or_default(),
        )
        .find(|p| p.is_file())
        .context("no `go` found (tests/rig/go-build.sh needs Go 1.26 or newer)")?;
    let cache = tempfile::tempdir()?;
    let peers = hna_testkit::locate::peers::peers_dir();
    std::fs::create_dir_all(cache.path().join("peers"))?;
    for built in ["kube-vip", "metallb"] {
        std::os::unix::fs::symlink(peers.join(built), cache.path().join("peers").join(built))?;
    }
    let bin = tempfile::tempdir()?;
    let fake_go = bin.path().join("go");
    std::fs::write(
        &fake_go,
        format!(
            "#!/bin/bash\nif [[ \"$1\" == build ]]; then echo 'go: this toolchain refuses to build' >&2; exit 1; fi\nexec {} \"$@\"\n",
            real_go.display()
        ),
    )?;
    std::fs::set_permissions(
        &fake_go,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )?;
    let path = std::env::join_paths(std::iter::once(bin.path().to_path_buf()).chain(
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()),
    ))?;
    let out = std::process::Command::new("bash")
        .arg(repo.join("tests/rig/peers.sh"))
        .env("HNA_CACHE_DIR", cache.path())
        .env("PATH", path)
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(
        !out.status.success(),
        "peers.sh succeeded with a `go` that cannot build:\n{err}"
    );
    let commit = hna_testkit::locate::peers::CCM_COMMIT;
    for said in [
        format!("go build failed: module harvester-cloud-provider, version {commit}"),
        "go build -trimpath".to_string(),
        "go: this toolchain refuses to build".to_string(),
    ] {
        ensure!(
            err.contains(&said),
            "{said:?} not in peers.sh's output:\n{err}"
        );
    }
    ensure!(
        !cache.path().join("peers/harvester-cloud-provider").exists(),
        "a cloud provider folder was cached after a failed build"
    );
    let scratch: Vec<_> = std::fs::read_dir(cache.path().join("build"))?
        .flatten()
        .map(|e| e.file_name())
        .collect();
    ensure!(scratch.is_empty(), "scratch folders left: {scratch:?}");
    Ok(())
}
