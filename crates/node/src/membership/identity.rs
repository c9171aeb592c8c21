//! A member's identity, as SWIM (`foca`) knows it and the codec writes it.

use std::net::SocketAddrV4;
use std::sync::Arc;

use foca::Identity;

/// A member's identity: its node name (unique in the cluster), where it
/// listens, and which run of its agent it is (a restarted agent is a new
/// identity that wins over the old one at once).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Id {
    pub(crate) name: Arc<str>,
    pub(crate) addr: SocketAddrV4,
    /// When this run of the agent began (Unix ms): also the envelope's epoch.
    pub(crate) run: u64,
    /// Bumped when the cluster declared this run down and it rejoins.
    pub(crate) renewal: u16,
}

impl Identity for Id {
    type Addr = Arc<str>;

    fn renew(&self) -> Option<Self> {
        Some(Id {
            renewal: self.renewal.checked_add(1)?,
            ..self.clone()
        })
    }

    fn addr(&self) -> Arc<str> {
        self.name.clone()
    }

    fn win_addr_conflict(&self, other: &Self) -> bool {
        (self.run, self.renewal) > (other.run, other.renewal)
    }
}
