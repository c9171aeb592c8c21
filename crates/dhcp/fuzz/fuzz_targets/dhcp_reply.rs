//! Everything a hostile LAN can hand the client: an IPv4/UDP frame as the
//! packet socket delivers it, and the DHCP payload inside, fed to the
//! strict parser and to a state machine in every receiving state.
#![no_main]

use hna_dhcp::fuzzing::exercise;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    exercise(data);
});
