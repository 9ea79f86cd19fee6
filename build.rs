//! `volring --version` names the commit it was built from. (The CSI
//! protocol is compiled by crates/csi's own build script.)

fn main() {
    git_commit();
}

/// `volring --version` names the commit it was built from (HEAD's short
/// hash; uncommitted changes are not noted). Outside a git checkout (a
/// source tarball, the image build without `.git`) it says nothing.
fn git_commit() {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let version = std::env::var("CARGO_PKG_VERSION").unwrap_or_default();
    let Some(hash) = git(&["rev-parse", "--short=12", "HEAD"]) else {
        // A source tree without git (an archive): the version alone.
        println!("cargo:rustc-env=VOLRING_VERSION={version}");
        return;
    };
    println!("cargo:rustc-env=VOLRING_VERSION={version} (commit {hash})");
    // Rebuilt when HEAD moves (a commit, a checkout), not on every build.
    if let Some(dir) = git(&["rev-parse", "--git-dir"]) {
        let dir = std::path::Path::new(&dir);
        if dir.join("HEAD").exists() {
            println!("cargo:rerun-if-changed={}", dir.join("HEAD").display());
        }
        if let Some(head) = git(&["symbolic-ref", "-q", "HEAD"]) {
            if dir.join(&head).exists() {
                println!("cargo:rerun-if-changed={}", dir.join(head).display());
            }
        }
    }
}
