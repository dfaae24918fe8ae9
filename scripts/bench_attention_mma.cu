// The tensor-core attention kernels of kernels/attention_mma.cu built for one architecture
// (scripts/bench_attention_mma.sh builds it for sm_90, `mma.sync`, and sm_90a, warpgroup
// MMAs): µs a launch (back to back, median of 9 batches) of the prefill attention's whole and
// split forms, the probabilities' rebuild and the attention diff, at a model's attention shape
// (head_dim 128), and every output written to DUMP so that two builds can be compared bit for
// bit. Also checks within the build what the kernels promise each other: the split form's
// outputs and statistics are the whole form's; rebuilt probabilities are the written ones.
//   bench_attention_mma HEADS KV_HEADS CASE N BASE DUMP
// CASE: whole (N queries after BASE keys, probabilities written where N · (BASE + N) <= 4M),
// imaged (the whole form with its tiles from `attention_mma_image`, timed with the image made;
// the whole form where this build takes no warpgroup tiles), split, or
// diff (a path pass of N queries whose keys start at BASE, apart from the keys before it,
// against a reference pass over all BASE + N: the rows a chunk prefilled apart compares).
#define MAX_SIDES 1
#include "../kernels/common.cuh"
#include "../kernels/attention_wgmma.cu"
#include "../kernels/attention_mma.cu"
#include "../kernels/attention_diff_mma.cu"

#include <cstring>
#include <string>

#include "bench_common.cuh"

static const int HD = 128;

struct Pass {
    int n, base, heads, kvh, span;
    float *q, *k, *v, *out, *stats, *probs;
    bf16_t* out_bf;
    int* meta;
};

static Pass make_pass(int heads, int kvh, int n, int base, bool probs) {
    Pass p{n, base, heads, kvh, base + n};
    std::vector<float> q((size_t)n * heads * HD), k((size_t)p.span * kvh * HD), v(k.size());
    for (auto& x : q) x = uniform();
    for (auto& x : k) x = uniform();
    for (auto& x : v) x = uniform();
    p.q = upload(q), p.k = upload(k), p.v = upload(v);
    p.meta = upload(std::vector<int>{base});
    CHECK(cudaMalloc(&p.out, (size_t)n * heads * HD * 4));
    CHECK(cudaMalloc(&p.out_bf, (size_t)n * heads * HD * 2));
    CHECK(cudaMalloc(&p.stats, (size_t)n * heads * 4 * 4));
    p.probs = nullptr;
    if (probs) CHECK(cudaMalloc(&p.probs, (size_t)n * heads * p.span * 4));
    return p;
}

static void whole(const Pass& p, float scale) {
    int tiles = (p.n + MMA_BQ - 1) / MMA_BQ;
    attention_mma<<<tiles * p.heads, 128, MMA_SHARED(HD) * 4>>>(
        p.q, p.k, p.v, p.probs, p.stats, p.out, p.out_bf, p.meta, p.n, 0, p.heads, p.kvh, HD,
        p.span, scale);
}

// Whether this build takes the warpgroup tiles (and so `attention_mma_imaged`).
__global__ void wg_built(int* f) { *f = MMA_WG; }

// The whole form with its tiles from an image made in the same launch sequence.
static void imaged(const Pass& p, float scale, float* image) {
    int tiles = (p.n + MMA_BQ - 1) / MMA_BQ, kt = (p.span + MMA_KT - 1) / MMA_KT;
    attention_mma_image<<<kt * p.kvh, 128>>>(p.k, p.v, image, p.span, p.kvh, HD);
    attention_mma_imaged<<<tiles * p.heads, 128, MMA_SHARED(HD) * 4>>>(
        p.q, p.k, p.v, p.probs, p.stats, p.out, p.out_bf, p.meta, p.n, 0, p.heads, p.kvh, HD,
        p.span, scale, image);
}

static void dump(FILE* f, const void* d, size_t bytes) {
    std::vector<char> h(bytes);
    CHECK(cudaMemcpy(h.data(), d, bytes, cudaMemcpyDeviceToHost));
    fwrite(h.data(), 1, bytes, f);
}

static bool same(const void* a, const void* b, size_t bytes) {
    std::vector<char> x(bytes), y(bytes);
    CHECK(cudaMemcpy(x.data(), a, bytes, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(y.data(), b, bytes, cudaMemcpyDeviceToHost));
    return memcmp(x.data(), y.data(), bytes) == 0;
}

int main(int argc, char** argv) {
    if (argc < 7) {
        fprintf(stderr, "usage: %s HEADS KV_HEADS whole|split|diff N BASE DUMP\n", argv[0]);
        return 2;
    }
    int heads = atoi(argv[1]), kvh = atoi(argv[2]), n = atoi(argv[4]), base = atoi(argv[5]);
    std::string mode = argv[3];
    FILE* out = fopen(argv[6], "wb");
    if (!out) return 2;
    float scale = 1.0f / sqrtf((float)HD);
    int shared = MMA_SHARED(HD) * 4, rb = MMA_RB_SHARED(HD) * 4, df = MMA_DIFF_SHARED(HD) * 4;
    CHECK(cudaFuncSetAttribute(attention_mma, cudaFuncAttributeMaxDynamicSharedMemorySize, shared));
    CHECK(cudaFuncSetAttribute(attention_mma_imaged, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               shared));
    CHECK(cudaFuncSetAttribute(attention_mma_split, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               shared));
    CHECK(cudaFuncSetAttribute(probs_from_stats_mma, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               rb));
    CHECK(cudaFuncSetAttribute(attention_diff_mma, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               df));
    auto batch = [](auto f) { return [f](int) { for (int i = 0; i < 10; i++) f(i); }; };
    bool ok = true;
    float us = 0.0f;
    const char* check = "";
    if (mode == "imaged") {
        // Where the warpgroup tiles are not built: the whole form, whose bits these are.
        int* flag;
        int wg = 0;
        CHECK(cudaMalloc(&flag, 4));
        wg_built<<<1, 1>>>(flag);
        CHECK(cudaMemcpy(&wg, flag, 4, cudaMemcpyDeviceToHost));
        Pass p = make_pass(heads, kvh, n, base, false);
        size_t no = (size_t)n * heads * HD, ns = (size_t)n * heads * 4;
        float *image, *o1, *s1;
        // MMA_IMG_TILE floats a tile (defined for device code only).
        size_t tile = 4 * MMA_KT * MMA_MAXD;
        CHECK(cudaMalloc(&image, (size_t)((p.span + MMA_KT - 1) / MMA_KT) * kvh * tile * 4));
        CHECK(cudaMalloc(&o1, no * 4));
        CHECK(cudaMalloc(&s1, ns * 4));
        whole(p, scale);
        CHECK(cudaDeviceSynchronize());
        CHECK(cudaMemcpy(o1, p.out, no * 4, cudaMemcpyDeviceToDevice));
        CHECK(cudaMemcpy(s1, p.stats, ns * 4, cudaMemcpyDeviceToDevice));
        if (wg) {
            CHECK(cudaMemset(p.out, 0xff, no * 4));
            imaged(p, scale, image);
            CHECK(cudaDeviceSynchronize());
            ok = same(o1, p.out, no * 4) && same(s1, p.stats, ns * 4);
            check = ok ? "imaged = whole: same bits" : "imaged = whole: BITS DIFFER";
            us = median_us(9, batch([&](int) { imaged(p, scale, image); })) / 10;
        } else {
            us = median_us(9, batch([&](int) { whole(p, scale); })) / 10;
        }
        dump(out, p.out, no * 4);
        dump(out, p.stats, ns * 4);
    } else if (mode == "whole" || mode == "split") {
        bool probs = mode == "whole" && (size_t)n * (base + n) <= (1u << 22);
        Pass p = make_pass(heads, kvh, n, base, probs);
        whole(p, scale);
        CHECK(cudaDeviceSynchronize());
        size_t no = (size_t)n * heads * HD, ns = (size_t)n * heads * 4;
        dump(out, p.out, no * 4);
        dump(out, p.stats, ns * 4);
        if (mode == "whole") {
            us = median_us(9, batch([&](int) { whole(p, scale); })) / 10;
            if (probs) {
                dump(out, p.probs, (size_t)n * heads * p.span * 4);
                // The rebuild of every row from its statistics: the written rows' bits.
                std::vector<int> rows(n);
                for (int i = 0; i < n; i++) rows[i] = i;
                int* drows = upload(rows);
                float* rebuilt;
                CHECK(cudaMalloc(&rebuilt, (size_t)n * heads * p.span * 4));
                int tiles = (n + MMA_BQ - 1) / MMA_BQ;
                int kch = (p.span + MMA_RB_KEYS - 1) / MMA_RB_KEYS;
                probs_from_stats_mma<<<tiles * heads * kch, 128, rb>>>(
                    p.q, p.k, p.stats, drows, rebuilt, n, base, 0, heads, kvh, HD, p.span, scale);
                CHECK(cudaDeviceSynchronize());
                ok = same(rebuilt, p.probs, (size_t)n * heads * p.span * 4);
                check = ok ? "rebuild: same bits" : "rebuild: BITS DIFFER";
            }
        } else {
            int nseg = 0;
            for (int b = 0; b < p.span; b += std::max(MMA_SEG, b / MMA_SEG_RATIO / MMA_KT * MMA_KT))
                nseg++;
            int tiles = (n + MMA_BQ - 1) / MMA_BQ;
            float *part, *o2, *s2;
            bf16_t* ob2;
            CHECK(cudaMalloc(&part, (size_t)n * heads * nseg * (MMA_PART_HEAD + HD) * 4));
            CHECK(cudaMalloc(&o2, no * 4));
            CHECK(cudaMalloc(&ob2, no * 2));
            CHECK(cudaMalloc(&s2, ns * 4));
            auto split = [&](int) {
                attention_mma_split<<<tiles * heads * nseg, 128, shared>>>(
                    p.q, p.k, p.v, p.meta, n, 0, heads, kvh, HD, scale, part, nseg);
                attention_mma_merge<<<n * heads, HD, 0>>>(part, s2, o2, ob2, p.meta, heads, HD,
                                                          nseg);
            };
            split(0);
            CHECK(cudaDeviceSynchronize());
            ok = same(o2, p.out, no * 4) && same(s2, p.stats, ns * 4);
            check = ok ? "split = whole: same bits" : "split = whole: BITS DIFFER";
            us = median_us(9, batch(split)) / 10;
        }
    } else if (mode == "diff") {
        // b: the reference over all base + n; a: the path's chunk of n queries, keys its own.
        Pass b = make_pass(heads, kvh, base + n, 0, false);
        Pass a = make_pass(heads, kvh, n, 0, false);
        whole(a, scale);
        whole(b, scale);
        std::vector<int> rows(n);
        for (int i = 0; i < n; i++) rows[i] = base + i;
        int* drows = upload(rows);
        int width = base + n, blocks = (n + MMA_BQ - 1) / MMA_BQ * heads;
        int cols = width;
        if (blocks < 512) {
            int chunks = (512 + blocks - 1) / blocks;
            int per = (width + chunks - 1) / chunks;
            cols = std::max(4 * MMA_KT, (per + MMA_KT - 1) / MMA_KT * MMA_KT);
        }
        int chunks = (width + cols - 1) / cols;
        float* sums;
        CHECK(cudaMalloc(&sums, (size_t)n * heads * chunks * 12 * 4));
        auto diff = [&](int) {
            attention_diff_mma<<<blocks * chunks, 128, df>>>(
                a.q, a.k, a.stats, 0, 0, base, n, b.q, b.k, b.stats, drows, 0, 0, 0, width, sums,
                n, cols, heads, kvh, HD, scale);
        };
        diff(0);
        CHECK(cudaDeviceSynchronize());
        dump(out, sums, (size_t)n * heads * chunks * 12 * 4);
        us = median_us(9, batch(diff)) / 10;
    } else {
        fprintf(stderr, "unknown case %s\n", mode.c_str());
        return 2;
    }
    CHECK(cudaGetLastError());
    fclose(out);
    printf("%-5s heads %2d kv %d  n %5d base %5d: %9.1f us  %s\n", mode.c_str(), heads, kvh, n,
           base, us, check);
    return ok ? 0 : 1;
}
