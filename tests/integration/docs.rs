//! The README and `docs/*.md` link to each other and into the tree: every
//! relative link must name a file or folder that exists, and every
//! `#anchor` a heading of the file it points at (GitHub's rule: lower case,
//! spaces become `-`, punctuation other than `-` and `_` dropped). External
//! `http(s)` and `mailto:` links are not fetched.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::harness::tests;

tests! {
    every_relative_link_and_anchor_resolves;
    the_checker_sees_a_broken_link;
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The files whose links are checked: `README.md` and `docs/*.md`.
fn documents() -> Vec<PathBuf> {
    let mut files = vec![repo().join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(repo().join("docs"))
        .expect("docs/")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

/// Markdown text without fenced code blocks and inline code spans, where a
/// `](...)` is not a link. A code span may wrap lines but not cross a
/// paragraph, so spans are matched paragraph by paragraph.
fn prose(text: &str) -> String {
    let mut kept = String::new();
    let mut fence: Option<&str> = None;
    for line in text.lines() {
        let trimmed = line.trim_start();
        let marker = ["```", "~~~"].into_iter().find(|m| trimmed.starts_with(m));
        match (fence, marker) {
            (None, Some(m)) => fence = Some(m),
            (Some(open), Some(m)) if open == m => fence = None,
            (None, None) => kept.push_str(line),
            _ => {}
        }
        kept.push('\n');
    }
    let mut out = String::new();
    for paragraph in kept.split("\n\n") {
        // An unmatched backtick is a literal one: keep the text after it.
        let parts: Vec<&str> = paragraph.split('`').collect();
        let closed = if parts.len() % 2 == 1 {
            parts.len()
        } else {
            parts.len() - 1
        };
        for (i, part) in parts.iter().enumerate() {
            if i % 2 == 0 || i >= closed {
                out.push_str(part);
            }
        }
        out.push_str("\n\n");
    }
    out
}

/// The targets of inline links `[text](target)` and images.
fn links(text: &str) -> Vec<String> {
    let text = prose(text);
    let mut out = Vec::new();
    let mut rest = text.as_str();
    while let Some(i) = rest.find("](") {
        rest = &rest[i + 2..];
        let Some(end) = rest.find(')') else { break };
        let target = rest[..end].trim();
        // `[text](target "title")`
        let target = target.split_whitespace().next().unwrap_or("");
        let target = target.trim_start_matches('<').trim_end_matches('>');
        if !target.is_empty() {
            out.push(target.to_string());
        }
        rest = &rest[end..];
    }
    out
}

/// GitHub's anchor of a heading.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            '-' | '_' => Some(c),
            c if c.is_alphanumeric() => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a Markdown file's headings (`#` to `######`, outside
/// code blocks), with GitHub's `-1`, `-2` suffixes for repeats.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut fence = false;
    for line in text.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
            fence = !fence;
            continue;
        }
        if fence {
            continue;
        }
        let hashes = trimmed.chars().take_while(|&c| c == '#').count();
        if !(1..=6).contains(&hashes) || !trimmed[hashes..].starts_with(' ') {
            continue;
        }
        let base = slug(&trimmed[hashes..].trim().replace('`', ""));
        let mut anchor = base.clone();
        let mut n = 0;
        while out.contains(&anchor) {
            n += 1;
            anchor = format!("{base}-{n}");
        }
        out.insert(anchor);
    }
    out
}

/// What is wrong with one link of `from`, if anything.
fn check(from: &Path, target: &str) -> Option<String> {
    if target.starts_with("http://")
        || target.starts_with("https://")
        || target.starts_with("mailto:")
    {
        return None;
    }
    let (path, anchor) = match target.split_once('#') {
        Some((p, a)) => (p, Some(a)),
        None => (target, None),
    };
    let file = if path.is_empty() {
        from.to_path_buf()
    } else {
        from.parent().unwrap().join(path)
    };
    if !file.exists() {
        return Some(format!("{target}: {} does not exist", file.display()));
    }
    let anchor = anchor?;
    if file.is_dir() || file.extension().is_none_or(|x| x != "md") {
        return Some(format!(
            "{target}: an anchor into a file that is not Markdown"
        ));
    }
    let text = std::fs::read_to_string(&file).unwrap();
    if anchors(&text).contains(anchor) {
        None
    } else {
        Some(format!(
            "{target}: no heading of {} has the anchor #{anchor}",
            file.display()
        ))
    }
}

fn broken(files: &[PathBuf]) -> Vec<String> {
    let mut out = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(file).unwrap();
        for target in links(&text) {
            if let Some(why) = check(file, &target) {
                let name = file.strip_prefix(repo()).unwrap_or(file);
                out.push(format!("{}: {why}", name.display()));
            }
        }
    }
    out
}

fn every_relative_link_and_anchor_resolves() {
    let files = documents();
    assert!(files.len() > 1, "no docs/*.md");
    let total: usize = files
        .iter()
        .map(|f| links(&std::fs::read_to_string(f).unwrap()).len())
        .sum();
    assert!(total > 20, "only {total} links found: is the parser blind?");
    let bad = broken(&files);
    assert!(bad.is_empty(), "broken links:\n{}", bad.join("\n"));
}

/// The checker itself: a missing file, a missing anchor and an anchor in
/// this file are found; good ones, code and external links are not.
fn the_checker_sees_a_broken_link() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("other.md"),
        "# Other\n\n## The `check` and `status` commands\n",
    )
    .unwrap();
    let doc = dir.path().join("doc.md");
    std::fs::write(
        &doc,
        "# Doc\n\n## Failover timing\n\n\
         [ok](other.md) [ok](other.md#the-check-and-status-commands) [ok](#failover-timing)\n\
         [ok](https://example.com/nowhere) `[code](nowhere.md)`\n\n```\n[fenced](nowhere.md)\n```\n\
         [bad](missing.md) [bad](other.md#nowhere) [bad](#failover)\n",
    )
    .unwrap();
    let bad = broken(std::slice::from_ref(&doc));
    assert_eq!(bad.len(), 3, "{bad:#?}");
    assert!(bad[0].contains("missing.md"), "{bad:#?}");
    assert!(bad[1].contains("#nowhere"), "{bad:#?}");
    assert!(bad[2].contains("#failover"), "{bad:#?}");
    assert_eq!(
        slug("`kube-vip.io/ignore` leaks".replace('`', "").as_str()),
        "kube-vipioignore-leaks"
    );
    assert_eq!(slug("What it is, and for whom"), "what-it-is-and-for-whom");
}
