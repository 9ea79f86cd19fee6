//! Every program the agent runs is in the image's package list.

use super::*;

/// The programs the agent runs, from its source: `volumes::run("NAME", …)`,
/// the mkfs programs (`FsKind::mkfs_command`), the nfs-ganesha daemon
/// (`--nfs-ganesha`'s default). The process-spawning sites are listed, so
/// a new one fails this test until it is looked at (and its program put in
/// deploy/image/packages.txt).
fn programs_the_agent_runs() -> Result<Vec<String>, Failed> {
    const SPAWN_SITES: &[(&str, &str)] =
        &[("crates/volumes/src/lib.rs", "Command::new(program)"), ("crates/share/src/server.rs", "Command::new(&self.files.binary)")];
    let top = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    let mut dirs = vec![top.join("src"), top.join("crates")];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d)?.flatten() {
            let p = e.path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                files.push(p);
            }
        }
    }
    let mut programs = std::collections::BTreeSet::new();
    let mut sites = Vec::new();
    // The literal after `marker`, with `keep` (the part of the marker that
    // belongs to the name) in front.
    let literal_after = |text: &str, marker: &str, keep: &str, out: &mut std::collections::BTreeSet<String>| {
        for (i, _) in text.match_indices(marker) {
            let rest = &text[i + marker.len()..];
            match rest.find('"') {
                Some(end) if rest[..end].bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)) => {
                    out.insert(format!("{keep}{}", &rest[..end]));
                }
                _ => {}
            }
        }
    };
    for f in &files {
        let whole = std::fs::read_to_string(f)?;
        // A crate's unit tests may run peers (nbdkit, qemu-nbd): not the agent's programs.
        let text = whole.split("#[cfg(test)]\nmod tests").next().unwrap_or_default();
        let rel = f.strip_prefix(Path::new(env!("CARGO_MANIFEST_DIR"))).unwrap_or(f).to_string_lossy().into_owned();
        for (i, _) in text.match_indices("Command::new(") {
            let end = text[i..].find(')').map(|e| i + e + 1).unwrap_or(text.len());
            sites.push((rel.clone(), text[i..end].to_string()));
        }
        literal_after(text, " run(\"", "", &mut programs);
        literal_after(text, "(run(\"", "", &mut programs);
        literal_after(text, "\"mkfs.", "mkfs.", &mut programs);
        literal_after(text, "VOLRING_NFS_GANESHA\", default_value = \"", "", &mut programs);
    }
    let programs: Vec<String> = programs.into_iter().collect();
    let unknown: Vec<String> = sites
        .iter()
        .filter(|(f, call)| !SPAWN_SITES.iter().any(|(sf, sc)| f == sf && call == sc))
        .map(|(f, c)| format!("{f}: {c}"))
        .collect();
    if !unknown.is_empty() {
        return Err(format!(
            "process spawns this test does not know (list them in SPAWN_SITES, their programs in deploy/image/packages.txt): {unknown:?}"
        )
        .into());
    }
    Ok(programs)
}
/// deploy/image/packages.txt: each package with the programs the agent
/// runs from it.
fn image_packages() -> Result<Vec<(String, Vec<String>)>, Failed> {
    let text = std::fs::read_to_string(root().join("image/packages.txt"))?;
    Ok(text
        .lines()
        .map(|l| l.split('#').next().unwrap_or(""))
        .filter_map(|l| {
            let mut words = l.split_whitespace().map(String::from);
            words.next().map(|p| (p, words.collect()))
        })
        .collect())
}

/// The Debian package that ships PROGRAM in a bin directory on this
/// machine (`dpkg -S`); None when no installed package does.
fn debian_package_of(program: &str) -> Result<Option<String>, Failed> {
    let out = std::process::Command::new("dpkg").args(["-S", &format!("bin/{program}")]).output()?;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some((packages, path)) = line.split_once(": ") else { continue };
        if line.starts_with("diversion ") || !path.ends_with(&format!("bin/{program}")) {
            continue;
        }
        if Path::new(path).file_name().is_some_and(|n| n == program) {
            return Ok(packages.split(", ").next().map(|p| p.split(':').next().unwrap_or(p).to_string()));
        }
    }
    Ok(None)
}

/// Every program the agent runs is in the image: listed in
/// deploy/image/packages.txt (which build.sh and the Dockerfile install,
/// and build.sh checks on the image's PATH) beside the package that ships
/// it here (`dpkg -S`); the list names no program the agent does not run.
pub(super) fn every_program_the_agent_runs_is_in_the_image() -> Result<(), Failed> {
    let programs = programs_the_agent_runs()?;
    let mut problems = Vec::new();
    for want in ["mkfs.ext4", "mkfs.xfs", "resize2fs", "xfs_growfs", "ganesha.nfsd"] {
        if !programs.iter().any(|p| p == want) {
            problems.push(format!("the scan of src/ and crates/ did not find {want} (found {programs:?}): the scan is out of date"));
        }
    }
    let listed = image_packages()?;
    for p in &programs {
        let Some((package, _)) = listed.iter().find(|(_, progs)| progs.contains(p)) else {
            problems.push(format!("{p}: the agent runs it, deploy/image/packages.txt does not list it"));
            continue;
        };
        match debian_package_of(p)? {
            Some(shipped) if shipped == *package => {}
            Some(shipped) => problems.push(format!("{p}: listed under {package}, but {shipped} ships it (dpkg -S)")),
            None if std::env::var_os("CI").is_some() => {
                problems.push(format!("{p}: no installed package ships it (.ci/deps installs {package})"))
            }
            None => eprintln!("{p}: not installed here, its package not checked (apt-get install {package})"),
        }
    }
    for (package, progs) in &listed {
        for p in progs.iter().filter(|p| !programs.contains(p)) {
            problems.push(format!("{p}: listed under {package} in deploy/image/packages.txt, but the agent does not run it"));
        }
    }
    for reader in ["Dockerfile", "image/build.sh"] {
        if !std::fs::read_to_string(root().join(reader))?.contains("packages.txt") {
            problems.push(format!("deploy/{reader} does not read deploy/image/packages.txt"));
        }
    }
    if !problems.is_empty() {
        return Err(problems.join("\n").into());
    }
    Ok(())
}
