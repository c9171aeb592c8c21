//! From a plan's writes to API requests, and carrying them out in order.
//!
//! `requests` is pure: which object, which subresource and which kind of
//! PATCH each write is (Services are only ever PATCHed, never replaced;
//! finalizers are appended and removed by strategic merge, so other
//! controllers' finalizers stay). [`execute`] sends them through
//! [`Requests`] (the API edge, or a recording fake in tests), stops writing
//! the moment leadership lapses, and skips a Service's later writes when
//! an earlier one for it failed (its status before its annotations, its
//! release before its finalizer); a node's spec write then goes without
//! that Service's changes (`Write::without`).

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashSet};

use serde_json::{Value, json};

use crate::reconcile::{Assigned, EventOut, Ingress, Plan, Write};
use hna_contract::node_object::{self, Spec};
use hna_contract::{self, FINALIZER, ServiceKey};

/// The kinds of object the controller writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Kind {
    Service,
    LoadBalancerNode,
    Role,
    RoleBinding,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PatchKind {
    /// `application/merge-patch+json`
    Merge,
    /// `application/strategic-merge-patch+json`
    Strategic,
    /// Server-side apply (force, our field manager).
    Apply,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Verb {
    /// 409 AlreadyExists counts as done.
    Create(Value),
    Patch(PatchKind, Value),
    /// 404 NotFound counts as done.
    Delete,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub(crate) kind: Kind,
    pub(crate) namespace: String,
    pub(crate) name: String,
    pub(crate) subresource: Option<&'static str>,
    pub(crate) verb: Verb,
}

/// Why a request failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct SendError {
    pub(crate) message: String,
    /// The precondition did not hold (409): the object changed since the
    /// plan was decided; the watch brings the change and a new plan. Not a
    /// reason to back off.
    pub(crate) conflict: bool,
}

impl From<&str> for SendError {
    fn from(message: &str) -> SendError {
        SendError {
            message: message.to_string(),
            conflict: false,
        }
    }
}

/// Why an Event was not published.
#[derive(Debug, thiserror::Error)]
pub enum EventError {
    #[error("timed out after {0:?}")]
    TimedOut(std::time::Duration),
    #[error(transparent)]
    Api(#[from] kube::Error),
}

/// The API edge.
pub trait Requests: Sync {
    /// Sends `r`; a `precondition` makes a PATCH fail with a conflict when
    /// the object changed since: a resourceVersion, or for a node object's
    /// spec its generation (`kube_edge::generation_guarded`). Returns that
    /// version after the write, when the answer has one.
    fn send(
        &self,
        r: &Request,
        precondition: Option<&str>,
    ) -> impl Future<Output = Result<Option<String>, SendError>> + Send;
    fn event(&self, e: &EventOut) -> impl Future<Output = Result<(), EventError>> + Send;
}

/// The field manager of our server-side applies.
pub const FIELD_MANAGER: &str = "harvester-node-agent-controller";

fn ingress_json(ingress: &[Ingress]) -> Value {
    if ingress.is_empty() {
        return Value::Null;
    }
    ingress
        .iter()
        .map(|i| {
            let mut entry = json!({
                "ip": i.ip,
                "ports": i.ports.iter().map(|p| json!({"port": p.port, "protocol": p.protocol})).collect::<Vec<_>>(),
            });
            if let Some(mode) = &i.ip_mode {
                entry["ipMode"] = json!(mode);
            }
            entry
        })
        .collect()
}

/// Our condition on a Service, or the directive that removes it.
fn condition_json(ingress: &[Ingress], assigned: Option<&Assigned>) -> Value {
    let Some(a) = assigned else {
        return json!({"type": hna_contract::SERVICE_CONDITION, "$patch": "delete"});
    };
    let at = std::time::UNIX_EPOCH + std::time::Duration::from_secs(a.at.max(0).unsigned_abs());
    json!({
        "type": hna_contract::SERVICE_CONDITION,
        "status": "True",
        "observedGeneration": a.generation,
        "lastTransitionTime": humantime::format_rfc3339_seconds(at).to_string(),
        "reason": "AddressAssigned",
        "message": format!(
            "{} published by harvester-node-agent",
            ingress.first().map_or("", |i| i.ip.as_str())
        ),
    })
}

fn service(key: &ServiceKey, subresource: Option<&'static str>, verb: Verb) -> Request {
    Request {
        kind: Kind::Service,
        namespace: key.namespace.clone(),
        name: key.name.clone(),
        subresource,
        verb,
    }
}

/// The Role that lets `system:node:<node>` read its own object and write
/// its status, and read the LAN membership's key, and nothing else; and
/// the RoleBinding granting it.
pub(crate) fn node_access(namespace: &str, node: &str) -> [Request; 2] {
    let name = node_object::role_name(node);
    let labels = json!({"app.kubernetes.io/managed-by": FIELD_MANAGER});
    let role = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "rules": [
            {
                "apiGroups": [node_object::GROUP],
                "resources": [node_object::PLURAL],
                "resourceNames": [node],
                "verbs": ["get", "list", "watch"],
            },
            {
                "apiGroups": [node_object::GROUP],
                "resources": [format!("{}/status", node_object::PLURAL)],
                "resourceNames": [node],
                "verbs": ["get", "update", "patch"],
            },
            {
                "apiGroups": [""],
                "resources": ["secrets"],
                "resourceNames": [hna_contract::membership::SECRET_NAME],
                "verbs": ["get", "list", "watch"],
            },
        ],
    });
    let binding = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{
            "kind": "User",
            "apiGroup": "rbac.authorization.k8s.io",
            "name": node_object::node_user(node),
        }],
    });
    let req = |kind, body| Request {
        kind,
        namespace: namespace.to_string(),
        name: name.clone(),
        subresource: None,
        verb: Verb::Patch(PatchKind::Apply, body),
    };
    [req(Kind::Role, role), req(Kind::RoleBinding, binding)]
}

fn node_object_body(namespace: &str, node: &str, spec: &Spec) -> Value {
    json!({
        "apiVersion": format!("{}/{}", node_object::GROUP, node_object::VERSION),
        "kind": node_object::KIND,
        "metadata": {
            "name": node,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/managed-by": FIELD_MANAGER},
        },
        "spec": spec,
    })
}

/// The requests that carry out `w`, in order.
pub(crate) fn requests(namespace: &str, w: &Write) -> Vec<Request> {
    let node_req = |kind, name: &str, subresource, verb| Request {
        kind,
        namespace: namespace.to_string(),
        name: name.to_string(),
        subresource,
        verb,
    };
    match w {
        Write::AddFinalizer(key) => vec![service(
            key,
            None,
            // `finalizers` merges by value: this appends.
            Verb::Patch(
                PatchKind::Strategic,
                json!({"metadata": {"finalizers": [FINALIZER]}}),
            ),
        )],
        Write::RemoveFinalizer(key) => vec![service(
            key,
            None,
            Verb::Patch(
                PatchKind::Strategic,
                json!({"metadata": {"$deleteFromPrimitiveList/finalizers": [FINALIZER]}}),
            ),
        )],
        Write::ServiceStatus {
            service: key,
            ingress,
            assigned,
        } => vec![service(
            key,
            Some("status"),
            Verb::Patch(
                PatchKind::Strategic,
                json!({"status": {
                    "loadBalancer": {"ingress": ingress_json(ingress)},
                    // A list merged by `type`: others' conditions stay.
                    "conditions": [condition_json(ingress, assigned.as_ref())],
                }}),
            ),
        )],
        Write::ServiceAnnotations { service: key, set } => vec![service(
            key,
            None,
            Verb::Patch(PatchKind::Merge, json!({"metadata": {"annotations": set}})),
        )],
        Write::CreateNodeObject(node) => vec![node_req(
            Kind::LoadBalancerNode,
            node,
            None,
            Verb::Create(node_object_body(namespace, node, &Spec::default())),
        )],
        Write::EnsureNodeAccess(node) => node_access(namespace, node).into(),
        Write::SetSpec { node, spec, .. } => vec![node_req(
            Kind::LoadBalancerNode,
            node,
            None,
            Verb::Patch(
                PatchKind::Merge,
                json!({"spec": {"assignments": spec.assignments}}),
            ),
        )],
        Write::SetPeers { node, peers } => vec![node_req(
            Kind::LoadBalancerNode,
            node,
            None,
            Verb::Patch(PatchKind::Merge, json!({"spec": {"peers": peers}})),
        )],
        Write::DeleteNodeObject(node) => {
            let role = node_object::role_name(node);
            vec![
                node_req(Kind::RoleBinding, &role, None, Verb::Delete),
                node_req(Kind::Role, &role, None, Verb::Delete),
                node_req(Kind::LoadBalancerNode, node, None, Verb::Delete),
            ]
        }
    }
}

/// Identifies what a write changes, for [`WriteMemo`].
pub(crate) fn target(w: &Write) -> String {
    match w {
        Write::AddFinalizer(k) | Write::RemoveFinalizer(k) => format!("service/{k}"),
        Write::ServiceAnnotations { service, .. } => format!("service/{service}"),
        Write::ServiceStatus { service, .. } => format!("service/{service}"),
        Write::CreateNodeObject(n)
        | Write::EnsureNodeAccess(n)
        | Write::SetSpec { node: n, .. }
        | Write::SetPeers { node: n, .. }
        | Write::DeleteNodeObject(n) => format!("node/{n}"),
    }
}

/// Writes made and not yet seen in the watch caches: a reconcile that
/// runs before the watch event of its last write arrives would otherwise
/// send the same write again. An entry holds only while the target's
/// resourceVersion is the one the write was decided on; any change to the
/// object (ours arriving, or someone else's) makes the write count again.
#[derive(Debug, Default)]
pub(crate) struct WriteMemo {
    sent: BTreeMap<String, (String, String)>,
}

impl WriteMemo {
    fn key(w: &Write) -> (String, String) {
        (target(w), format!("{w:?}"))
    }

    /// Whether `w` was sent while the target was at `version`.
    pub(crate) fn already_sent(&self, w: &Write, version: &str) -> bool {
        let (t, payload) = Self::key(w);
        self.sent
            .get(&format!("{t}#{payload}"))
            .is_some_and(|(v, _)| v == version)
    }

    pub(crate) fn record(&mut self, w: &Write, version: &str) {
        let (t, payload) = Self::key(w);
        self.sent
            .insert(format!("{t}#{payload}"), (version.to_string(), t));
    }

    /// Forgets entries whose target is at another version now.
    pub(crate) fn prune(&mut self, version_of: impl Fn(&str) -> Option<String>) {
        self.sent
            .retain(|_, (v, t)| version_of(t).as_deref() == Some(v.as_str()));
    }

    pub(crate) fn clear(&mut self) {
        self.sent.clear();
    }
}

/// Per object, the writes that failed: each object waits out its own
/// backoff (exponential from [`WriteBackoff::FIRST`] to
/// [`WriteBackoff::MAX`], with ±25 % jitter so that retries after an
/// outage do not go out in lockstep), while writes to other objects and
/// the judging of liveness go on. A validating webhook that is down with
/// `failurePolicy: Fail`, or a policy that refuses one node's Role, stops
/// the writes it refuses and nothing else (issue #29).
#[derive(Debug, Default)]
pub(crate) struct WriteBackoff {
    /// Target (as [`target`] names it): failures in a row, and when the
    /// next write to it may go.
    failing: BTreeMap<String, (u32, tokio::time::Instant)>,
}

impl WriteBackoff {
    pub(crate) const FIRST: std::time::Duration = std::time::Duration::from_secs(1);
    pub(crate) const MAX: std::time::Duration = std::time::Duration::from_secs(30);

    /// At most this many writes that failed before are tried again in one
    /// pass: with a webhook refusing every Service write, thousands of
    /// waiting objects must not become hundreds of refused requests a
    /// second. Writes that never failed (a failover's) are not counted.
    pub(crate) const RETRIES_PER_PASS: usize = 16;

    /// Whether a write to `target` may go at `now`.
    pub(crate) fn ready(&self, target: &str, now: tokio::time::Instant) -> bool {
        self.failing.get(target).is_none_or(|(_, at)| *at <= now)
    }

    /// Whether a write to `target` failed before (and has not gone
    /// through since).
    pub(crate) fn is_retry(&self, target: &str) -> bool {
        self.failing.contains_key(target)
    }

    /// A write to `target` failed at `now`: the wait doubles, jittered.
    pub(crate) fn failed(&mut self, target: &str, now: tokio::time::Instant) {
        let n = self.failing.get(target).map_or(0, |(n, _)| *n);
        let base = Self::FIRST.saturating_mul(1u32 << n.min(16)).min(Self::MAX);
        let jitter = base.mul_f64(0.75 + fastrand::f64() * 0.5);
        self.failing
            .insert(target.to_string(), (n.saturating_add(1), now + jitter));
    }

    /// A write to `target` went through: no more waiting.
    pub(crate) fn succeeded(&mut self, target: &str) {
        self.failing.remove(target);
    }

    /// When the earliest waiting write may go: when to decide again.
    pub(crate) fn next_retry(&self, now: tokio::time::Instant) -> Option<tokio::time::Instant> {
        self.failing
            .values()
            .map(|(_, at)| *at)
            .filter(|at| *at > now)
            .min()
    }

    /// How many objects wait.
    pub(crate) fn waiting(&self) -> usize {
        self.failing.len()
    }

    pub(crate) fn clear(&mut self) {
        self.failing.clear();
    }
}

/// Events already published in this leader term: an Event says what
/// changed, so the same (object, reason, message) is told once.
#[derive(Debug, Default)]
pub(crate) struct EventMemo {
    seen: HashSet<(ServiceKey, String, &'static str, String)>,
}

impl EventMemo {
    /// True the first time (and records it).
    pub(crate) fn first_time(&mut self, e: &EventOut) -> bool {
        self.seen.insert((
            e.service.clone(),
            e.uid.clone(),
            e.reason,
            e.message.clone(),
        ))
    }

    /// Forgets the Services that are gone.
    pub(crate) fn retain(&mut self, exists: impl Fn(&ServiceKey, &str) -> bool) {
        self.seen.retain(|(k, uid, _, _)| exists(k, uid));
    }

    pub(crate) fn clear(&mut self) {
        self.seen.clear();
    }
}

/// What [`execute`] did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Successful writes by [`Write::kind`].
    pub(crate) writes: BTreeMap<&'static str, u64>,
    /// Events published.
    pub(crate) published: Vec<EventOut>,
    /// Failures, in words.
    pub errors: Vec<String>,
    /// Writes skipped: an earlier write for the same Service failed.
    pub(crate) skipped: u64,
    /// Writes held back: their object waits out its [`WriteBackoff`].
    pub(crate) deferred: u64,
    /// Leadership lapsed before everything was written.
    pub(crate) stopped: bool,
    /// Writes refused because their object changed since the plan (a
    /// precondition); the next plan redoes them. Not in `errors`.
    pub conflicts: u64,
    /// The nodes whose Role and RoleBinding were applied.
    pub(crate) access_ensured: BTreeSet<String>,
}

/// What [`execute`] keeps between passes.
#[derive(Debug, Default)]
pub struct Memory {
    pub(crate) writes: WriteMemo,
    pub(crate) events: EventMemo,
    pub(crate) backoff: WriteBackoff,
}

impl Memory {
    /// A new leader term: what was sent or told before may have been
    /// undone by another leader since.
    pub(crate) fn clear(&mut self) {
        self.writes.clear();
        self.events.clear();
        self.backoff.clear();
    }
}

/// At most this many writes (and, after them, Events) in flight at once.
/// One after another, a failover of 200 Services spent seconds on their
/// record annotations and Events, during which no other pass ran (issue
/// #30); all at once, it would be a burst the API server's fairness queues
/// shed.
pub(crate) const WRITES_IN_FLIGHT: usize = 8;

/// How one write went.
enum Sent {
    /// Every request landed; the object's version after the last guarded
    /// one, if any.
    Done(Option<String>),
    /// A request failed (its namespace/name, the error).
    Failed(String, SendError),
    /// Leadership lapsed before a request.
    Stopped,
}

/// One write's requests, in order, each asked of `leading` first; `known`:
/// the object's version to carry as the first precondition.
async fn send_write<R: Requests>(
    namespace: &str,
    w: &Write,
    mut known: String,
    api: &R,
    leading: &(dyn Fn() -> bool + Sync),
) -> Sent {
    let mut after = None;
    for r in requests(namespace, w) {
        if !leading() {
            return Sent::Stopped;
        }
        let guarded = matches!(
            r.verb,
            Verb::Patch(PatchKind::Merge | PatchKind::Strategic, _)
        );
        let precondition = Some(known.clone()).filter(|v| guarded && !v.is_empty());
        match api.send(&r, precondition.as_deref()).await {
            Ok(Some(v)) if guarded => {
                known.clone_from(&v);
                after = Some(v);
            }
            Ok(_) => {}
            Err(e) => return Sent::Failed(format!("{}/{}", r.namespace, r.name), e),
        }
    }
    Sent::Done(after)
}

/// One Event, unless leadership lapsed (`None`).
async fn tell<R: Requests>(
    e: &EventOut,
    api: &R,
    leading: &(dyn Fn() -> bool + Sync),
) -> Option<Result<(), EventError>> {
    if !leading() {
        return None;
    }
    Some(api.event(e).await)
}

/// Carries out `plan` in order. `leading` is asked before every request:
/// a leader that lost its Lease stops. `version_of(target)` is the
/// resourceVersion the plan was decided on (for the `WriteMemo`). A write
/// whose object waits out its `WriteBackoff` is held back (with the
/// later writes of its Services), the others go.
///
/// The plan's order is kept between kinds of write (a finalizer before an
/// assignment, a status before its annotations): the writes of one kind
/// that follow each other, each to an object of its own, go out together,
/// `WRITES_IN_FLIGHT` at a time, and the next kind waits for them all.
/// The Events go out the same way, last.
pub async fn execute<R: Requests>(
    namespace: &str,
    plan: &Plan,
    api: &R,
    leading: &(dyn Fn() -> bool + Sync),
    memory: &mut Memory,
    version_of: &(dyn Fn(&str) -> Option<String> + Sync),
) -> Outcome {
    let mut progress = Progress::default();
    let mut next = 0;
    while next < plan.writes.len() {
        let wave = wave_at(&plan.writes[next..]);
        next += wave.len();
        let kind = wave[0].kind();
        let go = progress.choose(wave, memory, version_of);
        let results = send_wave(namespace, kind, &go, &progress.versions, api, leading).await;
        progress.record(go, results, memory);
        if progress.out.stopped {
            return progress.out;
        }
    }
    tell_events(
        &plan.events,
        &mut memory.events,
        api,
        leading,
        &mut progress.out,
    )
    .await;
    progress.out
}

/// A write that goes: the write (without the changes of Services whose
/// earlier writes failed), its target, and the version it was decided on.
type Going<'w> = (Cow<'w, Write>, String, String);

/// What [`execute`] keeps from one wave to the next.
#[derive(Default)]
struct Progress {
    out: Outcome,
    /// Services whose later writes are skipped: one of theirs failed or
    /// was held back.
    failed: BTreeSet<ServiceKey>,
    /// Each object's resourceVersion as this plan knows it: the one it was
    /// decided on, then the one each of our writes left. Every PATCH of a
    /// Service or a node object carries it as a precondition, so a write
    /// that a deposed leader sent (and the server handled late) cannot land
    /// over what the new leader wrote since: it fails with a conflict.
    versions: BTreeMap<String, String>,
    /// Writes that failed before and are tried again in this pass.
    retries: usize,
}

impl Progress {
    /// Which of `wave` go, decided in order: not those of a Service whose
    /// earlier write failed, those whose object waits out its backoff, or
    /// those sent at this version before.
    fn choose<'w>(
        &mut self,
        wave: &'w [Write],
        memory: &Memory,
        version_of: &(dyn Fn(&str) -> Option<String> + Sync),
    ) -> Vec<Going<'w>> {
        let mut go = Vec::new();
        for w in wave {
            let kind = w.kind();
            let Some(w) = w.without(&self.failed) else {
                self.out.skipped += 1;
                continue;
            };
            let object = target(&w);
            let retry = memory.backoff.is_retry(&object);
            if !memory.backoff.ready(&object, tokio::time::Instant::now())
                || (retry && self.retries >= WriteBackoff::RETRIES_PER_PASS)
            {
                tracing::debug!(
                    kind,
                    object,
                    "write held back: its object waits out a failure"
                );
                self.out.deferred += 1;
                self.failed.extend(w.services().into_iter().cloned());
                continue;
            }
            if retry {
                self.retries += 1;
            }
            let version = version_of(&object).unwrap_or_default();
            if memory.writes.already_sent(&w, &version) {
                tracing::debug!(
                    kind,
                    object,
                    version,
                    "write not sent again: sent at this version before"
                );
                continue;
            }
            go.push((w, object, version));
        }
        go
    }

    /// How each write of a wave went, into the outcome and the memory.
    fn record(&mut self, go: Vec<Going<'_>>, results: Vec<Sent>, memory: &mut Memory) {
        for ((w, object, version), result) in go.into_iter().zip(results) {
            match result {
                Sent::Done(after) => {
                    if let Some(v) = after {
                        self.versions.insert(object.clone(), v);
                    }
                    memory.backoff.succeeded(&object);
                    memory.writes.record(&w, &version);
                    *self.out.writes.entry(w.kind()).or_default() += 1;
                    if let Write::EnsureNodeAccess(n) = &*w {
                        self.out.access_ensured.insert(n.clone());
                    }
                }
                Sent::Failed(what, e) => {
                    if e.conflict {
                        self.out.conflicts += 1;
                    } else {
                        memory.backoff.failed(&object, tokio::time::Instant::now());
                        self.out.errors.push(format!("{} {what}: {e}", w.kind()));
                    }
                    self.failed.extend(w.services().into_iter().cloned());
                }
                Sent::Stopped => self.out.stopped = true,
            }
        }
    }
}

/// The writes at the start of `writes` that go out together: of one kind,
/// each to an object of its own.
fn wave_at(writes: &[Write]) -> &[Write] {
    let kind = writes[0].kind();
    let mut objects = HashSet::new();
    let end = writes
        .iter()
        .position(|w| w.kind() != kind || !objects.insert(target(w)))
        .unwrap_or(writes.len());
    &writes[..end]
}

/// Sends the writes of a wave of `kind`, [`WRITES_IN_FLIGHT`] at a time;
/// their results in their order.
async fn send_wave<R: Requests>(
    namespace: &str,
    kind: &'static str,
    go: &[Going<'_>],
    versions: &BTreeMap<String, String>,
    api: &R,
    leading: &(dyn Fn() -> bool + Sync),
) -> Vec<Sent> {
    use futures::StreamExt as _;
    // Futures made up front, not in a stream's closure: a borrowing
    // closure's future is not `Send` for every lifetime.
    let sending: Vec<_> = go
        .iter()
        .map(|(w, object, version)| {
            let known = versions
                .get(object)
                .cloned()
                .unwrap_or_else(|| version.clone());
            send_write(namespace, w, known, api, leading)
        })
        .collect();
    let began = tokio::time::Instant::now();
    let results: Vec<Sent> = futures::stream::iter(sending)
        .buffered(WRITES_IN_FLIGHT)
        .collect()
        .await;
    tracing::debug!(
        kind,
        n = results.len(),
        to = ?go.iter().map(|(_, o, _)| o.as_str()).collect::<Vec<_>>(),
        took = ?began.elapsed(),
        "writes sent"
    );
    results
}

/// The Events not told before in this term, [`WRITES_IN_FLIGHT`] at a
/// time, into `out`.
async fn tell_events<R: Requests>(
    planned: &[EventOut],
    memo: &mut EventMemo,
    api: &R,
    leading: &(dyn Fn() -> bool + Sync),
    out: &mut Outcome,
) {
    use futures::StreamExt as _;
    let to_tell: Vec<&EventOut> = planned.iter().filter(|e| memo.first_time(e)).collect();
    let telling: Vec<_> = to_tell.iter().map(|e| tell(e, api, leading)).collect();
    let results: Vec<Option<Result<(), EventError>>> = futures::stream::iter(telling)
        .buffered(WRITES_IN_FLIGHT)
        .collect()
        .await;
    for (e, result) in to_tell.into_iter().zip(results) {
        match result {
            None => out.stopped = true,
            Some(Ok(())) => out.published.push(e.clone()),
            Some(Err(err)) => out
                .errors
                .push(format!("event {} on {}: {err}", e.reason, e.service)),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use tokio::time::Instant;

    use super::*;
    use crate::reconcile::{EventType, Port};

    #[derive(Default)]
    struct Recording {
        sent: Mutex<Vec<Request>>,
        preconditions: Mutex<Vec<Option<String>>>,
        events: Mutex<Vec<EventOut>>,
        fail: Mutex<Option<(Kind, Option<&'static str>)>>,
        /// Refuses every write to the object of this name (a webhook
        /// scoped to one Service).
        refuse: Mutex<Option<&'static str>>,
    }

    impl Requests for Recording {
        async fn send(
            &self,
            r: &Request,
            precondition: Option<&str>,
        ) -> Result<Option<String>, SendError> {
            if *self.fail.lock().unwrap() == Some((r.kind, r.subresource))
                || *self.refuse.lock().unwrap() == Some(r.name.as_str())
            {
                return Err("injected".into());
            }
            let mut sent = self.sent.lock().unwrap();
            sent.push(r.clone());
            self.preconditions
                .lock()
                .unwrap()
                .push(precondition.map(str::to_string));
            // As the server does: every write makes a new version.
            Ok(Some(format!("after-{}", sent.len())))
        }
        async fn event(&self, e: &EventOut) -> Result<(), EventError> {
            self.events.lock().unwrap().push(e.clone());
            Ok(())
        }
    }

    fn key(name: &str) -> ServiceKey {
        ServiceKey {
            namespace: "default".into(),
            name: name.into(),
        }
    }

    fn served(name: &str) -> Plan {
        let k = key(name);
        Plan {
            writes: vec![
                Write::ServiceStatus {
                    service: k.clone(),
                    ingress: vec![Ingress {
                        ip: "10.77.0.150".into(),
                        ip_mode: Some("VIP".into()),
                        ports: vec![Port {
                            port: 80,
                            protocol: "TCP".into(),
                        }],
                    }],
                    assigned: Some(Assigned {
                        generation: 1,
                        at: 1_800_000_000,
                    }),
                },
                Write::ServiceAnnotations {
                    service: k.clone(),
                    set: [("kube-vip.io/vipHost".to_string(), Some("n1".to_string()))].into(),
                },
                Write::RemoveFinalizer(k.clone()),
            ],
            events: vec![EventOut {
                service: k,
                uid: "u".into(),
                type_: EventType::Normal,
                reason: "AddressAssigned",
                message: "10.77.0.150 held by n1".into(),
            }],
            summary: Default::default(),
        }
    }

    async fn run(api: &Recording, plan: &Plan, memory: &mut Memory) -> Outcome {
        execute("hna", plan, api, &|| true, memory, &|_| Some("1".into())).await
    }

    #[tokio::test]
    async fn status_then_annotations_all_by_patch() {
        let api = Recording::default();
        let mut memory = Memory::default();
        let out = run(&api, &served("web"), &mut memory).await;
        assert!(out.errors.is_empty(), "{out:?}");
        let sent = api.sent.lock().unwrap().clone();
        assert_eq!(sent.len(), 3);
        assert_eq!(
            (sent[0].kind, sent[0].subresource),
            (Kind::Service, Some("status"))
        );
        // Its body: `node_access_is_limited_to_the_nodes_own_object` below.
        assert_eq!(
            sent[0].verb,
            requests("hna", &served("web").writes[0])[0].verb
        );
        assert_eq!(sent[1].subresource, None);
        assert_eq!(
            sent[1].verb,
            Verb::Patch(
                PatchKind::Merge,
                json!({"metadata": {"annotations": {"kube-vip.io/vipHost": "n1"}}})
            )
        );
        assert_eq!(
            sent[2].verb,
            Verb::Patch(
                PatchKind::Strategic,
                json!({"metadata": {"$deleteFromPrimitiveList/finalizers": [FINALIZER]}})
            )
        );
        for r in &sent {
            assert!(
                !matches!(r.verb, Verb::Create(_) | Verb::Delete),
                "a Service is only patched: {r:?}"
            );
        }
        assert_eq!(api.events.lock().unwrap().len(), 1);
    }

    #[tokio::test]
    async fn a_failed_status_holds_back_that_services_annotations() {
        let api = Recording::default();
        *api.fail.lock().unwrap() = Some((Kind::Service, Some("status")));
        let mut memory = Memory::default();
        let out = run(&api, &served("web"), &mut memory).await;
        assert_eq!(out.errors.len(), 1, "{out:?}");
        assert_eq!(out.skipped, 2, "annotations and finalizer wait");
        assert!(api.sent.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn writes_not_yet_seen_and_events_told_are_not_repeated() {
        let api = Recording::default();
        let mut memory = Memory::default();
        let plan = served("web");
        run(&api, &plan, &mut memory).await;
        let out = run(&api, &plan, &mut memory).await;
        assert_eq!(out, Outcome::default(), "same versions: nothing again");
        assert_eq!(api.sent.lock().unwrap().len(), 3);
        assert_eq!(api.events.lock().unwrap().len(), 1);
        // The object changed since: the write counts again, the Event not.
        memory.writes.prune(|_| Some("2".into()));
        let out = execute("hna", &plan, &api, &|| true, &mut memory, &|_| {
            Some("2".into())
        })
        .await;
        assert_eq!(out.writes.values().sum::<u64>(), 3);
        assert_eq!(api.events.lock().unwrap().len(), 1);
    }

    /// Issue #22: every PATCH of a Service carries the resourceVersion the
    /// plan was decided on, then the one the previous write left.
    #[tokio::test]
    async fn service_patches_carry_the_version_as_a_precondition() {
        let api = Recording::default();
        let mut memory = Memory::default();
        let out = execute("hna", &served("web"), &api, &|| true, &mut memory, &|t| {
            (t == "service/default/web").then(|| "41".to_string())
        })
        .await;
        assert!(out.errors.is_empty(), "{:?}", out.errors);
        let sent = api.sent.lock().unwrap();
        let pre = api.preconditions.lock().unwrap();
        assert!(sent.len() >= 2, "{sent:?}");
        assert_eq!(pre[0].as_deref(), Some("41"));
        for i in 1..sent.len() {
            if sent[i].kind == Kind::Service {
                assert_eq!(
                    pre[i].as_deref(),
                    Some(format!("after-{i}").as_str()),
                    "request {i}: {:?}",
                    sent[i]
                );
            }
        }
    }

    /// Issue #29: a failing write backs off its own object only: another
    /// Service's writes go out in the same pass, and the failing one is
    /// retried once its (jittered) wait is over, not before.
    #[tokio::test(start_paused = true)]
    async fn a_failing_write_backs_off_its_own_object_only() {
        struct FailsFor(Recording, &'static str);
        impl Requests for FailsFor {
            async fn send(
                &self,
                r: &Request,
                p: Option<&str>,
            ) -> Result<Option<String>, SendError> {
                if r.name == self.1 {
                    return Err("webhook: connection refused".into());
                }
                self.0.send(r, p).await
            }
            async fn event(&self, e: &EventOut) -> Result<(), EventError> {
                self.0.event(e).await
            }
        }
        let api = FailsFor(Recording::default(), "web");
        let mut plan = served("web");
        plan.writes.extend(served("db").writes);
        let mut memory = Memory::default();
        async fn pass(api: &FailsFor, plan: &Plan, memory: &mut Memory) -> Outcome {
            execute("hna", plan, api, &|| true, memory, &|_| Some("1".into())).await
        }
        let out = pass(&api, &plan, &mut memory).await;
        assert_eq!((out.errors.len(), out.skipped), (1, 2), "{out:?}");
        assert_eq!(out.writes.values().sum::<u64>(), 3, "db's writes went out");
        let retry = memory.backoff.next_retry(Instant::now()).unwrap();
        let wait = retry - Instant::now();
        assert!(
            wait >= WriteBackoff::FIRST.mul_f64(0.75) && wait <= WriteBackoff::FIRST.mul_f64(1.25),
            "{wait:?}"
        );
        // Before its time: held back, not sent.
        let out = pass(&api, &plan, &mut memory).await;
        assert_eq!((out.errors.len(), out.deferred), (0, 1), "{out:?}");
        // After it: sent again, failing again, and the wait doubles.
        tokio::time::sleep_until(retry).await;
        let out = pass(&api, &plan, &mut memory).await;
        assert_eq!(out.errors.len(), 1, "{out:?}");
        let wait = memory.backoff.next_retry(Instant::now()).unwrap() - Instant::now();
        assert!(wait >= WriteBackoff::FIRST.mul_f64(1.5), "{wait:?}");
        // Never longer than the bound, however often it fails.
        for _ in 0..10 {
            memory.backoff.failed("service/default/web", Instant::now());
        }
        let wait = memory.backoff.next_retry(Instant::now()).unwrap() - Instant::now();
        assert!(wait <= WriteBackoff::MAX.mul_f64(1.25), "{wait:?}");
        // A success ends the waiting.
        memory.backoff.succeeded("service/default/web");
        assert_eq!(memory.backoff.waiting(), 0);
    }

    fn assignment(service: &str) -> node_object::Assignment {
        node_object::Assignment {
            service: format!("default/{service}"),
            uid: format!("uid-{service}"),
            interface: format!("hlb-{service}"),
            mac: "02:00:00:00:00:01".into(),
            ..Default::default()
        }
    }

    fn assignments(spec: &[Request]) -> Vec<String> {
        spec.iter()
            .filter(|r| r.kind == Kind::LoadBalancerNode)
            .flat_map(|r| {
                let Verb::Patch(_, body) = &r.verb else {
                    panic!("{r:?}")
                };
                body["spec"]["assignments"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|a| a["service"].as_str().unwrap().to_string())
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// Issue #29: a new Service (`late`) is placed on n2 in the same pass
    /// as `web`, whose holder died, moves there. A webhook refuses every
    /// write of `late`, its finalizer first: n2's spec still takes `web`
    /// (and keeps what it had), and only `late`'s later writes wait.
    #[tokio::test]
    async fn a_refused_new_service_does_not_hold_back_a_failover_to_the_same_node() {
        let api = Recording::default();
        *api.refuse.lock().unwrap() = Some("late");
        let mut plan = Plan {
            writes: vec![
                Write::AddFinalizer(key("late")),
                Write::SetSpec {
                    node: "n2".into(),
                    spec: Spec {
                        assignments: vec![
                            assignment("kept"),
                            assignment("late"),
                            assignment("web"),
                        ],
                        ..Spec::default()
                    },
                    services: vec![key("late"), key("web")],
                    before: vec![assignment("kept")],
                },
            ],
            ..Plan::default()
        };
        plan.writes.extend(served("web").writes);
        plan.writes.extend(served("late").writes);
        let mut memory = Memory::default();
        let out = run(&api, &plan, &mut memory).await;
        assert_eq!(out.errors.len(), 1, "late's finalizer only: {out:?}");
        let sent = api.sent.lock().unwrap().clone();
        assert_eq!(
            assignments(&sent),
            ["default/kept", "default/web"],
            "web moved to n2 without late: {sent:?}"
        );
        assert!(
            sent.iter()
                .any(|r| r.name == "web" && r.subresource == Some("status")),
            "web's status followed its holder: {sent:?}"
        );
        assert!(
            sent.iter().all(|r| r.name != "late"),
            "late's writes after its finalizer waited: {sent:?}"
        );
        assert_eq!(out.skipped, 3, "late's status, annotations, finalizer");
    }

    /// A Service held back whose only change on a node was being placed
    /// there: nothing is left to write to that node.
    #[tokio::test]
    async fn a_spec_write_with_only_a_held_back_service_is_not_sent() {
        let api = Recording::default();
        *api.refuse.lock().unwrap() = Some("late");
        let plan = Plan {
            writes: vec![
                Write::AddFinalizer(key("late")),
                Write::SetSpec {
                    node: "n2".into(),
                    spec: Spec {
                        assignments: vec![assignment("kept"), assignment("late")],
                        ..Spec::default()
                    },
                    services: vec![key("late")],
                    before: vec![assignment("kept")],
                },
            ],
            ..Plan::default()
        };
        let out = run(&api, &plan, &mut Memory::default()).await;
        assert_eq!((out.errors.len(), out.skipped), (1, 1), "{out:?}");
        assert!(api.sent.lock().unwrap().is_empty());
    }

    /// Issue #29: however many objects wait, a pass tries only
    /// `RETRIES_PER_PASS` of them again; writes that never failed all go.
    #[tokio::test(start_paused = true)]
    async fn retries_per_pass_are_bounded_and_fresh_writes_are_not() {
        let api = Recording::default();
        *api.fail.lock().unwrap() = Some((Kind::Service, Some("status")));
        let mut plan = Plan::default();
        for i in 0..40 {
            plan.writes.extend(served(&format!("svc{i}")).writes);
        }
        let mut memory = Memory::default();
        let out = execute("hna", &plan, &api, &|| true, &mut memory, &|_| {
            Some("1".into())
        })
        .await;
        assert_eq!(out.errors.len(), 40, "every first try goes out");
        tokio::time::advance(WriteBackoff::MAX * 2).await;
        // Another Service's writes, never failed, beside the 40 waiting.
        plan.writes.extend(served("fresh").writes);
        *api.fail.lock().unwrap() = None;
        let out = execute("hna", &plan, &api, &|| true, &mut memory, &|_| {
            Some("1".into())
        })
        .await;
        let statuses = api
            .sent
            .lock()
            .unwrap()
            .iter()
            .filter(|r| r.subresource == Some("status"))
            .count();
        assert_eq!(
            statuses,
            WriteBackoff::RETRIES_PER_PASS + 1,
            "retried {statuses} statuses: {out:?}"
        );
        assert_eq!(out.deferred, (40 - WriteBackoff::RETRIES_PER_PASS) as u64);
        assert!(
            api.sent.lock().unwrap().iter().any(|r| r.name == "fresh"),
            "the fresh write went out"
        );
    }

    /// Takes 100 ms per request and records when each ran.
    #[derive(Default)]
    struct Slow {
        ran: Mutex<Vec<(&'static str, Instant, Instant)>>,
        in_flight: std::sync::atomic::AtomicUsize,
        most: std::sync::atomic::AtomicUsize,
    }

    impl Requests for Slow {
        async fn send(
            &self,
            r: &Request,
            _precondition: Option<&str>,
        ) -> Result<Option<String>, SendError> {
            let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            self.most.fetch_max(now, Ordering::SeqCst);
            let began = Instant::now();
            tokio::time::sleep(Duration::from_millis(100)).await;
            self.in_flight.fetch_sub(1, Ordering::SeqCst);
            let kind = if r.subresource == Some("status") {
                "status"
            } else {
                "annotations"
            };
            self.ran.lock().unwrap().push((kind, began, Instant::now()));
            Ok(Some("2".into()))
        }
        async fn event(&self, _e: &EventOut) -> Result<(), EventError> {
            tokio::time::sleep(Duration::from_millis(100)).await;
            Ok(())
        }
    }

    /// Issue #30: a failover's 40 writes (a status and the record
    /// annotations of 20 Services) and 20 Events go out
    /// `WRITES_IN_FLIGHT` at a time, not one after another (6 s at 100 ms
    /// each), and never out of their order: every status has landed
    /// before the first annotation goes.
    #[tokio::test(start_paused = true)]
    async fn a_failovers_writes_go_out_together_in_their_order() {
        let mut plan = Plan::default();
        let mut annotations = Vec::new();
        for i in 0..20 {
            let p = served(&format!("s{i:02}"));
            plan.writes.push(p.writes[0].clone());
            annotations.push(p.writes[1].clone());
            plan.events.extend(p.events.into_iter().map(|mut e| {
                e.message = format!("{} ({i})", e.message);
                e
            }));
        }
        plan.writes.extend(annotations);
        let api = Slow::default();
        let t0 = Instant::now();
        let out = execute(
            "hna",
            &plan,
            &api,
            &|| true,
            &mut Memory::default(),
            &|_| Some("1".into()),
        )
        .await;
        let took = t0.elapsed();
        assert_eq!(out.writes.values().sum::<u64>(), 40, "{out:?}");
        assert_eq!(out.published.len(), 20);
        assert!(out.errors.is_empty(), "{:?}", out.errors);
        // 3 rounds of 8 per kind, and for the Events: 900 ms.
        assert_eq!(took, Duration::from_millis(900), "{took:?}");
        assert_eq!(api.most.load(Ordering::SeqCst), WRITES_IN_FLIGHT);
        let ran = api.ran.lock().unwrap();
        let last_status = ran.iter().filter(|r| r.0 == "status").map(|r| r.2).max();
        let first_annotation = ran
            .iter()
            .filter(|r| r.0 == "annotations")
            .map(|r| r.1)
            .min();
        assert!(last_status <= first_annotation, "{ran:?}");
    }

    #[tokio::test]
    async fn a_lapsed_leader_stops_at_once() {
        let api = Recording::default();
        let leading = AtomicBool::new(true);
        struct Lapsing<'a>(&'a Recording, &'a AtomicBool);
        impl Requests for Lapsing<'_> {
            async fn send(
                &self,
                r: &Request,
                p: Option<&str>,
            ) -> Result<Option<String>, SendError> {
                self.1.store(false, Ordering::SeqCst);
                self.0.send(r, p).await
            }
            async fn event(&self, e: &EventOut) -> Result<(), EventError> {
                self.0.event(e).await
            }
        }
        let mut memory = Memory::default();
        let out = execute(
            "hna",
            &served("web"),
            &Lapsing(&api, &leading),
            &|| leading.load(Ordering::SeqCst),
            &mut memory,
            &|_| None,
        )
        .await;
        assert!(out.stopped);
        assert_eq!(api.sent.lock().unwrap().len(), 1);
        assert!(api.events.lock().unwrap().is_empty());
    }

    #[test]
    fn node_access_is_limited_to_the_nodes_own_object() {
        let [role, binding] = node_access("hna", "n1");
        let Verb::Patch(PatchKind::Apply, role) = role.verb else {
            panic!("{role:?}")
        };
        assert_eq!(role["rules"][0]["resourceNames"], json!(["n1"]));
        assert_eq!(role["rules"][0]["verbs"], json!(["get", "list", "watch"]));
        assert_eq!(
            role["rules"][1]["resources"],
            json!(["loadbalancernodes/status"])
        );
        assert_eq!(role["rules"][1]["verbs"], json!(["get", "update", "patch"]));
        let Verb::Patch(PatchKind::Apply, binding) = binding.verb else {
            panic!("{binding:?}")
        };
        assert_eq!(
            binding["subjects"],
            json!([{"kind": "User", "apiGroup": "rbac.authorization.k8s.io", "name": "system:node:n1"}])
        );
        let spec_write = requests(
            "hna",
            &Write::SetSpec {
                node: "n1".into(),
                spec: Spec::default(),
                services: vec![],
                before: vec![],
            },
        );
        assert_eq!(
            spec_write[0].verb,
            Verb::Patch(PatchKind::Merge, json!({"spec": {"assignments": []}}))
        );
        // Clearing takes our condition off, and only ours.
        let clear = requests(
            "hna",
            &Write::ServiceStatus {
                service: key("web"),
                ingress: vec![],
                assigned: None,
            },
        );
        assert_eq!(
            clear[0].verb,
            Verb::Patch(
                PatchKind::Strategic,
                json!({"status": {
                    "loadBalancer": {"ingress": null},
                    "conditions": [{"type": hna_contract::SERVICE_CONDITION, "$patch": "delete"}],
                }})
            )
        );
        let publish = requests("hna", &served("web").writes[0]);
        assert_eq!(
            publish[0].verb,
            Verb::Patch(
                PatchKind::Strategic,
                json!({"status": {
                    "loadBalancer": {"ingress": [{"ip": "10.77.0.150", "ipMode": "VIP", "ports": [{"port": 80, "protocol": "TCP"}]}]},
                    "conditions": [{
                        "type": hna_contract::SERVICE_CONDITION,
                        "status": "True",
                        "observedGeneration": 1,
                        "lastTransitionTime": "2027-01-15T08:00:00Z",
                        "reason": "AddressAssigned",
                        "message": "10.77.0.150 published by harvester-node-agent",
                    }],
                }})
            )
        );
    }
}
