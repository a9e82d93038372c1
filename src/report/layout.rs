//! How wide text output may be, and fitting text to it: tables that wrap their cells and leave
//! out their least important columns ([`Grid`]), free text wrapped at spaces ([`fit_text`]),
//! lists broken between items ([`wrap_items`]) and shell commands continued with `\`
//! ([`shell_lines`]).
//!
//! The width is chosen once per process ([`set_width`] with [`detect`], from `main`): no limit
//! with `--wide`; else `COLUMNS` when it is set, else the terminal's width when stdout is a
//! terminal; never more than [`PIPE_WIDTH`] when stdout is not a terminal.

use std::sync::atomic::{AtomicUsize, Ordering};

use comfy_table::{presets, ColumnConstraint, ContentArrangement, Table, Width};

/// The width when stdout is not a terminal (and the most `COLUMNS` can ask for then).
pub const PIPE_WIDTH: usize = 100;

/// The narrowest width honoured: below it tables cannot show their essential columns.
pub const MIN_WIDTH: usize = 60;

/// A cell wider than this may wrap inside its column rather than push other columns out.
const WRAP_AT: usize = 30;

/// `usize::MAX` stands for no limit.
static WIDTH: AtomicUsize = AtomicUsize::new(PIPE_WIDTH);

/// The width for `--wide`, the value of `COLUMNS` and, when stdout is a terminal, its width:
/// `None` (no limit) with `--wide`; else `COLUMNS` (a positive number) or the terminal's
/// width, at most [`PIPE_WIDTH`] without a terminal; never under [`MIN_WIDTH`].
pub fn choose(wide: bool, columns: Option<&str>, terminal: Option<usize>) -> Option<usize> {
    if wide {
        return None;
    }
    let columns = columns
        .and_then(|c| c.trim().parse::<usize>().ok())
        .filter(|&c| c > 0);
    let w = match terminal {
        Some(t) => columns.unwrap_or(t),
        None => columns.unwrap_or(PIPE_WIDTH).min(PIPE_WIDTH),
    };
    Some(w.max(MIN_WIDTH))
}

/// [`choose`] with this process's `COLUMNS` and stdout.
pub fn detect(wide: bool) -> Option<usize> {
    use std::io::IsTerminal;
    let terminal = std::io::stdout().is_terminal().then(|| {
        Table::new()
            .width()
            .map(usize::from)
            .filter(|&w| w > 0)
            .unwrap_or(PIPE_WIDTH)
    });
    choose(wide, std::env::var("COLUMNS").ok().as_deref(), terminal)
}

/// Sets the width text output fits in (`None`: no limit).
pub fn set_width(width: Option<usize>) {
    WIDTH.store(width.unwrap_or(usize::MAX), Ordering::Relaxed);
}

/// The width text output fits in (`None`: no limit); [`PIPE_WIDTH`] until [`set_width`].
pub fn width() -> Option<usize> {
    match WIDTH.load(Ordering::Relaxed) {
        usize::MAX => None,
        w => Some(w),
    }
}

/// Characters of the longest line of `s`.
fn chars(s: &str) -> usize {
    s.lines().map(|l| l.chars().count()).max().unwrap_or(0)
}

/// A table in glmdiff's style (plain ASCII borders) fitted to `width`: cells wrap when the
/// table would be wider; without a width nothing wraps (stable to grep and diff).
pub fn table_at(header: &[&str], width: Option<usize>) -> Table {
    let mut t = Table::new();
    t.load_preset(presets::ASCII_MARKDOWN)
        .set_header(header.iter().copied());
    match width {
        Some(w) => {
            t.set_content_arrangement(ContentArrangement::Dynamic)
                .set_width(w.min(usize::from(u16::MAX)) as u16);
        }
        None => {
            t.set_content_arrangement(ContentArrangement::Disabled);
        }
    }
    t
}

/// A table whose columns have a rank: when the table does not fit, the columns of highest rank
/// are left out first (rank 0: never), then the remaining cells wrap. A line under the table
/// names what was left out.
#[derive(Clone, Debug, Default)]
pub struct Grid {
    header: Vec<String>,
    rank: Vec<u8>,
    /// Columns whose cells never wrap (names a user searches for, such as hook names).
    whole: Vec<bool>,
    rows: Vec<Vec<String>>,
}

impl Grid {
    /// A grid with these columns: (header, rank).
    pub fn new(columns: &[(&str, u8)]) -> Grid {
        Grid {
            header: columns.iter().map(|(h, _)| h.to_string()).collect(),
            rank: columns.iter().map(|(_, r)| *r).collect(),
            whole: vec![false; columns.len()],
            rows: Vec::new(),
        }
    }

    /// Marks columns whose cells are never wrapped or shortened (identifiers such as hook
    /// names): when the table is too wide, the other columns give way.
    pub fn whole(mut self, columns: &[usize]) -> Grid {
        for &c in columns {
            if let Some(w) = self.whole.get_mut(c) {
                *w = true;
            }
        }
        self
    }

    /// Adds a row (one cell per column; missing cells are empty).
    pub fn add_row(&mut self, row: Vec<String>) {
        self.rows.push(row);
    }

    /// Whether the grid has no rows.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The columns kept at `width`, in order, with the width each needs when the kept ones
    /// fit together (their cells may then wrap at spaces, never inside a word of the header).
    fn kept(&self, width: Option<usize>) -> (Vec<usize>, Option<Vec<usize>>) {
        let mut kept: Vec<usize> = (0..self.header.len()).collect();
        let Some(width) = width else {
            return (kept, None);
        };
        // A header wraps at its spaces: its longest word counts.
        let word = |c: usize| -> usize {
            self.header[c]
                .split(' ')
                .map(|w| w.chars().count())
                .max()
                .unwrap_or(0)
        };
        let need = |c: usize| -> usize {
            let header = word(c);
            self.rows
                .iter()
                .filter_map(|r| r.get(c))
                .map(|s| chars(s))
                .max()
                .unwrap_or(0)
                .min(if self.whole[c] { usize::MAX } else { WRAP_AT })
                .max(header)
        };
        let needs: Vec<usize> = (0..self.header.len()).map(need).collect();
        loop {
            let total: usize = kept.iter().map(|&c| needs[c] + 3).sum::<usize>() + 1;
            if total <= width {
                let mins = kept.iter().map(|&c| needs[c]).collect();
                return (kept, Some(mins));
            }
            // The highest rank goes first; of equal ranks, the rightmost.
            let Some((pos, _)) = kept
                .iter()
                .enumerate()
                .filter(|(_, &c)| self.rank[c] > 0)
                .max_by_key(|(pos, &c)| (self.rank[c], *pos))
            else {
                // Still too wide: the widest columns give way first, down to a common width
                // (never under their header's longest word); the narrow ones stay whole.
                let room = width.saturating_sub(3 * kept.len() + 1);
                let floor = |c: usize| -> usize {
                    if self.whole[c] {
                        needs[c]
                    } else {
                        word(c)
                    }
                };
                let fit = |level: usize| -> usize {
                    kept.iter()
                        .map(|&c| needs[c].min(level.max(floor(c))))
                        .sum()
                };
                let top = kept.iter().map(|&c| needs[c]).max().unwrap_or(0);
                let Some(level) = (1..=top).rev().find(|&l| fit(l) <= room) else {
                    return (kept, None);
                };
                let mins = kept
                    .iter()
                    .map(|&c| needs[c].min(level.max(floor(c))))
                    .collect();
                return (kept, Some(mins));
            };
            kept.remove(pos);
        }
    }

    /// The table at `width` (`None`: every column, nothing wrapped), followed by the line that
    /// names the columns left out, if any.
    pub fn render(&self, width: Option<usize>) -> String {
        let (kept, mins) = self.kept(width);
        let header: Vec<&str> = kept.iter().map(|&c| self.header[c].as_str()).collect();
        let mut t = table_at(&header, width);
        // Each column at least as wide as it needs (plus its padding), so that cells wrap at
        // their spaces rather than inside words.
        for (i, m) in mins.iter().flatten().enumerate() {
            if let Some(col) = t.column_mut(i) {
                let w = (m + 2).min(usize::from(u16::MAX)) as u16;
                col.set_constraint(ColumnConstraint::LowerBoundary(Width::Fixed(w)));
            }
        }
        for r in &self.rows {
            t.add_row(
                kept.iter()
                    .map(|&c| r.get(c).cloned().unwrap_or_default())
                    .collect::<Vec<_>>(),
            );
        }
        let mut s = t.to_string();
        if kept.len() < self.header.len() {
            let left: Vec<&str> = (0..self.header.len())
                .filter(|c| !kept.contains(c))
                .map(|c| self.header[c].as_str())
                .collect();
            s.push_str(&format!(
                "\n(left out to fit {} characters: {}; --wide shows them)",
                width.unwrap_or(0),
                left.join(", ")
            ));
        }
        s
    }
}

impl std::fmt::Display for Grid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.render(width()))
    }
}

/// `s` cut to at most `max` characters, the cut marked with how long it was.
pub fn shorten(s: &str, max: usize) -> String {
    let n = s.chars().count();
    if n <= max {
        return s.to_string();
    }
    let note = format!("... ({n} characters)");
    let keep = max.saturating_sub(note.len());
    format!("{}{note}", s.chars().take(keep).collect::<String>())
}

/// `line` broken at spaces into lines of at most `width` characters, continuation lines
/// indented two spaces more than the first. A word longer than a line stays whole.
pub fn wrap_line(line: &str, width: usize) -> Vec<String> {
    if line.chars().count() <= width {
        return vec![line.to_string()];
    }
    let indent = line.len() - line.trim_start_matches(' ').len();
    let next_indent = " ".repeat(indent + 2);
    let mut out = Vec::new();
    let mut cur = line[..indent].to_string();
    let mut cur_len = indent;
    let mut empty = true;
    for word in line[indent..].split(' ') {
        let n = word.chars().count();
        if !empty && cur_len + 1 + n > width {
            out.push(cur.trim_end().to_string());
            cur = next_indent.clone();
            cur_len = next_indent.len();
            empty = true;
        }
        if !empty {
            cur.push(' ');
            cur_len += 1;
        }
        cur.push_str(word);
        cur_len += n;
        empty = false;
    }
    out.push(cur.trim_end().to_string());
    out
}

/// `text` with every line that is too long for `width` wrapped ([`wrap_line`]), except table
/// lines (starting with `|`) and shell commands continued with `\` (a line ending in `\` and
/// the line after it), which are already fitted. `None`: unchanged.
pub fn fit_text(text: &str, width: Option<usize>) -> String {
    let Some(width) = width else {
        return text.to_string();
    };
    let mut out = String::with_capacity(text.len());
    let mut continued = false;
    for (i, line) in text.split('\n').enumerate() {
        if i > 0 {
            out.push('\n');
        }
        let keep = continued || line.starts_with('|') || line.ends_with('\\');
        continued = line.ends_with('\\');
        if keep {
            out.push_str(line);
        } else {
            out.push_str(&wrap_line(line, width).join("\n"));
        }
    }
    out
}

/// `first` followed by `items` joined with `sep`, broken between items into lines of at most
/// `width` characters (continuation lines indented two spaces); one line without a width.
pub fn wrap_items(first: &str, items: &[String], sep: &str, width: Option<usize>) -> String {
    let Some(width) = width else {
        return format!("{first}{}", items.join(sep));
    };
    let end = sep.trim_end();
    let mut lines = Vec::new();
    let mut cur = first.to_string();
    let mut fresh = true;
    for (i, item) in items.iter().enumerate() {
        let tail = if i + 1 < items.len() { end } else { "" };
        let add = if fresh {
            item.clone()
        } else {
            format!("{}{item}", &sep[end.len()..])
        };
        if !fresh && cur.chars().count() + add.chars().count() + tail.chars().count() > width {
            lines.push(cur);
            cur = format!("  {item}");
        } else {
            cur.push_str(&add);
        }
        cur.push_str(tail);
        fresh = false;
    }
    lines.push(cur);
    lines.join("\n")
}

/// The words of a command line as [`crate::report`]'s callers quote them: split at spaces
/// outside single quotes.
fn shell_split(cmd: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    for c in cmd.chars() {
        match c {
            '\'' => {
                quoted = !quoted;
                cur.push(c);
            }
            ' ' if !quoted => {
                if !cur.is_empty() {
                    words.push(std::mem::take(&mut cur));
                }
            }
            _ => cur.push(c),
        }
    }
    if !cur.is_empty() {
        words.push(cur);
    }
    words
}

/// `lead` and the shell command `cmd` (words quoted with single quotes where needed) on one
/// line when it fits `width`; else the command broken between words (a flag stays with its
/// value) into lines ending in ` \`, continuation lines indented four spaces beyond `lead`'s
/// indentation. A word longer than a line stays whole: the only line that may be longer.
pub fn shell_lines(lead: &str, cmd: &str, width: Option<usize>) -> String {
    let one = format!("{lead} {cmd}");
    let Some(width) = width.filter(|&w| one.chars().count() > w) else {
        return one;
    };
    let indent = lead.len() - lead.trim_start_matches(' ').len();
    let words = shell_split(cmd);
    let mut units: Vec<String> = Vec::new();
    let mut i = 0;
    while i < words.len() {
        let w = &words[i];
        if w.starts_with('-') && words.get(i + 1).is_some_and(|v| !v.starts_with('-')) {
            units.push(format!("{w} {}", words[i + 1]));
            i += 2;
        } else {
            units.push(w.clone());
            i += 1;
        }
    }
    let mut lines: Vec<String> = Vec::new();
    let first_fits = units
        .first()
        .is_some_and(|u| lead.chars().count() + 1 + u.chars().count() + 2 <= width);
    let mut cur = if first_fits {
        lead.to_string()
    } else {
        lines.push(lead.to_string());
        " ".repeat(indent + 2)
    };
    let mut fresh = !first_fits;
    let cont = " ".repeat(indent + 4);
    for u in &units {
        let n = u.chars().count();
        if !fresh && cur.chars().count() + 1 + n + 2 > width {
            lines.push(format!("{cur} \\"));
            cur = cont.clone();
            fresh = true;
        }
        if !fresh {
            cur.push(' ');
        }
        // A word too long for a line is continued inside itself: a backslash at the end of a
        // line and the rest from the first column (the shell joins them). Not inside quotes,
        // where a backslash is kept as it is.
        let room = width.saturating_sub(cur.chars().count() + 1);
        if n + 2 > width.saturating_sub(cur.chars().count()) && !u.contains('\'') && room > 0 {
            let pieces = split_word(u, room, width - 1);
            let last = pieces.len() - 1;
            for (k, piece) in pieces.into_iter().enumerate() {
                cur.push_str(&piece);
                if k < last {
                    lines.push(format!("{cur}\\"));
                    cur = String::new();
                }
            }
        } else {
            cur.push_str(u);
        }
        fresh = false;
    }
    lines.push(cur);
    lines.join("\n")
}

/// `word` cut into pieces of at most `first` characters, then at most `rest`, each cut after a
/// `,` or `/` where one is near enough the end (else at the limit).
fn split_word(word: &str, first: usize, rest: usize) -> Vec<String> {
    let chars: Vec<char> = word.chars().collect();
    let mut pieces = Vec::new();
    let mut start = 0;
    let mut room = first.max(1);
    while chars.len() - start > room {
        let limit = start + room;
        // The last `,` or `/` in the back half of the room, else the limit.
        let cut = (start + room / 2..limit)
            .rev()
            .find(|&i| matches!(chars[i], ',' | '/'))
            .map_or(limit, |i| i + 1);
        pieces.push(chars[start..cut].iter().collect());
        start = cut;
        room = rest.max(1);
    }
    pieces.push(chars[start..].iter().collect());
    pieces
}

#[cfg(test)]
mod tests {
    use super::*;

    fn widest(s: &str) -> usize {
        s.lines().map(|l| l.chars().count()).max().unwrap_or(0)
    }

    #[test]
    fn width_follows_wide_columns_and_the_terminal() {
        assert_eq!(choose(true, Some("80"), Some(200)), None);
        // No terminal: at most 100, whatever COLUMNS says.
        assert_eq!(choose(false, None, None), Some(100));
        assert_eq!(choose(false, Some("80"), None), Some(80));
        assert_eq!(choose(false, Some("300"), None), Some(100));
        // A terminal: its width, or COLUMNS.
        assert_eq!(choose(false, None, Some(180)), Some(180));
        assert_eq!(choose(false, Some("120"), Some(180)), Some(120));
        // Nonsense and tiny values.
        assert_eq!(choose(false, Some("x"), None), Some(100));
        assert_eq!(choose(false, Some("0"), Some(150)), Some(150));
        assert_eq!(choose(false, Some("10"), None), Some(MIN_WIDTH));
    }

    #[test]
    fn whole_columns_never_wrap_the_others_give_way() {
        let mut g = Grid::new(&[("hook", 0), ("error", 0), ("verdict", 0)]).whole(&[0]);
        g.add_row(vec![
            "blk.12.indexer_scores".into(),
            "1.27e0 (attn_heads)".into(),
            "r FAIL, c drift, near-tie flips: 3 rows, margins 1.2e-5..1.9e-2".into(),
        ]);
        let s = g.render(Some(48));
        assert!(s.contains("blk.12.indexer_scores"), "{s}");
        assert!(s.lines().all(|l| l.chars().count() <= 48), "{s}");
    }

    #[test]
    fn grid_leaves_out_the_highest_ranks_first_and_says_so() {
        let mut g = Grid::new(&[("name", 0), ("a", 2), ("b", 1), ("verdict", 0)]);
        g.add_row(vec![
            "x".repeat(20),
            "y".repeat(25),
            "z".repeat(25),
            "ok".into(),
        ]);
        let wide = g.render(None);
        assert!(wide.contains(&"y".repeat(25)) && !wide.contains("left out"));
        // 20 + 25 + 25 + 7 + 4 * 3 + 1 = 90: all fit at 90, not at 89.
        assert!(!g.render(Some(90)).contains("left out"));
        // Without `a`: 20 + 25 + 7 + 3 * 3 + 1 = 62.
        let narrow = g.render(Some(65));
        assert!(!narrow.contains('y'), "{narrow}");
        assert!(narrow.contains(&"z".repeat(25)), "{narrow}");
        assert!(
            narrow.contains("left out to fit 65 characters: a;"),
            "{narrow}"
        );
        assert!(widest(&narrow) <= 65, "{narrow}");
        // Headers wrap at their spaces, not inside words.
        let mut h = Grid::new(&[("dequant thr-ms", 0), ("a b c d e f", 0), ("x", 1)]);
        h.add_row(vec!["1.0".into(), "2.0".into(), "y".repeat(70)]);
        let t = h.render(Some(60));
        assert!(t.contains("| dequant ") && t.contains("| thr-ms "), "{t}");
        let narrower = g.render(Some(61));
        assert!(
            !narrower.contains('z') && narrower.contains(": a, b;"),
            "{narrower}"
        );
    }

    #[test]
    fn the_widest_columns_give_way_first() {
        let mut g = Grid::new(&[("a", 0), ("b", 0), ("c", 0)]);
        g.add_row(vec!["x".repeat(10), "y y".repeat(10), "z z".repeat(10)]);
        // 10 + 30 + 30 + 10 = 80 > 60: b and c wrap to 20 each, a stays whole.
        let t = g.render(Some(60));
        assert!(widest(&t) <= 60, "{t}");
        assert!(t.contains(&"x".repeat(10)), "{t}");
    }

    #[test]
    fn long_cells_wrap_within_the_width() {
        let mut g = Grid::new(&[("hook", 0), ("note", 0)]);
        let long = ["word"; 40].join(" ");
        g.add_row(vec!["blk.0.attn_heads".into(), long.clone()]);
        let t = g.render(Some(60));
        assert!(widest(&t) <= 60, "{t}");
        assert_eq!(t.matches("word").count(), 40);
        assert!(g.render(None).contains(&long));
    }

    #[test]
    fn long_values_are_cut_and_say_how_long() {
        assert_eq!(shorten("short", 10), "short");
        let s = shorten(&"x".repeat(500), 60);
        assert_eq!(s.chars().count(), 60);
        assert!(s.ends_with("... (500 characters)"), "{s}");
    }

    #[test]
    fn lines_wrap_at_spaces_with_a_hanging_indent() {
        let l = wrap_line("note: aaaa bbbb cccc dddd", 15);
        assert_eq!(l, vec!["note: aaaa bbbb", "  cccc dddd"]);
        assert_eq!(wrap_line("  x yyyyyyyyyyyyyyyyyyyy", 10).len(), 2);
        assert_eq!(wrap_line("short", 10), vec!["short"]);
        let t = fit_text(
            "| a table line that is long |\nplain words here\n",
            Some(10),
        );
        assert_eq!(t, "| a table line that is long |\nplain\n  words\n  here\n");
        assert_eq!(fit_text("plain words here", None), "plain words here");
    }

    #[test]
    fn items_break_between_items() {
        let items: Vec<String> = (0..6).map(|i| format!("{i} \"t{i}\"")).collect();
        let s = wrap_items("tokens (6): ", &items, " | ", Some(30));
        assert!(widest(&s) <= 30, "{s}");
        assert_eq!(
            s.replace("\n  ", " "),
            wrap_items("tokens (6): ", &items, " | ", None)
        );
    }

    #[test]
    fn shell_commands_continue_with_backslashes() {
        let cmd = "glmdiff run '/a path/model.gguf' --tokens 1,2,3,4,5,6,7,8 --layer 3 --against cpu --mode both --inject kv_b_concat";
        let s = shell_lines("re-run that layer:", cmd, Some(60));
        assert!(widest(&s) <= 60, "{s}");
        let lines: Vec<&str> = s.lines().collect();
        assert!(lines[..lines.len() - 1].iter().all(|l| l.ends_with(" \\")));
        // Joined back as a shell joins continuations: the same words.
        let joined = s.replace(" \\\n", " ");
        let words: Vec<&str> = joined.split_whitespace().collect();
        let again = format!("re-run that layer: {cmd}");
        assert_eq!(words, again.split_whitespace().collect::<Vec<_>>());
        assert!(s.contains("--layer 3"), "a flag stays with its value: {s}");
        assert!(s.contains("'/a path/model.gguf'"), "{s}");
        // Short enough: one line; no width: one line.
        assert_eq!(
            shell_lines("x:", "glmdiff step d", Some(60)),
            "x: glmdiff step d"
        );
        assert!(!shell_lines("re-run:", cmd, None).contains('\n'));
        // Lines after a continuation are left alone by fit_text.
        assert_eq!(fit_text(&s, Some(60)), s);
    }

    #[test]
    fn a_word_longer_than_a_line_continues_inside_itself() {
        let ids: Vec<String> = (0..40).map(|i| (154_000 + i).to_string()).collect();
        let cmd = format!(
            "glmdiff run m.gguf --tokens {} --layer 3 --against cuda:0",
            ids.join(",")
        );
        let s = shell_lines("re-run that layer:", &cmd, Some(60));
        assert!(widest(&s) <= 60, "{s}");
        // Joined as a shell joins lines (backslash-newline removed): the same words.
        let joined = s.replace("\\\n", "");
        let again = format!("re-run that layer: {cmd}");
        assert_eq!(
            joined.split_whitespace().collect::<Vec<_>>(),
            again.split_whitespace().collect::<Vec<_>>(),
            "{s}"
        );
        // Cut after commas.
        assert!(s.lines().filter(|l| l.ends_with(",\\")).count() >= 4, "{s}");
        // A quoted word cannot be cut: it stays whole, the one line that may be longer.
        let quoted = format!("glmdiff run '{}' --layer 1", "a b".repeat(30));
        let q = shell_lines("re-run:", &quoted, Some(60));
        assert!(q.contains(&format!("'{}'", "a b".repeat(30))), "{q}");
    }
}
