// The noise model's oracle on the GPU (src/cuda/oracle.rs): the standard prefill recomputed in
// f64, and the same pass in f32 with bf16-rounded matmul inputs (the emulation of a bf16
// backend's rounding). Written apart from the engine's kernels, with nothing in common with
// them: plain loops, one fixed order per sum, no fusion, and matrix products of their own
// (`oracle_gemm_*` below, not kernels/gemm.cu): in f64 on FP64 tensor cores where the GPU has
// them, in f32 on plain FMAs (no TF32). The emulation's products are f64 products of its
// bf16-rounded operands, rounded once to f32.
//
// Every kernel has a double (`_f64`) and a float (`_f32`) instance. Weights arrive as the bf16
// bits the GPU holds and are widened exactly, or (`_w32_` kernels) as the f32 values of a
// checkpoint bf16 cannot hold exactly. Each waits for the kernel before it (`pdl_wait`):
// they may be launched with programmatic dependent launch, like every kernel of the module.

__device__ __forceinline__ float oracle_from_bf16(unsigned short b) {
  return __uint_as_float(((unsigned int)b) << 16);
}

// Round to the nearest bf16, ties to even, as the host's `half::bf16::from_f32`.
__device__ __forceinline__ float oracle_to_bf16(float x) {
  unsigned int u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return __uint_as_float(u | 0x00400000u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return __uint_as_float(u & 0xffff0000u);
}

__device__ __forceinline__ float oracle_weight(unsigned short b) { return oracle_from_bf16(b); }
__device__ __forceinline__ float oracle_weight(float w) { return w; }

#define ORACLE_STRIDE(i, n)                                                            \
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (long long)(n); \
       i += (long long)gridDim.x * blockDim.x)

template <typename T, typename W>
__device__ void oracle_widen(const W* w, T* out, long long n) {
  pdl_wait();
  ORACLE_STRIDE(i, n) out[i] = (T)oracle_weight(w[i]);
}

template <typename T, typename W>
__device__ void oracle_embed(const W* table, const unsigned int* tokens, T* out, int n, int h) {
  pdl_wait();
  ORACLE_STRIDE(i, (long long)n * h) {
    long long t = i / h, j = i % h;
    out[i] = (T)oracle_weight(table[(long long)tokens[t] * h + j]);
  }
}

// `out[r] = sum_i w[r, i]^2` for each of `rows` rows of `k`, one block a row, over a fixed tree:
// the scale of a product's rows that blame by replay (src/cuda/oracle/replay.rs) measures by.
template <typename T, typename W>
__device__ void oracle_row_sumsq(const W* w, T* out, int rows, int k) {
  pdl_wait();
  __shared__ T part[256];
  int r = blockIdx.x;
  if (r >= rows) return;
  const W* row = w + (long long)r * k;
  T s = 0;
  for (int j = threadIdx.x; j < k; j += blockDim.x) {
    T v = (T)oracle_weight(row[j]);
    s += v * v;
  }
  part[threadIdx.x] = s;
  __syncthreads();
  for (int h = blockDim.x / 2; h > 0; h /= 2) {
    if (threadIdx.x < h) part[threadIdx.x] += part[threadIdx.x + h];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[r] = part[0];
}

// One block per row; the sum of squares reduced over a fixed tree.
template <typename T, typename W>
__device__ void oracle_rms_norm(const T* x, const W* w, T* out, int rows, int dim, float eps) {
  pdl_wait();
  __shared__ T part[256];
  int r = blockIdx.x;
  if (r >= rows) return;
  const T* row = x + (long long)r * dim;
  T s = 0;
  for (int j = threadIdx.x; j < dim; j += blockDim.x) s += row[j] * row[j];
  part[threadIdx.x] = s;
  __syncthreads();
  for (int k = blockDim.x / 2; k > 0; k /= 2) {
    if (threadIdx.x < k) part[threadIdx.x] += part[threadIdx.x + k];
    __syncthreads();
  }
  T inv = (T)1 / sqrt(part[0] / (T)dim + (T)eps);
  for (int j = threadIdx.x; j < dim; j += blockDim.x)
    out[(long long)r * dim + j] = row[j] * inv * (T)oracle_weight(w[j]);
}

// `y[n, m] += bias` (bias in f32: the bf16-rounded values the GPU holds, or the checkpoint's).
template <typename T>
__device__ void oracle_add_bias(T* y, const float* bias, int n, int m) {
  pdl_wait();
  ORACLE_STRIDE(i, (long long)n * m) y[i] += (T)bias[i % m];
}

template <typename T>
__device__ void oracle_add(const T* a, const T* b, T* out, long long n) {
  pdl_wait();
  ORACLE_STRIDE(i, n) out[i] = a[i] + b[i];
}

template <typename T>
__device__ void oracle_swiglu(const T* gate, const T* up, T* out, long long n) {
  pdl_wait();
  ORACLE_STRIDE(i, n) {
    T g = gate[i];
    out[i] = g / ((T)1 + exp(-g)) * up[i];
  }
}

// Rotate-half RoPE of `x[n, heads, hd]` by per-token tables `cos`/`sin` `[n, hd/2]` (the
// host computes the angles, as the pass it stands for does).
template <typename T>
__device__ void oracle_rope(T* x, const T* cos, const T* sin, int n, int heads, int hd) {
  pdl_wait();
  int half = hd / 2;
  ORACLE_STRIDE(i, (long long)n * heads * half) {
    long long t = i / ((long long)heads * half);
    int rest = (int)(i % ((long long)heads * half));
    int h = rest / half, j = rest % half;
    T* p = x + (t * heads + h) * hd;
    T c = cos[t * half + j], s = sin[t * half + j];
    T a = p[j], b = p[j + half];
    p[j] = a * c - b * s;
    p[j + half] = b * c + a * s;
  }
}

// Causal attention over tokens 0..n-1 (the last `window` keys when window > 0; GQA): one block
// per (query, head). Writes the probabilities `[n, heads, n]` (zero outside the window) and the
// output `[n, heads, hd]`.
template <typename T>
__device__ void oracle_attention(const T* q, const T* k, const T* v, T* probs, T* out, int n,
                                 int heads, int kvh, int hd, int window) {
  pdl_wait();
  __shared__ T red[128];
  int t = blockIdx.x / heads, head = blockIdx.x % heads;
  if (t >= n) return;
  int g = head / (heads / kvh);
  int first = window > 0 ? max(0, t + 1 - window) : 0;
  const T* qv = q + ((long long)t * heads + head) * hd;
  T* p = probs + ((long long)t * heads + head) * n;
  T scale = (T)1 / sqrt((T)hd);
  T m = (T)NEG_INF;
  for (int e = threadIdx.x; e < n; e += blockDim.x) {
    if (e < first || e > t) {
      p[e] = 0;
      continue;
    }
    const T* key = k + ((long long)e * kvh + g) * hd;
    T s = 0;
    for (int d = 0; d < hd; d++) s += qv[d] * key[d];
    s *= scale;
    p[e] = s;
    m = fmax(m, s);
  }
  red[threadIdx.x] = m;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) red[threadIdx.x] = fmax(red[threadIdx.x], red[threadIdx.x + w]);
    __syncthreads();
  }
  m = red[0];
  __syncthreads();
  T sum = 0;
  for (int e = first + threadIdx.x; e <= t; e += blockDim.x) {
    T x = exp(p[e] - m);
    p[e] = x;
    sum += x;
  }
  red[threadIdx.x] = sum;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) red[threadIdx.x] += red[threadIdx.x + w];
    __syncthreads();
  }
  sum = red[0];
  for (int e = first + threadIdx.x; e <= t; e += blockDim.x) p[e] = p[e] / sum;
  __syncthreads();
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    T acc = 0;
    for (int e = first; e <= t; e++) acc += p[e] * v[((long long)e * kvh + g) * hd + d];
    out[((long long)t * heads + head) * hd + d] = acc;
  }
}

#define ORACLE_WEIGHT_INSTANCES(T, S, W, WS)                                                  \
  extern "C" __global__ void oracle_widen_##WS##S(const W* w, T* out, long long n) {            \
    oracle_widen<T, W>(w, out, n);                                                              \
  }                                                                                             \
  extern "C" __global__ void oracle_embed_##WS##S(const W* table, const unsigned int* tokens,   \
                                                  T* out, int n, int h) {                       \
    oracle_embed<T, W>(table, tokens, out, n, h);                                               \
  }                                                                                             \
  extern "C" __global__ void oracle_rms_norm_##WS##S(const T* x, const W* w, T* out, int rows,  \
                                                     int dim, float eps) {                      \
    oracle_rms_norm<T, W>(x, w, out, rows, dim, eps);                                           \
  }                                                                                             \
  extern "C" __global__ void oracle_row_sumsq_##WS##S(const W* w, T* out, int rows, int k) {    \
    oracle_row_sumsq<T, W>(w, out, rows, k);                                                    \
  }

ORACLE_WEIGHT_INSTANCES(double, f64, unsigned short, )
ORACLE_WEIGHT_INSTANCES(float, f32, unsigned short, )
ORACLE_WEIGHT_INSTANCES(double, f64, float, w32_)
ORACLE_WEIGHT_INSTANCES(float, f32, float, w32_)

#define ORACLE_INSTANCES(T, S)                                                                 \
  extern "C" __global__ void oracle_add_bias_##S(T* y, const float* bias, int n, int m) {      \
    oracle_add_bias<T>(y, bias, n, m);                                                          \
  }                                                                                             \
  extern "C" __global__ void oracle_add_##S(const T* a, const T* b, T* out, long long n) {      \
    oracle_add<T>(a, b, out, n);                                                                \
  }                                                                                             \
  extern "C" __global__ void oracle_swiglu_##S(const T* gate, const T* up, T* out,              \
                                               long long n) {                                   \
    oracle_swiglu<T>(gate, up, out, n);                                                         \
  }                                                                                             \
  extern "C" __global__ void oracle_rope_##S(T* x, const T* cos, const T* sin, int n, int heads, \
                                             int hd) {                                          \
    oracle_rope<T>(x, cos, sin, n, heads, hd);                                                  \
  }                                                                                             \
  extern "C" __global__ void oracle_attention_##S(const T* q, const T* k, const T* v, T* probs,  \
                                                  T* out, int n, int heads, int kvh, int hd,    \
                                                  int window) {                                 \
    oracle_attention<T>(q, k, v, probs, out, n, heads, kvh, hd, window);                        \
  }

ORACLE_INSTANCES(double, f64)
ORACLE_INSTANCES(float, f32)

// The oracle's matrix products: y[t, j] (rows `ldy` apart) = sum_i x[t, i] * w[j, i], x being
// n x k and w m x k, both row-major (a linear layer's weight). Each output is one chain of
// products along k, in the operands' precision: f64 on FP64 tensor cores (`mma.m8n8k4`, sm_80
// and later; FMAs before), f32 on FMAs, which is what "f32 without TF32" means. They replace
// cuBLAS's DGEMM and SGEMM: loading cuBLAS held up the driver's other calls for 70-90 ms of
// every calibrating run, and its first DGEMM took 40-140 ms more.
//
// Block: ORACLE_GEMM_TILE rows of x by as many of w (16 * ORACLE_GEMM_NT on the DMMA path),
// 128 threads, over kchunk columns of k: blocks tiles * s .. tiles * (s + 1) - 1 take split s
// of k, which writes its partial products to slice s of `y`, `slice` values apart (one split:
// `y` itself); oracle_gemm_sum adds the slices up in order, so the result does not depend on
// which block ends first. Tiles of ORACLE_GEMM_BK columns go through
// shared memory; rows of a shared tile are ORACLE_GEMM_PAD values apart, so that the eight rows
// and four columns a DMMA fragment reads fall in distinct banks. The DMMA path keeps STAGES
// tiles in flight (cp.async); the FMA path reads the next tile into registers meanwhile.
// Dynamic shared memory: STAGES * (ORACLE_GEMM_TILE + 16 * NT) * ORACLE_GEMM_PAD doubles on the
// DMMA path, 4 * ORACLE_GEMM_TILE * ORACLE_GEMM_PAD values on the FMA one.
#define ORACLE_GEMM_TILE 64
#define ORACLE_GEMM_BK 16
#define ORACLE_GEMM_PAD 20
#define ORACLE_GEMM_STAGES 3
#define ORACLE_GEMM_NT 4
#define ORACLE_GEMM_LOADS (ORACLE_GEMM_TILE * ORACLE_GEMM_BK / 128)

__device__ __forceinline__ float oracle_gemm_value(unsigned short b) { return oracle_from_bf16(b); }
__device__ __forceinline__ double oracle_gemm_value(double v) { return v; }
__device__ __forceinline__ float oracle_gemm_value(float v) { return v; }

template <typename T, typename S>
__device__ __forceinline__ void oracle_gemm_fetch(T (&r)[ORACLE_GEMM_LOADS], const S* src,
                                                  int row0, int rows, int k, int k0, int k1) {
#pragma unroll
  for (int it = 0; it < ORACLE_GEMM_LOADS; it++) {
    int q = threadIdx.x + it * 128, row = row0 + q / ORACLE_GEMM_BK,
        col = k0 + q % ORACLE_GEMM_BK;
    r[it] = row < rows && col < k1 ? (T)oracle_gemm_value(src[(long long)row * k + col]) : (T)0;
  }
}

template <typename T>
__device__ __forceinline__ void oracle_gemm_store(T* tile, const T (&r)[ORACLE_GEMM_LOADS]) {
#pragma unroll
  for (int it = 0; it < ORACLE_GEMM_LOADS; it++) {
    int q = threadIdx.x + it * 128;
    tile[q / ORACLE_GEMM_BK * ORACLE_GEMM_PAD + q % ORACLE_GEMM_BK] = r[it];
  }
}

#if __CUDA_ARCH__ >= 800
// Rows row0 .. row0 + R of `src` (rows x k), columns k0 .. k0 + ORACLE_GEMM_BK, into `tile` by
// 16-byte cp.async (rows 16-byte aligned: k even, `src` aligned); zeros past `rows` and k1.
template <int R, int PAD>
__device__ __forceinline__ void oracle_gemm_copy(double* tile, const double* src, int row0,
                                                 int rows, int k, int k0, int k1) {
  constexpr int CHUNKS = ORACLE_GEMM_BK / 2;
#pragma unroll
  for (int it = 0; it < R * CHUNKS / 128; it++) {
    int q = threadIdx.x + it * 128, r = q / CHUNKS, c = 2 * (q % CHUNKS);
    int row = row0 + r, col = k0 + c;
    int left = row < rows ? k1 - col : 0;
    int bytes = left >= 2 ? 16 : left == 1 ? 8 : 0;
    const double* s = bytes ? src + (long long)row * k + col : src;
    unsigned d;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }"
        : "=r"(d)
        : "l"(tile + r * PAD + c));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(s), "r"(bytes));
  }
}

// WB's loads: eight bf16 of row `row` of w from column col (zeros past m and k1), as one
// 16-byte load where rows allow (`vec`), and their store into a tile as f64.
__device__ __forceinline__ uint4 oracle_gemm_fetch_bf16(const unsigned short* w, int row, int m,
                                                        int k, int col, int k1, bool vec) {
  const unsigned short* p = w + (long long)row * k + col;
  if (row < m && vec && col + 8 <= k1) return __ldg((const uint4*)p);
  unsigned v[4] = {0, 0, 0, 0};
  if (row < m)
    for (int e = 0; e < 8; e++)
      if (col + e < k1) v[e >> 1] |= (unsigned)p[e] << (16 * (e & 1));
  return make_uint4(v[0], v[1], v[2], v[3]);
}

__device__ __forceinline__ void oracle_gemm_store_bf16(double* to, uint4 v) {
  unsigned u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int e = 0; e < 4; e++)
    ((double2*)to)[e] = make_double2((double)__uint_as_float(u[e] << 16),
                                     (double)__uint_as_float(u[e] & 0xffff0000u));
}

// Warps 2 x 2, each 32 rows of x by NT * 8 of w: BN = 16 * NT columns a block. WB: w holds
// the bf16 the GPU keeps (a checkpoint's own values), widened to f64 as its tiles are stored,
// which saves writing and reading back a widened copy of every weight.
template <int STAGES, int NT, bool WB>
__device__ __forceinline__ void oracle_dgemm_mma(const double* x, const void* wv, double* y,
                                                 int n, int k, int m, int r0, int c0, int k0,
                                                 int k1, long long ldy) {
  constexpr int PAD = ORACLE_GEMM_PAD;
  constexpr int BN = 16 * NT, XS = ORACLE_GEMM_TILE * PAD, WS = BN * PAD;
  static_assert(!WB || BN * ORACLE_GEMM_BK == 8 * 128, "one 16-byte piece of w a thread a tile");
  const double* w = (const double*)wv;
  const unsigned short* wb = (const unsigned short*)wv;
  // WB: this thread's piece of a w tile, row wr_ of the tile, columns wc_ .. wc_ + 7.
  int wr_ = threadIdx.x >> 1, wc_ = (threadIdx.x & 1) * 8;
  bool wvec = ((k & 7) == 0) && (((size_t)wv & 15) == 0);
  uint4 wnext = make_uint4(0, 0, 0, 0);
  extern __shared__ double oracle_gemm_tiles[];
  double* xs = oracle_gemm_tiles;
  double* ws = xs + STAGES * XS;
  int ktiles = (k1 - k0 + ORACLE_GEMM_BK - 1) / ORACLE_GEMM_BK;
#pragma unroll
  for (int s = 0; s < STAGES - 1; s++) {
    if (s < ktiles) {
      oracle_gemm_copy<ORACLE_GEMM_TILE, PAD>(xs + s * XS, x, r0, n, k, k0 + s * ORACLE_GEMM_BK, k1);
      if constexpr (WB) {
        oracle_gemm_store_bf16(ws + s * WS + wr_ * PAD + wc_,
                               oracle_gemm_fetch_bf16(wb, c0 + wr_, m, k, k0 + s * ORACLE_GEMM_BK + wc_, k1, wvec));
      } else {
        oracle_gemm_copy<BN, PAD>(ws + s * WS, w, c0, m, k, k0 + s * ORACLE_GEMM_BK, k1);
      }
    }
    asm volatile("cp.async.commit_group;\n" ::);
  }
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int g = lane >> 2, t = lane & 3, wr = (warp >> 1) * 32, wc = (warp & 1) * NT * 8;
#if __CUDA_ARCH__ >= 900
  // m16n8k16 (sm_90): two 16-row tiles by NT 8-column ones; lane (g, t) holds outputs
  // (g, 2t + h) at [i][j][h] and (g + 8, 2t + h) at [i][j][2 + h].
  constexpr int MI = 2, PER = 4;
#else
  // m8n8k4: four 8-row tiles by NT; lane (g, t) holds outputs (g, 2t + h) at [i][j][h].
  constexpr int MI = 4, PER = 2;
#endif
  double acc[MI][NT][PER];
#pragma unroll
  for (int i = 0; i < MI; i++)
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
      for (int e = 0; e < PER; e++) acc[i][j][e] = 0.0;
  for (int kt = 0; kt < ktiles; kt++) {
    // Tile kt has landed, and every warp is done with the stage the next copy overwrites.
    asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2));
    __syncthreads();
    int nk = kt + STAGES - 1;
    if (nk < ktiles) {
      int s = nk % STAGES;
      oracle_gemm_copy<ORACLE_GEMM_TILE, PAD>(xs + s * XS, x, r0, n, k, k0 + nk * ORACLE_GEMM_BK, k1);
      // WB: read now, stored once this tile is multiplied (the stage it goes to was last read
      // at kt - 1, and tile nk is read two barriers later).
      if constexpr (WB)
        wnext = oracle_gemm_fetch_bf16(wb, c0 + wr_, m, k, k0 + nk * ORACLE_GEMM_BK + wc_, k1, wvec);
      else
        oracle_gemm_copy<BN, PAD>(ws + s * WS, w, c0, m, k, k0 + nk * ORACLE_GEMM_BK, k1);
    }
    asm volatile("cp.async.commit_group;\n" ::);
    const double* a = xs + (kt % STAGES) * XS;
    const double* b = ws + (kt % STAGES) * WS;
#if __CUDA_ARCH__ >= 900
    static_assert(ORACLE_GEMM_BK == 16, "one m16n8k16 step a tile");
    // A: a[e] at row g + 8 (e & 1), column 4 (e / 2) + t; B: b[e] at column (k) 4e + t, row g.
    double af[MI][8], bf[NT][4];
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
      for (int e = 0; e < 8; e++)
        af[i][e] = a[(wr + 16 * i + g + 8 * (e & 1)) * PAD + 4 * (e >> 1) + t];
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
      for (int e = 0; e < 4; e++) bf[j][e] = b[(wc + 8 * j + g) * PAD + 4 * e + t];
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
      for (int j = 0; j < NT; j++)
        asm("mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, "
            "{%4,%5,%6,%7,%8,%9,%10,%11}, {%12,%13,%14,%15}, {%0,%1,%2,%3};\n"
            : "+d"(acc[i][j][0]), "+d"(acc[i][j][1]), "+d"(acc[i][j][2]), "+d"(acc[i][j][3])
            : "d"(af[i][0]), "d"(af[i][1]), "d"(af[i][2]), "d"(af[i][3]), "d"(af[i][4]),
              "d"(af[i][5]), "d"(af[i][6]), "d"(af[i][7]), "d"(bf[j][0]), "d"(bf[j][1]),
              "d"(bf[j][2]), "d"(bf[j][3]));
#else
#pragma unroll
    for (int ks = 0; ks < ORACLE_GEMM_BK; ks += 4) {
      double af[MI], bf[NT];
#pragma unroll
      for (int i = 0; i < MI; i++) af[i] = a[(wr + 8 * i + g) * PAD + ks + t];
#pragma unroll
      for (int j = 0; j < NT; j++) bf[j] = b[(wc + 8 * j + g) * PAD + ks + t];
#pragma unroll
      for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
          asm("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};\n"
              : "+d"(acc[i][j][0]), "+d"(acc[i][j][1])
              : "d"(af[i]), "d"(bf[j]));
    }
#endif
    if constexpr (WB)
      if (nk < ktiles) oracle_gemm_store_bf16(ws + (nk % STAGES) * WS + wr_ * PAD + wc_, wnext);
  }
  asm volatile("cp.async.wait_group 0;\n" ::);
#pragma unroll
  for (int i = 0; i < MI; i++)
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
      for (int e = 0; e < PER; e++) {
        int row = r0 + wr + (32 / MI) * i + g + 8 * (e >> 1), col = c0 + wc + 8 * j + 2 * t + (e & 1);
        if (row < n && col < m) y[row * ldy + col] = acc[i][j][e];
      }
}
#endif

template <typename T, typename WT>
__device__ __forceinline__ void oracle_gemm_fma(const T* x, const WT* w, T* y, int n, int k,
                                                int m, int r0, int c0, int k0, int k1,
                                                long long ldy) {
  constexpr int TS = ORACLE_GEMM_TILE * ORACLE_GEMM_PAD;
  extern __shared__ double oracle_gemm_tiles[];
  T* xs = (T*)oracle_gemm_tiles;
  T* ws = xs + 2 * TS;
  int ktiles = (k1 - k0 + ORACLE_GEMM_BK - 1) / ORACLE_GEMM_BK;
  T rx[ORACLE_GEMM_LOADS], rw[ORACLE_GEMM_LOADS];
  oracle_gemm_fetch(rx, x, r0, n, k, k0, k1);
  oracle_gemm_fetch(rw, w, c0, m, k, k0, k1);
  oracle_gemm_store(xs, rx);
  oracle_gemm_store(ws, rw);
  __syncthreads();
  // Thread (tr, tc) takes rows 4tr .. 4tr + 3 and columns tc + 8j.
  int tr = threadIdx.x >> 3, tc = threadIdx.x & 7;
  T acc[4][8];
#pragma unroll
  for (int i = 0; i < 4; i++)
#pragma unroll
    for (int j = 0; j < 8; j++) acc[i][j] = (T)0;
  for (int kt = 0; kt < ktiles; kt++) {
    int cur = kt & 1;
    bool more = kt + 1 < ktiles;
    if (more) {
      oracle_gemm_fetch(rx, x, r0, n, k, k0 + (kt + 1) * ORACLE_GEMM_BK, k1);
      oracle_gemm_fetch(rw, w, c0, m, k, k0 + (kt + 1) * ORACLE_GEMM_BK, k1);
    }
    const T* a = xs + cur * TS;
    const T* b = ws + cur * TS;
#pragma unroll
    for (int kk = 0; kk < ORACLE_GEMM_BK; kk++) {
      T av[4], bv[8];
#pragma unroll
      for (int i = 0; i < 4; i++) av[i] = a[(4 * tr + i) * ORACLE_GEMM_PAD + kk];
#pragma unroll
      for (int j = 0; j < 8; j++) bv[j] = b[(tc + 8 * j) * ORACLE_GEMM_PAD + kk];
#pragma unroll
      for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[i][j] = fma(av[i], bv[j], acc[i][j]);
    }
    if (more) {
      oracle_gemm_store(xs + (cur ^ 1) * TS, rx);
      oracle_gemm_store(ws + (cur ^ 1) * TS, rw);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; i++)
#pragma unroll
    for (int j = 0; j < 8; j++) {
      int row = r0 + 4 * tr + i, col = c0 + tc + 8 * j;
      if (row < n && col < m) y[row * ldy + col] = acc[i][j];
    }
}

// MMA: the DMMA path (f64 operands with 16-byte aligned rows of x, sm_80 and later), else FMAs.
// WT: w's type, T or the bf16 bits the GPU holds (unsigned short).
template <typename T, typename WT, bool MMA, int STAGES, int NT>
__device__ __forceinline__ void oracle_gemm(const T* x, const WT* w, T* y, int n, int k, int m,
                                            long long ldy, int kchunk, long long slice) {
  pdl_wait();
  int bn = MMA ? 16 * NT : ORACLE_GEMM_TILE;
  int tiles_m = (m + bn - 1) / bn, tiles = (n + ORACLE_GEMM_TILE - 1) / ORACLE_GEMM_TILE * tiles_m;
  int split = blockIdx.x / tiles, tile = blockIdx.x % tiles;
  int r0 = tile / tiles_m * ORACLE_GEMM_TILE, c0 = tile % tiles_m * bn;
  int k0 = split * kchunk, k1 = min(k, k0 + kchunk);
  y += split * slice;
#if __CUDA_ARCH__ >= 800
  if constexpr (MMA && sizeof(T) == 8) {
    oracle_dgemm_mma<STAGES, NT, sizeof(WT) == 2>((const double*)x, (const void*)w, (double*)y, n,
                                                  k, m, r0, c0, k0, k1, ldy);
    return;
  }
#endif
  oracle_gemm_fma<T, WT>(x, w, y, n, k, m, r0, c0, k0, k1, ldy);
}

#define ORACLE_GEMM_ARGS(T, WT)                                                                \
  const T *x, const WT *w, T *y, int n, int k, int m, long long ldy, int kchunk, long long slice
#define ORACLE_GEMM_KERNEL(name, T, WT, MMA)                                                   \
  extern "C" __global__ void __launch_bounds__(128) name(ORACLE_GEMM_ARGS(T, WT)) {            \
    oracle_gemm<T, WT, MMA, ORACLE_GEMM_STAGES, ORACLE_GEMM_NT>(x, w, y, n, k, m, ldy, kchunk,  \
                                                                slice);                         \
  }
ORACLE_GEMM_KERNEL(oracle_gemm_f64, double, double, true)
ORACLE_GEMM_KERNEL(oracle_gemm_f64_wb, double, unsigned short, true)
ORACLE_GEMM_KERNEL(oracle_gemm_f64_fma, double, double, false)
ORACLE_GEMM_KERNEL(oracle_gemm_f64_fma_wb, double, unsigned short, false)
ORACLE_GEMM_KERNEL(oracle_gemm_f32, float, float, false)

// y[t, j] (rows `ldy` apart) = the sum of the `splits` slices of a split product (n x m each,
// contiguous), in slice order.
template <typename T>
__device__ __forceinline__ void oracle_gemm_sum(const T* part, T* y, int n, int m, long long ldy,
                                                int splits) {
  pdl_wait();
  long long len = (long long)n * m;
  ORACLE_STRIDE(i, len) {
    T s = part[i];
    for (int p = 1; p < splits; p++) s += part[p * len + i];
    y[i / m * ldy + i % m] = s;
  }
}

extern "C" __global__ void oracle_gemm_sum_f64(const double* part, double* y, int n, int m,
                                               long long ldy, int splits) {
  oracle_gemm_sum<double>(part, y, n, m, ldy, splits);
}

extern "C" __global__ void oracle_gemm_sum_f32(const float* part, float* y, int n, int m,
                                               long long ldy, int splits) {
  oracle_gemm_sum<float>(part, y, n, m, ldy, splits);
}

extern "C" __global__ void oracle_round_bf16_f32(const float* x, float* out, long long n) {
  pdl_wait();
  ORACLE_STRIDE(i, n) out[i] = oracle_to_bf16(x[i]);
}

// The emulation's matmul operand: rounded to bf16, then widened exactly for DGEMM.
extern "C" __global__ void oracle_round_bf16_widen_f64(const float* x, double* out, long long n) {
  pdl_wait();
  ORACLE_STRIDE(i, n) out[i] = (double)oracle_to_bf16(x[i]);
}

// The emulation's product, `rows` x `cols` summed in f64, rounded once to f32 into rows `ld`
// apart.
extern "C" __global__ void oracle_narrow_rows_f64(const double* x, float* out, int rows, int cols,
                                                  long long ld) {
  pdl_wait();
  ORACLE_STRIDE(i, (long long)rows * cols) out[i / cols * ld + i % cols] = (float)x[i];
}

extern "C" __global__ void oracle_narrow_f64(const double* x, float* out, long long n) {
  pdl_wait();
  ORACLE_STRIDE(i, n) out[i] = (float)x[i];
}

// Blame by replay's attention (`attend_group` in src/engine/oracle.rs, called from
// src/compare/judge/replay.rs): one block of 128 threads per (query row, head), the host's f64
// operations in the host's order, each product and sum rounded on its own (no contraction into
// FMAs), so each output is the host's but where this exp rounds otherwise than the host's in
// its last bit. q: rows x heads x hd; k, v: keys x kvh x hd from position `lo`; vsq, vmx
// (keys x kvh): each key's Σv² and max|v| over its group's values; span: each row's first and
// last key position; probs: rows x heads x keys doubles of scratch. Out: out (rows x heads x hd,
// rounded to f32 once), natural and spread (rows x heads): the host's natural scale and Σ p·Σv².
extern "C" __global__ void oracle_replay_attend(const float* q, const float* k, const float* v,
                                                const double* vsq, const double* vmx,
                                                const int* span, double* probs, float* out,
                                                double* natural, double* spread, int heads,
                                                int kvh, int hd, int keys, int lo) {
  pdl_wait();
  extern __shared__ double qs[];
  __shared__ double red_m[128];
  __shared__ double red_s[128];
  __shared__ double total;
  int r = blockIdx.x / heads, h = blockIdx.x % heads;
  int g = h / (heads / kvh);
  int first = span[2 * r], last = span[2 * r + 1];
  const float* qv = q + ((long long)r * heads + h) * hd;
  for (int d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = (double)qv[d];
  __syncthreads();
  double* p = probs + ((long long)r * heads + h) * keys - lo;
  double scale = 1.0 / sqrt((double)hd);
  int full = hd / 8 * 8;
  double m = (double)NEG_INF, smax = 0.0;
  for (int j = first + threadIdx.x; j <= last; j += blockDim.x) {
    const float* kj = k + ((long long)(j - lo) * kvh + g) * hd;
    double acc[8];
    for (int i = 0; i < 8; i++) acc[i] = 0.0;
    for (int c = 0; c < full; c += 8)
      for (int i = 0; i < 8; i++) acc[i] = __dadd_rn(acc[i], __dmul_rn(qs[c + i], (double)kj[c + i]));
    double tail = -0.0;
    for (int i = full; i < hd; i++) tail = __dadd_rn(tail, __dmul_rn(qs[i], (double)kj[i]));
    double s = -0.0;
    for (int i = 0; i < 8; i++) s = __dadd_rn(s, acc[i]);
    s = __dmul_rn(__dadd_rn(s, tail), scale);
    p[j] = s;
    m = fmax(m, s);
    smax = fmax(smax, fabs(s));
  }
  red_m[threadIdx.x] = m;
  red_s[threadIdx.x] = smax;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) {
      red_m[threadIdx.x] = fmax(red_m[threadIdx.x], red_m[threadIdx.x + w]);
      red_s[threadIdx.x] = fmax(red_s[threadIdx.x], red_s[threadIdx.x + w]);
    }
    __syncthreads();
  }
  m = red_m[0];
  smax = red_s[0];
  for (int j = first + threadIdx.x; j <= last; j += blockDim.x) p[j] = exp(__dsub_rn(p[j], m));
  __syncthreads();
  if (threadIdx.x == 0) {
    double sum = -0.0;
    for (int j = first; j <= last; j++) sum = __dadd_rn(sum, p[j]);
    total = sum;
  }
  __syncthreads();
  for (int j = first + threadIdx.x; j <= last; j += blockDim.x) p[j] = __ddiv_rn(p[j], total);
  __syncthreads();
  long long o = (long long)r * heads + h;
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    double acc = 0.0;
    for (int j = first; j <= last; j++)
      acc = __dadd_rn(acc, __dmul_rn(p[j], (double)v[((long long)(j - lo) * kvh + g) * hd + d]));
    out[o * hd + d] = __double2float_rn(acc);
  }
  if (threadIdx.x == 0) {
    double p2 = 0.0, sp = 0.0, vmax = 0.0;
    for (int j = first; j <= last; j++) {
      long long at = (long long)(j - lo) * kvh + g;
      vmax = fmax(vmax, vmx[at]);
      p2 = __dadd_rn(p2, __dmul_rn(p[j], p[j]));
      sp = __dadd_rn(sp, __dmul_rn(p[j], vsq[at]));
    }
    natural[o] = __dmul_rn(vmax, __dadd_rn(1.0, __dmul_rn(smax, sqrt(p2))));
    spread[o] = sp;
  }
}

// Measures a pass against the oracle's taps kept on the GPU, as the host's noise meter does:
// per token (one block), `max|x - o| / max|o|` over its `rpt` rows of `width` values (`x` rows
// `stride` apart, `o` rows contiguous), and the largest over tokens into `*err` (non-negative
// floats order as their bits). A non-finite value on either side sets `*bad` to the smallest
// such token.
extern "C" __global__ void oracle_meter_f32(const float* x, int stride, int rpt, int width,
                                            const float* o, float* err, int* bad) {
  pdl_wait();
  __shared__ float dmax[256];
  __shared__ float omax[256];
  __shared__ int nonfinite;
  int t = blockIdx.x;
  if (threadIdx.x == 0) nonfinite = 0;
  __syncthreads();
  float dm = 0.0f, om = 0.0f;
  long long len = (long long)rpt * width;
  for (long long i = threadIdx.x; i < len; i += blockDim.x) {
    long long r = i / width, j = i % width;
    float a = x[((long long)t * rpt + r) * stride + j];
    float b = o[(long long)t * len + i];
    if (!isfinite(a) || !isfinite(b)) nonfinite = 1;
    dm = fmaxf(dm, fabsf(a - b));
    om = fmaxf(om, fabsf(b));
  }
  dmax[threadIdx.x] = dm;
  omax[threadIdx.x] = om;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) {
      dmax[threadIdx.x] = fmaxf(dmax[threadIdx.x], dmax[threadIdx.x + w]);
      omax[threadIdx.x] = fmaxf(omax[threadIdx.x], omax[threadIdx.x + w]);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    if (nonfinite) {
      atomicMin(bad, t);
    } else if (omax[0] > 0.0f) {
      atomicMax((int*)err, __float_as_int(dmax[0] / omax[0]));
    }
  }
}
