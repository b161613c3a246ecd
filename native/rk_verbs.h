/* rdmakv native verbs core: the part of the RDMA data path where per-WR
 * Python cost would show (building and posting WR chains, polling CQs).
 *
 * Ownership: an rk_ctx owns one device context and ONE protection domain;
 * memory regions and queue pairs hang off it and must be destroyed before it.
 * An rk_qp owns its CQ. rk_qp_run is not reentrant per QP: the Python side
 * serialises jobs on a QP (one worker thread per peer). */
#ifndef RK_VERBS_H
#define RK_VERBS_H
#include <stdint.h>
#include <stddef.h>

#define RK_ERRLEN 256

/* Per-op status codes returned by rk_qp_run (>= 0 and < 64 are ibv_wc_status
 * values from the device; these are ours). */
#define RK_OK 0
#define RK_ST_TIMEOUT 1001      /* op was in flight when the job deadline passed */
#define RK_ST_NOT_POSTED 1002   /* op never reached the device (QP already failed) */
#define RK_ST_POST_FAILED 1003  /* ibv_post_send refused the WR */
#define RK_ST_FLUSHED 1004      /* flushed because an earlier WR on the QP failed */
#define RK_ST_STALLED 1005      /* in flight while the QP gave no completion for stall_s */

#define RK_OP_WRITE 0
#define RK_OP_READ 1

typedef struct rk_ctx rk_ctx;
typedef struct rk_qp rk_qp;
typedef struct rk_mr rk_mr;
typedef struct rk_mw rk_mw;

typedef struct {
    uint32_t max_sge;
    uint32_t max_qp_wr;
    uint32_t max_qp_rd_atom;
    uint32_t max_cqe;
    uint64_t max_mr_size;
    uint32_t port_state;    /* enum ibv_port_state: 4 = ACTIVE */
    uint32_t active_mtu;    /* enum ibv_mtu: 1=256 .. 5=4096 */
    uint32_t max_msg_sz;
    uint32_t lid;
    uint32_t link_layer;    /* 1 = InfiniBand, 2 = Ethernet */
    uint32_t gid_tbl_len;
    uint32_t phys_port_cnt;
} rk_attrs;

typedef struct {
    uint64_t local_offset;  /* into the registered local region */
    uint64_t remote_addr;   /* absolute address inside the remote region */
    uint64_t length;
    uint64_t rkey;          /* this op's remote key (e.g. a memory window's); 0: the job's rkey */
} rk_op;

typedef struct {
    uint32_t wrs;           /* work requests posted in the job */
    uint32_t sges;          /* scatter/gather entries across those WRs */
    uint32_t post_calls;    /* ibv_post_send calls (chains) */
    uint32_t signaled;      /* WRs posted with IBV_SEND_SIGNALED */
    uint32_t polls;         /* ibv_poll_cq calls that returned >= 1 completion */
    uint32_t max_outstanding;
    int32_t first_error;    /* first failing status (0 if none) */
    uint32_t failed_ops;
} rk_stats;

typedef struct {
    uint32_t qpn;
    uint32_t psn;
} rk_qp_info;

typedef struct {
    uint32_t qpn;
    uint32_t psn;
    uint32_t lid;
    uint32_t mtu;           /* enum ibv_mtu of the remote port */
    uint8_t gid[16];
} rk_remote;

int rk_device_names(char *buf, size_t buflen);
rk_ctx *rk_open(const char *device, int port, char *err);
void rk_close(rk_ctx *c);
int rk_query(rk_ctx *c, rk_attrs *out, char *err);
int rk_query_gid(rk_ctx *c, int index, uint8_t *gid16, char *err);
uint64_t rk_pd_handle(rk_ctx *c);

/* remote: 0 = local access only, 1 = remote read+write through the MR's rkey,
 * 2 = no remote access through the MR itself, only through memory windows
 * bound to it (IBV_ACCESS_MW_BIND). */
rk_mr *rk_reg_mr(rk_ctx *c, uint64_t addr, uint64_t length, int remote, char *err);
uint32_t rk_mr_lkey(rk_mr *m);
uint32_t rk_mr_rkey(rk_mr *m);
int rk_dereg_mr(rk_mr *m);
uint64_t rk_reg_count(rk_ctx *c);

rk_qp *rk_qp_create(rk_ctx *c, uint32_t max_wr, uint32_t max_sge, uint32_t max_rd_atom,
                    char *err);
int rk_qp_info_get(rk_qp *q, rk_qp_info *out);
int rk_qp_connect(rk_qp *q, const rk_remote *r, int gid_index, int use_grh, uint32_t timeout,
                  uint32_t retry_cnt, uint32_t rnr_retry, char *err);
int rk_qp_reset(rk_qp *q, char *err);
int rk_qp_state(rk_qp *q);
int rk_qp_force_error(rk_qp *q);
void rk_qp_destroy(rk_qp *q);

/* Memory windows (type 2): allocated from the context's PD, bound to ONE QP by
 * a BIND_MW work request on that QP (the only QP whose peer may use the rkey),
 * revoked by rk_mw_dealloc (works whatever the QP's state). Every window bound
 * on a QP must be deallocated before the QP is destroyed (rxe blocks ~50 s
 * in ibv_destroy_qp otherwise). Binding uses the QP's send queue and CQ: the
 * caller serialises it with rk_qp_run on the same QP. */
int rk_mw_supported(rk_ctx *c);  /* 1 when the device reports type-2 windows */
rk_mw *rk_mw_alloc(rk_ctx *c, char *err);
uint32_t rk_mw_rkey(rk_mw *w);
int rk_mw_dealloc(rk_mw *w);
/* Bind mws[i] over [addrs[i], addrs[i]+lens[i]) of mr (remote read if
 * access & 1, remote write if access & 2). Returns the number of failures;
 * status[i] is the completion status of bind i (0 = bound). */
int rk_qp_bind_mws(rk_qp *q, rk_mr *mr, rk_mw **mws, const uint64_t *addrs,
                   const uint64_t *lens, int access, uint32_t n, int32_t *status,
                   double timeout_s);

/* stall_s > 0: when WRs are outstanding and the CQ yields nothing for
 * stall_s seconds plus the time their bytes take at RK_STALL_FLOOR_BPS, the
 * QP is taken for stalled (a device that keeps its own retry contract
 * completes or fails every WR well within that): it is forced to ERROR and
 * the ops in flight get RK_ST_STALLED, the rest RK_ST_NOT_POSTED, so that the
 * caller can reset the QP and move them again. */
#define RK_STALL_FLOOR_BPS 8000000  /* bytes/s; soft-RoCE in the CI VM moves ~60 MB/s per QP */
int rk_qp_run(rk_qp *q, int opcode, uint64_t local_base, uint32_t lkey, uint32_t rkey,
              const rk_op *ops, uint32_t n, int32_t *status, uint32_t sge_limit,
              uint32_t signal_every, uint64_t max_inflight_bytes, double timeout_s,
              double stall_s, rk_stats *stats);
#endif
