/*
 * matmul.c - how the frozen base weights are multiplied, decided once: from an engine's matmul mode
 * and kernel request (rg_engine_set_matmul), or a weight cache's (rg_model_set_weight_cache), which
 * weights go through a 16-bit copy, of which type, and which kernel multiplies the copies:
 * retrograd's packed product (gemm.c and its AMX and AVX2 siblings) or ggml's own. The graph
 * (graph.c, rewrite.c), the LM head and the weight cache read the decision (rg_matmul) and ask
 * neither the CPU nor the mode again.
 *
 * The CPU is asked here only: ggml says what it was compiled for and the CPU what it runs, and a
 * BF16 kernel needs both to have the BF16 dot product (the mode's conversion type asks ggml alone,
 * since ggml's own BF16 product is what runs without the packed kernel).
 */
#include "rg_internal.h"
#include "kernels.h"

#include "ggml-cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
/* ggml and the CPU both have AVX512-BF16's dot product */
static bool bf16_dot(void) {
    __builtin_cpu_init();
    return ggml_cpu_has_avx512_bf16() && __builtin_cpu_supports("avx512bf16");
}
#endif

/* whether this CPU runs a packed kernel, and what it lacks when it does not */
static const char * missing(int kernel) {
#if defined(__x86_64__) && defined(__GNUC__)
    switch (kernel) {
        case RG_KERNEL_AVX512_BF16: return bf16_dot() ? NULL : "AVX512-BF16";
        case RG_KERNEL_AMX_BF16:    return !bf16_dot() ? "AVX512-BF16" : rg_amx_ready() ? NULL : "AMX-BF16 tiles";
        case RG_KERNEL_AVX2_F16:    return rg_avx2_ready() ? NULL : "AVX2, FMA and F16C";
        default:                    return NULL;
    }
#else
    return kernel == RG_KERNEL_GGML ? NULL : "an x86-64 CPU";
#endif
}

/* the kernel RG_KERNEL_AUTO takes: AMX tiles, else AVX512-BF16, where the CPU has a BF16 dot
 * product; else the F16 kernel where it has AVX2; else ggml's product */
static int cpu_kernel(void) {
    if (!missing(RG_KERNEL_AVX512_BF16)) return missing(RG_KERNEL_AMX_BF16) ? RG_KERNEL_AVX512_BF16 : RG_KERNEL_AMX_BF16;
    return missing(RG_KERNEL_AVX2_F16) ? RG_KERNEL_GGML : RG_KERNEL_AVX2_F16;
}

static const char * kernel_name(int kernel) {
    switch (kernel) {
        case RG_KERNEL_AVX512_BF16: return "avx512-bf16";
        case RG_KERNEL_AMX_BF16:    return "amx-bf16";
        case RG_KERNEL_AVX2_F16:    return "avx2-f16";
        default:                    return "ggml";
    }
}

/* the conversion type: BF16 where the mode asks for it, or auto where ggml has the BF16 dot product */
static enum ggml_type conv_type(int mode) {
    if (mode == RG_MATMUL_BF16) return GGML_TYPE_BF16;
    if (mode == RG_MATMUL_AUTO && ggml_cpu_has_avx512_bf16()) return GGML_TYPE_BF16;
    return GGML_TYPE_F16;
}

static rg_status check(int mode, int kernel) {
    if (mode < RG_MATMUL_AUTO || mode > RG_MATMUL_BF16) return rg_fail(RG_ERR_ARG, "unknown matmul mode %d", mode);
    if (kernel < RG_KERNEL_AUTO || kernel > RG_KERNEL_AVX2_F16) {
        return rg_fail(RG_ERR_ARG, "unknown matmul kernel %d", kernel);
    }
    const char * lacks = missing(kernel);
    if (lacks) {
        return rg_fail(RG_ERR_UNSUPPORTED, "the %s kernel does not run on this CPU: it needs %s", kernel_name(kernel),
                       lacks);
    }
    return RG_OK;
}

rg_status rg_matmul_decide(int mode, int kernel, rg_matmul * out) {
    const rg_status st = check(mode, kernel);
    if (st) return st;
    const int k = kernel == RG_KERNEL_AUTO ? cpu_kernel() : kernel;
    out->mode = mode;
    out->conv_type = conv_type(mode);
    /* a kernel multiplies copies of its own type, in the modes that convert for speed (auto or the
     * explicit type; never native, whose backward converts only to transpose, nor f32) */
    const enum ggml_type kt = k == RG_KERNEL_AVX2_F16 ? GGML_TYPE_F16 : GGML_TYPE_BF16;
    const bool converts = mode == RG_MATMUL_AUTO || mode == RG_MATMUL_F16 || mode == RG_MATMUL_BF16;
    out->kernel = k != RG_KERNEL_GGML && converts && out->conv_type == kt ? k : RG_KERNEL_GGML;
    return RG_OK;
}

bool rg_matmul_converts(const rg_matmul * mm, enum ggml_type type) {
    if (mm->mode == RG_MATMUL_NATIVE || mm->mode == RG_MATMUL_F32 || !ggml_is_quantized(type)) return false;
    if (mm->mode == RG_MATMUL_F16 || mm->mode == RG_MATMUL_BF16) return true;
    /* measured on AVX2 (scripts/bench_matmul.py): Q8_0 and Q4_0 have fast native kernels */
    return type != GGML_TYPE_Q8_0 && type != GGML_TYPE_Q4_0;
}

const char * rg_matmul_conv_type(int mode) {
    return mode == RG_MATMUL_F32 ? "f32" : ggml_type_name(conv_type(mode));
}

rg_status rg_matmul_kernel(int mode, int kernel, const char ** name) {
    rg_matmul mm;
    const rg_status st = rg_matmul_decide(mode, kernel, &mm);
    if (st == RG_OK && name) *name = kernel_name(mm.kernel);
    return st;
}
