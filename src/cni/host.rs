//! The facts of [`super::assess`], read from this node without changing
//! anything: CNI configuration files, our links and their addresses (rtnetlink),
//! the tc filters and tcx programs on them (rtnetlink, `bpf(BPF_PROG_QUERY)`),
//! NetworkManager's and systemd-networkd's per-link state files, and the
//! Node's annotations and the LoadBalancer Services (the API server).

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::TryStreamExt as _;
use k8s_openapi::api::core::v1::{Node, Service};
use kube::Api;
use kube::api::ListParams;

use super::{ConfFile, Facts, Managed, Manager, NodeFacts, OurLink};
use hna_contract::INTERFACE_PREFIX;

/// Where NetworkManager keeps its per-device run state (`<ifindex>`
/// keyfiles), under the run directory.
const NM_DEVICES: &str = "NetworkManager/devices";
/// Where systemd-networkd keeps its per-link state (`<ifindex>`).
const NETWORKD_LINKS: &str = "systemd/netif/links";

/// Everything about this node, read-only. `run_dir` is `/run` outside
/// tests.
pub(crate) async fn gather(
    conf_dirs: &[PathBuf],
    run_dir: &Path,
    uplink: Option<String>,
    node: NodeFacts,
) -> Facts {
    let conf_files = conf_files(conf_dirs);
    let (links, mut bpf_error) = match our_links().await {
        Ok(links) => (links, None),
        Err(e) => (Vec::new(), Some(e.to_string())),
    };
    let (bpf, read_error) = bpf_attachments(&links).await;
    bpf_error = bpf_error.or(read_error);
    let managed = managed(run_dir, &links);
    Facts {
        conf_dirs: conf_dirs.to_vec(),
        conf_files,
        uplink,
        links,
        node,
        bpf,
        bpf_error,
        managed,
    }
}

/// The CNI configuration files in `dirs` (`*.conf`, `*.conflist`,
/// `*.json`, as the container runtime reads them), by name.
pub(crate) fn conf_files(dirs: &[PathBuf]) -> Vec<ConfFile> {
    let mut out = Vec::new();
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        let mut paths: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.extension()
                    .and_then(|e| e.to_str())
                    .is_some_and(|e| matches!(e, "conf" | "conflist" | "json"))
            })
            .collect();
        paths.sort();
        for path in paths {
            let Ok(text) = std::fs::read_to_string(&path) else {
                continue;
            };
            out.push(ConfFile {
                plugins: plugin_types(&text),
                path,
            });
        }
    }
    out
}

/// The plugin types a CNI configuration names: a `.conflist`'s `plugins`,
/// or a single `.conf`'s `type`. Unparsable text names none.
pub(crate) fn plugin_types(text: &str) -> Vec<String> {
    let Ok(v) = serde_json::from_str::<serde_json::Value>(text) else {
        return Vec::new();
    };
    let of = |p: &serde_json::Value| p["type"].as_str().map(str::to_string);
    match v["plugins"].as_array() {
        Some(plugins) => plugins.iter().filter_map(of).collect(),
        None => of(&v).into_iter().collect(),
    }
}

async fn our_links() -> Result<Vec<OurLink>, hna_dhcp::link::LinkError> {
    let nl = hna_dhcp::link::Netlink::connect()?;
    let mut out = Vec::new();
    for link in nl.links().await? {
        if !link.name.starts_with(INTERFACE_PREFIX) {
            continue;
        }
        let addresses = nl.addresses(link.index).await?;
        out.push(OurLink {
            name: link.name,
            index: link.index,
            addresses,
        });
    }
    Ok(out)
}

/// One line per BPF program found on `links`: tc filters of kind `bpf`
/// (Cilium before tcx) and tcx programs (Cilium on kernels from 6.6).
async fn bpf_attachments(links: &[OurLink]) -> (Vec<String>, Option<String>) {
    if links.is_empty() {
        return (Vec::new(), None);
    }
    let (conn, handle, _) = match rtnetlink::new_connection() {
        Ok(c) => c,
        Err(e) => return (Vec::new(), Some(format!("netlink: {e}"))),
    };
    let task = tokio::spawn(conn);
    let mut found = Vec::new();
    let mut error = None;
    for link in links {
        tc_bpf_filters(&handle, link, &mut found, &mut error).await;
        tcx_attachments(link, &mut found, &mut error);
    }
    task.abort();
    (found, error)
}

/// The `bpf` tc filters on `link`'s ingress and egress, a line each into
/// `found`; why they could not be read into `error`.
async fn tc_bpf_filters(
    handle: &rtnetlink::Handle,
    link: &OurLink,
    found: &mut Vec<String>,
    error: &mut Option<String>,
) {
    for (side, request) in [
        (
            "ingress",
            handle.traffic_filter(link.index as i32).get().ingress(),
        ),
        (
            "egress",
            handle.traffic_filter(link.index as i32).get().egress(),
        ),
    ] {
        match request.execute().try_collect::<Vec<_>>().await {
            Ok(filters) => found.extend(
                filters
                    .iter()
                    .filter_map(filter_kind)
                    .filter(|k| k == "bpf")
                    .map(|kind| format!("{}: tc {side} filter {kind}", link.name)),
            ),
            // No clsact qdisc: no filters.
            Err(e) if is_errno(&e, libc::EINVAL) || is_errno(&e, libc::ENOENT) => {}
            Err(e) => *error = Some(format!("tc filters of {}: {e}", link.name)),
        }
    }
}

/// The tcx programs on `link`, a line per side that has any into `found`;
/// why they could not be counted into `error`.
fn tcx_attachments(link: &OurLink, found: &mut Vec<String>, error: &mut Option<String>) {
    for (side, attach_type) in [("ingress", BPF_TCX_INGRESS), ("egress", BPF_TCX_EGRESS)] {
        match tcx_programs(link.index, attach_type) {
            Ok(0) => {}
            Ok(n) => found.push(format!("{}: tcx {side}, {n} program(s)", link.name)),
            // Kernels before 6.6 have no tcx: nothing can be attached.
            Err(nix::errno::Errno::EINVAL) => {}
            Err(e) => *error = Some(format!("tcx programs of {}: {e}", link.name)),
        }
    }
}

fn filter_kind(f: &rtnetlink::packet_route::tc::TcMessage) -> Option<String> {
    f.attributes.iter().find_map(|a| match a {
        rtnetlink::packet_route::tc::TcAttribute::Kind(k) => Some(k.clone()),
        _ => None,
    })
}

fn is_errno(e: &rtnetlink::Error, errno: i32) -> bool {
    matches!(e, rtnetlink::Error::NetlinkError(m)
        if m.code.is_some_and(|c| c.get() == -errno))
}

/// `enum bpf_attach_type` (linux/bpf.h, kernel 6.6).
const BPF_TCX_INGRESS: u32 = 46;
const BPF_TCX_EGRESS: u32 = 47;
/// `enum bpf_cmd`.
const BPF_PROG_QUERY: libc::c_long = 16;

/// The query part of `union bpf_attr` (linux/bpf.h), as far as this reads.
#[repr(C, align(8))]
#[derive(Default)]
struct ProgQuery {
    target_ifindex: u32,
    attach_type: u32,
    query_flags: u32,
    attach_flags: u32,
    prog_ids: u64,
    prog_cnt: u32,
    _pad: u32,
    prog_attach_flags: u64,
    link_ids: u64,
    link_attach_flags: u64,
    revision: u64,
}

/// How many tcx programs `attach_type` has on interface `index`. No crate
/// this project uses wraps `bpf(2)`; this one query is small enough to
/// write by hand.
fn tcx_programs(index: u32, attach_type: u32) -> Result<u32, nix::errno::Errno> {
    let mut q = ProgQuery {
        target_ifindex: index,
        attach_type,
        ..ProgQuery::default()
    };
    // SAFETY: `q` is a valid, writable `bpf_attr` prefix of the size
    // passed; with `prog_ids` null the kernel writes only the counts.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_PROG_QUERY,
            &mut q as *mut ProgQuery,
            std::mem::size_of::<ProgQuery>(),
        )
    };
    if rc < 0 {
        return Err(nix::errno::Errno::last());
    }
    Ok(q.prog_cnt)
}

/// Who besides us manages `links`, from the managers' own state files
/// under `run_dir`.
pub(crate) fn managed(run_dir: &Path, links: &[OurLink]) -> Vec<Managed> {
    let mut out = Vec::new();
    for link in links {
        let nm = run_dir.join(NM_DEVICES).join(link.index.to_string());
        if let Ok(text) = std::fs::read_to_string(&nm)
            && nm_manages(&text)
        {
            out.push(Managed {
                link: link.name.clone(),
                manager: Manager::NetworkManager,
                evidence: format!("managed=true in {}", nm.display()),
            });
        }
        let networkd = run_dir.join(NETWORKD_LINKS).join(link.index.to_string());
        if let Ok(text) = std::fs::read_to_string(&networkd)
            && let Some(why) = networkd_manages(&text)
        {
            out.push(Managed {
                link: link.name.clone(),
                manager: Manager::SystemdNetworkd,
                evidence: format!("{why} in {}", networkd.display()),
            });
        }
    }
    out
}

/// NetworkManager's device state keyfile: `[device]` `managed=true`.
pub(crate) fn nm_manages(keyfile: &str) -> bool {
    let mut in_device = false;
    for line in keyfile.lines().map(str::trim) {
        if line.starts_with('[') {
            in_device = line == "[device]";
        } else if in_device && let Some(v) = line.strip_prefix("managed=") {
            return matches!(v.trim(), "true" | "1");
        }
    }
    false
}

/// systemd-networkd's link state: a `.network` file matched it
/// (`NETWORK_FILE=`) or it is being configured (`ADMIN_STATE=`). Returns
/// the line that says so.
pub(crate) fn networkd_manages(state: &str) -> Option<String> {
    let value = |key: &str| {
        state
            .lines()
            .find_map(|l| l.strip_prefix(key).map(str::trim))
            .filter(|v| !v.is_empty())
    };
    if let Some(file) = value("NETWORK_FILE=") {
        return Some(format!("NETWORK_FILE={file}"));
    }
    value("ADMIN_STATE=")
        .filter(|s| matches!(*s, "configuring" | "configured" | "failed"))
        .map(|s| format!("ADMIN_STATE={s}"))
}

/// The Node's annotations and every LoadBalancer Service's address.
pub(crate) async fn node_facts(client: kube::Client, node: &str, timeout: Duration) -> NodeFacts {
    let read = async {
        let n = Api::<Node>::all(client.clone())
            .get(node)
            .await
            .map_err(|e| format!("Node {node}: {e}"))?;
        let services = Api::<Service>::all(client)
            .list(&ListParams::default())
            .await
            .map_err(|e| format!("Services: {e}"))?;
        let mut service_addresses = BTreeMap::new();
        for s in services.items {
            let key = format!(
                "{}/{}",
                s.metadata.namespace.as_deref().unwrap_or_default(),
                s.metadata.name.as_deref().unwrap_or_default()
            );
            let ingress = s
                .status
                .and_then(|st| st.load_balancer)
                .and_then(|lb| lb.ingress)
                .unwrap_or_default();
            for i in ingress {
                if let Some(ip) = i.ip.and_then(|ip| ip.parse::<Ipv4Addr>().ok()) {
                    service_addresses.entry(ip).or_insert_with(|| key.clone());
                }
            }
        }
        Ok::<_, String>(NodeFacts::Read {
            node: node.to_string(),
            annotations: n.metadata.annotations.unwrap_or_default(),
            service_addresses,
        })
    };
    match tokio::time::timeout(timeout, read).await {
        Ok(Ok(facts)) => facts,
        Ok(Err(why)) => NodeFacts::NotRead(why),
        Err(_) => NodeFacts::NotRead(format!(
            "the API server did not answer within {}",
            humantime::format_duration(timeout)
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_conflist_names_its_chain_and_a_conf_its_type() {
        let canal = r#"{"name":"k8s-pod-network","cniVersion":"0.3.1","plugins":[
            {"type":"calico","log_level":"info"},{"type":"flannel"},
            {"type":"portmap","snat":true},{"type":"bandwidth"}]}"#;
        assert_eq!(
            plugin_types(canal),
            ["calico", "flannel", "portmap", "bandwidth"]
        );
        assert_eq!(
            plugin_types(r#"{"cniVersion":"0.3.1","name":"cilium","type":"cilium-cni"}"#),
            ["cilium-cni"]
        );
        assert!(plugin_types("not json").is_empty());
    }

    #[test]
    fn networkmanager_manages_only_with_managed_true_in_its_device_group() {
        assert!(nm_manages(
            "[device]\nmanaged=true\nperm-hw-addr-fake=02:00:00:00:00:01\n"
        ));
        assert!(!nm_manages("[device]\nmanaged=false\n"));
        assert!(!nm_manages("[other]\nmanaged=true\n"));
        assert!(!nm_manages(""));
    }

    #[test]
    fn networkd_manages_a_matched_or_configured_link_only() {
        assert_eq!(
            networkd_manages(
                "# This is private data. Do not parse.\nADMIN_STATE=configured\nOPER_STATE=routable\nNETWORK_FILE=/etc/systemd/network/99-all.network\n"
            )
            .as_deref(),
            Some("NETWORK_FILE=/etc/systemd/network/99-all.network")
        );
        assert_eq!(
            networkd_manages("ADMIN_STATE=configuring\n").as_deref(),
            Some("ADMIN_STATE=configuring")
        );
        assert_eq!(
            networkd_manages("ADMIN_STATE=unmanaged\nOPER_STATE=routable\n"),
            None
        );
        assert_eq!(
            networkd_manages("ADMIN_STATE=pending\nNETWORK_FILE=\n"),
            None
        );
    }

    #[test]
    fn the_tcx_query_matches_the_kernels_bpf_attr() {
        // linux/bpf.h (6.6): the query struct ends with `revision` at 56.
        assert_eq!(std::mem::size_of::<ProgQuery>(), 64);
        assert_eq!(std::mem::offset_of!(ProgQuery, prog_ids), 16);
        assert_eq!(std::mem::offset_of!(ProgQuery, prog_cnt), 24);
        assert_eq!(std::mem::offset_of!(ProgQuery, revision), 56);
    }
}
