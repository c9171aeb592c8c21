//! The credentials watcher: finds credentials, connects, keeps asking the API
//! server whether it is there, and connects afresh when the credentials
//! change. Both the node daemon and the controller run it.
//!
//! Each round is decided by `plan`, a pure function of what was found now
//! and what the current session was built from; the loop in [`watch()`] only
//! performs the chosen step. A change is detected by content
//! (`Fingerprint`), not modification time: a kubeconfig (or a client
//! certificate it names, which RKE2 rotates in place) replaced within the
//! same second must still be noticed.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::credentials::{self, Discovery, DiscoveryEnv, Settings};
use crate::systemd::{Heartbeat, beating};

/// Connection to the guest cluster, as reports show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state")]
pub enum ClusterState {
    /// No kubeconfig yet: normal before the node has joined.
    WaitingForCredentials {
        searched: Vec<PathBuf>,
        configured: bool,
    },
    /// Credentials found; the first connection attempt is under way.
    Connecting { kubeconfig: Option<PathBuf> },
    /// Credentials found, the API server answered.
    Connected {
        kubeconfig: Option<PathBuf>,
        server: String,
        server_version: String,
    },
    /// Credentials found but unusable or the server did not answer.
    Unreachable {
        kubeconfig: Option<PathBuf>,
        error: String,
    },
}

impl ClusterState {
    /// The state before the first round: what discovery finds right now.
    pub fn initial(found: &Discovery) -> ClusterState {
        match found {
            Discovery::NotFound {
                searched,
                configured,
            } => ClusterState::WaitingForCredentials {
                searched: searched.clone(),
                configured: *configured,
            },
            Discovery::File { path, .. } => ClusterState::Connecting {
                kubeconfig: Some(path.clone()),
            },
            Discovery::InCluster => ClusterState::Connecting { kubeconfig: None },
        }
    }
}

/// The bytes a client is built from: the kubeconfig and every file it
/// names (certificate authority, client certificate and key, token file).
/// Equal fingerprints mean an equal client.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Fingerprint(Vec<(PathBuf, Option<Vec<u8>>)>);

impl Fingerprint {
    /// Reads the files behind `found`. In-cluster credentials have an empty
    /// fingerprint: the client re-reads its rotating token by itself.
    pub(crate) fn read(found: &Discovery) -> Fingerprint {
        match found {
            Discovery::File { path, .. } => Fingerprint::of_kubeconfig(path),
            Discovery::InCluster | Discovery::NotFound { .. } => Fingerprint::default(),
        }
    }

    fn of_kubeconfig(path: &Path) -> Fingerprint {
        let main = std::fs::read(path).ok();
        let mut files = vec![(path.to_path_buf(), main.clone())];
        if let Some(text) = main.as_deref().and_then(|b| std::str::from_utf8(b).ok()) {
            let base = path.parent().unwrap_or(Path::new("/"));
            for named in referenced_files(text) {
                let p = base.join(named);
                let content = std::fs::read(&p).ok();
                files.push((p, content));
            }
        }
        Fingerprint(files)
    }
}

/// Files a kubeconfig names, in document order; an unparsable kubeconfig
/// names none (the client build reports why it is unusable).
fn referenced_files(kubeconfig: &str) -> Vec<String> {
    let Ok(kc) = kube::config::Kubeconfig::from_yaml(kubeconfig) else {
        return Vec::new();
    };
    let clusters = kc
        .clusters
        .iter()
        .filter_map(|c| c.cluster.as_ref()?.certificate_authority.clone());
    let users = kc
        .auth_infos
        .iter()
        .filter_map(|a| a.auth_info.as_ref())
        .flat_map(|a| {
            [
                a.client_certificate.clone(),
                a.client_key.clone(),
                a.token_file.clone(),
            ]
            .into_iter()
            .flatten()
        });
    clusters.chain(users).collect()
}

/// What the current session was built from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Basis {
    pub(crate) found: Discovery,
    pub(crate) fingerprint: Fingerprint,
}

/// One round's decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Step {
    /// No credentials: report this and drop any session.
    Wait(ClusterState),
    /// Same credentials as the session: ask the server whether it is there.
    Probe,
    /// New or changed credentials, or no session: build a client and connect.
    Connect,
}

/// Decides a round from what was found now and the session's basis.
pub(crate) fn plan(now: &Basis, session: Option<&Basis>) -> Step {
    match (&now.found, session) {
        (Discovery::NotFound { .. }, _) => Step::Wait(ClusterState::initial(&now.found)),
        (_, Some(was)) if was == now => Step::Probe,
        _ => Step::Connect,
    }
}

/// The kubeconfig path a state names, for reports.
pub(crate) fn kubeconfig_of(found: &Discovery) -> Option<PathBuf> {
    match found {
        Discovery::File { path, .. } => Some(path.clone()),
        _ => None,
    }
}

/// The state after a health probe of an existing session: the server's
/// version, why it did not answer, or how long it was waited for.
pub(crate) fn after_probe<E: std::fmt::Display>(
    found: &Discovery,
    server: &str,
    answer: Result<Result<String, E>, Duration>,
) -> ClusterState {
    let kubeconfig = kubeconfig_of(found);
    match answer {
        Ok(Ok(server_version)) => ClusterState::Connected {
            kubeconfig,
            server: server.to_string(),
            server_version,
        },
        Ok(Err(error)) => ClusterState::Unreachable {
            kubeconfig,
            error: error.to_string(),
        },
        Err(waited) => ClusterState::Unreachable {
            kubeconfig,
            error: format!(
                "API server did not answer within {}",
                humantime::format_duration(waited)
            ),
        },
    }
}

/// Whether the session's client stays published after a round that ended
/// in `state`. A failed health probe of a working session (one slow, 429
/// or 5xx `/version`) only reports the cluster unreachable: taking the
/// client away would stop the node's heartbeat and move all its Services,
/// or make the controller give up its Lease, for one bad answer. Requests
/// made with the client fail or succeed on their own. Only a round that
/// could not build a session, or found no credentials, takes it away.
pub(crate) fn keep_client(state: &ClusterState, probed: bool) -> bool {
    matches!(state, ClusterState::Connected { .. }) || probed
}

/// How the watcher runs.
#[derive(Debug, Clone)]
pub struct WatchOptions {
    pub settings: Settings,
    /// Between rounds.
    pub every: Duration,
    /// How long one API request may take before the cluster counts as
    /// unreachable.
    pub api_timeout: Duration,
    /// How often the loop beats while waiting on the network.
    pub beat_every: Duration,
}

struct Session {
    basis: Basis,
    client: kube::Client,
    server: String,
}

/// Runs until `shutdown` changes: publishes the cluster state and a usable
/// client (`None` while not connected).
pub async fn watch(
    opts: WatchOptions,
    env: impl DiscoveryEnv,
    cluster: watch::Sender<ClusterState>,
    client_out: watch::Sender<Option<kube::Client>>,
    hb: Heartbeat,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut session: Option<Session> = None;
    let mut tick = tokio::time::interval(opts.every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut beat = tokio::time::interval(opts.beat_every);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = beat.tick() => { hb.beat(); continue; }
            _ = shutdown.changed() => return,
        }
        hb.beat();
        let found = credentials::discover(&opts.settings, &env);
        let now = Basis {
            fingerprint: Fingerprint::read(&found),
            found,
        };
        // A new session (first connection, or changed credentials) is
        // published even when a client already was: holders of the old
        // client must move to the new one.
        let (mut new_session, mut kept_old) = (false, false);
        let step = plan(&now, session.as_ref().map(|s| &s.basis));
        let probed = matches!(step, Step::Probe);
        let next = match step {
            Step::Wait(state) => {
                session = None;
                state
            }
            Step::Probe => {
                let s = session
                    .as_ref()
                    .expect("Probe is planned only with a session");
                probe(&opts, &hb, &now, s).await
            }
            Step::Connect => {
                let (state, made) = connect(&opts, &hb, now, &mut session).await;
                new_session = made == Connected::New;
                kept_old = made == Connected::KeptOld;
                state
            }
        };
        let usable = keep_client(&next, probed || kept_old)
            .then(|| session.as_ref().map(|s| s.client.clone()))
            .flatten();
        client_out.send_if_modified(|current| {
            let changed = current.is_some() != usable.is_some() || new_session;
            *current = usable;
            changed
        });
        cluster.send_if_modified(|current| {
            if *current != next {
                *current = next;
                true
            } else {
                false
            }
        });
    }
}

/// How a connect round left the session.
#[derive(Debug, PartialEq, Eq)]
enum Connected {
    New,
    /// The new credentials failed; the previous session goes on.
    KeptOld,
    /// No session.
    None,
}

/// Asks the session's server for its version, within the API timeout.
async fn probe(opts: &WatchOptions, hb: &Heartbeat, now: &Basis, s: &Session) -> ClusterState {
    let answer = beating(
        hb,
        opts.beat_every,
        tokio::time::timeout(opts.api_timeout, s.client.apiserver_version()),
    )
    .await
    .map(|r| r.map(|info| info.git_version))
    .map_err(|_| opts.api_timeout);
    after_probe(&now.found, &s.server, answer)
}

/// Connects with the credentials found; a success replaces the session.
async fn connect(
    opts: &WatchOptions,
    hb: &Heartbeat,
    now: Basis,
    session: &mut Option<Session>,
) -> (ClusterState, Connected) {
    let kubeconfig = kubeconfig_of(&now.found);
    match beating(
        hb,
        opts.beat_every,
        credentials::connect(&now.found, opts.api_timeout),
    )
    .await
    {
        Ok(conn) => {
            tracing::info!(server = %conn.server, version = %conn.server_version, kubeconfig = ?kubeconfig, "connected to the guest cluster");
            let state = ClusterState::Connected {
                kubeconfig,
                server: conn.server.clone(),
                server_version: conn.server_version,
            };
            *session = Some(Session {
                basis: now,
                client: conn.client,
                server: conn.server,
            });
            (state, Connected::New)
        }
        Err(e) => {
            // Changed credentials that do not work yet (a rotation half
            // done, the server briefly away): the session that works goes
            // on and the new ones are tried again next round. Dropping it
            // would stop the node's heartbeat and move its Services (issue
            // #29).
            let kept_old = session.is_some();
            if kept_old {
                tracing::warn!(error = %format!("{e:#}"), "the changed credentials do not connect: going on with the previous session, retrying");
            }
            let state = ClusterState::Unreachable {
                kubeconfig,
                error: format!("{e:#}"),
            };
            (
                state,
                if kept_old {
                    Connected::KeptOld
                } else {
                    Connected::None
                },
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::credentials::Source;

    fn file(path: &str) -> Discovery {
        Discovery::File {
            path: path.into(),
            source: Source::Search,
        }
    }

    fn basis(found: Discovery, content: &[u8]) -> Basis {
        let fingerprint = match &found {
            Discovery::File { path, .. } => {
                Fingerprint(vec![(path.clone(), Some(content.to_vec()))])
            }
            _ => Fingerprint::default(),
        };
        Basis { found, fingerprint }
    }

    #[test]
    fn a_failed_probe_keeps_the_client_a_failed_connect_does_not() {
        let unreachable = after_probe(&file("/a"), "https://x", Ok(Err("429")));
        assert!(matches!(unreachable, ClusterState::Unreachable { .. }));
        assert!(
            keep_client(&unreachable, true),
            "a probe of a working session"
        );
        assert!(
            !keep_client(&unreachable, false),
            "no session could be built"
        );
        let timed_out = after_probe::<&str>(&file("/a"), "https://x", Err(Duration::from_secs(5)));
        assert!(keep_client(&timed_out, true));
        let connected = after_probe(
            &file("/a"),
            "https://x",
            Ok(Ok::<_, &str>("v1.37.2".into())),
        );
        assert!(keep_client(&connected, false));
    }

    #[test]
    fn no_credentials_waits_and_drops_the_session() {
        let missing = Discovery::NotFound {
            searched: vec!["/a".into()],
            configured: true,
        };
        let was = basis(file("/a"), b"x");
        assert_eq!(
            plan(&basis(missing, b""), Some(&was)),
            Step::Wait(ClusterState::WaitingForCredentials {
                searched: vec!["/a".into()],
                configured: true
            })
        );
    }

    #[test]
    fn same_credentials_probe_changed_ones_reconnect() {
        let was = basis(file("/etc/kc"), b"v1");
        assert_eq!(
            plan(&basis(file("/etc/kc"), b"v1"), Some(&was)),
            Step::Probe
        );
        assert_eq!(
            plan(&basis(file("/etc/kc"), b"v2"), Some(&was)),
            Step::Connect
        );
        assert_eq!(
            plan(&basis(file("/other"), b"v1"), Some(&was)),
            Step::Connect
        );
        assert_eq!(plan(&basis(file("/etc/kc"), b"v1"), None), Step::Connect);
        let in_cluster = basis(Discovery::InCluster, b"");
        assert_eq!(plan(&in_cluster, Some(&in_cluster.clone())), Step::Probe);
    }

    #[test]
    fn probe_outcomes_become_states() {
        let f = file("/etc/kc");
        assert_eq!(
            after_probe(&f, "https://s", Ok(Ok::<_, &str>("v1.20.2".into()))),
            ClusterState::Connected {
                kubeconfig: Some("/etc/kc".into()),
                server: "https://s".into(),
                server_version: "v1.20.2".into()
            }
        );
        assert_eq!(
            after_probe::<&str>(&f, "https://s", Err(Duration::from_secs(10))),
            ClusterState::Unreachable {
                kubeconfig: Some("/etc/kc".into()),
                error: "API server did not answer within 10s".into()
            }
        );
    }

    const KUBECONFIG: &str = "apiVersion: v1
kind: Config
clusters:
- name: c
  cluster:
    server: https://127.0.0.1:6443
    certificate-authority: ca.crt
users:
- name: u
  user:
    client-certificate: /abs/client.crt
    client-key: client.key
contexts:
- name: x
  context: {cluster: c, user: u}
current-context: x
";

    #[test]
    fn a_kubeconfig_names_its_certificate_files() {
        assert_eq!(
            referenced_files(KUBECONFIG),
            vec!["ca.crt", "/abs/client.crt", "client.key"]
        );
        assert!(referenced_files("not: [yaml").is_empty());
    }

    /// The defect this replaces: a file rewritten within the same second
    /// (same mtime) went unnoticed. Content decides now, so the test pins
    /// both versions to one mtime.
    #[test]
    fn a_rewrite_with_the_same_mtime_is_a_change() {
        let dir = tempfile::tempdir().unwrap();
        let kc = dir.path().join("kubelet.kubeconfig");
        let key = dir.path().join("client.key");
        std::fs::write(&kc, KUBECONFIG).unwrap();
        std::fs::write(&key, "key one").unwrap();
        let pin = |p: &Path| {
            let t = std::time::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
            let times = std::fs::FileTimes::new().set_accessed(t).set_modified(t);
            std::fs::File::options()
                .write(true)
                .open(p)
                .unwrap()
                .set_times(times)
                .unwrap();
        };
        pin(&kc);
        pin(&key);
        let found = Discovery::File {
            path: kc.clone(),
            source: Source::Configured,
        };
        let first = Fingerprint::read(&found);
        assert_eq!(first, Fingerprint::read(&found), "reading twice is stable");

        std::fs::write(&kc, KUBECONFIG.replace("6443", "6444")).unwrap();
        pin(&kc);
        let second = Fingerprint::read(&found);
        assert_ne!(first, second, "kubeconfig rewritten in place");

        std::fs::write(&key, "key two").unwrap();
        pin(&key);
        assert_ne!(
            second,
            Fingerprint::read(&found),
            "a rotated client key is a change too"
        );
    }
}
