/* One layer's one-token decode step on the CPU, fused: write the new token into S, attend over S ∪ R, accumulate
 * S's scores, evict one entry of S.
 *
 * The C twin of the torch step (`H2OLayer._torch_step` in h2o_cli/cache/layer.py and, with recall slots,
 * `RecallLayer._torch_step` in h2o_cli/cache/recall/layer.py), for a store whose entries all lie below `active`
 * with at most one hole there (the state a decode step runs in once the cache is full), a policy whose victim
 * is the lowest score outside the recent window, ties to the oldest (`kernel_victim`,
 * h2o_kernels.reference.lowest_outside_recent), and exactly one entry over budget after the write. float32 only.
 * The new token is written to S's lowest free slot; one softmax runs over S and the `counts[g]` recall slots of
 * each head at rolling positions (ranks of E_q by token index, as h2o_cli.cache.positions.rolling_positions,
 * or with R placed as one block before the recent window, as `placed_order`) or token indices; S's scores are
 * decayed by `decay` and take the step's probabilities; one entry of S is evicted. `h2o`'s step is the case
 * R = ∅: `recall` 0, the R pointers and `order` NULL, `entries` = length + 1.
 * The cache side (h2o_cli/cache/c_step.py) checks those conditions and keeps the store's counters.
 */
#include "step_common.h"

/* Returns the store's new `active`, or a negative code if the caller broke the contract. */
int64_t cache_step(
    int64_t n_kv, int64_t group, int64_t head_dim, int64_t slots, int64_t active,
    const float *restrict query,      /* [n_kv, group, 2 * head_dim]: rotated, scaled, [q1, -q1, q2, q2] */
    const float *restrict new_key,    /* [n_kv, head_dim], unrotated */
    const float *restrict new_value,  /* [n_kv, head_dim] */
    const float *restrict table,      /* [positions, 2 * head_dim]: row p is [c, s, s, c] of position p */
    float *restrict keys, float *restrict values,                    /* [n_kv, slots, head_dim] */
    float *restrict scores, float *restrict seen, float *restrict last_probs, /* [n_kv, slots] */
    int64_t *restrict token_index, int64_t *restrict rank, uint8_t *restrict valid,
    int64_t rolling,         /* 0: E_q's entries sit at their token index; 1: at their rank by token index;
                              * 2: as 1 with R placed after S's ranks < limit and before the rest (contiguous) */
    int64_t tokens_seen,     /* token index of the new token */
    int64_t length,          /* entries of S per head before the write (= the new token's rank in S) */
    int64_t limit,           /* entries of S of rank < limit may be evicted (length + 1 - recent slots) */
    float decay,             /* every score is multiplied by this before the step's probabilities add */
    int64_t recall,
    const float *restrict recall_keys, const float *restrict recall_values, /* [n_kv, recall, head_dim] */
    const int64_t *restrict recall_index, /* [n_kv, recall]: the first counts[g] hold a token */
    const int64_t *restrict counts,       /* [n_kv] */
    int64_t *restrict order,              /* [2 * slots + 3 * recall] scratch (NULL without recall slots) */
    int64_t entries,         /* rolling: the query's position + 1 (heads with fewer entries shift up to it) */
    float *restrict output,           /* [n_kv, group, head_dim] */
    float *restrict scratch,          /* [group * (slots + recall) + (group + 1) * head_dim] */
    int64_t *restrict victims,        /* [n_kv]: the evicted slot of each head */
    const uint8_t *restrict pinned)   /* [n_kv, slots]: entries never evicted (NULL: none); when they leave no
                                       * entry of rank < limit, the oldest unpinned entry goes */
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
        /* contiguous: S's ranks below `split` (older than the recent window, and never the step's own token)
         * come first, then all of R, then the rest of S */
        const int64_t split = rolling == 2 ? (limit < 0 ? 0 : limit < resident - 1 ? limit : resident - 1) : -1;
        if (merged) { /* merge S (in rank order) and R (sorted) by token index: each one's rank in E_q */
            for (int64_t s = 0; s < count; s++)
                if (v[s]) by_rank[r[s]] = t[s];
            for (int64_t i = 0; i < taken; i++) recalled_order[i] = (Pair){-held[i], i};
            sort_desc(recalled_order, taken); /* oldest token first */
            int64_t position = entries - (resident + taken), i = 0, k = 0;
            while (i < resident || k < taken) {
                if (k >= taken ||
                    (i < resident && (split >= 0 ? i < split : by_rank[i] < -recalled_order[k].key)))
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
                                     valid + g * slots, token_index + g * slots, limit,
                                     pinned ? pinned + g * slots : NULL);
        if (victims[g] < 0) return -2;
    }
    return count;
}

/* `exp_nonpositive` over an array, exported for its accuracy test (tests/test_native_step.py). */
void h2o_exp_nonpositive(const float *restrict x, float *restrict out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = exp_nonpositive(x[i]);
}
