// y[m] (f32) = w[m, k] (bf16) · x[k] (bf16), f32 accumulation: the GEMMs of a decode step, where
// one token makes every GEMM a matrix-vector product bound by reading the weights. One warp
// per output row, 16-byte loads (8 bf16), four in flight per lane; needs k % 8 == 0 and
// 16-byte aligned rows. Blocks of 256 threads (8 rows).
__device__ __forceinline__ float dot8_bf16(uint4 a, uint4 b) {
    const unsigned int* pa = (const unsigned int*)&a;
    const unsigned int* pb = (const unsigned int*)&b;
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        acc += __uint_as_float(pa[j] << 16) * __uint_as_float(pb[j] << 16);
        acc += __uint_as_float(pa[j] & 0xffff0000u) * __uint_as_float(pb[j] & 0xffff0000u);
    }
    return acc;
}

// One row's dot product with x, summed over the warp (every lane gets it).
__device__ __forceinline__ float warp_row_dot(const bf16_t* __restrict__ row,
                                              const bf16_t* __restrict__ x, int k) {
    const uint4* wr = (const uint4*)row;
    const uint4* xv = (const uint4*)x;
    int vecs = k >> 3, i = threadIdx.x & 31;
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
    for (; i + 96 < vecs; i += 128) {
        uint4 w0 = wr[i], w1 = wr[i + 32], w2 = wr[i + 64], w3 = wr[i + 96];
        a0 += dot8_bf16(w0, xv[i]);
        a1 += dot8_bf16(w1, xv[i + 32]);
        a2 += dot8_bf16(w2, xv[i + 64]);
        a3 += dot8_bf16(w3, xv[i + 96]);
    }
    for (; i < vecs; i += 32) a0 += dot8_bf16(wr[i], xv[i]);
    return warp_sum((a0 + a1) + (a2 + a3));
}

extern "C" __global__ void gemv_bf16(const bf16_t* __restrict__ x, const bf16_t* __restrict__ w,
                                     float* __restrict__ y, int k, int m) {
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= m) return;
    float acc = warp_row_dot(w + (size_t)row * k, x, k);
    if ((threadIdx.x & 31) == 0) y[row] = acc;
}

// The decode step's gate/up projection and SwiGLU in one launch: w is gate_proj over up_proj
// ([2 * inter, k]); output j is silu(gate_j) * up_j in bf16 (the down projection's input).
extern "C" __global__ void gemv_swiglu_bf16(const bf16_t* __restrict__ x,
                                            const bf16_t* __restrict__ w,
                                            bf16_t* __restrict__ out, int k, int inter) {
    int j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (j >= inter) return;
    float g = warp_row_dot(w + (size_t)j * k, x, k);
    float u = warp_row_dot(w + (size_t)(inter + j) * k, x, k);
    if ((threadIdx.x & 31) == 0) out[j] = f32_to_bf16(g / (1.0f + expf(-g)) * u);
}

// A decode step's o_proj or down_proj together with the residual add and RMSNorm that follow
// it (as add_rms_norm): the GEMV's last block to finish (counted in `counter`, which it resets
// for the next step) adds the residual and normalises the row, saving a launch per GEMM.
extern "C" __global__ void gemv_add_norm_bf16(const bf16_t* __restrict__ x,
                                              const bf16_t* __restrict__ w, float* y, int k,
                                              int m, const float* resid, float* resid_out,
                                              const bf16_t* norm_weight, float* out,
                                              bf16_t* out_bf16, float eps,
                                              unsigned int* counter) {
    __shared__ float scratch[32];
    __shared__ bool last;
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row < m) {
        float acc = warp_row_dot(w + (size_t)row * k, x, k);
        if ((threadIdx.x & 31) == 0) y[row] = acc;
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    if (threadIdx.x == 0) *counter = 0;
    __threadfence();
    float ss = 0.0f;
    for (int i = threadIdx.x; i < m; i += blockDim.x) {
        float v = resid[i] + __ldcg(y + i);
        resid_out[i] = v;
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    float inv = 1.0f / sqrtf(ss / m + eps);
    for (int i = threadIdx.x; i < m; i += blockDim.x) {
        float o = bf16_to_f32(norm_weight[i]) * (resid_out[i] * inv);
        out[i] = o;
        out_bf16[i] = f32_to_bf16(o);
    }
}
