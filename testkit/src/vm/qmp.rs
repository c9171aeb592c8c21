//! The QEMU Machine Protocol, as a hypervisor drives a VM: JSON lines over
//! the unix socket of `-qmp unix:<path>,server=on,wait=off`. Enough of it
//! for live migration (`migrate`, `query-migrate`), pausing (`stop`,
//! `cont`) and asking the guest to announce itself (`announce-self`).
//!
//! Synchronous: one command at a time, its answer read before the next;
//! asynchronous events that arrive in between are kept with the time they
//! were read ([`Qmp::events`]).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

/// An event QEMU sent on its own (`STOP`, `RESUME`, `MIGRATION`, …).
#[derive(Debug, Clone)]
pub struct QmpEvent {
    /// When the client read it.
    pub read_at: Instant,
    /// Its `event` field.
    pub name: String,
    /// Its `data` field (`Null` when it has none).
    pub data: Value,
}

/// A connection to one QEMU's monitor, in command mode.
pub struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    events: Vec<QmpEvent>,
}

impl Qmp {
    /// Connects to the monitor socket at `path` (retrying until QEMU has
    /// made it, or `deadline`), reads the greeting and leaves negotiation
    /// mode.
    pub fn connect(path: &Path, deadline: Instant) -> Result<Qmp> {
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => {
                    return Err(e).with_context(|| format!("QMP socket {}", path.display()));
                }
            }
        };
        stream.set_read_timeout(Some(Duration::from_secs(60)))?;
        let mut qmp = Qmp {
            reader: BufReader::new(stream.try_clone()?),
            writer: stream,
            events: Vec::new(),
        };
        let greeting = qmp.read_message()?;
        if greeting.get("QMP").is_none() {
            bail!("QMP: expected the greeting, got {greeting}");
        }
        qmp.execute("qmp_capabilities", json!({}))?;
        Ok(qmp)
    }

    /// Runs `command` with `arguments` and returns its `return` value; a
    /// QMP `error` is an error quoting its class and description.
    pub fn execute(&mut self, command: &str, arguments: Value) -> Result<Value> {
        let mut line = serde_json::to_vec(&json!({"execute": command, "arguments": arguments}))?;
        line.push(b'\n');
        self.writer
            .write_all(&line)
            .with_context(|| format!("QMP: sending {command}"))?;
        loop {
            let msg = self.read_message()?;
            if let Some(ret) = msg.get("return") {
                return Ok(ret.clone());
            }
            if let Some(err) = msg.get("error") {
                bail!(
                    "QMP {command}: {}: {}",
                    err["class"].as_str().unwrap_or("?"),
                    err["desc"].as_str().unwrap_or("?")
                );
            }
        }
    }

    /// The events read so far, oldest first.
    pub fn events(&self) -> &[QmpEvent] {
        &self.events
    }

    /// Reads one message; an event is recorded and the next read.
    fn read_message(&mut self) -> Result<Value> {
        loop {
            let mut line = String::new();
            let n = self
                .reader
                .read_line(&mut line)
                .context("QMP: reading from the monitor")?;
            if n == 0 {
                bail!("QMP: the monitor closed the connection (QEMU exited?)");
            }
            let msg: Value = serde_json::from_str(line.trim())
                .with_context(|| format!("QMP: not JSON: {line:?}"))?;
            if let Some(name) = msg.get("event").and_then(Value::as_str) {
                self.events.push(QmpEvent {
                    read_at: Instant::now(),
                    name: name.to_string(),
                    data: msg.get("data").cloned().unwrap_or(Value::Null),
                });
                continue;
            }
            return Ok(msg);
        }
    }
}
