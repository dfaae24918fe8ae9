// Prefill GEMMs on tensor cores (sm_80 and later): y (n x m, f32, row-major) = x (n x k, bf16,
// row-major) times w^T, w being a linear layer's weight (m x k, bf16, row-major), with
// `mma.m16n8k16` (bf16 operands, f32 accumulation).
//
// Why not cuBLAS: opening it and meeting each GEMM shape once cost a whole-command run about
// 0.2 s before the first token (its first GEMM, then a few ms per shape), longer than the rest
// of the start-up it ran beside; these kernels load with the others from the cached cubin.
// And every output element sums its products in one order, 16 at a time along k from 0
// upwards, whatever n, m and tile shape: a row comes out with the same bits whether it is
// computed alone, in a chunk or in a whole prompt (cuBLAS picks kernels, and with them
// summation orders, by shape).
//
// Block tile BM x BN over GEMM_BK = 64 columns of k at a time, GEMM_STAGES tiles in flight
// (cp.async), warps WM x WN each computing (BM / WM) x (BN / WN) with ldmatrix fragments.
// Shared rows are 128 bytes (eight 16-byte chunks); chunk c of row r sits at c ^ (r % 8), so
// that the eight rows an ldmatrix phase reads fall in distinct bank groups (32 columns a stage
// left the kernel at half cuBLAS's rate at 16k rows: a barrier every two MMA steps). VEC: rows of x and w are 16-byte aligned (k % 8 == 0, aligned
// bases) and tiles arrive by cp.async; otherwise element by element, with zeros past k.
// Dynamic shared memory: GEMM_STAGES * (BM + BN) * GEMM_BK * 2 bytes.

#define GEMM_BK 64
#define GEMM_STAGES 3

#if __CUDA_ARCH__ >= 800
__device__ __forceinline__ unsigned gemm_smem(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// The shared offset (in bf16) of chunk c of row r of a tile.
__device__ __forceinline__ int gemm_at(int r, int c) { return r * GEMM_BK + 8 * (c ^ (r & 7)); }

// Rows row0.. of `src` (rows x k), columns k0 .. k0 + GEMM_BK, into tile `dst` (R rows);
// zeros past `rows` and past k.
template <int R, int THREADS, bool VEC>
__device__ __forceinline__ void gemm_load(bf16_t* dst, const bf16_t* src, int row0, int rows,
                                          int k, int k0) {
#pragma unroll
    for (int it = 0; it < (R * 8 + THREADS - 1) / THREADS; it++) {
        int q = threadIdx.x + it * THREADS;
        if (q >= R * 8) break;
        int r = q >> 3, c = q & 7, gr = row0 + r, gk = k0 + 8 * c;
        bf16_t* d = dst + gemm_at(r, c);
        if (VEC) {
            bool full = gr < rows && gk < k;
            const bf16_t* s = full ? src + (size_t)gr * k + gk : src;
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(gemm_smem(d)),
                         "l"(s), "r"(full ? 16 : 0));
        } else {
            unsigned v[4];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                unsigned lo = 0, hi = 0;
                if (gr < rows && gk + 2 * e < k) lo = src[(size_t)gr * k + gk + 2 * e];
                if (gr < rows && gk + 2 * e + 1 < k) hi = src[(size_t)gr * k + gk + 2 * e + 1];
                v[e] = lo | (hi << 16);
            }
            *(uint4*)d = make_uint4(v[0], v[1], v[2], v[3]);
        }
    }
}

__device__ __forceinline__ void gemm_ldmatrix(unsigned* r, const bf16_t* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(gemm_smem(p)));
}

__device__ __forceinline__ void gemm_mma(float* d, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <int BM, int BN, int WM, int WN, bool VEC>
__device__ __forceinline__ void gemm_tile(const bf16_t* x, const bf16_t* w, float* y, int n,
                                          int k, int m) {
    constexpr int THREADS = WM * WN * 32, TM = BM / WM, TN = BN / WN;
    constexpr int MT = TM / 16, NT = TN / 8;
    extern __shared__ uint4 gemm_shared[];
    bf16_t* as = (bf16_t*)gemm_shared;
    bf16_t* bs = as + GEMM_STAGES * BM * GEMM_BK;
    int tiles_m = (m + BN - 1) / BN;
    int bm0 = (blockIdx.x / tiles_m) * BM, bn0 = (blockIdx.x % tiles_m) * BN;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int wr = (warp / WN) * TM, wc = (warp % WN) * TN;
    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.0f;
    int ktiles = (k + GEMM_BK - 1) / GEMM_BK;
#pragma unroll
    for (int s = 0; s < GEMM_STAGES - 1; s++) {
        if (s < ktiles) {
            gemm_load<BM, THREADS, VEC>(as + s * BM * GEMM_BK, x, bm0, n, k, s * GEMM_BK);
            gemm_load<BN, THREADS, VEC>(bs + s * BN * GEMM_BK, w, bn0, m, k, s * GEMM_BK);
        }
        asm volatile("cp.async.commit_group;\n" ::);
    }
    for (int kt = 0; kt < ktiles; kt++) {
        // Tile kt has landed (at most GEMM_STAGES - 2 younger groups are pending), and every
        // warp is done with the buffer the next load overwrites (the one read at kt - 1).
        asm volatile("cp.async.wait_group %0;\n" ::"n"(GEMM_STAGES - 2));
        __syncthreads();
        int nk = kt + GEMM_STAGES - 1;
        if (nk < ktiles) {
            int s = nk % GEMM_STAGES;
            gemm_load<BM, THREADS, VEC>(as + s * BM * GEMM_BK, x, bm0, n, k, nk * GEMM_BK);
            gemm_load<BN, THREADS, VEC>(bs + s * BN * GEMM_BK, w, bn0, m, k, nk * GEMM_BK);
        }
        asm volatile("cp.async.commit_group;\n" ::);
        const bf16_t* a = as + (kt % GEMM_STAGES) * BM * GEMM_BK;
        const bf16_t* b = bs + (kt % GEMM_STAGES) * BN * GEMM_BK;
#pragma unroll
        for (int ks = 0; ks < GEMM_BK / 16; ks++) {
            unsigned af[MT][4], bf[NT][2];
#pragma unroll
            for (int i = 0; i < MT; i++) {
                // Matrices: rows 0-7 and 8-15 at k 0-7, then both at k 8-15 (the A fragment).
                int r = wr + 16 * i + (lane & 15);
                gemm_ldmatrix(af[i], a + gemm_at(r, 2 * ks + (lane >> 4)));
            }
#pragma unroll
            for (int j = 0; j < NT / 2; j++) {
                // Matrices: w rows (n) 0-7 at k 0-7 and 8-15, then rows 8-15 alike: the B
                // fragments of two n8 tiles.
                int q = lane >> 3, r = wc + 16 * j + (q >> 1) * 8 + (lane & 7);
                unsigned t[4];
                gemm_ldmatrix(t, b + gemm_at(r, 2 * ks + (q & 1)));
                bf[2 * j][0] = t[0];
                bf[2 * j][1] = t[1];
                bf[2 * j + 1][0] = t[2];
                bf[2 * j + 1][1] = t[3];
            }
#pragma unroll
            for (int i = 0; i < MT; i++)
#pragma unroll
                for (int j = 0; j < NT; j++) gemm_mma(acc[i][j], af[i], bf[j]);
        }
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
    int g = lane >> 2, t = lane & 3;
    bool pairs = (m & 1) == 0 && ((size_t)y & 7) == 0;
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int row = bm0 + wr + 16 * i + g + 8 * h, col = bn0 + wc + 8 * j + 2 * t;
                if (row >= n || col >= m) continue;
                float* o = y + (size_t)row * m + col;
                if (pairs) {
                    *(float2*)o = make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
                } else {
                    o[0] = acc[i][j][2 * h];
                    if (col + 1 < m) o[1] = acc[i][j][2 * h + 1];
                }
            }
}
#endif

#define GEMM_KERNEL(name, threads, BM, BN, WM, WN, VEC)                                          \
    extern "C" __global__ void __launch_bounds__(threads)                                       \
        name(const bf16_t* x, const bf16_t* w, float* y, int n, int k, int m) {                 \
        PDL_ENTER();                                                                            \
        GEMM_BODY(BM, BN, WM, WN, VEC)                                                          \
    }
#if __CUDA_ARCH__ >= 800
#define GEMM_BODY(BM, BN, WM, WN, VEC) gemm_tile<BM, BN, WM, WN, VEC>(x, w, y, n, k, m);
#else
#define GEMM_BODY(BM, BN, WM, WN, VEC)
#endif

// Large (n and m each span many tiles), medium, small; `any` for rows that are not 16-byte
// aligned. The host picks the largest tile that still gives every SM work (`Gpu::gemm_own`).
GEMM_KERNEL(gemm_bf16_l, 256, 128, 128, 2, 4, true)
GEMM_KERNEL(gemm_bf16_m, 128, 64, 64, 2, 2, true)
GEMM_KERNEL(gemm_bf16_s, 128, 32, 32, 2, 2, true)
GEMM_KERNEL(gemm_bf16_any, 128, 64, 64, 2, 2, false)
