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
 * output panel. The inner loop is a 4 x 64 micro-kernel: 16 accumulators in zmm registers,
 * per visited input 4 loads of the streamed matrix and 16 fused multiply-adds, so most of
 * the speed of a dense GEMM is kept while the skipped work is not done at all. Rows of
 * 4-KiB-aligned matrices (n = 1024) map to a few cache sets, so each 64-column panel of
 * the streamed matrix is first copied into contiguous scratch (``pack``).
 *
 * Exact sums: every output element is the same sum of products as the dense product
 * (terms that are zero are left out), added in order of increasing input index, so results
 * agree with BLAS to rounding.
 *
 * AVX-512F only: the engine asks ``hp_zskip_available()`` (a run-time CPU check, so the
 * extension needs no -march flag) and uses BLAS when it returns 0. A portable C version
 * was not kept: compiled for baseline x86-64 it ran 3-5x slower than OpenBLAS's dense
 * sgemm even at MNIST's density, so it would lose everywhere.
 */
#ifndef HPCPS_ZERO_SKIP_H
#define HPCPS_ZERO_SKIP_H

#include <stddef.h>
#include <string.h>

#define HP_RB 4        /* rows (forward) or input columns (update) per block */
#define HP_PANEL 64    /* output columns per micro-kernel call: 4 zmm */

/* Scratch sizes, in elements, for nb x n_in mini-batches. */
static inline size_t hp_zskip_ints(int nb, int n_in)
{
    size_t rblocks = (size_t)(nb + HP_RB - 1) / HP_RB;
    size_t cblocks = (size_t)(n_in + HP_RB - 1) / HP_RB;
    /* +16: the compress-store of the last 16 columns may write a full vector */
    return (rblocks + 1) + rblocks * n_in + 16 + (cblocks + 1) + cblocks * nb;
}

static inline size_t hp_zskip_floats(int nb, int n_in)
{
    size_t pack = (size_t)(n_in > nb ? n_in : nb) * HP_PANEL;
    return (size_t)n_in + (size_t)nb * HP_RB + pack;
}

#if defined(__GNUC__) && defined(__x86_64__)
#define HP_HAVE_X86 1
#include <immintrin.h>
#define HP_TARGET __attribute__((target("avx512f")))
#define HP_UNROLL _Pragma("GCC unroll 16")
#endif

#ifdef HP_HAVE_X86

static int hp_zskip_cpu = -1;

static int hp_zskip_available(void)
{
    if (hp_zskip_cpu < 0) {
        __builtin_cpu_init();
        hp_zskip_cpu = __builtin_cpu_supports("avx512f") ? 1 : 0;
    }
    return hp_zskip_cpu;
}

HP_TARGET static inline __mmask16 hp_mask(int w, int i)
{
    int left = w - 16 * i;
    if (left >= 16)
        return (__mmask16)0xFFFF;
    if (left <= 0)
        return (__mmask16)0;
    return (__mmask16)((1u << left) - 1u);
}

/* The plan of one mini-batch: which inputs each block visits. */
typedef struct {
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

/* Lay the scratch out and list the nonzero patterns of X (nb x n_in, row-major). Returns
 * the work left for the forward product as a fraction of the dense one. */
HP_TARGET static double hp_zskip_plan(hp_plan *pl, int nb, int n_in, const float *X,
                                      int *iscratch, float *fscratch)
{
    int rblocks = (nb + HP_RB - 1) / HP_RB, cblocks = (n_in + HP_RB - 1) / HP_RB;
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
    return rblocks * n_in > 0 ? (double)cnt / ((double)rblocks * n_in) : 1.0;
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
HP_TARGET static void hp_pack_panel(const float *M, int rows, int n, int p, int w,
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
HP_TARGET static void hp_zskip_forward(const hp_plan *pl, int n, const float *W, float *Z)
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
HP_TARGET static void hp_zskip_update(const hp_plan *pl, int n, const float *D, float alpha,
                                      float *W, float *W2)
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

#else  /* not x86-64 with GCC/Clang: never available, BLAS is used */

typedef struct { int nb; } hp_plan;
static double hp_zskip_plan(hp_plan *pl, int nb, int n_in, const float *X, int *iscratch,
                            float *fscratch)
{
    (void)pl; (void)nb; (void)n_in; (void)X; (void)iscratch; (void)fscratch;
    return 1.0;
}

static int hp_zskip_available(void) { return 0; }
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
#endif
