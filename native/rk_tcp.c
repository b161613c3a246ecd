/* rdmakv native TCP core: see rk_tcp.h. */
#define _GNU_SOURCE
#include "rk_tcp.h"

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdint.h>
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

static int64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* Receive spinning (see rk_tcp.h): the budget, the receives in flight, and
 * how the waits ended. Shared by every thread; relaxed atomics, since each
 * is a counter or a setting read on its own. */
static struct recv_spin {
    int64_t budget_us;
    int64_t receiving;
    uint64_t spun, slept;
} spin = {RK_TCP_RECV_SPIN_US, 0, 0, 0};

int rk_tcp_set_recv_spin_us(int64_t us) {
    if (us < 0 || us > RK_TCP_RECV_SPIN_MAX_US) return -1;
    __atomic_store_n(&spin.budget_us, us, __ATOMIC_RELAXED);
    return 0;
}

int64_t rk_tcp_recv_spin_us(void) { return __atomic_load_n(&spin.budget_us, __ATOMIC_RELAXED); }

void rk_tcp_recv_wait_counts(uint64_t *spun, uint64_t *slept) {
    *spun = __atomic_load_n(&spin.spun, __ATOMIC_RELAXED);
    *slept = __atomic_load_n(&spin.slept, __ATOMIC_RELAXED);
}

int64_t rk_tcp_receives_in_flight(void) {
    return __atomic_load_n(&spin.receiving, __ATOMIC_RELAXED);
}

/* Whether a receive may spin now: fewer receives in flight (this one among
 * them) than CPUs the calling thread may run on. */
static int may_spin(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) != 0) return 0;
    return __atomic_load_n(&spin.receiving, __ATOMIC_RELAXED) < CPU_COUNT(&set);
}

/* A receive's wait for more bytes: spin first when allowed (rk_tcp.h), then
 * sleep as wait_fd does. */
static int recv_wait(int fd, int timeout_ms, int64_t deadline, int *err) {
    int64_t budget = rk_tcp_recv_spin_us();
    if (budget > 0 && may_spin()) {
        int64_t stop = now_us() + budget;
        if (timeout_ms >= 0 && stop > deadline * 1000) stop = deadline * 1000;
        do {
            struct pollfd p = {.fd = fd, .events = POLLIN, .revents = 0};
            int r = poll(&p, 1, 0);
            if (r > 0) {
                __atomic_fetch_add(&spin.spun, 1, __ATOMIC_RELAXED);
                return RK_TCP_OK;
            }
            if (r < 0) break; /* the sleeping wait reports it */
        } while (now_us() < stop);
    }
    __atomic_fetch_add(&spin.slept, 1, __ATOMIC_RELAXED);
    return wait_fd(fd, POLLIN, timeout_ms, deadline, err);
}

/* The hashed-send plan (see rk_tcp.h) as window * 2 + ahead: one word, so
 * that a send reads a consistent pair without a lock. Until one is set:
 * RK_TCP_WINDOW, hashed after its sendmsg. */
static uint64_t send_plan = (uint64_t)RK_TCP_WINDOW * 2;

void rk_tcp_hashed_send_plan(uint64_t *window, int *ahead) {
    uint64_t p = __atomic_load_n(&send_plan, __ATOMIC_RELAXED);
    *window = p / 2;
    *ahead = (int)(p & 1);
}

int rk_tcp_set_hashed_send_plan(uint64_t bytes, int ahead) {
    if (bytes == 0 || bytes > RK_TCP_WINDOW || (ahead != 0 && ahead != 1)) return -1;
    __atomic_store_n(&send_plan, bytes * 2 + (uint64_t)ahead, __ATOMIC_RELAXED);
    return 0;
}

/* Fill win[] with up to RK_TCP_IOV_MAX ranges of [i, n) starting at range i,
 * offset off, and at most `cap` bytes (a range longer than that is cut at
 * `cap`). *bytes: the window's size. */
static int fill_window(struct iovec *win, const uint64_t *iov, size_t n, size_t i, uint64_t off,
                       uint64_t cap, uint64_t *bytes) {
    int k = 0;
    uint64_t total = 0;
    for (; i < n && k < RK_TCP_IOV_MAX && total < cap; i++) {
        uint64_t len = iov[2 * i + 1] - off;
        if (len) {
            if (len > cap - total) {
                if (k) break;
                len = cap;
            }
            win[k].iov_base = (void *)(uintptr_t)(iov[2 * i] + off);
            win[k].iov_len = (size_t)len;
            total += len;
            k++;
        }
        off = 0;
    }
    *bytes = total;
    return k;
}

/* Hashing state of one call. Ranges [0, *count) are hashed; range *count
 * starts at list offset `pos` and is hashed up to offset `at` (streamed
 * through `state` when pos < at). `n`: the list's ranges (out[0, n)). */
struct hashing {
    const rk_hasher *fn;
    uint64_t *out;
    uint64_t *count;
    uint64_t pos, at;
    void *state;
    size_t n;
};

#define NO_STOP SIZE_MAX

/* Whether range j's bytes lie (in part) in the hashes being computed. */
static int reads_hashes(const struct hashing *h, const uint64_t *iov, size_t j) {
    uint64_t a = iov[2 * j], len = iov[2 * j + 1];
    uint64_t lo = (uint64_t)(uintptr_t)h->out, hi = lo + sizeof *h->out * h->n;
    return len && a < hi && a + len > lo;
}

/* Whether ranges [i, stop] (from offset `off` of range i on) fit one window
 * of `cap` bytes and RK_TCP_IOV_MAX ranges whole; *before: their bytes ahead
 * of range `stop`. */
static int window_reaches(const uint64_t *iov, size_t i, uint64_t off, size_t stop, uint64_t cap,
                          uint64_t *before) {
    if (stop - i >= RK_TCP_IOV_MAX) return 0;
    uint64_t total = 0;
    for (size_t j = i; j < stop; j++, off = 0) {
        total += iov[2 * j + 1] - off;
        if (total > cap) return 0;
    }
    *before = total;
    return total + iov[2 * stop + 1] <= cap;
}

/* The first range at or after i that is hashes[] entries (see
 * rk_tcp_sendv_hashed), or n. */
static size_t next_hashes_range(const struct hashing *h, const uint64_t *iov, size_t n,
                                size_t i) {
    while (i < n && !reads_hashes(h, iov, i)) i++;
    return i;
}

/* Hash the list up to offset `target`: whole ranges in one shot, a range that
 * ends past `target` streamed up to it. 0, or -1 when no stream state could
 * be allocated. */
static int hash_to(struct hashing *h, const uint64_t *iov, size_t n, uint64_t target) {
    while (*h->count < n) {
        uint64_t j = *h->count, len = iov[2 * j + 1], end = h->pos + len;
        const char *base = (const char *)(uintptr_t)iov[2 * j];
        if (h->at == h->pos && end <= target) {
            h->out[j] = h->fn->oneshot(base, (size_t)len);
        } else {
            if (h->at >= target) return 0;
            if (!h->state && !(h->state = h->fn->create_state())) return -1;
            if (h->at == h->pos) h->fn->reset(h->state);
            uint64_t stop = end < target ? end : target;
            h->fn->update(h->state, base + (h->at - h->pos), (size_t)(stop - h->at));
            h->at = stop;
            if (stop < end) return 0;
            h->out[j] = h->fn->digest(h->state);
        }
        h->pos = h->at = end;
        *h->count = j + 1;
    }
    return 0;
}

void rk_tcp_hash_ranges(const rk_hasher *hasher, const uint64_t *iov, size_t n,
                        uint64_t *hashes) {
    for (size_t i = 0; i < n; i++)
        hashes[i] = hasher->oneshot((const void *)(uintptr_t)iov[2 * i], (size_t)iov[2 * i + 1]);
}

static int run_loop(int fd, int sending, const uint64_t *iov, size_t n, uint64_t skip,
                    int timeout_ms, struct hashing *h, uint64_t *done, int *err) {
    struct iovec win[RK_TCP_IOV_MAX];
    size_t i = 0;
    uint64_t off = skip, moved = skip, bytes;
    uint64_t cap = RK_TCP_WINDOW;
    int ahead = 0; /* each window is hashed before its sendmsg */
    if (h && sending) { /* the plan as this call starts (rk_tcp.h) */
        uint64_t plan = __atomic_load_n(&send_plan, __ATOMIC_RELAXED);
        cap = plan / 2;
        ahead = (int)(plan & 1);
    }
    *err = 0;
    *done = skip;
    int64_t deadline = timeout_ms >= 0 ? now_ms() + timeout_ms : 0;
    size_t stop = NO_STOP; /* sending: the next range of hashes[] entries after i */
    if (h) {
        for (uint64_t j = 0; j < *h->count; j++) h->pos += iov[2 * j + 1];
        h->at = h->pos;
        /* receiving: the bytes the caller placed before the call; sending:
         * those that went out before a call resumed after RK_TCP_EINTR */
        if (hash_to(h, iov, n, moved)) goto nomem;
    }
    for (;;) {
        while (i < n && off >= iov[2 * i + 1]) { /* skip moved / empty ranges (and `skip`) */
            off -= iov[2 * i + 1];
            i++;
        }
        if (i >= n) {
            if (h && hash_to(h, iov, n, UINT64_MAX)) goto nomem; /* trailing empty ranges */
            return RK_TCP_OK;
        }
        size_t end = n;
        if (h && sending) {
            /* A window hashed right after it goes out (below) holds a range
             * of hashes[] entries only at its start: every range before it
             * has gone out and been hashed by then. A window ends before
             * the next such range after its first, unless that range and
             * everything before it fit this window: then the ranges before
             * it are hashed first (the copy then finds them in the cache
             * instead of the hash) and it goes out in the same call, so a
             * small put's frames leave in one segment. A window hashed
             * before it goes out keeps to the same cuts. */
            if (stop == NO_STOP || stop <= i) stop = next_hashes_range(h, iov, n, i + 1);
            uint64_t before = 0; /* bytes of this window ahead of range `stop` */
            if (stop < n && window_reaches(iov, i, off, stop, cap, &before)) {
                if (hash_to(h, iov, n, moved + before)) goto nomem;
                stop = next_hashes_range(h, iov, n, stop + 1);
            }
            end = stop;
        }
        int k = fill_window(win, iov, end, i, off, cap, &bytes);
        /* the hash reads the window from memory, and the copy then finds
         * it in the CPU cache (rk_tcp.h: on some CPUs that is cheaper) */
        if (ahead && hash_to(h, iov, n, moved + bytes)) goto nomem;
        ssize_t r;
        if (sending) {
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
            /* hashed right after the copy into or out of the socket, while
             * the bytes are still in the CPU cache (sends hashed ahead: done) */
            if (h && hash_to(h, iov, n, moved)) goto nomem;
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
        int w = sending ? wait_fd(fd, POLLOUT, timeout_ms, deadline, err)
                        : recv_wait(fd, timeout_ms, deadline, err);
        if (w != RK_TCP_OK) return w;
    }
nomem:
    *err = ENOMEM;
    return RK_TCP_ERRNO;
}

/* run_loop; a receive is counted among those in flight while it runs
 * (may_spin). */
static int run(int fd, int sending, const uint64_t *iov, size_t n, uint64_t skip,
               int timeout_ms, struct hashing *h, uint64_t *done, int *err) {
    if (sending) return run_loop(fd, 1, iov, n, skip, timeout_ms, h, done, err);
    __atomic_fetch_add(&spin.receiving, 1, __ATOMIC_RELAXED);
    int rc = run_loop(fd, 0, iov, n, skip, timeout_ms, h, done, err);
    __atomic_fetch_sub(&spin.receiving, 1, __ATOMIC_RELAXED);
    return rc;
}

int rk_tcp_sendv(int fd, const uint64_t *iov, size_t n, uint64_t skip, int timeout_ms,
                 uint64_t *done, int *err) {
    return run(fd, 1, iov, n, skip, timeout_ms, NULL, done, err);
}

int rk_tcp_recvv(int fd, const uint64_t *iov, size_t n, uint64_t skip, int timeout_ms,
                 uint64_t *done, int *err) {
    return run(fd, 0, iov, n, skip, timeout_ms, NULL, done, err);
}

static int run_hashed(int fd, int sending, const uint64_t *iov, size_t n, uint64_t skip,
                      int timeout_ms, const rk_hasher *hasher, uint64_t *hashes,
                      uint64_t *hashed, uint64_t *done, int *err) {
    struct hashing h = {hasher, hashes, hashed, 0, 0, NULL, n};
    int rc = run(fd, sending, iov, n, skip, timeout_ms, &h, done, err);
    if (h.state) hasher->free_state(h.state);
    return rc;
}

int rk_tcp_sendv_hashed(int fd, const uint64_t *iov, size_t n, uint64_t skip, int timeout_ms,
                        const rk_hasher *hasher, uint64_t *hashes, uint64_t *hashed,
                        uint64_t *done, int *err) {
    return run_hashed(fd, 1, iov, n, skip, timeout_ms, hasher, hashes, hashed, done, err);
}

int rk_tcp_recvv_hashed(int fd, const uint64_t *iov, size_t n, uint64_t skip, int timeout_ms,
                        const rk_hasher *hasher, uint64_t *hashes, uint64_t *hashed,
                        uint64_t *done, int *err) {
    return run_hashed(fd, 0, iov, n, skip, timeout_ms, hasher, hashes, hashed, done, err);
}

void rk_tcp_copy_in(const uint64_t *iov, size_t n, const void *src, uint64_t len) {
    const char *from = src;
    for (size_t i = 0; i < n && len; i++) {
        uint64_t take = iov[2 * i + 1] < len ? iov[2 * i + 1] : len;
        memcpy((void *)(uintptr_t)iov[2 * i], from, (size_t)take);
        from += take;
        len -= take;
    }
}

/* Wire integers are little-endian whatever the host, and the entries sit at
 * any alignment in the frame: assembled byte by byte (one load on x86). */
static uint64_t le_bytes(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

int64_t rk_tcp_get_answer_layout(const uint8_t *entries, size_t m, const uint64_t *slots,
                                 uint64_t base, uint64_t block, uint64_t *iov, uint32_t *hit,
                                 uint64_t *total, size_t *bad) {
    size_t k = 0;
    uint64_t sum = 0;
    for (size_t j = 0; j < m; j++) {
        uint64_t len = le_bytes(entries + 4 * j, 4);
        if (!len) continue;
        if (len > block) {
            *bad = j;
            return -1;
        }
        iov[2 * k] = base + slots[j] * block;
        iov[2 * k + 1] = len;
        hit[k++] = (uint32_t)j;
        sum += len;
    }
    *total = sum;
    return (int64_t)k;
}

size_t rk_tcp_get_answer_check(const uint8_t *entries, size_t m, const uint32_t *hit,
                               size_t hits, const uint64_t *got, int64_t *sizes) {
    const uint8_t *sums = entries + 4 * m;
    size_t matched = 0;
    for (size_t j = 0; j < m; j++) sizes[j] = RK_TCP_MISSED;
    for (size_t i = 0; i < hits; i++) {
        size_t j = hit[i];
        if (got[i] == le_bytes(sums + 8 * j, 8)) {
            sizes[j] = (int64_t)le_bytes(entries + 4 * j, 4);
            matched++;
        } else {
            sizes[j] = RK_TCP_CORRUPT;
        }
    }
    return matched;
}
