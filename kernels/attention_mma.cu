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
// memory MMA_KT at a time. Needs head_dim % 8 == 0 and head_dim <= MMA_MAXD. Key and value
// tiles are split into their TF32 halves once, as they are stored in shared memory, and laid out
// so that each of a lane's B fragments (both halves) is one 16-byte load: splitting in the inner
// loops instead made every warp redo it and left the kernel issue-bound at 13 instructions per
// MMA. Row strides are padded so that each quarter warp's 16-byte loads hit distinct banks:
//   queries: raw f32, MMA_QP floats per row (the A fragment is split as it is loaded);
//   keys:    per key, per 8 dimensions, 16 words: big(t), big(t+4), small(t), small(t+4) at
//            4t for t = 0..3, a lane's B fragments as register pairs; MMA_KP words per key;
//   values:  per pair of keys (2p, 2p + 1), per dimension, 4 words: big(2p), big(2p + 1),
//            small(2p), small(2p + 1); MMA_VP words per pair.
// Dynamic shared memory: MMA_SHARED(head_dim) floats (MMA_RB_SHARED for the rebuild).
#define MMA_BQ 64
#define MMA_KT 32
#define MMA_MAXD 128
#define MMA_QP(hd) ((hd) + 4)
#define MMA_KP(hd) (2 * (hd) + (48 - (2 * (hd)) % 32) % 32)
#define MMA_VP(hd) (4 * (hd) + 8)
#define MMA_RB_SHARED(hd) (MMA_BQ * MMA_QP(hd) + MMA_KT * MMA_KP(hd))
#define MMA_SHARED(hd) (MMA_RB_SHARED(hd) + MMA_KT / 2 * MMA_VP(hd))
#define MMA_RB_KEYS 1024

#if __CUDA_ARCH__ >= 800
// x as big + small, both TF32: big is x rounded to nearest (ties away from zero), small the
// exact remainder x - big truncated to TF32. Integer operations: `cvt.rna.tf32.f32` adds an
// Inf/NaN guard that made a split 7 instructions, and the splits dominated the inner loops.
// Exact for finite x; Inf or NaN come out NaN, which the checks downstream report.
__device__ __forceinline__ void split_tf32(float x, unsigned& big, unsigned& small) {
    big = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
    small = __float_as_uint(__fsub_rn(x, __uint_as_float(big))) & 0xffffe000u;
}

// Not volatile: the compiler may interleave independent products, which a warp's in-order
// issue needs to keep the tensor cores busy between dependent ones.
__device__ __forceinline__ void mma_tf32(float* d, const unsigned* a, const unsigned* b) {
    asm(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// d[i] (16x8) += a (16x8, the A fragment of m16n8k8) · b[i] (8x8, its B fragment) for i < N,
// about f32-exact, from both operands' TF32 halves (big, small): small·big + big·small +
// big·big, in that order for each d[i]. The N independent products go round by round, so a
// product never waits on the one just issued.
template <int N>
__device__ __forceinline__ void mma_3xtf32(float (*d)[4], const unsigned* ab, const unsigned* as,
                                           const unsigned (*bb)[2], const unsigned (*bs)[2]) {
#pragma unroll
    for (int i = 0; i < N; i++) mma_tf32(d[i], as, bb[i]);
#pragma unroll
    for (int i = 0; i < N; i++) mma_tf32(d[i], ab, bs[i]);
#pragma unroll
    for (int i = 0; i < N; i++) mma_tf32(d[i], ab, bb[i]);
}

// The A fragment (16x8) of rows `r` (rows hp floats apart) at columns k0..k0 + 8, split.
__device__ __forceinline__ void a_fragment(const float* r, int hp, int k0, unsigned* ab,
                                           unsigned* as) {
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float a[4] = {r[g * hp + k0 + t], r[(g + 8) * hp + k0 + t], r[g * hp + k0 + t + 4],
                  r[(g + 8) * hp + k0 + t + 4]};
#pragma unroll
    for (int i = 0; i < 4; i++) split_tf32(a[i], ab[i], as[i]);
}

// Raw scores of a warp's 16 query rows (`qw`, rows hp floats apart) against MMA_KT split keys
// (`ks`): s[j] is the C fragment of keys 8j..8j+8, i.e. lane (g = lane / 4, t = lane % 4) holds
// rows g and g + 8 at keys 8j + 2t and 8j + 2t + 1 in s[j][0], s[j][1] (row g), s[j][2],
// s[j][3] (row g + 8). The attention kernel and the rebuild both call this, so both get the
// same bits.
__device__ __forceinline__ void mma_scores(const float* qw, const float* ks, int hp, int kp,
                                           int head_dim, float s[MMA_KT / 8][4]) {
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < MMA_KT / 8; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
    for (int k0 = 0; k0 < head_dim; k0 += 8) {
        unsigned ab[4], as[4], bb[MMA_KT / 8][2], bs[MMA_KT / 8][2];
        a_fragment(qw, hp, k0, ab, as);
#pragma unroll
        for (int j = 0; j < MMA_KT / 8; j++) {
            uint4 f = *(const uint4*)(ks + (j * 8 + g) * kp + 2 * k0 + 4 * t);
            bb[j][0] = f.x, bb[j][1] = f.y, bs[j][0] = f.z, bs[j][1] = f.w;
        }
        mma_3xtf32<MMA_KT / 8>(s, ab, as, bb, bs);
    }
}

// A score's probability from its row's statistics (segment max m, segment weight f).
__device__ __forceinline__ float prob_of(float raw, float scale, float m, float f) {
    return __fmul_rn(expf(__fsub_rn(__fmul_rn(raw, scale), m)), f);
}

// The probabilities of a warp's key tile (scores `s` of keys k0.., from `mma_scores`) into
// `out` at row_at[i] + key for the lane's rows i = 0, 1, keys below `klast`: keys before a row's
// cascade cut from its segment-0 statistics st[i][0] (max), st[i][2] (weight), the rest from
// st[i][1], st[i][3]; keys the row does not see, 0. The attention kernel's second pass and the
// rebuild both write through this, so a rebuilt row equals the written one bit for bit. FULL:
// every key of the tile is below `klast`, visible to the warp's rows and on one side of each
// row's cut (the same values, without per-key tests).
template <bool FULL>
__device__ __forceinline__ void write_probs(const float s[MMA_KT / 8][4], int k0, int klast,
                                            float scale, const bool row_ok[2], const int vis[2],
                                            const int cut[2], const float st[2][4], float* out,
                                            const size_t row_at[2]) {
    int t = threadIdx.x & 3;
#pragma unroll
    for (int j = 0; j < MMA_KT / 8; j++) {
#pragma unroll
        for (int c = 0; c < 4; c++) {
            int i = c / 2, e = k0 + 8 * j + 2 * t + (c % 2);
            if (!row_ok[i] || (!FULL && e >= klast)) continue;
            if (FULL) {
                bool a = k0 < cut[i];
                out[row_at[i] + e] =
                    prob_of(s[j][c], scale, a ? st[i][0] : st[i][1], a ? st[i][2] : st[i][3]);
                continue;
            }
            bool a = e < cut[i];
            float p = e < vis[i]
                          ? prob_of(s[j][c], scale, a ? st[i][0] : st[i][1], a ? st[i][2] : st[i][3])
                          : 0.0f;
            out[row_at[i] + e] = p;
        }
    }
}

// Rows 0..count of `src` (row r at src + r * src_stride, head_dim floats) into shared memory
// `dst` (rows hp apart), raw; zeros past `rows`.
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

// A thread's share of loading a tile: items r0, r0 + step, ... (while below the tile's count)
// of column group c. Computed once per kernel: divisions in the load loops cost as much as the
// loads.
struct Share {
    int r0, c, step;
};

// Items of `per_item` floats spread over a row of head_dim floats, for a block of 128 threads.
__device__ __forceinline__ Share share_of(int head_dim, int per_item) {
    int groups = head_dim / per_item;
    int step = 128 / groups;
    int r0 = threadIdx.x / groups;
    // Threads past step * groups have no item (r0 = step stays past any tile's count).
    return Share{r0 < step ? r0 : 1 << 20, (int)threadIdx.x % groups, step};
}

// A thread's items of one key or value tile, held in registers between the global load and
// the split into shared memory, so that the next tile's loads are in flight while the current
// one is computed (at 8 warps per SM nothing else hides their latency). At most 4 items per
// thread for head_dim <= 128.
#define MMA_ITEMS 4
struct Fetched {
    float4 a[MMA_ITEMS], b[MMA_ITEMS];
};

// Keys k0.. of a tile (key r at src + r * src_stride; zeros at or past `rows`) into registers:
// item n is key sh.r0 + n·sh.step, dimensions 8·sh.c.. (`sh`: share_of(head_dim, 8)).
__device__ __forceinline__ void fetch_keys(const float* src, size_t src_stride, int rows, Share sh,
                                           Fetched& f) {
#pragma unroll
    for (int n = 0; n < MMA_ITEMS; n++) {
        int r = sh.r0 + n * sh.step;
        f.a[n] = f.b[n] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (r < rows && r < MMA_KT) {
            const float* p = src + (size_t)r * src_stride + 8 * sh.c;
            f.a[n] = *(const float4*)p;
            f.b[n] = *(const float4*)(p + 4);
        }
    }
}

// Fetched keys into shared memory, split, in the key layout above.
__device__ __forceinline__ void store_keys(const Fetched& f, float* ks, int kp, Share sh) {
#pragma unroll
    for (int n = 0; n < MMA_ITEMS; n++) {
        int r = sh.r0 + n * sh.step;
        if (r >= MMA_KT) break;
        float x[4] = {f.a[n].x, f.a[n].y, f.a[n].z, f.a[n].w};
        float y[4] = {f.b[n].x, f.b[n].y, f.b[n].z, f.b[n].w};
        float* d = ks + r * kp + 16 * sh.c;
#pragma unroll
        for (int t = 0; t < 4; t++) {
            uint4 w;
            split_tf32(x[t], w.x, w.z);
            split_tf32(y[t], w.y, w.w);
            *(uint4*)(d + 4 * t) = w;
        }
    }
}

// Values of a tile (as `fetch_keys`) into registers, a pair of keys per item: item n is keys
// 2p, 2p + 1 for p = sh.r0 + n·sh.step, dimensions 4·sh.c.. (`sh`: share_of(head_dim, 4)).
__device__ __forceinline__ void fetch_values(const float* src, size_t src_stride, int rows,
                                             Share sh, Fetched& f) {
#pragma unroll
    for (int n = 0; n < MMA_ITEMS; n++) {
        int p = sh.r0 + n * sh.step, c = 4 * sh.c;
        f.a[n] = f.b[n] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (p < MMA_KT / 2) {
            if (2 * p < rows) f.a[n] = *(const float4*)(src + (size_t)(2 * p) * src_stride + c);
            if (2 * p + 1 < rows)
                f.b[n] = *(const float4*)(src + (size_t)(2 * p + 1) * src_stride + c);
        }
    }
}

// Fetched values into shared memory, split, in the value layout above.
__device__ __forceinline__ void store_values(const Fetched& f, float* vs, int vp, Share sh) {
#pragma unroll
    for (int n = 0; n < MMA_ITEMS; n++) {
        int p = sh.r0 + n * sh.step;
        if (p >= MMA_KT / 2) break;
        float x[4] = {f.a[n].x, f.a[n].y, f.a[n].z, f.a[n].w};
        float y[4] = {f.b[n].x, f.b[n].y, f.b[n].z, f.b[n].w};
        float* d = vs + p * vp + 16 * sh.c;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            uint4 w;
            split_tf32(x[k], w.x, w.z);
            split_tf32(y[k], w.y, w.w);
            *(uint4*)(d + 4 * k) = w;
        }
    }
}

// One key tile of the online softmax for the lane's two rows: scores `s` (raw, from
// `mma_scores`) become exp(score·scale - M) in place; each row's segment maxima m, running max
// M (`mall`) and sums l move on, and the output accumulator `o` is rescaled where M grew.
// Segment 0 is a row's keys before its cascade cut, segment 1 the rest. FULL: every key of the
// tile is visible to every row of the warp and lies on one side of each row's cut, so no key
// needs a mask; the results are the same bits as the general form's.
template <bool FULL>
__device__ __forceinline__ void softmax_tile(float s[MMA_KT / 8][4], int k0, const int vis[2],
                                             const int cut[2], float scale, float m[2][2],
                                             float l[2][2], float mall[2],
                                             float o[MMA_MAXD / 8][4]) {
    int t = threadIdx.x & 3;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        bool seg0 = k0 < cut[i];  // under FULL, for every key of the tile
        float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
        for (int j = 0; j < MMA_KT / 4; j++) {
            int e = k0 + 8 * (j / 2) + 2 * t + (j % 2);
            float& v = s[j / 2][2 * i + j % 2];
            v = FULL || e < vis[i] ? __fmul_rn(v, scale) : NEG_INF;
            if (FULL ? seg0 : e < cut[i]) mx0 = fmaxf(mx0, v);
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
            // exp(-Inf) is 0: masked keys need no branch. (A row past the pass, whose every
            // key is masked, gets NaN here; its rows of the products stay its own and are
            // never written.)
            v = expf(v - mn);
            bool a = FULL ? seg0 : e < cut[i];
            ps0 += a ? v : 0.0f;
            ps1 += a ? 0.0f : v;
        }
        ps0 += __shfl_xor_sync(0xffffffffu, ps0, 1);
        ps0 += __shfl_xor_sync(0xffffffffu, ps0, 2);
        ps1 += __shfl_xor_sync(0xffffffffu, ps1, 1);
        ps1 += __shfl_xor_sync(0xffffffffu, ps1, 2);
        l[i][0] = l[i][0] * al + ps0;
        l[i][1] = l[i][1] * al + ps1;
        // Once the maxima settle, M rarely grows: skip multiplying by 1 when no row of the
        // warp needs it.
        if (__any_sync(0xffffffffu, al != 1.0f)) {
#pragma unroll
            for (int d = 0; d < MMA_MAXD / 8; d++) {
                o[d][2 * i] *= al;
                o[d][2 * i + 1] *= al;
            }
        }
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
    int hp = MMA_QP(head_dim), kp = MMA_KP(head_dim), vp = MMA_VP(head_dim);
    float* qs = sm;
    float* ks = qs + MMA_BQ * hp;
    float* vs = ks + MMA_KT * kp;
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
    Share key_share = share_of(head_dim, 8), value_share = share_of(head_dim, 4);
    float s[MMA_KT / 8][4];

    // One pass over the keys (online softmax): statistics, and exp(score - M) summed over V
    // with the output rescaled whenever M grows. A cascade's two segments share the output
    // accumulator: merging per-segment softmaxes by log-sum-exp weights is this same sum.
    Fetched fk, fv;
    fetch_keys(kbase, kv_dim, kend, key_share, fk);
    fetch_values(vbase, kv_dim, kend, value_share, fv);
    for (int k0 = 0; k0 < kend; k0 += MMA_KT) {
        __syncthreads();
        store_keys(fk, ks, kp, key_share);
        store_values(fv, vs, vp, value_share);
        __syncthreads();
        int next = k0 + MMA_KT;
        if (next < kend) {
            fetch_keys(kbase + (size_t)next * kv_dim, kv_dim, kend - next, key_share, fk);
            fetch_values(vbase + (size_t)next * kv_dim, kv_dim, kend - next, value_share, fv);
        }
        if (k0 >= kend_w) continue;
        mma_scores(qw, ks, hp, kp, head_dim, s);
        // Tiles wholly below the warp's diagonal and on one side of the cut need no masks.
        if (k0 + MMA_KT <= base + qw0 + 1 &&
            (split <= 0 || k0 + MMA_KT <= split || k0 >= split))
            softmax_tile<true>(s, k0, vis, cut, scale, m, l, mall, o);
        else
            softmax_tile<false>(s, k0, vis, cut, scale, m, l, mall, o);
        // P·V with P's C fragment reused as the A fragment: its k index t stands for key 2t and
        // t + 4 for key 2t + 1, so V's B fragment takes those two keys.
#pragma unroll
        for (int j = 0; j < MMA_KT / 8; j++) {
            float a[4] = {s[j][0], s[j][2], s[j][1], s[j][3]};
            unsigned ab[4], as[4];
#pragma unroll
            for (int i = 0; i < 4; i++) split_tf32(a[i], ab[i], as[i]);
            const float* v0 = vs + (4 * j + t) * vp + 4 * g;
            // Four output column groups at a time; a group past head_dim (head_dim % 32 != 0)
            // multiplies zeros into an accumulator that is never written out.
#pragma unroll
            for (int d0 = 0; d0 < MMA_MAXD / 8; d0 += 4) {
                if (8 * d0 >= head_dim) break;
                unsigned bb[4][2], bs[4][2];
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    uint4 f = 8 * (d0 + i) < head_dim ? *(const uint4*)(v0 + 32 * (d0 + i))
                                                      : make_uint4(0, 0, 0, 0);
                    bb[i][0] = f.x, bb[i][1] = f.y, bs[i][0] = f.z, bs[i][1] = f.w;
                }
                mma_3xtf32<4>(o + d0, ab, as, bb, bs);
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
    float st[2][4];
    size_t row_at[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        st[i][0] = m[i][0], st[i][1] = m[i][1], st[i][2] = fin[i][0], st[i][3] = fin[i][1];
        row_at[i] = ((size_t)(qw0 + g + 8 * i) * heads + h) * stride;
    }
    fetch_keys(kbase, kv_dim, kend, key_share, fk);
    for (int k0 = 0; k0 < kend; k0 += MMA_KT) {
        __syncthreads();
        store_keys(fk, ks, kp, key_share);
        __syncthreads();
        int next = k0 + MMA_KT;
        if (next < kend)
            fetch_keys(kbase + (size_t)next * kv_dim, kv_dim, kend - next, key_share, fk);
        if (k0 >= kend_w) continue;
        mma_scores(qw, ks, hp, kp, head_dim, s);
        if (k0 + MMA_KT <= base + qw0 + 1 && (split <= 0 || k0 + MMA_KT <= split || k0 >= split))
            write_probs<true>(s, k0, span, scale, row_ok, vis, cut, st, probs, row_at);
        else
            write_probs<false>(s, k0, span, scale, row_ok, vis, cut, st, probs, row_at);
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
// MMA_KT at a time; `out` is [count, heads, span], 0 at or past each query's
// `base + index + 1`. Dynamic shared memory: MMA_RB_SHARED(head_dim) floats.
extern "C" __global__ void __launch_bounds__(128)
    probs_from_stats_mma(const float* q, const float* keys, const float* stats, const int* rows,
                         float* out, int count, int base, int split, int heads, int kv_heads,
                         int head_dim, int span, float scale) {
    PDL_ENTER();
#if __CUDA_ARCH__ >= 800
    extern __shared__ float sm[];
    int hp = MMA_QP(head_dim), kp = MMA_KP(head_dim);
    float* qs = sm;
    float* ks = qs + MMA_BQ * hp;
    // Blocks also split the keys, MMA_RB_KEYS each, so that a few rows still fill the GPU.
    int tiles = (count + MMA_BQ - 1) / MMA_BQ, kchunks = (span + MMA_RB_KEYS - 1) / MMA_RB_KEYS;
    int kc = blockIdx.x % kchunks, rest = blockIdx.x / kchunks;
    int h = rest / tiles, i0 = (rest % tiles) * MMA_BQ;
    int kfirst = kc * MMA_RB_KEYS, klast = min(span, kfirst + MMA_RB_KEYS);
    int nq = min(MMA_BQ, count - i0);
    int kvh = h / (heads / kv_heads), kv_dim = kv_heads * head_dim;
    int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2;
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
    int vis_w = 1 << 30;  // keys the warp's first-seeing query sees
    for (int r = 0; r < nqw; r++) {
        kend_w = max(kend_w, base + rows[i0 + rw0 + r] + 1);
        vis_w = min(vis_w, base + rows[i0 + rw0 + r] + 1);
    }
    const float* kbase = keys + kvh * head_dim;
    Share key_share = share_of(head_dim, 8);
    float s[MMA_KT / 8][4];
    size_t row_at[2];
#pragma unroll
    for (int i = 0; i < 2; i++) row_at[i] = ((size_t)(i0 + rw0 + g + 8 * i) * heads + h) * span;
    Fetched fk;
    if (kfirst < kend)
        fetch_keys(kbase + (size_t)kfirst * kv_dim, kv_dim, kend - kfirst, key_share, fk);
    for (int k0 = kfirst; k0 < klast; k0 += MMA_KT) {
        if (k0 < kend) {
            __syncthreads();
            store_keys(fk, ks, kp, key_share);
            __syncthreads();
            int next = k0 + MMA_KT;
            if (next < kend && next < klast)
                fetch_keys(kbase + (size_t)next * kv_dim, kv_dim, kend - next, key_share, fk);
        }
        if (nqw == 0) continue;
        // Past the warp's last visible key the scores are not needed: every value is 0.
        if (k0 < kend_w) mma_scores(qs + rw0 * hp, ks, hp, kp, head_dim, s);
        if (k0 + MMA_KT <= min(vis_w, klast) &&
            (split <= 0 || k0 + MMA_KT <= split || k0 >= split))
            write_probs<true>(s, k0, klast, scale, row_ok, vis, cut, st, out, row_at);
        else
            write_probs<false>(s, k0, klast, scale, row_ok, vis, cut, st, out, row_at);
    }
#endif
}
