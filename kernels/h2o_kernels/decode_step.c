/* One layer's decode step on the CPU, fused: write the new token, attend, accumulate scores, evict one.
 *
 * The same steps as `H2OLayer._step_on_one_thread` (h2o_cli/cache/layer.py) on the torch path, for a store whose
 * entries all lie below `active` with at most one hole there (the state a decode step runs in once the cache
 * is full), a policy whose victim is the lowest score outside the recent window, ties to the oldest
 * (`kernel_victim`), and exactly one entry over budget after the write. float32 only. The Python side
 * (h2o_kernels/native.py) checks those conditions and keeps the store's counters. It is recall's step
 * (recall_step.c) with no recall slots: one body serves both.
 */
#include "step_common.h"

/* Returns the store's new `active` (one past the highest slot holding an entry). */
int64_t h2o_decode_step(
    int64_t n_kv, int64_t group, int64_t head_dim, int64_t slots, int64_t active,
    const float *restrict query,      /* [n_kv, group, 2 * head_dim]: rotated, scaled, [q1, -q1, q2, q2] */
    const float *restrict new_key,    /* [n_kv, head_dim], unrotated */
    const float *restrict new_value,  /* [n_kv, head_dim] */
    const float *restrict table,      /* [positions, 2 * head_dim]: row p is [c, s, s, c] of position p */
    float *restrict keys, float *restrict values,                    /* [n_kv, slots, head_dim] */
    float *restrict scores, float *restrict seen, float *restrict last_probs, /* [n_kv, slots] */
    int64_t *restrict token_index, int64_t *restrict rank, uint8_t *restrict valid,
    int64_t rolling,         /* 1: keys sit at their rank, 0: at their token index */
    int64_t tokens_seen,     /* token index of the new token */
    int64_t length,          /* entries per head before the write (= the new token's rank) */
    int64_t limit,           /* entries of rank < limit may be evicted (length + 1 - recent slots) */
    float decay,             /* every score is multiplied by this before the step's probabilities add */
    float *restrict output,           /* [n_kv, group, head_dim] */
    float *restrict scratch,          /* [group * slots + (group + 1) * head_dim] at least */
    int64_t *restrict victims)        /* [n_kv]: the evicted slot of each head */
{
    return recall_decode_step(n_kv, group, head_dim, slots, active, query, new_key, new_value, table, keys,
                              values, scores, seen, last_probs, token_index, rank, valid, rolling, tokens_seen,
                              length, limit, decay, 0, NULL, NULL, NULL, NULL, length + 1, output, scratch, NULL,
                              victims);
}

/* `exp_nonpositive` over an array, exported for its accuracy test (tests/test_native_step.py). */
void h2o_exp_nonpositive(const float *restrict x, float *restrict out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = exp_nonpositive(x[i]);
}
