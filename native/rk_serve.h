/* rdmakv native request loop: a node session's EXISTS requests answered in C.
 *
 * An engine's scheduler asks EXISTS for a prompt's block keys before each
 * step and waits for the answer, so its latency is what a lookup costs the
 * engine. Served in Python, the node spent ~8 us of its ~30 us round trip
 * (64 keys, one CPU) framing, dispatching and checking the request; this
 * loop reads the frame, touches the keys in the index under the store's
 * lock and sends the answer with the GIL released, and hands every other
 * frame back to the session's Python code untouched.
 *
 * The frame is the one rdmakv/protocol.py documents (header, then EXISTS's
 * keys: u32 n, n x (u16 klen, key); answer: u32 n, n x u8). The loop answers
 * only a request whose keys all have one length and whose payload is exactly
 * their size, with no bulk, and that fits the read-ahead buffer: what the
 * Python decoder's fast path accepts (decode_keys_request). Anything else,
 * well-formed or not, is the caller's to serve or refuse, so each error is
 * still named in one place.
 *
 * The store lock: the node's KVStore serialises every change to its index,
 * pool and leases with one lock. With the native index that lock is an
 * rk_store_lock, a mutex that Python takes through cffi (which drops the GIL
 * while it waits) and this loop takes without the GIL, so the loop's touch
 * is ordered with eviction, commits and every other store call exactly as a
 * Python EXISTS would be. No thread ever waits for the GIL holding it: the
 * loop never takes the GIL, and a Python thread waits for the mutex with the
 * GIL released. Plain libc and pthreads only; part of rdmakv._native_index. */
#ifndef RK_SERVE_H
#define RK_SERVE_H
#include <stdint.h>
#include <stddef.h>

#include "rk_index.h"

#define RK_SERVE_HEADER 24 /* HEADER in rdmakv/protocol.py: <BBHIQQ */

/* Return codes of rk_serve_exists. In every case buf[0, *have) holds the bytes
 * read and not answered (a frame's start), which belong to the caller now. */
#define RK_SERVE_IDLE 0    /* wait_ms passed with no whole frame to answer, or
                              the caller's turn came (see rk_serve_exists) */
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

/* What one session's loop keeps: the request opcode it answers and the bit a
 * response sets (Op.EXISTS and RESPONSE_BIT, passed in so the protocol's
 * numbers stay written in one place), and its scratch space for an answer
 * and the touched blocks (sized from the read-ahead buffer's capacity). */
typedef struct {
    rk_index *ix;
    rk_store_lock *lock;
    uint8_t opcode;
    uint8_t response_bit;
    uint32_t max_keys_per_request; /* MAX_KEYS_PER_REQUEST */
    uint8_t *answer;               /* RK_SERVE_HEADER + 4 + keys bytes */
    int64_t *blocks;               /* one per key */
    size_t max_keys;               /* most keys a request in buf can hold */
} rk_serve_ctx;

/* Serve EXISTS requests from fd (a non-blocking stream socket) until another
 * frame comes, the connection ends, or the caller's turn: wait_ms after the
 * call began, or once max_served answers were sent. Then the caller checks
 * whether the node is stopping, marks the session active if it answered any
 * (so a session busy in this loop is never taken for idle), serves a frame
 * left part read, and calls again.
 *
 * buf (capacity cap) is the session's read-ahead buffer, *have bytes already
 * in it on entry; frames are read into it, answered and dropped from its
 * front. Each answer goes out whole before the next frame is read: a send
 * that finds no room waits at most io_timeout_ms for it. *served: answers
 * sent; durations_ns[i] (when not NULL, max_served entries): answer i's time
 * from its last byte received to its answer sent, for the node's metrics. */
int rk_serve_exists(const rk_serve_ctx *ctx, int fd, int wait_ms, int io_timeout_ms,
                    uint8_t *buf, size_t cap, size_t *have, uint64_t *durations_ns,
                    size_t max_served, size_t *served, int *err);

#endif
