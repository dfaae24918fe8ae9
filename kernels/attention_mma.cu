// Prefill attention on tensor cores (sm_80 and later): what `attention_tiled` computes, with
// every dot product (scores Q·Kᵀ and output P·V) taken as three TF32 products per operand pair
// (big·big + big·small + small·big, each f32 split into a TF32 and the TF32 of its remainder),
// which keeps about f32 accuracy at tensor-core speed.
//
// One pass over the keys computes the output by online softmax and each row's statistics (per
// segment of a cascade split: max and weight). Where probabilities are asked for, a second
// pass recomputes the scores and writes p = exp(s·scale - max) · weight. `probs_from_stats_mma`
// computes scores with the same `mma_scores` and probabilities with the same `prob_of`, so it
// rebuilds any row bit for bit from q, the keys and the four statistics per row.
//
// Block: 4 warps; warp w takes queries q0 + 16w .. +16 of one head; keys go through shared
// memory MMA_KT at a time. Needs head_dim % 8 == 0 and head_dim <= MMA_MAXD. Rows in shared
// memory are head_dim + 4 floats apart, so the fragment loads of a warp hit 32 different banks.
// Dynamic shared memory: MMA_SHARED(head_dim) floats.
#define MMA_BQ 64
#define MMA_KT 32
#define MMA_MAXD 128
#define MMA_SHARED(hd) ((MMA_BQ + 2 * MMA_KT) * ((hd) + 4))
#define MMA_RB_KEYS 1024

#if __CUDA_ARCH__ >= 800
__device__ __forceinline__ unsigned to_tf32(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ void split_tf32(float x, unsigned& big, unsigned& small) {
    big = to_tf32(x);
    small = to_tf32(__fsub_rn(x, __uint_as_float(big)));
}

__device__ __forceinline__ void mma_tf32(float* d, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// d (16x8) += a (16x8, the A fragment of m16n8k8) · b (8x8, its B fragment), about f32-exact.
__device__ __forceinline__ void mma_3xtf32(float* d, const float* a, const float* b) {
    unsigned ab[4], as[4], bb[2], bs[2];
#pragma unroll
    for (int i = 0; i < 4; i++) split_tf32(a[i], ab[i], as[i]);
#pragma unroll
    for (int i = 0; i < 2; i++) split_tf32(b[i], bb[i], bs[i]);
    mma_tf32(d, as, bb);
    mma_tf32(d, ab, bs);
    mma_tf32(d, ab, bb);
}

// Raw scores of a warp's 16 query rows (`qw`, rows hp floats apart) against MMA_KT keys (`ks`):
// s[j] is the C fragment of keys 8j..8j+8, i.e. lane (g = lane / 4, t = lane % 4) holds rows g
// and g + 8 at keys 8j + 2t and 8j + 2t + 1 in s[j][0], s[j][1] (row g), s[j][2], s[j][3]
// (row g + 8). The attention kernel and the rebuild both call this, so both get the same bits.
__device__ __forceinline__ void mma_scores(const float* qw, const float* ks, int hp, int head_dim,
                                           float s[MMA_KT / 8][4]) {
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < MMA_KT / 8; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
    for (int k0 = 0; k0 < head_dim; k0 += 8) {
        float a[4] = {qw[g * hp + k0 + t], qw[(g + 8) * hp + k0 + t], qw[g * hp + k0 + t + 4],
                      qw[(g + 8) * hp + k0 + t + 4]};
#pragma unroll
        for (int j = 0; j < MMA_KT / 8; j++) {
            const float* kr = ks + (j * 8 + g) * hp + k0;
            float b[2] = {kr[t], kr[t + 4]};
            mma_3xtf32(s[j], a, b);
        }
    }
}

// A score's probability from its row's statistics (segment max m, segment weight f).
__device__ __forceinline__ float prob_of(float raw, float scale, float m, float f) {
    return __fmul_rn(expf(__fsub_rn(__fmul_rn(raw, scale), m)), f);
}

// Rows r0..r0 + rows of `src` (row r at src + r * src_stride + col0, head_dim floats) into
// shared memory `dst` (rows hp apart); zeros past `rows`.
__device__ __forceinline__ void load_rows(const float* src, size_t src_stride, int rows, float* dst,
                                          int count, int head_dim, int hp) {
    int vec = head_dim / 4;
    for (int i = threadIdx.x; i < count * vec; i += blockDim.x) {
        int r = i / vec, c = (i % vec) * 4;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (r < rows) v = *(const float4*)(src + (size_t)r * src_stride + c);
        *(float4*)(dst + r * hp + c) = v;
    }
}
#endif

extern "C" __global__ void __launch_bounds__(128)
    attention_mma(const float* q, const float* keys, const float* values, float* probs,
                  float* stats, float* out, bf16_t* out_bf16, const int* meta, int n, int split,
                  int heads, int kv_heads, int head_dim, int stride, float scale) {
    PDL_ENTER();
#if __CUDA_ARCH__ >= 800
    extern __shared__ float sm[];
    int hp = head_dim + 4;
    float* qs = sm;
    float* ks = qs + MMA_BQ * hp;
    float* vs = ks + MMA_KT * hp;
    int tiles_q = (n + MMA_BQ - 1) / MMA_BQ;
    // Heaviest query tiles (the latest, seeing the most keys) first.
    int h = blockIdx.x / tiles_q, q0 = (tiles_q - 1 - blockIdx.x % tiles_q) * MMA_BQ;
    int nq = min(MMA_BQ, n - q0);
    int kvh = h / (heads / kv_heads), kv_dim = kv_heads * head_dim;
    int base = meta[0], span = base + n;
    int kend = base + q0 + nq;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int qw0 = q0 + warp * 16, nqw = max(0, min(16, n - qw0));
    int kend_w = base + qw0 + nqw;  // keys the warp's last query sees
    float* qw = qs + warp * 16 * hp;
    load_rows(q + ((size_t)q0 * heads + h) * head_dim, (size_t)heads * head_dim, nq, qs, MMA_BQ,
              head_dim, hp);
    // This thread's two rows (g and g + 8 of the warp): keys visible, cascade cut.
    int vis[2], cut[2];
    bool row_ok[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        int r = g + 8 * i;
        row_ok[i] = r < nqw;
        vis[i] = row_ok[i] ? base + qw0 + r + 1 : 0;
        cut[i] = (split > 0 && split < vis[i]) ? split : 0;
    }
    // Per row: each segment's running max m, the running max of both M, and each segment's
    // sum of exp(score - M).
    float m[2][2], l[2][2], mall[2], o[MMA_MAXD / 8][4];
#pragma unroll
    for (int i = 0; i < 2; i++) m[i][0] = m[i][1] = mall[i] = NEG_INF, l[i][0] = l[i][1] = 0.0f;
#pragma unroll
    for (int d = 0; d < MMA_MAXD / 8; d++) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
    const float* kbase = keys + kvh * head_dim;
    const float* vbase = values + kvh * head_dim;
    float s[MMA_KT / 8][4];

    // One pass over the keys (online softmax): statistics, and exp(score - M) summed over V
    // with the output rescaled whenever M grows. A cascade's two segments share the output
    // accumulator: merging per-segment softmaxes by log-sum-exp weights is this same sum.
    for (int k0 = 0; k0 < kend; k0 += MMA_KT) {
        __syncthreads();
        int rows = min(MMA_KT, kend - k0);
        load_rows(kbase + (size_t)k0 * kv_dim, kv_dim, rows, ks, MMA_KT, head_dim, hp);
        load_rows(vbase + (size_t)k0 * kv_dim, kv_dim, rows, vs, MMA_KT, head_dim, hp);
        __syncthreads();
        if (k0 >= kend_w) continue;
        mma_scores(qw, ks, hp, head_dim, s);
#pragma unroll
        for (int i = 0; i < 2; i++) {
            // Segment 0: keys before the row's cut; segment 1: the rest.
            float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
            for (int j = 0; j < MMA_KT / 4; j++) {
                int e = k0 + 8 * (j / 2) + 2 * t + (j % 2);
                float v = e < vis[i] ? __fmul_rn(s[j / 2][2 * i + j % 2], scale) : NEG_INF;
                s[j / 2][2 * i + j % 2] = v;
                if (e < cut[i]) mx0 = fmaxf(mx0, v);
                else mx1 = fmaxf(mx1, v);
            }
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
            m[i][0] = fmaxf(m[i][0], mx0);
            m[i][1] = fmaxf(m[i][1], mx1);
            float mn = fmaxf(m[i][0], m[i][1]);
            float al = mall[i] == NEG_INF ? 0.0f : expf(mall[i] - mn);
            mall[i] = mn;
            float ps0 = 0.0f, ps1 = 0.0f;
#pragma unroll
            for (int j = 0; j < MMA_KT / 4; j++) {
                int e = k0 + 8 * (j / 2) + 2 * t + (j % 2);
                float& v = s[j / 2][2 * i + j % 2];
                v = v == NEG_INF ? 0.0f : expf(v - mn);
                if (e < cut[i]) ps0 += v;
                else ps1 += v;
            }
            ps0 += __shfl_xor_sync(0xffffffffu, ps0, 1);
            ps0 += __shfl_xor_sync(0xffffffffu, ps0, 2);
            ps1 += __shfl_xor_sync(0xffffffffu, ps1, 1);
            ps1 += __shfl_xor_sync(0xffffffffu, ps1, 2);
            l[i][0] = l[i][0] * al + ps0;
            l[i][1] = l[i][1] * al + ps1;
#pragma unroll
            for (int d = 0; d < MMA_MAXD / 8; d++) {
                o[d][2 * i] *= al;
                o[d][2 * i + 1] *= al;
            }
        }
        // P·V with P's C fragment reused as the A fragment: its k index t stands for key 2t and
        // t + 4 for key 2t + 1, so V's B fragment takes those two keys.
#pragma unroll
        for (int j = 0; j < MMA_KT / 8; j++) {
            float a[4] = {s[j][0], s[j][2], s[j][1], s[j][3]};
            const float* v0 = vs + (8 * j + 2 * t) * hp + g;
#pragma unroll
            for (int d = 0; d < MMA_MAXD / 8; d++) {
                if (8 * d >= head_dim) break;
                float b[2] = {v0[8 * d], v0[hp + 8 * d]};
                mma_3xtf32(o[d], a, b);
            }
        }
    }
    // Segment weights as in `attention`: exp(lse_segment - lse_all), over each segment's sum
    // relative to its own max. The sums here are relative to M, so that sum is l·exp(M - m)
    // and the weight w / (l·exp(M - m)) = w·exp(m - M) / l, which cannot overflow however far
    // below M a segment's max lies.
    float fin[2][2], norm[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        fin[i][0] = fin[i][1] = norm[i] = 0.0f;
        if (!row_ok[i]) continue;
        norm[i] = 1.0f / (l[i][0] + l[i][1]);
        float lse_a = l[i][0] > 0.0f ? mall[i] + logf(l[i][0]) : NEG_INF;
        // Either sum may underflow to 0 when its segment lies far below the other.
        float lse_b = l[i][1] > 0.0f ? mall[i] + logf(l[i][1]) : NEG_INF;
        float mm = fmaxf(lse_a, lse_b);
        float wa = l[i][0] > 0.0f ? expf(lse_a - mm) : 0.0f;
        float wb = l[i][1] > 0.0f ? expf(lse_b - mm) : 0.0f;
        fin[i][0] = l[i][0] > 0.0f ? wa / (wa + wb) * expf(m[i][0] - mall[i]) / l[i][0] : 0.0f;
        fin[i][1] = l[i][1] > 0.0f ? wb / (wa + wb) * expf(m[i][1] - mall[i]) / l[i][1] : 0.0f;
        if (stats && t == 0) {
            float* st = stats + ((size_t)(qw0 + g + 8 * i) * heads + h) * 4;
            st[0] = m[i][0];
            st[1] = m[i][1];
            st[2] = fin[i][0];
            st[3] = fin[i][1];
        }
    }
#pragma unroll
    for (int d = 0; d < MMA_MAXD / 8; d++) {
        if (8 * d >= head_dim) break;
#pragma unroll
        for (int c = 0; c < 4; c++) {
            int i = c / 2;
            if (!row_ok[i]) continue;
            float v = o[d][c] * norm[i];
            size_t at = ((size_t)(qw0 + g + 8 * i) * heads + h) * head_dim + 8 * d + 2 * t + c % 2;
            out[at] = v;
            out_bf16[at] = f32_to_bf16(v);
        }
    }
    if (!probs) return;

    // Where asked, a second pass writes the probabilities from the statistics, as
    // `probs_from_stats_mma` rebuilds them.
    for (int k0 = 0; k0 < kend; k0 += MMA_KT) {
        __syncthreads();
        load_rows(kbase + (size_t)k0 * kv_dim, kv_dim, min(MMA_KT, kend - k0), ks, MMA_KT,
                  head_dim, hp);
        __syncthreads();
        if (k0 >= kend_w) continue;
        mma_scores(qw, ks, hp, head_dim, s);
#pragma unroll
        for (int j = 0; j < MMA_KT / 8; j++) {
#pragma unroll
            for (int c = 0; c < 4; c++) {
                int i = c / 2, e = k0 + 8 * j + 2 * t + (c % 2);
                if (!row_ok[i] || e >= span) continue;
                bool a = e < cut[i];
                float p = e < vis[i] ? prob_of(s[j][c], scale, a ? m[i][0] : m[i][1],
                                               a ? fin[i][0] : fin[i][1])
                                     : 0.0f;
                probs[((size_t)(qw0 + g + 8 * i) * heads + h) * stride + e] = p;
            }
        }
    }
    // Columns past the last key tile the warp went through (up to the pass's span) are 0.
    int done = ((kend_w + MMA_KT - 1) / MMA_KT) * MMA_KT;
    for (int r = 0; r < nqw; r++)
        for (int e = done + lane; e < span; e += 32)
            probs[((size_t)(qw0 + r) * heads + h) * stride + e] = 0.0f;
#endif
}

// `probs_from_stats` for rows `attention_mma` wrote: the scores by `mma_scores`, the
// probabilities by `prob_of`, so every value equals the one the kernel computed. Block: 4
// warps of 16 rows (`rows[i]`: a query's index in its pass) and MMA_RB_KEYS keys, taken
// MMA_KT at a time; `out` is
// [count, heads, span], 0 at or past each query's `base + index + 1`. Dynamic shared memory:
// (MMA_BQ + MMA_KT) * (head_dim + 4) floats.
extern "C" __global__ void __launch_bounds__(128)
    probs_from_stats_mma(const float* q, const float* keys, const float* stats, const int* rows,
                         float* out, int count, int base, int split, int heads, int kv_heads,
                         int head_dim, int span, float scale) {
    PDL_ENTER();
#if __CUDA_ARCH__ >= 800
    extern __shared__ float sm[];
    int hp = head_dim + 4;
    float* qs = sm;
    float* ks = qs + MMA_BQ * hp;
    // Blocks also split the keys, MMA_RB_KEYS each, so that a few rows still fill the GPU.
    int tiles = (count + MMA_BQ - 1) / MMA_BQ, kchunks = (span + MMA_RB_KEYS - 1) / MMA_RB_KEYS;
    int kc = blockIdx.x % kchunks, rest = blockIdx.x / kchunks;
    int h = rest / tiles, i0 = (rest % tiles) * MMA_BQ;
    int kfirst = kc * MMA_RB_KEYS, klast = min(span, kfirst + MMA_RB_KEYS);
    int nq = min(MMA_BQ, count - i0);
    int kvh = h / (heads / kv_heads), kv_dim = kv_heads * head_dim;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int vec = head_dim / 4;
    for (int i = threadIdx.x; i < MMA_BQ * vec; i += blockDim.x) {
        int r = i / vec, c = (i % vec) * 4;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (r < nq) v = *(const float4*)(q + ((size_t)rows[i0 + r] * heads + h) * head_dim + c);
        *(float4*)(qs + r * hp + c) = v;
    }
    int rw0 = warp * 16, nqw = max(0, min(16, nq - rw0));
    int vis[2], cut[2], kend = 0, kend_w = 0;
    float st[2][4];
    bool row_ok[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        int r = rw0 + g + 8 * i;
        row_ok[i] = r - rw0 < nqw;
        int qi = row_ok[i] ? rows[i0 + r] : 0;
        vis[i] = row_ok[i] ? base + qi + 1 : 0;
        cut[i] = (split > 0 && split < vis[i]) ? split : 0;
        const float* sp = stats + ((size_t)qi * heads + h) * 4;
#pragma unroll
        for (int j = 0; j < 4; j++) st[i][j] = row_ok[i] ? sp[j] : 0.0f;
    }
    for (int r = 0; r < nq; r++) kend = max(kend, base + rows[i0 + r] + 1);
    for (int r = 0; r < nqw; r++) kend_w = max(kend_w, base + rows[i0 + rw0 + r] + 1);
    const float* kbase = keys + kvh * head_dim;
    float s[MMA_KT / 8][4];
    for (int k0 = kfirst; k0 < klast; k0 += MMA_KT) {
        if (k0 < kend) {
            __syncthreads();
            load_rows(kbase + (size_t)k0 * kv_dim, kv_dim, min(MMA_KT, kend - k0), ks, MMA_KT,
                      head_dim, hp);
            __syncthreads();
        }
        if (nqw == 0) continue;
        if (k0 < kend_w) mma_scores(qs + rw0 * hp, ks, hp, head_dim, s);
#pragma unroll
        for (int j = 0; j < MMA_KT / 8; j++) {
#pragma unroll
            for (int c = 0; c < 4; c++) {
                int i = c / 2, e = k0 + 8 * j + 2 * t + (c % 2);
                if (!row_ok[i] || e >= klast) continue;
                bool a = e < cut[i];
                float p = e < vis[i] ? prob_of(s[j][c], scale, a ? st[i][0] : st[i][1],
                                               a ? st[i][2] : st[i][3])
                                     : 0.0f;
                out[((size_t)(i0 + rw0 + g + 8 * i) * heads + h) * span + e] = p;
            }
        }
    }
#endif
}
