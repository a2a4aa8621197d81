/* The memory ceiling of the local cell's shape, in C: how fast can ANY consumer go?
 *
 * transfer-bench's local cell at large sizes is a producer that stamps every page of a
 * slot and checksums it (verify every group), and a consumer that copies the slot into
 * its own buffer and checksums what it copied. Both stream through DRAM at once. This
 * program runs that shape with no Python, no daemon and no IPC: a producer thread and a
 * consumer thread over SLOTS shared slots, the consumer copying with the worker's own
 * loop (native/dataplane.h: 16-byte loads, non-temporal stores, the word sum fused).
 *
 * It prints, in one run:
 *   memcpy alone      glibc memcpy of one slot, nothing else running (what
 *                     transfer-bench calls limit:memcpy, there with NumPy's copyto)
 *   copy+sum alone    the consumer's loop, nothing else running
 *   cell              the consumer's rate while the producer stamps and sums beside it
 *
 * "cell" is the best any consumer of this shape can do on the machine; transfer's 64 MiB
 * figure is to be read against it as well as against memcpy.
 *
 *   cc -O3 -march=native -pthread bench/ceiling.c -o /tmp/ceiling && /tmp/ceiling [MiB] [seconds]
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define SLOTS 4
#define STAMP_STRIDE 512 /* words: one per 4 KiB page, as transfer-bench's stamp */

static size_t n;
static uint8_t *src[SLOTS], *dst;
static atomic_int full[SLOTS];
static atomic_int stop;

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static uint64_t lanes(__m128i a, __m128i b, __m128i c, __m128i d)
{
    uint64_t l[2];
    _mm_storeu_si128((__m128i *)l, _mm_add_epi64(_mm_add_epi64(a, b), _mm_add_epi64(c, d)));
    return l[0] + l[1];
}

static uint64_t sum(const uint8_t *p)
{
    __m128i a = _mm_setzero_si128(), b = a, c = a, d = a;
    for (size_t i = 0; i < n; i += 64) {
        a = _mm_add_epi64(a, _mm_loadu_si128((const __m128i *)(p + i)));
        b = _mm_add_epi64(b, _mm_loadu_si128((const __m128i *)(p + i + 16)));
        c = _mm_add_epi64(c, _mm_loadu_si128((const __m128i *)(p + i + 32)));
        d = _mm_add_epi64(d, _mm_loadu_si128((const __m128i *)(p + i + 48)));
    }
    return lanes(a, b, c, d);
}

/* The worker's streamed copy with its sum (tdp_copy_sum, aligned case). */
static uint64_t copy_sum(uint8_t *d, const uint8_t *s)
{
    __m128i a = _mm_setzero_si128(), b = a, c = a, e = a;
    for (size_t i = 0; i < n; i += 64) {
        __m128i x0 = _mm_loadu_si128((const __m128i *)(s + i)), x1 = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i x2 = _mm_loadu_si128((const __m128i *)(s + i + 32)), x3 = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), x0);
        _mm_stream_si128((__m128i *)(d + i + 16), x1);
        _mm_stream_si128((__m128i *)(d + i + 32), x2);
        _mm_stream_si128((__m128i *)(d + i + 48), x3);
        a = _mm_add_epi64(a, x0); b = _mm_add_epi64(b, x1); c = _mm_add_epi64(c, x2); e = _mm_add_epi64(e, x3);
    }
    _mm_sfence();
    return lanes(a, b, c, e);
}

static void *producer(void *arg)
{
    (void)arg;
    volatile uint64_t sink = 0;
    for (uint64_t g = 0; !atomic_load(&stop); g++) {
        int s = g % SLOTS;
        while (atomic_load(&full[s]))
            if (atomic_load(&stop))
                return NULL;
        uint64_t *w = (uint64_t *)src[s];
        for (size_t i = 0; i < n / 8; i += STAMP_STRIDE)
            w[i] = g;
        sink += sum(src[s]);
        atomic_store(&full[s], 1);
    }
    return NULL;
}

static void *(*volatile glibc_memcpy)(void *, const void *, size_t) = memcpy;

int main(int argc, char **argv)
{
    n = (size_t)(argc > 1 ? atol(argv[1]) : 64) << 20;
    double secs = argc > 2 ? atof(argv[2]) : 2.0;
    for (int i = 0; i < SLOTS; i++) {
        src[i] = aligned_alloc(4096, n);
        memset(src[i], i + 1, n);
    }
    dst = aligned_alloc(4096, n);
    memset(dst, 0, n);
    volatile uint64_t sink = 0;
    double t0 = now();
    uint64_t k = 0;
    for (; now() - t0 < secs; k++)
        glibc_memcpy(dst, src[k % SLOTS], n);
    printf("memcpy alone    %6.1f GB/s\n", k * (double)n / (now() - t0) / 1e9);
    t0 = now();
    for (k = 0; now() - t0 < secs; k++)
        sink += copy_sum(dst, src[k % SLOTS]);
    printf("copy+sum alone  %6.1f GB/s\n", k * (double)n / (now() - t0) / 1e9);
    pthread_t t;
    pthread_create(&t, NULL, producer, NULL);
    t0 = now();
    for (k = 0; now() - t0 < secs; k++) {
        int s = k % SLOTS;
        while (!atomic_load(&full[s]))
            ;
        sink += copy_sum(dst, src[s]);
        atomic_store(&full[s], 0);
    }
    printf("cell            %6.1f GB/s  (%zu MiB slots; the producer stamps and sums each beside the copy)\n",
           k * (double)n / (now() - t0) / 1e9, n >> 20);
    atomic_store(&stop, 1);
    pthread_join(t, NULL);
    return (int)(sink & 0);
}
