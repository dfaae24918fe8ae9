// Qwen3's per-head RMSNorm of q or k followed by RoPE ("rotate half": pairs (i, i + d/2) turn
// by position * inv_freq[i]). Reads heads from a row of the fused QKV output (row stride `ld`,
// first head at column `col`); writes the normalised heads and the rotated ones, contiguous
// [token, head, head_dim]. One block of head_dim threads per (token, head).
extern "C" __global__ void qk_norm_rope(const float* qkv, int ld, int col, const bf16_t* weight,
                                        const int* rope_pos, const float* inv_freq,
                                        float* normed, float* rotated, int heads, int head_dim,
                                        float eps) {
    __shared__ float scratch[32];
    extern __shared__ float row[];
    int t = blockIdx.x / heads, h = blockIdx.x % heads, i = threadIdx.x;
    float v = qkv[(size_t)t * ld + col + h * head_dim + i];
    float ss = block_sum(v * v, scratch);
    float y = bf16_to_f32(weight[i]) * (v * (1.0f / sqrtf(ss / head_dim + eps)));
    size_t out = ((size_t)t * heads + h) * head_dim + i;
    normed[out] = y;
    row[i] = y;
    __syncthreads();
    int half = head_dim / 2, j = i < half ? i : i - half;
    float angle = (float)rope_pos[t] * inv_freq[j];
    float s, c;
    sincosf(angle, &s, &c);
    rotated[out] = i < half ? row[i] * c - row[i + half] * s : row[i] * c + row[i - half] * s;
}

// Appends a batch's rotated keys and its values (read from the fused QKV output) at entry
// `meta[0]` (base) of one layer's cache. One block per token.
extern "C" __global__ void append_kv(const float* k_rot, const float* qkv, int ld, int v_col,
                                     float* keys, float* values, const int* meta, int kv_dim) {
    int t = blockIdx.x;
    size_t dst = ((size_t)meta[0] + t) * kv_dim;
    for (int i = threadIdx.x; i < kv_dim; i += blockDim.x) {
        keys[dst + i] = k_rot[(size_t)t * kv_dim + i];
        values[dst + i] = qkv[(size_t)t * ld + v_col + i];
    }
}
