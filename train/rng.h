/* rng.h — splitmix64, the trainer's one small generator: reproducible adapter initialisation,
 * batch order and random checkpoints from a seed, identical on every platform. */
#ifndef WA_TRAIN_RNG_H
#define WA_TRAIN_RNG_H

#include <stdint.h>

static inline uint64_t splitmix64(uint64_t *state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* uniform in [0, 1) with 53 random bits */
static inline double splitmix64_unit(uint64_t *state) { return (double)(splitmix64(state) >> 11) * 0x1.0p-53; }

#endif
