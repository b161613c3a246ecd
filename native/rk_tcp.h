/* rdmakv native TCP core: the per-block loop of the tcp transport.
 *
 * Moves a scatter-gather list of (address, length) ranges through a stream
 * socket with as few system calls as possible (sendmsg / readv of up to
 * RK_TCP_IOV_MAX ranges each), resuming after partial transfers. Plain libc
 * only (no libibverbs): it is built on every host, as rdmakv._native_tcp.
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
/* Bytes per system call when hashing: a range is hashed and moved within one
 * such window, so the second pass over it hits the CPU cache, not memory. */
#define RK_TCP_HASH_WINDOW 524288

/* Return codes. */
#define RK_TCP_OK 0
#define RK_TCP_TIMEOUT 1   /* no progress for timeout_ms */
#define RK_TCP_CLOSED 2    /* recv: the peer closed the connection mid-transfer */
#define RK_TCP_ERRNO 3     /* a system call failed; *err holds errno */
#define RK_TCP_EINTR 4     /* interrupted by a signal: *done bytes moved; call again
                              with skip = *done after Python ran its handlers */

/* iov: n pairs of uint64 (address, length). skip: bytes of the list already
 * moved (resume point). *done: bytes of the list moved on return (>= skip).
 * *err: errno for RK_TCP_ERRNO, else 0. */
int rk_tcp_sendv(int fd, const uint64_t *iov, size_t n, uint64_t skip, int timeout_ms,
                 uint64_t *done, int *err);
int rk_tcp_recvv(int fd, const uint64_t *iov, size_t n, uint64_t skip, int timeout_ms,
                 uint64_t *done, int *err);

/* A 64-bit hash of one range (the caller passes XXH3_64bits: the value
 * checksum of the wire protocol). */
typedef uint64_t (*rk_hash_fn)(const void *data, size_t len);

/* Like rk_tcp_sendv / rk_tcp_recvv, and also hashes[i] = hash(range i) for
 * every range: sendv hashes a range just before its first byte goes out,
 * recvv as soon as its last byte arrived, so the bytes are read from cache
 * (windows of at most RK_TCP_HASH_WINDOW bytes, at least one range).
 * *hashed: ranges hashed so far (in/out: 0 on the first call, kept across a
 * call resumed after RK_TCP_EINTR). On RK_TCP_OK, *hashed == n. */
int rk_tcp_sendv_hashed(int fd, const uint64_t *iov, size_t n, uint64_t skip, int timeout_ms,
                        rk_hash_fn hash, uint64_t *hashes, uint64_t *hashed,
                        uint64_t *done, int *err);
int rk_tcp_recvv_hashed(int fd, const uint64_t *iov, size_t n, uint64_t skip, int timeout_ms,
                        rk_hash_fn hash, uint64_t *hashes, uint64_t *hashed,
                        uint64_t *done, int *err);

#endif
