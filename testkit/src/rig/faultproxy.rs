//! A fault-injecting HTTPS proxy in front of the rig's kube-apiserver, for
//! the "no cascade" tests (issue #22): a share of requests is answered at
//! once with a 500, 503 or 429 (a Kubernetes `Status` body, and
//! `Retry-After: 1` on the 429) and another share is held back for up to
//! [`FaultConfig::max_delay`] before it is forwarded. Everything else, and
//! every response body (watches included), streams through unchanged.
//!
//! It serves TLS with the API server's own certificate (its SAN covers
//! 127.0.0.1), so the clients' kubeconfigs only change their port, and it
//! forwards to the API server over TLS trusting the rig CA. Bearer tokens
//! pass through: the API server authenticates the client, not the proxy.
//!
//! The faults come from a seeded PRNG, one draw per request in the order
//! requests arrive ([`seed_from_env`] takes `HNA_FAULT_SEED`). The same
//! seed gives the same sequence of decisions; which request meets which
//! decision still depends on the order the clients' requests arrive in.
//!
//! [`FaultProxy::counts`] says what it did, so a test can show that the
//! faults it relies on really happened. Each request's upstream connection
//! is its own (a fresh TLS handshake on loopback): a pooled connection the
//! API server closed could turn into an error the test did not ask for.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore, ServerConfig};
use tokio_rustls::{TlsAcceptor, TlsConnector};

/// The environment variable a seed is taken from ([`seed_from_env`]).
pub const SEED_ENV: &str = "HNA_FAULT_SEED";

/// How a request is treated while faults are on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FaultConfig {
    /// The share of requests answered at once with a 500, 503 or 429
    /// (each a third of those).
    pub errors: f64,
    /// The share of requests held back, for a uniformly drawn time up to
    /// `max_delay`, before they are forwarded.
    pub delays: f64,
    pub max_delay: Duration,
    /// Brownouts besides (or instead of) the per-request faults.
    pub brownout: Option<Brownout>,
}

/// An API server in a brownout, as one overloaded behind API Priority and
/// Fairness looks: every so often (seeded) and for a while, every request
/// is slow, and a share is shed at once with 429 and `Retry-After: 1`.
/// Faults drawn per request are what hedging beats; a brownout is not.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Brownout {
    /// From the end of one brownout to the start of the next.
    pub gap: (Duration, Duration),
    pub length: (Duration, Duration),
    /// Each request held back this long (drawn per request).
    pub delay: (Duration, Duration),
    /// The share answered 429 at once instead.
    pub shed: f64,
}

impl Brownout {
    /// Every request 1-3 s slow for 5-20 s, a fifth shed, 10-30 s apart.
    pub const SEVERE: Brownout = Brownout {
        gap: (Duration::from_secs(10), Duration::from_secs(30)),
        length: (Duration::from_secs(5), Duration::from_secs(20)),
        delay: (Duration::from_secs(1), Duration::from_secs(3)),
        shed: 0.2,
    };
}

/// What the proxy did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultCounts {
    /// Every request received.
    pub requests: u64,
    pub internal_errors: u64,
    pub unavailable: u64,
    pub too_many_requests: u64,
    /// Requests held back before forwarding.
    pub delayed: u64,
    /// The longest delay given, in milliseconds.
    pub longest_delay_ms: u64,
    /// Watch requests (`watch=true` or `watch=1`) forwarded.
    pub watches: u64,
    /// Requests the proxy could not forward (answered 502): not a fault
    /// it was asked for.
    pub upstream_failures: u64,
    /// Brownouts begun.
    pub brownouts: u64,
    /// Status writes of a `LoadBalancerNode` that came from a client (by
    /// its credentials) sooner than the `Retry-After` of the 429 it was
    /// answered last.
    pub early_retries: u64,
}

impl FaultCounts {
    pub fn errors(&self) -> u64 {
        self.internal_errors + self.unavailable + self.too_many_requests
    }
}

impl std::fmt::Display for FaultCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} requests: {} answered 500, {} answered 503, {} answered 429, {} delayed (longest {} ms), {} watches, {} not forwarded (502), {} brownouts, {} status writes sooner than a 429's Retry-After",
            self.requests,
            self.internal_errors,
            self.unavailable,
            self.too_many_requests,
            self.delayed,
            self.longest_delay_ms,
            self.watches,
            self.upstream_failures,
            self.brownouts,
            self.early_retries
        )
    }
}

/// `HNA_FAULT_SEED` if set (decimal or `0x` hex), else a fresh one.
pub fn seed_from_env() -> Result<u64> {
    match std::env::var(SEED_ENV) {
        Ok(s) => {
            let s = s.trim();
            let parsed = match s.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => s.parse(),
            };
            parsed.with_context(|| format!("{SEED_ENV}={s} is not a number"))
        }
        Err(_) => {
            let mut b = [0u8; 8];
            getrandom(&mut b)?;
            Ok(u64::from_le_bytes(b))
        }
    }
}

fn getrandom(buf: &mut [u8]) -> Result<()> {
    use std::io::Read;
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(buf))
        .context("reading /dev/urandom")
}

/// SplitMix64: small, seedable and good enough to draw faults from.
#[derive(Debug, Clone)]
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// One request's fate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    Forward,
    Fail(StatusCode),
    Delay(Duration),
}

/// Draws one request's fate: an error with probability `errors`, else a
/// delay with probability `delays`, else nothing.
fn draw(rng: &mut SplitMix64, config: Option<&FaultConfig>) -> Fate {
    let Some(c) = config else {
        return Fate::Forward;
    };
    let r = rng.next_f64();
    if r < c.errors {
        let code = match rng.next_u64() % 3 {
            0 => StatusCode::INTERNAL_SERVER_ERROR,
            1 => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::TOO_MANY_REQUESTS,
        };
        Fate::Fail(code)
    } else if r < c.errors + c.delays {
        let ms = c.max_delay.as_millis() as u64;
        Fate::Delay(Duration::from_millis(rng.next_u64() % (ms + 1)))
    } else {
        Fate::Forward
    }
}

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    internal_errors: AtomicU64,
    unavailable: AtomicU64,
    too_many_requests: AtomicU64,
    delayed: AtomicU64,
    longest_delay_ms: AtomicU64,
    watches: AtomicU64,
    upstream_failures: AtomicU64,
    brownouts: AtomicU64,
    early_retries: AtomicU64,
}

/// When the brownout under way ends and the next begins.
#[derive(Default)]
struct BrownoutClock {
    until: Option<std::time::Instant>,
    next: Option<std::time::Instant>,
}

/// Uniform in `[lo, hi]`.
fn between(rng: &mut SplitMix64, (lo, hi): (Duration, Duration)) -> Duration {
    let span = hi.saturating_sub(lo).as_millis() as u64;
    lo + Duration::from_millis(rng.next_u64() % (span + 1))
}

struct Shared {
    config: Mutex<Option<FaultConfig>>,
    rng: Mutex<SplitMix64>,
    brownout: Mutex<BrownoutClock>,
    /// Per client (its `Authorization` header): when a status write of
    /// it was last answered 429.
    shed_at: Mutex<std::collections::HashMap<String, std::time::Instant>>,
    counters: Counters,
    upstream: SocketAddr,
    connector: TlsConnector,
}

impl Shared {
    fn fate(&self) -> Fate {
        let config = *self.config.lock().unwrap_or_else(|e| e.into_inner());
        let mut rng = self.rng.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(b) = config.and_then(|c| c.brownout) {
            let now = std::time::Instant::now();
            let mut clock = self.brownout.lock().unwrap_or_else(|e| e.into_inner());
            let next = *clock
                .next
                .get_or_insert_with(|| now + between(&mut rng, b.gap));
            if clock.until.is_none_or(|u| now >= u) && now >= next {
                let until = now + between(&mut rng, b.length);
                clock.until = Some(until);
                clock.next = Some(until + between(&mut rng, b.gap));
                self.counters.brownouts.fetch_add(1, Ordering::Relaxed);
            }
            if clock.until.is_some_and(|u| now < u) {
                return if rng.next_f64() < b.shed {
                    Fate::Fail(StatusCode::TOO_MANY_REQUESTS)
                } else {
                    Fate::Delay(between(&mut rng, b.delay))
                };
            }
        }
        draw(&mut rng, config.as_ref())
    }

    /// Notes a `LoadBalancerNode` status write: answered 429 now
    /// (`shed`), or arriving (counted when it comes sooner than the
    /// `Retry-After` of its client's last 429).
    fn note_status_write(&self, client: &str, shed: bool) {
        let now = std::time::Instant::now();
        let mut at = self.shed_at.lock().unwrap_or_else(|e| e.into_inner());
        if shed {
            at.insert(client.to_string(), now);
        } else if at.get(client).is_some_and(|t| {
            // A write the client sent before the 429 reached it arrives
            // within moments of it: not one that ignored it.
            let since = now.duration_since(*t);
            since > IN_FLIGHT && since < RETRY_AFTER
        }) {
            self.counters.early_retries.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// A running proxy; [`FaultProxy::stop`] (or drop) closes the listener and
/// every connection it carries.
pub struct FaultProxy {
    port: u16,
    seed: u64,
    shared: Arc<Shared>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl FaultProxy {
    /// Listens on `127.0.0.1:<free port>` with `cert`/`key` (PEM) and
    /// forwards to `https://127.0.0.1:<upstream_port>`, trusting `ca`.
    /// Faults are off until [`FaultProxy::set_faults`].
    pub fn start(
        upstream_port: u16,
        cert: &Path,
        key: &Path,
        ca: &Path,
        seed: u64,
    ) -> Result<Self> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let certs = CertificateDer::pem_file_iter(cert)
            .with_context(|| format!("read {}", cert.display()))?
            .collect::<Result<Vec<_>, _>>()
            .with_context(|| format!("parse {}", cert.display()))?;
        let key = PrivateKeyDer::from_pem_file(key)
            .with_context(|| format!("read the key {}", key.display()))?;
        let mut server = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .context("the proxy's serving certificate")?;
        // HTTP/1.1 only, so every request is its own exchange to decide on.
        server.alpn_protocols = vec![b"http/1.1".to_vec()];
        let mut roots = RootCertStore::empty();
        for c in
            CertificateDer::pem_file_iter(ca).with_context(|| format!("read {}", ca.display()))?
        {
            roots
                .add(c.with_context(|| format!("parse {}", ca.display()))?)
                .context("the rig CA")?;
        }
        let mut client = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        client.alpn_protocols = vec![b"http/1.1".to_vec()];
        let shared = Arc::new(Shared {
            config: Mutex::new(None),
            rng: Mutex::new(SplitMix64(seed)),
            brownout: Mutex::new(BrownoutClock::default()),
            shed_at: Mutex::new(std::collections::HashMap::new()),
            counters: Counters::default(),
            upstream: SocketAddr::from(([127, 0, 0, 1], upstream_port)),
            connector: TlsConnector::from(Arc::new(client)),
        });
        let acceptor = TlsAcceptor::from(Arc::new(server));
        let listener = std::net::TcpListener::bind("127.0.0.1:0").context("bind the proxy")?;
        listener.set_nonblocking(true)?;
        let port = listener.local_addr()?.port();
        let (stop_tx, stop_rx) = oneshot::channel();
        let shared2 = shared.clone();
        let thread = std::thread::Builder::new()
            .name("fault-proxy".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        eprintln!("rig: fault proxy runtime: {e}");
                        return;
                    }
                };
                rt.block_on(async move {
                    let listener = match TcpListener::from_std(listener) {
                        Ok(l) => l,
                        Err(e) => {
                            eprintln!("rig: fault proxy listener: {e}");
                            return;
                        }
                    };
                    tokio::select! {
                        _ = accept_loop(listener, acceptor, shared2) => {}
                        _ = stop_rx => {}
                    }
                });
                // Dropping the runtime drops every connection task, which
                // closes their sockets: clients see the proxy gone.
                drop(rt);
            })
            .context("start the fault proxy thread")?;
        Ok(FaultProxy {
            port,
            seed,
            shared,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `https://127.0.0.1:<port>`
    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Turns faults on (`Some`) or off (`None`) for the requests that
    /// arrive from now on.
    pub fn set_faults(&self, config: Option<FaultConfig>) {
        *self.shared.config.lock().unwrap_or_else(|e| e.into_inner()) = config;
    }

    pub fn counts(&self) -> FaultCounts {
        let c = &self.shared.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        FaultCounts {
            requests: get(&c.requests),
            internal_errors: get(&c.internal_errors),
            unavailable: get(&c.unavailable),
            too_many_requests: get(&c.too_many_requests),
            delayed: get(&c.delayed),
            longest_delay_ms: get(&c.longest_delay_ms),
            watches: get(&c.watches),
            upstream_failures: get(&c.upstream_failures),
            brownouts: get(&c.brownouts),
            early_retries: get(&c.early_retries),
        }
    }

    /// Stops listening and closes every connection. Idempotent.
    pub fn stop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn accept_loop(listener: TcpListener, acceptor: TlsAcceptor, shared: Arc<Shared>) {
    loop {
        let (tcp, _) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                eprintln!("rig: fault proxy accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = tcp.set_nodelay(true);
        let (acceptor, shared) = (acceptor.clone(), shared.clone());
        tokio::spawn(async move {
            // A client that gives up during the handshake is its business.
            let Ok(tls) = acceptor.accept(tcp).await else {
                return;
            };
            let service = hyper::service::service_fn(move |req| {
                let shared = shared.clone();
                async move { Ok::<_, std::convert::Infallible>(handle(&shared, req).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(tls), service)
                .await;
        });
    }
}

type Body = BoxBody<Bytes, hyper::Error>;

fn full(text: String) -> Body {
    Full::new(Bytes::from(text))
        .map_err(|never| match never {})
        .boxed()
}

fn is_watch(req: &Request<Incoming>) -> bool {
    req.uri()
        .query()
        .is_some_and(|q| q.split('&').any(|kv| kv == "watch=true" || kv == "watch=1"))
}

/// A PATCH of a `LoadBalancerNode`'s status, and whose credentials sent it.
fn status_write(req: &Request<Incoming>) -> Option<String> {
    let path = req.uri().path();
    (req.method() == hyper::Method::PATCH
        && path.contains("/loadbalancernodes/")
        && path.ends_with("/status"))
    .then(|| {
        req.headers()
            .get(hyper::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string()
    })
}

/// What every 429 of the proxy asks for.
const RETRY_AFTER: Duration = Duration::from_secs(1);
/// How late after a 429 a write may arrive that its client sent before
/// the 429 reached it (loopback: milliseconds).
const IN_FLIGHT: Duration = Duration::from_millis(50);

async fn handle(shared: &Shared, req: Request<Incoming>) -> Response<Body> {
    let c = &shared.counters;
    c.requests.fetch_add(1, Ordering::Relaxed);
    let writer = status_write(&req);
    if let Some(w) = &writer {
        shared.note_status_write(w, false);
    }
    match shared.fate() {
        Fate::Fail(code) => {
            if let Some(w) = &writer
                && code == StatusCode::TOO_MANY_REQUESTS
            {
                shared.note_status_write(w, true);
            }
            let counter = match code {
                StatusCode::INTERNAL_SERVER_ERROR => &c.internal_errors,
                StatusCode::SERVICE_UNAVAILABLE => &c.unavailable,
                _ => &c.too_many_requests,
            };
            counter.fetch_add(1, Ordering::Relaxed);
            return status_response(code);
        }
        Fate::Delay(d) => {
            c.delayed.fetch_add(1, Ordering::Relaxed);
            c.longest_delay_ms
                .fetch_max(d.as_millis() as u64, Ordering::Relaxed);
            tokio::time::sleep(d).await;
        }
        Fate::Forward => {}
    }
    if is_watch(&req) {
        c.watches.fetch_add(1, Ordering::Relaxed);
    }
    match forward(shared, req).await {
        Ok(resp) => resp,
        Err(e) => {
            c.upstream_failures.fetch_add(1, Ordering::Relaxed);
            eprintln!("rig: fault proxy could not forward: {e:#}");
            let mut resp = Response::new(full(format!("fault proxy: {e:#}")));
            *resp.status_mut() = StatusCode::BAD_GATEWAY;
            resp
        }
    }
}

/// A Kubernetes `Status` for `code`, as the API server sends it.
fn status_response(code: StatusCode) -> Response<Body> {
    let (reason, message) = match code {
        StatusCode::INTERNAL_SERVER_ERROR => ("InternalError", "injected by the rig's fault proxy"),
        StatusCode::SERVICE_UNAVAILABLE => (
            "ServiceUnavailable",
            "the server is currently unable to handle the request (injected by the rig's fault proxy)",
        ),
        _ => (
            "TooManyRequests",
            "too many requests, please try again later (injected by the rig's fault proxy)",
        ),
    };
    let mut body = serde_json::json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code.as_u16(),
    });
    if code == StatusCode::TOO_MANY_REQUESTS {
        body["details"] = serde_json::json!({"retryAfterSeconds": 1});
    }
    let mut resp = Response::new(full(body.to_string()));
    *resp.status_mut() = code;
    let h = resp.headers_mut();
    h.insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    if code == StatusCode::TOO_MANY_REQUESTS {
        h.insert(
            hyper::header::RETRY_AFTER,
            hyper::header::HeaderValue::from_static("1"),
        );
    }
    resp
}

/// Sends `req` to the API server on a connection of its own and returns
/// its response, whose body streams through as it arrives.
async fn forward(shared: &Shared, req: Request<Incoming>) -> Result<Response<Body>> {
    let tcp = TcpStream::connect(shared.upstream)
        .await
        .with_context(|| format!("connect {}", shared.upstream))?;
    let _ = tcp.set_nodelay(true);
    let name = ServerName::try_from("127.0.0.1").map_err(|e| anyhow!("{e}"))?;
    let tls = shared
        .connector
        .connect(name, tcp)
        .await
        .context("TLS to the API server")?;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake::<_, Incoming>(TokioIo::new(tls))
            .await
            .context("HTTP handshake with the API server")?;
    // Runs until the response body is done (a watch: until it ends).
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let (mut parts, body) = req.into_parts();
    let path = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "/".into());
    parts.uri = path.parse().context("request path")?;
    parts.headers.insert(
        hyper::header::HOST,
        hyper::header::HeaderValue::from_str(&shared.upstream.to_string())?,
    );
    let resp = sender
        .send_request(Request::from_parts(parts, body))
        .await
        .context("request to the API server")?;
    Ok(resp.map(|b| b.boxed()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_replays_the_same_fates_and_shares_are_kept() {
        let c = FaultConfig {
            errors: 0.2,
            delays: 0.2,
            max_delay: Duration::from_secs(2),
            brownout: None,
        };
        let run = |seed| {
            let mut rng = SplitMix64(seed);
            (0..10_000)
                .map(|_| draw(&mut rng, Some(&c)))
                .collect::<Vec<_>>()
        };
        let a = run(42);
        assert_eq!(a, run(42));
        assert_ne!(a, run(43));
        let errors = a.iter().filter(|f| matches!(f, Fate::Fail(_))).count();
        let delays = a.iter().filter(|f| matches!(f, Fate::Delay(_))).count();
        assert!((1800..2200).contains(&errors), "{errors} errors");
        assert!((1800..2200).contains(&delays), "{delays} delays");
        for code in [
            StatusCode::INTERNAL_SERVER_ERROR,
            StatusCode::SERVICE_UNAVAILABLE,
            StatusCode::TOO_MANY_REQUESTS,
        ] {
            let n = a.iter().filter(|f| **f == Fate::Fail(code)).count();
            assert!((500..850).contains(&n), "{n} x {code}");
        }
        assert!(a.iter().all(|f| match f {
            Fate::Delay(d) => *d <= c.max_delay,
            _ => true,
        }));
        let mut rng = SplitMix64(1);
        assert_eq!(draw(&mut rng, None), Fate::Forward, "faults off");
    }

    #[test]
    fn a_429_says_when_to_retry() {
        let r = status_response(StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.headers()[hyper::header::RETRY_AFTER], "1");
        let r = status_response(StatusCode::SERVICE_UNAVAILABLE);
        assert!(r.headers().get(hyper::header::RETRY_AFTER).is_none());
    }
}
