//! Latency of every request the process's Kubernetes clients send, by verb
//! and outcome: a layer on the client's HTTP stack
//! (the cluster connection builds every client with it), so no
//! call site can forget it.

use std::future::Future;
use std::pin::Pin;
use std::sync::OnceLock;
use std::task::{Context, Poll};
use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;

/// Bounded: six verbs times six outcomes.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(crate) struct ApiRequest {
    /// `GET`, `WATCH` (a GET with `watch=true`), `POST`, `PUT`, `PATCH`,
    /// `DELETE`, or `OTHER`.
    pub(crate) verb: &'static str,
    /// `2xx` … `5xx`, or `error` (no answer: connect, TLS, timeout).
    pub(crate) code: &'static str,
}

pub(crate) type ApiLatency = Family<ApiRequest, Histogram, fn() -> Histogram>;

/// Seconds; a watch's time is until its response head, not its end.
fn buckets() -> Histogram {
    Histogram::new([
        0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    ])
}

/// The process's one family (each component registers it once).
pub(crate) fn api_latency() -> &'static ApiLatency {
    static FAMILY: OnceLock<ApiLatency> = OnceLock::new();
    FAMILY.get_or_init(|| Family::new_with_constructor(buckets as fn() -> Histogram))
}

/// The request's verb label.
pub(crate) fn verb_of(method: &http::Method, query: Option<&str>) -> &'static str {
    let watch = query.is_some_and(|q| q.split('&').any(|kv| kv == "watch=true" || kv == "watch=1"));
    match *method {
        http::Method::GET if watch => "WATCH",
        http::Method::GET => "GET",
        http::Method::POST => "POST",
        http::Method::PUT => "PUT",
        http::Method::PATCH => "PATCH",
        http::Method::DELETE => "DELETE",
        _ => "OTHER",
    }
}

/// The answer's code class label.
pub(crate) fn code_of(status: Option<http::StatusCode>) -> &'static str {
    match status.map(|s| s.as_u16() / 100) {
        Some(1) => "1xx",
        Some(2) => "2xx",
        Some(3) => "3xx",
        Some(4) => "4xx",
        Some(5) => "5xx",
        _ => "error",
    }
}

/// The `tower` layer timing each request into [`api_latency`].
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct TimedLayer;

impl<S> tower::Layer<S> for TimedLayer {
    type Service = Timed<S>;
    fn layer(&self, inner: S) -> Timed<S> {
        Timed { inner }
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Timed<S> {
    inner: S,
}

impl<S, ReqBody, ResBody> tower::Service<http::Request<ReqBody>> for Timed<S>
where
    S: tower::Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<ReqBody>) -> Self::Future {
        let verb = verb_of(req.method(), req.uri().query());
        let start = Instant::now();
        let answer = self.inner.call(req);
        Box::pin(async move {
            let result = answer.await;
            let code = code_of(result.as_ref().ok().map(|r| r.status()));
            api_latency()
                .get_or_create(&ApiRequest { verb, code })
                .observe(start.elapsed().as_secs_f64());
            result
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verbs_and_codes_are_few() {
        assert_eq!(
            verb_of(&http::Method::GET, Some("labelSelector=a&watch=true")),
            "WATCH"
        );
        assert_eq!(verb_of(&http::Method::GET, Some("watch=false")), "GET");
        assert_eq!(verb_of(&http::Method::PATCH, None), "PATCH");
        assert_eq!(verb_of(&http::Method::OPTIONS, None), "OTHER");
        assert_eq!(code_of(Some(http::StatusCode::CONFLICT)), "4xx");
        assert_eq!(code_of(None), "error");
    }

    /// Through a real `tower` stack: each answered request lands in its
    /// verb and code, a failed one under `error`.
    #[tokio::test]
    async fn the_layer_times_answers_and_failures() {
        use tower::{Layer as _, ServiceExt as _};
        let svc = TimedLayer.layer(tower::service_fn(|req: http::Request<()>| async move {
            if req.uri().path() == "/fail" {
                Err("refused")
            } else {
                Ok(http::Response::builder().status(404).body(()).unwrap())
            }
        }));
        let before = |verb, code| {
            api_latency()
                .get_or_create(&ApiRequest { verb, code })
                .count()
        };
        let (ok0, err0) = (before("DELETE", "4xx"), before("DELETE", "error"));
        let req = |path: &str| {
            http::Request::builder()
                .method(http::Method::DELETE)
                .uri(path)
                .body(())
                .unwrap()
        };
        svc.clone().oneshot(req("/api/v1/x")).await.unwrap();
        svc.oneshot(req("/fail")).await.unwrap_err();
        assert_eq!(before("DELETE", "4xx"), ok0 + 1);
        assert_eq!(before("DELETE", "error"), err0 + 1);
    }
}
