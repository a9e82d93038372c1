//! Structural searches of `--explain`: hypotheses with too many variants to list, found by
//! matching the candidate's output piece by piece.
//!
//! - [`expert_map`]: which expert's weights each routed expert slot was computed with. Every
//!   expert's own output on every token is computed once; the weighted sum under a mapping is
//!   then cheap, and the mapping is searched (every transposition first, then one slot at a time
//!   until nothing improves).
//! - [`head_map`]: which reference head each of the candidate's head blocks holds (nearest block
//!   per slot), for outputs with a head axis (`q_b`, `q_pe_rope`, `attn_heads`).

use anyhow::{bail, Result};

use super::residual;
use crate::engine::cpu::CpuEngine;
use crate::engine::HostTensor;

/// Experts whose outputs the search computes when the model has at most this many; beyond it
/// only the experts the step routes to (a mapping onto an expert no token uses is then not
/// found).
pub const ALL_EXPERTS_UP_TO: usize = 64;

/// An expert mapping: `(slot, from)` pairs, slot `slot` computed with expert `from`'s weights.
pub type ExpertMap = Vec<(usize, usize)>;

/// The residual and output of a full mapping (`map[e]` for every expert slot).
type Eval<'a> = dyn Fn(&[usize]) -> Result<(f64, HostTensor)> + 'a;

/// Passes of the local search.
const PASSES: usize = 8;

/// Largest `T * K^2 * experts^2 * hidden` for which the decoupled start is computed (about a
/// second of work).
const DECOUPLED_BUDGET: usize = 1 << 31;

/// The routed-experts output when slot `e` is computed with expert `map[e]`'s weights:
/// `sum_k w_k * Y[map[id_k]]`, accumulated in f64 in ascending slot order, as the reference
/// accumulates (so the identity map gives the reference's values bit for bit).
fn mixed(
    y: &[Option<Vec<f32>>],
    map: &[usize],
    ids: &[i32],
    w: &[f32],
    t: usize,
    k: usize,
    hidden: usize,
) -> Vec<f32> {
    let mut acc = vec![0f64; t * hidden];
    for (e, &from) in map.iter().enumerate() {
        let Some(ye) = y.get(from).and_then(Option::as_ref) else {
            continue;
        };
        for tok in 0..t {
            for j in 0..k {
                if ids[tok * k + j] != e as i32 {
                    continue;
                }
                let wt = f64::from(w[tok * k + j]);
                for (a, &v) in acc[tok * hidden..(tok + 1) * hidden]
                    .iter_mut()
                    .zip(&ye[tok * hidden..(tok + 1) * hidden])
                {
                    *a += wt * f64::from(v);
                }
            }
        }
    }
    acc.iter().map(|&v| v as f32).collect()
}

/// The expert mapping that best reproduces `cand` (`moe_routed`, `[T, hidden]`) from the step's
/// inputs `x` (`[T, hidden]`), `ids`, `w` (`[T, K]`) in layer `layer`: `(slot, from)` pairs
/// (slot `e` computed with expert `from`'s weights, `e != from`) and the output they give;
/// `None` when the identity is best.
pub fn expert_map(
    cpu: &CpuEngine<'_>,
    layer: usize,
    x: &HostTensor,
    ids: &HostTensor,
    w: &HostTensor,
    cand: &HostTensor,
) -> Result<Option<(ExpertMap, HostTensor)>> {
    let hp = cpu.weights().hparams();
    let (t, hidden) = x.dims2("moe input")?;
    let (ti, k) = ids.dims2("moe_topk_ids")?;
    if ti != t || w.shape != ids.shape || cand.shape != x.shape {
        bail!(
            "explain: expert search: input {:?}, ids {:?}, weights {:?}, output {:?} disagree",
            x.shape,
            ids.shape,
            w.shape,
            cand.shape
        );
    }
    let (xv, idv, wv) = (x.as_f32("x")?, ids.as_i32("ids")?, w.as_f32("w")?);
    let mut routed: Vec<usize> = idv
        .iter()
        .filter(|&&e| e >= 0 && (e as usize) < hp.n_expert)
        .map(|&e| e as usize)
        .collect();
    routed.sort_unstable();
    routed.dedup();
    let pool: Vec<usize> = if hp.n_expert <= ALL_EXPERTS_UP_TO {
        (0..hp.n_expert).collect()
    } else {
        routed.clone()
    };
    // Y[f]: expert f's output on every token, [T, hidden].
    let mut y: Vec<Option<Vec<f32>>> = vec![None; hp.n_expert];
    for &f in &pool {
        let rows = cpu.expert_rows(layer, f)?;
        y[f] = Some(cpu.expert_output(&rows, xv, t)?);
    }
    let eval = |map: &[usize]| -> Result<(f64, HostTensor)> {
        let out = HostTensor::f32(vec![t, hidden], mixed(&y, map, idv, wv, t, k, hidden))?;
        Ok((residual(cand, &out), out))
    };
    let identity: Vec<usize> = (0..hp.n_expert).collect();
    let (mut best_r, _) = eval(&identity)?;
    // Starts: the identity, the best transposition of a routed expert with any expert, and
    // each slot's best expert with the token's other slots explained as well as they can be.
    let mut best = identity.clone();
    let mut starts = vec![identity.clone()];
    let mut best_swap = (best_r, identity.clone());
    for &a in &routed {
        for &b in &pool {
            if b == a {
                continue;
            }
            let mut m = identity.clone();
            m.swap(a, b);
            let (r, _) = eval(&m)?;
            if r < best_swap.0 {
                best_swap = (r, m);
            }
        }
    }
    starts.push(best_swap.1);
    let work = t * k * k * pool.len() * pool.len() * hidden;
    if work <= DECOUPLED_BUDGET {
        starts.push(decoupled(
            &y,
            &routed,
            &pool,
            idv,
            wv,
            cand.as_f32("candidate")?,
            t,
            k,
            hidden,
        ));
    }
    for start in starts {
        let (mut r0, _) = eval(&start)?;
        let mut m0 = start;
        descend(&eval, &routed, &pool, &mut m0, &mut r0)?;
        if r0 < best_r {
            (best_r, best) = (r0, m0);
        }
    }
    // Only the slots a token uses matter.
    let map: Vec<(usize, usize)> = routed
        .iter()
        .filter(|&&e| best[e] != e)
        .map(|&e| (e, best[e]))
        .collect();
    if map.is_empty() {
        return Ok(None);
    }
    let mut m = identity;
    for &(e, f) in &map {
        m[e] = f;
    }
    let (_, out) = eval(&m)?;
    Ok(Some((map, out)))
}

/// The head block of `reference` each head slot of `cand` is closest to (`heads` blocks per
/// row), and `reference` with its blocks so arranged; `None` when every slot is its own head.
pub fn head_map(
    reference: &HostTensor,
    cand: &HostTensor,
    heads: usize,
) -> Option<(Vec<usize>, HostTensor)> {
    if reference.shape != cand.shape || heads < 2 {
        return None;
    }
    let (r, c) = (reference.as_f32("").ok()?, cand.as_f32("").ok()?);
    let rows = *reference.shape.first()?;
    let n = r.len();
    if rows == 0 || n % rows != 0 || (n / rows) % heads != 0 {
        return None;
    }
    let row = n / rows;
    let d = row / heads;
    let block = |v: &[f32], t: usize, h: usize| -> Vec<f64> {
        v[t * row + h * d..t * row + (h + 1) * d]
            .iter()
            .map(|&x| f64::from(x))
            .collect()
    };
    let map: Vec<usize> = (0..heads)
        .map(|slot| {
            (0..heads)
                .map(|g| {
                    let dist: f64 = (0..rows)
                        .map(|t| {
                            block(c, t, slot)
                                .iter()
                                .zip(block(r, t, g))
                                .map(|(a, b)| (a - b) * (a - b))
                                .sum::<f64>()
                        })
                        .sum();
                    (g, dist)
                })
                .min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)))
                .map_or(slot, |(g, _)| g)
        })
        .collect();
    if map.iter().enumerate().all(|(h, &g)| h == g) {
        return None;
    }
    let mut out = Vec::with_capacity(n);
    for t in 0..rows {
        for &g in &map {
            out.extend_from_slice(&r[t * row + g * d..t * row + (g + 1) * d]);
        }
    }
    let out = HostTensor::f32(reference.shape.clone(), out).ok()?;
    Some((map, out))
}

/// Local search from `m` (residual `r`): one slot moved to another expert, or two slots
/// exchanging theirs, whichever lowers the residual, until nothing does (at most [`PASSES`]
/// passes).
fn descend(
    eval: &Eval<'_>,
    routed: &[usize],
    pool: &[usize],
    m: &mut Vec<usize>,
    r: &mut f64,
) -> Result<()> {
    for _ in 0..PASSES {
        let mut moved = false;
        for &a in routed {
            for &b in pool {
                if m[a] == b {
                    continue;
                }
                let mut c = m.clone();
                c[a] = b;
                let (rc, _) = eval(&c)?;
                if rc < *r {
                    (*r, *m) = (rc, c);
                    moved = true;
                }
            }
        }
        for (i, &a) in routed.iter().enumerate() {
            for &b in &routed[i + 1..] {
                let mut c = m.clone();
                c.swap(a, b);
                let (rc, _) = eval(&c)?;
                if rc < *r {
                    (*r, *m) = (rc, c);
                    moved = true;
                }
            }
        }
        if !moved {
            break;
        }
    }
    Ok(())
}

/// Each routed slot's expert chosen on its own: for slot `a` and expert `f`, every token routed
/// to `a` is charged what remains of its output after `w_a * Y[f]` and after its other slots,
/// one by one, take the expert that explains the most of the rest; the slot gets the `f` with
/// the smallest charge (itself on a tie). A mapping whose slots share tokens (experts of one
/// group, a cycle) is found this way where moving one slot at a time gets stuck.
#[allow(clippy::too_many_arguments)]
fn decoupled(
    y: &[Option<Vec<f32>>],
    routed: &[usize],
    pool: &[usize],
    ids: &[i32],
    w: &[f32],
    cand: &[f32],
    t: usize,
    k: usize,
    hidden: usize,
) -> Vec<usize> {
    let mut map: Vec<usize> = (0..y.len()).collect();
    let yv = |f: usize, tok: usize| -> Option<&[f32]> {
        y.get(f)
            .and_then(Option::as_ref)
            .map(|v| &v[tok * hidden..(tok + 1) * hidden])
    };
    let sub = |r: &mut [f64], wt: f64, v: &[f32]| {
        for (x, &e) in r.iter_mut().zip(v) {
            *x -= wt * f64::from(e);
        }
    };
    let norm2 = |r: &[f64]| r.iter().map(|x| x * x).sum::<f64>();
    for &a in routed {
        let mut best = (f64::INFINITY, a);
        let order = std::iter::once(a).chain(pool.iter().copied().filter(|&f| f != a));
        for f in order {
            let mut cost = 0f64;
            for tok in 0..t {
                let slots = &ids[tok * k..(tok + 1) * k];
                let Some(j) = slots.iter().position(|&e| e == a as i32) else {
                    continue;
                };
                let Some(yf) = yv(f, tok) else { continue };
                let mut r: Vec<f64> = cand[tok * hidden..(tok + 1) * hidden]
                    .iter()
                    .map(|&x| f64::from(x))
                    .collect();
                sub(&mut r, f64::from(w[tok * k + j]), yf);
                for (jj, _) in slots.iter().enumerate().filter(|&(jj, _)| jj != j) {
                    let wt = f64::from(w[tok * k + jj]);
                    let pick = pool
                        .iter()
                        .filter_map(|&g| yv(g, tok).map(|v| (g, v)))
                        .map(|(_, v)| {
                            let mut rr = r.clone();
                            sub(&mut rr, wt, v);
                            rr
                        })
                        .min_by(|p, q| norm2(p).total_cmp(&norm2(q)));
                    if let Some(rr) = pick {
                        r = rr;
                    }
                }
                cost += norm2(&r);
            }
            if cost < best.0 {
                best = (cost, f);
            }
        }
        map[a] = best.1;
    }
    map
}

/// The name of a head mapping: `head_map:g0,g1,..[@L]` (slot `h` holds head `g_h`).
pub fn head_map_name(map: &[usize], layer: Option<usize>) -> String {
    let v: Vec<String> = map.iter().map(usize::to_string).collect();
    match layer {
        Some(l) => format!("head_map:{}@{l}", v.join(",")),
        None => format!("head_map:{}", v.join(",")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_map_finds_moved_blocks() {
        // 2 tokens, 3 heads of 2.
        let r = HostTensor::f32(
            vec![2, 6],
            vec![1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12.],
        )
        .unwrap();
        let c = HostTensor::f32(
            vec![2, 6],
            vec![1., 2., 5., 6., 1., 2., 7., 8., 11., 12., 7., 8.],
        )
        .unwrap();
        let (map, out) = head_map(&r, &c, 3).unwrap();
        assert_eq!(map, vec![0, 2, 0]);
        assert_eq!(out, c);
        assert!(head_map(&r, &r, 3).is_none());
        assert_eq!(head_map_name(&map, Some(1)), "head_map:0,2,0@1");
    }

    #[test]
    fn mixed_sums_weighted_expert_outputs() {
        // 2 tokens, K = 1, hidden 1, experts 0 and 1 output 10 and 20 on every token.
        let y = vec![Some(vec![10.0, 10.0]), Some(vec![20.0, 20.0])];
        let out = mixed(&y, &[1, 0], &[0, 1], &[0.5, 2.0], 2, 1, 1);
        assert_eq!(out, vec![10.0, 20.0]);
    }
}
