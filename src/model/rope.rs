//! RoPE frequencies, the cos/sin scale ("attention factor") and the attention softmax scale,
//! derived from [`HParams`]. These are definitions shared by every engine (each engine applies
//! them its own way); nothing here touches activations.
//!
//! Plain RoPE: `inv_freq[i] = base^(-2i/d)`. DeepSeek YaRN follows transformers
//! `modeling_rope_utils.py` (`_compute_yarn_parameters`) and DeepSeek's reference
//! (`deepseek-ai/DeepSeek-V3`, `inference/model.py`, `precompute_freqs_cis`):
//! ```text
//! low/high  = floor/ceil( d * ln(orig_ctx / (beta * 2 pi)) / (2 ln base) ),  clamped to [0, d-1]
//! ramp[i]   = clamp((i - low) / (high - low), 0, 1)          i in 0..d/2
//! inv_freq  = inv_extra * (1 - ramp) + (inv_extra / factor) * ramp
//! ```
//! Scales (transformers `deepseek_v3/modeling_deepseek_v3.py` `yarn_apply_mscale`, llama.cpp
//! `src/models/deepseek2.cpp` `kq_scale`):
//! `softmax scale = mscale^2 / sqrt(qk_nope + qk_rope)`, `mscale = 0.1 * mscale_all_dim * ln(factor) + 1`
//! when `mscale_all_dim` is known (GGUF `yarn_log_multiplier / 0.1`), else `1 / sqrt(qk_nope + qk_rope)`.
//! cos/sin are multiplied by transformers' `attention_factor`: the file's
//! `rope.scaling.yarn_attn_factor` (or the generic `rope.scaling.attn_factor`) when present; else `get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)`, which is 1
//! because the GGUF does not carry `mscale` and DeepSeek's checkpoints set `mscale == mscale_all_dim`
//! (V3: 1/1, V2-Lite: 0.707/0.707; llama.cpp `llama-context.cpp` assumes the same); without
//! `mscale_all_dim` it is `0.1 ln(factor) + 1`.

use std::f64::consts::PI;

use super::hparams::{HParams, RopeParams, Yarn};

/// Added to `high` when `low == high` (transformers `linear_ramp_factor`, "prevent singularity").
const RAMP_SINGULARITY_EPS: f64 = 0.001;

/// YaRN magnitude correction `0.1 * m * ln(scale) + 1` (1 for `scale <= 1`), transformers
/// `get_mscale` / DeepSeek `yarn_get_mscale`.
pub fn yarn_get_mscale(scale: f64, m: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * m * scale.ln() + 1.0
    }
}

/// Dimension (of `dim`) at which a frequency makes `num_rotations` turns over `orig_ctx` positions.
fn correction_dim(num_rotations: f64, dim: f64, base: f64, orig_ctx: f64) -> f64 {
    dim * (orig_ctx / (num_rotations * 2.0 * PI)).ln() / (2.0 * base.ln())
}

/// Inverse frequencies, one per rotated pair: `[dim / 2]`.
pub fn inv_freq(rope: &RopeParams) -> Vec<f64> {
    let d = rope.dim as f64;
    let extra: Vec<f64> = (0..rope.dim / 2)
        .map(|i| 1.0 / rope.base.powf((2 * i) as f64 / d))
        .collect();
    let Some(y) = &rope.yarn else {
        return extra;
    };
    let low = correction_dim(y.beta_fast, d, rope.base, y.original_context)
        .floor()
        .max(0.0);
    let mut high = correction_dim(y.beta_slow, d, rope.base, y.original_context)
        .ceil()
        .min(d - 1.0);
    if low == high {
        high += RAMP_SINGULARITY_EPS;
    }
    extra
        .iter()
        .enumerate()
        .map(|(i, &e)| {
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            // transformers: inv_inter * (1 - extrapolation_factor) + inv_extra * extrapolation_factor,
            // with extrapolation_factor = 1 - ramp.
            let extrapolation = 1.0 - ramp;
            (e / y.factor) * (1.0 - extrapolation) + e * extrapolation
        })
        .collect()
}

/// The factor applied to cos and sin (transformers `attention_scaling`).
pub fn attention_factor(rope: &RopeParams) -> f64 {
    match &rope.yarn {
        None => 1.0,
        Some(Yarn {
            attn_factor: Some(a),
            ..
        }) => *a,
        Some(Yarn {
            mscale_all_dim: Some(_),
            ..
        }) => 1.0,
        Some(y) => yarn_get_mscale(y.factor, 1.0),
    }
}

/// Softmax scale of MLA attention: `mscale^2 / sqrt(qk_nope + qk_rope)`.
pub fn softmax_scale(hp: &HParams) -> f64 {
    let base = 1.0 / (hp.qk_head() as f64).sqrt();
    match &hp.rope.yarn {
        Some(Yarn {
            factor,
            mscale_all_dim: Some(m),
            ..
        }) => {
            let ms = yarn_get_mscale(*factor, *m);
            base * ms * ms
        }
        _ => base,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deepseek_v3_rope() -> RopeParams {
        RopeParams {
            dim: 64,
            base: 10000.0,
            yarn: Some(Yarn {
                factor: 40.0,
                original_context: 4096.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
                mscale_all_dim: Some(1.0),
                attn_factor: None,
            }),
        }
    }

    /// Expected values from numpy in float64, written out independently of this code:
    /// `low, high = floor(10.472), ceil(22.513) = 10, 23`; `pos = 1e4**(arange(0,64,2)/64)`;
    /// `ramp = clip((arange(32)-10)/13, 0, 1)`; `inv = (1/(40*pos))*ramp + (1/pos)*(1-ramp)`.
    #[test]
    fn yarn_inv_freq_matches_numpy() {
        let f = inv_freq(&deepseek_v3_rope());
        let expected = [
            (0, 1.0),
            (1, 0.749_894_209_332_455_9),
            (10, 0.056_234_132_519_034_905),
            (11, 0.039_006_926_567_143_86),
            (12, 0.026_879_360_111_431_223),
            (15, 0.008_334_508_951_020_777),
            (20, 0.000_790_569_415_042_094_7),
            (24, 2.5e-05),
            (25, 1.874_735_523_331_139_6e-05),
            (31, 3.333_803_580_408_31e-06),
        ];
        assert_eq!(f.len(), 32);
        for (i, want) in expected {
            let rel = (f[i] - want).abs() / want;
            assert!(rel < 1e-14, "inv_freq[{i}] = {} want {want}", f[i]);
        }
    }

    #[test]
    fn yarn_scales_match_deepseek_v3() {
        let rope = deepseek_v3_rope();
        assert_eq!(attention_factor(&rope), 1.0);
        // mscale = 0.1*ln(40)+1; scale = mscale^2/sqrt(192) = 0.1352337788608801 (numpy).
        let hp_scale = {
            let ms = yarn_get_mscale(40.0, 1.0);
            ms * ms / 192f64.sqrt()
        };
        assert!((hp_scale - 0.135_233_778_860_880_1).abs() < 1e-15);
        // Without mscale_all_dim the magnitude moves to cos/sin (transformers get_mscale(factor)).
        let mut r = rope.clone();
        if let Some(y) = &mut r.yarn {
            y.mscale_all_dim = None;
        }
        assert!((attention_factor(&r) - (0.1 * 40f64.ln() + 1.0)).abs() < 1e-15);
    }

    #[test]
    fn plain_rope_inv_freq_by_hand() {
        let r = RopeParams {
            dim: 4,
            base: 100.0,
            yarn: None,
        };
        // base^(-0/4) = 1, base^(-2/4) = 1/10.
        let f = inv_freq(&r);
        assert_eq!(f.len(), 2);
        assert_eq!(f[0], 1.0);
        assert!((f[1] - 0.1).abs() < 1e-16);
        assert_eq!(attention_factor(&r), 1.0);
    }
}
