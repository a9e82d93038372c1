// K-quant dequantizers (Q2_K..Q6_K, IQ4_XS): see dequant.cu for the conventions.
//
// Ports of src/quant/kquants.rs, which mirrors ggml's dequantize_row_q{2..6}_K and
// dequantize_row_iq4_xs (ggml/src/ggml-quants.c); block layouts from ggml-common.h. Every type
// has 256 elements per super-block. As on the CPU, the per-sub-block scale products
// (`dl = d * sc`, `ml = dmin * m`) are formed first as f32 and the quant is multiplied by `dl`
// afterwards (`dl * q`, never `d * (sc * q)`); types with a min subtract `ml` last. With
// --fmad=false each product and difference rounds separately, as in Rust. Helpers carry a `kq_`
// prefix: this file shares one translation unit with the other dequant families.

// ---- Q2_K ------------------------------------------------------------------------------------
// kquants.rs `dequant_q2_k`, ggml `dequantize_row_q2_K`.
// Block (84 bytes): scales[16] @0 (low nibble scale, high nibble min), qs[64] @16,
// f16 d @80, f16 dmin @82.
// Element e = 128h + 32j + 16t + l (l < 16): x = qs[32h + 16t + l], q = (x >> 2j) & 3,
// s = scales[8h + 2j + t] = scales[e / 16]; y = (d * (s & 0xF)) * q - (dmin * (s >> 4)).
__device__ __forceinline__ float dq_q2_k(const u8* b, u32 e) {
    const u32 h = e >> 7, j = (e >> 5) & 3u, t = (e >> 4) & 1u, l = e & 15u;
    const u8 s = b[e >> 4];
    const float d = ld_f16(b + 80);
    const float dmin = ld_f16(b + 82);
    const float dl = d * (float)(s & 0xFu);
    const float ml = dmin * (float)(s >> 4);
    const u32 x = b[16 + 32 * h + 16 * t + l];
    const u32 q = (x >> (2 * j)) & 3u;
    return dl * (float)q - ml;
}

// ---- Q3_K ------------------------------------------------------------------------------------
// kquants.rs `dequant_q3_k` / `q3_k_scales`, ggml `dequantize_row_q3_K`.
// Block (110 bytes): hmask[32] @0, qs[64] @32, scales[12] @96 (sixteen packed 6-bit scales),
// f16 d @108.
// Scale i (0..16): lo = i < 8 ? sc[i] & 0xF : sc[i-8] >> 4, hi = (sc[8 + i%4] >> 2*(i/4)) & 3,
// scale = (lo | hi << 4) - 32.
// Element e = 128h + 32j + l (l < 32): x = qs[32h + l], low = (x >> 2j) & 3,
// q = low - (hmask[l] bit (4h + j) set ? 0 : 4); y = (d * scale[e / 16]) * q.
__device__ __forceinline__ int kq_q3_k_scale(const u8* s, u32 i) {
    const u32 lo = i < 8 ? (s[i] & 0xFu) : (s[i - 8] >> 4);
    const u32 hi = (s[8 + (i & 3u)] >> (2 * (i >> 2))) & 3u;
    return (int)(lo | (hi << 4)) - 32;
}
__device__ __forceinline__ float dq_q3_k(const u8* b, u32 e) {
    const u32 h = e >> 7, j = (e >> 5) & 3u, l = e & 31u;
    const float d = ld_f16(b + 108);
    const float dl = d * (float)kq_q3_k_scale(b + 96, e >> 4);
    const u32 x = b[32 + 32 * h + l];
    const int low = (int)((x >> (2 * j)) & 3u);
    const int q = low - ((b[l] & (1u << (4 * h + j))) != 0 ? 0 : 4);
    return dl * (float)q;
}

// ---- Q4_K / Q5_K shared scales ---------------------------------------------------------------
// kquants.rs `scale_min_k4`, ggml `get_scale_min_k4`, for sub-block i (0..8) of the 12 packed
// bytes s: i < 4: sc = s[i] & 63, m = s[i+4] & 63;
// i >= 4: sc = (s[i+4] & 0xF) | (s[i-4] >> 6) << 4, m = (s[i+4] >> 4) | (s[i] >> 6) << 4.
__device__ __forceinline__ void kq_scale_min_k4(const u8* s, u32 i, u32* sc, u32* m) {
    if (i < 4) {
        *sc = s[i] & 63u;
        *m = s[i + 4] & 63u;
    } else {
        *sc = (s[i + 4] & 0xFu) | ((u32)(s[i - 4] >> 6) << 4);
        *m = (u32)(s[i + 4] >> 4) | ((u32)(s[i] >> 6) << 4);
    }
}

// ---- Q4_K ------------------------------------------------------------------------------------
// kquants.rs `dequant_q4_k`, ggml `dequantize_row_q4_K`.
// Block (144 bytes): f16 d @0, f16 dmin @2, scales[12] @4, qs[128] @16.
// Element e = 64g + 32t + l (l < 32): x = qs[32g + l], q = t ? x >> 4 : x & 0xF,
// (sc, m) = get_scale_min_k4(2g + t = e / 32); y = (d * sc) * q - (dmin * m).
__device__ __forceinline__ float dq_q4_k(const u8* b, u32 e) {
    const u32 g = e >> 6, t = (e >> 5) & 1u, l = e & 31u;
    u32 sc, m;
    kq_scale_min_k4(b + 4, e >> 5, &sc, &m);
    const float d = ld_f16(b);
    const float dmin = ld_f16(b + 2);
    const float dl = d * (float)sc;
    const float ml = dmin * (float)m;
    const u32 x = b[16 + 32 * g + l];
    const u32 q = t ? (x >> 4) : (x & 0xFu);
    return dl * (float)q - ml;
}

// ---- Q5_K ------------------------------------------------------------------------------------
// kquants.rs `dequant_q5_k`, ggml `dequantize_row_q5_K`.
// Block (176 bytes): f16 d @0, f16 dmin @2, scales[12] @4, qh[32] @16, qs[128] @48.
// Element e = 64g + 32t + l (l < 32): x = qs[32g + l], q = (t ? x >> 4 : x & 0xF)
// | (qh[l] bit (2g + t) set ? 16 : 0), (sc, m) = get_scale_min_k4(e / 32);
// y = (d * sc) * q - (dmin * m).
__device__ __forceinline__ float dq_q5_k(const u8* b, u32 e) {
    const u32 g = e >> 6, t = (e >> 5) & 1u, l = e & 31u;
    const u32 is = e >> 5;  // 2g + t
    u32 sc, m;
    kq_scale_min_k4(b + 4, is, &sc, &m);
    const float d = ld_f16(b);
    const float dmin = ld_f16(b + 2);
    const float dl = d * (float)sc;
    const float ml = dmin * (float)m;
    const u32 x = b[48 + 32 * g + l];
    const u32 hbit = (b[16 + l] & (1u << is)) != 0 ? 16u : 0u;
    const u32 q = (t ? (x >> 4) : (x & 0xFu)) | hbit;
    return dl * (float)q - ml;
}

// ---- Q6_K ------------------------------------------------------------------------------------
// kquants.rs `dequant_q6_k`, ggml `dequantize_row_q6_K`.
// Block (210 bytes): ql[128] @0, qh[64] @128, i8 scales[16] @192, f16 d @208.
// Element e = 128h + 32k + l (l < 32): low 4 bits from ql[64h + l + 32*(k & 1)] (low nibble for
// k < 2, high nibble for k >= 2), high 2 bits (qh[32h + l] >> 2k) & 3, q = (lo | hi << 4) - 32;
// y = (d * scales[8h + 2k + l/16]) * q (scale index = e / 16).
__device__ __forceinline__ float dq_q6_k(const u8* b, u32 e) {
    const u32 h = e >> 7, k = (e >> 5) & 3u, l = e & 31u;
    const float d = ld_f16(b + 208);
    const float ds = d * (float)(i8)b[192 + (e >> 4)];
    const u32 a = b[64 * h + l + 32 * (k & 1u)];
    const u32 lo = k < 2 ? (a & 0xFu) : (a >> 4);
    const u32 hi = (b[128 + 32 * h + l] >> (2 * k)) & 3u;
    const int q = (int)(lo | (hi << 4)) - 32;
    return ds * (float)q;
}

// ---- IQ4_XS ----------------------------------------------------------------------------------
// kquants.rs `dequant_iq4_xs`, ggml `dequantize_row_iq4_xs`.
// Block (136 bytes): f16 d @0, u16 scales_h @2, scales_l[4] @4, qs[128] @8.
// Sub-block ib = e / 32: ls = ((scales_l[ib/2] >> 4*(ib%2)) & 0xF) | ((scales_h >> 2ib) & 3) << 4,
// dl = d * (ls - 32). Element e = 32ib + 16u + l (l < 16): x = qs[16ib + l],
// y = dl * kvalues_iq4nl[u ? x >> 4 : x & 0xF].
__device__ __forceinline__ float dq_iq4_xs(const u8* b, u32 e) {
    const u32 ib = e >> 5, u = (e >> 4) & 1u, l = e & 15u;
    const float d = ld_f16(b);
    const u32 scales_h = ld_u16(b + 2);
    const u32 lo = (b[4 + (ib >> 1)] >> (4 * (ib & 1u))) & 0xFu;
    const u32 hi = (scales_h >> (2 * ib)) & 3u;
    const float dl = d * (float)((int)(lo | (hi << 4)) - 32);
    const u32 x = b[8 + 16 * ib + l];
    const u32 q = u ? (x >> 4) : (x & 0xFu);
    return dl * (float)kvalues_iq4nl[q];
}

DEQUANT_KERNELS_STAGED(q2_k, 256, 84)
DEQUANT_KERNELS_STAGED(q3_k, 256, 110)
DEQUANT_KERNELS_STAGED(q4_k, 256, 144)
DEQUANT_KERNELS_STAGED(q5_k, 256, 176)
DEQUANT_KERNELS(q6_k, 256, 210)
DEQUANT_KERNELS(iq4_xs, 256, 136)
