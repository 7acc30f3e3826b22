/*
 * convert.c - quantized weight -> F16 or BF16, optionally transposed, in one pass.
 *
 * ggml's CPU backend cannot copy a quantized tensor to F16 directly, so the obvious route goes
 * through an F32 tensor twice the size of the result; for the backward the transposed copy is also
 * written column by column. This custom op dequantizes a block of rows into a small per-thread
 * buffer and writes the F16 result straight away (for the transpose, in runs of RG_TILE values so
 * every store stays in cache lines). The buffer is a fixed-size stack array: a tile of RG_TILE rows
 * is converted RG_SPAN values at a time, so nothing is allocated while the graph runs. The result
 * is a transient the allocator frees after its use.
 */
#include "rg_internal.h"
#include "kernels.h"

#define RG_TILE 32    /* rows of the weight per tile */
#define RG_SPAN 256   /* values of a row per pass: a multiple of every ggml block size */

void rg_row_span_f32(const struct ggml_tensor * w, const void * row, int64_t i0, int64_t n,
                     ggml_to_float_t to_float, float * out) {
    if (w->type == GGML_TYPE_F32) {
        for (int64_t i = 0; i < n; i++) out[i] = ((const float *) row)[i0 + i];
    } else {
        to_float((const char *) row + (size_t) (i0 / ggml_blck_size(w->type)) * ggml_type_size(w->type), out, n);
    }
}

static void to_bf16(const float * x, ggml_fp16_t * y, int64_t n) { ggml_cpu_fp32_to_bf16(x, (ggml_bf16_t *) y, n); }

/* The scratch lives on the stack (48 KiB per thread), so the op allocates nothing and cannot fail
 * inside the graph computation. */
static void dequant_half(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    const struct ggml_tensor * w = dst->src[0];
    const bool transposed = userdata != NULL;
    /* F16 and BF16 are both 2 bytes a value, so one scratch serves both */
    void (*to_half)(const float *, ggml_fp16_t *, int64_t) = dst->type == GGML_TYPE_BF16 ? to_bf16 : ggml_cpu_fp32_to_fp16;
    const int64_t n_in = w->ne[0], n_out = w->ne[1];
    const ggml_to_float_t to_float = ggml_get_type_traits(w->type)->to_float;
    float tmp[RG_TILE * RG_SPAN];
    ggml_fp16_t half[RG_TILE * RG_SPAN];
    const int64_t n_tiles = (n_out + RG_TILE - 1) / RG_TILE;
    for (int64_t tile = ith; tile < n_tiles; tile += nth) {
        const int64_t r0 = tile * RG_TILE;
        const int64_t nr = n_out - r0 < RG_TILE ? n_out - r0 : RG_TILE;
        if (!transposed) {
            /* dst is [n_in, n_out] like w: each row through the whole scratch at a time */
            for (int64_t r = r0; r < r0 + nr; r++) {
                const void * row = (const char *) w->data + r * w->nb[1];
                ggml_fp16_t * out = (ggml_fp16_t *) ((char *) dst->data + r * dst->nb[1]);
                for (int64_t i0 = 0; i0 < n_in; i0 += RG_TILE * RG_SPAN) {
                    const int64_t ns = n_in - i0 < RG_TILE * RG_SPAN ? n_in - i0 : RG_TILE * RG_SPAN;
                    rg_row_span_f32(w, row, i0, ns, to_float, tmp);
                    to_half(tmp, out + i0, ns);
                }
            }
            continue;
        }
        /* dst is [n_out, n_in]: dst(o, i) at i * n_out + o; write nr consecutive o's per i */
        ggml_fp16_t * out = (ggml_fp16_t *) dst->data;
        for (int64_t i0 = 0; i0 < n_in; i0 += RG_SPAN) {
            const int64_t ns = n_in - i0 < RG_SPAN ? n_in - i0 : RG_SPAN;
            for (int64_t r = 0; r < nr; r++) {
                const void * row = (const char *) w->data + (r0 + r) * w->nb[1];
                rg_row_span_f32(w, row, i0, ns, to_float, tmp + r * RG_SPAN);
                to_half(tmp + r * RG_SPAN, half + r * RG_SPAN, ns);
            }
            for (int64_t i = 0; i < ns; i++) {
                ggml_fp16_t * d = out + (i0 + i) * n_out + r0;
                for (int64_t r = 0; r < nr; r++) d[r] = half[r * RG_SPAN + i];
            }
        }
    }
}

struct ggml_tensor * rg_dequant(struct ggml_context * ctx, struct ggml_tensor * w, bool transposed, enum ggml_type type) {
    struct ggml_tensor * args[1] = { w };
    struct ggml_tensor * t = transposed
        ? ggml_custom_4d(ctx, type, w->ne[1], w->ne[0], 1, 1, args, 1, dequant_half, GGML_N_TASKS_MAX, (void *) 1)
        : ggml_custom_4d(ctx, type, w->ne[0], w->ne[1], 1, 1, args, 1, dequant_half, GGML_N_TASKS_MAX, NULL);
    ggml_format_name(t, "%s (%s%s)", w->name, ggml_type_name(type), transposed ? ", transposed" : "");
    return t;
}
