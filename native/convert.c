/*
 * convert.c - quantized weight -> F16, optionally transposed, in one pass.
 *
 * ggml's CPU backend cannot copy a quantized tensor to F16 directly, so the obvious route goes
 * through an F32 tensor twice the size of the result; for the backward the transposed copy is also
 * written column by column. This custom op dequantizes a block of rows into a small per-thread
 * buffer and writes the F16 result straight away (for the transpose, in runs of RG_TILE values so
 * every store stays in cache lines). The result is a transient the allocator frees after its use.
 */
#include "rg_internal.h"

#include <stdlib.h>

#define RG_TILE 32

static void dequant_f16(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    const struct ggml_tensor * w = dst->src[0];
    const bool transposed = userdata != NULL;
    const int64_t n_in = w->ne[0], n_out = w->ne[1];
    const ggml_to_float_t to_float = ggml_get_type_traits(w->type)->to_float;
    float * tmp = malloc(sizeof(float) * (size_t) n_in * RG_TILE);
    ggml_fp16_t * half = malloc(sizeof(ggml_fp16_t) * (size_t) n_in * RG_TILE);
    const int64_t n_tiles = (n_out + RG_TILE - 1) / RG_TILE;
    for (int64_t tile = ith; tile < n_tiles; tile += nth) {
        const int64_t r0 = tile * RG_TILE;
        const int64_t nr = n_out - r0 < RG_TILE ? n_out - r0 : RG_TILE;
        for (int64_t r = 0; r < nr; r++) {
            const void * row = (const char *) w->data + (r0 + r) * w->nb[1];
            if (w->type == GGML_TYPE_F32) {
                for (int64_t i = 0; i < n_in; i++) tmp[r * n_in + i] = ((const float *) row)[i];
            } else {
                to_float(row, tmp + r * n_in, n_in);
            }
        }
        if (!transposed) {
            ggml_cpu_fp32_to_fp16(tmp, (ggml_fp16_t *) ((char *) dst->data + r0 * dst->nb[1]), nr * n_in);
            continue;
        }
        /* dst is [n_out, n_in]: dst(o, i) at i * n_out + o; write nr consecutive o's per i */
        ggml_cpu_fp32_to_fp16(tmp, half, nr * n_in);
        ggml_fp16_t * out = (ggml_fp16_t *) dst->data;
        for (int64_t i = 0; i < n_in; i++) {
            ggml_fp16_t * d = out + i * n_out + r0;
            for (int64_t r = 0; r < nr; r++) d[r] = half[r * n_in + i];
        }
    }
    free(tmp);
    free(half);
}

struct ggml_tensor * rg_dequant_f16(struct ggml_context * ctx, struct ggml_tensor * w, bool transposed) {
    struct ggml_tensor * args[1] = { w };
    struct ggml_tensor * t = transposed
        ? ggml_custom_4d(ctx, GGML_TYPE_F16, w->ne[1], w->ne[0], 1, 1, args, 1, dequant_f16, GGML_N_TASKS_MAX, (void *) 1)
        : ggml_custom_4d(ctx, GGML_TYPE_F16, w->ne[0], w->ne[1], 1, 1, args, 1, dequant_f16, GGML_N_TASKS_MAX, NULL);
    ggml_format_name(t, "%s (f16%s)", w->name, transposed ? ", transposed" : "");
    return t;
}
