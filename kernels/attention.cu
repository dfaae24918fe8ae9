// Causal GQA attention of n new queries over a layer's cache: query t (at cache entry base + t)
// sees entries 0..=base+t. With 0 < split < visible, entries [0, split) and [split, visible)
// get separate softmaxes merged by log-sum-exp (cascade attention); the probabilities written
// are the merged ones. KV may come from anywhere the path put it: the kernel only reads the
// cache. One block per (token, head); `probs` is [n, heads, span] and doubles as scratch.
// Writes the output in f32 and bf16 (the o_proj GEMM's input).
extern "C" __global__ void attention(const float* q, const float* keys, const float* values,
                                     float* probs, float* out, bf16_t* out_bf16, int base,
                                     int split, int heads, int kv_heads, int head_dim, int span,
                                     float scale) {
    __shared__ float scratch[32];
    extern __shared__ float qs[];
    int t = blockIdx.x / heads, h = blockIdx.x % heads;
    int kvh = h / (heads / kv_heads), kv_dim = kv_heads * head_dim;
    int visible = base + t + 1;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    float* row = probs + (size_t)blockIdx.x * span;
    const float* qv = q + ((size_t)t * heads + h) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) qs[d] = qv[d];
    __syncthreads();

    // Scores: one warp per key, lanes across the head dimension.
    for (int e = warp; e < visible; e += warps) {
        const float* k = keys + (size_t)e * kv_dim + kvh * head_dim;
        float acc = 0.0f;
        for (int d = lane; d < head_dim; d += 32) acc += qs[d] * k[d];
        acc = warp_sum(acc);
        if (lane == 0) row[e] = acc * scale;
    }
    for (int e = visible + threadIdx.x; e < span; e += blockDim.x) row[e] = 0.0f;
    __syncthreads();

    // Softmax per segment; each segment's weight in the merge is exp(lse_seg - lse_all).
    int cut = (split > 0 && split < visible) ? split : 0;
    int seg_start[2] = {0, cut}, seg_end[2] = {cut, visible};
    float lse[2] = {NEG_INF, NEG_INF}, total[2] = {0.0f, 0.0f};
    for (int s = 0; s < 2; s++) {
        if (seg_start[s] == seg_end[s]) continue;
        float m = NEG_INF;
        for (int e = seg_start[s] + threadIdx.x; e < seg_end[s]; e += blockDim.x) m = fmaxf(m, row[e]);
        m = block_max(m, scratch);
        float sum = 0.0f;
        for (int e = seg_start[s] + threadIdx.x; e < seg_end[s]; e += blockDim.x) {
            float p = expf(row[e] - m);
            row[e] = p;
            sum += p;
        }
        sum = block_sum(sum, scratch);
        total[s] = sum;
        lse[s] = m + logf(sum);
    }
    float mx = fmaxf(lse[0], lse[1]);
    float wa = seg_start[0] == seg_end[0] ? 0.0f : expf(lse[0] - mx);
    float wb = expf(lse[1] - mx);
    float norm_a = wa / (wa + wb) / total[0], norm_b = wb / (wa + wb) / total[1];
    for (int e = threadIdx.x; e < visible; e += blockDim.x) row[e] *= e < cut ? norm_a : norm_b;
    __syncthreads();

    // Output: the block splits into groups of head_dim threads; group g sums keys g, g + G,
    // ... with two accumulators (more loads in flight), then the groups' partial sums are
    // added in a fixed order.
    int groups = blockDim.x / head_dim;
    int g = threadIdx.x / head_dim, d = threadIdx.x % head_dim;
    float acc0 = 0.0f, acc1 = 0.0f;
    if (g < groups) {
        const float* v = values + kvh * head_dim + d;
        int e = g;
        for (; e + groups < visible; e += 2 * groups) {
            acc0 += row[e] * v[(size_t)e * kv_dim];
            acc1 += row[e + groups] * v[(size_t)(e + groups) * kv_dim];
        }
        if (e < visible) acc0 += row[e] * v[(size_t)e * kv_dim];
    }
    __syncthreads();
    float* part = qs + head_dim;  // dynamic shared memory: head_dim + blockDim.x floats
    if (g < groups) part[g * head_dim + d] = acc0 + acc1;
    __syncthreads();
    if (threadIdx.x < head_dim) {
        float acc = 0.0f;
        for (int k = 0; k < groups; k++) acc += part[k * head_dim + threadIdx.x];
        size_t o = ((size_t)t * heads + h) * head_dim + threadIdx.x;
        out[o] = acc;
        out_bf16[o] = f32_to_bf16(acc);
    }
}
