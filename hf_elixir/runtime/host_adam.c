/* The one-pass host Adam of hf_elixir (runtime/host_kernel.py): the update of an offloaded
   chunk and its compute-dtype copy in one loop over memory.

   host_kernel.py compiles this file for the machine's CPU on first use (cc -O3 -march=native,
   linked against the OpenMP runtime PyTorch loaded where there is one), keeps the library in
   a private folder of the calibration cache with its sha256 beside it, and calls it through
   ctypes. It follows PyTorch's fused Adam(W) kernel's order of operations; `check` in
   host_kernel.py compares the two whenever the library loads. A change here changes the
   cache key, so every machine builds the new loop on its next run. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__F16C__) || defined(__FLT16_MAX__)
#define HAS_FP16 1
#else
#define HAS_FP16 0
#endif

/* fp32 -> bf16 as PyTorch casts: to nearest, ties to even; NaN to 0x7FC0 */
static inline uint16_t to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    return (uint16_t)(x != x ? 0x7FC0u : rounded);
}

static inline float from_bf16(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* one Adam(W) update of n elements, in PyTorch's fused kernel's order of operations; the
   constant flags make each call below a loop of its own, vectorised without branches */
static inline void adam(float *restrict param, const void *restrict grad, float *restrict exp_avg,
                        float *restrict exp_avg_sq, void *restrict out, int64_t n, const float *s,
                        const int grad_bf16, const int out_kind, const int decoupled, const int maximize) {
    const float decay = s[0], one_minus_beta1 = s[1], beta2 = s[2], one_minus_beta2 = s[3], eps = s[4],
                step_size = s[5], bc2_sqrt = s[6], factor = s[7];
    const float *g32 = (const float *)grad;
    const uint16_t *g16 = (const uint16_t *)grad;
    float *o32 = (float *)out;
    uint16_t *o16 = (uint16_t *)out;
    for (int64_t i = 0; i < n; i++) {
        /* the clipping factor, rounded as a separate fp32 multiply rounds it (1 is exact) */
        float g = (grad_bf16 ? from_bf16(g16[i]) : g32[i]) * factor;
        if (maximize) g = -g;
        float p = param[i];
        if (decoupled) p = p * decay; else g = g + decay * p;
        float m = exp_avg[i] + (g - exp_avg[i]) * one_minus_beta1;
        float v = exp_avg_sq[i] * beta2 + (g * g) * one_minus_beta2;
        float denom = sqrtf(v) / bc2_sqrt + eps;
        p = p - step_size * m / denom;
        param[i] = p;
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        if (out_kind == 1) o32[i] = p;
        if (out_kind == 2) o16[i] = to_bf16(p);
    }
}

/* fp32 -> fp16 as PyTorch's CPU cast: the hardware conversion, to nearest, ties to even
   (NaN: quiet, the payload's top bits kept) */
static void to_fp16(const float *restrict src, uint16_t *restrict dst, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++)
        dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
#elif defined(__FLT16_MAX__)
    for (; i < n; i++) {
        _Float16 h = (_Float16)src[i];
        memcpy(dst + i, &h, sizeof h);
    }
#else
    (void)src; (void)dst; (void)n; (void)i;
#endif
}

/* 1 where the loop writes an fp16 copy */
int hf_elixir_fp16(void) {
#if HAS_FP16
    return 1;
#else
    return 0;
#endif
}

int hf_elixir_adam(float *param, const void *grad, float *exp_avg, float *exp_avg_sq, void *out, int64_t n,
                   const float *s, int grad_bf16, int out_kind, int decoupled, int maximize);

/* the fp16 copy: the vectorised loop writes an fp32 block that stays in the cache, which
   the conversion then reads (compilers do not vectorise the conversion inside the loop) */
static int adam_fp16(float *param, const void *grad, float *exp_avg, float *exp_avg_sq, uint16_t *out, int64_t n,
                     const float *s, int grad_bf16, int decoupled, int maximize) {
    float block[1024];
    const int64_t grad_size = grad_bf16 ? 2 : 4;
    for (int64_t lo = 0; lo < n; lo += 1024) {
        const int64_t m = n - lo < 1024 ? n - lo : 1024;
        if (hf_elixir_adam(param + lo, (const char *)grad + grad_size * lo, exp_avg + lo, exp_avg_sq + lo, block, m,
                           s, grad_bf16, 1, decoupled, maximize))
            return 1;
        to_fp16(block, out + lo, m);
    }
    return 0;
}

#define CASE(GB, OK, DE, MA) \
    if (grad_bf16 == GB && out_kind == OK && decoupled == DE && maximize == MA) { \
        adam(param, grad, exp_avg, exp_avg_sq, out, n, s, GB, OK, DE, MA); return 0; }
#define CASES(GB, OK) CASE(GB, OK, 0, 0) CASE(GB, OK, 0, 1) CASE(GB, OK, 1, 0) CASE(GB, OK, 1, 1)

/* grad_bf16: the gradient is bf16 (else fp32); out_kind: 0 no copy, 1 an fp32 copy, 2 bf16,
   3 fp16 (where hf_elixir_fp16) */
int hf_elixir_adam(float *param, const void *grad, float *exp_avg, float *exp_avg_sq, void *out, int64_t n,
                   const float *s, int grad_bf16, int out_kind, int decoupled, int maximize) {
    CASES(0, 0) CASES(0, 1) CASES(0, 2) CASES(1, 0) CASES(1, 1) CASES(1, 2)
    if (out_kind == 3 && HAS_FP16)
        return adam_fp16(param, grad, exp_avg, exp_avg_sq, (uint16_t *)out, n, s, grad_bf16, decoupled, maximize);
    return 1;
}

/* 1 where built with OpenMP: hf_elixir_adam_parallel runs its parts on OpenMP's threads */
int hf_elixir_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* hf_elixir_adam over `parts` contiguous parts of the run, each a whole number of cache
   lines, one per thread of the OpenMP runtime PyTorch loaded (in order without OpenMP) */
int hf_elixir_adam_parallel(float *param, const void *grad, float *exp_avg, float *exp_avg_sq, void *out,
                            int64_t n, const float *s, int grad_bf16, int out_kind, int decoupled, int maximize,
                            int parts) {
    const int64_t grad_size = grad_bf16 ? 2 : 4, out_size = out_kind >= 2 ? 2 : 4;
    const int64_t per = ((n + parts - 1) / parts + 63) / 64 * 64;
    int rc = 0;
#pragma omp parallel for num_threads(parts) schedule(static, 1) reduction(|:rc)
    for (int part = 0; part < parts; part++) {
        const int64_t lo = per * part, hi = lo + per < n ? lo + per : n;
        if (lo < hi)
            rc |= hf_elixir_adam(param + lo, (const char *)grad + grad_size * lo, exp_avg + lo, exp_avg_sq + lo,
                                 out ? (char *)out + out_size * lo : out, hi - lo, s, grad_bf16, out_kind,
                                 decoupled, maximize);
    }
    return rc;
}
