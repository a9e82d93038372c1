// Scalar types and 32-element blocks: the kernels of the dequant_scalar family (compiled after
// dequant.cu, whose macros and conventions they use).

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

// Octets (see DEQUANT_OCTETS): v[0..4] = y[j..j+4], v[4..8] = y[j+16..j+20], j in {0, 4, 8, 12};
// the same operations as dq_ above on the same operands.
__device__ __forceinline__ void dq8_q8_0(const u8* b, u32 j, float v[8]) {
    const float d = ld_f16_a2(b);
    const u32 x0 = ld4_a2(b + 2 + j), x1 = ld4_a2(b + 18 + j);
    _Pragma("unroll") for (u32 k = 0; k < 4; k++) {
        v[k] = (float)(i8)byte_of(x0, k) * d;
        v[4 + k] = (float)(i8)byte_of(x1, k) * d;
    }
}
// Values j..j+4 are the low nibbles of qs[j..j+4], values j+16.. their high nibbles.
__device__ __forceinline__ void dq8_q4_0(const u8* b, u32 j, float v[8]) {
    const float d = ld_f16_a2(b);
    const u32 x = ld4_a2(b + 2 + j);
    _Pragma("unroll") for (u32 k = 0; k < 4; k++) {
        v[k] = (float)((int)((x >> (8 * k)) & 0xFu) - 8) * d;
        v[4 + k] = (float)((int)((x >> (8 * k + 4)) & 0xFu) - 8) * d;
    }
}
__device__ __forceinline__ void dq8_q4_1(const u8* b, u32 j, float v[8]) {
    const float d = ld_f16_a2(b), m = ld_f16_a2(b + 2);
    const u32 x = ld4_a4(b + 4 + j);
    _Pragma("unroll") for (u32 k = 0; k < 4; k++) {
        v[k] = (float)((x >> (8 * k)) & 0xFu) * d + m;
        v[4 + k] = (float)((x >> (8 * k + 4)) & 0xFu) * d + m;
    }
}
__device__ __forceinline__ void dq8_q5_0(const u8* b, u32 j, float v[8]) {
    const float d = ld_f16_a2(b);
    const u32 qh = ld4_a2(b + 2), x = ld4_a2(b + 6 + j);
    _Pragma("unroll") for (u32 k = 0; k < 4; k++) {
        const u32 lo = ((x >> (8 * k)) & 0xFu) | (((qh >> (j + k)) & 1u) << 4);
        const u32 hi = ((x >> (8 * k + 4)) & 0xFu) | (((qh >> (j + 16 + k)) & 1u) << 4);
        v[k] = (float)((int)lo - 16) * d;
        v[4 + k] = (float)((int)hi - 16) * d;
    }
}
__device__ __forceinline__ void dq8_q5_1(const u8* b, u32 j, float v[8]) {
    const float d = ld_f16_a2(b), m = ld_f16_a2(b + 2);
    const u32 qh = ld4_a4(b + 4), x = ld4_a4(b + 8 + j);
    _Pragma("unroll") for (u32 k = 0; k < 4; k++) {
        const u32 lo = ((x >> (8 * k)) & 0xFu) | (((qh >> (j + k)) & 1u) << 4);
        const u32 hi = ((x >> (8 * k + 4)) & 0xFu) | (((qh >> (j + 16 + k)) & 1u) << 4);
        v[k] = (float)lo * d + m;
        v[4 + k] = (float)hi * d + m;
    }
}
__device__ __forceinline__ void dq8_iq4_nl(const u8* b, u32 j, float v[8]) {
    const float d = ld_f16_a2(b);
    const u32 x = ld4_a2(b + 2 + j);
    _Pragma("unroll") for (u32 k = 0; k < 4; k++) {
        v[k] = d * (float)kvalues_iq4nl[(x >> (8 * k)) & 0xFu];
        v[4 + k] = d * (float)kvalues_iq4nl[(x >> (8 * k + 4)) & 0xFu];
    }
}

DEQUANT_KERNELS8(q8_0, 32, 34, 2)
DEQUANT_KERNELS8(q4_0, 32, 18, 2)
DEQUANT_KERNELS8(q4_1, 32, 20, 4)
DEQUANT_KERNELS8(q5_0, 32, 22, 2)
DEQUANT_KERNELS8(q5_1, 32, 24, 4)
DEQUANT_KERNELS8(iq4_nl, 32, 18, 2)
