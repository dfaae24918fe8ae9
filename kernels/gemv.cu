// y[m] (f32) = w[m, k] (bf16) · x[k] (bf16), f32 accumulation: the GEMMs of a decode step, where
// one token makes every GEMM a matrix-vector product bound by reading the weights. One warp
// per output row, 16-byte loads (8 bf16); needs k % 8 == 0 and
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

// A weight vector, streamed past L1: each is read once, and in L1 it would only evict what is
// read again there (the `_sides` kernels' inputs: with ten sides, keeping them there made the
// LM head 2.3x faster, see scripts/bench_gemv_sides.cu).
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// a[j & 3] += d with j known only at run time, by branches: indexing a register array with a
// run-time value moves it to local memory.
__device__ __forceinline__ void add_at(float* a, int j, float d) {
    if ((j & 3) == 0) a[0] += d;
    else if ((j & 3) == 1) a[1] += d;
    else if ((j & 3) == 2) a[2] += d;
    else a[3] += d;
}

// A warp's row of w, its first PRE * 32 16-byte vectors held in registers: loaded before
// pdl_wait() (weights are never written), so the loads overlap the previous kernel's tail. The
// rest of the row is asked into L2 at the same time. dot() then reads x and sums, lane l taking
// vectors l, l + 32, ... into four accumulators.
template <int PRE>
struct Row {
    uint4 w[PRE];
    const uint4* wr;
    int vecs;

    __device__ __forceinline__ void load(const bf16_t* row, int k) {
        wr = (const uint4*)row;
        vecs = k >> 3;
        int lane = threadIdx.x & 31;
#pragma unroll
        for (int j = 0; j < PRE; j++)
            if (lane + 32 * j < vecs) w[j] = ld_stream(wr + lane + 32 * j);
        for (int i = 32 * PRE + lane * 8; i < vecs; i += 256)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(wr + i));
    }

    // The dot product with x, summed over the warp (every lane gets it).
    __device__ __forceinline__ float dot(const bf16_t* __restrict__ x) const {
        const uint4* xv = (const uint4*)x;
        int lane = threadIdx.x & 31;
        float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int j = 0; j < PRE; j++)
            if (lane + 32 * j < vecs) a[j & 3] += dot8_bf16(w[j], xv[lane + 32 * j]);
        int i = lane + 32 * PRE;
        for (; i + 96 < vecs; i += 128) {
            uint4 w0 = ld_stream(wr + i), w1 = ld_stream(wr + i + 32);
            uint4 w2 = ld_stream(wr + i + 64), w3 = ld_stream(wr + i + 96);
            a[0] += dot8_bf16(w0, xv[i]);
            a[1] += dot8_bf16(w1, xv[i + 32]);
            a[2] += dot8_bf16(w2, xv[i + 64]);
            a[3] += dot8_bf16(w3, xv[i + 96]);
        }
        for (int j = 0; i < vecs; i += 32, j++) add_at(a, j, dot8_bf16(ld_stream(wr + i), xv[i]));
        return warp_sum((a[0] + a[1]) + (a[2] + a[3]));
    }
};

// A row of the `_sides` kernels, whose every vector is dotted with several inputs:
// dot_sides(xs, out) gives out[s] for xs[s], each summed in Row::dot's order (so with the single
// kernel's bits), the row read once and the inputs' loads and sums interleaved. The weights
// stream from the first vector in the loop's groups of four, with no preload held in registers
// and no L2 prefetch: at Qwen3-8B's shapes and five sides 12-22% faster than Row<4>'s preload
// (scripts/bench_gemv_sides.cu, "streamed" against "row_preloaded"), and the warm default
// compare at 8B 5.06-5.15 s against 5.34-5.42 s.
struct Streamed {
    const uint4* wr;
    int vecs;

    __device__ __forceinline__ void load(const bf16_t* row, int k) {
        wr = (const uint4*)row;
        vecs = k >> 3;
    }

    template <int S>
    __device__ __forceinline__ void dot_sides(const bf16_t* const* xs, float* out) const {
        const uint4* xv[S];
#pragma unroll
        for (int s = 0; s < S; s++) xv[s] = (const uint4*)xs[s];
        float a[S][4];
#pragma unroll
        for (int s = 0; s < S; s++) a[s][0] = a[s][1] = a[s][2] = a[s][3] = 0.0f;
        int i = threadIdx.x & 31;
        for (; i + 96 < vecs; i += 128) {
            uint4 w0 = ld_stream(wr + i), w1 = ld_stream(wr + i + 32);
            uint4 w2 = ld_stream(wr + i + 64), w3 = ld_stream(wr + i + 96);
#pragma unroll
            for (int s = 0; s < S; s++) {
                a[s][0] += dot8_bf16(w0, xv[s][i]);
                a[s][1] += dot8_bf16(w1, xv[s][i + 32]);
                a[s][2] += dot8_bf16(w2, xv[s][i + 64]);
                a[s][3] += dot8_bf16(w3, xv[s][i + 96]);
            }
        }
        for (int j = 0; i < vecs; i += 32, j++) {
            uint4 wv = ld_stream(wr + i);
#pragma unroll
            for (int s = 0; s < S; s++) add_at(a[s], j, dot8_bf16(wv, xv[s][i]));
        }
#pragma unroll
        for (int s = 0; s < S; s++) out[s] = (a[s][0] + a[s][1]) + (a[s][2] + a[s][3]);
        for (int o = 16; o > 0; o >>= 1)
#pragma unroll
            for (int s = 0; s < S; s++) out[s] += __shfl_xor_sync(0xffffffffu, out[s], o);
    }
};

extern "C" __global__ void gemv_bf16(const bf16_t* __restrict__ x, const bf16_t* __restrict__ w,
                                     float* __restrict__ y, int k, int m) {
    pdl_trigger();
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    Row<4> r;
    if (row < m) r.load(w + (size_t)row * k, k);
    pdl_wait();
    if (row >= m) return;
    float acc = r.dot(x);
    if ((threadIdx.x & 31) == 0) y[row] = acc;
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
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    Row<8> r;
    if (row < m) r.load(w + (size_t)row * k, k);
    pdl_wait();
    if (row < m) {
        float acc = r.dot(x);
        if ((threadIdx.x & 31) == 0) y[row] = acc;
    }
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
    float ss = 0.0f;
    for (int i = threadIdx.x; i < k; i += blockDim.x) {
        float v = resid[i];
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    float inv = 1.0f / sqrtf(ss / k + eps);
    for (int i = threadIdx.x; i < k; i += blockDim.x) {
        float o = bf16_to_f32(weight[i]) * (resid[i] * inv);
        xs[i] = f32_to_bf16(o);
        if (first) norm_out[i] = o;
    }
    __syncthreads();
}

// y[m] = w[m, k] · rmsnorm(resid) (f32 out). Blocks of 256 threads (8 rows).
extern "C" __global__ void gemv_norm_bf16(const float* resid, const bf16_t* norm_weight,
                                          float eps, const bf16_t* __restrict__ w,
                                          float* __restrict__ y, int k, int m,
                                          float* norm_out) {
    __shared__ float scratch[32];
    extern __shared__ __align__(16) bf16_t xs[];
    pdl_trigger();
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    Row<4> r;
    if (row < m) r.load(w + (size_t)row * k, k);
    pdl_wait();
    rms_norm_to_shared(resid, norm_weight, k, eps, xs, norm_out, scratch, blockIdx.x == 0);
    if (row >= m) return;
    float acc = r.dot(xs);
    if ((threadIdx.x & 31) == 0) y[row] = acc;
}

// The MLP's RMSNorm, gate/up projection and SwiGLU in one launch: w is gate_proj over up_proj
// ([2 * inter, k]); output j is silu(gate_j) * up_j in bf16 (the down projection's input).
extern "C" __global__ void gemv_norm_swiglu_bf16(const float* resid, const bf16_t* norm_weight,
                                                 float eps, const bf16_t* __restrict__ w,
                                                 bf16_t* __restrict__ out, int k, int inter,
                                                 float* norm_out) {
    __shared__ float scratch[32];
    extern __shared__ __align__(16) bf16_t xs[];
    pdl_trigger();
    int j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    Row<4> gate, up;
    if (j < inter) {
        gate.load(w + (size_t)j * k, k);
        up.load(w + (size_t)(inter + j) * k, k);
    }
    pdl_wait();
    rms_norm_to_shared(resid, norm_weight, k, eps, xs, norm_out, scratch, blockIdx.x == 0);
    if (j >= inter) return;
    float g = gate.dot(xs);
    float u = up.dot(xs);
    if ((threadIdx.x & 31) == 0) out[j] = f32_to_bf16(g / (1.0f + expf(-g)) * u);
}

// A projection and the residual add after it (o_proj, down_proj), row by row: y = w · x,
// resid_out = resid + y. The norm that follows is left to the next projection's kernel.
extern "C" __global__ void gemv_add_bf16(const bf16_t* __restrict__ x,
                                         const bf16_t* __restrict__ w, float* y, int k, int m,
                                         const float* resid, float* resid_out) {
    pdl_trigger();
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    Row<8> r;
    if (row < m) r.load(w + (size_t)row * k, k);
    pdl_wait();
    if (row >= m) return;
    float acc = r.dot(x);
    if ((threadIdx.x & 31) == 0) {
        y[row] = acc;
        resid_out[row] = resid[row] + acc;
    }
}

// The same GEMVs for several decode steps at once (one per side, see `Sides`), in one launch:
// a warp reads its weight row once and dots it with every side's input (Streamed::dot_sides, each
// side in `dot`'s order, so with the single kernel's bits). The inputs stay in L1, the weights
// stream past it. Interleaving one block of the single kernel per side instead read the
// weights from DRAM once per side: a row was gone from L2 before the next side's block read it
// (scripts/bench_gemv_sides.cu: Qwen3-8B's gate/up with ten sides 591 against 123 µs on an
// H200). The fused RMSNorm of the single kernels runs before, in rms_norm_bf16_sides: each
// block normalising every side's row again would read more than the weights.
#define SIDES_PICK(T, arr, base, sides)                                                    \
    const T* arr[S];                                                                       \
    _Pragma("unroll") for (int s_ = 0; s_ < S; s_++) arr[s_] = padded_side<const T>(base, s_, sides)

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
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    Streamed r;
    if (row < m) r.load(w + (size_t)row * k, k);
    pdl_wait();
    if (row >= m) return;
    WITH_SIDES(sides, {
        SIDES_PICK(bf16_t, xs, x, sides);
        float acc[S];
        r.dot_sides<S>(xs, acc);
        if ((threadIdx.x & 31) == 0)
            _Pragma("unroll")
            for (int s = 0; s < S; s++)
                if (s < sides) at_side<float>(y, s)[row] = acc[s];
    });
}

extern "C" __global__ void gemv_add_bf16_sides(Sides x, const bf16_t* __restrict__ w, Sides y,
                                               int k, int m, Sides resid, Sides resid_out,
                                               int sides) {
    pdl_trigger();
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    Streamed r;
    if (row < m) r.load(w + (size_t)row * k, k);
    pdl_wait();
    if (row >= m) return;
    WITH_SIDES(sides, {
        SIDES_PICK(bf16_t, xs, x, sides);
        float acc[S];
        r.dot_sides<S>(xs, acc);
        if ((threadIdx.x & 31) == 0)
            _Pragma("unroll")
            for (int s = 0; s < S; s++)
                if (s < sides) {
                    at_side<float>(y, s)[row] = acc[s];
                    at_side<float>(resid_out, s)[row] = at_side<const float>(resid, s)[row] + acc[s];
                }
    });
}

// gemv_norm_swiglu_bf16's projection and SwiGLU for every side, x normalised before.
extern "C" __global__ void gemv_swiglu_bf16_sides(Sides x, const bf16_t* __restrict__ w,
                                                  Sides out, int k, int inter, int sides) {
    pdl_trigger();
    int j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    Streamed gate, up;
    if (j < inter) {
        gate.load(w + (size_t)j * k, k);
        up.load(w + (size_t)(inter + j) * k, k);
    }
    pdl_wait();
    if (j >= inter) return;
    WITH_SIDES(sides, {
        SIDES_PICK(bf16_t, xs, x, sides);
        float g[S], u[S];
        gate.dot_sides<S>(xs, g);
        up.dot_sides<S>(xs, u);
        if ((threadIdx.x & 31) == 0)
            _Pragma("unroll")
            for (int s = 0; s < S; s++)
                if (s < sides) at_side<bf16_t>(out, s)[j] = f32_to_bf16(g[s] / (1.0f + expf(-g[s])) * u[s]);
    });
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
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    Streamed r;
    if (row < m) r.load(w + (size_t)row * k, k);
    pdl_wait();
    if (row < m) {
        WITH_SIDES(sides, {
            SIDES_PICK(bf16_t, xs, x, sides);
            float acc[S];
            r.dot_sides<S>(xs, acc);
            if ((threadIdx.x & 31) == 0)
                _Pragma("unroll")
                for (int s = 0; s < S; s++)
                    if (s < sides) at_side<float>(y, s)[row] = acc[s];
        });
    }
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
