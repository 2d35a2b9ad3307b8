/* Row copies with streaming stores, for node_agent.backend.row_kernel (loaded with ctypes).
 *
 * A row is `row` bytes. Every function copies whole rows between two C-contiguous
 * buffers; the caller (RowOp) has checked every index against both buffers, that
 * destination rows do not repeat and that the two buffers do not overlap, before
 * calling. On x86-64 a row whose destination is 16-byte aligned and whose size is a
 * multiple of 64 (AVX2: 32-byte aligned, a multiple of 128) is written with
 * non-temporal (streaming) stores: the destination
 * line is not read first and the copy does not evict the caches, which makes a
 * scattered row copy as fast as a flat memcpy or faster. Other rows, and every row
 * on other architectures, use memcpy. Each call ends with a store fence, so every
 * byte is visible to other threads once it returns.
 */
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define ROWCOPY_STREAM 1
#endif

#ifdef ROWCOPY_STREAM
/* 16-byte loads and streaming stores: every x86-64 CPU has SSE2. */
static void rows_sse2(char *dst, const int64_t *didx, const char *src, const int64_t *sidx,
                      int64_t n, int64_t row) {
    for (int64_t i = 0; i < n; i++) {
        char *d = dst + (didx ? didx[i] : i) * row;
        const char *s = src + (sidx ? sidx[i] : i) * row;
        if (((uintptr_t)d & 15) || (row & 63)) { memcpy(d, s, (size_t)row); continue; }
        for (int64_t o = 0; o < row; o += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(s + o));
            __m128i b = _mm_loadu_si128((const __m128i *)(s + o + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + o + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + o + 48));
            _mm_stream_si128((__m128i *)(d + o), a);
            _mm_stream_si128((__m128i *)(d + o + 16), b);
            _mm_stream_si128((__m128i *)(d + o + 32), c);
            _mm_stream_si128((__m128i *)(d + o + 48), e);
        }
    }
    _mm_sfence();
}

/* 32-byte loads and streaming stores, chosen at run time where the CPU has AVX2
 * (measured 0.1-0.2 of a flat copy faster than SSE2 on 2 KiB rows). */
__attribute__((target("avx2")))
static void rows_avx2(char *dst, const int64_t *didx, const char *src, const int64_t *sidx,
                      int64_t n, int64_t row) {
    for (int64_t i = 0; i < n; i++) {
        char *d = dst + (didx ? didx[i] : i) * row;
        const char *s = src + (sidx ? sidx[i] : i) * row;
        if (((uintptr_t)d & 31) || (row & 127)) { memcpy(d, s, (size_t)row); continue; }
        for (int64_t o = 0; o < row; o += 128) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(s + o));
            __m256i b = _mm256_loadu_si256((const __m256i *)(s + o + 32));
            __m256i c = _mm256_loadu_si256((const __m256i *)(s + o + 64));
            __m256i e = _mm256_loadu_si256((const __m256i *)(s + o + 96));
            _mm256_stream_si256((__m256i *)(d + o), a);
            _mm256_stream_si256((__m256i *)(d + o + 32), b);
            _mm256_stream_si256((__m256i *)(d + o + 64), c);
            _mm256_stream_si256((__m256i *)(d + o + 96), e);
        }
    }
    _mm_sfence();
}
#endif

/* The most capable copy this CPU runs: 2 AVX2 streaming stores, 1 SSE2, 0 memcpy. */
static int best_level(void) {
#ifdef ROWCOPY_STREAM
    return __builtin_cpu_supports("avx2") ? 2 : 1;
#else
    return 0;
#endif
}

/* A cap on the level (tests set it to run every variant); negative: no cap. */
int rowcopy_max_level = -1;

/* The level rows() runs at: best_level(), capped by rowcopy_max_level. */
int rowcopy_level(void) {
    int best = best_level();
    return rowcopy_max_level >= 0 && rowcopy_max_level < best ? rowcopy_max_level : best;
}

/* dst[didx[i] or i] = src[sidx[i] or i] for i in [0, n); a null index means "i". */
static void rows(char *dst, const int64_t *didx, const char *src, const int64_t *sidx,
                 int64_t n, int64_t row) {
    int level = rowcopy_level();
#ifdef ROWCOPY_STREAM
    if (level == 2) { rows_avx2(dst, didx, src, sidx, n, row); return; }
    if (level == 1) { rows_sse2(dst, didx, src, sidx, n, row); return; }
#endif
    (void)level;
    for (int64_t i = 0; i < n; i++)
        memcpy(dst + (didx ? didx[i] : i) * row, src + (sidx ? sidx[i] : i) * row, (size_t)row);
}

/* dst[i] = src[idx[i]] for i in [0, n) */
void rowcopy_gather(char *dst, const char *src, const int64_t *idx, int64_t n, int64_t row) {
    rows(dst, NULL, src, idx, n, row);
}

/* dst[idx[i]] = src[i] for i in [0, n) */
void rowcopy_scatter(char *dst, const int64_t *idx, const char *src, int64_t n, int64_t row) {
    rows(dst, idx, src, NULL, n, row);
}

/* dst[i] = src[i] for i in [0, n): one run of rows, as one flat streaming copy */
void rowcopy_run(char *dst, const char *src, int64_t n, int64_t row) {
    rows(dst, NULL, src, NULL, 1, n * row);
}

/* dst[didx[i]] = src[sidx[i]] for i in [0, n): no staging, one pass */
void rowcopy_gather_scatter(char *dst, const int64_t *didx, const char *src,
                            const int64_t *sidx, int64_t n, int64_t row) {
    rows(dst, didx, src, sidx, n, row);
}
