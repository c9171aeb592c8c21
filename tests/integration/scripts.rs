//! The shell scripts that install and build (tests/, packaging/, .ci/):
//! under `set -o pipefail`, a pipeline into a reader that stops early
//! (`grep -q`, `grep -m`, `head`) fails at random: the reader exits at its
//! first match, the writer dies of SIGPIPE on its next write, and pipefail
//! turns that into the pipeline's status. A fresh machine met it
//! (`kube-vip version | grep -q v1.2.2` failed a cold demo after 14
//! minutes); a warm cache never does. Such a script reads the output whole
//! first (`out="$(cmd)"`, then `[[ $out == *x* ]]` or `grep -q <<<"$out"`).

use std::path::{Path, PathBuf};

use crate::harness::tests;

tests! {
    no_pipeline_into_an_early_exiting_reader_under_pipefail;
    the_check_sees_each_shape;
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn scripts(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            scripts(&p, out);
        } else if p.extension().is_some_and(|x| x == "sh") || p.ends_with(".ci/run") {
            out.push(p);
        }
    }
}

/// The lines of `text` (a script) that pipe into a reader that may stop
/// before its writer does, when the script sets pipefail; comments ignored.
fn early_exit_pipes(text: &str) -> Vec<(usize, String)> {
    if !text.contains("pipefail") {
        return Vec::new();
    }
    text.lines()
        .enumerate()
        .filter(|(_, line)| {
            let code = line.split(" #").next().unwrap_or("");
            // `a || b` is no pipeline: only single bars separate stages.
            let code = code.replace("||", "\u{0}");
            !code.trim_start().starts_with('#') && code.split('|').skip(1).any(stops_early)
        })
        .map(|(i, line)| (i + 1, line.trim().to_string()))
        .collect()
}

/// A pipeline stage that may exit before reading all its input: `head`, or
/// `grep` with a flag that stops at the first match.
fn stops_early(stage: &str) -> bool {
    let mut words = stage.split_whitespace();
    match words.next() {
        Some("head") => true,
        Some("grep") => words.take_while(|w| w.starts_with('-')).any(|w| {
            w == "--quiet"
                || w.starts_with("--max-count")
                || (!w.starts_with("--") && (w.contains('q') || w.contains('m')))
        }),
        _ => false,
    }
}

fn no_pipeline_into_an_early_exiting_reader_under_pipefail() -> anyhow::Result<()> {
    let mut files = Vec::new();
    for dir in ["tests", "packaging", ".ci", "kiwi"] {
        scripts(&repo().join(dir), &mut files);
    }
    files.sort();
    anyhow::ensure!(
        files.len() >= 8,
        "found only {} scripts: {files:?}",
        files.len()
    );
    let mut found = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f)?;
        for (n, line) in early_exit_pipes(&text) {
            found.push(format!(
                "{}:{n}: {line}",
                f.strip_prefix(repo()).unwrap_or(f).display()
            ));
        }
    }
    anyhow::ensure!(
        found.is_empty(),
        "pipelines into a reader that exits early, under pipefail (read the output whole first):\n{}",
        found.join("\n")
    );
    Ok(())
}

fn the_check_sees_each_shape() -> anyhow::Result<()> {
    let script = |body: &str| format!("#!/bin/bash\nset -euo pipefail\n{body}\n");
    for bad in [
        "kube-vip version 2>&1 | grep -q v1.2.2 || die",
        "x=$(find . -name '*.deb' | head -1)",
        "if cargo install --list | grep -qx 'cargo-deb v3.8.0:'; then :; fi",
        "dpkg-query -W p | grep -m1 ok",
    ] {
        anyhow::ensure!(early_exit_pipes(&script(bad)).len() == 1, "not seen: {bad}");
    }
    for fine in [
        "out=\"$(kube-vip version 2>&1)\"; grep -q v1.2.2 <<<\"$out\"",
        "x=$(find . -name '*.deb' | sed -n 1p)",
        "bash prereqs.sh | tail -n1",
        "# a comment: cmd | grep -q x",
        "[[ -x a ]] || grep -q x file",
        "cmd | grep -v x | sort",
    ] {
        anyhow::ensure!(
            early_exit_pipes(&script(fine)).is_empty(),
            "flagged: {fine}"
        );
    }
    // Without pipefail the pipeline's status is grep's: not flagged.
    anyhow::ensure!(early_exit_pipes("cmd | grep -q x\n").is_empty());
    Ok(())
}
