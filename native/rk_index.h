/* rdmakv native index: the node's committed keys, key -> pool block, in LRU
 * order, with each block's token digest.
 *
 * What :class:`rdmakv.node.index.Index` keeps in an OrderedDict, kept in C:
 * an open-addressing hash table (linear probing, at most half full, deletion
 * by backward shift, so no tombstones) whose slots hold a block number and a
 * tag of its key's hash, and per block one 64-byte record: the key (inline up
 * to 24 bytes, else on the heap), its hash, its digest and its links in a
 * doubly linked LRU list. A cold hit reads two cache lines, and a batch
 * prefetches them for 32 keys at a time. Every call takes a whole batch (a
 * GET's keys), so a batch costs one crossing from Python, not one per key.
 *
 * Invariants: a block holds at most one key and a key at most one block;
 * rk_index_insert refuses (per key, nothing changed) a key already present, a
 * block already holding a key, and a block out of range. The caller (the
 * store) serialises calls with its lock; the functions run with the GIL
 * released. Plain libc only: built on every host, as rdmakv._native_index.
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

/* rk_index_insert per-key status */
#define RK_INDEX_OK 0
#define RK_INDEX_EXISTS 1    /* the key is already in the index */
#define RK_INDEX_BUSY 2      /* the block already holds a key */
#define RK_INDEX_BAD_BLOCK 3 /* block >= num_blocks */
#define RK_INDEX_BAD_KEY 4   /* length 0 or over RK_INDEX_MAX_KEY */
#define RK_INDEX_NOMEM 5

typedef struct rk_index rk_index;

/* An empty index over blocks [0, num_blocks); seed keys the hash (pass a
 * random one: keys come from clients). NULL when out of memory. */
rk_index *rk_index_new(uint32_t num_blocks, uint64_t seed);
void rk_index_free(rk_index *ix);
uint32_t rk_index_count(const rk_index *ix);

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

/* Add key i -> blocks[i] with digest i as the most recently used, in key
 * order; status[i] says whether it was (RK_INDEX_OK) or why not. */
void rk_index_insert(rk_index *ix, const uint8_t *keys, const uint32_t *lens, size_t n,
                     const uint32_t *blocks, const uint8_t *digests, uint8_t *status);

/* Remove each key; blocks[i]: the block it held, or RK_INDEX_NONE (absent, or
 * named earlier in the batch). */
void rk_index_remove(rk_index *ix, const uint8_t *keys, const uint32_t *lens, size_t n,
                     int64_t *blocks);

/* Remove the key block holds; 0, or -1 when it holds none. */
int rk_index_remove_block(rk_index *ix, uint32_t block);

/* Up to max blocks in LRU order, oldest first, starting after block `after`
 * (-1: from the oldest). Returns how many were written. */
size_t rk_index_oldest(const rk_index *ix, int64_t after, size_t max, uint32_t *out);

/* The key block holds: its length (0: none), copied to out (RK_INDEX_MAX_KEY bytes). */
size_t rk_index_key(const rk_index *ix, uint32_t block, uint8_t *out);

#endif
