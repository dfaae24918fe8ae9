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
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = x[row + i];
        if (add) {
            v += add[row + i];
            resid[row + i] = v;
        }
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    float inv = 1.0f / sqrtf(ss / dim + eps);
    const float* src = add ? resid : x;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float y = bf16_to_f32(weight[i]) * (src[row + i] * inv);
        out[row + i] = y;
        out_bf16[row + i] = f32_to_bf16(y);
    }
}
