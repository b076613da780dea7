/* What the C twins share (step.c: the one-token step; archive.c: the archive's write and choice): float
 * kernels, the parts of a one-token step on a store (write, rotate-and-dot, softmax, scores and eviction) and a
 * sort of (key, item) pairs.
 *
 * Every array is row-major and contiguous; `slots` is the store's row length (its preallocation). Only the
 * float rounding differs from the torch path: sums run in another order, and exp is a polynomial (2 ulp).
 */
#ifndef H2O_STEP_COMMON_H
#define H2O_STEP_COMMON_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* a·b over n floats. `omp simd reduction` lets the compiler keep one partial sum per vector lane and add
 * them at the end (a fixed order for a given build: the result does not change from call to call). */
static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < n; i++) total += a[i] * b[i];
    return total;
}

/* The sum of n floats (as `dot`). */
static inline float sum(const float *a, int64_t n) {
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < n; i++) total += a[i];
    return total;
}

/* e**x for x <= 0 (a softmax's logits minus their maximum), within 2 ulp of the exact value, written without
 * a branch or a call so that a loop over it is vectorised: x = n ln2 + r with |r| <= ln2/2 (n rounded by the
 * 1.5 * 2**23 trick), e**r by Cephes' degree-6 polynomial, times 2**n built in the exponent bits. Below -87
 * (where e**x leaves float32's normal range) it is 0, also for -inf (a masked logit): the bits are masked. */
static inline float exp_nonpositive(float x) {
    const float clamped = x < -87.0f ? -87.0f : x;
    const float n = (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = (clamped - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.0f;
    const int32_t keep = -(int32_t)(x >= -87.0f);
    const int32_t bits = (((int32_t)n + 127) << 23) & keep;
    float scale;
    __builtin_memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}

/* Write the new token into each head's lowest free slot (score 0, rank `length`). Returns the store's new
 * `active` (one past the highest slot holding an entry), or -1 if a head has no free slot. */
static inline int64_t write_lowest_free(
    int64_t n_kv, int64_t head_dim, int64_t slots, int64_t active,
    const float *restrict new_key, const float *restrict new_value,  /* [n_kv, head_dim] */
    float *restrict keys, float *restrict values, float *restrict scores, float *restrict seen,
    int64_t *restrict token_index, int64_t *restrict rank, uint8_t *restrict valid,
    int64_t tokens_seen, int64_t length)
{
    int64_t new_active = active;
    for (int64_t g = 0; g < n_kv; g++) {
        uint8_t *v = valid + g * slots;
        int64_t free = 0;
        while (free < slots && v[free]) free++;
        if (free >= slots) return -1;
        const int64_t at = g * slots + free;
        for (int64_t i = 0; i < head_dim; i++) {
            keys[at * head_dim + i] = new_key[g * head_dim + i];
            values[at * head_dim + i] = new_value[g * head_dim + i];
        }
        token_index[at] = tokens_seen;
        rank[at] = length;
        scores[at] = 0.0f;
        seen[at] = 0.0f;
        v[free] = 1;
        if (free + 1 > new_active) new_active = free + 1;
    }
    return new_active;
}

/* Each query's halves q1, q2 side by side ([group, head_dim]) from `expand`'s form [q1, -q1, q2, q2]. */
static inline void query_halves(const float *restrict query, int64_t group, int64_t head_dim,
                                float *restrict halves) {
    const int64_t half = head_dim / 2, width = 2 * head_dim;
    for (int64_t j = 0; j < group; j++)
        for (int64_t i = 0; i < half; i++) {
            halves[j * head_dim + i] = query[j * width + i];
            halves[j * head_dim + half + i] = query[j * width + head_dim + i];
        }
}

/* The logits of one key for the group's queries, written at p[j * stride]: the key's halves a, b rotated by
 * its table row (c, s) are (a c - b s, b c + a s); `rotated` is [head_dim] scratch. */
static inline void key_logits(const float *restrict k, const float *restrict row, const float *restrict halves,
                              int64_t group, int64_t head_dim, float *restrict rotated, float *restrict p,
                              int64_t stride) {
    const int64_t half = head_dim / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = k[i], b = k[half + i], c = row[i], sn = row[half + i];
        rotated[i] = a * c - b * sn;
        rotated[half + i] = b * c + a * sn;
    }
    for (int64_t j = 0; j < group; j++) p[j * stride] = dot(halves + j * head_dim, rotated, head_dim);
}

/* Softmax of each of the `group` rows of `count` logits (row j at p + j * stride); -inf gives 0. */
static inline void softmax_rows(float *restrict p, int64_t group, int64_t stride, int64_t count) {
    for (int64_t j = 0; j < group; j++) {
        float *row = p + j * stride, top = -INFINITY;
#pragma omp simd reduction(max : top)
        for (int64_t s = 0; s < count; s++) top = row[s] > top ? row[s] : top;
#pragma omp simd
        for (int64_t s = 0; s < count; s++) row[s] = exp_nonpositive(row[s] - top);
        const float inverse = 1.0f / sum(row, count);
#pragma omp simd
        for (int64_t s = 0; s < count; s++) row[s] *= inverse;
    }
}

/* out[j] += Σ_s p[j * stride + s] · value[s] over `count` values ([count, head_dim], one pass over them). */
static inline void add_weighted_values(const float *restrict p, int64_t stride, const float *restrict value_rows,
                                       int64_t count, int64_t group, int64_t head_dim, float *restrict out) {
    for (int64_t s = 0; s < count; s++) {
        const float *restrict value = value_rows + s * head_dim;
        for (int64_t j = 0; j < group; j++) {
            const float weight = p[j * stride + s];
            float *restrict o = out + j * head_dim;
#pragma omp simd
            for (int64_t i = 0; i < head_dim; i++) o[i] += weight * value[i];
        }
    }
}

/* One head's scores after the step and its eviction: each of the `count` slots gets the group's summed
 * probability (scores decayed first), valid ones are seen once more; the lowest score among ranks below
 * `limit` (ties to the oldest) is dropped and the younger ranks move down. Returns the victim, or -1. */
static inline int64_t score_and_evict(const float *restrict p, int64_t stride, int64_t group, int64_t count,
                                      int64_t slots, float decay, float *restrict score, float *restrict last,
                                      float *restrict saw, int64_t *restrict r, uint8_t *restrict v,
                                      int64_t *restrict token_index, int64_t limit,
                                      const uint8_t *restrict pinned) {
    int64_t victim = -1, oldest = -1; /* oldest: the oldest unpinned entry of the recent window */
    float lowest = INFINITY;
    for (int64_t s = 0; s < count; s++) {
        float total = 0.0f;
        for (int64_t j = 0; j < group; j++) total += p[j * stride + s];
        if (decay != 1.0f) score[s] *= decay;
        score[s] += total;
        last[s] = total;
        if (!v[s]) continue;
        saw[s] += 1.0f;
        if (pinned && pinned[s]) continue;
        if (r[s] < limit && (victim < 0 || score[s] < lowest || (score[s] == lowest && r[s] < r[victim]))) {
            victim = s;
            lowest = score[s];
        } else if (r[s] >= limit && (oldest < 0 || r[s] < r[oldest])) {
            oldest = s;
        }
    }
    if (victim < 0 && pinned) victim = oldest; /* pins left no candidate: the oldest unpinned entry goes */
    if (victim < 0) return -1;
    const int64_t gone = r[victim];
    for (int64_t s = 0; s < slots; s++) r[s] -= r[s] > gone;
    v[victim] = 0;
    token_index[victim] = -1;
    return victim;
}

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

#endif
