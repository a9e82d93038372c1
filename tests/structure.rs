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

/// The paths that follow `prefix` (e.g. `crate::`) in `code`, each as its first two segments
/// (a brace group gives one path per member).
fn paths_after<'a>(code: &'a str, prefix: &str) -> Vec<Vec<&'a str>> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(k) = code[from..].find(prefix) {
        let at = from + k;
        from = at + prefix.len();
        // `prefix` must start a path: not `xsuper::`, and not `super::super::` seen from its tail.
        if at > 0 {
            let prev = code[..at].chars().next_back().unwrap_or(' ');
            if prev.is_ascii_alphanumeric() || prev == '_' || code[..at].ends_with("::") {
                continue;
            }
        }
        out.extend(segments(&code[from..]));
    }
    out
}

/// The leading segments (at most two) of the path or brace group `s` starts with.
fn segments(s: &str) -> Vec<Vec<&str>> {
    let s = s.trim_start();
    if let Some(inner) = s.strip_prefix('{') {
        let mut depth = 1usize;
        let mut members = Vec::new();
        let mut start = 0;
        for (k, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        members.push(&inner[start..k]);
                        break;
                    }
                }
                ',' if depth == 1 => {
                    members.push(&inner[start..k]);
                    start = k + 1;
                }
                _ => {}
            }
        }
        return members.into_iter().flat_map(segments).collect();
    }
    let Some(first) = ident_at(s) else {
        return Vec::new();
    };
    let rest = &s[first.len()..];
    match rest.strip_prefix("::") {
        Some(r) => {
            let r = r.trim_start();
            if r.starts_with('{') {
                segments(r)
                    .into_iter()
                    .map(|m| [vec![first], m.into_iter().take(1).collect()].concat())
                    .collect()
            } else {
                vec![[vec![first], ident_at(r).into_iter().collect()].concat()]
            }
        }
        None => vec![vec![first]],
    }
}

/// The source tree read as rooms: for each file, its room and sub-room, and what it imports.
struct Tree {
    /// Room -> its sub-rooms (child files and directories, `mod.rs` left out).
    rooms: BTreeMap<String, BTreeSet<String>>,
    /// (room, room it imports) -> files that do.
    room_edges: BTreeMap<(String, String), BTreeSet<String>>,
    /// (room, sub-room, sub-room it imports) -> files that do.
    sub_edges: BTreeMap<(String, String, String), BTreeSet<String>>,
}

fn read_tree() -> Tree {
    let src = root().join("src");
    let mut rooms: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for e in fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_stem().unwrap().to_string_lossy().into_owned();
        if name == "lib" || name == "main" {
            continue;
        }
        let mut subs = BTreeSet::new();
        if p.is_dir() {
            for c in fs::read_dir(&p).unwrap() {
                let c = c.unwrap().path();
                let s = c.file_stem().unwrap().to_string_lossy().into_owned();
                if s != "mod" && (c.is_dir() || c.extension().is_some_and(|x| x == "rs")) {
                    subs.insert(s);
                }
            }
        }
        rooms.insert(name, subs);
    }
    let mut room_edges: BTreeMap<(String, String), BTreeSet<String>> = BTreeMap::new();
    let mut sub_edges: BTreeMap<(String, String, String), BTreeSet<String>> = BTreeMap::new();
    for f in rust_files(&src) {
        let rel = f.strip_prefix(&src).unwrap();
        let parts: Vec<String> = rel
            .iter()
            .map(|s| s.to_string_lossy().trim_end_matches(".rs").to_string())
            .collect();
        if parts[0] == "lib" || parts[0] == "main" {
            continue;
        }
        let room = parts[0].clone();
        // The sub-room this file belongs to (none for the room's own front file).
        let sub = (parts.len() > 1 && parts[1] != "mod").then(|| parts[1].clone());
        let shown = format!("src/{}", rel.display());
        let code = code_of(&fs::read_to_string(&f).unwrap());
        let subs = &rooms[&room];
        let mut add_sub = |target: &str| {
            if let Some(s) = &sub {
                if subs.contains(target) && target != s {
                    sub_edges
                        .entry((room.clone(), s.clone(), target.to_string()))
                        .or_default()
                        .insert(shown.clone());
                }
            }
        };
        for p in paths_after(&code, "crate::") {
            if p[0] != room {
                if rooms.contains_key(p[0]) {
                    room_edges
                        .entry((room.clone(), p[0].to_string()))
                        .or_default()
                        .insert(shown.clone());
                }
            } else if let Some(s) = p.get(1) {
                add_sub(s);
            }
        }
        // `super::` names the room from a sub-room's own file (src/room/sub.rs or
        // src/room/sub/mod.rs), `super::super::` from a file inside a sub-room directory.
        let depth = parts.len() - usize::from(parts.last().is_some_and(|l| l == "mod"));
        let to_room = match depth {
            2 => "super::",
            3 => "super::super::",
            _ => "",
        };
        if !to_room.is_empty() {
            for p in paths_after(&code, to_room) {
                add_sub(p[0]);
            }
        }
    }
    Tree {
        rooms,
        room_edges,
        sub_edges,
    }
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

#[test]
fn no_circle_across_rooms() {
    let t = read_tree();
    let nodes: BTreeSet<String> = t.rooms.keys().cloned().collect();
    let edges: BTreeSet<(String, String)> = t.room_edges.keys().cloned().collect();
    if let Some(c) = circle(&nodes, &edges) {
        let why: Vec<String> = c
            .windows(2)
            .map(|w| {
                format!(
                    "{} -> {} ({})",
                    w[0],
                    w[1],
                    t.room_edges[&(w[0].clone(), w[1].clone())]
                        .iter()
                        .cloned()
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            })
            .collect();
        panic!("a circle across rooms: {}", why.join("; "));
    }
}

#[test]
fn no_circle_across_the_sub_rooms_of_a_room() {
    let t = read_tree();
    for (room, subs) in &t.rooms {
        let edges: BTreeSet<(String, String)> = t
            .sub_edges
            .keys()
            .filter(|(r, _, _)| r == room)
            .map(|(_, a, b)| (a.clone(), b.clone()))
            .collect();
        if let Some(c) = circle(subs, &edges) {
            let why: Vec<String> = c
                .windows(2)
                .map(|w| {
                    let files = &t.sub_edges[&(room.clone(), w[0].clone(), w[1].clone())];
                    format!(
                        "{room}::{} -> {room}::{} ({})",
                        w[0],
                        w[1],
                        files.iter().cloned().collect::<Vec<_>>().join(", ")
                    )
                })
                .collect();
            panic!("a circle inside {room}: {}", why.join("; "));
        }
    }
}

/// The rooms in the order of `src/lib.rs`'s layer list (`N. [`room`]...`).
fn layer_list() -> Vec<String> {
    let lib = fs::read_to_string(root().join("src/lib.rs")).unwrap();
    let mut out = Vec::new();
    for line in lib.lines() {
        let l = line.trim_start_matches("//!").trim_start();
        let Some((num, rest)) = l.split_once(". [`") else {
            continue;
        };
        if num.is_empty() || !num.chars().all(|c| c.is_ascii_digit()) {
            continue;
        }
        if let Some(end) = rest.find('`') {
            out.push(rest[..end].to_string());
        }
    }
    out
}

#[test]
fn the_layer_list_of_lib_rs_is_an_order_every_import_follows() {
    let t = read_tree();
    let order = layer_list();
    let mut problems = Vec::new();
    for room in t.rooms.keys() {
        if !order.contains(room) {
            problems.push(format!("{room} is not in the list"));
        }
    }
    for ((a, b), files) in &t.room_edges {
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
            .filter(|b| t.room_edges.contains_key(&(room.clone(), (*b).clone())))
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
