// Next-token agreement of a path's logits row with the reference's, on the GPU where both rows
// already are, so that a decode step's 150k-wide logits never leave it: KL(reference ‖ path) of
// the softmaxes, relative L2, and both rows' top-k (k <= AGREE_KMAX), ordered as the host's
// `top_k`: larger first by IEEE total order, then smaller index. Sums are in f64.
//
// Each block folds a slice of the vocabulary into an Agree state, written to `partials`; the
// last block to finish (counted in `counter`, which it resets) folds those and writes
// out[0..4]: top-1 agrees (0/1), top-k overlap, KL, relative L2. Blocks of AGREE_THREADS.
#define AGREE_KMAX 8
#define AGREE_THREADS 128
#define NEG_INF_D __longlong_as_double(0xfff0000000000000ull)

// Softmax sums relative to a running max: KL needs, per row, m = max and s = Σ exp(x - m), and
// a = Σ exp(r - m_r) (r - p), so that KL = a / s_r - (m_r + ln s_r) + (m_p + ln s_p).
struct Agree {
    double mp, sp, mr, sr, a, d2, b2;
    unsigned int kp[AGREE_KMAX], kr[AGREE_KMAX];
    int ip[AGREE_KMAX], ir[AGREE_KMAX];
};

// f32 bits as an unsigned key in IEEE total order (Rust's f32::total_cmp).
__device__ __forceinline__ unsigned int order_key(float x) {
    unsigned int u = __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// exp(m - to) as a scale factor; an empty state (m = -inf) weighs nothing.
__device__ __forceinline__ double rescale(double m, double to) {
    return m == NEG_INF_D ? 0.0 : exp(m - to);
}

__device__ __forceinline__ bool ranks_before(unsigned int ka, int ia, unsigned int kb, int ib) {
    if (ib < 0) return ia >= 0;
    if (ia < 0) return false;
    return ka > kb || (ka == kb && ia < ib);
}

// Inserts (key, idx) into a top-k list kept in order.
__device__ __forceinline__ void topk_insert(unsigned int* keys, int* idx, int k, unsigned int key,
                                            int i) {
    if (!ranks_before(key, i, keys[k - 1], idx[k - 1])) return;
    int j = k - 1;
    while (j > 0 && ranks_before(key, i, keys[j - 1], idx[j - 1])) {
        keys[j] = keys[j - 1];
        idx[j] = idx[j - 1];
        j--;
    }
    keys[j] = key;
    idx[j] = i;
}

__device__ void topk_merge(unsigned int* ka, int* ia, const unsigned int* kb, const int* ib, int k) {
    unsigned int keys[AGREE_KMAX];
    int idx[AGREE_KMAX];
    int x = 0, y = 0;
    for (int j = 0; j < k; j++) {
        if (ranks_before(kb[y], ib[y], ka[x], ia[x])) {
            keys[j] = kb[y];
            idx[j] = ib[y++];
        } else {
            keys[j] = ka[x];
            idx[j] = ia[x++];
        }
    }
    for (int j = 0; j < k; j++) {
        ka[j] = keys[j];
        ia[j] = idx[j];
    }
}

__device__ void agree_empty(Agree* s, int k) {
    s->mp = s->mr = NEG_INF_D;
    s->sp = s->sr = s->a = s->d2 = s->b2 = 0.0;
    for (int j = 0; j < k; j++) {
        s->kp[j] = s->kr[j] = 0;
        s->ip[j] = s->ir[j] = -1;
    }
}

__device__ void agree_add(Agree* s, float p, float r, int i, int k) {
    double pd = p, rd = r;
    if (pd > s->mp) {
        s->sp *= rescale(s->mp, pd);
        s->mp = pd;
    }
    s->sp += exp(pd - s->mp);
    if (rd > s->mr) {
        double f = rescale(s->mr, rd);
        s->sr *= f;
        s->a *= f;
        s->mr = rd;
    }
    double e = exp(rd - s->mr);
    s->sr += e;
    s->a += e * (rd - pd);
    s->d2 += (pd - rd) * (pd - rd);
    s->b2 += rd * rd;
    topk_insert(s->kp, s->ip, k, order_key(p), i);
    topk_insert(s->kr, s->ir, k, order_key(r), i);
}

__device__ void agree_merge(Agree* s, const Agree* o, int k) {
    double mp = fmax(s->mp, o->mp), mr = fmax(s->mr, o->mr);
    s->sp = s->sp * rescale(s->mp, mp) + o->sp * rescale(o->mp, mp);
    double fs = rescale(s->mr, mr), fo = rescale(o->mr, mr);
    s->sr = s->sr * fs + o->sr * fo;
    s->a = s->a * fs + o->a * fo;
    s->mp = mp;
    s->mr = mr;
    s->d2 += o->d2;
    s->b2 += o->b2;
    topk_merge(s->kp, s->ip, o->kp, o->ip, k);
    topk_merge(s->kr, s->ir, o->kr, o->ir, k);
}

// Folds the block's states (one per thread, in `all`) into all[0], in a fixed tree order.
__device__ void agree_reduce(Agree* all, int k) {
    for (int s = AGREE_THREADS / 2; s > 0; s >>= 1) {
        __syncthreads();
        if (threadIdx.x < s) agree_merge(&all[threadIdx.x], &all[threadIdx.x + s], k);
    }
    __syncthreads();
}

// Several comparisons in one launch (one per slot of the `Sides` arguments, `blocks` blocks
// each, side-major): a decode step compares its path with every reference, and the launches
// would otherwise run one after another, each a few blocks deep in merges on a mostly idle
// GPU. A comparison's blocks, states and merge order are those of a launch of its own.
extern "C" __global__ void logits_agreement(Sides paths, Sides refs, int n, int k,
                                            Sides partials_of, Sides counters, Sides outs,
                                            int blocks) {
    PDL_ENTER();
    __shared__ Agree all[AGREE_THREADS];
    int job = blockIdx.x / blocks, block = blockIdx.x % blocks;
    const float* path = at_side<const float>(paths, job);
    const float* ref = at_side<const float>(refs, job);
    Agree* partials = at_side<Agree>(partials_of, job);
    unsigned int* counter = at_side<unsigned int>(counters, job);
    double* out = at_side<double>(outs, job);
    Agree s;
    agree_empty(&s, k);
    int per = (n + blocks - 1) / blocks;
    int from = block * per, to = min(n, from + per);
    for (int i = from + threadIdx.x; i < to; i += AGREE_THREADS) agree_add(&s, path[i], ref[i], i, k);
    all[threadIdx.x] = s;
    agree_reduce(all, k);
    if (threadIdx.x == 0) partials[block] = all[0];
    if (!last_block_done(counter, blocks)) return;
    agree_empty(&s, k);
    for (int b = threadIdx.x; b < blocks; b += AGREE_THREADS) {
        Agree o;
        // Other blocks' states, read past L1.
        const double* src = (const double*)&partials[b];
        double* dst = (double*)&o;
        for (int w = 0; w < (int)(sizeof(Agree) / sizeof(double)); w++) dst[w] = __ldcg(src + w);
        agree_merge(&s, &o, k);
    }
    all[threadIdx.x] = s;
    agree_reduce(all, k);
    if (threadIdx.x == 0) {
        const Agree* t = &all[0];
        int overlap = 0;
        for (int x = 0; x < k; x++)
            for (int y = 0; y < k; y++) overlap += t->ip[x] >= 0 && t->ip[x] == t->ir[y];
        out[0] = t->ip[0] == t->ir[0] ? 1.0 : 0.0;
        out[1] = overlap;
        out[2] = t->a / t->sr - (t->mr + log(t->sr)) + (t->mp + log(t->sp));
        out[3] = t->b2 > 0.0 ? sqrt(t->d2 / t->b2) : sqrt(t->d2);
    }
}
