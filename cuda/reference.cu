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
// Tiling: a block of 256 threads makes a tile of BT = 32 tokens by BR = 32 rows. Thread
// (g, l) = (tid / 8, tid % 8) keeps lane l of 4 tokens by 8 rows (32 f64 accumulators): tokens
// 4 (g % 8) .. +4, rows 8 (g / 8) .. +8. Columns advance in chunks of KC = 64, staged in shared
// memory as f64 (the conversion from f32 is exact), column-major so that a thread's 4 tokens and
// 8 rows of one column are contiguous; lane l reads columns l, l + 8, .., in order.

#define REF_BT 32
#define REF_BR 32
#define REF_KC 64
#define REF_PAD 2

extern "C" __global__ void __launch_bounds__(256)
    reference_products_f32(const float* __restrict__ x,  // [t, k]
                           const float* __restrict__ w,  // [r, k]
                           float* __restrict__ out,      // [t, ldo], columns 0..r
                           u32 t, u32 r, u32 k, u32 ldo) {
    __shared__ double xs[REF_KC][REF_BT + REF_PAD];
    __shared__ double ws[REF_KC][REF_BR + REF_PAD];
    const u32 tid = threadIdx.x;
    const u32 l = tid & 7u, g = tid >> 3;
    const u32 tg = (g & 7u) * 4u, rg = (g >> 3) * 8u;
    const u64 t0 = (u64)blockIdx.y * REF_BT, r0 = (u64)blockIdx.x * REF_BR;

    double acc[4][8];
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int b = 0; b < 8; b++) acc[a][b] = 0.0;

    for (u64 k0 = 0; k0 < k; k0 += REF_KC) {
        // Stage the chunk: 32 x 64 values of each operand, 8 per thread, coalesced along k.
#pragma unroll
        for (u32 i = 0; i < (REF_BT * REF_KC) / 256; i++) {
            const u32 idx = tid + 256u * i;
            const u32 row = idx / REF_KC, col = idx % REF_KC;
            const u64 c = k0 + col;
            const u64 tt = t0 + row, rr = r0 + row;
            xs[col][row] = (tt < t && c < k) ? (double)x[tt * k + c] : 0.0;
            ws[col][row] = (rr < r && c < k) ? (double)w[rr * k + c] : 0.0;
        }
        __syncthreads();
#pragma unroll
        for (u32 jj = 0; jj < REF_KC / 8; jj++) {
            const u32 c = 8u * jj + l;
            double xv[4], wv[8];
#pragma unroll
            for (int a = 0; a < 4; a++) xv[a] = xs[c][tg + a];
#pragma unroll
            for (int b = 0; b < 8; b++) wv[b] = ws[c][rg + b];
#pragma unroll
            for (int a = 0; a < 4; a++)
#pragma unroll
                for (int b = 0; b < 8; b++) acc[a][b] = __fma_rn(xv[a], wv[b], acc[a][b]);
        }
        __syncthreads();
    }

    // The lanes of one output sit in 8 consecutive threads: the butterfly adds the tree's pairs
    // (l0 + l1, then (l0 + l1) + (l2 + l3), then the two halves); lane l writes row rg + l.
#pragma unroll
    for (int a = 0; a < 4; a++) {
        float mine = 0.0f;
#pragma unroll
        for (int b = 0; b < 8; b++) {
            double s = acc[a][b];
            s = __dadd_rn(s, __shfl_xor_sync(0xFFFFFFFFu, s, 1));
            s = __dadd_rn(s, __shfl_xor_sync(0xFFFFFFFFu, s, 2));
            s = __dadd_rn(s, __shfl_xor_sync(0xFFFFFFFFu, s, 4));
            if ((u32)b == l) mine = __double2float_rn(s);
        }
        const u64 tt = t0 + tg + a, rr = r0 + rg + l;
        if (tt < t && rr < r) out[tt * ldo + rr] = mine;
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
