//! Whether a Service's address serves TCP, asked over and over from a host
//! on the LAN, as a client that reconnects would: a fresh connection every
//! few hundred milliseconds, each with a short connect and read deadline,
//! and the answer (the rig's listeners answer with their node's name)
//! recorded with when it was asked.
//!
//! A fresh connection per try makes every try independent: an answer means
//! ARP, the MAC the client's neighbour cache holds, the holder's kernel and
//! its listener all worked at that moment.

use std::io::Read;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};

use crate::rig::forward::in_netns;

/// How long one try may take to connect, and then to read the answer.
const DEADLINE: Duration = Duration::from_millis(300);

/// One connection tried.
#[derive(Debug, Clone)]
pub struct Try {
    pub sent: Instant,
    /// The node that answered, if one did within the deadline.
    pub answer: Option<String>,
}

/// What the prober saw.
#[derive(Debug, Clone, Default)]
pub struct TcpRecord {
    pub tries: Vec<Try>,
}

impl TcpRecord {
    /// When each answered try was made.
    pub fn answered(&self) -> Vec<Instant> {
        self.tries
            .iter()
            .filter(|t| t.answer.is_some())
            .map(|t| t.sent)
            .collect()
    }
}

pub struct TcpProber {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<Vec<Try>>>>,
}

impl TcpProber {
    /// Starts connecting to `target:port` every `every` from namespace
    /// `ns`, and returns once a try was answered (an error after 10 s
    /// without one: the record must begin with the address served).
    pub fn start(ns: &str, target: Ipv4Addr, port: u16, every: Duration) -> Result<TcpProber> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let (answered_tx, answered) = std::sync::mpsc::channel();
        let ns = ns.to_string();
        let thread = std::thread::Builder::new()
            .name(format!("tcp-{target}"))
            .spawn(move || {
                in_netns(&ns, || {
                    run(SocketAddr::from((target, port)), every, &flag, answered_tx)
                })
            })?;
        if answered.recv_timeout(Duration::from_secs(10)).is_err() {
            stop.store(true, Ordering::SeqCst);
            let _ = thread.join();
            bail!("{target}:{port} answered no TCP connection within 10 s");
        }
        Ok(TcpProber {
            stop,
            thread: Some(thread),
        })
    }

    /// Stops and returns what was seen.
    pub fn finish(mut self) -> Result<TcpRecord> {
        self.stop.store(true, Ordering::SeqCst);
        let tries = self
            .thread
            .take()
            .expect("running")
            .join()
            .map_err(|_| anyhow::anyhow!("the TCP prober panicked"))??;
        Ok(TcpRecord { tries })
    }
}

impl Drop for TcpProber {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(
    to: SocketAddr,
    every: Duration,
    stop: &AtomicBool,
    answered: std::sync::mpsc::Sender<()>,
) -> Vec<Try> {
    let mut tries = Vec::new();
    let mut next = Instant::now();
    while !stop.load(Ordering::SeqCst) {
        let sent = Instant::now();
        let answer = ask(to);
        if answer.is_some() {
            let _ = answered.send(());
        }
        tries.push(Try { sent, answer });
        next += every;
        let now = Instant::now();
        if next > now {
            std::thread::sleep(next - now);
        } else {
            // A try that took longer than the period: go on from now, not
            // in a burst to catch up.
            next = now;
        }
    }
    tries
}

/// One connection from namespace `ns` to `ip:port`, with the prober's
/// deadlines: what the listener answered, if it did.
pub fn ask_from(ns: &str, ip: Ipv4Addr, port: u16) -> Option<String> {
    in_netns(ns, || ask(SocketAddr::from((ip, port))))
        .ok()
        .flatten()
}

/// One connection: the first line the listener sends, trimmed.
fn ask(to: SocketAddr) -> Option<String> {
    let mut s = TcpStream::connect_timeout(&to, DEADLINE).ok()?;
    s.set_read_timeout(Some(DEADLINE)).ok()?;
    let mut buf = [0u8; 256];
    let mut got = 0;
    // The listener writes its node's name and closes.
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(_) => return None,
        }
    }
    let text = String::from_utf8_lossy(&buf[..got]).trim().to_string();
    (!text.is_empty()).then_some(text)
}
