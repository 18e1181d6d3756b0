/* convert.h — scalar f16/bf16 <-> f32 conversions, round-to-nearest-even, IEEE-exact.
 *
 * Used wherever a low-precision element enters or leaves f32: tile loads and stores on the CPU,
 * the oracle's inputs, the dense baseline's roundings, the tools. Written with bit operations so
 * they behave the same on every compiler and ISA (no reliance on _Float16 or __bf16).
 */
#ifndef WA_CONVERT_H
#define WA_CONVERT_H

#include <stdint.h>
#include <string.h>

static inline uint32_t wa_f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static inline float wa_bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float wa_bf16_to_f32(uint16_t h) { return wa_bits_f32((uint32_t)h << 16); }

static inline uint16_t wa_f32_to_bf16(float f) {
    uint32_t u = wa_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest, ties to even */
    return (uint16_t)(u >> 16);
}

static inline float wa_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1f) return wa_bits_f32(sign | 0x7f800000u | (man << 13)); /* inf, nan */
    if (exp == 0) {
        if (man == 0) return wa_bits_f32(sign);
        /* subnormal: value = man * 2^-24, exact in f32 */
        float v = (float)man * (1.0f / 16777216.0f);
        return sign ? -v : v;
    }
    return wa_bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

static inline uint16_t wa_f32_to_f16(float f) {
    uint32_t u = wa_f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t au = u & 0x7fffffffu;
    if (au > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((au >> 13) & 0x3ffu)); /* NaN */
    if (au >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to >= 65520: inf */
    if (au < 0x38800000u) {
        /* below the smallest normal half (2^-14): subnormal or zero. Add 0.5 (2^-1) so the f32
         * adder rounds the value to a multiple of 2^-24 with ties to even; read the low bits. */
        float a = wa_bits_f32(au) + 0.5f;
        return (uint16_t)(sign | (uint16_t)(wa_f32_bits(a) - 0x3f000000u));
    }
    uint32_t man_odd = (au >> 13) & 1u;
    au += 0xc8000fffu + man_odd; /* rebias exponent (-112 << 23) and round to nearest even */
    return (uint16_t)(sign | (au >> 13));
}

/* Round an f32 to the nearest value of a storage dtype (0 = f32, 1 = f16, 2 = bf16; the
 * wa_dtype values), returned as f32. The dense baseline uses it to mimic a framework. */
static inline float wa_round_to(int dtype, float x) {
    if (dtype == 1) return wa_f16_to_f32(wa_f32_to_f16(x));
    if (dtype == 2) return wa_bf16_to_f32(wa_f32_to_bf16(x));
    return x;
}

#endif /* WA_CONVERT_H */
