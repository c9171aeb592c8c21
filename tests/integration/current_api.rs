//! What only a current API server proves (issue #18), on the rig's real
//! kube-apiserver with the shipped manifests: `spec.loadBalancerClass`,
//! `status.loadBalancer.ingress[].ipMode`, IPv6-only and dual-stack
//! Services, the shipped ValidatingAdmissionPolicy refusing a real
//! `kubectl` request, and what `kubectl get` / `kubectl describe` show a
//! user.

use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use hna_contract::{harvester, kube_vip};
use hna_testkit::lb::{self, LISTEN_PORT, LbRig, annotation, wait_for};
use k8s_openapi::api::core::v1::Service;
use kube::api::{Patch, PatchParams};
use serde_json::json;

use crate::harness::tests;

tests! {
    another_class_is_never_touched_and_a_named_class_is_served: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    the_ingress_says_ip_mode_vip: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    dhcp_addresses_are_ipv4_whatever_the_ip_families: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    the_admission_policy_refuses_a_real_kubectl_request: Root, Iproute2, Dnsmasq, ApiServer, Kubectl, Socat;
    kubectl_shows_the_address_and_the_events_a_user_needs: Root, Iproute2, Dnsmasq, ApiServer, Kubectl, Socat;
}

const ADDRESS_WITHIN: Duration = Duration::from_secs(60);
const WITHIN: Duration = Duration::from_secs(30);
const OTHER_CLASS: &str = "example.com/other";
const NAMED_CLASS: &str = "example.com/dhcp";

fn options() -> lb::Options {
    lb::Options::new(
        crate::BIN,
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/kubernetes"),
    )
}

fn ingress(svc: &Service) -> Vec<k8s_openapi::api::core::v1::LoadBalancerIngress> {
    svc.status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|l| l.ingress.clone())
        .unwrap_or_default()
}

/// The link a Service's lease would live on, in any guest.
fn links_of(lb: &LbRig, uid: &str) -> Vec<String> {
    let name = format!("{}{}", lb::INTERFACE_PREFIX, &uid[..8]);
    (0..3)
        .flat_map(|g| lb.hlb_links(g))
        .filter(|l| l.name == name)
        .map(|l| l.name)
        .collect()
}

/// `created` exactly as it was created: no write of any kind since (same
/// resourceVersion: no status, no annotation, no finalizer), no Event
/// about it, no link for it on any guest, no assignment naming it.
fn untouched(lb: &LbRig, created: &Service) -> Result<()> {
    let name = created.metadata.name.as_deref().unwrap();
    let uid = created.metadata.uid.as_deref().unwrap();
    let now = lb.service(name).context("Service gone")?;
    ensure!(
        now.metadata.resource_version == created.metadata.resource_version,
        "{name} was written: {:#?}",
        (
            now.metadata.annotations,
            now.metadata.finalizers,
            now.status
        )
    );
    // The API server's own (its ClusterIP repair loop may report a Service
    // it has not finished allocating) are not ours to answer for.
    let events = lb.our_events(name);
    ensure!(events.is_empty(), "our Events about {name}: {events:?}");
    ensure!(links_of(lb, uid).is_empty(), "a link for {name}");
    for i in 0..3 {
        let node = lb.node_name(i);
        let obj = lb.node_object(&node).unwrap_or_default();
        ensure!(
            !obj["spec"].to_string().contains(uid),
            "{node} is assigned {name}: {}",
            obj["spec"]
        );
    }
    Ok(())
}

/// Waits until `name` is served and kube-vip's record is written (the last
/// write of a pass that served it), and returns the Service then.
fn served(lb: &LbRig, name: &str) -> Service {
    lb.wait_ingress(name, ADDRESS_WITHIN);
    wait_for(WITHIN, || {
        lb.service(name)
            .filter(|s| annotation(s, kube_vip::VIP_HOST).is_some())
    })
    .unwrap_or_else(|| panic!("{name}: no vipHost after its address\n{}", lb.diagnostics()))
}

fn restart_controllers(lb: &mut LbRig, args: &[&str]) -> Result<()> {
    for i in 0..2 {
        lb.kill_controller(i);
    }
    lb.set_controller_args(args);
    for i in 0..2 {
        lb.start_controller(i)?;
    }
    Ok(())
}

fn another_class_is_never_touched_and_a_named_class_is_served() -> Result<()> {
    let mut lb = LbRig::start(options())?;
    // Every marker that would make a class-less Service ours.
    let dhcp = [
        (harvester::IPAM, "dhcp"),
        (kube_vip::LOADBALANCER_IPS, "0.0.0.0"),
    ];
    let other = lb.create_service_with(
        "other",
        &dhcp,
        &[LISTEN_PORT],
        json!({"loadBalancerClass": OTHER_CLASS}),
    )?;
    let named = lb.create_service_with(
        "named",
        &[],
        &[LISTEN_PORT],
        json!({"loadBalancerClass": NAMED_CLASS}),
    )?;
    lb.create_service("classless", &[(harvester::IPAM, "dhcp")], &[LISTEN_PORT])?;

    // Defaults: class-less DHCP Services (and our own class) are served;
    // a pass that served `classless` read the others, created before it.
    let classless = served(&lb, "classless");
    untouched(&lb, &other)?;
    untouched(&lb, &named)?;

    // --load-balancer-class: that class only (listed in the controller's
    // admission policy too, as its `classes` variable says to).
    lb.allow_classes_in_controller_policy(&[NAMED_CLASS])?;
    restart_controllers(&mut lb, &["--load-balancer-class", NAMED_CLASS])?;
    let named_served = served(&lb, "named");
    let uid = classless.metadata.uid.as_deref().unwrap();
    // Handed over: released, so its status no longer claims the address
    // (which the DHCP server may give `named`), kube-vip's record kept.
    let handed_over = wait_for(WITHIN, || {
        let s = lb.service("classless")?;
        let finalizers = s.metadata.finalizers.clone().unwrap_or_default();
        (finalizers.is_empty() && links_of(&lb, uid).is_empty() && ingress(&s).is_empty())
            .then_some(())
    });
    ensure!(
        handed_over.is_some(),
        "class-less Service still served with only {NAMED_CLASS}: links {:?}, status {:?}\n{}",
        links_of(&lb, uid),
        lb.service("classless").map(|s| ingress(&s)),
        lb.diagnostics()
    );
    untouched(&lb, &other)?;

    // ... plus class-less ones with --serve-classless: served again, with
    // the address its record asks for, unless the DHCP server gave it to
    // `named` meanwhile.
    let before = lb::ingress_ip(&classless).unwrap();
    let named_ip = lb::ingress_ip(&named_served);
    println!("class-less {before} handed over; {NAMED_CLASS} Service got {named_ip:?}");
    restart_controllers(
        &mut lb,
        &["--load-balancer-class", NAMED_CLASS, "--serve-classless"],
    )?;
    let again = served(&lb, "classless");
    let again_ip = lb::ingress_ip(&again);
    if named_ip == Some(before) {
        ensure!(
            again_ip.is_some() && again_ip != named_ip,
            "{again_ip:?} after serving class-less Services again; {before} is the {NAMED_CLASS} Service's now"
        );
    } else {
        ensure!(
            again_ip == Some(before),
            "{again_ip:?} after serving class-less Services again, {before} before"
        );
    }
    let named_now = lb::ingress_ip(&lb.service("named").context("named gone")?);
    ensure!(
        named_now == named_ip,
        "the {NAMED_CLASS} Service's address {named_ip:?} changed to {named_now:?} when class-less ones were served again"
    );
    untouched(&lb, &other)?;
    Ok(())
}

fn the_ingress_says_ip_mode_vip() -> Result<()> {
    let lb = LbRig::start(options())?;
    lb.create_service("web", &[(harvester::IPAM, "dhcp")], &[LISTEN_PORT])?;
    let svc = served(&lb, "web");
    let ingress = ingress(&svc);
    ensure!(
        ingress.len() == 1 && ingress[0].ip_mode.as_deref() == Some("VIP"),
        "ingress {ingress:?}"
    );
    Ok(())
}

fn dhcp_addresses_are_ipv4_whatever_the_ip_families() -> Result<()> {
    let lb = LbRig::start(options())?;
    let dhcp = [(harvester::IPAM, "dhcp")];
    let v6 = lb.create_service_with(
        "v6only",
        &dhcp,
        &[LISTEN_PORT],
        json!({"ipFamilyPolicy": "SingleStack", "ipFamilies": ["IPv6"]}),
    )?;
    lb.create_service_with(
        "dual",
        &dhcp,
        &[LISTEN_PORT],
        json!({"ipFamilyPolicy": "RequireDualStack", "ipFamilies": ["IPv6", "IPv4"]}),
    )?;

    // Dual-stack: the IPv4 family is served, and only it.
    let dual = served(&lb, "dual");
    let dual_ingress = ingress(&dual);
    ensure!(
        dual_ingress.len() == 1
            && dual_ingress[0]
                .ip
                .as_deref()
                .is_some_and(|ip| ip.parse::<std::net::Ipv4Addr>().is_ok()),
        "dual-stack ingress {dual_ingress:?}"
    );
    ensure!(
        lb.events("dual")
            .iter()
            .any(|(t, r, m)| t == "Normal" && r == "IPv6NotServed" && m.contains("IPv4")),
        "events {:?}",
        lb.events("dual")
    );

    // IPv6 only: a Warning that says what to do, and nothing else.
    let why = lb.wait_warning("v6only", "IPv4Required", WITHIN);
    ensure!(
        why.contains("IPv4") && why.contains("PreferDualStack"),
        "{why}"
    );
    let now = lb.service("v6only").unwrap();
    ensure!(ingress_is_empty(&now), "status {:?}", now.status);
    ensure!(
        now.metadata.finalizers.unwrap_or_default().is_empty(),
        "a finalizer on a refused Service"
    );
    ensure!(links_of(&lb, v6.metadata.uid.as_deref().unwrap()).is_empty());

    // What the Event says to do works: the IPv4 family added, it is served.
    lb.block_on(lb.services().patch(
        "v6only",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"ipFamilyPolicy": "PreferDualStack"}})),
    ))?;
    let fixed = served(&lb, "v6only");
    ensure!(ingress(&fixed).len() == 1, "ingress {:?}", ingress(&fixed));
    Ok(())
}

fn ingress_is_empty(svc: &Service) -> bool {
    ingress(svc).is_empty()
}

/// Runs the rig's real kubectl as admin; Ok(stdout) or Err(stderr).
fn kubectl(lb: &LbRig, args: &[&str]) -> Result<std::result::Result<String, String>> {
    let out = lb.rig.apiserver().context("API server")?.kubectl(args)?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    Ok(if out.status.success() {
        Ok(stdout)
    } else {
        Err(stderr)
    })
}

/// `kubectl -n default annotate --overwrite service web <change>` (`key=value`,
/// or `key-` to remove).
fn annotate_web(change: &str) -> [&str; 7] {
    [
        "-n",
        "default",
        "annotate",
        "--overwrite",
        "service",
        "web",
        change,
    ]
}

fn refused(lb: &LbRig, args: &[&str], says: &[&str]) -> Result<()> {
    match kubectl(lb, args)? {
        Ok(out) => bail!("kubectl {args:?} was admitted: {out}"),
        Err(err) => {
            ensure!(
                err.contains("ValidatingAdmissionPolicy")
                    && err.contains("harvester-node-agent-service-annotations"),
                "kubectl {args:?} failed, but not by the policy: {err}"
            );
            for s in says {
                ensure!(err.contains(s), "kubectl {args:?}: {err:?} lacks {s:?}");
            }
            println!("kubectl {}: {}", args.join(" "), err.trim());
            Ok(())
        }
    }
}

fn the_admission_policy_refuses_a_real_kubectl_request() -> Result<()> {
    let lb = LbRig::start(options())?;
    lb.create_service("web", &[(harvester::IPAM, "dhcp")], &[LISTEN_PORT])?;
    let before = served(&lb, "web");
    let ip = lb::ingress_ip(&before).unwrap();

    // The policy is enforced from the moment the API server has loaded
    // it; a refused change of the IPAM mode is the handshake.
    let ipam = annotate_web("cloudprovider.harvesterhci.io/ipam=pool");
    let loaded = wait_for(WITHIN, || kubectl(&lb, &ipam).ok()?.err());
    ensure!(loaded.is_some(), "the IPAM change was never refused");
    refused(
        &lb,
        &ipam,
        &["cannot change", "delete the Service and create it again"],
    )?;
    // Removing the annotation is a change to pool mode too.
    refused(
        &lb,
        &annotate_web("cloudprovider.harvesterhci.io/ipam-"),
        &["from dhcp to pool"],
    )?;
    refused(
        &lb,
        &annotate_web("kube-vip.io/hwaddr=01:00:5e:00:00:01"),
        &["kube-vip.io/hwaddr", "not a unicast MAC"],
    )?;
    refused(
        &lb,
        &annotate_web("kube-vip.io/requestedIP=10.77.0.300"),
        &["kube-vip.io/requestedIP", "not an IPv4 address"],
    )?;
    // At creation too: a manifest with a malformed record.
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("bad.yaml");
    std::fs::write(
        &file,
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: bad\n  namespace: default\n  annotations:\n    cloudprovider.harvesterhci.io/ipam: dhcp\n    kube-vip.io/requestedIP: fd00::5\nspec:\n  type: LoadBalancer\n  ports:\n  - port: 80\n",
    )?;
    refused(
        &lb,
        &["apply", "-f", file.to_str().unwrap()],
        &["kube-vip.io/requestedIP"],
    )?;
    ensure!(lb.service("bad").is_none(), "the refused Service exists");

    // What the policy admits: the controller's own record and a valid
    // change of another annotation.
    ensure!(
        kubectl(&lb, &annotate_web("example.com/owner=team-a"))?.is_ok(),
        "a harmless annotation was refused"
    );
    // Nothing served changed.
    let after = lb.service("web").unwrap();
    ensure!(lb::ingress_ip(&after) == Some(ip));
    for key in [harvester::IPAM, kube_vip::HWADDR, kube_vip::REQUESTED_IP] {
        ensure!(
            annotation(&after, key) == annotation(&before, key),
            "{key} changed"
        );
    }
    ensure!(lb.carriers(ip).len() == 1);
    Ok(())
}

fn kubectl_shows_the_address_and_the_events_a_user_needs() -> Result<()> {
    let lb = LbRig::start(options())?;
    // As in a running cluster: the agents have joined before the Service
    // comes (else the first Event is a true but passing NoEligibleNode).
    let joined = wait_for(WITHIN, || {
        (0..3)
            .all(|i| {
                lb.node_object(&lb.node_name(i))
                    .is_some_and(|o| o["status"]["ready"] == true)
            })
            .then_some(())
    });
    ensure!(joined.is_some(), "agents not ready\n{}", lb.diagnostics());
    lb.create_service("web", &[(harvester::IPAM, "dhcp")], &[LISTEN_PORT])?;
    lb.create_service_with(
        "v6only",
        &[(harvester::IPAM, "dhcp")],
        &[LISTEN_PORT],
        json!({"ipFamilyPolicy": "SingleStack", "ipFamilies": ["IPv6"]}),
    )?;
    let svc = served(&lb, "web");
    let ip = lb::ingress_ip(&svc).unwrap().to_string();
    let holder = annotation(&svc, kube_vip::VIP_HOST).unwrap().to_string();
    lb.wait_warning("v6only", "IPv4Required", WITHIN);

    let get = kubectl(&lb, &["-n", "default", "get", "svc", "web", "-o", "wide"])?
        .map_err(anyhow::Error::msg)?;
    println!("$ kubectl get svc web -o wide\n{get}");
    let row = get.lines().nth(1).context("no row")?;
    let columns: Vec<&str> = row.split_whitespace().collect();
    ensure!(
        columns.get(3) == Some(&ip.as_str()),
        "EXTERNAL-IP is not {ip}: {get}"
    );
    ensure!(!get.contains("<pending>"), "{get}");

    let describe =
        kubectl(&lb, &["-n", "default", "describe", "svc", "web"])?.map_err(anyhow::Error::msg)?;
    println!("$ kubectl describe svc web\n{describe}");
    for want in [
        format!("LoadBalancer Ingress:     {ip} (VIP)"),
        format!("{holder} holds the address"),
        format!("{ip} held by {holder}"),
        "HolderChosen".to_string(),
        "AddressAssigned".to_string(),
    ] {
        ensure!(
            describe.contains(&want),
            "describe lacks {want:?}:\n{describe}"
        );
    }
    let refused = kubectl(&lb, &["-n", "default", "describe", "svc", "v6only"])?
        .map_err(anyhow::Error::msg)?;
    println!("$ kubectl describe svc v6only\n{refused}");
    ensure!(
        refused.contains("IPv4Required") && refused.contains("PreferDualStack"),
        "{refused}"
    );
    let get =
        kubectl(&lb, &["-n", "default", "get", "svc", "v6only"])?.map_err(anyhow::Error::msg)?;
    println!("$ kubectl get svc v6only\n{get}");

    let lbn = kubectl(&lb, &["-n", lb::NAMESPACE, "get", "loadbalancernodes"])?
        .map_err(anyhow::Error::msg)?;
    println!(
        "$ kubectl -n {} get loadbalancernodes\n{lbn}",
        lb::NAMESPACE
    );
    ensure!(
        lbn.lines().next().is_some_and(|h| {
            let h: Vec<&str> = h.split_whitespace().collect();
            h == [
                "NAME",
                "READY",
                "REASON",
                "HELD",
                "ADDRESSES",
                "HEARTBEAT",
                "AGE",
            ]
        }),
        "{lbn}"
    );
    ensure!(
        lbn.lines()
            .any(|l| l.starts_with(&holder) && l.contains(&format!("{ip} (default/web)"))),
        "{lbn}"
    );
    Ok(())
}
