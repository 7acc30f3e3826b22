/*
 * matmul.c - the policy for the frozen base weights' products: which weights a matmul mode
 * multiplies through a 16-bit copy, and of which type.
 */
#include "rg_internal.h"

bool rg_use_converted_matmul(enum ggml_type type, int mode) {
    if (mode == RG_MATMUL_NATIVE || mode == RG_MATMUL_F32 || !ggml_is_quantized(type)) return false;
    if (mode == RG_MATMUL_F16 || mode == RG_MATMUL_BF16) return true;
    /* measured on AVX2 (scripts/bench_matmul.py): Q8_0 and Q4_0 have fast native kernels */
    return type != GGML_TYPE_Q8_0 && type != GGML_TYPE_Q4_0;
}

enum ggml_type rg_conv_type(int mode) {
    if (mode == RG_MATMUL_BF16) return GGML_TYPE_BF16;
    if (mode == RG_MATMUL_AUTO && ggml_cpu_has_avx512_bf16()) return GGML_TYPE_BF16;
    return GGML_TYPE_F16;
}

const char * rg_matmul_conv_type(int mode) {
    return mode == RG_MATMUL_F32 ? "f32" : ggml_type_name(rg_conv_type(mode));
}
