//! Text rendering of a [`Report`].

use super::{LayerKind, Report};
use crate::report::{human_bytes, table};

const MIB: f64 = (1u64 << 20) as f64;

fn mib(b: u64) -> String {
    format!("{:.1}", b as f64 / MIB)
}

fn ms(s: f64) -> String {
    format!("{:.1}", s * 1e3)
}

/// Renders the report: a table per layer kind and token count, a memory table per token count,
/// then the run's settings and what the columns mean.
pub fn render_table(r: &Report) -> String {
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

    let mut t = table(&[
        "tokens",
        "layer",
        "wall ms",
        "CPU ms",
        "dequant thr-ms",
        "matmul thr-ms",
        "other thr-ms",
        "dq share",
        "quant MiB read",
        "f32 MiB out",
        "experts",
        "floor ms",
        "wall/floor",
        "peak anon MiB",
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
                LayerKind::Dense => "-".to_string(),
                LayerKind::Moe => format!(
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

    let mut m = table(&[
        "tokens",
        "run s",
        "VmHWM MiB",
        "peak RssAnon MiB",
        "peak RssFile MiB",
        "RssAnon before",
        "RssFile before",
        "quant MiB read",
        "model MiB",
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
         matmul interleave in the same tasks, so they have no separate wall time). other = CPU -\n\
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
