//! The local control socket: `harvester-node-agent status` asks the running
//! daemon for its live state.
//!
//! Protocol: the client connects, writes one request line (`status`), the
//! daemon answers with one JSON document and closes. Root-only (mode 0600):
//! the state names credentials paths and, later, addresses.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

use serde::Serialize;
use serde::de::DeserializeOwned;

const MAX_REQUEST: u64 = 256;
const IO_TIMEOUT: Duration = Duration::from_secs(3);

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("another harvester-node-agent is already answering on {path}; stop it first (systemctl stop harvester-node-agent) or choose another --socket", path = path.display())]
    InUse { path: PathBuf },
    #[error("cannot create the socket directory {path}: {source}", path = path.display())]
    Dir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot listen on {path}: {source}", path = path.display())]
    Bind {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "no daemon answers on {path}: {source}. Is it running? Try `systemctl status harvester-node-agent`, or pass the daemon's --socket",
        path = path.display()
    )]
    NoDaemon {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the daemon on {path} gave an unreadable answer: {reason}", path = path.display())]
    BadAnswer { path: PathBuf, reason: String },
}

/// Binds the control socket, replacing a stale one left by a crashed daemon
/// but refusing to steal it from a live one.
pub(crate) async fn bind(path: &Path) -> Result<UnixListener, ControlError> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|source| ControlError::Dir {
            path: parent.to_path_buf(),
            source,
        })?;
    }
    if path.exists() {
        if UnixStream::connect(path).await.is_ok() {
            return Err(ControlError::InUse {
                path: path.to_path_buf(),
            });
        }
        let _ = std::fs::remove_file(path);
    }
    let listener = UnixListener::bind(path).map_err(|source| ControlError::Bind {
        path: path.to_path_buf(),
        source,
    })?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(|source| {
        ControlError::Bind {
            path: path.to_path_buf(),
            source,
        }
    })?;
    Ok(listener)
}

/// Answers one connection. `status` is called only for a valid request.
/// Generic over the answer so that this transport knows nothing of the
/// daemon's report types.
pub(crate) async fn serve_connection<T: Serialize>(stream: UnixStream, status: impl FnOnce() -> T) {
    let (read, mut write) = stream.into_split();
    let mut line = String::new();
    let mut reader = BufReader::new(read.take(MAX_REQUEST));
    let answer = match tokio::time::timeout(IO_TIMEOUT, reader.read_line(&mut line)).await {
        Ok(Ok(_)) => match line.trim() {
            "status" => serde_json::to_string(&status()).expect("status serializes"),
            other => serde_json::json!({
                "error": format!("unknown request `{other}`; this daemon answers `status`")
            })
            .to_string(),
        },
        _ => return,
    };
    let _ = tokio::time::timeout(IO_TIMEOUT, async {
        write.write_all(answer.as_bytes()).await?;
        write.write_all(b"\n").await?;
        write.shutdown().await
    })
    .await;
}

/// Client side: asks the daemon on `path` for its status.
pub async fn request_status<T: DeserializeOwned>(path: &Path) -> Result<T, ControlError> {
    let no_daemon = |source| ControlError::NoDaemon {
        path: path.to_path_buf(),
        source,
    };
    let bad = |reason: String| ControlError::BadAnswer {
        path: path.to_path_buf(),
        reason,
    };
    let exchange = async {
        let mut stream = UnixStream::connect(path).await.map_err(no_daemon)?;
        stream.write_all(b"status\n").await.map_err(no_daemon)?;
        let mut buf = Vec::new();
        stream
            .take(16 * 1024 * 1024)
            .read_to_end(&mut buf)
            .await
            .map_err(no_daemon)?;
        Ok::<_, ControlError>(buf)
    };
    let buf = tokio::time::timeout(IO_TIMEOUT, exchange)
        .await
        .map_err(|_| bad("no answer within 3s".into()))??;
    serde_json::from_slice(&buf).map_err(|e| bad(e.to_string()))
}
