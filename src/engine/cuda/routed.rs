//! Routed uploads: the stacked expert tensors of a MoE layer put on the device by expert, only
//! the experts its router picked, when few are.
//!
//! A step that routes few tokens reads few experts: at 16 tokens GLM-5 routes each to 8 of 256,
//! so about 100 experts are read, and the other 156 (3.3 of the layer's 5.9 GB at Q4_K) would
//! be uploaded for nothing. With routed uploads the stacked expert tensors (`ffn_gate_exps`,
//! `ffn_up_exps`, `ffn_down_exps`, `ffn_gate_up_exps`) are left out of the layer's prefetch;
//! once the expert step has read its routing back, the routed experts' rows that are not on the
//! device yet go to the prefetch's uploader in groups of [`GROUP`] experts per tensor (one job
//! of several file ranges each: the uploader's reader threads read a group at once), and the
//! step takes each group when it reaches its first expert. Without the uploader (prefetch off,
//! or it failed) a group is copied on demand from the memory map. Either way the bytes are the
//! file's, the rows those of the whole tensor: the same values, the same bits.
//!
//! When ([`ExpertUploads`], `--expert-uploads`): `auto` (the default) when the expected share
//! of experts a step routes to, with every token's experts spread evenly, is at most
//! [`ROUTED_SHARE_MAX`] (GLM-5: up to 21 tokens); `routed` and `whole` force one way. The token count is the last prompt the
//! engine embedded or routed; a layer prefetched before the engine saw any is prefetched whole.

use std::collections::HashMap;
use std::ops::Range;
use std::rc::Rc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use cudarc::driver::CudaSlice;

use super::prefetch::Want;
use super::CudaEngine;
use crate::gpu::resident;
use crate::gpu::upload::FileRange;
use crate::model::names::{self, blk};

/// Experts of one upload job of a stacked tensor: a group of GLM-5 Q4_K `ffn_gate_exps` rows is
/// 113 MB, enough for the uploader's four readers, and the step starts on the first group while
/// the others are read.
pub const GROUP: usize = 16;

/// The largest expected share of a layer's experts a step routes to for which `auto` uploads
/// by expert: with a larger share the whole tensors, prefetched behind the layer before, cost
/// less than uploading most of them after the router.
pub const ROUTED_SHARE_MAX: f64 = 0.5;

/// How often a wait for an upload polls while the reference may use this engine's routed
/// experts (`gpu::resident`), microseconds.
const POLL_MICROS: u64 = 300;

/// Bytes of an expert's first and last rows compared between the memory map and the file.
const FINGERPRINT: usize = 64;

/// How the stacked expert tensors reach the device (the command's `--expert-uploads`); the
/// same bits either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExpertUploads {
    /// By expert when few are routed ([`ROUTED_SHARE_MAX`]), else whole.
    #[default]
    Auto,
    /// Always by expert, the routed ones only, after the router.
    Routed,
    /// Always whole (every expert, prefetched with the layer).
    Whole,
}

/// [`ExpertUploads`] of the engines opened from now on ([`set_expert_uploads_by_default`]).
static BY_DEFAULT: AtomicU8 = AtomicU8::new(0);

/// How the engines this process opens from now on upload stacked expert tensors: the
/// command's `--expert-uploads`, set once at its start, before any engine opens.
pub fn set_expert_uploads_by_default(mode: ExpertUploads) {
    let v = match mode {
        ExpertUploads::Auto => 0,
        ExpertUploads::Routed => 1,
        ExpertUploads::Whole => 2,
    };
    BY_DEFAULT.store(v, Ordering::Relaxed);
}

/// The mode [`set_expert_uploads_by_default`] set (`auto` unless told otherwise).
pub fn expert_uploads_by_default() -> ExpertUploads {
    match BY_DEFAULT.load(Ordering::Relaxed) {
        1 => ExpertUploads::Routed,
        2 => ExpertUploads::Whole,
        _ => ExpertUploads::Auto,
    }
}

/// The expected share of `n_expert` experts that `tokens` tokens, each routed to `used`
/// distinct experts evenly spread, reach: `1 - (1 - used / n_expert)^tokens`.
pub fn expected_routed_share(tokens: usize, used: usize, n_expert: usize) -> f64 {
    if n_expert == 0 {
        return 0.0;
    }
    let miss = 1.0 - (used.min(n_expert) as f64 / n_expert as f64);
    1.0 - miss.powi(tokens.min(i32::MAX as usize) as i32)
}

/// Whether `name` is a stacked expert tensor of a layer (`[cols, rows, n_expert]`).
pub fn is_stacked_experts(name: &str) -> bool {
    matches!(
        names::split_blk(name),
        Some((_, s)) if s == blk::FFN_GATE_EXPS
            || s == blk::FFN_UP_EXPS
            || s == blk::FFN_DOWN_EXPS
            || s == blk::FFN_GATE_UP_EXPS
    )
}

/// The groups of at most `group` experts, in order, of `experts` (sorted).
pub fn groups(experts: &[usize], group: usize) -> Vec<&[usize]> {
    experts.chunks(group.max(1)).collect()
}

/// One group of experts of a stacked tensor, uploaded as one buffer: the experts' rows one
/// after another.
pub(super) struct Group {
    /// The name the buffer is filed under (in the prefetch's pending jobs, then in the
    /// engine's raw buffers): `<tensor>, <n> experts from <first>`.
    key: String,
    /// The stacked tensor.
    tensor: String,
    /// Its experts, in the buffer's order.
    experts: Vec<usize>,
}

/// Where an expert's rows are: its group and the byte offset of its first row in the group's
/// buffer.
pub(super) struct Slot {
    group: Rc<Group>,
    at: usize,
}

/// The experts of each stacked tensor put (or being put) on the device by expert, by tensor.
pub(super) type RoutedIndex = HashMap<String, HashMap<usize, Slot>>;

impl CudaEngine<'_> {
    /// The same engine with stacked expert tensors uploaded as `mode` says (the command's
    /// `--expert-uploads` by default, [`expert_uploads_by_default`]).
    pub fn with_expert_uploads(mut self, mode: ExpertUploads) -> Self {
        self.expert_uploads = mode;
        self
    }

    /// The tensors of `weights` (a layer's) that go to the device whole, prefetched with their
    /// layer: all but the stacked expert tensors while uploads go by expert.
    pub(super) fn whole_tensors(&self, weights: &[String]) -> Vec<String> {
        let by_expert = self.routed_uploads();
        weights
            .iter()
            .filter(|n| !(by_expert && is_stacked_experts(n)))
            .cloned()
            .collect()
    }

    /// Whether the stacked expert tensors go by expert now: the mode, and for `auto` the last
    /// token count seen.
    pub(super) fn routed_uploads(&self) -> bool {
        match self.expert_uploads {
            ExpertUploads::Routed => true,
            ExpertUploads::Whole => false,
            ExpertUploads::Auto => {
                let hp = self.weights.hparams();
                self.tokens.get().is_some_and(|t| {
                    expected_routed_share(t, hp.n_expert_used, hp.n_expert) <= ROUTED_SHARE_MAX
                })
            }
        }
    }

    /// The stacked expert tensors of layer `layer` its expert step reads: the fused
    /// `ffn_gate_up_exps` (when the model has no `ffn_gate_exps`) or `ffn_gate_exps` and
    /// `ffn_up_exps`, then `ffn_down_exps`.
    pub(super) fn stacked_expert_names(&self, layer: usize) -> Vec<String> {
        let gate = names::blk(layer, blk::FFN_GATE_EXPS);
        let fused = names::blk(layer, blk::FFN_GATE_UP_EXPS);
        let down = names::blk(layer, blk::FFN_DOWN_EXPS);
        if !self.weights.has(&gate) && self.weights.has(&fused) {
            vec![fused, down]
        } else {
            vec![gate, names::blk(layer, blk::FFN_UP_EXPS), down]
        }
    }

    /// Starts the uploads of the rows of `experts` (sorted, distinct) of the stacked tensors
    /// `tensors` of layer `layer`, for those of the tensors that go by expert (not on the
    /// device whole, nor on their way whole) and those of the experts not already there.
    pub(super) fn upload_routed(
        &self,
        layer: usize,
        tensors: &[&str],
        experts: &[usize],
    ) -> Result<()> {
        if !self.routed_uploads() {
            return Ok(());
        }
        // Per tensor, its groups' uploads in expert order.
        let mut by_tensor: Vec<Vec<Want>> = Vec::new();
        {
            let mut index = self.routed.borrow_mut();
            let p = self.prefetch.borrow();
            for &name in tensors {
                by_tensor.push(Vec::new());
                let wants = by_tensor.last_mut().context("engine: cuda: no tensor")?;
                if self.raw.borrow().contains_key(name) || p.is_pending(name) {
                    continue;
                }
                let have = index.entry(name.to_string()).or_default();
                let missing: Vec<usize> = experts
                    .iter()
                    .copied()
                    .filter(|e| !have.contains_key(e))
                    .collect();
                for g in groups(&missing, GROUP) {
                    let group = Rc::new(Group {
                        key: format!("{name}, {} experts from {}", g.len(), g[0]),
                        tensor: name.to_string(),
                        experts: g.to_vec(),
                    });
                    let mut src = Vec::with_capacity(g.len());
                    let (mut head, mut tail) = (Vec::new(), Vec::new());
                    let mut at = 0;
                    let mut mapped = true;
                    for (i, &e) in g.iter().enumerate() {
                        let desc = self.weights.expert_desc(name, e)?;
                        let data = desc
                            .data()
                            .with_context(|| format!("engine: cuda: reading {name} expert {e}"))?;
                        match desc.file_range() {
                            Ok(Some((path, offset, len))) if len as usize == data.len() => src
                                .push(FileRange {
                                    path: path.to_path_buf(),
                                    offset,
                                    len: data.len(),
                                }),
                            _ => mapped = false,
                        }
                        let k = FINGERPRINT.min(data.len());
                        if i == 0 {
                            head = data[..k].to_vec();
                        }
                        if i + 1 == g.len() {
                            tail = data[data.len() - k..].to_vec();
                        }
                        have.insert(
                            e,
                            Slot {
                                group: group.clone(),
                                at,
                            },
                        );
                        at += data.len();
                    }
                    // A model held in memory has no file to read: its groups are copied on
                    // demand.
                    if mapped && at > 0 {
                        wants.push(Want {
                            name: group.key.clone(),
                            src,
                            head,
                            tail,
                        });
                    }
                }
            }
        }
        // Interleaved by group (the first experts' gate, up and down rows, then the next
        // experts'): the step, and the reference's products from these bytes
        // (`gpu::resident`), can start on the first experts while the others are copied.
        let most = by_tensor.iter().map(Vec::len).max().unwrap_or(0);
        let mut wants = Vec::with_capacity(by_tensor.iter().map(Vec::len).sum());
        let mut iters: Vec<_> = by_tensor.into_iter().map(Vec::into_iter).collect();
        for _ in 0..most {
            wants.extend(iters.iter_mut().filter_map(Iterator::next));
        }
        let mut p = self.prefetch.borrow_mut();
        if !wants.is_empty() && p.can_send() {
            p.send(self.gpu, layer, wants);
        }
        Ok(())
    }

    /// Rows `rows` of the stacked tensor `name` when they were put on the device by expert:
    /// the group's buffer (taken from its upload, or copied now) and the byte offset of the
    /// rows' first byte in it; `None` when the tensor's rows are not held by expert (the whole
    /// tensor is read instead).
    pub(super) fn routed_rows(
        &self,
        name: &str,
        rows: &Range<usize>,
        row_bytes: usize,
    ) -> Result<Option<(Arc<CudaSlice<u8>>, usize)>> {
        let (group, at) = {
            let index = self.routed.borrow();
            let Some(by_expert) = index.get(name) else {
                return Ok(None);
            };
            let t = self.weights.tensor(name)?;
            let per_expert = t.info.ne.get(1).copied().unwrap_or(0) as usize;
            if per_expert == 0 {
                return Ok(None);
            }
            let e = rows.start / per_expert;
            if rows.end > (e + 1) * per_expert {
                return Ok(None);
            }
            let Some(slot) = by_expert.get(&e) else {
                return Ok(None);
            };
            (
                slot.group.clone(),
                slot.at + (rows.start - e * per_expert) * row_bytes,
            )
        };
        Ok(Some((self.group_buffer(&group)?, at)))
    }

    /// The device buffer of `group`: already taken, taken from its upload now (the compute
    /// stream ordered after its copies), or copied on demand from the memory map; counted as
    /// the engine's weight uploads.
    fn group_buffer(&self, group: &Group) -> Result<Arc<CudaSlice<u8>>> {
        if let Some(b) = self.raw.borrow().get(&group.key) {
            return Ok(b.clone());
        }
        let t0 = Instant::now();
        let d = match self.take_prefetched(&group.key) {
            Some(d) => d,
            None => {
                let mut bytes = Vec::new();
                for &e in &group.experts {
                    let desc = self.weights.expert_desc(&group.tensor, e)?;
                    bytes.extend_from_slice(desc.data().with_context(|| {
                        format!("engine: cuda: reading {} expert {e}", group.tensor)
                    })?);
                }
                self.gpu.alloc_copy(&bytes, &group.key)?
            }
        };
        self.count_upload(t0, d.len());
        let d = Arc::new(d);
        self.raw.borrow_mut().insert(group.key.clone(), d.clone());
        self.offer_group(group, &d);
        Ok(d)
    }

    /// Offers the rows of `group`'s experts, held in `buf` (its copies done), to the
    /// reference's products on this device (`gpu::resident`, `--reference-reuse`), by the file
    /// span each expert's rows come from.
    fn offer_group(&self, group: &Group, buf: &Arc<CudaSlice<u8>>) {
        if !resident::reuse() {
            return;
        }
        let Some((layer, _)) = names::split_blk(&group.tensor) else {
            return;
        };
        let mut at = 0usize;
        for &e in &group.experts {
            let Ok(desc) = self.weights.expert_desc(&group.tensor, e) else {
                return;
            };
            let Ok(Some((path, offset, len))) = desc.file_range() else {
                return;
            };
            resident::offer(
                layer,
                resident::FileSpan {
                    path: path.to_path_buf(),
                    offset,
                    len,
                },
                resident::OnDevice {
                    ordinal: self.gpu.info.ordinal,
                    buf: buf.clone(),
                    at,
                },
            );
            at += len as usize;
        }
    }

    /// While the reference may use this engine's routed experts (`gpu::resident`), waits for
    /// the upload of `name` by polling, offering every other group as soon as its copies are
    /// done; returns at once otherwise (the take then waits as it always has).
    pub(super) fn wait_offering(&self, name: &str) {
        if !resident::reuse() {
            return;
        }
        while self.prefetch.borrow_mut().upload_done(name) == Some(false) {
            self.offer_arrived();
            std::thread::sleep(std::time::Duration::from_micros(POLL_MICROS));
        }
    }

    /// Takes every routed group whose upload is back and done into the engine's buffers and
    /// offers it to the reference (`gpu::resident`), without waiting for any: the reference's
    /// products can use a group as soon as it is on the device, not when this engine's step
    /// reaches it; so are the whole tensors prefetched for a layer. Returns whether such an
    /// upload is still under way (false without `--reference-reuse`).
    pub(super) fn offer_arrived(&self) -> bool {
        if !resident::reuse() {
            return false;
        }
        let mut under_way = false;
        let groups: Vec<Rc<Group>> = {
            let index = self.routed.borrow();
            let raw = self.raw.borrow();
            let mut p = self.prefetch.borrow_mut();
            let mut seen = std::collections::HashSet::new();
            index
                .values()
                .flat_map(|by_expert| by_expert.values())
                .filter(|slot| seen.insert(slot.group.key.clone()))
                .filter(|slot| !raw.contains_key(&slot.group.key))
                .filter(|slot| arrived(&mut p, &slot.group.key, &mut under_way))
                .map(|slot| slot.group.clone())
                .collect()
        };
        for g in groups {
            // A failure here is met again, and reported, when the step needs the group.
            let _ = self.group_buffer(&g);
        }
        // The whole tensors of the layers begun or prefetched (attention, shared expert, dense
        // MLP), taken as their copies finish (`raw` offers them).
        let whole: Vec<String> = {
            let raw = self.raw.borrow();
            let mut p = self.prefetch.borrow_mut();
            let names: Vec<String> = p
                .pending
                .keys()
                .filter(|n| names::split_blk(n).is_some() && self.weights.has(n))
                .filter(|n| !raw.contains_key(*n))
                .cloned()
                .collect();
            names
                .into_iter()
                .filter(|n| arrived(&mut p, n, &mut under_way))
                .collect()
        };
        for name in whole {
            let _ = self.raw(&name);
        }
        under_way
    }
}

/// Whether the upload filed as `name` is back with its copies done; one still under way sets
/// `under_way`.
fn arrived(p: &mut super::prefetch::Prefetch, name: &str, under_way: &mut bool) -> bool {
    match p.upload_done(name) {
        Some(true) => true,
        Some(false) => {
            *under_way = true;
            false
        }
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The expected share by hand: GLM-5 (8 of 256) at 16 tokens is 1 - (31/32)^16 = 0.3983, at
    /// 21 tokens 0.487 and at 22 tokens 0.503, so `auto` goes by expert up to 21 tokens.
    #[test]
    fn expected_share_by_hand() {
        let s = |t| expected_routed_share(t, 8, 256);
        assert!((s(16) - 0.39829).abs() < 1e-4, "{}", s(16));
        assert!(s(21) <= ROUTED_SHARE_MAX && s(22) > ROUTED_SHARE_MAX);
        assert_eq!(s(0), 0.0);
        assert_eq!(expected_routed_share(1, 8, 256), 8.0 / 256.0);
        // Every expert used by every token, and no experts.
        assert_eq!(expected_routed_share(1, 4, 4), 1.0);
        assert_eq!(expected_routed_share(3, 8, 0), 0.0);
    }

    #[test]
    fn stacked_expert_tensors_by_name() {
        for s in [
            blk::FFN_GATE_EXPS,
            blk::FFN_UP_EXPS,
            blk::FFN_DOWN_EXPS,
            blk::FFN_GATE_UP_EXPS,
        ] {
            assert!(is_stacked_experts(&names::blk(3, s)), "{s}");
        }
        for n in [
            names::blk(3, blk::FFN_GATE_SHEXP),
            names::blk(3, blk::ATTN_Q_B),
            "ffn_gate_exps.weight".to_string(),
            "output.weight".to_string(),
        ] {
            assert!(!is_stacked_experts(&n), "{n}");
        }
    }

    #[test]
    fn groups_in_order() {
        let e: Vec<usize> = (0..40).map(|i| i * 3).collect();
        let g = groups(&e, GROUP);
        assert_eq!(g.len(), 3);
        assert_eq!(g[0].len(), 16);
        assert_eq!(g[2], &e[32..]);
        assert!(groups(&[], GROUP).is_empty());
        assert_eq!(groups(&[5], 0), vec![&[5][..]]);
    }
}
