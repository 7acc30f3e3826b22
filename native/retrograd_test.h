/*
 * retrograd_test.h - the native library's entry points for tests and benchmarks: compiled into the
 * same library as the ABI (retrograd.h) and reached through the same cffi module
 * (retrograd/native.py, which reads both headers' declaration blocks), but kept apart so the ABI a
 * product uses holds no switch that exists only to check or time it.
 *
 * The block between RG_CDEF_BEGIN and RG_CDEF_END is fed verbatim to cffi, as retrograd.h's is.
 */
#ifndef RETROGRAD_TEST_H
#define RETROGRAD_TEST_H

#include "retrograd.h"

#ifdef __cplusplus
extern "C" {
#endif

/* RG_CDEF_BEGIN */
/* Address of ggml_init as this library resolved it: lets a test prove the process holds a single
 * ggml (the one llama-cpp-python loaded). */
const void * rg_ggml_init_address(void);
/* 1: compute with composite ops of exact math (GELU from exp/softplus) everywhere instead of
 * llama.cpp's fused ops (GELU from an fp16 table). Forward values then differ from llama.cpp by
 * ~1e-3 relative on GELU models, but the forward is the exact function the gradient is of,
 * which finite-difference tests need. 0 (the default): the fused ops. RG_ERR_ARG otherwise. */
rg_status rg_engine_set_exact_ops(rg_engine * engine, int on);
/* Time ggml's CPU product of an [m, k] matrix of ggml type `type` (F32, F16 or a quantized
 * type; k a multiple of its block size) with an F32 [k, n] one: seconds per product, the median
 * rate is 2 m n k / seconds. A yardstick for the profile's FLOP rates, measured in the same run. */
rg_status rg_matmul_bench(int type, int64_t m, int64_t n, int64_t k, int n_threads, int reps, double * seconds_out);
/* The same for a packed product (gemm.c; kernel: RG_KERNEL_AUTO for the CPU's own, or one forced:
 * BF16, or F16 weights times F32 activations on AVX2) of an [m, k] weight and [k, n] activations,
 * both packed beforehand: the product alone. RG_ERR_UNSUPPORTED where it does not run. */
rg_status rg_gemm_bench(int kernel, int64_t m, int64_t n, int64_t k, int n_threads, int reps, double * seconds_out);
/* A packed product (gemm.c, kernel as for rg_gemm_bench) on its own, for tests against an oracle:
 * w [n_out, n_in] (row-major floats) is quantized to ggml type `type` (or kept, F32) and written back
 * dequantized to w_dequant; out = W x for x [n_tokens, n_in], or W^T x for x [n_tokens, n_out] when
 * transposed, each row of out one token's outputs; with rank > 0, plus the low-rank term V Z for
 * v [rank, rows] and z [n_tokens, rank] (F32, not rounded). The kernel rounds W to BF16 and x to BF16
 * (the BF16 kernels), or W to F16 and x not at all (avx2-f16). */
rg_status rg_gemm_check(int kernel, int type, const float * w, int64_t n_out, int64_t n_in, const float * x,
                        int64_t n_tokens, int transposed, const float * v, const float * z, int rank, int n_threads,
                        float * out, float * w_dequant);
/* RG_CDEF_END */

#ifdef __cplusplus
}
#endif

#endif /* RETROGRAD_TEST_H */
