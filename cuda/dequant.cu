// Dequantization kernels: every GGML type glmdiff's CPU code dequantizes (src/quant), to f32
// bit-exact against it, and to bf16 / f16 rounded to nearest even from that f32.
//
// One device function per type returns element `j` of a block: `float dq_<type>(const u8* blk,
// u32 j)`, a port of the CPU formula with the same operations in the same order (the sources
// cite ggml's `dequantize_row_*` in ggml/src/ggml-quants.c and gguf-py's quants.py). With
// --fmad=false every product and sum rounds as on the CPU. A second function per block type,
// `dq8_<type>(blk, j, v)`, makes eight values at once (two quads of one 32-value chunk, see
// DEQUANT_OCTETS) with the same operations. DEQUANT_KERNELS8(type, QK, TS, ALIGN) makes the
// three kernels `dequant_<type>_{f32,bf16,f16}(src, dst, n)`: `src` holds whole blocks of TS
// bytes at any byte offset, `dst` (16-byte aligned) gets n = blocks * QK values; 64-bit
// indices, grid-stride loops over warps.
//
// Scalar types (SCALAR_KERNELS) split work by warps too: warp w makes the 256 outputs
// [256 w, 256 w + 256), lane l the quads starting at 4 l and 128 + 4 l, so that each store
// instruction of a warp writes 512 contiguous bytes (256 for 16-bit outputs); their 16-bit
// kernels (DEQUANT_KERNEL_U16) decode a quad with four dq_ calls (DQ_QUAD). Outputs past the
// last whole 256 are written one by one.
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

// ---- octet kernels -------------------------------------------------------------------------
//
// DEQUANT_OCTETS: the layout every block type now runs. A warp makes the 256 outputs
// [256 w, 256 w + 256) per iteration. Lane l = 4 s + q makes 8 of them with one call of
// `dq8_<type>(blk, j, v)`: the quads at 32 s + 4 q and 32 s + 16 + 4 q, which lie in one 32-value
// chunk of one block (so every scale field is decoded once per lane, and the packed values come
// with one or two word loads), and a store instruction of the warp writes eight whole 64-byte
// pieces (sixteen full 32-byte sectors, as a contiguous 512 bytes would).
// The warp's input bytes (its span, SPAN = 256 / QK * TS) are fetched with 16-byte loads, one per
// lane, into registers one iteration ahead (the next span's loads are in flight while this one
// decodes), then moved to shared memory at the same offset modulo 16 as in global memory, so that
// `dq8_` reads whole words where a block's layout allows (ALIGN: the alignment the dq8_ function
// needs of a block, 2 or 4 bytes, or 1; a source pointer not aligned to it takes the per-value
// path). Words that are not wholly inside the tensor (its first and last) are assembled byte by
// byte, so no load leaves the source's bytes. Outputs past the last whole 256 are made one by one.

// `dq8_` helpers: 4 little-endian bytes from a 2- or 4-aligned pointer, and byte k of a word.
__device__ __forceinline__ u32 ld4_a2(const u8* p) {
    return (u32) * (const u16*)p | ((u32) * (const u16*)(p + 2) << 16);
}
__device__ __forceinline__ u32 ld4_a4(const u8* p) { return *(const u32*)p; }
__device__ __forceinline__ float ld_f16_a2(const u8* p) { return cvt_f16(*(const u16*)p); }
__device__ __forceinline__ u32 byte_of(u32 x, u32 k) { return (x >> (8 * k)) & 0xFFu; }

// One 16-byte word of the source: word `wi` counted from `base` (src rounded down to 16 bytes);
// the bytes [lo, hi) relative to base are the tensor's.
__device__ __forceinline__ uint4 dq8_fetch_word(const u8* base, u64 wi, u64 lo, u64 hi) {
    const u64 b = wi * 16;
    if (b >= lo && b + 16 <= hi) return ((const uint4*)base)[wi];
    u32 w[4] = {0u, 0u, 0u, 0u};
    for (u32 k = 0; k < 16; k++)
        if (b + k >= lo && b + k < hi) w[k / 4] |= (u32)base[b + k] << (8 * (k % 4));
    return make_uint4(w[0], w[1], w[2], w[3]);
}

#define DQ8_STORE_F32(dst, i, v)                                                                \
    {                                                                                            \
        *(float4*)((dst) + (i)) = make_float4(v[0], v[1], v[2], v[3]);                           \
        *(float4*)((dst) + (i) + 16) = make_float4(v[4], v[5], v[6], v[7]);                      \
    }
#define DQ8_STORE_U16(dst, i, v, ROUND)                                                         \
    {                                                                                            \
        *(uint2*)((dst) + (i)) = make_uint2(ROUND(v[0]) | ((u32)ROUND(v[1]) << 16),              \
                                            ROUND(v[2]) | ((u32)ROUND(v[3]) << 16));             \
        *(uint2*)((dst) + (i) + 16) = make_uint2(ROUND(v[4]) | ((u32)ROUND(v[5]) << 16),         \
                                                 ROUND(v[6]) | ((u32)ROUND(v[7]) << 16));        \
    }
#define DQ8_STORE_BF16(dst, i, v) DQ8_STORE_U16(dst, i, v, float_to_bf16_bits)
#define DQ8_STORE_F16(dst, i, v) DQ8_STORE_U16(dst, i, v, float_to_half_bits)
#define DQ8_ONE_F32(v) (v)
#define DQ8_ONE_BF16(v) float_to_bf16_bits(v)
#define DQ8_ONE_F16(v) float_to_half_bits(v)

#define DEQUANT_OCTETS(T, QK, TS, ALIGN, NAME, OUT_T, FMT)                                      \
    extern "C" __global__ void NAME(const u8* __restrict__ src, OUT_T* __restrict__ dst, u64 n) { \
        constexpr u32 SPAN = (DQ_WARP_SPAN / (QK)) * (TS);                                       \
        constexpr u32 WORDS = (SPAN + 15) / 16 + 1;                                              \
        static_assert(WORDS <= 32, "a warp's span fits one word per lane");                      \
        __shared__ uint4 stage_[8][WORDS];                                                       \
        const u32 lane = threadIdx.x & 31;                                                       \
        uint4* st = stage_[(threadIdx.x / 32) & 7];                                              \
        const u8* sh = (const u8*)st;                                                            \
        const u64 warps = ((u64)gridDim.x * blockDim.x) / 32;                                    \
        const u64 full = n / DQ_WARP_SPAN;                                                       \
        u64 w = ((u64)blockIdx.x * blockDim.x + threadIdx.x) / 32;                               \
        if ((((u64)src) & ((ALIGN) - 1)) == 0) {                                                 \
            const u64 head = (u64)src & 15;                                                      \
            const u8* base = src - head;                                                         \
            const u64 end = head + (n / (QK)) * (TS);                                            \
            uint4 r = make_uint4(0u, 0u, 0u, 0u);                                                \
            if (w < full && lane < WORDS)                                                        \
                r = dq8_fetch_word(base, ((head + w * SPAN) >> 4) + lane, head, end);            \
            for (; w < full; w += warps) {                                                       \
                const u64 b0 = head + w * SPAN;                                                  \
                if (lane < WORDS) st[lane] = r;                                                  \
                __syncwarp();                                                                    \
                const u64 wn = w + warps;                                                        \
                if (wn < full && lane < WORDS)                                                   \
                    r = dq8_fetch_word(base, ((head + wn * SPAN) >> 4) + lane, head, end);       \
                const u32 e0 = 32 * (lane >> 2) + 4 * (lane & 3);                                \
                const u8* blk = sh + (b0 & 15) + (e0 / (QK)) * (TS);                             \
                float v[8];                                                                      \
                dq8_##T(blk, e0 % (QK), v);                                                      \
                DQ8_STORE_##FMT(dst, w * DQ_WARP_SPAN + e0, v)                                   \
                __syncwarp();                                                                    \
            }                                                                                    \
        } else {                                                                                 \
            for (; w < full; w += warps) {                                                       \
                const u32 e0 = 32 * (lane >> 2) + 4 * (lane & 3);                                \
                const u8* blk = src + w * SPAN + (e0 / (QK)) * (TS);                             \
                float v[8];                                                                      \
                _Pragma("unroll") for (u32 k = 0; k < 4; k++) {                                  \
                    v[k] = dq_##T(blk, e0 % (QK) + k);                                           \
                    v[4 + k] = dq_##T(blk, e0 % (QK) + 16 + k);                                  \
                }                                                                                \
                DQ8_STORE_##FMT(dst, w * DQ_WARP_SPAN + e0, v)                                   \
            }                                                                                    \
        }                                                                                        \
        const u64 stride = (u64)gridDim.x * blockDim.x;                                          \
        for (u64 i = full * DQ_WARP_SPAN + (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;   \
             i += stride)                                                                        \
            dst[i] = DQ8_ONE_##FMT(dq_##T(src + (i / (QK)) * (TS), (u32)(i % (QK))));            \
    }

// The three kernels of a block type: dequant_<type>_{f32,bf16,f16}, octet layout.
#define DEQUANT_KERNELS8(T, QK, TS, ALIGN)                                                      \
    DEQUANT_OCTETS(T, QK, TS, ALIGN, dequant_##T##_f32, float, F32)                              \
    DEQUANT_OCTETS(T, QK, TS, ALIGN, dequant_##T##_bf16, u16, BF16)                              \
    DEQUANT_OCTETS(T, QK, TS, ALIGN, dequant_##T##_f16, u16, F16)

// dq8_ from dq_: the octet of a type without a dedicated one.
#define DQ8_FROM_DQ(T)                                                                          \
    __device__ __forceinline__ void dq8_##T(const u8* b, u32 j, float v[8]) {                    \
        _Pragma("unroll") for (u32 k = 0; k < 4; k++) {                                          \
            v[k] = dq_##T(b, j + k);                                                             \
            v[4 + k] = dq_##T(b, j + 16 + k);                                                    \
        }                                                                                        \
    }

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
// 128 + 4 l of the warp's 256 values), so that loads and stores of a warp are contiguous. A
// source not aligned to a quad's bytes (a view at an odd offset) takes the per-value path.
#define SCALAR_KERNELS(T, TS, W)                                                                \
    extern "C" __global__ void dequant_##T##_f32(const u8* __restrict__ src,                     \
                                                 float* __restrict__ dst, u64 n) {               \
        u64 warps = ((u64)gridDim.x * blockDim.x) / 32;                                          \
        u64 lane = threadIdx.x & 31;                                                             \
        u64 full = ((u64)src & (4 * (TS) - 1)) == 0 ? n / DQ_WARP_SPAN : 0;                   \
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

