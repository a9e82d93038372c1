//! The suite file: a TOML list of `[[case]]` tables, checked key by key before anything runs.
//! Paths (`model`, `against = "trace:FILE"`) are relative to the suite file. Every error names
//! the file, the case (number and name) and the key.

use std::collections::BTreeSet;
use std::ops::Range;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use toml::{Table, Value};

use crate::util::glob;
use crate::util::shell::shell_word;
use crate::words::{Against, CudaDtype, Modes, PrecisionOverride, PRECISION_WORDS};

/// Every key a case may have.
pub const CASE_KEYS: &[&str] = &[
    "name",
    "model",
    "prompt",
    "tokens",
    "against",
    "layer",
    "layers",
    "mode",
    "dtype",
    "hook",
    "tol",
    "precision",
    "max_kl",
    "top1_agreement",
    "expect_top5",
    "expect_divergence",
];

/// A suite: its file and its cases, in file order.
#[derive(Clone, Debug, PartialEq)]
pub struct Suite {
    /// The suite file as given.
    pub path: PathBuf,
    /// The cases.
    pub cases: Vec<Case>,
}

/// The prompt of a case.
#[derive(Clone, Debug, PartialEq)]
pub enum Input {
    /// Text, tokenized with the model's tokenizer.
    Prompt(String),
    /// Token ids.
    Tokens(Vec<u32>),
    /// Neither: a trace candidate's own tokens.
    FromTrace,
}

/// One case: the flags of a `run` and what its result must show.
#[derive(Clone, Debug, PartialEq)]
pub struct Case {
    /// Unique name.
    pub name: String,
    /// The model file (resolved against the suite's directory).
    pub model: PathBuf,
    /// The prompt.
    pub input: Input,
    /// The candidate (a trace path resolved against the suite's directory).
    pub against: Against,
    /// `layer = N` (as `N..N+1`) or `layers = "A..B"`; all layers when absent.
    pub layers: Option<Range<u64>>,
    /// `both`, `replay` or `chained`.
    pub mode: Modes,
    /// The CUDA engine's precision, `f32` or `bf16` (`run --dtype`).
    pub dtype: CudaDtype,
    /// `--hook` globs.
    pub hook: Vec<String>,
    /// Floor overrides `(glob, value)`, the longest glob first (so the most specific wins).
    pub tol: Vec<(String, f64)>,
    /// Candidate precision overrides, the longest glob first.
    pub precision: Vec<PrecisionOverride>,
    /// What the result must show.
    pub expect: Expect,
}

/// The expectations of a case. Besides these, every case expects `run`'s verdict `ok`, unless
/// `divergence` names the hook where it must diverge.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Expect {
    /// `KL(reference || candidate)` at every position at most this.
    pub max_kl: Option<f64>,
    /// Share of positions whose top-1 tokens agree, at least this.
    pub top1_agreement: Option<f64>,
    /// The reference's top-5 token ids per position (most likely first).
    pub top5: Option<Vec<Vec<u32>>>,
    /// The run must differ, with its first divergence (replay, else chained) at this hook.
    pub divergence: Option<String>,
}

impl Expect {
    /// Whether an expectation reads the output distributions (the run must reach the logits).
    pub fn needs_logits(&self) -> Option<&'static str> {
        if self.max_kl.is_some() {
            Some("max_kl")
        } else if self.top1_agreement.is_some() {
            Some("top1_agreement")
        } else if self.top5.is_some() {
            Some("expect_top5")
        } else {
            None
        }
    }
}

impl Suite {
    /// The cases whose name matches one of `globs` (all when empty), with their index in the
    /// suite; an error naming every case when none matches.
    pub fn select(&self, globs: &[String]) -> Result<Vec<(usize, &Case)>> {
        let cases: Vec<(usize, &Case)> = self
            .cases
            .iter()
            .enumerate()
            .filter(|(_, c)| globs.is_empty() || globs.iter().any(|g| glob::matches(g, &c.name)))
            .collect();
        if cases.is_empty() {
            let names: Vec<&str> = self.cases.iter().map(|c| c.name.as_str()).collect();
            bail!(
                "regress: no case of {} matches --case {} (cases: {})",
                self.path.display(),
                globs.join(" "),
                names.join(", ")
            );
        }
        Ok(cases)
    }
}

impl Case {
    /// The `glmdiff run` command that re-runs the case (with the tokens it ran, when known).
    pub fn run_command(&self, tokens: Option<&[u32]>) -> String {
        let mut c = format!(
            "glmdiff run {}",
            shell_word(&self.model.display().to_string())
        );
        let asked = match &self.input {
            Input::Tokens(t) => Some(t.as_slice()),
            _ => None,
        };
        match (tokens.or(asked), &self.input) {
            (Some(t), _) => {
                let ids: Vec<String> = t.iter().map(u32::to_string).collect();
                c.push_str(&format!(" --tokens {}", ids.join(",")));
            }
            (None, Input::Prompt(p)) => c.push_str(&format!(" --prompt {}", shell_word(p))),
            _ => {}
        }
        if let Some(l) = &self.layers {
            c.push_str(&format!(" --layers {}..{}", l.start, l.end));
        }
        c.push_str(&format!(
            " --against {} --mode {}",
            shell_word(&self.against.to_string()),
            self.mode
        ));
        for g in &self.hook {
            c.push_str(&format!(" --hook {}", shell_word(g)));
        }
        for (g, v) in &self.tol {
            c.push_str(&format!(" --tol {}", shell_word(&format!("{g}={v:e}"))));
        }
        for o in &self.precision {
            c.push_str(&format!(
                " --precision {}",
                shell_word(&format!("{}={}", o.glob, o.dtype))
            ));
        }
        c
    }
}

/// Reads and checks a suite file.
pub fn load(path: &Path) -> Result<Suite> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("regress: cannot read the suite {}", path.display()))?;
    parse(path, &text)
}

/// Parses and checks suite text; `path` locates relative paths and names the file in errors.
pub fn parse(path: &Path, text: &str) -> Result<Suite> {
    let file = path.display().to_string();
    let table: Table = toml::from_str(text).map_err(|e| {
        anyhow::anyhow!(
            "regress: {file} is not valid TOML: {}",
            e.to_string().trim_end()
        )
    })?;
    for key in table.keys() {
        if key != "case" {
            bail!("regress: {file}: unknown top-level key {key:?}: a suite is a list of [[case]] tables");
        }
    }
    let cases = match table.get("case") {
        None => bail!("regress: {file} has no [[case]] table"),
        Some(Value::Array(a)) => a,
        Some(other) => bail!(
            "regress: {file}: \"case\" must be an array of tables ([[case]]), not {}",
            other.type_str()
        ),
    };
    if cases.is_empty() {
        bail!("regress: {file} has no [[case]] table");
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let mut out = Vec::with_capacity(cases.len());
    let mut names = BTreeSet::new();
    for (i, c) in cases.iter().enumerate() {
        let case = match c {
            Value::Table(t) => parse_case(&file, &dir, i + 1, t)?,
            other => bail!(
                "regress: {file}: case {} is a {}, not a table",
                i + 1,
                other.type_str()
            ),
        };
        if !names.insert(case.name.clone()) {
            bail!(
                "regress: {file}: case {} {:?}: key \"name\": another case has this name",
                i + 1,
                case.name
            );
        }
        out.push(case);
    }
    Ok(Suite {
        path: path.to_path_buf(),
        cases: out,
    })
}

/// Errors of one case: `file: case N "name": key "k": ...`.
struct Ctx<'a> {
    file: &'a str,
    n: usize,
    name: Option<&'a str>,
}

impl Ctx<'_> {
    fn err(&self, key: &str, msg: impl std::fmt::Display) -> anyhow::Error {
        match self.name {
            Some(name) => anyhow::anyhow!(
                "regress: {}: case {} {name:?}: key {key:?}: {msg}",
                self.file,
                self.n
            ),
            None => anyhow::anyhow!(
                "regress: {}: case {}: key {key:?}: {msg}",
                self.file,
                self.n
            ),
        }
    }

    fn wrong_type(&self, key: &str, want: &str, v: &Value) -> anyhow::Error {
        self.err(
            key,
            format!("expected {want}, got {} {}", v.type_str(), show(v)),
        )
    }

    fn string<'v>(&self, t: &'v Table, key: &str) -> Result<Option<&'v str>> {
        match t.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.wrong_type(key, "a string", v)),
        }
    }

    fn number(&self, t: &Table, key: &str, range: (f64, f64)) -> Result<Option<f64>> {
        let x = match t.get(key) {
            None => return Ok(None),
            Some(Value::Float(f)) => *f,
            Some(Value::Integer(i)) => *i as f64,
            Some(v) => return Err(self.wrong_type(key, "a number", v)),
        };
        if !x.is_finite() || x < range.0 || x > range.1 {
            return Err(self.err(key, format!("{x} is outside {}..={}", range.0, range.1)));
        }
        Ok(Some(x))
    }

    fn uint(&self, key: &str, v: &Value, max: u64) -> Result<u64> {
        match v {
            Value::Integer(i) if *i >= 0 && (*i as u64) <= max => Ok(*i as u64),
            Value::Integer(i) => Err(self.err(key, format!("{i} is outside 0..={max}"))),
            v => Err(self.wrong_type(key, "a non-negative integer", v)),
        }
    }

    fn ids(&self, key: &str, v: &Value) -> Result<Vec<u32>> {
        match v {
            Value::Array(a) => a
                .iter()
                .map(|x| self.uint(key, x, u64::from(u32::MAX)).map(|x| x as u32))
                .collect(),
            v => Err(self.wrong_type(key, "an array of token ids", v)),
        }
    }

    /// A table of glob = value pairs, the longest glob first.
    fn globs<T>(
        &self,
        t: &Table,
        key: &str,
        value: impl Fn(&Value) -> std::result::Result<T, String>,
    ) -> Result<Vec<(String, T)>> {
        let table = match t.get(key) {
            None => return Ok(Vec::new()),
            Some(Value::Table(g)) => g,
            Some(v) => return Err(self.wrong_type(key, "a table of \"GLOB\" = value", v)),
        };
        let mut out = Vec::with_capacity(table.len());
        for (g, v) in table {
            if g.trim().is_empty() {
                return Err(self.err(key, "an empty glob"));
            }
            let v = value(v).map_err(|m| self.err(&format!("{key}.{g}"), m))?;
            out.push((g.clone(), v));
        }
        out.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then_with(|| a.0.cmp(&b.0)));
        Ok(out)
    }
}

fn parse_case(file: &str, dir: &Path, n: usize, t: &Table) -> Result<Case> {
    let mut cx = Ctx {
        file,
        n,
        name: None,
    };
    let name = match t.get("name") {
        None => return Err(cx.err("name", "missing: every case needs a unique name")),
        Some(Value::String(s)) if !s.trim().is_empty() => s.as_str(),
        Some(v) => return Err(cx.wrong_type("name", "a non-empty string", v)),
    };
    cx.name = Some(name);
    for key in t.keys() {
        if !CASE_KEYS.contains(&key.as_str()) {
            return Err(cx.err(
                key,
                format!("unknown key (a case has: {})", CASE_KEYS.join(", ")),
            ));
        }
    }
    let model = match cx.string(t, "model")? {
        None => return Err(cx.err("model", "missing: the GGUF to run")),
        Some(m) => dir.join(m),
    };
    if !model.is_file() {
        return Err(cx.err("model", format!("no such file {}", model.display())));
    }
    let input = match (cx.string(t, "prompt")?, t.get("tokens")) {
        (Some(_), Some(_)) => return Err(cx.err("tokens", "give prompt or tokens, not both")),
        (Some(p), None) => Input::Prompt(p.to_string()),
        (None, Some(v)) => {
            let ids = cx.ids("tokens", v)?;
            if ids.is_empty() {
                return Err(cx.err("tokens", "no tokens"));
            }
            Input::Tokens(ids)
        }
        (None, None) => Input::FromTrace,
    };
    let against = match cx.string(t, "against")? {
        None => {
            return Err(cx.err(
                "against",
                "missing: the candidate (cpu, cuda, cuda:N or trace:FILE)",
            ))
        }
        Some(a) => match Against::parse(a) {
            Ok(Against::Trace(p)) if p.as_os_str().is_empty() => {
                return Err(cx.err("against", "trace: needs a file"))
            }
            Err(_) if a == "trace:" => return Err(cx.err("against", "trace: needs a file")),
            Ok(Against::Trace(p)) => {
                let p = dir.join(p);
                if !p.is_file() {
                    return Err(cx.err("against", format!("no such file {}", p.display())));
                }
                Against::Trace(p)
            }
            Ok(a @ (Against::Auto | Against::Cpu | Against::Cuda(_))) => a,
            Err(_) => {
                return Err(cx.err(
                    "against",
                    format!("{a:?} is not one of auto, cpu, cuda, cuda:N, trace:FILE"),
                ))
            }
        },
    };
    if input == Input::FromTrace && !matches!(against, Against::Trace(_)) {
        return Err(cx.err(
            "prompt",
            "missing: give prompt or tokens (only a trace candidate brings its own tokens)",
        ));
    }
    let layers = match (t.get("layer"), t.get("layers")) {
        (Some(_), Some(_)) => return Err(cx.err("layers", "give layer or layers, not both")),
        (Some(v), None) => {
            let l = cx.uint("layer", v, u64::from(u32::MAX))?;
            Some(l..l + 1)
        }
        (None, Some(Value::String(s))) => {
            Some(parse_range(s).map_err(|m| cx.err("layers", format!("{s:?}: {m}")))?)
        }
        (None, Some(Value::Array(a))) if a.len() == 2 => {
            let (x, y) = (
                cx.uint("layers", &a[0], u64::from(u32::MAX))?,
                cx.uint("layers", &a[1], u64::from(u32::MAX))?,
            );
            if x >= y {
                return Err(cx.err(
                    "layers",
                    format!("[{x}, {y}] is empty (the end is exclusive)"),
                ));
            }
            Some(x..y)
        }
        (None, Some(v)) => return Err(cx.wrong_type("layers", "\"A..B\" or [A, B]", v)),
        (None, None) => None,
    };
    let mode = match cx.string(t, "mode")? {
        None => Modes::BOTH,
        Some(m) => Modes::parse(m).map_err(|e| cx.err("mode", e.to_string()))?,
    };
    let dtype = match cx.string(t, "dtype")? {
        None => CudaDtype::F32,
        Some(d) => CudaDtype::parse(d).map_err(|e| cx.err("dtype", e.to_string()))?,
    };
    let hook = match t.get("hook") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.clone()),
                v => Err(cx.wrong_type("hook", "a glob string", v)),
            })
            .collect::<Result<_>>()?,
        Some(v) => return Err(cx.wrong_type("hook", "a glob or an array of globs", v)),
    };
    let tol = cx.globs(t, "tol", |v| {
        let x = match v {
            Value::Float(f) => *f,
            Value::Integer(i) => *i as f64,
            v => {
                return Err(format!(
                    "expected a number, got {} {}",
                    v.type_str(),
                    show(v)
                ))
            }
        };
        if x.is_finite() && x >= 0.0 {
            Ok(x)
        } else {
            Err(format!("{x} must be finite and not negative"))
        }
    })?;
    let precision = cx
        .globs(t, "precision", |v| match v {
            Value::String(d) => Ok(d.clone()),
            v => Err(format!(
                "expected a dtype string, got {} {}",
                v.type_str(),
                show(v)
            )),
        })?
        .into_iter()
        .map(|(g, d)| {
            PrecisionOverride::flag(&g, &d).map_err(|_| {
                cx.err(
                    &format!("precision.{g}"),
                    format!("{d:?} is not one of {PRECISION_WORDS}"),
                )
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let top5 = match t.get("expect_top5") {
        None => None,
        Some(Value::Array(rows)) => {
            if rows.is_empty() {
                return Err(cx.err("expect_top5", "no positions"));
            }
            let rows: Vec<Vec<u32>> = rows
                .iter()
                .map(|r| cx.ids("expect_top5", r))
                .collect::<Result<_>>()?;
            if let Some(i) = rows.iter().position(|r| r.is_empty() || r.len() > 5) {
                return Err(cx.err(
                    "expect_top5",
                    format!(
                        "position {i} pins {} ids: give 1 to 5 per position",
                        rows[i].len()
                    ),
                ));
            }
            Some(rows)
        }
        Some(v) => {
            return Err(cx.wrong_type("expect_top5", "an array of id arrays, one per position", v))
        }
    };
    if let (Input::Tokens(ids), Some(rows)) = (&input, &top5) {
        if rows.len() != ids.len() {
            return Err(cx.err(
                "expect_top5",
                format!(
                    "pins {} positions, but the case has {} tokens: one row of ids per position",
                    rows.len(),
                    ids.len()
                ),
            ));
        }
    }
    let divergence = cx.string(t, "expect_divergence")?.map(str::to_string);
    if divergence.as_deref().is_some_and(|d| d.trim().is_empty()) {
        return Err(cx.err("expect_divergence", "an empty hook name"));
    }
    let expect = Expect {
        max_kl: cx.number(t, "max_kl", (0.0, f64::MAX))?,
        top1_agreement: cx.number(t, "top1_agreement", (0.0, 1.0))?,
        top5,
        divergence,
    };
    Ok(Case {
        name: name.to_string(),
        model,
        input,
        against,
        layers,
        mode,
        dtype,
        hook,
        tol,
        precision,
        expect,
    })
}

/// A TOML value as it is shown in errors (JSON spelling).
fn show(v: &Value) -> String {
    serde_json::to_string(v).unwrap_or_else(|_| format!("{v:?}"))
}

/// `A..B`, end exclusive.
fn parse_range(s: &str) -> std::result::Result<Range<u64>, String> {
    let (a, b) = s.split_once("..").ok_or("expected A..B")?;
    let a: u64 = a
        .trim()
        .parse()
        .map_err(|_| format!("{a:?} is not a number"))?;
    let b: u64 = b
        .trim()
        .parse()
        .map_err(|_| format!("{b:?} is not a number"))?;
    if a >= b {
        return Err(format!("{a}..{b} is empty (the end is exclusive)"));
    }
    Ok(a..b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn suite(text: &str) -> Result<Suite> {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("m.gguf"), b"x").unwrap();
        std::fs::write(dir.path().join("t.safetensors"), b"x").unwrap();
        parse(&dir.path().join("s.toml"), text)
    }

    fn err(text: &str) -> String {
        format!("{:#}", suite(text).unwrap_err())
    }

    #[test]
    fn a_full_case_parses() {
        let s = suite(
            r#"
[[case]]
name = "a"
model = "m.gguf"
prompt = "The capital of France is"
against = "cpu"
layers = "1..3"
hook = "blk.*"
max_kl = 1e-6
top1_agreement = 1
expect_top5 = [[1, 2, 3, 4, 5], [6]]
[case.tol]
"blk.*" = 1e-3
"blk.*.moe_*" = 1e-5
[case.precision]
"blk.*.indexer_*" = "fp8"

[[case]]
name = "b"
model = "m.gguf"
against = "trace:t.safetensors"
layer = 2
expect_divergence = "blk.1.attn_heads"
"#,
        )
        .unwrap();
        let a = &s.cases[0];
        assert_eq!(a.input, Input::Prompt("The capital of France is".into()));
        assert_eq!(a.layers, Some(1..3));
        assert_eq!(a.hook, vec!["blk.*".to_string()]);
        // The most specific glob first.
        assert_eq!(a.tol[0], ("blk.*.moe_*".to_string(), 1e-5));
        assert_eq!(a.expect.top1_agreement, Some(1.0));
        assert_eq!(a.expect.top5.as_ref().unwrap()[1], vec![6]);
        let b = &s.cases[1];
        assert_eq!(b.input, Input::FromTrace);
        assert_eq!(b.layers, Some(2..3));
        assert!(matches!(&b.against, Against::Trace(p) if p.ends_with("t.safetensors")));
        assert_eq!(b.expect.divergence.as_deref(), Some("blk.1.attn_heads"));
    }

    /// `--case` globs keep the matching cases with their index; none matching names them all.
    #[test]
    fn select_keeps_the_cases_a_glob_matches() {
        let case = |n: &str| {
            format!(
                "[[case]]\nname = \"{n}\"\nmodel = \"m.gguf\"\nagainst = \"cpu\"\ntokens = [1]\n"
            )
        };
        let s = suite(&[case("glm-a"), case("dsv3-b"), case("glm-c")].concat()).unwrap();
        let names = |globs: &[&str]| -> Vec<(usize, String)> {
            let g: Vec<String> = globs.iter().map(|g| g.to_string()).collect();
            s.select(&g)
                .unwrap()
                .into_iter()
                .map(|(i, c)| (i, c.name.clone()))
                .collect()
        };
        assert_eq!(names(&[]).len(), 3);
        assert_eq!(
            names(&["glm-*"]),
            vec![(0, "glm-a".to_string()), (2, "glm-c".to_string())]
        );
        assert_eq!(names(&["zzz", "dsv3-?"]), vec![(1, "dsv3-b".to_string())]);
        let e = format!("{:#}", s.select(&["zzz*".to_string()]).unwrap_err());
        assert!(
            e.contains("s.toml matches --case zzz* (cases: glm-a, dsv3-b, glm-c)"),
            "{e}"
        );
    }

    /// The re-run command quotes what a shell would split, and prefers the tokens that ran.
    #[test]
    fn run_command_is_the_case_as_flags() {
        let s = suite(
            r#"
[[case]]
name = "a"
model = "m.gguf"
prompt = "it's"
against = "cpu"
layers = "1..3"
mode = "replay"
hook = "blk.*"
[case.tol]
"blk.*" = 1e-3
"#,
        )
        .unwrap();
        let c = &s.cases[0];
        let model = c.model.display().to_string();
        assert_eq!(
            c.run_command(None),
            format!(
                "glmdiff run {model} --prompt 'it'\\''s' --layers 1..3 --against cpu --mode replay --hook 'blk.*' --tol 'blk.*=1e-3'"
            )
        );
        assert!(c
            .run_command(Some(&[5, 6]))
            .starts_with(&format!("glmdiff run {model} --tokens 5,6 --layers")));
    }

    #[test]
    fn errors_name_the_case_and_the_key() {
        let base = "[[case]]\nname = \"c\"\nmodel = \"m.gguf\"\nagainst = \"cpu\"\ntokens = [1]\n";
        let e = err(&format!("{base}max_k1 = 1e-6\n"));
        assert!(
            e.contains("case 1 \"c\": key \"max_k1\": unknown key"),
            "{e}"
        );
        let e = err(&format!("{base}max_kl = \"small\"\n"));
        assert!(e.contains("key \"max_kl\": expected a number"), "{e}");
        let e = err(&format!("{base}top1_agreement = 2\n"));
        assert!(e.contains("key \"top1_agreement\": 2 is outside"), "{e}");
        let e = err(&format!("{base}[case.tol]\n\"blk.*\" = -1\n"));
        assert!(e.contains("key \"tol.blk.*\""), "{e}");
        let e = err(&format!("{base}expect_top5 = [[1, 2, 3, 4, 5, 6]]\n"));
        assert!(e.contains("key \"expect_top5\": position 0 pins 6"), "{e}");
        let e = err(&format!("{base}layers = \"3..1\"\n"));
        assert!(e.contains("key \"layers\""), "{e}");
        let e = err(&format!("{base}{base}"));
        assert!(e.contains("case 2 \"c\": key \"name\""), "{e}");
        let e = err("[[case]]\nname = \"d\"\nmodel = \"nope.gguf\"\nagainst = \"cpu\"\n");
        assert!(
            e.contains("case 1 \"d\": key \"model\": no such file"),
            "{e}"
        );
        let e = err("[[case]]\nname = \"d\"\nmodel = \"m.gguf\"\nagainst = \"gpu\"\ntokens=[1]\n");
        assert!(e.contains("key \"against\""), "{e}");
        let e = err("[[case]]\nname = \"d\"\nmodel = \"m.gguf\"\nagainst = \"cpu\"\n");
        assert!(e.contains("key \"prompt\": missing"), "{e}");
        let e = err("[[case]]\nmodel = \"m.gguf\"\n");
        assert!(e.contains("case 1: key \"name\": missing"), "{e}");
        let e = err("title = \"x\"\n");
        assert!(e.contains("unknown top-level key \"title\""), "{e}");
        let e = err("[[case]\n");
        assert!(e.contains("not valid TOML"), "{e}");
    }
}
