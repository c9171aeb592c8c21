//! The health vocabulary every subsystem reports in: a three-level
//! [`Status`] and one named [`Check`] result. A leaf module: the kernel,
//! guest-agent and topology layers describe their state with it, and
//! `check`, `status` and `STATUS=` render it, without the layers importing
//! the commands that show them.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Ok,
    Warn,
    Fail,
}

/// One named result, as `check` prints it and `check --output json` emits it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Check {
    pub name: String,
    pub status: Status,
    /// Machine-readable, stable CamelCase reason.
    pub reason: String,
    pub message: String,
    /// What to do about it; empty when nothing needs doing.
    pub remediation: String,
}

impl Check {
    pub fn new(
        name: &str,
        status: Status,
        reason: &str,
        message: String,
        remediation: &str,
    ) -> Self {
        Self {
            name: name.into(),
            status,
            reason: reason.into(),
            message,
            remediation: remediation.into(),
        }
    }
}
