//! The optional `/metrics` (OpenMetrics text, through `prometheus-client`)
//! and `/healthz` endpoint of the daemon (`metrics_listen`, off by default),
//! the controller and `dhcp-hold`, and what every one of them exports: the
//! `process_*` metrics (`process`) and its API requests' latency
//! (`api`).
//! Two read-only GET routes do not justify an HTTP framework: this answers
//! one request per connection with `Connection: close`.

pub(crate) mod api;
pub mod exposition;
pub(crate) mod process;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What every component's registry has besides its own: the `process_*`
/// metrics and the latency of its Kubernetes API requests.
pub fn register_common(registry: &mut prometheus_client::registry::Registry) {
    registry.register_collector(Box::new(process::ProcessCollector));
    registry.register_with_unit(
        "hna_api_request_duration",
        "Kubernetes API requests by verb (GET, WATCH, POST, PUT, PATCH, DELETE) and outcome (2xx..5xx, error: no answer), until the response head",
        prometheus_client::registry::Unit::Seconds,
        api::api_latency().clone(),
    );
}

/// What the endpoint serves, computed per request.
#[derive(Clone)]
pub struct Pages {
    /// The OpenMetrics text exposition ([`exposition::encode`]).
    pub metrics: Arc<dyn Fn() -> String + Send + Sync>,
    /// `/healthz` (readiness): `Ok` for `200 ok`, `Err(why)` for `503`.
    // why String: `why` is the 503's body, text made for a reader and
    // never handled as an error; the daemon and the controller build it.
    pub health: Arc<dyn Fn() -> Result<(), String> + Send + Sync>,
    /// `/livez` (liveness): whether the process's own loops run, whatever
    /// the API server does; the same answers as `health` (and the same
    /// why String: the 503 body).
    pub live: Arc<dyn Fn() -> Result<(), String> + Send + Sync>,
}

/// At most this many connections are answered at once; more are closed at
/// once, so a flood of slow clients costs a few sockets, not memory and
/// tasks without bound.
pub(crate) const MAX_CONNECTIONS: usize = 16;

/// Binds `addr`; serve with [`serve`].
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

/// Serves until the task is dropped: `MAX_CONNECTIONS` at a time, each
/// given 5 s.
pub async fn serve(listener: TcpListener, pages: Pages) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok((conn, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            drop(conn);
            continue;
        };
        let pages = pages.clone();
        tokio::spawn(async move {
            let _ = tokio::time::timeout(Duration::from_secs(5), answer(conn, pages)).await;
            drop(slot);
        });
    }
}

async fn answer(mut conn: TcpStream, pages: Pages) -> std::io::Result<()> {
    let mut buf = vec![0u8; 4096];
    let mut n = 0;
    // Read the request head (the body, if any, is ignored).
    while n < buf.len() {
        let r = conn.read(&mut buf[n..]).await?;
        if r == 0 {
            break;
        }
        n += r;
        if buf[..n].windows(4).any(|w| w == b"\r\n\r\n")
            || buf[..n].windows(2).any(|w| w == b"\n\n")
        {
            break;
        }
    }
    let head = String::from_utf8_lossy(&buf[..n]);
    let mut words = head.split_whitespace();
    let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let (code, ctype, body) = match (method, path.split('?').next().unwrap_or("")) {
        ("GET", "/metrics") => ("200 OK", exposition::CONTENT_TYPE, (pages.metrics)()),
        ("GET", route @ ("/healthz" | "/livez")) => {
            let verdict = if route == "/healthz" {
                (pages.health)()
            } else {
                (pages.live)()
            };
            match verdict {
                Ok(()) => ("200 OK", "text/plain; charset=utf-8", "ok\n".to_string()),
                Err(why) => (
                    "503 Service Unavailable",
                    "text/plain; charset=utf-8",
                    format!("unhealthy: {why}\n"),
                ),
            }
        }
        ("GET", _) => ("404 Not Found", "text/plain", "not found\n".to_string()),
        _ => (
            "405 Method Not Allowed",
            "text/plain",
            "only GET\n".to_string(),
        ),
    };
    let resp = format!(
        "HTTP/1.1 {code}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(resp.as_bytes()).await?;
    conn.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn get(addr: SocketAddr, req: &str) -> String {
        let mut c = TcpStream::connect(addr).await.unwrap();
        c.write_all(req.as_bytes()).await.unwrap();
        let mut out = String::new();
        c.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn metrics_healthz_and_errors() {
        let l = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = l.local_addr().unwrap();
        let healthy = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let h = healthy.clone();
        let pages = Pages {
            metrics: Arc::new(|| "hna_up 1\n".to_string()),
            health: Arc::new(move || {
                if h.load(std::sync::atomic::Ordering::Relaxed) {
                    Ok(())
                } else {
                    Err("loop x stalled".into())
                }
            }),
            live: Arc::new(|| Ok(())),
        };
        let task = tokio::spawn(serve(l, pages));
        let r = get(addr, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").await;
        assert!(
            r.starts_with("HTTP/1.1 200 OK\r\n") && r.ends_with("\r\n\r\nok\n"),
            "{r}"
        );
        let r = get(addr, "GET /metrics HTTP/1.1\r\n\r\n").await;
        assert!(r.ends_with("\r\n\r\nhna_up 1\n"), "{r}");
        healthy.store(false, std::sync::atomic::Ordering::Relaxed);
        let r = get(addr, "GET /healthz HTTP/1.1\r\n\r\n").await;
        assert!(
            r.starts_with("HTTP/1.1 503") && r.ends_with("unhealthy: loop x stalled\n"),
            "{r}"
        );
        // Liveness is its own verdict: unready is not dead.
        let r = get(addr, "GET /livez HTTP/1.1\r\n\r\n").await;
        assert!(r.starts_with("HTTP/1.1 200 OK\r\n"), "{r}");
        let r = get(addr, "GET /nope HTTP/1.1\r\n\r\n").await;
        assert!(r.starts_with("HTTP/1.1 404"), "{r}");
        let r = get(addr, "POST /metrics HTTP/1.1\r\n\r\n").await;
        assert!(r.starts_with("HTTP/1.1 405"), "{r}");
        task.abort();
    }

    /// Slow clients that never send a request hold at most
    /// [`MAX_CONNECTIONS`] slots; the next is closed at once, and a slot
    /// frees when one of them goes.
    #[tokio::test]
    async fn connections_beyond_the_cap_are_closed_at_once() {
        let l = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = l.local_addr().unwrap();
        let pages = Pages {
            metrics: Arc::new(String::new),
            health: Arc::new(|| Ok(())),
            live: Arc::new(|| Ok(())),
        };
        let task = tokio::spawn(serve(l, pages));
        let mut idle = Vec::new();
        for _ in 0..MAX_CONNECTIONS {
            idle.push(TcpStream::connect(addr).await.unwrap());
        }
        // Handshake: every idle one has been accepted (and holds a slot)
        // once an extra connection is refused; retry until it is.
        let refused = async {
            loop {
                let mut c = TcpStream::connect(addr).await.unwrap();
                let _ = c.write_all(b"GET /livez HTTP/1.1\r\n\r\n").await;
                let mut out = String::new();
                let _ = c.read_to_string(&mut out).await;
                if out.is_empty() {
                    return;
                }
                tokio::task::yield_now().await;
            }
        };
        tokio::time::timeout(Duration::from_secs(5), refused)
            .await
            .expect("a connection beyond the cap was answered");
        drop(idle.pop());
        let answered = async {
            loop {
                let r = get(addr, "GET /livez HTTP/1.1\r\n\r\n").await;
                if r.starts_with("HTTP/1.1 200") {
                    return;
                }
                tokio::task::yield_now().await;
            }
        };
        tokio::time::timeout(Duration::from_secs(5), answered)
            .await
            .expect("no slot freed");
        task.abort();
    }
}
