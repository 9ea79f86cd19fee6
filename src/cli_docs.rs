//! Shell completions and the manual page, both generated from the same
//! clap definition as `--help`, so neither can drift from the flags.

use std::io::Write;

/// Writes the completion script for `shell` to stdout.
pub(crate) fn completions(shell: clap_complete::Shell, cmd: &mut clap::Command) -> anyhow::Result<()> {
    let mut buf = Vec::new();
    clap_complete::generate(shell, cmd, "volring", &mut buf);
    write_stdout(&buf)
}

/// Writes `volring(1)` as roff to stdout: clap_mangen's page for the top
/// command (it renders one command per page), then a section per
/// subcommand, in the order `--help` lists them, with its options, so one
/// page documents every flag.
pub(crate) fn man(cmd: clap::Command) -> anyhow::Result<()> {
    let mut buf = Vec::new();
    let mut cmd = cmd.name("volring");
    cmd.build();
    clap_mangen::Man::new(cmd.clone()).render(&mut buf)?;
    let mut todo: Vec<(String, clap::Command)> = subcommands("volring", &cmd);
    todo.reverse();
    // Pre-order over the (finite) command tree; each command is visited once.
    while let Some((path, sub)) = todo.pop() {
        writeln!(buf, ".SH \"{}\"", path.to_uppercase())?;
        if let Some(about) = sub.get_long_about().or(sub.get_about()) {
            writeln!(buf, "{}", roff_text(&about.to_string()))?;
        }
        if sub.get_arguments().any(|a| !matches!(a.get_id().as_str(), "help" | "version")) {
            let mut opts = Vec::new();
            clap_mangen::Man::new(sub.clone()).render_options_section(&mut opts)?;
            // Options belong to the section above: a subsection, not a
            // second OPTIONS section.
            let opts = String::from_utf8_lossy(&opts).replacen(".SH OPTIONS", ".SS Options", 1);
            buf.extend_from_slice(opts.as_bytes());
        }
        if let Some(after) = sub.get_after_long_help().or(sub.get_after_help()) {
            writeln!(buf, ".PP\n.nf\n{}\n.fi", roff_text(&after.to_string()))?;
        }
        let mut children = subcommands(&path, &sub);
        children.reverse();
        todo.extend(children);
    }
    write_stdout(&buf)
}

fn subcommands(path: &str, cmd: &clap::Command) -> Vec<(String, clap::Command)> {
    cmd.get_subcommands().filter(|s| s.get_name() != "help").map(|s| (format!("{path} {}", s.get_name()), s.clone())).collect()
}

/// Text as a roff paragraph: a leading `.` or `'` would be read as a
/// request, backslashes as escapes.
fn roff_text(s: &str) -> String {
    s.lines()
        .map(|l| {
            let l = l.replace('\\', "\\e");
            if l.starts_with('.') || l.starts_with('\'') {
                format!("\\&{l}")
            } else {
                l
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn write_stdout(buf: &[u8]) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(buf).and_then(|_| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => Ok(r?),
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    /// `volring node --help` is grouped by subsystem, not one long list.
    #[test]
    fn node_help_is_grouped_by_subsystem() {
        let mut cmd = super::super::Cli::command();
        let node = cmd.find_subcommand_mut("node").expect("node subcommand");
        let help = node.render_long_help().to_string();
        for heading in ["Mount watcher:", "Block devices:", "CSI driver:", "NBD server:", "Kubernetes publisher:"] {
            assert!(help.lines().any(|l| l == heading), "no {heading:?} group in:\n{help}");
        }
    }

    /// Every argument of every command (`volring csi`'s calls above all)
    /// says what it is for in `--help`.
    #[test]
    fn every_argument_has_help() {
        let mut missing = Vec::new();
        let mut todo = vec![(String::from("volring"), super::super::Cli::command())];
        while let Some((path, cmd)) = todo.pop() {
            for a in cmd.get_arguments() {
                let builtin = matches!(a.get_id().as_str(), "help" | "version");
                if !builtin && a.get_help().is_none() && a.get_long_help().is_none() {
                    missing.push(format!("{path} {}", a.get_long().map_or(a.get_id().to_string(), |l| format!("--{l}"))));
                }
            }
            if cmd.get_about().is_none() && cmd.get_long_about().is_none() {
                missing.push(format!("{path} (the command itself)"));
            }
            todo.extend(cmd.get_subcommands().filter(|s| s.get_name() != "help").map(|s| (format!("{path} {}", s.get_name()), s.clone())));
        }
        assert!(missing.is_empty(), "arguments without help text:\n{}", missing.join("\n"));
    }

    #[test]
    fn the_command_line_is_consistent() {
        super::super::Cli::command().debug_assert();
    }
}
