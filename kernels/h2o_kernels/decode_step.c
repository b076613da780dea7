/* One layer's decode step on the CPU, fused: write the new token, attend, accumulate scores, evict one.
 *
 * The same steps as `H2OLayer._step_on_one_thread` (h2o_cli/cache.py) on the torch path, for a store whose
 * entries all lie below `active` with at most one hole there (the state a decode step runs in once the cache
 * is full), a policy whose victim is the lowest score outside the recent window, ties to the oldest
 * (`kernel_victim`), and exactly one entry over budget after the write. float32 only. The Python side
 * (h2o_kernels/native.py) checks those conditions and keeps the store's counters.
 *
 * Every array is row-major and contiguous; `slots` is the store's row length (its preallocation). Only the
 * float rounding differs from the torch path: sums run in another order, and exp is a polynomial (2 ulp).
 */
#include <math.h>
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
    float *restrict scratch,          /* [group, slots + 1]: probabilities, then the row of rotated-key terms */
    int64_t *restrict victims)        /* [n_kv]: the evicted slot of each head */
{
    const int64_t half = head_dim / 2, width = 2 * head_dim;
    int64_t new_active = active;
    for (int64_t g = 0; g < n_kv; g++) { /* write into the lowest free slot */
        uint8_t *v = valid + g * slots;
        int64_t free = 0;
        while (free < slots && v[free]) free++;
        if (free >= slots) return -1; /* no free slot: the caller broke the contract */
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
    const int64_t count = new_active;
    float *restrict rotated = scratch + group * count; /* [head_dim]: one key rotated at its position */
    float *restrict halves = rotated + head_dim;         /* [group, head_dim]: each query's q1, q2 side by side */
    for (int64_t g = 0; g < n_kv; g++) {
        const uint8_t *v = valid + g * slots;
        const int64_t *positions = (rolling ? rank : token_index) + g * slots;
        for (int64_t j = 0; j < group; j++)
            for (int64_t i = 0; i < half; i++) {
                halves[j * head_dim + i] = query[(g * group + j) * width + i];
                halves[j * head_dim + half + i] = query[(g * group + j) * width + head_dim + i];
            }
        /* logits: the key's halves a, b rotated by (c, s) are (a c - b s, b c + a s); the query's are q1, q2 */
        for (int64_t s = 0; s < count; s++) {
            if (!v[s]) {
                for (int64_t j = 0; j < group; j++) scratch[j * count + s] = -INFINITY;
                continue;
            }
            const float *restrict k = keys + (g * slots + s) * head_dim;
            const float *restrict row = table + positions[s] * width;
            for (int64_t i = 0; i < half; i++) {
                const float a = k[i], b = k[half + i], c = row[i], sn = row[half + i];
                rotated[i] = a * c - b * sn;
                rotated[half + i] = b * c + a * sn;
            }
            for (int64_t j = 0; j < group; j++) scratch[j * count + s] = dot(halves + j * head_dim, rotated, head_dim);
        }
        /* softmax per query */
        for (int64_t j = 0; j < group; j++) {
            float *p = scratch + j * count, top = -INFINITY;
#pragma omp simd reduction(max : top)
            for (int64_t s = 0; s < count; s++) top = p[s] > top ? p[s] : top;
#pragma omp simd
            for (int64_t s = 0; s < count; s++) p[s] = exp_nonpositive(p[s] - top);
            const float inverse = 1.0f / sum(p, count);
#pragma omp simd
            for (int64_t s = 0; s < count; s++) p[s] *= inverse; /* a masked slot's is 0 */
        }
        /* outputs = Σ p[s] · value[s]: one pass over the values for all the group's queries */
        float *restrict out = output + g * group * head_dim;
        for (int64_t i = 0; i < group * head_dim; i++) out[i] = 0.0f;
        for (int64_t s = 0; s < count; s++) {
            const float *restrict value = values + (g * slots + s) * head_dim;
            for (int64_t j = 0; j < group; j++) {
                const float weight = scratch[j * count + s];
                float *restrict o = out + j * head_dim;
#pragma omp simd
                for (int64_t i = 0; i < head_dim; i++) o[i] += weight * value[i];
            }
        }
        float *score = scores + g * slots, *last = last_probs + g * slots, *saw = seen + g * slots;
        const int64_t *r = rank + g * slots;
        int64_t victim = -1;
        float lowest = INFINITY;
        for (int64_t s = 0; s < count; s++) {
            float sum = 0.0f;
            for (int64_t j = 0; j < group; j++) sum += scratch[j * count + s];
            if (decay != 1.0f) score[s] *= decay;
            score[s] += sum;
            last[s] = sum;
            if (!v[s]) continue;
            saw[s] += 1.0f;
            if (r[s] < limit && (victim < 0 || score[s] < lowest || (score[s] == lowest && r[s] < r[victim]))) {
                victim = s;
                lowest = score[s];
            }
        }
        victims[g] = victim;
        if (victim < 0) return -2; /* no entry outside the recent window: the caller broke the contract */
        /* drop it; ranks stay dense: every entry younger than it moves down one */
        const int64_t gone = r[victim];
        int64_t *ranks = rank + g * slots;
        for (int64_t s = 0; s < slots; s++) ranks[s] -= ranks[s] > gone;
        valid[g * slots + victim] = 0;
        token_index[g * slots + victim] = -1;
    }
    return new_active;
}

/* `exp_nonpositive` over an array, exported for its accuracy test (tests/test_native_step.py). */
void h2o_exp_nonpositive(const float *restrict x, float *restrict out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = exp_nonpositive(x[i]);
}
