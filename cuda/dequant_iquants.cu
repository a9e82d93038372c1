// i-quant, ternary and FP4 dequantizers: see dequant.cu for the conventions.
//
// Ports of src/quant/iquants.rs (IQ2_XXS .. IQ1_M) and src/quant/small.rs (TQ1_0, TQ2_0, MXFP4,
// NVFP4), which mirror ggml's `dequantize_row_*` in ggml/src/ggml-quants.c. Each dq_ function
// returns element j of one block with the CPU code's f32 operations on the same operands in the
// same order (left to right, every product and sum rounded on its own: --fmad=false).
//
// Index notation for the 256-value super-blocks: ib = j / 32 (sub-block of 32 values, one scale
// field), l = (j % 32) / 8 (group of 8 values: one grid entry and one sign byte), k = j % 8
// (value within the group: byte k of the 8-byte grid entry, sign bit kmask_iq2xs[k]).

// ---- shared pieces (iquants.rs) ------------------------------------------------------------

// Byte k (0..7) of a little-endian u64 grid entry (Rust: `grid.to_le_bytes()[k]`).
__device__ __forceinline__ u32 grid_byte(u64 g, u32 k) { return (u32)((g >> (8 * k)) & 0xFFu); }

// iquants.rs `signed_group` for one value: v = db * grid[k] (u8 -> f32), negated when bit k of
// the sign byte is set (ggml: `db * grid[j] * (signs & kmask_iq2xs[j] ? -1.f : 1.f)`; Rust
// negates, which is the same exact operation, and so do we).
__device__ __forceinline__ float signed_value(float db, u64 grid, u32 signs, u32 k) {
    float v = db * (float)grid_byte(grid, k);
    return (signs & kmask_iq2xs[k]) ? -v : v;
}

// iquants.rs `half_step_scale`: `d * (0.5 + scale as f32) * factor` = (d * (0.5f + s)) * factor.
__device__ __forceinline__ float half_step_scale(float d, u32 scale, float factor) {
    return d * (0.5f + (float)scale) * factor;
}

// iquants.rs `iq1_group` for one value: dl * ((grid[k] as i8) as f32 + delta).
__device__ __forceinline__ float iq1_value(float dl, float delta, u64 grid, u32 k) {
    return dl * ((float)(i8)(u8)grid_byte(grid, k) + delta);
}

// iquants.rs `iq1_delta`: -IQ1S_DELTA when the sign bit is set, else IQ1S_DELTA.
__device__ __forceinline__ float iq1_delta(bool negative) {
    return negative ? -IQ1S_DELTA : IQ1S_DELTA;
}

// ---- IQ2_XXS ----------------------------------------------------------------------------------
// iquants.rs `dequant_iq2_xxs`, ggml `dequantize_row_iq2_xxs`. Block (66 bytes): f16 d, then per
// 32 values 8 bytes: 4 grid indices (one per group), then a u32 aux = 4 x 7-bit sign indices
// (bits 7l..7l+6) | 4-bit scale << 28. db = d * (0.5 + (aux >> 28)) * 0.25;
// y = ±db * iq2xxs_grid[q[l]] byte k, sign ksigns_iq2xs[(aux >> 7l) & 127] bit k.
__device__ __forceinline__ float dq_iq2_xxs(const u8* b, u32 j) {
    const u32 ib = j / 32, l = (j % 32) / 8, k = j % 8;
    const float d = ld_f16(b);
    const u8* q = b + 2 + 8 * ib;
    const u32 aux = ld_u32(q + 4);
    const float db = half_step_scale(d, aux >> 28, 0.25f);
    const u32 signs = ksigns_iq2xs[(aux >> (7 * l)) & 127u];
    return signed_value(db, iq2xxs_grid[q[l]], signs, k);
}

// ---- IQ2_XS -----------------------------------------------------------------------------------
// iquants.rs `dequant_iq2_xs`, ggml `dequantize_row_iq2_xs`. Block (74 bytes): f16 d, u16 qs[32]
// (bytes 2..66: 9-bit grid index | 7-bit sign index << 9, one per group), scales[8] (bytes
// 66..74: per 32 values, low nibble for groups 0-1, high nibble for groups 2-3).
// y = ±db[l/2] * iq2xs_grid[v & 511] byte k, sign ksigns_iq2xs[v >> 9] bit k.
__device__ __forceinline__ float dq_iq2_xs(const u8* b, u32 j) {
    const u32 ib = j / 32, l = (j % 32) / 8, k = j % 8;
    const float d = ld_f16(b);
    const u32 sc = b[66 + ib];
    const float db = half_step_scale(d, l < 2 ? (sc & 0xFu) : (sc >> 4), 0.25f);
    const u32 v = ld_u16(b + 2 + 8 * ib + 2 * l);
    const u32 signs = ksigns_iq2xs[v >> 9];
    return signed_value(db, iq2xs_grid[v & 511u], signs, k);
}

// ---- IQ2_S ------------------------------------------------------------------------------------
// iquants.rs `dequant_iq2_s`, ggml `dequantize_row_iq2_s`. Block (82 bytes): f16 d, qs[32]
// (bytes 2..34: low 8 bits of the grid index, one per group), signs[32] (bytes 34..66: one sign
// byte per group), qh[8] (bytes 66..74: bits 2l..2l+1 are index bits 8-9 of group l), scales[8]
// (bytes 74..82, nibbles as IQ2_XS). idx = qs[4ib+l] | ((qh[ib] << (8 - 2l)) & 0x300).
__device__ __forceinline__ float dq_iq2_s(const u8* b, u32 j) {
    const u32 ib = j / 32, l = (j % 32) / 8, k = j % 8;
    const float d = ld_f16(b);
    const u32 sc = b[74 + ib];
    const float db = half_step_scale(d, l < 2 ? (sc & 0xFu) : (sc >> 4), 0.25f);
    const u32 h = b[66 + ib];
    const u32 idx = (u32)b[2 + 4 * ib + l] | ((h << (8 - 2 * l)) & 0x300u);
    const u32 signs = b[34 + 4 * ib + l];
    return signed_value(db, iq2s_grid[idx], signs, k);
}

// ---- IQ3_XXS ----------------------------------------------------------------------------------
// iquants.rs `dequant_iq3_xxs`, ggml `dequantize_row_iq3_xxs`. Block (98 bytes): f16 d, qs[64]
// (bytes 2..66: two 4-value grid indices per group), then 8 u32 (bytes 66..98, one per 32
// values) of 4 x 7-bit sign indices | 4-bit scale << 28. db = d * (0.5 + (aux >> 28)) * 0.5;
// values 0-3 of group l come from iq3xxs_grid[qs[8ib+2l]], values 4-7 from
// iq3xxs_grid[qs[8ib+2l+1]] (Rust: the two u32 joined as lo | hi << 32).
__device__ __forceinline__ float dq_iq3_xxs(const u8* b, u32 j) {
    const u32 ib = j / 32, l = (j % 32) / 8, k = j % 8;
    const float d = ld_f16(b);
    const u32 aux = ld_u32(b + 66 + 4 * ib);
    const float db = half_step_scale(d, aux >> 28, 0.5f);
    const u32 signs = ksigns_iq2xs[(aux >> (7 * l)) & 127u];
    const u8* q2 = b + 2 + 8 * ib + 2 * l;
    const u64 grid = (u64)iq3xxs_grid[q2[0]] | ((u64)iq3xxs_grid[q2[1]] << 32);
    return signed_value(db, grid, signs, k);
}

// ---- IQ3_S ------------------------------------------------------------------------------------
// iquants.rs `dequant_iq3_s`, ggml `dequantize_row_iq3_s`. Block (110 bytes): f16 d, qs[64]
// (bytes 2..66: two low-8-bit grid indices per group), qh[8] (bytes 66..74: bit 2l is index
// bit 8 of the first index of group l, bit 2l+1 of the second), signs[32] (bytes 74..106, one
// per group), scales[4] (bytes 106..110: nibble ib%2 of byte ib/2). db = d * (1 + 2*sc) with the
// integer product converted once.
__device__ __forceinline__ float dq_iq3_s(const u8* b, u32 j) {
    const u32 ib = j / 32, l = (j % 32) / 8, k = j % 8;
    const float d = ld_f16(b);
    const u32 sc = ((u32)b[106 + ib / 2] >> (4 * (ib % 2))) & 0xFu;
    const float db = d * (float)(1u + 2u * sc);
    const u32 h = b[66 + ib];
    const u8* q2 = b + 2 + 8 * ib + 2 * l;
    const u32 lo = iq3s_grid[(u32)q2[0] | ((h << (8 - 2 * l)) & 256u)];
    const u32 hi = iq3s_grid[(u32)q2[1] | ((h << (7 - 2 * l)) & 256u)];
    const u32 signs = b[74 + 4 * ib + l];
    return signed_value(db, (u64)lo | ((u64)hi << 32), signs, k);
}

// ---- IQ1_S ------------------------------------------------------------------------------------
// iquants.rs `dequant_iq1_s`, ggml `dequantize_row_iq1_s`. Block (50 bytes): f16 d, qs[32]
// (bytes 2..34: low 8 bits of an 11-bit grid index per group), u16 qh[8] (bytes 34..50, one per
// 32 values: bits 3l..3l+2 are index bits 8-10 of group l, bits 12-14 the scale s, bit 15 the
// offset sign). dl = d * (2s + 1) (integer converted once); y = dl * (grid[k] as i8 + delta).
__device__ __forceinline__ float dq_iq1_s(const u8* b, u32 j) {
    const u32 ib = j / 32, l = (j % 32) / 8, k = j % 8;
    const float d = ld_f16(b);
    const u32 h = ld_u16(b + 34 + 2 * ib);
    const float dl = d * (float)(2u * ((h >> 12) & 7u) + 1u);
    const float delta = iq1_delta((h & 0x8000u) != 0);
    const u32 idx = (u32)b[2 + 4 * ib + l] | (((h >> (3 * l)) & 7u) << 8);
    return iq1_value(dl, delta, iq1s_grid[idx], k);
}

// ---- IQ1_M ------------------------------------------------------------------------------------
// iquants.rs `dequant_iq1_m`, ggml `dequantize_row_iq1_m`. Block (56 bytes): qs[32] (bytes 0..32,
// low 8 index bits per group), qh[16] (bytes 32..48: nibble l%2 of byte 2ib + l/2 holds group l's
// index bits 8-10 and, in bit 3, its offset sign), scales[8] = u16 sc[4] (bytes 48..56): 3-bit
// scales, 4 per word (sub-block ib uses sc[ib/2] >> 6(ib%2): bits 0-2 for values 0-15, bits 3-5
// for 16-31), and the f16 d from the top nibbles:
// (sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) | (sc[3] & 0xf000).
__device__ __forceinline__ float dq_iq1_m(const u8* b, u32 j) {
    const u32 ib = j / 32, l = (j % 32) / 8, k = j % 8;
    const u32 sc0 = ld_u16(b + 48), sc1 = ld_u16(b + 50), sc2 = ld_u16(b + 52),
              sc3 = ld_u16(b + 54);
    const u16 d_bits =
        (u16)((sc0 >> 12) | ((sc1 >> 8) & 0x00F0u) | ((sc2 >> 4) & 0x0F00u) | (sc3 & 0xF000u));
    const float d = half_bits_to_float(d_bits);
    const u32 s = (u32)ld_u16(b + 48 + 2 * (ib / 2)) >> (6 * (ib % 2));
    const float dl = l < 2 ? d * (float)(2u * (s & 7u) + 1u) : d * (float)(2u * ((s >> 3) & 7u) + 1u);
    const u32 nib = ((u32)b[32 + 2 * ib + l / 2] >> (4 * (l % 2))) & 0xFu;
    const u32 idx = (u32)b[4 * ib + l] | ((nib & 7u) << 8);
    return iq1_value(dl, iq1_delta((nib & 8u) != 0), iq1s_grid[idx], k);
}

// ---- octets (see DEQUANT_OCTETS in dequant.cu) --------------------------------------------------
// Lane (s, q) makes values 4q..4q+4 of groups grp = q/2 (first half) and 2 + q/2 (second half)
// of sub-block s: bytes 4(q%2) .. 4(q%2)+4 of each group's grid entry, sign bits 4(q%2) + k.
// The same operations as the dq_ functions above (kmask_iq2xs[k] is 1 << k).

// The value of byte k of a 4-byte grid half `g4`, sign bit `bit` of `signs`: db * grid, negated.
__device__ __forceinline__ float sv4(float db, u32 g4, u32 k, u32 signs, u32 bit) {
    const float v = db * (float)byte_of(g4, k);
    return ((signs >> bit) & 1u) ? -v : v;
}
__device__ __forceinline__ u32 grid_half(u64 g, u32 upper) {
    return upper ? (u32)(g >> 32) : (u32)g;
}

__device__ __forceinline__ void dq8_iq2_xxs(const u8* b, u32 j, float v[8]) {
    const u32 s = j >> 5, q = (j >> 2) & 3u, up = q & 1u;
    const float d = ld_f16_a2(b);
    const u8* qp = b + 2 + 8 * s;
    const u32 aux = ld4_a2(qp + 4);
    const float db = half_step_scale(d, aux >> 28, 0.25f);
    _Pragma("unroll") for (u32 t = 0; t < 2; t++) {
        const u32 grp = 2 * t + (q >> 1);
        const u32 signs = ksigns_iq2xs[(aux >> (7 * grp)) & 127u];
        const u32 g4 = grid_half(iq2xxs_grid[qp[grp]], up);
        _Pragma("unroll") for (u32 k = 0; k < 4; k++) v[4 * t + k] = sv4(db, g4, k, signs, 4 * up + k);
    }
}

__device__ __forceinline__ void dq8_iq2_xs(const u8* b, u32 j, float v[8]) {
    const u32 s = j >> 5, q = (j >> 2) & 3u, up = q & 1u;
    const float d = ld_f16_a2(b);
    const u32 sc = b[66 + s];
    _Pragma("unroll") for (u32 t = 0; t < 2; t++) {
        const u32 grp = 2 * t + (q >> 1);
        const float db = half_step_scale(d, t == 0 ? (sc & 0xFu) : (sc >> 4), 0.25f);
        const u32 vv = *(const u16*)(b + 2 + 8 * s + 2 * grp);
        const u32 signs = ksigns_iq2xs[vv >> 9];
        const u32 g4 = grid_half(iq2xs_grid[vv & 511u], up);
        _Pragma("unroll") for (u32 k = 0; k < 4; k++) v[4 * t + k] = sv4(db, g4, k, signs, 4 * up + k);
    }
}

__device__ __forceinline__ void dq8_iq2_s(const u8* b, u32 j, float v[8]) {
    const u32 s = j >> 5, q = (j >> 2) & 3u, up = q & 1u;
    const float d = ld_f16_a2(b);
    const u32 sc = b[74 + s];
    const u32 h = b[66 + s];
    _Pragma("unroll") for (u32 t = 0; t < 2; t++) {
        const u32 grp = 2 * t + (q >> 1);
        const float db = half_step_scale(d, t == 0 ? (sc & 0xFu) : (sc >> 4), 0.25f);
        const u32 idx = (u32)b[2 + 4 * s + grp] | ((h << (8 - 2 * grp)) & 0x300u);
        const u32 signs = b[34 + 4 * s + grp];
        const u32 g4 = grid_half(iq2s_grid[idx], up);
        _Pragma("unroll") for (u32 k = 0; k < 4; k++) v[4 * t + k] = sv4(db, g4, k, signs, 4 * up + k);
    }
}

// IQ3: a group's values 0-3 and 4-7 are two separate 4-byte grid entries: one lookup per half.
__device__ __forceinline__ void dq8_iq3_xxs(const u8* b, u32 j, float v[8]) {
    const u32 s = j >> 5, q = (j >> 2) & 3u, up = q & 1u;
    const float d = ld_f16_a2(b);
    const u32 aux = ld4_a2(b + 66 + 4 * s);
    const float db = half_step_scale(d, aux >> 28, 0.5f);
    _Pragma("unroll") for (u32 t = 0; t < 2; t++) {
        const u32 grp = 2 * t + (q >> 1);
        const u32 signs = ksigns_iq2xs[(aux >> (7 * grp)) & 127u];
        const u32 g4 = iq3xxs_grid[b[2 + 8 * s + 2 * grp + up]];
        _Pragma("unroll") for (u32 k = 0; k < 4; k++) v[4 * t + k] = sv4(db, g4, k, signs, 4 * up + k);
    }
}

__device__ __forceinline__ void dq8_iq3_s(const u8* b, u32 j, float v[8]) {
    const u32 s = j >> 5, q = (j >> 2) & 3u, up = q & 1u;
    const float d = ld_f16_a2(b);
    const u32 sc = ((u32)b[106 + s / 2] >> (4 * (s % 2))) & 0xFu;
    const float db = d * (float)(1u + 2u * sc);
    const u32 h = b[66 + s];
    _Pragma("unroll") for (u32 t = 0; t < 2; t++) {
        const u32 grp = 2 * t + (q >> 1);
        const u32 idx = (u32)b[2 + 8 * s + 2 * grp + up] | ((h << (8 - 2 * grp - up)) & 256u);
        const u32 g4 = iq3s_grid[idx];
        const u32 signs = b[74 + 4 * s + grp];
        _Pragma("unroll") for (u32 k = 0; k < 4; k++) v[4 * t + k] = sv4(db, g4, k, signs, 4 * up + k);
    }
}

// IQ1: dl * (grid byte as i8 + delta).
__device__ __forceinline__ void dq8_iq1_s(const u8* b, u32 j, float v[8]) {
    const u32 s = j >> 5, q = (j >> 2) & 3u, up = q & 1u;
    const float d = ld_f16_a2(b);
    const u32 h = *(const u16*)(b + 34 + 2 * s);
    const float dl = d * (float)(2u * ((h >> 12) & 7u) + 1u);
    const float delta = iq1_delta((h & 0x8000u) != 0);
    _Pragma("unroll") for (u32 t = 0; t < 2; t++) {
        const u32 grp = 2 * t + (q >> 1);
        const u32 idx = (u32)b[2 + 4 * s + grp] | (((h >> (3 * grp)) & 7u) << 8);
        const u32 g4 = grid_half(iq1s_grid[idx], up);
        _Pragma("unroll") for (u32 k = 0; k < 4; k++)
            v[4 * t + k] = dl * ((float)(i8)(u8)byte_of(g4, k) + delta);
    }
}

__device__ __forceinline__ void dq8_iq1_m(const u8* b, u32 j, float v[8]) {
    // Whole words (the block is 4-aligned here): the scales' two words, the sub-block's four
    // index bytes, its two bytes of high bits and signs; the same fields as dq_iq1_m's loads.
    const u32 s = j >> 5, q = (j >> 2) & 3u, up = q & 1u;
    const u32 w0 = *(const u32*)(b + 48), w1 = *(const u32*)(b + 52);
    const u32 sc0 = w0 & 0xFFFFu, sc1 = w0 >> 16, sc2 = w1 & 0xFFFFu, sc3 = w1 >> 16;
    const u16 d_bits =
        (u16)((sc0 >> 12) | ((sc1 >> 8) & 0x00F0u) | ((sc2 >> 4) & 0x0F00u) | (sc3 & 0xF000u));
    const float d = cvt_f16(d_bits);  // the hardware conversion here, dq_iq1_m the integer one
    const u32 sw = (((s / 2) & 2u) ? w1 : w0) >> (16 * ((s / 2) & 1u));
    const u32 s16 = (sw & 0xFFFFu) >> (6 * (s % 2));
    const u32 qs = *(const u32*)(b + 4 * s);
    const u32 qh = *(const u16*)(b + 32 + 2 * s);
    _Pragma("unroll") for (u32 t = 0; t < 2; t++) {
        const u32 grp = 2 * t + (q >> 1);
        const float dl = t == 0 ? d * (float)(2u * (s16 & 7u) + 1u)
                                : d * (float)(2u * ((s16 >> 3) & 7u) + 1u);
        const u32 nib = (qh >> (4 * grp)) & 0xFu;
        const u32 idx = ((qs >> (8 * grp)) & 0xFFu) | ((nib & 7u) << 8);
        const float delta = iq1_delta((nib & 8u) != 0);
        const u32 g4 = grid_half(iq1s_grid[idx], up);
        _Pragma("unroll") for (u32 k = 0; k < 4; k++)
            v[4 * t + k] = dl * ((float)(i8)(u8)byte_of(g4, k) + delta);
    }
}

DEQUANT_KERNELS8(iq2_xxs, 256, 66, 2)
DEQUANT_KERNELS8(iq2_xs, 256, 74, 2)
DEQUANT_KERNELS8(iq2_s, 256, 82, 2)
DEQUANT_KERNELS8(iq3_xxs, 256, 98, 2)
DEQUANT_KERNELS8(iq3_s, 256, 110, 2)
DEQUANT_KERNELS8(iq1_s, 256, 50, 2)
DEQUANT_KERNELS8(iq1_m, 256, 56, 4)

// ---- TQ1_0 ------------------------------------------------------------------------------------
// small.rs `dequant_tq1_0` (`tq1_digits`, `tq1_trit`), ggml `dequantize_row_tq1_0`. Block (54
// bytes): qs[48], qh[4], f16 d (bytes 52..54). Digit n of byte x is
// t = ((u8(x * 3^n) * 3) >> 8) - 1 and y = t * d, at 32n + m (qs[m], m < 32, n < 5),
// 160 + 16n + m (qs[32 + m], m < 16, n < 5) and 240 + 4n + m (qh[m], m < 4, n < 4).
__device__ __forceinline__ float dq_tq1_0(const u8* b, u32 j) {
    u32 n, x;
    if (j < 160) {
        n = j / 32;
        x = b[j % 32];
    } else if (j < 240) {
        n = (j - 160) / 16;
        x = b[32 + (j - 160) % 16];
    } else {
        n = (j - 240) / 4;
        x = b[48 + (j - 240) % 4];
    }
    const u32 q = (x * (u32)pow3[n]) & 0xFFu;  // Rust: x.wrapping_mul(p) on u8
    const int t = (int)((q * 3u) >> 8) - 1;
    return (float)t * ld_f16(b + 52);
}

// ---- TQ2_0 ------------------------------------------------------------------------------------
// small.rs `dequant_tq2_0`, ggml `dequantize_row_tq2_0`. Block (66 bytes): qs[64], f16 d (bytes
// 64..66). For j = 128h + 32l + m: y = (((qs[32h + m] >> 2l) & 3) - 1) * d.
__device__ __forceinline__ float dq_tq2_0(const u8* b, u32 j) {
    const u32 h = j / 128, l = (j % 128) / 32, m = j % 32;
    const int t = (int)(((u32)b[32 * h + m] >> (2 * l)) & 3u) - 1;
    return (float)t * ld_f16(b + 64);
}

// ---- MXFP4 ------------------------------------------------------------------------------------
// small.rs `dequant_mxfp4` and `e8m0_to_f32_half`, ggml `dequantize_row_mxfp4` and
// `ggml_e8m0_to_fp32_half`. Block (17 bytes, QK 32): u8 e (E8M0), qs[16]. d = 2^(e-128) as f32
// bits (subnormal 0x00200000 << e for e < 2, else (e - 1) << 23); y[j] = kv[qs[j] & 0xF] * d,
// y[j + 16] = kv[qs[j] >> 4] * d (kv = kvalues_mxfp4, the doubled E2M1 values).
__device__ __forceinline__ float e8m0_to_f32_half(u32 x) {
    const u32 bits = x < 2 ? (0x00200000u << x) : ((x - 1u) << 23);
    return __uint_as_float(bits);
}
__device__ __forceinline__ float dq_mxfp4(const u8* b, u32 j) {
    const float d = e8m0_to_f32_half(b[0]);
    const u32 q = j < 16 ? (b[1 + j] & 0xFu) : ((u32)b[1 + j - 16] >> 4);
    return kvalues_mxfp4[q] * d;
}

// ---- NVFP4 ------------------------------------------------------------------------------------
// small.rs `dequant_nvfp4` (`UE4M3_HALF` = `ue4m3_to_f32_half`), ggml `dequantize_row_nvfp4` and
// `ggml_ue4m3_to_fp32`. Block (36 bytes, QK 64): u8 d[4] (UE4M3, one per 16 values), qs[32]
// (bytes 4..36, 8 per sub-block). For s = j / 16, r = j % 16:
// y = kv[qs[8s + r%8] & 0xF] * ue4m3_half[d[s]] (r < 8), kv[qs[8s + r%8] >> 4] * ... (r >= 8).
__device__ __forceinline__ float dq_nvfp4(const u8* b, u32 j) {
    const u32 s = j / 16, r = j % 16;
    const u32 x = b[4 + 8 * s + r % 8];
    const u32 q = r < 8 ? (x & 0xFu) : (x >> 4);
    const float d = ue4m3_half[b[s]];
    return kvalues_mxfp4[q] * d;
}

// ---- octets (see DEQUANT_OCTETS in dequant.cu) --------------------------------------------------
// TQ1_0's digit positions do not follow 32-value chunks: its octet is eight dq_ calls.
DQ8_FROM_DQ(tq1_0)

// TQ2_0: j = 128h + 32l + 4q: bytes qs[32h + 4q ..] and qs[32h + 16 + 4q ..], bits 2l.
__device__ __forceinline__ void dq8_tq2_0(const u8* b, u32 j, float v[8]) {
    const u32 h = j >> 7, l = (j >> 5) & 3u, q = (j >> 2) & 3u;
    const float d = ld_f16_a2(b + 64);
    _Pragma("unroll") for (u32 t = 0; t < 2; t++) {
        const u32 x = ld4_a2(b + 32 * h + 16 * t + 4 * q);
        _Pragma("unroll") for (u32 k = 0; k < 4; k++)
            v[4 * t + k] = (float)((int)((x >> (8 * k + 2 * l)) & 3u) - 1) * d;
    }
}

// MXFP4 (17-byte blocks, byte aligned): qs[j..j+4], low nibbles then high nibbles.
__device__ __forceinline__ void dq8_mxfp4(const u8* b, u32 j, float v[8]) {
    const float d = e8m0_to_f32_half(b[0]);
    _Pragma("unroll") for (u32 k = 0; k < 4; k++) {
        const u32 x = b[1 + j + k];
        v[k] = kvalues_mxfp4[x & 0xFu] * d;
        v[4 + k] = kvalues_mxfp4[x >> 4] * d;
    }
}

// NVFP4: j = 32c + 4q; the halves are sub-blocks 2c and 2c + 1 (one UE4M3 scale each); values
// r = 4q + k of a sub-block are the low (r < 8) or high nibbles of qs[8 sub + r % 8].
__device__ __forceinline__ void dq8_nvfp4(const u8* b, u32 j, float v[8]) {
    const u32 c = j >> 5, q = (j >> 2) & 3u;
    const u32 sh = q >= 2 ? 4u : 0u, off = 4 * (q & 1u);
    _Pragma("unroll") for (u32 t = 0; t < 2; t++) {
        const u32 sub = 2 * c + t;
        const float d = ue4m3_half[b[sub]];
        const u32 x = ld4_a4(b + 4 + 8 * sub + off);
        _Pragma("unroll") for (u32 k = 0; k < 4; k++)
            v[4 * t + k] = kvalues_mxfp4[(x >> (8 * k + sh)) & 0xFu] * d;
    }
}

DEQUANT_KERNELS8(tq1_0, 256, 54, 2)
DEQUANT_KERNELS8(tq2_0, 256, 66, 2)
DEQUANT_KERNELS8(mxfp4, 32, 17, 1)
DEQUANT_KERNELS8(nvfp4, 64, 36, 4)
