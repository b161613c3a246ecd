/* rdmakv native TCP core: see rk_tcp.h. */
#define _GNU_SOURCE
#include "rk_tcp.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
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

/* The hashed-send window (see rk_tcp.h). `chosen` is read without the lock:
 * the window in use, 0 before the first choice. Everything else is shared by
 * every thread that sends hashed, under probe_lock. */
static const uint64_t probe_sizes[2] = {RK_TCP_HASHED_WINDOW_SMALL, RK_TCP_HASHED_WINDOW_LARGE};
static uint64_t chosen;
static pthread_mutex_t probe_lock = PTHREAD_MUTEX_INITIALIZER;
static int fixed;       /* set by rk_tcp_set_hashed_send_window: never measure */
static int probing = 1; /* windows alternate sizes and are timed */
static int warm_up = RK_TCP_WINDOW_WARM_UP; /* windows left before the samples */
static uint64_t since;  /* windows since the last choice */
static uint64_t choices;
static double probe_cost[2][RK_TCP_WINDOW_PROBES]; /* ns of thread CPU per byte moved */
static int probe_count[2];
static unsigned probe_turn;

static uint64_t chosen_window(void) { return __atomic_load_n(&chosen, __ATOMIC_ACQUIRE); }

static int64_t thread_ns(void) {
    struct timespec ts = {0, 0}; /* no such clock: every sample 0, a tie: the small window */
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* The probe size the next window should measure (the one with fewer
 * samples; turns when even), or -1: use the chosen window. Every
 * RK_TCP_WINDOW_REPROBE windows after a choice the sizes are measured again. */
static int probe_next(void) {
    pthread_mutex_lock(&probe_lock);
    int which = -1;
    if (!fixed) {
        if (!probing && ++since >= RK_TCP_WINDOW_REPROBE) {
            probing = 1;
            probe_count[0] = probe_count[1] = 0;
        }
        if (probing)
            which = probe_count[0] == probe_count[1] ? (int)(probe_turn++ & 1)
                                                     : probe_count[1] < probe_count[0];
    }
    pthread_mutex_unlock(&probe_lock);
    return which;
}

/* One window of probe size `which` (at least half full): `ns` of thread CPU
 * moved `bytes`.
 * The last sample needed settles the choice (ties keep the small window). */
static void probe_record(int which, int64_t ns, uint64_t bytes) {
    pthread_mutex_lock(&probe_lock);
    if (!probing || fixed) {
        /* settled or set meanwhile by another thread */
    } else if (warm_up > 0) {
        warm_up--;
    } else if (probe_count[which] < RK_TCP_WINDOW_PROBES) {
        probe_cost[which][probe_count[which]++] = (double)ns / (double)bytes;
        if (probe_count[0] == RK_TCP_WINDOW_PROBES && probe_count[1] == RK_TCP_WINDOW_PROBES) {
            double small = median(probe_cost[0], RK_TCP_WINDOW_PROBES);
            double large = median(probe_cost[1], RK_TCP_WINDOW_PROBES);
            __atomic_store_n(&chosen, probe_sizes[large < small], __ATOMIC_RELEASE);
            probing = 0;
            since = 0;
            choices++;
        }
    }
    pthread_mutex_unlock(&probe_lock);
}

uint64_t rk_tcp_hashed_send_window(void) { return chosen_window(); }

uint64_t rk_tcp_hashed_send_window_choices(void) {
    pthread_mutex_lock(&probe_lock);
    uint64_t n = choices;
    pthread_mutex_unlock(&probe_lock);
    return n;
}

int rk_tcp_set_hashed_send_window(uint64_t bytes) {
    if (bytes > RK_TCP_WINDOW) return -1;
    pthread_mutex_lock(&probe_lock);
    fixed = bytes != 0;
    probing = !fixed;
    probe_count[0] = probe_count[1] = 0;
    warm_up = RK_TCP_WINDOW_WARM_UP;
    since = choices = 0;
    __atomic_store_n(&chosen, bytes, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&probe_lock);
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
struct helped;

struct hashing {
    const rk_hasher *fn;
    uint64_t *out;
    uint64_t *count;
    uint64_t pos, at;
    void *state;
    size_t n;
    struct helped *hp; /* sending: ranges shared with the hash helper, or NULL */
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

/* ---- The hash helper (rk_tcp.h) ------------------------------------------
 *
 * One send's ranges, shared by its sending thread and the helper. A range is
 * claimed once (`next`, by compare-and-swap) and its hash published by
 * setting ready[j] after out[j] is written. Checksum rows (ranges that read
 * out[] itself) are never hashed by a claimer: the sender hashes them in
 * order once every range before them is ready, so a row's hash covers the
 * final entries. Invariant: until the helper has left (leave_helper), it
 * may read iov and write out[] and ready[]; the sender frees nothing before.
 *
 * The helper only takes a CPU that no hashed send of this process is using
 * (by default): with two such sends on a 2-core host (a put split across
 * two connections), the bench VM's 64 KiB puts ran 3-7% slower with it. So it
 * declines a send, or stops claiming in the middle of one, once a send more
 * is in flight; the sender then hashes the rest inline (go_inline). */
struct helped {
    const struct hashing *h;
    const uint64_t *iov;
    size_t n;
    size_t next;          /* atomic: the first range nobody has claimed */
    size_t checked;       /* sender only: ranges [0, checked) are ready */
    unsigned char *ready; /* atomic per range */
    int taken;            /* under helper_lock: the helper works on it */
    int declined;         /* atomic: the helper stopped claiming early */
};

static pthread_mutex_t helper_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t helper_wake = PTHREAD_COND_INITIALIZER; /* a send was posted */
static pthread_cond_t helper_left = PTHREAD_COND_INITIALIZER; /* the helper left one */
static struct helped *helper_job; /* posted or taken; NULL: the helper is idle */
static int helper_started;        /* 1 running, -1 could not start (never again) */
static pthread_t helper_thread;
static int helper_avoids = -1;    /* the CPU left out of the helper's affinity */
static int helper_mode = -1;      /* rk_tcp_set_hash_helper; atomic */
static int hashed_senders;        /* atomic: hashed sends in flight */
static uint64_t helper_sends;
static pthread_once_t helper_fork_once = PTHREAD_ONCE_INIT;

static uint64_t helper_declines;
static cpu_set_t process_cpus; /* under helper_lock: the affinity at the last post */
static int process_cpu_count = 1; /* atomic */

/* Lock held: the process's CPUs, read again at each post (the process may
 * have been moved since). */
static void read_usable_cpus(void) {
    cpu_set_t set;
    int c = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
    if (c > 1) process_cpus = set;
    __atomic_store_n(&process_cpu_count, c < 1 ? 1 : c, __ATOMIC_RELAXED);
}

/* Whether the helper may hash now: forced on, or by default while the
 * hashed sends in flight leave it a CPU. */
static int helper_has_cpu(void) {
    int mode = __atomic_load_n(&helper_mode, __ATOMIC_RELAXED);
    if (mode >= 0) return mode > 0;
    return __atomic_load_n(&hashed_senders, __ATOMIC_RELAXED) <
           __atomic_load_n(&process_cpu_count, __ATOMIC_RELAXED);
}

static void hash_one(const struct hashing *h, const uint64_t *iov, size_t j) {
    h->out[j] = h->fn->oneshot((const void *)(uintptr_t)iov[2 * j], (size_t)iov[2 * j + 1]);
}

/* Claim and hash ranges below `upto` until none is left unclaimed, checksum
 * rows excepted (left to the sender). The helper (`helper`) stops early,
 * setting `declined`, when it no longer has a CPU of its own. */
static void claim_and_hash(struct helped *hp, size_t upto, int helper) {
    size_t j = __atomic_load_n(&hp->next, __ATOMIC_RELAXED);
    int claims = 0;
    for (;;) {
        if (j >= upto) return;
        if (helper && (!helper_has_cpu() || (claims && __atomic_load_n(&helper_mode, __ATOMIC_RELAXED) == RK_TCP_HELPER_DECLINES))) {
            __atomic_store_n(&hp->declined, 1, __ATOMIC_RELEASE);
            return;
        }
        if (!__atomic_compare_exchange_n(&hp->next, &j, j + 1, 1, __ATOMIC_ACQ_REL,
                                         __ATOMIC_RELAXED))
            continue; /* j now holds the current value */
        if (!reads_hashes(hp->h, hp->iov, j)) {
            hash_one(hp->h, hp->iov, j);
            __atomic_store_n(&hp->ready[j], 1, __ATOMIC_RELEASE);
        }
        claims++;
        j++;
    }
}

/* Sender: every range below `upto` hashed (ranges still unclaimed hashed
 * here, those the helper holds waited for, checksum rows hashed in order). */
static void await_hashed(struct helped *hp, size_t upto) {
    claim_and_hash(hp, upto, 0);
    for (size_t j = hp->checked; j < upto; j++) {
        if (reads_hashes(hp->h, hp->iov, j)) { /* every range before it is ready */
            if (!__atomic_load_n(&hp->ready[j], __ATOMIC_ACQUIRE)) {
                hash_one(hp->h, hp->iov, j);
                __atomic_store_n(&hp->ready[j], 1, __ATOMIC_RELEASE);
            }
            continue;
        }
        /* claimed by the helper: one range's hash away, unless it lost its
         * CPU, which yielding gives back when it shares ours */
        while (!__atomic_load_n(&hp->ready[j], __ATOMIC_ACQUIRE)) sched_yield();
    }
    if (upto > hp->checked) hp->checked = upto;
}

static void *helper_main(void *arg) {
    (void)arg;
    pthread_mutex_lock(&helper_lock);
    for (;;) {
        while (!helper_job || helper_job->taken) pthread_cond_wait(&helper_wake, &helper_lock);
        struct helped *hp = helper_job;
        hp->taken = 1;
        helper_sends++;
        pthread_mutex_unlock(&helper_lock);
        claim_and_hash(hp, hp->n, 1);
        pthread_mutex_lock(&helper_lock);
        if (hp->declined) helper_declines++;
        hp->taken = 0;
        helper_job = NULL;
        pthread_cond_broadcast(&helper_left);
    }
    return NULL;
}

/* In a child of fork() the helper thread does not exist, and the lock may
 * have been held by a thread that does not either. */
static void helper_after_fork(void) {
    pthread_mutex_init(&helper_lock, NULL);
    pthread_cond_init(&helper_wake, NULL);
    pthread_cond_init(&helper_left, NULL);
    helper_job = NULL;
    helper_started = 0;
    helper_avoids = -1;
    hashed_senders = 0;
}

static void register_fork_handler(void) { pthread_atfork(NULL, NULL, helper_after_fork); }

/* Lock held. Keep the helper off the sender's CPU: woken by the sender, the
 * scheduler may queue it there, where it only takes turns with the send it
 * should overlap. One system call when the sender moved since the last
 * post, none otherwise. */
static void helper_avoid_cpu(int cpu) {
    if (cpu < 0 || cpu == helper_avoids || process_cpu_count < 2 || !CPU_ISSET(cpu, &process_cpus))
        return;
    cpu_set_t set = process_cpus;
    CPU_CLR(cpu, &set);
    if (pthread_setaffinity_np(helper_thread, sizeof set, &set) == 0) helper_avoids = cpu;
}

/* Lock held. 1 when the helper runs (started now if need be). */
static int helper_running(void) {
    if (helper_started) return helper_started > 0;
    pthread_once(&helper_fork_once, register_fork_handler);
    sigset_t all, old;
    sigfillset(&all); /* signals go to Python's threads, never to the helper */
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_attr_t attr;
    pthread_t t;
    int ok = pthread_attr_init(&attr) == 0;
    if (ok) {
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        ok = pthread_create(&t, &attr, helper_main, NULL) == 0;
        if (ok) helper_thread = t;
        pthread_attr_destroy(&attr);
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    helper_started = ok ? 1 : -1;
    return ok;
}

/* Post `hp` to the helper: 1, or 0 when it is busy, has no CPU or cannot run. */
static int post_to_helper(struct helped *hp) {
    pthread_mutex_lock(&helper_lock);
    read_usable_cpus();
    int posted = !helper_job && helper_has_cpu() && helper_running();
    if (posted) {
        helper_avoid_cpu(sched_getcpu());
        helper_job = hp;
        pthread_cond_signal(&helper_wake);
    }
    pthread_mutex_unlock(&helper_lock);
    return posted;
}

/* Take `hp` back from the helper (nothing left to claim): on return the
 * helper no longer touches it. */
static void leave_helper(struct helped *hp) {
    __atomic_store_n(&hp->next, hp->n, __ATOMIC_RELEASE);
    pthread_mutex_lock(&helper_lock);
    if (helper_job == hp && !hp->taken) helper_job = NULL; /* never picked up */
    while (helper_job == hp) pthread_cond_wait(&helper_left, &helper_lock);
    pthread_mutex_unlock(&helper_lock);
}

/* Sender, when the helper declined: take the send back and hash inline from
 * range i on (every range before it has gone out: hashed here now). */
static void go_inline(struct hashing *h, const uint64_t *iov, size_t i) {
    struct helped *hp = h->hp;
    leave_helper(hp);
    size_t k = 0;
    uint64_t pos = 0;
    for (; k < hp->n; pos += iov[2 * k + 1], k++) {
        if (hp->ready[k]) continue;
        if (k >= i) break;
        hash_one(h, iov, k); /* in order: a checksum row's entries are final */
        hp->ready[k] = 1;
    }
    *h->count = k;
    h->pos = h->at = pos;
    h->hp = NULL;
}

int rk_tcp_set_hash_helper(int mode) {
    if (mode < -1 || mode > RK_TCP_HELPER_DECLINES) return -1;
    __atomic_store_n(&helper_mode, mode, __ATOMIC_RELAXED);
    return 0;
}

uint64_t rk_tcp_hash_helper_sends(void) {
    pthread_mutex_lock(&helper_lock);
    uint64_t n = helper_sends;
    pthread_mutex_unlock(&helper_lock);
    return n;
}

uint64_t rk_tcp_hash_helper_declines(void) {
    pthread_mutex_lock(&helper_lock);
    uint64_t n = helper_declines;
    pthread_mutex_unlock(&helper_lock);
    return n;
}

static int run(int fd, int sending, const uint64_t *iov, size_t n, uint64_t skip,
               int timeout_ms, struct hashing *h, uint64_t *done, int *err) {
    struct iovec win[RK_TCP_IOV_MAX];
    size_t i = 0;
    uint64_t off = skip, moved = skip, bytes;
    uint64_t cap = RK_TCP_WINDOW;
    /* a hashed send takes part in measuring its windows, but not on a blocking
     * socket, where the calls' time would include the waits for room */
    int measures = 0;
    if (h && sending && !h->hp) {
        int fl = fcntl(fd, F_GETFL);
        measures = fl >= 0 && (fl & O_NONBLOCK);
    }
    *err = 0;
    *done = skip;
    int64_t deadline = timeout_ms >= 0 ? now_ms() + timeout_ms : 0;
    size_t stop = NO_STOP; /* sending: the next range of hashes[] entries after i */
    if (h) {
        for (uint64_t j = 0; j < *h->count; j++) h->pos += iov[2 * j + 1];
        h->at = h->pos;
        /* receiving: the bytes the caller placed before the call; sending:
         * those that went out before a call resumed after RK_TCP_EINTR (with
         * the helper: claimed like the rest) */
        if (!h->hp && hash_to(h, iov, n, moved)) goto nomem;
    }
    for (;;) {
        while (i < n && off >= iov[2 * i + 1]) { /* skip moved / empty ranges (and `skip`) */
            off -= iov[2 * i + 1];
            i++;
        }
        if (i >= n) {
            if (h && h->hp)
                await_hashed(h->hp, n);
            else if (h && hash_to(h, iov, n, UINT64_MAX)) /* trailing empty ranges */
                goto nomem;
            return RK_TCP_OK;
        }
        if (h && h->hp && __atomic_load_n(&h->hp->declined, __ATOMIC_ACQUIRE))
            go_inline(h, iov, i);
        size_t end = n;
        int which = measures ? probe_next() : -1; /* the probe size this window measures */
        int64_t t0 = 0;
        if (which >= 0) {
            cap = probe_sizes[which];
            t0 = thread_ns();
        } else if (h && sending && !h->hp) {
            cap = chosen_window();
            if (!cap) cap = RK_TCP_HASHED_WINDOW_SMALL;
        }
        if (h && sending) {
            /* Ranges are hashed right after they go out (below), so a range
             * of hashes[] entries may only start a window: every range before
             * it has gone out and been hashed by then. A window ends before
             * the next such range after its first, unless that range and
             * everything before it fit this window: then the ranges before
             * it are hashed first (the copy then finds them in the cache
             * instead of the hash) and it goes out in the same call, so a
             * small put's frames leave in one segment. */
            /* With the helper, the ranges before a checksum row are hashed
             * (awaited) just before the window that sends it instead. */
            if (stop == NO_STOP || stop <= i) stop = next_hashes_range(h, iov, n, i + 1);
            uint64_t before = 0; /* bytes of this window ahead of range `stop` */
            if (stop < n && window_reaches(iov, i, off, stop, cap, &before)) {
                if (h->hp)
                    await_hashed(h->hp, stop);
                else if (hash_to(h, iov, n, moved + before))
                    goto nomem;
                stop = next_hashes_range(h, iov, n, stop + 1);
            } else if (h->hp && reads_hashes(h, iov, i)) {
                await_hashed(h->hp, i);
            }
            end = stop;
        }
        int k = fill_window(win, iov, end, i, off, cap, &bytes);
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
             * the bytes are still in the CPU cache */
            if (h && !h->hp && hash_to(h, iov, n, moved)) goto nomem;
            /* a short window's fixed costs would skew its sample: windows cut
             * short by the end of the list, a checksum row or the next range
             * not fitting whole (after a partial send a window starts inside
             * a range and rarely fills exactly) count when at least half full */
            if (which >= 0 && 2 * bytes >= cap)
                probe_record(which, thread_ns() - t0, (uint64_t)r);
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
nomem:
    *err = ENOMEM;
    return RK_TCP_ERRNO;
}

int rk_tcp_sendv(int fd, const uint64_t *iov, size_t n, uint64_t skip, int timeout_ms,
                 uint64_t *done, int *err) {
    return run(fd, 1, iov, n, skip, timeout_ms, NULL, done, err);
}

int rk_tcp_recvv(int fd, const uint64_t *iov, size_t n, uint64_t skip, int timeout_ms,
                 uint64_t *done, int *err) {
    return run(fd, 0, iov, n, skip, timeout_ms, NULL, done, err);
}

/* Whether a send's ranges still to hash come to RK_TCP_HELPER_MIN_BYTES. */
static int worth_helping(const struct hashing *h, const uint64_t *iov, size_t n, size_t from) {
    uint64_t total = 0;
    for (size_t j = from; j < n && total < RK_TCP_HELPER_MIN_BYTES; j++)
        if (!reads_hashes(h, iov, j)) total += iov[2 * j + 1];
    return total >= RK_TCP_HELPER_MIN_BYTES;
}

static int run_hashed(int fd, int sending, const uint64_t *iov, size_t n, uint64_t skip,
                      int timeout_ms, const rk_hasher *hasher, uint64_t *hashes,
                      uint64_t *hashed, uint64_t *done, int *err) {
    struct hashing h = {hasher, hashes, hashed, 0, 0, NULL, n, NULL};
    struct helped hp = {&h, iov, n, (size_t)*hashed, (size_t)*hashed, NULL, 0, 0};
    if (sending) __atomic_add_fetch(&hashed_senders, 1, __ATOMIC_RELAXED);
    if (sending && worth_helping(&h, iov, n, hp.next) && (hp.ready = calloc(n, 1))) {
        memset(hp.ready, 1, hp.next); /* hashed by the calls before */
        if (post_to_helper(&hp))
            h.hp = &hp;
        else {
            free(hp.ready);
            hp.ready = NULL;
        }
    }
    int rc = run(fd, sending, iov, n, skip, timeout_ms, &h, done, err);
    if (h.hp) { /* still shared (not gone inline) */
        leave_helper(&hp);
        size_t k = *hashed;
        while (k < n && hp.ready[k]) k++; /* a resumed call starts after these */
        *hashed = k;
    }
    free(hp.ready);
    if (sending) __atomic_sub_fetch(&hashed_senders, 1, __ATOMIC_RELAXED);
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
