//! In-process TCP forwarder that makes a port on the host's loopback
//! reachable at the same address from inside another network namespace.
//!
//! A thread enters the target namespace (`setns(CLONE_NEWNET)`), binds
//! `127.0.0.1:<port>` there and returns to the original namespace. Sockets
//! keep the namespace they were created in, so the listener keeps accepting
//! connections made inside the guest namespace while every outgoing
//! connection (made from this thread, back in the original namespace) reaches
//! the host's `127.0.0.1:<port>`.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, ErrorKind};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use nix::sched::{CloneFlags, setns};

type Conns = Arc<Mutex<HashMap<u64, Vec<TcpStream>>>>;

/// A running forwarder; [`Forwarder::stop`] (or drop) stops accepting and
/// shuts down every connection it is carrying.
pub struct Forwarder {
    netns: String,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    conns: Conns,
    /// How long each chunk from the upstream waits before it goes on, in
    /// milliseconds ([`Forwarder::delay_replies`]).
    reply_delay: Arc<AtomicU64>,
}

/// Runs `f` on the current thread while it is inside the network namespace
/// `/run/netns/<netns>`, then moves the thread back to its original
/// namespace. Only use it on a thread you own (the namespace is per thread).
pub fn in_netns<T>(netns: &str, f: impl FnOnce() -> T) -> Result<T> {
    let original =
        File::open("/proc/thread-self/ns/net").context("open /proc/thread-self/ns/net")?;
    let target = File::open(format!("/run/netns/{netns}"))
        .with_context(|| format!("open /run/netns/{netns}"))?;
    setns(&target, CloneFlags::CLONE_NEWNET).with_context(|| format!("setns into {netns}"))?;
    let out = f();
    setns(&original, CloneFlags::CLONE_NEWNET)
        .with_context(|| format!("setns back from {netns}"))
        // Should never happen; a thread stuck in the wrong namespace would
        // silently misroute everything it does afterwards.
        .expect("cannot return to the original network namespace");
    Ok(out)
}

impl Forwarder {
    /// Listens on `127.0.0.1:<port>` inside `netns` and forwards each
    /// connection to `127.0.0.1:<port>` in the namespace of the calling
    /// process. Returns once the listener is bound.
    pub fn start(netns: &str, port: u16) -> Result<Forwarder> {
        Forwarder::start_at(netns, SocketAddr::from(([127, 0, 0, 1], port)), port)
    }

    /// Listens on `listen` inside `netns` and forwards each connection to
    /// `127.0.0.1:<upstream>` in the namespace of the calling process.
    pub fn start_at(netns: &str, listen: SocketAddr, upstream: u16) -> Result<Forwarder> {
        let stop = Arc::new(AtomicBool::new(false));
        let conns: Conns = Arc::default();
        let reply_delay = Arc::new(AtomicU64::new(0));
        let delay2 = reply_delay.clone();
        let (tx, rx) = mpsc::channel::<Result<()>>();
        let ns = netns.to_string();
        let (stop2, conns2) = (stop.clone(), conns.clone());
        let thread = std::thread::Builder::new()
            .name(format!("fwd-{netns}"))
            .spawn(move || {
                let bound = in_netns(&ns, || TcpListener::bind(listen))
                    .and_then(|r| r.with_context(|| format!("bind {listen} in {ns}")))
                    .and_then(|l| {
                        l.set_nonblocking(true)?;
                        Ok(l)
                    });
                let listener = match bound {
                    Ok(l) => {
                        let _ = tx.send(Ok(()));
                        l
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e));
                        return;
                    }
                };
                accept_loop(listener, upstream, &stop2, &conns2, &delay2);
            })?;
        rx.recv()
            .map_err(|_| anyhow!("forwarder thread for {netns} died"))??;
        Ok(Forwarder {
            netns: netns.to_string(),
            stop,
            thread: Some(thread),
            conns,
            reply_delay,
        })
    }

    /// Holds everything the upstream sends back (a watch's events, a
    /// write's answer) for `delay` before passing it on, on open
    /// connections too: an API server that answers this client late (a
    /// brownout, its requests queued by API Priority and Fairness). Zero:
    /// at once again. Each chunk waits in turn, so a burst arrives later
    /// still.
    pub fn delay_replies(&self, delay: Duration) {
        let ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        self.reply_delay.store(ms, Ordering::SeqCst);
    }

    /// The namespace this forwarder listens in.
    pub fn netns(&self) -> &str {
        &self.netns
    }

    /// Stops accepting, closes the listener and shuts down all open
    /// connections. Idempotent.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let conns = std::mem::take(&mut *self.conns.lock().unwrap_or_else(|e| e.into_inner()));
        for s in conns.values().flatten() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.stop();
    }
}

fn accept_loop(
    listener: TcpListener,
    port: u16,
    stop: &AtomicBool,
    conns: &Conns,
    reply_delay: &Arc<AtomicU64>,
) {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let upstream = SocketAddr::from(([127, 0, 0, 1], port));
    while !stop.load(Ordering::SeqCst) {
        let (client, _) = match listener.accept() {
            Ok(c) => c,
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(e) => {
                eprintln!("rig: forwarder accept on port {port}: {e}");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        // This thread is back in the original namespace: connect from here.
        let server = match TcpStream::connect_timeout(&upstream, Duration::from_secs(5)) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("rig: forwarder cannot reach {upstream}: {e}");
                continue; // dropping `client` closes it
            }
        };
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = spawn_pipe(id, client, server, conns, reply_delay.clone()) {
            eprintln!("rig: forwarder cannot start connection threads: {e}");
        }
    }
}

fn spawn_pipe(
    id: u64,
    client: TcpStream,
    server: TcpStream,
    conns: &Conns,
    reply_delay: Arc<AtomicU64>,
) -> io::Result<()> {
    client.set_nonblocking(false)?;
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    conns
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(id, vec![client.try_clone()?, server.try_clone()?]);
    let (c_read, s_write) = (client.try_clone()?, server.try_clone()?);
    let conns = conns.clone();
    std::thread::Builder::new()
        .name(format!("fwd-conn-{id}"))
        .spawn(move || {
            let back = std::thread::Builder::new()
                .name(format!("fwd-conn-{id}-back"))
                .spawn(move || copy_delayed(server, client, &reply_delay));
            copy(c_read, s_write);
            if let Ok(back) = back {
                let _ = back.join();
            }
            conns.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
        })?;
    Ok(())
}

/// [`copy`], each chunk held for the delay of the moment first.
fn copy_delayed(mut from: TcpStream, mut to: TcpStream, delay: &AtomicU64) {
    use std::io::{Read, Write};
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => {
                let _ = to.shutdown(Shutdown::Write);
                return;
            }
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        let ms = delay.load(Ordering::SeqCst);
        if ms > 0 {
            std::thread::sleep(Duration::from_millis(ms));
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Both);
    let _ = from.shutdown(Shutdown::Both);
}

/// Copies `from` into `to` until EOF, then half-closes `to`; on an error
/// both sockets are shut down so the other direction ends too.
fn copy(mut from: TcpStream, mut to: TcpStream) {
    match io::copy(&mut from, &mut to) {
        Ok(_) => {
            let _ = to.shutdown(Shutdown::Write);
        }
        Err(_) => {
            let _ = to.shutdown(Shutdown::Both);
            let _ = from.shutdown(Shutdown::Both);
        }
    }
}
