//! Giving freed heap back to the kernel after a large pass.
//!
//! glibc's allocator keeps what a burst of work freed: each thread's arena
//! is trimmed only from its top, so pages freed in the middle stay
//! resident. A controller that decided 10,000 Services during their
//! creation kept that peak as its resident size at rest, well above what
//! its caches hold. `malloc_trim` hands every arena's free pages back. It
//! walks the free lists (milliseconds for a heap of a few hundred MiB), so
//! it runs at most once per [`EVERY`], and only after a pass ran since the
//! last time.

use std::time::Duration;

use tokio::time::Instant;

/// At most this often.
pub(crate) const EVERY: Duration = Duration::from_secs(10);

/// When to trim: after work, not more often than [`EVERY`].
#[derive(Debug)]
pub(crate) struct Trimmer {
    last: Instant,
    worked: bool,
}

impl Trimmer {
    pub(crate) fn new(now: Instant) -> Trimmer {
        Trimmer {
            last: now,
            worked: false,
        }
    }

    /// A pass ran: its garbage is freed by now.
    pub(crate) fn worked(&mut self) {
        self.worked = true;
    }

    /// Whether to trim now; if so, the next one waits [`EVERY`].
    pub(crate) fn due(&mut self, now: Instant) -> bool {
        if self.worked && now.saturating_duration_since(self.last) >= EVERY {
            self.last = now;
            self.worked = false;
            true
        } else {
            false
        }
    }
}

/// Hands the allocator's free pages back to the kernel.
pub(crate) fn trim() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only reorganizes the allocator's own free
    // lists; it takes no pointer and is thread-safe (it locks each arena).
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_after_work_and_not_more_often_than_every() {
        let t0 = Instant::now();
        let mut t = Trimmer::new(t0);
        assert!(!t.due(t0 + EVERY), "no work yet");
        t.worked();
        assert!(!t.due(t0 + EVERY / 2), "too soon");
        assert!(t.due(t0 + EVERY));
        assert!(!t.due(t0 + EVERY * 3), "no work since");
        t.worked();
        assert!(!t.due(t0 + EVERY + EVERY / 2));
        assert!(t.due(t0 + EVERY * 2));
    }
}
