// Row-wise diff summaries, so only a few numbers per row leave the GPU. Row r of the path is
// `a + r * a_stride` (a_width values); its reference row is `b + b_rows[r] * b_stride`
// (b_width values; b_rows[r] < 0: no reference, skipped), or row `b_row0 + r` when b_rows is
// null. The shorter row reads as zero-padded
// (attention rows over fewer keys). One block of 256 threads per row; `out` is [rows, 12]:
//   0 max|a-b|   1 its index   2 max|b|   3 sum (a-b)^2   4 sum b^2   5 sum a*b   6 sum a^2
//   7 first index with a NaN/Inf in either row, -1 if none (-2: row skipped)
//   8 count of bitwise-different elements   9 a and 10 b at the non-finite index, else at 1
extern "C" __global__ void diff_rows(const float* a, int a_stride, int a_width, const float* b,
                                     int b_stride, int b_width, const int* b_rows, int b_row0,
                                     float* out) {
    __shared__ float scratch[32];
    __shared__ float best_v[256];
    __shared__ int best_i[256];
    __shared__ int first_bad;
    float* o = out + (size_t)blockIdx.x * 12;
    int br = b_rows ? b_rows[blockIdx.x] : b_row0 + (int)blockIdx.x;
    if (br < 0) {
        if (threadIdx.x < 12) o[threadIdx.x] = threadIdx.x == 7 ? -2.0f : 0.0f;
        return;
    }
    const float* ar = a + (size_t)blockIdx.x * a_stride;
    const float* brow = b + (size_t)br * b_stride;
    int w = a_width > b_width ? a_width : b_width;
    if (threadIdx.x == 0) first_bad = 0x7fffffff;
    __syncthreads();
    float bv = -1.0f, mref = 0.0f, d2 = 0.0f, b2 = 0.0f, ab = 0.0f, a2 = 0.0f, bits = 0.0f;
    int bi = 0;
    for (int i = threadIdx.x; i < w; i += blockDim.x) {
        float x = i < a_width ? ar[i] : 0.0f, y = i < b_width ? brow[i] : 0.0f;
        if (__float_as_uint(x) != __float_as_uint(y)) bits += 1.0f;
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
    bits = block_sum(bits, scratch);
    if (threadIdx.x == 0) {
        int idx = first_bad != 0x7fffffff ? first_bad : best_i[0];
        o[0] = fmaxf(best_v[0], 0.0f);
        o[1] = (float)best_i[0];
        o[2] = mref;
        o[3] = d2;
        o[4] = b2;
        o[5] = ab;
        o[6] = a2;
        o[7] = first_bad == 0x7fffffff ? -1.0f : (float)first_bad;
        o[8] = bits;
        o[9] = idx < a_width ? ar[idx] : 0.0f;
        o[10] = idx < b_width ? brow[idx] : 0.0f;
        o[11] = 0.0f;
    }
}

// Copies `rows` rows of `width` values from a strided source into a contiguous buffer (keeps
// a reference tap on the device). Grid: rows.
extern "C" __global__ void copy_rows(const float* src, int stride, int width, float* dst) {
    size_t r = blockIdx.x;
    for (int i = threadIdx.x; i < width; i += blockDim.x) dst[r * width + i] = src[r * stride + i];
}
