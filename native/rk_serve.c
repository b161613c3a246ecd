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
#define COUNT_BYTES 4 /* the u32 key count that starts EXISTS's payload and its answer */

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

/* The key length of an EXISTS payload this loop answers, 0 for any other:
 * n >= 1 keys (at most max_keys) all of one length in 1..RK_INDEX_MAX_KEY,
 * filling the payload exactly (the Python decoder's fast path, whose slow
 * path names what is wrong with the rest). */
static uint32_t uniform_key_len(const uint8_t *p, size_t len, size_t max_keys) {
    if (len < COUNT_BYTES + RK_INDEX_RECORD_HEAD)
        return 0;
    const uint32_t n = rd32(p);
    const uint32_t klen = rd16(p + COUNT_BYTES);
    if (n == 0 || n > max_keys || klen == 0 || klen > RK_INDEX_MAX_KEY)
        return 0;
    const size_t stride = RK_INDEX_RECORD_HEAD + klen;
    if (len != COUNT_BYTES + (size_t)n * stride)
        return 0;
    for (size_t i = 1; i < n; i++)
        if (rd16(p + COUNT_BYTES + i * stride) != klen)
            return 0;
    return klen;
}

/* Send all of data; RK_SERVE_* code. */
static int send_all(int fd, const uint8_t *data, size_t len, int io_timeout_ms, int *err) {
    while (len > 0) {
        ssize_t k = send(fd, data, len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k > 0) {
            data += k;
            len -= (size_t)k;
            continue;
        }
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
            *err = errno;
            return RK_SERVE_ERRNO;
        }
        struct pollfd p = {.fd = fd, .events = POLLOUT};
        int r = poll(&p, 1, io_timeout_ms);
        if (r == 0)
            return RK_SERVE_TIMEOUT;
        if (r < 0 && errno != EINTR) {
            *err = errno;
            return RK_SERVE_ERRNO;
        }
    }
    return RK_SERVE_IDLE;
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
    const uint64_t no_bulk = 0;
    const uint64_t req_id = rd64(frame + H_REQ_ID);
    memset(out, 0, RK_SERVE_HEADER);
    out[H_OPCODE] = (uint8_t)(ctx->opcode | ctx->response_bit);
    memcpy(out + H_PAYLOAD_LEN, &payload_len, sizeof payload_len);
    memcpy(out + H_BULK_LEN, &no_bulk, sizeof no_bulk);
    memcpy(out + H_REQ_ID, &req_id, sizeof req_id);
    memcpy(out + RK_SERVE_HEADER, &n, sizeof n);
    uint8_t *flags = out + RK_SERVE_HEADER + COUNT_BYTES;
    for (uint32_t i = 0; i < n; i++)
        flags[i] = ctx->blocks[i] != RK_INDEX_NONE;
    return send_all(fd, out, RK_SERVE_HEADER + payload_len, io_timeout_ms, err);
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

int rk_serve_exists(const rk_serve_ctx *ctx, int fd, int wait_ms, int io_timeout_ms,
                    uint8_t *buf, size_t cap, size_t *have, uint64_t *durations_ns,
                    size_t max_served, size_t *served, int *err) {
    /* The caller's turn: a hard bound, so a frame that trickles in byte by
     * byte is handed over (the caller's own timeouts govern it then) and the
     * caller sees the node stopping within wait_ms. */
    const uint64_t deadline = now_ns() + (uint64_t)(wait_ms > 0 ? wait_ms : 0) * 1000000ull;
    const size_t max_keys = ctx->max_keys < ctx->max_keys_per_request ? ctx->max_keys
                                                                      : ctx->max_keys_per_request;
    *served = 0;
    *err = 0;
    for (;;) {
        if (*have >= RK_SERVE_HEADER) {
            const uint64_t payload_len = rd32(buf + H_PAYLOAD_LEN);
            if (buf[H_OPCODE] != ctx->opcode || rd64(buf + H_BULK_LEN) != 0 ||
                RK_SERVE_HEADER + payload_len > cap)
                return RK_SERVE_OTHER;
            const size_t frame = RK_SERVE_HEADER + (size_t)payload_len;
            if (*have >= frame) {
                const uint32_t klen = uniform_key_len(buf + RK_SERVE_HEADER, payload_len, max_keys);
                if (klen == 0)
                    return RK_SERVE_OTHER;
                const uint64_t received = now_ns();
                int rc = answer(ctx, fd, buf, klen, io_timeout_ms, err);
                if (rc != RK_SERVE_IDLE)
                    return rc; /* the answer is part sent: nothing more can go on this stream */
                const uint64_t sent = now_ns();
                if (durations_ns != NULL)
                    durations_ns[*served] = sent - received;
                ++*served;
                *have -= frame;
                memmove(buf, buf + frame, *have);
                if (*served == max_served || sent >= deadline)
                    return RK_SERVE_IDLE;
                continue;
            }
        }
        int rc = read_some(fd, deadline, buf, cap, have, err);
        if (rc != RK_SERVE_OTHER)
            return rc;
    }
}
