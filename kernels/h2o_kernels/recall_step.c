/* The `recall` policy's one-token decode step on the CPU: a C call for the archive write (`update`), then two
 * per layer around torch's page bounds and query matrix.
 *
 * `recall_choose` is `PageArchive.choose_one` from the page bounds on (h2o_cli/cache/recall/archive.py) and
 * `RecallLayer._read_all`: the candidates (archived tokens not in S), the pages that hold one ranked by
 * bound then age, the first `recall` candidates in reading order copied into the recall slots, and the hits.
 * Its result is the torch path's exactly: the bounds come from torch (`best_page_bound`) and the rest is
 * integer work. `recall_decode_step` is `h2o_decode_step` over S ∪ R: the new token written into S, one
 * softmax over S and the recalled entries at rolling positions (ranks of E_q by token index, as
 * `rolling_step_positions`) or token indices, S's scores accumulated, one entry of S evicted. With no recall
 * slots (`recall` 0, the R pointers and `order` NULL, `entries` = length + 1) it is `h2o_decode_step`, which
 * calls it so.
 * float32 archive in RAM and a full S only; h2o_kernels/native.py checks that and keeps the counters.
 */
#include "step_common.h"

typedef struct {
    int64_t key, item;
} Pair;

static inline void swap_pairs(Pair *a, Pair *b) {
    const Pair t = *a;
    *a = *b;
    *b = t;
}

/* Hoare's partition of a[lo..hi] around a median of three, larger keys first: afterwards a[lo..*j] >= the
 * pivot >= a[*i..hi], and the pairs between equal it. */
static void partition_desc(Pair *a, int64_t lo, int64_t hi, int64_t *i_out, int64_t *j_out) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (a[mid].key > a[lo].key) swap_pairs(&a[mid], &a[lo]);
    if (a[hi].key > a[lo].key) swap_pairs(&a[hi], &a[lo]);
    if (a[hi].key > a[mid].key) swap_pairs(&a[hi], &a[mid]);
    const int64_t pivot = a[mid].key;
    int64_t i = lo, j = hi;
    while (i <= j) {
        while (a[i].key > pivot) i++;
        while (a[j].key < pivot) j--;
        if (i <= j) swap_pairs(&a[i++], &a[j--]);
    }
    *i_out = i;
    *j_out = j;
}

/* Sort a[0..n) by key, largest first (small runs by insertion). */
static void sort_desc(Pair *a, int64_t n) {
    while (n > 16) {
        int64_t i, j;
        partition_desc(a, 0, n - 1, &i, &j);
        if (j + 1 < n - i) { /* recurse into the smaller side: stack depth stays logarithmic */
            sort_desc(a, j + 1);
            a += i;
            n -= i;
        } else {
            sort_desc(a + i, n - i);
            n = j + 1;
        }
    }
    for (int64_t i = 1; i < n; i++) {
        const Pair t = a[i];
        int64_t j = i - 1;
        while (j >= 0 && a[j].key < t.key) {
            a[j + 1] = a[j];
            j--;
        }
        a[j + 1] = t;
    }
}

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

/* `order_key` of h2o_cli/cache/recall/archive.py for one page: the bound's bits made monotone in its value (-0.0 first
 * made +0.0) in the high 32 bits, minus the page's first token index in the low ones. */
static inline int64_t order_key(float bound, int64_t page_start) {
    const float positive_zero = bound + 0.0f;
    int32_t bits;
    __builtin_memcpy(&bits, &positive_zero, sizeof bits);
    const int64_t ordered = bits < 0 ? (int64_t)(bits ^ 0x7FFFFFFF) : (int64_t)bits;
    return ordered * 4294967296LL - page_start;
}

/* `PageArchive._write_token`: archive one token's K/V (unrotated) at ring slot `token % capacity`; a token
 * that starts a page first empties its ring page (token indices -1, summary high -inf, low +inf); the page's
 * per-channel max and min take the key (`torch.maximum`/`minimum`: a NaN wins). */
void recall_archive_token(
    int64_t n_kv, int64_t head_dim, int64_t capacity, int64_t page_size, int64_t token,
    const float *restrict new_key, const float *restrict new_value,           /* [n_kv, head_dim] */
    int64_t *restrict archive_index,                                          /* [capacity] */
    float *restrict archive_keys, float *restrict archive_values,             /* [n_kv, capacity, head_dim] */
    float *restrict summary)                    /* [n_kv, capacity / page_size, 2 * head_dim]: [high, low] */
{
    const int64_t slot = token % capacity, page = slot / page_size, pages = capacity / page_size;
    if (token % page_size == 0) {
        for (int64_t o = 0; o < page_size; o++) archive_index[page * page_size + o] = -1;
        for (int64_t g = 0; g < n_kv; g++) {
            float *restrict bounds = summary + (g * pages + page) * 2 * head_dim;
            for (int64_t i = 0; i < head_dim; i++) {
                bounds[i] = -INFINITY;
                bounds[head_dim + i] = INFINITY;
            }
        }
    }
    for (int64_t g = 0; g < n_kv; g++) {
        const float *restrict k = new_key + g * head_dim;
        __builtin_memcpy(archive_keys + (g * capacity + slot) * head_dim, k, head_dim * sizeof(float));
        __builtin_memcpy(archive_values + (g * capacity + slot) * head_dim, new_value + g * head_dim,
                         head_dim * sizeof(float));
        float *restrict high = summary + (g * pages + page) * 2 * head_dim, *restrict low = high + head_dim;
        for (int64_t i = 0; i < head_dim; i++) {
            high[i] = (k[i] > high[i] || k[i] != k[i]) ? k[i] : high[i];
            low[i] = (k[i] < low[i] || k[i] != k[i]) ? k[i] : low[i];
        }
    }
    archive_index[slot] = token;
}

/* Returns the hits summed over heads (chosen tokens that the recall slots held before); counts[g] is how many
 * recall slots of head g now hold a token (they come first; the rest are zero with index -1). */
int64_t recall_choose(
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
    uint8_t *restrict candidate, /* [capacity] scratch */
    int64_t *restrict previous,  /* [capacity] scratch: -1 everywhere between calls */
    Pair *restrict pages,        /* [used] scratch */
    int64_t *restrict chosen,    /* [recall] scratch */
    int64_t *restrict counts,    /* [n_kv] */
    int64_t *restrict totals)    /* [2]: recall slots filled over all heads, and the most of one head */
{
    const int64_t span = used * page_size;
    int64_t hits = 0;
    totals[0] = totals[1] = 0;
    for (int64_t g = 0; g < n_kv; g++) {
        /* candidates: written ring slots whose token is neither in S nor the step's own */
        for (int64_t s = 0; s < span; s++) candidate[s] = archive_index[s] >= 0;
        const int64_t own = new_token % capacity;
        if (own < span && archive_index[own] == new_token) candidate[own] = 0;
        for (int64_t s = 0; s < active; s++) {
            if (!valid[g * slots + s]) continue;
            const int64_t t = token_index[g * slots + s], at = t % capacity;
            if (at < span && archive_index[at] == t) candidate[at] = 0;
        }
        int64_t ranked = 0;
        for (int64_t p = 0; p < used; p++) {
            uint8_t any = 0;
            for (int64_t o = 0; o < page_size; o++) any |= candidate[p * page_size + o];
            if (any) pages[ranked++] = (Pair){order_key(bound[g * used + p], archive_index[p * page_size]), p};
        }
        /* every such page holds a candidate: the first `recall` pages in rank order hold all we take */
        const int64_t top = ranked < recall ? ranked : recall;
        if (top < ranked) select_top(pages, ranked, top);
        sort_desc(pages, top);
        int64_t *held = recall_index + g * recall;
        for (int64_t i = 0; i < recall; i++)
            if (held[i] >= 0) previous[held[i] % capacity] = held[i];
        int64_t count = 0;
        for (int64_t rank = 0; rank < top && count < recall; rank++)
            for (int64_t o = 0; o < page_size && count < recall; o++) {
                const int64_t s = pages[rank].item * page_size + o;
                if (!candidate[s]) continue;
                hits += previous[s] == archive_index[s];
                chosen[count++] = s;
            }
        for (int64_t i = 0; i < recall; i++)
            if (held[i] >= 0) previous[held[i] % capacity] = -1;
        for (int64_t i = 0; i < recall; i++) {
            float *restrict k = recall_keys + (g * recall + i) * head_dim;
            float *restrict v = recall_values + (g * recall + i) * head_dim;
            if (i < count) {
                const int64_t row = g * capacity + chosen[i];
                __builtin_memcpy(k, archive_keys + row * head_dim, head_dim * sizeof(float));
                __builtin_memcpy(v, archive_values + row * head_dim, head_dim * sizeof(float));
                held[i] = archive_index[chosen[i]];
            } else {
                for (int64_t d = 0; d < head_dim; d++) k[d] = v[d] = 0.0f;
                held[i] = -1;
            }
        }
        counts[g] = count;
        totals[0] += count;
        if (count > totals[1]) totals[1] = count;
    }
    return hits;
}

/* Returns the store's new `active`, or a negative code if the caller broke the contract. */
int64_t recall_decode_step(
    int64_t n_kv, int64_t group, int64_t head_dim, int64_t slots, int64_t active,
    const float *restrict query,      /* [n_kv, group, 2 * head_dim]: rotated, scaled, [q1, -q1, q2, q2] */
    const float *restrict new_key,    /* [n_kv, head_dim], unrotated */
    const float *restrict new_value,  /* [n_kv, head_dim] */
    const float *restrict table,      /* [positions, 2 * head_dim]: row p is [c, s, s, c] of position p */
    float *restrict keys, float *restrict values,                    /* [n_kv, slots, head_dim] */
    float *restrict scores, float *restrict seen, float *restrict last_probs, /* [n_kv, slots] */
    int64_t *restrict token_index, int64_t *restrict rank, uint8_t *restrict valid,
    int64_t rolling,         /* 1: E_q's entries sit at their rank by token index, 0: at their token index */
    int64_t tokens_seen,     /* token index of the new token */
    int64_t length,          /* entries of S per head before the write (= the new token's rank in S) */
    int64_t limit,           /* entries of S of rank < limit may be evicted (length + 1 - recent slots) */
    float decay,             /* every score is multiplied by this before the step's probabilities add */
    int64_t recall,
    const float *restrict recall_keys, const float *restrict recall_values, /* [n_kv, recall, head_dim] */
    const int64_t *restrict recall_index, /* [n_kv, recall]: the first counts[g] hold a token */
    const int64_t *restrict counts,       /* [n_kv] */
    int64_t entries,         /* rolling: the query's position + 1 (heads with fewer entries shift up to it) */
    float *restrict output,           /* [n_kv, group, head_dim] */
    float *restrict scratch,          /* [group * (slots + recall) + (group + 1) * head_dim] */
    int64_t *restrict order,          /* [2 * slots + 3 * recall] */
    int64_t *restrict victims)        /* [n_kv]: the evicted slot of each head */
{
    const int64_t count = write_lowest_free(n_kv, head_dim, slots, active, new_key, new_value, keys, values,
                                            scores, seen, token_index, rank, valid, tokens_seen, length);
    if (count < 0) return -1;
    const int64_t width = 2 * head_dim, resident = length + 1;
    float *restrict rotated = scratch + group * (slots + recall); /* [head_dim] */
    float *restrict halves = rotated + head_dim;                   /* [group, head_dim] */
    /* `order` (NULL without recall slots) holds the merge's buffers: [slots] twice, then [recall] Pairs and
     * [recall] positions. */
    int64_t *restrict by_rank = order, *restrict resident_position = recall ? order + slots : NULL;
    Pair *restrict recalled_order = recall ? (Pair *)(order + 2 * slots) : NULL;
    int64_t *restrict recalled_position = recall ? order + 2 * slots + 2 * recall : NULL;
    for (int64_t g = 0; g < n_kv; g++) {
        const uint8_t *v = valid + g * slots;
        const int64_t *r = rank + g * slots, *t = token_index + g * slots;
        const int64_t *held = recall ? recall_index + g * recall : NULL;
        const int64_t taken = recall ? counts[g] : 0, stride = count + taken;
        /* rolling, R empty: S's ranks, shifted up to the fullest head's query position (no merge needed) */
        const int64_t shift = entries - resident;
        const int merged = rolling && taken;
        if (merged) { /* merge S (in rank order) and R (sorted) by token index: each one's rank in E_q */
            for (int64_t s = 0; s < count; s++)
                if (v[s]) by_rank[r[s]] = t[s];
            for (int64_t i = 0; i < taken; i++) recalled_order[i] = (Pair){-held[i], i};
            sort_desc(recalled_order, taken); /* oldest token first */
            int64_t position = entries - (resident + taken), i = 0, k = 0;
            while (i < resident || k < taken) {
                if (k >= taken || (i < resident && by_rank[i] < -recalled_order[k].key))
                    resident_position[i++] = position++;
                else
                    recalled_position[recalled_order[k++].item] = position++;
            }
        }
        query_halves(query + g * group * width, group, head_dim, halves);
        for (int64_t s = 0; s < count; s++) {
            if (!v[s]) {
                for (int64_t j = 0; j < group; j++) scratch[j * stride + s] = -INFINITY;
                continue;
            }
            const int64_t position = merged ? resident_position[r[s]] : rolling ? r[s] + shift : t[s];
            key_logits(keys + (g * slots + s) * head_dim, table + position * width, halves, group, head_dim,
                       rotated, scratch + s, stride);
        }
        for (int64_t i = 0; i < taken; i++) {
            const int64_t position = rolling ? recalled_position[i] : held[i];
            key_logits(recall_keys + (g * recall + i) * head_dim, table + position * width, halves, group,
                       head_dim, rotated, scratch + count + i, stride);
        }
        softmax_rows(scratch, group, stride, stride);
        float *restrict out = output + g * group * head_dim;
        for (int64_t i = 0; i < group * head_dim; i++) out[i] = 0.0f;
        add_weighted_values(scratch, stride, values + g * slots * head_dim, count, group, head_dim, out);
        add_weighted_values(scratch + count, stride, recall_values + g * recall * head_dim, taken, group,
                            head_dim, out);
        victims[g] = score_and_evict(scratch, stride, group, count, slots, decay, scores + g * slots,
                                     last_probs + g * slots, seen + g * slots, rank + g * slots,
                                     valid + g * slots, token_index + g * slots, limit);
        if (victims[g] < 0) return -2;
    }
    return count;
}
