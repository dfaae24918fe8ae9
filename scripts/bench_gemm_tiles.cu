// Prefill GEMM tiles (kernels/gemm.cu) at a model's shapes and the row counts a compare's paths
// prefill (chunks of 16 and 32 tokens, query chunks, whole prompts): time per tile shape and
// block order, weight GB/s, and whether each gives the large tile's bits (it must: every tile
// sums an output in one order). Built and run by scripts/bench_gemm_tiles.sh (nvcc, one GPU).
// L, M, S and T are the tiles kvdiff has; the others are candidates. (Blocks ordered so that
// consecutive ones share a slice of w, not of x, made no difference at these shapes.)
#define MAX_SIDES 2
#include "../kernels/common.cuh"
#include "../kernels/gemm.cu"
// BEFORE: a file holding an earlier gemm.cu's device functions (without its kernels), whose
// tiles are timed beside today's and must give their bits: e.g.
//   git show REV:kernels/gemm.cu | sed '/^#define GEMM_KERNEL/,$d' > /tmp/gemm_before.cuh
#ifdef BEFORE
namespace before {
#include BEFORE
}
#endif

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cuda_runtime.h>

#include "bench_common.cuh"

#ifdef BEFORE
template <int BM, int BN, int WM, int WN>
__global__ void __launch_bounds__(WM * WN * 32)
    tile_before(const bf16_t* x, const bf16_t* w, float* y, int n, int k, int m) {
#if __CUDA_ARCH__ >= 800
    before::gemm_tile<BM, BN, WM, WN, true>(x, w, y, n, k, m);
#endif
}
#endif

template <int BM, int BN, int WM, int WN, int BK, int STAGES>
__global__ void __launch_bounds__(WM * WN * 32)
    tile(const bf16_t* x, const bf16_t* w, float* y, int n, int k, int m) {
#if __CUDA_ARCH__ >= 800
    gemm_tile<BM, BN, WM, WN, true, BK, STAGES>(x, w, y, n, k, m);
#endif
}

struct Variant {
    const char* name;
    void (*f)(const bf16_t*, const bf16_t*, float*, int, int, int);
    int bm, bn, threads, shared;
    int max_n;  // timed only up to this many rows
};

template <int BM, int BN, int WM, int WN, int BK = GEMM_BK, int STAGES = GEMM_STAGES>
Variant variant(const char* name, int max_n = 1 << 30) {
    return {name, tile<BM, BN, WM, WN, BK, STAGES>, BM, BN, WM * WN * 32,
            STAGES * (BM + BN) * BK * 2, max_n};
}

int main(int argc, char** argv) {
    int hidden = argc > 1 ? atoi(argv[1]) : 4096, inter = argc > 2 ? atoi(argv[2]) : 12288;
    int qd = argc > 3 ? atoi(argv[3]) : 4096, kvd = argc > 4 ? atoi(argv[4]) : 1024;
    int shapes[][2] = {{hidden, qd + 2 * kvd}, {qd, hidden}, {hidden, 2 * inter}, {inter, hidden}};
    const char* names[] = {"qkv", "o_proj", "gate_up", "down"};
    int ns[] = {16, 32, 64, 160, 176, 368, 512, 2048};
    Variant vs[] = {
#ifdef BEFORE
        {"L before", tile_before<128, 128, 2, 4>, 128, 128, 256, 3 * 256 * 64 * 2, 1 << 30},
        {"M before", tile_before<64, 64, 2, 2>, 64, 64, 128, 3 * 128 * 64 * 2, 1 << 30},
        {"S before", tile_before<32, 32, 2, 2>, 32, 32, 128, 3 * 64 * 64 * 2, 1 << 30},
#endif
        variant<128, 128, 2, 4, 128, 2>("L"),
        variant<64, 64, 2, 2>("M"),
        variant<32, 32, 2, 2, 64, 4>("S"),
        variant<16, 32, 1, 2, 64, 6>("T", 32),
        // Candidates: deeper pipelines, longer runs of each weight row per step (BK), tiles
        // of a few rows (timed up to 32 or 64 rows).
        variant<32, 32, 2, 2, 64, 3>("32x32 s3", 64),
        variant<32, 32, 2, 2, 128, 4>("32x32 k128 s4", 64),
        variant<16, 64, 1, 4, 128, 4>("16x64 k128 s4", 32),
        variant<32, 64, 2, 2, 64, 4>("32x64 s4", 64),
        variant<64, 64, 2, 2, 64, 4>("64x64 s4"),
        variant<64, 64, 2, 2, 128, 3>("64x64 k128 s3"),
        variant<64, 128, 2, 4, 64, 3>("64x128"),
        variant<128, 128, 2, 4, 64, 3>("128x128 k64 s3"),
    };
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    size_t wmax = 0;
    for (auto& s : shapes) wmax = std::max(wmax, (size_t)s[0] * s[1]);
    int copies = 4;
    bf16_t *w, *x;
    float *y, *yref;
    CHECK(cudaMalloc(&w, wmax * 2 * copies));
    CHECK(cudaMalloc(&x, (size_t)2048 * 12288 * 2));
    CHECK(cudaMalloc(&y, (size_t)2048 * 24576 * 4));
    CHECK(cudaMalloc(&yref, (size_t)2048 * 24576 * 4));
    {
        std::vector<bf16_t> h(wmax * copies);
        unsigned st = 1;
        // Random signs, mantissas and exponents (2^-10 .. 2^-3): sums that round, so that
        // another order shows in the bits.
        for (auto& v : h) { st = st * 1664525u + 1013904223u; v = (bf16_t)(((st >> 16) & 0x807f) | ((117 + ((st >> 8) & 7)) << 7)); }
        CHECK(cudaMemcpy(w, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
        std::vector<bf16_t> hx((size_t)2048 * 12288);
        for (auto& v : hx) { st = st * 1664525u + 1013904223u; v = (bf16_t)(((st >> 16) & 0x807f) | ((120 + ((st >> 8) & 7)) << 7)); }
        CHECK(cudaMemcpy(x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
    }
    for (auto& v : vs)
        CHECK(cudaFuncSetAttribute(v.f, cudaFuncAttributeMaxDynamicSharedMemorySize, v.shared));
    printf("%s, %d SMs\n%-8s %5s %-15s %9s %7s %s\n", prop.name, prop.multiProcessorCount, "shape", "n",
           "tile", "us", "w GB/s", "bits");
    // BENCH_ONLY="down:16" times one shape at one row count (e.g. under Nsight Compute).
    const char* only = getenv("BENCH_ONLY");
    for (int si = 0; si < 4; si++) {
        int k = shapes[si][0], m = shapes[si][1];
        for (int n : ns) {
            char key[64];
            snprintf(key, sizeof key, "%s:%d", names[si], n);
            if (only && strcmp(only, key) != 0) continue;
            std::vector<float> ref((size_t)n * m), got((size_t)n * m);
            float best = 1e30f;
            const char* best_name = "";
            for (size_t vi = 0; vi < sizeof(vs) / sizeof(vs[0]); vi++) {
                auto& v = vs[vi];
                if (n > v.max_n) continue;
                int blocks = ((n + v.bm - 1) / v.bm) * ((m + v.bn - 1) / v.bn);
                int sh = v.shared;
                auto launch = [&](const bf16_t* wp, float* out) {
                    v.f<<<blocks, v.threads, sh>>>(x, wp, out, n, k, m);
                };
                launch(w, vi == 0 ? yref : y);
                CHECK(cudaGetLastError());
                CHECK(cudaDeviceSynchronize());
                bool same = true;
                if (vi > 0) {
                    CHECK(cudaMemcpy(ref.data(), yref, ref.size() * 4, cudaMemcpyDeviceToHost));
                    CHECK(cudaMemcpy(got.data(), y, got.size() * 4, cudaMemcpyDeviceToHost));
                    same = ref == got;
                }
                float us = median_us(12, [&](int it) {
                    launch(w + (size_t)(it % copies) * wmax, y);
                });
                if (us < best) { best = us; best_name = v.name; }
                printf("%-8s %5d %-15s %9.1f %7.0f %s\n", names[si], n, v.name, us,
                       (double)k * m * 2 / us / 1e3, same ? "same" : "DIFFER");
            }
            printf("%-8s %5d best: %s\n", names[si], n, best_name);
        }
    }
    return 0;
}
