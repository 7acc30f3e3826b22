/*
 * kernels.h - what the CPU kernels share: the lane helpers their SIMD loops use, the low-rank term
 * of a packed product's epilogue, the row reader their packing ops convert weights with, and the
 * entry points one kernel file offers another (gemm.c dispatches to gemm_amx.c and gemm_avx2.c;
 * attention.c runs outer.c's register tile). Not part of the ABI; the graph-level declarations
 * are in rg_internal.h.
 */
#ifndef RG_KERNELS_H
#define RG_KERNELS_H

#include "ggml.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ---- lane helpers ---------------------------------------------------------------------------- */
/* a 16-lane mask of the first n lanes (none for n <= 0, all for n >= 16): the lanes of a vector
 * that still hold data when n values are left */
static inline uint16_t rg_lanes16(int64_t n) { return n >= 16 ? 0xffff : n <= 0 ? 0 : (uint16_t) ((1u << n) - 1); }

/* an optional low-rank term added to a tile: V [rows, r] (column q at V + q ldv) times Z [r, T]
 * (token t's values at Z + t ldz), both F32, pointed at the tile's first row and token */
typedef struct {
    const float * V, * Z;
    int64_t       ldv, ldz;
    int           r;
} rg_lowrank;
/* the term for the tile whose first row is row0 and first token tok0, from v [rows, r] and z [r, T] */
static inline rg_lowrank rg_lowrank_at(const struct ggml_tensor * v, const struct ggml_tensor * z, int64_t row0,
                                       int64_t tok0) {
    const int64_t ldv = v->nb[1] / sizeof(float), ldz = z->nb[1] / sizeof(float);
    const rg_lowrank lr = { (const float *) v->data + row0, (const float *) z->data + tok0 * ldz, ldv, ldz, (int) v->ne[1] };
    return lr;
}

/* ---- convert.c ------------------------------------------------------------------------------- */
/* values [i0, i0 + n) of a weight row (F32 or a ggml type with to_float) as F32; i0 and n multiples
 * of the type's block size, or n reaching the row's end (convert.c, also the packing ops') */
void rg_row_span_f32(const struct ggml_tensor * w, const void * row, int64_t i0, int64_t n,
                     ggml_to_float_t to_float, float * out);

/* ---- outer.c --------------------------------------------------------------------------------- */
/* the register tile: acc[i][j] = sum_s B[s * ldb + i * sb] V[s * ldv + j], i < nb <= 8, j < nv <= 32 */
void rg_tile_product(const float * V, size_t ldv, const float * B, size_t ldb, size_t sb, int64_t steps, int nv, int nb,
                     float acc[8][32]);

/* ---- attn_rows.c ------------------------------------------------------------------------------ */
/* which keys of a tile one query sees: those of its sequence or its shared prefix (kseq), at or
 * before its position (kpos), within the sliding window n_swa when it is > 0 */
typedef struct {
    int32_t         seq, prefix, pos, n_swa;
    const int32_t * kseq, * kpos;
} rg_attn_row_vis;
/* whether a query (sequence seq, shared prefix prefix, position pos) sees a key (sequence kseq,
 * position kpos); swa the window, INT32_MAX for none. Bitwise, without branches: it is also the
 * body of rg_attn_scale_row's vector loop. */
static inline int rg_attn_sees(int32_t seq, int32_t prefix, int32_t pos, int32_t swa, int32_t kseq, int32_t kpos) {
    return ((kseq == seq) | (kseq == prefix)) & (kpos <= pos) & (pos - kpos < swa);
}
static inline int32_t rg_attn_window(int32_t n_swa) { return n_swa > 0 ? n_swa : INT32_MAX; }
void  rg_attn_scale_row(float * s, int n, float scale, const rg_attn_row_vis * v);   /* v NULL: all seen */
float rg_attn_row_max(const float * s, int n);
void  rg_attn_exp_row(float * s, int n, float shift);                               /* exp(s - shift) */
float rg_attn_row_sum(const float * s, int n);
float rg_attn_row_dot(const float * a, const float * b, int n);
void  rg_attn_softmax_grad_row(float * ds, const float * p, float D, int n);        /* p (ds - D) */
void  rg_attn_add_row(float * y, const float * x, int n);                           /* y += x */

/* ---- gemm_amx.c ------------------------------------------------------------------------------ */
/* gemm.c's product on AMX tiles. rg_amx_ready: the CPU has AMX-BF16 and Linux granted the tile
 * state (asked once). The activations' packing there is row-major BF16 [2 kp, 32 ceil(T / 32)]
 * (kp a multiple of 16); both are ggml custom ops for gemm.c's builders. */
bool rg_amx_ready(void);
void rg_amx_pack_act(struct ggml_tensor * dst, int ith, int nth, void * userdata);
void rg_amx_gemm(struct ggml_tensor * dst, int ith, int nth, void * userdata);

/* ---- gemm_avx2.c ----------------------------------------------------------------------------- */
/* the same product for CPUs without AVX512-BF16, F16 weights times F32 activations. rg_avx2_ready:
 * the CPU has AVX2, FMA and F16C. The weight packed as F16 [RG_AVX2_MR k, row blocks], the
 * activations as F32 [RG_AVX2_NR k, token blocks]; the three are ggml custom ops for gemm.c's
 * builders (the weight's userdata non-NULL: transposed). */
#define RG_AVX2_MR 16
#define RG_AVX2_NR 6
bool rg_avx2_ready(void);
void rg_avx2_pack_weight(struct ggml_tensor * dst, int ith, int nth, void * userdata);
void rg_avx2_pack_act(struct ggml_tensor * dst, int ith, int nth, void * userdata);
void rg_avx2_gemm(struct ggml_tensor * dst, int ith, int nth, void * userdata);

#endif /* RG_KERNELS_H */
