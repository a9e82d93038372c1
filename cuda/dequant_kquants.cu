// K-quant dequantizers (Q2_K..Q6_K, IQ4_XS): see dequant.cu for the conventions.
//
// Ports of src/quant/kquants.rs, which mirrors ggml's dequantize_row_q{2..6}_K and
// dequantize_row_iq4_xs (ggml/src/ggml-quants.c); block layouts from ggml-common.h. Every type
// has 256 elements per super-block. As on the CPU, the per-sub-block scale products
// (`dl = d * sc`, `ml = dmin * m`) are formed first as f32 and the quant is multiplied by `dl`
// afterwards (`dl * q`, never `d * (sc * q)`); types with a min subtract `ml` last. With
// --fmad=false each product and difference rounds separately, as in Rust. Helpers carry a `kq_`
// prefix (each dequant family is compiled after dequant.cu, whose names they must not take).

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

// ---- octets ----------------------------------------------------------------------------------
// See DEQUANT_OCTETS in dequant.cu: v[0..4] = y[j..j+4], v[4..8] = y[j+16..j+20] with
// j = 32 s + 4 q (s: the 32-value chunk, q < 4); the same operations as the dq_ functions above
// on the same operands, with the scale fields decoded once per half (16 values) or per chunk.

// Q2_K: the halves are scale fields 2s and 2s + 1; bytes qs[32h + 16t + 4q ..] shifted by 2 jj.
__device__ __forceinline__ void dq8_q2_k(const u8* b, u32 j, float v[8]) {
    const u32 s = j >> 5, q = (j >> 2) & 3u, h = s >> 2, jj = s & 3u;
    const float d = ld_f16_a2(b + 80), dmin = ld_f16_a2(b + 82);
    _Pragma("unroll") for (u32 t = 0; t < 2; t++) {
        const u32 sc = b[2 * s + t];
        const float dl = d * (float)(sc & 0xFu);
        const float ml = dmin * (float)(sc >> 4);
        const u32 x = ld4_a4(b + 16 + 32 * h + 16 * t + 4 * q);
        _Pragma("unroll") for (u32 k = 0; k < 4; k++)
            v[4 * t + k] = dl * (float)((x >> (8 * k + 2 * jj)) & 3u) - ml;
    }
}

// Q3_K: scale fields 2s and 2s + 1; low bits from qs[32h + 16t + 4q ..], high bit from hmask.
__device__ __forceinline__ void dq8_q3_k(const u8* b, u32 j, float v[8]) {
    const u32 s = j >> 5, q = (j >> 2) & 3u, h = s >> 2, jj = s & 3u;
    const float d = ld_f16_a2(b + 108);
    _Pragma("unroll") for (u32 t = 0; t < 2; t++) {
        const float dl = d * (float)kq_q3_k_scale(b + 96, 2 * s + t);
        const u32 x = ld4_a2(b + 32 + 32 * h + 16 * t + 4 * q);
        const u32 hm = ld4_a2(b + 16 * t + 4 * q);
        _Pragma("unroll") for (u32 k = 0; k < 4; k++) {
            const int low = (int)((x >> (8 * k + 2 * jj)) & 3u);
            const int qv = low - (((hm >> (8 * k + 4 * h + jj)) & 1u) != 0 ? 0 : 4);
            v[4 * t + k] = dl * (float)qv;
        }
    }
}

// Q4_K: one (sc, m) for the chunk; bytes qs[32g + 4q ..] and qs[32g + 16 + 4q ..], nibble t.
__device__ __forceinline__ void dq8_q4_k(const u8* b, u32 j, float v[8]) {
    const u32 s = j >> 5, q = (j >> 2) & 3u, g = s >> 1, sh = 4 * (s & 1u);
    u32 sc, m;
    kq_scale_min_k4(b + 4, s, &sc, &m);
    const float d = ld_f16_a2(b), dmin = ld_f16_a2(b + 2);
    const float dl = d * (float)sc;
    const float ml = dmin * (float)m;
    _Pragma("unroll") for (u32 t = 0; t < 2; t++) {
        const u32 x = ld4_a4(b + 16 + 32 * g + 16 * t + 4 * q);
        _Pragma("unroll") for (u32 k = 0; k < 4; k++)
            v[4 * t + k] = dl * (float)((x >> (8 * k + sh)) & 0xFu) - ml;
    }
}

// Q5_K: as Q4_K, plus bit s of qh[16t + 4q ..].
__device__ __forceinline__ void dq8_q5_k(const u8* b, u32 j, float v[8]) {
    const u32 s = j >> 5, q = (j >> 2) & 3u, g = s >> 1, sh = 4 * (s & 1u);
    u32 sc, m;
    kq_scale_min_k4(b + 4, s, &sc, &m);
    const float d = ld_f16_a2(b), dmin = ld_f16_a2(b + 2);
    const float dl = d * (float)sc;
    const float ml = dmin * (float)m;
    _Pragma("unroll") for (u32 t = 0; t < 2; t++) {
        const u32 x = ld4_a4(b + 48 + 32 * g + 16 * t + 4 * q);
        const u32 hb = ld4_a4(b + 16 + 16 * t + 4 * q);
        _Pragma("unroll") for (u32 k = 0; k < 4; k++) {
            const u32 qv = ((x >> (8 * k + sh)) & 0xFu) | (((hb >> (8 * k + s)) & 1u) << 4);
            v[4 * t + k] = dl * (float)qv - ml;
        }
    }
}

// Q6_K: scales 2s and 2s + 1; low 4 bits from ql[64h + 32(kk & 1) + 16t + 4q ..] (nibble kk / 2),
// high 2 bits from qh[32h + 16t + 4q ..] >> 2kk.
__device__ __forceinline__ void dq8_q6_k(const u8* b, u32 j, float v[8]) {
    const u32 s = j >> 5, q = (j >> 2) & 3u, h = s >> 2, kk = s & 3u;
    const float d = ld_f16_a2(b + 208);
    _Pragma("unroll") for (u32 t = 0; t < 2; t++) {
        const float ds = d * (float)(i8)b[192 + 2 * s + t];
        const u32 a = ld4_a2(b + 64 * h + 32 * (kk & 1u) + 16 * t + 4 * q);
        const u32 hh = ld4_a2(b + 128 + 32 * h + 16 * t + 4 * q);
        _Pragma("unroll") for (u32 k = 0; k < 4; k++) {
            const u32 lo = (a >> (8 * k + 4 * (kk >> 1))) & 0xFu;
            const u32 hi = (hh >> (8 * k + 2 * kk)) & 3u;
            v[4 * t + k] = ds * (float)((int)(lo | (hi << 4)) - 32);
        }
    }
}

// IQ4_XS: one scale for the chunk; qs[16s + 4q ..]: low nibbles first half, high the second.
__device__ __forceinline__ void dq8_iq4_xs(const u8* b, u32 j, float v[8]) {
    const u32 s = j >> 5, q = (j >> 2) & 3u;
    const float d = ld_f16_a2(b);
    const u32 scales_h = *(const u16*)(b + 2);
    const u32 lo = (b[4 + (s >> 1)] >> (4 * (s & 1u))) & 0xFu;
    const u32 hi = (scales_h >> (2 * s)) & 3u;
    const float dl = d * (float)((int)(lo | (hi << 4)) - 32);
    const u32 x = ld4_a4(b + 8 + 16 * s + 4 * q);
    _Pragma("unroll") for (u32 k = 0; k < 4; k++) {
        v[k] = dl * (float)kvalues_iq4nl[(x >> (8 * k)) & 0xFu];
        v[4 + k] = dl * (float)kvalues_iq4nl[(x >> (8 * k + 4)) & 0xFu];
    }
}

DEQUANT_KERNELS8(q2_k, 256, 84, 4)
DEQUANT_KERNELS8(q3_k, 256, 110, 2)
DEQUANT_KERNELS8(q4_k, 256, 144, 4)
DEQUANT_KERNELS8(q5_k, 256, 176, 4)
DEQUANT_KERNELS8(q6_k, 256, 210, 2)
DEQUANT_KERNELS8(iq4_xs, 256, 136, 4)
