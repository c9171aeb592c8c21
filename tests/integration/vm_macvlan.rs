//! The macvlan preflight on a real kernel: Debian's `linux-image-*-amd64`
//! (macvlan is a loadable module there) booted under qemu, with the agent
//! binary, busybox, kmod and socat in the initramfs.
//!
//! One boot walks the states a node can be in — on disk and not loaded,
//! blacklisted, removed (the `kernel-default-base` case) — through `check`,
//! `check --fix` and the daemon (with a real `NOTIFY_SOCKET` receiver). A
//! second boot gives the VM a user-mode NIC whose only destination is the
//! rig's API server on host loopback, and shows `MacvlanReady` change on the
//! Node as the module state changes.

use std::io::Write;
use std::net::TcpListener;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use hna_testkit::rig::{self, Rig, RigOptions};
use hna_testkit::vm;

use crate::BIN;
use crate::harness::tests;

tests! {
    preflight_states_on_a_real_kernel: Root, Qemu, VmKernel, Socat, QemuGuestAgent;
    macvlan_ready_condition_follows_the_module_on_a_real_kernel:
        Root, Qemu, VmKernel, Socat, Iproute2, ApiServer;
    probe_needs_neither_veth_nor_dummy_on_a_real_kernel: Root, Qemu, VmKernel;
}

fn image(kernel: &vm::Kernel, dir: &Path, extra_modules: &[&str]) -> vm::Initramfs {
    let mut img = vm::Initramfs::new(kernel).unwrap();
    img.add_binary(
        &vm::stripped_binary(Path::new(BIN), dir).unwrap(),
        "/usr/bin/harvester-node-agent",
    )
    .unwrap();
    img.add_binary(Path::new("/usr/bin/socat"), "/usr/bin/socat")
        .unwrap();
    let mut modules = vec!["macvlan", "veth"];
    modules.extend_from_slice(extra_modules);
    img.add_modules(&modules).unwrap();
    img.add_file("/etc/harvester-node-agent/config.toml", b"", 0o644)
        .unwrap();
    img
}

fn rc(run: &vm::VmRun, key: &str) -> String {
    run.marker(&format!("{key}.rc"))
        .unwrap_or_else(|| panic!("no {key}.rc; console tail:\n{}", run.tail(60)))
}

/// Shell helpers shared by both boots.
const PRELUDE: &str = r#"
A=/usr/bin/harvester-node-agent
export HNA_LOG_TARGET=stderr HNA_KUBECONFIG_SEARCH=
ARGS="--state-dir /var/lib/hna --socket /run/hna/agent.sock"
REL=$(uname -r)
MOD=/lib/modules/$REL/kernel/drivers/net/macvlan.ko
loaded() { grep -c '^macvlan ' /proc/modules; }
# Waits until `status --output json` contains $1 (up to 60 s).
wait_status() {
  i=0
  while [ $i -lt 600 ]; do
    if $A status --output json --socket /run/hna/agent.sock 2>/dev/null | grep -q "$1"; then return 0; fi
    sleep 0.1; i=$((i+1))
  done
  return 1
}
"#;

fn preflight_states_on_a_real_kernel() {
    let kernel = vm::kernel().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut img = image(&kernel, dir.path(), &["virtio_pci", "virtio_net"]);
    let sles = "NAME=\"SLES\"\nVERSION=\"15-SP5\"\nID=\"sles\"\nID_LIKE=\"suse\"\nPRETTY_NAME=\"SUSE Linux Enterprise Server 15 SP5\"\n";
    img.add_file("/etc/os-release.sles", sles.as_bytes(), 0o644)
        .unwrap();
    // qemu-ga kept aside: first "not installed", then installed in a VM
    // that has no guest-agent channel.
    img.add_binary(Path::new("/usr/sbin/qemu-ga"), "/opt/qemu-ga")
        .unwrap();
    img.set_init(&format!(
        "{PRELUDE}{}",
        r#"
hna release "$REL"
hna loaded.start "$(loaded)"
# The NIC: the probe's parent, as on a node.
modprobe virtio_pci && modprobe virtio_net
hna nic $?

# qemu-guest-agent: not installed, then installed without a channel.
hna_run ga_missing $A check qemu-guest-agent --output json $ARGS
cp /opt/qemu-ga /usr/sbin/qemu-ga
hna_run ga_noport $A check qemu-guest-agent --output json $ARGS

# 1. On disk, not loaded: check reports and changes nothing.
hna_run notloaded $A check macvlan --output json $ARGS
hna loaded.after_check "$(loaded)"

# 2. check --fix loads it (system modprobe) and proves it.
hna_run fix $A check macvlan --fix --output json $ARGS
hna loaded.after_fix "$(loaded)"
rmmod macvlan; hna loaded.after_rmmod "$(loaded)"

# 3. Blacklisted: neither check nor --fix loads it.
echo "blacklist macvlan" > /etc/modprobe.d/no-macvlan.conf
hna_run black $A check macvlan --output json $ARGS
hna_run blackfix $A check macvlan --fix --output json $ARGS
hna loaded.blacklisted "$(loaded)"
rm /etc/modprobe.d/no-macvlan.conf

# 4. The kernel-default-base case: the module is not in the image.
mv $MOD /tmp/macvlan.ko && depmod
hna_run missing $A check macvlan --output json $ARGS
cp /etc/os-release /tmp/os-release.debian && cp /etc/os-release.sles /etc/os-release
hna_run missing_suse $A check macvlan --output json $ARGS
cp /tmp/os-release.debian /etc/os-release

# 5. The daemon without the module: stays up, says so in STATUS= and
#    status; installing the module and reloading fixes it, no restart.
socat -u UNIX-RECV:/run/notify.sock,unlink-early OPEN:/tmp/notify.log,creat,append &
SOCAT=$!
# The receiver is up once its socket exists (10 s at most).
i=0; while [ ! -S /run/notify.sock ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
NOTIFY_SOCKET=/run/notify.sock $A run $ARGS --node-name vm-1 --macvlan-recheck 1h 2>/tmp/daemon.log &
PID=$!
wait_status '"reason": "ModuleNotFound"'; hna d.missing.waited $?
hna_run d_missing $A status --output json --socket /run/hna/agent.sock
hna d.alive "$(kill -0 $PID 2>/dev/null && echo yes || echo no)"
mv /tmp/macvlan.ko $MOD && depmod
kill -HUP $PID
wait_status '"reason": "LoadedByAgent"'; hna d.fixed.waited $?
hna_run d_fixed $A status --output json --socket /run/hna/agent.sock
hna loaded.after_reload "$(loaded)"
kill -TERM $PID; wait $PID; hna d.exit $?

# 6. The daemon loads it at start.
rmmod macvlan
NOTIFY_SOCKET=/run/notify.sock $A run $ARGS --node-name vm-1 2>>/tmp/daemon.log &
PID=$!
wait_status '"reason": "LoadedByAgent"'; hna d2.waited $?
hna loaded.after_start "$(loaded)"
ip link add v0 type veth peer name v1 && ip link add link v0 name mv0 type macvlan mode bridge
hna iplink.macvlan $?
kill -TERM $PID; wait $PID; hna d2.exit $?
# Stop the receiver once it has logged the second daemon's STOPPING=1.
i=0; while [ "$(grep -c '^STOPPING=1' /tmp/notify.log)" -lt 2 ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
kill $SOCAT
while read -r line; do hna notify "$line"; done < /tmp/notify.log
while read -r line; do hna daemon.log "$line"; done < /tmp/daemon.log
"#
    ));
    let started = Instant::now();
    let run = vm::boot(&kernel, &img.build().unwrap(), &isolated_nic()).unwrap();
    eprintln!("VM run took {:.1}s", started.elapsed().as_secs_f64());
    assert_eq!(run.marker("nic").as_deref(), Some("0"), "{}", run.tail(60));
    let release = run.marker("release").unwrap();
    assert_eq!(release, kernel.release);
    assert_eq!(run.marker("loaded.start").as_deref(), Some("0"));

    let c = run.check("ga_missing", "qemu-guest-agent");
    assert_eq!(
        (c["status"].as_str(), c["reason"].as_str()),
        (Some("fail"), Some("NotInstalled")),
        "{c}"
    );
    assert!(c["remediation"].as_str().unwrap().contains("#cloud-config"));
    let c = run.check("ga_noport", "qemu-guest-agent");
    assert_eq!(c["reason"], "NoVirtioPort", "{c}");

    // 1. NotLoaded, read-only.
    let c = run.check("notloaded", "macvlan");
    assert_eq!(
        (c["status"].as_str(), c["reason"].as_str()),
        (Some("warn"), Some("NotLoaded")),
        "{c}"
    );
    assert!(c["message"].as_str().unwrap().contains("macvlan.ko"));
    assert_eq!(rc(&run, "notloaded"), "0");
    assert_eq!(
        run.marker("loaded.after_check").as_deref(),
        Some("0"),
        "plain check loaded the module"
    );

    // 2. --fix.
    let c = run.check("fix", "macvlan");
    assert_eq!(
        (c["status"].as_str(), c["reason"].as_str()),
        (Some("ok"), Some("LoadedByAgent")),
        "{c}"
    );
    assert!(
        c["message"]
            .as_str()
            .unwrap()
            .contains("test macvlan link was created")
    );
    assert_eq!(rc(&run, "fix"), "0");
    assert_eq!(run.marker("loaded.after_fix").as_deref(), Some("1"));
    assert_eq!(run.marker("loaded.after_rmmod").as_deref(), Some("0"));

    // 3. Blacklisted.
    for key in ["black", "blackfix"] {
        let c = run.check(key, "macvlan");
        assert_eq!(
            (c["status"].as_str(), c["reason"].as_str()),
            (Some("fail"), Some("Blacklisted")),
            "{c}"
        );
        assert!(
            c["message"]
                .as_str()
                .unwrap()
                .contains("/etc/modprobe.d/no-macvlan.conf")
        );
        assert_eq!(rc(&run, key), "1");
    }
    assert_eq!(run.marker("loaded.blacklisted").as_deref(), Some("0"));

    // 4. ModuleNotFound with the kernel, the package and the remedy.
    let c = run.check("missing", "macvlan");
    assert_eq!(
        (c["status"].as_str(), c["reason"].as_str()),
        (Some("fail"), Some("ModuleNotFound")),
        "{c}"
    );
    let msg = c["message"].as_str().unwrap();
    assert!(
        msg.contains(&release) && msg.contains(&format!("linux-image-{release}")),
        "{msg}"
    );
    assert_eq!(rc(&run, "missing"), "1");
    let c = run.check("missing_suse", "macvlan");
    assert!(
        c["message"]
            .as_str()
            .unwrap()
            .contains("kernel-default-base"),
        "{c}"
    );
    let fix = c["remediation"].as_str().unwrap();
    assert!(
        fix.contains("zypper --non-interactive in kernel-default") && fix.contains("kiwi"),
        "{fix}"
    );

    // 5. Daemon: up without the module, fixed by reload.
    assert_eq!(
        run.marker("d.missing.waited").as_deref(),
        Some("0"),
        "{}",
        run.tail(80)
    );
    let st = run.json("d_missing");
    assert_eq!(st["macvlan"]["reason"], "ModuleNotFound");
    assert!(
        st["summary"]
            .as_str()
            .unwrap()
            .contains("macvlan ModuleNotFound")
    );
    assert_eq!(run.marker("d.alive").as_deref(), Some("yes"));
    assert_eq!(
        run.marker("d.fixed.waited").as_deref(),
        Some("0"),
        "{}",
        run.tail(80)
    );
    let st = run.json("d_fixed");
    assert_eq!(
        (
            st["macvlan"]["reason"].as_str(),
            st["macvlan"]["ready"].as_bool()
        ),
        (Some("LoadedByAgent"), Some(true))
    );
    assert_eq!(run.marker("loaded.after_reload").as_deref(), Some("1"));
    assert_eq!(run.marker("d.exit").as_deref(), Some("0"));
    let notify = run.markers("notify");
    assert!(
        notify
            .iter()
            .any(|l| l.starts_with("STATUS=") && l.contains("macvlan ModuleNotFound")),
        "STATUS= never showed ModuleNotFound: {notify:?}"
    );
    assert!(
        notify
            .iter()
            .any(|l| l.starts_with("STATUS=") && l.contains("macvlan LoadedByAgent")),
        "STATUS= never showed LoadedByAgent: {notify:?}"
    );

    // 6. Daemon loads at start; macvlan links work afterwards.
    assert_eq!(
        run.marker("d2.waited").as_deref(),
        Some("0"),
        "{}",
        run.tail(80)
    );
    assert_eq!(run.marker("loaded.after_start").as_deref(), Some("1"));
    assert_eq!(run.marker("iplink.macvlan").as_deref(), Some("0"));
    assert_eq!(run.marker("d2.exit").as_deref(), Some("0"));
}

/// Accepts the guest's next handshake connection on `listener` and, once
/// `observed` holds (60 s at most), answers `observed` (else `not-observed`)
/// and hangs up. Returns early when `done` is set (the VM has ended).
fn answer_when_seen(listener: &TcpListener, done: &AtomicBool, observed: impl Fn() -> bool) {
    let mut conn = loop {
        match listener.accept() {
            Ok((conn, _)) => break conn,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if done.load(Ordering::Relaxed) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("handshake listener: {e}"),
        }
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let answer = loop {
        if observed() {
            break "observed";
        }
        if Instant::now() > deadline || done.load(Ordering::Relaxed) {
            break "not-observed";
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = writeln!(conn, "{answer}");
}

fn admin_client_call<T: Send>(
    api: &rig::ApiServer,
    f: impl FnOnce(kube::Client) -> std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>
    + Send,
) -> T {
    let kubeconfig = api.admin_kubeconfig().to_path_buf();
    rig::apiserver::on_runtime(|| async move {
        let client = rig::kube_client(&kubeconfig).await.unwrap();
        f(client).await
    })
}

fn macvlan_condition(api: &rig::ApiServer, node: &str) -> Option<(String, String)> {
    let node = node.to_string();
    admin_client_call(api, move |client| {
        Box::pin(async move {
            use k8s_openapi::api::core::v1::Node;
            let n = kube::Api::<Node>::all(client).get(&node).await.ok()?;
            let c = n
                .status?
                .conditions?
                .into_iter()
                .find(|c| c.type_ == "MacvlanReady")?;
            Some((c.status, c.reason.unwrap_or_default()))
        })
    })
}

fn macvlan_ready_condition_follows_the_module_on_a_real_kernel() {
    let kernel = vm::kernel().unwrap();
    let node = "hna-vm";
    let rig = Rig::start(RigOptions {
        guests: 1,
        dhcp: false,
        apiserver: true,
        node_names: vec![node.into()],
        ..Default::default()
    })
    .unwrap();
    let api = rig.apiserver().unwrap();
    admin_client_call(api, move |client| {
        Box::pin(async move {
            use k8s_openapi::api::core::v1::Node;
            let n: Node = serde_json::from_value(serde_json::json!({
                "apiVersion": "v1", "kind": "Node", "metadata": {"name": node}
            }))
            .unwrap();
            kube::Api::<Node>::all(client)
                .create(&Default::default(), &n)
                .await
                .unwrap();
        })
    });

    // The VM reaches the API server as https://localhost:<port>: its
    // /etc/hosts points localhost at the user-mode network's forward, which
    // qemu connects to host loopback (the serving certificate names
    // localhost). restrict=on: nothing else leaves the VM.
    let port = api.port();
    let kubeconfig = std::fs::read_to_string(api.node_kubeconfig(node))
        .unwrap()
        .replace(
            &format!("https://127.0.0.1:{port}"),
            &format!("https://localhost:{port}"),
        );
    assert!(kubeconfig.contains("https://localhost:"));
    let dir = tempfile::tempdir().unwrap();
    let mut img = image(&kernel, dir.path(), &["virtio_pci", "virtio_net"]);
    img.add_file("/etc/kubernetes/kubelet.conf", kubeconfig.as_bytes(), 0o600)
        .unwrap();
    img.add_file(
        "/etc/hosts",
        b"10.0.2.100 localhost\n127.0.0.1 hna-vm\n",
        0o644,
    )
    .unwrap();
    img.set_init(&format!(
        "{PRELUDE}{}",
        r#"
modprobe virtio_pci; modprobe virtio_net
ip link set eth0 up && ip addr add 10.0.2.15/24 dev eth0
hna net $?
echo "blacklist macvlan" > /etc/modprobe.d/no-macvlan.conf
$A run $ARGS --node-name hna-vm --kubeconfig /etc/kubernetes/kubelet.conf --credentials-retry 1s 2>/tmp/daemon.log &
PID=$!
wait_status '"reason": "Blacklisted"' && wait_status '"state": "Reported"'
hna phase.blacklisted $?
# Handshake: the host answers on 10.0.2.101:80 once it has seen the False
# condition on the Node, so the state cannot change before it is observed.
hna seen.blacklisted "$(timeout 90 socat -u TCP:10.0.2.101:80 STDOUT)"
rm /etc/modprobe.d/no-macvlan.conf
kill -HUP $PID
wait_status '"reason": "LoadedByAgent"'
hna phase.loaded $?
hna seen.loaded "$(timeout 90 socat -u TCP:10.0.2.101:80 STDOUT)"
hna_run final $A status --output json --socket /run/hna/agent.sock
kill -TERM $PID; wait $PID; hna d.exit $?
while read -r line; do hna daemon.log "$line"; done < /tmp/daemon.log
"#
    ));
    let initramfs = img.build().unwrap();
    // The host end of the handshake: the guest connects to 10.0.2.101:80
    // and waits for a line.
    let handshake = TcpListener::bind("127.0.0.1:0").unwrap();
    handshake.set_nonblocking(true).unwrap();
    let handshake_port = handshake.local_addr().unwrap().port();
    let opts = vm::VmOptions {
        extra_args: vec![
            "-netdev".into(),
            format!(
                "user,id=n0,restrict=on,\
                 guestfwd=tcp:10.0.2.100:{port}-cmd:socat - TCP:127.0.0.1:{port},\
                 guestfwd=tcp:10.0.2.101:80-cmd:socat - TCP:127.0.0.1:{handshake_port}"
            ),
            "-device".into(),
            "virtio-net-pci,netdev=n0".into(),
        ],
        ..vm::VmOptions::default()
    };

    let seen = std::sync::Mutex::new(Vec::<(String, String)>::new());
    let done = AtomicBool::new(false);
    let run = std::thread::scope(|s| {
        s.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                if let Some(c) = macvlan_condition(api, node) {
                    let mut seen = seen.lock().unwrap();
                    if seen.last() != Some(&c) {
                        seen.push(c);
                    }
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        s.spawn(|| {
            for want in [("False", "Blacklisted"), ("True", "LoadedByAgent")] {
                answer_when_seen(&handshake, &done, || {
                    seen.lock()
                        .unwrap()
                        .iter()
                        .any(|(st, r)| (st.as_str(), r.as_str()) == want)
                });
            }
        });
        let run = vm::boot(&kernel, &initramfs, &opts);
        done.store(true, Ordering::Relaxed);
        run
    })
    .unwrap();
    eprintln!("VM run took {:.1}s", run.duration.as_secs_f64());
    assert_eq!(run.marker("net").as_deref(), Some("0"), "{}", run.tail(60));
    assert_eq!(
        run.marker("phase.blacklisted").as_deref(),
        Some("0"),
        "{}",
        run.tail(80)
    );
    assert_eq!(
        run.marker("phase.loaded").as_deref(),
        Some("0"),
        "{}",
        run.tail(80)
    );
    for key in ["seen.blacklisted", "seen.loaded"] {
        assert_eq!(
            run.marker(key).as_deref(),
            Some("observed"),
            "{key}: {}",
            run.tail(80)
        );
    }
    assert_eq!(run.json("final")["node_conditions"]["state"], "Reported");
    assert_eq!(run.marker("d.exit").as_deref(), Some("0"));
    let seen = seen.into_inner().unwrap();
    let want = [
        ("False".to_string(), "Blacklisted".to_string()),
        ("True".to_string(), "LoadedByAgent".to_string()),
    ];
    assert_eq!(
        seen, want,
        "MacvlanReady on Node {node} went through {seen:?}"
    );
}

/// A virtio NIC (the macvlan probe's parent, like a node's uplink) whose
/// frames go nowhere: its hub has no other port.
fn isolated_nic() -> vm::VmOptions {
    vm::VmOptions {
        extra_args: vec![
            "-netdev".into(),
            "hubport,id=n0,hubid=0".into(),
            "-device".into(),
            "virtio-net-pci,netdev=n0".into(),
        ],
        ..vm::VmOptions::default()
    }
}

/// The capabilities the shipped unit bounds the daemon to, as a `setpriv
/// --bounding-set` argument (`-all,+net_admin,...`).
fn unit_bounding_set() -> String {
    let unit = include_str!("../../systemd/harvester-node-agent.service");
    let caps = unit
        .lines()
        .find_map(|l| l.strip_prefix("CapabilityBoundingSet="))
        .expect("the unit sets CapabilityBoundingSet=");
    let mut arg = String::from("-all");
    for cap in caps.split_whitespace() {
        let cap = cap
            .strip_prefix("CAP_")
            .expect("capability names start with CAP_");
        arg.push_str(",+");
        arg.push_str(&cap.to_ascii_lowercase());
    }
    arg
}

/// Issue #12: a kernel that has macvlan but neither veth nor dummy (the
/// image carries only macvlan and the virtio NIC's drivers, like a node
/// whose kernel package lacks them). The probe needs no module besides
/// macvlan: `check macvlan` reports ok, not ProbeFailed, also with no more
/// capabilities than the shipped unit grants, and leaves no link behind.
fn probe_needs_neither_veth_nor_dummy_on_a_real_kernel() {
    let kernel = vm::kernel().unwrap();
    // util-linux is essential on Debian: setpriv is always there.
    let setpriv = hna_testkit::find_program("setpriv")
        .expect("setpriv is missing; install it with `apt-get install util-linux`");
    let dir = tempfile::tempdir().unwrap();
    let mut img = vm::Initramfs::new(&kernel).unwrap();
    img.add_binary(
        &vm::stripped_binary(Path::new(BIN), dir.path()).unwrap(),
        "/usr/bin/harvester-node-agent",
    )
    .unwrap();
    img.add_binary(&setpriv, "/usr/bin/setpriv").unwrap();
    img.add_modules(&["macvlan", "virtio_pci", "virtio_net"])
        .unwrap();
    img.add_file("/etc/harvester-node-agent/config.toml", b"", 0o644)
        .unwrap();
    let bounding = unit_bounding_set();
    img.set_init(&format!(
        "{PRELUDE}UNIT_CAPS={bounding}\n{}",
        r#"
modprobe virtio_pci && modprobe virtio_net
hna nic $?
links() { ls /sys/class/net | tr '\n' ' '; }
hna links.before "$(links)"
# The premise: neither veth nor dummy can be had on this kernel.
hna_run veth_mod modprobe veth
hna_run dummy_mod modprobe dummy
hna_run veth_link ip link add hv0 type veth peer name hv1
hna_run dummy_link ip link add hd0 type dummy
hna loaded.veth_dummy "$(grep -cE '^(veth|dummy) ' /proc/modules)"

# On disk, not loaded: --fix loads and proves it, with the unit's
# capabilities only (no CAP_SYS_ADMIN), the uplink still down.
hna_run fix setpriv --bounding-set=$UNIT_CAPS --inh-caps=-all $A check macvlan --fix --output json $ARGS
hna loaded.after_fix "$(loaded)"
hna caps "$(setpriv --bounding-set=$UNIT_CAPS --inh-caps=-all grep CapEff /proc/self/status)"
# Loaded, uplink up: plain check proves it again.
ip link set eth0 up
hna_run plain $A check macvlan --output json $ARGS
hna links.after "$(links)"
"#
    ));
    let run = vm::boot(&kernel, &img.build().unwrap(), &isolated_nic()).unwrap();
    eprintln!("VM run took {:.1}s", run.duration.as_secs_f64());
    assert_eq!(run.marker("nic").as_deref(), Some("0"), "{}", run.tail(60));

    // The premise holds: veth and dummy are not available.
    for key in ["veth_mod", "dummy_mod", "veth_link", "dummy_link"] {
        assert_ne!(rc(&run, key), "0", "{key} worked: {}", run.tail(60));
    }
    for key in ["veth_link", "dummy_link"] {
        let out = run.markers(&format!("{key}.out")).join(" ");
        assert!(out.contains("not supported"), "{key}: {out}");
    }
    assert_eq!(run.marker("loaded.veth_dummy").as_deref(), Some("0"));

    for key in ["fix", "plain"] {
        let c = run.check(key, "macvlan");
        assert_eq!(c["status"], "ok", "{key}: {c}");
        assert!(
            c["message"]
                .as_str()
                .unwrap()
                .contains("test macvlan link was created"),
            "{key}: {c}"
        );
        assert_eq!(rc(&run, key), "0");
    }
    assert_eq!(run.check("fix", "macvlan")["reason"], "LoadedByAgent");
    assert_eq!(run.check("plain", "macvlan")["reason"], "Loaded");
    assert_eq!(run.marker("loaded.after_fix").as_deref(), Some("1"));
    assert_eq!(
        run.marker("links.after"),
        run.marker("links.before"),
        "the probe left a link behind"
    );

    // CAP_SYS_ADMIN (bit 21) is not among the capabilities the fix ran with.
    let caps = run.marker("caps").unwrap();
    let eff = u64::from_str_radix(caps.split_whitespace().last().unwrap(), 16).unwrap();
    assert_eq!(eff & (1 << 21), 0, "CAP_SYS_ADMIN in {caps}");
    assert_ne!(eff & (1 << 12), 0, "no CAP_NET_ADMIN in {caps}");
}
