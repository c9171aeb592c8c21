//! Starts the test rig (tests/rig) by hand, e.g. to run the daemon against
//! it interactively:
//!
//! ```text
//! sudo cargo run --example rig -- [--guests N] [--no-dhcp] [--apiserver] [--no-stdin]
//! ```
//!
//! Prints one JSON object describing the rig on stdout, then blocks until
//! SIGINT, SIGTERM or EOF on stdin (`--no-stdin`: signals only) and tears
//! everything down. Exit status 2 means a prerequisite is missing.

use std::io::Read;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use hna_testkit::rig::{Rig, RigOptions};
use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, sigaction};

const USAGE: &str = "usage: rig [--guests N] [--no-dhcp] [--apiserver] [--no-stdin]";

/// 1 + the number of the first SIGINT/SIGTERM received, 0 before that.
static SIGNALLED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: nix::libc::c_int) {
    let _ = SIGNALLED.compare_exchange(0, sig + 1, Ordering::SeqCst, Ordering::SeqCst);
}

fn main() {
    if let Err(e) = real_main() {
        eprintln!("rig: {e:#}");
        std::process::exit(1);
    }
}

fn real_main() -> Result<()> {
    let mut opts = RigOptions::default();
    let mut watch_stdin = true;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--guests" => {
                let n = args.next().context(USAGE)?;
                opts.guests = n.parse().with_context(|| format!("--guests {n:?}"))?;
            }
            "--no-dhcp" => opts.dhcp = false,
            "--apiserver" => opts.apiserver = true,
            "--no-stdin" => watch_stdin = false,
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            other => bail!("unknown argument {other:?}\n{USAGE}"),
        }
    }

    // Handlers only set a flag (a blocked mask would be inherited by the
    // rig's children through exec, and dnsmasq would then ignore SIGTERM).
    let action = SigAction::new(
        SigHandler::Handler(on_signal),
        SaFlags::SA_RESTART,
        SigSet::empty(),
    );
    for sig in [Signal::SIGINT, Signal::SIGTERM] {
        // SAFETY: the handler only stores to an atomic (async-signal-safe).
        unsafe { sigaction(sig, &action) }?;
    }

    let missing = hna_testkit::prereq::missing(&opts.prerequisites());
    if !missing.is_empty() {
        for m in &missing {
            eprintln!("rig: {m}");
        }
        std::process::exit(2);
    }
    let rig = Rig::start(opts)?;

    let guests: Vec<_> = (0..rig.guest_count())
        .map(|i| serde_json::json!({ "netns": rig.guest_ns(i), "node_name": rig.node_name(i) }))
        .collect();
    let apiserver = rig.apiserver().map(|a| {
        let nodes: serde_json::Map<_, _> = rig
            .node_names()
            .iter()
            .map(|n| (n.clone(), a.node_kubeconfig(n).display().to_string().into()))
            .collect();
        serde_json::json!({
            "url": a.url(),
            "version": a.version(),
            "ca": a.ca_path(),
            "admin_kubeconfig": a.admin_kubeconfig(),
            "controller_kubeconfig": a.controller_kubeconfig(),
            "node_kubeconfigs": nodes,
            "log": a.log(),
        })
    });
    let out = serde_json::json!({
        "id": rig.id(),
        "dir": rig.dir(),
        "lan_ns": rig.lan_ns(),
        "subnet": rig.subnet(),
        "dnsmasq_leases": rig.leases_path(),
        "guests": guests,
        "apiserver": apiserver,
    });
    println!("{out}");

    let (tx, rx) = mpsc::channel::<&str>();
    if watch_stdin {
        std::thread::spawn(move || {
            let mut sink = [0u8; 4096];
            let mut stdin = std::io::stdin().lock();
            while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
            let _ = tx.send("stdin closed");
        });
    } else {
        // Keep the channel open: only signals end the wait.
        std::mem::forget(tx);
    }
    let why = loop {
        match SIGNALLED.load(Ordering::SeqCst) {
            0 => {}
            n if n - 1 == Signal::SIGINT as i32 => break "received SIGINT",
            _ => break "received SIGTERM",
        }
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(why) => break why,
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break "stdin reader ended",
        }
    };
    eprintln!("rig: {why}, tearing down");
    drop(rig);
    Ok(())
}
