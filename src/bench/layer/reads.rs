//! The weight slices a step or a layer reads and their dequantize-then-matmul floor.

use std::collections::BTreeMap;
use std::ops::Range;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::{Floor, FLOOR_ACTIVATION, FLOOR_CHUNK_ELEMS, FLOOR_SAMPLE_MADDS};
use crate::engine::cpu::math;
use crate::engine::cpu::Matrix;
use crate::gguf::{Model, TensorRef};
use crate::model::names::{self, blk};
use crate::model::{steps, Weights};
use crate::quant;

/// One slice of weights a step reads: rows of a tensor and how many tokens multiply them
/// (0 for vectors: norms and biases).
#[derive(Clone)]
pub(super) struct Read<'m> {
    pub(super) t: TensorRef<'m>,
    pub(super) rows: Range<u64>,
    pub(super) tokens: usize,
}

impl Read<'_> {
    pub(super) fn bytes(&self) -> u64 {
        (self.rows.end - self.rows.start) * self.t.info.row_bytes()
    }

    pub(super) fn values(&self) -> u64 {
        (self.rows.end - self.rows.start) * self.t.info.row_len()
    }

    pub(super) fn madds(&self) -> u64 {
        self.tokens as u64 * self.values()
    }

    /// Rows per task of the CPU reference with this read's tokens
    /// ([`math::rows_per_task`]).
    pub(super) fn rows_per_task(&self) -> u64 {
        math::rows_per_task(self.tokens, self.t.info.row_len() as usize) as u64
    }

    /// Dequantization tasks for these rows: tasks of [`Read::rows_per_task`] whole rows, one per
    /// embedding row. Not observable from outside the engine, so computed from the shape: it is
    /// how the CPU reference splits a matrix (`math::matmul_rows`); the vectors and kv_b it
    /// dequantizes whole go through `quant::dequantize_par`, whose chunks are as large but cut
    /// by blocks, not rows.
    pub(super) fn tasks(&self) -> u64 {
        (self.rows.end - self.rows.start).div_ceil(self.rows_per_task())
    }
}

/// The slices layer `layer` reads with `t` tokens: every tensor its steps read
/// ([`Step::weights`](crate::model::Step::weights)), as [`reads_of`] reads them.
pub(super) fn layer_reads<'m>(
    weights: &Weights<'m>,
    layer: usize,
    t: usize,
    routed: &BTreeMap<usize, usize>,
) -> Result<Vec<Read<'m>>> {
    let steps = steps::layer_steps(weights.hparams(), layer);
    reads_of(weights, &steps::weights_of(&steps, weights), t, routed)
}

/// The slices a step reading the tensors `names` on `t` tokens reads: each tensor whole (matrices
/// multiplied with the `t` tokens, vectors with none), except the stacked expert tensors, of
/// which only the rows of the experts in `routed` (expert -> tokens routed to it), multiplied
/// with the tokens routed to each.
pub(super) fn reads_of<'m>(
    weights: &Weights<'m>,
    names: &[String],
    t: usize,
    routed: &BTreeMap<usize, usize>,
) -> Result<Vec<Read<'m>>> {
    let mut out = Vec::new();
    for name in names {
        let tr = weights.tensor(name)?;
        let suffix = names::split_blk(name).map_or("", |(_, s)| s);
        let stacked = matches!(
            suffix,
            blk::FFN_GATE_EXPS | blk::FFN_UP_EXPS | blk::FFN_GATE_UP_EXPS | blk::FFN_DOWN_EXPS
        );
        let tokens = if tr.info.ne.len() == 1 { 0 } else { t };
        if !stacked {
            out.push(Read {
                t: tr,
                rows: 0..tr.info.n_rows(),
                tokens,
            });
            continue;
        }
        let ne = &tr.info.ne;
        if ne.len() != 3 {
            bail!(
                "bench: layer: tensor {} has ne={ne:?}, expected [cols, rows, n_expert]",
                tr.info.name
            );
        }
        for (&e, &n) in routed {
            let e = e as u64;
            out.push(Read {
                t: tr,
                rows: e * ne[1]..(e + 1) * ne[1],
                tokens: n,
            });
        }
    }
    Ok(out)
}

/// The floor of `reads` (see the module documentation).
pub(super) fn floor(model: &Model, reads: &[Read<'_>]) -> Result<Floor> {
    let (mut dq, mut mm) = (Duration::ZERO, Duration::ZERO);
    // Seconds the sampled slices' untimed rows would have taken at their timed rows' rate.
    let mut mm_scaled = 0.0;
    let mut buf: Vec<f32> = Vec::new();
    for r in reads {
        let cols = r.t.info.row_len() as usize;
        // This slice's product time and the rows it covers.
        let (mut mm_read, mut timed) = (Duration::ZERO, 0u64);
        let rows_per_call = (FLOOR_CHUNK_ELEMS / cols.max(1)).max(1) as u64;
        let x = vec![FLOOR_ACTIVATION; r.tokens * cols]; // [tokens, cols]
        let mut row = r.rows.start;
        while row < r.rows.end {
            let end = (row + rows_per_call).min(r.rows.end);
            let bytes = model.row_data(r.t, row..end)?;
            let n = (end - row) as usize;
            buf.resize(n * cols, 0.0);
            let t0 = Instant::now();
            quant::dequantize_par(r.t.info.ty, bytes, &mut buf)
                .with_context(|| format!("bench: layer: floor of {}", r.t.info.name))?;
            dq += t0.elapsed();
            // Past FLOOR_SAMPLE_MADDS a slice's products are timed on its first rows and
            // scaled to all of them: every row costs the same (the same tokens and columns).
            if r.tokens > 0 && timed * (r.tokens * cols) as u64 >= FLOOR_SAMPLE_MADDS {
                row = end;
                continue;
            }
            if r.tokens > 0 {
                timed += n as u64;
                let w = Matrix {
                    rows: n,
                    cols,
                    data: std::mem::take(&mut buf),
                };
                let t0 = Instant::now();
                let y = math::matmul(&x, r.tokens, &w);
                let took = t0.elapsed();
                mm += took;
                mm_read += took;
                std::hint::black_box(&y);
                buf = w.data;
            }
            row = end;
        }
        if timed > 0 {
            let all = r.rows.end - r.rows.start;
            mm_scaled += mm_read.as_secs_f64() * (all as f64 / timed as f64 - 1.0);
        }
    }
    Ok(Floor {
        dequant_s: dq.as_secs_f64(),
        matmul_s: mm.as_secs_f64() + mm_scaled,
    })
}
