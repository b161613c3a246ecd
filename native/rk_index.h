/* rdmakv native index: the node's keys, key -> pool block, each with its
 * token digest: the committed ones in LRU order, and the uncommitted ones
 * (reserved by a PUT or ALLOC, not yet committed) with the session that owns
 * each.
 *
 * What :class:`rdmakv.node.index.Index` keeps in an OrderedDict and a dict
 * of pending entries, kept in C:
 * an open-addressing hash table (linear probing, at most half full, deletion
 * by backward shift, so no tombstones) whose slots hold a block number and a
 * tag of its key's hash, and per block one 64-byte record: the key (inline up
 * to 24 bytes, else on the heap), its hash, its digest and its links in a
 * doubly linked LRU list. A cold hit reads two cache lines, and a batch
 * prefetches them for 32 keys at a time. Every call takes a whole batch (a
 * GET's keys), so a batch costs one crossing from Python, not one per key.
 *
 * Invariants: a block holds at most one key and a key at most one block,
 * committed or pending. Only committed keys are found by lookups, counted by
 * rk_index_count and kept in the LRU list; a pending one is seen only by its
 * owner's calls (commit, abort, write checks) and by reserve, which refuses
 * its key to everyone else. Reserving takes blocks the caller hands over
 * (spare) and, once they run out, evicts the least recently used committed
 * key whose block nobody else references; the index reads the pool's
 * refcounts for that and never changes them (the evicted block's one
 * reference passes to the new pending key). The caller (the store)
 * serialises calls with its lock; the functions run with the GIL released.
 * Plain libc only: built on every host, in rdmakv._native.
 *
 * A batch of n keys comes as their bytes back to back (keys) and per key its
 * length (lens); a length outside 1..RK_INDEX_MAX_KEY names no key (never
 * found). Digests, where a call takes them, come back to back too, 16 bytes
 * per key. */
#ifndef RK_INDEX_H
#define RK_INDEX_H
#include <stdint.h>
#include <stddef.h>

#define RK_INDEX_MAX_KEY 512
#define RK_INDEX_DIGEST 16
#define RK_INDEX_NONE -1 /* a miss, in the block lists calls fill */

typedef struct rk_index rk_index;

/* An empty index over blocks [0, num_blocks); seed keys the hash (pass a
 * random one: keys come from clients). NULL when out of memory. */
rk_index *rk_index_new(uint32_t num_blocks, uint64_t seed);
void rk_index_free(rk_index *ix);
uint32_t rk_index_count(const rk_index *ix); /* committed keys */

/* blocks[i]: key i's block, or RK_INDEX_NONE; the LRU order is unchanged. */
void rk_index_find(const rk_index *ix, const uint8_t *keys, const uint32_t *lens, size_t n,
                   int64_t *blocks);

/* Like rk_index_find, but a hit becomes the most recently used (in key
 * order); with digests != NULL (per key the digest it must be stored with) a
 * key stored with another digest is a miss and is not touched. Returns the
 * hits. */
size_t rk_index_touch(rk_index *ix, const uint8_t *keys, const uint32_t *lens, size_t n,
                      const uint8_t *digests, int64_t *blocks);

/* rk_index_touch of a GET request's items where they lie: n records of
 * RK_INDEX_RECORD_HEAD bytes (the key's length, which the caller checked is
 * key_len for every record), the key, and its digest: GET in rdmakv/protocol.py. */
#define RK_INDEX_RECORD_HEAD 2
size_t rk_index_touch_records(rk_index *ix, const uint8_t *records, size_t n, uint32_t key_len,
                              int64_t *blocks);

/* rk_index_touch (no digests) of a keys-only request's items where they lie:
 * n records of RK_INDEX_RECORD_HEAD bytes (the key's length, key_len for
 * every record) and the key: EXISTS in rdmakv/protocol.py. */
size_t rk_index_touch_key_records(rk_index *ix, const uint8_t *records, size_t n,
                                  uint32_t key_len, int64_t *blocks);

/* A GET served in one call: rk_index_touch_records, then its answer written
 * as it goes on the wire. Per record i, answer_lengths + 4 i and
 * answer_sums + 8 i (little-endian u32 and u64, GET's answer in
 * rdmakv/protocol.py) get the hit's value length and checksum from the
 * per-block columns lengths and sums, or 0 and 0 for a miss. Per hit, in
 * record order: one reference taken on its block (refs[block] += 1, for the
 * caller to drop once the bytes are sent; an index entry's block is live),
 * its (base + block * block_size, length) as the next row of iov, its block
 * in hit_blocks. Returns the hits; *nbytes: the sum of their lengths. */
size_t rk_index_get_records(rk_index *ix, const uint8_t *records, size_t n, uint32_t key_len,
                            const uint32_t *lengths, const uint64_t *sums, int32_t *refs,
                            uint64_t base, uint64_t block_size, uint8_t *answer_lengths,
                            uint8_t *answer_sums, uint64_t *iov, uint32_t *hit_blocks,
                            uint64_t *nbytes);

/* Give back the references rk_index_get_records took on blocks[0..n): each
 * one that is not its block's last is dropped here; each last one is left
 * for the caller, whose free list it concerns, and written to last[].
 * Returns how many were. */
size_t rk_index_unpin(int32_t *refs, const uint32_t *blocks, size_t n, uint32_t *last);

/* A PUT's or ALLOC's reservation, item by item in order, of key i (sizes[i]
 * bytes, digest i) for session owner (> 0). status[i] is the wire's
 * AllocStatus: RK_INDEX_TOO_LARGE for a size outside 1..max_size (or a key
 * length outside 1..RK_INDEX_MAX_KEY),
 * RK_INDEX_EXISTS for a committed key, RK_INDEX_BUSY for a pending one (any
 * owner's), RK_INDEX_NO_SPACE when no block is left, else RK_INDEX_RESERVED:
 * the key is pending in blocks[i] (RK_INDEX_NONE for the others), whose
 * lengths[] row is set to its size. Its block is the next of spare[0..nspare)
 * or, once they are used up, that of the least recently used committed key
 * whose refs[] is 1 (only the index holds it), which is evicted; *evicted and
 * *evicted_bytes count those. A long key whose copy cannot be allocated is
 * RK_INDEX_NO_SPACE too. An item sees what the items before it did (one
 * may evict a key named later). Returns the spares used, or -1 - j when
 * spare[j] is out of range or holds a key (nothing changed then). */
#define RK_INDEX_RESERVED 0
#define RK_INDEX_EXISTS 1
#define RK_INDEX_BUSY 2
#define RK_INDEX_NO_SPACE 3
#define RK_INDEX_TOO_LARGE 4
int64_t rk_index_reserve(rk_index *ix, const uint8_t *keys, const uint32_t *lens, size_t n,
                         const uint64_t *sizes, const uint8_t *digests, uint32_t max_size,
                         uint64_t owner, const uint32_t *spare, size_t nspare,
                         const int32_t *refs, uint32_t *lengths, uint8_t *status,
                         int64_t *blocks, uint64_t *evicted, uint64_t *evicted_bytes);

/* rk_index_reserve of a PUT's or ALLOC's items where they lie: n records of
 * RK_INDEX_RECORD_HEAD bytes (the key's length, which the caller checked is
 * key_len for every record), the key, its size (RK_INDEX_SIZE_BYTES,
 * little-endian) and its digest: ALLOC in rdmakv/protocol.py. */
#define RK_INDEX_SIZE_BYTES 4
int64_t rk_index_reserve_records(rk_index *ix, const uint8_t *records, size_t n,
                                 uint32_t key_len, uint32_t max_size, uint64_t owner,
                                 const uint32_t *spare, size_t nspare, const int32_t *refs,
                                 uint32_t *lengths, uint8_t *status, int64_t *blocks,
                                 uint64_t *evicted, uint64_t *evicted_bytes);

/* Commit owner's pending key i, with checksum i in sums[] at its block: it
 * becomes the most recently used (in key order). With require_written, only
 * one marked written (rk_index_mark_written). blocks[i]: its block, or
 * RK_INDEX_NONE (not owner's pending key, not written, or named earlier in the
 * batch). *bytes: the committed values' lengths[], *one_sided: those of the
 * ones not marked written. Returns how many were committed. */
size_t rk_index_commit(rk_index *ix, const uint8_t *keys, const uint32_t *lens, size_t n,
                       uint64_t owner, int require_written, const uint64_t *checksums,
                       const uint32_t *lengths, uint64_t *sums, int64_t *blocks,
                       uint64_t *bytes, uint64_t *one_sided);

/* Forget owner's pending key i; blocks[i]: its block (for the caller to
 * free) or RK_INDEX_NONE. Returns how many were forgotten. */
size_t rk_index_abort(rk_index *ix, const uint8_t *keys, const uint32_t *lens, size_t n,
                      uint64_t owner, int64_t *blocks);

/* Up to max blocks of owner's pending keys (owner 0: anyone's) into out;
 * with drop, those keys are forgotten too (a session that ended). Returns
 * how many were written. A scan of every block: not on a hot path. */
size_t rk_index_pending_blocks(rk_index *ix, uint64_t owner, int drop, uint32_t *out,
                               size_t max);
uint32_t rk_index_pending_count(const rk_index *ix);

/* Whether block holds a pending key of owner. */
int rk_index_is_pending(const rk_index *ix, uint32_t block, uint64_t owner);

/* Mark the pending keys of owner in blocks[0..n) written: the node received
 * every byte (others are left alone: a block that is no longer owner's). */
void rk_index_mark_written(rk_index *ix, const uint32_t *blocks, size_t n, uint64_t owner);

/* The digest of each committed block into out + 16 i (zeros for
 * RK_INDEX_NONE); returns 0, or -1 when a block holds no committed key. */
int rk_index_digests(const rk_index *ix, const int64_t *blocks, size_t n, uint8_t *out);

/* Remove each committed key; blocks[i]: the block it held, or RK_INDEX_NONE
 * (absent, pending, or named earlier in the batch). */
void rk_index_remove(rk_index *ix, const uint8_t *keys, const uint32_t *lens, size_t n,
                     int64_t *blocks);

/* Remove the committed key block holds; 0, or -1 when it holds none. */
int rk_index_remove_block(rk_index *ix, uint32_t block);

/* Up to max blocks in LRU order, oldest first, starting after block `after`
 * (-1: from the oldest). Returns how many were written. */
size_t rk_index_oldest(const rk_index *ix, int64_t after, size_t max, uint32_t *out);

/* The key block holds: its length (0: none), copied to out (RK_INDEX_MAX_KEY bytes). */
size_t rk_index_key(const rk_index *ix, uint32_t block, uint8_t *out);

#endif
