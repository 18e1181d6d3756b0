/* traits.cuh — the tuning values of every CUDA kernel, in one place: tile sizes, thread counts,
 * pipeline stages, register budgets and work orders. The kernels and the dispatcher (tensor-map
 * boxes, grids) read them from here; docs/cuda.md says how each was chosen.
 *
 * Compile-time switches: the only one left is WA_DEBUG_WAIT_TIMEOUT (prims/hopper.cuh, off by
 * default): an mbarrier wait that spins 2^22 times prints the barrier, the parity, the CTA and the
 * thread, and gives up, so that a deadlock shows where it is instead of hanging the process (the
 * results are then wrong). Every other choice is fixed here. */
#ifndef WA_CUDA_TRAITS_CUH
#define WA_CUDA_TRAITS_CUH

/* ---- portable kernels (portable/attn.cu): CUDA cores, any D, f32 too ---- */

/* Threads of a CTA. The kernels are chains of dependent fmaf with shared-memory loads between, one
 * CTA an SM at the larger D: latency-bound, so warps are what hides it. Results do not depend on
 * it (every element's sums run in one thread in a fixed order). */
constexpr int kPortableThreads = 512;

/* ---- mma.sync kernels (sm80/): compute capability 8.0 and up ---- */

constexpr int kSm80FwdThreads = 256; /* 8 warps, 16 query rows each */
/* Above D = 256 an O row of f32 accumulators would take 256 registers a thread, so two warps share
 * 16 query rows (each forms S over one half of D and accumulates O for one half of the columns). */
template <int D> __host__ __device__ constexpr int sm80_fwd_split() { return D > 256 ? 2 : 1; }
template <int D> __host__ __device__ constexpr int sm80_fwd_rows() { return 128 / sm80_fwd_split<D>(); }
/* key tile: 32 at D = 512 keeps Q, K and V (two stages) within 227 KB */
template <int D> __host__ __device__ constexpr int sm80_fwd_keys() { return D <= 256 ? 64 : 32; }

constexpr int kSm80BwdKeys = 64, kSm80BwdRows = 64, kSm80BwdThreads = 256; /* the dK/dV kernel */
constexpr int kSm80DqWarps = 8;                                            /* the dQ kernel: 16 rows a warp */
/* the dQ kernel's key tile: at D = 256 dQ takes 128 registers a thread, so S and dP get half a tile */
template <int D> __host__ __device__ constexpr int sm80_dq_keys() { return D >= 256 ? 32 : 64; }

/* D = 512 backward (sm80/bwd_d512.cu): 32 × 32 pair tiles, D split between warps */
constexpr int kSm80D512Keys = 32, kSm80D512Rows = 32, kSm80D512Threads = 256;

/* ---- wgmma kernels (sm90/): compute capability 9.0, the sm_90a build ---- */

/* warp-specialised CTAs: one producer warpgroup (TMA) and two consumer warpgroups; registers per
 * thread after setmaxnreg: 24 + 2 × 240 fits 65,536 for 3 × 128 threads */
constexpr int kSm90Consumers = 2, kSm90Threads = 128 * (kSm90Consumers + 1);
constexpr int kSm90ProducerRegs = 24, kSm90ConsumerRegs = 240;
constexpr int kSm90Stages = 2; /* the key-tile ring (prims/hopper.cuh: kv_ring) */

/* forward, D = 64, 128, 256 (sm90/fwd.cu): 64 query rows per consumer; the key tile must leave S
 * (64 × keys f32) and O (64 × D) within the consumers' 240 registers */
constexpr int kSm90FwdRows = 64 * kSm90Consumers;
template <int D> __host__ __device__ constexpr int sm90_fwd_keys() { return D == 256 ? 64 : 128; }
/* Rectangular calls run persistent (one CTA per SM walking the work items) in order 2: all heads'
 * query tile t before tile t - 1, each round of gridDim.x items dealt in the opposite direction to
 * the last (sm90/fwd_common.cuh: for_each_item). */
constexpr int kSm90FwdOrder = 2;

/* forward, D = 256 without TMA (sm90/fwd_cp_async.cu): cp.async loads, two warpgroups in step */
constexpr int kSm90CpAsyncRows = 128, kSm90CpAsyncThreads = 256, kSm90CpAsyncKeys = 64;

/* D = 512 (sm90/fwd_d512.cu, sm90/bwd_d512.cu) */
constexpr int kSm90D512 = 512;
constexpr int kSm90FwdD512Rows = 64, kSm90FwdD512Keys = 64; /* Q, K, V of one stage: 192 KB */
constexpr int kSm90FwdD512Order = 2;                        /* persistent order, as kSm90FwdOrder */
constexpr int kSm90DkdvD512Keys = 32;                       /* dK/dV: keys per CTA */
constexpr int kSm90D512QParts = 4;                          /* dK/dV: Q and dO loaded and released in 4 parts along D */
constexpr int kSm90DqD512Rows = 64, kSm90DqD512Keys = 32; /* dQ: query rows per CTA, key tile */
constexpr int kSm90DqD512Stages = 1;                       /* dQ: key-tile ring stages */

/* backward, D = 64, 128, 256 (sm90/bwd_*.cu). By rows (D <= 128): each consumer owns 64 keys with
 * their dK and dV; by output (D = 256): 64 keys a CTA, one consumer owns dV, the other dK. */
template <int D> __host__ __device__ constexpr bool sm90_dkdv_by_rows() { return D <= 128; }
template <int D> __host__ __device__ constexpr int sm90_dkdv_keys() { return sm90_dkdv_by_rows<D>() ? 128 : 64; }
constexpr int kSm90DqRows = 128; /* the deterministic dQ kernel: 64 rows per consumer */
template <int D> __host__ __device__ constexpr int sm90_dq_keys() { return D == 256 ? 32 : 64; }
/* the head dim whose fused dK/dV kernel overlaps its own products with its element-wise work
 * (commit groups inside a step), and the one whose deterministic form is the ordered dQ (the fused
 * kernel adding each dQ block's shares in a fixed order) rather than the dQ kernel */
constexpr int kSm90StepOverlapD = 128, kSm90OrderedDqD = 128;

#endif /* WA_CUDA_TRAITS_CUH */
