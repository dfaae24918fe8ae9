// The head-128 decode attention with its q/k norm and RoPE folded in, for a pass of several
// sides (caches) at a model's shape: time per launch with a block per query head against a
// block per GQA group (each KV head's keys and values loaded once for its query heads), and
// whether every output, probability, cache entry and tap keeps the per-head block's bits.
// Built and run by scripts/bench_decode_attention.sh (nvcc, one GPU):
//   /tmp/bench_decode_attention HEADS KV_HEADS VISIBLE [CAPACITY]
#define MAX_SIDES 8
#include "../kernels/common.cuh"
#include "../kernels/rope.cu"
#include "../kernels/attention.cu"

#include <algorithm>
#include <cstdio>
#include <string>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cuda_runtime.h>

#include "bench_common.cuh"

// One side's buffers, as a decode step's workspace holds them.
struct Side {
    float *qkv, *keys, *values, *probs, *part, *out, *q_normed, *q_rotated, *k_normed,
        *k_rotated;
    bf16_t* out_bf16;
    unsigned int* counters;
    int *meta, *rope_meta;
};

int main(int argc, char** argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s HEADS KV_HEADS VISIBLE [CAPACITY]\n", argv[0]);
        return 2;
    }
    int heads = atoi(argv[1]), kvh = atoi(argv[2]), visible = atoi(argv[3]);
    int capacity = argc > 4 ? atoi(argv[4]) : visible + 64;
    int hd = 128, kv_dim = kvh * 128, group = heads / kvh;
    int chunks = (capacity + DECODE_CHUNK - 1) / DECODE_CHUNK + 1;
    int stride = capacity;
    // The merge's factors and sums for each head of a block (`merge_heads`).
    size_t shared =
        (size_t)std::max(hd + std::max(DECODE_THREADS, hd), group * (chunks + 2 * hd)) * 4;

    std::vector<float> inv_freq(64);
    for (int j = 0; j < 64; j++) inv_freq[j] = powf(1000000.0f, -(float)j / 64.0f);
    std::vector<bf16_t> qw(128), kw(128);
    for (int i = 0; i < 128; i++) {
        float a = 1.0f + 0.1f * uniform(), b = 1.0f + 0.1f * uniform();
        unsigned int ua, ub;
        memcpy(&ua, &a, 4);
        memcpy(&ub, &b, 4);
        qw[i] = (bf16_t)(ua >> 16);
        kw[i] = (bf16_t)(ub >> 16);
    }
    float* d_inv = upload(inv_freq);
    bf16_t *d_qw = upload(qw), *d_kw = upload(kw);

    Side sides[MAX_SIDES];
    std::vector<std::vector<float>> keys0(MAX_SIDES), values0(MAX_SIDES);
    for (int s = 0; s < MAX_SIDES; s++) {
        Side& d = sides[s];
        std::vector<float> qkv((size_t)(heads + 2 * kvh) * 128);
        for (auto& x : qkv) x = uniform();
        keys0[s].resize((size_t)capacity * kv_dim);
        values0[s].resize((size_t)capacity * kv_dim);
        for (auto& x : keys0[s]) x = uniform();
        for (auto& x : values0[s]) x = uniform();
        d.qkv = upload(qkv);
        d.keys = upload(keys0[s]);
        d.values = upload(values0[s]);
        CHECK(cudaMalloc(&d.probs, (size_t)heads * stride * 4));
        CHECK(cudaMalloc(&d.part, (size_t)heads * chunks * (hd + 2) * 4));
        CHECK(cudaMalloc(&d.out, (size_t)heads * hd * 4));
        CHECK(cudaMalloc(&d.out_bf16, (size_t)heads * hd * 2));
        CHECK(cudaMalloc(&d.q_normed, (size_t)heads * hd * 4));
        CHECK(cudaMalloc(&d.q_rotated, (size_t)heads * hd * 4));
        CHECK(cudaMalloc(&d.k_normed, (size_t)kvh * hd * 4));
        CHECK(cudaMalloc(&d.k_rotated, (size_t)kvh * hd * 4));
        CHECK(cudaMalloc(&d.counters, (size_t)heads * 4));
        CHECK(cudaMemset(d.counters, 0, (size_t)heads * 4));
        CHECK(cudaMemset(d.probs, 0, (size_t)heads * stride * 4));
        // Side s one key further on, so the sides differ in length (a ragged last chunk).
        int v = visible - s;
        d.meta = upload(std::vector<int>{v - 1});
        d.rope_meta = upload(std::vector<int>{v - 1, v - 1, v - 1});
    }
    auto pack = [&](int n, auto field) {
        Sides p{};
        for (int s = 0; s < MAX_SIDES; s++)
            p.p[s] = (unsigned long long)(s < n ? sides[s].*field : sides[0].*field);
        return p;
    };
    auto launch = [&](int n, int per) {
        SideInts split{}, strides{}, ch{};
        for (int s = 0; s < MAX_SIDES; s++) {
            split.v[s] = 0;
            strides.v[s] = stride;
            ch.v[s] = chunks;
        }
        int per_side = heads / per * chunks;
        attention_decode_128_rope_sides<<<n * per_side, DECODE_THREADS, shared>>>(
            pack(n, &Side::qkv), d_qw, d_kw, pack(n, &Side::rope_meta), d_inv,
            pack(n, &Side::q_normed), pack(n, &Side::q_rotated), pack(n, &Side::k_normed),
            pack(n, &Side::k_rotated), 1e-6f, 1.0f, pack(n, &Side::keys), pack(n, &Side::values),
            pack(n, &Side::probs), pack(n, &Side::part), pack(n, &Side::out),
            pack(n, &Side::out_bf16), pack(n, &Side::counters), pack(n, &Side::meta), split,
            heads, kvh, per, strides, ch, per_side, 1.0f / sqrtf(128.0f));
    };
    auto launch_single = [&](int per) {
        Side& d = sides[0];
        attention_decode_128_rope<<<heads / per * chunks, DECODE_THREADS, shared>>>(
            d.qkv, d_qw, d_kw, d.rope_meta, d_inv, d.q_normed, d.q_rotated, d.k_normed,
            d.k_rotated, 1e-6f, 1.0f, d.keys, d.values, d.probs, d.part, d.out, d.out_bf16,
            d.counters, d.meta, 0, heads, kvh, per, stride, chunks, 1.0f / sqrtf(128.0f));
    };
    // Everything a launch writes, per side.
    auto outputs = [&](int n) {
        std::vector<std::vector<float>> r;
        for (int s = 0; s < n; s++) {
            Side& d = sides[s];
            std::vector<float> all = download(d.out, (size_t)heads * hd);
            for (float x : download(d.probs, (size_t)heads * stride)) all.push_back(x);
            for (float x : download(d.q_rotated, (size_t)heads * hd)) all.push_back(x);
            for (float x : download(d.q_normed, (size_t)heads * hd)) all.push_back(x);
            for (float x : download(d.k_rotated, (size_t)kvh * hd)) all.push_back(x);
            // The new key's cache entry (the rest is only read).
            size_t slot = (size_t)(visible - s - 1) * kv_dim;
            for (float x : download(d.keys + slot, kv_dim)) all.push_back(x);
            for (float x : download(d.values + slot, kv_dim)) all.push_back(x);
            for (bf16_t x : download(d.out_bf16, (size_t)heads * hd)) all.push_back((float)x);
            r.push_back(all);
        }
        return r;
    };
    auto reset = [&]() {
        for (int s = 0; s < MAX_SIDES; s++) {
            CHECK(cudaMemcpy(sides[s].keys, keys0[s].data(), keys0[s].size() * 4,
                             cudaMemcpyHostToDevice));
            CHECK(cudaMemcpy(sides[s].values, values0[s].data(), values0[s].size() * 4,
                             cudaMemcpyHostToDevice));
            CHECK(cudaMemset(sides[s].probs, 0, (size_t)heads * stride * 4));
        }
    };
    auto same = [](const std::vector<std::vector<float>>& a,
                   const std::vector<std::vector<float>>& b) {
        for (size_t s = 0; s < a.size(); s++)
            if (memcmp(a[s].data(), b[s].data(), a[s].size() * 4) != 0) return false;
        return true;
    };
    int pers[] = {1, group};
    cudaEvent_t t0, t1;
    CHECK(cudaEventCreate(&t0));
    CHECK(cudaEventCreate(&t1));
    auto time = [&](auto&& f) {
        for (int i = 0; i < 20; i++) f();
        CHECK(cudaEventRecord(t0));
        const int reps = 200;
        for (int i = 0; i < reps; i++) f();
        CHECK(cudaEventRecord(t1));
        CHECK(cudaEventSynchronize(t1));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, t0, t1));
        return ms * 1000.0f / reps;
    };
    printf("heads %d, kv heads %d, %d keys (side s: %d - s), capacity %d, %d chunks\n", heads,
           kvh, visible, visible, capacity, chunks);
    printf("%-8s %14s %14s %8s %s\n", "sides", "per head us", "per group us", "ratio",
           "bits");
    bool all_same = true;
    for (int n = 0; n <= MAX_SIDES; n++) {
        float us[2];
        std::vector<std::vector<float>> got[2];
        for (int k = 0; k < 2; k++) {
            reset();
            if (n == 0) launch_single(pers[k]);
            else launch(n, pers[k]);
            CHECK(cudaDeviceSynchronize());
            got[k] = outputs(n == 0 ? 1 : n);
            us[k] = n == 0 ? time([&] { launch_single(pers[k]); })
                           : time([&] { launch(n, pers[k]); });
        }
        bool ok = same(got[0], got[1]);
        all_same &= ok;
        printf("%-8s %14.1f %14.1f %8.2f %s\n",
               n == 0 ? "single" : std::to_string(n).c_str(), us[0], us[1], us[0] / us[1],
               ok ? "same" : "DIFFER");
    }
    CHECK(cudaGetLastError());
    return all_same ? 0 : 1;
}
