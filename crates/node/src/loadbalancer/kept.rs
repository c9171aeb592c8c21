//! What one run of the agent keeps for the next, in the state directory
//! (`<state_dir>/loadbalancer/`), so that an agent restarted while the API
//! server cannot be read (killed, crashed, upgraded during an outage) can
//! still take part in its LAN and hold what it held (issue #49):
//!
//! - `spec.json`: the last `LoadBalancerNode` spec it read (assignments and
//!   peers), removed when the object is gone;
//! - `membership.key`: the membership key it last read from the Secret
//!   (hex, mode 0600, as the lease files and the kubelet's credentials are
//!   root's only);
//! - `words.json`: its witnesses' word on it as last heard
//!   (`membership::swim::Attestation`, without its times), the baseline a
//!   restarted run compares their next word with;
//! - `epoch`: the membership's last run epoch, so a new run's epoch only
//!   grows, across restarts and clock steps (a run epoch below the last one
//!   its peers saw is a replay to them, and they would not hear it).
//!
//! Nothing here is needed: a file that is missing, unreadable or malformed
//! is logged and taken as absent (the agent then waits for the API server,
//! as before), and a write that fails is logged and changes nothing else.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use hna_contract::node_object::Spec;

pub(crate) use crate::membership::transport::Word as KeptWord;

/// The folder and its files.
#[derive(Debug, Clone)]
pub(crate) struct Kept {
    dir: PathBuf,
    /// Writes are made off the runtime's threads ([`Kept::ticket`]): the
    /// newest ticket written per file, so a write that comes late never
    /// replaces a newer one.
    written: std::sync::Arc<std::sync::Mutex<BTreeMap<&'static str, u64>>>,
    tickets: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

const SPEC: &str = "spec.json";
const KEY: &str = "membership.key";
const WORDS: &str = "words.json";
const EPOCH: &str = "epoch";

impl Kept {
    pub(crate) fn in_state_dir(state_dir: &Path) -> Kept {
        Kept {
            dir: state_dir.join("loadbalancer"),
            written: Default::default(),
            tickets: Default::default(),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Reads a file; absent is `None` silently, unreadable is `None` with
    /// a warning.
    fn read(&self, name: &str) -> Option<Vec<u8>> {
        match std::fs::read(self.path(name)) {
            Ok(b) => Some(b),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => {
                tracing::warn!(path = %self.path(name).display(), error = %e, "cannot read what the last run kept; taken as absent");
                None
            }
        }
    }

    /// Replaces a file whole (written beside it, then renamed), mode 0600.
    fn write(&self, name: &str, bytes: &[u8]) {
        let result = (|| -> std::io::Result<()> {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&self.dir)?;
            let tmp = self.path(&format!(".{name}.new"));
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)?;
            f.write_all(bytes)?;
            f.sync_all()?;
            std::fs::rename(&tmp, self.path(name))
        })();
        if let Err(e) = result {
            tracing::warn!(path = %self.path(name).display(), error = %e, "cannot keep this for the next run");
        }
    }

    fn parse<T: serde::de::DeserializeOwned>(&self, name: &str) -> Option<T> {
        let bytes = self.read(name)?;
        match serde_json::from_slice(&bytes) {
            Ok(v) => Some(v),
            Err(e) => {
                tracing::warn!(path = %self.path(name).display(), error = %e, "what the last run kept does not parse; taken as absent");
                None
            }
        }
    }

    /// A place in the order of writes, taken where the write is decided
    /// (in order), for a write carried out elsewhere (in any order).
    pub(crate) fn ticket(&self) -> u64 {
        self.tickets
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
            .saturating_add(1)
    }

    /// Runs `write` unless a write of `file` with a newer ticket was made.
    fn in_order(&self, file: &'static str, ticket: u64, write: impl FnOnce()) {
        let mut written = self.written.lock().unwrap_or_else(|e| e.into_inner());
        if written.get(file).is_some_and(|w| *w > ticket) {
            return;
        }
        write();
        written.insert(file, ticket);
    }

    /// [`Kept::keep_spec`] (`None`: [`Kept::forget_spec`]) in the order of
    /// its ticket.
    pub(crate) fn keep_spec_in_order(&self, ticket: u64, spec: Option<&Spec>) {
        self.in_order(SPEC, ticket, || match spec {
            Some(s) => self.keep_spec(s),
            None => self.forget_spec(),
        });
    }

    /// [`Kept::keep_words`] in the order of its ticket.
    pub(crate) fn keep_words_in_order(&self, ticket: u64, words: &BTreeMap<String, KeptWord>) {
        self.in_order(WORDS, ticket, || self.keep_words(words));
    }

    pub(crate) fn spec(&self) -> Option<Spec> {
        self.parse(SPEC)
    }

    pub(crate) fn keep_spec(&self, spec: &Spec) {
        match serde_json::to_vec(spec) {
            Ok(b) => self.write(SPEC, &b),
            Err(e) => tracing::warn!(error = %e, "cannot encode the spec to keep it"),
        }
    }

    /// The object is gone: a next run has nothing to hold from it.
    pub(crate) fn forget_spec(&self) {
        match std::fs::remove_file(self.path(SPEC)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(path = %self.path(SPEC).display(), error = %e, "cannot remove the kept spec")
            }
        }
    }

    /// The membership key kept (32 bytes or more), if any.
    pub(crate) fn key(&self) -> Option<Vec<u8>> {
        let text = self.read(KEY)?;
        let text = String::from_utf8_lossy(&text);
        match hex::decode(text.trim()) {
            Ok(k) if k.len() >= 32 => Some(k),
            _ => {
                tracing::warn!(path = %self.path(KEY).display(), "the kept membership key is not 32 or more bytes of hex; taken as absent");
                None
            }
        }
    }

    pub(crate) fn keep_key(&self, key: &[u8]) {
        self.write(KEY, hex::encode(key).as_bytes());
    }

    pub(crate) fn words(&self) -> BTreeMap<String, KeptWord> {
        self.parse(WORDS).unwrap_or_default()
    }

    pub(crate) fn keep_words(&self, words: &BTreeMap<String, KeptWord>) {
        match serde_json::to_vec(words) {
            Ok(b) => self.write(WORDS, &b),
            Err(e) => tracing::warn!(error = %e, "cannot encode the witnesses' words to keep them"),
        }
    }

    /// The epoch of a new membership run: `now_ms` (the wall clock), or one
    /// past the last run's when the clock is behind it (stepped back, or
    /// two runs within a millisecond); kept before it is used.
    pub(crate) fn next_epoch(&self, now_ms: u64) -> u64 {
        let last = self
            .read(EPOCH)
            .and_then(|b| String::from_utf8_lossy(&b).trim().parse::<u64>().ok());
        let epoch = match last {
            Some(last) if last >= now_ms => {
                tracing::info!(
                    last,
                    now_ms,
                    "the wall clock is behind the last membership run's epoch (stepped back?): the new run's epoch follows the last one instead"
                );
                last + 1
            }
            _ => now_ms,
        };
        self.write(EPOCH, epoch.to_string().as_bytes());
        epoch
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn what_one_run_keeps_the_next_reads() {
        let dir = tempfile::tempdir().unwrap();
        let kept = Kept::in_state_dir(dir.path());
        assert_eq!(kept.spec(), None);
        assert_eq!(kept.key(), None);
        assert!(kept.words().is_empty());

        let spec = Spec {
            assignments: vec![hna_contract::node_object::Assignment {
                service: "default/web".into(),
                uid: "3f2a9c1e-0000-0000-0000-000000000000".into(),
                interface: "hlb-3f2a9c1e".into(),
                mac: "02:00:00:00:00:01".into(),
                ..Default::default()
            }],
            peers: vec![],
        };
        kept.keep_spec(&spec);
        assert_eq!(kept.spec(), Some(spec));
        kept.forget_spec();
        assert_eq!(kept.spec(), None);

        kept.keep_key(&[7; 32]);
        assert_eq!(kept.key(), Some(vec![7; 32]));
        let mode = std::fs::metadata(kept.path(KEY))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "the key is root's only");

        let words = BTreeMap::from([(
            "node-2".to_string(),
            KeptWord {
                run: 9,
                accusations: 2,
                accusing: false,
            },
        )]);
        kept.keep_words(&words);
        assert_eq!(kept.words(), words);
    }

    /// A run's epoch only grows: a clock stepped back 120 s gives the last
    /// epoch plus one, not an epoch the peers would take for a replay.
    #[test]
    fn the_epoch_only_grows_across_runs_and_clock_steps() {
        let dir = tempfile::tempdir().unwrap();
        let kept = Kept::in_state_dir(dir.path());
        assert_eq!(kept.next_epoch(1_000_000), 1_000_000);
        assert_eq!(kept.next_epoch(1_000_000 - 120_000), 1_000_001);
        assert_eq!(kept.next_epoch(1_000_001), 1_000_002);
        assert_eq!(kept.next_epoch(2_000_000), 2_000_000);
    }

    /// Writes carried out out of order keep the newest.
    #[test]
    fn a_late_write_never_replaces_a_newer_one() {
        let dir = tempfile::tempdir().unwrap();
        let kept = Kept::in_state_dir(dir.path());
        let older = kept.ticket();
        let newer = kept.ticket();
        let spec = |n: usize| Spec {
            assignments: vec![Default::default(); n],
            peers: vec![],
        };
        kept.keep_spec_in_order(newer, Some(&spec(2)));
        kept.keep_spec_in_order(older, Some(&spec(1)));
        assert_eq!(kept.spec().map(|s| s.assignments.len()), Some(2));
        let forget = kept.ticket();
        kept.keep_spec_in_order(forget, None);
        assert_eq!(kept.spec(), None);
    }

    /// Garbage in any file is taken as absent, never a panic.
    #[test]
    fn malformed_files_are_absent() {
        let dir = tempfile::tempdir().unwrap();
        let kept = Kept::in_state_dir(dir.path());
        for name in [SPEC, KEY, WORDS, EPOCH] {
            kept.write(name, b"\x00not what it should be{");
        }
        assert_eq!(kept.spec(), None);
        assert_eq!(kept.key(), None);
        assert!(kept.words().is_empty());
        assert_eq!(kept.next_epoch(5), 5);
        kept.write(KEY, hex::encode([1u8; 8]).as_bytes());
        assert_eq!(kept.key(), None, "too short");
    }
}
