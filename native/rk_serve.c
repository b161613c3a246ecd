/* rdmakv native request loop: see rk_serve.h. */
#include "rk_serve.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the frame header is read in the host's byte order, which must be little-endian"
#endif

/* Offsets in the header (<BBHIQQ: opcode, flags, status, payload_len, bulk_len, req_id). */
#define H_OPCODE 0
#define H_FLAGS 1
#define H_STATUS 2
#define H_PAYLOAD_LEN 4
#define H_BULK_LEN 8
#define H_REQ_ID 16
#define COUNT_BYTES 4 /* the u32 key count that starts a request's payload and its answer */

struct rk_store_lock {
    pthread_mutex_t mutex;
};

rk_store_lock *rk_store_lock_new(void) {
    rk_store_lock *lock = malloc(sizeof *lock);
    if (lock != NULL && pthread_mutex_init(&lock->mutex, NULL) != 0) {
        free(lock);
        return NULL;
    }
    return lock;
}

void rk_store_lock_free(rk_store_lock *lock) {
    if (lock != NULL) {
        pthread_mutex_destroy(&lock->mutex);
        free(lock);
    }
}

void rk_store_lock_acquire(rk_store_lock *lock) { pthread_mutex_lock(&lock->mutex); }

void rk_store_lock_release(rk_store_lock *lock) { pthread_mutex_unlock(&lock->mutex); }

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, sizeof v); return v; }
static uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, sizeof v); return v; }
static uint64_t rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, sizeof v); return v; }

/* The key length of an EXISTS (trailer 0) or GET (trailer RK_SERVE_DIGEST)
 * payload this loop answers, 0 for any other: n >= 1 items (at most
 * max_keys), every key of one length in 1..RK_INDEX_MAX_KEY, filling the
 * payload exactly (the Python decoder's fast path, whose slow path names
 * what is wrong with the rest). */
static uint32_t uniform_key_len(const uint8_t *p, size_t len, size_t max_keys, size_t trailer) {
    if (len < COUNT_BYTES + RK_INDEX_RECORD_HEAD)
        return 0;
    const uint32_t n = rd32(p);
    const uint32_t klen = rd16(p + COUNT_BYTES);
    if (n == 0 || n > max_keys || klen == 0 || klen > RK_INDEX_MAX_KEY)
        return 0;
    const size_t stride = RK_INDEX_RECORD_HEAD + klen + trailer;
    if (len != COUNT_BYTES + (size_t)n * stride)
        return 0;
    for (size_t i = 1; i < n; i++)
        if (rd16(p + COUNT_BYTES + i * stride) != klen)
            return 0;
    return klen;
}

/* An answer's header (status OK, no flags) into out. */
static void put_header(uint8_t *out, uint8_t opcode, uint32_t payload_len, uint64_t bulk_len,
                       uint64_t req_id) {
    memset(out, 0, RK_SERVE_HEADER);
    out[H_OPCODE] = opcode;
    memcpy(out + H_PAYLOAD_LEN, &payload_len, sizeof payload_len);
    memcpy(out + H_BULK_LEN, &bulk_len, sizeof bulk_len);
    memcpy(out + H_REQ_ID, &req_id, sizeof req_id);
}

/* Send iov's n (address, length) rows whole with the tcp loop's send:
 * RK_SERVE_IDLE, or RK_SERVE_TIMEOUT, _CLOSED or _ERRNO (*err set). A signal
 * only interrupts it: Python runs its handlers on another thread. */
static int send_rows(int fd, const uint64_t *iov, size_t n, int io_timeout_ms, int *err) {
    uint64_t done = 0;
    int rc;
    do
        rc = rk_tcp_sendv(fd, iov, n, done, io_timeout_ms, &done, err);
    while (rc == RK_TCP_EINTR);
    switch (rc) {
    case RK_TCP_OK: return RK_SERVE_IDLE;
    case RK_TCP_TIMEOUT: return RK_SERVE_TIMEOUT;
    case RK_TCP_CLOSED: return RK_SERVE_CLOSED;
    default: return RK_SERVE_ERRNO;
    }
}

/* Answer the EXISTS frame at buf (its header and payload all there). */
static int answer(const rk_serve_ctx *ctx, int fd, const uint8_t *frame, uint32_t klen,
                  int io_timeout_ms, int *err) {
    const uint8_t *payload = frame + RK_SERVE_HEADER;
    const uint32_t n = rd32(payload);
    rk_store_lock_acquire(ctx->lock);
    rk_index_touch_key_records(ctx->ix, payload + COUNT_BYTES, n, klen, ctx->blocks);
    rk_store_lock_release(ctx->lock);

    uint8_t *out = ctx->answer;
    const uint32_t payload_len = COUNT_BYTES + n;
    put_header(out, (uint8_t)(ctx->opcode | ctx->response_bit), payload_len, 0,
               rd64(frame + H_REQ_ID));
    memcpy(out + RK_SERVE_HEADER, &n, sizeof n);
    uint8_t *flags = out + RK_SERVE_HEADER + COUNT_BYTES;
    for (uint32_t i = 0; i < n; i++)
        flags[i] = ctx->blocks[i] != RK_INDEX_NONE;
    const uint64_t row[2] = {(uint64_t)(uintptr_t)out, RK_SERVE_HEADER + payload_len};
    return send_rows(fd, row, 1, io_timeout_ms, err);
}

/* Answer the GET frame at buf (its header and payload all there): the hits
 * pinned and the answer laid out under the lock, header, answer and values
 * sent in the same system calls, the pins dropped under the lock. */
static int answer_get(const rk_serve_ctx *ctx, int fd, const uint8_t *frame, uint32_t klen,
                      int io_timeout_ms, rk_serve_tally *tally, int *err) {
    const uint8_t *payload = frame + RK_SERVE_HEADER;
    const uint32_t n = rd32(payload);
    uint8_t *out = ctx->get_answer;
    uint8_t *entries = out + RK_SERVE_HEADER + COUNT_BYTES;
    uint64_t nbytes = 0;
    rk_store_lock_acquire(ctx->lock);
    const size_t hits = rk_index_get_records(
        ctx->ix, payload + COUNT_BYTES, n, klen, ctx->lengths, ctx->sums, ctx->refs, ctx->base,
        ctx->block_size, entries, entries + (size_t)4 * n, ctx->iov + 2, ctx->hit_blocks, &nbytes);
    ctx->counts->lookups += n;
    ctx->counts->hits += hits;
    ctx->counts->bytes += nbytes;
    rk_store_lock_release(ctx->lock);

    const uint32_t payload_len = COUNT_BYTES + n * RK_SERVE_GET_ENTRY;
    put_header(out, (uint8_t)(ctx->get_opcode | ctx->response_bit), payload_len, nbytes,
               rd64(frame + H_REQ_ID));
    memcpy(out + RK_SERVE_HEADER, &n, sizeof n);
    ctx->iov[0] = (uint64_t)(uintptr_t)out;
    ctx->iov[1] = RK_SERVE_HEADER + payload_len;
    __atomic_store_n(ctx->sending, 1, __ATOMIC_RELAXED);
    const int rc = send_rows(fd, ctx->iov, hits + 1, io_timeout_ms, err);
    __atomic_store_n(ctx->sending, 0, __ATOMIC_RELAXED);

    rk_store_lock_acquire(ctx->lock);
    tally->last = rk_index_unpin(ctx->refs, ctx->hit_blocks, hits, ctx->last);
    if (rc == RK_SERVE_IDLE)
        ctx->counts->gets++;
    rk_store_lock_release(ctx->lock);
    if (rc == RK_SERVE_IDLE)
        tally->sent++;
    return rc;
}

/* Wait until the deadline for input and read what there is into buf[*have, cap). */
static int read_some(int fd, uint64_t deadline, uint8_t *buf, size_t cap, size_t *have,
                     int *err) {
    for (;;) {
        ssize_t k = recv(fd, buf + *have, cap - *have, MSG_DONTWAIT);
        if (k > 0) {
            *have += (size_t)k;
            return RK_SERVE_OTHER; /* "read something": the caller looks at it */
        }
        if (k == 0)
            return RK_SERVE_CLOSED;
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            *err = errno;
            return RK_SERVE_ERRNO;
        }
        const uint64_t now = now_ns();
        if (now >= deadline)
            return RK_SERVE_IDLE;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        /* rounded up: a poll that returns early would only spin */
        int r = poll(&p, 1, (int)((deadline - now + 999999) / 1000000));
        if (r == 0)
            return RK_SERVE_IDLE;
        if (r < 0 && errno != EINTR) {
            *err = errno;
            return RK_SERVE_ERRNO;
        }
    }
}

int rk_serve_requests(const rk_serve_ctx *ctx, int fd, int wait_ms, int io_timeout_ms,
                      uint8_t *buf, size_t cap, size_t *have, uint64_t *durations_ns,
                      uint8_t *ops, size_t max_served, size_t *served, rk_serve_tally *tally,
                      int *err) {
    /* The caller's turn: a hard bound, so a frame that trickles in byte by
     * byte is handed over (the caller's own timeouts govern it then) and the
     * caller sees the node stopping within wait_ms. */
    const uint64_t deadline = now_ns() + (uint64_t)(wait_ms > 0 ? wait_ms : 0) * 1000000ull;
    const size_t per_request = ctx->max_keys_per_request;
    const size_t max_keys = ctx->max_keys < per_request ? ctx->max_keys : per_request;
    const size_t max_get_keys = ctx->max_get_keys < per_request ? ctx->max_get_keys : per_request;
    memset(tally, 0, sizeof *tally);
    *served = 0;
    *err = 0;
    for (;;) {
        if (*have >= RK_SERVE_HEADER) {
            const uint64_t payload_len = rd32(buf + H_PAYLOAD_LEN);
            const uint8_t op = buf[H_OPCODE];
            const int get = ctx->get_opcode != 0 && op == ctx->get_opcode;
            if ((op != ctx->opcode && !get) || rd64(buf + H_BULK_LEN) != 0 ||
                RK_SERVE_HEADER + payload_len > cap)
                return RK_SERVE_OTHER;
            const size_t frame = RK_SERVE_HEADER + (size_t)payload_len;
            if (*have >= frame) {
                const uint32_t klen =
                    get ? uniform_key_len(buf + RK_SERVE_HEADER, payload_len, max_get_keys,
                                          RK_SERVE_DIGEST)
                        : uniform_key_len(buf + RK_SERVE_HEADER, payload_len, max_keys, 0);
                if (klen == 0)
                    return RK_SERVE_OTHER;
                const uint64_t received = now_ns();
                int rc = get ? answer_get(ctx, fd, buf, klen, io_timeout_ms, tally, err)
                             : answer(ctx, fd, buf, klen, io_timeout_ms, err);
                if (rc != RK_SERVE_IDLE)
                    return rc; /* the answer is part sent: nothing more can go on this stream */
                const uint64_t sent = now_ns();
                if (durations_ns != NULL)
                    durations_ns[*served] = sent - received;
                if (ops != NULL)
                    ops[*served] = op;
                ++*served;
                *have -= frame;
                memmove(buf, buf + frame, *have);
                if (*served == max_served || sent >= deadline || tally->last > 0)
                    return RK_SERVE_IDLE;
                continue;
            }
        }
        int rc = read_some(fd, deadline, buf, cap, have, err);
        if (rc != RK_SERVE_OTHER)
            return rc;
    }
}
