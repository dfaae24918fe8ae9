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

// Index of the largest value (the first of equals, as the CPU's argmax). One block; four
// loads in flight per thread.
extern "C" __global__ void argmax(const float* x, int n, unsigned int* out) {
    PDL_ENTER();
    __shared__ float best_v[1024];
    __shared__ int best_i[1024];
    float bv = NEG_INF;
    int bi = 0x7fffffff, step = blockDim.x;
    int i = threadIdx.x;
    for (; i + 3 * step < n; i += 4 * step) {
        float v0 = x[i], v1 = x[i + step], v2 = x[i + 2 * step], v3 = x[i + 3 * step];
        if (v0 > bv) { bv = v0; bi = i; }
        if (v1 > bv) { bv = v1; bi = i + step; }
        if (v2 > bv) { bv = v2; bi = i + 2 * step; }
        if (v3 > bv) { bv = v3; bi = i + 3 * step; }
    }
    for (; i < n; i += step) {
        float v = x[i];
        if (v > bv) { bv = v; bi = i; }
    }
    block_argmax(bv, bi, best_v, best_i);
    if (threadIdx.x == 0) *out = best_i[0] == 0x7fffffff ? 0 : best_i[0];
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
