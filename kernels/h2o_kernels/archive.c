/* The `recall` archive's C twins: one token's write (`archive_token`) and a one-token step's pass 1 from the page
 * bounds on (`archive_choose`).
 *
 * `archive_token` is `PageArchive.write` of one token (h2o_cli/cache/recall/archive.py), bit for bit.
 * `archive_choose` is `PageArchive.choose_one` from the page bounds on and the read-back into the recall slots
 * (`RecallLayer._read_back`): the candidates (archived tokens not in S), the pages that hold one ranked by
 * bound then age, the first `recall` candidates in reading order copied into the recall slots, and the hits.
 * Its result is the torch path's exactly: the bounds come from torch (`best_page_bound`) and the rest is
 * integer work. float32 archive in RAM only; the cache side (h2o_cli/cache/recall/c_step.py) checks that.
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

/* `order_key` of h2o_cli/cache/recall/archive.py for one page: the bound's bits made monotone in its value (-0.0 first
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
 * +inf); the per-channel max and min of the token's block take the key (`torch.maximum`/`minimum`: a NaN wins). */
void archive_token(
    int64_t n_kv, int64_t head_dim, int64_t capacity, int64_t page_size, int64_t block_size, int64_t token,
    const float *restrict new_key, const float *restrict new_value,           /* [n_kv, head_dim] */
    int64_t *restrict archive_index,                                          /* [capacity] */
    float *restrict archive_keys, float *restrict archive_values,             /* [n_kv, capacity, head_dim] */
    float *restrict summary)                  /* [n_kv, capacity / block_size, 2 * head_dim]: [high, low] */
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
        const float *restrict k = new_key + g * head_dim;
        __builtin_memcpy(archive_keys + (g * capacity + slot) * head_dim, k, head_dim * sizeof(float));
        __builtin_memcpy(archive_values + (g * capacity + slot) * head_dim, new_value + g * head_dim,
                         head_dim * sizeof(float));
        float *restrict high = summary + (g * blocks + block) * 2 * head_dim, *restrict low = high + head_dim;
        for (int64_t i = 0; i < head_dim; i++) {
            high[i] = (k[i] > high[i] || k[i] != k[i]) ? k[i] : high[i];
            low[i] = (k[i] < low[i] || k[i] != k[i]) ? k[i] : low[i];
        }
    }
    archive_index[slot] = token;
}

/* Returns the hits summed over heads (chosen tokens that the recall slots held before); counts[g] is how many
 * recall slots of head g now hold a token (they come first; the rest are zero with index -1). */
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
