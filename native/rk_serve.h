/* rdmakv native request loop: a node session's EXISTS and GET requests
 * answered in C.
 *
 * An engine's scheduler asks EXISTS for a prompt's block keys before each
 * step and waits for the answer, so its latency is what a lookup costs the
 * engine. Served in Python, the node spent a quarter of its round trip
 * framing, dispatching and checking the request (bench/README.md,
 * "Measurements moved from code comments (issue 58)"); this
 * loop reads the frame, touches the keys in the index under the store's
 * lock and sends the answer with the GIL released, and hands every other
 * frame back to the session's Python code untouched. A GET (a lookup and
 * its values, which the engine waits for as it loads a prompt) cost the node
 * more Python still around its two native calls, pin and send; here it is
 * one pass: look up and pin the hits under the lock (rk_index_get_records),
 * send the answer and the values straight from the pool in the same
 * system calls (rk_tcp_sendv), and drop the pins under the lock.
 *
 * The frames are the ones rdmakv/protocol.py documents (header, then
 * EXISTS's keys: u32 n, n x (u16 klen, key); answer: u32 n, n x u8. GET's
 * items: u32 n, n x (u16 klen, key, 16-byte digest); answer: u32 n, n x u32
 * length, n x u64 checksum, and the hits' values as bulk). The loop answers
 * only a request whose keys all have one length and whose payload is exactly
 * their size, with no bulk, and that fits the read-ahead buffer: what the
 * Python decoder's fast path accepts (decode_keys_request,
 * decode_get_request). A GET also needs room for its answer in the loop's
 * scratch, and its keys' values must fit one answer's bulk whatever they
 * hold (n x block size <= MAX_BULK_BYTES). Anything else, well-formed or
 * not, is the caller's to serve or refuse, so each error is still named in
 * one place.
 *
 * The store lock: the node's KVStore serialises every change to its index,
 * pool and leases with one lock. With the native index that lock is an
 * rk_store_lock, a mutex that Python takes through cffi (which drops the GIL
 * while it waits) and this loop takes without the GIL, so the loop's touch
 * is ordered with eviction, commits and every other store call exactly as a
 * Python EXISTS or GET would be. No thread ever waits for the GIL holding it:
 * the loop never takes the GIL, and a Python thread waits for the mutex with
 * the GIL released. A GET's pins keep its blocks while the lock is not held
 * (the send): nothing evicts or reuses a block with a reference beyond the
 * index's. Dropping a pin that is its block's last (the key was deleted or
 * evicted meanwhile) frees the block, which is the pool's free list's, in
 * Python: such blocks are handed to the caller (rk_serve_tally).
 * Plain libc and pthreads only; part of rdmakv._native (with
 * rk_tcp.c's send). */
#ifndef RK_SERVE_H
#define RK_SERVE_H
#include <stdint.h>
#include <stddef.h>

#include "rk_index.h"
#include "rk_tcp.h"

#define RK_SERVE_HEADER 24 /* HEADER in rdmakv/protocol.py: <BBHIQQ */
#define RK_SERVE_DIGEST 16 /* DIGEST_LEN: the digest after each GET key */
#define RK_SERVE_GET_ENTRY 12 /* GET_ENTRY_BYTES: a u32 length and a u64 checksum */

/* Return codes of rk_serve_requests. In every case buf[0, *have) holds the bytes
 * read and not answered (a frame's start), which belong to the caller now. */
#define RK_SERVE_IDLE 0    /* wait_ms passed with no whole frame to answer, or
                              the caller's turn came (see rk_serve_requests) */
#define RK_SERVE_OTHER 1   /* buf starts with a whole header this loop does not answer */
#define RK_SERVE_CLOSED 2  /* the peer closed the connection (or it was shut down) */
#define RK_SERVE_ERRNO 3   /* a system call failed; *err holds errno */
#define RK_SERVE_TIMEOUT 4 /* no room to send an answer for io_timeout_ms */

typedef struct rk_store_lock rk_store_lock;

/* A mutex for KVStore (NULL when out of memory); free it once nothing uses it. */
rk_store_lock *rk_store_lock_new(void);
void rk_store_lock_free(rk_store_lock *lock);
void rk_store_lock_acquire(rk_store_lock *lock);
void rk_store_lock_release(rk_store_lock *lock);

/* The store's counts of the GETs its native loops answered, which its
 * stats add to its own: updated under the store's lock, as the Python path
 * counts a GET's lookups as it pins them, so a stats call sees every GET
 * answered before it. One per store, shared by its sessions' loops. */
typedef struct {
    uint64_t gets;    /* GET answers sent whole */
    uint64_t lookups; /* keys looked up */
    uint64_t hits;
    uint64_t bytes; /* of the hits' values */
} rk_serve_counts;

/* What one session's loop keeps: the request opcodes it answers and the bit
 * a response sets (Op.EXISTS, Op.GET and RESPONSE_BIT, passed in so the
 * protocol's numbers stay written in one place), and its scratch space for
 * an answer and the touched blocks (sized from the read-ahead buffer's
 * capacity). get_opcode 0: every GET is the caller's, and the GET fields
 * are unused. */
typedef struct {
    rk_index *ix;
    rk_store_lock *lock;
    uint8_t opcode;
    uint8_t response_bit;
    uint32_t max_keys_per_request; /* MAX_KEYS_PER_REQUEST */
    uint8_t *answer;               /* RK_SERVE_HEADER + 4 + keys bytes */
    int64_t *blocks;               /* one per key */
    size_t max_keys;               /* most keys a request in buf can hold */
    /* GET: the index's per-block value lengths and checksums, the pool's
     * refcounts (rk_index_get_records), block b at base + b * block_size */
    uint8_t get_opcode;
    const uint32_t *lengths;
    const uint64_t *sums;
    int32_t *refs;
    uint64_t base;
    uint64_t block_size;
    size_t max_get_keys;  /* most keys of a GET answered here (its scratch, and
                             max_get_keys * block_size <= MAX_BULK_BYTES) */
    uint8_t *get_answer;  /* RK_SERVE_HEADER + 4 + max_get_keys * RK_SERVE_GET_ENTRY */
    uint64_t *iov;        /* (max_get_keys + 1) (address, length) rows */
    uint32_t *hit_blocks; /* max_get_keys */
    uint32_t *last;       /* max_get_keys: see rk_serve_tally */
    rk_serve_counts *counts; /* the store's */
    int *sending; /* 1 while a GET's answer goes out: the session is busy then, not
                     idle (read by the node's admission, without the lock) */
} rk_serve_ctx;

/* What one call's GETs left for the caller: the answers it sent whole, and
 * `last` blocks in ctx->last whose pin was their block's last reference (the
 * key was deleted or evicted meanwhile), which the caller must give back to
 * the pool (decref) under the store's lock. A GET that leaves such blocks
 * ends the call (its turn). */
typedef struct {
    uint64_t sent;
    size_t last;
} rk_serve_tally;

/* Serve EXISTS and GET requests from fd (a non-blocking stream socket)
 * until another frame comes, the connection ends, or the caller's turn:
 * wait_ms after the call began, or once max_served answers were sent. Then
 * the caller settles *tally, checks whether the node is stopping, marks the
 * session active if it answered any (so a session busy in this loop is
 * never taken for idle), serves a frame left part read, and calls again.
 *
 * buf (capacity cap) is the session's read-ahead buffer, *have bytes already
 * in it on entry; frames are read into it, answered and dropped from its
 * front. Each answer goes out whole before the next frame is read: a send
 * that finds no room waits at most io_timeout_ms for it. *served: answers
 * sent; durations_ns[i] and ops[i] (when not NULL, max_served entries):
 * answer i's time from its last byte received to its answer sent, and its
 * request's opcode, for the node's metrics. */
int rk_serve_requests(const rk_serve_ctx *ctx, int fd, int wait_ms, int io_timeout_ms,
                      uint8_t *buf, size_t cap, size_t *have, uint64_t *durations_ns,
                      uint8_t *ops, size_t max_served, size_t *served, rk_serve_tally *tally,
                      int *err);

#endif
