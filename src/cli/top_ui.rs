//! `volring top`'s terminal view (ratatui over crossterm): the rows of
//! [`super::top`], refreshed each interval, and the keys that sort, filter
//! and switch between volumes and devices. The terminal is restored on
//! every way out (a key, an error, a panic: ratatui's hook).

use std::time::{Duration, Instant};

use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Cell, Paragraph, Row as TableRow, Table};
use ratatui::Frame;

use super::top::{cells, rank, Row, Sampler, SortKey, TopArgs, View, COLUMNS};

/// What the screen shows, changed by keys and refreshes.
struct State {
    view: View,
    sort: SortKey,
    reverse: bool,
    filter: String,
    /// Typing a filter after `/`.
    editing: bool,
    rows: Vec<Row>,
    source: String,
    error: Option<String>,
}

const HELP: &str = "q quit  v/d/Tab volumes/devices  s sort  i/t/a/u/n by IOPS/throughput/await/util/name  r reverse  / filter";

pub(crate) fn run(args: &TopArgs) -> anyhow::Result<()> {
    let mut sampler = Sampler::new(&args.source)?;
    let mut state = State {
        view: if args.devices { View::Devices } else { View::Volumes },
        sort: args.sort,
        reverse: false,
        filter: args.filter.clone().unwrap_or_default(),
        editing: false,
        rows: Vec::new(),
        source: sampler.source(),
        error: None,
    };
    // Both views sampled from the start, so a switch shows rates at once.
    for view in [View::Volumes, View::Devices] {
        let rows = sampler.sample(view)?;
        if view == state.view {
            state.rows = rows;
        }
    }
    let every = Duration::from_secs_f64(args.interval.clamp(0.05, 3600.0));
    let mut terminal = ratatui::try_init()?;
    let result = (|| -> anyhow::Result<()> {
        let mut next = Instant::now() + every;
        loop {
            terminal.draw(|f| draw(f, &state))?;
            let wait = next.saturating_duration_since(Instant::now());
            if event::poll(wait)? {
                if let Event::Key(k) = event::read()? {
                    if k.kind != KeyEventKind::Release && !key(&mut state, k.code, k.modifiers) {
                        return Ok(());
                    }
                }
                continue;
            }
            next = Instant::now() + every;
            let other = if state.view == View::Volumes { View::Devices } else { View::Volumes };
            match sampler.sample(state.view) {
                Ok(rows) => {
                    state.rows = rows;
                    state.error = None;
                }
                Err(e) => state.error = Some(super::one_line(&e)),
            }
            // The other view's counters stay current for a switch.
            let _ = sampler.sample(other);
        }
    })();
    ratatui::try_restore()?;
    result
}

/// Applies a key; false to quit.
fn key(s: &mut State, code: KeyCode, mods: KeyModifiers) -> bool {
    if mods.contains(KeyModifiers::CONTROL) && code == KeyCode::Char('c') {
        return false;
    }
    if s.editing {
        match code {
            KeyCode::Enter => s.editing = false,
            KeyCode::Esc => {
                s.editing = false;
                s.filter.clear();
            }
            KeyCode::Backspace => {
                s.filter.pop();
            }
            KeyCode::Char(c) if s.filter.len() < 256 => s.filter.push(c),
            _ => {}
        }
        return true;
    }
    match code {
        KeyCode::Char('q') | KeyCode::Esc => return false,
        KeyCode::Char('v') => s.view = View::Volumes,
        KeyCode::Char('d') => s.view = View::Devices,
        KeyCode::Tab => s.view = if s.view == View::Volumes { View::Devices } else { View::Volumes },
        KeyCode::Char('s') => s.sort = s.sort.next(),
        KeyCode::Char('i') => s.sort = SortKey::Iops,
        KeyCode::Char('t') => s.sort = SortKey::Throughput,
        KeyCode::Char('a') => s.sort = SortKey::Await,
        KeyCode::Char('u') => s.sort = SortKey::Util,
        KeyCode::Char('n') => s.sort = SortKey::Name,
        KeyCode::Char('r') => s.reverse = !s.reverse,
        KeyCode::Char('/') => {
            s.editing = true;
            s.filter.clear();
        }
        _ => {}
    }
    true
}

fn draw(f: &mut Frame<'_>, s: &State) {
    let [head, body, foot] = Layout::vertical([Constraint::Length(2), Constraint::Min(1), Constraint::Length(1)]).areas(f.area());
    let what = if s.view == View::Volumes { "volumes" } else { "devices" };
    let order = if s.reverse { "least busy first" } else { "busiest first" };
    let filter = match (s.editing, s.filter.is_empty()) {
        (true, _) => format!("  filter: {}_", s.filter),
        (false, false) => format!("  filter: {}", s.filter),
        (false, true) => String::new(),
    };
    let title = format!("volring top: {what} by {} ({order}){filter}", s.sort.label());
    let second = s.error.as_ref().map_or_else(|| format!("source: {}", s.source), |e| format!("error: {e}"));
    f.render_widget(Paragraph::new(vec![Line::from(title).style(Style::new().add_modifier(Modifier::BOLD)), Line::from(second)]), head);

    let mut rows: Vec<Row> = s.rows.iter().filter(|r| s.filter.is_empty() || r.matches(&s.filter)).cloned().collect();
    rank(&mut rows, s.sort, s.reverse, s.view);
    let widths = [
        Constraint::Min(12),
        Constraint::Length(8),
        Constraint::Min(8),
        Constraint::Min(9),
        Constraint::Min(8),
        Constraint::Length(7),
        Constraint::Length(7),
        Constraint::Length(8),
        Constraint::Length(8),
        Constraint::Length(9),
        Constraint::Length(6),
    ];
    let header = TableRow::new(COLUMNS.map(Cell::from)).style(Style::new().add_modifier(Modifier::REVERSED));
    let lines: Vec<TableRow<'_>> = rows.iter().map(|r| TableRow::new(cells(r).map(Cell::from))).collect();
    let empty = lines.is_empty();
    f.render_widget(Table::new(lines, widths).header(header), body);
    if empty {
        let [_, below] = Layout::vertical([Constraint::Length(1), Constraint::Min(1)]).areas(body);
        f.render_widget(Paragraph::new(format!("no {what}")), below);
    }
    f.render_widget(Paragraph::new(HELP), foot);
}

#[cfg(test)]
mod tests {
    use super::*;
    use ratatui::backend::TestBackend;
    use ratatui::Terminal;

    /// Keys switch the view, sort and filter; drawn on a test backend.
    #[test]
    fn keys_sort_filter_and_switch() {
        let mut s = State {
            view: View::Volumes,
            sort: SortKey::Iops,
            reverse: false,
            filter: String::new(),
            editing: false,
            rows: Vec::new(),
            source: "kernel".into(),
            error: None,
        };
        assert!(key(&mut s, KeyCode::Char('d'), KeyModifiers::NONE));
        assert_eq!(s.view, View::Devices);
        assert!(key(&mut s, KeyCode::Tab, KeyModifiers::NONE));
        assert_eq!(s.view, View::Volumes);
        key(&mut s, KeyCode::Char('s'), KeyModifiers::NONE);
        assert_eq!(s.sort, SortKey::Throughput);
        key(&mut s, KeyCode::Char('/'), KeyModifiers::NONE);
        for c in "pvc-9q".chars() {
            key(&mut s, KeyCode::Char(c), KeyModifiers::NONE);
        }
        key(&mut s, KeyCode::Backspace, KeyModifiers::NONE);
        // A `q` typed into the filter does not quit.
        assert!(key(&mut s, KeyCode::Enter, KeyModifiers::NONE));
        assert_eq!(s.filter, "pvc-9");
        let mut t = Terminal::new(TestBackend::new(120, 10)).unwrap();
        t.draw(|f| draw(f, &s)).unwrap();
        let screen: String = t.backend().buffer().content().iter().map(|c| c.symbol()).collect();
        assert!(screen.contains("volumes by throughput") && screen.contains("filter: pvc-9") && screen.contains("no volumes"), "{screen}");
        assert!(!key(&mut s, KeyCode::Char('q'), KeyModifiers::NONE));
        assert!(!key(&mut s, KeyCode::Char('c'), KeyModifiers::CONTROL));
    }
}
