/* The C twins of a bf16 read's steps around its matmuls (`h2o_kernels.native_read`): `rotate_to_bf16`, the
 * rotation, scale and bf16 rounding of q and k before QK^T; `read_softmax`, what `reference.slot_attention` does
 * between its two bf16 matmuls when the keys are in token order, in one pass over each row instead of five (the
 * masks added, softmax, the bf16 copy of the probabilities for PV, the score sums over the queries, the last
 * query's probabilities).
 *
 * Rows are the chunk's queries, [n_kv, group, chunk] flattened; columns the keys, in token order, the chunk's
 * own `chunk` last. Query c of the chunk sees the columns 0 .. cols - chunk + c, less the first `leading` ones
 * its KV head's `present` [n_kv, leading] marks 0 (empty recall slots). A row's probabilities are the float32
 * softmax of the bf16 logits it sees (0 elsewhere); `probs` gets them rounded to bf16 (to nearest, ties to
 * even, as torch's `.to(torch.bfloat16)`), `increments` [n_kv, cols] adds them weighed by `query_weights`
 * [chunk] (NULL: 1) and `last` [n_kv, cols] the last query's, both in float32. Only the rounding differs from
 * torch: exp is a polynomial (2 ulp, step_common.h), a row is scaled by 1/sum, and sums run in another order.
 * `increments` and `last` are added to, never reset: the caller zeroes them.
 */
#include <string.h>

#include "step_common.h"

static inline float from_bf16(uint16_t bits) {
    const uint32_t widened = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &widened, sizeof value);
    return value;
}

/* Rounded to nearest, ties to even: `value` is a probability (finite, not NaN). */
static inline uint16_t to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

void read_softmax(int64_t n_kv, int64_t group, int64_t chunk, int64_t cols, int64_t leading,
                  const uint16_t *restrict logits, const uint8_t *restrict present,
                  const float *restrict query_weights, uint16_t *restrict probs, float *restrict increments,
                  float *restrict last, float *restrict row_scratch) {
    for (int64_t row = 0; row < n_kv * group * chunk; row++) {
        const int64_t c = row % chunk, head = row / (group * chunk);
        const int64_t seen = cols - chunk + c + 1;
        const uint16_t *restrict in = logits + row * cols;
        uint16_t *restrict out = probs + row * cols;
        float *restrict x = row_scratch;
#pragma omp simd
        for (int64_t s = 0; s < seen; s++) x[s] = from_bf16(in[s]);
        if (present != NULL) {
            const uint8_t *restrict keep = present + head * leading;
            for (int64_t s = 0; s < leading; s++) x[s] = keep[s] ? x[s] : -INFINITY;
        }
        float top = -INFINITY;
#pragma omp simd reduction(max : top)
        for (int64_t s = 0; s < seen; s++) top = x[s] > top ? x[s] : top;
#pragma omp simd
        for (int64_t s = 0; s < seen; s++) x[s] = exp_nonpositive(x[s] - top);
        const float inverse = 1.0f / sum(x, seen);
        const float weight = query_weights != NULL ? query_weights[c] : 1.0f;
        float *restrict scores = increments + head * cols;
#pragma omp simd
        for (int64_t s = 0; s < seen; s++) {
            const float p = x[s] * inverse;
            out[s] = to_bf16(p);
            scores[s] += weight * p;
        }
        memset(out + seen, 0, (size_t)(cols - seen) * sizeof *out);
        if (c == chunk - 1) {
            float *restrict final = last + head * cols;
#pragma omp simd
            for (int64_t s = 0; s < seen; s++) final[s] += x[s] * inverse;
        }
    }
}

/* `reference.rotate` of `rows` rows of `x` [rows, head_dim] (float32), times `scale`, rounded to bf16 into
 * `out` [rows, head_dim]: row r turns by row r % `table_rows` of `cos`, `sin` [table_rows, head_dim] (a query
 * chunk's rows share one table over its heads; keys have one row each). The same float32 operations in the
 * same order as the torch code (x·cos + rotate_half(x)·sin, then the scale), so the same bits. */
void rotate_to_bf16(int64_t rows, int64_t head_dim, int64_t table_rows, const float *restrict x,
                    const float *restrict cos, const float *restrict sin, float scale, uint16_t *restrict out) {
    const int64_t half = head_dim / 2;
    for (int64_t row = 0; row < rows; row++) {
        const float *restrict in = x + row * head_dim;
        const float *restrict c = cos + (row % table_rows) * head_dim;
        const float *restrict s = sin + (row % table_rows) * head_dim;
        uint16_t *restrict o = out + row * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < half; i++) o[i] = to_bf16((in[i] * c[i] + -in[i + half] * s[i]) * scale);
#pragma omp simd
        for (int64_t i = half; i < head_dim; i++) o[i] = to_bf16((in[i] * c[i] + in[i - half] * s[i]) * scale);
    }
}
