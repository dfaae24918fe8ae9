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
            if (lane + 32 * j < vecs) w[j] = wr[lane + 32 * j];
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
            uint4 w0 = wr[i], w1 = wr[i + 32], w2 = wr[i + 64], w3 = wr[i + 96];
            a[0] += dot8_bf16(w0, xv[i]);
            a[1] += dot8_bf16(w1, xv[i + 32]);
            a[2] += dot8_bf16(w2, xv[i + 64]);
            a[3] += dot8_bf16(w3, xv[i + 96]);
        }
        for (int j = 0; i < vecs; i += 32, j++) a[j & 3] += dot8_bf16(wr[i], xv[i]);
        return warp_sum((a[0] + a[1]) + (a[2] + a[3]));
    }

    // `dot` with S inputs at once, out[s] for xs[s], each summed in `dot`'s order (so with its
    // bits): the row's vectors are read once, and the inputs' loads and sums interleave
    // instead of waiting one dot after another. `dot` stays a copy of this loop for one input:
    // written as dot_sides<1> it gave the same bits but a 1-2% slower generate (78-79 against
    // 77 ms, three rounds alternating).
    template <int S>
    __device__ __forceinline__ void dot_sides(const bf16_t* const* xs, float* out) const {
        const uint4* xv[S];
#pragma unroll
        for (int s = 0; s < S; s++) xv[s] = (const uint4*)xs[s];
        int lane = threadIdx.x & 31;
        float a[S][4];
#pragma unroll
        for (int s = 0; s < S; s++) a[s][0] = a[s][1] = a[s][2] = a[s][3] = 0.0f;
#pragma unroll
        for (int j = 0; j < PRE; j++)
            if (lane + 32 * j < vecs)
#pragma unroll
                for (int s = 0; s < S; s++) a[s][j & 3] += dot8_bf16(w[j], xv[s][lane + 32 * j]);
        int i = lane + 32 * PRE;
        for (; i + 96 < vecs; i += 128) {
            uint4 w0 = wr[i], w1 = wr[i + 32], w2 = wr[i + 64], w3 = wr[i + 96];
#pragma unroll
            for (int s = 0; s < S; s++) {
                a[s][0] += dot8_bf16(w0, xv[s][i]);
                a[s][1] += dot8_bf16(w1, xv[s][i + 32]);
                a[s][2] += dot8_bf16(w2, xv[s][i + 64]);
                a[s][3] += dot8_bf16(w3, xv[s][i + 96]);
            }
        }
        for (int j = 0; i < vecs; i += 32, j++) {
            uint4 wv = wr[i];
#pragma unroll
            for (int s = 0; s < S; s++) a[s][j & 3] += dot8_bf16(wv, xv[s][i]);
        }
#pragma unroll
        for (int s = 0; s < S; s++) out[s] = (a[s][0] + a[s][1]) + (a[s][2] + a[s][3]);
        // warp_sum's butterfly, the sides' shuffles interleaved.
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
// block b runs block b / sides of the single kernel for side b % sides, so the sides' blocks
// of a weight row start together and the row comes from DRAM once (the other sides find it
// in L2), while each side has the single kernel's warps and arithmetic (and its bits).
//
// The LM head instead dots each row it holds with every side's input in turn (one warp per
// row, as the single kernel, and its `dot` for each side): its 150k rows are enough warps to
// fill the GPU, and interleaved blocks made it 2.4x the single kernel's time (L2 traffic and
// three times the blocks), where this reads the weights once at the single kernel's pace.
extern "C" __global__ void gemv_bf16_sides(Sides x, const bf16_t* __restrict__ w, Sides y, int k,
                                           int m, int sides) {
    pdl_trigger();
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    Row<4> r;
    if (row < m) r.load(w + (size_t)row * k, k);
    pdl_wait();
    if (row >= m) return;
    WITH_SIDES(sides, {
        const bf16_t* xs[S];
        float acc[S];
        _Pragma("unroll")
        for (int s = 0; s < S; s++) xs[s] = padded_side<const bf16_t>(x, s, sides);
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
    int s = blockIdx.x % sides;
    int row = blockIdx.x / sides * (blockDim.x >> 5) + (threadIdx.x >> 5);
    Row<8> r;
    if (row < m) r.load(w + (size_t)row * k, k);
    pdl_wait();
    if (row >= m) return;
    float acc = r.dot(at_side<const bf16_t>(x, s));
    if ((threadIdx.x & 31) == 0) {
        at_side<float>(y, s)[row] = acc;
        at_side<float>(resid_out, s)[row] = at_side<const float>(resid, s)[row] + acc;
    }
}

extern "C" __global__ void gemv_norm_bf16_sides(Sides resid, const bf16_t* norm_weight, float eps,
                                                const bf16_t* __restrict__ w, Sides y, int k,
                                                int m, Sides norm_out, int sides) {
    __shared__ float scratch[32];
    extern __shared__ __align__(16) bf16_t xs[];
    pdl_trigger();
    int s = blockIdx.x % sides, block = blockIdx.x / sides;
    int row = block * (blockDim.x >> 5) + (threadIdx.x >> 5);
    Row<4> r;
    if (row < m) r.load(w + (size_t)row * k, k);
    pdl_wait();
    rms_norm_to_shared(at_side<const float>(resid, s), norm_weight, k, eps, xs,
                       at_side<float>(norm_out, s), scratch, block == 0);
    if (row >= m) return;
    float acc = r.dot(xs);
    if ((threadIdx.x & 31) == 0) at_side<float>(y, s)[row] = acc;
}

extern "C" __global__ void gemv_norm_swiglu_bf16_sides(Sides resid, const bf16_t* norm_weight,
                                                       float eps, const bf16_t* __restrict__ w,
                                                       Sides out, int k, int inter,
                                                       Sides norm_out, int sides) {
    __shared__ float scratch[32];
    extern __shared__ __align__(16) bf16_t xs[];
    pdl_trigger();
    int s = blockIdx.x % sides, block = blockIdx.x / sides;
    int j = block * (blockDim.x >> 5) + (threadIdx.x >> 5);
    Row<4> gate, up;
    if (j < inter) {
        gate.load(w + (size_t)j * k, k);
        up.load(w + (size_t)(inter + j) * k, k);
    }
    pdl_wait();
    rms_norm_to_shared(at_side<const float>(resid, s), norm_weight, k, eps, xs,
                       at_side<float>(norm_out, s), scratch, block == 0);
    if (j >= inter) return;
    float g = gate.dot(xs);
    float u = up.dot(xs);
    if ((threadIdx.x & 31) == 0) at_side<bf16_t>(out, s)[j] = f32_to_bf16(g / (1.0f + expf(-g)) * u);
}

// gemv_add_norm_bf16 for several sides: each side's blocks are counted at its own counter,
// and the last of them normalises that side's row.
extern "C" __global__ void gemv_add_norm_bf16_sides(Sides x, const bf16_t* __restrict__ w, Sides y,
                                                    int k, int m, Sides resid, Sides resid_out,
                                                    const bf16_t* norm_weight, Sides out,
                                                    Sides out_bf16, float eps, Sides counter,
                                                    int sides) {
    __shared__ float scratch[32];
    pdl_trigger();
    int s = blockIdx.x % sides;
    int row = blockIdx.x / sides * (blockDim.x >> 5) + (threadIdx.x >> 5);
    Row<8> r;
    if (row < m) r.load(w + (size_t)row * k, k);
    pdl_wait();
    float* ys = at_side<float>(y, s);
    if (row < m) {
        float acc = r.dot(at_side<const bf16_t>(x, s));
        if ((threadIdx.x & 31) == 0) ys[row] = acc;
    }
    if (!last_block_done(at_side<unsigned int>(counter, s), gridDim.x / sides)) return;
    const float* rs = at_side<const float>(resid, s);
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
