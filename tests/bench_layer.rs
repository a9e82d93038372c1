//! `bench layer` on a tiny synthetic model: the report's structure and byte accounting, not its
//! timings. Expected bytes are computed by hand from each tensor's dimensions and the GGML block
//! table (`n_elements / block_size * type_size`), independently of the counters under test.

use std::path::Path;
use std::time::Duration;

use glmdiff::bench::layer::{self, BenchLayerOptions, LayerKind, LayerRow, Report};
use glmdiff::gguf::Model;
use glmdiff::synth::{self, SynthOptions};

fn tiny() -> SynthOptions {
    SynthOptions::parse("glm-dsa", "tiny", None, "ud-q4_k_xl", 7).unwrap()
}

fn options(model: Option<&Path>, temp_parent: &Path, tokens: Vec<usize>) -> BenchLayerOptions {
    BenchLayerOptions {
        model: model.map(Path::to_path_buf),
        synth: tiny(),
        temp_parent: temp_parent.to_path_buf(),
        tokens,
        seed: 1,
        warmup: false,
        reps: 2,
        baseline: true,
        sample_interval: Duration::from_millis(1),
    }
}

/// Per tensor of layer `l`: (name suffix, ne, bytes of the whole tensor, bytes of one expert).
fn layer_tensors(model: &Model, l: usize) -> Vec<(String, Vec<u64>, u64, u64)> {
    let prefix = format!("blk.{l}.");
    model
        .tensors()
        .filter(|t| t.info.name.starts_with(&prefix))
        .map(|t| {
            let ty = t.info.ty;
            let (bs, ts) = (ty.block_size() as u64, ty.type_size() as u64);
            let n: u64 = t.info.ne.iter().product();
            let per_expert = if t.info.ne.len() == 3 {
                t.info.ne[0] * t.info.ne[1] / bs * ts
            } else {
                0
            };
            (
                t.info.name[prefix.len()..].to_string(),
                t.info.ne.clone(),
                n / bs * ts,
                per_expert,
            )
        })
        .collect()
}

fn is_stacked_expert(suffix: &str) -> bool {
    suffix.starts_with("ffn_") && suffix.ends_with("_exps.weight")
}

/// Checks one layer's bytes, values and multiply-adds against the hand computation.
fn check_layer(model: &Model, row: &LayerRow, tokens: usize, k: usize, n_expert: usize) {
    let (mut bytes, mut values, mut madds) = (0u64, 0u64, 0u64);
    let t = tokens as u64;
    for (suffix, ne, whole, per_expert) in layer_tensors(model, row.layer) {
        if is_stacked_expert(&suffix) {
            assert_eq!(row.kind, LayerKind::Moe, "{suffix} in a dense layer");
            let per_values = ne[0] * ne[1];
            for (&_e, &n) in &row.experts {
                bytes += per_expert;
                values += per_values;
                madds += n as u64 * per_values;
            }
        } else {
            let n: u64 = ne.iter().product();
            bytes += whole;
            values += n;
            if ne.len() > 1 {
                madds += t * n;
            }
        }
    }
    let c = &row.counts;
    assert!(c.bytes_in > 0 && c.values_out > 0 && c.dequant_calls > 0 && c.madds > 0);
    assert_eq!(c.bytes_in, bytes, "layer {} bytes", row.layer);
    assert_eq!(c.values_out, values, "layer {} values", row.layer);
    assert_eq!(c.madds, madds, "layer {} multiply-adds", row.layer);
    assert_eq!(row.expected_bytes_in, bytes);
    match row.kind {
        LayerKind::Dense => assert!(row.experts.is_empty()),
        LayerKind::Moe => {
            let touched = row.experts.len();
            assert!(touched >= 1 && touched <= (tokens * k).min(n_expert));
            assert_eq!(row.experts.values().sum::<usize>(), tokens * k);
            assert!(row.experts.keys().all(|&e| e < n_expert));
        }
    }
    let f = row.floor.expect("baseline asked");
    assert!(f.dequant_s > 0.0 && f.matmul_s > 0.0);
}

fn check_report(model: &Model, r: &Report, tokens: &[usize]) {
    // tiny glm-dsa: layer 0 dense, layer 1 MoE (8 experts, 2 per token).
    assert_eq!((r.layers_run, r.n_expert, r.n_expert_used), (2, 8, 2));
    assert_eq!(r.runs.len(), tokens.len());
    let emb = model.tensor("token_embd.weight").unwrap().info;
    let emb_row = emb.ne[0] / emb.ty.block_size() as u64 * emb.ty.type_size() as u64;
    for (run, &t) in r.runs.iter().zip(tokens) {
        assert_eq!(run.tokens, t);
        assert_eq!(run.embed.bytes_in, t as u64 * emb_row);
        let kinds: Vec<LayerKind> = run.layers.iter().map(|l| l.kind).collect();
        assert_eq!(kinds, [LayerKind::Dense, LayerKind::Moe]);
        assert_eq!(run.kinds.len(), 2);
        for row in &run.layers {
            check_layer(model, row, t, r.n_expert_used, r.n_expert);
            assert!(row.wall_s >= 0.0 && row.dequant_s > 0.0);
        }
        assert!(run.rss_after.vm_rss > 0 && run.peak_anon > 0);
    }
    // One token touches 2 of 8 experts: the MoE layer reads a quarter of the expert bytes.
    let moe = &r.runs[0].layers[1];
    let all_experts: u64 = layer_tensors(model, 1)
        .iter()
        .filter(|(s, ..)| is_stacked_expert(s))
        .map(|(_, _, whole, _)| whole)
        .sum();
    let other: u64 = layer_tensors(model, 1)
        .iter()
        .filter(|(s, ..)| !is_stacked_expert(s))
        .map(|(_, _, whole, _)| whole)
        .sum();
    assert_eq!(moe.counts.bytes_in, other + all_experts * 2 / 8);
}

#[test]
fn tiny_model_report_structure_and_byte_accounting() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    synth::write(&tiny(), &path).unwrap();
    let tokens = vec![1, 4];
    let r = layer::run(&options(Some(&path), dir.path(), tokens.clone())).unwrap();
    let model = Model::open(&path).unwrap();
    check_report(&model, &r, &tokens);
    assert!(r.synth.is_none());
    let table = glmdiff::report::bench::render_layer(&r);
    assert!(table.contains("dense") && table.contains("MoE") && table.contains("wall/floor"));
    assert!(!table.contains("note:"), "{table}");
    let json = serde_json::to_value(&r).unwrap();
    assert_eq!(json["runs"][1]["layers"][1]["kind"], "moe");
}

#[test]
fn synthetic_model_is_written_to_a_temporary_directory_and_removed() {
    let parent = tempfile::tempdir().unwrap();
    let mut opts = options(None, parent.path(), vec![3]);
    opts.warmup = true;
    opts.reps = 1;
    opts.baseline = false;
    let r = layer::run(&opts).unwrap();
    let s = r.synth.as_ref().unwrap();
    assert!(s.removed && s.file_bytes == r.model_bytes && s.file_bytes > 0);
    assert_eq!(std::fs::read_dir(parent.path()).unwrap().count(), 0);
    assert!(r.runs[0].layers.iter().all(|l| l.floor.is_none()));
    assert!(layer::run(&options(None, parent.path(), vec![])).is_err());
}

#[test]
fn counting_weights_give_bit_identical_hooks() {
    use glmdiff::bench::layer::Counted;
    use glmdiff::driver::{self, Plan};
    use glmdiff::engine::cpu::CpuEngine;
    use glmdiff::engine::Engine;
    use glmdiff::model::Weights;
    use glmdiff::trace::{HookFilter, TraceSink};

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    synth::write(&tiny(), &path).unwrap();
    let model = Model::open(&path).unwrap();
    let w = Weights::new(&model).unwrap();
    fn trace<E: Engine>(
        engine: &E,
        w: &Weights<'_>,
    ) -> std::collections::BTreeMap<String, glmdiff::engine::HostTensor> {
        let mut sink = TraceSink::new(HookFilter::default());
        let plan = Plan::full(w).unwrap();
        driver::run(engine, w, &[5, 9, 2, 7], &plan, &mut sink).unwrap();
        sink.into_tensors()
    }
    let plain = trace(&CpuEngine::new(&w), &w);
    let engine = Counted::new(CpuEngine::new(&w), &w);
    let counted = trace(&engine, &w);
    assert!(plain.contains_key("logits") && plain.contains_key("blk.1.moe_routed"));
    assert_eq!(plain, counted);
    let c = engine.counts();
    assert!(c.bytes_in > 0 && c.madds > 0 && c.dequant_calls > 0 && c.values_out > 0);
}

/// Dequantization tasks are counted as the CPU reference splits its work: whole rows, as many
/// as fit in 65536 values with fewer than 64 tokens (all reads here), but 16 to 64 rows a task
/// and a multiple of 4, per tensor or per touched expert, and one per embedding row. Computed
/// here by hand from each tensor's dimensions.
#[test]
fn dequant_calls_are_tasks_of_whole_rows() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    synth::write(&tiny(), &path).unwrap();
    let mut opts = options(Some(&path), dir.path(), vec![3]);
    opts.reps = 1;
    opts.baseline = false;
    let r = layer::run(&opts).unwrap();
    let model = Model::open(&path).unwrap();
    let tasks = |rows: u64, cols: u64| rows.div_ceil((65536 / cols).clamp(16, 64) / 4 * 4);
    let run = &r.runs[0];
    assert_eq!(run.embed.dequant_calls, 3);
    for row in &run.layers {
        let mut want = 0;
        for (suffix, ne, _, _) in layer_tensors(&model, row.layer) {
            let rows: u64 = ne[1..].iter().product();
            if is_stacked_expert(&suffix) {
                want += row.experts.len() as u64 * tasks(ne[1], ne[0]);
            } else {
                want += tasks(rows, ne[0]);
            }
        }
        assert_eq!(row.counts.dequant_calls, want, "layer {}", row.layer);
    }
}
