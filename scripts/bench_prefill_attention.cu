// The tensor-core prefill attention (`attention_mma`) at a model's attention shape, for passes
// of N queries after BASE cache entries: time per launch (back to back) of the whole form (a
// block per head and query tile walks every key) and of the split form (a block per softmax
// segment as well, then `attention_mma_merge`), and whether both give every output and
// statistic the same bits, and how many blocks an SM holds.
// Built and run by scripts/bench_prefill_attention.sh (nvcc, one GPU):
//   /tmp/bench_prefill_attention HEADS KV_HEADS N BASE
#define MAX_SIDES 1
#include "../kernels/common.cuh"
#include "../kernels/attention_mma.cu"

#include <cstring>
#include <string>

#include "bench_common.cuh"

int main(int argc, char** argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s HEADS KV_HEADS N BASE\n", argv[0]);
        return 2;
    }
    int heads = atoi(argv[1]), kvh = atoi(argv[2]), n = atoi(argv[3]), base = atoi(argv[4]);
    int hd = 128, span = base + n;
    std::vector<float> q((size_t)n * heads * hd), k((size_t)span * kvh * hd), v(k.size());
    for (auto& x : q) x = uniform();
    for (auto& x : k) x = uniform();
    for (auto& x : v) x = uniform();
    float *dq = upload(q), *dk = upload(k), *dv = upload(v);
    int* meta = upload(std::vector<int>{base});
    // Softmax segments up to the last key (`seg_after` of kernels/attention_mma.cu).
    int nseg = 0;
    for (int b = 0; b < span; b += std::max(MMA_SEG, b / MMA_SEG_RATIO / MMA_KT * MMA_KT)) nseg++;
    int tiles = (n + MMA_BQ - 1) / MMA_BQ;
    float *out, *stats, *part;
    bf16_t* out_bf;
    CHECK(cudaMalloc(&out, (size_t)n * heads * hd * 4));
    CHECK(cudaMalloc(&out_bf, (size_t)n * heads * hd * 2));
    CHECK(cudaMalloc(&stats, (size_t)n * heads * 4 * 4));
    CHECK(cudaMalloc(&part, (size_t)n * heads * nseg * (MMA_PART_HEAD + hd) * 4));
    int shared = MMA_SHARED(hd) * 4;
    CHECK(cudaFuncSetAttribute(attention_mma, cudaFuncAttributeMaxDynamicSharedMemorySize, shared));
    CHECK(cudaFuncSetAttribute(attention_mma_split, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               shared));
    int resident = 0;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, attention_mma, 128, shared));
    float scale = 1.0f / sqrtf((float)hd);
    auto whole = [&](int) {
        attention_mma<<<tiles * heads, 128, shared>>>(dq, dk, dv, nullptr, stats, out, out_bf,
                                                      meta, n, 0, heads, kvh, hd, span, scale);
    };
    auto split = [&](int) {
        attention_mma_split<<<tiles * heads * nseg, 128, shared>>>(dq, dk, dv, meta, n, 0, heads,
                                                                   kvh, hd, scale, part, nseg);
        attention_mma_merge<<<n * heads, hd, 0>>>(part, stats, out, out_bf, meta, heads, hd,
                                                  nseg);
    };
    whole(0);
    CHECK(cudaDeviceSynchronize());
    auto o1 = download(out, (size_t)n * heads * hd), s1 = download(stats, (size_t)n * heads * 4);
    split(0);
    CHECK(cudaDeviceSynchronize());
    auto o2 = download(out, (size_t)n * heads * hd), s2 = download(stats, (size_t)n * heads * 4);
    bool same = memcmp(o1.data(), o2.data(), o1.size() * 4) == 0 &&
                memcmp(s1.data(), s2.data(), s1.size() * 4) == 0;
    // Launches back to back, as a pass enqueues them: the median of 9 batches of 20.
    auto batch = [](auto f) { return [f](int) { for (int i = 0; i < 20; i++) f(i); }; };
    float tw = median_us(9, batch(whole)) / 20, ts = median_us(9, batch(split)) / 20;
    printf("heads %2d kv %d  n %4d base %4d  seg %4d: whole %7.1f us (%3d blocks)  split %7.1f us "
           "(%4d blocks, %d segments)  %s\n",
           heads, kvh, n, base, MMA_SEG, tw, tiles * heads, ts, tiles * heads * nseg, nseg,
           same ? "same bits" : "BITS DIFFER");
    printf("  (%d blocks an SM, %d bytes of shared memory a block)\n", resident, shared);
    CHECK(cudaGetLastError());
    return same ? 0 : 1;
}
