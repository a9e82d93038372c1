//! How the reference's values line up with a GGUF tensor: a [`Gather`] reads, for any range of
//! the GGUF tensor's rows (matrix view, see [`super::store`]), the reference values that belong
//! there, in the same order. The correct layout of every tensor is a gather
//! ([`super::mapping`]); so is every mapping bug a diagnosis tries ([`super::diagnose`]).

use std::ops::Range;

use anyhow::Result;

use super::store::{Store, Values};

/// Largest block read from a store at once, in values (bounds memory for transposed reads).
pub const READ_CHUNK: u64 = 1 << 20;

/// Where the reference values of a GGUF tensor's rows come from.
#[derive(Clone, Debug, PartialEq)]
pub enum Gather {
    /// Row `i` is row `start + i` of tensor `name` (same row length).
    Rows {
        /// Reference tensor.
        name: String,
        /// First row.
        start: u64,
    },
    /// Row `i` is row `(i / group) * stride + offset + i % group` of `name`: every `group` rows
    /// start a new group `stride` rows further (the V rows of each head of `kv_b_proj`, or
    /// gate rows of fused experts).
    Strided {
        /// Reference tensor.
        name: String,
        /// Rows per group.
        group: u64,
        /// Reference rows between group starts.
        stride: u64,
        /// Reference row of group 0's first row.
        offset: u64,
    },
    /// Row `i` is column `i % width` of the `len` reference rows starting at
    /// `(i / width) * stride + offset`: blocks stored transposed (the K rows of each head of
    /// `kv_b_proj` in `attn_k_b`; with one block, a whole transposed matrix).
    Transposed {
        /// Reference tensor.
        name: String,
        /// Reference columns per block (= GGUF rows per block).
        width: u64,
        /// Reference rows per block (= GGUF row length).
        len: u64,
        /// Reference rows between block starts.
        stride: u64,
        /// Reference row of block 0.
        offset: u64,
    },
    /// [`Gather::Transposed`] over the rows of another gather whose rows hold `inner_row_len`
    /// values (a reference `kv_b` that is itself assembled from a GGUF's `attn_k_b`/`attn_v_b`).
    TransposedOf {
        /// The gather whose rows are read.
        inner: Box<Gather>,
        /// Values per inner row.
        inner_row_len: u64,
        /// Inner columns per block.
        width: u64,
        /// Inner rows per block.
        len: u64,
        /// Inner rows between block starts.
        stride: u64,
        /// Inner row of block 0.
        offset: u64,
    },
    /// Consecutive runs of rows served by their own gathers: `(first row, rows, gather)`, in
    /// order and covering all rows (stacked experts from per-expert tensors).
    Pieces(Vec<(u64, u64, Gather)>),
    /// Row `i` is row `rows[i]` of `inner` (permuted experts or heads, K/V order).
    Mapped {
        /// The gather whose rows are picked.
        inner: Box<Gather>,
        /// Inner row of each row.
        rows: Vec<u64>,
    },
    /// Column `j` is column `cols[j]` of `inner` (permuted heads of `attn_output`).
    ColMapped {
        /// The gather whose columns are picked.
        inner: Box<Gather>,
        /// Inner column of each column.
        cols: Vec<u64>,
    },
}

impl Gather {
    /// A stack of `parts`, each `per` rows.
    pub fn stack(parts: Vec<Gather>, per: u64) -> Gather {
        Gather::Pieces(
            parts
                .into_iter()
                .enumerate()
                .map(|(e, g)| (e as u64 * per, per, g))
                .collect(),
        )
    }

    /// Reference tensors this gather reads.
    pub fn sources(&self) -> Vec<String> {
        let mut out = Vec::new();
        self.collect_sources(&mut out);
        out.dedup();
        out
    }

    fn collect_sources(&self, out: &mut Vec<String>) {
        match self {
            Gather::Rows { name, .. }
            | Gather::Strided { name, .. }
            | Gather::Transposed { name, .. } => {
                if !out.contains(name) {
                    out.push(name.clone());
                }
            }
            Gather::Pieces(p) => p.iter().for_each(|(_, _, g)| g.collect_sources(out)),
            Gather::Mapped { inner, .. }
            | Gather::ColMapped { inner, .. }
            | Gather::TransposedOf { inner, .. } => inner.collect_sources(out),
        }
    }

    /// Reads rows `rows` (each `row_len` values) from `store`.
    pub fn read(
        &self,
        store: &dyn Store,
        rows: Range<u64>,
        row_len: u64,
        want_var: bool,
    ) -> Result<Values> {
        let mut out = Values {
            vals: Vec::with_capacity(((rows.end - rows.start) * row_len) as usize),
            var: None,
        };
        if rows.start >= rows.end {
            return Ok(out);
        }
        match self {
            Gather::Rows { name, start } => {
                return store.read(
                    name,
                    start + rows.start..start + rows.end,
                    0..row_len,
                    want_var,
                )
            }
            Gather::Strided {
                name,
                group,
                stride,
                offset,
            } => {
                let mut i = rows.start;
                while i < rows.end {
                    let g = i / group;
                    let end = ((g + 1) * group).min(rows.end);
                    let r0 = g * stride + offset + i % group;
                    out.extend(store.read(name, r0..r0 + (end - i), 0..row_len, want_var)?);
                    i = end;
                }
            }
            Gather::Transposed {
                name,
                width,
                len,
                stride,
                offset,
            } => {
                let mut i = rows.start;
                while i < rows.end {
                    let b = i / width;
                    let end = ((b + 1) * width).min(rows.end);
                    let (c0, c1) = (i % width, i % width + (end - i));
                    let base = b * stride + offset;
                    // [len, c1 - c0] read in row chunks, then transposed into [c1 - c0, len].
                    let w = (c1 - c0) as usize;
                    let mut block = Values::default();
                    // A GGUF store dequantizes whole rows: bound rows x full row length.
                    let full = store.meta(name).map_or(1, |m| m.row_len());
                    let step = (READ_CHUNK / full.max(w as u64).max(1)).max(1);
                    let mut r = 0;
                    while r < *len {
                        let re = (r + step).min(*len);
                        block.extend(store.read(name, base + r..base + re, c0..c1, want_var)?);
                        r = re;
                    }
                    let t = |v: &[f32]| -> Vec<f32> {
                        let l = *len as usize;
                        let mut o = vec![0f32; v.len()];
                        for (d, row) in v.chunks_exact(w).enumerate() {
                            for (c, &x) in row.iter().enumerate() {
                                o[c * l + d] = x;
                            }
                        }
                        o
                    };
                    out.extend(Values {
                        vals: t(&block.vals),
                        var: block.var.as_deref().map(t),
                    });
                    i = end;
                }
            }
            Gather::TransposedOf {
                inner,
                inner_row_len,
                width,
                len,
                stride,
                offset,
            } => {
                let il = *inner_row_len as usize;
                let mut i = rows.start;
                while i < rows.end {
                    let b = i / width;
                    let end = ((b + 1) * width).min(rows.end);
                    let (c0, c1) = ((i % width) as usize, (i % width + (end - i)) as usize);
                    let base = b * stride + offset;
                    let block = inner.read(store, base..base + len, *inner_row_len, want_var)?;
                    let t = |v: &[f32]| -> Vec<f32> {
                        let l = *len as usize;
                        let mut o = vec![0f32; (c1 - c0) * l];
                        for (d, row) in v.chunks_exact(il).enumerate() {
                            for (c, &x) in row[c0..c1].iter().enumerate() {
                                o[c * l + d] = x;
                            }
                        }
                        o
                    };
                    out.extend(Values {
                        vals: t(&block.vals),
                        var: block.var.as_deref().map(t),
                    });
                    i = end;
                }
            }
            Gather::Pieces(pieces) => {
                for (first, n, g) in pieces {
                    let (s, e) = (rows.start.max(*first), rows.end.min(first + n));
                    if s < e {
                        out.extend(g.read(store, s - first..e - first, row_len, want_var)?);
                    }
                }
            }
            Gather::Mapped { inner, rows: map } => {
                let mut i = rows.start as usize;
                let end = rows.end as usize;
                while i < end {
                    // A run of consecutive inner rows is one read.
                    let mut j = i + 1;
                    while j < end && map[j] == map[j - 1] + 1 {
                        j += 1;
                    }
                    out.extend(inner.read(store, map[i]..map[j - 1] + 1, row_len, want_var)?);
                    i = j;
                }
            }
            Gather::ColMapped { inner, cols } => {
                let v = inner.read(store, rows, row_len, want_var)?;
                let pick = |x: &[f32]| -> Vec<f32> {
                    x.chunks_exact(row_len as usize)
                        .flat_map(|r| cols.iter().map(|&c| r[c as usize]))
                        .collect()
                };
                return Ok(Values {
                    vals: pick(&v.vals),
                    var: v.var.as_deref().map(pick),
                });
            }
        }
        Ok(out)
    }
}

/// Row map that permutes groups of `group` rows: row `i` is row `perm[i / group] * group + i % group`.
pub fn group_rows(perm: &[u64], group: u64) -> Vec<u64> {
    perm.iter()
        .flat_map(|&p| (0..group).map(move |r| p * group + r))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wcheck::store::Meta;
    use std::collections::HashMap;

    /// A store of small matrices whose values encode (tensor, row, col).
    struct Mem(HashMap<String, (u64, u64)>);

    impl Store for Mem {
        fn describe(&self) -> String {
            "mem".into()
        }
        fn is_original(&self) -> bool {
            true
        }
        fn names(&self) -> Vec<String> {
            self.0.keys().cloned().collect()
        }
        fn meta(&self, name: &str) -> Option<Meta> {
            self.0.get(name).map(|&(r, c)| Meta {
                shape: vec![r, c],
                dtype: "F32".into(),
            })
        }
        fn read(&self, _: &str, rows: Range<u64>, cols: Range<u64>, _: bool) -> Result<Values> {
            let mut v = Vec::new();
            for r in rows {
                for c in cols.clone() {
                    v.push((r * 100 + c) as f32);
                }
            }
            Ok(Values { vals: v, var: None })
        }
    }

    fn mem() -> Mem {
        Mem(HashMap::from([("kv".to_string(), (12, 3))]))
    }

    /// kv_b with H=2 heads of nope=2 K rows and v=4 V rows, kv_lora=3 columns: attn_k_b rows
    /// (h, c) hold kv rows h*6 + d at column c; attn_v_b rows (h, j) are kv rows h*6 + 2 + j.
    #[test]
    fn kv_b_parts_by_hand() {
        let s = mem();
        let k = Gather::Transposed {
            name: "kv".into(),
            width: 3,
            len: 2,
            stride: 6,
            offset: 0,
        };
        // rows (h=1, c=1..3): [kv[6][1], kv[7][1]], [kv[6][2], kv[7][2]]
        let v = k.read(&s, 4..6, 2, false).unwrap().vals;
        assert_eq!(v, vec![601.0, 701.0, 602.0, 702.0]);
        let vb = Gather::Strided {
            name: "kv".into(),
            group: 4,
            stride: 6,
            offset: 2,
        };
        let v = vb.read(&s, 3..5, 3, false).unwrap().vals;
        assert_eq!(v, vec![500.0, 501.0, 502.0, 800.0, 801.0, 802.0]);
        let m = Gather::Mapped {
            inner: Box::new(Gather::Rows {
                name: "kv".into(),
                start: 0,
            }),
            rows: group_rows(&[1, 0], 6),
        };
        assert_eq!(
            m.read(&s, 0..1, 3, false).unwrap().vals,
            vec![600.0, 601.0, 602.0]
        );
        let c = Gather::ColMapped {
            inner: Box::new(Gather::Rows {
                name: "kv".into(),
                start: 0,
            }),
            cols: vec![2, 0, 1],
        };
        assert_eq!(
            c.read(&s, 1..2, 3, false).unwrap().vals,
            vec![102.0, 100.0, 101.0]
        );
    }
}
