// Shared device helpers for glmdiff's kernels. Compiled by NVRTC at run time (src/gpu/nvrtc.rs)
// with fixed options: --fmad=false (no contraction of a*b+c into an FMA: the CPU reference never
// fuses), --ftz=false, --prec-div=true, --prec-sqrt=true. Sources are concatenated in this order:
// this file, the tables generated from the CPU code (src/gpu/tables.rs), the kernel family.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// Little-endian loads from byte pointers (blocks are not aligned beyond 1 or 2 bytes).
__device__ __forceinline__ u16 ld_u16(const u8* p) { return (u16)p[0] | ((u16)p[1] << 8); }
__device__ __forceinline__ u32 ld_u32(const u8* p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}
__device__ __forceinline__ u64 ld_u64(const u8* p) {
    return (u64)ld_u32(p) | ((u64)ld_u32(p + 4) << 32);
}

// IEEE half -> float, exact for every input (subnormals, infinities, NaN), done with integer
// operations so that it depends on no intrinsic's FTZ behaviour.
__device__ __forceinline__ float half_bits_to_float(u16 h) {
    u32 sign = (u32)(h & 0x8000u) << 16;
    u32 exp = (h >> 10) & 0x1Fu;
    u32 mant = h & 0x3FFu;
    u32 bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {
            // Subnormal: normalize.
            int e = -1;
            do { e++; mant <<= 1; } while ((mant & 0x400u) == 0);
            bits = sign | ((u32)(127 - 15 - e) << 23) | ((mant & 0x3FFu) << 13);
        }
    } else if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    return __uint_as_float(bits);
}

// The hardware conversion (cvt.f32.f16 is exact for every half, subnormals included, and takes
// no .ftz here). Both conversions are checked against the CPU on every 16-bit pattern by the
// GPU tests (the F16 kernel on random bytes uses this one, IQ1_M's assembled scale the other).
__device__ __forceinline__ float cvt_f16(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ float ld_f16(const u8* p) { return cvt_f16(ld_u16(p)); }
__device__ __forceinline__ float ld_bf16(const u8* p) { return __uint_as_float((u32)ld_u16(p) << 16); }
__device__ __forceinline__ float ld_f32(const u8* p) { return __uint_as_float(ld_u32(p)); }

// float -> bfloat16 / half, round to nearest even (NaN stays NaN).
__device__ __forceinline__ u16 float_to_bf16_bits(float f) {
    u32 x = __float_as_uint(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (u16)((x >> 16) | 0x0040u);
    u32 lsb = (x >> 16) & 1u;
    x += 0x7FFFu + lsb;
    return (u16)(x >> 16);
}
__device__ __forceinline__ u16 float_to_half_bits(float f) {
    u32 x = __float_as_uint(f);
    u32 sign = (x >> 16) & 0x8000u;
    u32 ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) return (u16)(sign | 0x7E00u | ((ax >> 13) & 0x3FFu));  // NaN
    if (ax >= 0x477FF000u) return (u16)(sign | 0x7C00u);  // rounds to infinity (>= 65520)
    if (ax < 0x38800000u) {
        // Half subnormal (or zero): value = m * 2^-24, round the mantissa to nearest even.
        if (ax < 0x33000000u) return (u16)sign;  // below half of the smallest subnormal
        u32 e = ax >> 23;
        u32 m = (ax & 0x7FFFFFu) | 0x800000u;
        u32 shift = 126 - e;  // 14 + (113 - e) - 1 + 1
        u32 r = m >> shift;
        u32 rem = m & ((1u << shift) - 1u);
        u32 half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1u))) r++;
        return (u16)(sign | r);
    }
    // Normal: rebias the exponent and round 13 mantissa bits to nearest even.
    u32 r = ax - 0x38000000u;
    r = r + 0xFFFu + ((r >> 13) & 1u);
    return (u16)(sign | (r >> 13));
}
