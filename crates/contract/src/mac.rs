//! MAC addresses as text, the way Go's `HardwareAddr.String()` (and so
//! kube-vip's `hwaddr` annotation) writes them: `00:00:6c:ab:cd:ef`: the
//! form in the contract's annotations and status, read and written by the
//! node daemon, the controller and the command line. (`hna-dhcp` writes the
//! same form in its lease records with a private copy of [`format()`], so it
//! stays free of Kubernetes; a unit test in `hna-node` holds them equal.)

/// `aa:bb:cc:dd:ee:ff`, lowercase.
pub fn format(mac: &[u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// Six two-digit hex bytes separated by `:` or `-`, any case.
pub fn parse(s: &str) -> Option<[u8; 6]> {
    let parts: Vec<u8> = s
        .trim()
        .split([':', '-'])
        .map(|p| {
            (p.len() == 2)
                .then(|| u8::from_str_radix(p, 16).ok())
                .flatten()
        })
        .collect::<Option<_>>()?;
    parts.try_into().ok()
}

/// [`parse`], refusing multicast and all-zero addresses (not a host's).
pub fn parse_unicast(s: &str) -> Option<[u8; 6]> {
    parse(s).filter(|m| m[0] & 0x01 == 0 && *m != [0; 6])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_refusals() {
        let m = [0x00, 0x00, 0x6c, 0xab, 0xcd, 0xef];
        assert_eq!(format(&m), "00:00:6c:ab:cd:ef");
        assert_eq!(parse(&format(&m)), Some(m));
        assert_eq!(parse("00-00-6C-AB-CD-EF"), Some(m));
        for bad in [
            "00:00:6c:ab:cd",
            "00:00:6c:ab:cd:eg",
            "0:00:6c:ab:cd:ef",
            "",
        ] {
            assert_eq!(parse(bad), None, "{bad}");
        }
        assert_eq!(parse_unicast("01:00:5e:00:00:01"), None);
        assert_eq!(parse_unicast("00:00:00:00:00:00"), None);
        assert_eq!(parse_unicast("02:00:00:00:00:01"), Some([2, 0, 0, 0, 0, 1]));
    }
}
