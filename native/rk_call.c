/* rdmakv native client calls (the CPython module rdmakv._native_call, part of
 * the core's shared object rdmakv._native; see below), on
 * a client connection with nothing else in flight: a keys request answered
 * by one flag per key (EXISTS, DELETE), and a get's GET requests with their
 * answers, each in one call from Python.
 *
 * A scheduler waits for EXISTS before each engine step. With the node's
 * answer in C (rk_serve.h), the client's Python was most of what a 64-key
 * EXISTS cost over a plain socket ping-pong (the figures: bench/README.md,
 * "Measurements moved from code comments (issue 58)"): checking and encoding
 * the keys, framing, reading and checking the answer, and a bool per key.
 * This does all of it in one call:
 * it reads the keys straight from the list (which is why it is a CPython
 * extension and not cffi, which cannot), and sends and waits with the GIL
 * released.
 *
 * flags_call(fd, opcode, req_id, keys, scratch, ahead, timeout_ms) returns
 *   - a list of bools, one per key: the answer was the plain one (response
 *     opcode, same req_id, status 0, no bulk, a count of len(keys) and
 *     nothing after it) and has been consumed whole;
 *   - None: the keys are not for this call (not a list or tuple of bytes of
 *     one length in 1..max_key_len, or their frame does not fit scratch).
 *     Nothing was sent; the caller's own path checks them and names a bad one;
 *   - an int n >= 0: the request went out and the first n bytes of some other
 *     answer (an error status, a mismatch, or more than fits) are in ahead,
 *     for the caller's usual reading and checks, which say what is wrong;
 *   - -1: the peer closed the connection before a whole answer came.
 * It raises TimeoutError when no byte moves for timeout_ms (< 0: no limit),
 * OSError for a failed system call, and whatever a signal handler raises
 * (then, as when Python's own socket calls are interrupted, the answer may
 * be unread and the connection is the caller's to drop).
 * fd may be blocking or not: every call here is non-blocking, and waits are
 * polls. configure(response_bit, max_key_len, max_bulk) sets the protocol's
 * numbers (rdmakv/protocol.py, the one place they are written) before any
 * call.
 *
 * A get (GET in rdmakv/protocol.py) answered in Python cost the client more
 * than twice what a minimal client of the same node spent on a 1-block get
 * (bench/README.md, as above). So
 * get_call(fd, opcode, first_req_id, payloads, ends, counts, slots, base,
 * block, hasher, scratch, ahead, ahead_limit, timeout_ms) runs a whole get:
 * m requests whose payloads lie back to back in payloads (request i's ending
 * at ends[i], a uint64 array; counts[i], uint32, its keys; req_ids from
 * first_req_id on), sent under the tcp transport's flow control (at most
 * ahead_limit bytes of requests behind an unread answer); and their answers
 * read in order, each hit's value received straight into its slab block
 * (key j's at base + slots[j] * block, uint64 slots the caller has checked)
 * and hashed as it lands with the rk_hasher at address hasher
 * (native/rk_tcp.c's receive, in the same shared object). It returns
 *   - (sizes, corrupt, refusal): every answer consumed. sizes: per key its
 *     value's length, None for a miss; corrupt: the indices of the keys
 *     whose bytes failed their checksum (misses too); refusal: the bytes
 *     (header and payload) of the first error answer, whose keys are
 *     misses, or None;
 *   - None: the call does not take these arguments (a request over scratch,
 *     an answer's entries over ahead, inconsistent arrays). Nothing was sent;
 *   - (k, n): answer k is not one this call reads (out of step, malformed,
 *     values longer than a block or not matching its bulk); its first n
 *     bytes are in ahead for the caller's checks, which say what is wrong,
 *     and the connection is the caller's to drop;
 *   - -1: the peer closed the connection before the last answer was in.
 * Timeouts, failed calls and signal handlers as for flags_call.
 *
 * join_uniform and live_handles (below, before configure) check a batch's
 * keys, digests and block handles in one pass each, before any call. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "rk_tcp.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "frames are written in the host's byte order, which must be little-endian"
#endif

/* The frame header (HEADER in rdmakv/protocol.py: <BBHIQQ). */
#define HEADER_BYTES 24
#define H_OPCODE 0
#define H_STATUS 2
#define H_PAYLOAD_LEN 4
#define H_BULK_LEN 8
#define H_REQ_ID 16
#define COUNT_BYTES 4 /* u32 count at the start of a keys payload and of its answer */
#define KEY_LEN_BYTES 2
#define GET_ENTRY_BYTES 12 /* a GET answer's per key: u32 length, u64 checksum */

static unsigned response_bit = 0;
static Py_ssize_t max_key_len = 0;
static uint64_t max_bulk = 0;

static uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, sizeof v); return v; }
static uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, sizeof v); return v; }
static uint64_t rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, sizeof v); return v; }

enum io { IO_DONE, IO_AGAIN_AFTER_SIGNAL, IO_TIMEOUT, IO_CLOSED, IO_ERRNO };

/* Send data[*sent, len) (GIL released). IO_AGAIN_AFTER_SIGNAL: interrupted;
 * call again once Python's signal handlers ran. */
static enum io send_rest(int fd, const uint8_t *data, size_t len, size_t *sent, int timeout_ms) {
    while (*sent < len) {
        ssize_t k = send(fd, data + *sent, len - *sent, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k > 0) {
            *sent += (size_t)k;
            continue;
        }
        if (errno == EINTR)
            return IO_AGAIN_AFTER_SIGNAL;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return IO_ERRNO;
        struct pollfd p = {.fd = fd, .events = POLLOUT};
        int r = poll(&p, 1, timeout_ms);
        if (r == 0)
            return IO_TIMEOUT;
        if (r < 0)
            return errno == EINTR ? IO_AGAIN_AFTER_SIGNAL : IO_ERRNO;
    }
    return IO_DONE;
}

/* One receive of at most len bytes into buf (GIL released), polling first
 * when `wait` is set: IO_DONE with *got bytes read, which is 0 when none
 * had come (the caller polls before its next read), or why it failed. */
static enum io recv_some(int fd, uint8_t *buf, size_t len, int wait, int timeout_ms,
                         size_t *got) {
    *got = 0;
    if (wait) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int r = poll(&p, 1, timeout_ms);
        if (r == 0)
            return IO_TIMEOUT;
        if (r < 0)
            return errno == EINTR ? IO_AGAIN_AFTER_SIGNAL : IO_ERRNO;
    }
    ssize_t k = recv(fd, buf, len, MSG_DONTWAIT);
    if (k > 0)
        *got = (size_t)k;
    else if (k == 0)
        return IO_CLOSED;
    else if (errno == EINTR)
        return IO_AGAIN_AFTER_SIGNAL;
    else if (errno != EAGAIN && errno != EWOULDBLOCK)
        return IO_ERRNO;
    return IO_DONE;
}

/* Receive into buf until a whole answer (header and payload) is in, or buf
 * is full (GIL released). The answer is hardly ever in when this starts:
 * poll first, then read. */
static enum io recv_answer(int fd, uint8_t *buf, size_t cap, size_t *have, int timeout_ms) {
    for (;;) {
        if (*have >= HEADER_BYTES) {
            const uint64_t whole = HEADER_BYTES + (uint64_t)rd32(buf + H_PAYLOAD_LEN);
            if (*have >= whole || *have == cap)
                return IO_DONE;
        }
        size_t got;
        enum io io = recv_some(fd, buf + *have, cap - *have, 1, timeout_ms, &got);
        if (io != IO_DONE)
            return io;
        *have += got;
    }
}

/* The request frame for keys in scratch; its length, or 0 when the keys are
 * not for this call (see the top). */
static size_t encode(PyObject *seq, unsigned opcode, uint64_t req_id, uint8_t *out, size_t cap) {
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    if (n < 1 || n > UINT32_MAX || !PyBytes_CheckExact(items[0]))
        return 0;
    const Py_ssize_t klen = PyBytes_GET_SIZE(items[0]);
    if (klen < 1 || klen > max_key_len)
        return 0;
    const size_t stride = KEY_LEN_BYTES + (size_t)klen;
    const size_t payload_len = COUNT_BYTES + (size_t)n * stride;
    if (payload_len > UINT32_MAX || HEADER_BYTES + payload_len > cap)
        return 0;
    const uint32_t pl = (uint32_t)payload_len, count = (uint32_t)n;
    const uint16_t k16 = (uint16_t)klen;
    const uint64_t no_bulk = 0;
    memset(out, 0, HEADER_BYTES);
    out[H_OPCODE] = (uint8_t)opcode;
    memcpy(out + H_PAYLOAD_LEN, &pl, sizeof pl);
    memcpy(out + H_BULK_LEN, &no_bulk, sizeof no_bulk);
    memcpy(out + H_REQ_ID, &req_id, sizeof req_id);
    uint8_t *p = out + HEADER_BYTES;
    memcpy(p, &count, sizeof count);
    p += COUNT_BYTES;
    for (Py_ssize_t i = 0; i < n; i++, p += stride) {
        PyObject *key = items[i];
        if (!PyBytes_CheckExact(key) || PyBytes_GET_SIZE(key) != klen)
            return 0;
        memcpy(p, &k16, sizeof k16);
        memcpy(p + KEY_LEN_BYTES, PyBytes_AS_STRING(key), (size_t)klen);
    }
    return HEADER_BYTES + payload_len;
}

/* The flags of a plain answer to a request of n keys, or NULL without an
 * exception when it is not one (the caller reads it with its checks). */
static PyObject *plain_answer(const uint8_t *buf, size_t have, unsigned opcode, uint64_t req_id,
                              Py_ssize_t n) {
    if (have < HEADER_BYTES || buf[H_OPCODE] != (opcode | response_bit) ||
        rd16(buf + H_STATUS) != 0 || rd64(buf + H_BULK_LEN) != 0 ||
        rd64(buf + H_REQ_ID) != req_id ||
        rd32(buf + H_PAYLOAD_LEN) != COUNT_BYTES + (uint64_t)n ||
        have != HEADER_BYTES + COUNT_BYTES + (size_t)n ||
        rd32(buf + HEADER_BYTES) != (uint64_t)n)
        return NULL;
    PyObject *flags = PyList_New(n);
    if (flags == NULL)
        return NULL;
    const uint8_t *f = buf + HEADER_BYTES + COUNT_BYTES;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = f[i] ? Py_True : Py_False;
        Py_INCREF(b);
        PyList_SET_ITEM(flags, i, b);
    }
    return flags;
}

/* An exception for a failed wait or system call, or -1 (closed); NULL with
 * the exception set where Python raises. */
static PyObject *io_failure(enum io io, int err, int timeout_ms) {
    switch (io) {
    case IO_CLOSED:
        return PyLong_FromLong(-1);
    case IO_TIMEOUT:
        return PyErr_Format(PyExc_TimeoutError, "no answer for %d ms", timeout_ms);
    default:
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
}

/* flags_call once its arguments are parsed: keys a list or tuple. */
static PyObject *call(int fd, unsigned opcode, uint64_t req_id, PyObject *keys,
                      Py_buffer *scratch, Py_buffer *ahead, int timeout_ms) {
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(keys); /* before another thread can change it */
    const size_t frame = encode(keys, opcode, req_id, scratch->buf, (size_t)scratch->len);
    if (frame == 0)
        Py_RETURN_NONE;
    uint8_t *buf = ahead->buf;
    size_t sent = 0, have = 0;
    enum io io;
    int err = 0;
    for (;;) {
        Py_BEGIN_ALLOW_THREADS
        io = send_rest(fd, scratch->buf, frame, &sent, timeout_ms);
        if (io == IO_DONE)
            io = recv_answer(fd, buf, (size_t)ahead->len, &have, timeout_ms);
        err = errno;
        Py_END_ALLOW_THREADS
        if (io != IO_AGAIN_AFTER_SIGNAL)
            break;
        if (PyErr_CheckSignals() < 0)
            return NULL;
    }
    if (io != IO_DONE)
        return io_failure(io, err, timeout_ms);
    PyObject *flags = plain_answer(buf, have, opcode, req_id, n);
    return flags != NULL || PyErr_Occurred() ? flags : PyLong_FromSize_t(have);
}

static PyObject *flags_call(PyObject *self, PyObject *args) {
    int fd, timeout_ms;
    unsigned opcode;
    unsigned long long req_id;
    PyObject *keys;
    Py_buffer scratch, ahead;
    if (!PyArg_ParseTuple(args, "iIKOw*w*i", &fd, &opcode, &req_id, &keys, &scratch, &ahead,
                          &timeout_ms))
        return NULL;
    PyObject *result;
    if (response_bit == 0) {
        PyErr_SetString(PyExc_RuntimeError, "configure() was not called");
        result = NULL;
    } else if (!PyList_CheckExact(keys) && !PyTuple_CheckExact(keys)) {
        result = Py_NewRef(Py_None);
    } else {
        Py_INCREF(keys); /* kept while the GIL is released */
        result = call(fd, opcode, (uint64_t)req_id, keys, &scratch, &ahead, timeout_ms);
        Py_DECREF(keys);
    }
    PyBuffer_Release(&scratch);
    PyBuffer_Release(&ahead);
    return result;
}

/* Receive the head of one answer into buf, after the *have bytes already
 * there: its header and the payload the header announces, `expect` bytes
 * in all while the header is not in, never more than `cap`. An answer of
 * the expected length is read in one call; a shorter one (an error answer)
 * leaves bytes of what follows it in buf, for the caller. The answer is
 * hardly ever in when this starts: it polls first, and then reads before
 * it polls again. */
static enum io recv_head(int fd, uint8_t *buf, size_t cap, size_t expect, size_t *have,
                         int timeout_ms) {
    int ready = 0;
    for (;;) {
        size_t want = expect < cap ? expect : cap;
        if (*have >= HEADER_BYTES) {
            const uint64_t whole = HEADER_BYTES + (uint64_t)rd32(buf + H_PAYLOAD_LEN);
            want = whole < cap ? (size_t)whole : cap;
        }
        if (*have >= want)
            return IO_DONE;
        size_t got;
        enum io io = recv_some(fd, buf + *have, want - *have, !ready, timeout_ms, &got);
        if (io != IO_DONE)
            return io;
        ready = got > 0;
        *have += got;
    }
}

/* Read and drop `*left` bytes (an error answer's bulk) through buf. */
static enum io drain(int fd, uint8_t *buf, size_t cap, uint64_t *left, int timeout_ms) {
    while (*left) {
        size_t got;
        enum io io = recv_some(fd, buf, *left < cap ? (size_t)*left : cap, 1, timeout_ms, &got);
        if (io != IO_DONE)
            return io;
        *left -= got;
    }
    return IO_DONE;
}

static enum io from_tcp(int rc) {
    switch (rc) {
    case RK_TCP_OK: return IO_DONE;
    case RK_TCP_EINTR: return IO_AGAIN_AFTER_SIGNAL;
    case RK_TCP_TIMEOUT: return IO_TIMEOUT;
    case RK_TCP_CLOSED: return IO_CLOSED;
    default: return IO_ERRNO;
    }
}

/* One get_call: m GET requests (their payloads back to back, request i's
 * ending at ends[i], counts[i] keys each) and their answers, keys numbered
 * across the requests. Everything here runs with the GIL released; `run`
 * returns to Python only to run signal handlers (IO_AGAIN_AFTER_SIGNAL) and
 * is called again to resume where it stopped. */
struct gets {
    /* the call's arguments */
    int fd, timeout_ms;
    unsigned opcode;
    uint64_t first_id, ahead_limit, base, block;
    const uint8_t *payloads;
    const uint64_t *ends, *slots;
    const uint32_t *counts;
    size_t m;
    const rk_hasher *hasher;
    uint8_t *frame, *buf;
    size_t frame_cap, buf_cap;
    /* per key: length, RK_TCP_MISSED or RK_TCP_CORRUPT; and the scratch of one answer */
    int64_t *sizes;
    uint64_t *iov, *got;
    uint32_t *hit;
    /* progress */
    size_t sent, answered, key0; /* requests sent / answered; first key of the next answer */
    uint64_t in_flight;          /* request bytes sent whose answers are not read */
    int step;                    /* within the answer being read (see run) */
    size_t frame_len, frame_sent;
    size_t have; /* bytes in buf: the answer being read, from its first byte on, and
                    after its head maybe bytes that follow it (recv_head) */
    size_t len;  /* its head's length (header and payload) */
    int64_t hits;
    uint64_t moved, hashed, left;
    /* the first error answer (header and payload), for Python to raise */
    uint8_t *refusal;
    size_t refusal_len;
    int err;
};

enum { STEP_HEAD, STEP_BULK, STEP_DRAIN };
enum gets_end { GETS_DONE, GETS_OFF_PLAN, GETS_IO };

static size_t payload_start(const struct gets *g, size_t i) { return i ? g->ends[i - 1] : 0; }

/* Send request g->sent (its frame built in g->frame once). */
static enum io send_next(struct gets *g) {
    if (g->frame_sent == 0 && g->frame_len == 0) {
        const size_t at = payload_start(g, g->sent), len = (size_t)(g->ends[g->sent] - at);
        const uint32_t pl = (uint32_t)len;
        const uint64_t no_bulk = 0, id = g->first_id + g->sent;
        memset(g->frame, 0, HEADER_BYTES);
        g->frame[H_OPCODE] = (uint8_t)g->opcode;
        memcpy(g->frame + H_PAYLOAD_LEN, &pl, sizeof pl);
        memcpy(g->frame + H_BULK_LEN, &no_bulk, sizeof no_bulk);
        memcpy(g->frame + H_REQ_ID, &id, sizeof id);
        memcpy(g->frame + HEADER_BYTES, g->payloads + at, len);
        g->frame_len = HEADER_BYTES + len;
    }
    enum io io = send_rest(g->fd, g->frame, g->frame_len, &g->frame_sent, g->timeout_ms);
    g->err = errno;
    if (io == IO_DONE) {
        g->in_flight += g->frame_len;
        g->sent++;
        g->frame_len = g->frame_sent = 0;
    }
    return io;
}

/* Send what the flow control allows (REQUEST_BYTES_AHEAD in
 * rdmakv/transport/base.py: at most ahead_limit bytes of requests behind an
 * unread answer, or one request when none is unread), then read the next
 * answer, until every answer is in. GETS_OFF_PLAN: answer g->answered is
 * not one this call reads (g->have bytes of it in g->buf). */
static enum gets_end run(struct gets *g, enum io *io) {
    while (g->answered < g->m) {
        while (g->step == STEP_HEAD && g->sent < g->m) {
            const size_t next = HEADER_BYTES + (size_t)(g->ends[g->sent] - payload_start(g, g->sent));
            if (g->sent > g->answered && g->in_flight + next > g->ahead_limit)
                break;
            if ((*io = send_next(g)) != IO_DONE)
                return GETS_IO;
        }
        const size_t k = g->answered, count = g->counts[k];
        const size_t head = HEADER_BYTES + COUNT_BYTES + count * GET_ENTRY_BYTES;
        uint8_t *b = g->buf;
        if (g->step == STEP_HEAD) {
            *io = recv_head(g->fd, b, g->buf_cap, head, &g->have, g->timeout_ms);
            g->err = errno;
            if (*io != IO_DONE)
                return GETS_IO;
            if (b[H_OPCODE] != (g->opcode | response_bit) || rd64(b + H_REQ_ID) != g->first_id + k)
                return GETS_OFF_PLAN;
            if (rd16(b + H_STATUS) != 0) { /* refused: its keys are misses */
                const size_t len = HEADER_BYTES + (size_t)rd32(b + H_PAYLOAD_LEN);
                if (g->have < len || rd64(b + H_BULK_LEN) > max_bulk)
                    return GETS_OFF_PLAN;
                if (g->refusal == NULL) {
                    if ((g->refusal = malloc(len)) == NULL) {
                        *io = IO_ERRNO;
                        g->err = ENOMEM;
                        return GETS_IO;
                    }
                    memcpy(g->refusal, b, len);
                    g->refusal_len = len;
                }
                for (size_t j = 0; j < count; j++)
                    g->sizes[g->key0 + j] = RK_TCP_MISSED;
                const uint64_t extra = g->have - len, bulk = rd64(b + H_BULK_LEN);
                const size_t take = (size_t)(extra < bulk ? extra : bulk);
                g->left = bulk - take;
                g->len = len + take; /* the bulk read with the head is dropped with it */
                g->step = STEP_DRAIN;
            } else {
                uint64_t total = 0;
                size_t bad = 0;
                if (g->have < head || rd32(b + H_PAYLOAD_LEN) != head - HEADER_BYTES ||
                    rd32(b + HEADER_BYTES) != (uint64_t)count)
                    return GETS_OFF_PLAN;
                g->hits = rk_tcp_get_answer_layout(b + HEADER_BYTES + COUNT_BYTES, count,
                                                   g->slots + g->key0, g->base, g->block, g->iov,
                                                   g->hit, &total, &bad);
                if (g->hits < 0 || rd64(b + H_BULK_LEN) != total)
                    return GETS_OFF_PLAN;
                /* bulk read with the head goes to its blocks first (only after
                 * a short answer before this one can the head have come with any) */
                const uint64_t extra = g->have - head;
                g->moved = extra < total ? extra : total;
                g->hashed = 0;
                if (g->moved)
                    rk_tcp_copy_in(g->iov, (size_t)g->hits, b + head, g->moved);
                g->len = head + (size_t)g->moved;
                g->step = STEP_BULK;
            }
        }
        if (g->step == STEP_DRAIN) {
            /* through all of buf: while bulk is left, every byte read past the
             * head was bulk (taken above), and the refusal is copied out */
            *io = drain(g->fd, b, g->buf_cap, &g->left, g->timeout_ms);
            g->err = errno;
            if (*io != IO_DONE)
                return GETS_IO;
        } else if (g->step == STEP_BULK && g->hits > 0) {
            int rc = rk_tcp_recvv_hashed(g->fd, g->iov, (size_t)g->hits, g->moved, g->timeout_ms,
                                         g->hasher, g->got, &g->hashed, &g->moved, &g->err);
            if ((*io = from_tcp(rc)) != IO_DONE)
                return GETS_IO;
        }
        if (g->step == STEP_BULK)
            rk_tcp_get_answer_check(b + HEADER_BYTES + COUNT_BYTES, count, g->hit,
                                    (size_t)g->hits, g->got, g->sizes + g->key0);
        g->in_flight -= HEADER_BYTES + (size_t)(g->ends[k] - payload_start(g, k));
        g->answered++;
        g->key0 += count;
        g->have -= g->len; /* what follows the answer moves to the front */
        memmove(b, b + g->len, g->have);
        g->step = STEP_HEAD;
    }
    return GETS_DONE;
}

/* (sizes, corrupt, refusal) once every answer is in: per key its length or
 * None; the indices of the keys whose bytes failed their checksum; the
 * first error answer's bytes, or None. */
static PyObject *gets_result(const struct gets *g, size_t n) {
    PyObject *out = PyList_New((Py_ssize_t)n), *corrupt = PyList_New(0), *refusal;
    if (out == NULL || corrupt == NULL)
        goto fail;
    for (size_t j = 0; j < n; j++) {
        PyObject *v;
        if (g->sizes[j] > 0) {
            if ((v = PyLong_FromLongLong(g->sizes[j])) == NULL)
                goto fail;
        } else {
            v = Py_NewRef(Py_None);
            if (g->sizes[j] == RK_TCP_CORRUPT) {
                PyObject *idx = PyLong_FromSize_t(j);
                int bad = idx == NULL || PyList_Append(corrupt, idx) < 0;
                Py_XDECREF(idx);
                if (bad) {
                    Py_DECREF(v);
                    goto fail;
                }
            }
        }
        PyList_SET_ITEM(out, (Py_ssize_t)j, v);
    }
    refusal = g->refusal == NULL
                  ? Py_NewRef(Py_None)
                  : PyBytes_FromStringAndSize((const char *)g->refusal, (Py_ssize_t)g->refusal_len);
    if (refusal == NULL)
        goto fail;
    return Py_BuildValue("(NNN)", out, corrupt, refusal);
fail:
    Py_XDECREF(out);
    Py_XDECREF(corrupt);
    return NULL;
}

static PyObject *gets(struct gets *g, size_t n) {
    size_t most = 0;
    for (size_t i = 0; i < g->m; i++)
        if (g->counts[i] > most)
            most = g->counts[i];
    void *block = PyMem_Malloc(n * sizeof *g->sizes +
                               most * (2 * sizeof *g->iov + sizeof *g->got + sizeof *g->hit));
    if (block == NULL)
        return PyErr_NoMemory();
    g->sizes = block;
    g->iov = (uint64_t *)(g->sizes + n);
    g->got = g->iov + 2 * most;
    g->hit = (uint32_t *)(g->got + most);
    PyObject *result = NULL;
    enum io io = IO_DONE;
    enum gets_end end;
    for (;;) {
        Py_BEGIN_ALLOW_THREADS
        end = run(g, &io);
        Py_END_ALLOW_THREADS
        if (end != GETS_IO || io != IO_AGAIN_AFTER_SIGNAL)
            break;
        if (PyErr_CheckSignals() < 0)
            goto out;
    }
    if (end == GETS_DONE)
        result = gets_result(g, n);
    else if (end == GETS_OFF_PLAN)
        result = Py_BuildValue("(nn)", (Py_ssize_t)g->answered, (Py_ssize_t)g->have);
    else
        result = io_failure(io, g->err, g->timeout_ms);
out:
    free(g->refusal);
    PyMem_Free(block);
    return result;
}

static PyObject *get_call(PyObject *self, PyObject *args) {
    struct gets g;
    memset(&g, 0, sizeof g);
    unsigned long long first_id, base, block, hasher, ahead_limit;
    Py_buffer payloads, ends, counts, slots, scratch, ahead;
    if (!PyArg_ParseTuple(args, "iIKy*y*y*y*KKKw*w*Ki", &g.fd, &g.opcode, &first_id, &payloads,
                          &ends, &counts, &slots, &base, &block, &hasher, &scratch, &ahead,
                          &ahead_limit, &g.timeout_ms))
        return NULL;
    PyObject *result = NULL;
    const size_t m = (size_t)ends.len / sizeof(uint64_t), n = (size_t)slots.len / sizeof(uint64_t);
    const uint64_t *end_at = ends.buf;
    const uint32_t *count = counts.buf;
    int fits = response_bit != 0 && m >= 1 && hasher != 0 && block != 0 &&
               (size_t)counts.len == m * sizeof(uint32_t) && ends.len % sizeof(uint64_t) == 0 &&
               slots.len % sizeof(uint64_t) == 0 && end_at[m - 1] == (uint64_t)payloads.len;
    size_t keys = 0;
    for (size_t i = 0; fits && i < m; i++) {
        const uint64_t from = i ? end_at[i - 1] : 0;
        keys += count[i];
        fits = count[i] >= 1 && end_at[i] >= from &&
               HEADER_BYTES + (end_at[i] - from) <= (uint64_t)scratch.len &&
               HEADER_BYTES + COUNT_BYTES + (uint64_t)count[i] * GET_ENTRY_BYTES <= (uint64_t)ahead.len;
    }
    if (response_bit == 0) {
        PyErr_SetString(PyExc_RuntimeError, "configure() was not called");
    } else if (!fits || keys != n) {
        result = Py_NewRef(Py_None);
    } else {
        g.first_id = first_id;
        g.ahead_limit = ahead_limit;
        g.base = base;
        g.block = block;
        g.payloads = payloads.buf;
        g.ends = end_at;
        g.counts = count;
        g.slots = slots.buf;
        g.m = m;
        g.hasher = (const rk_hasher *)(uintptr_t)hasher;
        g.frame = scratch.buf;
        g.frame_cap = (size_t)scratch.len;
        g.buf = ahead.buf;
        g.buf_cap = (size_t)ahead.len;
        result = gets(&g, n);
    }
    PyBuffer_Release(&payloads);
    PyBuffer_Release(&ends);
    PyBuffer_Release(&counts);
    PyBuffer_Release(&slots);
    PyBuffer_Release(&scratch);
    PyBuffer_Release(&ahead);
    return result;
}


/* Batch argument scans. A client call checks its batch's keys, digests and
 * block handles before anything is sent, and an engine's batch holds
 * thousands of them. In Python the cheapest checks are C-level passes such
 * as set(map(len, keys)), and a 1000-key put made six of them, a large share
 * of the Python around a 16 KiB put's send where the client's CPU is what the
 * put waits for (bench/README.md, as above). These make one pass each. Each takes only the plain case and
 * answers "not taken" otherwise; the caller's Python then checks again and
 * names a bad item, so a batch is never refused here. */

/* join_uniform(items, min_len, max_len): (n, b"".join(items)) when items is
 * a list or tuple of one or more bytes objects (exactly bytes) all n long,
 * min_len <= n <= max_len; else None. */
static PyObject *join_uniform(PyObject *self, PyObject *args) {
    PyObject *seq;
    Py_ssize_t lo, hi;
    if (!PyArg_ParseTuple(args, "Onn", &seq, &lo, &hi))
        return NULL;
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq))
        Py_RETURN_NONE;
    /* no Python code runs below, so a list cannot change under the loops */
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    if (n < 1 || !PyBytes_CheckExact(items[0]))
        Py_RETURN_NONE;
    const Py_ssize_t len = PyBytes_GET_SIZE(items[0]);
    if (len < lo || len > hi || (len > 0 && n > PY_SSIZE_T_MAX / len))
        Py_RETURN_NONE;
    for (Py_ssize_t i = 1; i < n; i++)
        if (!PyBytes_CheckExact(items[i]) || PyBytes_GET_SIZE(items[i]) != len)
            Py_RETURN_NONE;
    PyObject *blob = PyBytes_FromStringAndSize(NULL, n * len);
    if (blob == NULL)
        return NULL;
    char *p = PyBytes_AS_STRING(blob);
    for (Py_ssize_t i = 0; i < n; i++, p += len)
        memcpy(p, PyBytes_AS_STRING(items[i]), (size_t)len);
    return Py_BuildValue("(nN)", len, blob);
}

/* live_handles(handles, refs): True when handles is a list or tuple of ints
 * (exactly int), each h in [0, len(refs)) with refs[h] an int other than 0,
 * refs a list (a slab's reference counts); else False. */
static PyObject *live_handles(PyObject *self, PyObject *args) {
    PyObject *seq, *refs;
    if (!PyArg_ParseTuple(args, "OO", &seq, &refs))
        return NULL;
    if ((!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) || !PyList_CheckExact(refs))
        Py_RETURN_FALSE;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), blocks = PyList_GET_SIZE(refs);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyLong_CheckExact(items[i]))
            Py_RETURN_FALSE;
        const Py_ssize_t h = PyLong_AsSsize_t(items[i]);
        if (h == -1 && PyErr_Occurred()) { /* beyond a Py_ssize_t: no block */
            PyErr_Clear();
            Py_RETURN_FALSE;
        }
        if (h < 0 || h >= blocks)
            Py_RETURN_FALSE;
        PyObject *ref = PyList_GET_ITEM(refs, h);
        if (!PyLong_CheckExact(ref))
            Py_RETURN_FALSE;
        const long count = PyLong_AsLong(ref);
        if (count == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            Py_RETURN_FALSE;
        }
        if (count == 0)
            Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}


static PyObject *configure(PyObject *self, PyObject *args) {
    unsigned bit;
    Py_ssize_t max_key;
    unsigned long long bulk;
    if (!PyArg_ParseTuple(args, "InK", &bit, &max_key, &bulk))
        return NULL;
    if (bit == 0 || bit > 0xFF || max_key < 1 || max_key > 0xFFFF || bulk == 0) {
        PyErr_Format(PyExc_ValueError,
                     "response bit %u / max key length %zd / max bulk %llu out of range", bit,
                     max_key, bulk);
        return NULL;
    }
    response_bit = bit;
    max_key_len = max_key;
    max_bulk = (uint64_t)bulk;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"flags_call", flags_call, METH_VARARGS,
     "flags_call(fd, opcode, req_id, keys, scratch, ahead, timeout_ms): see native/rk_call.c"},
    {"get_call", get_call, METH_VARARGS,
     "get_call(fd, opcode, first_req_id, payloads, ends, counts, slots, base, block, hasher, "
     "scratch, ahead, ahead_limit, timeout_ms): see native/rk_call.c"},
    {"join_uniform", join_uniform, METH_VARARGS,
     "join_uniform(items, min_len, max_len): (n, joined) or None: see native/rk_call.c"},
    {"live_handles", live_handles, METH_VARARGS,
     "live_handles(handles, refs): whether every handle is a live block: see native/rk_call.c"},
    {"configure", configure, METH_VARARGS,
     "configure(response_bit, max_key_len, max_bulk): the protocol's numbers, before any call"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "rdmakv._native_call",
    .m_doc = "Client calls in one native call each, and their batch scans: see native/rk_call.c.",
    .m_size = -1,
    .m_methods = methods,
};

/* This file is compiled into the cffi module rdmakv._native (native/build.py),
 * whose shared object thus holds two modules: cffi's, under the file's own name,
 * and this one, which rdmakv/native_core.py makes from the same file through
 * this second init function (PEP 489, "multiple modules in one library").
 * One shared object: one copy of rk_tcp.c's statics for both. */
PyMODINIT_FUNC PyInit__native_call(void) { return PyModule_Create(&module); }
