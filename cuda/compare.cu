// On-device comparison of a GPU result with the CPU's, so that multi-GB tensors are checked
// without copying them back. Two values are equal when their bits are equal or both are NaN
// (NaN payloads are not specified by either side).
//
// compare_f32(gpu, cpu, n, stats): stats[0] += mismatches, stats[1] = min index of a mismatch
// (atomicMin; initialise to ~0), stats[2] = max |gpu - cpu| over finite pairs as float bits
// (atomicMax on non-negative floats orders like unsigned ints).

extern "C" __global__ void compare_f32(const float* __restrict__ gpu, const float* __restrict__ cpu,
                                       u64 n, u64* stats) {
    u64 local_mis = 0, first = ~0ull;
    float local_max = 0.0f;
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float a = gpu[i], b = cpu[i];
        bool both_nan = (a != a) && (b != b);
        if (__float_as_uint(a) != __float_as_uint(b) && !both_nan) {
            local_mis++;
            if (i < first) first = i;
            float d = fabsf(a - b);
            if (d == d && d > local_max) local_max = d;  // a NaN/Inf pair counts as a mismatch only
        }
    }
    if (local_mis) {
        atomicAdd(&stats[0], local_mis);
        atomicMin(&stats[1], first);
        atomicMax((unsigned int*)&stats[2], __float_as_uint(local_max));
    }
}

// compare_u16(gpu, cpu, n, stats): the same for bf16/f16 bit patterns (exact equality).
extern "C" __global__ void compare_u16(const u16* __restrict__ gpu, const u16* __restrict__ cpu,
                                       u64 n, u64* stats) {
    u64 local_mis = 0, first = ~0ull;
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        if (gpu[i] != cpu[i]) {
            local_mis++;
            if (i < first) first = i;
        }
    }
    if (local_mis) {
        atomicAdd(&stats[0], local_mis);
        atomicMin(&stats[1], first);
    }
}

// hash_f32(v, n, base, out): *out += sum over i of mix64(canon(bits(v[i])) ^ (base + i) * GAMMA),
// wrapping. The sum commutes, so any thread order gives the same hash; src/dcheck/mod.rs computes
// the same on the CPU (`hash_f32_host`) and compares the two, so that equal chunks need no copy of
// the CPU's values. Every NaN hashes as 0x7FC00000 (NaN equals NaN, as in compare_f32).
__device__ __forceinline__ u64 mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

extern "C" __global__ void hash_f32(const float* __restrict__ v, u64 n, u64 base, u64* out) {
    u64 acc = 0;
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float x = v[i];
        u32 bits = (x != x) ? 0x7FC00000u : __float_as_uint(x);
        acc += mix64((u64)bits ^ ((base + i) * 0x9E3779B97F4A7C15ull));
    }
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
    if ((threadIdx.x & 31) == 0) atomicAdd(out, acc);
}

// hash_bytes(p, n, base, out): *out += sum over i < ceil(n / 4) of mix64(w_i ^ (base + i) * GAMMA),
// wrapping, where w_i is the little-endian u32 of bytes 4i .. 4i + 4 of p (zeros past n): raw bytes,
// no bit pattern made equal to another. src/gpu/resident.rs computes the same on the CPU
// (`hash_bytes_host`), so that bytes another engine put on the device are proven to be the file's
// without copying them back. p need not be aligned: an unaligned or last word is read by bytes.
extern "C" __global__ void hash_bytes(const unsigned char* __restrict__ p, u64 n, u64 base,
                                      u64* out) {
    u64 acc = 0;
    u64 words = (n + 3) / 4;
    bool aligned = (((unsigned long long)p) & 3ull) == 0;
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += stride) {
        u32 w = 0;
        if (aligned && 4 * i + 4 <= n) {
            w = ((const u32*)p)[i];
        } else {
            for (int k = 0; k < 4; k++) {
                u64 j = 4 * i + k;
                if (j < n) w |= (u32)p[j] << (8 * k);
            }
        }
        acc += mix64((u64)w ^ ((base + i) * 0x9E3779B97F4A7C15ull));
    }
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
    if ((threadIdx.x & 31) == 0) atomicAdd(out, acc);
}
