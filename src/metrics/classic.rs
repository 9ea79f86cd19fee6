//! The classic Prometheus text format (version 0.0.4), made from the
//! OpenMetrics text the encoder writes, for a client that does not ask for
//! OpenMetrics (promtool, older scrapers, `curl`).
//!
//! The two formats differ where it matters to a linter: an OpenMetrics
//! counter family is named without its `_total` suffix and its samples
//! with it, while classic text names family and samples alike. So counter
//! (and info) families are renamed, `# UNIT` and `# EOF` lines, `_created`
//! samples and exemplars are dropped, and types classic text lacks become
//! `untyped`.

/// What the scraper asked for, from its `Accept` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    OpenMetrics,
    Classic,
}

impl Format {
    /// OpenMetrics when the client lists it at all (Prometheus does, with
    /// the highest weight), the classic text otherwise.
    pub(crate) fn negotiate(accept: Option<&str>) -> Self {
        match accept {
            Some(a) if a.to_ascii_lowercase().contains("application/openmetrics-text") => Format::OpenMetrics,
            _ => Format::Classic,
        }
    }

    pub(crate) fn content_type(self) -> &'static str {
        match self {
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
            Format::Classic => "text/plain; version=0.0.4; charset=utf-8",
        }
    }
}

/// Rewrites OpenMetrics exposition text as classic text.
pub(crate) fn from_openmetrics(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    // The family being copied: its name and the suffix its classic name
    // gains (counters: `_total`, info: `_info`).
    let mut family = String::new();
    let mut suffix = "";
    let mut help: Option<&str> = None;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            // HELP comes before TYPE; hold it until the type says the name.
            flush_help(&mut out, &mut help);
            help = Some(rest);
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "unknown"));
            let (classic_kind, sfx) = match kind {
                "counter" => ("counter", "_total"),
                "info" => ("gauge", "_info"),
                "gauge" | "histogram" | "summary" => (kind, ""),
                _ => ("untyped", ""),
            };
            family = name.to_string();
            suffix = sfx;
            if let Some(h) = help.take() {
                let text = h.strip_prefix(name).map(str::trim_start).unwrap_or("");
                out.push_str(&format!("# HELP {name}{sfx} {}\n", text.replace("\\\"", "\"")));
            }
            out.push_str(&format!("# TYPE {name}{sfx} {classic_kind}\n"));
            continue;
        }
        // `# UNIT`, `# EOF`.
        if line.starts_with('#') {
            continue;
        }
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let name = &line[..name_end];
        if suffix == "_total" && name.strip_prefix(family.as_str()) == Some("_created") {
            continue;
        }
        // Exemplars (` # {...} value`) have no place in classic text.
        let sample = match line[name_end..].find(" # ") {
            Some(i) => &line[..name_end + i],
            None => line,
        };
        out.push_str(sample);
        out.push('\n');
    }
    flush_help(&mut out, &mut help);
    out
}

/// A HELP line whose family never got a TYPE line is kept as it was.
fn flush_help(out: &mut String, help: &mut Option<&str>) {
    if let Some(h) = help.take() {
        out.push_str("# HELP ");
        out.push_str(&h.replace("\\\"", "\""));
        out.push('\n');
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_named_with_their_suffix_and_extras_go() {
        let om = "# HELP x_reads Reads \\\"done\\\"\n# TYPE x_reads counter\n# UNIT x_reads reads\nx_reads_total{d=\"a\"} 5 # {trace=\"1\"} 1.0\nx_reads_created{d=\"a\"} 1.7e9\n\
                  # HELP x_up Up\n# TYPE x_up gauge\nx_up 1\n# HELP x_build Build\n# TYPE x_build info\nx_build_info{v=\"1\"} 1\n# EOF\n";
        let want = "# HELP x_reads_total Reads \"done\"\n# TYPE x_reads_total counter\nx_reads_total{d=\"a\"} 5\n\
                    # HELP x_up Up\n# TYPE x_up gauge\nx_up 1\n# HELP x_build_info Build\n# TYPE x_build_info gauge\nx_build_info{v=\"1\"} 1\n";
        assert_eq!(from_openmetrics(om), want);
    }

    #[test]
    fn histograms_pass_through() {
        let om = "# HELP h Latency\n# TYPE h histogram\nh_bucket{le=\"0.1\"} 1\nh_bucket{le=\"+Inf\"} 2\nh_sum 0.3\nh_count 2\n# EOF\n";
        assert_eq!(from_openmetrics(om), om.trim_end_matches("# EOF\n"));
    }

    #[test]
    fn negotiation_follows_the_accept_header() {
        let prometheus = "application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.3,*/*;q=0.2";
        assert_eq!(Format::negotiate(Some(prometheus)), Format::OpenMetrics);
        assert_eq!(Format::negotiate(Some("text/plain;version=0.0.4")), Format::Classic);
        assert_eq!(Format::negotiate(Some("*/*")), Format::Classic);
        assert_eq!(Format::negotiate(None), Format::Classic);
    }
}
