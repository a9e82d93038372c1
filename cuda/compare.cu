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
