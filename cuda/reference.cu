// The CPU reference's matrix products on the device, bit for bit (src/engine/cpu/math.rs `dot`,
// src/gpu/reference.rs): out[t][r] (row t of `out` at t * ldo) = f32(combine(lane[0..8])) where lane l holds, in f64, the
// sum of x[t][i] * w[r][i] over the columns i with i % 8 == l, added in increasing i from +0,
// and combine is the fixed tree ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
//
// Why the bits are the CPU's: a product of two f32 values is exact in f64, so the fused
// multiply-add __fma_rn(x, w, acc) rounds once where the CPU's `acc + x * w` rounds once; each
// lane receives the same products in the same order; the tree adds the same pairs (an IEEE sum
// is commutative, so the butterfly's lane that adds b + a gets a + b's bits); the final rounding
// to f32 is round-to-nearest-even on both. Columns, tokens and rows past the ends are loaded as
// +0 on both operands: a lane starts at +0 and is never -0 (an IEEE sum is -0 only when both
// terms are), so adding +0 * +0 leaves it as it is, as the CPU's zero padding does.
//
// Tiling: a block of 256 threads makes a tile of BT tokens by BR rows. Thread (g, l) =
// (tid / 8, tid % 8) keeps lane l of TT tokens by TR rows (TT x TR f64 accumulators): tokens
// TT (g % 8) .., rows TR (g / 8) ... Columns advance in chunks of KC, staged in shared memory as
// f64 (the conversion from f32 is exact), column-major so that a thread's tokens and rows of one
// column are contiguous; lane l reads columns l, l + 8, .., in order.

// Two tilings, the same sums: `reference_products_f32` (TT = 4 tokens by TR = 8 rows a thread,
// blocks of 32 x 32, KC = 64) and `reference_products_f32_t64` (8 x 8 a thread, blocks of 64
// tokens by 32 rows, KC = 32: fewer shared-memory loads per multiply-add, more registers).
// src/gpu/reference.rs times both when it opens the device and uses the faster.
#define REF_PAD 2

template <int TT, int TR, int KC>
__device__ __forceinline__ void ref_products(const float* __restrict__ x, const float* __restrict__ w,
                                             float* __restrict__ out, u32 t, u32 r, u32 k, u32 ldo,
                                             double* xs_, double* ws_) {
    constexpr int GT = 8, GR = 4;           // token groups by row groups: 32 groups of 8 lanes
    constexpr int BT = GT * TT, BR = GR * TR;
    constexpr int XS = BT + REF_PAD, WS = BR + REF_PAD;
    const u32 tid = threadIdx.x;
    const u32 l = tid & 7u, g = tid >> 3;
    const u32 tg = (g % GT) * TT, rg = (g / GT) * TR;
    const u64 t0 = (u64)blockIdx.y * BT, r0 = (u64)blockIdx.x * BR;

    double acc[TT][TR];
#pragma unroll
    for (int a = 0; a < TT; a++)
#pragma unroll
        for (int b = 0; b < TR; b++) acc[a][b] = 0.0;

    for (u64 k0 = 0; k0 < k; k0 += KC) {
        // Stage the chunk (coalesced along k), column-major in shared memory.
#pragma unroll
        for (u32 i = 0; i < (BT * KC) / 256; i++) {
            const u32 idx = tid + 256u * i;
            const u32 row = idx / KC, col = idx % KC;
            const u64 c = k0 + col, tt = t0 + row;
            xs_[col * XS + row] = (tt < t && c < k) ? (double)x[tt * k + c] : 0.0;
        }
#pragma unroll
        for (u32 i = 0; i < (BR * KC) / 256; i++) {
            const u32 idx = tid + 256u * i;
            const u32 row = idx / KC, col = idx % KC;
            const u64 c = k0 + col, rr = r0 + row;
            ws_[col * WS + row] = (rr < r && c < k) ? (double)w[rr * k + c] : 0.0;
        }
        __syncthreads();
#pragma unroll
        for (u32 jj = 0; jj < KC / 8; jj++) {
            const u32 c = 8u * jj + l;
            double xv[TT], wv[TR];
#pragma unroll
            for (int a = 0; a < TT; a++) xv[a] = xs_[c * XS + tg + a];
#pragma unroll
            for (int b = 0; b < TR; b++) wv[b] = ws_[c * WS + rg + b];
#pragma unroll
            for (int a = 0; a < TT; a++)
#pragma unroll
                for (int b = 0; b < TR; b++) acc[a][b] = __fma_rn(xv[a], wv[b], acc[a][b]);
        }
        __syncthreads();
    }

    // The lanes of one output sit in 8 consecutive threads: the butterfly adds the tree's pairs
    // (l0 + l1, then (l0 + l1) + (l2 + l3), then the two halves); lane l writes rows rg + l,
    // rg + 8 + l, ...
#pragma unroll
    for (int a = 0; a < TT; a++) {
        float mine[TR / 8];
#pragma unroll
        for (int m = 0; m < TR / 8; m++) mine[m] = 0.0f;
#pragma unroll
        for (int b = 0; b < TR; b++) {
            double s = acc[a][b];
            s = __dadd_rn(s, __shfl_xor_sync(0xFFFFFFFFu, s, 1));
            s = __dadd_rn(s, __shfl_xor_sync(0xFFFFFFFFu, s, 2));
            s = __dadd_rn(s, __shfl_xor_sync(0xFFFFFFFFu, s, 4));
            if ((u32)(b % 8) == l) mine[b / 8] = __double2float_rn(s);
        }
        const u64 tt = t0 + tg + a;
#pragma unroll
        for (int m = 0; m < TR / 8; m++) {
            const u64 rr = r0 + rg + 8 * m + l;
            if (tt < t && rr < r) out[tt * ldo + rr] = mine[m];
        }
    }
}

extern "C" __global__ void __launch_bounds__(256)
    reference_products_f32(const float* __restrict__ x,  // [t, k]
                           const float* __restrict__ w,  // [r, k]
                           float* __restrict__ out,      // [t, ldo], columns 0..r
                           u32 t, u32 r, u32 k, u32 ldo) {
    __shared__ double xs[64 * (32 + REF_PAD)];
    __shared__ double ws[64 * (32 + REF_PAD)];
    ref_products<4, 8, 64>(x, w, out, t, r, k, ldo, xs, ws);
}

extern "C" __global__ void __launch_bounds__(256, 1)
    reference_products_f32_t64(const float* __restrict__ x, const float* __restrict__ w,
                               float* __restrict__ out, u32 t, u32 r, u32 k, u32 ldo) {
    __shared__ double xs[32 * (64 + REF_PAD)];
    __shared__ double ws[32 * (32 + REF_PAD)];
    ref_products<8, 8, 32>(x, w, out, t, r, k, ldo, xs, ws);
}

// A product of a few tokens (a routed expert's one or two at a short prompt): the tiles above would
// compute up to 32 tokens for each, so here thread (row, lane l) = (block row + tid / 8, tid % 8)
// keeps lane l of FEW_T tokens of one row, reading columns l, l + 8, .. in order straight from the
// weights (each weight once for the FEW_T tokens), 32 rows a block, FEW_T tokens a block row of the
// grid. The same lanes, the same fused multiply-adds in the same order, the same tree and rounding:
// the same bits. Columns past the end are not visited (the CPU's +0 * +0 leaves a lane as it is),
// tokens past the end are computed from +0 and not written.
#define FEW_T 4
extern "C" __global__ void __launch_bounds__(256)
    reference_products_f32_few(const float* __restrict__ x,  // [t, k]
                               const float* __restrict__ w,  // [r, k]
                               float* __restrict__ out,      // [t, ldo], columns 0..r
                               u32 t, u32 r, u32 k, u32 ldo) {
    const u32 l = threadIdx.x & 7u;
    const u64 row = (u64)blockIdx.x * 32 + (threadIdx.x >> 3);
    const u64 t0 = (u64)blockIdx.y * FEW_T;
    double acc[FEW_T];
#pragma unroll
    for (int a = 0; a < FEW_T; a++) acc[a] = 0.0;
    if (row < r) {
        const float* __restrict__ wr = w + row * k;
#pragma unroll 4
        for (u64 c = l; c < k; c += 8) {
            const double wv = (double)wr[c];
#pragma unroll
            for (int a = 0; a < FEW_T; a++) {
                const u64 tt = t0 + a;
                const double xv = tt < t ? (double)x[tt * k + c] : 0.0;
                acc[a] = __fma_rn(xv, wv, acc[a]);
            }
        }
    }
    // Every thread of the warp takes part in the tree (a row past the end holds zeros).
#pragma unroll
    for (int a = 0; a < FEW_T; a++) {
        double s = acc[a];
        s = __dadd_rn(s, __shfl_xor_sync(0xFFFFFFFFu, s, 1));
        s = __dadd_rn(s, __shfl_xor_sync(0xFFFFFFFFu, s, 2));
        s = __dadd_rn(s, __shfl_xor_sync(0xFFFFFFFFu, s, 4));
        const u64 tt = t0 + a;
        if (l == 0 && row < r && tt < t) out[tt * ldo + row] = __double2float_rn(s);
    }
}

// Counts the values of `v` (n of them) that are not finite: the reference refuses a weight that
// holds one (src/engine/cpu/weights.rs `finite`), so a product with one goes back to the CPU,
// which names it.
extern "C" __global__ void reference_count_nonfinite(const float* __restrict__ v, u64 n,
                                                     unsigned long long* __restrict__ count) {
    u32 mine = 0;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        if ((__float_as_uint(v[i]) & 0x7F800000u) == 0x7F800000u) mine++;
    if (mine) atomicAdd(count, (unsigned long long)mine);
}

// Copies n 32-bit words from src to dst, either of them host memory mapped into the device's
// address space (a product's pinned parcel, src/gpu/parcels.rs): a product's input and outputs
// then travel by the device's own loads and stores over the link, not as copies queued on a copy
// engine behind another stream's bulk uploads.
extern "C" __global__ void reference_copy_words(const u32* __restrict__ src, u32* __restrict__ dst,
                                                u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        dst[i] = src[i];
}

// The CPU reference's MLA attention (src/engine/cpu/attention.rs, attention/tiles.rs), the
// scores and the weighted sums; the softmax between them stays on the CPU (its exp is the
// host's). Query i of a call (heads hd) sees the keys keys[offs[i] .. offs[i + 1]] (ascending,
// each < T); its scores and probabilities sit at (offs[i] - base) * h + hd * len_i + j, j in
// 0..len_i (len_i = offs[i + 1] - offs[i]).
//
// Scores, tiles.rs `scores`: (combine(nope lanes) + combine(rot lanes)) * scale, lane l of each
// part summing q[c] * k[c] over the part's columns c with c % 8 == l in increasing c by fused
// multiply-adds from +0 (the product of two f32 values is exact in f64, as on the CPU); the
// combine is the butterfly of reference_products. q: [n, h, nope + rd] (q_nope then q_rot),
// kv: [T, h, nope + v] (K's nope part then V), kpe: [T, rd]. A block per (query, head): 32
// groups of 8 lanes, a key a group; the q row in shared memory (nope + rd doubles).
extern "C" __global__ void __launch_bounds__(256)
    reference_mla_scores(const float* __restrict__ q, const float* __restrict__ kv,
                         const float* __restrict__ kpe, const u64* __restrict__ offs,
                         const u32* __restrict__ keys, double* __restrict__ out, u32 h, u32 nope,
                         u32 rd, u32 v, double scale, u64 base) {
    extern __shared__ double qs[];
    const u64 i = blockIdx.x;
    const u32 hd = blockIdx.y, tid = threadIdx.x, l = tid & 7u, g = tid >> 3;
    const u32 qk = nope + rd;
    for (u32 c = tid; c < qk; c += blockDim.x) qs[c] = (double)q[(i * h + hd) * qk + c];
    __syncthreads();
    const u64 o0 = offs[i], len = offs[i + 1] - o0;
    double* dst = out + (o0 - base) * h + (u64)hd * len;
    // Every warp runs the same number of rounds (the shuffles need all its lanes).
    for (u64 j0 = 0; j0 < len; j0 += 32) {
        const u64 j = j0 + g;
        const bool valid = j < len;
        double a = 0.0, b = 0.0;
        if (valid) {
            const u64 key = keys[o0 + j];
            const float* kr = kv + (key * h + hd) * (u64)(nope + v);
            for (u32 c = l; c < nope; c += 8) a = __fma_rn(qs[c], (double)kr[c], a);
            const float* pr = kpe + key * rd;
            for (u32 c = l; c < rd; c += 8) b = __fma_rn(qs[nope + c], (double)pr[c], b);
        }
        a = __dadd_rn(a, __shfl_xor_sync(0xFFFFFFFFu, a, 1));
        a = __dadd_rn(a, __shfl_xor_sync(0xFFFFFFFFu, a, 2));
        a = __dadd_rn(a, __shfl_xor_sync(0xFFFFFFFFu, a, 4));
        b = __dadd_rn(b, __shfl_xor_sync(0xFFFFFFFFu, b, 1));
        b = __dadd_rn(b, __shfl_xor_sync(0xFFFFFFFFu, b, 2));
        b = __dadd_rn(b, __shfl_xor_sync(0xFFFFFFFFu, b, 4));
        if (valid && l == 0) dst[j] = __dmul_rn(__dadd_rn(a, b), scale);
    }
}

// Weighted sums, tiles.rs `weighted_sums` over the query's own keys (a key of the CPU's block
// outside them has probability +0 and adds +-0, which changes no sum: a sum starts at +0 and is
// never -0; with a non-finite V value the CPU goes a row at a time, its own keys alone):
// out[i][hd][d] = f32(sum_j p_j * f64(V[key_j][hd][d])), a product then an add (p is no f32
// value: the product rounds), ascending j, from +0. A block per (query, head), a thread a value.
extern "C" __global__ void __launch_bounds__(256)
    reference_mla_sums(const double* __restrict__ p, const float* __restrict__ kv,
                       const u64* __restrict__ offs, const u32* __restrict__ keys,
                       float* __restrict__ out, u32 h, u32 nope, u32 v, u64 base) {
    const u64 i = blockIdx.x;
    const u32 hd = blockIdx.y;
    const u64 o0 = offs[i], len = offs[i + 1] - o0;
    const double* pr = p + (o0 - base) * h + (u64)hd * len;
    for (u32 d = threadIdx.x; d < v; d += blockDim.x) {
        double acc = 0.0;
        for (u64 j = 0; j < len; j++) {
            const u64 key = keys[o0 + j];
            const double x = (double)kv[(key * h + hd) * (u64)(nope + v) + nope + d];
            acc = __dadd_rn(acc, __dmul_rn(pr[j], x));
        }
        out[(i * h + hd) * v + d] = __double2float_rn(acc);
    }
}

// The DSA indexer's scores (src/engine/cpu/attention.rs `index_scores`): for query row t and key
// s <= t, I(t, s) = f32(acc) with acc = +0, then for each head h in order
// acc = acc + (f64(hw[t][h]) * scale) * relu(q_h(t) . k(s)) (each a product, then an add:
// never fused; relu(x) = fmax(x, 0), a NaN giving 0 as the CPU's f64::max does; none unless
// `relu`), the dot being math.rs `dot`'s: lane l sums q[c] * k[c] over the columns c with
// c % 8 == l in increasing c by fused multiply-adds from +0 (a product of two f32 values is
// exact in f64), combined by the butterfly of reference_products. Keys s > t get -inf.
// q: [T, ni, di], k: [T, di], hw: [T, ni]; out: rows row0 .. row0 + gridDim.x, [rows, T]. A
// block per query row: 32 groups of 8 lanes, a key a group; the row's q (ni * di doubles) and
// its head weights times the scale (ni doubles) in shared memory.
extern "C" __global__ void __launch_bounds__(256)
    reference_index_scores(const float* __restrict__ q, const float* __restrict__ k,
                           const float* __restrict__ hw, float* __restrict__ out, u32 t_all,
                           u32 ni, u32 di, double scale, u32 relu, u32 row0) {
    extern __shared__ double qs[];
    double* ws = qs + (u64)ni * di;
    const u32 t = row0 + blockIdx.x, tid = threadIdx.x, l = tid & 7u, g = tid >> 3;
    const u64 w = (u64)ni * di;
    for (u64 c = tid; c < w; c += blockDim.x) qs[c] = (double)q[(u64)t * w + c];
    for (u32 h = tid; h < ni; h += blockDim.x) ws[h] = __dmul_rn((double)hw[(u64)t * ni + h], scale);
    __syncthreads();
    float* dst = out + (u64)blockIdx.x * t_all;
    for (u32 s = tid; s < t_all; s += blockDim.x)
        if (s > t) dst[s] = __int_as_float(0xff800000);
    // Every warp runs the same number of rounds (the shuffles need all its lanes).
    for (u32 s0 = 0; s0 <= t; s0 += 32) {
        const u32 s = s0 + g;
        const bool valid = s <= t;
        const float* kr = k + (u64)(valid ? s : t) * di;
        double acc = 0.0;
        for (u32 h = 0; h < ni; h++) {
            const double* qh = qs + (u64)h * di;
            double a = 0.0;
            for (u32 c = l; c < di; c += 8) a = __fma_rn(qh[c], (double)kr[c], a);
            a = __dadd_rn(a, __shfl_xor_sync(0xFFFFFFFFu, a, 1));
            a = __dadd_rn(a, __shfl_xor_sync(0xFFFFFFFFu, a, 2));
            a = __dadd_rn(a, __shfl_xor_sync(0xFFFFFFFFu, a, 4));
            if (relu) a = fmax(a, 0.0);
            acc = __dadd_rn(acc, __dmul_rn(ws[h], a));
        }
        if (valid && l == 0) dst[s] = __double2float_rn(acc);
    }
}
