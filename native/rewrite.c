/*
 * rewrite.c - what the training graph becomes after ggml's autodiff, before it runs.
 *
 * ggml_build_backward_expand writes every product's gradient as ggml would compute it; several
 * of those are slow on the CPU or keep memory alive for nothing. After the backward is built:
 *  - OUT_PROD(W, transpose(dy)) for a frozen base weight W becomes
 *    MUL_MAT(dequantize-and-transpose(W), dy): the same numbers through the fast matmul kernel
 *    instead of ggml's OUT_PROD on quantized data (10-15x slower, docs/architecture.md);
 *  - the thin products of LoRA and attention become outer.c's kernels (sums of outer products
 *    for weight gradients, products over the rank), with no transposed copies;
 *  - consumers of a composite op listed in b->subst_from read the fused op instead;
 *  - nodes are re-expanded into a fresh graph in which a weight's dequantized copy comes right
 *    before its user (`reordered`), so only one layer's copies are live at a time.
 * Nodes change in place (`become`): the backward's references to them stay valid.
 */
#include "rg_internal.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

bool rg_is_base_weight(const rg_model * m, const struct ggml_tensor * t) {
    return t->op == GGML_OP_NONE && t->buffer == m->wbuf;
}

struct ggml_tensor * rg_base_weight_of(const rg_model * m, struct ggml_tensor * t) {
    while (t && !rg_is_base_weight(m, t)) {
        if (t->op == GGML_OP_NONE) return rg_model_uncached(m, t);     /* a weight-cache copy, or not a weight */
        if (t->op != GGML_OP_CPY && t->op != GGML_OP_DUP && t->op != GGML_OP_CONT && t->op != GGML_OP_CUSTOM) return NULL;
        if (t->op == GGML_OP_CUSTOM && t->src[1]) return NULL;     /* a product (outer.c, gemm.c), not a conversion */
        t = t->src[0];
    }
    return t;
}

/* per-graph copies made once per source even when several products need them: cont(transpose(t))
 * (the input of q, k and v is one tensor), and a base weight dequantized and transposed to F16
 * (the input's gradient and, with DoRA, the gradient of A through W A^T) */
typedef struct {
    struct ggml_tensor * src[1024];
    struct ggml_tensor * dst[1024];
    int                  n;
} rg_transposes;

static struct ggml_tensor * memo_find(const rg_transposes * c, const struct ggml_tensor * t) {
    for (int i = 0; i < c->n; i++) if (c->src[i] == t) return c->dst[i];
    return NULL;
}

static struct ggml_tensor * memo_keep(rg_transposes * c, struct ggml_tensor * t, struct ggml_tensor * r) {
    if (c->n < 1024) {
        c->src[c->n] = t;
        c->dst[c->n++] = r;
    }
    return r;
}

static struct ggml_tensor * transposed(rg_transposes * tc, struct ggml_context * ctx, struct ggml_tensor * t) {
    struct ggml_tensor * r = memo_find(tc, t);
    return r ? r : memo_keep(tc, t, ggml_cont(ctx, ggml_transpose(ctx, t)));
}

/* the weight cache's transposed copy, else one made in this graph */
static struct ggml_tensor * dequant_transposed(rg_transposes * dq, struct ggml_context * ctx, const rg_model * m,
                                               struct ggml_tensor * w, enum ggml_type type) {
    struct ggml_tensor * r = memo_find(dq, w);
    if (r) return r;
    r = rg_model_cached(m, w, true, type);
    return memo_keep(dq, w, r ? r : rg_dequant(ctx, w, true, type));
}

/* w packed for gemm.c (the weight cache's packed copy, else one made in this graph), once per graph
 * and orientation */
static struct ggml_tensor * packed_weight(rg_transposes * memo, struct ggml_context * ctx, const rg_model * m,
                                          struct ggml_tensor * w, bool transposed, int kernel) {
    struct ggml_tensor * r = memo_find(memo, w);
    if (r) return r;
    r = rg_model_cached_packed(m, w, transposed, kernel);
    return memo_keep(memo, w, r ? r : rg_pack_weight(ctx, w, transposed, kernel));
}

/* activations packed for gemm.c, once per graph: q, k and v read one input, gate and up another */
static struct ggml_tensor * packed_act(rg_transposes * memo, struct ggml_context * ctx, struct ggml_tensor * x,
                                       int kernel) {
    struct ggml_tensor * r = memo_find(memo, x);
    return r ? r : memo_keep(memo, x, rg_pack_act(ctx, x, kernel));
}

/* whether t depends on no graph input (tokens, positions, masks, the head's gradient): a weight,
 * an adapter tensor, or a conversion of one (a dequantized copy, a transpose), up to `depth` ops deep */
static bool input_free(const struct ggml_tensor * t, int depth) {
    if (t->op == GGML_OP_NONE) return !(t->flags & GGML_TENSOR_FLAG_INPUT);
    if (depth == 0) return false;
    for (int j = 0; j < GGML_MAX_SRC; j++) {
        if (t->src[j] && !input_free(t->src[j], depth - 1)) return false;
    }
    return true;
}

/* a set of tensors by address (open addressing; sized for a graph's nodes at creation) */
typedef struct {
    const struct ggml_tensor ** key;
    size_t                      cap;    /* a power of two */
} rg_ptrset;

static bool ptrset_init(rg_ptrset * s, size_t n) {
    s->cap = 64;
    while (s->cap < 4 * n) s->cap *= 2;
    s->key = calloc(s->cap, sizeof(*s->key));
    return s->key != NULL;
}

static size_t ptrset_slot(const rg_ptrset * s, const struct ggml_tensor * t) {
    size_t k = (((uintptr_t) t >> 4) * 0x9E3779B97F4A7C15ull) & (s->cap - 1);
    while (s->key[k] && s->key[k] != t) k = (k + 1) & (s->cap - 1);
    return k;
}

static bool ptrset_has(const rg_ptrset * s, const struct ggml_tensor * t) {
    return s->key[ptrset_slot(s, t)] == t;
}

static void ptrset_add(rg_ptrset * s, const struct ggml_tensor * t) {
    s->key[ptrset_slot(s, t)] = t;
}

/* The nodes of gf that still matter after the rewrite: those reachable from the graph's sinks (the
 * nodes nothing read before the rewrite: the loss, the adapter's gradients, the hidden state). A
 * rewrite that replaces a computation by another leaves the old one's nodes unreachable: tiled
 * attention leaves the [T, T] scores, their softmax and their gradients. `sinks` holds the
 * sinks, taken before any node changed. */
static bool reachable(struct ggml_cgraph * gf, const rg_ptrset * sinks, rg_ptrset * live) {
    const int n = ggml_graph_n_nodes(gf);
    if (!ptrset_init(live, (size_t) n * 4)) return false;    /* nodes, leaves and what the rewrite added */
    size_t cap = (size_t) n + GGML_MAX_SRC + 1, top = 0;
    const struct ggml_tensor ** stack = malloc(sizeof(*stack) * cap);
    if (!stack) return false;
    for (int i = 0; i < n; i++) {
        const struct ggml_tensor * node = ggml_graph_node(gf, i);
        if (ptrset_has(sinks, node)) stack[top++] = node;
    }
    while (top > 0) {
        const struct ggml_tensor * t = stack[--top];
        if (ptrset_has(live, t)) continue;
        ptrset_add(live, t);
        if (top + GGML_MAX_SRC + 1 > cap) {     /* a tensor is pushed once by each reader */
            const struct ggml_tensor ** grown = realloc(stack, sizeof(*stack) * cap * 2);
            if (!grown) {
                free(stack);
                return false;
            }
            stack = grown;
            cap *= 2;
        }
        for (int j = 0; j < GGML_MAX_SRC; j++) {
            if (t->src[j] && !ptrset_has(live, t->src[j])) stack[top++] = t->src[j];
        }
        if (t->view_src && !ptrset_has(live, t->view_src)) stack[top++] = t->view_src;
    }
    free(stack);
    return true;
}

static bool sinks_of(struct ggml_cgraph * gf, rg_ptrset * sinks) {
    const int n = ggml_graph_n_nodes(gf);
    rg_ptrset read;
    if (!ptrset_init(&read, (size_t) n * GGML_MAX_SRC)) return false;
    if (!ptrset_init(sinks, (size_t) n)) {
        free(read.key);
        return false;
    }
    for (int i = 0; i < n; i++) {
        const struct ggml_tensor * node = ggml_graph_node(gf, i);
        for (int j = 0; j < GGML_MAX_SRC; j++) if (node->src[j]) ptrset_add(&read, node->src[j]);
        if (node->view_src) ptrset_add(&read, node->view_src);
    }
    for (int i = 0; i < n; i++) {
        const struct ggml_tensor * node = ggml_graph_node(gf, i);
        if (!ptrset_has(&read, node)) ptrset_add(sinks, node);
    }
    free(read.key);
    return true;
}

/* left out of the rewritten graph: a composite op replaced by its fused twin (b->subst_from), the
 * two products a fused LoRA product replaced (`dead`), and what no sink reaches any more (`live`,
 * when set) */
static bool is_dead(const rg_graph_build * b, const rg_transposes * dead, const rg_ptrset * live,
                    const struct ggml_tensor * t) {
    for (int i = 0; i < b->n_subst; i++) if (b->subst_from[i] == t) return true;
    if (live && live->key && !ptrset_has(live, t)) return true;
    return memo_find(dead, t) != NULL;
}

/* how many of gf's nodes read each tensor, counted once before the rewrite changes any source: an
 * open-addressing table keyed by address (a full table answers "many", which only forgoes a fusion) */
#define RG_USERS_SLOTS (1 << 16)
typedef struct {
    const struct ggml_tensor * key[RG_USERS_SLOTS];
    int                        n[RG_USERS_SLOTS];
    int                        used;
} rg_users;

static size_t users_slot(const rg_users * u, const struct ggml_tensor * t) {
    size_t h = ((uintptr_t) t >> 4) * 0x9E3779B97F4A7C15ull;
    for (size_t i = 0; i < RG_USERS_SLOTS; i++) {
        const size_t k = (h + i) & (RG_USERS_SLOTS - 1);
        if (u->key[k] == t || u->key[k] == NULL) return k;
    }
    return SIZE_MAX;
}

static void users_count(rg_users * u, struct ggml_cgraph * gf) {
    for (int i = 0; i < ggml_graph_n_nodes(gf); i++) {
        const struct ggml_tensor * node = ggml_graph_node(gf, i);
        for (int j = 0; j < GGML_MAX_SRC; j++) {
            if (!node->src[j] || u->used >= RG_USERS_SLOTS / 2) continue;
            const size_t k = users_slot(u, node->src[j]);
            if (u->key[k] == NULL) {
                u->key[k] = node->src[j];
                u->used++;
            }
            u->n[k]++;
        }
    }
}

static int users(const rg_users * u, const struct ggml_tensor * t) {
    if (!u || u->used >= RG_USERS_SLOTS / 2) return INT32_MAX;
    const size_t k = users_slot(u, t);
    return k != SIZE_MAX && u->key[k] == t ? u->n[k] : 0;
}

/* gf's nodes in a fresh graph, in their order, except that a node which depends on no input (a
 * weight's dequantized copy) is placed right before its first user. ggml's depth-first expansion
 * puts such nodes first: from the last layer back, each layer's first matmul visits its weight
 * before the activations, which pull in all the layers below, so every layer's dequantized copy
 * would be live from the start of the graph to its use (5.8 GB of F16 weights on a 7B model). */
static struct ggml_cgraph * reordered(struct ggml_context * ctx, struct ggml_cgraph * gf, size_t size,
                                       const rg_graph_build * b, const rg_transposes * dead, const rg_ptrset * live) {
    struct ggml_cgraph * g2 = ggml_new_graph_custom(ctx, size, false);
    const int n = ggml_graph_n_nodes(gf);
    for (int i = 0; i < n; i++) {
        struct ggml_tensor * node = ggml_graph_node(gf, i);
        if (is_dead(b, dead, live, node) || input_free(node, 4)) continue;     /* pulled in by their users */
        ggml_build_forward_expand(g2, node);
    }
    return g2;
}

/* node computes what op (a fresh outer.c op on the same shape) computes, in place: the backward's
 * references to node stay valid */
/* whether t is ggml_permute(x, a0, a1, a2, a3) */
static bool permuted_as(const struct ggml_tensor * t, int a0, int a1, int a2, int a3) {
    const int32_t * ax = (const int32_t *) t->op_params;
    return t->op == GGML_OP_PERMUTE && ax[0] == a0 && ax[1] == a1 && ax[2] == a2 && ax[3] == a3;
}

static void become(struct ggml_tensor * node, const struct ggml_tensor * op) {
    node->op = op->op;
    memcpy(node->op_params, op->op_params, sizeof(node->op_params));
    for (int j = 0; j < GGML_MAX_SRC; j++) node->src[j] = op->src[j];
}

struct ggml_cgraph * rg_graph_rewrite(rg_graph_build * b, struct ggml_cgraph * gf, size_t size) {
    struct ggml_context * ctx = b->ctx;
    const int n = ggml_graph_n_nodes(gf);
    /* fg: the forward's base products made gemm.c's; lb: LoRA's B (A x) made rank_expand's; dead: the
     * pairs of those fused into one product */
    static __thread rg_transposes tc, dq, pw, pwt, pa, fg, lb, dead;
    tc.n = dq.n = pw.n = pwt.n = pa.n = fg.n = lb.n = dead.n = 0;
    const bool packed = rg_matmul_packed(&b->matmul);
    const int kernel = b->matmul.kernel;
    rg_users * uc = packed ? calloc(1, sizeof(rg_users)) : NULL;     /* NULL: no fusion */
    if (uc) users_count(uc, gf);
    /* attention a tile at a time (attention.c) on the CPU. It computes the same function as the dense
     * ops, so exact_ops (the finite-difference tests) keep it and check its gradients; the native
     * mode keeps llama.cpp's route for bit-equal log-probs */
    rg_ptrset sinks = { 0 }, live = { 0 };
    if (b->tiled_attention && b->on_cpu && b->matmul.mode != RG_MATMUL_NATIVE && sinks_of(gf, &sinks)) {
        int n_tiled = 0;
        for (int il = 0; il < RG_MAX_LAYERS; il++) n_tiled += rg_attn_tile(b, gf, il);
        if (n_tiled == 0 || !reachable(gf, &sinks, &live)) {
            free(live.key);
            live.key = NULL;
        }
        free(sinks.key);
    }
    for (int i = 0; i < n; i++) {
        struct ggml_tensor * node = ggml_graph_node(gf, i);
        for (int j = 0; j < GGML_MAX_SRC; j++) {
            for (int k = 0; k < b->n_subst; k++) {
                if (node->src[j] == b->subst_from[k] && node != b->subst_to[k]) node->src[j] = b->subst_to[k];
            }
        }
        /* outer.c's kernels allowed (CPU only: another device runs ggml's own ops) */
        const bool own = !b->exact_ops && b->on_cpu && ggml_is_contiguous(node);
        if (node->op == GGML_OP_MUL_MAT && own && packed) {
            /* a base weight's product through its 16-bit conversion (graph.c's linear, DoRA's W A^T;
             * BF16 or F16, the type this mode converts to, which the kernel replaces): gemm.c's kernel
             * on the weight packed as stored. The conversion node loses its user and is never computed. */
            struct ggml_tensor * c = node->src[0], * x = node->src[1];
            struct ggml_tensor * w = rg_base_weight_of(b->model, c);
            if (w && ggml_is_quantized(w->type) && c->type == b->matmul.conv_type && c->ne[0] == w->ne[0] &&
                node->ne[0] == w->ne[1] && node->ne[2] == 1 && rg_pack_act_fits(x)) {
                become(node, rg_gemm(ctx, packed_weight(&pw, ctx, b->model, w, false, kernel),
                                     packed_act(&pa, ctx, x, kernel), node->ne[0], node->ne[1]));
                memo_keep(&fg, node, node);
                continue;
            }
        }
        if (node->op == GGML_OP_ADD && own && packed && dead.n + 2 <= 1024 && memo_find(&fg, node->src[0]) &&
            memo_find(&lb, node->src[1])) {
            /* W x + B (s A x): LoRA's product added in the packed product's epilogue, so neither
             * [n_out, T] term is written and read back. Only when the add is each one's sole reader
             * (the backward reads their inputs, not their outputs). */
            struct ggml_tensor * g = node->src[0], * r = node->src[1];
            if (ggml_are_same_shape(node, g) && rg_gemm_lowrank_fits(r->src[0], r->src[1], g->ne[0], g->ne[1]) &&
                users(uc, g) == 1 && users(uc, r) == 1) {
                become(node, rg_gemm_lowrank(ctx, g->src[0], g->src[1], r->src[0], r->src[1]));
                memo_keep(&dead, g, g);
                memo_keep(&dead, r, r);
                continue;
            }
        }
        if (node->op == GGML_OP_MUL_MAT && own && b->matmul.mode != RG_MATMUL_NATIVE) {
            /* LoRA's B (A x) in the forward: an inner dimension of the rank. (The native mode keeps
             * ggml's kernel, as llama.cpp computes it.) */
            struct ggml_tensor * m = node->src[0];
            if (m->op == GGML_OP_CONT && permuted_as(m->src[0], 1, 2, 0, 3)) {
                /* attention's V P, from V transposed to [T, hd, n_kv] (graph.c): rank_expand reads V
                 * as stored instead, each output column a sum of V's columns over the keys. The
                 * transposed copy stays for the backward. */
                struct ggml_tensor * v = ggml_permute(ctx, m->src[0]->src[0], 0, 2, 1, 3);    /* [hd, T, n_kv] */
                if (rg_rank_expand_fits(v, node->src[1]) && v->ne[0] == node->ne[0]) {
                    become(node, rg_rank_expand(ctx, v, node->src[1]));
                    continue;
                }
            }
            if (permuted_as(m, 0, 2, 1, 3) && strncmp(m->src[0]->name, "k_rope", 6) == 0 &&
                ggml_is_contiguous(node->src[1])) {
                /* attention's scores K^T Q (graph.c: K permuted to [hd, T, n_kv], Q made contiguous):
                 * rank_expand over the head dimension on a copy of K with the tokens contiguous
                 * ([T, hd, n_kv], 0.2 MiB a layer on the default model). ggml's product ran at a
                 * third of rank_expand's rate on this shape (K = 64). */
                struct ggml_tensor * kt = ggml_cont(ctx, ggml_transpose(ctx, m));     /* [T, hd, n_kv] */
                if (rg_rank_expand_fits(kt, node->src[1]) && kt->ne[0] == node->ne[0]) {
                    become(node, rg_rank_expand(ctx, kt, node->src[1]));
                    continue;
                }
            }
            if ((m->flags & GGML_TENSOR_FLAG_PARAM) && m->ne[0] < m->ne[1] && m->ne[0] <= RG_RANK_EXPAND_MAX) {
                struct ggml_tensor * v = transposed(&tc, ctx, m);
                if (rg_rank_expand_fits(v, node->src[1])) {
                    become(node, rg_rank_expand(ctx, v, node->src[1]));
                    memo_keep(&lb, node, node);
                }
            }
            continue;
        }
        if (node->op != GGML_OP_OUT_PROD) continue;
        struct ggml_tensor * a = node->src[0], * bt = node->src[1];
        struct ggml_tensor * w = rg_base_weight_of(b->model, a);
        if (!w && own && bt->op != GGML_OP_TRANSPOSE && rg_outer_sum_fits(a, bt)) {
            /* a weight gradient (LoRA's A or B, attention's K or V): both operands hold a token per
             * column, which the outer-sum op reads as they are */
            become(node, rg_outer_sum(ctx, a, bt));
            continue;
        }
        if (!w && own && bt->op == GGML_OP_TRANSPOSE && rg_rank_expand_fits(a, bt->src[0])) {
            /* an input gradient whose other operand is not a base weight (through LoRA's A: A d(ax);
             * attention's queries and scores): a holds the contraction in its columns already */
            become(node, rg_rank_expand(ctx, a, bt->src[0]));
            continue;
        }
        if (w && own && packed && ggml_is_quantized(w->type)) {
            /* a base weight's input gradient W^T dy: gemm.c's kernel on the weight packed transposed */
            struct ggml_tensor * y = bt->op == GGML_OP_TRANSPOSE ? bt->src[0] : transposed(&tc, ctx, bt);
            if (y->nb[0] != sizeof(float)) y = ggml_cont(ctx, y);
            if (rg_pack_act_fits(y) && y->ne[0] == w->ne[1] && node->ne[0] == w->ne[0] && node->ne[1] == y->ne[1] &&
                node->ne[2] == 1) {
                become(node, rg_gemm(ctx, packed_weight(&pwt, ctx, b->model, w, true, kernel),
                                     packed_act(&pa, ctx, y, kernel), node->ne[0], node->ne[1]));
                continue;
            }
        }
        /* out_prod(a [n, m], b [p, m]) = mul_mat(a^T [m, n], b^T [m, p]); ggml's OUT_PROD kernel is
         * slow on the CPU for every type, the matmul kernels are not */
        struct ggml_tensor * x;
        if (w && w->type != GGML_TYPE_F32 && b->matmul.mode != RG_MATMUL_F32 && b->on_cpu) {
            /* a frozen base weight: dequantize, transpose to 16 bits (transient, freed after use);
             * F16/BF16 halve the copy and double the matmul speed against F32 (docs/architecture.md) */
            x = w->type == GGML_TYPE_F16 ? transposed(&tc, ctx, w)
                                         : dequant_transposed(&dq, ctx, b->model, w, b->matmul.conv_type);
        } else if (w) {
            /* F32 (or another device, where a cast is a ggml op the device can run) */
            x = ggml_cont(ctx, ggml_transpose(ctx, w->type == GGML_TYPE_F32 ? w : ggml_cast(ctx, w, GGML_TYPE_F32)));
        } else {
            x = transposed(&tc, ctx, a);
        }
        struct ggml_tensor * y = bt->op == GGML_OP_TRANSPOSE ? bt->src[0] : transposed(&tc, ctx, bt);
        if (w && y->nb[0] != sizeof(float)) {
            /* a thin gradient seen through a transpose (DoRA's W A^T): a copy of [n_out x rank]
             * floats buys the matmul kernel instead of OUT_PROD on quantized rows */
            y = ggml_cont(ctx, y);
        }
        if (x->ne[0] != y->ne[0] || node->ne[0] != x->ne[1] || node->ne[1] != y->ne[1] ||
            node->ne[2] != y->ne[2] || node->ne[3] != y->ne[3] || y->ne[2] % x->ne[2] != 0 ||
            y->nb[0] != sizeof(float)) {
            continue;   /* not a shape mul_mat can express: keep the OUT_PROD */
        }
        node->op = GGML_OP_MUL_MAT;
        memset(node->op_params, 0, sizeof(node->op_params));
        node->src[0] = x;
        node->src[1] = y;
    }
    free(uc);
    struct ggml_cgraph * g2 = reordered(ctx, gf, size, b, &dead, &live);
    free(live.key);
    return g2;
}
