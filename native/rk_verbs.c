/* See rk_verbs.h. Everything here runs without the GIL (cffi releases it). */
#include "rk_verbs.h"

#include <errno.h>
#include <sched.h>
#include <infiniband/verbs.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CQ_POLL_BATCH 64
/* Bound on waiting for flush completions after we force a QP to ERROR: the
 * device generates them promptly; past this the QP is left for the caller to
 * destroy rather than waiting forever. */
#define DRAIN_TIMEOUT_S 2.0

struct rk_ctx {
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    int port;
    uint64_t reg_count;
};

struct rk_mr {
    struct ibv_mr *mr;
};

struct rk_mw {
    struct ibv_mw *mw;
    uint32_t rkey;  /* the key it was last bound with (libibverbs leaves mw->rkey alone
                       for type-2 binds by WR; the next bind must name this one) */
};

struct rk_qp {
    rk_ctx *c;
    struct ibv_cq *cq;
    struct ibv_qp *qp;
    uint32_t max_wr;
    uint32_t max_sge;
    uint32_t max_rd_atom;
    uint32_t psn;
    uint32_t active_mtu;
    uint64_t max_msg;  /* port max_msg_sz: bounds the bytes of one WR */
    /* Scratch reused across jobs, grown on demand. */
    struct ibv_send_wr *wrs;
    struct ibv_sge *sges;
    uint32_t *wr_first_op;
    uint64_t *wr_bytes;
    uint32_t cap;
};

static void set_err(char *err, const char *fmt, const char *what, int e) {
    if (err) snprintf(err, RK_ERRLEN, fmt, what, strerror(e), e);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int rk_device_names(char *buf, size_t buflen) {
    int n = 0;
    struct ibv_device **list = ibv_get_device_list(&n);
    size_t used = 0;
    if (!list) return -errno;
    if (buflen) buf[0] = 0;
    for (int i = 0; i < n; i++) {
        const char *name = ibv_get_device_name(list[i]);
        size_t len = strlen(name);
        if (used + len + 2 > buflen) break;
        memcpy(buf + used, name, len);
        used += len;
        buf[used++] = '\n';
        buf[used] = 0;
    }
    ibv_free_device_list(list);
    return n;
}

rk_ctx *rk_open(const char *device, int port, char *err) {
    int n = 0;
    struct ibv_device **list = ibv_get_device_list(&n);
    struct ibv_context *ctx = NULL;
    if (!list) {
        set_err(err, "%s: %s (errno %d)", "ibv_get_device_list", errno);
        return NULL;
    }
    for (int i = 0; i < n; i++) {
        if (strcmp(ibv_get_device_name(list[i]), device) == 0) {
            ctx = ibv_open_device(list[i]);
            if (!ctx) set_err(err, "ibv_open_device(%s): %s (errno %d)", device, errno);
            break;
        }
    }
    ibv_free_device_list(list);
    if (!ctx) {
        if (err && !err[0]) snprintf(err, RK_ERRLEN, "no RDMA device named %s", device);
        return NULL;
    }
    rk_ctx *c = calloc(1, sizeof(*c));
    if (!c) {
        ibv_close_device(ctx);
        set_err(err, "%s: %s (errno %d)", "calloc", ENOMEM);
        return NULL;
    }
    c->ctx = ctx;
    c->port = port;
    c->pd = ibv_alloc_pd(ctx);
    if (!c->pd) {
        set_err(err, "%s: %s (errno %d)", "ibv_alloc_pd", errno);
        ibv_close_device(ctx);
        free(c);
        return NULL;
    }
    return c;
}

void rk_close(rk_ctx *c) {
    if (!c) return;
    if (c->pd) ibv_dealloc_pd(c->pd);
    if (c->ctx) ibv_close_device(c->ctx);
    free(c);
}

uint64_t rk_pd_handle(rk_ctx *c) { return c->pd->handle; }

int rk_query(rk_ctx *c, rk_attrs *out, char *err) {
    struct ibv_device_attr da;
    struct ibv_port_attr pa;
    int rc = ibv_query_device(c->ctx, &da);
    if (rc) {
        set_err(err, "%s: %s (errno %d)", "ibv_query_device", rc);
        return -1;
    }
    rc = ibv_query_port(c->ctx, (uint8_t)c->port, &pa);
    if (rc) {
        set_err(err, "%s: %s (errno %d)", "ibv_query_port", rc);
        return -1;
    }
    out->max_sge = (uint32_t)da.max_sge;
    out->max_qp_wr = (uint32_t)da.max_qp_wr;
    out->max_qp_rd_atom = (uint32_t)da.max_qp_rd_atom;
    out->max_cqe = (uint32_t)da.max_cqe;
    out->max_mr_size = da.max_mr_size;
    out->phys_port_cnt = da.phys_port_cnt;
    out->port_state = pa.state;
    out->active_mtu = pa.active_mtu;
    out->max_msg_sz = pa.max_msg_sz;
    out->lid = pa.lid;
    out->link_layer = pa.link_layer;
    out->gid_tbl_len = (uint32_t)pa.gid_tbl_len;
    return 0;
}

int rk_query_gid(rk_ctx *c, int index, uint8_t *gid16, char *err) {
    union ibv_gid g;
    int rc = ibv_query_gid(c->ctx, (uint8_t)c->port, index, &g);
    if (rc) {
        set_err(err, "%s: %s (errno %d)", "ibv_query_gid", errno ? errno : rc);
        return -1;
    }
    memcpy(gid16, g.raw, 16);
    return 0;
}

rk_mr *rk_reg_mr(rk_ctx *c, uint64_t addr, uint64_t length, int remote, char *err) {
    int access = IBV_ACCESS_LOCAL_WRITE;
    if (remote == 1) access |= IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;
    if (remote == 2) access |= IBV_ACCESS_MW_BIND;
    rk_mr *m = calloc(1, sizeof(*m));
    if (!m) {
        set_err(err, "%s: %s (errno %d)", "calloc", ENOMEM);
        return NULL;
    }
    m->mr = ibv_reg_mr(c->pd, (void *)(uintptr_t)addr, (size_t)length, access);
    if (!m->mr) {
        set_err(err, "%s: %s (errno %d)", "ibv_reg_mr", errno);
        free(m);
        return NULL;
    }
    c->reg_count++;
    return m;
}

uint32_t rk_mr_lkey(rk_mr *m) { return m->mr->lkey; }
uint32_t rk_mr_rkey(rk_mr *m) { return m->mr->rkey; }
uint64_t rk_reg_count(rk_ctx *c) { return c->reg_count; }

int rk_dereg_mr(rk_mr *m) {
    if (!m) return 0;
    int rc = ibv_dereg_mr(m->mr);
    free(m);
    return rc;
}

int rk_mw_supported(rk_ctx *c) {
    struct ibv_device_attr da;
    if (ibv_query_device(c->ctx, &da)) return 0;
    return da.max_mw > 0 && (da.device_cap_flags & IBV_DEVICE_MEM_WINDOW) &&
           (da.device_cap_flags &
            (IBV_DEVICE_MEM_WINDOW_TYPE_2A | IBV_DEVICE_MEM_WINDOW_TYPE_2B)) != 0;
}

rk_mw *rk_mw_alloc(rk_ctx *c, char *err) {
    rk_mw *w = calloc(1, sizeof(*w));
    if (!w) {
        set_err(err, "%s: %s (errno %d)", "calloc", ENOMEM);
        return NULL;
    }
    errno = 0;
    w->mw = ibv_alloc_mw(c->pd, IBV_MW_TYPE_2);
    if (!w->mw) {
        set_err(err, "%s: %s (errno %d)", "ibv_alloc_mw(TYPE_2)", errno ? errno : EOPNOTSUPP);
        free(w);
        return NULL;
    }
    w->rkey = w->mw->rkey;
    return w;
}

uint32_t rk_mw_rkey(rk_mw *w) { return w->rkey; }

int rk_mw_dealloc(rk_mw *w) {
    if (!w) return 0;
    int rc = ibv_dealloc_mw(w->mw);
    free(w);
    return rc;
}

int rk_qp_bind_mws(rk_qp *q, rk_mr *mr, rk_mw **mws, const uint64_t *addrs,
                   const uint64_t *lens, int access, uint32_t n, int32_t *status,
                   double timeout_s) {
    unsigned int acc = 0;
    if (access & 1) acc |= IBV_ACCESS_REMOTE_READ;
    if (access & 2) acc |= IBV_ACCESS_REMOTE_WRITE;
    uint32_t chunk = q->max_wr > 1 ? q->max_wr / 2 : 1;
    struct ibv_send_wr *wrs = calloc(chunk, sizeof(*wrs));
    uint32_t *keys = calloc(chunk, sizeof(*keys));
    uint32_t failed = 0;
    if (!wrs || !keys) {
        free(wrs);
        free(keys);
        for (uint32_t i = 0; i < n; i++) status[i] = RK_ST_NOT_POSTED;
        return (int)n;
    }
    const double deadline = now_s() + timeout_s;
    struct ibv_wc wc[CQ_POLL_BATCH];
    for (uint32_t lo = 0; lo < n; lo += chunk) {
        uint32_t k = n - lo < chunk ? n - lo : chunk;
        for (uint32_t j = 0; j < k; j++) {
            uint32_t i = lo + j;
            struct ibv_send_wr *w = &wrs[j];
            memset(w, 0, sizeof(*w));
            w->wr_id = i;
            w->opcode = IBV_WR_BIND_MW;
            w->send_flags = IBV_SEND_SIGNALED;
            /* the WR names the window by its current key; the new key differs
               in its low (consumer) byte */
            mws[i]->mw->rkey = mws[i]->rkey;
            keys[j] = ibv_inc_rkey(mws[i]->rkey);
            w->bind_mw.mw = mws[i]->mw;
            w->bind_mw.rkey = keys[j];
            w->bind_mw.bind_info.mr = mr->mr;
            w->bind_mw.bind_info.addr = addrs[i];
            w->bind_mw.bind_info.length = lens[i];
            w->bind_mw.bind_info.mw_access_flags = acc;
            w->next = j + 1 < k ? &wrs[j + 1] : NULL;
            status[i] = RK_ST_NOT_POSTED;
        }
        struct ibv_send_wr *bad = NULL;
        uint32_t posted = k;
        if (ibv_post_send(q->qp, wrs, &bad)) {
            posted = bad ? (uint32_t)(bad - wrs) : 0;
            for (uint32_t j = posted; j < k; j++) status[lo + j] = RK_ST_POST_FAILED;
        }
        uint32_t seen = 0;
        while (seen < posted) {
            int got = ibv_poll_cq(q->cq, CQ_POLL_BATCH, wc);
            if (got < 0) break;
            if (got == 0) {
                if (now_s() > deadline) break;
                sched_yield();
                continue;
            }
            for (int g = 0; g < got; g++) {
                uint32_t i = (uint32_t)wc[g].wr_id;
                if (i < lo || i >= lo + posted) continue;  /* not ours */
                seen++;
                status[i] = (int32_t)wc[g].status;
                if (wc[g].status == IBV_WC_SUCCESS) {
                    mws[i]->rkey = keys[i - lo];
                    mws[i]->mw->rkey = keys[i - lo];
                }
            }
        }
        if (seen < posted) {
            /* timed out or CQ gone: make the device let go of the WRs (their
               windows are unusable: the caller deallocates them) */
            rk_qp_force_error(q);
            double drain_end = now_s() + DRAIN_TIMEOUT_S;
            while (seen < posted && now_s() < drain_end) {
                int got = ibv_poll_cq(q->cq, CQ_POLL_BATCH, wc);
                if (got < 0) break;
                for (int g = 0; g < got; g++) {
                    uint32_t i = (uint32_t)wc[g].wr_id;
                    if (i >= lo && i < lo + posted) seen++;
                }
            }
            for (uint32_t j = 0; j < posted; j++)
                if (status[lo + j] == RK_ST_NOT_POSTED) status[lo + j] = RK_ST_TIMEOUT;
        }
    }
    for (uint32_t i = 0; i < n; i++)
        if (status[i] != RK_OK) failed++;
    free(wrs);
    free(keys);
    return (int)failed;
}

static int to_init(rk_qp *q, char *err) {
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = (uint8_t)q->c->port;
    a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;
    int rc = ibv_modify_qp(q->qp, &a,
                           IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
    if (rc) set_err(err, "%s: %s (errno %d)", "modify_qp(INIT)", rc);
    return rc;
}

static uint32_t fresh_psn(void) {
    /* PSNs are 24 bits; a fresh random start per connection keeps stale packets
     * of an earlier incarnation of this QP from being accepted. */
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint32_t x = (uint32_t)ts.tv_nsec ^ (uint32_t)rand();
    return x & 0xffffff;
}

rk_qp *rk_qp_create(rk_ctx *c, uint32_t max_wr, uint32_t max_sge, uint32_t max_rd_atom,
                    char *err) {
    rk_qp *q = calloc(1, sizeof(*q));
    if (!q) {
        set_err(err, "%s: %s (errno %d)", "calloc", ENOMEM);
        return NULL;
    }
    struct ibv_port_attr pa;
    if (ibv_query_port(c->ctx, (uint8_t)c->port, &pa) == 0) {
        q->active_mtu = pa.active_mtu;
        q->max_msg = pa.max_msg_sz;
    }
    if (!q->max_msg) q->max_msg = 1u << 20;
    q->c = c;
    q->max_wr = max_wr;
    q->max_sge = max_sge;
    q->max_rd_atom = max_rd_atom;
    q->cq = ibv_create_cq(c->ctx, (int)max_wr, NULL, NULL, 0);
    if (!q->cq) {
        set_err(err, "%s: %s (errno %d)", "ibv_create_cq", errno);
        free(q);
        return NULL;
    }
    struct ibv_qp_init_attr ia;
    memset(&ia, 0, sizeof(ia));
    ia.send_cq = q->cq;
    ia.recv_cq = q->cq;
    ia.qp_type = IBV_QPT_RC;
    ia.sq_sig_all = 0;  /* selective signalling */
    ia.cap.max_send_wr = max_wr;
    ia.cap.max_recv_wr = 1;  /* one-sided only: nothing is ever received */
    ia.cap.max_send_sge = max_sge;
    ia.cap.max_recv_sge = 1;
    q->qp = ibv_create_qp(c->pd, &ia);
    if (!q->qp) {
        set_err(err, "%s: %s (errno %d)", "ibv_create_qp", errno);
        ibv_destroy_cq(q->cq);
        free(q);
        return NULL;
    }
    q->psn = fresh_psn();
    if (to_init(q, err)) {
        rk_qp_destroy(q);
        return NULL;
    }
    return q;
}

int rk_qp_info_get(rk_qp *q, rk_qp_info *out) {
    out->qpn = q->qp->qp_num;
    out->psn = q->psn;
    return 0;
}

int rk_qp_connect(rk_qp *q, const rk_remote *r, int gid_index, int use_grh, uint32_t timeout,
                  uint32_t retry_cnt, uint32_t rnr_retry, char *err) {
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_RTR;
    uint32_t mtu = r->mtu < q->active_mtu || !q->active_mtu ? r->mtu : q->active_mtu;
    a.path_mtu = (enum ibv_mtu)mtu;
    a.dest_qp_num = r->qpn;
    a.rq_psn = r->psn;
    a.max_dest_rd_atomic = (uint8_t)q->max_rd_atom;
    /* Only matters for RNR NAKs, which one-sided traffic never produces. */
    a.min_rnr_timer = 12;
    a.ah_attr.port_num = (uint8_t)q->c->port;
    a.ah_attr.dlid = (uint16_t)r->lid;
    if (use_grh) {
        a.ah_attr.is_global = 1;
        memcpy(a.ah_attr.grh.dgid.raw, r->gid, 16);
        a.ah_attr.grh.sgid_index = (uint8_t)gid_index;
        a.ah_attr.grh.hop_limit = 64;
    }
    int rc = ibv_modify_qp(q->qp, &a,
                           IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                               IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
                               IBV_QP_MIN_RNR_TIMER);
    if (rc) {
        set_err(err, "%s: %s (errno %d)", "modify_qp(RTR)", rc);
        return rc;
    }
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_RTS;
    a.timeout = (uint8_t)timeout;
    a.retry_cnt = (uint8_t)retry_cnt;
    a.rnr_retry = (uint8_t)rnr_retry;
    a.sq_psn = q->psn;
    a.max_rd_atomic = (uint8_t)q->max_rd_atom;
    rc = ibv_modify_qp(q->qp, &a,
                       IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                           IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
    if (rc) set_err(err, "%s: %s (errno %d)", "modify_qp(RTS)", rc);
    return rc;
}

int rk_qp_state(rk_qp *q) {
    struct ibv_qp_attr a;
    struct ibv_qp_init_attr ia;
    if (ibv_query_qp(q->qp, &a, IBV_QP_STATE, &ia)) return -1;
    return a.qp_state;
}

int rk_qp_force_error(rk_qp *q) {
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_ERR;
    return ibv_modify_qp(q->qp, &a, IBV_QP_STATE);
}

int rk_qp_reset(rk_qp *q, char *err) {
    struct ibv_qp_attr a;
    struct ibv_wc wc[CQ_POLL_BATCH];
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_RESET;
    int rc = ibv_modify_qp(q->qp, &a, IBV_QP_STATE);
    if (rc) {
        set_err(err, "%s: %s (errno %d)", "modify_qp(RESET)", rc);
        return rc;
    }
    /* Completions of the old incarnation must not be seen by the next job. */
    while (ibv_poll_cq(q->cq, CQ_POLL_BATCH, wc) > 0) {
    }
    q->psn = fresh_psn();
    return to_init(q, err);
}

void rk_qp_destroy(rk_qp *q) {
    if (!q) return;
    if (q->qp) ibv_destroy_qp(q->qp);
    if (q->cq) ibv_destroy_cq(q->cq);
    free(q->wrs);
    free(q->sges);
    free(q->wr_first_op);
    free(q->wr_bytes);
    free(q);
}

static int ensure_cap(rk_qp *q, uint32_t n) {
    if (n <= q->cap) return 0;
    struct ibv_send_wr *w = realloc(q->wrs, sizeof(*w) * n);
    if (!w) return -1;
    q->wrs = w;
    struct ibv_sge *s = realloc(q->sges, sizeof(*s) * n);
    if (!s) return -1;
    q->sges = s;
    /* one extra slot: wr_first_op[nwr] = n marks the end of the last WR */
    uint32_t *f = realloc(q->wr_first_op, sizeof(*f) * (n + 1));
    if (!f) return -1;
    q->wr_first_op = f;
    uint64_t *b = realloc(q->wr_bytes, sizeof(*b) * n);
    if (!b) return -1;
    q->wr_bytes = b;
    q->cap = n;
    return 0;
}

static void mark(int32_t *status, const uint32_t *first, uint32_t wr_lo, uint32_t wr_hi,
                 int32_t st) {
    /* Give every op of WRs [wr_lo, wr_hi) the status st. */
    for (uint32_t w = wr_lo; w < wr_hi; w++)
        for (uint32_t i = first[w]; i < first[w + 1]; i++) status[i] = st;
}

/* Run one job: all ops with one opcode against one remote region.
 *
 * Batching: consecutive ops whose remote ranges are contiguous share one WR
 * (one SGE per op, merged further when the local ranges are contiguous too),
 * up to sge_limit SGEs and max_msg bytes. WRs are posted as chains, only every
 * signal_every-th WR and the tail of each chain are signalled, at most max_wr
 * WRs (reads: max_rd_atom) and max_inflight_bytes (0: no limit) are
 * outstanding, completions are polled CQ_POLL_BATCH at a time. Posting again
 * as soon as room frees up keeps the device fed (and, on soft-RoCE, drives
 * the requester from this thread, which is much faster than its tasklets).
 * A poll that finds nothing yields the CPU (sched_yield) instead of spinning.
 *
 * Returns the number of failed ops (0: all done); status[i] says why op i
 * failed. Never waits past timeout_s (plus a bounded drain): on timeout the QP
 * is forced to ERROR so the device lets go of every posted WR before we
 * return, and the caller must reset/reconnect it. A stall (stall_s without a
 * completion while WRs are out, see rk_verbs.h) ends the run the same way,
 * early, with RK_ST_STALLED for the ops in flight. */
int rk_qp_run(rk_qp *q, int opcode, uint64_t local_base, uint32_t lkey, uint32_t rkey,
              const rk_op *ops, uint32_t n, int32_t *status, uint32_t sge_limit,
              uint32_t signal_every, uint64_t max_inflight_bytes, double timeout_s,
              double stall_s, rk_stats *st) {
    memset(st, 0, sizeof(*st));
    if (n == 0) return 0;
    if (ensure_cap(q, n)) {
        for (uint32_t i = 0; i < n; i++) status[i] = RK_ST_NOT_POSTED;
        st->failed_ops = n;
        st->first_error = RK_ST_NOT_POSTED;
        return (int)n;
    }
    if (sge_limit == 0 || sge_limit > q->max_sge) sge_limit = q->max_sge;
    /* A WR never carries more than the in-flight budget: one giant WR would
     * leave the budget (and the posting loop) idle until it completes. */
    uint64_t max_msg = q->max_msg;
    if (max_inflight_bytes && max_inflight_bytes < max_msg) max_msg = max_inflight_bytes;

    /* ---- build: group ops into WRs ---- */
    uint32_t nwr = 0, nsge = 0;
    for (uint32_t i = 0; i < n; i++) {
        status[i] = RK_OK;
        const rk_op *op = &ops[i];
        struct ibv_send_wr *cur = nwr ? &q->wrs[nwr - 1] : NULL;
        int join = 0;
        if (cur) {
            struct ibv_sge *last = &cur->sg_list[cur->num_sge - 1];
            uint64_t wr_len = q->wr_bytes[nwr - 1];
            const rk_op *prev = &ops[i - 1];
            if (prev->remote_addr + prev->length == op->remote_addr &&
                prev->rkey == op->rkey &&
                wr_len + op->length <= max_msg) {
                if (last->addr + last->length == local_base + op->local_offset &&
                    (uint64_t)last->length + op->length <= UINT32_MAX) {
                    last->length += (uint32_t)op->length;  /* contiguous on both sides */
                    q->wr_bytes[nwr - 1] += op->length;
                    join = 1;
                } else if ((uint32_t)cur->num_sge < sge_limit) {
                    struct ibv_sge *s = &q->sges[nsge++];
                    s->addr = local_base + op->local_offset;
                    s->length = (uint32_t)op->length;
                    s->lkey = lkey;
                    cur->num_sge++;
                    q->wr_bytes[nwr - 1] += op->length;
                    join = 1;
                }
            }
        }
        if (join) continue;
        struct ibv_send_wr *w = &q->wrs[nwr];
        memset(w, 0, sizeof(*w));
        q->wr_first_op[nwr] = i;
        q->wr_bytes[nwr] = op->length;
        w->wr_id = nwr;
        w->sg_list = &q->sges[nsge];
        w->num_sge = 1;
        q->sges[nsge].addr = local_base + op->local_offset;
        q->sges[nsge].length = (uint32_t)op->length;
        q->sges[nsge].lkey = lkey;
        nsge++;
        w->opcode = opcode == RK_OP_READ ? IBV_WR_RDMA_READ : IBV_WR_RDMA_WRITE;
        w->wr.rdma.remote_addr = op->remote_addr;
        w->wr.rdma.rkey = op->rkey ? (uint32_t)op->rkey : rkey;
        nwr++;
    }
    q->wr_first_op[nwr] = n;
    st->wrs = nwr;
    st->sges = nsge;

    uint32_t window = q->max_wr;
    if (opcode == RK_OP_READ && q->max_rd_atom && q->max_rd_atom < window)
        window = q->max_rd_atom;
    if (signal_every == 0 || signal_every > window) signal_every = window / 4 ? window / 4 : 1;
    for (uint32_t w = 0; w < nwr; w++) {
        q->wrs[w].next = w + 1 < nwr ? &q->wrs[w + 1] : NULL;
        /* Every window holds a signalled WR, so the window always drains. */
        if ((w + 1) % signal_every == 0 || w + 1 == nwr) {
            q->wrs[w].send_flags = IBV_SEND_SIGNALED;
            st->signaled++;
        }
    }

    /* ---- post + poll ---- */
    const double deadline = now_s() + timeout_s;
    uint32_t posted = 0, done = 0;  /* WRs [0, done) completed successfully */
    uint64_t inflight = 0;          /* bytes of WRs [done, posted) */
    uint32_t bytes_done_upto = 0;
    if (max_inflight_bytes == 0) max_inflight_bytes = UINT64_MAX;
    int failed = 0;                 /* QP hit an error: stop posting, drain */
    int32_t first_err = 0;
    uint32_t err_wr = 0;
    int timed_out = 0;
    int32_t lost = RK_ST_TIMEOUT;   /* the status of WRs in flight when we give up */
    double last_progress = now_s(); /* the last completion (or the start) */
    int marked_rest = 0;
    struct ibv_wc wc[CQ_POLL_BATCH];
    while (done < nwr) {
        if (done > bytes_done_upto) {  /* retire the bytes of completed WRs */
            for (uint32_t w = bytes_done_upto; w < done; w++) inflight -= q->wr_bytes[w];
            bytes_done_upto = done;
        }
        if (!failed && posted < nwr && posted - done < window &&
            (inflight < max_inflight_bytes || posted == done)) {
            uint32_t k = 0;
            uint64_t add = 0;
            /* As many WRs as the WR window and the byte budget allow; at
             * least one when nothing is outstanding. */
            while (posted + k < nwr && posted - done + k < window &&
                   (k == 0 || inflight + add + q->wr_bytes[posted + k] <= max_inflight_bytes)) {
                add += q->wr_bytes[posted + k];
                k++;
            }
            struct ibv_send_wr *head = &q->wrs[posted], *bad = NULL;
            struct ibv_send_wr *tail = &q->wrs[posted + k - 1];
            struct ibv_send_wr *saved = tail->next;
            /* The tail of every chain is signalled, so whatever is outstanding
             * always ends in a signalled WR: the windows cannot deadlock. */
            if (!(tail->send_flags & IBV_SEND_SIGNALED)) {
                tail->send_flags |= IBV_SEND_SIGNALED;
                st->signaled++;
            }
            tail->next = NULL;
            int rc = ibv_post_send(q->qp, head, &bad);
            tail->next = saved;
            st->post_calls++;
            if (rc) {
                uint32_t ok = bad ? (uint32_t)(bad - q->wrs) : posted;
                mark(status, q->wr_first_op, ok, nwr, RK_ST_POST_FAILED);
                if (!first_err) first_err = RK_ST_POST_FAILED;
                failed = 1;
                err_wr = ok;
                posted = ok;
                rk_qp_force_error(q);
                if (posted == done) break;
            } else {
                posted += k;
                inflight += add;
            }
            if (posted - done > st->max_outstanding) st->max_outstanding = posted - done;
        }
        int got = ibv_poll_cq(q->cq, CQ_POLL_BATCH, wc);
        if (got < 0) {
            /* CQ overrun or device gone: nothing more will come from it. */
            mark(status, q->wr_first_op, done, nwr, RK_ST_FLUSHED);
            if (!first_err) first_err = RK_ST_FLUSHED;
            rk_qp_force_error(q);
            break;
        }
        if (got > 0) {
            st->polls++;
            last_progress = now_s();
        } else if (got == 0) {
            /* Nothing completed: let other runnable threads have the CPU.
             * Free when nothing else wants it (a real NIC host); under
             * contention (soft-RoCE, whose kernel work shares these CPUs,
             * or the engine's own threads) a spinning poller would steal it. */
            sched_yield();
        }
        int last_seen = 0;
        for (int j = 0; j < got; j++) {
            uint32_t id = (uint32_t)wc[j].wr_id;
            if (id >= nwr) continue;  /* not ours (should not happen after reset) */
            if (wc[j].status == IBV_WC_SUCCESS) {
                if (id + 1 > done) done = id + 1;
            } else if (!failed || wc[j].status != IBV_WC_WR_FLUSH_ERR) {
                /* RC completes in order: WRs before this one succeeded. */
                if (id > done) done = id;
                if (!failed || id < err_wr) err_wr = id;
                mark(status, q->wr_first_op, id, id + 1, (int32_t)wc[j].status);
                if (!first_err) first_err = (int32_t)wc[j].status;
                failed = 1;
            }
            if (id + 1 == posted) last_seen = 1;
        }
        if (failed) {
            if (!marked_rest) {
                /* Everything after the failing WR is flushed or never posted. */
                for (uint32_t w = err_wr + 1; w < nwr; w++)
                    if (status[q->wr_first_op[w]] == RK_OK)
                        mark(status, q->wr_first_op, w, w + 1,
                             w < posted ? RK_ST_FLUSHED : RK_ST_NOT_POSTED);
                marked_rest = 1;
            }
            if (last_seen || posted == 0) break;
            /* keep polling until the device has flushed the last posted WR */
            if (now_s() > deadline + DRAIN_TIMEOUT_S) break;
            continue;
        }
        if (got == 0) {
            double now = now_s();
            if (now > deadline) {
                timed_out = 1;
                break;
            }
            if (stall_s > 0 && posted > done &&
                now - last_progress > stall_s + (double)inflight / RK_STALL_FLOOR_BPS) {
                timed_out = 1;
                lost = RK_ST_STALLED;
                break;
            }
        }
    }
    if (timed_out) {
        mark(status, q->wr_first_op, done, posted, lost);
        mark(status, q->wr_first_op, posted, nwr, RK_ST_NOT_POSTED);
        if (!first_err) first_err = lost;
        rk_qp_force_error(q);
        /* Wait (bounded) for the flush of the last posted WR, so no WR still
         * references caller memory when we return. */
        double drain_end = now_s() + DRAIN_TIMEOUT_S;
        while (posted > done && now_s() < drain_end) {
            int got = ibv_poll_cq(q->cq, CQ_POLL_BATCH, wc);
            int fin = 0;
            for (int j = 0; j < got; j++)
                if ((uint32_t)wc[j].wr_id + 1 == posted) fin = 1;
            if (got < 0 || fin) break;
        }
    }
    uint32_t nfail = 0;
    for (uint32_t i = 0; i < n; i++)
        if (status[i] != RK_OK) nfail++;
    st->failed_ops = nfail;
    st->first_error = first_err;
    return (int)nfail;
}
