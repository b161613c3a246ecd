/* rdmakv native index: see rk_index.h. */
#include "rk_index.h"

#include <stdlib.h>
#include <string.h>

#define NO_LINK (-1)
#define INLINE_KEY 24 /* longer keys live on the heap */
#define BATCH 32      /* keys hashed and prefetched ahead of their lookups */

enum { REC_EMPTY, REC_PENDING, REC_COMMITTED };

/* One block's key: one cache line, so a cold hit reads the slot's line and
 * this one. state REC_EMPTY (key_len 0): the block holds no key. */
struct rec {
    uint64_t hash;
    union {
        struct {
            int32_t prev; /* committed: LRU, towards the oldest ... */
            int32_t next; /* ... and towards the newest */
        };
        uint64_t owner; /* pending (never in the LRU list): its session */
    };
    uint16_t key_len;
    uint8_t state;
    uint8_t written; /* pending: the node received every byte */
    uint8_t pad[4];
    uint8_t digest[RK_INDEX_DIGEST];
    union {
        uint8_t bytes[INLINE_KEY];
        uint8_t *heap;
    } key;
};

_Static_assert(sizeof(struct rec) == 64, "one cache line per record");

struct rk_index {
    uint32_t num_blocks;
    uint32_t count;   /* committed keys */
    uint32_t pending; /* pending keys */
    uint64_t seed;
    uint64_t mask;     /* slots - 1; slots is a power of two >= 2 num_blocks */
    uint64_t *slots;   /* (hash >> 32) << 32 | (block + 1); 0: empty */
    struct rec *recs;  /* per block, 64-byte aligned inside recs_mem */
    void *recs_mem;
    int32_t oldest, newest;
};

#define SLOT_BLOCK(s) ((uint32_t)(s) - 1)
#define TAG(h) ((h) >> 32)

static const uint8_t *key_of(const struct rec *r) {
    return r->key_len > INLINE_KEY ? r->key.heap : r->key.bytes;
}

/* 64-bit finaliser of MurmurHash3: every input bit reaches every output bit. */
static uint64_t fmix64(uint64_t h) {
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
}

/* Seeded, so a client cannot choose keys that collide in every node. */
static uint64_t hash_key(uint64_t seed, const uint8_t *p, size_t n) {
    uint64_t h = seed ^ ((uint64_t)n * 0x9e3779b97f4a7c15ULL);
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = (h ^ fmix64(w ^ seed)) * 0x9e3779b97f4a7c15ULL;
        h = (h << 31) | (h >> 33);
        p += 8;
        n -= 8;
    }
    if (n) {
        uint64_t w = 0;
        memcpy(&w, p, n);
        h ^= fmix64(w ^ seed ^ 0x5bd1e9955bd1e995ULL);
    }
    return fmix64(h);
}

rk_index *rk_index_new(uint32_t num_blocks, uint64_t seed) {
    if (num_blocks > INT32_MAX) return NULL; /* the LRU links are int32 */
    rk_index *ix = calloc(1, sizeof *ix);
    if (!ix) return NULL;
    uint64_t slots = 16;
    while (slots < 2 * (uint64_t)num_blocks) slots <<= 1;
    size_t nb = num_blocks ? num_blocks : 1;
    ix->num_blocks = num_blocks;
    ix->seed = seed;
    ix->mask = slots - 1;
    ix->oldest = ix->newest = NO_LINK;
    ix->slots = calloc(slots, sizeof *ix->slots);
    /* calloc, not aligned_alloc + memset: a large table's pages are then
     * zero-filled by the kernel as records are first written, not all at start
     * (64 bytes per pool block). Aligned by hand: a record never straddles lines. */
    ix->recs_mem = calloc(nb + 1, sizeof *ix->recs);
    ix->recs = ix->recs_mem ? (struct rec *)(((uintptr_t)ix->recs_mem + 63) & ~(uintptr_t)63) : NULL;
    if (!ix->slots || !ix->recs) {
        rk_index_free(ix);
        return NULL;
    }
    return ix;
}

void rk_index_free(rk_index *ix) {
    if (!ix) return;
    if (ix->recs)
        for (uint32_t b = 0; b < ix->num_blocks; b++)
            if (ix->recs[b].key_len > INLINE_KEY) free(ix->recs[b].key.heap);
    free(ix->slots);
    free(ix->recs_mem);
    free(ix);
}

uint32_t rk_index_count(const rk_index *ix) { return ix->count; }

uint32_t rk_index_pending_count(const rk_index *ix) { return ix->pending; }

/* The slot holding key, or the empty slot where the probe for it ended
 * (*found = 0). */
static uint64_t probe(const rk_index *ix, const uint8_t *key, size_t len, uint64_t h, int *found) {
    uint64_t i = h & ix->mask;
    for (;;) {
        uint64_t s = ix->slots[i];
        if (!s) break;
        if (TAG(s) == TAG(h)) {
            const struct rec *r = &ix->recs[SLOT_BLOCK(s)];
            if (r->hash == h && r->key_len == len && !memcmp(key_of(r), key, len)) {
                *found = 1;
                return i;
            }
        }
        i = (i + 1) & ix->mask;
    }
    *found = 0;
    return i;
}

static int64_t lookup_hashed(const rk_index *ix, const uint8_t *key, size_t len, uint64_t h,
                             uint64_t *slot) {
    if (len == 0 || len > RK_INDEX_MAX_KEY) return RK_INDEX_NONE;
    int found;
    uint64_t i = probe(ix, key, len, h, &found);
    if (!found) return RK_INDEX_NONE;
    if (slot) *slot = i;
    return (int64_t)SLOT_BLOCK(ix->slots[i]);
}

static int64_t lookup(const rk_index *ix, const uint8_t *key, size_t len, uint64_t *slot) {
    if (len == 0 || len > RK_INDEX_MAX_KEY) return RK_INDEX_NONE;
    return lookup_hashed(ix, key, len, hash_key(ix->seed, key, len), slot);
}

/* Up to BATCH keys of a call, each by its bytes, length and (or NULL) the
 * digest it must be stored with: whichever layout the call's keys come in. */
struct chunk {
    size_t n;
    const uint8_t *key[BATCH];
    uint32_t len[BATCH];
    const uint8_t *digest[BATCH];
    uint64_t hash[BATCH];
};

/* Keys [first, first + c->n) of a back-to-back batch; *at: where key `first`
 * starts (advanced past the chunk). */
static void chunk_of_keys(struct chunk *c, const uint8_t **at, const uint32_t *lens,
                          const uint8_t *digests, size_t first) {
    for (size_t k = 0; k < c->n; k++) {
        c->key[k] = *at;
        c->len[k] = lens[first + k];
        c->digest[k] = digests ? digests + (first + k) * RK_INDEX_DIGEST : NULL;
        *at += c->len[k];
    }
}

/* Look up a chunk's committed keys (a pending one is a miss): hash every key
 * and prefetch its home slot, then prefetch the record each home slot's tag
 * points at, then probe. A cold chunk waits
 * for its cache misses in parallel, not one by one. */
static void lookup_chunk(const rk_index *ix, struct chunk *c, int64_t *blocks) {
    for (size_t k = 0; k < c->n; k++) {
        uint32_t len = c->len[k];
        c->hash[k] = len && len <= RK_INDEX_MAX_KEY ? hash_key(ix->seed, c->key[k], len) : 0;
        __builtin_prefetch(&ix->slots[c->hash[k] & ix->mask]);
    }
    for (size_t k = 0; k < c->n; k++) {
        uint64_t s = ix->slots[c->hash[k] & ix->mask];
        if (s && TAG(s) == TAG(c->hash[k])) __builtin_prefetch(&ix->recs[SLOT_BLOCK(s)]);
    }
    for (size_t k = 0; k < c->n; k++) {
        int64_t b = lookup_hashed(ix, c->key[k], c->len[k], c->hash[k], NULL);
        blocks[k] = b != RK_INDEX_NONE && ix->recs[b].state == REC_COMMITTED ? b : RK_INDEX_NONE;
    }
}

static void unlink_block(rk_index *ix, uint32_t b) {
    int32_t p = ix->recs[b].prev, n = ix->recs[b].next;
    if (p == NO_LINK) ix->oldest = n; else ix->recs[p].next = n;
    if (n == NO_LINK) ix->newest = p; else ix->recs[n].prev = p;
}

static void link_newest(rk_index *ix, uint32_t b) {
    ix->recs[b].prev = ix->newest;
    ix->recs[b].next = NO_LINK;
    if (ix->newest == NO_LINK) ix->oldest = (int32_t)b; else ix->recs[ix->newest].next = (int32_t)b;
    ix->newest = (int32_t)b;
}

/* Empty slot i, moving later entries of its probe run back so that every
 * entry stays reachable from its home slot (no tombstones). */
static void clear_slot(rk_index *ix, uint64_t i) {
    uint64_t j = i;
    for (;;) {
        j = (j + 1) & ix->mask;
        uint64_t s = ix->slots[j];
        if (!s) break;
        uint64_t home = ix->recs[SLOT_BLOCK(s)].hash & ix->mask;
        /* the entry at j may move to i unless its home lies cyclically in (i, j] */
        int stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
        if (stays) continue;
        ix->slots[i] = s;
        i = j;
    }
    ix->slots[i] = 0;
}

/* Forget the key (committed or pending) that block b holds, at slot. */
static void drop(rk_index *ix, uint64_t slot, uint32_t b) {
    struct rec *r = &ix->recs[b];
    clear_slot(ix, slot);
    if (r->state == REC_COMMITTED) {
        unlink_block(ix, b);
        ix->count--;
    } else {
        ix->pending--;
    }
    if (r->key_len > INLINE_KEY) free(r->key.heap);
    memset(r, 0, sizeof *r);
}

/* The slot of the key block b holds (it holds one). */
static uint64_t slot_of(const rk_index *ix, uint32_t b) {
    const struct rec *r = &ix->recs[b];
    uint64_t slot = 0;
    lookup_hashed(ix, key_of(r), r->key_len, r->hash, &slot);
    return slot;
}

void rk_index_find(const rk_index *ix, const uint8_t *keys, const uint32_t *lens, size_t n,
                   int64_t *blocks) {
    struct chunk c;
    for (size_t i = 0; i < n; i += c.n) {
        c.n = n - i < BATCH ? n - i : BATCH;
        chunk_of_keys(&c, &keys, lens, NULL, i);
        lookup_chunk(ix, &c, blocks + i);
    }
}

/* Look up a chunk; the hits (with the digest, where the chunk names one)
 * become the most recently used, in order; the others are misses. */
static size_t touch_chunk(rk_index *ix, struct chunk *c, int64_t *blocks) {
    size_t hits = 0;
    lookup_chunk(ix, c, blocks);
    for (size_t k = 0; k < c->n; k++) {
        int64_t b = blocks[k];
        if (b == RK_INDEX_NONE) continue;
        if (c->digest[k] && memcmp(ix->recs[b].digest, c->digest[k], RK_INDEX_DIGEST)) {
            blocks[k] = RK_INDEX_NONE;
            continue;
        }
        if (ix->newest != (int32_t)b) {
            unlink_block(ix, (uint32_t)b);
            link_newest(ix, (uint32_t)b);
        }
        hits++;
    }
    return hits;
}

size_t rk_index_touch(rk_index *ix, const uint8_t *keys, const uint32_t *lens, size_t n,
                      const uint8_t *digests, int64_t *blocks) {
    struct chunk c;
    size_t hits = 0;
    for (size_t i = 0; i < n; i += c.n) {
        c.n = n - i < BATCH ? n - i : BATCH;
        chunk_of_keys(&c, &keys, lens, digests, i);
        hits += touch_chunk(ix, &c, blocks + i);
    }
    return hits;
}

/* Records [first, first + c->n) of a request: each the key's length, the key
 * and, `with_digest`, its digest (GET: rk_index_touch_records), else nothing
 * more (rk_index_touch_key_records). */
static void chunk_of_records(struct chunk *c, const uint8_t *records, uint32_t key_len,
                             int with_digest, size_t first) {
    const size_t stride = RK_INDEX_RECORD_HEAD + key_len + (with_digest ? RK_INDEX_DIGEST : 0);
    for (size_t k = 0; k < c->n; k++) {
        const uint8_t *rec = records + (first + k) * stride;
        c->key[k] = rec + RK_INDEX_RECORD_HEAD;
        c->len[k] = key_len;
        c->digest[k] = with_digest ? rec + RK_INDEX_RECORD_HEAD + key_len : NULL;
    }
}

static size_t touch_records(rk_index *ix, const uint8_t *records, size_t n, uint32_t key_len,
                            int with_digest, int64_t *blocks) {
    struct chunk c;
    size_t hits = 0;
    for (size_t i = 0; i < n; i += c.n) {
        c.n = n - i < BATCH ? n - i : BATCH;
        chunk_of_records(&c, records, key_len, with_digest, i);
        hits += touch_chunk(ix, &c, blocks + i);
    }
    return hits;
}

size_t rk_index_touch_records(rk_index *ix, const uint8_t *records, size_t n, uint32_t key_len,
                              int64_t *blocks) {
    return touch_records(ix, records, n, key_len, 1, blocks);
}

size_t rk_index_touch_key_records(rk_index *ix, const uint8_t *records, size_t n,
                                  uint32_t key_len, int64_t *blocks) {
    return touch_records(ix, records, n, key_len, 0, blocks);
}

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "GET's answer is written in the host's byte order, which must be little-endian"
#endif

size_t rk_index_get_records(rk_index *ix, const uint8_t *records, size_t n, uint32_t key_len,
                            const uint32_t *lengths, const uint64_t *sums, int32_t *refs,
                            uint64_t base, uint64_t block_size, uint8_t *answer_lengths,
                            uint8_t *answer_sums, uint64_t *iov, uint32_t *hit_blocks,
                            uint64_t *nbytes) {
    struct chunk c;
    int64_t blocks[BATCH];
    size_t hits = 0;
    uint64_t total = 0;
    for (size_t i = 0; i < n; i += c.n) {
        c.n = n - i < BATCH ? n - i : BATCH;
        chunk_of_records(&c, records, key_len, 1, i);
        touch_chunk(ix, &c, blocks);
        for (size_t k = 0; k < c.n; k++) {
            uint32_t len = 0;
            uint64_t sum = 0;
            int64_t b = blocks[k];
            if (b != RK_INDEX_NONE) {
                len = lengths[b];
                sum = sums[b];
                refs[b]++;
                iov[2 * hits] = base + (uint64_t)b * block_size;
                iov[2 * hits + 1] = len;
                hit_blocks[hits++] = (uint32_t)b;
                total += len;
            }
            /* the answer's columns are packed: their entries need not be aligned */
            memcpy(answer_lengths + 4 * (i + k), &len, 4);
            memcpy(answer_sums + 8 * (i + k), &sum, 8);
        }
    }
    *nbytes = total;
    return hits;
}

size_t rk_index_unpin(int32_t *refs, const uint32_t *blocks, size_t n, uint32_t *last) {
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (refs[blocks[i]] > 1) refs[blocks[i]]--;
        else last[k++] = blocks[i];
    }
    return k;
}

/* The least recently used committed block from *cursor on whose only
 * reference is the index's, forgotten; *cursor moves past it. RK_INDEX_NONE
 * when there is none. Within one call the blocks skipped stay referenced (no
 * reference is dropped under the store's lock meanwhile) and the LRU list only
 * loses blocks, so the walk resumes where it stopped. */
static int64_t evict(rk_index *ix, const int32_t *refs, int32_t *cursor) {
    while (*cursor != NO_LINK) {
        uint32_t b = (uint32_t)*cursor;
        *cursor = ix->recs[b].next;
        if (refs[b] == 1) {
            drop(ix, slot_of(ix, b), b);
            return b;
        }
    }
    return RK_INDEX_NONE;
}

/* One reserve call's state: its spares, where eviction resumes, what it evicted. */
struct reserving {
    rk_index *ix;
    uint64_t owner, max_size;
    const uint32_t *spare;
    size_t nspare, used;
    const int32_t *refs;
    uint32_t *lengths;
    int32_t cursor;
    uint64_t evicted, evicted_bytes;
};

/* -1 - j for the first spare j out of range or holding a key, else 0. */
static int64_t check_spares(const rk_index *ix, const uint32_t *spare, size_t nspare) {
    for (size_t j = 0; j < nspare; j++)
        if (spare[j] >= ix->num_blocks || ix->recs[spare[j]].state != REC_EMPTY)
            return -1 - (int64_t)j;
    return 0;
}

/* Reserve one item (rk_index_reserve); its status, *block its block or NONE. */
static uint8_t reserve_item(struct reserving *rv, const uint8_t *key, size_t len, uint64_t size,
                            const uint8_t *digest, int64_t *block) {
    rk_index *ix = rv->ix;
    *block = RK_INDEX_NONE;
    if (size == 0 || size > rv->max_size || len == 0 || len > RK_INDEX_MAX_KEY)
        return RK_INDEX_TOO_LARGE;
    uint64_t h = hash_key(ix->seed, key, len);
    int found;
    uint64_t slot = probe(ix, key, len, h, &found);
    if (found)
        return ix->recs[SLOT_BLOCK(ix->slots[slot])].state == REC_COMMITTED ? RK_INDEX_EXISTS
                                                                            : RK_INDEX_BUSY;
    uint8_t *copy = NULL;
    if (len > INLINE_KEY && !(copy = malloc(len))) return RK_INDEX_NO_SPACE;
    int64_t b;
    if (rv->used < rv->nspare) {
        b = rv->spare[rv->used++];
    } else {
        b = evict(ix, rv->refs, &rv->cursor);
        if (b == RK_INDEX_NONE) {
            free(copy);
            return RK_INDEX_NO_SPACE;
        }
        rv->evicted++;
        rv->evicted_bytes += rv->lengths[b];
        /* the eviction emptied a slot: this key's probe may now end sooner */
        slot = probe(ix, key, len, h, &found);
    }
    struct rec *r = &ix->recs[b];
    if (copy) {
        memcpy(copy, key, len);
        r->key.heap = copy;
    } else {
        memcpy(r->key.bytes, key, len);
    }
    r->key_len = (uint16_t)len;
    r->hash = h;
    r->state = REC_PENDING;
    r->written = 0;
    r->owner = rv->owner;
    memcpy(r->digest, digest, RK_INDEX_DIGEST);
    ix->slots[slot] = (TAG(h) << 32) | (uint64_t)(b + 1);
    ix->pending++;
    rv->lengths[b] = (uint32_t)size;
    *block = b;
    return RK_INDEX_RESERVED;
}

int64_t rk_index_reserve(rk_index *ix, const uint8_t *keys, const uint32_t *lens, size_t n,
                         const uint64_t *sizes, const uint8_t *digests, uint32_t max_size,
                         uint64_t owner, const uint32_t *spare, size_t nspare,
                         const int32_t *refs, uint32_t *lengths, uint8_t *status,
                         int64_t *blocks, uint64_t *evicted, uint64_t *evicted_bytes) {
    int64_t bad = check_spares(ix, spare, nspare);
    if (bad) return bad;
    struct reserving rv = {ix, owner, max_size, spare, nspare, 0, refs, lengths, ix->oldest, 0, 0};
    for (size_t i = 0; i < n; keys += lens[i], i++)
        status[i] = reserve_item(&rv, keys, lens[i], sizes[i], digests + i * RK_INDEX_DIGEST,
                                 &blocks[i]);
    *evicted = rv.evicted;
    *evicted_bytes = rv.evicted_bytes;
    return (int64_t)rv.used;
}

int64_t rk_index_reserve_records(rk_index *ix, const uint8_t *records, size_t n,
                                 uint32_t key_len, uint32_t max_size, uint64_t owner,
                                 const uint32_t *spare, size_t nspare, const int32_t *refs,
                                 uint32_t *lengths, uint8_t *status, int64_t *blocks,
                                 uint64_t *evicted, uint64_t *evicted_bytes) {
    int64_t bad = check_spares(ix, spare, nspare);
    if (bad) return bad;
    struct reserving rv = {ix, owner, max_size, spare, nspare, 0, refs, lengths, ix->oldest, 0, 0};
    const size_t stride = RK_INDEX_RECORD_HEAD + key_len + RK_INDEX_SIZE_BYTES + RK_INDEX_DIGEST;
    for (size_t i = 0; i < n; i++, records += stride) {
        const uint8_t *key = records + RK_INDEX_RECORD_HEAD;
        uint32_t size;
        memcpy(&size, key + key_len, RK_INDEX_SIZE_BYTES); /* little-endian, as checked */
        status[i] = reserve_item(&rv, key, key_len, size, key + key_len + RK_INDEX_SIZE_BYTES,
                                 &blocks[i]);
    }
    *evicted = rv.evicted;
    *evicted_bytes = rv.evicted_bytes;
    return (int64_t)rv.used;
}

/* The block of owner's pending key, and its slot; RK_INDEX_NONE for another. */
static int64_t owned(const rk_index *ix, const uint8_t *key, size_t len, uint64_t owner,
                     uint64_t *slot) {
    int64_t b = lookup(ix, key, len, slot);
    if (b == RK_INDEX_NONE) return b;
    const struct rec *r = &ix->recs[b];
    return r->state == REC_PENDING && r->owner == owner ? b : RK_INDEX_NONE;
}

size_t rk_index_commit(rk_index *ix, const uint8_t *keys, const uint32_t *lens, size_t n,
                       uint64_t owner, int require_written, const uint64_t *checksums,
                       const uint32_t *lengths, uint64_t *sums, int64_t *blocks,
                       uint64_t *bytes, uint64_t *one_sided) {
    size_t done = 0;
    *bytes = *one_sided = 0;
    for (size_t i = 0; i < n; keys += lens[i], i++) {
        int64_t b = owned(ix, keys, lens[i], owner, NULL);
        if (b != RK_INDEX_NONE && require_written && !ix->recs[b].written) b = RK_INDEX_NONE;
        blocks[i] = b;
        if (b == RK_INDEX_NONE) continue;
        struct rec *r = &ix->recs[b];
        if (!r->written) *one_sided += lengths[b];
        *bytes += lengths[b];
        sums[b] = checksums[i];
        r->state = REC_COMMITTED;
        r->written = 0;
        link_newest(ix, (uint32_t)b); /* the links overwrite the owner */
        ix->pending--;
        ix->count++;
        done++;
    }
    return done;
}

size_t rk_index_abort(rk_index *ix, const uint8_t *keys, const uint32_t *lens, size_t n,
                      uint64_t owner, int64_t *blocks) {
    size_t done = 0;
    for (size_t i = 0; i < n; keys += lens[i], i++) {
        uint64_t slot = 0;
        int64_t b = owned(ix, keys, lens[i], owner, &slot);
        blocks[i] = b;
        if (b == RK_INDEX_NONE) continue;
        drop(ix, slot, (uint32_t)b);
        done++;
    }
    return done;
}

size_t rk_index_pending_blocks(rk_index *ix, uint64_t owner, int drop_them, uint32_t *out,
                               size_t max) {
    size_t k = 0;
    for (uint32_t b = 0; b < ix->num_blocks && k < max; b++) {
        const struct rec *r = &ix->recs[b];
        if (r->state != REC_PENDING || (owner && r->owner != owner)) continue;
        out[k++] = b;
        if (drop_them) drop(ix, slot_of(ix, b), b);
    }
    return k;
}

int rk_index_is_pending(const rk_index *ix, uint32_t block, uint64_t owner) {
    return block < ix->num_blocks && ix->recs[block].state == REC_PENDING &&
           ix->recs[block].owner == owner;
}

void rk_index_mark_written(rk_index *ix, const uint32_t *blocks, size_t n, uint64_t owner) {
    for (size_t i = 0; i < n; i++)
        if (rk_index_is_pending(ix, blocks[i], owner)) ix->recs[blocks[i]].written = 1;
}

int rk_index_digests(const rk_index *ix, const int64_t *blocks, size_t n, uint8_t *out) {
    for (size_t i = 0; i < n; i++, out += RK_INDEX_DIGEST) {
        int64_t b = blocks[i];
        if (b == RK_INDEX_NONE) {
            memset(out, 0, RK_INDEX_DIGEST);
            continue;
        }
        if (b < 0 || (uint64_t)b >= ix->num_blocks || ix->recs[b].state != REC_COMMITTED)
            return -1;
        memcpy(out, ix->recs[b].digest, RK_INDEX_DIGEST);
    }
    return 0;
}

void rk_index_remove(rk_index *ix, const uint8_t *keys, const uint32_t *lens, size_t n,
                     int64_t *blocks) {
    for (size_t i = 0; i < n; keys += lens[i], i++) {
        uint64_t slot = 0;
        int64_t b = lookup(ix, keys, lens[i], &slot);
        if (b != RK_INDEX_NONE && ix->recs[b].state != REC_COMMITTED) b = RK_INDEX_NONE;
        if (b != RK_INDEX_NONE) drop(ix, slot, (uint32_t)b);
        blocks[i] = b;
    }
}

int rk_index_remove_block(rk_index *ix, uint32_t block) {
    if (block >= ix->num_blocks || ix->recs[block].state != REC_COMMITTED) return -1;
    const struct rec *r = &ix->recs[block];
    uint64_t slot = 0;
    int64_t b = lookup_hashed(ix, key_of(r), r->key_len, r->hash, &slot);
    if (b != (int64_t)block) return -1; /* unreachable while the table is consistent */
    drop(ix, slot, block);
    return 0;
}

size_t rk_index_oldest(const rk_index *ix, int64_t after, size_t max, uint32_t *out) {
    int32_t b;
    if (after < 0) b = ix->oldest;
    else if ((uint64_t)after < ix->num_blocks && ix->recs[after].state == REC_COMMITTED)
        b = ix->recs[after].next;
    else return 0;
    size_t k = 0;
    for (; b != NO_LINK && k < max; b = ix->recs[b].next) out[k++] = (uint32_t)b;
    return k;
}

size_t rk_index_key(const rk_index *ix, uint32_t block, uint8_t *out) {
    if (block >= ix->num_blocks || ix->recs[block].state != REC_COMMITTED) return 0;
    memcpy(out, key_of(&ix->recs[block]), ix->recs[block].key_len);
    return ix->recs[block].key_len;
}
