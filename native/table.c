/*
 * table.c: the data plane's mapping table (dataplane.h, "THE TABLE"): segment id -> memory,
 * owner, guests, device, under a writer-preferring rwlock. The workers translate against it
 * (dataplane.c, device.c); the binding keeps it in step with the daemon's (dataplane_type.c).
 */
#include "dataplane.h"

int tdp_table_init(tdp_table_t *t)
{
    pthread_rwlockattr_t a;
    pthread_rwlockattr_init(&a);
    /* A free must not starve behind a stream of readers. */
    pthread_rwlockattr_setkind_np(&a, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
    int rc = pthread_rwlock_init(&t->lock, &a);
    pthread_rwlockattr_destroy(&a);
    t->segs = NULL;
    t->n = t->cap = 0;
    atomic_store(&t->pinned_bytes, 0);
    atomic_store(&t->pin_cap, 0);
    return rc;
}

/* Room for one more element in a growable array (doubling from `first`). 0, or -1: no memory. */
static inline int tdp_grow(void **items, uint32_t n, uint32_t *cap, size_t size, uint32_t first)
{
    if (n < *cap)
        return 0;
    uint32_t c = *cap ? 2 * *cap : first;
    void *p = realloc(*items, (size_t)c * size);
    if (!p)
        return -1;
    *items = p;
    *cap = c;
    return 0;
}

/* Index of sid, or of where it would go (*found = 0). Call under either lock. */
static inline uint32_t tdp_find(const tdp_table_t *t, uint32_t sid, int *found)
{
    uint32_t lo = 0, hi = t->n;
    while (lo < hi) {
        uint32_t mid = (lo + hi) / 2;
        if (t->segs[mid].sid < sid)
            lo = mid + 1;
        else
            hi = mid;
    }
    *found = lo < t->n && t->segs[lo].sid == sid;
    return lo;
}

/* Insert (under the write lock). -1: no memory; -2: already present. */
int tdp_table_add(tdp_table_t *t, uint32_t sid, uint8_t *base, uint64_t nbytes,
                                uint64_t owner, int32_t device, void *keep)
{
    int found;
    uint32_t i = tdp_find(t, sid, &found);
    if (found)
        return -2;
    if (tdp_grow((void **)&t->segs, t->n, &t->cap, sizeof *t->segs, 64) < 0)
        return -1;
    tdp_busy_t *busy = calloc(1, sizeof *busy);
    if (!busy)
        return -1;
    busy->base = base;
    busy->nbytes = nbytes;
    memmove(&t->segs[i + 1], &t->segs[i], (size_t)(t->n - i) * sizeof *t->segs);
    t->segs[i] = (tdp_seg_t){sid, device, base, nbytes, owner, NULL, 0, 0, keep, -1, 0, busy};
    t->n++;
    return 0;
}

int tdp_table_add_cuda(tdp_table_t *t, uint32_t sid, uint64_t ptr, uint64_t nbytes, uint64_t owner, int32_t device,
                       int32_t ordinal, void *keep)
{
    int rc = tdp_table_add(t, sid, (uint8_t *)(uintptr_t)ptr, nbytes, owner, device, keep);
    if (rc == 0) {
        int found;
        tdp_seg_t *e = &t->segs[tdp_find(t, sid, &found)];
        e->cuda = 1;
        e->ordinal = ordinal;
        atomic_store(&e->busy->pin, TDP_PIN_REFUSED); /* (device memory is never page-locked) */
    }
    return rc;
}

tdp_busy_t *tdp_table_busy(tdp_table_t *t, uint32_t sid)
{
    int found;
    uint32_t i = tdp_find(t, sid, &found);
    return found ? t->segs[i].busy : NULL;
}

/* Remove (under the write lock); returns the entry's keep handle (NULL if absent). */
void *tdp_table_remove(tdp_table_t *t, uint32_t sid, tdp_busy_t **busy, int *cuda)
{
    int found;
    uint32_t i = tdp_find(t, sid, &found);
    *busy = NULL;
    if (!found)
        return NULL;
    void *keep = t->segs[i].keep;
    *busy = t->segs[i].busy;
    *cuda = t->segs[i].cuda;
    free(t->segs[i].guests);
    memmove(&t->segs[i], &t->segs[i + 1], (size_t)(t->n - i - 1) * sizeof *t->segs);
    t->n--;
    return keep;
}

/* Let `session` use segment sid too (Share/Attach), or stop it. Under the write lock. */
int tdp_table_guest(tdp_table_t *t, uint32_t sid, uint64_t session, int allow)
{
    int found;
    uint32_t i = tdp_find(t, sid, &found);
    if (!found)
        return 0;
    tdp_seg_t *e = &t->segs[i];
    for (uint32_t k = 0; k < e->nguests; k++) {
        if (e->guests[k] == session) {
            if (!allow)
                e->guests[k] = e->guests[--e->nguests];
            return 0;
        }
    }
    if (!allow)
        return 0;
    if (tdp_grow((void **)&e->guests, e->nguests, &e->guest_cap, sizeof *e->guests, 4) < 0)
        return -1;
    e->guests[e->nguests++] = session;
    return 0;
}

/* [va, va + n) as a pointer the worker may touch, if it lies in one segment `session` may use
 * and in host memory; else NULL (CUDA memory: tdp_lookup). *device gets the segment's device
 * (-1: host). Under the read lock. */
uint8_t *tdp_translate(const tdp_table_t *t, uint64_t session, uint64_t va, uint64_t n,
                                     int32_t *device)
{
    uint64_t off;
    const tdp_seg_t *e = tdp_lookup(t, session, va, n, &off);
    if (!e || e->cuda)
        return NULL;
    *device = e->device;
    return e->base + off;
}

const tdp_seg_t *tdp_lookup(const tdp_table_t *t, uint64_t session, uint64_t va, uint64_t n, uint64_t *off_out)
{
    int found;
    uint64_t sid64 = va >> TDP_OFFSET_BITS, off = va & TDP_OFFSET_MASK;
    uint32_t i = tdp_find(t, (uint32_t)sid64, &found);
    if (!found)
        return NULL;
    const tdp_seg_t *e = &t->segs[i];
    if (e->owner != session) {
        uint32_t k = 0;
        while (k < e->nguests && e->guests[k] != session)
            k++;
        if (k == e->nguests)
            return NULL;
    }
    if (off > e->nbytes || n > e->nbytes - off)
        return NULL;
    *off_out = off;
    return e;
}

