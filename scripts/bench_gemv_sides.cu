// Decode GEMVs for several sides (caches) at once: kvdiff's kernels (kernels/gemv.cu: a tile of
// 8 rows a block, k split over its warps, each slice summed on the tensor cores) against the
// kernels they replaced (a warp per row, every side dotted on the FP32 pipes), at a model's
// shapes; whether each side keeps the single kernel's bits, and how far both kernels' outputs
// are apart (the same sums in another order). Built and run by scripts/bench_gemv_sides.sh:
//   nvcc -O3 -arch=sm_90 [-DMAX_SIDES=N] -o /tmp/bench_gemv_sides scripts/bench_gemv_sides.cu
//   /tmp/bench_gemv_sides [hidden inter vocab q_dim kv_dim]   (default: Qwen3-8B's shape)
#ifndef MAX_SIDES
#define MAX_SIDES 5
#endif
#include "../kernels/common.cuh"
#include "../kernels/gemv.cu"

#include <cmath>
#include <cstring>
#include "bench_common.cuh"

// The kernels before: a warp per row, lane l dotting vectors l, l + 32, ... of the row with
// every side's input into four accumulators, then the warp's butterfly.
namespace before {
__device__ __forceinline__ float dot8_fp32(uint4 a, uint4 b) {
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

__device__ __forceinline__ void add_at(float* a, int j, float d) {
    if ((j & 3) == 0) a[0] += d;
    else if ((j & 3) == 1) a[1] += d;
    else if ((j & 3) == 2) a[2] += d;
    else a[3] += d;
}

template <int S>
__global__ void gemv_sides(Sides x, const bf16_t* __restrict__ w, Sides y, int k, int m) {
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= m) return;
    const uint4* wr = (const uint4*)(w + (size_t)row * k);
    int vecs = k >> 3;
    const uint4* xv[S];
#pragma unroll
    for (int s = 0; s < S; s++) xv[s] = at_side<const uint4>(x, s);
    float a[S][4];
#pragma unroll
    for (int s = 0; s < S; s++) a[s][0] = a[s][1] = a[s][2] = a[s][3] = 0.0f;
    int i = threadIdx.x & 31;
    for (; i + 96 < vecs; i += 128) {
        uint4 w0 = ld_stream(wr + i), w1 = ld_stream(wr + i + 32);
        uint4 w2 = ld_stream(wr + i + 64), w3 = ld_stream(wr + i + 96);
#pragma unroll
        for (int s = 0; s < S; s++) {
            a[s][0] += dot8_fp32(w0, xv[s][i]);
            a[s][1] += dot8_fp32(w1, xv[s][i + 32]);
            a[s][2] += dot8_fp32(w2, xv[s][i + 64]);
            a[s][3] += dot8_fp32(w3, xv[s][i + 96]);
        }
    }
    for (int j = 0; i < vecs; i += 32, j++) {
        uint4 wv = ld_stream(wr + i);
#pragma unroll
        for (int s = 0; s < S; s++) add_at(a[s], j, dot8_fp32(wv, xv[s][i]));
    }
    float out[S];
#pragma unroll
    for (int s = 0; s < S; s++) out[s] = (a[s][0] + a[s][1]) + (a[s][2] + a[s][3]);
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int s = 0; s < S; s++) out[s] += __shfl_xor_sync(0xffffffffu, out[s], o);
    if ((threadIdx.x & 31) == 0)
#pragma unroll
        for (int s = 0; s < S; s++) at_side<float>(y, s)[row] = out[s];
}
}  // namespace before

struct Shape {
    const char* name;
    int k, m;
};

typedef void (*Launch)(Sides, const bf16_t*, Sides, int, int, int);

// kvdiff's single kernel once per side.
void run_single(Sides x, const bf16_t* w, Sides y, int k, int m, int sides) {
    for (int s = 0; s < sides; s++)
        gemv_bf16<<<(m + 7) / 8, 256>>>((const bf16_t*)x.p[s], w, (float*)y.p[s], k, m);
}
// kvdiff's `_sides` kernel.
void run_sides(Sides x, const bf16_t* w, Sides y, int k, int m, int sides) {
    gemv_bf16_sides<<<(m + 7) / 8, 256>>>(x, w, y, k, m, sides);
}
template <int S>
void run_before(Sides x, const bf16_t* w, Sides y, int k, int m, int) {
    before::gemv_sides<S><<<(m + 7) / 8, 256>>>(x, w, y, k, m);
}
static Launch before_by_sides(int s) {
    switch (s) {
        case 1: return run_before<1>;
        case 2: return run_before<2>;
        case 3: return run_before<3>;
        case 5: return run_before<5>;
        case 8: return run_before<8>;
        case 10: return run_before<10>;
        case 16: return run_before<16>;
    }
    return nullptr;
}

static const int side_counts[] = {1, 2, 3, 5, 8, 10, 16};

int main(int argc, char** argv) {
    int hidden = 4096, inter = 12288, vocab = 151936, qd = 4096, kvd = 1024;
    if (argc == 6) {
        hidden = atoi(argv[1]); inter = atoi(argv[2]); vocab = atoi(argv[3]);
        qd = atoi(argv[4]); kvd = atoi(argv[5]);
    }
    // The last shape checks the edges: k not a multiple of 32, m not of 8.
    Shape shapes[] = {{"qkv", hidden, qd + 2 * kvd},
                      {"o_proj", qd, hidden},
                      {"gate_up", hidden, 2 * inter},
                      {"down", inter, hidden},
                      {"lm_head", hidden, vocab},
                      {"edges", 1000, 1001}};
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    size_t biggest = 0;
    for (auto& s : shapes) biggest = std::max(biggest, (size_t)s.k * s.m);
    // Weights, several copies' worth: launches rotate through them past L2.
    size_t pool_bytes = std::max(biggest * 2 * 3, (size_t)1 << 30);
    bf16_t* pool;
    CHECK(cudaMalloc(&pool, pool_bytes));
    {
        std::vector<bf16_t> h(pool_bytes / 2);
        unsigned int st = 12345;
        for (auto& v : h) {
            st = st * 1664525u + 1013904223u;
            // Random sign and mantissa, exponents 2^-10 .. 2^-3: sums that round, so that
            // another order shows in the bits.
            v = (bf16_t)(((st >> 16) & 0x807f) | ((117 + ((st >> 8) & 7)) << 7));
        }
        CHECK(cudaMemcpy(pool, h.data(), pool_bytes, cudaMemcpyHostToDevice));
    }
    int kmax = std::max(hidden, std::max(inter, qd)), mmax = std::max(vocab, 2 * inter);
    Sides x, y, yref;
    for (int s = 0; s < MAX_SIDES; s++) {
        std::vector<bf16_t> h(kmax);
        unsigned int st = 777 + s;
        for (auto& v : h) {
            st = st * 1664525u + 1013904223u;
            v = (bf16_t)(((st >> 16) & 0x807f) | ((120 + ((st >> 8) & 7)) << 7));
        }
        void* p;
        CHECK(cudaMalloc(&p, kmax * 2));
        CHECK(cudaMemcpy(p, h.data(), kmax * 2, cudaMemcpyHostToDevice));
        x.p[s] = (unsigned long long)p;
        CHECK(cudaMalloc(&p, mmax * 4));
        y.p[s] = (unsigned long long)p;
        CHECK(cudaMalloc(&p, mmax * 4));
        yref.p[s] = (unsigned long long)p;
    }
    printf("%s, %d SMs, MAX_SIDES %d; shapes hidden %d inter %d vocab %d q %d kv %d\n", prop.name,
           prop.multiProcessorCount, MAX_SIDES, hidden, inter, vocab, qd, kvd);
    printf("%-8s %-8s %5s %10s %10s %8s %-6s %s\n", "shape", "kernel", "sides", "us", "us/side",
           "GB/s", "bits", "max |new - before| / max |before|");
    for (auto& sh : shapes) {
        size_t wbytes = (size_t)sh.k * sh.m * 2;
        int copies = (int)(pool_bytes / wbytes);
        // The single kernel's outputs, every side: the bits each side must keep.
        for (int s = 0; s < MAX_SIDES; s++)
            gemv_bf16<<<(sh.m + 7) / 8, 256>>>((const bf16_t*)x.p[s], pool, (float*)yref.p[s],
                                               sh.k, sh.m);
        CHECK(cudaDeviceSynchronize());
        std::vector<float> ref((size_t)sh.m), got((size_t)sh.m);
        for (int sides : side_counts) {
            if (sides > MAX_SIDES) continue;
            Launch ls[3] = {run_single, run_sides, before_by_sides(sides)};
            const char* names[3] = {"single", "sides", "before"};
            for (int v = 0; v < 3; v++) {
                if (!ls[v] || (v == 1 && sides == 1)) continue;
                for (int s = 0; s < sides; s++) CHECK(cudaMemset((void*)y.p[s], 0xff, sh.m * 4));
                ls[v](x, pool, y, sh.k, sh.m, sides);
                CHECK(cudaGetLastError());
                CHECK(cudaDeviceSynchronize());
                bool same = true;
                double diff = 0, scale = 0;
                for (int s = 0; s < sides; s++) {
                    CHECK(cudaMemcpy(ref.data(), (void*)yref.p[s], sh.m * 4, cudaMemcpyDeviceToHost));
                    CHECK(cudaMemcpy(got.data(), (void*)y.p[s], sh.m * 4, cudaMemcpyDeviceToHost));
                    for (int i = 0; i < sh.m; i++) {
                        same = same && memcmp(&ref[i], &got[i], 4) == 0;
                        diff = std::max(diff, (double)std::fabs(ref[i] - got[i]));
                        scale = std::max(scale, (double)std::fabs(got[i]));
                    }
                }
                float us = median_us(30, [&](int it) {
                    ls[v](x, pool + (size_t)(it % copies) * sh.k * sh.m, y, sh.k, sh.m, sides);
                });
                printf("%-8s %-8s %5d %10.1f %10.1f %8.0f %-6s %.2e\n", sh.name, names[v], sides, us,
                       us / sides, wbytes / us / 1e3, v == 2 ? "-" : same ? "same" : "DIFFER",
                       v == 2 ? diff / std::max(scale, 1e-30) : 0.0);
            }
        }
    }
    return 0;
}
