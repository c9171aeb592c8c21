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

/// One TCP connection kept open through a fault, as a client with a
/// connection in flight sees it: a byte sent every few milliseconds, each
/// echoed back by the far end (the VM nodes' echo listener,
/// [`crate::vm::node::ECHO_PORT`]). A lost frame is retransmitted by TCP
/// (200 ms at first, then backing off), so the record's longest gap is
/// what the application saw, retransmissions included.
pub struct EchoProber {
    stop: Arc<AtomicBool>,
    /// Whether the writer sends (a client idle for a while: nothing of its
    /// own in flight, nothing of the server's unacknowledged).
    sending: Arc<AtomicBool>,
    stream: TcpStream,
    writer: Option<JoinHandle<Result<()>>>,
    reader: Option<JoinHandle<Vec<Instant>>>,
}

/// When each echoed byte came back, in order.
#[derive(Debug, Clone, Default)]
pub struct EchoRecord {
    pub echoed: Vec<Instant>,
    /// When the prober stopped.
    pub ended: Option<Instant>,
}

impl EchoRecord {
    /// The longest time without an echo, and when it began: between two
    /// echoes, or from the last echo to the end of the record.
    pub fn longest_gap(&self) -> (Duration, Option<Instant>) {
        let mut best = (Duration::ZERO, None);
        let ends = self.echoed.iter().copied().chain(self.ended);
        for (a, b) in self.echoed.iter().copied().zip(ends.skip(1)) {
            if b - a > best.0 {
                best = (b - a, Some(a));
            }
        }
        best
    }
}

impl EchoProber {
    /// Connects from namespace `ns` to `target:port` and starts sending a
    /// byte every `every`; returns once the first echo came back (an error
    /// after 10 s without one).
    pub fn start(ns: &str, target: Ipv4Addr, port: u16, every: Duration) -> Result<EchoProber> {
        let to = SocketAddr::from((target, port));
        let stream = in_netns(ns, || {
            TcpStream::connect_timeout(&to, Duration::from_secs(3))
        })??;
        stream.set_nodelay(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let (first_tx, first) = std::sync::mpsc::channel();
        let mut rx = stream.try_clone()?;
        let reader = std::thread::Builder::new()
            .name(format!("echo-rx-{target}"))
            .spawn(move || {
                let mut echoed = Vec::new();
                let mut buf = [0u8; 256];
                while let Ok(n) = rx.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    let now = Instant::now();
                    if echoed.is_empty() {
                        let _ = first_tx.send(());
                    }
                    echoed.extend(std::iter::repeat_n(now, n));
                }
                echoed
            })?;
        let mut tx = stream.try_clone()?;
        let flag = stop.clone();
        let sending = Arc::new(AtomicBool::new(true));
        let send = sending.clone();
        let writer = std::thread::Builder::new()
            .name(format!("echo-tx-{target}"))
            .spawn(move || -> Result<()> {
                use std::io::Write;
                let mut next = Instant::now();
                while !flag.load(Ordering::SeqCst) {
                    if send.load(Ordering::SeqCst) {
                        tx.write_all(b".")?;
                    }
                    next += every;
                    let now = Instant::now();
                    if next > now {
                        std::thread::sleep(next - now);
                    }
                }
                Ok(())
            })?;
        let prober = EchoProber {
            stop,
            sending,
            stream,
            writer: Some(writer),
            reader: Some(reader),
        };
        if first.recv_timeout(Duration::from_secs(10)).is_err() {
            bail!("{target}:{port} echoed nothing within 10 s");
        }
        Ok(prober)
    }

    /// Stops (`false`) or resumes (`true`) sending; the connection stays
    /// open. Idle, the client sends nothing, and once the last echoes are
    /// acknowledged neither end has anything in flight: after a fault on
    /// the path, only the client's next byte (and its retransmissions)
    /// can find out whether the server is reachable, as for a client of a
    /// keep-alive connection sending its next request.
    pub fn set_sending(&self, on: bool) {
        self.sending.store(on, Ordering::SeqCst);
    }

    /// Stops sending, waits a little for echoes in flight, closes the
    /// connection and returns what came back.
    pub fn finish(mut self) -> Result<EchoRecord> {
        self.stop.store(true, Ordering::SeqCst);
        let ended = Instant::now();
        if let Some(w) = self.writer.take() {
            w.join()
                .map_err(|_| anyhow::anyhow!("the echo writer panicked"))??;
        }
        std::thread::sleep(Duration::from_millis(300));
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        let mut echoed = self
            .reader
            .take()
            .expect("running")
            .join()
            .map_err(|_| anyhow::anyhow!("the echo reader panicked"))?;
        echoed.retain(|t| *t <= ended);
        Ok(EchoRecord {
            echoed,
            ended: Some(ended),
        })
    }
}

impl Drop for EchoProber {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        if let Some(t) = self.writer.take() {
            let _ = t.join();
        }
        if let Some(t) = self.reader.take() {
            let _ = t.join();
        }
    }
}
