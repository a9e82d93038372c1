// Dequantization kernels: every GGML type glmdiff's CPU code dequantizes (src/quant), to f32
// bit-exact against it, and to bf16 / f16 rounded to nearest even from that f32.
//
// One device function per type returns element `j` of a block: `float dq_<type>(const u8* blk,
// u32 j)`, a port of the CPU formula with the same operations in the same order (the sources
// cite ggml's `dequantize_row_*` in ggml/src/ggml-quants.c and gguf-py's quants.py). With
// --fmad=false every product and sum rounds as on the CPU. DEQUANT_KERNELS(type, QK, TS) makes
// the three kernels `dequant_<type>_{f32,bf16,f16}(src, dst, n)`: `src` holds whole blocks of
// TS bytes, `dst` gets n = blocks * QK values; 64-bit indices, grid-stride loops (consecutive
// threads write consecutive outputs).

#define DEQUANT_KERNELS(T, QK, TS)                                                              \
    extern "C" __global__ void dequant_##T##_f32(const u8* __restrict__ src,                     \
                                                 float* __restrict__ dst, u64 n) {               \
        u64 stride = (u64)gridDim.x * blockDim.x;                                                \
        for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)            \
            dst[i] = dq_##T(src + (i / (QK)) * (TS), (u32)(i % (QK)));                           \
    }                                                                                            \
    extern "C" __global__ void dequant_##T##_bf16(const u8* __restrict__ src,                    \
                                                  u16* __restrict__ dst, u64 n) {                \
        u64 stride = (u64)gridDim.x * blockDim.x;                                                \
        for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)            \
            dst[i] = float_to_bf16_bits(dq_##T(src + (i / (QK)) * (TS), (u32)(i % (QK))));       \
    }                                                                                            \
    extern "C" __global__ void dequant_##T##_f16(const u8* __restrict__ src,                     \
                                                 u16* __restrict__ dst, u64 n) {                 \
        u64 stride = (u64)gridDim.x * blockDim.x;                                                \
        for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)            \
            dst[i] = float_to_half_bits(dq_##T(src + (i / (QK)) * (TS), (u32)(i % (QK))));       \
    }

// ---- scalar types (src/quant/float.rs) -------------------------------------------------------

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

DEQUANT_KERNELS(f32, 1, 4)
DEQUANT_KERNELS(f16, 1, 2)
DEQUANT_KERNELS(bf16, 1, 2)
DEQUANT_KERNELS(f64, 1, 8)
DEQUANT_KERNELS(i8, 1, 1)
DEQUANT_KERNELS(i16, 1, 2)
DEQUANT_KERNELS(i32, 1, 4)
DEQUANT_KERNELS(i64, 1, 8)

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
