/* fuzz_config.c — libFuzzer target for the config.json parser (train/config.c).
 *
 * gemma_config_parse gets arbitrary bytes (a NUL-terminated copy). The contract checked:
 *   -1: a non-empty message of one line that starts with the name passed ("config.json: ");
 *    0: a config the model can be built from: vocab, hidden, intermediate, heads, KV heads and
 *       head dims >= 1; heads a multiple of the KV heads and head dims even, for both layer
 *       kinds; layers in [1, GEMMA_MAX_LAYERS], each layer kind 0 or 1; a sliding window >= 1;
 *       finite positive scales (norm eps, score and embedding scale, RoPE bases and factors,
 *       partial rotary factor in (0, 1]) and finite softcaps >= 0.
 * A broken contract abort()s, so libFuzzer records the input; ASan, UBSan and LeakSanitizer
 * catch the rest (gemma_config_describe runs on every accepted config too).
 *
 * Build: make fuzz (into $(BUILD)/fuzz/); run: make fuzz-check, or see docs/fuzzing.md.
 */
#include "config.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char NAME[] = "config.json";

static int positive(double x) { return isfinite(x) && x > 0; }

static void check_rope(const gemma_rope *r) {
    if (!positive(r->theta) || !positive(r->linear_factor) || !positive(r->partial) || r->partial > 1 ||
        (r->proportional != 0 && r->proportional != 1))
        abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *text = malloc(size + 1);
    if (!text) return 0;
    memcpy(text, data, size);
    text[size] = '\0';
    gemma_config c;
    char err[512];
    err[0] = '\0';
    int rc = gemma_config_parse(text, NAME, &c, err, sizeof err);
    free(text);
    if (rc != 0) {
        size_t n = strlen(NAME);
        if (rc != -1 || strncmp(err, NAME, n) != 0 || err[n] != ':' || strlen(err) <= n + 2 ||
            strchr(err, '\n') != NULL || strchr(err, '\r') != NULL)
            abort();
        return 0;
    }
    if (c.family != GEMMA_4 && c.family != GEMMA_3) abort();
    if (c.vocab < 1 || c.hidden < 1 || c.intermediate < 1 || c.heads < 1 || c.sliding_window < 1) abort();
    if (c.layers < 1 || c.layers > GEMMA_MAX_LAYERS) abort();
    for (int k = 0; k < 2; k++) {
        const gemma_attn_shape *s = &c.kind[k];
        if (s->kv_heads < 1 || s->head_dim < 1 || s->head_dim % 2 != 0 || c.heads % s->kv_heads != 0) abort();
        if (s->k_eq_v != 0 && s->k_eq_v != 1) abort();
        check_rope(&s->rope);
    }
    for (int l = 0; l < c.layers; l++)
        if (c.layer_kind[l] != LAYER_SLIDING && c.layer_kind[l] != LAYER_FULL) abort();
    if (!positive(c.norm_eps) || !positive(c.score_scale) || !positive(c.embed_scale)) abort();
    if (!isfinite(c.final_softcap) || c.final_softcap < 0 || !isfinite(c.attn_softcap) || c.attn_softcap < 0 ||
        !isfinite(c.attn_softcap_ignored) || c.attn_softcap_ignored < 0)
        abort();
    if (c.tied_embeddings != 0 && c.tied_embeddings != 1) abort();
    char desc[512];
    gemma_config_describe(&c, desc, sizeof desc);
    if (desc[0] == '\0' || strchr(desc, '\n') != NULL) abort();
    return 0;
}
