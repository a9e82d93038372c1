// Dequantization kernels: every GGML type glmdiff's CPU code dequantizes (src/quant), to f32
// bit-exact against it, and to bf16 / f16 rounded to nearest even from that f32.
//
// One device function per type returns element `j` of a block: `float dq_<type>(const u8* blk,
// u32 j)`, a port of the CPU formula with the same operations in the same order (the sources
// cite ggml's `dequantize_row_*` in ggml/src/ggml-quants.c and gguf-py's quants.py). With
// --fmad=false every product and sum rounds as on the CPU. DEQUANT_KERNELS(type, QK, TS) makes
// the three kernels `dequant_<type>_{f32,bf16,f16}(src, dst, n)`: `src` holds whole blocks of
// TS bytes, `dst` (16-byte aligned) gets n = blocks * QK values; 64-bit indices, grid-stride
// loops (consecutive threads write consecutive outputs).

// Work is split by warps: warp w makes the 256 outputs [256 w, 256 w + 256), lane l the quads
// (4 consecutive outputs) starting at 4 l and 128 + 4 l. A quad lies inside one block (every
// block type's QK is a multiple of 4), so its scale fields are read and decoded once after
// inlining; each store instruction of a warp writes 512 contiguous bytes (256 for 16-bit
// outputs). Outputs past the last whole 256 are written one by one.
#define DQ_WARP_SPAN 256

#define DQ_QUAD(T, QK, TS, i, v)                                                                \
    {                                                                                            \
        const u8* blk_ = src + ((i) / (QK)) * (TS);                                              \
        /* A quad starts at a multiple of 4: saying so lets the compiler see that its four */    \
        /* values share every sub-block index, and decode the scales once. */                    \
        u32 j_ = (u32)((i) % (QK)) & ~3u;                                                        \
        v[0] = dq_##T(blk_, j_);                                                                 \
        v[1] = dq_##T(blk_, j_ + 1);                                                             \
        v[2] = dq_##T(blk_, j_ + 2);                                                             \
        v[3] = dq_##T(blk_, j_ + 3);                                                             \
    }

#define DQ_STAGE 288

#define DEQUANT_KERNELS(T, QK, TS)                                                              \
    extern "C" __global__ void dequant_##T##_f32(const u8* __restrict__ src,                     \
                                                 float* __restrict__ dst, u64 n) {               \
        u64 warps = ((u64)gridDim.x * blockDim.x) / 32;                                          \
        u64 lane = threadIdx.x & 31;                                                             \
        u64 full = n / DQ_WARP_SPAN;                                                             \
        for (u64 w = ((u64)blockIdx.x * blockDim.x + threadIdx.x) / 32; w < full; w += warps) {  \
            _Pragma("unroll") for (int h = 0; h < 2; h++) {                                      \
                u64 i = w * DQ_WARP_SPAN + 128 * h + 4 * lane;                                   \
                float v[4];                                                                      \
                DQ_QUAD(T, QK, TS, i, v)                                                         \
                *(float4*)(dst + i) = make_float4(v[0], v[1], v[2], v[3]);                       \
            }                                                                                    \
        }                                                                                        \
        u64 stride = (u64)gridDim.x * blockDim.x;                                                \
        for (u64 i = full * DQ_WARP_SPAN + (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;   \
             i += stride)                                                                        \
            dst[i] = dq_##T(src + (i / (QK)) * (TS), (u32)(i % (QK)));                           \
    }                                                                                            \
    DEQUANT_KERNEL_U16(T, QK, TS, bf16, float_to_bf16_bits)                                      \
    DEQUANT_KERNEL_U16(T, QK, TS, f16, float_to_half_bits)

// DEQUANT_KERNELS_STAGED: the f32 kernel first stages a warp's blocks (its 256 outputs' bytes,
// at most DQ_STAGE) in shared memory with byte loads that a warp issues 32 contiguous bytes at a
// time, then decodes from there, so the scattered per-lane reads of scale fields and packed
// values hit shared memory. It is faster for most types and slower for a few (Q5_0, Q6_K, IQ3_S,
// IQ4_XS, NVFP4, TQ2_0 on an H200: `glmdiff bench dequant --device`); each type uses the faster.
#define DEQUANT_KERNELS_STAGED(T, QK, TS)                                                       \
    static_assert((DQ_WARP_SPAN / (QK)) * (TS) <= DQ_STAGE, "a warp's blocks fit the stage");   \
    extern "C" __global__ void dequant_##T##_f32(const u8* __restrict__ src,                     \
                                                 float* __restrict__ dst, u64 n) {               \
        __shared__ __align__(16) u8 stage_[8][DQ_STAGE];                                         \
        u8* sh = stage_[(threadIdx.x / 32) & 7];                                                 \
        const u32 span = (DQ_WARP_SPAN / (QK)) * (TS);                                           \
        u64 warps = ((u64)gridDim.x * blockDim.x) / 32;                                          \
        u32 lane = threadIdx.x & 31;                                                             \
        u64 full = n / DQ_WARP_SPAN;                                                             \
        for (u64 w = ((u64)blockIdx.x * blockDim.x + threadIdx.x) / 32; w < full; w += warps) {  \
            const u8* g = src + w * span;                                                        \
            for (u32 k = lane; k < span; k += 32) sh[k] = g[k];                                  \
            __syncwarp();                                                                        \
            _Pragma("unroll") for (int h = 0; h < 2; h++) {                                      \
                u32 il = 128 * h + 4 * lane;                                                     \
                const u8* blk = sh + (il / (QK)) * (TS);                                         \
                u32 j = (il % (QK)) & ~3u;                                                       \
                float4 v = make_float4(dq_##T(blk, j), dq_##T(blk, j + 1), dq_##T(blk, j + 2),   \
                                       dq_##T(blk, j + 3));                                      \
                *(float4*)(dst + w * DQ_WARP_SPAN + il) = v;                                     \
            }                                                                                    \
            __syncwarp();                                                                        \
        }                                                                                        \
        u64 stride = (u64)gridDim.x * blockDim.x;                                                \
        for (u64 i = full * DQ_WARP_SPAN + (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;   \
             i += stride)                                                                        \
            dst[i] = dq_##T(src + (i / (QK)) * (TS), (u32)(i % (QK)));                           \
    }                                                                                            \
    DEQUANT_KERNEL_U16(T, QK, TS, bf16, float_to_bf16_bits)                                      \
    DEQUANT_KERNEL_U16(T, QK, TS, f16, float_to_half_bits)

#define DEQUANT_KERNEL_U16(T, QK, TS, SUFFIX, ROUND)                                            \
    extern "C" __global__ void dequant_##T##_##SUFFIX(const u8* __restrict__ src,                \
                                                      u16* __restrict__ dst, u64 n) {            \
        u64 warps = ((u64)gridDim.x * blockDim.x) / 32;                                          \
        u64 lane = threadIdx.x & 31;                                                             \
        u64 full = ((QK) % 4 == 0) ? n / DQ_WARP_SPAN : 0;                                       \
        for (u64 w = ((u64)blockIdx.x * blockDim.x + threadIdx.x) / 32; w < full; w += warps) {  \
            _Pragma("unroll") for (int h = 0; h < 2; h++) {                                      \
                u64 i = w * DQ_WARP_SPAN + 128 * h + 4 * lane;                                   \
                float v[4];                                                                      \
                DQ_QUAD(T, QK, TS, i, v)                                                         \
                *(uint2*)(dst + i) = make_uint2(ROUND(v[0]) | ((u32)ROUND(v[1]) << 16),          \
                                                ROUND(v[2]) | ((u32)ROUND(v[3]) << 16));         \
            }                                                                                    \
        }                                                                                        \
        u64 stride = (u64)gridDim.x * blockDim.x;                                                \
        for (u64 i = full * DQ_WARP_SPAN + (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;   \
             i += stride)                                                                        \
            dst[i] = ROUND(dq_##T(src + (i / (QK)) * (TS), (u32)(i % (QK))));                    \
    }

// ---- scalar types (src/quant/float.rs) -------------------------------------------------------

// Scalar types have one value per "block": a lane's quad is 4 consecutive scalars, read with one
// vector load straight into registers, then converted one by one by `cv_<type>` on the raw
// little-endian integer (the same conversions as `dq_<type>`).
__device__ __forceinline__ float cv_f32(u32 x) { return __uint_as_float(x); }
__device__ __forceinline__ float cv_i32(u32 x) { return __int2float_rn((int)x); }
__device__ __forceinline__ float cv_f16(u32 x) { return cvt_f16((u16)x); }
__device__ __forceinline__ float cv_bf16(u32 x) { return __uint_as_float(x << 16); }
__device__ __forceinline__ float cv_i16(u32 x) { return (float)(short)(u16)x; }
__device__ __forceinline__ float cv_i8(u32 x) { return (float)(i8)(u8)x; }
__device__ __forceinline__ float cv_f64(u64 x) { return __double2float_rn(__longlong_as_double((long long)x)); }
__device__ __forceinline__ float cv_i64(u64 x) { return __ll2float_rn((long long)x); }

// 4 values of 1, 2, 4 or 8 bytes from `p` (aligned to 4 * TS bytes) as words.
__device__ __forceinline__ void words4_1(const u8* p, u32 w[4]) {
    u32 q = *(const u32*)p;
    _Pragma("unroll") for (int k = 0; k < 4; k++) w[k] = (q >> (8 * k)) & 0xFFu;
}
__device__ __forceinline__ void words4_2(const u8* p, u32 w[4]) {
    uint2 q = *(const uint2*)p;
    w[0] = q.x & 0xFFFFu; w[1] = q.x >> 16; w[2] = q.y & 0xFFFFu; w[3] = q.y >> 16;
}
__device__ __forceinline__ void words4_4(const u8* p, u32 w[4]) {
    uint4 q = *(const uint4*)p;
    w[0] = q.x; w[1] = q.y; w[2] = q.z; w[3] = q.w;
}
__device__ __forceinline__ void words4_8(const u8* p, u64 w[4]) {
    _Pragma("unroll") for (int k = 0; k < 2; k++) {
        uint4 q = ((const uint4*)p)[k];
        w[2 * k] = (u64)q.x | ((u64)q.y << 32);
        w[2 * k + 1] = (u64)q.z | ((u64)q.w << 32);
    }
}

// Scalar kernels split work by warps like the block kernels (lane l: the quads at 4 l and
// 128 + 4 l of the warp's 256 values), so that loads and stores of a warp are contiguous.
#define SCALAR_KERNELS(T, TS, W)                                                                \
    extern "C" __global__ void dequant_##T##_f32(const u8* __restrict__ src,                     \
                                                 float* __restrict__ dst, u64 n) {               \
        u64 warps = ((u64)gridDim.x * blockDim.x) / 32;                                          \
        u64 lane = threadIdx.x & 31;                                                             \
        u64 full = n / DQ_WARP_SPAN;                                                             \
        for (u64 g = ((u64)blockIdx.x * blockDim.x + threadIdx.x) / 32; g < full; g += warps) {  \
            _Pragma("unroll") for (int h = 0; h < 2; h++) {                                      \
                u64 i = g * DQ_WARP_SPAN + 128 * h + 4 * lane;                                   \
                W w[4];                                                                          \
                words4_##TS(src + i * (TS), w);                                                  \
                *(float4*)(dst + i) =                                                            \
                    make_float4(cv_##T(w[0]), cv_##T(w[1]), cv_##T(w[2]), cv_##T(w[3]));         \
            }                                                                                    \
        }                                                                                        \
        u64 stride = (u64)gridDim.x * blockDim.x;                                                \
        for (u64 i = full * DQ_WARP_SPAN + (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;   \
             i += stride)                                                                        \
            dst[i] = dq_##T(src + i * (TS), 0);                                                  \
    }                                                                                            \
    DEQUANT_KERNEL_U16(T, 1, TS, bf16, float_to_bf16_bits)                                       \
    DEQUANT_KERNEL_U16(T, 1, TS, f16, float_to_half_bits)

// One scalar at b (the tails, and the bf16/f16 kernels).
__device__ __forceinline__ float dq_f32(const u8* b, u32) { return cv_f32(ld_u32(b)); }
__device__ __forceinline__ float dq_f16(const u8* b, u32) { return cv_f16(ld_u16(b)); }
__device__ __forceinline__ float dq_bf16(const u8* b, u32) { return cv_bf16(ld_u16(b)); }
__device__ __forceinline__ float dq_f64(const u8* b, u32) { return cv_f64(ld_u64(b)); }
__device__ __forceinline__ float dq_i8(const u8* b, u32) { return cv_i8(b[0]); }
__device__ __forceinline__ float dq_i16(const u8* b, u32) { return cv_i16(ld_u16(b)); }
__device__ __forceinline__ float dq_i32(const u8* b, u32) { return cv_i32(ld_u32(b)); }
__device__ __forceinline__ float dq_i64(const u8* b, u32) { return cv_i64(ld_u64(b)); }

SCALAR_KERNELS(f32, 4, u32)
SCALAR_KERNELS(f16, 2, u32)
SCALAR_KERNELS(bf16, 2, u32)
SCALAR_KERNELS(f64, 8, u64)
SCALAR_KERNELS(i8, 1, u32)
SCALAR_KERNELS(i16, 2, u32)
SCALAR_KERNELS(i32, 4, u32)
SCALAR_KERNELS(i64, 8, u64)

// ---- 32-element blocks (src/quant/legacy.rs) -------------------------------------------------

// Q8_0: f16 d, i8 qs[32]; y[j] = qs[j] * d.
__device__ __forceinline__ float dq_q8_0(const u8* b, u32 j) {
    return (float)(i8)b[2 + j] * ld_f16(b);
}

// The 4-bit value of element j of a 16-byte nibble array: low nibbles are elements 0..15,
// high nibbles 16..31.
__device__ __forceinline__ u32 nib32(const u8* qs, u32 j) {
    return j < 16 ? (qs[j] & 0xFu) : (qs[j - 16] >> 4);
}

// Q4_0: f16 d, qs[16]; y = (q - 8) * d.
__device__ __forceinline__ float dq_q4_0(const u8* b, u32 j) {
    return (float)((int)nib32(b + 2, j) - 8) * ld_f16(b);
}

// Q4_1: f16 d, f16 m, qs[16]; y = q * d + m.
__device__ __forceinline__ float dq_q4_1(const u8* b, u32 j) {
    return (float)nib32(b + 4, j) * ld_f16(b) + ld_f16(b + 2);
}

// Q5: q = nibble | ((qh >> j) & 1) << 4.
__device__ __forceinline__ u32 q5(const u8* qh_p, const u8* qs, u32 j) {
    return nib32(qs, j) | (((ld_u32(qh_p) >> j) & 1u) << 4);
}

// Q5_0: f16 d, u32 qh, qs[16]; y = (q - 16) * d.
__device__ __forceinline__ float dq_q5_0(const u8* b, u32 j) {
    return (float)((int)q5(b + 2, b + 6, j) - 16) * ld_f16(b);
}

// Q5_1: f16 d, f16 m, u32 qh, qs[16]; y = q * d + m.
__device__ __forceinline__ float dq_q5_1(const u8* b, u32 j) {
    return (float)q5(b + 4, b + 8, j) * ld_f16(b) + ld_f16(b + 2);
}

// IQ4_NL: f16 d, qs[16]; y = d * kvalues_iq4nl[q].
__device__ __forceinline__ float dq_iq4_nl(const u8* b, u32 j) {
    return ld_f16(b) * (float)kvalues_iq4nl[nib32(b + 2, j)];
}

DEQUANT_KERNELS(q8_0, 32, 34)
DEQUANT_KERNELS_STAGED(q4_0, 32, 18)
DEQUANT_KERNELS_STAGED(q4_1, 32, 20)
DEQUANT_KERNELS(q5_0, 32, 22)
DEQUANT_KERNELS_STAGED(q5_1, 32, 24)
DEQUANT_KERNELS(iq4_nl, 32, 18)
