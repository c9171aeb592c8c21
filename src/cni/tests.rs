use super::*;

fn canal() -> ConfFile {
    ConfFile {
        path: "/etc/cni/net.d/10-canal.conflist".into(),
        plugins: vec!["calico".into(), "portmap".into(), "bandwidth".into()],
    }
}

fn facts() -> Facts {
    Facts {
        conf_dirs: vec!["/etc/cni/net.d".into()],
        conf_files: vec![canal()],
        uplink: Some("enp1s0".into()),
        links: vec![OurLink {
            name: "hlb-0a1b2c3d".into(),
            index: 7,
            addresses: vec![Ipv4Addr::new(10, 77, 0, 150)],
        }],
        node: NodeFacts::Read {
            node: "n1".into(),
            annotations: BTreeMap::from([(
                "projectcalico.org/IPv4Address".to_string(),
                "10.77.0.10/24".to_string(),
            )]),
            service_addresses: BTreeMap::from([
                (Ipv4Addr::new(10, 77, 0, 150), "default/web".to_string()),
                (Ipv4Addr::new(10, 77, 0, 151), "default/db".to_string()),
            ]),
        },
        bpf: Vec::new(),
        bpf_error: None,
        managed: Vec::new(),
    }
}

fn by_name<'a>(checks: &'a [Check], name: &str) -> &'a Check {
    checks.iter().find(|c| c.name == name).unwrap()
}

fn annotate(f: &mut Facts, key: &str, value: &str) {
    let NodeFacts::Read { annotations, .. } = &mut f.node else {
        unreachable!()
    };
    annotations.insert(key.into(), value.into());
}

#[test]
fn rke2s_cnis_are_told_apart_by_their_chains() {
    let conf = |plugins: &[&str]| ConfFile {
        path: "/x".into(),
        plugins: plugins.iter().map(|p| p.to_string()).collect(),
    };
    assert_eq!(detect(&[canal()]), [Cni::Canal]);
    assert_eq!(detect(&[conf(&["calico", "flannel"])]), [Cni::Canal]);
    assert_eq!(detect(&[conf(&["calico", "bandwidth"])]), [Cni::Calico]);
    assert_eq!(detect(&[conf(&["cilium-cni"])]), [Cni::Cilium]);
    assert_eq!(detect(&[conf(&["flannel", "portmap"])]), [Cni::Flannel]);
    // Multus in front of the primary: the primary's own file names it.
    assert_eq!(
        detect(&[conf(&["multus"]), conf(&["cilium-cni"])]),
        [Cni::Cilium]
    );
    assert!(detect(&[conf(&["bridge"])]).is_empty());
}

#[test]
fn a_healthy_node_passes_every_check() {
    let checks = assess(&facts());
    assert!(checks.iter().all(|c| c.status == Status::Ok), "{checks:#?}");
    assert!(by_name(&checks, "cni").message.contains("canal"));
}

#[test]
fn a_cni_node_address_on_our_link_or_of_a_service_fails() {
    let mut f = facts();
    annotate(&mut f, "projectcalico.org/IPv4Address", "10.77.0.150/24");
    let c = assess(&f);
    let c = by_name(&c, "cni-node-address");
    assert_eq!(c.status, Status::Fail);
    assert!(c.message.contains("hlb-0a1b2c3d"), "{}", c.message);
    assert!(c.remediation.contains("HelmChartConfig"));

    // Held elsewhere: the Service names it.
    let mut f = facts();
    annotate(&mut f, "flannel.alpha.coreos.com/public-ip", "10.77.0.151");
    let c = assess(&f);
    let c = by_name(&c, "cni-node-address");
    assert_eq!(c.status, Status::Fail);
    assert!(c.message.contains("default/db"), "{}", c.message);
}

#[test]
fn an_unread_node_is_a_warning_not_a_pass() {
    let mut f = facts();
    f.node = NodeFacts::NotRead("no credentials".into());
    let c = assess(&f);
    let c = by_name(&c, "cni-node-address");
    assert_eq!(c.status, Status::Warn);
    assert!(c.message.contains("no credentials"));
}

#[test]
fn a_bpf_program_on_our_link_fails_and_an_unread_one_warns() {
    let mut f = facts();
    f.bpf = vec!["hlb-0a1b2c3d: tc ingress filter bpf".into()];
    assert_eq!(by_name(&assess(&f), "cni-bpf").status, Status::Fail);
    let mut f = facts();
    f.bpf_error = Some("permission denied".into());
    assert_eq!(by_name(&assess(&f), "cni-bpf").status, Status::Warn);
}

#[test]
fn a_managed_link_fails_with_the_managers_own_fix() {
    let mut f = facts();
    f.managed = vec![Managed {
        link: "hlb-0a1b2c3d".into(),
        manager: Manager::NetworkManager,
        evidence: "managed=true in /run/NetworkManager/devices/7".into(),
    }];
    let c = assess(&f);
    let c = by_name(&c, "cni-link-managers");
    assert_eq!(c.status, Status::Fail);
    assert!(c.remediation.contains(NM_DROP_IN), "{}", c.remediation);
    assert!(!c.remediation.contains("networkctl"));
}

#[test]
fn without_links_or_configuration_nothing_fails() {
    let mut f = facts();
    f.links.clear();
    f.conf_files.clear();
    let checks = assess(&f);
    assert!(
        checks.iter().all(|c| c.status != Status::Fail),
        "{checks:#?}"
    );
    assert_eq!(by_name(&checks, "cni").status, Status::Warn);
    assert_eq!(by_name(&checks, "cni-bpf").reason, "NoLinks");
}

#[test]
fn the_helm_chart_configs_name_rke2s_charts_and_keep_off_our_links() {
    let mut f = facts();
    let canal = helm_chart_configs(&f);
    assert_eq!(canal.len(), 1);
    let (cni, text) = &canal[0];
    assert_eq!(*cni, Cni::Canal);
    let v = yaml(text);
    assert_eq!(v["kind"], "HelmChartConfig");
    assert_eq!(v["metadata"]["name"], "rke2-canal");
    assert_eq!(v["metadata"]["namespace"], "kube-system");
    let values = yaml(v["spec"]["valuesContent"].as_str().unwrap());
    assert_eq!(
        values["calico"]["ipAutoDetectionMethod"],
        "skip-interface=hlb-.*,vip-.*"
    );

    // None detected: all three, Cilium's naming the uplink.
    f.conf_files.clear();
    let all = helm_chart_configs(&f);
    assert_eq!(
        all.iter().map(|(c, _)| *c).collect::<Vec<_>>(),
        [Cni::Canal, Cni::Calico, Cni::Cilium]
    );
    let calico = yaml(&all[1].1);
    let values = yaml(calico["spec"]["valuesContent"].as_str().unwrap());
    assert_eq!(
        values["installation"]["calicoNetwork"]["nodeAddressAutodetectionV4"]["skipInterface"],
        "hlb-.*|vip-.*"
    );
    let cilium = yaml(&all[2].1);
    let values = yaml(cilium["spec"]["valuesContent"].as_str().unwrap());
    assert_eq!(values["devices"], serde_json::json!(["enp1s0"]));
}

fn yaml(text: &str) -> serde_json::Value {
    serde_norway::from_str(text).unwrap()
}
