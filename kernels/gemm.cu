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
// Block tile BM x BN over BK columns of k at a time (64, the large tile 128), STAGES in flight
// (cp.async), warps WM x WN each computing (BM / WM) x (BN / WN) with ldmatrix fragments.
// Shared rows are BK * 2 bytes; chunk c (16 bytes) of row r sits at c ^ (r % 8), so that the
// eight rows an ldmatrix phase reads fall in distinct bank groups (32 columns a stage left the
// kernel at half cuBLAS's rate at 16k rows: a barrier every two MMA steps). VEC: rows of x and
// w are 16-byte aligned (k % 8 == 0, aligned bases) and tiles arrive by cp.async; otherwise
// element by element, with zeros past k. Dynamic shared memory: STAGES * (BM + BN) * BK * 2
// bytes.

#define GEMM_BK 64
#define GEMM_STAGES 3

#if __CUDA_ARCH__ >= 800
__device__ __forceinline__ unsigned gemm_smem(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// The shared offset (in bf16) of chunk c of row r of a tile BK columns wide: the swizzle
// flips the chunk's low three bits, within its 128 bytes.
template <int BK>
__device__ __forceinline__ int gemm_at(int r, int c) { return r * BK + 8 * (c ^ (r & 7)); }

// Rows row0.. of `src` (rows x k), columns k0 .. k0 + BK, into tile `dst` (R rows), element
// by element (rows of any alignment); zeros past `rows` and past k.
template <int R, int THREADS, int BK>
__device__ __forceinline__ void gemm_load_any(bf16_t* dst, const bf16_t* src, int row0, int rows,
                                              int k, int k0) {
    constexpr int C = BK / 8;
#pragma unroll
    for (int it = 0; it < (R * C + THREADS - 1) / THREADS; it++) {
        int q = threadIdx.x + it * THREADS;
        if (q >= R * C) break;
        int r = q / C, c = q % C, gr = row0 + r, gk = k0 + 8 * c;
        unsigned v[4];
#pragma unroll
        for (int e = 0; e < 4; e++) {
            unsigned lo = 0, hi = 0;
            if (gr < rows && gk + 2 * e < k) lo = src[(size_t)gr * k + gk + 2 * e];
            if (gr < rows && gk + 2 * e + 1 < k) hi = src[(size_t)gr * k + gk + 2 * e + 1];
            v[e] = lo | (hi << 16);
        }
        *(uint4*)(dst + gemm_at<BK>(r, c)) = make_uint4(v[0], v[1], v[2], v[3]);
    }
}

// One thread's share of a tile's cp.async loads (rows 16-byte aligned): for each of its
// 16-byte chunks, its row in global memory (rows past the operand's end keep its first row
// and read nothing), its column and its byte offset in a stage. Worked out once, so that a
// step along k costs an add and a cp.async a chunk: with the addresses recomputed every step,
// a block of a few rows issued ten instructions for each MMA and ran at a quarter of the
// weights' bandwidth.
template <int R, int THREADS, int BK>
struct GemmChunks {
    static constexpr int C = BK / 8, L = (R * C + THREADS - 1) / THREADS;
    const bf16_t* src[L];
    int col[L];
    unsigned dst[L];
    bool row_in[L];

    __device__ __forceinline__ GemmChunks(const bf16_t* base, int row0, int rows, int k) {
#pragma unroll
        for (int it = 0; it < L; it++) {
            int q = threadIdx.x + it * THREADS, r = q / C, c = q % C;
            row_in[it] = q < R * C && row0 + r < rows;
            src[it] = base + (row_in[it] ? (size_t)(row0 + r) * k : 0);
            col[it] = 8 * c;
            dst[it] = 2 * gemm_at<BK>(r, c);
        }
    }

    // Columns k0 .. k0 + BK into the stage at shared address `stage`; zeros past k.
    __device__ __forceinline__ void load(unsigned stage, int k, int k0) const {
#pragma unroll
        for (int it = 0; it < L; it++) {
            if ((R * C) % THREADS != 0 && threadIdx.x + it * THREADS >= R * C) break;
            int gk = k0 + col[it];
            bool full = row_in[it] && gk < k;
            const bf16_t* s = full ? src[it] + gk : src[it];
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(stage + dst[it]),
                         "l"(s), "r"(full ? 16 : 0));
        }
    }
};

// The byte offset in a stage of the 16-byte chunk (2 ks + h) of row r, as `gemm_at` places it,
// for ks = 0: the offset for ks is `gemm_frag_at(o, ks)`. The swizzle flips the chunk's
// low three bits within its 128 bytes, so a step of ks flips bits 5 and 6 of the offset.
template <int BK>
__device__ __forceinline__ unsigned gemm_frag_base(int r, int h) {
    return 2 * r * BK + 16 * (h ^ (r & 7));
}
__device__ __forceinline__ unsigned gemm_frag_at(unsigned base, int ks) {
    return 128 * (ks / 4) + (base ^ (32 * (ks % 4)));
}

__device__ __forceinline__ void gemm_ldmatrix(unsigned* r, unsigned shared) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared));
}

__device__ __forceinline__ void gemm_mma(float* d, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <int BM, int BN, int WM, int WN, bool VEC, int BK = GEMM_BK, int STAGES = GEMM_STAGES>
__device__ __forceinline__ void gemm_tile(const bf16_t* x, const bf16_t* w, float* y, int n,
                                          int k, int m) {
    constexpr int THREADS = WM * WN * 32, TM = BM / WM, TN = BN / WN;
    constexpr int MT = TM / 16, NT = TN / 8;
    extern __shared__ uint4 gemm_shared[];
    bf16_t* as = (bf16_t*)gemm_shared;
    bf16_t* bs = as + STAGES * BM * BK;
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
    int ktiles = (k + BK - 1) / BK, kpad = (k + GEMM_BK - 1) / GEMM_BK * GEMM_BK;
    GemmChunks<BM, THREADS, BK> xa(x, bm0, n, k);
    GemmChunks<BN, THREADS, BK> wb(w, bn0, m, k);
    constexpr unsigned SA = BM * BK * 2, SB = BN * BK * 2;
    const unsigned a0 = gemm_smem(as), b0 = gemm_smem(bs);
    auto load = [&](int s, int kt) {
        if (VEC) {
            xa.load(a0 + s * SA, k, kt * BK);
            wb.load(b0 + s * SB, k, kt * BK);
        } else {
            gemm_load_any<BM, THREADS, BK>(as + s * BM * BK, x, bm0, n, k, kt * BK);
            gemm_load_any<BN, THREADS, BK>(bs + s * BN * BK, w, bn0, m, k, kt * BK);
        }
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < ktiles) load(s, s);
        asm volatile("cp.async.commit_group;\n" ::);
    }
    // This lane's ldmatrix rows: A's rows 0-15 at chunk 0 (lanes 0-15) and 1 (16-31); B's w
    // rows 0-7 at chunks 0 and 1, then rows 8-15 alike.
    unsigned fa[MT], fb[NT / 2];
#pragma unroll
    for (int i = 0; i < MT; i++) fa[i] = gemm_frag_base<BK>(wr + 16 * i + (lane & 15), lane >> 4);
#pragma unroll
    for (int j = 0; j < NT / 2; j++) {
        int q = lane >> 3;
        fb[j] = gemm_frag_base<BK>(wc + 16 * j + (q >> 1) * 8 + (lane & 7), q & 1);
    }
    int rs = 0, ws = STAGES - 1;
    for (int kt = 0; kt < ktiles; kt++) {
        // Tile kt has landed (at most STAGES - 2 younger groups are pending), and every
        // warp is done with the buffer the next load overwrites (the one read at kt - 1).
        asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2));
        __syncthreads();
        if (kt + STAGES - 1 < ktiles) load(ws, kt + STAGES - 1);
        asm volatile("cp.async.commit_group;\n" ::);
        const unsigned a = a0 + rs * SA, b = b0 + rs * SB;
        rs = rs + 1 == STAGES ? 0 : rs + 1;
        ws = ws + 1 == STAGES ? 0 : ws + 1;
#pragma unroll
        for (int ks = 0; ks < BK / 16; ks++) {
            // The MMAs of a GEMM_BK-wide tile, zeros past k included, and no more: a wider
            // tile runs exactly the narrow one's (an MMA of zeros may still turn -0 into +0).
            if (BK > GEMM_BK && kt * BK + ks * 16 >= kpad) break;
            unsigned af[MT][4], bf[NT][2];
#pragma unroll
            for (int i = 0; i < MT; i++) gemm_ldmatrix(af[i], a + gemm_frag_at(fa[i], ks));
#pragma unroll
            for (int j = 0; j < NT / 2; j++) {
                unsigned t[4];
                gemm_ldmatrix(t, b + gemm_frag_at(fb[j], ks));
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

#define GEMM_KERNEL(name, threads, BM, BN, WM, WN, VEC, BK, STAGES)                              \
    extern "C" __global__ void __launch_bounds__(threads)                                       \
        name(const bf16_t* x, const bf16_t* w, float* y, int n, int k, int m) {                 \
        PDL_ENTER();                                                                            \
        GEMM_BODY(BM, BN, WM, WN, VEC, BK, STAGES)                                              \
    }
#if __CUDA_ARCH__ >= 800
#define GEMM_BODY(BM, BN, WM, WN, VEC, BK, STAGES) \
    gemm_tile<BM, BN, WM, WN, VEC, BK, STAGES>(x, w, y, n, k, m);
#else
#define GEMM_BODY(BM, BN, WM, WN, VEC, BK, STAGES)
#endif

// Large (n and m each span many tiles: 128 columns of k a step, two steps in flight, 3-7%
// faster than 64 and three at 368-2048 rows of Qwen3-8B's shapes), medium, small, tiny (at
// most 16 rows: two warps, six steps of k in flight); `any` for rows that are not 16-byte
// aligned. The host picks the largest tile that still gives every SM work (`GemmTile::pick`).
GEMM_KERNEL(gemm_bf16_l, 256, 128, 128, 2, 4, true, 128, 2)
GEMM_KERNEL(gemm_bf16_m, 128, 64, 64, 2, 2, true, 64, 3)
GEMM_KERNEL(gemm_bf16_s, 128, 32, 32, 2, 2, true, 64, 4)
GEMM_KERNEL(gemm_bf16_t, 64, 16, 32, 1, 2, true, 64, 6)
GEMM_KERNEL(gemm_bf16_any, 128, 64, 64, 2, 2, false, 64, 3)
