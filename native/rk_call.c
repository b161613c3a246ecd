/* rdmakv native client call (rdmakv._native_call, a CPython extension): a
 * keys request answered by one flag per key (EXISTS, DELETE) in one call
 * from Python, on a client connection with nothing else in flight.
 *
 * A scheduler waits for EXISTS before each engine step. With the node's
 * answer in C (rk_serve.h), the client's Python was most of what a 64-key
 * EXISTS cost over a plain socket ping-pong (~7 of ~22 us on one CPU of the
 * 2-core bench host): checking and encoding the keys, framing, reading and
 * checking the answer, and a bool per key. This does all of it in one call:
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
 * polls. configure(response_bit, max_key_len) sets the protocol's numbers
 * (rdmakv/protocol.py, the one place they are written) before any call. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <poll.h>
#include <stdint.h>
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
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int r = poll(&p, 1, timeout_ms);
        if (r == 0)
            return IO_TIMEOUT;
        if (r < 0)
            return errno == EINTR ? IO_AGAIN_AFTER_SIGNAL : IO_ERRNO;
        ssize_t k = recv(fd, buf + *have, cap - *have, MSG_DONTWAIT);
        if (k > 0)
            *have += (size_t)k;
        else if (k == 0)
            return IO_CLOSED;
        else if (errno == EINTR)
            return IO_AGAIN_AFTER_SIGNAL;
        else if (errno != EAGAIN && errno != EWOULDBLOCK)
            return IO_ERRNO;
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
    switch (io) {
    case IO_DONE: {
        PyObject *flags = plain_answer(buf, have, opcode, req_id, n);
        return flags != NULL || PyErr_Occurred() ? flags : PyLong_FromSize_t(have);
    }
    case IO_CLOSED:
        return PyLong_FromLong(-1);
    case IO_TIMEOUT:
        return PyErr_Format(PyExc_TimeoutError, "no answer for %d ms", timeout_ms);
    default:
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
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

/* Receive the head of one answer into buf: the header and, as the header
 * announces, its payload, `expect` bytes in all until the header is in, and
 * never more than `cap` (GIL released). Nothing past the payload is read:
 * a GET answer's bulk stays in the socket, for the slab. */
static enum io recv_head(int fd, uint8_t *buf, size_t cap, size_t expect, size_t *have,
                         int timeout_ms) {
    for (;;) {
        size_t want = expect;
        if (*have >= HEADER_BYTES) {
            const uint64_t whole = HEADER_BYTES + (uint64_t)rd32(buf + H_PAYLOAD_LEN);
            want = whole < cap ? (size_t)whole : cap;
        }
        if (*have >= want)
            return IO_DONE;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int r = poll(&p, 1, timeout_ms);
        if (r == 0)
            return IO_TIMEOUT;
        if (r < 0)
            return errno == EINTR ? IO_AGAIN_AFTER_SIGNAL : IO_ERRNO;
        ssize_t k = recv(fd, buf + *have, want - *have, MSG_DONTWAIT);
        if (k > 0)
            *have += (size_t)k;
        else if (k == 0)
            return IO_CLOSED;
        else if (errno == EINTR)
            return IO_AGAIN_AFTER_SIGNAL;
        else if (errno != EAGAIN && errno != EWOULDBLOCK)
            return IO_ERRNO;
    }
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

/* Per-key scratch of one get_call (one allocation). */
struct get_scratch {
    uint64_t *iov;  /* 2 per key: (address, length) of each hit */
    uint32_t *hit;  /* key index of each hit */
    uint64_t *got;  /* hash of each hit's bytes as received */
    int64_t *sizes; /* per key: length, RK_TCP_MISSED or RK_TCP_CORRUPT */
    void *block;
};

static int get_scratch_alloc(struct get_scratch *g, size_t n) {
    g->block = PyMem_Malloc(n * (2 * sizeof *g->iov + sizeof *g->hit + sizeof *g->got +
                                 sizeof *g->sizes));
    if (g->block == NULL)
        return -1;
    g->iov = g->block;
    g->got = g->iov + 2 * n;
    g->sizes = (int64_t *)(g->got + n);
    g->hit = (uint32_t *)(g->sizes + n);
    return 0;
}

/* (sizes, corrupt) of a checked answer: per key its length or None, and
 * the indices of the keys whose bytes failed their checksum. */
static PyObject *get_result(const int64_t *sizes, size_t n) {
    PyObject *out = PyList_New((Py_ssize_t)n), *corrupt = PyList_New(0);
    if (out == NULL || corrupt == NULL)
        goto fail;
    for (size_t j = 0; j < n; j++) {
        PyObject *v;
        if (sizes[j] > 0) {
            v = PyLong_FromLongLong(sizes[j]);
            if (v == NULL)
                goto fail;
        } else {
            v = Py_NewRef(Py_None);
            if (sizes[j] == RK_TCP_CORRUPT) {
                PyObject *idx = PyLong_FromSize_t(j);
                if (idx == NULL || PyList_Append(corrupt, idx) < 0) {
                    Py_XDECREF(idx);
                    Py_DECREF(v);
                    goto fail;
                }
                Py_DECREF(idx);
            }
        }
        PyList_SET_ITEM(out, (Py_ssize_t)j, v);
    }
    return Py_BuildValue("(NN)", out, corrupt);
fail:
    Py_XDECREF(out);
    Py_XDECREF(corrupt);
    return NULL;
}

/* get_call once its arguments are parsed and fit (see get_call below). */
static PyObject *get(int fd, unsigned opcode, uint64_t req_id, const Py_buffer *payload,
                     size_t n, const uint64_t *slots, uint64_t base, uint64_t block,
                     const rk_hasher *hasher, Py_buffer *scratch, Py_buffer *ahead,
                     int timeout_ms) {
    uint8_t *frame = scratch->buf, *buf = ahead->buf;
    const size_t frame_len = HEADER_BYTES + (size_t)payload->len;
    const size_t answer_len = HEADER_BYTES + COUNT_BYTES + n * GET_ENTRY_BYTES;
    const uint32_t pl = (uint32_t)payload->len;
    const uint64_t no_bulk = 0;
    memset(frame, 0, HEADER_BYTES);
    frame[H_OPCODE] = (uint8_t)opcode;
    memcpy(frame + H_PAYLOAD_LEN, &pl, sizeof pl);
    memcpy(frame + H_BULK_LEN, &no_bulk, sizeof no_bulk);
    memcpy(frame + H_REQ_ID, &req_id, sizeof req_id);
    memcpy(frame + HEADER_BYTES, payload->buf, (size_t)payload->len);
    struct get_scratch g;
    if (get_scratch_alloc(&g, n) < 0)
        return PyErr_NoMemory();
    PyObject *result = NULL;
    size_t sent = 0, have = 0;
    enum io io;
    int err = 0;
    for (;;) {
        Py_BEGIN_ALLOW_THREADS
        io = send_rest(fd, frame, frame_len, &sent, timeout_ms);
        if (io == IO_DONE)
            io = recv_head(fd, buf, (size_t)ahead->len, answer_len, &have, timeout_ms);
        err = errno;
        Py_END_ALLOW_THREADS
        if (io != IO_AGAIN_AFTER_SIGNAL)
            break;
        if (PyErr_CheckSignals() < 0)
            goto out;
    }
    if (io != IO_DONE) {
        result = io_failure(io, err, timeout_ms);
        goto out;
    }
    const uint8_t *entries = buf + HEADER_BYTES + COUNT_BYTES;
    uint64_t total = 0;
    size_t bad = 0;
    int64_t hits = -1;
    if (have == answer_len && buf[H_OPCODE] == (opcode | response_bit) &&
        rd16(buf + H_STATUS) == 0 && rd64(buf + H_REQ_ID) == req_id &&
        rd32(buf + H_PAYLOAD_LEN) == answer_len - HEADER_BYTES &&
        rd32(buf + HEADER_BYTES) == (uint64_t)n)
        hits = rk_tcp_get_answer_layout(entries, n, slots, base, block, g.iov, g.hit, &total,
                                        &bad);
    if (hits < 0 || rd64(buf + H_BULK_LEN) != total) { /* not the plain answer */
        result = PyLong_FromSize_t(have);
        goto out;
    }
    uint64_t done = 0, hashed = 0;
    int rc = RK_TCP_OK;
    while (hits > 0) {
        Py_BEGIN_ALLOW_THREADS
        rc = rk_tcp_recvv_hashed(fd, g.iov, (size_t)hits, done, timeout_ms, hasher, g.got,
                                 &hashed, &done, &err);
        Py_END_ALLOW_THREADS
        if (rc != RK_TCP_EINTR)
            break;
        if (PyErr_CheckSignals() < 0)
            goto out;
    }
    if (rc == RK_TCP_TIMEOUT) {
        result = io_failure(IO_TIMEOUT, 0, timeout_ms);
    } else if (rc == RK_TCP_CLOSED) {
        result = io_failure(IO_CLOSED, 0, timeout_ms);
    } else if (rc != RK_TCP_OK) {
        result = io_failure(IO_ERRNO, err, timeout_ms);
    } else {
        rk_tcp_get_answer_check(entries, n, g.hit, (size_t)hits, g.got, g.sizes);
        result = get_result(g.sizes, n);
    }
out:
    PyMem_Free(g.block);
    return result;
}

static PyObject *get_call(PyObject *self, PyObject *args) {
    int fd, timeout_ms;
    unsigned opcode;
    unsigned long long req_id, base, block, hasher;
    Py_ssize_t n;
    Py_buffer payload, slots, scratch, ahead;
    if (!PyArg_ParseTuple(args, "iIKy*ny*KKKw*w*i", &fd, &opcode, &req_id, &payload, &n, &slots,
                          &base, &block, &hasher, &scratch, &ahead, &timeout_ms))
        return NULL;
    PyObject *result;
    if (response_bit == 0) {
        PyErr_SetString(PyExc_RuntimeError, "configure() was not called");
        result = NULL;
    } else if (n < 1 || n > UINT32_MAX || hasher == 0 || block == 0 ||
               slots.len != n * (Py_ssize_t)sizeof(uint64_t) ||
               HEADER_BYTES + (size_t)payload.len > (size_t)scratch.len ||
               payload.len > UINT32_MAX ||
               HEADER_BYTES + COUNT_BYTES + (size_t)n * GET_ENTRY_BYTES > (size_t)ahead.len) {
        result = Py_NewRef(Py_None);
    } else {
        result = get(fd, opcode, (uint64_t)req_id, &payload, (size_t)n, slots.buf, (uint64_t)base,
                     (uint64_t)block, (const rk_hasher *)(uintptr_t)hasher, &scratch, &ahead,
                     timeout_ms);
    }
    PyBuffer_Release(&payload);
    PyBuffer_Release(&slots);
    PyBuffer_Release(&scratch);
    PyBuffer_Release(&ahead);
    return result;
}

static PyObject *configure(PyObject *self, PyObject *args) {
    unsigned bit;
    Py_ssize_t max_key;
    if (!PyArg_ParseTuple(args, "In", &bit, &max_key))
        return NULL;
    if (bit == 0 || bit > 0xFF || max_key < 1 || max_key > 0xFFFF) {
        PyErr_Format(PyExc_ValueError, "response bit %u / max key length %zd out of range", bit,
                     max_key);
        return NULL;
    }
    response_bit = bit;
    max_key_len = max_key;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"flags_call", flags_call, METH_VARARGS,
     "flags_call(fd, opcode, req_id, keys, scratch, ahead, timeout_ms): see native/rk_call.c"},
    {"get_call", get_call, METH_VARARGS,
     "get_call(fd, opcode, req_id, payload, n, slots, base, block, hasher, scratch, ahead, "
     "timeout_ms): see native/rk_call.c"},
    {"configure", configure, METH_VARARGS,
     "configure(response_bit, max_key_len): the protocol's numbers, before any call"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "rdmakv._native_call",
    .m_doc = "A keys request answered by per-key flags, in one call: see native/rk_call.c.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__native_call(void) { return PyModule_Create(&module); }
