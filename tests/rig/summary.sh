# Sourced by tests/run.sh and tests/long.sh: the closing lines of a test
# run, repeated from its log ($log, the test binaries' stdout) so that a
# log cut to its tail still shows them: each failed test's message,
# shortened (`failed: NAME: ...`), the integration runs' `durations: ...`
# lines (their time per module and the longest tests), then their
# `skipped: N of M ...` summaries, also when something failed.
#
# The sourcing script sets `log` to a file and calls `trap closing_summary
# EXIT`.

closing_summary() {
    local lines
    # Each failed test's message again, shortened, where a log cut to its
    # head and tail still shows it.
    awk '/^---- .* ----$/ { name = $2; n = 0; next }
         name != "" && /^$/ { name = ""; next }
         name != "" && n < 6 { print "failed: " name ": " substr($0, 1, 300); n++ }' \
        "$log" 2>/dev/null || true
    # Where the integration runs' time went (per module, the longest tests).
    grep -h '^durations: ' "$log" 2>/dev/null || true
    lines="$(grep -h '^skipped: ' "$log" 2>/dev/null || true)"
    echo "${lines:-skipped: unknown (the integration tests did not run to their end)}"
    rm -f "$log"
}
