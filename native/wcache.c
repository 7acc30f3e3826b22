/*
 * wcache.c - the F16 weight cache: persistent F16 copies of the frozen base weights, so the
 * training graph stops converting every quantized weight twice per micro-batch (forward and,
 * transposed, backward: about a tenth of an SFT step on the default model, docs/benchmarks.md).
 *
 * The base never changes, so the copies are made once and stay valid; they are the numbers
 * convert.c's op would produce (the same to_float and the same F32 -> F16 rounding), so a graph
 * that reads them computes bit for bit what it computed before. Within a byte budget, transposed
 * copies come first (the backward's conversion is the dearer one), then forward ones, layer by
 * layer. CPU only: on another device the graph casts with ggml's own ops.
 */
#include "rg_internal.h"

#include <stdlib.h>
#include <string.h>

static void free_cache(rg_model * m) {
    if (m->cache_buf) ggml_backend_buffer_free(m->cache_buf);
    if (m->cache_ctx) ggml_free(m->cache_ctx);
    m->cache_buf = NULL;
    m->cache_ctx = NULL;
    m->cache_bytes = 0;
    memset(m->cache, 0, sizeof(m->cache));
}

/* whether the graph converts this weight to F16: transposed in every backward of a quantized weight
 * (rewrite.c), forward where the default route prefers F16 to the native kernel (graph.c) */
static bool converted(const struct ggml_tensor * w, bool transposed) {
    if (!w || !ggml_is_quantized(w->type)) return false;
    return transposed || rg_use_f16_matmul(w->type, RG_MATMUL_AUTO);
}

/* w as F16 into dst (host memory), transposed or not: the conversion convert.c's op performs */
static rg_status fill(const struct ggml_tensor * w, struct ggml_tensor * dst, bool transposed) {
    const int64_t n_in = w->ne[0], n_out = w->ne[1];
    const ggml_to_float_t to_float = ggml_get_type_traits(w->type)->to_float;
    float * row = rg_malloc(sizeof(float) * (size_t) n_in, "the weight cache");
    ggml_fp16_t * half = row ? rg_malloc(sizeof(ggml_fp16_t) * (size_t) n_in, "the weight cache") : NULL;
    if (!half) {
        free(row);
        return RG_ERR_NOMEM;
    }
    ggml_fp16_t * out = dst->data;
    for (int64_t o = 0; o < n_out; o++) {
        to_float((const char *) w->data + o * w->nb[1], row, n_in);
        ggml_cpu_fp32_to_fp16(row, transposed ? half : out + o * n_in, n_in);
        if (transposed) for (int64_t i = 0; i < n_in; i++) out[i * n_out + o] = half[i];
    }
    free(half);
    free(row);
    return RG_OK;
}

rg_status rg_model_set_weight_cache(rg_model * m, size_t budget_bytes, size_t * used_bytes) {
    free_cache(m);
    if (used_bytes) *used_bytes = 0;
    if (budget_bytes == 0) return RG_OK;
    if (m->backend != m->backend_cpu) {
        return rg_fail(RG_ERR_ARG, "the weight cache is for the CPU device (%s converts with its own ops)",
                       ggml_backend_dev_name(m->dev));
    }
    struct ggml_init_params ip = { ggml_tensor_overhead() * ((size_t) m->hp.n_layer * RG_N_TARGETS * 2 + 1), NULL, true };
    m->cache_ctx = ggml_init(ip);
    if (!m->cache_ctx) return rg_fail(RG_ERR_NOMEM, "out of host memory for the weight cache's metadata");
    size_t total = 0;
    for (int tr = 1; tr >= 0; tr--) {
        for (int il = 0; il < m->hp.n_layer; il++) {
            for (int t = 0; t < RG_N_TARGETS; t++) {
                const struct ggml_tensor * w = m->layers[il].w[t];
                if (!converted(w, tr == 1)) continue;
                const size_t bytes = ggml_row_size(GGML_TYPE_F16, w->ne[0]) * (size_t) w->ne[1];
                if (total + bytes > budget_bytes) continue;
                struct ggml_tensor * c = tr ? ggml_new_tensor_2d(m->cache_ctx, GGML_TYPE_F16, w->ne[1], w->ne[0])
                                            : ggml_new_tensor_2d(m->cache_ctx, GGML_TYPE_F16, w->ne[0], w->ne[1]);
                ggml_format_name(c, "%s (f16%s, cached)", w->name, tr ? ", transposed" : "");
                m->cache[il][t][tr] = c;
                total += bytes;
            }
        }
    }
    if (total == 0) {
        free_cache(m);
        return RG_OK;
    }
    m->cache_buf = ggml_backend_alloc_ctx_tensors_from_buft(m->cache_ctx, ggml_backend_cpu_buffer_type());
    if (!m->cache_buf) {
        free_cache(m);
        return rg_fail(RG_ERR_NOMEM, "could not allocate the weight cache (%.0f MiB)", (double) total / (1 << 20));
    }
    for (int il = 0; il < m->hp.n_layer; il++) {
        for (int t = 0; t < RG_N_TARGETS; t++) {
            for (int tr = 0; tr < 2; tr++) {
                if (!m->cache[il][t][tr]) continue;
                rg_status st = fill(m->layers[il].w[t], m->cache[il][t][tr], tr == 1);
                if (st) {
                    free_cache(m);
                    return st;
                }
            }
        }
    }
    m->cache_bytes = total;
    if (used_bytes) *used_bytes = total;
    return RG_OK;
}

struct ggml_tensor * rg_model_cached(const rg_model * m, const struct ggml_tensor * w, bool transposed) {
    if (!m->cache_buf || !w) return NULL;
    for (int il = 0; il < m->hp.n_layer; il++) {
        for (int t = 0; t < RG_N_TARGETS; t++) {
            if (m->layers[il].w[t] == w) return m->cache[il][t][transposed ? 1 : 0];
        }
    }
    return NULL;
}

struct ggml_tensor * rg_model_uncached(const rg_model * m, const struct ggml_tensor * c) {
    if (!m->cache_buf || c->buffer != m->cache_buf) return NULL;
    for (int il = 0; il < m->hp.n_layer; il++) {
        for (int t = 0; t < RG_N_TARGETS; t++) {
            if (m->cache[il][t][0] == c || m->cache[il][t][1] == c) return m->layers[il].w[t];
        }
    }
    return NULL;
}

void rg_model_free_weight_cache(rg_model * m) { free_cache(m); }
