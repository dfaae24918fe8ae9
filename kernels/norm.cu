// RMSNorm as HF computes it (x * rsqrt(mean(x^2) + eps) * weight), optionally fused with the
// residual add that precedes it: resid = x + add, out = norm(resid). The normalised row is
// written in f32 (taps, residual math) and in bf16 (the next GEMM's input).
// One block per row.
extern "C" __global__ void add_rms_norm(const float* x, const float* add, float* resid,
                                        const bf16_t* weight, float* out, bf16_t* out_bf16,
                                        int dim, float eps) {
    PDL_ENTER();
    __shared__ float scratch[32];
    size_t row = (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    // A thread's elements i, i + 256, ... in that order, NORM_BATCH of them loaded before the
    // first is used: its stores (resid may be x) otherwise kept each load from starting before
    // the store before it, one round trip to memory per element.
    for (int base = threadIdx.x; base < dim; base += NORM_BATCH * blockDim.x) {
        float v[NORM_BATCH], a[NORM_BATCH];
#pragma unroll
        for (int u = 0; u < NORM_BATCH; u++) {
            int i = base + u * blockDim.x;
            v[u] = i < dim ? x[row + i] : 0.0f;
            a[u] = add && i < dim ? add[row + i] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < NORM_BATCH; u++) {
            int i = base + u * blockDim.x;
            if (i >= dim) break;
            if (add) {
                v[u] += a[u];
                resid[row + i] = v[u];
            }
            ss += v[u] * v[u];
        }
    }
    ss = block_sum(ss, scratch);
    float inv = 1.0f / sqrtf(ss / dim + eps);
    const float* src = add ? resid : x;
    for (int base = threadIdx.x; base < dim; base += NORM_BATCH * blockDim.x) {
        float v[NORM_BATCH], w[NORM_BATCH];
#pragma unroll
        for (int u = 0; u < NORM_BATCH; u++) {
            int i = base + u * blockDim.x;
            v[u] = i < dim ? src[row + i] : 0.0f;
            w[u] = i < dim ? bf16_to_f32(weight[i]) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < NORM_BATCH; u++) {
            int i = base + u * blockDim.x;
            if (i >= dim) break;
            float y = w[u] * (v[u] * inv);
            out[row + i] = y;
            out_bf16[row + i] = f32_to_bf16(y);
        }
    }
}
