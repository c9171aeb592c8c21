//! Lease files: one JSON file per lease under `<state_dir>/leases/`, written
//! atomically (temporary file, fsync, rename, fsync of the directory) so a
//! crash at any point leaves either the old or the new lease, never a torn
//! one. After a crash, restart or reboot the client starts from it in
//! INIT-REBOOT and keeps its address while the server agrees.

use std::fs;
use std::io::Write;
use std::net::Ipv4Addr;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::machine::Lease;
use super::packet::Identity;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(
        "lease name `{0}` is not valid (1-64 of a-z, 0-9, '-', '_', '.', not starting with '.')"
    )]
    BadName(String),
    #[error("cannot {what} {path}: {source}", path = path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("lease file {path} is not valid: {source}", path = path.display())]
    Corrupt {
        path: PathBuf,
        source: serde_json::Error,
    },
}

/// The on-disk form. Times are wall-clock (Unix milliseconds) because
/// monotonic time does not survive a reboot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct LeaseRecord {
    pub(crate) name: String,
    pub(crate) identity: Identity,
    pub(crate) address: Ipv4Addr,
    pub(crate) prefix_len: u8,
    pub(crate) server_id: Ipv4Addr,
    pub(crate) server_mac: [u8; 6],
    pub(crate) routers: Vec<Ipv4Addr>,
    pub(crate) lease_ms: u64,
    pub(crate) t1_ms: u64,
    pub(crate) t2_ms: u64,
    pub(crate) acquired_unix_ms: u64,
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64
}

impl LeaseRecord {
    /// Converts a machine lease, mapping its monotonic `acquired` to wall
    /// time through the current pair of clocks.
    pub(crate) fn from_lease(name: &str, id: &Identity, l: &Lease) -> Self {
        let age = Instant::now().saturating_duration_since(l.acquired);
        let acquired = SystemTime::now().checked_sub(age).unwrap_or(UNIX_EPOCH);
        LeaseRecord {
            name: name.to_string(),
            identity: id.clone(),
            address: l.address,
            prefix_len: l.prefix_len,
            server_id: l.server_id,
            server_mac: l.server_mac,
            routers: l.routers.clone(),
            lease_ms: l.lease_time.as_millis() as u64,
            t1_ms: l.t1.as_millis() as u64,
            t2_ms: l.t2.as_millis() as u64,
            acquired_unix_ms: unix_ms(acquired),
        }
    }

    /// Back to a machine lease. A lease acquired "in the future" (clock
    /// stepped back) counts as acquired now.
    pub(crate) fn to_lease(&self) -> Lease {
        let age_ms = unix_ms(SystemTime::now()).saturating_sub(self.acquired_unix_ms);
        let now = Instant::now();
        let acquired = now
            .checked_sub(Duration::from_millis(age_ms))
            .unwrap_or(now);
        Lease {
            address: self.address,
            prefix_len: self.prefix_len,
            server_id: self.server_id,
            server_mac: self.server_mac,
            routers: self.routers.clone(),
            lease_time: Duration::from_millis(self.lease_ms),
            t1: Duration::from_millis(self.t1_ms),
            t2: Duration::from_millis(self.t2_ms),
            acquired,
        }
    }
}

/// `<state_dir>/leases`.
#[derive(Debug, Clone)]
pub struct Store {
    dir: PathBuf,
}

/// Lease names become file names: keep them boring.
pub(crate) fn validate_name(name: &str) -> Result<(), StoreError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-_.".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(StoreError::BadName(name.to_string()))
    }
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> StoreError {
    let path = path.to_path_buf();
    move |source| StoreError::Io { what, path, source }
}

impl Store {
    /// Uses `<state_dir>/leases`, creating it (mode 0700) if needed.
    pub fn open(state_dir: &Path) -> Result<Store, StoreError> {
        let dir = state_dir.join("leases");
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(io("create", &dir))?;
        Ok(Store { dir })
    }

    #[cfg(test)]
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    pub(crate) fn path(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.json"))
    }

    pub(crate) fn save(&self, rec: &LeaseRecord) -> Result<(), StoreError> {
        validate_name(&rec.name)?;
        let path = self.path(&rec.name);
        let tmp = self.dir.join(format!(".{}.json.tmp", rec.name));
        let body = serde_json::to_vec_pretty(rec).expect("lease record serializes");
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(io("create", &tmp))?;
        f.write_all(&body).map_err(io("write", &tmp))?;
        f.sync_all().map_err(io("fsync", &tmp))?;
        drop(f);
        fs::rename(&tmp, &path).map_err(io("rename into place", &path))?;
        fs::File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(io("fsync", &self.dir))?;
        Ok(())
    }

    /// The stored lease, `None` when there is none.
    pub(crate) fn load(&self, name: &str) -> Result<Option<LeaseRecord>, StoreError> {
        validate_name(name)?;
        let path = self.path(name);
        match fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|source| StoreError::Corrupt { path, source }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io("read", &path)(e)),
        }
    }

    pub(crate) fn remove(&self, name: &str) -> Result<(), StoreError> {
        validate_name(name)?;
        let path = self.path(name);
        match fs::remove_file(&path) {
            Ok(()) => fs::File::open(&self.dir)
                .and_then(|d| d.sync_all())
                .map_err(io("fsync", &self.dir)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io("remove", &path)(e)),
        }
    }

    /// Moves a lease file that cannot be read aside (`<name>.json.corrupt`,
    /// kept for a look, never read again) so its lease starts afresh
    /// instead of failing every start.
    pub(crate) fn set_aside(&self, name: &str) -> Result<PathBuf, StoreError> {
        validate_name(name)?;
        let path = self.path(name);
        let aside = self.dir.join(format!("{name}.json.corrupt"));
        fs::rename(&path, &aside).map_err(io("set aside", &path))?;
        Ok(aside)
    }

    /// Removes the lease files that no running lease uses and whose lease
    /// ran out before `now`: what handovers leave behind. A file still in
    /// its lease is kept, so a Service coming back is asked for by
    /// INIT-REBOOT. Returns the names removed.
    pub(crate) fn prune_expired(
        &self,
        in_use: &std::collections::BTreeSet<String>,
        now: SystemTime,
    ) -> Result<Vec<String>, StoreError> {
        let mut removed = Vec::new();
        for name in self.list()? {
            if in_use.contains(&name) {
                continue;
            }
            let ended = match self.load(&name) {
                Ok(Some(r)) => r.acquired_unix_ms.saturating_add(r.lease_ms) < unix_ms(now),
                Ok(None) => false,
                // Unreadable: of no use to anyone.
                Err(StoreError::Corrupt { .. }) => true,
                Err(e) => return Err(e),
            };
            if ended {
                self.remove(&name)?;
                removed.push(name);
            }
        }
        Ok(removed)
    }

    /// Names of all stored leases.
    pub(crate) fn list(&self) -> Result<Vec<String>, StoreError> {
        let mut names = Vec::new();
        for e in fs::read_dir(&self.dir).map_err(io("list", &self.dir))? {
            let e = e.map_err(io("list", &self.dir))?;
            let n = e.file_name().to_string_lossy().into_owned();
            if let Some(stem) = n.strip_suffix(".json")
                && !n.starts_with('.')
            {
                names.push(stem.to_string());
            }
        }
        names.sort();
        Ok(names)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease() -> Lease {
        Lease {
            address: Ipv4Addr::new(10, 77, 0, 150),
            prefix_len: 24,
            server_id: Ipv4Addr::new(10, 77, 0, 1),
            server_mac: [2, 0, 0, 0, 0, 1],
            routers: vec![Ipv4Addr::new(10, 77, 0, 1)],
            lease_time: Duration::from_secs(120),
            t1: Duration::from_secs(20),
            t2: Duration::from_secs(35),
            acquired: Instant::now() - Duration::from_secs(30),
        }
    }

    #[test]
    fn a_corrupt_file_is_set_aside_and_expired_unused_files_are_pruned() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let id = Identity::new([0, 0, 0x6c, 1, 2, 3]);
        fs::write(store.path("hlb-corrupt"), b"{\"name\": tru").unwrap();
        assert!(matches!(
            store.load("hlb-corrupt"),
            Err(StoreError::Corrupt { .. })
        ));
        let aside = store.set_aside("hlb-corrupt").unwrap();
        assert!(aside.is_file());
        assert!(store.load("hlb-corrupt").unwrap().is_none());
        assert!(!store.list().unwrap().contains(&"hlb-corrupt".to_string()));

        // Acquired 30 s ago for 120 s: running; for 20 s: over.
        store
            .save(&LeaseRecord::from_lease("hlb-running", &id, &lease()))
            .unwrap();
        let mut short = lease();
        short.lease_time = Duration::from_secs(20);
        for name in ["hlb-over", "hlb-over-in-use"] {
            store
                .save(&LeaseRecord::from_lease(name, &id, &short))
                .unwrap();
        }
        let in_use = ["hlb-over-in-use".to_string()].into();
        assert_eq!(
            store.prune_expired(&in_use, SystemTime::now()).unwrap(),
            ["hlb-over"]
        );
        assert_eq!(store.list().unwrap(), ["hlb-over-in-use", "hlb-running"]);
    }

    #[test]
    fn round_trip_keeps_the_remaining_time() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let id = Identity::new([0, 0, 0x6c, 1, 2, 3]);
        let rec = LeaseRecord::from_lease("vip-0123abcd", &id, &lease());
        store.save(&rec).unwrap();
        let back = store.load("vip-0123abcd").unwrap().unwrap();
        assert_eq!(back, rec);
        let l = back.to_lease();
        let remaining = l.expires_at() - Instant::now();
        assert!(
            remaining <= Duration::from_secs(90) && remaining > Duration::from_secs(88),
            "{remaining:?}"
        );
        assert_eq!(store.list().unwrap(), vec!["vip-0123abcd"]);
        // No temporary file is left behind, and the file is private.
        let names: Vec<_> = fs::read_dir(store.dir())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
        use std::os::unix::fs::PermissionsExt;
        let mode = fs::metadata(store.path("vip-0123abcd"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        store.remove("vip-0123abcd").unwrap();
        assert!(store.load("vip-0123abcd").unwrap().is_none());
        store.remove("vip-0123abcd").unwrap();
    }

    #[test]
    fn bad_names_and_corrupt_files_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        for bad in ["", "../x", "a/b", ".hidden", "UPPER", &"x".repeat(65)] {
            assert!(
                matches!(store.load(bad), Err(StoreError::BadName(_))),
                "{bad}"
            );
        }
        fs::write(store.path("broken"), b"{\"name\":").unwrap();
        let err = store.load("broken").unwrap_err();
        assert!(
            err.to_string().contains("broken.json is not valid"),
            "{err}"
        );
    }
}
