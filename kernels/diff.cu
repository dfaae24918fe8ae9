// Row-wise diff summaries, so only a few numbers per row leave the GPU: for each row of width
// `w`, max |a - b| and its index, max |b|, sum (a-b)^2, sum b^2, sum a*b, sum a^2, and the
// first index holding a NaN or Inf in either (or -1). One block per row; `out` is [rows, 8]:
// max_abs, index, max_ref, sum_d2, sum_b2, sum_ab, sum_a2, non_finite.
extern "C" __global__ void diff_rows(const float* a, const float* b, int w, float* out) {
    __shared__ float scratch[32];
    __shared__ float best_v[256];
    __shared__ int best_i[256];
    __shared__ int first_bad;
    size_t row = (size_t)blockIdx.x * w;
    if (threadIdx.x == 0) first_bad = 0x7fffffff;
    __syncthreads();
    float bv = -1.0f, mref = 0.0f, d2 = 0.0f, b2 = 0.0f, ab = 0.0f, a2 = 0.0f;
    int bi = 0;
    for (int i = threadIdx.x; i < w; i += blockDim.x) {
        float x = a[row + i], y = b[row + i];
        if (!finite(x) || !finite(y)) {
            atomicMin(&first_bad, i);
            continue;
        }
        float d = fabsf(x - y);
        if (d > bv) { bv = d; bi = i; }
        mref = fmaxf(mref, fabsf(y));
        d2 += (x - y) * (x - y);
        b2 += y * y;
        ab += x * y;
        a2 += x * x;
    }
    best_v[threadIdx.x] = bv;
    best_i[threadIdx.x] = bi;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            float v = best_v[threadIdx.x + s];
            int i = best_i[threadIdx.x + s];
            if (v > best_v[threadIdx.x] || (v == best_v[threadIdx.x] && i < best_i[threadIdx.x])) {
                best_v[threadIdx.x] = v;
                best_i[threadIdx.x] = i;
            }
        }
        __syncthreads();
    }
    mref = block_max(mref, scratch);
    d2 = block_sum(d2, scratch);
    b2 = block_sum(b2, scratch);
    ab = block_sum(ab, scratch);
    a2 = block_sum(a2, scratch);
    if (threadIdx.x == 0) {
        float* o = out + (size_t)blockIdx.x * 8;
        o[0] = fmaxf(best_v[0], 0.0f);
        o[1] = (float)best_i[0];
        o[2] = mref;
        o[3] = d2;
        o[4] = b2;
        o[5] = ab;
        o[6] = a2;
        o[7] = first_bad == 0x7fffffff ? -1.0f : (float)first_bad;
    }
}
