//! Text rendering of `glmdiff bench dequant`, `glmdiff bench layer` and `glmdiff bench run`:
//! the tables and the notes under them. [`crate::bench`] measures and returns the reports; this module only formats them.

#[cfg(feature = "cuda")]
use super::table;
use super::{human_bytes, Grid};
use crate::bench::{dequant, layer, run};

fn fmt_opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".to_string(), |x| format!("{x:.digits$}"))
}

/// Renders a `bench dequant` report as a table, followed by the run's settings and any notes.
/// With a libggml in the run its columns replace the C figures measured outside it.
pub fn render_dequant(r: &dequant::Report) -> String {
    let multi_melem = format!("{}T Melem/s", r.threads);
    let multi_gb = format!("{}T GB/s", r.threads);
    let with_lib = r.libggml.is_some();
    // Narrow: the figures measured outside this run go first, then the GB/s columns.
    let mut cols: Vec<(&str, u8)> = vec![("type", 0), ("1T Melem/s", 0)];
    if with_lib {
        cols.extend([("libggml 1T", 0), ("1T / libggml", 0), ("bit-exact", 0)]);
    }
    cols.extend([("1T GB/s", 2), (&multi_melem, 0), (&multi_gb, 1)]);
    if !with_lib {
        cols.extend([("C 1T (ref)", 3), ("1T / C", 0)]);
    }
    cols.extend([
        ("gguf-py Melem/s", 0),
        ("1T / gguf-py", 0),
        ("gguf-py (ref)", 4),
    ]);
    let mut t = Grid::new(&cols);
    for row in &r.rows {
        let mut cells = vec![row.ty.clone(), format!("{:.0}", row.single_melem_s)];
        if with_lib {
            cells.extend([
                fmt_opt(row.libggml_melem_s, 0),
                fmt_opt(row.ratio_single_vs_libggml, 2),
                match row.libggml_mismatches {
                    None => "-".to_string(),
                    Some(0) => "yes".to_string(),
                    Some(n) => format!("NO ({n} differ)"),
                },
            ]);
        }
        cells.extend([
            format!("{:.2}", row.single_gb_s),
            format!("{:.0}", row.multi_melem_s),
            format!("{:.2}", row.multi_gb_s),
        ]);
        if !with_lib {
            cells.extend([
                fmt_opt(row.c_anchor_melem_s, 0),
                fmt_opt(row.ratio_single_vs_c, 2),
            ]);
        }
        cells.extend([
            fmt_opt(row.gguf_py_melem_s, 1),
            fmt_opt(row.ratio_single_vs_gguf_py, 0),
            fmt_opt(row.gguf_py_anchor_melem_s, 0),
        ]);
        t.add_row(cells);
    }
    let mut s = t.to_string();
    s.push_str(&format!(
        "\n{} elements per type, f32 output, median of {} runs (gguf-py: {}) after a warm-up; \
         cpu: {} (glmdiff's {} build); seed {:#x}; gguf-py: {}\n",
        r.elements, r.reps, r.py_reps, r.cpu, r.cpu_simd, r.seed, r.gguf_py
    ));
    match &r.libggml {
        Some(p) => s.push_str(&format!(
            "libggml: {p}, one thread, on the same bytes, its runs alternating with glmdiff's; \
             bit-exact: its output equals glmdiff's bit for bit.\n"
        )),
        None => s.push_str(
            "C (ref) is a figure measured outside this run on the reference machine \
             (--libggml PATH measures llama.cpp's C in the run).\n",
        ),
    }
    s.push_str("gguf-py (ref) is a figure measured outside this run on the reference machine.\n");
    for row in &r.rows {
        if let Some(m) = &row.libggml_first_mismatch {
            s.push_str(&format!(
                "{}: libggml differs: {} values, the first at {}: glmdiff {:e} ({:#010x}), \
                 libggml {:e} ({:#010x})\n",
                row.ty,
                row.libggml_mismatches.unwrap_or(0),
                m.index,
                m.glmdiff,
                m.glmdiff.to_bits(),
                m.libggml,
                m.libggml.to_bits()
            ));
        }
        if let Some(note) = &row.libggml_note {
            s.push_str(&format!("{}: libggml {note}\n", row.ty));
        }
        if let Some(note) = &row.gguf_py_note {
            if !note.starts_with("skipped: disabled") && r.gguf_py.starts_with("gguf") {
                s.push_str(&format!("{}: gguf-py {note}\n", row.ty));
            }
        }
    }
    s
}

const MIB: f64 = (1u64 << 20) as f64;

fn mib(b: u64) -> String {
    format!("{:.1}", b as f64 / MIB)
}

fn ms(s: f64) -> String {
    format!("{:.1}", s * 1e3)
}

/// Renders a `bench layer` report: a table per layer kind and token count, a memory table per token count,
/// then the run's settings and what the columns mean.
pub fn render_layer(r: &layer::Report) -> String {
    let mut s = String::new();
    s.push_str(&format!(
        "model: {} ({}, {}); layers run: 0..{}; {} experts, {} per token\n",
        r.model,
        human_bytes(r.model_bytes),
        r.arch,
        r.layers_run,
        r.n_expert,
        r.n_expert_used
    ));
    if let Some(syn) = &r.synth {
        s.push_str(&format!(
            "{}: {} written in {:.1} s ({:.0} MiB/s); temporary directory removed: {}\n",
            syn.description,
            human_bytes(syn.file_bytes),
            syn.write_s,
            syn.file_bytes as f64 / MIB / syn.write_s.max(1e-9),
            if syn.removed { "yes" } else { "NO" }
        ));
    }
    s.push_str(&format!(
        "cpu: {}; {} threads; load average before {}, after {}\n\n",
        r.cpu, r.threads, r.load_before, r.load_after
    ));

    let mut t = Grid::new(&[
        ("tokens", 0),
        ("layer", 0),
        ("wall ms", 0),
        ("CPU ms", 3),
        ("dequant thr-ms", 0),
        ("matmul thr-ms", 0),
        ("other thr-ms", 4),
        ("dq share", 0),
        ("quant MiB read", 5),
        ("f32 MiB out", 6),
        ("experts", 2),
        ("floor ms", 1),
        ("wall/floor", 0),
        ("peak anon MiB", 7),
    ]);
    for run in &r.runs {
        for k in &run.kinds {
            let other = k
                .cpu_s
                .map(|c| ms((c - k.dequant_s - k.matmul_s).max(0.0)))
                .unwrap_or_else(|| "-".into());
            let share = k
                .cpu_s
                .filter(|&c| c > 0.0)
                .map(|c| format!("{:.0}%", 100.0 * k.dequant_s / c))
                .unwrap_or_else(|| "-".into());
            let experts = match k.kind {
                layer::LayerKind::Dense => "-".to_string(),
                layer::LayerKind::Moe => format!(
                    "{:.0} / {}",
                    k.experts,
                    (run.tokens * r.n_expert_used).min(r.n_expert)
                ),
            };
            let label = if k.layers > 1 {
                format!("{} (mean of {})", k.kind.label(), k.layers)
            } else {
                k.kind.label().to_string()
            };
            t.add_row(vec![
                run.tokens.to_string(),
                label,
                ms(k.wall_s),
                k.cpu_s.map(ms).unwrap_or_else(|| "-".into()),
                ms(k.dequant_s),
                ms(k.matmul_s),
                other,
                share,
                mib(k.bytes_in),
                mib(k.values_out * 4),
                experts,
                k.floor_s.map(ms).unwrap_or_else(|| "-".into()),
                k.floor_s
                    .filter(|&f| f > 0.0)
                    .map(|f| format!("{:.2}", k.wall_s / f))
                    .unwrap_or_else(|| "-".into()),
                mib(k.peak_anon),
            ]);
        }
    }
    s.push_str(&t.to_string());
    s.push_str("\n\n");

    let mut m = Grid::new(&[
        ("tokens", 0),
        ("run s", 0),
        ("VmHWM MiB", 2),
        ("peak RssAnon MiB", 0),
        ("peak RssFile MiB", 0),
        ("RssAnon before", 3),
        ("RssFile before", 4),
        ("quant MiB read", 1),
        ("model MiB", 5),
    ]);
    for run in &r.runs {
        let read: u64 =
            run.embed.bytes_in + run.layers.iter().map(|l| l.counts.bytes_in).sum::<u64>();
        let hwm = if run.hwm_reset {
            mib(run.rss_after.vm_hwm)
        } else {
            format!("{} (not reset)", mib(run.rss_after.vm_hwm))
        };
        m.add_row(vec![
            run.tokens.to_string(),
            format!("{:.3}", run.wall_s),
            hwm,
            mib(run.peak_anon),
            mib(run.peak_file),
            mib(run.rss_before.rss_anon),
            mib(run.rss_before.rss_file),
            mib(read),
            mib(r.model_bytes),
        ]);
    }
    s.push_str(&m.to_string());
    s.push('\n');
    for run in &r.runs {
        for l in &run.layers {
            if l.counts.bytes_in != l.expected_bytes_in || l.counts.madds != l.expected_madds {
                s.push_str(&format!(
                    "note: {} tokens, layer {}: counted {} bytes / {} multiply-adds, the layer's tensors and touched experts make {} / {}\n",
                    run.tokens, l.layer, l.counts.bytes_in, l.counts.madds, l.expected_bytes_in, l.expected_madds
                ));
            }
        }
    }
    s.push_str(&format!(
        "\nBest of {} timed runs per token count (per layer: lowest wall; floor: lowest), {}; \
         token ids random (seed {:#x}).\n",
        r.reps,
        if r.warmup {
            "after an untimed warm-up run with the same tokens (page faults excluded)"
        } else {
            "without warm-up (page faults included)"
        },
        r.seed
    ));
    s.push_str(&format!(
        "Time columns are per layer. thr-ms: thread CPU milliseconds summed over threads (dequant and\n\
         matmul interleave in the same tasks, so they have no separate wall time: after each run the\n\
         layer's weight reads are redone in those tasks, a timer on each half). other = CPU -\n\
         dequant - matmul (norms, RoPE, attention, routing, copies, scheduling). dq share =\n\
         dequant / CPU, the share of wall time spent dequantizing. floor: quant::dequantize_par\n\
         over the same slices + math::matmul of the f32 rows with the same tokens, wall time,\n\
         measured in this run. experts: touched / at most min(tokens * per-token, experts).\n\
         Memory: VmHWM counts mapped file pages once read; RssAnon (heap) and RssFile (mapped\n\
         files: the GGUF's quantized bytes read, clean page cache, plus the binary) sampled every\n\
         {:.0} ms; the model is reopened (fresh map) for each token count.\n",
        r.sample_ms
    ));
    s
}

fn opt_ms(v: Option<f64>) -> String {
    v.map(ms).unwrap_or_else(|| "-".into())
}

fn ratio(v: Option<f64>) -> String {
    fmt_opt(v, 2)
}

/// Renders a `bench run` report: the setting, a table per layer and token count (each side's
/// time, the floors and the ratios), the projection to the whole depth, memory, and what the
/// columns mean.
pub fn render_run(r: &run::Report) -> String {
    let mut s = String::new();
    let st = &r.settings;
    s.push_str(&format!(
        "model: {} ({}, {}); layers timed: {}..{} of {} ({} dense)\n",
        r.model,
        human_bytes(r.model_bytes),
        r.arch,
        r.layer_start,
        r.layer_end,
        r.n_layer,
        r.n_dense
    ));
    // The settings that differ from their defaults, as flags.
    let mut global = String::new();
    if st.candidate_ahead {
        global.push_str(" --candidate-ahead on");
    }
    if st.reference_reuse {
        global.push_str(" --reference-reuse on");
    }
    let mut own = st
        .dtype
        .as_ref()
        .map(|d| format!(" --dtype {d}"))
        .unwrap_or_default();
    if st.upload_from.as_deref() == Some("staged") {
        own.push_str(" --upload-from staged");
    }
    if st.register_pause_us > 0 {
        own.push_str(&format!(" --register-pause {}", st.register_pause_us));
    }
    s.push_str(&format!(
        "pipeline: glmdiff{global} run --against {} --mode {}{own}; candidate: {}\n",
        st.spec, st.mode, r.candidate
    ));
    if let Some(syn) = &r.synth {
        s.push_str(&format!(
            "{}: {} written in {:.1} s; temporary directory removed: {}\n",
            syn.description,
            human_bytes(syn.file_bytes),
            syn.write_s,
            if syn.removed { "yes" } else { "NO" }
        ));
    }
    if let Some(c) = &r.copies {
        s.push_str(&format!("copy floors on {}:", c.device));
        for f in &c.layers {
            s.push_str(&format!(
                " layer {} {} MiB pinned {:.1} GB/s, pageable {:.1} GB/s;",
                f.layer,
                mib(f.bytes),
                f.pinned_gbps,
                f.pageable_gbps
            ));
        }
        s.pop();
        s.push('\n');
    }
    s.push_str(&format!(
        "cpu: {}; {} threads; load average before {}, after {}\n\n",
        r.cpu, r.threads, r.load_before, r.load_after
    ));
    s.push_str(&run_layer_table(r));
    s.push_str("\n\n");
    s.push_str(&run_projection_table(r));
    s.push_str("\n\n");
    s.push_str(&run_memory_table(r));
    s.push('\n');
    for n in &r.notes {
        s.push_str(&format!("note: {n}\n"));
    }
    for run in r.runs.iter().filter(|run| run.differs) {
        s.push_str(&format!(
            "note: {} tokens: the comparison found a difference (glmdiff run with the same settings shows it)\n",
            run.tokens
        ));
    }
    s.push_str(&format!(
        "\nBest of {} timed passes per token count (per layer: lowest wall; floors: lowest of as many), {}; \
         token ids random (seed {:#x}).\n",
        r.reps,
        if r.warmup {
            "each token count after an untimed reference run of the same tokens (warm-up; its routing gives the floors' experts)"
        } else {
            "without warm-up"
        },
        r.seed
    ));
    s.push_str(
        "Times are per layer. wall: the pass over the layer (each step's two sides at the same time,\n\
         downloads, the comparison; layer 0 holds the embedding). reference, candidate (chain +\n\
         replay) and upload (the candidate's wait for its weights, part of candidate) as the driver\n\
         records them; cand beyond: the wall by which the candidate's side of each step ended after\n\
         the reference's, summed over the layer's steps. floor: the CPU reference's dequantize_par +\n\
         matmul of the layer's slices (touched experts) with the same tokens. copy: the layer's raw\n\
         GGUF bytes host-to-device from pinned and pageable memory.\n\
         Projection: the sum over kinds of layers at the depth x mean wall per layer (over a kind's\n\
         layers after its first when more are timed), that first counted once as itself (\"first +\n\
         n x mean\"): the run's first layer holds the embedding and the candidate's first uploads,\n\
         and the first MoE layer runs before any near-tie expert flip is followed; each side's the\n\
         same of its time; bound by: the side whose projected time is larger, and its ratio to the\n\
         other.\n\
         Memory: VmHWM (reset before each pass), RssAnon and RssFile sampled during the passes.\n",
    );
    s
}

fn run_layer_table(r: &run::Report) -> String {
    // Uploads only with a CUDA candidate (a CPU candidate has none), copies only when measured.
    let cuda = matches!(r.settings.candidate, run::CandidateKind::Cuda(_));
    let copies = r.copies.is_some();
    let mut cols = vec![
        ("tokens", 0),
        ("layer", 0),
        ("wall ms", 0),
        ("reference ms", 0),
        ("candidate ms", 0),
    ];
    if cuda {
        cols.extend([("upload ms", 2), ("upload MiB", 5)]);
    }
    cols.extend([("compare ms", 2), ("waited ms", 4)]);
    if cuda {
        cols.push(("cand beyond ms", 3));
    }
    cols.extend([("floor ms", 1), ("ref / floor", 0)]);
    if copies {
        cols.extend([
            ("copy pinned ms", 3),
            ("copy pageable ms", 4),
            ("upload / copy", 1),
        ]);
    }
    cols.extend([("cand / ref", 0), ("experts", 6)]);
    let mut t = Grid::new(&cols);
    for run in &r.runs {
        for l in &run.layers {
            let mut cells = vec![
                run.tokens.to_string(),
                format!("{} {}", l.layer, l.kind.label()),
                ms(l.wall_s),
                ms(l.reference_s),
                ms(l.candidate_s),
            ];
            if cuda {
                cells.extend([ms(l.upload_s), mib(l.upload_bytes)]);
            }
            cells.extend([ms(l.compare_s), ms(l.compare_wait_s)]);
            if cuda {
                cells.push(ms(l.candidate_beyond_s));
            }
            cells.extend([opt_ms(l.floor_s), ratio(l.ratios.reference_over_floor)]);
            if copies {
                cells.extend([
                    opt_ms(l.copy_pinned_s),
                    opt_ms(l.copy_pageable_s),
                    ratio(l.ratios.upload_over_copy),
                ]);
            }
            cells.extend([
                ratio(l.ratios.candidate_over_reference),
                match l.kind {
                    layer::LayerKind::Dense => "-".to_string(),
                    layer::LayerKind::Moe => l.experts.to_string(),
                },
            ]);
            t.add_row(cells);
        }
    }
    t.to_string()
}

/// Seconds with three significant digits below 100.
fn secs(x: f64) -> String {
    match x {
        x if x < 1.0 => format!("{x:.3}"),
        x if x < 10.0 => format!("{x:.2}"),
        x if x < 100.0 => format!("{x:.1}"),
        x => format!("{x:.0}"),
    }
}

fn run_projection_table(r: &run::Report) -> String {
    let d = &r.depth;
    let mut t = Grid::new(&[
        ("tokens", 0),
        ("dense layers x s", 2),
        ("MoE layers x s", 1),
        ("whole run s", 0),
        ("ref s", 0),
        ("cand s", 0),
        ("bound by", 0),
    ]);
    for run in &r.runs {
        let Some(p) = &run.projection else {
            t.add_row(vec![run.tokens.to_string(), "-".into(), "-".into()]);
            continue;
        };
        // A kind's first layer timed, counted once as itself, before the layers at the mean.
        let term = |k: layer::LayerKind| {
            p.terms
                .iter()
                .find(|t| t.kind == k)
                .map_or("-".to_string(), |t| match &t.first {
                    Some(f) if t.at_mean > 0 => {
                        format!("{} + {} x {}", secs(f.wall_s), t.at_mean, secs(t.wall_s))
                    }
                    Some(f) => secs(f.wall_s),
                    None => format!("{} x {}", t.count, secs(t.wall_s)),
                })
        };
        t.add_row(vec![
            run.tokens.to_string(),
            term(layer::LayerKind::Dense),
            term(layer::LayerKind::Moe),
            secs(p.total_s),
            secs(p.reference_s),
            secs(p.candidate_s),
            format!(
                "{} ({})",
                match p.bound {
                    run::Side::Reference => "reference",
                    run::Side::Candidate => "candidate",
                },
                p.bound_ratio
                    .map_or("the other side takes no time".to_string(), |x| format!(
                        "{x:.2}x"
                    ))
            ),
        ]);
    }
    format!(
        "projected to {} ({} dense + {} MoE layers):\n{t}",
        d.name, d.dense, d.moe
    )
}

fn run_memory_table(r: &run::Report) -> String {
    let mut m = Grid::new(&[
        ("tokens", 0),
        ("pipeline s", 0),
        ("VmHWM MiB", 0),
        ("peak RssAnon MiB", 0),
        ("peak RssFile MiB", 1),
        ("RssAnon before", 2),
    ]);
    for run in &r.runs {
        let mem = &run.memory;
        m.add_row(vec![
            run.tokens.to_string(),
            format!("{:.3}", run.pipeline_s),
            if mem.hwm_reset {
                mib(mem.vm_hwm)
            } else {
                format!("{} (not reset)", mib(mem.vm_hwm))
            },
            mib(mem.peak_anon),
            mib(mem.peak_file),
            mib(mem.rss_before.rss_anon),
        ]);
    }
    m.to_string()
}

/// Renders `bench dequant --device`.
#[cfg(feature = "cuda")]
pub fn render_gpu_dequant(r: &crate::bench::gpu_dequant::Report) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let _ = writeln!(s, "device: {}", r.device);
    let _ = writeln!(
        s,
        "device-to-device copy: {:.0} GB/s (read + write), the ceiling",
        r.copy_gbps
    );
    let mut t = table(&[
        "type",
        "ms (2^28 values)",
        "GB/s (read + write)",
        "of copy",
        "G values/s",
    ]);
    for row in &r.rows {
        t.add_row(vec![
            row.ty.clone(),
            format!("{:.3}", row.ms),
            format!("{:.0}", row.gbps),
            format!("{:.0}%", 100.0 * row.of_copy),
            format!("{:.1}", row.gelems),
        ]);
    }
    let _ = writeln!(s, "{t}");
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::GgmlType;

    #[test]
    fn dequant_table_shows_types_and_anchors() {
        let opts = dequant::BenchDequantOptions {
            elements: 4096,
            reps: 1,
            types: vec![GgmlType::Q4_K, GgmlType::Q8_0, GgmlType::Q8_1],
            with_python: false,
            ..Default::default()
        };
        let r = dequant::run(&opts).unwrap();
        let table = render_dequant(&r);
        assert!(table.contains("Q4_K") && table.contains("1720"));
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn gpu_table_fits_100_columns() {
        use crate::bench::gpu_dequant::{Report, Row};
        let r = Report {
            device: "cuda:0 NVIDIA H200 sm_90 (139.8 GiB, 132 SMs) | NVRTC 13.0 (arch sm_90 \
                     fmad=false ftz=false prec-div=true prec-sqrt=true) | driver CUDA 13.0"
                .into(),
            copy_gbps: 4225.0,
            rows: ["Q4_K", "IQ2_XXS", "MXFP4"]
                .iter()
                .map(|t| Row {
                    ty: t.to_string(),
                    ms: 0.512,
                    gbps: 3650.0,
                    of_copy: 0.86,
                    gelems: 524.3,
                })
                .collect(),
        };
        let text = crate::report::layout::fit_text(&render_gpu_dequant(&r), Some(100));
        for l in text.lines() {
            assert!(l.chars().count() <= 100, "{l}\n{text}");
        }
        assert!(text.contains("| IQ2_XXS") && text.contains("86%"), "{text}");
    }

    /// A `bench run` report with a CUDA candidate (copy columns, uploads) at 100 columns: every
    /// line fits, the copy floors, the projection and the bound are there.
    #[test]
    fn run_report_with_copies_fits_100_columns() {
        use crate::bench::run::*;
        let row = |layer: usize, kind: layer::LayerKind| {
            let mut r = LayerRow {
                layer,
                kind,
                wall_s: 0.512,
                reference_s: 0.361,
                chained_s: 0.05,
                replay_s: 0.012,
                candidate_s: 0.062,
                upload_s: 0.004,
                upload_bytes: 5_500_000_000,
                compare_s: 0.031,
                compare_wait_s: 0.0,
                candidate_beyond_s: 0.0,
                experts: 112,
                floor: Some(layer::Floor {
                    dequant_s: 0.1,
                    matmul_s: 0.15,
                }),
                floor_s: Some(0.25),
                copy_pinned_s: Some(0.11),
                copy_pageable_s: Some(0.45),
                ratios: Ratios::default(),
            };
            r.ratios = ratios(&r);
            r
        };
        let layers = vec![
            row(0, layer::LayerKind::Dense),
            row(1, layer::LayerKind::Moe),
        ];
        let kinds = by_kind(&layers);
        let depth = Depth::named("glm5").unwrap();
        let run = TokenRun {
            tokens: 4096,
            pipeline_s: 3.2,
            projection: project(&depth, &kinds),
            layers,
            kinds,
            memory: Memory::default(),
            differs: false,
        };
        let mut r = Report {
            cpu: "AMD EPYC 9654 96-Core Processor".into(),
            threads: 16,
            load_before: "0.10 0.20 0.30".into(),
            load_after: "1.10 1.20 1.30".into(),
            model: "/tmp/glmdiff-bench-run-1234-000000001/bench-run.gguf".into(),
            model_bytes: 8_034_558_848,
            arch: "glm-dsa".into(),
            synth: None,
            layer_start: 0,
            layer_end: 2,
            n_layer: 2,
            n_dense: 1,
            settings: Settings {
                candidate: CandidateKind::Cuda(0),
                spec: "cuda:0".into(),
                mode: "both".into(),
                dtype: Some("bf16".into()),
                choice: None,
                candidate_ahead: false,
                reference_reuse: false,
                upload_from: Some("mapped".into()),
                register_pause_us: 0,
            },
            candidate: "cuda:0 NVIDIA H200 sm_90 (139.8 GiB, 132 SMs), bf16 weights".into(),
            seed: 1,
            warmup: true,
            reps: 3,
            sample_ms: 5.0,
            copies: Some(Copies {
                device: "cuda:0 NVIDIA H200 sm_90 (139.8 GiB, 132 SMs)".into(),
                chunk_bytes: 256 << 20,
                layers: vec![CopyFloor {
                    layer: 0,
                    bytes: 600_000_000,
                    pinned_s: 0.011,
                    pageable_s: 0.045,
                    pinned_gbps: 54.5,
                    pageable_gbps: 13.3,
                }],
            }),
            depth,
            runs: vec![run],
            notes: vec!["a note".into()],
        };
        let text = crate::report::layout::fit_text(&render_run(&r), Some(100));
        for l in text.lines() {
            assert!(l.chars().count() <= 100, "{l}\n{text}");
        }
        for want in [
            "copy floors on cuda:0",
            "projected to glm5 (3 dense + 75 MoE layers)",
            "reference (",
            "note: a note",
        ] {
            assert!(text.contains(want), "{want}: {text}");
        }
        assert!(
            text.contains("pipeline: glmdiff run --against cuda:0 --mode both --dtype bf16;"),
            "{text}"
        );
        // The settings that differ from their defaults, as their flags.
        r.settings.candidate_ahead = true;
        r.settings.reference_reuse = true;
        r.settings.upload_from = Some("staged".into());
        r.settings.register_pause_us = 50;
        let text = render_run(&r);
        let want = "pipeline: glmdiff --candidate-ahead on --reference-reuse on run --against cuda:0 --mode both --dtype bf16 --upload-from staged --register-pause 50;";
        assert!(text.contains(want), "{text}");
    }
}
