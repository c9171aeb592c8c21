//! The hypervisor's end of qemu-guest-agent: the QGA protocol (one JSON
//! command per line, one JSON answer per line) over the host socket of a
//! `org.qemu.guest_agent.0` virtio-serial channel, as Harvester's
//! virt-launcher speaks it. [`Qga::exec`] runs a command in the guest and
//! returns its exit status and output (`guest-exec` + `guest-exec-status`).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

/// A connection to a guest's qemu-ga.
pub struct Qga {
    socket: PathBuf,
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    next_id: u64,
}

/// A finished `guest-exec`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutput {
    /// The exit code, or `None` when the process ended by a signal.
    pub exit_code: Option<i64>,
    pub stdout: String,
    pub stderr: String,
}

impl ExecOutput {
    /// Whether the command exited with 0.
    pub fn success(&self) -> bool {
        self.exit_code == Some(0)
    }
}

impl std::fmt::Display for ExecOutput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit {:?}\n--- stdout\n{}--- stderr\n{}",
            self.exit_code, self.stdout, self.stderr
        )
    }
}

impl Qga {
    /// Connects to the host end of the channel at `socket` (qemu's
    /// `-chardev socket,server=on,wait=off`) once qemu has created it, and
    /// waits until the guest's agent answers a `guest-sync`: the guest has
    /// booted far enough to run qemu-ga. Fails at `deadline`.
    pub fn connect(socket: &Path, deadline: Instant) -> Result<Qga> {
        let stream = loop {
            match UnixStream::connect(socket) {
                Ok(s) => break s,
                Err(e) if Instant::now() > deadline => {
                    bail!("qemu never opened {}: {e}", socket.display())
                }
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        };
        stream.set_read_timeout(Some(Duration::from_secs(3)))?;
        let mut qga = Qga {
            socket: socket.to_path_buf(),
            reader: BufReader::new(stream.try_clone()?),
            writer: stream,
            next_id: std::process::id() as u64 * 1_000_000,
        };
        loop {
            if qga.sync().is_ok() {
                return Ok(qga);
            }
            if Instant::now() > deadline {
                bail!(
                    "qemu-ga never answered guest-sync on {}",
                    qga.socket.display()
                );
            }
        }
    }

    /// `guest-sync` with a fresh id; reads answers until the one with that
    /// id, so answers left over from earlier (timed-out) commands are
    /// skipped. Fails after one read timeout without the answer.
    fn sync(&mut self) -> Result<()> {
        self.next_id += 1;
        let id = self.next_id;
        self.send(&json!({"execute": "guest-sync", "arguments": {"id": id}}))?;
        loop {
            let answer = self.read()?;
            if answer["return"].as_u64() == Some(id) {
                return Ok(());
            }
        }
    }

    fn send(&mut self, cmd: &Value) -> Result<()> {
        let mut line = serde_json::to_vec(cmd)?;
        line.push(b'\n');
        self.writer
            .write_all(&line)
            .with_context(|| format!("write to {}", self.socket.display()))
    }

    /// One answer line (a read timeout is an error).
    fn read(&mut self) -> Result<Value> {
        loop {
            let mut line = Vec::new();
            let n = self
                .reader
                .read_until(b'\n', &mut line)
                .with_context(|| format!("read from {}", self.socket.display()))?;
            if n == 0 {
                bail!("{} closed (the VM is gone)", self.socket.display());
            }
            // qemu-ga may send 0xff sync bytes before an answer.
            line.retain(|&b| b != 0xff);
            if let Ok(v) = serde_json::from_slice::<Value>(line.trim_ascii()) {
                return Ok(v);
            }
        }
    }

    /// Runs one command and returns its `return` value.
    pub fn execute(&mut self, command: &str, arguments: Value) -> Result<Value> {
        self.sync()
            .with_context(|| format!("qemu-ga did not answer before {command}"))?;
        self.send(&json!({"execute": command, "arguments": arguments}))?;
        let answer = self
            .read()
            .with_context(|| format!("no answer to {command}"))?;
        if let Some(err) = answer.get("error") {
            bail!("{command} failed: {err}");
        }
        Ok(answer["return"].clone())
    }

    /// `guest-ping`.
    pub fn ping(&mut self) -> Result<()> {
        self.execute("guest-ping", json!({})).map(|_| ())
    }

    /// Runs `argv` in the guest (as qemu-ga's user, root) and waits up to
    /// `timeout` for it to end; its output is captured.
    pub fn exec(&mut self, argv: &[&str], timeout: Duration) -> Result<ExecOutput> {
        let (path, args) = argv.split_first().context("empty argv")?;
        let started = self.execute(
            "guest-exec",
            json!({"path": path, "arg": args, "capture-output": true}),
        )?;
        let pid = started["pid"]
            .as_i64()
            .with_context(|| format!("guest-exec returned no pid: {started}"))?;
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_millis(50);
        loop {
            let st = self.execute("guest-exec-status", json!({"pid": pid}))?;
            if st["exited"].as_bool() == Some(true) {
                return Ok(ExecOutput {
                    exit_code: st["exitcode"].as_i64(),
                    stdout: decode_field(&st, "out-data")?,
                    stderr: decode_field(&st, "err-data")?,
                });
            }
            if Instant::now() > deadline {
                bail!("{argv:?} still running in the guest after {timeout:?}");
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(500));
        }
    }

    /// [`Qga::exec`] of `sh -c script`.
    pub fn sh(&mut self, script: &str, timeout: Duration) -> Result<ExecOutput> {
        self.exec(&["/bin/sh", "-c", script], timeout)
    }
}

fn decode_field(status: &Value, field: &str) -> Result<String> {
    match status[field].as_str() {
        None => Ok(String::new()),
        Some(b64) => {
            let bytes = base64_decode(b64).with_context(|| format!("{field} is not base64"))?;
            Ok(String::from_utf8_lossy(&bytes).into_owned())
        }
    }
}

/// Standard base64 (with or without padding), as qemu-ga encodes output.
pub fn base64_decode(text: &str) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    let mut acc: u32 = 0;
    let mut bits = 0;
    for c in text.bytes() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            b'=' | b'\n' | b'\r' => continue,
            _ => bail!("byte {c:#x} is not base64"),
        };
        acc = (acc << 6) | v as u32;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::base64_decode;

    #[test]
    fn decodes_base64_with_and_without_padding() {
        assert_eq!(base64_decode("aGVsbG8=").unwrap(), b"hello");
        assert_eq!(base64_decode("aGVsbG8").unwrap(), b"hello");
        assert_eq!(base64_decode("aGk=").unwrap(), b"hi");
        assert_eq!(base64_decode("").unwrap(), b"");
        assert_eq!(base64_decode("AP8=").unwrap(), [0u8, 255]);
        assert!(base64_decode("a*b").is_err());
    }
}
