// y[m] (f32) = w[m, k] (bf16) · x[k] (bf16), f32 accumulation: the GEMMs of a decode step, where
// one token makes every GEMM a matrix-vector product bound by reading the weights, and the
// `_sides` kernels below, which do it for several decode steps at once from one read of w.
//
// A block of 256 threads takes a tile of 8 rows of w (rows 8b .. 8b + 7 for block b); its 8
// warps split k into 8 slices, and warp 0 adds their sums in a fixed tree. On sm_80 and later a
// warp sums its slice on the tensor cores with mma.m16n8k16 (bf16 operands, f32 accumulation):
// the inputs are A (row i: input i, up to 16), the tile's rows are B. Lane (g, t) = (lane / 4,
// lane % 4) loads 16 bytes of row g at column 32j + 8t for each 32-column segment j of its
// slice (a load of the warp reads 64 contiguous bytes of each of the 8 rows, weights streamed
// past L1) and the same 16 bytes of inputs g and g + 8: words 0-1 are one MMA's fragments,
// words 2-3 the next's, a fixed permutation of k inside each segment, the same for both
// operands. The order of every output's sum thus depends on k alone, never on the inputs beside
// it or the kernel: each side of a `_sides` launch gets the single kernel's bits. Dotting on the
// FP32 pipes instead took about 100 instructions per 16 weight bytes a lane at five sides, and
// left the GEMVs issue-bound at half the weights' bandwidth (scripts/bench_gemv_sides.cu).
// Before sm_80 a warp dots a whole row with every input on the FP32 pipes (see gemv_slice).
// Needs k % 8 == 0 and 16-byte aligned rows and inputs (the host falls back to GEMMs
// otherwise). Blocks of 256 threads, m / 8 of them, rounded up.
#define GEMV_WARPS 8
// Segments a warp loads before it multiplies them: 2 was faster than 4 and 8 at both models'
// shapes, alone and at five sides (scripts/bench_gemv_sides.cu).
#ifndef GEMV_U
#define GEMV_U 2
#endif

// A weight vector, streamed past L1: each is read once, and in L1 it would only evict the
// inputs, which every block reads again (with ten sides, keeping them there made the LM head
// 2.3x faster). Not volatile: weights are never written, so the loads may move freely.
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

#if __CUDA_ARCH__ < 800
// The dot product of 8 bf16 pairs, in order.
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
#else
// The segment's two MMAs: inputs g (a) and g + 8 (b) against row g's words (w).
__device__ __forceinline__ void gemv_mma(float* c, uint4 a, uint4 b, uint4 w) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a.x), "r"(b.x), "r"(a.y), "r"(b.y), "r"(w.x), "r"(w.y));
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a.z), "r"(b.z), "r"(a.w), "r"(b.w), "r"(w.z), "r"(w.w));
}
#endif

// Warp `warp`'s slice of T tiles (rows n0[i] .. n0[i] + 7 of w[i], m rows each) against NS
// inputs, input g at xa in lanes (g, t) and input g + 8 at xb (read when TWO): c[i] gets, in lane
// (g, t), input g at rows 2t and 2t + 1 of tile i, then input g + 8 at the same rows. Before
// sm_80, warp 0's c holds the whole rows' sums and every other warp's zeros, and the block
// meets at a barrier inside: every thread of the block must call it.
template <int T, bool TWO, int NS>
__device__ __forceinline__ void gemv_slice(const bf16_t* const* w, const int* n0, int m, int k,
                                           const bf16_t* xa, const bf16_t* xb, float (*c)[4]) {
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, warp = threadIdx.x >> 5;
    int segs = (k + 31) >> 5;
    int s0 = warp * segs / GEMV_WARPS, s1 = (warp + 1) * segs / GEMV_WARPS;
#pragma unroll
    for (int i = 0; i < T; i++) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.0f;
#if __CUDA_ARCH__ >= 800
    const uint4* wr[T];
#pragma unroll
    for (int i = 0; i < T; i++) wr[i] = (const uint4*)(w[i] + (size_t)min(n0[i] + g, m - 1) * k);
    const uint4* av = (const uint4*)xa;
    const uint4* bv = (const uint4*)xb;
    uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    int full = min(s1, k >> 5), j = s0;
    for (; j + GEMV_U <= full; j += GEMV_U) {
        uint4 wv[T][GEMV_U], a[GEMV_U], b[GEMV_U];
#pragma unroll
        for (int u = 0; u < GEMV_U; u++)
#pragma unroll
            for (int i = 0; i < T; i++) wv[i][u] = ld_stream(wr[i] + 4 * (j + u) + t);
#pragma unroll
        for (int u = 0; u < GEMV_U; u++) {
            a[u] = av[4 * (j + u) + t];
            b[u] = TWO ? bv[4 * (j + u) + t] : zero;
        }
#pragma unroll
        for (int u = 0; u < GEMV_U; u++)
#pragma unroll
            for (int i = 0; i < T; i++) gemv_mma(c[i], a[u], b[u], wv[i][u]);
    }
    for (; j < s1; j++) {
        // The last segment may be short: its missing columns count as zeros on both sides.
        bool in = (4 * j + t) * 8 < k;
        uint4 a = in ? av[4 * j + t] : zero;
        uint4 b = in && TWO ? bv[4 * j + t] : zero;
#pragma unroll
        for (int i = 0; i < T; i++) gemv_mma(c[i], a, b, in ? ld_stream(wr[i] + 4 * j + t) : zero);
    }
#else
    // Warp q takes row q of each tile whole, as the kernels before the tensor cores did: lane
    // l dots vectors l, l + 32, l + 64, l + 96, ... of the row with every input into four
    // sums, then the warp's butterfly. The rows' sums go to warp 0 in the MMAs' layout, every
    // other warp's being zeros, so the block's tree leaves them as they are. Dotting the
    // tensor-core path's lanes on the FP32 pipes instead took 1.1-1.4x as long at five sides
    // (scripts/bench_gemv_sides.sh, as sm_75 PTX on an H200).
    (void)s0;
    (void)s1;
    __shared__ float rows[T][NS][GEMV_WARPS];
    const uint4* xs[NS];
#pragma unroll
    for (int s = 0; s < NS; s++)
        xs[s] = (const uint4*)__shfl_sync(0xffffffffu, (unsigned long long)(s < 8 ? xa : xb),
                                          4 * (s & 7));
    int vecs = k >> 3;
#pragma unroll
    for (int i = 0; i < T; i++) {
        const uint4* wr = (const uint4*)(w[i] + (size_t)min(n0[i] + warp, m - 1) * k);
        float a[NS][4];
#pragma unroll
        for (int s = 0; s < NS; s++) a[s][0] = a[s][1] = a[s][2] = a[s][3] = 0.0f;
        int v = lane;
        for (; v + 96 < vecs; v += 128) {
            uint4 w0 = ld_stream(wr + v), w1 = ld_stream(wr + v + 32);
            uint4 w2 = ld_stream(wr + v + 64), w3 = ld_stream(wr + v + 96);
#pragma unroll
            for (int s = 0; s < NS; s++) {
                a[s][0] += dot8_bf16(w0, xs[s][v]);
                a[s][1] += dot8_bf16(w1, xs[s][v + 32]);
                a[s][2] += dot8_bf16(w2, xs[s][v + 64]);
                a[s][3] += dot8_bf16(w3, xs[s][v + 96]);
            }
        }
        for (int q = 0; v < vecs; v += 32, q++) {
            uint4 wv = ld_stream(wr + v);
#pragma unroll
            for (int s = 0; s < NS; s++) {
                float d = dot8_bf16(wv, xs[s][v]);
                if (q == 0) a[s][0] += d;
                else if (q == 1) a[s][1] += d;
                else a[s][2] += d;
            }
        }
#pragma unroll
        for (int s = 0; s < NS; s++) {
            float r = (a[s][0] + a[s][1]) + (a[s][2] + a[s][3]);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) r += __shfl_xor_sync(0xffffffffu, r, o);
            if (lane == 0) rows[i][s][warp] = r;
        }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < T; i++) {
        if (warp != 0) continue;
#pragma unroll
        for (int s = 0; s < NS; s++) {
            if (s == g) c[i][0] = rows[i][s][2 * t], c[i][1] = rows[i][s][2 * t + 1];
            if (s == g + 8) c[i][2] = rows[i][s][2 * t], c[i][3] = rows[i][s][2 * t + 1];
        }
    }
#endif
}

// The block's sums of T tiles: every warp's slice (gemv_slice) added in a fixed tree. True in
// warp 0, whose c then holds them; every thread of the block must call it.
template <int T>
__device__ __forceinline__ bool gemv_block_sum(float (*c)[4]) {
    __shared__ float4 part[T][GEMV_WARPS][32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int i = 0; i < T; i++) part[i][warp][lane] = make_float4(c[i][0], c[i][1], c[i][2], c[i][3]);
    __syncthreads();
    if (warp != 0) return false;
#pragma unroll
    for (int i = 0; i < T; i++) {
        float4 p[GEMV_WARPS];
#pragma unroll
        for (int q = 0; q < GEMV_WARPS; q++) p[q] = part[i][q][lane];
#pragma unroll
        for (int h = GEMV_WARPS / 2; h > 0; h >>= 1)
#pragma unroll
            for (int q = 0; q < h; q++) {
                p[q].x = p[2 * q].x + p[2 * q + 1].x;
                p[q].y = p[2 * q].y + p[2 * q + 1].y;
                p[q].z = p[2 * q].z + p[2 * q + 1].z;
                p[q].w = p[2 * q].w + p[2 * q + 1].w;
            }
        c[i][0] = p[0].x;
        c[i][1] = p[0].y;
        c[i][2] = p[0].z;
        c[i][3] = p[0].w;
    }
    return true;
}

// The whole tile (rows n0 .. n0 + 7 of w) against input x alone: true in lanes 0-3 of warp 0,
// where c[0] and c[1] are rows n0 + 2t and n0 + 2t + 1.
template <int T>
__device__ __forceinline__ bool gemv_tile_one(const bf16_t* const* w, const int* n0, int m, int k,
                                              const bf16_t* x, float (*c)[4]) {
    gemv_slice<T, false, 1>(w, n0, m, k, x, x, c);
    return gemv_block_sum<T>(c) && (threadIdx.x >> 2) == 0;
}

// The rows n0 + 2t and n0 + 2t + 1 a lane's first two sums belong to, where they exist.
__device__ __forceinline__ void store_pair(float* y, int row, int m, float a, float b) {
    if (row < m) y[row] = a;
    if (row + 1 < m) y[row + 1] = b;
}

extern "C" __global__ void gemv_bf16(const bf16_t* __restrict__ x, const bf16_t* __restrict__ w,
                                     float* __restrict__ y, int k, int m) {
    pdl_trigger();
    int n0 = blockIdx.x * 8;
    const bf16_t* ws[1] = {w};
    pdl_wait();
    float c[1][4];
    if (gemv_tile_one<1>(ws, &n0, m, k, x, c))
        store_pair(y, n0 + 2 * (threadIdx.x & 3), m, c[0][0], c[0][1]);
}

// The last layer's down_proj together with the residual add and the final RMSNorm after it
// (as add_rms_norm), whose bf16 output is the LM head's input: the GEMV's last block to finish
// (counted in `counter`) adds the residual and normalises the row, saving a launch.
extern "C" __global__ void gemv_add_norm_bf16(const bf16_t* __restrict__ x,
                                              const bf16_t* __restrict__ w, float* y, int k,
                                              int m, const float* resid, float* resid_out,
                                              const bf16_t* norm_weight, float* out,
                                              bf16_t* out_bf16, float eps,
                                              unsigned int* counter) {
    __shared__ float scratch[32];
    pdl_trigger();
    int n0 = blockIdx.x * 8;
    const bf16_t* ws[1] = {w};
    pdl_wait();
    float c[1][4];
    if (gemv_tile_one<1>(ws, &n0, m, k, x, c))
        store_pair(y, n0 + 2 * (threadIdx.x & 3), m, c[0][0], c[0][1]);
    if (!last_block_done(counter, gridDim.x)) return;
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

// The fused RMSNorm + projection of a decode step (QKV, gate/up): every block normalises the
// residual row itself (k values, a few KB from L2) into shared memory as the bf16 GEMV input,
// so no launch and no last-block wait sits between the residual add and the projection after
// its norm. Same arithmetic as add_rms_norm (its 256-thread sum order); the `first` block
// writes the normalised row in f32 (the norm's tap). Dynamic shared memory: k bf16.
__device__ void rms_norm_to_shared(const float* resid, const bf16_t* weight, int k, float eps,
                                   bf16_t* xs, float* norm_out, float* scratch, bool first) {
    // Loads batched as add_rms_norm's (NORM_BATCH), in the same order.
    float ss = 0.0f;
    for (int base = threadIdx.x; base < k; base += NORM_BATCH * blockDim.x) {
        float v[NORM_BATCH];
#pragma unroll
        for (int u = 0; u < NORM_BATCH; u++) {
            int i = base + u * blockDim.x;
            v[u] = i < k ? resid[i] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < NORM_BATCH; u++) {
            if (base + u * blockDim.x >= k) break;
            ss += v[u] * v[u];
        }
    }
    ss = block_sum(ss, scratch);
    float inv = 1.0f / sqrtf(ss / k + eps);
    for (int base = threadIdx.x; base < k; base += NORM_BATCH * blockDim.x) {
        float v[NORM_BATCH], w[NORM_BATCH];
#pragma unroll
        for (int u = 0; u < NORM_BATCH; u++) {
            int i = base + u * blockDim.x;
            v[u] = i < k ? resid[i] : 0.0f;
            w[u] = i < k ? bf16_to_f32(weight[i]) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < NORM_BATCH; u++) {
            int i = base + u * blockDim.x;
            if (i >= k) break;
            float o = w[u] * (v[u] * inv);
            xs[i] = f32_to_bf16(o);
            if (first) norm_out[i] = o;
        }
    }
    __syncthreads();
}

// y[m] = w[m, k] · rmsnorm(resid) (f32 out).
extern "C" __global__ void gemv_norm_bf16(const float* resid, const bf16_t* norm_weight,
                                          float eps, const bf16_t* __restrict__ w,
                                          float* __restrict__ y, int k, int m,
                                          float* norm_out) {
    __shared__ float scratch[32];
    extern __shared__ __align__(16) bf16_t xs[];
    pdl_trigger();
    int n0 = blockIdx.x * 8;
    const bf16_t* ws[1] = {w};
    pdl_wait();
    rms_norm_to_shared(resid, norm_weight, k, eps, xs, norm_out, scratch, blockIdx.x == 0);
    float c[1][4];
    if (gemv_tile_one<1>(ws, &n0, m, k, xs, c))
        store_pair(y, n0 + 2 * (threadIdx.x & 3), m, c[0][0], c[0][1]);
}

// silu(gate) * up in bf16, the down projection's input.
__device__ __forceinline__ bf16_t swiglu(float g, float u) {
    return f32_to_bf16(g / (1.0f + expf(-g)) * u);
}

// The MLP's RMSNorm, gate/up projection and SwiGLU in one launch: w is gate_proj over up_proj
// ([2 * inter, k]); output j is silu(gate_j) * up_j in bf16. A block takes gate rows j .. j + 7
// and the up rows of the same j as two tiles.
extern "C" __global__ void gemv_norm_swiglu_bf16(const float* resid, const bf16_t* norm_weight,
                                                 float eps, const bf16_t* __restrict__ w,
                                                 bf16_t* __restrict__ out, int k, int inter,
                                                 float* norm_out) {
    __shared__ float scratch[32];
    extern __shared__ __align__(16) bf16_t xs[];
    pdl_trigger();
    int j0 = blockIdx.x * 8;
    const bf16_t* ws[2] = {w, w + (size_t)inter * k};
    int n0[2] = {j0, j0};
    pdl_wait();
    rms_norm_to_shared(resid, norm_weight, k, eps, xs, norm_out, scratch, blockIdx.x == 0);
    float c[2][4];
    if (gemv_tile_one<2>(ws, n0, inter, k, xs, c)) {
        int j = j0 + 2 * (threadIdx.x & 3);
        if (j < inter) out[j] = swiglu(c[0][0], c[1][0]);
        if (j + 1 < inter) out[j + 1] = swiglu(c[0][1], c[1][1]);
    }
}

// A projection and the residual add after it (o_proj, down_proj), row by row: y = w · x,
// resid_out = resid + y. The norm that follows is left to the next projection's kernel.
extern "C" __global__ void gemv_add_bf16(const bf16_t* __restrict__ x,
                                         const bf16_t* __restrict__ w, float* y, int k, int m,
                                         const float* resid, float* resid_out) {
    pdl_trigger();
    int n0 = blockIdx.x * 8;
    const bf16_t* ws[1] = {w};
    pdl_wait();
    float c[1][4];
    if (gemv_tile_one<1>(ws, &n0, m, k, x, c)) {
        int row = n0 + 2 * (threadIdx.x & 3);
        store_pair(y, row, m, c[0][0], c[0][1]);
        if (row < m) resid_out[row] = resid[row] + c[0][0];
        if (row + 1 < m) resid_out[row + 1] = resid[row + 1] + c[0][1];
    }
}

// The same GEMVs for several decode steps at once (one per side, see `Sides`), in one launch:
// the tile's rows are read once for every side, side s being A's row s (MAX_SIDES up to 16).
// A launch for fewer sides pads with side 0's input (`padded_side`); its sums are dropped.
// Interleaving one block of the single kernel per side instead read the weights from DRAM
// once per side: a row was gone from L2 before the next side's block read it
// (scripts/bench_gemv_sides.cu: Qwen3-8B's gate/up with ten sides 591 against 123 µs on an
// H200, when a warp dotted a row with each side on the FP32 pipes). The fused RMSNorm of the
// single kernels runs before, in rms_norm_bf16_sides: each block normalising every side's row
// again would read more than the weights.
#define GEMV_TWO (MAX_SIDES > 8)

// A tile's T sums for every side: lane (g, t) of warp 0 holds sides g and g + 8 (true there).
template <int T>
__device__ __forceinline__ bool gemv_tile_sides(const bf16_t* const* w, const int* n0, int m,
                                                int k, Sides x, int sides, float (*c)[4]) {
    int g = (threadIdx.x & 31) >> 2;
    gemv_slice<T, GEMV_TWO, MAX_SIDES>(w, n0, m, k, padded_side<const bf16_t>(x, g, sides),
                            padded_side<const bf16_t>(x, g + 8, sides), c);
    return gemv_block_sum<T>(c);
}

// Tile sums c (gemv_tile_sides) into each side's y at rows n0 + 2t, n0 + 2t + 1, and, with
// `resid`, resid_out = resid + y there.
__device__ __forceinline__ void store_sides(Sides y, int n0, int m, int sides, const float* c,
                                            bool add, Sides resid, Sides resid_out) {
    int g = (threadIdx.x & 31) >> 2, row = n0 + 2 * (threadIdx.x & 3);
#pragma unroll
    for (int half = 0; half < (GEMV_TWO ? 2 : 1); half++) {
        int s = g + 8 * half;
        if (s >= sides) continue;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            if (row + h >= m) continue;
            float v = c[2 * half + h];
            at_side<float>(y, s)[row + h] = v;
            if (add) at_side<float>(resid_out, s)[row + h] = at_side<const float>(resid, s)[row + h] + v;
        }
    }
}

// RMSNorm of each side's residual row (block s: side s), as the fused GEMVs' prologue does it
// (rms_norm_to_shared, 256 threads): the bf16 row the projection reads, and the f32 tap.
extern "C" __global__ void rms_norm_bf16_sides(Sides resid, const bf16_t* weight, float eps,
                                               Sides out_bf16, Sides norm_out, int k) {
    __shared__ float scratch[32];
    PDL_ENTER();
    int s = blockIdx.x;
    rms_norm_to_shared(at_side<const float>(resid, s), weight, k, eps, at_side<bf16_t>(out_bf16, s),
                       at_side<float>(norm_out, s), scratch, true);
}

extern "C" __global__ void gemv_bf16_sides(Sides x, const bf16_t* __restrict__ w, Sides y, int k,
                                           int m, int sides) {
    pdl_trigger();
    int n0 = blockIdx.x * 8;
    const bf16_t* ws[1] = {w};
    pdl_wait();
    float c[1][4];
    if (gemv_tile_sides<1>(ws, &n0, m, k, x, sides, c))
        store_sides(y, n0, m, sides, c[0], false, y, y);
}

extern "C" __global__ void gemv_add_bf16_sides(Sides x, const bf16_t* __restrict__ w, Sides y,
                                               int k, int m, Sides resid, Sides resid_out,
                                               int sides) {
    pdl_trigger();
    int n0 = blockIdx.x * 8;
    const bf16_t* ws[1] = {w};
    pdl_wait();
    float c[1][4];
    if (gemv_tile_sides<1>(ws, &n0, m, k, x, sides, c))
        store_sides(y, n0, m, sides, c[0], true, resid, resid_out);
}

// gemv_norm_swiglu_bf16's projection and SwiGLU for every side, x normalised before.
extern "C" __global__ void gemv_swiglu_bf16_sides(Sides x, const bf16_t* __restrict__ w,
                                                  Sides out, int k, int inter, int sides) {
    pdl_trigger();
    int j0 = blockIdx.x * 8;
    const bf16_t* ws[2] = {w, w + (size_t)inter * k};
    int n0[2] = {j0, j0};
    pdl_wait();
    float c[2][4];
    if (!gemv_tile_sides<2>(ws, n0, inter, k, x, sides, c)) return;
    int g = (threadIdx.x & 31) >> 2, j = j0 + 2 * (threadIdx.x & 3);
#pragma unroll
    for (int half = 0; half < (GEMV_TWO ? 2 : 1); half++) {
        int s = g + 8 * half;
        if (s >= sides) continue;
#pragma unroll
        for (int h = 0; h < 2; h++)
            if (j + h < inter) at_side<bf16_t>(out, s)[j + h] = swiglu(c[0][2 * half + h], c[1][2 * half + h]);
    }
}

// gemv_add_norm_bf16 for several sides: the last block to finish adds each side's residual and
// normalises its row, in the single kernel's order.
extern "C" __global__ void gemv_add_norm_bf16_sides(Sides x, const bf16_t* __restrict__ w, Sides y,
                                                    int k, int m, Sides resid, Sides resid_out,
                                                    const bf16_t* norm_weight, Sides out,
                                                    Sides out_bf16, float eps,
                                                    unsigned int* counter, int sides) {
    __shared__ float scratch[32];
    pdl_trigger();
    int n0 = blockIdx.x * 8;
    const bf16_t* ws[1] = {w};
    pdl_wait();
    float c[1][4];
    if (gemv_tile_sides<1>(ws, &n0, m, k, x, sides, c))
        store_sides(y, n0, m, sides, c[0], false, y, y);
    if (!last_block_done(counter, gridDim.x)) return;
    for (int s = 0; s < sides; s++) {
        const float* rs = at_side<const float>(resid, s);
        const float* ys = at_side<const float>(y, s);
        float* ro = at_side<float>(resid_out, s);
        float ss = 0.0f;
        for (int i = threadIdx.x; i < m; i += blockDim.x) {
            float v = rs[i] + __ldcg(ys + i);
            ro[i] = v;
            ss += v * v;
        }
        ss = block_sum(ss, scratch);
        float inv = 1.0f / sqrtf(ss / m + eps);
        float* o = at_side<float>(out, s);
        bf16_t* ob = at_side<bf16_t>(out_bf16, s);
        for (int i = threadIdx.x; i < m; i += blockDim.x) {
            float v = bf16_to_f32(norm_weight[i]) * (ro[i] * inv);
            o[i] = v;
            ob[i] = f32_to_bf16(v);
        }
    }
}
