/* fuzz_safetensors.c — libFuzzer target for the safetensors reader (formats/safetensors.c).
 *
 * st_parse is the code that sees untrusted files, so the fuzzer feeds it arbitrary bytes. When a
 * file is accepted, every byte of every tensor is read: the parser promises that each tensor's
 * [data, data + end - begin) lies inside the buffer, and AddressSanitizer turns a broken promise
 * into a crash. A rejected file must come with a non-empty one-line message and an empty
 * st_file, and everything must be freed (LeakSanitizer checks jansson's allocations too).
 *
 * Build: make fuzz (into $(BUILD)/fuzz/); run: make fuzz-check, or see docs/fuzzing.md.
 */
#include "safetensors.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    st_file f;
    char err[256];
    if (st_parse(data, size, &f, err, sizeof err) != 0) {
        /* Contract checks: crash (abort) so the fuzzer records the input. */
        if (err[0] == '\0' || strchr(err, '\n') != NULL || f.count != 0 || f.tensors != NULL ||
            f.meta != NULL)
            abort();
        st_close(&f);
        return 0;
    }
    volatile uint64_t sum = 0;
    for (int i = 0; i < f.count; i++) {
        const st_tensor *t = &f.tensors[i];
        const uint8_t *p = t->data;
        uint64_t n = t->end - t->begin;
        /* The shape must agree with the byte count the parser checked. */
        if (st_numel(t) * st_dtype_size(t->dtype) != n || t->rank < 0 || t->rank > ST_MAX_RANK)
            abort();
        if (st_find(&f, t->name) == NULL)
            abort();
        for (uint64_t b = 0; b < n; b++)
            sum += p[b];
    }
    for (int i = 0; i < st_metadata_count(&f); i++) {
        const char *k, *v;
        if (st_metadata_at(&f, i, &k, &v) != 0 || st_metadata(&f, k) == NULL)
            abort();
    }
    (void)sum;
    st_close(&f);
    return 0;
}
