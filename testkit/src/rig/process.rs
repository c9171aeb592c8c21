//! Small process helpers shared by the rig: running commands with good
//! errors, supervised children that are always stopped, random tokens.

use std::ffi::OsStr;
use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use nix::sys::signal::{SigSet, SigmaskHow, Signal, kill, pthread_sigmask};
use nix::unistd::Pid;

/// Runs `cmd` to completion and returns its stdout; a non-zero exit is an
/// error that quotes the command line and its stderr.
pub fn run(cmd: &mut Command) -> Result<String> {
    let desc = describe(cmd);
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("cannot run `{desc}`"))?;
    if !out.status.success() {
        bail!(
            "`{desc}` failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim(),
            String::from_utf8_lossy(&out.stdout).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `run` for a program and a list of arguments.
pub fn run_args<S: AsRef<OsStr>>(
    program: &str,
    args: impl IntoIterator<Item = S>,
) -> Result<String> {
    run(Command::new(program).args(args))
}

/// The command line of `cmd`, for messages.
pub fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// The last `lines` lines of a (log) file, or a note saying it cannot be read.
pub fn tail(path: &Path, lines: usize) -> String {
    let mut f = match File::open(path) {
        Ok(f) => f,
        Err(e) => return format!("<cannot read {}: {e}>", path.display()),
    };
    // Only look at the last 64 KiB: logs can be large.
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(64 * 1024)));
    let mut buf = Vec::new();
    let _ = f.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// `n` random bytes from the kernel, hex encoded.
pub fn random_hex(n: usize) -> String {
    let mut buf = vec![0u8; n];
    File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut buf))
        .expect("read /dev/urandom");
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether a process with this pid exists (zombies count as existing).
pub fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// A child process the rig started. It is stopped (SIGTERM, then SIGKILL
/// after a grace period) and reaped by [`ChildProc::stop`] or on drop.
pub struct ChildProc {
    name: String,
    child: Option<Child>,
    log: PathBuf,
}

impl ChildProc {
    /// Spawns `cmd` with stdin from /dev/null and stdout+stderr appended to
    /// `log`.
    pub fn spawn(name: &str, mut cmd: Command, log: &Path) -> Result<ChildProc> {
        let out = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("open {}", log.display()))?;
        let err = out.try_clone()?;
        let desc = describe(&cmd);
        // std::process::Command does not reset the signal mask: a child of a
        // thread that blocks SIGTERM (e.g. for sigwait) would ignore our
        // SIGTERM. Start every child with an empty mask.
        // SAFETY: pthread_sigmask is async-signal-safe; nothing allocates.
        unsafe {
            cmd.pre_exec(|| {
                pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None)?;
                Ok(())
            });
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("cannot start {name}: `{desc}`"))?;
        Ok(ChildProc {
            name: name.to_string(),
            child: Some(child),
            log: log.to_path_buf(),
        })
    }

    /// The child's pid (None once it was stopped).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// The log file its output goes to.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// `Some(status)` if the child has exited already.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// An error saying the child exited, with the tail of its log.
    pub fn exit_error(&self, status: ExitStatus) -> anyhow::Error {
        anyhow::anyhow!(
            "{} exited early ({status}); last lines of {}:\n{}",
            self.name,
            self.log.display(),
            tail(&self.log, 40)
        )
    }

    /// Sends SIGTERM, waits up to `grace`, then SIGKILL; always reaps.
    /// Idempotent.
    pub fn stop_with(&mut self, grace: Duration) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if matches!(child.try_wait(), Ok(Some(_))) {
            return;
        }
        let pid = Pid::from_raw(child.id() as i32);
        let _ = kill(pid, Signal::SIGTERM);
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if matches!(child.try_wait(), Ok(Some(_)) | Err(_)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!(
            "rig: {} did not stop after SIGTERM, sending SIGKILL",
            self.name
        );
        let _ = child.kill();
        let _ = child.wait();
    }

    /// [`ChildProc::stop_with`] a 5 s grace period.
    pub fn stop(&mut self) {
        self.stop_with(Duration::from_secs(5));
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        self.stop();
    }
}
