// Warpgroup MMAs (`wgmma`, sm_90a: H100, H200) for the tensor-core attention of
// attention_mma.cu. `mma.sync` fed every B fragment to each warp through its own shared-memory
// loads: 16 bytes a lane for three products of 16 query rows, which left those kernels bound by
// the shared-memory pipe. A warpgroup's MMA reads B from shared memory once for its 64 rows,
// without registers or load instructions; A (queries, probabilities) stays in registers, split
// as before, and every product is the same TF32 product in the same order.
//
// Shared-memory operands are in the canonical K-major layout without swizzling: 8x16-byte core
// matrices of 128 contiguous bytes, the next core matrix along K `lbo` bytes on, along N `sbo`.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MMA_WG 1

// The matrix descriptor of a shared-memory operand, as its two words: the low one holds the
// address (16-byte units, 14 bits) and `lbo`, the high one `sbo`. Made once per tile buffer:
// built from a pointer at every product, the descriptors' 64-bit arithmetic cost these
// kernels, bound by their instructions' issue, 3-5% of their time.
struct WgDesc {
    unsigned lo, hi;
};

__device__ __forceinline__ WgDesc wg_desc(const float* p, unsigned lbo, unsigned sbo) {
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    return WgDesc{((a & 0x3ffffu) >> 4) | (((lbo & 0x3ffffu) >> 4) << 16),
                  (sbo & 0x3ffffu) >> 4};
}

// The descriptor of the operand `floats` floats (a multiple of 4) past `d`'s: its address
// moves on within the low word (shared memory stays below 256 KiB, so no carry leaves it).
__device__ __forceinline__ unsigned long long wg_at(WgDesc d, unsigned floats) {
    unsigned long long r;
    asm("mov.b64 %0, {%1, %2};" : "=l"(r) : "r"(d.lo + floats / 4), "r"(d.hi));
    return r;
}

// Orders the registers' earlier writes before the MMAs that read them.
__device__ __forceinline__ void wg_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Until at most N commit groups are pending.
template <int N>
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Shared-memory stores by threads made visible to the MMAs, which read through the async proxy.
__device__ __forceinline__ void wg_proxy_fence() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// An accumulator pinned where it stands: the compiler must not move its reads above the wait
// that completes the MMAs writing it, nor its writes below the fence before them.
__device__ __forceinline__ void wg_pin(float& x) { asm volatile("" : "+f"(x)::"memory"); }
// An A fragment's register held until here: the MMAs read it as they run, so it must not be
// reused before the wait that completes them.
__device__ __forceinline__ void wg_pin_u(unsigned& x) { asm volatile("" : "+r"(x)::"memory"); }

// `wg_pin` on every value of an accumulator of R C fragments.
template <int R>
__device__ __forceinline__ void wg_pin_acc(float (*d)[4]) {
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int c = 0; c < 4; c++) wg_pin(d[r][c]);
}

// N A fragments, both TF32 halves, held until the wait just before this.
template <int N>
__device__ __forceinline__ void wg_hold(unsigned (*ab)[4], unsigned (*as)[4]) {
#pragma unroll
    for (int k = 0; k < N; k++)
#pragma unroll
        for (int i = 0; i < 4; i++) wg_pin_u(ab[k][i]), wg_pin_u(as[k][i]);
}

// One-dimensional bulk copies from global into shared memory (`cp.async.bulk`, the TMA's
// unit without a tensor map), each completing a phase of an mbarrier that one thread arms with
// the bytes to expect. The copies run beside the block's MMAs with no registers held for them.
__device__ __forceinline__ void mbar_init(unsigned long long* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(
                     (unsigned)__cvta_generic_to_shared(bar))
                 : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void bulk_load(float* dst, const float* src, unsigned bytes,
                                          unsigned long long* bar) {
    unsigned b = (unsigned)__cvta_generic_to_shared(bar);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(b), "r"(bytes)
                 : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
            (unsigned)__cvta_generic_to_shared(dst)),
        "l"(src), "r"(bytes), "r"(b)
        : "memory");
}

// Until the barrier's phase `phase` completes; then the next phase is the one to wait for.
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned& phase) {
    unsigned b = (unsigned)__cvta_generic_to_shared(bar), done;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(b), "r"(phase)
            : "memory");
    } while (!done);
    phase ^= 1;
}

// d (64x32) += a (64x8, this warp's 16 rows in registers) · b (8x32, shared memory).
__device__ __forceinline__ void wg_m64n32k8(float (*d)[4], const unsigned* a,
                                            unsigned long long b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, "
        "{%16,%17,%18,%19}, %20, 1, 1, 1;\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
          "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// d (64x128) += a (64x8, this warp's 16 rows in registers) · b (8x128, shared memory).
__device__ __forceinline__ void wg_m64n128k8(float (*d)[4], const unsigned* a,
                                             unsigned long long b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
        "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
        "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "
        "{%64,%65,%66,%67}, %68, 1, 1, 1;\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
          "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
          "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),
          "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),
          "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),
          "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]),
          "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
          "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]),
          "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
          "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
          "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
#else
#define MMA_WG 0
// Never called where the warpgroup tiles are not built (`attention_mma_image`'s tiles).
__device__ __forceinline__ void mbar_init(unsigned long long*) {}
__device__ __forceinline__ void bulk_load(float*, const float*, unsigned, unsigned long long*) {}
__device__ __forceinline__ void mbar_wait(unsigned long long*, unsigned&) {}
#endif
