// Embedding gather: rows of the bf16 table, as f32. One block per token.
extern "C" __global__ void embed(const bf16_t* table, const unsigned int* tokens, float* out,
                                 int hidden) {
    size_t src = (size_t)tokens[blockIdx.x] * hidden, dst = (size_t)blockIdx.x * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) out[dst + i] = bf16_to_f32(table[src + i]);
}

// SwiGLU over the fused gate|up GEMM output [n, 2 * inter]: silu(gate) * up, in bf16 for the
// down projection.
extern "C" __global__ void swiglu(const float* gate_up, bf16_t* out, int inter, int n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n * inter) return;
    size_t t = i / inter, j = i % inter;
    float g = gate_up[t * 2 * inter + j], u = gate_up[t * 2 * inter + inter + j];
    out[i] = f32_to_bf16(g / (1.0f + expf(-g)) * u);
}

// Index of the largest value (the first of equals, as the CPU's argmax). One block.
extern "C" __global__ void argmax(const float* x, int n, unsigned int* out) {
    __shared__ float best_v[1024];
    __shared__ int best_i[1024];
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = x[i];
        if (v > bv) { bv = v; bi = i; }
    }
    block_argmax(bv, bi, best_v, best_i);
    if (threadIdx.x == 0) *out = best_i[0] == 0x7fffffff ? 0 : best_i[0];
}
