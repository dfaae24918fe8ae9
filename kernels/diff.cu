// Row-wise diff summaries, so only a few numbers per row leave the GPU. Each block takes one
// row job of `jobs`, four words: the path row's address, the reference row's address (0: no
// reference, row skipped), the widths and the leads (a's in the low 32 bits, b's in the high
// 32), so one launch diffs every tap of a step. A row's values sit at columns lead..lead +
// width and read as zero elsewhere (attention rows over fewer keys, or over a chunk's keys). Blocks of 256 threads; `out` is [rows, 12]:
//   0 max|a-b|   1 its index   2 max|b|   3 sum (a-b)^2   4 sum b^2   5 sum a*b   6 sum a^2
//   7 first index with a NaN/Inf in either row, -1 if none (-2: row skipped)
//   8 count of bitwise-different elements   9 a and 10 b at the non-finite index, else at 1
// One warp's share of `diff_rows`' reduction: the five sums by warp_sum's butterfly (so
// block_sum's order), the largest |b|, and the largest difference at its smallest index.
__device__ __forceinline__ void summaries_over_warp(float v[5], float& mref, float& bv, int& bi) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
        for (int k = 0; k < 5; k++) v[k] += __shfl_xor_sync(0xffffffffu, v[k], o);
        mref = fmaxf(mref, __shfl_xor_sync(0xffffffffu, mref, o));
        float w = __shfl_xor_sync(0xffffffffu, bv, o);
        int j = __shfl_xor_sync(0xffffffffu, bi, o);
        if (w > bv || (w == bv && j < bi)) bv = w, bi = j;
    }
}

#ifndef DIFF_BATCH
#define DIFF_BATCH 16
#endif
extern "C" __global__ void diff_rows(const unsigned long long* jobs, float* out) {
    PDL_ENTER();
    // Per warp: the five sums, the largest |b|, the largest difference and its index.
    __shared__ float part[7][32];
    __shared__ int part_i[32];
    __shared__ int first_bad;
    float* o = out + (size_t)blockIdx.x * 12;
    const unsigned long long* job = jobs + (size_t)blockIdx.x * 4;
    if (job[1] == 0) {
        if (threadIdx.x < 12) o[threadIdx.x] = threadIdx.x == 7 ? -2.0f : 0.0f;
        return;
    }
    const float* ar = (const float*)job[0];
    const float* brow = (const float*)job[1];
    int a_width = (int)(job[2] & 0xffffffffull), b_width = (int)(job[2] >> 32);
    int a_lead = (int)(job[3] & 0xffffffffull), b_lead = (int)(job[3] >> 32);
    int a_end = a_lead + a_width, b_end = b_lead + b_width;
    int w = a_end > b_end ? a_end : b_end;
    if (threadIdx.x == 0) first_bad = 0x7fffffff;
    __syncthreads();
    float bv = -1.0f, mref = 0.0f, d2 = 0.0f, b2 = 0.0f, ab = 0.0f, a2 = 0.0f, bits = 0.0f;
    int bi = 0;
    // A thread's elements i, i + 256, ... in that order, DIFF_BATCH of them loaded before the
    // first is summed: a row is a few round trips to memory, not one per four elements (the
    // loop unrolled by 4 before left the diffs latency-bound, at a tenth of the bandwidth).
    for (int base = threadIdx.x; base < w; base += DIFF_BATCH * blockDim.x) {
        float xs[DIFF_BATCH], ys[DIFF_BATCH];
#pragma unroll
        for (int u = 0; u < DIFF_BATCH; u++) {
            int i = base + u * blockDim.x;
            xs[u] = i < w && i >= a_lead && i < a_end ? ar[i - a_lead] : 0.0f;
            ys[u] = i < w && i >= b_lead && i < b_end ? brow[i - b_lead] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < DIFF_BATCH; u++) {
            int i = base + u * blockDim.x;
            float x = xs[u], y = ys[u];
            if (i >= w) break;
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
    }
    // All seven reductions in one pass, two barriers instead of about twenty: each sum takes
    // block_sum's order (the warp's butterfly, then the warps' partials by another), so the
    // same bits; the maxima and the first largest difference come out alike in any order.
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    float v[5] = {d2, b2, ab, a2, bits};
    summaries_over_warp(v, mref, bv, bi);
    if (lane == 0) {
#pragma unroll
        for (int k = 0; k < 5; k++) part[k][warp] = v[k];
        part[5][warp] = mref;
        part[6][warp] = bv;
        part_i[warp] = bi;
    }
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int k = 0; k < 5; k++) v[k] = lane < warps ? part[k][lane] : 0.0f;
    mref = lane < warps ? part[5][lane] : NEG_INF;
    bv = lane < warps ? part[6][lane] : -1.0f;
    bi = lane < warps ? part_i[lane] : 0x7fffffff;
    summaries_over_warp(v, mref, bv, bi);
    d2 = v[0], b2 = v[1], ab = v[2], a2 = v[3], bits = v[4];
    if (threadIdx.x == 0) {
        int idx = first_bad != 0x7fffffff ? first_bad : bi;
        o[0] = fmaxf(bv, 0.0f);
        o[1] = (float)bi;
        o[2] = mref;
        o[3] = d2;
        o[4] = b2;
        o[5] = ab;
        o[6] = a2;
        o[7] = first_bad == 0x7fffffff ? -1.0f : (float)first_bad;
        o[8] = bits;
        o[9] = idx >= a_lead && idx < a_end ? ar[idx - a_lead] : 0.0f;
        o[10] = idx >= b_lead && idx < b_end ? brow[idx - b_lead] : 0.0f;
        o[11] = 0.0f;
    }
}

// Copies `rows` rows of `width` values from a strided source into a contiguous buffer (keeps
// a reference tap on the device). Grid: rows.
extern "C" __global__ void copy_rows(const float* src, int stride, int width, float* dst) {
    PDL_ENTER();
    size_t r = blockIdx.x;
    const float* from = src + r * stride;
    float* to = dst + r * width;
    // 16-byte moves where both rows allow them (a tap's rows usually do): four times fewer
    // loads in flight for the same bytes.
    if (((width | stride) & 3) == 0 && (((size_t)src | (size_t)dst) & 15) == 0) {
        for (int i = threadIdx.x; i < width / 4; i += blockDim.x)
            ((float4*)to)[i] = ((const float4*)from)[i];
        return;
    }
    for (int i = threadIdx.x; i < width; i += blockDim.x) to[i] = from[i];
}

// Folds the `chunks` consecutive summaries of each of `rows` rows (a head row's column chunks,
// as attention_diff_mma leaves them, indices counted from the row's column 0) into one, as the
// host's `combine_rows` folds sub-rows: the first largest difference and its column, the first
// non-finite column, the value pair at the first of those the row reports (chunk 0's where
// nothing differs), the largest reference value, and the sums and bit counts added in chunk
// order. A skipped row (word 7 = -2 in chunk 0) stays skipped. The host then reads one summary
// per head row, however finely the kernel split the columns. One thread per row.
extern "C" __global__ void combine_diff_chunks(const float* in, float* out, int rows, int chunks) {
    PDL_ENTER();
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* c = in + (size_t)r * chunks * 12;
    float* o = out + (size_t)r * 12;
    if (c[7] == -2.0f) {
        for (int i = 0; i < 12; i++) o[i] = c[i];
        return;
    }
    float max_abs = 0.0f, at = 0.0f, max_ref = 0.0f, bad = -1.0f, value = 0.0f, reference = 0.0f;
    float d2 = 0.0f, b2 = 0.0f, ab = 0.0f, a2 = 0.0f, bits = 0.0f;
    for (int k = 0; k < chunks; k++, c += 12) {
        if (c[0] > max_abs) {
            max_abs = c[0];
            at = c[1];
            if (bad < 0.0f) value = c[9], reference = c[10];
        }
        if (bad < 0.0f && c[7] >= 0.0f) {
            bad = c[7];
            value = c[9], reference = c[10];
        }
        max_ref = fmaxf(max_ref, c[2]);
        d2 += c[3];
        b2 += c[4];
        ab += c[5];
        a2 += c[6];
        bits += c[8];
    }
    c = in + (size_t)r * chunks * 12;
    if (max_abs == 0.0f && bad < 0.0f) value = c[9], reference = c[10], at = c[1];
    o[0] = max_abs;
    o[1] = at;
    o[2] = max_ref;
    o[3] = d2;
    o[4] = b2;
    o[5] = ab;
    o[6] = a2;
    o[7] = bad;
    o[8] = bits;
    o[9] = value;
    o[10] = reference;
    o[11] = 0.0f;
}
