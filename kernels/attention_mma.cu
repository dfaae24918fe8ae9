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
//   keys:    per key, per 8 dimensions c, 16 words: big(t), big(t+4), small(t), small(t+4) at
//            4·swz(t, c) for t = 0..3, a lane's B fragments as register pairs; MMA_KP words
//            per key;
//   values:  per pair of keys (2p, 2p + 1), per dimension, 4 words: big(2p), big(2p + 1),
//            small(2p), small(2p + 1); dimension 4c + k at 16c + 4·swz(k, c); MMA_VP words per
//            pair.
// swz(t, c) = t ^ ((c / 2) % 4) permutes the four 16-byte chunks of a group: a thread stores
// one group's four chunks, and without the permutation the eight threads of a quarter warp
// stored to 2 bank groups out of 8 (`ncu`: 4-way conflicts, 75% of all shared-store
// wavefronts, on a kernel bound by its shared-memory pipe). The loads permute alike.
// Dynamic shared memory: MMA_SHARED(head_dim) floats (MMA_RB_SHARED for the rebuild).
#define MMA_BQ 64
#define MMA_KT 32
#define MMA_MAXD 128
#define MMA_QP(hd) ((hd) + 4)
#define MMA_KP(hd) (2 * (hd) + (48 - (2 * (hd)) % 32) % 32)
#define MMA_VP(hd) (4 * (hd) + 8)
#define MMA_RB_SHARED(hd) (MMA_BQ * MMA_QP(hd) + MMA_KT * MMA_KP(hd))
// The whole form's running fold per thread (its two rows' M, m[2], l[2]), out of registers:
// held there, they spilled.
#define MMA_FOLD (10 * 128)
#define MMA_SHARED(hd) (MMA_RB_SHARED(hd) + MMA_KT / 2 * MMA_VP(hd) + MMA_FOLD)
#define MMA_RB_KEYS 1024
// Whether a kernel takes the warpgroup MMAs' tiles (`Tiles`).
#define WG_OK(head_dim) (MMA_WG && (head_dim) == MMA_MAXD)
// Softmax segments. A row's keys are taken in segments at fixed absolute positions
// (`seg_after`: MMA_SEG keys each at first, then wider), each segment's online softmax started
// afresh and the segments folded left to right (`fold_weights`), so a row's bits depend on its
// own position and keys only: not on how many queries share its pass, nor on whether one block
// walks all its segments or a block each takes one (`attention_mma`'s split form, for passes of
// few queries, whose few blocks would otherwise each walk every key alone).
#ifndef MMA_SEG
#define MMA_SEG 64
#endif
#ifndef MMA_SEG_RATIO
#define MMA_SEG_RATIO 4
#endif
// Floats of one row's segment state in the split form's scratch: M, m[2], l[2], padding, then
// head_dim outputs.
#define MMA_PART_HEAD 8
// Column groups of 8 a thread folds at a time (its loads in flight together).
#ifndef MMA_FOLD_GROUP
#define MMA_FOLD_GROUP 4
#endif

#if __CUDA_ARCH__ >= 800
// The permuted place of chunk t of group c (see the layouts above).
__device__ __forceinline__ int swz(int t, int c) { return t ^ ((c >> 1) & 3); }

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
    // Unrolled: the next steps' fragment loads and splits then overlap this step's products;
    // rolled, every step waited for its shared-memory loads and splits before its first MMA.
#pragma unroll 4
    for (int k0 = 0; k0 < head_dim; k0 += 8) {
        unsigned ab[4], as[4], bb[MMA_KT / 8][2], bs[MMA_KT / 8][2];
        a_fragment(qw, hp, k0, ab, as);
#pragma unroll
        for (int j = 0; j < MMA_KT / 8; j++) {
            uint4 f = *(const uint4*)(ks + (j * 8 + g) * kp + 2 * k0 + 4 * swz(t, k0 >> 3));
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

// Keys first.. of a tile (key k at src + k * src_stride; zeros where k < 0 or k >= rows) into
// registers: item n is key first + sh.r0 + n·sh.step, dimensions 8·sh.c.. (`sh`:
// share_of(head_dim, 8)).
__device__ __forceinline__ void fetch_keys_from(const float* src, size_t src_stride, int first,
                                                int rows, Share sh, Fetched& f) {
#pragma unroll
    for (int n = 0; n < MMA_ITEMS; n++) {
        int r = sh.r0 + n * sh.step, k = first + r;
        f.a[n] = f.b[n] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (r < MMA_KT && k >= 0 && k < rows) {
            const float* p = src + (size_t)k * src_stride + 8 * sh.c;
            f.a[n] = *(const float4*)p;
            f.b[n] = *(const float4*)(p + 4);
        }
    }
}

// Keys 0.. of a tile (zeros at or past `rows`) into registers.
__device__ __forceinline__ void fetch_keys(const float* src, size_t src_stride, int rows, Share sh,
                                           Fetched& f) {
    fetch_keys_from(src, src_stride, 0, rows, sh, f);
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
            *(uint4*)(d + 4 * swz(t, sh.c)) = w;
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
            *(uint4*)(d + 4 * swz(k, sh.c)) = w;
        }
    }
}

// Tiles in the warpgroup MMAs' layouts (attention_wgmma.cu), for head_dim == MMA_MAXD on sm_90a;
// both halves of a split tile in one buffer, the small half MMA_KT · MMA_MAXD floats after the
// big. Keys: core matrix (key / 8, dimension / 4), 4 dimensions of a key per 16-byte row.
// Values, transposed: core matrix (dimension / 8, 2j + h) holds keys 8j + 2t + h (t = 0..3) of
// each of 8 dimensions, the order in which P's C fragment serves as the A fragment (see P·V
// below). Threads store so that each 8-lane phase of a store meets 8 distinct 16-byte bank
// groups (a key tile's phase fills one core matrix).
#define MMA_WG_KSBO (8 * MMA_MAXD)   // floats from one 8-key core row to the next
#define MMA_WG_VSBO (8 * MMA_KT)     // floats from one 8-dimension core row to the next
#define MMA_WG_HALF (MMA_KT * MMA_MAXD)
// Dimension steps (8 each) of the scores a commit group takes: in the attention passes, and in
// the attention diff, whose statistics between tiles leave it the registers for larger groups
// (8 steps: the diff 6% faster, the whole pass 10% slower).
#ifndef MMA_WG_STEPS
#define MMA_WG_STEPS 4
#endif
#ifndef MMA_DIFF_WG_STEPS
#define MMA_DIFF_WG_STEPS 8
#endif
// Whether the attention passes fetch their keys by rows of core matrices, as the diff does
// (`wg_fetch_keys`).
#ifndef WHOLE_KEY_ROWS
#define WHOLE_KEY_ROWS false
#endif
// A key tile's image (`attention_mma_image`): the tile's keys, then its values, each both
// halves, in the warpgroup tiles' layouts, so that a block takes each with one bulk copy.
#define MMA_IMG_TILE (4 * MMA_WG_HALF)
#define MMA_IMG_BYTES (2 * MMA_WG_HALF * 4)

// Keys first.. of a tile into registers. ROWS: warp w takes keys 8w .. 8w + 8 (a row of core
// matrices), lane 8q + j key 8w + j, item n its dimensions 4·(4n + q)..: a warp's load reads 64
// contiguous bytes of each of 8 keys. Else item n is key (tid + 128n) % MMA_KT, dimensions
// 8 · ((tid + 128n) / MMA_KT)..: a load reads 16 bytes of each of 32 keys. Measured apart (H200):
// the attention diff, which fetches two sides' keys and no values, is 5% faster with ROWS; the
// whole pass, which fetches the values beside the keys, 3% slower.
template <bool ROWS>
__device__ __forceinline__ void wg_fetch_keys(const float* src, size_t src_stride, int first,
                                              int rows, Fetched& f) {
    if (ROWS) {
        int lane = threadIdx.x & 31, k = first + 8 * (threadIdx.x >> 5) + (lane & 7);
#pragma unroll
        for (int n = 0; n < 2 * MMA_ITEMS; n++) {
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (k >= 0 && k < rows)
                v = *(const float4*)(src + (size_t)k * src_stride + 4 * (lane >> 3) + 16 * n);
            if (n < MMA_ITEMS) f.a[n] = v;
            else f.b[n - MMA_ITEMS] = v;
        }
        return;
    }
#pragma unroll
    for (int n = 0; n < MMA_ITEMS; n++) {
        int id = threadIdx.x + 128 * n, r = id % MMA_KT, c = id / MMA_KT, k = first + r;
        f.a[n] = f.b[n] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (k >= 0 && k < rows) {
            const float* p = src + (size_t)k * src_stride + 8 * c;
            f.a[n] = *(const float4*)p;
            f.b[n] = *(const float4*)(p + 4);
        }
    }
}

__device__ __forceinline__ void wg_store_quad(float* big, float4 v) {
    float x[4] = {v.x, v.y, v.z, v.w};
    unsigned b[4], s[4];
#pragma unroll
    for (int i = 0; i < 4; i++) split_tf32(x[i], b[i], s[i]);
    *(uint4*)big = make_uint4(b[0], b[1], b[2], b[3]);
    *(uint4*)(big + MMA_WG_HALF) = make_uint4(s[0], s[1], s[2], s[3]);
}

// Either way each quarter warp's 16-byte stores go to 8 keys' rows of one core matrix. The
// stores are fenced for the MMAs, which read shared memory through the async proxy (before the
// block's barrier), as `wg_store_values`'s are.
template <bool ROWS>
__device__ __forceinline__ void wg_store_keys(const Fetched& f, float* ks) {
    if (ROWS) {
        int lane = threadIdx.x & 31;
        float* d = ks + (threadIdx.x >> 5) * MMA_WG_KSBO + (lane >> 3) * 32 + (lane & 7) * 4;
#pragma unroll
        for (int n = 0; n < 2 * MMA_ITEMS; n++)
            wg_store_quad(d + 128 * n, n < MMA_ITEMS ? f.a[n] : f.b[n - MMA_ITEMS]);
    } else {
#pragma unroll
        for (int n = 0; n < MMA_ITEMS; n++) {
            int id = threadIdx.x + 128 * n, r = id % MMA_KT, c = id / MMA_KT;
            float* d = ks + (r / 8) * MMA_WG_KSBO + 2 * c * 32 + (r % 8) * 4;
            wg_store_quad(d, f.a[n]);
            wg_store_quad(d + 32, f.b[n]);
        }
    }
#if MMA_WG
    wg_proxy_fence();
#endif
}

// Values of a tile into registers: warp w, lane l takes dimensions 4l .. 4l + 4 of keys
// 8j + 2t + h (t = 0..3) for q = 2j + h = w and w + 4, item 4·(q / 4) + t: each load reads one
// key's 512 bytes. (A dimension a thread, 32 loads of 4 bytes, held the pass 5% longer.)
__device__ __forceinline__ void wg_fetch_values(const float* src, size_t src_stride, int rows,
                                                Fetched& f) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
#pragma unroll
    for (int n = 0; n < 2 * MMA_ITEMS; n++) {
        int q = w + 4 * (n / 4), e = 8 * (q / 2) + 2 * (n % 4) + q % 2;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (e < rows) v = *(const float4*)(src + (size_t)e * src_stride + 4 * lane);
        if (n < MMA_ITEMS) f.a[n] = v;
        else f.b[n - MMA_ITEMS] = v;
    }
}

__device__ __forceinline__ float wg_pick(float4 v, int i) {
    return i & 2 ? (i & 1 ? v.w : v.z) : (i & 1 ? v.y : v.x);
}

// A thread's 4 keys x 4 dimensions of each q, transposed into four 16-byte rows (4 keys of one
// dimension each). Lane l stores its dimension (s + l / 2) % 4 at step s, so that the 8 lanes of
// each quarter warp store to 8 distinct 16-byte bank groups.
__device__ __forceinline__ void wg_store_values(const Fetched& f, float* vs) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, r = (lane >> 1) & 3;
#pragma unroll
    for (int m = 0; m < 2; m++) {
        const float4* x = m == 0 ? f.a : f.b;
        float* d = vs + (lane >> 1) * MMA_WG_VSBO + (w + 4 * m) * 32 + 16 * (lane & 1);
#pragma unroll
        for (int s = 0; s < 4; s++) {
            int i = (s + r) & 3;
            wg_store_quad(d + 4 * i, make_float4(wg_pick(x[0], i), wg_pick(x[1], i),
                                                 wg_pick(x[2], i), wg_pick(x[3], i)));
        }
    }
#if MMA_WG
    wg_proxy_fence();
#endif
}

// `mma_scores` by warpgroup MMAs: the block's 64 query rows (warp w's at qw, rows hp floats
// apart) against a key tile of `wg_store_keys`. Every warp of the block must call it.
template <int STEPS>
__device__ __forceinline__ void wg_scores(const float* qw, const float* ks, int hp,
                                          float s[MMA_KT / 8][4]) {
#if MMA_WG
#pragma unroll
    for (int j = 0; j < MMA_KT / 8; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
    wg_pin_acc<MMA_KT / 8>(s);
    WgDesc kd = wg_desc(ks, 128, 4 * MMA_WG_KSBO);
    // The dimension steps go in commit groups of STEPS, each waited for before the next
    // group's A fragments are written: the MMAs read registers as they run, so a register
    // written sooner is a race. (Two sets of fragments taken in turn, the next group issued
    // while one runs, held more registers than the tiles' prefetch leaves: the spills and the
    // later prefetch cost more than the waits.)
    for (int g0 = 0; g0 < MMA_MAXD; g0 += 8 * STEPS) {
        unsigned ab[STEPS][4], as[STEPS][4];
#pragma unroll
        for (int k = 0; k < STEPS; k++) a_fragment(qw, hp, g0 + 8 * k, ab[k], as[k]);
        wg_fence();
#pragma unroll
        for (int k = 0; k < STEPS; k++) {
            unsigned kb = 8 * (g0 + 8 * k);
            wg_m64n32k8(s, as[k], wg_at(kd, kb));
            wg_m64n32k8(s, ab[k], wg_at(kd, kb + MMA_WG_HALF));
            wg_m64n32k8(s, ab[k], wg_at(kd, kb));
        }
        wg_commit();
        wg_wait<0>();
        wg_hold<STEPS>(ab, as);
    }
    wg_pin_acc<MMA_KT / 8>(s);
#endif
}

// o += P·V by warpgroup MMAs, P from the scores' C fragments as in `pv_tile`. Every warp of the
// block must call it (a warp whose rows take no part passes P = 0).
__device__ __forceinline__ void wg_pv(const float s[MMA_KT / 8][4], const float* vs,
                                      float o[MMA_MAXD / 8][4]) {
#if MMA_WG
    unsigned ab[MMA_KT / 8][4], as[MMA_KT / 8][4];
#pragma unroll
    for (int j = 0; j < MMA_KT / 8; j++) {
        float a[4] = {s[j][0], s[j][2], s[j][1], s[j][3]};
#pragma unroll
        for (int i = 0; i < 4; i++) split_tf32(a[i], ab[j][i], as[j][i]);
    }
    wg_pin_acc<MMA_MAXD / 8>(o);
    WgDesc vd = wg_desc(vs, 128, 4 * MMA_WG_VSBO);
    wg_fence();
#pragma unroll
    for (int j = 0; j < MMA_KT / 8; j++) {
        wg_m64n128k8(o, as[j], wg_at(vd, 2 * j * 32));
        wg_m64n128k8(o, ab[j], wg_at(vd, 2 * j * 32 + MMA_WG_HALF));
        wg_m64n128k8(o, ab[j], wg_at(vd, 2 * j * 32));
    }
    wg_commit();
    wg_wait<0>();
    wg_hold<MMA_KT / 8>(ab, as);
    wg_pin_acc<MMA_MAXD / 8>(o);
#endif
}

// o += P·V with `mma.sync`: P's C fragment reused as the A fragment: its k index t stands for
// key 2t and t + 4 for key 2t + 1, so V's B fragment takes those two keys.
__device__ __forceinline__ void pv_tile(const float s[MMA_KT / 8][4], const float* vs, int vp,
                                        int head_dim, float o[MMA_MAXD / 8][4]) {
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < MMA_KT / 8; j++) {
        float a[4] = {s[j][0], s[j][2], s[j][1], s[j][3]};
        unsigned ab[4], as[4];
#pragma unroll
        for (int i = 0; i < 4; i++) split_tf32(a[i], ab[i], as[i]);
        // Dimension 8(d0 + i) + g: group 2(d0 + i) + g / 4, chunk g % 4, permuted.
        const float* v0 = vs + (4 * j + t) * vp + 16 * (g >> 2);
        // Four output column groups at a time; a group past head_dim (head_dim % 32 != 0)
        // multiplies zeros into an accumulator that is never written out.
#pragma unroll
        for (int d0 = 0; d0 < MMA_MAXD / 8; d0 += 4) {
            if (8 * d0 >= head_dim) break;
            unsigned bb[4][2], bs[4][2];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                uint4 f = 8 * (d0 + i) < head_dim
                              ? *(const uint4*)(v0 + 32 * (d0 + i) + 4 * swz(g & 3, 2 * (d0 + i)))
                              : make_uint4(0, 0, 0, 0);
                bb[i][0] = f.x, bb[i][1] = f.y, bs[i][0] = f.z, bs[i][1] = f.w;
            }
            mma_3xtf32<4>(o + d0, ab, as, bb, bs);
        }
    }
}

// The forms a kernel's tiles take: the warpgroup MMAs' (WG, where the unit is built for sm_90a
// and head_dim is MMA_MAXD; `WG_OK`) or `mma.sync`'s. Both give every score and output the same
// bits. Under WG every warp of the block calls `scores` and `pv` together, outside any branch
// the compiler cannot prove uniform (else it serialises the MMAs).
// KEY_ROWS: the warpgroup tiles' keys fetched by rows of core matrices (`wg_fetch_keys`);
// STEPS: the warpgroup scores' dimension steps a commit group (`wg_scores`).
template <bool WG, bool KEY_ROWS = false, int STEPS = MMA_WG_STEPS>
struct Tiles {
    __device__ __forceinline__ void fetch_keys(const float* src, size_t stride, int first, int rows,
                                               Share sh, Fetched& f) const {
        if (WG) wg_fetch_keys<KEY_ROWS>(src, stride, first, rows, f);
        else fetch_keys_from(src, stride, first, rows, sh, f);
    }
    __device__ __forceinline__ void store_keys(const Fetched& f, float* ks, int kp,
                                               Share sh) const {
        if (WG) wg_store_keys<KEY_ROWS>(f, ks);
        else ::store_keys(f, ks, kp, sh);
    }
    __device__ __forceinline__ void fetch_values(const float* src, size_t stride, int rows,
                                                 Share sh, Fetched& f) const {
        if (WG) wg_fetch_values(src, stride, rows, f);
        else ::fetch_values(src, stride, rows, sh, f);
    }
    __device__ __forceinline__ void store_values(const Fetched& f, float* vs, int vp,
                                                 Share sh) const {
        if (WG) wg_store_values(f, vs);
        else ::store_values(f, vs, vp, sh);
    }
    __device__ __forceinline__ void scores(const float* qw, const float* ks, int hp, int kp,
                                           int head_dim, float s[MMA_KT / 8][4]) const {
        if (WG) wg_scores<STEPS>(qw, ks, hp, s);
        else mma_scores(qw, ks, hp, kp, head_dim, s);
    }
    __device__ __forceinline__ void pv(const float s[MMA_KT / 8][4], const float* vs, int vp,
                                       int head_dim, float o[MMA_MAXD / 8][4]) const {
        if (WG) wg_pv(s, vs, o);
        else pv_tile(s, vs, vp, head_dim, o);
    }
};

// One key tile of the online softmax for the lane's two rows: scores `s` (raw, from
// `mma_scores`) become exp(score·scale - M) in place; each row's cascade parts' maxima m,
// running max M (`mall`) and sums l move on, and `al` is what the row's output accumulator is
// to be rescaled by (`rescale`), 1 where M did not grow. Part 0 is a row's keys before its
// cascade cut, part 1 the rest. FULL: every key of the tile is visible to every row of the warp
// and lies on one side of each row's cut, so no key needs a mask; the results are the same bits
// as the general form's.
template <bool FULL>
__device__ __forceinline__ void softmax_tile(float s[MMA_KT / 8][4], int k0, const int vis[2],
                                             const int cut[2], float scale, float m[2][2],
                                             float l[2][2], float mall[2], float al_out[2]) {
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
        al_out[i] = al;
    }
}

// The output accumulator's rows rescaled by `softmax_tile`'s `al`. Once the maxima settle, M
// rarely grows: multiplying by 1 is skipped when no row of the warp needs it.
__device__ __forceinline__ void rescale(float o[MMA_MAXD / 8][4], const float al[2]) {
#pragma unroll
    for (int i = 0; i < 2; i++) {
        if (__any_sync(0xffffffffu, al[i] != 1.0f)) {
#pragma unroll
            for (int d = 0; d < MMA_MAXD / 8; d++) {
                o[d][2 * i] *= al[i];
                o[d][2 * i + 1] *= al[i];
            }
        }
    }
}

// The weights a running fold (its max aM, per-part maxima am and sums al, relative to aM) and
// a segment's softmax state (M, m, l) combine with; the fold's maxima and sums move on.
// Every form of `attention_mma` and `attention_mma_merge` fold through this and `fold_value`,
// so a row's bits do not depend on which of them ran it. (The first segment is taken as is.)
__device__ __forceinline__ void fold_weights(float& aM, float am[2], float al[2], float M,
                                             const float m[2], const float l[2], float& wa,
                                             float& wb) {
    float mn = fmaxf(aM, M);
    wa = expf(__fsub_rn(aM, mn));
    wb = expf(__fsub_rn(M, mn));
#pragma unroll
    for (int p = 0; p < 2; p++) {
        al[p] = __fadd_rn(__fmul_rn(al[p], wa), __fmul_rn(l[p], wb));
        am[p] = fmaxf(am[p], m[p]);
    }
    aM = mn;
}

__device__ __forceinline__ float fold_value(float acc, float x, float wa, float wb) {
    return __fadd_rn(__fmul_rn(acc, wa), __fmul_rn(x, wb));
}

// The end of the softmax segment that starts at key b (a segment boundary): MMA_SEG keys while
// the keys before are few, then a 1/MMA_SEG_RATIO of them in whole tiles, so that a long row
// folds a few dozen times rather than every few tiles.
__device__ __forceinline__ int seg_after(int b) {
    return b + max(MMA_SEG, b / MMA_SEG_RATIO / MMA_KT * MMA_KT);
}

// Where segment k starts.
__device__ __forceinline__ int seg_start(int k) {
    int b = 0;
    for (int i = 0; i < k; i++) b = seg_after(b);
    return b;
}

// A row's output scale and its cascade parts' weights as in `attention`: exp(lse_part -
// lse_all), over each part's sum relative to its own max. The sums are relative to M, so that
// sum is l·exp(M - m) and the weight w / (l·exp(M - m)) = w·exp(m - M) / l, which cannot
// overflow however far below M a part's max lies.
__device__ __forceinline__ void row_weights(float mall, const float m[2], const float l[2],
                                            float fin[2], float& norm) {
    norm = 1.0f / (l[0] + l[1]);
    float lse_a = l[0] > 0.0f ? mall + logf(l[0]) : NEG_INF;
    // Either sum may underflow to 0 when its part lies far below the other.
    float lse_b = l[1] > 0.0f ? mall + logf(l[1]) : NEG_INF;
    float mm = fmaxf(lse_a, lse_b);
    float wa = l[0] > 0.0f ? expf(lse_a - mm) : 0.0f;
    float wb = l[1] > 0.0f ? expf(lse_b - mm) : 0.0f;
    fin[0] = l[0] > 0.0f ? wa / (wa + wb) * expf(m[0] - mall) / l[0] : 0.0f;
    fin[1] = l[1] > 0.0f ? wb / (wa + wb) * expf(m[1] - mall) / l[1] : 0.0f;
}
#endif

// Prefill attention on the tensor cores. Whole form (`part` null): block (head, query tile)
// walks every key its rows see, segment by segment (`seg_after`), folding each segment into the
// row's running state, whose outputs wait in `out` until the last segment. Split form (`part`
// set, `nseg` segments a row at most): block (head, query tile, segment) takes one segment
// and leaves each row's state in `part` ([query, head, segment] of MMA_PART_HEAD + head_dim
// floats); `attention_mma_merge` folds them. The split form writes no probabilities.
// IMG (warpgroup tiles only): the tiles come from `image` (`attention_mma_image`) by bulk
// copies, the keys' for the next tile issued once the scores are done with the last, the
// values' once P·V is, rather than through registers a tile ahead.
template <bool SPLIT, bool WG, bool IMG = false>
__device__ __forceinline__ void attention_mma_block(
    const float* q, const float* keys, const float* values, float* probs, float* stats,
    float* out, bf16_t* out_bf16, const int* meta, int n, int split, int heads, int kv_heads,
    int head_dim, int stride, float scale, float* part, int nseg, const float* image) {
#if __CUDA_ARCH__ >= 800
    // Named apart from the kernels' `sm`: a template's would conflict with theirs.
    extern __shared__ float sm_block[];
    int hp = MMA_QP(head_dim), kp = MMA_KP(head_dim), vp = MMA_VP(head_dim);
    float* qs = sm_block;
    float* ks = qs + MMA_BQ * hp;
    float* vs = ks + MMA_KT * kp;
    int tiles_q = (n + MMA_BQ - 1) / MMA_BQ;
    int only = SPLIT ? (int)(blockIdx.x % nseg) : -1;
    int b = SPLIT ? (int)(blockIdx.x / nseg) : (int)blockIdx.x;
    // Heaviest query tiles (the latest, seeing the most keys) first.
    int h = b / tiles_q, q0 = (tiles_q - 1 - b % tiles_q) * MMA_BQ;
    int nq = min(MMA_BQ, n - q0);
    int kvh = h / (heads / kv_heads), kv_dim = kv_heads * head_dim;
    int base = meta[0], span = base + n;
    int kend = base + q0 + nq;
    // The keys this block walks: all its rows see, or one segment of them.
    int kfirst = SPLIT ? seg_start(only) : 0;
    int kstop = SPLIT ? min(kend, seg_after(kfirst)) : kend;
    if (kfirst >= kstop) return;
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
    // Per row, within a segment: each cascade part's running max m, the running max of both
    // M, and each part's sum of exp(score - M). The fold of the segments before is in shared
    // memory (MMA_FOLD: its M, m, l) and `out` (its outputs).
    float m[2][2], l[2][2], mall[2], o[MMA_MAXD / 8][4];
    const float* kbase = keys + kvh * head_dim;
    const float* vbase = values + kvh * head_dim;
    Share key_share = share_of(head_dim, 8), value_share = share_of(head_dim, 4);
    const Tiles<WG, WHOLE_KEY_ROWS> tl;
    float s[MMA_KT / 8][4];

    // A segment's end for the warp: each row's state left in `part` (split form) or folded
    // into the row's running fold (whole form).
    auto end_segment = [&](int seg0) {
        // Addresses worked out here from values the compiler takes as new: hoisted out of the
        // loops, they held registers through every tile (and the tiles spilled).
        int head = h, tid = threadIdx.x;
        asm volatile("" : "+r"(head), "+r"(tid));
        // fold[(5i + f) * 128 + thread]: row i's M (f = 0), m (1, 2), l (3, 4).
        float* fold = sm_block + MMA_SHARED(head_dim) - MMA_FOLD + tid;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            // A row that sees none of the segment's keys has nothing to fold.
            if (!row_ok[i] || seg0 >= vis[i]) continue;
            size_t row = (size_t)(q0 + (tid >> 5) * 16 + ((tid & 31) >> 2) + 8 * i) * heads + head;
            if (SPLIT) {
                float* pr = part + (row * nseg + only) * (MMA_PART_HEAD + head_dim);
                if (t == 0) {
                    pr[0] = mall[i];
                    pr[1] = m[i][0], pr[2] = m[i][1];
                    pr[3] = l[i][0], pr[4] = l[i][1];
                }
#pragma unroll
                for (int d = 0; d < MMA_MAXD / 8; d++) {
                    if (8 * d >= head_dim) break;
                    *(float2*)(pr + MMA_PART_HEAD + 8 * d + 2 * t) =
                        make_float2(o[d][2 * i], o[d][2 * i + 1]);
                }
                continue;
            }
            float* acc = out + row * head_dim;
            float* f = fold + 5 * i * 128;
            // A row's first segment is segment 0: taken as is.
            if (seg0 == 0) {
                f[0] = mall[i];
                f[128] = m[i][0], f[256] = m[i][1], f[384] = l[i][0], f[512] = l[i][1];
#pragma unroll
                for (int d = 0; d < MMA_MAXD / 8; d++) {
                    if (8 * d >= head_dim) break;
                    *(float2*)(acc + 8 * d + 2 * t) = make_float2(o[d][2 * i], o[d][2 * i + 1]);
                }
                continue;
            }
            float fM = f[0], fm[2] = {f[128], f[256]}, fl[2] = {f[384], f[512]}, wa, wb;
            fold_weights(fM, fm, fl, mall[i], m[i], l[i], wa, wb);
            f[0] = fM;
            f[128] = fm[0], f[256] = fm[1], f[384] = fl[0], f[512] = fl[1];
            // A group's loads all before its stores: interleaved, each load waited for the
            // store before it (the compiler cannot tell the rows from the fold's state).
#pragma unroll
            for (int d0 = 0; d0 < MMA_MAXD / 8; d0 += MMA_FOLD_GROUP) {
                if (8 * d0 >= head_dim) break;
                float2 was[MMA_FOLD_GROUP];
#pragma unroll
                for (int d = 0; d < MMA_FOLD_GROUP; d++)
                    if (8 * (d0 + d) < head_dim)
                        was[d] = *(const float2*)(acc + 8 * (d0 + d) + 2 * t);
#pragma unroll
                for (int d = 0; d < MMA_FOLD_GROUP; d++)
                    if (8 * (d0 + d) < head_dim)
                        *(float2*)(acc + 8 * (d0 + d) + 2 * t) =
                            make_float2(fold_value(was[d].x, o[d0 + d][2 * i], wa, wb),
                                        fold_value(was[d].y, o[d0 + d][2 * i + 1], wa, wb));
            }
        }
    };
    // The tile's online-softmax step (`softmax_tile`): tiles wholly below the warp's diagonal
    // and on one side of the cut need no masks.
    auto softmax = [&](int k0, float al[2]) {
        if (k0 + MMA_KT <= base + qw0 + 1 && (split <= 0 || k0 + MMA_KT <= split || k0 >= split))
            softmax_tile<true>(s, k0, vis, cut, scale, m, l, mall, al);
        else
            softmax_tile<false>(s, k0, vis, cut, scale, m, l, mall, al);
    };
    // One pass over the keys (online softmax within each segment): statistics, and exp(score
    // - M) summed over V with the output rescaled whenever M grows. A cascade's two parts share
    // the output accumulator: merging per-part softmaxes by log-sum-exp weights is this same sum.
    Fetched fk, fv;
    // The segment the tiles are in: [s0, s1).
    int s0 = kfirst, s1 = min(kstop, seg_after(kfirst));
    // Under IMG: the tiles' barriers (in the key buffer's padding past the tile), the phases
    // awaited next, and this KV head's tiles.
    unsigned long long* bars = (unsigned long long*)(ks + 2 * MMA_WG_HALF);
    unsigned kphase = 0, vphase = 0;
    const float* img =
        IMG ? image + (size_t)kvh * ((span + MMA_KT - 1) / MMA_KT) * MMA_IMG_TILE : nullptr;
    if (IMG) {
        if (threadIdx.x == 0) mbar_init(bars), mbar_init(bars + 1);
        __syncthreads();
        if (threadIdx.x == 0) {
            const float* t0 = img + (size_t)(kfirst / MMA_KT) * MMA_IMG_TILE;
            bulk_load(ks, t0, MMA_IMG_BYTES, bars);
            bulk_load(vs, t0 + 2 * MMA_WG_HALF, MMA_IMG_BYTES, bars + 1);
        }
    } else {
        tl.fetch_keys(kbase, kv_dim, kfirst, s1, key_share, fk);
        tl.fetch_values(vbase + (size_t)kfirst * kv_dim, kv_dim, s1 - kfirst, value_share, fv);
    }
    for (int k0 = kfirst; k0 < kstop; k0 += MMA_KT) {
        if (!IMG) {
            __syncthreads();
            tl.store_keys(fk, ks, kp, key_share);
            tl.store_values(fv, vs, vp, value_share);
            __syncthreads();
        }
        int next = k0 + MMA_KT;
        const float* img_next = IMG ? img + (size_t)(next / MMA_KT) * MMA_IMG_TILE : nullptr;
        // Within the segment the next tile is fetched now; a segment's first tile is fetched
        // once the segment before is folded (held through the fold, its registers spilled).
        if (!IMG && next < s1) {
            tl.fetch_keys(kbase, kv_dim, next, s1, key_share, fk);
            tl.fetch_values(vbase + (size_t)next * kv_dim, kv_dim, s1 - next, value_share, fv);
        }
        bool live = k0 < kend_w;
        float al[2];
        if (!WG) {
            if (live) {
                if (k0 == s0) {
#pragma unroll
                    for (int i = 0; i < 2; i++)
                        m[i][0] = m[i][1] = mall[i] = NEG_INF, l[i][0] = l[i][1] = 0.0f;
#pragma unroll
                    for (int d = 0; d < MMA_MAXD / 8; d++)
                        o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
                }
                tl.scores(qw, ks, hp, kp, head_dim, s);
                softmax(k0, al);
                rescale(o, al);
                tl.pv(s, vs, vp, head_dim, o);
            }
        } else {
            // Every warp takes part in the MMAs; a warp past its rows' keys adds P = 0, which
            // leaves its outputs as they were. The MMAs' registers are written outside the
            // warp's branches: the compiler serialises MMAs whose inputs a branch it cannot
            // prove uniform wrote.
            bool reset = live && k0 == s0;
            if (reset) {
#pragma unroll
                for (int i = 0; i < 2; i++)
                    m[i][0] = m[i][1] = mall[i] = NEG_INF, l[i][0] = l[i][1] = 0.0f;
            }
#pragma unroll
            for (int d = 0; d < MMA_MAXD / 8; d++)
#pragma unroll
                for (int c = 0; c < 4; c++) o[d][c] = reset ? 0.0f : o[d][c];
            if (IMG) mbar_wait(bars, kphase);
            tl.scores(qw, ks, hp, kp, head_dim, s);
            if (IMG) {
                // Every warp's MMAs have read the keys (each waited for its own).
                __syncthreads();
                if (threadIdx.x == 0 && next < kstop) bulk_load(ks, img_next, MMA_IMG_BYTES, bars);
            }
            al[0] = al[1] = 1.0f;
            if (live) softmax(k0, al);
            rescale(o, al);
#pragma unroll
            for (int j = 0; j < MMA_KT / 8; j++)
#pragma unroll
                for (int c = 0; c < 4; c++) s[j][c] = live ? s[j][c] : 0.0f;
            if (IMG) mbar_wait(bars + 1, vphase);
            tl.pv(s, vs, vp, head_dim, o);
            if (IMG) {
                __syncthreads();
                if (threadIdx.x == 0 && next < kstop)
                    bulk_load(vs, img_next + 2 * MMA_WG_HALF, MMA_IMG_BYTES, bars + 1);
            }
        }
        if (next < s1) continue;
        // The segment's last tile: its state folded where the warp's rows saw it.
        if (s0 < kend_w) end_segment(s0);
        s0 = s1;
        s1 = min(kstop, seg_after(s1));
        if (!IMG && next < kstop) {
            tl.fetch_keys(kbase, kv_dim, next, s1, key_share, fk);
            tl.fetch_values(vbase + (size_t)next * kv_dim, kv_dim, s1 - next, value_share, fv);
        }
    }
    if constexpr (SPLIT) return;
    else {
    float fin[2][2], norm[2], fm[2][2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        fin[i][0] = fin[i][1] = norm[i] = fm[i][0] = fm[i][1] = 0.0f;
        if (!row_ok[i]) continue;
        const float* f = sm_block + MMA_SHARED(head_dim) - MMA_FOLD + threadIdx.x + 5 * i * 128;
        float fl[2] = {f[384], f[512]};
        fm[i][0] = f[128], fm[i][1] = f[256];
        row_weights(f[0], fm[i], fl, fin[i], norm[i]);
        if (stats && t == 0) {
            float* st = stats + ((size_t)(qw0 + g + 8 * i) * heads + h) * 4;
            st[0] = fm[i][0];
            st[1] = fm[i][1];
            st[2] = fin[i][0];
            st[3] = fin[i][1];
        }
    }
    // The fold's outputs, all loaded before the first store (as in `end_segment`).
#pragma unroll
    for (int d = 0; d < MMA_MAXD / 8; d++) {
        if (8 * d >= head_dim) break;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            if (!row_ok[i]) continue;
            float2 v = *(const float2*)(out + ((size_t)(qw0 + g + 8 * i) * heads + h) * head_dim +
                                        8 * d + 2 * t);
            o[d][2 * i] = v.x, o[d][2 * i + 1] = v.y;
        }
    }
#pragma unroll
    for (int d = 0; d < MMA_MAXD / 8; d++) {
        if (8 * d >= head_dim) break;
#pragma unroll
        for (int c = 0; c < 4; c++) {
            int i = c / 2;
            if (!row_ok[i]) continue;
            size_t at = ((size_t)(qw0 + g + 8 * i) * heads + h) * head_dim + 8 * d + 2 * t + c % 2;
            float v = o[d][c] * norm[i];
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
        st[i][0] = fm[i][0], st[i][1] = fm[i][1], st[i][2] = fin[i][0], st[i][3] = fin[i][1];
        row_at[i] = ((size_t)(qw0 + g + 8 * i) * heads + h) * stride;
    }
    tl.fetch_keys(kbase, kv_dim, 0, kend, key_share, fk);
    for (int k0 = 0; k0 < kend; k0 += MMA_KT) {
        __syncthreads();
        tl.store_keys(fk, ks, kp, key_share);
        __syncthreads();
        int next = k0 + MMA_KT;
        if (next < kend) tl.fetch_keys(kbase, kv_dim, next, kend, key_share, fk);
        if (WG) tl.scores(qw, ks, hp, kp, head_dim, s);
        if (k0 >= kend_w) continue;
        if (!WG) tl.scores(qw, ks, hp, kp, head_dim, s);
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
    }
#endif
}

extern "C" __global__ void __launch_bounds__(128)
    attention_mma(const float* q, const float* keys, const float* values, float* probs,
                  float* stats, float* out, bf16_t* out_bf16, const int* meta, int n, int split,
                  int heads, int kv_heads, int head_dim, int stride, float scale) {
    PDL_ENTER();
    if (WG_OK(head_dim))
        attention_mma_block<false, true>(q, keys, values, probs, stats, out, out_bf16, meta, n,
                                         split, heads, kv_heads, head_dim, stride, scale, nullptr,
                                         1, nullptr);
    else
        attention_mma_block<false, false>(q, keys, values, probs, stats, out, out_bf16, meta, n,
                                          split, heads, kv_heads, head_dim, stride, scale,
                                          nullptr, 1, nullptr);
}

// `attention_mma` with its tiles from `image` (`attention_mma_image` of the pass's keys and
// values), for head_dim == MMA_MAXD on sm_90a only: a kernel of its own, so that neither
// form's registers are the other's.
extern "C" __global__ void __launch_bounds__(128)
    attention_mma_imaged(const float* q, const float* keys, const float* values, float* probs,
                         float* stats, float* out, bf16_t* out_bf16, const int* meta, int n,
                         int split, int heads, int kv_heads, int head_dim, int stride,
                         float scale, const float* image) {
    PDL_ENTER();
#if MMA_WG
    attention_mma_block<false, true, true>(q, keys, values, probs, stats, out, out_bf16, meta, n,
                                           split, heads, kv_heads, head_dim, stride, scale,
                                           nullptr, 1, image);
#endif
}

// The key tiles of a pass over `rows` keys as the warpgroup tiles take them (MMA_IMG_TILE
// floats each, [kv head, tile]; zeros past `rows`), split once here rather than by every block
// that walks them. Block: one tile of one KV head. Only where the warpgroup tiles are built.
extern "C" __global__ void __launch_bounds__(128)
    attention_mma_image(const float* keys, const float* values, float* image, int rows,
                        int kv_heads, int head_dim) {
    PDL_ENTER();
#if MMA_WG
    int tiles = (rows + MMA_KT - 1) / MMA_KT;
    int tile = blockIdx.x % tiles, kvh = blockIdx.x / tiles, kv_dim = kv_heads * head_dim;
    float* dst = image + ((size_t)kvh * tiles + tile) * MMA_IMG_TILE;
    Fetched f;
    wg_fetch_keys<false>(keys + kvh * head_dim, kv_dim, tile * MMA_KT, rows, f);
    wg_store_keys<false>(f, dst);
    wg_fetch_values(values + kvh * head_dim + (size_t)tile * MMA_KT * kv_dim, kv_dim,
                    rows - tile * MMA_KT, f);
    wg_store_values(f, dst + 2 * MMA_WG_HALF);
#endif
}

// Grid: heads · query tiles · nseg blocks; dynamic shared memory MMA_SHARED(head_dim) floats
// as the whole form.
extern "C" __global__ void __launch_bounds__(128)
    attention_mma_split(const float* q, const float* keys, const float* values, const int* meta,
                        int n, int split, int heads, int kv_heads, int head_dim, float scale,
                        float* part, int nseg) {
    PDL_ENTER();
    if (WG_OK(head_dim))
        attention_mma_block<true, true>(q, keys, values, nullptr, nullptr, nullptr, nullptr, meta,
                                        n, split, heads, kv_heads, head_dim, 0, scale, part, nseg,
                                        nullptr);
    else
        attention_mma_block<true, false>(q, keys, values, nullptr, nullptr, nullptr, nullptr, meta,
                                         n, split, heads, kv_heads, head_dim, 0, scale, part, nseg,
                                         nullptr);
}

// The split form's segments of each (query, head) row folded left to right, as the whole form
// folds them, and the row finished as it finishes it: outputs in f32 and bf16, statistics.
// Block: one row, head_dim threads (each its column; the fold's weights computed by all alike).
extern "C" __global__ void attention_mma_merge(const float* part, float* stats, float* out,
                                               bf16_t* out_bf16, const int* meta, int heads,
                                               int head_dim, int nseg) {
    PDL_ENTER();
#if __CUDA_ARCH__ >= 800
    size_t row = blockIdx.x;
    int d = threadIdx.x;
    int qi = (int)(row / heads);
    int vis = meta[0] + qi + 1;
    const float* pr = part + row * nseg * (MMA_PART_HEAD + head_dim);
    float fM = pr[0], fm[2] = {pr[1], pr[2]}, fl[2] = {pr[3], pr[4]};
    float acc = d < head_dim ? pr[MMA_PART_HEAD + d] : 0.0f;
    // The segments the row sees.
    int used = 1;
    for (int b = seg_after(0); used < nseg && b < vis; b = seg_after(b)) used++;
    // Four segments' loads in flight at a time, folded in order.
    for (int k0 = 1; k0 < used; k0 += 4) {
        float st[4][5], x[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float* pk = pr + (size_t)min(k0 + j, used - 1) * (MMA_PART_HEAD + head_dim);
#pragma unroll
            for (int e = 0; e < 5; e++) st[j][e] = pk[e];
            x[j] = d < head_dim ? pk[MMA_PART_HEAD + d] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            if (k0 + j >= used) break;
            float m[2] = {st[j][1], st[j][2]}, l[2] = {st[j][3], st[j][4]}, wa, wb;
            fold_weights(fM, fm, fl, st[j][0], m, l, wa, wb);
            acc = fold_value(acc, x[j], wa, wb);
        }
    }
    float fin[2], norm;
    row_weights(fM, fm, fl, fin, norm);
    if (d < head_dim) {
        float v = acc * norm;
        out[row * head_dim + d] = v;
        out_bf16[row * head_dim + d] = f32_to_bf16(v);
    }
    if (stats && d == 0) {
        float* st = stats + row * 4;
        st[0] = fm[0];
        st[1] = fm[1];
        st[2] = fin[0];
        st[3] = fin[1];
    }
#endif
}

// `probs_from_stats` for rows `attention_mma` wrote: the scores by `mma_scores`, the
// probabilities by `prob_of`, so every value equals the one the kernel computed. Block: 4
// warps of 16 rows (`rows[i]`: a query's index in its pass) and MMA_RB_KEYS keys, taken
// MMA_KT at a time; `out` is [count, heads, span], 0 at or past each query's
// `base + index + 1`. Dynamic shared memory: MMA_RB_SHARED(head_dim) floats.
template <bool WG>
__device__ __forceinline__ void probs_from_stats_block(const float* q, const float* keys,
                                                       const float* stats, const int* rows,
                                                       float* out, int count, int base, int split,
                                                       int heads, int kv_heads, int head_dim,
                                                       int span, float scale) {
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
    const Tiles<WG> tl;
    float s[MMA_KT / 8][4];
    size_t row_at[2];
#pragma unroll
    for (int i = 0; i < 2; i++) row_at[i] = ((size_t)(i0 + rw0 + g + 8 * i) * heads + h) * span;
    Fetched fk;
    if (kfirst < kend) tl.fetch_keys(kbase, kv_dim, kfirst, kend, key_share, fk);
    for (int k0 = kfirst; k0 < klast; k0 += MMA_KT) {
        if (k0 < kend) {
            __syncthreads();
            tl.store_keys(fk, ks, kp, key_share);
            __syncthreads();
            int next = k0 + MMA_KT;
            if (next < kend && next < klast)
                tl.fetch_keys(kbase, kv_dim, next, kend, key_share, fk);
        }
        // Past the warp's last visible key the scores are not needed: every value is 0. (The
        // warpgroup MMAs take every warp while any needs them.)
        if (WG ? k0 < kend : nqw > 0 && k0 < kend_w)
            tl.scores(qs + rw0 * hp, ks, hp, kp, head_dim, s);
        if (nqw == 0) continue;
        if (k0 + MMA_KT <= min(vis_w, klast) &&
            (split <= 0 || k0 + MMA_KT <= split || k0 >= split))
            write_probs<true>(s, k0, klast, scale, row_ok, vis, cut, st, out, row_at);
        else
            write_probs<false>(s, k0, klast, scale, row_ok, vis, cut, st, out, row_at);
    }
#endif
}

extern "C" __global__ void __launch_bounds__(128)
    probs_from_stats_mma(const float* q, const float* keys, const float* stats, const int* rows,
                         float* out, int count, int base, int split, int heads, int kv_heads,
                         int head_dim, int span, float scale) {
    PDL_ENTER();
    if (WG_OK(head_dim))
        probs_from_stats_block<true>(q, keys, stats, rows, out, count, base, split, heads,
                                     kv_heads, head_dim, span, scale);
    else
        probs_from_stats_block<false>(q, keys, stats, rows, out, count, base, split, heads,
                                      kv_heads, head_dim, span, scale);
}
