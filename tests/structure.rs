//! The shape of the source tree, checked: which room (a top-level module of `src/`) imports which,
//! with no circle among rooms or among the sub-rooms of one room; `src/lib.rs`'s layer list is an
//! order every import follows; the drawing in `docs/architecture.md` is the code's; `cmd` holds
//! only short functions; no file of the CUDA engine grows past 600 lines; the README and docs link
//! nothing outside the repository.
//!
//! Imports are read from the source text (comments and `#[cfg(test)]` modules left out): paths
//! `crate::a::b`, `crate::{a, b::c}`, `super::x` and `super::super::x`, resolved to rooms and
//! sub-rooms by the files that exist.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every `.rs` file under `dir`, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// The source of a file without comments, string literals' contents and `#[cfg(test)]` items.
fn code_of(text: &str) -> String {
    // Comments and strings, by a small scanner.
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if b[i] == b'r' && (b.get(i + 1) == Some(&b'"') || b.get(i + 1) == Some(&b'#')) {
            // A raw string r"..." or r#"..."#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&b'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&b'"')
                || (i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_'))
            {
                out.push('r');
                i += 1;
                continue;
            }
            j += 1;
            loop {
                if j >= b.len() {
                    break;
                }
                if b[j] == b'"' && (0..hashes).all(|k| b.get(j + 1 + k) == Some(&b'#')) {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            out.push_str("\"\"");
            i = j;
        } else if b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
            out.push_str("\"\"");
        } else if b[i] == b'\'' {
            // A char literal ('x', '\n', '\u{..}', '\'') or a lifetime ('a).
            let mut cs = text[i + 1..].char_indices();
            let lit_end = match cs.next() {
                Some((_, '\\')) => text[i + 3..].find('\'').map(|k| i + 3 + k),
                Some((_, c)) => match cs.next() {
                    Some((k, '\'')) if c != '\'' => Some(i + 1 + k),
                    _ => None,
                },
                None => None,
            };
            match lit_end {
                Some(e) => {
                    out.push_str("' '");
                    i = e + 1;
                }
                None => {
                    out.push('\'');
                    i += 1;
                }
            }
        } else {
            let c = text[i..].chars().next().unwrap();
            out.push(c);
            i += c.len_utf8();
        }
    }
    // `#[cfg(test)]` items: the attribute and the braced item after it.
    let mut code = out;
    while let Some(at) = code.find("#[cfg(test)]") {
        let after = at + "#[cfg(test)]".len();
        let semi = code[after..].find(';').map(|k| after + k);
        let brace = code[after..].find('{').map(|k| after + k);
        let end = match (semi, brace) {
            (Some(s), Some(b)) if s < b => s + 1,
            (_, Some(b)) => {
                let mut depth = 0usize;
                let mut end = code.len();
                for (k, c) in code[b..].char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' => {
                            depth -= 1;
                            if depth == 0 {
                                end = b + k + 1;
                                break;
                            }
                        }
                        _ => {}
                    }
                }
                end
            }
            (Some(s), None) => s + 1,
            (None, None) => code.len(),
        };
        code.replace_range(at..end, "");
    }
    code
}

fn ident_at(s: &str) -> Option<&str> {
    let end = s
        .char_indices()
        .find(|(_, c)| !(c.is_ascii_alphanumeric() || *c == '_'))
        .map_or(s.len(), |(k, _)| k);
    (end > 0).then(|| &s[..end])
}

/// Every path in `code` that starts with `crate::`, `super::` or `self::`, made absolute for a
/// file of module `module` (brace groups give one path per member).
fn paths_in(code: &str, module: &[String]) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for (k, _) in code.match_indices("::") {
        // The identifier before `::` starts a path only when nothing path-like precedes it.
        let head_start = code[..k]
            .char_indices()
            .rev()
            .find(|(_, c)| !(c.is_ascii_alphanumeric() || *c == '_'))
            .map_or(0, |(i, c)| i + c.len_utf8());
        let head = &code[head_start..k];
        if !matches!(head, "crate" | "super" | "self") || code[..head_start].ends_with("::") {
            continue;
        }
        let mut base: Vec<String> = match head {
            "crate" => Vec::new(),
            "self" => module.to_vec(),
            _ => module[..module.len().saturating_sub(1)].to_vec(),
        };
        let mut rest = &code[k + 2..];
        // Further `super::` steps.
        while let Some(r) = rest.strip_prefix("super::") {
            base.pop();
            rest = r;
        }
        for tail in members(rest) {
            let mut p = base.clone();
            p.extend(tail.into_iter().map(str::to_string));
            out.push(p);
        }
    }
    out
}

/// The paths `s` starts with: `a::b::c`, or a brace group `{a::b, c::{d, e}}` (one per member).
fn members(s: &str) -> Vec<Vec<&str>> {
    let s = s.trim_start();
    if let Some(inner) = s.strip_prefix('{') {
        let mut depth = 1usize;
        let mut parts = Vec::new();
        let mut start = 0;
        for (k, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        parts.push(&inner[start..k]);
                        break;
                    }
                }
                ',' if depth == 1 => {
                    parts.push(&inner[start..k]);
                    start = k + 1;
                }
                _ => {}
            }
        }
        return parts.into_iter().flat_map(members).collect();
    }
    let Some(first) = ident_at(s) else {
        return Vec::new();
    };
    match s[first.len()..].strip_prefix("::") {
        Some(r) => members(r)
            .into_iter()
            .map(|m| [vec![first], m].concat())
            .collect(),
        None => vec![vec![first]],
    }
}

/// The source tree read as modules: which module imports which, grouped by the directory
/// module (room) whose children they are.
struct Tree {
    /// Directory module (`[]` for `src/` itself) -> its child modules.
    children: BTreeMap<Vec<String>, BTreeSet<String>>,
    /// (directory module, child, child it imports) -> files that do.
    edges: BTreeMap<(Vec<String>, String, String), BTreeSet<String>>,
}

impl Tree {
    /// The top-level rooms.
    fn rooms(&self) -> &BTreeSet<String> {
        &self.children[&Vec::new()]
    }

    /// Whether room `a` imports room `b`, and the files that do.
    fn room_edge(&self, a: &str, b: &str) -> Option<&BTreeSet<String>> {
        self.edges.get(&(Vec::new(), a.to_string(), b.to_string()))
    }
}

fn read_tree() -> Tree {
    let src = root().join("src");
    let mut children: BTreeMap<Vec<String>, BTreeSet<String>> = BTreeMap::new();
    let mut modules: BTreeMap<Vec<String>, PathBuf> = BTreeMap::new();
    for f in rust_files(&src) {
        let rel = f.strip_prefix(&src).unwrap();
        let mut m: Vec<String> = rel
            .iter()
            .map(|s| s.to_string_lossy().trim_end_matches(".rs").to_string())
            .collect();
        if m == ["lib"] || m == ["main"] {
            continue;
        }
        if m.last().is_some_and(|l| l == "mod") {
            m.pop();
        }
        for i in 0..m.len() {
            children
                .entry(m[..i].to_vec())
                .or_default()
                .insert(m[i].clone());
        }
        modules.insert(m, f);
    }
    let mut edges: BTreeMap<(Vec<String>, String, String), BTreeSet<String>> = BTreeMap::new();
    for (m, f) in &modules {
        let shown = format!("src/{}", f.strip_prefix(&src).unwrap().display());
        let code = code_of(&fs::read_to_string(f).unwrap());
        for mut t in paths_in(&code, m) {
            // The module the path names (an item's path ends in its module).
            while !t.is_empty() && !modules.contains_key(&t) {
                t.pop();
            }
            let d = m.iter().zip(&t).take_while(|(a, b)| a == b).count();
            if d < m.len() && d < t.len() {
                edges
                    .entry((m[..d].to_vec(), m[d].clone(), t[d].clone()))
                    .or_default()
                    .insert(shown.clone());
            }
        }
    }
    Tree { children, edges }
}

/// A circle in the graph `edges`, as its nodes, if there is one.
fn circle(nodes: &BTreeSet<String>, edges: &BTreeSet<(String, String)>) -> Option<Vec<String>> {
    // Depth-first search with colours.
    fn visit(
        n: &str,
        edges: &BTreeSet<(String, String)>,
        state: &mut BTreeMap<String, u8>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(n.to_string(), 1);
        path.push(n.to_string());
        for (a, b) in edges.iter().filter(|(a, _)| a == n) {
            let _ = a;
            match state.get(b.as_str()).copied().unwrap_or(0) {
                1 => {
                    let at = path.iter().position(|p| p == b).unwrap();
                    let mut c = path[at..].to_vec();
                    c.push(b.clone());
                    return Some(c);
                }
                0 => {
                    if let Some(c) = visit(b, edges, state, path) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        path.pop();
        state.insert(n.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in nodes {
        if state.get(n).copied().unwrap_or(0) == 0 {
            if let Some(c) = visit(n, edges, &mut state, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

/// The imports among the children of directory module `dir`, as edges.
fn edges_in(t: &Tree, dir: &[String]) -> BTreeSet<(String, String)> {
    t.edges
        .keys()
        .filter(|(d, _, _)| d == dir)
        .map(|(_, a, b)| (a.clone(), b.clone()))
        .collect()
}

/// A circle among the children of `dir`, said with the files that make each step.
fn circle_in(t: &Tree, dir: &[String]) -> Option<String> {
    let c = circle(&t.children[dir], &edges_in(t, dir))?;
    let prefix = if dir.is_empty() {
        String::new()
    } else {
        format!("{}::", dir.join("::"))
    };
    let steps: Vec<String> = c
        .windows(2)
        .map(|w| {
            let files = &t.edges[&(dir.to_vec(), w[0].clone(), w[1].clone())];
            format!(
                "{prefix}{} -> {prefix}{} ({})",
                w[0],
                w[1],
                files.iter().cloned().collect::<Vec<_>>().join(", ")
            )
        })
        .collect();
    Some(steps.join("; "))
}

#[test]
fn no_circle_across_rooms() {
    let t = read_tree();
    if let Some(c) = circle_in(&t, &[]) {
        panic!("a circle across rooms: {c}");
    }
}

#[test]
fn no_circle_across_the_sub_rooms_of_any_room() {
    let t = read_tree();
    let mut found = Vec::new();
    for dir in t.children.keys().filter(|d| !d.is_empty()) {
        found.extend(circle_in(&t, dir));
    }
    assert!(
        found.is_empty(),
        "circles inside rooms:\n  {}",
        found.join("\n  ")
    );
}

/// The rooms in the order of `src/lib.rs`'s layer list (`N. [`room`]...`).
fn layer_list() -> Vec<String> {
    let lib = fs::read_to_string(root().join("src/lib.rs")).unwrap();
    let mut out = Vec::new();
    for line in lib.lines() {
        let l = line.trim_start_matches("//!").trim_start();
        // `N. [`room`]...` or `N. `room`...` (a room the docs cannot link, e.g. feature-gated).
        let Some((num, rest)) = l.split_once(". ") else {
            continue;
        };
        if num.is_empty() || !num.chars().all(|c| c.is_ascii_digit()) {
            continue;
        }
        let rest = rest.strip_prefix('[').unwrap_or(rest);
        if let Some(name) = rest.strip_prefix('`').and_then(|r| r.split('`').next()) {
            out.push(name.to_string());
        }
    }
    out
}

#[test]
fn the_layer_list_of_lib_rs_is_an_order_every_import_follows() {
    let t = read_tree();
    let order = layer_list();
    let mut problems = Vec::new();
    for room in t.rooms() {
        if !order.contains(room) {
            problems.push(format!("{room} is not in the list"));
        }
    }
    for ((_, a, b), files) in t.edges.iter().filter(|((d, _, _), _)| d.is_empty()) {
        let (Some(ia), Some(ib)) = (
            order.iter().position(|r| r == a),
            order.iter().position(|r| r == b),
        ) else {
            continue;
        };
        if ib >= ia {
            problems.push(format!(
                "{a} ({}.) imports {b} ({}.), listed after it: {}",
                ia + 1,
                ib + 1,
                files.iter().cloned().collect::<Vec<_>>().join(", ")
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "src/lib.rs's layer list is not the code's:\n  {}",
        problems.join("\n  ")
    );
}

/// The drawing of the rooms: one line per room in layer order, with the rooms it imports.
fn drawing() -> String {
    let t = read_tree();
    let order = layer_list();
    let width = order.iter().map(String::len).max().unwrap_or(0);
    let mut s = String::new();
    for (i, room) in order.iter().enumerate() {
        let imports: Vec<&str> = order
            .iter()
            .filter(|b| t.room_edge(room, b).is_some())
            .map(String::as_str)
            .collect();
        let line = if imports.is_empty() {
            format!("{:>2}. {room}", i + 1)
        } else {
            format!("{:>2}. {room:<width$}  <- {}", i + 1, imports.join(" "))
        };
        s.push_str(line.trim_end());
        s.push('\n');
    }
    s
}

#[test]
fn the_structure_drawing_in_the_docs_is_the_code_s() {
    let doc = fs::read_to_string(root().join("docs/architecture.md")).unwrap();
    let (begin, end) = ("<!-- rooms:begin -->\n```\n", "```\n<!-- rooms:end -->");
    let want = drawing();
    let shown = doc
        .split_once(begin)
        .and_then(|(_, r)| r.split_once(end))
        .map(|(d, _)| d);
    assert_eq!(
        shown,
        Some(want.as_str()),
        "docs/architecture.md's drawing of the rooms (between {begin:?} and {end:?}) should read:\n{want}"
    );
}

/// Functions longer than `max` lines in `file`: (name, first line, lines).
fn long_functions(file: &Path, max: usize) -> Vec<(String, usize, usize)> {
    let text = fs::read_to_string(file).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        let t = l.trim_start();
        let indent = l.len() - t.len();
        let t = t
            .trim_start_matches("pub(crate) ")
            .trim_start_matches("pub(super) ")
            .trim_start_matches("pub ");
        let Some(rest) = t.strip_prefix("fn ") else {
            continue;
        };
        let name = ident_at(rest).unwrap_or("?").to_string();
        // The body ends at the first line after the signature that is `}` at this indent.
        let close = format!("{}}}", " ".repeat(indent));
        if let Some(k) = lines[i + 1..].iter().position(|x| *x == close) {
            let n = k + 2;
            if n > max {
                out.push((name, i + 1, n));
            }
        }
    }
    out
}

#[test]
fn cmd_holds_only_short_functions() {
    let mut long = Vec::new();
    for f in rust_files(&root().join("src/cmd")) {
        for (name, line, n) in long_functions(&f, 80) {
            long.push(format!(
                "{}:{line} {name} ({n} lines)",
                f.strip_prefix(root()).unwrap().display()
            ));
        }
    }
    assert!(
        long.is_empty(),
        "functions in src/cmd over 80 lines (cmd parses flags and prints; the work belongs in the library):\n  {}",
        long.join("\n  ")
    );
}

#[test]
fn no_file_of_the_cuda_engine_is_over_600_lines() {
    let dir = root().join("src/engine/cuda");
    let mut big = Vec::new();
    for f in rust_files(&dir) {
        let n = fs::read_to_string(&f).unwrap().lines().count();
        if n > 600 {
            big.push(format!("{} ({n} lines)", f.display()));
        }
    }
    assert!(big.is_empty(), "files over 600 lines: {}", big.join(", "));
}

/// Markdown links `](target)` in `text`.
fn links(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(k) = text[from..].find("](") {
        let s = from + k + 2;
        match text[s..].find(')') {
            Some(e) => {
                out.push(&text[s..s + e]);
                from = s + e;
            }
            None => break,
        }
    }
    out
}

#[test]
fn the_readme_and_docs_link_only_into_the_repository() {
    let mut pages = vec![root().join("README.md")];
    let mut docs: Vec<PathBuf> = fs::read_dir(root().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    pages.extend(docs);
    let mut bad = Vec::new();
    for page in &pages {
        let text = fs::read_to_string(page).unwrap();
        let shown = page.strip_prefix(root()).unwrap().display().to_string();
        if text.contains("../shared") || text.contains("shared/spec") {
            bad.push(format!("{shown} mentions ../shared"));
        }
        for l in links(&text) {
            if l.starts_with("http://") || l.starts_with("https://") || l.starts_with('#') {
                continue;
            }
            let path = l.split('#').next().unwrap_or(l);
            let target = page.parent().unwrap().join(path);
            let inside = target
                .canonicalize()
                .is_ok_and(|t| t.starts_with(root().canonicalize().unwrap()));
            if !inside {
                bad.push(format!("{shown} links {l:?}, not a file of the repository"));
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// The rooms whose functions read in one sitting: the judge, the driver, the pipelines and
/// the diagnosis.
const SHORT_ROOMS: [&str; 4] = ["src/driver", "src/compare", "src/session", "src/explain"];

#[test]
fn no_function_of_the_judge_driver_pipelines_or_diagnosis_is_over_120_lines() {
    let mut long = Vec::new();
    for dir in SHORT_ROOMS {
        for f in rust_files(&root().join(dir)) {
            for (name, line, n) in long_functions(&f, 120) {
                long.push(format!(
                    "{}:{line} {name} ({n} lines)",
                    f.strip_prefix(root()).unwrap().display()
                ));
            }
        }
    }
    assert!(
        long.is_empty(),
        "functions over 120 lines in {SHORT_ROOMS:?} (split them into named stages):\n  {}",
        long.join("\n  ")
    );
}

/// The body of `pub trait NAME` in `code` (comments and strings left out).
fn trait_body<'a>(code: &'a str, name: &str) -> Option<&'a str> {
    let at = code.find(&format!("pub trait {name} "))?;
    let open = at + code[at..].find('{')?;
    let mut depth = 0usize;
    for (k, c) in code[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(&code[open..open + k + 1]);
                }
            }
            _ => {}
        }
    }
    None
}

#[test]
fn the_judge_is_built_in_one_place_and_the_pair_sink_only_receives() {
    // `Judge { .. }` is written only by `Judge::new`.
    let mut literal = Vec::new();
    for f in rust_files(&root().join("src")) {
        let code = code_of(&fs::read_to_string(&f).unwrap());
        let rel = f.strip_prefix(root()).unwrap().display().to_string();
        let built = code.match_indices("Judge {").any(|(i, _)| {
            let before = code[..i].trim_end();
            !(before.ends_with("->")
                || before.ends_with('&')
                || before.ends_with("impl")
                || before.ends_with("struct")
                || before.ends_with("for")
                || before.ends_with(|c: char| c.is_alphanumeric() || c == '_'))
        });
        if rel != "src/compare/judge.rs" && built {
            literal.push(rel);
        }
    }
    assert!(
        literal.is_empty(),
        "a Judge is built by compare::judge::Judge::new alone; struct literals in: {literal:?}"
    );
    // The driver hands hooks to the sink; what it asks back is `NearTies`, passed apart (and
    // its wants, which `Answers` gives apart from the sink for its own thread).
    let trace = code_of(&fs::read_to_string(root().join("src/trace/mod.rs")).unwrap());
    let sink = trait_body(&trace, "PairSink").expect("src/trace/mod.rs defines PairSink");
    for (i, _) in sink.match_indices("fn ") {
        let sig = &sink[i..i + sink[i..].find(['{', ';']).unwrap_or(0)];
        let ret = sig.rsplit_once("->").map(|(_, r)| r.trim());
        assert!(
            matches!(
                ret,
                None | Some("bool") | Some("Result<()>") | Some("Option<Answers>")
            ),
            "PairSink only receives (its methods return nothing, a want, its wants given apart, or a Result<()>): {sig}"
        );
    }
    assert!(trait_body(&trace, "NearTies").is_some());
}

#[test]
fn settings_are_read_from_the_environment_at_the_top_only() {
    // The command line reads a setting's variable (a flag's default); the rooms are handed the
    // value. Where else the environment is read: the cache directory's conventional variables
    // (documented with --cache-dir) and the terminal's width (COLUMNS).
    let allowed = [
        "src/main.rs",
        "src/cli.rs",
        "src/util/cache_dir.rs",
        "src/report/layout.rs",
    ];
    let mut reads = Vec::new();
    for f in rust_files(&root().join("src")) {
        let rel = f.strip_prefix(root()).unwrap().display().to_string();
        let code = code_of(&fs::read_to_string(&f).unwrap());
        if !allowed.contains(&rel.as_str()) && (code.contains("env::var")) {
            reads.push(rel);
        }
    }
    assert!(
        reads.is_empty(),
        "the environment is read inside rooms (make it a flag whose default the variable sets in src/cli.rs): {reads:?}"
    );
}
