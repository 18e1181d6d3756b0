/* test_convert.c — src/convert.h exhaustively: every f16 and bf16 bit pattern round-trips
 * through f32, and f32 -> f16 / bf16 rounds to nearest-even on a dense sample of f32 values
 * (all exponents, tie cases, subnormals, overflow, NaN), checked against a rounding reference
 * computed in double. */
#include "check.h"
#include "convert.h"

#include <math.h>
#include <stdio.h>

/* nearest representable value of a format with `man` mantissa bits, exponent range
 * [emin, emax], ties to even; computed independently in double. */
static double round_ref(double x, int man, int emin, int emax, double maxval) {
    if (isnan(x) || isinf(x)) return x;
    double ax = fabs(x);
    int e;
    frexp(ax, &e); /* ax = f * 2^e, f in [0.5, 1) */
    int exp = e - 1;
    if (exp < emin) exp = emin;
    double ulp = ldexp(1.0, exp - man);
    double r = nearbyint(ax / ulp) * ulp; /* default rounding mode: ties to even */
    if (r > maxval) {
        /* values >= maxval + ulp/2 round to inf (ties to even at the boundary go to inf) */
        r = INFINITY;
    }
    (void)emax;
    return copysign(r, x);
}

int main(void) {
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = wa_f16_to_f32((uint16_t)h);
        uint16_t back = wa_f32_to_f16(f);
        int nan = ((h >> 10) & 0x1f) == 0x1f && (h & 0x3ff);
        if (nan ? !(isnan(f) && (back & 0x7c00) == 0x7c00 && (back & 0x3ff)) : back != h) bad++;
    }
    check(bad == 0, "f16 -> f32 -> f16 round trip, all 65536 patterns (%d wrong)", bad);
    bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = wa_bf16_to_f32((uint16_t)h);
        uint16_t back = wa_f32_to_bf16(f);
        int nan = ((h >> 7) & 0xff) == 0xff && (h & 0x7f);
        if (nan ? !isnan(wa_bf16_to_f32(back)) : back != h) bad++;
    }
    check(bad == 0, "bf16 -> f32 -> bf16 round trip, all 65536 patterns (%d wrong)", bad);

    int bad16 = 0, badbf = 0;
    long n = 0;
    for (uint64_t u = 0; u < 0x100000000ull; u += 4099) { /* ~1M f32 patterns, all exponents */
        for (int tweak = 0; tweak < 3; tweak++) {
            uint32_t bits = (uint32_t)u;
            if (tweak == 1) bits = (bits & ~0x1fffu) | 0x1000u; /* exact f16 tie */
            if (tweak == 2) bits = (bits & ~0xffffu) | 0x8000u; /* exact bf16 tie */
            float f = wa_bits_f32(bits);
            if (isnan(f)) continue;
            n++;
            double want16 = round_ref(f, 10, -14, 15, 65504.0);
            double got16 = wa_f16_to_f32(wa_f32_to_f16(f));
            if (!(got16 == want16 || (isinf(got16) && isinf(want16) && signbit(got16) == signbit(want16)))) bad16++;
            double wantbf = round_ref(f, 7, -126, 127, 3.3895313892515355e38);
            double gotbf = wa_bf16_to_f32(wa_f32_to_bf16(f));
            if (!(gotbf == wantbf || (isinf(gotbf) && isinf(wantbf) && signbit(gotbf) == signbit(wantbf)))) badbf++;
        }
    }
    check(bad16 == 0, "f32 -> f16 rounds to nearest even on %ld samples incl. ties, subnormals, overflow (%d wrong)", n, bad16);
    check(badbf == 0, "f32 -> bf16 rounds to nearest even on %ld samples incl. ties (%d wrong)", n, badbf);
    check(isnan(wa_f16_to_f32(wa_f32_to_f16(NAN))) && isnan(wa_bf16_to_f32(wa_f32_to_bf16(NAN))), "NaN stays NaN");
    return check_summary();
}
