//! Glob patterns for tensor and hook names: `*` matches any run of characters (dots included),
//! `?` one character; everything else matches itself.

/// Whether `name` matches `pattern`.
pub fn matches(pattern: &str, name: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let n: Vec<char> = name.chars().collect();
    // Iterative wildcard matching with one backtrack point (linear in practice).
    let (mut pi, mut ni) = (0usize, 0usize);
    let (mut star, mut mark) = (None::<usize>, 0usize);
    while ni < n.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == n[ni]) {
            pi += 1;
            ni += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some(pi);
            mark = ni;
            pi += 1;
        } else if let Some(s) = star {
            pi = s + 1;
            mark += 1;
            ni = mark;
        } else {
            return false;
        }
    }
    while pi < p.len() && p[pi] == '*' {
        pi += 1;
    }
    pi == p.len()
}

/// Whether `name` matches any of `patterns` (an empty list matches everything).
pub fn matches_any(patterns: &[String], name: &str) -> bool {
    patterns.is_empty() || patterns.iter().any(|p| matches(p, name))
}

#[cfg(test)]
mod tests {
    use super::matches;

    #[test]
    fn globs_match_by_hand() {
        assert!(matches("blk.*.attn_out", "blk.12.attn_out"));
        assert!(!matches("blk.*.attn_out", "blk.12.attn_output"));
        assert!(matches("blk.?.ffn_*", "blk.3.ffn_down_exps.weight"));
        assert!(!matches("blk.?.ffn_*", "blk.13.ffn_down"));
        assert!(matches("*", ""));
        assert!(matches("a*b*c", "aXXbYYc"));
        assert!(!matches("a*b*c", "aXXbYY"));
    }
}
