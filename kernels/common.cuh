// Helpers shared by every kernel. bf16 travels as raw 16-bit words (`bf16_t`) so NVRTC needs
// no CUDA headers; conversions round to nearest even, as torch does.

typedef unsigned short bf16_t;

#define NEG_INF __int_as_float(0xff800000u)

__device__ __forceinline__ bool finite(float x) {
    return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
}

__device__ __forceinline__ float bf16_to_f32(bf16_t x) {
    return __uint_as_float(((unsigned int)x) << 16);
}

__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)0x7fc0;  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block; every thread gets the result. `scratch` holds 32 floats.
__device__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

__device__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : NEG_INF;
    return warp_max(v);
}

// The block's largest `v` with its index `i` (the smallest index among equals) into best_v[0]
// and best_i[0]; the arrays hold blockDim.x entries, a power of two.
__device__ void block_argmax(float v, int i, float* best_v, int* best_i) {
    best_v[threadIdx.x] = v;
    best_i[threadIdx.x] = i;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            float w = best_v[threadIdx.x + s];
            int j = best_i[threadIdx.x + s];
            if (w > best_v[threadIdx.x] || (w == best_v[threadIdx.x] && j < best_i[threadIdx.x])) {
                best_v[threadIdx.x] = w;
                best_i[threadIdx.x] = j;
            }
        }
        __syncthreads();
    }
}

// Counts this block in at `counter` once its writes are visible device-wide, and says whether
// it is the last of `blocks` to finish. The last one resets the counter for the next launch
// and then sees every other block's writes (read them past L1: __ldcg). Every thread calls it.
__device__ bool last_block_done(unsigned int* counter, unsigned int blocks) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == blocks - 1;
    __syncthreads();
    if (last) {
        if (threadIdx.x == 0) *counter = 0;
        __threadfence();
    }
    return last;
}

// Programmatic dependent launch (sm_90 and later; kvdiff launches every kernel with it there).
// A kernel may then start while the one before it in the stream is still running: its blocks
// take the free SMs and load what no kernel writes (weights) early. Before touching anything
// else, and before writing anything, a kernel calls pdl_wait(), which returns once the kernel
// before it has finished and its writes are visible; as every kernel waits, "finished" then
// holds for all earlier ones. pdl_trigger() lets the next kernel start launching.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The prologue of a kernel with nothing to load early.
#define PDL_ENTER() \
    do {            \
        pdl_trigger(); \
        pdl_wait();    \
    } while (0)

// Elements a thread of a row-wise kernel (norms) loads before it uses the first: one round
// trip to memory per NORM_BATCH of its elements, not one each.
#define NORM_BATCH 8

// Several caches' decode steps in one launch (the `_sides` kernels): each side has its own
// buffers, so a kernel takes one address per side of every buffer it reads or writes, and the
// weights once. Each side's arithmetic is the single kernel's, unchanged. MAX_SIDES is
// defined ahead of the sources by the host (`MAX_SIDES` in src/cuda/gpu/kernels.rs).
struct Sides {
    unsigned long long p[MAX_SIDES];
};
struct SideInts {
    int v[MAX_SIDES];
};
// Picked by selects the compiler cannot see through: a kernel parameter indexed by a run-time
// value is copied to local memory by every thread first, and so was a chain of comparisons,
// which the compiler folds back into that indexing (the eight-side decode attention stored
// and loaded 298 times a thread, and took 66 against 38 us a launch at Qwen3-8B's shape).
template <class T>
__device__ __forceinline__ T* at_side(Sides s, int i) {
    unsigned long long p = s.p[0];
#pragma unroll
    for (int k = 1; k < MAX_SIDES; k++)
        asm("{\n\t.reg .pred q;\n\tsetp.eq.s32 q, %1, %2;\n\tselp.b64 %0, %3, %0, q;\n\t}"
            : "+l"(p)
            : "r"(i), "r"(k), "l"(s.p[k]));
    return (T*)p;
}
__device__ __forceinline__ int side_int(SideInts s, int i) {
    int v = s.v[0];
#pragma unroll
    for (int k = 1; k < MAX_SIDES; k++)
        asm("{\n\t.reg .pred q;\n\tsetp.eq.s32 q, %1, %2;\n\tselp.b32 %0, %3, %0, q;\n\t}"
            : "+r"(v)
            : "r"(i), "r"(k), "r"(s.v[k]));
    return v;
}

// Runs the statements `...` with `S` = MAX_SIDES, the one side count the kernels are compiled
// for: a launch for fewer sides pads with side 0's input (`padded_side`), whose results are
// dropped. One count only: compiled for several (2, 4, 6, 9, 12, 16) in one kernel, its
// registers were the largest case's, and the LM head with one side took 566 against 308 µs
// (scripts/bench_gemv_sides.cu). (A macro: NVRTC takes no lambdas in device code. Loops inside
// unroll with _Pragma, as #pragma cannot sit in one.)
#define WITH_SIDES(sides, ...)       \
    do {                             \
        constexpr int S = MAX_SIDES; \
        __VA_ARGS__                  \
    } while (0)

// Side s's input at `base` (a `Sides` argument), side 0's past the last side.
template <class T>
__device__ __forceinline__ T* padded_side(Sides base, int s, int sides) {
    return at_side<T>(base, s < sides ? s : 0);
}
