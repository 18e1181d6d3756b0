"""test_prepare_data.py — train/prepare_data.py on a tokenizer built here: a byte-level BPE trained
on a few sentences, Gemma's special tokens (pad 0, eos 1, bos 2, <start_of_turn>, <end_of_turn>)
and a Gemma-style Jinja chat template that also renders "tools" and enable_thinking. Checks token
ids against the tokenizer called directly; the prompt offsets of prompt/completion and chat records
(the default), the masks --mask-prompt writes and the plain tokens of --no-mask-prompt; the same
against mlx-lm's own datasets when mlx-lm is installed; that `winattn train` refuses the raw
records next to this tokenizer with a command that, run as given, prepares data it trains on, and
counts exactly the targets --mask-prompt leaves; and one-line errors naming file:line that leave
--out as it was. SKIPs without transformers and tokenizers.
Run from the repository root after `make`:
    WINATTN_LIBRARY=build/libwinattn.so PYTHONPATH=python python3 python/tests/test_prepare_data.py
"""
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import case, finish, report, skip  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "train", "prepare_data.py")
FIXTURE = os.path.join(ROOT, "train", "fixtures", "gemma4_smoke")  # vocab 512, above the tokenizer's

TEMPLATE = (
    "{{ bos_token }}{% if enable_thinking %}<|channel>{% endif %}"
    "{% if tools %}<start_of_turn>system\ntools: {% for t in tools %}{{ t['name'] }} {% endfor %}"
    "<end_of_turn>\n{% endif %}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Sliding-window attention keeps each query within a window of keys.",
    "What is the capital of France? Paris is the capital of France.",
    "Write a haiku about autumn leaves falling on a quiet pond.",
]

TRAIN = [  # chat first: the file's kind
    {"messages": [{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": "What is the capital of France?"},
                  {"role": "assistant", "content": "Paris."},
                  {"role": "user", "content": "And of Italy?"},
                  {"role": "assistant", "content": "Rome, the capital of Italy."}]},
    {"messages": [{"role": "user", "content": "Write a haiku."},
                  {"role": "assistant", "content": "Leaves fall on the pond."}],
     "tools": [{"name": "lookup", "description": "finds a word"}]},
    {"messages": [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "the quick fox"}]},
]
VALID = [
    {"prompt": "What is the capital of France?", "completion": "Paris is the capital."},
    {"prompt": "Name a dog.", "completion": "The lazy dog."},
    {"prompt": "Say the window.", "completion": "sliding window", "tools": [{"name": "search"}]},
]
TEST = [{"text": "The quick brown fox jumps."}, {"text": "over the lazy dog<eos>"}, {"text": ""}]


def have_modules():
    missing = [m for m in ("transformers", "tokenizers", "jinja2") if importlib.util.find_spec(m) is None]
    return missing


def build_checkpoint(d):
    """config.json and model.safetensors of the gemma4_smoke fixture, and the tokenizer here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<|channel>", "<channel|>"]
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                       special_tokens=[("<bos>", 2)])
    assert [tok.token_to_id(s) for s in specials[:3]] == [0, 1, 2]
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
                   "pad_token": "<pad>", "unk_token": "<unk>", "chat_template": TEMPLATE}, f)
    for name in ("config.json", "model.safetensors"):
        os.symlink(os.path.join(FIXTURE, name), os.path.join(d, name))


def write_jsonl(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def run_script(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, cwd=ROOT)


def expected(tok, rec, kind):
    """Tokens and prompt offset from the tokenizer directly, as mlx-lm 0.32.2's datasets define them
    (offset None for text, which has no prompt)."""
    extra = {"enable_thinking": True}  # the vocabulary has <|channel> and <channel|>
    if kind == "text":
        ids = tok.encode(rec["text"])
        ids = ids if ids and ids[-1] == tok.eos_token_id else ids + [tok.eos_token_id]
        return ids, None
    if kind == "completion":
        msgs = [{"role": "user", "content": rec["prompt"]}, {"role": "assistant", "content": rec["completion"]}]
        gen = True
    else:
        msgs, gen = rec["messages"], rec["messages"][-1]["role"] == "assistant"
    ids = list(tok.apply_chat_template(msgs, tools=rec.get("tools"), return_dict=False, **extra))
    off = len(tok.apply_chat_template(msgs[:-1], tools=rec.get("tools"), add_generation_prompt=gen,
                                      return_dict=False, **extra))
    return ids, off


def expected_record(tok, rec, kind, mode):
    """The line prepare_data.py writes: mode None (offset), True (--mask-prompt), False."""
    ids, off = expected(tok, rec, kind)
    if off is None or mode is False:
        return {"tokens": ids}
    if mode is None:
        return {"tokens": ids, "offset": off}
    return {"tokens": ids, "mask": [int(i >= off) for i in range(len(ids))]}


def winattn_binary():
    lib = os.environ.get("WINATTN_LIBRARY", os.path.join(ROOT, "build", "libwinattn.so"))
    exe = os.path.join(os.path.dirname(os.path.abspath(lib)), "winattn")
    return exe if os.access(exe, os.X_OK) else None


def main():
    missing = have_modules()
    if missing:
        skip("prepare_data", "needs %s (pip install transformers tokenizers jinja2)" % ", ".join(missing))
        return
    import warnings
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # PyTorch's absence does not matter here
    from transformers import AutoTokenizer

    tmp = tempfile.TemporaryDirectory(prefix="winattn-prepare-data-")
    ck, data, out = (os.path.join(tmp.name, n) for n in ("ck", "data", "out"))
    for d in (ck, data):
        os.mkdir(d)
    build_checkpoint(ck)
    write_jsonl(os.path.join(data, "train.jsonl"), TRAIN)
    write_jsonl(os.path.join(data, "valid.jsonl"), VALID)
    write_jsonl(os.path.join(data, "test.jsonl"), TEST)
    tok = AutoTokenizer.from_pretrained(ck)
    splits = (("train", TRAIN, "chat"), ("valid", VALID, "completion"), ("test", TEST, "text"))

    for mode, flag in ((None, []), (True, ["--mask-prompt"]), (False, ["--no-mask-prompt"])):
        r = run_script("--model", ck, "--data", data, "--out", out, *flag)
        name = "prepare_data folder%s" % (" " + flag[0] if flag else "")
        report(r.returncode == 0 and all(os.path.exists(os.path.join(out, s + ".jsonl")) for s, _, _ in splits),
               name + ": train, valid, test written", r.stderr.strip()[-300:])
        for split, recs, kind in splits:
            @case("%s %s %s" % (name, split, kind))
            def _():
                got = read_jsonl(os.path.join(out, split + ".jsonl"))
                assert len(got) == len(recs), "%d records, expected %d" % (len(got), len(recs))
                for i, (g, rec) in enumerate(zip(got, recs)):
                    want = expected_record(tok, rec, kind, mode)
                    assert g["tokens"] == want["tokens"], "record %d: tokens differ from the tokenizer's" % i
                    assert g == want, "record %d: %s, expected %s" % (
                        i, {k: v for k, v in g.items() if k != "tokens"}, {k: v for k, v in want.items() if k != "tokens"})
                report(True, "%s %s %s" % (name, split, kind), "records=%d tokens=%d" % (
                    len(got), sum(len(g["tokens"]) for g in got)))

    # What the offsets leave as targets, decoded: the completion, or the last message, with its turn's end.
    run_script("--model", ck, "--data", data, "--out", out)

    @case("prepare_data offsets leave the completion and the last message")
    def _():
        def targets(split, i):
            g = read_jsonl(os.path.join(out, split + ".jsonl"))[i]
            return tok.decode(g["tokens"][g["offset"]:])
        checks = [(targets("valid", 0), "Paris is the capital.<end_of_turn>\n"),
                  (targets("train", 0), "Rome, the capital of Italy.<end_of_turn>\n"),
                  (targets("train", 1), "Leaves fall on the pond.<end_of_turn>\n"),
                  (targets("train", 2), "<start_of_turn>user\nthe quick fox<end_of_turn>\n")]
        for got, want in checks:
            assert got == want, "targets %r, expected %r" % (got, want)
        g = read_jsonl(os.path.join(out, "test.jsonl"))
        assert g[1]["tokens"].count(tok.eos_token_id) == 1, "a text ending in EOS got a second one"
        assert g[2]["tokens"] == [tok.bos_token_id, tok.eos_token_id], "empty text: %s" % g[2]["tokens"]
        assert not [n for n in os.listdir(out) if n.endswith(".tmp")], "temporary files left in --out"
        report(True, "prepare_data offsets leave the completion and the last message")

    mlx_lm_check(ck, out)
    trainer_check(ck, data, out, tmp.name)
    error_checks(ck, data, out, tmp.name)
    tmp.cleanup()


def mlx_lm_check(ck, out):
    """The same records through mlx-lm's own datasets (mask_prompt on), where mlx-lm is installed:
    its offsets are the ones written."""
    try:
        from types import SimpleNamespace
        from pathlib import Path
        from mlx_lm.tokenizer_utils import load as load_tokenizer
        from mlx_lm.tuner.datasets import create_dataset
    except Exception as e:  # mlx-lm or mlx missing, or an mlx-lm without these names
        skip("prepare_data against mlx-lm's datasets", "mlx-lm not importable (%s)" % type(e).__name__)
        return

    @case("prepare_data against mlx-lm's datasets")
    def _():
        wrapper = load_tokenizer(Path(ck))
        for split, recs, masked in (("train", TRAIN, True), ("valid", VALID, True), ("test", TEST, False)):
            ds = create_dataset([dict(r) for r in recs], wrapper, SimpleNamespace(mask_prompt=masked))
            got = read_jsonl(os.path.join(out, split + ".jsonl"))
            for i in range(len(recs)):
                ids, off = ds.process(ds[i])
                assert got[i]["tokens"] == list(ids), "%s record %d: tokens differ from mlx-lm's" % (split, i)
                assert got[i].get("offset", 0) == off, "%s record %d: offset %s, mlx-lm's %d" % (
                    split, i, got[i].get("offset"), off)
        report(True, "prepare_data against mlx-lm's datasets", "chat, prompt/completion, text")


RUNS = []


def run_folder(data):
    """a fresh output folder for a training run, beside the data's folder (not inside it: the tests
    compare what the data folders hold)"""
    d = os.path.dirname(os.path.normpath(data if os.path.isdir(data) else os.path.dirname(data)))
    RUNS.append(os.path.join(d, "run%d" % len(RUNS)))
    return RUNS[-1]


def train(exe, ck, data, *flags, evaluate=True):
    """winattn train for one batch of 3 with the held-out loss at the end: (result, the evaluation's
    target count or None)."""
    r = subprocess.run([exe, "train", "--model", ck, "--data", data, "--iters", "1", "--batch-size", "3",
                        "--lora-rank", "4", "--threads", "1", *(["--eval"] if evaluate else []),
                        "--adapter-path", run_folder(data), *flags],
                       capture_output=True, text=True)
    m = re.search(r"^eval after training: held-out loss [0-9.]+ over (\d+) tokens", r.stdout, re.M)
    return r, int(m.group(1)) if m else None


def trainer_check(ck, data, out, tmp):
    exe = winattn_binary()
    if not exe:
        skip("prepare_data output through winattn train", "no winattn beside WINATTN_LIBRARY (run make)")
        return

    # the raw folder next to a tokenizer: one line naming the exact command; run as given, it
    # prepares a folder that trains
    r, _ = train(exe, ck, data)
    err = r.stderr.strip()
    m = re.search(r"prepare them with (python3 train/prepare_data\.py .*?), then train with --data (\S+)", err)
    report(r.returncode != 0 and len(err.splitlines()) == 1 and m is not None and "--model " + ck in err,
           "winattn train refuses raw chat records, naming the prepare command", err[-300:])
    if m:
        cmd = shlex.split(m.group(1))
        p = subprocess.run([sys.executable] + cmd[1:], capture_output=True, text=True, cwd=ROOT)
        prepared = shlex.split(m.group(2))[0]
        r, n = train(exe, ck, prepared)
        want = sum(len(g["tokens"]) - 1 for g in read_jsonl(os.path.join(prepared, "valid.jsonl")))
        report(p.returncode == 0 and r.returncode == 0 and n == want,
               "the named command prepares data winattn train takes", "eval targets=%s expected=%d %s %s" % (
                   n, want, p.stderr.strip()[-200:], r.stderr.strip()[-200:]))

    # one raw file: the command names a .jsonl beside it, which --data then takes
    raw = os.path.join(tmp, "raw")
    os.mkdir(raw)
    write_jsonl(os.path.join(raw, "chat.jsonl"), TRAIN)
    r, _ = train(exe, ck, os.path.join(raw, "chat.jsonl"), evaluate=False)
    m = re.search(r"prepare them with (python3 train/prepare_data\.py .*?), then train with --data (\S+)", r.stderr)
    ok = False
    if m:
        cmd = shlex.split(m.group(1))
        p = subprocess.run([sys.executable] + cmd[1:], capture_output=True, text=True, cwd=ROOT)
        prepared = shlex.split(m.group(2))[0]
        r2, _ = train(exe, ck, prepared, evaluate=False)
        ok = (p.returncode == 0 and prepared == os.path.join(raw, "chat.tokens.jsonl") and r2.returncode == 0 and
              "step 1/1" in r2.stdout)
    report(ok, "one raw file: the named command prepares a file winattn train takes", r.stderr.strip()[-300:])

    # valid.jsonl's 3 records are one batch, so the evaluation counts every target left
    run_script("--model", ck, "--data", data, "--out", out, "--mask-prompt")
    want = sum(sum(g["mask"][1:]) for g in read_jsonl(os.path.join(out, "valid.jsonl")))
    r, n = train(exe, ck, out)
    report(r.returncode == 0 and "step 1/1" in r.stdout and n == want,
           "prepare_data --mask-prompt output through winattn train", "eval targets=%s expected=%d %s" % (
               n, want, r.stderr.strip()[-200:]))

    helptext = subprocess.run([exe, "train", "--help"], capture_output=True, text=True)
    if "--mask-prompt" not in helptext.stdout + helptext.stderr:
        skip("prepare_data offsets under winattn train --mask-prompt", "this winattn train has no --mask-prompt")
        return
    run_script("--model", ck, "--data", data, "--out", out)
    # test.jsonl holds text records, which --mask-prompt refuses (as mlx-lm): train and valid only
    os.unlink(os.path.join(out, "test.jsonl"))
    want = sum(len(g["tokens"]) - g["offset"] for g in read_jsonl(os.path.join(out, "valid.jsonl")))
    r, n = train(exe, ck, out, "--mask-prompt")
    report(r.returncode == 0 and n == want, "prepare_data offsets under winattn train --mask-prompt",
           "eval targets=%s expected=%d %s" % (n, want, r.stderr.strip()[-200:]))


def error_checks(ck, data, out, tmp):
    """In this process (the script's main), to spare a transformers import per case."""
    import contextlib
    import io
    spec = importlib.util.spec_from_file_location("winattn_prepare_data", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    def run_script(*args):  # noqa: F811 (the subprocess one's result, from main in this process)
        so, se = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(so), contextlib.redirect_stderr(se):
            rc = script.main(list(args))
        return subprocess.CompletedProcess(args, rc, so.getvalue(), se.getvalue())

    before = {n: open(os.path.join(out, n)).read() for n in os.listdir(out)}

    def bad(name, lines, where, text):
        d = os.path.join(tmp, "bad-" + name)
        os.mkdir(d)
        with open(os.path.join(d, "train.jsonl"), "w") as f:
            f.write("\n".join(lines) + "\n")
        r = run_script("--model", ck, "--data", d, "--out", out)
        err = r.stderr.strip()
        after = {n: open(os.path.join(out, n)).read() for n in os.listdir(out)}
        ok = (r.returncode != 0 and len(err.splitlines()) == 1 and (os.path.join(d, "train.jsonl") + where) in err
              and text in err and after == before)
        report(ok, "prepare_data refuses %s" % name, err)

    chat = json.dumps(TRAIN[1])
    bad("invalid JSON", [chat, "{not json"], ":2:", "not valid JSON")
    bad("a text record in a chat file", [chat, '{"text": "hello"}'], ":2:", '"messages"')
    bad("a record of no known kind", ['{"input": "x"}'], ":1:", "mlx-lm's formats")
    bad("a message without content", [chat, chat, '{"messages": [{"role": "user"}]}'], ":3:", "messages[0]")
    bad("a non-object record", ["[1, 2]"], ":1:", "JSON object")
    bad("a completion that is not a string", ['{"prompt": "a", "completion": 3}'], ":1:", '"completion"')
    empty = os.path.join(tmp, "empty")
    os.mkdir(empty)
    r = run_script("--model", ck, "--data", empty, "--out", out)
    report(r.returncode != 0 and "no train.jsonl" in r.stderr, "prepare_data refuses a folder without splits",
           r.stderr.strip())
    r = run_script("--model", ck, "--data", os.path.join(data, "valid.jsonl"), "--out", data)
    report(r.returncode != 0 and "replace the input" in r.stderr, "prepare_data refuses --out over its input",
           r.stderr.strip())
    r = run_script("--model", ck, "--data", os.path.join(data, "test.jsonl"), "--out", os.path.join(tmp, "one"))
    report(r.returncode == 0 and os.path.exists(os.path.join(tmp, "one", "test.jsonl")),
           "prepare_data one file into a folder", r.stderr.strip()[-200:])
    dst = os.path.join(tmp, "sub", "valid.tokens.jsonl")
    r = run_script("--model", ck, "--data", os.path.join(data, "valid.jsonl"), "--out", dst)
    report(r.returncode == 0 and os.path.isfile(dst) and len(read_jsonl(dst)) == len(VALID),
           "prepare_data one file into a .jsonl file", r.stderr.strip()[-200:])


if __name__ == "__main__":
    main()
    finish()
