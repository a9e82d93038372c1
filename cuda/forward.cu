// Forward-pass kernels of the CUDA engine (src/engine/cuda): everything but the projections,
// which are cuBLAS SGEMMs on weights dequantized by dequant.cu into scratch.
//
// Each kernel is the GPU form of one CPU reference function (src/engine/cpu), named beside it.
// Reductions (norms, dot products of attention and the indexer, softmax, the weighted sum of
// the experts) accumulate in f64 like the reference, in a parallel order: results agree with
// the CPU to a few f32 ulps, not bit for bit; `glmdiff run --against cuda` judges them against
// the f32 floors. Shapes are row-major, PyTorch order; indices are 64-bit where a product of
// two dimensions can pass 2^31.

#define FWD_THREADS 256
#define INFINITY __int_as_float(0x7F800000)

// Block-wide sum of one double per thread (blockDim.x = FWD_THREADS); every thread gets it.
__device__ double block_sum(double v) {
    __shared__ double part[FWD_THREADS / 32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    double s = 0.0;
    for (int w = 0; w < FWD_THREADS / 32; w++) s += part[w];
    return s;
}

__device__ double block_max(double v) {
    __shared__ double part[FWD_THREADS / 32];
    for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    double m = -INFINITY;
    for (int w = 0; w < FWD_THREADS / 32; w++) m = fmax(m, part[w]);
    return m;
}

// math.rs `rms_norm` on columns [c0, c0 + nc) of each row of x [T, n]: one block per row.
// y [T, nc] = w * (v / sqrt(mean(v^2) + eps)).
extern "C" __global__ void rms_norm_f32(const float* __restrict__ x, const float* __restrict__ w,
                                        float* __restrict__ y, u32 n, u32 c0, u32 nc, double eps) {
    const u64 row = blockIdx.x;
    const float* v = x + row * n + c0;
    double ss = 0.0;
    for (u32 i = threadIdx.x; i < nc; i += blockDim.x) ss += (double)v[i] * (double)v[i];
    ss = block_sum(ss);
    const double inv = 1.0 / sqrt(ss / (double)nc + eps);
    for (u32 i = threadIdx.x; i < nc; i += blockDim.x)
        y[row * nc + i] = (float)((double)w[i] * ((double)v[i] * inv));
}

// math.rs `layer_norm`, in place on each row of x [T, n]: one block per row.
extern "C" __global__ void layer_norm_f32(float* __restrict__ x, const float* __restrict__ w,
                                          const float* __restrict__ b, u32 n, double eps) {
    float* v = x + (u64)blockIdx.x * n;
    double s = 0.0;
    for (u32 i = threadIdx.x; i < n; i += blockDim.x) s += (double)v[i];
    const double mean = block_sum(s) / (double)n;
    double q = 0.0;
    for (u32 i = threadIdx.x; i < n; i += blockDim.x) {
        const double d = (double)v[i] - mean;
        q += d * d;
    }
    const double inv = 1.0 / sqrt(block_sum(q) / (double)n + eps);
    __syncthreads();
    for (u32 i = threadIdx.x; i < n; i += blockDim.x)
        v[i] = (float)(((double)v[i] - mean) * inv * (double)w[i] + (double)b[i]);
}

// Interleaved RoPE (math.rs `rotate_pairs` with CpuEngine::cos_sin): x [T, heads * stride],
// pairs (2i, 2i+1) of the rd values at `offset` of each head, angle pos * inv_freq[i], cos and
// sin times attn_factor. Out of place into y [T, heads, rd] (in_place = 0) or in place in x.
extern "C" __global__ void rope_f32(float* __restrict__ x, float* __restrict__ y,
                                    const double* __restrict__ inv_freq, u32 T, u32 heads,
                                    u32 stride, u32 offset, u32 rd, double attn_factor,
                                    u32 in_place) {
    const u64 half = rd / 2;
    const u64 total = (u64)T * heads * half;
    for (u64 g = (u64)blockIdx.x * blockDim.x + threadIdx.x; g < total;
         g += (u64)gridDim.x * blockDim.x) {
        const u64 i = g % half, h = (g / half) % heads, pos = g / (half * heads);
        const double a = (double)pos * inv_freq[i];
        const double c = cos(a) * attn_factor, s = sin(a) * attn_factor;
        float* p = x + pos * heads * stride + h * stride + offset + 2 * i;
        const double x0 = (double)p[0], x1 = (double)p[1];
        float* o = in_place ? p : y + (pos * heads + h) * rd + 2 * i;
        o[0] = (float)(x0 * c - x1 * s);
        o[1] = (float)(x0 * s + x1 * c);
    }
}

// attention.rs `indexer_scores_cpu`, the score part: out[t, s] = sum_h hw[t, h] * scale *
// max(q[t, h] . k[s], 0) for s <= t, -inf above the diagonal. One warp per (t, s).
extern "C" __global__ void indexer_scores_f32(const float* __restrict__ q,
                                              const float* __restrict__ k,
                                              const float* __restrict__ hw, float* __restrict__ out,
                                              u32 T, u32 ni, u32 di, double scale) {
    const u64 warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const u32 lane = threadIdx.x % 32;
    if (warp >= (u64)T * T) return;
    const u64 t = warp / T, s = warp % T;
    if (s > t) {
        if (lane == 0) out[t * T + s] = -INFINITY;
        return;
    }
    double acc = 0.0;
    for (u32 h = 0; h < ni; h++) {
        const float* qh = q + (t * ni + h) * di;
        const float* ks = k + s * di;
        double d = 0.0;
        for (u32 i = lane; i < di; i += 32) d += (double)qh[i] * (double)ks[i];
        for (int o = 16; o > 0; o >>= 1) d += __shfl_xor_sync(0xFFFFFFFFu, d, o);
        acc += (double)hw[t * ni + h] * scale * fmax(d, 0.0);
    }
    if (lane == 0) out[t * T + s] = (float)acc;
}

// A float as an integer with the order of Rust's f32::total_cmp (IEEE totalOrder).
__device__ __forceinline__ int total_key(float f) {
    const int i = __float_as_int(f);
    return i ^ (int)(((unsigned)(i >> 31)) >> 1);
}

// attention.rs `top_k_cpu` / util::topk: per row t of scores [T, T], the min(k, t+1) positions
// s <= t with the largest scores, largest first, ties to the lower s; -1 up to width. One
// thread per row, k selection passes (a position is taken once: `taken` marks it via the last
// key seen).
extern "C" __global__ void topk_rows_f32(const float* __restrict__ scores, int* __restrict__ out,
                                         u32 T, u32 k, u32 width) {
    const u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) return;
    const float* row = scores + t * T;
    const u32 n = (u32)t + 1, m = k < n ? k : n;
    // (key, index) of the previous pick: the next pick is the largest pair below it in the order
    // (key descending, index ascending).
    int pk = 0;
    long long pi = -1;
    for (u32 slot = 0; slot < m; slot++) {
        int bk = 0;
        long long bi = -1;
        for (u32 s = 0; s < n; s++) {
            const int key = total_key(row[s]);
            const bool below_prev = pi < 0 || key < pk || (key == pk && (long long)s > pi);
            if (!below_prev) continue;
            if (bi < 0 || key > bk) {
                bk = key;
                bi = s;
            }
        }
        out[t * width + slot] = (int)bi;
        pk = bk;
        pi = bi;
    }
    for (u32 slot = m; slot < width; slot++) out[t * width + slot] = -1;
}

// topk_rows_f32's selection for rows of up to 2^14 keys, one block per row: the row's causal
// entries s <= t as 64-bit keys (total_key's order made unsigned, in the high half; the index
// reversed in the low half, so that descending keys mean larger scores first, ties to the lower
// s), a bitonic sort of the row's power of two in shared memory (dynamic: p2 of them, the
// padding 0, below any entry), then the first min(k, t + 1) indices; -1 up to width.
extern "C" __global__ void topk_rows_sort_f32(const float* __restrict__ scores,
                                              int* __restrict__ out, u32 T, u32 k, u32 width) {
    extern __shared__ unsigned long long keys[];
    const u64 t = blockIdx.x;
    if (t >= T) return;
    const float* row = scores + t * T;
    const u32 n = (u32)t + 1, m = k < n ? k : n;
    u32 p2 = 1;
    while (p2 < n) p2 <<= 1;
    for (u32 s = threadIdx.x; s < p2; s += blockDim.x) {
        unsigned long long v = 0;
        if (s < n) {
            const unsigned hi = (unsigned)total_key(row[s]) ^ 0x80000000u;
            v = ((unsigned long long)hi << 32) | (unsigned long long)(0xFFFFFFFFu - s);
        }
        keys[s] = v;
    }
    __syncthreads();
    for (u32 size = 2; size <= p2; size <<= 1) {
        for (u32 j = size >> 1; j > 0; j >>= 1) {
            for (u32 i = threadIdx.x; i < p2; i += blockDim.x) {
                const u32 ixj = i ^ j;
                if (ixj > i) {
                    const unsigned long long a = keys[i], b = keys[ixj];
                    // Descending in blocks with (i & size) == 0, ascending in the others; the
                    // last merge (size == p2) is descending throughout.
                    const bool desc = (i & size) == 0;
                    if (desc ? a < b : a > b) {
                        keys[i] = b;
                        keys[ixj] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
    for (u32 slot = threadIdx.x; slot < width; slot += blockDim.x)
        out[t * width + slot] =
            slot < m ? (int)(0xFFFFFFFFu - (unsigned)(keys[slot] & 0xFFFFFFFFull)) : -1;
}

// The keys each query may see: mask [T, T] (1 allowed) from the DSA selection [T, sk] (i32,
// -1 ignored, positions above the diagonal ignored), or causal when sel is null.
extern "C" __global__ void mla_mask(const int* __restrict__ sel, u8* __restrict__ mask, u32 T,
                                    u32 sk) {
    const u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) return;
    u8* row = mask + t * T;
    if (sel == nullptr) {
        for (u64 s = 0; s < T; s++) row[s] = s <= t ? 1 : 0;
        return;
    }
    for (u64 s = 0; s < T; s++) row[s] = 0;
    for (u32 j = 0; j < sk; j++) {
        const int s = sel[t * sk + j];
        if (s >= 0 && (u64)s <= t) row[s] = 1;
    }
}

// Absorbed MLA attention core, one block per (t, h): scores over the latent,
// p = softmax(scale * (q_lat[t, h] . c_kv[s] + q_pe[t, h] . k_pe[s])) over the allowed s,
// o_lat[t, h] = sum_s p[s] c_kv[s]. q_lat [T, H, L], q_pe [T, H, rd], c_kv [T, L],
// k_pe [T, rd], mask [T, T], o_lat [T, H, L], probs [H, T, T] (f32, may be null).
// Dynamic shared memory: T doubles (the scores of this row).
extern "C" __global__ void mla_attend_f32(const float* __restrict__ q_lat,
                                          const float* __restrict__ q_pe,
                                          const float* __restrict__ c_kv,
                                          const float* __restrict__ k_pe,
                                          const u8* __restrict__ mask, float* __restrict__ o_lat,
                                          float* __restrict__ probs, u32 T, u32 H, u32 L, u32 rd,
                                          double scale) {
    extern __shared__ double p[];
    const u64 t = blockIdx.x / H, h = blockIdx.x % H;
    const float* ql = q_lat + (t * H + h) * L;
    const float* qp = q_pe + (t * H + h) * rd;
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    // Scores: a warp per key.
    for (u64 s = warp; s < T; s += warps) {
        double d = 0.0;
        if (mask[t * T + s]) {
            const float* c = c_kv + s * L;
            for (u32 i = lane; i < L; i += 32) d += (double)ql[i] * (double)c[i];
            const float* kp = k_pe + s * rd;
            for (u32 i = lane; i < rd; i += 32) d += (double)qp[i] * (double)kp[i];
        }
        for (int o = 16; o > 0; o >>= 1) d += __shfl_xor_sync(0xFFFFFFFFu, d, o);
        if (lane == 0) p[s] = mask[t * T + s] ? d * scale : -INFINITY;
    }
    __syncthreads();
    double m = -INFINITY;
    for (u64 s = threadIdx.x; s < T; s += blockDim.x) m = fmax(m, p[s]);
    m = block_max(m);
    double sum = 0.0;
    for (u64 s = threadIdx.x; s < T; s += blockDim.x) {
        const double e = mask[t * T + s] ? exp(p[s] - m) : 0.0;
        p[s] = e;
        sum += e;
    }
    sum = block_sum(sum);
    __syncthreads();
    for (u64 s = threadIdx.x; s < T; s += blockDim.x) {
        p[s] /= sum;
        if (probs != nullptr) probs[(h * T + t) * T + s] = (float)p[s];
    }
    __syncthreads();
    for (u32 i = threadIdx.x; i < L; i += blockDim.x) {
        double acc = 0.0;
        for (u64 s = 0; s <= t; s++)
            if (mask[t * T + s]) acc += p[s] * (double)c_kv[s * L + i];
        o_lat[(t * H + h) * L + i] = (float)acc;
    }
}

// kv_b in HF layout [H, nope + v, L] (the legacy `attn_kv_b`) split into the absorbed forms:
// wk [H, L, nope] (as `attn_k_b`: wk[h][c][d] = kv[h][d][c]) and wv [H, v, L] (as `attn_v_b`).
extern "C" __global__ void split_kv_b_f32(const float* __restrict__ kv, float* __restrict__ wk,
                                          float* __restrict__ wv, u32 H, u32 nope, u32 v, u32 L) {
    const u64 total = (u64)H * (nope + v) * L;
    for (u64 g = (u64)blockIdx.x * blockDim.x + threadIdx.x; g < total;
         g += (u64)gridDim.x * blockDim.x) {
        const u64 c = g % L, r = (g / L) % (nope + v), h = g / ((u64)L * (nope + v));
        if (r < nope)
            wk[(h * L + c) * nope + r] = kv[g];
        else
            wv[(h * v + (r - nope)) * L + c] = kv[g];
    }
}

// moe.rs `route_token` for one token per thread: gating (0 sigmoid, 1 softmax) in f64, selection
// score = prob + bias, group-limited top-k (groups of E / n_group, the sum of each group's two
// best scores, `used` groups kept), top-k (ties to the lower index), weights normalised (norm)
// and scaled. logits [T, E], bias [E] or null; probs [T, E], ids [T, K], w [T, K].
#define ROUTE_MAX_E 512
__device__ __forceinline__ bool route_better(double a, u32 ia, double b, u32 ib) {
    // Rust f64::total_cmp order is the IEEE order for the non-NaN values here; ties to lower index.
    return a > b || (a == b && ia < ib);
}
extern "C" __global__ void moe_route_f32(const float* __restrict__ logits,
                                         const float* __restrict__ bias, float* __restrict__ probs,
                                         int* __restrict__ ids, float* __restrict__ w, u32 T, u32 E,
                                         u32 K, u32 gating, u32 n_group, u32 used, u32 norm,
                                         double w_scale) {
    const u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T || E > ROUTE_MAX_E) return;
    double p[ROUTE_MAX_E], sc[ROUTE_MAX_E];
    const float* lg = logits + t * E;
    if (gating == 0) {
        for (u32 e = 0; e < E; e++) p[e] = 1.0 / (1.0 + exp(-(double)lg[e]));
    } else {
        double m = -INFINITY;
        for (u32 e = 0; e < E; e++) m = fmax(m, (double)lg[e]);
        double sum = 0.0;
        for (u32 e = 0; e < E; e++) {
            p[e] = exp((double)lg[e] - m);
            sum += p[e];
        }
        for (u32 e = 0; e < E; e++) p[e] /= sum;
    }
    for (u32 e = 0; e < E; e++) {
        sc[e] = bias != nullptr ? p[e] + (double)bias[e] : p[e];
        probs[t * E + e] = (float)p[e];
    }
    if (n_group > 0) {
        const u32 size = E / n_group;
        double gs[64];
        for (u32 g = 0; g < n_group && g < 64; g++) {
            double b0 = -INFINITY, b1 = -INFINITY;
            for (u32 e = g * size; e < (g + 1) * size; e++) {
                if (sc[e] > b0) {
                    b1 = b0;
                    b0 = sc[e];
                } else if (sc[e] > b1) {
                    b1 = sc[e];
                }
            }
            gs[g] = size >= 2 ? b0 + b1 : b0;
        }
        // Keep the `used` best groups (ties to the lower group), mask the others.
        unsigned long long keep = 0;
        for (u32 r = 0; r < used; r++) {
            int best = -1;
            for (u32 g = 0; g < n_group; g++) {
                if (keep & (1ull << g)) continue;
                if (best < 0 || route_better(gs[g], g, gs[best], (u32)best)) best = (int)g;
            }
            if (best >= 0) keep |= 1ull << best;
        }
        for (u32 g = 0; g < n_group; g++)
            if (!(keep & (1ull << g)))
                for (u32 e = g * size; e < (g + 1) * size; e++) sc[e] = -INFINITY;
    }
    double wk[64];
    int ik[64];
    for (u32 r = 0; r < K && r < 64; r++) {
        int best = -1;
        for (u32 e = 0; e < E; e++) {
            bool taken = false;
            for (u32 j = 0; j < r; j++) taken |= ik[j] == (int)e;
            if (taken) continue;
            if (best < 0 || route_better(sc[e], e, sc[best], (u32)best)) best = (int)e;
        }
        ik[r] = best;
        wk[r] = p[best];
    }
    if (norm) {
        double sum = 0.0;
        for (u32 r = 0; r < K; r++) sum += wk[r];
        for (u32 r = 0; r < K; r++) wk[r] /= sum;
    }
    for (u32 r = 0; r < K; r++) {
        ids[t * K + r] = ik[r];
        w[t * K + r] = (float)(wk[r] * w_scale);
    }
}

// math.rs `swiglu`: y = silu(a) * b in f64, rounded to f32.
extern "C" __global__ void swiglu_f32(const float* __restrict__ a, const float* __restrict__ b,
                                      float* __restrict__ y, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        const double g = (double)a[i];
        y[i] = (float)(g / (1.0 + exp(-g)) * (double)b[i]);
    }
}

// y = a + b (one f32 rounding, as the reference's f64 sum rounded to f32).
extern "C" __global__ void add_f32(const float* __restrict__ a, const float* __restrict__ b,
                                   float* __restrict__ y, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x)
        y[i] = a[i] + b[i];
}

// y [m, n] = rows idx[0..m) of x [*, n].
extern "C" __global__ void gather_rows_f32(const float* __restrict__ x, const int* __restrict__ idx,
                                           float* __restrict__ y, u32 m, u32 n) {
    const u64 total = (u64)m * n;
    for (u64 g = (u64)blockIdx.x * blockDim.x + threadIdx.x; g < total;
         g += (u64)gridDim.x * blockDim.x)
        y[g] = x[(u64)idx[g / n] * n + g % n];
}

// acc [T, n] (f64) += w[i] * y[i] into row tok[i], for the m rows of one expert (distinct
// tokens: no two threads add to one value).
extern "C" __global__ void scatter_add_f64(double* __restrict__ acc, const float* __restrict__ y,
                                           const int* __restrict__ tok, const float* __restrict__ w,
                                           u32 m, u32 n) {
    const u64 total = (u64)m * n;
    for (u64 g = (u64)blockIdx.x * blockDim.x + threadIdx.x; g < total;
         g += (u64)gridDim.x * blockDim.x) {
        const u64 i = g / n, c = g % n;
        acc[(u64)tok[i] * n + c] += (double)w[i] * (double)y[g];
    }
}

extern "C" __global__ void f64_to_f32(const double* __restrict__ x, float* __restrict__ y, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x)
        y[i] = (float)x[i];
}

// bf16 storage (the engine's --dtype bf16): f32 -> bf16 bits, bf16 bits -> f32, and rounding
// f32 values to the nearest bf16 in place (round to nearest even, NaN kept; common.cuh).
extern "C" __global__ void f32_to_bf16(const float* __restrict__ x, u16* __restrict__ y, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x)
        y[i] = float_to_bf16_bits(x[i]);
}

extern "C" __global__ void bf16_to_f32(const u16* __restrict__ x, float* __restrict__ y, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x)
        y[i] = __uint_as_float((u32)x[i] << 16);
}

extern "C" __global__ void round_bf16(float* __restrict__ x, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x)
        x[i] = __uint_as_float((u32)float_to_bf16_bits(x[i]) << 16);
}
