// The GPU oracle's products (kernels/oracle.cu, oracle_gemm_f64/_f32) beside cuBLAS's DGEMM and
// SGEMM (TF32 off), at the calibration's 128 rows and a model's layer shapes and LM head block:
// time per product, TFLOP/s, and the largest difference from cuBLAS relative to the largest
// output. Built and run by scripts/bench_oracle_gemm.sh (nvcc, cuBLAS, one GPU).
#define MAX_SIDES 1
#include "../kernels/common.cuh"
#include "../kernels/oracle.cu"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "bench_common.cuh"

template <typename T, typename WT, bool MMA, int STAGES, int NT>
__global__ void __launch_bounds__(128) ours_kernel(const T* x, const WT* w, T* y, int n, int k,
                                                   int m, long long ldy, int kchunk,
                                                   long long slice) {
    oracle_gemm<T, WT, MMA, STAGES, NT>(x, w, y, n, k, m, ldy, kchunk, slice);
}

// w's values as the bf16 bits the GPU holds (they are bf16-representable here).
static unsigned short* g_wb = nullptr;

// As src/cuda/oracle/gemm.rs picks it: enough splits of k to give every SM two blocks, each
// split at least 16 tiles of k long.
static int splits_for(long long tiles, int k, int sms) {
    int most = std::max(1, (k + 255) / 256);
    return (int)std::max(1LL, std::min((long long)most, 2 * sms / tiles));
}

static int g_sms = 132;
static void* g_part = nullptr;

template <typename T, bool MMA, int STAGES, int NT, bool WB = false>
void ours(const T* x, const T* w, T* y, int n, int k, int m, bool split) {
    int bn = MMA ? 16 * NT : 64;
    long long tiles = (long long)((n + 63) / 64) * ((m + bn - 1) / bn);
    int splits = split ? splits_for(tiles, k, g_sms) : 1;
    int kchunk = ((k + splits - 1) / splits + 15) / 16 * 16;
    splits = (k + kchunk - 1) / kchunk;
    int shared = MMA ? STAGES * (64 + bn) * ORACLE_GEMM_PAD * 8 : 2 * 2 * 64 * ORACLE_GEMM_PAD * (int)sizeof(T);
    static bool set = false;
    if (!set) {
        cudaFuncSetAttribute(ours_kernel<T, T, MMA, STAGES, NT>, cudaFuncAttributeMaxDynamicSharedMemorySize, shared);
        cudaFuncSetAttribute(ours_kernel<T, unsigned short, MMA, STAGES, NT>, cudaFuncAttributeMaxDynamicSharedMemorySize, shared);
        set = true;
    }
    T* out = splits > 1 ? (T*)g_part : y;
    if (WB)
        ours_kernel<T, unsigned short, MMA, STAGES, NT><<<tiles * splits, 128, shared>>>(
            x, g_wb, out, n, k, m, m, kchunk, (long long)n * m);
    else
        ours_kernel<T, T, MMA, STAGES, NT><<<tiles * splits, 128, shared>>>(x, w, out, n, k, m, m, kchunk,
                                                                            (long long)n * m);
    if (splits > 1) {
        if (sizeof(T) == 8)
            oracle_gemm_sum_f64<<<std::min(8192, (n * m + 255) / 256), 256>>>((const double*)out, (double*)y, n, m, m, splits);
        else
            oracle_gemm_sum_f32<<<std::min(8192, (n * m + 255) / 256), 256>>>((const float*)out, (float*)y, n, m, m, splits);
    }
}

template <typename T>
void blas(cublasHandle_t h, const T* x, const T* w, T* y, int n, int k, int m) {
    bool d = sizeof(T) == 8;
    T one = 1, zero = 0;
    cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, w, d ? CUDA_R_64F : CUDA_R_32F, k, x,
                 d ? CUDA_R_64F : CUDA_R_32F, k, &zero, y, d ? CUDA_R_64F : CUDA_R_32F, m,
                 d ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT);
}

template <typename T>
void bench(cublasHandle_t h, const char* name, int n, int k, int m) {
    std::vector<T> hx((size_t)n * k), hw((size_t)m * k);
    unsigned st = 7;
    auto rnd = [&]() { st = st * 1664525u + 1013904223u; return ((int)(st >> 9) % 2001 - 1000) / 1000.0; };
    for (auto& v : hx) v = (T)rnd();
    std::vector<unsigned short> hb(hw.size());
    for (size_t i = 0; i < hw.size(); i++) {
        float f = (float)(rnd() * 0.05);
        unsigned u;
        memcpy(&u, &f, 4);
        hb[i] = (unsigned short)(u >> 16);
        u &= 0xffff0000u;
        memcpy(&f, &u, 4);
        hw[i] = (T)f;
    }
    T *x, *w, *y0, *y1;
    (void)0;
    CHECK(cudaMalloc(&x, hx.size() * sizeof(T)));
    CHECK(cudaMalloc(&w, hw.size() * sizeof(T)));
    CHECK(cudaMalloc(&y0, (size_t)n * m * sizeof(T)));
    CHECK(cudaMalloc(&y1, (size_t)n * m * sizeof(T)));
    CHECK(cudaMemcpy(x, hx.data(), hx.size() * sizeof(T), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(w, hw.data(), hw.size() * sizeof(T), cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&g_wb, hb.size() * 2));
    CHECK(cudaMemcpy(g_wb, hb.data(), hb.size() * 2, cudaMemcpyHostToDevice));
    auto time = [&](auto f) {
        f();
        CHECK(cudaDeviceSynchronize());
        return median_us(7, [&](int) { f(); });
    };
    float ub = time([&] { blas<T>(h, x, w, y0, n, k, m); });
    struct V { const char* name; void (*f)(const T*, const T*, T*, int, int, int, bool); bool split; };
    V vs[] = {{"m3x4+split", ours<T, true, 3, 4>, true}, {"wb3x4+split", ours<T, true, 3, 4, true>, true},
              {"fma-wb", ours<T, false, 2, 4, true>, true}};
    float best = 1e30f; const char* bn = "";
    double worst = 0;
    for (auto& v : vs) {
        CHECK(cudaMemset(y1, 0, (size_t)n * m * sizeof(T)));
        float u = time([&] { v.f(x, w, y1, n, k, m, v.split); });
        CHECK(cudaGetLastError());
        std::vector<T> a((size_t)n * m), b((size_t)n * m);
        CHECK(cudaMemcpy(a.data(), y0, a.size() * sizeof(T), cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(b.data(), y1, b.size() * sizeof(T), cudaMemcpyDeviceToHost));
        double md = 0, mx = 0;
        for (size_t i = 0; i < a.size(); i++) {
            md = std::max(md, std::fabs((double)a[i] - (double)b[i]));
            mx = std::max(mx, std::fabs((double)a[i]));
        }
        worst = std::max(worst, md / mx);
        printf("    %-9s %8.1f us\n", v.name, u);
        if (u < best) best = u, bn = v.name;
    }
    float uo = best;
    double md = worst, mx = 1;
    double flop = 2.0 * n * k * m;
    printf("%-4s %-10s n=%d k=%-6d m=%-7d cuBLAS %8.1f us %6.1f TF/s  best %s %8.1f us %6.1f TF/s  ratio %.2f  max diff / max %.1e\n",
           sizeof(T) == 8 ? "f64" : "f32", name, n, k, m, ub, flop / ub / 1e6, bn, uo, flop / uo / 1e6, uo / ub, md / mx);
    cudaFree(g_wb); cudaFree(x); cudaFree(w); cudaFree(y0); cudaFree(y1);
}

int main(int argc, char** argv) {
    int h = argc > 1 ? atoi(argv[1]) : 4096, inter = argc > 2 ? atoi(argv[2]) : 12288;
    int qd = argc > 3 ? atoi(argv[3]) : 4096, kvd = argc > 4 ? atoi(argv[4]) : 1024;
    int n = argc > 5 ? atoi(argv[5]) : 128;
    cublasHandle_t handle;
    cublasCreate(&handle);
    cudaDeviceGetAttribute(&g_sms, cudaDevAttrMultiProcessorCount, 0);
    CHECK(cudaMalloc(&g_part, (size_t)2 * g_sms * 64 * 64 * 8 * 2));
    int shapes[][2] = {{h, qd}, {h, kvd}, {qd, h}, {h, inter}, {inter, h}, {h, 8192}};
    const char* names[] = {"q", "k/v", "o", "gate/up", "down", "lm block"};
    for (int i = 0; i < 6; i++) bench<double>(handle, names[i], n, shapes[i][0], shapes[i][1]);
    if (getenv("BENCH_F32")) for (int i = 0; i < 6; i++) bench<float>(handle, names[i], n, shapes[i][0], shapes[i][1]);
    return 0;
}
