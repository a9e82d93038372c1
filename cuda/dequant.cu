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

// Each thread makes 8 consecutive outputs (inside one block for every block type, QK being a
// multiple of 8; 8 blocks of one value for the scalar types): the scale fields those outputs
// share are read and decoded once after inlining, and the outputs leave in 16- or 32-byte stores.
// A tail of n % 8 values is written one by one.
#define DQ_PER_THREAD 8

#define DEQUANT_KERNELS(T, QK, TS)                                                              \
    extern "C" __global__ void dequant_##T##_f32(const u8* __restrict__ src,                     \
                                                 float* __restrict__ dst, u64 n) {               \
        u64 stride = (u64)gridDim.x * blockDim.x;                                                \
        u64 groups = n / DQ_PER_THREAD;                                                          \
        for (u64 g = (u64)blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += stride) {      \
            u64 i0 = g * DQ_PER_THREAD;                                                          \
            /* QK is a multiple of 8: the thread's values share one block. */                    \
            const u8* blk = src + (i0 / (QK)) * (TS);                                            \
            u32 j0 = (u32)(i0 % (QK));                                                           \
            float v[DQ_PER_THREAD];                                                              \
            _Pragma("unroll") for (int k = 0; k < DQ_PER_THREAD; k++) v[k] = dq_##T(blk, j0 + k); \
            float4* d4 = (float4*)(dst + i0);                                                    \
            d4[0] = make_float4(v[0], v[1], v[2], v[3]);                                         \
            d4[1] = make_float4(v[4], v[5], v[6], v[7]);                                         \
        }                                                                                        \
        for (u64 i = groups * DQ_PER_THREAD + (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; \
             i += stride)                                                                        \
            dst[i] = dq_##T(src + (i / (QK)) * (TS), (u32)(i % (QK)));                           \
    }                                                                                            \
    DEQUANT_KERNEL_U16(T, QK, TS, bf16, float_to_bf16_bits)                                      \
    DEQUANT_KERNEL_U16(T, QK, TS, f16, float_to_half_bits)

#define DEQUANT_KERNEL_U16(T, QK, TS, SUFFIX, ROUND)                                            \
    extern "C" __global__ void dequant_##T##_##SUFFIX(const u8* __restrict__ src,                \
                                                      u16* __restrict__ dst, u64 n) {            \
        u64 stride = (u64)gridDim.x * blockDim.x;                                                \
        u64 groups = n / DQ_PER_THREAD;                                                          \
        for (u64 g = (u64)blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += stride) {      \
            u64 i0 = g * DQ_PER_THREAD;                                                          \
            u32 w[DQ_PER_THREAD / 2];                                                            \
            if ((QK) % DQ_PER_THREAD == 0) {                                                     \
                const u8* blk = src + (i0 / (QK)) * (TS);                                        \
                u32 j0 = (u32)(i0 % (QK));                                                       \
                _Pragma("unroll") for (int k = 0; k < DQ_PER_THREAD; k += 2) {                   \
                    u32 lo = ROUND(dq_##T(blk, j0 + k));                                         \
                    u32 hi = ROUND(dq_##T(blk, j0 + k + 1));                                     \
                    w[k / 2] = lo | (hi << 16);                                                  \
                }                                                                                \
            } else {                                                                             \
                _Pragma("unroll") for (int k = 0; k < DQ_PER_THREAD; k += 2) {                   \
                    u64 i = i0 + k;                                                              \
                    u32 lo = ROUND(dq_##T(src + (i / (QK)) * (TS), (u32)(i % (QK))));            \
                    u32 hi = ROUND(dq_##T(src + ((i + 1) / (QK)) * (TS), (u32)((i + 1) % (QK)))); \
                    w[k / 2] = lo | (hi << 16);                                                  \
                }                                                                                \
            }                                                                                    \
            *(uint4*)(dst + i0) = make_uint4(w[0], w[1], w[2], w[3]);                            \
        }                                                                                        \
        for (u64 i = groups * DQ_PER_THREAD + (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; \
             i += stride)                                                                        \
            dst[i] = ROUND(dq_##T(src + (i / (QK)) * (TS), (u32)(i % (QK))));                    \
    }

// ---- scalar types (src/quant/float.rs) -------------------------------------------------------

// Scalar types have one value per "block": a thread's 8 values are 8 consecutive scalars, read
// with 16-byte loads (8-byte for I8) into registers, then converted one by one.
#define SCALAR_KERNELS(T, TS)                                                                   \
    __device__ __forceinline__ void load8_##T(const u8* __restrict__ p, u8* b) {                 \
        if ((8 * (TS)) % 16 == 0) {                                                              \
            _Pragma("unroll") for (int k = 0; k < 8 * (TS) / 16; k++)                            \
                ((uint4*)b)[k] = ((const uint4*)p)[k];                                           \
        } else {                                                                                 \
            *(uint2*)b = *(const uint2*)p;                                                       \
        }                                                                                        \
    }                                                                                            \
    extern "C" __global__ void dequant_##T##_f32(const u8* __restrict__ src,                     \
                                                 float* __restrict__ dst, u64 n) {               \
        u64 stride = (u64)gridDim.x * blockDim.x;                                                \
        u64 groups = n / 8;                                                                      \
        for (u64 g = (u64)blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += stride) {      \
            __align__(16) u8 b[8 * (TS)];                                                        \
            load8_##T(src + g * 8 * (TS), b);                                                    \
            float4* d4 = (float4*)(dst + g * 8);                                                 \
            d4[0] = make_float4(dq_##T(b, 0), dq_##T(b + (TS), 0), dq_##T(b + 2 * (TS), 0),      \
                                dq_##T(b + 3 * (TS), 0));                                        \
            d4[1] = make_float4(dq_##T(b + 4 * (TS), 0), dq_##T(b + 5 * (TS), 0),                \
                                dq_##T(b + 6 * (TS), 0), dq_##T(b + 7 * (TS), 0));               \
        }                                                                                        \
        for (u64 i = groups * 8 + (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) \
            dst[i] = dq_##T(src + i * (TS), 0);                                                  \
    }                                                                                            \
    DEQUANT_KERNEL_U16(T, 1, TS, bf16, float_to_bf16_bits)                                       \
    DEQUANT_KERNEL_U16(T, 1, TS, f16, float_to_half_bits)

__device__ __forceinline__ float dq_f32(const u8* b, u32) { return ld_f32(b); }
__device__ __forceinline__ float dq_f16(const u8* b, u32) { return ld_f16(b); }
__device__ __forceinline__ float dq_bf16(const u8* b, u32) { return ld_bf16(b); }
__device__ __forceinline__ float dq_f64(const u8* b, u32) {
    return __double2float_rn(__longlong_as_double((long long)ld_u64(b)));
}
__device__ __forceinline__ float dq_i8(const u8* b, u32) { return (float)(i8)b[0]; }
__device__ __forceinline__ float dq_i16(const u8* b, u32) { return (float)(short)ld_u16(b); }
__device__ __forceinline__ float dq_i32(const u8* b, u32) { return __int2float_rn((int)ld_u32(b)); }
__device__ __forceinline__ float dq_i64(const u8* b, u32) { return __ll2float_rn((long long)ld_u64(b)); }

SCALAR_KERNELS(f32, 4)
SCALAR_KERNELS(f16, 2)
SCALAR_KERNELS(bf16, 2)
SCALAR_KERNELS(f64, 8)
SCALAR_KERNELS(i8, 1)
SCALAR_KERNELS(i16, 2)
SCALAR_KERNELS(i32, 4)
SCALAR_KERNELS(i64, 8)

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
DEQUANT_KERNELS(q4_0, 32, 18)
DEQUANT_KERNELS(q4_1, 32, 20)
DEQUANT_KERNELS(q5_0, 32, 22)
DEQUANT_KERNELS(q5_1, 32, 24)
DEQUANT_KERNELS(iq4_nl, 32, 18)
