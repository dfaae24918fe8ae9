// The noise model's oracle on the GPU (src/cuda/oracle.rs): the standard prefill recomputed in
// f64, and the same pass in f32 with bf16-rounded matmul inputs (the emulation of a bf16
// backend's rounding). Written apart from the engine's kernels, with nothing in common with
// them: plain loops, one fixed order per sum, no tiling, no tensor cores, no fusion. Matrix
// products go to cuBLAS (DGEMM; SGEMM with TF32 off for the plain f32 pass), not to
// kernels/gemm.cu: the emulation's are DGEMMs of its bf16-rounded operands, rounded once to f32.
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
