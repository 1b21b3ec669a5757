// Paged causal attention over a bf16 KV cache for the CPU engine: AVX-512 BF16, one pass per
// (sequence, kv head, query position), the query heads of one kv head processed together.
//
// Why a native kernel: at head dim 32 every attention score costs only 64 multiply-adds of each
// GEMM, so PyTorch's CPU flash kernel (SDPA) spends most of its time in per-block GEMM calls and in
// its softmax passes (measured ~53 GFLOP/s on one Zen 5 core, 60% of a 1,600-token prefill). Here
// the scores of one query position live in a row buffer in L1, K and V are packed once per kv head
// into the layouts the bf16 dot-product instruction wants, and the G query heads that share a kv
// head reuse every K/V load.
//
// Layouts (bf16 stored as uint16):
//   q, out      [T, Hq, D]                    new tokens of all sequences, packed (cu_q offsets)
//   k/v cache   [NB, BS, Hkv, D], blocks block_stride elements apart (a view of the engine's cache)
//   Kp          [ceil(n / 16)][D / 2][16 keys][2]   32-bit word (key j, channel pair p) at
//               (j / 16) * (D / 2) * 16 + p * 16 + j % 16: one load = 16 keys x one channel pair
//   Vp          [ceil(n / 2)][D][2]                  32-bit word (key pair jp, channel d) at jp * D + d
//   scores row  [G][n] float32, then probabilities [G][n + 1] bf16 (pairs read as 32-bit words)
//
// Token i of a sequence with tq new tokens and context n sits at position n - tq + i and sees keys
// 0 .. n - tq + i (its cached prefix and the new tokens up to itself).
//
// Math: scores and P.V accumulate in float32 (vdpbf16ps); the softmax is float32 and the
// probabilities are rounded to bf16 before P.V, as transformers' eager bf16 attention does.

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#define KERNEL __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

namespace {

KERNEL inline __m512 exp512(__m512 x) {
    // e^x = 2^(x log2 e) = 2^n 2^f, n = round(t), f in [-0.5, 0.5]: a degree-6 polynomial for 2^f
    // (relative error ~2e-7), then scalef for 2^n. Inputs below -87 give 0 (masked keys are -inf).
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(1.4426950408889634f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

inline const uint16_t* token_row(const uint16_t* cache, const int32_t* table, int64_t block_stride, int bs,
                                 int hkv, int d, int j, int h) {
    return cache + (int64_t)table[j / bs] * block_stride + ((int64_t)(j % bs) * hkv + h) * d;
}

// Pack keys 0 .. n-1 of kv head h into Kp and values into Vp (zero padding past n: padded lanes
// are masked in the scores, and a zero value row keeps 0 x pad = 0).
template <int D>
void pack_kv(const uint16_t* kc, const uint16_t* vc, const int32_t* table, int64_t block_stride, int bs, int hkv,
             int h, int n, uint32_t* kp, uint32_t* vp) {
    const int nk = (n + 15) / 16 * 16;
    for (int j = 0; j < nk; ++j) {
        uint32_t* dst = kp + (int64_t)(j / 16) * (D / 2) * 16 + j % 16;
        if (j < n) {
            const uint32_t* src = (const uint32_t*)token_row(kc, table, block_stride, bs, hkv, D, j, h);
            for (int p = 0; p < D / 2; ++p) dst[p * 16] = src[p];
        } else {
            for (int p = 0; p < D / 2; ++p) dst[p * 16] = 0;
        }
    }
    uint16_t* v16 = (uint16_t*)vp;
    const int nv = (n + 1) / 2 * 2;
    for (int j = 0; j < nv; ++j) {
        uint16_t* dst = v16 + (int64_t)(j / 2) * D * 2 + (j & 1);
        if (j < n) {
            const uint16_t* src = token_row(vc, table, block_stride, bs, hkv, D, j, h);
            for (int c = 0; c < D; ++c) dst[c * 2] = src[c];
        } else {
            for (int c = 0; c < D; ++c) dst[c * 2] = 0;
        }
    }
}

// Scores of the G query rows against NB consecutive 16-key blocks from block b0: each query pair
// broadcast feeds NB key loads (one block at a time re-broadcast every pair per 16 keys).
template <int D, int G, int NB>
KERNEL inline void score_blocks(const uint16_t* q, int64_t q_stride, const uint32_t* kp, int b0, int m,
                                __m512 vscale, float* s, int nk_cap, __m512* mx) {
    constexpr int P = D / 2;
    __m512 acc[NB][G];
    for (int x = 0; x < NB; ++x)
        for (int r = 0; r < G; ++r) acc[x][r] = _mm512_setzero_ps();
    const uint32_t* kb = kp + (int64_t)b0 * P * 16;
    for (int p = 0; p < P; ++p) {
        __m512bh kv[NB];
        for (int x = 0; x < NB; ++x) kv[x] = (__m512bh)_mm512_loadu_si512(kb + x * P * 16 + p * 16);
        for (int r = 0; r < G; ++r) {
            const __m512bh qq = (__m512bh)_mm512_set1_epi32(*(const int32_t*)(q + r * q_stride + 2 * p));
            for (int x = 0; x < NB; ++x) acc[x][r] = _mm512_dpbf16_ps(acc[x][r], qq, kv[x]);
        }
    }
    for (int x = 0; x < NB; ++x) {
        const int b = b0 + x;
        const int left = m - b * 16;
        const __mmask16 live = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        for (int r = 0; r < G; ++r) {
            const __m512 y = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, _mm512_mul_ps(acc[x][r], vscale));
            _mm512_storeu_ps(s + (int64_t)r * nk_cap + b * 16, y);
            mx[r] = _mm512_max_ps(mx[r], y);
        }
    }
}

// The G query rows q[r] (r < G, D bf16 each, `q_stride` apart) over keys 0 .. m-1 -> out rows.
// s: scratch float [G][nk], pr: scratch bf16 [G][nk + 2].
template <int D, int G>
KERNEL void attend_rows(const uint16_t* q, int64_t q_stride, const uint32_t* kp, const uint32_t* vp, int m,
                        float scale, float* s, uint16_t* pr, int nk_cap, uint16_t* out, int64_t out_stride) {
    const int nblk = (m + 15) / 16;
    // scores: S[r][j] = scale * q_r . k_j
    __m512 mx[G];
    for (int r = 0; r < G; ++r) mx[r] = _mm512_set1_ps(-INFINITY);
    const __m512 vscale = _mm512_set1_ps(scale);
    int b = 0;
    for (; b + 1 < nblk; b += 2) score_blocks<D, G, 2>(q, q_stride, kp, b, m, vscale, s, nk_cap, mx);
    if (b < nblk) score_blocks<D, G, 1>(q, q_stride, kp, b, m, vscale, s, nk_cap, mx);
    // softmax numerators e^(S - max) rounded to bf16, and their float sums
    float inv[G];
    for (int r = 0; r < G; ++r) {
        const __m512 vm = _mm512_set1_ps(_mm512_reduce_max_ps(mx[r]));
        __m512 sum = _mm512_setzero_ps();
        float* sr = s + (int64_t)r * nk_cap;
        uint16_t* prr = pr + (int64_t)r * (nk_cap + 2);
        for (int b = 0; b < nblk; ++b) {
            const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sr + b * 16), vm));
            const __m256bh eb = _mm512_cvtneps_pbh(e);
            // sum what P.V will use: the bf16-rounded numerators (normalization stays exact)
            sum = _mm512_add_ps(sum, _mm512_cvtpbh_ps(eb));
            _mm256_storeu_si256((__m256i*)(prr + b * 16), (__m256i)eb);
        }
        prr[nblk * 16] = 0;
        prr[nblk * 16 + 1] = 0;
        inv[r] = 1.0f / _mm512_reduce_add_ps(sum);
    }
    // out_r = sum_j P[r][j] v_j / sum_r: key pairs along the dot product, channels along lanes
    constexpr int NV = D / 16;
    __m512 o[G][NV];
    for (int r = 0; r < G; ++r)
        for (int c = 0; c < NV; ++c) o[r][c] = _mm512_setzero_ps();
    const int npair = (m + 1) / 2;
    for (int jp = 0; jp < npair; ++jp) {
        __m512bh vv[NV];
        for (int c = 0; c < NV; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vp + (int64_t)jp * D + c * 16);
        for (int r = 0; r < G; ++r) {
            // an odd m's last pair reads P[m] = e^-inf = 0 (or the zeroed pad)
            const __m512bh pp = (__m512bh)_mm512_set1_epi32(*(const int32_t*)(pr + (int64_t)r * (nk_cap + 2) + 2 * jp));
            for (int c = 0; c < NV; ++c) o[r][c] = _mm512_dpbf16_ps(o[r][c], pp, vv[c]);
        }
    }
    for (int r = 0; r < G; ++r) {
        const __m512 vi = _mm512_set1_ps(inv[r]);
        for (int c = 0; c < NV; ++c) {
            const __m256bh ob = _mm512_cvtneps_pbh(_mm512_mul_ps(o[r][c], vi));
            _mm256_storeu_si256((__m256i*)(out + r * out_stride + c * 16), (__m256i)ob);
        }
    }
}


// y[m, o] = x[m, :] . w[o, :] (+ bias[o]) for decode-sized m: one pass over the weights, each row
// of w read once for all m rows of x (oneDNN's bf16 GEMM at m = 1 reads an LM head at a few GB/s).
KERNEL void linear_rows(const uint16_t* x, const uint16_t* w, const uint16_t* bias, int m, int in, int o_lo,
                        int o_hi, float* out32, uint16_t* out16, int out_cols) {
    const int nv = in / 32;
    for (int o = o_lo; o < o_hi; ++o) {
        const uint16_t* wr = w + (int64_t)o * in;
        const float b = bias ? _mm_cvtss_f32(_mm_castsi128_ps(_mm_cvtsi32_si128((int)bias[o] << 16))) : 0.0f;
        for (int r = 0; r < m; ++r) {
            const uint16_t* xr = x + (int64_t)r * in;
            __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
            int c = 0;
            for (; c + 1 < nv; c += 2) {
                acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(xr + c * 32), (__m512bh)_mm512_loadu_si512(wr + c * 32));
                acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_loadu_si512(xr + c * 32 + 32), (__m512bh)_mm512_loadu_si512(wr + c * 32 + 32));
            }
            if (c < nv)
                acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(xr + c * 32), (__m512bh)_mm512_loadu_si512(wr + c * 32));
            const float y = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) + b;
            if (out32) {
                out32[(int64_t)r * out_cols + o] = y;
            } else {
                const __m128bh yb = _mm_cvtneps_pbh(_mm_set1_ps(y));
                out16[(int64_t)r * out_cols + o] = (uint16_t)_mm_extract_epi16((__m128i)yb, 0);
            }
        }
    }
}

template <int D, int G>
int run(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, int64_t block_stride, int bs, int hkv,
        const int32_t* tables, int64_t table_stride, const int32_t* cu_q, const int32_t* seq_lens, int nseq,
        int min_tq, float scale, uint16_t* out, int nthreads) {
    const int hq = hkv * G;
    const int64_t tok_stride = (int64_t)hq * D;
    int status = 0;
    for (int b = 0; b < nseq; ++b) {
        const int lo = cu_q[b], tq = cu_q[b + 1] - cu_q[b], n = seq_lens[b];
        if (tq < min_tq || tq <= 0) continue;
        const int nk = (n + 15) / 16 * 16;
        const int32_t* table = tables + (int64_t)b * table_stride;
        uint32_t* kp = (uint32_t*)malloc((size_t)nk * D * 2);
        uint32_t* vp = (uint32_t*)malloc((size_t)(nk + 2) * D * 2);
        if (!kp || !vp) { free(kp); free(vp); return 1; }
        for (int h = 0; h < hkv; ++h) {
            pack_kv<D>(kc, vc, table, block_stride, bs, hkv, h, n, kp, vp);
#pragma omp parallel num_threads(nthreads)
            {
                float* s = (float*)malloc((size_t)G * nk * sizeof(float));
                uint16_t* pr = (uint16_t*)malloc((size_t)G * (nk + 2) * sizeof(uint16_t));
                if (!s || !pr) {
#pragma omp atomic write
                    status = 1;
                } else {
#pragma omp for schedule(dynamic, 16)
                    for (int i = 0; i < tq; ++i) {
                        const int64_t row = (int64_t)(lo + i) * tok_stride + (int64_t)h * G * D;
                        attend_rows<D, G>(q + row, D, kp, vp, n - tq + i + 1, scale, s, pr, nk, out + row, D);
                    }
                }
                free(s);
                free(pr);
            }
        }
        free(kp);
        free(vp);
    }
    return status;
}

typedef int (*runner_t)(const uint16_t*, const uint16_t*, const uint16_t*, int64_t, int, int, const int32_t*,
                        int64_t, const int32_t*, const int32_t*, int, int, float, uint16_t*, int);

template <int D>
runner_t pick_group(int g) {
    switch (g) {
        case 1: return run<D, 1>;
        case 2: return run<D, 2>;
        case 3: return run<D, 3>;
        case 4: return run<D, 4>;
        case 5: return run<D, 5>;
        case 6: return run<D, 6>;
        case 7: return run<D, 7>;
        case 8: return run<D, 8>;
        default: return nullptr;
    }
}

runner_t pick(int d, int g) {
    switch (d) {
        case 32: return pick_group<32>(g);
        case 64: return pick_group<64>(g);
        case 128: return pick_group<128>(g);
        default: return nullptr;
    }
}

}  // namespace

extern "C" {

// 1 when this CPU runs the kernel (AVX-512 F/BW/VL and BF16), else 0. Compiled without AVX-512
// so that calling it is safe anywhere.
int pg_cpu_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

// 1 when (head_dim, group) has a compiled instance.
int pg_shape_supported(int head_dim, int group) { return pick(head_dim, group) != nullptr; }

// Attention of every sequence b with at least min_tq new tokens; rows of other sequences of `out`
// are left untouched. Returns 0, 1 when out of memory, 2 for an unsupported shape.
int pg_paged_attention(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache, int64_t block_stride,
                       int block_size, int num_kv_heads, int head_dim, int group, const int32_t* block_tables,
                       int64_t table_stride, const int32_t* cu_q, const int32_t* seq_lens, int num_seqs, int min_tq,
                       float scale, uint16_t* out, int num_threads) {
    runner_t f = pick(head_dim, group);
    if (!f) return 2;
    return f(q, k_cache, v_cache, block_stride, block_size, num_kv_heads, block_tables, table_stride, cu_q,
             seq_lens, num_seqs, min_tq, scale, out, num_threads < 1 ? 1 : num_threads);
}

// out [m, o] = x [m, in] @ w [o, in]^T (+ bias [o]); in a multiple of 32; out float32 when
// out_is_f32, else bf16. All contiguous. Returns 0, or 2 when `in` is not a multiple of 32.
int pg_linear(const uint16_t* x, const uint16_t* w, const uint16_t* bias, int m, int in, int out_features,
              void* out, int out_is_f32, int num_threads) {
    if (in % 32 != 0) return 2;
    float* out32 = out_is_f32 ? (float*)out : nullptr;
    uint16_t* out16 = out_is_f32 ? nullptr : (uint16_t*)out;
    const int chunk = 256;
    const int nchunks = (out_features + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) num_threads(num_threads < 1 ? 1 : num_threads) if (nchunks > 1 && num_threads > 1)
    for (int ci = 0; ci < nchunks; ++ci) {
        const int lo = ci * chunk, hi = lo + chunk < out_features ? lo + chunk : out_features;
        linear_rows(x, w, bias, m, in, lo, hi, out32, out16, out_features);
    }
    return 0;
}

}  // extern "C"
