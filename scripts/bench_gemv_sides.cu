// Decode GEMVs for several sides (caches) at once: how each way of reading the weights scales
// with the number of sides, at a model's shapes, and whether every side keeps the single
// kernel's bits. Built and run by scripts/bench_gemv_sides.sh (nvcc, one GPU):
//   nvcc -O3 -arch=sm_90 -o /tmp/bench_gemv_sides scripts/bench_gemv_sides.cu
//   /tmp/bench_gemv_sides [hidden inter vocab q_dim kv_dim]   (default: Qwen3-8B's shape)
#define MAX_SIDES 16
#include "../kernels/common.cuh"
#include "../kernels/gemv.cu"

#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>

#include "bench_common.cuh"

// One block of the single kernel per side, interleaved (the `_sides` layer kernels before:
// they counted on L2 to serve a row to the sides after the first).
template <int S>
__global__ void interleaved(Sides x, const bf16_t* __restrict__ w, Sides y, int k, int m) {
    int s = blockIdx.x % S;
    int row = blockIdx.x / S * (blockDim.x >> 5) + (threadIdx.x >> 5);
    Row<4> r;
    if (row < m) r.load(w + (size_t)row * k, k);
    if (row >= m) return;
    float acc = r.dot(at_side<const bf16_t>(x, s));
    if ((threadIdx.x & 31) == 0) at_side<float>(y, s)[row] = acc;
}

// The `_sides` kernels' dot before Streamed: a Row<4> (its first 128 vectors preloaded into
// registers, the rest prefetched into L2), then every side's input dotted with it in Row::dot's
// order.
template <int S>
__device__ __forceinline__ void preloaded_dot_sides(const Row<4>& r, const bf16_t* const* xs,
                                                    float* out) {
    const uint4* xv[S];
#pragma unroll
    for (int s = 0; s < S; s++) xv[s] = (const uint4*)xs[s];
    int lane = threadIdx.x & 31;
    float a[S][4];
#pragma unroll
    for (int s = 0; s < S; s++) a[s][0] = a[s][1] = a[s][2] = a[s][3] = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; j++)
        if (lane + 32 * j < r.vecs)
#pragma unroll
            for (int s = 0; s < S; s++) a[s][j & 3] += dot8_bf16(r.w[j], xv[s][lane + 32 * j]);
    int i = lane + 128;
    for (; i + 96 < r.vecs; i += 128) {
        uint4 w0 = ld_stream(r.wr + i), w1 = ld_stream(r.wr + i + 32);
        uint4 w2 = ld_stream(r.wr + i + 64), w3 = ld_stream(r.wr + i + 96);
#pragma unroll
        for (int s = 0; s < S; s++) {
            a[s][0] += dot8_bf16(w0, xv[s][i]);
            a[s][1] += dot8_bf16(w1, xv[s][i + 32]);
            a[s][2] += dot8_bf16(w2, xv[s][i + 64]);
            a[s][3] += dot8_bf16(w3, xv[s][i + 96]);
        }
    }
    for (int j = 0; i < r.vecs; i += 32, j++) {
        uint4 wv = ld_stream(r.wr + i);
#pragma unroll
        for (int s = 0; s < S; s++) add_at(a[s], j, dot8_bf16(wv, xv[s][i]));
    }
#pragma unroll
    for (int s = 0; s < S; s++) out[s] = (a[s][0] + a[s][1]) + (a[s][2] + a[s][3]);
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int s = 0; s < S; s++) out[s] += __shfl_xor_sync(0xffffffffu, out[s], o);
}

// A warp per row for exactly S sides: the preloaded row (PRELOADED) or Streamed, the shipped one.
template <int S, bool PRELOADED>
__global__ void once_row(Sides x, const bf16_t* __restrict__ w, Sides y, int k, int m) {
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= m) return;
    const bf16_t* xs[S];
    float acc[S];
#pragma unroll
    for (int s = 0; s < S; s++) xs[s] = at_side<const bf16_t>(x, s);
    if (PRELOADED) {
        Row<4> r;
        r.load(w + (size_t)row * k, k);
        preloaded_dot_sides<S>(r, xs, acc);
    } else {
        Streamed r;
        r.load(w + (size_t)row * k, k);
        r.dot_sides<S>(xs, acc);
    }
    if ((threadIdx.x & 31) == 0)
#pragma unroll
        for (int s = 0; s < S; s++) at_side<float>(y, s)[row] = acc[s];
}

// dot_sides' order (lane l: vectors l, l + 32, ... into accumulator t & 3, then the pairs,
// then the butterfly) with the inputs at `xs` (global or shared) and weights streamed past L1.
// R rows a warp: each input vector is read once for the R rows.
template <int S, int R>
__device__ __forceinline__ void dot_rows(const uint4* const* wr, int vecs,
                                         const bf16_t* const* xs, float (*out)[S]) {
    int lane = threadIdx.x & 31;
    float a[R][S][4];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int s = 0; s < S; s++) a[r][s][0] = a[r][s][1] = a[r][s][2] = a[r][s][3] = 0.0f;
    int i = lane;
    for (; i + 96 < vecs; i += 128) {
        uint4 wv[R][4];
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int j = 0; j < 4; j++) wv[r][j] = ld_stream(wr[r] + i + 32 * j);
#pragma unroll
        for (int s = 0; s < S; s++) {
            const uint4* xv = (const uint4*)xs[s];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                uint4 xx = xv[i + 32 * j];
#pragma unroll
                for (int r = 0; r < R; r++) a[r][s][j] += dot8_bf16(wv[r][j], xx);
            }
        }
    }
    for (int j = 0; i < vecs; i += 32, j++) {
        uint4 wv[R];
#pragma unroll
        for (int r = 0; r < R; r++) wv[r] = ld_stream(wr[r] + i);
#pragma unroll
        for (int s = 0; s < S; s++) {
            uint4 xx = ((const uint4*)xs[s])[i];
#pragma unroll
            for (int r = 0; r < R; r++) {
                float d = dot8_bf16(wv[r], xx);
                // j & 3 at run time would move `a` to local memory.
                if ((j & 3) == 0) a[r][s][0] += d;
                else if ((j & 3) == 1) a[r][s][1] += d;
                else if ((j & 3) == 2) a[r][s][2] += d;
                else a[r][s][3] += d;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int s = 0; s < S; s++) out[r][s] = (a[r][s][0] + a[r][s][1]) + (a[r][s][2] + a[r][s][3]);
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int s = 0; s < S; s++) out[r][s] += __shfl_xor_sync(0xffffffffu, out[r][s], o);
}

// Rows read once past L1, inputs from global (L1-resident). Warp w of block b: rows
// (b * warps + w) * R .. + R.
template <int S, int R>
__global__ void once_stream(Sides x, const bf16_t* __restrict__ w, Sides y, int k, int m) {
    int row0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * R;
    if (row0 >= m) return;
    const uint4* wr[R];
#pragma unroll
    for (int r = 0; r < R; r++) wr[r] = (const uint4*)(w + (size_t)min(row0 + r, m - 1) * k);
    const bf16_t* xs[S];
#pragma unroll
    for (int s = 0; s < S; s++) xs[s] = at_side<const bf16_t>(x, s);
    float acc[R][S];
    dot_rows<S, R>(wr, k >> 3, xs, acc);
    if ((threadIdx.x & 31) == 0)
#pragma unroll
        for (int r = 0; r < R; r++)
            if (row0 + r < m)
#pragma unroll
                for (int s = 0; s < S; s++) at_side<float>(y, s)[row0 + r] = acc[r][s];
}

// The same with every side's input staged in shared memory once per block, the grid
// persistent (a block walks rows until the matrix is done).
template <int S, int R>
__global__ void once_shared(Sides x, const bf16_t* __restrict__ w, Sides y, int k, int m) {
    extern __shared__ __align__(16) bf16_t xsh[];
    for (int s = 0; s < S; s++) {
        const uint4* src = (const uint4*)at_side<const bf16_t>(x, s);
        uint4* dst = (uint4*)(xsh + (size_t)s * k);
        for (int i = threadIdx.x; i < (k >> 3); i += blockDim.x) dst[i] = src[i];
    }
    __syncthreads();
    const bf16_t* xs[S];
#pragma unroll
    for (int s = 0; s < S; s++) xs[s] = xsh + (size_t)s * k;
    int warps = blockDim.x >> 5;
    for (int row0 = (blockIdx.x * warps + (threadIdx.x >> 5)) * R; row0 < m;
         row0 += gridDim.x * warps * R) {
        const uint4* wr[R];
#pragma unroll
        for (int r = 0; r < R; r++) wr[r] = (const uint4*)(w + (size_t)min(row0 + r, m - 1) * k);
        float acc[R][S];
        dot_rows<S, R>(wr, k >> 3, xs, acc);
        if ((threadIdx.x & 31) == 0)
#pragma unroll
            for (int r = 0; r < R; r++)
                if (row0 + r < m)
#pragma unroll
                    for (int s = 0; s < S; s++) at_side<float>(y, s)[row0 + r] = acc[r][s];
    }
}

// Streamed::dot_sides with every side's input widened to f32 beforehand (exactly: bf16 values), so
// the inner loop has no unpacking of x: the same products in the same order, two 16-byte
// loads of x instead of one and eight shifts or masks.
__device__ __forceinline__ float dot8_f32x(uint4 w, float4 x0, float4 x1) {
    float acc = 0.0f;
    acc += __uint_as_float(w.x << 16) * x0.x;
    acc += __uint_as_float(w.x & 0xffff0000u) * x0.y;
    acc += __uint_as_float(w.y << 16) * x0.z;
    acc += __uint_as_float(w.y & 0xffff0000u) * x0.w;
    acc += __uint_as_float(w.z << 16) * x1.x;
    acc += __uint_as_float(w.z & 0xffff0000u) * x1.y;
    acc += __uint_as_float(w.w << 16) * x1.z;
    acc += __uint_as_float(w.w & 0xffff0000u) * x1.w;
    return acc;
}

template <int S>
__global__ void once_f32x(Sides xf, const bf16_t* __restrict__ w, Sides y, int k, int m) {
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= m) return;
    const uint4* wr = (const uint4*)(w + (size_t)row * k);
    int vecs = k >> 3, lane = threadIdx.x & 31;
    const float4* xv[S];
#pragma unroll
    for (int s = 0; s < S; s++) xv[s] = at_side<const float4>(xf, s);
    float a[S][4];
#pragma unroll
    for (int s = 0; s < S; s++) a[s][0] = a[s][1] = a[s][2] = a[s][3] = 0.0f;
    int i = lane;
    for (; i + 96 < vecs; i += 128) {
        uint4 w0 = ld_stream(wr + i), w1 = ld_stream(wr + i + 32);
        uint4 w2 = ld_stream(wr + i + 64), w3 = ld_stream(wr + i + 96);
#pragma unroll
        for (int s = 0; s < S; s++) {
            a[s][0] += dot8_f32x(w0, xv[s][2 * i], xv[s][2 * i + 1]);
            a[s][1] += dot8_f32x(w1, xv[s][2 * i + 64], xv[s][2 * i + 65]);
            a[s][2] += dot8_f32x(w2, xv[s][2 * i + 128], xv[s][2 * i + 129]);
            a[s][3] += dot8_f32x(w3, xv[s][2 * i + 192], xv[s][2 * i + 193]);
        }
    }
    for (int j = 0; i < vecs; i += 32, j++) {
        uint4 wv = ld_stream(wr + i);
#pragma unroll
        for (int s = 0; s < S; s++) add_at(a[s], j, dot8_f32x(wv, xv[s][2 * i], xv[s][2 * i + 1]));
    }
    float out[S];
#pragma unroll
    for (int s = 0; s < S; s++) out[s] = (a[s][0] + a[s][1]) + (a[s][2] + a[s][3]);
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int s = 0; s < S; s++) out[s] += __shfl_xor_sync(0xffffffffu, out[s], o);
    if (lane == 0)
#pragma unroll
        for (int s = 0; s < S; s++) at_side<float>(y, s)[row] = out[s];
}

__global__ void widen(const bf16_t* x, float* xf, int k) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < k; i += gridDim.x * blockDim.x)
        xf[i] = bf16_to_f32(x[i]);
}

static Sides xf_sides;  // every side's input widened to f32

struct Shape {
    const char* name;
    int k, m;
};

static int sms;
static size_t pool_bytes;
static bf16_t* pool;  // weights, several copies' worth: launches rotate through it past L2

typedef void (*Launch)(Sides, const bf16_t*, Sides, int, int, int);

template <int S>
void run_interleaved(Sides x, const bf16_t* w, Sides y, int k, int m, int) {
    interleaved<S><<<(m + 7) / 8 * S, 256>>>(x, w, y, k, m);
}
template <int S, bool PRELOADED>
void run_row(Sides x, const bf16_t* w, Sides y, int k, int m, int) {
    once_row<S, PRELOADED><<<(m + 7) / 8, 256>>>(x, w, y, k, m);
}
// kvdiff's own `_sides` kernel (side counts padded to those it is compiled for).
void run_shipped(Sides x, const bf16_t* w, Sides y, int k, int m, int sides) {
    gemv_bf16_sides<<<(m + 7) / 8, 256>>>(x, w, y, k, m, sides);
}
template <int S, int R>
void run_stream(Sides x, const bf16_t* w, Sides y, int k, int m, int) {
    once_stream<S, R><<<(m + 8 * R - 1) / (8 * R), 256>>>(x, w, y, k, m);
}
template <int S, int R>
void run_shared(Sides x, const bf16_t* w, Sides y, int k, int m, int) {
    size_t sh = (size_t)S * k * 2;
    CHECK(cudaFuncSetAttribute(once_shared<S, R>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               (int)sh));
    int per_sm = 0;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, once_shared<S, R>, 256, sh));
    int rows = (m + 8 * R - 1) / (8 * R);
    int grid = std::min(rows, std::max(per_sm, 1) * sms);
    once_shared<S, R><<<grid, 256, sh>>>(x, w, y, k, m);
}
template <int S>
void run_f32x(Sides, const bf16_t* w, Sides y, int k, int m, int) {
    once_f32x<S><<<(m + 7) / 8, 256>>>(xf_sides, w, y, k, m);
}
// The single kernel once per side.
void run_single(Sides x, const bf16_t* w, Sides y, int k, int m, int sides) {
    for (int s = 0; s < sides; s++)
        gemv_bf16<<<(m + 7) / 8, 256>>>((const bf16_t*)x.p[s], w, (float*)y.p[s], k, m);
}

struct Variant {
    const char* name;
    Launch f[17];  // by side count
};

#define SIDES_TABLE(mk) {nullptr, mk(1), mk(2), mk(3), mk(4), mk(5), nullptr, nullptr, mk(8), nullptr, mk(10), nullptr, nullptr, nullptr, nullptr, nullptr, nullptr}
#define MK_INTER(s) run_interleaved<s>
#define MK_PRELOADED(s) run_row<s, true>
#define MK_STREAMED(s) run_row<s, false>
#define MK_SHIPPED(s) run_shipped
#define MK_STREAM2(s) run_stream<s, 2>
#define MK_SHARED1(s) run_shared<s, 1>
#define MK_F32X(s) run_f32x<s>

static const int side_counts[] = {1, 2, 3, 5, 10};

int main(int argc, char** argv) {
    int hidden = 4096, inter = 12288, vocab = 151936, qd = 4096, kvd = 1024;
    if (argc == 6) {
        hidden = atoi(argv[1]); inter = atoi(argv[2]); vocab = atoi(argv[3]);
        qd = atoi(argv[4]); kvd = atoi(argv[5]);
    }
    Shape shapes[] = {{"qkv", hidden, qd + 2 * kvd},
                      {"o_proj", qd, hidden},
                      {"gate_up", hidden, 2 * inter},
                      {"down", inter, hidden},
                      {"lm_head", hidden, vocab}};
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    sms = prop.multiProcessorCount;
    size_t biggest = 0;
    for (auto& s : shapes) biggest = std::max(biggest, (size_t)s.k * s.m);
    pool_bytes = std::max(biggest * 2 * 3, (size_t)1 << 30);
    CHECK(cudaMalloc(&pool, pool_bytes));
    {
        std::vector<bf16_t> h(pool_bytes / 2);
        unsigned int st = 12345;
        for (auto& v : h) {
            st = st * 1664525u + 1013904223u;
            // Small normals-ish: exponent around 2^-6, random mantissa and sign.
            v = (bf16_t)((st >> 16) & 0x807f) | (bf16_t)(0x3c00);
        }
        CHECK(cudaMemcpy(pool, h.data(), pool_bytes, cudaMemcpyHostToDevice));
    }
    int kmax = std::max(hidden, std::max(inter, qd)), mmax = std::max(vocab, 2 * inter);
    Sides x, y, yref;
    for (int s = 0; s < 16; s++) {
        std::vector<bf16_t> h(kmax);
        unsigned int st = 777 + s;
        for (auto& v : h) {
            st = st * 1664525u + 1013904223u;
            v = (bf16_t)((st >> 16) & 0x807f) | (bf16_t)(0x3f00);
        }
        void* p;
        CHECK(cudaMalloc(&p, kmax * 2));
        CHECK(cudaMemcpy(p, h.data(), kmax * 2, cudaMemcpyHostToDevice));
        x.p[s] = (unsigned long long)p;
        CHECK(cudaMalloc(&p, kmax * 4));
        widen<<<64, 256>>>((const bf16_t*)x.p[s], (float*)p, kmax);
        xf_sides.p[s] = (unsigned long long)p;
        CHECK(cudaMalloc(&p, mmax * 4));
        y.p[s] = (unsigned long long)p;
        CHECK(cudaMalloc(&p, mmax * 4));
        yref.p[s] = (unsigned long long)p;
    }
    Variant variants[] = {
        {"interleaved", SIDES_TABLE(MK_INTER)},
        {"gemv_sides", SIDES_TABLE(MK_SHIPPED)},
        {"row_preloaded", SIDES_TABLE(MK_PRELOADED)},
        {"streamed", SIDES_TABLE(MK_STREAMED)},
        {"once_stream2", SIDES_TABLE(MK_STREAM2)},
        {"once_shared", SIDES_TABLE(MK_SHARED1)},
        {"f32_inputs", SIDES_TABLE(MK_F32X)},
    };
    printf("%s, %d SMs; shapes hidden %d inter %d vocab %d q %d kv %d\n", prop.name, sms, hidden,
           inter, vocab, qd, kvd);
    printf("%-8s %-13s %5s %10s %10s %8s %s\n", "shape", "variant", "sides", "us", "us/side",
           "GB/s", "bits");
    for (auto& sh : shapes) {
        size_t wbytes = (size_t)sh.k * sh.m * 2;
        int copies = (int)(pool_bytes / wbytes);
        // Reference: the single kernel on copy 0.
        for (int s = 0; s < 16; s++)
            gemv_bf16<<<(sh.m + 7) / 8, 256>>>((const bf16_t*)x.p[s], pool, (float*)yref.p[s],
                                               sh.k, sh.m);
        CHECK(cudaDeviceSynchronize());
        std::vector<unsigned int> ref((size_t)sh.m), got((size_t)sh.m);
        for (int sides : side_counts) {
            for (int vi = -1; vi < (int)(sizeof(variants) / sizeof(variants[0])); vi++) {
                Launch f = vi < 0 ? run_single : variants[vi].f[sides];
                const char* name = vi < 0 ? "single" : variants[vi].name;
                if (!f) continue;
                if (vi == 5 && (size_t)sides * sh.k * 2 > (size_t)prop.sharedMemPerBlockOptin)
                    continue;
                for (int s = 0; s < sides; s++) CHECK(cudaMemset((void*)y.p[s], 0xff, sh.m * 4));
                f(x, pool, y, sh.k, sh.m, sides);
                CHECK(cudaGetLastError());
                CHECK(cudaDeviceSynchronize());
                bool same = true;
                for (int s = 0; s < sides && same; s++) {
                    CHECK(cudaMemcpy(ref.data(), (void*)yref.p[s], sh.m * 4, cudaMemcpyDeviceToHost));
                    CHECK(cudaMemcpy(got.data(), (void*)y.p[s], sh.m * 4, cudaMemcpyDeviceToHost));
                    same = ref == got;
                }
                float us = median_us(30, [&](int it) {
                    f(x, pool + (size_t)(it % copies) * sh.k * sh.m, y, sh.k, sh.m, sides);
                });
                printf("%-8s %-13s %5d %10.1f %10.1f %8.0f %s\n", sh.name, name, sides, us,
                       us / sides, wbytes / us / 1e3, same ? "same" : "DIFFER");
            }
        }
    }
    return 0;
}
