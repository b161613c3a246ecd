/* rdmakv native TCP core: see rk_tcp.h. */
#define _GNU_SOURCE
#include "rk_tcp.h"

#include <errno.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Wait until fd is ready for `events` or the deadline passes.
 * RK_TCP_OK (ready, or an error/hangup the next call will report),
 * RK_TCP_TIMEOUT, RK_TCP_EINTR, RK_TCP_ERRNO. */
static int wait_fd(int fd, short events, int timeout_ms, int64_t deadline, int *err) {
    struct pollfd p;
    p.fd = fd;
    p.events = events;
    p.revents = 0;
    int wait = -1;
    if (timeout_ms >= 0) {
        int64_t left = deadline - now_ms();
        if (left <= 0) return RK_TCP_TIMEOUT;
        wait = left > 0x7fffffff ? 0x7fffffff : (int)left;
    }
    int r = poll(&p, 1, wait);
    if (r > 0) return RK_TCP_OK;
    if (r == 0) return RK_TCP_TIMEOUT;
    if (errno == EINTR) return RK_TCP_EINTR;
    *err = errno;
    return RK_TCP_ERRNO;
}

/* Fill win[] with up to RK_TCP_IOV_MAX ranges starting at range i, offset off,
 * and at most `cap` bytes unless the first range alone is longer. *end: the
 * index past the last range the window reaches. */
static int fill_window(struct iovec *win, const uint64_t *iov, size_t n, size_t i, uint64_t off,
                       uint64_t cap, size_t *end) {
    int k = 0;
    uint64_t bytes = 0;
    for (; i < n && k < RK_TCP_IOV_MAX; i++) {
        uint64_t len = iov[2 * i + 1] - off;
        if (len) {
            if (k && len > cap - bytes) break;
            win[k].iov_base = (void *)(uintptr_t)(iov[2 * i] + off);
            win[k].iov_len = (size_t)len;
            bytes += len;
            k++;
        }
        off = 0;
    }
    *end = i;
    return k;
}

/* Per-range hashing (NULL: none). count: ranges hashed so far, in order;
 * pos: the list offset where range *count starts. */
struct hashing {
    rk_hash_fn fn;
    uint64_t *out;
    uint64_t *count;
    uint64_t pos;
};

/* Hash ranges [*count, upto) (sending: before their bytes go out). */
static void hash_upto(struct hashing *h, const uint64_t *iov, size_t upto) {
    for (uint64_t j = *h->count; j < upto; j++) {
        h->out[j] = h->fn((const void *)(uintptr_t)iov[2 * j], (size_t)iov[2 * j + 1]);
        h->pos += iov[2 * j + 1];
        *h->count = j + 1;
    }
}

/* Hash every range that lies within the first `moved` bytes of the list
 * (receiving: as soon as its last byte arrived). */
static void hash_received(struct hashing *h, const uint64_t *iov, size_t n, uint64_t moved) {
    size_t upto = *h->count;
    uint64_t end = h->pos;
    while (upto < n && end + iov[2 * upto + 1] <= moved) end += iov[2 * upto++ + 1];
    hash_upto(h, iov, upto);
}

static int run(int fd, int sending, const uint64_t *iov, size_t n, uint64_t skip,
               int timeout_ms, struct hashing *h, uint64_t *done, int *err) {
    struct iovec win[RK_TCP_IOV_MAX];
    size_t i = 0, end;
    uint64_t off = skip, moved = skip;
    uint64_t cap = h ? RK_TCP_HASH_WINDOW : UINT64_MAX;
    *err = 0;
    *done = skip;
    int64_t deadline = timeout_ms >= 0 ? now_ms() + timeout_ms : 0;
    if (h) {
        for (uint64_t j = 0; j < *h->count; j++) h->pos += iov[2 * j + 1];
        if (!sending) hash_received(h, iov, n, moved); /* bytes the caller placed */
    }
    for (;;) {
        while (i < n && off >= iov[2 * i + 1]) { /* skip moved / empty ranges (and `skip`) */
            off -= iov[2 * i + 1];
            i++;
        }
        if (i >= n) {
            if (h) hash_upto(h, iov, n); /* trailing empty ranges */
            return RK_TCP_OK;
        }
        int k = fill_window(win, iov, n, i, off, cap, &end);
        ssize_t r;
        if (sending) {
            if (h) hash_upto(h, iov, end);
            struct msghdr msg;
            memset(&msg, 0, sizeof msg);
            msg.msg_iov = win;
            msg.msg_iovlen = (size_t)k;
            r = sendmsg(fd, &msg, MSG_NOSIGNAL);
        } else {
            r = readv(fd, win, k);
        }
        if (r > 0) {
            moved += (uint64_t)r;
            *done = moved;
            off += (uint64_t)r;
            if (h && !sending) hash_received(h, iov, n, moved);
            if (timeout_ms >= 0) deadline = now_ms() + timeout_ms;
            continue;
        }
        if (r == 0) /* recv only: sendmsg of a non-empty window never returns 0 */
            return RK_TCP_CLOSED;
        if (errno == EINTR) return RK_TCP_EINTR;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            *err = errno;
            return RK_TCP_ERRNO;
        }
        int w = wait_fd(fd, sending ? POLLOUT : POLLIN, timeout_ms, deadline, err);
        if (w != RK_TCP_OK) return w;
    }
}

int rk_tcp_sendv(int fd, const uint64_t *iov, size_t n, uint64_t skip, int timeout_ms,
                 uint64_t *done, int *err) {
    return run(fd, 1, iov, n, skip, timeout_ms, NULL, done, err);
}

int rk_tcp_recvv(int fd, const uint64_t *iov, size_t n, uint64_t skip, int timeout_ms,
                 uint64_t *done, int *err) {
    return run(fd, 0, iov, n, skip, timeout_ms, NULL, done, err);
}

int rk_tcp_sendv_hashed(int fd, const uint64_t *iov, size_t n, uint64_t skip, int timeout_ms,
                        rk_hash_fn hash, uint64_t *hashes, uint64_t *hashed,
                        uint64_t *done, int *err) {
    struct hashing h = {hash, hashes, hashed, 0};
    return run(fd, 1, iov, n, skip, timeout_ms, &h, done, err);
}

int rk_tcp_recvv_hashed(int fd, const uint64_t *iov, size_t n, uint64_t skip, int timeout_ms,
                        rk_hash_fn hash, uint64_t *hashes, uint64_t *hashed,
                        uint64_t *done, int *err) {
    struct hashing h = {hash, hashes, hashed, 0};
    return run(fd, 0, iov, n, skip, timeout_ms, &h, done, err);
}
