// racecheck_exchange.cu — does compute-sanitizer's racecheck follow the named-barrier handshakes
// of the D = 512 dQ kernel (dq_wide_ws_kernel in src/cuda/bwd_hopper.cu)? The kernel below is that
// exchange and nothing else: warpgroup 0 returns at once (the producer, which leaves), warpgroup 1
// writes "P" into one of two buffers and hands it over (bar.arrive → bar.sync), warpgroup 2 reads
// it, frees it (bar.arrive, two steps later synced), and hands "dS" back the same way through two
// more buffers. Every value read is checked, so a handshake that does not order the accesses also
// shows as wrong values. Forms (the first argument):
//   p        P one way only (barriers 1..4), as dkdv_wide_ws_kernel
//   pds      P and dS back, barriers 1..4 and 7..10, as dq_wide_ws_kernel
//   pds-low  the same on barriers 1..8
// Build and run on the H200:
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -lineinfo -o /tmp/rc dev/cuda/racecheck_exchange.cu
//   for f in p pds pds-low; do compute-sanitizer --tool racecheck /tmp/rc $f; done
#include <cstdio>
#include <cstring>

__device__ __forceinline__ void bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void bar_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }

struct form {
    int ready, free, ds_ready, ds_free; // the first of each pair of barrier ids (buffer 0; buffer 1 is +1)
    bool ds;
};

__global__ void exchange(form f, int steps, int *wrong) {
    __shared__ float xp[2][128];
    __shared__ int xds[2][128];
    const int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
    if (wg == 0) return;
    int bad = 0;
    for (int it = 0; it < steps; it++) {
        const int buf = it & 1;
        if (wg == 1) {
            if (it >= 2) bar_sync(f.free + buf, 256);
            xp[buf][tid] = (float)(it * 1000 + tid);
            bar_arrive(f.ready + buf, 256);
            if (f.ds) {
                bar_sync(f.ds_ready + buf, 256);
                bad += xds[buf][tid] != it * 7 + tid;
                if (it + 2 < steps) bar_arrive(f.ds_free + buf, 256);
            }
        } else {
            bar_sync(f.ready + buf, 256);
            bad += xp[buf][tid] != (float)(it * 1000 + tid);
            if (it + 2 < steps) bar_arrive(f.free + buf, 256);
            if (f.ds) {
                if (it >= 2) bar_sync(f.ds_free + buf, 256);
                xds[buf][tid] = it * 7 + tid;
                bar_arrive(f.ds_ready + buf, 256);
            }
        }
    }
    if (bad) atomicAdd(wrong, bad);
}

int main(int argc, char **argv) {
    const char *name = argc > 1 ? argv[1] : "pds";
    form f{1, 3, 7, 9, true};
    if (!strcmp(name, "p")) f.ds = false;
    else if (!strcmp(name, "pds-low")) f.ds_ready = 5, f.ds_free = 7, f.free = 3;
    else if (strcmp(name, "pds")) {
        fprintf(stderr, "racecheck_exchange: unknown form %s (p, pds, pds-low)\n", name);
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
