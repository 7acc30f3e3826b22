/*
 * dropout.c - LoRA dropout's masks, drawn inside the graph.
 *
 * A mask is a function of (seed, layer and target, element index) only: the forward pass and a
 * second evaluation of the same batch (finite differences, a resumed run) draw the same mask
 * without storing it anywhere but the graph. The mask is a custom op whose one source is a small
 * input holding the seed and the probability; that input needs no gradient, so autodiff never
 * asks the op for one, and the product x * mask gives the input's gradient its mask.
 *
 * The draw: u = top 24 bits of splitmix64(splitmix64(seed + id * golden) ^ index) / 2^24; the
 * element is kept when u >= p, and a kept element is 1 / (1 - p). tests/test_native.py holds a
 * numpy twin of this function as the oracle.
 */
#include "rg_internal.h"

#include <string.h>

#define GOLDEN 0x9E3779B97F4A7C15ULL

static uint64_t splitmix64(uint64_t z) {
    z += GOLDEN;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* dst [ne0, ne1] F32; src[0] is the I32 [4] input: seed low and high words, p's bits, unused */
static void dropout_mask(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    const int32_t * in = (const int32_t *) dst->src[0]->data;
    const uint64_t seed = (uint64_t) (uint32_t) in[0] | ((uint64_t) (uint32_t) in[1] << 32);
    float p;
    memcpy(&p, &in[2], sizeof(p));
    /* the layer and target travel in the pointer's value: a per-op constant without storage */
    const uint64_t id = (uint64_t) (uintptr_t) userdata;
    const uint64_t base = splitmix64(seed + id * GOLDEN);
    const float keep = 1.0f / (1.0f - p);
    const int64_t ne0 = dst->ne[0], n = ne0 * dst->ne[1];
    const int64_t per = (n + nth - 1) / nth, start = per * ith, end = start + per < n ? start + per : n;
    for (int64_t k = start; k < end; k++) {
        const float u = (float) (splitmix64(base ^ (uint64_t) k) >> 40) * (1.0f / 16777216.0f);
        float * out = (float *) ((char *) dst->data + (k / ne0) * dst->nb[1]) + k % ne0;
        *out = u >= p ? keep : 0.0f;
    }
}

struct ggml_tensor * rg_dropout_mask(struct ggml_context * ctx, struct ggml_tensor * params, int64_t ne0,
                                     int64_t ne1, int layer, int target) {
    struct ggml_tensor * args[1] = { params };
    const uintptr_t id = (uintptr_t) layer * RG_N_TARGETS + (uintptr_t) target + 1;
    return ggml_custom_4d(ctx, GGML_TYPE_F32, ne0, ne1, 1, 1, args, 1, dropout_mask, GGML_N_TASKS_MAX, (void *) id);
}

void rg_dropout_params(const rg_batch * batch, int32_t out[4]) {
    out[0] = (int32_t) (uint32_t) (batch->dropout_seed & 0xFFFFFFFFu);
    out[1] = (int32_t) (uint32_t) (batch->dropout_seed >> 32);
    memcpy(&out[2], &batch->lora_dropout, sizeof(float));
    out[3] = 0;
}
