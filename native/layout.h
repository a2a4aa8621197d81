/*
 * layout.h: what the client, the daemon and the native code exchange through a ring,
 * declared for C. transfer/ring/_layout.py declares the same for Python (the NumPy dtypes,
 * the opcodes, flags and kinds); the extension reports these (`_native.layout()`, module.c)
 * and transfer/ring checks them against its own at import, so the two cannot drift.
 */
#ifndef TRANSFER_LAYOUT_H
#define TRANSFER_LAYOUT_H

#include <stdint.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the ring layout is little-endian"
#endif

/* A request descriptor (REQUEST_DTYPE) and a completion (COMPLETION_DTYPE). */
typedef struct {
    uint16_t op, flags;
    uint32_t stream;
    uint64_t id, dst, src, nbytes, arg0, arg1, arg2;
} tdp_desc_t;
typedef struct {
    uint64_t id;
    int32_t status;
    uint32_t flags;
    uint64_t result, aux;
} tdp_comp_t;
_Static_assert(sizeof(tdp_desc_t) == 64, "descriptor layout");
_Static_assert(sizeof(tdp_comp_t) == 32, "completion layout");

/* Opcodes (transfer.ring.Op). */
enum { TDP_NOP = 0, TDP_COPY = 1, TDP_FILL = 2, TDP_CHECKSUM = 3, TDP_FENCE = 4, TDP_COMPUTE = 5, TDP_RUN_GRAPH = 6 };
/* The next descriptor belongs to the same request (a CopyV's chain). */
#define TDP_FLAG_CHAIN 1u
/* Waits for the control frames its client sent before it: only Python counts those. */
#define TDP_FLAG_AFTER 2u
/* A verified CopyV (every piece of its chain has it): one completion per piece, its sum. */
#define TDP_FLAG_SUM 4u
/* Descriptors one chain may have. */
#define TDP_MAX_CHAIN 4096u
/* A VA is segment << TDP_OFFSET_BITS | offset (transfer/addressing.py). */
#define TDP_OFFSET_BITS 40
#define TDP_OFFSET_MASK ((1ull << TDP_OFFSET_BITS) - 1)
/* checksum64 = the wrapping sum of the range's u64 words + its length * TDP_GOLDEN. */
#define TDP_GOLDEN 0x9E3779B97F4A7C15ull
/* Completion flag: the error's message follows on the control socket. */
#define TDP_COMPLETION_DETAIL 1u

/* What the client's submission knows of a request, by kind (transfer.ring KINDS): which
 * fields go where in its descriptors. */
enum { K_WAIT = 0, K_COPY, K_FILL, K_CHECKSUM, K_FENCE, K_RUN_GRAPH, K_COPYV, K_CHECKSUMV, K_COUNT };

#endif /* TRANSFER_LAYOUT_H */
