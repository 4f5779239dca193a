/* Zero-skipping products for the first layer of an MLP (used by ext/hogwild.pyx).
 *
 * Inputs such as MNIST pixels are mostly zeros (81% of MNIST's are), and a dense GEMM
 * multiplies every one of them. The first layer's two products with the mini-batch X
 * (nb x n_in, row-major, dense in memory) are
 *
 *   forward:        Z += X @ W             (W: n_in x n, Z: nb x n)
 *   weight update:  W += alpha * X^T @ D   (D: nb x n; also into W2 when it is not NULL)
 *
 * Both are computed here as register-blocked GEMMs that skip what is zero in a whole
 * block: the forward pass takes X in blocks of HP_RB rows and only visits the input
 * columns that are nonzero in at least one row of the block; the update takes X in blocks
 * of HP_RB columns and only visits the rows that are nonzero in at least one of them. A
 * block's nonzero pattern is listed once per call (``hp_zskip_plan``) and used for every
 * output panel. Rows of 4-KiB-aligned matrices (n = 1024) map to a few cache sets, so each
 * panel of the streamed matrix is first copied into contiguous scratch (``pack``).
 *
 * Two builds of the same algorithm, chosen at run time (``hp_zskip_cpu_isa``), so the
 * extension needs no -march flag and runs on any x86-64:
 *
 *   AVX-512F       a 4 x 64 micro-kernel: 16 accumulators in zmm registers; per visited
 *                  input 4 loads of the streamed panel and 16 fused multiply-adds.
 *   AVX2 + FMA     a 4 x 24 micro-kernel: 12 accumulators in ymm registers (AVX2 has 16),
 *                  per visited input 3 loads and 12 fused multiply-adds. 4 x 32 would need
 *                  16 accumulators plus a broadcast and a load register and spills; 4 x 16
 *                  leaves 8 accumulators, just the 2 FMA pipes x 4 cycles of latency.
 *
 * Each function carries its own ``target`` attribute (no global -mavx2/-mavx512f flag),
 * so the compiler emits AVX-512 or AVX2 instructions only inside them, and the caller
 * passes the instruction set to ``hp_zskip_plan``; ``hp_zskip_supported`` says which this
 * CPU (and its operating system, which must save the wider registers) can run.
 *
 * Exact sums: every output element is the same sum of products as the dense product
 * (terms that are zero are left out), added in order of increasing input index, so results
 * agree with BLAS to rounding.
 *
 * Without AVX2 and FMA (or off x86-64, or without GCC/Clang) nothing here is available
 * and callers use BLAS: a portable C version was measured and not kept, since compiled
 * for baseline x86-64 (SSE2) it ran 3-5x slower than OpenBLAS's dense sgemm even at
 * MNIST's density, so it would lose everywhere.
 */
#ifndef HPCPS_ZERO_SKIP_H
#define HPCPS_ZERO_SKIP_H

#include <stddef.h>
#include <string.h>

#define HP_RB 4        /* rows (forward) or input columns (update) per block */
#define HP_PANEL 64    /* output columns per AVX-512 micro-kernel call: 4 zmm */
#define HP_PANEL2 24   /* output columns per AVX2 micro-kernel call: 3 ymm */

/* Instruction sets, in increasing order; each CPU runs every one up to its best. */
#define HP_ISA_NONE 0
#define HP_ISA_AVX2 1      /* AVX2 and FMA */
#define HP_ISA_AVX512 2    /* AVX-512F */

/* Scratch sizes, in elements, for nb x n_in mini-batches (any instruction set). */
static inline size_t hp_zskip_ints(int nb, int n_in)
{
    size_t rblocks = (size_t)(nb + HP_RB - 1) / HP_RB;
    size_t cblocks = (size_t)(n_in + HP_RB - 1) / HP_RB;
    /* +16: the compress-store of the last 16 columns may write a full vector */
    return (rblocks + 1) + rblocks * n_in + 16 + (cblocks + 1) + cblocks * nb;
}

static inline size_t hp_zskip_floats(int nb, int n_in)
{
    size_t pack = (size_t)(n_in > nb ? n_in : nb) * HP_PANEL;   /* >= HP_PANEL2 wide */
    return (size_t)n_in + (size_t)nb * HP_RB + pack;
}

/* The plan of one mini-batch: which inputs each block visits, and with which kernels. */
typedef struct {
    int isa;        /* HP_ISA_AVX2 or HP_ISA_AVX512 */
    int nb, n_in;
    const float *X;
    int *rstart;    /* rblocks + 1: offsets into rcols per row block */
    int *rcols;     /* input columns nonzero in some row of the block, ascending */
    int *cstart;    /* cblocks + 1: offsets into crows per column block */
    int *crows;     /* rows nonzero in some column of the block, ascending */
    float *zero;    /* n_in zeros: the missing rows of a last, partial row block */
    float *tail;    /* HP_RB values per row listed for the last column block when it is
                       partial (n_in not a multiple of HP_RB), zero-padded */
    float *pack;    /* a panel of W or D, contiguous */
} hp_plan;

#if defined(__GNUC__) && defined(__x86_64__)
#define HP_HAVE_X86 1
#include <immintrin.h>
#define HP_T512 __attribute__((target("avx512f")))
#define HP_T2 __attribute__((target("avx2,fma")))
#define HP_UNROLL _Pragma("GCC unroll 16")
#endif

#ifdef HP_HAVE_X86

/* The best instruction set this CPU runs the kernels with (GCC's and Clang's checks also
 * ask the OS whether it saves the ymm/zmm registers). Cached; every call gives the same. */
static int hp_zskip_cpu_isa(void)
{
    static int isa = -1;
    if (isa < 0) {
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx512f"))
            isa = HP_ISA_AVX512;
        else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
            isa = HP_ISA_AVX2;
        else
            isa = HP_ISA_NONE;
    }
    return isa;
}

/* --------------------------------------------------------------- shared by both builds */

/* Lay the scratch out for an nb x n_in batch X. */
static inline void hp_plan_layout(hp_plan *pl, int isa, int nb, int n_in, const float *X,
                                  int *iscratch, float *fscratch)
{
    int rblocks = (nb + HP_RB - 1) / HP_RB, cblocks = (n_in + HP_RB - 1) / HP_RB;
    pl->isa = isa;
    pl->nb = nb;
    pl->n_in = n_in;
    pl->X = X;
    pl->rstart = iscratch;
    pl->rcols = pl->rstart + rblocks + 1;
    pl->cstart = pl->rcols + (size_t)rblocks * n_in + 16;
    pl->crows = pl->cstart + cblocks + 1;
    pl->zero = fscratch;
    pl->tail = pl->zero + n_in;
    pl->pack = pl->tail + (size_t)nb * HP_RB;
    memset(pl->zero, 0, (size_t)n_in * sizeof(float));
}

/* List, per block of HP_RB columns of X, the rows nonzero in one of them (the update's
 * pattern); inlined into each build's plan. */
static inline void hp_plan_cols(hp_plan *pl)
{
    int nb = pl->nb, n_in = pl->n_in, cblocks = (n_in + HP_RB - 1) / HP_RB;
    const float *X = pl->X;
    int ccnt = 0;
    for (int b = 0; b < cblocks; b++) {
        int j0 = b * HP_RB, cb = n_in - j0 < HP_RB ? n_in - j0 : HP_RB;
        pl->cstart[b] = ccnt;
        for (int r = 0; r < nb; r++) {
            const float *x = X + (size_t)r * n_in + j0;
            int any = 0;
            for (int q = 0; q < cb; q++)
                any |= x[q] != 0.0f;
            pl->crows[ccnt] = r;   /* branch-free: always write, advance when used */
            ccnt += any;
        }
        if (cb < HP_RB) {
            for (int u = pl->cstart[b]; u < ccnt; u++)
                for (int q = 0; q < HP_RB; q++)
                    pl->tail[(size_t)(u - pl->cstart[b]) * HP_RB + q] =
                        q < cb ? X[(size_t)pl->crows[u] * n_in + j0 + q] : 0.0f;
        }
    }
    pl->cstart[cblocks] = ccnt;
}

static inline double hp_plan_work(const hp_plan *pl)
{
    int rblocks = (pl->nb + HP_RB - 1) / HP_RB;
    double dense = (double)rblocks * pl->n_in;
    return dense > 0 ? (double)pl->rstart[rblocks] / dense : 1.0;
}

/* ----------------------------------------------------------------------------- AVX-512F */

HP_T512 static inline __mmask16 hp_mask(int w, int i)
{
    int left = w - 16 * i;
    if (left >= 16)
        return (__mmask16)0xFFFF;
    if (left <= 0)
        return (__mmask16)0;
    return (__mmask16)((1u << left) - 1u);
}

/* The forward pattern (columns nonzero in a block of rows) by compress-stores. */
HP_T512 static double hp_zskip_plan_avx512(hp_plan *pl)
{
    int nb = pl->nb, n_in = pl->n_in, rblocks = (nb + HP_RB - 1) / HP_RB;
    const float *X = pl->X;
    const __m512i step = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2,
                                          1, 0);
    const __m512 zero = _mm512_setzero_ps();
    int cnt = 0;
    for (int b = 0; b < rblocks; b++) {
        int r0 = b * HP_RB, rb = nb - r0 < HP_RB ? nb - r0 : HP_RB;
        pl->rstart[b] = cnt;
        for (int j = 0; j < n_in; j += 16) {
            __mmask16 in = hp_mask(n_in - j, 0), any = 0;
            for (int q = 0; q < rb; q++)
                any |= _mm512_mask_cmp_ps_mask(
                    in, _mm512_maskz_loadu_ps(in, X + (size_t)(r0 + q) * n_in + j), zero,
                    _CMP_NEQ_UQ);
            _mm512_mask_compressstoreu_epi32(pl->rcols + cnt, any,
                                             _mm512_add_epi32(step, _mm512_set1_epi32(j)));
            cnt += __builtin_popcount((unsigned)any);
        }
    }
    pl->rstart[rblocks] = cnt;
    hp_plan_cols(pl);
    return hp_plan_work(pl);
}

/* acc[q][i] += sum over u < cnt of XV(u, q) * S[idx[u]][16 i ..]; S contiguous, ld 64 */
#define HP_MICRO(cnt, idx, XV, S)                                                        \
    for (int u = 0; u < (cnt); u++) {                                                    \
        const float *s_ = (S) + (size_t)(idx)[u] * HP_PANEL;                             \
        __m512 s0 = _mm512_loadu_ps(s_), s1 = _mm512_loadu_ps(s_ + 16);                  \
        __m512 s2 = _mm512_loadu_ps(s_ + 32), s3 = _mm512_loadu_ps(s_ + 48);             \
        HP_UNROLL for (int q = 0; q < HP_RB; q++) {                                      \
            __m512 x_ = _mm512_set1_ps(XV(u, q));                                        \
            acc[q][0] = _mm512_fmadd_ps(x_, s0, acc[q][0]);                              \
            acc[q][1] = _mm512_fmadd_ps(x_, s1, acc[q][1]);                              \
            acc[q][2] = _mm512_fmadd_ps(x_, s2, acc[q][2]);                              \
            acc[q][3] = _mm512_fmadd_ps(x_, s3, acc[q][3]);                              \
        }                                                                                \
    }

/* Copy columns [p, p + w) of the rows x n matrix M into pack (rows x 64, zero-padded). */
HP_T512 static void hp_pack_panel(const float *M, int rows, int n, int p, int w,
                                  float *pack)
{
    for (int r = 0; r < rows; r++) {
        float *dst = pack + (size_t)r * HP_PANEL;
        const float *src = M + (size_t)r * n + p;
        HP_UNROLL for (int i = 0; i < 4; i++) {
            __mmask16 m = hp_mask(w, i);
            _mm512_storeu_ps(dst + 16 * i, _mm512_maskz_loadu_ps(m, src + 16 * i));
        }
    }
}

/* Z (nb x n) += X @ W, W n_in x n; X's pattern from the plan. */
HP_T512 static void hp_zskip_forward_avx512(const hp_plan *pl, int n, const float *W,
                                            float *Z)
{
    int nb = pl->nb, n_in = pl->n_in, rblocks = (nb + HP_RB - 1) / HP_RB;
    for (int p = 0; p < n; p += HP_PANEL) {
        int w = n - p < HP_PANEL ? n - p : HP_PANEL;
        __mmask16 m[4];
        for (int i = 0; i < 4; i++)
            m[i] = hp_mask(w, i);
        hp_pack_panel(W, n_in, n, p, w, pl->pack);
        for (int b = 0; b < rblocks; b++) {
            int r0 = b * HP_RB, rb = nb - r0 < HP_RB ? nb - r0 : HP_RB;
            __m512 acc[HP_RB][4];
            HP_UNROLL for (int q = 0; q < HP_RB; q++)
                HP_UNROLL for (int i = 0; i < 4; i++)
                    acc[q][i] = q < rb ? _mm512_maskz_loadu_ps(
                        m[i], Z + (size_t)(r0 + q) * n + p + 16 * i) : _mm512_setzero_ps();
            const float *xr[HP_RB];
            for (int q = 0; q < HP_RB; q++)
                xr[q] = q < rb ? pl->X + (size_t)(r0 + q) * n_in : pl->zero;
            const int s = pl->rstart[b], *cols = pl->rcols + s;
#define HP_XV_ROWS(u, q) (xr[q][cols[u]])
            HP_MICRO(pl->rstart[b + 1] - s, cols, HP_XV_ROWS, pl->pack)
#undef HP_XV_ROWS
            for (int q = 0; q < rb; q++)
                HP_UNROLL for (int i = 0; i < 4; i++)
                    _mm512_mask_storeu_ps(Z + (size_t)(r0 + q) * n + p + 16 * i, m[i],
                                          acc[q][i]);
        }
    }
}

/* W (n_in x n) += alpha * X^T @ D, and W2 too when not NULL; D nb x n. */
HP_T512 static void hp_zskip_update_avx512(const hp_plan *pl, int n, const float *D,
                                           float alpha, float *W, float *W2)
{
    int nb = pl->nb, n_in = pl->n_in, cblocks = (n_in + HP_RB - 1) / HP_RB;
    const __m512 a = _mm512_set1_ps(alpha);
    for (int p = 0; p < n; p += HP_PANEL) {
        int w = n - p < HP_PANEL ? n - p : HP_PANEL;
        __mmask16 m[4];
        for (int i = 0; i < 4; i++)
            m[i] = hp_mask(w, i);
        hp_pack_panel(D, nb, n, p, w, pl->pack);
        for (int b = 0; b < cblocks; b++) {
            int s = pl->cstart[b], e = pl->cstart[b + 1];
            if (s == e)
                continue;
            int j0 = b * HP_RB, cb = n_in - j0 < HP_RB ? n_in - j0 : HP_RB;
            __m512 acc[HP_RB][4];
            HP_UNROLL for (int q = 0; q < HP_RB; q++)
                HP_UNROLL for (int i = 0; i < 4; i++)
                    acc[q][i] = _mm512_setzero_ps();
            const int *rows = pl->crows + s;
            if (cb == HP_RB) {
                const float *xc = pl->X + j0;
#define HP_XV_COLS(u, q) (xc[(size_t)rows[u] * n_in + (q)])
                HP_MICRO(e - s, rows, HP_XV_COLS, pl->pack)
#undef HP_XV_COLS
            } else {
                const float *t = pl->tail;
#define HP_XV_TAIL(u, q) (t[(size_t)(u) * HP_RB + (q)])
                HP_MICRO(e - s, rows, HP_XV_TAIL, pl->pack)
#undef HP_XV_TAIL
            }
            for (int q = 0; q < cb; q++) {
                float *wr = W + (size_t)(j0 + q) * n + p;
                HP_UNROLL for (int i = 0; i < 4; i++)
                    _mm512_mask_storeu_ps(wr + 16 * i, m[i], _mm512_fmadd_ps(
                        a, acc[q][i], _mm512_maskz_loadu_ps(m[i], wr + 16 * i)));
                if (W2 != NULL) {
                    float *w2 = W2 + (size_t)(j0 + q) * n + p;
                    HP_UNROLL for (int i = 0; i < 4; i++)
                        _mm512_mask_storeu_ps(w2 + 16 * i, m[i], _mm512_fmadd_ps(
                            a, acc[q][i], _mm512_maskz_loadu_ps(m[i], w2 + 16 * i)));
                }
            }
        }
    }
}

/* --------------------------------------------------------------------------- AVX2 + FMA */

/* Lanes [0, w - 8 i) of the i-th 8-float vector of a w-wide row, as a maskload mask. */
HP_T2 static inline __m256i hp_mask2(int w, int i)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(w - 8 * i),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* The forward pattern: compare 8 columns of each row of the block with zero, then list
 * the nonzero ones branch-free (AVX2 has no compress-store; a branch per bit mispredicts
 * on image data). */
HP_T2 static double hp_zskip_plan_avx2(hp_plan *pl)
{
    int nb = pl->nb, n_in = pl->n_in, rblocks = (nb + HP_RB - 1) / HP_RB;
    const float *X = pl->X;
    const __m256 zero = _mm256_setzero_ps();
    int cnt = 0;
    for (int b = 0; b < rblocks; b++) {
        int r0 = b * HP_RB, rb = nb - r0 < HP_RB ? nb - r0 : HP_RB;
        pl->rstart[b] = cnt;
        for (int j = 0; j < n_in; j += 8) {
            unsigned any = 0;
            if (n_in - j >= 8) {
                for (int q = 0; q < rb; q++)
                    any |= (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(
                        _mm256_loadu_ps(X + (size_t)(r0 + q) * n_in + j), zero,
                        _CMP_NEQ_UQ));
            } else {   /* masked-off lanes load as 0.0: never listed */
                __m256i in = hp_mask2(n_in - j, 0);
                for (int q = 0; q < rb; q++)
                    any |= (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(
                        _mm256_maskload_ps(X + (size_t)(r0 + q) * n_in + j, in), zero,
                        _CMP_NEQ_UQ));
            }
            HP_UNROLL for (int k = 0; k < 8; k++) {
                pl->rcols[cnt] = j + k;   /* always write, advance when nonzero */
                cnt += (any >> k) & 1u;
            }
        }
    }
    pl->rstart[rblocks] = cnt;
    hp_plan_cols(pl);
    return hp_plan_work(pl);
}

/* acc[q][i] += sum over u < cnt of XV(u, q) * S[idx[u]][8 i ..]; S contiguous, ld 24 */
#define HP_MICRO2(cnt, idx, XV, S)                                                       \
    for (int u = 0; u < (cnt); u++) {                                                    \
        const float *s_ = (S) + (size_t)(idx)[u] * HP_PANEL2;                            \
        __m256 s0 = _mm256_loadu_ps(s_), s1 = _mm256_loadu_ps(s_ + 8);                   \
        __m256 s2 = _mm256_loadu_ps(s_ + 16);                                            \
        HP_UNROLL for (int q = 0; q < HP_RB; q++) {                                      \
            __m256 x_ = _mm256_set1_ps(XV(u, q));                                        \
            acc[q][0] = _mm256_fmadd_ps(x_, s0, acc[q][0]);                              \
            acc[q][1] = _mm256_fmadd_ps(x_, s1, acc[q][1]);                              \
            acc[q][2] = _mm256_fmadd_ps(x_, s2, acc[q][2]);                              \
        }                                                                                \
    }

/* Copy columns [p, p + w) of the rows x n matrix M into pack (rows x 24, zero-padded). */
HP_T2 static void hp_pack_panel2(const float *M, int rows, int n, int p, int w, float *pack)
{
    __m256i m[3];
    for (int i = 0; i < 3; i++)
        m[i] = hp_mask2(w, i);
    for (int r = 0; r < rows; r++) {
        float *dst = pack + (size_t)r * HP_PANEL2;
        const float *src = M + (size_t)r * n + p;
        if (w == HP_PANEL2) {
            HP_UNROLL for (int i = 0; i < 3; i++)
                _mm256_storeu_ps(dst + 8 * i, _mm256_loadu_ps(src + 8 * i));
        } else {
            HP_UNROLL for (int i = 0; i < 3; i++)
                _mm256_storeu_ps(dst + 8 * i, _mm256_maskload_ps(src + 8 * i, m[i]));
        }
    }
}

/* v = lanes [8 i, 8 i + 8) of the w-wide row at r (zero past w); store them back. Masked
 * moves only in a last, partial panel: AMD's masked stores are slow. */
#define HP_LOAD2(r, i) (full ? _mm256_loadu_ps((r) + 8 * (i))                              \
                             : _mm256_maskload_ps((r) + 8 * (i), m[i]))
#define HP_STORE2(r, i, v)                                                               \
    do {                                                                                 \
        if (full)                                                                        \
            _mm256_storeu_ps((r) + 8 * (i), (v));                                        \
        else                                                                             \
            _mm256_maskstore_ps((r) + 8 * (i), m[i], (v));                               \
    } while (0)

/* Z (nb x n) += X @ W, W n_in x n; X's pattern from the plan. */
HP_T2 static void hp_zskip_forward_avx2(const hp_plan *pl, int n, const float *W, float *Z)
{
    int nb = pl->nb, n_in = pl->n_in, rblocks = (nb + HP_RB - 1) / HP_RB;
    for (int p = 0; p < n; p += HP_PANEL2) {
        int w = n - p < HP_PANEL2 ? n - p : HP_PANEL2, full = w == HP_PANEL2;
        __m256i m[3];
        for (int i = 0; i < 3; i++)
            m[i] = hp_mask2(w, i);
        hp_pack_panel2(W, n_in, n, p, w, pl->pack);
        for (int b = 0; b < rblocks; b++) {
            int r0 = b * HP_RB, rb = nb - r0 < HP_RB ? nb - r0 : HP_RB;
            __m256 acc[HP_RB][3];
            HP_UNROLL for (int q = 0; q < HP_RB; q++)
                HP_UNROLL for (int i = 0; i < 3; i++)
                    acc[q][i] = q < rb ? HP_LOAD2(Z + (size_t)(r0 + q) * n + p, i)
                                       : _mm256_setzero_ps();
            const float *xr[HP_RB];
            for (int q = 0; q < HP_RB; q++)
                xr[q] = q < rb ? pl->X + (size_t)(r0 + q) * n_in : pl->zero;
            const int s = pl->rstart[b], *cols = pl->rcols + s;
#define HP_XV_ROWS(u, q) (xr[q][cols[u]])
            HP_MICRO2(pl->rstart[b + 1] - s, cols, HP_XV_ROWS, pl->pack)
#undef HP_XV_ROWS
            for (int q = 0; q < rb; q++)
                HP_UNROLL for (int i = 0; i < 3; i++)
                    HP_STORE2(Z + (size_t)(r0 + q) * n + p, i, acc[q][i]);
        }
    }
}

/* W (n_in x n) += alpha * X^T @ D, and W2 too when not NULL; D nb x n. */
HP_T2 static void hp_zskip_update_avx2(const hp_plan *pl, int n, const float *D,
                                       float alpha, float *W, float *W2)
{
    int nb = pl->nb, n_in = pl->n_in, cblocks = (n_in + HP_RB - 1) / HP_RB;
    const __m256 a = _mm256_set1_ps(alpha);
    for (int p = 0; p < n; p += HP_PANEL2) {
        int w = n - p < HP_PANEL2 ? n - p : HP_PANEL2, full = w == HP_PANEL2;
        __m256i m[3];
        for (int i = 0; i < 3; i++)
            m[i] = hp_mask2(w, i);
        hp_pack_panel2(D, nb, n, p, w, pl->pack);
        for (int b = 0; b < cblocks; b++) {
            int s = pl->cstart[b], e = pl->cstart[b + 1];
            if (s == e)
                continue;
            int j0 = b * HP_RB, cb = n_in - j0 < HP_RB ? n_in - j0 : HP_RB;
            __m256 acc[HP_RB][3];
            HP_UNROLL for (int q = 0; q < HP_RB; q++)
                HP_UNROLL for (int i = 0; i < 3; i++)
                    acc[q][i] = _mm256_setzero_ps();
            const int *rows = pl->crows + s;
            if (cb == HP_RB) {
                const float *xc = pl->X + j0;
#define HP_XV_COLS(u, q) (xc[(size_t)rows[u] * n_in + (q)])
                HP_MICRO2(e - s, rows, HP_XV_COLS, pl->pack)
#undef HP_XV_COLS
            } else {
                const float *t = pl->tail;
#define HP_XV_TAIL(u, q) (t[(size_t)(u) * HP_RB + (q)])
                HP_MICRO2(e - s, rows, HP_XV_TAIL, pl->pack)
#undef HP_XV_TAIL
            }
            for (int q = 0; q < cb; q++) {
                float *wr = W + (size_t)(j0 + q) * n + p;
                HP_UNROLL for (int i = 0; i < 3; i++)
                    HP_STORE2(wr, i, _mm256_fmadd_ps(a, acc[q][i], HP_LOAD2(wr, i)));
                if (W2 != NULL) {
                    float *w2 = W2 + (size_t)(j0 + q) * n + p;
                    HP_UNROLL for (int i = 0; i < 3; i++)
                        HP_STORE2(w2, i, _mm256_fmadd_ps(a, acc[q][i], HP_LOAD2(w2, i)));
                }
            }
        }
    }
}

#undef HP_LOAD2
#undef HP_STORE2

/* ------------------------------------------------------------------------------ dispatch */

/* Lay the scratch out, list the nonzero patterns of X (nb x n_in, row-major) and fix the
 * kernels (``isa``, which the caller has checked with ``hp_zskip_supported``) the forward
 * and update calls with this plan use. Returns the work left for the forward product as a
 * fraction of the dense one. */
static double hp_zskip_plan(hp_plan *pl, int isa, int nb, int n_in, const float *X,
                            int *iscratch, float *fscratch)
{
    hp_plan_layout(pl, isa, nb, n_in, X, iscratch, fscratch);
    if (isa == HP_ISA_AVX512)
        return hp_zskip_plan_avx512(pl);
    return hp_zskip_plan_avx2(pl);
}

static void hp_zskip_forward(const hp_plan *pl, int n, const float *W, float *Z)
{
    if (pl->isa == HP_ISA_AVX512)
        hp_zskip_forward_avx512(pl, n, W, Z);
    else
        hp_zskip_forward_avx2(pl, n, W, Z);
}

static void hp_zskip_update(const hp_plan *pl, int n, const float *D, float alpha,
                            float *W, float *W2)
{
    if (pl->isa == HP_ISA_AVX512)
        hp_zskip_update_avx512(pl, n, D, alpha, W, W2);
    else
        hp_zskip_update_avx2(pl, n, D, alpha, W, W2);
}

#else  /* not x86-64 with GCC/Clang: nothing is supported, BLAS is used */

static int hp_zskip_cpu_isa(void) { return HP_ISA_NONE; }

static double hp_zskip_plan(hp_plan *pl, int isa, int nb, int n_in, const float *X,
                            int *iscratch, float *fscratch)
{
    (void)pl; (void)isa; (void)nb; (void)n_in; (void)X; (void)iscratch; (void)fscratch;
    return 2.0;   /* more than the dense work: never worth using */
}

static void hp_zskip_forward(const hp_plan *pl, int n, const float *W, float *Z)
{
    (void)pl; (void)n; (void)W; (void)Z;
}

static void hp_zskip_update(const hp_plan *pl, int n, const float *D, float alpha,
                            float *W, float *W2)
{
    (void)pl; (void)n; (void)D; (void)alpha; (void)W; (void)W2;
}

#endif

/* True when this CPU runs the kernels with ``isa`` (every set up to its best). */
static inline int hp_zskip_supported(int isa)
{
    return isa > HP_ISA_NONE && isa <= hp_zskip_cpu_isa();
}

#endif
