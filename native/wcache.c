/*
 * wcache.c - the weight cache: persistent 16-bit copies (F16 or BF16, whichever the engine's
 * matmul mode converts to) of the frozen base weights, so the training graph stops converting
 * every quantized weight twice per micro-batch (forward and, transposed, backward: about a tenth
 * of an SFT step on the default model, docs/benchmarks.md).
 *
 * Where the graph multiplies through gemm.c (BF16 on CPUs with AVX512-BF16, F16 on other AVX2 CPUs,
 * or the kernel forced) the copies are packed for its kernel instead, by its own packing op, in that
 * kernel's type and layout (rg_packed_weight_shape). The kernel is matmul.c's decision for the mode and
 * kernel the cache is made for: the one an engine with those settings takes. The base never
 * changes, so the copies are made once and stay valid; the op the graph would run makes them, so a
 * graph that reads them computes bit for bit what it computed before. Within a byte budget,
 * transposed copies come first (the backward's conversion is the dearer one), then forward ones,
 * layer by layer. CPU only: on another device the graph casts with ggml's own ops.
 */
#include "rg_internal.h"

#include <string.h>

static void free_cache(rg_model * m) {
    if (m->cache_buf) ggml_backend_buffer_free(m->cache_buf);
    if (m->cache_ctx) ggml_free(m->cache_ctx);
    m->cache_buf = NULL;
    m->cache_ctx = NULL;
    m->cache_bytes = 0;
    m->cache_kernel = RG_KERNEL_GGML;
    memset(m->cache, 0, sizeof(m->cache));
}

/* whether the graph converts this weight to 16 bits: transposed in every backward of a quantized
 * weight (rewrite.c), forward where the mode prefers that to the native kernel (graph.c) */
static bool converted(const struct ggml_tensor * w, bool transposed, const rg_matmul * mm) {
    if (!w || !ggml_is_quantized(w->type) || mm->mode == RG_MATMUL_F32) return false;
    return transposed || rg_matmul_converts(mm, w->type);
}

/* every copy made by convert.c's own op (the conversion the graph would otherwise run), copied into
 * the cache: one graph on the CPU backend, its transients reused by the allocator */
static rg_status fill(rg_model * m) {
    const size_t n = (size_t) m->hp.n_layer * RG_N_TARGETS * 2;
    struct ggml_init_params ip = { ggml_tensor_overhead() * (2 * n + 1) + ggml_graph_overhead_custom(2 * n + 1, false),
                                   NULL, true };
    struct ggml_context * ctx = ggml_init(ip);
    if (!ctx) return rg_fail(RG_ERR_NOMEM, "out of host memory for the weight cache's graph");
    struct ggml_cgraph * gf = ggml_new_graph_custom(ctx, 2 * n + 1, false);
    for (int il = 0; il < m->hp.n_layer; il++) {
        for (int t = 0; t < RG_N_TARGETS; t++) {
            for (int tr = 0; tr < 2; tr++) {
                struct ggml_tensor * c = m->cache[il][t][tr];
                if (!c) continue;
                struct ggml_tensor * w = m->layers[il].w[t];
                const bool packed = m->cache_kernel != RG_KERNEL_GGML;
                ggml_build_forward_expand(gf, ggml_cpy(ctx, packed ? rg_pack_weight(ctx, w, tr == 1, m->cache_kernel)
                                                                   : rg_dequant(ctx, w, tr == 1, c->type), c));
            }
        }
    }
    ggml_gallocr_t ga = ggml_gallocr_new(ggml_backend_cpu_buffer_type());
    rg_status st = RG_OK;
    if (!ga || !ggml_gallocr_alloc_graph(ga, gf)) {
        st = rg_fail(RG_ERR_NOMEM, "could not allocate the weight cache's conversion graph");
    } else if (ggml_backend_graph_compute(m->backend_cpu, gf) != GGML_STATUS_SUCCESS) {
        st = rg_fail(RG_ERR_COMPUTE, "could not fill the weight cache");
    }
    if (ga) ggml_gallocr_free(ga);
    ggml_free(ctx);
    return st;
}

rg_status rg_model_set_weight_cache(rg_model * m, size_t budget_bytes, int matmul_mode, int kernel, size_t * used_bytes) {
    if (used_bytes) *used_bytes = 0;
    rg_matmul mm;
    const rg_status valid = rg_matmul_decide(matmul_mode, kernel, &mm);
    if (valid) return valid;        /* the cache as it was */
    free_cache(m);
    if (budget_bytes == 0) return RG_OK;
    if (m->backend != m->backend_cpu) {
        return rg_fail(RG_ERR_ARG, "the weight cache is for the CPU device (%s converts with its own ops)",
                       ggml_backend_dev_name(m->dev));
    }
    struct ggml_init_params ip = { ggml_tensor_overhead() * ((size_t) m->hp.n_layer * RG_N_TARGETS * 2 + 1), NULL, true };
    m->cache_ctx = ggml_init(ip);
    if (!m->cache_ctx) return rg_fail(RG_ERR_NOMEM, "out of host memory for the weight cache's metadata");
    m->cache_kernel = mm.kernel;
    const bool packed = rg_matmul_packed(&mm);
    size_t total = 0;
    for (int tr = 1; tr >= 0; tr--) {
        for (int il = 0; il < m->hp.n_layer; il++) {
            for (int t = 0; t < RG_N_TARGETS; t++) {
                const struct ggml_tensor * w = m->layers[il].w[t];
                if (!converted(w, tr == 1, &mm)) continue;
                int64_t ne[2] = { tr ? w->ne[1] : w->ne[0], tr ? w->ne[0] : w->ne[1] };
                const enum ggml_type type = packed ? rg_packed_weight_shape(w, tr == 1, mm.kernel, ne) : mm.conv_type;
                const size_t bytes = ggml_row_size(type, ne[0]) * (size_t) ne[1];
                if (total + bytes > budget_bytes) continue;
                struct ggml_tensor * c = ggml_new_tensor_2d(m->cache_ctx, type, ne[0], ne[1]);
                ggml_format_name(c, "%s (%s%s%s, cached)", w->name, ggml_type_name(type), packed ? ", packed" : "",
                                 tr ? ", transposed" : "");
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
    rg_status st = fill(m);
    if (st) {
        free_cache(m);
        return st;
    }
    m->cache_bytes = total;
    if (used_bytes) *used_bytes = total;
    return RG_OK;
}

static struct ggml_tensor * cached(const rg_model * m, const struct ggml_tensor * w, bool transposed) {
    if (!m->cache_buf || !w) return NULL;
    for (int il = 0; il < m->hp.n_layer; il++) {
        for (int t = 0; t < RG_N_TARGETS; t++) {
            if (m->layers[il].w[t] == w) return m->cache[il][t][transposed ? 1 : 0];
        }
    }
    return NULL;
}

/* only a copy in the layout of the engine's kernel: one packed for another (a cache made for other
 * settings) would be read as garbage */
struct ggml_tensor * rg_model_cached_packed(const rg_model * m, const struct ggml_tensor * w, bool transposed, int kernel) {
    struct ggml_tensor * c = m->cache_kernel != RG_KERNEL_GGML ? cached(m, w, transposed) : NULL;
    return c && rg_packed_weight_fits(c, w, transposed, kernel) ? c : NULL;
}

struct ggml_tensor * rg_model_cached(const rg_model * m, const struct ggml_tensor * w, bool transposed, enum ggml_type type) {
    struct ggml_tensor * c = m->cache_kernel != RG_KERNEL_GGML ? NULL : cached(m, w, transposed);
    return c && c->type == type ? c : NULL;
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
