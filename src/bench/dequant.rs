//! `glmdiff bench dequant`: dequantization speed per type, on one thread and on all threads,
//! beside libggml (llama.cpp's C) and gguf-py measured in the same run on the same bytes.
//!
//! For each type with a dequantizer, [`run`] builds `elements` values worth of random valid
//! blocks ([`super::random_blocks`]), times [`quant::dequantize`] (one thread) and
//! [`quant::dequantize_par`] (rayon's pool) as the median of `reps` runs after one warm-up.
//! With a libggml ([`super::libggml`]) its row dequantizer is timed on one thread too, its
//! repetitions alternating with glmdiff's (so a busy machine slows both alike), and its output
//! is compared with glmdiff's bit for bit. Then `python3` is spawned to time
//! `gguf.quants.dequantize` on the same bytes (rows of [`PY_ROW_ELEMENTS`] values, the way a
//! converter calls it). Rates are million elements per second and GB/s of f32 output.

use super::cpu_model;
use super::libggml::LibGgml;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use super::random_blocks::fill_blocks;
use crate::quant::{self, GgmlType, TYPE_TABLE};
use crate::util::progress::{NoProgress, Progress};
use crate::util::rng::SplitMix64;

/// Default elements per type: 16 Mi values, 64 MiB of f32 output (larger than most L3 caches).
pub const DEFAULT_ELEMENTS: usize = 1 << 24;
/// Default timed repetitions per measurement (after one warm-up).
pub const DEFAULT_REPS: usize = 5;
/// Default timed repetitions of gguf-py (slow: keep the whole run near two minutes).
pub const DEFAULT_PY_REPS: usize = 3;
/// Default generator seed.
pub const DEFAULT_SEED: u64 = 0x0067_6C6D_6469_6666; // "glmdiff" in ASCII
/// Row length handed to gguf-py: a typical hidden size, a multiple of every block size.
pub const PY_ROW_ELEMENTS: usize = 4096;

/// llama.cpp's C `dequantize_row_*`, one thread of the reference 2-core machine, million
/// elements/s (measured outside glmdiff; constants, not re-measured here). Shown only when no
/// libggml is measured in the run: its same-run figure supersedes them.
pub const C_ANCHORS: &[(GgmlType, f64)] = &[
    (GgmlType::Q4_K, 1720.0),
    (GgmlType::Q5_K, 1721.0),
    (GgmlType::Q6_K, 783.0),
    (GgmlType::Q8_0, 2464.0),
    (GgmlType::IQ4_XS, 701.0),
    (GgmlType::IQ2_XS, 222.0),
];

/// gguf-py 0.19.0 `gguf.quants.dequantize` on the same machine, million elements/s
/// (measured outside glmdiff; the same-run measurement is the `gguf_py_melem_s` column).
pub const GGUF_PY_ANCHORS: &[(GgmlType, f64)] = &[
    (GgmlType::Q4_K, 52.0),
    (GgmlType::Q5_K, 68.0),
    (GgmlType::Q6_K, 110.0),
    (GgmlType::Q8_0, 192.0),
    (GgmlType::IQ4_XS, 90.0),
    (GgmlType::IQ2_XS, 45.0),
];

/// What to run.
#[derive(Clone, Debug)]
pub struct BenchDequantOptions {
    /// Values per type (rounded down to whole blocks, at least one block).
    pub elements: usize,
    /// Timed repetitions of each glmdiff measurement; the median is reported.
    pub reps: usize,
    /// Timed repetitions inside gguf-py; the median is reported.
    pub py_reps: usize,
    /// Types to run; empty means every type that has a dequantizer.
    pub types: Vec<GgmlType>,
    /// Time gguf-py too (needs `python` with numpy and gguf importable).
    pub with_python: bool,
    /// The Python interpreter to spawn.
    pub python: String,
    /// Seed of the random block generator (the same seed gives the same bytes).
    pub seed: u64,
    /// A libggml-base shared library to time and compare against (`None`: the C anchors).
    pub libggml: Option<PathBuf>,
}

impl Default for BenchDequantOptions {
    fn default() -> Self {
        Self {
            elements: DEFAULT_ELEMENTS,
            reps: DEFAULT_REPS,
            py_reps: DEFAULT_PY_REPS,
            types: Vec::new(),
            with_python: true,
            python: "python3".to_string(),
            seed: DEFAULT_SEED,
            libggml: None,
        }
    }
}

/// One type's measurements.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// Type name as ggml spells it.
    pub ty: String,
    /// Elements dequantized per run.
    pub elements: usize,
    /// Bytes of quantized input per run.
    pub input_bytes: usize,
    /// glmdiff, one thread: million elements/s (median).
    pub single_melem_s: f64,
    /// glmdiff, one thread: GB/s of f32 output.
    pub single_gb_s: f64,
    /// glmdiff, all threads of rayon's pool: million elements/s (median).
    pub multi_melem_s: f64,
    /// glmdiff, all threads: GB/s of f32 output.
    pub multi_gb_s: f64,
    /// libggml's row dequantizer measured in this run on the same bytes, one thread: million
    /// elements/s (median; `None` without `--libggml` or where ggml has no row function).
    pub libggml_melem_s: Option<f64>,
    /// `single_melem_s / libggml_melem_s`.
    pub ratio_single_vs_libggml: Option<f64>,
    /// Values whose bits differ between glmdiff and libggml (NaN equal to NaN; `None`: not
    /// compared).
    pub libggml_mismatches: Option<u64>,
    /// The first value that differs, if any.
    pub libggml_first_mismatch: Option<Mismatch>,
    /// Why libggml was not measured for this type (`skipped: ...`), with `--libggml`.
    pub libggml_note: Option<String>,
    /// llama.cpp C one-thread figure for this type, if known ([`C_ANCHORS`]); only without a
    /// libggml in the run.
    pub c_anchor_melem_s: Option<f64>,
    /// `single_melem_s / c_anchor_melem_s`.
    pub ratio_single_vs_c: Option<f64>,
    /// gguf-py measured in this run on the same bytes: million elements/s (median).
    pub gguf_py_melem_s: Option<f64>,
    /// `single_melem_s / gguf_py_melem_s`.
    pub ratio_single_vs_gguf_py: Option<f64>,
    /// gguf-py figure measured outside this run, if known ([`GGUF_PY_ANCHORS`]).
    pub gguf_py_anchor_melem_s: Option<f64>,
    /// Why gguf-py was not measured for this type (`skipped: ...`).
    pub gguf_py_note: Option<String>,
}

/// The whole benchmark.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// CPU model (from /proc/cpuinfo where available).
    pub cpu: String,
    /// Threads used by the all-threads measurement.
    pub threads: usize,
    /// Requested values per type.
    pub elements: usize,
    /// Timed repetitions per glmdiff measurement.
    pub reps: usize,
    /// Timed repetitions per gguf-py measurement.
    pub py_reps: usize,
    /// Generator seed.
    pub seed: u64,
    /// gguf-py version used, or `skipped: <reason>`.
    pub gguf_py: String,
    /// The libggml measured (its path as given), or `None`.
    pub libggml: Option<String>,
    /// The build of glmdiff's dequantizers that ran (`base`, `avx2`, `avx512`:
    /// [`quant::simd`]).
    pub cpu_simd: String,
    /// One row per type, in type-id order.
    pub rows: Vec<Row>,
}

impl Report {
    /// Whether libggml's output differs from glmdiff's for a type.
    pub fn libggml_differs(&self) -> bool {
        self.rows
            .iter()
            .any(|r| r.libggml_mismatches.is_some_and(|n| n > 0))
    }
}

/// A value on which glmdiff and libggml disagree.
#[derive(Clone, Debug, Serialize)]
pub struct Mismatch {
    /// Flat element index.
    pub index: usize,
    /// glmdiff's value.
    pub glmdiff: f32,
    /// libggml's value.
    pub libggml: f32,
}

fn anchor(table: &[(GgmlType, f64)], ty: GgmlType) -> Option<f64> {
    table.iter().find(|(t, _)| *t == ty).map(|&(_, v)| v)
}

/// Median of `reps` timings (seconds) of `f`, after one untimed warm-up call.
fn median_seconds(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut t = Vec::with_capacity(reps.max(1));
    for _ in 0..reps.max(1) {
        let start = Instant::now();
        f()?;
        t.push(start.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// Median of `reps` timings (seconds) of `f` and of `g`, after one untimed warm-up call of
/// each. The two alternate, and which goes first alternates too (`f g g f f g ...`): a run
/// right after the other one inherits its dirty cache lines and costs a few percent more.
fn median_seconds_pair(
    reps: usize,
    mut f: impl FnMut() -> Result<()>,
    mut g: impl FnMut() -> Result<()>,
) -> Result<(f64, f64)> {
    f()?;
    g()?;
    let (mut tf, mut tg) = (Vec::new(), Vec::new());
    let time = |h: &mut dyn FnMut() -> Result<()>, t: &mut Vec<f64>| -> Result<()> {
        let start = Instant::now();
        h()?;
        t.push(start.elapsed().as_secs_f64());
        Ok(())
    };
    for r in 0..reps.max(1) {
        if r % 2 == 0 {
            time(&mut f, &mut tf)?;
            time(&mut g, &mut tg)?;
        } else {
            time(&mut g, &mut tg)?;
            time(&mut f, &mut tf)?;
        }
    }
    tf.sort_by(f64::total_cmp);
    tg.sort_by(f64::total_cmp);
    Ok((tf[tf.len() / 2], tg[tg.len() / 2]))
}

/// The number of values of `a` and `b` whose bits differ (NaN equal to NaN) and the first.
fn bit_mismatches(a: &[f32], b: &[f32]) -> (u64, Option<Mismatch>) {
    let same = |x: f32, y: f32| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan());
    let mut n = 0u64;
    let mut first = None;
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        if !same(x, y) {
            n += 1;
            first.get_or_insert(Mismatch {
                index: i,
                glmdiff: x,
                libggml: y,
            });
        }
    }
    (n, first)
}

/// Runs the benchmark. Types without a dequantizer are left out; a missing or broken Python
/// only fills the gguf-py columns with `skipped: <reason>`. With a libggml, a library that
/// cannot be opened or lacks the row function of a type asked is an error before any timing.
pub fn run(opts: &BenchDequantOptions) -> Result<Report> {
    run_with_progress(opts, &NoProgress)
}

/// [`run`], reporting the types measured to `progress`.
pub fn run_with_progress(opts: &BenchDequantOptions, progress: &dyn Progress) -> Result<Report> {
    let types: Vec<GgmlType> = if opts.types.is_empty() {
        TYPE_TABLE.iter().map(|r| r.ty).collect()
    } else {
        opts.types.clone()
    };
    let types: Vec<GgmlType> = types
        .into_iter()
        .filter(|&ty| quant::dequant_fn(ty).is_some())
        .collect();
    let lib = match &opts.libggml {
        Some(p) => Some(LibGgml::open(p, &types)?),
        None => None,
    };
    progress.start("bench dequant", types.len() as u64);
    let mut rows = Vec::new();
    let py = if opts.with_python {
        probe_python(&opts.python)
    } else {
        Err("skipped: disabled by options".to_string())
    };
    let mut rng = SplitMix64::new(opts.seed);
    let mut src: Vec<u8> = Vec::new();
    let mut dst: Vec<f32> = Vec::new();
    let mut dst_c: Vec<f32> = Vec::new();
    for ty in types {
        progress.phase(&format!("bench dequant: {ty}"));
        let (bs, ts) = (ty.block_size(), ty.type_size());
        let n = (opts.elements / bs).max(1) * bs;
        // Reserved fallibly: an element count past the machine's memory is an error, not an
        // abort.
        let gib = |b: usize| b as f64 / f64::from(1u32 << 30);
        let short = |what: &str, bytes: usize| {
            anyhow::anyhow!(
                "bench dequant: {n} elements of {ty}: cannot allocate {what} ({:.1} GiB); give a smaller --elements",
                gib(bytes)
            )
        };
        let src_bytes = n / bs * ts;
        src.try_reserve_exact(src_bytes.saturating_sub(src.len()))
            .map_err(|_| short("the source blocks", src_bytes))?;
        dst.try_reserve_exact(n.saturating_sub(dst.len()))
            .map_err(|_| short("the f32 output", n * 4))?;
        src.resize(src_bytes, 0);
        dst.resize(n, 0.0);
        fill_blocks(ty, &mut rng, &mut src);
        let ctx = || format!("bench: dequantizing {n} elements of {ty}");
        let rate = |s: f64| n as f64 / s / 1e6;
        let mut c = LibRow::default();
        let single = match &lib {
            Some(l) if l.has(ty) => {
                dst_c
                    .try_reserve_exact(n.saturating_sub(dst_c.len()))
                    .map_err(|_| short("libggml's f32 output", n * 4))?;
                dst_c.resize(n, 0.0);
                let (single, c_s) = median_seconds_pair(
                    opts.reps,
                    || quant::dequantize(ty, &src, &mut dst),
                    || l.dequantize(ty, &src, &mut dst_c),
                )
                .with_context(ctx)?;
                let (mismatches, first) = bit_mismatches(&dst, &dst_c);
                c.melem_s = Some(rate(c_s));
                c.mismatches = Some(mismatches);
                c.first = first;
                single
            }
            Some(_) => {
                c.note = Some(format!("skipped: libggml has no row conversion for {ty}"));
                median_seconds(opts.reps, || quant::dequantize(ty, &src, &mut dst))
                    .with_context(ctx)?
            }
            None => median_seconds(opts.reps, || quant::dequantize(ty, &src, &mut dst))
                .with_context(ctx)?,
        };
        let multi = median_seconds(opts.reps, || quant::dequantize_par(ty, &src, &mut dst))
            .with_context(ctx)?;
        let gbs = |s: f64| (n * std::mem::size_of::<f32>()) as f64 / s / 1e9;
        let (gguf_py_melem_s, gguf_py_note) = match &py {
            Err(why) => (None, Some(why.clone())),
            Ok(p) if !p.supported.iter().any(|s| s == ty.name()) => (
                None,
                Some(format!("skipped: gguf-py has no dequantization for {ty}")),
            ),
            Ok(_) if ty == GgmlType::F32 => (
                None,
                Some("skipped: gguf-py returns a view for F32 (no work)".to_string()),
            ),
            Ok(_) => match time_python(&opts.python, ty, &src, opts.py_reps) {
                Ok(s) => (Some(rate(s)), None),
                Err(why) => (None, Some(format!("skipped: {why}"))),
            },
        };
        let c_anchor = anchor(C_ANCHORS, ty).filter(|_| lib.is_none());
        rows.push(Row {
            ty: ty.name().to_string(),
            elements: n,
            input_bytes: src.len(),
            single_melem_s: rate(single),
            single_gb_s: gbs(single),
            multi_melem_s: rate(multi),
            multi_gb_s: gbs(multi),
            libggml_melem_s: c.melem_s,
            ratio_single_vs_libggml: c.melem_s.map(|c| rate(single) / c),
            libggml_mismatches: c.mismatches,
            libggml_first_mismatch: c.first,
            libggml_note: c.note,
            c_anchor_melem_s: c_anchor,
            ratio_single_vs_c: c_anchor.map(|c| rate(single) / c),
            gguf_py_melem_s,
            ratio_single_vs_gguf_py: gguf_py_melem_s.map(|p| rate(single) / p),
            gguf_py_anchor_melem_s: anchor(GGUF_PY_ANCHORS, ty),
            gguf_py_note,
        });
        progress.inc(1);
    }
    progress.finish();
    Ok(Report {
        cpu: cpu_model(),
        threads: rayon::current_num_threads(),
        elements: opts.elements,
        reps: opts.reps,
        py_reps: opts.py_reps,
        seed: opts.seed,
        gguf_py: match &py {
            Ok(p) => format!("gguf {} (numpy {})", p.gguf, p.numpy),
            Err(why) => why.clone(),
        },
        libggml: lib.map(|l| l.path().display().to_string()),
        cpu_simd: quant::simd::detected().name().to_string(),
        rows,
    })
}

/// libggml's figures for one type.
#[derive(Default)]
struct LibRow {
    melem_s: Option<f64>,
    mismatches: Option<u64>,
    first: Option<Mismatch>,
    note: Option<String>,
}

/// What the Python probe found.
#[derive(Debug, Deserialize)]
struct PyProbe {
    gguf: String,
    numpy: String,
    /// Names of the types `gguf.quants.dequantize` accepts.
    supported: Vec<String>,
}

/// Python: print the gguf and numpy versions and the types gguf-py can dequantize.
const PY_PROBE: &str = r#"
import json, sys
from importlib.metadata import version
import numpy as np
from gguf import quants
from gguf.constants import GGMLQuantizationType, GGML_QUANT_SIZES
ok = []
for t in GGMLQuantizationType:
    if t not in GGML_QUANT_SIZES:
        continue
    bs, ts = GGML_QUANT_SIZES[t]
    try:
        quants.dequantize(np.zeros(ts, dtype=np.uint8), t)
        ok.append(t.name)
    except Exception:
        pass
print(json.dumps({"gguf": version("gguf"), "numpy": np.__version__, "supported": ok}))
"#;

/// Python: read whole blocks of argv[1] from stdin as rows of argv[3] elements, time
/// `gguf.quants.dequantize` argv[2] times after a warm-up on the first rows, print the median
/// seconds as JSON. Only the dequantize call is timed.
const PY_TIME: &str = r#"
import json, sys, time
import numpy as np
from gguf import quants
from gguf.constants import GGMLQuantizationType, GGML_QUANT_SIZES
name, reps, row = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
t = GGMLQuantizationType[name]
bs, ts = GGML_QUANT_SIZES[t]
data = np.frombuffer(sys.stdin.buffer.read(), dtype=np.uint8)
rows = data.reshape(-1, row // bs * ts)
quants.dequantize(rows[:16], t)
times = []
for _ in range(max(reps, 1)):
    start = time.perf_counter()
    quants.dequantize(rows, t)
    times.append(time.perf_counter() - start)
times.sort()
print(json.dumps({"seconds": times[len(times) // 2]}))
"#;

/// Runs the probe; `Err` holds the `skipped: ...` note for every row.
fn probe_python(python: &str) -> std::result::Result<PyProbe, String> {
    let out = Command::new(python)
        .args(["-c", PY_PROBE])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("skipped: cannot run {python}: {e}"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err.lines().last().unwrap_or("no error output");
        return Err(format!("skipped: {python} cannot import gguf-py: {last}"));
    }
    serde_json::from_slice(&out.stdout)
        .map_err(|e| format!("skipped: unreadable gguf-py probe output: {e}"))
}

#[derive(Deserialize)]
struct PyTiming {
    seconds: f64,
}

/// Times gguf-py on `src` (whole blocks of `ty`); returns the median seconds per call.
fn time_python(python: &str, ty: GgmlType, src: &[u8], reps: usize) -> Result<f64> {
    let row_bytes = PY_ROW_ELEMENTS / ty.block_size() * ty.type_size();
    if src.len() % row_bytes != 0 {
        bail!(
            "{} bytes of {ty} are not whole rows of {PY_ROW_ELEMENTS} elements",
            src.len()
        );
    }
    let mut child = Command::new(python)
        .args(["-c", PY_TIME, ty.name(), &reps.to_string()])
        .arg(PY_ROW_ELEMENTS.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot run {python}"))?;
    // Write from a thread so that a child failing early cannot block us on a full pipe.
    let mut stdin = child.stdin.take().context("no stdin pipe to python")?;
    let (written, out) = std::thread::scope(|s| {
        let writer = s.spawn(move || stdin.write_all(src));
        let out = child.wait_with_output();
        (writer.join(), out)
    });
    let out = out.context("waiting for python")?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err.lines().last().unwrap_or("no error output");
        bail!("gguf-py failed on {ty}: {last}");
    }
    match written {
        Ok(Ok(())) => {}
        Ok(Err(e)) => bail!("writing {} bytes of {ty} to python: {e}", src.len()),
        Err(_) => bail!("the thread writing {ty} blocks to python panicked"),
    }
    let t: PyTiming =
        serde_json::from_slice(&out.stdout).context("unreadable gguf-py timing output")?;
    if t.seconds.is_nan() || t.seconds <= 0.0 {
        bail!("gguf-py reported {} s for {ty}", t.seconds);
    }
    Ok(t.seconds)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_run_without_python_fills_every_rate() {
        let opts = BenchDequantOptions {
            elements: 4096,
            reps: 1,
            types: vec![GgmlType::Q4_K, GgmlType::Q8_0, GgmlType::Q8_1],
            with_python: false,
            ..Default::default()
        };
        let r = run(&opts).unwrap();
        // Q8_1 has no dequantizer: left out.
        let names: Vec<&str> = r.rows.iter().map(|r| r.ty.as_str()).collect();
        assert_eq!(names, ["Q4_K", "Q8_0"]);
        for row in &r.rows {
            assert!(row.single_melem_s > 0.0 && row.multi_melem_s > 0.0);
            assert_eq!(
                row.gguf_py_note.as_deref(),
                Some("skipped: disabled by options")
            );
        }
        assert_eq!(r.rows[0].c_anchor_melem_s, Some(1720.0));
        let json = serde_json::to_string(&r).unwrap();
        assert!(json.contains("\"ratio_single_vs_c\""));
    }

    #[test]
    fn missing_python_is_a_skip_note_not_an_error() {
        let opts = BenchDequantOptions {
            elements: 256,
            reps: 1,
            types: vec![GgmlType::Q6_K],
            python: "/nonexistent/python3".to_string(),
            ..Default::default()
        };
        let r = run(&opts).unwrap();
        assert!(r
            .gguf_py
            .starts_with("skipped: cannot run /nonexistent/python3"));
        let note = r.rows[0].gguf_py_note.as_deref().unwrap();
        assert!(note.starts_with("skipped:"), "{note}");
    }
}
