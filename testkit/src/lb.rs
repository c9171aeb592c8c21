//! The LoadBalancer rig: the test kit's rig (dnsmasq LAN, guest namespaces,
//! a real kube-apiserver) with the cluster manifests of
//! `packaging/kubernetes/` applied, a Node per guest, the node agent in
//! every guest namespace with that node's credentials, controller replicas
//! with the manifests' ServiceAccount, a client namespace on the LAN and a
//! TCP listener in every guest that answers with its node's name.
//!
//! Everything a test asserts is read from the machine or the API server
//! (links and addresses with `ip`, dnsmasq's log and lease file, objects),
//! not from the agents' own reports.
//!
//! Shared by the integration tests, the LoadBalancer benchmark and the demo.
//! Like the rest of the kit it knows the agent only from the outside: the
//! binary, the object names of `packaging/kubernetes/`, JSON.

use std::collections::BTreeMap;
use std::fs;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::{Event, Node, Service};
use kube::Api;
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams,
    PostParams,
};

use crate::rig::faultproxy::{FaultProxy, seed_from_env};
use crate::rig::forward::Forwarder;
use crate::rig::{self, Rig, RigOptions};

/// The controller's namespace in `packaging/kubernetes/` (the agent's
/// `contract::DEFAULT_NAMESPACE`; the integration tests check they agree).
pub const NAMESPACE: &str = "harvester-node-agent";
/// The controller replicas' Lease (`contract::CONTROLLER_LEASE`).
pub const CONTROLLER_LEASE: &str = "harvester-node-agent-controller";
/// Our links' prefix (`contract::INTERFACE_PREFIX`).
pub const INTERFACE_PREFIX: &str = "hlb-";
/// The reporting controller of the controller's Events
/// (`controller::writer::FIELD_MANAGER`).
pub const CONTROLLER_REPORTER: &str = "harvester-node-agent-controller";
/// Where the test listeners answer in every guest.
pub const LISTEN_PORT: u16 = 8080;

pub struct Options {
    /// The agent binary (`run` in guests, `controller` on the host).
    pub bin: PathBuf,
    /// `packaging/kubernetes/` of the checkout under test.
    pub manifests: PathBuf,
    pub guests: usize,
    pub controllers: usize,
    /// Extra lines for every agent's configuration file.
    pub agent_config: String,
    /// Extra arguments for every controller replica.
    pub controller_args: Vec<String>,
    /// Publish [`LbRig::set_endpoints`] in EndpointSlices instead of
    /// Endpoints, and start the controllers with the default
    /// `--endpoint-source auto` (else `endpoints`). Slices are `discovery.k8s.io/v1` where the server has it
    /// (every supported release), else `v1beta1` (with the node in
    /// `topology`, as 1.17 to 1.20 wrote it).
    pub endpoint_slices: bool,
    /// Apply `packaging/kubernetes/`'s ValidatingAdmissionPolicy and its
    /// binding (default). Without them, a change the policy refuses at
    /// admission reaches the controller, which must refuse it itself.
    pub admission_policy: bool,
    /// Leave `uplink` out of the agents' configuration: each takes its
    /// guest's default route's interface (eth0), as a node does by default.
    pub uplink_from_route: bool,
    /// The agents reach the API server (or the fault proxy) at the LAN's
    /// address ([`rig::LAN_ADDR`]) through their uplink, as a single-NIC VM
    /// reaches its control plane: a fault on the uplink or the LAN cuts
    /// both (default). Off: through a loopback side channel no LAN fault
    /// touches (a node with a separate management network); a test that
    /// turns it off says why.
    pub api_on_lan: bool,
    /// Put a [`FaultProxy`] in front of the API server and give the agents
    /// and controllers kubeconfigs that point at it (the test's own admin
    /// client still talks to the API server directly). Its faults are off
    /// until the test turns them on ([`LbRig::fault_proxy`]); its seed is
    /// `HNA_FAULT_SEED`, else a fresh one, printed either way.
    pub fault_proxy: bool,
    /// The DHCP range's lease time ([`RigOptions::lease_time`]); `None`
    /// means the rig's `1h`.
    pub lease_time: Option<String>,
    /// Start our agents and controller replicas with the rig (default).
    /// Without, the guests and the API are ready for another load balancer
    /// (a peer, or kube-vip before a migration) and [`LbRig::start_ours`]
    /// starts ours later.
    pub start_ours: bool,
    /// A second DHCP range, [`WIDE_RANGE`], for hundreds of leases (kube-vip
    /// takes one per node per Service), and a route to [`WIDE_LAN`] on the
    /// DHCP server, the client and the observer so that they reach its
    /// addresses. The guests keep their /24: a LoadBalancer address is a
    /// /32 on its own link.
    pub wide_lan: bool,
    /// Names of nodes without a guest that get node credentials
    /// ([`rig::RigOptions::credential_only_nodes`]): a bench simulates them.
    pub simulated_nodes: Vec<String>,
    /// Names of nodes that run as VMs ([`LbRig::vm_node_spec`]): node
    /// credentials, no guest namespace.
    pub vm_nodes: Vec<String>,
    /// Install the controller's side with the real `helm` from
    /// `packaging/helm/` instead of applying [`Options::manifests`]; the
    /// controllers then run as the chart's ServiceAccount (a TokenRequest
    /// of it) and everything lives in the release's namespace.
    pub helm: Option<HelmInstall>,
}

/// How [`Options::helm`] installs the charts.
#[derive(Debug, Clone)]
pub struct HelmInstall {
    /// `packaging/helm/` of the checkout under test.
    pub charts: PathBuf,
    /// The controller chart's release (the CRD chart's is `<release>-crd`).
    pub release: String,
    /// The release's namespace (created by `helm --create-namespace`).
    pub namespace: String,
    /// `--set` values.
    pub set: Vec<String>,
}

impl HelmInstall {
    /// The chart's ServiceAccount (`<release>-controller`).
    pub fn service_account(&self) -> String {
        format!("{}-controller", self.release)
    }

    /// Runs the real `helm` as the rig's admin; `Ok` with its output when
    /// it succeeded, else an error with what it said.
    pub fn run(admin_kubeconfig: &Path, args: &[&str]) -> Result<String> {
        let home = admin_kubeconfig.with_file_name("helm");
        let out = crate::locate::helm::command(&home)
            .map_err(anyhow::Error::msg)?
            .args(args)
            .arg("--kubeconfig")
            .arg(admin_kubeconfig)
            .output()
            .context("running helm")?;
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if !out.status.success() {
            bail!("helm {}: {}", args.join(" "), said.trim());
        }
        Ok(said)
    }

    fn install(&self, admin_kubeconfig: &Path, admission_policy: bool) -> Result<()> {
        let crd = self.charts.join("harvester-node-agent-crd");
        let chart = self.charts.join("harvester-node-agent");
        Self::run(
            admin_kubeconfig,
            &[
                "install",
                &format!("{}-crd", self.release),
                &crd.to_string_lossy(),
                "--wait",
            ],
        )?;
        let mut args = vec![
            "install".to_string(),
            self.release.clone(),
            chart.to_string_lossy().into_owned(),
            "--namespace".into(),
            self.namespace.clone(),
            "--create-namespace".into(),
        ];
        if !admission_policy {
            args.extend(["--set".into(), "admissionPolicies.enabled=false".into()]);
        }
        for s in &self.set {
            args.extend(["--set".into(), s.clone()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Self::run(admin_kubeconfig, &args)?;
        Ok(())
    }
}

impl Options {
    /// Liveness judged through the API server only, as before issue #30:
    /// the LAN membership off, a heartbeat every second and a node stale
    /// after 3 s. For tests of what that path alone must get right (the
    /// takeover guard behind a holder cut off from the API server, a
    /// heartbeat too slow for the bound).
    pub fn api_liveness(mut self) -> Options {
        self.agent_config
            .push_str("lb_membership_port = 0\nlb_heartbeat = \"1s\"\n");
        self.controller_args
            .extend(["--node-stale-after", "3s", "--watch-quiet-after", "2s"].map(String::from));
        self
    }
}

/// The LAN's prefix with [`Options::wide_lan`].
pub const WIDE_LAN: &str = "10.77.0.0/22";
/// The second DHCP range with [`Options::wide_lan`]: 512 addresses.
pub const WIDE_RANGE: (&str, &str) = ("10.77.1.0", "10.77.2.255");

impl Options {
    pub fn new(bin: impl Into<PathBuf>, manifests: impl Into<PathBuf>) -> Options {
        Options {
            bin: bin.into(),
            manifests: manifests.into(),
            guests: 3,
            controllers: 2,
            agent_config: String::new(),
            controller_args: Vec::new(),
            endpoint_slices: false,
            admission_policy: true,
            uplink_from_route: false,
            api_on_lan: true,
            fault_proxy: false,
            lease_time: None,
            start_ours: true,
            wide_lan: false,
            simulated_nodes: Vec::new(),
            vm_nodes: Vec::new(),
            helm: None,
        }
    }
}

/// A process the rig started; killed when dropped.
struct Proc {
    child: Child,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Fields drop in order: the agents, the controllers, the fault proxy and
/// the admin client go before the rig, so its kube-apiserver stops with no
/// client connected (with clients it waits out its 5 s grace and is
/// killed).
pub struct LbRig {
    pub client_ns: String,
    /// The LAN host that asks who has an address (the failover tests' and
    /// the soak's ARP prober), which nothing talks to: every request it
    /// sends, each with a sender MAC of its own, updates the entry a guest
    /// holds for its address, and were that the client's, the guests'
    /// answers to the client would go to the last request's made-up MAC.
    pub observer: rig::LanHost,
    agents: Vec<Option<Proc>>,
    controllers: Vec<Option<Proc>>,
    /// The proxy's port made reachable in each guest, as the rig does for
    /// the API server's.
    proxy_forwarders: Vec<Forwarder>,
    /// With [`Options::api_on_lan`]: per guest, the port on the LAN's
    /// address where its agent reaches the API server, and the forwarder
    /// there while its path is not cut ([`LbRig::cut_api`]).
    lan_paths: Vec<(u16, Option<Forwarder>)>,
    /// The VM nodes' ports on the LAN's address to the API server.
    vm_paths: Vec<Forwarder>,
    proxy: Option<FaultProxy>,
    admin: kube::Client,
    /// With [`Options::helm`]: the chart's ServiceAccount's kubeconfig,
    /// which the controllers run with.
    controller_kubeconfig: Option<PathBuf>,
    rt: tokio::runtime::Runtime,
    opts: Options,
    pub rig: Rig,
}

/// A forwarder listening on the LAN's address in `lan_ns` to `upstream`
/// on this machine's loopback, at a free port. The port is free on this
/// machine's loopback, which says nothing of the LAN namespace (CI once
/// found one taken there): a port in use there is given up for another.
fn forward_from_lan(lan_ns: &str, upstream: u16) -> Result<(std::net::SocketAddr, Forwarder)> {
    let mut last = None;
    for _ in 0..5 {
        let port = rig::apiserver::free_port()?;
        let listen = std::net::SocketAddr::from((rig::LAN_ADDR.parse::<Ipv4Addr>()?, port));
        match Forwarder::start_at(lan_ns, listen, upstream) {
            Ok(f) => return Ok((listen, f)),
            Err(e) => last = Some(e.context(format!("listening at {listen}"))),
        }
    }
    Err(last.expect("tried"))
}

impl LbRig {
    /// Whether the rig was started with [`Options::wide_lan`].
    pub fn wide_lan(&self) -> bool {
        self.opts.wide_lan
    }

    pub fn start(opts: Options) -> Result<LbRig> {
        // Every guest's test listener, and the client, are socat: without
        // it nothing answers TCP, which would look like the product's fault.
        crate::prereq::require(&[crate::prereq::Prereq::Socat])?;
        let mut rig = Rig::start(RigOptions {
            guests: opts.guests,
            dhcp: true,
            apiserver: true,
            lease_time: opts.lease_time.clone(),
            credential_only_nodes: opts
                .simulated_nodes
                .iter()
                .chain(&opts.vm_nodes)
                .cloned()
                .collect(),
            dnsmasq_args: if opts.wide_lan {
                vec![format!(
                    "--dhcp-range={},{},255.255.252.0,{}",
                    WIDE_RANGE.0,
                    WIDE_RANGE.1,
                    opts.lease_time
                        .as_deref()
                        .unwrap_or(rig::DEFAULT_LEASE_TIME)
                )]
            } else {
                Vec::new()
            },
            ..RigOptions::default()
        })?;
        let client_ns = rig.add_lan_host("client").context("client namespace")?.ns;
        let observer = rig
            .add_lan_host("arp-observer")
            .context("ARP observer namespace")?;
        if opts.wide_lan {
            for (ns, dev) in [
                (rig.lan_ns(), "br0"),
                (client_ns.as_str(), "eth0"),
                (observer.ns.as_str(), "eth0"),
            ] {
                rig::process::run_args("ip", ["-n", ns, "route", "add", WIDE_LAN, "dev", dev])
                    .with_context(|| format!("a route to {WIDE_LAN} in {ns}"))?;
            }
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let api = rig.apiserver().context("API server")?;
        let admin_kubeconfig = api.admin_kubeconfig().to_path_buf();
        let admin = rt.block_on(rig::kube_client(&admin_kubeconfig))?;
        let mut controller_kubeconfig = None;
        if let Some(h) = &opts.helm {
            h.install(&admin_kubeconfig, opts.admission_policy)
                .with_context(|| format!("installing {}", h.charts.display()))?;
            let path = admin_kubeconfig.with_file_name(format!(
                "sa-{}-{}.kubeconfig",
                h.namespace,
                h.service_account()
            ));
            rt.block_on(api.service_account_kubeconfig(
                &admin,
                &h.namespace,
                &h.service_account(),
                &path,
            ))?;
            controller_kubeconfig = Some(path);
        } else {
            let mut manifests = rig::manifests::load_kustomization(&opts.manifests)?;
            if !opts.admission_policy {
                manifests.retain(|m| !m.kind().starts_with("ValidatingAdmissionPolicy"));
            }
            rt.block_on(rig::manifests::apply(
                &admin,
                &manifests,
                rig::manifests::Mode::Apply,
            ))
            .with_context(|| format!("applying {}", opts.manifests.display()))?;
        }
        let mut lb = LbRig {
            controller_kubeconfig,
            rig,
            client_ns,
            observer,
            rt,
            admin,
            agents: Vec::new(),
            controllers: Vec::new(),
            proxy_forwarders: Vec::new(),
            lan_paths: Vec::new(),
            vm_paths: Vec::new(),
            proxy: None,
            opts,
        };
        if lb.opts.fault_proxy {
            lb.start_fault_proxy()?;
        }
        for i in 0..lb.opts.guests {
            lb.configure_uplink(i)?;
            if lb.opts.api_on_lan {
                let upstream = lb.api_upstream()?;
                let (listen, fwd) = forward_from_lan(lb.rig.lan_ns(), upstream)
                    .with_context(|| format!("the API server on the LAN for guest {i}"))?;
                lb.lan_paths.push((listen.port(), Some(fwd)));
            }
            let node = lb.rig.node_name(i).to_string();
            lb.register_node(&node)?;
            lb.agents.push(None);
            lb.listen(i)?;
        }
        lb.controllers = (0..lb.opts.controllers).map(|_| None).collect();
        if lb.opts.start_ours {
            lb.start_ours()?;
        }
        Ok(lb)
    }

    /// Starts every agent and controller replica that does not run.
    pub fn start_ours(&mut self) -> Result<()> {
        for i in 0..self.opts.guests {
            if self.agents[i].is_none() {
                self.start_agent(i)?;
            }
        }
        for i in 0..self.opts.controllers {
            if self.controllers[i].is_none() {
                self.start_controller(i)?;
            }
        }
        Ok(())
    }

    /// Stops every agent (SIGTERM, as systemd stops the unit) and every
    /// controller replica.
    pub fn stop_ours(&mut self) {
        for i in 0..self.opts.guests {
            if self.agents[i].is_some() {
                self.stop_agent(i);
            }
        }
        for i in 0..self.opts.controllers {
            self.kill_controller(i);
        }
    }

    fn start_fault_proxy(&mut self) -> Result<()> {
        let api = self.rig.apiserver().context("API server")?;
        let seed = seed_from_env()?;
        let (cert, key) = api.serving_cert();
        let proxy = FaultProxy::start(api.port(), &cert, &key, api.ca_path(), seed)
            .context("starting the fault proxy")?;
        println!(
            "fault proxy on {} in front of {}: seed {seed} (replay with {}={seed})",
            proxy.url(),
            api.url(),
            rig::faultproxy::SEED_ENV
        );
        for ns in self.rig.guest_namespaces().to_vec() {
            let fwd = Forwarder::start(&ns, proxy.port())
                .with_context(|| format!("forward the proxy's port into {ns}"))?;
            self.proxy_forwarders.push(fwd);
        }
        self.proxy = Some(proxy);
        Ok(())
    }

    /// The fault proxy the agents and controllers talk through, with
    /// [`Options::fault_proxy`].
    pub fn fault_proxy(&self) -> Option<&FaultProxy> {
        self.proxy.as_ref()
    }

    /// The admin kubeconfig for a process in guest `i` (a peer load
    /// balancer): through the guest's uplink with [`Options::api_on_lan`],
    /// as the agent's.
    pub fn guest_admin_kubeconfig(&self, i: usize) -> Result<PathBuf> {
        let api = self.rig.apiserver().context("API server")?;
        match self.lan_paths.get(i) {
            Some((port, _)) if self.opts.api_on_lan => api.admin_kubeconfig_via(
                &format!("https://{}:{port}", rig::LAN_ADDR),
                &format!("guest-{i}-via-lan"),
            ),
            _ => Ok(api.admin_kubeconfig().to_path_buf()),
        }
    }

    /// The kubeconfig guest `i`'s agent was started with (rotate it to try
    /// credential changes).
    pub fn agent_kubeconfig(&self, i: usize) -> Result<PathBuf> {
        self.kubeconfig(Some(&self.node_name(i)))
    }

    /// Guest `i`'s way to the API server (or the fault proxy) on the LAN's
    /// address, with [`Options::api_on_lan`].
    /// Where the agents' API path leads: the fault proxy, else the API
    /// server.
    fn api_upstream(&self) -> Result<u16> {
        Ok(match &self.proxy {
            Some(p) => p.port(),
            None => self.rig.apiserver().context("API server")?.port(),
        })
    }

    fn open_lan_path(&mut self, i: usize) -> Result<()> {
        let upstream = self.api_upstream()?;
        let lan_ns = self.rig.lan_ns().to_string();
        let Some((port, fwd)) = self.lan_paths.get_mut(i) else {
            bail!("guest {i} has no path to the API server on the LAN");
        };
        if fwd.is_none() {
            let listen =
                std::net::SocketAddr::from((rig::LAN_ADDR.parse::<std::net::Ipv4Addr>()?, *port));
            *fwd = Some(
                Forwarder::start_at(&lan_ns, listen, upstream)
                    .with_context(|| format!("the API server at {listen} for guest {i}"))?,
            );
        }
        Ok(())
    }

    /// What VM node `name` (one of [`Options::vm_nodes`]) needs to join the
    /// cluster as a guest namespace does: its Node registered, its
    /// credentials reaching the API server (or the fault proxy) at a port
    /// of its own on the LAN's address, through its NIC, and the agents'
    /// configuration (uplink `eth0`). `address` is its NIC's address on the
    /// LAN (outside the DHCP range and the LAN hosts' addresses).
    pub fn vm_node_spec(
        &mut self,
        name: &str,
        address: Ipv4Addr,
        mac: &str,
        nic: crate::vm::node::NicModel,
    ) -> Result<crate::vm::node::NodeSpec> {
        ensure!(
            self.opts.vm_nodes.iter().any(|n| n == name),
            "{name} is not one of the rig's VM nodes (Options::vm_nodes)"
        );
        let upstream = self.api_upstream()?;
        let (listen, fwd) = forward_from_lan(self.rig.lan_ns(), upstream)
            .with_context(|| format!("the API server on the LAN for VM node {name}"))?;
        self.vm_paths.push(fwd);
        let api = self.rig.apiserver().context("API server")?;
        let kubeconfig =
            api.kubeconfig_via(Some(name), &format!("https://{listen}"), "via-lan-vm")?;
        self.register_node(name)?;
        Ok(crate::vm::node::NodeSpec {
            node_name: name.to_string(),
            bin: self.opts.bin.clone(),
            kubeconfig,
            agent_config: format!(
                "namespace = \"{}\"\nuplink = \"eth0\"\n{}\n",
                self.namespace(),
                self.opts.agent_config
            ),
            address,
            gateway: rig::LAN_ADDR.parse()?,
            mac: mac.to_string(),
            nic,
            memory_mb: 512,
            files: Vec::new(),
        })
    }

    /// A path on the LAN's address (where a VM node reaches the rig's
    /// servers) to `upstream` on this machine's loopback: another API
    /// server's port (Harvester's, for the topology relay).
    pub fn lan_path_to(&mut self, upstream: u16) -> Result<std::net::SocketAddr> {
        let (listen, fwd) = forward_from_lan(self.rig.lan_ns(), upstream)
            .with_context(|| format!("a path on the LAN to port {upstream}"))?;
        self.vm_paths.push(fwd);
        Ok(listen)
    }

    /// The kubeconfig of node `node` (`Some`) or of the controllers: through
    /// the fault proxy when there is one; a node's through its uplink with
    /// [`Options::api_on_lan`].
    fn kubeconfig(&self, node: Option<&str>) -> Result<PathBuf> {
        let api = self.rig.apiserver().context("API server")?;
        if let (true, Some(n)) = (self.opts.api_on_lan, node) {
            let i = self.guest_of(n);
            let (port, _) = self
                .lan_paths
                .get(i)
                .context("the guest's path on the LAN")?;
            return api.kubeconfig_via(
                node,
                &format!("https://{}:{port}", rig::LAN_ADDR),
                "via-lan",
            );
        }
        match (&self.proxy, node) {
            (Some(p), _) => api.kubeconfig_via(node, &p.url(), "via-proxy"),
            (None, Some(n)) => Ok(api.node_kubeconfig(n).to_path_buf()),
            (None, None) => Ok(self
                .controller_kubeconfig
                .clone()
                .unwrap_or_else(|| api.controller_kubeconfig().to_path_buf())),
        }
    }

    pub fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        self.rt.block_on(f)
    }

    pub fn admin(&self) -> kube::Client {
        self.admin.clone()
    }

    pub fn services(&self) -> Api<Service> {
        Api::namespaced(self.admin.clone(), "default")
    }

    /// The Services of the namespace of `name` (`namespace/name`, or a
    /// plain name in `default`, as every Service helper here takes it),
    /// and the plain name.
    fn services_of<'a>(&self, name: &'a str) -> (Api<Service>, &'a str) {
        let (ns, name) = split_name(name);
        (Api::namespaced(self.admin.clone(), ns), name)
    }

    /// Creates namespace `name` (as a tenant's would be).
    pub fn create_namespace(&self, name: &str) -> Result<()> {
        let api: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(self.admin.clone());
        let ns = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}
        }))?;
        self.block_on(api.create(&PostParams::default(), &ns))
            .with_context(|| format!("creating namespace {name}"))?;
        Ok(())
    }

    /// The `LoadBalancerNode` objects, untyped (the caller deserializes
    /// them into the agent's contract types).
    pub fn node_objects(&self) -> Api<DynamicObject> {
        node_objects_in(self.admin.clone(), self.namespace())
    }

    /// Where the controller's objects live: [`NAMESPACE`], or the Helm
    /// release's.
    pub fn namespace(&self) -> &str {
        self.opts
            .helm
            .as_ref()
            .map_or(NAMESPACE, |h| h.namespace.as_str())
    }

    /// The admin's kubeconfig: for a client of a thread's own (the rig's
    /// client is driven only by the rig's runtime, on the test's thread).
    pub fn admin_kubeconfig(&self) -> Option<PathBuf> {
        self.rig
            .apiserver()
            .map(|a| a.admin_kubeconfig().to_path_buf())
    }

    /// How many guests the rig was started with.
    pub fn guests(&self) -> usize {
        self.opts.guests
    }

    /// Node `node`'s object as JSON, if it exists.
    pub fn node_object(&self, node: &str) -> Option<serde_json::Value> {
        let obj = self.block_on(self.node_objects().get_opt(node)).ok()??;
        serde_json::to_value(obj).ok()
    }

    /// Changes what the next [`LbRig::start_agent`] writes into the agents'
    /// configuration files.
    pub fn set_agent_config(&mut self, extra: &str) {
        self.opts.agent_config = extra.to_string();
    }

    pub fn node_name(&self, i: usize) -> String {
        self.rig.node_name(i).to_string()
    }

    pub fn guest_of(&self, node: &str) -> usize {
        self.rig
            .node_names()
            .iter()
            .position(|n| n == node)
            .unwrap_or_else(|| panic!("no guest runs node {node}"))
    }

    /// Creates the Kubernetes Node `name` (as a kubelet registering).
    pub fn register_node(&self, name: &str) -> Result<()> {
        let nodes: Api<Node> = Api::all(self.admin.clone());
        let node: Node = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Node", "metadata": {"name": name}
        }))?;
        self.block_on(nodes.create(&PostParams::default(), &node))
            .with_context(|| format!("creating Node {name}"))?;
        Ok(())
    }

    fn agent_dir(&self, i: usize) -> PathBuf {
        self.rig
            .dir()
            .join(format!("agent-{}", self.rig.node_name(i)))
    }

    pub fn agent_socket(&self, i: usize) -> PathBuf {
        self.agent_dir(i).join("agent.sock")
    }

    /// Whether guest `i`'s spec assigns Service `service` (`namespace/name`)
    /// to it, to hold (not to release).
    pub fn assigned(&self, i: usize, service: &str) -> bool {
        self.assigned_to(&self.node_name(i), service)
    }

    /// [`LbRig::assigned`] by node name (a VM node's too).
    pub fn assigned_to(&self, node: &str, service: &str) -> bool {
        self.node_object(node).is_some_and(|o| {
            o["spec"]["assignments"].as_array().is_some_and(|a| {
                a.iter()
                    .any(|a| a["service"] == service && a["release"] != true)
            })
        })
    }

    pub fn agent_log(&self, i: usize) -> String {
        fs::read_to_string(self.agent_dir(i).join("agent.log")).unwrap_or_default()
    }

    /// GET `path` from guest `i`'s agent at `listen` (its `metrics_listen`,
    /// on the guest's loopback), from inside the guest's namespace.
    pub fn agent_http(&self, i: usize, listen: &str, path: &str) -> Result<String> {
        let out = self
            .rig
            // busybox 1.35's `wget -T` dies of SIGSEGV: `timeout` bounds it.
            .netns_cmd(self.rig.guest_ns(i), "timeout")
            .args(["10", "busybox", "wget", "-q", "-O", "-"])
            .arg(format!("http://{listen}{path}"))
            .output()
            .context("running busybox wget in the guest")?;
        anyhow::ensure!(
            out.status.success(),
            "GET {path} from guest {i}'s agent: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Starts (or restarts) guest `i`'s agent with the same state directory.
    pub fn start_agent(&mut self, i: usize) -> Result<()> {
        let node = self.node_name(i);
        let dir = self.agent_dir(i);
        fs::create_dir_all(&dir)?;
        let config = dir.join("config.toml");
        fs::write(
            &config,
            format!(
                "{}namespace = \"{}\"\n{}\n",
                if self.opts.uplink_from_route {
                    ""
                } else {
                    "uplink = \"eth0\"\n"
                },
                self.namespace(),
                self.opts.agent_config
            ),
        )?;
        let kubeconfig = self.kubeconfig(Some(&node))?;
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("agent.log"))?;
        let mut cmd = self.rig.netns_cmd(self.rig.guest_ns(i), &self.opts.bin);
        cmd.arg("run")
            .arg("--config")
            .arg(&config)
            .args(["--node-name", &node, "--credentials-retry", "1s"])
            .arg("--state-dir")
            .arg(dir.join("state"))
            .arg("--socket")
            .arg(dir.join("agent.sock"))
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .env("HNA_LOG_TARGET", "stderr")
            .env("RUST_LOG", "info,harvester_node_agent=debug")
            .stdout(Stdio::null())
            .stderr(log);
        let child = cmd.spawn().context("starting an agent")?;
        self.agents[i] = Some(Proc { child });
        Ok(())
    }

    /// Sends `signal` to guest `i`'s agent; for SIGKILL, also reaps it.
    pub fn signal_agent(&mut self, i: usize, signal: nix::sys::signal::Signal) {
        let proc = self.agents[i].as_mut().expect("agent running");
        // `ip netns exec` execs the agent, so the child is the agent.
        let pid = nix::unistd::Pid::from_raw(proc.child.id() as i32);
        nix::sys::signal::kill(pid, signal).unwrap();
        if signal == nix::sys::signal::Signal::SIGKILL {
            let _ = proc.child.wait();
            self.agents[i] = None;
        }
    }

    /// Guest `i` is cut off from the API server, its LAN untouched
    /// ([`Rig::cut_api`]; through the fault proxy too, when there is one;
    /// on the LAN's address with [`Options::api_on_lan`], as a firewall or
    /// a route on the way to the control plane would): every connection is
    /// cut and none is accepted.
    pub fn cut_api(&mut self, i: usize) {
        if let Some((_, fwd)) = self.lan_paths.get_mut(i)
            && let Some(mut f) = fwd.take()
        {
            f.stop();
        }
        let ns = self.rig.guest_ns(i).to_string();
        for f in self.proxy_forwarders.iter_mut().filter(|f| f.netns() == ns) {
            f.stop();
        }
        self.proxy_forwarders.retain(|f| f.netns() != ns);
        self.rig.cut_api(i);
    }

    /// The API server answers guest `i` `delay` late, on its path on the
    /// LAN ([`Options::api_on_lan`]; [`Forwarder::delay_replies`]): a
    /// brownout for that node alone. Zero: at once again.
    pub fn delay_api_replies(&self, i: usize, delay: Duration) -> Result<()> {
        let Some((_, Some(fwd))) = self.lan_paths.get(i) else {
            bail!(
                "guest {i} has no open path to the API server on the LAN (api_on_lan off, or cut)"
            );
        };
        fwd.delay_replies(delay);
        Ok(())
    }

    /// Undoes [`LbRig::cut_api`].
    pub fn restore_api(&mut self, i: usize) -> Result<()> {
        if self.opts.api_on_lan {
            self.open_lan_path(i)?;
        }
        self.rig.restore_api(i)?;
        if let Some(p) = &self.proxy {
            let ns = self.rig.guest_ns(i).to_string();
            self.proxy_forwarders.push(Forwarder::start(&ns, p.port())?);
        }
        Ok(())
    }

    /// Guest `i` is switched off ([`Rig::delete_guest`]): its agent,
    /// listener and links die with its namespace.
    pub fn delete_guest(&mut self, i: usize) -> Result<()> {
        let ns = self.rig.guest_ns(i).to_string();
        if let Some(f) = self.proxy_forwarders.iter_mut().find(|f| f.netns() == ns) {
            f.stop();
        }
        self.rig.delete_guest(i)?;
        if let Some(mut p) = self.agents[i].take() {
            let _ = p.child.wait();
        }
        Ok(())
    }

    /// Waits until the LAN membership of every node counts all the others
    /// alive and each node is heard by its witnesses (the failover
    /// measured is the one a running cluster has, not a membership's first
    /// seconds). With the membership off (`lb_membership_port = 0`), at
    /// once.
    pub fn wait_for_membership(&self, within: Duration) -> Result<()> {
        let names: Vec<String> = (0..self.rig.guest_count())
            .filter(|i| self.agents.get(*i).is_some_and(Option::is_some))
            .map(|i| self.node_name(i).to_string())
            .collect();
        // Per node: how many others SWIM counts alive, and whom of those it
        // watches it has heard itself (`status.lan.hears`).
        let counts = || -> Vec<(String, Option<u64>, Vec<String>)> {
            names
                .iter()
                .map(|n| {
                    let lan = self.node_object(n).map(|o| o["status"]["lan"].clone());
                    let alive = lan.as_ref().and_then(|l| l["alive"].as_u64());
                    let hears = lan
                        .as_ref()
                        .and_then(|l| l["hears"].as_array().cloned())
                        .unwrap_or_default()
                        .iter()
                        .filter_map(|h| h.as_str().map(str::to_string))
                        .collect();
                    (n.clone(), alive, hears)
                })
                .collect()
        };
        // Every running agent is a member, unless the configuration turns
        // the membership off (then none is). A node whose status shows no
        // membership yet is not left out: it may be starting, and one that
        // is has heard nobody.
        if self.opts.agent_config.contains("lb_membership_port = 0") {
            return Ok(());
        }
        let done = wait_for(within, || {
            let c = counts();
            let members: Vec<&String> = c.iter().map(|(n, _, _)| n).collect();
            let everyone_alive = c
                .iter()
                .all(|(_, a, _)| *a == Some(members.len().saturating_sub(1) as u64));
            // A witness reports only a node it has heard itself: until two
            // (or all, with fewer) have heard each member, a member that
            // dies now is never convicted (a guest paused half a second
            // after the membership started was heard by one witness only).
            let need = members.len().saturating_sub(1).min(2);
            let everyone_heard = members
                .iter()
                .all(|m| c.iter().filter(|(_, _, hears)| hears.contains(*m)).count() >= need);
            (everyone_alive && everyone_heard).then_some(())
        });
        ensure!(
            done.is_some(),
            "the LAN membership did not settle within {within:?}: {:?}",
            counts()
        );
        Ok(())
    }

    /// A node's own address on guest `i`'s uplink and its default route,
    /// as a VM has from its network: replies from a LoadBalancer address
    /// (a /32 without a route) leave through it.
    pub fn configure_uplink(&self, i: usize) -> Result<()> {
        let ns = self.rig.guest_ns(i);
        let addr = format!("{}/24", node_address(i));
        rig::process::run_args("ip", ["-n", ns, "addr", "replace", &addr, "dev", "eth0"])?;
        rig::process::run_args(
            "ip",
            [
                "-n",
                ns,
                "route",
                "replace",
                "default",
                "via",
                rig::LAN_ADDR,
            ],
        )?;
        Ok(())
    }

    /// A new guest joins in the place of guest `i` after
    /// [`LbRig::delete_guest`], as a fresh VM of the same node name: new
    /// namespace and uplink, an empty state directory, its agent and test
    /// listener started.
    pub fn replace_guest(&mut self, i: usize) -> Result<()> {
        self.rig.recreate_guest(i)?;
        if self.proxy.is_some() {
            let ns = self.rig.guest_ns(i).to_string();
            let port = self.proxy.as_ref().map(|p| p.port()).unwrap_or_default();
            self.proxy_forwarders.retain(|f| f.netns() != ns);
            self.proxy_forwarders.push(Forwarder::start(&ns, port)?);
        }
        self.configure_uplink(i)?;
        let state = self.agent_dir(i).join("state");
        if state.exists() {
            fs::remove_dir_all(&state)
                .with_context(|| format!("remove {} (a new VM's disk)", state.display()))?;
        }
        self.start_agent(i)?;
        self.listen(i)
    }

    /// Guest `i`'s agent's lease files (`<state>/leases/*.json`): each
    /// file's name, the address it holds and when that lease was acquired
    /// (Unix ms); unreadable ones are listed with `0.0.0.0` and 0.
    pub fn agent_lease_files(&self, i: usize) -> Vec<(String, Ipv4Addr, u64)> {
        let dir = self.agent_dir(i).join("state").join("leases");
        let mut out = Vec::new();
        for entry in fs::read_dir(&dir).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !name.ends_with(".json") || name.starts_with('.') {
                continue;
            }
            let record = fs::read_to_string(entry.path())
                .ok()
                .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
                .unwrap_or_default();
            let address = record["address"]
                .as_str()
                .and_then(|a| a.parse().ok())
                .unwrap_or(Ipv4Addr::UNSPECIFIED);
            let acquired = record["acquired_unix_ms"].as_u64().unwrap_or(0);
            out.push((name, address, acquired));
        }
        out
    }

    /// SIGTERM and wait for the agent to exit.
    pub fn stop_agent(&mut self, i: usize) -> std::process::ExitStatus {
        self.signal_agent(i, nix::sys::signal::Signal::SIGTERM);
        let mut proc = self.agents[i].take().expect("agent running");
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(st) = proc.child.try_wait().unwrap() {
                return st;
            }
            assert!(Instant::now() < deadline, "agent did not stop within 20 s");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn controller_log_path(&self, i: usize) -> PathBuf {
        self.rig.dir().join(format!("controller-{i}.log"))
    }

    pub fn controller_log(&self, i: usize) -> String {
        fs::read_to_string(self.controller_log_path(i)).unwrap_or_default()
    }

    pub fn controller_identity(i: usize) -> String {
        format!("controller-{i}")
    }

    pub fn start_controller(&mut self, i: usize) -> Result<()> {
        let kubeconfig = self.kubeconfig(None)?;
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.controller_log_path(i))?;
        let child = Command::new(&self.opts.bin)
            .args([
                "controller",
                "--credentials-retry",
                "1s",
                "--namespace",
                self.namespace(),
            ])
            .args(["--identity", &Self::controller_identity(i)])
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .args(&self.opts.controller_args)
            // Slices: the default (`auto`), which reads v1 EndpointSlices
            // on every supported server. Endpoints: asked for, as `auto`
            // would not read them there.
            .args(if self.opts.endpoint_slices {
                &[][..]
            } else {
                &["--endpoint-source", "endpoints"][..]
            })
            .env("HNA_LOG_TARGET", "stderr")
            .env("RUST_LOG", "info,harvester_node_agent=debug")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting a controller")?;
        self.controllers[i] = Some(Proc { child });
        Ok(())
    }

    /// Changes the extra arguments of the next [`LbRig::start_controller`].
    pub fn set_controller_args(&mut self, args: &[&str]) {
        self.opts.controller_args = args.iter().map(|a| a.to_string()).collect();
    }

    /// Guest `i`'s agent's pid, while it runs (`ip netns exec` execs it).
    pub fn agent_pid(&self, i: usize) -> Option<u32> {
        self.agents.get(i)?.as_ref().map(|p| p.child.id())
    }

    /// Whether guest `i`'s agent runs (as far as this rig started it).
    pub fn agent_running(&self, i: usize) -> bool {
        self.agent_pid(i).is_some()
    }

    /// Controller replica `i`'s process id while it runs.
    pub fn controller_pid(&self, i: usize) -> Option<u32> {
        self.controllers.get(i)?.as_ref().map(|p| p.child.id())
    }

    pub fn kill_controller(&mut self, i: usize) {
        if let Some(mut p) = self.controllers[i].take() {
            let _ = p.child.kill();
            let _ = p.child.wait();
        }
    }

    /// The identity holding the controller Lease now.
    pub fn leader(&self) -> Option<String> {
        use k8s_openapi::api::coordination::v1::Lease;
        let leases: Api<Lease> = Api::namespaced(self.admin.clone(), self.namespace());
        self.block_on(leases.get_opt(CONTROLLER_LEASE))
            .ok()
            .flatten()
            .and_then(|l| l.spec?.holder_identity)
            .filter(|h| !h.is_empty())
    }

    /// A TCP listener on [`LISTEN_PORT`] in guest `i` that answers every
    /// connection with the node's name.
    fn listen(&mut self, i: usize) -> Result<()> {
        let node = self.node_name(i);
        let mut cmd = self.rig.netns_cmd(self.rig.guest_ns(i), "socat");
        cmd.arg(format!("TCP-LISTEN:{LISTEN_PORT},fork,reuseaddr"))
            .arg(format!("SYSTEM:echo {node}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // Killed with everything else in the namespace at teardown.
        cmd.spawn().context("socat listener")?;
        Ok(())
    }

    /// Connects from the client namespace to `ip:port` and returns what the
    /// far end said (the holder's node name), or the failure.
    pub fn tcp_from_client(&self, ip: Ipv4Addr, port: u16) -> Result<String> {
        let out = self
            .rig
            .netns_cmd(&self.client_ns, "socat")
            .args(["-T", "3", "-"])
            .arg(format!("TCP:{ip}:{port},connect-timeout=3"))
            .stdin(Stdio::null())
            .output()?;
        if !out.status.success() {
            bail!(
                "socat to {ip}:{port}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    }

    /// Everything on the way from the client to `ip` on guest `i` (whose
    /// link has `mac`), for a test that finds the address answers ARP but
    /// not TCP: the guest's links, addresses, routes and listeners, the
    /// client's neighbour entry, the bridge's forwarding entry for the MAC.
    pub fn path_diagnostics(&self, i: usize, ip: Ipv4Addr, mac: &str) -> String {
        let run = |ns: &str, args: &[&str]| -> String {
            let out = Command::new("ip").arg("-n").arg(ns).args(args).output();
            match out {
                Ok(o) => format!(
                    "$ ip -n {ns} {}\n{}{}",
                    args.join(" "),
                    String::from_utf8_lossy(&o.stdout),
                    String::from_utf8_lossy(&o.stderr)
                ),
                Err(e) => format!("ip {args:?}: {e}\n"),
            }
        };
        let guest = self.rig.guest_ns(i);
        let lan = self.rig.lan_ns();
        let ss = self
            .rig
            .netns_cmd(guest, "ss")
            .args(["-ltnp"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        let fdb = Command::new("bridge")
            .args(["-n", lan, "fdb", "show", "br", "br0"])
            .output()
            .map(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .filter(|l| l.to_lowercase().contains(&mac.to_lowercase()))
                    .collect::<Vec<_>>()
                    .join("\n")
            })
            .unwrap_or_default();
        format!(
            "{}{}{}{}$ ss -ltnp (guest {i})\n{ss}$ bridge fdb | grep {mac}\n{fdb}\n{}",
            run(guest, &["-br", "link"]),
            run(guest, &["-br", "addr"]),
            run(guest, &["route"]),
            run(&self.client_ns, &["neigh", "show", &ip.to_string()]),
            run(lan, &["-br", "link"]),
        )
    }

    /// Our links in guest `i`: name, MAC, IPv4 addresses with prefix.
    pub fn hlb_links(&self, i: usize) -> Vec<Link> {
        let out = Command::new("ip")
            .args(["-n", self.rig.guest_ns(i), "-j", "addr", "show"])
            .output()
            .expect("ip addr");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|l| {
                let name = l["ifname"].as_str()?;
                name.starts_with(INTERFACE_PREFIX).then(|| Link {
                    name: name.to_string(),
                    mac: l["address"].as_str().unwrap_or_default().to_string(),
                    addrs: l["addr_info"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter(|a| a["family"] == "inet")
                        .map(|a| {
                            format!(
                                "{}/{}",
                                a["local"].as_str().unwrap_or_default(),
                                a["prefixlen"]
                            )
                        })
                        .collect(),
                })
            })
            .collect()
    }

    /// The guests that carry `ip` on one of our links, by node name.
    pub fn carriers(&self, ip: Ipv4Addr) -> Vec<(String, Link)> {
        (0..self.opts.guests)
            .flat_map(|i| {
                self.hlb_links(i)
                    .into_iter()
                    .filter(|l| l.addrs.iter().any(|a| a == &format!("{ip}/32")))
                    .map(move |l| (i, l))
            })
            .map(|(i, l)| (self.node_name(i), l))
            .collect()
    }

    pub fn create_service(
        &self,
        name: &str,
        annotations: &[(&str, &str)],
        ports: &[u16],
    ) -> Result<Service> {
        self.create_service_with(name, annotations, ports, serde_json::json!({}))
    }

    /// [`LbRig::create_service`] with more `spec` fields (e.g.
    /// `{"externalTrafficPolicy": "Local"}`).
    pub fn create_service_with(
        &self,
        name: &str,
        annotations: &[(&str, &str)],
        ports: &[u16],
        spec: serde_json::Value,
    ) -> Result<Service> {
        self.create_service_by(&self.admin, name, annotations, ports, spec)
    }

    /// [`LbRig::create_service`] by `client` (a tenant's, [`LbRig::tenant`]).
    pub fn create_service_as(
        &self,
        client: &kube::Client,
        name: &str,
        annotations: &[(&str, &str)],
        ports: &[u16],
    ) -> Result<Service> {
        self.create_service_by(client, name, annotations, ports, serde_json::json!({}))
    }

    /// Sets (`Some`) or removes (`None`) an annotation of Service `name`
    /// by `client` (a tenant's, [`LbRig::tenant`]).
    pub fn annotate_as(
        &self,
        client: &kube::Client,
        name: &str,
        key: &str,
        value: Option<&str>,
    ) -> Result<()> {
        let (ns, name) = split_name(name);
        let api: Api<Service> = Api::namespaced(client.clone(), ns);
        let patch = serde_json::json!({"metadata": {"annotations": {key: value}}});
        self.block_on(api.patch(name, &PatchParams::default(), &Patch::Merge(&patch)))?;
        Ok(())
    }

    fn create_service_by(
        &self,
        client: &kube::Client,
        name: &str,
        annotations: &[(&str, &str)],
        ports: &[u16],
        spec: serde_json::Value,
    ) -> Result<Service> {
        let (ns, name) = split_name(name);
        let api: Api<Service> = Api::namespaced(client.clone(), ns);
        let annotations: BTreeMap<&str, &str> = annotations.iter().copied().collect();
        let ports: Vec<serde_json::Value> = ports
            .iter()
            .map(|p| serde_json::json!({"name": format!("p{p}"), "port": p, "protocol": "TCP", "targetPort": LISTEN_PORT}))
            .collect();
        let mut body = serde_json::json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "annotations": annotations},
            "spec": {"type": "LoadBalancer", "ports": ports, "selector": {"app": name}},
        });
        if let Some(extra) = spec.as_object() {
            for (k, v) in extra {
                body["spec"][k] = v.clone();
            }
        }
        let svc: Service = serde_json::from_value(body)?;
        Ok(self.block_on(api.create(&PostParams::default(), &svc))?)
    }

    /// Service `name`'s Endpoints: one ready endpoint on each of `nodes`
    /// (the rig runs no kube-controller-manager, so the test says where
    /// the Pods are). Created or replaced.
    /// Says that Service `name` has one ready endpoint on each of `nodes`:
    /// an Endpoints object, or with [`Options::endpoint_slices`] an
    /// EndpointSlice (and a second slice with a not-ready endpoint on every
    /// other node, which must not count).
    pub fn set_endpoints(&self, name: &str, nodes: &[String]) -> Result<()> {
        let pp = PatchParams::apply("hna-rig").force();
        if self.opts.endpoint_slices {
            let version = if self
                .block_on(self.admin.list_api_group_resources("discovery.k8s.io/v1"))
                .is_ok()
            {
                "v1"
            } else {
                "v1beta1"
            };
            let api: Api<DynamicObject> = Api::namespaced_with(
                self.admin.clone(),
                "default",
                &endpoint_slice_resource(version),
            );
            let others: Vec<String> = (0..self.opts.guests)
                .map(|i| self.node_name(i))
                .filter(|n| !nodes.contains(n))
                .collect();
            for (suffix, on, ready) in [("ready", nodes, true), ("not-ready", &others[..], false)] {
                let endpoints: Vec<serde_json::Value> = on
                    .iter()
                    .enumerate()
                    .map(|(i, n)| {
                        let mut e = serde_json::json!({
                            "addresses": [format!("10.42.{}.{}", u8::from(ready), i + 10)],
                            "conditions": {"ready": ready},
                        });
                        if version == "v1" {
                            e["nodeName"] = n.as_str().into();
                        } else {
                            e["topology"] = serde_json::json!({"kubernetes.io/hostname": n});
                        }
                        e
                    })
                    .collect();
                let slice = format!("{name}-{suffix}");
                let body = serde_json::json!({
                    "apiVersion": format!("discovery.k8s.io/{version}"), "kind": "EndpointSlice",
                    "metadata": {"name": slice, "namespace": "default",
                                 "labels": {"kubernetes.io/service-name": name}},
                    "addressType": "IPv4",
                    "endpoints": endpoints,
                    "ports": [{"port": LISTEN_PORT, "protocol": "TCP"}],
                });
                self.block_on(api.patch(&slice, &pp, &Patch::Apply(&body)))?;
            }
            return Ok(());
        }
        let api: Api<k8s_openapi::api::core::v1::Endpoints> =
            Api::namespaced(self.admin.clone(), "default");
        let addresses: Vec<serde_json::Value> = nodes
            .iter()
            .enumerate()
            .map(|(i, n)| serde_json::json!({"ip": format!("10.42.0.{}", i + 10), "nodeName": n}))
            .collect();
        let body = serde_json::json!({
            "apiVersion": "v1", "kind": "Endpoints",
            "metadata": {"name": name, "namespace": "default"},
            "subsets": if nodes.is_empty() { serde_json::json!([]) } else {
                serde_json::json!([{"addresses": addresses, "ports": [{"port": LISTEN_PORT, "protocol": "TCP"}]}])
            },
        });
        self.block_on(api.patch(name, &pp, &Patch::Apply(&body)))?;
        Ok(())
    }

    pub fn service(&self, name: &str) -> Option<Service> {
        let (api, name) = self.services_of(name);
        self.block_on(api.get_opt(name)).unwrap()
    }

    pub fn annotate(&self, name: &str, key: &str, value: Option<&str>) -> Result<()> {
        let (api, name) = self.services_of(name);
        let patch = serde_json::json!({"metadata": {"annotations": {key: value}}});
        self.block_on(api.patch(name, &PatchParams::default(), &Patch::Merge(&patch)))?;
        Ok(())
    }

    /// A client acting as a tenant of `namespace` would: a ServiceAccount
    /// `tenant` of that namespace bound to the built-in `edit` ClusterRole
    /// there and nowhere else, authenticated with its own token (a
    /// TokenRequest), not the admin's. Creates the namespace if needed.
    pub fn tenant(&self, namespace: &str) -> Result<kube::Client> {
        use k8s_openapi::api::core::v1::ServiceAccount;
        use k8s_openapi::api::rbac::v1::RoleBinding;
        let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(self.admin.clone());
        if self.block_on(namespaces.get_opt(namespace))?.is_none() {
            self.create_namespace(namespace)?;
        }
        self.aggregate_cluster_role("edit")?;
        let pp = PostParams::default();
        let sas: Api<ServiceAccount> = Api::namespaced(self.admin.clone(), namespace);
        let sa = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": "tenant", "namespace": namespace},
        }))?;
        self.block_on(sas.create(&pp, &sa))
            .with_context(|| format!("creating ServiceAccount {namespace}/tenant"))?;
        let bindings: Api<RoleBinding> = Api::namespaced(self.admin.clone(), namespace);
        let binding = serde_json::from_value(serde_json::json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": "tenant-edit", "namespace": namespace},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
            "subjects": [{"kind": "ServiceAccount", "name": "tenant", "namespace": namespace}],
        }))?;
        self.block_on(bindings.create(&pp, &binding))
            .with_context(|| format!("binding {namespace}/tenant to ClusterRole edit"))?;
        let api = self
            .rig
            .apiserver()
            .context("the LB rig has an API server")?;
        let kubeconfig = self.tenant_kubeconfig(namespace);
        self.block_on(api.service_account_kubeconfig(
            &self.admin,
            namespace,
            "tenant",
            &kubeconfig,
        ))?;
        let client = self.block_on(rig::kube_client(&kubeconfig))?;
        // Its rights are the tenant's: its own namespace only.
        let elsewhere = if namespace == "kube-system" {
            "default"
        } else {
            "kube-system"
        };
        let other: Api<Service> = Api::namespaced(client.clone(), elsewhere);
        if self.block_on(other.list(&ListParams::default())).is_ok() {
            bail!(
                "the tenant of {namespace} can list Services in `{elsewhere}`: not a tenant's rights"
            );
        }
        Ok(client)
    }

    /// Where [`LbRig::tenant`] writes the tenant's kubeconfig (its token).
    pub fn tenant_kubeconfig(&self, namespace: &str) -> PathBuf {
        self.rig
            .dir()
            .join(format!("tenant-{namespace}.kubeconfig"))
    }

    /// Fills the rules of the aggregated ClusterRole `name` (`edit`,
    /// `view`, ...) from the ClusterRoles its `aggregationRule` selects, as
    /// kube-controller-manager's aggregation controller does in a cluster
    /// (the rig runs no controller manager, so the built-in `edit` has no
    /// rules until this).
    pub fn aggregate_cluster_role(&self, name: &str) -> Result<()> {
        use k8s_openapi::api::rbac::v1::ClusterRole;
        let roles: Api<ClusterRole> = Api::all(self.admin.clone());
        let role = self
            .block_on(roles.get(name))
            .with_context(|| format!("ClusterRole {name}"))?;
        if role.rules.as_ref().is_some_and(|r| !r.is_empty()) {
            return Ok(());
        }
        let selectors = role
            .aggregation_rule
            .and_then(|a| a.cluster_role_selectors)
            .with_context(|| format!("ClusterRole {name} has no aggregationRule"))?;
        let mut rules = Vec::new();
        for sel in selectors {
            let labels: Vec<String> = sel
                .match_labels
                .unwrap_or_default()
                .into_iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            let picked =
                self.block_on(roles.list(&ListParams::default().labels(&labels.join(","))))?;
            for r in picked.items {
                // Aggregation nests: `edit` takes in `view`, itself an
                // aggregate of `system:aggregate-to-view`.
                let inner = match (&r.aggregation_rule, &r.rules) {
                    (Some(_), rules) if rules.as_ref().is_none_or(|r| r.is_empty()) => {
                        let inner = r.metadata.name.clone().unwrap_or_default();
                        self.aggregate_cluster_role(&inner)?;
                        self.block_on(roles.get(&inner))?.rules
                    }
                    _ => r.rules,
                };
                rules.extend(inner.unwrap_or_default());
            }
        }
        let patch = serde_json::json!({ "rules": rules });
        self.block_on(roles.patch(name, &PatchParams::default(), &Patch::Merge(&patch)))
            .with_context(|| format!("aggregating ClusterRole {name}"))?;
        Ok(())
    }

    /// Lists `classes` in the controller's admission policy
    /// (`controller-policy.yaml`, its `classes` variable), as an operator
    /// does who runs the controller with `--load-balancer-class`.
    pub fn allow_classes_in_controller_policy(&self, classes: &[&str]) -> Result<()> {
        let ar = ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk(
                "admissionregistration.k8s.io",
                "v1",
                "ValidatingAdmissionPolicy",
            ),
            "validatingadmissionpolicies",
        );
        let api: Api<DynamicObject> = Api::all_with(self.admin.clone(), &ar);
        const POLICY: &str = "harvester-node-agent-controller-writes";
        let mut policy = self.block_on(api.get(POLICY))?;
        let list = classes
            .iter()
            .map(|c| format!("'{c}'"))
            .collect::<Vec<_>>()
            .join(", ");
        let variables = policy.data["spec"]["variables"]
            .as_array_mut()
            .context("the controller policy has no variables")?;
        let classes_var = variables
            .iter_mut()
            .find(|v| v["name"] == "classes")
            .context("the controller policy has no `classes` variable")?;
        classes_var["expression"] = format!("[{list}]").into();
        self.block_on(api.replace(POLICY, &PostParams::default(), &policy))?;
        Ok(())
    }

    /// Installs a `ValidatingWebhookConfiguration` named `name` on UPDATE
    /// of Services and `services/status` with `failurePolicy: Fail`,
    /// pointing at a loopback port nothing listens on: as a policy engine
    /// (Kyverno, Gatekeeper) that is down leaves a cluster, every PATCH of a
    /// Service is refused ("failed calling webhook") while creates go
    /// through. `names`: only Services whose name starts with it are
    /// refused ("" for every Service), as a policy scoped to some
    /// workloads. Returns once the API server refuses such a PATCH.
    pub fn install_failing_webhook(&self, name: &str, names: &str) -> Result<()> {
        // A port that was free a moment ago: connection refused.
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let mut body = serde_json::json!({
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": name},
            "webhooks": [{
                "name": format!("{name}.policy.invalid"),
                "clientConfig": {"url": format!("https://127.0.0.1:{port}/validate")},
                "rules": [{
                    "apiGroups": [""],
                    "apiVersions": ["v1"],
                    "operations": ["UPDATE"],
                    "resources": ["services", "services/status"],
                }],
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "timeoutSeconds": 2,
            }],
        });
        if !names.is_empty() {
            body["webhooks"][0]["matchConditions"] = serde_json::json!([{
                "name": "scoped",
                "expression": format!("object.metadata.name.startsWith('{names}')"),
            }]);
        }
        let api: Api<k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration> =
            Api::all(self.admin.clone());
        let object = serde_json::from_value(body)?;
        self.block_on(api.create(&PostParams::default(), &object))
            .with_context(|| format!("creating ValidatingWebhookConfiguration {name}"))?;
        // The API server picks it up from its own watch.
        self.until_service_patches(names, false)
            .with_context(|| format!("the API server never called webhook {name}"))
    }

    /// Waits (30 s at most) until a PATCH of a Service (an annotation of
    /// the test's, on a Service of its own whose name starts with `names`)
    /// goes through (`true`) or is refused (`false`): the handshake after a
    /// webhook comes or goes.
    fn until_service_patches(&self, names: &str, through: bool) -> Option<()> {
        let probe = format!("{names}hna-webhook-probe-{}", std::process::id());
        self.create_service(&probe, &[], &[80]).ok()?;
        let seen = wait_for(Duration::from_secs(30), || {
            let went = self
                .annotate(&probe, "hna.invalid/probe", Some("x"))
                .is_ok();
            (went == through).then_some(())
        });
        let _ = self.delete_service(&probe);
        seen
    }

    /// Removes the webhook of [`LbRig::install_failing_webhook`]; returns
    /// once a PATCH of a Service whose name starts with `names` (as
    /// installed) goes through again.
    pub fn remove_webhook(&self, name: &str, names: &str) -> Result<()> {
        let api: Api<k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration> =
            Api::all(self.admin.clone());
        self.block_on(api.delete(name, &DeleteParams::default()))
            .with_context(|| format!("deleting ValidatingWebhookConfiguration {name}"))?;
        self.until_service_patches(names, true)
            .with_context(|| format!("Service PATCHes still refused after deleting webhook {name}"))
    }

    pub fn delete_service(&self, name: &str) -> Result<()> {
        let (api, name) = self.services_of(name);
        self.block_on(api.delete(name, &DeleteParams::default()))?;
        Ok(())
    }

    /// The first `status.loadBalancer.ingress` IP of Service `name`.
    pub fn ingress_ip(&self, name: &str) -> Option<Ipv4Addr> {
        ingress_ip(&self.service(name)?)
    }

    pub fn wait_ingress(&self, name: &str, within: Duration) -> Ipv4Addr {
        let mut last = None;
        let got = wait_for(within, || {
            last = self.service(name);
            last.as_ref().and_then(ingress_ip)
        });
        got.unwrap_or_else(|| {
            panic!(
                "Service {name} got no address within {within:?}; last: {:#?}\n{}",
                last.map(|s| (s.metadata.annotations, s.status)),
                self.diagnostics()
            )
        })
    }

    /// The logs' tails and every node object, for failure messages.
    pub fn diagnostics(&self) -> String {
        let mut out = String::new();
        for i in 0..self.controllers.len() {
            out += &format!(
                "--- controller {i} log:\n{}\n",
                tail(&self.controller_log(i), 30)
            );
        }
        for i in 0..self.agents.len() {
            let node = self.node_name(i);
            out += &format!(
                "--- agent {node} log:\n{}\n--- LoadBalancerNode {node}: {}\n",
                tail(&self.agent_log(i), 30),
                self.node_object(&node)
                    .map(|v| v.to_string())
                    .unwrap_or_else(|| "absent".into())
            );
        }
        out
    }

    /// Events about Service `name`: (type, reason, message).
    pub fn events(&self, name: &str) -> Vec<(String, String, String)> {
        self.events_where(name, |_| true)
    }

    /// [`LbRig::events`] that the controller reported (reporting
    /// controller `harvester-node-agent-controller`): not the API server's
    /// own, such as its ClusterIP repair loop's `ClusterIPNotAllocated`.
    pub fn our_events(&self, name: &str) -> Vec<(String, String, String)> {
        self.events_where(name, |e| {
            e.reporting_component.as_deref() == Some(CONTROLLER_REPORTER)
                || e.source.as_ref().and_then(|s| s.component.as_deref())
                    == Some(CONTROLLER_REPORTER)
        })
    }

    fn events_where(
        &self,
        name: &str,
        keep: impl Fn(&Event) -> bool,
    ) -> Vec<(String, String, String)> {
        let (ns, name) = split_name(name);
        let events: Api<Event> = Api::namespaced(self.admin.clone(), ns);
        let lp = ListParams::default().fields(&format!("involvedObject.name={name}"));
        self.block_on(events.list(&lp))
            .map(|l| {
                l.items
                    .into_iter()
                    .filter(|e| keep(e))
                    .map(|e| {
                        (
                            e.type_.unwrap_or_default(),
                            e.reason.unwrap_or_default(),
                            e.message.unwrap_or_default(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Waits for a Warning Event about `name` whose reason is `reason`.
    pub fn wait_warning(&self, name: &str, reason: &str, within: Duration) -> String {
        wait_for(within, || {
            self.our_events(name)
                .into_iter()
                .find(|(t, r, _)| t == "Warning" && r == reason)
                .map(|(_, _, m)| m)
        })
        .unwrap_or_else(|| {
            panic!(
                "no Warning {reason} about {name} within {within:?}; events: {:#?}",
                self.events(name)
            )
        })
    }

    /// dnsmasq's log from byte `from` on.
    pub fn dnsmasq_log_from(&self, from: usize) -> String {
        let log = fs::read_to_string(self.rig.dnsmasq_log()).unwrap_or_default();
        log.get(from..).unwrap_or_default().to_string()
    }

    pub fn dnsmasq_log_len(&self) -> usize {
        fs::metadata(self.rig.dnsmasq_log())
            .map(|m| m.len() as usize)
            .unwrap_or(0)
    }

    /// What a deleted Service `name` must leave: a DHCPRELEASE of `ip`
    /// with `mac` at dnsmasq since its log was `mark` long (within 10 s: a
    /// holder the controller judged down lets the Service's deletion
    /// through and sends its release once it reads its spec), no lease of
    /// dnsmasq's to `mac`, and (within 5 s) no link of ours on any guest.
    pub fn ensure_released(&self, name: &str, ip: Ipv4Addr, mac: &str, mark: usize) -> Result<()> {
        let released = wait_for(Duration::from_secs(10), || {
            self.dnsmasq_log_from(mark)
                .lines()
                .any(|l| {
                    l.contains("DHCPRELEASE") && l.contains(&ip.to_string()) && l.contains(mac)
                })
                .then_some(())
        });
        ensure!(
            released.is_some(),
            "no DHCPRELEASE for {ip} {mac} within 10 s:\n{}\nour Events on {name}: {:?}\n{}",
            self.dnsmasq_log_from(mark),
            self.our_events(name),
            self.diagnostics()
        );
        let leases = self.rig.dnsmasq_leases()?;
        ensure!(
            !leases.contains(mac),
            "dnsmasq still leases to {mac}:\n{leases}"
        );
        let unlinked = wait_for(Duration::from_secs(5), || {
            (0..self.guests())
                .all(|g| self.hlb_links(g).is_empty())
                .then_some(())
        });
        ensure!(
            unlinked.is_some(),
            "links left: {:?}",
            (0..self.guests())
                .map(|g| self.hlb_links(g))
                .collect::<Vec<_>>()
        );
        Ok(())
    }
}

/// `namespace/name`, or `name` in `default`.
fn split_name(name: &str) -> (&str, &str) {
    name.split_once('/').unwrap_or(("default", name))
}

/// Guest `i`'s own address (outside the DHCP range and the LAN hosts').
pub fn node_address(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 77, 0, 10 + i as u8)
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    pub name: String,
    pub mac: String,
    pub addrs: Vec<String>,
}

pub fn ingress_ip(svc: &Service) -> Option<Ipv4Addr> {
    svc.status
        .as_ref()?
        .load_balancer
        .as_ref()?
        .ingress
        .as_ref()?
        .first()?
        .ip
        .as_ref()?
        .parse()
        .ok()
}

pub fn annotation<'a>(svc: &'a Service, key: &str) -> Option<&'a str> {
    svc.metadata
        .annotations
        .as_ref()?
        .get(key)
        .map(String::as_str)
}

/// Polls `f` every 50 ms until it returns `Some` or `within` has passed.
pub fn wait_for<T>(within: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

fn endpoint_slice_resource(version: &str) -> ApiResource {
    let gvk = GroupVersionKind::gvk("discovery.k8s.io", version, "EndpointSlice");
    ApiResource::from_gvk_with_plural(&gvk, "endpointslices")
}

/// The node objects through `client`.
pub fn node_objects_with(client: kube::Client) -> Api<DynamicObject> {
    node_objects_in(client, NAMESPACE)
}

/// The `LoadBalancerNode` objects of `namespace`.
pub fn node_objects_in(client: kube::Client, namespace: &str) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("lb.harvester-node-agent.io", "v1alpha1", "LoadBalancerNode"),
        "loadbalancernodes",
    );
    Api::namespaced_with(client, namespace, &ar)
}

/// A client from kubeconfig `path`, built on the current runtime.
pub async fn client_from(path: &std::path::Path) -> Result<kube::Client> {
    let kc = kube::config::Kubeconfig::read_from(path)?;
    let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?;
    Ok(kube::Client::try_from(cfg)?)
}
