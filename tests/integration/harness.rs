//! The harness of the integration tests: every test declares what it needs
//! from the machine ([`Prereq`]); `main` probes each prerequisite once,
//! before any test runs, and then
//!
//! - when everything a test needs is there, runs it;
//! - when something is missing and this is a non-root run outside CI
//!   (`CI` is not `true`), registers the test as ignored, so cargo's closing
//!   line counts it, and prints one `skipped: ...` line after the run saying
//!   how many were skipped and why;
//! - when something is missing and this is a root run or CI, runs the test,
//!   which fails at once naming what is missing and the command that
//!   installs it. Only a non-root run may skip.
//!
//! `--ignored` / `--include-ignored` run skipped tests anyway (they then fail
//! with the same message). Filtering, `--list`, `--exact`, `--skip` and
//! `--test-threads` work as with the built-in harness (libtest-mimic).
//! Output is not captured: a test's stderr shows as it runs, and a failure's
//! message is printed at once (`FAILED <name>: ...`) as well as at the end.
//! A test marked `#[alone]` runs with no other test beside it.
//!
//! `HNA_TEST_AS_NONROOT=1` makes a root run behave like a non-root one
//! (outside CI only), to see the skip path without another user.
//!
//! `HNA_TEST_SET=ci` leaves out the [`LONG_SUITES`] (tests/run.sh, CI) and
//! says how many in its closing line; `HNA_TEST_SET=long` runs only them
//! (tests/long.sh); unset, every test runs.

use std::collections::BTreeMap;
use std::process::ExitCode;

use hna_testkit::prereq::{self, Missing, Prereq};
use libtest_mimic::{Arguments, Failed, Trial};

/// One integration test: `module::name`, what it needs, and its body.
pub struct Test {
    pub name: String,
    pub needs: &'static [Prereq],
    /// Runs with no other test beside it. For the tests that judge how
    /// long something took under injected faults (the soak, the flaky API
    /// server): every rig shares this machine's CPUs and one kernel (its
    /// RTNL lock, its scheduler), so another test's rig deleting
    /// namespaces or probing thousands of times a second delays this
    /// one's agents, controllers and fault proxy in ways no real node
    /// sees from its neighbours.
    pub alone: bool,
    pub run: fn() -> Result<(), Failed>,
}

/// Held for reading by every test, for writing by a test that runs alone.
/// std's RwLock makes new readers wait behind a waiting writer, so a test
/// that runs alone starts as soon as the tests already running end.
static RUNNING: std::sync::RwLock<()> = std::sync::RwLock::new(());

/// How long each test that ran took, for the closing `durations:` lines
/// (docs/testing.md: where CI's time goes).
static DURATIONS: std::sync::Mutex<Vec<(String, std::time::Duration)>> =
    std::sync::Mutex::new(Vec::new());

/// What a test body may return: `()` (it panics on failure) or a `Result`.
pub trait Outcome {
    fn into_outcome(self) -> Result<(), Failed>;
}

impl Outcome for () {
    fn into_outcome(self) -> Result<(), Failed> {
        Ok(())
    }
}

impl Outcome for anyhow::Result<()> {
    fn into_outcome(self) -> Result<(), Failed> {
        self.map_err(|e| failure_message(&e).into())
    }
}

/// An error and its causes, one per line. Not `{:?}`: under
/// `RUST_BACKTRACE=1` (as on the CI machine) that appends anyhow's
/// backtrace, dozens of lines that push the message itself out of a
/// shortened log.
fn failure_message(e: &anyhow::Error) -> String {
    let mut message = e.to_string();
    for cause in e.chain().skip(1) {
        message.push_str("\n  caused by: ");
        message.push_str(&cause.to_string());
    }
    message
}

/// Declares a module's tests: `tests! { name_a; name_b: Root, Dnsmasq; }`
/// defines `pub fn tests() -> Vec<Test>` with one entry per function, named
/// `<module>::<function>`, needing the listed [`Prereq`]s. `#[alone]` before
/// a name makes that test run with no other test beside it ([`Test::alone`]).
macro_rules! tests {
    ($($(#[$mark:ident])? $f:ident $(: $($need:ident),+)?);* $(;)?) => {
        pub fn tests() -> Vec<$crate::harness::Test> {
            let module = module_path!().rsplit("::").next().unwrap_or_default();
            vec![$(
                $crate::harness::Test {
                    name: format!("{module}::{}", stringify!($f)),
                    needs: &[$($(hna_testkit::prereq::Prereq::$need),+)?],
                    alone: $crate::harness::marked!($($mark)?),
                    run: || $crate::harness::Outcome::into_outcome($f()),
                }
            ),*]
        }
    };
}
/// The one mark `tests!` knows; any other is a compile error.
macro_rules! marked {
    () => {
        false
    };
    (alone) => {
        true
    };
}
pub(crate) use {marked, tests};

/// The environment the tests run in, probed once.
struct Machine {
    /// Missing prerequisites (of those some test needs), by prerequisite.
    missing: BTreeMap<Prereq, Missing>,
    /// Root or CI: a missing prerequisite fails instead of skipping.
    strict: bool,
}

impl Machine {
    fn probe(tests: &[Test]) -> Machine {
        let in_ci = std::env::var("CI").as_deref() == Ok("true");
        let as_nonroot = !in_ci && std::env::var("HNA_TEST_AS_NONROOT").as_deref() == Ok("1");
        let is_root = prereq::is_root() && !as_nonroot;
        let mut missing = BTreeMap::new();
        for &p in tests.iter().flat_map(|t| t.needs) {
            if missing.contains_key(&p) {
                continue;
            }
            let found = match p {
                Prereq::Root if is_root => Ok(()),
                Prereq::Root => Err(root_missing()),
                _ => p.probe(),
            };
            if let Err(m) = found {
                missing.insert(p, m);
            }
        }
        Machine {
            missing,
            strict: is_root || in_ci,
        }
    }

    fn missing_for(&self, test: &Test) -> Vec<&Missing> {
        test.needs
            .iter()
            .filter_map(|p| self.missing.get(p))
            .collect()
    }
}

/// The `Missing` of root (also under `HNA_TEST_AS_NONROOT=1`).
fn root_missing() -> Missing {
    match Prereq::Root.probe() {
        Err(m) => m,
        Ok(()) => Missing {
            prereq: Prereq::Root,
            what: "root (HNA_TEST_AS_NONROOT=1 pretends this is a non-root run)".into(),
            install: "unset HNA_TEST_AS_NONROOT".into(),
        },
    }
}

/// The failure of a test whose prerequisites are missing.
fn prerequisite_failure(missing: &[Missing]) -> Failed {
    let lines: Vec<String> = missing.iter().map(|m| format!("  - {m}")).collect();
    format!(
        "prerequisites missing (`{}` installs them all):\n{}",
        prereq::INSTALL_ALL,
        lines.join("\n")
    )
    .into()
}

/// The one-line summary of skipped tests, e.g.
/// `skipped: 26 of 36 integration tests (26 need root; 10 need kube-apiserver; ...)`.
fn summary(selected: usize, skipped: &[Vec<Prereq>]) -> String {
    if skipped.is_empty() {
        return format!("skipped: 0 of {selected} integration tests");
    }
    let mut by_prereq: BTreeMap<Prereq, usize> = BTreeMap::new();
    for needs in skipped {
        for p in needs {
            *by_prereq.entry(*p).or_default() += 1;
        }
    }
    let why: Vec<String> = by_prereq
        .iter()
        .map(|(p, n)| format!("{n} need {}", p.label()))
        .collect();
    format!(
        "skipped: {} of {selected} integration tests ({}); `{}` installs what is missing, then run them as root",
        skipped.len(),
        why.join("; "),
        prereq::INSTALL_ALL
    )
}

/// The suites that do not fit CI's hour on a cold machine (issue #31:
/// their prerequisites take long to build, they boot a whole VM image
/// under TCG, or they run alone for minutes): `tests/long.sh` runs them
/// (`HNA_TEST_SET=long`),
/// `tests/run.sh` and CI leave them out (`HNA_TEST_SET=ci`) and say so in
/// their closing line. docs/testing.md, "The long suites".
pub const LONG_SUITES: &[&str] = &["vm_image::", "peers::", "harvester_ccm::", "flaky_api::"];

/// Which tests `HNA_TEST_SET` selects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TestSet {
    /// Every test (unset, or `all`).
    All,
    /// All but the [`LONG_SUITES`].
    Ci,
    /// The [`LONG_SUITES`] only.
    Long,
}

impl TestSet {
    fn from_env() -> Result<TestSet, String> {
        match std::env::var("HNA_TEST_SET").as_deref() {
            Err(_) | Ok("") | Ok("all") => Ok(TestSet::All),
            Ok("ci") => Ok(TestSet::Ci),
            Ok("long") => Ok(TestSet::Long),
            Ok(other) => Err(format!(
                "HNA_TEST_SET={other:?}: must be `ci` (tests/run.sh), `long` (tests/long.sh) or `all` (the default)"
            )),
        }
    }

    fn keeps(self, name: &str) -> bool {
        let long = LONG_SUITES.iter().any(|s| name.starts_with(s));
        match self {
            TestSet::All => true,
            TestSet::Ci => !long,
            TestSet::Long => long,
        }
    }
}

/// What the closing line adds for the long tests a `ci` run left out,
/// e.g. `; 5 long tests left to `sudo tests/long.sh` (peers:: 2, ...)`.
fn left_out_note(left_out: &[String]) -> String {
    if left_out.is_empty() {
        return String::new();
    }
    let mut by_suite: BTreeMap<&str, usize> = BTreeMap::new();
    for name in left_out {
        let suite = name.split("::").next().unwrap_or(name);
        *by_suite.entry(suite).or_default() += 1;
    }
    let suites: Vec<String> = by_suite
        .iter()
        .map(|(suite, n)| format!("{suite}:: {n}"))
        .collect();
    format!(
        "; {} long tests left to `sudo tests/long.sh` ({})",
        left_out.len(),
        suites.join(", ")
    )
}

/// Runs `tests` as the process's test harness.
pub fn main(mut tests: Vec<Test>) -> ExitCode {
    let args = Arguments::from_args();
    let set = match TestSet::from_env() {
        Ok(set) => set,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    // Several name filters at once (libtest takes one): `HNA_TEST_FILTERS`
    // holds space-separated substrings, and a test runs if its name has
    // any of them. tests/long.sh runs the API-facing suites this way on the
    // oldest supported Kubernetes release.
    if let Ok(filters) = std::env::var("HNA_TEST_FILTERS") {
        let filters: Vec<&str> = filters.split_whitespace().collect();
        if !filters.is_empty() {
            tests.retain(|t| filters.iter().any(|f| t.name.contains(f)));
        }
    }
    // After the name filters: what they leave of the long tests is what
    // the closing line counts.
    let mut left_out = Vec::new();
    tests.retain(|t| {
        let keep = set.keeps(&t.name);
        if !keep && set == TestSet::Ci {
            left_out.push(t.name.clone());
        }
        keep
    });
    let machine = Machine::probe(&tests);
    let runs_ignored = args.ignored || args.include_ignored;
    let mut selected = 0;
    let mut skipped: Vec<Vec<Prereq>> = Vec::new();
    let trials: Vec<Trial> = tests
        .into_iter()
        .map(|test| {
            let missing: Vec<Missing> = machine.missing_for(&test).into_iter().cloned().collect();
            let missing_prereqs: Vec<Prereq> = missing.iter().map(|m| m.prereq).collect();
            let skip = !missing.is_empty() && !machine.strict;
            let run = test.run;
            let alone = test.alone;
            let name = test.name.clone();
            let trial = Trial::test(test.name, move || {
                // A test that panicked poisons the lock; the next runs anyway.
                let _alone = alone.then(|| RUNNING.write().unwrap_or_else(|p| p.into_inner()));
                let _beside = (!alone).then(|| RUNNING.read().unwrap_or_else(|p| p.into_inner()));
                let started = std::time::Instant::now();
                let outcome = if missing.is_empty() {
                    run()
                } else {
                    Err(prerequisite_failure(&missing))
                };
                DURATIONS
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push((name.clone(), started.elapsed()));
                // Said at once too, beside the test's own output: the
                // closing list comes after every other test's output, and
                // a log cut short may lose it.
                if let Err(failed) = &outcome {
                    eprintln!(
                        "FAILED {name}: {}",
                        failed.message().unwrap_or("(no message)")
                    );
                }
                outcome
            })
            .with_ignored_flag(skip);
            if !args.is_filtered_out(&trial) {
                selected += 1;
                if skip && !runs_ignored {
                    skipped.push(missing_prereqs);
                }
            }
            trial
        })
        .collect();
    let conclusion = libtest_mimic::run(&args, trials);
    if !args.list {
        let durations = std::mem::take(&mut *DURATIONS.lock().unwrap_or_else(|p| p.into_inner()));
        for line in durations_report(durations) {
            println!("{line}");
        }
        println!(
            "{}{}",
            summary(selected, &skipped),
            left_out_note(&left_out)
        );
    }
    conclusion.exit_code()
}

/// The closing `durations:` lines: the tests' times summed per module,
/// longest first, and the ten longest tests. Tests run side by side (two
/// threads on two cores), so the sums add up to more than the wall time.
fn durations_report(mut durations: Vec<(String, std::time::Duration)>) -> Vec<String> {
    if durations.is_empty() {
        return Vec::new();
    }
    let total: std::time::Duration = durations.iter().map(|(_, d)| *d).sum();
    let mut by_module: BTreeMap<&str, (usize, std::time::Duration)> = BTreeMap::new();
    for (name, took) in &durations {
        let module = name.split("::").next().unwrap_or(name);
        let entry = by_module.entry(module).or_default();
        entry.0 += 1;
        entry.1 += *took;
    }
    let mut modules: Vec<_> = by_module.into_iter().collect();
    modules.sort_by_key(|m| std::cmp::Reverse(m.1.1));
    let modules: Vec<String> = modules
        .iter()
        .map(|(module, (n, took))| format!("{module} {:.0} s ({n})", took.as_secs_f64()))
        .collect();
    let mut lines = vec![format!(
        "durations: {} tests took {:.0} s in all; by module: {}",
        durations.len(),
        total.as_secs_f64(),
        modules.join(", ")
    )];
    durations.sort_by_key(|d| std::cmp::Reverse(d.1));
    let longest: Vec<String> = durations
        .iter()
        .take(10)
        .map(|(name, took)| format!("{name} {:.0} s", took.as_secs_f64()))
        .collect();
    lines.push(format!("durations: the longest: {}", longest.join(", ")));
    lines
}
