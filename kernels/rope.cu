// Qwen3's per-head RMSNorm of q and k (skipped when q_weight is null: families without it)
// followed by RoPE ("rotate half": pairs (i, i + d/2) turn
// by position * inv_freq[i]), and the KV-cache append, in one launch. Reads a row of the fused
// QKV output ([q heads | k heads | v heads] per token); writes the normalised and rotated heads,
// contiguous [token, head, head_dim], and puts each token's rotated key and its value at cache
// entry base + t. `meta` holds the RoPE positions (n), the key positions (n), then base.
// One block of head_dim threads per (token, q or k head).
// One element of a head after Qwen3's RMSNorm, the head's squares summing to `ss` (no weight:
// families without the norm). Shared with the decode attention that folds this kernel in, so
// both give the same bits.
__device__ __forceinline__ float head_norm(float v, float ss, const bf16_t* weight, int i,
                                           int head_dim, float eps) {
    return weight ? bf16_to_f32(weight[i]) * (v * (1.0f / sqrtf(ss / head_dim + eps))) : v;
}

// Element i of the normalised head `row` (shared memory) turned to `position`.
__device__ __forceinline__ float rope_element(const float* row, int i, int head_dim, int position,
                                              const float* inv_freq, float rope_scale) {
    int half = head_dim / 2, j = i < half ? i : i - half;
    float angle = (float)position * inv_freq[j];
    float s, c;
    sincosf(angle, &s, &c);
    // YaRN's attention factor scales cos and sin (exactly 1 for other RoPE types).
    s *= rope_scale;
    c *= rope_scale;
    return i < half ? row[i] * c - row[i + half] * s : row[i] * c + row[i - half] * s;
}

__device__ __forceinline__ void qk_norm_rope_block(
    int block, const float* qkv, int heads, int kv_heads, int head_dim, const bf16_t* q_weight,
    const bf16_t* k_weight, const int* meta, int n, const float* inv_freq, float* q_normed,
    float* q_rotated, float* k_normed, float* k_rotated, float* keys, float* values, float eps,
    float rope_scale) {
    __shared__ float scratch[32];
    extern __shared__ float row[];
    int per_token = heads + kv_heads, ld = (heads + 2 * kv_heads) * head_dim;
    int t = block / per_token, hh = block % per_token, i = threadIdx.x;
    bool is_k = hh >= heads;
    int head = is_k ? hh - heads : hh, nh = is_k ? kv_heads : heads;
    int col = is_k ? heads * head_dim + head * head_dim : head * head_dim;
    float v = qkv[(size_t)t * ld + col + i];
    float ss = block_sum(v * v, scratch);
    // q_weight null: the family has no q/k norm.
    float y = head_norm(v, ss, q_weight ? (is_k ? k_weight : q_weight) : nullptr, i, head_dim, eps);
    size_t out = ((size_t)t * nh + head) * head_dim + i;
    (is_k ? k_normed : q_normed)[out] = y;
    row[i] = y;
    __syncthreads();
    float r = rope_element(row, i, head_dim, meta[is_k ? n + t : t], inv_freq, rope_scale);
    (is_k ? k_rotated : q_rotated)[out] = r;
    if (is_k) {
        int kv_dim = kv_heads * head_dim;
        size_t dst = ((size_t)meta[2 * n] + t) * kv_dim + head * head_dim + i;
        keys[dst] = r;
        values[dst] = qkv[(size_t)t * ld + (heads + kv_heads) * head_dim + head * head_dim + i];
    }
}

extern "C" __global__ void qk_norm_rope(const float* qkv, int heads, int kv_heads, int head_dim,
                                        const bf16_t* q_weight, const bf16_t* k_weight,
                                        const int* meta, int n, const float* inv_freq,
                                        float* q_normed, float* q_rotated, float* k_normed,
                                        float* k_rotated, float* keys, float* values,
                                        float eps, float rope_scale) {
    PDL_ENTER();
    qk_norm_rope_block(blockIdx.x, qkv, heads, kv_heads, head_dim, q_weight, k_weight, meta, n,
                       inv_freq, q_normed, q_rotated, k_normed, k_rotated, keys, values, eps,
                       rope_scale);
}

// One decode token per side (`Sides`): grid sides * (heads + kv_heads), side-major.
extern "C" __global__ void qk_norm_rope_sides(Sides qkv, int heads, int kv_heads, int head_dim,
                                              const bf16_t* q_weight, const bf16_t* k_weight,
                                              Sides meta, const float* inv_freq, Sides q_normed,
                                              Sides q_rotated, Sides k_normed, Sides k_rotated,
                                              Sides keys, Sides values, float eps,
                                              float rope_scale) {
    PDL_ENTER();
    int per_side = heads + kv_heads, s = blockIdx.x / per_side;
    qk_norm_rope_block(blockIdx.x % per_side, at_side<const float>(qkv, s), heads, kv_heads, head_dim,
                       q_weight, k_weight, at_side<const int>(meta, s), 1, inv_freq,
                       at_side<float>(q_normed, s), at_side<float>(q_rotated, s),
                       at_side<float>(k_normed, s), at_side<float>(k_rotated, s),
                       at_side<float>(keys, s), at_side<float>(values, s), eps, rope_scale);
}

// Turns `n` cached keys (entries first.., every head) further by `delta` positions: RoPE
// composes, so keys rotated at local positions 0..n land at delta..delta + n (chunk-reuse
// "rerotate"). Same angle arithmetic as qk_norm_rope. Grid: n * kv_heads; head_dim / 2 threads.
extern "C" __global__ void rotate_keys(float* keys, int first, int kv_heads, int head_dim,
                                       int delta, const float* inv_freq) {
    PDL_ENTER();
    int half = head_dim / 2, i = threadIdx.x;
    float* k = keys + ((size_t)first * kv_heads + blockIdx.x) * head_dim;
    float s, c;
    sincosf((float)delta * inv_freq[i], &s, &c);
    float a = k[i], b = k[i + half];
    k[i] = a * c - b * s;
    k[i + half] = b * c + a * s;
}

// x[t, j] += bias[j] for n rows of width `width` (q/k/v projection biases, in place, before
// anything reads the projection). Grid: ceil(n * width / 256); 256 threads.
extern "C" __global__ void add_bias(float* x, const float* bias, int width, int n) {
    PDL_ENTER();
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (size_t)n * width) x[i] += bias[i % width];
}
