/* The `recall` archive's C twins: a call's write (`archive_tokens`), a one-token step's pass 1 from the page
 * bounds on (`archive_choose`), and an answer step's pass 1 under a lead head (`archive_lead_choose`).
 *
 * `archive_tokens` is `PageArchive.write` (h2o_cli/cache/recall/store.py) of a step's token or a chunk's tokens,
 * one after the other, bit for bit.
 * `archive_choose` is `PageArchive.choose_one` from the page bounds on and the read-back into the recall slots
 * (`RecallLayer._read_back`): the candidates (archived tokens not in S), the pages that hold one ranked by
 * bound then age, the first `recall` candidates in reading order put into the recall slots, and the hits. A hit's
 * K/V move inside the slots and only the others are read from the archive, so a step touches just the archive
 * pages that are new to the slots (a file archive's pages fault in, and are released, only for those); a hit that
 * stays in its slot (an answer step choosing what the one before chose) is not copied at all.
 * `archive_lead_choose` is `LeadRanking.choose` (h2o_cli/cache/recall/lead.py) from the lead's ranking on, with
 * the same read-back.
 * Its result is the torch path's exactly: the bounds come from torch (`best_page_bound`) and the rest is
 * integer work. float32 archive (in RAM or a mapped file); the cache side (h2o_cli/cache/recall/c_step.py) checks that.
 */
#include "step_common.h"

/* Move the k largest keys of a[0..n) into a[0..k) (any order): quickselect. */
static void select_top(Pair *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        int64_t i, j;
        partition_desc(a, lo, hi, &i, &j);
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else break;
    }
}

/* `order_key` of h2o_cli/cache/recall/scores.py for one page: the bound's bits made monotone in its value (-0.0 first
 * made +0.0) in the high 32 bits, minus the page's first token index in the low ones. */
static inline int64_t order_key(float bound, int64_t page_start) {
    const float positive_zero = bound + 0.0f;
    int32_t bits;
    __builtin_memcpy(&bits, &positive_zero, sizeof bits);
    const int64_t ordered = bits < 0 ? (int64_t)(bits ^ 0x7FFFFFFF) : (int64_t)bits;
    return ordered * 4294967296LL - page_start;
}

/* `PageArchive.write` of one token: archive one token's K/V (unrotated) at ring slot `token % capacity`; a token
 * that starts a page first empties its ring page (token indices -1; the summaries of its blocks high -inf, low
 * +inf); the per-channel max and min of the token's block take the key (`torch.maximum`/`minimum`: a NaN wins).
 * Head g's key and value are at `new_key + g * stride` and `new_value + g * stride`. */
static void archive_one(
    int64_t n_kv, int64_t head_dim, int64_t capacity, int64_t page_size, int64_t block_size, int64_t token,
    const float *restrict new_key, const float *restrict new_value, int64_t stride,
    int64_t *restrict archive_index, float *restrict archive_keys, float *restrict archive_values,
    float *restrict summary)
{
    const int64_t slot = token % capacity, page = slot / page_size, blocks = capacity / block_size;
    const int64_t block = slot / block_size, per_page = page_size / block_size;
    if (token % page_size == 0) {
        for (int64_t o = 0; o < page_size; o++) archive_index[page * page_size + o] = -1;
        for (int64_t g = 0; g < n_kv; g++) {
            for (int64_t b = page * per_page; b < (page + 1) * per_page; b++) {
                float *restrict bounds = summary + (g * blocks + b) * 2 * head_dim;
                for (int64_t i = 0; i < head_dim; i++) {
                    bounds[i] = -INFINITY;
                    bounds[head_dim + i] = INFINITY;
                }
            }
        }
    }
    for (int64_t g = 0; g < n_kv; g++) {
        const float *restrict k = new_key + g * stride;
        __builtin_memcpy(archive_keys + (g * capacity + slot) * head_dim, k, head_dim * sizeof(float));
        __builtin_memcpy(archive_values + (g * capacity + slot) * head_dim, new_value + g * stride,
                         head_dim * sizeof(float));
        float *restrict high = summary + (g * blocks + block) * 2 * head_dim, *restrict low = high + head_dim;
        for (int64_t i = 0; i < head_dim; i++) {
            high[i] = (k[i] > high[i] || k[i] != k[i]) ? k[i] : high[i];
            low[i] = (k[i] < low[i] || k[i] != k[i]) ? k[i] : low[i];
        }
    }
    archive_index[slot] = token;
}

/* `count` tokens from `first` on, in order (a step's one token, or a chunk's `PageArchive.write` token by token:
 * the same ring, K/V and summaries as the torch write's pieces, since min and max are exact): keys and values
 * [n_kv, count, head_dim]. */
void archive_tokens(
    int64_t n_kv, int64_t head_dim, int64_t count, int64_t capacity, int64_t page_size, int64_t block_size,
    int64_t first,
    const float *restrict new_keys, const float *restrict new_values,         /* [n_kv, count, head_dim] */
    int64_t *restrict archive_index, float *restrict archive_keys, float *restrict archive_values,
    float *restrict summary)
{
    for (int64_t t = 0; t < count; t++)
        archive_one(n_kv, head_dim, capacity, page_size, block_size, first + t, new_keys + t * head_dim,
                    new_values + t * head_dim, count * head_dim, archive_index, archive_keys, archive_values,
                    summary);
}

/* Mark (`to` = 1) or unmark (0) one head's archived ring slots that hold its resident tokens or the step's own
 * `new_token`: `blocked[slot]` becomes `to`, and `marked[page]` counts a page's marked slots (unmarking sets it
 * back to 0). Only slots whose mark changes count, so a token listed twice counts once. */
static void mark_resident(
    uint8_t to, int64_t new_token, const int64_t *restrict token_index, const uint8_t *restrict valid,
    int64_t active, int64_t capacity, int64_t page_size, int64_t span, const int64_t *restrict archive_index,
    uint8_t *restrict blocked, int64_t *restrict marked)
{
    for (int64_t s = -1; s < active; s++) {
        if (s >= 0 && !valid[s]) continue;
        const int64_t t = s < 0 ? new_token : token_index[s], at = t % capacity;
        if (at < span && archive_index[at] == t && blocked[at] != to) {
            blocked[at] = to;
            marked[at / page_size] = to ? marked[at / page_size] + 1 : 0;
        }
    }
}

/* Fill head g's recall slots with the candidates (archived slots not `blocked`) of ring pages `page[0]`,
 * `page[stride]`, ... (`top` of them) in that order, oldest first inside a page, the first `recall` of them: a
 * hit's K/V (a token the slots held before) move inside the slots (or stay, when its slot is the same), the others
 * are read from the archive; the slots past them are zero with index -1 (as they were past the ones filled before,
 * which come first). Returns the hits; *count is how many slots hold a token. */
static int64_t fill_recall(
    int64_t g, int64_t head_dim, int64_t capacity, int64_t page_size, const int64_t *restrict archive_index,
    const float *restrict archive_keys, const float *restrict archive_values, const uint8_t *restrict blocked,
    const int64_t *restrict page, int64_t stride, int64_t top, int64_t recall, float *restrict recall_keys,
    float *restrict recall_values, int64_t *restrict recall_index, int64_t *restrict previous,
    int64_t *restrict chosen, float *restrict moved, int64_t *restrict count_out)
{
    int64_t *held = recall_index + g * recall;
    float *restrict head_keys = recall_keys + g * recall * head_dim;
    float *restrict head_values = recall_values + g * recall * head_dim;
    const int64_t size = head_dim * (int64_t)sizeof(float);
    int64_t hits = 0, count = 0, before = 0;
    /* previous[ring slot] = the recall slot that holds its token (-1: none) */
    for (int64_t i = 0; i < recall; i++)
        if (held[i] >= 0) {
            previous[held[i] % capacity] = i;
            before = i + 1;
        }
    /* chosen[i]: the ring slot of slot i's token; -1 - it where the token stays in slot i (nothing to move) */
    for (int64_t rank = 0; rank < top && count < recall; rank++)
        for (int64_t o = 0; o < page_size && count < recall; o++) {
            const int64_t s = page[rank * stride] * page_size + o;
            if (archive_index[s] < 0 || blocked[s]) continue;
            /* a hit: the recall slot's K/V are this token's (the archive's own numbers); else read them */
            const int64_t from = previous[s];
            const int hit = from >= 0 && held[from] == archive_index[s];
            hits += hit;
            if (hit && from == count) {
                chosen[count++] = -1 - s;
                continue;
            }
            float *restrict k = moved + count * head_dim, *restrict v = moved + (recall + count) * head_dim;
            if (hit) {
                __builtin_memcpy(k, head_keys + from * head_dim, size);
                __builtin_memcpy(v, head_values + from * head_dim, size);
            } else {
                __builtin_memcpy(k, archive_keys + (g * capacity + s) * head_dim, size);
                __builtin_memcpy(v, archive_values + (g * capacity + s) * head_dim, size);
            }
            chosen[count++] = s;
        }
    for (int64_t i = 0; i < recall; i++)
        if (held[i] >= 0) previous[held[i] % capacity] = -1;
    for (int64_t i = 0; i < count; i++)  /* every slot is read above before any is written here */
        if (chosen[i] >= 0) {
            __builtin_memcpy(head_keys + i * head_dim, moved + i * head_dim, size);
            __builtin_memcpy(head_values + i * head_dim, moved + (recall + i) * head_dim, size);
        }
    for (int64_t i = count * head_dim; i < before * head_dim; i++) head_keys[i] = head_values[i] = 0.0f;
    for (int64_t i = 0; i < recall; i++)
        held[i] = i < count ? archive_index[chosen[i] >= 0 ? chosen[i] : -1 - chosen[i]] : -1;
    *count_out = count;
    return hits;
}

/* Returns the hits summed over heads (chosen tokens that the recall slots held before); counts[g] is how many
 * recall slots of head g now hold a token (they come first; the rest are zero with index -1).
 * The archived tokens per page are counted once for all heads; a head then marks its resident tokens (and the
 * step's own) and ranks the pages holding more archived tokens than marked ones, so past that count a head's
 * work grows with its pages, S and the recall slots, not with the archive's tokens. */
int64_t archive_choose(
    int64_t n_kv, int64_t head_dim, int64_t slots, int64_t active,
    const int64_t *restrict token_index, const uint8_t *restrict valid, /* S: [n_kv, slots] */
    int64_t new_token,  /* the step's token: archived, and resident once the step writes it */
    int64_t capacity, int64_t page_size, int64_t used, /* ring slots, page size, pages written so far */
    const int64_t *restrict archive_index,                                    /* [capacity], -1 = empty */
    const float *restrict archive_keys, const float *restrict archive_values, /* [n_kv, capacity, head_dim] */
    const float *restrict bound,                                              /* [n_kv, used] */
    int64_t recall,
    float *restrict recall_keys, float *restrict recall_values, /* [n_kv, recall, head_dim] */
    int64_t *restrict recall_index,                              /* [n_kv, recall], -1 = empty */
    uint8_t *restrict blocked,   /* [capacity] scratch: 0 everywhere between calls */
    int64_t *restrict previous,  /* [capacity] scratch: -1 everywhere between calls */
    Pair *restrict pages,        /* [used] scratch */
    int64_t *restrict chosen,    /* [recall] scratch */
    float *restrict moved,       /* [2, recall, head_dim] scratch */
    int64_t *restrict per_page,  /* [2, capacity / page_size] scratch: the second half 0 between calls */
    int64_t *restrict counts,    /* [n_kv] */
    int64_t *restrict totals)    /* [2]: recall slots filled over all heads, and the most of one head */
{
    const int64_t span = used * page_size;
    int64_t *restrict archived = per_page, *restrict marked = per_page + capacity / page_size;
    int64_t hits = 0;
    totals[0] = totals[1] = 0;
    for (int64_t p = 0; p < used; p++) {
        int64_t n = 0;
        for (int64_t o = 0; o < page_size; o++) n += archive_index[p * page_size + o] >= 0;
        archived[p] = n;
    }
    for (int64_t g = 0; g < n_kv; g++) {
        /* blocked: archived ring slots whose token is in S or the step's own; the rest are candidates */
        mark_resident(1, new_token, token_index + g * slots, valid + g * slots, active, capacity, page_size, span,
                      archive_index, blocked, marked);
        int64_t ranked = 0;
        for (int64_t p = 0; p < used; p++)
            if (archived[p] > marked[p])
                pages[ranked++] = (Pair){order_key(bound[g * used + p], archive_index[p * page_size]), p};
        /* every such page holds a candidate: the first `recall` pages in rank order hold all we take */
        const int64_t top = ranked < recall ? ranked : recall;
        if (top < ranked) select_top(pages, ranked, top);
        sort_desc(pages, top);
        int64_t count;
        hits += fill_recall(g, head_dim, capacity, page_size, archive_index, archive_keys, archive_values, blocked,
                            &pages[0].item, 2, top, recall, recall_keys, recall_values, recall_index, previous,
                            chosen, moved, &count);
        mark_resident(0, new_token, token_index + g * slots, valid + g * slots, active, capacity, page_size, span,
                      archive_index, blocked, marked); /* S and the archive are unchanged since: the same slots */
        counts[g] = count;
        totals[0] += count;
        if (count > totals[1]) totals[1] = count;
    }
    return hits;
}

/* Pass 1 of a one-token step under a lead head (`LeadRanking.choose`, h2o_cli/cache/recall/lead.py) with the read
 * into the recall slots as `archive_choose` reads. `ranked` [n_ranked]: the lead's ring pages with a written first
 * slot and a positive score, best first (the ranking every layer shares, made once per lead score). A candidate of
 * head g is an archived token older than `new_token` (the step's own, archived) not in g's S. The first
 * `lead_pages` ranked pages below `used` that hold a candidate of some head are taken, and each head's recall slots
 * are filled with its candidates of them in that order. Returns the hits; counts and totals as archive_choose's. */
int64_t archive_lead_choose(
    int64_t n_kv, int64_t head_dim, int64_t slots, int64_t active,
    const int64_t *restrict token_index, const uint8_t *restrict valid, /* S: [n_kv, slots] */
    int64_t new_token, int64_t capacity, int64_t page_size, int64_t used,
    const int64_t *restrict archive_index,                                    /* [capacity], -1 = empty */
    const float *restrict archive_keys, const float *restrict archive_values, /* [n_kv, capacity, head_dim] */
    const int64_t *restrict ranked, int64_t n_ranked, int64_t lead_pages,
    int64_t recall,
    float *restrict recall_keys, float *restrict recall_values, /* [n_kv, recall, head_dim] */
    int64_t *restrict recall_index,                              /* [n_kv, recall], -1 = empty */
    uint8_t *restrict held_by,   /* [capacity] scratch, 0 between calls: the heads whose S holds the slot's token */
    uint8_t *restrict blocked,   /* [capacity] scratch: 0 everywhere between calls */
    int64_t *restrict previous,  /* [capacity] scratch: -1 everywhere between calls */
    int64_t *restrict taken,     /* [lead_pages] scratch */
    int64_t *restrict chosen,    /* [recall] scratch */
    float *restrict moved,       /* [2, recall, head_dim] scratch */
    int64_t *restrict marked,    /* [capacity / page_size] scratch: 0 between calls */
    int64_t *restrict counts,    /* [n_kv] */
    int64_t *restrict totals)    /* [2]: recall slots filled over all heads, and the most of one head */
{
    const int64_t span = used * page_size;
    int64_t hits = 0, pages = 0;
    totals[0] = totals[1] = 0;
    /* held_by: how many heads hold each archived slot's token in S (n_kv <= 255: the caller checks) */
    for (int64_t g = 0; g < n_kv; g++)
        for (int64_t s = 0; s < active; s++) {
            if (!valid[g * slots + s]) continue;
            const int64_t t = token_index[g * slots + s], at = t % capacity;
            if (at < span && archive_index[at] == t) held_by[at]++;
        }
    for (int64_t r = 0; r < n_ranked && pages < lead_pages; r++) {
        const int64_t p = ranked[r];
        if (p >= used) continue;
        int64_t some = 0;
        for (int64_t o = 0; o < page_size && !some; o++) {
            const int64_t s = p * page_size + o, t = archive_index[s];
            some = t >= 0 && t < new_token && held_by[s] < n_kv;
        }
        if (some) taken[pages++] = p;
    }
    for (int64_t g = 0; g < n_kv; g++)
        for (int64_t s = 0; s < active; s++)
            if (valid[g * slots + s]) {
                const int64_t at = token_index[g * slots + s] % capacity;
                if (at < span) held_by[at] = 0;
            }
    for (int64_t g = 0; g < n_kv; g++) {
        mark_resident(1, new_token, token_index + g * slots, valid + g * slots, active, capacity, page_size, span,
                      archive_index, blocked, marked);
        int64_t count;
        hits += fill_recall(g, head_dim, capacity, page_size, archive_index, archive_keys, archive_values, blocked,
                            taken, 1, pages, recall, recall_keys, recall_values, recall_index, previous, chosen,
                            moved, &count);
        mark_resident(0, new_token, token_index + g * slots, valid + g * slots, active, capacity, page_size, span,
                      archive_index, blocked, marked);
        counts[g] = count;
        totals[0] += count;
        if (count > totals[1]) totals[1] = count;
    }
    return hits;
}

typedef float lanes16 __attribute__((vector_size(64)));

/* An answer step's shortlist keys are held in half precision (docs/spec.md: its page mass is taken over keys
 * rounded to it), which halves the bytes a step reads. A compiler without _Float16 (before GCC 12, clang 15)
 * builds no step scores: `archive_held_bytes` says 0 and the caller scores in torch. widen16: 16 held values as
 * floats, into `out` (F16C's vector conversion where there is one: compilers convert _Float16 vectors one
 * element at a time). */
#if defined(__FLT16_MAX__)
typedef _Float16 held_t;
#define HELD_BYTES 2
#else
typedef float held_t; /* never called: archive_held_bytes says 0 */
#define HELD_BYTES 0
#endif
#if defined(__FLT16_MAX__) && defined(__F16C__)
#include <immintrin.h>
static inline __attribute__((always_inline)) void widen16(const held_t *restrict p, lanes16 *restrict out) {
#if defined(__AVX512F__)
    const __m512 all = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    __builtin_memcpy(out, &all, sizeof all);
#else
    const __m256 low = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    const __m256 high = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
    __builtin_memcpy(out, &low, sizeof low);
    __builtin_memcpy((char *)out + sizeof low, &high, sizeof high);
#endif
}
#else
static inline __attribute__((always_inline)) void widen16(const held_t *restrict p, lanes16 *restrict out) {
    for (int o = 0; o < 16; o++) (*out)[o] = (float)p[o];
}
#endif

/* Bytes of one held key element: 2 (half precision), or 0 where this build has no step scores. */
int64_t archive_held_bytes(void) { return HELD_BYTES; }

/* A key as held: clamped to half precision's finite range (±65504, so none becomes inf), rounded to nearest even. */
static inline held_t to_held(float x) {
    return (held_t)(x > 65504.0f ? 65504.0f : x < -65504.0f ? -65504.0f : x);
}

/* Logits of `nq` (1-4) queries over one held page of 16 tokens, kept transposed ([head_dim, 16]: a channel's 16
 * values side by side), so each channel is one widening load and a multiply-add per query over the page's
 * tokens. rows: the queries' logit rows (stride `width`). `nq` is a constant where it is inlined. */
static inline __attribute__((always_inline)) void page_logits16(
    int nq, const held_t *restrict page, const float *restrict queries, int64_t head_dim, float *restrict rows,
    int64_t width)
{
    lanes16 acc[4] = {{0}};
    for (int64_t d = 0; d < head_dim; d++) {
        lanes16 k;
        widen16(page + d * 16, &k);
        for (int i = 0; i < nq; i++) acc[i] += queries[i * head_dim + d] * k;
    }
    for (int i = 0; i < nq; i++) __builtin_memcpy(rows + i * width, &acc[i], sizeof acc[i]);
}

/* q·k of a float query and a held key of `n` elements. */
static inline float held_dot(const float *restrict q, const held_t *restrict k, int64_t n) {
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < n; i++) total += q[i] * (float)k[i];
    return total;
}

/* The page scores a one-token step ranks by when scores are carried and a shortlist is scored
 * (`PageArchive.bounds` on a one-token step with `attention`, `carry` and a `shortlist`; with no more pages
 * written than it, every written page is scored):
 * per KV head, `last` = the carried score of each written ring page that still holds the page it was scored on
 * (else 0); the `shortlist` pages `order_key(last)` ranks best; the attention mass of the `group` queries over
 * those pages' keys (each query's softmax over all their tokens, `scale` times q·k, the mean over the queries);
 * a page's score = its mass (0 outside the shortlist) + `carry` * `last`, written to `bound` and carried.
 *
 * The shortlist's keys are held between calls in `held_keys` in half precision (`to_held`; the mass is over
 * them), one page per column in no particular order (the mass does not depend on it; a page of 16 tokens is
 * held transposed, [head_dim, 16]): a column is read from the archive when its page enters the shortlist or
 * was written since the keys were last brought up to date (`*held_at`, archive tokens then; -1: nothing held),
 * so a step reads just the pages that changed. Differs from torch only in float rounding (the sums' order). */
void archive_step_scores(
    int64_t n_kv, int64_t group, int64_t head_dim, int64_t capacity, int64_t page_size,
    int64_t used, int64_t shortlist, float carry, float scale, int64_t tokens,
    const float *restrict query,                                        /* [n_kv, group, head_dim] unscaled */
    const int64_t *restrict archive_index, const float *restrict archive_keys,
    float *restrict carried, int64_t *restrict carried_start,           /* [n_kv, ring pages], [ring pages] */
    int64_t *restrict held_pages,   /* [n_kv, shortlist]: the ring page whose keys each column holds, -1 = none */
    int64_t *restrict held_column,  /* [n_kv, ring pages]: the column holding a page's keys, -1 = none */
    int64_t *restrict held_at,      /* [1] */
    held_t *restrict held_keys,     /* [n_kv, shortlist * page_size, head_dim] */
    Pair *restrict ranked,          /* [used] scratch */
    uint8_t *restrict wanted,       /* [ring pages] scratch, 0 between calls */
    float *restrict logits,         /* [group, shortlist * page_size] scratch */
    float *restrict scaled,         /* [group * head_dim + shortlist] scratch */
    float *restrict bound)          /* [n_kv, used] out */
{
    const int64_t ring = capacity / page_size, width = shortlist * page_size, page_floats = page_size * head_dim;
    /* the pages written since the held keys were brought up to date (all of them after a reset or a wrap) */
    const int64_t since = *held_at;
    const int fresh = since < 0 || since > tokens || tokens - since >= capacity;
    const int64_t first = fresh ? 0 : since / page_size, last_written = tokens > 0 ? (tokens - 1) / page_size : -1;
    for (int64_t g = 0; g < n_kv; g++) {
        int64_t *restrict pages_of = held_pages + g * shortlist, *restrict column_of = held_column + g * ring;
        if (fresh) {
            for (int64_t c = 0; c < shortlist; c++) pages_of[c] = -1;
            for (int64_t p = 0; p < ring; p++) column_of[p] = -1;
        } else {
            for (int64_t t = first; t <= last_written; t++) { /* stale: read again if still wanted */
                const int64_t p = t % ring, c = column_of[p];
                if (c >= 0) pages_of[c] = column_of[p] = -1;
            }
        }
        float *restrict out = bound + g * used;
        for (int64_t p = 0; p < used; p++) {
            const int64_t start = archive_index[p * page_size];
            const float last = start >= 0 && carried_start[p] == start ? carried[g * ring + p] : 0.0f;
            out[p] = last;
            ranked[p] = (Pair){start >= 0 ? order_key(last, start) : INT64_MIN, p};
        }
        const int64_t scored = shortlist < used ? shortlist : used;
        if (scored < used) select_top(ranked, used, scored);
        for (int64_t i = 0; i < scored; i++) wanted[ranked[i].item] = 1;
        for (int64_t c = 0; c < shortlist; c++)
            if (pages_of[c] >= 0 && !wanted[pages_of[c]]) column_of[pages_of[c]] = -1, pages_of[c] = -1;
        int64_t free_column = 0;
        for (int64_t i = 0; i < scored; i++) {
            const int64_t p = ranked[i].item;
            wanted[p] = 0;
            if (column_of[p] >= 0) continue;
            while (pages_of[free_column] >= 0) free_column++;
            pages_of[free_column] = p, column_of[p] = free_column;
            held_t *restrict to = held_keys + (g * shortlist + free_column) * page_floats;
            const float *restrict from = archive_keys + (g * capacity + p * page_size) * head_dim;
            if (page_size == 16) /* transposed, for page_logits16 */
                for (int64_t o = 0; o < 16; o++)
                    for (int64_t d = 0; d < head_dim; d++) to[d * 16 + o] = to_held(from[o * head_dim + d]);
            else
                for (int64_t i = 0; i < page_floats; i++) to[i] = to_held(from[i]);
        }
        /* the mass: logits [group, width] (an empty ring slot: -inf), one softmax per query, summed per column */
        for (int64_t i = 0; i < group * head_dim; i++) scaled[i] = query[g * group * head_dim + i] * scale;
        for (int64_t c = 0; c < shortlist; c++) {
            const int64_t p = pages_of[c];
            const held_t *restrict keys = held_keys + (g * shortlist + c) * page_floats;
            float *restrict rows = logits + c * page_size;
            if (p < 0) { /* a column left empty (fewer pages written than the shortlist): no mass */
                for (int64_t i = 0; i < group; i++)
                    for (int64_t o = 0; o < page_size; o++) rows[i * width + o] = -INFINITY;
                continue;
            }
            if (page_size == 16) {
                if (c + 4 < shortlist) /* the page four columns on (2 KiB at head_dim 64): ask for it now */
                    for (int64_t b = 0; b < page_floats * (int64_t)sizeof(held_t); b += 64)
                        __builtin_prefetch((const char *)(keys + 4 * page_floats) + b);
                for (int64_t i = 0; i < group; i += 4) {
                    const float *restrict queries = scaled + i * head_dim;
                    switch (group - i < 4 ? group - i : 4) {
                        case 4: page_logits16(4, keys, queries, head_dim, rows + i * width, width); break;
                        case 3: page_logits16(3, keys, queries, head_dim, rows + i * width, width); break;
                        case 2: page_logits16(2, keys, queries, head_dim, rows + i * width, width); break;
                        default: page_logits16(1, keys, queries, head_dim, rows + i * width, width);
                    }
                }
            } else {
                for (int64_t o = 0; o < page_size; o++)
                    for (int64_t i = 0; i < group; i++)
                        rows[i * width + o] = held_dot(scaled + i * head_dim, keys + o * head_dim, head_dim);
            }
            for (int64_t o = 0; o < page_size; o++)
                if (archive_index[p * page_size + o] < 0)
                    for (int64_t i = 0; i < group; i++) rows[i * width + o] = -INFINITY;
        }
        float *restrict column_mass = scaled + group * head_dim;
        for (int64_t c = 0; c < shortlist; c++) column_mass[c] = 0.0f;
        for (int64_t i = 0; i < group; i++) {
            float *restrict row = logits + i * width;
            float top = -INFINITY;
#pragma omp simd reduction(max : top)
            for (int64_t t = 0; t < width; t++) top = row[t] > top ? row[t] : top;
            if (top == -INFINITY) continue; /* nothing written in the shortlist: no mass */
#pragma omp simd
            for (int64_t t = 0; t < width; t++) row[t] = exp_nonpositive(row[t] - top);
            const float total = sum(row, width);
            for (int64_t c = 0; c < shortlist; c++) column_mass[c] += sum(row + c * page_size, page_size) / total;
        }
        for (int64_t c = 0; c < shortlist; c++) {
            const int64_t p = pages_of[c];
            if (p >= 0) out[p] = column_mass[c] / (float)group + carry * out[p];
        }
        for (int64_t p = 0; p < used; p++) {
            if (column_of[p] < 0) out[p] = carry * out[p];
            carried[g * ring + p] = out[p];
        }
    }
    for (int64_t p = 0; p < used; p++) carried_start[p] = archive_index[p * page_size];
    *held_at = tokens;
}
