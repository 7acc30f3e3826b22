/*
 * gemm_amx.c - gemm.c's packed BF16 product on Intel's AMX tiles (Sapphire Rapids and later).
 *
 * One TDPBF16PS multiplies a 16 x 32 BF16 tile by a 32 x 16 one into 16 x 16 F32 sums: 16,384
 * FLOPs an instruction, against 32 for AVX512-BF16's VDPBF16PS. The weight needs no packing of
 * its own: gemm.c's layout ([32-row block][k pair][32 rows][2]) is already the pair-interleaved
 * form AMX wants for its right operand, so a block's pairs p .. p+15 are two tiles 128 bytes
 * apart (rows 0-15 and 16-31 of the block). The activations are plain row-major BF16 here, one
 * token a row of 2 kp values, 32 tokens a block, and the result comes out as [token][row], which
 * is the layout of the product's output. Per 32 x 32 block of the result four accumulator tiles,
 * two activation tiles and two weight tiles: all eight AMX registers.
 *
 * Linux hands the 8 KiB of tile state to a process only when asked (arch_prctl), once; each thread
 * then loads the tile configuration when it enters a product and releases it on the way out, so
 * the kernel need not save the tiles. ggml's own AMX kernels (llama.cpp's AMX buffer type) set
 * their configuration once per thread and assume it stays; they share ggml's OpenMP threads with
 * this one, which is one more reason the generator keeps weights out of that buffer type on AMX
 * CPUs (generation/llama.py, extra_buffers_safe).
 */
#include "rg_internal.h"
#include "kernels.h"

#include <string.h>

#define MR  32      /* rows of a weight block (gemm.c's) */
#define TB  32      /* tokens of an activation block */

#if defined(__x86_64__) && defined(__GNUC__) && (defined(__clang__) || __GNUC__ >= 11) && defined(__linux__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

bool rg_amx_ready(void) {
    static int state = -1;      /* -1: not asked yet; racing first callers ask twice, harmlessly */
    if (state < 0) {
        unsigned a, b, c, d;
        const bool cpu = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 22)) && (d & (1u << 24));
        /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA */
        state = cpu && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    }
    return state == 1;
}

/* x: F32 [k, T] (columns contiguous); dst: BF16 [2 kp, 32 ceil(T / 32)], token t's values in row t,
 * zeros past k and past T. Converted with round-to-nearest-even, as gemm.c's other packing. */
__attribute__((target("avx512f,avx512bf16")))
void rg_amx_pack_act(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) userdata;
    const struct ggml_tensor * x = dst->src[0];
    const int64_t k = x->ne[0], T = x->ne[1], width = dst->ne[0], rows = dst->ne[1];
    for (int64_t t = rows * ith / nth; t < rows * (ith + 1) / nth; t++) {
        uint16_t * o = (uint16_t *) ((char *) dst->data + t * dst->nb[1]);
        if (t >= T) {
            memset(o, 0, sizeof(uint16_t) * (size_t) width);
            continue;
        }
        const float * col = (const float *) ((const char *) x->data + t * x->nb[1]);
        for (int64_t i = 0; i < width; i += 32) {
            const __mmask16 mlo = rg_lanes16(k - i), mhi = rg_lanes16(k - i - 16);
            const __m512 lo = _mm512_maskz_loadu_ps(mlo, col + i), hi = _mm512_maskz_loadu_ps(mhi, col + i + 16);
            _mm512_storeu_si512(o + i, (__m512i) _mm512_cvtne2ps_pbh(hi, lo));
        }
    }
}

/* palette 1; all eight tiles 16 rows of 64 bytes */
struct tile_config {
    uint8_t  palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t  rows[16];
};

/* buf[t][r] (32 x 32, F32) += sum over q of V(r, q) Z(q, t), then the nr x nt corner to C */
__attribute__((target("avx512f")))
static void finish_block(const float * buf, float * C, int64_t ldc, int nr, int nt, const rg_lowrank * lr) {
    const __mmask16 ma = rg_lanes16(nr), mb = rg_lanes16(nr - 16);
    for (int t = 0; t < nt; t++) {
        __m512 c0 = _mm512_loadu_ps(buf + t * MR), c1 = _mm512_loadu_ps(buf + t * MR + 16);
        if (lr) {
            for (int q = 0; q < lr->r; q++) {
                const __m512 z = _mm512_set1_ps(lr->Z[t * lr->ldz + q]);
                c0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(ma, lr->V + q * lr->ldv), z, c0);
                c1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mb, lr->V + q * lr->ldv + 16), z, c1);
            }
        }
        _mm512_mask_storeu_ps(C + t * ldc, ma, c0);
        _mm512_mask_storeu_ps(C + t * ldc + 16, mb, c1);
    }
}

/* dst [rows, T] F32 = packed weight src[0] times row-major activations src[1] (+ src[2] src[3]).
 * Each thread takes a contiguous run of 32 x 32 blocks, weight block by weight block, so the
 * block's 32 rows stay in L1 while the activations stream from L2. */
__attribute__((target("amx-tile,amx-bf16,avx512f")))
void rg_amx_gemm(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) userdata;
    const struct ggml_tensor * a = dst->src[0], * b = dst->src[1], * v = dst->src[2], * z = dst->src[3];
    const int64_t rows = dst->ne[0], T = dst->ne[1], kp = a->ne[0] / (2 * MR);
    const int64_t nblk = a->ne[1], ntb = b->ne[1] / TB, n = nblk * ntb;
    const int64_t ldc = dst->nb[1] / sizeof(float), ldx = b->nb[1];
    const int64_t i0 = n * ith / nth, i1 = n * (ith + 1) / nth;
    if (i0 >= i1) return;
    struct tile_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.rows[i] = 16;
        cfg.colsb[i] = 64;
    }
    _tile_loadconfig(&cfg);
    float buf[TB * MR] __attribute__((aligned(64)));
    for (int64_t i = i0; i < i1; i++) {
        const int64_t blk = i / ntb, tb = i % ntb;
        const char * W = (const char *) a->data + blk * kp * 2 * MR * sizeof(uint16_t);
        const char * X = (const char *) b->data + tb * TB * ldx;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t p = 0; p < kp; p += 16) {
            /* 16 pairs: 64 bytes of each of 32 tokens, 16 rows of 128 bytes of the weight block */
            _tile_loadd(4, X + p * 4, ldx);
            _tile_loadd(5, X + 16 * ldx + p * 4, ldx);
            _tile_loadd(6, W + p * 128, 128);
            _tile_loadd(7, W + p * 128 + 64, 128);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        const int nr = (int) (rows - blk * MR < MR ? rows - blk * MR : MR);
        const int nt = (int) (T - tb * TB < TB ? T - tb * TB : TB);
        float * C = (float *) dst->data + tb * TB * ldc + blk * MR;
        if (nr == MR && nt == TB && !v) {
            _tile_stored(0, C, ldc * sizeof(float));
            _tile_stored(1, C + 16, ldc * sizeof(float));
            _tile_stored(2, C + 16 * ldc, ldc * sizeof(float));
            _tile_stored(3, C + 16 * ldc + 16, ldc * sizeof(float));
            continue;
        }
        _tile_stored(0, buf, MR * sizeof(float));
        _tile_stored(1, buf + 16, MR * sizeof(float));
        _tile_stored(2, buf + 16 * MR, MR * sizeof(float));
        _tile_stored(3, buf + 16 * MR + 16, MR * sizeof(float));
        const rg_lowrank lr = v ? rg_lowrank_at(v, z, blk * MR, tb * TB) : (rg_lowrank) { 0 };
        finish_block(buf, C, ldc, nr, nt, v ? &lr : NULL);
    }
    _tile_release();
}
#else
/* never run: rg_amx_ready() is false */
bool rg_amx_ready(void) { return false; }
void rg_amx_pack_act(struct ggml_tensor * dst, int ith, int nth, void * userdata) { (void) dst; (void) ith; (void) nth; (void) userdata; }
void rg_amx_gemm(struct ggml_tensor * dst, int ith, int nth, void * userdata) { (void) dst; (void) ith; (void) nth; (void) userdata; }
#endif
