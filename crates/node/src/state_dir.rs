//! The persistent state directory (DHCP leases live here in later work).

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use nix::unistd::{AccessFlags, access};
use serde::Serialize;

/// What a read-only look at the directory found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "state", rename_all = "PascalCase")]
pub enum Inspection {
    /// Exists and this process may write to it.
    Writable,
    /// Missing, but the nearest existing ancestor is writable, so `run` will
    /// create it.
    WillBeCreated { ancestor: PathBuf },
    /// Exists (or must be created) but cannot be written.
    NotWritable { path: PathBuf, reason: String },
    /// Something that is not a directory is in the way.
    NotADirectory { path: PathBuf },
}

/// Looks without changing anything (for `check`).
pub fn inspect(dir: &Path) -> Inspection {
    match std::fs::metadata(dir) {
        Ok(md) if !md.is_dir() => Inspection::NotADirectory {
            path: dir.to_path_buf(),
        },
        Ok(_) => writable(dir, Inspection::Writable),
        Err(_) => inspect_missing(dir),
    }
}

/// `then` if this process may add entries to `dir`, else why not.
fn writable(dir: &Path, then: Inspection) -> Inspection {
    match access(dir, AccessFlags::W_OK | AccessFlags::X_OK) {
        Ok(()) => then,
        Err(e) => Inspection::NotWritable {
            path: dir.to_path_buf(),
            reason: e.desc().to_string(),
        },
    }
}

/// A directory that is not there: `run` creates it if its nearest existing
/// ancestor is a directory it may write to.
fn inspect_missing(dir: &Path) -> Inspection {
    let nearest = dir
        .ancestors()
        .skip(1)
        .find_map(|a| std::fs::metadata(a).ok().map(|md| (a, md)));
    match nearest {
        Some((a, md)) if md.is_dir() => writable(
            a,
            Inspection::WillBeCreated {
                ancestor: a.to_path_buf(),
            },
        ),
        Some((a, _)) => Inspection::NotADirectory {
            path: a.to_path_buf(),
        },
        None => Inspection::NotWritable {
            path: dir.to_path_buf(),
            reason: "no existing ancestor directory".into(),
        },
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StateDirError {
    #[error("cannot create state directory {path}: {source}", path = path.display())]
    Create {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("state directory {path} is not writable: {source}", path = path.display())]
    NotWritable {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Creates the directory (mode 0700, leases are private) and proves it is
/// writable by writing and removing a probe file.
pub(crate) fn prepare(dir: &Path) -> Result<(), StateDirError> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|source| StateDirError::Create {
            path: dir.to_path_buf(),
            source,
        })?;
    let probe = dir.join(".write-probe");
    std::fs::write(&probe, b"")
        .and_then(|_| std::fs::remove_file(&probe))
        .map_err(|source| StateDirError::NotWritable {
            path: dir.to_path_buf(),
            source,
        })?;
    Ok(())
}

/// Permission bits of an existing directory, for reports.
#[cfg(test)]
pub(crate) fn mode(dir: &Path) -> Option<u32> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(dir)
        .ok()
        .map(|m| m.permissions().mode() & 0o7777)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_dir_under_writable_parent_will_be_created_and_then_is_writable() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("a/b");
        assert_eq!(
            inspect(&dir),
            Inspection::WillBeCreated {
                ancestor: tmp.path().to_path_buf()
            }
        );
        prepare(&dir).unwrap();
        assert_eq!(inspect(&dir), Inspection::Writable);
        assert_eq!(mode(&dir), Some(0o700));
    }

    #[test]
    fn a_file_in_the_way_is_reported() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("f");
        std::fs::write(&file, "x").unwrap();
        assert!(matches!(inspect(&file), Inspection::NotADirectory { .. }));
        assert!(matches!(
            inspect(&file.join("sub")),
            Inspection::NotADirectory { .. }
        ));
        assert!(prepare(&file.join("sub")).is_err());
    }
}
