//! The controller's OCI image (`packaging/oci/build.sh`, buildah, no Docker
//! daemon), built from the binary under test, unpacked into an OCI runtime
//! bundle with umoci and run with runc: its metadata is what the Deployment
//! expects, `--help` runs from the image's own root file system (so the
//! shared libraries it carries are enough), and the controller from the
//! image, with the manifests' ServiceAccount credentials, becomes leader on
//! the rig's API server (host networking: the bundle gets no network
//! namespace, so 127.0.0.1 is the rig's API server).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use hna_testkit::rig::{self, Rig, RigOptions};
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use serde_json::Value;

use crate::BIN;
use crate::harness::tests;

tests! {
    image_carries_the_controller_and_runs_with_runc: Root, Buildah, Runc;
    controller_from_the_image_becomes_leader: Root, Iproute2, ApiServer, Buildah, Runc;
}

/// The Lease the controller replicas elect their leader with.
const LEASE: &str = "harvester-node-agent-controller";
/// The user the image runs as (and the Deployment's runAsUser).
const IMAGE_UID: u32 = 65532;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// An image built from [`BIN`] and unpacked into `dir/bundle`.
struct Bundle {
    dir: tempfile::TempDir,
    tag: String,
    image_config: Value,
}

impl Bundle {
    fn path(&self) -> PathBuf {
        self.dir.path().join("bundle")
    }

    fn rootfs(&self) -> PathBuf {
        self.path().join("rootfs")
    }

    fn build() -> Result<Bundle> {
        let dir = tempfile::Builder::new().prefix("hna-oci-").tempdir()?;
        let archive = dir.path().join("harvester-node-agent.tar");
        // Unique per build: buildah's storage is shared with anything else
        // on the machine. The builds of this process take turns: two
        // images built from the same binary can share their layers, and
        // build.sh's closing `buildah rmi` of one must not pull them from
        // under the other's push.
        static BUILDS: Mutex<usize> = Mutex::new(0);
        let mut builds = BUILDS.lock().unwrap_or_else(|e| e.into_inner());
        *builds += 1;
        let tag = format!(
            "localhost/hna-test-{}-{}:{}",
            std::process::id(),
            *builds,
            env!("CARGO_PKG_VERSION")
        );
        let started = Instant::now();
        let out = Command::new(repo().join("packaging/oci/build.sh"))
            .arg(BIN)
            .arg(&archive)
            .env("HNA_OCI_IMAGE", &tag)
            .output()
            .context("run packaging/oci/build.sh")?;
        ensure!(
            out.status.success(),
            "build.sh failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        drop(builds);
        eprintln!(
            "oci: built in {:?}: {}",
            started.elapsed(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        let size = std::fs::metadata(&archive)
            .with_context(|| format!("build.sh wrote no {}", archive.display()))?
            .len();
        eprintln!("oci: archive {} bytes", size);

        // An oci-archive is a tar of an OCI image layout.
        let layout = dir.path().join("layout");
        std::fs::create_dir(&layout)?;
        run(Command::new("tar")
            .arg("-xf")
            .arg(&archive)
            .arg("-C")
            .arg(&layout))?;
        let index: Value = read_json(&layout.join("index.json"))?;
        let refs: Vec<&str> = index["manifests"]
            .as_array()
            .context("index.json without manifests")?
            .iter()
            .filter_map(|m| m["annotations"]["org.opencontainers.image.ref.name"].as_str())
            .collect();
        ensure!(refs == [tag.as_str()], "archive holds {refs:?}, not {tag}");
        let image_config = image_config(&layout, &index)?;

        let bundle = dir.path().join("bundle");
        run(Command::new("umoci")
            .args(["unpack", "--image"])
            .arg(format!("{}:{tag}", layout.display()))
            .arg(&bundle))?;
        Ok(Bundle {
            dir,
            tag,
            image_config,
        })
    }

    /// Rewrites the bundle's runtime spec: `args`, no terminal, and no
    /// network namespace (the host's loopback).
    fn set_process(&self, args: &[String]) -> Result<()> {
        let path = self.path().join("config.json");
        let mut spec = read_json(&path)?;
        spec["process"]["args"] = args.iter().map(|a| Value::from(a.as_str())).collect();
        spec["process"]["terminal"] = Value::Bool(false);
        let namespaces = spec["linux"]["namespaces"]
            .as_array_mut()
            .context("spec without linux.namespaces")?;
        namespaces.retain(|n| n["type"] != "network");
        std::fs::write(&path, serde_json::to_vec_pretty(&spec)?)?;
        Ok(())
    }
}

/// The image's configuration blob (OCI image config), via its manifest.
fn image_config(layout: &Path, index: &Value) -> Result<Value> {
    let blob = |digest: &str| -> Result<Value> {
        let (alg, hex) = digest.split_once(':').context("digest without algorithm")?;
        read_json(&layout.join("blobs").join(alg).join(hex))
    };
    let manifest = blob(
        index["manifests"][0]["digest"]
            .as_str()
            .context("manifest digest")?,
    )?;
    blob(
        manifest["config"]["digest"]
            .as_str()
            .context("config digest")?,
    )
}

fn read_json(path: &Path) -> Result<Value> {
    let bytes = std::fs::read(path).with_context(|| format!("read {}", path.display()))?;
    serde_json::from_slice(&bytes).with_context(|| format!("parse {}", path.display()))
}

fn run(cmd: &mut Command) -> Result<std::process::Output> {
    let out = cmd.output().with_context(|| format!("run {cmd:?}"))?;
    ensure!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(out)
}

/// A container name unique to this process and purpose.
fn container_id(what: &str) -> String {
    format!("hna-test-{what}-{}", std::process::id())
}

/// A `runc run` in the foreground, killed and deleted on drop.
struct Container {
    id: String,
    child: Child,
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = Command::new("runc")
            .args(["kill", &self.id, "KILL"])
            .output();
        let _ = self.child.wait();
        let _ = Command::new("runc")
            .args(["delete", "--force", &self.id])
            .output();
    }
}

fn image_carries_the_controller_and_runs_with_runc() -> Result<()> {
    let bundle = Bundle::build()?;
    // What the Deployment relies on: the binary as entrypoint, the
    // controller as default command (its `args` replace it), a non-root
    // user, and the version label.
    let config = &bundle.image_config["config"];
    ensure!(
        config["Entrypoint"] == serde_json::json!(["/usr/bin/harvester-node-agent"]),
        "Entrypoint {}",
        config["Entrypoint"]
    );
    ensure!(
        config["Cmd"] == serde_json::json!(["controller"]),
        "Cmd {}",
        config["Cmd"]
    );
    ensure!(
        config["User"] == format!("{IMAGE_UID}:{IMAGE_UID}"),
        "User {}",
        config["User"]
    );
    ensure!(
        config["Labels"]["org.opencontainers.image.version"] == env!("CARGO_PKG_VERSION"),
        "version label {}",
        config["Labels"]["org.opencontainers.image.version"]
    );
    // Only the binary, its libraries and the small /etc: no shell.
    ensure!(
        bundle
            .rootfs()
            .join("usr/bin/harvester-node-agent")
            .is_file(),
        "no binary in the image"
    );
    ensure!(
        !bundle.rootfs().join("bin/sh").exists() && !bundle.rootfs().join("usr/bin/sh").exists(),
        "the image has a shell"
    );

    bundle.set_process(&["/usr/bin/harvester-node-agent".into(), "--help".into()])?;
    let id = container_id("help");
    let out = Command::new("runc")
        .args(["run", "--bundle"])
        .arg(bundle.path())
        .arg(&id)
        .output()
        .context("runc run")?;
    let _ = Command::new("runc")
        .args(["delete", "--force", &id])
        .output();
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "`harvester-node-agent --help` in the image failed ({}): {stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    // The real binary's help, compared with the binary under test.
    let host = Command::new(BIN).arg("--help").output()?;
    ensure!(
        out.stdout == host.stdout,
        "help from the image differs from the binary's own:\n{stdout}"
    );
    ensure!(bundle.tag.contains("hna-test-"), "tag {}", bundle.tag);
    Ok(())
}

fn controller_from_the_image_becomes_leader() -> Result<()> {
    let bundle = Bundle::build()?;
    let rig = Rig::start(RigOptions {
        guests: 1,
        dhcp: false,
        apiserver: true,
        ..Default::default()
    })?;
    let api = rig.apiserver().context("rig without API server")?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let admin = rt.block_on(rig::kube_client(api.admin_kubeconfig()))?;
    // The manifests in place, so the controller runs with exactly the
    // rights its ServiceAccount gets from them.
    rt.block_on(rig::manifests::apply_kustomization(
        &admin,
        &repo().join("packaging/kubernetes"),
        rig::manifests::Mode::Apply,
    ))
    .context("apply packaging/kubernetes")?;

    // The ServiceAccount's kubeconfig, inside the image's root, readable by
    // the image's user (as a projected token would be).
    let etc = bundle.rootfs().join("etc/harvester-node-agent");
    std::fs::create_dir_all(&etc)?;
    let kubeconfig = etc.join("kubeconfig");
    std::fs::copy(api.controller_kubeconfig(), &kubeconfig)?;
    std::os::unix::fs::chown(&kubeconfig, Some(IMAGE_UID), Some(IMAGE_UID))?;
    std::fs::set_permissions(&kubeconfig, std::fs::Permissions::from_mode(0o600))?;

    let identity = format!("oci-image-{}", std::process::id());
    let metrics = format!("127.0.0.1:{}", rig::apiserver::free_port()?);
    let args: Vec<String> = [
        "/usr/bin/harvester-node-agent",
        "controller",
        "--kubeconfig",
        "/etc/harvester-node-agent/kubeconfig",
        "--namespace",
        hna_contract::DEFAULT_NAMESPACE,
        "--identity",
        &identity,
        "--metrics-listen",
        &metrics,
        "--credentials-retry",
        "1s",
    ]
    .map(String::from)
    .to_vec();
    bundle.set_process(&args)?;
    let log_path = rig.dir().join("oci-controller.log");
    let log = std::fs::File::create(&log_path)?;
    let id = container_id("controller");
    let child = Command::new("runc")
        .args(["run", "--bundle"])
        .arg(bundle.path())
        .arg(&id)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("runc run")?;
    let mut container = Container { id, child };

    let leases: Api<Lease> = Api::namespaced(admin, hna_contract::DEFAULT_NAMESPACE);
    let deadline = Instant::now() + Duration::from_secs(60);
    let started = Instant::now();
    let outcome = loop {
        if let Some(status) = container.child.try_wait()? {
            break Err(anyhow::anyhow!("the container exited ({status})"));
        }
        let holder = rt
            .block_on(leases.get_opt(LEASE))
            .ok()
            .flatten()
            .and_then(|l| l.spec)
            .and_then(|s| s.holder_identity);
        if holder.as_deref() == Some(identity.as_str()) {
            break Ok(());
        }
        if Instant::now() > deadline {
            break Err(anyhow::anyhow!(
                "Lease {LEASE} holder is {holder:?}, not {identity}, after 60 s"
            ));
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    if let Err(e) = outcome {
        drop(container);
        bail!(
            "{e:#}\ncontroller log:\n{}",
            std::fs::read_to_string(&log_path).unwrap_or_default()
        );
    }
    eprintln!("oci: leader after {:?}", started.elapsed());
    // Still running, and reachable on the host's loopback (no network
    // namespace): its /healthz answers.
    ensure!(
        container.child.try_wait()?.is_none(),
        "the controller exited after winning the election"
    );
    let health = http_get(&metrics, "/healthz")?;
    ensure!(
        health.starts_with("HTTP/1.1 200"),
        "/healthz of the controller in the image: {health}"
    );
    drop(container);
    Ok(())
}

fn http_get(addr: &str, path: &str) -> Result<String> {
    use std::io::{Read, Write};
    let mut c = std::net::TcpStream::connect(addr).with_context(|| format!("connect {addr}"))?;
    c.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        c,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )?;
    let mut out = String::new();
    c.read_to_string(&mut out)?;
    Ok(out)
}
