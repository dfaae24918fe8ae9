// Causal GQA attention of n new queries over a layer's cache: query t (at cache entry base + t)
// sees entries 0..=base+t. With 0 < split < visible, entries [0, split) and [split, visible)
// get separate softmaxes merged by log-sum-exp (cascade attention); the probabilities written
// are the merged ones. KV may come from anywhere the path put it: the kernel only reads the
// cache. `meta[0]` is base (the cache length before the batch), read on the device so that a
// captured decode step replays at any length. One block per (token, head); `probs` is [n,
// heads, stride] and doubles as scratch; columns visible..base+n of each row are zeroed.
// Writes the output in f32 and bf16 (the o_proj GEMM's input). With window > 0 (a sliding
// layer) query t sees only its last `window` entries; the others get probability 0, and a
// cascade split the window has passed leaves one segment.
extern "C" __global__ void attention(const float* q, const float* keys, const float* values,
                                     float* probs, float* out, bf16_t* out_bf16, const int* meta,
                                     int split, int heads, int kv_heads, int head_dim, int stride,
                                     float scale, int window) {
    PDL_ENTER();
    __shared__ float scratch[32];
    extern __shared__ float qs[];
    int t = blockIdx.x / heads, h = blockIdx.x % heads;
    int kvh = h / (heads / kv_heads), kv_dim = kv_heads * head_dim;
    int base = meta[0], span = base + gridDim.x / heads;
    int visible = base + t + 1;
    int first = window > 0 && visible > window ? visible - window : 0;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    float* row = probs + (size_t)blockIdx.x * stride;
    const float* qv = q + ((size_t)t * heads + h) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) qs[d] = qv[d];
    __syncthreads();

    // Scores: one warp per key, lanes across the head dimension.
    for (int e = threadIdx.x; e < first; e += blockDim.x) row[e] = 0.0f;
    for (int e = first + warp; e < visible; e += warps) {
        const float* k = keys + (size_t)e * kv_dim + kvh * head_dim;
        float acc = 0.0f;
        for (int d = lane; d < head_dim; d += 32) acc += qs[d] * k[d];
        acc = warp_sum(acc);
        if (lane == 0) row[e] = acc * scale;
    }
    for (int e = visible + threadIdx.x; e < span; e += blockDim.x) row[e] = 0.0f;
    __syncthreads();

    // Softmax per segment; each segment's weight in the merge is exp(lse_seg - lse_all).
    int cut = (split > first && split < visible) ? split : first;
    int seg_start[2] = {first, cut}, seg_end[2] = {cut, visible};
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
    for (int e = first + threadIdx.x; e < visible; e += blockDim.x)
        row[e] *= e < cut ? norm_a : norm_b;
    __syncthreads();

    // Output: the block splits into groups of head_dim threads; group g sums keys g, g + G,
    // ... with two accumulators (more loads in flight), then the groups' partial sums are
    // added in a fixed order.
    int groups = blockDim.x / head_dim;
    int g = threadIdx.x / head_dim, d = threadIdx.x % head_dim;
    float acc0 = 0.0f, acc1 = 0.0f;
    if (g < groups) {
        const float* v = values + kvh * head_dim + d;
        int e = first + g;
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

// Decode attention split over the keys (flash-decoding): one query, many keys, so one block per
// head would leave most of the GPU idle. Block (head, c) takes chunk c of at most DECODE_CHUNK
// keys (chunks never straddle the cascade split), keeps exp(score - chunk max) in `probs` and
// writes [chunk max, chunk sum, partial output (head_dim)] to `part`; the head's last block
// then merges them (merge_head). Blocks past the last key write an empty chunk. `meta[0]` is
// base.
#define DECODE_CHUNK 64
#define DECODE_THREADS 256
#define DECODE_WARPS (DECODE_THREADS / 32)
#define DECODE_KEYS_PER_WARP (DECODE_CHUNK / DECODE_WARPS)

__device__ __forceinline__ void decode_chunk(int c, int visible, int cut, int* start, int* end) {
    int na = (cut + DECODE_CHUNK - 1) / DECODE_CHUNK;
    if (c < na) {
        *start = c * DECODE_CHUNK;
        *end = min(*start + DECODE_CHUNK, cut);
    } else {
        *start = cut + (c - na) * DECODE_CHUNK;
        *end = min(*start + DECODE_CHUNK, visible);
    }
}

// How many of a head's chunks hold keys: the grid has a block per chunk of the cache's
// capacity (a captured graph serves every step until the cache grows), and the chunks past
// the last key only leave. They are the last ones (decode_chunk).
__device__ __forceinline__ int decode_chunks_used(int visible, int cut) {
    return (cut + DECODE_CHUNK - 1) / DECODE_CHUNK + (visible - cut + DECODE_CHUNK - 1) / DECODE_CHUNK;
}

// Merges the chunks of heads h0 .. h0 + per - 1 (a block's GQA heads, per <= its warps): per
// cascade segment the log-sum-exp of its chunks, the segments weighted as in `attention`;
// rescales the probabilities in place and writes the output in f32 and bf16. Run by the last
// block of the heads to finish. Each head's arithmetic is the one-head merge's, in its order,
// with the heads side by side (warp a takes head a's weights; the rescale and the output sums
// spread over every thread), so the bits are those of merging them one after the other.
// `smem` holds per * (chunks + 2 * head_dim) floats.
// Other blocks' results are read past L1 (__ldcg): they were written by other SMs.
#define MERGE_BATCH 8

// Word `w` (0: the max, 1: the sum) of chunk c of a head's parts `ph` (rows of `row` floats):
// `first` or `second` where c is one of the two chunks the lane read ahead (lane, lane + 32),
// else loaded.
__device__ __forceinline__ float chunk_word(const float* ph, size_t row, int c, int lane, int w,
                                            float first, float second) {
    int k = (c - lane) >> 5;
    return k == 0 ? first : k == 1 ? second : __ldcg(ph + c * row + w);
}

__device__ void merge_heads(int h0, int per, float* probs, const float* part, float* out,
                            bf16_t* out_bf16, int visible, int cut, int head_dim, int stride,
                            int chunks, float* smem) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int na = (cut + DECODE_CHUNK - 1) / DECODE_CHUNK;
    // Only the chunks that hold keys wrote their parts; `chunks` is the grid's, part's stride.
    int used = decode_chunks_used(visible, cut);
    int span = used + 2 * head_dim;  // a head's factors, then its two halves' sums
    if (warp < per) {
        const float* ph = part + (size_t)(h0 + warp) * chunks * (head_dim + 2);
        float* factor = smem + warp * span;
        // Lanes over chunks: per segment the largest chunk max, then the rescaled sums. A
        // lane's first two chunks' max and sum are read once (a head's first 64 chunks), later
        // ones again where needed: three passes, not three round trips. Segment a's values are
        // the `_a`s, b's the `_b`s (no array indexed at run time, which would sit in local
        // memory).
        size_t row = head_dim + 2;
        float m0 = lane < used ? __ldcg(ph + lane * row) : NEG_INF;
        float s0 = lane < used ? __ldcg(ph + lane * row + 1) : 0.0f;
        float m1 = lane + 32 < used ? __ldcg(ph + (lane + 32) * row) : NEG_INF;
        float s1 = lane + 32 < used ? __ldcg(ph + (lane + 32) * row + 1) : 0.0f;
        float mx_a = NEG_INF, mx_b = NEG_INF, tot_a = 0.0f, tot_b = 0.0f;
        for (int c = lane; c < used; c += 32) {
            float cm = chunk_word(ph, row, c, lane, 0, m0, m1);
            if (c < na) mx_a = fmaxf(mx_a, cm);
            else mx_b = fmaxf(mx_b, cm);
        }
        mx_a = warp_max(mx_a);
        mx_b = warp_max(mx_b);
        for (int c = lane; c < used; c += 32) {
            float cm = chunk_word(ph, row, c, lane, 0, m0, m1);
            float sum = chunk_word(ph, row, c, lane, 1, s0, s1);
            if (sum > 0.0f) {
                if (c < na) tot_a += sum * expf(cm - mx_a);
                else tot_b += sum * expf(cm - mx_b);
            }
        }
        tot_a = warp_sum(tot_a);
        tot_b = warp_sum(tot_b);
        float lse_a = na > 0 ? mx_a + logf(tot_a) : NEG_INF, lse_b = mx_b + logf(tot_b);
        float m = fmaxf(lse_a, lse_b);
        float wa = na > 0 ? expf(lse_a - m) : 0.0f, wb = expf(lse_b - m);
        float norm_a = na > 0 ? wa / (wa + wb) / tot_a : 0.0f, norm_b = wb / (wa + wb) / tot_b;
        for (int c = lane; c < used; c += 32) {
            float cm = chunk_word(ph, row, c, lane, 0, m0, m1);
            float sum = chunk_word(ph, row, c, lane, 1, s0, s1);
            factor[c] = sum > 0.0f ? expf(cm - (c < na ? mx_a : mx_b)) * (c < na ? norm_a : norm_b)
                                   : 0.0f;
        }
    }
    __syncthreads();
    // A thread's probabilities are loaded MERGE_BATCH at a time before any is stored: the
    // compiler may not move a load above a store to the same rows, so one at a time each would
    // wait for its own round trip.
    for (int i0 = threadIdx.x; i0 < per * visible; i0 += MERGE_BATCH * blockDim.x) {
        float p[MERGE_BATCH];
#pragma unroll
        for (int u = 0; u < MERGE_BATCH; u++) {
            int i = i0 + u * blockDim.x;
            p[u] = i < per * visible ? __ldcg(probs + (size_t)(h0 + i / visible) * stride +
                                              i % visible)
                                     : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < MERGE_BATCH; u++) {
            int i = i0 + u * blockDim.x;
            if (i >= per * visible) break;
            int a = i / visible, e = i % visible;
            probs[(size_t)(h0 + a) * stride + e] =
                p[u] * smem[a * span + (e < cut ? e / DECODE_CHUNK : na + (e - cut) / DECODE_CHUNK)];
        }
    }
    // Output: each column's chunks are split between `halves` thread groups (more loads in
    // flight), whose sums meet in shared memory after the factors.
    int halves = head_dim * 2 <= (int)blockDim.x ? 2 : 1;
    int half = threadIdx.x / head_dim, d0 = threadIdx.x % head_dim;
    for (int a = 0; a < per; a++) {
        const float* ph = part + (size_t)(h0 + a) * chunks * (head_dim + 2);
        const float* factor = smem + a * span;
        float* sums = smem + a * span + used;
        for (int d = halves == 2 ? d0 : threadIdx.x; d < head_dim && half < halves;
             d += halves == 2 ? head_dim : blockDim.x) {
            const float* col = ph + 2 + d;
            float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
            int c = halves == 2 ? half : 0, step = halves;
            for (; c + 3 * step < used; c += 4 * step) {
                a0 += factor[c] * __ldcg(col + (size_t)c * (head_dim + 2));
                a1 += factor[c + step] * __ldcg(col + (size_t)(c + step) * (head_dim + 2));
                a2 += factor[c + 2 * step] * __ldcg(col + (size_t)(c + 2 * step) * (head_dim + 2));
                a3 += factor[c + 3 * step] * __ldcg(col + (size_t)(c + 3 * step) * (head_dim + 2));
            }
            for (; c < used; c += step) a0 += factor[c] * __ldcg(col + (size_t)c * (head_dim + 2));
            sums[(halves == 2 ? half : 0) * head_dim + d] = (a0 + a1) + (a2 + a3);
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < per * head_dim; i += blockDim.x) {
        int a = i / head_dim, d = i % head_dim;
        const float* sums = smem + a * span + used;
        float acc = halves == 2 ? sums[d] + sums[head_dim + d] : sums[d];
        size_t o = (size_t)(h0 + a) * head_dim + d;
        out[o] = acc;
        out_bf16[o] = f32_to_bf16(acc);
    }
}

__device__ void merge_head(int h, float* probs, const float* part, float* out, bf16_t* out_bf16,
                           int visible, int cut, int head_dim, int stride, int chunks,
                           float* factor) {
    merge_heads(h, 1, probs, part, out, out_bf16, visible, cut, head_dim, stride, chunks, factor);
}

// Decode attention: block (head, c) scores chunk c's keys, keeps exp(score - chunk max) in
// `probs` and writes [chunk max, chunk sum, partial output] to `part`; the last block of a head
// to finish (counted in `counters`, which it resets for the next step) merges them, so a step
// is one launch. Dynamic shared memory: max(head_dim + max(blockDim.x, head_dim), chunks + 2 *
// head_dim) floats.
__device__ __forceinline__ void attention_decode_block(
    int block, const float* q, const float* keys, const float* values, float* probs, float* part,
    float* out, bf16_t* out_bf16, unsigned int* counters, const int* meta, int split, int heads,
    int kv_heads, int head_dim, int stride, int chunks, float scale) {
    __shared__ float scratch[32];
    __shared__ float sc[DECODE_CHUNK];
    extern __shared__ float qs[];  // head_dim, then max(blockDim.x, head_dim) partial sums
    int h = block / chunks, c = block % chunks;
    int kvh = h / (heads / kv_heads), kv_dim = kv_heads * head_dim;
    int visible = meta[0] + 1;
    int cut = (split > 0 && split < visible) ? split : 0;
    int used = decode_chunks_used(visible, cut);
    // A chunk past the last key: nothing to score, and the merge leaves it out.
    if (c >= used) return;
    int start, end;
    decode_chunk(c, visible, cut, &start, &end);
    float* pm = part + ((size_t)h * chunks + c) * (head_dim + 2);
    {
        int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
        const float* qv = q + (size_t)h * head_dim;
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) qs[d] = qv[d];
        __syncthreads();

        // Scores: warp w takes keys start + w + j * DECODE_WARPS, lanes across the head
        // dimension; the loads for all of a warp's keys are in flight before any reduction.
        float acc[DECODE_KEYS_PER_WARP];
        const float* kbase = keys + kvh * head_dim;
#pragma unroll
        for (int j = 0; j < DECODE_KEYS_PER_WARP; j++) acc[j] = 0.0f;
        for (int d = lane; d < head_dim; d += 32) {
            float qd = qs[d];
#pragma unroll
            for (int j = 0; j < DECODE_KEYS_PER_WARP; j++) {
                int e = start + warp + j * DECODE_WARPS;
                if (e < end) acc[j] += qd * kbase[(size_t)e * kv_dim + d];
            }
        }
#pragma unroll
        for (int j = 0; j < DECODE_KEYS_PER_WARP; j++) {
            float s = warp_sum(acc[j]);
            int e = start + warp + j * DECODE_WARPS;
            if (lane == 0 && e < end) sc[e - start] = s * scale;
        }
        __syncthreads();
        int len = end - start;
        float m = threadIdx.x < len ? sc[threadIdx.x] : NEG_INF;
        m = block_max(m, scratch);
        float p = threadIdx.x < len ? expf(sc[threadIdx.x] - m) : 0.0f;
        float sum = block_sum(p, scratch);
        if (threadIdx.x < len) {
            sc[threadIdx.x] = p;
            probs[(size_t)h * stride + start + threadIdx.x] = p;
        }
        __syncthreads();

        // Partial output: `groups` groups of head_dim threads split the chunk's keys, eight
        // independent loads in flight per thread; their sums meet in shared memory.
        bool fits = head_dim <= (int)blockDim.x;
        int groups = fits ? blockDim.x / head_dim : 1;
        int g = fits ? threadIdx.x / head_dim : 0;
        int dstep = fits ? head_dim : blockDim.x;
        float* red = qs + head_dim;
        if (g < groups) {
            for (int d = fits ? threadIdx.x % head_dim : threadIdx.x; d < head_dim; d += dstep) {
                const float* v = values + (size_t)start * kv_dim + kvh * head_dim + d;
                float a[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
                int e = g;
                for (; e + 7 * groups < len; e += 8 * groups) {
#pragma unroll
                    for (int u = 0; u < 8; u++)
                        a[u] += sc[e + u * groups] * v[(size_t)(e + u * groups) * kv_dim];
                }
                for (; e < len; e += groups) a[0] += sc[e] * v[(size_t)e * kv_dim];
                red[g * head_dim + d] =
                    ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
            }
        }
        __syncthreads();
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
            float s = 0.0f;
            for (int j = 0; j < groups; j++) s += red[j * head_dim + d];
            pm[2 + d] = s;
        }
        if (threadIdx.x == 0) {
            pm[0] = m;
            pm[1] = sum;
        }
    }
    // Count this chunk in; the head's last one merges.
    if (!last_block_done(&counters[h], used)) return;
    merge_head(h, probs, part, out, out_bf16, visible, cut, head_dim, stride, chunks, qs);
}

extern "C" __global__ void attention_decode(const float* q, const float* keys,
                                            const float* values, float* probs, float* part,
                                            float* out, bf16_t* out_bf16,
                                            unsigned int* counters, const int* meta, int split,
                                            int heads, int kv_heads, int head_dim, int stride,
                                            int chunks, float scale) {
    PDL_ENTER();
    attention_decode_block(blockIdx.x, q, keys, values, probs, part, out, out_bf16, counters,
                           meta, split, heads, kv_heads, head_dim, stride, chunks, scale);
}

// One decode token per side (`Sides`), each over its own cache: grid sides * per_side
// (heads times the most chunks of any side), side-major; a side with fewer chunks leaves the
// blocks past its own.
extern "C" __global__ void attention_decode_sides(Sides q, Sides keys, Sides values, Sides probs,
                                                  Sides part, Sides out, Sides out_bf16,
                                                  Sides counters, Sides meta, SideInts split,
                                                  int heads, int kv_heads, int head_dim,
                                                  SideInts stride, SideInts chunks, int per_side,
                                                  float scale) {
    PDL_ENTER();
    int s = blockIdx.x / per_side, b = blockIdx.x % per_side;
    if (b >= heads * side_int(chunks, s)) return;
    attention_decode_block(b, at_side<const float>(q, s), at_side<const float>(keys, s),
                           at_side<const float>(values, s), at_side<float>(probs, s),
                           at_side<float>(part, s), at_side<float>(out, s),
                           at_side<bf16_t>(out_bf16, s), at_side<unsigned int>(counters, s),
                           at_side<const int>(meta, s), side_int(split, s), heads, kv_heads,
                           head_dim, side_int(stride, s), side_int(chunks, s), scale);
}

// The step's q/k norm, RoPE and cache append (qk_norm_rope for one token), folded into the
// decode attention that reads them: a launch less per layer on a chain of latency-bound
// kernels. `meta` is qk_norm_rope's: the query's position, the key's position, the cache entry.
struct StepRope {
    const float* qkv;
    const bf16_t* q_weight;
    const bf16_t* k_weight;
    const int* meta;
    const float* inv_freq;
    float* q_normed;
    float* q_rotated;
    float* k_normed;
    float* k_rotated;
    float eps;
    float scale;
};

// attention_decode for head_dim 128, built for latency: a decode step's attention is a chain
// of dependent memory round trips, not a bandwidth problem (a few MB). Lane l holds dims
// 4l..4l+3 as float4s; warp w takes keys start + w + j * DECODE_WARPS, and every key and value
// of the block is loaded before the first reduction, so the chunk costs one round trip instead
// of one per loop turn. Same output layout, probabilities and merge as attention_decode.
// A block takes `per` query heads of one KV head (a GQA group, up to DECODE_GROUP; `block` /
// chunks counts them) and scores each against the keys it loaded once: each head's arithmetic
// is the one-head block's, in its order, so the bits do not depend on `per`.
// ROPE: the queries come from the QKV row (`rope`), normalised and turned here while the keys
// load (two vectors at a time, a half block each: the queries, then the new key where this
// block needs it); the block whose chunk holds the new key uses the key it turned, and the
// first block of the KV head's chunk 0 writes the cache entry and the key taps, chunk 0's
// blocks the query taps.
#define DECODE_GROUP 8
template <bool ROPE>
__device__ __forceinline__ void attention_decode_128_block(
    int block, const float* q, float* keys, float* values, float* probs, float* part,
    float* out, bf16_t* out_bf16, unsigned int* counters, const int* meta, int split, int heads,
    int kv_heads, int per, int stride, int chunks, float scale, const StepRope& rope) {
    static_assert(DECODE_CHUNK == 64 && DECODE_WARPS == 8, "two scores per lane, 8 keys per warp");
    __shared__ float sc[DECODE_GROUP][DECODE_CHUNK];
    __shared__ float4 red[DECODE_WARPS][32];
    __shared__ float stat[DECODE_GROUP][2];
    __shared__ float4 turned[DECODE_GROUP + 2][32];  // ROPE: the queries, the new key, its value
    extern __shared__ float factor[];  // merge_heads' per * (chunks + 2 * head_dim) floats
    int h0 = block / chunks * per, c = block % chunks;
    int group = heads / kv_heads, kvh = h0 / group, kv_dim = kv_heads * 128;
    int visible = meta[0] + 1;
    int cut = (split > 0 && split < visible) ? split : 0;
    int used = decode_chunks_used(visible, cut);
    // A chunk past the last key: nothing to score, and the merge leaves it out. (Chunk 0,
    // which writes the new key with ROPE, always holds keys.)
    if (c >= used) return;
    int start, end;
    decode_chunk(c, visible, cut, &start, &end);
    int slot = ROPE ? rope.meta[2] : -1;
    bool writer = ROPE && c == 0 && h0 % group == 0;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, len = end - start;
    {
        const float* kb = keys + (size_t)kvh * 128 + lane * 4;
        const float* vb = values + (size_t)kvh * 128 + lane * 4;
        float4 kk[DECODE_KEYS_PER_WARP], vv[DECODE_KEYS_PER_WARP];
#pragma unroll
        for (int j = 0; j < DECODE_KEYS_PER_WARP; j++) {
            int e = start + warp + j * DECODE_WARPS;
            kk[j] = vv[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            // The new key's entry is being written (ROPE): its key and value come below.
            if (e < end && e != slot) {
                kk[j] = *(const float4*)(kb + (size_t)e * kv_dim);
                // With ROPE the values load once the scores are taken (below), in the
                // registers the keys held: four blocks an SM.
                if (!ROPE) vv[j] = *(const float4*)(vb + (size_t)e * kv_dim);
            }
        }
        bool has_new = ROPE && start <= slot && slot < end;
        if (ROPE) {
            __shared__ float normed[2][128];
            __shared__ float squares[DECODE_WARPS];
            int i = threadIdx.x & 127, is_k = threadIdx.x >> 7;
            // Item `per` is the new key; one round turns items 2r (threads 0-127) and 2r + 1.
            for (int r = 0; 2 * r <= per; r++) {
                int item = 2 * r + is_k;
                bool key = item == per;
                bool active = item < per || (key && (has_new || writer));
                int col = key ? (heads + kvh) * 128 : (h0 + item) * 128;
                float v = active ? rope.qkv[col + i] : 0.0f;
                // block_sum's order over each half's four warps: qk_norm_rope's bits.
                float ss = warp_sum(v * v);
                if (lane == 0) squares[warp] = ss;
                __syncthreads();
                ss = warp_sum(lane < 4 ? squares[4 * is_k + lane] : 0.0f);
                float y = head_norm(v, ss, rope.q_weight ? (key ? rope.k_weight : rope.q_weight)
                                                         : nullptr, i, 128, rope.eps);
                normed[is_k][i] = y;
                __syncthreads();
                float t = rope_element(normed[is_k], i, 128, rope.meta[key ? 1 : 0],
                                       rope.inv_freq, rope.scale);
                if (item <= per) ((float*)turned[item])[i] = t;
                if (item < per && c == 0) {
                    rope.q_normed[(h0 + item) * 128 + i] = y;
                    rope.q_rotated[(h0 + item) * 128 + i] = t;
                }
                if (key && active) {
                    float val = rope.qkv[(heads + kv_heads + kvh) * 128 + i];
                    ((float*)turned[per + 1])[i] = val;
                    if (writer) {
                        rope.k_normed[kvh * 128 + i] = y;
                        rope.k_rotated[kvh * 128 + i] = t;
                        keys[(size_t)slot * kv_dim + kvh * 128 + i] = t;
                        values[(size_t)slot * kv_dim + kvh * 128 + i] = val;
                    }
                }
                // normed and squares are taken again next round.
                __syncthreads();
            }
#pragma unroll
            for (int j = 0; j < DECODE_KEYS_PER_WARP; j++) {
                // Only inside the chunk: past its end the key's value would still meet a
                // zero probability, and 0 * NaN of unwritten shared memory is NaN.
                if (has_new && start + warp + j * DECODE_WARPS == slot) kk[j] = turned[per][lane];
            }
        }
        for (int a = 0; a < per; a++) {
            float4 qv = ROPE ? turned[a][lane] : ((const float4*)(q + (size_t)(h0 + a) * 128))[lane];
            float dots[DECODE_KEYS_PER_WARP];
#pragma unroll
            for (int j = 0; j < DECODE_KEYS_PER_WARP; j++)
                dots[j] = (qv.x * kk[j].x + qv.y * kk[j].y) + (qv.z * kk[j].z + qv.w * kk[j].w);
#pragma unroll
            for (int j = 0; j < DECODE_KEYS_PER_WARP; j++) {
                float s = warp_sum(dots[j]);
                int i = warp + j * DECODE_WARPS;
                if (lane == 0 && i < len) sc[a][i] = s * scale;
            }
        }
        if (ROPE) {
#pragma unroll
            for (int j = 0; j < DECODE_KEYS_PER_WARP; j++) {
                int e = start + warp + j * DECODE_WARPS;
                if (e < end && e != slot) vv[j] = *(const float4*)(vb + (size_t)e * kv_dim);
                if (e < end && e == slot) vv[j] = turned[per + 1][lane];
            }
        }
        __syncthreads();
        // Warp a takes head a's softmax; DECODE_CHUNK = 64: two scores per lane.
        for (int a = warp; a < per; a += DECODE_WARPS) {
            float x = lane < len ? sc[a][lane] : NEG_INF;
            float y = lane + 32 < len ? sc[a][lane + 32] : NEG_INF;
            float m = warp_max(fmaxf(x, y));
            float px = lane < len ? expf(x - m) : 0.0f;
            float py = lane + 32 < len ? expf(y - m) : 0.0f;
            float sum = warp_sum(px + py);
            float* row = probs + (size_t)(h0 + a) * stride + start;
            if (lane < len) {
                sc[a][lane] = px;
                row[lane] = px;
            }
            if (lane + 32 < len) {
                sc[a][lane + 32] = py;
                row[lane + 32] = py;
            }
            if (lane == 0) {
                stat[a][0] = m;
                stat[a][1] = sum;
            }
        }
        __syncthreads();
        for (int a = 0; a < per; a++) {
            float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
            for (int j = 0; j < DECODE_KEYS_PER_WARP; j++) {
                int i = warp + j * DECODE_WARPS;
                float p = i < len ? sc[a][i] : 0.0f;
                acc.x += p * vv[j].x;
                acc.y += p * vv[j].y;
                acc.z += p * vv[j].z;
                acc.w += p * vv[j].w;
            }
            if (a > 0) __syncthreads();  // head a - 1's sums are read
            red[warp][lane] = acc;
            __syncthreads();
            float* pm = part + ((size_t)(h0 + a) * chunks + c) * (128 + 2);
            if (threadIdx.x < 128) {
                const float* r = (const float*)red;
                float s = 0.0f;
#pragma unroll
                for (int w = 0; w < DECODE_WARPS; w++) s += r[w * 128 + threadIdx.x];
                pm[2 + threadIdx.x] = s;
            }
            if (threadIdx.x == 0) {
                pm[0] = stat[a][0];
                pm[1] = stat[a][1];
            }
        }
    }
    // Count this chunk in (one counter for the block's heads); the last one merges them.
    if (!last_block_done(&counters[h0], used)) return;
    merge_heads(h0, per, probs, part, out, out_bf16, visible, cut, 128, stride, chunks, factor);
}

// `per`: query heads a block takes (a divisor of the GQA group, at most DECODE_GROUP); the grid
// has heads / per * chunks blocks.
extern "C" __global__ void attention_decode_128(const float* q, const float* keys,
                                                const float* values, float* probs, float* part,
                                                float* out, bf16_t* out_bf16,
                                                unsigned int* counters, const int* meta,
                                                int split, int heads, int kv_heads, int per,
                                                int stride, int chunks, float scale) {
    PDL_ENTER();
    attention_decode_128_block<false>(blockIdx.x, q, (float*)keys, (float*)values, probs, part,
                                      out, out_bf16, counters, meta, split, heads, kv_heads, per,
                                      stride, chunks, scale, StepRope{});
}

// attention_decode_128 with the step's qk_norm_rope folded in (StepRope).
extern "C" __global__ void attention_decode_128_rope(
    const float* qkv, const bf16_t* q_weight, const bf16_t* k_weight, const int* rope_meta,
    const float* inv_freq, float* q_normed, float* q_rotated, float* k_normed, float* k_rotated,
    float eps, float rope_scale, float* keys, float* values, float* probs, float* part,
    float* out, bf16_t* out_bf16, unsigned int* counters, const int* meta, int split, int heads,
    int kv_heads, int per, int stride, int chunks, float scale) {
    PDL_ENTER();
    StepRope rope{qkv,      q_weight,  k_weight, rope_meta, inv_freq,
                  q_normed, q_rotated, k_normed, k_rotated, eps,      rope_scale};
    attention_decode_128_block<true>(blockIdx.x, nullptr, keys, values, probs, part, out,
                                     out_bf16, counters, meta, split, heads, kv_heads, per,
                                     stride, chunks, scale, rope);
}

// Block b of side s of the `_sides` kernels below: that side's buffers picked.
template <bool ROPE>
__device__ __forceinline__ void attention_decode_128_side(
    int s, int b, const float* q, Sides keys, Sides values, Sides probs, Sides part, Sides out,
    Sides out_bf16, Sides counters, Sides meta, SideInts split, int heads, int kv_heads, int per,
    SideInts stride, SideInts chunks, float scale, const StepRope& rope) {
    attention_decode_128_block<ROPE>(b, q, at_side<float>(keys, s), at_side<float>(values, s),
                                     at_side<float>(probs, s), at_side<float>(part, s),
                                     at_side<float>(out, s), at_side<bf16_t>(out_bf16, s),
                                     at_side<unsigned int>(counters, s),
                                     at_side<const int>(meta, s), side_int(split, s), heads,
                                     kv_heads, per, side_int(stride, s), side_int(chunks, s),
                                     scale, rope);
}

// attention_decode_sides for head_dim 128 (rows 16-byte aligned), `per` query heads a block
// as attention_decode_128. Three blocks an SM, as the single kernel gets: picking each side's
// buffers would otherwise hold registers enough to leave two.
extern "C" __global__ void __launch_bounds__(DECODE_THREADS, 3) attention_decode_128_sides(
    Sides q, Sides keys, Sides values, Sides probs, Sides part, Sides out, Sides out_bf16,
    Sides counters, Sides meta, SideInts split, int heads, int kv_heads, int per,
    SideInts stride, SideInts chunks, int per_side, float scale) {
    PDL_ENTER();
    int s = blockIdx.x / per_side, b = blockIdx.x % per_side;
    if (b >= heads / per * side_int(chunks, s)) return;
    attention_decode_128_side<false>(s, b, at_side<const float>(q, s), keys, values, probs, part,
                                     out, out_bf16, counters, meta, split, heads, kv_heads, per,
                                     stride, chunks, scale, StepRope{});
}

// attention_decode_128_sides with each side's qk_norm_rope folded in (StepRope), built for
// DECODE_ROPE_SIDES_BLOCKS blocks an SM (the values load after the scores, in the keys'
// registers). Three (scripts/bench_decode_attention.sh, 576 keys): at Qwen3-8B's shape 32
// us a launch for seven sides against 38 for two; four spill 40 bytes a thread, and took 28
// there but 36 against 34 for eight sides and 20 against 18 at Qwen3-0.6B's for five.
#ifndef DECODE_ROPE_SIDES_BLOCKS
#define DECODE_ROPE_SIDES_BLOCKS 3
#endif
extern "C" __global__ void __launch_bounds__(DECODE_THREADS, DECODE_ROPE_SIDES_BLOCKS) attention_decode_128_rope_sides(
    Sides qkv, const bf16_t* q_weight, const bf16_t* k_weight, Sides rope_meta,
    const float* inv_freq, Sides q_normed, Sides q_rotated, Sides k_normed, Sides k_rotated,
    float eps, float rope_scale, Sides keys, Sides values, Sides probs, Sides part, Sides out,
    Sides out_bf16, Sides counters, Sides meta, SideInts split, int heads, int kv_heads, int per,
    SideInts stride, SideInts chunks, int per_side, float scale) {
    PDL_ENTER();
    int s = blockIdx.x / per_side, b = blockIdx.x % per_side;
    if (b >= heads / per * side_int(chunks, s)) return;
    StepRope rope{at_side<const float>(qkv, s), q_weight,  k_weight,
                  at_side<const int>(rope_meta, s), inv_freq, at_side<float>(q_normed, s),
                  at_side<float>(q_rotated, s),     at_side<float>(k_normed, s),
                  at_side<float>(k_rotated, s),     eps,      rope_scale};
    attention_decode_128_side<true>(s, b, nullptr, keys, values, probs, part, out, out_bf16,
                                    counters, meta, split, heads, kv_heads, per, stride, chunks,
                                    scale, rope);
}

// Prefill attention in tiles (flash-attention's online softmax): block (head, query tile) takes
// TILE_Q queries and walks the keys they see in tiles of TILE_K held in shared memory, so each
// key is read once per tile of queries, not once per query. Per query, both cascade segments
// keep a running max and sum and their own output; the end merges them as `attention` does.
// With `probs` non-null, a second walk recomputes the scores and writes the merged
// probabilities (columns visible..base+n zeroed), as `attention`; without, nothing is written
// there. Needs head_dim % 4 == 0 and head_dim <= TILE_THREADS. `meta[0]` is base.
// Dynamic shared memory: TILE_SHARED(head_dim) floats.
#define TILE_Q 16
#define TILE_K 32
#define TILE_THREADS 128
#define TILE_SHARED(hd) ((TILE_Q + TILE_K) * ((hd) + 1) + TILE_K * (hd) + 2 * TILE_Q * TILE_K)

// Keys k0..k0 + TILE_K of KV head kvh into `ks` (rows of hp floats), and their values into `vs`
// (rows of head_dim) unless it is null; zeros past kend.
__device__ void load_kv_tile(const float* keys, const float* values, float* ks, float* vs,
                             int k0, int kend, int kv_dim, int kvh, int head_dim, int hp) {
    int vec = head_dim / 4;
    for (int i = threadIdx.x; i < TILE_K * vec; i += blockDim.x) {
        int r = i / vec, c = (i % vec) * 4;
        float4 kk = make_float4(0.0f, 0.0f, 0.0f, 0.0f), vv = kk;
        if (k0 + r < kend) {
            size_t off = (size_t)(k0 + r) * kv_dim + kvh * head_dim + c;
            kk = *(const float4*)(keys + off);
            if (vs) vv = *(const float4*)(values + off);
        }
        float* kr = ks + r * hp + c;
        kr[0] = kk.x;
        kr[1] = kk.y;
        kr[2] = kk.z;
        kr[3] = kk.w;
        if (vs) *(float4*)(vs + r * head_dim + c) = vv;
    }
}

extern "C" __global__ void attention_tiled(const float* q, const float* keys, const float* values,
                                           float* probs, float* stats, float* out,
                                           bf16_t* out_bf16, const int* meta, int n, int split,
                                           int heads, int kv_heads, int head_dim, int stride,
                                           float scale) {
    PDL_ENTER();
    extern __shared__ float sm[];
    __shared__ float alpha[TILE_Q][2], fin[TILE_Q][2], mfin[TILE_Q][2];
    __shared__ int cuts[TILE_Q];
    int hp = head_dim + 1;  // padded rows: the lanes of a warp read different rows
    float* qs = sm;
    float* ks = qs + TILE_Q * hp;
    float* vs = ks + TILE_K * hp;
    float* pa = vs + TILE_K * head_dim;
    float* pb = pa + TILE_Q * TILE_K;
    int tiles_q = (n + TILE_Q - 1) / TILE_Q;
    int h = blockIdx.x / tiles_q, q0 = (blockIdx.x % tiles_q) * TILE_Q;
    int nq = min(TILE_Q, n - q0);
    int kvh = h / (heads / kv_heads), kv_dim = kv_heads * head_dim;
    int base = meta[0];
    int kend = base + q0 + nq;  // keys the block's last query sees
    int tid = threadIdx.x;
    for (int i = tid; i < TILE_Q * head_dim; i += blockDim.x) {
        int r = i / head_dim, d = i % head_dim;
        qs[r * hp + d] = r < nq ? q[((size_t)(q0 + r) * heads + h) * head_dim + d] : 0.0f;
    }
    if (tid < TILE_Q) {
        int vis = base + q0 + tid + 1;
        cuts[tid] = (split > 0 && split < vis) ? split : 0;
    }
    bool cascade = split > 0 && split < kend;
    // Scores: thread (sq, sj) takes query sq and keys sj, sj + 8, sj + 16, sj + 24 of a tile;
    // the 8 threads of a query are neighbouring lanes and reduce by shuffles.
    int sq = tid / 8, sj = tid % 8;
    int vis_s = base + q0 + sq + 1;
    int cut_s = (split > 0 && split < vis_s) ? split : 0;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    float acc0[TILE_Q], acc1[TILE_Q];
#pragma unroll
    for (int i = 0; i < TILE_Q; i++) acc0[i] = acc1[i] = 0.0f;
    __syncthreads();
    for (int k0 = 0; k0 < kend; k0 += TILE_K) {
        load_kv_tile(keys, values, ks, vs, k0, kend, kv_dim, kvh, head_dim, hp);
        __syncthreads();
        float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int d = 0; d < head_dim; d++) {
            float qd = qs[sq * hp + d];
#pragma unroll
            for (int i = 0; i < 4; i++) s[i] += qd * ks[(sj + 8 * i) * hp + d];
        }
        float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int e = k0 + sj + 8 * i;
            s[i] = sq < nq && e < vis_s ? s[i] * scale : NEG_INF;
            if (e < cut_s) mx[0] = fmaxf(mx[0], s[i]);
            else mx[1] = fmaxf(mx[1], s[i]);
        }
        float al[2], ps[2] = {0.0f, 0.0f};
#pragma unroll
        for (int g = 0; g < 2; g++) {
            for (int o = 1; o < 8; o <<= 1) mx[g] = fmaxf(mx[g], __shfl_xor_sync(0xffffffffu, mx[g], o));
            float mn = fmaxf(m[g], mx[g]);
            al[g] = m[g] == NEG_INF ? 0.0f : expf(m[g] - mn);
            m[g] = mn;
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int j = sj + 8 * i, e = k0 + j;
            int g = e < cut_s ? 0 : 1;
            float p = s[i] == NEG_INF ? 0.0f : expf(s[i] - m[g]);
            ps[g] += p;
            pa[sq * TILE_K + j] = g == 0 ? p : 0.0f;
            pb[sq * TILE_K + j] = g == 1 ? p : 0.0f;
        }
#pragma unroll
        for (int g = 0; g < 2; g++) {
            for (int o = 1; o < 8; o <<= 1) ps[g] += __shfl_xor_sync(0xffffffffu, ps[g], o);
            l[g] = l[g] * al[g] + ps[g];
        }
        if (sj == 0) {
            alpha[sq][0] = al[0];
            alpha[sq][1] = al[1];
        }
        __syncthreads();
        if (tid < head_dim) {
            int jmax = min(TILE_K, kend - k0);
#pragma unroll
            for (int r = 0; r < TILE_Q; r++) {
                acc0[r] *= alpha[r][0];
                acc1[r] *= alpha[r][1];
            }
            for (int j = 0; j < jmax; j++) {
                float v = vs[j * head_dim + tid];
#pragma unroll
                for (int r = 0; r < TILE_Q; r++) acc1[r] += pb[r * TILE_K + j] * v;
                if (cascade) {
#pragma unroll
                    for (int r = 0; r < TILE_Q; r++) acc0[r] += pa[r * TILE_K + j] * v;
                }
            }
        }
        __syncthreads();
    }
    // Segment weights as in `attention`: exp(lse_segment - lse_all), over each segment's sum.
    if (sj == 0) {
        float fa = 0.0f, fb = 0.0f;
        if (sq < nq) {
            float lse_a = l[0] > 0.0f ? m[0] + logf(l[0]) : NEG_INF, lse_b = m[1] + logf(l[1]);
            float mm = fmaxf(lse_a, lse_b);
            float wa = l[0] > 0.0f ? expf(lse_a - mm) : 0.0f, wb = expf(lse_b - mm);
            fa = l[0] > 0.0f ? wa / (wa + wb) / l[0] : 0.0f;
            fb = wb / (wa + wb) / l[1];
        }
        fin[sq][0] = fa;
        fin[sq][1] = fb;
        mfin[sq][0] = m[0];
        mfin[sq][1] = m[1];
        // What `probs_from_stats` needs to rebuild the row's probabilities bit for bit.
        if (stats && sq < nq) {
            float* st = stats + ((size_t)(q0 + sq) * heads + h) * 4;
            st[0] = m[0];
            st[1] = m[1];
            st[2] = fa;
            st[3] = fb;
        }
    }
    __syncthreads();
    if (tid < head_dim) {
        for (int r = 0; r < nq; r++) {
            float o = acc0[r] * fin[r][0] + acc1[r] * fin[r][1];
            size_t at = ((size_t)(q0 + r) * heads + h) * head_dim + tid;
            out[at] = o;
            out_bf16[at] = f32_to_bf16(o);
        }
    }
    if (!probs) return;
    // Probabilities: lane pj takes key pj of the tile, warps take queries, so each row is
    // written 32 floats at a time.
    int span = base + n, pj = tid % 32, pw = tid / 32, warps = blockDim.x / 32;
    for (int k0 = 0; k0 < span; k0 += TILE_K) {
        if (k0 < kend) {
            __syncthreads();
            load_kv_tile(keys, values, ks, nullptr, k0, kend, kv_dim, kvh, head_dim, hp);
            __syncthreads();
        }
        int e = k0 + pj;
        if (e >= span) continue;
        for (int r = pw; r < nq; r += warps) {
            int vis = base + q0 + r + 1;
            float val = 0.0f;
            if (e < vis) {
                float acc = 0.0f;
                for (int d = 0; d < head_dim; d++) acc += qs[r * hp + d] * ks[pj * hp + d];
                int g = e < cuts[r] ? 0 : 1;
                val = expf(acc * scale - mfin[r][g]) * fin[r][g];
            }
            probs[((size_t)(q0 + r) * heads + h) * stride + e] = val;
        }
    }
}

// The attention probabilities of chosen rows, rebuilt from what `attention_tiled` kept of them
// (`stats`: per query and head, each segment's running max and weight) with the arithmetic of
// its own probabilities loop (same tiles in shared memory, same sums in the same order), so
// the values are the ones it would have written. This is how a reference keeps a long prompt's
// attention without tokens^2 memory: q, keys and four floats per row, rows rebuilt a tile at a
// time where a path's rows are compared.
// Block of 128 threads per (REBUILD_Q rows of `rows`, head): thread t computes rows
// 2 * (t / 16) + {0, 1} against keys t % 16 + {0, 16, 32, 48} of each REBUILD_K-key tile, every
// dot product summed over head_dim in order, as the attention kernel sums it. `rows[i]` is a
// query's index in its pass; `out` is [count, heads, span]; entries at or past the query's
// `base + index + 1` are 0. Dynamic shared memory: (REBUILD_Q + REBUILD_K) * (head_dim + 1)
// floats.
#define REBUILD_Q 16
#define REBUILD_K 64
extern "C" __global__ void probs_from_stats(const float* q, const float* keys, const float* stats,
                                            const int* rows, float* out, int count, int base,
                                            int split, int heads, int kv_heads, int head_dim,
                                            int span, float scale) {
    PDL_ENTER();
    extern __shared__ float sm[];
    __shared__ float st[REBUILD_Q][4];
    __shared__ int vis[REBUILD_Q], cut[REBUILD_Q];
    int hp = head_dim + 1;
    float* qs = sm;
    float* ks = qs + REBUILD_Q * hp;
    int tiles = (count + REBUILD_Q - 1) / REBUILD_Q;
    int h = blockIdx.x / tiles, i0 = (blockIdx.x % tiles) * REBUILD_Q;
    int nq = min(REBUILD_Q, count - i0);
    int kvh = h / (heads / kv_heads), kv_dim = kv_heads * head_dim;
    int tid = threadIdx.x;
    for (int i = tid; i < REBUILD_Q * head_dim; i += blockDim.x) {
        int r = i / head_dim, d = i % head_dim;
        qs[r * hp + d] = r < nq ? q[((size_t)rows[i0 + r] * heads + h) * head_dim + d] : 0.0f;
    }
    if (tid < REBUILD_Q) {
        int qi = tid < nq ? rows[i0 + tid] : 0;
        int v = tid < nq ? base + qi + 1 : 0;
        vis[tid] = v;
        cut[tid] = (split > 0 && split < v) ? split : 0;
        const float* s = stats + ((size_t)qi * heads + h) * 4;
        for (int j = 0; j < 4; j++) st[tid][j] = tid < nq ? s[j] : 0.0f;
    }
    __syncthreads();
    int kend = 0;
    for (int r = 0; r < nq; r++) kend = max(kend, vis[r]);
    int kg = tid % 16, r0 = (tid / 16) * 2;
    int vec = head_dim / 4;
    for (int k0 = 0; k0 < span; k0 += REBUILD_K) {
        float acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
        if (k0 < kend) {
            __syncthreads();
            for (int i = tid; i < REBUILD_K * vec; i += blockDim.x) {
                int r = i / vec, c = (i % vec) * 4;
                float4 kk = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (k0 + r < kend) kk = *(const float4*)(keys + (size_t)(k0 + r) * kv_dim + kvh * head_dim + c);
                float* kr = ks + r * hp + c;
                kr[0] = kk.x;
                kr[1] = kk.y;
                kr[2] = kk.z;
                kr[3] = kk.w;
            }
            __syncthreads();
            for (int d = 0; d < head_dim; d++) {
                float a0 = qs[r0 * hp + d], a1 = qs[(r0 + 1) * hp + d];
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    float kd = ks[(kg + 16 * j) * hp + d];
                    acc[0][j] += a0 * kd;
                    acc[1][j] += a1 * kd;
                }
            }
        }
#pragma unroll
        for (int i = 0; i < 2; i++) {
            int r = r0 + i;
            if (r >= nq) continue;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                int e = k0 + kg + 16 * j;
                if (e >= span) continue;
                float val = 0.0f;
                if (e < vis[r]) {
                    int g = e < cut[r] ? 0 : 1;
                    val = expf(acc[i][j] * scale - st[r][g]) * st[r][2 + g];
                }
                out[((size_t)(i0 + r) * heads + h) * span + e] = val;
            }
        }
    }
}
