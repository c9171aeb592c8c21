//! A real etcd + kube-apiserver pair on the host's loopback, with a private
//! CA, static bearer tokens and kubeconfig files for an admin, one user per
//! node and the controller.

use std::fs;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};

use super::process::{ChildProc, random_hex, run, tail};

/// How long kube-apiserver may take to report `/readyz` ok.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// The user the controller's credentials authenticate as: the
/// ServiceAccount `harvester-node-agent-controller` in namespace
/// `harvester-node-agent`, as `packaging/kubernetes/rbac.yaml` creates it.
pub const CONTROLLER_USER: &str =
    "system:serviceaccount:harvester-node-agent:harvester-node-agent-controller";

/// The groups of [`CONTROLLER_USER`], as the API server gives them to any
/// token of that ServiceAccount.
pub const CONTROLLER_GROUPS: [&str; 2] = [
    "system:serviceaccounts",
    "system:serviceaccounts:harvester-node-agent",
];

/// Namespaces that exist once [`ApiServer::start`] returns.
pub const SYSTEM_NAMESPACES: [&str; 4] =
    ["default", "kube-system", "kube-public", "kube-node-lease"];

pub use crate::locate::{Binaries, is_executable, releases_dir};

/// Credentials of one user of the rig's API server.
struct Creds {
    name: String,
    token: String,
    kubeconfig: PathBuf,
}

/// A running kube-apiserver (the newest release `tests/rig/kubernetes.sh`
/// builds, unless `KUBEBUILDER_ASSETS` points elsewhere) backed by its own etcd, serving TLS
/// on `https://127.0.0.1:<port>` with `Node,RBAC` authorization and the
/// `NodeRestriction` admission plugin. Stopped by the owning [`super::Rig`].
pub struct ApiServer {
    url: String,
    port: u16,
    ca_pem: String,
    ca_path: PathBuf,
    admin: Creds,
    controller: Creds,
    nodes: Vec<Creds>,
    version: String,
    etcd_url: String,
    log: PathBuf,
    ready_after: Duration,
    kubectl: Option<PathBuf>,
    // Field order matters for drop: the API server stops before etcd.
    apiserver: ChildProc,
    etcd: ChildProc,
    /// How to start each again ([`ApiServer::restart`]): same ports, same
    /// etcd data.
    apiserver_cmd: (PathBuf, Vec<String>),
    etcd_cmd: (PathBuf, Vec<String>),
}

impl ApiServer {
    /// `https://127.0.0.1:<port>`
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The secure port on 127.0.0.1 (host and every guest namespace).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// PEM of the CA that signed the serving certificate.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// Path of the CA certificate file (PEM), e.g. for `curl --cacert`.
    pub fn ca_path(&self) -> &Path {
        &self.ca_path
    }

    /// Writes to `out` a kubeconfig for ServiceAccount `namespace/name`
    /// with its own token (a TokenRequest through `admin`, valid a day),
    /// its context's namespace `namespace`: how a Pod's projected token
    /// authenticates.
    pub async fn service_account_kubeconfig(
        &self,
        admin: &kube::Client,
        namespace: &str,
        name: &str,
        out: &Path,
    ) -> Result<()> {
        use k8s_openapi::api::authentication::v1::TokenRequest;
        use k8s_openapi::api::core::v1::ServiceAccount;
        let sas: kube::Api<ServiceAccount> = kube::Api::namespaced(admin.clone(), namespace);
        let request: TokenRequest = serde_json::from_value(serde_json::json!({
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {"audiences": [], "expirationSeconds": 24 * 3600},
        }))?;
        let token = sas
            .create_token_request(name, &Default::default(), &request)
            .await
            .with_context(|| format!("TokenRequest for {namespace}/{name}"))?
            .status
            .context("TokenRequest without status")?
            .token;
        let config = serde_json::json!({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "rig", "cluster": {"server": self.url(), "certificate-authority": self.ca_path()}}],
            "users": [{"name": name, "user": {"token": token}}],
            "contexts": [{"name": name, "context": {"cluster": "rig", "user": name, "namespace": namespace}}],
            "current-context": name,
        });
        fs::write(out, serde_json::to_vec_pretty(&config)?)
            .with_context(|| format!("write {}", out.display()))
    }

    /// The serving certificate and its key (PEM, next to [`Self::ca_path`]),
    /// for a stand-in that answers as the API server (the fault proxy).
    pub fn serving_cert(&self) -> (PathBuf, PathBuf) {
        let pki = self.ca_path.parent().unwrap_or(Path::new("."));
        (pki.join("apiserver.crt"), pki.join("apiserver.key"))
    }

    /// Writes a kubeconfig like [`Self::node_kubeconfig`] (node `Some`) or
    /// [`Self::controller_kubeconfig`] (`None`), with the same credentials,
    /// but pointing at `url` (a proxy in front of this server); `tag` keeps
    /// the file apart from the direct one.
    pub fn kubeconfig_via(&self, node: Option<&str>, url: &str, tag: &str) -> Result<PathBuf> {
        let (creds, file) = match node {
            Some(n) => (self.node(n), format!("node-{n}-{tag}")),
            None => (&self.controller, format!("controller-{tag}")),
        };
        let dir = self.log.parent().context("the rig directory")?;
        write_kubeconfig(dir, &file, url, &self.ca_pem, creds)
    }

    /// [`Self::admin_kubeconfig`] pointing at `url`; `tag` keeps the file
    /// apart.
    pub fn admin_kubeconfig_via(&self, url: &str, tag: &str) -> Result<PathBuf> {
        let dir = self.log.parent().context("the rig directory")?;
        write_kubeconfig(dir, &format!("admin-{tag}"), url, &self.ca_pem, &self.admin)
    }

    /// Kubeconfig of user `hna-rig-admin`, group `system:masters`.
    pub fn admin_kubeconfig(&self) -> &Path {
        &self.admin.kubeconfig
    }

    /// Bearer token of the admin user.
    pub fn admin_token(&self) -> &str {
        &self.admin.token
    }

    /// Kubeconfig of user `system:node:<node>` in group `system:nodes`, so
    /// the Node authorizer and NodeRestriction apply to it.
    ///
    /// Panics if `node` is not one of the rig's node names.
    pub fn node_kubeconfig(&self, node: &str) -> &Path {
        &self.node(node).kubeconfig
    }

    /// Bearer token of `system:node:<node>`. Panics for unknown nodes.
    pub fn node_token(&self, node: &str) -> &str {
        &self.node(node).token
    }

    /// Kubeconfig of the controller: user [`CONTROLLER_USER`], the
    /// ServiceAccount of `packaging/kubernetes/`, with its groups
    /// [`CONTROLLER_GROUPS`] (plus the implicit `system:authenticated`).
    /// It may do nothing until RBAC grants it something: apply the
    /// manifests ([`super::manifests`]) or bind a role in the test.
    pub fn controller_kubeconfig(&self) -> &Path {
        &self.controller.kubeconfig
    }

    /// Bearer token of the controller ([`CONTROLLER_USER`]).
    pub fn controller_token(&self) -> &str {
        &self.controller.token
    }

    /// `gitVersion` reported by `/version`.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// Runs the real `kubectl` of the rig's release as the admin
    /// (`--kubeconfig` set) and returns what it did; an error only when it
    /// could not be run at all. Needs [`crate::prereq::Prereq::Kubectl`].
    pub fn kubectl<I, S>(&self, args: I) -> Result<std::process::Output>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<std::ffi::OsStr>,
    {
        let kubectl = self
            .kubectl
            .as_ref()
            .context("no kubectl next to kube-apiserver nor on PATH (sudo tests/rig/prereqs.sh)")?;
        Command::new(kubectl)
            .arg("--kubeconfig")
            .arg(&self.admin.kubeconfig)
            .args(args)
            .output()
            .with_context(|| format!("running {}", kubectl.display()))
    }

    /// `http://127.0.0.1:<port>` of the rig's etcd.
    pub fn etcd_url(&self) -> &str {
        &self.etcd_url
    }

    /// The kube-apiserver log file.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// How long it took from starting kube-apiserver until `/readyz` was ok.
    pub fn ready_after(&self) -> Duration {
        self.ready_after
    }

    /// Pids of kube-apiserver and etcd while they run.
    pub fn pids(&self) -> Vec<u32> {
        self.apiserver
            .pid()
            .into_iter()
            .chain(self.etcd.pid())
            .collect()
    }

    /// kube-apiserver and etcd frozen (SIGSTOP) until the guard is dropped
    /// (SIGCONT): their connections stay open and nothing answers, as a
    /// wedged control plane looks to its clients (a stopped one refuses
    /// connections instead).
    pub fn hang(&self) -> Result<Hung> {
        let pids = self.pids();
        ensure!(
            pids.len() == 2,
            "kube-apiserver and etcd are not both running"
        );
        for pid in &pids {
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(*pid as i32),
                nix::sys::signal::Signal::SIGSTOP,
            )
            .with_context(|| format!("SIGSTOP {pid}"))?;
        }
        Ok(Hung { pids })
    }

    /// Stops kube-apiserver, then etcd. Idempotent.
    pub fn stop(&mut self) {
        self.apiserver.stop();
        self.etcd.stop();
    }

    /// Starts etcd and kube-apiserver again after [`ApiServer::stop`], on
    /// the same ports with the same etcd data (every object kept, as after
    /// a control-plane restart), and waits until the API server is ready.
    pub fn restart(&mut self) -> Result<()> {
        self.stop();
        let spawn = |name: &str, (bin, args): &(PathBuf, Vec<String>), log: &Path| {
            let mut cmd = Command::new(bin);
            for (k, _) in std::env::vars_os() {
                if k.to_string_lossy().starts_with("ETCD") {
                    cmd.env_remove(k);
                }
            }
            cmd.args(args);
            ChildProc::spawn(name, cmd, log)
        };
        let etcd_port: u16 = self
            .etcd_url
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .context("etcd port")?;
        let etcd_log = self.log.with_file_name("etcd.log");
        self.etcd = spawn("etcd", &self.etcd_cmd, &etcd_log)?;
        let deadline = Instant::now() + Duration::from_secs(20);
        while !http_get(etcd_port, "/health").is_ok_and(|b| b.contains("\"health\":\"true\"")) {
            if let Some(status) = self.etcd.exited() {
                return Err(self.etcd.exit_error(status));
            }
            if Instant::now() > deadline {
                bail!(
                    "etcd not healthy 20 s after the restart:\n{}",
                    tail(&etcd_log, 40)
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let started = Instant::now();
        self.apiserver = spawn("kube-apiserver", &self.apiserver_cmd, &self.log)?;
        wait_ready(&self.admin.kubeconfig, &mut self.apiserver)?;
        self.ready_after = started.elapsed();
        Ok(())
    }

    fn node(&self, node: &str) -> &Creds {
        self.nodes
            .iter()
            .find(|c| c.name == node)
            .unwrap_or_else(|| panic!("rig: no node named {node:?}"))
    }

    /// Generates certificates and tokens in `dir`, starts etcd and
    /// kube-apiserver and waits until the API server is ready.
    pub fn start(
        dir: &Path,
        id: &str,
        bins: &Binaries,
        node_names: &[String],
    ) -> Result<ApiServer> {
        let pki = dir.join("pki");
        fs::create_dir_all(&pki)?;
        make_pki(&pki, id)?;
        let ca_path = pki.join("ca.crt");
        let ca_pem = fs::read_to_string(&ca_path)?;

        let creds = |name: &str| Creds {
            name: name.to_string(),
            token: random_hex(24),
            kubeconfig: PathBuf::new(),
        };
        let mut admin = creds("hna-rig-admin");
        let mut controller = creds(CONTROLLER_USER);
        let mut nodes: Vec<Creds> = node_names.iter().map(|n| creds(n)).collect();
        // A static token that authenticates exactly as the Pod's projected
        // service-account token would: same user name, same groups. So
        // packaging/kubernetes/rbac.yaml binds to it unchanged.
        let mut csv = format!(
            "{},{},{},\"system:masters\"\n{},{},{},\"{}\"\n",
            admin.token,
            admin.name,
            admin.name,
            controller.token,
            controller.name,
            controller.name,
            CONTROLLER_GROUPS.join(","),
        );
        for n in &nodes {
            let user = format!("system:node:{}", n.name);
            csv.push_str(&format!("{},{user},{user},\"system:nodes\"\n", n.token));
        }
        let tokens = pki.join("tokens.csv");
        fs::write(&tokens, csv)?;

        let (etcd, etcd_port, etcd_args) = start_etcd(dir, &bins.etcd)?;
        let etcd_url = format!("http://127.0.0.1:{etcd_port}");

        let log = dir.join("kube-apiserver.log");
        let mut last_err = None;
        for _attempt in 0..3 {
            let port = free_port()?;
            let url = format!("https://127.0.0.1:{port}");
            admin.kubeconfig = write_kubeconfig(dir, "admin", &url, &ca_pem, &admin)?;
            controller.kubeconfig =
                write_kubeconfig(dir, "controller", &url, &ca_pem, &controller)?;
            for n in &mut nodes {
                let file = format!("node-{}", n.name);
                n.kubeconfig = write_kubeconfig(dir, &file, &url, &ca_pem, n)?;
            }
            let args: Vec<String> = vec![
                format!("--etcd-servers={etcd_url}"),
                "--bind-address=127.0.0.1".into(),
                "--advertise-address=127.0.0.1".into(),
                format!("--secure-port={port}"),
                format!("--cert-dir={}", dir.join("apiserver-certs").display()),
                format!("--tls-cert-file={}", pki.join("apiserver.crt").display()),
                format!(
                    "--tls-private-key-file={}",
                    pki.join("apiserver.key").display()
                ),
                format!("--client-ca-file={}", ca_path.display()),
                format!("--token-auth-file={}", tokens.display()),
                "--authorization-mode=Node,RBAC".into(),
                "--enable-admission-plugins=NodeRestriction".into(),
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
                format!(
                    "--service-account-key-file={}",
                    pki.join("sa.pub").display()
                ),
                format!(
                    "--service-account-signing-key-file={}",
                    pki.join("sa.key").display()
                ),
                // Dual-stack, so that IPv6-only and dual-stack Services can
                // be created (and refused or served IPv4 by the controller).
                "--service-cluster-ip-range=10.96.0.0/16,fd00:10:96::/112".into(),
                "--allow-privileged=true".into(),
                // With --advertise-address=127.0.0.1 the default reconciler
                // fails every few seconds ("may not be in the loopback
                // range"); nothing in the rig needs the `kubernetes` Endpoints.
                "--endpoint-reconciler-type=none".into(),
                "--profiling=false".into(),
                "--v=1".into(),
            ];
            let mut cmd = Command::new(&bins.kube_apiserver);
            cmd.args(&args);
            let started = Instant::now();
            let mut proc = ChildProc::spawn("kube-apiserver", cmd, &log)?;
            match wait_ready(&admin.kubeconfig, &mut proc) {
                Ok(version) => {
                    return Ok(ApiServer {
                        url,
                        port,
                        ca_pem,
                        ca_path,
                        admin,
                        controller,
                        nodes,
                        version,
                        etcd_url,
                        log,
                        ready_after: started.elapsed(),
                        kubectl: bins.kubectl.clone(),
                        apiserver: proc,
                        etcd,
                        apiserver_cmd: (bins.kube_apiserver.clone(), args),
                        etcd_cmd: (bins.etcd.clone(), etcd_args),
                    });
                }
                Err(e) => {
                    proc.stop();
                    if !tail(&log, 20).contains("address already in use") {
                        return Err(e);
                    }
                    last_err = Some(e); // lost a race for the port: retry
                    let _ = fs::write(&log, "");
                }
            }
        }
        Err(last_err.expect("at least one attempt"))
    }
}

/// Waits for `/readyz` and the [`SYSTEM_NAMESPACES`] with the admin
/// kubeconfig and returns `gitVersion`.
fn wait_ready(admin_kubeconfig: &Path, proc: &mut ChildProc) -> Result<String> {
    on_runtime(|| async move {
        let client = super::kube_client(admin_kubeconfig).await?;
        let deadline = Instant::now() + READY_TIMEOUT;
        let mut last: String;
        loop {
            if let Some(status) = proc.exited() {
                return Err(proc.exit_error(status));
            }
            let req = kube::core::Request::new("/readyz")
                .list(&Default::default())
                .context("build /readyz request")?;
            match tokio::time::timeout(Duration::from_secs(5), client.request_text(req)).await {
                Ok(Ok(body)) if body.trim() == "ok" => break,
                Ok(Ok(body)) => last = body,
                Ok(Err(e)) => last = e.to_string(),
                Err(_) => last = "timed out".into(),
            }
            if Instant::now() > deadline {
                bail!(
                    "kube-apiserver not ready after {READY_TIMEOUT:?} (last /readyz: {last}); last lines of {}:\n{}",
                    proc.log().display(),
                    tail(proc.log(), 40)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // /readyz turns ok before the bootstrap controller has created the
        // system namespaces; tests (and node Leases) need them.
        let namespaces: kube::Api<k8s_openapi::api::core::v1::Namespace> =
            kube::Api::all(client.clone());
        for ns in SYSTEM_NAMESPACES {
            loop {
                match namespaces.get_opt(ns).await {
                    Ok(Some(_)) => break,
                    Ok(None) => last = "not found".into(),
                    Err(e) => last = e.to_string(),
                }
                if Instant::now() > deadline {
                    bail!(
                        "namespace {ns} not created within {READY_TIMEOUT:?} ({last}); last lines of {}:\n{}",
                        proc.log().display(),
                        tail(proc.log(), 40)
                    );
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        let info = client.apiserver_version().await.context("GET /version")?;
        Ok(info.git_version)
    })
}

/// Runs an async closure to completion on a fresh current-thread Tokio
/// runtime in a scoped helper thread, so it works whether or not the caller
/// is itself inside a runtime (e.g. a `#[tokio::test]`).
pub fn on_runtime<T, F, Fut>(f: F) -> T
where
    T: Send,
    F: FnOnce() -> Fut + Send,
    Fut: std::future::Future<Output = T>,
{
    std::thread::scope(|s| {
        s.spawn(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("build tokio runtime")
                .block_on(f())
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}

/// A currently free TCP port on 127.0.0.1.
pub fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn start_etcd(dir: &Path, etcd: &Path) -> Result<(ChildProc, u16, Vec<String>)> {
    let log = dir.join("etcd.log");
    let data = dir.join("etcd-data");
    let mut last_err = None;
    for _attempt in 0..3 {
        let _ = fs::remove_dir_all(&data);
        let (client, peer) = (free_port()?, free_port()?);
        let mut cmd = Command::new(etcd);
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("ETCD") {
                cmd.env_remove(k);
            }
        }
        let args: Vec<String> = vec![
            "--name=hna-rig".to_string(),
            format!("--data-dir={}", data.display()),
            format!("--listen-client-urls=http://127.0.0.1:{client}"),
            format!("--advertise-client-urls=http://127.0.0.1:{client}"),
            format!("--listen-peer-urls=http://127.0.0.1:{peer}"),
            format!("--initial-advertise-peer-urls=http://127.0.0.1:{peer}"),
            format!("--initial-cluster=hna-rig=http://127.0.0.1:{peer}"),
            "--initial-cluster-state=new".into(),
        ];
        cmd.args(&args);
        let mut proc = ChildProc::spawn("etcd", cmd, &log)?;
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = proc.exited() {
                let err = proc.exit_error(status);
                if tail(&log, 20).contains("address already in use") {
                    last_err = Some(err);
                    break; // lost a race for a port: retry
                }
                return Err(err);
            }
            if http_get(client, "/health").is_ok_and(|b| b.contains("\"health\":\"true\"")) {
                return Ok((proc, client, args));
            }
            if Instant::now() > deadline {
                bail!(
                    "etcd not healthy after 20 s; last lines of {}:\n{}",
                    log.display(),
                    tail(&log, 40)
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    Err(last_err.expect("at least one attempt"))
}

/// Plain HTTP/1.0 GET on 127.0.0.1:`port`; returns the whole response.
fn http_get(port: u16, path: &str) -> std::io::Result<String> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(500))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out)
}

const OPENSSL_CNF: &str = "\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = hna-rig
[v3_ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign,digitalSignature
subjectKeyIdentifier = hash
[v3_srv]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1,IP:10.77.0.1,DNS:localhost
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
";

/// CA (`ca.crt`/`ca.key`), serving certificate (`apiserver.crt`/`.key`,
/// SANs IP:127.0.0.1, the LAN's IP:10.77.0.1 (`rig::LAN_ADDR`, where the
/// guests reach it through their uplink) and DNS:localhost) and service-account key pair
/// (`sa.key`/`sa.pub`), all made with the `openssl` tool.
fn make_pki(pki: &Path, id: &str) -> Result<()> {
    let cnf = pki.join("openssl.cnf");
    fs::write(&cnf, OPENSSL_CNF)?;
    let openssl =
        |args: &[&str]| run(Command::new("openssl").current_dir(pki).args(args)).map(|_| ());
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let cn = format!("/CN=hna-rig-ca-{id}");
    let cnf_s = cnf.to_str().context("non-UTF-8 path")?;
    openssl(
        &[
            &["req", "-x509", "-new"][..],
            &ec,
            &[
                "-keyout",
                "ca.key",
                "-out",
                "ca.crt",
                "-days",
                "30",
                "-config",
                cnf_s,
                "-extensions",
                "v3_ca",
                "-subj",
                &cn,
            ],
        ]
        .concat(),
    )?;
    openssl(
        &[
            &["req", "-new"][..],
            &ec,
            &[
                "-keyout",
                "apiserver.key",
                "-out",
                "apiserver.csr",
                "-config",
                cnf_s,
                "-subj",
                "/CN=kube-apiserver",
            ],
        ]
        .concat(),
    )?;
    let serial = format!("0x{}", random_hex(8));
    openssl(&[
        "x509",
        "-req",
        "-in",
        "apiserver.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-set_serial",
        &serial,
        "-days",
        "30",
        "-out",
        "apiserver.crt",
        "-extfile",
        cnf_s,
        "-extensions",
        "v3_srv",
    ])?;
    openssl(&[
        "genpkey",
        "-algorithm",
        "RSA",
        "-pkeyopt",
        "rsa_keygen_bits:2048",
        "-out",
        "sa.key",
    ])?;
    openssl(&["pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub"])?;
    Ok(())
}

/// Writes `<dir>/<file>.kubeconfig` for `creds` (token user, CA embedded).
fn write_kubeconfig(
    dir: &Path,
    file: &str,
    url: &str,
    ca_pem: &str,
    creds: &Creds,
) -> Result<PathBuf> {
    let path = dir.join(format!("{file}.kubeconfig"));
    let yaml = format!(
        "apiVersion: v1
kind: Config
clusters:
- name: hna-rig
  cluster:
    server: {url}
    certificate-authority-data: {ca}
users:
- name: {user:?}
  user:
    token: {token}
contexts:
- name: hna-rig
  context:
    cluster: hna-rig
    user: {user:?}
current-context: hna-rig
",
        ca = base64(ca_pem.as_bytes()),
        user = creds.name,
        token = creds.token,
    );
    fs::write(&path, yaml).with_context(|| format!("write {}", path.display()))?;
    Ok(path)
}

/// Standard base64 with padding.
pub fn base64(data: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(A[(n >> (18 - 6 * i)) as usize & 63] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// A hung API server ([`ApiServer::hang`]); dropped, it runs again.
#[must_use = "the API server runs again when this is dropped"]
pub struct Hung {
    pids: Vec<u32>,
}

impl Drop for Hung {
    fn drop(&mut self) {
        for pid in &self.pids {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(*pid as i32),
                nix::sys::signal::Signal::SIGCONT,
            );
        }
    }
}
