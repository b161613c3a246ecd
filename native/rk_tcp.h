/* rdmakv native TCP core: the per-block loop of the tcp transport.
 *
 * Moves a scatter-gather list of (address, length) ranges through a stream
 * socket (sendmsg / readv of up to RK_TCP_IOV_MAX ranges and RK_TCP_WINDOW
 * bytes each), resuming after partial transfers. Plain libc
 * only (no libibverbs): it is built on every host, in rdmakv._native.
 *
 * Waits are bounded the way a Python socket timeout bounds them: every wait
 * for the socket (poll after EAGAIN on a non-blocking fd) lasts at most
 * timeout_ms since the last byte moved; timeout_ms < 0 waits forever (a
 * blocking socket with no timeout). Called with the GIL released (cffi's
 * default for API-mode functions), so other Python threads keep running. */
#ifndef RK_TCP_H
#define RK_TCP_H
#include <stdint.h>
#include <stddef.h>

#define RK_TCP_IOV_MAX 1024
/* Bytes per system call at most (a longer range moves in pieces). Not the
 * fewest calls: in windows of this size each call's bytes are still in the
 * CPU cache when the kernel copies them on, which moved more over loopback
 * than whole lists of RK_TCP_IOV_MAX ranges per call. When hashing, a range
 * is hashed and moved within one window for the same reason.
 * The measurements behind this and the plans and spinning below are in
 * bench/README.md, section "Measurements moved from code comments (issue 58)". */
#define RK_TCP_WINDOW 524288
/* The plan of a send that hashes as it goes (rk_tcp_sendv_hashed): how many
 * bytes each sendmsg moves, and whether the hash reads each window before
 * sendmsg copies it (ahead) or right after. Either way one of the two reads
 * takes the bytes from memory and the other finds them in the CPU cache;
 * which order and which size cost the sending thread least depends on the
 * CPU. The plan is the process's, set once at start-up
 * (rk_tcp_set_hashed_send_plan: rdmakv.transport.tcp sets the default or the
 * configuration's tcp.send_plan, and `rdmakv doctor --tune` times the plans
 * on a host); nothing here measures or changes it while bytes move.
 * A send that does not hash, and a receive (which hashes the bytes it has
 * just written, still in cache), keep RK_TCP_WINDOW: unhashed, smaller
 * windows were slower. */

/* Return codes. */
#define RK_TCP_OK 0
#define RK_TCP_TIMEOUT 1   /* no progress for timeout_ms */
#define RK_TCP_CLOSED 2    /* recv: the peer closed the connection mid-transfer */
#define RK_TCP_ERRNO 3     /* a system call failed; *err holds errno */
#define RK_TCP_EINTR 4     /* interrupted by a signal: *done bytes moved; call again
                              with skip = *done after Python ran its handlers */

/* Receive spinning. A receive that finds no bytes waiting in the middle of
 * its list (the sender is still copying the rest in) first polls the socket
 * without sleeping, for up to rk_tcp_recv_spin_us() microseconds (and never
 * past its deadline), and only then sleeps in poll(). A sleeping receiver
 * must be woken by the sender's every segment, and in a VM the sender's
 * thread pays for each wake-up (an inter-processor interrupt); a receiver
 * that spins first spares the sender most of them, and puts over loopback
 * got faster (a range of budgets around the default did the same).
 * A receive spins only while this process has fewer receives in flight than
 * it may use CPUs (sched_getaffinity), so that a CPU stays free for the
 * sender, or for its other threads: two connections' receives spinning at
 * once on 2 CPUs took the CPU their senders needed, and with the rule they
 * sleep as before.
 * A signal that arrives while a receive spins is seen when the next sleeping
 * wait is interrupted, as one that arrives while bytes move: the call returns
 * RK_TCP_EINTR only from a sleeping wait. */
#define RK_TCP_RECV_SPIN_US 100      /* the default */
#define RK_TCP_RECV_SPIN_MAX_US 10000 /* the most rk_tcp_set_recv_spin_us takes */
/* 0, or -1 when us is outside [0, RK_TCP_RECV_SPIN_MAX_US]; 0 never spins. */
int rk_tcp_set_recv_spin_us(int64_t us);
int64_t rk_tcp_recv_spin_us(void);
/* The process's receive waits so far: *spun ended while spinning (the bytes
 * came), *slept went on to sleep in poll(), after spinning or without. */
void rk_tcp_recv_wait_counts(uint64_t *spun, uint64_t *slept);
/* Receives (rk_tcp_recvv, rk_tcp_recvv_hashed) running in this process now. */
int64_t rk_tcp_receives_in_flight(void);

/* iov: n pairs of uint64 (address, length). skip: bytes of the list already
 * moved (resume point). *done: bytes of the list moved on return (>= skip).
 * *err: errno for RK_TCP_ERRNO, else 0. */
int rk_tcp_sendv(int fd, const uint64_t *iov, size_t n, uint64_t skip, int timeout_ms,
                 uint64_t *done, int *err);
int rk_tcp_recvv(int fd, const uint64_t *iov, size_t n, uint64_t skip, int timeout_ms,
                 uint64_t *done, int *err);

/* The 64-bit hash the loop computes per range (the caller passes XXH3-64,
 * the wire protocol's value checksum): one-shot for a range that fits in a
 * window, streamed piece by piece for a longer one. */
typedef struct {
    uint64_t (*oneshot)(const void *data, size_t len);
    void *(*create_state)(void);
    int (*free_state)(void *state);
    int (*reset)(void *state);
    int (*update)(void *state, const void *data, size_t len);
    uint64_t (*digest)(const void *state);
} rk_hasher;

/* Like rk_tcp_sendv / rk_tcp_recvv, and also hashes[i] = hash(range i) for
 * every range, a window at a time, so that the hash and the kernel's copy
 * read each byte from memory only once between them: a receive hashes the
 * bytes each readv moved (RK_TCP_WINDOW at most) right after it wrote them,
 * from the CPU cache; a send moves rk_tcp_hashed_send_plan()'s window per
 * sendmsg and hashes it right before or right after the call (see above:
 * which is cheaper depends on the CPU). *hashed: ranges hashed so far (in/out:
 * 0 on the first call, kept across a call resumed after RK_TCP_EINTR, which
 * hashes a range it had started again from its first byte). On RK_TCP_OK,
 * *hashed == n.
 * A range of sendv may be hashes[] entries of ranges before it (the tcp
 * transport sends a COMMIT's checksums right behind their values in the same
 * call): such a range goes out only once every range before it has been
 * hashed, so it holds their final values. As a rule those ranges went out in
 * earlier system calls; when they and it fit one window, they are hashed just
 * before that window's sendmsg and it goes out with them (a small put's
 * frames then leave in one segment, and the node reads them in one wake-up,
 * not two). */
int rk_tcp_sendv_hashed(int fd, const uint64_t *iov, size_t n, uint64_t skip, int timeout_ms,
                        const rk_hasher *hasher, uint64_t *hashes, uint64_t *hashed,
                        uint64_t *done, int *err);
int rk_tcp_recvv_hashed(int fd, const uint64_t *iov, size_t n, uint64_t skip, int timeout_ms,
                        const rk_hasher *hasher, uint64_t *hashes, uint64_t *hashed,
                        uint64_t *done, int *err);

/* hashes[i] = hash(range i) for every range, nothing moved: the loop's hash
 * for bytes it does not move (an RDMA transport's reads and writes of the
 * slab). One call hashes a whole batch, with the GIL released, where
 * Python would make one call per value. */
void rk_tcp_hash_ranges(const rk_hasher *hasher, const uint64_t *iov, size_t n,
                        uint64_t *hashes);
/* The hashed-send plan in use: *window bytes per sendmsg, *ahead 1 when each
 * window is hashed before its sendmsg, 0 right after. Until one is set:
 * RK_TCP_WINDOW, hashed after. */
void rk_tcp_hashed_send_plan(uint64_t *window, int *ahead);

/* Set the plan of every hashed send that starts from now on: `bytes` (1 to
 * RK_TCP_WINDOW) per sendmsg, hashed ahead (`ahead` 1) or after (0). 0, or -1
 * (nothing changes) for a size or `ahead` out of range. */
int rk_tcp_set_hashed_send_plan(uint64_t bytes, int ahead);

/* Copy `len` bytes from src into the list's first bytes, range by range
 * (len <= the list's bytes): a frame's bulk that arrived with its header,
 * in the caller's read-ahead buffer, before the rest is received in place
 * (rk_tcp_recvv with skip = len). */
void rk_tcp_copy_in(const uint64_t *iov, size_t n, const void *src, uint64_t len);

/* A GET answer's entries, read for the tcp transport's fetch (the answer is
 * documented in rdmakv/protocol.py): m little-endian u32 value lengths (0:
 * the key missed), then m little-endian u64 checksums, at any alignment.
 * Key j's value goes to the slab block at base + slots[j] * block. Numpy
 * did this per answer in a dozen calls, a large share of a small get's
 * client CPU; these are one call each side of the receive (measured:
 * bench/README.md, "Measurements moved from code comments (issue 58)").
 *
 * rk_tcp_get_answer_layout: iov[i] = (address, length) of the i-th hit in key
 * order, hit[i] its key. Returns the number of hits; *total: their bytes.
 * Returns -1, with *bad the key, when a length exceeds `block`: nothing may
 * be received then (the bytes would overrun the block). */
int64_t rk_tcp_get_answer_layout(const uint8_t *entries, size_t m, const uint64_t *slots,
                                 uint64_t base, uint64_t block, uint64_t *iov, uint32_t *hit,
                                 uint64_t *total, size_t *bad);

/* Once the hits' bytes are in (got[i]: the hash of hit i's bytes):
 * sizes[j] = key j's length when its bytes match its checksum,
 * RK_TCP_MISSED when the key missed, RK_TCP_CORRUPT when they do not match
 * (a miss to the caller, never wrong KV). Returns the number of matches. */
#define RK_TCP_MISSED 0
#define RK_TCP_CORRUPT -1
size_t rk_tcp_get_answer_check(const uint8_t *entries, size_t m, const uint32_t *hit,
                               size_t hits, const uint64_t *got, int64_t *sizes);

#endif
