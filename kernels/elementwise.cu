// Embedding gather: rows of the bf16 table, as f32. One block per token.
extern "C" __global__ void embed(const bf16_t* table, const unsigned int* tokens, float* out,
                                 int hidden) {
    PDL_ENTER();
    size_t src = (size_t)tokens[blockIdx.x] * hidden, dst = (size_t)blockIdx.x * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) out[dst + i] = bf16_to_f32(table[src + i]);
}

// SwiGLU over the fused gate|up GEMM output [n, 2 * inter]: silu(gate) * up, in bf16 for the
// down projection.
extern "C" __global__ void swiglu(const float* gate_up, bf16_t* out, int inter, int n) {
    PDL_ENTER();
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n * inter) return;
    size_t t = i / inter, j = i % inter;
    float g = gate_up[t * 2 * inter + j], u = gate_up[t * 2 * inter + inter + j];
    out[i] = f32_to_bf16(g / (1.0f + expf(-g)) * u);
}

// A value and its index as one 64-bit key whose unsigned order is argmax's: larger values
// first, then smaller indices (the first of equals, as the CPU's argmax). -0 counts as +0, and
// NaN as nothing (0), as the CPU's `>` never picks one (a NaN at index 0 wins: see argmax).
__device__ __forceinline__ unsigned long long argmax_key(float v, int i) {
    if (v != v) return 0ull;
    unsigned int b = v == 0.0f ? 0u : __float_as_uint(v);
    b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((unsigned long long)b << 32) | (unsigned long long)(~(unsigned int)i);
}

// Index of the largest value over the whole GPU: each block folds its share into one key
// (argmax_key), atomicMax'ed into out[2..4]; the last block to finish (counted in out[1]) writes
// the index to out[0] and resets both for the next launch. `out` holds four zeroed words (8-byte
// aligned). One block would take tens of µs over a vocabulary; this is one memory round trip.
extern "C" __global__ void argmax(const float* x, int n, unsigned int* out) {
    PDL_ENTER();
    __shared__ unsigned long long warps[32];
    unsigned long long best = 0ull;
    int step = gridDim.x * blockDim.x, i = blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * step < n; i += 4 * step) {
        float v0 = x[i], v1 = x[i + step], v2 = x[i + 2 * step], v3 = x[i + 3 * step];
        unsigned long long k0 = argmax_key(v0, i), k1 = argmax_key(v1, i + step);
        unsigned long long k2 = argmax_key(v2, i + 2 * step), k3 = argmax_key(v3, i + 3 * step);
        k0 = k0 > k1 ? k0 : k1;
        k2 = k2 > k3 ? k2 : k3;
        k0 = k0 > k2 ? k0 : k2;
        best = best > k0 ? best : k0;
    }
    for (; i < n; i += step) {
        unsigned long long k = argmax_key(x[i], i);
        best = best > k ? best : k;
    }
    for (int o = 16; o > 0; o >>= 1) {
        unsigned long long other = __shfl_xor_sync(0xffffffffu, best, o);
        best = best > other ? best : other;
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    if (lane == 0) warps[warp] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < nwarps; w++) best = best > warps[w] ? best : warps[w];
        if (best) atomicMax((unsigned long long*)(out + 2), best);
    }
    if (!last_block_done(out + 1, gridDim.x)) return;
    if (threadIdx.x == 0) {
        unsigned long long k = atomicExch((unsigned long long*)(out + 2), 0ull);
        // The CPU's scan starts at index 0 and nothing compares greater than a NaN there.
        out[0] = k && x[0] == x[0] ? ~(unsigned int)k : 0u;
    }
}

// Mixture-of-experts dispatch, in three simple launches per expert: gather the rows of the
// tokens routed to it, run its SwiGLU with the GEMMs every dense MLP uses, and add each row
// back weighted by the router. Experts are added one after another on one stream, so the sum
// runs in expert order as HF's does.

// dst[r] = src[idx[r]] for `count` bf16 rows of `width`. Grid: ceil(count * width / 256).
extern "C" __global__ void gather_rows_bf16(const bf16_t* src, const int* idx, bf16_t* dst,
                                            int width, int count) {
    PDL_ENTER();
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)count * width) return;
    size_t r = i / width, j = i % width;
    dst[i] = src[(size_t)idx[r] * width + j];
}

// out[idx[r]] += w[r] * y[r] for `count` f32 rows of `width` (each token at most once per
// expert, so no two threads add to one element). Grid: ceil(count * width / 256).
extern "C" __global__ void scatter_add_rows(const float* y, const int* idx, const float* w,
                                            float* out, int width, int count) {
    PDL_ENTER();
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)count * width) return;
    size_t r = i / width, j = i % width;
    out[(size_t)idx[r] * width + j] += w[r] * y[i];
}

// x[0..n) = 0.
extern "C" __global__ void zero_f32(float* x, int n) {
    PDL_ENTER();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = 0.0f;
}

// *flag = 1 when any of the n bf16 values is Inf or NaN (exponent bits all ones): the load-time
// check of a checkpoint streamed to the GPU.
extern "C" __global__ void any_nonfinite_bf16(const unsigned short* x, int n, int* flag) {
    PDL_ENTER();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        if ((x[i] & 0x7f80) == 0x7f80) *flag = 1;
}

// flags[job's flag] = 1 when the job's two word ranges differ in any bit. Jobs are four u64
// each (a, b, words, flag); `per` blocks share a job, each striding over its words. A block
// whose flag is already set leaves at once: ranges that differ are told apart after a few
// blocks, ranges that match are read whole. Whether two KV caches hold the same bits.
extern "C" __global__ void words_differ(const unsigned long long* jobs, int per, int* flags) {
    PDL_ENTER();
    const unsigned long long* j = jobs + 4 * (blockIdx.x / per);
    volatile int* flag = flags + j[3];
    if (*flag) return;
    const unsigned* a = (const unsigned*)j[0];
    const unsigned* b = (const unsigned*)j[1];
    long long n = (long long)j[2], stride = (long long)per * blockDim.x;
    int differ = 0;
    for (long long i = (long long)(blockIdx.x % per) * blockDim.x + threadIdx.x; i < n; i += stride)
        differ |= a[i] != b[i];
    if (__syncthreads_or(differ) && threadIdx.x == 0) *flag = 1;
}
