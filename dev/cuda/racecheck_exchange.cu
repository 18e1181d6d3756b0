// racecheck_exchange.cu — does compute-sanitizer's racecheck follow the handshakes of the D = 512
// dQ kernel (dq_wide_ws_kernel in src/cuda/bwd_hopper.cu)? The kernel below is that exchange and
// nothing else: warpgroup 0 returns at once (the producer, which leaves), warpgroup 1 writes "P"
// into one of two buffers and hands it over, warpgroup 2 reads it, frees it (the writer waits for
// that two steps later), and hands "dS" back the same way through two more buffers. Every value
// read is checked, so a handshake that does not order the accesses also shows as wrong values.
// Forms (the first argument):
//   p         P one way only on named barriers (bar.arrive → bar.sync; barriers 1..4), as
//             dkdv_wide_ws_kernel
//   pds       P and dS back on named barriers 1..4 and 7..10, as dq_wide_ws_kernel built with
//             -DWA_LAB_DS_NAMED
//   pds-low   the same on barriers 1..8
//   pds-mbar  P on named barriers, dS back on mbarriers (a full and an empty one per buffer, every
//             thread of a warpgroup arriving), as dq_wide_ws_kernel
//   mbar      both on mbarriers
// Build and run on the H200 (dev/cuda/bwd_d512_wgmma.sh racecheck does, with each hazard's lines):
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -lineinfo -o /tmp/rc dev/cuda/racecheck_exchange.cu
//   for f in p pds pds-low pds-mbar mbar; do compute-sanitizer --tool racecheck /tmp/rc $f; done
#include <cstdint>
#include <cstdio>
#include <cstring>

__device__ __forceinline__ void bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void bar_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ uint32_t smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_arrive(uint64_t *bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t *bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(smem_addr(bar)), "r"(parity)
                     : "memory");
    } while (!done);
}

struct form {
    int ready, free, ds_ready, ds_free; // named barriers: the first of each pair (buffer 0; buffer 1 is +1)
    bool ds, p_mbar, ds_mbar;
};

// the handshakes of one direction: the writer waits for `free` two steps after it first wrote a
// buffer, signals `ready`; the reader waits for `ready`, signals `free` while a later write comes
struct handshake {
    bool mbar;
    int ready_id, free_id;
    uint64_t *ready, *free; // mbarriers [2] each, 128 arrivals a phase
    __device__ void before_write(int it) const {
        if (it < 2) return;
        if (mbar) mbar_wait(&free[it & 1], ((it - 2) >> 1) & 1);
        else bar_sync(free_id + (it & 1), 256);
    }
    __device__ void after_write(int it) const {
        if (mbar) mbar_arrive(&ready[it & 1]);
        else bar_arrive(ready_id + (it & 1), 256);
    }
    __device__ void before_read(int it) const {
        if (mbar) mbar_wait(&ready[it & 1], (it >> 1) & 1);
        else bar_sync(ready_id + (it & 1), 256);
    }
    __device__ void after_read(int it, int steps) const {
        if (it + 2 >= steps) return;
        if (mbar) mbar_arrive(&free[it & 1]);
        else bar_arrive(free_id + (it & 1), 256);
    }
};

__global__ void exchange(form f, int steps, int *wrong) {
    __shared__ float xp[2][128];
    __shared__ int xds[2][128];
    __shared__ uint64_t bars[8];
    const int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
    if (threadIdx.x == 0) {
        for (int i = 0; i < 8; i++) asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(&bars[i])), "r"(128) : "memory");
    }
    __syncthreads();
    if (wg == 0) return;
    const handshake hp{f.p_mbar, f.ready, f.free, bars, bars + 2}, hds{f.ds_mbar, f.ds_ready, f.ds_free, bars + 4, bars + 6};
    int bad = 0;
    for (int it = 0; it < steps; it++) {
        const int buf = it & 1;
        if (wg == 1) {
            hp.before_write(it);
            xp[buf][tid] = (float)(it * 1000 + tid);
            hp.after_write(it);
            if (f.ds) {
                hds.before_read(it);
                bad += xds[buf][tid] != it * 7 + tid;
                hds.after_read(it, steps);
            }
        } else {
            hp.before_read(it);
            bad += xp[buf][tid] != (float)(it * 1000 + tid);
            hp.after_read(it, steps);
            if (f.ds) {
                hds.before_write(it);
                xds[buf][tid] = it * 7 + tid;
                hds.after_write(it);
            }
        }
    }
    if (bad) atomicAdd(wrong, bad);
}

int main(int argc, char **argv) {
    const char *name = argc > 1 ? argv[1] : "pds";
    form f{1, 3, 7, 9, true, false, false};
    if (!strcmp(name, "p")) f.ds = false;
    else if (!strcmp(name, "pds-low")) f.ds_ready = 5, f.ds_free = 7;
    else if (!strcmp(name, "pds-mbar")) f.ds_mbar = true;
    else if (!strcmp(name, "mbar")) f.p_mbar = f.ds_mbar = true;
    else if (strcmp(name, "pds")) {
        fprintf(stderr, "racecheck_exchange: unknown form %s (p, pds, pds-low, pds-mbar, mbar)\n", name);
        return 2;
    }
    int *wrong;
    cudaMalloc(&wrong, sizeof(int));
    cudaMemset(wrong, 0, sizeof(int));
    exchange<<<4, 384>>>(f, 9, wrong);
    int h = -1;
    cudaError_t e = cudaMemcpy(&h, wrong, sizeof(int), cudaMemcpyDeviceToHost);
    printf("%s: %s, %d wrong values\n", name, cudaGetErrorString(e), h);
    return e != cudaSuccess || h != 0;
}
