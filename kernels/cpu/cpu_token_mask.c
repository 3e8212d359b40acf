/* Structured outputs: forbid, in place, every token a grammar's bitmask does not allow.
 * logits: fp32 rows of `ld` floats; rows[j] is the logits row that bitmask row j (words uint32
 * words, bit t % 32 of word t / 32 = token t allowed) applies to. Tokens past the bitmask's
 * 32 * words, up to vocab, are forbidden too. allowed[j] = whether row j allows any token
 * (a row allowing none is left untouched: the caller fails that request instead).
 * One thread: at a few dozen rows this is tens of microseconds, less than waking OpenMP's
 * threads; numpy's unpack + putmask cost ~100 us a row here. */
#include <math.h>
#include <stdint.h>

void apply_token_bitmask(float *logits, int64_t ld, const int64_t *rows, int64_t nrows,
                         const uint32_t *mask, int64_t words, int64_t vocab, uint8_t *allowed) {
    const int64_t covered = words * 32 < vocab ? words * 32 : vocab;
    for (int64_t j = 0; j < nrows; j++) {
        const uint32_t *m = mask + j * words;
        uint32_t any = 0;
        for (int64_t w = 0; w < covered / 32; w++) any |= m[w];
        if (covered % 32) any |= m[covered / 32] & ((1u << (covered % 32)) - 1u);  /* bits past vocab */
        allowed[j] = any != 0;
        if (!any) continue;
        float *row = logits + rows[j] * ld;
        /* a word at a time, branch-free inside it (a select the compiler vectorises): masks are
         * mostly whole words of 0 (structure) or of 1 (free text) */
        int64_t w = 0;
        for (; (w + 1) * 32 <= covered; w++) {
            const uint32_t bits = m[w];
            if (bits == 0xffffffffu) continue;
            float *x = row + w * 32;
            for (int b = 0; b < 32; b++) x[b] = (bits >> b) & 1u ? x[b] : -INFINITY;
        }
        for (int64_t t = w * 32; t < covered; t++)
            if (!((m[w] >> (t - w * 32)) & 1u)) row[t] = -INFINITY;
        for (int64_t t = covered; t < vocab; t++) row[t] = -INFINITY;
    }
}
