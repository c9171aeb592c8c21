//! qemu-guest-agent health on a real kernel with a real `qemu-ga` (Debian's
//! qemu-guest-agent) and a virtio-serial channel named
//! `org.qemu.guest_agent.0` whose host end this test holds and releases
//! (when the guest says, on a second port `hna.ctl`, that it has seen the
//! agent ready).
//! The VM has no systemd, so the agent is judged by its process; the
//! unit-state mapping is unit-tested with a D-Bus double (crates/node/src/guest).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use hna_testkit::vm;

use crate::BIN;
use crate::harness::tests;

tests! {
    guest_agent_states_with_a_real_qemu_ga: Root, Qemu, VmKernel, QemuGuestAgent;
}

/// Waits (up to `deadline`) for qemu to create the socket at `path`.
fn wait_socket(path: &Path, deadline: Instant) -> Result<(), String> {
    while !path.exists() {
        if Instant::now() > deadline {
            return Err(format!("qemu never created {}", path.display()));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// The hypervisor's end of the channel: connects, proves the guest agent
/// answers `guest-ping`, holds the connection until the guest says on the
/// control port (`ctl`) that it has seen the agent ready, then hangs up.
/// Bounded by the VM's life: when qemu ends, its sockets close.
fn host_end(socket: &Path, ctl: &Path, vm_timeout: Duration) -> Result<Duration, String> {
    let deadline = Instant::now() + vm_timeout;
    wait_socket(ctl, deadline)?;
    wait_socket(socket, deadline)?;
    // Connected first, so the guest's write to its end does not wait.
    let ctl = UnixStream::connect(ctl).map_err(|e| format!("control port: {e}"))?;
    let stream = UnixStream::connect(socket).map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(Duration::from_secs(2)))
        .map_err(|e| e.to_string())?;
    let mut reader = BufReader::new(stream.try_clone().map_err(|e| e.to_string())?);
    let mut writer = stream;
    let started = Instant::now();
    loop {
        if Instant::now() > deadline {
            return Err("qemu-ga never answered guest-ping".into());
        }
        writer
            .write_all(b"{\"execute\":\"guest-ping\"}\n")
            .map_err(|e| e.to_string())?;
        let mut line = String::new();
        if reader.read_line(&mut line).is_ok() && line.contains("\"return\"") {
            break;
        }
    }
    let answered_after = started.elapsed();
    // No timeout of its own: the read ends with the guest's line, or with
    // end-of-file when the VM ends (or is killed at its timeout).
    let mut seen = String::new();
    BufReader::new(ctl)
        .read_line(&mut seen)
        .map_err(|e| format!("reading the control port: {e}"))?;
    if seen.trim() != "ready-seen" {
        return Err(format!(
            "the guest never reported the agent ready (control port read {seen:?})"
        ));
    }
    drop(writer);
    drop(reader);
    Ok(answered_after)
}

fn guest_agent_states_with_a_real_qemu_ga() {
    let kernel = vm::kernel().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut img = vm::Initramfs::new(&kernel).unwrap();
    img.add_binary(
        &vm::stripped_binary(Path::new(BIN), dir.path()).unwrap(),
        "/usr/bin/harvester-node-agent",
    )
    .unwrap();
    img.add_binary(Path::new("/usr/sbin/qemu-ga"), "/usr/sbin/qemu-ga")
        .unwrap();
    img.add_modules(&["virtio_pci", "virtio_console"]).unwrap();
    img.add_file("/etc/harvester-node-agent/config.toml", b"", 0o644)
        .unwrap();
    img.set_init(
        r#"
A=/usr/bin/harvester-node-agent
export HNA_LOG_TARGET=stderr HNA_KUBECONFIG_SEARCH=
ARGS="--state-dir /var/lib/hna --socket /run/hna/agent.sock"
ST() { $A status --output json --socket /run/hna/agent.sock 2>/dev/null; }
wait_status() { i=0; while [ $i -lt 600 ]; do ST | grep -q "$1" && return 0; sleep 0.1; i=$((i+1)); done; return 1; }
# The guest agent's port (the VM also has the test's control port).
gaport() { for p in /sys/class/virtio-ports/*; do [ "$(cat $p/name 2>/dev/null)" = org.qemu.guest_agent.0 ] && basename $p; done; }
flag() { sed -n "s/^$1: //p" /sys/kernel/debug/virtio-ports/$(gaport) 2>/dev/null | head -1; }
wait_flag() { i=0; while [ $i -lt 1200 ]; do [ "$(flag $1)" = "$2" ] && return 0; sleep 0.1; i=$((i+1)); done; return 1; }
ms() { cut -d' ' -f1 /proc/uptime | tr -d . ; }

# The daemon starts before the channel's driver: no port yet.
modprobe virtio_pci
$A run $ARGS --node-name vm-1 2>/tmp/daemon.log &
PID=$!
wait_status '"reason": "NoVirtioPort"'; hna d.noport $?
# Hot-plug: the port appears (driver loads); udev's rule makes the link.
T0=$(ms)
modprobe virtio_console
# The ports are announced one by one after the driver loads; on a loaded
# host the second can come late. Link them only once both are there (a
# write to a missing link would create a plain file and reach nobody).
i=0; while [ "$(cat /sys/class/virtio-ports/*/name 2>/dev/null | grep -c -e '^org.qemu.guest_agent.0$' -e '^hna.ctl$')" -lt 2 ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
for p in /sys/class/virtio-ports/*; do
  mkdir -p /dev/virtio-ports; ln -sf ../$(basename $p) /dev/virtio-ports/$(cat $p/name)
done
wait_status '"reason": "NotRunning"'; hna d.hotplug $?
hna d.hotplug.cs $(( $(ms) - T0 ))
hna_run notrunning $A check qemu-guest-agent --output json $ARGS

# The agent starts; the host end connects.
qemu-ga -m virtio-serial -p /dev/virtio-ports/org.qemu.guest_agent.0 -t /run 2>/tmp/qga.log &
QGA=$!
wait_flag guest_connected 1; hna guest_connected $?
wait_flag host_connected 1; hna host_connected $?
hna_run ready $A check qemu-guest-agent --output json $ARGS
wait_status '"reason": "Ready"'; hna d.ready $?
# Tell the host it may hang up now (it holds the channel until then).
[ -c /dev/virtio-ports/hna.ctl ]; hna ctl.linked $?
timeout 60 sh -c 'echo ready-seen > /dev/virtio-ports/hna.ctl'; hna ctl.sent $?

# The host end hangs up.
wait_flag host_connected 0; hna host_disconnected $?
T0=$(ms)
hna_run hostgone $A check qemu-guest-agent --output json $ARGS
wait_status '"reason": "HostDisconnected"'; hna d.hostgone $?
hna d.hostgone.cs $(( $(ms) - T0 ))

kill $QGA; wait $QGA
wait_status '"reason": "NotRunning"'; hna d.stopped $?
hna_run final $A status --output json --socket /run/hna/agent.sock
kill -TERM $PID; wait $PID; hna d.exit $?
while read -r l; do hna qga.log "$l"; done < /tmp/qga.log
"#,
    );
    let initramfs = img.build().unwrap();
    let socket = dir.path().join("qga.sock");
    let ctl = dir.path().join("ctl.sock");
    let opts = vm::VmOptions {
        extra_args: vec![
            "-device".into(),
            "virtio-serial-pci,id=vs0".into(),
            "-chardev".into(),
            format!(
                "socket,id=qga0,path={},server=on,wait=off",
                socket.display()
            ),
            "-device".into(),
            "virtserialport,bus=vs0.0,chardev=qga0,name=org.qemu.guest_agent.0".into(),
            "-chardev".into(),
            format!("socket,id=ctl0,path={},server=on,wait=off", ctl.display()),
            "-device".into(),
            "virtserialport,bus=vs0.0,chardev=ctl0,name=hna.ctl".into(),
        ],
        ..vm::VmOptions::default()
    };
    let (run, host) = std::thread::scope(|s| {
        let host = s.spawn(|| host_end(&socket, &ctl, opts.timeout));
        let run = vm::boot(&kernel, &initramfs, &opts);
        (run, host.join().unwrap())
    });
    let run = run.unwrap();
    eprintln!("VM run took {:.1}s", run.duration.as_secs_f64());
    let answered = host.unwrap();
    eprintln!("qemu-ga answered guest-ping {answered:?} after the host end connected");

    assert_eq!(
        run.marker("d.noport").as_deref(),
        Some("0"),
        "{}",
        run.tail(80)
    );
    assert_eq!(
        run.marker("d.hotplug").as_deref(),
        Some("0"),
        "{}",
        run.tail(80)
    );
    let hotplug_cs: u64 = run.marker("d.hotplug.cs").unwrap().parse().unwrap();
    eprintln!(
        "daemon noticed the hot-plugged port after {} ms",
        hotplug_cs * 10
    );
    let c = run.check("notrunning", "qemu-guest-agent");
    assert_eq!(
        (c["status"].as_str(), c["reason"].as_str()),
        (Some("fail"), Some("NotRunning")),
        "{c}"
    );

    assert_eq!(run.marker("guest_connected").as_deref(), Some("0"));
    assert_eq!(run.marker("host_connected").as_deref(), Some("0"));
    let c = run.check("ready", "qemu-guest-agent");
    assert_eq!(
        (c["status"].as_str(), c["reason"].as_str()),
        (Some("ok"), Some("Ready")),
        "{c}"
    );
    assert!(
        c["message"]
            .as_str()
            .unwrap()
            .contains("guest and host connected"),
        "{c}"
    );
    assert_eq!(
        run.marker("d.ready").as_deref(),
        Some("0"),
        "{}",
        run.tail(80)
    );

    assert_eq!(
        run.marker("ctl.linked").as_deref(),
        Some("0"),
        "the control port never appeared: {}",
        run.tail(80)
    );
    assert_eq!(
        run.marker("ctl.sent").as_deref(),
        Some("0"),
        "{}",
        run.tail(80)
    );
    assert_eq!(run.marker("host_disconnected").as_deref(), Some("0"));
    let c = run.check("hostgone", "qemu-guest-agent");
    assert_eq!(
        (c["status"].as_str(), c["reason"].as_str()),
        (Some("warn"), Some("HostDisconnected")),
        "{c}"
    );
    assert_eq!(
        run.marker("d.hostgone").as_deref(),
        Some("0"),
        "{}",
        run.tail(80)
    );
    let hostgone_cs: u64 = run.marker("d.hostgone.cs").unwrap().parse().unwrap();
    eprintln!(
        "daemon noticed the host hang-up after {} ms",
        hostgone_cs * 10
    );
    assert!(hostgone_cs <= 1000, "took {} ms", hostgone_cs * 10);

    assert_eq!(
        run.marker("d.stopped").as_deref(),
        Some("0"),
        "{}",
        run.tail(80)
    );
    let st = run.json("final");
    assert_eq!(st["guest_agent"]["reason"], "NotRunning");
    assert!(
        st["summary"]
            .as_str()
            .unwrap()
            .contains("qemu-ga NotRunning")
    );
    assert_eq!(run.marker("d.exit").as_deref(), Some("0"));
}
