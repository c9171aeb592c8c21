//! The Helm charts (`packaging/helm/`, issue #32 item 2) with the real
//! `helm`: lint, render equal to the kustomize base, refuse values that
//! cannot work with the reason, and install into a namespace of its own on
//! the rig's API server, where the controllers run as the chart's
//! ServiceAccount and serve a DHCP Service end to end; then upgrade with
//! changed values and uninstall.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use hna_contract::harvester;
use hna_testkit::lb::{self, HelmInstall, LISTEN_PORT, LbRig, wait_for};
use k8s_openapi::api::apps::v1::Deployment;
use kube::Api;
use kube::api::{DynamicObject, ListParams};
use kube::discovery::ApiResource;
use serde_json::Value;

use crate::harness::tests;

tests! {
    the_charts_lint_and_render_the_kustomize_base: Helm;
    values_that_cannot_work_fail_with_the_reason: Helm;
    a_release_elsewhere_serves_a_dhcp_service_upgrades_and_uninstalls: Root, Iproute2, Dnsmasq, ApiServer, Socat, Helm;
}

/// The Kubernetes version `helm template` renders for (the newest the rig
/// runs; the chart asks for 1.33 or newer).
const KUBE_VERSION: &str = "1.37.0";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn charts() -> PathBuf {
    repo().join("packaging/helm")
}

fn helm(args: &[&str]) -> Result<std::process::Output> {
    let home = tempfile::tempdir()?;
    hna_testkit::locate::helm::command(home.path())
        .map_err(anyhow::Error::msg)?
        .args(args)
        .output()
        .context("running helm")
}

fn said(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `helm template` of the controller chart as `release` in `namespace`.
fn render(release: &str, namespace: &str, set: &[&str]) -> Result<Vec<Value>> {
    let chart = charts().join("harvester-node-agent");
    let mut args = vec![
        "template",
        release,
        chart.to_str().unwrap(),
        "--namespace",
        namespace,
        "--kube-version",
        KUBE_VERSION,
    ];
    for s in set {
        args.extend(["--set", s]);
    }
    let out = helm(&args)?;
    ensure!(out.status.success(), "helm template: {}", said(&out));
    documents(&String::from_utf8(out.stdout)?)
}

fn documents(text: &str) -> Result<Vec<Value>> {
    let mut out = Vec::new();
    for doc in serde_norway::Deserializer::from_str(text) {
        let v: Value = serde::Deserialize::deserialize(doc)?;
        if !v.is_null() {
            out.push(v);
        }
    }
    Ok(out)
}

/// Labels only a Helm release carries (the kustomize base has none).
const RELEASE_LABELS: [&str; 4] = [
    "app.kubernetes.io/instance",
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/version",
    "helm.sh/chart",
];

fn without_release_labels(v: &mut Value) {
    match v {
        Value::Object(m) => {
            for k in RELEASE_LABELS {
                m.remove(k);
            }
            m.values_mut().for_each(without_release_labels);
        }
        Value::Array(a) => a.iter_mut().for_each(without_release_labels),
        _ => {}
    }
}

fn key(v: &Value) -> String {
    format!(
        "{}/{}/{}",
        v["kind"].as_str().unwrap_or_default(),
        v["metadata"]["namespace"].as_str().unwrap_or_default(),
        v["metadata"]["name"].as_str().unwrap_or_default()
    )
}

/// The kustomize base's objects, by `kind/namespace/name`.
fn base() -> Result<BTreeMap<String, Value>> {
    let dir = repo().join("packaging/kubernetes");
    let k: Value =
        serde_norway::from_str(&std::fs::read_to_string(dir.join("kustomization.yaml"))?)?;
    let mut out = BTreeMap::new();
    for r in k["resources"].as_array().context("resources")? {
        let file = dir.join(r.as_str().context("a resource path")?);
        for v in documents(&std::fs::read_to_string(&file)?)? {
            out.insert(key(&v), v);
        }
    }
    Ok(out)
}

/// Where two values first differ, as a JSON pointer with both sides.
fn first_difference(a: &Value, b: &Value, at: String) -> Option<String> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            for k in x.keys().chain(y.keys()) {
                let (l, r) = (
                    x.get(k).unwrap_or(&Value::Null),
                    y.get(k).unwrap_or(&Value::Null),
                );
                if let Some(d) = first_difference(l, r, format!("{at}/{k}")) {
                    return Some(d);
                }
            }
            None
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (l, r))| first_difference(l, r, format!("{at}/{i}"))),
        _ => (a != b).then(|| format!("{at}: {a} vs {b}")),
    }
}

fn the_charts_lint_and_render_the_kustomize_base() -> Result<()> {
    for chart in ["harvester-node-agent", "harvester-node-agent-crd"] {
        let path = charts().join(chart);
        let out = helm(&["lint", "--strict", path.to_str().unwrap()])?;
        ensure!(out.status.success(), "helm lint {chart}: {}", said(&out));
    }

    // The defaults, released as harvester-node-agent in its namespace, are
    // the base (but its Namespace, which `helm --create-namespace` makes,
    // and its CRD, the CRD chart's).
    let mut want = base()?;
    let crd = want
        .remove("CustomResourceDefinition//loadbalancernodes.lb.harvester-node-agent.io")
        .context("the base's CRD")?;
    want.remove("Namespace//harvester-node-agent")
        .context("the base's Namespace")?;
    let mut got = BTreeMap::new();
    for mut v in render("harvester-node-agent", "harvester-node-agent", &[])? {
        without_release_labels(&mut v);
        got.insert(key(&v), v);
    }
    ensure!(
        got.keys().eq(want.keys()),
        "the chart renders {:?}, the base has {:?}",
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    for (k, v) in &want {
        if let Some(d) = first_difference(&got[k], v, String::new()) {
            bail!("{k}: the chart and packaging/kubernetes differ at {d}");
        }
    }

    let chart = charts().join("harvester-node-agent-crd");
    let out = helm(&[
        "template",
        "harvester-node-agent-crd",
        chart.to_str().unwrap(),
        "--kube-version",
        KUBE_VERSION,
    ])?;
    ensure!(out.status.success(), "{}", said(&out));
    let rendered = documents(&String::from_utf8(out.stdout)?)?;
    ensure!(
        rendered.len() == 1 && first_difference(&rendered[0], &crd, String::new()).is_none(),
        "the CRD chart is not packaging/kubernetes/crd.yaml: {:?}",
        rendered
            .first()
            .and_then(|r| first_difference(r, &crd, String::new()))
    );
    Ok(())
}

fn values_that_cannot_work_fail_with_the_reason() -> Result<()> {
    let chart = charts().join("harvester-node-agent");
    for (set, reason) in [
        ("replicas=0", "/replicas"),
        ("replicas=1", "/replicas"),
        ("podDisruptionBudget.minAvailable=2", "no drain can finish"),
        ("loadBalancerClass=Not A Class", "/loadBalancerClass"),
        (
            "loadBalancerClass=kube-vip.io/kube-vip-class",
            "kube-vip's own class",
        ),
        (
            "admissionPolicies.validationActions={Deny,Warn}",
            "Deny and Warn together",
        ),
        ("metrics.port=0", "/metrics/port"),
    ] {
        // What `helm install` checks before it creates anything (the rig
        // test below tries one on a real API server).
        let out = helm(&[
            "template",
            "x",
            chart.to_str().unwrap(),
            "--kube-version",
            KUBE_VERSION,
            "--set",
            set,
        ])?;
        let text = said(&out);
        ensure!(
            !out.status.success() && text.contains(reason),
            "--set {set}: want a refusal naming {reason:?}, got: {text}"
        );
    }
    // Without the PodDisruptionBudget one replica is fine.
    render(
        "x",
        "x",
        &["replicas=1", "podDisruptionBudget.enabled=false"],
    )?;

    // Another release and namespace: every name follows, the CEL included.
    let objects = render(
        "lb",
        "lb-system",
        &[
            "loadBalancerClass=example.com/lb",
            "serveClasslessServices=false",
        ],
    )?;
    let find = |kind: &str, name: &str| {
        objects
            .iter()
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
            .with_context(|| format!("no {kind} {name}"))
    };
    let policy = find("ValidatingAdmissionPolicy", "lb-controller-writes")?;
    let text = policy.to_string();
    ensure!(
        text.contains(":lb-controller')") && text.contains("['example.com/lb']"),
        "{text}"
    );
    let deployment = find("Deployment", "lb-controller")?;
    let args = &deployment["spec"]["template"]["spec"]["containers"][0]["args"];
    ensure!(
        args == &serde_json::json!([
            "controller",
            "--namespace",
            "lb-system",
            "--metrics-listen",
            "0.0.0.0:9477",
            "--load-balancer-class",
            "example.com/lb",
            "--serve-classless=false"
        ]),
        "{args}"
    );
    let binding = find("ClusterRoleBinding", "lb-controller")?;
    ensure!(
        binding["subjects"][0]["namespace"] == "lb-system",
        "{binding}"
    );
    // The node agents' ScrapeConfig follows their port.
    let objects = render(
        "x",
        "x",
        &[
            "metrics.nodeAgents.scrapeConfig.enabled=true",
            "metrics.nodeAgents.port=9999",
        ],
    )?;
    let scrape = objects
        .iter()
        .find(|o| o["kind"] == "ScrapeConfig")
        .context("no ScrapeConfig")?;
    ensure!(
        scrape["spec"]["relabelings"][0]["replacement"] == "${1}:9999"
            && scrape["spec"]["kubernetesSDConfigs"][0]["role"] == "Node",
        "{scrape}"
    );
    // Rancher's system default registry goes in front of the image.
    let objects = render(
        "x",
        "x",
        &["global.cattle.systemDefaultRegistry=registry.example.org"],
    )?;
    let image = objects
        .iter()
        .find(|o| o["kind"] == "Deployment")
        .map(|d| d["spec"]["template"]["spec"]["containers"][0]["image"].clone());
    ensure!(
        image
            == Some(Value::from(
                "registry.example.org/ghcr.io/harvester-node-agent/harvester-node-agent:0.1.0"
            )),
        "{image:?}"
    );
    Ok(())
}

/// Every object of kind `ar` labelled with release `release`.
fn released(lb: &LbRig, ar: &ApiResource, release: &str) -> Result<Vec<String>> {
    let api: Api<DynamicObject> = Api::all_with(lb.admin(), ar);
    let lp = ListParams::default().labels(&format!("app.kubernetes.io/instance={release}"));
    Ok(lb
        .block_on(api.list(&lp))?
        .items
        .into_iter()
        .map(|o| {
            format!(
                "{}/{}",
                o.metadata.namespace.unwrap_or_default(),
                o.metadata.name.unwrap_or_default()
            )
        })
        .collect())
}

fn a_release_elsewhere_serves_a_dhcp_service_upgrades_and_uninstalls() -> Result<()> {
    const RELEASE: &str = "lb";
    const NAMESPACE: &str = "lb-system";
    let mut opts = lb::Options::new(crate::BIN, repo().join("packaging/kubernetes"));
    opts.helm = Some(HelmInstall {
        charts: charts(),
        release: RELEASE.into(),
        namespace: NAMESPACE.into(),
        set: Vec::new(),
    });
    let lb = LbRig::start(opts)?;
    let admin_kubeconfig: PathBuf = lb.admin_kubeconfig().context("admin kubeconfig")?;

    // Served end to end: the controllers run as lb-system's
    // lb-controller, the agents write their objects in lb-system.
    lb.create_service("web", &[(harvester::IPAM, "dhcp")], &[LISTEN_PORT])?;
    let ip = lb.wait_ingress("web", Duration::from_secs(60));
    let reply = lb.tcp_from_client(ip, LISTEN_PORT)?;
    ensure!(!reply.is_empty(), "no reply from {ip}");
    let leader = lb.leader().context("no leader in lb-system")?;
    let nodes = lb.block_on(lb.node_objects().list(&ListParams::default()))?;
    ensure!(
        nodes.items.len() == lb.guests(),
        "{} LoadBalancerNodes in {NAMESPACE}",
        nodes.items.len()
    );
    println!("helm: {ip} served by the chart's release in {NAMESPACE}, leader {leader}");

    // Upgrade with changed values: the running Deployment and the policy
    // follow.
    let chart = charts().join("harvester-node-agent");
    let upgrade = |set: &[&str]| {
        let mut args = vec![
            "upgrade",
            RELEASE,
            chart.to_str().unwrap(),
            "--namespace",
            NAMESPACE,
            "--reuse-values",
        ];
        for s in set {
            args.extend(["--set", s]);
        }
        HelmInstall::run(&admin_kubeconfig, &args)
    };
    upgrade(&["replicas=3", "loadBalancerClass=example.com/lb"])?;
    let deployments: Api<Deployment> = Api::namespaced(lb.admin(), NAMESPACE);
    let d = lb.block_on(deployments.get("lb-controller"))?;
    let spec = d.spec.context("spec")?;
    let args = spec.template.spec.context("pod spec")?.containers[0]
        .args
        .clone()
        .unwrap_or_default();
    ensure!(
        spec.replicas == Some(3)
            && args.ends_with(&[
                "--load-balancer-class".into(),
                "example.com/lb".into(),
                "--serve-classless=true".into()
            ]),
        "after the upgrade: replicas {:?}, args {args:?}",
        spec.replicas
    );
    let vap = ApiResource::from_gvk_with_plural(
        &kube::api::GroupVersionKind::gvk(
            "admissionregistration.k8s.io",
            "v1",
            "ValidatingAdmissionPolicy",
        ),
        "validatingadmissionpolicies",
    );
    let policies: Api<DynamicObject> = Api::all_with(lb.admin(), &vap);
    let policy = lb.block_on(policies.get("lb-controller-writes"))?;
    ensure!(
        serde_json::to_string(&policy.data)?.contains("['example.com/lb']"),
        "the policy's classes after the upgrade: {:?}",
        policy.data
    );

    // Values that cannot work are refused before anything changes.
    let refused = upgrade(&["replicas=0"]);
    let why = format!("{refused:?}");
    ensure!(refused.is_err() && why.contains("/replicas"), "{why}");
    let d = lb.block_on(deployments.get("lb-controller"))?;
    ensure!(
        d.spec.and_then(|s| s.replicas) == Some(3),
        "a refused upgrade changed the Deployment"
    );

    // Released before the uninstall, as a user deletes what the release
    // serves first.
    let mac = lb::annotation(&lb.service("web").context("web")?, "kube-vip.io/hwaddr")
        .context("no hwaddr")?
        .to_string();
    let mark = lb.dnsmasq_log_len();
    lb.delete_service("web")?;
    lb.ensure_released("web", ip, &mac, mark)?;

    HelmInstall::run(
        &admin_kubeconfig,
        &["uninstall", RELEASE, "--namespace", NAMESPACE, "--wait"],
    )?;
    HelmInstall::run(
        &admin_kubeconfig,
        &["uninstall", &format!("{RELEASE}-crd"), "--wait"],
    )?;
    let gvk = |g: &str, v: &str, k: &str, p: &str| {
        ApiResource::from_gvk_with_plural(&kube::api::GroupVersionKind::gvk(g, v, k), p)
    };
    let kinds = [
        gvk("apps", "v1", "Deployment", "deployments"),
        gvk("", "v1", "ServiceAccount", "serviceaccounts"),
        gvk(
            "rbac.authorization.k8s.io",
            "v1",
            "ClusterRole",
            "clusterroles",
        ),
        gvk(
            "rbac.authorization.k8s.io",
            "v1",
            "ClusterRoleBinding",
            "clusterrolebindings",
        ),
        gvk("rbac.authorization.k8s.io", "v1", "Role", "roles"),
        gvk(
            "rbac.authorization.k8s.io",
            "v1",
            "RoleBinding",
            "rolebindings",
        ),
        gvk(
            "policy",
            "v1",
            "PodDisruptionBudget",
            "poddisruptionbudgets",
        ),
        gvk(
            "networking.k8s.io",
            "v1",
            "NetworkPolicy",
            "networkpolicies",
        ),
        vap.clone(),
        gvk(
            "admissionregistration.k8s.io",
            "v1",
            "ValidatingAdmissionPolicyBinding",
            "validatingadmissionpolicybindings",
        ),
    ];
    for ar in &kinds {
        let left = released(&lb, ar, RELEASE)?;
        ensure!(
            left.is_empty(),
            "{} left after helm uninstall: {left:?}",
            ar.kind
        );
    }
    let crds = gvk(
        "apiextensions.k8s.io",
        "v1",
        "CustomResourceDefinition",
        "customresourcedefinitions",
    );
    let crd_api: Api<DynamicObject> = Api::all_with(lb.admin(), &crds);
    let gone = wait_for(Duration::from_secs(30), || {
        lb.block_on(crd_api.get_opt("loadbalancernodes.lb.harvester-node-agent.io"))
            .ok()
            .flatten()
            .is_none()
            .then_some(())
    });
    ensure!(
        gone.is_some(),
        "the CRD is still there after uninstalling its chart"
    );
    Ok(())
}
