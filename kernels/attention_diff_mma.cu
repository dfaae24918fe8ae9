// The attention diff (`attention_diff_mma`): a path pass's attention rows against a
// reference's, both rebuilt from their parts by the tensor-core attention's own scores and
// probabilities (attention_mma.cu) and summarised as `diff_rows` summarises rows.

// Running `diff_rows` statistics of one row's columns as a lane sees them (x: path, y:
// reference), in ascending column order.
struct RowStats {
    float best, mref, d2, b2, ab, a2, bits, best_x, best_y, bad_x, bad_y;
    int best_at, bad;
};

__device__ __forceinline__ void stats_start(RowStats& r) {
    r.best = -1.0f, r.mref = r.d2 = r.b2 = r.ab = r.a2 = r.bits = 0.0f;
    r.best_x = r.best_y = r.bad_x = r.bad_y = 0.0f;
    r.best_at = 0, r.bad = 0x7fffffff;
}

__device__ __forceinline__ void stats_add(RowStats& r, float x, float y, int col) {
    if (__float_as_uint(x) != __float_as_uint(y)) r.bits += 1.0f;
    if (!finite(x) || !finite(y)) {
        if (col < r.bad) r.bad = col, r.bad_x = x, r.bad_y = y;
        return;
    }
    float d = fabsf(x - y);
    if (d > r.best) r.best = d, r.best_at = col, r.best_x = x, r.best_y = y;
    r.mref = fmaxf(r.mref, fabsf(y));
    r.d2 += (x - y) * (x - y);
    r.b2 += y * y;
    r.ab += x * y;
    r.a2 += x * x;
}

// Merges the statistics of the four lanes that hold a row (lanes 4g .. 4g + 3): the largest
// difference at its smallest column, the first non-finite column, sums.
__device__ __forceinline__ void stats_merge_quad(RowStats& r) {
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) {
        float best = __shfl_xor_sync(0xffffffffu, r.best, o);
        int at = __shfl_xor_sync(0xffffffffu, r.best_at, o);
        float bx = __shfl_xor_sync(0xffffffffu, r.best_x, o);
        float by = __shfl_xor_sync(0xffffffffu, r.best_y, o);
        if (best > r.best || (best == r.best && at < r.best_at))
            r.best = best, r.best_at = at, r.best_x = bx, r.best_y = by;
        int bad = __shfl_xor_sync(0xffffffffu, r.bad, o);
        float cx = __shfl_xor_sync(0xffffffffu, r.bad_x, o);
        float cy = __shfl_xor_sync(0xffffffffu, r.bad_y, o);
        if (bad < r.bad) r.bad = bad, r.bad_x = cx, r.bad_y = cy;
        r.mref = fmaxf(r.mref, __shfl_xor_sync(0xffffffffu, r.mref, o));
        r.d2 += __shfl_xor_sync(0xffffffffu, r.d2, o);
        r.b2 += __shfl_xor_sync(0xffffffffu, r.b2, o);
        r.ab += __shfl_xor_sync(0xffffffffu, r.ab, o);
        r.a2 += __shfl_xor_sync(0xffffffffu, r.a2, o);
        r.bits += __shfl_xor_sync(0xffffffffu, r.bits, o);
    }
}

// Whether keys k0 .. k0 + MMA_KT are all seen (below `seen`) and on one side of a cascade cut.
__device__ __forceinline__ bool tile_inside(int k0, int seen, int split) {
    return k0 >= 0 && k0 + MMA_KT <= seen &&
           (split <= 0 || k0 + MMA_KT <= split || k0 >= split);
}

// Attention rows compared where they are computed, so neither side's rows are ever written:
// a path pass's rows (token i is its query row i) against reference rows b_rows[i] (-1: none,
// skipped), both rebuilt from their parts exactly as `probs_from_stats_mma` rebuilds them
// (`mma_scores`, `prob_of`), then diffed as `diff_rows` diffs a path row whose values sit at
// columns a_lead .. a_lead + a_width against a reference row at b_lead .. b_lead + b_width.
// Out: per (token, head, chunk of `cols` columns) the 12 words of `diff_rows`, column indices
// counted from the head row's column 0; a token without a reference row gets -2 at word 7 of
// each. Columns past every row's visible keys are zeros on both sides: once a block reaches
// them it stops. Block: 4 warps of 16 tokens, one head, one chunk; blockIdx.x =
// (tile · heads + head) · chunks + chunk. Dynamic shared memory: MMA_DIFF_SHARED(head_dim)
// floats (both sides' queries, one key tile, loaded for each side in turn, and a word for the
// block's last visible column: no static shared memory, which would not fit beside the dynamic
// maximum these kernels are given).
#define MMA_DIFF_SHARED(hd) (2 * MMA_BQ * MMA_QP(hd) + MMA_KT * MMA_KP(hd) + 4)
template <bool WG>
__device__ __forceinline__ void attention_diff_block(
    const float* qa, const float* ka, const float* sa, int a_base, int a_split, int a_lead,
    int a_width, const float* qb, const float* kb, const float* sb, const int* b_rows, int b_base,
    int b_split, int b_lead, int b_width, float* out, int count, int cols, int heads,
    int kv_heads, int head_dim, float scale) {
#if __CUDA_ARCH__ >= 800
    extern __shared__ float sm[];
    int hp = MMA_QP(head_dim), kp = MMA_KP(head_dim);
    float* qsa = sm;
    float* qsb = qsa + MMA_BQ * hp;
    float* ks = qsb + MMA_BQ * hp;
    int w = max(a_lead + a_width, b_lead + b_width);
    int chunks = (w + cols - 1) / cols;
    int kc = blockIdx.x % chunks, rest = blockIdx.x / chunks;
    int h = rest % heads, i0 = (rest / heads) * MMA_BQ;
    int cfirst = kc * cols, clast = min(w, cfirst + cols);
    int nq = min(MMA_BQ, count - i0);
    int kvh = h / (heads / kv_heads), kv_dim = kv_heads * head_dim;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int vec = head_dim / 4;
    for (int i = threadIdx.x; i < MMA_BQ * vec; i += blockDim.x) {
        int r = i / vec, c = (i % vec) * 4;
        float4 va = make_float4(0.0f, 0.0f, 0.0f, 0.0f), vb = va;
        int br = r < nq ? b_rows[i0 + r] : -1;
        if (r < nq) va = *(const float4*)(qa + ((size_t)(i0 + r) * heads + h) * head_dim + c);
        if (br >= 0) vb = *(const float4*)(qb + ((size_t)br * heads + h) * head_dim + c);
        *(float4*)(qsa + r * hp + c) = va;
        *(float4*)(qsb + r * hp + c) = vb;
    }
    // The lane's two rows (g and g + 8 of the warp): each side's visible keys, cut, statistics.
    int rw0 = warp * 16, vis_a[2], vis_b[2], cut_a[2], cut_b[2];
    bool ok[2], skip[2];
    float st_a[2][4], st_b[2][4];
    RowStats rs[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        int r = rw0 + g + 8 * i, tok = i0 + r;
        int br = r < nq ? b_rows[tok] : -1;
        ok[i] = br >= 0;
        skip[i] = r < nq && br < 0;
        vis_a[i] = ok[i] ? a_base + tok + 1 : 0;
        vis_b[i] = ok[i] ? b_base + br + 1 : 0;
        cut_a[i] = (a_split > 0 && a_split < vis_a[i]) ? a_split : 0;
        cut_b[i] = (b_split > 0 && b_split < vis_b[i]) ? b_split : 0;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            st_a[i][j] = ok[i] ? sa[((size_t)tok * heads + h) * 4 + j] : 0.0f;
            st_b[i][j] = ok[i] ? sb[((size_t)br * heads + h) * 4 + j] : 0.0f;
        }
        stats_start(rs[i]);
    }
    bool warp_on = __any_sync(0xffffffffu, ok[0] || ok[1]);
    // Columns past this one are zeros on both sides for every row of the block.
    int& block_end = *(int*)(ks + MMA_KT * kp);
    if (threadIdx.x == 0) block_end = 0;
    __syncthreads();
    int end = 0;
#pragma unroll
    for (int i = 0; i < 2; i++)
        if (ok[i]) end = max(end, max(a_lead + vis_a[i], b_lead + vis_b[i]));
    atomicMax(&block_end, end);
    __syncthreads();
    int stop = min(clast, block_end);
    // And past this one for every row of the warp: its tiles from there on are zeros too.
    for (int o = 16; o > 0; o >>= 1) end = max(end, __shfl_xor_sync(0xffffffffu, end, o));
    int wstop = min(stop, end);
    // Keys every row of the warp sees, per side.
    int vmin_a = 0x7fffffff, vmin_b = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < 2; i++)
        if (ok[i]) vmin_a = min(vmin_a, vis_a[i]), vmin_b = min(vmin_b, vis_b[i]);
    for (int o = 16; o > 0; o >>= 1) {
        vmin_a = min(vmin_a, __shfl_xor_sync(0xffffffffu, vmin_a, o));
        vmin_b = min(vmin_b, __shfl_xor_sync(0xffffffffu, vmin_b, o));
    }
    const float* kabase = ka + kvh * head_dim;
    const float* kbbase = kb + kvh * head_dim;
    Share key_share = share_of(head_dim, 8);
    const Tiles<WG, true, MMA_DIFF_WG_STEPS> tl;
    float s_a[MMA_KT / 8][4], s_b[MMA_KT / 8][4];
    // Tiles before both sides' first column are zeros on both sides for every row: they are
    // not computed (a chunk prefilled on its own sits far into the row). All they would add is
    // the row's largest difference, 0 at the chunk's first column, where nothing later beats it.
    int start = cfirst;
    int lead = min(min(a_lead, b_lead), stop);
    if (lead > cfirst) start += (lead - cfirst) / MMA_KT * MMA_KT;
    // Both sides' next key tiles are in flight while this one is computed; a side with no
    // column in a tile (a path chunk's row left of its chunk) neither loads nor multiplies.
    Fetched fa, fb;
    if (start < stop) {
        tl.fetch_keys(kabase, kv_dim, start - a_lead, a_width, key_share, fa);
        tl.fetch_keys(kbbase, kv_dim, start - b_lead, b_width, key_share, fb);
    }
    for (int c0 = start; c0 < stop; c0 += MMA_KT) {
        // Block-uniform: whether a side has any column in this tile.
        bool need_a = c0 + MMA_KT > a_lead && c0 < a_lead + a_width;
        bool need_b = c0 + MMA_KT > b_lead && c0 < b_lead + b_width;
        bool on = warp_on && c0 < wstop;
        // The warpgroup MMAs take every warp while any warp's rows need the tile: up to `stop`,
        // the largest warp's `wstop`.
        bool run = WG || on;
        if (need_a) {
            __syncthreads();
            tl.store_keys(fa, ks, kp, key_share);
            __syncthreads();
            if (run) tl.scores(qsa + rw0 * hp, ks, hp, kp, head_dim, s_a);
        }
        if (need_b) {
            __syncthreads();
            tl.store_keys(fb, ks, kp, key_share);
            __syncthreads();
        }
        int next = c0 + MMA_KT;
        if (next < stop) {
            tl.fetch_keys(kabase, kv_dim, next - a_lead, a_width, key_share, fa);
            tl.fetch_keys(kbbase, kv_dim, next - b_lead, b_width, key_share, fb);
        }
        if (need_b && run) tl.scores(qsb + rw0 * hp, ks, hp, kp, head_dim, s_b);
        if (!on) continue;
        // A tile whose every column is a visible key of the reference for every row, on one
        // side of each cut, and either a visible key of the path too (`with_a`) or no column of
        // the path's (a chunk's row, left of its chunk: x is 0 throughout, as the general form
        // gives it): the same values without per-column tests.
        auto inside = [&](bool with_a) {
#pragma unroll
            for (int i = 0; i < 2; i++) {
                if (!ok[i]) continue;
                bool in0a = c0 - a_lead < cut_a[i], in0b = c0 - b_lead < cut_b[i];
                float ma = in0a ? st_a[i][0] : st_a[i][1], fa_ = in0a ? st_a[i][2] : st_a[i][3];
                float mb = in0b ? st_b[i][0] : st_b[i][1], fb_ = in0b ? st_b[i][2] : st_b[i][3];
#pragma unroll
                for (int j = 0; j < MMA_KT / 8; j++) {
#pragma unroll
                    for (int c = 2 * i; c < 2 * i + 2; c++) {
                        int col = c0 + 8 * j + 2 * t + (c % 2);
                        float x = with_a ? prob_of(s_a[j][c], scale, ma, fa_) : 0.0f;
                        stats_add(rs[i], x, prob_of(s_b[j][c], scale, mb, fb_), col);
                    }
                }
            }
        };
        if (need_a && need_b && c0 + MMA_KT <= clast &&
            tile_inside(c0 - a_lead, vmin_a, a_split) &&
            tile_inside(c0 - b_lead, vmin_b, b_split)) {
            inside(true);
            continue;
        }
        if (!need_a && need_b && c0 + MMA_KT <= clast &&
            tile_inside(c0 - b_lead, vmin_b, b_split)) {
            inside(false);
            continue;
        }
#pragma unroll
        for (int j = 0; j < MMA_KT / 8; j++) {
#pragma unroll
            for (int c = 0; c < 4; c++) {
                int i = c / 2, col = c0 + 8 * j + 2 * t + (c % 2);
                if (!ok[i] || col >= clast) continue;
                int k = col - a_lead;
                bool in0 = k < cut_a[i];
                float x = k >= 0 && k < a_width && k < vis_a[i]
                              ? prob_of(s_a[j][c], scale, in0 ? st_a[i][0] : st_a[i][1],
                                        in0 ? st_a[i][2] : st_a[i][3])
                              : 0.0f;
                k = col - b_lead;
                in0 = k < cut_b[i];
                float y = k >= 0 && k < b_width && k < vis_b[i]
                              ? prob_of(s_b[j][c], scale, in0 ? st_b[i][0] : st_b[i][1],
                                        in0 ? st_b[i][2] : st_b[i][3])
                              : 0.0f;
                stats_add(rs[i], x, y, col);
            }
        }
    }
    // The zeros past `wstop`: all adding them would change is the largest difference where no
    // finite value came before it in the chunk: 0, at the first of them (the quad merge keeps
    // the smallest column among equals, so every lane may claim that one). A tile computed past
    // `wstop` holds finite zeros, so a row still without one computed none there.
    int zeros = max(wstop, cfirst);
#pragma unroll
    for (int i = 0; i < 2; i++) {
        if (rs[i].best < 0.0f && zeros < clast)
            rs[i].best = 0.0f, rs[i].best_at = zeros, rs[i].best_x = rs[i].best_y = 0.0f;
        // The tiles not computed before `start`: a difference of 0 at cfirst comes first.
        if (ok[i] && start > cfirst && rs[i].best <= 0.0f)
            rs[i].best = 0.0f, rs[i].best_at = cfirst, rs[i].best_x = rs[i].best_y = 0.0f;
    }
    // Warp-wide from here (the quad merges shuffle).
    if (!warp_on && !__any_sync(0xffffffffu, skip[0] || skip[1])) return;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        stats_merge_quad(rs[i]);
        if (t != 0 || (!ok[i] && !skip[i])) continue;
        float* o = out + (((size_t)(i0 + rw0 + g + 8 * i) * heads + h) * chunks + kc) * 12;
        const RowStats& r = rs[i];
        bool bad = r.bad != 0x7fffffff;
        float v[12] = {fmaxf(r.best, 0.0f), (float)r.best_at, r.mref, r.d2, r.b2, r.ab, r.a2,
                       skip[i] ? -2.0f : bad ? (float)r.bad : -1.0f, r.bits,
                       bad ? r.bad_x : r.best_x, bad ? r.bad_y : r.best_y, 0.0f};
#pragma unroll
        for (int k = 0; k < 12; k++) o[k] = v[k];
    }
#endif
}

extern "C" __global__ void __launch_bounds__(128)
    attention_diff_mma(const float* qa, const float* ka, const float* sa, int a_base, int a_split,
                       int a_lead, int a_width, const float* qb, const float* kb,
                       const float* sb, const int* b_rows, int b_base, int b_split, int b_lead,
                       int b_width, float* out, int count, int cols, int heads, int kv_heads,
                       int head_dim, float scale) {
    PDL_ENTER();
    if (WG_OK(head_dim))
        attention_diff_block<true>(qa, ka, sa, a_base, a_split, a_lead, a_width, qb, kb, sb,
                                   b_rows, b_base, b_split, b_lead, b_width, out, count, cols,
                                   heads, kv_heads, head_dim, scale);
    else
        attention_diff_block<false>(qa, ka, sa, a_base, a_split, a_lead, a_width, qb, kb, sb,
                                    b_rows, b_base, b_split, b_lead, b_width, out, count, cols,
                                    heads, kv_heads, head_dim, scale);
}
