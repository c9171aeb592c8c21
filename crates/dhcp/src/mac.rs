//! MAC addresses as text in this crate's own records (lease status, logs)
//! and in `/proc/net/arp`: `00:00:6c:ab:cd:ef`. The contract's public form
//! (`hna_contract::mac`) is the same; this crate keeps its own two functions
//! so it stays free of Kubernetes, and a unit test in `hna-node` holds the
//! two equal.

/// `aa:bb:cc:dd:ee:ff`, lowercase.
pub(crate) fn format(mac: &[u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// Six two-digit hex bytes separated by `:`, any case (`/proc/net/arp`).
pub(crate) fn parse(s: &str) -> Option<[u8; 6]> {
    let parts: Vec<u8> = s
        .trim()
        .split(':')
        .map(|p| {
            (p.len() == 2)
                .then(|| u8::from_str_radix(p, 16).ok())
                .flatten()
        })
        .collect::<Option<_>>()?;
    parts.try_into().ok()
}
