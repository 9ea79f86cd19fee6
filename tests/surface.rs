//! Each crate keeps a small public API (docs/architecture.md): items are
//! `pub(crate)` unless another crate, the binary, a test, a bench or a fuzz
//! target needs them. This test counts the `pub` items of every crate the
//! way the surface was first measured and fails when one grows past its
//! budget, so the surface cannot grow back unnoticed. A new `pub` item over
//! budget is a question first: can it be `pub(crate)`? When it truly must
//! be public, raise the budget in the same change and say why.

use std::fs;
use std::path::{Path, PathBuf};

/// The budget of each crate (its directory under the workspace root): the
/// count it reached when its items were narrowed (issue 26), plus a margin
/// of three; lower a budget whenever a crate shrinks.
const BUDGETS: &[(&str, usize)] = &[
    ("crates/sys", 50),
    ("crates/ring", 85),
    ("crates/mounts", 66),
    ("crates/devices", 78),
    ("crates/nbd", 91),
    ("crates/volumes", 154),
    ("crates/share", 53),
    ("crates/csi", 66),
    ("crates/kube", 59),
    ("src", 3),
];

/// The whole surface (`crates` and `src` together) may not pass half of
/// what the one-crate build had (1,356 `pub` items at ac8946f): issue 26's
/// proof that the crates' APIs stayed small, not only each within its own
/// margin.
const TOTAL: usize = 1_356 / 2;

/// What counts as a `pub` item: a line that, less its indentation, starts
/// with `pub ` and one of these (the measure's regular expression,
/// `^\s*pub (fn|struct|enum|trait|type|const|static|mod|use|async fn|unsafe fn)`,
/// spelled out so the test needs no regex crate).
const KINDS: &[&str] = &["fn", "struct", "enum", "trait", "type", "const", "static", "mod", "use", "async fn", "unsafe fn"];

fn is_pub_item(line: &str) -> bool {
    line.trim_start().strip_prefix("pub ").is_some_and(|rest| KINDS.iter().any(|k| rest.starts_with(k)))
}

/// Every `.rs` file below `dir`, depth-first; the walk is bounded by the
/// tree on disk (no symlinks are followed).
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> =
        fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())).map(|e| e.expect("dir entry")).collect();
    entries.sort_by_key(|e| e.path());
    for e in entries {
        let kind = e.file_type().expect("file type");
        if kind.is_dir() {
            rust_files(&e.path(), out);
        } else if kind.is_file() && e.path().extension().is_some_and(|x| x == "rs") {
            out.push(e.path());
        }
    }
}

fn count(dir: &Path) -> usize {
    let mut files = Vec::new();
    rust_files(dir, &mut files);
    files
        .iter()
        .map(|f| fs::read_to_string(f).unwrap_or_else(|e| panic!("{}: {e}", f.display())).lines().filter(|l| is_pub_item(l)).count())
        .sum()
}

#[test]
fn the_measure_counts_what_it_should() {
    for yes in ["pub fn f()", "    pub struct S;", "\tpub async fn g()", "pub use x::Y;", "pub mod m;", "pub unsafe fn h()"] {
        assert!(is_pub_item(yes), "{yes:?}");
    }
    for no in ["pub(crate) fn f()", "fn f()", "// pub fn f()x", "pub(super) struct S;", "    pub name: String,"] {
        assert!(!is_pub_item(no), "{no:?}");
    }
}

#[test]
fn every_crate_stays_within_its_public_budget() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut over = Vec::new();
    let mut report = String::new();
    for (dir, budget) in BUDGETS {
        let n = count(&root.join(dir));
        report.push_str(&format!("{dir}: {n} (budget {budget})\n"));
        if n > *budget {
            over.push(format!("{dir} has {n} pub items, over its budget of {budget}"));
        }
    }
    let total: usize = BUDGETS.iter().map(|(dir, _)| count(&root.join(dir))).sum();
    report.push_str(&format!("total: {total} (at most {TOTAL})\n"));
    if total > TOTAL {
        over.push(format!("{total} pub items in all, over half the one-crate build's ({TOTAL})"));
    }
    let mut crates = Vec::new();
    rust_files(&root.join("crates"), &mut crates);
    let listed: Vec<&str> = BUDGETS.iter().map(|(d, _)| *d).collect();
    for f in crates {
        let krate = f.strip_prefix(root).expect("under the root").iter().take(2).collect::<PathBuf>();
        assert!(listed.contains(&krate.to_str().expect("utf-8 path")), "{} has no budget: add its crate to BUDGETS", f.display());
    }
    assert!(over.is_empty(), "{}\n(make the new items pub(crate) where nothing outside the crate needs them)\n{report}", over.join("\n"));
}
