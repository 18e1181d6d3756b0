# winattn — plain GNU Make. `make` builds the library (static and shared), the winattn command
# and the tests; `make test` runs them; `make install PREFIX=...` installs. `make help` lists
# the rest. Objects go to build/ with dependency files.

CC      ?= cc
PREFIX  ?= /usr/local
BUILD   ?= build
WERROR  ?= 0

# CFLAGS, CPPFLAGS, LDFLAGS and LDLIBS are the user's (`make CFLAGS=-O1 LDFLAGS=-Wl,--as-needed`):
# CFLAGS sets optimisation, debug and extra flags; what the build cannot do without (C11, -fPIC,
# the include path, dependency files) lives in WA_CFLAGS and is always added in front. CFLAGS
# and LDFLAGS go to every link too, so -fsanitize=... or -flto need no second variable.
CFLAGS  ?= -O2 -g
CPPFLAGS ?=
LDFLAGS ?=
LDLIBS  ?=
WARN    := -Wall -Wextra -Wshadow -Wstrict-prototypes -Wmissing-prototypes -Wno-unused-parameter
# -ffp-contract=off: the kernels decide where a multiply and an add fuse (src/cpu/simd.h, vfma);
# GCC in ISO C mode already never fuses on its own, clang does by default.
WA_CFLAGS := -std=c11 $(WARN) -ffp-contract=off -fPIC -Iinclude -MMD -MP
ifeq ($(WERROR),1)
WA_CFLAGS += -Werror
endif
COMPILE  = $(CC) $(WA_CFLAGS) $(CPPFLAGS) $(CFLAGS)
LINK     = $(CC) $(CFLAGS) $(LDFLAGS)
# the library's own link dependencies (also what winattn.pc lists for static linking)
WA_LIBS := -lm -lpthread

# x86-64 gets the AVX-512 and AVX2 builds of the CPU kernels beside the portable one, aarch64
# (Linux aarch64-*, Apple arm64-*) the NEON build; other targets build the portable one only.
# This asks the compiler what it targets; it never probes the machine (dispatch happens at run
# time, so a cross compiler, CC=aarch64-linux-gnu-gcc, gets the target's kernels).
TARGET_ARCH := $(shell $(CC) -dumpmachine 2>/dev/null)
ifneq (,$(findstring x86_64,$(TARGET_ARCH)))
X86 := 1
else ifneq (,$(filter aarch64% arm64%,$(TARGET_ARCH)))
ARM64 := 1
endif
# Apple's linker names a shared library with -install_name instead of -soname
ifneq (,$(findstring darwin,$(TARGET_ARCH)))
SONAME_FLAG = -Wl,-install_name,@rpath/$(SONAME)
else
SONAME_FLAG = -Wl,-soname,$(SONAME)
endif

LIB_SRC := src/winattn.c src/status.c src/overlap.c src/cpu/pool.c src/cpu/dispatch.c src/cpu/dense.c
LIB_OBJ := $(LIB_SRC:%.c=$(BUILD)/%.o) $(BUILD)/src/cpu/attn_generic.o
ifdef X86
LIB_OBJ += $(BUILD)/src/cpu/attn_avx512bf16.o $(BUILD)/src/cpu/attn_avx512.o $(BUILD)/src/cpu/attn_avx2.o
$(BUILD)/src/cpu/dispatch.o: WA_CFLAGS += -DWA_HAVE_X86_KERNELS
endif
ifdef ARM64
LIB_OBJ += $(BUILD)/src/cpu/attn_neon.o
$(BUILD)/src/cpu/dispatch.o: WA_CFLAGS += -DWA_HAVE_NEON_KERNELS
endif

# CUDA: the kernels are built for the GPUs this machine has, with nvcc (NO_CUDA=1 forces them
# off); without them the library gets a stub that reports CUDA as unsupported at run time.
#   CUDA_ARCHS=auto (the default): nvidia-smi's compute capabilities: 9.0 builds sm_90a, 8.x the
#     mma.sync build for that sm, anything newer the compute_80 PTX; no GPU (or no nvidia-smi):
#     no kernels, as NO_CUDA=1
#   CUDA_ARCHS=all: sm_90a, sm_80, sm_86, sm_89 and the compute_80 PTX
#   CUDA_ARCHS="sm_90a sm_80": those (sm_8x from compute_80; compute_80 alone is the PTX)
# Every .cu file gets the same targets: the dispatcher asks one kernel which code the driver
# loaded and takes the answer for all (src/cuda/sm90/fwd.cu: sm90_code_loaded).
NVCC ?= $(shell command -v nvcc 2>/dev/null)
ifeq ($(NO_CUDA),1)
NVCC :=
endif
# the kernel files sit one folder down (portable/, sm80/, sm90/); dispatch.cu at the top
CUDA_SRC := $(wildcard src/cuda/*.cu src/cuda/*/*.cu)
CUDA_HDR := $(wildcard src/cuda/*.cuh src/cuda/*/*.cuh)
CUDA_ARCHS ?= auto
ifeq ($(CUDA_ARCHS),auto)
CUDA_GPU_CAPS := $(if $(NVCC),$(shell nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null))
cuda_arch_of = $(if $(filter 9.0,$(1)),sm_90a,$(if $(filter 8.%,$(1)),sm_$(subst .,,$(1)),$(if $(filter 1%,$(1)),compute_80)))
CUDA_ARCH_LIST := $(sort $(foreach c,$(CUDA_GPU_CAPS),$(call cuda_arch_of,$(c))))
else ifeq ($(CUDA_ARCHS),all)
CUDA_ARCH_LIST := sm_90a sm_80 sm_86 sm_89 compute_80
else
CUDA_ARCH_LIST := $(CUDA_ARCHS)
$(foreach a,$(CUDA_ARCH_LIST),$(if $(filter sm_% compute_%,$(a)),,$(error CUDA_ARCHS: '$(a)' is not an architecture \
    such as sm_90a, sm_80 or compute_80)))
endif
comma := ,
cuda_gencode = $(if $(filter sm_90a,$(1)),-gencode=arch=compute_90a$(comma)code=sm_90a,$(if $(filter compute_%,$(1)),-gencode=arch=$(1)$(comma)code=$(1),-gencode=arch=compute_80$(comma)code=$(1)))
ifneq ($(NVCC),)
ifneq ($(CUDA_SRC),)
# NVCCFLAGS given on the command line bring their own targets
ifneq ($(CUDA_ARCH_LIST)$(filter command line environment,$(origin NVCCFLAGS)),)
CUDA_ON := 1
endif
endif
endif
# the `all` target's closing line: what was built, or why not and how to get the kernels
ifdef CUDA_ON
CUDA_STATUS := CUDA on: $(NVCC), $(or $(CUDA_ARCH_LIST),NVCCFLAGS)
else ifneq ($(NVCC),)
CUDA_STATUS := CUDA off: no GPU found (CUDA_ARCHS=$(CUDA_ARCHS)); CUDA_ARCHS=all or a list such as CUDA_ARCHS='sm_90a sm_80' builds the kernels
else ifeq ($(NO_CUDA),1)
CUDA_STATUS := CUDA off: NO_CUDA=1
else
CUDA_STATUS := CUDA off: nvcc not found
endif
ifdef CUDA_ON
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(realpath $(NVCC)))
NVCCFLAGS ?= -O3 -lineinfo $(foreach a,$(CUDA_ARCH_LIST),$(call cuda_gencode,$(a))) -Xcompiler -fPIC -Iinclude -std=c++17
# a host function that calls itself forever is an error where nvcc's host compiler (g++ unless
# -ccbin says otherwise) can tell: CI builds the CUDA sources but runs none of them, and one such
# function once hung every varlen call on the GPU
NVCC_HOST_CHECKS := $(shell echo 'int main(){return 0;}' | g++ -x c++ -Werror=infinite-recursion -fsyntax-only - 2>/dev/null && echo -Xcompiler -Werror=infinite-recursion)
NVCCFLAGS += $(NVCC_HOST_CHECKS)
LIB_OBJ  += $(CUDA_SRC:%.cu=$(BUILD)/%.o)
# the static runtime: binaries start on machines without the CUDA toolkit's libraries (CI),
# where wa_device_available(WA_DEVICE_CUDA) then reports 0
WA_LIBS  += -L$(CUDA_HOME)/lib64 -lcudart_static -ldl -lrt -lstdc++
else
LIB_OBJ  += $(BUILD)/src/cuda/stub.o
endif

REF_OBJ  := $(BUILD)/src/ref/oracle.o $(BUILD)/src/ref/case.o
TOOL_SRC := $(wildcard tools/*.c)
TOOL_OBJ := $(TOOL_SRC:%.c=$(BUILD)/%.o)
# formats/: the safetensors reader and writer, atomic output files and the platform layer, below
# both the trainer and the command (tests/test_layers.sh checks the order)
FORMATS_SRC := $(wildcard formats/*.c)
FORMATS_OBJ := $(FORMATS_SRC:%.c=$(BUILD)/%.o)
# jansson for the command's JSON; JANSSON_CFLAGS/JANSSON_LIBS point elsewhere when the
# machine has no libjansson-dev (e.g. a carried copy on the GPU machine)
JANSSON_CFLAGS ?=
JANSSON_LIBS ?= -ljansson
TOOL_LIBS := $(JANSSON_LIBS)
# Without jansson the objects that include it stop the build with one line saying what to install
# (scripts/deps.sh does it); the library alone (`make lib`, pip) does not need it.
HAVE_JANSSON := $(shell printf '\043include <jansson.h>\nint main(void){return json_object()==0;}\n' | \
                $(CC) $(CPPFLAGS) $(JANSSON_CFLAGS) -x c - -x none $(LDFLAGS) $(JANSSON_LIBS) -o /dev/null >/dev/null 2>&1 && echo 1)
# libyaml for `winattn train -c FILE` (tools/train_yaml.c, mlx-lm's config files): Debian's
# libyaml-dev; YAML_CFLAGS/YAML_LIBS point elsewhere as JANSSON_CFLAGS/JANSSON_LIBS do. Only the
# command links it; without it the build stops with one line saying what to install.
YAML_CFLAGS ?=
YAML_LIBS ?= -lyaml
HAVE_YAML := $(shell printf '\043include <yaml.h>\nint main(void){yaml_parser_t p;return !yaml_parser_initialize(&p);}\n' | \
                $(CC) $(CPPFLAGS) $(YAML_CFLAGS) -x c - -x none $(LDFLAGS) $(YAML_LIBS) -o /dev/null >/dev/null 2>&1 && echo 1)

# The trainer (train/, `winattn train`): a library of its own, $(BUILD)/libwinattn_train.a, which
# the command links through one header, train/train.h; not part of libwinattn. Its matrix
# products use OpenBLAS when it links (libopenblas-dev), else built-in loops.
HAVE_CBLAS := $(shell printf '\043include <cblas.h>\nint main(void){openblas_set_num_threads(1);return 0;}\n' | \
                $(CC) $(CPPFLAGS) $(CFLAGS) -x c - $(LDFLAGS) -lopenblas -o /dev/null >/dev/null 2>&1 && echo 1)
TRAIN_SRC  := train/train.c train/config.c train/checkpoint.c train/quant.c train/data.c train/linalg.c train/adapters.c train/trainer.c
TRAIN_LIB  := $(BUILD)/libwinattn_train.a
TRAIN_OBJ  := $(TRAIN_SRC:%.c=$(BUILD)/%.o) $(BUILD)/train/model_f32.o $(BUILD)/train/model_f64.o
TRAIN_LIBS :=
# `winattn train --device cuda` (train/model_cuda.cu): built with the CUDA backend; cuBLAS is
# opened with dlopen when a run asks for the GPU, so nothing new is linked
ifdef CUDA_ON
TRAIN_OBJ  += $(BUILD)/train/model_cuda.o
else
TRAIN_OBJ  += $(BUILD)/train/model_cuda_stub.o
endif
ifeq ($(HAVE_CBLAS),1)
$(BUILD)/train/linalg.o: WA_CFLAGS += -DWA_HAVE_CBLAS
TRAIN_LIBS := -lopenblas
endif

TEST_NAMES := test_geometry test_convert test_oracle test_kernels test_api test_safetensors test_nonfinite test_fork test_atomic_file
# tests/test_misuse.c (hostile and odd inputs; run under `make sanitize`) builds once it exists
TEST_NAMES += $(if $(wildcard tests/test_misuse.c),test_misuse)
TESTS    := $(TEST_NAMES:%=$(BUILD)/tests/%) $(BUILD)/tests/cli_helper $(BUILD)/tests/test_train \
            $(BUILD)/tests/test_train_data $(BUILD)/tests/test_train_quant $(BUILD)/tests/test_train_adapters $(BUILD)/tests/test_train_ckpt $(BUILD)/tests/test_train_cuda

STATIC   := $(BUILD)/libwinattn.a
SHARED   := $(BUILD)/libwinattn.so
SONAME   := libwinattn.so.0
# the version's one source is include/winattn.h (WINATTN_VERSION_*): wa_version(), the Python
# package (python/setup.py) and winattn.pc read it from there
WA_VERSION := $(shell sed -n 's/^\#define WINATTN_VERSION_[A-Z]* \([0-9]*\)$$/\1/p' include/winattn.h | paste -sd. -)

.PHONY: all lib tests test test-long sanitize install uninstall clean help fuzz fuzz-check demo tile-gemm no-jansson no-yaml torch-ext
# keep intermediate objects (and keep make quiet after the test summary)
.SECONDARY:
all: lib $(BUILD)/winattn $(TESTS)
	@echo "winattn: built ($(CUDA_STATUS))"

lib: $(STATIC) $(SHARED)
tests: $(TESTS)

ifneq ($(HAVE_JANSSON),1)
$(TOOL_OBJ) $(TRAIN_OBJ) $(BUILD)/formats/safetensors.o $(BUILD)/tests/test_safetensors.o $(BUILD)/tests/test_train.o $(BUILD)/tests/test_train_data.o $(BUILD)/tests/test_train_quant.o $(BUILD)/tests/test_train_adapters.o $(BUILD)/tests/test_train_ckpt.o $(BUILD)/tests/test_train_cuda.o $(BUILD)/tests/cli_helper.o: | no-jansson
no-jansson:
	@echo "winattn: jansson not found (<jansson.h>, -ljansson): run 'sh scripts/deps.sh', or apt-get install libjansson-dev pkg-config" >&2
	@exit 1
endif
ifneq ($(HAVE_YAML),1)
$(BUILD)/tools/train_yaml.o $(BUILD)/winattn: | no-yaml
no-yaml:
	@echo "winattn: libyaml not found (<yaml.h>, -lyaml; winattn train -c reads YAML with it): run 'sh scripts/deps.sh', or apt-get install libyaml-dev (YAML_CFLAGS/YAML_LIBS point at another copy)" >&2
	@exit 1
endif

$(STATIC): $(LIB_OBJ)
	@mkdir -p $(@D)
	rm -f $@
	ar rcs $@ $^

$(SHARED): $(LIB_OBJ)
	@mkdir -p $(@D)
	$(LINK) -shared $(SONAME_FLAG) -o $@ $^ $(WA_LIBS) $(LDLIBS)

$(BUILD)/%.o: %.c
	@mkdir -p $(@D)
	$(COMPILE) -c $< -o $@

# One source, one build per ISA (src/cpu/simd.h): four on x86-64, NEON and generic on aarch64.
$(BUILD)/src/cpu/attn_avx512bf16.o: src/cpu/attn_cpu.c
	@mkdir -p $(@D)
	$(COMPILE) -DWA_ISA_AVX512 -DWA_BF16_DOT -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -mfma -c $< -o $@
$(BUILD)/src/cpu/attn_avx512.o: src/cpu/attn_cpu.c
	@mkdir -p $(@D)
	$(COMPILE) -DWA_ISA_AVX512 -mavx512f -mavx512bw -mavx512vl -mfma -c $< -o $@
$(BUILD)/src/cpu/attn_avx2.o: src/cpu/attn_cpu.c
	@mkdir -p $(@D)
	$(COMPILE) -DWA_ISA_AVX2 -mavx2 -mfma -c $< -o $@
$(BUILD)/src/cpu/attn_neon.o: src/cpu/attn_cpu.c
	@mkdir -p $(@D)
	$(COMPILE) -DWA_ISA_NEON -c $< -o $@
$(BUILD)/src/cpu/attn_generic.o: src/cpu/attn_cpu.c
	@mkdir -p $(@D)
	$(COMPILE) -DWA_ISA_GENERIC -c $< -o $@

# nvcc writes no dependency files here: the .cu objects depend on every header they may include
$(BUILD)/src/cuda/%.o: src/cuda/%.cu $(CUDA_HDR) $(wildcard src/*.h) include/winattn.h
	@mkdir -p $(@D)
	$(NVCC) $(NVCCFLAGS) -c $< -o $@

# model.c twice: float for training, double for the finite-difference tests
$(BUILD)/train/model_cuda.o: train/model_cuda.cu formats/platform.h train/quant_cuda.cuh train/quant.h train/model_cuda.h train/model.h train/model_generic.h train/config.h train/checkpoint.h train/train.h include/winattn.h src/convert.h
	@mkdir -p $(@D)
	$(NVCC) $(NVCCFLAGS) -Itrain -Isrc -Iformats -c $< -o $@
$(BUILD)/train/model_f32.o: train/model.c
	@mkdir -p $(@D)
	$(COMPILE) -c $< -o $@
$(BUILD)/train/model_f64.o: train/model.c
	@mkdir -p $(@D)
	$(COMPILE) -DMODEL_F64 -c $< -o $@

$(TRAIN_LIB): $(TRAIN_OBJ)
	rm -f $@
	ar rcs $@ $^

$(BUILD)/winattn: $(TOOL_OBJ) $(REF_OBJ) $(TRAIN_LIB) $(FORMATS_OBJ) $(STATIC)
	$(LINK) -o $@ $^ $(TOOL_LIBS) $(YAML_LIBS) $(TRAIN_LIBS) $(WA_LIBS) $(LDLIBS)

$(BUILD)/tests/test_train: $(BUILD)/tests/test_train.o $(BUILD)/tests/check.o $(TRAIN_LIB) $(FORMATS_OBJ) $(STATIC)
	$(LINK) -o $@ $^ $(TOOL_LIBS) $(TRAIN_LIBS) $(WA_LIBS) $(LDLIBS)

$(BUILD)/tests/test_train_data: $(BUILD)/tests/test_train_data.o $(BUILD)/tests/check.o $(TRAIN_LIB) $(FORMATS_OBJ) $(STATIC)
	$(LINK) -o $@ $^ $(TOOL_LIBS) $(TRAIN_LIBS) $(WA_LIBS) $(LDLIBS)
$(BUILD)/tests/test_train_quant: $(BUILD)/tests/test_train_quant.o $(BUILD)/tests/check.o $(TRAIN_LIB) $(FORMATS_OBJ) $(STATIC)
	$(LINK) -o $@ $^ $(TOOL_LIBS) $(TRAIN_LIBS) $(WA_LIBS) $(LDLIBS)
$(BUILD)/tests/test_train_ckpt: $(BUILD)/tests/test_train_ckpt.o $(BUILD)/tests/check.o $(TRAIN_LIB) $(FORMATS_OBJ) $(STATIC)
	$(LINK) -o $@ $^ $(TOOL_LIBS) $(TRAIN_LIBS) $(WA_LIBS) $(LDLIBS)
$(BUILD)/tests/test_train_adapters: $(BUILD)/tests/test_train_adapters.o $(BUILD)/tests/check.o $(TRAIN_LIB) $(FORMATS_OBJ) $(STATIC)
	$(LINK) -o $@ $^ $(TOOL_LIBS) $(TRAIN_LIBS) $(WA_LIBS) $(LDLIBS)

$(BUILD)/tests/test_train_cuda: $(BUILD)/tests/test_train_cuda.o $(BUILD)/tests/check.o $(TRAIN_LIB) $(FORMATS_OBJ) $(STATIC)
	$(LINK) -o $@ $^ $(TOOL_LIBS) $(TRAIN_LIBS) $(WA_LIBS) $(LDLIBS)

$(BUILD)/tests/test_safetensors: $(BUILD)/tests/test_safetensors.o $(FORMATS_OBJ)
	$(LINK) -o $@ $^ $(TOOL_LIBS) $(WA_LIBS) $(LDLIBS)

$(BUILD)/tests/test_atomic_file: $(BUILD)/tests/test_atomic_file.o $(FORMATS_OBJ)
	$(LINK) -o $@ $^ $(TOOL_LIBS) $(WA_LIBS) $(LDLIBS)

$(BUILD)/tests/cli_helper: $(BUILD)/tests/cli_helper.o $(BUILD)/tests/check.o $(FORMATS_OBJ) $(REF_OBJ) $(STATIC)
	$(LINK) -o $@ $^ $(TOOL_LIBS) $(WA_LIBS) $(LDLIBS)

$(BUILD)/tests/%: $(BUILD)/tests/%.o $(BUILD)/tests/check.o $(REF_OBJ) $(STATIC)
	$(LINK) -o $@ $^ $(WA_LIBS) $(LDLIBS)

# Include paths follow the layers (tests/test_layers.sh): include/ < src/ < formats/ < train/ <
# tools/ < tests/; a folder sees the ones below it, never one above
$(BUILD)/tests/%.o: WA_CFLAGS += -Isrc -Iformats -Itrain -Itools $(JANSSON_CFLAGS)
$(BUILD)/tools/%.o: WA_CFLAGS += -Isrc -Iformats -Itrain $(JANSSON_CFLAGS) $(YAML_CFLAGS)
$(BUILD)/train/%.o: WA_CFLAGS += -Isrc -Iformats $(JANSSON_CFLAGS)
$(BUILD)/formats/%.o: WA_CFLAGS += $(JANSSON_CFLAGS)

# EXTRA=all (or a list of portability, sanitize, fuzz, aarch64, cuda) adds tests/extra_checks.sh's checks; CI runs all
EXTRA ?=
test: all
	@EXTRA="$(EXTRA)" sh tests/run_tests.sh $(BUILD)

# winattn's tile micro-kernels against OpenBLAS sgemm/sbgemm on the kernels' tile shapes (x86 with
# OpenBLAS only; docs/cpu.md has the result).
$(BUILD)/bench/tile_gemm: bench/tile_gemm.c $(STATIC)
	@mkdir -p $(@D)
	$(COMPILE) $(LDFLAGS) -Isrc -o $@ $< $(STATIC) -lopenblas $(WA_LIBS) $(LDLIBS)
tile-gemm: $(BUILD)/bench/tile_gemm
	$(BUILD)/bench/tile_gemm

# The library, the command and the tests built with AddressSanitizer and UBSan in build-san
# (SAN_BUILD), for the misuse tests: e.g. `make sanitize && build-san/tests/test_misuse`, or
# `sh tests/test_cli.sh build-san`. `make test EXTRA=sanitize` runs the tests and parity --quick with it.
SAN_BUILD ?= build-san
SAN_CFLAGS ?= -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined
sanitize:
	$(MAKE) BUILD=$(SAN_BUILD) NO_CUDA=1 CFLAGS="$(SAN_CFLAGS)" all

# winattn.torch's C++ eager path (python/winattn/_torch_ext.cpp) for the torch that $(PYTHON)
# imports, into $(BUILD)/torch_ext/torch-VERSION/; winattn.torch takes it when it is there.
PYTHON ?= python3
torch-ext: lib
	$(PYTHON) python/build_torch_ext.py --build $(BUILD)

# The trainer demo: corpus, a small random Gemma 4, a short LoRA run with held-out loss.
demo: all
	@sh train/demo.sh $(BUILD)

# The full parity sweep and probe (tens of minutes on two cores).
test-long: all
	$(BUILD)/winattn parity
	$(BUILD)/winattn probe --dense

# libFuzzer targets (clang and libclang-rt-14-dev or newer; ASan, UBSan, LeakSanitizer) in
# $(BUILD)/fuzz/: fuzz_safetensors (formats/safetensors.c), fuzz_config (config.json,
# train/config.c), fuzz_data (training JSONL, train/data.c) and fuzz_state (adapters.safetensors,
# optimizer.safetensors, adapter_config.json: train/trainer.c on a tiny model). The sources they
# test are compiled in with clang; fuzz_state links the library as $(STATIC) and the built-in
# matrix loops (no OpenBLAS). `make fuzz-check` runs each for FUZZ_SECONDS from its corpus
# (tests/fuzz/corpus*, read only; new inputs go to $(BUILD)/fuzz/found-NAME) and fails on any
# crash, leak, hang or contract break. docs/fuzzing.md has the commands and the long runs.
FUZZ_CC ?= clang
FUZZ_SECONDS ?= 45
FUZZ_TARGETS := safetensors config data state
FUZZ_FLAGS = -std=c11 -g -O1 -fsanitize=fuzzer,address,undefined $(CPPFLAGS) -Iinclude -Isrc -Iformats -Itrain $(JANSSON_CFLAGS)
FUZZ_HDRS := $(wildcard formats/*.h train/*.h) include/winattn.h
fuzz: $(FUZZ_TARGETS:%=$(BUILD)/fuzz/fuzz_%)
	@echo "run: make fuzz-check BUILD=$(BUILD) [FUZZ_SECONDS=600], or one: $(BUILD)/fuzz/fuzz_config -max_total_time=600 DIR tests/fuzz/corpus_config"
$(BUILD)/fuzz/fuzz_safetensors: tests/fuzz/fuzz_safetensors.c formats/safetensors.c formats/atomic_file.c $(FUZZ_HDRS)
	@mkdir -p $(@D)
	$(FUZZ_CC) $(FUZZ_FLAGS) $(filter %.c,$^) $(LDFLAGS) $(JANSSON_LIBS) -lm -o $@
$(BUILD)/fuzz/fuzz_config: tests/fuzz/fuzz_config.c train/config.c $(FUZZ_HDRS)
	@mkdir -p $(@D)
	$(FUZZ_CC) $(FUZZ_FLAGS) $(filter %.c,$^) $(LDFLAGS) $(JANSSON_LIBS) -lm -o $@
$(BUILD)/fuzz/fuzz_data: tests/fuzz/fuzz_data.c train/data.c $(FUZZ_HDRS)
	@mkdir -p $(@D)
	$(FUZZ_CC) $(FUZZ_FLAGS) $(filter %.c,$^) $(LDFLAGS) $(JANSSON_LIBS) -lm -o $@
$(BUILD)/fuzz/fuzz_state: tests/fuzz/fuzz_state.c $(TRAIN_SRC) train/model.c train/model_cuda_stub.c $(FORMATS_SRC) $(FUZZ_HDRS) $(STATIC)
	@mkdir -p $(@D)
	$(FUZZ_CC) $(FUZZ_FLAGS) $(filter %.c,$^) $(STATIC) $(LDFLAGS) $(JANSSON_LIBS) $(WA_LIBS) -o $@
# one line per target: PASS with the inputs run, or FAIL with where the input is; exit 1 on any FAIL
fuzz-check: fuzz
	@rc=0; for t in $(FUZZ_TARGETS); do \
	    corpus=tests/fuzz/corpus_$$t; [ $$t = safetensors ] && corpus=tests/fuzz/corpus; \
	    mkdir -p $(BUILD)/fuzz/found-$$t; log=$(BUILD)/fuzz/fuzz_$$t.log; start=$$(date +%s); \
	    if $(BUILD)/fuzz/fuzz_$$t -max_total_time=$(FUZZ_SECONDS) -timeout=10 -print_final_stats=1 \
	        -artifact_prefix=$(BUILD)/fuzz/$$t- $(BUILD)/fuzz/found-$$t $$corpus >$$log 2>&1; then \
	        runs=$$(sed -n 's/^stat::number_of_executed_units: *//p' $$log); \
	        echo "PASS fuzz $$t: $${runs:-?} inputs in $$(( $$(date +%s) - start )) s, no crash, no leak, no hang, no contract break"; \
	    else \
	        grep -E 'ERROR|SUMMARY|Test unit written' $$log | head -n 10; rc=1; \
	        echo "FAIL fuzz $$t (log $$log; the input is $(BUILD)/fuzz/$$t-*, replay: $(BUILD)/fuzz/fuzz_$$t FILE)"; \
	    fi; \
	done; exit $$rc

install: lib
	install -d $(DESTDIR)$(PREFIX)/include $(DESTDIR)$(PREFIX)/lib/pkgconfig $(DESTDIR)$(PREFIX)/bin
	install -m 644 include/winattn.h $(DESTDIR)$(PREFIX)/include/
	install -m 644 $(STATIC) $(DESTDIR)$(PREFIX)/lib/
	install -m 755 $(SHARED) $(DESTDIR)$(PREFIX)/lib/$(SONAME)
	ln -sf $(SONAME) $(DESTDIR)$(PREFIX)/lib/libwinattn.so
	if [ -f $(BUILD)/winattn ]; then install -m 755 $(BUILD)/winattn $(DESTDIR)$(PREFIX)/bin/; fi
	sed -e 's|@PREFIX@|$(PREFIX)|' -e 's|@LIBS@|$(WA_LIBS)|' -e 's|@VERSION@|$(WA_VERSION)|' winattn.pc.in > $(DESTDIR)$(PREFIX)/lib/pkgconfig/winattn.pc

uninstall:
	rm -f $(DESTDIR)$(PREFIX)/include/winattn.h $(DESTDIR)$(PREFIX)/lib/libwinattn.a \
	      $(DESTDIR)$(PREFIX)/lib/libwinattn.so $(DESTDIR)$(PREFIX)/lib/$(SONAME) \
	      $(DESTDIR)$(PREFIX)/lib/pkgconfig/winattn.pc $(DESTDIR)$(PREFIX)/bin/winattn

clean:
	rm -rf $(BUILD)

help:
	@echo "make            library, build/winattn, tests"
	@echo "make test       unit tests, parity --quick, probe --quick (ends 'N passed, N failed')"
	@echo "make test EXTRA=all   adds clang -Wpedantic (x86-64, aarch64), ASan+UBSan, libFuzzer, aarch64 under qemu, the CUDA build"
	@echo "                (sh scripts/deps.sh --extra installs what they need; CI runs it)"
	@echo "make test-long  the full parity sweep and the full memory probe"
	@echo "make tile-gemm  winattn's tile micro-kernels vs OpenBLAS sgemm/sbgemm (x86 + OpenBLAS)"
	@echo "make torch-ext  winattn.torch's C++ eager path for the installed torch (PYTHON=python3)"
	@echo "make demo       corpus + small random Gemma 4 + a short LoRA run through winattn (a few minutes)"
	@echo "make install    PREFIX=$(PREFIX): header, libwinattn.{a,so}, winattn, pkg-config file"
	@echo "make fuzz       libFuzzer targets for the file readers (safetensors, config.json, JSONL, adapter state); make fuzz-check runs them"
	@echo "make sanitize   library, winattn and tests with ASan + UBSan in $(SAN_BUILD) (make test EXTRA=sanitize runs them)"
	@echo "options: NO_CUDA=1, WERROR=1, CC=clang, BUILD=dir; CFLAGS (default -O2 -g), CPPFLAGS, LDFLAGS, LDLIBS add to the build's own flags"

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
