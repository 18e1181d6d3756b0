#!/bin/sh
# test_layers.sh — the repository's layers and the absence of circles, read from the compiler,
# the linker's view of the objects and the Python parser rather than from anyone's memory.
#
# The rule. Folders, bottom to top:
#     include/ < src/ (the library) < src/ref/ (the float64 oracle) < formats/ < train/ < tools/ < tests/
#   - A file may include (and its object may call) files of its own folder and of folders below
#     it, never one above: the library never sees the oracle, the file formats, the trainer or the
#     command; the trainer never sees the command. tests/ may include anything.
#   - formats/ (safetensors, atomic output files, the platform layer) stands on include/ alone:
#     it uses no part of the library's internals, so both the trainer and the command can take it.
#   - The trainer is a library with one interface: outside train/ (tests aside) no file reaches a
#     train/ header other than train/train.h, directly or through another header.
#   - No circle between files: not in the C/C++ includes, not between the objects of the build
#     (one calling into another and back), not in the imports of the Python package.
#
# How. `make -n` with a scratch BUILD (and NVCC=nvcc CUDA_ARCHS=all, so the CUDA rules print too;
# nothing is run) lists every compile the Makefile does with its flags; .c files under src/ formats/ train/
# tools/ tests/ that no rule of `all` compiles (tests/fuzz) get their folder's pattern rule, also
# from `make -n`. Each translation unit is preprocessed with its own -I/-D/-std flags by `$CC -E -H`
# (.cu by `g++ -x c++ -E -H`, the CUDA headers as -isystem), whose tree of opened headers gives
# the direct include edges; where the CUDA headers are missing, a .cu falls back to
# `g++ -MM -MG` (its headers as edges of the unit itself, noted in the output). Objects: `nm` on
# the objects of BUILD that the Makefile builds today (strong definitions only), skipped when
# BUILD has none. Python: every import statement of python/winattn/*.py found by `ast`,
# including those inside functions (listed as lazy).
# usage: tests/test_layers.sh BUILD_DIR
BUILD=${1:-build}
if ! command -v python3 >/dev/null 2>&1; then
    echo "SKIP layers: python3 is not installed"
    echo "0 passed, 0 failed"
    exit 0
fi
exec python3 - "$BUILD" <<'EOF'
import ast, glob, os, re, shlex, shutil, subprocess, sys, tempfile

BUILD = sys.argv[1]
ROOT = os.getcwd()
passed = failed = 0


def ok(msg):
    global passed
    passed += 1
    print("PASS layers: " + msg)


def bad(msg):
    global failed
    failed += 1
    print("FAIL layers: " + msg)


ORDER = ["include", "src", "src/ref", "formats", "train", "tools", "tests"]
# what a file in each folder may include or call (tests: anything)
ALLOWED = {
    "include": {"include"},
    "src": {"include", "src"},
    "src/ref": {"include", "src", "src/ref"},
    "formats": {"include", "formats"},
    "train": {"include", "src", "formats", "train"},
    "tools": {"include", "src", "src/ref", "formats", "train", "tools"},
    "tests": set(ORDER),
}


def folder(path):
    """the layer of a repository path, or None outside the layers"""
    if path.startswith("src/ref/"):
        return "src/ref"
    top = path.split("/", 1)[0]
    return top if top in ORDER and "/" in path else None


def rel(path):
    """path relative to the repository root, or None for a file outside it"""
    p = os.path.normpath(os.path.join(ROOT, path))
    if not p.startswith(ROOT + os.sep):
        return None
    return os.path.relpath(p, ROOT)


# ---- the compiles the Makefile does ----
env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
scratch = tempfile.mkdtemp(prefix="winattn-layers-")


def make_n(*targets):
    r = subprocess.run(["make", "-n", "BUILD=" + scratch, "NO_CUDA=", "NVCC=nvcc", "CUDA_ARCHS=all"] + list(targets),
                       cwd=ROOT, env=env, capture_output=True, text=True)
    return r.stdout


def compiles(text):
    """(source, flags, object) for each compile line of make -n output"""
    out = []
    for line in text.splitlines():
        if " -c " not in line:
            continue
        try:
            words = shlex.split(line)
        except ValueError:
            continue
        for i, w in enumerate(words[:-1]):
            if w == "-c" and re.search(r"\.(c|cu)$", words[i + 1]):
                src = words[i + 1]
                obj = words[words.index("-o") + 1] if "-o" in words else None
                flags = [f for f in words if re.match(r"-(I|D|U|std=)", f)]
                out.append((src, flags, obj))
    return out


units = compiles(make_n("all"))
seen = {u[0] for u in units}
leftover = sorted(f for d in ("src", "formats", "train", "tools", "tests") for ext in ("c", "cu")
                  for f in glob.glob(d + "/**/*." + ext, recursive=True) if f not in seen)
if leftover:
    units += compiles(make_n(*[os.path.join(scratch, os.path.splitext(f)[0] + ".o") for f in leftover]))
shutil.rmtree(scratch, ignore_errors=True)
missing = sorted(set(leftover) - {u[0] for u in units})
for f in missing:
    bad("%s: `make -n` prints no compile for it" % f)
if not units:
    bad("`make -n all` printed no compile command")

cc = os.environ.get("CC") or "cc"
if not shutil.which(cc.split()[0]):
    cc = "cc"
nvcc = shutil.which("nvcc")
cuda_inc = [d for d in (os.environ.get("CUDA_HOME", "") + "/include",
                        os.path.join(os.path.dirname(os.path.dirname(nvcc)), "include") if nvcc else "",
                        "/usr/local/cuda/include") if d != "/include" and os.path.exists(os.path.join(d, "cuda_runtime.h"))]

edges = {}  # file -> set of files it includes directly
reach = {}  # translation unit -> every repository file it opens
fallback = []


def add_edge(a, b):
    edges.setdefault(a, set()).add(b)
    edges.setdefault(b, set())


def h_tree(src, cmd):
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        errors = [l for l in r.stderr.splitlines() if "error" in l] or r.stderr.splitlines() or ["?"]
        return None, errors[0]
    stack = [src]
    files = set()
    for line in r.stderr.splitlines():
        m = re.match(r"^(\.+) (.*)$", line)
        if not m:
            continue
        depth, path = len(m.group(1)), rel(m.group(2))
        del stack[depth:]
        if path is None:  # a system header: nothing of ours lies below it
            stack.append(None)
            continue
        if stack[-1] is not None:
            add_edge(stack[-1], path)
        files.add(path)
        stack.append(path)
    return files, None


for src, flags, obj in sorted(set((u[0], tuple(u[1]), u[2]) for u in units)):
    flags = list(flags)
    edges.setdefault(src, set())
    if src.endswith(".cu"):
        std = [f for f in flags if f.startswith("-std=")] or ["-std=c++17"]
        base = ["g++", "-x", "c++"] + std + [f for f in flags if not f.startswith("-std=")]
        files, err = (None, "no CUDA headers")
        if cuda_inc:
            files, err = h_tree(src, base + ["-isystem", cuda_inc[0], "-E", "-H", src, "-o", os.devnull])
        if files is None:
            if cuda_inc:
                print("NOTE layers: %s: g++ -E -H failed (%s); its headers from g++ -MM -MG instead" % (src, err))
            r = subprocess.run(base + ["-MM", "-MG", src], cwd=ROOT, capture_output=True, text=True)
            if r.returncode != 0:
                bad("%s: cannot list its headers: %s" % (src, r.stderr.strip().splitlines()[-1:]))
                continue
            deps = r.stdout.replace("\\\n", " ").split(":", 1)[1].split()
            files = {p for p in (rel(d) if "/" in d else None for d in deps[1:]) if p}
            for p in files:
                add_edge(src, p)
            fallback.append(src)
    else:
        files, err = h_tree(src, cc.split() + flags + ["-E", "-H", src, "-o", os.devnull])
        if files is None:
            bad("%s: the preprocessor failed: %s" % (src, err))
            continue
    reach[src] = reach.get(src, set()) | files

nfiles = len(edges)
nedges = sum(len(v) for v in edges.values())
ok("%d translation units preprocessed (%s%s), %d include edges between %d files" %
   (len({u[0] for u in units}), cc + " -E -H" + (", g++ -x c++ -E -H" if any(u[0].endswith(".cu") for u in units) else ""), "; -MM -MG for " + ", ".join(fallback) if fallback else "", nedges, nfiles))


# ---- circles ----
def cycles(graph):
    """the strongly connected components with more than one node (or a self edge)"""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]
    sys.setrecursionlimit(100000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def layer_violations(graph, what):
    n = 0
    for a in sorted(graph):
        fa = folder(a)
        if fa is None:
            continue
        for b in sorted(graph[a]):
            fb = folder(b)
            if fb is None:
                if fa != "tests":
                    bad("%s %s %s, outside the layers (%s)" % (a, what, b, " < ".join(o + "/" for o in ORDER)))
                    n += 1
            elif fb not in ALLOWED[fa]:
                if ORDER.index(fb) > ORDER.index(fa):
                    bad("%s %s %s: %s/ is above %s/" % (a, what, b, fb, fa))
                else:
                    bad("%s %s %s: %s/ may use only %s" % (a, what, b, fa,
                                                          ", ".join(o + "/" for o in ORDER if o in ALLOWED[fa])))
                n += 1
    return n


circles = cycles(edges)
for c in circles:
    bad("include circle among: " + ", ".join(c))
if not circles:
    ok("no include circle between files")
if layer_violations(edges, "includes") == 0:
    ok("no file includes one in a folder above its own (%s; formats/ on include/ alone)" %
       " < ".join(o + "/" for o in ORDER))

iface = 0
for unit in sorted(reach):
    if folder(unit) in ("train", "tests"):
        continue
    for f in sorted(reach[unit]):
        if folder(f) == "train" and f != "train/train.h":
            bad("%s reaches %s: outside train/, the trainer's only header is train/train.h" % (unit, f))
            iface += 1
users = sorted(u for u in reach if folder(u) not in ("train", "tests") and "train/train.h" in reach[u])
if iface == 0:
    ok("the trainer is reached through train/train.h alone (%s)" % (", ".join(users) or "no user"))

# ---- objects: who calls whom ----
objs = []
for src, flags, obj in units:
    if obj and folder(src) in ("src", "src/ref", "formats", "train", "tools"):
        path = os.path.join(BUILD, os.path.relpath(obj, scratch))
        if os.path.exists(path):
            objs.append((os.path.relpath(obj, scratch), path))
objs = sorted(set(objs))
if not objs or not shutil.which("nm"):
    print("SKIP layers: object circles (no objects in %s, or no nm)" % BUILD)
else:
    defs, undef = {}, {}
    for name, path in objs:
        r = subprocess.run(["nm", "-P", path], capture_output=True, text=True)
        undef[name] = set()
        for line in r.stdout.splitlines():
            w = line.split()
            if len(w) < 2:
                continue
            if w[1] == "U":
                undef[name].add(w[0])
            elif w[1] in "TDBRC" or w[1] == "G" or w[1] == "S":  # strong, global
                defs.setdefault(w[0], set()).add(name)
    calls = {name: set() for name, _ in objs}
    for name in calls:
        for s in undef[name]:
            d = defs.get(s, set())
            if len(d) == 1 and name not in d:
                calls[name] |= d
    circles = cycles(calls)
    for c in circles:
        bad("objects calling each other in a circle: " + ", ".join(c))
    if not circles:
        ok("no circle between the %d objects of %s (nm: an object calling into another and back)" % (len(objs), BUILD))
    if layer_violations(calls, "calls into") == 0:
        ok("no object calls into a folder above its own")

# ---- Python ----
pkg = "python/winattn"
mods = {os.path.basename(f)[:-3]: f for f in glob.glob(pkg + "/*.py")}
imports, lazy = {m: set() for m in mods}, []


def target(name):
    """the module of the package that `import winattn.NAME...` names, or the package itself"""
    first = name.split(".")[0] if name else ""
    return first if first in mods else "__init__"


for m, f in sorted(mods.items()):
    tree = ast.parse(open(f, encoding="utf-8").read(), f)
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    inner = {id(n) for fn in funcs for n in ast.walk(fn) if n is not fn}
    for node in ast.walk(tree):
        got = []
        if isinstance(node, ast.Import):
            got = [target(a.name[len("winattn."):]) for a in node.names
                   if a.name == "winattn" or a.name.startswith("winattn.")]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 1 or (node.level == 0 and module.split(".")[0] == "winattn"):
                sub = module if node.level else module[len("winattn."):]
                if sub:
                    got = [target(sub)]
                else:
                    got = [target(a.name) for a in node.names]
            elif node.level > 1:
                bad("%s:%d imports from above the package" % (f, node.lineno))
        if id(node) in inner and isinstance(node, (ast.Import, ast.ImportFrom)):
            names = ", ".join(a.name for a in node.names)
            lazy.append("%s:%d %s" % (f, node.lineno, ("from %s%s import %s" % ("." * node.level, node.module or "", names))
                                     if isinstance(node, ast.ImportFrom) else "import " + names))
        for t in got:
            if t != m:
                imports[m].add(t)
circles = cycles(imports)
for c in circles:
    bad("Python import circle among: " + ", ".join(c))
if not circles:
    ok("no import circle in %s (%d modules, %d edges: %s; lazy imports inside functions: %s)" % (
        pkg, len(mods), sum(len(v) for v in imports.values()),
        ", ".join("%s -> %s" % (a, b) for a in sorted(imports) for b in sorted(imports[a])),
        "; ".join(lazy) or "none"))

print("%d passed, %d failed" % (passed, failed))
sys.exit(1 if failed else 0)
EOF
